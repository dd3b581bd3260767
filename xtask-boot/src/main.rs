//! `cargo xtask ...` runs this first (the alias in `.cargo/config.toml`).
//!
//! `xtask` depends on the lab crate, which depends on `lb-userspace`, whose
//! build script compiles the XDP program with the nightly's rust-src and
//! bpf-linker. On a fresh machine neither exists yet, so `xtask` itself
//! cannot compile until they are installed. This crate has no such
//! dependency: it installs the two when missing, then replaces itself with
//! `cargo run --package xtask` and the same arguments (exec, so signals and
//! the exit status are xtask's own). `setup` it does itself, whole.
use std::{os::unix::process::CommandExt as _, process::Command};

// The library's dependencies: the binary uses them only through it.
use {anyhow as _, libc as _};
// The library's test dependency.
#[cfg(test)]
use serde_json as _;

fn main() {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    // `setup` is the whole set-up, done here: through `xtask` it would
    // need the workspace to compile first, so a checkout that does not
    // (an unfinished edit) would stop it before the Debian packages.
    if args.len() == 1 && args[0] == "setup" {
        if let Err(e) = xtask_boot::setup() {
            eprintln!("xtask setup: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    if !xtask_boot::toolchain_complete()
        && let Err(e) = xtask_boot::toolchain()
    {
        eprintln!("xtask: installing the toolchain the build needs: {e:#}");
        std::process::exit(1);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // The bench runs a release build of xtask, made with the binaries it
    // runs (see `BENCH_BUILD`). Not for a user who is not root: xtask
    // refuses the bench then, and should not build for minutes first.
    if xtask_boot::is_root() && xtask_boot::is_release_bench(&args) {
        eprintln!("xtask: building the bench's release binaries (xtask among them)");
        let mut build = Command::new(&cargo);
        build.current_dir(xtask_boot::workspace_root()).args(xtask_boot::BENCH_BUILD);
        if let Err(e) = xtask_boot::run(&mut build) {
            eprintln!("xtask: {e:#}");
            std::process::exit(1);
        }
        let xtask = xtask_boot::target_dir().join("release/xtask");
        let e = Command::new(&xtask).args(args).exec();
        eprintln!("xtask: could not run {}: {e}", xtask.display());
        std::process::exit(1);
    }
    let e = Command::new(cargo).args(["run", "--quiet", "--package", "xtask", "--"]).args(args).exec();
    eprintln!("xtask: could not run `cargo run --package xtask`: {e}");
    std::process::exit(1);
}

//! `cargo xtask setup`: install what building and testing need, from what
//! this machine can reach (rustup, crates.io, Debian). Idempotent: each
//! step first checks whether its result is already there.
//!
//! A crate of its own, with no dependency that needs the toolchain it
//! installs: `cargo xtask` runs this crate's binary first, which installs
//! the toolchain when it is missing and only then compiles xtask (see
//! `main.rs`).
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Run a command, inheriting stdio; error if it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// True when the command runs and exits 0 (output discarded).
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// The workspace's root directory (where its Cargo.toml is).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// The workspace's target directory: `CARGO_TARGET_DIR`, taken from the
/// workspace root when relative (xtask runs cargo there), or `target`.
pub fn target_dir() -> PathBuf {
    workspace_root().join(std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| "target".into(), PathBuf::from))
}

/// The release build of `cargo xtask bench`: xtask itself and every binary
/// the bench runs (lb-bench; for the lab the load generator, the backends'
/// server, lbd and lbctl), in one cargo run. The bench's xtask is a release
/// build too, so that a bench from nothing compiles the workspace's
/// dependencies once (release) instead of twice (debug for xtask, then
/// release for the binaries): 3 min 35 s to 4 min 1 s from nothing
/// against about 5 min 20 s on a 2-core VM. The same arguments each
/// time, because cargo unifies a dependency's features over the packages
/// one run selects: a run with fewer packages would build some crates
/// (nix, signal-hook) again.
pub const BENCH_BUILD: &[&str] = &[
    "build",
    "--release",
    "-p",
    "xtask",
    "--bin",
    "xtask",
    "-p",
    "lb-bench",
    "--bin",
    "lb-bench",
    "-p",
    "lb-tests",
    "--bin",
    "lab-client",
    "--bin",
    "lab-backend",
    "-p",
    "lb-userspace",
    "--bin",
    "lbd",
    "--bin",
    "lbctl",
];

/// Whether `args` (after `cargo xtask`) are a bench that runs release
/// binaries: `bench` with or without a part, except the fuzzer (a test
/// run) and help.
pub fn is_release_bench<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> bool {
    args.first().is_some_and(|a| a.as_ref() == "bench")
        && !args.iter().any(|a| matches!(a.as_ref().to_str(), Some("fuzz" | "-h" | "--help" | "help")))
}

/// Debian packages the lab and the tests use.
pub const PACKAGES: &[(&str, &str)] = &[
    // (package, a file it installs: present means installed)
    ("iproute2", "/usr/sbin/ip"),
    ("ethtool", "/usr/sbin/ethtool"),
    ("curl", "/usr/bin/curl"),
    ("bpftool", "/usr/sbin/bpftool"),
    ("systemd", "/usr/bin/systemd-analyze"),
    ("prometheus", "/usr/bin/prometheus"),
    ("tmux", "/usr/bin/tmux"),
    // BIRD 2: lbd's BGP speaker, and the ecmp lab's router.
    ("bird2", "/usr/sbin/bird"),
    // The status page's browser test (headless).
    ("chromium", "/usr/bin/chromium"),
];

pub fn setup() -> anyhow::Result<()> {
    toolchain()?;
    debian(PACKAGES)?;
    Ok(())
}

/// The part of the set-up the workspace needs to compile at all (the XDP
/// program is built by lb-userspace's build script) and the lint tools.
pub fn toolchain() -> anyhow::Result<()> {
    nightly()?;
    bpf_linker()
}

/// True when `toolchain` has nothing to install.
pub fn toolchain_complete() -> bool {
    nightly_has("rust-src") && nightly_has("clippy") && stable_lint_tools() && bpf_linker_works()
}

/// True when nothing is missing (fast check used before demo and test).
pub fn complete() -> bool {
    toolchain_complete() && PACKAGES.iter().all(|(_, f)| Path::new(f).exists())
}

/// Whether the nightly toolchain has `component` (rust-src to build the
/// eBPF crate, clippy to lint it for its target).
fn nightly_has(component: &str) -> bool {
    Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]).output().is_ok_and(
        |o| o.status.success() && String::from_utf8_lossy(&o.stdout).lines().any(|l| l.starts_with(component)),
    )
}

/// `cargo fmt` and `cargo clippy` of the toolchain running us (the test
/// command runs both).
fn stable_lint_tools() -> bool {
    succeeds(Command::new("cargo").args(["fmt", "--version"]))
        && succeeds(Command::new("cargo").args(["clippy", "--version"]))
}

fn nightly() -> anyhow::Result<()> {
    if !succeeds(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        eprintln!("setup: installing the nightly toolchain");
        run(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
    }
    for component in ["rust-src", "clippy"] {
        if !nightly_has(component) {
            eprintln!("setup: adding {component} to the nightly toolchain");
            run(Command::new("rustup").args(["component", "add", component, "--toolchain", "nightly"]))?;
        }
    }
    if !stable_lint_tools() {
        eprintln!("setup: adding rustfmt and clippy to the default toolchain");
        run(Command::new("rustup").args(["component", "add", "rustfmt", "clippy"]))?;
    }
    Ok(())
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cargo"),
        PathBuf::from,
    )
}

fn bpf_linker_works() -> bool {
    succeeds(Command::new("bpf-linker").arg("--version"))
        || succeeds(Command::new(cargo_home().join("bin/bpf-linker")).arg("--version"))
}

/// The nightly's libLLVM: (major version, file name, directory).
fn nightly_llvm() -> anyhow::Result<(String, String, PathBuf)> {
    let out = Command::new("rustc").args(["+nightly", "--print", "sysroot"]).output().context("rustc +nightly")?;
    if !out.status.success() {
        bail!("cannot find the nightly sysroot: {}", String::from_utf8_lossy(&out.stderr));
    }
    let lib = PathBuf::from(String::from_utf8(out.stdout)?.trim()).join("lib");
    for entry in std::fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        // e.g. libLLVM.so.22.1-rust-1.97.0-nightly
        if let Some(rest) = name.strip_prefix("libLLVM.so.")
            && let Some(major) = rest.split('.').next()
            && !major.is_empty()
            && major.chars().all(|c| c.is_ascii_digit())
        {
            return Ok((major.to_owned(), name, lib));
        }
    }
    bail!("no libLLVM.so.<version> in {}", lib.display())
}

fn bpf_linker() -> anyhow::Result<()> {
    if bpf_linker_works() {
        return Ok(());
    }
    // bpf-linker links against the nightly's own libLLVM. Its build looks
    // for LLVM under LLVM_PREFIX/lib, and the binary keeps that path to
    // find the library at run time, so the prefix must last.
    let (major, file, lib) = nightly_llvm()?;
    let prefix = cargo_home().join(format!("lb-llvm-{major}"));
    let plib = prefix.join("lib");
    std::fs::create_dir_all(&plib).with_context(|| format!("creating {}", plib.display()))?;
    for link in [file.as_str(), "libLLVM.so"] {
        let path = plib.join(link);
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink(lib.join(&file), &path)
            .with_context(|| format!("linking {} to {}", path.display(), lib.join(&file).display()))?;
    }
    eprintln!("setup: building bpf-linker 0.13.0 against the nightly's LLVM {major} (a few minutes)");
    run(Command::new("cargo")
        .args(["install", "bpf-linker", "--version", "0.13.0", "--locked", "--no-default-features", "--features"])
        .arg(format!("llvm-{major}"))
        .env("LLVM_PREFIX", &prefix))
    .or_else(|_| {
        // Without --locked, in case the pinned lock file cannot resolve here.
        run(Command::new("cargo")
            .args(["install", "bpf-linker", "--version", "0.13.0", "--no-default-features", "--features"])
            .arg(format!("llvm-{major}"))
            .env("LLVM_PREFIX", &prefix))
    })?;
    if !bpf_linker_works() {
        bail!("bpf-linker was installed but does not run");
    }
    Ok(())
}

pub fn debian(packages: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().filter(|(_, f)| !Path::new(f).exists()).map(|(p, _)| *p).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("installing Debian packages ({}) needs root; run it as root", missing.join(" "));
    }
    eprintln!("setup: installing Debian packages: {}", missing.join(" "));
    let install = |cmd: &mut Command| {
        run(cmd
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing))
    };
    if install(&mut Command::new("apt-get")).is_err() {
        run(Command::new("apt-get").arg("update").env("DEBIAN_FRONTEND", "noninteractive"))?;
        install(&mut Command::new("apt-get"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, process::Command};

    /// The benches that run release binaries take the release path; the
    /// fuzzer (a test run), help and every other command do not.
    #[test]
    fn which_commands_run_a_release_xtask() {
        for args in [&["bench"][..], &["bench", "packet"], &["bench", "--full"], &["bench", "e2e", "--full"]] {
            assert!(super::is_release_bench(args), "{args:?}");
        }
        for args in [&["bench", "fuzz"][..], &["bench", "--help"], &["bench", "-h"], &["test"], &["demo"], &[]] {
            assert!(!super::is_release_bench(args), "{args:?}");
        }
    }

    /// What `cargo xtask` compiles first must not need what it installs:
    /// no crate of this workspace but itself (lb-userspace's build script
    /// needs the nightly's rust-src and bpf-linker, and the others depend
    /// on it) among its normal and build dependencies, however deep.
    #[test]
    fn the_launcher_builds_without_the_toolchain_it_installs() {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let out = Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--manifest-path"])
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml"))
            .output()
            .expect("running cargo metadata");
        assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
        let m: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
        let members: BTreeSet<&str> =
            m["workspace_members"].as_array().expect("workspace_members").iter().filter_map(|v| v.as_str()).collect();
        let nodes = m["resolve"]["nodes"].as_array().expect("resolve.nodes");
        let node = |id: &str| nodes.iter().find(|n| n["id"].as_str() == Some(id)).expect("a resolved package");
        let name = |id: &str| {
            let p = m["packages"].as_array().expect("packages").iter().find(|p| p["id"].as_str() == Some(id));
            p.and_then(|p| p["name"].as_str()).unwrap_or(id).to_owned()
        };
        let root = members.iter().copied().find(|id| name(id) == "xtask-boot").expect("xtask-boot is a member");
        let (mut seen, mut todo) = (BTreeSet::new(), vec![root]);
        while let Some(id) = todo.pop() {
            if !seen.insert(id) {
                continue;
            }
            for dep in node(id)["deps"].as_array().into_iter().flatten() {
                // Dev dependencies are built for tests only, not by `cargo xtask`.
                let kinds = dep["dep_kinds"].as_array().into_iter().flatten();
                if kinds.clone().count() == 0 || kinds.into_iter().any(|k| k["kind"].as_str() != Some("dev")) {
                    todo.push(dep["pkg"].as_str().expect("a dependency's id"));
                }
            }
        }
        let ours: Vec<String> =
            seen.iter().filter(|id| members.contains(**id) && **id != root).map(|id| name(id)).collect();
        assert!(ours.is_empty(), "xtask-boot depends on workspace crates: {ours:?}");
        assert!(seen.len() > 1, "the walk found no dependency at all: {seen:?}");
    }
}

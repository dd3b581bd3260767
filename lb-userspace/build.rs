//! Builds the XDP program (`lb-ebpf`) for `bpfel-unknown-none` with the
//! nightly toolchain and bpf-linker, and leaves the objects (every bin of
//! lb-ebpf) in OUT_DIR, where `dataplane.rs` embeds `lb-xdp` and the
//! benchmark programs `bench-floor` (used by the `lb-bench` crate).
//!
//! This does what `aya_build::build_ebpf` does, plus `-C target-cpu=v3`:
//! aya-build sets the BPF rustflags itself and offers no way to add one, and
//! the datapath needs BPF v3 for atomic fetch-and-add (one round-robin
//! counter shared by all CPUs). Every kernel with BPF_PROG_TEST_RUN for XDP
//! and bpf_fib_lookup (5.x) runs v3 programs.
use std::{env, path::PathBuf, process::Command};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.parent().expect("workspace root").to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    for dir in ["lb-ebpf/src", "lb-ebpf/Cargo.toml", "lb-common/src", "lb-common/Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }
    println!("cargo:rerun-if-env-changed=PATH");

    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("CARGO_CFG_TARGET_ARCH");
    let flags = [
        format!("--cfg=bpf_target_arch=\"{arch}\""),
        "-Cdebuginfo=2".to_owned(),
        "-Clink-arg=--btf".to_owned(),
        "-Ctarget-cpu=v3".to_owned(),
    ]
    .join("\x1f");
    // A target dir of its own (cargo holds a lock on ours while we run),
    // shared by every profile of this workspace: OUT_DIR is
    // <target>/<profile>/build/<pkg>-<hash>/out, and the XDP program is
    // always built the same way (release, for BPF), so a release build
    // after a dev build (the benchmark's, after the tests') reuses the
    // objects instead of building them again (about 35 s on 2 cores).
    let target_dir = out_dir.ancestors().nth(4).expect("OUT_DIR is <target>/<profile>/build/<pkg>/out").join("ebpf");
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", "build", "--package", "lb-ebpf", "--bins", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core", "--target-dir"])
        .arg(&target_dir)
        .current_dir(&workspace)
        .env("CARGO_ENCODED_RUSTFLAGS", flags);
    // Make sure the nightly toolchain, not the one running us, does the work.
    for key in [
        "RUSTC",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "CARGO",
        "RUSTUP_TOOLCHAIN",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
    ] {
        cmd.env_remove(key);
    }
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("could not run `rustup run nightly cargo` to build the XDP program: {e}; run `cargo xtask setup`")
    });
    if !status.success() {
        panic!(
            "building the XDP program (lb-ebpf) failed: {status}. Missing nightly rust-src or bpf-linker? `cargo xtask setup` installs them."
        );
    }
    // Every bin of lb-ebpf (the datapath `lb-xdp`, the benchmark programs):
    // the built objects are the files without an extension (not `*.d`).
    let release = target_dir.join("bpfel-unknown-none/release");
    let entries = std::fs::read_dir(&release).unwrap_or_else(|e| panic!("read {}: {e}", release.display()));
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.contains('.') || name.starts_with("lib") || !entry.path().is_file() {
            continue;
        }
        std::fs::copy(entry.path(), out_dir.join(&name))
            .unwrap_or_else(|e| panic!("copy {} to OUT_DIR: {e}", entry.path().display()));
    }
    if !out_dir.join("lb-xdp").is_file() {
        panic!("the XDP program lb-xdp was not built in {}", release.display());
    }
}

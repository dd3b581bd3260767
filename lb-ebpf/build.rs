//! The BPF build needs the `bpf-linker` binary, which cargo cannot declare.
//! Rebuild when the linker found on PATH changes (installed or upgraded by
//! `cargo xtask setup`).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}

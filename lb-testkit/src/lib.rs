//! Test frames for the load balancer's datapath, shared by the packet
//! fixtures (`tests/tests/datapath.rs`) and the benchmark (`lb-bench`).
//!
//! [`frame`] builds Ethernet + IPv4 + TCP/UDP frames from scratch and parses
//! them back. Headers are written and checksums computed and verified by the
//! `etherparse` crate, not by code of ours, so a datapath output that matches
//! a frame built here has checksums a second implementation agrees with.
//!
//! [`sysctl`] changes a kernel setting for a benchmark's run and puts it
//! back, also after a kill. [`xdp_ctx`] is the context both hand to
//! `BPF_PROG_TEST_RUN`; [`cpu_model`] names the machine in their reports.
pub mod frame;
pub mod frame6;
pub mod sysctl;

pub use frame::{Frame, L4Checksum, ParseError, Proto};
pub use frame6::Frame6;

/// The `xdp_md` context of a BPF_PROG_TEST_RUN: a frame of `len` bytes
/// (`data_end`) received on `ifindex` (`ingress_ifindex`).
pub fn xdp_ctx(len: usize, ifindex: u32) -> [u8; 24] {
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(len as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

/// The CPU's model name from `/proc/cpuinfo`, for a benchmark's report:
/// floor multiples depend on the CPU (its return thunks, its memory) as
/// much as on the code. None where the kernel gives none.
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_owned())
}

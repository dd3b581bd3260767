//! Test frames for the load balancer's datapath, shared by the packet
//! fixtures (`tests/tests/datapath.rs`) and the benchmark (`lb-bench`).
//!
//! [`frame`] builds Ethernet + IPv4 + TCP/UDP frames from scratch and parses
//! them back. Headers are written and checksums computed and verified by the
//! `etherparse` crate, not by code of ours, so a datapath output that matches
//! a frame built here has checksums a second implementation agrees with.
//!
//! [`sysctl`] changes a kernel setting for a benchmark's run and puts it
//! back, also after a kill.
pub mod frame;
pub mod frame6;
pub mod sysctl;

pub use frame::{Frame, L4Checksum, ParseError, Proto};
pub use frame6::Frame6;

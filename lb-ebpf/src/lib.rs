//! Pieces shared by the BPF programs of this crate (the balancer in
//! `main.rs`, the benchmark harness in `bin/bench-floor.rs`). The programs
//! themselves are built for `bpfel-unknown-none` by `lb-userspace/build.rs`.
#![no_std]
#![expect(
    unused_crate_dependencies,
    reason = "the dependencies serve the programs (bins); the library holds only the checksum helpers"
)]

pub mod csum;

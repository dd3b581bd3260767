//! Pieces shared by the BPF programs of this crate (the balancer in
//! `main.rs`, the benchmark harness in `bin/bench-floor.rs`). The programs
//! themselves are built for `bpfel-unknown-none` by `lb-userspace/build.rs`.
#![no_std]

pub mod csum;

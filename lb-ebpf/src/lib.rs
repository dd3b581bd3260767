//! Host-side stub. The XDP program lives in `main.rs` and is built for
//! `bpfel-unknown-none` by `lb-userspace/build.rs`.
#![no_std]

//! The datapath fuzzer (`lb_tests::fuzz`) at a test-suite count: random
//! frames and mutations of valid client, reply, ICMP, ARP, IPv6 and VLAN
//! frames through the real XDP program (BPF_PROG_TEST_RUN), every result
//! judged by a checker independent of the datapath's parser.
//!
//! `LB_FUZZ_COUNT` packets (default 100,000), `LB_FUZZ_SEED` (default
//! random, printed) repeats a run, `LB_FUZZ_REPLAY=a:HEX` runs one frame.
//! `cargo xtask bench fuzz` runs this test with 1,000,000 packets. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use lb_tests::{fixture::in_netns, fuzz};

const DEFAULT_COUNT: u64 = 100_000;

#[test]
fn random_and_mutated_packets_are_passed_untouched_dropped_or_rewritten_exactly() {
    let opts = fuzz::Options::from_env(DEFAULT_COUNT);
    println!("fuzz: {} packets, seed {} (LB_FUZZ_SEED)", opts.count, opts.seed);
    let summary = in_netns(move || fuzz::run(&opts));
    print!("{}", summary.report());
    summary.assert_no_rule_broken();
    // Each outcome at least 1% of the packets.
    summary.assert_exercised(10);
}

//! `cargo xtask bench fuzz [--full]`: the datapath fuzzer (`lb_tests::fuzz`,
//! run by `tests/tests/fuzz.rs`) at full count: 1,000,000 random and mutated
//! packets (10,000,000 with `--full`) through BPF_PROG_TEST_RUN, each judged
//! by a checker independent of the datapath's parser. The test prints the
//! packets per action and outcome and the rate, and fails on any broken
//! rule; `LB_FUZZ_SEED` repeats a run.
use crate::{cargo, run};

pub(crate) fn fuzz(full: bool) -> anyhow::Result<()> {
    let count: u64 = if full { 10_000_000 } else { 1_000_000 };
    println!("== datapath fuzzer: {count} packets through BPF_PROG_TEST_RUN ==");
    run(cargo()
        .args(["test", "-p", "lb-tests", "--test", "fuzz", "--", "--nocapture"])
        .env("LB_FUZZ_COUNT", count.to_string()))
}

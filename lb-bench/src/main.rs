//! `lb-bench packet`: what one packet costs in the XDP program, measured
//! with BPF_PROG_TEST_RUN and a large repeat count.
//!
//! Method (run as root):
//!
//! - A private network namespace, the measuring thread's own (unnamed, so
//!   it goes with the process however it ends), with a veth pair
//!   `gwa`/`gwb`, routes and static neighbours for the client and three
//!   backends, so that `bpf_fib_lookup` succeeds and a
//!   VIP packet takes the full path up to XDP_REDIRECT. The measuring thread
//!   is pinned to one CPU.
//! - The datapath is loaded as lbd loads it (`Dataplane::load_unpinned`,
//!   flow table for 4M connections) with one VIP port per scheduler.
//! - With `repeat N` the kernel runs all N repeats on one buffer without
//!   restoring it: a rewriting program would see its own output from the
//!   second repeat on. So every case runs through `bench_harness` (lb-ebpf
//!   `src/bin/bench-floor.rs`), which copies the original frame back,
//!   optionally makes it a new flow (fresh source address and port), drains
//!   the store buffer (so the program's loads do not stall on the
//!   restore's stores, a cost only the harness causes), and tail-calls the
//!   program under test. The harness's own cost is measured the same way
//!   with `floor_pass` behind it and subtracted:
//!   `cost = t(harness -> program) - (t(harness -> floor_pass) - t(floor_pass))`,
//!   i.e. what a direct run of the program on a fresh packet costs, the
//!   test loop's own overhead included (as in the floors). A case whose
//!   frame the program passes untouched (not a VIP, in either family) needs no
//!   restoring and runs directly, as the floors do.
//! - Before timing, every case is run once and its return value and output
//!   frame are checked byte for byte; after timing, the last repeat's
//!   output is checked again and the datapath's counters must show that
//!   every repeat took the intended path (N new flows, or none; N packets
//!   forwarded; no drop or FIB fallback).
//! - Rounds are interleaved (round 1 of every case, then round 2, ...);
//!   median and min-max over rounds are reported. One discarded warm-up
//!   round comes first. The flow table is emptied before every run of the
//!   datapath, so new flows always insert into a table with room.
//! - Time per packet is the kernel's own figure: the mean per repeat over
//!   the timed loop, which excludes the syscall's setup (with `repeat > 1`
//!   the kernel installs the program in the XDP dispatcher and removes it
//!   afterwards, two RCU grace periods, ~15 ms on this kind of VM: wall
//!   time would carry 15 ns per packet of it at a million repeats). The
//!   kernel truncates the mean to whole ns; we use it + 0.5 ns.
//! - `kernel.bpf_stats_enabled` makes every run read the clock twice (tens
//!   of ns in a VM): lb-bench turns it off for its run and restores it
//!   afterwards, unless `--keep-bpf-stats`.
//!
//! Modules: `netns` (the namespace, the thread's place in it), `cases` (what
//! is measured; frames from `lb-testkit`), `measure` (runs and checks),
//! `memory` (one random load in memory of the flow table's size, timed from
//! userspace on the same CPU), `cold` (single runs after the caches are
//! evicted), `report` (figures, table, JSON). Signals are caught with `signal-hook`.
//! The benchmark programs come from lb-userspace's build script
//! (`lb_userspace::dataplane::BENCH_OBJECT`).
mod cases;
mod cold;
mod measure;
mod memory;
mod netns;
mod report;

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::{Context as _, ensure};
use clap::{Args, Parser, Subcommand};
use serde_json::Value;

use crate::{
    cases::{CONNTRACK_MAX, FILL, Item, Prog, full, is_ipv6, items, new_flow_case},
    measure::{Bench, NoRoom, Sample},
    netns::{pin_thread, private_netns},
    report::{HostInfo, read_trim, report},
};

#[derive(Parser)]
#[command(name = "lb-bench", about = "Benchmarks of the load balancer's datapath")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Per-packet cost of the XDP program through BPF_PROG_TEST_RUN (needs root).
    Packet(PacketArgs),
}

#[derive(Args, Clone)]
pub struct PacketArgs {
    /// Measured rounds (interleaved across cases; median and min-max reported).
    #[arg(long, default_value_t = 7)]
    pub rounds: u32,
    /// Repeats per BPF_PROG_TEST_RUN call.
    #[arg(long, default_value_t = 1_000_000)]
    pub repeat: u32,
    /// Repeats per call of a new-flow case (default: half of --repeat, at
    /// least 1,000). A new flow costs about ten times an established one,
    /// so its run is still several times longer than theirs, and the
    /// rounds' time is mostly new-flow runs and taking their flows out.
    #[arg(long)]
    pub new_flow_repeat: Option<u32>,
    /// Write every round of every case, medians and ratios to this file.
    #[arg(long, value_name = "OUT.json")]
    pub json: Option<PathBuf>,
    /// CPU to pin the measuring thread to (default: the last one allowed).
    #[arg(long)]
    pub cpu: Option<usize>,
    /// Leave kernel.bpf_stats_enabled as it is (by default it is turned off
    /// for the run: with it every run reads the clock twice more).
    #[arg(long)]
    pub keep_bpf_stats: bool,
    /// Measure only these cases (comma-separated keys, e.g.
    /// `tcp_established,non_vip`); the floors, the flow table alone and the
    /// harness are always measured. Keys: tcp_established, tcp_established_one_arm, tcp_reply, new_maglev, new_wrr, new_rr,
    /// new_source_hash, new_least_conn, new_shared, udp_established, tcp6_established, tcp6_reply,
    /// new_maglev6, ipv6, non_vip.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Flow table size in connections. Default 4M, or more when --repeat
    /// and --fill need it: a new-flow run must never find the table full.
    #[arg(long)]
    pub conntrack_max: Option<u32>,
    /// Flows put in the table before the "full table" variant of every
    /// datapath case (0: measure with an empty table only).
    #[arg(long, default_value_t = FILL)]
    pub fill: u32,
    /// Single runs per case with cold caches (an established flow, a new
    /// flow, a packet not to a VIP, each beside its base; 0: none).
    #[arg(long, default_value_t = 300)]
    pub cold_runs: usize,
    /// A time budget for each depth's cold runs, in seconds (0: none): past
    /// it, no more runs are made once every pair has made
    /// `cold::MIN_RUNS`. The report gives the runs made.
    #[arg(long, default_value_t = 0)]
    pub cold_seconds: u64,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Packet(args) => packet(args),
    };
    if let Err(e) = result {
        eprintln!("lb-bench: {e:#}");
        std::process::exit(1);
    }
}

const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl PacketArgs {
    /// The repeats of a new-flow case's run.
    pub(crate) fn new_flow_repeat(&self) -> u32 {
        self.new_flow_repeat.unwrap_or((self.repeat / 2).max(1000)).min(self.repeat)
    }

    /// The repeats of `item`'s run in a measured round.
    fn repeat_of(&self, item: &Item) -> u32 {
        if new_flow_case(item) { self.new_flow_repeat() } else { self.repeat }
    }
}

/// Flow table size: 4M connections, more when the fill and one run make
/// more entries (a new flow of a service with shared endpoints takes two),
/// so that no insert ever finds the table full (it would then measure the
/// stateless path).
fn conntrack_max(args: &PacketArgs) -> anyhow::Result<u32> {
    let need = args.fill.saturating_add(args.repeat.saturating_mul(2)).saturating_add(16);
    match args.conntrack_max {
        Some(n) => {
            ensure!(n >= need, "--conntrack-max {n}: a run of {} new flows needs at least {need}", args.repeat);
            Ok(n)
        }
        None => Ok(CONNTRACK_MAX.max(need.saturating_add(1024).next_power_of_two())),
    }
}

fn packet(args: PacketArgs) -> anyhow::Result<()> {
    ensure!(lb_userspace::is_root(), "lb-bench packet needs root (BPF programs, network namespaces)");
    ensure!(args.rounds >= 1, "--rounds must be at least 1");
    ensure!((1..=1 << 25).contains(&args.repeat), "--repeat must be between 1 and 2^25");
    ensure!(args.new_flow_repeat != Some(0), "--new-flow-repeat must be at least 1");
    conntrack_max(&args)?;
    // The first SIGINT/SIGTERM asks the measuring thread to stop between
    // runs; a second one ends the process at once (a run can take seconds
    // inside the kernel), after putting back the sysctl this run changed.
    // The namespace needs nothing: it is the measuring thread's own and
    // goes with the process.
    let stop = Arc::new(AtomicBool::new(false));
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])
        .context("installing the signal handlers")?;
    let flag = Arc::clone(&stop);
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for (n, sig) in signals.forever().enumerate() {
            if n == 0 {
                flag.store(true, Ordering::Relaxed);
                eprintln!("\nlb-bench: signal {sig}, stopping after this run (again to stop at once)");
                continue;
            }
            if let Err(e) = lb_testkit::sysctl::restore_saved() {
                eprintln!("lb-bench: restoring the sysctls this run changed: {e}");
            }
            std::process::exit(128 + sig);
        }
    })?;
    // Put back what a killed run left changed, then look.
    lb_testkit::sysctl::restore_saved().context("restoring sysctls a killed run left changed")?;
    let stats_before = read_trim(BPF_STATS_SYSCTL);
    // Restored on drop, and by the next run or `cargo xtask lab down --all`
    // if this one is killed.
    let _stats_guard = if stats_before != "0" && !args.keep_bpf_stats {
        let g = lb_testkit::sysctl::Sysctl::set("kernel.bpf_stats_enabled", "0")
            .context("turning kernel.bpf_stats_enabled off")?;
        eprintln!("kernel.bpf_stats_enabled was {stats_before}: off for this run, restored afterwards");
        Some(g)
    } else {
        None
    };
    let host = HostInfo {
        bpf_stats_before: stats_before,
        bpf_stats_during: read_trim(BPF_STATS_SYSCTL),
        bpf_jit_enable: read_trim("/proc/sys/net/core/bpf_jit_enable"),
    };
    if host.bpf_stats_during != "0" {
        eprintln!(
            "warning: kernel.bpf_stats_enabled={}: every run also pays for reading the clock twice",
            host.bpf_stats_during
        );
    }
    let a = args.clone();
    let worker = std::thread::Builder::new()
        .name("lb-bench".into())
        .spawn(move || -> anyhow::Result<Value> { measure_all(&a, &host, stop) })?;
    let result = worker.join();
    let report = match result {
        Ok(r) => r?,
        Err(p) => std::panic::resume_unwind(p),
    };
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("raw numbers: {}", path.display());
    }
    Ok(())
}

/// The cold-cache runs (see `cold`) of the measured cases among an
/// established flow, a maglev new flow and a packet not to a VIP (empty
/// table), each against its base, at each depth of eviction; printed, and
/// returned for the JSON. `out` holds the rounds' figures, for the warm
/// ones beside; `tx` is the run's XDP_TX floor.
fn cold_caches(b: &mut Bench, items: &[Item], args: &PacketArgs, out: &Value, tx: f64) -> anyhow::Result<Value> {
    const PAIRS: [(&str, &str); 3] =
        [("tcp_established", "harness_restore"), ("new_maglev", "harness_new"), ("non_vip", "floor_pass")];
    let find = |key: &str| items.iter().find(|i| i.key == key && i.fill == 0);
    let pairs: Vec<_> = PAIRS.iter().filter_map(|&(c, base)| Some((find(c)?, find(base)?))).collect();
    if args.cold_runs == 0 || pairs.is_empty() {
        return Ok(Value::Null);
    }
    let pass = report::case_median(out, "floor_pass").context("the XDP_PASS floor's median")?;
    let mut levels = Vec::new();
    for depth in [cold::Depth::Private, cold::Depth::All] {
        let Some(ev) = cold::Evictor::new(b.cpu(), depth) else {
            println!(
                "cold caches, {}: sysfs lists no cache of that kind for CPU {}; not measured",
                depth.name(),
                b.cpu()
            );
            continue;
        };
        let t0 = std::time::Instant::now();
        let budget = (args.cold_seconds > 0).then(|| std::time::Duration::from_secs(args.cold_seconds));
        let colds = cold::measure(b, &ev, &pairs, args.cold_runs, budget)?;
        let runs = colds.first().map_or(0, |c| c.case_ns.len());
        println!(
            "cold caches, {}: single runs, each after reading {} KB on the measuring CPU, {runs} of each case alternating with its base ({:.1} s{}):",
            depth.name(),
            ev.bytes() >> 10,
            t0.elapsed().as_secs_f64(),
            if runs < args.cold_runs {
                format!("; {} asked, the {} s budget reached", args.cold_runs, args.cold_seconds)
            } else {
                String::new()
            }
        );
        let mut cases = Vec::new();
        for c in &colds {
            let (median, p10, p90) = report::spread(&c.case_ns);
            let (base_median, base_p10, base_p90) = report::spread(&c.base_ns);
            let over = median - base_median;
            // The same difference in the rounds: the case's cost (the
            // harness already taken out) over the XDP_PASS floor.
            let warm_over = report::case_median(out, c.case.key).map(|w| w - pass);
            println!(
                "  - {}: {median:.1} ns (p10-p90 {p10:.1}-{p90:.1}), its base ({}) {base_median:.1} ns: {over:.1} ns over it = {:.1}x floor_tx{}",
                c.case.label,
                c.base.label,
                over / tx,
                warm_over.map_or_else(String::new, |w| format!(
                    "; warm, in the rounds, {w:.1} ns over floor_pass ({:.1}x that)",
                    over / w
                ))
            );
            cases.push(serde_json::json!({
                "key": c.case.key,
                "name": c.case.label,
                "base_key": c.base.key,
                "base_name": c.base.label,
                "median_ns": median,
                "p10_ns": p10,
                "p90_ns": p90,
                "base_median_ns": base_median,
                "base_p10_ns": base_p10,
                "base_p90_ns": base_p90,
                "over_base_ns": over,
                "over_base_x_floor_tx": over / tx,
                "warm_over_floor_pass_ns": warm_over,
                "runs_ns": c.case_ns,
                "base_runs_ns": c.base_ns,
            }));
        }
        levels.push(serde_json::json!({
            "depth": depth.key(),
            "name": depth.name(),
            "evict_bytes": ev.bytes(),
            "runs": runs,
            "runs_asked": args.cold_runs,
            "seconds": t0.elapsed().as_secs_f64(),
            "cases": cases,
        }));
    }
    Ok(Value::Array(levels))
}

/// The measuring thread: makes its namespace, pins itself, runs every round.
fn measure_all(args: &PacketArgs, host: &HostInfo, stop: Arc<AtomicBool>) -> anyhow::Result<Value> {
    private_netns().context("setting up the benchmark's network namespace")?;
    let cpu = pin_thread(args.cpu)?;
    let mut b = Bench::new(cpu, conntrack_max(args)?, stop)?;
    b.self_test()?;
    let mut items = items();
    if !args.only.is_empty() {
        for k in &args.only {
            ensure!(items.iter().any(|i| i.prog == Prog::Lb && i.key == k), "--only: no case {k}");
        }
        items.retain(|i| i.prog != Prog::Lb || args.only.iter().any(|k| k == i.key));
    }
    if args.fill > 0 {
        let twins: Vec<_> = items
            .iter()
            // The IPv6 cases too (their table is filled with IPv6 flows);
            // the table-alone programs' keys are IPv4.
            .filter(|i| i.prog == Prog::Lb || (i.prog.table_alone() && !is_ipv6(&i.frame)))
            .map(|i| full(i, args.fill))
            .collect();
        items.extend(twins);
    }
    eprintln!(
        "lb-bench packet: {} cases, {} rounds (+1 warm-up) of {} repeats ({} for a new flow), pinned to CPU {cpu}",
        items.len(),
        args.rounds,
        args.repeat,
        args.new_flow_repeat()
    );
    let warm = (args.repeat / 10).max(1000).min(args.repeat);
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); items.len()];
    // Runs made again because a few new flows found no slot (`NoRoom`).
    let mut reruns: Vec<Value> = Vec::new();
    for round in 0..=args.rounds {
        for (i, item) in items.iter().enumerate() {
            let repeat = if round == 0 { warm } else { args.repeat_of(item) };
            let s = match b.measure(item, repeat).map_err(anyhow::Error::downcast::<NoRoom>) {
                Err(Ok(no_room)) => {
                    eprintln!("\nround {round}: {no_room}; run again");
                    reruns.push(serde_json::json!({
                        "round": round,
                        "key": item.key,
                        "label": no_room.label,
                        "dropped": no_room.dropped,
                        "repeat": no_room.repeat,
                    }));
                    b.measure(item, repeat)
                }
                Err(Err(e)) => Err(e),
                Ok(s) => Ok(s),
            }
            .with_context(|| format!("round {round}, {}", item.label))?;
            if round > 0 {
                samples[i].push(s);
            }
        }
        if round > 0 {
            eprint!("\rround {round}/{} done", args.rounds);
        }
    }
    eprintln!();
    let mut out = report(&items, &samples, args, cpu, host, b.conntrack_max);
    out["reruns"] = Value::Array(reruns);
    // The least a new flow waits for on this machine: its slot, one random
    // load in memory the size of the IPv4 flow table.
    let bytes = lb_common::flow_slots(b.conntrack_max) as usize * size_of::<lb_common::FlowSlot>();
    let mem = memory::random_load(bytes, args.rounds.max(3) as usize)?;
    let tx = report::case_median(&out, "floor_tx").context("the XDP_TX floor's median")?;
    let small = report::median(&mem.small_pages_ns);
    let huge = mem.huge_pages_ns.as_deref().map(report::median);
    println!(
        "memory: one random load in {:.1} MB (the IPv4 flow table's size), 4 KB pages as the kernel's BPF arrays: {small:.1} ns = {:.1}x floor_tx{}",
        bytes as f64 / f64::from(1u32 << 20),
        small / tx,
        huge.map_or_else(
            || "; no huge pages to compare".to_owned(),
            |h| format!("; with 2 MB pages {h:.1} ns = {:.1}x", h / tx)
        )
    );
    out["memory"] = serde_json::json!({
        "bytes": bytes,
        "random_load_ns": mem.small_pages_ns,
        "random_load_median_ns": small,
        "random_load_x_floor_tx": small / tx,
        "random_load_huge_pages_ns": mem.huge_pages_ns,
        "random_load_huge_pages_median_ns": huge,
        "random_load_huge_pages_x_floor_tx": huge.map(|h| h / tx),
    });
    out["cold"] = cold_caches(&mut b, &items, args, &out, tx)?;
    let (arrays, in_vmalloc) = b.split_arrays;
    println!(
        "floor_split: {arrays} arrays of {} KB, {}",
        (measure::SPLIT_SLOTS as usize * size_of::<measure::SplitSlot>()).div_ceil(1024),
        if in_vmalloc == 0 {
            "all allocated in the kernel's linear map (huge pages)".to_owned()
        } else {
            format!(
                "{in_vmalloc} of them allocated with vmalloc after all (4 KB pages): its figures are not all huge pages"
            )
        }
    );
    out["split_arrays"] = serde_json::json!({ "arrays": arrays, "in_vmalloc": in_vmalloc });
    let wc = b.weight_changes(11)?;
    let mut ms = wc.ms.clone();
    ms.sort_by(f64::total_cmp);
    let median = ms[ms.len() / 2];
    let verdict = if median < 10.0 && wc.lost == 0 { "met" } else { "missed" };
    println!(
        "control: weight change on a 65,537-entry Maglev table live in {median:.2} ms median ({:.2}-{:.2}; target under 10 ms), \
{} of {} new-flow packets sent around the changes lost ({} of them while an apply ran; target 0): {verdict}",
        ms[0],
        ms[ms.len() - 1],
        wc.lost,
        wc.packets,
        wc.during_apply
    );
    out["control"] = serde_json::json!({
        "weight_change_ms": wc.ms,
        "weight_change_median_ms": median,
        "target_ms": 10.0,
        "packets_during_changes": wc.packets,
        "packets_lost_during_changes": wc.lost,
        "packets_while_applying": wc.during_apply,
        "apply_cpu": wc.apply_cpu,
        "packet_cpu": cpu,
        "verdict": verdict,
    });
    // New flows on two CPUs at once (the datapath, then the table alone),
    // on a machine with more than one.
    let mut scaling = Vec::new();
    if b.has_another_cpu() {
        for key in ["new_maglev", "split_new"] {
            let sc = b.new_flows_on_two_cpus(key, args.rounds.max(3) as usize, args.new_flow_repeat())?;
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            let one = report::median(&sc.one);
            let both = report::median(&sc.both.iter().map(|r| mean(r)).collect::<Vec<_>>());
            println!(
                "two CPUs: {key} on CPUs {:?} at once: {both:.1} ns per packet on each (median of rounds), {:.2}x one CPU alone ({one:.1} ns) in the same rounds",
                sc.cpus,
                both / one
            );
            scaling.push(serde_json::json!({
                "key": key,
                "cpus": sc.cpus,
                "one_cpu_ns": sc.one,
                "two_cpus_ns": sc.both,
                "one_cpu_median_ns": one,
                "two_cpus_median_ns": both,
                "ratio": both / one,
                "reruns": sc.reruns.iter().map(|&(round, lost)| serde_json::json!({"round": round, "lost": lost})).collect::<Vec<_>>(),
            }));
        }
    }
    out["two_cpus"] = Value::Array(scaling);
    let n = args.fill.max(1_000_000);
    let c = b.sweep_cost(n)?;
    println!(
        "sweeper: {} IPv4 flows read in {:.0} ms (nothing idle), read and expired in {:.0} ms (everything idle; removed in the kernel by lb_sweep), in parts of at most {:.1} ms; baseline, emptied without batching (a batched read, then an lb_sweep run per flow): {:.0} ms",
        c.flows, c.read_ms, c.expire_ms, c.longest_part_ms, c.syscalls_ms
    );
    out["sweeper"] = serde_json::json!({
        "flows": c.flows,
        "read_ms": c.read_ms,
        "read_and_expire_ms": c.expire_ms,
        "read_and_remove_by_syscalls_ms": c.syscalls_ms,
        "longest_part_ms": c.longest_part_ms,
    });
    Ok(out)
}

//! The measurement: the datapath loaded as lbd loads it, the benchmark
//! programs (`bench-floor`, embedded by lb-userspace's build script) beside
//! it, and one checked BPF_PROG_TEST_RUN per case and round. aya runs the
//! programs and reads the maps; every output frame is parsed and its
//! checksums verified by `lb-testkit` (the `etherparse` crate) and compared
//! byte for byte with a frame built from scratch. The flow table is emptied
//! with `Dataplane::flush_flows` (batched: deleting millions of entries one
//! by one would take longer than the measurement).
use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    os::fd::AsFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray, ProgramArray},
    programs::{ProgramFd, TestRun as _, TestRunOptions, Xdp},
};
use lb_common::{FLOW_ESTABLISHED, FLOW_REPLIED, FlowKey, FlowKey6};
use lb_testkit::{Frame, Frame6, xdp_ctx};
use lb_userspace::{
    config::{Config, XdpMode},
    dataplane::{BENCH_OBJECT, Dataplane, delete_flow_keys, drain_flow_map, words6},
};

use crate::{
    cases::{
        BACKENDS, BACKENDS6, CLIENT, CLIENT_MAC, Expect, FRAME_MAX, GW_A_MAC, GW_B_MAC, Item, MODE_NEW_TCP,
        MODE_NEW_TCP6, MODE_RESTORE, Prog, VIP, VIP6, Via, XDP_PASS, XDP_REDIRECT, XDP_TX, answered_first, backend_mac,
        backend_mac6, backend_port, is_ipv6, items, new_flow_case, payload, reply_frame, reply_frame6, services, tcp,
        udp,
    },
    netns::{ifindex, pin_to},
};

/// [`Bench::new_flows_on_two_cpus`]'s figures, ns per packet: per round,
/// one CPU alone, and each of the two CPUs running at once.
pub(crate) struct Scaling {
    pub cpus: Vec<usize>,
    pub one: Vec<f64>,
    pub both: Vec<Vec<f64>>,
    /// Two-CPU runs made again, as (round, new flows that lost their
    /// slot to the other CPU) (see [`Bench::new_flows_on_two_cpus`]).
    pub reruns: Vec<(usize, u64)>,
}

/// Two-CPU runs of one round, at most, that may lose a slot to the other
/// CPU before the bench gives up (see [`Bench::new_flows_on_two_cpus`]).
const TWO_CPU_TRIES: u32 = 3;

/// One timed run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sample {
    /// The kernel's mean time per repeat, truncated to whole ns.
    pub kernel_ns: u32,
    /// The figure used: `kernel_ns + 0.5`, the middle of the interval the
    /// truncated mean stands for (so that it is not biased low).
    pub ns: f64,
    /// Wall time of the whole syscall, ms (for information: it includes the
    /// kernel's setup, two XDP dispatcher updates with RCU grace periods).
    pub wall_ms: f64,
}

struct RunOut {
    retval: u32,
    out: Vec<u8>,
    sample: Sample,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct HarnessConfig {
    len: u32,
    mode: u32,
}
// SAFETY: repr(C), two u32, no padding.
unsafe impl aya::Pod for HarnessConfig {}

pub(crate) struct Bench {
    dp: Dataplane,
    bench: Ebpf,
    lb_fd: ProgramFd,
    pass_fd: ProgramFd,
    tx_fd: ProgramFd,
    table_fd: ProgramFd,
    lru_fd: ProgramFd,
    open_fd: ProgramFd,
    split_fd: ProgramFd,
    /// `floor_open`'s current epoch: a slot claimed in an older one is free.
    open_epoch: u32,
    /// `floor_split`'s, the same.
    split_epoch: u32,
    /// `floor_split`'s inner arrays, and how many of them are in vmalloc's
    /// 4 KB pages (0 when the kernel gave every one huge pages).
    pub split_arrays: (u32, usize),
    /// What PROG_ARRAY slot 0 holds now.
    slot: Option<Prog>,
    /// Per table (indexed by [`LB4`], [`TABLE`], [`LRU`], [`OPEN`],
    /// [`LB6`], [`SPLIT`]): `Some(n)` while it holds the `n` flows of its last fill
    /// and at most a few single flows since; `None` once a new-flow run
    /// added its repeats. A case finding its table as it needs it skips
    /// the refill.
    filled: [Option<u32>; 6],
    if_a: u32,
    /// The backends' side, where a one-arm case's client packets arrive.
    if_b: u32,
    cpu: usize,
    pub conntrack_max: u32,
    /// Set by SIGINT/SIGTERM: stop between runs, clean up (namespace, sysctl).
    stop: Arc<AtomicBool>,
}

/// The tables [`Bench::filled`] follows: the datapath's IPv4 flow table,
/// `floor_table`'s, `floor_lru`'s, `floor_open`'s, the datapath's IPv6
/// flow table, `floor_split`'s.
const LB4: usize = 0;
const TABLE: usize = 1;
const LRU: usize = 2;
const OPEN: usize = 3;
const LB6: usize = 4;
const SPLIT: usize = 5;

/// Slots in each of `floor_split`'s inner arrays (`SPLIT_SLOTS` in
/// bench-floor), of 80 bytes each (`OpenSlot`; a size that differs makes
/// the kernel refuse the arrays in `FLOW_SPLIT`, at start).
pub(crate) const SPLIT_SLOTS: u32 = 256;
pub(crate) type SplitSlot = [u64; 10];

/// A new-flow run of a service whose flows take two entries (its backend
/// endpoints shared with another service's) in which a few flows found
/// no free slot among the 32 of their probe sequence, and were dropped
/// and counted (`flow_table`), as the datapath does for such flows: every
/// other repeat took the measured path. A flow and its reply entry start
/// their probes at the same slot, so such a table's entries come in
/// pairs, whose runs grow faster; with the 1M-flow fill and a run's
/// 500,000 pairs (a quarter of the slots taken), a simulation of the
/// table put a flow past its 32 slots in about 1 run of 250. The run is
/// not a sample of the path it times: the caller runs it again, once,
/// and the report says so.
#[derive(Debug, thiserror::Error)]
#[error(
    "{label}: {dropped} of {repeat} new flows found no free slot among their 32 and were dropped (counted flow_table)"
)]
pub(crate) struct NoRoom {
    pub label: String,
    pub dropped: u64,
    pub repeat: u32,
}

/// Slots of `floor_open`'s table for a flow table of `conntrack_max`
/// connections: twice as many, rounded up to a power of two, so that a
/// full table is at most half occupied (linear probing's probe sequences
/// stay short; 80 bytes a slot, 640 MB at 4M connections, against about
/// 540 MB for the kernel hash of the same capacity).
fn open_slots(conntrack_max: u32) -> u32 {
    conntrack_max.saturating_mul(2).next_power_of_two().max(2)
}

/// `floor_split`'s inner arrays, one per `SPLIT_SLOTS` slots, put in
/// `FLOW_SPLIT` (which holds them from then on) as lbd fills its flow
/// tables.
/// Returns how many there are and how many of them the kernel allocated
/// with vmalloc (4 KB pages) after all: it falls back to vmalloc when
/// kmalloc finds no free 32 KB.
fn split_arrays(bench: &mut Ebpf) -> anyhow::Result<(u32, usize)> {
    let in_vmalloc =
        || lb_userspace::dataplane::small_vmalloc_arrays().ok_or_else(|| anyhow!("reading /proc/vmallocinfo"));
    let before = in_vmalloc()?;
    let n = lb_userspace::dataplane::fill_arrays::<SplitSlot>(bench, "FLOW_SPLIT", "FLOW_SPLIT_ARR", SPLIT_SLOTS)?;
    Ok((n, in_vmalloc()?.saturating_sub(before)))
}

fn xdp<'a>(ebpf: &'a Ebpf, name: &str) -> anyhow::Result<&'a Xdp> {
    let p = ebpf.program(name).ok_or_else(|| anyhow!("program {name} missing from the object"))?;
    Ok(<&Xdp>::try_from(p)?)
}

impl Bench {
    pub(crate) fn new(cpu: usize, conntrack_max: u32, stop: Arc<AtomicBool>) -> anyhow::Result<Self> {
        let cfg = Config {
            interfaces: vec![],
            xdp_mode: XdpMode::Auto,
            control_socket: "/nonexistent".into(),
            pin_path: "/nonexistent".into(),
            conntrack_max,
            conntrack_max_ipv6: conntrack_max,
            table_capacity: 1 << 20,
            maglev_seed: 0,
            tcp_idle_timeout: 900,
            udp_idle_timeout: 300,
            // No new-flow rate limit: a new-flow run inserts a million
            // flows a second on one CPU, far above `auto`, and must
            // measure the insert, not the stateless path.
            flood: lb_userspace::config::FloodConfig { new_flow_rate_per_cpu: Some(0), ..Default::default() },
            metrics_listen: "127.0.0.1:9464".parse()?,
            bgp: None,
            services: services(),
        };
        let mut dp = Dataplane::load_unpinned(&cfg).context("loading the datapath")?;
        dp.apply_admin(&cfg.services).context("programming the services")?;
        // Both devices take native redirects (what lbd writes for a gateway
        // whose veth peers have GRO on), so the measured path is the fast
        // one; and XDP_TX (what lbd writes for a NIC's driver, or generic
        // mode), so that the one-arm case times the path a one-arm gateway
        // takes there (packets that arrive on a device they leave by).
        let xmit = lb_common::NETDEV_F_XMIT_GENERIC | lb_common::NETDEV_F_XMIT_NATIVE | lb_common::NETDEV_F_TX;
        dp.write_netdevs(&[(ifindex("gwa")?, xmit), (ifindex("gwb")?, xmit)].into_iter().collect())
            .context("describing the devices")?;
        // The table-alone programs' tables have the datapath's flow-table size.
        let mut bench = EbpfLoader::new()
            .map_max_entries("FLOW_TABLE", conntrack_max)
            .map_max_entries("FLOW_LRU", conntrack_max)
            .map_max_entries("FLOW_OPEN", open_slots(conntrack_max))
            .map_max_entries("FLOW_SPLIT", open_slots(conntrack_max).div_ceil(SPLIT_SLOTS))
            .load(BENCH_OBJECT)
            .context("loading the benchmark programs")?;
        let split_arrays = split_arrays(&mut bench).context("making floor_split's arrays")?;
        for name in ["floor_pass", "floor_tx", "floor_table", "floor_lru", "floor_open", "floor_split", "bench_harness"]
        {
            let p: &mut Xdp =
                bench.program_mut(name).ok_or_else(|| anyhow!("program {name} missing from the object"))?.try_into()?;
            p.load().with_context(|| format!("loading {name}"))?;
        }
        let lb_fd = dp.program().fd()?.try_clone()?;
        let pass_fd = xdp(&bench, "floor_pass")?.fd()?.try_clone()?;
        let tx_fd = xdp(&bench, "floor_tx")?.fd()?.try_clone()?;
        let table_fd = xdp(&bench, "floor_table")?.fd()?.try_clone()?;
        let lru_fd = xdp(&bench, "floor_lru")?.fd()?.try_clone()?;
        let open_fd = xdp(&bench, "floor_open")?.fd()?.try_clone()?;
        let split_fd = xdp(&bench, "floor_split")?.fd()?.try_clone()?;
        Ok(Self {
            dp,
            bench,
            lb_fd,
            pass_fd,
            tx_fd,
            table_fd,
            lru_fd,
            open_fd,
            split_fd,
            open_epoch: 0,
            split_epoch: 0,
            split_arrays,
            slot: None,
            filled: [None; 6],
            if_a: ifindex("gwa")?,
            if_b: ifindex("gwb")?,
            cpu,
            conntrack_max,
            stop,
        })
    }

    fn set_slot(&mut self, prog: Prog) -> anyhow::Result<()> {
        if self.slot == Some(prog) {
            return Ok(());
        }
        let fd = match prog {
            Prog::Lb => &self.lb_fd,
            Prog::FloorPass => &self.pass_fd,
            Prog::FloorTx => &self.tx_fd,
            Prog::Table => &self.table_fd,
            Prog::Lru => &self.lru_fd,
            Prog::Open => &self.open_fd,
            Prog::Split => &self.split_fd,
        };
        let mut arr = ProgramArray::try_from(self.bench.map_mut("PROG_ARRAY").ok_or_else(|| anyhow!("PROG_ARRAY"))?)?;
        arr.set(0, fd, 0)?;
        self.slot = Some(prog);
        Ok(())
    }

    fn set_frame(&mut self, frame: &[u8], mode: u32) -> anyhow::Result<()> {
        ensure!(!frame.is_empty() && frame.len() <= FRAME_MAX, "frame of {} bytes", frame.len());
        let mut words = [0u64; FRAME_MAX / 8];
        let mut padded = [0u8; FRAME_MAX];
        padded[..frame.len()].copy_from_slice(frame);
        for (i, w) in words.iter_mut().enumerate() {
            *w = u64::from_ne_bytes(padded[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        }
        let mut f: Array<&mut MapData, [u64; FRAME_MAX / 8]> =
            Array::try_from(self.bench.map_mut("FRAME").ok_or_else(|| anyhow!("FRAME"))?)?;
        f.set(0, words, 0)?;
        let mut c: Array<&mut MapData, HarnessConfig> =
            Array::try_from(self.bench.map_mut("CONFIG").ok_or_else(|| anyhow!("CONFIG"))?)?;
        c.set(0, HarnessConfig { len: frame.len() as u32, mode }, 0)?;
        Ok(())
    }

    /// The harness's new-flow counter on our CPU.
    fn new_flow_counter(&self) -> anyhow::Result<u64> {
        let m: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.bench.map("COUNTER").ok_or_else(|| anyhow!("COUNTER"))?)?;
        let v = m.get(&0, 0)?;
        v.get(self.cpu).copied().ok_or_else(|| anyhow!("no COUNTER value for CPU {}", self.cpu))
    }

    /// The table-alone programs' inserts so far on our CPU (one counter).
    fn table_inserts(&self) -> anyhow::Result<u64> {
        self.inserts_on(&[self.cpu])
    }

    /// Empty the table of a table-alone program, then put `n` fresh
    /// 5-tuples in it (as the datapath's table is emptied and filled for
    /// its cases).
    fn reset_table(&mut self, prog: Prog, n: u32) -> anyhow::Result<()> {
        let (name, fill_case) = match prog {
            Prog::Lru => ("FLOW_LRU", "lru_new"),
            Prog::Open => ("FLOW_OPEN", "open_new"),
            Prog::Split => ("FLOW_SPLIT", "split_new"),
            _ => ("FLOW_TABLE", "table_new"),
        };
        if matches!(prog, Prog::Open | Prog::Split) {
            // Epochs 1..=65535 (16 bits in a slot's claim word; 0 is a
            // never-used slot's).
            let (epoch, conf) = if prog == Prog::Open {
                (&mut self.open_epoch, "OPEN_CONF")
            } else {
                (&mut self.split_epoch, "SPLIT_CONF")
            };
            *epoch = *epoch % 0xffff + 1;
            let epoch = *epoch;
            let mut conf: Array<&mut MapData, [u32; 2]> =
                Array::try_from(self.bench.map_mut(conf).ok_or_else(|| anyhow!("{conf}"))?)?;
            conf.set(0, [open_slots(self.conntrack_max) - 1, epoch], 0)?;
        } else {
            let map = self.bench.map(name).ok_or_else(|| anyhow!("{name}"))?;
            let fd = match map {
                aya::maps::Map::LruHashMap(m) | aya::maps::Map::HashMap(m) => m.fd().as_fd(),
                _ => anyhow::bail!("{name} is not a hash map"),
            };
            drain_flow_map(fd).with_context(|| format!("emptying {name}"))?;
        }
        if n == 0 {
            return Ok(());
        }
        let item = items().into_iter().find(|i| i.key == fill_case).with_context(|| format!("no {fill_case} case"))?;
        let i0 = self.table_inserts()?;
        let r = self.run(&item, n)?;
        let i1 = self.table_inserts()?;
        ensure!(r.retval == XDP_PASS, "filling {name}: returned {}", r.retval);
        ensure!(i1 - i0 == u64::from(n), "filling {name}: {} inserts for {n} packets", i1 - i0);
        Ok(())
    }

    /// Empty the datapath's flow tables, both families' (in batches: see
    /// `Dataplane::flush_flows`), and mark them so.
    fn flush_flows(&mut self) -> anyhow::Result<u64> {
        let n = self.dp.flush_flows()?;
        self.filled[LB4] = Some(0);
        self.filled[LB6] = Some(0);
        Ok(n)
    }

    /// One BPF_PROG_TEST_RUN of `item` with `repeat` repeats.
    fn run(&mut self, item: &Item, repeat: u32) -> anyhow::Result<RunOut> {
        self.run_after(item, repeat, &mut || {})
    }

    /// [`Self::run`], with `before` called just before the syscall, after
    /// every map read of the run's own checks (the cold-cache runs evict
    /// the caches there).
    fn run_after(&mut self, item: &Item, repeat: u32, before: &mut dyn FnMut()) -> anyhow::Result<RunOut> {
        let prog: &Xdp = match item.via {
            Via::Direct => match item.prog {
                Prog::FloorPass => xdp(&self.bench, "floor_pass")?,
                Prog::FloorTx => xdp(&self.bench, "floor_tx")?,
                Prog::Table => xdp(&self.bench, "floor_table")?,
                Prog::Lru => xdp(&self.bench, "floor_lru")?,
                Prog::Open => xdp(&self.bench, "floor_open")?,
                Prog::Split => xdp(&self.bench, "floor_split")?,
                Prog::Lb => self.dp.program(),
            },
            Via::Harness(mode) => {
                self.set_slot(item.prog)?;
                self.set_frame(&item.frame, mode)?;
                xdp(&self.bench, "bench_harness")?
            }
        };
        let ctx = xdp_ctx(item.frame.len(), self.ingress(item));
        let mut out = vec![0u8; item.frame.len() + 256];
        ensure!(!self.stop.load(Ordering::Relaxed), "interrupted");
        let stateless_before = self.stateless_count()?;
        before();
        let t0 = Instant::now();
        let res = prog
            .test_run(TestRunOptions {
                data_in: Some(&item.frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat,
                ..TestRunOptions::new()
            })
            .with_context(|| format!("BPF_PROG_TEST_RUN of {}", item.key))?;
        let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
        out.truncate(res.data_size_out as usize);
        // The kernel divides its total by the repeat count and truncates
        // (net/bpf/test_run.c, bpf_test_timer_continue): `duration` is
        // already the mean per repeat, in whole ns.
        let kernel_ns = res.duration.as_nanos() as u32;
        let sample = Sample { kernel_ns, ns: f64::from(kernel_ns) + 0.5, wall_ms };
        // Every new flow measured got its entry: none found the table full
        // or went above the new-flow rate (that would time the stateless
        // path instead).
        let stateless = self.stateless_count()? - stateless_before;
        ensure!(stateless == 0, "{}: {stateless} flows routed without an entry", item.key);
        Ok(RunOut { retval: res.return_value, out, sample })
    }

    /// The device `item`'s frame arrives on: a client's packet on the
    /// client side (gwa), a backend's reply on the backends' side (gwb);
    /// for a one-arm case (`Expect::SentBack`) each on the side it leaves
    /// by, the other way round.
    fn ingress(&self, item: &Item) -> u32 {
        if item.reply == (item.expect == Expect::SentBack) { self.if_a } else { self.if_b }
    }

    /// Flows the datapath routed without an entry so far (`table_full`,
    /// `flood_rate`).
    fn stateless_count(&self) -> anyhow::Result<u64> {
        let c = self.dp.counters()?;
        Ok(c.get("table_full").copied().unwrap_or(0) + c.get("flood_rate").copied().unwrap_or(0))
    }

    /// For [`Self::both_cpus`]: packets held so far (`held`: a new flow's
    /// insert that lost its slot to another CPU's) and flows routed
    /// without an entry ([`Self::stateless_count`]).
    fn raced_count(&self) -> anyhow::Result<u64> {
        let held = self.dp.counters()?.get("held").copied().unwrap_or(0);
        Ok(held + self.stateless_count()?)
    }

    /// New flows, packets in (client -> backend), packets out (replies).
    fn service_counters(&self, service: &str) -> anyhow::Result<(u64, u64, u64)> {
        let s = self
            .dp
            .services()
            .find(|s| s.config.name == service)
            .ok_or_else(|| anyhow!("service {service} not applied"))?;
        let (mut new_flows, mut packets_in, mut packets_out) = (0, 0, 0);
        for b in &s.backends {
            let st = self.dp.backend_stats(b.id)?;
            new_flows += st.new_flows;
            packets_in += st.packets_in;
            packets_out += st.packets_out;
        }
        Ok((new_flows, packets_in, packets_out))
    }

    /// Put `n` new flows into the IPv4 table (fresh 5-tuples to the
    /// maglev service, made by the datapath itself through the harness).
    fn fill(&mut self, n: u32) -> anyhow::Result<()> {
        self.fill_by("new_maglev", "maglev", n)
    }

    /// Put `n` new flows into the IPv6 table, as [`Self::fill`] (the
    /// maglev6 service).
    fn fill6(&mut self, n: u32) -> anyhow::Result<()> {
        self.fill_by("new_maglev6", "maglev6", n)
    }

    /// `n` repeats of the new-flow case `case` (a fresh 5-tuple per
    /// repeat) to `service`, each checked to have made a new flow.
    fn fill_by(&mut self, case: &str, service: &str, n: u32) -> anyhow::Result<()> {
        let item = items().into_iter().find(|i| i.key == case).with_context(|| format!("no {case} case"))?;
        let (nf0, _, _) = self.service_counters(service)?;
        let r = self.run(&item, n)?;
        let (nf1, _, _) = self.service_counters(service)?;
        ensure!(r.retval == XDP_REDIRECT, "filling the flow table ({service}): returned {}", r.retval);
        ensure!(
            nf1 - nf0 == u64::from(n),
            "filling the flow table ({service}): {} new flows for {n} packets",
            nf1 - nf0
        );
        Ok(())
    }

    /// The sweeper's cost at `n` flows: the table is filled, then swept
    /// once with nothing to expire (a read of every entry) and once with
    /// everything expired (a read of every entry and its removal by
    /// `lb_sweep`, in batches); then filled again and emptied without
    /// batching, the baseline: a batched read, then an `lb_sweep` run per
    /// flow. ms each, and the longest part of either sweep (lbd holds its
    /// agent's lock for one part at a time).
    pub(crate) fn sweep_cost(&mut self, n: u32) -> anyhow::Result<SweepCost> {
        self.flush_flows()?;
        self.fill(n)?;
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let mut longest = Duration::ZERO;
        let mut sweep = |dp: &mut Dataplane, now, idle| -> anyhow::Result<_> {
            let t = Instant::now();
            let mut run = dp.sweep_begin(now, idle, idle);
            loop {
                let part = Instant::now();
                let done = dp.sweep_step(&mut run)?;
                longest = longest.max(part.elapsed());
                if let Some(r) = done {
                    return Ok((r, t.elapsed().as_secs_f64() * 1e3));
                }
            }
        };
        let (keep, read_ms) = sweep(&mut self.dp, now, u64::MAX / 2)?;
        ensure!(keep.entries >= u64::from(n) && keep.removed == 0, "sweep of {n} flows: {keep:?}");
        let (all, delete_ms) = sweep(&mut self.dp, now + 1_000_000, 1)?;
        ensure!(all.removed == keep.entries && all.expired == keep.entries, "expiring {n} flows: {all:?}");
        self.flush_flows()?;
        self.fill(n)?;
        let t = Instant::now();
        let keys = self.dp.flow_keys()?;
        let mut removed = 0;
        for k in &keys {
            removed += self.dp.forget_flows(std::slice::from_ref(k))?;
        }
        let syscalls_ms = t.elapsed().as_secs_f64() * 1e3;
        ensure!(removed == u64::from(n), "removing {n} flows one by one: {removed} removed");
        Ok(SweepCost {
            flows: keep.entries,
            read_ms,
            expire_ms: delete_ms,
            syscalls_ms,
            longest_part_ms: longest.as_secs_f64() * 1e3,
        })
    }

    /// Check one run's return value and output frame. For a new flow, the
    /// harness gave the last repeat the source derived from `counter_last`.
    fn check_output(&self, item: &Item, r: &RunOut, repeat: u32, counter_last: Option<u64>) -> anyhow::Result<()> {
        let what = &item.label;
        // The frame the program under test saw: for a new flow the harness
        // gave it the source derived from its counter (built here from
        // scratch, so the harness's incremental checksums are checked too).
        let seen = if item.via == Via::Harness(MODE_NEW_TCP6) {
            let n = counter_last.ok_or_else(|| anyhow!("{what}: no harness counter"))?;
            let orig = Frame6::parse(&item.frame).with_context(|| format!("{what}: the case's frame"))?;
            let mut src = orig.src.octets();
            let last = u32::from_be_bytes(src[12..].try_into().expect("4 bytes")).wrapping_add((n >> 16) as u32);
            src[12..].copy_from_slice(&last.to_be_bytes());
            Frame6 { src: src.into(), sport: n as u16, ..orig }.bytes()
        } else if item.via == Via::Harness(MODE_NEW_TCP) {
            let n = counter_last.ok_or_else(|| anyhow!("{what}: no harness counter"))?;
            let orig = Frame::parse(&item.frame).with_context(|| format!("{what}: the case's frame"))?;
            Frame { src: Ipv4Addr::from(u32::from(orig.src).wrapping_add((n >> 16) as u32)), sport: n as u16, ..orig }
                .bytes()
        } else {
            item.frame.clone()
        };
        ensure!(r.out.len() == seen.len(), "{what}: output length {} != {}", r.out.len(), seen.len());
        match item.expect {
            Expect::Pass => {
                ensure!(r.retval == XDP_PASS, "{what}: returned {} instead of XDP_PASS (2)", r.retval);
                if item.prog == Prog::Lb {
                    // The path claimed: the address filter knows neither
                    // address, so nothing past it ran.
                    for a in frame_addrs(&seen).ok_or_else(|| anyhow!("{what}: not an IP frame"))? {
                        ensure!(
                            !self.dp.in_filter(a)?,
                            "{what}: {a} has its address-filter bit set (shares it with a VIP or backend): the measured path is not the filter's early pass"
                        );
                    }
                }
                ensure!(
                    r.out == seen,
                    "{what}: a passed frame must be untouched\n in  {seen:02x?}\n out {:02x?}",
                    r.out
                );
            }
            Expect::Tx => {
                ensure!(r.retval == XDP_TX, "{what}: returned {} instead of XDP_TX (3)", r.retval);
                let mut want = seen.clone();
                // Run directly (no harness), repeats swap back and forth.
                if item.via != Via::Direct || repeat % 2 == 1 {
                    want[..6].copy_from_slice(&seen[6..12]);
                    want[6..12].copy_from_slice(&seen[..6]);
                }
                ensure!(r.out == want, "{what}: MACs not swapped\n out {:02x?}", r.out);
            }
            Expect::Redirect | Expect::SentBack => {
                let want = item.expect.retval();
                ensure!(
                    r.retval == want,
                    "{what}: returned {} instead of {want} ({}): the measured path is not the forwarding path",
                    r.retval,
                    if want == XDP_TX { "XDP_TX" } else { "XDP_REDIRECT" }
                );
                if is_ipv6(&seen) {
                    return check_redirect6(item, &seen, &r.out);
                }
                // Parsed, both checksums verified (etherparse).
                let got = Frame::parse(&r.out).with_context(|| format!("{what}: output {:02x?}", r.out))?;
                let orig = Frame::parse(&seen).with_context(|| format!("{what}: the frame the program saw"))?;
                let want = if item.reply {
                    // Back to the client, from the VIP.
                    let vport = if item.service == Some("dns") { 53 } else { 80 };
                    Frame { dmac: CLIENT_MAC, smac: GW_A_MAC, src: VIP, sport: vport, ttl: orig.ttl - 1, ..orig }
                        .bytes()
                } else {
                    let (dst, dport) = (got.dst, got.dport);
                    let port = backend_port(item.service.unwrap_or_default());
                    ensure!(BACKENDS.contains(&dst), "{what}: destination {dst} is not a backend");
                    ensure!(dport == port, "{what}: destination port {dport}, expected {port}");
                    Frame { dmac: backend_mac(dst), smac: GW_B_MAC, dst, dport: port, ttl: orig.ttl - 1, ..orig }
                        .bytes()
                };
                ensure!(
                    r.out == want,
                    "{what}: output differs from the expected frame (checksums recomputed from scratch)\n want {want:02x?}\n out  {:02x?}",
                    r.out
                );
            }
        }
        Ok(())
    }

    /// The harness restores what FRAME holds whatever the packet held, by
    /// words and (for other lengths) by the helper.
    /// Control-plane write time: a weight change on the `maglev` service
    /// (a 65,537-entry table), from `apply` to the VIP entry pointing at the
    /// new table, `n` times; and whether the datapath dropped a packet
    /// meanwhile. While each change is applied, another thread (on this
    /// CPU, the apply on another) sends new flows to the service through
    /// the harness without pause, from before the apply starts until after
    /// it returns; every one of them must leave by XDP redirect with a new
    /// flow counted on one of the service's backends. The changes are
    /// spaced past the table-region grace period, so no allocation waits.
    pub(crate) fn weight_changes(&mut self, n: usize) -> anyhow::Result<WeightChanges> {
        let mut svcs = services();
        ensure!(svcs[0].name == "maglev" && svcs[0].table_size == 65537, "the first service is the Maglev one");
        let item = items().into_iter().find(|i| i.key == "new_maglev").ok_or_else(|| anyhow!("no new_maglev case"))?;
        let Via::Harness(mode) = item.via else { anyhow::bail!("new_maglev runs through the harness") };
        self.flush_flows()?;
        self.set_slot(Prog::Lb)?;
        self.set_frame(&item.frame, mode)?;
        let apply_cpu = other_cpu(self.cpu);
        let before = self.traffic_counters()?;
        let mut out = WeightChanges {
            ms: Vec::with_capacity(n),
            packets: 0,
            during_apply: 0,
            not_redirected: 0,
            lost: 0,
            apply_cpu,
        };
        for i in 0..n {
            let w = if i % 2 == 0 { 2 } else { 1 };
            svcs[0].backends[0].weight = w;
            let harness = xdp(&self.bench, "bench_harness")?;
            let (dp, cpu, if_a) = (&mut self.dp, self.cpu, self.if_a);
            let running = AtomicBool::new(true);
            let (ms, sent, during, not_redirected) = std::thread::scope(|s| -> anyhow::Result<(f64, u64, u64, u64)> {
                let traffic = s.spawn(|| send_until(harness, &item.frame, if_a, cpu, &running));
                // The apply runs on another CPU than the packets, so the
                // two overlap for real; the traffic runs before and after.
                pin_to(apply_cpu)?;
                std::thread::sleep(Duration::from_millis(5));
                let t0 = Instant::now();
                let applied = dp.apply_admin(&svcs);
                let t1 = Instant::now();
                std::thread::sleep(Duration::from_millis(5));
                running.store(false, Ordering::Relaxed);
                let calls = traffic.join().map_err(|_| anyhow!("the traffic thread panicked"))??;
                pin_to(cpu)?;
                applied.context("weight change")?;
                let sent = calls.len() as u64 * u64::from(TRAFFIC_REPEAT);
                // Packets of the calls that ran while the apply did.
                let during =
                    calls.iter().filter(|(a, b, _)| *a < t1 && *b > t0).count() as u64 * u64::from(TRAFFIC_REPEAT);
                let not_redirected = calls.iter().filter(|c| !c.2).count() as u64 * u64::from(TRAFFIC_REPEAT);
                Ok(((t1 - t0).as_secs_f64() * 1e3, sent, during, not_redirected))
            })?;
            out.not_redirected += not_redirected;
            ensure!(during > 0, "no packet ran while weight change {i} was applied");
            out.ms.push(ms);
            out.packets += sent;
            out.during_apply += during;
            let live = self
                .dp
                .services()
                .find(|a| a.config.name == "maglev")
                .and_then(|a| a.backends.first())
                .map(|b| b.runtime.weight);
            ensure!(live == Some(w), "the weight change did not land: {live:?}");
            std::thread::sleep(Duration::from_millis(250));
        }
        let after = self.traffic_counters()?;
        // Every packet sent was a new flow of the service that left by XDP
        // redirect; any other outcome (a drop of any reason, the kernel's
        // path, a flow without its count) is a packet lost to the change.
        let (new_flows, redirected) = (after.0 - before.0, after.1 - before.1);
        out.lost =
            (out.packets.saturating_sub(new_flows.min(redirected)) + (after.2 - before.2)).max(out.not_redirected);
        self.dp.apply_admin(&services()).context("restoring the weights")?;
        self.flush_flows()?;
        Ok(out)
    }

    /// New flows on two CPUs at once, against one CPU alone, in the same
    /// rounds: what the datapath's shared cache lines cost when CPUs open
    /// flows together (the flow table's entry count, `FLOW_COUNT`, and the
    /// backends' connection counts, `CONNS`, are one atomic word each for
    /// every CPU), beside the datapath's kind of table alone (`split_new`;
    /// no shared word: what the memory itself costs two CPUs). Each round runs `repeat`
    /// new flows of `key` on this CPU alone, then on this CPU and another
    /// at once (started together, each its own fresh 5-tuples), on an
    /// emptied table; every run is checked (each repeat a new flow that
    /// got an entry and left by XDP redirect; the table alone: one insert
    /// a repeat).
    ///
    /// Two CPUs inserting at once can race for one free slot: the loser of
    /// the compare-and-swap gets no entry (the datapath holds that packet,
    /// dropped and counted `held`; the table alone counts no insert). Its
    /// run is then not a sample of the path it times: it is made again,
    /// up to [`TWO_CPU_TRIES`] runs a round, and reported.
    pub(crate) fn new_flows_on_two_cpus(&mut self, key: &str, rounds: usize, repeat: u32) -> anyhow::Result<Scaling> {
        let item = items().into_iter().find(|i| i.key == key).ok_or_else(|| anyhow!("no {key} case"))?;
        let Via::Harness(mode) = item.via else { anyhow::bail!("{key} runs through the harness") };
        ensure!(mode == MODE_NEW_TCP, "{key} is not a new-flow case");
        let other = other_cpu(self.cpu);
        ensure!(other != self.cpu, "one CPU only: nothing to run beside it");
        let cpus = [self.cpu, other];
        let mut out = Scaling { cpus: cpus.to_vec(), one: Vec::new(), both: Vec::new(), reruns: Vec::new() };
        for round in 0..=rounds {
            self.empty_for(&item)?;
            let (c0, i0) = (self.new_flows_of(&item)?, self.inserts_on(&cpus)?);
            let one = self.run(&item, repeat)?;
            ensure!(one.retval == item.expect.retval(), "{key}: returned {}", one.retval);
            self.check_new_flows(&item, c0, i0, &cpus, u64::from(repeat))?;
            let mut tries = 1;
            let both = loop {
                match self.both_cpus(&item, &cpus, repeat)? {
                    Ok(both) => break both,
                    Err(lost) => {
                        ensure!(
                            tries < TWO_CPU_TRIES,
                            "{key} on two CPUs: {lost} new flows lost their slot to the other CPU, in {tries} runs in a row"
                        );
                        eprintln!(
                            "\n{key} on two CPUs, round {round}: {lost} new flows lost their slot to the other CPU; run again"
                        );
                        out.reruns.push((round, lost));
                        tries += 1;
                    }
                }
            };
            if round > 0 {
                out.one.push(f64::from(one.sample.kernel_ns) + 0.5);
                out.both.push(both.iter().map(|&(_, ns)| f64::from(ns) + 0.5).collect());
            }
        }
        self.empty_for(&item)?;
        Ok(out)
    }

    /// One run of [`Self::new_flows_on_two_cpus`] on both `cpus` at once,
    /// on an emptied table: each CPU's return value and ns per packet, or
    /// how many new flows lost their slot to the other CPU. Checked as the
    /// one-CPU run is.
    fn both_cpus(
        &mut self,
        item: &Item,
        cpus: &[usize; 2],
        repeat: u32,
    ) -> anyhow::Result<Result<Vec<(u32, u32)>, u64>> {
        let key = item.key;
        self.empty_for(item)?;
        self.spread_counters(cpus)?;
        let (c0, i0) = (self.new_flows_of(item)?, self.inserts_on(cpus)?);
        let raced0 = self.raced_count()?;
        let harness = xdp(&self.bench, "bench_harness")?;
        let (frame, if_a) = (&item.frame, self.if_a);
        let start = std::sync::Barrier::new(cpus.len());
        let both = std::thread::scope(|s| -> anyhow::Result<Vec<(u32, u32)>> {
            let runs: Vec<_> = cpus
                .iter()
                .map(|&cpu| {
                    let start = &start;
                    s.spawn(move || -> anyhow::Result<(u32, u32)> {
                        pin_to(cpu)?;
                        let ctx = xdp_ctx(frame.len(), if_a);
                        let mut buf = vec![0u8; frame.len() + 256];
                        start.wait();
                        let r = harness
                            .test_run(TestRunOptions {
                                data_in: Some(frame),
                                data_out: Some(&mut buf),
                                ctx_in: Some(&ctx),
                                repeat,
                                ..TestRunOptions::new()
                            })
                            .context("BPF_PROG_TEST_RUN on two CPUs")?;
                        Ok((r.return_value, r.duration.as_nanos() as u32))
                    })
                })
                .collect();
            runs.into_iter().map(|t| t.join().map_err(|_| anyhow!("a run thread panicked"))?).collect()
        })?;
        pin_to(self.cpu)?;
        let n = 2 * u64::from(repeat);
        // The flows that lost a race: held (the datapath; the count also
        // takes in flows routed without an entry, over the flood rate or
        // the table's room, as the check before it did: such a run is
        // made again too, and the message names the race), or not
        // inserted (the table alone).
        let lost = if item.prog == Prog::Lb {
            self.raced_count()? - raced0
        } else {
            n.saturating_sub(self.inserts_on(cpus)? - i0)
        };
        // Counted before the return values are checked: a run's return
        // value is its last packet's, which a lost race may have held.
        if lost > 0 {
            return Ok(Err(lost));
        }
        for &(retval, _) in &both {
            ensure!(retval == item.expect.retval(), "{key} on two CPUs: returned {retval}");
        }
        self.check_new_flows(item, c0, i0, cpus, n)?;
        Ok(Ok(both))
    }

    /// The CPU the measuring thread is pinned to.
    pub(crate) const fn cpu(&self) -> usize {
        self.cpu
    }

    /// Whether the machine has a CPU besides the measuring one (this
    /// thread is pinned: its own affinity says one).
    pub(crate) fn has_another_cpu(&self) -> bool {
        other_cpu(self.cpu) != self.cpu
    }

    /// For [`Self::new_flows_on_two_cpus`]: `item`'s table emptied (and
    /// marked so for the per-packet cases).
    fn empty_for(&mut self, item: &Item) -> anyhow::Result<()> {
        match item.prog {
            // The two-CPU runs add IPv4 flows only.
            Prog::Lb => {
                self.flush_flows()?;
                self.filled[LB4] = None;
            }
            Prog::Open => {
                self.reset_table(Prog::Open, 0)?;
                self.filled[OPEN] = None;
            }
            Prog::Split => {
                self.reset_table(Prog::Split, 0)?;
                self.filled[SPLIT] = None;
            }
            p => anyhow::bail!("no two-CPU run of {p:?}"),
        }
        Ok(())
    }

    /// New flows counted on `item`'s service so far (0 for the table alone).
    fn new_flows_of(&self, item: &Item) -> anyhow::Result<u64> {
        Ok(match item.service {
            Some(s) => self.service_counters(s)?.0,
            None => 0,
        })
    }

    /// The table-alone programs' inserts so far on `cpus` together.
    fn inserts_on(&self, cpus: &[usize]) -> anyhow::Result<u64> {
        let m: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.bench.map("INSERTS").ok_or_else(|| anyhow!("INSERTS"))?)?;
        let v = m.get(&0, 0)?;
        cpus.iter().map(|&c| v.get(c).copied().ok_or_else(|| anyhow!("no INSERTS value for CPU {c}"))).sum()
    }

    /// `n` new flows since (`c0`, `i0`): counted on the service, each with
    /// its entry (the datapath), or inserted (the table alone).
    fn check_new_flows(&self, item: &Item, c0: u64, i0: u64, cpus: &[usize], n: u64) -> anyhow::Result<()> {
        if item.prog == Prog::Lb {
            let new = self.new_flows_of(item)? - c0;
            ensure!(new == n, "{}: {new} new flows counted, expected {n}", item.key);
            let entries = self.dp.flow_counts()?.0;
            ensure!(entries == n, "{}: {entries} flow-table entries, expected {n}", item.key);
        } else {
            let inserts = self.inserts_on(cpus)? - i0;
            ensure!(inserts == n, "{}: {inserts} inserts, expected {n}", item.key);
        }
        Ok(())
    }

    /// Set the harness's new-flow counters of `cpus` after the first
    /// 2^34 apart, so that each CPU's fresh 5-tuples (source address + n
    /// >> 16) are its own: the counters are per CPU and all start at 0.
    fn spread_counters(&mut self, cpus: &[usize]) -> anyhow::Result<()> {
        let mut m: PerCpuArray<&mut MapData, u64> =
            PerCpuArray::try_from(self.bench.map_mut("COUNTER").ok_or_else(|| anyhow!("COUNTER"))?)?;
        let mut v: Vec<u64> = m.get(&0, 0)?.iter().copied().collect();
        let base = v.get(cpus[0]).copied().ok_or_else(|| anyhow!("no COUNTER value for CPU {}", cpus[0]))?;
        for (i, &c) in cpus.iter().enumerate().skip(1) {
            let slot = v.get_mut(c).ok_or_else(|| anyhow!("no COUNTER value for CPU {c}"))?;
            *slot = base + ((i as u64) << 34);
        }
        m.set(0, aya::maps::PerCpuValues::try_from(v)?, 0)?;
        Ok(())
    }

    /// For [`Self::weight_changes`]: the `maglev` service's new flows, the
    /// packets sent by XDP redirect, and every drop and kernel-path count.
    fn traffic_counters(&self) -> anyhow::Result<(u64, u64, u64)> {
        let (new_flows, _, _) = self.service_counters("maglev")?;
        let c = self.dp.counters()?;
        let get = |k: &str| c.get(k).copied().unwrap_or(0);
        let other =
            ["malformed", "no_backend", "flow_table", "fib_fallback", "kernel_egress", "table_full", "flood_rate"]
                .iter()
                .map(|k| get(k))
                .sum();
        Ok((new_flows, get("xdp_redirect"), other))
    }

    pub(crate) fn self_test(&mut self) -> anyhow::Result<()> {
        let frames = [
            tcp(CLIENT, 40000, VIP, 80, lb_testkit::frame::tcp::ACK).bytes(),
            Frame { payload: payload(17), ..udp(CLIENT, 5353, VIP, 53) }.bytes(),
        ];
        self.set_slot(Prog::FloorPass)?;
        for f in frames {
            self.set_frame(&f, MODE_RESTORE)?;
            let garbage = vec![0xa5u8; f.len()];
            let ctx = xdp_ctx(f.len(), self.if_a);
            let mut out = vec![0u8; f.len() + 256];
            let res = xdp(&self.bench, "bench_harness")?.test_run(TestRunOptions {
                data_in: Some(&garbage),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                ..TestRunOptions::new()
            })?;
            out.truncate(res.data_size_out as usize);
            ensure!(
                res.return_value == XDP_PASS,
                "harness self-test ({} bytes): returned {}",
                f.len(),
                res.return_value
            );
            ensure!(
                out == f,
                "harness self-test ({} bytes): frame not restored\n want {f:02x?}\n out  {out:02x?}",
                f.len()
            );
        }
        Ok(())
    }

    /// Run `item` once (checked), then time it with `repeat` repeats and
    /// check that every repeat took the intended path.
    pub(crate) fn measure(&mut self, item: &Item, repeat: u32) -> anyhow::Result<Sample> {
        self.measure_after(item, repeat, &mut || {})
    }

    /// [`Self::measure`], with `before` called just before the timed run's
    /// syscall (see [`Self::run_after`]).
    pub(crate) fn measure_after(
        &mut self,
        item: &Item,
        repeat: u32,
        before: &mut dyn FnMut(),
    ) -> anyhow::Result<Sample> {
        let table = item.prog.table_alone();
        // Empty the case's table and fill it with `item.fill` flows, unless
        // it holds just that already (a case other than a new-flow one adds
        // at most a few flows: the table stays as filled).
        let ipv6 = is_ipv6(&item.frame);
        let which = match item.prog {
            Prog::Lb if ipv6 => Some(LB6),
            Prog::Lb => Some(LB4),
            Prog::Table => Some(TABLE),
            Prog::Lru => Some(LRU),
            Prog::Open => Some(OPEN),
            Prog::Split => Some(SPLIT),
            Prog::FloorPass | Prog::FloorTx => None,
        };
        if let Some(w) = which {
            if self.filled[w] != Some(item.fill) {
                if item.prog == Prog::Lb {
                    // Both families' tables (the other then holds none).
                    self.flush_flows()?;
                    if item.fill > 0 && ipv6 {
                        self.fill6(item.fill)?;
                    } else if item.fill > 0 {
                        self.fill(item.fill)?;
                    }
                } else {
                    self.reset_table(item.prog, item.fill)?;
                }
            }
            // A new-flow run adds its flows; they are taken out again
            // after it where they can be (see `forget_run`).
            let adds_flows = new_flow_case(item);
            self.filled[w] = if adds_flows { None } else { Some(item.fill) };
        }
        let reply;
        let item = if item.reply {
            reply = self.reply_to(item)?;
            &reply
        } else {
            item
        };
        if answered_first(item) {
            self.answer(item)?;
        }
        let new_flow = new_flow_case(item);
        // Checked single run (inserts the flow of an established case).
        let c0 = self.new_flow_counter()?;
        let i0 = self.table_inserts()?;
        let e0 = self.dp.flow_counts()?.0;
        let once = self.run(item, 1)?;
        let c1 = self.new_flow_counter()?;
        let i1 = self.table_inserts()?;
        if new_flow {
            ensure!(c1 == c0 + 1, "{}: harness counter moved by {} in one run", item.label, c1 - c0);
        }
        if item.prog == Prog::Lb && item.via == Via::Harness(MODE_NEW_TCP) {
            // The SYN loads its key's second slot early exactly for a VIP
            // whose new flows take two entries (the reply-entry hint): the
            // path timed is the one its label names.
            let added = self.dp.flow_counts()?.0 - e0;
            let f = Frame::parse(&item.frame).with_context(|| format!("{}: the case's frame", item.label))?;
            let hinted = self.dp.in_reply_hint(f.dst, f.dport)?;
            ensure!(
                hinted == (added == 2),
                "{}: a new flow added {added} flow-table entries, and its VIP's reply-entry hint is {}",
                item.label,
                if hinted { "set" } else { "clear" }
            );
        }
        // A fresh 5-tuple is never in its table; a hit's may be already
        // (put there by an earlier round sharing the fill).
        ensure!(!table || i1 - i0 == 1 || (!new_flow && i1 == i0), "{}: {} inserts in one run", item.label, i1 - i0);
        self.check_output(item, &once, 1, c1.checked_sub(1))?;

        let stats0 = match item.service {
            Some(s) => Some(self.service_counters(s)?),
            None => None,
        };
        let global0 = self.dp.counters()?;
        let timed = self.run_after(item, repeat, before)?;
        let c2 = self.new_flow_counter()?;
        let i2 = self.table_inserts()?;
        if new_flow {
            ensure!(c2 == c1 + u64::from(repeat), "{}: harness counter moved by {}, not {repeat}", item.label, c2 - c1);
        }
        // The table alone: an insert per fresh 5-tuple, none for a hit.
        let want_inserts = if table && new_flow { u64::from(repeat) } else { 0 };
        ensure!(
            i2 - i1 == want_inserts,
            "{}: {} inserts into its table in {repeat} repeats, expected {want_inserts}",
            item.label,
            i2 - i1
        );
        let global1 = self.dp.counters()?;
        let mut moved: BTreeMap<&String, u64> =
            global1.iter().filter(|&(k, v)| global0.get(k) != Some(v)).map(|(k, v)| (k, v - global0[k])).collect();
        // A forwarded packet counts one XDP redirect; nothing else may move
        // (a drop, a kernel-path hand-over: not the path meant to be timed).
        let redirected = moved.remove(&"xdp_redirect".to_owned()).unwrap_or(0);
        // Of those, the ones sent back out of their ingress by XDP_TX.
        let sent_back = moved.remove(&"xdp_tx".to_owned()).unwrap_or(0);
        let want_back = if item.expect == Expect::SentBack { u64::from(repeat) } else { 0 };
        ensure!(
            sent_back == want_back,
            "{}: {sent_back} packets sent back out by XDP_TX in {repeat} repeats, expected {want_back}",
            item.label
        );
        // Before the output's check: the last repeat may be the one dropped.
        if let Some(dropped) = moved.get(&"flow_table".to_owned()).copied()
            && matches!(item.expect, Expect::Redirect)
            && moved.len() == 1
            && redirected + dropped == u64::from(repeat)
            && dropped <= u64::from(repeat / 1000).max(1)
        {
            return Err(NoRoom { label: item.label.clone(), dropped, repeat }.into());
        }
        self.check_output(item, &timed, repeat, c2.checked_sub(1))
            .with_context(|| format!("{}: output of the timed run (last repeat)", item.label))?;
        if matches!(item.expect, Expect::Redirect | Expect::SentBack) {
            ensure!(
                redirected == u64::from(repeat),
                "{}: {redirected} XDP redirects counted for {repeat} repeats (other counters that moved: {moved:?})",
                item.label
            );
        } else {
            ensure!(redirected == 0, "{}: {redirected} XDP redirects counted", item.label);
        }
        ensure!(moved.is_empty(), "{}: datapath counters moved during the timed run: {moved:?}", item.label);
        if let (Some(s), Some((nf0, in0, out0))) = (item.service, stats0) {
            let (nf1, in1, out1) = self.service_counters(s)?;
            let want_new = if new_flow { u64::from(repeat) } else { 0 };
            ensure!(
                nf1 - nf0 == want_new,
                "{}: {} new flows in {repeat} repeats, expected {want_new}",
                item.label,
                nf1 - nf0
            );
            let (moved, other) = if item.reply { (out1 - out0, in1 - in0) } else { (in1 - in0, out1 - out0) };
            ensure!(
                moved == u64::from(repeat) && other == 0,
                "{}: {moved} packets counted in the packet's direction and {other} in the other, in {repeat} repeats",
                item.label
            );
        }
        if answered_first(item) {
            let state = self.flow_state(item)?;
            let want = FLOW_REPLIED | FLOW_ESTABLISHED;
            ensure!(state & want == want, "{}: the flow is not established (state {state:#x})", item.label);
        }
        if new_flow {
            self.forget_run(item, c0..c2)?;
        }
        Ok(timed.sample)
    }

    /// Take the flows a new-flow run of `item` added (the harness's tuples
    /// `counters`) out of its table again, so that the table holds just
    /// its fill and the next case needs no emptying and refilling, which
    /// took most of a round (a fill of 1M flows and the removal of 1.5M,
    /// several times a round). Where that cannot be done exactly (a
    /// service whose flows take a reply entry too; the open-addressing
    /// table, emptied by a new epoch), the table is refilled as before.
    fn forget_run(&mut self, item: &Item, counters: std::ops::Range<u64>) -> anyhow::Result<()> {
        if is_ipv6(&item.frame) {
            // The harness alone (floor_pass) made no flows.
            return if item.prog == Prog::Lb { self.forget_run6(item, counters) } else { Ok(()) };
        }
        let (fd, w) = match item.prog {
            Prog::Lb if item.service != Some("maglev-shared") => (None, LB4),
            Prog::Table => (Some("FLOW_TABLE"), TABLE),
            Prog::Lru => (Some("FLOW_LRU"), LRU),
            _ => return Ok(()),
        };
        let f = Frame::parse(&item.frame)?;
        let base = u32::from(f.src);
        let keys: Vec<FlowKey> = counters
            .map(|n| FlowKey {
                src_addr: u32::from_ne_bytes(Ipv4Addr::from(base.wrapping_add((n >> 16) as u32)).octets()),
                dst_addr: u32::from_ne_bytes(f.dst.octets()),
                src_port: (n as u16).to_be(),
                dst_port: f.dport.to_be(),
                proto: lb_common::PROTO_TCP,
                _pad: [0; 3],
            })
            .collect();
        let removed = match fd {
            None => self.dp.forget_flows(&keys)?,
            Some(name) => {
                let map = self.bench.map(name).ok_or_else(|| anyhow!("{name}"))?;
                let fd = match map {
                    aya::maps::Map::LruHashMap(m) | aya::maps::Map::HashMap(m) => m.fd().as_fd(),
                    _ => anyhow::bail!("{name} is not a hash map"),
                };
                delete_flow_keys(fd, &keys).with_context(|| format!("taking a run's flows out of {name}"))?
            }
        };
        ensure!(
            removed == keys.len() as u64,
            "{}: {removed} of the run's {} new flows found in its table afterwards",
            item.label,
            keys.len()
        );
        self.filled[w] = Some(item.fill);
        Ok(())
    }

    /// `forget_run` for an IPv6 new-flow case: the flows are taken out
    /// of the IPv6 table, which keeps its fill.
    fn forget_run6(&mut self, item: &Item, counters: std::ops::Range<u64>) -> anyhow::Result<()> {
        let f = Frame6::parse(&item.frame)?;
        let src = words6(&f.src);
        let base = u32::from_be(src[3]);
        let keys: Vec<FlowKey6> = counters
            .map(|n| FlowKey6 {
                src_addr: [src[0], src[1], src[2], base.wrapping_add((n >> 16) as u32).to_be()],
                dst_addr: words6(&f.dst),
                src_port: (n as u16).to_be(),
                dst_port: f.dport.to_be(),
                proto: lb_common::PROTO_TCP,
                _pad: [0; 3],
            })
            .collect();
        let removed = self.dp.forget_flows6(&keys)?;
        ensure!(
            removed == keys.len() as u64,
            "{}: {removed} of the run's {} new flows found in the IPv6 table afterwards",
            item.label,
            keys.len()
        );
        self.filled[LB6] = Some(item.fill);
        Ok(())
    }

    /// Make the flow of `item`'s frame and pass its reply once (the
    /// backend's answer), checked: the next client packet establishes it.
    fn answer(&mut self, item: &Item) -> anyhow::Result<()> {
        let reply = self.reply_to(item)?;
        let r = self.run(&reply, 1)?;
        ensure!(r.retval == item.expect.retval(), "{}: the flow's reply returned {}", item.label, r.retval);
        ensure!(self.flow_state(item)? & FLOW_REPLIED != 0, "{}: the reply was not seen", item.label);
        Ok(())
    }

    /// Run `item`'s forward packet once (checked: it makes the flow), and
    /// return the case of its reply, from the backend the packet went to.
    fn reply_to(&mut self, item: &Item) -> anyhow::Result<Item> {
        // (A reply case's own frame is the forward one, sent as a client's.)
        let fwd = self.run(&Item { reply: false, ..item.clone() }, 1)?;
        ensure!(fwd.retval == item.expect.retval(), "{}: the forward packet returned {}", item.label, fwd.retval);
        let service = item.service.unwrap_or_default();
        let frame = if is_ipv6(&item.frame) {
            reply_frame6(&Frame6::parse(&item.frame)?, Frame6::parse(&fwd.out)?.dst, service)
        } else {
            reply_frame(&Frame::parse(&item.frame)?, Frame::parse(&fwd.out)?.dst, service)
        };
        Ok(Item { frame, reply: true, ..item.clone() })
    }

    /// The close/handshake state of the flow `item`'s frame opens.
    fn flow_state(&self, item: &Item) -> anyhow::Result<u64> {
        if is_ipv6(&item.frame) {
            let f = Frame6::parse(&item.frame)?;
            let key = FlowKey6 {
                src_addr: words6(&f.src),
                dst_addr: words6(&f.dst),
                src_port: f.sport.to_be(),
                dst_port: f.dport.to_be(),
                proto: if f.proto == lb_testkit::Proto::Udp { lb_common::PROTO_UDP } else { lb_common::PROTO_TCP },
                _pad: [0; 3],
            };
            let flow = self.dp.flow6(&key)?.ok_or_else(|| anyhow!("{}: no IPv6 flow-table entry", item.label))?;
            return Ok(flow.state);
        }
        let f = Frame::parse(&item.frame)?;
        let key = FlowKey {
            src_addr: u32::from_ne_bytes(f.src.octets()),
            dst_addr: u32::from_ne_bytes(f.dst.octets()),
            src_port: f.sport.to_be(),
            dst_port: f.dport.to_be(),
            proto: if f.proto == lb_testkit::Proto::Udp { lb_common::PROTO_UDP } else { lb_common::PROTO_TCP },
            _pad: [0; 3],
        };
        let flow = self.dp.flow(&key)?.ok_or_else(|| anyhow!("{}: no flow-table entry", item.label))?;
        Ok(flow.state)
    }
}

/// An IPv6 case's output (`check_output`'s redirect check): the frame
/// the program saw, sent to one of the service's backends (a reply: to
/// the client, from the VIP) with its hop limit one less, from the
/// gateway's MAC on that side. Parsed, its
/// TCP/UDP checksum verified (etherparse) and compared byte for byte with
/// one built from scratch.
fn check_redirect6(item: &Item, seen: &[u8], out: &[u8]) -> anyhow::Result<()> {
    let what = &item.label;
    let got = Frame6::parse(out).with_context(|| format!("{what}: output {out:02x?}"))?;
    let orig = Frame6::parse(seen).with_context(|| format!("{what}: the frame the program saw"))?;
    if item.reply {
        // Back to the client, from the VIP.
        let want =
            Frame6 { dmac: CLIENT_MAC, smac: GW_A_MAC, src: VIP6, sport: 80, hop_limit: orig.hop_limit - 1, ..orig }
                .bytes();
        ensure!(
            out == want,
            "{what}: output differs from the expected reply (checksum recomputed from scratch)\n want {want:02x?}\n out  {out:02x?}"
        );
        return Ok(());
    }
    let (dst, dport) = (got.dst, got.dport);
    let port = backend_port(item.service.unwrap_or_default());
    ensure!(BACKENDS6.contains(&dst), "{what}: destination {dst} is not a backend");
    ensure!(dport == port, "{what}: destination port {dport}, expected {port}");
    let want =
        Frame6 { dmac: backend_mac6(dst), smac: GW_B_MAC, dst, dport: port, hop_limit: orig.hop_limit - 1, ..orig }
            .bytes();
    ensure!(
        out == want,
        "{what}: output differs from the expected frame (checksum recomputed from scratch)\n want {want:02x?}\n out  {out:02x?}"
    );
    Ok(())
}

/// What [`Bench::weight_changes`] measured.
pub(crate) struct WeightChanges {
    /// Milliseconds from the apply to the change being live, each change.
    pub ms: Vec<f64>,
    /// New-flow packets the datapath took around the changes (from
    /// before each apply began until after it returned).
    pub packets: u64,
    /// Of them, those in calls that overlapped an apply.
    pub during_apply: u64,
    /// Of them, those whose run returned anything but XDP_REDIRECT.
    pub not_redirected: u64,
    /// Of them, the ones that did not leave by XDP redirect as a counted
    /// new flow of the service (dropped, or sent to the kernel).
    pub lost: u64,
    /// The CPU the applies ran on (the packets ran on the bench's CPU).
    pub apply_cpu: usize,
}

/// Repeats per BPF_PROG_TEST_RUN call of the traffic during a weight
/// change: one. A call with more than one repeat switches the kernel's
/// XDP dispatcher to the program and back (about 18 ms a call here,
/// whatever the repeat count), which would leave a few calls per change.
const TRAFFIC_REPEAT: u32 = 1;

/// New flows through the harness (already set up with the frame and the
/// datapath in its slot), one packet a call, until `running` is cleared;
/// when each call started and ended, and whether its packet left by XDP
/// redirect.
fn send_until(
    harness: &Xdp,
    frame: &[u8],
    if_a: u32,
    cpu: usize,
    running: &AtomicBool,
) -> anyhow::Result<Vec<(Instant, Instant, bool)>> {
    pin_to(cpu)?;
    let ctx = xdp_ctx(frame.len(), if_a);
    let mut out = vec![0u8; frame.len() + 256];
    let mut calls = Vec::new();
    while running.load(Ordering::Relaxed) {
        let t = Instant::now();
        let res = harness
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat: TRAFFIC_REPEAT,
                ..TestRunOptions::new()
            })
            .context("BPF_PROG_TEST_RUN during a weight change")?;
        calls.push((t, Instant::now(), res.return_value == XDP_REDIRECT));
    }
    Ok(calls)
}

/// A CPU other than `cpu` that this thread may run on (`cpu` itself on a
/// one-CPU machine).
fn other_cpu(cpu: usize) -> usize {
    let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let online = nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .map_or(n, |v| usize::try_from(v).unwrap_or(n));
    (0..online).find(|&c| c != cpu).unwrap_or(cpu)
}

/// The source and destination addresses of an IPv4 or IPv6 frame, read
/// by the shared test-frame parsers.
fn frame_addrs(f: &[u8]) -> Option<[std::net::IpAddr; 2]> {
    match Frame::parse(f) {
        Ok(v4) => Some([v4.src.into(), v4.dst.into()]),
        Err(_) => Frame6::parse(f).ok().map(|v6| [v6.src.into(), v6.dst.into()]),
    }
}

/// What sweeping a full flow table cost (`Bench::sweep_cost`), ms.
pub(crate) struct SweepCost {
    pub(crate) flows: u64,
    /// A sweep with nothing idle, and one that expires every flow.
    pub(crate) read_ms: f64,
    pub(crate) expire_ms: f64,
    /// The baseline: read, then a lookup and a delete syscall per flow.
    pub(crate) syscalls_ms: f64,
    /// The longest part of either sweep.
    pub(crate) longest_part_ms: f64,
}

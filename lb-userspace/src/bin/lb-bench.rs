//! `lb-bench packet`: what one packet costs in the XDP program, measured
//! with BPF_PROG_TEST_RUN and a large repeat count.
//!
//! Method (run as root):
//!
//! - A private network namespace (`lbbench-<pid>`, deleted on exit, also on
//!   panic) with a veth pair `gwa`/`gwb`, routes and static neighbours for
//!   the client and three backends, so that `bpf_fib_lookup` succeeds and a
//!   VIP packet takes the full path up to XDP_REDIRECT. The measuring thread
//!   enters it and is pinned to one CPU.
//! - The datapath is loaded as lbd loads it (`Dataplane::load_unpinned`,
//!   flow table for 4M connections) with one VIP port per scheduler.
//! - With `repeat N` the kernel runs all N repeats on one buffer without
//!   restoring it: a rewriting program would see its own output from the
//!   second repeat on. So every case runs through `bench_harness` (lb-ebpf
//!   `src/bin/bench-floor.rs`), which copies the original frame back,
//!   optionally makes it a new flow (fresh source address and port), and
//!   tail-calls the program under test. The harness's own cost is measured
//!   the same way with `floor_pass` behind it and subtracted:
//!   `cost = t(harness -> program) - (t(harness -> floor_pass) - t(floor_pass))`,
//!   i.e. what a direct run of the program on a fresh packet costs, the
//!   test loop's own overhead included (as in the floors).
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
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    time::Instant,
};

use anyhow::{Context as _, anyhow, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray, ProgramArray},
    programs::{ProgramFd, TestRun as _, TestRunOptions, Xdp},
};
use clap::{Args, Parser, Subcommand};
use lb_userspace::{
    config::{BackendConfig, Config, Protocol, ServiceConfig, XdpMode},
    dataplane::Dataplane,
    sched::Scheduler,
};
use serde_json::{Value, json};

/// floor_pass, floor_tx and bench_harness, built by build.rs.
static BENCH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bench-floor"));

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

/// Harness modes (`bench-floor.rs`).
const MODE_RESTORE: u32 = 0;
const MODE_NEW_TCP: u32 = 1;
/// Largest frame the harness restores.
const FRAME_MAX: usize = 128;
/// Every test frame is this long (payload padded): whole 8-byte words, so
/// the harness restores each with the same word stores and its cost,
/// measured once, is the same for every case.
const FRAME_LEN: usize = 96;

const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x01];
const GW_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
const GW_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];
const VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 100);
const NON_VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 7);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 1, 1);
/// New flows: the harness adds (n >> 16) to this address, port = n & 0xffff.
const NEW_FLOW_BASE: Ipv4Addr = Ipv4Addr::new(10, 10, 64, 1);
const BACKEND_PORT: u16 = 8080;
const BACKENDS: [Ipv4Addr; 3] =
    [Ipv4Addr::new(10, 20, 0, 11), Ipv4Addr::new(10, 20, 0, 12), Ipv4Addr::new(10, 20, 0, 13)];
const CONNTRACK_MAX: u32 = 4 << 20;

fn backend_mac(addr: Ipv4Addr) -> [u8; 6] {
    [0x02, 0, 0, 0, 0x02, addr.octets()[3]]
}

/// Katran's XDP balancer on this kernel, same method (from the issue).
mod katran {
    pub const ESTABLISHED: f64 = 58.5;
    pub const NEW_FLOW: f64 = 160.0;
    pub const NON_VIP: f64 = 26.5;
    pub const FLOOR_TX: f64 = 6.0;
    pub const TEXT: &str = "Katran's XDP balancer (IPIP encapsulation, no FIB lookup) on this kernel, same method: \
established flow about 55-62 ns, new flow with LRU insert about 160 ns, non-VIP packet 26-27 ns; floor XDP_TX about 6 ns.";
}

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
struct PacketArgs {
    /// Measured rounds (interleaved across cases; median and min-max reported).
    #[arg(long, default_value_t = 7)]
    rounds: u32,
    /// Repeats per BPF_PROG_TEST_RUN call.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Write every round of every case, medians and ratios to this file.
    #[arg(long, value_name = "OUT.json")]
    json: Option<PathBuf>,
    /// CPU to pin the measuring thread to (default: the last one allowed).
    #[arg(long)]
    cpu: Option<usize>,
    /// Leave kernel.bpf_stats_enabled as it is (by default it is turned off
    /// for the run: with it every run reads the clock twice more).
    #[arg(long)]
    keep_bpf_stats: bool,
    /// Measure only these cases (comma-separated keys, e.g.
    /// `tcp_established,non_vip`); the floors and the harness are always
    /// measured. Keys: tcp_established, new_maglev, new_wrr, new_rr,
    /// new_source_hash, new_least_conn, udp_established, ipv6, non_vip.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Flow table size in connections (two entries each). Default 4M, or
    /// more when --repeat needs it: a new-flow run must never evict.
    #[arg(long)]
    conntrack_max: Option<u32>,
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

// ------------------------------------------------------------------ netns

/// The benchmark's network namespace; deleted on drop.
struct Netns {
    name: String,
}

fn sh(cmd: &str) -> anyhow::Result<()> {
    let args: Vec<&str> = cmd.split(' ').collect();
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("spawn {}", args[0]))?;
    ensure!(out.status.success(), "`{cmd}` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

impl Netns {
    fn create() -> anyhow::Result<Self> {
        // Namespaces left by an lb-bench that was killed (no destructor ran).
        if let Ok(rd) = std::fs::read_dir("/run/netns") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("lbbench-")
                    && !Path::new("/proc").join(pid).exists()
                {
                    let _ = Command::new("ip").args(["netns", "del", &name]).output();
                }
            }
        }
        let name = format!("lbbench-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&format!("ip netns add {name}"))?;
        let ns = Self { name };
        let n = &ns.name;
        let mut cmds = vec![
            format!(
                "ip -n {n} link add name gwa address {} type veth peer name gwb address {}",
                mac_str(GW_A_MAC),
                mac_str(GW_B_MAC)
            ),
            format!("ip -n {n} link set lo up"),
            format!("ip -n {n} link set dev gwa up"),
            format!("ip -n {n} link set dev gwb up"),
            format!("ip -n {n} addr add 10.10.0.1/16 dev gwa"),
            format!("ip -n {n} addr add 10.20.0.1/24 dev gwb"),
            format!("ip -n {n} neigh replace {CLIENT} lladdr {} dev gwa nud permanent", mac_str(CLIENT_MAC)),
            format!("ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"),
        ];
        for b in BACKENDS {
            cmds.push(format!("ip -n {n} neigh replace {b} lladdr {} dev gwb nud permanent", mac_str(backend_mac(b))));
        }
        for c in cmds {
            sh(&c)?;
        }
        Ok(ns)
    }
}

/// Move the calling thread into namespace `name`.
fn enter_netns(name: &str) -> anyhow::Result<()> {
    let path = Path::new("/run/netns").join(name);
    let file = std::fs::File::open(&path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: setns on the calling thread with a valid namespace fd.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    ensure!(rc == 0, "setns: {}", std::io::Error::last_os_error());
    Ok(())
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

fn ifindex(name: &str) -> anyhow::Result<u32> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: valid C string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    ensure!(i != 0, "interface {name} not found");
    Ok(i)
}

/// Pin the calling thread to `cpu`, or to the last CPU it may run on.
fn pin_thread(cpu: Option<usize>) -> anyhow::Result<usize> {
    // SAFETY: plain syscalls on a zeroed cpu_set_t of the right size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        ensure!(
            libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) == 0,
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        );
        let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
        let cpu = match cpu {
            Some(c) => {
                ensure!(allowed.contains(&c), "CPU {c} is not in this process's affinity mask {allowed:?}");
                c
            }
            None => *allowed.last().ok_or_else(|| anyhow!("empty CPU affinity mask"))?,
        };
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        ensure!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &one) == 0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
        Ok(cpu)
    }
}

// ------------------------------------------------------------------ frames

/// An HTTP-ish payload of `n` bytes.
fn payload(n: usize) -> Vec<u8> {
    let mut p = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n".to_vec();
    p.resize(n, b'x');
    p
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        sum += u32::from(if c.len() == 2 { u16::from_be_bytes([c[0], c[1]]) } else { u16::from(c[0]) << 8 });
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet + IPv4 (no options) + TCP/UDP frame, built from scratch
/// (all checksums computed in full).
#[derive(Clone, Debug)]
struct Frame4 {
    dmac: [u8; 6],
    smac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    /// 6 or 17.
    proto: u8,
    ttl: u8,
    tcp_flags: u8,
    payload: Vec<u8>,
}

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

impl Frame4 {
    fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Self {
        Self {
            dmac: GW_A_MAC,
            smac: CLIENT_MAC,
            src,
            dst,
            sport,
            dport,
            proto: 6,
            ttl: 64,
            tcp_flags: flags,
            payload: payload(FRAME_LEN - 54),
        }
    }

    fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Self {
        Self { proto: 17, tcp_flags: 0, payload: payload(FRAME_LEN - 42), ..Self::tcp(src, sport, dst, dport, 0) }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend(self.sport.to_be_bytes());
        l4.extend(self.dport.to_be_bytes());
        let check_at = if self.proto == 6 {
            l4.extend(1000u32.to_be_bytes());
            l4.extend(if self.tcp_flags & TCP_ACK != 0 { 5000u32 } else { 0 }.to_be_bytes());
            l4.extend([5 << 4, self.tcp_flags]);
            l4.extend(64240u16.to_be_bytes());
            l4.extend([0, 0, 0, 0]);
            16
        } else {
            l4.extend((8 + self.payload.len() as u16).to_be_bytes());
            l4.extend([0, 0]);
            6
        };
        l4.extend(&self.payload);
        let mut pseudo = Vec::new();
        pseudo.extend(self.src.octets());
        pseudo.extend(self.dst.octets());
        pseudo.extend([0, self.proto]);
        pseudo.extend((l4.len() as u16).to_be_bytes());
        pseudo.extend(&l4);
        let mut c = checksum(&pseudo);
        if self.proto == 17 && c == 0 {
            c = 0xffff;
        }
        l4[check_at..check_at + 2].copy_from_slice(&c.to_be_bytes());
        let mut ip = vec![0x45, 0];
        ip.extend(((20 + l4.len()) as u16).to_be_bytes());
        ip.extend([0x12, 0x34, 0x40, 0x00, self.ttl, self.proto, 0, 0]);
        ip.extend(self.src.octets());
        ip.extend(self.dst.octets());
        let c = checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = Vec::new();
        f.extend(self.dmac);
        f.extend(self.smac);
        f.extend(0x0800u16.to_be_bytes());
        f.extend(ip);
        f.extend(l4);
        f
    }

    /// Parse the fields this benchmark varies back out of a frame.
    fn addrs(frame: &[u8]) -> (Ipv4Addr, u16, Ipv4Addr, u16) {
        let a = |o: usize| Ipv4Addr::new(frame[o], frame[o + 1], frame[o + 2], frame[o + 3]);
        let p = |o: usize| u16::from_be_bytes([frame[o], frame[o + 1]]);
        (a(26), p(34), a(30), p(36))
    }
}

/// An IPv6 TCP segment to `dst` (the datapath is IPv4-only and passes it).
fn frame6_tcp(src: Ipv6Addr, dst: Ipv6Addr, sport: u16, dport: u16) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend(sport.to_be_bytes());
    l4.extend(dport.to_be_bytes());
    l4.extend(1000u32.to_be_bytes());
    l4.extend(5000u32.to_be_bytes());
    l4.extend([5 << 4, TCP_ACK]);
    l4.extend(64240u16.to_be_bytes());
    l4.extend([0, 0, 0, 0]);
    l4.extend(payload(FRAME_LEN - 74));
    let mut pseudo = Vec::new();
    pseudo.extend(src.octets());
    pseudo.extend(dst.octets());
    pseudo.extend((l4.len() as u32).to_be_bytes());
    pseudo.extend([0, 0, 0, 6]);
    pseudo.extend(&l4);
    let c = checksum(&pseudo);
    l4[16..18].copy_from_slice(&c.to_be_bytes());
    let mut f = Vec::new();
    f.extend(GW_A_MAC);
    f.extend(CLIENT_MAC);
    f.extend(0x86ddu16.to_be_bytes());
    f.extend([0x60, 0, 0, 0]);
    f.extend((l4.len() as u16).to_be_bytes());
    f.extend([6, 64]);
    f.extend(src.octets());
    f.extend(dst.octets());
    f.extend(l4);
    f
}

// ------------------------------------------------------------------ cases

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prog {
    Lb,
    FloorPass,
    FloorTx,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// BPF_PROG_TEST_RUN on the program itself.
    Direct,
    /// Through the harness in this mode (restore / new flow).
    Harness(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// XDP_REDIRECT to one of the backends.
    Redirect,
    /// XDP_PASS, frame untouched.
    Pass,
    /// XDP_TX with the MAC addresses swapped.
    Tx,
}

/// One thing timed every round.
struct Item {
    key: &'static str,
    label: String,
    path: &'static str,
    prog: Prog,
    via: Via,
    frame: Vec<u8>,
    expect: Expect,
    /// Service whose counters must move (VIP cases).
    service: Option<&'static str>,
    katran: Option<f64>,
}

/// One timed run.
#[derive(Clone, Copy, Debug)]
struct Sample {
    /// The kernel's mean time per repeat, truncated to whole ns.
    kernel_ns: u32,
    /// The figure used: `kernel_ns + 0.5`, the middle of the interval the
    /// truncated mean stands for (so that it is not biased low).
    ns: f64,
    /// Wall time of the whole syscall, ms (for information: it includes the
    /// kernel's setup, two XDP dispatcher updates with RCU grace periods).
    wall_ms: f64,
}

struct RunOut {
    retval: u32,
    out: Vec<u8>,
    sample: Sample,
}

fn services() -> Vec<ServiceConfig> {
    let svc = |name: &str, port: u16, protocol: Protocol, scheduler: Scheduler| ServiceConfig {
        name: name.into(),
        vip: VIP,
        port,
        protocol,
        scheduler,
        table_size: 65537,
        health: Default::default(),
        slow_start: None,
        backends: BACKENDS
            .iter()
            .map(|&address| BackendConfig { address, port: BACKEND_PORT, weight: 1, drain: false })
            .collect(),
    };
    vec![
        svc("maglev", 80, Protocol::Tcp, Scheduler::Maglev),
        svc("wrr", 81, Protocol::Tcp, Scheduler::Wrr),
        svc("rr", 82, Protocol::Tcp, Scheduler::Rr),
        svc("source-hash", 83, Protocol::Tcp, Scheduler::SourceHash),
        svc("least-conn", 84, Protocol::Tcp, Scheduler::LeastConn),
        svc("dns", 53, Protocol::Udp, Scheduler::Maglev),
    ]
}

fn items() -> Vec<Item> {
    let est = Frame4::tcp(CLIENT, 40000, VIP, 80, TCP_ACK).bytes();
    let mut v = vec![
        Item {
            key: "floor_pass",
            label: "floor: XDP_PASS".into(),
            path: "return XDP_PASS",
            prog: Prog::FloorPass,
            via: Via::Direct,
            frame: est.clone(),
            expect: Expect::Pass,
            service: None,
            katran: None,
        },
        Item {
            key: "floor_tx",
            label: "floor: swap MACs, XDP_TX".into(),
            path: "swap MACs, XDP_TX",
            prog: Prog::FloorTx,
            via: Via::Direct,
            frame: est.clone(),
            expect: Expect::Tx,
            service: None,
            katran: Some(katran::FLOOR_TX),
        },
        Item {
            key: "harness_restore",
            label: "harness (restore) -> floor_pass".into(),
            path: "",
            prog: Prog::FloorPass,
            via: Via::Harness(MODE_RESTORE),
            frame: est.clone(),
            expect: Expect::Pass,
            service: None,
            katran: None,
        },
        Item {
            key: "harness_tx",
            label: "harness (restore) -> floor_tx".into(),
            path: "",
            prog: Prog::FloorTx,
            via: Via::Harness(MODE_RESTORE),
            frame: est.clone(),
            expect: Expect::Tx,
            service: None,
            katran: None,
        },
        Item {
            key: "harness_new",
            label: "harness (new flow) -> floor_pass".into(),
            path: "",
            prog: Prog::FloorPass,
            via: Via::Harness(MODE_NEW_TCP),
            frame: Frame4::tcp(NEW_FLOW_BASE, 1, VIP, 80, TCP_SYN).bytes(),
            expect: Expect::Pass,
            service: None,
            katran: None,
        },
        Item {
            key: "tcp_established",
            label: "TCP established flow (maglev)".into(),
            path: "flow hit, NAT, FIB, REDIRECT",
            prog: Prog::Lb,
            via: Via::Harness(MODE_RESTORE),
            frame: est,
            expect: Expect::Redirect,
            service: Some("maglev"),
            katran: Some(katran::ESTABLISHED),
        },
    ];
    for (key, name, port) in [
        ("new_maglev", "maglev", 80),
        ("new_wrr", "wrr", 81),
        ("new_rr", "rr", 82),
        ("new_source_hash", "source-hash", 83),
        ("new_least_conn", "least-conn", 84),
    ] {
        v.push(Item {
            key,
            label: format!("TCP new flow, {name}"),
            path: "flow miss, VIP, pick, 2 inserts, NAT, FIB, REDIRECT",
            prog: Prog::Lb,
            via: Via::Harness(MODE_NEW_TCP),
            frame: Frame4::tcp(NEW_FLOW_BASE, 1, VIP, port, TCP_SYN).bytes(),
            expect: Expect::Redirect,
            service: Some(name),
            katran: Some(katran::NEW_FLOW),
        });
    }
    v.push(Item {
        key: "udp_established",
        label: "UDP established flow (maglev)".into(),
        path: "flow hit, NAT, FIB, REDIRECT",
        prog: Prog::Lb,
        via: Via::Harness(MODE_RESTORE),
        frame: Frame4::udp(CLIENT, 5353, VIP, 53).bytes(),
        expect: Expect::Redirect,
        service: Some("dns"),
        katran: Some(katran::ESTABLISHED),
    });
    v.push(Item {
        key: "ipv6",
        label: "IPv6 TCP packet".into(),
        path: "not IPv4: PASS",
        prog: Prog::Lb,
        via: Via::Harness(MODE_RESTORE),
        frame: frame6_tcp("fd00::1".parse().expect("literal"), "fd00::64".parse().expect("literal"), 40000, 80),
        expect: Expect::Pass,
        service: None,
        katran: None,
    });
    v.push(Item {
        key: "non_vip",
        label: "IPv4 TCP, not a VIP".into(),
        path: "flow miss, VIP miss: PASS",
        prog: Prog::Lb,
        via: Via::Harness(MODE_RESTORE),
        frame: Frame4::tcp(CLIENT, 40000, NON_VIP, 80, TCP_ACK).bytes(),
        expect: Expect::Pass,
        service: None,
        katran: Some(katran::NON_VIP),
    });
    for i in &v {
        assert_eq!(i.frame.len(), FRAME_LEN, "{}: frame length", i.key);
    }
    v
}

// ------------------------------------------------------------------ bench

#[repr(C)]
#[derive(Clone, Copy)]
struct HarnessConfig {
    len: u32,
    mode: u32,
}
// SAFETY: repr(C), two u32, no padding.
unsafe impl aya::Pod for HarnessConfig {}

struct Bench {
    dp: Dataplane,
    bench: Ebpf,
    lb_fd: ProgramFd,
    pass_fd: ProgramFd,
    tx_fd: ProgramFd,
    /// What PROG_ARRAY slot 0 holds now.
    slot: Option<Prog>,
    if_a: u32,
    cpu: usize,
    conntrack_max: u32,
}

fn xdp<'a>(ebpf: &'a Ebpf, name: &str) -> anyhow::Result<&'a Xdp> {
    let p = ebpf.program(name).ok_or_else(|| anyhow!("program {name} missing from the object"))?;
    Ok(<&Xdp>::try_from(p)?)
}

impl Bench {
    fn new(cpu: usize, conntrack_max: u32) -> anyhow::Result<Self> {
        let cfg = Config {
            interfaces: vec![],
            xdp_mode: XdpMode::Auto,
            control_socket: "/nonexistent".into(),
            pin_path: "/nonexistent".into(),
            conntrack_max,
            table_capacity: 1 << 20,
            tcp_idle_timeout: 900,
            udp_idle_timeout: 300,
            metrics_listen: "127.0.0.1:9464".parse()?,
            services: services(),
        };
        let mut dp = Dataplane::load_unpinned(&cfg).context("loading the datapath")?;
        dp.apply_admin(&cfg.services).context("programming the services")?;
        // Both veths take native redirects (what lbd writes for a gateway
        // whose veth peers have GRO on), so the measured path is the fast one.
        let xmit = lb_common::NETDEV_F_XMIT_GENERIC | lb_common::NETDEV_F_XMIT_NATIVE;
        dp.write_netdevs(&[(ifindex("gwa")?, xmit), (ifindex("gwb")?, xmit)].into_iter().collect())
            .context("describing the devices")?;
        let mut bench = EbpfLoader::new().load(BENCH_OBJECT).context("loading the benchmark programs")?;
        for name in ["floor_pass", "floor_tx", "bench_harness"] {
            let p: &mut Xdp =
                bench.program_mut(name).ok_or_else(|| anyhow!("program {name} missing from the object"))?.try_into()?;
            p.load().with_context(|| format!("loading {name}"))?;
        }
        let lb_fd = dp.program().fd()?.try_clone()?;
        let pass_fd = xdp(&bench, "floor_pass")?.fd()?.try_clone()?;
        let tx_fd = xdp(&bench, "floor_tx")?.fd()?.try_clone()?;
        Ok(Self { dp, bench, lb_fd, pass_fd, tx_fd, slot: None, if_a: ifindex("gwa")?, cpu, conntrack_max })
    }

    fn set_slot(&mut self, prog: Prog) -> anyhow::Result<()> {
        if self.slot == Some(prog) {
            return Ok(());
        }
        let fd = match prog {
            Prog::Lb => &self.lb_fd,
            Prog::FloorPass => &self.pass_fd,
            Prog::FloorTx => &self.tx_fd,
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

    /// Empty the flow table (BPF_MAP_LOOKUP_AND_DELETE_BATCH).
    fn flush_flows(&mut self) -> anyhow::Result<u64> {
        let fd = self.dp.flow_table_fd().as_raw_fd();
        flush_hash_map(fd, size_of::<lb_common::FlowKey>(), size_of::<lb_common::Flow>())
    }

    /// One BPF_PROG_TEST_RUN of `item` with `repeat` repeats.
    fn run(&mut self, item: &Item, repeat: u32) -> anyhow::Result<RunOut> {
        let prog: &Xdp = match item.via {
            Via::Direct => match item.prog {
                Prog::FloorPass => xdp(&self.bench, "floor_pass")?,
                Prog::FloorTx => xdp(&self.bench, "floor_tx")?,
                Prog::Lb => self.dp.program(),
            },
            Via::Harness(mode) => {
                self.set_slot(item.prog)?;
                self.set_frame(&item.frame, mode)?;
                xdp(&self.bench, "bench_harness")?
            }
        };
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(item.frame.len() as u32).to_ne_bytes()); // data_end
        ctx[12..16].copy_from_slice(&self.if_a.to_ne_bytes()); // ingress_ifindex
        let mut out = vec![0u8; item.frame.len() + 256];
        ensure!(!interrupted(), "interrupted");
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
        Ok(RunOut { retval: res.return_value, out, sample })
    }

    fn service_counters(&self, service: &str) -> anyhow::Result<(u64, u64)> {
        let s = self
            .dp
            .services()
            .find(|s| s.config.name == service)
            .ok_or_else(|| anyhow!("service {service} not applied"))?;
        let (mut new_flows, mut packets) = (0, 0);
        for b in &s.backends {
            let st = self.dp.backend_stats(b.id)?;
            new_flows += st.new_flows;
            packets += st.packets_in;
        }
        Ok((new_flows, packets))
    }

    /// Check one run's return value and output frame. For a new flow, the
    /// harness gave the last repeat the source derived from `counter_last`.
    fn check_output(&self, item: &Item, r: &RunOut, repeat: u32, counter_last: Option<u64>) -> anyhow::Result<()> {
        let what = &item.label;
        // The frame the program under test saw: for a new flow the harness
        // gave it the source derived from its counter (built here from
        // scratch, so the harness's incremental checksums are checked too).
        let seen = if item.via == Via::Harness(MODE_NEW_TCP) {
            let n = counter_last.ok_or_else(|| anyhow!("{what}: no harness counter"))?;
            let orig = parse_frame4(&item.frame)?;
            Frame4 { src: Ipv4Addr::from(u32::from(orig.src).wrapping_add((n >> 16) as u32)), sport: n as u16, ..orig }
                .bytes()
        } else {
            item.frame.clone()
        };
        ensure!(r.out.len() == seen.len(), "{what}: output length {} != {}", r.out.len(), seen.len());
        match item.expect {
            Expect::Pass => {
                ensure!(r.retval == XDP_PASS, "{what}: returned {} instead of XDP_PASS (2)", r.retval);
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
            Expect::Redirect => {
                ensure!(
                    r.retval == XDP_REDIRECT,
                    "{what}: returned {} instead of XDP_REDIRECT (4): the measured path is not the forwarding path",
                    r.retval
                );
                let (_, _, dst, dport) = Frame4::addrs(&r.out);
                ensure!(BACKENDS.contains(&dst), "{what}: destination {dst} is not a backend");
                ensure!(dport == BACKEND_PORT, "{what}: destination port {dport}, expected {BACKEND_PORT}");
                let orig = parse_frame4(&seen)?;
                let want = Frame4 {
                    dmac: backend_mac(dst),
                    smac: GW_B_MAC,
                    dst,
                    dport: BACKEND_PORT,
                    ttl: orig.ttl - 1,
                    ..orig
                }
                .bytes();
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
    fn self_test(&mut self) -> anyhow::Result<()> {
        let frames = [
            Frame4::tcp(CLIENT, 40000, VIP, 80, TCP_ACK).bytes(),
            Frame4 { payload: payload(17), ..Frame4::udp(CLIENT, 5353, VIP, 53) }.bytes(),
        ];
        self.set_slot(Prog::FloorPass)?;
        for f in frames {
            self.set_frame(&f, MODE_RESTORE)?;
            let garbage = vec![0xa5u8; f.len()];
            let mut ctx = [0u8; 24];
            ctx[4..8].copy_from_slice(&(f.len() as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&self.if_a.to_ne_bytes());
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
    fn measure(&mut self, item: &Item, repeat: u32) -> anyhow::Result<Sample> {
        let is_lb = item.prog == Prog::Lb;
        if is_lb {
            self.flush_flows()?;
        }
        let new_flow = item.via == Via::Harness(MODE_NEW_TCP);
        // Checked single run (inserts the flow of an established case).
        let c0 = self.new_flow_counter()?;
        let once = self.run(item, 1)?;
        let c1 = self.new_flow_counter()?;
        if new_flow {
            ensure!(c1 == c0 + 1, "{}: harness counter moved by {} in one run", item.label, c1 - c0);
        }
        self.check_output(item, &once, 1, c1.checked_sub(1))?;

        let stats0 = match item.service {
            Some(s) => Some(self.service_counters(s)?),
            None => None,
        };
        let global0 = self.dp.counters()?;
        let timed = self.run(item, repeat)?;
        let c2 = self.new_flow_counter()?;
        if new_flow {
            ensure!(c2 == c1 + u64::from(repeat), "{}: harness counter moved by {}, not {repeat}", item.label, c2 - c1);
        }
        self.check_output(item, &timed, repeat, c2.checked_sub(1))
            .with_context(|| format!("{}: output of the timed run (last repeat)", item.label))?;
        let global1 = self.dp.counters()?;
        let mut moved: BTreeMap<&String, u64> =
            global1.iter().filter(|&(k, v)| global0.get(k) != Some(v)).map(|(k, v)| (k, v - global0[k])).collect();
        // A forwarded packet counts one XDP redirect; nothing else may move
        // (a drop, a kernel-path hand-over: not the path meant to be timed).
        let redirected = moved.remove(&"xdp_redirect".to_owned()).unwrap_or(0);
        if matches!(item.expect, Expect::Redirect) {
            ensure!(
                redirected == u64::from(repeat),
                "{}: {redirected} XDP redirects counted for {repeat} repeats",
                item.label
            );
        } else {
            ensure!(redirected == 0, "{}: {redirected} XDP redirects counted", item.label);
        }
        ensure!(moved.is_empty(), "{}: datapath counters moved during the timed run: {moved:?}", item.label);
        if let (Some(s), Some((nf0, p0))) = (item.service, stats0) {
            let (nf1, p1) = self.service_counters(s)?;
            let want_new = if new_flow { u64::from(repeat) } else { 0 };
            ensure!(
                nf1 - nf0 == want_new,
                "{}: {} new flows in {repeat} repeats, expected {want_new}",
                item.label,
                nf1 - nf0
            );
            ensure!(p1 - p0 == u64::from(repeat), "{}: {} packets forwarded in {repeat} repeats", item.label, p1 - p0);
        }
        Ok(timed.sample)
    }
}

fn parse_frame4(f: &[u8]) -> anyhow::Result<Frame4> {
    ensure!(f.len() >= 42 && f[12..14] == [8, 0] && f[14] == 0x45, "not an IPv4 frame without options");
    let (src, sport, dst, dport) = Frame4::addrs(f);
    let proto = f[23];
    let l4_hdr = if proto == 6 { 20 } else { 8 };
    let payload = f[34 + l4_hdr..].to_vec();
    Ok(Frame4 {
        dmac: f[..6].try_into()?,
        smac: f[6..12].try_into()?,
        src,
        dst,
        sport,
        dport,
        proto,
        ttl: f[22],
        tcp_flags: if proto == 6 { f[47] } else { 0 },
        payload,
    })
}

/// Delete every entry of a hash map with BPF_MAP_LOOKUP_AND_DELETE_BATCH.
fn flush_hash_map(fd: i32, key_size: usize, value_size: usize) -> anyhow::Result<u64> {
    /// The `batch` member of `union bpf_attr`.
    #[repr(C)]
    #[derive(Default)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    const BPF_MAP_LOOKUP_AND_DELETE_BATCH: libc::c_long = 25;
    const CHUNK: usize = 1 << 14;
    let mut keys = vec![0u8; CHUNK * key_size];
    let mut values = vec![0u8; CHUNK * value_size];
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut first = true;
    let mut total = 0u64;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &raw const token_in as u64 },
            out_batch: &raw mut token_out as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        // SAFETY: a valid attr for this command; every buffer outlives the call.
        let rc = unsafe {
            libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_AND_DELETE_BATCH, &raw mut attr, size_of::<BatchAttr>())
        };
        let err = std::io::Error::last_os_error();
        total += u64::from(attr.count);
        if rc != 0 {
            if err.raw_os_error() == Some(libc::ENOENT) {
                return Ok(total);
            }
            bail!("emptying the flow table: {err}");
        }
        first = false;
        token_in = token_out;
    }
}

// ------------------------------------------------------------------ stats

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn kernel_release() -> (String, String) {
    // SAFETY: zeroed utsname filled by the kernel.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a plain libc call with valid arguments; it has no other preconditions.
    if unsafe { libc::uname(&mut u) } != 0 {
        return ("?".into(), "?".into());
    }
    let s = |f: &[libc::c_char]| {
        // SAFETY: uname NUL-terminates every field.
        unsafe { std::ffi::CStr::from_ptr(f.as_ptr()) }.to_string_lossy().into_owned()
    };
    let full = format!("{} {} {} {}", s(&u.sysname), s(&u.release), s(&u.version), s(&u.machine));
    (s(&u.release), full)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "?".into())
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_owned()).unwrap_or_else(|_| "?".into())
}

// ------------------------------------------------------------------ main flow

/// Set by SIGINT/SIGTERM: stop between runs, clean up (namespace, sysctl).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// What the report says about the machine, read by the main thread (the
/// measuring thread sits in a namespace without the net.core sysctls).
struct HostInfo {
    bpf_stats_before: String,
    bpf_stats_during: String,
    bpf_jit_enable: String,
}

/// Restores kernel.bpf_stats_enabled on drop.
struct StatsOff {
    old: String,
}

impl Drop for StatsOff {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(BPF_STATS_SYSCTL, &self.old) {
            eprintln!("lb-bench: restoring kernel.bpf_stats_enabled={}: {e}", self.old);
        }
    }
}

/// Flow table size: 4M connections, more when one run makes more new flows
/// (each takes two entries), so that no insert ever evicts.
fn conntrack_max(args: &PacketArgs) -> anyhow::Result<u32> {
    let need = args.repeat + 16;
    match args.conntrack_max {
        Some(n) => {
            ensure!(n >= need, "--conntrack-max {n}: a run of {} new flows needs at least {need}", args.repeat);
            Ok(n)
        }
        None => Ok(CONNTRACK_MAX.max((args.repeat + 1024).next_power_of_two())),
    }
}

fn packet(args: PacketArgs) -> anyhow::Result<()> {
    ensure!(lb_userspace::is_root(), "lb-bench packet needs root (BPF programs, network namespaces)");
    ensure!(args.rounds >= 1, "--rounds must be at least 1");
    ensure!((1..=1 << 25).contains(&args.repeat), "--repeat must be between 1 and 2^25");
    conntrack_max(&args)?;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let stats_before = read_trim(BPF_STATS_SYSCTL);
    let _stats_guard = if stats_before != "0" && !args.keep_bpf_stats {
        std::fs::write(BPF_STATS_SYSCTL, "0").context("turning kernel.bpf_stats_enabled off")?;
        eprintln!("kernel.bpf_stats_enabled was {stats_before}: off for this run, restored afterwards");
        Some(StatsOff { old: stats_before.clone() })
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
    let ns = Netns::create().context("creating the network namespace")?;
    let name = ns.name.clone();
    let a = args.clone();
    let worker = std::thread::Builder::new()
        .name("lb-bench".into())
        .spawn(move || -> anyhow::Result<Value> { measure_all(&name, &a, &host) })?;
    let result = worker.join();
    drop(ns);
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

/// The measuring thread: enters the namespace, pins itself, runs every round.
fn measure_all(ns_name: &str, args: &PacketArgs, host: &HostInfo) -> anyhow::Result<Value> {
    enter_netns(ns_name)?;
    let cpu = pin_thread(args.cpu)?;
    let mut b = Bench::new(cpu, conntrack_max(args)?)?;
    b.self_test()?;
    let mut items = items();
    if !args.only.is_empty() {
        for k in &args.only {
            ensure!(items.iter().any(|i| i.prog == Prog::Lb && i.key == k), "--only: no case {k}");
        }
        items.retain(|i| i.prog != Prog::Lb || args.only.iter().any(|k| k == i.key));
    }
    eprintln!(
        "lb-bench packet: {} cases, {} rounds (+1 warm-up) of {} repeats, pinned to CPU {cpu}",
        items.len(),
        args.rounds,
        args.repeat
    );
    let warm = (args.repeat / 10).max(1000).min(args.repeat);
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); items.len()];
    for round in 0..=args.rounds {
        let repeat = if round == 0 { warm } else { args.repeat };
        for (i, item) in items.iter().enumerate() {
            let s = b.measure(item, repeat).with_context(|| format!("round {round}, {}", item.label))?;
            if round > 0 {
                samples[i].push(s);
            }
        }
        if round > 0 {
            eprint!("\rround {round}/{} done", args.rounds);
        }
    }
    eprintln!();
    Ok(report(&items, &samples, args, cpu, host, b.conntrack_max))
}

fn report(
    items: &[Item],
    samples: &[Vec<Sample>],
    args: &PacketArgs,
    cpu: usize,
    host: &HostInfo,
    conntrack_max: u32,
) -> Value {
    let stats_during = &host.bpf_stats_during;
    let rounds = samples[0].len();
    let raw = |key: &str| -> Vec<f64> {
        let i = items.iter().position(|i| i.key == key).expect("the floors and the harness are always measured");
        samples[i].iter().map(|s| s.ns).collect()
    };
    let diff = |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(x, y)| x - y).collect() };
    let floor_pass = raw("floor_pass");
    let floor_tx = raw("floor_tx");
    // The harness's own cost, per round and mode (same-round differences).
    let h_restore = diff(&raw("harness_restore"), &floor_pass);
    let h_new = diff(&raw("harness_new"), &floor_pass);
    let tx_via_harness = diff(&raw("harness_tx"), &h_restore);
    let tx_med = median(&floor_tx);

    let summary = |v: &[f64]| json!({"median_ns": round2(median(v)), "min_ns": round2(min(v)), "max_ns": round2(max(v)), "rounds_ns": v.iter().map(|x| round2(*x)).collect::<Vec<_>>()});

    let mut cases = Vec::new();
    let mut table = String::new();
    let _ = writeln!(
        table,
        "{:<30} {:<51} {:>9} {:>13} {:>10} {:>7} {:>8} {:>13}",
        "case", "path", "median ns", "min-max ns", "x floor_tx", "Katran", "x Katran", "x K in floors"
    );
    let mut targets = Vec::new();
    let mut row = |label: &str, path: &str, v: &[f64], kat: Option<f64>, key: &str, cases: &mut Vec<Value>| {
        let med = median(v);
        let ratio_tx = med / tx_med;
        let ratio_k = kat.map(|k| med / k);
        // Both in units of their own XDP_TX floor: machine speed cancels.
        let ratio_k_floors = kat.map(|k| ratio_tx / (k / katran::FLOOR_TX));
        let _ = writeln!(
            table,
            "{:<30} {:<51} {:>9.1} {:>13} {:>10.1} {:>7} {:>8} {:>13}",
            label,
            path,
            med,
            format!("{:.1}-{:.1}", min(v), max(v)),
            ratio_tx,
            kat.map_or("-".into(), |k| format!("{k:.1}")),
            ratio_k.map_or("-".into(), |r| format!("{r:.2}")),
            ratio_k_floors.map_or("-".into(), |r| format!("{r:.2}")),
        );
        let mut c = summary(v);
        c["key"] = json!(key);
        c["name"] = json!(label);
        c["path"] = json!(path);
        c["ratio_to_floor_tx"] = json!(round2(ratio_tx));
        c["katran_ns"] = json!(kat);
        c["ratio_to_katran"] = json!(ratio_k.map(round2));
        c["ratio_to_katran_in_floors"] = json!(ratio_k_floors.map(round2));
        cases.push(c);
        med
    };
    for (i, item) in items.iter().enumerate() {
        let Via::Harness(mode) = item.via else { continue };
        if item.prog != Prog::Lb {
            continue;
        }
        let h = if mode == MODE_NEW_TCP { &h_new } else { &h_restore };
        let v = diff(&samples[i].iter().map(|s| s.ns).collect::<Vec<_>>(), h);
        let med = row(&item.label, item.path, &v, item.katran, item.key, &mut cases);
        match item.key {
            "tcp_established" => targets.push(format!(
                "established flow: {med:.1} ns = {:.2}x Katran's {:.1} ns (target at most 1.0x, aim 0.7x): {}",
                med / katran::ESTABLISHED,
                katran::ESTABLISHED,
                verdict(med / katran::ESTABLISHED, 1.0, 0.7)
            )),
            k if k.starts_with("new_") => targets.push(format!(
                "{}: {med:.1} ns = {:.2}x Katran's {:.0} ns (target at most 1.0x, aim 0.7x): {}",
                item.label,
                med / katran::NEW_FLOW,
                katran::NEW_FLOW,
                verdict(med / katran::NEW_FLOW, 1.0, 0.7)
            )),
            "non_vip" => targets.push(format!(
                "non-VIP packet: {med:.1} ns (target at most 15 ns): {}",
                if med <= 15.0 { "met" } else { "missed" }
            )),
            _ => {}
        }
    }
    row("floor: return XDP_PASS", "direct", &floor_pass, None, "floor_pass", &mut cases);
    row("floor: swap MACs, XDP_TX", "direct", &floor_tx, Some(katran::FLOOR_TX), "floor_tx", &mut cases);
    row(
        "floor: XDP_TX via harness",
        "harness -> floor_tx, minus harness cost (a check)",
        &tx_via_harness,
        None,
        "floor_tx_via_harness",
        &mut cases,
    );

    let (release, uname) = kernel_release();
    let model = cpu_model();
    println!();
    println!(
        "Per-packet cost through BPF_PROG_TEST_RUN: {} rounds x {} repeats, CPU {cpu} ({model}), kernel {release}",
        rounds, args.repeat
    );
    println!(
        "Each case: harness -> program, minus the harness's own cost (harness -> floor_pass, minus floor_pass).\n"
    );
    print!("{table}");
    println!(
        "\nharness cost: restore {:.1} ns (min-max {:.1}-{:.1}), restore + new flow {:.1} ns ({:.1}-{:.1})",
        median(&h_restore),
        min(&h_restore),
        max(&h_restore),
        median(&h_new),
        min(&h_new),
        max(&h_new)
    );
    println!(
        "timing: the kernel's mean per repeat (whole ns, truncated) + 0.5 ns; kernel.bpf_stats_enabled during the run: {stats_during}"
    );
    println!(
        "x K in floors: (median / our floor_tx) / (Katran / Katran's floor_tx 6 ns), each in units of its own XDP_TX floor"
    );
    println!("\nReference: {}", katran::TEXT);
    println!("Targets (read, not asserted):");
    for t in &targets {
        println!("  - {t}");
    }

    let raw_rounds: Vec<Value> = items
        .iter()
        .zip(samples)
        .map(|(item, s)| {
            json!({
                "key": item.key,
                "name": item.label,
                "via": match item.via { Via::Direct => "direct".to_owned(), Via::Harness(m) => format!("harness mode {m}") },
                "rounds": s.iter().map(|s| json!({
                    "ns": round2(s.ns),
                    "kernel_ns": s.kernel_ns,
                    "syscall_wall_ms": round2(s.wall_ms),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "benchmark": "packet",
        "method": "BPF_PROG_TEST_RUN with a large repeat count, thread pinned to one CPU, rounds interleaved; \
    every repeat sees the original frame (bench_harness restores it and tail-calls the program under test); \
    case cost = t(harness -> program) - (t(harness -> floor_pass) - t(floor_pass)); new flows get a fresh source \
    address and port per repeat (checksums updated incrementally); flow table emptied before each datapath run; \
    return value and output checked before and after timing, counters show every repeat took the intended path.",
        "rounds": rounds,
        "repeat": args.repeat,
        "cpu": cpu,
        "cpu_model": model,
        "cpus_online": read_trim("/sys/devices/system/cpu/online"),
        "kernel": release,
        "uname": uname,
        "bpf_stats_enabled_before": host.bpf_stats_before,
        "bpf_stats_enabled_during": stats_during,
        "bpf_jit_enable": host.bpf_jit_enable,
        "conntrack_max": conntrack_max,
        "timing": "ns = the kernel's mean per repeat (BPF_PROG_TEST_RUN duration, truncated to whole ns) + 0.5",
        "cases": cases,
        "harness": {
            "restore": summary(&h_restore),
            "restore_new_flow": summary(&h_new),
        },
        "reference": {
            "text": katran::TEXT,
            "katran_established_ns": katran::ESTABLISHED,
            "katran_new_flow_ns": katran::NEW_FLOW,
            "katran_non_vip_ns": katran::NON_VIP,
            "katran_floor_tx_ns": katran::FLOOR_TX,
        },
        "targets": targets,
        "raw": raw_rounds,
    })
}

fn verdict(ratio: f64, limit: f64, aim: f64) -> &'static str {
    if ratio <= aim {
        "met, within the aim"
    } else if ratio <= limit {
        "met"
    } else {
        "missed"
    }
}

//! The datapath fixture: the real XDP program, loaded and programmed by the
//! real `Dataplane` inside a network namespace of its own, fed frames through
//! BPF_PROG_TEST_RUN. Used by the packet fixture tests (`tests/datapath.rs`)
//! and the fuzzer (`tests/fuzz.rs`).
//!
//! The namespace has two interfaces, routes and static neighbours, so
//! bpf_fib_lookup answers as it would on a gateway; it is removed on drop.
//! Needs root.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::programs::{TestRun as _, TestRunOptions};
use lb_common::{NETDEV_F_XMIT_GENERIC, NETDEV_F_XMIT_NATIVE};
use lb_testkit::{Frame, L4Checksum};
use lb_userspace::{
    config::{BackendConfig, Config, Protocol, ServiceConfig, XdpMode},
    dataplane::Dataplane,
    sched::Scheduler,
};

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

pub const XMIT_ALL: u32 = NETDEV_F_XMIT_GENERIC | NETDEV_F_XMIT_NATIVE;

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x01];
pub const BACKEND_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x02, 0x11];
pub const GW_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
pub const GW_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];

pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 100);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 1, 1);
pub const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 11);
/// A backend without a neighbour entry: the FIB answers "no neighbour".
pub const BACKEND_UNRESOLVED: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 12);

pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x100);
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 1, 1);
pub const BACKEND6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 0x11);
/// An IPv6 backend without a neighbour entry.
pub const BACKEND6_UNRESOLVED: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 0x12);
/// A backend behind a router (not on a directly connected network).
pub const BACKEND_ROUTED: Ipv4Addr = Ipv4Addr::new(10, 30, 0, 11);

// ---------------------------------------------------------------- netns

/// A network namespace with a veth pair `gwa` (client side, 10.10.0.1/16) and
/// `gwb` (backend side, 10.20.0.1/24), forwarding on, static neighbours for
/// CLIENT and BACKEND. Deleted on drop.
pub struct Netns {
    pub name: String,
}

pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("spawn");
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

impl Default for Netns {
    fn default() -> Self {
        Self::new()
    }
}

/// Fixture namespaces are named `<NETNS_PREFIX><pid>-<n>`.
pub const NETNS_PREFIX: &str = "lbt-dp-";

impl Netns {
    pub fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(crate::lab::remove_stale_fixture_netns);
        let name = format!("{NETNS_PREFIX}{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&["ip", "netns", "add", &name]);
        let ns = Self { name };
        let n = ns.name.as_str();
        let mac = |m: [u8; 6]| m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
        for cmd in [
            format!(
                "ip -n {n} link add name gwa address {} type veth peer name gwb address {}",
                mac(GW_A_MAC),
                mac(GW_B_MAC)
            ),
            format!("ip -n {n} link set lo up"),
            format!("ip -n {n} link set dev gwa up"),
            format!("ip -n {n} link set dev gwb up"),
            format!("ip -n {n} addr add 10.10.0.1/16 dev gwa"),
            format!("ip -n {n} addr add 10.20.0.1/24 dev gwb"),
            format!("ip -n {n} neigh replace {CLIENT} lladdr {} dev gwa nud permanent", mac(CLIENT_MAC)),
            format!("ip -n {n} neigh replace {BACKEND} lladdr {} dev gwb nud permanent", mac(BACKEND_MAC)),
            format!("ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"),
            format!("ip netns exec {n} sysctl -qw net.ipv6.conf.all.forwarding=1"),
            format!("ip -n {n} addr add fd00:10::1/64 dev gwa nodad"),
            format!("ip -n {n} addr add fd00:20::1/64 dev gwb nodad"),
            format!("ip -n {n} neigh replace {CLIENT6} lladdr {} dev gwa nud permanent", mac(CLIENT_MAC)),
            format!("ip -n {n} neigh replace {BACKEND6} lladdr {} dev gwb nud permanent", mac(BACKEND_MAC)),
            // A router on the backend side, and a network behind it.
            format!("ip -n {n} neigh replace 10.20.0.254 lladdr {} dev gwb nud permanent", mac(BACKEND_MAC)),
            format!("ip -n {n} route add 10.30.0.0/24 via 10.20.0.254 dev gwb"),
        ] {
            sh(&cmd.split(' ').collect::<Vec<_>>());
        }
        ns
    }

    /// Run `f` on a thread inside this namespace.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = PathBuf::from("/run/netns").join(&self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("open netns");
            // Moves this thread only.
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

pub fn ifindex(name: &str) -> u32 {
    nix::net::if_::if_nametoindex(name).unwrap_or_else(|e| panic!("interface {name}: {e}"))
}

// ---------------------------------------------------------------- packets

/// A TCP segment from the client side: `Frame::tcp` addressed to the gateway.
pub fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Frame {
    Frame::tcp(src, sport, dst, dport, flags).macs(GW_A_MAC, CLIENT_MAC)
}

/// A UDP datagram from the client side.
pub fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Frame {
    Frame::udp(src, sport, dst, dport).macs(GW_A_MAC, CLIENT_MAC)
}

/// The frame parses (etherparse), its IPv4 header checksum verifies and its
/// L4 checksum is finished and verifies (or, UDP only, absent).
pub fn assert_checksums_valid(frame: &[u8]) {
    let f = Frame::parse(frame).unwrap_or_else(|e| panic!("{e}: {frame:02x?}"));
    // The parser takes a 0 for "no checksum" only in UDP.
    assert_ne!(f.l4_checksum, L4Checksum::Partial, "L4 checksum not finished: {frame:02x?}");
}

/// The destination of an output frame, which must parse with valid checksums.
pub fn dst_of(frame: &[u8]) -> Ipv4Addr {
    assert_checksums_valid(frame);
    Frame::parse(frame).expect("parse").dst
}

// ---------------------------------------------------------------- harness

pub struct Fixture {
    pub dp: Dataplane,
    pub if_a: u32,
    pub if_b: u32,
}

pub fn service(name: &str, port: u16, protocol: Protocol, backends: &[(Ipv4Addr, u16)]) -> ServiceConfig {
    service_with(name, port, protocol, Scheduler::Maglev, backends)
}

pub fn service_with<A: Into<IpAddr> + Copy>(
    name: &str,
    port: u16,
    protocol: Protocol,
    scheduler: Scheduler,
    backends: &[(A, u16)],
) -> ServiceConfig {
    let backends = backends
        .iter()
        .map(|&(address, port)| BackendConfig { address: address.into(), port, weight: 1, drain: false })
        .collect();
    ServiceConfig { protocol, scheduler, ..ServiceConfig::example(name, VIP, port, backends) }
}

/// An IPv6 service at [`VIP6`] (Maglev).
pub fn service6(name: &str, port: u16, protocol: Protocol, backends: &[(Ipv6Addr, u16)]) -> ServiceConfig {
    ServiceConfig { vip: VIP6.into(), ..service_with(name, port, protocol, Scheduler::Maglev, backends) }
}

/// `svc` by L2 direct server return.
pub fn dsr(svc: ServiceConfig) -> ServiceConfig {
    ServiceConfig { forwarding: lb_userspace::config::Forwarding::Dsr, ..svc }
}

impl Fixture {
    pub fn new(services: Vec<ServiceConfig>) -> Self {
        Self::with_config(services, |_| {})
    }

    /// A fixture whose configuration `edit` changes first (table size,
    /// flood settings, ...).
    pub fn with_config(services: Vec<ServiceConfig>, edit: impl FnOnce(&mut Config)) -> Self {
        let mut cfg = fixture_config(services);
        edit(&mut cfg);
        let mut dp = Dataplane::load_unpinned(&cfg).expect("load the XDP program (are you root?)");
        dp.apply_admin(&cfg.services).expect("apply services");
        let mut fx = Self { dp, if_a: ifindex("gwa"), if_b: ifindex("gwb") };
        // Both devices take native and generic redirects, the program
        // runs natively on both (what lbd writes for such a gateway).
        fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
        fx
    }

    /// Describe the two devices to the datapath as lbd would: each one's
    /// ingress mode (`NETDEV_F_GENERIC` or 0) and what it can transmit.
    pub fn netdevs(&mut self, a_mode: u32, a_xmit: u32, b_mode: u32, b_xmit: u32) {
        let flags = [(self.if_a, a_mode | a_xmit), (self.if_b, b_mode | b_xmit)].into_iter().collect();
        self.dp.write_netdevs(&flags).expect("write NETDEVS");
    }

    /// Run one frame as if received on `ifindex`; returns (action, output).
    pub fn run(&self, frame: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        let ctx = lb_testkit::xdp_ctx(frame.len(), ifindex);
        let mut out = vec![0u8; frame.len() + 256];
        let res = self
            .dp
            .program()
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                ..TestRunOptions::new()
            })
            .expect("BPF_PROG_TEST_RUN");
        out.truncate(res.data_size_out as usize);
        (res.return_value, out)
    }

    /// Run a client frame to the VIP; returns the backend it was rewritten
    /// to. Only BACKEND has a neighbour entry: a frame to it is redirected,
    /// one to another backend goes to the kernel (FIB fallback).
    pub fn forward(&self, frame: &[u8]) -> Ipv4Addr {
        let (action, out) = self.run(frame, self.if_a);
        let dst = dst_of(&out);
        assert_eq!(action, if dst == BACKEND { XDP_REDIRECT } else { XDP_PASS }, "to {dst}");
        dst
    }

    /// Entries in the flow table now (a sweep that removes nothing: idle
    /// timeouts out of reach, half-open flows seconds old at most).
    pub fn entries(&mut self) -> u64 {
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let r = self.dp.sweep(now, u64::MAX / 2, u64::MAX / 2).expect("sweep");
        assert_eq!(r.removed, 0, "nothing is due yet: {r:?}");
        // The count the datapath keeps against conntrack_max agrees.
        // It may remove reply entries no forward entry names (and only
        // those: no flow is removed).
        let left = r.entries - r.entries_removed;
        let (v4, v6) = self.dp.flow_counts().expect("flow counts");
        assert_eq!(v4 + v6, left, "entries counted by the datapath (IPv4 {v4}, IPv6 {v6}) against those in the tables");
        left
    }

    pub fn counter(&self, name: &str) -> u64 {
        let index =
            lb_common::counter::NAMES.iter().position(|n| *n == name).unwrap_or_else(|| panic!("no counter {name}"));
        self.dp.counter(index as u32).unwrap()
    }

    pub fn new_flows(&self, service: &str, backend: impl Into<IpAddr>) -> u64 {
        let backend = backend.into();
        let s = self.dp.services().find(|s| s.config.name == service).unwrap();
        let b = s.backends.iter().find(|b| b.config.address == backend).unwrap();
        self.dp.backend_stats(b.id).unwrap().new_flows
    }

    /// Connections of `service`, all its backends together: (opened,
    /// closed, expired), unclamped.
    pub fn connection_counts(&self, service: &str) -> (u64, u64, u64) {
        let s = self.dp.services().find(|s| s.config.name == service).unwrap();
        s.backends
            .iter()
            .map(|b| self.dp.connection_counts(b.id).unwrap())
            .fold((0, 0, 0), |a, c| (a.0 + c.0, a.1 + c.1, a.2 + c.2))
    }

    /// Active flows of `service`, all its backends together.
    pub fn active_flows(&self, service: &str) -> u64 {
        let s = self.dp.services().find(|s| s.config.name == service).unwrap();
        s.backends.iter().map(|b| self.dp.active_flows(b.id).unwrap()).sum()
    }
}

/// The configuration a fixture's datapath is loaded with: no interfaces,
/// nothing pinned, tables for 1,024 flows per family, `services`.
pub fn fixture_config(services: Vec<ServiceConfig>) -> Config {
    Config {
        interfaces: vec![],
        xdp_mode: XdpMode::Auto,
        control_socket: "/nonexistent".into(),
        pin_path: "/nonexistent".into(),
        conntrack_max: 1024,
        conntrack_max_ipv6: 1024,
        table_capacity: 1 << 20,
        maglev_seed: 0,
        tcp_idle_timeout: 900,
        udp_idle_timeout: 300,
        flood: Default::default(),
        metrics_listen: "127.0.0.1:9464".parse().unwrap(),
        bgp: None,
        services,
    }
}

/// Run the calling thread on `cpu` alone: what the datapath keeps per
/// CPU (the new-flow rate, the per-CPU counts) is then that CPU's.
pub fn on_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
}

pub fn in_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = Netns::new();
    ns.run(f)
}

/// One run of the XDP program over `frame` (received on `ifindex`) by
/// the program's fd, for a thread other than the fixture's owner (which
/// may sweep meanwhile: `Dataplane::sweep` takes it mutably); answers the
/// output frame. aya's `test_run` needs the `Program`, hence the raw
/// `BPF_PROG_TEST_RUN` here.
pub fn run_by_fd_raw(prog_fd: i32, frame: &[u8], ifindex: u32) -> Vec<u8> {
    let ctx = lb_testkit::xdp_ctx(frame.len(), ifindex);
    let mut out = vec![0u8; frame.len() + 256];
    // union bpf_attr's test member: prog_fd, retval, data_size_in,
    // data_size_out, data_in, data_out, repeat, duration, ctx_size_in,
    // ctx_size_out, ctx_in, ctx_out, flags, cpu, batch_size.
    let mut attr = [0u8; 80];
    attr[0..4].copy_from_slice(&(prog_fd as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    attr[12..16].copy_from_slice(&(out.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
    attr[24..32].copy_from_slice(&(out.as_mut_ptr() as u64).to_ne_bytes());
    attr[40..44].copy_from_slice(&(ctx.len() as u32).to_ne_bytes());
    attr[48..56].copy_from_slice(&(ctx.as_ptr() as u64).to_ne_bytes());
    // SAFETY: BPF_PROG_TEST_RUN (10) with an attr whose pointers name
    // live buffers of the sizes given; the kernel writes `out` and attr.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, 10, attr.as_mut_ptr(), attr.len()) };
    assert_eq!(rc, 0, "BPF_PROG_TEST_RUN: {}", std::io::Error::last_os_error());
    let size_out = u32::from_ne_bytes(attr[12..16].try_into().unwrap()) as usize;
    out.truncate(size_out);
    out
}

/// The same new flows on CPUs 0 and 1 at once: both send flow `i`'s SYN
/// (`frame(i, flags)`, a new client address a flow) once both have come
/// to it (a spinning rendezvous: a sleeping one starts them far apart),
/// for 6 s or 20,000 flows. `service` is round robin over its backends
/// (whose one counter for all CPUs gives the two picks different
/// backends), and `fx` has room for every flow and no rate limit; `dst`
/// reads an output frame's destination. Asserts `entries_per_flow`
/// entries a flow (2 where the service shares its backends' endpoints
/// with another: a reply entry too), both packets at its backend (or one
/// held: dropped untouched, and counted), and every flow counted new and
/// open once.
pub fn same_new_flows_on_two_cpus(
    fx: &mut Fixture,
    service: &str,
    vip: IpAddr,
    frame: impl Fn(u32, u8) -> Vec<u8> + Copy + Send + 'static,
    dst: fn(&[u8]) -> IpAddr,
    entries_per_flow: u64,
) {
    use std::sync::{
        Arc,
        atomic::{AtomicU32, Ordering::SeqCst},
    };
    const FLOWS: u32 = 20_000;
    let prog_fd = {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        fx.dp.program().fd().expect("program fd").as_fd().as_raw_fd()
    };
    let if_a = fx.if_a;
    let gate = Arc::new(AtomicU32::new(0));
    let done = Arc::new(AtomicU32::new(FLOWS));
    let send = move |cpu: usize, gate: Arc<AtomicU32>, done: Arc<AtomicU32>| {
        on_cpu(cpu);
        let t0 = std::time::Instant::now();
        let mut went = Vec::new();
        for i in 0..FLOWS {
            gate.fetch_add(1, SeqCst);
            while gate.load(SeqCst) < 2 * (i + 1) {
                std::hint::spin_loop();
            }
            if i >= done.load(SeqCst) {
                break;
            }
            went.push(dst(&run_by_fd_raw(prog_fd, &frame(i, lb_testkit::frame::tcp::SYN), if_a)));
            if t0.elapsed() > std::time::Duration::from_secs(6) {
                done.fetch_min(i + 1, SeqCst);
            }
        }
        went
    };
    let other = {
        let (gate, done) = (gate.clone(), done.clone());
        std::thread::spawn(move || send(1, gate, done))
    };
    let mine = send(0, gate, done.clone());
    let theirs = other.join().expect("the other CPU's sender");
    let flows = done.load(SeqCst) as usize;
    assert!(flows >= 1_000, "too few flows to tell: {flows}");
    // A packet that met the other CPU still writing the flow's entry is
    // held (dropped, untouched: its sender retransmits), and counted.
    let held = mine[..flows].iter().chain(&theirs[..flows]).filter(|&&d| d == vip).count() as u64;
    let split: Vec<String> = (0..flows)
        .filter(|&i| mine[i] != theirs[i] && mine[i] != vip && theirs[i] != vip)
        .map(|i| format!("flow {i}: {} on CPU 0, {} on CPU 1", mine[i], theirs[i]))
        .collect();
    assert!(
        split.is_empty(),
        "{} of {flows} flows went to two backends: {:?}",
        split.len(),
        &split[..split.len().min(5)]
    );
    let counted: u64 = fx
        .dp
        .services()
        .find(|s| s.config.name == service)
        .expect("the service")
        .backends
        .iter()
        .map(|b| fx.dp.backend_stats(b.id).expect("backend stats").new_flows)
        .sum();
    let (opened, closed, expired) = fx.connection_counts(service);
    eprintln!(
        "{flows} flows on two CPUs at once: {counted} counted new, {opened} opened, {closed} closed, {held} held"
    );
    // Every packet not forwarded was held, none dropped as if the table
    // were full: it has room for every flow.
    assert_eq!(fx.counter("held"), held, "packets held");
    assert_eq!((fx.counter("flow_table"), fx.counter("table_full")), (0, 0), "dropped or routed as if full");
    assert_eq!(fx.entries(), entries_per_flow * flows as u64, "entries: {entries_per_flow} a flow");
    assert_eq!(counted, flows as u64, "new flows counted");
    assert_eq!((opened, closed, expired), (flows as u64, 0, 0), "connections opened, closed, expired");
    assert_eq!(fx.active_flows(service), flows as u64, "active flows");
    // Each flow's entry names the backend its packets went to.
    for i in (0..flows).step_by(97) {
        let went = if mine[i] == vip { theirs[i] } else { mine[i] };
        let (_, out) = fx.run(&frame(i as u32, lb_testkit::frame::tcp::ACK), if_a);
        assert_eq!(dst(&out), went, "flow {i}'s ACK");
    }
}

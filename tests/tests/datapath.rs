//! Packet fixtures through BPF_PROG_TEST_RUN: the real XDP program, loaded
//! and programmed by the real `Dataplane`, fed hand-built frames; the action
//! and the output frame are compared byte for byte with frames built from
//! scratch (so incremental checksum updates are checked against full
//! recomputation).
//!
//! Each test runs in a thread that has entered its own network namespace
//! with two interfaces, routes and static neighbours, so bpf_fib_lookup
//! answers as it would on a gateway. Namespaces are removed on drop.
//! Needs root.
use std::{
    net::Ipv4Addr,
    os::fd::AsRawFd as _,
    path::PathBuf,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::programs::{TestRun as _, TestRunOptions};
use lb_common::{NETDEV_F_GENERIC, NETDEV_F_XMIT_GENERIC, NETDEV_F_XMIT_NATIVE};
use lb_userspace::{
    config::{BackendConfig, Config, Protocol, ServiceConfig, XdpMode},
    dataplane::Dataplane,
    sched::Scheduler,
};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

const XMIT_ALL: u32 = NETDEV_F_XMIT_GENERIC | NETDEV_F_XMIT_NATIVE;

const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x01];
const BACKEND_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x02, 0x11];
const GW_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
const GW_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];

const VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 100);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 1, 1);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 11);
/// A backend without a neighbour entry: the FIB answers "no neighbour".
const BACKEND_UNRESOLVED: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 12);

// ---------------------------------------------------------------- netns

/// A network namespace with a veth pair `gwa` (client side, 10.10.0.1/16) and
/// `gwb` (backend side, 10.20.0.1/24), forwarding on, static neighbours for
/// CLIENT and BACKEND. Deleted on drop.
struct Netns {
    name: String,
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("spawn");
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

impl Netns {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("lbt-dp-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
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
        ] {
            sh(&cmd.split(' ').collect::<Vec<_>>());
        }
        ns
    }

    /// Run `f` on a thread inside this namespace.
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = PathBuf::from("/run/netns").join(&self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("open netns");
            // SAFETY: setns on this thread only, with a valid netns fd.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
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

fn ifindex(name: &str) -> u32 {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(i, 0, "interface {name} not found");
    i
}

// ---------------------------------------------------------------- packets

fn checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 { u16::from_be_bytes([chunk[0], chunk[1]]) } else { u16::from(chunk[0]) << 8 };
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn pseudo(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend([0, proto]);
    p.extend((l4.len() as u16).to_be_bytes());
    p.extend(l4);
    p
}

#[derive(Clone)]
struct Pkt {
    dmac: [u8; 6],
    smac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    proto: u8,
    ttl: u8,
    tcp_flags: u8,
    ip_options: Vec<u8>,
    payload: Vec<u8>,
    /// UDP only: send without checksum (0).
    udp_no_csum: bool,
    /// Leave the L4 checksum unfinished, as a local sender with checksum
    /// offload does (CHECKSUM_PARTIAL): the field holds the folded
    /// pseudo-header sum.
    partial: bool,
}

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const FIN: u8 = 0x01;

impl Pkt {
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
            ip_options: Vec::new(),
            payload: b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            udp_no_csum: false,
            partial: false,
        }
    }

    fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Self {
        Self { proto: 17, tcp_flags: 0, payload: b"query".to_vec(), ..Self::tcp(src, sport, dst, dport, 0) }
    }

    fn l4(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend(self.sport.to_be_bytes());
        l4.extend(self.dport.to_be_bytes());
        if self.proto == 6 {
            l4.extend(1000u32.to_be_bytes()); // seq
            l4.extend(0u32.to_be_bytes()); // ack
            l4.extend([5 << 4, self.tcp_flags]);
            l4.extend(64240u16.to_be_bytes());
            l4.extend([0, 0, 0, 0]); // checksum, urgent
            l4.extend(&self.payload);
            let c = if self.partial { self.seed(l4.len()) } else { checksum(&pseudo(self.src, self.dst, 6, &l4)) };
            l4[16..18].copy_from_slice(&c.to_be_bytes());
        } else {
            l4.extend((8 + self.payload.len() as u16).to_be_bytes());
            l4.extend([0, 0]);
            l4.extend(&self.payload);
            if self.partial {
                let c = self.seed(l4.len());
                l4[6..8].copy_from_slice(&c.to_be_bytes());
            } else if !self.udp_no_csum {
                let mut c = checksum(&pseudo(self.src, self.dst, 17, &l4));
                if c == 0 {
                    c = 0xffff;
                }
                l4[6..8].copy_from_slice(&c.to_be_bytes());
            }
        }
        l4
    }

    /// The unfinished checksum a sender with offload writes: the folded
    /// sum of the pseudo-header alone, not complemented.
    fn seed(&self, l4_len: usize) -> u16 {
        !checksum(
            &pseudo(self.src, self.dst, self.proto, &[])[..10]
                .iter()
                .copied()
                .chain((l4_len as u16).to_be_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    fn frame(&self) -> Vec<u8> {
        let l4 = self.l4();
        let ihl = 20 + self.ip_options.len();
        assert_eq!(ihl % 4, 0);
        let mut ip = vec![0x40 | (ihl / 4) as u8, 0];
        ip.extend(((ihl + l4.len()) as u16).to_be_bytes());
        ip.extend([0x12, 0x34, 0x40, 0x00]); // id, DF
        ip.extend([self.ttl, self.proto, 0, 0]);
        ip.extend(self.src.octets());
        ip.extend(self.dst.octets());
        ip.extend(&self.ip_options);
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
}

/// IPv4 header checksum and L4 checksum of `frame` both verify.
fn assert_checksums_valid(frame: &[u8]) {
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    let ip = &frame[14..14 + ihl];
    assert_eq!(checksum(ip), 0, "IPv4 header checksum invalid");
    let tot = usize::from(u16::from_be_bytes([frame[16], frame[17]]));
    let l4 = &frame[14 + ihl..14 + tot];
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    if proto == 17 && l4[6..8] == [0, 0] {
        return; // no UDP checksum
    }
    assert_eq!(checksum(&pseudo(src, dst, proto, l4)), 0, "L4 checksum invalid");
}

// ---------------------------------------------------------------- harness

struct Fixture {
    dp: Dataplane,
    if_a: u32,
    if_b: u32,
}

fn service(name: &str, port: u16, protocol: Protocol, backends: &[(Ipv4Addr, u16)]) -> ServiceConfig {
    service_with(name, port, protocol, Scheduler::Maglev, backends)
}

fn service_with(
    name: &str,
    port: u16,
    protocol: Protocol,
    scheduler: Scheduler,
    backends: &[(Ipv4Addr, u16)],
) -> ServiceConfig {
    ServiceConfig {
        name: name.into(),
        vip: VIP,
        port,
        protocol,
        scheduler,
        table_size: 65537,
        backends: backends
            .iter()
            .map(|&(address, port)| BackendConfig { address, port, weight: 1, drain: false })
            .collect(),
        health: Default::default(),
        slow_start: None,
    }
}

impl Fixture {
    fn new(services: Vec<ServiceConfig>) -> Self {
        let cfg = Config {
            interfaces: vec![],
            xdp_mode: XdpMode::Auto,
            control_socket: "/nonexistent".into(),
            pin_path: "/nonexistent".into(),
            conntrack_max: 1024,
            table_capacity: 1 << 20,
            tcp_idle_timeout: 900,
            udp_idle_timeout: 300,
            metrics_listen: "127.0.0.1:9464".parse().unwrap(),
            services,
        };
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
    fn netdevs(&mut self, a_mode: u32, a_xmit: u32, b_mode: u32, b_xmit: u32) {
        let flags = [(self.if_a, a_mode | a_xmit), (self.if_b, b_mode | b_xmit)].into_iter().collect();
        self.dp.write_netdevs(&flags).expect("write NETDEVS");
    }

    /// Run one frame as if received on `ifindex`; returns (action, output).
    fn run(&self, frame: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes()); // data_end
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes()); // ingress_ifindex
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

    fn counter(&self, name: &str) -> u64 {
        self.dp.counters().unwrap()[name]
    }

    fn new_flows(&self, service: &str, backend: Ipv4Addr) -> u64 {
        let s = self.dp.services().find(|s| s.config.name == service).unwrap();
        let b = s.backends.iter().find(|b| b.config.address == backend).unwrap();
        self.dp.backend_stats(b.id).unwrap().new_flows
    }
}

fn in_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = Netns::new();
    ns.run(f)
}

// ---------------------------------------------------------------- tests

#[test]
fn syn_to_vip_is_rewritten_to_the_backend_and_redirected() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let syn = Pkt::tcp(CLIENT, 40000, VIP, 80, SYN);
        let (action, out) = fx.run(&syn.frame(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let expected = Pkt { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..syn.clone() };
        assert_eq!(out, expected.frame(), "rewritten SYN differs from the expected bytes");
        assert_checksums_valid(&out);
        assert_eq!(fx.new_flows("web", BACKEND), 1);

        // The rest of the flow takes the same path without a new schedule.
        let ack = Pkt { tcp_flags: ACK, ..syn.clone() };
        let (action, out) = fx.run(&ack.frame(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Pkt { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..ack }.frame());
        assert_eq!(fx.new_flows("web", BACKEND), 1);
        assert_eq!(fx.counter("xdp_redirect"), 2);
        assert_eq!(fx.counter("kernel_egress") + fx.counter("fib_fallback") + fx.counter("csum_partial"), 0);
    });
}

/// The packet `p` as the datapath should leave it for the kernel: rewritten
/// to the backend, TTL and MACs as they came.
fn to_backend_unrouted(p: &Pkt) -> Pkt {
    Pkt { dst: BACKEND, dport: 8080, ..p.clone() }
}

#[test]
fn an_egress_that_cannot_take_native_redirects_gets_the_kernel_path() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        // gwb transmits only redirects from generic XDP (a bridge, or a
        // veth whose peer has neither XDP nor GRO); gwa runs natively.
        fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
        let syn = Pkt::tcp(CLIENT, 41000, VIP, 80, SYN);
        let (action, out) = fx.run(&syn.frame(), fx.if_a);
        assert_eq!(action, XDP_PASS, "a native redirect into gwb would be dropped by the kernel");
        // Rewritten, but TTL and MACs untouched: the kernel forwards it and
        // decrements the TTL once.
        assert_eq!(out, to_backend_unrouted(&syn).frame());
        assert_checksums_valid(&out);
        assert_eq!(fx.counter("kernel_egress"), 1);
        assert_eq!(fx.counter("xdp_redirect"), 0);
        // Not cached: the next packet asks again, and goes the same way.
        let ack = Pkt { tcp_flags: ACK, ..syn.clone() };
        assert_eq!(fx.run(&ack.frame(), fx.if_a).0, XDP_PASS);
        assert_eq!(fx.counter("kernel_egress"), 2);

        // With the program in generic mode on gwa, the same egress works.
        fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
        let (action, out) = fx.run(&ack.frame(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(
            out,
            Pkt { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..ack.clone() }.frame()
        );
        assert_eq!(fx.counter("xdp_redirect"), 1);

        // A device lbd knows nothing about (or one that is down / not
        // Ethernet) takes no redirect at all.
        fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, 0);
        let other = Pkt::tcp(CLIENT, 41001, VIP, 80, SYN);
        let (action, out) = fx.run(&other.frame(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, to_backend_unrouted(&other).frame());
        assert_eq!(fx.counter("kernel_egress"), 3);
    });
}

#[test]
fn a_device_change_makes_cached_next_hops_stale_at_once() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        // The flow's next hop is cached (for a second) while gwb takes
        // native redirects...
        let syn = Pkt::tcp(CLIENT, 40999, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.frame(), fx.if_a).0, XDP_REDIRECT);
        // ...then gwb loses that (a veth whose peer's GRO went off): the
        // very next packet of the flow must not be redirected into it.
        fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
        let ack = Pkt { tcp_flags: ACK, ..syn.clone() };
        let (action, out) = fx.run(&ack.frame(), fx.if_a);
        assert_eq!(action, XDP_PASS, "a cached next hop outlived the device change");
        assert_eq!(out, to_backend_unrouted(&ack).frame());
        assert_eq!((fx.counter("xdp_redirect"), fx.counter("kernel_egress")), (1, 1));
        // And back: redirected again.
        fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
        assert_eq!(fx.run(&ack.frame(), fx.if_a).0, XDP_REDIRECT);
    });
}

#[test]
fn unfinished_checksums_are_finished_for_native_redirects_and_kept_unfinished_otherwise() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("dns", 53, Protocol::Udp, &[(BACKEND, 5353)]),
        ]);
        // Payload sizes around the summing loop's pieces: empty, odd,
        // 3 bytes, just over one 512-byte chunk, a full-size segment.
        let sizes = [0usize, 1, 3, 481, 513, 1400, 1460];
        let mut port = 42000u16;
        let mut partial = 0;
        for (i, &n) in sizes.iter().enumerate() {
            let payload: Vec<u8> = (0..n).map(|b| (b * 7 + i) as u8).collect();
            for udp in [false, true] {
                port += 1;
                let base = if udp { Pkt::udp(CLIENT, port, VIP, 53) } else { Pkt::tcp(CLIENT, port, VIP, 80, SYN) };
                let p = Pkt { payload: payload.clone(), partial: true, ..base };
                let (dport, proto) = if udp { (5353, "udp") } else { (8080, "tcp") };

                // Native ingress, capable egress: leaves as an XDP frame, which
                // carries no "finish me" mark, so it must be finished here.
                fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&p.frame(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "{proto} payload {n}");
                let done = Pkt {
                    dst: BACKEND,
                    dport,
                    ttl: 63,
                    dmac: BACKEND_MAC,
                    smac: GW_B_MAC,
                    partial: false,
                    ..p.clone()
                };
                assert_eq!(out, done.frame(), "{proto} payload {n}: not finished correctly");
                assert_checksums_valid(&out);
                partial += 1;

                // Generic ingress: the skb keeps its mark, and the device
                // (or the kernel) finishes it: it stays unfinished, for the
                // rewritten addresses.
                let next = Pkt { sport: p.sport + 10_000, ..p.clone() };
                fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&next.frame(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "{proto} payload {n}");
                let kept = Pkt { dst: BACKEND, dport, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..next.clone() };
                assert_eq!(
                    out,
                    kept.frame(),
                    "{proto} payload {n}: unfinished checksum not kept for the new addresses"
                );
                partial += 1;

                // Native ingress, kernel path: the skb keeps its mark too.
                let third = Pkt { sport: p.sport + 20_000, ..p.clone() };
                fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
                let (action, out) = fx.run(&third.frame(), fx.if_a);
                assert_eq!(action, XDP_PASS, "{proto} payload {n}");
                assert_eq!(out, Pkt { dst: BACKEND, dport, ..third.clone() }.frame(), "{proto} payload {n}");
                partial += 1;
            }
        }
        assert_eq!(fx.counter("csum_partial"), partial);
    });
}

#[test]
fn a_finished_checksum_that_looks_unfinished_is_left_finished() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        // Choose the last two payload bytes so that the finished checksum
        // equals the pseudo-header sum (what an unfinished one holds): one
        // packet in 65,536 does so by chance.
        let mut p = Pkt { payload: vec![0x55; 100], ..Pkt::tcp(CLIENT, 43000, VIP, 80, ACK | 0x08) };
        let seed = p.seed(20 + p.payload.len());
        let found = (0..=u16::MAX).find(|&w| {
            p.payload[98..100].copy_from_slice(&w.to_be_bytes());
            let f = p.frame();
            u16::from_be_bytes([f[14 + 20 + 16], f[14 + 20 + 17]]) == seed
        });
        assert!(found.is_some(), "no payload word gives the colliding checksum");
        assert_checksums_valid(&p.frame());
        // Not a new flow (ACK without SYN is still scheduled, as a mid-flow packet).
        let (action, out) = fx.run(&p.frame(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Pkt { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..p }.frame());
        assert_checksums_valid(&out);
        assert_eq!(fx.counter("csum_partial"), 0);
    });
}

#[test]
fn reply_from_backend_is_rewritten_back_to_the_vip() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let (action, _) = fx.run(&Pkt::tcp(CLIENT, 40001, VIP, 80, SYN).frame(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let synack = Pkt { dmac: GW_B_MAC, smac: BACKEND_MAC, ..Pkt::tcp(BACKEND, 8080, CLIENT, 40001, SYN | ACK) };
        let (action, out) = fx.run(&synack.frame(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        let expected = Pkt { src: VIP, sport: 80, ttl: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..synack };
        assert_eq!(out, expected.frame(), "rewritten reply differs from the expected bytes");
        assert_checksums_valid(&out);
    });
}

#[test]
fn packets_not_for_a_vip_pass_unchanged() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let mut frames = vec![
            // Other address, other port on the VIP, other protocol on the VIP port.
            Pkt::tcp(CLIENT, 40000, Ipv4Addr::new(10, 10, 0, 7), 80, SYN).frame(),
            Pkt::tcp(CLIENT, 40000, VIP, 81, SYN).frame(),
            Pkt::udp(CLIENT, 40000, VIP, 80).frame(),
        ];
        // ARP request for the VIP.
        let mut arp = vec![0xff; 6];
        arp.extend(CLIENT_MAC);
        arp.extend([0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
        arp.extend(CLIENT_MAC);
        arp.extend(CLIENT.octets());
        arp.extend([0; 6]);
        arp.extend(VIP.octets());
        frames.push(arp);
        // IPv6 TCP SYN.
        let mut v6 = GW_A_MAC.to_vec();
        v6.extend(CLIENT_MAC);
        v6.extend([0x86, 0xdd, 0x60, 0, 0, 0, 0, 20, 6, 64]);
        v6.extend([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        v6.extend([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x64]);
        v6.extend([0x9c, 0x40, 0, 80, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, SYN, 0xfa, 0xf0, 0, 0, 0, 0]);
        frames.push(v6);
        // ICMP echo to the VIP.
        let mut icmp = Pkt::tcp(CLIENT, 0, VIP, 0, 0).frame();
        icmp[14 + 9] = 1;
        frames.push(icmp);
        for f in frames {
            let (action, out) = fx.run(&f, fx.if_a);
            assert_eq!(action, XDP_PASS, "frame {f:02x?}");
            assert_eq!(out, f, "a passed frame must be untouched");
        }
        assert_eq!(fx.new_flows("web", BACKEND), 0);
        assert!(fx.dp.counters().unwrap().values().all(|&v| v == 0));
    });
}

#[test]
fn truncated_or_broken_packets_to_a_vip_are_dropped_and_counted() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let full = Pkt::tcp(CLIENT, 40000, VIP, 80, SYN).frame();
        // Cut inside the TCP header; the IP total length still claims the whole packet.
        let truncated = full[..14 + 20 + 10].to_vec();
        // Whole frame, but the IP header claims more than is there.
        let mut long = full.clone();
        let claimed = (full.len() - 14 + 40) as u16;
        long[16..18].copy_from_slice(&claimed.to_be_bytes());
        // IHL below 5.
        let mut bad_ihl = full.clone();
        bad_ihl[14] = 0x44;
        for (i, f) in [truncated, long, bad_ihl].into_iter().enumerate() {
            let (action, _) = fx.run(&f, fx.if_a);
            assert_eq!(action, XDP_DROP, "broken frame {i} must be dropped");
            assert_eq!(fx.counter("malformed"), i as u64 + 1);
        }
        // A fragment of a packet to the VIP has no ports: dropped, counted apart.
        let mut frag = full.clone();
        frag[20] = 0x20; // MF
        let c = checksum(&{
            let mut h = frag[14..34].to_vec();
            h[10] = 0;
            h[11] = 0;
            h
        });
        frag[24..26].copy_from_slice(&c.to_be_bytes());
        assert_eq!(fx.run(&frag, fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("fragment"), 1);
        // Nothing was scheduled or forwarded.
        assert_eq!(fx.new_flows("web", BACKEND), 0);
        // The same truncation to a non-VIP address is the kernel's business.
        let mut other = Pkt::tcp(CLIENT, 40000, Ipv4Addr::new(10, 10, 0, 7), 80, SYN).frame();
        other.truncate(14 + 20 + 10);
        assert_eq!(fx.run(&other, fx.if_a).0, XDP_PASS);
        assert_eq!(fx.counter("malformed"), 3);
    });
}

#[test]
fn ip_options_udp_and_unresolved_next_hop() {
    in_netns(|| {
        let fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("dns", 53, Protocol::Udp, &[(BACKEND, 5353)]),
            service("cold", 81, Protocol::Tcp, &[(BACKEND_UNRESOLVED, 8080)]),
        ]);
        // IPv4 header with options (IHL 6: one NOP x3 + EOL word).
        let opt = Pkt { ip_options: vec![1, 1, 1, 0], ..Pkt::tcp(CLIENT, 40002, VIP, 80, SYN) };
        let (action, out) = fx.run(&opt.frame(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Pkt { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..opt }.frame());
        assert_checksums_valid(&out);

        // UDP with a checksum and without one.
        for no_csum in [false, true] {
            let q = Pkt { udp_no_csum: no_csum, ..Pkt::udp(CLIENT, 5000 + u16::from(no_csum), VIP, 53) };
            let (action, out) = fx.run(&q.frame(), fx.if_a);
            assert_eq!(action, XDP_REDIRECT);
            let expected = Pkt { dst: BACKEND, dport: 5353, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..q };
            assert_eq!(out, expected.frame());
            assert_checksums_valid(&out);
            // Reply back through the VIP.
            let r = Pkt {
                dmac: GW_B_MAC,
                smac: BACKEND_MAC,
                udp_no_csum: no_csum,
                ..Pkt::udp(BACKEND, 5353, CLIENT, 5000 + u16::from(no_csum))
            };
            let (action, out) = fx.run(&r.frame(), fx.if_b);
            assert_eq!(action, XDP_REDIRECT);
            assert_eq!(out, Pkt { src: VIP, sport: 53, ttl: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..r }.frame());
        }

        // No neighbour entry for the backend: rewritten, handed to the kernel
        // (TTL and MACs untouched: the kernel forwards and decrements).
        let cold = Pkt::tcp(CLIENT, 40003, VIP, 81, SYN);
        let (action, out) = fx.run(&cold.frame(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Pkt { dst: BACKEND_UNRESOLVED, dport: 8080, ..cold }.frame());
        assert_checksums_valid(&out);
        assert_eq!(fx.counter("fib_fallback"), 1);
        assert_eq!(fx.new_flows("cold", BACKEND_UNRESOLVED), 1);
    });
}

#[test]
fn expiring_ttl_goes_to_the_kernel_untouched() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let f = Pkt { ttl: 1, ..Pkt::tcp(CLIENT, 40004, VIP, 80, SYN) }.frame();
        let (action, out) = fx.run(&f, fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, f);
        assert_eq!(fx.counter("ttl_expired"), 1);
    });
}

#[test]
fn a_new_syn_on_a_closed_flow_is_a_new_connection() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let c = |flags| Pkt::tcp(CLIENT, 40005, VIP, 80, flags).frame();
        let b =
            |flags| Pkt { dmac: GW_B_MAC, smac: BACKEND_MAC, ..Pkt::tcp(BACKEND, 8080, CLIENT, 40005, flags) }.frame();
        assert_eq!(fx.run(&c(SYN), fx.if_a).0, XDP_REDIRECT);
        // A retransmitted SYN of an open flow is the same connection.
        assert_eq!(fx.run(&c(SYN), fx.if_a).0, XDP_REDIRECT);
        assert_eq!(fx.new_flows("web", BACKEND), 1);
        assert_eq!(fx.run(&b(SYN | ACK), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.run(&c(FIN | ACK), fx.if_a).0, XDP_REDIRECT);
        assert_eq!(fx.run(&b(FIN | ACK), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.run(&c(ACK), fx.if_a).0, XDP_REDIRECT);
        // Port reused for a new connection (TIME_WAIT reuse): counted anew.
        assert_eq!(fx.run(&c(SYN), fx.if_a).0, XDP_REDIRECT);
        assert_eq!(fx.new_flows("web", BACKEND), 2);
    });
}

#[test]
fn a_service_without_backends_drops_new_flows_and_counts_them() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[])]);
        let f = Pkt::tcp(CLIENT, 40006, VIP, 80, SYN).frame();
        assert_eq!(fx.run(&f, fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("no_backend"), 1);
        // All weights zero: the same.
        let mut s = service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]);
        s.backends[0].weight = 0;
        fx.dp.apply_admin(&[s]).unwrap();
        assert_eq!(fx.run(&f, fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("no_backend"), 2);
    });
}

#[test]
fn every_flow_sticks_to_one_backend_and_flows_spread_over_all() {
    in_netns(|| {
        let backends: Vec<(Ipv4Addr, u16)> = (11..14).map(|i| (Ipv4Addr::new(10, 20, 0, i), 8080)).collect();
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &backends)]);
        let mut seen = std::collections::HashMap::new();
        for port in 20000..20300u16 {
            let f = Pkt::tcp(CLIENT, port, VIP, 80, SYN).frame();
            let (_, first) = fx.run(&f, fx.if_a);
            let dst = Ipv4Addr::new(first[30], first[31], first[32], first[33]);
            for _ in 0..3 {
                let (_, again) = fx.run(&Pkt::tcp(CLIENT, port, VIP, 80, ACK).frame(), fx.if_a);
                assert_eq!(Ipv4Addr::new(again[30], again[31], again[32], again[33]), dst);
            }
            *seen.entry(dst).or_insert(0u32) += 1;
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        for (b, n) in &seen {
            assert!((70..=130).contains(n), "backend {b} got {n} of 300 flows: {seen:?}");
        }
    });
}

#[test]
fn round_robin_and_wrr_follow_their_sequence_exactly() {
    in_netns(|| {
        let b: Vec<(Ipv4Addr, u16)> = (11..14).map(|i| (Ipv4Addr::new(10, 20, 0, i), 8080)).collect();
        let mut fx = Fixture::new(vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &b)]);
        let dst_of = |fx: &Fixture, port: u16| {
            let (_, out) = fx.run(&Pkt::tcp(CLIENT, port, VIP, 80, SYN).frame(), fx.if_a);
            out[33]
        };
        let seq: Vec<u8> = (0..9).map(|i| dst_of(&fx, 30000 + i)).collect();
        // Round robin: a rotation of 11, 12, 13 repeated.
        for w in seq.windows(3) {
            let mut s = w.to_vec();
            s.sort_unstable();
            assert_eq!(s, [11, 12, 13], "not round robin: {seq:?}");
        }
        // Smooth WRR 5:1:1 gives a a b a c a a (a rotation of it, as the
        // shared counter continues).
        let mut s = service_with("web", 80, Protocol::Tcp, Scheduler::Wrr, &b);
        s.backends[0].weight = 5;
        fx.dp.apply_admin(&[s]).unwrap();
        let seq: Vec<u8> = (0..14).map(|i| dst_of(&fx, 31000 + i)).collect();
        let cycle = [11, 11, 12, 11, 13, 11, 11];
        let start = (0..7)
            .find(|&r| (0..14).all(|i| seq[i] == cycle[(i + r) % 7]))
            .unwrap_or_else(|| panic!("not a rotation of a a b a c a a: {seq:?}"));
        let _ = start;
    });
}

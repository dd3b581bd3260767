//! What is measured: the addresses of the benchmark's little network, the
//! services programmed into the datapath (one VIP port per scheduler), and
//! the cases, each a frame, a program, a way to run it and the result it
//! must give. Frames are built by `lb-testkit` (headers and checksums by the
//! `etherparse` crate).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_testkit::{
    Frame, Frame6,
    frame::{
        Proto, ipv6_tcp,
        tcp::{ACK, SYN},
    },
};
use lb_userspace::{
    config::{BackendConfig, Protocol, ServiceConfig},
    sched::Scheduler,
};

pub(crate) const XDP_PASS: u32 = 2;
pub(crate) const XDP_TX: u32 = 3;
pub(crate) const XDP_REDIRECT: u32 = 4;

/// Harness modes (`bench-floor.rs`).
pub(crate) const MODE_RESTORE: u32 = 0;
pub(crate) const MODE_NEW_TCP: u32 = 1;
/// A new IPv6 TCP flow per repeat (the source address's last word grows).
pub(crate) const MODE_NEW_TCP6: u32 = 3;
/// Largest frame the harness restores.
pub(crate) const FRAME_MAX: usize = 128;
/// Every test frame is this long (payload padded): whole 8-byte words, so
/// the harness restores each with the same word stores and its cost,
/// measured once, is the same for every case.
pub(crate) const FRAME_LEN: usize = 96;

pub(crate) const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x01];
pub(crate) const GW_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
pub(crate) const GW_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];
pub(crate) const VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 100);
pub(crate) const NON_VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 7);
pub(crate) const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 1, 1);
/// New flows: the harness adds (n >> 16) to this address, port = n & 0xffff.
pub(crate) const NEW_FLOW_BASE: Ipv4Addr = Ipv4Addr::new(10, 10, 64, 1);
/// Flows put in the table before the "full table" variant of each case.
pub(crate) const FILL: u32 = 1 << 20;
pub(crate) const BACKENDS: [Ipv4Addr; 3] =
    [Ipv4Addr::new(10, 20, 0, 11), Ipv4Addr::new(10, 20, 0, 12), Ipv4Addr::new(10, 20, 0, 13)];
pub(crate) const CONNTRACK_MAX: u32 = 4 << 20;
/// The IPv6 service's VIP and client, on the client side's /64, and its
/// backends, on the backends' side's /64 (`netns`).
pub(crate) const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 0x64);
pub(crate) const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 1, 1);
/// New IPv6 flows: the harness adds (n >> 16) to this address's last word.
pub(crate) const NEW_FLOW_BASE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0x40, 1);
pub(crate) const BACKENDS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0xfd00, 0x14, 0, 0, 0, 0, 0, 0x11),
    Ipv6Addr::new(0xfd00, 0x14, 0, 0, 0, 0, 0, 0x12),
    Ipv6Addr::new(0xfd00, 0x14, 0, 0, 0, 0, 0, 0x13),
];

pub(crate) fn backend_mac(addr: Ipv4Addr) -> [u8; 6] {
    [0x02, 0, 0, 0, 0x02, addr.octets()[3]]
}

pub(crate) fn backend_mac6(addr: Ipv6Addr) -> [u8; 6] {
    [0x02, 0, 0, 0, 0x06, addr.octets()[15]]
}

/// Katran's XDP balancer on this kernel, same method (from the issue).
/// Katran's figures, measured elsewhere: only as multiples of its own
/// XDP_TX floor (machine speed cancels), never as nanoseconds.
pub(crate) mod katran {
    pub(crate) const ESTABLISHED_X: f64 = 5.6;
    pub(crate) const NEW_FLOW_X: f64 = 20.0;
    pub(crate) const NON_VIP_X: f64 = 2.8;
    pub(crate) const SOURCE: &str = "Katran (default build, per-CPU LRUs of 4M entries, fresh 5-tuples per new flow), \
measured through BPF_PROG_TEST_RUN with a restoring harness on a 2-core machine of this kind, kernel 6.18, \
in November 2026 (issue 11's measurement), in units of its own XDP_TX floor (about 22.5 ns there); not measured in this run";
}

/// An HTTP-ish payload of `n` bytes.
pub(crate) fn payload(n: usize) -> Vec<u8> {
    let mut p = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n".to_vec();
    p.resize(n, b'x');
    p
}

/// A TCP segment from the client, FRAME_LEN bytes (an ACK acknowledges 5000).
pub(crate) fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Frame {
    Frame {
        ack_number: if flags & ACK != 0 { 5000 } else { 0 },
        payload: payload(FRAME_LEN - 54),
        ..Frame::tcp(src, sport, dst, dport, flags).macs(GW_A_MAC, CLIENT_MAC)
    }
}

/// An IPv6 TCP segment from the client, FRAME_LEN bytes (an ACK
/// acknowledges 5000).
pub(crate) fn tcp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Frame6 {
    Frame6 {
        ack_number: if flags & ACK != 0 { 5000 } else { 0 },
        payload: payload(FRAME_LEN - 74),
        ..Frame6::tcp(src, sport, dst, dport, flags).macs(GW_A_MAC, CLIENT_MAC)
    }
}

/// A UDP datagram from the client, FRAME_LEN bytes.
pub(crate) fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Frame {
    Frame { payload: payload(FRAME_LEN - 42), ..Frame::udp(src, sport, dst, dport).macs(GW_A_MAC, CLIENT_MAC) }
}

// ------------------------------------------------------------------ cases

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Prog {
    Lb,
    FloorPass,
    FloorTx,
    /// `floor_table`: a kernel hash alone with the flow table's key, value
    /// and size (the datapath's flow table up to layout 2): a lookup, and
    /// an insert when the 5-tuple is missing.
    Table,
    /// `floor_lru`: the same on an LRU hash (Katran's kind of flow table).
    Lru,
    /// `floor_open`: the same on an open-addressing array of our own (the
    /// prototype of the datapath's flow table: the same probing and claim
    /// protocol, without its entry count and replace path).
    Open,
    /// `floor_split`: `floor_open`'s table with its slots in arrays of 32
    /// KB or less (which the kernel allocates in huge pages), found through
    /// an array of maps.
    Split,
}

impl Prog {
    /// A table-alone program: `floor_table`, `floor_lru`, `floor_open` or
    /// `floor_split`.
    pub(crate) fn table_alone(self) -> bool {
        matches!(self, Self::Table | Self::Lru | Self::Open | Self::Split)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// BPF_PROG_TEST_RUN on the program itself.
    Direct,
    /// Through the harness in this mode (restore / new flow).
    Harness(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expect {
    /// XDP_REDIRECT to one of the backends.
    Redirect,
    /// XDP_PASS, frame untouched.
    Pass,
    /// XDP_TX with the MAC addresses swapped.
    Tx,
    /// A one-arm gateway's forwarding: the frame arrives on the device it
    /// leaves by (gwb for a client's packet, gwa for a reply), is
    /// rewritten as a redirected one is, and goes back out by XDP_TX.
    SentBack,
}

impl Expect {
    /// The program's return value on this path.
    pub(crate) fn retval(self) -> u32 {
        match self {
            Self::Redirect => XDP_REDIRECT,
            Self::Pass => XDP_PASS,
            Self::Tx | Self::SentBack => XDP_TX,
        }
    }
}

/// One thing timed every round.
#[derive(Clone)]
pub(crate) struct Item {
    pub key: &'static str,
    pub label: String,
    pub path: &'static str,
    pub prog: Prog,
    pub via: Via,
    pub frame: Vec<u8>,
    pub expect: Expect,
    /// Service whose counters must move (VIP cases).
    pub service: Option<&'static str>,
    pub katran: Option<f64>,
    /// A reply: the frame is rebuilt from the backend the forward frame
    /// `frame` is sent to (run first, which makes the flow).
    pub reply: bool,
    /// Flows put in the table before the case runs (0: an empty table).
    pub fill: u32,
}

/// The port every backend of `service` listens on: its own per service,
/// as in a real pool, except `maglev-shared`, whose backends are
/// `maglev`'s (an endpoint shared between two services).
pub(crate) fn backend_port(service: &str) -> u16 {
    match service {
        "maglev" | "maglev-shared" => 8080,
        "wrr" => 8081,
        "rr" => 8082,
        "source-hash" => 8083,
        "least-conn" => 8084,
        "maglev6" => 8086,
        _ => 8053,
    }
}

pub(crate) fn services() -> Vec<ServiceConfig> {
    let svc = |name: &str, vip: IpAddr, port: u16, protocol: Protocol, scheduler: Scheduler, addrs: &[IpAddr]| {
        let backends = addrs
            .iter()
            .map(|&address| BackendConfig { address, port: backend_port(name), weight: 1, drain: false })
            .collect();
        ServiceConfig { protocol, scheduler, ..ServiceConfig::example(name, vip, port, backends) }
    };
    let v4: Vec<IpAddr> = BACKENDS.iter().map(|&a| a.into()).collect();
    let v6: Vec<IpAddr> = BACKENDS6.iter().map(|&a| a.into()).collect();
    let (vip, vip6) = (IpAddr::from(VIP), IpAddr::from(VIP6));
    vec![
        svc("maglev", vip, 80, Protocol::Tcp, Scheduler::Maglev, &v4),
        svc("wrr", vip, 81, Protocol::Tcp, Scheduler::Wrr, &v4),
        svc("rr", vip, 82, Protocol::Tcp, Scheduler::Rr, &v4),
        svc("source-hash", vip, 83, Protocol::Tcp, Scheduler::SourceHash, &v4),
        svc("least-conn", vip, 84, Protocol::Tcp, Scheduler::LeastConn, &v4),
        svc("dns", vip, 53, Protocol::Udp, Scheduler::Maglev, &v4),
        svc("maglev-shared", vip, 85, Protocol::Tcp, Scheduler::Maglev, &v4),
        // IPv6: its own VIP and backends, its own flow table.
        svc("maglev6", vip6, 80, Protocol::Tcp, Scheduler::Maglev, &v6),
    ]
}

pub(crate) fn items() -> Vec<Item> {
    let est = tcp(CLIENT, 40000, VIP, 80, ACK).bytes();
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
            reply: false,
            fill: 0,
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
            katran: None,
            reply: false,
            fill: 0,
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
            reply: false,
            fill: 0,
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
            reply: false,
            fill: 0,
        },
        Item {
            key: "harness_new",
            label: "harness (new flow) -> floor_pass".into(),
            path: "",
            prog: Prog::FloorPass,
            via: Via::Harness(MODE_NEW_TCP),
            frame: tcp(NEW_FLOW_BASE, 1, VIP, 80, SYN).bytes(),
            expect: Expect::Pass,
            service: None,
            katran: None,
            reply: false,
            fill: 0,
        },
        Item {
            key: "harness_new6",
            label: "harness (new IPv6 flow) -> floor_pass".into(),
            path: "",
            prog: Prog::FloorPass,
            via: Via::Harness(MODE_NEW_TCP6),
            frame: tcp6(NEW_FLOW_BASE6, 1, VIP6, 80, SYN).bytes(),
            expect: Expect::Pass,
            service: None,
            katran: None,
            reply: false,
            fill: 0,
        },
        Item {
            key: "tcp_established",
            label: "TCP established flow (maglev)".into(),
            path: "flow hit, NAT, cached next hop, REDIRECT",
            prog: Prog::Lb,
            via: Via::Harness(MODE_RESTORE),
            frame: est.clone(),
            expect: Expect::Redirect,
            service: Some("maglev"),
            katran: Some(katran::ESTABLISHED_X),
            reply: false,
            fill: 0,
        },
        Item {
            key: "tcp_established_one_arm",
            label: "TCP established flow, one arm (maglev)".into(),
            path: "flow hit, NAT, cached next hop, back out of its ingress by XDP_TX",
            prog: Prog::Lb,
            via: Via::Harness(MODE_RESTORE),
            frame: tcp(CLIENT, 40001, VIP, 80, ACK).bytes(),
            expect: Expect::SentBack,
            service: Some("maglev"),
            katran: Some(katran::ESTABLISHED_X),
            reply: false,
            fill: 0,
        },
        Item {
            key: "tcp_reply",
            label: "TCP reply (maglev)".into(),
            path: "endpoint, flow hit, NAT, cached next hop, REDIRECT",
            prog: Prog::Lb,
            via: Via::Harness(MODE_RESTORE),
            frame: est.clone(),
            expect: Expect::Redirect,
            service: Some("maglev"),
            katran: None,
            reply: true,
            fill: 0,
        },
    ];
    // A flow table alone, as a kernel hash (the datapath's up to layout
    // 2), an LRU hash and an array of our own: a hit on the established
    // frame, a new entry per repeat on the new-flow one. (An LRU hash's
    // hit costs what the plain hash's does: not timed.)
    let hit = |key| (key, MODE_RESTORE, est.clone(), "lookup hit", "lookup (the flow table's key, value, size), PASS");
    let new = |key| {
        let frame = tcp(NEW_FLOW_BASE, 1, VIP, 80, SYN).bytes();
        (key, MODE_NEW_TCP, frame, "new entry", "lookup miss + insert of a fresh 5-tuple, PASS")
    };
    for (prog, cases, what, kind) in [
        (Prog::Table, vec![hit("table_hit"), new("table_new")], "kernel hash alone", "kernel hash"),
        (Prog::Lru, vec![new("lru_new")], "LRU table alone", "kernel LRU hash"),
        (
            Prog::Open,
            vec![hit("open_hit"), new("open_new")],
            "open-addressing table alone, one array (layout 6's)",
            "one array, open addressing,",
        ),
        (
            Prog::Split,
            vec![hit("split_hit"), new("split_new")],
            "open-addressing table alone, in 32 KB arrays",
            "arrays of 256 slots (array of maps), open addressing,",
        ),
    ] {
        for (key, mode, frame, label, path) in cases {
            v.push(Item {
                key,
                label: format!("{what}: {label}"),
                path: Box::leak(format!("{kind} {path}").into_boxed_str()),
                prog,
                via: Via::Harness(mode),
                frame,
                expect: Expect::Pass,
                service: None,
                katran: None,
                reply: false,
                fill: 0,
            });
        }
    }
    for (key, name, port) in [
        ("new_maglev", "maglev", 80),
        ("new_wrr", "wrr", 81),
        ("new_rr", "rr", 82),
        ("new_source_hash", "source-hash", 83),
        ("new_least_conn", "least-conn", 84),
        ("new_shared", "maglev-shared", 85),
    ] {
        let (label, path) = if name == "maglev-shared" {
            (
                "TCP new flow, maglev, endpoints shared".to_owned(),
                "flow miss, VIP, pick, 2 inserts (reply entry), NAT, REDIRECT",
            )
        } else {
            (format!("TCP new flow, {name}"), "flow miss, VIP, pick, 1 insert, NAT, REDIRECT")
        };
        v.push(Item {
            key,
            label,
            path,
            prog: Prog::Lb,
            via: Via::Harness(MODE_NEW_TCP),
            frame: tcp(NEW_FLOW_BASE, 1, VIP, port, SYN).bytes(),
            expect: Expect::Redirect,
            service: Some(name),
            katran: Some(katran::NEW_FLOW_X),
            reply: false,
            fill: 0,
        });
    }
    v.push(Item {
        key: "udp_established",
        label: "UDP established flow (maglev)".into(),
        path: "flow hit, NAT, cached next hop, REDIRECT",
        prog: Prog::Lb,
        via: Via::Harness(MODE_RESTORE),
        frame: udp(CLIENT, 5353, VIP, 53).bytes(),
        expect: Expect::Redirect,
        service: Some("dns"),
        katran: Some(katran::ESTABLISHED_X),
        reply: false,
        fill: 0,
    });
    // The IPv6 service's cases (Katran's figures are IPv4 ones: not
    // compared).
    let v6 = |key, label: &str, path, via, frame: Vec<u8>, reply| Item {
        key,
        label: label.into(),
        path,
        prog: Prog::Lb,
        via,
        frame,
        expect: Expect::Redirect,
        service: Some("maglev6"),
        katran: None,
        reply,
        fill: 0,
    };
    let est6 = tcp6(CLIENT6, 40000, VIP6, 80, ACK).bytes();
    let hit = "flow hit, NAT, cached next hop, REDIRECT";
    v.push(v6(
        "tcp6_established",
        "IPv6 TCP established flow (maglev)",
        hit,
        Via::Harness(MODE_RESTORE),
        est6.clone(),
        false,
    ));
    v.push(v6(
        "tcp6_reply",
        "IPv6 TCP reply (maglev)",
        "endpoint, flow hit, NAT, cached next hop, REDIRECT",
        Via::Harness(MODE_RESTORE),
        est6,
        true,
    ));
    v.push(v6(
        "new_maglev6",
        "IPv6 TCP new flow, maglev",
        "flow miss, VIP, pick, 1 insert, NAT, REDIRECT",
        Via::Harness(MODE_NEW_TCP6),
        tcp6(NEW_FLOW_BASE6, 1, VIP6, 80, SYN).bytes(),
        false,
    ));
    v.push(Item {
        key: "ipv6",
        label: "IPv6 TCP, not a VIP".into(),
        path: "address filter: neither ours, PASS",
        prog: Prog::Lb,
        // Passed untouched: every repeat sees the original frame without
        // the harness, so it runs directly, as the floors do.
        via: Via::Direct,
        frame: ipv6_tcp(
            (GW_A_MAC, CLIENT_MAC),
            (Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1), 40000),
            (Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x64), 80),
            ACK,
            &payload(FRAME_LEN - 74),
        ),
        expect: Expect::Pass,
        service: None,
        katran: None,
        reply: false,
        fill: 0,
    });
    v.push(Item {
        key: "non_vip",
        label: "IPv4 TCP, not a VIP".into(),
        path: "address filter: neither ours, PASS",
        prog: Prog::Lb,
        // Directly, as the IPv6 case (passed untouched).
        via: Via::Direct,
        frame: tcp(CLIENT, 40000, NON_VIP, 80, ACK).bytes(),
        expect: Expect::Pass,
        service: None,
        katran: Some(katran::NON_VIP_X),
        reply: false,
        fill: 0,
    });
    for i in &v {
        assert_eq!(i.frame.len(), FRAME_LEN, "{}: frame length", i.key);
    }
    v
}

/// The same case with `fill` flows in the table first (the realistic,
/// cache-missing one); its key ends in `_full`.
pub(crate) fn full(item: &Item, fill: u32) -> Item {
    let key: &'static str = Box::leak(format!("{}_full", item.key).into_boxed_str());
    let flows = if fill.is_multiple_of(1 << 20) { format!("{}M", fill >> 20) } else { fill.to_string() };
    Item { key, label: format!("{}, {flows} flows", item.label), fill, ..item.clone() }
}

/// The reply of the flow the forward frame `fwd` made on `backend` of
/// `service`.
pub(crate) fn reply_frame(fwd: &Frame, backend: Ipv4Addr, service: &str) -> Vec<u8> {
    let port = backend_port(service);
    let macs = (GW_B_MAC, backend_mac(backend));
    if fwd.proto == Proto::Udp {
        return Frame {
            payload: payload(FRAME_LEN - 42),
            ..Frame::udp(backend, port, fwd.src, fwd.sport).macs(macs.0, macs.1)
        }
        .bytes();
    }
    Frame {
        payload: payload(FRAME_LEN - 54),
        ack_number: 7000,
        ..Frame::tcp(backend, port, fwd.src, fwd.sport, ACK).macs(macs.0, macs.1)
    }
    .bytes()
}

/// The same for an IPv6 flow (TCP).
pub(crate) fn reply_frame6(fwd: &Frame6, backend: Ipv6Addr, service: &str) -> Vec<u8> {
    Frame6 {
        payload: payload(FRAME_LEN - 74),
        ack_number: 7000,
        ..Frame6::tcp(backend, backend_port(service), fwd.src, fwd.sport, ACK).macs(GW_B_MAC, backend_mac6(backend))
    }
    .bytes()
}

/// Whether `frame` is an IPv6 one (its EtherType).
pub(crate) fn is_ipv6(frame: &[u8]) -> bool {
    frame.get(12..14) == Some(&[0x86, 0xdd][..])
}

/// A case that makes a new flow per repeat (through the harness).
pub(crate) fn new_flow_case(item: &Item) -> bool {
    matches!(item.via, Via::Harness(MODE_NEW_TCP | MODE_NEW_TCP6))
}

/// An established-flow case: before it is timed its flow's reply passes
/// once and the client speaks again, so the flow is established (answered,
/// `FLOW_ESTABLISHED`), as a real connection's is.
pub(crate) fn answered_first(item: &Item) -> bool {
    matches!(
        item.key.strip_suffix("_full").unwrap_or(item.key),
        "tcp_established" | "tcp_established_one_arm" | "udp_established" | "tcp6_established"
    )
}

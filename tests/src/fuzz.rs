//! The datapath fuzzer: random frames and mutations of valid ones go through
//! the real XDP program by BPF_PROG_TEST_RUN (the [`fixture`](crate::fixture)),
//! and every result is judged by a checker of its own: byte offsets and the
//! `etherparse` crate, never the datapath's parser.
//!
//! The rules, for every packet (`check`):
//! 1. A frame that is not IPv4 to a VIP address nor IPv4 from a backend
//!    address (EtherType 0x0800 and a whole 20-byte IPv4 header to read the
//!    addresses from) is passed (XDP_PASS) byte for byte as it came.
//! 2. XDP_DROP only for an IPv4 frame to a VIP address, or, untouched, for
//!    a TCP/UDP packet from a backend endpoint (a service's backend
//!    address and port): a backend's packet for a client flow whose entry
//!    names another backend (`stale_backend`). The run's drops of this
//!    second kind must equal the datapath's `stale_backend` counter. Such
//!    a packet to a VIP address on a port no service has is a stale
//!    backend's too (the datapath finds no service for it); its drop is
//!    told from that address's other drops by the counter moving, and the
//!    counter may move only on such a drop, by one.
//! 3. An output that differs from its input, and every transmitted one
//!    (XDP_REDIRECT, XDP_TX), is a rewrite: it parses (etherparse) as
//!    Ethernet/IPv4/TCP-or-UDP with a valid IPv4 header checksum, has the
//!    input's length, and differs from the input only in
//!    - either the destination address and port (a forward: the input was
//!      to a service's VIP and port, the output goes to one of that
//!      service's backends) or the source address and port (a reply: the
//!      input came from a backend endpoint of a service, the output comes
//!      from the VIP and port of a service with that endpoint);
//!    - the IPv4 header checksum and the TCP/UDP checksum: the L4 checksum
//!      of the output is full and valid when the input's was, stays 0 (or
//!      becomes valid) for a UDP datagram without one; an unfinished one
//!      (the pseudo-header sum, as a sender with offload leaves it) is
//!      finished on a transmit and stays unfinished, for the new addresses,
//!      on the kernel path; a wrong one stays exactly as wrong (the same
//!      ones' complement residue);
//!    - on a transmit only: TTL one less (the input's at least 2) and the
//!      MACs of the next hop (the neighbour of the new destination). On
//!      the kernel path (XDP_PASS) TTL and MACs are as they came.
//! 4. No XDP_ABORTED, and no action other than PASS, DROP, TX, REDIRECT.
//! 6. An IPv4 frame in one VLAN tag (TPID 0x8100 or 0x88a8) or two
//!    (0x8100 inside) is judged by rules 1-4 as the same frame without
//!    its tags, and besides: its tags come out as they went in, and a
//!    rewrite goes to the kernel (XDP_PASS: TTL and MACs as they came),
//!    never out by XDP redirect or XDP_TX.
//! 5. An ICMP error (IPv4 ICMP type 3, 11 or 12, without options, quoting
//!    an IPv4 TCP/UDP header without options and at least its ports: a
//!    quote cut short after them is still about that flow) is passed
//!    untouched, or
//!    passed translated: same length; only the outer destination, the
//!    quoted addresses, ports and checksums and the checksums over them
//!    changed; every checksum (outer header, ICMP message, quoted header)
//!    as valid as it was; and either the quoted destination went from a
//!    backend endpoint to the VIP and port of a service of that endpoint
//!    (an error about a forwarded packet, on to the client), or the quoted
//!    source went from a service's VIP and port to one of its backends and
//!    the outer destination from that VIP to that backend (an error about
//!    a reply, on to the backend).
//!
//! A run counts packets per action and per outcome (passed untouched,
//! dropped, forward and reply rewrites, transmitted or for the kernel) and
//! requires each outcome to have occurred, so it cannot silently test
//! nothing. A violation does not stop the run: each rule's first case is
//! kept, shrunk towards the valid frame it was mutated from, and printed
//! with the seed, the inputs and outputs in hex. `LB_FUZZ_SEED` repeats a
//! run, `LB_FUZZ_REPLAY=a:HEX` (or `b:`, `lo:`, the receiving device) runs
//! one frame after the setup flows.
use std::{
    collections::{BTreeMap, VecDeque},
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use etherparse::{
    ArpEthIpv4Packet, ArpOperation, Icmpv4Type, IpNumber, Ipv4Header, NetSlice, PacketBuilder, SlicedPacket, TcpHeader,
    TransportSlice, UdpHeader,
    checksum::Sum16BitWords,
    err::packet::SliceError,
    icmpv4::{DestUnreachableHeader, TimeExceededCode},
};
use fastrand::Rng;
use lb_testkit::frame::{arp_request, tcp as flag};
use lb_userspace::{
    config::{Protocol, ServiceConfig},
    sched::Scheduler,
};

use crate::fixture::{
    BACKEND, BACKEND_MAC, BACKEND_UNRESOLVED, CLIENT, CLIENT_MAC, Fixture, GW_A_MAC, GW_B_MAC, VIP, XDP_DROP, XDP_PASS,
    XDP_REDIRECT, ifindex, service_with,
};

pub const XDP_ABORTED: u32 = 0;
pub const XDP_TX: u32 = 3;

/// A second VIP address.
pub const VIP2: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 101);
/// A third backend address, without a neighbour entry like
/// [`BACKEND_UNRESOLVED`].
pub const BACKEND3: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 13);

const TCP: u8 = 6;
const UDP: u8 = 17;
const ETH_LEN: usize = 14;
const ETH_P_IP: [u8; 2] = [0x08, 0x00];
/// Largest frame made (an Ethernet frame without FCS at a 1,500-byte MTU).
const MAX_FRAME: usize = 1514;

// ---------------------------------------------------------------- services

/// A service as the checker knows it: from this table, not from the
/// datapath's maps.
pub struct Svc {
    pub name: &'static str,
    pub vip: Ipv4Addr,
    pub port: u16,
    /// IP protocol number (6 or 17).
    pub proto: u8,
    pub scheduler: Scheduler,
    pub backends: &'static [(Ipv4Addr, u16)],
}

/// What the fuzzer sets up: two VIP addresses, TCP and UDP, Maglev and
/// round robin, a resolved backend (BACKEND) and unresolved ones, and two
/// backend endpoints each shared by two services (BACKEND:8080 by web and
/// alt, BACKEND:5353 by dns and log; the first named owns it).
pub const SERVICES: [Svc; 5] = [
    Svc {
        name: "web",
        vip: VIP,
        port: 80,
        proto: TCP,
        scheduler: Scheduler::Maglev,
        backends: &[(BACKEND, 8080), (BACKEND_UNRESOLVED, 8080)],
    },
    Svc {
        name: "alt",
        vip: VIP,
        port: 81,
        proto: TCP,
        scheduler: Scheduler::Rr,
        backends: &[(BACKEND, 8080), (BACKEND, 8081)],
    },
    Svc {
        name: "dns",
        vip: VIP,
        port: 53,
        proto: UDP,
        scheduler: Scheduler::Maglev,
        backends: &[(BACKEND, 5353), (BACKEND_UNRESOLVED, 5353)],
    },
    Svc {
        name: "api",
        vip: VIP2,
        port: 443,
        proto: TCP,
        scheduler: Scheduler::Maglev,
        backends: &[(BACKEND, 9443), (BACKEND3, 9443)],
    },
    Svc {
        name: "log",
        vip: VIP2,
        port: 514,
        proto: UDP,
        scheduler: Scheduler::Rr,
        backends: &[(BACKEND, 5353), (BACKEND, 5514)],
    },
];

/// [`SERVICES`] as the configuration the fixture's `Dataplane` applies.
pub fn service_configs() -> Vec<ServiceConfig> {
    SERVICES
        .iter()
        .map(|s| {
            let proto = if s.proto == TCP { Protocol::Tcp } else { Protocol::Udp };
            ServiceConfig { vip: s.vip.into(), ..service_with(s.name, s.port, proto, s.scheduler, s.backends) }
        })
        .collect()
}

fn is_vip_addr(a: Ipv4Addr) -> bool {
    SERVICES.iter().any(|s| s.vip == a)
}

fn is_backend_addr(a: Ipv4Addr) -> bool {
    SERVICES.iter().any(|s| s.backends.iter().any(|b| b.0 == a))
}

fn service_at(addr: Ipv4Addr, port: u16, proto: u8) -> Option<&'static Svc> {
    SERVICES.iter().find(|s| (s.vip, s.port, s.proto) == (addr, port, proto))
}

/// Whether an Ethernet/IPv4 frame is TCP or UDP from a backend endpoint
/// (its source address and port a backend of a service of that protocol).
fn from_backend_endpoint(f: &[u8]) -> bool {
    let (Some((src, _)), Some((l4, _, _, proto))) = (ipv4_addrs(f), l4_layout(f, ETH_LEN)) else { return false };
    services_of_endpoint(src, u16_at(f, l4), proto).next().is_some()
}

/// The services a backend endpoint serves.
fn services_of_endpoint(addr: Ipv4Addr, port: u16, proto: u8) -> impl Iterator<Item = &'static Svc> {
    SERVICES.iter().filter(move |s| s.proto == proto && s.backends.contains(&(addr, port)))
}

/// The (destination, source) MACs of a frame sent to `addr`: the
/// namespace's static neighbours, seen from the gateway. None for an
/// address without one (the datapath cannot transmit to it itself).
fn next_hop_macs(addr: Ipv4Addr) -> Option<([u8; 6], [u8; 6])> {
    match addr {
        a if a == BACKEND => Some((BACKEND_MAC, GW_B_MAC)),
        a if a == CLIENT => Some((CLIENT_MAC, GW_A_MAC)),
        _ => None,
    }
}

// ---------------------------------------------------------------- options

/// The device a frame is received on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    /// gwa, the clients' side.
    A,
    /// gwb, the backends' side.
    B,
    /// lo: a device lbd did not describe to the datapath.
    Lo,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Self::A => "a",
            Self::B => "b",
            Self::Lo => "lo",
        }
    }
}

pub struct Options {
    /// Packets to generate (the setup flows come on top).
    pub count: u64,
    pub seed: u64,
    /// Run only this frame (after the setup flows), received on this side.
    pub replay: Option<(Side, Vec<u8>)>,
}

impl Options {
    /// From the environment: `LB_FUZZ_COUNT` (default `default_count`;
    /// `_` and `,` allowed as separators), `LB_FUZZ_SEED` (decimal or 0x
    /// hex; default random) and `LB_FUZZ_REPLAY` (`a:HEX`, `b:HEX` or
    /// `lo:HEX`).
    pub fn from_env(default_count: u64) -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let count = var("LB_FUZZ_COUNT").map_or(default_count, |v| {
            let digits: String = v.chars().filter(|c| !matches!(c, '_' | ',')).collect();
            digits.trim().parse().unwrap_or_else(|e| panic!("LB_FUZZ_COUNT={v}: {e}"))
        });
        let seed = var("LB_FUZZ_SEED").map_or_else(
            || fastrand::u64(..),
            |v| {
                let v = v.trim();
                let parsed = match v.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => v.parse(),
                };
                parsed.unwrap_or_else(|e| panic!("LB_FUZZ_SEED={v}: {e}"))
            },
        );
        let replay = var("LB_FUZZ_REPLAY").map(|v| {
            let (side, digits) =
                v.trim().split_once(':').unwrap_or_else(|| panic!("LB_FUZZ_REPLAY: a:HEX, b:HEX or lo:HEX"));
            let side = match side {
                "a" => Side::A,
                "b" => Side::B,
                "lo" => Side::Lo,
                other => panic!("LB_FUZZ_REPLAY: side {other} is not a, b or lo"),
            };
            (side, from_hex(digits).unwrap_or_else(|e| panic!("LB_FUZZ_REPLAY: {e}")))
        });
        Self { count, seed, replay }
    }
}

fn from_hex(s: &str) -> Result<Vec<u8>, String> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    if !s.len().is_multiple_of(2) {
        return Err("odd number of hex digits".into());
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string())).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

// ---------------------------------------------------------------- checker

/// What became of a packet that broke no rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// XDP_PASS, untouched.
    Passed,
    Dropped,
    /// A backend endpoint's packet not to a VIP, dropped untouched (rule
    /// 2: a stale backend's; the run checks its count against the
    /// datapath's).
    DroppedStale,
    /// Rewritten to `to`, a backend; transmitted (XDP_REDIRECT/TX) or for the kernel.
    Forward {
        to: (Ipv4Addr, u16),
        transmitted: bool,
    },
    /// Rewritten to come from a VIP; transmitted or for the kernel.
    Reply {
        transmitted: bool,
    },
    /// An ICMP error about a balanced flow, translated (rule 5).
    IcmpTranslated,
}

/// A broken rule: which (the key a run groups cases by) and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub rule: String,
    pub detail: String,
}

fn violation(rule: impl Into<String>, detail: impl Into<String>) -> Violation {
    Violation { rule: rule.into(), detail: detail.into() }
}

fn action_name(action: u32) -> String {
    match action {
        XDP_ABORTED => "XDP_ABORTED".into(),
        XDP_DROP => "XDP_DROP".into(),
        XDP_PASS => "XDP_PASS".into(),
        XDP_TX => "XDP_TX".into(),
        XDP_REDIRECT => "XDP_REDIRECT".into(),
        other => format!("action {other}"),
    }
}

fn addr_at(f: &[u8], off: usize) -> Ipv4Addr {
    Ipv4Addr::new(f[off], f[off + 1], f[off + 2], f[off + 3])
}

fn u16_at(f: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([f[off], f[off + 1]])
}

/// Source and destination of an IPv4 frame by its own bytes: EtherType
/// 0x0800 and the 20 bytes of an IPv4 header present (whatever they say).
fn ipv4_addrs(f: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr)> {
    (f.len() >= ETH_LEN + 20 && f[12..14] == ETH_P_IP).then(|| (addr_at(f, ETH_LEN + 12), addr_at(f, ETH_LEN + 16)))
}

/// The folded (not complemented) ones' complement sum of the pseudo-header.
fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: u16) -> Sum16BitWords {
    Sum16BitWords::new()
        .add_4bytes(src.octets())
        .add_4bytes(dst.octets())
        .add_2bytes([0, proto])
        .add_2bytes(len.to_be_bytes())
}

/// Fold of a ones' complement sum (words as they sit in memory, so only
/// compared with sums made the same way; 0xffff is a valid checksum's).
fn folded(s: Sum16BitWords) -> u16 {
    !s.ones_complement()
}

/// A ones' complement value with its two zeros made one (0xffff -> 0).
fn residue(x: u16) -> u16 {
    x % 0xffff
}

/// The L4 checksum as it arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum L4Sum {
    /// UDP with 0: no checksum.
    Absent,
    /// Sums, with the pseudo-header, to all ones.
    Full,
    /// The field holds the pseudo-header sum (a sender with offload).
    Unfinished,
    /// Neither: a wrong checksum.
    Wrong,
}

/// Name of the field at byte `off` of an Ethernet/IPv4 frame whose IPv4
/// header is `ihl` bytes long and carries `proto`, total length `end`.
fn field_name(off: usize, ihl: usize, proto: u8, end: usize) -> &'static str {
    let l4 = ETH_LEN + ihl;
    match off {
        0..6 => "destination MAC",
        6..12 => "source MAC",
        12..14 => "EtherType",
        o if o >= end => "bytes after the IPv4 packet",
        14 => "IPv4 version/IHL",
        15 => "IPv4 TOS",
        16..18 => "IPv4 total length",
        18..20 => "IPv4 id",
        20..22 => "IPv4 flags/fragment offset",
        22 => "TTL",
        23 => "IP protocol",
        24..26 => "IPv4 header checksum",
        26..30 => "source address",
        30..34 => "destination address",
        o if o < l4 => "IPv4 options",
        o => match (proto, o - l4) {
            (_, 0..2) => "source port",
            (_, 2..4) => "destination port",
            (UDP, 4..6) => "UDP length",
            (UDP, 6..8) => "UDP checksum",
            (UDP, _) => "UDP payload",
            (_, 4..8) => "TCP sequence number",
            (_, 8..12) => "TCP acknowledgment number",
            (_, 12) => "TCP data offset",
            (_, 13) => "TCP flags",
            (_, 14..16) => "TCP window",
            (_, 16..18) => "TCP checksum",
            (_, 18..20) => "TCP urgent pointer",
            _ => "TCP options or payload",
        },
    }
}

/// Judge one run of the program: `input` received, `action` returned,
/// `output` the frame as the program left it.
pub fn check(input: &[u8], action: u32, output: &[u8]) -> Result<Outcome, Violation> {
    if let Some(r) = check_icmp(input, action, output) {
        return r;
    }
    if let Some(tags) = vlan_tags(input) {
        return check_tagged(input, action, output, tags);
    }
    let addrs = ipv4_addrs(input);
    let for_vip = addrs.is_some_and(|(_, d)| is_vip_addr(d));
    let from_backend = addrs.is_some_and(|(s, _)| is_backend_addr(s));
    if !for_vip && !from_backend {
        if action != XDP_PASS {
            return Err(violation(
                "not for a VIP nor from a backend, yet not passed",
                format!("returned {}", action_name(action)),
            ));
        }
        if output != input {
            return Err(violation("not for a VIP nor from a backend, yet changed", first_difference(input, output)));
        }
        return Ok(Outcome::Passed);
    }
    if !matches!(action, XDP_PASS | XDP_DROP | XDP_TX | XDP_REDIRECT) {
        return Err(violation("action other than PASS, DROP, TX, REDIRECT", action_name(action)));
    }
    if action == XDP_DROP && !for_vip {
        if output == input && from_backend_endpoint(input) {
            return Ok(Outcome::DroppedStale);
        }
        return Err(violation(
            "dropped, not for a VIP",
            "XDP_DROP of a packet from a backend address to a non-VIP address, changed or not from a backend endpoint",
        ));
    }
    let transmitted = matches!(action, XDP_TX | XDP_REDIRECT);
    if output == input && !transmitted {
        return Ok(if action == XDP_DROP { Outcome::Dropped } else { Outcome::Passed });
    }
    let outcome = check_rewrite(input, output, transmitted)?;
    Ok(if action == XDP_DROP { Outcome::Dropped } else { outcome })
}

/// Rule 5, for an ICMP error quoting a TCP/UDP header (None for any other
/// frame: the other rules judge it).
fn check_icmp(input: &[u8], action: u32, output: &[u8]) -> Option<Result<Outcome, Violation>> {
    const ICMP: usize = ETH_LEN + 20;
    const Q: usize = ICMP + 8;
    const QL4: usize = Q + 20;
    // The ports are all a quote needs to name its flow (the datapath's
    // test too); the rest of the quoted L4 header may be cut off.
    if input.len() < QL4 + 4
        || u16_at(input, 12) != 0x0800
        || input[ETH_LEN] != 0x45
        || input[ETH_LEN + 9] != 1
        || !matches!(input[ICMP], 3 | 11 | 12)
        || input[Q] != 0x45
        || !matches!(input[Q + 9], TCP | UDP)
    {
        return None;
    }
    if action == XDP_PASS && output == input {
        return Some(Ok(Outcome::Passed));
    }
    let v = |rule: &str, detail: String| Some(Err(violation(format!("icmp: {rule}"), detail)));
    if action != XDP_PASS {
        return v("translated but not passed", action_name(action));
    }
    if output.len() != input.len() {
        return v("length changed", first_difference(input, output));
    }
    let proto = input[Q + 9];
    let q_check = QL4 + if proto == TCP { 16 } else { 6 };
    let may_change = |o: usize| {
        (ETH_LEN + 10..ETH_LEN + 12).contains(&o)
            || (ETH_LEN + 16..ETH_LEN + 20).contains(&o)
            || (ICMP + 2..ICMP + 4).contains(&o)
            || (Q + 10..Q + 20).contains(&o)
            || (QL4..QL4 + 4).contains(&o)
            || (q_check..q_check + 2).contains(&o)
    };
    if let Some(o) = (0..input.len()).find(|&o| input[o] != output[o] && !may_change(o)) {
        return v("a byte outside the translated fields changed", format!("byte {o}"));
    }
    // Each checksum as valid as it was (the receiver's test: all ones).
    let end = (ETH_LEN + usize::from(u16_at(input, ETH_LEN + 2))).min(input.len());
    let valid = |f: &[u8], a: usize, b: usize| a < b && folded(Sum16BitWords::new().add_slice(&f[a..b])) == 0xffff;
    for (what, a, b) in [("outer IPv4 header", ETH_LEN, ICMP), ("ICMP message", ICMP, end), ("quoted header", Q, QL4)] {
        if valid(input, a, b) != valid(output, a, b) {
            return v(
                "checksum validity changed",
                format!("{what}: {} -> {}", valid(input, a, b), valid(output, a, b)),
            );
        }
    }
    let ep = |f: &[u8], o: usize, p: usize| (addr_at(f, o), u16_at(f, p));
    let (qs_in, qd_in) = (ep(input, Q + 12, QL4), ep(input, Q + 16, QL4 + 2));
    let (qs_out, qd_out) = (ep(output, Q + 12, QL4), ep(output, Q + 16, QL4 + 2));
    let (dst_in, dst_out) = (addr_at(input, ETH_LEN + 16), addr_at(output, ETH_LEN + 16));
    let what = format!("quoted {qs_in:?} -> {qd_in:?} became {qs_out:?} -> {qd_out:?}, outer to {dst_in} -> {dst_out}");
    let about_forward = qs_in == qs_out
        && dst_in == dst_out
        && services_of_endpoint(qd_in.0, qd_in.1, proto).any(|s| (s.vip, s.port) == qd_out);
    let about_reply = qd_in == qd_out
        && dst_in == qs_in.0
        && dst_out == qs_out.0
        && service_at(qs_in.0, qs_in.1, proto).is_some_and(|s| s.backends.contains(&qs_out));
    if !about_forward && !about_reply {
        return v("neither about a forwarded packet nor about a reply", what);
    }
    Some(Ok(Outcome::IcmpTranslated))
}

/// The length of the VLAN tags of an IPv4 frame in one tag or two (rule
/// 6), or None.
fn vlan_tags(f: &[u8]) -> Option<usize> {
    let et = |o: usize| (f.len() >= o + 2).then(|| u16_at(f, o));
    if !matches!(et(12)?, 0x8100 | 0x88a8) {
        return None;
    }
    match et(16)? {
        0x0800 => Some(4),
        0x8100 if et(20)? == 0x0800 => Some(8),
        _ => None,
    }
}

/// Rule 6: a tagged frame, judged untagged.
fn check_tagged(input: &[u8], action: u32, output: &[u8], tags: usize) -> Result<Outcome, Violation> {
    let strip = |f: &[u8]| [&f[..12], &f[12 + tags..]].concat();
    if output.len() < 12 + tags || output[12..12 + tags] != input[12..12 + tags] {
        return Err(violation("vlan: tags changed", first_difference(input, output)));
    }
    let outcome = check(&strip(input), action, &strip(output))?;
    match outcome {
        Outcome::Forward { transmitted: true, .. } | Outcome::Reply { transmitted: true } => {
            Err(violation("vlan: a tagged frame left by XDP redirect or TX", action_name(action)))
        }
        o => Ok(o),
    }
}

fn first_difference(input: &[u8], output: &[u8]) -> String {
    if input.len() != output.len() {
        return format!("length {} -> {}", input.len(), output.len());
    }
    let i = input.iter().zip(output).position(|(a, b)| a != b).unwrap_or(0);
    format!("first difference at byte {i}: {:#04x} -> {:#04x}", input[i], output[i])
}

/// Rule 3: `output` is a rewrite of `input`.
fn check_rewrite(input: &[u8], output: &[u8], transmitted: bool) -> Result<Outcome, Violation> {
    if output.len() != input.len() {
        return Err(violation("rewrite: length changed", first_difference(input, output)));
    }
    let not_tcp_udp = |why: String| violation("rewrite: output not Ethernet/IPv4/TCP-or-UDP", why);
    let sliced = SlicedPacket::from_ethernet(output).map_err(|e| {
        // One rule per way of failing (the layer or header at fault).
        let how = match &e {
            SliceError::Len(l) => format!("{:?} too short", l.layer),
            SliceError::Tcp(_) => "TCP data offset".into(),
            SliceError::Ipv4(_) | SliceError::Ip(_) => "IPv4 header".into(),
            _ => "other".into(),
        };
        violation(format!("rewrite: output does not parse ({how})"), format!("etherparse: {e}"))
    })?;
    if !sliced.link_exts.is_empty() {
        return Err(not_tcp_udp("VLAN-tagged".into()));
    }
    let Some(NetSlice::Ipv4(ip)) = &sliced.net else {
        return Err(not_tcp_udp("not IPv4".into()));
    };
    let proto = match sliced.transport {
        Some(TransportSlice::Tcp(_)) => TCP,
        Some(TransportSlice::Udp(_)) => UDP,
        _ => {
            return Err(not_tcp_udp(format!(
                "IP protocol {}, fragmented: {}",
                ip.header().protocol().0,
                ip.is_payload_fragmented()
            )));
        }
    };
    let header = ip.header();
    let ihl = header.slice().len();
    // The receiver's test: the header, checksum included, sums to all ones.
    if folded(Sum16BitWords::new().add_slice(header.slice())) != 0xffff {
        return Err(violation(
            "rewrite: IPv4 header checksum invalid",
            format!("checksum {:#06x}, input's {:#06x}", header.header_checksum(), u16_at(input, ETH_LEN + 10)),
        ));
    }
    let l4 = ETH_LEN + ihl;
    let end = ETH_LEN + usize::from(header.total_len());
    let csum_off = l4 + if proto == TCP { 16 } else { 6 };
    // Every byte but the fields a rewrite may change is the input's.
    let may_change = |o: usize| {
        (transmitted && (o < 12 || o == ETH_LEN + 8))
            || (ETH_LEN + 10..ETH_LEN + 20).contains(&o)
            || (l4..l4 + 4).contains(&o)
            || (csum_off..csum_off + 2).contains(&o)
    };
    if let Some(o) = (0..input.len()).find(|&o| input[o] != output[o] && !may_change(o)) {
        return Err(violation(
            "rewrite: a byte outside the rewritten fields changed",
            format!("byte {o} ({}): {:#04x} -> {:#04x}", field_name(o, ihl, proto, end), input[o], output[o]),
        ));
    }
    let (src_in, dst_in) = (addr_at(input, ETH_LEN + 12), addr_at(input, ETH_LEN + 16));
    let (src_out, dst_out) = (addr_at(output, ETH_LEN + 12), addr_at(output, ETH_LEN + 16));
    let (sport_in, dport_in) = (u16_at(input, l4), u16_at(input, l4 + 2));
    let (sport_out, dport_out) = (u16_at(output, l4), u16_at(output, l4 + 2));
    let src_changed = (src_in, sport_in) != (src_out, sport_out);
    let dst_changed = (dst_in, dport_in) != (dst_out, dport_out);
    let what =
        format!("{src_in}:{sport_in} -> {dst_in}:{dport_in} became {src_out}:{sport_out} -> {dst_out}:{dport_out}");
    let outcome = match (src_changed, dst_changed) {
        (false, true) => {
            let Some(svc) = service_at(dst_in, dport_in, proto) else {
                return Err(violation("forward: input not for a service", what));
            };
            if !svc.backends.contains(&(dst_out, dport_out)) {
                return Err(violation("forward: not to a backend of the service", format!("{what} ({})", svc.name)));
            }
            Outcome::Forward { to: (dst_out, dport_out), transmitted }
        }
        (true, false) => {
            let mut owners = services_of_endpoint(src_in, sport_in, proto).peekable();
            if owners.peek().is_none() {
                return Err(violation("reply: input not from a backend endpoint", what));
            }
            if !owners.any(|s| (s.vip, s.port) == (src_out, sport_out)) {
                return Err(violation("reply: not from the VIP of a service of the endpoint", what));
            }
            Outcome::Reply { transmitted }
        }
        _ => return Err(violation("rewrite: neither a forward nor a reply", what)),
    };
    let (ttl_in, ttl_out) = (input[ETH_LEN + 8], output[ETH_LEN + 8]);
    if transmitted {
        if ttl_in < 2 || ttl_out != ttl_in - 1 {
            return Err(violation("transmit: TTL not decremented by one", format!("TTL {ttl_in} -> {ttl_out}")));
        }
        let Some((dmac, smac)) = next_hop_macs(dst_out) else {
            return Err(violation("transmit: to an address without a neighbour", what));
        };
        if output[0..6] != dmac || output[6..12] != smac {
            return Err(violation(
                "transmit: MACs not the next hop's",
                format!("to {dst_out}: {:02x?} {:02x?}, want {dmac:02x?} {smac:02x?}", &output[0..6], &output[6..12]),
            ));
        }
    }
    check_l4_checksum(input, output, proto, (l4, end, csum_off), transmitted)
        .map_err(|d| violation("L4 checksum", d))?;
    Ok(outcome)
}

/// The L4 checksum rules (see the module doc). Lengths are the IPv4
/// header's: the segment is `l4..end`, the field at `csum_off`.
fn check_l4_checksum(
    input: &[u8],
    output: &[u8],
    proto: u8,
    (l4, end, csum_off): (usize, usize, usize),
    transmitted: bool,
) -> Result<(), String> {
    let len = u16::try_from(end - l4).expect("an IPv4 payload fits 16 bits");
    let sums = |f: &[u8]| {
        let (src, dst) = (addr_at(f, ETH_LEN + 12), addr_at(f, ETH_LEN + 16));
        let pseudo = pseudo_header(src, dst, proto, len);
        let field = u16::from_ne_bytes([f[csum_off], f[csum_off + 1]]);
        (folded(pseudo.clone().add_slice(&f[l4..end])), folded(pseudo), field)
    };
    let (whole_in, pseudo_in, field_in) = sums(input);
    let (whole_out, pseudo_out, field_out) = sums(output);
    let kind = if proto == UDP && field_in == 0 {
        L4Sum::Absent
    } else if whole_in == 0xffff {
        L4Sum::Full
    } else if field_in == pseudo_in {
        L4Sum::Unfinished
    } else {
        L4Sum::Wrong
    };
    let valid_out = whole_out == 0xffff && !(proto == UDP && field_out == 0);
    let ok = match kind {
        L4Sum::Absent => field_out == 0 || valid_out,
        L4Sum::Full => valid_out,
        L4Sum::Unfinished if transmitted => valid_out,
        L4Sum::Unfinished => residue(field_out) == residue(pseudo_out),
        L4Sum::Wrong => residue(whole_out) == residue(whole_in),
    };
    if ok {
        return Ok(());
    }
    let field = |f: &[u8]| u16_at(f, csum_off);
    let want = match kind {
        L4Sum::Absent => "0 or a valid checksum",
        L4Sum::Full => "a valid checksum",
        L4Sum::Unfinished if transmitted => "finished and valid (transmitted)",
        L4Sum::Unfinished => "unfinished for the new addresses (kernel path)",
        L4Sum::Wrong => "as wrong as it came (same residue)",
    };
    Err(format!("input {kind:?} {:#06x}, output {:#06x}: want {want}", field(input), field(output)))
}

// ---------------------------------------------------------------- frames

/// Recompute the IPv4 header checksum of the header at `l3`, if it is there.
fn fix_ip_checksum(f: &mut [u8], l3: usize) {
    if f.len() < l3 + 20 {
        return;
    }
    let ihl = usize::from(f[l3] & 0x0f) * 4;
    if ihl < 20 || f.len() < l3 + ihl {
        return;
    }
    f[l3 + 10..l3 + 12].fill(0);
    let c = Sum16BitWords::new().add_slice(&f[l3..l3 + ihl]).ones_complement();
    f[l3 + 10..l3 + 12].copy_from_slice(&c.to_ne_bytes());
}

/// Where the L4 checksum of the IPv4 packet at `l3` is: (segment start,
/// end, checksum offset, protocol), if the lengths allow one.
fn l4_layout(f: &[u8], l3: usize) -> Option<(usize, usize, usize, u8)> {
    if f.len() < l3 + 20 {
        return None;
    }
    let ihl = usize::from(f[l3] & 0x0f) * 4;
    let proto = f[l3 + 9];
    let (l4, end) = (l3 + ihl, l3 + usize::from(u16_at(f, l3 + 2)));
    let csum = match proto {
        TCP => l4 + 16,
        UDP => l4 + 6,
        _ => return None,
    };
    (ihl >= 20 && end <= f.len() && csum + 2 <= end).then_some((l4, end, csum, proto))
}

/// Write the L4 checksum of the IPv4 packet at `l3`: finished, or (when
/// `unfinished`) the pseudo-header sum a sender with offload leaves.
fn set_l4_checksum(f: &mut [u8], l3: usize, unfinished: bool) {
    let Some((l4, end, csum, proto)) = l4_layout(f, l3) else {
        return;
    };
    let len = u16::try_from(end - l4).expect("an IPv4 payload fits 16 bits");
    let pseudo = pseudo_header(addr_at(f, l3 + 12), addr_at(f, l3 + 16), proto, len);
    let value = if unfinished {
        folded(pseudo)
    } else {
        f[csum..csum + 2].fill(0);
        match pseudo.add_slice(&f[l4..end]).ones_complement() {
            0 if proto == UDP => 0xffff,
            c => c,
        }
    };
    f[csum..csum + 2].copy_from_slice(&value.to_ne_bytes());
}

/// Offset of the network header: after the 802.1Q / 802.1ad tags.
fn l3_offset(f: &[u8]) -> usize {
    let mut off = 12;
    while f.len() >= off + 2 && matches!(u16_at(f, off), 0x8100 | 0x88a8) && off < 20 {
        off += 4;
    }
    off + 2
}

/// IPv4 options of `words` 32-bit words: real ones (NOPs, router alert,
/// record route, timestamp) or random bytes.
fn ip_options(rng: &mut Rng, words: usize) -> Vec<u8> {
    let len = words * 4;
    let mut o = match rng.u32(0..5) {
        0 => vec![1; len],
        1 => [148, 4, 0, 0].repeat(words),
        2 if len >= 8 => {
            let mut v = vec![7, (len - 1) as u8, 4];
            v.resize(len, 0);
            v
        }
        3 if len >= 8 => {
            let mut v = vec![68, len as u8, 5, 0];
            v.resize(len, 0);
            v
        }
        _ => {
            let mut v = vec![0; len];
            rng.fill(&mut v);
            v
        }
    };
    if rng.u32(0..4) == 0 {
        o[len - 1] = 0; // end of options
    }
    o
}

/// TCP options, a multiple of 4 bytes: MSS, window scale, SACK permitted,
/// timestamps in some order, NOP padded, or random bytes.
fn tcp_options(rng: &mut Rng) -> Vec<u8> {
    if rng.u32(0..5) == 0 {
        let mut v = vec![0; rng.usize(1..=10) * 4];
        rng.fill(&mut v);
        return v;
    }
    let mut v = Vec::new();
    if rng.bool() {
        v.extend_from_slice(&[2, 4, 0x05, 0xb4]);
    }
    if rng.bool() {
        v.extend_from_slice(&[1, 3, 3, rng.u8(0..15)]);
    }
    if rng.bool() {
        v.extend_from_slice(&[4, 2]);
    }
    if rng.bool() {
        v.extend_from_slice(&[8, 10]);
        v.extend_from_slice(&rng.u64(..).to_be_bytes());
    }
    while !v.len().is_multiple_of(4) || v.is_empty() {
        v.push(1);
    }
    v
}

/// What a case was made as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Client -> a service's VIP and port.
    ToService,
    /// Client -> an address or port or protocol no service has.
    NotService,
    /// Backend -> client: of a flow, or stray.
    Reply,
    /// Random bytes, some dressed as IPv4.
    Random,
    /// ICMP echo, and errors quoting a VIP's packet.
    Icmp,
    Ipv6,
    Arp,
    /// 802.1Q / 802.1ad tagged.
    Vlan,
    /// The frame of `LB_FUZZ_REPLAY`.
    Replay,
}

/// A flow the datapath forwarded: its replies come from `backend`.
#[derive(Clone, Copy)]
struct FlowRec {
    client: (Ipv4Addr, u16),
    svc: usize,
    backend: (Ipv4Addr, u16),
}

/// A client's (address, port) and the index of the service it sent to.
type Learn = ((Ipv4Addr, u16), usize);

struct Case {
    kind: Kind,
    mutated: bool,
    side: Side,
    frame: Vec<u8>,
    /// The frame before mutation (the same when not mutated).
    base: Vec<u8>,
    /// An unmutated client packet to service `.1`: when forwarded, a flow
    /// to reply to.
    learn: Option<Learn>,
}

/// The case generator: one PRNG stream per packet (from the seed and the
/// packet's number), and the flows forwarded so far.
struct Gen {
    seed: u64,
    rng: Rng,
    flows: VecDeque<FlowRec>,
}

const FLOW_POOL: usize = 512;

impl Gen {
    fn new(seed: u64) -> Self {
        Self { seed, rng: Rng::with_seed(seed), flows: VecDeque::with_capacity(FLOW_POOL) }
    }

    fn learn(&mut self, client: (Ipv4Addr, u16), svc: usize, backend: (Ipv4Addr, u16)) {
        if self.flows.len() == FLOW_POOL {
            self.flows.pop_front();
        }
        self.flows.push_back(FlowRec { client, svc, backend });
    }

    fn case(&mut self, index: u64) -> Case {
        self.rng = Rng::with_seed(self.seed ^ index.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut learn = None;
        let (kind, base, natural) = match self.rng.u32(0..100) {
            0..40 => {
                let (f, l) = self.client_packet(true);
                learn = l;
                (Kind::ToService, f, Side::A)
            }
            40..46 => (Kind::NotService, self.client_packet(false).0, Side::A),
            46..70 => (Kind::Reply, self.reply_packet(), Side::B),
            70..78 => (Kind::Random, self.random_frame(), self.side()),
            78..84 => {
                let (f, s) = self.icmp_packet();
                (Kind::Icmp, f, s)
            }
            84..91 => {
                let (f, s) = self.ipv6_packet();
                (Kind::Ipv6, f, s)
            }
            91..95 => {
                let (f, s) = self.arp_packet();
                (Kind::Arp, f, s)
            }
            _ => {
                let (f, s) = self.vlan_packet();
                (Kind::Vlan, f, s)
            }
        };
        let mutated = kind != Kind::Random && self.rng.u32(0..100) < 55;
        let frame = if mutated { self.mutate(&base) } else { base.clone() };
        let side = if self.rng.u32(0..100) < 80 { natural } else { self.side() };
        Case { kind, mutated, side, frame, base, learn: if mutated { None } else { learn } }
    }

    fn side(&mut self) -> Side {
        match self.rng.u32(0..10) {
            0..5 => Side::A,
            5..9 => Side::B,
            _ => Side::Lo,
        }
    }

    /// A client address: CLIENT (which has a neighbour), one of the
    /// clients' network, or anywhere.
    fn client_addr(&mut self) -> Ipv4Addr {
        match self.rng.u32(0..10) {
            0..6 => CLIENT,
            6..9 => Ipv4Addr::new(10, 10, self.rng.u8(1..=254), self.rng.u8(1..=254)),
            _ => Ipv4Addr::from(self.rng.u32(..)),
        }
    }

    fn client_flags(&mut self) -> u8 {
        match self.rng.u32(0..100) {
            0..35 => flag::SYN,
            35..60 => flag::ACK,
            60..75 => flag::PSH | flag::ACK,
            75..83 => flag::FIN | flag::ACK,
            83..88 => flag::RST,
            88..90 => flag::RST | flag::ACK,
            _ => self.rng.u8(..),
        }
    }

    fn reply_flags(&mut self) -> u8 {
        match self.rng.u32(0..100) {
            0..30 => flag::SYN | flag::ACK,
            30..60 => flag::ACK,
            60..80 => flag::PSH | flag::ACK,
            80..90 => flag::FIN | flag::ACK,
            90..95 => flag::RST,
            _ => self.rng.u8(..),
        }
    }

    /// A valid Ethernet/IPv4/TCP-or-UDP frame (etherparse writes it):
    /// random id, payload, sequence numbers, window; TTL mostly 64; some
    /// with IPv4 or TCP options; the L4 checksum mostly finished, some
    /// unfinished, some UDP without one.
    fn l4_frame(
        &mut self,
        (dmac, smac): ([u8; 6], [u8; 6]),
        proto: u8,
        (src, sport): (Ipv4Addr, u16),
        (dst, dport): (Ipv4Addr, u16),
        flags: u8,
    ) -> Vec<u8> {
        let r = &mut self.rng;
        let payload_len = match r.u32(0..10) {
            0..6 => r.usize(0..40),
            6..9 => r.usize(40..600),
            _ => r.usize(600..1380),
        };
        let mut payload = vec![0; payload_len];
        r.fill(&mut payload);
        let ttl = match r.u32(0..40) {
            0 => 0,
            1 => 1,
            2 => 2,
            3 => 255,
            _ => 64,
        };
        let mut ip = Ipv4Header::new(0, ttl, IpNumber(proto), src.octets(), dst.octets()).expect("no payload yet");
        ip.identification = r.u16(..);
        ip.dont_fragment = r.u32(0..5) != 0;
        if r.u32(0..10) == 0 {
            let words = r.usize(1..=10);
            ip.options = ip_options(r, words).as_slice().try_into().expect("whole words, at most 40 bytes");
        }
        let mut l4 = Vec::with_capacity(60 + payload.len());
        if proto == TCP {
            let mut t = TcpHeader::new(sport, dport, r.u32(..), r.u16(..));
            (t.fin, t.syn, t.rst, t.psh) =
                (flags & flag::FIN != 0, flags & flag::SYN != 0, flags & flag::RST != 0, flags & flag::PSH != 0);
            (t.ack, t.urg, t.ece, t.cwr) =
                (flags & flag::ACK != 0, flags & flag::URG != 0, flags & flag::ECE != 0, flags & flag::CWR != 0);
            if t.ack {
                t.acknowledgment_number = r.u32(..);
            }
            if t.urg {
                t.urgent_pointer = r.u16(..);
            }
            if r.u32(0..4) == 0 {
                t.set_options_raw(&tcp_options(r)).expect("whole words, at most 40 bytes");
            }
            ip.set_payload_len(t.header_len() + payload.len()).expect("fits");
            t.checksum = t.calc_checksum_ipv4(&ip, &payload).expect("fits");
            t.write(&mut l4).expect("write to a Vec");
        } else {
            ip.set_payload_len(UdpHeader::LEN + payload.len()).expect("fits");
            let u = UdpHeader::with_ipv4_checksum(sport, dport, &ip, &payload).expect("fits");
            u.write(&mut l4).expect("write to a Vec");
        }
        l4.extend_from_slice(&payload);
        ip.header_checksum = ip.calc_header_checksum();
        let mut f = Vec::with_capacity(ETH_LEN + ip.header_len() + l4.len());
        f.extend_from_slice(&dmac);
        f.extend_from_slice(&smac);
        f.extend_from_slice(&ETH_P_IP);
        ip.write_raw(&mut f).expect("write to a Vec");
        f.extend_from_slice(&l4);
        match r.u32(0..20) {
            0 | 1 => set_l4_checksum(&mut f, ETH_LEN, true),
            2 if proto == UDP => {
                let off = ETH_LEN + ip.header_len() + 6;
                f[off..off + 2].fill(0);
            }
            _ => {}
        }
        f
    }

    /// A client's packet: to a service (`to_service`; the flow to learn
    /// if it is forwarded), or to something no service is.
    fn client_packet(&mut self, to_service: bool) -> (Vec<u8>, Option<Learn>) {
        let client = (self.client_addr(), self.rng.u16(1024..));
        let (dst, proto, svc) = if to_service {
            let i = self.rng.usize(..SERVICES.len());
            let s = &SERVICES[i];
            ((s.vip, s.port), s.proto, Some(i))
        } else {
            let s = &SERVICES[self.rng.usize(..SERVICES.len())];
            match self.rng.u32(0..4) {
                // A port of the VIP no service has.
                0 => ((s.vip, *self.rng.choice(&[8080, 22, 79, 82, 444, 0]).expect("not empty")), s.proto, None),
                // The service's port with the other protocol.
                1 => ((s.vip, s.port), TCP + UDP - s.proto, None),
                // Another address, the service's port (the gateway, a
                // backend, the clients' network, the Internet).
                2 => {
                    let other =
                        [Ipv4Addr::new(10, 10, 0, 7), Ipv4Addr::new(10, 10, 0, 1), BACKEND, Ipv4Addr::new(8, 8, 8, 8)];
                    ((*self.rng.choice(&other).expect("not empty"), s.port), s.proto, None)
                }
                _ => (
                    (Ipv4Addr::from(self.rng.u32(..)), self.rng.u16(..)),
                    if self.rng.bool() { TCP } else { UDP },
                    None,
                ),
            }
        };
        let flags = self.client_flags();
        let f = self.l4_frame((GW_A_MAC, CLIENT_MAC), proto, client, dst, flags);
        (f, svc.map(|i| (client, i)))
    }

    /// A backend's packet: a reply of a flow the datapath forwarded, a
    /// stray one from a backend endpoint, or one from a backend address
    /// but no endpoint.
    fn reply_packet(&mut self) -> Vec<u8> {
        let roll = self.rng.u32(0..10);
        let (src, dst, proto) = if roll < 7 && !self.flows.is_empty() {
            let n = self.flows.len();
            let f = self.flows[n - 1 - self.rng.usize(..n.min(128))];
            (f.backend, f.client, SERVICES[f.svc].proto)
        } else if roll < 9 {
            let s = &SERVICES[self.rng.usize(..SERVICES.len())];
            let b = s.backends[self.rng.usize(..s.backends.len())];
            (b, (self.client_addr(), self.rng.u16(1024..)), s.proto)
        } else {
            let addr = *self.rng.choice(&[BACKEND, BACKEND_UNRESOLVED, BACKEND3]).expect("not empty");
            let any = self.rng.u16(..);
            let port = *self.rng.choice(&[22, 8082, 5354, any]).expect("not empty");
            ((addr, port), (self.client_addr(), self.rng.u16(..)), if self.rng.bool() { TCP } else { UDP })
        };
        let flags = self.reply_flags();
        self.l4_frame((GW_B_MAC, BACKEND_MAC), proto, src, dst, flags)
    }

    /// Random bytes, from 14 (BPF_PROG_TEST_RUN's least) to 1,514 bytes,
    /// some with the IPv4 EtherType, some also with a version 4 header to
    /// or from our addresses.
    fn random_frame(&mut self) -> Vec<u8> {
        let len =
            if self.rng.u32(0..20) == 0 { self.rng.usize(ETH_LEN..=MAX_FRAME) } else { self.rng.usize(ETH_LEN..=160) };
        let mut f = vec![0; len];
        self.rng.fill(&mut f);
        if self.rng.u32(0..3) > 0 {
            f[12..14].copy_from_slice(&ETH_P_IP);
        }
        if self.rng.bool() && len >= ETH_LEN + 20 {
            f[14] = if self.rng.u32(0..4) > 0 { 0x45 } else { 0x40 | self.rng.u8(..16) };
            let any = self.rng.u8(..);
            f[23] = *self.rng.choice(&[TCP, UDP, TCP, UDP, 1, any]).expect("not empty");
            if self.rng.bool() {
                f[30..34].copy_from_slice(&if self.rng.bool() { VIP } else { VIP2 }.octets());
            }
            if self.rng.u32(0..3) == 0 {
                f[26..30].copy_from_slice(&BACKEND.octets());
            }
            if self.rng.bool() {
                f[16..18].copy_from_slice(&((len - ETH_LEN) as u16).to_be_bytes());
                f[20..22].copy_from_slice(&[0x40, 0]);
            }
            if self.rng.bool() {
                fix_ip_checksum(&mut f, ETH_LEN);
            }
        }
        f
    }

    /// ICMP: echo to a VIP or from a backend, and errors quoting a VIP's
    /// or a backend's packet.
    fn icmp_packet(&mut self) -> (Vec<u8>, Side) {
        let vip = if self.rng.bool() { VIP } else { VIP2 };
        let (cport, id) = (self.rng.u16(1024..), self.rng.u16(..));
        let (src, dst, ty, quoted, side) = match self.rng.u32(0..6) {
            0 => return (icmp_echo_frame(GW_A_MAC, CLIENT_MAC, CLIENT, vip, id, true), Side::A),
            1 => return (icmp_echo_frame(GW_B_MAC, BACKEND_MAC, BACKEND, CLIENT, id, false), Side::B),
            // The client says a reply from the VIP found no socket.
            2 => {
                let q = self.quoted(TCP, (vip, 80), (CLIENT, cport), (CLIENT_MAC, GW_A_MAC));
                (CLIENT, vip, Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port), q, Side::A)
            }
            // A router on the way to the client: fragmentation needed.
            3 => {
                let q = self.quoted(TCP, (vip, 443), (CLIENT, cport), (CLIENT_MAC, GW_A_MAC));
                let ty = Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded {
                    next_hop_mtu: 1400,
                });
                (Ipv4Addr::new(192, 0, 2, 1), vip, ty, q, Side::A)
            }
            // A router: a client's datagram to the VIP timed out.
            4 => {
                let q = self.quoted(UDP, (CLIENT, cport), (vip, 53), (GW_A_MAC, CLIENT_MAC));
                (
                    Ipv4Addr::new(10, 10, 0, 1),
                    CLIENT,
                    Icmpv4Type::TimeExceeded(TimeExceededCode::TtlExceededInTransit),
                    q,
                    Side::A,
                )
            }
            // The backend: port unreachable for a forwarded packet.
            _ => {
                let q = self.quoted(UDP, (CLIENT, cport), (BACKEND, 5353), (BACKEND_MAC, GW_B_MAC));
                (BACKEND, CLIENT, Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port), q, Side::B)
            }
        };
        let (dmac, smac) = if side == Side::A { (GW_A_MAC, CLIENT_MAC) } else { (GW_B_MAC, BACKEND_MAC) };
        let b = PacketBuilder::ethernet2(smac, dmac).ipv4(src.octets(), dst.octets(), 64).icmpv4(ty);
        let mut out = Vec::with_capacity(b.size(quoted.len()));
        b.write(&mut out, &quoted).expect("write to a Vec");
        (out, side)
    }

    /// The start of a packet as an ICMP error quotes it: IPv4 header and
    /// the first 8 bytes of the TCP/UDP header.
    fn quoted(&mut self, proto: u8, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), macs: ([u8; 6], [u8; 6])) -> Vec<u8> {
        let f = self.l4_frame(macs, proto, src, dst, flag::SYN | flag::ACK);
        let ihl = usize::from(f[ETH_LEN] & 0x0f) * 4;
        f[ETH_LEN..ETH_LEN + ihl + 8].to_vec()
    }

    /// IPv6 TCP, UDP and ICMPv6 between addresses of ours, v4-mapped
    /// (::ffff:a.b.c.d), NAT64 (64:ff9b::a.b.c.d) and ULA ones.
    fn ipv6_packet(&mut self) -> (Vec<u8>, Side) {
        let addrs = [
            Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1),
            Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x64),
            VIP.to_ipv6_mapped(),
            VIP2.to_ipv6_mapped(),
            BACKEND.to_ipv6_mapped(),
            CLIENT.to_ipv6_mapped(),
            Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0x0a0a, 0x0064),
        ];
        let src = *self.rng.choice(&addrs).expect("not empty");
        let dst = *self.rng.choice(&addrs).expect("not empty");
        let side = self.side();
        let (dmac, smac) = if side == Side::B { (GW_B_MAC, BACKEND_MAC) } else { (GW_A_MAC, CLIENT_MAC) };
        let s = &SERVICES[self.rng.usize(..SERVICES.len())];
        let mut payload = vec![0; self.rng.usize(0..64)];
        self.rng.fill(&mut payload);
        let ip = PacketBuilder::ethernet2(smac, dmac).ipv6(src.octets(), dst.octets(), 64);
        let mut out = Vec::new();
        match self.rng.u32(0..3) {
            0 => {
                let b = ip.tcp(self.rng.u16(1024..), s.port, self.rng.u32(..), 64240).syn();
                b.write(&mut out, &payload).expect("write to a Vec");
            }
            1 => {
                let b = ip.udp(self.rng.u16(1024..), s.port);
                b.write(&mut out, &payload).expect("write to a Vec");
            }
            _ => {
                let b = ip.icmpv6_echo_request(self.rng.u16(..), 1);
                b.write(&mut out, &payload).expect("write to a Vec");
            }
        }
        (out, side)
    }

    /// ARP requests for our addresses and replies from a backend.
    fn arp_packet(&mut self) -> (Vec<u8>, Side) {
        match self.rng.u32(0..3) {
            0 => (arp_request(CLIENT_MAC, CLIENT, if self.rng.bool() { VIP } else { VIP2 }), Side::A),
            1 => (arp_request(BACKEND_MAC, BACKEND, Ipv4Addr::new(10, 20, 0, 1)), Side::B),
            _ => {
                let arp = ArpEthIpv4Packet {
                    operation: ArpOperation::REPLY,
                    sender_mac: BACKEND_MAC,
                    sender_ipv4: BACKEND.octets(),
                    target_mac: GW_B_MAC,
                    target_ipv4: [10, 20, 0, 1],
                };
                let b = PacketBuilder::ethernet2(BACKEND_MAC, GW_B_MAC).arp(arp.into());
                let mut out = Vec::with_capacity(b.size());
                b.write(&mut out).expect("write to a Vec");
                (out, Side::B)
            }
        }
    }

    /// A client's packet to a service or a backend's reply, VLAN tagged
    /// (802.1Q, sometimes inside an 802.1ad tag).
    fn vlan_packet(&mut self) -> (Vec<u8>, Side) {
        let (mut f, side) =
            if self.rng.bool() { (self.client_packet(true).0, Side::A) } else { (self.reply_packet(), Side::B) };
        let vid = self.rng.u16(1..4095).to_be_bytes();
        insert_at(&mut f, 12, &[0x81, 0x00, vid[0], vid[1]]);
        if self.rng.u32(0..4) == 0 {
            let outer = self.rng.u8(1..);
            insert_at(&mut f, 12, &[0x88, 0xa8, 0, outer]);
        }
        f.truncate(MAX_FRAME);
        (f, side)
    }

    /// One to three mutations of `base`, then (often) the IPv4 header
    /// checksum made right again, and sometimes the L4 checksum, so that
    /// mutated packets also get past checksum checks.
    fn mutate(&mut self, base: &[u8]) -> Vec<u8> {
        let mut f = base.to_vec();
        let l3 = l3_offset(&f);
        let n = match self.rng.u32(0..10) {
            0..6 => 1,
            6..9 => 2,
            _ => 3,
        };
        for _ in 0..n {
            self.mutate_once(&mut f, l3);
        }
        if self.rng.u32(0..100) < 60 {
            fix_ip_checksum(&mut f, l3);
        }
        if self.rng.u32(0..100) < 30 {
            set_l4_checksum(&mut f, l3, false);
        }
        f
    }

    fn mutate_once(&mut self, f: &mut Vec<u8>, l3: usize) {
        let has_ip = f.len() >= l3 + 20;
        let ihl = if has_ip { usize::from(f[l3] & 0x0f) * 4 } else { 0 };
        let l4 = l3 + ihl.max(20);
        let op = if has_ip { self.rng.u32(0..16) } else { self.rng.u32(0..4) };
        let r = &mut self.rng;
        match op {
            // A bit flip, mostly in the headers.
            0 => {
                let hdr = f.len().min(l4 + 20);
                let pos = if r.u32(0..10) < 7 { r.usize(..hdr) } else { r.usize(..f.len()) };
                f[pos] ^= 1 << r.u32(0..8);
            }
            1 => {
                let pos = r.usize(..f.len());
                f[pos] = r.u8(..);
            }
            // Truncation (BPF_PROG_TEST_RUN takes no less than 14 bytes).
            2 if f.len() > ETH_LEN => f.truncate(r.usize(ETH_LEN..f.len())),
            // Extension: bytes after the packet.
            2 | 3 => {
                let n = r.usize(1..=64).min(MAX_FRAME.saturating_sub(f.len()));
                f.extend((0..n).map(|_| r.u8(..)));
            }
            // Version and IHL.
            4 => {
                f[l3] = match r.u32(0..3) {
                    0 => r.u8(..),
                    1 => 0x40 | r.u8(..16),
                    _ => 0x40 | ((f[l3] & 0x0f) + 1).min(15),
                }
            }
            // Total length.
            5 => {
                let real = (f.len() - l3) as u16;
                let v = match r.u32(0..6) {
                    0 => r.u16(..),
                    1 => real.wrapping_add(r.u16(1..8)),
                    2 => real.saturating_sub(r.u16(1..8)),
                    3 => 0,
                    4 => 20,
                    _ => 0xffff,
                };
                f[l3 + 2..l3 + 4].copy_from_slice(&v.to_be_bytes());
            }
            // Fragment bits and offset.
            6 => {
                let v: u16 = match r.u32(0..5) {
                    0 => 0x2000 | r.u16(..0x2000),
                    1 => r.u16(1..0x2000),
                    2 => 0x2000,
                    3 => u16_at(f, l3 + 6) ^ 0x4000,
                    _ => 0x8000 | u16_at(f, l3 + 6),
                };
                f[l3 + 6..l3 + 8].copy_from_slice(&v.to_be_bytes());
            }
            7 => {
                let any = r.u8(..);
                f[l3 + 9] = *r.choice(&[0, 1, 2, 4, 6, 17, 41, 47, 50, 51, 58, 132, 136, 255, any]).expect("not empty");
            }
            8 => f[l3 + 8] = *r.choice(&[0, 1, 2, 255]).expect("not empty"),
            // Ports.
            9 if f.len() >= l4 + 4 => {
                let any = r.u16(..);
                let ports = [80, 81, 53, 443, 514, 8080, 8081, 5353, 9443, 5514, 0, any];
                let v: u16 = *r.choice(&ports).expect("not empty");
                let at = l4 + if r.bool() { 0 } else { 2 };
                f[at..at + 2].copy_from_slice(&v.to_be_bytes());
            }
            // TCP flags or data offset; UDP length.
            10 if f.len() >= l4 + 14 && f[l3 + 9] == TCP => {
                if r.bool() {
                    f[l4 + 13] = r.u8(..);
                } else {
                    f[l4 + 12] = (r.u8(..16) << 4) | (f[l4 + 12] & 0x0f);
                }
            }
            10 if f.len() >= l4 + 8 => {
                let real = (f.len() - l4) as u16;
                let any = r.u16(..);
                let v = *r.choice(&[0, 7, 8, real.wrapping_add(1), real.saturating_sub(1), any]).expect("not empty");
                f[l4 + 4..l4 + 6].copy_from_slice(&v.to_be_bytes());
            }
            // Checksums: the L4 one wrong, 0, 0xffff or unfinished; the IPv4 one wrong.
            11 => match r.u32(0..5) {
                0 => set_l4_checksum(f, l3, true),
                1 => f[l3 + 10] ^= 1 << r.u32(0..8),
                _ => {
                    if let Some((_, _, csum, _)) = l4_layout(f, l3) {
                        let any = r.u16(..);
                        let v = *r.choice(&[0, 0xffff, any]).expect("not empty");
                        f[csum..csum + 2].copy_from_slice(&u16::to_be_bytes(v));
                    }
                }
            },
            // Addresses.
            12 => {
                let addrs = [VIP, VIP2, BACKEND, BACKEND_UNRESOLVED, BACKEND3, CLIENT, Ipv4Addr::new(10, 10, 0, 7)];
                let a =
                    if r.u32(0..4) == 0 { Ipv4Addr::from(r.u32(..)) } else { *r.choice(&addrs).expect("not empty") };
                let at = l3 + if r.bool() { 12 } else { 16 };
                f[at..at + 4].copy_from_slice(&a.octets());
            }
            // IPv4 options inserted, IHL and total length to match.
            13 if (20..60).contains(&ihl) && l3 + ihl <= f.len() => {
                let words = r.usize(1..=(60 - ihl) / 4);
                let opts = ip_options(r, words);
                insert_at(f, l3 + ihl, &opts);
                f[l3] = (f[l3] & 0xf0) | ((ihl / 4 + words) as u8);
                let tot = u16_at(f, l3 + 2).wrapping_add((words * 4) as u16);
                f[l3 + 2..l3 + 4].copy_from_slice(&tot.to_be_bytes());
                f.truncate(MAX_FRAME);
            }
            // Bytes cut out of the middle.
            14 if f.len() > ETH_LEN + 1 => {
                let at = r.usize(ETH_LEN..f.len() - 1);
                let n = r.usize(1..=(f.len() - at).min(16));
                f.copy_within(at + n.., at);
                f.truncate(f.len() - n);
            }
            // EtherType.
            _ => {
                let any = r.u16(..);
                let t: u16 = *r.choice(&[0x86dd, 0x0806, 0x8100, 0x0800, 0x88a8, any]).expect("not empty");
                f[12..14].copy_from_slice(&t.to_be_bytes());
            }
        }
    }
}

/// Where `frame` differs from the valid `base` it was mutated from, by
/// byte and field (fields named as in an untagged IPv4 frame).
fn differing_fields(base: &[u8], frame: &[u8]) -> String {
    let mut parts = Vec::new();
    if base.len() != frame.len() {
        parts.push(format!("length {} -> {}", base.len(), frame.len()));
    }
    let ipv4 = ipv4_addrs(base).is_some();
    let (ihl, proto) = if ipv4 { (usize::from(base[ETH_LEN] & 0x0f) * 4, base[ETH_LEN + 9]) } else { (20, 0) };
    let end = if ipv4 { ETH_LEN + usize::from(u16_at(base, ETH_LEN + 2)) } else { base.len() };
    for i in (0..base.len().min(frame.len())).filter(|&i| base[i] != frame[i]) {
        let name = if ipv4 { field_name(i, ihl, proto, end) } else { "-" };
        parts.push(format!("byte {i} ({name}) {:#04x} -> {:#04x}", base[i], frame[i]));
    }
    parts.join(", ")
}

/// `bytes` inserted into `f` at `at`.
fn insert_at(f: &mut Vec<u8>, at: usize, bytes: &[u8]) {
    let tail = f.split_off(at);
    f.extend_from_slice(bytes);
    f.extend_from_slice(&tail);
}

/// An ICMP echo request (or reply) from `src` to `dst`.
fn icmp_echo_frame(dmac: [u8; 6], smac: [u8; 6], src: Ipv4Addr, dst: Ipv4Addr, id: u16, request: bool) -> Vec<u8> {
    let ip = PacketBuilder::ethernet2(smac, dmac).ipv4(src.octets(), dst.octets(), 64);
    let b = if request { ip.icmpv4_echo_request(id, 1) } else { ip.icmpv4_echo_reply(id, 1) };
    let mut out = Vec::with_capacity(b.size(8));
    b.write(&mut out, b"pingpong").expect("write to a Vec");
    out
}

// ---------------------------------------------------------------- runs

/// One rule's first case (and how many broke it).
pub struct Finding {
    pub count: u64,
    pub first: Example,
}

pub struct Example {
    /// Packet number in the run (u64::MAX: a setup flow or a replay).
    pub index: u64,
    pub kind: String,
    pub side: Side,
    pub action: u32,
    pub input: Vec<u8>,
    pub output: Vec<u8>,
    pub base: Vec<u8>,
    pub detail: String,
    /// The input shrunk towards `base` while it still breaks the same
    /// rule: (input, action, output, detail).
    pub minimal: Option<(Vec<u8>, u32, Vec<u8>, String)>,
}

/// Outcome counts.
#[derive(Default, Clone, Copy)]
pub struct Outcomes {
    pub passed: u64,
    pub dropped: u64,
    /// Of those, a backend endpoint's packets not to a VIP (rule 2).
    pub dropped_stale: u64,
    pub forward_transmitted: u64,
    pub forward_kernel: u64,
    pub reply_transmitted: u64,
    pub reply_kernel: u64,
    /// ICMP errors about balanced flows, translated (rule 5).
    pub icmp_translated: u64,
}

pub struct Summary {
    pub seed: u64,
    pub replay: bool,
    /// Packets run, the setup flows included.
    pub packets: u64,
    pub elapsed: Duration,
    /// By action: ABORTED, DROP, PASS, TX, REDIRECT, other.
    pub actions: [u64; 6],
    pub outcomes: Outcomes,
    /// By what the packet was made as (and whether mutated): actions.
    pub by_kind: BTreeMap<(Kind, bool), [u64; 6]>,
    pub findings: BTreeMap<String, Finding>,
    /// The datapath's own counters at the end.
    pub counters: BTreeMap<String, u64>,
}

const ACTION_COLUMNS: [&str; 6] = ["ABORTED", "DROP", "PASS", "TX", "REDIRECT", "other"];

fn action_slot(action: u32) -> usize {
    match action {
        0..=4 => action as usize,
        _ => 5,
    }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl Summary {
    fn record(&mut self, case: &Case, index: u64, action: u32, output: &[u8], result: Result<Outcome, Violation>) {
        self.packets += 1;
        self.actions[action_slot(action)] += 1;
        self.by_kind.entry((case.kind, case.mutated)).or_default()[action_slot(action)] += 1;
        let o = &mut self.outcomes;
        match result {
            Ok(Outcome::Passed) => o.passed += 1,
            Ok(Outcome::Dropped) => o.dropped += 1,
            Ok(Outcome::DroppedStale) => {
                o.dropped += 1;
                o.dropped_stale += 1;
            }
            Ok(Outcome::Forward { transmitted: true, .. }) => o.forward_transmitted += 1,
            Ok(Outcome::Forward { transmitted: false, .. }) => o.forward_kernel += 1,
            Ok(Outcome::Reply { transmitted: true }) => o.reply_transmitted += 1,
            Ok(Outcome::Reply { transmitted: false }) => o.reply_kernel += 1,
            Ok(Outcome::IcmpTranslated) => o.icmp_translated += 1,
            Err(v) => {
                let f = self.findings.entry(v.rule).or_insert_with(|| Finding {
                    count: 0,
                    first: Example {
                        index,
                        kind: format!("{:?}{}", case.kind, if case.mutated { " (mutated)" } else { "" }),
                        side: case.side,
                        action,
                        input: case.frame.clone(),
                        output: output.to_vec(),
                        base: case.base.clone(),
                        detail: v.detail.clone(),
                        minimal: None,
                    },
                });
                f.count += 1;
            }
        }
    }

    /// The report: counts per action and outcome, per kind of input, and
    /// every broken rule with its first case.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let secs = self.elapsed.as_secs_f64();
        let rate = if secs > 0.0 { self.packets as f64 / secs } else { 0.0 };
        let _ = writeln!(
            s,
            "fuzz: seed {:#018x} (LB_FUZZ_SEED={}): {} packets in {secs:.1} s, {} packets/s",
            self.seed,
            self.seed,
            thousands(self.packets),
            thousands(rate as u64)
        );
        let _ = write!(s, "  per action:");
        for (name, n) in ACTION_COLUMNS.iter().zip(self.actions) {
            let _ = write!(s, "  {name} {}", thousands(n));
        }
        let o = &self.outcomes;
        let _ = writeln!(
            s,
            "\n  outcomes:  passed untouched {}, dropped {} (a stale backend's {}), forwards {} (transmitted {}, kernel path {}), replies {} (transmitted {}, kernel path {}), ICMP errors translated {}",
            thousands(o.passed),
            thousands(o.dropped),
            thousands(o.dropped_stale),
            thousands(o.forward_transmitted + o.forward_kernel),
            thousands(o.forward_transmitted),
            thousands(o.forward_kernel),
            thousands(o.reply_transmitted + o.reply_kernel),
            thousands(o.reply_transmitted),
            thousands(o.reply_kernel),
            thousands(o.icmp_translated),
        );
        let _ = writeln!(
            s,
            "  {:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "input", "ABORTED", "DROP", "PASS", "TX", "REDIRECT", "other"
        );
        for ((kind, mutated), a) in &self.by_kind {
            let name = format!("{kind:?}{}", if *mutated { " mutated" } else { "" });
            let _ = writeln!(s, "  {name:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}", a[0], a[1], a[2], a[3], a[4], a[5]);
        }
        let nonzero: Vec<String> =
            self.counters.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k} {}", thousands(*v))).collect();
        let _ = writeln!(s, "  datapath counters: {}", nonzero.join(", "));
        if self.findings.is_empty() {
            let _ = writeln!(s, "  rules broken: none");
        }
        for (rule, f) in &self.findings {
            let e = &f.first;
            let _ = writeln!(s, "\nRULE BROKEN: {rule}: {} packet(s); the first:", thousands(f.count));
            let packet = if e.index == u64::MAX {
                "a setup flow or the replay".to_string()
            } else {
                format!("packet #{}", e.index)
            };
            let _ = writeln!(
                s,
                "  {packet}, {}, received on {}, returned {}: {}",
                e.kind,
                e.side.name(),
                action_name(e.action),
                e.detail
            );
            let _ = writeln!(s, "  input:  {}", hex(&e.input));
            let _ = writeln!(s, "  output: {}", hex(&e.output));
            if e.base != e.input {
                let _ = writeln!(s, "  mutated from: {}", hex(&e.base));
            }
            if let Some((input, action, output, detail)) = &e.minimal {
                let _ = writeln!(
                    s,
                    "  shrunk: differs from the valid frame in {}; returned {}: {detail}",
                    differing_fields(&e.base, input),
                    action_name(*action)
                );
                let _ = writeln!(s, "  input:  {}", hex(input));
                let _ = writeln!(s, "  output: {}", hex(output));
                let _ = writeln!(s, "  replay: LB_FUZZ_REPLAY={}:{}", e.side.name(), hex(input));
            } else {
                if e.base != e.input {
                    let _ = writeln!(
                        s,
                        "  not shrunk (no step back towards the valid frame kept the rule broken): differs from it in {}",
                        differing_fields(&e.base, &e.input)
                    );
                }
                let _ = writeln!(s, "  replay: LB_FUZZ_REPLAY={}:{}", e.side.name(), hex(&e.input));
            }
        }
        s
    }

    /// Panics if any rule was broken.
    pub fn assert_no_rule_broken(&self) {
        if !self.findings.is_empty() {
            let rules: Vec<String> = self.findings.iter().map(|(r, f)| format!("{r} ({})", f.count)).collect();
            panic!("seed {} (LB_FUZZ_SEED={}): rules broken: {}", self.seed, self.seed, rules.join("; "));
        }
        // Rule 2's second kind of drop is the datapath's stale-backend
        // drop, every one of them counted.
        let counted = self.counters.get("stale_backend").copied().unwrap_or_default();
        assert_eq!(
            self.outcomes.dropped_stale, counted,
            "seed {} (LB_FUZZ_SEED={}): backend endpoints' packets dropped, against the datapath's stale_backend count",
            self.seed, self.seed
        );
    }

    /// Panics unless the run exercised every outcome: forwards and
    /// replies (transmitted and for the kernel), drops and untouched
    /// passes, each at least `min_per_mille` of the packets (per mille;
    /// the transmitted/kernel halves a fifth of that). A replay is exempt.
    pub fn assert_exercised(&self, min_per_mille: u64) {
        if self.replay {
            return;
        }
        let min = self.packets * min_per_mille / 1000;
        let o = &self.outcomes;
        let checks = [
            ("forwards", o.forward_transmitted + o.forward_kernel, min),
            ("forwards transmitted", o.forward_transmitted, min / 5),
            ("forwards for the kernel", o.forward_kernel, min / 5),
            ("replies", o.reply_transmitted + o.reply_kernel, min),
            ("replies transmitted", o.reply_transmitted, min / 5),
            ("replies for the kernel", o.reply_kernel, min / 5),
            ("drops", o.dropped, min),
            ("untouched passes", o.passed, min),
        ];
        let short: Vec<String> = checks
            .iter()
            .filter(|(_, n, want)| n < want || *n == 0)
            .map(|(what, n, want)| format!("{what}: {n} < {want}"))
            .collect();
        assert!(short.is_empty(), "seed {}: the run did not exercise every outcome: {}", self.seed, short.join(", "));
    }
}

/// Packets between two sweeps that empty the flow table.
const SWEEP_EVERY: u64 = 4096;

struct Ifs {
    a: u32,
    b: u32,
    lo: u32,
}

impl Ifs {
    fn of(&self, side: Side) -> u32 {
        match side {
            Side::A => self.a,
            Side::B => self.b,
            Side::Lo => self.lo,
        }
    }
}

/// Run the fuzzer; call it inside a network namespace of its own
/// ([`crate::fixture::in_netns`]). Needs root.
pub fn run(opts: &Options) -> Summary {
    let mut fx = Fixture::new(service_configs());
    let ifs = Ifs { a: fx.if_a, b: fx.if_b, lo: ifindex("lo") };
    let mut summary = Summary {
        seed: opts.seed,
        replay: opts.replay.is_some(),
        packets: 0,
        elapsed: Duration::ZERO,
        actions: [0; 6],
        outcomes: Outcomes::default(),
        by_kind: BTreeMap::new(),
        findings: BTreeMap::new(),
        counters: BTreeMap::new(),
    };
    let mut generator = Gen::new(opts.seed);
    let start = Instant::now();
    let one = |fx: &Fixture, summary: &mut Summary, generator: &mut Gen, case: Case, index: u64| {
        // A backend endpoint's packet to a VIP address but no service may
        // be dropped as a stale backend's or for another reason (a VIP
        // address's malformed packet, say): the counter tells which.
        let stale_before = maybe_stale_to_vip(&case.frame).then(|| stale_count(fx));
        let (action, output) = fx.run(&case.frame, ifs.of(case.side));
        let mut result = check(&case.frame, action, &output);
        if let Some(before) = stale_before {
            result = judge_stale_to_vip(result, output == case.frame, stale_count(fx) - before);
        }
        if let (Some((client, svc)), Ok(Outcome::Forward { to, .. })) = (case.learn, &result) {
            generator.learn(client, svc, *to);
        }
        summary.record(&case, index, action, &output, result);
    };
    // Real flows first: one valid packet per service from CLIENT, so that
    // the first replies have flows to match.
    for (i, s) in SERVICES.iter().enumerate() {
        let client = (CLIENT, 40000 + i as u16);
        let flags = if s.proto == TCP { flag::SYN } else { 0 };
        let mut f = generator.l4_frame((GW_A_MAC, CLIENT_MAC), s.proto, client, (s.vip, s.port), flags);
        // Whatever TTL the generator chose: one that lets them be forwarded.
        f[ETH_LEN + 8] = 64;
        fix_ip_checksum(&mut f, ETH_LEN);
        let case = Case {
            kind: Kind::ToService,
            mutated: false,
            side: Side::A,
            base: f.clone(),
            frame: f,
            learn: Some((client, i)),
        };
        one(&fx, &mut summary, &mut generator, case, u64::MAX);
    }
    if let Some((side, frame)) = &opts.replay {
        let case = Case {
            kind: Kind::Replay,
            mutated: false,
            side: *side,
            frame: frame.clone(),
            base: frame.clone(),
            learn: None,
        };
        one(&fx, &mut summary, &mut generator, case, u64::MAX);
    } else {
        for index in 0..opts.count {
            // The flow table (1,024 entries) takes no new entry once full:
            // empty it now and then, so that runs see flows with entries,
            // flows without (a full table, the new-flow rate) and replies
            // of both.
            if index % SWEEP_EVERY == SWEEP_EVERY - 1 {
                let later = lb_userspace::dataplane::monotonic_coarse_secs() + 1_000_000;
                fx.dp.sweep(later, 1, 1).expect("sweep the flow table");
            }
            let case = generator.case(index);
            one(&fx, &mut summary, &mut generator, case, index);
        }
    }
    summary.elapsed = start.elapsed();
    summary.counters = fx.dp.counters().unwrap_or_default();
    for f in summary.findings.values_mut() {
        f.first.minimal = shrink(&fx, &ifs, &f.first);
    }
    summary
}

/// The datapath's `stale_backend` counter.
fn stale_count(fx: &Fixture) -> u64 {
    fx.dp.counter(lb_common::counter::STALE_BACKEND).expect("read the datapath's stale_backend counter")
}

/// A TCP/UDP packet from a backend endpoint to a VIP address on a port
/// (or protocol) no service has: the datapath finds no service, takes it
/// for a backend's and drops it as stale when the flow of its "client"
/// (the VIP address and port) names another backend.
fn maybe_stale_to_vip(f: &[u8]) -> bool {
    let (Some((_, dst)), Some((l4, _, _, proto))) = (ipv4_addrs(f), l4_layout(f, ETH_LEN)) else { return false };
    vlan_tags(f).is_none()
        && is_vip_addr(dst)
        && service_at(dst, u16_at(f, l4 + 2), proto).is_none()
        && from_backend_endpoint(f)
}

/// `check`'s verdict on a [`maybe_stale_to_vip`] packet, given how much
/// `stale_backend` moved on it: a drop it counted is a stale backend's; it
/// may count only such a packet's untouched drop, and once.
fn judge_stale_to_vip(result: Result<Outcome, Violation>, untouched: bool, counted: u64) -> Result<Outcome, Violation> {
    match (result, counted) {
        (r, 0) => r,
        (Ok(Outcome::Dropped), 1) if untouched => Ok(Outcome::DroppedStale),
        (Ok(o), n) => Err(violation(
            "stale_backend counted a packet it did not drop untouched, or more than once",
            format!("counted {n} for {o:?}"),
        )),
        (Err(v), _) => Err(v),
    }
}

/// Bring `e`'s input back towards the valid frame it was mutated from
/// while the same rule still breaks: first its length (cut, or the valid
/// frame's tail put back), then byte by byte; each step also tried with the
/// IPv4 header checksum made right again. None when no step was kept.
fn shrink(fx: &Fixture, ifs: &Ifs, e: &Example) -> Option<(Vec<u8>, u32, Vec<u8>, String)> {
    if e.base == e.input {
        return None;
    }
    let rule = check(&e.input, e.action, &e.output).err()?.rule;
    let ifindex = ifs.of(e.side);
    let base = &e.base;
    let mut cur = e.input.clone();
    let mut last = None;
    let mut try_step = |cur: &mut Vec<u8>, step: Vec<u8>| {
        let mut fixed = step.clone();
        let l3 = l3_offset(&fixed);
        fix_ip_checksum(&mut fixed, l3);
        for cand in [step, fixed] {
            let (action, output) = fx.run(&cand, ifindex);
            if let Err(v) = check(&cand, action, &output)
                && v.rule == rule
            {
                *cur = cand;
                last = Some((action, output, v.detail));
                return;
            }
        }
    };
    if cur.len() != base.len() {
        let step =
            if cur.len() > base.len() { cur[..base.len()].to_vec() } else { [&cur[..], &base[cur.len()..]].concat() };
        try_step(&mut cur, step);
    }
    if cur.len() == base.len() {
        for i in 0..cur.len() {
            if cur[i] != base[i] {
                let mut step = cur.clone();
                step[i] = base[i];
                try_step(&mut cur, step);
            }
        }
    }
    let (action, output, detail) = last?;
    Some((cur, action, output, detail))
}

#[cfg(test)]
mod tests {
    use lb_testkit::{Frame, L4Checksum};

    use super::*;

    fn syn() -> Frame {
        Frame { payload: b"hello".to_vec(), ..Frame::tcp(CLIENT, 40000, VIP, 80, flag::SYN) }.macs(GW_A_MAC, CLIENT_MAC)
    }

    /// The rewrite the datapath makes of `f` to BACKEND:8080, transmitted.
    fn forwarded(f: &Frame) -> Frame {
        Frame { dst: BACKEND, dport: 8080, ttl: f.ttl - 1, dmac: BACKEND_MAC, smac: GW_B_MAC, ..f.clone() }
    }

    /// Rule 2: a drop of a packet not to a VIP is a stale backend's only
    /// when it comes untouched from a backend endpoint.
    #[test]
    fn only_a_backend_endpoints_packet_may_be_dropped_when_not_to_a_vip() {
        let reply = Frame::tcp(BACKEND, 8080, CLIENT, 40000, flag::ACK).macs(GW_B_MAC, BACKEND_MAC).bytes();
        assert_eq!(check(&reply, XDP_DROP, &reply), Ok(Outcome::DroppedStale));
        let other_port = Frame::tcp(BACKEND, 7000, CLIENT, 40000, flag::ACK).macs(GW_B_MAC, BACKEND_MAC).bytes();
        assert!(check(&other_port, XDP_DROP, &other_port).is_err(), "not an endpoint");
        let mut changed = reply.clone();
        changed[ETH_LEN + 8] -= 1;
        assert!(check(&reply, XDP_DROP, &changed).is_err(), "changed");
    }

    /// Rule 2 for a backend endpoint's packet to a VIP address on no
    /// service's port: a stale drop exactly when the counter moved by one
    /// on an untouched drop.
    #[test]
    fn a_stale_drop_to_a_vip_address_is_told_by_the_counter() {
        let to_vip = Frame::tcp(BACKEND, 8080, VIP, 4444, flag::ACK).macs(GW_B_MAC, BACKEND_MAC).bytes();
        assert!(maybe_stale_to_vip(&to_vip));
        let to_service = Frame::tcp(BACKEND, 8080, VIP, 80, flag::ACK).macs(GW_B_MAC, BACKEND_MAC).bytes();
        assert!(!maybe_stale_to_vip(&to_service), "a service's VIP and port");
        let other_port = Frame::tcp(BACKEND, 7000, VIP, 4444, flag::ACK).macs(GW_B_MAC, BACKEND_MAC).bytes();
        assert!(!maybe_stale_to_vip(&other_port), "not an endpoint");
        let dropped = check(&to_vip, XDP_DROP, &to_vip);
        assert_eq!(dropped, Ok(Outcome::Dropped));
        assert_eq!(judge_stale_to_vip(dropped.clone(), true, 1), Ok(Outcome::DroppedStale));
        assert_eq!(judge_stale_to_vip(dropped.clone(), true, 0), Ok(Outcome::Dropped));
        assert!(judge_stale_to_vip(dropped.clone(), true, 2).is_err(), "counted twice");
        assert!(judge_stale_to_vip(dropped, false, 1).is_err(), "changed");
        assert!(judge_stale_to_vip(Ok(Outcome::Passed), true, 1).is_err(), "counted, not dropped");
    }

    #[test]
    fn correct_rewrites_pass_the_checker() {
        let f = syn();
        let out = forwarded(&f).bytes();
        assert_eq!(
            check(&f.bytes(), XDP_REDIRECT, &out),
            Ok(Outcome::Forward { to: (BACKEND, 8080), transmitted: true })
        );
        // The kernel path: TTL and MACs as they came.
        let out = Frame { dst: BACKEND_UNRESOLVED, dport: 8080, ..f.clone() }.bytes();
        assert!(matches!(check(&f.bytes(), XDP_PASS, &out), Ok(Outcome::Forward { transmitted: false, .. })));
        // Unfinished: finished when transmitted, kept unfinished otherwise.
        let p = Frame { l4_checksum: L4Checksum::Partial, ..f.clone() };
        let done = Frame { l4_checksum: L4Checksum::Full, ..forwarded(&p) };
        assert!(check(&p.bytes(), XDP_REDIRECT, &done.bytes()).is_ok());
        let kept = Frame { dst: BACKEND_UNRESOLVED, dport: 8080, ..p.clone() };
        assert!(check(&p.bytes(), XDP_PASS, &kept.bytes()).is_ok());
        // A reply of the shared endpoint: either service's VIP port.
        let r = Frame::tcp(BACKEND, 8080, CLIENT, 40000, flag::SYN | flag::ACK).macs(GW_B_MAC, BACKEND_MAC);
        for port in [80, 81] {
            let out = Frame { src: VIP, sport: port, ttl: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..r.clone() };
            assert_eq!(check(&r.bytes(), XDP_REDIRECT, &out.bytes()), Ok(Outcome::Reply { transmitted: true }));
        }
        // UDP without a checksum stays without.
        let u = Frame { l4_checksum: L4Checksum::None, ..Frame::udp(CLIENT, 5000, VIP, 53) };
        let out = Frame { dst: BACKEND, dport: 5353, ..u.clone() };
        assert!(check(&u.bytes(), XDP_PASS, &out.bytes()).is_ok());
        // Not ours, untouched.
        let other = Frame::tcp(CLIENT, 1, Ipv4Addr::new(10, 10, 0, 7), 80, flag::SYN).bytes();
        assert_eq!(check(&other, XDP_PASS, &other), Ok(Outcome::Passed));
    }

    #[test]
    fn wrong_rewrites_break_their_rule() {
        let f = syn();
        let input = f.bytes();
        let rule = |action, out: &[u8]| check(&input, action, out).unwrap_err().rule;
        let good = forwarded(&f);
        assert_eq!(
            rule(XDP_REDIRECT, &Frame { ttl: f.ttl, ..good.clone() }.bytes()),
            "transmit: TTL not decremented by one"
        );
        assert_eq!(
            rule(XDP_REDIRECT, &Frame { dmac: CLIENT_MAC, ..good.clone() }.bytes()),
            "transmit: MACs not the next hop's"
        );
        assert_eq!(rule(XDP_PASS, &good.bytes()), "rewrite: a byte outside the rewritten fields changed");
        assert_eq!(
            rule(XDP_REDIRECT, &Frame { dport: 8081, ..good.clone() }.bytes()),
            "forward: not to a backend of the service"
        );
        assert_eq!(
            rule(XDP_REDIRECT, &Frame { ident: 1, ..good.clone() }.bytes()),
            "rewrite: a byte outside the rewritten fields changed"
        );
        assert_eq!(rule(XDP_REDIRECT, &input), "rewrite: neither a forward nor a reply");
        let mut bad_ip = good.bytes();
        bad_ip[ETH_LEN + 10] ^= 1;
        assert_eq!(rule(XDP_REDIRECT, &bad_ip), "rewrite: IPv4 header checksum invalid");
        let mut bad_l4 = good.bytes();
        *bad_l4.last_mut().unwrap() ^= 1;
        // (the payload byte changed too: caught first as a changed byte)
        assert_eq!(rule(XDP_REDIRECT, &bad_l4), "rewrite: a byte outside the rewritten fields changed");
        let mut bad_csum = good.bytes();
        bad_csum[ETH_LEN + 20 + 16] ^= 1;
        assert_eq!(rule(XDP_REDIRECT, &bad_csum), "L4 checksum");
        // Unfinished, transmitted, not finished.
        let p = Frame { l4_checksum: L4Checksum::Partial, ..f.clone() };
        let unfinished = Frame { l4_checksum: L4Checksum::Partial, ..forwarded(&p) };
        assert_eq!(check(&p.bytes(), XDP_REDIRECT, &unfinished.bytes()).unwrap_err().rule, "L4 checksum");
        // Not ours: must pass untouched.
        let other = Frame::tcp(CLIENT, 1, Ipv4Addr::new(10, 10, 0, 7), 80, flag::SYN).bytes();
        assert_eq!(
            check(&other, XDP_DROP, &other).unwrap_err().rule,
            "not for a VIP nor from a backend, yet not passed"
        );
        assert_eq!(rule(XDP_ABORTED, &input), "action other than PASS, DROP, TX, REDIRECT");
    }

    #[test]
    fn a_wrong_checksum_must_stay_exactly_as_wrong() {
        let f = syn();
        let mut input = f.bytes();
        let c = ETH_LEN + 20 + 16;
        input[c] ^= 0x10;
        let mut out = forwarded(&f).bytes();
        out[c] ^= 0x10;
        assert!(check(&input, XDP_REDIRECT, &out).is_ok(), "the incremental update of a wrong checksum");
        // Recomputed from scratch (made valid): not what a rewrite does.
        assert_eq!(check(&input, XDP_REDIRECT, &forwarded(&f).bytes()).unwrap_err().rule, "L4 checksum");
    }

    #[test]
    fn generated_frames_are_valid_where_meant_to_be() {
        let mut g = Gen::new(7);
        for i in 0..2000 {
            g.rng = Rng::with_seed(i);
            let (f, _) = g.client_packet(true);
            let s = SlicedPacket::from_ethernet(&f).expect("parses");
            let Some(NetSlice::Ipv4(ip)) = &s.net else { panic!("IPv4") };
            assert_eq!(folded(Sum16BitWords::new().add_slice(ip.header().slice())), 0xffff);
            assert!(f.len() <= MAX_FRAME);
            assert!(matches!(s.transport, Some(TransportSlice::Tcp(_) | TransportSlice::Udp(_))));
        }
        for i in 0..20_000 {
            let c = g.case(i);
            assert!((ETH_LEN..=MAX_FRAME).contains(&c.frame.len()), "{} bytes", c.frame.len());
        }
    }
}

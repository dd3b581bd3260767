//! Packet fixtures (BPF_PROG_TEST_RUN, as `datapath.rs`) for packets too
//! big for their egress: a redirected frame above the egress MTU is
//! dropped silently by the kernel, so the datapath must never send one,
//! and the sender must learn the path MTU from an ICMP error that names
//! what it sent.
//!
//! The fixture's backend side (`gwb`) gets an MTU of 1,280; the client
//! side keeps 1,500. ICMP errors are read back and their checksums
//! verified by etherparse (`lb_testkit::frame6`), not by code of ours.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{Ipv4Addr, Ipv6Addr};

use lb_common::{NETDEV_F_GENERIC, NETDEV_MTU_SHIFT, TC_HANDOFF_MAGIC};
use lb_testkit::{
    Frame, Frame6, L4Checksum,
    frame::{
        ETH_LEN, IPV4_LEN, TCP_LEN,
        tcp::{ACK, SYN},
    },
    frame6::{IPV6_LEN, parse_frag_needed, parse_too_big6},
};
use lb_tests::fixture::*;
use lb_userspace::config::Protocol;

const SMALL_MTU: u32 = 1280;

/// A fixture whose backend-side device has the small MTU, described to
/// the datapath with its MTU as lbd describes it.
fn small_backend_mtu() -> Fixture {
    sh(&["ip", "link", "set", "dev", "gwb", "mtu", &SMALL_MTU.to_string()]);
    let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
    mtus(&mut fx, 1500, SMALL_MTU);
    fx
}

fn mtus(fx: &mut Fixture, a: u32, b: u32) {
    fx.netdevs(a << NETDEV_MTU_SHIFT, XMIT_ALL, b << NETDEV_MTU_SHIFT, XMIT_ALL);
}

/// A client -> VIP segment whose IP packet is `ip_len` bytes long.
fn big(sport: u16, flags: u8, ip_len: usize, df: bool) -> Frame {
    let mut f = tcp(CLIENT, sport, VIP, 80, flags);
    f.payload = vec![0x5a; ip_len - IPV4_LEN - TCP_LEN];
    f.dont_fragment = df;
    f
}

/// The ICMP "fragmentation needed" the datapath answers `sent` with: from
/// the VIP to the client, quoting the packet as the client sent it.
fn assert_frag_needed(out: &[u8], sent: &Frame, action: u32) {
    let icmp = parse_frag_needed(out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
    assert_eq!((icmp.src, icmp.dst), (VIP, CLIENT), "from the address the client sent to, back to the client");
    assert_eq!(u32::from(icmp.mtu), SMALL_MTU);
    let bytes = sent.bytes();
    assert_eq!(icmp.quoted, bytes[ETH_LEN..ETH_LEN + IPV4_LEN + 8], "quotes the IP header and 8 bytes as sent");
    // To the kernel, which routes it to the client: the frame as it came.
    assert_eq!(action, XDP_PASS);
    assert_eq!((icmp.dmac, icmp.smac), (GW_A_MAC, CLIENT_MAC));
}

#[test]
fn a_forward_packet_too_big_for_the_backend_side_is_answered_with_fragmentation_needed() {
    in_netns(|| {
        let fx = small_backend_mtu();
        let syn = tcp(CLIENT, 42000, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT, "a small packet goes through");
        // The egress is narrower than the ingress, so its hop is never
        // cached: the FIB compares every packet with the route's MTU.
        let p = big(42000, ACK, 1400, true);
        let (action, out) = fx.run(&p.bytes(), fx.if_a);
        assert_frag_needed(&out, &p, action);
        assert_eq!(fx.counter("too_big"), 1);
        // Exactly the MTU fits.
        let fits = big(42000, ACK, SMALL_MTU as usize, true);
        let (action, out) = fx.run(&fits.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(dst_of(&out), BACKEND);
        assert_eq!(fx.counter("too_big"), 1);
    });
}

#[test]
fn the_first_packet_of_a_flow_too_big_is_caught_by_the_fib() {
    in_netns(|| {
        let fx = small_backend_mtu();
        // The first packet of the flow, already too big.
        let p = big(42001, SYN, 1400, true);
        let (action, out) = fx.run(&p.bytes(), fx.if_a);
        assert_frag_needed(&out, &p, action);
        assert_eq!(fx.counter("too_big"), 1);
        assert_eq!(fx.counter("xdp_redirect"), 0);
    });
}

#[test]
fn a_packet_too_big_without_df_goes_to_the_kernel_rewritten_to_be_fragmented() {
    in_netns(|| {
        let fx = small_backend_mtu();
        let syn = tcp(CLIENT, 42002, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let p = big(42002, ACK, 1400, false);
        let (action, out) = fx.run(&p.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Frame { dst: BACKEND, dport: 8080, ..p }.bytes(), "rewritten, TTL and MACs as they came");
        assert_eq!(fx.counter("too_big"), 1);
    });
}

#[test]
fn a_reply_too_big_for_the_client_side_goes_back_to_the_kernel_as_it_came() {
    in_netns(|| {
        sh(&["ip", "link", "set", "dev", "gwa", "mtu", &SMALL_MTU.to_string()]);
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        mtus(&mut fx, SMALL_MTU, 1500);
        let syn = tcp(CLIENT, 42003, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let mut reply = Frame::tcp(BACKEND, 8080, CLIENT, 42003, ACK).macs(GW_B_MAC, BACKEND_MAC);
        reply.payload = vec![0xa5; 1400 - IPV4_LEN - TCP_LEN];
        let (action, out) = fx.run(&reply.bytes(), fx.if_b);
        // Untouched: the kernel's own "fragmentation needed" then quotes
        // the header the backend sent, and reaches the backend.
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, reply.bytes());
        assert_eq!(fx.counter("too_big"), 1);
    });
}

// ---------------------------------------------------------------- GSO

/// A packet of two full segments' length: in generic mode, what the
/// kernel's GRO makes of two segments (or a local sender behind a veth
/// hands over unsegmented), its TCP checksum unfinished, longer than the
/// ingress device's 1,500-byte MTU.
const GSO_LEN: usize = 2 * 1500 - 40;

/// A GSO packet ([`GSO_LEN`]) of either direction, as it reaches the
/// gateway's device on its side.
fn gso4(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, from_client: bool) -> Frame {
    let macs = if from_client { (GW_A_MAC, CLIENT_MAC) } else { (GW_B_MAC, BACKEND_MAC) };
    let mut f = Frame::tcp(src, sport, dst, dport, ACK).macs(macs.0, macs.1);
    f.payload = vec![0x5a; GSO_LEN - IPV4_LEN - TCP_LEN];
    f.l4_checksum = L4Checksum::Partial;
    f
}

/// [`gso4`] in IPv6.
fn gso6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, from_client: bool) -> Frame6 {
    let macs = if from_client { (GW_A_MAC, CLIENT_MAC) } else { (GW_B_MAC, BACKEND_MAC) };
    let mut f = Frame6::tcp(src, sport, dst, dport, ACK).macs(macs.0, macs.1);
    f.payload = vec![0x5a; GSO_LEN - IPV6_LEN - TCP_LEN];
    f.l4_checksum = L4Checksum::Partial;
    f
}

/// A GSO packet cannot leave by XDP redirect: the kernel drops a
/// redirected frame above the egress MTU (EMSGSIZE), and a bulk transfer
/// through a generic-mode gateway stalled on it. It goes to the kernel's
/// forwarding path rewritten, its checksum left unfinished for the new
/// addresses, TTL and MACs as they came: the kernel splits it into
/// segments that fit. So it does on a flow whose hop is cached, in both
/// directions, while the full-sized segments around it go by redirect.
#[test]
fn a_gso_packet_goes_to_the_kernel_rewritten_in_both_directions() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        mtus(&mut fx, 1500, 1500);
        let syn = tcp(CLIENT, 42010, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let full = big(42010, ACK, 1500, true);
        let (action, out) = fx.run(&full.bytes(), fx.if_a);
        assert_eq!((action, dst_of(&out)), (XDP_REDIRECT, BACKEND), "a full frame goes by its cached hop");
        let redirected = fx.counter("xdp_redirect");

        let gso = gso4(CLIENT, 42010, VIP, 80, true);
        let (action, out) = fx.run(&gso.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Frame { dst: BACKEND, dport: 8080, ..gso.clone() }.bytes());
        assert_eq!(fx.counter("kernel_egress"), 1);

        let reply = gso4(BACKEND, 8080, CLIENT, 42010, false);
        let (action, out) = fx.run(&reply.bytes(), fx.if_b);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Frame { src: VIP, sport: 80, ..reply.clone() }.bytes());
        assert_eq!(fx.counter("kernel_egress"), 2);
        assert_eq!((fx.counter("xdp_redirect"), fx.counter("too_big")), (redirected, 0));

        // The same in IPv6.
        let mut fx = Fixture::new(vec![service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)])]);
        mtus(&mut fx, 1500, 1500);
        let syn6 = Frame6::tcp(CLIENT6, 42011, VIP6, 80, SYN).macs(GW_A_MAC, CLIENT_MAC);
        assert_eq!(fx.run(&syn6.bytes(), fx.if_a).0, XDP_REDIRECT);
        let up6 = gso6(CLIENT6, 42011, VIP6, 80, true);
        let (action, out) = fx.run(&up6.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Frame6 { dst: BACKEND6, dport: 8080, ..up6.clone() }.bytes());
        let reply6 = gso6(BACKEND6, 8080, CLIENT6, 42011, false);
        let (action, out) = fx.run(&reply6.bytes(), fx.if_b);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Frame6 { src: VIP6, sport: 80, ..reply6.clone() }.bytes());
        assert_eq!((fx.counter("kernel_egress"), fx.counter("too_big")), (2, 0));
    });
}

/// A GSO packet of a DSR service can leave neither by XDP redirect
/// (dropped above the egress MTU) nor by the kernel's forwarding (it is
/// addressed to the VIP). It is handed to lbd's tc program: its MACs set
/// for the backend, everything else as it came (its checksum unfinished),
/// the egress and the mark in its metadata (`TcHandoff`), counted in
/// `kernel_egress`. So it is on a flow whose hop is cached, and when the
/// cached hop has expired and the FIB is asked (by the length of the
/// packet's segments, which fit), in both families; the full frames
/// around it go by redirect. Towards a narrower egress, its segments do
/// not fit: answered as too big.
#[test]
fn a_dsr_gso_packet_is_handed_to_the_tc_program_with_its_egress() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            dsr(service("web", 80, Protocol::Tcp, &[(BACKEND, 80)])),
            dsr(service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 80)])),
        ]);
        let mtu = 1500 << NETDEV_MTU_SHIFT;
        fx.netdevs(NETDEV_F_GENERIC | mtu, XMIT_ALL, NETDEV_F_GENERIC | mtu, XMIT_ALL);
        let handoff: Vec<u8> = [TC_HANDOFF_MAGIC, fx.if_b].iter().flat_map(|w| w.to_ne_bytes()).collect();
        let syn = tcp(CLIENT, 42020, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let syn6 = Frame6::tcp(CLIENT6, 42021, VIP6, 80, SYN).macs(GW_A_MAC, CLIENT_MAC);
        assert_eq!(fx.run(&syn6.bytes(), fx.if_a).0, XDP_REDIRECT);
        let gso = gso4(CLIENT, 42020, VIP, 80, true);
        let gso6 = gso6(CLIENT6, 42021, VIP6, 80, true);
        let mut handed = 0;
        for when in ["cached hop", "hop expired"] {
            let full = Frame { dport: 80, ..big(42020, ACK, 1500, true) };
            let (action, out) = fx.run(&full.bytes(), fx.if_a);
            assert_eq!((action, out), (XDP_REDIRECT, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..full }.bytes()));
            let redirected = fx.counter("xdp_redirect");

            let (action, out) = fx.run(&gso.bytes(), fx.if_a);
            assert_eq!(action, XDP_PASS, "{when}");
            assert_eq!(out.len(), handoff.len() + gso.bytes().len(), "{when}: metadata in front of the frame");
            let (meta, frame) = out.split_at(handoff.len());
            assert_eq!(meta, handoff, "{when}: the mark and the egress");
            assert_eq!(frame, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..gso.clone() }.bytes(), "{when}");

            let (action, out) = fx.run(&gso6.bytes(), fx.if_a);
            assert_eq!(action, XDP_PASS, "{when}");
            let (meta, frame) = out.split_at(handoff.len());
            assert_eq!(meta, handoff, "{when}: the mark and the egress (IPv6)");
            assert_eq!(frame, Frame6 { dmac: BACKEND_MAC, smac: GW_B_MAC, ..gso6.clone() }.bytes(), "{when}");
            handed += 2;
            assert_eq!(fx.counter("kernel_egress"), handed, "{when}");
            assert_eq!((fx.counter("xdp_redirect"), fx.counter("too_big")), (redirected, 0), "{when}");
            // The next round after the cached hops' lifetime (1 s).
            std::thread::sleep(std::time::Duration::from_millis(2100));
        }

        // Towards a narrower egress: too big, as any packet.
        sh(&["ip", "link", "set", "dev", "gwb", "mtu", &SMALL_MTU.to_string()]);
        fx.netdevs(NETDEV_F_GENERIC | mtu, XMIT_ALL, NETDEV_F_GENERIC | SMALL_MTU << NETDEV_MTU_SHIFT, XMIT_ALL);
        let (action, out) = fx.run(&gso.bytes(), fx.if_a);
        assert_frag_needed(&out, &gso, action);
        assert_eq!((fx.counter("too_big"), fx.counter("kernel_egress")), (1, handed));
    });
}

/// A GSO packet towards an egress narrower than its ingress is too big
/// as any packet is: its segments, as long as the ingress MTU allows, do
/// not fit either, and the client hears "fragmentation needed" / "packet
/// too big" from the VIP, as for a single segment.
#[test]
fn a_gso_packet_too_big_for_a_narrower_egress_is_answered_as_any_packet() {
    in_netns(|| {
        let fx = small_backend_mtu();
        let syn = tcp(CLIENT, 42012, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let gso = gso4(CLIENT, 42012, VIP, 80, true);
        let (action, out) = fx.run(&gso.bytes(), fx.if_a);
        assert_frag_needed(&out, &gso, action);
        assert_eq!((fx.counter("too_big"), fx.counter("kernel_egress")), (1, 0));

        let mut fx = Fixture::new(vec![service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)])]);
        mtus(&mut fx, 1500, SMALL_MTU);
        let up6 = gso6(CLIENT6, 42013, VIP6, 80, true);
        let syn6 = Frame6 { tcp_flags: SYN, payload: Vec::new(), l4_checksum: L4Checksum::Full, ..up6.clone() };
        assert_eq!(fx.run(&syn6.bytes(), fx.if_a).0, XDP_REDIRECT);
        let (action, out) = fx.run(&up6.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS, "to the kernel, which routes the error to the client");
        let icmp = parse_too_big6(&out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
        assert_eq!((icmp.src, icmp.dst, icmp.mtu), (VIP6, CLIENT6, SMALL_MTU));
        assert_eq!((fx.counter("too_big"), fx.counter("kernel_egress")), (1, 0));
    });
}

/// A route narrower than its device (a locked route MTU of 1,280 on the
/// 1,500-byte backend side, both devices described at 1,500): every
/// packet of a flow that takes it is asked of the FIB, which compares it
/// with the route's MTU, so one that fits leaves by redirect (with the
/// FIB's MACs) and a longer one later in the same flow is answered as too
/// big, from the VIP. Were the flow's hop cached after its first packet,
/// as a hop through a route as wide as the ingress is, the longer packet
/// would leave by it, for the narrower link past it to drop.
#[test]
fn a_route_narrower_than_its_device_is_asked_for_every_packet() {
    in_netns(|| {
        let mtu = SMALL_MTU.to_string();
        sh(&["ip", "route", "add", &format!("{BACKEND}/32"), "dev", "gwb", "mtu", "lock", &mtu]);
        sh(&["ip", "-6", "route", "add", &format!("{BACKEND6}/128"), "dev", "gwb", "mtu", "lock", &mtu]);
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        mtus(&mut fx, 1500, 1500);
        let syn = tcp(CLIENT, 42030, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT, "a small packet goes through");
        for round in 0..2 {
            let fits = big(42030, ACK, SMALL_MTU as usize, true);
            let (action, out) = fx.run(&fits.bytes(), fx.if_a);
            assert_eq!(action, XDP_REDIRECT, "round {round}: what fits the route leaves by redirect");
            assert_eq!(dst_of(&out), BACKEND);
            assert_eq!(out[..12], [BACKEND_MAC, GW_B_MAC].concat(), "round {round}: the FIB's MACs");
            let p = big(42030, ACK, 1400, true);
            let (action, out) = fx.run(&p.bytes(), fx.if_a);
            assert_frag_needed(&out, &p, action);
            assert_eq!(fx.counter("too_big"), round + 1);
        }

        let mut fx = Fixture::new(vec![service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)])]);
        mtus(&mut fx, 1500, 1500);
        let syn6 = Frame6::tcp(CLIENT6, 42031, VIP6, 80, SYN).macs(GW_A_MAC, CLIENT_MAC);
        assert_eq!(fx.run(&syn6.bytes(), fx.if_a).0, XDP_REDIRECT);
        let sized = |len: usize| {
            let mut f = Frame6::tcp(CLIENT6, 42031, VIP6, 80, ACK).macs(GW_A_MAC, CLIENT_MAC);
            f.payload = vec![0x5a; len - IPV6_LEN - TCP_LEN];
            f
        };
        for round in 0..2 {
            let fits = sized(SMALL_MTU as usize);
            let (action, out) = fx.run(&fits.bytes(), fx.if_a);
            assert_eq!(action, XDP_REDIRECT, "round {round}: what fits the route leaves by redirect");
            let want = Frame6 { dmac: BACKEND_MAC, smac: GW_B_MAC, dst: BACKEND6, dport: 8080, hop_limit: 63, ..fits };
            assert_eq!(out, want.bytes(), "round {round}: rewritten, with the FIB's MACs");
            let (action, out) = fx.run(&sized(1400).bytes(), fx.if_a);
            assert_eq!(action, XDP_PASS, "to the kernel, which routes the error to the client");
            let icmp = parse_too_big6(&out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
            assert_eq!((icmp.src, icmp.dst, icmp.mtu), (VIP6, CLIENT6, SMALL_MTU));
            assert_eq!(fx.counter("too_big"), round + 1);
        }
    });
}

//! Packet fixtures (BPF_PROG_TEST_RUN, as `datapath.rs`) for IPv6, L2
//! direct server return and ICMP errors about balanced flows. Frames are
//! built and read back by `lb-testkit` (etherparse): every checksum in an
//! expected frame is computed by etherparse, never by our code, so a
//! byte-for-byte match checks the datapath's incremental updates.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::{Icmpv4Type, Icmpv6Type, Ipv4Header, PacketBuilder, icmpv4::DestUnreachableHeader};
use lb_common::{NETDEV_F_GENERIC, NETDEV_F_TX, NETDEV_F_XMIT_GENERIC, NETDEV_MTU_SHIFT};
use lb_testkit::{
    Frame, Frame6, L4Checksum,
    frame::{
        ETH_LEN, IPV4_LEN, TCP_LEN,
        tcp::{ACK, FIN, PSH, RST, SYN},
    },
    frame6::{Ext, IPV6_LEN, parse_frag_needed, parse_too_big6},
};
use lb_tests::fixture::*;
use lb_userspace::{
    config::{Protocol, ServiceConfig},
    dataplane::BackendRuntime,
    sched::Scheduler,
};

fn tcp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Frame6 {
    Frame6::tcp(src, sport, dst, dport, flags).macs(GW_A_MAC, CLIENT_MAC)
}

/// The client's packet as the datapath sends it on to the backend.
fn to_backend6(p: &Frame6) -> Frame6 {
    Frame6 { dst: BACKEND6, dport: 8080, hop_limit: p.hop_limit - 1, dmac: BACKEND_MAC, smac: GW_B_MAC, ..p.clone() }
}

fn web6() -> Fixture {
    Fixture::new(vec![service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)])])
}

fn assert_valid6(out: &[u8]) -> Frame6 {
    let f = Frame6::parse(out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
    assert_eq!(f.l4_checksum, L4Checksum::Full, "L4 checksum not finished");
    f
}

// ---------------------------------------------------------------- IPv6 NAT

/// `conntrack_max_ipv6` sizes the IPv6 flow table on its own (an IPv4-only
/// gateway need not allocate IPv6 room for `conntrack_max` flows): it
/// holds that many flows, the next ones go by hash without an entry
/// (`table_full`), and the IPv4 table keeps its own, larger limit.
#[test]
fn the_ipv6_flow_table_holds_conntrack_max_ipv6_flows_and_ipv4_keeps_its_own_limit() {
    in_netns(|| {
        let mut fx = Fixture::with_config(
            vec![
                service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
                service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            ],
            |c| {
                c.conntrack_max = 64;
                c.conntrack_max_ipv6 = 16;
                c.flood.new_flow_rate_per_cpu = Some(0);
            },
        );
        for port in 0..40 {
            assert_eq!(fx.run(&tcp6(CLIENT6, 41_000 + port, VIP6, 80, SYN).bytes(), fx.if_a).0, XDP_REDIRECT);
        }
        assert_eq!(fx.dp.flow_counts().unwrap(), (0, 16), "(IPv4, IPv6) entries");
        assert_eq!(fx.counter("table_full"), 24);
        assert_eq!(fx.new_flows("web6", BACKEND6), 40, "every SYN is a new connection, with an entry or not");
        for port in 0..40 {
            assert_eq!(fx.run(&tcp(CLIENT, 41_000 + port, VIP, 80, SYN).bytes(), fx.if_a).0, XDP_REDIRECT);
        }
        assert_eq!(fx.dp.flow_counts().unwrap(), (40, 16));
        assert_eq!(fx.counter("table_full"), 24, "the IPv4 table had room for all 40");
        assert_eq!(fx.entries(), 56);
        assert_eq!(fx.dp.flow_capacities(), (64, 16), "(IPv4, IPv6) capacities, as the status reports them");
    });
}

/// As for IPv4 (`datapath.rs`): a reply entry whose forward entry found
/// no room is taken back, its room with it.
#[test]
fn an_ipv6_reply_entry_whose_flow_found_no_room_is_taken_back() {
    in_netns(|| {
        let mut fx = Fixture::with_config(
            vec![
                service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
                service6("alt6", 81, Protocol::Tcp, &[(BACKEND6, 8080)]),
            ],
            |c| {
                c.conntrack_max_ipv6 = 3;
                c.flood.new_flow_rate_per_cpu = Some(0);
            },
        );
        for cport in [41000, 41001] {
            assert_eq!(fx.run(&tcp6(CLIENT6, cport, VIP6, 80, SYN).bytes(), fx.if_a).0, XDP_REDIRECT);
        }
        assert_eq!(fx.dp.flow_counts().unwrap(), (0, 2));
        assert_eq!(fx.run(&tcp6(CLIENT6, 41002, VIP6, 81, SYN).bytes(), fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("flow_table"), 1);
        assert_eq!(fx.dp.flow_counts().unwrap(), (0, 2), "the reply entry was left in the table");
        assert_eq!(fx.entries(), 2);
        assert_eq!(fx.run(&tcp6(CLIENT6, 41003, VIP6, 80, SYN).bytes(), fx.if_a).0, XDP_REDIRECT);
        assert_eq!(fx.dp.flow_counts().unwrap(), (0, 3));
        assert_eq!(fx.counter("table_full"), 0);
    });
}

#[test]
fn ipv6_tcp_is_rewritten_both_ways_byte_for_byte() {
    in_netns(|| {
        let mut fx = web6();
        let syn = tcp6(CLIENT6, 40000, VIP6, 80, SYN);
        let (action, out) = fx.run(&syn.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, to_backend6(&syn).bytes(), "the forward rewrite differs from etherparse's frame");
        assert_valid6(&out);
        assert_eq!(fx.new_flows("web6", BACKEND6), 1);
        // The backend's answer goes back as from the VIP.
        let synack = Frame6::tcp(BACKEND6, 8080, CLIENT6, 40000, SYN | ACK).macs(GW_B_MAC, BACKEND_MAC);
        let (action, out) = fx.run(&synack.bytes(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        let back = Frame6 { src: VIP6, sport: 80, hop_limit: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..synack };
        assert_eq!(out, back.bytes(), "the reply rewrite differs from etherparse's frame");
        // The rest of the flow: same backend, no new schedule.
        let ack = Frame6 { tcp_flags: ACK, ..syn };
        let (action, out) = fx.run(&ack.bytes(), fx.if_a);
        assert_eq!((action, out), (XDP_REDIRECT, to_backend6(&ack).bytes()));
        assert_eq!(fx.new_flows("web6", BACKEND6), 1);
        assert_eq!(fx.counter("xdp_redirect"), 3);
        assert_eq!(fx.entries(), 1, "one flow-table entry");
    });
}

#[test]
fn ipv6_udp_is_rewritten_with_its_checksum_and_an_ipv4_service_works_beside_it() {
    in_netns(|| {
        let fx = Fixture::new(vec![
            service6("dns6", 53, Protocol::Udp, &[(BACKEND6, 5353)]),
            service("dns4", 53, Protocol::Udp, &[(BACKEND, 5353)]),
        ]);
        let q = Frame6::udp(CLIENT6, 40001, VIP6, 53).macs(GW_A_MAC, CLIENT_MAC);
        let (action, out) = fx.run(&q.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let want = Frame6 { dst: BACKEND6, dport: 5353, hop_limit: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..q.clone() };
        assert_eq!(out, want.bytes());
        let a = Frame6::udp(BACKEND6, 5353, CLIENT6, 40001).macs(GW_B_MAC, BACKEND_MAC);
        let (action, out) = fx.run(&a.bytes(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Frame6 { src: VIP6, sport: 53, hop_limit: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..a }.bytes());
        let q4 = udp(CLIENT, 40001, VIP, 53);
        assert_eq!(fx.forward(&q4.bytes()), BACKEND);
        assert_eq!(fx.new_flows("dns6", BACKEND6), 1);
        assert_eq!(fx.new_flows("dns4", BACKEND), 1);
    });
}

/// `p` with its last two payload bytes chosen so that its finished L4
/// checksum equals the pseudo-header sum, which is what an unfinished one
/// holds: one packet in 65,536 does so by chance.
fn colliding6(mut p: Frame6) -> Frame6 {
    let seed = p.l4_seed();
    let n = p.payload.len();
    let found = (0..=u16::MAX).find(|&w| {
        p.payload[n - 2..].copy_from_slice(&w.to_be_bytes());
        p.full_l4_checksum() == seed
    });
    assert!(found.is_some(), "no payload word gives the colliding checksum");
    // etherparse takes it for finished too (it checks the full sum first).
    assert_eq!(Frame6::parse(&p.bytes()).unwrap().l4_checksum, L4Checksum::Full);
    p
}

#[test]
fn a_finished_ipv6_checksum_that_looks_unfinished_is_left_finished() {
    in_netns(|| {
        let fx = Fixture::new(vec![
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
            service6("dns6", 53, Protocol::Udp, &[(BACKEND6, 5353)]),
        ]);
        for (i, udp) in [false, true].into_iter().enumerate() {
            let cport = 41000 + i as u16;
            let (vport, bport) = if udp { (53, 5353) } else { (80, 8080) };
            let base = if udp {
                Frame6::udp(CLIENT6, cport, VIP6, vport).macs(GW_A_MAC, CLIENT_MAC)
            } else {
                tcp6(CLIENT6, cport, VIP6, vport, SYN)
            };
            // Client -> backend: rewritten by native redirect, its
            // checksum updated as a finished one.
            let q = colliding6(Frame6 { payload: vec![0x5a; 64], ..base });
            let (action, out) = fx.run(&q.bytes(), fx.if_a);
            let want = Frame6 { dst: BACKEND6, dport: bport, hop_limit: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..q };
            assert_eq!((action, out), (XDP_REDIRECT, want.bytes()), "forward, udp {udp}");
            // Backend -> client, the same way back.
            let a = if udp {
                Frame6::udp(BACKEND6, bport, CLIENT6, cport)
            } else {
                Frame6::tcp(BACKEND6, bport, CLIENT6, cport, SYN | ACK)
            };
            let a = colliding6(Frame6 { payload: vec![0xa5; 64], ..a.macs(GW_B_MAC, BACKEND_MAC) });
            let (action, out) = fx.run(&a.bytes(), fx.if_b);
            let want = Frame6 { src: VIP6, sport: vport, hop_limit: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..a };
            assert_eq!((action, out), (XDP_REDIRECT, want.bytes()), "reply, udp {udp}");
        }
        assert_eq!(fx.counter("csum_partial"), 0);
        assert_eq!(fx.counter("kernel_egress"), 0);
    });
}

#[test]
fn an_unfinished_ipv6_checksum_is_finished_for_a_native_redirect_and_kept_otherwise() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
            service6("dns6", 53, Protocol::Udp, &[(BACKEND6, 5353)]),
            dsr(service6("dweb6", 81, Protocol::Tcp, &[(BACKEND6, 81)])),
            dsr(service6("ddns6", 54, Protocol::Udp, &[(BACKEND6, 54)])),
        ]);
        let mut port = 42000u16;
        let mut partial = 0;
        for (i, n) in [0usize, 1, 513, 1400].into_iter().enumerate() {
            let payload: Vec<u8> = (0..n).map(|b| (b * 7 + i) as u8).collect();
            for (udp, dsr) in [(false, false), (true, false), (false, true), (true, true)] {
                port += 1;
                let (vport, bport) = match (udp, dsr) {
                    (false, false) => (80, 8080),
                    (true, false) => (53, 5353),
                    (false, true) => (81, 81),
                    (true, true) => (54, 54),
                };
                let base = if udp {
                    Frame6::udp(CLIENT6, port, VIP6, vport).macs(GW_A_MAC, CLIENT_MAC)
                } else {
                    tcp6(CLIENT6, port, VIP6, vport, SYN)
                };
                let p = Frame6 { payload: payload.clone(), l4_checksum: L4Checksum::Partial, ..base };
                let what = format!("udp {udp}, dsr {dsr}, payload {n}");
                // What leaves: NAT rewrites the destination and decrements
                // the hop limit; DSR changes the MACs only.
                let out_of = |f: &Frame6, l4_checksum| {
                    let f = Frame6 { dmac: BACKEND_MAC, smac: GW_B_MAC, l4_checksum, ..f.clone() };
                    if dsr { f } else { Frame6 { dst: BACKEND6, dport: bport, hop_limit: f.hop_limit - 1, ..f } }
                };

                // Native ingress: an XDP frame carries no "finish me" mark,
                // so the checksum is finished here.
                fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&p.bytes(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "{what}");
                assert_eq!(out, out_of(&p, L4Checksum::Full).bytes(), "{what}: not finished correctly");
                assert_valid6(&out);
                partial += 1;

                // Generic ingress: the skb keeps its mark, the checksum
                // stays unfinished (for the new addresses).
                let next = Frame6 { sport: p.sport + 10_000, ..p.clone() };
                fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&next.bytes(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "{what}");
                assert_eq!(out, out_of(&next, L4Checksum::Partial).bytes(), "{what}: not kept unfinished");
                if !dsr {
                    // DSR does not look at the checksum in generic mode.
                    partial += 1;
                }
            }
        }
        assert_eq!(fx.counter("csum_partial"), partial);
        assert_eq!(fx.counter("kernel_egress"), 0);
    });
}

#[test]
fn ipv6_extension_headers_are_walked_and_kept() {
    in_netns(|| {
        let fx = web6();
        let mut syn = tcp6(CLIENT6, 40002, VIP6, 80, SYN);
        syn.ext = vec![Ext::padded(0, 0), Ext::padded(43, 1), Ext::padded(60, 2)];
        let (action, out) = fx.run(&syn.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, to_backend6(&syn).bytes());
        assert_eq!(fx.new_flows("web6", BACKEND6), 1);
    });
}

#[test]
fn ipv6_fragments_and_unwalked_extension_headers_to_a_vip_are_dropped_and_counted() {
    in_netns(|| {
        let fx = web6();
        let mut frag = tcp6(CLIENT6, 40003, VIP6, 80, SYN);
        frag.ext = vec![Ext { kind: 44, body: vec![0, 0, 0, 0, 0, 1] }];
        assert_eq!(fx.run(&frag.bytes(), fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("fragment"), 1);
        // Authentication header, and five walkable headers (one too many).
        let mut ah = tcp6(CLIENT6, 40004, VIP6, 80, SYN);
        ah.ext = vec![Ext::padded(51, 1)];
        assert_eq!(fx.run(&ah.bytes(), fx.if_a).0, XDP_DROP);
        let mut many = tcp6(CLIENT6, 40005, VIP6, 80, SYN);
        many.ext = vec![Ext::padded(60, 0); 5];
        assert_eq!(fx.run(&many.bytes(), fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("ipv6_ext"), 2);
        // Not to a VIP: the kernel's.
        let mut other = tcp6(CLIENT6, 40006, BACKEND6_UNRESOLVED, 80, SYN);
        other.ext = vec![Ext::padded(51, 1)];
        assert_eq!(fx.run(&other.bytes(), fx.if_a).0, XDP_PASS);
        assert_eq!(fx.new_flows("web6", BACKEND6), 0);
    });
}

#[test]
fn broken_ipv6_packets_are_never_forwarded() {
    in_netns(|| {
        let fx = web6();
        let mut syn = tcp6(CLIENT6, 40007, VIP6, 80, SYN);
        syn.ext = vec![Ext::padded(0, 0)];
        let whole = syn.bytes();
        // Cut at every length: inside Ethernet, the IPv6 header, the
        // extension header, the TCP header, the payload.
        for len in 0..whole.len() {
            let (action, _) = fx.run(&whole[..len.max(14)], fx.if_a);
            assert_ne!(action, XDP_REDIRECT, "a frame cut at {len} bytes was forwarded");
        }
        // Truncated past the IPv6 header: the datapath knew it was for a
        // VIP, and counted the drops.
        assert!(fx.counter("malformed") > 0);
        // A payload length beyond the frame, a zero payload length, a UDP
        // checksum of 0 (which IPv6 forbids).
        let mut long = whole.clone();
        long[ETH_LEN + 4..ETH_LEN + 6].copy_from_slice(&2000u16.to_be_bytes());
        let mut zero = whole.clone();
        zero[ETH_LEN + 4..ETH_LEN + 6].copy_from_slice(&0u16.to_be_bytes());
        let mut q = Frame6::udp(CLIENT6, 40008, VIP6, 80).macs(GW_A_MAC, CLIENT_MAC);
        q.l4_checksum = L4Checksum::None;
        let before = fx.counter("malformed");
        for f in [long, zero, q.bytes()] {
            assert_eq!(fx.run(&f, fx.if_a).0, XDP_DROP);
        }
        assert_eq!(fx.counter("malformed"), before + 3);
        assert_eq!(fx.new_flows("web6", BACKEND6), 0);
        assert_eq!(fx.counter("xdp_redirect"), 0);
    });
}

#[test]
fn an_ipv6_packet_too_big_for_the_backend_side_is_answered_with_packet_too_big() {
    in_netns(|| {
        sh(&["ip", "link", "set", "dev", "gwb", "mtu", "1280"]);
        let mut fx = web6();
        fx.netdevs(1500 << NETDEV_MTU_SHIFT, XMIT_ALL, 1280 << NETDEV_MTU_SHIFT, XMIT_ALL);
        let mut p = tcp6(CLIENT6, 40009, VIP6, 80, SYN);
        p.payload = vec![7; 1400 - IPV6_LEN - TCP_LEN];
        let sent = p.bytes();
        let (action, out) = fx.run(&sent, fx.if_a);
        assert_eq!(action, XDP_PASS, "to the kernel, which routes it to the client");
        let icmp = parse_too_big6(&out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
        assert_eq!((icmp.src, icmp.dst, icmp.mtu), (VIP6, CLIENT6, 1280));
        assert_eq!((icmp.dmac, icmp.smac), (GW_A_MAC, CLIENT_MAC));
        // As much of the packet as fits in 1,280 bytes, as the client sent it.
        assert_eq!(icmp.quoted, sent[ETH_LEN..ETH_LEN + 1280 - IPV6_LEN - 8]);
        assert_eq!(fx.counter("too_big"), 1);
    });
}

// ---------------------------------------------------------------- DSR

/// A DSR web service in each family, each with one backend.
fn dsr_web() -> Fixture {
    Fixture::new(vec![
        dsr(service("web", 80, Protocol::Tcp, &[(BACKEND, 80)])),
        dsr(service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 80)])),
    ])
}

#[test]
fn dsr_changes_only_the_macs_and_the_replies_never_come_back() {
    in_netns(|| {
        let fx = dsr_web();
        let syn = tcp(CLIENT, 40010, VIP, 80, SYN);
        let (action, out) = fx.run(&syn.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..syn.clone() }.bytes(), "TTL, addresses unchanged");
        let syn6 = tcp6(CLIENT6, 40010, VIP6, 80, SYN);
        let (action, out) = fx.run(&syn6.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Frame6 { dmac: BACKEND_MAC, smac: GW_B_MAC, ..syn6.clone() }.bytes());
        // The flow keeps its backend (and is established by the client's ACK).
        let ack = Frame { tcp_flags: ACK, ..syn };
        assert_eq!(
            fx.run(&ack.bytes(), fx.if_a),
            (XDP_REDIRECT, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..ack }.bytes())
        );
        assert_eq!(fx.new_flows("web", BACKEND), 1);
        assert_eq!(fx.new_flows("web6", BACKEND6), 1);
        // A backend's answer from the VIP is none of the datapath's business.
        let answer = Frame::tcp(VIP, 80, CLIENT, 40010, SYN | ACK).macs(GW_B_MAC, BACKEND_MAC);
        assert_eq!(fx.run(&answer.bytes(), fx.if_b), (XDP_PASS, answer.bytes()));
    });
}

/// A DSR flow's close is never seen whole (the backend's FIN goes straight
/// to the client): a client that reuses the tuple while the entry lives
/// opens a new connection, counted as one, and the old one is closed.
#[test]
fn a_reused_tuple_of_a_dsr_flow_is_counted_as_a_new_connection() {
    in_netns(|| {
        let fx = dsr_web();
        let sent = |p: Vec<u8>| {
            let (action, out) = fx.run(&p, fx.if_a);
            assert_eq!(action, XDP_REDIRECT);
            assert_eq!(out[..6], BACKEND_MAC, "to the backend");
        };
        for flags in [SYN, ACK, FIN | ACK, ACK] {
            sent(tcp(CLIENT, 40_020, VIP, 80, flags).bytes());
            sent(tcp6(CLIENT6, 40_020, VIP6, 80, flags).bytes());
        }
        assert_eq!((fx.new_flows("web", BACKEND), fx.new_flows("web6", BACKEND6)), (1, 1));
        assert_eq!((fx.active_flows("web"), fx.active_flows("web6")), (1, 1));
        // The reused tuple's SYN, then its retransmission.
        for _ in 0..2 {
            sent(tcp(CLIENT, 40_020, VIP, 80, SYN).bytes());
            sent(tcp6(CLIENT6, 40_020, VIP6, 80, SYN).bytes());
            assert_eq!((fx.new_flows("web", BACKEND), fx.new_flows("web6", BACKEND6)), (2, 2));
            assert_eq!((fx.active_flows("web"), fx.active_flows("web6")), (1, 1));
        }
    });
}

/// A SYN that the client sends again after resetting its own handshake is
/// the same connection, in both families. That is what a client does when
/// a backend's TIME_WAIT still holds the tuple (another service's earlier
/// connection on a shared backend endpoint) and answers the SYN with the
/// old connection's ACK: the client resets that, which closes the entry,
/// and its kernel retransmits the SYN. Counted as new, the connection was
/// counted twice. A SYN with another sequence number after a reset is a
/// new connection.
#[test]
fn a_syn_sent_again_after_its_handshakes_reset_is_the_same_connection() {
    in_netns(|| {
        let fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
        ]);
        let sent = |p: Vec<u8>| assert_eq!(fx.run(&p, fx.if_a).0, XDP_REDIRECT);
        let both = |flags, seq| {
            sent(Frame { seq, ..tcp(CLIENT, 40_030, VIP, 80, flags) }.bytes());
            sent(Frame6 { seq, ..tcp6(CLIENT6, 40_030, VIP6, 80, flags) }.bytes());
        };
        let counts = || {
            (
                (fx.new_flows("web", BACKEND), fx.new_flows("web6", BACKEND6)),
                (fx.active_flows("web"), fx.active_flows("web6")),
            )
        };
        // The backend's answer from the packets' other side.
        let answered = |flags| {
            let b4 = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..tcp(BACKEND, 8080, CLIENT, 40_030, flags) };
            let b6 = Frame6::tcp(BACKEND6, 8080, CLIENT6, 40_030, flags).macs(GW_B_MAC, BACKEND_MAC);
            assert_eq!(fx.run(&b4.bytes(), fx.if_b).0, XDP_REDIRECT);
            assert_eq!(fx.run(&b6.bytes(), fx.if_b).0, XDP_REDIRECT);
        };
        // The SYN, the backend's ACK of its old connection, the client's
        // reset of that.
        both(SYN, 0x1234_5678);
        answered(ACK);
        both(RST, 0x0bad_0000);
        assert_eq!(counts(), ((1, 1), (0, 0)), "the reset closed the entry");
        // The SYN again: the same connection, active again, not new; and
        // again, on the half-open entry it left.
        for _ in 0..2 {
            both(SYN, 0x1234_5678);
            assert_eq!(counts(), ((1, 1), (1, 1)), "a retransmission");
        }
        // Reset again, then a SYN of another connection (another sequence
        // number, here in its low byte alone): counted.
        both(RST, 0x0bad_0000);
        both(SYN, 0x1234_5679);
        assert_eq!(counts(), ((2, 2), (1, 1)), "a new connection");
        // That one completes its handshake, and the client aborts it with
        // a reset: a SYN on the tuple is a new connection whatever its
        // sequence number (clients that abort with resets reuse ports).
        answered(SYN | ACK);
        both(ACK, 0x1234_567a);
        both(RST, 0x1234_567a);
        assert_eq!(counts(), ((2, 2), (0, 0)), "aborted");
        both(SYN, 0x1234_5679);
        assert_eq!(counts(), ((3, 3), (1, 1)), "a new connection after an established one's reset");
    });
}

/// A SYN with another sequence number on a half-open entry is a new
/// connection on the entry's backend (see datapath.rs), also in IPv6 and
/// for a DSR service, whose entry never sees the backend's answers: the
/// client gave up the handshake and reused the tuple. Retransmissions of
/// either SYN are not counted again.
#[test]
fn a_syn_with_another_sequence_number_on_a_half_open_ipv6_or_dsr_flow_is_a_new_connection() {
    in_netns(|| {
        let fx = Fixture::new(vec![
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
            dsr(service("web", 80, Protocol::Tcp, &[(BACKEND, 80)])),
        ]);
        let sent = |p: Vec<u8>| assert_eq!(fx.run(&p, fx.if_a).0, XDP_REDIRECT);
        let both = |seq| {
            sent(Frame6 { seq, ..tcp6(CLIENT6, 40_040, VIP6, 80, SYN) }.bytes());
            sent(Frame { seq, ..tcp(CLIENT, 40_040, VIP, 80, SYN) }.bytes());
        };
        let counts = || {
            (
                (fx.new_flows("web6", BACKEND6), fx.new_flows("web", BACKEND)),
                (fx.active_flows("web6"), fx.active_flows("web")),
            )
        };
        for (seq, new) in [(0x100, 1), (0x100, 1), (0x201, 2), (0x201, 2), (0x302, 3)] {
            both(seq);
            assert_eq!(counts(), ((new, new), (1, 1)), "SYN {seq:#x}");
        }
        // The IPv6 backend answers and the client's ACK completes that
        // handshake; the DSR client's ACK alone completes its own.
        let answer = Frame6::tcp(BACKEND6, 8080, CLIENT6, 40_040, SYN | ACK).macs(GW_B_MAC, BACKEND_MAC);
        assert_eq!(fx.run(&answer.bytes(), fx.if_b).0, XDP_REDIRECT);
        sent(Frame6 { seq: 0x303, ..tcp6(CLIENT6, 40_040, VIP6, 80, ACK) }.bytes());
        sent(Frame { seq: 0x303, ..tcp(CLIENT, 40_040, VIP, 80, ACK) }.bytes());
        // Established: any SYN is a new connection (a reopen), and then
        // its own retransmission is not.
        both(0x302);
        assert_eq!(counts(), ((4, 4), (1, 1)), "reopened");
        both(0x302);
        assert_eq!(counts(), ((4, 4), (1, 1)), "the reopening SYN again");
    });
}

/// A client's tuple that opened a new connection after its flow closed
/// is scheduled anew (round robin: onto the other backend). The first
/// backend's late packets for that tuple (a retransmitted FIN) belong to
/// no live flow: dropped and counted, never passed on to the client with
/// the backend's own address as their source.
#[test]
fn an_old_backends_late_ipv6_packet_for_a_reused_tuple_is_dropped_not_leaked() {
    in_netns(|| {
        let backends = [(BACKEND6, 8080), (BACKEND6_UNRESOLVED, 8080)];
        let fx = Fixture::new(vec![ServiceConfig {
            vip: VIP6.into(),
            ..service_with("web6", 80, Protocol::Tcp, Scheduler::Rr, &backends)
        }]);
        let to = |flags: u8| {
            let (action, out) = fx.run(&tcp6(CLIENT6, 40_030, VIP6, 80, flags).bytes(), fx.if_a);
            let dst = assert_valid6(&out).dst;
            assert_eq!(action, if dst == BACKEND6 { XDP_REDIRECT } else { XDP_PASS }, "to {dst}");
            dst
        };
        let from = |b: Ipv6Addr, flags: u8| Frame6::tcp(b, 8080, CLIENT6, 40_030, flags).macs(GW_B_MAC, BACKEND_MAC);
        let old = to(SYN);
        assert_eq!(fx.run(&from(old, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        for flags in [ACK, FIN | ACK] {
            assert_eq!(to(flags), old);
        }
        assert_eq!(fx.run(&from(old, FIN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(to(ACK), old);
        // The tuple's new connection goes to the other backend.
        let new = to(SYN);
        assert_ne!(new, old);
        assert_eq!(fx.counter("stale_backend"), 0);
        let late = from(old, FIN | ACK).bytes();
        assert_eq!(fx.run(&late, fx.if_b), (XDP_DROP, late.clone()));
        assert_eq!(fx.counter("stale_backend"), 1);
        // The new backend's answer is the new flow's reply, from the VIP.
        let (action, out) = fx.run(&from(new, SYN | ACK).bytes(), fx.if_b);
        assert_eq!((action, assert_valid6(&out).src), (XDP_REDIRECT, VIP6));
    });
}

/// As for IPv4 (`datapath.rs`): a flow whose backend went down is counted
/// closed once, when a new entry on a live backend replaces its entry, and
/// not at all while no live backend can take it (its packets dropped).
#[test]
fn an_ipv6_flow_whose_backend_went_down_is_counted_closed_once() {
    in_netns(|| {
        let backends = [(BACKEND6, 8080), (BACKEND6_UNRESOLVED, 8080)];
        let service =
            ServiceConfig { vip: VIP6.into(), ..service_with("web6", 80, Protocol::Tcp, Scheduler::Rr, &backends) };
        let mut fx = Fixture::new(vec![service.clone()]);
        let to = |fx: &Fixture, flags: u8| {
            let (action, out) = fx.run(&tcp6(CLIENT6, 40_040, VIP6, 80, flags).bytes(), fx.if_a);
            let dst = assert_valid6(&out).dst;
            assert_eq!(action, if dst == BACKEND6 { XDP_REDIRECT } else { XDP_PASS }, "to {dst}");
            dst
        };
        let set_down = |fx: &mut Fixture, down: &[Ipv6Addr]| {
            let down: Vec<std::net::IpAddr> = down.iter().map(|&a| a.into()).collect();
            fx.dp
                .apply(std::slice::from_ref(&service), &|_, b| BackendRuntime {
                    weight: if down.contains(&b.address) { 0 } else { b.admin_weight() },
                    down: down.contains(&b.address),
                })
                .unwrap();
        };
        let old = to(&fx, SYN);
        assert_eq!(fx.connection_counts("web6"), (1, 0, 0));
        set_down(&mut fx, &[old]);
        let new = to(&fx, ACK);
        assert_ne!(new, old, "re-dispatched");
        assert_eq!(to(&fx, ACK), new);
        assert_eq!(fx.connection_counts("web6"), (2, 1, 0), "closed on the old backend once, opened on the new");
        set_down(&mut fx, &[BACKEND6, BACKEND6_UNRESOLVED]);
        for _ in 0..3 {
            assert_eq!(fx.run(&tcp6(CLIENT6, 40_040, VIP6, 80, ACK).bytes(), fx.if_a).0, XDP_DROP);
        }
        assert_eq!(fx.connection_counts("web6"), (2, 1, 0), "no live backend took the flow: nothing counted");
        set_down(&mut fx, &[]);
        assert_eq!(to(&fx, ACK), new, "the flow goes on on its backend");
        assert_eq!(fx.active_flows("web6"), 1);
        assert_eq!(to(&fx, RST), new);
        assert_eq!(fx.connection_counts("web6"), (2, 2, 0));
    });
}

/// As for IPv4 (`datapath.rs`): a new connection above the new-flow rate
/// on a tuple whose closed entry lingers takes that entry over, and its
/// backend's SYN-ACK goes back to the client.
#[test]
fn a_new_ipv6_flow_on_two_cpus_at_once_is_one_flow_counted_once() {
    // As `a_new_flow_on_two_cpus_at_once_is_one_flow_counted_once`
    // (datapath.rs), for IPv6: one entry, one backend, counted once.
    same_flow6_on_two_cpus(false);
}

#[test]
fn a_new_ipv6_flow_sharing_its_backends_endpoints_on_two_cpus_at_once_is_one_flow_counted_once() {
    // As the IPv4 test of that name (datapath.rs): a reply entry's lost
    // swap is a held packet, not a full table.
    same_flow6_on_two_cpus(true);
}

/// The two-CPU race against a round-robin IPv6 service over six
/// backends; `shared`: their endpoints are another service's (`web6`),
/// the flows go to `alt6` (as `same_flow_on_two_cpus`, datapath.rs).
fn same_flow6_on_two_cpus(shared: bool) {
    in_netns(move || {
        let backends: Vec<(Ipv6Addr, u16)> =
            (0x11..0x17).map(|i| (Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, i), 8080)).collect();
        let (name, port) = if shared { ("alt6", 81) } else { ("web6", 80) };
        let mut services = vec![ServiceConfig {
            vip: VIP6.into(),
            ..service_with("web6", 80, Protocol::Tcp, Scheduler::Rr, &backends)
        }];
        if shared {
            services.push(ServiceConfig {
                vip: VIP6.into(),
                ..service_with("alt6", 81, Protocol::Tcp, Scheduler::Rr, &backends)
            });
        }
        let mut fx = Fixture::with_config(services, |c| {
            // Room for every flow (two entries each when shared): none
            // is routed without an entry.
            c.conntrack_max_ipv6 = if shared { 65_536 } else { 32_768 };
            c.flood.new_flow_rate_per_cpu = Some(0);
        });
        let client =
            |i: u32| Ipv6Addr::from(u128::from(Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0)) + u128::from(i));
        same_new_flows_on_two_cpus(
            &mut fx,
            name,
            VIP6.into(),
            move |i, flags| tcp6(client(i), 40_000, VIP6, port, flags).bytes(),
            |out| Frame6::parse(out).expect("an IPv6 frame").dst.into(),
            if shared { 2 } else { 1 },
        );
    });
}

#[test]
fn a_new_ipv6_connection_above_the_rate_on_a_tuple_with_an_entry_takes_the_entry_over() {
    in_netns(|| {
        // The limit is per CPU: stay on one.
        on_cpu(0);
        let backends = [(BACKEND6, 8080), (BACKEND6_UNRESOLVED, 8080)];
        let service =
            ServiceConfig { vip: VIP6.into(), ..service_with("web6", 80, Protocol::Tcp, Scheduler::Rr, &backends) };
        let mut fx = Fixture::with_config(vec![service], |c| c.flood.new_flow_rate_per_cpu = Some(5));
        let to = |fx: &Fixture, f: Frame6| {
            let (action, out) = fx.run(&f.bytes(), fx.if_a);
            let dst = assert_valid6(&out).dst;
            assert_eq!(action, if dst == BACKEND6 { XDP_REDIRECT } else { XDP_PASS }, "to {dst}");
            dst
        };
        let from = |b: Ipv6Addr, flags: u8| Frame6::tcp(b, 8080, CLIENT6, 40_050, flags).macs(GW_B_MAC, BACKEND_MAC);
        let first = to(&fx, tcp6(CLIENT6, 40_050, VIP6, 80, SYN));
        assert_eq!(fx.run(&from(first, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(to(&fx, tcp6(CLIENT6, 40_050, VIP6, 80, ACK)), first);
        assert_eq!(to(&fx, tcp6(CLIENT6, 40_050, VIP6, 80, RST)), first);
        let mut fresh = 41_000;
        let taken = (0..5).find_map(|_| {
            let second = lb_userspace::dataplane::monotonic_coarse_secs();
            let limited = fx.counter("flood_rate");
            while fx.counter("flood_rate") == limited {
                to(&fx, tcp6(CLIENT6, fresh, VIP6, 80, SYN));
                fresh += 1;
            }
            let b = to(&fx, Frame6 { seq: 7_000_000, ..tcp6(CLIENT6, 40_050, VIP6, 80, SYN) });
            let same_second = lb_userspace::dataplane::monotonic_coarse_secs() == second;
            same_second.then_some((b, fx.counter("flood_rate") - limited - 1))
        });
        let (b, limited_since) = taken.expect("five tries, each across a second's turn");
        let (action, out) = fx.run(&from(b, SYN | ACK).bytes(), fx.if_b);
        assert_eq!(
            action,
            XDP_REDIRECT,
            "the SYN-ACK of the port's new connection (stale_backend {})",
            fx.counter("stale_backend")
        );
        assert_eq!(assert_valid6(&out).src, VIP6);
        assert_eq!(to(&fx, tcp6(CLIENT6, 40_050, VIP6, 80, ACK)), b);
        assert_eq!(fx.counter("stale_backend"), 0);
        assert_eq!(limited_since, 0, "the port's new connection was rate limited");
        let with_entries = u64::from(fresh - 41_000) - fx.counter("flood_rate");
        assert_eq!(fx.entries(), 1 + with_entries, "the closed entry replaced in place");
        assert_eq!(fx.active_flows("web6"), 1 + with_entries);
    });
}

/// As for IPv4 (`datapath.rs`): a client reusing its address and port
/// for the service sharing an endpoint, right after its connection to the
/// owner closed, gets the backend's SYN-ACK and later replies as from the
/// sharing service's VIP port, not the owner's.
#[test]
fn an_ipv6_syn_ack_for_the_sharing_service_on_a_closed_owners_tuple_goes_back_as_the_sharing_service() {
    in_netns(|| {
        let fx = Fixture::new(vec![
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
            service6("alt6", 81, Protocol::Tcp, &[(BACKEND6, 8080)]),
        ]);
        let to = |vport: u16, flags: u8| {
            let (action, out) = fx.run(&tcp6(CLIENT6, 40_040, VIP6, vport, flags).bytes(), fx.if_a);
            assert_eq!((action, assert_valid6(&out).dst), (XDP_REDIRECT, BACKEND6), "to {vport}");
        };
        let back = |flags: u8| {
            let f = Frame6::tcp(BACKEND6, 8080, CLIENT6, 40_040, flags).macs(GW_B_MAC, BACKEND_MAC);
            let (action, out) = fx.run(&f.bytes(), fx.if_b);
            assert_eq!(action, XDP_REDIRECT);
            let got = assert_valid6(&out);
            (got.src, got.sport)
        };
        to(80, SYN);
        assert_eq!(back(SYN | ACK), (VIP6, 80));
        to(80, ACK);
        assert_eq!(back(FIN | ACK), (VIP6, 80));
        to(80, FIN | ACK);
        to(80, ACK);
        to(81, SYN);
        assert_eq!(back(SYN | ACK), (VIP6, 81), "the SYN-ACK of alt6's flow went back as web6's");
        to(81, ACK);
        assert_eq!(back(ACK | PSH), (VIP6, 81), "alt6's answer went back as web6's");
        assert_eq!(fx.counter("stale_backend"), 0);
        // The client's late packet of web6's closed flow still goes to its
        // backend endpoint, port and all.
        let (action, out) = fx.run(&tcp6(CLIENT6, 40_040, VIP6, 80, ACK).bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let late = assert_valid6(&out);
        assert_eq!((late.dst, late.dport), (BACKEND6, 8080), "a retired flow's late packet");
    });
}

/// A DSR packet leaves unchanged but for its MACs; one with an unfinished
/// IPv4 checksum (a local sender's offload) leaves by native redirect
/// finished, since the XDP frame carries no "finish me" mark, and by
/// generic redirect still unfinished (the skb keeps the mark).
#[test]
fn a_dsr_packet_with_an_unfinished_checksum_leaves_finished_by_native_redirect() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            dsr(service("web", 80, Protocol::Tcp, &[(BACKEND, 80)])),
            dsr(service("dns", 53, Protocol::Udp, &[(BACKEND, 53)])),
        ]);
        let mut port = 43000u16;
        let mut partial = 0;
        for n in [0usize, 1, 513, 1460] {
            let payload: Vec<u8> = (0..n).map(|b| (b * 5 + n) as u8).collect();
            for is_udp in [false, true] {
                port += 1;
                let base = if is_udp { udp(CLIENT, port, VIP, 53) } else { tcp(CLIENT, port, VIP, 80, SYN) };
                let p = Frame { payload: payload.clone(), l4_checksum: L4Checksum::Partial, ..base };
                fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&p.bytes(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "payload {n}, udp {is_udp}");
                let done = Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, l4_checksum: L4Checksum::Full, ..p.clone() };
                assert_eq!(out, done.bytes(), "payload {n}, udp {is_udp}: not finished correctly");
                assert_checksums_valid(&out);
                partial += 1;
                let next = Frame { sport: p.sport + 10_000, ..p.clone() };
                fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&next.bytes(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT);
                assert_eq!(out, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..next.clone() }.bytes(), "kept unfinished");
            }
        }
        // Counted on native ingress (generic mode does not look).
        assert_eq!(fx.counter("csum_partial"), partial);
        // A finished checksum is left alone.
        fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
        let full = tcp(CLIENT, 44000, VIP, 80, SYN);
        assert_eq!(
            fx.run(&full.bytes(), fx.if_a),
            (XDP_REDIRECT, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..full }.bytes())
        );
    });
}

#[test]
fn a_dsr_backend_behind_a_router_is_refused_and_counted() {
    in_netns(|| {
        let fx = Fixture::new(vec![dsr(service("web", 80, Protocol::Tcp, &[(BACKEND_ROUTED, 80)]))]);
        let syn = tcp(CLIENT, 40011, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("dsr_off_link"), 1);
    });
}

// ---------------------------------------------------------------- ICMP

/// An ICMP "fragmentation needed" from `src` to `dst` quoting `quoted`
/// (built and checksummed by etherparse), arriving from `smac`.
fn frag_needed(src: Ipv4Addr, dst: Ipv4Addr, quoted: &[u8], macs: ([u8; 6], [u8; 6])) -> Vec<u8> {
    let t = Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded { next_hop_mtu: 1200 });
    let b = PacketBuilder::ethernet2(macs.1, macs.0).ipv4(src.octets(), dst.octets(), 64).icmpv4(t);
    let mut out = Vec::new();
    b.write(&mut out, quoted).expect("write to a Vec");
    out
}

fn quoted_ip(q: &[u8]) -> Ipv4Header {
    let (ip, _) = Ipv4Header::from_slice(q).expect("quoted IPv4 header");
    assert_eq!(ip.header_checksum, ip.calc_header_checksum(), "the quoted header's checksum");
    ip
}

#[test]
fn an_icmp_error_about_a_forwarded_packet_reaches_the_client_naming_the_vip() {
    // The flow of the endpoint's owner, and of a service that shares the
    // endpoint (its flows keep a reply entry, which names their VIP).
    for vport in [80, 81] {
        icmp_error_about_a_forwarded_packet_names(vport);
    }
}

fn icmp_error_about_a_forwarded_packet_names(vport: u16) {
    in_netns(move || {
        let fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("alt", 81, Protocol::Tcp, &[(BACKEND, 8080)]),
        ]);
        let mut syn = tcp(CLIENT, 40012, VIP, vport, SYN);
        syn.payload = vec![1; 200];
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        // A router on the backend side could not pass the (rewritten)
        // packet: it quotes it, header and the first 28 bytes of TCP
        // (checksum included).
        let sent_on = Frame { dst: BACKEND, dport: 8080, ttl: 63, ..syn.clone() }.bytes();
        let quote = &sent_on[ETH_LEN..ETH_LEN + IPV4_LEN + 28];
        let err = frag_needed(Ipv4Addr::new(10, 20, 0, 254), CLIENT, quote, (GW_B_MAC, BACKEND_MAC));
        let (action, out) = fx.run(&err, fx.if_b);
        assert_eq!(action, XDP_PASS, "on to the client through the kernel");
        let icmp = parse_frag_needed(&out).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((icmp.src, icmp.dst), (Ipv4Addr::new(10, 20, 0, 254), CLIENT));
        // What the client sent, as it sent it (but for the TTL the hop
        // took): to the VIP and its port, its checksums valid.
        let as_sent = Frame { ttl: 63, ..syn }.bytes();
        assert_eq!(icmp.quoted, as_sent[ETH_LEN..ETH_LEN + IPV4_LEN + 28]);
        quoted_ip(&icmp.quoted);
        assert_eq!(fx.counter("icmp_to_client"), 1);
    });
}

#[test]
fn an_icmp_error_about_a_reply_reaches_the_backend_naming_it() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let syn = tcp(CLIENT, 40013, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        // The reply as it left the balancer (from the VIP); a router on
        // the client side sends the error to the VIP.
        let mut reply = Frame::tcp(VIP, 80, CLIENT, 40013, ACK);
        reply.ttl = 63;
        reply.payload = vec![2; 200];
        let r = reply.bytes();
        let err = frag_needed(
            Ipv4Addr::new(10, 10, 0, 254),
            VIP,
            &r[ETH_LEN..ETH_LEN + IPV4_LEN + 8],
            (GW_A_MAC, CLIENT_MAC),
        );
        let (action, out) = fx.run(&err, fx.if_a);
        assert_eq!(action, XDP_PASS, "on to the backend through the kernel");
        let icmp = parse_frag_needed(&out).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(icmp.dst, BACKEND);
        // The reply as the backend sent it: from its own address and port.
        let as_sent = Frame { src: BACKEND, sport: 8080, ..reply }.bytes();
        assert_eq!(icmp.quoted, as_sent[ETH_LEN..ETH_LEN + IPV4_LEN + 8]);
        quoted_ip(&icmp.quoted);
        assert_eq!(fx.counter("icmp_to_backend"), 1);
    });
}

#[test]
fn an_icmpv6_packet_too_big_about_a_reply_reaches_the_backend_naming_it() {
    in_netns(|| {
        let fx = web6();
        let syn = tcp6(CLIENT6, 40014, VIP6, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let mut reply = Frame6::tcp(VIP6, 80, CLIENT6, 40014, ACK);
        reply.hop_limit = 63;
        reply.payload = vec![3; 100];
        let r = reply.bytes();
        let router: Ipv6Addr = "fd00:10::fe".parse().unwrap();
        let b = PacketBuilder::ethernet2(CLIENT_MAC, GW_A_MAC)
            .ipv6(router.octets(), VIP6.octets(), 64)
            .icmpv6(Icmpv6Type::PacketTooBig { mtu: 1280 });
        let mut err = Vec::new();
        b.write(&mut err, &r[ETH_LEN..]).expect("write to a Vec");
        let (action, out) = fx.run(&err, fx.if_a);
        assert_eq!(action, XDP_PASS);
        let icmp = parse_too_big6(&out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
        assert_eq!((icmp.src, icmp.dst, icmp.mtu), (router, BACKEND6, 1280));
        let as_sent = Frame6 { src: BACKEND6, sport: 8080, ..reply }.bytes();
        assert_eq!(icmp.quoted, as_sent[ETH_LEN..]);
        assert_eq!(fx.counter("icmp_to_backend"), 1);
    });
}

#[test]
fn an_icmpv6_error_about_a_forwarded_packet_reaches_the_client_naming_the_vip() {
    // As for IPv4: the owner's flow and a sharing service's.
    for vport in [80, 81] {
        icmpv6_error_about_a_forwarded_packet_names(vport);
    }
}

fn icmpv6_error_about_a_forwarded_packet_names(vport: u16) {
    in_netns(move || {
        let fx = Fixture::new(vec![
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
            service6("alt6", 81, Protocol::Tcp, &[(BACKEND6, 8080)]),
        ]);
        let mut syn = tcp6(CLIENT6, 40015, VIP6, vport, SYN);
        syn.payload = vec![4; 100];
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        // A router on the backend side: the packet as it went on.
        let sent_on = to_backend6(&syn).bytes();
        let router: Ipv6Addr = "fd00:20::fe".parse().unwrap();
        let b = PacketBuilder::ethernet2(BACKEND_MAC, GW_B_MAC)
            .ipv6(router.octets(), CLIENT6.octets(), 64)
            .icmpv6(Icmpv6Type::PacketTooBig { mtu: 1280 });
        let mut err = Vec::new();
        b.write(&mut err, &sent_on[ETH_LEN..]).expect("write to a Vec");
        let (action, out) = fx.run(&err, fx.if_b);
        assert_eq!(action, XDP_PASS);
        let icmp = parse_too_big6(&out).unwrap_or_else(|e| panic!("{e}: {out:02x?}"));
        assert_eq!((icmp.src, icmp.dst), (router, CLIENT6));
        // What the client sent (but for the hop limit): to the VIP and port.
        let as_sent = Frame6 { hop_limit: 63, ..syn }.bytes();
        assert_eq!(icmp.quoted, as_sent[ETH_LEN..]);
        assert_eq!(fx.counter("icmp_to_client"), 1);
    });
}

#[test]
fn a_packet_too_big_for_a_dsr_reply_path_is_sent_on_to_the_backend_unchanged() {
    in_netns(|| {
        let fx = Fixture::new(vec![dsr(service("web", 80, Protocol::Tcp, &[(BACKEND, 80)]))]);
        let syn = tcp(CLIENT, 40016, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        // The backend's answer (from the VIP) hit a narrow link on the
        // client side; that router tells the VIP, by the gateway.
        let mut answer = Frame::tcp(VIP, 80, CLIENT, 40016, ACK);
        answer.payload = vec![5; 1400];
        let a = answer.bytes();
        let err = frag_needed(
            Ipv4Addr::new(10, 20, 0, 254),
            VIP,
            &a[ETH_LEN..ETH_LEN + IPV4_LEN + 8],
            (GW_B_MAC, BACKEND_MAC),
        );
        let (action, out) = fx.run(&err, fx.if_b);
        assert_eq!(action, XDP_REDIRECT, "to the backend's MAC");
        assert_eq!(out[..6], BACKEND_MAC);
        assert_eq!(out[12..], err[12..], "otherwise unchanged: the backend holds the VIP it quotes");
        assert_eq!(fx.counter("icmp_to_backend"), 1);
    });
}

#[test]
fn a_truncated_icmp_error_is_left_untouched() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let syn = tcp(CLIENT, 40017, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        let sent_on = Frame { dst: BACKEND, dport: 8080, ttl: 63, ..syn }.bytes();
        let err = frag_needed(
            Ipv4Addr::new(10, 20, 0, 254),
            CLIENT,
            &sent_on[ETH_LEN..ETH_LEN + IPV4_LEN + 28],
            (GW_B_MAC, BACKEND_MAC),
        );
        // Cut anywhere (the outer header, the ICMP header, the quoted
        // header, the quoted ports): the stated lengths no longer hold,
        // and nothing is rewritten.
        for len in 14..err.len() {
            assert_eq!(fx.run(&err[..len], fx.if_b), (XDP_PASS, err[..len].to_vec()), "cut at {len}");
        }
        assert_eq!(fx.counter("icmp_to_client"), 0);
        assert_eq!(fx.run(&err, fx.if_b).0, XDP_PASS);
        assert_eq!(fx.counter("icmp_to_client"), 1, "the whole error is translated");
    });
}

#[test]
fn the_sweeper_removes_an_ipv6_flow_only_while_it_is_as_it_was_judged() {
    in_netns(|| {
        let mut fx = web6();
        assert_eq!(fx.run(&tcp6(CLIENT6, 40100, VIP6, 80, SYN).bytes(), fx.if_a).0, XDP_REDIRECT);
        let key = lb_common::FlowKey6 {
            src_addr: lb_userspace::dataplane::words6(&CLIENT6),
            dst_addr: lb_userspace::dataplane::words6(&VIP6),
            src_port: 40100u16.to_be(),
            dst_port: 80u16.to_be(),
            proto: lb_common::PROTO_TCP,
            _pad: [0; 3],
        };
        let f = fx.dp.flow6(&key).unwrap().expect("the flow's entry");
        let slot = fx.dp.flow_slot6(&key).unwrap().expect("the flow's slot");
        let item = lb_common::SweepItem6 { key, state: f.state, last_seen: f.last_seen, removed: 0, slot };
        // Judged before its last packet: it stays.
        let older = lb_common::SweepItem6 { last_seen: f.last_seen.wrapping_sub(1), ..item };
        assert_eq!(fx.dp.remove_unchanged6(&[older]).unwrap()[0].removed, 0);
        assert_eq!(fx.dp.flow6(&key).unwrap(), Some(f));
        // As judged: it goes.
        assert_eq!(fx.dp.remove_unchanged6(&[item]).unwrap()[0].removed, 1);
        assert_eq!(fx.dp.flow6(&key).unwrap(), None);
        assert_eq!(fx.entries(), 0);
    });
}

/// As for IPv4 (`datapath.rs`): a migration's late copy brings what the
/// old program saw since into an IPv6 flow's copy (a handshake; a close by
/// halves, counted once, here), leaves an entry made anew since alone, and
/// puts a later connection the old program made on a copy's tuple in the
/// copy's place (its close then counted here).
#[test]
fn a_late_copy_brings_what_the_old_program_saw_into_an_ipv6_flows_copy() {
    use lb_common::{FLOW_ESTABLISHED as EST, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REPLIED, FLOW_RST};
    in_netns(|| {
        let fx = web6();
        let key = |p: u16| lb_common::FlowKey6 {
            src_addr: lb_userspace::dataplane::words6(&CLIENT6),
            dst_addr: lb_userspace::dataplane::words6(&VIP6),
            src_port: p.to_be(),
            dst_port: 80u16.to_be(),
            proto: lb_common::PROTO_TCP,
            _pad: [0; 3],
        };
        let entry = |p: u16| fx.dp.flow6(&key(p)).unwrap().expect("an entry");
        let to =
            |p: u16, flags: u8| assert_eq!(fx.run(&tcp6(CLIENT6, p, VIP6, 80, flags).bytes(), fx.if_a).0, XDP_REDIRECT);
        let from = |p: u16, flags: u8| {
            let f = Frame6::tcp(BACKEND6, 8080, CLIENT6, p, flags).macs(GW_B_MAC, BACKEND_MAC);
            assert_eq!(fx.run(&f.bytes(), fx.if_b).0, XDP_REDIRECT);
        };
        // 41,100: half-open when copied; 41,101: established; 41,102:
        // closed when copied, a new connection on the tuple since; 41,103:
        // reset when copied, a later connection by the old program.
        to(41_100, SYN);
        from(41_100, SYN | ACK);
        for p in [41_101, 41_102, 41_103] {
            to(p, SYN);
            from(p, SYN | ACK);
            to(p, ACK);
        }
        to(41_102, FIN | ACK);
        from(41_102, FIN | ACK);
        to(41_103, RST);
        // The first copy takes them (this datapath made them), marked as
        // copies (`FLOW_COPY`) and without the mark of a flow counted per
        // CPU, as every layout a migration copies from counted its flows
        // in `CONNS` (see `first_copy` in datapath.rs); `copies` keeps
        // them as the old program had them.
        let mut copies: Vec<(lb_common::FlowKey6, lb_common::Flow6)> = Vec::new();
        for p in [41_100, 41_101, 41_102, 41_103] {
            let (k, f) = (key(p), entry(p));
            let slot = fx.dp.flow_slot6(&k).unwrap().expect("a slot");
            let item = lb_common::SweepItem6 { key: k, state: f.state, last_seen: f.last_seen, removed: 0, slot };
            assert_eq!(fx.dp.remove_unchanged6(&[item]).unwrap()[0].removed, 1);
            let f = lb_common::Flow6 { state: f.state & !lb_common::FLOW_CONNS_CPU, ..f };
            let copy = lb_common::Flow6 { state: f.state | lb_common::FLOW_COPY, ..f };
            assert_eq!(fx.dp.insert_flows6(&[(k, copy)]).unwrap().inserted, 1);
            copies.push((k, f));
        }
        assert_eq!(copies[3].1.state, FLOW_REPLIED | EST | FLOW_RST);
        // After the swap: the backend's FIN of 41,101 here; 41,102 anew;
        // the client's FIN of 41,103's later connection (on the copy,
        // closed: not counted).
        from(41_101, FIN | ACK);
        to(41_102, SYN);
        to(41_103, FIN | ACK);
        let anew = entry(41_102);
        let active = fx.active_flows("web6");
        // The old program's later views: 41,100's handshake completed,
        // the client's FIN of 41,101, 41,102 as copied, 41,103's later
        // connection established.
        let seen = [FLOW_REPLIED | EST, FLOW_REPLIED | EST | FLOW_FIN_CLIENT, copies[2].1.state, FLOW_REPLIED | EST];
        let old: Vec<_> = copies
            .iter()
            .zip(seen)
            .map(|(&(k, f), state)| (k, lb_common::Flow6 { state, last_seen: f.last_seen + 3, ..f }))
            .collect();
        let copied = copies.iter().map(|(k, f)| (*k, f.state)).collect();
        let done = fx.dp.merge_flows6(&old, &copied).unwrap();
        let counts = (done.inserted, done.merged, done.replaced, done.existed, done.no_room);
        assert_eq!(counts, (0, 2, 1, 1, 0), "{done:?}");
        assert_eq!(entry(41_100).state, FLOW_REPLIED | EST | lb_common::FLOW_COPY, "the handshake the old program saw");
        let closed = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND;
        assert_eq!(entry(41_101).state & closed, closed, "the close seen by halves");
        assert_eq!(entry(41_101).last_seen, copies[1].1.last_seen + 3);
        assert_eq!(entry(41_102), anew, "the new connection on the tuple took the old view");
        assert_eq!(fx.active_flows("web6"), active - 1, "the close by halves is counted once");
        assert_eq!(entry(41_103).state, FLOW_REPLIED | EST | FLOW_FIN_CLIENT, "the later connection, as both saw it");
        assert_eq!(entry(41_103).last_seen, copies[3].1.last_seen + 3);
        from(41_103, FIN | ACK);
        assert_eq!(fx.active_flows("web6"), active - 2, "the later connection's close is counted here");
    });
}

/// As for IPv4 (`datapath.rs`): while a migration holds, a TCP packet
/// other than a SYN on a closed IPv6 entry is dropped for its
/// retransmission (`held`), and so is a SYN on a half-open one (it may be
/// a later connection on a copy's reused tuple); a SYN on the closed
/// tuple is scheduled, and once the hold ends the closed flow's late
/// packets, and the half-open flow's SYN, pass again.
#[test]
fn a_migrations_hold_keeps_packets_on_a_closed_ipv6_entry_for_their_retransmission() {
    in_netns(|| {
        let mut fx = web6();
        let run = |fx: &Fixture, p: u16, flags: u8| fx.run(&tcp6(CLIENT6, p, VIP6, 80, flags).bytes(), fx.if_a).0;
        let from = |fx: &Fixture, p: u16, flags: u8| {
            let f = Frame6::tcp(BACKEND6, 8080, CLIENT6, p, flags).macs(GW_B_MAC, BACKEND_MAC);
            assert_eq!(fx.run(&f.bytes(), fx.if_b).0, XDP_REDIRECT);
        };
        for p in [41_200, 41_201, 41_202] {
            assert_eq!(run(&fx, p, SYN), XDP_REDIRECT);
            from(&fx, p, SYN | ACK);
            assert_eq!(run(&fx, p, ACK), XDP_REDIRECT);
        }
        for p in [41_200, 41_201] {
            assert_eq!(run(&fx, p, FIN | ACK), XDP_REDIRECT);
            from(&fx, p, FIN | ACK);
        }
        fx.dp.hold_for(10).unwrap();
        let held = fx.counter("held");
        assert_eq!(run(&fx, 41_200, ACK), XDP_DROP);
        assert_eq!(run(&fx, 41_200, FIN | ACK), XDP_DROP);
        assert_eq!(fx.counter("held"), held + 2);
        assert_eq!(run(&fx, 41_202, ACK | PSH), XDP_REDIRECT, "an open flow's packet is not held");
        assert_eq!(run(&fx, 41_202, SYN), XDP_REDIRECT, "a SYN on an established flow is not held");
        let new_flows = fx.new_flows("web6", BACKEND6);
        assert_eq!(run(&fx, 41_201, SYN), XDP_REDIRECT, "a SYN on the closed tuple is scheduled");
        assert_eq!(fx.new_flows("web6", BACKEND6), new_flows + 1);
        assert_eq!(fx.counter("held"), held + 2);
        // 41,201's entry is half-open now: a SYN on it waits.
        assert_eq!(run(&fx, 41_201, SYN), XDP_DROP, "a SYN on a half-open entry");
        assert_eq!(fx.counter("held"), held + 3);
        fx.dp.hold_for(0).unwrap();
        assert_eq!(run(&fx, 41_200, ACK), XDP_REDIRECT);
        assert_eq!(run(&fx, 41_201, SYN), XDP_REDIRECT, "the half-open flow's SYN, after the hold");
        assert_eq!(fx.new_flows("web6", BACKEND6), new_flows + 1, "a retransmitted SYN is not a new flow");
        assert_eq!(fx.counter("held"), held + 3);
    });
}

/// As for IPv4 (`datapath.rs`): while a migration's program swap is under
/// way, an IPv6 SYN that would open a flow waits for its retransmission
/// (`held`), uncounted and without an entry; once it is done, SYNs are
/// scheduled again.
#[test]
fn a_migrations_swap_holds_ipv6_syns_that_would_open_a_flow() {
    in_netns(|| {
        let mut fx = web6();
        let run = |fx: &Fixture, p: u16, flags: u8| fx.run(&tcp6(CLIENT6, p, VIP6, 80, flags).bytes(), fx.if_a).0;
        fx.dp.hold_new_for(10).unwrap();
        let (held, new_flows) = (fx.counter("held"), fx.new_flows("web6", BACKEND6));
        assert_eq!(run(&fx, 41_300, SYN), XDP_DROP);
        assert_eq!(fx.counter("held"), held + 1);
        assert_eq!(fx.new_flows("web6", BACKEND6), new_flows, "a held SYN is counted nowhere");
        fx.dp.hold_for(10).unwrap();
        assert_eq!(run(&fx, 41_300, SYN), XDP_REDIRECT, "the swap done, a SYN is scheduled");
        assert_eq!(fx.new_flows("web6", BACKEND6), new_flows + 1);
        assert_eq!(fx.counter("held"), held + 1);
        fx.dp.hold_for(0).unwrap();
    });
}

// ---------------------------------------------------------------- one arm

/// A one-arm gateway (Katran's setup): a packet whose egress is the very
/// device it came in on goes back out by XDP_TX where lbd says that works
/// (`NETDEV_F_TX`: generic mode, or a native device other than a veth),
/// rewritten exactly as a redirected one, and counts in `xdp_redirect`
/// (the forwarded-by-XDP total) and in `xdp_tx`. Both families, NAT both
/// ways and DSR. Any other egress is still a redirect, also from a cached
/// hop marked for XDP_TX; a native veth (no `NETDEV_F_TX`) sends it back
/// by redirect; an egress that takes no redirect from the ingress's mode
/// gets the kernel path.
#[test]
fn a_packet_whose_egress_is_its_ingress_goes_back_out_by_xdp_tx() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service6("web6", 80, Protocol::Tcp, &[(BACKEND6, 8080)]),
            dsr(service("dsr", 81, Protocol::Tcp, &[(BACKEND, 81)])),
            dsr(service6("dsr6", 81, Protocol::Tcp, &[(BACKEND6, 81)])),
        ]);
        // Both devices native, each able to send XDP_TX (a NIC's driver).
        fx.netdevs(0, XMIT_ALL | NETDEV_F_TX, 0, XMIT_ALL | NETDEV_F_TX);
        let sent = |fx: &Fixture| (fx.counter("xdp_redirect"), fx.counter("xdp_tx"));
        let to_backend =
            |p: &Frame| Frame { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..p.clone() };
        // The client's SYN arrives on gwb, the backends' side: it leaves
        // through gwb again.
        let syn = tcp(CLIENT, 40100, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_b), (XDP_TX, to_backend(&syn).bytes()));
        assert_eq!(sent(&fx), (1, 1));
        assert_eq!(fx.new_flows("web", BACKEND), 1);
        // The backend's answer arrives on gwa, the clients' side.
        let synack = Frame { dmac: GW_A_MAC, smac: BACKEND_MAC, ..tcp(BACKEND, 8080, CLIENT, 40100, SYN | ACK) };
        let back = |p: &Frame| Frame { src: VIP, sport: 80, ttl: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..p.clone() };
        assert_eq!(fx.run(&synack.bytes(), fx.if_a), (XDP_TX, back(&synack).bytes()));
        assert_checksums_valid(&back(&synack).bytes());
        assert_eq!(sent(&fx), (2, 2));
        // The next reply arrives on gwb: the flow's cached hop, marked for
        // XDP_TX out of gwa, is a redirect into gwa from there.
        let data = Frame { tcp_flags: ACK, ..synack.clone() };
        assert_eq!(fx.run(&data.bytes(), fx.if_b), (XDP_REDIRECT, back(&data).bytes()));
        assert_eq!(sent(&fx), (3, 2));
        // The flow's next packet on gwa: another egress, a redirect (the
        // backend's next hop, cached for gwb, is not taken for gwa).
        let ack = Frame { tcp_flags: ACK, ..syn.clone() };
        assert_eq!(fx.run(&ack.bytes(), fx.if_a), (XDP_REDIRECT, to_backend(&ack).bytes()));
        assert_eq!(sent(&fx), (4, 2));
        // On gwb again, twice: looked up, then from the cache.
        for _ in 0..2 {
            assert_eq!(fx.run(&ack.bytes(), fx.if_b), (XDP_TX, to_backend(&ack).bytes()));
        }
        assert_eq!(sent(&fx), (6, 4));
        assert_eq!(fx.new_flows("web", BACKEND), 1, "one connection throughout");

        // IPv6, NAT and DSR of both families.
        let syn6 = tcp6(CLIENT6, 40100, VIP6, 80, SYN);
        assert_eq!(fx.run(&syn6.bytes(), fx.if_b), (XDP_TX, to_backend6(&syn6).bytes()));
        let dsr4 = tcp(CLIENT, 40100, VIP, 81, SYN);
        let (action, out) = fx.run(&dsr4.bytes(), fx.if_b);
        assert_eq!((action, out), (XDP_TX, Frame { dmac: BACKEND_MAC, smac: GW_B_MAC, ..dsr4 }.bytes()));
        let dsr6 = tcp6(CLIENT6, 40100, VIP6, 81, SYN);
        let (action, out) = fx.run(&dsr6.bytes(), fx.if_b);
        assert_eq!((action, out), (XDP_TX, Frame6 { dmac: BACKEND_MAC, smac: GW_B_MAC, ..dsr6 }.bytes()));
        assert_eq!(sent(&fx), (9, 7));
        let flows = (fx.new_flows("web6", BACKEND6), fx.new_flows("dsr", BACKEND), fx.new_flows("dsr6", BACKEND6));
        assert_eq!(flows, (1, 1, 1));

        // Native veths (what lbd describes for them: no NETDEV_F_TX): back
        // out of gwb by redirect, in both families.
        fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
        assert_eq!(fx.run(&ack.bytes(), fx.if_b), (XDP_REDIRECT, to_backend(&ack).bytes()));
        let ack6 = Frame6 { tcp_flags: ACK, ..syn6 };
        assert_eq!(fx.run(&ack6.bytes(), fx.if_b), (XDP_REDIRECT, to_backend6(&ack6).bytes()));
        assert_eq!(sent(&fx), (11, 7));
        // gwb takes no native redirect: the kernel path, XDP_TX or not.
        fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC | NETDEV_F_TX);
        let (action, out) = fx.run(&ack.bytes(), fx.if_b);
        assert_eq!((action, out), (XDP_PASS, Frame { dst: BACKEND, dport: 8080, ..ack.clone() }.bytes()));
        assert_eq!(sent(&fx), (11, 7));
        assert_eq!(fx.counter("kernel_egress"), 1);
        // Generic mode on gwb (XDP_TX always works there): XDP_TX again.
        fx.netdevs(0, XMIT_ALL, NETDEV_F_GENERIC, NETDEV_F_XMIT_GENERIC | NETDEV_F_TX);
        assert_eq!(fx.run(&ack.bytes(), fx.if_b), (XDP_TX, to_backend(&ack).bytes()));
        assert_eq!(sent(&fx), (12, 8));
        assert_eq!(fx.counter("fib_fallback"), 0);
    });
}

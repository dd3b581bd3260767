//! Packet fixtures through BPF_PROG_TEST_RUN: the real XDP program, loaded
//! and programmed by the real `Dataplane`, fed frames built from scratch; the
//! action and the output frame are compared byte for byte with frames built
//! from scratch, so the program's incremental checksum updates are checked
//! against a full recomputation. Frames are built, parsed and their
//! checksums computed and verified by `lb-testkit` (the `etherparse` crate),
//! not by code of ours; network namespaces entered with `nix`.
//!
//! Each test runs in a thread that has entered its own network namespace
//! (`lb_tests::fixture`). Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_common::{NETDEV_F_GENERIC, NETDEV_F_XMIT_GENERIC, SlotKey as _};
use lb_testkit::{
    Frame, L4Checksum,
    frame::{
        ETH_LEN, IPV4_LEN, arp_request, icmp_echo, ipv6_tcp,
        tcp::{ACK, FIN, PSH, RST, SYN},
    },
};
use lb_tests::fixture::*;
use lb_userspace::{config::Protocol, dataplane::BackendRuntime, sched::Scheduler};

// ---------------------------------------------------------------- tests

#[test]
fn syn_to_vip_is_rewritten_to_the_backend_and_redirected() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let syn = tcp(CLIENT, 40000, VIP, 80, SYN);
        let (action, out) = fx.run(&syn.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let expected = Frame { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..syn.clone() };
        assert_eq!(out, expected.bytes(), "rewritten SYN differs from the expected bytes");
        assert_checksums_valid(&out);
        assert_eq!(fx.new_flows("web", BACKEND), 1);

        // The rest of the flow takes the same path without a new schedule.
        let ack = Frame { tcp_flags: ACK, ..syn.clone() };
        let (action, out) = fx.run(&ack.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Frame { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..ack }.bytes());
        assert_eq!(fx.new_flows("web", BACKEND), 1);
        assert_eq!(fx.counter("xdp_redirect"), 2);
        assert_eq!(fx.counter("kernel_egress") + fx.counter("fib_fallback") + fx.counter("csum_partial"), 0);
    });
}

/// The packet `p` as the datapath should leave it for the kernel: rewritten
/// to the backend, TTL and MACs as they came.
fn to_backend_unrouted(p: &Frame) -> Frame {
    Frame { dst: BACKEND, dport: 8080, ..p.clone() }
}

#[test]
fn an_egress_that_cannot_take_native_redirects_gets_the_kernel_path() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        // gwb transmits only redirects from generic XDP (a bridge, or a
        // veth whose peer has neither XDP nor GRO); gwa runs natively.
        fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
        let syn = tcp(CLIENT, 41000, VIP, 80, SYN);
        let (action, out) = fx.run(&syn.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS, "a native redirect into gwb would be dropped by the kernel");
        // Rewritten, but TTL and MACs untouched: the kernel forwards it and
        // decrements the TTL once.
        assert_eq!(out, to_backend_unrouted(&syn).bytes());
        assert_checksums_valid(&out);
        assert_eq!(fx.counter("kernel_egress"), 1);
        assert_eq!(fx.counter("xdp_redirect"), 0);
        // Not cached: the next packet asks again, and goes the same way.
        let ack = Frame { tcp_flags: ACK, ..syn.clone() };
        assert_eq!(fx.run(&ack.bytes(), fx.if_a).0, XDP_PASS);
        assert_eq!(fx.counter("kernel_egress"), 2);

        // With the program in generic mode on gwa, the same egress works.
        fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
        let (action, out) = fx.run(&ack.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(
            out,
            Frame { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..ack.clone() }.bytes()
        );
        assert_eq!(fx.counter("xdp_redirect"), 1);

        // A device lbd knows nothing about (or one that is down / not
        // Ethernet) takes no redirect at all.
        fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, 0);
        let other = tcp(CLIENT, 41001, VIP, 80, SYN);
        let (action, out) = fx.run(&other.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, to_backend_unrouted(&other).bytes());
        assert_eq!(fx.counter("kernel_egress"), 3);
    });
}

#[test]
fn a_device_change_makes_cached_next_hops_stale_at_once() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        // The flow's next hop is cached (for a second) while gwb takes
        // native redirects...
        let syn = tcp(CLIENT, 40999, VIP, 80, SYN);
        assert_eq!(fx.run(&syn.bytes(), fx.if_a).0, XDP_REDIRECT);
        // ...then gwb loses that (a veth whose peer's GRO went off): the
        // very next packet of the flow must not be redirected into it.
        fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
        let ack = Frame { tcp_flags: ACK, ..syn.clone() };
        let (action, out) = fx.run(&ack.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS, "a cached next hop outlived the device change");
        assert_eq!(out, to_backend_unrouted(&ack).bytes());
        assert_eq!((fx.counter("xdp_redirect"), fx.counter("kernel_egress")), (1, 1));
        // And back: redirected again.
        fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
        assert_eq!(fx.run(&ack.bytes(), fx.if_a).0, XDP_REDIRECT);
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
            for is_udp in [false, true] {
                port += 1;
                let base = if is_udp { udp(CLIENT, port, VIP, 53) } else { tcp(CLIENT, port, VIP, 80, SYN) };
                let p = Frame { payload: payload.clone(), l4_checksum: L4Checksum::Partial, ..base };
                let (dport, proto) = if is_udp { (5353, "udp") } else { (8080, "tcp") };

                // Native ingress, capable egress: leaves as an XDP frame, which
                // carries no "finish me" mark, so it must be finished here.
                fx.netdevs(0, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&p.bytes(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "{proto} payload {n}");
                let done = Frame {
                    dst: BACKEND,
                    dport,
                    ttl: 63,
                    dmac: BACKEND_MAC,
                    smac: GW_B_MAC,
                    l4_checksum: L4Checksum::Full,
                    ..p.clone()
                };
                assert_eq!(out, done.bytes(), "{proto} payload {n}: not finished correctly");
                assert_checksums_valid(&out);
                partial += 1;

                // Generic ingress: the skb keeps its mark, and the device
                // (or the kernel) finishes it: it stays unfinished, for the
                // rewritten addresses.
                let next = Frame { sport: p.sport + 10_000, ..p.clone() };
                fx.netdevs(NETDEV_F_GENERIC, XMIT_ALL, 0, XMIT_ALL);
                let (action, out) = fx.run(&next.bytes(), fx.if_a);
                assert_eq!(action, XDP_REDIRECT, "{proto} payload {n}");
                let kept = Frame { dst: BACKEND, dport, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..next.clone() };
                assert_eq!(
                    out,
                    kept.bytes(),
                    "{proto} payload {n}: unfinished checksum not kept for the new addresses"
                );
                partial += 1;

                // Native ingress, kernel path: the skb keeps its mark too.
                let third = Frame { sport: p.sport + 20_000, ..p.clone() };
                fx.netdevs(0, XMIT_ALL, 0, NETDEV_F_XMIT_GENERIC);
                let (action, out) = fx.run(&third.bytes(), fx.if_a);
                assert_eq!(action, XDP_PASS, "{proto} payload {n}");
                assert_eq!(out, Frame { dst: BACKEND, dport, ..third.clone() }.bytes(), "{proto} payload {n}");
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
        let mut p = Frame { payload: vec![0x55; 100], ..tcp(CLIENT, 43000, VIP, 80, ACK | PSH) };
        let seed = p.l4_seed();
        let found = (0..=u16::MAX).find(|&w| {
            p.payload[98..100].copy_from_slice(&w.to_be_bytes());
            p.full_l4_checksum() == seed
        });
        assert!(found.is_some(), "no payload word gives the colliding checksum");
        assert_checksums_valid(&p.bytes());
        // The parser takes it for finished too (it checks the full sum first).
        assert_eq!(Frame::parse(&p.bytes()).unwrap().l4_checksum, L4Checksum::Full);
        // Not a new flow (ACK without SYN is still scheduled, as a mid-flow packet).
        let (action, out) = fx.run(&p.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Frame { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..p }.bytes());
        assert_checksums_valid(&out);
        assert_eq!(fx.counter("csum_partial"), 0);
    });
}

#[test]
fn reply_from_backend_is_rewritten_back_to_the_vip() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let (action, _) = fx.run(&tcp(CLIENT, 40001, VIP, 80, SYN).bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let synack = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..tcp(BACKEND, 8080, CLIENT, 40001, SYN | ACK) };
        let (action, out) = fx.run(&synack.bytes(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        let expected = Frame { src: VIP, sport: 80, ttl: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..synack };
        assert_eq!(out, expected.bytes(), "rewritten reply differs from the expected bytes");
        assert_checksums_valid(&out);
    });
}

#[test]
fn a_flow_is_one_entry_unless_its_backend_endpoint_is_shared_and_replies_find_their_vip() {
    in_netns(|| {
        // web and alt share 10.20.0.11:8080 (web, first, owns it); other
        // has an endpoint of its own.
        let mut fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("alt", 81, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("other", 82, Protocol::Tcp, &[(BACKEND, 9090)]),
        ]);
        let entries = |fx: &mut Fixture| {
            let now = lb_userspace::dataplane::monotonic_coarse_secs();
            let r = fx.dp.sweep(now, u64::MAX / 2, u64::MAX / 2).unwrap();
            assert_eq!(r.removed, 0);
            r.entries
        };
        let from_backend = |port: u16, cport: u16, flags: u8| Frame {
            dmac: GW_B_MAC,
            smac: BACKEND_MAC,
            ..tcp(BACKEND, port, CLIENT, cport, flags)
        };
        let reply_src = |fx: &Fixture, f: &Frame| {
            let (action, out) = fx.run(&f.bytes(), fx.if_b);
            assert_eq!(action, XDP_REDIRECT, "reply to {}", f.dport);
            assert_checksums_valid(&out);
            let got = Frame::parse(&out).unwrap();
            assert_eq!((got.dst, got.dport, got.dmac), (CLIENT, f.dport, CLIENT_MAC));
            (got.src, got.sport)
        };
        let key = |src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16| lb_common::FlowKey {
            src_addr: u32::from_ne_bytes(src.octets()),
            dst_addr: u32::from_ne_bytes(dst.octets()),
            src_port: sport.to_be(),
            dst_port: dport.to_be(),
            proto: lb_common::PROTO_TCP,
            _pad: [0; 3],
        };
        // alt's client port: one whose first slot is neither web's flow's
        // nor the slot just before it, where alt's forward entry would
        // have to go past web's entry (its reply entry taking the first
        // slot), the two no longer side by side (1 seed in 2,048 with any
        // one port).
        let mask = lb_common::flow_slots(1024) - 1;
        let seed = fx.dp.flow_seed();
        let first = |p: u16| key(CLIENT, p, VIP, 81).slot_hash(seed) as u32 & mask;
        let web_first = key(CLIENT, 41000, VIP, 80).slot_hash(seed) as u32 & mask;
        let alt_port = (41_001..41_900)
            .find(|&p| p != 41_002 && first(p) != web_first && (first(p) + 1) & mask != web_first)
            .unwrap();
        assert_eq!(fx.forward(&tcp(CLIENT, 41000, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(entries(&mut fx), 1, "a flow of a service owning its endpoints is one entry");
        assert_eq!(fx.forward(&tcp(CLIENT, alt_port, VIP, 81, SYN).bytes()), BACKEND);
        assert_eq!(entries(&mut fx), 3, "a flow of the service that shares the endpoint keeps a reply entry");
        // The reply entry is keyed by the backend's 5-tuple, marked as a
        // reply key, and sits in the slot beside its forward entry (its
        // probes start on the client's side): the second insert of the
        // flow touches memory the first had just read.
        let fwd = fx.dp.flow_slot(&key(CLIENT, alt_port, VIP, 81)).unwrap().expect("the forward entry");
        let rev = fx.dp.flow_slot(&key(BACKEND, 8080, CLIENT, alt_port).reply()).unwrap().expect("the reply entry");
        assert_eq!(fx.dp.flow_slot(&key(BACKEND, 8080, CLIENT, alt_port)).unwrap(), None, "an unmarked reply key");
        assert_eq!(rev, first(alt_port), "the reply entry is not in its first slot");
        assert_eq!((rev + 1) & mask, fwd, "the reply entry is not beside its forward entry");
        assert_eq!(fx.forward(&tcp(CLIENT, 41002, VIP, 82, SYN).bytes()), BACKEND);
        assert_eq!(entries(&mut fx), 4);
        // Each reply gets its own service's VIP port back.
        assert_eq!(reply_src(&fx, &from_backend(8080, 41000, SYN | ACK)), (VIP, 80));
        assert_eq!(reply_src(&fx, &from_backend(8080, alt_port, SYN | ACK)), (VIP, 81));
        assert_eq!(reply_src(&fx, &from_backend(9090, 41002, SYN | ACK)), (VIP, 82));
        // A backend packet whose flow has no entry (routed without one,
        // or expired) goes back as from the VIP its endpoint's owner has,
        // without an entry, and is counted.
        assert_eq!(fx.counter("stateless_reply"), 0);
        assert_eq!(reply_src(&fx, &from_backend(8080, 41999, ACK)), (VIP, 80));
        assert_eq!(fx.counter("stateless_reply"), 1);
        assert_eq!(entries(&mut fx), 4, "a stateless reply makes no entry");
        // ... but not a backend's answer to the gateway itself (a health
        // probe's SYN-ACK): that is the kernel's, untouched.
        let probe = Frame { dst: Ipv4Addr::new(10, 20, 0, 1), ..from_backend(8080, 41998, SYN | ACK) }.bytes();
        assert_eq!(fx.run(&probe, fx.if_b), (XDP_PASS, probe.clone()));
        assert_eq!(fx.counter("stateless_reply"), 1);
        // Closes are tracked from both sides on both kinds of flow.
        let id = |svc: &str| {
            let s = fx.dp.services().find(|s| s.config.name == svc).unwrap();
            s.backends[0].id
        };
        let (web, alt) = (id("web"), id("alt"));
        assert_eq!((fx.dp.active_flows(web).unwrap(), fx.dp.active_flows(alt).unwrap()), (1, 1));
        for (vport, cport) in [(80, 41000), (81, alt_port)] {
            assert_eq!(fx.run(&tcp(CLIENT, cport, VIP, vport, FIN | ACK).bytes(), fx.if_a).0, XDP_REDIRECT);
            assert_eq!(reply_src(&fx, &from_backend(8080, cport, FIN | ACK)), (VIP, vport));
        }
        assert_eq!((fx.dp.active_flows(web).unwrap(), fx.dp.active_flows(alt).unwrap()), (0, 0));
        // Expiring every flow removes 3 flows, 4 entries (alt's reply entry).
        let later = lb_userspace::dataplane::monotonic_coarse_secs() + 100_000;
        let r = fx.dp.sweep(later, 1, 1).unwrap();
        assert_eq!((r.entries, r.removed, r.entries_removed), (4, 3, 4), "{r:?}");
        assert_eq!(entries(&mut fx), 0);
    });
}

/// A flow of a service that shares its backend endpoints keeps a reply
/// entry keyed by its backend's side. When the client reuses the tuple
/// for a new connection that round robin sends to another backend, the
/// new entry replaces the forward entry in place and makes a reply entry
/// of its own: the old reply entry is named by no forward entry any
/// more, and nothing removed it (it held its room in the table for
/// good). The sweeper removes it once two sweeps found it so, and never
/// a live flow's.
#[test]
fn a_reply_entry_left_behind_by_a_reused_tuple_is_removed_by_the_sweeper() {
    in_netns(|| {
        let two = [(BACKEND, 8080), (THIRD, 8080)];
        let mut fx = Fixture::new(vec![
            service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &two),
            service_with("alt", 81, Protocol::Tcp, Scheduler::Rr, &two),
        ]);
        let cport = 47_000;
        let syn = |seq| Frame { seq, ..tcp(CLIENT, cport, VIP, 81, SYN) }.bytes();
        let to = |fx: &Fixture, f: &[u8]| {
            let (action, out) = fx.run(f, fx.if_a);
            let dst = Frame::parse(&out).unwrap().dst;
            assert_eq!(action, if dst == BACKEND { XDP_REDIRECT } else { XDP_PASS }, "to {dst}");
            dst
        };
        let first = to(&fx, &syn(1));
        assert_eq!(to(&fx, &tcp(CLIENT, cport, VIP, 81, RST).bytes()), first);
        let second = to(&fx, &syn(2));
        assert_ne!(second, first, "round robin: the new connection's backend");
        let reply_key = |b: Ipv4Addr| {
            lb_common::FlowKey::new(
                u32::from_ne_bytes(b.octets()),
                u32::from_ne_bytes(CLIENT.octets()),
                8080u16.to_be(),
                cport.to_be(),
                lb_common::PROTO_TCP,
            )
            .reply()
        };
        assert!(fx.dp.flow_slot(&reply_key(first)).unwrap().is_some(), "the old reply entry");
        assert!(fx.dp.flow_slot(&reply_key(second)).unwrap().is_some(), "the new reply entry");
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let r = fx.dp.sweep(now, u64::MAX / 2, u64::MAX / 2).unwrap();
        assert_eq!((r.entries, r.entries_removed), (3, 0), "found once, kept: {r:?}");
        let r = fx.dp.sweep(now, u64::MAX / 2, u64::MAX / 2).unwrap();
        assert_eq!((r.entries, r.removed, r.orphans_removed, r.entries_removed), (3, 0, 1, 1), "{r:?}");
        assert_eq!(fx.dp.flow_slot(&reply_key(first)).unwrap(), None, "the old reply entry stayed");
        // The live flow keeps both its entries, sweep after sweep, and its
        // backend's answers go back from its service's VIP port.
        for _ in 0..3 {
            assert_eq!(fx.entries(), 2);
        }
        let answer = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..tcp(second, 8080, CLIENT, cport, SYN | ACK) };
        let (action, out) = fx.run(&answer.bytes(), fx.if_b);
        let got = Frame::parse(&out).unwrap();
        assert_eq!((action, got.src, got.sport), (XDP_REDIRECT, VIP, 81));
        let later = lb_userspace::dataplane::monotonic_coarse_secs() + 100_000;
        let r = fx.dp.sweep(later, 1, 1).unwrap();
        assert_eq!((r.removed, r.entries_removed), (1, 2), "{r:?}");
        assert_eq!(fx.entries(), 0);
    });
}

/// The reply-entry hint (a TCP SYN to a VIP with its bit loads its flow's
/// second slot early) names exactly the IPv4 TCP VIPs whose services keep
/// reply entries, port by port on one address, and follows the
/// configuration: a service that stops sharing its endpoint, or is
/// removed, takes its bit with it. A DSR service never keeps reply
/// entries.
#[test]
fn the_reply_entry_hint_names_the_vips_whose_flows_take_two_entries() {
    in_netns(|| {
        // One address: web (80) owns 10.20.0.11:8080 (listed first), alt
        // (81) shares it, other (82) has an endpoint of its own.
        let ports = [80, 81, 82];
        let bit = |port: u16| lb_common::reply_hint_bit(u32::from(VIP).to_be(), port.to_be());
        assert!(
            bit(80) != bit(81) && bit(81) != bit(82) && bit(80) != bit(82),
            "the test's three VIPs share a hint bit: pick other ports"
        );
        let web = service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]);
        let alt = service("alt", 81, Protocol::Tcp, &[(BACKEND, 8080)]);
        let other = service("other", 82, Protocol::Tcp, &[(BACKEND, 9090)]);
        let mut fx = Fixture::new(vec![web.clone(), alt.clone(), other.clone()]);
        let hinted = |fx: &Fixture| ports.map(|p| fx.dp.in_reply_hint(VIP, p).expect("read the reply-entry hint"));
        assert_eq!(hinted(&fx), [false, true, false], "only alt keeps reply entries");
        // Its flows do take two entries (web's one), and go both ways.
        assert_eq!(fx.forward(&tcp(CLIENT, 42000, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.entries(), 1);
        assert_eq!(fx.forward(&tcp(CLIENT, 42001, VIP, 81, SYN).bytes()), BACKEND);
        assert_eq!(fx.entries(), 3, "a flow of the service sharing the endpoint has a reply entry");
        let back = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..tcp(BACKEND, 8080, CLIENT, 42001, SYN | ACK) };
        let (action, out) = fx.run(&back.bytes(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        let got = Frame::parse(&out).unwrap();
        assert_eq!((got.src, got.sport), (VIP, 81), "alt's reply left as from another VIP");
        // By DSR, alt needs no reply entry: its bit goes.
        fx.dp.apply_admin(&[web.clone(), dsr(alt.clone()), other.clone()]).unwrap();
        assert_eq!(hinted(&fx), [false, false, false], "a DSR service keeps no reply entries");
        // alt alone owns the endpoint, no bit; with web back (listed
        // first, but alt keeps the endpoint it owns), web's VIP gets it.
        fx.dp.apply_admin(std::slice::from_ref(&alt)).unwrap();
        assert_eq!(hinted(&fx), [false, false, false], "alt owns its endpoint now");
        fx.dp.apply_admin(&[web, alt, other]).unwrap();
        assert_eq!(hinted(&fx), [true, false, false], "web shares the endpoint alt owns");
        // Nothing configured: nothing hinted.
        fx.dp.apply_admin(&[]).unwrap();
        assert_eq!(hinted(&fx), [false, false, false]);
    });
}

/// A shared endpoint's forward entry goes to the slot after its reply
/// entry when that one is free, without probing again; when another
/// flow's entry is there, it goes on to the next free slot of its
/// sequence, and both are found.
#[test]
fn a_shared_endpoints_forward_entry_goes_past_a_taken_slot_beside_its_reply_entry() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("alt", 81, Protocol::Tcp, &[(BACKEND, 8080)]),
        ]);
        let mask = lb_common::flow_slots(1024) - 1;
        let seed = fx.dp.flow_seed();
        let addr = |a: Ipv4Addr| u32::from_ne_bytes(a.octets());
        let alt = |cport: u16| {
            lb_common::FlowKey::new(addr(CLIENT), addr(VIP), cport.to_be(), 81u16.to_be(), lb_common::PROTO_TCP)
        };
        let reply = |cport: u16| {
            lb_common::FlowKey::new(addr(BACKEND), addr(CLIENT), 8080u16.to_be(), cport.to_be(), lb_common::PROTO_TCP)
                .reply()
        };
        let first = |k: &lb_common::FlowKey| k.slot_hash(seed) as u32 & mask;
        // web's flow takes its first slot; alt's client port: one whose
        // first slot is just before it.
        assert_eq!(fx.forward(&tcp(CLIENT, 41000, VIP, 80, SYN).bytes()), BACKEND);
        let web_at = fx.dp.flow_slot(&key4(41000)).unwrap().expect("web's entry");
        assert_eq!(web_at, first(&key4(41000)));
        let taken = (1024..u16::MAX)
            .find(|&p| p != 41000 && (first(&alt(p)) + 1) & mask == web_at)
            .expect("a client port whose first slot is just before web's entry");
        // ... and one whose first two slots are free once that flow's
        // two entries are in (just before web's entry, and just after).
        let used = [web_at.wrapping_sub(1) & mask, web_at, (web_at + 1) & mask];
        let free = (1024..u16::MAX)
            .find(|&p| {
                let f = first(&alt(p));
                !used.contains(&f) && !used.contains(&((f + 1) & mask))
            })
            .expect("a client port whose first two slots are free");
        for (cport, past) in [(taken, 2), (free, 1)] {
            assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 81, SYN).bytes()), BACKEND);
            let f = first(&alt(cport));
            assert_eq!(fx.dp.flow_slot(&reply(cport)).unwrap(), Some(f), "port {cport}: the reply entry");
            assert_eq!(
                fx.dp.flow_slot(&alt(cport)).unwrap(),
                Some((f + past) & mask),
                "port {cport}: the forward entry"
            );
            // The flow's next packet finds its entry, and so does the reply.
            assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 81, ACK).bytes()), BACKEND);
            let back = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..tcp(BACKEND, 8080, CLIENT, cport, SYN | ACK) };
            let (action, out) = fx.run(&back.bytes(), fx.if_b);
            assert_eq!(action, XDP_REDIRECT);
            let got = Frame::parse(&out).unwrap();
            assert_eq!((got.src, got.sport, got.dst, got.dport), (VIP, 81, CLIENT, cport));
        }
        assert_eq!(fx.dp.flow_slot(&key4(41000)).unwrap(), Some(web_at), "web's entry moved");
        assert_eq!(fx.entries(), 5, "web's flow, and two entries for each of alt's");
        assert_eq!(fx.counter("table_full"), 0);
    });
}

/// A new flow of a service sharing its backend's endpoint takes two
/// entries, its reply entry first. When the reply entry takes the table's
/// last room and the forward entry then finds none, the reply entry is
/// taken back: left, no sweep would ever remove it (the sweeper removes
/// a reply entry with its forward entry), and its room would be lost for
/// good.
#[test]
fn a_reply_entry_whose_flow_found_no_room_is_taken_back() {
    in_netns(|| {
        let mut fx = Fixture::with_config(
            vec![
                service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
                service("alt", 81, Protocol::Tcp, &[(BACKEND, 8080)]),
            ],
            |c| {
                c.conntrack_max = 3;
                c.flood.new_flow_rate_per_cpu = Some(0);
            },
        );
        // Two flows of web (the endpoint's owner): one entry each.
        for cport in [41000, 41001] {
            assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, SYN).bytes()), BACKEND);
        }
        assert_eq!(fx.dp.flow_counts().unwrap(), (2, 0));
        // alt's flow: its reply entry takes the third and last room, its
        // forward entry finds none; the SYN is dropped (such a flow cannot
        // go without entries) and the reply entry taken back.
        let syn = tcp(CLIENT, 41002, VIP, 81, SYN).bytes();
        assert_eq!(fx.run(&syn, fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("flow_table"), 1);
        assert_eq!(fx.dp.flow_counts().unwrap(), (2, 0), "the reply entry was left in the table");
        assert_eq!(fx.entries(), 2);
        // Its room is back: another flow of web gets an entry.
        assert_eq!(fx.forward(&tcp(CLIENT, 41003, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.dp.flow_counts().unwrap(), (3, 0));
        assert_eq!(fx.counter("table_full"), 0);
    });
}

#[test]
fn a_udp_service_with_its_own_idle_timeout_expires_its_flows_by_it() {
    in_netns(|| {
        // dns: 20 s of its own; syslog: the global 300 s (Fixture's config).
        let mut dns = service("dns", 53, Protocol::Udp, &[(BACKEND, 5353)]);
        dns.udp_idle_timeout = Some(20);
        let mut fx = Fixture::new(vec![dns, service("syslog", 514, Protocol::Udp, &[(BACKEND, 5514)])]);
        // Both flows established: the client speaks again after a reply
        // (one-way flows are half-open and go after 10 s, tested apart).
        for (cport, vport, bport) in [(41000, 53, 5353), (41001, 514, 5514)] {
            assert_eq!(fx.forward(&udp(CLIENT, cport, VIP, vport).bytes()), BACKEND);
            let reply = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..udp(BACKEND, bport, CLIENT, cport) };
            assert_eq!(fx.run(&reply.bytes(), fx.if_b).0, XDP_REDIRECT);
            assert_eq!(fx.forward(&udp(CLIENT, cport, VIP, vport).bytes()), BACKEND);
        }
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let r = fx.dp.sweep(now + 100, 900, 300).unwrap();
        assert_eq!((r.entries, r.expired), (2, 1), "100 s idle: only dns's flow is past its timeout: {r:?}");
        let r = fx.dp.sweep(now + 400, 900, 300).unwrap();
        assert_eq!((r.entries, r.expired), (1, 1), "400 s idle: syslog's flow too: {r:?}");
    });
}

#[test]
fn a_flows_idle_clock_is_the_coarse_monotonic_second_as_it_moves() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let key = lb_common::FlowKey {
            src_addr: u32::from_ne_bytes(CLIENT.octets()),
            dst_addr: u32::from_ne_bytes(VIP.octets()),
            src_port: 40007u16.to_be(),
            dst_port: 80u16.to_be(),
            proto: lb_common::PROTO_TCP,
            _pad: [0; 3],
        };
        let clock = lb_userspace::dataplane::monotonic_coarse_secs;
        // The datapath keeps the second it read for the rest of the jiffy
        // (a per-CPU cache): every packet must still stamp its flow with
        // the second in force, the first and the ones after the clock has
        // moved on.
        let mut last = 0;
        for (round, flags) in [SYN, ACK, ACK].into_iter().enumerate() {
            if round > 0 {
                // Into the next second of the coarse clock.
                let start = clock();
                while clock() == start {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
            let before = clock();
            assert_eq!(fx.run(&tcp(CLIENT, 40007, VIP, 80, flags).bytes(), fx.if_a).0, XDP_REDIRECT);
            let after = clock();
            let seen = fx.dp.flow(&key).unwrap().expect("the flow's entry").last_seen;
            assert!(
                (before..=after).contains(&seen) && seen > last,
                "packet {round}: last_seen {seen}, the clock read {before}..={after}, the packet before {last}"
            );
            last = seen;
        }
    });
}

#[test]
fn packets_not_for_a_vip_pass_unchanged() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let mut frames = vec![
            // Other address, other port on the VIP, other protocol on the VIP port.
            tcp(CLIENT, 40000, Ipv4Addr::new(10, 10, 0, 7), 80, SYN).bytes(),
            tcp(CLIENT, 40000, VIP, 81, SYN).bytes(),
            udp(CLIENT, 40000, VIP, 80).bytes(),
        ];
        // ARP request for the VIP.
        frames.push(arp_request(CLIENT_MAC, CLIENT, VIP));
        // IPv6 TCP SYN.
        let (v6_client, v6_vip) =
            (Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1), Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x64));
        frames.push(ipv6_tcp((GW_A_MAC, CLIENT_MAC), (v6_client, 40000), (v6_vip, 80), SYN, &[]));
        // ICMP echo to the VIP.
        frames.push(icmp_echo(GW_A_MAC, CLIENT_MAC, CLIENT, VIP));
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
        let fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("dns", 53, Protocol::Udp, &[(BACKEND, 5353)]),
        ]);
        let full = tcp(CLIENT, 40000, VIP, 80, SYN).bytes();
        // Cut inside the TCP header; the IP total length still claims the whole packet.
        let truncated = full[..ETH_LEN + IPV4_LEN + 10].to_vec();
        // Whole frame, but the IP header claims more than is there.
        let mut long = full.clone();
        let claimed = (full.len() - ETH_LEN + 40) as u16;
        long[ETH_LEN + 2..ETH_LEN + 4].copy_from_slice(&claimed.to_be_bytes());
        // IHL below 5.
        let mut bad_ihl = full.clone();
        bad_ihl[ETH_LEN] = 0x44;
        // IPv4 header checksum off by one (the kernel drops these; a
        // rewrite would carry the error on).
        let mut bad_ip_sum = full.clone();
        bad_ip_sum[ETH_LEN + 11] ^= 1;
        // TCP data offset below 5 words, and beyond the segment.
        let (mut short_doff, mut long_doff) = (full.clone(), full.clone());
        short_doff[ETH_LEN + IPV4_LEN + 12] = 0x40;
        long_doff[ETH_LEN + IPV4_LEN + 12] = 0xf0;
        // UDP length below its header, and beyond the IP payload.
        let dgram = Frame { payload: b"query".to_vec(), ..udp(CLIENT, 5000, VIP, 53) }.bytes();
        let (mut udp_short, mut udp_long) = (dgram.clone(), dgram.clone());
        udp_short[ETH_LEN + IPV4_LEN + 4..ETH_LEN + IPV4_LEN + 6].copy_from_slice(&7u16.to_be_bytes());
        udp_long[ETH_LEN + IPV4_LEN + 4..ETH_LEN + IPV4_LEN + 6].copy_from_slice(&14u16.to_be_bytes());
        assert_eq!(fx.run(&dgram, fx.if_a).0, XDP_REDIRECT, "the valid datagram is forwarded");
        let broken = [truncated, long, bad_ihl, bad_ip_sum, short_doff, long_doff, udp_short, udp_long];
        for (i, f) in broken.into_iter().enumerate() {
            let (action, _) = fx.run(&f, fx.if_a);
            assert_eq!(action, XDP_DROP, "broken frame {i} must be dropped");
            assert_eq!(fx.counter("malformed"), i as u64 + 1);
        }
        // A fragment of a packet to the VIP has no ports: dropped, counted apart.
        let frag = Frame { dont_fragment: false, more_fragments: true, ..tcp(CLIENT, 40000, VIP, 80, SYN) }.bytes();
        assert_eq!(fx.run(&frag, fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("fragment"), 1);
        // Nothing was scheduled or forwarded.
        assert_eq!(fx.new_flows("web", BACKEND), 0);
        // The same truncation to a non-VIP address is the kernel's business.
        let mut other = tcp(CLIENT, 40000, Ipv4Addr::new(10, 10, 0, 7), 80, SYN).bytes();
        other.truncate(ETH_LEN + IPV4_LEN + 10);
        assert_eq!(fx.run(&other, fx.if_a).0, XDP_PASS);
        assert_eq!(fx.counter("malformed"), 8);
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
        let opt = Frame { ip_options: vec![1, 1, 1, 0], ..tcp(CLIENT, 40002, VIP, 80, SYN) };
        let (action, out) = fx.run(&opt.bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(out, Frame { dst: BACKEND, dport: 8080, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..opt }.bytes());
        assert_checksums_valid(&out);

        // UDP with a checksum and without one.
        for no_csum in [false, true] {
            let csum = if no_csum { L4Checksum::None } else { L4Checksum::Full };
            let q = Frame { l4_checksum: csum, ..udp(CLIENT, 5000 + u16::from(no_csum), VIP, 53) };
            let (action, out) = fx.run(&q.bytes(), fx.if_a);
            assert_eq!(action, XDP_REDIRECT);
            let expected = Frame { dst: BACKEND, dport: 5353, ttl: 63, dmac: BACKEND_MAC, smac: GW_B_MAC, ..q };
            assert_eq!(out, expected.bytes());
            assert_checksums_valid(&out);
            // Reply back through the VIP.
            let r = Frame {
                dmac: GW_B_MAC,
                smac: BACKEND_MAC,
                l4_checksum: csum,
                ..udp(BACKEND, 5353, CLIENT, 5000 + u16::from(no_csum))
            };
            let (action, out) = fx.run(&r.bytes(), fx.if_b);
            assert_eq!(action, XDP_REDIRECT);
            assert_eq!(out, Frame { src: VIP, sport: 53, ttl: 63, dmac: CLIENT_MAC, smac: GW_A_MAC, ..r }.bytes());
        }

        // No neighbour entry for the backend: rewritten, handed to the kernel
        // (TTL and MACs untouched: the kernel forwards and decrements).
        let cold = tcp(CLIENT, 40003, VIP, 81, SYN);
        let (action, out) = fx.run(&cold.bytes(), fx.if_a);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, Frame { dst: BACKEND_UNRESOLVED, dport: 8080, ..cold }.bytes());
        assert_checksums_valid(&out);
        assert_eq!(fx.counter("fib_fallback"), 1);
        assert_eq!(fx.new_flows("cold", BACKEND_UNRESOLVED), 1);
    });
}

#[test]
fn expiring_ttl_goes_to_the_kernel_untouched() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let f = Frame { ttl: 1, ..tcp(CLIENT, 40004, VIP, 80, SYN) }.bytes();
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
        let c = |flags| tcp(CLIENT, 40005, VIP, 80, flags).bytes();
        let b = |flags| Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..tcp(BACKEND, 8080, CLIENT, 40005, flags) }.bytes();
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

/// A SYN on an established flow whose close the datapath did not see
/// (the client reused the tuple; a FIN went another way): a new connection,
/// counted as one, on the entry's backend, which round robin would not
/// have picked again (so a forged SYN cannot move a live connection).
#[test]
fn a_syn_on_an_established_flow_is_a_new_connection_on_the_same_backend() {
    in_netns(|| {
        let mut fx = rr_fixture_with_table(64);
        let counted = |fx: &Fixture| RR_BACKENDS.map(|(a, _)| fx.new_flows("web", a));
        let b = handshake(&fx, 40_100, 80, 8080);
        let first = counted(&fx);
        assert_eq!(first.iter().sum::<u64>(), 1);
        assert_eq!(fx.active_flows("web"), 1);
        // Only the client's FIN passes this gateway.
        assert_eq!(fx.forward(&tcp(CLIENT, 40_100, VIP, 80, FIN | ACK).bytes()), b);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_100, VIP, 80, ACK).bytes()), b);
        assert_eq!(fx.active_flows("web"), 1, "half closed is still active");
        // The same tuple's SYN: the same backend, counted once more; the
        // old connection is closed, so one flow is active.
        assert_eq!(fx.forward(&tcp(CLIENT, 40_100, VIP, 80, SYN).bytes()), b, "reused tuple");
        let i = RR_BACKENDS.iter().position(|x| x.0 == b).unwrap();
        let mut want = first;
        want[i] += 1;
        assert_eq!(counted(&fx), want);
        assert_eq!(fx.active_flows("web"), 1);
        // Its retransmission is the same connection.
        assert_eq!(fx.forward(&tcp(CLIENT, 40_100, VIP, 80, SYN).bytes()), b);
        assert_eq!(counted(&fx), want);
        // A reopened entry is no half-open flow: past the half-open
        // timeout (10 s) the sweeper leaves it, so a forged SYN cannot get
        // an idle connection's entry expired early.
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let r = fx.dp.sweep(now + 11, 900, 300).unwrap();
        assert_eq!((r.removed, r.expired), (0, 0), "{r:?}");
        assert_eq!(fx.entries(), 1);
        // The handshake completes as a fresh one's, and both FINs close it.
        assert_eq!(fx.run(&from_backend(b, 8080, 40_100, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_100, VIP, 80, ACK).bytes()), b);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_100, VIP, 80, FIN | ACK).bytes()), b);
        assert_eq!(fx.run(&from_backend(b, 8080, 40_100, FIN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.active_flows("web"), 0);
        assert_eq!(counted(&fx), want);
    });
}

/// A SYN on a half-open entry with another sequence number than the
/// entry's own SYN: the client gave up that handshake (a connect timeout,
/// no answer) and reused the tuple. A new connection, counted as one, on
/// the entry's backend; the old handshake is counted closed, so one flow
/// stays active. The retransmissions of either SYN are not counted again,
/// also after a reopen. A migration's half-open copy (older layouts kept
/// no sequence byte) takes any SYN for a retransmission.
#[test]
fn a_syn_with_another_sequence_number_on_a_half_open_flow_is_a_new_connection() {
    in_netns(|| {
        let fx = rr_fixture_with_table(64);
        let counted = |fx: &Fixture| RR_BACKENDS.map(|(a, _)| fx.new_flows("web", a)).iter().sum::<u64>();
        let syn = |port, seq| Frame { seq, ..tcp(CLIENT, port, VIP, 80, SYN) }.bytes();
        let b = fx.forward(&syn(40_150, 7_000));
        assert_eq!((counted(&fx), fx.active_flows("web")), (1, 1));
        // Its retransmission: the same connection.
        assert_eq!(fx.forward(&syn(40_150, 7_000)), b);
        assert_eq!(counted(&fx), 1);
        // The backend answered, the client never finished the handshake,
        // then opened another connection on the tuple: the same backend,
        // counted, and still one active flow.
        assert_eq!(fx.run(&from_backend(b, 8080, 40_150, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.forward(&syn(40_150, 9_001)), b, "the entry's backend");
        assert_eq!((counted(&fx), fx.active_flows("web")), (2, 1));
        assert_eq!(fx.forward(&syn(40_150, 9_001)), b);
        assert_eq!(counted(&fx), 2, "the new SYN's retransmission");
        // Its handshake starts over: the old connection's answer does not
        // count for it, so the client's ACK alone does not establish it.
        let state = |fx: &Fixture| fx.dp.flow(&key4(40_150)).unwrap().expect("an entry").state;
        assert_eq!(fx.forward(&tcp(CLIENT, 40_150, VIP, 80, ACK).bytes()), b);
        assert_eq!(state(&fx) & lb_common::FLOW_ESTABLISHED, 0, "{:#x}", state(&fx));
        assert_eq!(fx.run(&from_backend(b, 8080, 40_150, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_150, VIP, 80, ACK).bytes()), b);
        assert_ne!(state(&fx) & lb_common::FLOW_ESTABLISHED, 0, "{:#x}", state(&fx));
        // A reopen of the established flow keeps its SYN's byte: that
        // SYN's retransmission is not counted; another SYN on the reopened
        // (half-open) entry is.
        assert_eq!(fx.forward(&syn(40_150, 12_002)), b);
        assert_eq!(counted(&fx), 3);
        assert_eq!(fx.forward(&syn(40_150, 12_002)), b);
        assert_eq!(counted(&fx), 3, "the reopening SYN's retransmission");
        assert_eq!(fx.forward(&syn(40_150, 12_003)), b);
        assert_eq!((counted(&fx), fx.active_flows("web")), (4, 1));
        // Still reopened: not expired early as half-open (see
        // a_syn_on_an_established_flow_is_a_new_connection_on_the_same_backend).
        assert_ne!(state(&fx) & lb_common::FLOW_REOPENED, 0, "{:#x}", state(&fx));
        // A half-open first copy of a migration: any SYN is its own.
        let c = fx.forward(&syn(40_151, 5_000));
        assert_eq!(counted(&fx), 5);
        first_copy(&fx, [40_151]);
        assert_eq!(fx.forward(&syn(40_151, 5_077)), c);
        assert_eq!((counted(&fx), fx.active_flows("web")), (5, 2));
    });
}

/// A flow re-dispatched because its backend went down belongs to its new
/// backend. The old backend's late packets (an answer it retransmits, its
/// FIN) are replies of nothing: dropped and counted, never passed on to
/// the client with the backend's own address as their source.
#[test]
fn a_down_backends_late_packets_for_a_re_dispatched_flow_are_dropped_not_leaked() {
    in_netns(|| {
        let mut fx = rr_fixture_with_table(64);
        let old = handshake(&fx, 40_200, 80, 8080);
        let services = vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &RR_BACKENDS)];
        let down = IpAddr::from(old);
        fx.dp
            .apply(&services, &|_, b| BackendRuntime {
                weight: if b.address == down { 0 } else { b.admin_weight() },
                down: b.address == down,
            })
            .unwrap();
        // The client's next packet is re-dispatched to a live backend.
        let new = fx.forward(&tcp(CLIENT, 40_200, VIP, 80, PSH | ACK).bytes());
        assert_ne!(new, old, "re-dispatched");
        assert_eq!(fx.counter("stale_backend"), 0);
        for flags in [PSH | ACK, FIN | ACK] {
            let late = from_backend(old, 8080, 40_200, flags).bytes();
            assert_eq!(fx.run(&late, fx.if_b), (XDP_DROP, late.clone()), "the old backend's {flags:#x}");
        }
        assert_eq!(fx.counter("stale_backend"), 2);
        // The new backend's answer is the flow's reply, from the VIP.
        let (action, out) = fx.run(&from_backend(new, 8080, 40_200, ACK).bytes(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        let got = Frame::parse(&out).unwrap();
        assert_eq!((got.src, got.sport, got.dst, got.dport), (VIP, 80, CLIENT, 40_200));
        // The old backend's packet for a client with no flow at all is
        // still a stateless reply (its flow was routed without an entry).
        let (action, out) = fx.run(&from_backend(old, 8080, 40_201, ACK).bytes(), fx.if_b);
        assert_eq!((action, Frame::parse(&out).unwrap().src), (XDP_REDIRECT, VIP));
        assert_eq!((fx.counter("stale_backend"), fx.counter("stateless_reply")), (2, 1));
    });
}

/// Mark `down` (and only those) of the round-robin fixture's backends
/// down, as the health checks do.
fn set_down(fx: &mut Fixture, down: &[Ipv4Addr]) {
    let services = vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &RR_BACKENDS)];
    let down: Vec<IpAddr> = down.iter().map(|&a| IpAddr::from(a)).collect();
    fx.dp
        .apply(&services, &|_, b| BackendRuntime {
            weight: if down.contains(&b.address) { 0 } else { b.admin_weight() },
            down: down.contains(&b.address),
        })
        .unwrap();
}

/// The connection counts of the round-robin fixture's backend `b`:
/// (opened, closed, expired).
fn counts_of(fx: &Fixture, b: Ipv4Addr) -> (u64, u64, u64) {
    let s = fx.dp.services().find(|s| s.config.name == "web").unwrap();
    let id = s.backends.iter().find(|x| x.config.address == IpAddr::from(b)).unwrap().id;
    fx.dp.connection_counts(id).unwrap()
}

/// A flow whose backend went down is counted closed on that backend once,
/// when a new entry on a live backend replaces its entry. While there is
/// no live backend to take it, its packets are dropped and nothing is
/// counted: when its backend comes back, the flow goes on, still active
/// (each such packet used to count it closed again, and the backend's
/// count then stayed below its flows: least-conn sent it more).
#[test]
fn a_flow_whose_backend_went_down_is_counted_closed_once() {
    in_netns(|| {
        let mut fx = rr_fixture_with_table(64);
        let old = handshake(&fx, 40_300, 80, 8080);
        assert_eq!(counts_of(&fx, old), (1, 0, 0));
        set_down(&mut fx, &[old]);
        let new = fx.forward(&tcp(CLIENT, 40_300, VIP, 80, PSH | ACK).bytes());
        assert_ne!(new, old, "re-dispatched");
        assert_eq!(fx.forward(&tcp(CLIENT, 40_300, VIP, 80, PSH | ACK).bytes()), new);
        assert_eq!(counts_of(&fx, old), (1, 1, 0), "the old backend's flow closed, once");
        assert_eq!(counts_of(&fx, new), (1, 0, 0), "and opened on its new backend");
        assert_eq!(fx.active_flows("web"), 1);

        // Every backend down: the flow's packets are dropped, and it stays
        // active on its backend.
        let all: Vec<Ipv4Addr> = RR_BACKENDS.iter().map(|b| b.0).collect();
        set_down(&mut fx, &all);
        let ack = tcp(CLIENT, 40_300, VIP, 80, PSH | ACK).bytes();
        for _ in 0..3 {
            assert_eq!(fx.run(&ack, fx.if_a).0, XDP_DROP);
        }
        assert_eq!(fx.counter("no_backend"), 3);
        assert_eq!(counts_of(&fx, new), (1, 0, 0), "no live backend took the flow: nothing counted");
        set_down(&mut fx, &[]);
        assert_eq!(fx.forward(&ack), new, "the flow goes on on its backend");
        assert_eq!(fx.active_flows("web"), 1);
        // A second flow, then both reset: every count comes back to none.
        let other = handshake(&fx, 40_301, 80, 8080);
        assert_eq!(fx.active_flows("web"), 2);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_300, VIP, 80, RST).bytes()), new);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_301, VIP, 80, RST).bytes()), other);
        assert_eq!(fx.active_flows("web"), 0);
        assert_eq!(fx.connection_counts("web"), (3, 3, 0));
    });
}

/// While the sweeper has an entry marked for removal
/// (`lb_common::FLOW_DOOMED`, between its check of the entry and its swap
/// of the slot's claim), the entry's close is the sweeper's to count:
/// the datapath counts no close of it, neither a reset's nor that of the
/// new entry that replaces it. A SYN takes its tuple up as a new flow,
/// counted as one. (The sweeper's side, which counts the close when its
/// removal goes through or its mark comes off a closed or replaced entry,
/// runs inside one program run and is exercised by the race tests below,
/// which check that every connection opened is counted closed or expired
/// exactly once.)
#[test]
fn an_entry_the_sweeper_has_marked_leaves_its_close_to_the_sweeper() {
    in_netns(|| {
        let fx = rr_fixture_with_table(64);
        let syn = |port, seq| Frame { seq, ..tcp(CLIENT, port, VIP, 80, SYN) }.bytes();
        // A half-open flow, marked: a new connection on its tuple.
        fx.forward(&syn(40_400, 1));
        assert!(fx.dp.set_flow_state_bits(&key4(40_400), lb_common::FLOW_DOOMED).unwrap());
        let new_flows = |fx: &Fixture| RR_BACKENDS.map(|(a, _)| fx.new_flows("web", a)).iter().sum::<u64>();
        fx.forward(&syn(40_400, 2));
        let f = fx.dp.flow(&key4(40_400)).unwrap().expect("the new connection's entry");
        assert_eq!(f.state & lb_common::FLOW_DOOMED, 0, "a new entry in the marked one's place: {:#x}", f.state);
        assert_eq!(f.syn_seq, 2);
        assert_eq!(new_flows(&fx), 2);
        assert_eq!(fx.connection_counts("web"), (2, 0, 0), "the marked entry's close is the sweeper's");
        // An established flow, marked, then reset: no close counted.
        let b = handshake(&fx, 40_401, 80, 8080);
        assert!(fx.dp.set_flow_state_bits(&key4(40_401), lb_common::FLOW_DOOMED).unwrap());
        assert_eq!(fx.forward(&tcp(CLIENT, 40_401, VIP, 80, RST).bytes()), b);
        assert_eq!(fx.connection_counts("web"), (3, 0, 0), "the marked entry's close is the sweeper's");
        // Unmarked, the same reset on another flow is counted at once.
        let c = handshake(&fx, 40_402, 80, 8080);
        assert_eq!(fx.forward(&tcp(CLIENT, 40_402, VIP, 80, RST).bytes()), c);
        assert_eq!(fx.connection_counts("web"), (4, 1, 0));
    });
}

#[test]
fn a_service_without_backends_drops_new_flows_and_counts_them() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[])]);
        let f = tcp(CLIENT, 40006, VIP, 80, SYN).bytes();
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
            let f = tcp(CLIENT, port, VIP, 80, SYN).bytes();
            let dst = fx.forward(&f);
            for _ in 0..3 {
                assert_eq!(fx.forward(&tcp(CLIENT, port, VIP, 80, ACK).bytes()), dst);
            }
            *seen.entry(dst).or_insert(0u32) += 1;
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        for (b, n) in &seen {
            assert!((70..=130).contains(n), "backend {b} got {n} of 300 flows: {seen:?}");
        }
    });
}

/// A client reuses its address and port for the service that shares an
/// endpoint right after its connection to the endpoint's owner closed
/// (its entry lingers), and the new flow goes to the same backend: the
/// backend's SYN-ACK carries the same tuple as the closed flow's replies,
/// yet answers the new flow, and goes back as from that flow's VIP port,
/// as does every later reply of it. (It went as from the owner's: the
/// client reset it, and every retried SYN the same way, until the closed
/// entry was swept: a connect timeout, seen in the lab; with the SYN-ACK
/// alone mended, the answer to the request went as the owner's.)
#[test]
fn a_syn_ack_for_the_sharing_service_on_a_closed_owners_tuple_goes_back_as_the_sharing_service() {
    in_netns(|| {
        let mut fx = sharing_fixture();
        closed_connection(&fx, "web", 80);
        // The same client address and port to alt, on the same backend:
        // its SYN-ACK, and the rest of its replies (the closed flow was
        // retired from the backend's tuple by the SYN-ACK), go back as alt's.
        answered_as(&fx, ("alt", 81), "web");
        // The client's own late packet of web's closed flow (its last ACK,
        // retransmitted) still goes to web's backend endpoint, port and
        // all, as before the flow was retired.
        let (action, out) = fx.run(&tcp(CLIENT, 40_000, VIP, 80, ACK).bytes(), fx.if_a);
        assert_eq!(action, XDP_REDIRECT);
        let late = Frame::parse(&out).unwrap();
        assert_eq!((late.dst, late.dport), (BACKEND, 8080), "a retired flow's late packet");
        // The sweeper removes the retired flow once its linger is over, and
        // with it nothing of alt's: alt's replies still go back as alt's.
        let later = lb_userspace::dataplane::monotonic_coarse_secs() + 11;
        let r = fx.dp.sweep(later, u64::MAX / 2, u64::MAX / 2).unwrap();
        assert_eq!((r.removed, r.entries_removed), (1, 1), "{r:?}");
        assert_eq!(back_from_shared(&fx, ACK), (VIP, 81), "alt's reply after the retired flow was swept");
    });
}

/// The other way round: a client's connection to the sharing service
/// closed, and the same client address and port then connect to the
/// endpoint's owner, on the same backend, within the closed flow's
/// linger. The backend's SYN-ACK and replies go back as from the owner's
/// VIP port, not the sharing service's.
#[test]
fn a_syn_ack_for_the_owner_on_a_closed_sharing_flows_tuple_goes_back_as_the_owner() {
    in_netns(|| {
        let fx = sharing_fixture();
        closed_connection(&fx, "alt", 81);
        // The same client address and port to web, on the same backend.
        answered_as(&fx, ("web", 80), "alt");
    });
}

/// Two services, web (:80, the endpoint's owner) and alt (:81), sharing
/// one backend endpoint, BACKEND:8080.
fn sharing_fixture() -> Fixture {
    Fixture::new(vec![
        service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
        service("alt", 81, Protocol::Tcp, &[(BACKEND, 8080)]),
    ])
}

/// A packet from the shared endpoint to the client's port 40,000: the
/// address and port it goes back to the client from.
fn back_from_shared(fx: &Fixture, flags: u8) -> (Ipv4Addr, u16) {
    let (action, out) = fx.run(&from_backend(BACKEND, 8080, 40_000, flags).bytes(), fx.if_b);
    assert_eq!(action, XDP_REDIRECT);
    let got = Frame::parse(&out).unwrap();
    (got.src, got.sport)
}

/// A whole connection from the client's port 40,000 to `name` (VIP port
/// `vport`) of `sharing_fixture`, closed both ways.
fn closed_connection(fx: &Fixture, name: &str, vport: u16) {
    assert_eq!(handshake(fx, 40_000, vport, 8080), BACKEND);
    assert_eq!(back_from_shared(fx, FIN | ACK), (VIP, vport));
    assert_eq!(fx.forward(&tcp(CLIENT, 40_000, VIP, vport, FIN | ACK).bytes()), BACKEND);
    assert_eq!(fx.forward(&tcp(CLIENT, 40_000, VIP, vport, ACK).bytes()), BACKEND);
    assert_eq!(fx.active_flows(name), 0, "{name}'s flow is not closed");
}

/// A new connection from the client's port 40,000 to `name` (VIP port
/// `vport`) of `sharing_fixture`, right after one to `other` closed: its
/// SYN-ACK, its answer and its FIN go back as from `vport`, not `other`'s;
/// it is active, and nothing was dropped as stale.
fn answered_as(fx: &Fixture, (name, vport): (&str, u16), other: &str) {
    assert_eq!(fx.forward(&tcp(CLIENT, 40_000, VIP, vport, SYN).bytes()), BACKEND);
    assert_eq!(back_from_shared(fx, SYN | ACK), (VIP, vport), "the SYN-ACK of {name}'s flow went back as {other}'s");
    assert_eq!(fx.forward(&tcp(CLIENT, 40_000, VIP, vport, ACK).bytes()), BACKEND);
    assert_eq!(back_from_shared(fx, ACK | PSH), (VIP, vport), "{name}'s answer went back as {other}'s");
    assert_eq!(back_from_shared(fx, FIN | ACK), (VIP, vport));
    assert_eq!(fx.active_flows(name), 1);
    assert_eq!(fx.counter("stale_backend"), 0);
}

/// The selection tables are packed four entries to an element of SELECT
/// (layout 6), and services' regions lie back to back, so one element
/// may hold the end of one table and the start of the next. Every
/// service's table and fallback table reads back from the kernel as lbd
/// built it, before and after a weight change moves two of them, and a
/// Maglev pick is the built table's entry at the flow's hash.
#[test]
fn packed_selection_tables_read_back_as_built_and_picks_follow_them() {
    packed_selection_tables(false);
}

/// The same, with the tables written through the kernel element by
/// element (lbd's way where SELECT cannot be memory-mapped): each element
/// read first, so that the lanes of its neighbours' live tables are
/// written back as they were.
#[test]
fn packed_selection_tables_written_without_the_mapping_read_back_as_built() {
    packed_selection_tables(true);
}

fn packed_selection_tables(unmapped: bool) {
    in_netns(move || {
        let b: Vec<(Ipv4Addr, u16)> = (11..14).map(|i| (Ipv4Addr::new(10, 20, 0, i), 8080)).collect();
        let mut wrr = service_with("wrr", 82, Protocol::Tcp, Scheduler::Wrr, &b);
        wrr.backends[0].weight = 5;
        let mut services = vec![
            service_with("rr", 81, Protocol::Tcp, Scheduler::Rr, &b),
            service("web", 80, Protocol::Tcp, &b),
            wrr,
            service_with("lc", 83, Protocol::Tcp, Scheduler::LeastConn, &b),
        ];
        let mut fx = Fixture::new(Vec::new());
        if unmapped {
            fx.dp.unmap_select();
        }
        fx.dp.apply_admin(&services).unwrap();
        let check = |fx: &Fixture| {
            for name in ["rr", "web", "wrr", "lc"] {
                let [(table, read), (fallback, read_fallback)] = fx.dp.select_tables(name).unwrap().unwrap();
                assert!(!table.is_empty(), "{name}: no table");
                assert_eq!(read, table, "{name}: SELECT holds another table than the one built");
                assert_eq!(read_fallback, fallback, "{name}: SELECT holds another fallback table than the one built");
            }
            let offsets: Vec<u32> =
                ["rr", "web", "wrr", "lc"].iter().map(|n| fx.dp.select_offset(n).unwrap()).collect();
            assert!(offsets.iter().any(|o| o % 4 != 0), "no table starts inside an element: {offsets:?}");
        };
        check(&fx);
        // Two weight changes: wrr's and rr's tables move to new regions
        // beside the others.
        services[2].backends[1].weight = 3;
        services[0].backends[2].weight = 2;
        fx.dp.apply_admin(&services).unwrap();
        check(&fx);
        // Maglev: the backend of a new flow is the table's entry at the
        // flow's hash (the packet's own byte order, as the datapath reads it).
        let [(table, _), _] = fx.dp.select_tables("web").unwrap().unwrap();
        let web = fx.dp.services().find(|s| s.config.name == "web").unwrap().clone();
        for port in 42_000..42_050u16 {
            let got = fx.forward(&tcp(CLIENT, port, VIP, 80, SYN).bytes());
            let hash = lb_common::flow_hash(
                u32::from_ne_bytes(CLIENT.octets()),
                u32::from_ne_bytes(VIP.octets()),
                u16::from_ne_bytes(port.to_be_bytes()),
                u16::from_ne_bytes(80u16.to_be_bytes()),
                6,
            );
            let id = table[(hash % table.len() as u32) as usize];
            let want = web.backends.iter().find(|b| b.id == id).map(|b| b.config.address);
            assert_eq!(Some(IpAddr::V4(got)), want, "port {port}: backend id {id}");
        }
    });
}

#[test]
fn round_robin_and_wrr_follow_their_sequence_exactly() {
    in_netns(|| {
        let b: Vec<(Ipv4Addr, u16)> = (11..14).map(|i| (Ipv4Addr::new(10, 20, 0, i), 8080)).collect();
        let mut fx = Fixture::new(vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &b)]);
        let last_octet = |fx: &Fixture, port: u16| fx.forward(&tcp(CLIENT, port, VIP, 80, SYN).bytes()).octets()[3];
        let seq: Vec<u8> = (0..9).map(|i| last_octet(&fx, 30000 + i)).collect();
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
        let seq: Vec<u8> = (0..14).map(|i| last_octet(&fx, 31000 + i)).collect();
        let cycle = [11, 11, 12, 11, 13, 11, 11];
        let start = (0..7)
            .find(|&r| (0..14).all(|i| seq[i] == cycle[(i + r) % 7]))
            .unwrap_or_else(|| panic!("not a rotation of a a b a c a a: {seq:?}"));
        let _ = start;
    });
}

// ---------------------------------------------------------------- floods and lifecycles

const THIRD: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 13);

/// A TCP segment from backend `b`:`bport` back to the client's `cport`.
fn from_backend(b: Ipv4Addr, bport: u16, cport: u16, flags: u8) -> Frame {
    Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..Frame::tcp(b, bport, CLIENT, cport, flags) }
}

/// SYN, the backend's SYN-ACK, the client's ACK through the datapath;
/// returns the backend.
fn handshake(fx: &Fixture, cport: u16, vport: u16, bport: u16) -> Ipv4Addr {
    let b = fx.forward(&tcp(CLIENT, cport, VIP, vport, SYN).bytes());
    assert_eq!(fx.run(&from_backend(b, bport, cport, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
    assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, vport, ACK).bytes()), b, "ACK of {cport}");
    b
}

#[test]
fn a_full_table_routes_new_flows_by_hash_and_never_evicts_established_ones() {
    in_netns(|| {
        // Round robin: a flow routed twice by its scheduler would change
        // backend; without an entry it must hash instead.
        let mut fx = rr_fixture_with_table(16);
        let established: Vec<(u16, Ipv4Addr)> =
            (0..16).map(|i| (40_000 + i, handshake(&fx, 40_000 + i, 80, 8080))).collect();
        assert_eq!(fx.entries(), 16);
        assert_eq!(fx.active_flows("web"), 16);

        // A SYN flood from 300 sources: every SYN, its retransmission and
        // its ACK reach the same backend; none gets an entry or evicts one.
        for i in 0..300u32 {
            let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 10, 100, 0)) + i);
            let sport = 1024 + i as u16;
            let b = fx.forward(&tcp(src, sport, VIP, 80, SYN).bytes());
            assert!(RR_BACKENDS.iter().any(|x| x.0 == b), "{b}");
            assert_eq!(fx.forward(&tcp(src, sport, VIP, 80, SYN).bytes()), b, "retransmitted SYN of {src}");
            assert_eq!(fx.forward(&tcp(src, sport, VIP, 80, ACK).bytes()), b, "ACK of {src}");
        }
        assert_eq!(fx.counter("table_full"), 900);
        assert_eq!(fx.entries(), 16);

        // Every established flow still has its entry (no new-flow path:
        // the table_full count stays) and its backend.
        for &(cport, b) in &established {
            assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, ACK | PSH).bytes()), b);
        }
        assert_eq!(fx.counter("table_full"), 900, "established flows kept their entries");
        assert_eq!(fx.active_flows("web"), 16);

        // A flow routed without an entry: its backend's answer goes back
        // from the VIP without one.
        let counted = |fx: &Fixture| RR_BACKENDS.iter().map(|&(a, _)| fx.new_flows("web", a)).sum::<u64>();
        let before = counted(&fx);
        let b = fx.forward(&tcp(CLIENT, 50_000, VIP, 80, SYN).bytes());
        assert_eq!(counted(&fx), before + 1, "a connection routed without an entry is a new flow all the same");
        let (action, out) = fx.run(&from_backend(b, 8080, 50_000, SYN | ACK).bytes(), fx.if_b);
        assert_eq!(action, XDP_REDIRECT);
        assert_checksums_valid(&out);
        let got = Frame::parse(&out).unwrap();
        assert_eq!((got.src, got.sport, got.dst, got.dport), (VIP, 80, CLIENT, 50_000));
        assert_eq!(fx.counter("stateless_reply"), 1);

        // Room again (one established flow reset and swept): the stateless
        // flow's next packet takes an entry, on the backend it had.
        let (cport, b0) = established[0];
        assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, RST).bytes()), b0);
        let later = lb_userspace::dataplane::monotonic_coarse_secs() + 100;
        let r = fx.dp.sweep(later, u64::MAX / 2, u64::MAX / 2).unwrap();
        assert_eq!((r.removed, r.expired), (1, 0), "only the closed flow goes: {r:?}");
        assert_eq!(fx.entries(), 15);
        let full = fx.counter("table_full");
        assert_eq!(fx.forward(&tcp(CLIENT, 50_000, VIP, 80, ACK).bytes()), b);
        assert_eq!((fx.counter("table_full"), fx.entries()), (full, 16), "the SYN-ACK's ACK found room");
        assert_eq!(counted(&fx), before + 1, "taking an entry mid-connection is not a new flow");
        assert_eq!(fx.forward(&tcp(CLIENT, 50_000, VIP, 80, ACK | PSH).bytes()), b);
        assert_eq!((fx.counter("table_full"), fx.entries()), (full, 16), "and kept it");
    });
}

/// One run of the XDP program over `frame` (received on `ifindex`) by
/// the program's fd (`run_by_fd_raw`); answers the frame's destination
/// address.
fn run_by_fd(prog_fd: i32, frame: &[u8], ifindex: u32) -> Ipv4Addr {
    dst_of(&run_by_fd_raw(prog_fd, frame, ifindex))
}

#[test]
fn a_new_entry_stays_found_while_the_sweeper_removes_entries_beside_it() {
    // A new entry that takes the empty slot after an entry the sweeper is
    // removing must not be hidden by the sweeper emptying the run of
    // removed slots before it. A new client address a round: no tuple is
    // reused. Before the fix (table.rs, `clear_run` and `keep_reachable`)
    // this lost about one flow's entry in 250,000 and failed 5 of 6 runs;
    // a race, so a run that passes proves nothing alone.
    new_flows_beside_a_sweeper(Reuse::None);
}

#[test]
fn a_new_connection_on_a_closed_flows_tuple_keeps_its_entry_while_the_sweeper_removes_the_old_one() {
    // A client reusing its ports: each SYN finds its tuple's closed entry
    // (or none, once the sweeper removed it) and replaces it in place,
    // while the sweeper, judging that closed entry, removes it. The
    // sweeper's removal must fail when the entry was replaced between its
    // check and its compare-and-swap of the claim (which a replacement
    // puts back as it was, but for the claim's generation: `table.rs`).
    // Before the generation, 3 of 16 runs lost an entry.
    new_flows_beside_a_sweeper(Reuse::NewConnections);
}

#[test]
fn a_reset_handshake_taken_up_again_keeps_its_entry_while_the_sweeper_removes_it() {
    // The same, with every SYN of a tuple the same (its sequence number's
    // low byte): a SYN on its tuple's entry, closed by the client's reset,
    // takes it up again in place (`resumed`), as a client retrying its
    // handshake does. The sweeper's removal of that entry and the SYN's
    // change of its state exclude each other (`lb_common::FLOW_DOOMED`);
    // before, 8 of 26 runs lost an entry, with the claim's generation or
    // without it.
    new_flows_beside_a_sweeper(Reuse::SameSyns);
}

#[test]
fn connections_on_reused_tuples_that_the_sweeper_expires_are_each_counted_closed_once() {
    // Open flows the sweeper expires (its clock 11 s ahead, every timeout
    // 5 s) while their tuples' new connections renew them and resets close
    // them: every connection opened must be counted closed or expired
    // exactly once (the harness checks it for every variant). The datapath
    // counts no close of an entry the sweeper has marked, the sweeper
    // counts the close of one it removes or finds closed or replaced when
    // its mark comes off; before, a reset between the sweeper's mark and
    // its removal was counted twice, once by the datapath and once as
    // expired.
    new_flows_beside_a_sweeper(Reuse::Expiring);
}

#[test]
fn a_new_flow_on_two_cpus_at_once_is_one_flow_counted_once() {
    // The same new flow's packets on two CPUs at the same moment (a SYN
    // and its retransmission taken by two queues, a UDP flow's packets on
    // two links): both miss the table and both pick a backend. One entry
    // must come of it, both packets must go to its backend (or the one
    // that met the other CPU still writing the entry be held, counted),
    // and the flow be counted new and open once. Before the fix (the
    // loser's insert replaced the winner's entry, or put in a second one)
    // this sent both packets of 14,000-15,500 of 20,000 flows a run to two
    // backends; a race, so a run that passes proves nothing alone.
    same_flow_on_two_cpus(false);
}

#[test]
fn a_new_flow_sharing_its_backends_endpoints_on_two_cpus_at_once_is_one_flow_counted_once() {
    // As above, for a service whose backends' endpoints another service
    // owns: each new flow takes a reply entry too, inserted first, whose
    // slots start where the flow entry's do. The second CPU's reply entry
    // often lost the swap of its free slot to the first CPU's flow entry,
    // and the lost swap answered as a full table: that packet was dropped
    // and counted `flow_table` (579 of 40,000 packets in one run), though
    // the table had room for every flow. It is a race like the one above,
    // and its packet is held (counted `held`) like that one's.
    same_flow_on_two_cpus(true);
}

/// The two-CPU race (`fixture::same_new_flows_on_two_cpus`) against a
/// round-robin service over six backends; `shared`: the backends'
/// endpoints are another service's (`web`), the flows go to `alt`.
fn same_flow_on_two_cpus(shared: bool) {
    in_netns(move || {
        let backends: Vec<(Ipv4Addr, u16)> = (11..17).map(|i| (Ipv4Addr::new(10, 20, 0, i), 8080)).collect();
        let (name, port) = if shared { ("alt", 81) } else { ("web", 80) };
        let mut services = vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &backends)];
        if shared {
            services.push(service_with("alt", 81, Protocol::Tcp, Scheduler::Rr, &backends));
        }
        let mut fx = Fixture::with_config(services, |c| {
            // Room for every flow (two entries each when shared): none
            // is routed without an entry.
            c.conntrack_max = if shared { 65_536 } else { 32_768 };
            c.flood.new_flow_rate_per_cpu = Some(0);
        });
        let client = |i: u32| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i);
        same_new_flows_on_two_cpus(
            &mut fx,
            name,
            VIP.into(),
            move |i, flags| tcp(client(i), 40_000, VIP, port, flags).bytes(),
            |out| dst_of(out).into(),
            if shared { 2 } else { 1 },
        );
    });
}

/// Which tuples `new_flows_beside_a_sweeper` reuses, and how.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reuse {
    /// A new client address a round: none.
    None,
    /// One client's 24 ports every round, each round's SYNs with a
    /// sequence number of their own.
    NewConnections,
    /// The same, every round's SYNs the same.
    SameSyns,
    /// As `NewConnections`, with resets every other round only, and every
    /// open flow due to expire at each sweep: the sweeper judges and
    /// removes live flows too (its clock ahead), so a flow's next packet
    /// may find no entry and go elsewhere, which this variant allows.
    Expiring,
}

/// New flows on CPU 1 (SYN, then its next packet, which must go where the
/// SYN went, then a reset: closed, the sweeper's to remove) while the
/// sweeper runs without pause on CPU 0. Round robin over six backends: a
/// flow whose entry went missing after its SYN has its next packet
/// scheduled anew, most often elsewhere. A small table, so that new
/// entries often go right beside entries being removed; no rate limit,
/// nothing expires but closed flows. `reuse`: see [`Reuse`].
fn new_flows_beside_a_sweeper(reuse: Reuse) {
    in_netns(move || {
        let backends: Vec<(Ipv4Addr, u16)> = (11..17).map(|i| (Ipv4Addr::new(10, 20, 0, i), 8080)).collect();
        let mut fx =
            Fixture::with_config(vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &backends)], |c| {
                c.conntrack_max = 32;
                c.flood.new_flow_rate_per_cpu = Some(0);
                c.flood.half_open_timeout = if reuse == Reuse::Expiring { 5 } else { 3600 };
            });
        let prog_fd = {
            use std::os::fd::{AsFd as _, AsRawFd as _};
            fx.dp.program().fd().expect("program fd").as_fd().as_raw_fd()
        };
        let if_a = fx.if_a;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worker = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                on_cpu(1);
                let (mut flows, mut moved) = (0u64, Vec::new());
                'run: for round in 0u32.. {
                    let client = Ipv4Addr::from(
                        u32::from(Ipv4Addr::new(10, 100, 0, 0)) + if reuse == Reuse::None { round } else { 0 },
                    );
                    // Reused, 24 ports: fewer than the table holds, so that every
                    // SYN finds its tuple's closed entry unless it was removed.
                    let ports = if reuse == Reuse::None { 10_000..10_480 } else { 10_000..10_024u16 };
                    for first in ports.step_by(12) {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break 'run;
                        }
                        // 12 at a time, so that the table holds some.
                        // With a sequence number of their own, as a client's new
                        // connections have, a reused tuple's SYN is a new
                        // connection, not its reset handshake resumed (`resumed`,
                        // which keeps the entry and its backend).
                        let seq = if reuse == Reuse::SameSyns { 0 } else { round.wrapping_mul(0x0101_0101) };
                        // Expiring: the even rounds' flows are left open.
                        let reset = reuse != Reuse::Expiring || round % 2 == 1;
                        let syns: Vec<Frame> = (first..first + 12)
                            .map(|cport| Frame { seq, ..Frame::tcp(client, cport, VIP, 80, SYN) })
                            .collect();
                        let went: Vec<Ipv4Addr> =
                            syns.iter().map(|syn| run_by_fd(prog_fd, &syn.bytes(), if_a)).collect();
                        for (syn, &b) in syns.iter().zip(&went) {
                            let next = run_by_fd(prog_fd, &Frame { tcp_flags: ACK, ..syn.clone() }.bytes(), if_a);
                            if next != b {
                                moved.push(format!("{client}:{} SYN to {b}, next packet to {next}", syn.sport));
                            }
                        }
                        for syn in syns.into_iter().filter(|_| reset) {
                            run_by_fd(prog_fd, &Frame { tcp_flags: RST, ..syn }.bytes(), if_a);
                        }
                        flows += 12;
                    }
                }
                (flows, moved)
            })
        };
        // The sweeper on CPU 0, as fast as it goes, 11 s ahead: closed
        // flows are past their linger and removed, nothing else is due
        // (Expiring: every open flow is, its idle timeout 5 s).
        on_cpu(0);
        let idle = if reuse == Reuse::Expiring { 5 } else { u64::MAX / 2 };
        let t0 = std::time::Instant::now();
        let (mut sweeps, mut removed, mut expired, mut marked) = (0u64, 0u64, 0u64, 0u64);
        while t0.elapsed() < std::time::Duration::from_secs(8) {
            let now = lb_userspace::dataplane::monotonic_coarse_secs() + 11;
            let r = fx.dp.sweep(now, idle, idle).expect("sweep");
            sweeps += 1;
            removed += r.removed;
            expired += r.expired;
            marked += r.closed_while_marked;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (flows, moved) = worker.join().expect("worker");
        eprintln!(
            "{flows} new flows, {sweeps} sweeps removing {removed} entries ({expired} expired, {marked} of them \
             closed or replaced while marked), table_full {}",
            fx.counter("table_full")
        );
        assert!(flows > 10_000 && removed > 10_000, "too little happened to tell: {flows} flows, {removed} removed");
        if reuse == Reuse::Expiring {
            assert!(expired > 10_000, "too few open flows expired to tell: {expired}");
        } else {
            assert!(
                moved.is_empty(),
                "{} of {flows} flows lost their entry right after their SYN: {:?}",
                moved.len(),
                &moved[..moved.len().min(5)]
            );
        }
        // Everything swept, every connection opened was counted closed or
        // expired exactly once.
        let now = lb_userspace::dataplane::monotonic_coarse_secs() + 100_000;
        fx.dp.sweep(now, 1, 1).expect("the last sweep");
        assert_eq!(fx.entries(), 0);
        let (opened, closed, expired) = fx.connection_counts("web");
        assert_eq!(
            opened,
            closed + expired,
            "connections opened {opened}, closed {closed}, expired {expired}: not each counted once"
        );
    });
}

#[test]
fn new_flows_above_the_rate_get_a_backend_but_no_entry() {
    in_netns(|| {
        // The limit is per CPU: stay on one.
        on_cpu(0);
        let backends = [(BACKEND, 8080), (BACKEND_UNRESOLVED, 8080), (THIRD, 8080)];
        let mut fx =
            Fixture::with_config(vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &backends)], |c| {
                c.flood.new_flow_rate_per_cpu = Some(5);
            });
        // The limit's seconds are the flows' idle clock's (the coarse
        // monotonic clock), read around the burst: a burst stalled across
        // seconds on a loaded machine gets 5 more a second.
        let before = lb_userspace::dataplane::monotonic_coarse_secs();
        let flows: Vec<(u16, Ipv4Addr)> =
            (0..40).map(|i| (30_000 + i, fx.forward(&tcp(CLIENT, 30_000 + i, VIP, 80, SYN).bytes()))).collect();
        let seconds = lb_userspace::dataplane::monotonic_coarse_secs() - before + 1;
        let (entries, limited) = (fx.entries(), fx.counter("flood_rate"));
        assert_eq!(entries + limited, 40);
        // 5 in each second the burst touched (two, when a boundary fell
        // inside it), and 5 at least.
        let most = (5 * seconds).min(40);
        assert!((5..=most).contains(&entries), "{entries} entries for 40 new flows at 5/s over {seconds} s");
        // With or without an entry, a flow's next packet goes where its SYN went.
        for &(cport, b) in &flows {
            assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, ACK).bytes()), b, "ACK of {cport}");
        }
    });
}

#[test]
fn a_new_connection_above_the_rate_on_a_tuple_with_an_entry_takes_the_entry_over() {
    in_netns(|| {
        // The limit is per CPU: stay on one.
        on_cpu(0);
        let mut fx =
            Fixture::with_config(vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &RR_BACKENDS)], |c| {
                c.flood.new_flow_rate_per_cpu = Some(5);
            });
        // A client port's connection, closed by a reset: its entry
        // lingers (closed) for the port's next connection.
        let cport = 42_000;
        let first = handshake(&fx, cport, 80, 8080);
        assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, RST).bytes()), first);
        // Fresh tuples until one is over this second's limit, then at once
        // the port's next connection, in the same second (tried again if
        // the clock's second turned in between).
        let mut fresh = 43_000;
        let taken = (0..5).find_map(|_| {
            let second = lb_userspace::dataplane::monotonic_coarse_secs();
            let limited = fx.counter("flood_rate");
            while fx.counter("flood_rate") == limited {
                fx.forward(&tcp(CLIENT, fresh, VIP, 80, SYN).bytes());
                fresh += 1;
            }
            let syn = Frame { seq: 7_000_000, ..tcp(CLIENT, cport, VIP, 80, SYN) };
            let b = fx.forward(&syn.bytes());
            let same_second = lb_userspace::dataplane::monotonic_coarse_secs() == second;
            same_second.then_some((b, fx.counter("flood_rate") - limited - 1))
        });
        let (b, limited_since) = taken.expect("five tries, each across a second's turn");
        // The backend's answer goes back to the client, and the rest of
        // the connection to that backend. Routed without an entry, the
        // SYN-ACK met the closed entry and was dropped as stale: the
        // client waited a second for its SYN's retransmission.
        assert_eq!(
            fx.run(&from_backend(b, 8080, cport, SYN | ACK).bytes(), fx.if_b).0,
            XDP_REDIRECT,
            "the SYN-ACK of the port's new connection (stale_backend {})",
            fx.counter("stale_backend")
        );
        assert_eq!(fx.counter("stale_backend"), 0);
        assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, ACK).bytes()), b);
        assert_eq!(fx.run(&from_backend(b, 8080, cport, ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.counter("stale_backend"), 0);
        // It took the closed entry over: not limited, no new entry.
        assert_eq!(limited_since, 0, "the port's new connection was rate limited");
        let entries = fx.entries();
        let with_entries = u64::from(fresh - 43_000) - fx.counter("flood_rate");
        assert_eq!(entries, 1 + with_entries, "the closed entry replaced in place");
        // The port's two connections, each counted once.
        let all: u64 = RR_BACKENDS.iter().map(|&(a, _)| fx.new_flows("web", a)).sum();
        assert_eq!(all, 2 + u64::from(fresh - 43_000));
        assert_eq!(fx.active_flows("web"), 1 + with_entries);
    });
}

#[test]
fn half_open_flows_expire_early_and_active_counts_return_to_exactly_zero() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![
            service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)]),
            service("dns", 53, Protocol::Udp, &[(BACKEND, 5353)]),
        ]);
        // Half-open: a SYN alone, a SYN answered but never acknowledged,
        // a one-way UDP flow.
        fx.forward(&tcp(CLIENT, 41_000, VIP, 80, SYN).bytes());
        fx.forward(&tcp(CLIENT, 41_001, VIP, 80, SYN).bytes());
        assert_eq!(fx.run(&from_backend(BACKEND, 8080, 41_001, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        fx.forward(&udp(CLIENT, 41_002, VIP, 53).bytes());
        // Established: a full handshake, and a UDP exchange the client
        // went on with.
        handshake(&fx, 41_003, 80, 8080);
        fx.forward(&udp(CLIENT, 41_004, VIP, 53).bytes());
        let reply = Frame { dmac: GW_B_MAC, smac: BACKEND_MAC, ..Frame::udp(BACKEND, 5353, CLIENT, 41_004) };
        assert_eq!(fx.run(&reply.bytes(), fx.if_b).0, XDP_REDIRECT);
        fx.forward(&udp(CLIENT, 41_004, VIP, 53).bytes());
        assert_eq!(fx.entries(), 5);
        assert_eq!((fx.active_flows("web"), fx.active_flows("dns")), (3, 2));

        // 11 s on (half_open_timeout 10 s by default): the three half-open
        // flows go, counted as expired.
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let r = fx.dp.sweep(now + 11, 900, 300).unwrap();
        assert_eq!((r.removed, r.expired, r.half_open_expired), (3, 3, 3), "{r:?}");
        assert_eq!((fx.active_flows("web"), fx.active_flows("dns")), (1, 1));

        // The TCP flow is reset, the UDP one idles out: both counts are 0.
        fx.forward(&tcp(CLIENT, 41_003, VIP, 80, RST).bytes());
        assert_eq!(fx.active_flows("web"), 0);
        let r = fx.dp.sweep(now + 400, 900, 300).unwrap();
        assert_eq!((r.removed, r.expired, r.half_open_expired), (2, 1, 0), "{r:?}");
        assert_eq!((fx.active_flows("web"), fx.active_flows("dns")), (0, 0));
        assert_eq!(fx.entries(), 0);
    });
}

fn key4(cport: u16) -> lb_common::FlowKey {
    lb_common::FlowKey {
        src_addr: u32::from_ne_bytes(CLIENT.octets()),
        dst_addr: u32::from_ne_bytes(VIP.octets()),
        src_port: cport.to_be(),
        dst_port: 80u16.to_be(),
        proto: lb_common::PROTO_TCP,
        _pad: [0; 3],
    }
}

/// The client's FIN and the backend `b`'s FIN of the flow from `cport`
/// (to port 80, the backend's 8080) through the datapath: closed.
fn close(fx: &Fixture, cport: u16, b: Ipv4Addr) {
    assert_eq!(fx.forward(&tcp(CLIENT, cport, VIP, 80, FIN | ACK).bytes()), b);
    assert_eq!(fx.run(&from_backend(b, 8080, cport, FIN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
}

/// A migration's first copy of the flows on `ports`, as lbd makes it: the
/// entries this datapath made stand in for the old program's, and are put
/// back as the first copy inserts them, marked `FLOW_COPY`, and without
/// the mark of a flow counted per CPU (`FLOW_CONNS_CPU`): every layout a
/// migration copies from counted its flows in `CONNS`. (lbd's active
/// counts add both kinds, so the flows opened here per CPU and closed as
/// copies still sum to none.) Returns the flows as the old program had
/// them, which the late copy's `copied` record keeps.
fn first_copy(fx: &Fixture, ports: impl IntoIterator<Item = u16>) -> std::collections::HashMap<u16, lb_common::Flow> {
    let mut copies = std::collections::HashMap::new();
    for p in ports {
        let f = fx.dp.flow(&key4(p)).unwrap().expect("an entry");
        let removed = fx.dp.remove_unchanged(&[sweep_item(fx, key4(p), &f)]).unwrap();
        assert_eq!(removed[0].removed, 1, "{p}");
        let f = lb_common::Flow { state: f.state & !lb_common::FLOW_CONNS_CPU, ..f };
        let copy = lb_common::Flow { state: f.state | lb_common::FLOW_COPY, ..f };
        assert_eq!(fx.dp.insert_flows(&[(key4(p), copy)]).unwrap().inserted, 1, "{p}");
        copies.insert(p, f);
    }
    copies
}

/// The request to remove `key`'s entry as `f` (its slot where it has one).
fn sweep_item(fx: &Fixture, key: lb_common::FlowKey, f: &lb_common::Flow) -> lb_common::SweepItem {
    let slot = fx.dp.flow_slot(&key).unwrap().unwrap_or(0);
    lb_common::SweepItem { key, state: f.state, last_seen: f.last_seen, removed: 0, slot }
}

#[test]
fn the_sweeper_removes_a_flow_only_while_it_is_as_it_was_judged() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        // A connection is reset; the sweeper reads its entry (closed) and
        // would remove it. Before it does, the client reuses the port: the
        // SYN makes a new entry under the same 5-tuple.
        handshake(&fx, 42_000, 80, 8080);
        fx.forward(&tcp(CLIENT, 42_000, VIP, 80, RST).bytes());
        let key = key4(42_000);
        let judged = fx.dp.flow(&key).unwrap().expect("the reset flow's entry");
        assert!(lb_common::flow_closed(judged.state));
        fx.forward(&tcp(CLIENT, 42_000, VIP, 80, SYN).bytes());
        let live = fx.dp.flow(&key).unwrap().expect("the new connection's entry");
        assert!(!lb_common::flow_closed(live.state));
        let done = fx.dp.remove_unchanged(&[sweep_item(&fx, key, &judged)]).unwrap();
        assert_eq!(done[0].removed, 0, "the new connection's entry was removed on the strength of the old one's");
        assert_eq!(fx.dp.flow(&key).unwrap(), Some(live), "the new connection lost its entry");
        // An entry whose last packet is newer than the one judged stays too.
        let stale = lb_common::SweepItem { last_seen: live.last_seen.wrapping_sub(1), ..sweep_item(&fx, key, &live) };
        assert_eq!(fx.dp.remove_unchanged(&[stale]).unwrap()[0].removed, 0);
        assert!(fx.dp.flow(&key).unwrap().is_some());
        // As judged: removed.
        assert_eq!(fx.dp.remove_unchanged(&[sweep_item(&fx, key, &live)]).unwrap()[0].removed, 1);
        assert_eq!(fx.dp.flow(&key).unwrap(), None);

        // More flows than one run of the program takes (64): every other
        // one changed since it was judged; exactly the others go, and a key
        // with no entry is reported not removed.
        let n = 150u16;
        for i in 0..n {
            fx.forward(&tcp(CLIENT, 43_000 + i, VIP, 80, SYN).bytes());
        }
        let mut items: Vec<_> = (0..n)
            .map(|i| {
                let k = key4(43_000 + i);
                let f = fx.dp.flow(&k).unwrap().expect("entry");
                let item = sweep_item(&fx, k, &f);
                if i % 2 == 1 { lb_common::SweepItem { state: f.state ^ lb_common::FLOW_RST, ..item } } else { item }
            })
            .collect();
        items.push(sweep_item(&fx, key4(44_999), &lb_common::Flow::default()));
        let done = fx.dp.remove_unchanged(&items).unwrap();
        assert_eq!(done.len(), items.len());
        for (i, d) in done.iter().enumerate() {
            let want = u32::from(i < usize::from(n) && i % 2 == 0);
            assert_eq!(d.removed, want, "item {i}");
            assert_eq!(d.key, items[i].key, "item {i} came back in its place");
        }
        assert_eq!(fx.entries(), u64::from(n / 2));
    });
}

#[test]
fn a_sweep_left_half_done_still_counts_the_flows_it_removed() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        for port in [45_000, 45_001] {
            fx.forward(&tcp(CLIENT, port, VIP, 80, SYN).bytes());
        }
        assert_eq!(fx.active_flows("web"), 2);
        // lbd sweeps a part at a time and may stop between parts (a stop,
        // a restart): the part that removed the two half-open flows has
        // counted them expired already.
        let now = lb_userspace::dataplane::monotonic_coarse_secs();
        let mut run = fx.dp.sweep_begin(now + 11, 900, 300);
        assert_eq!(fx.dp.sweep_step(&mut run).unwrap(), None, "one part swept both tables");
        drop(run);
        assert_eq!(fx.entries(), 0);
        assert_eq!(fx.active_flows("web"), 0, "flows removed by an unfinished sweep still count as active");
    });
}

#[test]
fn the_program_verifies_with_room_to_spare() {
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let n = fx.dp.program().info().unwrap().verified_instruction_count().unwrap();
        eprintln!("the verifier processed {n} instructions (limit 1,000,000)");
        // A change that brings it near the limit fails here first, and
        // clearly, instead of failing to load on a kernel whose verifier
        // explores a little more.
        assert!(n <= 700_000, "{n} instructions verified: too close to the verifier's limit of 1,000,000");
    });
}

/// The backends of [`rr_fixture_with_table`]'s service.
const RR_BACKENDS: [(Ipv4Addr, u16); 3] = [(BACKEND, 8080), (BACKEND_UNRESOLVED, 8080), (THIRD, 8080)];

/// A round-robin service over three backends (a flow found anew by its
/// scheduler would change backend) with a flow table for `conntrack_max`
/// flows and no new-flow rate limit.
fn rr_fixture_with_table(conntrack_max: u32) -> Fixture {
    Fixture::with_config(vec![service_with("web", 80, Protocol::Tcp, Scheduler::Rr, &RR_BACKENDS)], |c| {
        c.conntrack_max = conntrack_max;
        c.flood.new_flow_rate_per_cpu = Some(0);
    })
}

/// The flow table is open addressing in slots of our own: keys whose
/// first slots collide are found past each other, a removed entry's slot
/// is skipped by lookups and taken again by inserts, and the table holds
/// exactly `conntrack_max` flows however its slots are taken.
#[test]
fn colliding_flows_and_removed_slots_keep_every_flow_on_its_backend() {
    in_netns(|| {
        // Round robin: a flow found anew by its scheduler would change
        // backend. 32 slots for 16 flows: their first slots collide.
        let mut fx = rr_fixture_with_table(16);
        let mask = lb_common::flow_slots(16) - 1;
        let seed = fx.dp.flow_seed();
        let home = |k: &lb_common::FlowKey| k.slot_hash(seed) as u32 & mask;

        // Three flows with the same first slot take it and the two after
        // it; the middle one is reset and swept, and its slot, between the
        // others, is marked removed. The third is found past it: its
        // packets neither take a second entry nor change backend.
        let mut same: Vec<u16> = Vec::new();
        for p in 30_000..40_000u16 {
            if same.is_empty() || home(&key4(p)) == home(&key4(same[0])) {
                same.push(p);
            }
            if same.len() == 4 {
                break;
            }
        }
        let h = home(&key4(same[0]));
        let chain: Vec<Ipv4Addr> = same[..3].iter().map(|&p| handshake(&fx, p, 80, 8080)).collect();
        for (i, &p) in same[..3].iter().enumerate() {
            assert_eq!(fx.dp.flow_slot(&key4(p)).unwrap(), Some((h + i as u32) & mask), "flow {i} of the chain");
        }
        assert_eq!(fx.forward(&tcp(CLIENT, same[1], VIP, 80, RST).bytes()), chain[1]);
        let later = lb_userspace::dataplane::monotonic_coarse_secs() + 100;
        assert_eq!(fx.dp.sweep(later, u64::MAX / 2, u64::MAX / 2).unwrap().removed, 1);
        assert_eq!(fx.entries(), 2);
        for _ in 0..3 {
            assert_eq!(fx.forward(&tcp(CLIENT, same[2], VIP, 80, ACK | PSH).bytes()), chain[2]);
        }
        assert_eq!(fx.entries(), 2, "the flow past a removed slot took a second entry");
        assert_eq!(fx.dp.flow_slot(&key4(same[2])).unwrap(), Some((h + 2) & mask));
        // A fourth flow with that first slot takes the removed slot, the
        // first free one of its sequence, not the empty one past the
        // chain: removed slots are used again.
        let fourth = handshake(&fx, same[3], 80, 8080);
        assert_eq!(fx.dp.flow_slot(&key4(same[3])).unwrap(), Some((h + 1) & mask), "the removed slot was not reused");
        assert_eq!(fx.entries(), 3);
        assert_eq!(fx.forward(&tcp(CLIENT, same[2], VIP, 80, ACK | PSH).bytes()), chain[2]);
        // The others reset and swept too: the table is empty again.
        for (p, b) in [(same[0], chain[0]), (same[2], chain[2]), (same[3], fourth)] {
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, RST).bytes()), b);
        }
        assert_eq!(fx.dp.sweep(later, u64::MAX / 2, u64::MAX / 2).unwrap().removed, 3);
        assert_eq!(fx.entries(), 0);

        // Sixteen flows, the last (an odd port, as its index is) with the
        // first's first slot: at least one leaves its first slot whatever
        // the seed (sixteen arbitrary ports all land apart once in about
        // 90 seeds).
        let twin = (50_001..u16::MAX).step_by(2).find(|&p| home(&key4(p)) == home(&key4(41_000))).unwrap();
        let mut flows: Vec<(u16, Ipv4Addr)> =
            (41_000..41_015).chain([twin]).map(|p| (p, handshake(&fx, p, 80, 8080))).collect();
        let displaced = flows
            .iter()
            .filter(|&&(p, _)| fx.dp.flow_slot(&key4(p)).unwrap().expect("every flow has a slot") != home(&key4(p)))
            .count();
        assert!(displaced > 0, "no flow left its first slot: the test exercises no probing");
        assert_eq!(fx.entries(), 16);

        // Half of them reset and swept: their slots are removed (or emptied
        // at the end of a run); the others are still found, past them.
        for &(p, b) in flows.iter().step_by(2) {
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, RST).bytes()), b);
        }
        let later = lb_userspace::dataplane::monotonic_coarse_secs() + 100;
        let r = fx.dp.sweep(later, u64::MAX / 2, u64::MAX / 2).unwrap();
        assert_eq!(r.removed, 8, "{r:?}");
        assert_eq!(fx.entries(), 8);
        flows.retain(|&(p, _)| p % 2 == 1);
        for &(p, b) in &flows {
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, ACK | PSH).bytes()), b, "flow {p} after the removals");
        }

        // Eight new flows take the room back, in removed slots or empty
        // ones; then the table is full again, and every flow keeps its
        // backend.
        flows.extend((0..8).map(|i| (42_000 + i, handshake(&fx, 42_000 + i, 80, 8080))));
        assert_eq!(fx.entries(), 16);
        let full = fx.counter("table_full");
        fx.forward(&tcp(CLIENT, 43_000, VIP, 80, SYN).bytes());
        assert_eq!(fx.counter("table_full"), full + 1, "a 17th flow found room");
        for &(p, b) in &flows {
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, ACK | PSH).bytes()), b, "flow {p}");
        }
        assert_eq!(fx.counter("table_full"), full + 1, "an established flow lost its entry");
    });
}

/// Where a flow's entry goes depends on a seed drawn per datapath: 48
/// client ports whose first slots, under the hash as this source spells
/// it with no seed, are two neighbouring slots of a 2,048-slot table (what
/// a client that read the source would send to crowd one probe sequence,
/// 32 slots long: unseeded, 14 or more of them would find no slot) all get
/// entries, found where the datapath put them, and keep their backends.
#[test]
fn flows_aimed_at_one_probe_sequence_of_the_unseeded_hash_all_get_entries() {
    in_netns(|| {
        let mut fx = rr_fixture_with_table(1024);
        let mask = lb_common::flow_slots(1024) - 1;
        assert_eq!(mask, 2047);
        let unseeded = |p: u16| key4(p).slot_hash(0) as u32 & mask;
        let target = unseeded(1024);
        let aimed: Vec<u16> =
            (1024..u16::MAX).filter(|&p| unseeded(p).wrapping_sub(target) & mask < 2).take(48).collect();
        assert_eq!(aimed.len(), 48);
        let seed = fx.dp.flow_seed();
        let full = fx.counter("table_full");
        let flows: Vec<(u16, Ipv4Addr)> = aimed.iter().map(|&p| (p, handshake(&fx, p, 80, 8080))).collect();
        assert_eq!(fx.counter("table_full"), full, "a flow aimed at one probe sequence found no slot (seed {seed:#x})");
        assert_eq!(fx.entries(), 48);
        for &(p, b) in &flows {
            let at = fx.dp.flow_slot(&key4(p)).unwrap().expect("every aimed flow has an entry");
            assert!(
                at.wrapping_sub(key4(p).slot_hash(seed) as u32) & mask < lb_common::SLOT_PROBES,
                "flow {p} in slot {at}, outside its probe sequence under the datapath's seed"
            );
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, ACK | PSH).bytes()), b, "flow {p}");
        }
    });
}

/// A migration copies an old table's flows through the datapath's own
/// insert: a key the datapath made already keeps its entry, the others go
/// in, and the table's count follows.
#[test]
fn inserted_flows_keep_entries_the_datapath_made() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        handshake(&fx, 44_000, 80, 8080);
        let made = fx.dp.flow(&key4(44_000)).unwrap().expect("the datapath's entry");
        let copied = lb_common::Flow { backend_id: made.backend_id + 7, ..made };
        let flows: Vec<_> = (0..100u16).map(|i| (key4(44_000 + i), copied)).collect();
        let done = fx.dp.insert_flows(&flows).unwrap();
        assert_eq!((done.inserted, done.existed, done.no_room), (99, 1, 0));
        assert_eq!(fx.dp.flow(&key4(44_000)).unwrap(), Some(made), "the datapath's own entry was replaced");
        for i in 1..100 {
            assert_eq!(fx.dp.flow(&key4(44_000 + i)).unwrap(), Some(copied), "flow {i}");
        }
        assert_eq!(fx.entries(), 100);
    });
}

/// A migration's late copy reads the old table again after the program
/// swap. Where a key's entry is still the flow's earlier copy, what the old
/// program saw since goes into it: a handshake it completed (else the live
/// connection stayed half-open here and was expired early), a close (else
/// the entry lived out its idle timeout and was counted expired on top of
/// closed), a reopen, its later time. A close whose two FINs the two
/// programs saw apart is counted then, once; one the old program saw whole
/// it counted itself (carried by `add_counts`). An entry that is a new
/// connection on the tuple since (made anew, or reopened here) keeps its
/// own state.
#[test]
fn a_late_copy_brings_what_the_old_program_saw_into_the_flows_copies() {
    use lb_common::{
        FLOW_COPY, FLOW_ESTABLISHED as EST, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REOPENED, FLOW_REPLIED,
    };
    const CLOSED: u64 = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND;
    in_netns(|| {
        let fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let id = fx.dp.services().next().unwrap().backends[0].id;
        let entry = |p: u16| fx.dp.flow(&key4(p)).unwrap().expect("an entry");
        // 44,100: a handshake the old program completed after the copy.
        assert_eq!(fx.forward(&tcp(CLIENT, 44_100, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.run(&from_backend(BACKEND, 8080, 44_100, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        // 44,101: closed by the old program alone; 44,102: the backend's
        // FIN seen here, the client's by the old program; 44,103: closed
        // before the copy, then a new connection on the tuple here; 44,104:
        // reopened here; 44,105: reopened by the old program.
        for p in 44_101..=44_105 {
            assert_eq!(handshake(&fx, p, 80, 8080), BACKEND);
        }
        close(&fx, 44_103, BACKEND);
        // The copies, as the first copy took them (this datapath made them).
        let copies = first_copy(&fx, 44_100..=44_105);
        assert_eq!(copies[&44_100].state, FLOW_REPLIED);
        assert_eq!(copies[&44_101].state, FLOW_REPLIED | EST);
        assert_eq!(copies[&44_103].state & CLOSED, CLOSED);
        // What the new program sees after the swap.
        assert_eq!(fx.run(&from_backend(BACKEND, 8080, 44_102, FIN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        assert_eq!(fx.forward(&tcp(CLIENT, 44_103, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.forward(&tcp(CLIENT, 44_104, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(entry(44_103).state & CLOSED, 0, "the new connection on 44,103 has an entry of its own");
        assert_eq!(entry(44_104).state, FLOW_REPLIED | FLOW_REOPENED);
        let live: std::collections::HashMap<u16, lb_common::Flow> = (44_100..=44_105).map(|p| (p, entry(p))).collect();
        // 44,100 and 44,103 to 44,105 are open here, 44,101 and 44,102 too.
        let active = fx.active_flows("web");
        // The old program's later view of each.
        let later = |p: u16, state: u64| lb_common::Flow { state, last_seen: copies[&p].last_seen + 5, ..copies[&p] };
        let old = vec![
            (key4(44_100), later(44_100, FLOW_REPLIED | EST)),
            (key4(44_101), later(44_101, FLOW_REPLIED | EST | CLOSED)),
            (key4(44_102), later(44_102, FLOW_REPLIED | EST | FLOW_FIN_CLIENT)),
            (key4(44_103), later(44_103, copies[&44_103].state)),
            (key4(44_104), later(44_104, FLOW_REPLIED | EST | CLOSED)),
            (key4(44_105), later(44_105, FLOW_REPLIED | FLOW_REOPENED)),
        ];
        let copied = copies.iter().map(|(&p, f)| (key4(p), f.state)).collect();
        let done = fx.dp.merge_flows(&old, &copied).unwrap();
        let counts = (done.inserted, done.merged, done.replaced, done.existed, done.no_room);
        assert_eq!(counts, (0, 3, 1, 2, 0), "{done:?}");
        let now: std::collections::HashMap<u16, lb_common::Flow> = (44_100..=44_105).map(|p| (p, entry(p))).collect();
        assert_eq!(now[&44_100].state, FLOW_REPLIED | EST | FLOW_COPY, "the handshake the old program saw");
        assert_eq!(now[&44_101].state & CLOSED, CLOSED, "the close the old program saw");
        assert_eq!(now[&44_102].state & CLOSED, CLOSED, "the close seen by halves");
        assert_eq!(now[&44_105].state, FLOW_REPLIED | FLOW_REOPENED, "the reopen the old program saw (replaced)");
        for p in [44_100, 44_101, 44_102, 44_105] {
            assert_eq!(now[&p].last_seen, copies[&p].last_seen + 5, "{p}: the old program's later time");
        }
        for p in [44_103, 44_104] {
            assert_eq!(now[&p], live[&p], "{p}: a new connection on the tuple took the old view");
        }
        // Only the close by halves was counted here.
        assert_eq!(fx.active_flows("web"), active - 1);
        // The old program's own counts (one close, 44,101's, and two new
        // flows with their packets) are added in the kernel, to what this
        // datapath counted; an id past the table's adds nothing.
        let new_flows = fx.new_flows("web", BACKEND);
        let stats = lb_common::BackendStats { new_flows: 2, packets_in: 6, ..Default::default() };
        let add = |backend_id| lb_common::CountsAdd { backend_id, closed: 1, stats, ..Default::default() };
        assert_eq!(fx.dp.add_counts(&[add(id), add(lb_common::MAX_BACKENDS + 1)]).unwrap(), 1);
        assert_eq!(fx.active_flows("web"), active - 2);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows + 2);
    });
}

/// A client reuses a closed connection's port while the old program still
/// serves, between the migration's two copies: the old program schedules
/// the later connection (maybe onto another backend) and counts it open,
/// while the new table holds the closed copy. The late copy puts the later
/// connection in the copy's place, with what the new program saw of it
/// since the swap, so its packets reach its own backend and its close is
/// counted once. (Without this, its packets went to the copy's backend,
/// or its close was never counted: one connection active for ever.)
#[test]
fn a_late_copy_puts_a_later_connection_on_a_copys_tuple_in_its_place() {
    use lb_common::{
        FLOW_ESTABLISHED as EST, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REOPENED, FLOW_REPLIED, FLOW_RST,
    };
    const CLOSED: u64 = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND;
    in_netns(|| {
        // Round robin over three backends: consecutive flows go to
        // different ones.
        let fx = rr_fixture_with_table(64);
        let entry = |p: u16| fx.dp.flow(&key4(p)).unwrap().expect("an entry");
        let active = |b: u32| fx.dp.active_flows(b).unwrap();
        let close_from = |p: u16, b: Ipv4Addr, flags: u8| {
            assert_eq!(fx.run(&from_backend(b, 8080, p, flags).bytes(), fx.if_b).0, XDP_REDIRECT);
        };
        // 45,000 and 45,001: closed when copied; 45,002: open when copied.
        let on: Vec<Ipv4Addr> = (45_000..=45_002).map(|p| handshake(&fx, p, 80, 8080)).collect();
        // A flow on another backend than 45,001's, whose entry lends the
        // later connection its backend.
        let other =
            (45_010..45_020).find(|&p| handshake(&fx, p, 80, 8080) != on[1]).expect("round robin spreads flows");
        // 45,000 closed by the client's reset, 45,001 by FINs both ways.
        assert_eq!(fx.forward(&tcp(CLIENT, 45_000, VIP, 80, RST).bytes()), on[0]);
        assert_eq!(fx.forward(&tcp(CLIENT, 45_001, VIP, 80, FIN | ACK).bytes()), on[1]);
        close_from(45_001, on[1], FIN | ACK);
        let copies = first_copy(&fx, 45_000..=45_002);
        assert_eq!(copies[&45_000].state, FLOW_REPLIED | EST | FLOW_RST);
        assert_eq!(copies[&45_001].state & CLOSED, CLOSED);
        let x = |p: u16| copies[&p].backend_id;
        // The old program's later connections: 45,000 anew on its backend,
        // open; 45,001 anew on another backend, open; 45,002 reopened.
        let later = |p: u16, state: u64, like: lb_common::Flow| lb_common::Flow {
            state,
            last_seen: copies[&p].last_seen + 5,
            ..like
        };
        let moved = entry(other);
        let old = vec![
            (key4(45_000), later(45_000, FLOW_REPLIED | EST, copies[&45_000])),
            (key4(45_001), later(45_001, FLOW_REPLIED | EST, moved)),
            (key4(45_002), later(45_002, FLOW_REPLIED | FLOW_REOPENED | EST, copies[&45_002])),
        ];
        // After the swap, the new program sees the later connections'
        // packets on the copies: 45,000's client FIN (not counted: the
        // copy is closed; a FIN on a copy closed by FINs would add
        // nothing that tells it apart); 45,002's close both ways (counted on the open
        // copy, whose connection the old program counted closed at the
        // reopen).
        assert_eq!(fx.forward(&tcp(CLIENT, 45_000, VIP, 80, FIN | ACK).bytes()), on[0]);
        let before = (active(x(45_000)), active(x(45_002)));
        assert_eq!(fx.forward(&tcp(CLIENT, 45_002, VIP, 80, FIN | ACK).bytes()), on[2]);
        close_from(45_002, on[2], FIN | ACK);
        assert_eq!(active(x(45_002)), before.1 - 1);
        let all: Vec<u32> = fx.dp.services().next().unwrap().backends.iter().map(|b| b.id).collect();
        let actives = |fx: &Fixture| all.iter().map(|&b| fx.dp.active_flows(b).unwrap()).collect::<Vec<u64>>();
        let merged_at = actives(&fx);

        let copied = copies.iter().map(|(&p, f)| (key4(p), f.state)).collect();
        let done = fx.dp.merge_flows(&old, &copied).unwrap();
        assert_eq!((done.inserted, done.merged, done.replaced, done.existed), (0, 0, 3, 0), "{done:?}");
        // 45,000: the later connection, with the client's FIN seen here.
        let e = entry(45_000);
        assert_eq!((e.backend_id, e.state), (x(45_000), FLOW_REPLIED | EST | FLOW_FIN_CLIENT));
        assert_eq!(e.last_seen, copies[&45_000].last_seen + 5);
        // 45,001: on the later connection's backend, and its packets go there.
        let e = entry(45_001);
        assert_eq!((e.backend_id, e.nat_addr, e.state), (moved.backend_id, moved.nat_addr, FLOW_REPLIED | EST));
        assert_ne!(moved.backend_id, x(45_001));
        let to = fx.forward(&tcp(CLIENT, 45_001, VIP, 80, ACK | PSH).bytes());
        assert_eq!(u32::from_ne_bytes(to.octets()), moved.nat_addr, "45,001's packets go to its own backend");
        // 45,002: reopened, and closed by what the new program saw; the
        // close counted on the copy was taken back and counted for the
        // later connection: once in all.
        assert_eq!(entry(45_002).state, FLOW_REPLIED | FLOW_REOPENED | EST | CLOSED);
        assert_eq!(actives(&fx), merged_at, "the replace changed no count but 45,002's, back and forth");
        // 45,000's close, seen whole here, is counted.
        close_from(45_000, on[0], FIN | ACK);
        assert_eq!(active(x(45_000)), merged_at[all.iter().position(|&b| b == x(45_000)).unwrap()] - 1);
    });
}

/// A later connection on a copy's reused tuple that the new program made
/// and saw whole before the late copy (a busy client reusing its port
/// within the window) has every state bit the copy had, and more. It is
/// not the copy, and the late copy leaves it whatever the old program's
/// view of the tuple: the client's next connection there is scheduled
/// and counted. Taken for the copy by its bits (before `FLOW_COPY`), the
/// entry was replaced by the old program's half-open view, and the next
/// connection's SYN was forwarded as that one's retransmission,
/// uncounted.
#[test]
fn a_late_copy_leaves_a_later_connection_the_new_program_saw_whole() {
    use lb_common::{FLOW_COPY, FLOW_ESTABLISHED as EST, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REPLIED};
    const CLOSED: u64 = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND;
    in_netns(|| {
        let fx = rr_fixture_with_table(64);
        let entry = |p: u16| fx.dp.flow(&key4(p)).unwrap().expect("an entry");
        let total = |fx: &Fixture| RR_BACKENDS.iter().map(|&(b, _)| fx.new_flows("web", b)).sum::<u64>();
        // 48,000: closed when the first copy takes it.
        let first = handshake(&fx, 48_000, 80, 8080);
        close(&fx, 48_000, first);
        let copies = first_copy(&fx, [48_000]);
        assert_eq!(copies[&48_000].state, FLOW_REPLIED | EST | CLOSED);
        // After the swap: a whole later connection on the tuple, counted.
        let before = total(&fx);
        let later = handshake(&fx, 48_000, 80, 8080);
        close(&fx, 48_000, later);
        assert_eq!(total(&fx), before + 1);
        let live = entry(48_000);
        // Unmarked (no `FLOW_COPY`), and counted per CPU, as this
        // datapath counts a round-robin service's new flows.
        assert_eq!(
            live.state,
            FLOW_REPLIED | EST | CLOSED | lb_common::FLOW_CONNS_CPU,
            "the later connection's, unmarked"
        );
        // The old program's view of the tuple: a connection of its own
        // after the copy's, half-open, on another backend than the later
        // connection's.
        let other =
            (48_010..48_020).find(|&p| handshake(&fx, p, 80, 8080) != later).expect("round robin spreads flows");
        let view = lb_common::Flow { state: FLOW_REPLIED, last_seen: live.last_seen + 1, ..entry(other) };
        let copied = copies.iter().map(|(&p, f)| (key4(p), f.state)).collect();
        let done = fx.dp.merge_flows(&[(key4(48_000), view)], &copied).unwrap();
        assert_eq!((done.merged, done.replaced, done.existed), (0, 0, 1), "{done:?}");
        assert_eq!(entry(48_000), live, "the later connection's entry stands");
        assert_eq!(entry(48_000).state & FLOW_COPY, 0);
        // The client's next connection on the tuple: scheduled and counted.
        let before = total(&fx);
        let next = fx.forward(&tcp(CLIENT, 48_000, VIP, 80, SYN).bytes());
        assert_eq!(total(&fx), before + 1, "the next connection on 48,000 is counted (went to {next})");
        assert_eq!(entry(48_000).state & (EST | CLOSED), 0, "48,000's entry is the next connection's");
    });
}

/// While a migration copies the old datapath's last flows, a TCP packet
/// other than a SYN on a closed entry waits for its retransmission, as one
/// with no entry does (`held`): it may be a later connection's, scheduled
/// by the old program on the reused tuple, which the late copy then puts
/// in the entry's place; on the closed copy its FIN would go unseen. A SYN
/// is scheduled as ever, and once the hold ends the closed flow's late
/// packets pass to its backend again.
#[test]
fn a_migrations_hold_keeps_packets_on_a_closed_entry_for_their_retransmission() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        assert_eq!(handshake(&fx, 46_000, 80, 8080), BACKEND);
        assert_eq!(handshake(&fx, 46_001, 80, 8080), BACKEND);
        for p in [46_000, 46_001] {
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, FIN | ACK).bytes()), BACKEND);
            assert_eq!(fx.run(&from_backend(BACKEND, 8080, p, FIN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        }
        fx.dp.hold_for(10).unwrap();
        let held = fx.counter("held");
        assert_eq!(fx.run(&tcp(CLIENT, 46_000, VIP, 80, ACK).bytes(), fx.if_a).0, XDP_DROP);
        assert_eq!(fx.run(&tcp(CLIENT, 46_000, VIP, 80, FIN | ACK).bytes(), fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("held"), held + 2);
        // An open flow's packets are not held.
        assert_eq!(handshake(&fx, 46_002, 80, 8080), BACKEND);
        assert_eq!(fx.forward(&tcp(CLIENT, 46_002, VIP, 80, ACK | PSH).bytes()), BACKEND);
        // A SYN on the closed tuple is a new connection, scheduled.
        let new_flows = fx.new_flows("web", BACKEND);
        assert_eq!(fx.forward(&tcp(CLIENT, 46_001, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows + 1);
        assert_eq!(fx.counter("held"), held + 2);
        fx.dp.hold_for(0).unwrap();
        assert_eq!(fx.forward(&tcp(CLIENT, 46_000, VIP, 80, ACK).bytes()), BACKEND);
        assert_eq!(fx.counter("held"), held + 2);
    });
}

/// While a migration swaps its program in, interface by interface, the
/// old program still runs on some of them and would see the backends'
/// side of a connection the new one opened: so a SYN that would open a
/// flow (no entry, or a closed one) waits for its retransmission too
/// (`held`), makes no entry and is not counted. An open flow's packets go
/// on. Once the swap is done (the hold of other packets stays), SYNs are
/// scheduled and counted again.
#[test]
fn a_migrations_swap_holds_syns_that_would_open_a_flow() {
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        assert_eq!(handshake(&fx, 49_000, 80, 8080), BACKEND);
        assert_eq!(handshake(&fx, 49_002, 80, 8080), BACKEND);
        assert_eq!(fx.forward(&tcp(CLIENT, 49_002, VIP, 80, RST).bytes()), BACKEND);
        fx.dp.hold_new_for(10).unwrap();
        let (held, new_flows) = (fx.counter("held"), fx.new_flows("web", BACKEND));
        assert_eq!(fx.run(&tcp(CLIENT, 49_001, VIP, 80, SYN).bytes(), fx.if_a).0, XDP_DROP, "no entry");
        assert_eq!(fx.run(&tcp(CLIENT, 49_002, VIP, 80, SYN).bytes(), fx.if_a).0, XDP_DROP, "a closed entry");
        assert_eq!(fx.counter("held"), held + 2);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows, "a held SYN is counted nowhere");
        assert!(fx.dp.flow(&key4(49_001)).unwrap().is_none(), "a held SYN makes no entry");
        assert_eq!(fx.forward(&tcp(CLIENT, 49_000, VIP, 80, ACK | PSH).bytes()), BACKEND, "an open flow");
        // The swap done: the hold of other packets stays, SYNs open flows.
        fx.dp.hold_for(10).unwrap();
        assert_eq!(fx.forward(&tcp(CLIENT, 49_001, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.forward(&tcp(CLIENT, 49_002, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows + 2);
        assert_eq!(fx.run(&tcp(CLIENT, 49_003, VIP, 80, ACK).bytes(), fx.if_a).0, XDP_DROP, "no entry, no SYN");
        assert_eq!(fx.counter("held"), held + 3);
        fx.dp.hold_for(0).unwrap();
    });
}

/// While a migration copies the old datapath's last flows, a SYN on an
/// entry whose handshake has not completed waits for its retransmission
/// too (`held`). The entry may be a copy taken half-open of a connection
/// the old program then saw complete and close, and the SYN a later
/// connection on the reused tuple: taken as the copy's retransmission, it
/// went uncounted (lbd's new flows one under the backends' connections),
/// and the late copy's close bits landed on the live connection. Its
/// retransmission after the late copy finds the closed entry and is
/// scheduled and counted as new; a copy the late copy leaves half-open
/// takes the SYN as its own retransmission, not counted, as ever.
#[test]
fn a_migrations_hold_keeps_a_syn_on_a_half_open_copy_for_its_retransmission() {
    use lb_common::{FLOW_ESTABLISHED as EST, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REPLIED};
    const CLOSED: u64 = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND;
    in_netns(|| {
        let mut fx = Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])]);
        let entry = |fx: &Fixture, p: u16| fx.dp.flow(&key4(p)).unwrap().expect("an entry");
        // 47,000 and 47,001: the client's SYN and the backend's answer,
        // not the client's ACK: half-open when the first copy takes them.
        for p in [47_000, 47_001] {
            assert_eq!(fx.forward(&tcp(CLIENT, p, VIP, 80, SYN).bytes()), BACKEND);
            assert_eq!(fx.run(&from_backend(BACKEND, 8080, p, SYN | ACK).bytes(), fx.if_b).0, XDP_REDIRECT);
        }
        let copies = first_copy(&fx, [47_000, 47_001]);
        assert_eq!(copies[&47_000].state, FLOW_REPLIED);
        // The swap: a SYN on either tuple waits.
        fx.dp.hold_for(10).unwrap();
        let (held, new_flows) = (fx.counter("held"), fx.new_flows("web", BACKEND));
        for p in [47_000, 47_001] {
            assert_eq!(fx.run(&tcp(CLIENT, p, VIP, 80, SYN).bytes(), fx.if_a).0, XDP_DROP, "{p}'s SYN");
        }
        assert_eq!(fx.counter("held"), held + 2);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows, "a held SYN is counted nowhere");
        let marked = lb_common::Flow { state: copies[&47_000].state | lb_common::FLOW_COPY, ..copies[&47_000] };
        assert_eq!(entry(&fx, 47_000), marked, "a held SYN changes nothing");
        // The late copy: the old program saw 47,000 complete and close
        // (and counted it), 47,001 not change.
        let later = |p: u16, state: u64| lb_common::Flow { state, last_seen: copies[&p].last_seen + 1, ..copies[&p] };
        let old = vec![(key4(47_000), later(47_000, FLOW_REPLIED | EST | CLOSED)), (key4(47_001), copies[&47_001])];
        let copied = copies.iter().map(|(&p, f)| (key4(p), f.state)).collect();
        let done = fx.dp.merge_flows(&old, &copied).unwrap();
        assert_eq!((done.merged, done.existed), (1, 1), "{done:?}");
        fx.dp.hold_for(0).unwrap();
        // The retransmissions: 47,000's is a new connection on the closed
        // tuple, scheduled and counted; 47,001's is its half-open
        // connection's own, forwarded and not counted again.
        assert_eq!(fx.forward(&tcp(CLIENT, 47_000, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows + 1, "the later connection on 47,000");
        assert_eq!(entry(&fx, 47_000).state & (EST | CLOSED), 0, "47,000's entry is the later connection's");
        assert_eq!(fx.forward(&tcp(CLIENT, 47_001, VIP, 80, SYN).bytes()), BACKEND);
        assert_eq!(fx.new_flows("web", BACKEND), new_flows + 1, "47,001's SYN is its retransmission");
        assert_eq!(fx.counter("held"), held + 2);
    });
}

/// The global-counter map an older lbd pinned has fewer counters than this
/// build counts (it adds them as the datapath learns new cases): the next
/// start replaces it with a map of the right size and carries every count
/// over, so an upgrade does not set `lb_dropped_packets_total` and its
/// kind back to 0. (The old map is made by bpftool here, as an older lbd
/// would have pinned it, with known per-CPU counts.)
#[test]
fn an_older_global_counter_map_is_replaced_with_its_counts_carried_over() {
    use aya::maps::{MapData, PerCpuArray, PerCpuValues};
    use lb_common::counter;
    use lb_userspace::{config::Config, dataplane::Dataplane};

    /// Removes the pinned datapath however the test ends.
    struct Pins(std::path::PathBuf);
    impl Drop for Pins {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let pins = Pins(format!("/sys/fs/bpf/lbt-counters-{}", std::process::id()).into());
    let cfg = Config { pin_path: pins.0.clone(), ..fixture_config(vec![]) };
    drop(Dataplane::load(&cfg).expect("first start"));
    let pinned = pins.0.join("maps/COUNTERS");
    let older = counter::COUNT - 1;
    std::fs::remove_file(&pinned).unwrap();
    sh(&[
        "bpftool",
        "map",
        "create",
        pinned.to_str().unwrap(),
        "type",
        "percpu_array",
        "key",
        "4",
        "value",
        "8",
        "entries",
        &older.to_string(),
        "name",
        "COUNTERS",
    ]);
    let ncpus = aya::util::nr_cpus().unwrap();
    let mut old: PerCpuArray<MapData, u64> =
        aya::maps::Map::PerCpuArray(MapData::from_pin(&pinned).unwrap()).try_into().unwrap();
    for i in 0..older {
        let per_cpu = (0..ncpus).map(|cpu| u64::from(i) * 1000 + cpu as u64).collect::<Vec<_>>();
        old.set(i, PerCpuValues::try_from(per_cpu).unwrap(), 0).unwrap();
    }
    drop(old);
    let dp = Dataplane::load(&cfg).expect("a start on the older counter map");
    let counts = dp.counters().unwrap();
    let cpus_sum = (0..ncpus as u64).sum::<u64>();
    for (i, name) in counter::NAMES.iter().enumerate().take(older as usize) {
        assert_eq!(counts[*name], i as u64 * 1000 * ncpus as u64 + cpus_sum, "{name}");
    }
    assert_eq!(counts[counter::NAMES[older as usize]], 0, "the counter the older map lacked starts at 0");
}

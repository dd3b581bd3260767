//! Packet fixtures (BPF_PROG_TEST_RUN, as `datapath.rs`) for VLAN-tagged
//! IPv4: one 802.1Q tag, and two (QinQ: 802.1ad outside). A tagged packet
//! is balanced like an untagged one and handed to the kernel rewritten,
//! its tags where they were (the kernel knows the egress VLAN). Expected
//! frames are etherparse's (`lb_testkit`), tags inserted byte by byte.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use lb_testkit::{
    Frame,
    frame::tcp::{ACK, SYN},
    frame6::Frame6,
};
use lb_tests::fixture::*;
use lb_userspace::config::{Forwarding, Protocol, ServiceConfig};

const TPID_8021Q: u16 = 0x8100;
const TPID_8021AD: u16 = 0x88a8;

/// `frame` with VLAN tags (TPID, TCI) inserted after its MACs, outermost first.
fn tagged(frame: &[u8], tags: &[(u16, u16)]) -> Vec<u8> {
    let mut out = frame[..12].to_vec();
    for &(tpid, tci) in tags {
        out.extend_from_slice(&tpid.to_be_bytes());
        out.extend_from_slice(&tci.to_be_bytes());
    }
    out.extend_from_slice(&frame[12..]);
    out
}

const ONE: &[(u16, u16)] = &[(TPID_8021Q, 20)];
const TWO: &[(u16, u16)] = &[(TPID_8021AD, 100), (TPID_8021Q, 20)];

fn web() -> Fixture {
    Fixture::new(vec![service("web", 80, Protocol::Tcp, &[(BACKEND, 8080)])])
}

#[test]
fn a_tagged_flow_is_balanced_both_ways_and_handed_to_the_kernel_with_its_tags() {
    for tags in [ONE, TWO] {
        in_netns(move || {
            let fx = web();
            let syn = tcp(CLIENT, 40000, VIP, 80, SYN);
            let (action, out) = fx.run(&tagged(&syn.bytes(), tags), fx.if_a);
            assert_eq!(action, XDP_PASS, "{tags:x?}: the kernel forwards it, into its VLAN");
            // Rewritten to the backend; TTL, MACs and tags as they came.
            let want = Frame { dst: BACKEND, dport: 8080, ..syn.clone() };
            assert_eq!(out, tagged(&want.bytes(), tags), "{tags:x?}");
            assert_eq!(fx.new_flows("web", BACKEND), 1);
            // The flow's next packet: same backend, not new.
            let ack = Frame { tcp_flags: ACK, ..syn };
            let (action, out) = fx.run(&tagged(&ack.bytes(), tags), fx.if_a);
            assert_eq!((action, out), (XDP_PASS, tagged(&Frame { dst: BACKEND, dport: 8080, ..ack }.bytes(), tags)));
            // The backend's answer, tagged on its side: back from the VIP.
            let answer = Frame::tcp(BACKEND, 8080, CLIENT, 40000, SYN | ACK).macs(GW_B_MAC, BACKEND_MAC);
            let (action, out) = fx.run(&tagged(&answer.bytes(), tags), fx.if_b);
            assert_eq!(action, XDP_PASS);
            assert_eq!(out, tagged(&Frame { src: VIP, sport: 80, ..answer }.bytes(), tags));
            assert_eq!(fx.new_flows("web", BACKEND), 1);
            assert_eq!(fx.counter("vlan"), 3);
            assert_eq!(fx.counter("xdp_redirect"), 0);
        });
    }
}

#[test]
fn tagged_frames_that_are_not_ours_pass_untouched_and_broken_ones_are_never_forwarded() {
    in_netns(|| {
        let fx = web();
        // Not to a VIP; IPv6 in a tag; a third tag.
        let other = tagged(&tcp(CLIENT, 40001, BACKEND_UNRESOLVED, 80, SYN).bytes(), ONE);
        let v6 = tagged(&Frame6::tcp(CLIENT6, 40001, VIP6, 80, SYN).macs(GW_A_MAC, CLIENT_MAC).bytes(), ONE);
        let three =
            tagged(&tcp(CLIENT, 40001, VIP, 80, SYN).bytes(), &[(TPID_8021AD, 1), (TPID_8021Q, 2), (TPID_8021Q, 3)]);
        for f in [other, v6, three] {
            assert_eq!(fx.run(&f, fx.if_a), (XDP_PASS, f.clone()));
        }
        // A tagged SYN cut at every length: never rewritten.
        for tags in [ONE, TWO] {
            let whole = tagged(&tcp(CLIENT, 40002, VIP, 80, SYN).bytes(), tags);
            for len in 14..whole.len() {
                let (action, out) = fx.run(&whole[..len], fx.if_a);
                assert!(
                    (action == XDP_PASS && out == whole[..len]) || action == XDP_DROP,
                    "{tags:x?} cut at {len}: action {action}"
                );
            }
        }
        assert!(fx.counter("malformed") > 0, "truncations past the IPv4 header are counted");
        assert_eq!(fx.new_flows("web", BACKEND), 0);
        assert_eq!(fx.counter("vlan"), 0);
    });
}

#[test]
fn direct_server_return_does_not_serve_tagged_frames() {
    in_netns(|| {
        let svc = ServiceConfig { forwarding: Forwarding::Dsr, ..service("web", 80, Protocol::Tcp, &[(BACKEND, 80)]) };
        let fx = Fixture::new(vec![svc]);
        let syn = tagged(&tcp(CLIENT, 40003, VIP, 80, SYN).bytes(), ONE);
        assert_eq!(fx.run(&syn, fx.if_a).0, XDP_DROP);
        assert_eq!(fx.counter("dsr_off_link"), 1);
    });
}

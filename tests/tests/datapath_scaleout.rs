//! Two balancer nodes in one fixture (issue 14): two datapaths loaded and
//! programmed independently, the same pool listed in different orders, fed
//! the same frames through BPF_PROG_TEST_RUN. A flow that moves to the
//! other node mid-connection (its first packet there is not a SYN) must
//! reach the backend the first node chose. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::Ipv4Addr;

use lb_testkit::frame::tcp::{ACK, SYN};
use lb_tests::fixture::*;
use lb_userspace::{config::Protocol, sched::Scheduler};

const THIRD: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 13);
const FLOWS: u16 = 300;

/// A node with `scheduler` over the three backends, listed in `order`,
/// hashing with `seed`.
fn node(scheduler: Scheduler, order: [Ipv4Addr; 3], seed: u64) -> Fixture {
    let backends: Vec<(Ipv4Addr, u16)> = order.iter().map(|&a| (a, 8080)).collect();
    Fixture::with_config(vec![service_with("web", 80, Protocol::Tcp, scheduler, &backends)], |c| {
        c.maglev_seed = seed;
    })
}

fn new_flows(fx: &Fixture) -> u64 {
    [BACKEND, BACKEND_UNRESOLVED, THIRD].iter().map(|&b| fx.new_flows("web", b)).sum()
}

/// For every scheduler: a mid-connection packet that finds no entry is
/// scheduled by the consistent-hash table, identical on both nodes, so
/// both send it to the same backend; it takes an entry there without
/// counting as a new flow, and the flow's next packets stay. Where the
/// scheduler is consistent hashing (maglev, source-hash), that is also
/// the backend the first node gave the flow's SYN: an established
/// connection survives the move. A node with another `maglev_seed`
/// disagrees (so the agreement is the tables', not chance).
#[test]
fn a_flow_that_moves_to_another_node_mid_connection_keeps_its_backend() {
    in_netns(|| {
        for s in Scheduler::ALL {
            let a = node(s, [BACKEND, BACKEND_UNRESOLVED, THIRD], 7);
            let mut b = node(s, [THIRD, BACKEND, BACKEND_UNRESOLVED], 7);
            let other_seed = node(s, [BACKEND, BACKEND_UNRESOLVED, THIRD], 8);
            let (mut kept, mut same_hash, mut differs) = (0, 0, 0);
            for i in 0..FLOWS {
                // Each flow from its own client (source-hash hashes the
                // client alone), the flows without an entry from others.
                let client = Ipv4Addr::new(10, 10, 1 + (i / 200) as u8, 1 + (i % 200) as u8);
                let other = Ipv4Addr::new(10, 10, 5 + (i / 200) as u8, 1 + (i % 200) as u8);
                let port = 20_000 + i;
                let first = a.forward(&tcp(client, port, VIP, 80, SYN).bytes());
                // The router moves the flow: its next packet reaches b.
                let moved = b.forward(&tcp(client, port, VIP, 80, ACK).bytes());
                // What either node says of a flow it has no entry for.
                let fresh = a.forward(&tcp(other, port, VIP, 80, ACK).bytes());
                let fresh_b = b.forward(&tcp(other, port, VIP, 80, ACK).bytes());
                same_hash += u32::from(fresh == fresh_b);
                kept += u32::from(first == moved);
                let seeded = other_seed.forward(&tcp(other, port, VIP, 80, ACK).bytes());
                differs += u32::from(seeded != fresh);
                for _ in 0..2 {
                    assert_eq!(b.forward(&tcp(client, port, VIP, 80, ACK).bytes()), moved, "{s}: flow {port} on b");
                }
            }
            println!(
                "{s}: {kept}/{FLOWS} moved flows kept their backend, nodes agreed on {same_hash}/{FLOWS} flows without an entry, another seed disagreed on {differs}"
            );
            assert_eq!(same_hash, u32::from(FLOWS), "{s}: the nodes' consistent-hash answers differ");
            assert!(differs > u32::from(FLOWS) / 3, "{s}: another seed changed only {differs} answers");
            if matches!(s, Scheduler::Maglev | Scheduler::SourceHash) {
                assert_eq!(kept, u32::from(FLOWS), "{s}: a moved flow changed backend");
            }
            // The moved flows took entries on b, none counted as new.
            assert_eq!(new_flows(&b), 0, "{s}: a moved flow was counted as new on b");
            assert_eq!(b.entries(), 2 * u64::from(FLOWS), "{s}: entries on b");
        }
    });
}

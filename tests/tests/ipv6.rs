//! IPv6 through the balancer in the lab (issue 13), beside IPv4 in the same
//! lbd: HTTP over TCP and UDP datagram flows to IPv6 VIPs, NAT both ways.
//! Every connection and flow succeeds, lbd's per-backend counts equal what
//! the backends counted themselves, every packet of a flow (keep-alive
//! requests, datagrams of one socket) reaches one backend, and the
//! datapath did the forwarding (native XDP, redirects). Needs root; one lab
//! at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{IpAddr, SocketAddr};

use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{Lab, LabSpec, VIP6},
    lbd::{Lbd, path_counts, wait_for, write_config_for, xdp_mode_in_use},
};

const PREFIX: &str = "lbt-v6";

fn services(lab: &Lab) -> String {
    let mut s = web("", &[(1, 1), (2, 1), (3, 1)]);
    for (name, port, proto) in [("web6", 80, "tcp"), ("dns6", 53, "udp")] {
        s.push_str(&format!(
            "  - name: {name}\n    vip: \"{VIP6}\"\n    port: {port}\n    protocol: {proto}\n    backends:\n"
        ));
        for a in lab.backend_addrs6() {
            s.push_str(&format!("      - {{ address: \"{a}\", port: 8080 }}\n"));
        }
    }
    s
}

/// A client report without its per-source detail.
fn summary(r: &serde_json::Value) -> serde_json::Value {
    let mut r = r.clone();
    if let Some(m) = r.as_object_mut() {
        m.remove("per_source_backends");
    }
    r
}

/// lbd's new-flow count of each backend of `service` (lab order).
fn new_flows(lbd: &Lbd, service: &str, addrs: &[IpAddr]) -> Vec<u64> {
    let status = lbd.status().unwrap();
    addrs.iter().map(|a| Lbd::new_flows(&status, service, &a.to_string()).unwrap()).collect()
}

#[test]
fn ipv6_http_and_udp_are_balanced_exactly_beside_ipv4() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec { prefix: PREFIX.into(), backends: 3, ..LabSpec::default() }).expect("lab up");
    let sock = socket_for(PREFIX);
    let config = write_config_for(&config_dir(PREFIX), "lbd", &sock, &lab.gw_interfaces(), &services(&lab)).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    let v6: Vec<IpAddr> = lab.backend_addrs6().into_iter().map(IpAddr::from).collect();
    let v4: Vec<IpAddr> = lab.backend_addrs().into_iter().map(IpAddr::from).collect();
    let sources6: Vec<String> = lab.client_sources6().iter().take(100).map(ToString::to_string).collect();
    let sources6 = sources6.join(",");
    let target6 = SocketAddr::new(VIP6.into(), 80).to_string();
    // The IPv6 health probes find every backend up.
    let up = wait_for(10, || v6.iter().all(|a| lbd.backend_state("web6", &a.to_string()) == "up").then_some(()));
    assert!(
        up.is_some(),
        "IPv6 backends not up: {:?}",
        v6.iter().map(|a| lbd.backend_state("web6", &a.to_string())).collect::<Vec<_>>()
    );
    lab.reset_backend_counts().unwrap();

    // 1. 1,000 IPv6 HTTP connections from 100 source addresses while 500
    // IPv4 ones go to the IPv4 service of the same lbd.
    let (r6, r4) = std::thread::scope(|scope| {
        let t6 = scope.spawn(|| {
            lab.client(&[
                "conns",
                "--target",
                &target6,
                "--count",
                "1000",
                "--concurrency",
                "10",
                "--sources",
                &sources6,
            ])
            .unwrap()
        });
        let t4 = scope.spawn(|| {
            lab.client(&[
                "conns",
                "--target",
                "10.10.0.100:80",
                "--count",
                "500",
                "--sources-range",
                "10.10.1.1-10.10.1.100",
            ])
            .unwrap()
        });
        (t6.join().unwrap(), t4.join().unwrap())
    });
    println!("IPv6 HTTP: {}\nIPv4 HTTP beside it: {}", summary(&r6), summary(&r4));
    assert_eq!((r6["ok"].as_u64(), r6["failed"].as_u64()), (Some(1000), Some(0)), "{r6}");
    assert_eq!((r4["ok"].as_u64(), r4["failed"].as_u64()), (Some(500), Some(0)), "{r4}");
    let (ours6, ours4) = (new_flows(&lbd, "web6", &v6), new_flows(&lbd, "web", &v4));
    let theirs: Vec<u64> = lab.backend_counts().unwrap().iter().map(|c| c.connections).collect();
    let both: Vec<u64> = ours6.iter().zip(&ours4).map(|(a, b)| a + b).collect();
    println!("new flows: IPv6 {ours6:?} + IPv4 {ours4:?}; backends accepted {theirs:?}");
    assert_eq!(ours6.iter().sum::<u64>(), 1000);
    assert_eq!(ours4.iter().sum::<u64>(), 500);
    assert_eq!(both, theirs, "lbd's per-backend counts are the backends' own");
    assert!(ours6.iter().all(|&n| n > 200), "Maglev spreads the IPv6 connections: {ours6:?}");

    // 2. Affinity: 30 keep-alive connections, 20 requests each, each
    // answered by one backend throughout.
    let r = lab
        .client(&["longlived", "--target", &target6, "--connections", "30", "--rounds", "20", "--sources", &sources6])
        .unwrap();
    println!("IPv6 keep-alive: {r}");
    assert_eq!(
        (r["ok_rounds"].as_u64(), r["failed"].as_u64(), r["switched"].as_u64()),
        (Some(600), Some(0), Some(0)),
        "{r}"
    );

    // 3. 1,000 IPv6 UDP flows of 3 datagrams each: every answer, every flow
    // on one backend, and the new flows are the flows.
    lab.reset_backend_counts().unwrap();
    let target = SocketAddr::new(VIP6.into(), 53).to_string();
    let r = lab
        .client(&["udp", "--target", &target, "--count", "1000", "--per-socket", "3", "--sources", &sources6])
        .unwrap();
    println!("IPv6 UDP: {r}");
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(3000), Some(0)), "{r}");
    assert_eq!((r["flows_switched"].as_u64(), r["replies_from_other_addr"].as_u64()), (Some(0), Some(0)), "{r}");
    let ours = new_flows(&lbd, "dns6", &v6);
    let datagrams: Vec<u64> = lab.backend_counts().unwrap().iter().map(|c| c.udp_datagrams).collect();
    let answered: Vec<u64> = ["be1", "be2", "be3"].iter().map(|b| r["per_backend"][b].as_u64().unwrap_or(0)).collect();
    println!("UDP new flows {ours:?}, datagrams each backend received {datagrams:?}");
    // A later socket may reuse an earlier one's port: the same 5-tuple is
    // one flow to the balancer. New flows count the distinct 5-tuples.
    assert_eq!(ours.iter().sum::<u64>(), r["distinct_flows"].as_u64().unwrap(), "one new flow per 5-tuple");
    assert_eq!(datagrams, answered, "each backend answered every datagram it received, and only those");

    // What the datapath did: native XDP on the gateway's interfaces (the
    // default xdp_mode, auto), the traffic left by XDP redirect.
    for iface in lab.gw_interfaces() {
        assert_eq!(xdp_mode_in_use(&lab, &iface).unwrap().as_deref(), Some("native"), "{iface}");
    }
    let status = lbd.status().unwrap();
    let (redirected, kernel, forwarded) = path_counts(&status);
    println!("paths: {redirected} by XDP redirect, {kernel} through the kernel, of {forwarded}");
    assert_eq!(redirected + kernel, forwarded, "every forwarded packet took one path: {}", status["counters"]);
    assert!(kernel * 20 < redirected, "XDP redirect carried too little: {}", status["counters"]);
}

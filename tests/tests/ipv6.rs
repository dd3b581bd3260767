//! IPv6 through the balancer in the lab (issue 13), beside IPv4 in the same
//! lbd: HTTP over TCP and UDP datagram flows to IPv6 VIPs, NAT both ways.
//! Every connection and flow succeeds, lbd's per-backend counts equal what
//! the backends counted themselves, every packet of a flow (keep-alive
//! requests, datagrams of one socket) reaches one backend, and the
//! datapath did the forwarding (native XDP, redirects). Needs root; one lab
//! at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Instant;

use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{GW6_BACKEND, GW6_CLIENT, Lab, LabSpec, ROUTED_GW6, Topology, VIP6},
    lbd::{Lbd, path_counts, wait_for, write_config_for, xdp_mode_in_use},
};

const PREFIX: &str = "lbt-v6";

/// stdout of a command that must succeed.
fn output(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The gateway's count of forwarded IPv6 packets.
fn forwarded6(lab: &Lab) -> u64 {
    let text = output(lab.cmd("gw", "cat").arg("/proc/net/snmp6"));
    let v = text.lines().find_map(|l| l.strip_prefix("Ip6OutForwDatagrams")).expect("Ip6OutForwDatagrams");
    v.trim().parse().expect("a number")
}

/// The client's route to `dst`, as `ip -6 route get` prints it.
fn client_route(lab: &Lab, dst: &str) -> String {
    output(lab.cmd("client", "ip").args(["-6", "route", "get", dst]))
}

/// IPv6 in every lab topology, without a balancer: the gateway holds
/// fd00:10::1 and fd00:20::1 on the interfaces that hold 10.10.0.1 and
/// 10.20.0.1, no address anywhere is still tentative when `Lab::up`
/// returns (nothing waits for duplicate address detection), the client
/// reaches every backend through the gateway from fd00:10::2 (its default
/// source, as 10.10.0.2 is for IPv4) and from an extra source, and keeps
/// going through it (one-arm: ICMPv6 redirects ignored).
#[test]
fn ipv6_goes_through_the_gateway_in_every_topology() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-v6topo";
    for t in Topology::ALL {
        let name = t.name();
        let lab = Lab::up(LabSpec {
            prefix: prefix.into(),
            backends: 2,
            client_sources: 4,
            topology: t,
            ..LabSpec::default()
        })
        .unwrap_or_else(|e| panic!("{name}: lab up: {e:#}"));
        let mut roles = vec!["client".to_owned(), "gw".to_owned()];
        roles.extend(lab.backend_names());
        for role in &roles {
            let addrs = output(lab.cmd(role, "ip").args(["-6", "addr", "show"]));
            assert!(!addrs.contains("tentative"), "{name}: {role} has tentative addresses:\n{addrs}");
        }
        let ifs = lab.gw_interfaces();
        let (client_side, backend_side) = (&ifs[0], &ifs[ifs.len() - 1]);
        let gw = output(Command::new("ip").args(["-n", &lab.ns("gw"), "-6", "-o", "addr", "show"]));
        // In `routed`, the backends' gateway is the router; the gateway has
        // the link to it.
        let backend_addr = if t == Topology::Routed { ROUTED_GW6 } else { GW6_BACKEND };
        for (dev, addr) in [(client_side, GW6_CLIENT), (backend_side, backend_addr)] {
            assert!(
                gw.lines().any(|l| l.contains(&format!(" {dev} ")) && l.contains(&format!("{addr}/64"))),
                "{name}: {addr}/64 on {dev}:\n{gw}"
            );
        }
        let before = forwarded6(&lab);
        let mut took = Vec::new();
        for (i, addr) in lab.backend_addrs6().iter().enumerate() {
            let route = client_route(&lab, &addr.to_string());
            assert!(
                route.contains(&format!("via {GW6_CLIENT} ")) && route.contains("src fd00:10::2 "),
                "{name}: client route to {addr}: {route}"
            );
            let start = Instant::now();
            let body =
                output(lab.cmd("client", "curl").args(["-s", "--max-time", "3"]).arg(format!("http://[{addr}]:8080/")));
            took.push(start.elapsed());
            assert!(body.starts_with(&format!("backend=be{} ", i + 1)), "{name}: {addr} answered {body:?}");
        }
        let src = lab.client_sources6()[2].to_string();
        let addr = lab.backend_addrs6()[1];
        let body = output(
            lab.cmd("client", "curl")
                .args(["-s", "--max-time", "3", "--interface", &src])
                .arg(format!("http://[{addr}]:8080/")),
        );
        assert!(body.starts_with("backend=be2 "), "{name}: from {src}: {body:?}");
        let fwd = forwarded6(&lab) - before;
        // Handshake, request, response and close of each of 3 connections.
        assert!(fwd >= 3 * 6, "{name}: the gateway forwarded only {fwd} IPv6 packets");
        for addr in lab.backend_addrs6() {
            let route = client_route(&lab, &addr.to_string());
            assert!(
                route.contains(&format!("via {GW6_CLIENT} ")),
                "{name}: after the traffic, the client routes {addr}: {route}"
            );
        }
        println!("{name:>15}: IPv6 through the gateway ({fwd} packets forwarded), first connections took {took:?}");
        drop(lab);
    }
    let left = output(Command::new("ip").args(["netns", "list"]));
    assert!(!left.lines().any(|l| l.starts_with(&format!("{prefix}-"))), "namespaces left behind:\n{left}");
}

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
        let t6 = scope.spawn(|| lab.conns(&target6, 1000, 10, &["--sources", &sources6]).unwrap());
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
    // Per service: what each backend accepted on its IPv6 address, and on
    // its IPv4 one.
    let counts = lab.backend_counts().unwrap();
    let at6: Vec<u64> = counts.iter().zip(&v6).map(|(c, a)| c.at(*a).connections).collect();
    let at4: Vec<u64> = counts.iter().zip(&v4).map(|(c, a)| c.at(*a).connections).collect();
    assert_eq!(ours6, at6, "web6: lbd's per-backend counts are what the backends accepted over IPv6");
    assert_eq!(ours4, at4, "web: lbd's per-backend counts are what the backends accepted over IPv4");
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
    if r["failed"].as_u64() != Some(0) {
        // Where a lost datagram went, while the lab is still up: the
        // datapath's own counters and every device's drops.
        let status = lbd.status().unwrap();
        println!("lbd counters: {}", status["counters"]);
        for role in lab.all_roles() {
            if let Ok(out) = lab.cmd(&role, "ip").args(["-s", "-s", "link"]).output() {
                println!("{role}: ip -s -s link:\n{}", String::from_utf8_lossy(&out.stdout));
            }
        }
    }
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
    let flows: Vec<u64> = lab.backend_counts().unwrap().iter().zip(&v6).map(|(c, a)| c.at(*a).udp_flows).collect();
    assert_eq!(ours, flows, "dns6: per backend, lbd's new flows are the distinct peers the backend saw");

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

/// Kernel-default offloads (the `mixed` topology: the client's veth leaves
/// its TCP/UDP checksums unfinished, the gateway's client side runs native
/// XDP): IPv6 packets with unfinished checksums are finished by the
/// datapath and leave by XDP redirect, as IPv4's do, and every request is
/// answered. (Before, they took the kernel's forwarding path.)
#[test]
fn ipv6_unfinished_checksums_are_finished_for_native_redirect() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-v6csum";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 3, topology: Topology::Mixed, ..LabSpec::default() })
        .expect("lab up");
    let sock = socket_for(prefix);
    let config = write_config_for(&config_dir(prefix), "lbd", &sock, &lab.gw_interfaces(), &services(&lab)).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    let v6: Vec<IpAddr> = lab.backend_addrs6().into_iter().map(IpAddr::from).collect();
    let up = wait_for(10, || v6.iter().all(|a| lbd.backend_state("web6", &a.to_string()) == "up").then_some(()));
    assert!(up.is_some(), "IPv6 backends not up");
    let sources6: Vec<String> = lab.client_sources6().iter().take(20).map(ToString::to_string).collect();
    let sources6 = sources6.join(",");
    let web = SocketAddr::new(VIP6.into(), 80).to_string();
    let r = lab.client(&["conns", "--target", &web, "--count", "300", "--sources", &sources6]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{}", summary(&r));
    let dns = SocketAddr::new(VIP6.into(), 53).to_string();
    let r =
        lab.client(&["udp", "--target", &dns, "--count", "100", "--per-socket", "3", "--sources", &sources6]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{r}");
    assert_eq!(r["flows_switched"].as_u64(), Some(0), "{r}");

    let status = lbd.status().unwrap();
    let c = &status["counters"];
    let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("no {k} in {c}"));
    println!("counters: {c}");
    // The client's checksums arrived unfinished, and none of those packets
    // took the kernel's path: finished here, redirected.
    assert!(n("csum_partial") >= 300 + 300, "too few unfinished checksums seen: {c}");
    assert_eq!(n("kernel_egress"), 0, "{c}");
    let (redirected, kernel, forwarded) = path_counts(&status);
    assert_eq!(redirected + kernel, forwarded, "every forwarded packet took one path: {c}");
    assert!(kernel * 20 < redirected, "XDP redirect carried too little: {c}");
    // The mode in use on the client side is native (where the finishing
    // matters: generic mode keeps the skb's mark).
    let client_side = &lab.gw_interfaces()[0];
    assert_eq!(xdp_mode_in_use(&lab, client_side).unwrap().as_deref(), Some("native"), "{client_side}");
}

//! Where it runs: the balancer with its default configuration (`xdp_mode:
//! auto`) on every lab topology, with every device's offloads at kernel
//! defaults (and the tuned lab as the fast-path reference). Per topology:
//! the XDP mode the kernel reports on each interface is the one `auto`
//! must pick; 2,000 new HTTP connections and 20 long-lived ones pass with
//! no failure; lbd's new-flow counters equal the backends' accept counts;
//! UDP flows of several datagrams each stay on one backend (a second
//! service); 300 IPv6 connections pass (a third service); and the path counters account for every forwarded packet,
//! agreeing with the path lbd reports. Prints the share of packets that
//! left by XDP redirect. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::collections::BTreeMap;

use lb_tests::{
    harness::{config_dir, serial, socket_for},
    lab::{Lab, LabSpec, Topology, VIP6},
    lbd::{Lbd, assert_xdp_mode, path_counts, wait_for, write_config_for, xdp_mode_in_use},
};

const SERVICES: &str = "  - name: web
    vip: 10.10.0.100
    port: 80
    protocol: tcp
    scheduler: maglev
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 1 }
      - { address: 10.20.0.13, port: 8080, weight: 1 }
  - name: dns
    vip: 10.10.0.101
    port: 53
    protocol: udp
    scheduler: maglev
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 1 }
      - { address: 10.20.0.13, port: 8080, weight: 1 }
";

/// What `auto` must choose on each gateway interface, and why (see the
/// README's "Where it runs").
fn expected_modes(t: Topology) -> Vec<(&'static str, &'static str)> {
    match t {
        // GRO on the veth peers: both directions take native redirects.
        Topology::Tuned => vec![("eth0", "native"), ("eth1", "native")],
        // Default veths: no peer has XDP or GRO, native redirects would be dropped.
        Topology::Default => vec![("eth0", "generic"), ("eth1", "generic")],
        // A bridge has no native XDP and cannot transmit native redirects.
        Topology::BridgeBackend => vec![("eth0", "generic"), ("br0", "generic")],
        Topology::BridgeClient => vec![("br0", "generic"), ("eth1", "generic")],
        // One veth whose peer takes no native redirects.
        Topology::OneArm => vec![("eth0", "generic")],
        // eth1's peer runs XDP (native redirects into eth1 work), eth0's does not.
        Topology::Mixed => vec![("eth0", "native"), ("eth1", "generic")],
        // Neither a macvlan nor a VXLAN device has native XDP.
        Topology::Macvlan => vec![("eth0", "generic"), ("eth1", "generic")],
        Topology::Vxlan => vec![("eth0", "generic"), ("eth1", "generic")],
        // Default veths, the backends behind a router.
        Topology::Routed => vec![("eth0", "generic"), ("eth1", "generic")],
        // On each node, as Mixed: GRO on the switch end of eth1.
        Topology::Ecmp => vec![("eth0", "native"), ("eth1", "generic")],
    }
}

/// The IPv4 services and an IPv6 HTTP service on the same backends.
fn services(lab: &Lab) -> String {
    let mut s = SERVICES.to_owned();
    s.push_str(&format!("  - name: web6\n    vip: \"{VIP6}\"\n    port: 80\n    protocol: tcp\n    backends:\n"));
    for a in lab.backend_addrs6() {
        s.push_str(&format!("      - {{ address: \"{a}\", port: 8080 }}\n"));
    }
    s
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

fn counters(status: &serde_json::Value) -> BTreeMap<String, u64> {
    serde_json::from_value(status["counters"].clone()).expect("counters")
}

fn run_topology(t: Topology) {
    let prefix = "lbt-where";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 3, topology: t, ..LabSpec::default() })
        .unwrap_or_else(|e| panic!("{}: lab up: {e:#}", t.name()));
    let sock = socket_for(prefix);
    let config = write_config_for(&config_dir(prefix), "lbd", &sock, &lab.gw_interfaces(), &services(&lab)).unwrap();
    let mut lbd = Lbd::start(&lab, &config, &sock).unwrap_or_else(|e| panic!("{}: lbd start: {e:#}", t.name()));
    let status = lbd.status().unwrap();

    // The mode in use, as the kernel reports it, is what auto must pick
    // and what lbd says it uses.
    check_modes(t, &lab, &lbd, "first start");
    // lbd reports a path for every ingress and each egress it forwards
    // to (the other interfaces; itself on a one-arm gateway), and logged
    // each one.
    let log = lbd.log_text();
    let paths = status["paths"].as_array().unwrap();
    let ifaces = lab.gw_interfaces();
    let want = if ifaces.len() == 1 { 1 } else { ifaces.len() * (ifaces.len() - 1) };
    assert_eq!(paths.len(), want, "{}: paths {status}", t.name());
    for p in paths {
        let (i, e) = (p["ingress"].as_str().unwrap(), p["egress"].as_str().unwrap());
        assert!(
            log.lines().any(|l| l.contains("forwarding path")
                && l.contains(&format!("ingress={i} "))
                && l.contains(&format!("egress={e} "))),
            "{}: no path line for {i} -> {e} in the log:\n{log}",
            t.name()
        );
    }
    lab.reset_backend_counts().unwrap();

    // 20 long-lived connections while 2,000 new ones come and go.
    let long = std::thread::scope(|sc| {
        let long = sc.spawn(|| {
            lab.client(&[
                "longlived",
                "--target",
                "10.10.0.100:80",
                "--connections",
                "20",
                "--rounds",
                "200",
                "--interval-ms",
                "20",
                "--sources-range",
                "10.10.1.231-10.10.1.250",
            ])
        });
        let conns = lab.conns("10.10.0.100:80", 2000, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
        assert_eq!(u(&conns, "failed"), 0, "{}: failed connections: {conns}", t.name());
        assert_eq!(u(&conns, "ok"), 2000, "{}: {conns}", t.name());
        long.join().unwrap()
    });
    let long = long.unwrap_or_else(|e| panic!("{}: long-lived connections: {e:#}", t.name()));
    assert_eq!(u(&long, "failed"), 0, "{}: long-lived failures: {long}", t.name());

    // UDP through the second service: 50 flows of 5 datagrams, each flow
    // answered by one backend throughout.
    let udp =
        lab.udp("10.10.0.101:53", 50, 5, &["--concurrency", "5", "--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!(u(&udp, "failed"), 0, "{}: UDP failures: {udp}", t.name());
    assert_eq!(u(&udp, "ok"), 250, "{}: {udp}", t.name());
    assert_eq!(u(&udp, "flows_switched"), 0, "{}: a UDP flow changed backend: {udp}", t.name());

    // IPv6 through the same interfaces: 300 connections from 20 sources
    // once the IPv6 health probes find the backends up.
    let up = wait_for(10, || {
        lab.backend_addrs6().iter().all(|a| lbd.backend_state("web6", &a.to_string()) == "up").then_some(())
    });
    assert!(up.is_some(), "{}: IPv6 backends not up", t.name());
    let sources6: Vec<String> = lab.client_sources6().iter().take(20).map(ToString::to_string).collect();
    let target6 = format!("[{VIP6}]:80");
    let r6 = lab.conns(&target6, 300, 10, &["--sources", &sources6.join(",")]).unwrap();
    assert_eq!(u(&r6, "failed"), 0, "{}: IPv6 failures: {r6}", t.name());
    assert_eq!(u(&r6, "ok"), 300, "{}: {r6}", t.name());

    let status = lbd.status().unwrap();
    // New-flow counters (IPv4 and IPv6) equal the backends' own accept counts.
    let counts = lab.backend_counts().unwrap();
    for (i, (addr, addr6)) in lab.backend_addrs().iter().zip(lab.backend_addrs6()).enumerate() {
        let ours = Lbd::new_flows(&status, "web", &addr.to_string()).unwrap()
            + Lbd::new_flows(&status, "web6", &addr6.to_string()).unwrap();
        assert_eq!(
            ours,
            counts[i].connections,
            "{}: lbd counted {ours} new flows for {addr} and {addr6}, the backend {counts:?}",
            t.name()
        );
        let udp_flows = Lbd::new_flows(&status, "dns", &addr.to_string()).unwrap();
        assert!(udp_flows <= 50, "{}: {udp_flows} UDP flows on {addr}", t.name());
    }
    let total_udp: u64 =
        lab.backend_addrs().iter().map(|a| Lbd::new_flows(&status, "dns", &a.to_string()).unwrap()).sum();
    assert_eq!(total_udp, 50, "{}: UDP flows counted", t.name());

    // Every forwarded packet left by exactly one path, and the counters say
    // which; they agree with the paths lbd reports.
    let c = counters(&status);
    let (redirect, kernel, forwarded) = path_counts(&status);
    assert_eq!(redirect + kernel, forwarded, "{}: path counters {c:?} do not add up to {forwarded} packets", t.name());
    for k in ["malformed", "no_backend", "flow_table", "fragment", "ttl_expired"] {
        assert_eq!(c[k], 0, "{}: counter {k} = {}: {c:?}", t.name(), c[k]);
    }
    // A one-arm gateway sends every packet it forwards by XDP back out of
    // the interface it came in on, by XDP_TX; a gateway with two sides
    // none (clients and backends are each behind one of them).
    let sent_back = if ifaces.len() == 1 { c["xdp_redirect"] } else { 0 };
    assert_eq!(c["xdp_tx"], sent_back, "{}: packets sent back out by XDP_TX: {c:?}", t.name());
    let all_redirect = status["paths"].as_array().unwrap().iter().all(|p| p["path"] == "xdp_redirect");
    let share = redirect as f64 / forwarded as f64;
    // The neighbours are known now: a second round shows the steady state.
    let again = lab
        .client(&["conns", "--target", "10.10.0.100:80", "--count", "500", "--sources-range", "10.10.1.1-10.10.1.250"])
        .unwrap();
    assert_eq!(u(&again, "failed"), 0, "{}: {again}", t.name());
    let later = lbd.status().unwrap();
    let c2 = counters(&later);
    let (redirect2, _, total2) = path_counts(&later);
    let forwarded2 = total2 - forwarded;
    let steady = (redirect2 - redirect) as f64 / forwarded2 as f64;
    println!(
        "topology {:<15} modes {:?}: {forwarded} packets, {:.2}% by XDP redirect ({:.2}% of the next {forwarded2} after warm-up; {} of all by XDP_TX), {} kernel_egress, {} fib_fallback, {} unfinished checksums",
        t.name(),
        expected_modes(t),
        share * 100.0,
        steady * 100.0,
        c["xdp_tx"],
        c["kernel_egress"],
        c["fib_fallback"],
        c["csum_partial"]
    );
    if all_redirect {
        assert_eq!(c["kernel_egress"], 0, "{}: lbd reports XDP redirect everywhere, yet {c:?}", t.name());
        // Only first packets towards a not-yet-resolved neighbour take
        // the kernel path: 250 IPv4 and 20 IPv6 client source addresses,
        // 3 backends in each family, and as before a few more while one
        // is being resolved.
        let neighbours = 250 + 20 + 2 * 3;
        assert!(c["fib_fallback"] <= neighbours + 37, "{}: {c:?}", t.name());
        assert!(steady >= 0.99, "{}: only {:.2}% by XDP redirect after warm-up: {c2:?}", t.name(), steady * 100.0);
    } else {
        assert!(c["kernel_egress"] > 0, "{}: lbd reports a kernel path, no packet took it: {c:?}", t.name());
    }
    if t == Topology::Tuned {
        // The senders finish their checksums there.
        assert_eq!(c["csum_partial"], 0, "{c:?}");
    }
    if t == Topology::Mixed {
        // Default offloads: the client leaves checksums unfinished, and the
        // native eth0 finishes them before redirecting.
        assert!(c["csum_partial"] > 0, "{c:?}");
    }

    // A crash and a restart change nothing an operator sees: the new lbd
    // adopts the pinned links in the modes the kernel runs them in, takes
    // the same paths, and forwards as before, by the same path.
    let first = lbd.program_id().unwrap();
    lbd.kill().unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).unwrap_or_else(|e| panic!("{}: lbd restart: {e:#}", t.name()));
    assert_ne!(lbd.program_id(), Some(first), "{}: the restarted lbd did not swap in its program", t.name());
    check_modes(t, &lab, &lbd, "after a kill and restart");
    // The same configuration: every link was adopted as it ran (a program
    // swap, with no moment without XDP), none replaced.
    let log = lbd.log_text();
    assert!(!log.contains("XDP mode changed"), "{}: a link replaced at a restart:\n{log}", t.name());
    assert_eq!(
        log.matches("XDP program replaced on the pinned link").count(),
        ifaces.len(),
        "{}: links adopted at the restart:\n{log}",
        t.name()
    );
    let restarted = lbd.status().unwrap();
    assert_eq!(restarted["paths"], later["paths"], "{}: paths after a kill and restart", t.name());
    let r = lab.conns("10.10.0.100:80", 500, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((u(&r, "ok"), u(&r, "failed")), (500, 0), "{}: after a kill and restart: {r}", t.name());
    let c3 = counters(&lbd.status().unwrap());
    let (redirect3, _, total3) = path_counts(&lbd.status().unwrap());
    let (redirected, forwarded3) = (redirect3 - redirect2, total3 - total2);
    assert!(forwarded3 >= 500 * 4, "{}: {forwarded3} packets forwarded after the restart: {c3:?}", t.name());
    if all_redirect {
        assert_eq!(c3["kernel_egress"], 0, "{}: packets through the kernel after a restart: {c3:?}", t.name());
        assert!(
            redirected as f64 >= 0.99 * forwarded3 as f64,
            "{}: {redirected} of {forwarded3} packets by XDP redirect after a restart: {c3:?}",
            t.name()
        );
    } else {
        assert!(c3["kernel_egress"] > c2["kernel_egress"], "{}: kernel path unused after a restart: {c3:?}", t.name());
    }
    println!(
        "topology {:<15} after a kill and restart: {redirected} of {forwarded3} packets by XDP redirect",
        t.name()
    );

    // Bulk transfers, each way and in each family. With the lab's default
    // offloads the senders hand over, and generic mode's GRO makes,
    // packets longer than the MTU, which an XDP redirect drops: they must
    // take the kernel's path and arrive whole, none answered as too big
    // (every link here has the same MTU).
    let before = counters(&lbd.status().unwrap());
    for target in ["10.10.0.100:80".to_string(), target6.clone()] {
        for way in ["download", "upload"] {
            let r = lab
                .client(&[way, "--target", &target, "--bytes", "20971520", "--timeout-ms", "60000"])
                .unwrap_or_else(|e| {
                    panic!("{}: {way} from {target}: {e:#}\ncounters {:?}", t.name(), counters(&lbd.status().unwrap()))
                });
            assert_eq!(r["complete"].as_bool(), Some(true), "{}: {way} from {target}: {r}", t.name());
            println!("topology {:<15} {way} {target}: {r}", t.name());
        }
    }
    let after = counters(&lbd.status().unwrap());
    assert_eq!(after["too_big"], before["too_big"], "{}: bulk packets answered as too big: {after:?}", t.name());
    // Generic mode sees GSO packets (every sender here offloads its
    // segmentation); native mode sees frames only.
    let generic = expected_modes(t).iter().any(|&(_, m)| m == "generic");
    assert_eq!(
        after["kernel_egress"] > before["kernel_egress"],
        generic,
        "{}: bulk packets by the kernel path with modes {:?}: {after:?}",
        t.name(),
        expected_modes(t)
    );
    println!(
        "topology {:<15} bulk transfers: {} packets by XDP redirect, {} by the kernel path (kernel_egress)",
        t.name(),
        after["xdp_redirect"] - before["xdp_redirect"],
        after["kernel_egress"] - before["kernel_egress"]
    );
    drop(lbd);
    drop(lab);
}

/// The XDP mode on each interface, as the kernel reports it and as lbd
/// reports it, is the one `auto` must pick on `t`.
fn check_modes(t: Topology, lab: &Lab, lbd: &Lbd, when: &str) {
    for (iface, mode) in expected_modes(t) {
        assert_xdp_mode(lab, lbd, iface, mode, &format!("{}, {when}", t.name()));
    }
}

#[test]
fn every_topology_forwards_correctly_with_the_default_config() {
    let _guard = serial();
    lb_tests::require_root().expect("lab tests need root");
    for t in Topology::ALL {
        run_topology(t);
    }
}

/// `xdp_mode: native` forced where native redirects cannot work (default
/// veths: no peer has XDP or GRO): lbd warns, every forwarded packet takes
/// the kernel path and is counted there, nothing fails. Then the devices
/// change at run time (GRO turned on at both peers): within a few seconds
/// lbd logs the new paths and packets leave by XDP redirect; and back.
#[test]
fn forced_native_takes_the_kernel_path_and_follows_device_changes() {
    let _guard = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-native";
    let lab =
        Lab::up(LabSpec { prefix: prefix.into(), backends: 3, topology: Topology::Default, ..LabSpec::default() })
            .expect("lab up");
    let sock = socket_for(prefix);
    let config = write_config_for(&config_dir(prefix), "lbd", &sock, &lab.gw_interfaces(), SERVICES).unwrap();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("xdp_mode: native\n{text}")).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).unwrap();
    for iface in ["eth0", "eth1"] {
        assert_eq!(xdp_mode_in_use(&lab, iface).unwrap().as_deref(), Some("native"), "{iface}");
    }
    let log = lbd.log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN") && l.contains("xdp_mode native: packets to eth1 take the kernel path")),
        "no warning about eth1 in:\n{log}"
    );
    let status = lbd.status().unwrap();
    assert!(status["paths"].as_array().unwrap().iter().all(|p| p["path"] == "kernel"), "{status}");
    let conns = ["conns", "--target", "10.10.0.100:80", "--count", "500", "--sources-range", "10.10.1.1-10.10.1.250"];
    let r = lab.client(&conns).unwrap();
    assert_eq!(u(&r, "failed"), 0, "{r}");
    let status = lbd.status().unwrap();
    let c = counters(&status);
    let (_, _, forwarded) = path_counts(&status);
    assert_eq!(c["xdp_redirect"], 0, "a native redirect into a veth without XDP or GRO at its peer: {c:?}");
    assert_eq!(c["kernel_egress"] + c["fib_fallback"], forwarded, "{c:?}");
    assert!(c["kernel_egress"] > 0, "{c:?}");
    println!("forced native on default veths: {forwarded} packets, all through the kernel ({c:?})");

    // GRO on at both peers: native redirects into eth0 and eth1 work now.
    let ethtool = |role: &str, dev: &str, on: &str| {
        let out = lab.cmd(role, "ethtool").args(["-K", dev, "gro", on]).output().unwrap();
        assert!(out.status.success(), "{out:?}");
    };
    ethtool("sw", "p0", "on");
    ethtool("client", "eth0", "on");
    let switched = wait_for(10, || {
        let s = lbd.status().ok()?;
        s["paths"].as_array()?.iter().all(|p| p["path"] == "xdp_redirect").then_some(())
    });
    assert!(switched.is_some(), "paths did not follow the devices:\n{}", lbd.log_text());
    let r = lab.client(&conns).unwrap();
    assert_eq!(u(&r, "failed"), 0, "{r}");
    let c2 = counters(&lbd.status().unwrap());
    assert!(c2["xdp_redirect"] > 0, "{c2:?}");
    assert_eq!(c2["kernel_egress"], c["kernel_egress"], "{c2:?}");
    // And back: the datapath stops redirecting into eth1 at once.
    ethtool("sw", "p0", "off");
    let back = wait_for(10, || {
        let s = lbd.status().ok()?;
        s["paths"].as_array()?.iter().any(|p| p["egress"] == "eth1" && p["path"] == "kernel").then_some(())
    });
    assert!(back.is_some(), "eth1 still reported as a redirect target:\n{}", lbd.log_text());
    let r = lab.client(&conns).unwrap();
    assert_eq!(u(&r, "failed"), 0, "{r}");
    let c3 = counters(&lbd.status().unwrap());
    assert!(c3["kernel_egress"] > c2["kernel_egress"], "{c3:?}");
    let log = lbd.log_text();
    assert!(
        log.lines().any(|l| l.contains("forwarding path")
            && l.contains("ingress=eth0 ")
            && l.contains("egress=eth1 ")
            && l.contains("kernel forwarding")),
        "{log}"
    );
}

/// A gateway with three interfaces: a second uplink (`eth2`, a plain
/// veth to the client, 10.40.0.0/24) beside the tuned lab's two. The
/// client reaches the VIP by both uplinks (by source address), and each
/// connection is answered back the way it came. `auto` picks native on
/// eth2 (its egresses take native redirects) and generic on eth0 and
/// eth1 (native redirects into eth2 would be dropped: its peer has no
/// XDP or GRO); lbd reports a path for each of the six ingress-egress
/// pairs; none failed and the counters are exact.
#[test]
fn a_gateway_with_a_second_uplink_balances_from_both() {
    let _guard = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-uplinks";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 3, ..LabSpec::default() }).expect("lab up");
    let gw = lab.ns("gw");
    lab.ip("client", &["link", "add", "eth2", "type", "veth", "peer", "name", "eth2", "netns", &gw]).unwrap();
    lab.ip("client", &["addr", "add", "10.40.0.2/24", "dev", "eth2"]).unwrap();
    lab.ip("client", &["link", "set", "eth2", "up"]).unwrap();
    lab.ip("client", &["rule", "add", "from", "10.40.0.2", "table", "40"]).unwrap();
    lab.ip("client", &["route", "add", "10.10.0.96/28", "via", "10.40.0.1", "table", "40"]).unwrap();
    lab.ip("gw", &["addr", "add", "10.40.0.1/24", "dev", "eth2"]).unwrap();
    lab.ip("gw", &["link", "set", "eth2", "up"]).unwrap();
    let ok = lab.cmd("gw", "sysctl").args(["-q", "-w", "net.ipv4.conf.eth2.rp_filter=0"]).status().unwrap();
    assert!(ok.success());
    let sock = socket_for(prefix);
    let ifaces = ["eth0".to_owned(), "eth1".to_owned(), "eth2".to_owned()];
    let config = write_config_for(&config_dir(prefix), "lbd", &sock, &ifaces, SERVICES).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).unwrap();
    for (iface, mode) in [("eth0", "generic"), ("eth1", "generic"), ("eth2", "native")] {
        assert_eq!(xdp_mode_in_use(&lab, iface).unwrap().as_deref(), Some(mode), "{iface}; log:\n{}", lbd.log_text());
    }
    let status = lbd.status().unwrap();
    assert_eq!(status["paths"].as_array().unwrap().len(), 6, "{}", status["paths"]);
    lab.reset_backend_counts().unwrap();

    let by = |sources: &[&str]| {
        let r = lab.conns("10.10.0.100:80", 500, 5, &["--sources", &sources.join(",")]).unwrap();
        assert_eq!((u(&r, "ok"), u(&r, "failed")), (500, 0), "from {sources:?}: {r}");
    };
    let link = |iface: &str| lab.link_bytes("gw", iface).unwrap();
    let before = link("eth2");
    by(&["10.40.0.2"]);
    let after = link("eth2");
    assert!(after.0 > before.0 && after.1 > before.1, "the second uplink carried nothing: {before:?} -> {after:?}");
    by(&["10.10.0.2"]);
    // (Neighbour discovery may pass meanwhile; 500 connections would be
    // hundreds of kB.)
    let last = link("eth2");
    assert!(
        last.0 < after.0 + 4096 && last.1 < after.1 + 4096,
        "the first uplink's connections went by the second: {after:?} -> {last:?}"
    );

    let status = lbd.status().unwrap();
    let counts = lab.backend_counts().unwrap();
    for (i, addr) in lab.backend_addrs().iter().enumerate() {
        let ours = Lbd::new_flows(&status, "web", &addr.to_string()).unwrap();
        assert_eq!(ours, counts[i].connections, "lbd counted {ours} new flows for {addr}, the backend {counts:?}");
    }
    let (redirect, kernel, forwarded) = path_counts(&status);
    assert_eq!(redirect + kernel, forwarded, "{:?}", counters(&status));
    assert!(redirect as f64 >= 0.95 * forwarded as f64, "{redirect} of {forwarded} by XDP redirect");
    println!("two uplinks: 1,000 connections, {forwarded} packets, {redirect} by XDP redirect");
}

/// A one-arm gateway whose one veth takes native redirects (GRO on at its
/// peer, the switch's `p0`; the client's and backends' offloads at kernel
/// defaults, so their checksums arrive unfinished): `auto` attaches
/// natively, and lbd reports the path back out of `eth0` as a redirect,
/// not XDP_TX: a veth's native XDP_TX reaches its peer only when the peer
/// runs an XDP program (GRO is not enough: such frames wait unsent, and
/// every connection timed out in this test when the datapath sent them).
/// Every packet forwarded by XDP is redirected, its unfinished checksum
/// finished first, with none failed and the counters exact.
#[test]
fn a_native_one_arm_veth_gateway_sends_back_by_redirect() {
    let _guard = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-onearm";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 3, topology: Topology::OneArm, ..LabSpec::default() })
        .expect("lab up");
    let out = lab.cmd("sw", "ethtool").args(["-K", "p0", "gro", "on"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let sock = socket_for(prefix);
    let config = write_config_for(&config_dir(prefix), "lbd", &sock, &lab.gw_interfaces(), SERVICES).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).unwrap();
    assert_eq!(xdp_mode_in_use(&lab, "eth0").unwrap().as_deref(), Some("native"), "log:\n{}", lbd.log_text());
    let status = lbd.status().unwrap();
    let paths = status["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 1, "{status}");
    assert_eq!((paths[0]["egress"].as_str(), paths[0]["path"].as_str()), (Some("eth0"), Some("xdp_redirect")));
    let reason = paths[0]["reason"].as_str().unwrap();
    assert!(reason.contains("native") && reason.contains("by redirect, not XDP_TX"), "{reason}");
    lab.reset_backend_counts().unwrap();

    let r = lab.conns("10.10.0.100:80", 1000, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((u(&r, "ok"), u(&r, "failed")), (1000, 0), "{r}");
    let udp = lab.udp("10.10.0.101:53", 20, 5, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((u(&udp, "ok"), u(&udp, "failed"), u(&udp, "flows_switched")), (100, 0, 0), "{udp}");

    let status = lbd.status().unwrap();
    let counts = lab.backend_counts().unwrap();
    for (i, addr) in lab.backend_addrs().iter().enumerate() {
        let ours = Lbd::new_flows(&status, "web", &addr.to_string()).unwrap();
        assert_eq!(ours, counts[i].connections, "lbd counted {ours} new flows for {addr}, the backend {counts:?}");
    }
    let c = counters(&status);
    let (redirect, kernel, forwarded) = path_counts(&status);
    assert_eq!(redirect + kernel, forwarded, "{c:?}");
    assert_eq!((c["xdp_tx"], c["kernel_egress"]), (0, 0), "{c:?}");
    // Only first packets towards not-yet-resolved neighbours (250 client
    // addresses, 3 backends) go by the kernel.
    assert!(redirect as f64 >= 0.9 * forwarded as f64, "{redirect} of {forwarded} by XDP: {c:?}");
    assert!(c["csum_partial"] > 0, "the client's and backends' unfinished checksums: {c:?}");
    println!(
        "native one-arm veth: 1,000 connections and 20 UDP flows, {forwarded} packets, {redirect} by XDP redirect back out of eth0, {} by the kernel (fib_fallback), {} unfinished checksums finished",
        c["fib_fallback"], c["csum_partial"]
    );
}

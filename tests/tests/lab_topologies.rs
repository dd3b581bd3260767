//! Every lab topology forwards through the gateway by itself, without a
//! balancer: the client reaches a backend over the gateway's kernel
//! forwarding, the gateway has the devices the topology promises (and lbd
//! would attach to), offloads are the kernel's defaults except in `tuned`,
//! and nothing (namespace or pin) is left behind. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]

use std::path::Path;
use std::process::Command;

use lb_tests::lab::{BPFFS, Lab, LabSpec, ROUTED_GW, Topology};

const PREFIX: &str = "lbt-topo";

fn output(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    output(Command::new("ip").args(["netns", "list"]))
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|ns| ns.starts_with(&format!("{prefix}-")))
        .map(String::from)
        .collect()
}

/// The gateway's devices (without lo): name -> `ip -d link` details.
fn gw_links(lab: &Lab) -> Vec<(String, String)> {
    let v: serde_json::Value =
        serde_json::from_str(&output(Command::new("ip").args(["-n", &lab.ns("gw"), "-d", "-j", "link", "show"])))
            .expect("ip -j link JSON");
    v.as_array()
        .expect("link array")
        .iter()
        .filter(|l| l["ifname"] != "lo")
        .map(|l| (l["ifname"].as_str().expect("ifname").to_owned(), l.to_string()))
        .collect()
}

fn kind(details: &str) -> &'static str {
    if details.contains(r#""info_kind":"bridge""#) {
        "bridge"
    } else if details.contains(r#""info_kind":"veth""#) {
        "veth"
    } else if details.contains(r#""info_kind":"macvlan""#) {
        "macvlan"
    } else if details.contains(r#""info_kind":"vxlan""#) {
        "vxlan"
    } else {
        "other"
    }
}

fn master(details: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(details).ok()?;
    v["master"].as_str().map(String::from)
}

/// The gateway's devices in each topology: (name, kind, bridge it is a port of).
fn expected_gw_links(t: Topology, backends: usize) -> Vec<(String, &'static str, Option<&'static str>)> {
    let d = |n: &str, k, m| (n.to_owned(), k, m);
    let mut v = match t {
        Topology::Tuned | Topology::Default | Topology::Mixed | Topology::Routed => {
            vec![d("eth0", "veth", None), d("eth1", "veth", None)]
        }
        Topology::BridgeBackend => vec![d("eth0", "veth", None), d("br0", "bridge", None)],
        Topology::BridgeClient => vec![d("br0", "bridge", None), d("c0", "veth", Some("br0")), d("eth1", "veth", None)],
        Topology::OneArm => vec![d("eth0", "veth", None)],
        Topology::Macvlan => vec![d("eth0", "macvlan", None), d("eth1", "macvlan", None)],
        Topology::Vxlan => vec![d("eth0", "veth", None), d("eth1", "vxlan", None), d("u0", "veth", None)],
        Topology::Ecmp => panic!("the ecmp lab has no gateway (tests/ecmp.rs covers it)"),
    };
    if t == Topology::BridgeBackend {
        v.extend((1..=backends).map(|i| d(&format!("p{i}"), "veth", Some("br0"))));
    }
    v.sort();
    v
}

/// `ethtool -k DEV` feature state ("on"/"off") in the namespace of `role`.
fn feature(lab: &Lab, role: &str, dev: &str, name: &str) -> String {
    let out = output(lab.cmd(role, "ethtool").args(["-k", dev]));
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("{name} not in ethtool -k {dev}:\n{out}"))
        .to_owned()
}

/// Packets be1's eth0 took through its NAPI receive queue (veth's
/// `rx_queue_0_xdp_packets`, which counts GRO-mode receives too).
fn be1_napi_packets(lab: &Lab) -> u64 {
    let out = output(lab.cmd("be1", "ethtool").args(["-S", "eth0"]));
    out.lines()
        .find_map(|l| l.trim().strip_prefix("rx_queue_0_xdp_packets: "))
        .unwrap_or_else(|| panic!("no rx_queue_0_xdp_packets in be1's ethtool -S eth0:\n{out}"))
        .parse()
        .expect("number")
}

/// A counter of the gateway's /proc/net/snmp, e.g. ("Ip", "ForwDatagrams").
fn snmp(lab: &Lab, section: &str, field: &str) -> u64 {
    let snmp = output(lab.cmd("gw", "cat").arg("/proc/net/snmp"));
    let tag = format!("{section}:");
    let mut rows = snmp.lines().filter(|l| l.split_whitespace().next() == Some(tag.as_str()));
    let (names, values) = (rows.next().expect("snmp header"), rows.next().expect("snmp values"));
    let i = names.split_whitespace().position(|n| n == field).unwrap_or_else(|| panic!("no {field}"));
    values.split_whitespace().nth(i).expect("value").parse().expect("number")
}

fn check(t: Topology) {
    let backends = 2;
    let lab =
        Lab::up(LabSpec { prefix: PREFIX.into(), backends, client_sources: 4, topology: t, ..LabSpec::default() })
            .unwrap_or_else(|e| panic!("{t}: lab up: {e:#}"));
    let name = t.name();

    // The devices lbd is told to attach to, and nothing unexpected.
    let links = gw_links(&lab);
    let mut got: Vec<(String, &str, Option<String>)> =
        links.iter().map(|(n, d)| (n.clone(), kind(d), master(d))).collect();
    got.sort();
    let want: Vec<(String, &str, Option<String>)> =
        expected_gw_links(t, backends).into_iter().map(|(n, k, m)| (n, k, m.map(String::from))).collect();
    assert_eq!(got, want, "{name}: gateway devices");
    for i in lab.gw_interfaces() {
        assert!(links.iter().any(|(n, _)| *n == i), "{name}: gw has no {i}");
    }
    assert_eq!(lab.gw_interfaces(), t.gw_interfaces(), "{name}");
    // Addresses on the gateway (VIPs not among them).
    let addrs = output(Command::new("ip").args(["-n", &lab.ns("gw"), "-4", "-o", "addr", "show"]));
    // Client side first, backend side last (the same one in one-arm).
    let ifs = lab.gw_interfaces();
    let (client_side, backend_side) = (&ifs[0], &ifs[ifs.len() - 1]);
    assert!(
        addrs.lines().any(|l| l.contains(&format!(" {client_side} ")) && l.contains("10.10.0.1/16")),
        "{name}: 10.10.0.1/16 on {client_side}:\n{addrs}"
    );
    // In `routed`, the link to the backends' router.
    let backend_net = if t == Topology::Routed { format!("{ROUTED_GW}/30") } else { "10.20.0.1/24".to_owned() };
    assert!(
        addrs.lines().any(|l| l.contains(&format!(" {backend_side} ")) && l.contains(&backend_net)),
        "{name}: {backend_net} on {backend_side}:\n{addrs}"
    );
    assert!(!addrs.contains("10.10.0.9") && !addrs.contains("10.10.0.10"), "{name}: a VIP on the gateway:\n{addrs}");

    // Offloads: only tuned changes them (veths default to TX checksum on).
    let tx = if t == Topology::Tuned { "off" } else { "on" };
    assert_eq!(feature(&lab, "client", "eth0", "tx-checksumming"), tx, "{name}: client eth0 TX checksum");
    assert_eq!(feature(&lab, "be1", "eth0", "tx-checksumming"), tx, "{name}: be1 eth0 TX checksum");
    if t != Topology::Tuned {
        assert_eq!(feature(&lab, "client", "eth0", "generic-receive-offload"), "off", "{name}: client eth0 GRO");
    }
    // Tuned: each backend polls one receive queue (GRO on its eth0, TSO
    // off on the switch port that sends to it), as behind a NIC.
    let (be_gro, port_tso) = if t == Topology::Tuned { ("on", "off") } else { ("off", "on") };
    assert_eq!(feature(&lab, "be1", "eth0", "generic-receive-offload"), be_gro, "{name}: be1 eth0 GRO");
    if matches!(t, Topology::Tuned | Topology::Default) {
        assert_eq!(feature(&lab, "sw", "p1", "tcp-segmentation-offload"), port_tso, "{name}: switch port p1 TSO");
    }
    let napi_before = be1_napi_packets(&lab);

    // The mixed topology's peer XDP program: pinned, attached in native mode to p0.
    let pin = Path::new(BPFFS).join(format!("{PREFIX}-peer-xdp"));
    assert_eq!(pin.exists(), t == Topology::Mixed, "{name}: {}", pin.display());
    if t == Topology::Mixed {
        let p0 = output(Command::new("ip").args(["-n", &lab.ns("sw"), "-d", "link", "show", "dev", "p0"]));
        assert!(p0.contains("xdp "), "{name}: no native XDP on p0:\n{p0}");
        assert!(p0.contains("prog/xdp id"), "{name}: no program on p0:\n{p0}");
    }

    // Kernel forwarding through the gateway, both backends, no balancer.
    let before = snmp(&lab, "Ip", "ForwDatagrams");
    for (i, addr) in lab.backend_addrs().iter().enumerate() {
        let body =
            output(lab.cmd("client", "curl").args(["-s", "--max-time", "3"]).arg(format!("http://{addr}:8080/")));
        assert!(body.starts_with(&format!("backend=be{} ", i + 1)), "{name}: {addr} answered {body:?}");
    }
    let fwd = snmp(&lab, "Ip", "ForwDatagrams") - before;
    // The path be1's packets took: its NAPI queue in tuned (request,
    // handshake and close at least), the backlog of the sending CPU in
    // the others.
    let napi = be1_napi_packets(&lab) - napi_before;
    if t == Topology::Tuned {
        assert!(napi >= 4, "{name}: be1 took only {napi} packets through its NAPI queue");
    } else {
        assert_eq!(napi, 0, "{name}: be1 took {napi} packets through a NAPI queue");
    }
    // At least the handshake, request, response and close of each connection.
    assert!(fwd >= 2 * 6, "{name}: the gateway forwarded only {fwd} packets");
    // From an extra source address as well (the gateway routes the /16 back).
    let body = output(
        lab.cmd("client", "curl")
            .args(["-s", "--max-time", "3", "--interface", "10.10.1.3"])
            .arg("http://10.20.0.12:8080/"),
    );
    assert!(body.starts_with("backend=be2 "), "{name}: from 10.10.1.3: {body:?}");
    // Packets in and out of the same interface, but no ICMP redirects (one-arm).
    assert_eq!(snmp(&lab, "Icmp", "OutRedirects"), 0, "{name}: the gateway sent ICMP redirects");
    println!("{name:>15}: gw {:?}, forwarded {fwd} packets for 2 connections ({})", lab.gw_interfaces(), t.describe());

    drop(lab);
    assert!(namespaces_with_prefix(PREFIX).is_empty(), "{name}: leftovers {:?}", namespaces_with_prefix(PREFIX));
    assert!(!pin.exists(), "{name}: {} left behind", pin.display());
}

#[test]
fn every_topology_forwards_without_a_balancer() {
    lb_tests::require_root().expect("lab tests need root");
    assert_eq!(
        Topology::ALL.map(Topology::name),
        ["tuned", "default", "bridge-backend", "bridge-client", "one-arm", "mixed", "macvlan", "vxlan", "routed"]
    );
    for t in Topology::ALL {
        assert_eq!(t.name().parse::<Topology>(), Ok(t));
    }
    for t in Topology::ALL {
        check(t);
    }
    Lab::down(PREFIX).expect("lab down");
    assert!(namespaces_with_prefix(PREFIX).is_empty());
}

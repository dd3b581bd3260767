//! Jumbo frames through the gateway, with the default configuration
//! (`xdp_mode: auto`): every link of the tuned lab at a 9,000-byte MTU,
//! as in a data centre, and NAT and DSR services of both families in one
//! lbd. Then the backends' side back at 1,500 bytes while the clients'
//! stays jumbo, so that the clients' segments are too big for it.
//!
//! 1. All jumbo: `auto` attaches in the mode the README gives for such a
//!    device, and lbd says why; 1,000 IPv4 and 200 IPv6 new connections
//!    pass with lbd's new-flow counts equal to the backends' accepts;
//!    20 MB each way through every service completes, with packets
//!    longer than a 1,500-byte MTU allows counted by the datapath, and
//!    none answered as too big.
//! 2. Jumbo clients, 1,500-byte backends advertising a jumbo MSS (as
//!    hosts on a jumbo segment behind a narrower link do): uploads through the NAT and DSR
//!    services of both families complete because the datapath answers the
//!    clients' too-big segments ("fragmentation needed" / "packet too
//!    big" from the VIP), and the counters say so.
//!
//! Needs root; one lab at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{IpAddr, SocketAddr};

use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{DSR_VIP, DSR_VIP6, Lab, LabSpec, Topology, VIP6},
    lbd::{Lbd, assert_xdp_mode, wait_for, write_config_for},
};

const PREFIX: &str = "lbt-jumbo";
const JUMBO: u32 = 9000;
const PLAIN: u32 = 1500;
const BULK: &str = "20971520";
const PORT: u16 = 8080;

/// NAT services of both families (`web`, `web6`) and DSR services of both
/// (`dsr4`, `dsr6`), on the same three backends.
fn services(lab: &Lab) -> String {
    let mut s = web("", &[(1, 1), (2, 1), (3, 1)]);
    s.push_str(&format!("  - name: web6\n    vip: \"{VIP6}\"\n    port: 80\n    protocol: tcp\n    backends:\n"));
    for a in lab.backend_addrs6() {
        s.push_str(&format!("      - {{ address: \"{a}\", port: {PORT} }}\n"));
    }
    for (name, vip, v6) in [("dsr4", IpAddr::from(DSR_VIP), false), ("dsr6", IpAddr::from(DSR_VIP6), true)] {
        s.push_str(&format!(
            "  - name: {name}\n    vip: \"{vip}\"\n    port: {PORT}\n    protocol: tcp\n    forwarding: dsr\n    backends:\n"
        ));
        for a in lab.backend_ips(v6) {
            s.push_str(&format!("      - {{ address: \"{a}\" }}\n"));
        }
    }
    s
}

/// The services a bulk transfer goes through: (service, target).
fn targets() -> [(&'static str, String); 4] {
    [
        ("web", "10.10.0.100:80".to_string()),
        ("web6", format!("[{VIP6}]:80")),
        ("dsr4", SocketAddr::new(IpAddr::from(DSR_VIP), PORT).to_string()),
        ("dsr6", SocketAddr::new(IpAddr::from(DSR_VIP6), PORT).to_string()),
    ]
}

/// The clients' links at `mtu`: to the gateway, and the DSR answers' way
/// in from the router.
fn client_side(lab: &Lab, mtu: u32) {
    lab.set_mtu("gw", "eth0", mtu).unwrap();
    lab.set_mtu("client", "eth0", mtu).unwrap();
    lab.set_mtu("client", "eth1", mtu).unwrap();
    lab.set_mtu("rt", "c0", mtu).unwrap();
}

fn counter(lbd: &Lbd, name: &str) -> u64 {
    lbd.status().unwrap()["counters"][name].as_u64().unwrap_or_else(|| panic!("no counter {name}"))
}

/// (packets, bytes) lbd counted in from clients for `service`'s backends.
fn counted_in(lbd: &Lbd, lab: &Lab, service: &str) -> (u64, u64) {
    let status = lbd.status().unwrap();
    let v6 = service.ends_with('6');
    lab.backend_ips(v6).iter().fold((0, 0), |(p, b), a| {
        let be = Lbd::backend(&status, service, &a.to_string()).unwrap_or_else(|| panic!("{service} {a}"));
        (p + be["packets_in"].as_u64().unwrap(), b + be["bytes_in"].as_u64().unwrap())
    })
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

#[test]
fn jumbo_frames_pass_and_a_narrower_backend_side_is_answered() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec {
        prefix: PREFIX.into(),
        backends: 3,
        dsr: true,
        topology: Topology::Tuned,
        ..LabSpec::default()
    })
    .expect("lab up");
    lab.set_backend_side_mtu(JUMBO).unwrap();
    client_side(&lab, JUMBO);
    let sock = socket_for(PREFIX);
    let config = write_config_for(&config_dir(PREFIX), "lbd", &sock, &lab.gw_interfaces(), &services(&lab)).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");

    // 1. The mode in use, as the kernel and lbd report it, and why.
    let status = lbd.status().unwrap();
    for iface in lab.gw_interfaces() {
        assert_xdp_mode(&lab, &lbd, &iface, "generic", "every link at 9,000 bytes");
        let a = status["interfaces"].as_array().unwrap().iter().find(|a| a["interface"] == iface.as_str()).unwrap();
        println!("{iface}: {} ({})", a["mode"], a["reason"]);
        assert!(
            a["reason"].as_str().unwrap().contains("MTU"),
            "{iface}: lbd does not say that the MTU kept it from native mode: {a}"
        );
    }

    // New connections in both families, counted exactly.
    let up = wait_for(15, || {
        ["web", "web6", "dsr4", "dsr6"]
            .iter()
            .all(|s| lab.backend_ips(s.ends_with('6')).iter().all(|a| lbd.backend_state(s, &a.to_string()) == "up"))
            .then_some(())
    });
    assert!(up.is_some(), "backends not up: {}", lbd.status().unwrap()["services"]);
    lab.reset_backend_counts().unwrap();
    let r = lab.conns("10.10.0.100:80", 1000, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((u(&r, "ok"), u(&r, "failed")), (1000, 0), "{r}");
    let sources6: Vec<String> = lab.client_sources6().iter().take(20).map(ToString::to_string).collect();
    let r6 = lab.conns(&format!("[{VIP6}]:80"), 200, 10, &["--sources", &sources6.join(",")]).unwrap();
    assert_eq!((u(&r6, "ok"), u(&r6, "failed")), (200, 0), "{r6}");
    let status = lbd.status().unwrap();
    let accepted = lab.backend_counts().unwrap();
    for (i, (a, a6)) in lab.backend_addrs().iter().zip(lab.backend_addrs6()).enumerate() {
        let ours = Lbd::new_flows(&status, "web", &a.to_string()).unwrap()
            + Lbd::new_flows(&status, "web6", &a6.to_string()).unwrap();
        assert_eq!(ours, accepted[i].connections, "lbd counted {ours} new flows for {a} and {a6}: {accepted:?}");
    }

    // Bulk each way through every service: the clients' packets are longer
    // than a 1,500-byte link carries, and none is answered as too big.
    let too_big = counter(&lbd, "too_big");
    for (service, target) in targets() {
        let (packets, bytes) = counted_in(&lbd, &lab, service);
        for way in ["upload", "download"] {
            let r = lab
                .client(&[way, "--target", &target, "--bytes", BULK, "--timeout-ms", "60000"])
                .unwrap_or_else(|e| panic!("{service}: {way}: {e:#}\ncounters {}", lbd.status().unwrap()["counters"]));
            println!("{service}: {way} {r}");
            assert_eq!(r["complete"].as_bool(), Some(true), "{service}: {way}: {r}");
        }
        let (p, b) = counted_in(&lbd, &lab, service);
        let (p, b) = (p - packets, b - bytes);
        println!("{service}: {p} packets, {b} bytes in from the client ({} bytes a packet)", b / p.max(1));
        assert!(b >= 20_971_520, "{service}: the upload did not pass the datapath ({b} bytes)");
        assert!(
            b / p > u64::from(PLAIN),
            "{service}: {b} bytes in {p} packets: no longer than a 1,500-byte link carries"
        );
    }
    assert_eq!(counter(&lbd, "too_big"), too_big, "bulk packets answered as too big with every link at 9,000");

    // 2. The backends' side back at 1,500 bytes. The backends still
    // advertise a jumbo MSS (route `advmss`, as hosts on a jumbo segment
    // behind a narrower link do), so the clients send 9,000-byte segments,
    // which the datapath answers.
    lab.set_backend_side_mtu(PLAIN).unwrap();
    for be in lab.backend_names() {
        for (family, via, table, mss) in [
            ("-4", "10.20.0.1", "main", "8960"),
            ("-6", "fd00:20::1", "main", "8940"),
            ("-4", "10.20.0.3", "100", "8960"),
            ("-6", "fd00:20::3", "100", "8940"),
        ] {
            lab.ip(
                &be,
                &[family, "route", "change", "default", "via", via, "dev", "eth0", "table", table, "advmss", mss],
            )
            .unwrap();
        }
    }
    // lbd sees the MTUs with its device refresh (once a second).
    std::thread::sleep(std::time::Duration::from_secs(3));
    for (service, target) in targets() {
        let answered = counter(&lbd, "too_big");
        let r = lab
            .client(&["upload", "--target", &target, "--bytes", BULK, "--timeout-ms", "30000"])
            .unwrap_or_else(|e| panic!("{service}: upload: {e:#}\ncounters {}", lbd.status().unwrap()["counters"]));
        let answered = counter(&lbd, "too_big") - answered;
        println!("{service}: upload across a 1,500-byte backend side {r}, {answered} packets answered as too big");
        assert_eq!(r["complete"].as_bool(), Some(true), "{service}: upload: {r}");
        assert!(answered > 0, "{service}: the upload crossed the narrower side without a too-big answer");
    }
    let c = lbd.status().unwrap()["counters"].clone();
    println!("counters: {c}");
    for k in ["malformed", "no_backend", "flow_table", "fragment"] {
        assert_eq!(c[k], 0, "counter {k}: {c}");
    }
}

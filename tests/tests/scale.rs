//! lbd at its configured limits: 255 services (service ids 1-255) and
//! 4,095 backends (backend ids 1-4,095), every service health-checked
//! every second. The lab has three backend hosts, each serving port
//! 8080: every service's first three backends are those (an endpoint
//! shared by all 255 services), the other 3,330 are ports where nothing
//! listens. What an operator of a large gateway relies on:
//! - lbd starts, and a 256th service is refused by name, with nothing
//!   changed;
//! - every backend that refuses connections is taken out (all 3,330),
//!   and `lbctl` answers meanwhile;
//! - each service's new connections go to its live backends only: none
//!   fails, and lbd's per-backend counters say where they went;
//! - the probes leave no pile of TIME_WAIT sockets on the gateway (765
//!   successful probes a second would leave tens of thousands);
//! - a reload that changes one weight among the 4,095 is applied.
//!
//! Before, each probe transition copied and compared all 255 services'
//! 65,537-entry tables and rebuilt one, one transition at a time: in the
//! debug build the dead backends took minutes to go down, and `lbctl
//! status` gave up after 30 s. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use lb_tests::{
    harness::{config_dir, serial, socket_for},
    lab::{Lab, LabSpec},
    lbd::{Lbd, wait_for, write_config_with},
};

const SERVICES: usize = 255;
const BACKENDS: usize = 4095;

/// The services: ports 1000.., each with three live backends (the lab's
/// hosts, port 8080) and dead ones (ports 9000.. on the same hosts) until
/// `BACKENDS` are listed. `bump` gives backend 10.20.0.11:9003 weight 5.
fn services(bump: bool) -> String {
    let mut text = String::new();
    let mut n = 0;
    for i in 0..SERVICES {
        text.push_str(&format!(
            "  - name: s{i}\n    vip: 10.10.0.100\n    port: {}\n    scheduler: maglev\n    health: {{ type: tcp, interval: 1s, timeout: 500ms, rise: 2, fall: 2 }}\n    backends:\n",
            1000 + i
        ));
        // 4,095 = 255 x 16 + 15: the first 15 services get 17.
        let k = BACKENDS / SERVICES + usize::from(i < BACKENDS % SERVICES);
        for j in 0..k {
            let host = 11 + j % 3;
            let port = if j < 3 { 8080 } else { 9000 + n };
            let weight = if bump && host == 11 && port == 9003 { 5 } else { 1 };
            text.push_str(&format!("      - {{ address: 10.20.0.{host}, port: {port}, weight: {weight} }}\n"));
            n += 1;
        }
    }
    assert_eq!(n, BACKENDS);
    text
}

/// Each backend's state by (service, address:port), from `lbctl status`.
fn states(status: &serde_json::Value) -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for s in status["services"].as_array().expect("services") {
        for b in s["backends"].as_array().expect("backends") {
            let key = (s["name"].as_str().unwrap().to_owned(), format!("{}:{}", b["address"], b["port"]));
            out.insert(key, b["state"].as_str().unwrap().to_owned());
        }
    }
    out
}

/// TIME_WAIT sockets in the gateway's namespace.
fn time_wait(lab: &Lab) -> usize {
    let out = lab.cmd("gw", "ss").args(["-tan", "state", "time-wait"]).output().unwrap();
    assert!(out.status.success(), "ss: {out:?}");
    // A header line, then one per socket.
    String::from_utf8_lossy(&out.stdout).lines().skip(1).count()
}

/// TCP connections each backend host has accepted (`PassiveOpens` in its
/// namespace's /proc/net/snmp).
fn passive_opens(lab: &Lab) -> Vec<u64> {
    let mut out = Vec::new();
    for be in lab.backend_names() {
        let snmp = lab.cmd(&be, "cat").arg("/proc/net/snmp").output().unwrap();
        assert!(snmp.status.success(), "{be}: {snmp:?}");
        let text = String::from_utf8_lossy(&snmp.stdout);
        let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:")).map(|l| l.split_whitespace());
        let (names, values) = (tcp.next().unwrap(), tcp.next().unwrap());
        let opens = names.zip(values).find(|(n, _)| *n == "PassiveOpens").unwrap().1;
        out.push(opens.parse().unwrap());
    }
    out
}

#[test]
fn lbd_at_its_limits_probes_balances_and_answers() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-scale";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 3, ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let dir = config_dir(prefix);
    let ifaces = lab.gw_interfaces();
    // 255 tables of 65,537 entries, twice over for atomic swaps.
    let top = "conntrack_max: 262144\ntable_capacity: 33554432\n";
    let config = write_config_with(&dir, "lbd", &sock, &ifaces, top, &services(false)).unwrap();
    let started = Instant::now();
    let mut lbd = Lbd::start(&lab, &config, &sock).unwrap();
    println!("lbd answered {:.1} s after its start", started.elapsed().as_secs_f64());

    // All 3,330 dead backends down; 765 live ones up.
    let settled = wait_for(90, || {
        let st = states(&lbd.status().ok()?);
        let down = st.values().filter(|s| *s == "down").count();
        (down == BACKENDS - 3 * SERVICES).then_some(st)
    });
    let st = settled.unwrap_or_else(|| {
        let st = states(&lbd.status().unwrap());
        let down = st.values().filter(|s| *s == "down").count();
        panic!("{down} of {} dead backends down after 90 s", BACKENDS - 3 * SERVICES)
    });
    println!("every dead backend down {:.1} s after lbd's start", started.elapsed().as_secs_f64());
    assert_eq!(st.len(), BACKENDS);
    let up: Vec<_> = st.iter().filter(|(_, s)| *s == "up").map(|(k, _)| k).collect();
    assert_eq!(up.len(), 3 * SERVICES);
    assert!(up.iter().all(|(_, b)| b.ends_with(":8080")), "a dead backend is up: {up:?}");
    let t = Instant::now();
    let text = lbd.lbctl(&["status"]).unwrap();
    println!("lbctl status: {} lines in {:.2} s", text.lines().count(), t.elapsed().as_secs_f64());

    // The first, a middle and the last service: every connection served,
    // by the service's three live backends, and counted there.
    // All from one client address: a port it reuses for another service
    // meets the backend's TIME_WAIT of the earlier connection (every
    // service shares the three endpoints), and the counts stay exact.
    for i in [0, SERVICES / 2, SERVICES - 1] {
        let target = format!("10.10.0.100:{}", 1000 + i);
        let r = lab.conns(&target, 300, 10, &[]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{target}: {r}");
        let status = lbd.status().unwrap();
        let s = status["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == format!("s{i}"))
            .unwrap_or_else(|| panic!("s{i} not in status"));
        let flows: Vec<(u64, u64)> = s["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| (b["port"].as_u64().unwrap(), b["new_flows"].as_u64().unwrap()))
            .collect();
        let live: u64 = flows.iter().filter(|(p, _)| *p == 8080).map(|(_, n)| n).sum();
        assert_eq!(live, 300, "s{i}: new flows by backend port: {flows:?}");
        assert!(flows.iter().filter(|(p, _)| *p == 8080).all(|(_, n)| *n > 0), "s{i}: {flows:?}");
        // The shares and the fairness index are the live backends' alone:
        // a third each expected, none for the dead, and an even spread
        // reads as fair (counted with the dead's zeros, it read 0.18).
        for b in s["backends"].as_array().unwrap() {
            let expected = b["expected_share"].as_f64().unwrap();
            let want = if b["port"] == 8080 { 1.0 / 3.0 } else { 0.0 };
            assert!((expected - want).abs() < 1e-9, "s{i}: expected share {expected} for {b}");
        }
        let fairness = s["fairness"].as_f64().unwrap();
        assert!(fairness > 0.9, "s{i}: fairness {fairness} with new flows by backend port {flows:?}");
    }

    // Successful probes end with a reset, not a TIME_WAIT each.
    let tw = time_wait(&lab);
    println!("TIME_WAIT sockets on the gateway: {tw}");
    assert!(tw < 100, "{tw} TIME_WAIT sockets on the gateway after 765 probes a second");

    // Every service probes the three hosts the same way, so they share
    // one probe a second each, not 255.
    let before = passive_opens(&lab);
    std::thread::sleep(Duration::from_secs(3));
    let opened: Vec<u64> = passive_opens(&lab).iter().zip(&before).map(|(a, b)| a - b).collect();
    println!("connections each live host accepted in 3 s: {opened:?}");
    assert!(opened.iter().all(|n| (1..=10).contains(n)), "connections per host in 3 s: {opened:?}");

    // A 256th service is refused, naming the limit; nothing changes.
    let err = lbd
        .lbctl(&["service", "add", "extra", "--vip", "10.10.0.100", "--port", "2000", "--backend", "10.20.0.11:8080"])
        .expect_err("a 256th service was added");
    assert!(format!("{err:#}").contains("256 services; at most 255 are supported"), "{err:#}");
    assert_eq!(lbd.status().unwrap()["services"].as_array().unwrap().len(), SERVICES);

    // One weight changed among the 4,095, by a reload.
    write_config_with(&dir, "lbd", &sock, &ifaces, top, &services(true)).unwrap();
    let out = lbd.lbctl(&["reload"]).unwrap();
    assert!(out.contains("changed s0"), "{out}");
    let status = lbd.status().unwrap();
    let b = status["services"][0]["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["port"] == 9003)
        .expect("10.20.0.11:9003 in s0")
        .clone();
    assert_eq!((b["weight"].as_u64(), b["state"].as_str()), (Some(5), Some("down")), "{b}");

    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

//! A SYN flood against a small flow table, in the lab (issue 12): a table
//! of 8,192 connections takes SYNs from spoofed sources at twice its size
//! per second for 20 s, while 50 keep-alive connections exchange a request
//! every 2 s and new connections keep arriving. The live connections must
//! all complete on the backend they started on, new ones must succeed, and
//! the metrics must show the flood (flows routed without an entry,
//! half-open flows expired). Needs root; one lab at a time.
//!
//! The table was 16,384 (a flood of 32,768 SYNs/s) until a slower 2-core
//! VM with a CPU-bound process beside the test sent only 24,419/s: every
//! SYN also costs the gateway's datapath, a backend's SYN-ACK and the
//! gateway's blackhole, all on the same two CPUs, so the flood was held
//! by the machine, not by the sender. What the test is about is the
//! ratio (twice the table per second, as the issue asks), which half the
//! table keeps at a rate such a machine reaches.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{collections::BTreeMap, process::Command, time::Duration};

use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{Lab, LabSpec},
    lbd::{Lbd, write_config_with, xdp_mode_in_use},
};

const PREFIX: &str = "lbt-flood";
const TABLE: u64 = 8_192;
const FLOOD_MS: u64 = 20_000;
const TABLE6: u64 = 1_024;

/// `name{labels} value` samples of a family, by their label text.
fn samples(text: &str, name: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once(' ')?;
            Some((labels.trim_matches(|c| c == '{' || c == '}').to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_syn_flood_at_twice_the_table_per_second_spares_live_and_new_connections() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec { prefix: PREFIX.into(), backends: 3, ..LabSpec::default() }).expect("lab up");
    // The backends answer the spoofed sources through the balancer; the
    // gateway blackholes those answers (its FIB says so, the datapath
    // hands them to the kernel, which drops them).
    let out = Command::new("ip")
        .args(["-n", &lab.ns("gw"), "route", "add", "blackhole", "10.99.0.0/16"])
        .output()
        .expect("ip route");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sock = socket_for(PREFIX);
    // Round robin, as the operator who reported the problem ran it: a flow
    // without an entry must be hashed (the Maglev fallback table), not
    // scheduled twice. Flood settings are the defaults. The IPv6 flow
    // table, unused here, is sized on its own (the status and the metrics
    // report each table against its own size).
    let config = write_config_with(
        &config_dir(PREFIX),
        "lbd",
        &sock,
        &lab.gw_interfaces(),
        &format!("conntrack_max: {TABLE}\nconntrack_max_ipv6: {TABLE6}\n"),
        &web("    scheduler: rr\n", &[(1, 1), (2, 1), (3, 1)]),
    )
    .expect("config");
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");

    let (live, fresh, flood) = std::thread::scope(|scope| {
        let live = scope.spawn(|| lab.longlived("10.10.0.100:80", 50, 12, 2000, &[]).expect("longlived"));
        // The live connections are open before the flood starts.
        std::thread::sleep(Duration::from_millis(1500));
        let fresh = scope.spawn(|| {
            lab.client(&[
                "conns",
                "--target",
                "10.10.0.100:80",
                "--count",
                "100000000",
                "--duration-ms",
                &FLOOD_MS.to_string(),
                "--concurrency",
                "2",
                "--sources-range",
                "10.10.1.51-10.10.1.250",
            ])
            .expect("conns")
        });
        let flood = lab
            .client(&[
                "flood",
                "--target",
                "10.10.0.100:80",
                "--rate",
                &(2 * TABLE).to_string(),
                "--duration-ms",
                &FLOOD_MS.to_string(),
            ])
            .expect("flood");
        (live.join().unwrap(), fresh.join().unwrap(), flood)
    });
    eprintln!("flood: {flood}\nlive: {live}\nnew connections: ok {} failed {}", fresh["ok"], fresh["failed"]);

    // The flood was what it says: twice the table per second, for 20 s.
    let sent = flood["sent"].as_u64().unwrap();
    assert!(sent >= 2 * TABLE * FLOOD_MS / 1000 * 9 / 10, "the flood sent only {sent} SYNs: {flood}");

    // Every live connection completed every round on its first backend.
    assert_eq!(live["failed"], 0, "{live}");
    assert_eq!(live["ok_rounds"], 50 * 12, "{live}");
    assert_eq!(live["switched"], 0, "a live connection changed backend: {live}");

    // New connections kept succeeding.
    let (ok, failed) = (fresh["ok"].as_u64().unwrap(), fresh["failed"].as_u64().unwrap());
    assert!(ok >= 200, "only {ok} new connections in 20 s: {fresh}");
    assert!(failed * 100 <= ok + failed, "{failed} of {} new connections failed: {fresh}", ok + failed);

    // The datapath says what happened, in the status and in the metrics.
    let status = lbd.status().expect("status");
    let counters = &status["counters"];
    eprintln!("counters: {counters}\nflood: {}", status["flood"]);
    let stateless = counters["table_full"].as_u64().unwrap() + counters["flood_rate"].as_u64().unwrap();
    assert!(stateless > TABLE, "flows routed without an entry: {counters}");
    assert!(status["flood"]["half_open_expired"].as_u64().unwrap() > 0, "{}", status["flood"]);
    assert_eq!(status["flood"]["flow_capacity"], TABLE, "{}", status["flood"]);
    let tables = &status["flood"]["flow_tables"];
    assert_eq!((tables["ipv4"]["capacity"].as_u64(), tables["ipv6"]["capacity"].as_u64()), (Some(TABLE), Some(TABLE6)));
    let entries4 = tables["ipv4"]["entries"].as_u64().unwrap();
    assert!(entries4 <= TABLE, "the IPv4 table holds more than its limit: {tables}");
    assert_eq!(tables["ipv6"]["entries"], 0, "{tables}");
    assert_eq!(status["flood"]["flow_entries"], entries4, "the total is both tables': {}", status["flood"]);
    let out = lab.cmd("gw", "curl").args(["-sf", "--max-time", "5", "http://127.0.0.1:9464/metrics"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let by_reason = samples(&text, "lb_stateless_packets_total");
    let capacity = samples(&text, "lb_flow_table_capacity");
    assert_eq!(
        (capacity.get("family=\"ipv4\"").copied(), capacity.get("family=\"ipv6\"").copied()),
        (Some(TABLE as f64), Some(TABLE6 as f64)),
        "lb_flow_table_capacity: {capacity:?}"
    );
    let entries = samples(&text, "lb_flow_table_entries");
    assert!(entries.get("family=\"ipv4\"").is_some_and(|&n| n <= TABLE as f64), "lb_flow_table_entries: {entries:?}");
    assert_eq!(entries.get("family=\"ipv6\"").copied(), Some(0.0), "lb_flow_table_entries: {entries:?}");
    let metric_total: f64 = ["table_full", "flood_rate"]
        .iter()
        .map(|r| by_reason.get(&format!("reason=\"{r}\"")).copied().unwrap_or(0.0))
        .sum();
    assert!(metric_total > TABLE as f64, "lb_stateless_packets_total: {by_reason:?}");
    let half_open = samples(&text, "lb_half_open_expired_flows_total");
    assert!(half_open.values().sum::<f64>() > 0.0, "lb_half_open_expired_flows_total: {half_open:?}");
    // Sweeps ran to their end (they expired the half-open flows): how long
    // the last one took is in the status and the metrics.
    let sweep_ms = status["flood"]["last_sweep_ms"].as_u64().unwrap_or_else(|| panic!("{}", status["flood"]));
    assert!(sweep_ms < 5_000, "a sweep of a {TABLE}-entry table took {sweep_ms} ms");
    let sweep = samples(&text, "lb_flow_sweep_duration_seconds");
    assert!(
        sweep.len() == 1 && sweep.values().all(|s| (0.0..5.0).contains(s)),
        "lb_flow_sweep_duration_seconds: {sweep:?}"
    );
    // The default xdp_mode (auto) ran natively on this topology, and the
    // connections' packets left by XDP redirect (the answers to spoofed
    // sources went to the kernel, which blackholed them).
    for iface in lab.gw_interfaces() {
        assert_eq!(xdp_mode_in_use(&lab, &iface).unwrap().as_deref(), Some("native"), "{iface}");
    }
    let redirected = counters["xdp_redirect"].as_u64().unwrap();
    assert!(redirected > 10 * ok, "{redirected} packets by XDP redirect for {ok} new connections: {counters}");
    let text = lbd.lbctl(&["status"]).expect("lbctl status");
    assert!(text.contains("flood protection: flow table IPv4 "), "{text}");
    assert!(text.contains(&format!("/{TABLE}, IPv6 0/{TABLE6} entries")), "{text}");
    assert!(text.contains(" entries (last sweep "), "{text}");
}

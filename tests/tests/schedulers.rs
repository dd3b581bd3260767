//! The schedulers on real connections in the lab, counted by the backends
//! themselves: round robin, smooth WRR, Maglev, source hash, weighted least
//! connections, least response time; live changes (weights, scheduler, pool) that must not move
//! an established connection; draining. Needs root; one lab at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::time::Duration;

use lb_tests::{
    harness::{self, Running},
    lbd::Lbd,
};

/// One `web` service on 10.10.0.100:80 with `scheduler` over lab backends
/// given as (1-based backend number, weight).
fn web(scheduler: &str, backends: &[(u8, u32)]) -> String {
    harness::web(&format!("    scheduler: {scheduler}\n"), backends)
}

fn setup(prefix: &str, backends: usize, services: &str) -> Running {
    Running::start(prefix, backends, services)
}

trait Measure {
    fn conns(&self, count: u32, concurrency: u32, sources: &str) -> serde_json::Value;
    fn counts(&self) -> Vec<u64>;
}

impl Measure for Running {
    fn conns(&self, count: u32, concurrency: u32, sources: &str) -> serde_json::Value {
        let r = self.lab.conns("10.10.0.100:80", count, concurrency, &["--sources-range", sources]).unwrap();
        assert_eq!(r["failed"], 0, "failed requests: {r}");
        assert_eq!(r["ok"], u64::from(count));
        r
    }

    /// Connections each backend accepted (its own count), in backend order;
    /// checked equal to lbd's new-flow counters.
    fn counts(&self) -> Vec<u64> {
        let counts: Vec<u64> = self.lab.backend_counts().unwrap().iter().map(|c| c.connections).collect();
        let status = self.lbd.status().unwrap();
        for (i, addr) in self.lab.backend_addrs().iter().enumerate() {
            if let Some(ours) = Lbd::new_flows(&status, "web", &addr.to_string()) {
                assert_eq!(ours, counts[i], "lbd and backend {addr} disagree: {counts:?}");
            }
        }
        counts
    }
}

fn jain(x: &[f64]) -> f64 {
    lb_userspace::report::jain(x).expect("some connections were counted")
}

fn as_f64(v: &[u64]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn round_robin_gives_each_backend_a_third_of_3000_connections() {
    let s = setup("lbt-s-rr", 3, &web("rr", &[(1, 1), (2, 5), (3, 1)]));
    s.conns(3000, 10, "10.10.1.1-10.10.1.250");
    let c = s.counts();
    println!("rr 3000 connections: {c:?}");
    for n in &c {
        assert!((990..=1010).contains(n), "round robin spread {c:?}");
    }
    let j = jain(&as_f64(&c));
    assert!(j >= 0.999, "Jain {j}");
    let f = s.lbd.status().unwrap()["services"][0]["fairness"].as_f64().unwrap();
    assert!(f >= 0.999, "lbd's fairness {f}");
}

#[test]
fn weighted_round_robin_5_3_2_over_10000_connections() {
    let s = setup("lbt-s-wrr", 3, &web("wrr", &[(1, 5), (2, 3), (3, 2)]));
    s.conns(10_000, 10, "10.10.1.1-10.10.1.250");
    let c = s.counts();
    let total: u64 = c.iter().sum();
    let shares: Vec<f64> = c.iter().map(|&n| n as f64 / total as f64).collect();
    println!("wrr 5:3:2 over 10000: {c:?} shares {shares:?}");
    for (share, want) in shares.iter().zip([0.5, 0.3, 0.2]) {
        assert!((share - want).abs() <= 0.01, "shares {shares:?}");
    }
    let weighted = [c[0] as f64 / 5.0, c[1] as f64 / 3.0, c[2] as f64 / 2.0];
    assert!(jain(&weighted) >= 0.999, "weighted Jain {}", jain(&weighted));
}

#[test]
fn maglev_spreads_10000_connections_from_100_sources() {
    let s = setup("lbt-s-maglev", 3, &web("maglev", &[(1, 1), (2, 1), (3, 1)]));
    s.conns(10_000, 10, "10.10.1.1-10.10.1.100");
    let c = s.counts();
    let j = jain(&as_f64(&c));
    println!("maglev 10000 connections from 100 sources: {c:?} Jain {j:.5}");
    assert!(j >= 0.99, "Jain {j}: {c:?}");
}

#[test]
fn source_hash_keeps_each_client_on_one_backend() {
    let s = setup("lbt-s-sh", 3, &web("source-hash", &[(1, 1), (2, 1), (3, 1)]));
    let r = s.conns(2000, 10, "10.10.1.1-10.10.1.200");
    let per_source = r["per_source_backends"].as_object().unwrap();
    assert_eq!(per_source.len(), 200);
    for (src, backends) in per_source {
        assert_eq!(backends.as_array().unwrap().len(), 1, "{src} reached {backends}");
    }
    // Sources per backend.
    let mut sources = [0u64; 3];
    for backends in per_source.values() {
        let b = backends[0].as_str().unwrap();
        sources[b.trim_start_matches("be").parse::<usize>().unwrap() - 1] += 1;
    }
    let j = jain(&as_f64(&sources));
    println!("source-hash: 200 sources over backends {sources:?} Jain {j:.4}; connections {:?}", s.counts());
    assert!(j >= 0.95, "Jain {j}: {sources:?}");
}

#[test]
fn least_conn_sends_fewer_connections_to_a_slow_backend() {
    let s = setup("lbt-s-lc", 3, &web("least-conn", &[(1, 1), (2, 1), (3, 1)]));
    s.lab.set_backend_delay(0, 200).unwrap();
    let r = s
        .lab
        .client(&[
            "conns",
            "--target",
            "10.10.0.100:80",
            "--concurrency",
            "30",
            "--duration-ms",
            "10000",
            "--sources-range",
            "10.10.1.1-10.10.1.250",
        ])
        .unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    let c = s.counts();
    println!("least-conn, be1 answers after 200 ms, 30 clients for 10 s: {c:?}");
    assert!(c[0] * 2 < c[1] && c[0] * 2 < c[2], "slow backend got {} vs {} and {}", c[0], c[1], c[2]);
    // Every connection closed: nothing stays counted as active.
    std::thread::sleep(Duration::from_millis(300));
    let status = s.lbd.status().unwrap();
    for b in status["services"][0]["backends"].as_array().unwrap() {
        assert_eq!(b["active_flows"], 0, "{b}");
    }
}

#[test]
fn least_time_sends_little_to_a_backend_that_answers_50ms_later() {
    let health = "    health: { type: http, interval: 200ms, timeout: 150ms, rise: 1, fall: 3 }\n";
    let services = harness::web(&format!("    scheduler: least-time\n{health}"), &[(1, 1), (2, 1), (3, 1)]);
    let s = setup("lbt-s-lt", 3, &services);
    s.lab.set_backend_delay(0, 50).unwrap();
    // Wait until lbd's estimates have seen the delay (probes every 200 ms,
    // a moving average): be1's above 40 ms, the others' below 10 ms.
    let addrs: Vec<String> = s.lab.backend_addrs().iter().map(ToString::to_string).collect();
    let estimate =
        |st: &serde_json::Value, addr: &str| Lbd::backend(st, "web", addr).and_then(|b| b["response_time_ms"].as_f64());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = s.lbd.status().unwrap();
        let e: Vec<Option<f64>> = addrs.iter().map(|a| estimate(&st, a)).collect();
        if e[0].is_some_and(|t| t > 40.0) && e[1..].iter().all(|t| t.is_some_and(|t| t < 10.0)) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "estimates never settled: {e:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let r = s
        .lab
        .client(&[
            "conns",
            "--target",
            "10.10.0.100:80",
            "--concurrency",
            "30",
            "--duration-ms",
            "10000",
            "--sources-range",
            "10.10.1.1-10.10.1.250",
        ])
        .unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    // Counted by the client (the backends also count the probes), and equal
    // to lbd's new-flow counters.
    let status = s.lbd.status().unwrap();
    let c: Vec<u64> = (1..=3).map(|i| r["per_backend"][format!("be{i}")].as_u64().unwrap_or(0)).collect();
    for (i, addr) in addrs.iter().enumerate() {
        assert_eq!(Lbd::new_flows(&status, "web", addr), Some(c[i]), "lbd and the client disagree on {addr}: {c:?}");
    }
    println!("least-time, be1 answers after 50 ms, 30 clients for 10 s: {c:?}");
    for b in status["services"][0]["backends"].as_array().unwrap() {
        println!(
            "  {} estimate {} ms, effective weight {}",
            b["address"], b["response_time_ms"], b["effective_weight"]
        );
    }
    assert!(c[0] * 3 < c[1] && c[0] * 3 < c[2], "slow backend got {} vs {} and {}", c[0], c[1], c[2]);
    let (lo, hi) = (c[1].min(c[2]) as f64, c[1].max(c[2]) as f64);
    assert!(hi <= lo * 1.1, "the two fast backends differ by more than 10%: {c:?}");
    // The estimates and the weights in force are what an operator sees.
    let text = s.lbd.lbctl(&["status"]).unwrap();
    assert!(text.contains("scheduler least-time") && text.contains("RESPONSE"), "{text}");
    let row = text.lines().find(|l| l.trim_start().starts_with(&format!("{}:8080", addrs[0]))).unwrap();
    let ms: f64 = row.split_whitespace().last().unwrap().trim_end_matches("ms").parse().unwrap();
    assert!(ms > 40.0, "be1's estimate in lbctl status: {row}");
    let eff = |a: &str| Lbd::backend(&status, "web", a).unwrap()["effective_weight"].as_u64().unwrap();
    // The weights in force follow the design: a backend answering 50 ms
    // later weighs at most what 50 ms gives (1024 / 2^(13/4) = 108, the
    // ratio to the 5 ms floor rounded to quarter octaves), the fast ones
    // (1024 at or under the floor) at least five times that.
    let slow_bound = u64::from(lb_userspace::sched::least_time_weight(1, Some(Duration::from_millis(50))));
    assert!(eff(&addrs[0]) <= slow_bound, "be1 weighs {}, more than {slow_bound}", eff(&addrs[0]));
    for a in &addrs[1..] {
        assert!(eff(a) >= 5 * slow_bound, "{a} weighs {}, not 5 x {slow_bound}", eff(a));
    }
}

#[test]
fn live_changes_never_move_an_established_connection() {
    let s = setup("lbt-s-live", 4, &web("maglev", &[(1, 1), (2, 1), (3, 1)]));
    let lab = &s.lab;
    std::thread::scope(|scope| {
        let long = scope.spawn(|| lab.longlived("10.10.0.100:80", 50, 100, 40, &[]).unwrap());
        std::thread::sleep(Duration::from_millis(700));
        s.reconfigure(&web("maglev", &[(1, 5), (2, 1), (3, 2)]));
        std::thread::sleep(Duration::from_millis(500));
        s.reconfigure(&web("wrr", &[(1, 5), (2, 1), (3, 2)]));
        std::thread::sleep(Duration::from_millis(500));
        s.reconfigure(&web("rr", &[(1, 1), (2, 1), (3, 1)]));
        std::thread::sleep(Duration::from_millis(500));
        s.reconfigure(&web("least-conn", &[(1, 1), (2, 1), (3, 1), (4, 3)]));
        // New connections meanwhile go by the new pool.
        let r = lab
            .client(&[
                "conns",
                "--target",
                "10.10.0.100:80",
                "--count",
                "200",
                "--sources-range",
                "10.10.1.51-10.10.1.250",
            ])
            .unwrap();
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["per_backend"]["be4"].as_u64().unwrap_or(0) > 0, "the added backend got nothing: {r}");
        let r = long.join().unwrap();
        println!("50 long-lived connections through 4 changes: {r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["ok_rounds"], 5000, "{r}");
        assert_eq!(r["switched"], 0, "a connection moved: {r}");
        assert!(r["per_backend"].get("be4").is_none(), "an old connection reached the new backend: {r}");
    });
}

#[test]
fn draining_a_backend_lets_its_connections_finish_and_sends_it_nothing_new() {
    let s = setup("lbt-s-drain", 3, &web("rr", &[(1, 1), (2, 1), (3, 1)]));
    let lab = &s.lab;
    std::thread::scope(|scope| {
        let long = scope.spawn(|| lab.longlived("10.10.0.100:80", 60, 60, 50, &[]).unwrap());
        std::thread::sleep(Duration::from_millis(800));
        s.reconfigure(&web("rr", &[(1, 0), (2, 1), (3, 1)]));
        let before = lab.backend_counts().unwrap()[0].connections;
        let r = lab
            .client(&[
                "conns",
                "--target",
                "10.10.0.100:80",
                "--count",
                "300",
                "--sources-range",
                "10.10.1.61-10.10.1.160",
            ])
            .unwrap();
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["per_backend"].get("be1").is_none(), "drained backend got new connections: {r}");
        let r = long.join().unwrap();
        println!("60 long-lived connections while be1 drains: {r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["switched"], 0, "{r}");
        assert_eq!(r["per_backend"]["be1"], 20, "round robin gave be1 a third of the 60: {r}");
        assert_eq!(lab.backend_counts().unwrap()[0].connections, before, "be1 accepted a connection after drain");
    });
    let status = s.lbd.status().unwrap();
    let be1 = &status["services"][0]["backends"][0];
    assert_eq!(be1["weight"], 0);
    assert_eq!(be1["new_flows"], 20);
}

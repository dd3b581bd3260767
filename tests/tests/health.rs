//! Health checks as operators configure them: HTTP probes on the service
//! port, judged by status code and body, against backends whose process
//! stays up while they fail (a 503, a closed service port). The flows of a
//! backend that goes down are re-dispatched, as the README says: their
//! next packet goes to a live backend, which resets them, instead of the
//! failing backend answering them. Needs root; one lab at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::time::{Duration, Instant};

use lb_tests::{
    harness::{Running, web},
    lab::Lab,
    lbd::{Lbd, wait_for},
};

/// Probes of the health endpoint on the service port (no `port:`), status
/// 200-399 and "health=ok" in the body (what lab-backend writes while
/// healthy).
const INTERVAL_MS: u64 = 300;
const FALL: u64 = 2;
const HEALTH: &str = "    health: { type: http, path: /health, interval: 300ms, timeout: 200ms, rise: 2, fall: 2, body: \"health=ok\" }\n";

fn backend_state(lbd: &Lbd, addr: &str) -> String {
    lbd.backend_state("web", addr)
}

/// Long-lived keep-alive connections, a request every 100 ms on each, while
/// `fail` makes backend `idx` fail its checks; returns the client's report
/// and how long detection took.
fn fail_under_longlived(
    lab: &Lab,
    lbd: &Lbd,
    idx: usize,
    sources: &str,
    fail: impl FnOnce(),
) -> (serde_json::Value, Duration) {
    let addr = format!("10.20.0.{}", 11 + idx);
    std::thread::scope(|scope| {
        let client = scope.spawn(|| {
            lab.client(&[
                "longlived",
                "--target",
                "10.10.0.100:80",
                "--connections",
                "30",
                "--rounds",
                "50",
                "--interval-ms",
                "100",
                "--sources-range",
                sources,
            ])
            .unwrap()
        });
        std::thread::sleep(Duration::from_millis(1000));
        fail();
        let t0 = Instant::now();
        let down = wait_for(10, || (backend_state(lbd, &addr) == "down").then(Instant::now))
            .unwrap_or_else(|| panic!("{addr} was never marked down"));
        (client.join().unwrap(), down.duration_since(t0))
    })
}

/// The flows that were on the failed backend `name` all ended in an error:
/// the backend itself kept serving them (its process is up), so the error
/// is the datapath re-dispatching them to a live backend, which resets
/// them. Every other flow never failed.
fn assert_redispatched(r: &serde_json::Value, name: &str) {
    let on_failed = r["per_backend"][name].as_u64().unwrap_or(0);
    let broken = &r["broken_per_backend"];
    println!("{name}: {on_failed} of 30 connections on it; ended in an error, by backend: {broken}");
    assert!(on_failed >= 3, "too few connections on {name} to judge: {r}");
    assert_eq!(*broken, serde_json::json!({ name: on_failed }), "each connection on {name}, and only those, ends: {r}");
    // (a sample of the errors)
    for e in r["errors"].as_array().unwrap() {
        let e = e.as_str().unwrap();
        assert!(!e.contains("HTTP status") && !e.contains("timed out"), "not a reset by the new backend: {e}");
    }
    assert_eq!(r["switched"], 0, "no request was answered by another backend: {r}");
}

#[test]
fn a_backend_answering_503_or_with_its_service_port_closed_goes_down_and_its_flows_are_redispatched() {
    let s = Running::start("lbt-h-fail", 3, &web(HEALTH, &[(1, 1), (2, 1), (3, 1)]));
    let (lab, lbd) = (&s.lab, &s.lbd);
    let bound = Duration::from_millis(FALL * INTERVAL_MS + 2000);
    wait_for(10, || (0..3).all(|i| backend_state(lbd, &format!("10.20.0.{}", 11 + i)) == "up").then_some(()))
        .expect("the backends never came up");

    // be1 answers 503 on its service port; its process stays up.
    let (r, took) =
        fail_under_longlived(lab, lbd, 0, "10.10.1.1-10.10.1.100", || lab.set_backend_status(0, 503).unwrap());
    println!("503: be1 down after {took:?} (bound {bound:?})");
    assert!(took <= bound, "detection took {took:?}");
    assert_redispatched(&r, "be1");

    // be2's service port closes (connects refused); the process and its
    // open connections stay. be1 is still down.
    let (r, took) =
        fail_under_longlived(lab, lbd, 1, "10.10.1.101-10.10.1.200", || lab.set_backend_listening(1, false).unwrap());
    println!("port closed: be2 down after {took:?} (bound {bound:?})");
    assert!(took <= bound, "detection took {took:?}");
    assert_redispatched(&r, "be2");
    assert!(r["per_backend"].get("be1").is_none(), "a new flow went to be1 while it was down: {r}");

    // A body without the expected text is a failure too: be3's health
    // endpoint answers 299 (in the accepted range) with "health=failing".
    lab.set_backend_status(2, 299).unwrap();
    wait_for(10, || (backend_state(lbd, "10.20.0.13") == "down").then_some(()))
        .expect("be3 with a 299 whose body lacks health=ok never went down");

    // All healthy again: every backend rejoins.
    lab.set_backend_status(0, 200).unwrap();
    lab.set_backend_listening(1, true).unwrap();
    lab.set_backend_status(2, 200).unwrap();
    wait_for(10, || (0..3).all(|i| backend_state(lbd, &format!("10.20.0.{}", 11 + i)) == "up").then_some(()))
        .expect("the backends never came back");
}

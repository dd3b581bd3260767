//! Scale-out behind ECMP (issue 14), in the ecmp lab: two balancer nodes,
//! each with its own lbd, which has its own BIRD announce the VIPs to a
//! router running BIRD; the router spreads the clients over the nodes by
//! a 5-tuple hash. The services are DSR (see the lab module for why).
//!
//! - Spread: both nodes take connections, and the backends get them in
//!   their weights' shares (Jain >= 0.99), each node's counts exact.
//! - Node loss: 100 long-lived connections keep talking while one node's
//!   lbd is SIGKILLed and its XDP program detached: every one continues
//!   on its backend through the other node.
//! - Withdraw and re-announce: a VIP whose backends all fail leaves the
//!   router's table, within the health checks' detection time plus the
//!   BGP update, and comes back when a backend recovers; another service's
//!   VIP stays announced throughout.
//!
//! Needs root and BIRD (`cargo xtask setup`); one lab at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    net::{Ipv4Addr, SocketAddr},
    process::Stdio,
    time::{Duration, Instant},
};

use lb_tests::{
    harness::{config_dir, serial},
    lab::{DSR_VIP, Lab, LabSpec, Topology},
    lbd::{Lbd, wait_for, xdp_mode_in},
};

const PORT: u16 = 8080;
/// The NAT service's VIP: announced like any other (its traffic is not
/// what this lab is for).
const OTHER_VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 100);
/// Health checks: down after 2 failures 500 ms apart, up after 1 success.
const INTERVAL: Duration = Duration::from_millis(500);
const TIMEOUT: Duration = Duration::from_millis(300);
const FALL: u32 = 2;

fn services(lab: &Lab) -> String {
    let mut s = format!(
        "  - name: dsr\n    vip: {DSR_VIP}\n    port: {PORT}\n    protocol: tcp\n    forwarding: dsr\n    scheduler: maglev\n    health: {{ type: http, path: /health, interval: {}ms, timeout: {}ms, fall: {FALL}, rise: 1 }}\n    backends:\n",
        INTERVAL.as_millis(),
        TIMEOUT.as_millis()
    );
    for a in lab.backend_addrs() {
        s.push_str(&format!("      - {{ address: {a} }}\n"));
    }
    // A second service, probed by TCP: a backend failing its HTTP check
    // still accepts connections, so this VIP stays announced.
    s.push_str(&format!(
        "  - name: web\n    vip: {OTHER_VIP}\n    port: 80\n    protocol: tcp\n    health: {{ type: tcp, interval: 500ms, timeout: 300ms }}\n    backends:\n"
    ));
    for a in lab.backend_addrs() {
        s.push_str(&format!("      - {{ address: {a}, port: {PORT} }}\n"));
    }
    s
}

struct Scaled {
    nodes: Vec<Lbd>,
    lab: Lab,
}

/// The ecmp lab with `prefix`, lbd on every node, and the router holding
/// both VIPs by every node.
fn start(prefix: &str, client_sources: usize) -> Scaled {
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec {
        prefix: prefix.into(),
        backends: 3,
        client_sources,
        topology: Topology::Ecmp,
        nodes: 2,
        ..LabSpec::default()
    })
    .expect("lab up");
    let dir = config_dir(prefix);
    std::fs::create_dir_all(&dir).unwrap();
    let mut nodes = Vec::new();
    let began = Instant::now();
    for k in 1..=2 {
        let path = dir.join(format!("n{k}.yaml"));
        std::fs::write(&path, lab.node_config(k, 9, &services(&lab))).unwrap();
        nodes.push(Lbd::start_in(&lab, &format!("n{k}"), &path, &lab.node_socket(k)).expect("lbd start"));
    }
    let all = all_nodes();
    for vip in [DSR_VIP, OTHER_VIP] {
        wait_for(30, || (lab.router_next_hops(vip).unwrap() == all).then_some(())).unwrap_or_else(|| {
            panic!("the router did not learn {vip} from both nodes: {:?}", lab.router_next_hops(vip))
        });
    }
    println!("both nodes announced both VIPs {} ms after the first lbd started", began.elapsed().as_millis());
    for (k, n) in nodes.iter().enumerate() {
        // The clients' packets arrive on eth0 and leave by eth1: native
        // XDP on eth0 (auto may put eth1 in generic mode: nothing is
        // redirected into eth0's peer, which has neither GRO nor XDP).
        let mode = xdp_mode_in(&lab, &format!("n{}", k + 1), "eth0").unwrap();
        assert_eq!(mode.as_deref(), Some("native"), "n{}: eth0", k + 1);
        // lbd reads the sessions' state every 250 ms.
        let announced = || {
            let s = n.status().unwrap();
            s["services"].as_array().unwrap().iter().all(|svc| svc["announced"] == true).then_some(())
        };
        wait_for(2, announced)
            .unwrap_or_else(|| panic!("n{}: not every VIP announced: {}", k + 1, n.status().unwrap()));
    }
    lab.reset_backend_counts().unwrap();
    Scaled { nodes, lab }
}

/// Every node's address on its uplink: the router's next hops for a VIP
/// all nodes announce.
fn all_nodes() -> Vec<Ipv4Addr> {
    (1..=2).map(|k| Lab::node_uplink(k).0).collect()
}

/// Per backend (lab order), the new flows a node's lbd counted for `service`.
fn new_flows(lbd: &Lbd, lab: &Lab, service: &str) -> Vec<u64> {
    let s = lbd.status().unwrap();
    lab.backend_addrs().iter().map(|a| Lbd::new_flows(&s, service, &a.to_string()).unwrap()).collect()
}

/// Active flows of `service` on a node, all backends together.
fn active_flows(lbd: &Lbd, service: &str) -> u64 {
    let s = lbd.status().unwrap();
    let svc = s["services"].as_array().unwrap().iter().find(|v| v["name"] == service).unwrap().clone();
    svc["backends"].as_array().unwrap().iter().map(|b| b["active_flows"].as_u64().unwrap()).sum()
}

/// `lb_vip_announced` of `service` in a node's metrics.
fn announced_metric(lab: &Lab, node: &str, service: &str) -> Option<f64> {
    let out = lab.cmd(node, "curl").args(["-sS", "--max-time", "3", "http://127.0.0.1:9464/metrics"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let prefix = format!("lb_vip_announced{{service=\"{service}\",");
    text.lines().find(|l| l.starts_with(&prefix)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

fn jain(x: &[u64]) -> f64 {
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let sq: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    sum * sum / (x.len() as f64 * sq)
}

#[test]
fn the_router_spreads_connections_over_both_nodes_and_the_backends() {
    let _serial = serial();
    let s = start("lbt-ecmp", 250);
    let target = SocketAddr::new(DSR_VIP.into(), PORT).to_string();
    let r = s
        .lab
        .client(&["conns", "--target", &target, "--count", "3000", "--sources-range", "10.10.1.1-10.10.1.250"])
        .unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(3000), Some(0)), "{}", r["errors"]);
    let per_node: Vec<Vec<u64>> = s.nodes.iter().map(|n| new_flows(n, &s.lab, "dsr")).collect();
    let accepted: Vec<u64> = s.lab.backend_counts().unwrap().iter().map(|c| c.at(DSR_VIP.into()).connections).collect();
    let summed: Vec<u64> = (0..3).map(|i| per_node.iter().map(|n| n[i]).sum()).collect();
    let node_totals: Vec<u64> = per_node.iter().map(|n| n.iter().sum()).collect();
    let j = jain(&accepted);
    println!(
        "3,000 connections from 250 sources: nodes took {node_totals:?}; per backend n1 {:?} + n2 {:?} = {summed:?}, the backends accepted {accepted:?}; Jain {j:.4}",
        per_node[0], per_node[1]
    );
    for (k, t) in node_totals.iter().enumerate() {
        assert!(*t >= 3000 / 5, "n{} took only {t} of 3,000 connections: the router did not spread them", k + 1);
    }
    // Each node's counters say which path a connection counted nowhere took.
    let counters: Vec<String> = s.nodes.iter().map(Lbd::counters_text).collect();
    assert_eq!(
        summed, accepted,
        "the nodes' counts add up to what each backend accepted; n1's counters {}, n2's {}",
        counters[0], counters[1]
    );
    assert!(j >= 0.99, "Jain {j:.4} over the backends {accepted:?}");
    for (k, n) in s.nodes.iter().enumerate() {
        let st = n.status().unwrap();
        let c = &st["counters"];
        assert!(c["xdp_redirect"].as_u64().unwrap() > 0, "n{}: nothing left by XDP redirect: {c}", k + 1);
        assert_eq!(c["dsr_off_link"].as_u64(), Some(0), "n{}: {c}", k + 1);
        // Default offloads: the client's checksums arrive unfinished, and
        // the node finished them before its native redirects.
        assert!(c["csum_partial"].as_u64().unwrap() > 0, "n{}: no unfinished checksum seen: {c}", k + 1);
        assert_eq!(announced_metric(&s.lab, &format!("n{}", k + 1), "dsr"), Some(1.0));
    }

    // A graceful restart (SIGUSR2) of n1: BIRD and its session outlive
    // it (the new lbd adopts the same BIRD), so the router never loses n1.
    let pidfile = format!("{}.bird.pid", s.lab.node_socket(1).display());
    let bird = std::fs::read_to_string(&pidfile).unwrap();
    let all = all_nodes();
    let (samples, new_program) = std::thread::scope(|scope| {
        let watch = scope.spawn(|| {
            // The router's next hops every 10 ms for 6 s: any gap is a loss.
            let until = Instant::now() + Duration::from_secs(6);
            let mut samples = Vec::new();
            while Instant::now() < until {
                samples.push(s.lab.router_next_hops(DSR_VIP).unwrap().len());
                std::thread::sleep(Duration::from_millis(10));
            }
            samples
        });
        std::thread::sleep(Duration::from_millis(500));
        let new_program = s.nodes[0].restart().expect("n1 restarts");
        (watch.join().unwrap(), new_program)
    });
    println!(
        "n1 restarted (program {new_program}): the router had {} next hops in each of {} samples over 6 s",
        samples.iter().min().unwrap(),
        samples.len()
    );
    assert!(samples.iter().all(|&n| n == all.len()), "the router lost a next hop during n1's restart: {samples:?}");
    // The new lbd adopts BIRD in its announcer's first round, which may
    // end after restart() returns (under CPU load, seconds after): wait
    // for it, then check that the BIRD running is still the old one.
    let adopted = wait_for(10, || s.nodes[0].log_text().contains("adopted the BIRD").then_some(()));
    assert!(adopted.is_some(), "n1 did not adopt its BIRD within 10 s of its restart: {}", s.nodes[0].log_text());
    assert_eq!(std::fs::read_to_string(&pidfile).unwrap(), bird, "n1's BIRD was replaced, not adopted");
    // The new lbd reports BGP after its announcer's first round (adopt,
    // sync, ask BIRD), which may end after restart() returns (`bgp` is
    // null until then; seen under CPU load): the adopted session must be
    // reported Established within that round's time.
    let mut st = serde_json::Value::Null;
    let up = wait_for(10, || {
        st = s.nodes[0].status().ok()?;
        (st["bgp"]["peers"][0]["state"] == "Established").then_some(())
    });
    assert!(up.is_some(), "n1's BGP session is not reported Established 10 s after its restart: {st}");
}

#[test]
fn long_lived_connections_survive_the_loss_of_a_node() {
    let _serial = serial();
    let mut s = start("lbt-ecmpk", 100);
    let target = SocketAddr::new(DSR_VIP.into(), PORT).to_string();
    // 100 connections, a request every 50 ms each for about 12 s.
    let exe = s.lab.spec.bin_dir.join("lab-client");
    let client = s
        .lab
        .cmd("client", &exe)
        .args(["longlived", "--target", &target, "--connections", "100", "--rounds", "240", "--interval-ms", "50"])
        .args(["--sources-range", "10.10.1.1-10.10.1.100", "--timeout-ms", "10000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Every connection open and talking.
    wait_for(10, || (active_flows(&s.nodes[0], "dsr") + active_flows(&s.nodes[1], "dsr") == 100).then_some(()))
        .unwrap_or_else(|| {
            panic!(
                "100 connections not established: n1 {} + n2 {}",
                active_flows(&s.nodes[0], "dsr"),
                active_flows(&s.nodes[1], "dsr")
            )
        });
    std::thread::sleep(Duration::from_secs(2));
    let moved = active_flows(&s.nodes[0], "dsr");
    let stayed = active_flows(&s.nodes[1], "dsr");
    assert!(moved >= 10, "n1 carries only {moved} of the 100 connections: the test would prove little");

    // n1 dies: lbd SIGKILLed, its XDP program detached (its pins removed:
    // the links lbd pinned were all that held the program). The kernel
    // releases an unpinned link after an RCU grace period, from a work
    // queue: under CPU load that took longer than the first look once.
    let killed = Instant::now();
    s.nodes[0].kill().unwrap();
    std::fs::remove_dir_all(s.lab.pin_dir().join("n1")).unwrap();
    for iface in ["eth0", "eth1"] {
        let gone = wait_for(5, || xdp_mode_in(&s.lab, "n1", iface).unwrap().is_none().then_some(()));
        assert!(gone.is_some(), "n1 {iface}: XDP still attached 5 s after its pins were removed");
    }
    let n2 = vec![Lab::node_uplink(2).0];
    wait_for(10, || (s.lab.router_next_hops(DSR_VIP).unwrap() == n2).then_some(()))
        .unwrap_or_else(|| panic!("the router still routes by n1: {:?}", s.lab.router_next_hops(DSR_VIP)));
    let withdrawn = killed.elapsed();

    let out = client.wait_with_output().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("lab-client: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    let after = active_flows(&s.nodes[1], "dsr");
    println!(
        "100 connections, {moved} through n1 and {stayed} through n2: n1 killed, the router routed by n2 alone after {} ms; longest round trip {} ms (the interruption); n2 then held {after} flows; failed rounds {}, connections that switched backend {}",
        withdrawn.as_millis(),
        r["max_round_ms"],
        r["failed"],
        r["switched"]
    );
    assert_eq!((r["failed"].as_u64(), r["switched"].as_u64()), (Some(0), Some(0)), "{r}");
    assert_eq!(r["ok_rounds"].as_u64(), Some(100 * 240), "{r}");
    // The moved connections took entries on n2 (not counted as new flows).
    assert!(after >= 100, "n2 holds {after} flows: the moved connections did not take entries there");
    let new_on_n2: u64 = new_flows(&s.nodes[1], &s.lab, "dsr").iter().sum();
    assert_eq!(new_on_n2, stayed, "a moved connection was counted as a new flow on n2");
}

#[test]
fn a_vip_without_healthy_backends_is_withdrawn_and_announced_again_on_recovery() {
    let _serial = serial();
    let s = start("lbt-ecmpw", 4);
    let all = all_nodes();
    let failed = Instant::now();
    for i in 0..3 {
        s.lab.set_backend_status(i, 503).unwrap();
    }
    wait_for(20, || s.lab.router_next_hops(DSR_VIP).unwrap().is_empty().then_some(()))
        .unwrap_or_else(|| panic!("{DSR_VIP} still routed: {:?}", s.lab.router_next_hops(DSR_VIP)));
    let withdraw = failed.elapsed();
    // Detection: FALL failed probes, the first up to one interval after
    // the failure began, each taking at most the timeout; then the
    // announcer's period and the BGP update.
    let detection = INTERVAL * FALL + TIMEOUT;
    let bound = detection + Duration::from_secs(2);
    assert_eq!(s.lab.router_next_hops(OTHER_VIP).unwrap(), all, "the other service's VIP stays announced");
    for (k, n) in s.nodes.iter().enumerate() {
        let st = n.status().unwrap();
        let by_name =
            |name: &str| st["services"].as_array().unwrap().iter().find(|v| v["name"] == name).unwrap().clone();
        assert_eq!(by_name("dsr")["announced"], false, "n{}", k + 1);
        assert_eq!(by_name("web")["announced"], true, "n{}", k + 1);
        assert_eq!(announced_metric(&s.lab, &format!("n{}", k + 1), "dsr"), Some(0.0));
        let text = n.lbctl(&["status"]).unwrap();
        assert!(text.contains("bgp withdrawn") && text.contains("Established"), "n{}: {text}", k + 1);
    }

    let recovered = Instant::now();
    s.lab.set_backend_status(1, 200).unwrap();
    wait_for(20, || (s.lab.router_next_hops(DSR_VIP).unwrap() == all).then_some(()))
        .unwrap_or_else(|| panic!("{DSR_VIP} not announced again: {:?}", s.lab.router_next_hops(DSR_VIP)));
    let announce = recovered.elapsed();
    println!(
        "withdrawn from the router {} ms after every backend failed (detection up to {} ms: fall {FALL} x {} ms + timeout {} ms); announced again {} ms after one recovered (rise 1)",
        withdraw.as_millis(),
        detection.as_millis(),
        INTERVAL.as_millis(),
        TIMEOUT.as_millis(),
        announce.as_millis()
    );
    assert!(withdraw <= bound, "withdrawn after {withdraw:?}, more than {bound:?}");
    assert!(announce <= INTERVAL + TIMEOUT + Duration::from_secs(2), "announced again after {announce:?}");
    let target = SocketAddr::new(DSR_VIP.into(), PORT).to_string();
    let r = s.lab.client(&["conns", "--target", &target, "--count", "100"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(100), Some(0)), "{}", r["errors"]);
}

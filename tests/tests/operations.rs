//! Operating the balancer in the lab: failover by health checks, slow
//! start, pool changes from lbctl under load and after a restart, reload
//! of a bad config, and the control socket's guard. Needs root; one lab at
//! a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::{fs::MetadataExt as _, net::UnixStream},
    process::Command,
    time::{Duration, Instant},
};

use lb_tests::{
    harness::{Running, web},
    lab::{Lab, VIP6},
    lbd::{Lbd, wait_for, write_config},
};

/// Health checks against the backends' stats port (so probes are not
/// counted as balanced connections).
const HEALTH: &str =
    "    health: { type: http, path: /stats, port: 9000, interval: 500ms, timeout: 300ms, rise: 2, fall: 3 }\n";

fn setup(prefix: &str, backends: usize, services: &str) -> Running {
    Running::start(prefix, backends, services)
}

fn backend_state(lbd: &Lbd, addr: &str) -> String {
    lbd.backend_state("web", addr)
}

fn conns(lab: &Lab, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["conns", "--target", "10.10.0.100:80"];
    a.extend_from_slice(args);
    lab.client(&a).unwrap()
}

#[test]
fn a_stopped_backend_is_taken_out_and_rejoins() {
    let s = setup("lbt-o-fail", 3, &web(HEALTH, &[(1, 1), (2, 1), (3, 1)]));
    let (lab, lbd) = (&s.lab, &s.lbd);
    assert_eq!(backend_state(lbd, "10.20.0.11"), "up");
    let (detected, r) = std::thread::scope(|scope| {
        // A steady stream of new connections (about 100/s) throughout.
        let stream = scope.spawn(|| {
            conns(lab, &["--concurrency", "2", "--duration-ms", "4000", "--sources-range", "10.10.1.1-10.10.1.100"])
        });
        std::thread::sleep(Duration::from_millis(500));
        lab.stop_backend(0).unwrap();
        let t0 = Instant::now();
        let detected = wait_for(10, || (backend_state(lbd, "10.20.0.11") == "down").then(Instant::now))
            .expect("the stopped backend was never marked down");
        (detected.duration_since(t0), stream.join().unwrap())
    });
    println!("failover: backend stopped, marked down after {detected:?} (bound: 3 x 500ms + 1s)");
    println!("stream during the failover: ok {} failed {}", r["ok"], r["failed"]);
    assert!(detected <= Duration::from_millis(2500), "detection took {detected:?}");
    assert!(r["ok"].as_u64().unwrap() >= 200, "the stream was under 50 connections/s: {r}");
    // From the detection point on: nothing to be1, nothing fails.
    let after =
        conns(lab, &["--concurrency", "2", "--duration-ms", "2000", "--sources-range", "10.10.1.101-10.10.1.200"]);
    println!("after detection: ok {} failed {} per backend {}", after["ok"], after["failed"], after["per_backend"]);
    assert_eq!(after["failed"], 0, "{after}");
    assert!(after["ok"].as_u64().unwrap() >= 100, "{after}");
    assert!(after["per_backend"].get("be1").is_none(), "{after}");
    let log = lbd.log_text();
    let downs: Vec<&str> = log.lines().filter(|l| l.contains("backend down")).collect();
    assert_eq!(downs.len(), 1, "one log line for the transition:\n{log}");
    assert!(downs[0].contains("service=web") && downs[0].contains("10.20.0.11:8080"), "{}", downs[0]);

    // Back: rejoins after `rise` good probes.
    lab.start_backend(0).unwrap();
    let t1 = Instant::now();
    wait_for(10, || (backend_state(lbd, "10.20.0.11") == "up").then_some(())).expect("never rejoined");
    println!("rejoin after {:?} (rise 2 x 500ms)", t1.elapsed());
    let back = conns(lab, &["--count", "300", "--sources-range", "10.10.1.1-10.10.1.250"]);
    assert_eq!(back["failed"], 0, "{back}");
    assert!(back["per_backend"]["be1"].as_u64().unwrap_or(0) > 0, "{back}");
}

/// Why connections of a `conns` result `r` failed, as far as the lab can
/// tell while it is up: lbd's health transitions (a flow of a backend
/// marked down is re-dispatched, and reset), the datapath's counters in
/// `lbctl status`, and each namespace's TCP counters (which host's TCP
/// sent a reset).
fn failure_report(lab: &Lab, lbd: &Lbd, r: &serde_json::Value) -> String {
    let log = lbd.log_text();
    let health: Vec<&str> = log.lines().filter(|l| l.contains("backend down") || l.contains("backend up")).collect();
    let status = lbd.lbctl(&["status"]).unwrap_or_else(|e| format!("(lbctl status failed: {e})"));
    format!(
        "{} of {} connections failed: {}\nhealth transitions in lbd's log:\n{}\n{status}\nTCP counters by namespace:\n{}",
        r["failed"],
        r["ok"].as_u64().unwrap_or(0) + r["failed"].as_u64().unwrap_or(0),
        r["errors"],
        health.join("\n"),
        lab.tcp_counters()
    )
}

#[test]
fn slow_start_ramps_a_returning_backend() {
    let extra = format!("{HEALTH}    slow_start: 10s\n").replace("rise: 2, fall: 3", "rise: 1, fall: 1");
    let s = setup("lbt-o-slow", 3, &web(&extra, &[(1, 1), (2, 1), (3, 1)]));
    let (lab, lbd) = (&s.lab, &s.lbd);
    // Let the start-up ramp (new backends slow-start too) finish.
    wait_for(20, || {
        let st = lbd.status().unwrap();
        st["services"][0]["backends"].as_array().unwrap().iter().all(|b| b["effective_weight"] == 10).then_some(())
    })
    .expect("initial slow start never finished");
    lab.stop_backend(0).unwrap();
    wait_for(10, || (backend_state(lbd, "10.20.0.11") == "down").then_some(())).unwrap();
    lab.start_backend(0).unwrap();
    wait_for(10, || (backend_state(lbd, "10.20.0.11") == "up").then_some(())).unwrap();
    lab.reset_backend_counts().unwrap();
    let share = |a: &[u64], b: &[u64]| {
        let d: Vec<u64> = a.iter().zip(b).map(|(x, y)| y - x).collect();
        d[0] as f64 / d.iter().sum::<u64>() as f64
    };
    let counts = || lab.backend_counts().unwrap().iter().map(|c| c.connections).collect::<Vec<_>>();
    let (first, last) = std::thread::scope(|scope| {
        let stream = scope.spawn(|| {
            conns(lab, &["--concurrency", "4", "--duration-ms", "10500", "--sources-range", "10.10.1.1-10.10.1.250"])
        });
        let c0 = counts();
        std::thread::sleep(Duration::from_secs(2));
        let c2 = counts();
        std::thread::sleep(Duration::from_secs(6));
        let c8 = counts();
        std::thread::sleep(Duration::from_secs(2));
        let c10 = counts();
        let r = stream.join().unwrap();
        if r["failed"] != 0 {
            panic!("{}", failure_report(lab, lbd, &r));
        }
        (share(&c0, &c2), share(&c8, &c10))
    });
    println!(
        "slow start 10s: the returning backend's share {:.1}% in the first 2 s, {:.1}% in the last 2 s",
        first * 100.0,
        last * 100.0
    );
    assert!(first * 2.0 < last, "first {first:.3} vs last {last:.3}");
}

#[test]
fn lbctl_changes_the_pool_under_load_and_changes_survive_a_restart() {
    let s = setup("lbt-o-ctl", 4, &web("", &[(1, 1), (2, 1), (3, 1)]));
    let (lab, lbd) = (&s.lab, &s.lbd);
    std::thread::scope(|scope| {
        let long = scope.spawn(|| lab.longlived("10.10.0.100:80", 50, 80, 40, &[]).unwrap());
        std::thread::sleep(Duration::from_millis(600));
        for args in [
            vec!["backend", "weight", "web", "10.20.0.11:8080", "3"],
            vec!["backend", "drain", "web", "10.20.0.12:8080"],
            vec!["backend", "add", "web", "10.20.0.14:8080", "--weight", "2"],
            vec!["backend", "remove", "web", "10.20.0.13:8080"],
        ] {
            let out = lbd.lbctl(&args).unwrap();
            assert!(out.starts_with("ok: "), "{out}");
            std::thread::sleep(Duration::from_millis(300));
        }
        let r = long.join().unwrap();
        println!("50 long-lived connections through 4 lbctl changes: {r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["ok_rounds"], 4000, "{r}");
        assert_eq!(r["switched"], 0, "{r}");
    });
    // Bad requests change nothing and say why.
    let err = lbd.lbctl(&["backend", "weight", "web", "10.20.0.11:8080", "70000"]).unwrap_err().to_string();
    assert!(err.contains("weight") && err.contains("out of range"), "{err}");
    let err = lbd.lbctl(&["backend", "remove", "web", "10.20.0.99:8080"]).unwrap_err().to_string();
    assert!(err.contains("no backend 10.20.0.99:8080"), "{err}");

    let check = |lbd: &Lbd| {
        let st = lbd.status().unwrap();
        let b = st["services"][0]["backends"].as_array().unwrap().clone();
        let find = |a: &str| b.iter().find(|x| x["address"] == a).cloned();
        assert_eq!(find("10.20.0.11").unwrap()["weight"], 3);
        assert_eq!(find("10.20.0.12").unwrap()["state"], "drain");
        assert_eq!(find("10.20.0.14").unwrap()["weight"], 2);
        assert!(find("10.20.0.13").is_none());
    };
    check(lbd);
    // New connections follow the new pool: none to the drained or removed one.
    let r = conns(lab, &["--count", "300", "--sources-range", "10.10.1.51-10.10.1.250"]);
    assert_eq!(r["failed"], 0, "{r}");
    assert!(r["per_backend"].get("be2").is_none() && r["per_backend"].get("be3").is_none(), "{r}");
    assert!(r["per_backend"]["be4"].as_u64().unwrap() > 0, "{r}");

    // The file holds the changes; a full stop and start keeps them.
    let text = std::fs::read_to_string(&s.config).unwrap();
    assert!(text.contains("10.20.0.14") && !text.contains("10.20.0.13") && text.contains("drain: true"), "{text}");
    let mut s = s;
    assert!(s.lbd.stop().unwrap().success());
    s.lbd = Lbd::start(&s.lab, &s.config, &s.lbd.socket.clone()).unwrap();
    check(&s.lbd);
}

#[test]
fn an_invalid_reload_lists_every_problem_and_changes_nothing() {
    let s = setup("lbt-o-reload", 3, &web("", &[(1, 1), (2, 2), (3, 3)]));
    let r = conns(&s.lab, &["--count", "200", "--sources-range", "10.10.1.1-10.10.1.250"]);
    assert_eq!(r["failed"], 0);
    let before = s.lbd.status().unwrap();
    let good = std::fs::read_to_string(&s.config).unwrap();
    let bad = good
        .replace("weight: 2 }", "weight: -2 }")
        .replace("10.20.0.13", "10.20.0.300")
        .replace("port: 80\n", "port: 80\n    colour: blue\n");
    std::fs::write(&s.config, &bad).unwrap();
    let err = s.lbd.lbctl(&["reload"]).unwrap_err().to_string();
    println!("{err}");
    for field in ["services[0].colour", "services[0].backends[1].weight", "services[0].backends[2].address"] {
        assert!(err.contains(&format!("{}: {field}: ", s.config.display())), "{field} not reported:\n{err}");
    }
    assert_eq!(s.lbd.status().unwrap(), before, "the running state changed");
    // SIGHUP too.
    s.lbd.signal(libc::SIGHUP).unwrap();
    wait_for(5, || s.lbd.log_text().contains("reload rejected").then_some(())).expect("SIGHUP reload not logged");
    assert_eq!(s.lbd.status().unwrap(), before, "the running state changed");
    // Keys read only at start: each refusal says what does change it (a
    // pinned table's size only a fresh start; the rest a restart).
    assert!(good.contains("conntrack_max: 262144\n"), "{good}");
    let sized = good.replace("conntrack_max: 262144\n", "conntrack_max: 524288\nxdp_mode: generic\n");
    std::fs::write(&s.config, &sized).unwrap();
    let err = s.lbd.lbctl(&["reload"]).unwrap_err().to_string();
    println!("{err}");
    let line = |field: &str| {
        err.lines()
            .find(|l| l.contains(&format!("{}: {field}: ", s.config.display())))
            .unwrap_or_else(|| panic!("{field} not reported:\n{err}"))
            .to_owned()
    };
    assert!(line("conntrack_max").contains("stop lbd (SIGTERM"), "{err}");
    assert!(line("xdp_mode").contains("restart lbd (SIGUSR2"), "{err}");
    assert_eq!(s.lbd.status().unwrap(), before, "the running state changed");
    std::fs::write(&s.config, &good).unwrap();
}

fn call_raw(path: &std::path::Path, line: &[u8]) -> Option<serde_json::Value> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(line).unwrap();
    s.write_all(b"\n").unwrap();
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).ok()?;
    serde_json::from_str(&answer).ok()
}

#[test]
fn the_control_socket_is_root_only_and_survives_malformed_requests() {
    let s = setup("lbt-o-sock", 3, &web("", &[(1, 1), (2, 1), (3, 1)]));
    let sock = s.lbd.socket.clone();
    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);
    assert_eq!(meta.uid(), 0);
    let lbctl = s.lab.spec.bin_dir.join("lbctl");
    let as_nobody = || {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&lbctl)
            .arg("--socket")
            .arg(&sock)
            .args(["status"])
            .output()
            .unwrap()
    };
    let out = as_nobody();
    assert!(!out.status.success(), "a non-root lbctl was served");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{out:?}");
    // Even with the file mode loosened, lbd itself refuses other users.
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    std::fs::set_permissions("/run/lbd", std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = as_nobody();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("permission denied for uid 65534"), "{out:?}");
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::set_permissions("/run/lbd", std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();

    // 1,200 malformed requests: each gets an error answer, none a crash.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let templates: Vec<Vec<u8>> = vec![
        b"{".to_vec(),
        b"{}".to_vec(),
        b"[]".to_vec(),
        b"null".to_vec(),
        br#"{"command":"status","extra":1}"#.to_vec(),
        br#"{"command":"backend-add","service":"web","backend":"10.20.0.1"}"#.to_vec(),
        br#"{"command":"backend-add","service":"web","backend":"1.2.3.4:99999"}"#.to_vec(),
        br#"{"command":"backend-weight","service":"web","backend":"10.20.0.11:8080","weight":-1}"#.to_vec(),
        br#"{"command":"backend-weight","service":"nope","backend":"10.20.0.11:8080","weight":1}"#.to_vec(),
        br#"{"command":"service-add","spec":{"name":"x"}}"#.to_vec(),
        br#"{"command":"service-add","spec":7}"#.to_vec(),
        br#"{"command":"service-remove","service":"missing"}"#.to_vec(),
        br#"{"command":12}"#.to_vec(),
        vec![0xff, 0xfe, 0x00, 0x80],
    ];
    let mut answered = 0;
    for i in 0..1200 {
        let mut line = templates[i % templates.len()].clone();
        // Mutate: flip, cut or insert random bytes (never a newline).
        for _ in 0..(next() % 4) {
            let r = next();
            let pos = (r as usize >> 8) % (line.len() + 1);
            let byte = (r as u8).max(1);
            let byte = if byte == b'\n' { b'x' } else { byte };
            match r % 3 {
                0 if pos < line.len() => line[pos] = byte,
                1 => line.truncate(pos),
                _ => line.insert(pos, byte),
            }
        }
        if let Some(v) = call_raw(&sock, &line) {
            assert_eq!(v["ok"], false, "malformed request {:?} was accepted: {v}", String::from_utf8_lossy(&line));
            assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()));
            answered += 1;
        }
    }
    assert_eq!(answered, 1200, "some malformed requests got no answer");
    // A very long line is refused, and lbd keeps serving.
    let v = call_raw(&sock, &vec![b'a'; 200_000]).expect("answer to an oversized request");
    assert_eq!(v["ok"], false);
    let st = s.lbd.status().unwrap();
    assert_eq!(st["services"][0]["backends"].as_array().unwrap().len(), 3, "the pool changed: {st}");
    let r = conns(&s.lab, &["--count", "100", "--sources-range", "10.10.1.1-10.10.1.100"]);
    assert_eq!(r["failed"], 0);
}

/// lbd warns at start of forwarding the kernel has off where the
/// datapath needs it: IPv4 forwarding on a configured interface (the FIB
/// lookup refuses a packet arriving on a device whose own
/// `net.ipv4.conf.DEV.forwarding` is 0, even with `ip_forward` on), and
/// IPv6 forwarding when an IPv6 service is configured. Each warning names
/// the sysctl; with both on again the next start says nothing.
#[test]
fn a_start_warns_of_forwarding_the_kernel_has_off() {
    let s = setup("lbt-o-fwd", 3, &web("", &[(1, 1), (2, 1), (3, 1)]));
    let mut services = web("", &[(1, 1), (2, 1), (3, 1)]);
    services.push_str(&format!("  - name: web6\n    vip: \"{VIP6}\"\n    port: 80\n    backends:\n"));
    for a in s.lab.backend_addrs6() {
        services.push_str(&format!("      - {{ address: \"{a}\", port: 8080 }}\n"));
    }
    write_config(s.config.parent().unwrap(), "lbd", &s.lbd.socket, &services).unwrap();
    let sysctl = |key: &str, value: &str| {
        let out = s.lab.cmd("gw", "sysctl").args(["-qw", &format!("{key}={value}")]).output().unwrap();
        assert!(out.status.success(), "sysctl {key}={value}: {out:?}");
    };
    let warnings = || -> Vec<String> {
        let log = s.lbd.log_text();
        log.lines().filter(|l| l.contains("WARN") && l.contains("forwarding is 0")).map(str::to_owned).collect()
    };
    assert_eq!(warnings(), Vec::<String>::new(), "forwarding is on in the lab");
    sysctl("net.ipv4.conf.eth0.forwarding", "0");
    sysctl("net.ipv6.conf.all.forwarding", "0");
    s.lbd.restart().unwrap();
    let w = warnings();
    assert_eq!(w.len(), 2, "{w:#?}");
    assert!(
        w.iter().any(|l| l.contains("net.ipv4.conf.eth0.forwarding is 0") && l.contains("arriving on eth0")),
        "{w:#?}"
    );
    assert!(w.iter().any(|l| l.contains("net.ipv6.conf.all.forwarding is 0")), "{w:#?}");
    sysctl("net.ipv4.conf.eth0.forwarding", "1");
    sysctl("net.ipv6.conf.all.forwarding", "1");
    s.lbd.restart().unwrap();
    assert_eq!(warnings().len(), 2, "a start with forwarding on warned");
    let r = conns(&s.lab, &["--count", "100"]);
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(100), Some(0)), "{r}");
    // IPv6: the FIB lookup also reads the arriving device's own setting,
    // which `all` on does not override; the kernel's IPv6 forwarding
    // reads only `all`, so those packets pass, by the kernel's path.
    let sources6: Vec<String> = s.lab.client_sources6().iter().take(20).map(ToString::to_string).collect();
    let web6 = std::net::SocketAddr::new(VIP6.into(), 80).to_string();
    let fallback = || s.lbd.status().unwrap()["counters"]["fib_fallback"].as_u64().expect("fib_fallback");
    let conns6 = |expect_fallback: bool| {
        let before = fallback();
        let r =
            s.lab.client(&["conns", "--target", &web6, "--count", "100", "--sources", &sources6.join(",")]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(100), Some(0)), "{r}");
        let taken = fallback() - before;
        if expect_fallback {
            // At least the SYN and the final ACK of each connection.
            assert!(taken >= 200, "IPv6 packets refused by the FIB: only {taken}");
        } else {
            assert_eq!(taken, 0, "IPv6 packets fell back to the kernel with forwarding on");
        }
    };
    sysctl("net.ipv6.conf.eth0.forwarding", "0");
    s.lbd.restart().unwrap();
    let w = warnings();
    assert_eq!(w.len(), 3, "{w:#?}");
    assert!(w[2].contains("net.ipv6.conf.eth0.forwarding is 0") && w[2].contains("arriving on eth0"), "{w:#?}");
    conns6(true);
    sysctl("net.ipv6.conf.eth0.forwarding", "1");
    s.lbd.restart().unwrap();
    assert_eq!(warnings().len(), 3, "a start with IPv6 forwarding on warned");
    conns6(false);
}

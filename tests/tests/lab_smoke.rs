//! Brings up the namespace lab without a load balancer and checks plain
//! connectivity to the backends through the gateway. Needs root (and fails
//! saying so without it).
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]

use std::process::Command;

use lb_tests::lab::{Lab, LabSpec};

fn require_root() {
    if let Err(e) = lb_tests::require_root() {
        panic!("{e}");
    }
}

fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|ns| ns.starts_with(&format!("{prefix}-")))
        .map(String::from)
        .collect()
}

fn u(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn lab_direct_backend_connectivity() {
    require_root();
    let prefix = "lbt-smoke";
    let spec = LabSpec { prefix: prefix.into(), ..LabSpec::default() };
    let lab = Lab::up(spec).expect("lab up");
    assert_eq!(lab.backend_names(), ["be1", "be2", "be3"]);
    assert_eq!(lab.ns("be2"), "lbt-smoke-be2");
    assert_eq!(lab.client_sources().len(), 250);

    // Short-lived connections from 50 source addresses to be1.
    let v =
        lab.conns("10.20.0.11:8080", 200, 10, &["--sources-range", "10.10.1.1-10.10.1.50"]).expect("lab-client conns");
    assert_eq!(u(&v, "ok"), 200, "{v}");
    assert_eq!(u(&v, "failed"), 0, "{v}");
    assert_eq!(v["per_backend"]["be1"].as_u64(), Some(200), "{v}");
    let per_source = v["per_source_backends"].as_object().expect("per_source_backends");
    assert_eq!(per_source.len(), 50, "{v}");
    assert!(per_source.values().all(|b| b == &serde_json::json!(["be1"])), "{v}");
    let counts = lab.backend_counts().expect("backend counts");
    assert_eq!(counts.len(), 3);
    assert_eq!(counts[0].name, "be1");
    assert_eq!(counts[0].connections, 200, "{counts:?}");
    assert_eq!(counts[0].requests, 200, "{counts:?}");
    assert_eq!(counts[1].connections, 0, "{counts:?}");

    // Keep-alive connections to be2.
    let v = lab
        .client(&[
            "longlived",
            "--target",
            "10.20.0.12:8080",
            "--connections",
            "10",
            "--rounds",
            "20",
            "--sources",
            "10.10.1.1,10.10.1.2,10.10.1.3",
        ])
        .expect("lab-client longlived");
    assert_eq!(u(&v, "switched"), 0, "{v}");
    assert_eq!(u(&v, "failed"), 0, "{v}");
    assert_eq!(u(&v, "ok_rounds"), 200, "{v}");
    assert_eq!(v["per_backend"]["be2"].as_u64(), Some(10), "{v}");
    let counts = lab.backend_counts().expect("backend counts");
    assert_eq!(counts[1].connections, 10, "{counts:?}");
    assert_eq!(counts[1].requests, 200, "{counts:?}");

    // UDP to be3.
    let v = lab
        .client(&["udp", "--target", "10.20.0.13:8080", "--count", "50", "--sources-range", "10.10.1.1-10.10.1.250"])
        .expect("lab-client udp");
    assert_eq!(u(&v, "ok"), 50, "{v}");
    assert_eq!(u(&v, "failed"), 0, "{v}");
    assert_eq!(v["per_backend"]["be3"].as_u64(), Some(50), "{v}");
    assert_eq!(lab.backend_counts().unwrap()[2].udp_datagrams, 50);

    // Control API: reset, delay, stop/start.
    lab.reset_backend_counts().expect("reset");
    assert!(lab.backend_counts().unwrap().iter().all(|c| c.connections == 0 && c.requests == 0));
    lab.set_backend_delay(0, 300).expect("delay");
    let v = lab
        .client(&["conns", "--target", "10.20.0.11:8080", "--count", "2", "--concurrency", "1"])
        .expect("delayed conns");
    assert_eq!(u(&v, "ok"), 2, "{v}");
    assert!(u(&v, "elapsed_ms") >= 600, "{v}");
    lab.set_backend_delay(0, 0).expect("delay off");

    lab.stop_backend(0).expect("stop be1");
    let v = lab
        .client(&["conns", "--target", "10.20.0.11:8080", "--count", "3", "--concurrency", "1", "--timeout-ms", "1000"])
        .expect("conns to a stopped backend");
    assert_eq!(u(&v, "failed"), 3, "{v}");
    assert!(!v["errors"].as_array().unwrap().is_empty(), "{v}");
    assert!(lab.backend_counts().is_err(), "stats of a stopped backend should fail");
    lab.start_backend(0).expect("start be1");
    let v = lab
        .client(&["conns", "--target", "10.20.0.11:8080", "--count", "5", "--concurrency", "2"])
        .expect("conns after restart");
    assert_eq!(u(&v, "ok"), 5, "{v}");
    assert_eq!(lab.backend_counts().unwrap()[0].connections, 5);

    drop(lab);
    assert_eq!(namespaces_with_prefix(prefix), Vec::<String>::new());
}

#[test]
fn failed_up_leaves_nothing_behind() {
    require_root();
    let prefix = "lbt-fail";
    // A bin_dir whose lab-backend exits at once: `up` fails only after all
    // namespaces, links and addresses were created.
    let dir = std::env::temp_dir().join("lbt-fail-bin");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, body) in
        [("lab-backend", "#!/bin/sh\necho broken backend >&2\nexit 3\n"), ("lab-client", "#!/bin/sh\nexit 1\n")]
    {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let spec = LabSpec {
        prefix: prefix.into(),
        backends: 2,
        client_sources: 10,
        bin_dir: dir.clone(),
        topology: lb_tests::lab::Topology::Tuned,
        dsr: false,
        nodes: 2,
    };
    let err = Lab::up(spec).err().expect("up must fail");
    let msg = format!("{err:#}");
    assert!(msg.contains("exited during startup"), "{msg}");
    assert!(msg.contains("broken backend"), "{msg}");
    assert_eq!(namespaces_with_prefix(prefix), Vec::<String>::new());

    // A missing binary directory fails before anything is built.
    let spec = LabSpec { prefix: prefix.into(), bin_dir: dir.join("nope"), ..LabSpec::default() };
    assert!(Lab::up(spec).is_err());
    assert_eq!(namespaces_with_prefix(prefix), Vec::<String>::new());

    // down() is idempotent.
    Lab::down(prefix).expect("down of nothing");
    let _ = std::fs::remove_dir_all(dir);
}

//! Path MTU through the balancer in the lab (issue 13): transfers cross a
//! link narrower than both ends think, and complete only because the ICMP
//! errors reach the host that sent the packet, naming the packet as that
//! host sent it. Each endpoint advertises a TCP MSS for a 1,500-byte path
//! (route `advmss`) so that segments are too big for the 1,280-byte link,
//! as with a tunnel or a smaller link in between.
//!
//! 1. NAT upload, backend side narrow: the datapath answers the client's
//!    too-big segments with "fragmentation needed" from the VIP.
//! 2. NAT download, client side narrow: the datapath hands the backend's
//!    too-big replies to the kernel as they came; the kernel's error
//!    reaches the backend.
//! 3. DSR download, the client side of the reply path narrow: the router
//!    there sends its error to the VIP, and the datapath sends it on to
//!    the flow's backend.
//!
//! Needs root; one lab at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{DSR_VIP, Lab, LabSpec},
    lbd::{Lbd, wait_for, write_config_for},
};

const PREFIX: &str = "lbt-pmtu";
const NARROW: u32 = 1280;
const WIDE: u32 = 1500;
const SIZE: &str = "10485760";

fn counter(lbd: &Lbd, name: &str) -> u64 {
    lbd.status().unwrap()["counters"][name].as_u64().unwrap()
}

/// Every link between the gateway and the backends at `mtu`.
fn backend_side(lab: &Lab, mtu: u32) {
    lab.set_mtu("gw", "eth1", mtu).unwrap();
    for p in ["p0", "p1", "p2", "p3", "pb"] {
        lab.set_mtu("sw", p, mtu).unwrap();
    }
    lab.set_mtu("rt", "b0", mtu).unwrap();
    for be in lab.backend_names() {
        lab.set_mtu(&be, "eth0", mtu).unwrap();
    }
}

/// The gateway's client-side link at `mtu`.
fn client_side(lab: &Lab, mtu: u32) {
    lab.set_mtu("gw", "eth0", mtu).unwrap();
    lab.set_mtu("client", "eth0", mtu).unwrap();
}

/// lbd has seen the devices' MTUs (its datapath needs them): wait until
/// its path report is rewritten after a change. A status call is enough
/// to see the counters; the device refresh is lbd's own, every second.
fn settle() {
    std::thread::sleep(std::time::Duration::from_secs(3));
}

#[test]
fn transfers_across_a_narrower_link_complete_because_icmp_errors_reach_the_sender() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec { prefix: PREFIX.into(), backends: 3, dsr: true, ..LabSpec::default() }).expect("lab up");
    let sock = socket_for(PREFIX);
    let mut services = web("", &[(1, 1), (2, 1), (3, 1)]);
    services
        .push_str(&format!("  - name: dsr\n    vip: {DSR_VIP}\n    port: 8080\n    forwarding: dsr\n    backends:\n"));
    for a in lab.backend_addrs() {
        services.push_str(&format!("      - {{ address: {a} }}\n"));
    }
    let config = write_config_for(&config_dir(PREFIX), "lbd", &sock, &lab.gw_interfaces(), &services).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    let ok = |r: &serde_json::Value| r["complete"].as_bool() == Some(true);

    // 1. NAT upload: the backends' side narrow; they advertise a 1,460-byte MSS.
    backend_side(&lab, NARROW);
    for be in lab.backend_names() {
        lab.ip(&be, &["route", "change", "default", "via", "10.20.0.1", "dev", "eth0", "advmss", "1460"]).unwrap();
    }
    settle();
    let before = counter(&lbd, "too_big");
    let r = lab
        .client(&["upload", "--target", "10.10.0.100:80", "--bytes", SIZE, "--timeout-ms", "15000"])
        .unwrap_or_else(|e| {
            let st = lbd.status().unwrap();
            panic!(
                "{e:#}\ncounters {}\npaths {}\n{}",
                st["counters"],
                st["paths"],
                lab.cmd("client", "nstat")
                    .args(["-az"])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .filter(|l| !l.contains(" 0 "))
                        .collect::<Vec<_>>()
                        .join("\n"))
                    .unwrap_or_default()
            )
        });
    let answered = counter(&lbd, "too_big") - before;
    println!("NAT upload across a {NARROW}-byte backend side: {r}, {answered} too-big packets answered");
    assert!(ok(&r), "{r}");
    assert!(answered > 0, "the upload crossed the narrow link without a fragmentation-needed answer");
    backend_side(&lab, WIDE);
    for be in lab.backend_names() {
        lab.ip(&be, &["route", "change", "default", "via", "10.20.0.1", "dev", "eth0"]).unwrap();
    }

    // 2. NAT download: the client's side narrow; it advertises 1,460.
    client_side(&lab, NARROW);
    lab.ip("client", &["route", "change", "10.10.0.96/28", "via", "10.10.0.1", "advmss", "1460"]).unwrap();
    settle();
    let before = counter(&lbd, "too_big");
    let r = lab.client(&["download", "--target", "10.10.0.100:80", "--bytes", SIZE, "--timeout-ms", "60000"]).unwrap();
    let handed = counter(&lbd, "too_big") - before;
    println!("NAT download across a {NARROW}-byte client side: {r}, {handed} too-big replies handed to the kernel");
    assert!(ok(&r), "{r}");
    assert!(handed > 0, "the download crossed the narrow link without the kernel's error to the backend");
    client_side(&lab, WIDE);
    lab.ip("client", &["route", "change", "10.10.0.96/28", "via", "10.10.0.1"]).unwrap();

    // 3. DSR download: the answers' path (backend -> router -> client)
    // narrow at the router's client side. Its errors go to the VIP.
    lab.set_mtu("rt", "c0", NARROW).unwrap();
    lab.set_mtu("client", "eth1", NARROW).unwrap();
    settle();
    let before = counter(&lbd, "icmp_to_backend");
    let target = format!("{DSR_VIP}:8080");
    let r = lab
        .client(&["download", "--target", &target, "--bytes", SIZE, "--timeout-ms", "20000"])
        .unwrap_or_else(|e| panic!("{e:#}\ncounters {}", lbd.status().unwrap()["counters"]));
    let relayed = counter(&lbd, "icmp_to_backend") - before;
    println!(
        "DSR download across a {NARROW}-byte link on the answers' path: {r}, {relayed} ICMP errors sent on to the backend"
    );
    assert!(ok(&r), "{r}");
    assert!(relayed > 0, "the router's errors did not reach the backend through the balancer");
    let all = wait_for(1, || Some(lbd.status().unwrap()["counters"].clone())).unwrap();
    println!("counters: {all}");
}

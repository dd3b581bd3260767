//! Path MTU through the balancer in the lab (issue 13): transfers cross a
//! link narrower than both ends think, and complete only because the ICMP
//! errors reach the host that sent the packet, naming the packet as that
//! host sent it. Each endpoint advertises a TCP MSS for a 1,500-byte path
//! (route `advmss`) so that segments are too big for the 1,280-byte link,
//! as with a tunnel or a smaller link in between.
//!
//! 1. NAT upload, backend side narrow: the datapath answers the client's
//!    too-big segments with "fragmentation needed" / "packet too big"
//!    from the VIP, in both families.
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
    lab::{DSR_VIP, Lab, LabSpec, VIP6},
    lbd::{Lbd, assert_xdp_mode, wait_for, write_config_for},
};

const PREFIX: &str = "lbt-pmtu";
const NARROW: u32 = 1280;
const WIDE: u32 = 1500;
const SIZE: &str = "10485760";

fn counter(lbd: &Lbd, name: &str) -> u64 {
    lbd.status().unwrap()["counters"][name].as_u64().unwrap()
}

/// An IPv6 NAT service (`web6`) on the lab's three backends.
fn web6(lab: &Lab) -> String {
    let mut s = format!("  - name: web6\n    vip: \"{VIP6}\"\n    port: 80\n    protocol: tcp\n    backends:\n");
    for a in lab.backend_addrs6() {
        s.push_str(&format!("      - {{ address: \"{a}\", port: 8080 }}\n"));
    }
    s
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
    services.push_str(&web6(&lab));
    services
        .push_str(&format!("  - name: dsr\n    vip: {DSR_VIP}\n    port: 8080\n    forwarding: dsr\n    backends:\n"));
    for a in lab.backend_addrs() {
        services.push_str(&format!("      - {{ address: {a} }}\n"));
    }
    let config = write_config_for(&config_dir(PREFIX), "lbd", &sock, &lab.gw_interfaces(), &services).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    let ok = |r: &serde_json::Value| r["complete"].as_bool() == Some(true);

    // 1. NAT upload: the backends' side narrow; they advertise a 1,460-byte
    // MSS (1,440 in IPv6).
    lab.set_backend_side_mtu(NARROW).unwrap();
    for be in lab.backend_names() {
        lab.ip(&be, &["route", "change", "default", "via", "10.20.0.1", "dev", "eth0", "advmss", "1460"]).unwrap();
        lab.ip(&be, &["-6", "route", "change", "default", "via", "fd00:20::1", "dev", "eth0", "advmss", "1440"])
            .unwrap();
    }
    settle();
    // IPv6 first: its packets that fit the narrower link leave by a hop
    // looked up for each (never cached there), with the FIB's MACs.
    ipv6_backends_up(&lab, &lbd);
    let target6 = format!("[{VIP6}]:80");
    let (r, answered) = upload_answered(&lab, &lbd, &target6, "15000");
    println!("IPv6 NAT upload across a {NARROW}-byte backend side: {r}, {answered} too-big packets answered");
    assert!(ok(&r), "{r}");
    assert!(answered > 0, "the IPv6 upload crossed the narrow link without a packet-too-big answer");
    let (r, answered) = upload_answered(&lab, &lbd, "10.10.0.100:80", "15000");
    println!("NAT upload across a {NARROW}-byte backend side: {r}, {answered} too-big packets answered");
    assert!(ok(&r), "{r}");
    assert!(answered > 0, "the upload crossed the narrow link without a fragmentation-needed answer");
    lab.set_backend_side_mtu(WIDE).unwrap();
    for be in lab.backend_names() {
        lab.ip(&be, &["route", "change", "default", "via", "10.20.0.1", "dev", "eth0"]).unwrap();
        lab.ip(&be, &["-6", "route", "change", "default", "via", "fd00:20::1", "dev", "eth0"]).unwrap();
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

/// A route's own MTU, below its device's, is the gateway's to enforce, as
/// the kernel's forwarding does: an operator sets one (locked) where a
/// link past the next hop is narrower (a tunnel, a smaller segment) and
/// nothing there answers for it. Here the backends' own links take 1,400
/// bytes behind the gateway's 1,500-byte segment, and a frame longer than
/// that is dropped where it arrives, counted there and not answered; the
/// gateway's routes to the backends say 1,400. Uploads in both families
/// must complete with every too-big packet answered by the datapath (from
/// the VIP) and none sent into the narrower links, also once a flow's
/// next hop is cached: the backends' links drop nothing. The default
/// config (`auto`: native on the tuned lab).
#[test]
fn a_route_mtu_below_its_devices_is_enforced() {
    const ROUTE_MTU: u32 = 1400;
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec { prefix: PREFIX.into(), backends: 3, ..LabSpec::default() }).expect("lab up");
    let sock = socket_for(PREFIX);
    let mut services = web("", &[(1, 1), (2, 1), (3, 1)]);
    services.push_str(&web6(&lab));
    let config = write_config_for(&config_dir(PREFIX), "lbd", &sock, &lab.gw_interfaces(), &services).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    for iface in lab.gw_interfaces() {
        assert_xdp_mode(&lab, &lbd, &iface, "native", "the tuned lab");
    }
    // The backends' links narrower than the segment the gateway is on;
    // the backends advertise an MSS for a 1,500-byte path.
    for be in lab.backend_names() {
        lab.set_mtu(&be, "eth0", ROUTE_MTU).unwrap();
        lab.ip(&be, &["-4", "route", "change", "default", "via", "10.20.0.1", "dev", "eth0", "advmss", "1460"])
            .unwrap();
        lab.ip(&be, &["-6", "route", "change", "default", "via", "fd00:20::1", "dev", "eth0", "advmss", "1440"])
            .unwrap();
    }
    let mtu = ROUTE_MTU.to_string();
    // Unlocked first: the kernel's own IPv4 forwarding honours it, the
    // FIB helper the datapath asks does not (`ip_mtu_from_fib_result`),
    // so lbd must say so, naming the route (it asks about the routes to
    // its backends every 5 s).
    lab.ip("gw", &["-4", "route", "add", "10.20.0.0/25", "dev", "eth1", "mtu", &mtu]).unwrap();
    let warned = wait_for(15, || {
        lbd.log_text()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("not locked") && l.contains("10.20.0.0/25") && l.contains("1400"))
            .then_some(())
    });
    assert!(warned.is_some(), "lbd did not warn about the unlocked route MTU; log:\n{}", lbd.log_text());
    // Locked: the kernel's FIB answers a forwarded packet by a route's
    // own MTU only then (`ip_mtu_from_fib_result`), and so does the FIB
    // helper the datapath asks.
    lab.ip("gw", &["-4", "route", "change", "10.20.0.0/25", "dev", "eth1", "mtu", "lock", &mtu]).unwrap();
    lab.ip("gw", &["-6", "route", "add", "fd00:20::/80", "dev", "eth1", "mtu", "lock", &mtu]).unwrap();
    ipv6_backends_up(&lab, &lbd);
    // Frames dropped on the backends' links, either end.
    let dropped = || -> u64 {
        let mut n = 0;
        for (i, be) in lab.backend_names().iter().enumerate() {
            n += link_dropped(&lab, be, "eth0") + link_dropped(&lab, "sw", &format!("p{}", i + 1));
        }
        n
    };
    for target in ["10.10.0.100:80".to_string(), format!("[{VIP6}]:80")] {
        let lost = dropped();
        let (r, answered) = upload_answered(&lab, &lbd, &target, "20000");
        let lost = dropped() - lost;
        println!(
            "upload to {target} across a {ROUTE_MTU}-byte route: {r}, {answered} too-big packets answered, {lost} dropped on the backends' links"
        );
        assert_eq!(r["complete"].as_bool(), Some(true), "{target}: {r}");
        assert!(answered > 0, "{target}: the upload passed a {ROUTE_MTU}-byte route without a too-big answer");
        assert_eq!(lost, 0, "{target}: packets too big for the route were sent on, and dropped past it");
    }
}

/// Wait (15 s at most) until lbd reports every IPv6 backend of `web6` up.
fn ipv6_backends_up(lab: &Lab, lbd: &Lbd) {
    let up = wait_for(15, || {
        lab.backend_addrs6().iter().all(|a| lbd.backend_state("web6", &a.to_string()) == "up").then_some(())
    });
    assert!(up.is_some(), "IPv6 backends not up");
}

/// A 10 MB upload from the client to `target` (failing after `timeout_ms`,
/// with lbd's counters and paths and the client's TCP counters), and how
/// many packets the datapath answered as too big meanwhile.
fn upload_answered(lab: &Lab, lbd: &Lbd, target: &str, timeout_ms: &str) -> (serde_json::Value, u64) {
    let before = counter(lbd, "too_big");
    let r =
        lab.client(&["upload", "--target", target, "--bytes", SIZE, "--timeout-ms", timeout_ms]).unwrap_or_else(|e| {
            let st = lbd.status().unwrap();
            panic!(
                "{target}: {e:#}\ncounters {}\npaths {}\n{}",
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
    (r, counter(lbd, "too_big") - before)
}

/// Frames the kernel counts as dropped on `dev` in lab role `role`'s
/// namespace, received or sent (`ip -s link`).
fn link_dropped(lab: &Lab, role: &str, dev: &str) -> u64 {
    let out = std::process::Command::new("ip")
        .args(["-n", &lab.ns(role), "-j", "-s", "link", "show", "dev", dev])
        .output()
        .expect("ip -s link");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j -s link output");
    let stats = &v[0]["stats64"];
    stats["rx"]["dropped"].as_u64().expect("rx dropped") + stats["tx"]["dropped"].as_u64().expect("tx dropped")
}

//! An interface replaced under the balancer: a device deleted and made
//! again under the same name (a driver reload, a veth re-created by its
//! owner) is a new device, without the XDP program the old one had.
//! lbd reports it missing while it is gone (`lbctl status`, the
//! `lb_interface_xdp_mode` gauge at 0) and attaches to the new device by
//! itself, in the mode `auto` picks; the same when the device was
//! replaced while no lbd ran and a new lbd adopts the pinned link of the
//! old one. Verified with the kernel's view (the program on the device),
//! the datapath's path counters and the backends' accept counts. Needs
//! root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use lb_tests::{
    harness::{Running, web},
    lab::{GW6_BACKEND, Lab},
    lbd::{Lbd, path_counts, wait_for, write_config_for, xdp_mode_in_use, xdp_program_in_use},
};

/// Delete the gateway's backend-side veth (`eth1`, its peer `p0` in the
/// switch) and make it again as the lab first made it, with the same MAC
/// address (as a reloaded NIC has), so the backends' neighbour entries
/// stay right. `between` runs while the device is gone.
fn replace_eth1(lab: &Lab, between: impl FnOnce()) {
    let out = lab.cmd("gw", "ip").args(["-j", "link", "show", "eth1"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mac = v[0]["address"].as_str().expect("eth1's address").to_owned();
    lab.ip("gw", &["link", "del", "eth1"]).unwrap();
    between();
    let sw = lab.ns("sw");
    lab.ip("gw", &["link", "add", "eth1", "address", &mac, "type", "veth", "peer", "name", "p0", "netns", &sw])
        .unwrap();
    lab.ip("sw", &["link", "set", "p0", "master", "br0"]).unwrap();
    lab.ip("sw", &["link", "set", "p0", "up"]).unwrap();
    // The tuned lab's redirect target: GRO on the peer.
    let ok = lab.cmd("sw", "ethtool").args(["-K", "p0", "gro", "on"]).status().unwrap();
    assert!(ok.success(), "ethtool -K p0 gro on");
    configure_eth1(lab);
}

/// Move the gateway's `eth1` into another namespace and back (its
/// addresses go on the way out). `between` runs while it is away.
fn move_eth1_away_and_back(lab: &Lab, between: impl FnOnce()) {
    let (gw, sw) = (lab.ns("gw"), lab.ns("sw"));
    lab.ip("gw", &["link", "set", "eth1", "netns", &sw]).unwrap();
    between();
    lab.ip("sw", &["link", "set", "eth1", "netns", &gw]).unwrap();
    configure_eth1(lab);
}

/// The gateway's addresses and settings on `eth1`, as the lab made them.
fn configure_eth1(lab: &Lab) {
    lab.ip("gw", &["addr", "add", "10.20.0.1/24", "dev", "eth1"]).unwrap();
    lab.ip("gw", &["addr", "add", &format!("{GW6_BACKEND}/64"), "dev", "eth1", "nodad"]).unwrap();
    let ok = lab.cmd("gw", "sysctl").args(["-q", "-w", "net.ipv4.conf.eth1.rp_filter=0"]).status().unwrap();
    assert!(ok.success(), "sysctl rp_filter");
    lab.ip("gw", &["link", "set", "eth1", "up"]).unwrap();
}

/// lbd's report for `iface` (`lbctl status`).
fn reported(lbd: &Lbd, iface: &str) -> serde_json::Value {
    let s = lbd.status().unwrap();
    s["interfaces"]
        .as_array()
        .expect("interfaces")
        .iter()
        .find(|a| a["interface"] == iface)
        .unwrap_or_else(|| panic!("{iface} not in {}", s["interfaces"]))
        .clone()
}

/// New connections for a second: none fails, every one reaches a backend
/// through the datapath (the backends' accept counts and lbd's new-flow
/// counters move together), and the forwarded packets left by XDP
/// redirect (the tuned lab's path, into the new device too).
fn balanced(lab: &Lab, lbd: &Lbd) {
    let (redirected, _, _) = path_counts(&lbd.status().unwrap());
    let served = lab.connections_served().unwrap();
    let flows = lbd.total_new_flows();
    let r =
        lab.client(&["conns", "--target", "10.10.0.100:80", "--concurrency", "4", "--duration-ms", "1000"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    let ok = r["ok"].as_u64().unwrap();
    assert!(ok > 50, "{r}");
    assert_eq!(lab.connections_served().unwrap(), served + ok, "connections not served by the backends: {r}");
    let counted = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == flows + ok));
    assert_eq!(counted, Some(flows + ok), "lbd counted {} new flows, {ok} were made", lbd.total_new_flows() - flows);
    let (now, _, _) = path_counts(&lbd.status().unwrap());
    // Each connection's packets both ways: at least three per connection
    // left by redirect (SYN, SYN-ACK, ACK, request, answer, closes).
    assert!(now >= redirected + 3 * ok, "{} packets left by XDP redirect for {ok} connections", now - redirected);
}

/// The `lb_interface_xdp_mode` sample of `iface` (the default metrics
/// address, in the gateway).
fn metric(lab: &Lab, iface: &str) -> Option<String> {
    let url = "http://127.0.0.1:9464/metrics";
    let out = lab.cmd("gw", "curl").args(["-sf", "--max-time", "5", url]).output().unwrap();
    assert!(out.status.success(), "GET {url}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let prefix = format!("lb_interface_xdp_mode{{interface=\"{iface}\",");
    text.lines().find(|l| l.starts_with(&prefix)).map(str::to_owned)
}

#[test]
fn a_replaced_interface_gets_the_program_again() {
    let web = web("    scheduler: maglev\n", &[(1, 1), (2, 1), (3, 1)]);
    let mut s = Running::start("lbt-devices", 3, &web);
    let (lab, config, sock) = (&s.lab, s.config.clone(), s.lbd.socket.clone());
    let mode = xdp_mode_in_use(lab, "eth1").unwrap();
    assert_eq!(mode.as_deref(), Some("native"), "the tuned lab's eth1 takes native XDP");
    balanced(lab, &s.lbd);

    // Replaced while lbd runs.
    replace_eth1(lab, || {
        let missing = wait_for(5, || Some(reported(&s.lbd, "eth1")).filter(|a| a["missing"] == true));
        assert!(missing.is_some(), "eth1 is gone and lbd does not say so: {}", reported(&s.lbd, "eth1"));
        assert_eq!(metric(lab, "eth1").as_deref(), Some("lb_interface_xdp_mode{interface=\"eth1\",mode=\"native\"} 0"));
        let text = s.lbd.lbctl(&["status"]).unwrap();
        assert!(text.contains("interface eth1 MISSING"), "{text}");
    });
    let back = wait_for(5, || xdp_mode_in_use(lab, "eth1").unwrap().filter(|m| m == "native"));
    assert!(back.is_some(), "XDP not on the new eth1 after 5 s; log:\n{}", s.lbd.log_text());
    let reattached = wait_for(5, || Some(reported(&s.lbd, "eth1")).filter(|a| a.get("missing").is_none()));
    assert!(reattached.is_some(), "lbd still reports eth1 missing: {}", reported(&s.lbd, "eth1"));
    assert!(s.lbd.log_text().contains("the interface was replaced: XDP attached again"), "{}", s.lbd.log_text());
    assert_eq!(metric(lab, "eth1").as_deref(), Some("lb_interface_xdp_mode{interface=\"eth1\",mode=\"native\"} 1"));
    balanced(lab, &s.lbd);

    // Moved to another namespace and back: whether the device keeps the
    // program on the way (the kernel decides), lbd ends with it on eth1
    // and reports it attached.
    move_eth1_away_and_back(lab, || {
        let missing = wait_for(5, || Some(reported(&s.lbd, "eth1")).filter(|a| a["missing"] == true));
        assert!(missing.is_some(), "eth1 moved away and lbd does not say so: {}", reported(&s.lbd, "eth1"));
    });
    let back = wait_for(5, || {
        let attached = xdp_mode_in_use(lab, "eth1").unwrap().is_some_and(|m| m == "native");
        (attached && reported(&s.lbd, "eth1").get("missing").is_none()).then_some(())
    });
    assert!(back.is_some(), "eth1 back: {:?}, {}", xdp_mode_in_use(lab, "eth1"), reported(&s.lbd, "eth1"));
    balanced(lab, &s.lbd);

    // Replaced while no lbd runs: the next one adopts the pinned link of
    // the old device, finds the program not on the new one, and attaches.
    s.lbd.kill().unwrap();
    replace_eth1(lab, || {});
    assert_eq!(xdp_mode_in_use(lab, "eth1").unwrap(), None, "a new device came with XDP");
    let mut lbd = Lbd::start(lab, &config, &sock).unwrap();
    let back = wait_for(5, || xdp_mode_in_use(lab, "eth1").unwrap().filter(|m| m == "native"));
    assert!(back.is_some(), "XDP not on the new eth1 after the restart; log:\n{}", lbd.log_text());
    assert_eq!(xdp_mode_in_use(lab, "eth0").unwrap().as_deref(), Some("native"));
    balanced(lab, &lbd);

    // Replaced while no lbd runs, and the new device given another XDP
    // program meanwhile (another datapath's, pinned elsewhere): the pinned
    // link is severed and cannot be adopted. The start is refused, naming
    // the interface and the program in the way, and changes no program;
    // once that program is gone, the next start attaches.
    lbd.kill().unwrap();
    replace_eth1(lab, || {});
    // Inside the lab's pin directory, so that the lab's teardown removes it.
    let other_pin = lab.pin_dir().join("other");
    let other = write_config_for(config.parent().unwrap(), "other", &sock, &["eth1".into()], &web).unwrap();
    let text = std::fs::read_to_string(&other).unwrap();
    let line = text.lines().find(|l| l.starts_with("pin_path:")).expect("pin_path").to_owned();
    std::fs::write(&other, text.replace(&line, &format!("pin_path: {}", other_pin.display()))).unwrap();
    let mut in_the_way = Lbd::start(lab, &other, &sock).unwrap();
    let theirs = in_the_way.program_id().expect("the other datapath's program");
    in_the_way.kill().unwrap();
    let ours = xdp_program_in_use(lab, "eth0");
    assert_eq!(xdp_program_in_use(lab, "eth1"), theirs);
    let err = Lbd::start(lab, &config, &sock).err().expect("lbd started over another program on eth1");
    let log = format!("{err:#}");
    let text = log.lines().rev().find(|l| l.starts_with("lbd: ")).unwrap_or_else(|| panic!("no error line: {log}"));
    let names = format!("eth1 already runs an XDP program (id {theirs}, \"lb_xdp\")");
    assert!(text.contains(&names), "the error does not name the interface and program: {text}");
    assert_eq!((xdp_program_in_use(lab, "eth0"), xdp_program_in_use(lab, "eth1")), (ours, theirs));
    std::fs::remove_dir_all(&other_pin).unwrap();
    assert_eq!(xdp_mode_in_use(lab, "eth1").unwrap(), None, "the other datapath's link outlived its pins");
    let mut lbd = Lbd::start(lab, &config, &sock).unwrap();
    let back = wait_for(5, || xdp_mode_in_use(lab, "eth1").unwrap().filter(|m| m == "native"));
    assert!(back.is_some(), "XDP not on eth1 once the other program was gone; log:\n{}", lbd.log_text());
    assert_eq!(xdp_program_in_use(lab, "eth0"), lbd.program_id().unwrap());
    balanced(lab, &lbd);
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

//! L2 direct server return in the lab (issue 13): the backends hold the
//! DSR VIPs on loopback and answer clients by a path that bypasses the
//! gateway (`LabSpec::dsr`). DSR services of both families, TCP and UDP,
//! beside a NAT service in the same lbd: every connection and flow
//! succeeds with exact per-backend counts, and a 100 MB download through
//! each DSR VIP completes while the datapath counts only the client's
//! packets (the replies never passed it). Needs root; one lab at a time.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::net::{IpAddr, SocketAddr};

use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{DSR_VIP, DSR_VIP6, Lab, LabSpec, Topology},
    lbd::{Lbd, path_counts, write_config_for, xdp_mode_in_use},
};

const PREFIX: &str = "lbt-dsr";
const PORT: u16 = 8080;
const DOWNLOAD: u64 = 100 * 1024 * 1024;

fn services(lab: &Lab) -> String {
    let mut s = web("", &[(1, 1), (2, 1), (3, 1)]);
    let (v4, v6) = (lab.backend_ips(false), lab.backend_ips(true));
    for (name, vip, proto, backends) in [
        ("dsr4", IpAddr::from(DSR_VIP), "tcp", &v4),
        ("dsr6", IpAddr::from(DSR_VIP6), "tcp", &v6),
        ("dsr4u", IpAddr::from(DSR_VIP), "udp", &v4),
        ("dsr6u", IpAddr::from(DSR_VIP6), "udp", &v6),
    ] {
        // Backends without a port: DSR gives them the service's.
        s.push_str(&format!(
            "  - name: {name}\n    vip: \"{vip}\"\n    port: {PORT}\n    protocol: {proto}\n    forwarding: dsr\n    backends:\n"
        ));
        for a in backends {
            s.push_str(&format!("      - {{ address: \"{a}\" }}\n"));
        }
    }
    s
}

/// What lbd counted for one backend of a service.
#[derive(Debug, Clone, Copy)]
struct Counted {
    new_flows: u64,
    packets_in: u64,
    bytes_in: u64,
    packets_out: u64,
    bytes_out: u64,
}

/// lbd's counts of each backend of `service`, in `addrs` order.
fn counts(lbd: &Lbd, service: &str, addrs: &[IpAddr]) -> Vec<Counted> {
    let status = lbd.status().unwrap();
    addrs
        .iter()
        .map(|a| {
            let b = Lbd::backend(&status, service, &a.to_string()).unwrap_or_else(|| panic!("{service} {a}"));
            let n = |k: &str| b[k].as_u64().unwrap_or_else(|| panic!("no {k} in {b}"));
            Counted {
                new_flows: n("new_flows"),
                packets_in: n("packets_in"),
                bytes_in: n("bytes_in"),
                packets_out: n("packets_out"),
                bytes_out: n("bytes_out"),
            }
        })
        .collect()
}

/// The gateway's forwarded-packet counters: (IPv4, IPv6).
fn gw_forwarded(lab: &Lab) -> (u64, u64) {
    let text = |file: &str| {
        let out = lab.cmd("gw", "cat").arg(file).output().expect("cat");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let snmp = text("/proc/net/snmp");
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip: "));
    let (names, values) = (ip.next().expect("Ip header"), ip.next().expect("Ip values"));
    let i = names.split_whitespace().position(|n| n == "ForwDatagrams").expect("ForwDatagrams");
    let v4 = values.split_whitespace().nth(i).expect("value").parse().expect("number");
    let snmp6 = text("/proc/net/snmp6");
    let v6 = snmp6
        .lines()
        .find_map(|l| l.strip_prefix("Ip6OutForwDatagrams"))
        .expect("Ip6OutForwDatagrams")
        .trim()
        .parse()
        .expect("number");
    (v4, v6)
}

/// The lab's DSR wiring by itself, the gateway's kernel standing in for
/// the balancer: a host route sends each DSR VIP to be1, the packets
/// still addressed to the VIP as L2 DSR leaves them. be1 takes them on
/// its loopback VIP and answers past the gateway: a 100 MB download per
/// family arrives on the client's bypass interface while the gateway
/// forwards only the client's packets. Nobody on the backends' network
/// answers ARP or neighbour solicitations for a DSR VIP.
#[test]
fn the_dsr_wiring_answers_past_the_gateway() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec {
        prefix: "lbt-dsrlab".into(),
        backends: 2,
        client_sources: 4,
        dsr: true,
        ..LabSpec::default()
    })
    .expect("lab up");
    let backend_side = lab.gw_interfaces().last().expect("an interface").clone();
    let (be1, be1_6) = (lab.backend_addrs()[0].to_string(), lab.backend_addrs6()[0].to_string());
    lab.ip("gw", &["route", "add", &format!("{DSR_VIP}/32"), "via", &be1]).unwrap();
    lab.ip("gw", &["-6", "route", "add", &format!("{DSR_VIP6}/128"), "via", &be1_6]).unwrap();
    for vip in [IpAddr::from(DSR_VIP), IpAddr::from(DSR_VIP6)] {
        let target = SocketAddr::new(vip, PORT).to_string();
        let (fwd_before, eth0_before, eth1_before) =
            (gw_forwarded(&lab), lab.link_bytes("client", "eth0").unwrap(), lab.link_bytes("client", "eth1").unwrap());
        let d = lab.client(&["download", "--target", &target, "--bytes", &DOWNLOAD.to_string()]).unwrap();
        let (fwd, eth0, eth1) =
            (gw_forwarded(&lab), lab.link_bytes("client", "eth0").unwrap(), lab.link_bytes("client", "eth1").unwrap());
        assert_eq!(
            (d["complete"].as_bool(), d["bytes"].as_u64(), d["backend"].as_str()),
            (Some(true), Some(DOWNLOAD), Some("be1")),
            "{d}"
        );
        let forwarded = (fwd.0 - fwd_before.0) + (fwd.1 - fwd_before.1);
        let (by_gw, by_bypass) = (eth0.0 - eth0_before.0, eth1.0 - eth1_before.0);
        println!(
            "{vip}: {DOWNLOAD} bytes in {} ms; the client received {by_bypass} bytes on the bypass, {by_gw} from the gateway, which forwarded {forwarded} packets (the client's)",
            d["ms"]
        );
        assert!(by_bypass >= DOWNLOAD, "{vip}: only {by_bypass} bytes came by the bypass");
        assert!(by_gw < DOWNLOAD / 100, "{vip}: {by_gw} bytes came by the gateway");
        assert!(forwarded > 0, "{vip}: the client's packets went by the gateway");
    }
    // The gateway asking its backend side for the VIPs themselves (an
    // on-link route): no backend answers, the connections fail, and the
    // neighbour entries stay without a link-layer address.
    lab.ip("gw", &["route", "replace", &format!("{DSR_VIP}/32"), "dev", &backend_side]).unwrap();
    lab.ip("gw", &["-6", "route", "replace", &format!("{DSR_VIP6}/128"), "dev", &backend_side]).unwrap();
    for vip in [IpAddr::from(DSR_VIP), IpAddr::from(DSR_VIP6)] {
        let url = format!("http://{}/", SocketAddr::new(vip, PORT));
        let out = lab.cmd("gw", "curl").args(["-s", "--max-time", "2", &url]).output().unwrap();
        assert!(!out.status.success(), "{vip} answered on the backends' network: {out:?}");
        let out = lab.cmd("gw", "ip").args(["-j", "neigh", "show", "to", &vip.to_string()]).output().unwrap();
        let neigh: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let learned: Vec<&serde_json::Value> =
            neigh.as_array().unwrap().iter().filter(|n| n.get("lladdr").is_some()).collect();
        assert!(learned.is_empty(), "a backend announced {vip}: {neigh}");
    }
}

#[test]
fn dsr_services_balance_exactly_and_their_replies_bypass_the_balancer() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let lab = Lab::up(LabSpec { prefix: PREFIX.into(), backends: 3, dsr: true, ..LabSpec::default() }).expect("lab up");
    let sock = socket_for(PREFIX);
    let config = write_config_for(&config_dir(PREFIX), "lbd", &sock, &lab.gw_interfaces(), &services(&lab)).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    let sources4 = "10.10.1.1-10.10.1.100";
    let sources6: Vec<String> = lab.client_sources6().iter().take(100).map(ToString::to_string).collect();
    let sources6 = sources6.join(",");

    for (service, vip, v6) in [("dsr4", IpAddr::from(DSR_VIP), false), ("dsr6", IpAddr::from(DSR_VIP6), true)] {
        let target = SocketAddr::new(vip, PORT).to_string();
        let src: [&str; 2] = if v6 { ["--sources", &sources6] } else { ["--sources-range", sources4] };
        let addrs = lab.backend_ips(v6);

        // 1,000 HTTP connections, exact per backend.
        lab.reset_backend_counts().unwrap();
        let r = lab.client(&["conns", "--target", &target, "--count", "1000", src[0], src[1]]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(1000), Some(0)), "{service}: {}", r["errors"]);
        let ours: Vec<u64> = counts(&lbd, service, &addrs).iter().map(|c| c.new_flows).collect();
        // What each backend accepted on the VIP itself (the only address
        // the DSR service reaches).
        let theirs: Vec<u64> = lab.backend_counts().unwrap().iter().map(|c| c.at(vip).connections).collect();
        println!("{service}: 1,000 connections, new flows {ours:?}, backends accepted {theirs:?}");
        assert_eq!(ours, theirs, "{service}: lbd's per-backend counts are the backends' own");
        assert!(ours.iter().all(|&n| n > 0), "{service}: a backend got nothing: {ours:?}");

        // 1,000 UDP flows of 3 datagrams, each on one backend.
        let udp = format!("{service}u");
        let r =
            lab.client(&["udp", "--target", &target, "--count", "1000", "--per-socket", "3", src[0], src[1]]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(3000), Some(0)), "{udp}: {}", r["errors"]);
        assert_eq!((r["flows_switched"].as_u64(), r["replies_from_other_addr"].as_u64()), (Some(0), Some(0)), "{r}");
        let ours: Vec<u64> = counts(&lbd, &udp, &addrs).iter().map(|c| c.new_flows).collect();
        let backends = lab.backend_counts().unwrap();
        let datagrams: Vec<u64> = backends.iter().map(|c| c.udp_datagrams).collect();
        let flows: Vec<u64> = backends.iter().map(|c| c.at(vip).udp_flows).collect();
        let answered: Vec<u64> =
            ["be1", "be2", "be3"].iter().map(|b| r["per_backend"][b].as_u64().unwrap_or(0)).collect();
        println!("{udp}: 1,000 flows, new flows {ours:?}, datagrams received {datagrams:?}");
        // A later socket may reuse an earlier one's port: one 5-tuple, one flow.
        assert_eq!(ours.iter().sum::<u64>(), r["distinct_flows"].as_u64().unwrap(), "{udp}: one new flow per 5-tuple");
        assert_eq!(datagrams, answered, "{udp}: each backend answered what it received");
        assert_eq!(ours, flows, "{udp}: per backend, lbd's new flows are the distinct peers it saw on the VIP");

        // A 100 MB download: the replies (the 100 MB) never pass the
        // datapath, which sees only the client's ACKs.
        let before = counts(&lbd, service, &addrs);
        let (eth0_before, eth1_before) =
            (lab.link_bytes("client", "eth0").unwrap(), lab.link_bytes("client", "eth1").unwrap());
        let bytes = DOWNLOAD.to_string();
        let d = lab.client(&["download", "--target", &target, "--bytes", &bytes, src[0], src[1]]).unwrap();
        println!("{service}: download {d}");
        assert_eq!((d["complete"].as_bool(), d["bytes"].as_u64()), (Some(true), Some(DOWNLOAD)), "{d}");
        let after = counts(&lbd, service, &addrs);
        let (eth0, eth1) = (lab.link_bytes("client", "eth0").unwrap(), lab.link_bytes("client", "eth1").unwrap());
        let packets_in: u64 = after.iter().zip(&before).map(|(a, b)| a.packets_in - b.packets_in).sum();
        let bytes_in: u64 = after.iter().zip(&before).map(|(a, b)| a.bytes_in - b.bytes_in).sum();
        let (packets_out, bytes_out): (u64, u64) =
            after.iter().fold((0, 0), |(p, b), a| (p + a.packets_out, b + a.bytes_out));
        let (by_gw, by_bypass) = (eth0.0 - eth0_before.0, eth1.0 - eth1_before.0);
        println!(
            "{service}: during the download the datapath saw {packets_in} packets, {bytes_in} bytes client -> server and {packets_out} back; the client received {by_bypass} bytes by the bypass, {by_gw} from the gateway"
        );
        assert_eq!((packets_out, bytes_out), (0, 0), "{service}: no reply passed the datapath");
        assert!(packets_in > 0, "{service}: the client's packets passed the datapath");
        assert!(
            bytes_in > 0 && bytes_in < DOWNLOAD / 20,
            "{service}: {bytes_in} bytes in for a {DOWNLOAD}-byte download"
        );
        // The kernel's own count agrees: the download came by the bypass.
        assert!(by_bypass >= DOWNLOAD, "{service}: only {by_bypass} bytes came by the bypass");
        assert!(by_gw < DOWNLOAD / 100, "{service}: {by_gw} bytes came by the gateway");
    }

    // The NAT service beside them: 1,000 connections, exact per backend
    // (what each accepted on its own address, where NAT sends them), the
    // replies back through the datapath.
    let r =
        lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "1000", "--sources-range", sources4]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(1000), Some(0)), "{}", r["errors"]);
    let v4 = lab.backend_ips(false);
    let web = counts(&lbd, "web", &v4);
    let ours: Vec<u64> = web.iter().map(|c| c.new_flows).collect();
    let theirs: Vec<u64> = lab.backend_counts().unwrap().iter().zip(&v4).map(|(c, a)| c.at(*a).connections).collect();
    println!("web (NAT): 1,000 connections, new flows {ours:?}, backends accepted {theirs:?}");
    assert_eq!(ours, theirs, "web: lbd's per-backend counts are the backends' own");
    assert!(web.iter().all(|c| c.packets_out > 0), "web: NAT replies pass the datapath: {web:?}");
    for iface in lab.gw_interfaces() {
        assert_eq!(xdp_mode_in_use(&lab, &iface).unwrap().as_deref(), Some("native"), "{iface}");
    }
    // Native mode sees no GSO packet: no tc program beside it.
    let log = lbd.log_text();
    assert!(!log.contains("tc ingress program attached"), "a tc program in native mode:\n{log}");
    let status = lbd.status().unwrap();
    println!("counters: {}", status["counters"]);
    assert_eq!(status["counters"]["dsr_off_link"], 0);
    // The client's packets, DSR and NAT, left by XDP redirect.
    let (redirected, kernel, forwarded) = path_counts(&status);
    assert_eq!(redirected + kernel, forwarded, "every forwarded packet took one path: {}", status["counters"]);
    assert!(kernel * 20 < redirected, "XDP redirect carried too little: {}", status["counters"]);
}

/// Bulk uploads to DSR services through a generic-mode gateway: the lab's
/// default offloads (`Topology::Default`, where `auto` picks generic mode)
/// hand the gateway GSO packets, longer than any MTU, which an XDP
/// redirect drops and the kernel's forwarding cannot send (they are
/// addressed to the VIP). The XDP program hands them to lbd's tc program,
/// which redirects them as they are. A 20 MB upload (and download) per
/// family completes, none is answered as too big, and the handed-on
/// packets are counted in `kernel_egress`. The tc links are pinned: they
/// outlive a killed lbd, whose pinned XDP program goes on balancing, and
/// uploads still complete then; a restart or the next start replaces
/// them, and a clean stop detaches them.
#[test]
fn dsr_uploads_through_a_generic_mode_gateway_complete() {
    const BULK: &str = "20971520";
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-dsrgso";
    let lab = Lab::up(LabSpec {
        prefix: prefix.into(),
        backends: 3,
        client_sources: 4,
        dsr: true,
        topology: Topology::Default,
        ..LabSpec::default()
    })
    .expect("lab up");
    let sock = socket_for(prefix);
    let config = write_config_for(&config_dir(prefix), "lbd", &sock, &lab.gw_interfaces(), &services(&lab)).unwrap();
    let mut lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
    for iface in lab.gw_interfaces() {
        assert_eq!(xdp_mode_in_use(&lab, &iface).unwrap().as_deref(), Some("generic"), "{iface}");
    }
    let log = lbd.log_text();
    assert_eq!(
        log.matches("tc ingress program attached").count(),
        lab.gw_interfaces().len(),
        "the tc program on every interface:\n{log}"
    );
    assert_eq!(tc_links(), lab.gw_interfaces().len(), "the kernel's view: a TCX link to lb_tc per interface");
    // lbd's view, for the operator: pinned on every interface.
    let status = lbd.status().unwrap();
    for a in status["interfaces"].as_array().expect("interfaces") {
        assert_eq!(a["tc"], "pinned", "{a}");
    }
    let text = lbd.lbctl(&["status"]).unwrap();
    assert_eq!(
        text.matches("tc ingress link for DSR services' GSO packets: pinned").count(),
        lab.gw_interfaces().len(),
        "{text}"
    );
    let counter = |name: &str| lbd.status().unwrap()["counters"][name].as_u64().expect(name);
    for (service, vip, v6) in [("dsr4", IpAddr::from(DSR_VIP), false), ("dsr6", IpAddr::from(DSR_VIP6), true)] {
        let target = SocketAddr::new(vip, PORT).to_string();
        let addrs = lab.backend_ips(v6);
        let (too_big, kernel) = (counter("too_big"), counter("kernel_egress"));
        let before: u64 = counts(&lbd, service, &addrs).iter().map(|c| c.bytes_in).sum();
        for way in ["upload", "download"] {
            let r = lab.client(&[way, "--target", &target, "--bytes", BULK, "--timeout-ms", "60000"]).unwrap();
            println!("{service}: {way} {r}");
            assert_eq!(r["complete"].as_bool(), Some(true), "{service}: {way}: {r}");
        }
        let after: u64 = counts(&lbd, service, &addrs).iter().map(|c| c.bytes_in).sum();
        let handed = counter("kernel_egress") - kernel;
        println!("{service}: {} bytes in, {handed} packets by the tc program", after - before);
        assert_eq!(counter("too_big"), too_big, "{service}: bulk packets answered as too big");
        assert!(handed > 0, "{service}: no GSO packet went by the tc program");
        assert!(
            after - before >= 20_971_520,
            "{service}: the upload did not pass the datapath ({} bytes)",
            after - before
        );
    }
    // A graceful restart attaches its own links and detaches the pinned
    // ones it replaces: one per interface.
    lbd.restart().expect("restart");
    assert_eq!(tc_links(), lab.gw_interfaces().len(), "after a restart");
    let no_tc_warning = |log: String| {
        assert!(log.contains("tc ingress program attached"), "no attach in the log:\n{log}");
        assert!(!log.lines().any(|l| l.contains("WARN") && l.contains("tc ingress")), "a tc link warning:\n{log}");
    };
    no_tc_warning(lbd.log_text());
    // While lbd is down, its pinned XDP program goes on handing GSO
    // packets on, and the pinned tc links go on taking them: uploads
    // still complete (without the tc links they stall).
    lbd.kill().unwrap();
    assert_eq!(tc_links(), lab.gw_interfaces().len(), "the tc links outlive a killed lbd, pinned");
    for vip in [IpAddr::from(DSR_VIP), IpAddr::from(DSR_VIP6)] {
        let target = SocketAddr::new(vip, PORT).to_string();
        let r = lab.client(&["upload", "--target", &target, "--bytes", BULK, "--timeout-ms", "20000"]).unwrap();
        println!("{vip} with lbd down: upload {r}");
        assert_eq!(r["complete"].as_bool(), Some(true), "{vip}: upload with lbd down: {r}");
    }
    // The next start takes them over, and a clean stop detaches them.
    let mut lbd = Lbd::start(&lab, &config, &sock).expect("lbd start after the kill");
    assert_eq!(tc_links(), lab.gw_interfaces().len(), "after a start over the pinned links");
    assert!(lbd.stop().unwrap().success());
    assert_eq!(tc_links(), 0, "TCX links left behind by lbd");
    no_tc_warning(lbd.log_text());
}

/// TCX links (tc programs attached by BPF link) to a program named
/// `lb_tc`. Machine-wide: BPF ids are global, and the bpftool the lab
/// installs (7.1) lists no TCX link by device; lab tests run one at a
/// time, so every such link is this test's lbd's.
fn tc_links() -> usize {
    let json = |args: &[&str]| -> serde_json::Value {
        let out = std::process::Command::new("bpftool").arg("-j").args(args).output().expect("bpftool");
        assert!(out.status.success(), "bpftool {args:?}: {out:?}");
        serde_json::from_slice(&out.stdout).expect("bpftool JSON")
    };
    // BPF_LINK_TYPE_TCX is 11; a newer bpftool names it.
    let tcx = |l: &serde_json::Value| l["type"] == 11 || l["type"] == "tcx";
    json(&["link", "show"])
        .as_array()
        .expect("a list of links")
        .iter()
        .filter(|l| tcx(l))
        .filter(|l| {
            let id = l["prog_id"].as_u64().expect("prog_id").to_string();
            json(&["prog", "show", "id", &id])["name"] == "lb_tc"
        })
        .count()
}

//! End to end through the namespace lab: real TCP and UDP from the client
//! namespace through lbd's XDP program on the gateway to the backends,
//! checked against what the backends themselves counted. Needs root.
//! Tests run one at a time (a lock), each with its own lab.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::process::Command;

use lb_tests::{
    harness::{Running, config_dir, serial, socket_for},
    lab::{Lab, LabSpec},
    lbd::{Lbd, path_counts, wait_for, write_config, xdp_mode_in_use, xdp_program_in_use},
};

const WEB: &str = "  - name: web
    vip: 10.10.0.100
    port: 80
    protocol: tcp
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 1 }
      - { address: 10.20.0.13, port: 8080, weight: 1 }
";

const DNS: &str = "  - name: dns
    vip: 10.10.0.100
    port: 53
    protocol: udp
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 1 }
      - { address: 10.20.0.13, port: 8080, weight: 1 }
";

fn lab(prefix: &str) -> Lab {
    lb_tests::require_root().expect("end-to-end tests need root");
    Lab::up(LabSpec { prefix: prefix.into(), ..LabSpec::default() }).expect("lab up")
}

fn setup(prefix: &str, services: &str) -> Running {
    Running::start(prefix, 3, services)
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

fn xdp_attached(lab: &Lab, iface: &str) -> bool {
    xdp_mode_in_use(lab, iface).unwrap().is_some()
}

#[test]
fn a_thousand_new_connections_are_balanced_and_counted_exactly() {
    // Two services on one VIP, as the demo config has.
    let s = setup("lbt-e2e-conns", &format!("{WEB}{DNS}"));
    // The tuned lab (GRO on the veth peers): auto picks native on both,
    // and the kernel says so.
    for iface in ["eth0", "eth1"] {
        assert_eq!(xdp_mode_in_use(&s.lab, iface).unwrap().as_deref(), Some("native"), "{iface}");
    }
    let r = s.lab.conns("10.10.0.100:80", 1000, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!(u(&r, "failed"), 0, "failed requests: {r}");
    assert_eq!(u(&r, "ok"), 1000);
    let status = s.lbd.status().unwrap();
    let counts = s.lab.backend_counts().unwrap();
    for (i, addr) in s.lab.backend_addrs().iter().enumerate() {
        let ours = Lbd::new_flows(&status, "web", &addr.to_string()).unwrap();
        assert!(counts[i].connections > 0, "backend {addr} served nothing: {counts:?}");
        assert_eq!(
            ours, counts[i].connections,
            "lbd counted {ours} new flows for {addr}, the backend accepted {}",
            counts[i].connections
        );
        // The responses named the backend that counted them.
        assert_eq!(r["per_backend"][&counts[i].name].as_u64().unwrap(), counts[i].connections);
    }
    assert_eq!(counts.iter().map(|c| c.connections).sum::<u64>(), 1000);
    // Every packet went through XDP: none fell back to the kernel after warm-up
    // beyond neighbour resolution, and nothing was dropped.
    for reason in ["malformed", "no_backend", "flow_table", "fragment", "kernel_egress", "ttl_expired", "csum_partial"]
    {
        assert_eq!(status["counters"][reason], 0, "{reason}: {status}");
    }
    // Neighbour resolution: at most the first packet towards each of the
    // 250 client addresses and 3 backends (and a retransmission or two)
    // takes the kernel path.
    let (redirected, fallback, forwarded) = path_counts(&status);
    assert!(fallback <= 260, "{fallback} packets fell back to the kernel: {status}");
    assert_eq!(redirected + fallback, forwarded, "every forwarded packet took one counted path: {status}");
    // Once the neighbours are known, XDP redirect carries (nearly) everything.
    let again = ["conns", "--target", "10.10.0.100:80", "--count", "1000", "--sources-range", "10.10.1.1-10.10.1.250"];
    assert_eq!(u(&s.lab.client(&again).unwrap(), "failed"), 0);
    let after = s.lbd.status().unwrap();
    let (r2, f2, t2) = path_counts(&after);
    let share = (r2 - redirected) as f64 / (t2 - forwarded) as f64;
    println!(
        "tuned lab: {:.2}% of {} packets by XDP redirect after warm-up ({:.2}% before it)",
        share * 100.0,
        t2 - forwarded,
        100.0 * redirected as f64 / forwarded as f64
    );
    assert!(share >= 0.99, "only {:.2}% by XDP redirect after warm-up: {after}", share * 100.0);
    assert_eq!(r2 + f2, t2);
    // The second service answers too.
    let r = s.lab.client(&["udp", "--target", "10.10.0.100:53", "--count", "20", "--per-socket", "3"]).unwrap();
    assert_eq!((u(&r, "ok"), u(&r, "failed"), u(&r, "flows_switched")), (60, 0, 0), "{r}");
    // The text view names every backend with its weight.
    let text = s.lbd.lbctl(&["status"]).unwrap();
    for addr in s.lab.backend_addrs() {
        assert!(text.contains(&format!("{addr}:8080")), "{text}");
    }
}

#[test]
fn long_lived_connections_keep_their_backend_for_every_round_trip() {
    let s = setup("lbt-e2e-affinity", WEB);
    let r = s
        .lab
        .client(&[
            "longlived",
            "--target",
            "10.10.0.100:80",
            "--connections",
            "50",
            "--rounds",
            "100",
            "--sources-range",
            "10.10.1.1-10.10.1.50",
        ])
        .unwrap();
    assert_eq!(u(&r, "failed"), 0, "{r}");
    assert_eq!(u(&r, "ok_rounds"), 5000, "{r}");
    assert_eq!(u(&r, "switched"), 0, "a connection saw more than one backend: {r}");
    let per: u64 = r["per_backend"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(per, 50);
    let status = s.lbd.status().unwrap();
    let flows: u64 =
        s.lab.backend_addrs().iter().map(|a| Lbd::new_flows(&status, "web", &a.to_string()).unwrap()).sum();
    assert_eq!(flows, 50, "one scheduled flow per connection");
}

#[test]
fn udp_datagrams_are_balanced_and_answered_from_the_vip() {
    let s = setup("lbt-e2e-udp", DNS);
    let r = s
        .lab
        .client(&["udp", "--target", "10.10.0.100:53", "--count", "300", "--sources-range", "10.10.1.1-10.10.1.100"])
        .unwrap();
    assert_eq!(u(&r, "failed"), 0, "{r}");
    assert_eq!(u(&r, "ok"), 300);
    assert_eq!(u(&r, "replies_from_other_addr"), 0, "replies must come from the VIP: {r}");
    let counts = s.lab.backend_counts().unwrap();
    let status = s.lbd.status().unwrap();
    // A later socket may get an earlier one's port: the same 5-tuple is
    // one flow to the balancer (and one peer to the backend), though two
    // datagrams. New flows count the distinct 5-tuples.
    let mut ours = 0;
    for (i, addr) in s.lab.backend_addrs().iter().enumerate() {
        assert!(counts[i].udp_datagrams > 0, "{counts:?}");
        let new_flows = Lbd::new_flows(&status, "dns", &addr.to_string()).unwrap();
        assert_eq!(new_flows, counts[i].udp_flows, "{addr}: lbd's new flows are the distinct peers it saw: {counts:?}");
        ours += new_flows;
    }
    assert_eq!(ours, r["distinct_flows"].as_u64().unwrap(), "one new flow per 5-tuple: {r}");
}

#[test]
fn invalid_configs_are_rejected_before_anything_is_attached() {
    let _g = serial();
    let lab = lab("lbt-e2e-badcfg");
    let dir = config_dir("lbt-e2e-badcfg");
    let sock = socket_for("lbt-e2e-badcfg");
    let good = write_config(&dir, "good", &sock, WEB).unwrap();
    let good_text = std::fs::read_to_string(&good).unwrap();
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "unknown-key",
            "weight: 1 }\n      - { address: 10.20.0.12",
            "wieght: 1 }\n      - { address: 10.20.0.12",
            "services[0].backends[0].wieght: unknown key",
        ),
        (
            "bad-address",
            "10.20.0.12",
            "10.20.0.312",
            "services[0].backends[1].address: \"10.20.0.312\" is not an IPv4 or IPv6 address",
        ),
        (
            "negative-weight",
            "10.20.0.13, port: 8080, weight: 1",
            "10.20.0.13, port: 8080, weight: -2",
            "services[0].backends[2].weight: -2 is negative",
        ),
        (
            "text-weight",
            "10.20.0.13, port: 8080, weight: 1",
            "10.20.0.13, port: 8080, weight: lots",
            "services[0].backends[2].weight: expected a whole number",
        ),
        ("missing-port", "    port: 80\n", "", "services[0].port: missing"),
        (
            "missing-interface",
            "[eth0, eth1]",
            "[eth0, eth9]",
            "interfaces[1]: no network interface named \"eth9\" exists",
        ),
    ];
    let mut texts: Vec<(String, String, String)> = cases
        .iter()
        .map(|(n, from, to, want)| (n.to_string(), good_text.replacen(from, to, 1), want.to_string()))
        .collect();
    // A second service on the same VIP, port and protocol.
    texts.push((
        "duplicate-vip".into(),
        format!("{good_text}{}", WEB.replace("name: web", "name: web2")),
        "services[1].vip: duplicate VIP 10.10.0.100:80/tcp".into(),
    ));
    for (name, text, want) in texts {
        assert_ne!(text, good_text, "case {name} did not change the config");
        let path = dir.join(format!("{name}.yaml"));
        std::fs::write(&path, &text).unwrap();
        let out = lab.cmd("gw", lab.spec.bin_dir.join("lbd")).arg("--config").arg(&path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: lbd accepted an invalid config");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{name}: expected one message, got:\n{stderr}");
        let expect = format!("lbd: invalid config: {}: {want}", path.display());
        assert!(lines[0].starts_with(&expect), "{name}: got {:?}, want a line starting {expect:?}", lines[0]);
        assert!(!xdp_attached(&lab, "eth0") && !xdp_attached(&lab, "eth1"), "{name}: XDP attached");
        assert!(!sock.exists(), "{name}: control socket created");
    }
}

/// The name of the loaded BPF program `id`; None once it is unloaded. By
/// id, not by counting programs of a name: another datapath loaded on the
/// same machine (another test, a user's) would be counted too.
fn bpf_program_name(id: u64) -> Option<String> {
    let out = Command::new("bpftool").args(["-j", "prog", "show", "id", &id.to_string()]).output().expect("bpftool");
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Some(v["name"].as_str().unwrap_or_default().to_owned())
}

/// Every path under `dir` (pins and their directories), sorted.
fn entries_under(dir: &std::path::Path) -> Vec<String> {
    fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                out.push(e.path().display().to_string());
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    walk(&e.path(), out);
                }
            }
        }
    }
    let mut v = Vec::new();
    walk(dir, &mut v);
    v.sort();
    v
}

fn bpffs_entries() -> Vec<String> {
    entries_under(std::path::Path::new("/sys/fs/bpf"))
}

#[test]
fn sigterm_detaches_everything_and_leaves_nothing_pinned() {
    let pinned_before = bpffs_entries();
    let mut s = setup("lbt-e2e-term", WEB);
    assert!(xdp_attached(&s.lab, "eth0") && xdp_attached(&s.lab, "eth1"));
    assert!(s.lab.pin_dir().join("maps/FLOW_SLOTS").exists(), "the running datapath is pinned");
    // One program, the balancer's, on both interfaces.
    let prog = xdp_program_in_use(&s.lab, "eth0");
    assert_eq!(xdp_program_in_use(&s.lab, "eth1"), prog, "one program on both interfaces");
    assert_eq!(bpf_program_name(prog).as_deref(), Some("lb_xdp"));
    // lbd runs in its own mount namespace (`ip netns exec` makes one):
    // hold it, to look at the pins from where lbd made them.
    let pid = s.lbd.pid().unwrap();
    let lbd_mnt = std::fs::File::open(format!("/proc/{pid}/ns/mnt")).unwrap();
    let in_lbd_ns = |path: &std::path::Path| {
        use std::os::fd::AsRawFd as _;
        let ns = format!("/proc/{}/fd/{}", std::process::id(), lbd_mnt.as_raw_fd());
        let out = Command::new("nsenter")
            .arg(format!("--mount={ns}"))
            .arg("--")
            .arg("test")
            .arg("-e")
            .arg(path)
            .output()
            .unwrap();
        match out.status.code() {
            Some(0) => true,
            Some(1) => false,
            _ => panic!("nsenter failed: {out:?}"),
        }
    };
    assert!(in_lbd_ns(&s.lab.pin_dir().join("maps/FLOW_SLOTS")), "lbd's own view shows the pins");
    let status = s.lbd.stop().unwrap();
    assert!(!in_lbd_ns(&s.lab.pin_dir()), "pins left in lbd's mount namespace");
    assert!(status.success(), "lbd exited with {status}; log:\n{}", s.lbd.log_text());
    assert!(!xdp_attached(&s.lab, "eth0"), "XDP still attached to eth0");
    assert!(!xdp_attached(&s.lab, "eth1"), "XDP still attached to eth1");
    // The program's last reference can be the unpinned link's, which the
    // kernel drops after an RCU grace period, from a work queue: a little
    // after lbd exits, not before.
    let unloaded = wait_for(5, || bpf_program_name(prog).is_none().then_some(()));
    assert!(unloaded.is_some(), "the program is still loaded 5 s after lbd exited");
    assert_eq!(bpffs_entries(), pinned_before, "something was left pinned in /sys/fs/bpf");
    assert!(!s.lab.pin_dir().exists(), "something was left pinned in {}", s.lab.pin_dir().display());
    assert!(!s.lbd.socket.exists(), "control socket left behind");
}

#[test]
fn a_global_counter_map_pinned_by_an_older_version_is_replaced() {
    let _g = serial();
    let prefix = "lbt-e2e-oldpin";
    let lab = lab(prefix);
    // What the previous version pinned: 6 global counters (this one has more).
    let maps = lab.pin_dir().join("maps");
    std::fs::create_dir_all(&maps).unwrap();
    let out = Command::new("bpftool")
        .args(["map", "create"])
        .arg(maps.join("COUNTERS"))
        .args(["type", "percpu_array", "key", "4", "value", "8", "entries", "6", "name", "COUNTERS"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let sock = socket_for(prefix);
    let config = write_config(&config_dir(prefix), "lbd", &sock, WEB).unwrap();
    let lbd = Lbd::start(&lab, &config, &sock).unwrap();
    assert!(lbd.log_text().contains("predates this version"), "{}", lbd.log_text());
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "50"]).unwrap();
    assert_eq!(u(&r, "failed"), 0, "{r}");
    let status = lbd.status().unwrap();
    assert!(u(&status["counters"], "xdp_redirect") > 0, "{status}");
}

/// A memory cgroup of `limit` bytes for the test's lbd (cgroup v1's
/// memory hierarchy or cgroup v2's, whichever the machine has), removed
/// on drop. BPF maps are charged to the cgroup of the process that
/// creates them.
struct MemCgroup(std::path::PathBuf);

impl MemCgroup {
    fn new(name: &str, limit: u64) -> Self {
        let v1 = std::path::Path::new("/sys/fs/cgroup/memory");
        let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers");
        let (dir, file) = if v1.join("memory.limit_in_bytes").exists() {
            (v1.join(name), "memory.limit_in_bytes")
        } else if std::fs::read_to_string(v2).is_ok_and(|c| c.split_whitespace().any(|c| c == "memory")) {
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory");
            (std::path::PathBuf::from("/sys/fs/cgroup").join(name), "memory.max")
        } else {
            panic!("no memory cgroup controller (v1 or v2) on this machine");
        };
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let me = Self(dir);
        std::fs::write(me.0.join(file), limit.to_string()).unwrap();
        me
    }

    /// `cmd` run as a member of the cgroup (the shell joins it, then
    /// execs the command).
    fn command(&self, cmd: &Command) -> Command {
        let procs = self.0.join("cgroup.procs");
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!("echo $$ > {} && exec \"$@\"", procs.display())).arg("sh");
        c.arg(cmd.get_program()).args(cmd.get_args());
        c
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir(&self.0) {
            eprintln!("removing {}: {e}", self.0.display());
        }
    }
}

/// Flow tables that do not fit lbd's memory cgroup (120 MB; the default
/// `conntrack_max` takes about 447 MB): the start fails with one line
/// naming the cgroup, its limit, what takes the memory and what to do,
/// before any map is created, and leaves nothing pinned or attached.
/// (Letting the kernel refuse instead is not reliable: when the charge
/// that crosses the limit is one the kernel does not let fail, such as a
/// map's dentry, the cgroup's OOM killer kills lbd, with no word of why.)
#[test]
fn flow_tables_without_the_memory_fail_the_start_clearly_and_leave_nothing() {
    let _serial = serial();
    let prefix = "lbt-e2e-mem";
    let lab = lab(prefix);
    let sock = socket_for(prefix);
    let config = lb_tests::lbd::write_config_with(
        &config_dir(prefix),
        "lbd",
        &sock,
        &["eth0".into(), "eth1".into()],
        "conntrack_max: 1048576\n",
        WEB,
    )
    .unwrap();
    // Two ways into the gateway's namespace: `ip netns exec` mounts a
    // fresh /sys, where no cgroup hierarchy is mounted (lbd mounts one of
    // its own, detached); nsenter keeps this mount namespace's.
    let nsenter = |program: &std::path::Path| {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", lab.ns("gw"))).arg(program);
        c
    };
    for (how, mut lbd) in [
        ("ip netns exec", lab.cmd("gw", lab.spec.bin_dir.join("lbd"))),
        ("nsenter", nsenter(&lab.spec.bin_dir.join("lbd"))),
    ] {
        lbd.arg("--config").arg(&config);
        let cgroup = MemCgroup::new(prefix, 120 << 20);
        let out = cgroup.command(&lbd).output().unwrap();
        drop(cgroup);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{how}: lbd started in 120 MB with 1M-entry flow tables:\n{stderr}");
        let line = stderr
            .lines()
            .rev()
            .find(|l| l.starts_with("lbd: "))
            .unwrap_or_else(|| panic!("{how}: no error line:\n{stderr}"));
        // 120 MiB is 125 MB, of which lbd itself has used some by then
        // (about 15 MB, a debug build).
        for want in [
            "The flow tables take about 447 MB (conntrack_max: 1048576, conntrack_max_ipv6: 1048576)",
            "more than lbd's memory cgroup /lbt-e2e-mem leaves: about ",
            " MB free of its 125 MB limit (memory.",
            "Lower them, or raise the cgroup's limit; nothing was created",
        ] {
            assert!(line.contains(want), "{how}: {want:?} not in {line:?}");
        }
        let free: u64 = line
            .split_once("leaves: about ")
            .and_then(|(_, rest)| rest.split_once(" MB free"))
            .and_then(|(n, _)| n.parse().ok())
            .unwrap_or_else(|| panic!("{how}: no free figure in {line:?}"));
        assert!((60..=125).contains(&free), "{how}: {free} MB free of 125 in {line:?}");
    }
    assert!(!lab.pin_dir().exists(), "the failed start left pins: {:?}", entries_under(&lab.pin_dir()));
    assert!(!xdp_attached(&lab, "eth0") && !xdp_attached(&lab, "eth1"), "XDP attached");
    assert!(!sock.exists(), "control socket created");
}

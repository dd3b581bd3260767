//! The datapath outlives lbd: SIGKILL, a graceful restart (SIGUSR2) and a
//! binary upgrade, all while clients open new connections continuously;
//! zero failed requests, counters continue, the flow table is kept.
//! Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use lb_tests::{
    harness::{Running, config_dir, serial, socket_for},
    lab::{Lab, LabSpec, Topology},
    lbd::{
        Lbd, assert_xdp_mode, kill_once_pinned, pinned_layout, wait_for, write_config, write_config_with,
        xdp_mode_in_use, xdp_program_in_use,
    },
};

const WEB: &str = "  - name: web
    vip: 10.10.0.100
    port: 80
    scheduler: maglev
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 1 }
      - { address: 10.20.0.13, port: 8080, weight: 1 }
";

#[test]
fn kill_restart_and_upgrade_under_load_lose_nothing() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-restart";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let config = write_config(&config_dir(prefix), "lbd", &sock, WEB).unwrap();
    // lbd runs from its own copy, so the test can upgrade it in place.
    let bin = PathBuf::from(format!("/tmp/{prefix}-bin"));
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("lbd");
    std::fs::copy(lab.spec.bin_dir.join("lbd"), &exe).unwrap();

    let mut lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
    lab.reset_backend_counts().unwrap();
    let first_program = lbd.program_id().unwrap();

    std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            lab.client(&[
                "conns",
                "--target",
                "10.10.0.100:80",
                "--concurrency",
                "10",
                "--duration-ms",
                "9000",
                "--sources-range",
                "10.10.1.1-10.10.1.250",
            ])
            .unwrap()
        });
        let long = scope.spawn(|| lab.longlived("10.10.0.100:80", 20, 160, 50, &[]).unwrap());
        std::thread::sleep(Duration::from_millis(1000));

        // 1. Crash: the pinned datapath keeps forwarding without lbd.
        let before_kill = lbd.total_new_flows();
        lbd.kill().unwrap();
        let c0 = lab.connections_served().unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        let c1 = lab.connections_served().unwrap();
        assert!(c1 > c0, "no connections were balanced while lbd was down ({c0} -> {c1})");
        lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
        let after_kill = lbd.total_new_flows();
        assert!(after_kill >= before_kill + (c1 - c0), "counters restarted: {before_kill} -> {after_kill}");
        let second_program = lbd.program_id().unwrap();
        assert_ne!(second_program, first_program, "the restarted lbd did not swap in its program");

        // 2. Graceful restart.
        std::thread::sleep(Duration::from_millis(1000));
        let before = lbd.total_new_flows();
        let third_program = lbd.restart().unwrap();
        assert!(lbd.total_new_flows() >= before);

        // 3. Upgrade: a new binary replaces the old one on disk, then the
        // graceful restart runs it and it replaces the XDP program. The
        // address filter as older builds pinned it (under the first bit
        // function, then as 1,024 one-word entries) stands for an older
        // version's maps: once the new program is attached nothing reads
        // them, and they are unpinned.
        std::thread::sleep(Duration::from_millis(1000));
        let names = ["ADDR_FILTER", "ADDR_BITS"];
        let stale: Vec<_> = names.iter().map(|n| lab.pin_dir().join("maps").join(n)).collect();
        for (path, name) in stale.iter().zip(names) {
            let out = std::process::Command::new("bpftool")
                .args(["map", "create"])
                .arg(path)
                .args(["type", "array", "key", "4", "value", "8", "entries", "1024", "name", name])
                .output()
                .unwrap();
            assert!(out.status.success(), "bpftool map create {name}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let staged = bin.join("lbd.new");
        std::fs::copy(lab.spec.bin_dir.join("lbd"), &staged).unwrap();
        std::fs::rename(&staged, &exe).unwrap();
        let fourth_program = lbd.restart().unwrap();
        assert_ne!(fourth_program, third_program);
        for path in &stale {
            assert!(!path.exists(), "an older version's map {} is still pinned after the upgrade", path.display());
        }
        assert!(lab.pin_dir().join("maps").join("ADDR_BITMAP").exists(), "the address filter is not pinned");

        let r = load.join().unwrap();
        println!(
            "new connections through kill, restart and upgrade: ok {} failed {} per backend {}",
            r["ok"], r["failed"], r["per_backend"]
        );
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["ok"].as_u64().unwrap() > 1000, "{r}");
        let r = long.join().unwrap();
        println!("long-lived connections through kill, restart and upgrade: {r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["switched"], 0, "{r}");
    });
    // Counters continued across all three: they equal what the backends saw.
    let counts = lab.connections_served().unwrap();
    let flows = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == counts));
    assert_eq!(flows, Some(counts), "lbd counted {} new flows, backends {counts}", lbd.total_new_flows());
    let status = lbd.stop().unwrap();
    assert!(status.success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(&bin);
}

/// An lbd that adopts links attached in generic mode (a lab of default
/// veths, whose peers take no native redirects) says they are generic, as
/// the kernel does, and forwards by XDP redirect on every path, after a
/// kill and after a graceful restart. (The mode of an adopted link was once
/// read from a file beside its pin, which bpffs never let lbd write: every
/// adopted link was taken as native, its veth egresses as unable to take a
/// native redirect, and all traffic went through the kernel.)
#[test]
fn a_restarted_lbd_keeps_generic_links_generic_and_their_xdp_paths() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-regen";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), topology: Topology::Default, ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let config = write_config(&config_dir(prefix), "lbd", &sock, WEB).unwrap();
    let mut lbd = Lbd::start(&lab, &config, &sock).unwrap();
    let generic = |lbd: &Lbd, when: &str| {
        let status = lbd.status().unwrap();
        for iface in lab.gw_interfaces() {
            assert_xdp_mode(&lab, lbd, &iface, "generic", when);
        }
        let paths = status["paths"].as_array().unwrap();
        assert!(!paths.is_empty() && paths.iter().all(|p| p["path"] == "xdp_redirect"), "{when}: {}", status["paths"]);
        let r = lab.conns("10.10.0.100:80", 200, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(200), Some(0)), "{when}: {r}");
        let c = &lbd.status().unwrap()["counters"];
        assert_eq!(c["kernel_egress"], 0, "{when}: packets sent through the kernel: {c}");
        println!("{when}: generic on {:?}, {c}", lab.gw_interfaces());
    };
    generic(&lbd, "first start");
    let first = lbd.program_id().unwrap();
    lbd.kill().unwrap();
    lbd = Lbd::start(&lab, &config, &sock).unwrap();
    assert_ne!(lbd.program_id().unwrap(), first, "the restarted lbd did not swap in its program");
    generic(&lbd, "after a kill");
    lbd.restart().unwrap();
    generic(&lbd, "after a graceful restart");
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

/// `xdp_mode` changed takes effect when lbd starts again, as a reload that
/// changes it says: a graceful restart with `native` in a lab of default
/// veths replaces the generic links by native ones (the kernel and the
/// status say native, every path is the kernel's, and packets take it: no
/// native redirect reaches these veths), and a kill and start with `auto`
/// again puts generic links back (every path, and every packet, by XDP
/// redirect). New connections run throughout; those that meet a switch's
/// moment without XDP can fail, and are counted and printed. Counters go on.
#[test]
fn a_restart_applies_a_changed_xdp_mode() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-xmode";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), topology: Topology::Default, ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let dir = config_dir(prefix);
    let ifaces = lab.gw_interfaces();
    let with_mode = |mode: &str| {
        write_config_with(&dir, "lbd", &sock, &ifaces, &format!("conntrack_max: 262144\nxdp_mode: {mode}\n"), WEB)
            .unwrap()
    };
    let config = with_mode("auto");
    let mut lbd = Lbd::start(&lab, &config, &sock).unwrap();
    // The mode on every interface (kernel and status) and every path are
    // `mode` and `path`, and every packet forwarded while 300 new
    // connections pass takes that path.
    let check = |lbd: &Lbd, mode: &str, path: &str, when: &str| {
        let status = lbd.status().unwrap();
        for iface in &ifaces {
            assert_xdp_mode(&lab, lbd, iface, mode, when);
        }
        let paths = status["paths"].as_array().unwrap();
        assert!(!paths.is_empty() && paths.iter().all(|p| p["path"] == path), "{when}: {}", status["paths"]);
        // (Packets to a neighbour not yet resolved take the kernel path in
        // either mode, as fib_fallback: not counted here.)
        let taken = || {
            let c = &lbd.status().unwrap()["counters"];
            (c["xdp_redirect"].as_u64().unwrap(), c["kernel_egress"].as_u64().unwrap())
        };
        // New connections of their own (the load's may still wait on a
        // retransmit after a switch).
        let before = taken();
        let r = lab.conns("10.10.0.100:80", 300, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{when}: {r}");
        let after = taken();
        let (redirected, kernel) = (after.0 - before.0, after.1 - before.1);
        println!("{when}: 300 connections, {redirected} packets by XDP redirect, {kernel} by the kernel");
        if path == "kernel" {
            assert!(kernel > 0 && redirected == 0, "{when}: {redirected} redirected, {kernel} by the kernel");
        } else {
            assert!(redirected > 0 && kernel == 0, "{when}: {redirected} redirected, {kernel} by the kernel");
        }
    };
    let stop = AtomicBool::new(false);
    let (ok, failed) = std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            let (mut ok, mut failed) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                let r = lab.conns("10.10.0.100:80", 200, 4, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
                ok += r["ok"].as_u64().unwrap();
                failed += r["failed"].as_u64().unwrap();
            }
            (ok, failed)
        });
        // The load stops when this closure ends, panicking or not.
        let stop_load = StopOnDrop(&stop);
        check(&lbd, "generic", "xdp_redirect", "first start");
        // A reload cannot change it, and says a restart does.
        with_mode("native");
        let refused = lbd.lbctl(&["reload"]).expect_err("a reload changed xdp_mode").to_string();
        assert!(refused.contains("xdp_mode") && refused.contains("restart lbd"), "{refused}");
        lbd.restart().unwrap();
        check(&lbd, "native", "kernel", "after a graceful restart with xdp_mode: native");
        with_mode("auto");
        lbd.kill().unwrap();
        lbd = Lbd::start(&lab, &config, &sock).unwrap();
        check(&lbd, "generic", "xdp_redirect", "after a kill and start with xdp_mode: auto");
        drop(stop_load);
        load.join().unwrap()
    });
    println!("new connections through two mode changes: {ok} passed, {failed} failed");
    assert!(ok > 1000, "{ok} passed, {failed} failed");
    // Each switch logged its moment without XDP, once per interface (the
    // log holds every start's lines).
    let log = lbd.log_text();
    for to in ["native", "generic"] {
        let switched =
            log.lines().filter(|l| l.contains("XDP mode changed") && l.contains(&format!("to=\"{to}\""))).count();
        assert_eq!(switched, ifaces.len(), "switches to {to}: {log}");
    }
    // Counters went on through both (a connection that met a switch may
    // count at one end only): at least every connection that passed, and
    // from here on in step with the backends.
    let (flows, served) = (lbd.total_new_flows(), lab.connections_served().unwrap());
    assert!(flows >= ok, "lbd counted {flows} new flows, {ok} connections passed");
    let r = lab.conns("10.10.0.100:80", 300, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{r}");
    let counted = wait_for(5, || Some(lbd.total_new_flows() - flows).filter(|&n| n == 300));
    assert_eq!(counted, Some(300), "new flows counted for 300 connections: {}", lbd.total_new_flows() - flows);
    assert_eq!(lab.connections_served().unwrap() - served, 300);
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

/// A start on a datapath pinned elsewhere (the configured `pin_path`
/// changed while the datapath ran) fails before it attaches anything,
/// naming the interface, the program on it and the pin path it looked in;
/// the running datapath forwards on, and the old configuration adopts it.
#[test]
fn a_start_whose_pin_path_moved_names_the_program_in_the_way() {
    let mut s = Running::start("lbt-pinmove", 3, WEB);
    let (lab, good) = (&s.lab, s.config.clone());
    let running = ["eth0", "eth1"].map(|i| xdp_program_in_use(lab, i));
    s.lbd.kill().unwrap();
    // Another socket name gives another pin_path (write_config's rule).
    let moved_sock = socket_for("lbt-pinmove2");
    let moved = write_config(good.parent().unwrap(), "moved", &moved_sock, WEB).unwrap();
    let moved_pin = std::path::Path::new(lb_tests::lab::BPFFS).join("lbt-pinmove2");
    let err = Lbd::start(lab, &moved, &moved_sock).err().expect("lbd started beside a datapath pinned elsewhere");
    let log = format!("{err:#}");
    let text = log.lines().rev().find(|l| l.starts_with("lbd: ")).unwrap_or_else(|| panic!("no error line: {log}"));
    let names = format!("eth0 already runs an XDP program (id {}, \"lb_xdp\")", running[0]);
    assert!(text.contains(&names), "the error does not name the interface and program: {text}");
    assert!(text.contains(&moved_pin.display().to_string()) && text.contains("pin_path"), "{text}");
    assert_eq!(["eth0", "eth1"].map(|i| xdp_program_in_use(lab, i)), running, "the failed start changed XDP");
    assert!(!moved_pin.exists(), "the failed start left pins at {}", moved_pin.display());
    let r = lab.conns("10.10.0.100:80", 300, 10, &[]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{r}");
    let mut lbd = Lbd::start(lab, &good, &s.lbd.socket).unwrap();
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

/// A graceful restart (SIGUSR2) first has the binary it would run check
/// the configuration it would read (`--check`). Into a file that no longer
/// passes, or a binary that cannot run, it is refused: the running lbd
/// stays (same process, same program, answering), logs why (the file's
/// problem, or the binary's), and balances on. Once both are right, the
/// restart goes ahead.
#[test]
fn a_graceful_restart_into_a_broken_config_or_binary_is_refused() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-usr2check";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let dir = config_dir(prefix);
    let config = write_config(&dir, "lbd", &sock, WEB).unwrap();
    let bin = PathBuf::from(format!("/tmp/{prefix}-bin"));
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("lbd");
    std::fs::copy(lab.spec.bin_dir.join("lbd"), &exe).unwrap();
    let mut lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
    let program = lbd.program_id().unwrap();
    let pid = lbd.pid().unwrap();
    // SIGUSR2, then the refusal in the log (its `n`th), and lbd as it was.
    let refused = |lbd: &Lbd, n: usize, why: &str| {
        lbd.signal(libc::SIGUSR2).unwrap();
        let log = wait_for(20, || {
            let log = lbd.log_text();
            (log.matches("SIGUSR2: restart refused").count() >= n).then_some(log)
        })
        .unwrap_or_else(|| panic!("no refusal logged; log:\n{}", lbd.log_text()));
        assert!(log.contains(why), "the refusal does not say {why:?}:\n{log}");
        let at = log.rfind("SIGUSR2: restart refused").unwrap();
        println!("{}", log[at..].lines().take(3).collect::<Vec<_>>().join("\n"));
        assert_eq!(lbd.pid(), Some(pid));
        assert_eq!(lbd.program_id(), Some(program), "lbd restarted; log:\n{log}");
        let r = lab.conns("10.10.0.100:80", 200, 10, &[]).unwrap();
        assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(200), Some(0)), "{r}");
    };

    // 1. A configuration that no longer passes.
    write_config(&dir, "lbd", &sock, &WEB.replace("maglev", "fastest")).unwrap();
    refused(&lbd, 1, "scheduler");
    write_config(&dir, "lbd", &sock, WEB).unwrap();

    // 2. A binary that cannot run put in place of lbd's.
    let staged = bin.join("lbd.new");
    std::fs::write(&staged, b"not an executable\n").unwrap();
    std::fs::set_permissions(&staged, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&staged, &exe).unwrap();
    refused(&lbd, 2, &exe.display().to_string());

    // 3. Both right again: the restart goes ahead.
    std::fs::copy(lab.spec.bin_dir.join("lbd"), &staged).unwrap();
    std::fs::rename(&staged, &exe).unwrap();
    let next = lbd.restart().unwrap();
    assert_ne!(next, program);
    assert_eq!(lbd.pid(), Some(pid), "a graceful restart keeps the process");
    let r = lab.conns("10.10.0.100:80", 200, 10, &[]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(200), Some(0)), "{r}");
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(&bin);
}

/// Sets its flag when dropped (a load loop's stop, also on a panic).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A start whose changed `xdp_mode` one interface refuses (native on a
/// bridge) fails naming it, and puts back what ran: the interface whose
/// mode it had already switched gets the previous program in its previous
/// mode again, and the datapath balances as before.
#[test]
fn a_mode_change_that_cannot_attach_puts_back_what_ran() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-xmodef";
    let lab =
        Lab::up(LabSpec { prefix: prefix.into(), topology: Topology::BridgeBackend, ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let dir = config_dir(prefix);
    let ifaces = lab.gw_interfaces();
    assert_eq!(ifaces, ["eth0", "br0"]);
    let with_mode = |mode: &str| {
        write_config_with(&dir, "lbd", &sock, &ifaces, &format!("conntrack_max: 262144\nxdp_mode: {mode}\n"), WEB)
            .unwrap()
    };
    let config = with_mode("auto");
    let mut lbd = Lbd::start(&lab, &config, &sock).unwrap();
    let modes = || ifaces.iter().map(|i| xdp_mode_in_use(&lab, i).unwrap()).collect::<Vec<_>>();
    let programs = || ifaces.iter().map(|i| xdp_program_in_use(&lab, i)).collect::<Vec<_>>();
    assert_eq!(modes(), [Some("generic".to_owned()), Some("generic".to_owned())]);
    let running = programs();
    lbd.kill().unwrap();

    with_mode("native");
    let err = Lbd::start(&lab, &config, &sock).err().expect("lbd started with native XDP on a bridge");
    let log = format!("{err:#}");
    let text = log.lines().rev().find(|l| l.starts_with("lbd: ")).unwrap_or_else(|| panic!("no error line: {log}"));
    assert!(text.contains("br0") && text.contains("native"), "the error does not name the interface and mode: {text}");
    // eth0 was switched before br0 refused, and switched back.
    assert!(log.contains("XDP mode changed") && log.contains("interface=eth0"), "eth0 was not switched: {log}");
    assert!(log.contains("the program the interface ran before is back on it"), "{log}");
    assert_eq!(modes(), [Some("generic".to_owned()), Some("generic".to_owned())], "modes after the failed start");
    assert_eq!(programs(), running, "the failed start left other programs than the running one: {log}");
    for i in &ifaces {
        assert!(lab.pin_dir().join("links").join(i).exists(), "{i}'s link is not pinned after the failed start");
    }
    let r = lab.conns("10.10.0.100:80", 300, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{r}");

    // The old configuration adopts the datapath as it was.
    with_mode("auto");
    let mut lbd = Lbd::start(&lab, &config, &sock).unwrap();
    assert_eq!(modes(), [Some("generic".to_owned()), Some("generic".to_owned())]);
    // (The log holds every start's lines: the failed one switched eth0.)
    assert_eq!(lbd.log_text().matches("XDP mode changed").count(), 1, "{}", lbd.log_text());
    let r = lab.conns("10.10.0.100:80", 300, 10, &["--sources-range", "10.10.1.1-10.10.1.250"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{r}");
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

/// A restart whose configuration cannot be attached everywhere (here a
/// bridge in forced native mode, listed after the two interfaces the
/// running datapath is on) fails with an error naming the interface, and
/// leaves the datapath attached and forwarding on the interfaces it had:
/// the links it adopted before the failure are not rolled back, since
/// unpinning them would stop the balancer that was running.
#[test]
fn a_restart_that_cannot_attach_leaves_the_datapath_forwarding() {
    let mut s = Running::start("lbt-restartf", 3, WEB);
    let (lab, good, sock) = (&s.lab, s.config.clone(), s.lbd.socket.clone());
    let bridge = "lbtbr0";
    let bad = write_config_with(
        good.parent().unwrap(),
        "bad",
        &sock,
        &["eth0".into(), "eth1".into(), bridge.into()],
        "conntrack_max: 262144\nxdp_mode: native\n",
        WEB,
    )
    .unwrap();

    let modes: Vec<_> = ["eth0", "eth1"].iter().map(|i| xdp_mode_in_use(lab, i).unwrap()).collect();
    assert!(modes.iter().all(Option::is_some), "XDP not attached at start: {modes:?}");
    let programs = || ["eth0", "eth1"].map(|i| xdp_program_in_use(lab, i));
    let running = programs();
    let balanced = || {
        let r = lab
            .client(&["conns", "--target", "10.10.0.100:80", "--concurrency", "4", "--duration-ms", "1000"])
            .unwrap();
        assert_eq!(r["failed"], 0, "{r}");
        r["ok"].as_u64().unwrap()
    };
    assert!(balanced() > 0);
    s.lbd.kill().unwrap();
    // The bridge appears while no lbd runs: the running datapath's egress
    // table (NETDEVS) has never seen it, and must not after the failed start.
    lab.ip("gw", &["link", "add", bridge, "type", "bridge"]).unwrap();
    lab.ip("gw", &["link", "set", bridge, "up"]).unwrap();
    let netdevs = lab.pin_dir().join("maps").join("NETDEVS");
    let dump = || {
        let out =
            std::process::Command::new("bpftool").args(["-j", "map", "dump", "pinned"]).arg(&netdevs).output().unwrap();
        assert!(out.status.success(), "bpftool map dump: {}", String::from_utf8_lossy(&out.stderr));
        // By key: a hash map dumps in bucket order, which rewriting can change.
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut entries: Vec<String> =
            v.as_array().unwrap().iter().map(|e| format!("{} -> {}", e["key"], e["value"])).collect();
        entries.sort();
        entries
    };
    let egresses = dump();

    let err = Lbd::start(lab, &bad, &sock).err().expect("lbd started with a bridge in forced native mode");
    // The line lbd printed on its way out (its log holds the whole run).
    let log = format!("{err:#}");
    let text = log.lines().rev().find(|l| l.starts_with("lbd: ")).unwrap_or_else(|| panic!("no error line: {log}"));
    assert!(text.contains(bridge), "the error does not name the interface: {text}");
    assert!(text.contains("does not offer (xdp_mode: auto"), "the error does not say what to do: {text}");
    // Each cause once: the kernel's answer, and the call that got it.
    assert!(text.contains("Operation not supported"), "the error does not give the kernel's answer: {text}");
    assert_eq!(text.matches("bpf_link_create").count(), 1, "a cause said twice: {text}");
    let after: Vec<_> = ["eth0", "eth1"].iter().map(|i| xdp_mode_in_use(lab, i).unwrap()).collect();
    assert_eq!(after, modes, "the failed start changed or removed XDP on the running interfaces");
    assert_eq!(programs(), running, "the failed start replaced the running program");
    assert_eq!(xdp_mode_in_use(lab, bridge).unwrap(), None, "XDP left on {bridge}");
    assert_eq!(dump(), egresses, "the failed start left its egress flags in NETDEVS");
    assert!(!lab.pin_dir().join("links").join(bridge).exists(), "a link pinned for {bridge}");
    // Nothing else routes the VIP: an answered connection went through the
    // datapath.
    let before = lab.connections_served().unwrap();
    let ok = balanced();
    let now = lab.connections_served().unwrap();
    assert!(
        ok > 0 && now >= before + ok,
        "not balanced after the failed start: {ok} answered, backends {before} -> {now}"
    );

    // A start that fails while swapping its program into the pinned links
    // (eth1's pin is not a link: the link itself is held by a pin
    // elsewhere, so XDP stays on eth1): eth0, already swapped, gets the
    // running program back.
    let links = lab.pin_dir().join("links");
    let hold = lab.pin_dir().join("held-eth1");
    let bpftool = |args: &[&str]| {
        let out = std::process::Command::new("bpftool").args(args).output().unwrap();
        assert!(out.status.success(), "bpftool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let eth1_link = links.join("eth1").display().to_string();
    let info: serde_json::Value =
        serde_json::from_str(&bpftool(&["-j", "link", "show", "pinned", &eth1_link])).unwrap();
    let id = info["id"].as_u64().expect("link id").to_string();
    bpftool(&["link", "pin", "id", &id, &hold.display().to_string()]);
    std::fs::remove_file(links.join("eth1")).unwrap();
    bpftool(&[
        "map", "create", &eth1_link, "type", "array", "key", "4", "value", "4", "entries", "1", "name", "notalink",
    ]);
    let err = Lbd::start(lab, &good, &sock).err().expect("lbd started with eth1's pin not a link");
    let log = format!("{err:#}");
    assert!(log.contains("the program the link ran before is back in it"), "{log}");
    assert_eq!(programs(), running, "the failed swap left this build's program on eth0");
    std::fs::remove_file(links.join("eth1")).unwrap();
    bpftool(&["link", "pin", "id", &id, &eth1_link]);
    std::fs::remove_file(&hold).unwrap();
    let now = lab.connections_served().unwrap();
    let ok = balanced();
    assert_eq!(lab.connections_served().unwrap(), now + ok, "not balanced after the failed swap");
    let now = now + ok;

    // The good configuration adopts the datapath again; the counters went on.
    let mut lbd = Lbd::start(lab, &good, &sock).unwrap();
    let flows = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == now));
    assert_eq!(flows, Some(now), "lbd counted {} new flows, the backends saw {now}", lbd.total_new_flows());
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
}

#[test]
fn a_killed_first_start_and_a_resized_restart_go_by_the_maps_pinned() {
    let _serial = serial();
    lb_tests::require_root().expect("lab tests need root");
    let prefix = "lbt-restartk";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 3, ..LabSpec::default() }).expect("lab up");
    let sock = socket_for(prefix);
    let config = write_config(&config_dir(prefix), "lbd", &sock, WEB).unwrap();
    let maps = lab.pin_dir().join("maps");
    let layout = maps.join("LAYOUT");
    assert!(!layout.exists(), "a datapath is pinned before the first start");

    // The first start is killed once its maps are pinned: lbd pins them as
    // it creates them, then verifies its programs (a second or more here)
    // before it writes the layout version and attaches.
    kill_once_pinned(&lab, &lab.spec.bin_dir.join("lbd"), &config, &[layout.clone(), maps.join("FLOW_SLOTS")]);
    assert_eq!(pinned_layout(&maps), 0, "the killed start had written its layout already");
    assert!(xdp_mode_in_use(&lab, "eth0").unwrap().is_none(), "the killed start attached to eth0");

    // The next start sets the datapath up afresh instead of refusing the
    // half-made one ("layout version 0, which this lbd cannot migrate").
    let mut lbd = Lbd::start(&lab, &config, &sock).expect("lbd refused the maps a killed first start left");
    assert!(lbd.log_text().contains("never finished setting up"), "no word of the half-made maps in the log");
    lab.reset_backend_counts().unwrap();
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "300"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(300), Some(0)), "{r}");
    assert_eq!(lbd.total_new_flows(), 300);
    assert_eq!(lab.connections_served().unwrap(), 300);
    assert_eq!(lbd.status().unwrap()["flood"]["flow_capacity"], 262_144);
    // Its flow tables hold every array their slots need, each named for
    // its table (`bpftool map` lists them so).
    let slots = lb_common::flow_slots(262_144);
    for (table, per, array) in [
        ("FLOW_SLOTS", lb_common::FLOW_ARRAY_ELEMENTS, lb_userspace::dataplane::FLOW_ARRAY_NAME),
        ("FLOW_SLOTS6", lb_common::FLOW_ARRAY_ELEMENTS6, lb_userspace::dataplane::FLOW_ARRAY_NAME6),
    ] {
        let names = lb_tests::lbd::pinned_inner_names(&maps, table);
        assert_eq!(names.len(), lb_common::flow_arrays(slots, per) as usize, "{table}: arrays held");
        let other: Vec<_> = names.iter().filter(|n| *n != array).take(3).collect();
        assert!(other.is_empty(), "{table}: arrays not named {array}: {other:?}");
    }

    // A restart with a larger flow table and selection array in the
    // config adopts the maps as they are: what lbd reports and limits by
    // is their size, and it says the config's waits for a clean stop.
    lbd.kill().unwrap();
    let bigger = write_config_with(
        config.parent().unwrap(),
        "bigger",
        &sock,
        &["eth0".into(), "eth1".into()],
        "conntrack_max: 524288\ntable_capacity: 8388608\n",
        WEB,
    )
    .unwrap();
    let mut lbd = Lbd::start(&lab, &bigger, &sock).unwrap();
    let status = lbd.status().unwrap();
    assert_eq!(
        status["flood"]["flow_capacity"], 262_144,
        "the status reports the adopted table's size, not the config's"
    );
    for family in ["ipv4", "ipv6"] {
        let table = &status["flood"]["flow_tables"][family];
        assert_eq!(table["capacity"], 262_144, "{family}: the adopted table's size, not the config's: {table}");
    }
    let log = lbd.log_text();
    for line in [
        "the adopted flow table has 524288 slots, room for 262144 flows where the config's conntrack_max says 524288",
        "the adopted IPv6 flow table has 524288 slots, room for 262144 flows where the config's conntrack_max_ipv6 says 524288",
        "the adopted SELECT map has 4194304 entries, the config's table_capacity says",
    ] {
        assert!(log.contains(line), "no warning \"{line}\" in the log");
    }
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "100"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(100), Some(0)), "{r}");

    // A second lbd given the same pin_path but a control socket and a
    // metrics address of its own (which let it past those binds, as in
    // another network namespace) is refused before it touches the running
    // datapath.
    let other_sock = sock.with_file_name("other.sock");
    let text = std::fs::read_to_string(&bigger).unwrap();
    let own = format!("control_socket: {}", sock.display());
    assert!(text.contains(&own), "{text}");
    let second = config.with_file_name("second.yaml");
    let text =
        text.replace(&own, &format!("control_socket: {}\nmetrics_listen: 127.0.0.1:19464", other_sock.display()));
    std::fs::write(&second, text).unwrap();
    let program = xdp_program_in_use(&lab, "eth0");
    let err = Lbd::start(&lab, &second, &other_sock).err().expect("a second lbd started on a datapath in use");
    let err = format!("{err:#}");
    assert!(err.contains("another lbd runs the datapath pinned at"), "{err}");
    assert_eq!(xdp_program_in_use(&lab, "eth0"), program, "the refused lbd swapped its program in");
    assert!(!other_sock.exists(), "the refused lbd left its socket");
    assert_eq!(lbd.status().unwrap()["services"].as_array().map(Vec::len), Some(1));
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "100"]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(100), Some(0)), "{r}");
    lbd.stop().unwrap();
}

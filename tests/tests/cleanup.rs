//! What a killed test, lab or benchmark leaves behind is removed by
//! `cargo xtask lab down --all` (`Lab::down_all`): every lab's namespaces
//! and processes, lb-bench's namespaces, pins under the lab bpffs (then the bpffs mount itself), and a
//! sysctl a benchmark changed; that an interrupted or killed lb-bench
//! leaves no namespace without it; and that labs coming up at once mount
//! one bpf filesystem. Its own test binary: it removes every lab
//! on the machine, so nothing else may run beside it. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    io::{BufRead as _, BufReader},
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use lb_testkit::sysctl::{SAVED_DIR, Sysctl};
use lb_tests::{
    harness::{serial, web},
    lab::{BPFFS, Lab, LabSpec},
    lbd::{Lbd, write_config},
};

fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

/// How many filesystems are mounted on [`BPFFS`] (stacked ones each
/// count).
fn bpffs_mounts() -> usize {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines().filter(|l| l.split(' ').nth(4) == Some(BPFFS)).count()
}

fn bpf_stats() -> String {
    std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").unwrap().trim().to_owned()
}

#[test]
fn lab_down_all_removes_what_killed_runs_left() {
    let _guard = serial();
    lb_tests::require_root().expect("needs root");
    // A second bpf filesystem stacked on the labs' one, as two labs that
    // came up at once could mount before `ensure_bpffs` took a lock.
    lb_tests::lab::ensure_bpffs().unwrap();
    assert!(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]).status().unwrap().success());
    assert!(bpffs_mounts() >= 2, "no stacked mount on {BPFFS}");
    // A lab with a running lbd (pins, processes), left behind as a SIGKILL
    // would leave it: nothing is torn down.
    let prefix = "lbt-killed";
    let lab = Lab::up(LabSpec { prefix: prefix.into(), backends: 2, ..LabSpec::default() }).unwrap();
    let sock = lb_tests::harness::socket_for(prefix);
    let cfg = write_config(&lb_tests::harness::config_dir(prefix), "lbd", &sock, &web("", &[(1, 1), (2, 1)])).unwrap();
    let lbd = Lbd::start(&lab, &cfg, &sock).unwrap();
    let pins = lab.pin_dir();
    assert!(pins.exists(), "lbd pinned nothing under {}", pins.display());
    std::mem::forget(lbd);
    std::mem::forget(lab);
    // lb-bench's namespace of a process that is gone.
    let bench_ns = "lbbench-4000000";
    assert!(Command::new("ip").args(["netns", "add", bench_ns]).status().unwrap().success());
    // A benchmark's sysctl change, its guard never dropped.
    let before = bpf_stats();
    let flipped = if before == "0" { "1" } else { "0" };
    std::mem::forget(Sysctl::set("kernel.bpf_stats_enabled", flipped).unwrap());
    assert_eq!(bpf_stats(), flipped);

    Lab::down_all().unwrap();

    let left: Vec<String> =
        namespaces().into_iter().filter(|n| n.starts_with("lbt-killed-") || n == bench_ns).collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");
    assert!(!pins.exists(), "pins left under {}", pins.display());
    // (bpffs's own maps.debug and progs.debug stay)
    let in_bpffs: Vec<_> = std::fs::read_dir(BPFFS)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    assert!(in_bpffs.is_empty(), "pin directories left in {BPFFS}: {in_bpffs:?}");
    // Nothing pinned any more: the labs' bpf filesystem is unmounted.
    assert!(!lb_tests::lab::bpffs_mounted(), "{BPFFS} still mounted");
    assert_eq!(bpffs_mounts(), 0, "bpf filesystems left on {BPFFS}");
    assert_eq!(bpf_stats(), before, "kernel.bpf_stats_enabled not restored");
    let saved: Vec<_> =
        std::fs::read_dir(SAVED_DIR).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(saved.is_empty(), "saved values left: {saved:?}");
    let procs = Command::new("pgrep").args(["-f", "lbt-killed"]).output().unwrap();
    assert!(procs.stdout.is_empty(), "processes left: {}", String::from_utf8_lossy(&procs.stdout));
    // Safe to repeat.
    Lab::down_all().unwrap();
    // The forgotten lab's logs and config (a killed run's stay for
    // reading; this one's are the test's own).
    lb_tests::lab::remove_tmp_files(prefix);
}

/// Labs that come up at once (a test binary's tests run in parallel
/// threads) mount one bpf filesystem between them, not one each: a
/// second one stacked on the first would hide the first's pins and
/// outlive a release.
#[test]
fn labs_coming_up_at_once_mount_one_bpffs() {
    let _guard = serial();
    lb_tests::require_root().expect("needs root");
    lb_tests::lab::release_bpffs().unwrap();
    assert_eq!(bpffs_mounts(), 0, "a bpf filesystem on {BPFFS} with pins in it (another lab running?)");
    let start = std::sync::Barrier::new(8);
    std::thread::scope(|sc| {
        for _ in 0..8 {
            sc.spawn(|| {
                start.wait();
                lb_tests::lab::ensure_bpffs().unwrap();
            });
        }
    });
    let mounted = bpffs_mounts();
    assert!(lb_tests::lab::release_bpffs().unwrap());
    assert_eq!(mounted, 1, "8 labs coming up at once mounted {mounted} bpf filesystems on {BPFFS}");
    assert_eq!(bpffs_mounts(), 0, "release left a bpf filesystem on {BPFFS}");
}

/// A lab taken down unmounts the labs' bpf filesystem when it was the
/// last lab using it, and not before: a lab still up keeps it, and its
/// lbd pins and balances there after the other lab is gone. (Before,
/// only `cargo xtask test` or `lab down` unmounted it, so a test run by
/// hand left it mounted.)
#[test]
fn the_last_lab_taken_down_unmounts_the_bpffs() {
    let _guard = serial();
    lb_tests::require_root().expect("needs root");
    lb_tests::lab::release_bpffs().unwrap();
    assert_eq!(bpffs_mounts(), 0, "a bpf filesystem on {BPFFS} with pins in it (another lab running?)");
    let spec = |prefix: &str| LabSpec { prefix: prefix.into(), backends: 2, ..LabSpec::default() };
    let first = Lab::up(spec("lbt-bpfa")).unwrap();
    let second = Lab::up(spec("lbt-bpfb")).unwrap();
    assert_eq!(bpffs_mounts(), 1);
    drop(first);
    assert_eq!(bpffs_mounts(), 1, "the first lab's teardown unmounted the bpf filesystem the second one uses");
    let sock = lb_tests::harness::socket_for("lbt-bpfb");
    let cfg =
        write_config(&lb_tests::harness::config_dir("lbt-bpfb"), "lbd", &sock, &web("", &[(1, 1), (2, 1)])).unwrap();
    let mut lbd = Lbd::start(&second, &cfg, &sock).unwrap();
    let r = second.conns("10.10.0.100:80", 100, 10, &[]).unwrap();
    assert_eq!((r["ok"].as_u64(), r["failed"].as_u64()), (Some(100), Some(0)), "{r}");
    assert!(lbd.stop().unwrap().success());
    drop(second);
    assert_eq!(bpffs_mounts(), 0, "the last lab's teardown left a bpf filesystem on {BPFFS}");
    // The directories the labs made for it (/run/lbd itself may hold an
    // lbd's socket of the machine's own).
    for dir in [BPFFS, "/run/lbd/bpffs-users"] {
        assert!(!Path::new(dir).exists(), "{dir} left after the last lab");
    }
}

/// The network namespace of process `pid`'s threads that is not this
/// process's own: lb-bench's measuring thread makes one of its own.
fn private_namespaces(pid: u32) -> Vec<PathBuf> {
    let own = std::fs::read_link("/proc/self/ns/net").unwrap();
    let mut found: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.flatten().filter_map(|t| std::fs::read_link(t.path().join("ns/net")).ok()).collect())
        .unwrap_or_default();
    found.retain(|ns| *ns != own);
    found.sort();
    found.dedup();
    found
}

/// Every task on the machine still in network namespace `ns`
/// (`net:[inode]`).
fn tasks_in(ns: &Path) -> Vec<String> {
    let mut held = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else { continue };
        for t in tasks.flatten() {
            if std::fs::read_link(t.path().join("ns/net")).is_ok_and(|l| l == ns) {
                held.push(t.path().display().to_string());
            }
        }
    }
    held
}

/// Start `lb-bench packet` on long runs; returns it once it measures,
/// with its namespace and its stderr lines as they come.
fn start_lb_bench() -> (Child, PathBuf, mpsc::Receiver<String>) {
    let bin = LabSpec::default().bin_dir.join("lb-bench");
    // 2^21 repeats a run, a fifth of a second or so: a signal usually
    // lands in one (more would size the flow table for that many new
    // flows, gigabytes).
    let mut child = Command::new(&bin)
        .args(["packet", "--rounds", "20", "--repeat", "2097152", "--fill", "0", "--only", "tcp_established"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).split(b'\n').map_while(Result::ok) {
            // The progress line ends in \r without \n; a line per \n.
            let _ = tx.send(String::from_utf8_lossy(&line).into_owned());
        }
    });
    wait_line(&rx, &mut child, "lb-bench packet:", Duration::from_secs(120));
    let ns = private_namespaces(child.id());
    assert_eq!(ns.len(), 1, "lb-bench's threads are in {ns:?} beside this process's namespace");
    (child, ns[0].clone(), rx)
}

/// Wait for a line of lb-bench's stderr starting with or containing
/// `what`, within `within` (lb-bench is killed and the test fails
/// otherwise).
fn wait_line(rx: &mpsc::Receiver<String>, child: &mut Child, what: &str, within: Duration) {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains(what)) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(l) => seen.push(l),
            Err(e) => {
                let _ = child.kill();
                panic!("no line with {what:?} from lb-bench within {within:?} ({e}): {seen:?}");
            }
        }
    }
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("lb-bench still running {within:?} after it was told to stop");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What a user relies on when a benchmark is interrupted or killed: its
/// namespace (veth pair, routes, neighbours), the sysctl it changed and
/// no process are left, without `lab down`.
fn assert_bench_left_nothing(ns: &Path, stats_before: &str) {
    let held = tasks_in(ns);
    assert!(held.is_empty(), "tasks still in lb-bench's namespace {}: {held:?}", ns.display());
    let named: Vec<String> = namespaces().into_iter().filter(|n| n.starts_with("lbbench-")).collect();
    assert!(named.is_empty(), "lb-bench left named namespaces: {named:?}");
    assert_eq!(bpf_stats(), stats_before, "kernel.bpf_stats_enabled not as lb-bench found it");
    let saved: Vec<_> =
        std::fs::read_dir(SAVED_DIR).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(saved.is_empty(), "saved values left: {saved:?}");
}

#[test]
fn lb_bench_stopped_by_a_second_signal_leaves_nothing() {
    let _guard = serial();
    lb_tests::require_root().expect("needs root");
    let stats_before = bpf_stats();
    let (mut child, ns, rx) = start_lb_bench();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    // The first is taken as "stop after this run"; the second, sent once
    // it says so, ends the run at once.
    wait_line(&rx, &mut child, "stopping after this run", Duration::from_secs(30));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
    let st = wait_exit(&mut child, Duration::from_secs(20));
    let rest: Vec<String> = rx.try_iter().collect();
    // Exit 130 (128 + SIGINT) from the second signal; or, when the run in
    // progress ended between the two, the first signal's clean stop.
    assert!(
        st.code() == Some(130) || (st.code() == Some(1) && rest.iter().any(|l| l.contains("interrupted"))),
        "lb-bench ended with {st} after two SIGINTs: {rest:?}"
    );
    assert_bench_left_nothing(&ns, &stats_before);
}

#[test]
fn lb_bench_killed_leaves_no_namespace() {
    let _guard = serial();
    lb_tests::require_root().expect("needs root");
    let stats_before = bpf_stats();
    let (mut child, ns, _rx) = start_lb_bench();
    child.kill().unwrap();
    let st = wait_exit(&mut child, Duration::from_secs(20));
    assert_eq!(st.signal(), Some(libc::SIGKILL));
    // The sysctl is as it was only if lb-bench had nothing to change (a
    // SIGKILLed run's change is put back by the next run or `lab down
    // --all`, tested above); the namespace goes in any case.
    if stats_before == "0" {
        assert_bench_left_nothing(&ns, &stats_before);
    } else {
        let held = tasks_in(&ns);
        assert!(held.is_empty(), "tasks still in lb-bench's namespace {}: {held:?}", ns.display());
        lb_testkit::sysctl::restore_saved().unwrap();
    }
}

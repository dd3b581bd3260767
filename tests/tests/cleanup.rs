//! What a killed test, lab or benchmark leaves behind is removed by
//! `cargo xtask lab down --all` (`Lab::down_all`): every lab's namespaces
//! and processes, lb-bench's namespaces, pins under the lab bpffs (then the bpffs mount itself), and a
//! sysctl a benchmark changed. Its own test binary: it removes every lab
//! on the machine, so nothing else may run beside it. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::process::Command;

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

fn bpf_stats() -> String {
    std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").unwrap().trim().to_owned()
}

#[test]
fn lab_down_all_removes_what_killed_runs_left() {
    let _guard = serial();
    lb_tests::require_root().expect("needs root");
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

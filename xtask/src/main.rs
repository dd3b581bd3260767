//! Project tasks: `cargo xtask setup | build | lab up|down | demo | test | install`.
mod bench;
mod install;

use std::{
    io::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use lb_tests::{
    lab::{Lab, LabSpec, Topology},
    lbd::Lbd,
};
use xtask_boot::{self as setup, is_root, run, target_dir, workspace_root};

#[derive(Parser)]
#[command(about = "Build, set up, demo and test the XDP load balancer")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the toolchain pieces and packages the project needs (idempotent).
    Setup,
    /// Build every binary (lbd, lbctl, lab helpers).
    Build,
    /// The namespace lab (clients, gateway, switch, 3 backends).
    Lab {
        #[command(subcommand)]
        action: LabAction,
    },
    /// Build, bring the lab up, balance 1,000 HTTP connections through the VIP,
    /// compare lbd's per-backend counters with the backends' own counts.
    Demo {
        /// Requests to send (each on a new TCP connection).
        #[arg(long, default_value_t = 1000)]
        requests: u32,
    },
    /// Host unit tests, datapath fixtures (BPF_PROG_TEST_RUN) and lab end-to-end tests.
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks: per-packet cost, end to end against HAProxy and nginx,
    /// the published evaluations; report in target/bench/report.md.
    Bench {
        /// Only this part (default: all three; `fuzz` only when named).
        #[arg(value_enum)]
        part: Option<BenchPart>,
        /// The long versions (default: short, meant to take under 12
        /// minutes in all on a 2-core machine, its release build included).
        #[arg(long)]
        full: bool,
    },
    /// Release build of lbd and lbctl, installed with shell completions, man
    /// pages, the systemd unit and (if none exists) an example configuration.
    Install {
        /// Installation prefix: binaries in PREFIX/bin, completions and man pages in PREFIX/share.
        #[arg(long, default_value = "/usr/local")]
        prefix: PathBuf,
        /// Stage the installation under this directory (packaging); no root needed.
        #[arg(long)]
        destdir: Option<PathBuf>,
        /// Configuration root: SYSCONFDIR/systemd/system/lbd.service and SYSCONFDIR/lbd/lbd.yaml.
        #[arg(long, default_value = "/etc")]
        sysconfdir: PathBuf,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchPart {
    Packet,
    E2e,
    Scenarios,
    /// The datapath fuzzer: 1,000,000 packets (10,000,000 with --full); only when named.
    Fuzz,
}

#[derive(Subcommand)]
enum LabAction {
    /// Create the lab (replacing any leftover one) and leave it running.
    Up {
        /// Gateway wiring: tuned (the demo's), default, bridge-backend,
        /// bridge-client, one-arm or mixed (see the README, "Where it runs").
        #[arg(long, default_value = "tuned")]
        topology: Topology,
        /// Balancer nodes of the `ecmp` topology (2-8), each running its
        /// own lbd, announcing the VIPs to the router over BGP.
        #[arg(long, default_value_t = 2)]
        nodes: usize,
    },
    /// Remove the lab: processes, namespaces, links. Safe to repeat.
    Down {
        /// Remove everything any lab, test or benchmark of this project
        /// left, also when it was killed: every lab's namespaces and
        /// processes, lb-bench's namespaces, pins, changed sysctls.
        #[arg(long)]
        all: bool,
    },
}

const LAB_PREFIX: &str = "lb";

fn main() {
    let args = Args::parse();
    let result = match args.cmd {
        Cmd::Setup => setup::setup(),
        Cmd::Build => ensure_setup().and_then(|()| build()),
        Cmd::Lab { action: LabAction::Up { topology, nodes } } => need_root("cargo xtask lab up")
            .and_then(|()| ensure_setup())
            .and_then(|()| build())
            .and_then(|()| if topology == Topology::Ecmp { ecmp_up(nodes) } else { lab_up(topology) }),
        Cmd::Lab { action: LabAction::Down { all } } => need_root("cargo xtask lab down").and_then(|()| {
            if all {
                Lab::down_all()
            } else {
                Lab::down(LAB_PREFIX).and_then(|()| lb_tests::lab::release_bpffs().map(drop))
            }
        }),
        Cmd::Demo { requests } => need_root("cargo xtask demo")
            .and_then(|()| ensure_setup())
            .and_then(|()| build())
            .and_then(|()| demo(requests)),
        Cmd::Test { args } => need_root("cargo xtask test")
            .and_then(|()| ensure_setup())
            .and_then(|()| build())
            .and_then(|()| test(&args)),
        Cmd::Bench { part: Some(BenchPart::Fuzz), full } => {
            need_root("cargo xtask bench fuzz").and_then(|()| ensure_setup()).and_then(|()| bench::fuzz(full))
        }
        Cmd::Bench { part, full } => need_root("cargo xtask bench")
            .and_then(|()| ensure_setup())
            .and_then(|()| setup::debian(bench::PACKAGES))
            // No debug build: the bench builds and runs release binaries
            // only (`bench::bench`).
            .and_then(|()| {
                let parts = match part {
                    None => vec![bench::Part::Packet, bench::Part::E2e, bench::Part::Scenarios],
                    Some(BenchPart::Packet) => vec![bench::Part::Packet],
                    Some(BenchPart::E2e) => vec![bench::Part::E2e],
                    Some(BenchPart::Scenarios) => vec![bench::Part::Scenarios],
                    Some(BenchPart::Fuzz) => unreachable!("bench fuzz is matched above"),
                };
                bench::bench(&bench::Options { parts, full })
            }),
        Cmd::Install { prefix, destdir, sysconfdir } => {
            let root_ok = if destdir.is_none() { need_root("cargo xtask install (without --destdir)") } else { Ok(()) };
            root_ok
                .and_then(|()| ensure_setup())
                .and_then(|()| install::install(&prefix, destdir.as_deref(), &sysconfdir))
        }
    };
    if let Err(e) = result {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn need_root(what: &str) -> anyhow::Result<()> {
    if !is_root() {
        let why = if what.contains("install") {
            "it writes to system directories"
        } else {
            "it creates network namespaces and loads XDP programs"
        };
        bail!("{what} needs root ({why}); run it as root");
    }
    Ok(())
}

fn ensure_setup() -> anyhow::Result<()> {
    if setup::complete() {
        return Ok(());
    }
    setup::setup().context("setting up the build and test environment")
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// Where `cargo build` (dev profile) puts binaries.
fn bin_dir() -> PathBuf {
    target_dir().join("debug")
}

fn build() -> anyhow::Result<()> {
    run(cargo().args(["build", "--bins"]))
}

fn lab_spec() -> LabSpec {
    LabSpec { prefix: LAB_PREFIX.into(), bin_dir: bin_dir(), ..LabSpec::default() }
}

fn lab_up(topology: Topology) -> anyhow::Result<()> {
    let lab = Lab::up(LabSpec { topology, ..lab_spec() })?;
    println!(
        "lab {LAB_PREFIX} ({topology}: {}) is up: namespaces {}, {}, {}, {}..{}; gateway interfaces {} (clients 10.10.0.1, backends 10.20.0.1)",
        topology.describe(),
        lab.ns("client"),
        lab.ns("gw"),
        lab.ns("sw"),
        lab.ns("be1"),
        lab.ns(&format!("be{}", lab.spec.backends)),
        lab.gw_interfaces().join(", "),
    );
    if lab.gw_interfaces() == ["eth0", "eth1"] {
        println!(
            "start the balancer:  ip netns exec {} {}/lbd --config configs/lab.yaml",
            lab.ns("gw"),
            bin_dir().display()
        );
    } else {
        println!(
            "start the balancer:  ip netns exec {} {}/lbd --config FILE  (configs/lab.yaml with interfaces: [{}])",
            lab.ns("gw"),
            bin_dir().display(),
            lab.gw_interfaces().join(", ")
        );
    }
    println!("take it down:        cargo xtask lab down");
    lab.keep();
    Ok(())
}

/// The scale-out lab: the nodes, each with its own lbd balancing a DSR
/// service on 10.10.0.110:8080 and announcing it to the router over BGP.
fn ecmp_up(nodes: usize) -> anyhow::Result<()> {
    let lab = Lab::up(LabSpec { topology: Topology::Ecmp, nodes, ..lab_spec() })?;
    let mut services = format!(
        "  - name: dsr\n    vip: {}\n    port: 8080\n    protocol: tcp\n    forwarding: dsr\n    scheduler: maglev\n    health: {{ type: http, path: /health, interval: 1s, fall: 2, rise: 2 }}\n    backends:\n",
        lb_tests::lab::DSR_VIP
    );
    for a in lab.backend_addrs() {
        services.push_str(&format!("      - {{ address: {a} }}\n"));
    }
    let dir = PathBuf::from(format!("/tmp/{LAB_PREFIX}-cfg"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for k in 1..=nodes {
        let config = dir.join(format!("n{k}.yaml"));
        std::fs::write(&config, lab.node_config(k, 9, &services))
            .with_context(|| format!("writing {}", config.display()))?;
        let log = PathBuf::from(format!("/tmp/{LAB_PREFIX}-n{k}-lbd.log"));
        let logf = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        // Left running with the lab; `cargo xtask lab down` stops it with
        // the namespace's other processes.
        lab.cmd(&format!("n{k}"), bin_dir().join("lbd"))
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .with_context(|| format!("starting lbd on n{k}"))?;
    }
    let vip = lb_tests::lab::DSR_VIP;
    lb_tests::lbd::wait_for(30, || lab.router_next_hops(vip).ok().filter(|h| h.len() == nodes));
    let hops = lab.router_next_hops(vip)?;
    println!(
        "lab {LAB_PREFIX} (ecmp: {}) is up: client {}, router {} (BIRD, AS {}), nodes {}..{} (lbd + BIRD, AS {}), switch {}, backends {}..{}",
        Topology::Ecmp.describe(),
        lab.ns("client"),
        lab.ns("rt"),
        lb_tests::lab::ROUTER_ASN,
        lab.ns("n1"),
        lab.ns(&format!("n{nodes}")),
        lb_tests::lab::NODE_ASN,
        lab.ns("sw"),
        lab.ns("be1"),
        lab.ns(&format!("be{}", lab.spec.backends)),
    );
    println!("the router's route to {vip}: next hops {hops:?} ({} of {nodes} nodes)", hops.len());
    println!("configs {}/n*.yaml, logs /tmp/{LAB_PREFIX}-n*-lbd.log", dir.display());
    println!("a node's state:      {}/lbctl --socket {} status", bin_dir().display(), lab.node_socket(1).display());
    println!(
        "the router's view:   ip -n {} route show {vip}; birdc -s {} show protocols",
        lab.ns("rt"),
        lab.router_bird_ctl().display()
    );
    println!("take it down:        cargo xtask lab down");
    lab.keep();
    if hops.len() != nodes {
        bail!("the router learnt {vip} from {} of {nodes} nodes within 30 s (see the logs)", hops.len());
    }
    Ok(())
}

fn demo(requests: u32) -> anyhow::Result<()> {
    let lab = Lab::up(lab_spec()).context("bringing the lab up")?;
    let config = workspace_root().join("configs/lab.yaml");
    let socket = PathBuf::from("/run/lbd/lbd.sock");
    let lbd = Lbd::start(&lab, &config, &socket)?;
    println!("lbd is running in {} with {} (log: {})", lab.ns("gw"), config.display(), lbd.log.display());
    lab.reset_backend_counts()?;

    let count = requests.to_string();
    println!(
        "\nsending {requests} HTTP requests to 10.10.0.100:80, each on a new TCP connection, from 250 client addresses ..."
    );
    let result = lab.client(&[
        "conns",
        "--target",
        "10.10.0.100:80",
        "--count",
        &count,
        "--concurrency",
        "10",
        "--sources-range",
        "10.10.1.1-10.10.1.250",
    ])?;
    let ok = result["ok"].as_u64().unwrap_or(0);
    let failed = result["failed"].as_u64().unwrap_or(u64::MAX);
    println!("client: {ok} ok, {failed} failed in {} ms", result["elapsed_ms"]);

    println!("\n$ lbctl status\n{}", lbd.lbctl(&["status"])?);
    let status = lbd.status()?;
    let seen = lab.backend_counts()?;
    println!("{:<10} {:<18} {:>16} {:>22}", "BACKEND", "ADDRESS", "lbd NEW FLOWS", "BACKEND CONNECTIONS");
    let mut all_match = true;
    let mut served = 0;
    for (i, addr) in lab.backend_addrs().iter().enumerate() {
        let ours = Lbd::new_flows(&status, "web", &addr.to_string()).unwrap_or(0);
        let theirs = seen[i].connections;
        let same = ours == theirs;
        all_match &= same;
        if theirs > 0 {
            served += 1;
        }
        println!(
            "{:<10} {:<18} {:>16} {:>22}  {}",
            seen[i].name,
            format!("{addr}:8080"),
            ours,
            theirs,
            if same { "match" } else { "MISMATCH" }
        );
    }
    if let Some(f) = status["services"][0]["fairness"].as_f64() {
        println!("Jain's fairness index over the backends: {f:.4}");
    }
    drop(lbd);
    drop(lab);
    lb_tests::lab::release_bpffs()?;
    println!("\nlab taken down.");
    if failed != 0 || ok != u64::from(requests) {
        bail!("{failed} of {requests} requests failed");
    }
    if !all_match {
        bail!("lbd's new-flow counters differ from the backends' own connection counts");
    }
    if served != 3 {
        bail!("only {served} of 3 backends served connections");
    }
    println!("demo passed: {requests} requests, 0 failures, all 3 backends served, counters match exactly.");
    Ok(())
}

/// The lints first (formatting, clippy with warnings denied for the host
/// crates and, with the nightly, for the eBPF crate on its own target),
/// then every test. A filter (`extra`) runs only the matching tests.
fn test(extra: &[String]) -> anyhow::Result<()> {
    if extra.is_empty() {
        run(cargo().args(["fmt", "--all", "--check"]))?;
        run(cargo().args(["clippy", "--workspace", "--exclude", "lb-ebpf", "--all-targets", "--", "-D", "warnings"]))?;
        lint_ebpf()?;
    }
    let old_lbd = build_upgrade_from(UPGRADE_FROM, "upgrade-from")?;
    let v2_lbd = build_upgrade_from(UPGRADE_FROM_V2, "upgrade-from-v2")?;
    let v3_lbd = build_upgrade_from(UPGRADE_FROM_V3, "upgrade-from-v3")?;
    let v4_lbd = build_upgrade_from(UPGRADE_FROM_V4, "upgrade-from-v4")?;
    let v5_lbd = build_upgrade_from(UPGRADE_FROM_V5, "upgrade-from-v5")?;
    let v6_lbd = build_upgrade_from(UPGRADE_FROM_V6, "upgrade-from-v6")?;
    let v7_lbd = build_upgrade_from(UPGRADE_FROM_V7, "upgrade-from-v7")?;
    let v8_lbd = build_upgrade_from(UPGRADE_FROM_V8, "upgrade-from-v8")?;
    let result = run(cargo()
        .args(["test", "--no-fail-fast"])
        .args(extra)
        .env("LB_BIN_DIR", bin_dir())
        .env("LB_UPGRADE_FROM_LBD", old_lbd)
        .env("LB_UPGRADE_FROM_V2_LBD", v2_lbd)
        .env("LB_UPGRADE_FROM_V3_LBD", v3_lbd)
        .env("LB_UPGRADE_FROM_V4_LBD", v4_lbd)
        .env("LB_UPGRADE_FROM_V5_LBD", v5_lbd)
        .env("LB_UPGRADE_FROM_V6_LBD", v6_lbd)
        .env("LB_UPGRADE_FROM_V7_LBD", v7_lbd)
        .env("LB_UPGRADE_FROM_V8_LBD", v8_lbd));
    // The labs' bpf filesystem, once no lab (the user's own included)
    // has anything pinned in it.
    if let Err(e) = lb_tests::lab::release_bpffs() {
        eprintln!("warning: {e:#}");
    }
    result
}

/// The release the first upgrade test (tests/upgrade.rs) upgrades from: the last
/// commit before the pinned maps carried a layout version (layout 1).
const UPGRADE_FROM: &str = "8c0cc042adc34afa60df0c41c441d487944d6142";

/// The release the second upgrade test upgrades from: the last commit of
/// layout 2 (flows in kernel hash maps, before the flow table of slots).
const UPGRADE_FROM_V2: &str = "44637cace7b7622b7eef548a88e9ee76768d17e4";

/// The release the third upgrade test upgrades from: the last commit of
/// layout 3 (flow slots placed by an unseeded hash).
const UPGRADE_FROM_V3: &str = "9e1e1f1b38e019a4506411487f50c67306ea4b38";

/// The release the fourth upgrade test upgrades from: the last commit of
/// layout 4 (slots hashed over the whole 5-tuple, reply keys unmarked).
const UPGRADE_FROM_V4: &str = "f85d190ffbf8172ac4a0d8e1a2e432150ab449d4";

/// The release the fifth upgrade test upgrades from: the last commit of
/// layout 5 (one selection-table entry to an element of SELECT).
const UPGRADE_FROM_V5: &str = "4622c4472bcece7828d860160c51003b2d95e2bc";

/// The release the sixth upgrade test upgrades from: the last commit of
/// layout 6 (each flow table one big array).
const UPGRADE_FROM_V6: &str = "0aeaa9d4b82e9c8b5dc518ee20a38edd850c632c";

/// The release the seventh upgrade test upgrades from: the last commit of
/// layout 7 (entry and connection counts in shared words only).
const UPGRADE_FROM_V7: &str = "89292715ea1976990305219f0411426b92040d98";

/// The release the eighth upgrade test upgrades from: the last commit of
/// layout 8 (flow-table claims without a generation, no sweeper's mark).
const UPGRADE_FROM_V8: &str = "50e88d675519afe8484272e2a32d20d93a8e36b0";

/// Build the lbd of commit `commit` from this repository's history, once,
/// into target/`name` (its source is extracted with `git archive`);
/// returns the binary's path.
fn build_upgrade_from(commit: &str, name: &str) -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let dir = root.join("target").join(name);
    let src = dir.join("src");
    let stamp = src.join(".commit");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(commit) {
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src)?;
        // A shallow clone lacks the commit: fetch it from where this clone
        // came from (best effort; the archive below says if it failed).
        let have = Command::new("git")
            .args(["cat-file", "-e", &format!("{commit}^{{commit}}")])
            .current_dir(&root)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !have {
            eprintln!("xtask: fetching commit {} (the upgrade test's old release)", &commit[..7]);
            let _ = Command::new("git")
                .args(["fetch", "--quiet", "--depth", "1", "origin", commit])
                .current_dir(&root)
                .status();
        }
        let archive = Command::new("git")
            .args(["archive", "--format=tar", commit])
            .current_dir(&root)
            .output()
            .context("running git archive")?;
        if !archive.status.success() {
            bail!(
                "the upgrade test builds lbd from commit {commit}, which this clone does not have and could not fetch from origin ({}); clone the repository with its history",
                String::from_utf8_lossy(&archive.stderr).trim()
            );
        }
        let mut tar = Command::new("tar").args(["-x", "-C"]).arg(&src).stdin(Stdio::piped()).spawn()?;
        tar.stdin.take().expect("piped").write_all(&archive.stdout)?;
        if !tar.wait()?.success() {
            bail!("extracting commit {commit} into {} failed", src.display());
        }
        std::fs::write(&stamp, commit)?;
    }
    eprintln!("xtask: building lbd of {} (the upgrade test's old release)", &commit[..7]);
    // Without debug info or incremental state: the whole test run must fit
    // the disk of a CI machine (a run that kept three full debug builds of
    // old releases ran out of space on one). A target directory each: one
    // shared by the releases would take a release's crates for another's,
    // since git archive dates their files to their commits and cargo then
    // finds the other release's artifacts newer than the sources.
    let mut c = cargo();
    c.current_dir(&src).args(["build", "-p", "lb-userspace", "--bin", "lbd", "--target-dir"]).arg(dir.join("target"));
    c.env_remove("CARGO_TARGET_DIR").env("CARGO_PROFILE_DEV_DEBUG", "0").env("CARGO_INCREMENTAL", "0");
    run(&mut c)?;
    Ok(dir.join("target/debug/lbd"))
}

/// Clippy of lb-ebpf for bpfel-unknown-none (what lb-userspace's build
/// script compiles), in a target directory of its own.
fn lint_ebpf() -> anyhow::Result<()> {
    let root = workspace_root();
    let mut c = Command::new("rustup");
    c.args(["run", "nightly", "cargo", "clippy", "--package", "lb-ebpf", "--bins", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core", "--target-dir"])
        .arg(root.join("target/ebpf-clippy"))
        .args(["--", "-D", "warnings"])
        .current_dir(&root);
    for key in ["RUSTC", "RUSTC_WORKSPACE_WRAPPER", "RUSTC_WRAPPER", "CARGO", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR"] {
        c.env_remove(key);
    }
    run(&mut c)
}

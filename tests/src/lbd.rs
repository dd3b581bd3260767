//! Run lbd inside a lab's gateway namespace, stopped (SIGTERM, then
//! SIGKILL) when the guard drops, also when a test fails.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::lab::Lab;

pub struct Lbd {
    child: Option<Child>,
    pub socket: PathBuf,
    pub log: PathBuf,
    bin_dir: PathBuf,
}

/// Poll `f` every 50 ms until it returns Some, for at most `secs` seconds.
pub fn wait_for<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How long lbd may go without using CPU or writing a log line before a
/// wait for it gives up: a start or restart that is stuck, not slow.
const STALL: Duration = Duration::from_secs(20);
/// The longest a wait for a working lbd lasts (one that spins forever).
const WORKING_LIMIT: Duration = Duration::from_secs(300);

/// Tells a slow lbd from a stuck one. A start verifies the programs and
/// makes the flow tables, seconds of CPU time that stretch several times
/// over when other tests and processes share the cores; a fixed deadline
/// fails such a start for being slow. Progress is lbd's CPU time (user and
/// system: the kernel's verifier counts as lbd's system time) or its log
/// growing.
struct Progress {
    pid: u32,
    log: PathBuf,
    seen: (u64, u64),
    since: Instant,
}

impl Progress {
    fn new(pid: u32, log: &Path) -> Self {
        let mut me = Self { pid, log: log.to_owned(), seen: (0, 0), since: Instant::now() };
        me.seen = me.now().unwrap_or_default();
        me
    }

    /// lbd's CPU ticks (utime + stime, fields 14 and 15 of
    /// /proc/PID/stat, counted after the command name's closing
    /// parenthesis: a name may hold spaces); None once lbd has exited
    /// (its state, field 3, is Z, or it was reaped).
    fn stat(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?;
        let rest = stat.get(stat.rfind(')')? + 1..)?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if *fields.first()? == "Z" {
            return None;
        }
        Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
    }

    /// (CPU ticks, log bytes) now; None once lbd has exited.
    fn now(&self) -> Option<(u64, u64)> {
        let bytes = std::fs::metadata(&self.log).map_or(0, |m| m.len());
        Some((self.stat()?, bytes))
    }

    /// How long since lbd last used CPU or logged; None once it has exited.
    fn idle(&mut self) -> Option<Duration> {
        let now = self.now()?;
        if now != self.seen {
            self.seen = now;
            self.since = Instant::now();
        }
        Some(self.since.elapsed())
    }
}

/// Write a lab config for lbd: `services_yaml` is the `services:` list
/// (already indented as list items). Returns the file path.
/// The config says nothing about `xdp_mode`: lbd's default (`auto`) is
/// what is tested. Interfaces are the tuned lab's (`eth0`, `eth1`).
pub fn write_config(dir: &Path, name: &str, socket: &Path, services_yaml: &str) -> anyhow::Result<PathBuf> {
    write_config_for(dir, name, socket, &["eth0".into(), "eth1".into()], services_yaml)
}

/// As [`write_config`], attaching to `interfaces` (a topology's
/// [`Lab::gw_interfaces`](crate::lab::Lab::gw_interfaces)).
pub fn write_config_for(
    dir: &Path,
    name: &str,
    socket: &Path,
    interfaces: &[String],
    services_yaml: &str,
) -> anyhow::Result<PathBuf> {
    // Room for what the lab tests do (about 10,000 connections a second,
    // closed ones lingering 10 s) without reaching the table's limit: the
    // tests that mean to fill it (flood.rs) say so.
    write_config_with(dir, name, socket, interfaces, "conntrack_max: 262144\n", services_yaml)
}

/// As [`write_config_for`], with top-level keys of the caller's (`top`,
/// whole YAML lines; `conntrack_max` among them if it matters).
pub fn write_config_with(
    dir: &Path,
    name: &str,
    socket: &Path,
    interfaces: &[String],
    top: &str,
    services_yaml: &str,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{name}.yaml"));
    let text = format!(
        "interfaces: [{}]\nforwarding: nat\ncontrol_socket: {}\npin_path: {}/{}\n{top}services:\n{services_yaml}",
        interfaces.join(", "),
        socket.display(),
        crate::lab::BPFFS,
        socket.file_stem().and_then(|s| s.to_str()).unwrap_or("lbd"),
    );
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Assert that the gateway's `iface` runs XDP in `mode` (`native`,
/// `generic`), as the kernel says and as `lbd` reports it; `when` says at
/// which moment, in the message.
pub fn assert_xdp_mode(lab: &Lab, lbd: &Lbd, iface: &str, mode: &str, when: &str) {
    let kernel = xdp_mode_in_use(lab, iface).unwrap();
    assert_eq!(kernel.as_deref(), Some(mode), "{when}: the kernel's XDP mode on {iface}; lbd log:\n{}", lbd.log_text());
    let status = lbd.status().unwrap();
    let reported = status["interfaces"].as_array().and_then(|a| a.iter().find(|a| a["interface"] == iface));
    assert_eq!(reported.map(|a| a["mode"].clone()), Some(mode.into()), "{when}: lbd reports {}", status["interfaces"]);
}

/// The XDP mode the kernel reports for `iface` in the lab's gateway
/// (`ip -j -d link`: the attach mode number, not a substring of the text):
/// "native", "generic", "offload", or None when no program is attached.
pub fn xdp_mode_in_use(lab: &Lab, iface: &str) -> anyhow::Result<Option<String>> {
    xdp_mode_in(lab, "gw", iface)
}

/// As [`xdp_mode_in_use`], on `iface` in the namespace of lab role `role`.
pub fn xdp_mode_in(lab: &Lab, role: &str, iface: &str) -> anyhow::Result<Option<String>> {
    let xdp = xdp_of(lab, role, iface)?;
    // XDP_ATTACHED_* from linux/if_link.h.
    Ok(match xdp["mode"].as_u64() {
        None | Some(0) => None,
        Some(1) => Some("native".into()),
        Some(2) => Some("generic".into()),
        Some(3) => Some("offload".into()),
        Some(m) => bail!("{iface}: XDP attach mode {m} ({xdp}) is not a single program"),
    })
}

/// The `xdp` object `ip -j -d link` reports for `iface` in lab role `role`.
fn xdp_of(lab: &Lab, role: &str, iface: &str) -> anyhow::Result<serde_json::Value> {
    let out = Command::new("ip")
        .args(["-n", &lab.ns(role), "-j", "-d", "link", "show", "dev", iface])
        .output()
        .context("running ip link show")?;
    if !out.status.success() {
        bail!("ip link show dev {iface}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("ip -j link output")?;
    Ok(v[0]["xdp"].clone())
}

/// The id of the XDP program the kernel reports on the gateway's `iface`
/// (the one program, in whichever mode). Panics when there is none.
pub fn xdp_program_in_use(lab: &Lab, iface: &str) -> u64 {
    let xdp = xdp_of(lab, "gw", iface).unwrap();
    xdp["prog"]["id"].as_u64().unwrap_or_else(|| panic!("no XDP program on {iface}: {xdp}"))
}

/// Where the forwarded packets of a status report went: (left by XDP
/// redirect, handed to the kernel's forwarding, forwarded in all). The
/// last is the per-backend packet counters of every service; the first two
/// are the path counters, which must add up to it.
pub fn path_counts(status: &serde_json::Value) -> (u64, u64, u64) {
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    let forwarded = status["services"]
        .as_array()
        .expect("services")
        .iter()
        .flat_map(|s| s["backends"].as_array().expect("backends").iter())
        .map(|b| n(b, "packets_in") + n(b, "packets_out"))
        .sum();
    let c = &status["counters"];
    (n(c, "xdp_redirect"), n(c, "fib_fallback") + n(c, "kernel_egress"), forwarded)
}

impl Lbd {
    /// lbd's process id (the child of `ip netns exec`, which execs lbd).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Start lbd with `config` in the lab's gateway and wait until its
    /// control socket answers.
    pub fn start(lab: &Lab, config: &Path, socket: &Path) -> anyhow::Result<Self> {
        Self::start_binary(lab, &lab.spec.bin_dir.join("lbd"), config, socket)
    }

    /// As [`start`](Self::start), with the lbd binary at `lbd`.
    pub fn start_binary(lab: &Lab, lbd: &Path, config: &Path, socket: &Path) -> anyhow::Result<Self> {
        Self::start_at(lab, "gw", lbd, config, socket)
    }

    /// As [`start`](Self::start), in the namespace of lab role `role` (an
    /// ecmp lab's node, `n1`...); its log is `/tmp/{prefix}-{role}-lbd.log`.
    pub fn start_in(lab: &Lab, role: &str, config: &Path, socket: &Path) -> anyhow::Result<Self> {
        Self::start_at(lab, role, &lab.spec.bin_dir.join("lbd"), config, socket)
    }

    fn start_at(lab: &Lab, role: &str, lbd: &Path, config: &Path, socket: &Path) -> anyhow::Result<Self> {
        let bin_dir = lab.spec.bin_dir.clone();
        let lbd = lbd.to_path_buf();
        if !lbd.exists() {
            bail!("{} not found: build the workspace binaries first (cargo xtask test does)", lbd.display());
        }
        let log = if role == "gw" {
            PathBuf::from(format!("/tmp/{}-lbd.log", lab.spec.prefix))
        } else {
            PathBuf::from(format!("/tmp/{}-{role}-lbd.log", lab.spec.prefix))
        };
        // Appended to: a restarted lbd's log follows the previous one's.
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let child = lab
            .cmd(role, &lbd)
            .arg("--config")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .context("starting lbd")?;
        let mut me = Self { child: Some(child), socket: socket.to_owned(), log, bin_dir };
        let what = format!("answering on {}", socket.display());
        if let Err(e) = me.wait_working(&what, |me| me.lbctl(&["status", "--json"]).ok()) {
            let status = me.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            return Err(match status {
                Some(status) => e.context(format!("lbd exited during start-up with {status}")),
                None => e,
            });
        }
        Ok(me)
    }

    /// Poll `f` every 100 ms until it returns Some, while lbd works
    /// towards it: fails when lbd exits, when it has used no CPU and
    /// logged nothing for [`STALL`], or after [`WORKING_LIMIT`] in all.
    /// `what` names the awaited state in the error.
    fn wait_working<T>(&self, what: &str, mut f: impl FnMut(&Self) -> Option<T>) -> anyhow::Result<T> {
        let pid = self.pid().context("lbd already stopped")?;
        let mut progress = Progress::new(pid, &self.log);
        let started = Instant::now();
        loop {
            if let Some(v) = f(self) {
                return Ok(v);
            }
            let Some(idle) = progress.idle() else {
                bail!("lbd exited before {what}; log:\n{}", self.log_text());
            };
            if idle > STALL {
                bail!(
                    "lbd stuck before {what}: no CPU time used and no log line for {} s; log:\n{}",
                    idle.as_secs(),
                    self.log_text()
                );
            }
            if started.elapsed() > WORKING_LIMIT {
                bail!("lbd still not {what} after {} s of work; log:\n{}", WORKING_LIMIT.as_secs(), self.log_text());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Run lbctl with `args` against this lbd; stdout on success.
    pub fn lbctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(self.bin_dir.join("lbctl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .context("running lbctl")?;
        if !out.status.success() {
            bail!("lbctl {args:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// `lbctl status --json`, parsed.
    pub fn status(&self) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_str(&self.lbctl(&["status", "--json"])?)?)
    }

    /// One backend of one service in a `lbctl status --json` document.
    pub fn backend<'a>(status: &'a serde_json::Value, service: &str, address: &str) -> Option<&'a serde_json::Value> {
        status["services"].as_array()?.iter().find(|s| s["name"] == service)?["backends"]
            .as_array()?
            .iter()
            .find(|b| b["address"] == address)
    }

    /// New-flow counter of one backend of one service, from `lbctl status`.
    pub fn new_flows(status: &serde_json::Value, service: &str, address: &str) -> Option<u64> {
        Self::backend(status, service, address)?["new_flows"].as_u64()
    }

    /// New flows of every backend of every service, now.
    pub fn total_new_flows(&self) -> u64 {
        let s = self.status().expect("lbctl status");
        s["services"]
            .as_array()
            .expect("services")
            .iter()
            .flat_map(|svc| svc["backends"].as_array().expect("backends"))
            .map(|b| b["new_flows"].as_u64().unwrap_or(0))
            .sum()
    }

    /// A backend's state (`up`, `down`, `drain`, ...) now, from `lbctl
    /// status`; empty when lbd does not list it. Panics when lbctl fails.
    pub fn backend_state(&self, service: &str, address: &str) -> String {
        let status = self.status().expect("lbctl status --json");
        Self::backend(&status, service, address).and_then(|b| b["state"].as_str()).unwrap_or_default().to_owned()
    }

    /// Send `signal` to lbd (the process inside the namespace: `ip netns
    /// exec` execs it, so the child's pid is lbd's).
    pub fn signal(&self, signal: i32) -> anyhow::Result<()> {
        let pid = self.child.as_ref().context("lbd already stopped")?.id();
        // SAFETY: plain kill(2) on our own child.
        if unsafe { libc::kill(pid as i32, signal) } != 0 {
            bail!("kill({pid}, {signal}): {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// SIGKILL, as a crash would: no cleanup runs; the pinned datapath stays.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else { bail!("lbd already stopped") };
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// lbd's global counters as one line, for a failure message (empty
    /// when lbd does not answer).
    pub fn counters_text(&self) -> String {
        self.status().map(|st| st["counters"].to_string()).unwrap_or_default()
    }

    /// XDP program id lbd reports (changes with every restart/upgrade).
    pub fn program_id(&self) -> Option<u64> {
        self.status().ok()?["program_id"].as_u64()
    }

    /// Graceful restart (SIGUSR2: lbd re-executes itself, same pid) and
    /// wait until the new instance answers with a new program id.
    /// Waits while lbd works (see `wait_working`): a restart verifies
    /// the programs again and may migrate the pinned maps.
    pub fn restart(&self) -> anyhow::Result<u64> {
        let before = self.program_id().context("no program id before restart")?;
        self.signal(libc::SIGUSR2)?;
        self.wait_working("back with a new program after SIGUSR2", |me| me.program_id().filter(|&id| id != before))
    }

    /// SIGTERM and wait for the exit status. lbd acts on SIGTERM once its
    /// start is over, so the wait lasts while lbd works, as a start's
    /// does (`wait_working`); then SIGKILL, and the control socket lbd
    /// had no chance to remove is removed.
    pub fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        let pid = self.pid().context("lbd already stopped")?;
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        // Ends in an error either way: lbd exited, or it did not.
        let waited = self.wait_working("exiting after SIGTERM", |_| None::<()>).expect_err("never Some");
        let mut child = self.child.take().context("lbd already stopped")?;
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_file(&self.socket);
        Err(waited)
    }
}

impl Drop for Lbd {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

/// Start the lbd binary `lbd` with `config` in the lab's gateway and kill
/// it (SIGKILL) the moment every one of `paths` exists (pins it makes as
/// it starts): an lbd that dies part-way through its start. Panics if
/// they never all appear.
pub fn kill_once_pinned(lab: &Lab, lbd: &Path, config: &Path, paths: &[PathBuf]) {
    let mut child = lab.cmd("gw", lbd).arg("--config").arg(config).stderr(Stdio::null()).spawn().expect("lbd");
    let seen = wait_for(20, || paths.iter().all(|p| p.exists()).then_some(()));
    child.kill().expect("kill lbd");
    child.wait().expect("reap lbd");
    assert!(seen.is_some(), "lbd never pinned all of {paths:?}");
}

/// The layout version held by the `LAYOUT` map pinned in `maps` (0: an
/// lbd pinned it and never wrote it).
pub fn pinned_layout(maps: &Path) -> u32 {
    u32::try_from(pinned_value(maps, "LAYOUT")).expect("a u32")
}

/// The flow tables' hash seed held by the `FLOW_SEED` map pinned in
/// `maps` (layout 4 on).
pub fn pinned_seed(maps: &Path) -> u64 {
    pinned_value(maps, "FLOW_SEED")
}

/// The first value (4 or 8 bytes) of the array map `name` pinned in `maps`.
fn pinned_value(maps: &Path, name: &str) -> u64 {
    pinned_words(maps, name)[0]
}

/// Every value (4 or 8 bytes each) of the array map `name` pinned in
/// `maps`, in index order.
pub fn pinned_words(maps: &Path, name: &str) -> Vec<u64> {
    let out =
        Command::new("bpftool").args(["-j", "map", "dump", "pinned"]).arg(maps.join(name)).output().expect("bpftool");
    assert!(out.status.success(), "bpftool map dump {name}: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    let entries = v.as_array().unwrap_or_else(|| panic!("{name} dump: {v}"));
    entries.iter().map(|e| word(name, &e["value"])).collect()
}

/// The connection counts (`lb_common::Conns`: opened, closed) the array
/// `name` pinned in `maps` holds, summed over its entries and, for a
/// per-CPU array, over every CPU's copy.
pub fn pinned_conns(maps: &Path, name: &str) -> (u64, u64) {
    let out =
        Command::new("bpftool").args(["-j", "map", "dump", "pinned"]).arg(maps.join(name)).output().expect("bpftool");
    assert!(out.status.success(), "bpftool map dump {name}: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    let entries = v.as_array().unwrap_or_else(|| panic!("{name} dump: {v}"));
    let values = entries.iter().flat_map(|e| match e["values"].as_array() {
        Some(per_cpu) => per_cpu.iter().map(|c| &c["value"]).collect::<Vec<_>>(),
        None => vec![&e["value"]],
    });
    let mut sum = (0, 0);
    for value in values {
        let bytes = hex_bytes(name, value);
        assert_eq!(bytes.len(), 16, "{name} value of {bytes:?}");
        sum.0 += u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        sum.1 += u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes"));
    }
    sum
}

/// The name of each array the pinned array of maps `name` holds (by
/// `bpftool map show`), in the order of its entries; entries without one
/// are not listed.
pub fn pinned_inner_names(maps: &Path, name: &str) -> Vec<String> {
    let ids = pinned_words(maps, name);
    let out = Command::new("bpftool").args(["-j", "map", "show"]).output().expect("bpftool");
    assert!(out.status.success(), "bpftool map show: {}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    let names: std::collections::HashMap<u64, &str> = all
        .as_array()
        .expect("bpftool map show: a list")
        .iter()
        .filter_map(|m| Some((m["id"].as_u64()?, m["name"].as_str().unwrap_or(""))))
        .collect();
    ids.iter().map(|id| names.get(id).map_or_else(|| format!("(no map {id})"), |n| (*n).to_owned())).collect()
}

/// One value of a bpftool dump: a number when the map has BTF, else its
/// bytes as hex strings.
/// A map value as `bpftool -j` prints it without BTF: hex bytes.
fn hex_bytes(name: &str, value: &serde_json::Value) -> Vec<u8> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("{name} dump: {value}"))
        .iter()
        .map(|b| u8::from_str_radix(b.as_str().expect("hex byte").trim_start_matches("0x"), 16).expect("hex byte"))
        .collect()
}

fn word(name: &str, value: &serde_json::Value) -> u64 {
    if let Some(n) = value.as_u64() {
        return n;
    }
    let mut bytes = hex_bytes(name, value);
    assert!(matches!(bytes.len(), 4 | 8), "{name} value of {bytes:?}");
    bytes.resize(8, 0);
    u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
}

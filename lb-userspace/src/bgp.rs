//! VIP announcement over BGP, by a real BGP daemon: lbd runs BIRD 2 as its
//! child, writes its whole configuration (one static route per VIP to
//! announce, one BGP session per peer) and asks it to reload through its
//! control socket whenever the set of VIPs to announce changes.
//!
//! How a peer learns that lbd is gone:
//! - lbd stops (SIGTERM, SIGINT): dropping the [`Speaker`] sends BIRD
//!   SIGTERM, and BIRD closes its sessions with a Cease notification; the
//!   peers withdraw our routes at once.
//! - lbd dies (SIGKILL, a crash): BIRD was started with the parent-death
//!   signal set to SIGTERM, so the kernel stops it the moment lbd's thread
//!   that started it ends, with the same result. That thread is lbd's main
//!   thread (the announcer runs there), which lives as long as lbd.
//! - lbd restarts (SIGUSR2, an upgrade): the speaker is kept
//!   ([`Speaker::keep`]), BIRD keeps its sessions and routes while lbd
//!   execs itself (same process, same main thread: no parent-death
//!   signal), and the new lbd adopts it ([`Speaker::adopt`]).
//! - The node dies or is cut off: nothing closes the sessions, and the
//!   peers withdraw when the hold time (`bgp.hold_time`) runs out.
//!
//! BIRD never installs a route in this node's kernel: the VIPs are
//! `blackhole` static routes inside BIRD only, exported to the peers with
//! our own address (or `next_hop`) as the next hop.
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::UnixStream,
};

use crate::config::BgpConfig;

/// How long BIRD may take to open its control socket after starting.
const START_TIMEOUT: Duration = Duration::from_secs(5);
/// One control-socket exchange (a reconfiguration is quick: a few routes).
const CTL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BgpError {
    #[error("starting {daemon}: {source}")]
    Spawn { daemon: PathBuf, source: std::io::Error },
    #[error("BIRD exited ({0}); its log is lbd's log")]
    Exited(String),
    #[error("writing the BIRD configuration {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("BIRD control socket {path}: {message}")]
    Control { path: PathBuf, message: String },
}

/// One BGP session as BIRD reports it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PeerStatus {
    pub address: IpAddr,
    pub asn: u32,
    /// BIRD's BGP state: `Established` when up, else `Idle`, `Connect`,
    /// `Active`, `OpenSent`, `OpenConfirm` (or `unknown`).
    pub state: String,
}

/// Announcement state for the status report and the metrics.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BgpStatus {
    pub peers: Vec<PeerStatus>,
    /// VIPs BIRD originates now (whether any session is up or not).
    pub originated: BTreeSet<IpAddr>,
    /// The last failure to drive BIRD, if the last attempt failed.
    pub error: Option<String>,
}

impl BgpStatus {
    /// Is `vip` announced: originated, and sent on at least one
    /// established session of its family?
    pub fn announced(&self, vip: IpAddr) -> bool {
        self.originated.contains(&vip)
            && self.peers.iter().any(|p| p.state == "Established" && p.address.is_ipv4() == vip.is_ipv4())
    }
}

/// BIRD's whole configuration for `cfg`, announcing `vips`.
pub fn bird_config(cfg: &BgpConfig, vips: &BTreeSet<IpAddr>) -> String {
    let mut s = String::from("# Written by lbd, rewritten at every change: edit lbd's bgp: section instead.\n");
    writeln!(s, "router id {};", cfg.router_id).unwrap();
    // BIRD runs in the foreground with lbd: its log goes to lbd's stderr.
    s.push_str("log stderr { info, remote, warning, error, auth, fatal, bug };\n");
    s.push_str("protocol device { }\n");
    for (name, family, v4) in [("lbd_vips4", "ipv4", true), ("lbd_vips6", "ipv6", false)] {
        writeln!(s, "protocol static {name} {{\n  {family};").unwrap();
        for vip in vips.iter().filter(|v| v.is_ipv4() == v4) {
            let len = if v4 { 32 } else { 128 };
            writeln!(s, "  route {vip}/{len} blackhole;").unwrap();
        }
        s.push_str("}\n");
    }
    s.push_str("filter lbd_export {\n  if proto = \"lbd_vips4\" || proto = \"lbd_vips6\" then {\n");
    for c in &cfg.communities {
        if let Some((a, b)) = c.split_once(':') {
            writeln!(s, "    bgp_community.add(({a}, {b}));").unwrap();
        }
    }
    if let Some(med) = cfg.med {
        writeln!(s, "    bgp_med = {med};").unwrap();
    }
    s.push_str("    accept;\n  }\n  reject;\n}\n");
    for (i, p) in cfg.peers.iter().enumerate() {
        let family = if p.address.is_ipv4() { "ipv4" } else { "ipv6" };
        let next_hop = match cfg.next_hop {
            Some(nh) if nh.is_ipv4() == p.address.is_ipv4() => format!("next hop address {nh}"),
            _ => "next hop self".to_owned(),
        };
        writeln!(
            s,
            "protocol bgp {} {{\n  local as {};\n  neighbor {} as {};\n  hold time {};\n  keepalive time {};\n  {family} {{ import none; export filter lbd_export; {next_hop}; }};\n}}",
            peer_protocol(i),
            cfg.local_asn,
            p.address,
            p.asn,
            cfg.hold_time,
            (cfg.hold_time / 3).max(1),
        )
        .unwrap();
    }
    s
}

/// BIRD's name for the session with peer number `i`.
fn peer_protocol(i: usize) -> String {
    format!("lbd_peer{i}")
}

/// The states of a BGP session (RFC 4271), and BIRD's `Down` for one
/// that is shut.
const BGP_STATES: &[&str] = &["Idle", "Connect", "Active", "OpenSent", "OpenConfirm", "Established", "Down"];

/// The BGP state of each of `cfg`'s peers in BIRD's `show protocols`
/// output (`unknown` when missing).
pub fn parse_protocols(cfg: &BgpConfig, out: &str) -> Vec<PeerStatus> {
    cfg.peers
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let name = peer_protocol(i);
            // "lbd_peer0  BGP  ---  up  12:00:00.000  Established": the
            // BGP state is the first word of the info column (the time
            // before it may be one word or two, by BIRD's time format).
            let state = out
                .lines()
                .map(|l| l.trim_start_matches(|c: char| c.is_ascii_digit() || c == '-' || c == ' '))
                .find(|l| l.split_whitespace().next() == Some(name.as_str()))
                .and_then(|l| l.split_whitespace().skip(4).find(|w| BGP_STATES.contains(w)))
                .unwrap_or("unknown")
                .to_owned();
            PeerStatus { address: p.address, asn: p.asn, state }
        })
        .collect()
}

/// A running BIRD of ours: our child process, by pid (an adopted one has
/// no `Child` handle: the lbd that started it was this very process before
/// it exec'd itself).
pub struct Speaker {
    pid: Pid,
    conf: PathBuf,
    ctl: PathBuf,
    /// Left running when dropped (a restart hands it to the next lbd).
    keep: bool,
    /// Running a configuration we did not write (adopted): rewrite it.
    stale: bool,
    /// What BIRD runs with now.
    pub cfg: BgpConfig,
    pub vips: BTreeSet<IpAddr>,
}

/// The files of the BIRD of an lbd whose control socket is `base`:
/// configuration, control socket, pid file.
fn files(base: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let with = |ext: &str| {
        let mut p = base.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    (with(".bird.conf"), with(".bird.ctl"), with(".bird.pid"))
}

/// The parent of process `pid`, from /proc (none if it is gone).
fn parent_of(pid: Pid) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero())).ok()?;
    // "pid (comm) state ppid ...": the command may hold spaces and parentheses.
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

impl Speaker {
    /// Start BIRD with `cfg` announcing `vips`; its files are `base` with
    /// `.bird.conf`, `.bird.ctl` and `.bird.pid` appended (beside lbd's
    /// control socket, so that several lbd on one host keep apart).
    ///
    /// Call it from lbd's main thread: the parent-death signal follows the
    /// thread that forks.
    pub async fn start(cfg: &BgpConfig, vips: &BTreeSet<IpAddr>, base: &Path) -> Result<Self, BgpError> {
        let (conf, ctl, pidfile) = files(base);
        write_atomic(&conf, &bird_config(cfg, vips))?;
        let _ = std::fs::remove_file(&ctl);
        let parent = rustix::process::getpid();
        let mut cmd = std::process::Command::new(&cfg.daemon);
        cmd.arg("-f").arg("-c").arg(&conf).arg("-s").arg(&ctl).arg("-P").arg(&pidfile);
        cmd.stdin(std::process::Stdio::null());
        // SAFETY: only async-signal-safe system calls run in the child
        // between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
                // lbd may have died before the line above: then nobody would.
                if rustix::process::getppid() != Some(parent) {
                    return Err(std::io::Error::other("lbd exited while starting BIRD"));
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| BgpError::Spawn { daemon: cfg.daemon.clone(), source })?;
        let pid = Pid::from_child(&child);
        // Reaped by pid (`exited`); the handle itself neither kills nor waits.
        drop(child);
        let mut sp = Self { pid, conf, ctl, keep: false, stale: false, cfg: cfg.clone(), vips: vips.clone() };
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = sp.exited() {
                sp.keep = true; // nothing left to stop
                return Err(BgpError::Exited(status));
            }
            match sp.command("show status").await {
                Ok(_) => return Ok(sp),
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// The BIRD a previous lbd of this very process (before a restart's
    /// exec) left running for `base`, if it is there, ours, and answers.
    /// It runs the configuration it had; [`set`](Self::set) brings it up
    /// to date. A BIRD at `base` that is not our child (left by another
    /// process) is stopped, and none is adopted.
    pub async fn adopt(cfg: &BgpConfig, base: &Path) -> Option<Self> {
        let (conf, ctl, pidfile) = files(base);
        let raw: i32 = std::fs::read_to_string(&pidfile).ok()?.trim().parse().ok()?;
        let pid = Pid::from_raw(raw)?;
        if parent_of(pid) != Some(rustix::process::getpid().as_raw_nonzero().get()) {
            if std::fs::read_to_string(format!("/proc/{raw}/comm")).is_ok_and(|c| c.trim() == "bird") {
                let _ = rustix::process::kill_process(pid, Signal::TERM);
            }
            return None;
        }
        let sp = Self { pid, conf, ctl, keep: false, stale: true, cfg: cfg.clone(), vips: BTreeSet::new() };
        if sp.command("show status").await.is_err() {
            return None; // dropped: stopped
        }
        Some(sp)
    }

    /// Leave BIRD running when this is dropped (a graceful restart: the
    /// next lbd adopts it).
    pub fn keep(&mut self) {
        self.keep = true;
    }

    /// Has BIRD exited? (How, if so: it is reaped.)
    pub fn exited(&mut self) -> Option<String> {
        match rustix::process::waitpid(Some(self.pid), rustix::process::WaitOptions::NOHANG) {
            Ok(Some((_, status))) => Some(format!("{status:?}")),
            Ok(None) => None,
            Err(e) => Some(format!("not our child any more ({e})")),
        }
    }

    /// Make BIRD run `cfg` announcing `vips` (nothing to do when it does).
    pub async fn set(&mut self, cfg: &BgpConfig, vips: &BTreeSet<IpAddr>) -> Result<(), BgpError> {
        if !self.stale && &self.cfg == cfg && &self.vips == vips {
            return Ok(());
        }
        write_atomic(&self.conf, &bird_config(cfg, vips))?;
        self.command("configure").await?;
        self.cfg = cfg.clone();
        self.vips = vips.clone();
        self.stale = false;
        Ok(())
    }

    /// Each peer's session state.
    pub async fn peers(&self) -> Result<Vec<PeerStatus>, BgpError> {
        let out = self.command("show protocols").await?;
        Ok(parse_protocols(&self.cfg, &out))
    }

    /// One command on BIRD's control socket: its reply, or the error BIRD
    /// gave (reply codes 8000 and up).
    async fn command(&self, cmd: &str) -> Result<String, BgpError> {
        let err = |message: String| BgpError::Control { path: self.ctl.clone(), message };
        let exchange = async {
            let stream = UnixStream::connect(&self.ctl).await.map_err(|e| err(e.to_string()))?;
            let (rd, mut wr) = stream.into_split();
            let mut lines = BufReader::new(rd).lines();
            // The greeting: "0001 BIRD 2.0.12 ready."
            read_reply(&mut lines).await.map_err(err)?;
            wr.write_all(format!("{cmd}\n").as_bytes()).await.map_err(|e| err(e.to_string()))?;
            read_reply(&mut lines).await.map_err(err)
        };
        tokio::time::timeout(CTL_TIMEOUT, exchange).await.map_err(|_| err(format!("{cmd:?} timed out")))?
    }
}

impl Drop for Speaker {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        // SIGTERM: BIRD closes its sessions with a notification, so the
        // peers withdraw at once (SIGKILL would leave it to TCP). Reaped
        // if it goes at once (lbd is exiting; else init reaps it).
        let _ = rustix::process::kill_process(self.pid, Signal::TERM);
        for _ in 0..20 {
            if self.exited().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_file(&self.conf);
    }
}

/// Read one reply: lines `CODE-text` (more follow), ` text` (continued),
/// up to `CODE text` (the last). Codes 8000 and up are errors.
async fn read_reply(
    lines: &mut tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
) -> Result<String, String> {
    let mut out = String::new();
    loop {
        let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? else {
            return Err(format!("connection closed (so far: {out:?})"));
        };
        out.push_str(&line);
        out.push('\n');
        let code = line.get(..4).and_then(|c| c.parse::<u32>().ok());
        if let Some(code) = code
            && line.as_bytes().get(4) == Some(&b' ')
        {
            return if code >= 8000 { Err(out.trim_end().to_owned()) } else { Ok(out) };
        }
    }
}

/// The project's atomic replace ([`crate::render::write_atomic`]), its
/// error naming the BIRD configuration.
fn write_atomic(path: &Path, text: &str) -> Result<(), BgpError> {
    crate::render::write_atomic(path, text).map_err(|source| BgpError::Write { path: path.to_owned(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BgpPeer;

    fn cfg() -> BgpConfig {
        BgpConfig {
            local_asn: 65001,
            router_id: "10.40.1.2".parse().unwrap(),
            peers: vec![
                BgpPeer { address: "10.40.1.1".parse().unwrap(), asn: 65000 },
                BgpPeer { address: "fd00:40::1".parse().unwrap(), asn: 65000 },
            ],
            next_hop: Some("10.40.1.2".parse().unwrap()),
            communities: vec!["65001:100".into()],
            med: Some(10),
            hold_time: 9,
            daemon: "/usr/sbin/bird".into(),
        }
    }

    #[test]
    fn config_announces_each_vip_to_its_family() {
        let vips: BTreeSet<IpAddr> = ["10.10.0.100", "fd00:10::100"].iter().map(|s| s.parse().unwrap()).collect();
        let c = bird_config(&cfg(), &vips);
        assert!(c.contains("router id 10.40.1.2;"), "{c}");
        assert!(c.contains("route 10.10.0.100/32 blackhole;"), "{c}");
        assert!(c.contains("route fd00:10::100/128 blackhole;"), "{c}");
        assert!(c.contains("bgp_community.add((65001, 100));") && c.contains("bgp_med = 10;"), "{c}");
        assert!(c.contains("neighbor 10.40.1.1 as 65000;") && c.contains("local as 65001;"), "{c}");
        assert!(c.contains("ipv4 { import none; export filter lbd_export; next hop address 10.40.1.2; };"), "{c}");
        // The IPv6 session has no IPv6 next hop configured: its own address.
        assert!(c.contains("ipv6 { import none; export filter lbd_export; next hop self; };"), "{c}");
        assert!(c.contains("hold time 9;") && c.contains("keepalive time 3;"), "{c}");
        let none = bird_config(&cfg(), &BTreeSet::new());
        assert!(!none.contains("route "), "{none}");
    }

    #[test]
    fn protocol_states_are_read_per_peer() {
        let out = "0001 BIRD 2.0.12 ready.\n2002-Name       Proto      Table      State  Since         Info\n1002-device1    Device     ---        up     12:00:00.000  \n lbd_peer0  BGP        ---        up     12:00:01.000  Established   \n lbd_peer1  BGP        ---        start  12:00:01.000  Active        Socket: Connection refused\n0000 \n";
        let p = parse_protocols(&cfg(), out);
        assert_eq!(p[0].state, "Established");
        assert_eq!(p[1].state, "Active");
        let mut s = BgpStatus { peers: p, originated: BTreeSet::new(), error: None };
        let v4: IpAddr = "10.10.0.100".parse().unwrap();
        let v6: IpAddr = "fd00:10::100".parse().unwrap();
        assert!(!s.announced(v4), "not originated");
        s.originated.extend([v4, v6]);
        assert!(s.announced(v4));
        assert!(!s.announced(v6), "the IPv6 session is not established");
    }
}

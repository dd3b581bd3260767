//! The configuration file: parse and validate, reporting every problem at
//! once as `file: field: problem`.
//!
//! The YAML is read into a generic value tree and walked by hand instead of
//! deserialised straight into structs: serde stops at the first type error,
//! and an operator fixing a config wants the whole list in one go.
use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use yaml_serde::{Mapping, Value};

use crate::sched::{Pool, Scheduler, maglev};

mod walker;

use walker::Walker;

pub const DEFAULT_CONTROL_SOCKET: &str = "/run/lbd/lbd.sock";
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/lbd";
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_CONNTRACK_MAX: u32 = 1_048_576;
/// Upper bound for `conntrack_max` (one LRU entry per connection; two for
/// a service whose backend endpoint another service owns).
pub const MAX_CONNTRACK: u32 = 1 << 26;
/// Entries of the selection-table array when the config does not say.
pub const DEFAULT_TABLE_CAPACITY: u32 = 1 << 22;
pub const MAX_WEIGHT: u32 = 65_535;
pub const DEFAULT_TCP_IDLE_TIMEOUT: u32 = 900;
pub const DEFAULT_UDP_IDLE_TIMEOUT: u32 = 300;
/// Seconds of silence after which a half-open flow (one whose handshake
/// never completed: a SYN flood's) expires.
pub const DEFAULT_HALF_OPEN_TIMEOUT: u32 = 10;
/// Lowest per-CPU new-flow rate `auto` picks.
pub const AUTO_RATE_FLOOR: u32 = 10_000;

/// Flood protection (`flood:`). New flows above the per-CPU rate, and new
/// flows that find the flow table full, are routed by consistent hash
/// without an entry; established flows are never evicted; half-open flows
/// expire after `half_open_timeout` of silence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FloodConfig {
    /// New flows per second and CPU that get a flow-table entry. None
    /// (`auto`): enough to fill the table with half-open flows once per
    /// `half_open_timeout` across all CPUs, at least [`AUTO_RATE_FLOOR`].
    /// Some(0): no limit.
    pub new_flow_rate_per_cpu: Option<u32>,
    pub half_open_timeout: u32,
}

impl Default for FloodConfig {
    fn default() -> Self {
        Self { new_flow_rate_per_cpu: None, half_open_timeout: DEFAULT_HALF_OPEN_TIMEOUT }
    }
}

impl FloodConfig {
    /// The per-CPU rate in force (0: no limit) for a table of
    /// `conntrack_max` entries on `ncpus` CPUs.
    pub fn rate_per_cpu(&self, conntrack_max: u32, ncpus: usize) -> u32 {
        self.new_flow_rate_per_cpu.unwrap_or_else(|| {
            let per_cpu = u64::from(conntrack_max) / u64::from(self.half_open_timeout.max(1)) / ncpus.max(1) as u64;
            u32::try_from(per_cpu).unwrap_or(u32::MAX).max(AUTO_RATE_FLOOR)
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    Native,
    Generic,
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => lb_common::PROTO_TCP,
            Self::Udp => lb_common::PROTO_UDP,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        })
    }
}

/// How a service's packets reach its backends (`forwarding:`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Forwarding {
    /// Destination rewritten to the backend, replies rewritten back to the
    /// VIP on their way through the balancer.
    #[default]
    Nat,
    /// L2 direct server return: only the destination MAC changes; the
    /// backend holds the VIP and answers the client directly.
    Dsr,
}

impl fmt::Display for Forwarding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Nat => "nat",
            Self::Dsr => "dsr",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendConfig {
    /// IPv4 or IPv6, the family of its service's VIP.
    pub address: IpAddr,
    pub port: u16,
    pub weight: u32,
    /// Administratively drained: no new flows, existing ones continue;
    /// the weight is kept for when it is enabled again.
    pub drain: bool,
}

impl BackendConfig {
    /// The weight the schedulers use before health and slow start.
    pub fn admin_weight(&self) -> u32 {
        if self.drain { 0 } else { self.weight }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// No probing: every backend counts as up.
    None,
    /// A TCP connect to the backend.
    Tcp,
    /// An HTTP GET whose status must fall in `expect`.
    Http,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HealthConfig {
    pub kind: ProbeKind,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes that bring a down backend back.
    pub rise: u32,
    /// Consecutive failures that take an up backend out.
    pub fall: u32,
    /// HTTP path (http probes).
    pub path: String,
    /// Accepted HTTP status range, inclusive (http probes).
    pub expect: (u16, u16),
    /// Probe this port instead of the backend's own.
    pub port: Option<u16>,
    /// Text the HTTP response body must contain (http probes).
    pub body: Option<String>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            kind: ProbeKind::None,
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            rise: 2,
            fall: 3,
            path: "/".into(),
            expect: (200, 399),
            port: None,
            body: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceConfig {
    pub name: String,
    /// IPv4 or IPv6: a service is one address family.
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    #[serde(default)]
    pub forwarding: Forwarding,
    pub scheduler: Scheduler,
    /// Maglev table size (a prime).
    pub table_size: u32,
    pub health: HealthConfig,
    /// A backend that comes up (or is added) ramps its weight from a small
    /// value to the configured one over this long.
    pub slow_start: Option<Duration>,
    /// Seconds without a packet after which a UDP flow of this service
    /// expires (None: the global `udp_idle_timeout`).
    pub udp_idle_timeout: Option<u32>,
    pub backends: Vec<BackendConfig>,
}

impl ServiceConfig {
    /// A Maglev TCP service (table 65,537, no health checks, no slow
    /// start): unit tests, the datapath fixture, the benchmark.
    pub fn example(name: &str, vip: impl Into<IpAddr>, port: u16, backends: Vec<BackendConfig>) -> Self {
        Self {
            name: name.into(),
            vip: vip.into(),
            port,
            protocol: Protocol::Tcp,
            forwarding: Forwarding::Nat,
            scheduler: Scheduler::Maglev,
            table_size: 65537,
            health: HealthConfig::default(),
            slow_start: None,
            udp_idle_timeout: None,
            backends,
        }
    }
}

/// Where lbd's BGP daemon (BIRD) lives when the config does not say.
pub const DEFAULT_BGP_DAEMON: &str = "/usr/sbin/bird";
/// BGP hold time (seconds) when the config does not say: how long a peer
/// keeps our routes after the node goes silent without closing its
/// sessions (power loss). A stopped or killed lbd closes them at once.
pub const DEFAULT_BGP_HOLD_TIME: u32 = 90;

/// VIP announcement over BGP (`bgp:`): lbd runs BIRD as its child and has
/// it announce each VIP while one of the VIP's services has a healthy
/// backend. Written back to the file in this very form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgpConfig {
    pub local_asn: u32,
    pub router_id: std::net::Ipv4Addr,
    /// Each IPv4 peer learns the IPv4 VIPs, each IPv6 peer the IPv6 ones.
    pub peers: Vec<BgpPeer>,
    /// The next hop announced (default: the address of our end of each
    /// session). Applies to the peers of its family.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_hop: Option<IpAddr>,
    /// Standard communities `ASN:VALUE` attached to every announcement.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub communities: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub med: Option<u32>,
    /// Seconds (3-65535), see [`DEFAULT_BGP_HOLD_TIME`].
    pub hold_time: u32,
    /// The BIRD 2 binary.
    pub daemon: PathBuf,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgpPeer {
    pub address: IpAddr,
    pub asn: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    pub interfaces: Vec<String>,
    pub xdp_mode: XdpMode,
    pub control_socket: PathBuf,
    /// bpffs directory where the datapath (maps, links) is pinned so that
    /// it outlives lbd and a restarted lbd adopts it.
    pub pin_path: PathBuf,
    pub conntrack_max: u32,
    /// Flows the IPv6 flow table holds (`conntrack_max_ipv6`; default:
    /// `conntrack_max`). Its slots are 120 bytes against IPv4's 80, all
    /// allocated at start: an IPv4-only gateway can make it small.
    pub conntrack_max_ipv6: u32,
    pub table_capacity: u32,
    /// Mixed into every Maglev table's permutations (`maglev_seed`, default
    /// 0: the keys as they ever were). Nodes sharing one ECMP route must
    /// use the same value to build the same tables.
    pub maglev_seed: u64,
    /// Seconds without a packet after which an open TCP flow expires.
    pub tcp_idle_timeout: u32,
    /// Seconds without a packet after which a UDP flow expires.
    pub udp_idle_timeout: u32,
    pub flood: FloodConfig,
    /// Where the Prometheus exporter listens (path /metrics).
    pub metrics_listen: std::net::SocketAddr,
    /// VIP announcement over BGP; none: lbd announces nothing.
    pub bgp: Option<BgpConfig>,
    pub services: Vec<ServiceConfig>,
}

impl Config {
    /// Keys that only take effect when lbd starts (a reload that changes
    /// them is refused rather than half-applied).
    pub fn restart_only_changes(&self, new: &Self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.interfaces != new.interfaces {
            v.push("interfaces");
        }
        if self.xdp_mode != new.xdp_mode {
            v.push("xdp_mode");
        }
        if self.control_socket != new.control_socket {
            v.push("control_socket");
        }
        if self.pin_path != new.pin_path {
            v.push("pin_path");
        }
        if self.metrics_listen != new.metrics_listen {
            v.push("metrics_listen");
        }
        if self.conntrack_max != new.conntrack_max {
            v.push("conntrack_max");
        }
        if self.conntrack_max_ipv6 != new.conntrack_max_ipv6 {
            v.push("conntrack_max_ipv6");
        }
        if self.table_capacity != new.table_capacity {
            v.push("table_capacity");
        }
        v
    }
}

/// One problem found in a config: where and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: String,
    pub field: String,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.file, self.field, self.reason)
    }
}

/// Every problem found in a config file.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// Checks that depend on the machine, not the file; tests replace them.
pub trait Environment {
    /// Does a network interface with this name exist?
    fn interface_exists(&self, name: &str) -> bool;
}

/// The real machine.
pub struct System;

impl Environment for System {
    fn interface_exists(&self, name: &str) -> bool {
        let Ok(c) = std::ffi::CString::new(name) else {
            return false;
        };
        // SAFETY: a valid NUL-terminated string.
        unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
    }
}

/// Read and validate a config file.
pub fn load(path: &Path, env: &dyn Environment) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        problems: vec![Problem { file: file.clone(), field: "(file)".into(), reason: format!("cannot read: {e}") }],
    })?;
    parse(&text, &file, env)
}

/// Parse and validate config text; `file` names it in problems.
pub fn parse(text: &str, file: &str, env: &dyn Environment) -> Result<Config, ConfigError> {
    let mut w = Walker { file, problems: Vec::new() };
    let root: Value = match yaml_serde::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            let at = e.location().map(|l| format!("line {} column {}", l.line(), l.column()));
            w.problem(at.as_deref().unwrap_or("(document)"), format!("not valid YAML: {e}"));
            return Err(ConfigError { problems: w.problems });
        }
    };
    let cfg = w.config(&root, env);
    match cfg {
        Some(cfg) if w.problems.is_empty() => Ok(cfg),
        _ => {
            if w.problems.is_empty() {
                w.problem("(document)", "invalid configuration".into());
            }
            Err(ConfigError { problems: w.problems })
        }
    }
}

/// `500ms`, `2s`, `1.5s`, `1m`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().ok()?;
    if !v.is_finite() || v < 0.0 {
        return None;
    }
    Some(Duration::from_secs_f64(v * mult))
}

/// `200` or `200-399`.
pub fn parse_status_range(s: &str) -> Option<(u16, u16)> {
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
        None => {
            let v = s.trim().parse().ok()?;
            (v, v)
        }
    };
    ((100..=599).contains(&a) && (100..=599).contains(&b) && a <= b).then_some((a, b))
}

/// Entries the selection tables of `s` take: its own, and its consistent-hash
/// fallback when it needs one.
pub fn table_entries(s: &ServiceConfig) -> u64 {
    let weights: Vec<u32> = s.backends.iter().map(|b| b.weight).collect();
    let measures_response = s.health.kind == ProbeKind::Http;
    let pool = Pool { table_size: s.table_size, weights: &weights, measures_response };
    s.scheduler.table_len(&pool) + s.scheduler.fallback_len(&pool)
}

#[cfg(test)]
pub(crate) mod tests;

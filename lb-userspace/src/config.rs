//! The configuration file: parse and validate, reporting every problem at
//! once as `file: field: problem`.
//!
//! The YAML is read into a generic value tree and walked by hand instead of
//! deserialised straight into structs: serde stops at the first type error,
//! and an operator fixing a config wants the whole list in one go.
use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use yaml_serde::{Mapping, Value};

use crate::sched::{Pool, Scheduler, maglev};

pub const DEFAULT_CONTROL_SOCKET: &str = "/run/lbd/lbd.sock";
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/lbd";
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_CONNTRACK_MAX: u32 = 1_048_576;
/// Upper bound for `conntrack_max` (each connection takes two LRU entries).
pub const MAX_CONNTRACK: u32 = 1 << 26;
/// Entries of the selection-table array when the config does not say.
pub const DEFAULT_TABLE_CAPACITY: u32 = 1 << 22;
pub const MAX_WEIGHT: u32 = 65_535;
pub const DEFAULT_TCP_IDLE_TIMEOUT: u32 = 900;
pub const DEFAULT_UDP_IDLE_TIMEOUT: u32 = 300;

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

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendConfig {
    pub address: Ipv4Addr,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// No probing: every backend counts as up.
    None,
    /// A TCP connect to the backend.
    Tcp,
    /// An HTTP GET whose status must fall in `expect`.
    Http,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceConfig {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
    pub scheduler: Scheduler,
    /// Maglev table size (a prime).
    pub table_size: u32,
    pub health: HealthConfig,
    /// A backend that comes up (or is added) ramps its weight from a small
    /// value to the configured one over this long.
    pub slow_start: Option<Duration>,
    pub backends: Vec<BackendConfig>,
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
    pub table_capacity: u32,
    /// Seconds without a packet after which an open TCP flow expires.
    pub tcp_idle_timeout: u32,
    /// Seconds without a packet after which a UDP flow expires.
    pub udp_idle_timeout: u32,
    /// Where the Prometheus exporter listens (path /metrics).
    pub metrics_listen: std::net::SocketAddr,
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

struct Walker<'a> {
    file: &'a str,
    problems: Vec<Problem>,
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "nothing (null)".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

impl Walker<'_> {
    fn problem(&mut self, field: &str, reason: String) {
        self.problems.push(Problem { file: self.file.to_owned(), field: field.to_owned(), reason });
    }

    /// The mapping at `path`, with every key not in `known` reported.
    fn mapping<'v>(&mut self, v: &'v Value, path: &str, known: &[&str]) -> Option<&'v Mapping> {
        let Value::Mapping(m) = v else {
            self.problem(path, format!("expected a mapping, found {}", describe(v)));
            return None;
        };
        for k in m.keys() {
            match k.as_str() {
                Some(k) if known.contains(&k) => {}
                Some(k) => {
                    let field = if path.is_empty() { k.to_owned() } else { format!("{path}.{k}") };
                    self.problem(&field, format!("unknown key (known keys: {})", known.join(", ")));
                }
                None => self.problem(path, format!("key {} is not a string", describe(k))),
            }
        }
        Some(m)
    }

    fn field(path: &str, key: &str) -> String {
        if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") }
    }

    fn uint(&mut self, v: &Value, field: &str, min: u64, max: u64) -> Option<u64> {
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            Some(n) => {
                self.problem(field, format!("{n} is out of range ({min} to {max})"));
                None
            }
            None => {
                if let Some(n) = v.as_i64() {
                    self.problem(field, format!("{n} is negative; expected a whole number from {min} to {max}"));
                } else {
                    self.problem(field, format!("expected a whole number from {min} to {max}, found {}", describe(v)));
                }
                None
            }
        }
    }

    fn string<'v>(&mut self, v: &'v Value, field: &str) -> Option<&'v str> {
        match v.as_str() {
            Some(s) => Some(s),
            None => {
                self.problem(field, format!("expected a string, found {}", describe(v)));
                None
            }
        }
    }

    fn ipv4(&mut self, v: &Value, field: &str) -> Option<Ipv4Addr> {
        let s = self.string(v, field)?;
        match s.parse::<Ipv4Addr>() {
            Ok(a) if a.is_unspecified() || a.is_broadcast() || a.is_multicast() => {
                self.problem(field, format!("{s} is not a unicast address"));
                None
            }
            Ok(a) => Some(a),
            Err(_) => {
                self.problem(field, format!("{s:?} is not an IPv4 address"));
                None
            }
        }
    }

    fn required<'v>(&mut self, m: &'v Mapping, path: &str, key: &str) -> Option<&'v Value> {
        let v = m.get(key);
        if v.is_none() {
            self.problem(&Self::field(path, key), "missing (required)".into());
        }
        v
    }

    fn config(&mut self, root: &Value, env: &dyn Environment) -> Option<Config> {
        const KEYS: &[&str] = &[
            "interfaces",
            "xdp_mode",
            "forwarding",
            "control_socket",
            "pin_path",
            "conntrack_max",
            "table_capacity",
            "tcp_idle_timeout",
            "udp_idle_timeout",
            "metrics_listen",
            "services",
        ];
        let m = self.mapping(root, "", KEYS)?;

        let mut interfaces = Vec::new();
        if let Some(v) = self.required(m, "", "interfaces") {
            match v.as_sequence() {
                Some(seq) if !seq.is_empty() => {
                    for (i, item) in seq.iter().enumerate() {
                        let field = format!("interfaces[{i}]");
                        let Some(name) = self.string(item, &field) else { continue };
                        if interfaces.iter().any(|n: &String| n == name) {
                            self.problem(&field, format!("interface {name} is listed twice"));
                        } else if !env.interface_exists(name) {
                            self.problem(&field, format!("no network interface named {name:?} exists"));
                        } else {
                            interfaces.push(name.to_owned());
                        }
                    }
                }
                Some(_) => self.problem("interfaces", "the list is empty; name at least one interface".into()),
                None => {
                    self.problem("interfaces", format!("expected a list of interface names, found {}", describe(v)));
                }
            }
        }

        let xdp_mode = match m.get("xdp_mode") {
            None => XdpMode::Auto,
            Some(v) => match self.string(v, "xdp_mode") {
                Some("native") => XdpMode::Native,
                Some("generic") => XdpMode::Generic,
                Some("auto") => XdpMode::Auto,
                Some(other) => {
                    self.problem("xdp_mode", format!("{other:?} is not one of native, generic, auto"));
                    XdpMode::Auto
                }
                None => XdpMode::Auto,
            },
        };

        if let Some(v) = m.get("forwarding") {
            match self.string(v, "forwarding") {
                Some("nat") | None => {}
                Some(other) => self.problem("forwarding", format!("{other:?} is not supported (supported: nat)")),
            }
        }

        let control_socket = match m.get("control_socket") {
            None => PathBuf::from(DEFAULT_CONTROL_SOCKET),
            Some(v) => match self.string(v, "control_socket") {
                Some(s) if s.starts_with('/') => PathBuf::from(s),
                Some(s) => {
                    self.problem("control_socket", format!("{s:?} is not an absolute path"));
                    PathBuf::new()
                }
                None => PathBuf::new(),
            },
        };

        let pin_path = match m.get("pin_path") {
            None => PathBuf::from(DEFAULT_PIN_PATH),
            Some(v) => match self.string(v, "pin_path") {
                Some(s) if s.starts_with('/') && s.len() > 1 => PathBuf::from(s.trim_end_matches('/')),
                Some(s) => {
                    self.problem("pin_path", format!("{s:?} is not an absolute directory path"));
                    PathBuf::new()
                }
                None => PathBuf::new(),
            },
        };

        let conntrack_max = match m.get("conntrack_max") {
            None => DEFAULT_CONNTRACK_MAX,
            Some(v) => self.uint(v, "conntrack_max", 1, u64::from(MAX_CONNTRACK)).unwrap_or(1) as u32,
        };
        let table_capacity = match m.get("table_capacity") {
            None => DEFAULT_TABLE_CAPACITY,
            Some(v) => self.uint(v, "table_capacity", 1024, 1 << 26).unwrap_or(1024) as u32,
        };

        let tcp_idle_timeout = match m.get("tcp_idle_timeout") {
            None => DEFAULT_TCP_IDLE_TIMEOUT,
            Some(v) => self.uint(v, "tcp_idle_timeout", 10, 86_400 * 7).unwrap_or(10) as u32,
        };
        let udp_idle_timeout = match m.get("udp_idle_timeout") {
            None => DEFAULT_UDP_IDLE_TIMEOUT,
            Some(v) => self.uint(v, "udp_idle_timeout", 10, 86_400 * 7).unwrap_or(10) as u32,
        };

        let metrics_listen = match m.get("metrics_listen") {
            None => DEFAULT_METRICS_LISTEN.parse().expect("valid default"),
            Some(v) => match self.string(v, "metrics_listen") {
                Some(s) => match s.parse::<std::net::SocketAddr>() {
                    Ok(a) => a,
                    Err(_) => {
                        self.problem("metrics_listen", format!("{s:?} is not ADDRESS:PORT"));
                        DEFAULT_METRICS_LISTEN.parse().expect("valid default")
                    }
                },
                None => DEFAULT_METRICS_LISTEN.parse().expect("valid default"),
            },
        };

        let mut services = Vec::new();
        match m.get("services") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(seq)) => {
                for (i, s) in seq.iter().enumerate() {
                    if let Some(svc) = self.service(s, &format!("services[{i}]")) {
                        services.push((i, svc));
                    }
                }
            }
            Some(v) => self.problem("services", format!("expected a list of services, found {}", describe(v))),
        }
        self.cross_service(&services, table_capacity);

        Some(Config {
            interfaces,
            xdp_mode,
            control_socket,
            pin_path,
            conntrack_max,
            table_capacity,
            tcp_idle_timeout,
            udp_idle_timeout,
            metrics_listen,
            services: services.into_iter().map(|(_, s)| s).collect(),
        })
    }

    fn service(&mut self, v: &Value, path: &str) -> Option<ServiceConfig> {
        const KEYS: &[&str] =
            &["name", "vip", "port", "protocol", "scheduler", "table_size", "health", "slow_start", "backends"];
        let m = self.mapping(v, path, KEYS)?;
        let before = self.problems.len();

        let name = self.required(m, path, "name").and_then(|v| self.string(v, &Self::field(path, "name")));
        if let Some(n) = name
            && (n.is_empty() || n.len() > 64 || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            self.problem(
                &Self::field(path, "name"),
                format!("{n:?} is not a valid name (1-64 letters, digits, '-' or '_')"),
            );
        }
        let vip = self.required(m, path, "vip").and_then(|v| self.ipv4(v, &Self::field(path, "vip")));
        let port = self.required(m, path, "port").and_then(|v| self.uint(v, &Self::field(path, "port"), 1, 65535));
        let protocol = match m.get("protocol") {
            None => Some(Protocol::Tcp),
            Some(v) => match self.string(v, &Self::field(path, "protocol")) {
                Some("tcp") => Some(Protocol::Tcp),
                Some("udp") => Some(Protocol::Udp),
                Some(o) => {
                    self.problem(&Self::field(path, "protocol"), format!("{o:?} is not one of tcp, udp"));
                    None
                }
                None => None,
            },
        };
        let scheduler = match m.get("scheduler") {
            None => Some(Scheduler::default()),
            Some(v) => match self.string(v, &Self::field(path, "scheduler")) {
                Some(s) => match Scheduler::parse(s) {
                    Some(s) => Some(s),
                    None => {
                        self.problem(
                            &Self::field(path, "scheduler"),
                            format!("{s:?} is not one of {}", Scheduler::names()),
                        );
                        None
                    }
                },
                None => None,
            },
        };
        let table_size = match m.get("table_size") {
            None => Some(maglev::DEFAULT_TABLE_SIZE),
            Some(v) => {
                let field = Self::field(path, "table_size");
                match self.uint(v, &field, 3, 16_777_259) {
                    Some(n) if maglev::is_prime(n as u32) => Some(n as u32),
                    Some(n) => {
                        self.problem(&field, format!("{n} is not a prime number (Maglev needs a prime table size)"));
                        None
                    }
                    None => None,
                }
            }
        };

        let health = match m.get("health") {
            None => Some(HealthConfig::default()),
            Some(v) => self.health(v, &Self::field(path, "health")),
        };
        let slow_start = match m.get("slow_start") {
            None => Some(None),
            Some(v) => self
                .duration(v, &Self::field(path, "slow_start"), Duration::ZERO, Duration::from_secs(3600))
                .map(|d| if d.is_zero() { None } else { Some(d) }),
        };

        let mut backends = Vec::new();
        let bpath = Self::field(path, "backends");
        match m.get("backends") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(seq)) => {
                for (i, b) in seq.iter().enumerate() {
                    let field = format!("{bpath}[{i}]");
                    if let Some(b) = self.backend(b, &field) {
                        if backends.iter().any(|o: &BackendConfig| o.address == b.address && o.port == b.port) {
                            self.problem(&field, format!("backend {}:{} is listed twice", b.address, b.port));
                        } else {
                            backends.push(b);
                        }
                    }
                }
            }
            Some(v) => self.problem(&bpath, format!("expected a list of backends, found {}", describe(v))),
        }
        if let Some(scheduler) = scheduler {
            let weights: Vec<u32> = backends.iter().map(|b| b.weight).collect();
            // A table_size already refused is not judged again.
            let table_size = table_size.unwrap_or(u32::MAX);
            let measures_response = health.as_ref().is_some_and(|h| h.kind == ProbeKind::Http);
            for p in scheduler.validate(&Pool { table_size, weights: &weights, measures_response }) {
                self.problem(&Self::field(path, p.field), p.message);
            }
        }
        if self.problems.len() != before {
            return None;
        }
        Some(ServiceConfig {
            name: name?.to_owned(),
            vip: vip?,
            port: port? as u16,
            protocol: protocol?,
            scheduler: scheduler?,
            table_size: table_size?,
            health: health?,
            slow_start: slow_start?,
            backends,
        })
    }

    /// A duration: a number with a unit (`500ms`, `2s`, `1m`) or a bare
    /// number of seconds.
    fn duration(&mut self, v: &Value, field: &str, min: Duration, max: Duration) -> Option<Duration> {
        let d = match v {
            Value::Number(n) => n.as_u64().map(Duration::from_secs),
            Value::String(s) => parse_duration(s),
            _ => None,
        };
        match d {
            Some(d) if d >= min && d <= max => Some(d),
            Some(d) => {
                self.problem(field, format!("{d:?} is out of range ({min:?} to {max:?})"));
                None
            }
            None => {
                self.problem(field, format!("expected a duration such as 500ms, 2s or 1m, found {}", describe(v)));
                None
            }
        }
    }

    fn health(&mut self, v: &Value, path: &str) -> Option<HealthConfig> {
        let m = self.mapping(v, path, &["type", "interval", "timeout", "rise", "fall", "path", "expect", "port"])?;
        let before = self.problems.len();
        let mut h = HealthConfig::default();
        let f = |k: &str| Self::field(path, k);
        match m.get("type") {
            None => self.problem(&f("type"), "missing (required): one of none, tcp, http".into()),
            Some(v) => match self.string(v, &f("type")) {
                Some("none") => h.kind = ProbeKind::None,
                Some("tcp") => h.kind = ProbeKind::Tcp,
                Some("http") => h.kind = ProbeKind::Http,
                Some(o) => self.problem(&f("type"), format!("{o:?} is not one of none, tcp, http")),
                None => {}
            },
        }
        if let Some(v) = m.get("interval")
            && let Some(d) = self.duration(v, &f("interval"), Duration::from_millis(50), Duration::from_secs(3600))
        {
            h.interval = d;
        }
        if let Some(v) = m.get("timeout")
            && let Some(d) = self.duration(v, &f("timeout"), Duration::from_millis(10), Duration::from_secs(600))
        {
            h.timeout = d;
        }
        if let Some(v) = m.get("rise")
            && let Some(n) = self.uint(v, &f("rise"), 1, 100)
        {
            h.rise = n as u32;
        }
        if let Some(v) = m.get("fall")
            && let Some(n) = self.uint(v, &f("fall"), 1, 100)
        {
            h.fall = n as u32;
        }
        if let Some(v) = m.get("path")
            && let Some(p) = self.string(v, &f("path"))
        {
            if p.starts_with('/') && !p.chars().any(|c| c.is_whitespace() || c.is_control()) {
                h.path = p.to_owned();
            } else {
                self.problem(&f("path"), format!("{p:?} is not an absolute URL path without spaces"));
            }
        }
        if let Some(v) = m.get("expect") {
            let text = match v {
                Value::Number(n) => Some(n.to_string()),
                Value::String(s) => Some(s.clone()),
                _ => None,
            };
            match text.as_deref().and_then(parse_status_range) {
                Some(r) => h.expect = r,
                None => self.problem(
                    &f("expect"),
                    format!("expected a status or range such as 200 or 200-399, found {}", describe(v)),
                ),
            }
        }
        if let Some(v) = m.get("port")
            && let Some(p) = self.uint(v, &f("port"), 1, 65535)
        {
            h.port = Some(p as u16);
        }
        if h.kind != ProbeKind::None && h.timeout > h.interval {
            self.problem(&f("timeout"), format!("{:?} is longer than the interval {:?}", h.timeout, h.interval));
        }
        (self.problems.len() == before).then_some(h)
    }

    fn backend(&mut self, v: &Value, path: &str) -> Option<BackendConfig> {
        let m = self.mapping(v, path, &["address", "port", "weight", "drain"])?;
        let address = self.required(m, path, "address").and_then(|v| self.ipv4(v, &Self::field(path, "address")));
        let port = self.required(m, path, "port").and_then(|v| self.uint(v, &Self::field(path, "port"), 1, 65535));
        let weight = match m.get("weight") {
            None => Some(1),
            Some(v) => self.uint(v, &Self::field(path, "weight"), 0, u64::from(MAX_WEIGHT)),
        };
        let drain = match m.get("drain") {
            None => Some(false),
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                self.problem(&Self::field(path, "drain"), format!("expected true or false, found {}", describe(v)));
                None
            }
        };
        Some(BackendConfig { address: address?, port: port? as u16, weight: weight? as u32, drain: drain? })
    }

    fn cross_service(&mut self, services: &[(usize, ServiceConfig)], table_capacity: u32) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut vips: BTreeMap<(Ipv4Addr, u16, Protocol), usize> = BTreeMap::new();
        for (i, s) in services {
            if let Some(first) = names.insert(&s.name, *i) {
                self.problem(
                    &format!("services[{i}].name"),
                    format!("service name {:?} is already used by services[{first}]", s.name),
                );
            }
            if let Some(first) = vips.insert((s.vip, s.port, s.protocol), *i) {
                self.problem(
                    &format!("services[{i}].vip"),
                    format!("duplicate VIP {}:{}/{}: already used by services[{first}]", s.vip, s.port, s.protocol),
                );
            }
        }
        let backends: usize = services.iter().map(|(_, s)| s.backends.len()).sum();
        if backends >= lb_common::MAX_BACKENDS as usize {
            self.problem(
                "services",
                format!("{backends} backends in all; at most {} are supported", lb_common::MAX_BACKENDS - 1),
            );
        }
        if services.len() > lb_common::MAX_SERVICES as usize {
            self.problem(
                "services",
                format!("{} services; at most {} are supported", services.len(), lb_common::MAX_SERVICES),
            );
        }
        // Each table needs room for itself and for its replacement.
        let need: u64 = services.iter().map(|(_, s)| 2 * table_entries(s)).sum();
        if need > u64::from(table_capacity) {
            self.problem(
                "table_capacity",
                format!("the services' selection tables need {need} entries (twice their size, for atomic swaps); capacity is {table_capacity}"),
            );
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

/// Entries the selection table of `s` takes.
pub fn table_entries(s: &ServiceConfig) -> u64 {
    let weights: Vec<u32> = s.backends.iter().map(|b| b.weight).collect();
    let measures_response = s.health.kind == ProbeKind::Http;
    s.scheduler.table_len(&Pool { table_size: s.table_size, weights: &weights, measures_response })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake;
    impl Environment for Fake {
        fn interface_exists(&self, name: &str) -> bool {
            name == "eth0" || name == "eth1"
        }
    }

    const GOOD: &str = r#"
interfaces: [eth0, eth1]
xdp_mode: auto
forwarding: nat
control_socket: /run/lbd/lbd.sock
conntrack_max: 1048576
services:
  - name: web
    vip: 10.10.0.100
    port: 80
    protocol: tcp
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 2 }
"#;

    fn problems(text: &str) -> Vec<Problem> {
        parse(text, "lab.yaml", &Fake).expect_err("config should be rejected").problems
    }

    fn only(text: &str) -> Problem {
        let p = problems(text);
        assert_eq!(p.len(), 1, "expected exactly one problem, got {p:#?}");
        p.into_iter().next().unwrap()
    }

    #[test]
    fn good_config_parses_with_defaults() {
        let c = parse(GOOD, "lab.yaml", &Fake).unwrap();
        assert_eq!(c.interfaces, vec!["eth0", "eth1"]);
        assert_eq!(c.xdp_mode, XdpMode::Auto);
        assert_eq!(c.services.len(), 1);
        let s = &c.services[0];
        assert_eq!(s.scheduler, Scheduler::Maglev);
        assert_eq!(s.table_size, 65537);
        assert_eq!(
            s.backends[1],
            BackendConfig { address: "10.20.0.12".parse().unwrap(), port: 8080, weight: 2, drain: false }
        );
        assert_eq!(s.health.kind, ProbeKind::None);
        assert_eq!(s.slow_start, None);
        assert_eq!(c.pin_path, PathBuf::from(DEFAULT_PIN_PATH));
    }

    #[test]
    fn unknown_key_is_named_with_its_path() {
        let p = only(&GOOD.replace("weight: 2", "wieght: 2"));
        assert_eq!(p.file, "lab.yaml");
        assert_eq!(p.field, "services[0].backends[1].wieght");
        assert!(p.reason.contains("unknown key"), "{p}");
    }

    #[test]
    fn invalid_address_is_rejected() {
        let p = only(&GOOD.replace("10.20.0.12", "10.20.0.300"));
        assert_eq!(p.field, "services[0].backends[1].address");
        assert!(p.reason.contains("not an IPv4 address"), "{p}");
        let p = only(&GOOD.replace("vip: 10.10.0.100", "vip: 224.0.0.1"));
        assert_eq!(p.field, "services[0].vip");
    }

    #[test]
    fn duplicate_vip_is_rejected() {
        let text = format!(
            "{GOOD}  - name: web2\n    vip: 10.10.0.100\n    port: 80\n    backends: [{{ address: 10.20.0.13, port: 80 }}]\n"
        );
        let p = only(&text);
        assert_eq!(p.field, "services[1].vip");
        assert!(p.reason.contains("duplicate VIP 10.10.0.100:80/tcp"), "{p}");
        // The same address and port over UDP is a different VIP.
        let udp = text.replace("    port: 80\n    backends: [", "    port: 80\n    protocol: udp\n    backends: [");
        parse(&udp, "lab.yaml", &Fake).unwrap();
    }

    #[test]
    fn negative_and_non_numeric_weights_are_rejected() {
        let p = only(&GOOD.replace("weight: 2", "weight: -1"));
        assert_eq!(p.field, "services[0].backends[1].weight");
        assert!(p.reason.contains("negative"), "{p}");
        let p = only(&GOOD.replace("weight: 2", "weight: heavy"));
        assert_eq!(p.field, "services[0].backends[1].weight");
        assert!(p.reason.contains("the string \"heavy\""), "{p}");
        let p = only(&GOOD.replace("weight: 2", "weight: 70000"));
        assert!(p.reason.contains("out of range"), "{p}");
    }

    #[test]
    fn missing_port_is_rejected() {
        let p = only(&GOOD.replace("    port: 80\n", ""));
        assert_eq!(p.field, "services[0].port");
        assert!(p.reason.contains("missing"), "{p}");
        let p = only(&GOOD.replace("10.20.0.12, port: 8080,", "10.20.0.12,"));
        assert_eq!(p.field, "services[0].backends[1].port");
    }

    #[test]
    fn missing_interface_is_rejected() {
        let p = only(&GOOD.replace("[eth0, eth1]", "[eth0, eth9]"));
        assert_eq!(p.field, "interfaces[1]");
        assert!(p.reason.contains("no network interface named \"eth9\""), "{p}");
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        let text = GOOD
            .replace("[eth0, eth1]", "[eth0, eth7]")
            .replace("weight: 2", "weight: -3")
            .replace("xdp_mode: auto", "xdp_mode: turbo")
            .replace("    port: 80\n", "    port: 0\n");
        let p = problems(&text);
        let fields: Vec<_> = p.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["interfaces[1]", "xdp_mode", "services[0].port", "services[0].backends[1].weight"]);
        let shown = ConfigError { problems: p }.to_string();
        assert!(shown.lines().all(|l| l.starts_with("lab.yaml: ")), "{shown}");
    }

    #[test]
    fn table_size_must_be_prime_and_schedulers_known() {
        let p = only(&GOOD.replace("protocol: tcp", "protocol: tcp\n    table_size: 65536"));
        assert_eq!(p.field, "services[0].table_size");
        let p = only(&GOOD.replace("protocol: tcp", "protocol: tcp\n    scheduler: random"));
        assert_eq!(p.field, "services[0].scheduler");
        let c = parse(&GOOD.replace("protocol: tcp", "protocol: tcp\n    scheduler: source-hash"), "f", &Fake).unwrap();
        assert_eq!(c.services[0].scheduler, Scheduler::SourceHash);
    }

    #[test]
    fn health_slow_start_and_drain_parse_and_validate() {
        let text = GOOD.replace(
            "    protocol: tcp\n",
            "    protocol: tcp\n    slow_start: 10s\n    health: { type: http, interval: 500ms, timeout: 200ms, rise: 2, fall: 3, path: /healthz, expect: 200-299, port: 9000 }\n",
        )
        .replace("weight: 2 }", "weight: 2, drain: true }");
        let c = parse(&text, "f", &Fake).unwrap();
        let s = &c.services[0];
        assert_eq!(s.slow_start, Some(Duration::from_secs(10)));
        assert_eq!(s.health.kind, ProbeKind::Http);
        assert_eq!(s.health.interval, Duration::from_millis(500));
        assert_eq!(s.health.timeout, Duration::from_millis(200));
        assert_eq!((s.health.rise, s.health.fall), (2, 3));
        assert_eq!(s.health.path, "/healthz");
        assert_eq!(s.health.expect, (200, 299));
        assert_eq!(s.health.port, Some(9000));
        assert!(s.backends[1].drain);
        assert_eq!(s.backends[1].admin_weight(), 0);

        let bad = GOOD.replace(
            "    protocol: tcp\n",
            "    protocol: tcp\n    slow_start: soon\n    health: { type: ping, interval: 1s, timeout: 2s, expect: 700 }\n",
        );
        let fields: Vec<String> = problems(&bad).into_iter().map(|p| p.field).collect();
        assert_eq!(fields, ["services[0].health.type", "services[0].health.expect", "services[0].slow_start"],);
        let p = only(&GOOD.replace(
            "    protocol: tcp\n",
            "    protocol: tcp\n    health: { type: tcp, interval: 1s, timeout: 2s }\n",
        ));
        assert_eq!(p.field, "services[0].health.timeout");
    }

    #[test]
    fn durations_and_status_ranges() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("fast"), None);
        assert_eq!(parse_status_range("200-399"), Some((200, 399)));
        assert_eq!(parse_status_range("204"), Some((204, 204)));
        assert_eq!(parse_status_range("399-200"), None);
        assert_eq!(parse_status_range("99"), None);
    }

    #[test]
    fn not_yaml_is_reported_with_location() {
        let p = only("interfaces: [eth0\nservices: {");
        assert_eq!(p.file, "lab.yaml");
        assert!(p.reason.starts_with("not valid YAML"), "{p}");
    }
}

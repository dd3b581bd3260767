//! The running agent's state: the dataplane, the configuration it was
//! given and each backend's health. Every change (reload from the file,
//! SIGHUP, the control API, a health transition, slow start, the flow
//! sweeper) goes through here, under one lock, to the one writer of the maps.
//!
//! The config file is the single source of truth: a change made through the
//! control API is validated with the same rules as the file (the new
//! configuration is rendered to YAML and parsed back), applied, and then
//! written back to the file atomically, so it survives a restart.
use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    config::{self, BackendConfig, Config, ConfigError, ProbeKind, Problem, ServiceConfig, System},
    dataplane::{BackendRuntime, Dataplane, DataplaneError, SweepReport, SweepRun, monotonic_coarse_secs},
    health::{Checker, Health, HealthMetrics, slow_start_weight},
    render,
};

/// Weights are multiplied by this during slow start, so that a backend can
/// start at a tenth of its weight even when that weight is 1.
const SLOW_START_SCALE: u32 = 10;

/// One backend: (service name, address, port).
pub type BackendKey = (String, IpAddr, u16);

pub struct Agent {
    pub dp: Dataplane,
    pub config: Config,
    pub config_path: PathBuf,
    health: HashMap<BackendKey, Checker>,
    /// When a backend was added (slow start also starts over when its
    /// checker brings it back up: `Checker::up_since`).
    joined: HashMap<BackendKey, Instant>,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// Half-open flows the sweeper expired early, since lbd started.
    pub half_open_expired: u64,
    /// How long the last complete sweep took, start to end (ms).
    pub last_sweep_ms: Option<u64>,
    pub health_metrics: HealthMetrics,
    /// VIP announcement, while the config has a `bgp:` section (kept by
    /// lbd's announcer loop).
    pub bgp: Option<crate::bgp::BgpStatus>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("{0}")]
    Invalid(ConfigError),
    #[error("applying the new configuration failed ({0}); the previous one was restored")]
    Apply(DataplaneError),
    #[error("{0}")]
    NotFound(String),
    #[error("saving the configuration to {path}: {source}; the change was rolled back")]
    Save { path: PathBuf, source: std::io::Error },
}

/// What a successful reload changed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReloadSummary {
    pub services: usize,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

/// A change to the pool, as the control API takes it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum Change {
    BackendAdd {
        service: String,
        address: IpAddr,
        port: u16,
        weight: u32,
    },
    BackendRemove {
        service: String,
        address: IpAddr,
        port: u16,
    },
    BackendWeight {
        service: String,
        address: IpAddr,
        port: u16,
        weight: u32,
    },
    BackendDrain {
        service: String,
        address: IpAddr,
        port: u16,
    },
    BackendEnable {
        service: String,
        address: IpAddr,
        port: u16,
    },
    /// A service given with the config file's keys (validated as the file is).
    ServiceAdd {
        spec: serde_json::Value,
    },
    ServiceRemove {
        service: String,
    },
}

/// A backend's state as the status report shows it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BackendState {
    Up,
    Down,
    Drain,
}

impl Agent {
    pub fn new(dp: Dataplane, config: Config, config_path: PathBuf) -> Self {
        let mut a = Self {
            dp,
            config,
            config_path,
            health: HashMap::new(),
            joined: HashMap::new(),
            reloads_ok: 0,
            reloads_failed: 0,
            half_open_expired: 0,
            last_sweep_ms: None,
            health_metrics: HealthMetrics::default(),
            bgp: None,
        };
        a.sync_health();
        a
    }

    /// Keep one checker per backend of the configuration; new backends
    /// start up (and slow-start when their service says so).
    fn sync_health(&mut self) {
        let mut keep = HashMap::new();
        for s in &self.config.services {
            for b in &s.backends {
                let k: BackendKey = (s.name.clone(), b.address, b.port);
                let c = self.health.remove(&k).unwrap_or_else(|| {
                    if s.slow_start.is_some() {
                        self.joined.insert(k.clone(), Instant::now());
                    }
                    Checker::new()
                });
                keep.insert(k, c);
            }
        }
        self.joined.retain(|k, _| keep.contains_key(k));
        self.health = keep;
    }

    pub fn health_of(&self, service: &str, address: IpAddr, port: u16) -> Health {
        self.health.get(&(service.to_owned(), address, port)).map_or(Health::Up, Checker::state)
    }

    pub fn state_of(&self, service: &str, b: &BackendConfig) -> BackendState {
        if self.health_of(service, b.address, b.port) == Health::Down {
            BackendState::Down
        } else if b.drain {
            BackendState::Drain
        } else {
            BackendState::Up
        }
    }

    /// The VIPs to announce: each VIP one of whose services has a backend
    /// the health checks find up (draining or not: a drained backend's
    /// open connections still need the route).
    pub fn vips_to_announce(&self) -> BTreeSet<IpAddr> {
        self.config
            .services
            .iter()
            .filter(|s| s.backends.iter().any(|b| self.state_of(&s.name, b) != BackendState::Down))
            .map(|s| s.vip)
            .collect()
    }

    /// The weight the schedulers use now: configuration, health, drain,
    /// slow start.
    fn runtime(&self, s: &ServiceConfig, b: &BackendConfig, now: Instant) -> BackendRuntime {
        let k: BackendKey = (s.name.clone(), b.address, b.port);
        let down = self.health.get(&k).is_some_and(|c| c.state() == Health::Down);
        if down {
            return BackendRuntime { weight: 0, down: true };
        }
        let w = b.admin_weight();
        let weight = match s.slow_start {
            None => w,
            Some(window) => {
                let scaled = w.saturating_mul(SLOW_START_SCALE);
                match self.ramp_start(&k) {
                    Some(t) => slow_start_weight(scaled, now.duration_since(t), window),
                    None => scaled,
                }
            }
        };
        let response = self.health.get(&k).and_then(Checker::response_time);
        BackendRuntime { weight: s.scheduler.effective_weight(weight, response), down: false }
    }

    /// A backend's recent probe response time, when measured.
    pub fn response_time_of(&self, service: &str, address: IpAddr, port: u16) -> Option<Duration> {
        self.health.get(&(service.to_owned(), address, port)).and_then(Checker::response_time)
    }

    /// Where a backend's slow start counts from: the later of when it was
    /// added and when it last came back up.
    fn ramp_start(&self, k: &BackendKey) -> Option<Instant> {
        let up = self.health.get(k).and_then(Checker::up_since);
        self.joined.get(k).copied().into_iter().chain(up).max()
    }

    /// True while some backend is still ramping up.
    pub fn ramping(&self) -> bool {
        let now = Instant::now();
        self.config.services.iter().any(|s| s.backends.iter().any(|b| self.ramping_at(s, b, now)))
    }

    /// True while `b` of service `s` is still inside its slow-start window
    /// (whatever its health; the status report shows it only while up).
    pub fn slow_starting(&self, s: &ServiceConfig, b: &BackendConfig) -> bool {
        self.ramping_at(s, b, Instant::now())
    }

    fn ramping_at(&self, s: &ServiceConfig, b: &BackendConfig, now: Instant) -> bool {
        s.slow_start.is_some_and(|w| {
            self.ramp_start(&(s.name.clone(), b.address, b.port)).is_some_and(|t| now.duration_since(t) < w)
        })
    }

    /// Program the maps from the configuration and the runtime state.
    pub fn apply(&mut self) -> Result<(), DataplaneError> {
        let now = Instant::now();
        let services = self.config.services.clone();
        let rt: HashMap<BackendKey, BackendRuntime> = services
            .iter()
            .flat_map(|s| s.backends.iter().map(move |b| (s, b)))
            .map(|(s, b)| ((s.name.clone(), b.address, b.port), self.runtime(s, b, now)))
            .collect();
        self.dp.set_flood(&self.config.flood)?;
        self.dp.set_maglev_seed(self.config.maglev_seed);
        self.dp.apply(&services, &|s, b| rt[&(s.name.clone(), b.address, b.port)])
    }

    /// Record a probe result; on a transition, log it. True when the
    /// datapath must be reprogrammed ([`apply`](Self::apply)) for it,
    /// which the caller does, for several results at once.
    pub fn observe(&mut self, key: &BackendKey, result: Result<Duration, String>) -> bool {
        let Some(s) = self.config.services.iter().find(|s| s.name == key.0) else { return false };
        self.health_metrics.record(&key.0, &SocketAddr::new(key.1, key.2).to_string(), &result);
        let (rise, fall) = (s.health.rise, s.health.fall);
        let Some(c) = self.health.get_mut(key) else { return false };
        if let Ok(took) = result {
            c.record_response(took);
        }
        let transition = c.observe(result.is_ok(), rise, fall);
        let backend = SocketAddr::new(key.1, key.2).to_string();
        match (&transition, &result) {
            (None, _) => {}
            (Some(Health::Down), Err(e)) => warn!(service = %key.0, backend = %backend, reason = %e, "backend down"),
            (Some(_), _) => info!(service = %key.0, backend = %backend, "backend up"),
        }
        // A scheduler may weigh the response time: reprogram when the
        // weight in force moved, not only on a health transition.
        transition.is_some() || self.runtime_moved(key)
    }

    /// True when the backend's runtime (weight, down) now differs from what
    /// the dataplane has.
    fn runtime_moved(&self, key: &BackendKey) -> bool {
        let Some(s) = self.config.services.iter().find(|s| s.name == key.0) else { return false };
        let Some(b) = s.backends.iter().find(|b| b.address == key.1 && b.port == key.2) else { return false };
        let now = self.runtime(s, b, Instant::now());
        self.dp
            .services()
            .filter(|a| a.config.name == key.0)
            .flat_map(|a| &a.backends)
            .any(|a| a.config.address == key.1 && a.config.port == key.2 && a.runtime != now)
    }

    /// What the health checker should probe: (key, probe address, config).
    pub fn probe_targets(&self) -> Vec<(BackendKey, SocketAddr, config::HealthConfig)> {
        let mut v = Vec::new();
        for s in &self.config.services {
            if s.health.kind == ProbeKind::None {
                continue;
            }
            for b in &s.backends {
                v.push(((s.name.clone(), b.address, b.port), SocketAddr::new(b.address, b.port), s.health.clone()));
            }
        }
        v
    }

    /// Every IPv4 backend address of the configuration, once each, in
    /// order: the addresses whose routes lbd checks
    /// (`netdev::RouteMtuWatch`, outside the state's lock).
    pub fn ipv4_backends(&self) -> Vec<Ipv4Addr> {
        let addrs: BTreeSet<Ipv4Addr> = (self.config.services.iter().flat_map(|s| &s.backends))
            .filter_map(|b| match b.address {
                IpAddr::V4(a) => Some(a),
                IpAddr::V6(_) => None,
            })
            .collect();
        addrs.into_iter().collect()
    }

    /// Re-read the config file, validate it in full and apply the
    /// difference. On any problem the running state stays exactly as it was.
    pub fn reload(&mut self) -> Result<ReloadSummary, ReloadError> {
        let r =
            config::load(&self.config_path, &System).map_err(ReloadError::Invalid).and_then(|new| self.replace(new));
        match &r {
            Ok(s) => {
                self.reloads_ok += 1;
                info!(added = ?s.added, removed = ?s.removed, changed = ?s.changed, "reload applied");
            }
            Err(e) => {
                self.reloads_failed += 1;
                warn!("reload rejected, running configuration unchanged: {}", e.to_string().replace('\n', "; "));
            }
        }
        r
    }

    /// Switch to `new` (already validated), or change nothing.
    fn replace(&mut self, new: Config) -> Result<ReloadSummary, ReloadError> {
        let restart: Vec<Problem> = self
            .config
            .restart_only_changes(&new)
            .into_iter()
            .map(|k| Problem {
                file: self.config_path.display().to_string(),
                field: k.to_owned(),
                reason: if matches!(k, "conntrack_max" | "conntrack_max_ipv6" | "table_capacity") {
                    // The pinned tables are adopted as they are by a restart.
                    "changed, but this key sizes a pinned table, which only a fresh start makes anew: stop lbd \
                     (SIGTERM, which detaches the datapath) and start it to change it"
                        .into()
                } else {
                    "changed, but this key only takes effect when lbd starts; restart lbd (SIGUSR2 keeps the \
                     datapath forwarding) to change it"
                        .into()
                },
            })
            .collect();
        if !restart.is_empty() {
            return Err(ReloadError::Invalid(ConfigError { problems: restart }));
        }
        let old = self.config.clone();
        let summary = ReloadSummary {
            services: new.services.len(),
            added: new
                .services
                .iter()
                .filter(|s| !old.services.iter().any(|o| o.name == s.name))
                .map(|s| s.name.clone())
                .collect(),
            removed: old
                .services
                .iter()
                .filter(|o| !new.services.iter().any(|s| s.name == o.name))
                .map(|s| s.name.clone())
                .collect(),
            changed: new
                .services
                .iter()
                .filter(|s| old.services.iter().any(|o| o.name == s.name && o != *s))
                .map(|s| s.name.clone())
                .collect(),
        };
        let old_health = self.health.clone();
        let old_joined = self.joined.clone();
        self.config = new;
        self.sync_health();
        if let Err(e) = self.apply() {
            warn!(error = %e, "applying failed; restoring the previous configuration");
            self.config = old;
            self.health = old_health;
            self.joined = old_joined;
            if let Err(e2) = self.apply() {
                warn!(error = %e2, "restoring the previous configuration failed too");
            }
            return Err(ReloadError::Apply(e));
        }
        Ok(summary)
    }

    /// Apply a change from the control API: validated with the file's rules,
    /// applied, then saved to the config file.
    pub fn change(&mut self, change: &Change) -> Result<ReloadSummary, ReloadError> {
        let file = self.config_path.display().to_string();
        let text = if let Change::ServiceAdd { spec } = change {
            let name = spec.get("name").and_then(|n| n.as_str()).unwrap_or_default();
            if self.config.services.iter().any(|s| s.name == name) {
                return Err(ReloadError::Invalid(ConfigError {
                    problems: vec![Problem {
                        file: "(request)".into(),
                        field: "name".into(),
                        reason: format!("service name {name:?} is already used"),
                    }],
                }));
            }
            // Into the file's own form, then through the file's parser.
            let mut doc: yaml_serde::Value =
                yaml_serde::from_str(&render::render(&self.config)).expect("rendered config is YAML");
            let spec = yaml_serde::to_value(spec).expect("JSON converts to YAML");
            match doc.get_mut("services") {
                Some(yaml_serde::Value::Sequence(seq)) => seq.push(spec),
                _ => {
                    doc["services"] = yaml_serde::Value::Sequence(vec![spec]);
                }
            }
            yaml_serde::to_string(&doc).expect("YAML serialises")
        } else {
            let mut cfg = self.config.clone();
            edit(&mut cfg, change)?;
            render::render(&cfg)
        };
        let parsed = config::parse(&text, &file, &System).map_err(ReloadError::Invalid)?;
        let old_text = render::render(&self.config);
        let summary = self.replace(parsed)?;
        if let Err(source) = render::write_atomic(&self.config_path, &text) {
            // Keep file and datapath in agreement: undo.
            if let Ok(old) = config::parse(&old_text, &file, &System) {
                let _ = self.replace(old);
            }
            return Err(ReloadError::Save { path: self.config_path.clone(), source });
        }
        info!(change = ?change, "pool changed and saved");
        Ok(summary)
    }

    /// A sweep of the flow tables with the timeouts in force now, run a
    /// part at a time by [`Agent::sweep_step`] (lbd's sweeper lets go of
    /// the agent between parts: a sweep of millions of flows takes
    /// seconds, which a health change or an lbctl request need not wait).
    pub fn sweep_begin(&self) -> SweepRun {
        self.dp.sweep_begin(
            monotonic_coarse_secs(),
            u64::from(self.config.tcp_idle_timeout),
            u64::from(self.config.udp_idle_timeout),
        )
    }

    /// The next part of `run`; its report once it is done.
    pub fn sweep_step(&mut self, run: &mut SweepRun) -> Result<Option<SweepReport>, DataplaneError> {
        let Some(r) = self.dp.sweep_step(run)? else {
            return Ok(None);
        };
        self.half_open_expired += r.half_open_expired;
        self.last_sweep_ms = Some(r.duration_ms);
        Ok(Some(r))
    }
}

fn not_found(what: String) -> ReloadError {
    ReloadError::NotFound(what)
}

/// Apply `change` to a configuration (no validation here: the caller
/// validates the result with the config file's rules).
fn edit(cfg: &mut Config, change: &Change) -> Result<(), ReloadError> {
    let service = |cfg: &mut Config, name: &str| -> Result<usize, ReloadError> {
        cfg.services.iter().position(|s| s.name == name).ok_or_else(|| not_found(format!("no service named {name:?}")))
    };
    let backend = |s: &ServiceConfig, a: IpAddr, p: u16| -> Result<usize, ReloadError> {
        s.backends
            .iter()
            .position(|b| b.address == a && b.port == p)
            .ok_or_else(|| not_found(format!("service {:?} has no backend {a}:{p}", s.name)))
    };
    match change {
        Change::BackendAdd { service: n, address, port, weight } => {
            let i = service(cfg, n)?;
            if backend(&cfg.services[i], *address, *port).is_ok() {
                return Err(ReloadError::Invalid(ConfigError {
                    problems: vec![Problem {
                        file: "(request)".into(),
                        field: "address".into(),
                        reason: format!("service {n:?} already has backend {address}:{port}"),
                    }],
                }));
            }
            cfg.services[i].backends.push(BackendConfig {
                address: *address,
                port: *port,
                weight: *weight,
                drain: false,
            });
        }
        Change::BackendRemove { service: n, address, port } => {
            let i = service(cfg, n)?;
            let j = backend(&cfg.services[i], *address, *port)?;
            cfg.services[i].backends.remove(j);
        }
        Change::BackendWeight { service: n, address, port, weight } => {
            let i = service(cfg, n)?;
            let j = backend(&cfg.services[i], *address, *port)?;
            cfg.services[i].backends[j].weight = *weight;
        }
        Change::BackendDrain { service: n, address, port } | Change::BackendEnable { service: n, address, port } => {
            let i = service(cfg, n)?;
            let j = backend(&cfg.services[i], *address, *port)?;
            cfg.services[i].backends[j].drain = matches!(change, Change::BackendDrain { .. });
        }
        Change::ServiceAdd { .. } => unreachable!("handled on the YAML document in Agent::change"),
        Change::ServiceRemove { service: n } => {
            let i = service(cfg, n)?;
            cfg.services.remove(i);
        }
    }
    Ok(())
}

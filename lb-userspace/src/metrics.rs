//! Prometheus / OpenMetrics exporter.
//!
//! A prometheus-client registry built once: a collector
//! (`prometheus_client::collector::Collector`, writing constant counters and
//! gauges) that reads the agent's state and the BPF maps at every scrape
//! (per-CPU counters summed then, so scraping costs the datapath nothing),
//! plus the health-check histograms. The HTTP side is a minimal GET handler (one route).

/// Every series lbd exports (metric family names; histograms also expose
/// `_bucket`, `_sum` and `_count`, counters are sampled as `<name>`, which
/// already ends in `_total`).
pub const SERIES: &[&str] = &[
    "lb_backend_connections_total",
    "lb_backend_packets_total",
    "lb_backend_bytes_total",
    "lb_backend_up",
    "lb_backend_weight",
    "lb_backend_effective_weight",
    "lb_backend_active_flows",
    "lb_service_packets_total",
    "lb_service_fairness",
    "lb_dropped_packets_total",
    "lb_kernel_fallback_packets_total",
    "lb_xdp_redirect_packets_total",
    "lb_partial_checksum_packets_total",
    "lb_interface_xdp_mode",
    "lb_forwarding_path",
    "lb_flow_table_entries",
    "lb_flow_table_capacity",
    "lb_half_open_expired_flows_total",
    "lb_stateless_packets_total",
    "lb_icmp_translated_packets_total",
    "lb_health_check_duration_seconds",
    "lb_health_check_failures_total",
    "lb_config_reloads_total",
    "lb_vip_announced",
    "lb_build_info",
];

use std::{
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder, text::encode},
    metrics::{MetricType, counter::ConstCounter, family::Family, gauge::ConstGauge, gauge::Gauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use tracing::{debug, warn};

use crate::{
    agent::{Agent, BackendState},
    health::Labels,
    report::{self, Status},
};

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// What one scrape reads: the status report and the agent's own counters.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub status: Status,
    pub flow_entries: u64,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
}

impl Snapshot {
    pub fn of(agent: &Agent) -> Result<Self, String> {
        Ok(Self {
            status: report::status(agent).map_err(|e| e.to_string())?,
            flow_entries: agent.flow_entries,
            reloads_ok: agent.reloads_ok,
            reloads_failed: agent.reloads_failed,
        })
    }
}

/// One family of constant samples, written through the collector's encoder.
struct Samples {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    rows: Vec<(Labels, Value)>,
}

enum Value {
    Counter(u64),
    Gauge(i64),
    GaugeF(f64),
}

impl Samples {
    fn new(name: &'static str, help: &'static str, kind: MetricType) -> Self {
        Self { name, help, kind, rows: Vec::new() }
    }

    fn push(&mut self, l: Labels, v: Value) {
        self.rows.push((l, v));
    }

    fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
        fn sample(v: &Value, e: MetricEncoder<'_>) -> fmt::Result {
            match *v {
                Value::Counter(c) => ConstCounter::new(c).encode(e),
                Value::Gauge(g) => ConstGauge::new(g).encode(e),
                Value::GaugeF(g) => ConstGauge::new(g).encode(e),
            }
        }
        // `Registry::register` ends every help text with a period, a
        // collector's descriptor is written as given: add it, so the HELP
        // lines read as they did when these families were registered.
        let help = format!("{}.", self.help);
        let mut family = encoder.encode_descriptor(self.name, &help, None, self.kind)?;
        match self.rows.as_slice() {
            // One sample without labels: `name value`, not `name{} value`.
            [(l, v)] if l.is_empty() => sample(v, family),
            rows => rows.iter().try_for_each(|(l, v)| sample(v, family.encode_family(l)?)),
        }
    }
}

/// Every series of a snapshot, in the order they are exposed.
fn families(snap: &Snapshot) -> Vec<Samples> {
    use MetricType::{Counter, Gauge};
    let status = &snap.status;
    let mut conns = Samples::new("lb_backend_connections", "New flows scheduled onto the backend", Counter);
    let mut packets =
        Samples::new("lb_backend_packets", "Packets through the balancer per backend and direction", Counter);
    let mut bytes =
        Samples::new("lb_backend_bytes", "Bytes (frames) through the balancer per backend and direction", Counter);
    let mut up = Samples::new("lb_backend_up", "1 while health checks consider the backend up", Gauge);
    let mut weight = Samples::new("lb_backend_weight", "Configured weight", Gauge);
    let mut effective = Samples::new(
        "lb_backend_effective_weight",
        "Weight the scheduler uses now (0 when down or drained; slow start on a 10x scale)",
        Gauge,
    );
    let mut active = Samples::new("lb_backend_active_flows", "Flows open now (opened - closed - expired)", Gauge);
    let mut svc_packets =
        Samples::new("lb_service_packets", "Packets through the balancer per service, both directions", Counter);
    let mut fairness =
        Samples::new("lb_service_fairness", "Jain's fairness index over weight-normalised new flows", Gauge);
    let mut announced = Samples::new(
        "lb_vip_announced",
        "1 while the service's VIP is announced over BGP (originated, and sent on an established session)",
        Gauge,
    );
    for s in &status.services {
        if let Some(a) = s.announced {
            announced.push(labels(&[("service", &s.name), ("vip", &s.vip.to_string())]), Value::Gauge(i64::from(a)));
        }
        let mut total = 0u64;
        for b in &s.backends {
            let be = std::net::SocketAddr::new(b.address, b.port).to_string();
            let l = labels(&[("service", &s.name), ("backend", &be)]);
            conns.push(l.clone(), Value::Counter(b.new_flows));
            for (dir, p, by) in [("in", b.packets_in, b.bytes_in), ("out", b.packets_out, b.bytes_out)] {
                let ld = labels(&[("service", &s.name), ("backend", &be), ("direction", dir)]);
                packets.push(ld.clone(), Value::Counter(p));
                bytes.push(ld, Value::Counter(by));
            }
            up.push(l.clone(), Value::Gauge(i64::from(b.state != BackendState::Down)));
            weight.push(l.clone(), Value::Gauge(i64::from(b.weight)));
            effective.push(l.clone(), Value::Gauge(i64::from(b.effective_weight)));
            active.push(l, Value::Gauge(i64::try_from(b.active_flows).unwrap_or(i64::MAX)));
            total += b.packets_in + b.packets_out;
        }
        let l = labels(&[("service", &s.name)]);
        svc_packets.push(l.clone(), Value::Counter(total));
        if let Some(f) = s.fairness {
            fairness.push(l, Value::GaugeF(f));
        }
    }
    let mut dropped = Samples::new("lb_dropped_packets", "Packets the datapath dropped, by reason", Counter);
    let mut fallback = Samples::new(
        "lb_kernel_fallback_packets",
        "Packets handed to the kernel's own forwarding, by reason (unresolved next hop, an egress that cannot take XDP redirects, expiring TTL, too big for the egress, VLAN-tagged)",
        Counter,
    );
    let mut redirected =
        Samples::new("lb_xdp_redirect_packets", "Rewritten packets that left by XDP redirect", Counter);
    let mut partial = Samples::new(
        "lb_partial_checksum_packets",
        "Packets whose TCP/UDP checksum arrived unfinished (local senders behind a veth)",
        Counter,
    );
    // The two unlabelled counters always have their one sample (0 when the
    // datapath reports none), as registered plain counters had.
    let mut stateless = Samples::new(
        "lb_stateless_packets",
        "Packets routed by consistent hash without a flow-table entry, by reason: a new flow above flood.new_flow_rate_per_cpu (flood_rate), a new flow that found the flow table full (table_full), a backend's packet whose flow has no entry (stateless_reply)",
        Counter,
    );
    let mut icmp = Samples::new(
        "lb_icmp_translated_packets",
        "ICMP errors about balanced flows, translated and sent on: to_client (about a forwarded packet), to_backend (about a reply)",
        Counter,
    );
    let (mut redirects, mut partials) = (0, 0);
    for (reason, &v) in &status.counters {
        match reason.as_str() {
            "xdp_redirect" => redirects = v,
            "csum_partial" => partials = v,
            "flood_rate" | "table_full" | "stateless_reply" => {
                stateless.push(labels(&[("reason", reason)]), Value::Counter(v));
            }
            "fib_fallback" | "kernel_egress" | "ttl_expired" | "too_big" | "vlan" => {
                fallback.push(labels(&[("reason", reason)]), Value::Counter(v));
            }
            "icmp_to_client" | "icmp_to_backend" => {
                icmp.push(labels(&[("direction", &reason["icmp_".len()..])]), Value::Counter(v));
            }
            _ => dropped.push(labels(&[("reason", reason)]), Value::Counter(v)),
        }
    }
    redirected.push(Labels::new(), Value::Counter(redirects));
    partial.push(Labels::new(), Value::Counter(partials));
    let mut modes =
        Samples::new("lb_interface_xdp_mode", "The XDP mode in use per attached interface (always 1)", Gauge);
    for a in &status.interfaces {
        modes.push(labels(&[("interface", &a.interface), ("mode", a.mode.name())]), Value::Gauge(1));
    }
    let mut path = Samples::new(
        "lb_forwarding_path",
        "Path packets take from an ingress interface to an egress interface (always 1; see the path label)",
        Gauge,
    );
    for r in &status.paths {
        let l = labels(&[
            ("ingress", &r.ingress),
            ("mode", r.mode.name()),
            ("egress", &r.egress),
            ("path", r.path.label()),
        ]);
        path.push(l, Value::Gauge(1));
    }
    let mut entries = Samples::new(
        "lb_flow_table_entries",
        "Flow table entries (one per flow, two for a service whose backend endpoint another service owns), as of the last sweep",
        Gauge,
    );
    entries.push(Labels::new(), Value::Gauge(i64::try_from(snap.flow_entries).unwrap_or(i64::MAX)));
    let mut half_open = Samples::new(
        "lb_half_open_expired_flows",
        "Half-open flows (no completed handshake) expired after flood.half_open_timeout, since lbd started",
        Counter,
    );
    half_open.push(Labels::new(), Value::Counter(status.flood.half_open_expired));
    let mut capacity = Samples::new("lb_flow_table_capacity", "Flow table size (conntrack_max)", Gauge);
    capacity.push(Labels::new(), Value::Gauge(i64::from(status.flood.flow_capacity)));
    let mut reloads = Samples::new("lb_config_reloads", "Configuration reloads by result", Counter);
    reloads.push(labels(&[("result", "ok")]), Value::Counter(snap.reloads_ok));
    reloads.push(labels(&[("result", "rejected")]), Value::Counter(snap.reloads_failed));
    vec![
        conns,
        packets,
        bytes,
        up,
        weight,
        effective,
        active,
        svc_packets,
        fairness,
        dropped,
        fallback,
        redirected,
        partial,
        stateless,
        icmp,
        modes,
        path,
        entries,
        capacity,
        half_open,
        reloads,
        announced,
    ]
}

/// Reads the agent's state at every scrape (per-CPU counters summed then),
/// so scraping costs the datapath nothing and nothing is copied between
/// scrapes.
struct StatusCollector {
    agent: Arc<Mutex<Agent>>,
}

impl fmt::Debug for StatusCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusCollector")
    }
}

impl Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let snap = {
            let a = self.agent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            Snapshot::of(&a)
        };
        let snap = snap.map_err(|e| {
            warn!(error = %e, "metrics: reading the datapath failed");
            fmt::Error
        })?;
        for f in families(&snap) {
            f.encode(&mut encoder)?;
        }
        Ok(())
    }
}

/// The exporter's registry: the status collector, the health-check
/// histograms (which accumulate between scrapes) and the build info.
pub fn registry(agent: Arc<Mutex<Agent>>) -> Registry {
    let mut reg = Registry::default();
    let health = agent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).health_metrics.clone();
    reg.register_collector(Box::new(StatusCollector { agent }));
    reg.register("lb_health_check_duration_seconds", "Duration of successful health checks", health.duration);
    reg.register("lb_health_check_failures", "Failed health checks", health.failures);
    // A gauge fixed at 1 rather than an OpenMetrics `info` family: the
    // Prometheus text-format tools (promtool) know no `info` type.
    let build = Family::<Labels, Gauge>::default();
    build.get_or_create(&labels(&[("version", env!("CARGO_PKG_VERSION"))])).set(1);
    reg.register("lb_build_info", "Build information (always 1)", build);
    reg
}

/// The Prometheus text format (0.0.4) of an OpenMetrics exposition, for
/// scrapers that do not ask for OpenMetrics: counter families are named
/// with their `_total` suffix there, and there is no `# EOF` or `# UNIT`.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Serve `GET /metrics` until the task is dropped.
pub async fn serve(listener: TcpListener, agent: Arc<Mutex<Agent>>) {
    let registry = Arc::new(registry(agent));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let registry = registry.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, registry).await {
                        debug!(error = %e, "metrics connection");
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn handle(mut stream: TcpStream, registry: Arc<Registry>) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request head"))??;
        if n == 0 || buf.len() > 8192 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let openmetrics = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("accept:") && l.contains("application/openmetrics-text"));
    let path = target.split('?').next().unwrap_or("");
    let (status, ctype, body) = if method != "GET" {
        ("405 Method Not Allowed", "text/plain", "only GET\n".to_owned())
    } else if path != "/metrics" {
        ("404 Not Found", "text/plain", "metrics are at /metrics\n".to_owned())
    } else {
        let r = tokio::task::spawn_blocking(move || {
            let mut text = String::new();
            encode(&mut text, &registry).map(|()| text).map_err(|_| "reading the datapath failed".to_owned())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        match r {
            Ok(text) if openmetrics => ("200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", text),
            Ok(text) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", to_prometheus_text(&text)),
            Err(e) => ("500 Internal Server Error", "text/plain", format!("{e}\n")),
        }
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        config::Protocol,
        dataplane::Attachment,
        paths::PathReport,
        report::{BackendStatus, FloodStatus, ServiceStatus},
        sched::Scheduler,
    };

    /// Encodes a fixed snapshot, as the status collector does.
    #[derive(Debug)]
    struct Fixed(Snapshot);
    impl Collector for Fixed {
        fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
            for f in families(&self.0) {
                f.encode(&mut encoder)?;
            }
            Ok(())
        }
    }

    fn backend(last: u8, new_flows: u64, state: BackendState) -> BackendStatus {
        BackendStatus {
            address: std::net::Ipv4Addr::new(10, 20, 0, last).into(),
            port: 8080,
            weight: 2,
            effective_weight: if state == BackendState::Down { 0 } else { 2 },
            state,
            new_flows,
            packets_in: 10,
            bytes_in: 1000,
            packets_out: 8,
            bytes_out: 900,
            active_flows: 3,
            expected_share: 0.5,
            observed_share: 0.5,
            response_time_ms: None,
        }
    }

    /// A snapshot with two backends (one down), every kind of datapath
    /// counter, an interface and a forwarding path.
    fn fixed() -> Snapshot {
        let status = Status {
            bgp: None,
            program_id: Some(7),
            interfaces: vec![Attachment {
                interface: "lb0".into(),
                mode: crate::paths::Mode::Generic,
                reason: "asked".into(),
            }],
            paths: vec![PathReport {
                ingress: "lb0".into(),
                mode: crate::paths::Mode::Generic,
                egress: "lb1".into(),
                path: crate::paths::Path::Kernel,
                reason: "generic mode".into(),
            }],
            counters: BTreeMap::from([
                ("xdp_redirect".to_owned(), 40),
                ("kernel_egress".to_owned(), 2),
                ("fib_fallback".to_owned(), 0),
                ("no_backend".to_owned(), 5),
                ("csum_partial".to_owned(), 1),
                ("table_full".to_owned(), 9),
                ("stateless_reply".to_owned(), 4),
            ]),
            flood: FloodStatus {
                new_flow_rate_per_cpu: 10_000,
                half_open_timeout: 10,
                flow_entries: 24,
                flow_capacity: 1024,
                half_open_expired: 6,
            },
            services: vec![ServiceStatus {
                name: "web".into(),
                vip: std::net::Ipv4Addr::new(10, 10, 0, 100).into(),
                port: 80,
                protocol: Protocol::Tcp,
                forwarding: Default::default(),
                scheduler: Scheduler::Maglev,
                new_flows: 12,
                fairness: Some(0.98),
                announced: Some(true),
                backends: vec![backend(11, 5, BackendState::Up), backend(12, 7, BackendState::Down)],
            }],
        };
        Snapshot { status, flow_entries: 24, reloads_ok: 3, reloads_failed: 1 }
    }

    /// An agent with nothing configured and a datapath that reports nothing.
    fn empty() -> Snapshot {
        let status = Status {
            bgp: None,
            program_id: None,
            interfaces: Vec::new(),
            paths: Vec::new(),
            counters: BTreeMap::new(),
            flood: FloodStatus::default(),
            services: Vec::new(),
        };
        Snapshot { status, flow_entries: 0, reloads_ok: 0, reloads_failed: 0 }
    }

    /// What a scrape of the collector writes for `snap`.
    fn scrape(snap: Snapshot) -> String {
        let mut reg = Registry::default();
        reg.register_collector(Box::new(Fixed(snap)));
        let mut text = String::new();
        encode(&mut text, &reg).unwrap();
        text
    }

    /// The exposition as the exporter wrote it before the collector: a
    /// registry rebuilt per scrape, counters set with `inc_by` (the code as
    /// it was, less the health histograms and build info, which are
    /// registered the same way in both).
    fn before_collector(snap: &Snapshot) -> String {
        use prometheus_client::metrics::counter::Counter;
        let status = &snap.status;
        let mut reg = Registry::default();
        let conns = Family::<Labels, Counter>::default();
        let packets = Family::<Labels, Counter>::default();
        let bytes = Family::<Labels, Counter>::default();
        let up = Family::<Labels, Gauge>::default();
        let weight = Family::<Labels, Gauge>::default();
        let effective = Family::<Labels, Gauge>::default();
        let active = Family::<Labels, Gauge>::default();
        let svc_packets = Family::<Labels, Counter>::default();
        let fairness = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        for s in &status.services {
            let mut total = 0u64;
            for b in &s.backends {
                let be = std::net::SocketAddr::new(b.address, b.port).to_string();
                let l = labels(&[("service", &s.name), ("backend", &be)]);
                conns.get_or_create(&l).inc_by(b.new_flows);
                for (dir, p, by) in [("in", b.packets_in, b.bytes_in), ("out", b.packets_out, b.bytes_out)] {
                    let ld = labels(&[("service", &s.name), ("backend", &be), ("direction", dir)]);
                    packets.get_or_create(&ld).inc_by(p);
                    bytes.get_or_create(&ld).inc_by(by);
                }
                up.get_or_create(&l).set(i64::from(b.state != BackendState::Down));
                weight.get_or_create(&l).set(i64::from(b.weight));
                effective.get_or_create(&l).set(i64::from(b.effective_weight));
                active.get_or_create(&l).set(i64::try_from(b.active_flows).unwrap());
                total += b.packets_in + b.packets_out;
            }
            let l = labels(&[("service", &s.name)]);
            svc_packets.get_or_create(&l).inc_by(total);
            if let Some(f) = s.fairness {
                fairness.get_or_create(&l).set(f);
            }
        }
        let dropped = Family::<Labels, Counter>::default();
        let fallback = Family::<Labels, Counter>::default();
        let redirected = Counter::<u64>::default();
        let partial = Counter::<u64>::default();
        let stateless = Family::<Labels, Counter>::default();
        let icmp = Family::<Labels, Counter>::default();
        for (reason, v) in &status.counters {
            match reason.as_str() {
                "xdp_redirect" => {
                    redirected.inc_by(*v);
                }
                "flood_rate" | "table_full" | "stateless_reply" => {
                    stateless.get_or_create(&labels(&[("reason", reason)])).inc_by(*v);
                }
                "csum_partial" => {
                    partial.inc_by(*v);
                }
                "fib_fallback" | "kernel_egress" | "ttl_expired" | "too_big" | "vlan" => {
                    fallback.get_or_create(&labels(&[("reason", reason)])).inc_by(*v);
                }
                "icmp_to_client" | "icmp_to_backend" => {
                    icmp.get_or_create(&labels(&[("direction", &reason["icmp_".len()..])])).inc_by(*v);
                }
                _ => {
                    dropped.get_or_create(&labels(&[("reason", reason)])).inc_by(*v);
                }
            }
        }
        let modes = Family::<Labels, Gauge>::default();
        for a in &status.interfaces {
            modes.get_or_create(&labels(&[("interface", &a.interface), ("mode", a.mode.name())])).set(1);
        }
        let path = Family::<Labels, Gauge>::default();
        for r in &status.paths {
            path.get_or_create(&labels(&[
                ("ingress", &r.ingress),
                ("mode", r.mode.name()),
                ("egress", &r.egress),
                ("path", r.path.label()),
            ]))
            .set(1);
        }
        let entries = Gauge::<i64>::default();
        entries.set(i64::try_from(snap.flow_entries).unwrap());
        let reloads = Family::<Labels, Counter>::default();
        reloads.get_or_create(&labels(&[("result", "ok")])).inc_by(snap.reloads_ok);
        reloads.get_or_create(&labels(&[("result", "rejected")])).inc_by(snap.reloads_failed);

        reg.register("lb_backend_connections", "New flows scheduled onto the backend", conns);
        reg.register("lb_backend_packets", "Packets through the balancer per backend and direction", packets);
        reg.register("lb_backend_bytes", "Bytes (frames) through the balancer per backend and direction", bytes);
        reg.register("lb_backend_up", "1 while health checks consider the backend up", up);
        reg.register("lb_backend_weight", "Configured weight", weight);
        reg.register(
            "lb_backend_effective_weight",
            "Weight the scheduler uses now (0 when down or drained; slow start on a 10x scale)",
            effective,
        );
        reg.register("lb_backend_active_flows", "Flows open now (opened - closed - expired)", active);
        reg.register("lb_service_packets", "Packets through the balancer per service, both directions", svc_packets);
        reg.register("lb_service_fairness", "Jain's fairness index over weight-normalised new flows", fairness);
        reg.register("lb_dropped_packets", "Packets the datapath dropped, by reason", dropped);
        reg.register(
            "lb_kernel_fallback_packets",
            "Packets handed to the kernel's own forwarding, by reason (unresolved next hop, an egress that cannot take XDP redirects, expiring TTL, too big for the egress, VLAN-tagged)",
            fallback,
        );
        reg.register("lb_xdp_redirect_packets", "Rewritten packets that left by XDP redirect", redirected);
        reg.register(
            "lb_partial_checksum_packets",
            "Packets whose TCP/UDP checksum arrived unfinished (local senders behind a veth)",
            partial,
        );
        reg.register(
            "lb_stateless_packets",
            "Packets routed by consistent hash without a flow-table entry, by reason: a new flow above flood.new_flow_rate_per_cpu (flood_rate), a new flow that found the flow table full (table_full), a backend's packet whose flow has no entry (stateless_reply)",
            stateless,
        );
        reg.register("lb_icmp_translated_packets", "ICMP errors about balanced flows, translated and sent on: to_client (about a forwarded packet), to_backend (about a reply)", icmp);
        reg.register("lb_interface_xdp_mode", "The XDP mode in use per attached interface (always 1)", modes);
        reg.register(
            "lb_forwarding_path",
            "Path packets take from an ingress interface to an egress interface (always 1; see the path label)",
            path,
        );
        reg.register("lb_flow_table_entries", "Flow table entries (one per flow, two for a service whose backend endpoint another service owns), as of the last sweep", entries);
        let capacity = Gauge::<i64>::default();
        capacity.set(i64::from(status.flood.flow_capacity));
        reg.register("lb_flow_table_capacity", "Flow table size (conntrack_max)", capacity);
        let half_open = Counter::<u64>::default();
        half_open.inc_by(status.flood.half_open_expired);
        reg.register(
            "lb_half_open_expired_flows",
            "Half-open flows (no completed handshake) expired after flood.half_open_timeout, since lbd started",
            half_open,
        );
        reg.register("lb_config_reloads", "Configuration reloads by result", reloads);
        let announced = Family::<Labels, Gauge>::default();
        for s in &status.services {
            if let Some(a) = s.announced {
                announced
                    .get_or_create(&labels(&[("service", &s.name), ("vip", &s.vip.to_string())]))
                    .set(i64::from(a));
            }
        }
        reg.register(
            "lb_vip_announced",
            "1 while the service's VIP is announced over BGP (originated, and sent on an established session)",
            announced,
        );
        let mut out = String::new();
        encode(&mut out, &reg).unwrap();
        out
    }

    /// An exposition as (family, its HELP/TYPE/UNIT lines, its samples
    /// sorted) in the order written: a registry's family keeps its samples
    /// in a hash map, so their order is not part of the format.
    fn parsed(text: &str) -> Vec<(String, Vec<String>, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
        for line in text.lines() {
            if line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap().to_owned();
                out.push((name, vec![line.to_owned()], Vec::new()));
                continue;
            }
            let (_, meta, samples) = out.last_mut().unwrap_or_else(|| panic!("{line:?} before any family"));
            if line.starts_with('#') { meta } else { samples }.push(line.to_owned());
        }
        for (_, _, samples) in &mut out {
            samples.sort();
        }
        out
    }

    #[test]
    fn the_collector_writes_what_the_rebuilt_registry_wrote() {
        for snap in [fixed(), empty()] {
            let now = scrape(snap.clone());
            let before = before_collector(&snap);
            assert_eq!(parsed(&now), parsed(&before), "collector:\n{now}\nbefore:\n{before}");
            assert!(now.ends_with("# EOF\n"), "{now}");
        }
        // Without any datapath counter the unlabelled counters still have
        // their sample.
        let text = scrape(empty());
        for line in
            ["lb_xdp_redirect_packets_total 0", "lb_partial_checksum_packets_total 0", "lb_flow_table_entries 0"]
        {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
    }

    #[test]
    fn a_scrape_reads_the_snapshot_with_every_series_name_and_label() {
        let text = scrape(fixed());
        for line in [
            "# TYPE lb_backend_connections counter",
            "lb_backend_connections_total{service=\"web\",backend=\"10.20.0.11:8080\"} 5",
            "lb_backend_connections_total{service=\"web\",backend=\"10.20.0.12:8080\"} 7",
            "lb_backend_packets_total{service=\"web\",backend=\"10.20.0.11:8080\",direction=\"out\"} 8",
            "lb_backend_bytes_total{service=\"web\",backend=\"10.20.0.12:8080\",direction=\"in\"} 1000",
            "lb_backend_up{service=\"web\",backend=\"10.20.0.12:8080\"} 0",
            "lb_backend_effective_weight{service=\"web\",backend=\"10.20.0.12:8080\"} 0",
            "lb_backend_active_flows{service=\"web\",backend=\"10.20.0.11:8080\"} 3",
            "lb_service_packets_total{service=\"web\"} 36",
            "lb_service_fairness{service=\"web\"} 0.98",
            "lb_dropped_packets_total{reason=\"no_backend\"} 5",
            "lb_kernel_fallback_packets_total{reason=\"kernel_egress\"} 2",
            "lb_xdp_redirect_packets_total 40",
            "lb_partial_checksum_packets_total 1",
            "lb_flow_table_entries 24",
            "lb_config_reloads_total{result=\"rejected\"} 1",
            "lb_config_reloads_total{result=\"ok\"} 3",
            "lb_vip_announced{service=\"web\",vip=\"10.10.0.100\"} 1",
            "lb_interface_xdp_mode{interface=\"lb0\",mode=\"generic\"} 1",
            "lb_forwarding_path{ingress=\"lb0\",mode=\"generic\",egress=\"lb1\",path=\"kernel\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        // Every family the collector writes is a documented series.
        for name in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()) {
            let exposed = if text.contains(&format!("# TYPE {name} counter")) {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            assert!(SERIES.contains(&exposed.as_str()), "{exposed} is not in SERIES");
        }
    }

    #[test]
    fn prometheus_text_names_counters_with_total_and_drops_eof() {
        let om = "# HELP lb_x Things.\n# TYPE lb_x counter\nlb_x_total{a=\"b\"} 3\n# HELP lb_g A gauge.\n# TYPE lb_g gauge\nlb_g 1\n# EOF\n";
        assert_eq!(
            to_prometheus_text(om),
            "# HELP lb_x_total Things.\n# TYPE lb_x_total counter\nlb_x_total{a=\"b\"} 3\n# HELP lb_g A gauge.\n# TYPE lb_g gauge\nlb_g 1\n"
        );
    }
}

//! Prometheus / OpenMetrics exporter.
//!
//! A prometheus-client registry built once: a collector
//! (`prometheus_client::collector::Collector`, writing constant counters and
//! gauges) that reads the agent's state and the BPF maps at every scrape
//! (per-CPU counters summed then, so scraping costs the datapath nothing),
//! plus the health-check histograms. The HTTP side is a minimal, read-only
//! GET handler: `/metrics`, and the status page (`page`): `/` and
//! `/status.json`.

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
    "lb_xdp_tx_packets_total",
    "lb_partial_checksum_packets_total",
    "lb_interface_xdp_mode",
    "lb_forwarding_path",
    "lb_flow_table_entries",
    "lb_flow_table_capacity",
    "lb_half_open_expired_flows_total",
    "lb_flow_sweep_duration_seconds",
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
    page,
    report::{self, Status},
};

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// What one scrape reads: the status report and the agent's own counters.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub status: Status,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
}

impl Snapshot {
    pub fn of(agent: &Agent) -> Result<Self, String> {
        Ok(Self {
            status: report::status(agent).map_err(|e| e.to_string())?,
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

/// Help of `lb_flow_sweep_duration_seconds`.
const ENTRIES_HELP: &str = "Flow table entries per address family (one per flow, two for a service whose backend endpoint another service owns), as the datapath counts them against the table's capacity";
const CAPACITY_HELP: &str = "Entries the address family's flow table may hold (conntrack_max, conntrack_max_ipv6; an adopted table's own size until a clean stop): new flows beyond it go without an entry (lb_stateless_packets_total{reason=\"table_full\"})";
const SWEEP_HELP: &str = "How long the last complete sweep of the flow tables took, start to end, pauses between its parts included (none before the first); longer than the sweep interval (5 s, less with a short flood.half_open_timeout) means flows outlive their timeouts";

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
/// The help texts of the XDP-forwarding counters (the test's rebuilt
/// registry registers the same).
const REDIRECT_HELP: &str = "Rewritten packets that left by XDP: redirected to their egress, or sent back out of the interface they came in on (counted again in lb_xdp_tx_packets_total)";
const TX_HELP: &str = "Of the packets in lb_xdp_redirect_packets_total, those sent back out of the interface they came in on by XDP_TX (a one-arm gateway)";

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
    let mut redirected = Samples::new("lb_xdp_redirect_packets", REDIRECT_HELP, Counter);
    let mut sent_back = Samples::new("lb_xdp_tx_packets", TX_HELP, Counter);
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
    let (mut redirects, mut txs, mut partials) = (0, 0, 0);
    for (reason, &v) in &status.counters {
        match reason.as_str() {
            "xdp_redirect" => redirects = v,
            "xdp_tx" => txs = v,
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
    sent_back.push(Labels::new(), Value::Counter(txs));
    partial.push(Labels::new(), Value::Counter(partials));
    let mut modes = Samples::new(
        "lb_interface_xdp_mode",
        "The XDP mode per configured interface: 1 while the program is attached in it, 0 while the interface is missing (gone, or replaced and not yet attached again)",
        Gauge,
    );
    for a in &status.interfaces {
        modes
            .push(labels(&[("interface", &a.interface), ("mode", a.mode.name())]), Value::Gauge(i64::from(!a.missing)));
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
    let tables = &status.flood.flow_tables;
    let mut entries = Samples::new("lb_flow_table_entries", ENTRIES_HELP, Gauge);
    let mut capacity = Samples::new("lb_flow_table_capacity", CAPACITY_HELP, Gauge);
    for (family, t) in [("ipv4", tables.ipv4), ("ipv6", tables.ipv6)] {
        entries.push(labels(&[("family", family)]), Value::Gauge(i64::try_from(t.entries).unwrap_or(i64::MAX)));
        capacity.push(labels(&[("family", family)]), Value::Gauge(i64::from(t.capacity)));
    }
    let mut half_open = Samples::new(
        "lb_half_open_expired_flows",
        "Half-open flows (no completed handshake) expired after flood.half_open_timeout, since lbd started",
        Counter,
    );
    half_open.push(Labels::new(), Value::Counter(status.flood.half_open_expired));
    let mut sweep = Samples::new("lb_flow_sweep_duration_seconds", SWEEP_HELP, Gauge);
    if let Some(ms) = status.flood.last_sweep_ms {
        sweep.push(Labels::new(), Value::GaugeF(Duration::from_millis(ms).as_secs_f64()));
    }
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
        sent_back,
        partial,
        stateless,
        icmp,
        modes,
        path,
        entries,
        capacity,
        half_open,
        sweep,
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

/// What the listener answers from: the exporter's registry (`/metrics`)
/// and the status report (`/status.json`; the page at `/` is a constant).
struct Site {
    registry: Registry,
    status: Box<dyn Fn() -> Result<Status, String> + Send + Sync>,
}

impl Site {
    fn of(agent: Arc<Mutex<Agent>>) -> Self {
        Self {
            registry: registry(agent.clone()),
            status: Box::new(move || {
                let a = agent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                report::status(&a).map_err(|e| e.to_string())
            }),
        }
    }
}

/// Serve, read-only, until the task is dropped: `GET /metrics` (the
/// exporter), `GET /status.json` (the status report as `lbctl status
/// --json` prints it) and `GET /` (the status page, which reads
/// `/status.json`).
pub async fn serve(listener: TcpListener, agent: Arc<Mutex<Agent>>) {
    serve_site(listener, Arc::new(Site::of(agent))).await;
}

async fn serve_site(listener: TcpListener, site: Arc<Site>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let site = site.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, site).await {
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

/// One HTTP answer.
#[derive(Debug)]
struct Reply {
    status: &'static str,
    content_type: &'static str,
    /// Header lines besides Content-Type, Content-Length and Connection.
    headers: &'static [(&'static str, &'static str)],
    body: String,
}

impl Reply {
    fn text(status: &'static str, headers: &'static [(&'static str, &'static str)], body: String) -> Self {
        Self { status, content_type: "text/plain; charset=utf-8", headers, body }
    }
}

/// What the page may load: itself (inline script and style) and, by
/// fetch, this listener (`/status.json`); nothing from anywhere else.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
     connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The answer to `method target` (only GET; the query string ignored).
async fn answer(site: &Arc<Site>, method: &str, target: &str, openmetrics: bool) -> Reply {
    if method != "GET" {
        return Reply::text(
            "405 Method Not Allowed",
            &[("Allow", "GET")],
            "only GET: this listener is read-only\n".into(),
        );
    }
    let site = site.clone();
    match target.split('?').next().unwrap_or("") {
        "/" => Reply {
            status: "200 OK",
            content_type: "text/html; charset=utf-8",
            headers: &[
                ("Cache-Control", "no-store"),
                ("Content-Security-Policy", PAGE_POLICY),
                ("X-Content-Type-Options", "nosniff"),
            ],
            body: page::HTML.to_owned(),
        },
        "/status.json" => {
            let r = tokio::task::spawn_blocking(move || {
                (site.status)().and_then(|s| page::status_json(&s).map_err(|e| e.to_string()))
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            match r {
                Ok(json) => Reply {
                    status: "200 OK",
                    content_type: "application/json",
                    headers: &[("Cache-Control", "no-store")],
                    body: json,
                },
                Err(e) => Reply::text("500 Internal Server Error", &[("Cache-Control", "no-store")], format!("{e}\n")),
            }
        }
        "/metrics" => {
            let r = tokio::task::spawn_blocking(move || {
                let mut text = String::new();
                encode(&mut text, &site.registry).map(|()| text).map_err(|_| "reading the datapath failed".to_owned())
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            match r {
                Ok(text) if openmetrics => Reply {
                    status: "200 OK",
                    content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    headers: &[],
                    body: text,
                },
                Ok(text) => Reply {
                    status: "200 OK",
                    content_type: "text/plain; version=0.0.4; charset=utf-8",
                    headers: &[],
                    body: to_prometheus_text(&text),
                },
                Err(e) => Reply::text("500 Internal Server Error", &[], format!("{e}\n")),
            }
        }
        _ => Reply::text(
            "404 Not Found",
            &[],
            "not found: lbd serves / (the status page), /status.json and /metrics\n".into(),
        ),
    }
}

async fn handle(mut stream: TcpStream, site: Arc<Site>) -> std::io::Result<()> {
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
    let reply = answer(&site, method, target, openmetrics).await;
    let mut resp = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n",
        reply.status,
        reply.content_type,
        reply.body.len()
    );
    for (name, value) in reply.headers {
        resp.push_str(&format!("{name}: {value}\r\n"));
    }
    resp.push_str("Connection: close\r\n\r\n");
    resp.push_str(&reply.body);
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await?;
    // Read what the client may still send (a request body) until it
    // closes, briefly: closing with unread data would reset the
    // connection, and the client could lose the answer.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut left = 64usize << 10;
        while let Ok(n @ 1..) = stream.read(&mut chunk).await {
            left = left.saturating_sub(n);
            if left == 0 {
                break;
            }
        }
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        config::Protocol,
        dataplane::Attachment,
        paths::PathReport,
        report::{BackendStatus, FloodStatus, FlowTableStatus, FlowTablesStatus, ServiceStatus},
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
            slow_start: false,
        }
    }

    /// A snapshot with two backends (one down), every kind of datapath
    /// counter, an interface and a forwarding path.
    fn fixed() -> Snapshot {
        let status = Status {
            bgp: None,
            program_id: Some(7),
            interfaces: vec![
                Attachment {
                    interface: "lb0".into(),
                    mode: crate::paths::Mode::Generic,
                    reason: "asked".into(),
                    missing: false,
                    tc: Some(crate::dataplane::TcLink::Pinned),
                },
                Attachment {
                    interface: "lb2".into(),
                    mode: crate::paths::Mode::Native,
                    reason: "auto".into(),
                    missing: true,
                    tc: None,
                },
            ],
            paths: vec![PathReport {
                ingress: "lb0".into(),
                mode: crate::paths::Mode::Generic,
                egress: "lb1".into(),
                path: crate::paths::Path::Kernel,
                reason: "generic mode".into(),
            }],
            counters: BTreeMap::from([
                ("xdp_redirect".to_owned(), 40),
                ("xdp_tx".to_owned(), 15),
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
                flow_tables: FlowTablesStatus {
                    ipv4: FlowTableStatus { entries: 20, capacity: 1024 },
                    ipv6: FlowTableStatus { entries: 4, capacity: 256 },
                },
                half_open_expired: 6,
                last_sweep_ms: Some(1250),
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
        Snapshot { status, reloads_ok: 3, reloads_failed: 1 }
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
        Snapshot { status, reloads_ok: 0, reloads_failed: 0 }
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
        let sent_back = Counter::<u64>::default();
        let partial = Counter::<u64>::default();
        let stateless = Family::<Labels, Counter>::default();
        let icmp = Family::<Labels, Counter>::default();
        for (reason, v) in &status.counters {
            match reason.as_str() {
                "xdp_redirect" => {
                    redirected.inc_by(*v);
                }
                "xdp_tx" => {
                    sent_back.inc_by(*v);
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
            modes
                .get_or_create(&labels(&[("interface", &a.interface), ("mode", a.mode.name())]))
                .set(i64::from(!a.missing));
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
        let entries = Family::<Labels, Gauge>::default();
        let capacity = Family::<Labels, Gauge>::default();
        let tables = &snap.status.flood.flow_tables;
        for (family, t) in [("ipv4", tables.ipv4), ("ipv6", tables.ipv6)] {
            entries.get_or_create(&labels(&[("family", family)])).set(i64::try_from(t.entries).unwrap());
            capacity.get_or_create(&labels(&[("family", family)])).set(i64::from(t.capacity));
        }
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
        reg.register("lb_xdp_redirect_packets", REDIRECT_HELP, redirected);
        reg.register("lb_xdp_tx_packets", TX_HELP, sent_back);
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
        reg.register("lb_interface_xdp_mode", "The XDP mode per configured interface: 1 while the program is attached in it, 0 while the interface is missing (gone, or replaced and not yet attached again)", modes);
        reg.register(
            "lb_forwarding_path",
            "Path packets take from an ingress interface to an egress interface (always 1; see the path label)",
            path,
        );
        reg.register("lb_flow_table_entries", ENTRIES_HELP, entries);
        reg.register("lb_flow_table_capacity", CAPACITY_HELP, capacity);
        let half_open = Counter::<u64>::default();
        half_open.inc_by(status.flood.half_open_expired);
        reg.register(
            "lb_half_open_expired_flows",
            "Half-open flows (no completed handshake) expired after flood.half_open_timeout, since lbd started",
            half_open,
        );
        // One unlabelled sample once there is a value; before, the family
        // alone (its HELP and TYPE), as the collector writes it.
        if let Some(ms) = status.flood.last_sweep_ms {
            let sweep = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
            sweep.set(Duration::from_millis(ms).as_secs_f64());
            reg.register("lb_flow_sweep_duration_seconds", SWEEP_HELP, sweep);
        } else {
            let sweep = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
            reg.register("lb_flow_sweep_duration_seconds", SWEEP_HELP, sweep);
        }
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
        for line in [
            "lb_xdp_redirect_packets_total 0",
            "lb_xdp_tx_packets_total 0",
            "lb_partial_checksum_packets_total 0",
            "lb_flow_table_entries{family=\"ipv4\"} 0",
            "lb_flow_table_entries{family=\"ipv6\"} 0",
        ] {
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
            "lb_xdp_tx_packets_total 15",
            "lb_partial_checksum_packets_total 1",
            "lb_flow_table_entries{family=\"ipv4\"} 20",
            "lb_flow_table_entries{family=\"ipv6\"} 4",
            "lb_flow_table_capacity{family=\"ipv4\"} 1024",
            "lb_flow_table_capacity{family=\"ipv6\"} 256",
            "lb_config_reloads_total{result=\"rejected\"} 1",
            "lb_config_reloads_total{result=\"ok\"} 3",
            "lb_vip_announced{service=\"web\",vip=\"10.10.0.100\"} 1",
            "lb_interface_xdp_mode{interface=\"lb0\",mode=\"generic\"} 1",
            "lb_interface_xdp_mode{interface=\"lb2\",mode=\"native\"} 0",
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

    /// A listener serving `snap` (its status for `/status.json`, its
    /// families for `/metrics`), or failing to read the status.
    fn site(snap: Snapshot, status_fails: bool) -> Arc<Site> {
        let mut registry = Registry::default();
        let status = snap.status.clone();
        registry.register_collector(Box::new(Fixed(snap)));
        Arc::new(Site {
            registry,
            status: Box::new(
                move || if status_fails { Err("reading the datapath failed".into()) } else { Ok(status.clone()) },
            ),
        })
    }

    /// One request over TCP to a listener serving `site`: (status line,
    /// header lines, body).
    fn exchange(site: Arc<Site>, request: &[u8]) -> (String, Vec<String>, String) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = tokio::spawn(serve_site(listener, site));
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(request).await.unwrap();
            let mut raw = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut raw)).await.unwrap().unwrap();
            server.abort();
            let raw = String::from_utf8(raw).unwrap();
            let (head, body) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no head in {raw:?}"));
            let mut lines = head.split("\r\n").map(str::to_owned);
            let status = lines.next().unwrap();
            let headers: Vec<String> = lines.collect();
            let length = headers.iter().find_map(|h| h.strip_prefix("Content-Length: ")).unwrap();
            assert_eq!(length.parse::<usize>().unwrap(), body.len(), "Content-Length");
            (status, headers, body.to_owned())
        })
    }

    fn get(site: Arc<Site>, path: &str) -> (String, Vec<String>, String) {
        exchange(site, format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
    }

    /// A status with what the page shows beyond `fixed`: BGP, a response
    /// time, a backend in slow start, an IPv6 service.
    fn rich() -> Snapshot {
        let mut snap = fixed();
        let st = &mut snap.status;
        st.bgp = Some(crate::bgp::BgpStatus {
            peers: vec![crate::bgp::PeerStatus {
                address: std::net::Ipv4Addr::new(10, 0, 0, 1).into(),
                asn: 65000,
                state: "Established".into(),
            }],
            originated: [st.services[0].vip].into(),
            error: None,
        });
        st.services[0].backends[0].response_time_ms = Some(1.234_567_890_123);
        st.services[0].backends[0].slow_start = true;
        st.services[0].backends[1].observed_share = 1.0 / 3.0;
        let mut six = st.services[0].clone();
        six.name = "web6".into();
        six.vip = "fd00:10::100".parse().unwrap();
        six.fairness = None;
        six.announced = Some(false);
        for (b, last) in six.backends.iter_mut().zip(["fd00:20::11", "fd00:20::12"]) {
            b.address = last.parse().unwrap();
        }
        st.services.push(six);
        snap
    }

    #[test]
    fn status_json_is_what_lbctl_status_json_prints() {
        for snap in [rich(), fixed(), empty()] {
            let status = snap.status.clone();
            // The control API's way: the report as a JSON value, in a
            // response line; lbctl reads the line and pretty-prints the
            // value (`println!`).
            let resp =
                crate::api::Response { ok: true, result: Some(serde_json::to_value(&status).unwrap()), error: None };
            let line = serde_json::to_string(&resp).unwrap();
            let read: crate::api::Response = serde_json::from_str(&line).unwrap();
            let lbctl = format!("{}\n", serde_json::to_string_pretty(&read.result.unwrap()).unwrap());

            let (code, headers, body) = get(site(snap, false), "/status.json");
            assert_eq!(code, "HTTP/1.1 200 OK");
            assert!(headers.iter().any(|h| h == "Content-Type: application/json"), "{headers:?}");
            assert!(headers.iter().any(|h| h == "Cache-Control: no-store"), "{headers:?}");
            assert_eq!(body, lbctl, "the bytes lbctl status --json prints");
            assert_eq!(body, page::status_json(&status).unwrap());
            // And it reads back as the report, slow start included.
            assert_eq!(serde_json::from_str::<Status>(&body).unwrap(), status);
        }
        let v: serde_json::Value = serde_json::from_str(&page::status_json(&rich().status).unwrap()).unwrap();
        assert_eq!(v["services"][0]["backends"][0]["slow_start"], true);
        assert_eq!(v["services"][1]["backends"][0]["address"], "fd00:20::11");
        // A report written before the field existed still reads.
        let mut old = v.clone();
        old["services"][0]["backends"][0].as_object_mut().unwrap().remove("slow_start");
        let old: Status = serde_json::from_value(old).unwrap();
        assert!(!old.services[0].backends[0].slow_start);
    }

    #[test]
    fn the_page_is_one_self_contained_document_with_the_dom_contract() {
        let (code, headers, body) = get(site(fixed(), false), "/");
        assert_eq!(code, "HTTP/1.1 200 OK");
        assert!(headers.iter().any(|h| h == "Content-Type: text/html; charset=utf-8"), "{headers:?}");
        assert!(headers.iter().any(|h| h.starts_with("Content-Security-Policy: default-src 'none';")), "{headers:?}");
        assert_eq!(body, page::HTML);
        assert!(body.len() < 25 * 1024, "{} bytes", body.len());
        // Nothing loaded from elsewhere: no URL with a scheme or a
        // protocol-relative one, no src= or @import; the only links are
        // to status.json and the empty data: icon.
        let lower = body.to_ascii_lowercase();
        for bad in ["http:", "https:", "://", "\"//", "'//", "src=", "@import", "url("] {
            assert!(!lower.contains(bad), "the page contains {bad:?}");
        }
        for (i, _) in lower.match_indices("href=") {
            let target = &lower[i + "href=".len()..];
            assert!(target.starts_with("\"status.json\"") || target.starts_with("\"data:,\""), "{}", &target[..40]);
        }
        assert!(body.contains(r#"fetch("status.json""#), "relative, so it also works behind a path prefix");
        // The markers the browser test reads.
        for marker in [
            r#"<body data-refreshes="0">"#,
            "document.body.dataset.refreshes = String(++refreshes)",
            r#"<section class="service">"#,
            r#"el.dataset.service = s.name"#,
            r#"class="announced""#,
            r#""announced" : s.announced === false ? "withdrawn" : "-""#,
            r#"<tr class="backend">"#,
            "tr.dataset.service = s.name",
            "tr.dataset.backend = addr",
            r#"<td class="state">"#,
            r#"b.state === "up" && b.slow_start ? "slow-start" : b.state"#,
            r#"<td class="new-flows">"#,
            r#"<td class="weight">"#,
            r#"<td class="effective-weight">"#,
            r#"<td class="active-flows">"#,
            r#"<td class="rate">"#,
            r#"<td class="response-time">"#,
            r#"tr.className = "counter""#,
            "tr.dataset.counter = name",
            r#"b.className = "value""#,
            "lbd unreachable since",
            "<svg",
        ] {
            assert!(body.contains(marker), "the page lacks {marker:?}");
        }
    }

    #[test]
    fn only_get_of_the_three_paths_is_answered() {
        for (req, want) in [
            ("POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nstop", "HTTP/1.1 405 Method Not Allowed"),
            ("POST /status.json HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"),
            ("PUT /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"),
            ("HEAD / HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"),
            ("DELETE /nope HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"),
            ("GET /nope HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"),
            ("GET /index.html HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"),
            ("GET /status.json/ HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"),
            ("GET /status.json?t=1 HTTP/1.1\r\n\r\n", "HTTP/1.1 200 OK"),
            ("GET /?refresh=1 HTTP/1.1\r\n\r\n", "HTTP/1.1 200 OK"),
        ] {
            let (code, headers, _) = exchange(site(fixed(), false), req.as_bytes());
            assert_eq!(code, want, "{req:?}");
            if want.contains("405") {
                assert!(headers.iter().any(|h| h == "Allow: GET"), "{req:?}: {headers:?}");
            }
        }
        // /metrics as before: Prometheus text, or OpenMetrics when asked.
        let (code, headers, body) = get(site(fixed(), false), "/metrics");
        assert_eq!(code, "HTTP/1.1 200 OK");
        assert!(headers.iter().any(|h| h == "Content-Type: text/plain; version=0.0.4; charset=utf-8"), "{headers:?}");
        assert!(body.lines().any(|l| l == "lb_xdp_redirect_packets_total 40"), "{body}");
        let (_, headers, body) = exchange(
            site(fixed(), false),
            b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n",
        );
        assert!(headers.iter().any(|h| h.starts_with("Content-Type: application/openmetrics-text")), "{headers:?}");
        assert!(body.ends_with("# EOF\n"), "{body}");
        // A status that cannot be read is an error, not a stale document.
        let (code, headers, body) = get(site(fixed(), true), "/status.json");
        assert_eq!(code, "HTTP/1.1 500 Internal Server Error");
        assert!(headers.iter().any(|h| h == "Cache-Control: no-store"), "{headers:?}");
        assert_eq!(body, "reading the datapath failed\n");
    }
}

//! Prometheus / OpenMetrics exporter.
//!
//! Every scrape builds the exposition from the agent's state and the BPF
//! maps at that moment (per-CPU counters summed then), so scraping costs the
//! datapath nothing.

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
    "lb_health_check_duration_seconds",
    "lb_health_check_failures_total",
    "lb_config_reloads_total",
    "lb_build_info",
];

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use tracing::{debug, warn};

use crate::{agent::Agent, report};

use crate::health::Labels;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// The exposition (OpenMetrics text) of the agent's state now.
pub fn exposition(agent: &Agent) -> Result<String, String> {
    let status = report::status(agent).map_err(|e| e.to_string())?;
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
            let be = format!("{}:{}", b.address, b.port);
            let l = labels(&[("service", &s.name), ("backend", &be)]);
            conns.get_or_create(&l).inc_by(b.new_flows);
            for (dir, p, by) in [("in", b.packets_in, b.bytes_in), ("out", b.packets_out, b.bytes_out)] {
                let ld = labels(&[("service", &s.name), ("backend", &be), ("direction", dir)]);
                packets.get_or_create(&ld).inc_by(p);
                bytes.get_or_create(&ld).inc_by(by);
            }
            up.get_or_create(&l).set(i64::from(b.state != crate::agent::BackendState::Down));
            weight.get_or_create(&l).set(i64::from(b.weight));
            effective.get_or_create(&l).set(i64::from(b.effective_weight));
            active.get_or_create(&l).set(b.active_flows as i64);
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
    for (reason, v) in &status.counters {
        match reason.as_str() {
            "xdp_redirect" => {
                redirected.inc_by(*v);
            }
            "csum_partial" => {
                partial.inc_by(*v);
            }
            "fib_fallback" | "kernel_egress" | "ttl_expired" => {
                fallback.get_or_create(&labels(&[("reason", reason)])).inc_by(*v);
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
    entries.set(agent.flow_entries as i64);
    let reloads = Family::<Labels, Counter>::default();
    reloads.get_or_create(&labels(&[("result", "ok")])).inc_by(agent.reloads_ok);
    reloads.get_or_create(&labels(&[("result", "rejected")])).inc_by(agent.reloads_failed);

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
        "Rewritten packets handed to the kernel's own forwarding, by reason (unresolved next hop, an egress that cannot take XDP redirects, expiring TTL)",
        fallback,
    );
    reg.register("lb_xdp_redirect_packets", "Rewritten packets that left by XDP redirect", redirected);
    reg.register(
        "lb_partial_checksum_packets",
        "Packets whose TCP/UDP checksum arrived unfinished (local senders behind a veth)",
        partial,
    );
    reg.register("lb_interface_xdp_mode", "The XDP mode in use per attached interface (always 1)", modes);
    reg.register(
        "lb_forwarding_path",
        "Path packets take from an ingress interface to an egress interface (always 1; see the path label)",
        path,
    );
    reg.register("lb_flow_table_entries", "Flow table entries (two per flow), as of the last sweep", entries);
    reg.register(
        "lb_health_check_duration_seconds",
        "Duration of successful health checks",
        agent.health_metrics.duration.clone(),
    );
    reg.register("lb_health_check_failures", "Failed health checks", agent.health_metrics.failures.clone());
    reg.register("lb_config_reloads", "Configuration reloads by result", reloads);
    // A gauge fixed at 1 rather than an OpenMetrics `info` family: the
    // Prometheus text-format tools (promtool) know no `info` type.
    let build = Family::<Labels, Gauge>::default();
    build.get_or_create(&labels(&[("version", env!("CARGO_PKG_VERSION"))])).set(1);
    reg.register("lb_build_info", "Build information (always 1)", build);
    let mut out = String::new();
    encode(&mut out, &reg).map_err(|e| e.to_string())?;
    Ok(out)
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
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let agent = agent.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, agent).await {
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

async fn handle(mut stream: TcpStream, agent: Arc<Mutex<Agent>>) -> std::io::Result<()> {
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
            let a = agent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            exposition(&a)
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
    use super::*;

    #[test]
    fn prometheus_text_names_counters_with_total_and_drops_eof() {
        let om = "# HELP lb_x Things.\n# TYPE lb_x counter\nlb_x_total{a=\"b\"} 3\n# HELP lb_g A gauge.\n# TYPE lb_g gauge\nlb_g 1\n# EOF\n";
        assert_eq!(
            to_prometheus_text(om),
            "# HELP lb_x_total Things.\n# TYPE lb_x_total counter\nlb_x_total{a=\"b\"} 3\n# HELP lb_g A gauge.\n# TYPE lb_g gauge\nlb_g 1\n"
        );
    }
}

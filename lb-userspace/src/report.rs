//! The status report: what `lbctl status`, `lbctl watch` and the metrics
//! exporter show (per service and backend: state, weights, shares, counters,
//! Jain's fairness index; the forwarding paths and datapath counters). Its
//! own module so that the API that serves it and the exporter that reads
//! it both depend on it, and it on neither.
use std::{collections::BTreeMap, net::IpAddr};

use serde::{Deserialize, Serialize};

use crate::{
    agent::{Agent, BackendState},
    config::{Forwarding, Protocol},
    dataplane::Attachment,
    sched::Scheduler,
};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BackendStatus {
    pub address: IpAddr,
    pub port: u16,
    /// Configured weight.
    pub weight: u32,
    /// The weight the scheduler uses now (0 when down or drained; ramping
    /// during slow start, on a scale of 10x the configured weight).
    pub effective_weight: u32,
    pub state: BackendState,
    pub new_flows: u64,
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    /// Flows open now (opened - closed - expired).
    pub active_flows: u64,
    /// weight / sum of weights.
    pub expected_share: f64,
    /// This backend's new flows / the service's new flows (0 when none yet).
    pub observed_share: f64,
    /// Moving average of the health probes' response time (for http, the
    /// time to the response's first line), in milliseconds; None without
    /// probes or before the first successful one.
    #[serde(default)]
    pub response_time_ms: Option<f64>,
    /// True while the backend is up (not down, not drained) and its
    /// effective weight still ramps under the service's `slow_start`.
    #[serde(default)]
    pub slow_start: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ServiceStatus {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// `nat` or `dsr`.
    #[serde(default)]
    pub forwarding: Forwarding,
    pub scheduler: Scheduler,
    pub new_flows: u64,
    /// Jain's fairness index over weight-normalised new flows; None before
    /// the first flow.
    pub fairness: Option<f64>,
    /// Whether the VIP is announced over BGP now (originated and sent on
    /// an established session); none without a `bgp:` section.
    #[serde(default)]
    pub announced: Option<bool>,
    pub backends: Vec<BackendStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Status {
    /// Kernel id of the XDP program now attached (a restart or upgrade
    /// swaps in a new one).
    pub program_id: Option<u32>,
    pub interfaces: Vec<Attachment>,
    /// Which path packets take from each attached interface to each
    /// (XDP redirect or the kernel's forwarding), and why.
    #[serde(default)]
    pub paths: Vec<crate::paths::PathReport>,
    /// Datapath counters by name: drops and kernel-path packets by reason,
    /// XDP redirects, unfinished checksums.
    pub counters: BTreeMap<String, u64>,
    /// Flood protection: what is in force and what it did.
    #[serde(default)]
    pub flood: FloodStatus,
    /// BGP sessions and announcements; none without a `bgp:` section.
    #[serde(default)]
    pub bgp: Option<crate::bgp::BgpStatus>,
    pub services: Vec<ServiceStatus>,
}

/// Flood protection in `lbctl status` and the metrics.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FloodStatus {
    /// New flows per second and CPU that get a flow-table entry (0: no limit).
    pub new_flow_rate_per_cpu: u32,
    pub half_open_timeout: u32,
    /// Flow-table entries now, both families together (as the datapath
    /// counts them), and the IPv4 table's size (`conntrack_max`); each
    /// table's own, which is what fills, in `flow_tables`.
    pub flow_entries: u64,
    pub flow_capacity: u32,
    /// Each family's flow table: entries now and the entries it may hold
    /// (`conntrack_max`, `conntrack_max_ipv6`). A table that is full
    /// routes its family's new flows without an entry (`table_full`)
    /// while the other table may have room.
    #[serde(default)]
    pub flow_tables: FlowTablesStatus,
    /// Half-open flows expired early since lbd started.
    pub half_open_expired: u64,
    /// How long the last complete sweep of the flow tables took, start to
    /// end, in ms (none yet: lbd has not finished one). A sweep longer than
    /// its interval means closed and idle flows stay longer than their
    /// timeouts say.
    #[serde(default)]
    pub last_sweep_ms: Option<u64>,
}

/// The two flow tables in [`FloodStatus`].
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FlowTablesStatus {
    pub ipv4: FlowTableStatus,
    pub ipv6: FlowTableStatus,
}

/// One flow table: entries now (as the datapath counts them against its
/// limit) and the entries it may hold.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FlowTableStatus {
    pub entries: u64,
    pub capacity: u32,
}

/// Jain's fairness index `(sum x)^2 / (n * sum x^2)` over `x`; None when
/// there is nothing to judge (no values or all zero).
pub fn jain(x: &[f64]) -> Option<f64> {
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if x.is_empty() || sq == 0.0 {
        return None;
    }
    Some(sum * sum / (x.len() as f64 * sq))
}

/// Build the status report.
pub fn status(agent: &Agent) -> Result<Status, crate::dataplane::DataplaneError> {
    let dp = &agent.dp;
    let mut services = Vec::new();
    for s in dp.services() {
        let total_weight: u64 = s.backends.iter().map(|b| u64::from(b.config.weight)).sum();
        let mut backends = Vec::new();
        for b in &s.backends {
            let st = dp.backend_stats(b.id)?;
            let state = agent.state_of(&s.config.name, &b.config);
            backends.push(BackendStatus {
                address: b.config.address,
                port: b.config.port,
                weight: b.config.weight,
                effective_weight: b.runtime.weight,
                state,
                new_flows: st.new_flows,
                packets_in: st.packets_in,
                bytes_in: st.bytes_in,
                packets_out: st.packets_out,
                bytes_out: st.bytes_out,
                active_flows: dp.active_flows(b.id)?,
                expected_share: if total_weight == 0 { 0.0 } else { f64::from(b.config.weight) / total_weight as f64 },
                observed_share: 0.0,
                response_time_ms: agent
                    .response_time_of(&s.config.name, b.config.address, b.config.port)
                    .map(|d| d.as_secs_f64() * 1000.0),
                slow_start: state == BackendState::Up && agent.slow_starting(&s.config, &b.config),
            });
        }
        let new_flows: u64 = backends.iter().map(|b| b.new_flows).sum();
        for b in &mut backends {
            b.observed_share = if new_flows == 0 { 0.0 } else { b.new_flows as f64 / new_flows as f64 };
        }
        let normalised: Vec<f64> = backends
            .iter()
            .filter(|b| b.weight > 0)
            .map(|b| s.config.scheduler.fairness_input(b.new_flows, b.weight))
            .collect();
        services.push(ServiceStatus {
            name: s.config.name.clone(),
            vip: s.config.vip,
            port: s.config.port,
            protocol: s.config.protocol,
            forwarding: s.config.forwarding,
            scheduler: s.config.scheduler,
            new_flows,
            fairness: jain(&normalised),
            announced: agent.bgp.as_ref().map(|b| b.announced(s.config.vip)),
            backends,
        });
    }
    let rate = dp.new_flow_rate();
    let (entries4, entries6) = dp.flow_counts()?;
    let (capacity4, capacity6) = dp.flow_capacities();
    Ok(Status {
        program_id: dp.program_id(),
        interfaces: dp.attachments(),
        paths: dp.paths().to_vec(),
        counters: dp.counters()?,
        flood: FloodStatus {
            new_flow_rate_per_cpu: rate,
            half_open_timeout: agent.config.flood.half_open_timeout,
            flow_entries: entries4 + entries6,
            flow_capacity: capacity4,
            flow_tables: FlowTablesStatus {
                ipv4: FlowTableStatus { entries: entries4, capacity: capacity4 },
                ipv6: FlowTableStatus { entries: entries6, capacity: capacity6 },
            },
            half_open_expired: agent.half_open_expired,
            last_sweep_ms: agent.last_sweep_ms,
        },
        bgp: agent.bgp.clone(),
        services,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_index() {
        assert_eq!(jain(&[1.0, 1.0, 1.0]), Some(1.0));
        assert_eq!(jain(&[]), None);
        assert_eq!(jain(&[0.0, 0.0]), None);
        // One of three gets everything: 1/n.
        let j = jain(&[3.0, 0.0, 0.0]).unwrap();
        assert!((j - 1.0 / 3.0).abs() < 1e-12);
    }
}

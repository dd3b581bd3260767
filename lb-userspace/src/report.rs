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
    /// The share of the service's new flows the scheduler gives this
    /// backend now: its weight in force / the sum of the weights in force
    /// (1 / the backends in rotation for `rr`, which ignores weights); 0
    /// when down or drained.
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
    /// Jain's fairness index over the weight-normalised new flows of the
    /// backends in rotation (not down, not drained); None before the first
    /// flow or with none in rotation.
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

/// One backend as its service's shares see it.
struct Part {
    /// Configured weight.
    weight: u32,
    /// The weight the scheduler uses now: 0 when down or drained.
    in_force: u32,
    new_flows: u64,
}

/// Each backend's expected share of new flows and the service's fairness
/// index. Both count only the backends in rotation: a down or drained
/// backend is meant to get nothing, so it has no share and is not judged
/// (counted with its zero, 14 dead backends beside 3 that share evenly
/// would read as a fairness of 0.18).
fn shares(scheduler: Scheduler, parts: &[Part]) -> (Vec<f64>, Option<f64>) {
    let basis: Vec<f64> = parts.iter().map(|p| scheduler.share_basis(p.in_force)).collect();
    let total: f64 = basis.iter().sum();
    let expected = basis.iter().map(|b| if total == 0.0 { 0.0 } else { b / total }).collect();
    let normalised: Vec<f64> = parts
        .iter()
        .filter(|p| p.in_force > 0 && p.weight > 0)
        .map(|p| scheduler.fairness_input(p.new_flows, p.weight))
        .collect();
    (expected, jain(&normalised))
}

/// Build the status report.
pub fn status(agent: &Agent) -> Result<Status, crate::dataplane::DataplaneError> {
    let dp = &agent.dp;
    let mut services = Vec::new();
    for s in dp.services() {
        // The counters first: each backend's share needs the service's.
        let stats = s.backends.iter().map(|b| dp.backend_stats(b.id)).collect::<Result<Vec<_>, _>>()?;
        let new_flows: u64 = stats.iter().map(|st| st.new_flows).sum();
        let parts: Vec<Part> = s
            .backends
            .iter()
            .zip(&stats)
            .map(|(b, st)| Part { weight: b.config.weight, in_force: b.runtime.weight, new_flows: st.new_flows })
            .collect();
        let (expected, fairness) = shares(s.config.scheduler, &parts);
        let mut backends = Vec::new();
        for ((b, st), expected_share) in s.backends.iter().zip(stats).zip(expected) {
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
                expected_share,
                observed_share: if new_flows == 0 { 0.0 } else { st.new_flows as f64 / new_flows as f64 },
                response_time_ms: agent
                    .response_time_of(&s.config.name, b.config.address, b.config.port)
                    .map(|d| d.as_secs_f64() * 1000.0),
                slow_start: state == BackendState::Up && agent.slow_starting(&s.config, &b.config),
            });
        }
        services.push(ServiceStatus {
            name: s.config.name.clone(),
            vip: s.config.vip,
            port: s.config.port,
            protocol: s.config.protocol,
            forwarding: s.config.forwarding,
            scheduler: s.config.scheduler,
            new_flows,
            fairness,
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

    fn part(weight: u32, in_force: u32, new_flows: u64) -> Part {
        Part { weight, in_force, new_flows }
    }

    #[test]
    fn only_backends_in_rotation_have_a_share_and_are_judged() {
        // Three live backends sharing evenly beside two down ones, one of
        // which served flows before it went down.
        let parts = [part(1, 1, 100), part(1, 1, 100), part(1, 1, 100), part(1, 0, 0), part(1, 0, 40)];
        let (expected, fairness) = shares(Scheduler::Maglev, &parts);
        for e in &expected[..3] {
            assert!((e - 1.0 / 3.0).abs() < 1e-12, "{expected:?}");
        }
        assert_eq!(&expected[3..], &[0.0, 0.0]);
        assert_eq!(fairness, Some(1.0));

        // Weights in force decide (a slow start ramping at 5 of 20), the
        // fairness input stays flows per configured weight.
        let (expected, fairness) = shares(Scheduler::Wrr, &[part(2, 20, 200), part(1, 5, 100)]);
        assert_eq!(expected, vec![0.8, 0.2]);
        assert_eq!(fairness, Some(1.0));

        // Round robin ignores weights: an even share among those in rotation.
        let (expected, _) = shares(Scheduler::Rr, &[part(5, 5, 10), part(1, 1, 10), part(3, 0, 0)]);
        assert_eq!(expected, vec![0.5, 0.5, 0.0]);

        // Nothing in rotation: no shares, nothing to judge.
        let (expected, fairness) = shares(Scheduler::Maglev, &[part(1, 0, 10), part(1, 0, 0)]);
        assert_eq!(expected, vec![0.0, 0.0]);
        assert_eq!(fairness, None);
    }
}

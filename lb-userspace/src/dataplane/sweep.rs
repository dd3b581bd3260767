//! Expiring idle flows from the flow table (the datapath only sees FIN and
//! RST), and the datapath's idle clock.
use std::{collections::HashMap, os::fd::AsFd as _};

use aya::maps::IterableMap as _;

use lb_common::{DIR_FORWARD, DIR_REPLY, FLOW_ESTABLISHED, Flow, FlowKey, PROTO_TCP, flow_closed, maps as names};

use super::{Dataplane, DataplaneError, batch, map_err};

impl Dataplane {
    /// Expire idle flows: an open flow silent for longer than its
    /// protocol's idle timeout (a UDP service's own, when it has one), or a
    /// half-open one (no `FLOW_ESTABLISHED`: the client never spoke after
    /// the backend answered) silent for longer than the flood settings'
    /// `half_open_timeout`, is removed (with its reply entry, if it has
    /// one) and counted as expired for its backend; a closed TCP flow is
    /// removed after `CLOSED_LINGER` seconds. `now` is in seconds of
    /// CLOCK_MONOTONIC_COARSE (see [`monotonic_coarse_secs`]). The table is
    /// read and pruned in batches (see `batch`).
    pub fn sweep(&mut self, now: u64, tcp_idle: u64, udp_idle: u64) -> Result<SweepReport, DataplaneError> {
        let mut report = SweepReport::default();
        // (forward key, its reply entry's key if it has one, backend if it
        // expired open)
        let mut doomed: Vec<(FlowKey, Option<FlowKey>, Option<u32>, bool)> = Vec::new();
        let half_open_limit = u64::from(self.flood.half_open_timeout);
        // Services with a UDP idle timeout of their own, by service id.
        let udp_by_service: HashMap<u32, u64> =
            self.services.values().filter_map(|s| s.config.udp_idle_timeout.map(|t| (s.id, u64::from(t)))).collect();
        let fd = self.maps.flows.map().fd().as_fd();
        let read = batch::for_each::<FlowKey, Flow>(fd, |k, f| {
            report.entries += 1;
            if f.dir == DIR_REPLY {
                return;
            }
            report.scanned += 1;
            let idle = now.saturating_sub(f.last_seen);
            let reply = (f.dir == DIR_FORWARD).then_some(FlowKey {
                src_addr: f.nat_addr,
                dst_addr: k.src_addr,
                src_port: f.nat_port,
                dst_port: k.src_port,
                proto: k.proto,
                _pad: [0; 3],
            });
            let closed = k.proto == PROTO_TCP && flow_closed(f.state);
            if closed {
                if idle > CLOSED_LINGER {
                    doomed.push((*k, reply, None, false));
                }
            } else {
                let limit = if k.proto == PROTO_TCP {
                    tcp_idle
                } else {
                    udp_by_service.get(&f.service_id).copied().unwrap_or(udp_idle)
                };
                let half_open = f.state & FLOW_ESTABLISHED == 0;
                if idle > limit {
                    doomed.push((*k, reply, Some(f.backend_id), false));
                } else if half_open && idle > half_open_limit {
                    doomed.push((*k, reply, Some(f.backend_id), true));
                }
            }
        });
        read.map_err(|e| DataplaneError::Batch { map: names::FLOWS, source: e })?;
        // The flow's own entry first: if a packet raced us and it is gone
        // already, nothing is counted twice.
        let keys: Vec<FlowKey> = doomed.iter().map(|d| d.0).collect();
        let removed = batch::delete(fd, &keys).map_err(|e| DataplaneError::Batch { map: names::FLOWS, source: e })?;
        let mut replies = Vec::new();
        let mut expired_by: HashMap<u32, u64> = HashMap::new();
        for ((_, reply, backend, half_open), gone) in doomed.into_iter().zip(removed) {
            if !gone {
                continue;
            }
            report.removed += 1;
            replies.extend(reply);
            if let Some(b) = backend {
                *expired_by.entry(b).or_default() += 1;
                report.expired += 1;
            }
            if half_open {
                report.half_open_expired += 1;
            }
        }
        report.entries_removed = report.removed;
        if !replies.is_empty() {
            let gone =
                batch::delete(fd, &replies).map_err(|e| DataplaneError::Batch { map: names::FLOWS, source: e })?;
            report.entries_removed += gone.iter().filter(|&&g| g).count() as u64;
        }
        if !expired_by.is_empty() {
            let expired = &mut self.maps.expired;
            for (b, n) in expired_by {
                let cur = expired.get(&b, 0).map_err(map_err(names::EXPIRED))?;
                expired.set(b, cur + n, 0).map_err(map_err(names::EXPIRED))?;
            }
        }
        Ok(report)
    }
}

/// Seconds a closed TCP flow's entries stay (late retransmissions, the
/// final ACK) before the sweeper removes them. Short, as Cilium's and
/// IPVS's close timeouts (10 s): the table does not evict, so a closed
/// flow holds room a new one could use (at 8,000 connections a second,
/// 60 s of lingering filled a 65,536-entry table and sent new flows down
/// the stateless path).
pub const CLOSED_LINGER: u64 = 10;

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Entries in the flow table (flows, and reply entries).
    pub entries: u64,
    /// Flows looked at (reply entries are not).
    pub scanned: u64,
    /// Flows removed.
    pub removed: u64,
    /// Entries removed: the flows and their reply entries.
    pub entries_removed: u64,
    /// Open flows expired (idle, or half-open).
    pub expired: u64,
    /// Of those, half-open flows expired early (`flood.half_open_timeout`).
    pub half_open_expired: u64,
}

/// The datapath's idle clock: CLOCK_MONOTONIC_COARSE in whole seconds
/// (what `bpf_ktime_get_coarse_ns` reads).
pub fn monotonic_coarse_secs() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    u64::try_from(ts.tv_sec).unwrap_or(0)
}

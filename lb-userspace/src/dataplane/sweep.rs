//! Expiring idle flows from the flow table (the datapath only sees FIN and
//! RST), and the datapath's idle clock.
use std::{collections::HashMap, os::fd::AsFd as _};

use aya::maps::IterableMap as _;

use lb_common::{
    DIR_FORWARD, DIR_REPLY, FLOW_ESTABLISHED, Flow, Flow6, FlowKey, FlowKey6, PROTO_TCP, flow_closed, maps as names,
};

use super::{Dataplane, DataplaneError, batch, map_err};

/// One flow table's key and value types, seen the same way by the sweep.
trait Table {
    type K: aya::Pod + Copy;
    type V: aya::Pod + Copy;
    /// The map's name (errors).
    const NAME: &'static str;
    /// (dir, proto, state, last_seen, backend id, service id) of an entry.
    fn view(k: &Self::K, v: &Self::V) -> (u8, u8, u64, u64, u32, u32);
    /// The key of a forward entry's reply entry.
    fn reply_key(k: &Self::K, v: &Self::V) -> Self::K;
}

struct V4;
struct V6;

impl Table for V4 {
    type K = FlowKey;
    type V = Flow;
    const NAME: &'static str = names::FLOWS;
    fn view(k: &FlowKey, f: &Flow) -> (u8, u8, u64, u64, u32, u32) {
        (f.dir, k.proto, f.state, f.last_seen, f.backend_id, f.service_id)
    }
    fn reply_key(k: &FlowKey, f: &Flow) -> FlowKey {
        FlowKey {
            src_addr: f.nat_addr,
            dst_addr: k.src_addr,
            src_port: f.nat_port,
            dst_port: k.src_port,
            proto: k.proto,
            _pad: [0; 3],
        }
    }
}

impl Table for V6 {
    type K = FlowKey6;
    type V = Flow6;
    const NAME: &'static str = names::FLOWS6;
    fn view(k: &FlowKey6, f: &Flow6) -> (u8, u8, u64, u64, u32, u32) {
        (f.dir, k.proto, f.state, f.last_seen, f.backend_id, f.service_id)
    }
    fn reply_key(k: &FlowKey6, f: &Flow6) -> FlowKey6 {
        FlowKey6 {
            src_addr: f.nat_addr,
            dst_addr: k.src_addr,
            src_port: f.nat_port,
            dst_port: k.src_port,
            proto: k.proto,
            _pad: [0; 3],
        }
    }
}

/// A flow the sweep removes: its key, its reply entry's key if it has
/// one, its backend if it expired open, and whether it was half-open.
type Doomed<K> = (K, Option<K>, Option<u32>, bool);

/// What a sweep decides, for the limits in force.
struct Limits<'a> {
    now: u64,
    tcp_idle: u64,
    udp_idle: u64,
    half_open: u64,
    udp_by_service: &'a HashMap<u32, u64>,
}

/// Sweep one flow table (see [`Dataplane::sweep`]): expired flows counted
/// into `expired_by`, the rest into `report`.
fn sweep_table<T: Table>(
    fd: std::os::fd::BorrowedFd<'_>,
    l: &Limits<'_>,
    report: &mut SweepReport,
    expired_by: &mut HashMap<u32, u64>,
) -> Result<(), DataplaneError> {
    let mut doomed: Vec<Doomed<T::K>> = Vec::new();
    let read = batch::for_each::<T::K, T::V>(fd, |k, f| {
        report.entries += 1;
        let (dir, proto, state, last_seen, backend, service) = T::view(k, f);
        if dir == DIR_REPLY {
            return;
        }
        report.scanned += 1;
        let idle = l.now.saturating_sub(last_seen);
        let reply = (dir == DIR_FORWARD).then(|| T::reply_key(k, f));
        let closed = proto == PROTO_TCP && flow_closed(state);
        if closed {
            if idle > CLOSED_LINGER {
                doomed.push((*k, reply, None, false));
            }
        } else {
            let limit = if proto == PROTO_TCP {
                l.tcp_idle
            } else {
                l.udp_by_service.get(&service).copied().unwrap_or(l.udp_idle)
            };
            // A DSR flow never sees its backend's answers: the datapath
            // marks it established at the client's first packet after
            // its opening, so this holds for it too.
            let half_open = state & FLOW_ESTABLISHED == 0;
            if idle > limit {
                doomed.push((*k, reply, Some(backend), false));
            } else if half_open && idle > l.half_open {
                doomed.push((*k, reply, Some(backend), true));
            }
        }
    });
    read.map_err(|e| DataplaneError::Batch { map: T::NAME, source: e })?;
    // The flow's own entry first: if a packet raced us and it is gone
    // already, nothing is counted twice.
    let keys: Vec<T::K> = doomed.iter().map(|d| d.0).collect();
    let removed = batch::delete(fd, &keys).map_err(|e| DataplaneError::Batch { map: T::NAME, source: e })?;
    let mut replies = Vec::new();
    let mut removed_here = 0;
    for ((_, reply, backend, half_open), gone) in doomed.into_iter().zip(removed) {
        if !gone {
            continue;
        }
        removed_here += 1;
        replies.extend(reply);
        if let Some(b) = backend {
            *expired_by.entry(b).or_default() += 1;
            report.expired += 1;
        }
        if half_open {
            report.half_open_expired += 1;
        }
    }
    report.removed += removed_here;
    report.entries_removed += removed_here;
    if !replies.is_empty() {
        let gone = batch::delete(fd, &replies).map_err(|e| DataplaneError::Batch { map: T::NAME, source: e })?;
        report.entries_removed += gone.iter().filter(|&&g| g).count() as u64;
    }
    Ok(())
}

impl Dataplane {
    /// Expire idle flows: an open flow silent for longer than its
    /// protocol's idle timeout (a UDP service's own, when it has one), or a
    /// half-open one (no `FLOW_ESTABLISHED`: the client never spoke after
    /// the backend answered) silent for longer than the flood settings'
    /// `half_open_timeout`, is removed (with its reply entry, if it has
    /// one) and counted as expired for its backend; a closed TCP flow is
    /// removed after `CLOSED_LINGER` seconds. `now` is in seconds of
    /// CLOCK_MONOTONIC_COARSE (see [`monotonic_coarse_secs`]). Both flow
    /// tables (IPv4 and IPv6) are read and pruned in batches (see `batch`).
    pub fn sweep(&mut self, now: u64, tcp_idle: u64, udp_idle: u64) -> Result<SweepReport, DataplaneError> {
        let mut report = SweepReport::default();
        // Services with a UDP idle timeout of their own, by service id.
        let udp_by_service: HashMap<u32, u64> =
            self.services.values().filter_map(|s| s.config.udp_idle_timeout.map(|t| (s.id, u64::from(t)))).collect();
        let limits = Limits {
            now,
            tcp_idle,
            udp_idle,
            half_open: u64::from(self.flood.half_open_timeout),
            udp_by_service: &udp_by_service,
        };
        let mut expired_by: HashMap<u32, u64> = HashMap::new();
        sweep_table::<V4>(self.maps.flows.map().fd().as_fd(), &limits, &mut report, &mut expired_by)?;
        sweep_table::<V6>(self.maps.flows6.map().fd().as_fd(), &limits, &mut report, &mut expired_by)?;
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
    /// Entries in the flow tables (flows, and reply entries; IPv4 and IPv6).
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

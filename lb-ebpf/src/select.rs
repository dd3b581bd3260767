//! Backend selection for a new flow: one bounded read of the service's
//! selection table, which userspace built (Maglev, WRR sequence, ...).
use core::intrinsics::{AtomicOrdering, atomic_xadd};

use lb_common::{
    BACKEND_NONE, SCHED_SEQUENCE, SCHED_SOURCE_HASH, SVC_F_NO_BACKEND, Service, flow_hash,
    source_hash,
};

use crate::{
    maps::{SELECT, SEQ},
    parse::Packet,
};

/// The backend id for a new flow of `svc`, or `BACKEND_NONE`.
#[inline(always)]
pub fn pick(svc: &Service, pkt: &Packet) -> u32 {
    let len = svc.table_len;
    if len == 0 || svc.flags & SVC_F_NO_BACKEND != 0 {
        return BACKEND_NONE;
    }
    let idx = match svc.scheduler {
        SCHED_SEQUENCE => {
            let Some(seq) = SEQ.get_ptr_mut(svc.service_id) else {
                return BACKEND_NONE;
            };
            // One counter for all CPUs: every pick takes the next slot of the
            // sequence exactly once, so the spread is exact over a cycle.
            // SAFETY: the pointer is a valid, aligned u64 map value.
            let n = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(seq, 1) };
            (n % len as u64) as u32
        }
        SCHED_SOURCE_HASH => source_hash(pkt.saddr) % len,
        _ => flow_hash(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto) % len,
    };
    // idx < len and userspace keeps [off, off + len) inside SELECT; the map
    // lookup bounds-checks the index again for the verifier.
    match SELECT.get(svc.table_off.wrapping_add(idx)) {
        Some(id) => *id,
        None => BACKEND_NONE,
    }
}

//! Backend selection for a new flow: one bounded read of the service's
//! selection table, which userspace built (Maglev, WRR sequence, ...).
//!
//! This is the datapath half of the schedulers. The userspace half, which
//! names them, validates a service and builds its table, is
//! `lb-userspace/src/sched/`; a scheduler lives in those two places only.
use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::helpers::bpf_get_prandom_u32;
use lb_common::{
    BACKEND_NONE, SCHED_FLOW_HASH, SCHED_LEAST_CONN, SCHED_LEAST_TIME, SCHED_SEQUENCE, SCHED_SOURCE_HASH,
    SVC_F_NO_BACKEND, Service, flow_hash, select_slot, source_hash,
};

use crate::{
    maps::{BACKENDS, SELECT, SEQ},
    parse::Packet,
    stats,
};

/// What the hash schedulers hash: a flow's 5-tuple, IPv6 addresses folded
/// to 32 bits (`lb_common::fold6`), so both families share the tables.
#[derive(Clone, Copy)]
pub(crate) struct Tuple {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
}

impl Tuple {
    #[inline(always)]
    pub(crate) fn v4(pkt: &Packet) -> Self {
        Self { saddr: pkt.saddr, daddr: pkt.daddr, sport: pkt.sport, dport: pkt.dport, proto: pkt.proto }
    }
}

/// The backend id for a new flow of `svc`, or `BACKEND_NONE`.
#[inline(always)]
pub(crate) fn pick(svc: &Service, pkt: Tuple) -> u32 {
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
            // SeqCst, not Relaxed: LLVM's BPF backend lowers a relaxed
            // atomicrmw to the non-fetching `lock +=` even when the old
            // value is used (seen with LLVM 22), which made every pick the same.
            // SAFETY: the pointer is a valid, aligned u64 map value.
            let n = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(seq, 1) };
            (n % u64::from(len)) as u32
        }
        SCHED_SOURCE_HASH => source_hash(pkt.saddr) % len,
        SCHED_LEAST_CONN => return least_conn(svc, len, false),
        SCHED_LEAST_TIME => return least_conn(svc, len, true),
        _ => flow_hash(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto) % len,
    };
    // idx < len and userspace keeps [off, off + len) inside SELECT; the map
    // lookup bounds-checks the index again for the verifier.
    entry(svc.table_off.wrapping_add(idx)).unwrap_or(BACKEND_NONE)
}

/// Entry `i` of `SELECT` (lane `i % 4` of element `i / 4`), a backend id;
/// None past the array's end.
#[inline(always)]
fn entry(i: u32) -> Option<u32> {
    let (element, lane) = select_slot(i);
    let word = SELECT.get(element)?;
    Some(u32::from(word[lane]))
}

/// The backend id for a flow that gets no flow-table entry (or a TCP
/// packet other than a SYN that has none): a hash of its 5-tuple, so every
/// packet of it gets the same answer. Hash schedulers answer as always;
/// the others read the service's consistent-hash fallback table.
#[inline(always)]
pub(crate) fn pick_stateless(svc: &Service, pkt: Tuple) -> u32 {
    if matches!(svc.scheduler, SCHED_FLOW_HASH | SCHED_SOURCE_HASH) {
        return pick(svc, pkt);
    }
    let len = svc.fallback_len;
    if len == 0 || svc.flags & SVC_F_NO_BACKEND != 0 {
        return BACKEND_NONE;
    }
    let idx = flow_hash(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto) % len;
    entry(svc.fallback_off.wrapping_add(idx)).unwrap_or(BACKEND_NONE)
}

/// Power of two choices over the weighted table: draw two entries at
/// random, keep the backend with fewer active flows per unit of weight
/// (compared as a1 * w2 <= a2 * w1, so no division). For least time
/// (`by_time`), see `lb_common::SCHED_LEAST_TIME`.
#[inline(always)]
fn least_conn(svc: &Service, len: u32, by_time: bool) -> u32 {
    // Both choices from one random draw, without a division: the first
    // index is the high half of r * len (a multiply-shift reduction to
    // [0, len)), the second the same reduction of its low half. The r
    // that give one first index are a run of about 2^32 / len, over
    // which the low half steps by len through all of [0, 2^32), so the
    // second index is spread evenly whatever the first is. A helper call
    // and two divisions fewer per new flow than two draws modulo len.
    // SAFETY: a plain helper call.
    let r = u64::from(unsafe { bpf_get_prandom_u32() });
    let first = r * u64::from(len);
    let second = (first & 0xffff_ffff) * u64::from(len);
    let (i1, i2) = ((first >> 32) as u32, (second >> 32) as u32);
    let Some(b1) = entry(svc.table_off.wrapping_add(i1)) else { return BACKEND_NONE };
    let Some(b2) = entry(svc.table_off.wrapping_add(i2)) else { return b1 };
    if b1 == b2 {
        return b1;
    }
    let (w1, w2) = match (BACKENDS.get(b1), BACKENDS.get(b2)) {
        (Some(x), Some(y)) => (u64::from(x.weight), u64::from(y.weight)),
        _ => return b1,
    };
    let (a1, a2) = (stats::active(b1), stats::active(b2));
    if !by_time {
        return if a1 * w2 <= a2 * w1 { b1 } else { b2 };
    }
    if w1 == w2 {
        return b1;
    }
    // (a + 1): an idle backend still counts by its weight.
    if (a1 + 1) * w2 <= (a2 + 1) * w1 { b1 } else { b2 }
}

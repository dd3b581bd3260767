//! Per-CPU counters: plain adds, no atomics needed (each CPU owns its copy).
use core::intrinsics::{AtomicOrdering, atomic_xadd, atomic_xsub};

use lb_common::{Conns, FLOW_CONNS_CPU, reads_conns};

use crate::maps::{BACKEND_STATS, CONNS, CONNS_CPU, CONNS_SUM, COUNTERS, EXPIRED};

/// Count one event in the global counter `idx` (`lb_common::counter::*`).
#[inline(always)]
pub(crate) fn count(idx: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *c += 1 };
    }
}

/// A new flow was scheduled onto backend `id`.
#[inline(always)]
pub(crate) fn new_flow(id: u32) {
    if let Some(s) = BACKEND_STATS.get_ptr_mut(id) {
        // SAFETY: this CPU's slot (the id bound is checked by the map);
        // only this CPU writes it while we run. Raw pointer writes: no
        // reference into the map value is made.
        unsafe { (*s).new_flows += 1 };
    }
}

/// A client -> backend packet of `bytes` bytes.
#[inline(always)]
pub(crate) fn packet_in(id: u32, bytes: u64) {
    if let Some(s) = BACKEND_STATS.get_ptr_mut(id) {
        // SAFETY: as in `new_flow`.
        unsafe {
            (*s).packets_in += 1;
            (*s).bytes_in += bytes;
        }
    }
}

/// A backend -> client packet of `bytes` bytes.
#[inline(always)]
pub(crate) fn packet_out(id: u32, bytes: u64) {
    if let Some(s) = BACKEND_STATS.get_ptr_mut(id) {
        // SAFETY: as in `new_flow`.
        unsafe {
            (*s).packets_out += 1;
            (*s).bytes_out += bytes;
        }
    }
}

/// Whether a flow whose state is `state` is counted per CPU
/// (`FLOW_CONNS_CPU`: in `CONNS_CPU`) rather than in the shared `CONNS`.
#[inline(always)]
fn per_cpu(state: u64) -> bool {
    state & FLOW_CONNS_CPU != 0
}

/// The state bit a new flow of a service scheduled by `scheduler` is
/// counted by: per CPU, but for the schedulers that read the counts on
/// every new flow (`lb_common::reads_conns`).
#[inline(always)]
pub(crate) fn conns_class(scheduler: u32) -> u64 {
    if reads_conns(scheduler) { 0 } else { FLOW_CONNS_CPU }
}

/// Add 1 to `opened` or `closed` (`closed`) of backend `id`'s count that
/// `state` says (`per_cpu`), from a packet's XDP run: this CPU's copy with
/// a plain add (no other run on this CPU touches it meanwhile: the
/// sweeper, which a packet may interrupt, adds atomically), the shared
/// one atomically.
#[inline(always)]
fn count_conn(id: u32, state: u64, closed: bool) {
    if per_cpu(state) {
        if let Some(c) = CONNS_CPU.get_ptr_mut(id) {
            // SAFETY: this CPU's slot (the id bound is checked by the
            // map); raw pointer writes, no reference into the map value.
            unsafe {
                if closed {
                    (*c).closed += 1;
                } else {
                    (*c).opened += 1;
                }
            }
        }
    } else if let Some(c) = CONNS.get_ptr_mut(id) {
        // SAFETY: aligned u64s inside a map value; atomic RMW only.
        unsafe {
            let to = if closed { &raw mut (*c).closed } else { &raw mut (*c).opened };
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(to, 1);
        }
    }
}

/// A flow to backend `id`, whose state is `state`, opened.
#[inline(always)]
pub(crate) fn flow_opened(id: u32, state: u64) {
    count_conn(id, state, false);
}

/// A flow to backend `id`, whose state is `state`, closed (FIN both ways
/// or RST).
#[inline(always)]
pub(crate) fn flow_closed(id: u32, state: u64) {
    count_conn(id, state, true);
}

/// Backend `id`'s counts that a flow whose state is `state` is counted
/// in: this CPU's copy (`CONNS_CPU`) or the shared one (`CONNS`).
#[inline(always)]
fn conns_of(id: u32, state: u64) -> Option<*mut Conns> {
    if per_cpu(state) { CONNS_CPU.get_ptr_mut(id) } else { CONNS.get_ptr_mut(id) }
}

/// [`flow_closed`] for the sweeper (`lb_sweep`, run by lbd through
/// BPF_PROG_TEST_RUN): a packet on its CPU may interrupt it between two
/// instructions, so this CPU's copy takes an atomic add too.
#[inline(always)]
pub(crate) fn flow_closed_swept(id: u32, state: u64) {
    if let Some(c) = conns_of(id, state) {
        // SAFETY: aligned u64 inside a map value; atomic RMW only.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).closed, 1) };
    }
}

/// A close counted for backend `id` taken back: the connection it was
/// counted for had been counted closed already (a migration's late copy,
/// `sweep::replace`). Its count holds that close, so it stays whole. For
/// the sweeper, as [`flow_closed_swept`].
#[inline(always)]
pub(crate) fn close_taken_back(id: u32, state: u64) {
    if let Some(c) = conns_of(id, state) {
        // SAFETY: aligned u64 inside a map value.
        unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).closed, 1) };
    }
}

/// Active flows of backend `id`: opened - closed - expired (never
/// negative), its shared counts (`CONNS`) up to date, its counts per CPU
/// as lbd last summed them (`CONNS_SUM`, at most a second old). A
/// least-conn service's own flows are all in the first, but for those it
/// had before it became least-conn.
///
/// One running difference is kept across the three lookups (the counts
/// only grow, so their differences fit in an i64): least-conn reads two
/// backends' in the balancer's frame, which is at the verifier's limit.
#[inline(always)]
pub(crate) fn active(id: u32) -> u64 {
    let Some(c) = CONNS.get(id) else { return 0 };
    let mut a = c.opened.wrapping_sub(c.closed);
    if let Some(s) = CONNS_SUM.get(id) {
        a = a.wrapping_add(s.opened.wrapping_sub(s.closed));
    }
    a = a.wrapping_sub(EXPIRED.get(id).copied().unwrap_or(0));
    if (a as i64) < 0 { 0 } else { a }
}

//! Per-CPU counters: plain adds, no atomics needed (each CPU owns its copy).
use core::intrinsics::{AtomicOrdering, atomic_xadd, atomic_xsub};

use crate::maps::{BACKEND_STATS, CONNS, COUNTERS, EXPIRED};

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

/// A flow to backend `id` opened (shared counter: atomic).
#[inline(always)]
pub(crate) fn flow_opened(id: u32) {
    if let Some(c) = CONNS.get_ptr_mut(id) {
        // SAFETY: aligned u64 inside a map value.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).opened, 1) };
    }
}

/// A flow to backend `id` closed (FIN both ways or RST).
#[inline(always)]
pub(crate) fn flow_closed(id: u32) {
    if let Some(c) = CONNS.get_ptr_mut(id) {
        // SAFETY: aligned u64 inside a map value.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).closed, 1) };
    }
}

/// A close counted for backend `id` taken back: the connection it was
/// counted for had been counted closed already (a migration's late copy,
/// `sweep::replace`). `closed` holds that count, so it stays whole.
#[inline(always)]
pub(crate) fn close_taken_back(id: u32) {
    if let Some(c) = CONNS.get_ptr_mut(id) {
        // SAFETY: aligned u64 inside a map value.
        unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).closed, 1) };
    }
}

/// Active flows of backend `id`: opened - closed - expired (never negative).
#[inline(always)]
pub(crate) fn active(id: u32) -> u64 {
    let (opened, closed) = match CONNS.get(id) {
        Some(c) => (c.opened, c.closed),
        None => return 0,
    };
    let expired = EXPIRED.get(id).copied().unwrap_or(0);
    opened.saturating_sub(closed).saturating_sub(expired)
}

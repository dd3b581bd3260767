//! Per-CPU counters: plain adds, no atomics needed (each CPU owns its copy).
use lb_common::BackendStats;

use crate::maps::{BACKEND_STATS, COUNTERS};

/// Count one event in the global counter `idx` (`lb_common::counter::*`).
#[inline(always)]
pub fn count(idx: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *c += 1 };
    }
}

#[inline(always)]
fn backend(id: u32) -> Option<&'static mut BackendStats> {
    // SAFETY: per-CPU slot as above; the id bound is checked by the map.
    BACKEND_STATS.get_ptr_mut(id).map(|p| unsafe { &mut *p })
}

/// A new flow was scheduled onto backend `id`.
#[inline(always)]
pub fn new_flow(id: u32) {
    if let Some(s) = backend(id) {
        s.new_flows += 1;
    }
}

/// A client -> backend packet of `bytes` bytes.
#[inline(always)]
pub fn packet_in(id: u32, bytes: u64) {
    if let Some(s) = backend(id) {
        s.packets_in += 1;
        s.bytes_in += bytes;
    }
}

/// A backend -> client packet of `bytes` bytes.
#[inline(always)]
pub fn packet_out(id: u32, bytes: u64) {
    if let Some(s) = backend(id) {
        s.packets_out += 1;
        s.bytes_out += bytes;
    }
}

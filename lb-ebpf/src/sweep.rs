//! The sweeper's remove-if-unchanged, in the kernel (`lb_sweep`): lbd
//! walks the flow tables in batches and judges every entry, then hands
//! this program the flows it would remove, with the `state` and
//! `last_seen` it judged each by (`lb_common::SweepHeader`). Each goes
//! only if its entry still has both: a flow that saw a packet since, or an
//! entry made anew for the same 5-tuple by a client reusing its port,
//! stays. BPF maps have no compare-and-delete; here the gap between the
//! check and the delete is a few instructions on one CPU, where removing
//! from userspace left two syscalls between them, and it costs one run
//! per batch of flows instead of two syscalls per flow.
//!
//! Run by lbd through BPF_PROG_TEST_RUN, never attached: the "frame" is
//! the request, and the program marks in it what it removed.
use aya_ebpf::{bindings::xdp_action, macros::xdp, maps::HashMap, programs::XdpContext};
use core::{
    mem::size_of,
    ptr::{addr_of, addr_of_mut, read_volatile},
};
use lb_common::{Flow, Flow6, FlowKey, FlowKey6, SWEEP_BATCH, SWEEP_BATCH6, SweepHeader, SweepItem, SweepItem6};

use crate::{
    maps::{FLOWS, FLOWS6},
    parse::ptr_at,
};

#[xdp]
pub(crate) fn lb_sweep(ctx: XdpContext) -> u32 {
    match try_sweep(&ctx) {
        Some(()) => xdp_action::XDP_PASS,
        // A request shorter than its count, or of no known family: lbd
        // treats this answer as an error.
        None => xdp_action::XDP_ABORTED,
    }
}

const HDR: usize = size_of::<SweepHeader>();

/// A request item and the flow-table value it names, of either family.
trait Item {
    type Key;
    type Value;
    /// The item's key and the state bits and last packet it was judged by.
    fn judged(&self) -> (Self::Key, u64, u64);
    /// The entry's state bits and last packet now.
    ///
    /// # Safety
    /// `v` points at a live flow-table value.
    unsafe fn now(v: *const Self::Value) -> (u64, u64);
    /// Mark the item removed.
    ///
    /// # Safety
    /// `item` points at a whole item inside the frame.
    unsafe fn mark(item: *mut Self);
}

impl Item for SweepItem {
    type Key = FlowKey;
    type Value = Flow;
    fn judged(&self) -> (FlowKey, u64, u64) {
        (self.key, self.state, self.last_seen)
    }
    unsafe fn now(v: *const Flow) -> (u64, u64) {
        // SAFETY: the caller's promise; the fields are read (not
        // referenced) while other CPUs may write them.
        unsafe { (read_volatile(addr_of!((*v).state)), read_volatile(addr_of!((*v).last_seen))) }
    }
    unsafe fn mark(item: *mut Self) {
        // SAFETY: the caller's promise; a store through the raw pointer.
        unsafe { addr_of_mut!((*item).removed).write(1) };
    }
}

impl Item for SweepItem6 {
    type Key = FlowKey6;
    type Value = Flow6;
    fn judged(&self) -> (FlowKey6, u64, u64) {
        (self.key, self.state, self.last_seen)
    }
    unsafe fn now(v: *const Flow6) -> (u64, u64) {
        // SAFETY: as above.
        unsafe { (read_volatile(addr_of!((*v).state)), read_volatile(addr_of!((*v).last_seen))) }
    }
    unsafe fn mark(item: *mut Self) {
        // SAFETY: as above.
        unsafe { addr_of_mut!((*item).removed).write(1) };
    }
}

fn try_sweep(ctx: &XdpContext) -> Option<()> {
    let hdr = ptr_at::<SweepHeader>(ctx, 0)?;
    // SAFETY: `ptr_at` proved the header inside the frame.
    let (family, count) = unsafe { ((*hdr).family, (*hdr).count) };
    match family {
        4 => remove_unchanged::<SweepItem, { SWEEP_BATCH as usize }>(ctx, count, &FLOWS),
        6 => remove_unchanged::<SweepItem6, { SWEEP_BATCH6 as usize }>(ctx, count, &FLOWS6),
        _ => None,
    }
}

/// Remove the entry of each of the request's `count` items (at most `N`)
/// from `map` if it is as the item says it was judged, and mark the item.
#[inline(always)]
fn remove_unchanged<I: Item, const N: usize>(
    ctx: &XdpContext,
    count: u32,
    map: &HashMap<I::Key, I::Value>,
) -> Option<()> {
    // Bounded for the verifier by the batch size; `count` may be less.
    for i in 0..N {
        if i >= count as usize {
            break;
        }
        let item = ptr_at::<I>(ctx, HDR + i * size_of::<I>())?;
        // SAFETY: `ptr_at` proved the item inside the frame; the key is
        // copied out before the map is touched.
        let (key, state, seen) = unsafe { (*item).judged() };
        // SAFETY: a live entry's value (`get_ptr`).
        let now = map.get_ptr(&key).map(|v| unsafe { I::now(v) });
        if now == Some((state, seen)) && map.remove(&key).is_ok() {
            // SAFETY: inside the frame (above).
            unsafe { I::mark(item) };
        }
    }
    Some(())
}

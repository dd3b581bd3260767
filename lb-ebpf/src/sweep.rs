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
use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use core::{
    mem::size_of,
    ptr::{addr_of, addr_of_mut, read_volatile},
};
use lb_common::{Flow6, SWEEP_BATCH, SWEEP_BATCH6, SweepHeader, SweepItem, SweepItem6};

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

fn try_sweep(ctx: &XdpContext) -> Option<()> {
    let hdr = ptr_at::<SweepHeader>(ctx, 0)?;
    // SAFETY: `ptr_at` proved the header inside the frame.
    let (family, count) = unsafe { ((*hdr).family, (*hdr).count) };
    match family {
        4 => {
            // Bounded for the verifier by the batch size; `count` may be less.
            for i in 0..SWEEP_BATCH {
                if i >= count {
                    break;
                }
                let item = ptr_at::<SweepItem>(ctx, HDR + i as usize * size_of::<SweepItem>())?;
                // SAFETY: `ptr_at` proved the item inside the frame; the
                // key is copied out before the map is touched.
                let (key, state, seen) = unsafe { ((*item).key, (*item).state, (*item).last_seen) };
                let now = FLOWS.get_ptr(&key).map(|f| {
                    // SAFETY: a live entry's fields, read (not referenced)
                    // while other CPUs may write them.
                    unsafe { (read_volatile(addr_of!((*f).state)), read_volatile(addr_of!((*f).last_seen))) }
                });
                if now == Some((state, seen)) && FLOWS.remove(&key).is_ok() {
                    // SAFETY: inside the frame (above).
                    unsafe { addr_of_mut!((*item).removed).write(1) };
                }
            }
        }
        6 => {
            for i in 0..SWEEP_BATCH6 {
                if i >= count {
                    break;
                }
                let item = ptr_at::<SweepItem6>(ctx, HDR + i as usize * size_of::<SweepItem6>())?;
                // SAFETY: as above.
                let (key, state, seen) = unsafe { ((*item).key, (*item).state, (*item).last_seen) };
                let now = FLOWS6.get_ptr(&key).map(|f: *const Flow6| {
                    // SAFETY: as above.
                    unsafe { (read_volatile(addr_of!((*f).state)), read_volatile(addr_of!((*f).last_seen))) }
                });
                if now == Some((state, seen)) && FLOWS6.remove(&key).is_ok() {
                    // SAFETY: inside the frame (above).
                    unsafe { addr_of_mut!((*item).removed).write(1) };
                }
            }
        }
        _ => return None,
    }
    Some(())
}

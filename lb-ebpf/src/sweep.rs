//! The sweeper's remove-if-unchanged, in the kernel (`lb_sweep`): lbd
//! reads the flow tables in batches and judges every entry, then hands
//! this program the flows it would remove, each with its slot and the
//! `state` and `last_seen` it judged it by (`lb_common::SweepHeader`).
//! Each goes only if its slot still holds that key with both: a flow that
//! saw a packet since, or an entry made anew for the same 5-tuple by a
//! client reusing its port, stays. The removal itself is a
//! compare-and-swap of the slot's claim (`table::remove_if`); between the
//! check of the value and it lie a few instructions on one CPU, and it
//! costs one run per batch of flows instead of syscalls per flow.
//!
//! Run by lbd through BPF_PROG_TEST_RUN, never attached: the "frame" is
//! the request, and the program marks in it what it removed.
use aya_ebpf::{bindings::xdp_action, macros::xdp, maps::Array, programs::XdpContext};
use core::intrinsics::{AtomicOrdering, atomic_and, atomic_or, atomic_xadd};
use core::{
    mem::size_of,
    ptr::{addr_of, addr_of_mut, read_volatile},
};
use lb_common::{
    COPIED, COUNTS_BATCH, CountsAdd, DIR_REPLY, FLOW_REOPENED, FLOW_REPLIED, Flow, Flow6, FlowKey, FlowKey6,
    INSERT_BATCH, INSERT_BATCH6, INSERT_EXISTS, INSERT_MERGED, INSERTED, InsertItem, InsertItem6, MERGED_BITS,
    SLOT_BUCKET, SWEEP_BATCH, SWEEP_BATCH6, SWEEP_BY_KEY, SWEEP_COUNTS, SWEEP_INSERT, Slot, SlotKey, SweepHeader,
    SweepItem, SweepItem6, flow_closed,
};

use crate::{
    maps::{BACKEND_STATS, CONNS, FLOW_SLOTS, FLOW_SLOTS6, flow_mask, flow_mask6},
    parse::ptr_at,
    stats, table,
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
    type Key: SlotKey;
    type Value;
    /// The item's key, slot, and the state bits and last packet it was
    /// judged by.
    fn judged(&self) -> (Self::Key, u32, u64, u64);
    /// The entry's state bits and last packet now.
    ///
    /// # Safety
    /// `v` points at a flow-table value.
    unsafe fn now(v: *const Self::Value) -> (u64, u64);
    /// Mark the item removed.
    ///
    /// # Safety
    /// `item` points at a whole item inside the frame.
    unsafe fn mark(item: *mut Self);
    /// The slot of `key`'s entry (`table::MISS` set, or `table::NO_SLOT`:
    /// none), by the table's global lookup.
    fn slot_of(key: &Self::Key) -> u32;
    /// The table's entry count.
    const COUNT: table::Count;
}

impl Item for SweepItem {
    type Key = FlowKey;
    type Value = Flow;
    fn judged(&self) -> (FlowKey, u32, u64, u64) {
        (self.key, self.slot, self.state, self.last_seen)
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
    fn slot_of(key: &FlowKey) -> u32 {
        table::lb_flow_slot(key)
    }
    const COUNT: table::Count = table::Count::V4;
}

impl Item for SweepItem6 {
    type Key = FlowKey6;
    type Value = Flow6;
    fn judged(&self) -> (FlowKey6, u32, u64, u64) {
        (self.key, self.slot, self.state, self.last_seen)
    }
    unsafe fn now(v: *const Flow6) -> (u64, u64) {
        // SAFETY: as above.
        unsafe { (read_volatile(addr_of!((*v).state)), read_volatile(addr_of!((*v).last_seen))) }
    }
    unsafe fn mark(item: *mut Self) {
        // SAFETY: as above.
        unsafe { addr_of_mut!((*item).removed).write(1) };
    }
    fn slot_of(key: &FlowKey6) -> u32 {
        table::lb_flow_slot6(key)
    }
    const COUNT: table::Count = table::Count::V6;
}

fn try_sweep(ctx: &XdpContext) -> Option<()> {
    let hdr = ptr_at::<SweepHeader>(ctx, 0)?;
    // SAFETY: `ptr_at` proved the header inside the frame.
    let (family, count) = unsafe { ((*hdr).family, (*hdr).count) };
    const INSERT4: u32 = SWEEP_INSERT | 4;
    const INSERT6: u32 = SWEEP_INSERT | 6;
    match family {
        4 => remove_unchanged::<SweepItem, { SWEEP_BATCH as usize }>(ctx, count, &FLOW_SLOTS, flow_mask()),
        6 => remove_unchanged::<SweepItem6, { SWEEP_BATCH6 as usize }>(ctx, count, &FLOW_SLOTS6, flow_mask6()),
        INSERT4 => insert::<InsertItem, { INSERT_BATCH as usize }>(ctx, count),
        INSERT6 => insert::<InsertItem6, { INSERT_BATCH6 as usize }>(ctx, count),
        SWEEP_COUNTS => add_counts(ctx, count),
        _ => None,
    }
}

/// An insert request's item and its table's global insert function.
trait Insert {
    type Key: Copy;
    type Value: Copy;
    /// `table::lb_put_flow` or `table::lb_put_flow6`, without replacing.
    fn put(key: *const Self::Key, value: *const Self::Value) -> u32;
    /// Where the item's key, value and result word are, and its `copied`
    /// word.
    fn parts(item: *mut Self) -> (*const Self::Key, *const Self::Value, *mut u32, u32);
    /// The key's entry, when it is the flow `old` is a view of (the same
    /// backend endpoint and direction, not a reply entry): what a merge
    /// takes from `old`, and the entry's `state` and `last_seen`.
    fn same_flow(key: &Self::Key, old: &Self::Value) -> Option<(OldView, *mut u64, *mut u64)>;
}

/// [`Insert::same_flow`] of either family: `Flow` and `Flow6` name these
/// fields alike, and `$find` is `table::flow` or `table::flow6`.
macro_rules! same_flow {
    ($find:path, $key:expr, $old:expr) => {{
        let old = $old;
        let live = $find($key)?;
        // SAFETY: a valid, aligned map value; plain loads of integers,
        // and the addresses of two fields.
        unsafe {
            let same = (*live).backend_id == old.backend_id
                && (*live).nat_addr == old.nat_addr
                && (*live).nat_port == old.nat_port
                && (*live).dir == old.dir
                && old.dir != DIR_REPLY;
            same.then(|| {
                let view = OldView { backend_id: old.backend_id, state: old.state, last_seen: old.last_seen };
                (view, &raw mut (*live).state, &raw mut (*live).last_seen)
            })
        }
    }};
}

impl Insert for InsertItem {
    type Key = FlowKey;
    type Value = Flow;
    fn put(key: *const FlowKey, value: *const Flow) -> u32 {
        table::lb_put_flow(key, value, 0, table::NO_SLOT)
    }
    fn parts(item: *mut Self) -> (*const FlowKey, *const Flow, *mut u32, u32) {
        // SAFETY: the fields' addresses are taken, and the item (inside
        // the frame: `ptr_at`) gives its `copied` word.
        unsafe { (&raw const (*item).key, &raw const (*item).value, &raw mut (*item).inserted, (*item).copied) }
    }
    fn same_flow(key: &FlowKey, old: &Flow) -> Option<(OldView, *mut u64, *mut u64)> {
        same_flow!(table::flow, key, old)
    }
}

impl Insert for InsertItem6 {
    type Key = FlowKey6;
    type Value = Flow6;
    fn put(key: *const FlowKey6, value: *const Flow6) -> u32 {
        table::lb_put_flow6(key, value, 0, table::NO_SLOT)
    }
    fn parts(item: *mut Self) -> (*const FlowKey6, *const Flow6, *mut u32, u32) {
        // SAFETY: as for `InsertItem`.
        unsafe { (&raw const (*item).key, &raw const (*item).value, &raw mut (*item).inserted, (*item).copied) }
    }
    fn same_flow(key: &FlowKey6, old: &Flow6) -> Option<(OldView, *mut u64, *mut u64)> {
        same_flow!(table::flow6, key, old)
    }
}

/// Bring `old`, the old program's later view of a flow copied with the
/// state bits `copied`, into the key's entry where that is the flow's
/// copy (see `lb_common::InsertItem::copied`); answers `INSERT_MERGED` or
/// `INSERT_EXISTS`.
#[inline(always)]
fn merge<I: Insert>(key: *const I::Key, old: *const I::Value, copied: u32) -> u32 {
    // SAFETY: both lie inside the frame (`ptr_at`); copied out whole.
    let (key, old) = unsafe { (key.read_unaligned(), old.read_unaligned()) };
    match I::same_flow(&key, &old) {
        Some((view, state, seen)) => merge_into(state, seen, &view, copied),
        None => INSERT_EXISTS,
    }
}

/// What a merge takes from the old program's view of a flow.
struct OldView {
    backend_id: u32,
    state: u64,
    last_seen: u64,
}

/// The merge of `lb_common::InsertItem::copied` into a live entry's
/// `state` and `last_seen` (the same flow: its backend endpoint and
/// direction were checked). The datapath writes both at the same time:
/// the state with atomic AND and OR as it does itself, the time with a
/// plain store (either time is a packet's).
#[inline(always)]
fn merge_into(state: *mut u64, seen: *mut u64, old: &OldView, copied: u32) -> u32 {
    let copied = u64::from(copied & !COPIED);
    // SAFETY: a valid, aligned u64 inside a map value (see `known_flow`
    // on reading a word other CPUs OR bits into).
    let live = unsafe { read_volatile(state) };
    // The entry lost a bit it was copied with, or was reopened since: a
    // new connection on the tuple, which the old view is not about.
    if live & copied != copied || (live ^ copied) & FLOW_REOPENED != 0 {
        return INSERT_EXISTS;
    }
    let mut merged = false;
    let mut have = live;
    if old.state & FLOW_REOPENED != 0 && copied & FLOW_REOPENED == 0 {
        // The old program saw the client reopen the tuple (and counted
        // the close and the open): what `reopen` does to the entry.
        // SAFETY: as above.
        unsafe {
            atomic_and::<u64, u64, { AtomicOrdering::SeqCst }>(state, FLOW_REPLIED);
            atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(state, FLOW_REOPENED);
        }
        have = FLOW_REPLIED | FLOW_REOPENED;
        merged = true;
    }
    let add = old.state & MERGED_BITS & !have;
    if add != 0 {
        // SAFETY: as above.
        let before = unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(state, add) };
        // Closed by halves the two programs saw apart (neither counted
        // it); a close the old program saw whole it counted.
        if !flow_closed(old.state) && !flow_closed(before) && flow_closed(before | add) {
            stats::flow_closed(old.backend_id);
        }
        merged = true;
    }
    // SAFETY: as above; plain load and store of a timestamp.
    unsafe {
        if old.last_seen > read_volatile(seen) {
            seen.write_volatile(old.last_seen);
            merged = true;
        }
    }
    if merged { INSERT_MERGED } else { INSERT_EXISTS }
}

/// Insert each of the request's `count` items (at most `N`) unless its key
/// has an entry, and write what became of it into the item; an item with
/// `copied` set is merged into the key's entry instead, where that is its
/// earlier copy. The insert is the table's global function (verified
/// once, not once per item).
#[inline(always)]
fn insert<I: Insert, const N: usize>(ctx: &XdpContext, count: u32) -> Option<()> {
    for i in 0..N {
        if i >= count as usize {
            break;
        }
        let item = ptr_at::<I>(ctx, HDR + i * size_of::<I>())?;
        let (key, value, result, copied) = I::parts(item);
        let done = I::put(key, value);
        let answer = if done == table::Put::Done as u32 {
            INSERTED
        } else if done == table::Put::Exists as u32 {
            if copied & COPIED != 0 { merge::<I>(key, value, copied) } else { INSERT_EXISTS }
        } else {
            0
        };
        // SAFETY: the result word lies inside the item, inside the frame
        // (`ptr_at`).
        unsafe { result.write(answer) };
    }
    Some(())
}

/// Add each of the request's `count` items (at most `COUNTS_BATCH`) to its
/// backend's counts, atomically (`lb_common::SWEEP_COUNTS`): the
/// connection counts, and this CPU's slot of the per-CPU counters, which
/// userspace sums (a packet on this CPU may interrupt the run between two
/// instructions, never inside an atomic add).
#[inline(always)]
fn add_counts(ctx: &XdpContext, count: u32) -> Option<()> {
    for i in 0..COUNTS_BATCH as usize {
        if i >= count as usize {
            break;
        }
        let item = ptr_at::<CountsAdd>(ctx, HDR + i * size_of::<CountsAdd>())?;
        // SAFETY: inside the frame (`ptr_at`), aligned as the frame's
        // items are (8 + i x 64 bytes); integers read one at a time (a
        // copy of the whole item would not fit the program's stack).
        let id = unsafe { (*item).backend_id };
        let (Some(c), Some(s)) = (CONNS.get_ptr_mut(id), BACKEND_STATS.get_ptr_mut(id)) else {
            continue;
        };
        // SAFETY: aligned u64s inside map values and inside the frame;
        // the item's result word inside the frame.
        unsafe {
            let add = |to: *mut u64, n: u64| atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(to, n);
            add(&raw mut (*c).opened, (*item).opened);
            add(&raw mut (*c).closed, (*item).closed);
            add(&raw mut (*s).new_flows, (*item).stats.new_flows);
            add(&raw mut (*s).packets_in, (*item).stats.packets_in);
            add(&raw mut (*s).bytes_in, (*item).stats.bytes_in);
            add(&raw mut (*s).packets_out, (*item).stats.packets_out);
            add(&raw mut (*s).bytes_out, (*item).stats.bytes_out);
            (&raw mut (*item).added).write(1);
        }
    }
    Some(())
}

/// Remove the entry of each of the request's `count` items (at most `N`)
/// from `table` if it is as the item says it was judged, and mark the item.
#[inline(always)]
fn remove_unchanged<I: Item, const N: usize>(
    ctx: &XdpContext,
    count: u32,
    slots: &Array<[Slot<I::Key, I::Value>; SLOT_BUCKET as usize]>,
    mask: u32,
) -> Option<()> {
    // Bounded for the verifier by the batch size; `count` may be less.
    for i in 0..N {
        if i >= count as usize {
            break;
        }
        let item = ptr_at::<I>(ctx, HDR + i * size_of::<I>())?;
        // SAFETY: `ptr_at` proved the item inside the frame; the key is
        // copied out before the table is touched.
        let (key, at, state, seen) = unsafe { (*item).judged() };
        let removed = if at == SWEEP_BY_KEY {
            let at = I::slot_of(&key);
            at & table::MISS == 0 && table::remove_if(slots, mask, I::COUNT, at, &key, |_| true)
        } else {
            // SAFETY: `remove_if` hands over a value of the table.
            table::remove_if(slots, mask, I::COUNT, at, &key, |v| unsafe { I::now(v) } == (state, seen))
        };
        if removed {
            // SAFETY: inside the frame (above).
            unsafe { I::mark(item) };
        }
    }
    Some(())
}

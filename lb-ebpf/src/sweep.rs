//! The sweeper's remove-if-unchanged, in the kernel (`lb_sweep`): lbd
//! reads the flow tables in batches and judges every entry, then hands
//! this program the flows it would remove, each with its slot and the
//! `state` and `last_seen` it judged it by (`lb_common::SweepHeader`).
//! Each goes only if its slot still holds that key with both: a flow that
//! saw a packet since, or an entry made anew for the same 5-tuple by a
//! client reusing its port, stays. The removal itself is a
//! compare-and-swap of the slot's claim (`table::remove_if`), from the
//! claim read before the check (a replacement bumps its generation), after
//! the entry's state is marked (`doom`: a SYN that would take the entry up
//! in place sees the mark, or the mark's swap fails); between the check
//! of the last packet's time and it lie a few instructions on one CPU,
//! and it costs one run per batch of flows instead of syscalls per flow.
//! While the mark is on, the entry's close is the sweeper's to count
//! (`undoom`), so that a reset, a new entry or the removal that meet on
//! one flow count its connection closed once.
//!
//! Run by lbd through BPF_PROG_TEST_RUN, never attached: the "frame" is
//! the request, and the program marks in it what it removed.
use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use core::intrinsics::{AtomicOrdering, atomic_and, atomic_cxchg, atomic_or, atomic_xadd};
use core::{
    mem::size_of,
    ptr::{addr_of, addr_of_mut, read_volatile},
};
use lb_common::{
    COPIED, COUNTS_BATCH, CountsAdd, DIR_REPLY, FLOW_COPY, FLOW_DOOMED, FLOW_REOPENED, Flow, Flow6, FlowKey, FlowKey6,
    INSERT_BATCH, INSERT_BATCH6, INSERT_EXISTS, INSERT_MERGED, INSERT_REPLACED, INSERTED, InsertItem, InsertItem6,
    MERGED_BITS, SWEEP_BATCH, SWEEP_BATCH6, SWEEP_BY_CLAIM, SWEEP_BY_KEY, SWEEP_CLOSED, SWEEP_COUNTS, SWEEP_INSERT,
    SlotKey, SweepHeader, SweepItem, SweepItem6, flow_closed,
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
    /// The entry's state word (the datapath's `state_of`).
    fn state(v: *mut Self::Value) -> *mut u64;
    /// Mark the item removed (1) or closed here (`SWEEP_CLOSED`).
    ///
    /// # Safety
    /// `item` points at a whole item inside the frame.
    unsafe fn mark(item: *mut Self, how: u32);
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
    fn state(v: *mut Flow) -> *mut u64 {
        crate::state_of(v)
    }
    unsafe fn mark(item: *mut Self, how: u32) {
        // SAFETY: the caller's promise; a store through the raw pointer.
        unsafe { addr_of_mut!((*item).removed).write(how) };
    }
    fn slot_of(key: &FlowKey) -> u32 {
        table::lb_flow_slot(key)
    }
    const COUNT: table::Count = table::Count::V4Shared;
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
    fn state(v: *mut Flow6) -> *mut u64 {
        crate::v6::state_of(v)
    }
    unsafe fn mark(item: *mut Self, how: u32) {
        // SAFETY: as above.
        unsafe { addr_of_mut!((*item).removed).write(how) };
    }
    fn slot_of(key: &FlowKey6) -> u32 {
        table::lb_flow_slot6(key)
    }
    const COUNT: table::Count = table::Count::V6Shared;
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
    /// `table::lb_put_flow` or `table::lb_put_flow6`; `replace` as there.
    fn put(key: *const Self::Key, value: *const Self::Value, replace: u32) -> u32;
    /// Where the item's key, value and result word are, and its `copied`
    /// word.
    fn parts(item: *mut Self) -> (*const Self::Key, *mut Self::Value, *mut u32, u32);
    /// The key's entry, when it is a flow in the same direction as `old`
    /// (not a reply entry), and how the two stand to each other.
    fn live(key: &Self::Key, old: &Self::Value) -> Option<Live>;
    /// The old view's backend, `state` and `last_seen`.
    fn view(old: &Self::Value) -> OldView;
    /// Where the item's value keeps its `state` and `last_seen`.
    fn words(value: *mut Self::Value) -> (*mut u64, *mut u64);
}

/// [`Insert::live`] of either family: `Flow` and `Flow6` name these
/// fields alike, and `$find` is `table::flow` or `table::flow6`.
macro_rules! live {
    ($find:path, $key:expr, $old:expr) => {{
        let old = $old;
        let live = $find($key)?;
        // SAFETY: a valid, aligned map value; plain loads of integers,
        // and the addresses of two fields.
        unsafe {
            let flow = (*live).dir == old.dir && old.dir != DIR_REPLY;
            flow.then(|| Live {
                backend_id: (*live).backend_id,
                same_endpoint: (*live).backend_id == old.backend_id
                    && (*live).nat_addr == old.nat_addr
                    && (*live).nat_port == old.nat_port,
                state: &raw mut (*live).state,
                seen: &raw mut (*live).last_seen,
            })
        }
    }};
}

impl Insert for InsertItem {
    type Key = FlowKey;
    type Value = Flow;
    fn put(key: *const FlowKey, value: *const Flow, replace: u32) -> u32 {
        table::lb_put_flow(key, value, replace | table::PUT_SWEPT, table::NO_SLOT)
    }
    fn parts(item: *mut Self) -> (*const FlowKey, *mut Flow, *mut u32, u32) {
        // SAFETY: the fields' addresses are taken, and the item (inside
        // the frame: `ptr_at`) gives its `copied` word.
        unsafe { (&raw const (*item).key, &raw mut (*item).value, &raw mut (*item).inserted, (*item).copied) }
    }
    fn live(key: &FlowKey, old: &Flow) -> Option<Live> {
        live!(table::flow, key, old)
    }
    fn view(old: &Flow) -> OldView {
        OldView { backend_id: old.backend_id, state: old.state, last_seen: old.last_seen }
    }
    fn words(value: *mut Flow) -> (*mut u64, *mut u64) {
        // SAFETY: only the fields' addresses are taken.
        unsafe { (&raw mut (*value).state, &raw mut (*value).last_seen) }
    }
}

impl Insert for InsertItem6 {
    type Key = FlowKey6;
    type Value = Flow6;
    fn put(key: *const FlowKey6, value: *const Flow6, replace: u32) -> u32 {
        table::lb_put_flow6(key, value, replace | table::PUT_SWEPT, table::NO_SLOT)
    }
    fn parts(item: *mut Self) -> (*const FlowKey6, *mut Flow6, *mut u32, u32) {
        // SAFETY: as for `InsertItem`.
        unsafe { (&raw const (*item).key, &raw mut (*item).value, &raw mut (*item).inserted, (*item).copied) }
    }
    fn live(key: &FlowKey6, old: &Flow6) -> Option<Live> {
        live!(table::flow6, key, old)
    }
    fn view(old: &Flow6) -> OldView {
        OldView { backend_id: old.backend_id, state: old.state, last_seen: old.last_seen }
    }
    fn words(value: *mut Flow6) -> (*mut u64, *mut u64) {
        // SAFETY: as for `InsertItem`.
        unsafe { (&raw mut (*value).state, &raw mut (*value).last_seen) }
    }
}

/// A key's entry as a merge sees it.
struct Live {
    backend_id: u32,
    /// It names the old view's backend endpoint.
    same_endpoint: bool,
    state: *mut u64,
    seen: *mut u64,
}

/// What a merge takes from the old program's view of a flow.
struct OldView {
    backend_id: u32,
    state: u64,
    last_seen: u64,
}

/// Bring the old program's later view of a flow copied with the state
/// bits `copied` (the item's value, `old`) into the key's entry where that
/// is still the flow's copy (see `lb_common::InsertItem::copied`):
/// answers `INSERT_MERGED`, `INSERT_REPLACED` or `INSERT_EXISTS`.
///
/// The entry is still the copy while it keeps `FLOW_COPY`, which the
/// first copy set and a new connection on the tuple drops (a new entry,
/// a reopen, a handshake taken up again: `known_flow`); the new program
/// otherwise only adds bits, so every copied bit is still set too. By its
/// bits alone, a later connection's entry that the new program made
/// before the late copy and that had come as far as the copy (a whole
/// connection, on a busy client's reused port) was taken for the copy,
/// and replaced by the old program's view of the tuple: half-open, say,
/// and the client's next connection there was then taken for a
/// retransmission and went uncounted.
#[inline(always)]
fn merge<I: Insert>(key: *const I::Key, old: *mut I::Value, copied: u32) -> u32 {
    // SAFETY: both lie inside the frame (`ptr_at`); copied out whole.
    let (k, v) = unsafe { (key.read_unaligned(), old.read_unaligned()) };
    let Some(live) = I::live(&k, &v) else { return INSERT_EXISTS };
    let view = I::view(&v);
    let copied = u64::from(copied & !COPIED);
    // SAFETY: a valid, aligned u64 inside a map value (see `known_flow`
    // on reading a word other CPUs OR bits into).
    let now = unsafe { read_volatile(live.state) };
    if now & FLOW_COPY == 0 || now & copied != copied || (now ^ copied) & FLOW_REOPENED != 0 {
        // A new connection on the tuple since the swap: the newest view.
        return INSERT_EXISTS;
    }
    // The old program's view is of a later connection on the tuple when
    // it lost a copied bit or was reopened (`reopen` clears the handshake
    // and close bits), or names another backend (scheduled anew, after
    // the copy's connection closed or its backend went down).
    let later = !live.same_endpoint || view.state & copied != copied || (view.state ^ copied) & FLOW_REOPENED != 0;
    if later { replace::<I>(key, old, &live, &view, now, copied) } else { merge_into(&live, &view, now) }
}

/// The old program's view of the same connection as the entry: ORs in
/// the handshake and close bits it saw since the copy (`MERGED_BITS`) and
/// takes its later time. The datapath writes both at the same time: the
/// state with atomic OR as it does itself, the time with a plain store
/// (either time is a packet's).
#[inline(always)]
fn merge_into(live: &Live, old: &OldView, now: u64) -> u32 {
    let mut merged = false;
    let add = old.state & MERGED_BITS & !now;
    if add != 0 {
        // SAFETY: as above.
        let before = unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(live.state, add) };
        // Closed by halves the two programs saw apart (neither counted
        // it); a close the old program saw whole it counted.
        if !flow_closed(old.state) && !flow_closed(before) && flow_closed(before | add) {
            stats::flow_closed_swept(old.backend_id, before);
        }
        merged = true;
    }
    // SAFETY: as above; plain load and store of a timestamp.
    unsafe {
        if old.last_seen > read_volatile(live.seen) {
            live.seen.write_volatile(old.last_seen);
            merged = true;
        }
    }
    if merged { INSERT_MERGED } else { INSERT_EXISTS }
}

/// The old program's view of a later connection on the tuple than the
/// entry's (`now`, still the copy): the entry is replaced by it (backend
/// and all), with the bits the new program added to the copy since
/// (`now` less `copied`: the client's packets after the swap, which are
/// the later connection's) and the later time. The old program counted
/// the copy's connection closed before it took the tuple again (`reopen`,
/// or a closed or downed flow scheduled anew), and the later one opened:
/// a close the new program counted on the copy is taken back, and the
/// later connection's close is counted if only the two views together
/// make it. The view is written into the item (inside the frame) and put
/// from there: the stack has no room for another value.
#[inline(always)]
fn replace<I: Insert>(
    key: *const I::Key,
    old: *mut I::Value,
    live: &Live,
    view: &OldView,
    now: u64,
    copied: u64,
) -> u32 {
    let state = view.state | (now & !copied & MERGED_BITS);
    // SAFETY: a plain load of a timestamp in a map value.
    let seen = unsafe { read_volatile(live.seen) }.max(view.last_seen);
    let (s, t) = I::words(old);
    // SAFETY: both words lie inside the item, inside the frame.
    unsafe {
        s.write_unaligned(state);
        t.write_unaligned(seen);
    }
    if I::put(key, old, 1) != table::Put::Done as u32 {
        return INSERT_EXISTS;
    }
    if !flow_closed(copied) && flow_closed(now) {
        stats::close_taken_back(live.backend_id, now);
    }
    if !flow_closed(view.state) && flow_closed(state) {
        stats::flow_closed_swept(view.backend_id, state);
    }
    INSERT_REPLACED
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
        let done = I::put(key, value, 0);
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

/// Mark the entry `v` as being removed (`FLOW_DOOMED`) if its state is
/// still `state`, by compare-and-swap, and its last packet still `seen`
/// (read after the mark: when a packet wrote it since, the mark comes off
/// again and the entry stays). True when marked. A SYN that takes the
/// entry up in place changes its state by an atomic operation too, so of
/// the two exactly one wins: the sweeper's swap fails, or the SYN sees
/// the mark and takes its flow up as a new one (main.rs, `syn_on_open`).
///
/// While the mark is on, the datapath counts no close of the entry (a
/// FIN or reset, `track_close`; a new entry replacing it,
/// `table::Entry`): it is the sweeper's, counted when the removal goes
/// through (lbd counts an open flow it removed as expired), or when the
/// mark comes off again ([`undoom`]). `item` is the request's item, told
/// by `undoom`.
///
/// # Safety
/// `v` points at a flow-table value, `item` at a whole item inside the
/// frame.
#[inline(always)]
unsafe fn doom<I: Item>(v: *mut I::Value, state: u64, seen: u64, item: *mut I) -> bool {
    let s = I::state(v);
    // SAFETY: the caller's promise: an aligned u64 inside a flow-table value.
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(s, state, state | FLOW_DOOMED)
    };
    if !won {
        return false;
    }
    // SAFETY: as above.
    if unsafe { I::now(v) }.1 != seen {
        // SAFETY: as above.
        unsafe { undoom::<I>(v, state, item) };
        return false;
    }
    true
}

/// Take the sweeper's mark (`doom`) off the entry `v` again, the removal
/// given up (a packet came since the entry was judged by `state`, or its
/// claim changed), and tell the request's `item` ([`SWEEP_CLOSED`]) when
/// the connection the entry was judged open for closed while it was
/// marked, which no one else counted:
/// - the state the mark comes off has a close in it (a FIN or reset, or
///   `table::Entry`'s both FINs: a new entry replacing it, which found
///   the mark, is being written);
/// - or it has no mark at all: the slot holds a new entry already, which
///   replaced the marked one (the mark is set by this sweeper alone and
///   taken off here alone, and a new entry is written without it).
///
/// A new entry that found no mark counts the old one's close itself, and
/// then the state the mark comes off here is the old entry's, not closed
/// by the replacement yet: nothing told. So exactly one side counts, as
/// the one atomic operation on the state word that came first says.
///
/// Left open: when a new entry replaced the judged one between lbd's
/// read and this run, with the very state it was judged by (a fresh
/// entry's, the judged one half-open too), the mark lands on the new
/// entry; its last packet then differs (the judged one was idle past a
/// timeout), and the mark comes off again. Only a close of the new entry
/// inside those few instructions is then told, as the judged flow's.
///
/// # Safety
/// As `doom`.
#[inline(always)]
unsafe fn undoom<I: Item>(v: *mut I::Value, state: u64, item: *mut I) {
    // SAFETY: the caller's promise: an aligned u64 inside a flow-table value.
    let was = unsafe { atomic_and::<u64, u64, { AtomicOrdering::SeqCst }>(I::state(v), !FLOW_DOOMED) };
    if !flow_closed(state) && (was & FLOW_DOOMED == 0 || flow_closed(was)) {
        // SAFETY: the caller's promise.
        unsafe { I::mark(item, SWEEP_CLOSED) };
    }
}

/// Remove the entry of each of the request's `count` items (at most `N`)
/// from `table` if it is as the item says it was judged, and mark the item.
#[inline(always)]
fn remove_unchanged<I: Item, const N: usize>(
    ctx: &XdpContext,
    count: u32,
    slots: &impl table::SlotTable<I::Key, I::Value>,
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
            at & table::MISS == 0 && table::remove_if(slots, mask, I::COUNT, at, &key, |_, _| true, |_| {})
        } else if seen == SWEEP_BY_CLAIM {
            // A reply entry no forward entry names (`lb_common::SWEEP_BY_CLAIM`):
            // `state` is the claim it was found with.
            table::remove_if(slots, mask, I::COUNT, at, &key, |_, claim| claim == state, |_| {})
        } else {
            // SAFETY: `remove_if` hands over a value of the table.
            table::remove_if(
                slots,
                mask,
                I::COUNT,
                at,
                &key,
                |v, _| unsafe { doom::<I>(v, state, seen, item) },
                |v| unsafe { undoom::<I>(v, state, item) },
            )
        };
        if removed {
            // SAFETY: inside the frame (above).
            unsafe { I::mark(item, 1) };
        }
    }
    Some(())
}

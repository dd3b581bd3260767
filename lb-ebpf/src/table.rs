//! The flow tables: open addressing in a plain array of our own
//! (`lb_common::Slot`; the protocol of a slot's claim word is described
//! there), for both families.
//!
//! Measured against the kernel's preallocated hash with the same key,
//! value and size (lb-bench, "table alone" cases, November 2026): a hit
//! 46.5 against 88.5 ns, a new entry 295-347 against 542 ns, where the
//! floor (XDP_PASS) was 33.5 ns. The kernel's map hashes with a helper,
//! walks a bucket list, and on insert pops a free-list element and takes
//! the bucket's lock: three or more cold cache lines for a new flow where
//! this touches one or two. That was an AMD VM's. On an Intel Xeon VM
//! with a large L3 (260 MB as it reports; 3 December 2026) the kernel
//! hash's new entry cost less in runs of few cases (237.5-343.5 against
//! 303.5-437.5 ns, four runs), its 64 MB bucket array apparently staying
//! cached, and more in the full bench (630.0 against 356.5 ns).
//!
//! What that costs in exchange, and how it is kept safe:
//! - Removal is the sweeper's (`sweep.rs`), and, for the one entry it has
//!   just made, a new flow's whose second insert failed
//!   ([`lb_take_back`]): it marks a slot removed (`SLOT_TOMB`) by
//!   compare-and-swap, and turns a run of removed slots that ends at an
//!   empty one back to empty, so that lookups stop early again; when an
//!   insert took that empty slot meanwhile, the run is put back as
//!   removed, by the sweeper or by the insert ([`clear_run`],
//!   `keep_reachable`).
//! - An insert takes the first free slot of the key's probe sequence
//!   after making sure the key is not further on; two CPUs inserting the
//!   same key race for the same slot, and the table keeps one entry (a
//!   loser that saw the slot being written waits for the entry, which a
//!   new flow's insert joins and a reply entry's replaces;
//!   one that lost the compare-and-swap itself to another insert gets
//!   `Put::Busy`, and its packet is held, counted `held`, for its sender
//!   to retransmit; one that lost it to a removal takes the freed slot:
//!   see `claim_and_write`).
//!   An entry that is replaced (a new connection on a closed flow's
//!   5-tuple) is rewritten in place under the claim (`SLOT_BUSY`), which
//!   lookups skip: the kernel's hash swapped a whole new element in
//!   instead.
//! - The table holds at most `conntrack_max` entries, counted by one
//!   shared counter (`FLOW_COUNT`, an atomic add per new entry); it has
//!   twice as many slots, so an insert also fails, rarely, when the key's
//!   32 slots are all taken. Either way that flow goes without an entry
//!   (`counter::TABLE_FULL`).
//! - An entry replaced in place takes its claim with the next generation
//!   (`lb_common::SLOT_GEN`), and the sweeper swaps from the claim it
//!   read before judging the entry: a replacement between the two, which
//!   left the claim READY with the same tag as before, failed nothing
//!   and lost the new connection's entry (the datapath test that reuses
//!   tuples beside a sweeper running without pause: 3 entries lost in
//!   2.7 million flows, 16 runs, against none in as many after).
//! - Between the sweeper's check of an entry and its compare-and-swap lie
//!   a few instructions, as before between its check and the kernel's
//!   delete: a packet on another CPU that writes the entry in place then
//!   (its timestamp, its state bits) is not seen (its flow is judged
//!   again at the next sweep, if it still has an entry). A SYN that
//!   takes an entry up in place (`resumed`, `renew`, `reopen` in
//!   main.rs) is the exception: it and the sweeper's removal exclude
//!   each other on the state word (`lb_common::FLOW_DOOMED`, which the
//!   sweeper sets by compare-and-swap before it swaps the claim:
//!   `sweep.rs`, `doom`). A CPU holding a pointer to
//!   an entry while the sweeper removes it, and another CPU's insert
//!   takes the slot, may write its timestamp or state bits into the new
//!   entry: as with the kernel's preallocated hash, whose freed elements
//!   were reused at once.
use core::{
    intrinsics::{AtomicOrdering, atomic_cxchg, atomic_or, atomic_xadd, atomic_xsub},
    mem::size_of,
    ptr::read_volatile,
};

use lb_common::{
    DIR_REPLY, FLOW_DOOMED, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, Flow, Flow6, FlowKey, FlowKey6, SLOT_BUCKET, SLOT_BUSY,
    SLOT_EMPTY, SLOT_GEN, SLOT_GEN_ONE, SLOT_MATCH, SLOT_PROBES, SLOT_READY, SLOT_STATE, SLOT_TAG, SLOT_TOMB, Slot,
    SlotKey, flow_closed, flow_credit_batch,
};

use crate::maps::{
    FLOW_COUNT, FLOW_CREDIT, FLOW_SLOTS, FLOW_SLOTS6, FlowTable, SCRATCH, SCRATCH6, flow_limit, flow_limit6, flow_mask,
    flow_mask6, flow_seed,
};

/// Reads of a claim a writer holds (`SLOT_BUSY`) before an insert gives
/// up on that slot: the writer is another CPU between two instructions
/// of its own insert (XDP runs without preemption), tens of nanoseconds,
/// but its stores of the entry wait for the cache line this loop keeps
/// reading. With 64, two CPUs inserting the same 20,000 new flows at
/// once (BPF_PROG_TEST_RUN, Intel Xeon VM, December 2026) gave up on 299
/// of them, with 1,024 on 2: so many reads are cheap (only an insert
/// that meets a writer on a slot with its key's tag spins at all).
const SPIN: u32 = 1024;

/// A flow table's slots, by index.
pub(crate) trait SlotTable<K, V> {
    /// Slot `at` (None past the end, or where lbd has not put an array).
    fn slot(&self, at: u32) -> Option<*mut Slot<K, V>>;
}

impl<K, V, const N: usize> SlotTable<K, V> for FlowTable<[Slot<K, V>; SLOT_BUCKET as usize], N> {
    /// Slot `at % SLOT_BUCKET` of element `e = at / SLOT_BUCKET`, which is
    /// element `e % N` of array `e / N` (`lb_common::FLOW_ARRAY_ELEMENTS`):
    /// two lookups, both inlined by the verifier, of which the outer
    /// array's (8 bytes an array) stays in cache.
    #[inline(always)]
    fn slot(&self, at: u32) -> Option<*mut Slot<K, V>> {
        let element = at / SLOT_BUCKET;
        let bucket = self.get_value_ptr_mut(element / N as u32, &(element % N as u32))?;
        // SAFETY: the offset is below SLOT_BUCKET, inside the element.
        Some(unsafe { bucket.cast::<Slot<K, V>>().add((at % SLOT_BUCKET) as usize) })
    }
}

/// Slot `at` of `table` (None past the end).
#[inline(always)]
pub(crate) fn slot_at<K, V>(table: &impl SlotTable<K, V>, at: u32) -> Option<*mut Slot<K, V>> {
    table.slot(at)
}

/// Where `key`'s entry is in `table` (`mask`: its size - 1), as
/// [`lb_flow_slot`] answers: the slot's index, or on a miss the slot an
/// insert of `key` would take ([`MISS`] set, [`MISS_TOMB`] too when that
/// slot holds a removed entry), or `NO_SLOT` when there is no such slot
/// (all the key's slots taken) or another CPU was writing a slot with the
/// key's tag (maybe this very key: the full insert waits for it).
///
/// `ahead` (an IPv4 TCP SYN to a VIP whose service keeps reply entries,
/// by lbd's reply-entry hint): the lines of the key's second slot are
/// loaded too, together with the first slot's. A new flow with a reply
/// entry (a backend endpoint shared with another service) takes two
/// slots side by side, the reply entry the first and the flow's own the
/// next; without this, the second slot's lines came
/// only at that second insert, after the first one's locked
/// instructions, which wait for every earlier load: a second memory miss
/// after the first. On an Intel Xeon VM (1 December 2026, seven
/// alternating pairs of `lb-bench packet` runs, empty table) such a new
/// flow cost 21-145 ns more than a one-insert new flow of the same run
/// with it, against 213-352 ns without; the established flow (which does
/// not look ahead) moved within its noise. Loaded for every packet, it
/// made the established flow look some ns dearer (three pairs), hence
/// openings only; and for every SYN, a one-insert new flow (which loads
/// the second slot for nothing) measured dearer in 8 of 11 pairs, hence
/// only the SYNs of VIPs whose flows take two entries (README).
#[inline(always)]
pub(crate) fn find<K: SlotKey, V>(table: &impl SlotTable<K, V>, mask: u32, key: &K, ahead: bool) -> u32 {
    let h = key.slot_hash(flow_seed());
    let want = (h & SLOT_TAG) | SLOT_READY;
    let writer = (h & SLOT_TAG) | SLOT_BUSY;
    let start = h as u32;
    // The first removed slot seen (`NO_SLOT`: none yet), and whether a
    // writer held a slot with the key's tag.
    let mut free = NO_SLOT;
    let mut busy = false;
    if ahead && let Some(next) = slot_at(table, start.wrapping_add(1) & mask) {
        touch_slot(next);
    }
    // Verifier: a bounded loop.
    for j in 0..SLOT_PROBES {
        let at = start.wrapping_add(j) & mask;
        let Some(slot) = slot_at(table, at) else { return NO_SLOT };
        touch_lines(slot);
        // SAFETY: a valid map value; the claim is read once (volatile:
        // other CPUs change it), the key only when the claim is a whole
        // entry's with the key's tag.
        unsafe {
            let claim = read_volatile(&raw const (*slot).claim);
            if claim == SLOT_EMPTY {
                return if busy {
                    NO_SLOT
                } else if free == NO_SLOT {
                    at | MISS
                } else {
                    free
                };
            }
            // Tag and state, the generation aside (`lb_common::Slot`).
            if claim & SLOT_MATCH == want && (*slot).key.same(key) {
                return at;
            }
            if claim == SLOT_TOMB && free == NO_SLOT {
                free = at | MISS | MISS_TOMB;
            }
            if claim & SLOT_MATCH == writer {
                busy = true;
            }
        }
    }
    if busy { NO_SLOT } else { free }
}

/// Read a word of each cache line of `slot` past its first one (the
/// claim's, which the caller reads next), discarding it (BPF has no
/// prefetch): the loads are issued together with the claim's, so that a
/// slot spanning two lines (an IPv4 slot of 80 bytes always does, an
/// IPv6 one of 120 bytes mostly spans three) costs one memory miss rather
/// than two in a row. Without them the next line came only when used: for
/// a new flow at the insert, whose writes the locked add that publishes
/// the entry waits for, after the first miss had been paid. On an Intel
/// Xeon VM (1 December 2026, three alternating pairs of `lb-bench packet`
/// runs, empty table) a maglev new flow cost 333-363 ns with them against
/// 458-484 without, an IPv6 one 426-445 against 557-592; the established
/// flow did not move.
#[inline(always)]
fn touch_lines<K, V>(slot: *mut Slot<K, V>) {
    let words = slot.cast::<u64>();
    let last = size_of::<Slot<K, V>>() / 8 - 1;
    // Every eighth word (64 bytes apart) after the first, and the last:
    // no line of the slot is left between two reads.
    let mut i = 8;
    while i < last {
        // SAFETY: word `i` is within the slot, a valid map value, aligned.
        unsafe { read_volatile(words.add(i)) };
        i += 8;
    }
    // SAFETY: as above; the slot's last word.
    unsafe { read_volatile(words.add(last)) };
}

/// Every cache line of `slot`, its first word's included (as
/// [`touch_lines`]).
#[inline(always)]
fn touch_slot<K, V>(slot: *mut Slot<K, V>) {
    // SAFETY: a valid map value, aligned; a discarded read.
    unsafe { read_volatile(slot.cast::<u64>()) };
    touch_lines(slot);
}

/// Copy a `T` (a whole number of words `W`: u64 for every key and value
/// of the tables, u32 for a 4-aligned `Service`) word by word. A plain
/// assignment of a struct this size becomes a call of `memmove`, a byte
/// loop, which the verifier walks byte by byte on every path.
///
/// # Safety
/// Both point at a valid `T` that do not overlap, aligned as `T` is.
#[inline(always)]
pub(crate) unsafe fn copy_words<T, W: Copy>(dst: *mut T, src: *const T) {
    const { assert!(size_of::<T>().is_multiple_of(size_of::<W>()) && align_of::<T>() >= align_of::<W>()) };
    let (d, s) = (dst.cast::<W>(), src.cast::<W>());
    for i in 0..size_of::<T>() / size_of::<W>() {
        // SAFETY: the caller's promise; i is within T's words. Volatile,
        // so that the compiler does not turn the loop back into a call.
        unsafe { d.add(i).write_volatile(s.add(i).read_volatile()) };
    }
}

/// A flow table's entry count (`FLOW_COUNT`) and its limit
/// (`conntrack_max`, `conntrack_max_ipv6`), as a packet's XDP run uses
/// them (`V4`, `V6`: with this CPU's share, `FLOW_CREDIT`), or the shared
/// count only (`V4Shared`, `V6Shared`): the sweeper's (see `FLOW_CREDIT`
/// on why), and a packet's taking back of the reply entry it has just
/// made (rare, and in a frame with no room for the share's logic: the
/// balancer's deepest chain of calls is at the verifier's 512 bytes).
#[derive(Clone, Copy)]
pub(crate) enum Count {
    V4,
    V6,
    V4Shared,
    V6Shared,
}

impl Count {
    /// Whether this is a packet's put (the datapath's), not the sweeper's.
    #[inline(always)]
    fn datapaths(self) -> bool {
        matches!(self, Self::V4 | Self::V6)
    }

    /// The table's index in `FLOW_COUNT` and `FLOW_CREDIT`.
    #[inline(always)]
    fn index(self) -> u32 {
        match self {
            Self::V4 | Self::V4Shared => 0,
            Self::V6 | Self::V6Shared => 1,
        }
    }

    #[inline(always)]
    fn word(self) -> Option<*mut u64> {
        FLOW_COUNT.get_ptr_mut(self.index())
    }

    /// This CPU's share of the count, for a packet's XDP run (None for
    /// the sweeper's).
    #[inline(always)]
    fn credit(self) -> Option<*mut u64> {
        match self {
            Self::V4 | Self::V6 => FLOW_CREDIT.get_ptr_mut(self.index()),
            Self::V4Shared | Self::V6Shared => None,
        }
    }

    #[inline(always)]
    fn limit(self) -> u64 {
        u64::from(match self {
            Self::V4 | Self::V4Shared => flow_limit(),
            Self::V6 | Self::V6Shared => flow_limit6(),
        })
    }

    /// Room for one more entry, taken; false when the table holds its
    /// limit. A packet's run takes it from this CPU's share, and when that
    /// is used up, takes a new share from the shared count (one atomic add
    /// for `flow_credit_batch` entries); when no whole share is left, or
    /// for the sweeper, one entry's room from the shared count, which
    /// stays exact under any number of CPUs inserting at once.
    #[inline(always)]
    pub(crate) fn take(self) -> bool {
        let Some(w) = self.word() else { return false };
        let limit = self.limit();
        if let Some(c) = self.credit() {
            // SAFETY: this CPU's slot of a per-CPU map; only packets' runs
            // use it, and one does not interrupt another on its CPU. Plain
            // loads and stores.
            unsafe {
                if *c > 0 {
                    *c -= 1;
                    return true;
                }
            }
            let batch = flow_credit_batch(limit as u32);
            if batch > 1 {
                // SAFETY: a valid, aligned u64 of a map value; atomic RMW.
                let before = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(w, batch) };
                if before + batch <= limit {
                    // SAFETY: as above.
                    unsafe { *c = batch - 1 };
                    return true;
                }
                // SAFETY: as above.
                unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::SeqCst }>(w, batch) };
            }
        }
        // SAFETY: a valid, aligned u64 of a map value; atomic RMW only.
        let before = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(w, 1) };
        if before < limit {
            return true;
        }
        // SAFETY: as above.
        unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::SeqCst }>(w, 1) };
        false
    }

    /// Room for one entry given back (an entry removed, or a claim lost):
    /// to this CPU's share on a packet's run, while it holds less than a
    /// whole one, else to the shared count.
    #[inline(always)]
    pub(crate) fn give_back(self) {
        if let Some(c) = self.credit() {
            // SAFETY: as in `take`.
            unsafe {
                if *c + 1 < flow_credit_batch(self.limit() as u32) {
                    *c += 1;
                    return;
                }
            }
        }
        if let Some(w) = self.word() {
            // SAFETY: as in `take`.
            unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::SeqCst }>(w, 1) };
        }
    }
}

/// What `put` did.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Put {
    /// None of the key's slots was free (or a writer held the one needed).
    Full = 0,
    Done = 1,
    /// `key` has an entry, and `replace` was not asked.
    Exists = 2,
    /// Another CPU took the free slot (or the entry) this insert was
    /// about to claim, or, with [`PUT_JOIN`], is still writing `key`'s
    /// entry after [`SPIN`] reads of its claim: a race, not a full table.
    Busy = 3,
}

impl Put {
    /// A global function's answer (`Put as u32`) back.
    #[inline(always)]
    pub(crate) fn of(answer: u32) -> Self {
        match answer {
            1 => Self::Done,
            2 => Self::Exists,
            3 => Self::Busy,
            _ => Self::Full,
        }
    }
}

/// Insert `value` as `key`'s entry, or, if `replace`, replace the entry
/// `key` has; `join`: [`PUT_JOIN`] was asked (see `Put::Busy`).
///
/// Slots are tracked by index, and the free one's claim by its state bits
/// alone, packed into one word; the mask (`mask`, a constant the verifier
/// knows) is read where it is used and the value (`value`) once a slot is
/// found: the global functions that call this run at the end of the
/// balancer's deepest chain of calls, whose stack frames together may
/// take 512 bytes at most, and every value kept across the loop's map
/// lookups (helper calls) costs a stack slot.
#[expect(
    clippy::too_many_arguments,
    reason = "inlined into its two global functions; the flags as one word, decoded here, made the verifier's walk \
              pass its million instructions"
)]
#[inline(always)]
pub(crate) fn put<K: SlotKey, V: Copy + Entry>(
    table: &impl SlotTable<K, V>,
    mask: impl Fn() -> u32,
    count: Count,
    key: &K,
    value: impl Fn() -> Option<*const V>,
    replace: bool,
    join: bool,
    hint: u32,
) -> Put {
    if hint != NO_SLOT
        && let Some(done) = put_at(table, mask(), count, key, &value, replace, hint)
    {
        return done;
    }
    let h = key.slot_hash(flow_seed());
    // The tag alone (a claim's high half), compared with a claim's state
    // bits apart: tag-and-state words kept for the comparisons would take
    // two more stack slots.
    let tag = (h >> 32) as u32;
    let start = h as u32;
    // The first free slot of the sequence (or the key's own) and the first
    // slot with this key's tag that a writer held.
    let mut seen = Seen::NONE;
    for j in 0..SLOT_PROBES {
        let at = start.wrapping_add(j) & mask();
        let Some(slot) = slot_at(table, at) else { return Put::Full };
        // SAFETY: a valid map value; the claim read as in `find`.
        let claim = unsafe { read_volatile(&raw const (*slot).claim) };
        let ours = (claim >> 32) as u32 == tag;
        let state = claim & SLOT_STATE;
        // Another CPU writing a slot with this key's tag: maybe this very
        // key (the same flow's packet on two CPUs); looked at again below.
        if state == SLOT_BUSY && ours {
            seen = seen.busy(at);
        }
        if claim == SLOT_EMPTY {
            seen = seen.free(at, SLOT_EMPTY);
            break;
        }
        if claim == SLOT_TOMB {
            seen = seen.free(at, SLOT_TOMB);
            continue;
        }
        // SAFETY: as in `find`.
        if state == SLOT_READY && ours && unsafe { (*slot).key.same(key) } {
            if !replace {
                return Put::Exists;
            }
            // Replaced in place, under the claim.
            seen = seen.own(at);
            break;
        }
    }
    let tag = u64::from(tag) << 32;
    // A writer held a slot with this key's tag: wait for its entry (once
    // per insert, outside the probe loop: the verifier walks every
    // iteration of a loop in a loop). If it is this key's, that entry is
    // the one to replace (or keep).
    if let Some(busy) = seen.busy_at()
        && seen.free_state() != SLOT_READY
    {
        let Some(slot) = slot_at(table, busy) else { return Put::Full };
        let mut claim = SLOT_BUSY | tag;
        for _ in 0..SPIN {
            // SAFETY: a valid map value, read as in `find`.
            claim = unsafe { read_volatile(&raw const (*slot).claim) } & SLOT_MATCH;
            if claim != SLOT_BUSY | tag {
                break;
            }
        }
        // SAFETY: as in `find`.
        if claim == SLOT_READY | tag && unsafe { (*slot).key.same(key) } {
            if !replace {
                return Put::Exists;
            }
            seen = seen.own(busy);
        }
        // Still written after all the reads (its writer interrupted, or
        // its vCPU descheduled, between its swap and its publish): maybe
        // this very key's entry, whose key may not even be written yet. A
        // joining insert ([`PUT_JOIN`]) puts in no second entry that might
        // be the same flow's (no lookup would find it, and the flow would
        // be counted twice): it gives up. (Another key with the same
        // 32-bit tag, its writer stalled too, costs a packet that its
        // sender retransmits.)
        if join && claim == SLOT_BUSY | tag {
            return Put::Busy;
        }
    }
    let Some(at) = seen.free_at() else { return Put::Full };
    let Some(slot) = slot_at(table, at) else { return Put::Full };
    let Some(value) = value() else { return Put::Full };
    let fresh = seen.free_state() != SLOT_READY;
    let old = if fresh { seen.free_state() } else { SLOT_READY | tag };
    // A swap lost to another CPU's insert answers `Busy`, whose packet is
    // held, not `Full`, which routes a flow without an entry (by
    // consistent hash: maybe another backend than that CPU's entry of the
    // same flow names) or drops it as if the table had no room; a slot a
    // removal freed meanwhile is taken once more (`claim_and_write`).
    claim_and_write(slot, old, tag, fresh, true, count, key, value, || keep_reachable(table, mask(), start, at))
}

/// `put` in the slot a lookup of `key` just found (`hint`, as
/// [`lb_flow_slot`] answers), without probing again, or, when another
/// key has taken that free slot since, in the next one if it is free.
/// None otherwise: `put` then probes.
///
/// Why the lookup's slot is the one: the lookup saw every slot before it
/// taken by other keys (or removed: then it named the first removed one),
/// and no writer on a slot with the key's tag. Another CPU inserting the
/// same key now takes the first free slot it sees, this same slot, and
/// only one of the two compare-and-swaps wins; the loser probes and finds
/// the winner's entry, as in `put`. The one way to two entries: between
/// this packet's lookup and its insert, another key takes the slot, the
/// other CPU's insert of this key goes past it, and the sweeper removes
/// that other key's entry again (a closed flow, removed after
/// `CLOSED_LINGER` seconds at the earliest; `put` alone has the same
/// window between its probe and its swap, a few instructions shorter).
/// The second entry is then never found, and goes when it is idle.
#[inline(always)]
fn put_at<K: SlotKey, V: Copy + Entry>(
    table: &impl SlotTable<K, V>,
    mask: u32,
    count: Count,
    key: &K,
    value: &impl Fn() -> Option<*const V>,
    replace: bool,
    hint: u32,
) -> Option<Put> {
    let h = key.slot_hash(flow_seed());
    let tag = h & SLOT_TAG;
    let (at, old, fresh) = if hint & MISS == 0 {
        if !replace {
            return Some(Put::Exists);
        }
        (hint, SLOT_READY | tag, false)
    } else {
        (hint & HINT_AT, if hint & MISS_TOMB != 0 { SLOT_TOMB } else { SLOT_EMPTY }, true)
    };
    if at > mask {
        return None;
    }
    let slot = slot_at(table, at)?;
    // A plain read of the claim first: when the slot has changed since the
    // lookup, the swap below would fail after the count was taken, and the
    // count be given back: three locked instructions for nothing. The
    // lookup has just read this line, so the read is a hit.
    // SAFETY: a valid map value, read as in `find`.
    let now = unsafe { read_volatile(&raw const (*slot).claim) };
    let (at, slot, old) =
        if now & SLOT_MATCH == old { (at, slot, old) } else { next_free(table, mask, h, at, now, fresh)? };
    let value = value()?;
    // No second try here: a lost slot sends the insert to `put`'s probe.
    if claim_and_write(slot, old, tag, fresh, false, count, key, value, || keep_reachable(table, mask, h as u32, at))
        != Put::Done
    {
        return None;
    }
    Some(Put::Done)
}

/// `put_at`'s way on when the free slot `at` that a lookup of a key
/// (slot hash `h`) found holds the claim `now` instead: the next slot of
/// the key's sequence (its index, the slot, its claim), when that slot is
/// free.
#[inline(always)]
fn next_free<K, V>(
    table: &impl SlotTable<K, V>,
    mask: u32,
    h: u64,
    at: u32,
    now: u64,
    fresh: bool,
) -> Option<(u32, *mut Slot<K, V>, u64)> {
    // The free slot was taken since the lookup by another key, whole or
    // being written: a shared endpoint's reply entry, inserted just
    // before the forward entry, starts probing at the same slot and takes
    // it (or another CPU's new flow won it). The lookup saw the key in
    // none of its slots, and every slot before this one taken, so when
    // the next slot of the sequence is free, it is where `put` would go:
    // taken without probing again. Anything else (the slot now holds a
    // claim with the key's tag, maybe this very key's from another CPU;
    // it went free again; the next slot is taken, or past the key's
    // sequence), and `put` probes.
    let state = now & SLOT_STATE;
    if !fresh || now & SLOT_TAG == h & SLOT_TAG || (state != SLOT_READY && state != SLOT_BUSY) {
        return None;
    }
    if at.wrapping_sub(h as u32) & mask >= SLOT_PROBES - 1 {
        return None;
    }
    let next = at.wrapping_add(1) & mask;
    let slot = slot_at(table, next)?;
    // SAFETY: a valid map value, read as in `find`.
    let claim = unsafe { read_volatile(&raw const (*slot).claim) };
    (claim == SLOT_EMPTY || claim == SLOT_TOMB).then_some((next, slot, claim))
}

/// After a new entry took slot `at` of a key's sequence (which starts at
/// `start`): any slot of the sequence before it that is empty now is made
/// a removed one again, so that lookups go on to the entry.
///
/// Why one can be empty: the insert saw every slot before `at` taken or
/// removed, and `at` free. A removal ([`remove_if`]) just before `at`
/// that saw `at` still empty, before this insert's claim, turned the run
/// of removed slots it ended back to empty, the slot before `at` among
/// them: lookups then stopped there, short of the new entry, and every
/// later packet of its flow missed it (a round-robin flow's went to its
/// consistent-hash backend instead, which reset the connection: about
/// one flow in 250,000 in the datapath test that inserts beside a
/// sweeper running without pause on a 64-slot table). A removal that
/// ends its clearing after this claim sees `at` taken and puts the run
/// back itself; this check covers one that ended before. Nothing to do
/// for the common entry that takes its sequence's first slot; otherwise
/// the slots read are the ones the insert's probe has just read.
#[inline(always)]
fn keep_reachable<K, V>(table: &impl SlotTable<K, V>, mask: u32, start: u32, at: u32) {
    put_back_removed(table, mask, at.wrapping_sub(1), at.wrapping_sub(start) & mask);
}

/// The `n` slots `top`, `top - 1`, ... (at most a probe sequence's) that
/// are empty made removed again: both sides of the race described at
/// [`keep_reachable`] and [`clear_run`]. By compare-and-swap, so an
/// insert that took one of them meanwhile keeps it.
#[inline(always)]
fn put_back_removed<K, V>(table: &impl SlotTable<K, V>, mask: u32, top: u32, n: u32) {
    for j in 0..SLOT_PROBES {
        if j >= n {
            break;
        }
        let Some(s) = slot_at(table, top.wrapping_sub(j) & mask) else { break };
        // SAFETY: a valid map value; the claim read as in `find` (a
        // plain read first: the slots are in cache, a locked instruction
        // on a taken one would be wasted), changed only from empty to
        // removed.
        unsafe {
            if read_volatile(&raw const (*s).claim) == SLOT_EMPTY {
                atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    &raw mut (*s).claim,
                    SLOT_EMPTY,
                    SLOT_TOMB,
                );
            }
        }
    }
}

/// A flow-table value that a packet's new entry replaces (both
/// families).
pub(crate) trait Entry {
    /// Close the entry at `v`, which a packet's new entry is about to
    /// overwrite (its slot's claim held: `claim_and_write`), and count
    /// its connection closed unless that was counted already: by the
    /// packet that closed it, or, when the sweeper is removing it
    /// (`FLOW_DOOMED`), by the sweeper (`sweep.rs`, `undoom`). The one
    /// place the close of an open entry that goes this way is counted: a
    /// flow re-dispatched from a backend that went down, a SYN that found
    /// the sweeper's mark, the entry of a new flow whose packets came on
    /// two CPUs at once, the second replacing the first's.
    ///
    /// An atomic OR of both FIN bits, which says whether it closed the
    /// entry: a packet closing it on another CPU at the same moment, or
    /// the sweeper marking it, see it closed, as this sees theirs.
    ///
    /// # Safety
    /// `v` points at a flow-table value.
    unsafe fn close_replaced(v: *mut Self);
}

/// [`Entry::close_replaced`] of an entry with the state word `state`
/// (`dir`, `backend_id`: its direction and backend, read first: its words
/// are overwritten only once this returns). A reply entry counts nothing:
/// its forward entry holds the connection's state.
#[inline(always)]
fn close_replaced(state: *mut u64, dir: u8, backend_id: u32) {
    let closing = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND;
    // SAFETY: an aligned u64 inside a flow-table value (the caller's).
    let old = unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(state, closing) };
    if dir != DIR_REPLY && !flow_closed(old) && old & FLOW_DOOMED == 0 {
        crate::stats::flow_closed(backend_id, old);
    }
}

impl Entry for Flow {
    unsafe fn close_replaced(v: *mut Self) {
        // SAFETY: the caller's promise; plain loads of integers.
        let (dir, backend_id) = unsafe { ((*v).dir, (*v).backend_id) };
        close_replaced(crate::state_of(v), dir, backend_id);
    }
}

impl Entry for Flow6 {
    unsafe fn close_replaced(v: *mut Self) {
        // SAFETY: as above.
        let (dir, backend_id) = unsafe { ((*v).dir, (*v).backend_id) };
        close_replaced(crate::v6::state_of(v), dir, backend_id);
    }
}

/// Take `slot` from the claim `old` (its tag and state: a whole entry's
/// claim also holds a generation) and write `key` and `value` into it,
/// publishing it once whole (`tag`: the key's tag, in a claim's high
/// half; `fresh`: a new entry, counted against the limit, of generation
/// 0, rather than the key's own being replaced, which takes the next
/// generation), then, for a new entry, run `reach` (`keep_reachable`).
/// `Put::Done`; `Put::Full` when the table holds its limit.
///
/// When the slot's claim is no longer `old`, either another CPU's insert
/// took it (being written, or whole: maybe this very key's, the same
/// flow's packet on another CPU, or a shared endpoint's reply entry
/// meeting the same flow's entry, whose slots start at the same one):
/// `Put::Busy`, a race, whose packet is held for its sender to
/// retransmit. Or a removal freed it (the sweeper's, or a reply entry
/// that another CPU's insert took back; the entry being replaced may be
/// the one removed): with `retry` the slot is taken once more, from the
/// claim found, as a new entry (once: `Put::Full` when a second removal
/// beats it too); without, `Put::Full`. (Answering `Busy` there held a
/// SYN whose closed entry the sweeper had just removed, and under round
/// robin its next packet, finding no entry, went by consistent hash to
/// another backend: 1 of 183,408 flows in a run of the datapath test
/// that reuses tuples beside a sweeper. `Full` drops a shared endpoint's
/// new flow as `flow_table`.)
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "inlined: the slot, the claims and the key and value a put already holds, and how it ends"
)]
fn claim_and_write<K, V: Entry>(
    slot: *mut Slot<K, V>,
    old: u64,
    tag: u64,
    fresh: bool,
    retry: bool,
    count: Count,
    key: &K,
    value: *const V,
    reach: impl FnOnce(),
) -> Put {
    // A new entry counts against the table's limit first.
    if fresh && !count.take() {
        return Put::Full;
    }
    // SAFETY: a valid map value. The compare-and-swap makes this CPU the
    // slot's only writer; readers skip it until the add below publishes
    // it, after the entry (a BPF atomic is a full barrier). `value` is
    // the caller's, valid for reads.
    unsafe {
        // A replacement swaps from the whole claim, generation and all
        // (read again here: the caller compared its tag and state), to
        // the next generation, so that a sweeper that read the old entry's
        // claim cannot remove the new one (`remove_if`). The line was just
        // read: a hit. A claim that differs already counts as a lost swap.
        let (expect, generation) = if fresh {
            (old, 0)
        } else {
            let now = read_volatile(&raw const (*slot).claim);
            (now, now.wrapping_add(SLOT_GEN_ONE) & SLOT_GEN)
        };
        let claim = SLOT_BUSY | generation | tag;
        let (found, won) = if expect & SLOT_MATCH == old {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                &raw mut (*slot).claim,
                expect,
                claim,
            )
        } else {
            (expect, false)
        };
        let mut fresh = fresh;
        if !won {
            let removed = freed(found);
            // A new entry keeps its count for the second try.
            if fresh && !(retry && removed) {
                count.give_back();
            }
            if !removed {
                return Put::Busy;
            }
            if !retry || (!fresh && !count.take()) {
                return Put::Full;
            }
            fresh = true;
            let (again, won) = atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                &raw mut (*slot).claim,
                found,
                claim,
            );
            if !won {
                count.give_back();
                // Lost again: to an insert, a race as above; to a second
                // removal (a removed slot made empty again, as the
                // sweeper does right after removing), no more tries.
                return if taken(again) { Put::Busy } else { Put::Full };
            }
        }
        if !fresh && count.datapaths() {
            V::close_replaced(&raw mut (*slot).value);
        }
        copy_words::<_, u64>(&raw mut (*slot).key, key);
        copy_words::<_, u64>(&raw mut (*slot).value, value);
        atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(&raw mut (*slot).claim, SLOT_READY - SLOT_BUSY);
        if fresh {
            reach();
        }
    }
    Put::Done
}

/// Whether a claim a lost swap found says a removal freed the slot (empty
/// or removed) rather than another insert's entry (being written, or
/// whole): `claim_and_write`'s two answers to a lost swap.
#[inline(always)]
fn freed(claim: u64) -> bool {
    let state = claim & SLOT_STATE;
    state == SLOT_EMPTY || state == SLOT_TOMB
}

/// The other side of [`freed`], as the second lost swap asks it.
#[inline(always)]
fn taken(claim: u64) -> bool {
    let state = claim & SLOT_STATE;
    state == SLOT_BUSY || state == SLOT_READY
}

/// What `put`'s probe loop found, in one word (every value kept across
/// the loop's map lookups, which are helper calls, costs a stack slot,
/// and `put` runs at the end of the balancer's deepest chain of calls,
/// whose frames may take 512 bytes in all): the first free slot, or the
/// key's own entry, in bits 0-30, the state bits of its claim (EMPTY,
/// TOMB, or READY for the key's own) in bits 31-32, and the first slot
/// with the key's tag that a writer held in bits 33-63. An index of all
/// ones is none (a table has at most 2^30 slots).
#[derive(Clone, Copy)]
struct Seen(u64);

impl Seen {
    const IDX: u64 = 0x7fff_ffff;
    const NONE: Self = Self(Self::IDX | (Self::IDX << 33));

    /// The first free slot, unless one was seen before.
    #[inline(always)]
    fn free(self, at: u32, state: u64) -> Self {
        if self.0 & Self::IDX != Self::IDX {
            return self;
        }
        Self((self.0 & !(Self::IDX | (3 << 31))) | (u64::from(at) & Self::IDX) | (state << 31))
    }

    /// The key's own entry, which replaces any free slot seen.
    #[inline(always)]
    fn own(self, at: u32) -> Self {
        Self((self.0 & !(Self::IDX | (3 << 31))) | (u64::from(at) & Self::IDX) | (SLOT_READY << 31))
    }

    /// The first slot a writer held, unless one was seen before.
    #[inline(always)]
    fn busy(self, at: u32) -> Self {
        if (self.0 >> 33) != Self::IDX {
            return self;
        }
        Self((self.0 & !(Self::IDX << 33)) | ((u64::from(at) & Self::IDX) << 33))
    }

    #[inline(always)]
    fn free_at(self) -> Option<u32> {
        let at = self.0 & Self::IDX;
        (at != Self::IDX).then_some(at as u32)
    }

    #[inline(always)]
    fn free_state(self) -> u64 {
        (self.0 >> 31) & 3
    }

    #[inline(always)]
    fn busy_at(self) -> Option<u32> {
        let at = self.0 >> 33;
        (at != Self::IDX).then_some(at as u32)
    }
}

/// Remove the entry in slot `at` if it is `key`'s and `take`, handed its
/// value and the slot's claim as read, says it is as the sweeper judged
/// it (and marks it: `lb_common::FLOW_DOOMED`; or the claim is the one
/// judged, `lb_common::SWEEP_BY_CLAIM`), and give its room back to
/// `count`; then, when the slot after it is empty, turn the run of
/// removed slots that ends here back to empty
/// ([`clear_run`], in the table of `count`'s family, which is `table`).
/// When the swap of the claim fails (the entry was replaced since its
/// claim was read), `undo` takes the mark off again. True when the entry
/// was removed.
#[inline(always)]
pub(crate) fn remove_if<K: SlotKey, V>(
    table: &impl SlotTable<K, V>,
    mask: u32,
    count: Count,
    at: u32,
    key: &K,
    take: impl Fn(*mut V, u64) -> bool,
    undo: impl Fn(*mut V),
) -> bool {
    let Some(slot) = slot_at(table, at & mask) else { return false };
    let want = (key.slot_hash(flow_seed()) & SLOT_TAG) | SLOT_READY;
    // SAFETY: a valid map value; claim and key read as in `find`.
    unsafe {
        // The claim first, then the entry: the swap below is from this
        // claim, generation and all, so it fails when the entry was
        // replaced since (a replacement takes the next generation), even
        // by one that ended before the swap (the claim READY again).
        let claim = read_volatile(&raw const (*slot).claim);
        if claim & SLOT_MATCH != want || !(*slot).key.same(key) || !take(&raw mut (*slot).value, claim) {
            return false;
        }
        let (_, won) = atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            &raw mut (*slot).claim,
            claim,
            SLOT_TOMB,
        );
        if !won {
            undo(&raw mut (*slot).value);
            return false;
        }
    }
    count.give_back();
    match count {
        Count::V4 | Count::V4Shared => lb_clear_removed(at),
        Count::V6 | Count::V6Shared => lb_clear_removed6(at),
    };
    true
}

/// After slot `at`'s entry was removed: when the slot after it is empty,
/// the run of removed slots that ends at `at` turned back to empty (no
/// probe sequence goes past an empty slot, so none needs them).
///
/// An insert that saw the slot after the run empty may have taken it
/// since (its probe went past the run's slots, then removed or taken):
/// the run's slots, empty now, would hide its entry from lookups. So the
/// slot after the run is read again once they are cleared, and when it
/// is taken, they are put back as removed (an insert may have taken one
/// meanwhile: it keeps it). The insert checks the same from its side
/// (`keep_reachable`), for a claim made after that second read.
#[inline(always)]
fn clear_run<K, V>(table: &impl SlotTable<K, V>, mask: u32, at: u32) {
    let Some(next) = slot_at(table, at.wrapping_add(1) & mask) else { return };
    // SAFETY: a valid map value, its claim read as in `find`.
    if unsafe { read_volatile(&raw const (*next).claim) } != SLOT_EMPTY {
        return;
    }
    let mut cleared = 0;
    for j in 0..SLOT_PROBES {
        let Some(s) = slot_at(table, at.wrapping_sub(j) & mask) else { break };
        // SAFETY: as above; only a removed slot is cleared (an insert may
        // have claimed it meanwhile: then the swap fails and this stops).
        let (_, done) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                &raw mut (*s).claim,
                SLOT_TOMB,
                SLOT_EMPTY,
            )
        };
        if !done {
            break;
        }
        cleared += 1;
    }
    // SAFETY: as above.
    if cleared > 0 && unsafe { read_volatile(&raw const (*next).claim) } != SLOT_EMPTY {
        put_back_removed(table, mask, at, cleared);
    }
}

/// [`clear_run`] in the IPv4 table, a global function: inlined into the
/// sweeper's loop over a batch of removals, its two loops took the
/// sweeper's verification past the kernel's million instructions.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_clear_removed(at: u32) -> u32 {
    clear_run(&FLOW_SLOTS, flow_mask(), at);
    0
}

/// [`lb_clear_removed`] in the IPv6 table.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_clear_removed6(at: u32) -> u32 {
    clear_run(&FLOW_SLOTS6, flow_mask6(), at);
    0
}

// The datapath's entry points are global BPF functions (`extern "C"`,
// exported): the verifier checks each of them once, on its own, instead
// of once per path that calls it. Inlined or as static subprograms, the
// probe loops were walked again on every path through the program, and
// the balancer no longer verified within the kernel's million
// instructions. A global function may return only a scalar: lookups
// return the slot's index (`NO_SLOT`: none), and the caller takes the
// value from the array (an inlined bounds check).

/// A slot index that is none: past the end of any table (at most 2^30
/// slots).
pub(crate) const NO_SLOT: u32 = u32::MAX;
/// In a lookup's answer: a miss, and the index (in the low 30 bits) is
/// the free slot an insert of the key takes. Past the end of any table
/// too, so `slot_at` answers None for it.
pub(crate) const MISS: u32 = 1 << 31;
/// With [`MISS`]: that slot holds a removed entry (else it is empty).
const MISS_TOMB: u32 = 1 << 30;
/// The index bits of a lookup's answer.
const HINT_AT: u32 = MISS_TOMB - 1;

/// Whether a lookup's answer is its key's entry (neither a miss nor
/// `NO_SLOT`).
#[inline(always)]
pub(crate) fn found(at: u32) -> bool {
    at < MISS
}

/// The IPv4 flow entry of `key`, for the rarer paths: the slot's two
/// lookups are made in a call of their own ([`flow_in`]).
#[inline(always)]
pub(crate) fn flow(key: &FlowKey) -> Option<*mut Flow> {
    let p = flow_in(lb_flow_slot(key));
    if p.is_null() { None } else { Some(p) }
}

/// [`flow`] for the path every reply of a one-entry flow takes: the
/// slot's lookups inlined ([`flow_at`]).
#[inline(always)]
pub(crate) fn flow_inlined(key: &FlowKey) -> Option<*mut Flow> {
    flow_at(lb_flow_slot(key))
}

/// The IPv4 flow entry in slot `at`, a lookup's answer ([`lb_flow_slot`]):
/// None for a miss (its answer is past the table's end). The two lookups
/// (the array, the element) are inlined: on this project's machines (AMD,
/// with the SRSO mitigation "Safe RET") a BPF-to-BPF call costs about
/// 7 ns, its return going through the kernel's return thunk (three
/// calls of a one-line function added 20-21 ns to the XDP_PASS floor, two
/// runs), and an established flow, which takes this path, cost 80-83 ns
/// with the call and 73-76 ns without (two alternating pairs). Used by a
/// packet's own lookup and by a reply's (`reply_of_flow`) only: see
/// [`flow_in`] for the others.
#[inline(always)]
pub(crate) fn flow_at(at: u32) -> Option<*mut Flow> {
    // SAFETY: only the field's address is taken.
    slot_at(&FLOW_SLOTS, at).map(|s| unsafe { &raw mut (*s).value })
}

/// [`flow_at`]'s lookups in a function of its own (a BPF-to-BPF call, a
/// few instructions) that answers a pointer, null for none, in a
/// register, for every other lookup by key ([`flow`]). Inlined there
/// too, `lb_sweep`, which looks up 64 flows a run, made the verifier walk
/// more than its million instructions (November 2026); the IPv6 program's
/// own copy ([`flow6_in`]) is kept for the reasons given there.
#[inline(never)]
fn flow_in(at: u32) -> *mut Flow {
    // SAFETY: only the field's address is taken.
    slot_at(&FLOW_SLOTS, at).map_or(core::ptr::null_mut(), |s| unsafe { &raw mut (*s).value })
}

/// Insert the IPv4 flow entry of `key` from this CPU's scratch entry
/// (`SCRATCH`, where the caller built it); `hint`: the answer of the
/// lookup of `key` this packet made (or `NO_SLOT`). `how`: a constant,
/// [`PUT_REPLACE`] (in place of any entry `key` has: a reply entry's
/// stale one) or [`PUT_JOIN`] (in place of the entry the lookup found;
/// an entry another CPU put in since the lookup is kept, answered as
/// `Put::Exists` with a copy of it in the scratch entry).
#[inline(always)]
pub(crate) fn put_flow(key: &FlowKey, hint: u32, how: u32) -> Put {
    let Some(value) = SCRATCH.get_ptr_mut(0) else { return Put::Full };
    Put::of(lb_put_flow(key, value, how, hint))
}

/// The IPv6 flow entry of `key`.
#[inline(always)]
pub(crate) fn flow6(key: &FlowKey6) -> Option<*mut Flow6> {
    flow6_at(lb_flow_slot6(key))
}

/// The IPv6 flow entry in slot `at` (as [`flow_at`]).
#[inline(always)]
pub(crate) fn flow6_at(at: u32) -> Option<*mut Flow6> {
    let p = flow6_in(at);
    if p.is_null() { None } else { Some(p) }
}

/// [`flow6_at`]'s lookups, in a call of their own for every lookup,
/// the packet's own too: inlined into the IPv6 program (as [`flow_at`]
/// is into the IPv4 one), they made LLVM spill a register left undefined
/// on one path, which the verifier refuses, and inlined on the packet's
/// lookup only, they grew its frame past the verifier's combined stack
/// limit (528 bytes over 4 calls; November 2026).
#[inline(never)]
fn flow6_in(at: u32) -> *mut Flow6 {
    // SAFETY: only the field's address is taken.
    slot_at(&FLOW_SLOTS6, at).map_or(core::ptr::null_mut(), |s| unsafe { &raw mut (*s).value })
}

/// Insert or replace the IPv6 flow entry of `key` with this CPU's scratch
/// entry (`SCRATCH6`); `hint` and `how` as in [`put_flow`].
#[inline(always)]
pub(crate) fn put_flow6(key: &FlowKey6, hint: u32, how: u32) -> Put {
    let Some(value) = SCRATCH6.get_ptr_mut(0) else { return Put::Full };
    Put::of(lb_put_flow6(key, value, how, hint))
}

/// [`flow`]'s global function: the slot of `key`'s entry, or on a miss
/// the slot an insert would take (see [`find`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_flow_slot(key: *const FlowKey) -> u32 {
    // SAFETY: a global function's pointer argument may be null (the
    // verifier makes it check); otherwise it points at a whole key.
    let Some(key) = (unsafe { key.as_ref() }) else { return NO_SLOT };
    find(&FLOW_SLOTS, flow_mask(), key, false)
}

/// The lookup of a packet's own 5-tuple (`key`), the one every packet
/// makes. A packet from a backend's address ([`PACKET_FROM_BACKEND`] in
/// `flags`) is looked up as a reply entry's key first (marked [`KEY_REPLY`]: its
/// probes start on the destination's side, the client's, beside its
/// flow's forward entry), and, when that misses, unmarked, as the
/// packet's own (the backend a client of a VIP, through the gateway).
/// Answers as [`lb_flow_slot`] for the key left in `key`: marked on a
/// reply entry's match, unmarked otherwise. One global function for
/// both kinds of packet: with the two lookups in the caller, LLVM
/// spilled a register left undefined on one path (which the verifier
/// refuses), and with two call sites the verifier walked the rest of the
/// program once for each. The caller's mark on its stack key made LLVM
/// do the same, hence the flag. A connection's opening to a VIP whose
/// flows take two entries ([`PACKET_OPENING`]) has its second slot loaded
/// too (see [`find`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_packet_flow_slot(key: *mut FlowKey, flags: u32) -> u32 {
    // SAFETY: as in `lb_flow_slot`; the caller's key, written in place.
    let Some(key) = (unsafe { key.as_mut() }) else { return NO_SLOT };
    key.set_reply(flags & PACKET_FROM_BACKEND != 0);
    reply_first(&FLOW_SLOTS, flow_mask(), key, flags & PACKET_OPENING != 0)
}

/// [`lb_packet_flow_slot`]'s flags: the packet comes from a backend's
/// address; ...
pub(crate) const PACKET_FROM_BACKEND: u32 = 1;
/// ... it opens a connection (a TCP SYN) to a VIP whose new flows take
/// two entries: the lookup loads the next slot too (`find`'s `ahead`).
pub(crate) const PACKET_OPENING: u32 = 2;

/// [`lb_packet_flow_slot`] for IPv6, whose key (in a per-CPU scratch
/// slot, not on the stack) comes marked already when the packet is from
/// a backend's address: a flag argument kept alive to the call grew the
/// IPv6 program's frame past the verifier's combined stack limit. No
/// look-ahead for a connection's opening (see [`find`]): with the flag
/// for it, LLVM made two call sites of this function, and the established
/// IPv6 flow measured dearer in 5 of 6 alternating pairs of runs.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_packet_flow_slot6(key: *mut FlowKey6) -> u32 {
    // SAFETY: as in `lb_packet_flow_slot`.
    let Some(key) = (unsafe { key.as_mut() }) else { return NO_SLOT };
    reply_first(&FLOW_SLOTS6, flow_mask6(), key, false)
}

/// `key`'s slot in `table` (as [`find`]), looked up first as marked (a
/// reply entry's) when it comes marked, then, on a miss, unmarked; the
/// key is left as it was found.
#[inline(always)]
fn reply_first<K: SlotKey, V>(table: &impl SlotTable<K, V>, mask: u32, key: &mut K, opening: bool) -> u32 {
    if key.is_reply() {
        let at = find(table, mask, key, false);
        if at < MISS {
            return at;
        }
        key.set_reply(false);
    }
    find(table, mask, key, opening)
}

/// Remove `key`'s entry, which this program invocation has just inserted:
/// a new flow's reply entry whose forward entry then found no room (the
/// entry limit reached by the reply entry itself, its probe sequence
/// full, or a lost race). Left in place, no sweep would ever remove it
/// (the sweeper removes a reply entry with its forward entry) and its
/// room would stay taken. Answers 1 when it was removed.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_take_back(key: *const FlowKey) -> u32 {
    // SAFETY: as in `lb_flow_slot`.
    let Some(key) = (unsafe { key.as_ref() }) else { return 0 };
    take_back(&FLOW_SLOTS, flow_mask(), Count::V4Shared, key)
}

/// [`lb_take_back`] for IPv6.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_take_back6(key: *const FlowKey6) -> u32 {
    // SAFETY: as in `lb_flow_slot`.
    let Some(key) = (unsafe { key.as_ref() }) else { return 0 };
    take_back(&FLOW_SLOTS6, flow_mask6(), Count::V6Shared, key)
}

/// [`lb_take_back`]'s work for either table.
#[inline(always)]
fn take_back<K: SlotKey, V>(table: &impl SlotTable<K, V>, mask: u32, count: Count, key: &K) -> u32 {
    let at = find(table, mask, key, false);
    if at >= MISS {
        return 0;
    }
    u32::from(remove_if(table, mask, count, at, key, |_, _| true, |_| {}))
}

/// [`flow6`]'s global function.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_flow_slot6(key: *const FlowKey6) -> u32 {
    // SAFETY: as in `lb_flow_slot`.
    let Some(key) = (unsafe { key.as_ref() }) else { return NO_SLOT };
    find(&FLOW_SLOTS6, flow_mask6(), key, false)
}

/// [`put_flow`]'s global function: `value` inserted as `key`'s entry,
/// or, with `replace` ([`PUT_REPLACE`]) set, put in place of the one
/// `key` has (with [`PUT_JOIN`] instead: see there; `value` is then
/// written too, the caller's scratch entry); with [`PUT_SWEPT`] set too,
/// for the sweeper (its room taken from the shared count only: see
/// `Count`). `hint`: a lookup's answer for `key` (`NO_SLOT`: none).
/// Answers what `put` did as a number (`Put as u32`).
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_put_flow(key: *const FlowKey, value: *const Flow, replace: u32, hint: u32) -> u32 {
    // SAFETY: as in `lb_flow_slot`.
    let Some(key) = (unsafe { key.as_ref() }) else { return Put::Full as u32 };
    if value.is_null() {
        return Put::Full as u32;
    }
    let count = if replace & PUT_SWEPT != 0 { Count::V4Shared } else { Count::V4 };
    let join = replace & PUT_JOIN != 0;
    let done = put(&FLOW_SLOTS, flow_mask, count, key, || Some(value), replaces(replace, hint), join, hint);
    if done == Put::Exists && join {
        return copy_entry(&FLOW_SLOTS, flow_mask(), key, value.cast_mut()) as u32;
    }
    done as u32
}

/// [`put_flow6`]'s global function (as `lb_put_flow`).
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn lb_put_flow6(key: *const FlowKey6, value: *const Flow6, replace: u32, hint: u32) -> u32 {
    // SAFETY: as in `lb_flow_slot`.
    let Some(key) = (unsafe { key.as_ref() }) else { return Put::Full as u32 };
    if value.is_null() {
        return Put::Full as u32;
    }
    let count = if replace & PUT_SWEPT != 0 { Count::V6Shared } else { Count::V6 };
    let join = replace & PUT_JOIN != 0;
    let done = put(&FLOW_SLOTS6, flow_mask6, count, key, || Some(value), replaces(replace, hint), join, hint);
    if done == Put::Exists && join {
        return copy_entry(&FLOW_SLOTS6, flow_mask6(), key, value.cast_mut()) as u32;
    }
    done as u32
}

/// Whether an insert with `replace` (its flags) replaces the entry its
/// key has: with [`PUT_JOIN`], only the one its lookup found (`hint`).
/// Decided here rather than by the caller: a flag computed in the
/// balancer's main frame grew it past the verifier's stack limit.
#[inline(always)]
fn replaces(replace: u32, hint: u32) -> bool {
    replace & PUT_REPLACE != 0 || (replace & PUT_JOIN != 0 && found(hint))
}

/// After a `Put::Exists` asked with [`PUT_JOIN`]: `key`'s entry copied
/// into `value` (the caller's scratch entry), answered `Put::Exists`; or
/// `Put::Full` when it is gone again, or was replaced while it was
/// copied (its claim read before and after the copy differ).
#[inline(always)]
fn copy_entry<K: SlotKey, V>(table: &impl SlotTable<K, V>, mask: u32, key: &K, value: *mut V) -> Put {
    let at = find(table, mask, key, false);
    if !found(at) {
        return Put::Full;
    }
    let Some(slot) = slot_at(table, at) else { return Put::Full };
    // SAFETY: a valid map value and the caller's scratch entry; the claim
    // read as in `find`, the value's words as in `copy_words`.
    unsafe {
        let before = read_volatile(&raw const (*slot).claim);
        copy_words::<_, u64>(value, &raw const (*slot).value);
        if read_volatile(&raw const (*slot).claim) != before || before & SLOT_STATE != SLOT_READY {
            return Put::Full;
        }
    }
    Put::Exists
}

/// [`lb_put_flow`]'s `replace` flags: the entry `key` has is replaced ...
pub(crate) const PUT_REPLACE: u32 = 1;
/// ... and the insert is the sweeper's; ...
pub(crate) const PUT_SWEPT: u32 = 2;
/// ... or the entry `key` has is replaced only when it is the one the
/// caller's lookup found (`hint`); any other, which another CPU put in
/// since that lookup, is kept and copied into `value` (`Put::Exists`):
/// the same flow's packet on two CPUs at once joins that CPU's entry
/// (`insert_flow` in main.rs).
pub(crate) const PUT_JOIN: u32 = 4;

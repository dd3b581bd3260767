//! Programs for `lb-bench packet` (per-packet cost through BPF_PROG_TEST_RUN).
//!
//! - `floor_pass`: returns XDP_PASS, nothing else. The cheapest XDP program:
//!   what BPF_PROG_TEST_RUN's own loop costs per repeat.
//! - `floor_tx`: swaps the Ethernet addresses and returns XDP_TX, the
//!   smallest program that touches the packet (the floor a balancer is
//!   compared against).
//! - `bench_harness`: makes every repeat of a BPF_PROG_TEST_RUN see the
//!   original frame. The kernel runs all repeats on one buffer without
//!   restoring it, so from the second repeat on a rewriting program would
//!   see its own output (a packet for a backend, not for the VIP) and take
//!   the cheap pass path. The harness copies the frame back from `FRAME`
//!   (`CONFIG.len` bytes, which must be the packet's length; see
//!   [`restore`]), optionally
//!   gives it a source address and port never used before (a new flow per
//!   repeat, see [`vary_source`]), then tail-calls the program in slot 0 of
//!   `PROG_ARRAY`. A failed tail call returns XDP_ABORTED. Its own cost is
//!   measured by putting `floor_pass` in the slot. Before the tail call it
//!   drains the CPU's store buffer (see [`settle`]).
//! - `floor_table`: the flow table's own cost, nothing of the balancer's:
//!   looks the packet's 5-tuple up in `FLOW_TABLE` (a hash with the key,
//!   value and size of the datapath's flow table up to layout 2) and, when it is missing,
//!   inserts it; returns XDP_PASS. Through the harness with a fresh source
//!   per repeat it times what every new flow pays the kernel's table (a
//!   miss and an insert); with the same packet, a hit.
//! - `floor_lru`: the same on an LRU hash of the same size (`FLOW_LRU`),
//!   the kind of table Katran keeps its flows in (one per CPU there; this
//!   program runs on one CPU).
//! - `floor_open`: the same on a table of our own that the datapath does
//!   not use (yet): open addressing in a plain array (`FLOW_OPEN`, one
//!   80-byte slot per flow: a claim word, the key, the datapath's `Flow`),
//!   with a hash computed here, a bounded linear probe, and a new slot
//!   claimed with compare-and-swap; emptied by a new epoch (a slot of an
//!   older one is free). It measures what the kernel's hash
//!   maps cost beyond the memory a flow must touch: their lookup is a
//!   helper call (jhash, a bucket list) and their insert pops an element
//!   from a free list, links it into a bucket and takes the bucket's lock,
//!   touching three or more cache lines where this touches two.
//! - `floor_split`: `floor_open`'s table with its slots in arrays of 256
//!   (`FLOW_SPLIT`, an array of maps whose inner arrays lb-bench makes).
//!   The kernel allocates a BPF array of up to 32 KB with kmalloc, in its
//!   linear map, which it maps with huge pages (1 GB or 2 MB), and a larger
//!   one with vmalloc, in 4 KB pages: a random slot of a table of hundreds
//!   of megabytes in one array costs a page walk (two in a VM) besides the
//!   cache miss. This measures what the datapath's table would save in
//!   such arrays, at the cost of one more lookup (the outer array).
#![no_std]
#![no_main]
// The store-buffer drain is an atomic add: core's atomic types have no RMW
// methods on the BPF target, the intrinsic lowers to a BPF atomic.
#![feature(core_intrinsics)]
#![expect(internal_features, reason = "core_intrinsics gives the atomic add the BPF target needs")]
#![expect(unused_crate_dependencies, reason = "used by the balancer program")]

use core::{
    ffi::c_void,
    intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xadd},
};

use lb_ebpf::csum;

use aya_ebpf::{
    bindings::xdp_action,
    btf_maps::{self, ArrayOfMaps},
    helpers::generated::bpf_xdp_store_bytes,
    macros::{btf_map, map, xdp},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, ProgramArray},
    programs::XdpContext,
};
use lb_common::{DIR_FLOW, Flow, FlowKey};

/// Largest frame the harness restores.
const FRAME_MAX: usize = 128;
const FRAME_WORDS: usize = FRAME_MAX / 8;

/// [`HarnessConfig::mode`]: restore the frame only (the same packet every repeat).
const MODE_RESTORE: u32 = 0;
/// Restore, then a fresh source address and port: a new TCP flow per repeat.
const MODE_NEW_TCP: u32 = 1;
/// The same for UDP.
const MODE_NEW_UDP: u32 = 2;
/// The same for IPv6 TCP.
const MODE_NEW_TCP6: u32 = 3;

/// Byte offsets in an Ethernet + IPv4 (no options) frame.
const IP_CHECK: usize = 14 + 10;
const IP_PROTO: usize = 14 + 9;
const IP_SADDR: usize = 14 + 12;
const L4: usize = 14 + 20;
const TCP_CHECK: usize = L4 + 16;
const UDP_CHECK: usize = L4 + 6;
/// Byte offsets in an Ethernet + IPv6 (no extension headers) frame: the
/// source address's last word, the TCP header and its checksum.
const IP6_SADDR_LAST: usize = 14 + 8 + 12;
const L4_6: usize = 14 + 40;
const TCP6_CHECK: usize = L4_6 + 16;

/// Written by userspace (lb-bench has the same layout).
#[repr(C)]
pub struct HarnessConfig {
    /// Frame length in bytes, 1..=128; the packet must be exactly this long.
    pub len: u32,
    /// One of the `MODE_*` values.
    pub mode: u32,
}

/// The original frame, as 8-byte words (aligned loads from the map value).
#[map]
static FRAME: Array<[u64; FRAME_WORDS]> = Array::with_max_entries(1, 0);

#[map]
static CONFIG: Array<HarnessConfig> = Array::with_max_entries(1, 0);

/// Per-CPU count of new flows made by the harness: the source of fresh
/// (address, port) pairs. Never reset, so tuples are not reused across runs.
#[map]
static COUNTER: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The target of [`settle`]'s atomic add; its value means nothing.
#[map]
static SETTLE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Slot 0: the program under test.
#[map]
static PROG_ARRAY: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// `floor_table`'s table: the flow table's key and value, sized by
/// lb-bench like the datapath's flow table (preallocated, no flags; the
/// datapath kept its flows in such a map up to layout 2).
#[map]
static FLOW_TABLE: HashMap<FlowKey, Flow> = HashMap::with_max_entries(1, 0);

/// `floor_lru`'s table: `FLOW_TABLE` as an LRU hash (sized by lb-bench).
#[map]
static FLOW_LRU: LruHashMap<FlowKey, Flow> = LruHashMap::with_max_entries(1, 0);

/// One slot of `floor_open`'s table.
#[repr(C)]
pub struct OpenSlot {
    /// Free when 0 or of an older epoch; `BUSY | epoch | tag` while the
    /// CPU that claimed it writes the entry, `READY | epoch | tag` once
    /// the entry is whole (bits 0-1 the state, 2-17 the epoch, the rest
    /// the key's hash). Claimed with compare-and-swap.
    claim: u64,
    key: FlowKey,
    flow: Flow,
}

const BUSY: u64 = 1;
const READY: u64 = 2;
/// The epoch's bits in a claim word.
const EPOCH_SHIFT: u32 = 2;
const EPOCH_BITS: u64 = 0xffff << EPOCH_SHIFT;
/// The key hash's bits in a claim word.
const TAG_BITS: u64 = !0 << 18;
/// Slots probed before a table is taken for full: bounds the loop. With
/// 8, a quarter-full table (1M flows and a run of 1M new ones in 8M
/// slots) found no free slot for about 1 insert in 10,000 (linear
/// probing's clusters); 32 leaves that far below one in a run.
const PROBES: u32 = 32;

/// `floor_open`'s table: sized by lb-bench to a power of two (twice the
/// datapath's flow-table size). Not `BPF_F_MMAPABLE`: such an array, which
/// userspace could clear with one memset, cost a new entry 845 ns against
/// 349 ns for a plain one in one run here.
#[map]
static FLOW_OPEN: Array<OpenSlot> = Array::with_max_entries(1, 0);

/// `FLOW_OPEN`'s slot mask (its size - 1) and current epoch (1-65535),
/// written by lb-bench.
#[map]
static OPEN_CONF: Array<[u32; 2]> = Array::with_max_entries(1, 0);

/// Slots in each of `FLOW_SPLIT`'s arrays: 256 of 80 bytes, with the
/// array's header well under the 32 KB up to which the kernel allocates a
/// BPF array with kmalloc (so in its linear map, in huge pages) instead of
/// vmalloc (4 KB pages).
const SPLIT_SLOTS: usize = 256;
/// log2 of [`SPLIT_SLOTS`] (a power of two: a slot's array and place in it
/// are a shift and a mask).
const SPLIT_SHIFT: u32 = SPLIT_SLOTS.trailing_zeros();
const _: () = assert!(SPLIT_SLOTS.is_power_of_two() && SPLIT_SLOTS * size_of::<OpenSlot>() <= 32 * 1024 - 1024);

/// `floor_split`'s table: `FLOW_OPEN`'s slots, `SPLIT_SLOTS` to an inner
/// array, the inner arrays made by lb-bench (as many as the slots need:
/// the outer array's size is set at load).
#[btf_map]
static FLOW_SPLIT: ArrayOfMaps<btf_maps::Array<OpenSlot, SPLIT_SLOTS>, 1> = ArrayOfMaps::new();

/// `FLOW_SPLIT`'s slot mask and epoch, as `OPEN_CONF`.
#[map]
static SPLIT_CONF: Array<[u32; 2]> = Array::with_max_entries(1, 0);

/// Per-CPU count of `floor_table`'s and `floor_lru`'s inserts (lb-bench checks that a run
/// inserted once per repeat, or never).
#[map]
static INSERTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[xdp]
pub(crate) fn floor_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[xdp]
pub(crate) fn floor_tx(ctx: XdpContext) -> u32 {
    let data = ctx.data();
    if data + 12 > ctx.data_end() {
        return xdp_action::XDP_ABORTED;
    }
    // SAFETY: the 12 address bytes were bounds-checked above.
    unsafe {
        let dst_hi = (data as *mut u32).read();
        let dst_lo = ((data + 4) as *mut u16).read();
        let src_hi = ((data + 6) as *mut u32).read();
        let src_lo = ((data + 10) as *mut u16).read();
        (data as *mut u32).write(src_hi);
        ((data + 4) as *mut u16).write(src_lo);
        ((data + 6) as *mut u32).write(dst_hi);
        ((data + 10) as *mut u16).write(dst_lo);
    }
    xdp_action::XDP_TX
}

#[xdp]
pub(crate) fn floor_table(ctx: XdpContext) -> u32 {
    table_alone(&ctx, &FLOW_TABLE)
}

#[xdp]
pub(crate) fn floor_lru(ctx: XdpContext) -> u32 {
    table_alone(&ctx, &FLOW_LRU)
}

#[xdp]
pub(crate) fn floor_open(ctx: XdpContext) -> u32 {
    table_alone(&ctx, &OpenTable::<Flat>(core::marker::PhantomData))
}

#[xdp]
pub(crate) fn floor_split(ctx: XdpContext) -> u32 {
    table_alone(&ctx, &OpenTable::<Split>(core::marker::PhantomData))
}

/// What a table of flows costs alone: the 5-tuple read, a lookup, and an
/// insert when it is missing (counted in `INSERTS`). `T`: a hash map type
/// of aya-ebpf (the plain one, or the LRU one).
#[inline(always)]
fn table_alone<T: FlowTable>(ctx: &XdpContext, table: &T) -> u32 {
    let data = ctx.data();
    if data + L4 + 4 > ctx.data_end() {
        return xdp_action::XDP_ABORTED;
    }
    // SAFETY: every field read lies before L4 + 4, bounds-checked above
    // (IPv4 without options, as lb-bench builds its frames). The key is
    // made as the datapath makes its own (`FlowKey::new`, two words): a
    // struct literal's zero padding compiles to a call of `memset`, a byte
    // loop, which the datapath no longer pays and the table alone must not
    // either.
    let key = unsafe {
        FlowKey::new(
            ((data + IP_SADDR) as *const u32).read_unaligned(),
            ((data + IP_SADDR + 4) as *const u32).read_unaligned(),
            ((data + L4) as *const u16).read_unaligned(),
            ((data + L4 + 2) as *const u16).read_unaligned(),
            ((data + IP_PROTO) as *const u8).read(),
        )
    };
    if table.has(&key) {
        return xdp_action::XDP_PASS;
    }
    let mut flow = core::mem::MaybeUninit::<Flow>::uninit();
    new_entry(flow.as_mut_ptr(), &key);
    // SAFETY: `new_entry` wrote every byte.
    if !table.put(&key, unsafe { flow.assume_init_ref() }) {
        return xdp_action::XDP_ABORTED;
    }
    if let Some(n) = INSERTS.get_ptr_mut(0) {
        // SAFETY: this CPU's slot, which only this program writes while it runs.
        unsafe { *n += 1 };
    }
    xdp_action::XDP_PASS
}

/// A new flow's entry, written in place at `flow`: zeroed word by word
/// as the datapath zeroes its own (`insert_flow`), where a literal's MAC
/// arrays compile to a `memset` call (and so does a copy of the zeroed
/// value: it is written where it is used).
#[inline(always)]
fn new_entry(flow: *mut Flow, key: &FlowKey) {
    const { assert!(size_of::<Flow>().is_multiple_of(8) && align_of::<Flow>() >= 8) };
    let words = flow.cast::<u64>();
    // SAFETY: the caller's stack value, 8-aligned; the words lie within it.
    unsafe {
        for i in 0..size_of::<Flow>() / 8 {
            words.add(i).write_volatile(0);
        }
        (*flow).backend_id = 1;
        (*flow).nat_addr = key.dst_addr;
        (*flow).nat_port = key.dst_port;
        (*flow).dir = DIR_FLOW;
    }
}

/// The two kinds of hash map `table_alone` times.
trait FlowTable {
    fn has(&self, key: &FlowKey) -> bool;
    fn put(&self, key: &FlowKey, flow: &Flow) -> bool;
}

/// Both map types have the same methods, but no trait of aya-ebpf's names them.
macro_rules! flow_table {
    ($($map:ty),*) => {$(
        impl FlowTable for $map {
            #[inline(always)]
            fn has(&self, key: &FlowKey) -> bool {
                self.get_ptr(key).is_some()
            }
            #[inline(always)]
            fn put(&self, key: &FlowKey, flow: &Flow) -> bool {
                self.insert(key, flow, 0).is_ok()
            }
        }
    )*};
}
flow_table!(HashMap<FlowKey, Flow>, LruHashMap<FlowKey, Flow>);

/// Where an open-addressing table keeps its slots.
trait Slots {
    /// Slot `i` (masked by the caller).
    fn slot(i: u32) -> Option<*mut OpenSlot>;
    /// The slot mask and the epoch.
    fn conf() -> Option<[u32; 2]>;
}

/// One array (`FLOW_OPEN`).
struct Flat;

impl Slots for Flat {
    #[inline(always)]
    fn slot(i: u32) -> Option<*mut OpenSlot> {
        FLOW_OPEN.get_ptr_mut(i)
    }
    #[inline(always)]
    fn conf() -> Option<[u32; 2]> {
        OPEN_CONF.get(0).copied()
    }
}

/// Arrays of `SPLIT_SLOTS` slots each (`FLOW_SPLIT`).
struct Split;

impl Slots for Split {
    #[inline(always)]
    fn slot(i: u32) -> Option<*mut OpenSlot> {
        FLOW_SPLIT.get_value_ptr_mut(i >> SPLIT_SHIFT, &(i & (SPLIT_SLOTS as u32 - 1)))
    }
    #[inline(always)]
    fn conf() -> Option<[u32; 2]> {
        SPLIT_CONF.get(0).copied()
    }
}

/// An open-addressing flow table whose slots `S` keeps.
struct OpenTable<S>(core::marker::PhantomData<S>);

/// What a probe of `FLOW_OPEN` found.
enum Probe {
    Found,
    /// The first free slot on the key's probe sequence, and its claim word.
    Free(*mut OpenSlot, u64),
    /// None free within `PROBES` slots (or the mask is missing).
    Full,
}

impl<S: Slots> OpenTable<S> {
    /// A 64-bit mix of the key's two words (multiply, xor-shift). A real
    /// table would mix in a secret seed, so that clients cannot aim their
    /// 5-tuples at one probe sequence.
    #[inline(always)]
    fn hash(key: &FlowKey) -> u64 {
        let (a, b) = Self::words(key);
        let mut h = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        h ^= h >> 29;
        h = h.wrapping_mul(0x1656_67b1_9e37_79f9);
        h ^ (h >> 32)
    }

    /// The key as two 8-byte words (compared and hashed so).
    #[inline(always)]
    fn words(key: *const FlowKey) -> (u64, u64) {
        // SAFETY: FlowKey is 16 bytes of plain integers (padding explicit),
        // 4-byte aligned: read as two unaligned u64 words.
        unsafe {
            let p = key.cast::<u64>();
            (p.read_unaligned(), p.add(1).read_unaligned())
        }
    }

    /// The claim tag of `key` in the current epoch (state bits clear) and
    /// the slot mask.
    #[inline(always)]
    fn tag(key: &FlowKey) -> Option<(u64, u32)> {
        let [mask, epoch] = S::conf()?;
        Some(((Self::hash(key) & TAG_BITS) | (u64::from(epoch) << EPOCH_SHIFT & EPOCH_BITS), mask))
    }

    #[inline(always)]
    fn probe(key: &FlowKey, tag: u64, mask: u32) -> Probe {
        let start = (tag >> 32) as u32;
        // Verifier: a bounded loop (PROBES slots).
        for j in 0..PROBES {
            let Some(slot) = S::slot(start.wrapping_add(j) & mask) else { return Probe::Full };
            // SAFETY: a valid map value; the claim word is read once
            // (volatile: other CPUs change it), the key only when the
            // claim says the entry is whole.
            unsafe {
                let claim = core::ptr::read_volatile(&raw const (*slot).claim);
                if claim & EPOCH_BITS != tag & EPOCH_BITS {
                    return Probe::Free(slot, claim);
                }
                if claim == READY | tag && Self::words(&raw const (*slot).key) == Self::words(key) {
                    return Probe::Found;
                }
            }
        }
        Probe::Full
    }
}

impl<S: Slots> FlowTable for OpenTable<S> {
    #[inline(always)]
    fn has(&self, key: &FlowKey) -> bool {
        Self::tag(key).is_some_and(|(tag, mask)| matches!(Self::probe(key, tag, mask), Probe::Found))
    }

    #[inline(always)]
    fn put(&self, key: &FlowKey, flow: &Flow) -> bool {
        let Some((tag, mask)) = Self::tag(key) else { return false };
        let Probe::Free(slot, old) = Self::probe(key, tag, mask) else { return false };
        // SAFETY: a valid map value. The compare-and-swap makes this CPU
        // the slot's only writer; readers skip it until READY is stored,
        // after the entry (a BPF atomic is a full barrier).
        unsafe {
            let (_, won) = atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                &raw mut (*slot).claim,
                old,
                BUSY | tag,
            );
            if !won {
                return false;
            }
            (*slot).key = *key;
            (*slot).flow = *flow;
            atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(&raw mut (*slot).claim, READY - BUSY);
        }
        true
    }
}

#[xdp]
pub(crate) fn bench_harness(ctx: XdpContext) -> u32 {
    let (Some(cfg), Some(frame)) = (CONFIG.get(0), FRAME.get(0)) else {
        return xdp_action::XDP_ABORTED;
    };
    if !restore(&ctx, frame, cfg.len as usize) {
        return xdp_action::XDP_ABORTED;
    }
    let varied = match cfg.mode {
        MODE_RESTORE => true,
        MODE_NEW_TCP => vary_source::<IP_SADDR, L4, TCP_CHECK, false>(&ctx, false),
        MODE_NEW_UDP => vary_source::<IP_SADDR, L4, UDP_CHECK, false>(&ctx, true),
        MODE_NEW_TCP6 => vary_source::<IP6_SADDR_LAST, L4_6, TCP6_CHECK, true>(&ctx, false),
        _ => false,
    };
    if !varied {
        return xdp_action::XDP_ABORTED;
    }
    settle();
    // SAFETY: plain helper call; on success it does not return.
    unsafe { PROG_ARRAY.tail_call(&ctx, 0) };
    xdp_action::XDP_ABORTED
}

/// Copy the original frame over the packet. A frame of whole 8-byte words
/// (lb-bench pads its frames so) is copied with word stores; any other
/// length goes through the bpf_xdp_store_bytes helper (slower). False when
/// the packet is not `len` bytes long.
#[inline(always)]
fn restore(ctx: &XdpContext, frame: &[u64; FRAME_WORDS], len: usize) -> bool {
    let data = ctx.data();
    let end = ctx.data_end();
    if len == 0 || len > FRAME_MAX || end - data != len {
        return false;
    }
    if !len.is_multiple_of(8) {
        // SAFETY: helper call; `frame` is a map value of FRAME_MAX >= len bytes.
        let rc = unsafe { bpf_xdp_store_bytes(ctx.ctx, 0, frame.as_ptr().cast_mut().cast::<c_void>(), len as u32) };
        return rc == 0;
    }
    // Every store is checked against data_end itself: that is what lets the
    // verifier accept it (it does not relate `len` to the packet).
    let mut i = 0;
    while i < FRAME_WORDS {
        let off = i * 8;
        if data + off + 8 > end {
            break;
        }
        // SAFETY: bounds-checked above; i < FRAME_WORDS.
        unsafe { ((data + off) as *mut u64).write(frame[i]) };
        i += 1;
    }
    true
}

/// Let the restored frame's stores reach the cache before the program
/// under test reads the packet. Without this its first loads read bytes
/// still in the store buffer, and every load that spans two of the
/// harness's 8-byte stores (an IPv4 destination address at bytes 30-33,
/// for one) cannot be forwarded and stalls until they commit: a cost of
/// the harness, charged to the program, that the subtraction of the
/// harness's own cost (through `floor_pass`, which reads nothing) does not
/// remove. A non-VIP packet, which a direct run can time exactly, measured
/// 2 ns more through the harness than directly. An atomic add is a locked
/// instruction on x86, which drains the store buffer; it runs in the
/// harness, so its cost is subtracted with the rest.
#[inline(always)]
fn settle() {
    if let Some(v) = SETTLE.get_ptr_mut(0) {
        // SAFETY: a valid, aligned u64 in this CPU's slot.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(v, 1) };
    }
}

/// Give the (restored) packet a source address and port no earlier repeat
/// used: the n-th call (per CPU) adds `n >> 16` to the source address and
/// sets the source port to `n & 0xffff`, so 2^32 repeats per base address
/// stay distinct. The IPv4 header checksum and the TCP/UDP checksum
/// (pseudo-header address and port) are updated incrementally, so the
/// packet stays valid and the output check can verify both from scratch.
/// Assumes IPv4 without options (userspace builds the frames). For IPv6
/// (`V6`, no extension headers) the address's last word is the one that
/// grows, and there is no IP header checksum. `SADDR`, `SPORT` and `CHECK`
/// are the offsets of that address word, the source port and the L4
/// checksum.
#[inline(always)]
fn vary_source<const SADDR: usize, const SPORT: usize, const CHECK: usize, const V6: bool>(
    ctx: &XdpContext,
    udp: bool,
) -> bool {
    let Some(counter) = COUNTER.get_ptr_mut(0) else { return false };
    let data = ctx.data();
    if data + CHECK + 2 > ctx.data_end() {
        return false;
    }
    // SAFETY: per-CPU slot; header fields bounds-checked above (CHECK is the
    // furthest one).
    unsafe {
        let n = *counter;
        *counter = n + 1;
        let saddr = (data + SADDR) as *mut u32;
        let sport = (data + SPORT) as *mut u16;
        let ip_check = (data + IP_CHECK) as *mut u16;
        let l4_check = (data + CHECK) as *mut u16;
        let old_addr = saddr.read();
        let new_addr = u32::from_be(old_addr).wrapping_add((n >> 16) as u32).to_be();
        let old_port = sport.read();
        let new_port = (n as u16).to_be();
        saddr.write(new_addr);
        sport.write(new_port);
        if !V6 {
            ip_check.write(csum::replace4(ip_check.read(), old_addr, new_addr));
        }
        let old = l4_check.read();
        if !(udp && old == 0) {
            let mut new = csum::replace4(old, old_addr, new_addr);
            new = csum::replace2(new, old_port, new_port);
            if udp && new == 0 {
                new = 0xffff;
            }
            l4_check.write(new);
        }
    }
    true
}

// Incremental checksum update (RFC 1624: HC' = ~(~HC + ~m + m')), on the raw
// words as they sit in the packet.

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

//! Every map the datapath reads or writes. Userspace (lb-userspace's
//! `dataplane` module) is the only writer of the configuration maps; the
//! datapath writes the flow table and the counters.
//!
//! Each map is named after its static, and that name must be the one
//! `lb_common::maps` gives userspace: the checks at the end of this file
//! fail the build otherwise.
use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    btf_maps::{self, ArrayOfMaps},
    macros::{btf_map, map},
    maps::{Array, HashMap, PerCpuArray, ProgramArray},
};
use lb_common::{
    AddrFilter, Backend, BackendStats, ClockCache, Conns, EndpointKey, FLOW_ARRAY_ELEMENTS, FLOW_ARRAY_ELEMENTS6,
    Flood, Flow, Flow6, FlowBucket, FlowBucket6, MAX_BACKENDS, MAX_ENDPOINTS, MAX_NETDEVS, MAX_SERVICES, NextHop,
    RateWindow, ReplyHint, Service, Vip6Key, VipKey, counter,
};

/// (VIP, port, protocol) -> service and the location of its live selection table.
#[map]
pub(crate) static VIPS: HashMap<VipKey, Service> = HashMap::with_max_entries(MAX_SERVICES, 0);

/// Addresses that carry at least one VIP (value unused). Read only on the
/// error path, to decide whether an unparseable packet was meant for us.
#[map]
pub(crate) static VIP_ADDRS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_SERVICES, 0);

/// Backend id -> address and port. Id 0 is "no backend".
#[map]
pub(crate) static BACKENDS: Array<Backend> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Selection tables of all services, back to back: each entry is a backend
/// id, four to an element (`lb_common::SelectWord`; read with
/// `select::entry`). Sized by userspace at load time; one service's table
/// is the entries `[table_off, table_off + table_len)` named by its
/// `Service` value. Memory-mappable: userspace writes a whole table with
/// plain stores instead of one syscall per entry.
#[map]
pub(crate) static SELECT: Array<lb_common::SelectWord> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// Per-service position in a sequence table (round robin / WRR), shared by
/// all CPUs and advanced with an atomic add.
#[map]
pub(crate) static SEQ: Array<u64> = Array::with_max_entries(MAX_SERVICES, 0);

/// Connection table: wire 5-tuple -> what to rewrite, in slots of our own
/// (`crate::table`; open addressing, two slots per `conntrack_max`, a
/// power of two; `SLOT_BUCKET` slots per array element, the elements in
/// arrays of `FLOW_ARRAY_ELEMENTS` that lbd makes and puts here: see
/// `lb_common::FLOW_ARRAY_ELEMENTS` for why). One entry per flow, keyed by the client's 5-tuple
/// (`DIR_FLOW`; see `lb_common::Flow` for the services that keep a reply
/// entry too). Sized by userspace at load time.
///
/// Not a kernel map of flows, which costs more per packet (see
/// `crate::table`), and not an LRU: when a flow's slots are all taken an
/// insert fails and the new flow is routed by consistent hash without an
/// entry (`counter::TABLE_FULL`), so a flood can never evict an
/// established flow; entries leave only through the sweeper (closed,
/// idle, or half-open for `flood.half_open_timeout`). Per-CPU tables
/// (Katran's array of maps) would lose a flow whose packets arrive on two
/// CPUs, which a veth's senders and RSS-less NICs do.
#[btf_map]
pub(crate) static FLOW_SLOTS: FlowTable<FlowBucket, { FLOW_ARRAY_ELEMENTS as usize }> = ArrayOfMaps::new();

/// A flow table: an array of maps (its size in arrays set by lbd at load)
/// of arrays of `N` elements.
pub(crate) type FlowTable<B, const N: usize> = ArrayOfMaps<btf_maps::Array<B, N>, 1>;

/// Entries in each flow table (0: `FLOW_SLOTS`, 1: `FLOW_SLOTS6`), for
/// `conntrack_max`: added to by the datapath's inserts and taken from by
/// the sweeper's removals, atomically (one count for all CPUs, so that
/// the limit is exact).
#[map]
pub(crate) static FLOW_COUNT: Array<u64> = Array::with_max_entries(2, 0);

/// Room for entries (0: IPv4, 1: IPv6) this CPU took from `FLOW_COUNT`
/// and has not used yet (`lb_common::flow_credit_batch`): counted there as
/// taken, so that the limit still holds. Only an XDP run on a packet
/// uses it (`table::Count::take`): the sweeper, run by lbd through
/// BPF_PROG_TEST_RUN, may be interrupted by a packet on its CPU between
/// two instructions, so its inserts and removals go to `FLOW_COUNT` itself.
#[map]
pub(crate) static FLOW_CREDIT: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// Entries the IPv4 flow table may hold (`conntrack_max`), set by lbd when
/// it loads the program (read-only data, as the masks).
#[unsafe(no_mangle)]
static FLOW_LIMIT: u32 = 0;

/// Entries the IPv6 flow table may hold (`conntrack_max_ipv6`), as
/// `FLOW_LIMIT`.
#[unsafe(no_mangle)]
static FLOW_LIMIT6: u32 = 0;

/// The entry limit of `FLOW_SLOTS`.
#[inline(always)]
pub(crate) fn flow_limit() -> u32 {
    // SAFETY: as `flow_mask`.
    unsafe { core::ptr::read_volatile(&raw const FLOW_LIMIT) }
}

/// The entry limit of `FLOW_SLOTS6`.
#[inline(always)]
pub(crate) fn flow_limit6() -> u32 {
    // SAFETY: as `flow_mask`.
    unsafe { core::ptr::read_volatile(&raw const FLOW_LIMIT6) }
}

/// The seed of the flow tables' slot hash (`lb_common::SlotKey`), set by
/// lbd when it loads the program (read-only data, as the masks): drawn at
/// random for new tables, the pinned `FLOW_SEED` for adopted ones.
#[unsafe(no_mangle)]
static FLOW_HASH_SEED: u64 = 0;

/// The flow tables' hash seed.
#[inline(always)]
pub(crate) fn flow_seed() -> u64 {
    // SAFETY: as `flow_mask`.
    unsafe { core::ptr::read_volatile(&raw const FLOW_HASH_SEED) }
}

/// `FLOW_SLOTS`' size - 1, set by lbd when it loads the program (a
/// constant to the verifier and the JIT: read-only data).
#[unsafe(no_mangle)]
static FLOW_SLOT_MASK: u32 = 0;

/// `FLOW_SLOTS6`' size - 1, as `FLOW_SLOT_MASK`.
#[unsafe(no_mangle)]
static FLOW_SLOT_MASK6: u32 = 0;

/// `FLOW_SLOTS`' slot mask.
#[inline(always)]
pub(crate) fn flow_mask() -> u32 {
    // SAFETY: a read of a global that lbd sets before loading; volatile so
    // that the compiler does not fold the 0 it was built with.
    unsafe { core::ptr::read_volatile(&raw const FLOW_SLOT_MASK) }
}

/// `FLOW_SLOTS6`' slot mask.
#[inline(always)]
pub(crate) fn flow_mask6() -> u32 {
    // SAFETY: as `flow_mask`.
    unsafe { core::ptr::read_volatile(&raw const FLOW_SLOT_MASK6) }
}

/// Bitmap over `addr_filter_bit` of every VIP and backend address, as one
/// value: one inlined array lookup and a word read per address tell a
/// packet that is none of our business.
#[map]
pub(crate) static ADDR_BITMAP: Array<AddrFilter> = Array::with_max_entries(1, 0);

/// The reply-entry hint (`lb_common::ReplyHint`), written by lbd with
/// the services: which IPv4 TCP VIPs (address and port) have new flows
/// that take two entries side by side, so that a SYN's lookup loads the
/// second slot too (`table::find`'s `ahead`).
#[map]
pub(crate) static REPLY_HINT: Array<ReplyHint> = Array::with_max_entries(1, 0);

/// Per-backend counters, per CPU.
#[map]
pub(crate) static BACKEND_STATS: PerCpuArray<BackendStats> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Global counters (drops by reason, fallbacks), per CPU; see `lb_common::counter`.
#[map]
pub(crate) static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Per-backend opened/closed flow counts (global, atomic adds) of the
/// flows without `FLOW_CONNS_CPU`: the least-conn and least-time
/// services' (their schedulers read them on every new flow), and flows
/// made before layout 8. With `CONNS_CPU`, the active-flows figure.
#[map]
pub(crate) static CONNS: Array<Conns> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Per-backend opened/closed flow counts of the flows marked
/// `FLOW_CONNS_CPU`, per CPU: a new flow's opening writes only its own
/// CPU's line. lbd sums them (the active-flows figure, and `CONNS_SUM`).
#[map]
pub(crate) static CONNS_CPU: PerCpuArray<Conns> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// `CONNS_CPU` summed over the CPUs, per backend, written by lbd once a
/// second: what least-conn adds to a candidate's `CONNS` for its flows
/// counted per CPU (a service that became least-conn, or a backend
/// endpoint another service shares), a second late at most.
#[map]
pub(crate) static CONNS_SUM: Array<Conns> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Per-backend count of flows that expired idle, written only by userspace.
#[map]
pub(crate) static EXPIRED: Array<u64> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Network devices of the gateway, by ifindex -> `NETDEV_F_*` flags: the
/// mode the program runs in on each device it is attached to, and which
/// devices can transmit frames redirected from native or generic XDP.
/// Written by lbd at attach and whenever a device changes; read only when
/// a next hop is looked up (not per packet of an established flow).
#[map]
pub(crate) static NETDEVS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_NETDEVS, 0);

/// Generation of NETDEVS, bumped by lbd after every change: next hops
/// cached in flow entries under an older generation are looked up again.
#[map]
pub(crate) static NETDEV_GEN: Array<u32> = Array::with_max_entries(1, 0);

/// Backend (address, port, protocol) -> the VIP key of the service whose
/// replies come from it: a reply's flow entry is the client's 5-tuple
/// towards that VIP. Written by userspace before any flow can reach a new
/// backend; an endpoint shared by two services belongs to the first, and
/// the other keeps reply entries (`SVC_F_REPLY_ENTRY`).
#[map]
pub(crate) static ENDPOINTS: HashMap<EndpointKey, VipKey> = HashMap::with_max_entries(MAX_ENDPOINTS, 0);

/// Next hop towards each backend, by backend id: forward packets, new
/// flows included, look the FIB up once a second per backend instead of
/// once per flow.
#[map]
pub(crate) static NEXT_HOPS: Array<NextHop> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Flood protection settings (one entry), written by lbd.
#[map]
pub(crate) static FLOOD: Array<Flood> = Array::with_max_entries(1, 0);

/// Each CPU's count of new flows given an entry in the current second.
#[map]
pub(crate) static NEW_FLOW_RATE: PerCpuArray<RateWindow> = PerCpuArray::with_max_entries(1, 0);

/// One flow entry per CPU: where a new flow's entry is built before it is
/// inserted (the 512-byte stack has no room for it).
#[map]
pub(crate) static SCRATCH: PerCpuArray<Flow> = PerCpuArray::with_max_entries(1, 0);

/// Each CPU's copy of the idle clock, refreshed once a jiffy (see
/// `lb_common::ClockCache`). A cache only: nothing in it is migrated.
#[map]
pub(crate) static CLOCK: PerCpuArray<ClockCache> = PerCpuArray::with_max_entries(1, 0);

/// The layout version of these maps (`lb_common::LAYOUT_VERSION`), written
/// by lbd when it creates them; never read by the datapath. A restarted or
/// upgraded lbd reads it from the pinned map before it reads anything else.
#[map]
pub(crate) static LAYOUT: Array<u32> = Array::with_max_entries(1, 0);

/// The flow tables' hash seed (`FLOW_HASH_SEED`), written by lbd when it
/// creates the tables, so that the next lbd that adopts them loads its
/// program with the same one, and beside it the tables' sizes in slots
/// (`lb_common::FLOW_SEED_SLOTS`); never read by the datapath.
#[map]
pub(crate) static FLOW_SEED: Array<u64> = Array::with_max_entries(lb_common::FLOW_SEED_SLOTS, 0);

/// IPv6 (VIP, port, protocol) -> service (the `Service` value is the same
/// as IPv4's: the selection tables are shared).
#[map]
pub(crate) static VIPS6: HashMap<Vip6Key, Service> = HashMap::with_max_entries(MAX_SERVICES, 0);

/// IPv6 addresses that carry at least one VIP (value unused).
#[map]
pub(crate) static VIP_ADDRS6: HashMap<[u32; 4], u32> = HashMap::with_max_entries(MAX_SERVICES, 0);

/// IPv6 address of each IPv6 backend (`BACKEND_F_V6`), by backend id.
#[map]
pub(crate) static BACKEND_ADDRS6: Array<[u32; 4]> = Array::with_max_entries(MAX_BACKENDS, 0);

/// IPv6 backend (address, port, protocol) -> the VIP key of the service
/// whose replies come from it (see `ENDPOINTS`).
#[map]
pub(crate) static ENDPOINTS6: HashMap<Vip6Key, Vip6Key> = HashMap::with_max_entries(MAX_ENDPOINTS, 0);

/// IPv6 connection table (see `FLOW_SLOTS`), sized by userspace.
#[btf_map]
pub(crate) static FLOW_SLOTS6: FlowTable<FlowBucket6, { FLOW_ARRAY_ELEMENTS6 as usize }> = ArrayOfMaps::new();

/// One IPv6 flow entry per CPU, where a new flow's entry is built.
#[map]
pub(crate) static SCRATCH6: PerCpuArray<Flow6> = PerCpuArray::with_max_entries(1, 0);

/// The keys of one IPv6 packet's lookups, per CPU (see `v6::Keys6`).
#[map]
pub(crate) static KEYS6: PerCpuArray<crate::v6::Keys6> = PerCpuArray::with_max_entries(1, 0);

/// Programs the balancer tail-calls (`lb_common::TAIL_CALLS`): the IPv6
/// path (`lb_xdp6`) and the ICMP error translators, written by lbd after
/// loading. Programs of their own so that the verifier checks each path
/// once, and TCP/UDP over IPv4 pays for none of them.
#[map]
pub(crate) static PROGS: ProgramArray = ProgramArray::with_max_entries(lb_common::TAIL_CALLS.len() as u32, 0);

/// Tail-call `PROGS[SLOT]` (returns only when the slot is empty).
///
/// Not `ProgramArray::tail_call`: LLVM merges several of its calls into one
/// call instruction with the slot chosen before it, and the verifier then
/// sees a key that is not one constant. The kernel makes a tail call whose
/// key is a constant a direct jump; any other takes the indirect one,
/// which on a kernel with retpolines costs about as much as a branch
/// mispredicted (6-15 ns of an established IPv6 flow's 110-118 ns on an
/// AMD EPYC VM, README's "How a packet goes through").
/// Inline assembly is never merged, so each call site keeps its own
/// constant key, loaded right before the call.
///
/// # Safety
/// `ctx` is the running program's context.
#[inline(always)]
pub(crate) unsafe fn tail_call<const SLOT: u32>(ctx: &impl aya_ebpf::EbpfContext) {
    // SAFETY: helper 12 (bpf_tail_call) with the program's context, a
    // program array and a key; on return it has clobbered r0-r5 only, as
    // every helper call.
    unsafe {
        core::arch::asm!(
            "r3 = {slot}",
            "call 12",
            slot = const SLOT,
            inout("r1") ctx.as_ptr() => _,
            inout("r2") (&raw const PROGS).cast::<u8>() => _,
            out("r0") _,
            out("r3") _,
            out("r4") _,
            out("r5") _,
        );
    }
}

// Every map's name is the one userspace looks up (lb_common::maps).
const _: () = assert!(lb_common::maps::same(lb_common::maps::VIPS, stringify!(VIPS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::VIP_ADDRS, stringify!(VIP_ADDRS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::BACKENDS, stringify!(BACKENDS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::SELECT, stringify!(SELECT)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::SEQ, stringify!(SEQ)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::FLOWS, stringify!(FLOW_SLOTS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::ADDR_FILTER, stringify!(ADDR_BITMAP)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::BACKEND_STATS, stringify!(BACKEND_STATS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::COUNTERS, stringify!(COUNTERS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::CONNS, stringify!(CONNS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::EXPIRED, stringify!(EXPIRED)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::NETDEVS, stringify!(NETDEVS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::NETDEV_GEN, stringify!(NETDEV_GEN)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::ENDPOINTS, stringify!(ENDPOINTS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::NEXT_HOPS, stringify!(NEXT_HOPS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::FLOOD, stringify!(FLOOD)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::NEW_FLOW_RATE, stringify!(NEW_FLOW_RATE)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::LAYOUT, stringify!(LAYOUT)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::SCRATCH, stringify!(SCRATCH)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::VIPS6, stringify!(VIPS6)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::VIP_ADDRS6, stringify!(VIP_ADDRS6)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::BACKEND_ADDRS6, stringify!(BACKEND_ADDRS6)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::ENDPOINTS6, stringify!(ENDPOINTS6)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::FLOWS6, stringify!(FLOW_SLOTS6)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::SCRATCH6, stringify!(SCRATCH6)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::PROGS, stringify!(PROGS)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::KEYS6, stringify!(KEYS6)));
// ... and userspace knows every map.
const _: () = assert!(lb_common::maps::same(lb_common::maps::CLOCK, stringify!(CLOCK)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::FLOW_COUNT, stringify!(FLOW_COUNT)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::FLOW_SEED, stringify!(FLOW_SEED)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::REPLY_HINT, stringify!(REPLY_HINT)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::FLOW_CREDIT, stringify!(FLOW_CREDIT)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::CONNS_CPU, stringify!(CONNS_CPU)));
const _: () = assert!(lb_common::maps::same(lb_common::maps::CONNS_SUM, stringify!(CONNS_SUM)));
const _: () = assert!(lb_common::maps::ALL.len() == 34);

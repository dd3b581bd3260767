//! Types shared by the XDP program (`lb-ebpf`) and userspace (`lb-userspace`).
//!
//! Every key and value that crosses the kernel/user boundary is defined here
//! once. All of them are `#[repr(C)]` with explicit padding and integer flags
//! (no `bool`, enum or `Option`), so that their byte layout is the same on both
//! sides and has no implicit padding. Addresses and ports are stored in
//! network byte order, exactly as they appear in the packet, so the datapath
//! never swaps bytes.
#![no_std]

/// Backend id 0 is reserved as "no backend" (an empty slot of a table).
pub const BACKEND_NONE: u32 = 0;
/// Size of the backend array; ids run from 1 to `MAX_BACKENDS - 1`.
pub const MAX_BACKENDS: u32 = 4096;
/// Number of services (VIP, port, protocol) the datapath can hold.
pub const MAX_SERVICES: u32 = 256;

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// Scheduler ids stored in [`Service::scheduler`].
///
/// Hash a flow's 5-tuple into the service's selection table.
pub const SCHED_FLOW_HASH: u32 = 0;
/// Hash the client address alone into the selection table.
pub const SCHED_SOURCE_HASH: u32 = 1;
/// Walk the selection table in order with one counter per service shared
/// by all CPUs (round robin and smooth weighted round robin).
pub const SCHED_SEQUENCE: u32 = 2;

/// Weighted least connections, by power of two choices: two candidates
/// drawn from the (weighted) selection table, the one with fewer active
/// flows per unit of weight wins.
pub const SCHED_LEAST_CONN: u32 = 3;
/// Least response time: the same two choices, where the weights already
/// carry the response times (userspace divides them). Two candidates of
/// the same weight (same response-time step) are taken as the table drew
/// them: their active-flow counts differ by momentary noise, which would
/// otherwise skew the split between backends that are alike. Candidates of
/// different weights are compared on (active + 1) per unit of weight.
pub const SCHED_LEAST_TIME: u32 = 4;

/// Whether `scheduler` (a `SCHED_*`) reads its candidates' active-flow
/// counts on every new flow (least-conn, least-time). Its flows are
/// counted in the shared `CONNS`, not per CPU ([`FLOW_CONNS_CPU`]), and
/// lbd writes the per-CPU sums of its backends' older flows to
/// `CONNS_SUM` for it to add.
#[inline(always)]
#[must_use]
pub const fn reads_conns(scheduler: u32) -> bool {
    scheduler == SCHED_LEAST_CONN || scheduler == SCHED_LEAST_TIME
}

/// [`Service::flags`]: the service has no backend able to take new flows;
/// new flows are dropped and counted.
pub const SVC_F_NO_BACKEND: u32 = 1;

/// [`Service::flags`]: a backend (address, port) of this service also
/// serves another service, which owns its [`ENDPOINTS`](maps::ENDPOINTS)
/// entry, so replies cannot name this service's VIP from the endpoint
/// alone: new flows get a reply entry besides the forward one (`DIR_FORWARD`
/// + `DIR_REPLY`) instead of one entry (`DIR_FLOW`).
pub const SVC_F_REPLY_ENTRY: u32 = 2;

/// [`Service::flags`]: L2 direct server return (`forwarding: dsr`). Only
/// the destination MAC changes (to the backend's); the backend holds the
/// VIP itself and answers the client directly, so no reply ever comes
/// back through the datapath. Flows get a `DIR_DSR` entry (affinity only).
pub const SVC_F_DSR: u32 = 4;

/// [`Backend::flags`]: health checks took the backend out; flows pinned to
/// it are re-dispatched on their next packet.
pub const BACKEND_F_DOWN: u32 = 1;
/// [`Backend::flags`]: an IPv6 backend. Its address is in
/// `BACKEND_ADDRS6` at the same id; [`Backend::addr`] then holds
/// [`fold6`] of it (never 0, so a used slot is told from an empty one).
pub const BACKEND_F_V6: u32 = 2;

/// The programs the balancer (`lb_xdp`) reaches by tail call, by their
/// slot in its program array (`PROGS`): lbd loads each and writes its fd
/// into its slot before attaching.
pub const TAIL_CALLS: [(u32, &str); 5] =
    [(0, "lb_xdp6"), (1, "lb_icmp"), (2, "lb_icmp6"), (3, "lb_vlan"), (4, "lb_qinq")];
/// The sweeper's program (see [`SweepHeader`]): loaded by lbd beside the
/// balancer, run by it through BPF_PROG_TEST_RUN, never attached.
pub const SWEEP_PROGRAM: &str = "lb_sweep";
/// Slots of [`TAIL_CALLS`].
pub const PROG_V6: u32 = 0;
pub const PROG_ICMP: u32 = 1;
pub const PROG_ICMP6: u32 = 2;
/// IPv4 in one 802.1Q tag, and in two (QinQ: 802.1ad outside, 802.1Q inside).
pub const PROG_VLAN: u32 = 3;
pub const PROG_QINQ: u32 = 4;

/// Bits of a `NETDEVS` value above [`NETDEV_MTU_SHIFT`]: the device's MTU.
pub const NETDEV_MTU_SHIFT: u32 = 16;

/// Most IPv6 extension headers (hop-by-hop, routing, destination options)
/// the datapath walks before the TCP/UDP header; a packet with more is
/// dropped (`counter::IPV6_EXT`) when it is for a VIP.
pub const MAX_IPV6_EXT: u32 = 4;

/// Size of the network-device map (`NETDEVS` in lb-ebpf): devices
/// of the gateway's network namespace lbd describes to the datapath.
pub const MAX_NETDEVS: u32 = 4096;

/// Network-device flags, by ifindex, written by lbd (low 16 bits; the MTU
/// sits above them, see [`NETDEV_MTU_SHIFT`]). The datapath's program
/// runs on this device in generic (skb) mode; without it, native mode is
/// assumed (and a device lbd has not described is treated as native).
pub const NETDEV_F_GENERIC: u32 = 1;
/// Generic-mode XDP may redirect into this device: an Ethernet device that
/// is up (generic redirect hands the skb to the device's transmit).
pub const NETDEV_F_XMIT_GENERIC: u32 = 2;
/// Native-mode XDP may redirect into this device: the kernel reports
/// NDO_XMIT in its XDP features (for a veth: the peer has an XDP program or
/// GRO on). A bridge, for one, never has it.
pub const NETDEV_F_XMIT_NATIVE: u32 = 4;
/// `XDP_TX` out of this device, in the mode the program runs in on it,
/// reaches the other end: generic mode on any device, native mode on any
/// but a veth. A veth's native `XDP_TX` wakes its peer only when the peer
/// runs an XDP program of its own, which lbd cannot see from its network
/// namespace; GRO at the peer, which makes redirects into the veth work,
/// leaves `XDP_TX` frames waiting. A packet whose egress is its ingress
/// goes back out by `XDP_TX` where this is set, by redirect otherwise.
pub const NETDEV_F_TX: u32 = 8;
/// Set in a cached next hop's egress ifindex (`NextHop::ifindex`,
/// `Flow::nh_ifindex`): the egress has [`NETDEV_F_TX`]. Kernel ifindexes
/// are positive `int`s: bit 31 is free.
pub const HOP_TX: u32 = 1 << 31;

/// What the XDP program leaves in a packet's metadata for lbd's tc ingress
/// program (`lb_tc`) on the same device: a GSO packet to a DSR service,
/// its MACs already set for the backend, to be redirected to `ifindex`.
/// Only generic mode sees GSO packets (merged by GRO, or from a local
/// sender behind a veth that left segmentation to offload), and an XDP
/// redirect refuses a frame above the egress MTU; a tc redirect takes the
/// skb as it is, and the egress device splits it. A packet without this
/// metadata is left to the kernel by `lb_tc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcHandoff {
    /// [`TC_HANDOFF_MAGIC`]: metadata of ours, not some other program's.
    pub magic: u32,
    /// The egress device.
    pub ifindex: u32,
}

/// [`TcHandoff::magic`].
pub const TC_HANDOFF_MAGIC: u32 = 0x6c62_7463;

/// [`Flow::dir`]: client -> VIP, rewritten to the backend.
pub const DIR_FORWARD: u8 = 0;
/// [`Flow::dir`]: backend -> client, rewritten back to the VIP.
pub const DIR_REPLY: u8 = 1;
/// [`Flow::dir`]: the one entry of a flow of a DSR service (`SVC_F_DSR`):
/// client -> VIP, sent to the backend's MAC unchanged; no replies pass.
pub const DIR_DSR: u8 = 3;
/// [`Flow::dir`]: the one entry of a flow, keyed by the client's 5-tuple
/// like a forward entry. Replies find it through the backend's endpoint
/// (`ENDPOINTS`: backend address and port -> VIP, from which the client's
/// 5-tuple is rebuilt), so a new flow costs one insert, not two. Its
/// next-hop cache is the reply direction's (forward packets use the
/// backend's, `NEXT_HOPS`).
pub const DIR_FLOW: u8 = 2;
/// [`Flow::dir`]: a [`DIR_FLOW`] entry retired from its backend's tuple.
/// The flow had closed, and a SYN-ACK from its backend endpoint on the
/// same tuple answered another service's new connection (a client reusing
/// its address and port for a service that shares the endpoint): the
/// backend's packets on that tuple are that connection's, no longer this
/// flow's replies. The client's own late packets of it still go to its
/// backend, until the sweeper removes it (as a closed `DIR_FLOW` entry).
pub const DIR_RETIRED: u8 = 4;

/// Indexes into the per-CPU global counter array.
/// The datapath's BPF map names, defined once: `lb-ebpf` declares each map
/// under its name here (checked when it compiles), and userspace finds the
/// maps by these names.
pub mod maps {
    pub const VIPS: &str = "VIPS";
    pub const VIP_ADDRS: &str = "VIP_ADDRS";
    /// The address filter, named for its bit function and its layout: a
    /// build that changes either renames it, so that during an upgrade the
    /// old program goes on reading its own map, with its own bits, until
    /// the new one (whose map is filled before it attaches) replaces it.
    pub const ADDR_FILTER: &str = "ADDR_BITMAP";
    pub const BACKENDS: &str = "BACKENDS";
    pub const SELECT: &str = "SELECT";
    pub const SEQ: &str = "SEQ";
    pub const FLOWS: &str = "FLOW_SLOTS";
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    pub const COUNTERS: &str = "COUNTERS";
    pub const CONNS: &str = "CONNS";
    pub const EXPIRED: &str = "EXPIRED";
    pub const NETDEVS: &str = "NETDEVS";
    pub const NETDEV_GEN: &str = "NETDEV_GEN";
    pub const ENDPOINTS: &str = "ENDPOINTS";
    pub const NEXT_HOPS: &str = "NEXT_HOPS";
    pub const FLOOD: &str = "FLOOD";
    pub const NEW_FLOW_RATE: &str = "NEW_FLOW_RATE";
    pub const LAYOUT: &str = "LAYOUT";
    pub const SCRATCH: &str = "SCRATCH";
    pub const VIPS6: &str = "VIPS6";
    pub const VIP_ADDRS6: &str = "VIP_ADDRS6";
    pub const BACKEND_ADDRS6: &str = "BACKEND_ADDRS6";
    pub const ENDPOINTS6: &str = "ENDPOINTS6";
    pub const FLOWS6: &str = "FLOW_SLOTS6";
    pub const SCRATCH6: &str = "SCRATCH6";
    pub const CLOCK: &str = "CLOCK";
    pub const PROGS: &str = "PROGS";
    pub const KEYS6: &str = "KEYS6";
    pub const FLOW_COUNT: &str = "FLOW_COUNT";
    pub const FLOW_SEED: &str = "FLOW_SEED";
    pub const REPLY_HINT: &str = "REPLY_HINT";
    pub const FLOW_CREDIT: &str = "FLOW_CREDIT";
    pub const CONNS_CPU: &str = "CONNS_CPU";
    pub const CONNS_SUM: &str = "CONNS_SUM";

    /// Maps that older builds pinned and this one has no use for: removed
    /// from the pin path once this build's program is attached: the
    /// address filter under its first bit function (`ADDR_FILTER`), and as
    /// 1,024 one-word entries (`ADDR_BITS`).
    pub const STALE: [&str; 2] = ["ADDR_FILTER", "ADDR_BITS"];

    /// Every map of the datapath; all of them live in bpffs under the pin
    /// path (aya-log's ring buffer and the read-only globals do not).
    pub const ALL: [&str; 34] = [
        VIPS,
        VIP_ADDRS,
        ADDR_FILTER,
        BACKENDS,
        SELECT,
        SEQ,
        FLOWS,
        BACKEND_STATS,
        COUNTERS,
        CONNS,
        EXPIRED,
        NETDEVS,
        NETDEV_GEN,
        ENDPOINTS,
        NEXT_HOPS,
        FLOOD,
        NEW_FLOW_RATE,
        LAYOUT,
        SCRATCH,
        VIPS6,
        VIP_ADDRS6,
        BACKEND_ADDRS6,
        ENDPOINTS6,
        FLOWS6,
        SCRATCH6,
        PROGS,
        KEYS6,
        CLOCK,
        FLOW_COUNT,
        FLOW_SEED,
        REPLY_HINT,
        FLOW_CREDIT,
        CONNS_CPU,
        CONNS_SUM,
    ];

    /// `a == b`, usable in a constant (the datapath's compile-time check).
    pub const fn same(a: &str, b: &str) -> bool {
        let (a, b) = (a.as_bytes(), b.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        let mut i = 0;
        while i < a.len() {
            if a[i] != b[i] {
                return false;
            }
            i += 1;
        }
        true
    }
}

pub mod counter {
    /// Packet to a VIP address that could not be parsed (truncated header,
    /// bad IHL, total length beyond the frame): dropped.
    pub const DROP_MALFORMED: u32 = 0;
    /// New flow for a service without any backend that takes new flows: dropped.
    pub const DROP_NO_BACKEND: u32 = 1;
    /// The flow table refused an insert: dropped.
    pub const DROP_FLOW_TABLE: u32 = 2;
    /// IPv4 fragment to a VIP address (no ports to balance on): dropped.
    pub const DROP_FRAGMENT: u32 = 3;
    /// Rewritten packet handed to the kernel because the FIB had no
    /// resolved neighbour (or no route) for it: the kernel finishes the job.
    pub const FIB_FALLBACK: u32 = 4;
    /// Packet to a VIP with TTL <= 1, passed unmodified so the kernel answers
    /// with ICMP time exceeded.
    pub const TTL_EXPIRED: u32 = 5;
    /// Rewritten packet that left by XDP (the fast path): redirected to its
    /// egress device, or sent back out the device it came in on
    /// (`XDP_TX`, also counted in [`XDP_TX`]).
    pub const XDP_REDIRECT: u32 = 6;
    /// Rewritten packet handed to the kernel's forwarding path because its
    /// egress device cannot transmit frames redirected from the mode the
    /// program runs in on the ingress device (a bridge under native XDP, a
    /// veth whose peer has neither XDP nor GRO, a non-Ethernet device);
    /// and a GSO packet, longer than its ingress device's MTU (generic
    /// mode only: merged by GRO, or from a local sender that left its
    /// segmentation to offload), which a redirect would drop and the
    /// kernel splits. Also such a GSO packet to a DSR service, which the
    /// kernel's forwarding cannot send (it is addressed to the VIP): it
    /// goes on as an skb by lbd's tc program (see [`TcHandoff`](super::TcHandoff)).
    pub const KERNEL_EGRESS: u32 = 7;
    /// Packet whose TCP/UDP checksum arrived unfinished (CHECKSUM_PARTIAL
    /// from a local sender behind a veth): completed before a native XDP
    /// redirect, or updated as a partial checksum for the kernel to finish.
    pub const CSUM_PARTIAL: u32 = 8;
    /// New flow above the per-CPU new-flow rate (`FLOOD`): given a
    /// backend by consistent hash, without a flow-table entry.
    pub const FLOOD_RATE: u32 = 9;
    /// New flow that found the flow table full: given a backend by
    /// consistent hash, without an entry (established flows are never
    /// evicted to make room).
    pub const TABLE_FULL: u32 = 10;
    /// Packet from a backend endpoint whose flow has no entry (it was
    /// routed statelessly, or its entry expired): its source rewritten to
    /// the VIP the endpoint names, without per-flow state.
    pub const STATELESS_REPLY: u32 = 11;
    /// TCP packet other than a SYN without a flow entry, or on a closed
    /// one, or a SYN on a half-open one, dropped while a migration copies
    /// the old datapath's last flows (`Flood::hold_until`), and any SYN
    /// that would open a flow while its program swap is under way
    /// ([`HOLD_NEW`](crate::HOLD_NEW)); and a new flow's packet whose
    /// entry another CPU, inserting the same flow at the same moment, is
    /// still writing after many reads (`PUT_JOIN` in lb-ebpf's
    /// `table.rs`), or whose insert lost the free slot it was taking to
    /// another CPU's insert at that moment (`Put::Busy`): its sender
    /// retransmits.
    pub const HELD: u32 = 12;
    /// Packet too big for its egress device's MTU: never redirected (a
    /// redirected frame above the MTU is dropped silently). With DF set
    /// (IPv4) or IPv6, answered with ICMP "fragmentation needed" / "packet
    /// too big" from the VIP; an IPv4 packet without DF goes to the kernel,
    /// which fragments it.
    pub const TOO_BIG: u32 = 13;
    /// IPv6 packet to a VIP with an extension header the datapath does not
    /// walk (anything but hop-by-hop, routing and destination options, or
    /// more than [`super::MAX_IPV6_EXT`] of them): dropped.
    pub const IPV6_EXT: u32 = 14;
    /// Packet of a DSR service whose backend is not on a directly
    /// connected network (the FIB names a gateway for it): L2 direct
    /// server return cannot reach it; dropped.
    pub const DSR_OFF_LINK: u32 = 15;
    /// ICMP error from the backend side about a client -> backend packet
    /// of a balanced flow: its quoted header rewritten back to the VIP,
    /// on its way to the client.
    pub const ICMP_TO_CLIENT: u32 = 16;
    /// ICMP error from the client side about a reply (addressed to the
    /// VIP): sent on to the flow's backend (NAT: rewritten to it; DSR:
    /// "fragmentation needed" / "packet too big" only, unchanged, to its MAC).
    pub const ICMP_TO_BACKEND: u32 = 17;
    /// VLAN-tagged packet (one tag or two) balanced: rewritten with its
    /// tags in place and handed to the kernel's forwarding path, which
    /// knows the egress VLAN (an XDP redirect cannot reach a VLAN device).
    pub const VLAN: u32 = 18;
    /// Packet from a backend endpoint for a client's flow whose entry now
    /// names another backend (the flow was re-dispatched when its backend
    /// went down, or the client's tuple opened a new connection since):
    /// not a reply of that flow, so dropped rather than passed on to the
    /// client with the backend's own address as its source.
    pub const STALE_BACKEND: u32 = 19;
    /// Of the packets counted in [`XDP_REDIRECT`], those whose egress is
    /// the device they came in on (a one-arm gateway): sent back out by
    /// `XDP_TX`, without the redirect helper's call.
    pub const XDP_TX: u32 = 20;
    /// Number of counters.
    pub const COUNT: u32 = 21;

    /// Names used by userspace (metrics labels, `lbctl status`).
    pub const NAMES: [&str; COUNT as usize] = [
        "malformed",
        "no_backend",
        "flow_table",
        "fragment",
        "fib_fallback",
        "ttl_expired",
        "xdp_redirect",
        "kernel_egress",
        "csum_partial",
        "flood_rate",
        "table_full",
        "stateless_reply",
        "held",
        "too_big",
        "ipv6_ext",
        "dsr_off_link",
        "icmp_to_client",
        "icmp_to_backend",
        "vlan",
        "stale_backend",
        "xdp_tx",
    ];

    /// Counters that count a rewritten packet handed to the kernel's
    /// forwarding path (each packet in exactly one of them).
    pub const KERNEL_PATH: [u32; 3] = [FIB_FALLBACK, KERNEL_EGRESS, VLAN];
}

/// Version of the pinned datapath's layout: the maps, their types and the
/// byte layout of every key and value. Written into the `LAYOUT` map when
/// lbd creates the maps; a pinned datapath without that map is version 1
/// (every lbd before versions existed). Bump it whenever any of those
/// changes, and teach `lb-userspace`'s `dataplane::layout` to migrate from
/// the previous one.
///
/// 1: flows in an LRU hash; 2: flows in preallocated kernel hash maps;
/// 3: flows in slots of the datapath's own table ([`Slot`]); 4: the same
/// slots, placed by a hash seeded per datapath ([`SlotKey::slot_hash`],
/// the seed kept in `FLOW_SEED`); 5: an entry's first slot hashed from
/// its client's side only, and reply entries' keys marked
/// ([`KEY_REPLY`]), so that a flow's two entries sit side by side; 6:
/// the selection tables' entries packed four to an element of `SELECT`
/// ([`SelectWord`]); 7: the flow tables' slots in arrays of 30 KB held
/// by an array of maps ([`FLOW_ARRAY_ELEMENTS`]), their sizes in
/// `FLOW_SEED` beside the seed ([`FLOW_SEED_SLOTS`]); 8: three maps
/// more, for counts kept per CPU (`FLOW_CREDIT`: each CPU's share of
/// `FLOW_COUNT`, see [`flow_credit_batch`]; `CONNS_CPU`: the connection
/// counts of the flows marked [`FLOW_CONNS_CPU`]; `CONNS_SUM`: their sums,
/// written by lbd for least-conn), and the mark. Everything layout 7
/// pinned keeps its bytes and its meaning (an entry without the mark is
/// counted in `CONNS`, as every layout-7 entry was), so lbd takes a
/// layout-7 datapath up in place: it adopts the maps, creates the three
/// new ones and writes 8; 9: a generation in a flow-table slot's claim
/// word ([`SLOT_GEN`]), bumped by a replacement in place. Layouts 7 and 8
/// wrote claims of generation 0, which read the same, so both are taken
/// up in place; a layout-8 datapath's program, which compares whole
/// claims, would miss a replaced entry, so an lbd of layout 8 refuses a
/// datapath of 9.
pub const LAYOUT_VERSION: u32 = 9;

/// The last layout that lbd takes up in place, without a migration: its
/// maps are this layout's but for the ones layout 8 added (layout 9 added
/// none).
pub const LAYOUT_IN_PLACE_FROM: u32 = 7;

/// Room a CPU takes from the shared entry count (`FLOW_COUNT`) at a time,
/// for a flow table that holds at most `limit` entries: its inserts then
/// draw on that share (`FLOW_CREDIT`, per CPU) and write no shared word,
/// where one shared atomic add per new flow moved the counter's cache line
/// between CPUs on every new flow. What the CPUs hold unused counts as
/// taken: the table may refuse a new flow with up to `batch - 1` entries
/// free per other CPU. So the batch is a 4,096th of the limit, at most 64:
/// at most 63 entries short per other CPU (0.02% of a 262,144-entry table
/// on 2 CPUs, 1.5% on 64), and for a limit under 8,192 it is 1: every
/// insert takes from the shared count, exact, as before layout 8.
#[inline(always)]
pub const fn flow_credit_batch(limit: u32) -> u64 {
    let b = limit >> 12;
    if b < 2 {
        1
    } else if b > 64 {
        64
    } else {
        b as u64
    }
}

/// Entries of `FLOW_SEED`: the slot hash's seed (0), and the slots of
/// the IPv4 (1) and the IPv6 flow table (2), which an adopting lbd
/// cannot read from the tables themselves (an array of maps' size is in
/// arrays, and a small table's one array is partly used).
pub const FLOW_SEED_SLOTS: u32 = 3;

/// An element of the `SELECT` array: four selection-table entries
/// (backend ids, which fit 16 bits: [`MAX_BACKENDS`]). Entry `i` of the
/// array is lane `i % 4` of element `i / 4`. The kernel rounds an array's
/// values up to 8 bytes, so one `u32` entry per element took 8 bytes: a
/// 65,537-entry Maglev table filled 512 KB, and the random entry each new
/// flow reads missed the cache more often than in the 128 KB it takes
/// packed.
pub type SelectWord = [u16; SELECT_LANES as usize];
/// Entries per [`SelectWord`].
pub const SELECT_LANES: u32 = 4;
const _: () = assert!(MAX_BACKENDS <= 1 << 16, "backend ids must fit a SELECT lane");

/// Where entry `i` of `SELECT` lives: its element and the lane in it.
#[inline(always)]
pub const fn select_slot(i: u32) -> (u32, usize) {
    (i / SELECT_LANES, (i % SELECT_LANES) as usize)
}

/// `SELECT` elements that hold `entries` entries.
pub const fn select_elements(entries: u32) -> u32 {
    entries.div_ceil(SELECT_LANES)
}

/// Flood protection, read by the datapath (`FLOOD`, one entry), written by
/// lbd from the config.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flood {
    /// New flows per second and CPU that may get a flow-table entry; the
    /// rest get a backend by consistent hash and no entry. 0: no limit.
    pub new_flow_rate_per_cpu: u32,
    /// Until this coarse second (truncated), a TCP packet other than a SYN
    /// that finds no flow entry, or a closed one, is dropped
    /// (`counter::HELD`) instead of routed by hash or to the closed flow's
    /// backend: lbd is copying an older datapath's last flows (a
    /// migration), and the sender's retransmission will find its entry
    /// (a closed copy's may be replaced by a later connection the old
    /// program made on the tuple: see [`InsertItem::copied`]). So is a
    /// SYN on an entry whose handshake has not completed: a copy taken
    /// half-open may be of a connection the old program saw close since,
    /// and the SYN a later one on the tuple, which the late copy's close
    /// tells apart from a retransmission.
    /// 0: never. With [`HOLD_NEW`] set, every TCP SYN that would open a
    /// new entry is held too.
    pub hold_until: u32,
}

/// [`Flood::hold_until`]'s top bit (never a time: 68 years of uptime):
/// while a migration swaps the new program in interface by interface,
/// some interfaces still run the old one, which sees the backends' side
/// of a connection the new program opened: into its own tables or
/// nowhere, never into the new entry. That entry then never completed
/// its handshake nor closed, and the client's next connection on the
/// tuple was taken for its SYN's retransmission, uncounted (an upgrade
/// test counted one new flow fewer than the backends' connections). So
/// until the last interface runs the new program, its SYNs wait for their
/// retransmission, a second later; lbd clears the bit at once after the
/// swap, and a lapsed hold ends it anyway.
pub const HOLD_NEW: u32 = 1 << 31;

/// One CPU's new-flow count in the current second (`NEW_FLOW_RATE`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateWindow {
    /// Coarse monotonic second the count is for.
    pub second: u64,
    pub count: u64,
}

/// One CPU's copy of the datapath's idle clock (`CLOCK`): the coarse
/// monotonic second read at the jiffy `jiffies`. The coarse clock moves
/// only at a timer tick, as jiffies do, so within one jiffy the second
/// read is the one still in force; the datapath reads the clock once per
/// jiffy and CPU instead of once per packet (the helper cost about 17 ns
/// a call on a 2-core VM, November 2026; reading the jiffies about 1 ns).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockCache {
    pub jiffies: u64,
    pub secs: u64,
    /// 1 once written (a never-written slot is all zeros, and jiffies
    /// pass through 0 five minutes after boot).
    pub valid: u32,
    pub _pad: u32,
}

/// Key of the VIP map: what a client connects to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VipKey {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    /// IP protocol number (6 TCP, 17 UDP).
    pub proto: u8,
    pub _pad: u8,
}

/// Key of the endpoint map (`ENDPOINTS`): a backend's address, port and
/// protocol, laid out as a [`VipKey`]. The value is the `VipKey` of the one
/// service whose flows' replies come from it.
pub type EndpointKey = VipKey;

/// Size of the endpoint map: every backend of every service, plus room for
/// entries kept after their service went (its last flows still reply).
pub const MAX_ENDPOINTS: u32 = 2 * MAX_BACKENDS;

/// A cached next hop (`NEXT_HOPS`, by backend id): what the FIB answered
/// for packets to `addr` arriving on `ingress`, checked against the
/// devices of generation `gen`, at `time` (coarse seconds, truncated).
/// Used for about a second. Written whole by whichever CPU looked it up,
/// `ifindex` last; a reader may see a half-written one at worst once, when
/// the next hop changes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop {
    /// Destination the hop was looked up for (network order): a backend
    /// id reused for another address never sees the old hop.
    pub addr: u32,
    /// Egress device, marked [`HOP_TX`] where packets go back out of it
    /// by `XDP_TX`; 0 = nothing cached.
    pub ifindex: u32,
    pub ingress: u32,
    pub time: u32,
    pub generation: u32,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
}

/// Value of the VIP map: one service and where its live selection table is.
///
/// Userspace replaces this value whole (a hash map update swaps the element
/// atomically), which is how a new table goes live without a packet ever
/// seeing a half-written one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    pub service_id: u32,
    /// One of the `SCHED_*` ids.
    pub scheduler: u32,
    /// First entry of this service's table in the selection-table array.
    pub table_off: u32,
    /// Number of entries in the table (0 means no backend).
    pub table_len: u32,
    /// `SVC_F_*` bits.
    pub flags: u32,
    /// Where the service's consistent-hash table is, for flows that get no
    /// flow-table entry (a flood, a full table) or a TCP packet other than
    /// a SYN without one: schedulers that keep state (round robin, least
    /// connections, ...) cannot give such a flow the same backend twice,
    /// a hash into this table does. Hash schedulers use their own table
    /// (`fallback_len` 0).
    pub fallback_off: u32,
    pub fallback_len: u32,
    pub _pad: u32,
}

/// One backend, indexed by backend id in the backend array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    pub _pad: u16,
    pub service_id: u32,
    pub flags: u32,
    /// Configured weight (least-connections compares active / weight).
    pub weight: u32,
    pub _pad2: u32,
}

/// Active-flow accounting of one backend: in the shared `CONNS` (atomic
/// adds) for flows without [`FLOW_CONNS_CPU`], in `CONNS_CPU` (each CPU's
/// copy) for flows with it. Active flows = `opened - closed - expired`
/// over both, where `expired` lives in a separate array written only by
/// userspace (flows that ended without FIN/RST and timed out), so no
/// counter ever has two kinds of writer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Conns {
    pub opened: u64,
    pub closed: u64,
}

/// Key of the flow table: a 5-tuple as seen on the wire. Aligned to 8
/// bytes: the flow table hashes and compares it as two 8-byte words.
/// A reply entry's key (`DIR_REPLY`: backend -> client) has
/// [`KEY_REPLY`] in `_pad[0]`; every other key has 0 there.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src_addr: u32,
    pub dst_addr: u32,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// Value of the flow table. A flow has one entry (`DIR_FLOW`) keyed by the
/// client's 5-tuple, which rewrites the destination to the backend; replies
/// find it through `ENDPOINTS` and get the VIP back as source. A flow of a
/// service flagged `SVC_F_REPLY_ENTRY` (and every flow made by an lbd from
/// before this layout, adopted from its pinned table) has two: the forward one (`DIR_FORWARD`) and a reply one
/// (`DIR_REPLY`) keyed by the backend's 5-tuple marked [`KEY_REPLY`] (its
/// slots start beside the forward entry's), whose rewrite is the VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    pub backend_id: u32,
    pub service_id: u32,
    /// Forward: the backend's address; reply: the VIP. Network byte order.
    pub nat_addr: u32,
    /// Forward: the backend's port; reply: the VIP's port. Network byte order.
    pub nat_port: u16,
    /// `DIR_FLOW`, `DIR_FORWARD` or `DIR_REPLY`.
    pub dir: u8,
    /// The low byte of the sequence number of the TCP segment that made
    /// the entry (its SYN), or of the SYN that reopened or renewed it: a
    /// SYN with the same byte on an entry a reset closed during its
    /// handshake is that SYN's retransmission, not a new connection (see
    /// the datapath's `resumed`), and so is one on a half-open entry,
    /// where a SYN with another byte is a new connection (`syn_on_open`;
    /// not on a migration's copy, [`FLOW_COPY`]). In what was a padding
    /// byte, so the layout is unchanged (entries of older programs hold 0
    /// there).
    pub syn_seq: u8,
    /// TCP close tracking, kept on the forward entry only: `FLOW_*` bits,
    /// set with atomic OR by whichever CPU sees the FIN or RST.
    /// (64 bits wide: BPF has atomic OR only for 64-bit words on every CPU
    /// version the verifier accepts.)
    pub state: u64,
    /// Last packet seen, in seconds of CLOCK_MONOTONIC (coarse), forward
    /// entry only; userspace expires idle flows by it.
    pub last_seen: u64,
    /// Next-hop cache of the replies (`DIR_FLOW`, `DIR_REPLY`; forward
    /// packets use their backend's, `NEXT_HOPS`): egress ifindex (0 =
    /// none; marked [`HOP_TX`] as `NextHop::ifindex` is), when it was
    /// looked up (coarse seconds, truncated), and the MACs. A FIB lookup
    /// costs about as much as the rest of the path, so it is done at most
    /// about once a second per flow.
    pub nh_ifindex: u32,
    pub nh_time: u32,
    pub nh_smac: [u8; 6],
    pub nh_dmac: [u8; 6],
    /// The device generation (`NETDEV_GEN`) the cached next hop was checked
    /// against: a change to any device's abilities makes every cached hop
    /// stale at once.
    pub nh_gen: u32,
}

/// Key of the IPv6 VIP map (`VIPS6`), and of the IPv6 endpoint map
/// (`ENDPOINTS6`, a backend's address, port and protocol, whose value is
/// the VIP key of the service that owns it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Vip6Key {
    /// IPv6 address, as the 16 bytes appear on the wire.
    pub addr: [u32; 4],
    /// Port, network byte order.
    pub port: u16,
    /// IP protocol number (6 TCP, 17 UDP).
    pub proto: u8,
    pub _pad: u8,
}

/// Key of the IPv6 flow table (`FLOW_SLOTS6`): a 5-tuple as seen on the wire.
/// IPv6 flows have their own table so that the IPv4 key stays 16 bytes
/// (the hash of a 40-byte key costs every IPv4 packet more). Aligned to 8
/// bytes: hashed and compared as five 8-byte words.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey6 {
    pub src_addr: [u32; 4],
    pub dst_addr: [u32; 4],
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// Value of the IPv6 flow table: [`Flow`] with a 16-byte rewrite address.
/// Same directions, state bits and next-hop cache.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow6 {
    pub backend_id: u32,
    pub service_id: u32,
    /// Forward: the backend's address; reply: the VIP.
    pub nat_addr: [u32; 4],
    pub nat_port: u16,
    pub dir: u8,
    /// As [`Flow::syn_seq`].
    pub syn_seq: u8,
    pub _pad2: u32,
    pub state: u64,
    pub last_seen: u64,
    pub nh_ifindex: u32,
    pub nh_time: u32,
    pub nh_smac: [u8; 6],
    pub nh_dmac: [u8; 6],
    pub nh_gen: u32,
}

/// One slot of a flow table (`FLOW_SLOTS`, `FLOW_SLOTS6`): an array of
/// our own, with open addressing, where a kernel hash map would cost every
/// packet a helper's hash and bucket walk and every new flow a free-list
/// pop, a bucket lock and three or more cold cache lines. A key's slots
/// are `hash, hash + 1, ...` (linear probing, at most [`SLOT_PROBES`]),
/// masked by the table's size, a power of two.
///
/// `claim` says what the slot holds: [`SLOT_EMPTY`] (0; ends every probe
/// sequence), [`SLOT_TOMB`] (removed: free for an insert, skipped by a
/// lookup), or the key's tag (the high 32 bits of its hash) with
/// [`SLOT_BUSY`] while one CPU writes the entry or [`SLOT_READY`] once it
/// is whole. A writer takes a slot by compare-and-swap of the claim and
/// publishes it with an atomic add (a full barrier), after the key and
/// value; a reader compares the claim first (its tag and state bits,
/// [`SLOT_MATCH`]) and the key only on a match.
///
/// Between the state and the tag, a whole or busy entry's claim holds a
/// generation ([`SLOT_GEN`], layout 9): an entry replaced in place (a new
/// connection on a closed flow's 5-tuple) takes its claim with the next
/// generation, so the claim never returns to a value it held. The
/// sweeper's removal, a compare-and-swap from the claim it read before it
/// checked the entry, then fails when the entry was replaced in between,
/// however late its swap comes (its CPU taken by an interrupt, say);
/// before, the replaced entry's claim was the old one's again, and the
/// new connection's entry was removed (its next packets scheduled anew).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot<K, V> {
    pub claim: u64,
    pub key: K,
    pub value: V,
}

/// An IPv4 flow-table slot (80 bytes).
pub type FlowSlot = Slot<FlowKey, Flow>;
/// An IPv6 flow-table slot (120 bytes).
pub type FlowSlot6 = Slot<FlowKey6, Flow6>;

/// Slots per element of a flow-table array: slot `i` is slot `i %
/// SLOT_BUCKET` of element `i / SLOT_BUCKET`. One element is what the
/// kernel hands userspace per step of a batched read, which costs about a
/// microsecond a step on the development VM whatever the element's size:
/// the sweeper reads sixteen slots a step instead of one. (Probing within
/// an element is also pointer arithmetic rather than a map lookup.)
pub const SLOT_BUCKET: u32 = 16;

/// An element of the IPv4 flow-table array (1,280 bytes).
pub type FlowBucket = [FlowSlot; SLOT_BUCKET as usize];
/// An element of the IPv6 flow-table array (1,920 bytes).
pub type FlowBucket6 = [FlowSlot6; SLOT_BUCKET as usize];

/// [`Slot::claim`]: nothing was ever here since the table was made (or
/// since the sweeper cleared the end of a run of removed slots).
pub const SLOT_EMPTY: u64 = 0;
/// [`Slot::claim`] state bits: being written by the CPU that claimed it.
pub const SLOT_BUSY: u64 = 1;
/// [`Slot::claim`] state bits: a whole entry.
pub const SLOT_READY: u64 = 2;
/// [`Slot::claim`]: removed (no tag).
pub const SLOT_TOMB: u64 = 3;
/// The state bits of a claim word.
pub const SLOT_STATE: u64 = 3;
/// The tag bits of a claim word (the high half of the key's hash).
pub const SLOT_TAG: u64 = !0 << 32;
/// The generation bits of a claim word (see [`Slot`]): 0 in a new entry,
/// one more (wrapping within these bits) each time the entry is replaced
/// in place. Layouts before 9 wrote none, so their claims read as
/// generation 0.
pub const SLOT_GEN: u64 = !(SLOT_TAG | SLOT_STATE);
/// One generation, in a claim word.
pub const SLOT_GEN_ONE: u64 = SLOT_STATE + 1;
/// The bits of a claim word a lookup compares: the tag and the state, not
/// the generation.
pub const SLOT_MATCH: u64 = SLOT_TAG | SLOT_STATE;
/// Slots a lookup or an insert probes at most: bounds the loops. At the
/// table's fill of at most one half (two slots per `conntrack_max`),
/// linear probing's clusters leave a run of 32 taken slots about once in
/// millions of inserts; such an insert fails like a full table's
/// (`counter::TABLE_FULL`: the flow is routed by consistent hash without
/// an entry).
pub const SLOT_PROBES: u32 = 32;

/// Elements ([`FlowBucket`], [`SLOT_BUCKET`] slots each) in each array of
/// the IPv4 flow table, and ([`FlowBucket6`]) of the IPv6 one. A flow
/// table is an array of maps (`FLOW_SLOTS`, `FLOW_SLOTS6`) whose arrays
/// hold this many elements: 30,720 bytes of either family's, which with
/// the array's header stay under the 32 KB up to which the kernel
/// allocates a BPF array with kmalloc, in its linear map (mapped with
/// huge pages), instead of vmalloc, in 4 KB pages. A new flow's slot is a
/// miss to memory either way; in one big vmalloc'd array it is also a TLB
/// miss and a page walk (lb-bench's `floor_split` against `floor_open`:
/// see the README). Slot `i` is slot `i % SLOT_BUCKET` of element `e = i /
/// SLOT_BUCKET`, element `e % n` of array `e / n` (`n` this constant).
pub const FLOW_ARRAY_ELEMENTS: u32 = 24;
/// [`FLOW_ARRAY_ELEMENTS`] of the IPv6 flow table.
pub const FLOW_ARRAY_ELEMENTS6: u32 = 16;
/// The size (bytes) up to which the kernel allocates a BPF array with
/// kmalloc (`PAGE_SIZE << PAGE_ALLOC_COSTLY_ORDER`); a flow table's
/// arrays keep 1 KB under it for the array's header.
pub const KMALLOC_ARRAY_MAX: usize = 32 * 1024;
const _: () = assert!(
    FLOW_ARRAY_ELEMENTS as usize * size_of::<FlowBucket>() <= KMALLOC_ARRAY_MAX - 1024
        && FLOW_ARRAY_ELEMENTS6 as usize * size_of::<FlowBucket6>() <= KMALLOC_ARRAY_MAX - 1024
);

/// Arrays of a flow table of `slots` slots whose arrays hold `elements`
/// elements each (the last one maybe in part).
pub const fn flow_arrays(slots: u32, elements: u32) -> u32 {
    (slots / SLOT_BUCKET).div_ceil(elements)
}

/// Slots of a flow table for `conntrack_max` flows: twice as many, to a
/// power of two, at least one element's ([`SLOT_BUCKET`]) and at most 2^30
/// (the datapath's insert keeps slot indexes in 31 bits).
pub const fn flow_slots(conntrack_max: u32) -> u32 {
    let want = (conntrack_max as u64) * 2;
    let slots = if want < SLOT_BUCKET as u64 { SLOT_BUCKET as u64 } else { want.next_power_of_two() };
    if slots > 1 << 30 { 1 << 30 } else { slots as u32 }
}

/// A flow-table key: hashed to its slots, compared as whole words.
pub trait SlotKey: Copy {
    /// 64 bits under the table's `seed`: the low 32 pick the first slot,
    /// the high 32 are the tag.
    fn slot_hash(&self, seed: u64) -> u64;
    /// Equal keys, word by word (no memcmp: BPF has none).
    fn same(&self, other: &Self) -> bool;
    /// Whether this is a reply entry's key (marked [`KEY_REPLY`]).
    fn is_reply(&self) -> bool;
    /// Mark this key as a reply entry's, or take the mark off.
    fn set_reply(&mut self, reply: bool);
}

/// `_pad[0]` of a reply entry's key ([`FlowKey`], [`FlowKey6`]): its
/// client is the destination, and its first slot is hashed from that
/// side ([`SlotKey::slot_hash`]). Also keeps a reply key apart from a
/// forward key of the same 5-tuple.
pub const KEY_REPLY: u8 = 1;

/// A key's slot hash ([`SlotKey::slot_hash`]) from the mixed state after
/// its client side's words (`client`) and after all of them (`all`): a
/// multiply-xorshift mix per 8-byte word ([`mix_word`]), from a state
/// that starts at the seed ([`hash_init`]). The low 32 bits (the first
/// slot) come from the client's side alone, the tag (the high 32) from
/// the whole key.
///
/// Each datapath draws its seed at random when it makes its flow tables
/// (kept in `FLOW_SEED` for the next lbd that adopts them), so where a
/// 5-tuple lands is not known outside the gateway: a client cannot aim
/// its flows at one probe sequence, fill its [`SLOT_PROBES`] slots and
/// leave later flows there without an entry, as it could with a fixed
/// hash read from this source. (Not a keyed cryptographic hash: a few
/// multiplies per word is what a packet can afford; the kernel's own
/// hash maps take the same approach, a random seed to jhash.)
///
/// Two keys with the same client side (a flow's forward entry, client
/// -> VIP, and its reply entry, backend -> client) start their probes at
/// the same slot: the second insert of a new flow then
/// finds its slot's cache line and page just touched by the first,
/// where a hash over the whole key sent it to a cold one (190 ns of the
/// 520 a new flow of a service with shared endpoints cost).
///
/// What that gives up: a client's 5-tuples towards several VIP ports
/// share a probe sequence, so a client (address, port) talking to `n`
/// of the gateway's service ports makes a run of `n` entries. A run
/// longer than [`SLOT_PROBES`] leaves the later flows of keys starting
/// in it without an entry (routed by hash, counted `table_full`); a
/// spoofed client can make such runs, but not aim them, as the seed is
/// unknown outside the gateway.
#[inline(always)]
const fn split_hash(client: u64, all: u64) -> u64 {
    (finish(all) & !0xffff_ffff) | (finish(client) & 0xffff_ffff)
}

/// The state a slot hash starts from under `seed`.
#[inline(always)]
const fn hash_init(seed: u64) -> u64 {
    0x2545_f491_4f6c_dd1d ^ seed
}

#[inline(always)]
const fn mix_word(h: u64, w: u64) -> u64 {
    let h = (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ (h >> 29)
}

#[inline(always)]
const fn finish(h: u64) -> u64 {
    let h = h.wrapping_mul(0x1656_67b1_9e37_79f9);
    h ^ (h >> 32)
}

impl FlowKey {
    /// The key of a 5-tuple (its padding zero), written as two whole
    /// words. On BPF, a struct literal's `[0; 3]` padding compiles to a
    /// call of `memset`, a byte loop, on every packet that builds a key.
    /// (Volatile stores: built as a value from the words instead, LLVM
    /// spilled a register left undefined on one path of the balancer,
    /// which the verifier refuses.)
    #[inline(always)]
    #[must_use]
    pub fn new(src_addr: u32, dst_addr: u32, src_port: u16, dst_port: u16, proto: u8) -> Self {
        let (src, dst) = (u64::from(src_addr), u64::from(dst_addr));
        let (sport, dport, proto) = (u64::from(src_port), u64::from(dst_port), u64::from(proto));
        let words: [u64; 2] = if cfg!(target_endian = "little") {
            [src | dst << 32, sport | dport << 16 | proto << 32]
        } else {
            [src << 32 | dst, sport << 48 | dport << 32 | proto << 24]
        };
        let mut key = core::mem::MaybeUninit::<Self>::uninit();
        let w = key.as_mut_ptr().cast::<u64>();
        // SAFETY: `FlowKey` is repr(C), 8-aligned, 16 bytes of integers
        // with no implicit padding (size tests below): two aligned words
        // write all of it, and any bits are a value.
        unsafe {
            w.write_volatile(words[0]);
            w.add(1).write_volatile(words[1]);
            key.assume_init()
        }
    }

    /// This 5-tuple as a reply entry's key ([`KEY_REPLY`]).
    #[inline(always)]
    #[must_use]
    pub const fn reply(mut self) -> Self {
        self._pad[0] = KEY_REPLY;
        self
    }

    /// The key's 16 bytes as two words.
    #[inline(always)]
    pub fn words(&self) -> [u64; 2] {
        // SAFETY: 16 bytes of plain integers with explicit padding,
        // aligned to 8 (repr(C, align(8))).
        unsafe { *core::ptr::from_ref(self).cast::<[u64; 2]>() }
    }
}

impl SlotKey for FlowKey {
    #[inline(always)]
    fn slot_hash(&self, seed: u64) -> u64 {
        let mark = self._pad[0];
        let ((ca, cp), (oa, op)) = if mark == KEY_REPLY {
            ((self.dst_addr, self.dst_port), (self.src_addr, self.src_port))
        } else {
            ((self.src_addr, self.src_port), (self.dst_addr, self.dst_port))
        };
        let side = |a: u32, p: u16| u64::from(a) << 32 | u64::from(p) << 16;
        // The mark goes with the other side: the start is the client's.
        // (Word by word, no arrays: the datapath inlines this, and an
        // array is built on its stack.)
        let client = mix_word(hash_init(seed), side(ca, cp) | u64::from(self.proto));
        split_hash(client, mix_word(client, side(oa, op) | u64::from(mark)))
    }
    #[inline(always)]
    fn same(&self, other: &Self) -> bool {
        let (a, b) = (self.words(), other.words());
        (a[0] ^ b[0]) | (a[1] ^ b[1]) == 0
    }
    #[inline(always)]
    fn is_reply(&self) -> bool {
        self._pad[0] == KEY_REPLY
    }
    #[inline(always)]
    fn set_reply(&mut self, reply: bool) {
        self._pad[0] = if reply { KEY_REPLY } else { 0 };
    }
}

/// Copy an IPv6 address from `src` to `dst` as four 32-bit words. On
/// BPF, a plain copy of a 16-byte array (out of a packet, into a map value)
/// compiles to a call of a `memmove` subprogram, a byte loop of 16 rounds,
/// on every packet that makes one; the loads and stores are volatile so
/// that LLVM does not merge them back into that call.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of 16 bytes, each aligned
/// to 4 as `[u32; 4]` is (the datapath's packet headers are read as
/// structs at their offsets throughout; BPF has no alignment traps).
#[inline(always)]
pub unsafe fn copy_addr6(dst: *mut [u32; 4], src: *const [u32; 4]) {
    let (d, s) = (dst.cast::<u32>(), src.cast::<u32>());
    // SAFETY: the caller's promise; four words inside the 16 bytes.
    unsafe {
        d.write_volatile(s.read_volatile());
        d.add(1).write_volatile(s.add(1).read_volatile());
        d.add(2).write_volatile(s.add(2).read_volatile());
        d.add(3).write_volatile(s.add(3).read_volatile());
    }
}

impl FlowKey6 {
    /// Write the key of a 5-tuple into `key` in place: the addresses
    /// copied word by word from where they lie (the packet, a map value),
    /// the ports, protocol, `mark` (0, or [`KEY_REPLY`]) and zero padding
    /// as one word. A struct literal compiles to two `memmove` calls and a
    /// `memset` call on BPF (see [`copy_addr6`]).
    ///
    /// # Safety
    /// `key` is valid for writes of a `FlowKey6` (and aligned, as its type
    /// is); `src` and `dst` as [`copy_addr6`] asks.
    #[inline(always)]
    pub unsafe fn write(
        key: *mut Self,
        src: *const [u32; 4],
        dst: *const [u32; 4],
        src_port: u16,
        dst_port: u16,
        proto: u8,
        mark: u8,
    ) {
        let (sport, dport, proto, mark) = (u64::from(src_port), u64::from(dst_port), u64::from(proto), u64::from(mark));
        let tail = if cfg!(target_endian = "little") {
            sport | dport << 16 | proto << 32 | mark << 40
        } else {
            sport << 48 | dport << 32 | proto << 24 | mark << 16
        };
        // SAFETY: the caller's promise; `FlowKey6` is repr(C), 8-aligned,
        // two addresses then 8 bytes of ports, protocol and padding (size
        // tests below).
        unsafe {
            copy_addr6(&raw mut (*key).src_addr, src);
            copy_addr6(&raw mut (*key).dst_addr, dst);
            key.cast::<u64>().add(4).write_volatile(tail);
        }
    }

    /// This 5-tuple as a reply entry's key ([`KEY_REPLY`]).
    #[inline(always)]
    #[must_use]
    pub const fn reply(mut self) -> Self {
        self._pad[0] = KEY_REPLY;
        self
    }

    /// The key's 40 bytes as five words.
    #[inline(always)]
    pub fn words(&self) -> [u64; 5] {
        // SAFETY: 40 bytes of plain integers with explicit padding,
        // aligned to 8 (repr(C, align(8))).
        unsafe { *core::ptr::from_ref(self).cast::<[u64; 5]>() }
    }
}

impl SlotKey for FlowKey6 {
    #[inline(always)]
    fn slot_hash(&self, seed: u64) -> u64 {
        let mark = self._pad[0];
        let ((ca, cp), (oa, op)) = if mark == KEY_REPLY {
            ((&self.dst_addr, self.dst_port), (&self.src_addr, self.src_port))
        } else {
            ((&self.src_addr, self.src_port), (&self.dst_addr, self.dst_port))
        };
        let pair = |a: u32, b: u32| u64::from(a) << 32 | u64::from(b);
        // The mark goes with the other side (as for IPv4).
        let mut h = mix_word(hash_init(seed), pair(ca[0], ca[1]));
        h = mix_word(h, pair(ca[2], ca[3]));
        let client = mix_word(h, u64::from(cp) << 16 | u64::from(self.proto));
        h = mix_word(client, pair(oa[0], oa[1]));
        h = mix_word(h, pair(oa[2], oa[3]));
        split_hash(client, mix_word(h, u64::from(op) << 16 | u64::from(mark)))
    }
    #[inline(always)]
    fn same(&self, other: &Self) -> bool {
        let (a, b) = (self.words(), other.words());
        (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4]) == 0
    }
    #[inline(always)]
    fn is_reply(&self) -> bool {
        self._pad[0] == KEY_REPLY
    }
    #[inline(always)]
    fn set_reply(&mut self, reply: bool) {
        self._pad[0] = if reply { KEY_REPLY } else { 0 };
    }
}

/// The sweeper's request to the datapath's `lb_sweep` program, run by
/// lbd through BPF_PROG_TEST_RUN (never attached): the frame it is given
/// is this header and then `count` items of [`SweepItem`] (`family` 4) or
/// [`SweepItem6`] (`family` 6). For each item the program removes the
/// entry of `key` in slot `slot` only if its `state` and `last_seen` are
/// still those the sweeper judged it by, and sets the item's `removed`;
/// an entry a packet touched since, or one made anew for the same 5-tuple
/// (a client reusing its port), stays. lbd reads the frame back. With
/// [`SWEEP_INSERT`] in `family`, the items are flows to insert instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepHeader {
    /// 4: IPv4 items (`FLOW_SLOTS`); 6: IPv6 items (`FLOW_SLOTS6`); with
    /// `SWEEP_INSERT`, insert requests.
    pub family: u32,
    /// Items that follow (at most [`SWEEP_BATCH`] or [`SWEEP_BATCH6`]).
    pub count: u32,
}

/// One IPv4 flow the sweeper would remove; see [`SweepHeader`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepItem {
    pub key: FlowKey,
    /// The entry's `state` and `last_seen` as the sweeper read them.
    pub state: u64,
    pub last_seen: u64,
    /// Set to 1 by the program when it removed the entry, and to
    /// [`SWEEP_CLOSED`] when it did not, but the entry's close is the
    /// sweeper's to count all the same.
    pub removed: u32,
    /// The entry's slot in the flow table, or [`SWEEP_BY_KEY`].
    pub slot: u32,
}

/// [`SweepItem::removed`]: the entry was not removed, but `lb_sweep` had
/// marked it ([`FLOW_DOOMED`]) on the way, and while it was marked, the
/// connection it was judged open for was closed or replaced by a new
/// entry: the datapath counts no close of a marked entry, so the sweeper
/// counts this one (as it counts a removed flow that was open).
pub const SWEEP_CLOSED: u32 = 2;

/// One IPv6 flow the sweeper would remove; see [`SweepHeader`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepItem6 {
    pub key: FlowKey6,
    pub state: u64,
    pub last_seen: u64,
    pub removed: u32,
    pub slot: u32,
}

/// [`SweepHeader::family`] bit of a request to insert flows (with 4 or 6):
/// items of [`InsertItem`] or [`InsertItem6`], each inserted unless its
/// key has an entry already (a migration's copy of an old table, which
/// the datapath fills at the same time). An item with [`COPIED`] in its
/// `copied` word is the old program's later view of a flow copied before:
/// see [`InsertItem::copied`].
pub const SWEEP_INSERT: u32 = 0x100;

/// One IPv4 flow to insert; see [`SWEEP_INSERT`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsertItem {
    pub key: FlowKey,
    pub value: Flow,
    /// Set by the program: [`INSERTED`], [`INSERT_EXISTS`],
    /// [`INSERT_MERGED`], [`INSERT_REPLACED`], or 0 (no free slot for it).
    /// The program may rewrite the item's `state` and `last_seen`.
    pub inserted: u32,
    /// 0: a plain insert. [`COPIED`] | the `state` bits the flow had when
    /// it was first copied. Where the key's entry is still that copy (the
    /// same direction, every copied bit still set, no reopen since):
    /// - if the item is a view of the same connection (the same backend
    ///   endpoint, every copied bit set, no reopen since), the handshake
    ///   and close bits the old program added since ([`MERGED_BITS`]) are
    ///   set in the entry too, and a later `last_seen` is taken. A close
    ///   that needed both programs' halves (one FIN each) is counted for
    ///   the backend then; one the old program made alone it counted
    ///   itself;
    /// - otherwise the item is a later connection the old program made on
    ///   the tuple (a client reusing its port), and replaces the entry,
    ///   keeping the bits the new program added since. The old program
    ///   counted the copy's close and the later connection's open; a close
    ///   the new program counted on the copy is taken back, and the later
    ///   one's close counted if the two views together make it.
    pub copied: u32,
}

/// One IPv6 flow to insert; see [`SWEEP_INSERT`] and [`InsertItem`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsertItem6 {
    pub key: FlowKey6,
    pub value: Flow6,
    pub inserted: u32,
    pub copied: u32,
}

/// [`InsertItem::inserted`]: the entry was inserted.
pub const INSERTED: u32 = 1;
/// [`InsertItem::inserted`]: the key had an entry, which stands.
pub const INSERT_EXISTS: u32 = 2;
/// [`InsertItem::inserted`]: the key's entry was the item's earlier copy,
/// and the old program's later bits or time went into it.
pub const INSERT_MERGED: u32 = 3;
/// [`InsertItem::inserted`]: the key's entry was the item's earlier copy,
/// and the item is the old program's view of a later connection on the
/// tuple, which replaced it.
pub const INSERT_REPLACED: u32 = 4;
/// [`InsertItem::copied`]: the item carries the copied state bits.
pub const COPIED: u32 = 1 << 31;
/// The `state` bits a later view of a copied flow brings into its entry:
/// the handshake (`FLOW_REPLIED`, `FLOW_ESTABLISHED`) and the close
/// (`FLOW_FIN_CLIENT`, `FLOW_FIN_BACKEND`, `FLOW_RST`). A reopen
/// (`FLOW_REOPENED`) is a later connection on the tuple, which replaces
/// the entry (see [`InsertItem::copied`]).
pub const MERGED_BITS: u64 = FLOW_FIN_CLIENT | FLOW_FIN_BACKEND | FLOW_RST | FLOW_REPLIED | FLOW_ESTABLISHED;

/// Items per insert request: 8 + 43 x 80 = 3,448 bytes; IPv6 8 + 29 x
/// 120 = 3,488 (see [`SWEEP_BATCH`]).
pub const INSERT_BATCH: u32 = 43;
pub const INSERT_BATCH6: u32 = 29;

/// [`SweepHeader::family`] of a request to add to backends' counts: items
/// of [`CountsAdd`], added atomically to the connection counts (`CONNS`)
/// and to the running CPU's slot of the per-CPU counters
/// (`BACKEND_STATS`), so that no count the datapath makes at the same time
/// is lost (a read and a write back from userspace would lose those made
/// between them). A migration carries the old program's last counts over
/// with it.
pub const SWEEP_COUNTS: u32 = 0x200;

/// One backend's additions to its counts; see [`SWEEP_COUNTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountsAdd {
    pub backend_id: u32,
    /// Set to 1 by the program when it added the counts (0: no such
    /// backend id).
    pub added: u32,
    /// Added to [`Conns`].
    pub opened: u64,
    pub closed: u64,
    /// Added to [`BackendStats`].
    pub stats: BackendStats,
}

/// Items per [`SWEEP_COUNTS`] request: 8 + 54 x 64 = 3,464 bytes.
pub const COUNTS_BATCH: u32 = 54;

/// [`SweepItem::slot`] when the entry's slot is not known: `lb_sweep`
/// finds the key's entry wherever it is and removes it whatever its state
/// (the reply entry of a flow removed in the same request).
pub const SWEEP_BY_KEY: u32 = u32::MAX;

/// [`SweepItem::last_seen`] of a request to remove the entry in `slot`
/// only if the slot's claim (tag, state and generation: [`SLOT_GEN`]) is
/// still the item's `state`, whatever the entry holds: a reply entry
/// that no forward entry names any more (its flow's tuple taken by a new
/// connection on another backend), which the sweeper found so in two
/// sweeps running. No entry's last packet is this second.
pub const SWEEP_BY_CLAIM: u64 = u64::MAX;

/// Items per `lb_sweep` run. A BPF_PROG_TEST_RUN frame of an XDP program
/// holds at most a page less the XDP headroom (256 bytes) and the
/// `skb_shared_info` tailroom (320): 3,520 bytes. IPv4: 8 + 64 x 40 =
/// 2,568 bytes; IPv6: 8 + 48 x 64 = 3,080.
pub const SWEEP_BATCH: u32 = 64;
pub const SWEEP_BATCH6: u32 = 48;

/// An IPv6 address folded to 32 bits (never 0): the address filter, the
/// flow hash and the next-hop cache's address check use it.
#[inline(always)]
pub fn fold6(addr: &[u32; 4]) -> u32 {
    let h = fmix(mix(mix(mix(mix(0x2545_f491, addr[0]), addr[1]), addr[2]), addr[3]));
    if h == 0 { 1 } else { h }
}

/// The filter bit of an IPv6 address (see [`addr_filter_bit`]): its four
/// words XORed, then mixed as an IPv4 address. Cheaper than [`fold6`]:
/// every IPv6 packet pays it, and a false positive only costs a lookup.
#[inline(always)]
pub fn addr_filter_bit6(addr: &[u32; 4]) -> u32 {
    addr_filter_bit(addr[0] ^ addr[1] ^ addr[2] ^ addr[3])
}

/// The flow hash of an IPv6 5-tuple (the selection-table index of a new
/// IPv6 flow): [`flow_hash`] over the folded addresses.
#[inline(always)]
pub fn flow_hash6(src: &[u32; 4], dst: &[u32; 4], src_port: u16, dst_port: u16, proto: u8) -> u32 {
    flow_hash(fold6(src), fold6(dst), src_port, dst_port, proto)
}

/// The source hash of an IPv6 client address.
#[inline(always)]
pub fn source_hash6(src: &[u32; 4]) -> u32 {
    source_hash(fold6(src))
}

/// Bits in the address filter array (a power of two).
pub const ADDR_FILTER_BITS: u32 = 1 << 16;

/// The address filter: bit `b` is bit `b % 64` of word `b / 64`. It is one
/// map value, so that one lookup serves both of a packet's addresses.
pub type AddrFilter = [u64; (ADDR_FILTER_BITS / 64) as usize];

/// Where filter bit `bit` lives in an [`AddrFilter`]: its word's index and
/// the bit's mask in that word (the layout's one definition, for the
/// datapath and lbd alike).
#[inline(always)]
pub const fn filter_word(bit: u32) -> (usize, u64) {
    ((bit / 64) as usize, 1u64 << (bit % 64))
}

/// Whether bit `bit` is set in a bit set of [`filter_word`]'s layout
/// (the address filter, the reply-entry hint), `word(i)` reading its word
/// `i`: the one test lbd and the datapath share. The caller supplies the
/// read because they hold the set differently: lbd a copy it owns, the
/// datapath only a raw pointer to a map value that lbd may be writing
/// (no reference to it may exist).
#[inline(always)]
pub fn bit_is_set(bit: u32, word: impl FnOnce(usize) -> u64) -> bool {
    let (i, mask) = filter_word(bit);
    word(i) & mask != 0
}

/// The filter bit of an IPv4 address (network order): an address whose bit
/// is clear is neither a VIP nor a backend, and its packets skip the maps.
///
/// Knuth's multiplicative hash: one 32-bit multiply by an odd constant
/// (2^32 over the golden ratio), its top 16 bits. Every packet pays it
/// (twice for traffic that is not ours), so it is kept to one multiply:
/// the murmur finaliser used before (two multiplies, three shifts) cost
/// 3-4 ns more per non-VIP packet on the development VM. The address is
/// in network order, so its last two octets are the top half of `addr`:
/// within one /16 the bit is a bijection of them (no two addresses of a
/// /16 share a bit), and beyond it the spread is as good as the
/// finaliser's (tests below). Changing this function renames the filter
/// map (see `maps::ADDR_FILTER`).
#[inline(always)]
pub fn addr_filter_bit(addr: u32) -> u32 {
    addr.wrapping_mul(0x9e37_79b1) >> (32 - ADDR_FILTER_BITS.trailing_zeros())
}

/// Bits in the reply-entry hint (a power of two, below
/// [`ADDR_FILTER_BITS`]).
pub const REPLY_HINT_BITS: u32 = 1 << 10;

/// The reply-entry hint: bit [`reply_hint_bit`] of every IPv4 TCP VIP
/// (address and port) whose service keeps reply entries
/// ([`SVC_F_REPLY_ENTRY`]), in [`filter_word`]'s layout. A TCP SYN to such
/// a VIP has its flow lookup load the key's second slot early, where that
/// flow's forward entry goes after its reply entry. Only a hint: a bit
/// wrongly set or clear costs time, never a wrong answer. 128 bytes, two
/// cache lines, so that the read stays in cache.
pub type ReplyHint = [u64; (REPLY_HINT_BITS / 64) as usize];

/// A VIP's bit in the [`ReplyHint`]: its address and port (both in
/// network order, as in the packet) through [`addr_filter_bit`]'s
/// multiplicative hash, the port folded into the address's last two
/// octets (the word's top half), top bits kept. Services on one address
/// and different ports get their own bits.
#[inline(always)]
pub fn reply_hint_bit(addr: u32, port: u16) -> u32 {
    (addr ^ (u32::from(port) << 16)).wrapping_mul(0x9e37_79b1) >> (32 - REPLY_HINT_BITS.trailing_zeros())
}

/// [`Flow::state`]: the client sent a FIN.
pub const FLOW_FIN_CLIENT: u64 = 1;
/// [`Flow::state`]: the backend sent a FIN.
pub const FLOW_FIN_BACKEND: u64 = 2;
/// [`Flow::state`]: either side sent a RST.
pub const FLOW_RST: u64 = 4;
/// [`Flow::state`]: the backend has answered (any packet from it).
pub const FLOW_REPLIED: u64 = 8;
/// [`Flow::state`]: the client spoke again after the backend answered
/// (for TCP, a packet other than a SYN): the handshake is complete. A flow
/// without it is half-open, and the sweeper expires it after the short
/// `flood.half_open_timeout` of silence instead of the idle timeout.
pub const FLOW_ESTABLISHED: u64 = 16;
/// [`Flow::state`]: the entry was established, and a SYN on it opened a new
/// connection on the same 5-tuple (a reused client port whose close the
/// balancer did not see). Its handshake starts over (no
/// [`FLOW_ESTABLISHED`], so its SYN's retransmissions are not counted
/// again), but it is no half-open flow: it took no new room, and a forged
/// SYN must not get an idle connection's entry expired early.
pub const FLOW_REOPENED: u64 = 32;
/// [`Flow::state`]: the entry is a migration's copy of an older
/// datapath's flow (set by lbd as it copies, first or late; the datapath
/// never sets it). A new connection on the tuple drops it: a new entry in
/// its place, a reopen, a handshake taken up again. The late copy merges the old program's later view only
/// into an entry that still has it: the bits alone cannot tell, as a
/// later connection's entry may by then have every bit the copy had (a
/// whole connection in the late copy's window). And the datapath takes any
/// SYN on a half-open copy for the copy's own, retransmitted: the older
/// layouts kept no [`Flow::syn_seq`] to tell.
pub const FLOW_COPY: u64 = 64;
/// [`Flow::state`]: the flow's opening is counted in `CONNS_CPU` (this
/// CPU's copy, a plain add), and so is its close, on whichever CPU sees
/// it; without it, in the shared `CONNS` (atomic adds). Set when the
/// entry is made, for every service but the least-conn and least-time
/// ones, whose scheduler reads each candidate's count on every new flow
/// and so needs one word that is always up to date; kept by every later
/// change of the state (a reopen, a reset taken back), so a flow's close
/// always comes off the count its opening went to. Entries of layout 7
/// and copies of older layouts' flows have it clear: they were counted in
/// `CONNS`.
pub const FLOW_CONNS_CPU: u64 = 128;
/// State bit: the sweeper (`lb_sweep`) is removing the entry. Set by a
/// compare-and-swap from the state it judged the entry by, between that
/// check and its swap of the slot's claim, and cleared again if the swap
/// fails (the entry was replaced meanwhile). A packet that finds it takes
/// its flow up as a new one, and a SYN that would take the entry up in
/// place (a reset handshake resumed, a half-open or established entry's
/// tuple reused) and finds it set after its read does the same, without
/// counting anything: so the sweeper's removal and such a SYN exclude
/// each other on the state word (before layout 9, a SYN between the
/// sweeper's check and its swap lost its new connection's entry). While
/// it is set, the entry's close is the sweeper's to count: the datapath
/// counts none (a FIN or reset, a new entry replacing it), and the
/// sweeper counts the close when its removal goes through, or when the
/// mark comes off a closed or replaced entry ([`SWEEP_CLOSED`]).
pub const FLOW_DOOMED: u64 = 256;

/// A TCP flow is closed once either side reset it or both sides sent a FIN.
/// A new SYN on a closed flow's 5-tuple is a new connection and is scheduled
/// afresh (and counted), as IPVS does for reused ports.
#[inline(always)]
pub fn flow_closed(state: u64) -> bool {
    state & FLOW_RST != 0 || state & (FLOW_FIN_CLIENT | FLOW_FIN_BACKEND) == (FLOW_FIN_CLIENT | FLOW_FIN_BACKEND)
}

/// Per-backend counters, one copy per CPU, summed by userspace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Flows scheduled onto this backend.
    pub new_flows: u64,
    /// Client -> backend.
    pub packets_in: u64,
    pub bytes_in: u64,
    /// Backend -> client.
    pub packets_out: u64,
    pub bytes_out: u64,
}

impl BackendStats {
    pub fn add(&mut self, other: &Self) {
        self.new_flows += other.new_flows;
        self.packets_in += other.packets_in;
        self.bytes_in += other.bytes_in;
        self.packets_out += other.packets_out;
        self.bytes_out += other.bytes_out;
    }
}

/// The flow hash used by the datapath to index a selection table.
///
/// Defined here once so that userspace (tests, tools that predict a flow's
/// backend) computes exactly what the kernel computes. Inputs are the raw
/// network-order values from the packet. A murmur3-style finaliser over the
/// mixed words: cheap (a handful of multiplies) and well spread.
#[inline(always)]
pub fn flow_hash(src_addr: u32, dst_addr: u32, src_port: u16, dst_port: u16, proto: u8) -> u32 {
    let ports = (u32::from(src_port) << 16) | u32::from(dst_port);
    let mut h = mix(0x9e37_79b9 ^ u32::from(proto), src_addr);
    h = mix(h, dst_addr);
    h = mix(h, ports);
    fmix(h)
}

/// Hash of the client address alone (source-hash scheduling).
#[inline(always)]
pub fn source_hash(src_addr: u32) -> u32 {
    fmix(mix(0x85eb_ca6b, src_addr))
}

#[inline(always)]
fn mix(h: u32, k: u32) -> u32 {
    let k = k.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
    (h ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

#[inline(always)]
fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // All of these are repr(C), made of integers only, with every padding
    // byte spelled out as a field (sizes asserted by the tests below).
    macro_rules! pod {
        ($($t:ty),*) => {$(
            // SAFETY: see above: plain integers, no implicit padding.
            unsafe impl aya::Pod for $t {}
        )*};
    }
    pod!(
        VipKey,
        Service,
        Backend,
        FlowKey,
        Flow,
        BackendStats,
        Conns,
        NextHop,
        Flood,
        RateWindow,
        ClockCache,
        Vip6Key,
        FlowKey6,
        SweepHeader,
        SweepItem,
        SweepItem6,
        Flow6,
        FlowSlot,
        FlowSlot6,
        InsertItem,
        InsertItem6,
        CountsAdd
    );
}

#[cfg(test)]
mod tests {
    use core::mem::{align_of, size_of};

    use super::*;

    /// A CPU's share of a flow table's room: exact (1) for small tables,
    /// a 4,096th of the limit above, never more than 64; the room the
    /// other CPUs may hold unused stays a small part of the table.
    #[test]
    fn the_flow_credit_batch_is_a_small_part_of_the_table() {
        assert_eq!(flow_credit_batch(0), 1);
        assert_eq!(flow_credit_batch(32), 1);
        assert_eq!(flow_credit_batch(8_191), 1);
        assert_eq!(flow_credit_batch(8_192), 2);
        assert_eq!(flow_credit_batch(262_144), 64);
        assert_eq!(flow_credit_batch(u32::MAX), 64);
        for limit in [8_192u32, 65_536, 262_144, 1_000_000, 16_777_216] {
            let held = (flow_credit_batch(limit) - 1) * 63;
            assert!(held * 64 <= u64::from(limit), "{limit}: 64 CPUs may hold {held} entries unused");
        }
    }

    /// The address filter tells addresses apart: none of a /16 share a
    /// bit, and 4,096 addresses spread over the whole space (a fixed
    /// pseudo-random sequence) collide no more than a random function's
    /// would (about 125 expected, standard deviation about 11; 196 is six
    /// standard deviations above, so a fair function does not fail it).
    #[test]
    fn the_address_filter_spreads_addresses() {
        let net_order = |o: [u8; 4]| u32::from_ne_bytes(o);
        let mut seen = [false; ADDR_FILTER_BITS as usize];
        for c in 0..=255u8 {
            for d in 0..=255u8 {
                let bit = addr_filter_bit(net_order([192, 168, c, d]));
                assert!(!seen[bit as usize], "192.168.{c}.{d} shares bit {bit} with another address of its /16");
                seen[bit as usize] = true;
            }
        }
        let mut seen = [false; ADDR_FILTER_BITS as usize];
        let (mut x, mut collisions) = (0x1234_5678u32, 0);
        for _ in 0..4096 {
            // xorshift32: a fixed sequence, so the test is repeatable.
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let bit = addr_filter_bit(x) as usize;
            collisions += usize::from(seen[bit]);
            seen[bit] = true;
        }
        assert!(collisions <= 196, "{collisions} of 4096 spread addresses landed on a bit already taken");
    }

    /// The reply-entry hint's bits are in range, and the ports of one
    /// address spread over the hint: services on one VIP address and
    /// ports in a row get bits of their own.
    #[test]
    fn the_reply_hint_bit_is_within_the_hint_and_tells_ports_apart() {
        let addr = u32::from_ne_bytes([10, 10, 0, 100]);
        let mut seen = [false; REPLY_HINT_BITS as usize];
        for port in 80u16..112 {
            let bit = reply_hint_bit(addr, port.to_be());
            assert!(bit < REPLY_HINT_BITS, "bit {bit} of port {port}");
            assert!(!seen[bit as usize], "port {port} shares bit {bit} with a lower port of its address");
            seen[bit as usize] = true;
        }
        let mut words = [false; REPLY_HINT_BITS as usize / 64];
        let mut x = 0x8765_4321u32;
        for _ in 0..4096 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let bit = reply_hint_bit(x, 443u16.to_be());
            assert!(bit < REPLY_HINT_BITS, "bit {bit} of {x:#x}");
            words[filter_word(bit).0] = true;
        }
        assert!(words.iter().all(|&w| w), "a word of the hint no address reaches");
    }

    #[test]
    fn shared_type_sizes_have_no_hidden_padding() {
        assert_eq!(size_of::<VipKey>(), 8);
        assert_eq!(size_of::<Service>(), 32);
        assert_eq!(size_of::<Backend>(), 24);
        assert_eq!(size_of::<Conns>(), 16);
        assert_eq!(size_of::<FlowKey>(), 16);
        assert_eq!(size_of::<Flow>(), 56);
        assert_eq!(size_of::<NextHop>(), 32);
        assert_eq!(size_of::<Flood>(), 8);
        assert_eq!(size_of::<RateWindow>(), 16);
        assert_eq!(size_of::<ClockCache>(), 24);
        assert_eq!(size_of::<Vip6Key>(), 20);
        assert_eq!(size_of::<FlowKey6>(), 40);
        assert_eq!(size_of::<Flow6>(), 72);
        assert_eq!(size_of::<SweepHeader>(), 8);
        assert_eq!(size_of::<SweepItem>(), 40);
        assert_eq!(size_of::<SweepItem6>(), 64);
        assert!(8 + SWEEP_BATCH as usize * size_of::<SweepItem>() <= 3520);
        assert!(8 + SWEEP_BATCH6 as usize * size_of::<SweepItem6>() <= 3520);
        assert_eq!(size_of::<InsertItem>(), 80);
        assert_eq!(size_of::<InsertItem6>(), 120);
        assert!(8 + INSERT_BATCH as usize * size_of::<InsertItem>() <= 3520);
        assert!(8 + INSERT_BATCH6 as usize * size_of::<InsertItem6>() <= 3520);
        assert_eq!(size_of::<CountsAdd>(), 64);
        assert!(8 + COUNTS_BATCH as usize * size_of::<CountsAdd>() <= 3520);
        // The copied state travels in the low 31 bits of a u32.
        assert_eq!((MERGED_BITS | FLOW_REOPENED) & !u64::from(!COPIED), 0);
        assert_eq!(align_of::<Flow6>(), 8);
        assert_eq!(size_of::<FlowSlot>(), 80);
        assert_eq!(size_of::<FlowSlot6>(), 120);
        assert_eq!(align_of::<FlowKey>(), 8);
        assert_eq!(align_of::<FlowKey6>(), 8);
        assert_eq!(size_of::<BackendStats>(), 40);
        assert_eq!(align_of::<BackendStats>(), 8);
    }

    #[test]
    fn a_flow_key_made_from_words_is_the_struct_literal() {
        for (sa, da, sp, dp, proto) in
            [(0x0a00_0001, 0x0a0a_0064, 40_000, 80, 6), (u32::MAX, 1, u16::MAX, 1, 17), (0, 0, 0, 0, 0)]
        {
            let literal = FlowKey { src_addr: sa, dst_addr: da, src_port: sp, dst_port: dp, proto, _pad: [0; 3] };
            assert_eq!(FlowKey::new(sa, da, sp, dp, proto), literal);
            assert_eq!(FlowKey::new(sa, da, sp, dp, proto).reply(), literal.reply());
        }
    }

    #[test]
    fn an_ipv6_flow_key_written_in_place_is_the_struct_literal() {
        let a = [0x0000_00fd_u32.to_be(), 1, 2, 0x6400_0000];
        let b = [u32::MAX, 0, 0x1234_5678, 1];
        for (sa, da, sp, dp, proto, mark) in
            [(a, b, 40_000, 80, 6, 0), (b, a, u16::MAX, 1, 17, KEY_REPLY), ([0; 4], [0; 4], 0, 0, 0, 0)]
        {
            let literal =
                FlowKey6 { src_addr: sa, dst_addr: da, src_port: sp, dst_port: dp, proto, _pad: [mark, 0, 0] };
            // Over a key of other bytes: every byte is written.
            let mut key =
                FlowKey6 { src_addr: [7; 4], dst_addr: [9; 4], src_port: 3, dst_port: 4, proto: 5, _pad: [6; 3] };
            // SAFETY: a valid, aligned key; the addresses are arrays.
            unsafe { FlowKey6::write(&raw mut key, &raw const sa, &raw const da, sp, dp, proto, mark) };
            assert_eq!(key, literal);
            let mut addr = [5u32; 4];
            // SAFETY: two valid arrays.
            unsafe { copy_addr6(&raw mut addr, &raw const sa) };
            assert_eq!(addr, sa);
        }
    }

    #[test]
    fn flow_slots_are_twice_conntrack_max_to_a_power_of_two() {
        assert_eq!(flow_slots(0), 16);
        assert_eq!(flow_slots(1), 16);
        assert_eq!(flow_slots(8), 16);
        assert_eq!(flow_slots(9), 32);
        assert_eq!(flow_slots(16), 32);
        assert_eq!(flow_slots(1_000_000), 1 << 21);
        assert_eq!(flow_slots(1 << 20), 1 << 21);
        assert_eq!(flow_slots(u32::MAX), 1 << 30);
    }

    #[test]
    fn slot_keys_hash_and_compare_every_field() {
        let k = FlowKey { src_addr: 1, dst_addr: 2, src_port: 3, dst_port: 4, proto: 6, _pad: [0; 3] };
        let others = [
            FlowKey { src_addr: 9, ..k },
            FlowKey { dst_addr: 9, ..k },
            FlowKey { src_port: 9, ..k },
            FlowKey { dst_port: 9, ..k },
            FlowKey { proto: 17, ..k },
        ];
        assert!(k.same(&{ k }));
        for o in others {
            assert!(!k.same(&o), "{o:?}");
            assert_ne!(k.slot_hash(0), o.slot_hash(0), "{o:?}");
            assert_ne!(k.slot_hash(0) >> 32, o.slot_hash(0) >> 32, "tag of {o:?}");
        }
        let k6 = FlowKey6 {
            src_addr: [1, 2, 3, 4],
            dst_addr: [5, 6, 7, 8],
            src_port: 1,
            dst_port: 2,
            proto: 6,
            _pad: [0; 3],
        };
        for i in 0..4 {
            let mut a = k6;
            a.src_addr[i] ^= 1;
            let mut b = k6;
            b.dst_addr[i] ^= 1;
            for o in
                [a, b, FlowKey6 { src_port: 9, ..k6 }, FlowKey6 { dst_port: 9, ..k6 }, FlowKey6 { proto: 17, ..k6 }]
            {
                assert!(!k6.same(&o), "{o:?}");
                assert_ne!(k6.slot_hash(0), o.slot_hash(0), "{o:?}");
            }
        }
        assert!(k6.same(&{ k6 }));
        // The mark is part of the key: a reply key is never the forward
        // key of the same 5-tuple, nor has its tag.
        assert!(!k.same(&k.reply()) && !k6.same(&k6.reply()));
        assert_ne!(k.slot_hash(0) >> 32, k.reply().slot_hash(0) >> 32);
        assert_ne!(k6.slot_hash(0) >> 32, k6.reply().slot_hash(0) >> 32);
    }

    /// A flow's forward key (client -> VIP) and its reply key (backend ->
    /// client, marked) start at the same slot under any seed, with
    /// different tags; another client's do not share that start.
    #[test]
    fn a_flows_forward_and_reply_keys_start_at_one_slot() {
        let (client, cport, vip, backend) = (0x0a00_0001, 40_000, 0x0a00_0063, 0x0a00_020b);
        let fwd = FlowKey { src_addr: client, dst_addr: vip, src_port: cport, dst_port: 80, proto: 6, _pad: [0; 3] };
        let rev =
            FlowKey { src_addr: backend, dst_addr: client, src_port: 8080, dst_port: cport, proto: 6, _pad: [0; 3] }
                .reply();
        let fwd6 = FlowKey6 {
            src_addr: [1, 2, 3, 4],
            dst_addr: [9, 9, 9, 9],
            src_port: cport,
            dst_port: 80,
            proto: 6,
            _pad: [0; 3],
        };
        let rev6 = FlowKey6 {
            src_addr: [5, 6, 7, 8],
            dst_addr: [1, 2, 3, 4],
            src_port: 8080,
            dst_port: cport,
            proto: 6,
            _pad: [0; 3],
        }
        .reply();
        for seed in [0, 1, 0x5eed_1234_9876_abcd] {
            let (f, r) = (fwd.slot_hash(seed), rev.slot_hash(seed));
            assert_eq!(f as u32, r as u32, "seed {seed:#x}: the reply entry starts elsewhere");
            assert_ne!(f >> 32, r >> 32, "seed {seed:#x}: one tag for both");
            let (f6, r6) = (fwd6.slot_hash(seed), rev6.slot_hash(seed));
            assert_eq!(f6 as u32, r6 as u32, "seed {seed:#x}: the IPv6 reply entry starts elsewhere");
            assert_ne!(f6 >> 32, r6 >> 32);
            // Unmarked, the backend's 5-tuple is a key of the backend's
            // own side: another start.
            let plain = FlowKey { _pad: [0; 3], ..rev };
            assert_ne!(plain.slot_hash(seed) as u32, f as u32);
            let other = FlowKey { src_port: cport + 1, ..fwd };
            assert_ne!(other.slot_hash(seed) as u32, f as u32);
        }
    }

    /// Consecutive client ports (what a busy client sends) spread over a
    /// table's slots: no slot of a 2^16-slot table gets more than a few
    /// of 32,768 such flows.
    #[test]
    fn slot_hash_spreads_consecutive_ports() {
        let mut hits = [0u8; 1 << 16];
        for port in 0..32_768u16 {
            let k = FlowKey {
                src_addr: 0x0a00_0001,
                dst_addr: 0x0a00_0002,
                src_port: port,
                dst_port: 80,
                proto: 6,
                _pad: [0; 3],
            };
            hits[(k.slot_hash(0x5eed) as u32 & 0xffff) as usize] += 1;
        }
        assert!(*hits.iter().max().unwrap() <= 8, "max {}", hits.iter().max().unwrap());
    }

    /// Flows aimed at one probe sequence under one seed (what a client
    /// that knows the hash could send: 64 tuples with the same first slot
    /// of a 2^16-slot table under seed 0) are spread by another: under
    /// seed 1 or a random-looking seed, no run of [`SLOT_PROBES`] slots
    /// is the first slot of more than 3 of them, and their tags differ.
    #[test]
    fn slot_hash_under_another_seed_spreads_tuples_aimed_at_one_slot() {
        let mask = (1u32 << 16) - 1;
        let key = |src_addr: u32, src_port: u16| FlowKey {
            src_addr,
            dst_addr: 0x0a0a_0064,
            src_port,
            dst_port: 80,
            proto: 6,
            _pad: [0; 3],
        };
        let target = key(0x0a0a_0101, 1).slot_hash(0) as u32 & mask;
        let mut aimed = [key(0, 0); 64];
        let mut n = 0;
        'search: for addr in 0x0a0a_0101..0x0a0a_01ffu32 {
            for port in 1..=u16::MAX {
                let k = key(addr, port);
                if k.slot_hash(0) as u32 & mask == target {
                    aimed[n] = k;
                    n += 1;
                    if n == aimed.len() {
                        break 'search;
                    }
                }
            }
        }
        assert_eq!(n, 64);
        for seed in [1u64, 0x9c4f_1d2e_73a8_b605] {
            let homes = aimed.map(|k| k.slot_hash(seed) as u32 & mask);
            let crowd = homes
                .iter()
                .map(|&start| homes.iter().filter(|&&h| h.wrapping_sub(start) & mask < SLOT_PROBES).count())
                .max()
                .unwrap();
            assert!(crowd <= 3, "seed {seed:#x}: {crowd} of the 64 start in one run of {SLOT_PROBES} slots");
            assert!(aimed.iter().all(|k| k.slot_hash(seed) >> 32 != k.slot_hash(0) >> 32));
        }
    }

    #[test]
    fn flow_hash_depends_on_every_field() {
        let base = flow_hash(1, 2, 3, 4, 6);
        assert_ne!(base, flow_hash(9, 2, 3, 4, 6));
        assert_ne!(base, flow_hash(1, 9, 3, 4, 6));
        assert_ne!(base, flow_hash(1, 2, 9, 4, 6));
        assert_ne!(base, flow_hash(1, 2, 3, 9, 6));
        assert_ne!(base, flow_hash(1, 2, 3, 4, 17));
        // swapping the ports is a different flow
        assert_ne!(base, flow_hash(1, 2, 4, 3, 6));
    }

    #[test]
    fn flow_hash_spreads_sequential_ports_evenly() {
        // 30,000 flows from consecutive source ports into 3 buckets: each
        // bucket within 3% of a third.
        let mut buckets = [0u32; 3];
        for port in 20_000u16..50_000 {
            let h = flow_hash(0x0a0a_0102, 0x0a0a_0064, port.to_be(), 80u16.to_be(), 6);
            buckets[(h % 3) as usize] += 1;
        }
        for b in buckets {
            assert!((9_700..=10_300).contains(&b), "uneven buckets {buckets:?}");
        }
    }
}

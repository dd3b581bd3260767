//! The XDP load balancer. Reads top to bottom:
//! parse -> (from a backend: its flow, found through the endpoint map) ->
//! flow table -> (new flow: find VIP -> pick backend) -> rewrite -> count ->
//! next hop.
#![no_std]
#![no_main]
// Atomic read-modify-write on map values: core's atomic types have no RMW
// methods on the BPF target, the intrinsics lower to BPF atomic instructions.
#![feature(core_intrinsics, asm_experimental_arch)]
#![expect(internal_features, reason = "core_intrinsics gives the atomic RMW intrinsics the BPF target needs")]
// Map keys are passed by reference on purpose: a by-value key is one more
// copy on the 512-byte BPF stack.
#![expect(clippy::needless_borrows_for_generic_args, reason = "keys by reference keep them off the BPF stack")]

mod forward;
mod icmp;
mod maps;
mod parse;
mod select;
mod stats;
mod sweep;
mod table;
mod v6;

use core::intrinsics::{AtomicOrdering, atomic_and, atomic_cxchg, atomic_or};

use aya_ebpf::helpers::generated::{bpf_jiffies64, bpf_ktime_get_coarse_ns};

use aya_ebpf::{
    bindings::xdp_action,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use aya_log_ebpf::debug;
use forward::Hop;
use forward::Way;
use lb_common::{
    BACKEND_F_DOWN, BACKEND_NONE, ClockCache, DIR_DSR, DIR_FLOW, DIR_FORWARD, DIR_REPLY, DIR_RETIRED, EndpointKey,
    FLOW_CONNS_CPU, FLOW_COPY, FLOW_DOOMED, FLOW_ESTABLISHED, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REOPENED,
    FLOW_REPLIED, FLOW_RST, Flow, FlowKey, HOLD_NEW, PROTO_TCP, SVC_F_DSR, SVC_F_REPLY_ENTRY, Service, VipKey,
    addr_filter_bit, counter, flow_closed,
};
use maps::{ADDR_BITMAP, BACKENDS, CLOCK, ENDPOINTS, FLOOD, NEW_FLOW_RATE, REPLY_HINT, SCRATCH, VIP_ADDRS, VIPS};
use parse::{Packet, ParseError, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

// Always inlined into the section's entry point (the macro's outer
// function): LLVM's heuristic stopped doing so when the SYN's reply-entry
// hint was added, which put a BPF-to-BPF call before every packet.
#[xdp]
#[inline(always)]
pub(crate) fn lb_xdp(ctx: XdpContext) -> u32 {
    match try_lb::<{ parse::ETH_HLEN }>(&ctx) {
        Ok(action) => action,
        // Anything we cannot judge belongs to the kernel.
        Err(()) => xdp_action::XDP_PASS,
    }
}

/// lbd's tc ingress program, beside the XDP program on each interface: a
/// GSO packet of a DSR service, which the XDP program handed on with its
/// egress in the metadata, is redirected there as an skb (see
/// `forward::to_tc`); every other packet passes untouched.
#[classifier]
pub(crate) fn lb_tc(ctx: TcContext) -> i32 {
    forward::tc_handoff(&ctx)
}

/// IPv4 in one VLAN tag: the same path, its IPv4 header at byte 18, every
/// rewritten packet handed to the kernel with its tag (see `tagged`).
#[xdp]
pub(crate) fn lb_vlan(ctx: XdpContext) -> u32 {
    try_lb::<{ parse::VLAN_HLEN }>(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

/// IPv4 in two VLAN tags (QinQ), as `lb_vlan`.
#[xdp]
pub(crate) fn lb_qinq(ctx: XdpContext) -> u32 {
    try_lb::<{ parse::QINQ_HLEN }>(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

/// Whether the IPv4 header starts past VLAN tags. A tagged packet is
/// rewritten in place, tags and all, and handed to the kernel's
/// forwarding path: the egress may be another VLAN, which only the kernel
/// knows (the FIB answers a device, a VLAN device cannot take an XDP
/// redirect, and the frame's own tag would be wrong there).
#[inline(always)]
const fn tagged(l2: usize) -> bool {
    l2 != parse::ETH_HLEN
}

// Always inlined: it holds the tail calls to the tagged programs, which
// the verifier refuses in a BPF-to-BPF function returning anything but an
// int (LLVM's own heuristic stopped inlining it into `lb_xdp` when the
// SYN's reply-entry hint was added).
#[inline(always)]
fn try_lb<const L2: usize>(ctx: &XdpContext) -> Result<u32, ()> {
    if !tagged(L2) {
        match parse::first_look(ctx) {
            parse::Look::NotOurs => return Ok(xdp_action::XDP_PASS),
            // IPv6 has a program of its own (`v6.rs`): the verifier checks
            // each family's path once, and IPv4 pays for no IPv6 code.
            parse::Look::V6 => {
                // SAFETY: a tail call with this program's own context; when
                // the slot is empty (lbd has not filled it yet) it returns
                // and the packet goes to the kernel.
                unsafe { maps::tail_call::<{ lb_common::PROG_V6 }>(ctx) };
                return Ok(xdp_action::XDP_PASS);
            }
            parse::Look::Other => {}
        }
    }
    let pkt = match parse::parse::<L2>(ctx) {
        Ok(pkt) => pkt,
        Err(ParseError::NotOurs) => {
            if tagged(L2) {
                return Ok(xdp_action::XDP_PASS);
            }
            if parse::is_icmp4(ctx) {
                // SAFETY: a tail call with this program's own context
                // (ICMP errors about balanced flows); when the slot is
                // empty it returns and the packet goes to the kernel.
                unsafe { maps::tail_call::<{ lb_common::PROG_ICMP }>(ctx) };
            } else {
                // IPv4 in VLAN tags: one call site per slot, each with its
                // constant key (see `maps::tail_call`).
                match parse::vlan_slot(ctx) {
                    // SAFETY: as above.
                    Some(lb_common::PROG_VLAN) => unsafe { maps::tail_call::<{ lb_common::PROG_VLAN }>(ctx) },
                    // SAFETY: as above.
                    Some(lb_common::PROG_QINQ) => unsafe { maps::tail_call::<{ lb_common::PROG_QINQ }>(ctx) },
                    _ => {}
                }
            }
            return Ok(xdp_action::XDP_PASS);
        }
        Err(ParseError::Malformed { daddr }) => {
            return Ok(drop_if_vip(ctx, daddr, counter::DROP_MALFORMED));
        }
        Err(ParseError::Fragment { daddr }) => {
            return Ok(drop_if_vip(ctx, daddr, counter::DROP_FRAGMENT));
        }
    };

    // Neither to a VIP nor from a backend: not ours, skip the maps. An
    // untagged frame that `parse` takes is IPv4 TCP or UDP, so
    // `first_look` found one of its two bits set: only the source's
    // is read again. (Keeping that check's result instead costs more: a
    // value alive across `parse` multiplies the verifier's states.)
    let from_backend = maybe_ours(pkt.saddr);
    if tagged(L2) && !from_backend && !maybe_ours(pkt.daddr) {
        return Ok(xdp_action::XDP_PASS);
    }
    if !parse::ip_checksum_ok::<L2>(ctx, &pkt) {
        return Ok(drop_if_vip(ctx, pkt.daddr, counter::DROP_MALFORMED));
    }

    // The packet's flow-table key, written before the clock's read: made
    // after it, LLVM kept one of its words in a register it spilled
    // undefined on the clock's slow path, which the verifier refuses.
    let mut key = FlowKey::new(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto);
    let now = now_secs();
    // Where the packet goes. One call site each for `forward` and `reply`
    // (both inlined): the paths to them share one stack frame.
    let mut to = None;
    // Set when the packet comes from a backend endpoint and the client's
    // flow towards its VIP has no entry at all: it may go back without one.
    let mut no_flow = false;
    if from_backend && let Some(vip) = endpoint_vip(&pkt) {
        to = reply_of_flow(&pkt, vip, &mut no_flow);
    }
    // The lookup's answer: the entry's slot, or the slot a new entry
    // takes, which the insert of a new flow then takes without probing
    // again.
    let mut hint = table::NO_SLOT;
    if to.is_none() {
        // A packet from a backend's address: its reply entry's first
        // (see `lb_packet_flow_slot`). A reply entry's match never leads
        // to a new flow, so the key a new flow is inserted by is the
        // packet's own, unmarked. A SYN to a VIP whose new flows take two
        // entries side by side loads the second slot with the first.
        let opening = if is_syn(&pkt) && reply_hint(pkt.daddr, pkt.dport) { table::PACKET_OPENING } else { 0 };
        let from = if from_backend { table::PACKET_FROM_BACKEND } else { 0 };
        hint = table::lb_packet_flow_slot(&raw mut key, from | opening);
        if let Some(flow) = table::flow_at(hint) {
            if is_syn(&pkt) && syn_held(state_of(flow), now) {
                return Ok(xdp_action::XDP_DROP);
            }
            to = known_flow(&pkt, flow, now);
        }
    }
    let to = match to {
        Some(to) => to,
        None => {
            let vip = VipKey { addr: pkt.daddr, port: pkt.dport, proto: pkt.proto, _pad: 0 };
            // SAFETY: the value is copied before anything can replace it.
            match (unsafe { VIPS.get(&vip) }).copied() {
                Some(svc) => match new_flow(&pkt, &key, &svc, now, hint) {
                    Ok(nat) if svc.flags & SVC_F_DSR != 0 => To::Dsr(nat),
                    Ok(nat) => To::Backend(nat),
                    Err(action) => return Ok(action),
                },
                // A backend's packet whose flow has no entry (routed
                // without one, or expired): back to the client as from
                // the VIP its endpoint names, by the FIB each time. A
                // call site of its own, with no next-hop cache: joined
                // with the flows' replies, the verifier would explore
                // those (the larger part) once with a cache and once
                // without.
                None if no_flow => match stateless_reply(ctx, &pkt) {
                    Some(nat) => return Ok(reply::<L2>(ctx, &pkt, nat, Hop::Uncached, now)),
                    None => return Ok(xdp_action::XDP_PASS),
                },
                None if from_backend => return Ok(stale_or_pass(ctx, &pkt)),
                None => return Ok(xdp_action::XDP_PASS),
            }
        }
    };
    Ok(match to {
        To::Backend(nat) => forward::<L2>(ctx, &pkt, nat, now),
        To::Dsr(nat) => dsr::<L2>(ctx, &pkt, nat, now),
        To::Client(nat, entry) => reply::<L2>(ctx, &pkt, nat, Hop::Flow(entry), now),
    })
}

/// A backend's packet whose flow has no entry (routed without one, or
/// expired): back to the client as from the VIP its endpoint names.
/// Looked up again (rare path) rather than kept on the main frame's stack.
/// None for a packet to the gateway itself (its health probes, anything
/// local talking to a backend's service port): the kernel's, untouched.
#[inline(never)]
fn stateless_reply(ctx: &XdpContext, pkt: &Packet) -> Option<Nat> {
    let vip = endpoint_vip(pkt)?;
    if forward::to_gateway(ctx, pkt) {
        return None;
    }
    stats::count(counter::STATELESS_REPLY);
    Some(Nat { backend_id: BACKEND_NONE, addr: vip.addr, port: vip.port })
}

/// A packet from a backend's address that matched nothing else, though
/// its client's flow towards the VIP of its endpoint (if it is one) has
/// an entry. When that entry names another backend (the flow was
/// re-dispatched when this one went down, or the client's tuple opened a
/// new connection since), this backend's late packets belong to no live
/// flow: dropped and counted (`counter::STALE_BACKEND`) rather than
/// passed on to the client with the backend's own address as their
/// source. Anything else (not an endpoint's; a DSR flow's backend, which
/// answers from the VIP; to the gateway itself) is the kernel's,
/// untouched. Looked up again: a rare path, and a value kept from the
/// first lookup for it made LLVM spill a register left undefined, which
/// the verifier refuses.
#[inline(never)]
fn stale_or_pass(ctx: &XdpContext, pkt: &Packet) -> u32 {
    let Some(vip) = endpoint_vip(pkt) else { return xdp_action::XDP_PASS };
    let Some(flow) = table::flow(&client_key(pkt, vip.addr, vip.port)) else { return xdp_action::XDP_PASS };
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, nat) = unsafe { ((*flow).dir, Nat::of(flow)) };
    let its_own = dir != DIR_RETIRED && nat.addr == pkt.saddr && nat.port == pkt.sport;
    if dir == DIR_DSR || its_own || forward::to_gateway(ctx, pkt) {
        return xdp_action::XDP_PASS;
    }
    stats::count(counter::STALE_BACKEND);
    xdp_action::XDP_DROP
}

/// The VIP whose service owns the backend endpoint `pkt` comes from, if
/// it comes from one (`ENDPOINTS`).
#[inline(always)]
fn endpoint_vip(pkt: &Packet) -> Option<VipKey> {
    let ep = EndpointKey { addr: pkt.saddr, port: pkt.sport, proto: pkt.proto, _pad: 0 };
    // SAFETY: the value is copied at once.
    unsafe { ENDPOINTS.get(&ep) }.copied()
}

/// Where a packet of a known flow goes, and its rewrite.
#[derive(Clone, Copy)]
enum To {
    /// Client -> backend (destination rewritten).
    Backend(Nat),
    /// Client -> backend by L2 direct server return (MACs only).
    Dsr(Nat),
    /// Backend -> client (source rewritten to the VIP); the entry whose
    /// next-hop cache serves the reply (the flow's entry or its reply
    /// entry).
    Client(Nat, *mut Flow),
}

/// A packet that matched a flow-table entry by its own 5-tuple. None when
/// the flow is over or its backend is down: the packet is then scheduled
/// as a new flow.
#[inline(always)]
fn known_flow(pkt: &Packet, flow: *mut Flow, now: u64) -> Option<To> {
    // Copy out the fields we need: no reference to the map value is ever
    // held, since this CPU writes it below and others may write it at any
    // time (close bits, timestamp, next-hop cache).
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, nat, last_seen) = unsafe { ((*flow).dir, Nat::of(flow), (*flow).last_seen) };
    if dir == DIR_REPLY {
        reply_entry_seen(pkt, flow, nat);
        return Some(To::Client(nat, flow));
    }
    // `state` is also written with atomic OR by other CPUs. BPF before v4
    // has no atomic load instruction (LLVM cannot select one for v3); an
    // aligned 8-byte load is single-copy atomic on every architecture BPF
    // JITs for, and a volatile read keeps the compiler from tearing or
    // repeating it. A stale value only delays seeing a close by one packet.
    // SAFETY: a valid, aligned u64 inside a map value.
    let state = unsafe { core::ptr::read_volatile(&raw const (*flow).state) };
    // A fresh SYN on a closed flow's tuple is a new connection; a flow
    // whose backend went down is re-dispatched (its next packet, e.g. a
    // retransmission, reaches a live backend, which resets it fast). Its
    // close is counted by the new entry that replaces this one
    // (`table::Entry`), once, or by its expiry if none does.
    let down = backend_down(nat.backend_id);
    // A SYN on it is a new connection, unless it retransmits the entry's
    // own (`resumed`).
    if down
        || (flow_closed(state)
            && (if is_syn(pkt) { !resumed4(pkt, flow, state) } else { pkt.proto == PROTO_TCP && holding(now) }))
    {
        return None;
    }
    if is_syn(pkt) && !flow_closed(state) && !syn_on_open4(pkt, flow, state) {
        return None;
    }
    track_close(state_of(flow), nat.backend_id, pkt.tcp_flags, pkt.proto, FLOW_FIN_CLIENT);
    // The client speaking again after the backend answered completes the
    // handshake (for TCP, with anything but a SYN): from now on the flow
    // is established and only the idle timeout expires it. A DSR flow
    // never sees its backend's answers: the client's first packet other
    // than a SYN (its ACK of the backend's SYN-ACK) says it was answered.
    // A reset completes nothing: a client that resets its own handshake
    // has not established it (see `resumed`).
    let dsr = dir == DIR_DSR;
    let needs = if dsr { 0 } else { FLOW_REPLIED };
    if state & (needs | FLOW_ESTABLISHED) == needs && !is_syn(pkt) && pkt.tcp_flags & TCP_RST == 0 {
        set_state(state_of(flow), FLOW_ESTABLISHED);
    }
    if last_seen != now {
        // SAFETY: a valid map value; a plain store of a timestamp.
        unsafe { (*flow).last_seen = now };
    }
    Some(if dsr { To::Dsr(nat) } else { To::Backend(nat) })
}

/// A packet we could not parse: dropped (and counted) when it was headed
/// for a VIP address, otherwise left to the kernel.
#[inline(always)]
fn drop_if_vip(ctx: &XdpContext, daddr: u32, reason: u32) -> u32 {
    // SAFETY: read-only presence check.
    if unsafe { VIP_ADDRS.get(&daddr) }.is_some() {
        stats::count(reason);
        debug!(ctx, "drop packet to a VIP address, reason {}", reason);
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// False when `addr` is certainly neither a VIP nor a backend.
#[inline(always)]
pub(crate) fn maybe_ours(addr: u32) -> bool {
    filter_has(addr_filter_bit(addr))
}

/// False when both `a` and `b` are certainly neither a VIP nor a backend
/// (`a` is read first).
#[inline(always)]
pub(crate) fn maybe_either_ours(a: u32, b: u32) -> bool {
    filter_has_either(addr_filter_bit(a), addr_filter_bit(b))
}

/// Whether the address filter's bit `bit` is set (either family's).
#[inline(always)]
pub(crate) fn filter_has(bit: u32) -> bool {
    ADDR_BITMAP.get_ptr(0).is_none_or(|f| bit_in(f, bit))
}

/// Whether the address filter has bit `a` or bit `b` set: one lookup for
/// both reads (the pre-checks of a packet's two addresses).
#[inline(always)]
fn filter_has_either(a: u32, b: u32) -> bool {
    ADDR_BITMAP.get_ptr(0).is_none_or(|f| bit_in(f, a) || bit_in(f, b))
}

/// Bit `bit` of the bit set at `f`, a map's one value (the address filter
/// or the reply-entry hint).
#[inline(always)]
pub(crate) fn bit_in<const N: usize>(f: *const [u64; N], bit: u32) -> bool {
    lb_common::bit_is_set(bit, |word| {
        // SAFETY: `f` is the map's one value, valid while the program
        // runs; a plain word read through the pointer (no reference to a
        // value lbd writes), in bounds as both maps' bit functions stay
        // below their sets' sizes (`ADDR_FILTER_BITS`, `REPLY_HINT_BITS`).
        unsafe { (*f)[word] }
    })
}

/// Whether (`addr`, `port`), a TCP SYN's destination, may be a VIP whose
/// service keeps reply entries: its bit in the reply-entry hint
/// (`REPLY_HINT`, see `lb_common::ReplyHint`).
#[inline(always)]
fn reply_hint(addr: u32, port: u16) -> bool {
    REPLY_HINT.get_ptr(0).is_some_and(|h| bit_in(h, lb_common::reply_hint_bit(addr, port)))
}

#[inline(always)]
pub(crate) fn backend_down(id: u32) -> bool {
    match BACKENDS.get(id) {
        Some(b) => b.flags & BACKEND_F_DOWN != 0,
        None => false,
    }
}

#[inline(always)]
fn is_syn(pkt: &Packet) -> bool {
    syn_only(pkt.proto, pkt.tcp_flags)
}

/// A TCP SYN without ACK: a connection's opening.
#[inline(always)]
pub(crate) fn syn_only(proto: u8, tcp_flags: u8) -> bool {
    proto == PROTO_TCP && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// Seconds of the coarse monotonic clock (the flows' idle clock), read
/// once a jiffy per CPU (see `lb_common::ClockCache`).
#[inline(always)]
pub(crate) fn now_secs() -> u64 {
    // SAFETY: plain helper call (inlined by the verifier on 64-bit JITs).
    let jiffies = unsafe { bpf_jiffies64() };
    let Some(c) = CLOCK.get_ptr_mut(0) else {
        return coarse_secs();
    };
    // SAFETY: this CPU's slot of a per-CPU map, which only this program
    // invocation touches while it runs; plain loads and stores.
    unsafe {
        if (*c).valid != 0 && (*c).jiffies == jiffies {
            return (*c).secs;
        }
        let secs = coarse_secs();
        c.write(ClockCache { jiffies, secs, valid: 1, _pad: 0 });
        secs
    }
}

/// Seconds of the coarse monotonic clock, read now.
#[inline(always)]
fn coarse_secs() -> u64 {
    // SAFETY: plain helper call.
    let ns = unsafe { bpf_ktime_get_coarse_ns() };
    ns / 1_000_000_000
}

/// Record a FIN (as `fin_bit`) or RST on a forward flow entry; the packet
/// that closes the flow counts it closed for its backend, exactly once.
#[inline(always)]
pub(crate) fn track_close(state: *mut u64, backend_id: u32, tcp_flags: u8, proto: u8, fin_bit: u64) {
    if proto != PROTO_TCP || tcp_flags & (TCP_FIN | TCP_RST) == 0 {
        return;
    }
    let bit = if tcp_flags & TCP_RST != 0 { FLOW_RST } else { fin_bit };
    // Both directions may run on different CPUs at once: atomic OR, and
    // the old value says whether this packet is the one that closed it.
    // SeqCst: the old value is used, see select.rs on relaxed atomics.
    // SAFETY: a valid, aligned u64 inside a map value.
    let old = unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(state, bit) };
    // Not while the sweeper is removing the entry (`FLOW_DOOMED`): its
    // close is then the sweeper's to count, whether the removal goes
    // through or not (`sweep.rs`, `undoom`).
    if !flow_closed(old) && flow_closed(old | bit) && old & FLOW_DOOMED == 0 {
        stats::flow_closed(backend_id, old);
    }
}

/// A SYN on an entry that a reset closed during its handshake (`seen`, its
/// state as read: reset, never established), whose own SYN's sequence
/// number ended in the same byte (`syn_seq`, `seq`): that SYN's
/// retransmission, the same connection, not a new one. It
/// happens when a backend's TIME_WAIT holds the tuple from an earlier
/// connection (another service's, on a shared backend endpoint): the
/// backend answers the SYN with an ACK of the old connection, the client
/// resets that, and the reset closes the new entry; the client's kernel
/// then sends the SYN again. Taken as new, the connection was counted
/// twice. The entry is taken up again as the half-open flow it is, on its
/// backend: not counted again, active again (the reset counted it
/// closed). A connection that completed its handshake before a reset is
/// never taken for one (a client that aborts its connections with resets
/// and reuses their ports is common). A new connection on a tuple whose
/// handshake was reset has another sequence number, the same low byte
/// once in 256; it goes uncounted then, on the backend the closed entry
/// named. True when the entry is taken up; false too when the sweeper is
/// removing it (`lb_common::FLOW_DOOMED`, in `seen` or set since): the SYN
/// is then a new flow.
#[inline(always)]
pub(crate) fn resumed(state: *mut u64, seen: u64, dir: u8, syn_seq: u8, seq: u8, backend_id: u32) -> bool {
    if seen & (FLOW_RST | FLOW_ESTABLISHED | FLOW_DOOMED) != FLOW_RST
        || syn_seq != seq
        || dir == DIR_RETIRED
        || dir == DIR_REPLY
    {
        return false;
    }
    // Compare-and-swap: when another CPU changed the state since it was
    // read (the same SYN twice at once), that CPU took the entry up; when
    // the sweeper did (`FLOW_DOOMED`), the entry is going, and the SYN is
    // a new connection.
    // SAFETY: a valid, aligned u64 inside a map value.
    // The state starts over but for the count its opening goes to.
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(state, seen, seen & FLOW_CONNS_CPU)
    };
    if won {
        stats::flow_opened(backend_id, seen);
    }
    won || !doomed(state)
}

/// Whether the sweeper is removing the entry whose state word is `state`
/// (`lb_common::FLOW_DOOMED`), read afresh.
#[inline(always)]
fn doomed(state: *const u64) -> bool {
    // SAFETY: a valid, aligned u64 inside a map value (see `known_flow`).
    unsafe { core::ptr::read_volatile(state) & FLOW_DOOMED != 0 }
}

/// [`resumed`] for an IPv4 entry, in a call of its own: the known-flow
/// path's frame keeps no more than it had, its chain of frames being near
/// the verifier's 512 bytes.
#[inline(never)]
fn resumed4(pkt: &Packet, flow: *mut Flow, seen: u64) -> bool {
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, syn_seq, backend_id) = unsafe { ((*flow).dir, (*flow).syn_seq, (*flow).backend_id) };
    resumed(state_of(flow), seen, dir, syn_seq, pkt.seq_lo(), backend_id)
}

/// [`syn_on_open`] for an IPv4 entry, in a call of its own (see
/// `resumed4`).
#[inline(never)]
fn syn_on_open4(pkt: &Packet, flow: *mut Flow, seen: u64) -> bool {
    // SAFETY: a valid, aligned map value; only fields' addresses are taken
    // and an integer loaded.
    let (syn_seq, backend_id) = unsafe { (&raw mut (*flow).syn_seq, (*flow).backend_id) };
    syn_on_open(state_of(flow), seen, syn_seq, pkt.seq_lo(), backend_id)
}

/// A SYN (its sequence number's low byte `seq`) on an entry that is not
/// closed, whose state was read as `seen` (both families). On an
/// established entry it is a new connection on the reused tuple
/// (`reopen`). On a half-open one it is the entry's own SYN retransmitted
/// when its low byte is the one the entry keeps (`syn_seq`), and
/// otherwise a new connection too: the client gave up a handshake the
/// balancer saw no end of (it never sent a reset: an application's
/// connect timeout, a backend that never answered, a SYN-ACK lost) and
/// reused the tuple. Taken for a retransmission, that connection went
/// uncounted. Now it is counted, and its handshake tracked afresh
/// (`renew`). Either way the entry keeps its backend, and from then on
/// keeps the new SYN's byte, so the new connection's own retransmissions
/// are not counted again. A migration's copy (`FLOW_COPY`) is the
/// exception: older layouts kept no byte (0 in the copy), so a SYN on a
/// half-open copy is taken for a retransmission, as before. Once in 256
/// a new connection's SYN has the same byte, and goes uncounted.
///
/// False when the sweeper is removing the entry (`lb_common::FLOW_DOOMED`,
/// in `seen` or set since): nothing was counted, and the SYN is taken up
/// as a new flow.
#[inline(always)]
pub(crate) fn syn_on_open(state: *mut u64, seen: u64, syn_seq: *mut u8, seq: u8, backend_id: u32) -> bool {
    if seen & FLOW_DOOMED != 0 {
        return false;
    }
    if seen & FLOW_ESTABLISHED != 0 {
        if !reopen(state, backend_id) {
            return false;
        }
    } else if seen & FLOW_COPY != 0
        // SAFETY: a byte inside a valid map value.
        || unsafe { *syn_seq } == seq
    {
        return true;
    } else if !renew(state, seen, backend_id) {
        // Another CPU renewed it (the same SYN twice at once), or the
        // sweeper is removing it.
        return !doomed(state);
    }
    // SAFETY: as above; a plain store of a byte. Another CPU taking the
    // same SYN at once writes the same byte.
    unsafe { *syn_seq = seq };
    true
}

/// A new connection on a half-open entry's tuple (see `syn_on_open`): the
/// old handshake is counted closed, the new connection opened and new, and
/// the state starts over, with no answer from the backend yet
/// (`FLOW_REPLIED` is the old connection's). A reopened entry stays
/// reopened (`FLOW_REOPENED`: a forged SYN must not get an idle
/// connection's entry expired early as half-open). Compare-and-swap, as
/// in `resumed`: of two SYNs at once, one counts. True when this one did.
#[inline(always)]
fn renew(state: *mut u64, seen: u64, backend_id: u32) -> bool {
    // SAFETY: a valid, aligned u64 inside a map value.
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            state,
            seen,
            seen & (FLOW_REOPENED | FLOW_CONNS_CPU),
        )
    };
    if won {
        stats::flow_closed(backend_id, seen);
        stats::new_flow(backend_id);
        stats::flow_opened(backend_id, seen);
    }
    won
}

/// A SYN on an entry whose handshake completed and whose close was not
/// seen: the client reused the tuple for a new connection (a DSR flow's
/// close is never seen whole: the backend's FIN takes another path). The
/// new connection keeps the entry's backend, so a forged SYN cannot move a
/// live connection; it is counted as one: the old connection closed, the
/// new one opened and new. Its handshake and close are tracked afresh
/// (`FLOW_REOPENED` in place of the handshake and FIN bits: see there).
/// False, with nothing counted, when the sweeper is removing the entry
/// (`lb_common::FLOW_DOOMED`, kept by the change).
#[inline(always)]
pub(crate) fn reopen(state: *mut u64, backend_id: u32) -> bool {
    // Atomic, as other CPUs OR bits in: the old value says whether a close
    // raced this SYN and was counted already. Between the two, the entry
    // is neither established nor reopened for a few instructions: a sweep
    // that judged it then finds it changed and leaves it.
    // SAFETY: a valid, aligned u64 inside a map value.
    let old = unsafe {
        atomic_and::<u64, u64, { AtomicOrdering::SeqCst }>(state, FLOW_REPLIED | FLOW_CONNS_CPU | FLOW_DOOMED)
    };
    if old & FLOW_DOOMED != 0 {
        return false;
    }
    set_state(state, FLOW_REOPENED);
    if !flow_closed(old) {
        stats::flow_closed(backend_id, old);
    }
    stats::new_flow(backend_id);
    stats::flow_opened(backend_id, old);
    true
}

/// A migration is copying the old datapath's last flows (`Flood::hold_until`).
/// A TCP packet other than a SYN that finds no entry then waits for its
/// retransmission (`new_flow`), and so does one on a closed entry: it may
/// be a later connection's that the old program scheduled on the reused
/// tuple, which the late copy puts in the entry's place, and whose close
/// would be lost on the closed copy (its FIN bits already set there);
/// and so does a SYN on a half-open entry (`syn_held`).
#[inline(always)]
pub(crate) fn holding(now: u64) -> bool {
    FLOOD.get(0).is_some_and(|f| u64::from(f.hold_until & !HOLD_NEW) > now)
}

/// What a packet that would open a flow (it found no entry, or a closed
/// one) may do, from one read of `FLOOD`: None when it is dropped and
/// counted (`counter::HELD`) instead, a TCP packet other than a SYN while
/// a migration copies the old datapath's last flows (`holding`: its
/// retransmission finds the entry), and a SYN too while the program swap
/// is under way (`lb_common::HOLD_NEW`); otherwise this CPU's new-flow
/// rate limit (`flood.new_flow_rate_per_cpu`, 0: none) for `rate_ok`.
#[inline(always)]
pub(crate) fn admit_opening(proto: u8, tcp_flags: u8, now: u64) -> Option<u64> {
    let Some((until, limit)) = FLOOD.get(0).map(|f| (f.hold_until, f.new_flow_rate_per_cpu)) else { return Some(0) };
    let held = proto == PROTO_TCP
        && u64::from(until & !HOLD_NEW) > now
        && (until & HOLD_NEW != 0 || !syn_only(proto, tcp_flags));
    if held {
        stats::count(counter::HELD);
        return None;
    }
    Some(u64::from(limit))
}

/// Whether a SYN on the flow entry whose state word is `state` is dropped
/// and counted (`counter::HELD`), before anything else is decided for it
/// (both families): one whose handshake has not completed (neither
/// established nor closed: a SYN opens a closed entry anew), while a
/// migration copies the old datapath's last flows (`holding`). Outside
/// a migration it is the entry's own connection's retransmission. Now the
/// entry may be a copy that the old program saw complete and close since,
/// the client reusing the tuple: taken as a retransmission, the new
/// connection would go uncounted (and the late copy would close the entry
/// under it). The SYN's retransmission, a second later, finds the entry
/// the late copy left: still half-open (a retransmission, forwarded) or
/// closed (a new connection, scheduled and counted).
#[inline(always)]
pub(crate) fn syn_held(state: *const u64, now: u64) -> bool {
    // SAFETY: a valid, aligned u64 inside a map value (see `known_flow`).
    let state = unsafe { core::ptr::read_volatile(state) };
    let held = state & FLOW_ESTABLISHED == 0 && !flow_closed(state) && holding(now);
    if held {
        stats::count(counter::HELD);
    }
    held
}

/// Set `bit` in a flow entry's state, once (atomic OR: other CPUs write it too).
#[inline(always)]
pub(crate) fn set_state(state: *mut u64, bit: u64) {
    // SAFETY: a valid, aligned u64 inside a map value.
    unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(state, bit) };
}

/// The state word of a flow entry (the one field several CPUs write).
#[inline(always)]
pub(crate) fn state_of(flow: *mut Flow) -> *mut u64 {
    // SAFETY: only the field's address is taken.
    unsafe { &raw mut (*flow).state }
}

/// The direction of a flow entry (see `superseded`).
#[inline(always)]
fn dir_of(flow: *mut Flow) -> *mut u8 {
    // SAFETY: only the field's address is taken.
    unsafe { &raw mut (*flow).dir }
}

// Its own stack frame (flow entry and keys), off the established path; it
// returns what to rewrite, and the caller forwards (so the FIB lookup's
// frame is not stacked on this one).
#[inline(always)]
fn new_flow(pkt: &Packet, key: &FlowKey, svc: &Service, now: u64, hint: u32) -> Result<Nat, u32> {
    let opening = pkt.proto != PROTO_TCP || is_syn(pkt);
    // A migration is copying the old datapath's last flows: a TCP packet
    // of one of them waits for its retransmission rather than be hashed
    // to a backend that may not be the one its SYN went to (and a SYN
    // waits while the swap is under way: `admit_opening`).
    let Some(limit) = admit_opening(pkt.proto, pkt.tcp_flags, now) else {
        return Err(xdp_action::XDP_DROP);
    };
    let reply_entry = svc.flags & SVC_F_REPLY_ENTRY != 0;
    // A flow of a service whose replies need their own entry cannot go
    // without one: it is never rate limited, and dropped when full. Nor
    // is a flow whose tuple still has an entry (`takes_over`).
    if reply_entry || takes_over(hint) || rate_ok(limit, now) {
        // Only a SYN opens a TCP connection; any other TCP packet without
        // an entry belongs to a flow that was routed without one (or whose
        // entry is gone), and gets the stateless answer it had.
        let id = if opening {
            select::pick(svc, select::Tuple::v4(pkt))
        } else {
            select::pick_stateless(svc, select::Tuple::v4(pkt))
        };
        match insert_flow(pkt, key, svc, id, now, hint) {
            Insert::Done(nat) => return Ok(nat),
            Insert::NoBackend => return Err(no_backend()),
            Insert::Held => {
                stats::count(counter::HELD);
                return Err(xdp_action::XDP_DROP);
            }
            Insert::Full if reply_entry => {
                stats::count(counter::DROP_FLOW_TABLE);
                return Err(xdp_action::XDP_DROP);
            }
            Insert::Full => stats::count(counter::TABLE_FULL),
        }
    } else {
        stats::count(counter::FLOOD_RATE);
    }
    // No entry: the consistent-hash answer, the same for every packet of
    // the flow (and for its SYN's retransmissions).
    let id = select::pick_stateless(svc, select::Tuple::v4(pkt));
    match if id == BACKEND_NONE { None } else { BACKENDS.get(id) } {
        Some(b) => {
            // A new connection all the same (its backend accepts it): the
            // new-flow counters keep equal to the connections backends
            // accept. (Not an active flow: nothing tracks its close.)
            if opening {
                stats::new_flow(id);
            }
            Ok(Nat { backend_id: id, addr: b.addr, port: b.port })
        }
        None => Err(no_backend()),
    }
}

#[inline(always)]
pub(crate) fn no_backend() -> u32 {
    stats::count(counter::DROP_NO_BACKEND);
    xdp_action::XDP_DROP
}

/// Whether a new flow takes over its tuple's entry, which the packet's
/// lookup found (`hint`): closed, open on a backend gone down, or one the
/// sweeper is removing (a SYN on any other open entry keeps its backend
/// in place, `syn_on_open`). The rate limit does not apply: the
/// entry's slot is replaced in place, so the table does not grow, and the
/// slot was just read. Routed without an entry instead, the flow would
/// leave the old one in place, and its backend's answers would meet it:
/// a SYN-ACK on a closed entry retires it (`superseded`) and is then
/// dropped as stale, and any answer on an entry naming another backend
/// is dropped as stale (`stale_or_pass`). Each such connection waited for
/// its SYN's retransmission, a second or more, whenever the client's new
/// connections outran the rate limit while reusing ports that still had
/// entries (in the bench's lab, about 15,000 a second per CPU against a
/// limit of 13,107 for a table of 262,144).
#[inline(always)]
pub(crate) fn takes_over(hint: u32) -> bool {
    table::found(hint)
}

/// Whether this CPU may give one more new flow an entry this second
/// (under `limit`, `flood.new_flow_rate_per_cpu` as `admit_opening` read it; 0:
/// no limit); counts it if so.
#[inline(always)]
pub(crate) fn rate_ok(limit: u64, now: u64) -> bool {
    if limit == 0 {
        return true;
    }
    let Some(w) = NEW_FLOW_RATE.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's slot; only this CPU writes it while we run.
    unsafe {
        if (*w).second != now {
            (*w).second = now;
            (*w).count = 0;
        }
        if (*w).count >= limit {
            return false;
        }
        (*w).count += 1;
    }
    true
}

/// What inserting a new flow's entry came to (`N`: the rewrite, of
/// either family).
pub(crate) enum Insert<N> {
    Done(N),
    /// The pick found no backend.
    NoBackend,
    /// The flow table is full.
    Full,
    /// Another CPU is still writing this flow's entry: the packet is
    /// dropped and counted as held (`counter::HELD`).
    Held,
}

/// The close state a flow's entry starts with: a TCP packet that opens
/// the entry with a RST or FIN has already closed (or half-closed) it.
#[inline(always)]
pub(crate) fn opening_state(proto: u8, tcp_flags: u8) -> u64 {
    if proto != PROTO_TCP {
        0
    } else if tcp_flags & TCP_RST != 0 {
        FLOW_RST
    } else if tcp_flags & TCP_FIN != 0 {
        FLOW_FIN_CLIENT
    } else {
        0
    }
}

#[inline(always)]
fn insert_flow(pkt: &Packet, key: &FlowKey, svc: &Service, id: u32, now: u64, hint: u32) -> Insert<Nat> {
    let Some(backend) = (if id == BACKEND_NONE { None } else { BACKENDS.get(id) }) else {
        return Insert::NoBackend;
    };
    let state = opening_state(pkt.proto, pkt.tcp_flags) | stats::conns_class(svc.scheduler);
    // One buffer for both entries, in this CPU's scratch slot rather than
    // on the stack (56 bytes the 512-byte stack has no room for).
    let Some(e) = SCRATCH.get_ptr_mut(0) else {
        return Insert::Full;
    };
    // Zeroed word by word first: a struct literal's MAC arrays compiled
    // to a call of `memset`, a byte loop, on every new flow.
    const { assert!(size_of::<Flow>().is_multiple_of(8) && align_of::<Flow>() >= 8) };
    // SAFETY: this CPU's slot of a per-CPU map, which only this program
    // invocation touches while it runs; plain stores, the words within
    // the (8-aligned) value.
    unsafe {
        let words = e.cast::<u64>();
        for i in 0..size_of::<Flow>() / 8 {
            words.add(i).write_volatile(0);
        }
        (*e).backend_id = id;
        (*e).service_id = svc.service_id;
        (*e).nat_addr = pkt.daddr;
        (*e).nat_port = pkt.dport;
        (*e).dir = DIR_REPLY;
        (*e).syn_seq = pkt.seq_lo();
    }
    let dir = if svc.flags & SVC_F_DSR != 0 {
        DIR_DSR
    } else if svc.flags & SVC_F_REPLY_ENTRY != 0 {
        // The backend's endpoint names another service's VIP: this flow's
        // replies need an entry of their own, inserted first so that once
        // the forward entry exists, replies can come.
        // Its lost swap (`Put::Busy`: often the same flow's entry from
        // another CPU, whose slots start where this one's do) holds the
        // packet: a race, not a full table.
        // SAFETY: see above; the shared reference lives for the call only,
        // and nothing writes the slot meanwhile.
        match table::put_flow(&reply_key(pkt, backend.addr, backend.port), table::NO_SLOT, table::PUT_REPLACE) {
            table::Put::Done => {}
            table::Put::Busy => return Insert::Held,
            _ => return Insert::Full,
        }
        DIR_FORWARD
    } else {
        DIR_FLOW
    };
    // SAFETY: as above.
    unsafe {
        (*e).nat_addr = backend.addr;
        (*e).nat_port = backend.port;
        (*e).dir = dir;
        (*e).state = state;
        (*e).last_seen = now;
    }
    // In place of the entry the lookup found (a new flow taking over its
    // tuple's entry), or in a free slot. Not over an entry that another
    // CPU put in since the lookup: that is this very flow's (its packets
    // on two CPUs at once), which this packet joins, copied into the
    // scratch entry: it goes where that entry says, and that CPU alone
    // counts the flow. (Replacing it counted the flow twice, and under a
    // scheduler whose two picks differ sent its packets to two backends.)
    // When that CPU is still writing the entry, or took the free slot
    // first (`Put::Busy`), the packet is held: dropped, its sender's
    // retransmission finds the entry.
    match table::put_flow(key, hint, table::PUT_JOIN) {
        table::Put::Done => {}
        table::Put::Exists => {
            if dir == DIR_FORWARD {
                joined_reply(pkt, id);
            }
            // SAFETY: this CPU's scratch slot, as above; plain loads.
            return Insert::Done(unsafe { Nat::of(e) });
        }
        put => {
            // The reply entry without its flow would never be swept (the
            // sweeper removes it with its forward entry): taken back, with
            // its room in the table.
            if dir == DIR_FORWARD {
                table::lb_take_back(&reply_key(pkt, backend.addr, backend.port));
            }
            return if put == table::Put::Busy { Insert::Held } else { Insert::Full };
        }
    }
    // A TCP packet other than a SYN that takes an entry belongs to a
    // connection already counted (routed without an entry until now):
    // active from here on, as its close is now tracked, but not new.
    if pkt.proto != PROTO_TCP || is_syn(pkt) {
        stats::new_flow(id);
    }
    stats::flow_opened(id, state);
    if flow_closed(state) {
        stats::flow_closed(id, state);
    }
    Insert::Done(Nat { backend_id: id, addr: backend.addr, port: backend.port })
}

/// A new flow that joined the entry another CPU put in for it (copied
/// into this CPU's scratch entry, `insert_flow`): the reply entry this
/// packet put in for its own pick, backend `id`, taken back, unless it is
/// the joined entry's own (its backend the same, and so its key and
/// value). Its own frame: a rare path, kept off the balancer's main
/// frame (inlined, it took the deepest chain of frames past the
/// verifier's 512 bytes).
#[inline(never)]
fn joined_reply(pkt: &Packet, id: u32) {
    let Some(e) = SCRATCH.get_ptr(0) else { return };
    // SAFETY: this CPU's scratch slot; a plain load.
    if unsafe { (*e).backend_id } == id {
        return;
    }
    if let Some(b) = BACKENDS.get(id) {
        table::lb_take_back(&reply_key(pkt, b.addr, b.port));
    }
}

/// The reply entry's key of a new flow of `pkt` to the backend endpoint
/// (`addr`, `port`): the backend's 5-tuple towards the client, marked as
/// a reply key, so that its slots start where the forward entry's do
/// and its insert finds them already cached.
#[inline(always)]
fn reply_key(pkt: &Packet, addr: u32, port: u16) -> FlowKey {
    FlowKey::new(addr, pkt.saddr, port, pkt.sport, pkt.proto).reply()
}

/// What a packet of a flow gets rewritten to, and whose counters it counts in.
#[derive(Clone, Copy)]
pub struct Nat {
    pub backend_id: u32,
    pub addr: u32,
    pub port: u16,
}

impl Nat {
    /// The rewrite a flow entry names.
    ///
    /// # Safety
    /// `f` points at a valid flow-table value.
    #[inline(always)]
    unsafe fn of(f: *const Flow) -> Self {
        // SAFETY: the caller's promise; plain loads of integers.
        unsafe { Self { backend_id: (*f).backend_id, addr: (*f).nat_addr, port: (*f).nat_port } }
    }
}

/// Client -> backend: destination becomes the backend; the next hop is
/// the backend's.
#[inline(always)]
fn forward<const L2: usize>(ctx: &XdpContext, pkt: &Packet, nat: Nat, now: u64) -> u32 {
    if !forward::ttl_ok(pkt) {
        stats::count(counter::TTL_EXPIRED);
        return xdp_action::XDP_PASS;
    }
    stats::packet_in(nat.backend_id, pkt.len);
    let cs = forward::classify(ctx, pkt);
    let rw = forward::rewrite_dst(pkt, nat.addr, nat.port);
    if tagged(L2) {
        return forward::to_kernel(pkt, rw, cs, counter::VLAN);
    }
    forward::send(ctx, pkt, rw, cs, Hop::Backend { id: nat.backend_id, addr: nat.addr }, now, Way::Forward)
}

/// Client -> backend by L2 direct server return: only the MACs change.
#[inline(always)]
fn dsr<const L2: usize>(ctx: &XdpContext, pkt: &Packet, nat: Nat, now: u64) -> u32 {
    // Direct server return cannot serve a tagged frame: it would leave by
    // XDP redirect, and the backend's VLAN is the kernel's to know.
    if tagged(L2) {
        stats::count(counter::DSR_OFF_LINK);
        return xdp_action::XDP_DROP;
    }
    stats::packet_in(nat.backend_id, pkt.len);
    // Here rather than first thing in `send_dsr`, whose frame, with the
    // calls below it, is exactly at the verifier's 512-byte stack limit.
    forward::finish_for_dsr(ctx, pkt);
    forward::send_dsr(ctx, pkt, nat.backend_id, nat.addr, now)
}

/// A packet from a backend's endpoint, `vip` the service that owns it: a
/// reply when the client's 5-tuple towards `vip` is a one-entry flow on
/// this very backend. Otherwise the packet goes the way of any other (a
/// reply entry, a new flow), or, when that flow has no entry at all
/// (`no_flow` set), back to the client statelessly; when its entry names
/// another backend, it is dropped (`stale_or_pass`).
#[inline(always)]
fn reply_of_flow(pkt: &Packet, vip: VipKey, no_flow: &mut bool) -> Option<To> {
    let Some(flow) = table::flow_inlined(&client_key(pkt, vip.addr, vip.port)) else {
        *no_flow = true;
        return None;
    };
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, nat) = unsafe { ((*flow).dir, Nat::of(flow)) };
    if dir != DIR_FLOW
        || nat.addr != pkt.saddr
        || nat.port != pkt.sport
        || superseded(pkt.proto, pkt.tcp_flags, state_of(flow), dir_of(flow))
    {
        return None;
    }
    mark_replied(state_of(flow));
    track_close(state_of(flow), nat.backend_id, pkt.tcp_flags, pkt.proto, FLOW_FIN_BACKEND);
    Some(To::Client(Nat { backend_id: nat.backend_id, addr: vip.addr, port: vip.port }, flow))
}

/// A SYN-ACK that matches the endpoint owner's flow only after that flow
/// closed: it answers a new connection on the same backend tuple, which
/// a client reusing its address and port opened to another service of
/// the endpoint (a renewed connection of the owner's own would have
/// reopened the entry with its SYN). That flow's reply entry, which the
/// packet's own lookup finds next, says where it and the rest of the new
/// connection's replies go; the closed flow would send them back as from
/// the owner's VIP port, which the client resets. So the closed entry is
/// retired (`DIR_RETIRED`): no later packet of the backend matches it (a
/// late one that matches nothing else is dropped as stale), while the
/// client's own late packets of it (a retransmitted FIN) still go to its
/// backend, as any NAT's would, until the sweeper removes it. Only a
/// SYN-ACK retires: the closed flow's own late replies still go back as
/// the owner's until then.
#[inline(always)]
pub(crate) fn superseded(proto: u8, tcp_flags: u8, state: *mut u64, dir: *mut u8) -> bool {
    if proto != PROTO_TCP || tcp_flags & (TCP_SYN | TCP_ACK) != (TCP_SYN | TCP_ACK) {
        return false;
    }
    // SAFETY: a valid, aligned u64 inside a map value (volatile: other
    // CPUs set its bits).
    if !flow_closed(unsafe { core::ptr::read_volatile(state) }) {
        return false;
    }
    // SAFETY: a field of the same map value; a one-byte store, which other
    // CPUs' plain loads see whole, before or after.
    unsafe { core::ptr::write_volatile(dir, DIR_RETIRED) };
    true
}

/// The backend has answered on this flow entry (set once).
#[inline(always)]
pub(crate) fn mark_replied(state: *mut u64) -> bool {
    // SAFETY: a valid, aligned u64 inside a map value (see known_flow on
    // the volatile read).
    let old = unsafe { core::ptr::read_volatile(state) };
    if old & FLOW_REPLIED != 0 {
        return false;
    }
    set_state(state, FLOW_REPLIED);
    true
}

/// A packet that matched a reply entry (`DIR_REPLY`, whose rewrite `nat`
/// is the VIP): the flow's state lives on the forward entry, the (client,
/// VIP) tuple. Looked up for the first reply and for a FIN or RST only.
#[inline(always)]
fn reply_entry_seen(pkt: &Packet, entry: *mut Flow, nat: Nat) {
    let first = mark_replied(state_of(entry));
    let closing = pkt.proto == PROTO_TCP && pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0;
    if !first && !closing {
        return;
    }
    if let Some(fwd) = table::flow(&client_key(pkt, nat.addr, nat.port)) {
        if first {
            set_state(state_of(fwd), FLOW_REPLIED);
        }
        track_close(state_of(fwd), nat.backend_id, pkt.tcp_flags, pkt.proto, FLOW_FIN_BACKEND);
    }
}

/// The flow-table key of the connection a backend -> client packet
/// answers: the client's 5-tuple towards the VIP (`vip_addr`, `vip_port`).
#[inline(always)]
fn client_key(pkt: &Packet, vip_addr: u32, vip_port: u16) -> FlowKey {
    FlowKey::new(pkt.daddr, vip_addr, pkt.dport, vip_port, pkt.proto)
}

/// Backend -> client: source becomes the VIP again; the next hop is cached
/// where `hop` says (the flow's entry, its reply entry, or nowhere).
#[inline(always)]
fn reply<const L2: usize>(ctx: &XdpContext, pkt: &Packet, nat: Nat, hop: Hop, now: u64) -> u32 {
    if !forward::ttl_ok(pkt) {
        stats::count(counter::TTL_EXPIRED);
        return xdp_action::XDP_PASS;
    }
    // A stateless reply does not know its backend's id.
    if nat.backend_id != BACKEND_NONE {
        stats::packet_out(nat.backend_id, pkt.len);
    }
    let cs = forward::classify(ctx, pkt);
    let rw = forward::rewrite_src(pkt, nat.addr, nat.port);
    if tagged(L2) {
        return forward::to_kernel(pkt, rw, cs, counter::VLAN);
    }
    forward::send(ctx, pkt, rw, cs, hop, now, Way::Reply)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

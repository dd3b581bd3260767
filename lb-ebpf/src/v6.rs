//! The IPv6 path: a program of its own (`lb_xdp6`), reached from `lb_xdp`
//! by a tail call for every IPv6 frame, so that the verifier checks each
//! family's path once and IPv4 packets pay for none of this.
//!
//! It reads like the IPv4 path in `main.rs` (parse -> from a backend: its
//! flow -> flow table -> new flow: VIP -> pick -> rewrite -> next hop),
//! over the IPv6 maps (`VIPS6`, `ENDPOINTS6`, `FLOW_SLOTS6`), sharing the
//! services' selection tables, the backends, the counters and the
//! next-hop caches with IPv4. What differs: no IP header checksum; the
//! hop limit instead of the TTL; a UDP checksum that is never 0;
//! hop-by-hop, routing and destination-options headers skipped (at most
//! `MAX_IPV6_EXT`); fragments dropped (`fragment`) and other extension
//! headers dropped (`ipv6_ext`) when addressed to a VIP.
use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NOT_FWDED, bpf_fib_lookup as FibParams, xdp_action},
    helpers::generated::{bpf_fib_lookup, bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    macros::xdp,
    programs::XdpContext,
};
use lb_common::{
    BACKEND_F_V6, BACKEND_NONE, DIR_DSR, DIR_FLOW, DIR_FORWARD, DIR_REPLY, DIR_RETIRED, FLOW_ESTABLISHED,
    FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_REPLIED, Flow6, FlowKey6, KEY_REPLY, MAX_IPV6_EXT, PROTO_TCP, PROTO_UDP,
    SVC_F_DSR, SVC_F_REPLY_ENTRY, Service, Vip6Key, copy_addr6, counter, flow_closed, fold6,
};
use lb_ebpf::csum;

use crate::{
    admit_opening, backend_down,
    forward::{
        FIB_NO_NEIGH, FIB_OFF_LINK, FIB_OK, FIB_TOO_BIG, Hop, L4Csum, NextHopAddr, ON_LINK, Way, adopt_hop, ask_narrow,
        cached_hop, classify_segment, generic_ingress, gso, gso_fits, leave, segment_sum, segments, set_macs, to_tc,
        widen,
    },
    holding,
    maps::{BACKEND_ADDRS6, BACKENDS, ENDPOINTS6, KEYS6, NETDEV_GEN, SCRATCH6, VIP_ADDRS6, VIPS6},
    no_backend, now_secs, opening_state,
    parse::{ETH_HLEN, ETH_P_IPV6, EthHdr, ICMP6_TOO_BIG, IP6_HLEN, TCP_FIN, TCP_RST, TcpHdr, UdpHdr, ptr_at},
    rate_ok, resumed, select, set_state, stats, syn_held, syn_on_open, syn_only, table, takes_over, track_close,
};

const AF_INET6: u8 = 10;
const NEXT_HOPOPT: u8 = 0;
const NEXT_ROUTING: u8 = 43;
const NEXT_FRAGMENT: u8 = 44;
const NEXT_DSTOPTS: u8 = 60;
const NEXT_ICMPV6: u8 = 58;
/// The smallest MTU IPv6 allows; an ICMPv6 error fits in it.
const IPV6_MIN_MTU: usize = 1280;

#[repr(C)]
pub(crate) struct Ipv6Hdr {
    /// Version, traffic class, flow label (network order).
    pub vtc_flow: u32,
    pub payload_len: u16,
    pub nexthdr: u8,
    pub hop_limit: u8,
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
}

/// Why an IPv6 packet could not be handled (see `parse::ParseError`).
enum ParseError {
    NotOurs,
    /// ICMPv6.
    Icmp,
    Malformed {
        daddr: [u32; 4],
    },
    Fragment {
        daddr: [u32; 4],
    },
    /// An extension header we do not walk.
    Ext {
        daddr: [u32; 4],
    },
}

/// One parsed IPv6 packet. As `parse::Packet`: only [`parse`] makes one,
/// after bounds-checking every header its pointers name.
struct Packet6 {
    eth: *mut EthHdr,
    ip: *mut Ipv6Hdr,
    ports: *mut [u16; 2],
    l4_check: *mut u16,
    proto: u8,
    tcp_flags: u8,
    sport: u16,
    dport: u16,
    /// Frame length, for the byte counters.
    len: u64,
    /// Offset of the L4 header, and the L4 length (header and payload).
    l4_off: usize,
    l4_len: usize,
}

impl Packet6 {
    /// The low byte of a TCP segment's sequence number (0 for UDP), as
    /// `Packet::seq_lo`.
    #[inline(always)]
    fn seq_lo(&self) -> u8 {
        if self.proto != PROTO_TCP {
            return 0;
        }
        // SAFETY: parse() bounds-checked the whole TCP header, which
        // `ports` starts; byte 7 is the sequence number's low byte.
        unsafe { *self.ports.cast::<u8>().add(7) }
    }

    /// The source address, as the packet holds it now (read in place: a
    /// copy would cost the stack 16 bytes).
    #[inline(always)]
    fn saddr(&self) -> [u32; 4] {
        // SAFETY: bounds-checked by parse().
        unsafe { (*self.ip).saddr }
    }

    /// The destination address, as the packet holds it now.
    #[inline(always)]
    fn daddr(&self) -> [u32; 4] {
        // SAFETY: bounds-checked by parse().
        unsafe { (*self.ip).daddr }
    }

    #[inline(always)]
    fn tuple(&self) -> select::Tuple {
        select::Tuple {
            saddr: fold6(&self.saddr()),
            daddr: fold6(&self.daddr()),
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
        }
    }

    #[inline(always)]
    fn is_syn(&self) -> bool {
        syn_only(self.proto, self.tcp_flags)
    }

    /// The IPv6 packet's length (header and payload).
    #[inline(always)]
    fn ip_len(&self) -> u32 {
        (self.l4_off - ETH_HLEN + self.l4_len) as u32
    }
}

#[inline(always)]
fn parse(ctx: &XdpContext) -> Result<Packet6, ParseError> {
    let eth: *mut EthHdr = ptr_at(ctx, 0).ok_or(ParseError::NotOurs)?;
    let ip: *mut Ipv6Hdr = ptr_at(ctx, ETH_HLEN).ok_or(ParseError::NotOurs)?;
    // SAFETY: bounds checked by ptr_at.
    let (vtc, plen, mut next, daddr) =
        unsafe { (u32::from_be((*ip).vtc_flow), u16::from_be((*ip).payload_len) as usize, (*ip).nexthdr, (*ip).daddr) };
    let mut off = ETH_HLEN + IP6_HLEN;
    // Hop-by-hop, routing and destination options: skipped, at most
    // MAX_IPV6_EXT of them (each is 8 * (1 + its length byte) long).
    for _ in 0..MAX_IPV6_EXT {
        if next != NEXT_HOPOPT && next != NEXT_ROUTING && next != NEXT_DSTOPTS {
            break;
        }
        let ext: *mut [u8; 2] = ptr_at(ctx, off).ok_or(ParseError::Malformed { daddr })?;
        // SAFETY: bounds checked by ptr_at.
        let (n, words) = unsafe { ((*ext)[0], (*ext)[1]) };
        next = n;
        off += (usize::from(words) + 1) * 8;
    }
    match next {
        PROTO_TCP | PROTO_UDP => {}
        NEXT_FRAGMENT => return Err(ParseError::Fragment { daddr }),
        // Too many of the ones we walk, or one we do not (AH, ESP,
        // mobility, HIP, shim6, experimental): not balanced.
        NEXT_HOPOPT | NEXT_ROUTING | NEXT_DSTOPTS | 50 | 51 | 135 | 139 | 140 | 253 | 254 => {
            return Err(ParseError::Ext { daddr });
        }
        // ICMPv6 errors (types 1-4) about balanced flows: their own
        // program; neighbour discovery, echo and the rest: the kernel's.
        NEXT_ICMPV6 => return Err(ParseError::Icmp),
        _ => return Err(ParseError::NotOurs),
    }
    if vtc >> 28 != 6 {
        return Err(ParseError::Malformed { daddr });
    }
    // Verifier: the L4 offset goes through a map value, which the verifier
    // does not follow, and comes back as one range whatever number of
    // extension headers the packet had. Otherwise each count would leave
    // a different proven offset, and the rest of the program would be
    // verified once per count. Extension headers beyond the first 457
    // bytes are not walked (the offset is masked to 511: a packet with more
    // fails the checks below, as malformed).
    if off > 0x1ff {
        return Err(ParseError::Ext { daddr });
    }
    let off = opaque(off) & 0x1ff;
    if off < ETH_HLEN + IP6_HLEN {
        return Err(ParseError::Malformed { daddr });
    }
    let proto = next;
    let (ports, sport, dport, tcp_flags, l4_check, hdr_len, udp_len, check) = if proto == PROTO_TCP {
        let tcp: *mut TcpHdr = ptr_at(ctx, off).ok_or(ParseError::Malformed { daddr })?;
        // SAFETY: bounds checked by ptr_at; every field lies inside *tcp.
        unsafe {
            (
                tcp.cast::<[u16; 2]>(),
                (*tcp).sport,
                (*tcp).dport,
                (*tcp).flags,
                &raw mut (*tcp).check,
                ((*tcp).off_res >> 4) as usize * 4,
                0,
                1,
            )
        }
    } else {
        let udp: *mut UdpHdr = ptr_at(ctx, off).ok_or(ParseError::Malformed { daddr })?;
        // SAFETY: bounds checked by ptr_at; every field lies inside *udp.
        unsafe {
            (
                udp.cast::<[u16; 2]>(),
                (*udp).sport,
                (*udp).dport,
                0,
                &raw mut (*udp).check,
                size_of::<UdpHdr>(),
                u16::from_be((*udp).len) as usize,
                (*udp).check,
            )
        }
    };
    let frame_len = ctx.data_end() - ctx.data();
    // The payload holds the extension headers and the L4 header it
    // claims, the frame holds the payload, a UDP length lies between its
    // header and the L4 length, and a UDP checksum is present (IPv6 makes
    // it mandatory).
    let ext_len = off - ETH_HLEN - IP6_HLEN;
    if ETH_HLEN + IP6_HLEN + plen > frame_len || plen < ext_len + hdr_len {
        return Err(ParseError::Malformed { daddr });
    }
    let l4_len = plen - ext_len;
    if (proto == PROTO_TCP && hdr_len < size_of::<TcpHdr>())
        || (proto == PROTO_UDP && (udp_len < size_of::<UdpHdr>() || udp_len > l4_len || check == 0))
    {
        return Err(ParseError::Malformed { daddr });
    }
    Ok(Packet6 { eth, ip, ports, l4_check, proto, tcp_flags, sport, dport, len: frame_len as u64, l4_off: off, l4_len })
}

/// `v`, by way of this CPU's scratch slot: the same number, of which the
/// verifier knows nothing.
#[inline(always)]
fn opaque(v: usize) -> usize {
    match SCRATCH6.get_ptr_mut(0) {
        // SAFETY: this CPU's slot, touched by this invocation only.
        Some(s) => unsafe {
            core::ptr::write_volatile(&raw mut (*s)._pad2, v as u32);
            core::ptr::read_volatile(&raw const (*s)._pad2) as usize
        },
        None => v,
    }
}

#[xdp]
pub(crate) fn lb_xdp6(ctx: XdpContext) -> u32 {
    try_lb(&ctx)
}

/// Where a packet goes (see `main.rs`'s `To`).
#[derive(Clone, Copy)]
enum To {
    Backend(Nat6),
    Dsr(Nat6),
    Client(Nat6, *mut Flow6),
    /// Backend -> client without a flow entry (no next-hop cache).
    Stateless(Nat6),
}

/// What a packet of a flow gets rewritten to, and whose counters it counts in.
#[derive(Clone, Copy)]
pub(crate) struct Nat6 {
    backend_id: u32,
    addr: [u32; 4],
    port: u16,
}

impl Nat6 {
    /// # Safety
    /// `f` points at a valid flow-table value.
    #[inline(always)]
    unsafe fn of(f: *const Flow6) -> Self {
        // SAFETY: the caller's promise; plain loads of integers.
        unsafe { Self { backend_id: (*f).backend_id, addr: (*f).nat_addr, port: (*f).nat_port } }
    }
}

#[inline(always)]
fn try_lb(ctx: &XdpContext) -> u32 {
    let pkt = match parse(ctx) {
        Ok(pkt) => pkt,
        Err(ParseError::NotOurs) => return xdp_action::XDP_PASS,
        Err(ParseError::Icmp) => {
            // SAFETY: a tail call with this program's context; returns
            // only if the slot is empty.
            unsafe { crate::maps::tail_call::<{ lb_common::PROG_ICMP6 }>(ctx) };
            return xdp_action::XDP_PASS;
        }
        Err(ParseError::Malformed { daddr }) => return drop_if_vip(daddr, counter::DROP_MALFORMED),
        Err(ParseError::Fragment { daddr }) => return drop_if_vip(daddr, counter::DROP_FRAGMENT),
        Err(ParseError::Ext { daddr }) => return drop_if_vip(daddr, counter::IPV6_EXT),
    };
    let from_backend = maybe_ours6(&pkt.saddr());
    if !from_backend && !maybe_ours6(&pkt.daddr()) {
        return xdp_action::XDP_PASS;
    }
    // The keys live in this CPU's scratch slot, not on the stack (see
    // `Keys6`).
    let Some(k) = KEYS6.get_ptr_mut(0) else {
        return xdp_action::XDP_PASS;
    };
    let now = now_secs();
    let mut to = None;
    let mut no_flow = false;
    if from_backend {
        // SAFETY: this CPU's slot, touched by this invocation only; the
        // shared reference lives for the lookup only.
        // Addresses copied word by word (see `copy_addr6`).
        let found = unsafe {
            set_vip_key(k, &raw const (*pkt.ip).saddr, pkt.sport, pkt.proto);
            match ENDPOINTS6.get_ptr(&(*k).vip) {
                Some(vip) => {
                    set_vip_key(k, &raw const (*vip).addr, (*vip).port, (*vip).proto);
                    true
                }
                None => false,
            }
        };
        if found {
            to = reply_of_flow(&pkt, k, &mut no_flow);
        }
    }
    // SAFETY: as above; the addresses were bounds-checked by parse().
    // Written in place, word by word (see `FlowKey6::write`). A backend's
    // packet: its reply entry's first (as for IPv4).
    unsafe {
        let mark = if from_backend { KEY_REPLY } else { 0 };
        let ip = pkt.ip;
        FlowKey6::write(
            &raw mut (*k).flow,
            &raw const (*ip).saddr,
            &raw const (*ip).daddr,
            pkt.sport,
            pkt.dport,
            pkt.proto,
            mark,
        );
    }
    // The lookup's answer, kept for a new flow's insert (as for IPv4).
    // SAFETY: as above; a plain store.
    unsafe { (*k).hint = table::NO_SLOT };
    if to.is_none() {
        // SAFETY: as above; the reference lives for the call only.
        // SAFETY: as above; the key is written in place.
        let at = table::lb_packet_flow_slot6(unsafe { &raw mut (*k).flow });
        // SAFETY: as above.
        unsafe { (*k).hint = at };
        if let Some(flow) = table::flow6_at(at) {
            if pkt.is_syn() && syn_held(state_of(flow), now) {
                return xdp_action::XDP_DROP;
            }
            to = known_flow(&pkt, flow, k, now);
        }
    }
    let to = match to {
        Some(to) => to,
        None => {
            match find_service(&pkt, k) {
                true => match new_flow(&pkt, k, now) {
                    // SAFETY: as above; a plain load.
                    Ok(nat) if unsafe { (*k).svc.flags } & SVC_F_DSR != 0 => To::Dsr(nat),
                    Ok(nat) => To::Backend(nat),
                    Err(action) => return action,
                },
                false if no_flow => match stateless_reply(ctx, &pkt) {
                    Some(nat) => To::Stateless(nat),
                    None => return xdp_action::XDP_PASS,
                },
                false if from_backend => return stale_or_pass(ctx, &pkt, k),
                false => return xdp_action::XDP_PASS,
            }
        }
    };
    transmit(ctx, &pkt, &to, now)
}

/// Write a VIP or endpoint key into the scratch slot's `vip`, its address
/// word by word (see `copy_addr6`).
///
/// # Safety
/// `k` is this CPU's scratch slot; `addr` as `copy_addr6` asks, and not
/// inside `(*k).vip`'s address unless it is that address.
#[inline(always)]
unsafe fn set_vip_key(k: *mut Keys6, addr: *const [u32; 4], port: u16, proto: u8) {
    // SAFETY: the caller's promise.
    unsafe {
        copy_addr6(&raw mut (*k).vip.addr, addr);
        (*k).vip.port = port;
        (*k).vip.proto = proto;
        (*k).vip._pad = 0;
    }
}

/// The service of the packet's VIP, copied into the scratch slot (off
/// the stack) before anything can replace it; false when the packet is
/// not to a VIP. A frame of its own: inlined, its word copies took
/// registers from the established path's (6 ns more per packet there).
#[inline(never)]
fn find_service(pkt: &Packet6, k: *mut Keys6) -> bool {
    // SAFETY: this CPU's scratch slot (see try_lb); the packet's address
    // was bounds-checked by parse(); word by word (see `copy_addr6`,
    // `table::copy_words`).
    unsafe {
        set_vip_key(k, &raw const (*pkt.ip).daddr, pkt.dport, pkt.proto);
        match VIPS6.get_ptr(&(*k).vip) {
            Some(svc) => {
                // 32-bit words: `Service` is 4-aligned.
                table::copy_words::<_, u32>(&raw mut (*k).svc, svc);
                true
            }
            None => false,
        }
    }
}

/// Rewrite and send the packet where `to` says. Its own frame: the
/// rewrite's and the next hop's locals would not fit beside the lookups'
/// in one 512-byte stack with a new flow's frame on top.
#[inline(never)]
fn transmit(ctx: &XdpContext, pkt: &Packet6, to: &To, now: u64) -> u32 {
    if let To::Dsr(nat) = *to {
        return dsr(ctx, pkt, nat, now);
    }
    // One call site for the checksum's classification.
    let cs = classify(ctx, pkt);
    match *to {
        To::Backend(nat) => forward(ctx, pkt, nat, cs, now),
        To::Client(nat, entry) => reply(ctx, pkt, nat, cs, Hop::Flow6(entry), now),
        To::Stateless(nat) => reply(ctx, pkt, nat, cs, Hop::Uncached, now),
        To::Dsr(_) => xdp_action::XDP_PASS,
    }
}

/// An IPv6 TCP or UDP packet (no extension headers) neither to nor from an
/// address of ours: what this program would pass untouched, told by the
/// IPv4 program before its tail call here, which then costs nothing. The
/// address filter's bits are the ones `try_lb` reads.
#[inline(always)]
pub(crate) fn surely_not_ours(ctx: &XdpContext) -> bool {
    // The filter's lookup before the packet's reads: read first, the
    // eight address words had to live on the stack across the lookup's
    // call (six stores and six loads more per packet; IPv4's two words
    // stay in registers). What that saves is below lb-bench's noise here
    // (three alternating pairs of runs, December 2026).
    let Some(f) = crate::maps::ADDR_BITMAP.get_ptr(0) else {
        return false;
    };
    let Some(ip) = ptr_at::<Ipv6Hdr>(ctx, ETH_HLEN) else {
        return false;
    };
    // SAFETY: bounds checked by ptr_at; plain loads of integers.
    let (next, saddr, daddr) = unsafe { ((*ip).nexthdr, (*ip).saddr, (*ip).daddr) };
    (next == PROTO_TCP || next == PROTO_UDP)
        && !crate::bit_in(f, lb_common::addr_filter_bit6(&saddr))
        && !crate::bit_in(f, lb_common::addr_filter_bit6(&daddr))
}

/// False when `addr` is certainly neither a VIP nor a backend (see
/// `main.rs`'s `maybe_ours`).
#[inline(always)]
fn maybe_ours6(addr: &[u32; 4]) -> bool {
    crate::filter_has(lb_common::addr_filter_bit6(addr))
}

/// A packet we could not parse: dropped (and counted) when it was headed
/// for a VIP address, otherwise left to the kernel.
#[inline(always)]
fn drop_if_vip(daddr: [u32; 4], reason: u32) -> u32 {
    // SAFETY: read-only presence check.
    if unsafe { VIP_ADDRS6.get(&daddr) }.is_some() {
        stats::count(reason);
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// A backend's packet whose flow has no entry: back to the client as from
/// the VIP its endpoint names (see `main.rs`).
#[inline(never)]
fn stateless_reply(ctx: &XdpContext, pkt: &Packet6) -> Option<Nat6> {
    let vip = endpoint_vip(pkt)?;
    if to_gateway(ctx, pkt) {
        return None;
    }
    stats::count(counter::STATELESS_REPLY);
    Some(Nat6 { backend_id: BACKEND_NONE, addr: vip.addr, port: vip.port })
}

/// A packet from a backend's address that matched nothing else, though
/// its client's flow towards the VIP of its endpoint has an entry: dropped
/// when that entry names another backend, otherwise the kernel's (see
/// `main.rs`'s `stale_or_pass`).
#[inline(never)]
fn stale_or_pass(ctx: &XdpContext, pkt: &Packet6, k: *mut Keys6) -> u32 {
    let Some(vip) = endpoint_vip(pkt) else { return xdp_action::XDP_PASS };
    let Some(flow) = table::flow6(client_key(pkt, k, &vip.addr, vip.port)) else { return xdp_action::XDP_PASS };
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, nat) = unsafe { ((*flow).dir, Nat6::of(flow)) };
    let its_own = dir != DIR_RETIRED && nat.addr == pkt.saddr() && nat.port == pkt.sport;
    if dir == DIR_DSR || its_own || to_gateway(ctx, pkt) {
        return xdp_action::XDP_PASS;
    }
    stats::count(counter::STALE_BACKEND);
    xdp_action::XDP_DROP
}

/// The VIP whose service owns the backend endpoint `pkt` comes from, if
/// it comes from one (`ENDPOINTS6`; `try_lb` looks it up into its scratch
/// slot instead, for its stack's sake).
#[inline(always)]
fn endpoint_vip(pkt: &Packet6) -> Option<Vip6Key> {
    let ep = Vip6Key { addr: pkt.saddr(), port: pkt.sport, proto: pkt.proto, _pad: 0 };
    // SAFETY: the value is copied at once.
    unsafe { ENDPOINTS6.get(&ep) }.copied()
}

/// Whether `pkt` is addressed to the gateway itself (the FIB does not
/// forward it): the kernel's, untouched.
#[inline(always)]
fn to_gateway(ctx: &XdpContext, pkt: &Packet6) -> bool {
    fib(ctx, pkt, &pkt.daddr(), 0).0 == i64::from(BPF_FIB_LKUP_RET_NOT_FWDED)
}

#[inline(always)]
pub(crate) fn state_of(flow: *mut Flow6) -> *mut u64 {
    // SAFETY: only the field's address is taken.
    unsafe { &raw mut (*flow).state }
}

/// The direction of a flow entry (see `main.rs`'s `superseded`).
#[inline(always)]
fn dir_of(flow: *mut Flow6) -> *mut u8 {
    // SAFETY: only the field's address is taken.
    unsafe { &raw mut (*flow).dir }
}

/// A packet that matched a flow-table entry by its own 5-tuple (see
/// `main.rs`'s `known_flow`).
#[inline(always)]
fn known_flow(pkt: &Packet6, flow: *mut Flow6, k: *mut Keys6, now: u64) -> Option<To> {
    // Held on a closed entry (see `holding`), decided first: with the
    // entry's fields loaded, the map lookup's spills took the chain of stack
    // frames past the verifier's 512 bytes.
    // SAFETY: a valid, aligned u64 inside a map value (see main.rs).
    let closed = flow_closed(unsafe { core::ptr::read_volatile(&raw const (*flow).state) });
    if closed && pkt.proto == PROTO_TCP && !pkt.is_syn() && holding(now) {
        return None;
    }
    // A SYN that retransmits the closed entry's own takes it up again
    // (`resumed`), decided here too, before the entry's fields are loaded;
    // any other SYN on a closed entry is a new connection (below).
    if closed && pkt.is_syn() {
        resumed6(pkt, flow);
    }
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, nat, last_seen) = unsafe { ((*flow).dir, Nat6::of(flow), (*flow).last_seen) };
    if dir == DIR_REPLY {
        reply_entry_seen(pkt, flow, k, &nat);
        return Some(To::Client(nat, flow));
    }
    // SAFETY: a valid, aligned u64 inside a map value (see main.rs).
    let state = unsafe { core::ptr::read_volatile(&raw const (*flow).state) };
    // A flow whose backend went down: its close is counted by the entry
    // that replaces this one (`table::Entry`), or by its expiry.
    let down = backend_down(nat.backend_id);
    if down || (pkt.is_syn() && flow_closed(state)) {
        return None;
    }
    if pkt.is_syn() && !syn_on_open6(pkt, flow, state) {
        return None;
    }
    track_close(state_of(flow), nat.backend_id, pkt.tcp_flags, pkt.proto, FLOW_FIN_CLIENT);
    let dsr = dir == DIR_DSR;
    let needs = if dsr { 0 } else { FLOW_REPLIED };
    if state & (needs | FLOW_ESTABLISHED) == needs && !pkt.is_syn() && pkt.tcp_flags & TCP_RST == 0 {
        set_state(state_of(flow), FLOW_ESTABLISHED);
    }
    if last_seen != now {
        // SAFETY: a valid map value; a plain store of a timestamp.
        unsafe { (*flow).last_seen = now };
    }
    Some(if dsr { To::Dsr(nat) } else { To::Backend(nat) })
}

/// `resumed` for an IPv6 entry, in a call of its own (see `resumed4`).
/// Its answer is not needed: the caller reads the entry's state afresh.
#[inline(never)]
fn resumed6(pkt: &Packet6, flow: *mut Flow6) {
    // SAFETY: a valid, aligned map value; plain loads of integers (the
    // state volatile, see main.rs).
    let (seen, dir, syn_seq, backend_id) = unsafe {
        (core::ptr::read_volatile(&raw const (*flow).state), (*flow).dir, (*flow).syn_seq, (*flow).backend_id)
    };
    resumed(state_of(flow), seen, dir, syn_seq, pkt.seq_lo(), backend_id);
}

/// `syn_on_open` for an IPv6 entry, in a call of its own (see
/// `resumed4`).
#[inline(never)]
fn syn_on_open6(pkt: &Packet6, flow: *mut Flow6, seen: u64) -> bool {
    // SAFETY: a valid, aligned map value; only fields' addresses are taken
    // and an integer loaded.
    let (syn_seq, backend_id) = unsafe { (&raw mut (*flow).syn_seq, (*flow).backend_id) };
    syn_on_open(state_of(flow), seen, syn_seq, pkt.seq_lo(), backend_id)
}

/// A new flow: planned in a frame of its own (`plan_flow`), its entries
/// inserted from this one, and settled in a frame of its own again
/// (`settle_flow`). The inserts are calls of their own
/// (`table::put_flow6`), and the program's deepest chain of frames (this
/// one, `transmit`, its FIB lookup) leaves no room for them on top of
/// the planning frame.
#[inline(always)]
fn new_flow(pkt: &Packet6, k: *mut Keys6, now: u64) -> Result<Nat6, u32> {
    let mut code = plan_flow(pkt, k, now);
    if code == PLAN_INSERT || code == PLAN_INSERT_REPLY {
        let reply = code == PLAN_INSERT_REPLY;
        let first = if reply {
            // SAFETY: this CPU's scratch slot, where `plan_flow` wrote the
            // keys; the reference lives for the call only.
            table::put_flow6(unsafe { &(*k).other }, table::NO_SLOT, table::PUT_REPLACE)
        } else {
            table::Put::Done
        };
        let ok = first == table::Put::Done;
        if ok && reply {
            forward_entry(pkt, k, DIR_FORWARD, now);
        }
        // In place of the entry the lookup found, or in a free slot; not
        // over one another CPU put in since (as for IPv4: `insert_flow`).
        // A reply entry's failure is the flow's (its lost swap, `Busy`,
        // holds the packet).
        let put = if ok {
            // SAFETY: as above; a plain load.
            table::put_flow6(unsafe { &(*k).flow }, unsafe { (*k).hint }, table::PUT_JOIN)
        } else {
            first
        };
        if ok && reply && (put == table::Put::Full || put == table::Put::Busy) {
            // The reply entry without its flow: taken back (as for IPv4).
            // SAFETY: as above.
            table::lb_take_back6(unsafe { &raw const (*k).other });
        }
        code = settle_flow(pkt, k, put as u32);
    }
    if code == PLAN_NAT {
        // SAFETY: as above; a plain copy.
        Ok(unsafe { (*k).nat })
    } else {
        Err(code)
    }
}

/// `plan_flow`'s and `settle_flow`'s answers besides an XDP action (which
/// the packet gets): the rewrite is in `Keys6::nat`; ...
const PLAN_NAT: u32 = u32::MAX;
/// ... insert the entry in `SCRATCH6` under `Keys6::flow`; ...
const PLAN_INSERT: u32 = u32::MAX - 1;
/// ... insert it under `Keys6::other` as the reply entry, then as the
/// flow's under `Keys6::flow` (`forward_entry` turns it).
const PLAN_INSERT_REPLY: u32 = u32::MAX - 2;

/// The new flow's backend and entry (see `new_flow`).
#[inline(never)]
fn plan_flow(pkt: &Packet6, k: *mut Keys6, now: u64) -> u32 {
    // SAFETY: this CPU's scratch slot, where try_lb copied the service;
    // nothing writes `svc` while this reference lives.
    let svc = unsafe { &(*k).svc };
    let Some(limit) = admit_opening(pkt.proto, pkt.tcp_flags, now) else {
        return xdp_action::XDP_DROP;
    };
    let opening = pkt.proto != PROTO_TCP || pkt.is_syn();
    let reply_entry = svc.flags & SVC_F_REPLY_ENTRY != 0;
    // SAFETY: this CPU's scratch slot; a plain load.
    if reply_entry || takes_over(unsafe { (*k).hint }) || rate_ok(limit, now) {
        let tuple = pkt.tuple();
        let id = if opening { select::pick(svc, tuple) } else { select::pick_stateless(svc, tuple) };
        return prepare_entry(pkt, k, svc, id, now);
    }
    stats::count(counter::FLOOD_RATE);
    stateless(pkt, k, opening)
}

/// After the inserts (`put`: the flow's, as `table::Put`; `Done` only
/// when the reply entry went in too): the flow counted, or the entry
/// another CPU put in for it joined (`joined6`), or the packet held while
/// that CPU still writes it, or, without an entry, its consistent-hash
/// answer (see `new_flow`).
#[inline(never)]
fn settle_flow(pkt: &Packet6, k: *mut Keys6, put: u32) -> u32 {
    // SAFETY: this CPU's scratch slots; plain loads.
    let (id, reply_entry, scheduler) =
        unsafe { ((*k).nat.backend_id, (*k).svc.flags & SVC_F_REPLY_ENTRY != 0, (*k).svc.scheduler) };
    if put == table::Put::Exists as u32 && joined6(k, id, reply_entry) {
        return PLAN_NAT;
    }
    // Another CPU still writing this flow's entry: held (see
    // `insert_flow` in main.rs).
    if put == table::Put::Busy as u32 {
        stats::count(counter::HELD);
        return xdp_action::XDP_DROP;
    }
    if put == table::Put::Done as u32 {
        let state = opening_state(pkt.proto, pkt.tcp_flags) | stats::conns_class(scheduler);
        if pkt.proto != PROTO_TCP || pkt.is_syn() {
            stats::new_flow(id);
        }
        stats::flow_opened(id, state);
        if flow_closed(state) {
            stats::flow_closed(id, state);
        }
        return PLAN_NAT;
    }
    // A flow of a service whose replies need their own entry cannot go
    // without one: dropped when the table has no room.
    if reply_entry {
        stats::count(counter::DROP_FLOW_TABLE);
        return xdp_action::XDP_DROP;
    }
    stats::count(counter::TABLE_FULL);
    stateless(pkt, k, pkt.proto != PROTO_TCP || pkt.is_syn())
}

/// A new flow whose entry another CPU put in between this packet's
/// lookup and its insert, copied into this CPU's `SCRATCH6` slot by the
/// insert (as for IPv4: `insert_flow`): its rewrite into `Keys6::nat`,
/// counted by that CPU alone; this packet's reply entry, for its own pick
/// `id`, taken back when the entry names another backend.
#[inline(always)]
fn joined6(k: *mut Keys6, id: u32, reply: bool) -> bool {
    let Some(e) = SCRATCH6.get_ptr(0) else { return false };
    // SAFETY: this CPU's scratch slot; a plain load.
    let theirs = unsafe { (*e).backend_id };
    if reply && theirs != id {
        // SAFETY: this CPU's scratch slot, where `plan_flow` wrote the
        // keys; the pointer is read for the call only.
        table::lb_take_back6(unsafe { &raw const (*k).other });
    }
    // SAFETY: this CPU's scratch slots; plain loads and stores, the
    // address word by word (see `copy_addr6`).
    unsafe {
        (*k).nat.backend_id = theirs;
        copy_addr6(&raw mut (*k).nat.addr, &raw const (*e).nat_addr);
        (*k).nat.port = (*e).nat_port;
    }
    true
}

/// No entry: the consistent-hash answer, the same for every packet of
/// the flow (and for its SYN's retransmissions).
#[inline(always)]
fn stateless(pkt: &Packet6, k: *mut Keys6, opening: bool) -> u32 {
    // SAFETY: this CPU's scratch slot; the reference lives for the pick.
    let id = select::pick_stateless(unsafe { &(*k).svc }, pkt.tuple());
    match backend_addr(id) {
        Some((addr, port)) => {
            // A new connection all the same (its backend accepts it).
            if opening {
                stats::new_flow(id);
            }
            set_nat(k, id, addr, port);
            PLAN_NAT
        }
        None => no_backend(),
    }
}

/// An IPv6 backend's address (where its map value holds it) and port
/// (None for an empty id or an IPv4 backend: a table never mixes them,
/// but a stale id might).
#[inline(always)]
fn backend_addr(id: u32) -> Option<(*const [u32; 4], u16)> {
    if id == BACKEND_NONE {
        return None;
    }
    let b = BACKENDS.get(id)?;
    if b.flags & BACKEND_F_V6 == 0 {
        return None;
    }
    let port = b.port;
    Some((BACKEND_ADDRS6.get_ptr(id)?, port))
}

/// The new flow's rewrite, into the scratch slot's `nat`: backend `id`
/// at the address `addr` points at (a map value), word by word (see
/// `copy_addr6`).
#[inline(always)]
fn set_nat(k: *mut Keys6, id: u32, addr: *const [u32; 4], port: u16) {
    // SAFETY: this CPU's scratch slot, touched by this invocation only;
    // `addr` a valid map value (`backend_addr`).
    unsafe {
        (*k).nat.backend_id = id;
        copy_addr6(&raw mut (*k).nat.addr, addr);
        (*k).nat.port = port;
    }
}

/// A new flow's entry built in this CPU's `SCRATCH6` slot, for backend
/// `id`: its reply entry first when the service needs one (its key in
/// `Keys6::other`), the flow's own otherwise; the rewrite in `Keys6::nat`.
#[inline(always)]
fn prepare_entry(pkt: &Packet6, k: *mut Keys6, svc: &Service, id: u32, now: u64) -> u32 {
    let Some((addr, port)) = backend_addr(id) else {
        return no_backend();
    };
    let Some(e) = SCRATCH6.get_ptr_mut(0) else {
        return xdp_action::XDP_DROP;
    };
    set_nat(k, id, addr, port);
    // Zeroed word by word first, then field by field: a whole-struct write
    // is built on the stack first, and its MAC arrays and addresses compile
    // to `memset` and `memmove` calls, byte loops (see `copy_addr6`).
    const { assert!(size_of::<Flow6>().is_multiple_of(8) && align_of::<Flow6>() >= 8) };
    // SAFETY: this CPU's slots of per-CPU maps, touched by this program
    // invocation only; plain stores, the words within the (8-aligned)
    // value; the packet's address was bounds-checked by parse().
    unsafe {
        let words = e.cast::<u64>();
        for i in 0..size_of::<Flow6>() / 8 {
            words.add(i).write_volatile(0);
        }
        (*e).backend_id = id;
        (*e).service_id = svc.service_id;
        copy_addr6(&raw mut (*e).nat_addr, &raw const (*pkt.ip).daddr);
        (*e).nat_port = pkt.dport;
        (*e).dir = DIR_REPLY;
        // Kept by the forward entry made from this one (`forward_entry`;
        // written there, it took new_flow's chain of frames past the
        // verifier's 512 bytes).
        (*e).syn_seq = pkt.seq_lo();
    }
    if svc.flags & SVC_F_DSR != 0 {
        forward_entry(pkt, k, DIR_DSR, now);
        PLAN_INSERT
    } else if svc.flags & SVC_F_REPLY_ENTRY != 0 {
        // The backend's endpoint names another service's VIP: this flow's
        // replies need an entry of their own, inserted first so that once
        // the forward entry exists, replies can come.
        // Marked as a reply key: its slots start where the forward
        // entry's do (already cached by this insert's lookup).
        // SAFETY: as above.
        // Written in place (see `FlowKey6::write`).
        unsafe {
            FlowKey6::write(
                &raw mut (*k).other,
                addr,
                &raw const (*pkt.ip).saddr,
                port,
                pkt.sport,
                pkt.proto,
                KEY_REPLY,
            );
        }
        PLAN_INSERT_REPLY
    } else {
        forward_entry(pkt, k, DIR_FLOW, now);
        PLAN_INSERT
    }
}

/// Turn the scratch entry into the flow's own (direction `dir`): the
/// rewrite towards the backend of `Keys6::nat`, the opening state, the
/// packet's time.
#[inline(always)]
fn forward_entry(pkt: &Packet6, k: *mut Keys6, dir: u8, now: u64) {
    let Some(e) = SCRATCH6.get_ptr_mut(0) else { return };
    // SAFETY: as in `prepare_entry`.
    unsafe {
        copy_addr6(&raw mut (*e).nat_addr, &raw const (*k).nat.addr);
        (*e).nat_port = (*k).nat.port;
        (*e).dir = dir;
        (*e).state = opening_state(pkt.proto, pkt.tcp_flags) | stats::conns_class((*k).svc.scheduler);
        (*e).last_seen = now;
    }
}

/// A packet from a backend's endpoint, `vip` the service that owns it (see
/// `main.rs`'s `reply_of_flow`).
#[inline(always)]
fn reply_of_flow(pkt: &Packet6, k: *mut Keys6, no_flow: &mut bool) -> Option<To> {
    // SAFETY: this CPU's scratch slot (see try_lb); plain copies.
    let vip = unsafe { (*k).vip };
    let Some(flow) = table::flow6(client_key(pkt, k, &vip.addr, vip.port)) else {
        *no_flow = true;
        return None;
    };
    // SAFETY: a valid, aligned map value; plain loads of integers.
    let (dir, nat) = unsafe { ((*flow).dir, Nat6::of(flow)) };
    if dir != DIR_FLOW
        || nat.addr != pkt.saddr()
        || nat.port != pkt.sport
        || crate::superseded(pkt.proto, pkt.tcp_flags, state_of(flow), dir_of(flow))
    {
        return None;
    }
    crate::mark_replied(state_of(flow));
    track_close(state_of(flow), nat.backend_id, pkt.tcp_flags, pkt.proto, FLOW_FIN_BACKEND);
    Some(To::Client(Nat6 { backend_id: nat.backend_id, addr: vip.addr, port: vip.port }, flow))
}

/// A packet that matched a reply entry (see `main.rs`).
#[inline(always)]
fn reply_entry_seen(pkt: &Packet6, entry: *mut Flow6, k: *mut Keys6, nat: &Nat6) {
    let first = crate::mark_replied(state_of(entry));
    let closing = pkt.proto == PROTO_TCP && pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0;
    if !first && !closing {
        return;
    }
    if let Some(fwd) = table::flow6(client_key(pkt, k, &nat.addr, nat.port)) {
        if first {
            set_state(state_of(fwd), FLOW_REPLIED);
        }
        track_close(state_of(fwd), nat.backend_id, pkt.tcp_flags, pkt.proto, FLOW_FIN_BACKEND);
    }
}

/// The client's 5-tuple towards the VIP, from a backend -> client packet,
/// written into the scratch slot's second key.
#[inline(always)]
fn client_key<'a>(pkt: &Packet6, k: *mut Keys6, vip_addr: &[u32; 4], vip_port: u16) -> &'a FlowKey6 {
    // SAFETY: this CPU's scratch slot (see try_lb); the reference is used
    // for one lookup, and nothing writes the slot meanwhile.
    // Written in place, word by word (see `FlowKey6::write`).
    unsafe {
        FlowKey6::write(&raw mut (*k).other, &raw const (*pkt.ip).daddr, vip_addr, pkt.dport, vip_port, pkt.proto, 0);
        &(*k).other
    }
}

/// The keys of one packet's lookups, in a per-CPU scratch slot
/// (`KEYS6`): 120 bytes the 512-byte stack has no room for. `flow` is
/// the packet's own 5-tuple; `other` the client's tuple of a backend's
/// packet, or a new flow's reply entry; `vip` a VIP or endpoint key.
#[repr(C)]
pub(crate) struct Keys6 {
    pub flow: FlowKey6,
    pub other: FlowKey6,
    pub vip: Vip6Key,
    pub rw: Rewrite6,
    /// The service of a new flow.
    pub svc: Service,
    /// A new flow's rewrite (see `new_flow`).
    pub nat: Nat6,
    /// The answer of the lookup of `flow` (`table::lb_flow_slot6`), where
    /// a new flow's insert starts.
    pub hint: u32,
}

/// What a NAT rewrite changed, for the L4 checksum update.
#[derive(Clone, Copy)]
pub(crate) struct Rewrite6 {
    old_addr: [u32; 4],
    new_addr: [u32; 4],
    old_port: u16,
    new_port: u16,
}

#[inline(always)]
fn hop_limit_ok(pkt: &Packet6) -> bool {
    // SAFETY: bounds-checked by parse().
    unsafe { (*pkt.ip).hop_limit > 1 }
}

/// Client -> backend: destination becomes the backend.
#[inline(always)]
fn forward(ctx: &XdpContext, pkt: &Packet6, nat: Nat6, cs: L4Csum, now: u64) -> u32 {
    if !hop_limit_ok(pkt) {
        stats::count(counter::TTL_EXPIRED);
        return xdp_action::XDP_PASS;
    }
    stats::packet_in(nat.backend_id, pkt.len);
    let Some(rw) = rewrite(pkt, nat.addr, nat.port, Way::Forward) else {
        return xdp_action::XDP_PASS;
    };
    send(ctx, pkt, rw, cs, Hop::Backend { id: nat.backend_id, addr: fold6(&nat.addr) }, now, Way::Forward)
}

/// Backend -> client: source becomes the VIP again.
#[inline(always)]
fn reply(ctx: &XdpContext, pkt: &Packet6, nat: Nat6, cs: L4Csum, hop: Hop, now: u64) -> u32 {
    if !hop_limit_ok(pkt) {
        stats::count(counter::TTL_EXPIRED);
        return xdp_action::XDP_PASS;
    }
    if nat.backend_id != BACKEND_NONE {
        stats::packet_out(nat.backend_id, pkt.len);
    }
    let Some(rw) = rewrite(pkt, nat.addr, nat.port, Way::Reply) else {
        return xdp_action::XDP_PASS;
    };
    send(ctx, pkt, rw, cs, hop, now, Way::Reply)
}

/// The L4 checksum as it arrived (see `forward::classify`): one that
/// equals the pseudo-header sum is confirmed unfinished by summing the
/// segment, as IPv4 does, since a finished checksum equals it by chance
/// once in 65,536 packets (taken for unfinished, its checksum would be
/// rewritten the wrong way and the receiver would drop it: 26 of 1,000,000
/// IPv6 UDP datagrams from fresh sockets were lost so in the lab). The
/// sum also gives the finished checksum, which a native redirect needs.
#[inline(always)]
fn classify(ctx: &XdpContext, pkt: &Packet6) -> L4Csum {
    // SAFETY: bounds-checked by parse().
    let field = unsafe { *pkt.l4_check };
    let pseudo = csum::pseudo_header6(&pkt.saddr(), &pkt.daddr(), pkt.proto, pkt.l4_len as u32);
    if field != pseudo {
        return L4Csum::Full;
    }
    classify_slow(ctx, pkt.l4_off, pkt.l4_len, pseudo)
}

// Its own frame: the summing loop runs only for a checksum that equals
// the pseudo-header sum, and the verifier walks it with this frame's few
// registers rather than the whole path's.
#[inline(never)]
fn classify_slow(ctx: &XdpContext, l4_off: usize, l4_len: usize, pseudo: u16) -> L4Csum {
    classify_segment(ctx, l4_off, l4_len, pseudo)
}

/// Rewrite the destination (forward) or source (reply) address and port.
#[inline(always)]
fn rewrite<'a>(pkt: &Packet6, addr: [u32; 4], port: u16, way: Way) -> Option<&'a Rewrite6> {
    // What changed is kept in this CPU's scratch slot (`Keys6::rw`), off
    // the stack.
    let k = KEYS6.get_ptr_mut(0)?;
    // SAFETY: every pointer in Packet6 was bounds-checked by parse(); the
    // scratch slot is this invocation's, and the reference handed out is
    // the only one until the packet is sent.
    unsafe {
        let ip = pkt.ip;
        let (a, p) = match way {
            Way::Forward => (&raw mut (*ip).daddr, &raw mut (*pkt.ports)[1]),
            Way::Reply => (&raw mut (*ip).saddr, &raw mut (*pkt.ports)[0]),
        };
        // The old address word by word (see `copy_addr6`).
        copy_addr6(&raw mut (*k).rw.old_addr, a);
        (*k).rw.new_addr = addr;
        (*k).rw.old_port = *p;
        (*k).rw.new_port = port;
        *a = addr;
        *p = port;
        Some(&(*k).rw)
    }
}

/// Bring the L4 checksum in line with the rewrite (see `forward::update_l4`).
#[inline(always)]
fn update_l4(pkt: &Packet6, rw: &Rewrite6, cs: L4Csum, finish: bool) {
    // SAFETY: l4_check was bounds-checked by parse().
    unsafe {
        let mut old = *pkt.l4_check;
        match cs {
            L4Csum::Partial { done: Some(done) } if finish => old = done,
            L4Csum::Partial { .. } => {
                *pkt.l4_check = csum::replace6_partial(old, &rw.old_addr, &rw.new_addr);
                return;
            }
            L4Csum::Full => {}
        }
        let mut new = csum::replace_addr6_port(old, &rw.old_addr, &rw.new_addr, rw.old_port, rw.new_port);
        if pkt.proto == PROTO_UDP && new == 0 {
            new = 0xffff;
        }
        *pkt.l4_check = new;
    }
}

/// The kernel's forwarding path, the packet as rewritten so far.
#[inline(always)]
fn to_kernel(pkt: &Packet6, rw: &Rewrite6, cs: L4Csum, reason: u32) -> u32 {
    update_l4(pkt, rw, cs, false);
    stats::count(reason);
    xdp_action::XDP_PASS
}

/// Send the rewritten packet to its next hop (see `forward::send`).
#[inline(always)]
fn send(ctx: &XdpContext, pkt: &Packet6, rw: &Rewrite6, cs: L4Csum, hop: Hop, now: u64, way: Way) -> u32 {
    let now = now as u32;
    let generation = NETDEV_GEN.get(0).copied().unwrap_or(0);
    // The egress only: the MACs are copied into the frame from wherever
    // the hop is kept (held in locals across the checks below, their
    // bytes cost this frame more than it has), once no path is left that
    // hands the packet to the kernel as it came: from the cache for a
    // cached hop, from the FIB's answer for one just looked up, whether
    // `adopt_hop` cached it or not (a narrower egress or route).
    // A GSO packet is never sent by a cached hop (see `forward::gso`).
    let cached = if gso(ctx) { None } else { cached_hop(ctx, hop, now, generation) };
    let ifindex = if let Some(nh) = cached {
        copy_macs(hop, pkt.eth);
        nh.0
    } else {
        // SAFETY: bounds-checked by parse().
        let dst = unsafe { (*pkt.ip).daddr };
        let (rc, mut nh) = fib(ctx, pkt, &dst, 0);
        match rc {
            FIB_OK => {}
            FIB_TOO_BIG if gso_fits(ctx, nh.0) => return to_kernel(pkt, rw, cs, counter::KERNEL_EGRESS),
            FIB_TOO_BIG => return too_big_rewritten(ctx, pkt, rw, way, nh.0),
            _ => return to_kernel(pkt, rw, cs, counter::FIB_FALLBACK),
        }
        if !adopt_hop(ctx, hop, &mut nh, now, generation) {
            return to_kernel(pkt, rw, cs, counter::KERNEL_EGRESS);
        }
        copy_macs(Hop::Uncached, pkt.eth);
        nh.0
    };
    // Native mode finishes an unfinished checksum before a redirect (the
    // frame loses the skb's "finish me" mark on the way); generic mode
    // keeps it unfinished for the kernel or the device.
    let finish = matches!(cs, L4Csum::Partial { .. }) && !generic_ingress(ctx);
    update_l4(pkt, rw, cs, finish);
    // SAFETY: bounds-checked by parse().
    unsafe { (*pkt.ip).hop_limit -= 1 };
    leave(ctx, ifindex)
}

/// Write the MACs of the next hop `hop` names into the frame: from its
/// cache, or for `Hop::Uncached` (any hop just looked up) from the FIB's
/// answer in the scratch slot (nothing has used the slot since).
#[inline(always)]
fn copy_macs(hop: Hop, eth: *mut EthHdr) {
    // SAFETY: valid map values (a cache just found fresh or filled, the
    // scratch slot); plain loads; eth was bounds-checked by parse().
    unsafe {
        match hop {
            Hop::Backend { id, .. } => {
                if let Some(h) = crate::maps::NEXT_HOPS.get_ptr(id) {
                    set_macs(eth, (*h).smac, (*h).dmac);
                }
            }
            Hop::Flow(e) => set_macs(eth, (*e).nh_smac, (*e).nh_dmac),
            Hop::Flow6(e) => set_macs(eth, (*e).nh_smac, (*e).nh_dmac),
            Hop::Uncached => {
                if let Some(p) = SCRATCH6.get_ptr(0) {
                    let p = p.cast::<FibParams>();
                    set_macs(eth, (*p).smac, (*p).dmac);
                }
            }
        }
    }
}

/// A rewritten packet too big for its egress: never redirected. A reply
/// goes back to the kernel as it came (backend -> client), whose "packet
/// too big" reaches the backend quoting what the backend sent; a forward
/// packet is answered here from the VIP (see `forward::too_big_rewritten`).
#[inline(always)]
fn too_big_rewritten(ctx: &XdpContext, pkt: &Packet6, rw: &Rewrite6, way: Way, mtu: u32) -> u32 {
    stats::count(counter::TOO_BIG);
    // SAFETY: every pointer in Packet6 was bounds-checked by parse().
    unsafe {
        match way {
            Way::Forward => {
                (*pkt.ip).daddr = rw.old_addr;
                (*pkt.ports)[1] = rw.old_port;
            }
            Way::Reply => {
                (*pkt.ip).saddr = rw.old_addr;
                (*pkt.ports)[0] = rw.old_port;
            }
        }
    }
    match way {
        Way::Reply => xdp_action::XDP_PASS,
        Way::Forward => icmp6_too_big(ctx, mtu),
    }
}

/// Client -> backend by L2 direct server return (see `forward::send_dsr`).
#[inline(always)]
fn dsr(ctx: &XdpContext, pkt: &Packet6, nat: Nat6, now: u64) -> u32 {
    stats::packet_in(nat.backend_id, pkt.len);
    let now = now as u32;
    let generation = NETDEV_GEN.get(0).copied().unwrap_or(0);
    let hop = Hop::Backend { id: nat.backend_id, addr: fold6(&nat.addr) };
    let (ifindex, smac, dmac) = if let Some(nh) = cached_hop(ctx, hop, now, generation) {
        nh
    } else {
        // A GSO packet, as in IPv4's `forward::send_dsr`.
        let (rc, mut nh) = fib(ctx, pkt, &nat.addr, ON_LINK | ASK_SEGMENTS);
        match rc {
            FIB_OK => {}
            FIB_TOO_BIG => {
                stats::count(counter::TOO_BIG);
                return icmp6_too_big(ctx, nh.0);
            }
            FIB_NO_NEIGH => {
                stats::count(counter::FIB_FALLBACK);
                return xdp_action::XDP_DROP;
            }
            _ => {
                stats::count(counter::DSR_OFF_LINK);
                return xdp_action::XDP_DROP;
            }
        }
        if !adopt_hop(ctx, hop, &mut nh, now, generation) {
            stats::count(counter::DSR_OFF_LINK);
            return xdp_action::XDP_DROP;
        }
        nh
    };
    finish_for_dsr(ctx, pkt);
    set_macs(pkt.eth, smac, dmac);
    if gso(ctx) {
        return to_tc(ctx, ifindex);
    }
    leave(ctx, ifindex)
}

/// A DSR packet leaves unchanged but for its MACs: an unfinished L4
/// checksum is finished before a native redirect, or the backend would
/// drop the packet (see `forward::finish_for_dsr`); generic mode keeps it.
// Its own frame, as IPv4's: the summing loop only for such packets.
#[inline(never)]
fn finish_for_dsr(ctx: &XdpContext, pkt: &Packet6) {
    if generic_ingress(ctx) {
        return;
    }
    if let L4Csum::Partial { done: Some(done) } = classify(ctx, pkt) {
        // A computed 0 is sent as 0xffff: 0 is no checksum, which IPv6
        // UDP may not have.
        let done = if pkt.proto == PROTO_UDP && done == 0 { 0xffff } else { done };
        // SAFETY: l4_check was bounds-checked by parse().
        unsafe { *pkt.l4_check = done };
    }
}

/// Turn the (too big) IPv6 packet into ICMPv6 "packet too big" (type 2,
/// MTU `mtu`) from the address it was sent to, back to its sender,
/// quoting as much of it as fits in 1,280 bytes, handed to the kernel's
/// forwarding path. Built in place, as `forward::icmp4_too_big` is (see
/// there why not XDP_TX).
#[inline(never)]
fn icmp6_too_big(ctx: &XdpContext, mtu: u32) -> u32 {
    // SAFETY: plain helper calls on the program's own context.
    unsafe {
        if bpf_xdp_adjust_head(ctx.ctx.cast(), -(ICMP6_GROW as i32)) != 0 {
            return xdp_action::XDP_DROP;
        }
        let len = ctx.data_end() - ctx.data();
        if len > ETH_HLEN + IPV6_MIN_MTU
            && bpf_xdp_adjust_tail(ctx.ctx.cast(), (ETH_HLEN + IPV6_MIN_MTU) as i32 - len as i32) != 0
        {
            return xdp_action::XDP_DROP;
        }
    }
    let len = ctx.data_end() - ctx.data();
    // The new headers, then the old Ethernet and IPv6 headers.
    let Some(frame) = ptr_at::<[u16; (ICMP6_GROW + ETH_HLEN + IP6_HLEN) / 2]>(ctx, 0) else {
        return xdp_action::XDP_DROP;
    };
    if len > ETH_HLEN + IPV6_MIN_MTU {
        return xdp_action::XDP_DROP;
    }
    let icmp_len = len - ETH_HLEN - IP6_HLEN;
    let w = frame.cast::<u16>();
    // Word offsets: the old Ethernet header now starts at word 24, the
    // quoted IPv6 header at word 31 (source at 35, destination at 43).
    const OLD_ETH: usize = ICMP6_GROW / 2;
    const QUOTED: usize = OLD_ETH + ETH_HLEN / 2;
    // SAFETY: every index is below the 55 words bounds-checked above;
    // each word is read before anything is written over it.
    unsafe {
        for i in 0..6 {
            *w.add(i) = *w.add(OLD_ETH + i);
        }
        *w.add(6) = ETH_P_IPV6.to_be();
        // Version 6, no traffic class or flow label; payload length;
        // next header ICMPv6, hop limit 64.
        *w.add(7) = u16::from_ne_bytes([0x60, 0]);
        *w.add(8) = 0;
        *w.add(9) = (icmp_len as u16).to_be();
        *w.add(10) = u16::from_ne_bytes([NEXT_ICMPV6, 64]);
        // Source = where the packet went, destination = its sender.
        for i in 0..8 {
            *w.add(11 + i) = *w.add(QUOTED + 12 + i);
            *w.add(19 + i) = *w.add(QUOTED + 4 + i);
        }
        // Type 2 (packet too big), code 0, checksum 0 for now; the MTU.
        *w.add(27) = u16::from_ne_bytes([ICMP6_TOO_BIG, 0]);
        *w.add(28) = 0;
        *w.add(29) = ((mtu >> 16) as u16).to_be();
        *w.add(30) = (mtu as u16).to_be();
    }
    let Some(body) = segment_sum(ctx, ETH_HLEN + IP6_HLEN, icmp_len) else {
        return xdp_action::XDP_DROP;
    };
    // The pseudo-header: both addresses (their sum is the same either
    // way round), the ICMPv6 length, the next header.
    let Some(ip) = ptr_at::<Ipv6Hdr>(ctx, ETH_HLEN) else {
        return xdp_action::XDP_DROP;
    };
    // SAFETY: bounds-checked just above; w[28] lies inside the frame
    // checked above.
    unsafe {
        let pseudo = csum::pseudo_header6(&(*ip).saddr, &(*ip).daddr, NEXT_ICMPV6, icmp_len as u32);
        *w.add(28) = !csum::add(pseudo, body);
    }
    xdp_action::XDP_PASS
}

/// What the ICMPv6 error adds in front of the quoted packet.
const ICMP6_GROW: usize = IP6_HLEN + 8;

/// A FIB lookup's question: a GSO packet (`forward::gso`) is compared with
/// the route's MTU by the length of its segments (`forward::segments`),
/// not its own, found in the lookup's own frame. (IPv4 gives the length
/// from its caller, `forward::ASK_LEN_SHIFT`; here a length carried in
/// costs the caller's frame stack its chain does not have.)
const ASK_SEGMENTS: u32 = 2;

/// The length a FIB lookup compares with the route's MTU: the packet's
/// own, `own`, or its segments' where `ask` says so and it is a GSO
/// packet.
#[inline(always)]
fn fib_len(ctx: &XdpContext, ask: u32, own: u16) -> u16 {
    if ask & ASK_SEGMENTS != 0 {
        let seg = segments(ctx);
        if seg != 0 {
            return seg as u16;
        }
    }
    own
}

/// Ask the FIB about the packet towards `dst`, as `ask` says
/// (`forward::ON_LINK`, [`ASK_SEGMENTS`]): the parameters and the
/// answer live in this CPU's scratch slot (`forward::fib_params`), not on
/// the stack. Ok(next hop); Err(the `BPF_FIB_LKUP_RET_*` code, or
/// [`FIB_OFF_LINK`]), with the MTU in the first slot for [`FIB_TOO_BIG`].
#[inline(always)]
fn fib(ctx: &XdpContext, pkt: &Packet6, dst: &[u32; 4], ask: u32) -> (i64, NextHopAddr) {
    let Some(p) = crate::forward::fib_params() else {
        return (-1, (0, [0; 6], [0; 6]));
    };
    // SAFETY: this CPU's zeroed scratch slot.
    unsafe { (*p).__bindgen_anon_4.ipv6_dst = *dst };
    let rc = fib_lookup(ctx, pkt, ask);
    // SAFETY: as above; the helper's answer (plain loads).
    unsafe {
        match rc {
            FIB_OK => (rc, ((*p).ifindex, (*p).smac, (*p).dmac)),
            FIB_TOO_BIG => (rc, (u32::from((*p).__bindgen_anon_1.mtu_result), [0; 6], [0; 6])),
            _ => (rc, (0, [0; 6], [0; 6])),
        }
    }
}

/// The lookup itself, on the parameters [`fib`] started (destination
/// set). Its own frame, as in `forward`.
#[inline(never)]
fn fib_lookup(ctx: &XdpContext, pkt: &Packet6, ask: u32) -> i64 {
    // First, with little held across its call (the frame stays small).
    // It writes only past the parameters in the scratch slot.
    let len = fib_len(ctx, ask, pkt.ip_len() as u16);
    let Some(p) = SCRATCH6.get_ptr_mut(0) else {
        return -1;
    };
    let p = p.cast::<FibParams>();
    // SAFETY: this CPU's scratch slot, which `fib` zeroed and gave the
    // destination; plain stores and loads.
    unsafe {
        // The destination held as two 64-bit words, not four 32-bit ones
        // (each would take a stack slot of its own; this chain of frames
        // has no room for them). The slot is 8-aligned, and the address is
        // at byte 32 (asserted below).
        let d = (&raw const (*p).__bindgen_anon_4.ipv6_dst).cast::<u64>();
        let dst = (*d, *d.add(1));
        (*p).family = AF_INET6;
        (*p).l4_protocol = pkt.proto;
        (*p).__bindgen_anon_1.tot_len = len;
        (*p).__bindgen_anon_3.ipv6_src = pkt.saddr();
        (*p).ifindex = ctx.ingress_ifindex() as u32;
        // Asked for the ingress MTU, and again by the packet's own length
        // where only that fits (see `forward::widen`).
        widen(ctx, p);
        let rc = bpf_fib_lookup(ctx.ctx.cast(), p, size_of::<FibParams>() as i32, 0);
        let rc = ask_narrow(ctx, p, rc);
        // The helper wrote the next hop's address (a gateway, if the
        // route has one) over the destination.
        if rc == FIB_OK && ask & ON_LINK != 0 && (*d, *d.add(1)) != dst {
            return FIB_OFF_LINK;
        }
        rc
    }
}

const _: () = assert!(core::mem::offset_of!(FibParams, __bindgen_anon_4).is_multiple_of(8));

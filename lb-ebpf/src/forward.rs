//! NAT rewrite and next hop.
//!
//! Forward packets get the backend's address and port as destination, reply
//! packets get the VIP back as source. Checksums are updated incrementally.
//! The next hop comes from the kernel FIB; when the FIB cannot give a
//! resolved neighbour the rewritten packet goes to the kernel, which
//! resolves it (ARP) and forwards it.
use core::mem::{align_of, size_of};

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_UNSPEC,
        bpf_check_mtu_ret::BPF_MTU_CHK_RET_FRAG_NEEDED, bpf_fib_lookup as FibParams, xdp_action,
    },
    helpers::generated::{
        bpf_check_mtu, bpf_csum_diff, bpf_fib_lookup, bpf_redirect, bpf_xdp_adjust_head, bpf_xdp_adjust_meta,
        bpf_xdp_adjust_tail, bpf_xdp_load_bytes,
    },
    programs::{TcContext, XdpContext},
};
use lb_common::{
    Flow, Flow6, HOP_TX, NETDEV_F_GENERIC, NETDEV_F_TX, NETDEV_F_XMIT_GENERIC, NETDEV_F_XMIT_NATIVE, NETDEV_MTU_SHIFT,
    PROTO_UDP, TC_HANDOFF_MAGIC, TcHandoff, counter,
};

use lb_ebpf::csum;

use crate::{
    maps::{NETDEV_GEN, NETDEVS, NEXT_HOPS, SCRATCH6},
    parse::{ETH_HLEN, EthHdr, ICMP_FRAG_NEEDED, ICMP_UNREACH, Ipv4Hdr, Packet, ptr_at},
    stats,
};

const AF_INET: u8 = 2;

/// The L4 checksum as it arrived, judged before the rewrite.
#[derive(Clone, Copy)]
pub(crate) enum L4Csum {
    /// A finished checksum (or UDP without one): updated incrementally.
    Full,
    /// An unfinished one (CHECKSUM_PARTIAL: a local sender behind a veth
    /// left it to offload): the field holds the pseudo-header sum. `done`
    /// is the finished checksum of the packet as it arrived (None for a
    /// segment longer than [`SUM_MAX`], only seen in generic mode).
    Partial { done: Option<u16> },
}

/// What a NAT rewrite changed, for the L4 checksum update that follows
/// once the path is known.
#[derive(Clone, Copy)]
pub(crate) struct Rewrite {
    old_addr: u32,
    new_addr: u32,
    old_port: u16,
    new_port: u16,
}

/// Is the L4 checksum unfinished? Cheap test first: an unfinished one
/// equals the pseudo-header sum. A finished checksum equals it by chance
/// once in 65,536 packets, so a match is confirmed by summing the segment.
#[inline(always)]
pub(crate) fn classify(ctx: &XdpContext, pkt: &Packet) -> L4Csum {
    // SAFETY: bounds-checked by parse().
    let field = unsafe { *pkt.l4_check() };
    if pkt.proto == PROTO_UDP && field == 0 {
        return L4Csum::Full;
    }
    let pseudo = csum::pseudo_header(pkt.saddr, pkt.daddr, pkt.proto, pkt.l4_len as u16);
    if field != pseudo {
        return L4Csum::Full;
    }
    classify_slow(ctx, pkt, pseudo)
}

// Its own frame: the summing loop is only for unfinished checksums.
#[inline(never)]
fn classify_slow(ctx: &XdpContext, pkt: &Packet, pseudo: u16) -> L4Csum {
    classify_segment(ctx, pkt.l4_off, pkt.l4_len, pseudo)
}

/// The slow half of [`classify`] for either family: the L4 segment at
/// `l4_off` (`l4_len` bytes) whose checksum field equals the
/// pseudo-header sum `pseudo`.
#[inline(always)]
pub(crate) fn classify_segment(ctx: &XdpContext, l4_off: usize, l4_len: usize, pseudo: u16) -> L4Csum {
    if l4_len > SUM_MAX {
        // Only generic mode sees segments this long (native frames fit a
        // page): a GSO packet from a local sender, which is always
        // unfinished, or a GRO-merged one, whose checksum the kernel
        // recomputes when it splits it. A native jumbo frame that matches
        // by chance (1 in 65,536) is left as it is.
        if generic_ingress(ctx) {
            stats::count(counter::CSUM_PARTIAL);
            return L4Csum::Partial { done: None };
        }
        return L4Csum::Full;
    }
    let Some(segment) = segment_sum(ctx, l4_off, l4_len) else {
        return L4Csum::Full;
    };
    // A finished checksum sums, with the pseudo-header, to all ones.
    if csum::add(pseudo, segment) == 0xffff {
        return L4Csum::Full;
    }
    // Unfinished: the field holds the pseudo-header sum, so the segment's
    // sum is already the sum over pseudo-header and segment.
    stats::count(counter::CSUM_PARTIAL);
    L4Csum::Partial { done: Some(!segment) }
}

/// Largest chunk `bpf_csum_diff` sums in one call.
const CHUNK: usize = 512;
/// Longest L4 segment summed. Bounds the loop (and keeps the packet
/// offsets the verifier tracks well inside the 64 KiB it allows); more than
/// any native XDP frame on veth or a 9,000-byte jumbo frame.
const SUM_MAX: usize = 18 * CHUNK;

/// Ones' complement sum of `len` bytes from `off` (the L4 segment, which
/// parse() checked lies inside the frame). None if the frame ends early.
#[inline(always)]
pub(crate) fn segment_sum(ctx: &XdpContext, off: usize, len: usize) -> Option<u16> {
    let end = off + len;
    let mut off = off;
    let mut sum: u32 = 0;
    // Verifier: a bounded loop (the caller checked len <= SUM_MAX).
    for _ in 0..SUM_MAX / CHUNK {
        if off + CHUNK > end {
            break;
        }
        sum = csum_diff(ptr_at::<[u8; CHUNK]>(ctx, off)?, CHUNK, sum);
        off += CHUNK;
    }
    // The rest (< 512 bytes): power-of-two pieces, sizes the helper needs
    // as constants, then up to 3 single bytes.
    macro_rules! piece {
        ($n:expr) => {
            if off + $n <= end {
                sum = csum_diff(ptr_at::<[u8; $n]>(ctx, off)?, $n, sum);
                off += $n;
            }
        };
    }
    piece!(256);
    piece!(128);
    piece!(64);
    piece!(32);
    piece!(16);
    piece!(8);
    piece!(4);
    // The last 0-3 bytes, copied by the helper (a direct 1-byte read at a
    // variable offset loses its bounds proof to the compiler's rewriting of
    // the check). A last odd byte is the first byte of a zero-padded word.
    let mut b = [0u8; 4];
    let rc = match end.saturating_sub(off) {
        0 => 0,
        1 => load_bytes(ctx, off, &mut b, 1),
        2 => load_bytes(ctx, off, &mut b, 2),
        _ => load_bytes(ctx, off, &mut b, 3),
    };
    if rc != 0 {
        return None;
    }
    let tail = u32::from(u16::from_ne_bytes([b[0], b[1]])) + u32::from(u16::from_ne_bytes([b[2], 0]));
    Some(csum::add(csum::fold32(sum), csum::fold32(tail)))
}

#[inline(always)]
fn load_bytes(ctx: &XdpContext, off: usize, buf: &mut [u8; 4], len: u32) -> i64 {
    // SAFETY: buf has room for `len` (at most 3) bytes; the helper checks
    // the packet bounds itself.
    unsafe { bpf_xdp_load_bytes(ctx.ctx, off as u32, buf.as_mut_ptr().cast(), len) }
}

#[inline(always)]
fn csum_diff<T>(p: *mut T, len: usize, seed: u32) -> u32 {
    // SAFETY: `p` points at `len` readable packet bytes (ptr_at checked).
    unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, p.cast::<u32>(), len as u32, seed) as u32 }
}

/// Whether the IPv4 packet has DF set.
#[inline(always)]
fn dont_fragment(pkt: &Packet) -> bool {
    // SAFETY: bounds-checked by parse().
    unsafe { u16::from_be((*pkt.ip()).frag_off) & 0x4000 != 0 }
}

/// Rewrite the destination address and port (client -> backend); the L4
/// checksum follows in [`send`].
#[inline(always)]
pub(crate) fn rewrite_dst(pkt: &Packet, addr: u32, port: u16) -> Rewrite {
    // SAFETY: every pointer in Packet was bounds-checked by parse().
    unsafe {
        let ip = pkt.ip();
        let old_addr = (*ip).daddr;
        let old_port = (*pkt.ports())[1];
        (*ip).daddr = addr;
        (*ip).check = csum::replace4((*ip).check, old_addr, addr);
        (*pkt.ports())[1] = port;
        Rewrite { old_addr, new_addr: addr, old_port, new_port: port }
    }
}

/// Rewrite the source address and port (backend -> client).
#[inline(always)]
pub(crate) fn rewrite_src(pkt: &Packet, addr: u32, port: u16) -> Rewrite {
    // SAFETY: every pointer in Packet was bounds-checked by parse().
    unsafe {
        let ip = pkt.ip();
        let old_addr = (*ip).saddr;
        let old_port = (*pkt.ports())[0];
        (*ip).saddr = addr;
        (*ip).check = csum::replace4((*ip).check, old_addr, addr);
        (*pkt.ports())[0] = port;
        Rewrite { old_addr, new_addr: addr, old_port, new_port: port }
    }
}

/// The kernel's forwarding path: the packet as rewritten so far, TTL and
/// MACs untouched (the kernel routes it, decrements the TTL, resolves the
/// neighbour), its checksum left unfinished if it came so.
#[inline(always)]
pub(crate) fn to_kernel(pkt: &Packet, rw: Rewrite, cs: L4Csum, reason: u32) -> u32 {
    update_l4(pkt, rw, cs, false);
    stats::count(reason);
    xdp_action::XDP_PASS
}

/// Bring the L4 checksum in line with the rewrite. An unfinished checksum
/// is finished first when the packet leaves by native XDP redirect (the
/// frame loses the skb's "finish me" mark on the way); otherwise it stays
/// unfinished, for the kernel or the device to finish.
#[inline(always)]
fn update_l4(pkt: &Packet, rw: Rewrite, cs: L4Csum, finish: bool) {
    // SAFETY: l4_check was bounds-checked by parse().
    unsafe {
        let mut old = *pkt.l4_check();
        match cs {
            // Kept unfinished (a segment too long to sum is only seen in
            // generic mode, which never finishes).
            L4Csum::Partial { done: Some(done) } if finish => old = done,
            L4Csum::Partial { .. } => {
                *pkt.l4_check() = csum::replace4_partial(old, rw.old_addr, rw.new_addr);
                return;
            }
            L4Csum::Full => {
                if pkt.proto == PROTO_UDP && old == 0 {
                    // UDP without checksum: leave it without one.
                    return;
                }
            }
        }
        let mut new = csum::replace_addr_port(old, rw.old_addr, rw.new_addr, rw.old_port, rw.new_port);
        if pkt.proto == PROTO_UDP && new == 0 {
            // 0 means "no checksum" in UDP; a computed 0 is sent as 0xffff.
            new = 0xffff;
        }
        *pkt.l4_check() = new;
    }
}

/// True when the packet may be forwarded by us (TTL would stay above 0).
#[inline(always)]
pub(crate) fn ttl_ok(pkt: &Packet) -> bool {
    // SAFETY: bounds-checked by parse().
    unsafe { (*pkt.ip()).ttl > 1 }
}

/// Seconds a cached next hop is used before the FIB is asked again.
const NEXT_HOP_TTL: u32 = 1;

/// The flags lbd gave the device `ifindex` (0 for a device it did not
/// describe), with its MTU above `NETDEV_MTU_SHIFT`.
#[inline(always)]
fn netdev(ifindex: u32) -> u32 {
    // SAFETY: the value is copied at once.
    unsafe { NETDEVS.get(&ifindex) }.copied().unwrap_or(0)
}

/// The slow path's verdict on the egress of a next hop the FIB just gave
/// (`nh.0`): false when a frame received on this packet's ingress device
/// cannot leave through it by XDP redirect (native XDP needs a device that
/// transmits redirected frames, NDO_XMIT; generic XDP any Ethernet device
/// that is up). Otherwise true, with the egress marked `HOP_TX` when it is
/// this packet's ingress and `XDP_TX` out of it works (`NETDEV_F_TX`), and
/// the hop cached in `hop` when it may be. Each device's flags are read
/// once. (The hop is changed in place: a hop returned by value costs the
/// callers' frames stack they do not have.)
///
/// The hop is cached only when the egress MTU is at least the ingress one,
/// so that no packet that arrives can be too big for it. A hop through a
/// narrower egress is looked up in the FIB for every packet, and the FIB
/// compares each packet's length with the route's MTU (`FIB_TOO_BIG`).
/// That costs the flows that cross into a smaller MTU a lookup per packet,
/// and every other packet nothing: a per-packet length check on the cached
/// path costs the verifier a second exploration of everything after it. A
/// device lbd has not described (MTU 0) is taken to be as wide as any.
///
/// Nor is a hop whose route the FIB found narrower than the ingress device
/// ([`HOP_NARROW`], see [`widen`]): a route's own MTU (`ip route ... mtu
/// lock`) is below its device's, and a later packet of the flow may not
/// fit it, though this one did.
#[inline(always)]
pub(crate) fn adopt_hop(ctx: &XdpContext, hop: Hop, nh: &mut NextHopAddr, now: u32, generation: u32) -> bool {
    // The mark stays in `nh` (a local held across the lookups below
    // would cost the callers' frames stack they have not got): the
    // egress is read without it, and `leave` and `to_tc` send without it.
    let ingress = ctx.ingress_ifindex() as u32;
    let in_flags = netdev(ingress);
    let one_arm = nh.0 & !HOP_NARROW == ingress;
    let out_flags = if one_arm { in_flags } else { netdev(nh.0 & !HOP_NARROW) };
    if !xmits(in_flags, out_flags) {
        return false;
    }
    if one_arm && out_flags & NETDEV_F_TX != 0 {
        nh.0 |= HOP_TX;
    }
    let out_mtu = out_flags >> NETDEV_MTU_SHIFT;
    if nh.0 & HOP_NARROW == 0 && (out_mtu == 0 || out_mtu >= in_flags >> NETDEV_MTU_SHIFT) {
        store_hop(ctx, hop, *nh, now, generation);
    }
    true
}

/// Set in a FIB answer's egress (`NextHopAddr::0`; never cached, and
/// masked off by [`leave`] and [`to_tc`]): the route's MTU is below the
/// ingress device's. Kernel ifindexes are positive `int`s handed out from
/// 1 up: bit 30, beside [`HOP_TX`]'s 31, is never one of theirs.
pub(crate) const HOP_NARROW: u32 = 1 << 30;

/// Widen the FIB question in `p`, whose length is the packet's own (or
/// its segments'), to the ingress device's MTU where that is more. A
/// packet up to the ingress MTU may arrive, and a hop is cached for every
/// later packet of its flow, so the route must take that much. Where the
/// FIB then answers "too big" but the packet itself fits the route's MTU,
/// the route is narrower than the device the flow arrives on (a route's
/// own `mtu`, below its device's): [`ask_narrow`] asks again by the
/// packet's own length and marks the hop [`HOP_NARROW`]. A route at least
/// as wide as the ingress answers the first question: one lookup, as
/// before.
///
/// The MTU comes from `bpf_check_mtu` (a length of 1 fits any device; the
/// helper answers the device's MTU whatever its verdict). The scratch slot
/// past the FIB parameters holds it (word 16, as in
/// [`beyond_ingress_mtu`]), then the packet's own length (word 17) for
/// [`ask_narrow`]: on this chain of frames a value held in a register
/// across the helper calls costs stack there is none of.
///
/// # Safety
/// `p` is this CPU's scratch slot, its question written.
#[inline(always)]
pub(crate) unsafe fn widen(ctx: &XdpContext, p: *mut FibParams) {
    // SAFETY: the caller's promise; the slot holds 72 bytes, the
    // parameters 64 (asserted below): both words are inside it, 4-aligned.
    unsafe {
        let w = p.cast::<u8>().add(size_of::<FibParams>()).cast::<u32>();
        let own = (*p).__bindgen_anon_1.tot_len;
        *w.add(1) = u32::from(own);
        *w = 1;
        bpf_check_mtu(ctx.ctx.cast(), 0, w, 0, 0);
        let mtu = *w;
        if mtu > u32::from(own) && mtu <= u32::from(u16::MAX) {
            (*p).__bindgen_anon_1.tot_len = mtu as u16;
        }
    }
}

/// After the widened question's answer `rc` ([`widen`]): where it is "too
/// big" for a route whose MTU the packet itself fits, the same question
/// again by the packet's own length (a "too big" answer wrote only the
/// MTU, over the length), its next hop marked [`HOP_NARROW`]. Otherwise
/// `rc` as it is.
///
/// # Safety
/// `p` is this CPU's scratch slot, [`widen`]ed and answered.
#[inline(always)]
pub(crate) unsafe fn ask_narrow(ctx: &XdpContext, p: *mut FibParams, rc: i64) -> i64 {
    // SAFETY: the caller's promise, as in `widen`.
    unsafe {
        let own = *p.cast::<u8>().add(size_of::<FibParams>() + 4).cast::<u32>();
        if rc != FIB_TOO_BIG || u32::from((*p).__bindgen_anon_1.mtu_result) < own {
            return rc;
        }
        (*p).__bindgen_anon_1.tot_len = own as u16;
        let rc = bpf_fib_lookup(ctx.ctx.cast(), p, size_of::<FibParams>() as i32, 0);
        if rc == FIB_OK {
            (*p).ifindex |= HOP_NARROW;
        }
        rc
    }
}

/// The longest frame of a 1,500-byte MTU, two VLAN tags included: no
/// frame up to this long needs [`gso`]'s helper call.
const PLAIN_FRAME: usize = ETH_HLEN + 8 + 1500;

/// Is the packet longer than its ingress device's MTU? Only a GSO packet
/// is, which only generic mode sees: the kernel's GRO merged it (a NIC's
/// or a veth's), or a local sender behind a veth left its segmentation to
/// offload. The kernel splits it when it leaves, but an XDP redirect
/// refuses any frame above the egress MTU (dropped, `xdp_redirect_err`
/// with EMSGSIZE): every bulk transfer through a generic-mode gateway
/// stalled, its segments lost but for the retransmissions that went one
/// at a time. Such a packet is never sent by a cached hop: the FIB is
/// asked for each (one per up to 64 KB), and compares it with the egress
/// MTU ([`gso_fits`]).
#[inline(always)]
pub(crate) fn gso(ctx: &XdpContext) -> bool {
    segments(ctx) != 0
}

/// For a GSO packet ([`gso`]), the longest its segments can be: the
/// ingress device's MTU. 0 for any other packet.
#[inline(always)]
pub(crate) fn segments(ctx: &XdpContext) -> u32 {
    if ctx.data_end() - ctx.data() > PLAIN_FRAME { beyond_ingress_mtu(ctx) } else { 0 }
}

/// The ingress device's MTU, as the kernel has it now, when the frame is
/// longer than it allows; 0 when it is not (`bpf_check_mtu` with no
/// device named: the packet's own). The helper's in-out length lives in
/// this CPU's scratch slot, past the FIB parameters (a word on the stack
/// took the IPv6 path's chain of frames past the verifier's 512 bytes);
/// nothing reads the slot after this but a FIB lookup's answers.
// Its own frame: only frames longer than `PLAIN_FRAME` call it.
#[inline(never)]
fn beyond_ingress_mtu(ctx: &XdpContext) -> u32 {
    let Some(slot) = SCRATCH6.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: the slot holds 72 bytes, the FIB parameters 64 (asserted
    // below): the word after them is inside it and 4-aligned. 0 asks the
    // helper to check the frame's own length; it answers the MTU there.
    unsafe {
        let mtu_len = slot.cast::<u8>().add(size_of::<FibParams>()).cast::<u32>();
        *mtu_len = 0;
        let rc = bpf_check_mtu(ctx.ctx.cast(), 0, mtu_len, 0, 0);
        if rc == i64::from(BPF_MTU_CHK_RET_FRAG_NEEDED) { *mtu_len } else { 0 }
    }
}

/// Does a GSO packet ([`gso`]) that the FIB found too big for its egress
/// (`egress_mtu`) fit it as the segments it stands for? Each is no longer
/// than the ingress MTU, so through an egress at least as wide the
/// kernel's forwarding path takes the packet rewritten (its checksum left
/// unfinished, as a GSO packet's always is) and splits it. Through a
/// narrower egress it is too big as any packet can be
/// ([`too_big_rewritten`]): the sender hears of it and sends less. False
/// for a frame within the ingress MTU.
// Its own frame: only packets the FIB finds too big call it.
#[inline(never)]
pub(crate) fn gso_fits(ctx: &XdpContext, egress_mtu: u32) -> bool {
    let ingress_mtu = beyond_ingress_mtu(ctx);
    ingress_mtu != 0 && ingress_mtu <= egress_mtu
}

/// Does the program run in generic mode on the packet's ingress device?
#[inline(always)]
pub(crate) fn generic_ingress(ctx: &XdpContext) -> bool {
    netdev(ctx.ingress_ifindex() as u32) & NETDEV_F_GENERIC != 0
}

/// Can a frame received on this packet's ingress device leave by XDP
/// redirect through `egress`? Native XDP needs a device that transmits
/// redirected frames (NDO_XMIT); generic XDP any Ethernet device that is up.
#[inline(always)]
pub(crate) fn can_redirect(ctx: &XdpContext, egress: u32) -> bool {
    xmits(netdev(ctx.ingress_ifindex() as u32), netdev(egress))
}

/// Whether a device with flags `out_flags` transmits frames redirected by
/// the program on a device with flags `in_flags`: the XMIT flag of the
/// ingress's mode.
#[inline(always)]
fn xmits(in_flags: u32, out_flags: u32) -> bool {
    let need = if in_flags & NETDEV_F_GENERIC != 0 { NETDEV_F_XMIT_GENERIC } else { NETDEV_F_XMIT_NATIVE };
    out_flags & need != 0
}

/// Where a packet's next hop is cached.
#[derive(Clone, Copy)]
pub(crate) enum Hop {
    /// Towards backend `id` at `addr` (forward packets): `NEXT_HOPS`, one
    /// slot per backend, shared by all its flows.
    Backend { id: u32, addr: u32 },
    /// Towards a client (replies): the flow entry's own cache.
    Flow(*mut Flow),
    /// The same, for an IPv6 flow.
    Flow6(*mut Flow6),
    /// Towards a client, for a reply without a flow entry: no cache, the
    /// FIB is asked every time.
    Uncached,
}

/// A next hop: egress ifindex, source MAC, destination MAC.
pub(crate) type NextHopAddr = (u32, [u8; 6], [u8; 6]);

/// The cached next hop, if fresh: looked up under this device generation
/// less than [`NEXT_HOP_TTL`] seconds ago (and, for a backend's, for this
/// address and ingress device). Fields are copied out; no reference to
/// the map value is held (other CPUs refresh it).
#[inline(always)]
pub(crate) fn cached_hop(ctx: &XdpContext, hop: Hop, now: u32, generation: u32) -> Option<NextHopAddr> {
    let fresh =
        |ifindex: u32, time: u32, g: u32| ifindex != 0 && now.wrapping_sub(time) <= NEXT_HOP_TTL && g == generation;
    match hop {
        Hop::Backend { id, addr } => {
            let h = NEXT_HOPS.get_ptr(id)?;
            // SAFETY: a valid, aligned map value; plain loads.
            unsafe {
                let ok = fresh((*h).ifindex, (*h).time, (*h).generation)
                    && (*h).addr == addr
                    && (*h).ingress == ctx.ingress_ifindex() as u32;
                ok.then(|| ((*h).ifindex, (*h).smac, (*h).dmac))
            }
        }
        // SAFETY: a valid flow-table value; plain loads.
        Hop::Flow(e) => unsafe {
            fresh((*e).nh_ifindex, (*e).nh_time, (*e).nh_gen).then(|| ((*e).nh_ifindex, (*e).nh_smac, (*e).nh_dmac))
        },
        // SAFETY: as above.
        Hop::Flow6(e) => unsafe {
            fresh((*e).nh_ifindex, (*e).nh_time, (*e).nh_gen).then(|| ((*e).nh_ifindex, (*e).nh_smac, (*e).nh_dmac))
        },
        Hop::Uncached => None,
    }
}

/// Cache a next hop just looked up. Another CPU may read a half-written
/// one at worst once (when the hop changed); ifindex is written last.
#[inline(always)]
pub(crate) fn store_hop(ctx: &XdpContext, hop: Hop, nh: NextHopAddr, now: u32, generation: u32) {
    match hop {
        Hop::Backend { id, addr } => {
            if let Some(h) = NEXT_HOPS.get_ptr_mut(id) {
                // SAFETY: a valid, aligned map value; plain stores.
                unsafe {
                    (*h).addr = addr;
                    (*h).ingress = ctx.ingress_ifindex() as u32;
                    (*h).time = now;
                    (*h).generation = generation;
                    (*h).smac = nh.1;
                    (*h).dmac = nh.2;
                    core::ptr::write_volatile(&raw mut (*h).ifindex, nh.0);
                }
            }
        }
        // SAFETY: a valid flow-table value; plain stores.
        Hop::Flow(e) => unsafe {
            (*e).nh_time = now;
            (*e).nh_gen = generation;
            (*e).nh_smac = nh.1;
            (*e).nh_dmac = nh.2;
            core::ptr::write_volatile(&raw mut (*e).nh_ifindex, nh.0);
        },
        // SAFETY: as above.
        Hop::Flow6(e) => unsafe {
            (*e).nh_time = now;
            (*e).nh_gen = generation;
            (*e).nh_smac = nh.1;
            (*e).nh_dmac = nh.2;
            core::ptr::write_volatile(&raw mut (*e).nh_ifindex, nh.0);
        },
        Hop::Uncached => {}
    }
}

/// Which way a rewritten packet goes, for what happens when it is too big.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// Client -> backend (destination rewritten).
    Forward,
    /// Backend -> client (source rewritten).
    Reply,
}

/// Send the (already rewritten) packet to its next hop, decrementing the
/// TTL as a router does, or hand it to the kernel's forwarding path. The
/// next hop comes from its cache (`hop`) when fresh, else from the kernel
/// FIB, checked against what the egress device can take, and then cached.
/// The kernel path gets the packet with its TTL and MACs as they came (the
/// kernel decrements the TTL itself), counted by reason.
#[inline(always)]
pub(crate) fn send(ctx: &XdpContext, pkt: &Packet, rw: Rewrite, cs: L4Csum, hop: Hop, now: u64, way: Way) -> u32 {
    let now = now as u32;
    let generation = NETDEV_GEN.get(0).copied().unwrap_or(0);
    let cached = if gso(ctx) { None } else { cached_hop(ctx, hop, now, generation) };
    let (ifindex, smac, dmac) = if let Some(nh) = cached {
        nh
    } else {
        let mut nh: NextHopAddr = (0, [0; 6], [0; 6]);
        // SAFETY: bounds-checked by parse().
        let dst = unsafe { (*pkt.ip()).daddr };
        match fib_lookup(ctx, pkt, dst, 0, &mut nh) {
            FIB_OK => {}
            FIB_TOO_BIG if gso_fits(ctx, nh.0) => return to_kernel(pkt, rw, cs, counter::KERNEL_EGRESS),
            FIB_TOO_BIG => return too_big_rewritten(ctx, pkt, &Oversize { rw, cs, way, mtu: nh.0 }),
            _ => return to_kernel(pkt, rw, cs, counter::FIB_FALLBACK),
        }
        if !adopt_hop(ctx, hop, &mut nh, now, generation) {
            return to_kernel(pkt, rw, cs, counter::KERNEL_EGRESS);
        }
        nh
    };
    let finish = matches!(cs, L4Csum::Partial { .. }) && !generic_ingress(ctx);
    update_l4(pkt, rw, cs, finish);
    // SAFETY: bounds-checked by parse().
    unsafe {
        let ip = pkt.ip();
        // TTL is the high byte of the 16-bit word it shares with the protocol.
        let old = u16::from((*ip).ttl) << 8 | u16::from((*ip).proto);
        (*ip).ttl -= 1;
        let new = u16::from((*ip).ttl) << 8 | u16::from((*ip).proto);
        (*ip).check = csum::replace2((*ip).check, old.to_be(), new.to_be());
    }
    set_macs(pkt.eth(), smac, dmac);
    leave(ctx, ifindex)
}

/// Send the finished frame out of the next hop's egress `hop_if` (marked
/// by [`adopt_hop`]), which it judged able to take it: back out
/// of the device it came in on by `XDP_TX` where that works (a one-arm
/// gateway, Katran's setup: no helper call, and a NIC sends it from the
/// queue it came in on), by redirect otherwise. The mark is checked
/// against this packet's ingress: a flow entry's cached hop serves
/// replies whichever device they arrive on. Counted in `xdp_redirect`
/// either way, so that `xdp_redirect`, `fib_fallback` and
/// `kernel_egress` still add up to the forwarded packets, and `XDP_TX`
/// also in `xdp_tx`.
#[inline(always)]
pub(crate) fn leave(ctx: &XdpContext, hop_if: u32) -> u32 {
    stats::count(counter::XDP_REDIRECT);
    let ifindex = hop_if & !(HOP_TX | HOP_NARROW);
    if hop_if & HOP_TX != 0 && ifindex == ctx.ingress_ifindex() as u32 {
        stats::count(counter::XDP_TX);
        return xdp_action::XDP_TX;
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as u32 }
}

/// Write a next hop's MACs into the Ethernet header.
#[inline(always)]
pub(crate) fn set_macs(eth: *mut EthHdr, smac: [u8; 6], dmac: [u8; 6]) {
    let eth = eth.cast::<u8>();
    // SAFETY: the caller's header was bounds-checked (14 bytes). Byte
    // stores: an array assignment here compiles to a call of a memmove
    // subprogram, which costs more than the copy.
    unsafe {
        for i in 0..6 {
            core::ptr::write_volatile(eth.add(i), dmac[i]);
            core::ptr::write_volatile(eth.add(6 + i), smac[i]);
        }
    }
}

/// A rewritten packet too big for its egress (`mtu`): never redirected,
/// since a redirected frame above the egress MTU is dropped silently.
/// Without DF, the kernel gets it rewritten and fragments it. With DF, the
/// sender must hear "fragmentation needed" about the packet it sent, as
/// it sent it: a reply goes back to the kernel as it came (backend ->
/// client), and the kernel's ICMP error reaches the backend with the
/// header the backend knows; a forward packet is answered here, from the
/// VIP, since the kernel's own error would name the backend the client
/// never heard of.
// Its own frame, off the path of every packet that fits.
#[inline(never)]
fn too_big_rewritten(ctx: &XdpContext, pkt: &Packet, o: &Oversize) -> u32 {
    if !dont_fragment(pkt) {
        return to_kernel(pkt, o.rw, o.cs, counter::TOO_BIG);
    }
    stats::count(counter::TOO_BIG);
    match o.way {
        Way::Reply => {
            rewrite_src(pkt, o.rw.old_addr, o.rw.old_port);
            xdp_action::XDP_PASS
        }
        Way::Forward => {
            rewrite_dst(pkt, o.rw.old_addr, o.rw.old_port);
            icmp4_too_big(ctx, o.mtu)
        }
    }
}

/// A rewritten packet found too big, and for which egress MTU.
pub(crate) struct Oversize {
    rw: Rewrite,
    cs: L4Csum,
    way: Way,
    mtu: u32,
}

/// L2 direct server return: the packet leaves unchanged but for its MACs,
/// towards backend `id` at `addr`, which must be on a directly connected
/// network; the next hop is cached per backend. The TTL is left alone:
/// the backend, not this hop, is the packet's destination host on the
/// VIP's behalf.
// Its own frame: DSR services are the exception, and the main frame has
// no room for this path's locals.
#[inline(never)]
pub(crate) fn send_dsr(ctx: &XdpContext, pkt: &Packet, id: u32, addr: u32, now: u64) -> u32 {
    let now = now as u32;
    let generation = NETDEV_GEN.get(0).copied().unwrap_or(0);
    let hop = Hop::Backend { id, addr };
    let (ifindex, smac, dmac) = if let Some(nh) = cached_hop(ctx, hop, now, generation) {
        nh
    } else {
        let mut nh: NextHopAddr = (0, [0; 6], [0; 6]);
        // A GSO packet is asked of the FIB by its segments' length, and a
        // hop is cached only where they fit (see `adopt_hop`).
        match fib_lookup(ctx, pkt, addr, ON_LINK | segments(ctx) << ASK_LEN_SHIFT, &mut nh) {
            FIB_OK => {}
            FIB_TOO_BIG => return dsr_too_big(ctx, pkt, nh.0),
            // Not resolved yet: the kernel resolves the neighbour when it
            // forwards; a DSR packet cannot take that path (it is
            // addressed to the VIP), so ask the kernel to resolve the
            // backend and drop this one (the sender retransmits).
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
    set_macs(pkt.eth(), smac, dmac);
    if gso(ctx) {
        return to_tc(ctx, ifindex);
    }
    leave(ctx, ifindex)
}

/// Bytes of XDP metadata the handoff to `lb_tc` takes (`to_tc`,
/// `tc_handoff`).
const HANDOFF_LEN: usize = size_of::<TcHandoff>();

/// A GSO packet of a DSR service ([`segments`]), its MACs set for the
/// backend, is handed to lbd's tc program on this device with the egress
/// in its metadata ([`TcHandoff`]), and redirected from there as the skb
/// it is: an XDP redirect would drop it (longer than the egress MTU), and
/// the kernel's forwarding cannot send it (it is addressed to the VIP).
/// Counted in `kernel_egress`. Where the tc program is missing (lbd not
/// running), the kernel drops the packet, as the redirect would have.
// Its own frame: only GSO packets, in generic mode, call it.
#[inline(never)]
pub(crate) fn to_tc(ctx: &XdpContext, hop_if: u32) -> u32 {
    // SAFETY: a plain helper call on the program's own context.
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx.cast(), -(HANDOFF_LEN as i32)) } != 0 {
        return xdp_action::XDP_DROP;
    }
    let meta = ctx.metadata();
    if meta + HANDOFF_LEN > ctx.data() {
        return xdp_action::XDP_DROP;
    }
    let handoff = TcHandoff { magic: TC_HANDOFF_MAGIC, ifindex: hop_if & !(HOP_TX | HOP_NARROW) };
    // SAFETY: bounds-checked just above; the metadata area is 4-aligned.
    unsafe { core::ptr::write(meta as *mut TcHandoff, handoff) };
    stats::count(counter::KERNEL_EGRESS);
    xdp_action::XDP_PASS
}

/// lbd's tc ingress program (`lb_tc`): a packet the XDP program handed on
/// ([`to_tc`]) is redirected to the egress its metadata names. Any other
/// goes on untouched, with no verdict of ours (`TC_ACT_UNSPEC`, TCX's
/// "next"): the device's other tc programs, an operator's attached after
/// ours, still see it and decide (`TC_ACT_OK` would end the chain here).
#[inline(always)]
pub(crate) fn tc_handoff(ctx: &TcContext) -> i32 {
    let skb = ctx.skb.skb;
    // SAFETY: the program's own context; plain loads.
    let (meta, data) = unsafe { ((*skb).data_meta as usize, (*skb).data as usize) };
    if meta + HANDOFF_LEN > data {
        return TC_ACT_UNSPEC;
    }
    // SAFETY: bounds-checked just above.
    let handoff = unsafe { core::ptr::read(meta as *const TcHandoff) };
    if handoff.magic != TC_HANDOFF_MAGIC {
        return TC_ACT_UNSPEC;
    }
    // SAFETY: a plain helper call.
    unsafe { bpf_redirect(handoff.ifindex, 0) as i32 }
}

/// A DSR packet leaves unchanged but for its MACs, and by native XDP
/// redirect it loses the skb's "finish me" mark: an unfinished L4 checksum
/// (a local sender behind a veth) is finished first, or the backend would
/// drop the packet. In generic mode the skb keeps the mark and the
/// checksum stays for the kernel or the device to finish.
// Its own frame: its branches would otherwise double the verifier's walk
// of everything after it.
#[inline(never)]
pub(crate) fn finish_for_dsr(ctx: &XdpContext, pkt: &Packet) {
    if generic_ingress(ctx) {
        return;
    }
    if let L4Csum::Partial { done: Some(done) } = classify(ctx, pkt) {
        // SAFETY: l4_check was bounds-checked by parse().
        unsafe { *pkt.l4_check() = done };
    }
}

/// A DSR packet too big for the way to its backend: with DF, answered
/// from the VIP with "fragmentation needed"; without, dropped (the kernel
/// cannot fragment a packet addressed to the VIP towards the backend).
#[inline(always)]
fn dsr_too_big(ctx: &XdpContext, pkt: &Packet, mtu: u32) -> u32 {
    stats::count(counter::TOO_BIG);
    if dont_fragment(pkt) { icmp4_too_big(ctx, mtu) } else { xdp_action::XDP_DROP }
}

/// The ICMP "fragmentation needed" sent for an IPv4 packet, in place of
/// the packet: IP header + ICMP header + the packet's IP header and first
/// 8 bytes of payload.
const ICMP4_TOO_BIG_LEN: usize = 20 + 8 + 20 + 8;

/// Turn the (IPv4, DF, too big) packet into ICMP "fragmentation needed"
/// (type 3 code 4, next-hop MTU `mtu`) from the address it was sent to,
/// for its sender, handed to the kernel's forwarding path (which routes it
/// back; the frame keeps its MACs, addressed to this gateway). Not XDP_TX:
/// on a veth pair in native mode the frame sent back never reached the
/// sender in the lab (the kernel path did), and an error is rare enough
/// for the kernel's routing. A packet with IP options is dropped instead
/// (rare; the error must quote the header whole).
///
/// Built in place: the frame grows by the new IP and ICMP headers in
/// front, so the packet's own IP header and first 8 bytes of payload,
/// which the error quotes, stay where they are; the old Ethernet header is
/// read from where it now sits before the new headers cover it.
#[inline(never)]
fn icmp4_too_big(ctx: &XdpContext, mtu: u32) -> u32 {
    let Some(ip) = ptr_at::<Ipv4Hdr>(ctx, ETH_HLEN) else {
        return xdp_action::XDP_DROP;
    };
    // SAFETY: bounds-checked just above. The quoted header and 8 bytes of
    // payload must be there.
    if unsafe { (*ip).version_ihl } != 0x45 || ptr_at::<[u8; 28]>(ctx, ETH_HLEN).is_none() {
        return xdp_action::XDP_DROP;
    }
    // SAFETY: plain helper calls on the program's own context.
    unsafe {
        if bpf_xdp_adjust_head(ctx.ctx.cast(), -(ICMP4_GROW as i32)) != 0 {
            return xdp_action::XDP_DROP;
        }
        let len = (ctx.data_end() - ctx.data()) as i32;
        if bpf_xdp_adjust_tail(ctx.ctx.cast(), (ETH_HLEN + ICMP4_TOO_BIG_LEN) as i32 - len) != 0 {
            return xdp_action::XDP_DROP;
        }
    }
    let Some(frame) = ptr_at::<[u16; (ETH_HLEN + ICMP4_TOO_BIG_LEN) / 2]>(ctx, 0) else {
        return xdp_action::XDP_DROP;
    };
    let w = frame.cast::<u16>();
    // Word offsets: the old Ethernet header now starts at word 14, the
    // quoted IP header at word 21 (its source at 27, destination at 29).
    const OLD_ETH: usize = ICMP4_GROW / 2;
    const QUOTED: usize = OLD_ETH + ETH_HLEN / 2;
    // SAFETY: every word index is below the 35 words bounds-checked above.
    unsafe {
        // Ethernet first (its words are the next to be covered), as it
        // came: addressed to this gateway, for the kernel to route.
        for i in 0..6 {
            *w.add(i) = *w.add(OLD_ETH + i);
        }
        *w.add(6) = crate::parse::ETH_P_IP.to_be();
        // IP: 0x45, tos 0, length, id 0, no fragment bits, TTL 64,
        // protocol 1 (ICMP), checksum, source = where the packet went,
        // destination = its sender.
        *w.add(7) = u16::from_ne_bytes([0x45, 0]);
        *w.add(8) = (ICMP4_TOO_BIG_LEN as u16).to_be();
        *w.add(9) = 0;
        *w.add(10) = 0;
        *w.add(11) = u16::from_ne_bytes([64, 1]);
        *w.add(12) = 0;
        *w.add(13) = *w.add(QUOTED + 8);
        *w.add(14) = *w.add(QUOTED + 9);
        *w.add(15) = *w.add(QUOTED + 6);
        *w.add(16) = *w.add(QUOTED + 7);
        // ICMP: type 3 (unreachable), code 4 (fragmentation needed),
        // checksum, unused, next-hop MTU.
        *w.add(17) = u16::from_ne_bytes([ICMP_UNREACH, ICMP_FRAG_NEEDED]);
        *w.add(18) = 0;
        *w.add(19) = 0;
        *w.add(20) = (mtu.min(0xffff) as u16).to_be();
        let mut sum: u32 = 0;
        for i in 7..17 {
            sum += u32::from(*w.add(i));
        }
        *w.add(12) = !csum::fold32(sum);
        let mut sum: u32 = 0;
        for i in 17..(ETH_HLEN + ICMP4_TOO_BIG_LEN) / 2 {
            sum += u32::from(*w.add(i));
        }
        *w.add(18) = !csum::fold32(sum);
    }
    xdp_action::XDP_PASS
}

/// What the ICMP error adds in front of the quoted packet: IP and ICMP headers.
const ICMP4_GROW: usize = 20 + 8;

/// `fib_lookup` results: resolved; too big for the route's MTU (the
/// MTU in the next hop's ifindex slot); no resolved neighbour; anything
/// else (no route, not forwarded, blackhole...); for DSR, a next hop
/// that is not the destination itself (a gateway).
pub(crate) const FIB_OK: i64 = BPF_FIB_LKUP_RET_SUCCESS as i64;
pub(crate) const FIB_TOO_BIG: i64 = BPF_FIB_LKUP_RET_FRAG_NEEDED as i64;
pub(crate) const FIB_NO_NEIGH: i64 = aya_ebpf::bindings::BPF_FIB_LKUP_RET_NO_NEIGH as i64;
pub(crate) const FIB_OFF_LINK: i64 = -1000;

/// Whether the packet, as it is now, is addressed to the gateway itself
/// (the FIB does not forward it: a local, broadcast or multicast address).
#[inline(always)]
pub(crate) fn to_gateway(ctx: &XdpContext, pkt: &Packet) -> bool {
    let mut nh: NextHopAddr = (0, [0; 6], [0; 6]);
    // SAFETY: bounds-checked by parse().
    let dst = unsafe { (*pkt.ip()).daddr };
    fib_lookup(ctx, pkt, dst, 0, &mut nh) == i64::from(BPF_FIB_LKUP_RET_NOT_FWDED)
}

/// The FIB's answer for the packet as it is now, towards `dst`, asked as
/// `ask` says ([`ON_LINK`], [`ASK_LEN_SHIFT`]): a `BPF_FIB_LKUP_RET_*`
/// code, or [`FIB_OFF_LINK`] when [`ON_LINK`] asks for a directly
/// connected destination and the FIB names a gateway; on
/// success the next hop in `out` (marked [`HOP_NARROW`] where the route
/// is narrower than the ingress device, see [`widen`]), when too big
/// the MTU in `out.0`.
// Its own stack frame: the 64-byte parameters would otherwise add to the
// caller's (inlined) frame and overflow the 512-byte BPF stack.
#[inline(never)]
fn fib_lookup(ctx: &XdpContext, pkt: &Packet, dst: u32, ask: u32, out: &mut NextHopAddr) -> i64 {
    let Some(p) = fib_params() else {
        return -1;
    };
    // SAFETY: this CPU's scratch slot, zeroed; bounds-checked by parse().
    let rc = unsafe {
        let ip = pkt.ip();
        (*p).family = AF_INET;
        (*p).l4_protocol = pkt.proto;
        (*p).__bindgen_anon_1.tot_len = fib_len(ask, u16::from_be((*ip).tot_len));
        (*p).__bindgen_anon_2.tos = (*ip).tos;
        (*p).__bindgen_anon_3.ipv4_src = (*ip).saddr;
        (*p).__bindgen_anon_4.ipv4_dst = dst;
        (*p).ifindex = ctx.ingress_ifindex() as u32;
        widen(ctx, p);
        let rc = bpf_fib_lookup(ctx.ctx.cast(), p, size_of::<FibParams>() as i32, 0);
        ask_narrow(ctx, p, rc)
    };
    // SAFETY: the helper wrote its answer into the slot; plain loads.
    unsafe {
        if rc == FIB_OK {
            // The helper wrote the next hop's address (the gateway, if the
            // route has one) over the destination.
            if ask & ON_LINK != 0 && (*p).__bindgen_anon_4.ipv4_dst != dst {
                return FIB_OFF_LINK;
            }
            *out = ((*p).ifindex, (*p).smac, (*p).dmac);
        } else if rc == FIB_TOO_BIG {
            // On this result the helper wrote the MTU into the union.
            out.0 = u32::from((*p).__bindgen_anon_1.mtu_result);
        }
    }
    rc
}

/// A FIB lookup's question (`ask`): the next hop must be the destination
/// itself, on a directly connected network, or the answer is
/// [`FIB_OFF_LINK`].
pub(crate) const ON_LINK: u32 = 1;
/// A FIB lookup's question: above this bit, the length to compare with the
/// route's MTU in place of the packet's own (0: none given). A GSO packet
/// ([`gso`]) gives its segments' ([`segments`]). (IPv6 asks otherwise,
/// see `v6::ASK_SEGMENTS`. Here, the segments found in the lookup's own
/// frame take the chain of frames one deeper, past the verifier's 512
/// bytes.)
pub(crate) const ASK_LEN_SHIFT: u32 = 16;

/// The length a FIB lookup compares with the route's MTU: the one `ask`
/// gives, or the packet's own, `own`.
#[inline(always)]
fn fib_len(ask: u32, own: u16) -> u16 {
    let given = (ask >> ASK_LEN_SHIFT) as u16;
    if given != 0 { given } else { own }
}

/// The FIB helper's parameters, zeroed, in this CPU's scratch slot
/// (`SCRATCH6`, 72 bytes, otherwise only where an IPv6 flow's entry is
/// built, which is done before any FIB lookup): 64 bytes the 512-byte
/// stack has no room for.
#[inline(always)]
pub(crate) fn fib_params() -> Option<*mut FibParams> {
    let p = SCRATCH6.get_ptr_mut(0)?.cast::<FibParams>();
    // Zero the parameters word by word: `mem::zeroed()` compiles to a call
    // of a byte-loop memset subprogram. The helper reads the whole struct.
    let words = p.cast::<u64>();
    // SAFETY: the slot holds 72 bytes, 8-aligned (asserted below).
    unsafe {
        for i in 0..size_of::<FibParams>() / 8 {
            core::ptr::write_volatile(words.add(i), 0);
        }
    }
    Some(p)
}

const _: () = assert!(size_of::<FibParams>().is_multiple_of(8));
// The two words past the parameters (`beyond_ingress_mtu`, `widen`).
const _: () = assert!(size_of::<FibParams>() + 8 <= size_of::<Flow6>());
const _: () = assert!(align_of::<FibParams>() <= align_of::<Flow6>());

//! ICMP errors about balanced flows, translated both ways as the kernel's
//! conntrack does for related ICMP: programs of their own (`lb_icmp`,
//! `lb_icmp6`), tail-called by the balancer for every ICMP error it sees,
//! so that the verifier checks them apart and TCP/UDP packets pay nothing.
//!
//! - An error from the backend side about a client -> backend packet (the
//!   quoted header runs from the client to a backend endpoint, and the
//!   client's flow towards the VIP the endpoint names has that backend, or
//!   the backend's tuple has a reply entry, which names the VIP of a
//!   service that shares the endpoint):
//!   the quoted destination is rewritten back to the VIP and port, so the
//!   client's stack finds its socket. The error then goes on to the client.
//! - An error from the client side about a reply (addressed to the VIP,
//!   quoting VIP -> client): the flow's backend is found (flow table, or
//!   the consistent hash when it has no entry). NAT: the quoted source and
//!   the destination become the backend's, and the kernel routes it there.
//!   DSR: "fragmentation needed" / "packet too big" goes unchanged to the
//!   backend's MAC (the backend holds the VIP and sent the reply).
//!
//! Every checksum stays valid: the quoted IPv4 header's, the quoted
//! TCP/UDP checksum when the quote holds it, the ICMP checksum (and for
//! ICMPv6 its pseudo-header). A quote with IPv4 options or IPv6 extension
//! headers, and errors about anything else, go to the kernel untouched.
use aya_ebpf::{bindings::xdp_action, helpers::generated::bpf_redirect, macros::xdp, programs::XdpContext};
use lb_common::{
    BACKEND_F_V6, BACKEND_NONE, DIR_DSR, DIR_REPLY, EndpointKey, FlowKey, FlowKey6, KEY_REPLY, PROTO_TCP, PROTO_UDP,
    SVC_F_DSR, Service, Vip6Key, VipKey, counter, fold6,
};
use lb_ebpf::csum;

use crate::{
    forward::{FIB_OK, can_redirect, fib_params, set_macs},
    maps::{BACKEND_ADDRS6, BACKENDS, ENDPOINTS, ENDPOINTS6, KEYS6, VIPS, VIPS6},
    parse::{
        ETH_HLEN, EthHdr, ICMP_FRAG_NEEDED, ICMP_PARAM_PROBLEM, ICMP_TIME_EXCEEDED, ICMP_UNREACH, ICMP6_PARAM_PROBLEM,
        ICMP6_TIME_EXCEEDED, ICMP6_TOO_BIG, ICMP6_UNREACH, IP6_HLEN, ptr_at,
    },
    select, stats, table,
};

use aya_ebpf::{bindings::bpf_fib_lookup as FibParams, helpers::generated::bpf_fib_lookup};
use core::mem::size_of;

/// Offsets in an IPv4 ICMP error without IP options, quoting a header
/// without options.
const IP: usize = ETH_HLEN;
const ICMP: usize = IP + 20;
const Q_IP: usize = ICMP + 8;
const Q_L4: usize = Q_IP + 20;

/// The same for IPv6 (no extension headers outside or in the quote).
const IP6: usize = ETH_HLEN;
const ICMP6: usize = IP6 + IP6_HLEN;
const Q_IP6: usize = ICMP6 + 8;
const Q_L46: usize = Q_IP6 + IP6_HLEN;

/// Byte offset of the checksum in a TCP and a UDP header.
const TCP_CHECK: usize = 16;
const UDP_CHECK: usize = 6;

#[inline(always)]
fn word(ctx: &XdpContext, off: usize) -> Option<*mut u16> {
    ptr_at::<u16>(ctx, off)
}

#[inline(always)]
fn addr4(ctx: &XdpContext, off: usize) -> Option<*mut u32> {
    ptr_at::<u32>(ctx, off)
}

/// Replace the 16-bit word at `off` and fold the change into the
/// checksums at `sums` (each a word offset, 0 for none). Wider fields are
/// written word by word through it (`set32`, `set128`): a checksum takes
/// the change of each word alike.
#[inline(always)]
fn set16(ctx: &XdpContext, off: usize, new: u16, sums: [usize; 3]) -> Option<()> {
    let p = word(ctx, off)?;
    // SAFETY: bounds-checked by ptr_at.
    let old = unsafe { *p };
    // SAFETY: as above.
    unsafe { *p = new };
    for s in sums {
        if s != 0 {
            let c = word(ctx, s)?;
            // SAFETY: bounds-checked by ptr_at.
            unsafe { *c = csum::replace2(*c, old, new) };
        }
    }
    Some(())
}

/// Replace the 32-bit word at `off` (as it sits in the packet).
#[inline(always)]
fn set32(ctx: &XdpContext, off: usize, new: u32, sums: [usize; 3]) -> Option<()> {
    let b = new.to_ne_bytes();
    set16(ctx, off, u16::from_ne_bytes([b[0], b[1]]), sums)?;
    set16(ctx, off + 2, u16::from_ne_bytes([b[2], b[3]]), sums)
}

/// Replace the 16 bytes at `off`.
#[inline(always)]
fn set128(ctx: &XdpContext, off: usize, new: &[u32; 4], sums: [usize; 3]) -> Option<()> {
    for (i, &w) in new.iter().enumerate() {
        set32(ctx, off + 4 * i, w, sums)?;
    }
    Some(())
}

/// The offset of the quoted TCP/UDP checksum if the quote (which ends at
/// `end`, the outer packet's end) holds it (and, for UDP, if it is not
/// "none"), else 0.
#[inline(always)]
fn quoted_l4_check(ctx: &XdpContext, l4: usize, proto: u8, end: usize) -> usize {
    let off = l4 + if proto == PROTO_TCP { TCP_CHECK } else { UDP_CHECK };
    // Verifier: the frame bound first, then the packet's own end. The
    // other way round the compiler drops the frame check as implied (end
    // lies inside the frame), and the verifier, which does not follow
    // `end`, refuses the read.
    let Some(c) = word(ctx, off) else {
        return 0;
    };
    // SAFETY: bounds-checked by ptr_at.
    let v = unsafe { core::ptr::read_volatile(c) };
    if off + 2 > end || (proto == PROTO_UDP && v == 0) { 0 } else { off }
}

#[xdp]
pub(crate) fn lb_icmp(ctx: XdpContext) -> u32 {
    icmp4(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

#[inline(always)]
fn icmp4(ctx: &XdpContext) -> Option<u32> {
    // The outer header without options, an error type, a quoted header
    // without options for TCP/UDP, and its ports.
    let hdr = ptr_at::<[u8; Q_L4 + 4]>(ctx, 0)?;
    // SAFETY: bounds-checked by ptr_at.
    let h = unsafe { &*hdr };
    let kind = h[ICMP];
    let proto = h[Q_IP + 9];
    if h[IP] != 0x45
        || h[IP + 9] != 1
        || !matches!(kind, ICMP_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAM_PROBLEM)
        || h[Q_IP] != 0x45
        || (proto != PROTO_TCP && proto != PROTO_UDP)
    {
        return None;
    }
    let frag_needed = kind == ICMP_UNREACH && h[ICMP + 1] == ICMP_FRAG_NEEDED;
    // The packet holds what it claims, and its claim holds the quoted
    // ports: nothing past its end (padding) is touched.
    let end = ETH_HLEN + usize::from(u16::from_be_bytes([h[IP + 2], h[IP + 3]]));
    if end < Q_L4 + 4 || end > ctx.data_end() - ctx.data() {
        return None;
    }
    // SAFETY: bounds-checked above (the whole range up to the ports).
    let (outer_dst, q_src, q_dst, q_sport, q_dport) = unsafe {
        (
            *addr4(ctx, IP + 16)?,
            *addr4(ctx, Q_IP + 12)?,
            *addr4(ctx, Q_IP + 16)?,
            *word(ctx, Q_L4)?,
            *word(ctx, Q_L4 + 2)?,
        )
    };
    let q_check = quoted_l4_check(ctx, Q_L4, proto, end);
    // About a client -> backend packet: the quoted destination is a
    // backend endpoint whose client flow has that backend.
    let ep = EndpointKey { addr: q_dst, port: q_dport, proto, _pad: 0 };
    // SAFETY: the value is copied at once.
    if let Some(vip) = unsafe { ENDPOINTS.get(&ep) }.copied() {
        let key =
            FlowKey { src_addr: q_src, dst_addr: vip.addr, src_port: q_sport, dst_port: vip.port, proto, _pad: [0; 3] };
        // SAFETY: as above; plain loads.
        let owned = table::flow(&key)
            .is_some_and(|f| unsafe { (*f).dir != DIR_REPLY && (*f).nat_addr == q_dst && (*f).nat_port == q_dport });
        // The VIP the quote goes back to: the owner's when its flow has this
        // backend; otherwise a service sharing the endpoint without owning
        // it, named by its reply entry (the backend's tuple).
        let target = if owned {
            Some((vip.addr, vip.port))
        } else {
            let rev =
                FlowKey { src_addr: q_dst, dst_addr: q_src, src_port: q_dport, dst_port: q_sport, proto, _pad: [0; 3] }
                    .reply();
            // SAFETY: a valid, aligned map value; plain loads.
            table::flow(&rev).and_then(|f| unsafe { ((*f).dir == DIR_REPLY).then(|| ((*f).nat_addr, (*f).nat_port)) })
        };
        if let Some((addr, port)) = target {
            // Quoted destination back to the VIP: the quoted IP header's
            // checksum, the quoted L4 checksum (its pseudo-header and its
            // port) and the ICMP checksum follow.
            let (qip, icmp) = (Q_IP + 10, ICMP + 2);
            let old = quoted_checks(ctx, qip, q_check)?;
            set32(ctx, Q_IP + 16, addr, [qip, icmp, q_check])?;
            set16(ctx, Q_L4 + 2, port, [icmp, q_check, 0])?;
            refold(ctx, icmp, [qip, q_check], old)?;
            stats::count(counter::ICMP_TO_CLIENT);
            return Some(xdp_action::XDP_PASS);
        }
    }
    // About a reply: addressed to the VIP the quote comes from.
    let vk = VipKey { addr: q_src, port: q_sport, proto, _pad: 0 };
    if outer_dst != q_src {
        return None;
    }
    // SAFETY: the value is copied at once.
    let svc = unsafe { VIPS.get(&vk) }.copied()?;
    let key = FlowKey { src_addr: q_dst, dst_addr: q_src, src_port: q_dport, dst_port: q_sport, proto, _pad: [0; 3] };
    // SAFETY: plain loads of a copied value.
    let (id, dsr) = match table::flow(&key).map(|f| unsafe { *f }) {
        Some(f) if f.dir != DIR_REPLY => (f.backend_id, f.dir == DIR_DSR),
        _ => {
            let t = select::Tuple { saddr: q_dst, daddr: q_src, sport: q_dport, dport: q_sport, proto };
            (select::pick_stateless(&svc, t), svc.flags & SVC_F_DSR != 0)
        }
    };
    let b = if id == BACKEND_NONE { None } else { BACKENDS.get(id).copied() }?;
    if dsr {
        // The backend sent the reply from the VIP itself; only the "too
        // big" news is its business, unchanged, at its MAC.
        if !frag_needed {
            return None;
        }
        stats::count(counter::ICMP_TO_BACKEND);
        return Some(to_mac(ctx, 2, &[b.addr, 0, 0, 0]));
    }
    let (ip, qip, icmp) = (IP + 10, Q_IP + 10, ICMP + 2);
    let old = quoted_checks(ctx, qip, q_check)?;
    set32(ctx, IP + 16, b.addr, [ip, 0, 0])?;
    set32(ctx, Q_IP + 12, b.addr, [qip, icmp, q_check])?;
    set16(ctx, Q_L4, b.port, [icmp, q_check, 0])?;
    refold(ctx, icmp, [qip, q_check], old)?;
    stats::count(counter::ICMP_TO_BACKEND);
    Some(xdp_action::XDP_PASS)
}

/// The quoted checksums (at word offsets `a`, `b`; 0 for none) before a
/// rewrite, for [`refold`].
#[inline(always)]
fn quoted_checks(ctx: &XdpContext, a: usize, b: usize) -> Option<[u16; 2]> {
    let mut out = [0u16; 2];
    for (i, off) in [a, b].into_iter().enumerate() {
        if off != 0 {
            // SAFETY: bounds-checked by ptr_at.
            out[i] = unsafe { *word(ctx, off)? };
        }
    }
    Some(out)
}

/// The quoted checksums changed with the fields they cover: the ICMP
/// checksum at `icmp`, which covers them too, takes their change.
#[inline(always)]
fn refold(ctx: &XdpContext, icmp: usize, fields: [usize; 2], old: [u16; 2]) -> Option<()> {
    let c = word(ctx, icmp)?;
    for (i, off) in fields.into_iter().enumerate() {
        if off != 0 {
            // SAFETY: bounds-checked by ptr_at.
            unsafe { *c = csum::replace2(*c, old[i], *word(ctx, off)?) };
        }
    }
    Some(())
}

/// Send the (unchanged) frame to the MAC of `dst` (an IPv4 address is
/// the first word, the rest 0; `family` AF_INET or AF_INET6), on a
/// directly connected network, or drop it.
#[inline(never)]
fn to_mac(ctx: &XdpContext, family: u8, dst: &[u32; 4]) -> u32 {
    let Some(p) = fib_params() else {
        return xdp_action::XDP_DROP;
    };
    // SAFETY: this CPU's zeroed scratch slot; plain stores and loads. The
    // destination union is 16 bytes; an IPv4 address is its first word,
    // and the helper writes no more than that for IPv4.
    unsafe {
        (*p).family = family;
        (*p).__bindgen_anon_4.ipv6_dst = *dst;
        (*p).ifindex = ctx.ingress_ifindex() as u32;
        let rc = bpf_fib_lookup(ctx.ctx.cast(), p, size_of::<FibParams>() as i32, 0);
        if rc != FIB_OK || (*p).__bindgen_anon_4.ipv6_dst != *dst || !can_redirect(ctx, (*p).ifindex) {
            stats::count(counter::DSR_OFF_LINK);
            return xdp_action::XDP_DROP;
        }
        let Some(eth) = ptr_at::<EthHdr>(ctx, 0) else {
            return xdp_action::XDP_DROP;
        };
        set_macs(eth, (*p).smac, (*p).dmac);
        bpf_redirect((*p).ifindex, 0) as u32
    }
}

#[xdp]
pub(crate) fn lb_icmp6(ctx: XdpContext) -> u32 {
    icmp6(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

#[inline(always)]
fn icmp6(ctx: &XdpContext) -> Option<u32> {
    let hdr = ptr_at::<[u8; Q_L46 + 4]>(ctx, 0)?;
    // SAFETY: bounds-checked by ptr_at.
    let h = unsafe { &*hdr };
    let kind = h[ICMP6];
    let proto = h[Q_IP6 + 6];
    if h[IP6 + 6] != 58
        || !matches!(kind, ICMP6_UNREACH | ICMP6_TOO_BIG | ICMP6_TIME_EXCEEDED | ICMP6_PARAM_PROBLEM)
        || (proto != PROTO_TCP && proto != PROTO_UDP)
    {
        return None;
    }
    let end = ETH_HLEN + 40 + usize::from(u16::from_be_bytes([h[IP6 + 4], h[IP6 + 5]]));
    if end < Q_L46 + 4 || end > ctx.data_end() - ctx.data() {
        return None;
    }
    let k = KEYS6.get_ptr_mut(0)?;
    // SAFETY: bounds-checked above; plain loads of the addresses and ports.
    let (outer_dst, q_src, q_dst, q_sport, q_dport) = unsafe {
        (
            *ptr_at::<[u32; 4]>(ctx, IP6 + 24)?,
            *ptr_at::<[u32; 4]>(ctx, Q_IP6 + 8)?,
            *ptr_at::<[u32; 4]>(ctx, Q_IP6 + 24)?,
            *word(ctx, Q_L46)?,
            *word(ctx, Q_L46 + 2)?,
        )
    };
    let q_check = quoted_l4_check(ctx, Q_L46, proto, end);
    let icmp = ICMP6 + 2;
    // SAFETY: this CPU's scratch slot (see v6::Keys6); the references
    // live for one lookup each.
    let vip = unsafe {
        (*k).vip = Vip6Key { addr: q_dst, port: q_dport, proto, _pad: 0 };
        ENDPOINTS6.get(&(*k).vip).copied()
    };
    if let Some(vip) = vip {
        // SAFETY: as above.
        let owned = unsafe {
            (*k).flow = FlowKey6 {
                src_addr: q_src,
                dst_addr: vip.addr,
                src_port: q_sport,
                dst_port: vip.port,
                proto,
                _pad: [0; 3],
            };
            table::flow6(&(*k).flow)
                .is_some_and(|f| (*f).dir != DIR_REPLY && (*f).nat_addr == q_dst && (*f).nat_port == q_dport)
        };
        // The VIP the quote goes back to: the owner's when its flow has this
        // backend; otherwise a service sharing the endpoint without owning
        // it, named by its reply entry (the backend's tuple).
        let target = if owned {
            Some((vip.addr, vip.port))
        } else {
            // SAFETY: this CPU's scratch slot, as above, and a valid,
            // aligned map value; plain stores and loads.
            unsafe {
                (*k).flow = FlowKey6 {
                    src_addr: q_dst,
                    dst_addr: q_src,
                    src_port: q_dport,
                    dst_port: q_sport,
                    proto,
                    _pad: [KEY_REPLY, 0, 0],
                };
                table::flow6(&(*k).flow).and_then(|f| ((*f).dir == DIR_REPLY).then(|| ((*f).nat_addr, (*f).nat_port)))
            }
        };
        if let Some((addr, port)) = target {
            let old = quoted_checks(ctx, q_check, 0)?;
            set128(ctx, Q_IP6 + 24, &addr, [icmp, q_check, 0])?;
            set16(ctx, Q_L46 + 2, port, [icmp, q_check, 0])?;
            refold(ctx, icmp, [q_check, 0], old)?;
            stats::count(counter::ICMP_TO_CLIENT);
            return Some(xdp_action::XDP_PASS);
        }
    }
    if outer_dst != q_src {
        return None;
    }
    // SAFETY: as above; the service is copied into the slot.
    let svc: Service = unsafe {
        (*k).vip = Vip6Key { addr: q_src, port: q_sport, proto, _pad: 0 };
        *VIPS6.get(&(*k).vip)?
    };
    // SAFETY: as above.
    let entry = unsafe {
        (*k).flow =
            FlowKey6 { src_addr: q_dst, dst_addr: q_src, src_port: q_dport, dst_port: q_sport, proto, _pad: [0; 3] };
        table::flow6(&(*k).flow).map(|f| ((*f).dir, (*f).backend_id))
    };
    let (id, dsr) = match entry {
        Some((dir, id)) if dir != DIR_REPLY => (id, dir == DIR_DSR),
        _ => {
            let t = select::Tuple { saddr: fold6(&q_dst), daddr: fold6(&q_src), sport: q_dport, dport: q_sport, proto };
            (select::pick_stateless(&svc, t), svc.flags & SVC_F_DSR != 0)
        }
    };
    let b = if id == BACKEND_NONE { None } else { BACKENDS.get(id).copied() }?;
    if b.flags & BACKEND_F_V6 == 0 {
        return None;
    }
    let addr = *BACKEND_ADDRS6.get(id)?;
    if dsr {
        if kind != ICMP6_TOO_BIG {
            return None;
        }
        stats::count(counter::ICMP_TO_BACKEND);
        return Some(to_mac(ctx, 10, &addr));
    }
    // The outer destination is in the ICMPv6 pseudo-header.
    let old = quoted_checks(ctx, q_check, 0)?;
    set128(ctx, IP6 + 24, &addr, [icmp, 0, 0])?;
    set128(ctx, Q_IP6 + 8, &addr, [icmp, q_check, 0])?;
    set16(ctx, Q_L46, b.port, [icmp, q_check, 0])?;
    refold(ctx, icmp, [q_check, 0], old)?;
    stats::count(counter::ICMP_TO_BACKEND);
    Some(xdp_action::XDP_PASS)
}

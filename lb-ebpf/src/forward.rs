//! NAT rewrite and next hop.
//!
//! Forward packets get the backend's address and port as destination, reply
//! packets get the VIP back as source. Checksums are updated incrementally.
//! The next hop comes from the kernel FIB; when the FIB cannot give a
//! resolved neighbour the rewritten packet goes to the kernel, which
//! resolves it (ARP) and forwards it.
use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams, xdp_action},
    helpers::generated::{bpf_fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use lb_common::{PROTO_UDP, counter};

use crate::{csum, parse::Packet, stats};

const AF_INET: u8 = 2;

/// Rewrite the destination address and port (client -> backend).
#[inline(always)]
pub fn rewrite_dst(pkt: &Packet, addr: u32, port: u16) {
    // SAFETY: every pointer in Packet was bounds-checked by parse().
    unsafe {
        let ip = pkt.ip;
        let old_addr = (*ip).daddr;
        let old_port = (*pkt.ports)[1];
        (*ip).daddr = addr;
        (*ip).check = csum::replace4((*ip).check, old_addr, addr);
        (*pkt.ports)[1] = port;
        update_l4(pkt, old_addr, addr, old_port, port);
    }
}

/// Rewrite the source address and port (backend -> client).
#[inline(always)]
pub fn rewrite_src(pkt: &Packet, addr: u32, port: u16) {
    // SAFETY: every pointer in Packet was bounds-checked by parse().
    unsafe {
        let ip = pkt.ip;
        let old_addr = (*ip).saddr;
        let old_port = (*pkt.ports)[0];
        (*ip).saddr = addr;
        (*ip).check = csum::replace4((*ip).check, old_addr, addr);
        (*pkt.ports)[0] = port;
        update_l4(pkt, old_addr, addr, old_port, port);
    }
}

#[inline(always)]
unsafe fn update_l4(pkt: &Packet, old_addr: u32, new_addr: u32, old_port: u16, new_port: u16) {
    // SAFETY: l4_check was bounds-checked by parse().
    unsafe {
        let old = *pkt.l4_check;
        if pkt.proto == PROTO_UDP && old == 0 {
            // UDP without checksum: leave it without one.
            return;
        }
        let mut new = csum::replace_addr_port(old, old_addr, new_addr, old_port, new_port);
        if pkt.proto == PROTO_UDP && new == 0 {
            // 0 means "no checksum" in UDP; a computed 0 is sent as 0xffff.
            new = 0xffff;
        }
        *pkt.l4_check = new;
    }
}

/// True when the packet may be forwarded by us (TTL would stay above 0).
#[inline(always)]
pub fn ttl_ok(pkt: &Packet) -> bool {
    // SAFETY: bounds-checked by parse().
    unsafe { (*pkt.ip).ttl > 1 }
}

/// Look up the next hop for the (already rewritten) packet and redirect it
/// there, decrementing the TTL as a router does. Without a usable FIB
/// answer the packet goes to the kernel as it is, which forwards it (and
/// decrements the TTL itself).
#[inline(always)]
pub fn redirect(ctx: &XdpContext, pkt: &Packet) -> u32 {
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut p: FibParams = unsafe { core::mem::zeroed() };
    // SAFETY: bounds-checked by parse(); writes to a local struct.
    unsafe {
        let ip = pkt.ip;
        p.family = AF_INET;
        p.l4_protocol = pkt.proto;
        p.__bindgen_anon_1.tot_len = u16::from_be((*ip).tot_len);
        p.__bindgen_anon_2.tos = (*ip).tos;
        p.__bindgen_anon_3.ipv4_src = (*ip).saddr;
        p.__bindgen_anon_4.ipv4_dst = (*ip).daddr;
    }
    p.ifindex = ctx.ingress_ifindex() as u32;
    // SAFETY: ctx.ctx is the program's context; p is a valid params struct.
    let rc = unsafe {
        bpf_fib_lookup(ctx.ctx as *mut _, &mut p, size_of::<FibParams>() as i32, 0)
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        stats::count(counter::FIB_FALLBACK);
        return xdp_action::XDP_PASS;
    }
    // SAFETY: bounds-checked by parse().
    unsafe {
        let ip = pkt.ip;
        // TTL is the high byte of the 16-bit word it shares with the protocol.
        let old = ((*ip).ttl as u16) << 8 | (*ip).proto as u16;
        (*ip).ttl -= 1;
        let new = ((*ip).ttl as u16) << 8 | (*ip).proto as u16;
        (*ip).check = csum::replace2((*ip).check, old.to_be(), new.to_be());
        (*pkt.eth).dst = p.dmac;
        (*pkt.eth).src = p.smac;
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(p.ifindex, 0) as u32 }
}

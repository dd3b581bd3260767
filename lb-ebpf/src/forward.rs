//! NAT rewrite and next hop.
//!
//! Forward packets get the backend's address and port as destination, reply
//! packets get the VIP back as source. Checksums are updated incrementally.
//! The next hop comes from the kernel FIB; when the FIB cannot give a
//! resolved neighbour the rewritten packet goes to the kernel, which
//! resolves it (ARP) and forwards it.
use core::mem::{MaybeUninit, size_of};

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams, xdp_action},
    helpers::generated::{bpf_fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use lb_common::{Flow, PROTO_UDP, counter};

use lb_ebpf::csum;

use crate::{parse::Packet, stats};

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

/// Seconds a cached next hop is used before the FIB is asked again.
const NEXT_HOP_TTL: u32 = 1;

/// Send the (already rewritten) packet to its next hop, decrementing the
/// TTL as a router does. The next hop comes from the flow entry's cache
/// when fresh, else from the kernel FIB (and is cached). Without a usable
/// FIB answer the packet goes to the kernel as it is, which forwards it
/// (and decrements the TTL itself).
#[inline(always)]
pub fn redirect(ctx: &XdpContext, pkt: &Packet, entry: Option<*mut Flow>, now: u64) -> u32 {
    let now = now as u32;
    // SAFETY: a valid map value, read in place.
    let cached =
        entry.map(|e| unsafe { &*e }).filter(|f| f.nh_ifindex != 0 && now.wrapping_sub(f.nh_time) <= NEXT_HOP_TTL);
    let (ifindex, smac, dmac) = if let Some(f) = cached {
        (f.nh_ifindex, f.nh_smac, f.nh_dmac)
    } else {
        match fib(ctx, pkt) {
            Some((ifindex, smac, dmac)) => {
                if let Some(e) = entry {
                    // SAFETY: a valid map value. Another CPU may read a
                    // half-written cache at worst once; ifindex last.
                    unsafe {
                        (*e).nh_time = now;
                        (*e).nh_smac = smac;
                        (*e).nh_dmac = dmac;
                        core::ptr::write_volatile(&raw mut (*e).nh_ifindex, ifindex);
                    }
                }
                (ifindex, smac, dmac)
            }
            None => {
                stats::count(counter::FIB_FALLBACK);
                return xdp_action::XDP_PASS;
            }
        }
    };
    // SAFETY: bounds-checked by parse().
    unsafe {
        let ip = pkt.ip;
        // TTL is the high byte of the 16-bit word it shares with the protocol.
        let old = ((*ip).ttl as u16) << 8 | (*ip).proto as u16;
        (*ip).ttl -= 1;
        let new = ((*ip).ttl as u16) << 8 | (*ip).proto as u16;
        (*ip).check = csum::replace2((*ip).check, old.to_be(), new.to_be());
        // Byte stores: an array assignment here compiles to a call of a
        // memmove subprogram, which costs more than the copy.
        let eth = pkt.eth as *mut u8;
        for i in 0..6 {
            core::ptr::write_volatile(eth.add(i), dmac[i]);
            core::ptr::write_volatile(eth.add(6 + i), smac[i]);
        }
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as u32 }
}

/// Ask the kernel FIB for the next hop of the packet as it is now:
/// (egress ifindex, source MAC, destination MAC).
// Its own stack frame: the 64-byte parameters would otherwise add to the
// caller's (inlined) frame and overflow the 512-byte BPF stack.
#[inline(never)]
fn fib(ctx: &XdpContext, pkt: &Packet) -> Option<(u32, [u8; 6], [u8; 6])> {
    let mut p = MaybeUninit::<FibParams>::uninit();
    // Zero the parameters word by word: `mem::zeroed()` compiles to a call
    // of a byte-loop memset subprogram (about 35 ns). The helper reads the
    // whole struct, so the verifier needs every byte written.
    let words = p.as_mut_ptr() as *mut u64;
    // SAFETY: FibParams is 64 bytes, 8-aligned (asserted below).
    unsafe {
        for i in 0..size_of::<FibParams>() / 8 {
            core::ptr::write_volatile(words.add(i), 0);
        }
    }
    // SAFETY: every byte is initialised above; fields are plain integers.
    let mut p = unsafe { p.assume_init() };
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
    let rc = unsafe { bpf_fib_lookup(ctx.ctx as *mut _, &mut p, size_of::<FibParams>() as i32, 0) };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    Some((p.ifindex, p.smac, p.dmac))
}

const _: () = assert!(size_of::<FibParams>() % 8 == 0);

//! The XDP load balancer. Reads top to bottom:
//! parse -> flow table -> (new flow: find VIP -> pick backend) -> rewrite ->
//! count -> next hop.
#![no_std]
#![no_main]
// Atomic read-modify-write on map values: core's atomic types have no RMW
// methods on the BPF target, the intrinsics lower to BPF atomic instructions.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod csum;
mod forward;
mod maps;
mod parse;
mod select;
mod stats;

use core::intrinsics::{AtomicOrdering, atomic_or};

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use aya_log_ebpf::debug;
use lb_common::{
    BACKEND_F_DOWN, BACKEND_NONE, DIR_FORWARD, DIR_REPLY, FLOW_FIN_BACKEND, FLOW_FIN_CLIENT, FLOW_RST, Flow,
    FlowKey, PROTO_TCP, Service, VipKey, counter, flow_closed,
};
use maps::{BACKENDS, FLOWS, VIP_ADDRS, VIPS};
use parse::{Packet, ParseError, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    match try_lb(&ctx) {
        Ok(action) => action,
        // Anything we cannot judge belongs to the kernel.
        Err(()) => xdp_action::XDP_PASS,
    }
}

fn try_lb(ctx: &XdpContext) -> Result<u32, ()> {
    let pkt = match parse::parse(ctx) {
        Ok(pkt) => pkt,
        Err(ParseError::NotOurs) => return Ok(xdp_action::XDP_PASS),
        Err(ParseError::Malformed { daddr }) => {
            return Ok(drop_if_vip(ctx, daddr, counter::DROP_MALFORMED));
        }
        Err(ParseError::Fragment { daddr }) => {
            return Ok(drop_if_vip(ctx, daddr, counter::DROP_FRAGMENT));
        }
    };

    let key = FlowKey {
        src_addr: pkt.saddr,
        dst_addr: pkt.daddr,
        src_port: pkt.sport,
        dst_port: pkt.dport,
        proto: pkt.proto,
        _pad: [0; 3],
    };
    if let Some(flow) = FLOWS.get_ptr_mut(&key) {
        // SAFETY: a valid map value; copied out before any other map call.
        let f = unsafe { *flow };
        if f.dir == DIR_REPLY {
            return Ok(reply(ctx, &pkt, &f));
        }
        // A fresh SYN on a closed flow's tuple is a new connection; a flow
        // whose backend went down is re-dispatched (its next packet, e.g. a
        // retransmission, reaches a live backend, which resets it fast).
        let down = backend_down(f.backend_id);
        if down && !flow_closed(f.state) {
            stats::flow_closed(f.backend_id);
        }
        if !down && !(is_syn(&pkt) && flow_closed(f.state)) {
            track_close(flow, &f, pkt.tcp_flags, pkt.proto, FLOW_FIN_CLIENT);
            let now = now_secs();
            if f.last_seen != now {
                // SAFETY: a valid map value; a plain store of a timestamp.
                unsafe { (*flow).last_seen = now };
            }
            return Ok(forward(ctx, &pkt, &f));
        }
    }

    let vip = VipKey { addr: pkt.daddr, port: pkt.dport, proto: pkt.proto, _pad: 0 };
    // SAFETY: the value is copied before anything can replace it.
    let Some(svc) = (unsafe { VIPS.get(&vip) }).copied() else {
        return Ok(xdp_action::XDP_PASS);
    };
    Ok(new_flow(ctx, &pkt, &key, &svc))
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

#[inline(always)]
fn backend_down(id: u32) -> bool {
    match BACKENDS.get(id) {
        Some(b) => b.flags & BACKEND_F_DOWN != 0,
        None => false,
    }
}

#[inline(always)]
fn is_syn(pkt: &Packet) -> bool {
    pkt.proto == PROTO_TCP && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// Seconds of the coarse monotonic clock (the flows' idle clock).
#[inline(always)]
fn now_secs() -> u64 {
    // SAFETY: plain helper call.
    let ns = unsafe { bpf_ktime_get_coarse_ns() };
    ns / 1_000_000_000
}

/// Record a FIN (as `fin_bit`) or RST on a forward flow entry; the packet
/// that closes the flow counts it closed for its backend, exactly once.
#[inline(always)]
fn track_close(flow: *mut Flow, f: &Flow, tcp_flags: u8, proto: u8, fin_bit: u64) {
    if proto != PROTO_TCP || tcp_flags & (TCP_FIN | TCP_RST) == 0 {
        return;
    }
    let bit = if tcp_flags & TCP_RST != 0 { FLOW_RST } else { fin_bit };
    // Both directions may run on different CPUs at once: atomic OR, and
    // the old value says whether this packet is the one that closed it.
    // SeqCst: the old value is used, see select.rs on relaxed atomics.
    // SAFETY: a valid, aligned u64 inside a map value.
    let old = unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(&raw mut (*flow).state, bit) };
    if !flow_closed(old) && flow_closed(old | bit) {
        stats::flow_closed(f.backend_id);
    }
}

fn new_flow(ctx: &XdpContext, pkt: &Packet, key: &FlowKey, svc: &Service) -> u32 {
    let id = select::pick(svc, pkt);
    let Some(backend) = (if id == BACKEND_NONE { None } else { BACKENDS.get(id) }) else {
        stats::count(counter::DROP_NO_BACKEND);
        return xdp_action::XDP_DROP;
    };
    let mut fwd = Flow {
        backend_id: id,
        service_id: svc.service_id,
        nat_addr: backend.addr,
        nat_port: backend.port,
        dir: DIR_FORWARD,
        _pad: 0,
        state: 0,
        last_seen: now_secs(),
    };
    if pkt.proto == PROTO_TCP && pkt.tcp_flags & TCP_RST != 0 {
        fwd.state = FLOW_RST;
    } else if pkt.proto == PROTO_TCP && pkt.tcp_flags & TCP_FIN != 0 {
        fwd.state = FLOW_FIN_CLIENT;
    }
    let rev_key = FlowKey {
        src_addr: backend.addr,
        dst_addr: pkt.saddr,
        src_port: backend.port,
        dst_port: pkt.sport,
        proto: pkt.proto,
        _pad: [0; 3],
    };
    let rev = Flow {
        backend_id: id,
        service_id: svc.service_id,
        nat_addr: pkt.daddr,
        nat_port: pkt.dport,
        dir: DIR_REPLY,
        _pad: 0,
        state: 0,
        last_seen: 0,
    };
    // Reply entry first: once the forward entry exists, replies can come.
    if FLOWS.insert(&rev_key, &rev, 0).is_err() || FLOWS.insert(key, &fwd, 0).is_err() {
        stats::count(counter::DROP_FLOW_TABLE);
        return xdp_action::XDP_DROP;
    }
    stats::new_flow(id);
    stats::flow_opened(id);
    if flow_closed(fwd.state) {
        stats::flow_closed(id);
    }
    forward(ctx, pkt, &fwd)
}

/// Client -> backend: destination becomes the backend.
#[inline(always)]
fn forward(ctx: &XdpContext, pkt: &Packet, f: &Flow) -> u32 {
    if !forward::ttl_ok(pkt) {
        stats::count(counter::TTL_EXPIRED);
        return xdp_action::XDP_PASS;
    }
    stats::packet_in(f.backend_id, pkt.len);
    forward::rewrite_dst(pkt, f.nat_addr, f.nat_port);
    forward::redirect(ctx, pkt)
}

/// Backend -> client: source becomes the VIP again.
#[inline(always)]
fn reply(ctx: &XdpContext, pkt: &Packet, f: &Flow) -> u32 {
    if pkt.proto == PROTO_TCP && pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        // Close tracking lives on the forward entry: (client, VIP) tuple.
        let fwd_key = FlowKey {
            src_addr: pkt.daddr,
            dst_addr: f.nat_addr,
            src_port: pkt.dport,
            dst_port: f.nat_port,
            proto: pkt.proto,
            _pad: [0; 3],
        };
        if let Some(fwd) = FLOWS.get_ptr_mut(&fwd_key) {
            track_close(fwd, f, pkt.tcp_flags, pkt.proto, FLOW_FIN_BACKEND);
        }
    }
    if !forward::ttl_ok(pkt) {
        stats::count(counter::TTL_EXPIRED);
        return xdp_action::XDP_PASS;
    }
    stats::packet_out(f.backend_id, pkt.len);
    forward::rewrite_src(pkt, f.nat_addr, f.nat_port);
    forward::redirect(ctx, pkt)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

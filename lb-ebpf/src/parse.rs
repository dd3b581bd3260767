//! Packet parsing: Ethernet -> IPv4 (with options) -> TCP/UDP.
//!
//! Every access goes through [`ptr_at`], whose bound check against
//! `data_end` is what the verifier needs to accept the load or store.
use core::mem::size_of;

use aya_ebpf::{helpers::generated::bpf_xdp_load_bytes, programs::XdpContext};
use lb_common::{PROTO_TCP, PROTO_UDP};

pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;
pub(crate) const ETH_HLEN: usize = 14;
/// IPv6 header length.
pub(crate) const IP6_HLEN: usize = 40;

/// ICMP error types and codes the datapath reads or writes.
pub(crate) const ICMP_UNREACH: u8 = 3;
pub(crate) const ICMP_FRAG_NEEDED: u8 = 4;
pub(crate) const ICMP_TIME_EXCEEDED: u8 = 11;
pub(crate) const ICMP_PARAM_PROBLEM: u8 = 12;
pub(crate) const ICMP6_UNREACH: u8 = 1;
pub(crate) const ICMP6_TOO_BIG: u8 = 2;
pub(crate) const ICMP6_TIME_EXCEEDED: u8 = 3;
pub(crate) const ICMP6_PARAM_PROBLEM: u8 = 4;

#[repr(C)]
pub(crate) struct EthHdr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    /// Network byte order.
    pub proto: u16,
}

#[repr(C)]
pub(crate) struct Ipv4Hdr {
    pub version_ihl: u8,
    pub tos: u8,
    pub tot_len: u16,
    pub id: u16,
    pub frag_off: u16,
    pub ttl: u8,
    pub proto: u8,
    pub check: u16,
    pub saddr: u32,
    pub daddr: u32,
}

/// The first 20 bytes of a TCP header (options are not touched).
#[repr(C)]
pub(crate) struct TcpHdr {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    pub off_res: u8,
    pub flags: u8,
    pub window: u16,
    pub check: u16,
    pub urg: u16,
}

#[repr(C)]
pub(crate) struct UdpHdr {
    pub sport: u16,
    pub dport: u16,
    pub len: u16,
    pub check: u16,
}

pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;

/// Pointer to a `T` at `offset` from the start of the frame, if the whole
/// `T` lies inside the frame.
#[inline(always)]
pub(crate) fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    // Verifier: this comparison against data_end is what proves every
    // byte of the returned T readable and writable.
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *mut T)
}

/// Why a packet could not be handled.
pub(crate) enum ParseError {
    /// Not IPv4/TCP/UDP, or not ours to judge: hand it to the kernel.
    NotOurs,
    /// IPv4 header readable, but the rest is broken; `daddr` says where it
    /// was going so the caller can decide whether it was meant for a VIP.
    Malformed { daddr: u32 },
    /// A fragment (no L4 ports to balance on).
    Fragment { daddr: u32 },
}

/// Where the interesting fields of one parsed packet are.
///
/// A checked type: only [`parse`] makes one, after bounds-checking every
/// header its pointers name against the end of the frame, and the pointers
/// are private, so safe code can neither forge one nor point it elsewhere.
/// That is what makes the accessors' pointers valid to dereference for as
/// long as the program runs on this frame (nothing here resizes it).
pub(crate) struct Packet {
    eth: *mut EthHdr,
    ip: *mut Ipv4Hdr,
    /// TCP or UDP header start: source port, then destination port.
    ports: *mut [u16; 2],
    pub proto: u8,
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
    /// The L4 checksum field.
    l4_check: *mut u16,
    /// Frame length in bytes, for the byte counters.
    pub len: u64,
    /// Offset of the L4 header from the start of the frame, and the L4
    /// length (header and payload) the IP header gives (at most 65,535).
    pub l4_off: usize,
    pub l4_len: usize,
}

impl Packet {
    /// The low byte of a TCP segment's sequence number (0 for UDP): what a
    /// flow entry keeps of its SYN (`Flow::syn_seq`).
    #[inline(always)]
    pub(crate) fn seq_lo(&self) -> u8 {
        if self.proto != PROTO_TCP {
            return 0;
        }
        // SAFETY: parse() bounds-checked the whole TCP header, which
        // `ports` starts; the sequence number is its bytes 4-7, in network
        // order, so byte 7 is its low byte.
        unsafe { *self.ports.cast::<u8>().add(7) }
    }

    /// The Ethernet header: valid for reads and writes (see the type doc).
    #[inline(always)]
    pub(crate) fn eth(&self) -> *mut EthHdr {
        self.eth
    }

    /// The IPv4 header (without options): valid for reads and writes.
    #[inline(always)]
    pub(crate) fn ip(&self) -> *mut Ipv4Hdr {
        self.ip
    }

    /// The L4 ports: valid for reads and writes.
    #[inline(always)]
    pub(crate) fn ports(&self) -> *mut [u16; 2] {
        self.ports
    }

    /// The L4 checksum field: valid for reads and writes.
    #[inline(always)]
    pub(crate) fn l4_check(&self) -> *mut u16 {
        self.l4_check
    }
}

/// Whether the frame is IPv4 ICMP (EtherType and protocol only).
#[inline(always)]
pub(crate) fn is_icmp4(ctx: &XdpContext) -> bool {
    match (ptr_at::<EthHdr>(ctx, 0), ptr_at::<Ipv4Hdr>(ctx, ETH_HLEN)) {
        // SAFETY: bounds checked by ptr_at.
        (Some(eth), Some(ip)) => unsafe { (*eth).proto == ETH_P_IP.to_be() && (*ip).proto == 1 },
        _ => false,
    }
}

/// What the first look at an untagged frame tells (`first_look`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// TCP or UDP between two addresses that are neither a VIP nor a
    /// backend (the address filter says so): the kernel's, untouched.
    NotOurs,
    /// IPv6 that may be ours: the IPv6 program's.
    V6,
    /// Anything else: parsed as IPv4.
    Other,
}

/// The first thing the program looks at, before any check of the headers,
/// so that traffic that is not ours, most of what a gateway sees, pays
/// only this: IPv4 or IPv6 TCP or UDP between two addresses that are
/// neither a VIP nor a backend is `NotOurs`, whatever the rest of it
/// holds. (A broken packet that is not ours goes to the kernel all the
/// same: only one to a VIP address is dropped, and a VIP address always
/// has its filter bit.) The EtherType is read once for both families, so
/// an IPv6 packet skips the IPv4 parse's checks on its way.
#[inline(always)]
pub(crate) fn first_look(ctx: &XdpContext) -> Look {
    let Some(eth) = ptr_at::<EthHdr>(ctx, 0) else {
        return Look::Other;
    };
    // SAFETY: bounds checked by ptr_at.
    let ether = unsafe { (*eth).proto };
    if ether == ETH_P_IP.to_be() {
        let Some(ip) = ptr_at::<Ipv4Hdr>(ctx, ETH_HLEN) else {
            return Look::Other;
        };
        // SAFETY: bounds checked by ptr_at.
        let (proto, saddr, daddr) = unsafe { ((*ip).proto, (*ip).saddr, (*ip).daddr) };
        if (proto == PROTO_TCP || proto == PROTO_UDP) && !crate::maybe_either_ours(daddr, saddr) {
            return Look::NotOurs;
        }
        Look::Other
    } else if ether == ETH_P_IPV6.to_be() {
        if crate::v6::surely_not_ours(ctx) { Look::NotOurs } else { Look::V6 }
    } else {
        Look::Other
    }
}

pub(crate) const ETH_P_8021Q: u16 = 0x8100;
pub(crate) const ETH_P_8021AD: u16 = 0x88a8;
/// The Ethernet header with one VLAN tag, and with two.
pub(crate) const VLAN_HLEN: usize = ETH_HLEN + 4;
pub(crate) const QINQ_HLEN: usize = ETH_HLEN + 8;

/// The EtherType (network order) at byte `off`, if the frame has it.
#[inline(always)]
fn ether_type(ctx: &XdpContext, off: usize) -> Option<u16> {
    // SAFETY: bounds checked by ptr_at.
    ptr_at::<u16>(ctx, off).map(|p| unsafe { *p })
}

/// The program slot for a VLAN-tagged IPv4 frame: one tag (802.1Q or
/// 802.1ad), or two (QinQ); None for anything else.
#[inline(always)]
pub(crate) fn vlan_slot(ctx: &XdpContext) -> Option<u32> {
    let outer = ether_type(ctx, 12)?;
    if outer != ETH_P_8021Q.to_be() && outer != ETH_P_8021AD.to_be() {
        return None;
    }
    let inner = ether_type(ctx, 16)?;
    if inner == ETH_P_IP.to_be() {
        return Some(lb_common::PROG_VLAN);
    }
    (inner == ETH_P_8021Q.to_be() && ether_type(ctx, 20)? == ETH_P_IP.to_be()).then_some(lb_common::PROG_QINQ)
}

/// Parse an IPv4 TCP/UDP frame whose IPv4 header starts at byte `L2`:
/// plain Ethernet (14), one VLAN tag (18) or two (22).
#[inline(always)]
pub(crate) fn parse<const L2: usize>(ctx: &XdpContext) -> Result<Packet, ParseError> {
    let eth: *mut EthHdr = ptr_at(ctx, 0).ok_or(ParseError::NotOurs)?;
    let tagged_ok = match L2 {
        ETH_HLEN => true,
        VLAN_HLEN => vlan_slot(ctx) == Some(lb_common::PROG_VLAN),
        _ => vlan_slot(ctx) == Some(lb_common::PROG_QINQ),
    };
    // SAFETY: bounds checked by ptr_at.
    if !tagged_ok || (L2 == ETH_HLEN && unsafe { (*eth).proto } != ETH_P_IP.to_be()) {
        return Err(ParseError::NotOurs);
    }
    let ip: *mut Ipv4Hdr = ptr_at(ctx, L2).ok_or(ParseError::NotOurs)?;
    // SAFETY: bounds checked by ptr_at.
    let (vihl, tot_len, frag_off, proto, saddr, daddr) = unsafe {
        (
            (*ip).version_ihl,
            u16::from_be((*ip).tot_len) as usize,
            u16::from_be((*ip).frag_off),
            (*ip).proto,
            (*ip).saddr,
            (*ip).daddr,
        )
    };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Err(ParseError::NotOurs);
    }
    if vihl >> 4 != 4 {
        return Err(ParseError::Malformed { daddr });
    }
    // IHL is 4 bits, so ihl_len is at most 60: the verifier sees the bound.
    let ihl_len = ((vihl & 0x0f) as usize) * 4;
    if ihl_len < size_of::<Ipv4Hdr>() {
        return Err(ParseError::Malformed { daddr });
    }
    // More-fragments bit or a fragment offset: not balanceable by port.
    if frag_off & 0x3fff != 0 {
        return Err(ParseError::Fragment { daddr });
    }
    let l4 = L2 + ihl_len;
    // Verifier: the L4 header is bounds-checked against data_end here,
    // before the total-length checks below. Were those first, the compiler
    // could prove this check redundant and drop it, and the verifier (which
    // does not follow tot_len) would reject the header access.
    // `l4_len`: the L4 header length the packet claims (TCP's data
    // offset, UDP's fixed 8 bytes); `udp_len`: UDP's length field.
    let (ports, sport, dport, tcp_flags, l4_check, l4_len, udp_len) = if proto == PROTO_TCP {
        let tcp: *mut TcpHdr = ptr_at(ctx, l4).ok_or(ParseError::Malformed { daddr })?;
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
            )
        }
    } else {
        let udp: *mut UdpHdr = ptr_at(ctx, l4).ok_or(ParseError::Malformed { daddr })?;
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
            )
        }
    };
    let frame_len = ctx.data_end() - ctx.data();
    // The IP payload holds the L4 header it claims (a TCP data offset of
    // at least 5 words, and no more than the segment), and a UDP length
    // between its header and the payload; the frame holds the IP packet.
    // A router forwards no such packet, and a rewrite would leave it
    // unparseable downstream.
    if (proto == PROTO_TCP && l4_len < size_of::<TcpHdr>())
        || tot_len < ihl_len + l4_len
        || L2 + tot_len > frame_len
        || (proto == PROTO_UDP && (udp_len < size_of::<UdpHdr>() || udp_len > tot_len - ihl_len))
    {
        return Err(ParseError::Malformed { daddr });
    }
    Ok(Packet {
        eth,
        ip,
        ports,
        proto,
        saddr,
        daddr,
        sport,
        dport,
        tcp_flags,
        l4_check,
        len: frame_len as u64,
        l4_off: l4,
        l4_len: tot_len - ihl_len,
    })
}

/// Whether the IPv4 header checksum of `pkt` (options included) verifies.
/// The kernel drops a packet whose header checksum is wrong; a packet we
/// forward ourselves must be dropped too, and an incremental update would
/// carry the error on. Called only for packets that may be ours (after the
/// address filter), so traffic that is not ours pays nothing.
#[inline(always)]
pub(crate) fn ip_checksum_ok<const L2: usize>(ctx: &XdpContext, pkt: &Packet) -> bool {
    let ip = pkt.ip().cast::<u16>();
    let mut sum: u32 = 0;
    // SAFETY: the 20-byte base header was bounds-checked by parse().
    unsafe {
        for i in 0..size_of::<Ipv4Hdr>() / 2 {
            sum += u32::from(*ip.add(i));
        }
    }
    if pkt.l4_off > L2 + size_of::<Ipv4Hdr>() {
        let Some(opts) = options_sum::<L2>(ctx, pkt.l4_off - L2 - size_of::<Ipv4Hdr>()) else {
            return false;
        };
        sum += opts;
    }
    // At most 30 words: two folds bring the sum into 16 bits.
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum == 0xffff
}

/// The sum of the 16-bit words of the IPv4 options (`opt_len` bytes, 4 to
/// 40), if they can be read. They are
/// copied to the stack by the helper rather than read in place: reading
/// them in place would leave the verifier a different proven packet
/// length per option count, and so a separate state for the rest of the
/// program for each. Its own frame: options are rare, and the buffer
/// stays off the main frame.
#[inline(never)]
fn options_sum<const L2: usize>(ctx: &XdpContext, opt_len: usize) -> Option<u32> {
    let mut opts = [0u32; 16];
    // The same value for 1-64, written so the verifier sees it is never 0
    // nor more than the buffer.
    let len = ((opt_len.wrapping_sub(1)) & 63) + 1;
    // SAFETY: `opts` is 64 writable bytes; 1 <= len <= 64.
    let rc = unsafe {
        bpf_xdp_load_bytes(ctx.ctx.cast(), (L2 + size_of::<Ipv4Hdr>()) as u32, opts.as_mut_ptr().cast(), len as u32)
    };
    if rc != 0 {
        return None;
    }
    let mut sum = 0;
    for w in opts {
        sum += (w & 0xffff) + (w >> 16);
    }
    Some(sum)
}

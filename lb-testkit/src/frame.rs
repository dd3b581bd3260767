//! One Ethernet + IPv4 + TCP/UDP frame as plain fields: [`Frame::bytes`]
//! builds it from scratch, [`Frame::parse`] reads one back and checks it.
//!
//! The `etherparse` crate does the work: it writes every header, computes
//! the IPv4 header checksum and the TCP/UDP checksums (its
//! `calc_checksum_ipv4`, which also turns a computed UDP 0 into 0xffff), and
//! its `checksum::Sum16BitWords` gives the pseudo-header sum that a sender
//! with checksum offload leaves in the L4 field ([`L4Checksum::Partial`]).
//! The parser verifies both checksums with the same code and refuses a
//! frame whose lengths disagree (trailing bytes included), so
//! `Frame::parse(b)?.bytes() == b` for every frame it accepts.
//!
//! Also here: the frames the datapath must pass untouched (IPv6 TCP, ARP,
//! ICMP), built with etherparse's `PacketBuilder`.
use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::{
    ArpEthIpv4Packet, ArpOperation, EtherType, Ethernet2Header, IpNumber, Ipv4Header, PacketBuilder, TcpHeader,
    UdpHeader, checksum::Sum16BitWords,
};

/// TCP flag bits (byte 13 of the header).
pub mod tcp {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
    pub const ECE: u8 = 0x40;
    pub const CWR: u8 = 0x80;
}

/// Length of an Ethernet II header.
pub const ETH_LEN: usize = Ethernet2Header::LEN;
/// Length of an IPv4 header without options.
pub const IPV4_LEN: usize = Ipv4Header::MIN_LEN;
/// Length of a TCP header without options.
pub const TCP_LEN: usize = TcpHeader::MIN_LEN;
/// Length of a UDP header.
pub const UDP_LEN: usize = UdpHeader::LEN;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

/// What the TCP/UDP checksum field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4Checksum {
    /// The full checksum.
    Full,
    /// UDP only: 0, "no checksum".
    None,
    /// Unfinished, as a local sender with checksum offload leaves it
    /// (CHECKSUM_PARTIAL): the folded pseudo-header sum, not complemented.
    Partial,
}

/// An Ethernet + IPv4 + TCP/UDP frame. TCP carries no options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub ttl: u8,
    pub ident: u16,
    pub dont_fragment: bool,
    pub more_fragments: bool,
    /// Raw IPv4 options, a multiple of 4 bytes, at most 40.
    pub ip_options: Vec<u8>,
    pub proto: Proto,
    pub sport: u16,
    pub dport: u16,
    /// TCP only: flag bits ([`tcp`]), sequence and acknowledgment numbers,
    /// window.
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack_number: u32,
    pub window: u16,
    pub l4_checksum: L4Checksum,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A TCP segment: TTL 64, id 0x1234, DF, seq 1000, ack 0, window 64240,
    /// an HTTP request line as payload. MACs are zero until set.
    pub fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Self {
        Self {
            dmac: [0; 6],
            smac: [0; 6],
            src,
            dst,
            ttl: 64,
            ident: 0x1234,
            dont_fragment: true,
            more_fragments: false,
            ip_options: Vec::new(),
            proto: Proto::Tcp,
            sport,
            dport,
            tcp_flags: flags,
            seq: 1000,
            ack_number: 0,
            window: 64240,
            l4_checksum: L4Checksum::Full,
            payload: b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        }
    }

    /// A UDP datagram with the payload `query` (the TCP fields 0), otherwise
    /// as [`Frame::tcp`].
    pub fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Self {
        Self {
            proto: Proto::Udp,
            seq: 0,
            window: 0,
            payload: b"query".to_vec(),
            ..Self::tcp(src, sport, dst, dport, 0)
        }
    }

    /// The same frame with these MAC addresses.
    #[must_use]
    pub fn macs(self, dmac: [u8; 6], smac: [u8; 6]) -> Self {
        Self { dmac, smac, ..self }
    }

    fn ip_number(&self) -> IpNumber {
        match self.proto {
            Proto::Tcp => IpNumber::TCP,
            Proto::Udp => IpNumber::UDP,
        }
    }

    /// Length of the TCP/UDP header and payload.
    pub fn l4_len(&self) -> usize {
        self.payload.len() + if self.proto == Proto::Tcp { TCP_LEN } else { UDP_LEN }
    }

    /// The IPv4 header, checksum included (etherparse).
    fn ipv4(&self) -> Ipv4Header {
        let mut ip = Ipv4Header::new(0, self.ttl, self.ip_number(), self.src.octets(), self.dst.octets())
            .expect("an empty payload fits");
        ip.identification = self.ident;
        ip.dont_fragment = self.dont_fragment;
        ip.more_fragments = self.more_fragments;
        ip.options = self.ip_options.as_slice().try_into().expect("IPv4 options: a multiple of 4 bytes, at most 40");
        ip.set_payload_len(self.l4_len()).expect("IPv4 payload too long");
        ip.header_checksum = ip.calc_header_checksum();
        ip
    }

    fn tcp_header(&self) -> TcpHeader {
        tcp_header((self.sport, self.dport), self.seq, self.ack_number, self.window, self.tcp_flags)
    }

    /// The checksum field a sender with offload leaves unfinished: the
    /// folded sum of the pseudo-header (addresses, protocol, L4 length) alone.
    pub fn l4_seed(&self) -> u16 {
        let len = u16::try_from(self.l4_len()).expect("L4 length fits 16 bits");
        !Sum16BitWords::new()
            .add_4bytes(self.src.octets())
            .add_4bytes(self.dst.octets())
            .add_2bytes([0, self.ip_number().0])
            .add_2bytes(len.to_be_bytes())
            .ones_complement()
            // Summed as native-endian words (as etherparse's own callers do).
            .to_be()
    }

    /// The full TCP/UDP checksum of this frame (etherparse).
    pub fn full_l4_checksum(&self) -> u16 {
        let ip = self.ipv4();
        match self.proto {
            Proto::Tcp => self.tcp_header().calc_checksum_ipv4(&ip, &self.payload).expect("TCP length"),
            Proto::Udp => {
                UdpHeader::with_ipv4_checksum(self.sport, self.dport, &ip, &self.payload).expect("UDP length").checksum
            }
        }
    }

    /// The frame's bytes, every header written and every checksum computed
    /// by etherparse. Panics on a frame that cannot exist (options not a
    /// multiple of 4 bytes, a packet over 64 KiB).
    pub fn bytes(&self) -> Vec<u8> {
        let csum = match self.l4_checksum {
            L4Checksum::Full => self.full_l4_checksum(),
            L4Checksum::None => {
                assert_eq!(self.proto, Proto::Udp, "only UDP may go without a checksum");
                0
            }
            L4Checksum::Partial => self.l4_seed(),
        };
        let ip = self.ipv4();
        let mut out = Vec::with_capacity(ETH_LEN + ip.header_len() + self.l4_len());
        Ethernet2Header { source: self.smac, destination: self.dmac, ether_type: EtherType::IPV4 }
            .write(&mut out)
            .expect("write to a Vec");
        ip.write_raw(&mut out).expect("write to a Vec");
        match self.proto {
            Proto::Tcp => {
                let mut t = self.tcp_header();
                t.checksum = csum;
                t.write(&mut out).expect("write to a Vec");
            }
            Proto::Udp => {
                let mut u =
                    UdpHeader::without_ipv4_checksum(self.sport, self.dport, self.payload.len()).expect("UDP length");
                u.checksum = csum;
                u.write(&mut out).expect("write to a Vec");
            }
        }
        out.extend_from_slice(&self.payload);
        out
    }

    /// Read a frame back (etherparse), refusing anything this builder would
    /// not make: not IPv4, not TCP/UDP, TCP options or the NS bit, lengths
    /// that disagree with the frame's (trailing bytes included), a wrong
    /// IPv4 header checksum, or an L4 checksum that is neither full, nor
    /// (UDP) 0, nor the unfinished pseudo-header sum.
    pub fn parse(frame: &[u8]) -> Result<Self, ParseError> {
        let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| ParseError::Header(e.to_string()))?;
        if eth.ether_type != EtherType::IPV4 {
            return Err(ParseError::NotIpv4(eth.ether_type.0));
        }
        let (ip, l4) = Ipv4Header::from_slice(rest).map_err(|e| ParseError::Header(e.to_string()))?;
        let want = usize::from(ip.total_len) - ip.header_len();
        if l4.len() != want {
            return Err(ParseError::Length { what: "IPv4 total length", claimed: want, found: l4.len() });
        }
        if ip.header_checksum != ip.calc_header_checksum() {
            return Err(ParseError::Ipv4Checksum { found: ip.header_checksum, want: ip.calc_header_checksum() });
        }
        let mut f = Self {
            dmac: eth.destination,
            smac: eth.source,
            src: ip.source.into(),
            dst: ip.destination.into(),
            ttl: ip.time_to_live,
            ident: ip.identification,
            dont_fragment: ip.dont_fragment,
            more_fragments: ip.more_fragments,
            ip_options: ip.options.to_vec(),
            proto: Proto::Tcp,
            sport: 0,
            dport: 0,
            tcp_flags: 0,
            seq: 0,
            ack_number: 0,
            window: 0,
            l4_checksum: L4Checksum::Full,
            payload: Vec::new(),
        };
        let found = match ip.protocol {
            IpNumber::TCP => {
                let (t, payload) = TcpHeader::from_slice(l4).map_err(|e| ParseError::Header(e.to_string()))?;
                if !t.options.is_empty() || t.ns || t.urgent_pointer != 0 {
                    return Err(ParseError::Unsupported("TCP options, NS bit or urgent pointer"));
                }
                f.tcp_flags = tcp_flags(&t);
                (f.sport, f.dport, f.seq, f.ack_number, f.window) =
                    (t.source_port, t.destination_port, t.sequence_number, t.acknowledgment_number, t.window_size);
                f.payload = payload.to_vec();
                t.checksum
            }
            IpNumber::UDP => {
                let (u, payload) = UdpHeader::from_slice(l4).map_err(|e| ParseError::Header(e.to_string()))?;
                if usize::from(u.length) != l4.len() {
                    return Err(ParseError::Length { what: "UDP length", claimed: u.length.into(), found: l4.len() });
                }
                f.proto = Proto::Udp;
                (f.sport, f.dport) = (u.source_port, u.destination_port);
                f.payload = payload.to_vec();
                u.checksum
            }
            other => return Err(ParseError::NotTcpUdp(other.0)),
        };
        let full = f.full_l4_checksum();
        f.l4_checksum = if found == full {
            L4Checksum::Full
        } else if found == 0 && f.proto == Proto::Udp {
            L4Checksum::None
        } else if found == f.l4_seed() {
            L4Checksum::Partial
        } else {
            return Err(ParseError::L4Checksum { found, full, partial: f.l4_seed() });
        };
        debug_assert_eq!(f.bytes(), frame, "a parsed frame rebuilds to its bytes");
        Ok(f)
    }
}

/// A TCP header without options (IPv4 and IPv6 frames alike).
pub(crate) fn tcp_header((sport, dport): (u16, u16), seq: u32, ack_number: u32, window: u16, f: u8) -> TcpHeader {
    let mut t = TcpHeader::new(sport, dport, seq, window);
    t.acknowledgment_number = ack_number;
    t.fin = f & tcp::FIN != 0;
    t.syn = f & tcp::SYN != 0;
    t.rst = f & tcp::RST != 0;
    t.psh = f & tcp::PSH != 0;
    t.ack = f & tcp::ACK != 0;
    t.urg = f & tcp::URG != 0;
    t.ece = f & tcp::ECE != 0;
    t.cwr = f & tcp::CWR != 0;
    t
}

/// A TCP header's flag bits ([`tcp`]).
pub(crate) fn tcp_flags(t: &TcpHeader) -> u8 {
    let flags = [t.fin, t.syn, t.rst, t.psh, t.ack, t.urg, t.ece, t.cwr];
    flags.iter().enumerate().map(|(i, &set)| u8::from(set) << i).sum()
}

/// Why [`Frame::parse`] refused a frame.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("header: {0}")]
    Header(String),
    #[error("not IPv4 (EtherType {0:#06x})")]
    NotIpv4(u16),
    #[error("IP protocol {0} is neither TCP nor UDP")]
    NotTcpUdp(u8),
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    #[error("{what} says {claimed} bytes, the frame has {found}")]
    Length { what: &'static str, claimed: usize, found: usize },
    #[error("IPv4 header checksum {found:#06x}, should be {want:#06x}")]
    Ipv4Checksum { found: u16, want: u16 },
    #[error("L4 checksum {found:#06x} is neither the full one {full:#06x} nor the unfinished one {partial:#06x}")]
    L4Checksum { found: u16, full: u16, partial: u16 },
}

/// An IPv6 TCP segment (the datapath is IPv4-only and passes it): hop limit
/// 64, seq 1000, window 64240, checksum by etherparse.
pub fn ipv6_tcp(
    (dmac, smac): ([u8; 6], [u8; 6]),
    (src, sport): (Ipv6Addr, u16),
    (dst, dport): (Ipv6Addr, u16),
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut b =
        PacketBuilder::ethernet2(smac, dmac).ipv6(src.octets(), dst.octets(), 64).tcp(sport, dport, 1000, 64240);
    if flags & tcp::SYN != 0 {
        b = b.syn();
    }
    if flags & tcp::ACK != 0 {
        b = b.ack(5000);
    }
    let mut out = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut out, payload).expect("write to a Vec");
    out
}

/// An ARP request ("who has `target`") broadcast by `smac`/`sender`.
pub fn arp_request(smac: [u8; 6], sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let arp = ArpEthIpv4Packet {
        operation: ArpOperation::REQUEST,
        sender_mac: smac,
        sender_ipv4: sender.octets(),
        target_mac: [0; 6],
        target_ipv4: target.octets(),
    };
    let b = PacketBuilder::ethernet2(smac, [0xff; 6]).arp(arp.into());
    let mut out = Vec::with_capacity(b.size());
    b.write(&mut out).expect("write to a Vec");
    out
}

/// An ICMP echo request from `src` to `dst`, TTL 64.
pub fn icmp_echo(dmac: [u8; 6], smac: [u8; 6], src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let b = PacketBuilder::ethernet2(smac, dmac).ipv4(src.octets(), dst.octets(), 64).icmpv4_echo_request(1, 1);
    let payload = b"ping";
    let mut out = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut out, payload).expect("write to a Vec");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(10, 10, 1, 1);
    const B: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 100);

    #[test]
    fn every_kind_of_frame_parses_back_to_itself() {
        let frames = [
            Frame::tcp(A, 40000, B, 80, tcp::SYN),
            Frame { ip_options: vec![1, 1, 1, 0], ..Frame::tcp(A, 1, B, 2, tcp::ACK | tcp::PSH) },
            Frame { l4_checksum: L4Checksum::Partial, payload: vec![7; 513], ..Frame::tcp(A, 3, B, 4, tcp::SYN) },
            Frame::udp(A, 5353, B, 53),
            Frame { l4_checksum: L4Checksum::None, ..Frame::udp(A, 5353, B, 53) },
            Frame { l4_checksum: L4Checksum::Partial, payload: vec![], ..Frame::udp(A, 5353, B, 53) },
        ];
        for f in frames {
            let f = f.macs([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
            assert_eq!(Frame::parse(&f.bytes()), Ok(f.clone()), "{f:?}");
        }
    }

    #[test]
    fn a_wrong_checksum_or_length_is_refused() {
        let good = Frame::tcp(A, 40000, B, 80, tcp::SYN).bytes();
        let mut bad_ip = good.clone();
        bad_ip[ETH_LEN + 10] ^= 1;
        assert!(matches!(Frame::parse(&bad_ip), Err(ParseError::Ipv4Checksum { .. })));
        let mut bad_tcp = good.clone();
        *bad_tcp.last_mut().unwrap() ^= 1;
        assert!(matches!(Frame::parse(&bad_tcp), Err(ParseError::L4Checksum { .. })));
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(Frame::parse(&long), Err(ParseError::Length { .. })));
        assert!(matches!(Frame::parse(&good[..good.len() - 1]), Err(ParseError::Length { .. })));
    }
}

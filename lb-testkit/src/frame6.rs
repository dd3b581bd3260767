//! One Ethernet + IPv6 (+ extension headers) + TCP/UDP frame as plain
//! fields: [`Frame6::bytes`] builds it, [`Frame6::parse`] reads one back
//! and checks it. As [`crate::frame`], etherparse writes the headers and
//! computes and verifies the TCP/UDP checksums (`calc_checksum_ipv6`,
//! `with_ipv6_checksum`, which also turns a computed UDP 0 into 0xffff).
//! Also: ICMPv6 "packet too big" and ICMP "fragmentation needed" readers,
//! checked with etherparse's ICMP checksum code.
use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::{
    EtherType, Ethernet2Header, Icmpv4Header, Icmpv4Type, Icmpv6Header, Icmpv6Type, IpNumber, Ipv4Header, Ipv6Header,
    TcpHeader, UdpHeader, checksum::Sum16BitWords, icmpv4::DestUnreachableHeader,
};

use crate::frame::{ETH_LEN, L4Checksum, ParseError, Proto, TCP_LEN, UDP_LEN, tcp_flags, tcp_header};

/// Length of an IPv6 header.
pub const IPV6_LEN: usize = Ipv6Header::LEN;

/// An IPv6 extension header: its type (0 hop-by-hop, 43 routing, 60
/// destination options, 44 fragment, ...) and its body after the
/// next-header and length bytes, padded by the builder to a multiple of 8
/// bytes (with the two leading bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ext {
    pub kind: u8,
    pub body: Vec<u8>,
}

impl Ext {
    /// A hop-by-hop, routing (type 0 with no segments left) or
    /// destination-options header of `len8` 8-byte units beyond the first.
    pub fn padded(kind: u8, len8: u8) -> Self {
        let mut body = vec![0u8; 6 + 8 * usize::from(len8)];
        if kind == 0 || kind == 60 {
            // A PadN option filling the header.
            body[0] = 1;
            body[1] = u8::try_from(body.len() - 2).expect("fits");
        }
        Self { kind, body }
    }
}

/// An Ethernet + IPv6 + TCP/UDP frame. TCP carries no options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame6 {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub hop_limit: u8,
    pub flow_label: u32,
    pub ext: Vec<Ext>,
    pub proto: Proto,
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack_number: u32,
    pub window: u16,
    pub l4_checksum: L4Checksum,
    pub payload: Vec<u8>,
}

impl Frame6 {
    /// A TCP segment: hop limit 64, seq 1000, window 64240, an HTTP
    /// request line as payload. MACs are zero until set.
    pub fn tcp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Self {
        Self {
            dmac: [0; 6],
            smac: [0; 6],
            src,
            dst,
            hop_limit: 64,
            flow_label: 0x12345,
            ext: Vec::new(),
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

    /// A UDP datagram with the payload `query`.
    pub fn udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Self {
        Self {
            proto: Proto::Udp,
            seq: 0,
            window: 0,
            payload: b"query".to_vec(),
            ..Self::tcp(src, sport, dst, dport, 0)
        }
    }

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

    pub fn l4_len(&self) -> usize {
        self.payload.len() + if self.proto == Proto::Tcp { TCP_LEN } else { UDP_LEN }
    }

    fn ext_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, e) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(self.ip_number().0, |n| n.kind);
            let mut h = vec![next, 0];
            h.extend_from_slice(&e.body);
            while h.len() % 8 != 0 {
                h.push(0);
            }
            h[1] = u8::try_from(h.len() / 8 - 1).expect("extension header too long");
            out.extend_from_slice(&h);
        }
        out
    }

    fn ipv6(&self) -> Ipv6Header {
        Ipv6Header {
            traffic_class: 0,
            flow_label: self.flow_label.try_into().expect("20-bit flow label"),
            payload_length: u16::try_from(self.ext_bytes().len() + self.l4_len()).expect("payload fits"),
            next_header: self.ext.first().map_or(self.ip_number(), |e| IpNumber(e.kind)),
            hop_limit: self.hop_limit,
            source: self.src.octets(),
            destination: self.dst.octets(),
        }
    }

    fn tcp_header(&self) -> TcpHeader {
        tcp_header((self.sport, self.dport), self.seq, self.ack_number, self.window, self.tcp_flags)
    }

    /// The unfinished checksum a sender with offload leaves: the folded
    /// IPv6 pseudo-header sum.
    pub fn l4_seed(&self) -> u16 {
        let len = u32::try_from(self.l4_len()).expect("fits");
        !Sum16BitWords::new()
            .add_16bytes(self.src.octets())
            .add_16bytes(self.dst.octets())
            .add_4bytes(len.to_be_bytes())
            .add_2bytes([0, self.ip_number().0])
            .ones_complement()
            .to_be()
    }

    /// The full TCP/UDP checksum (etherparse).
    pub fn full_l4_checksum(&self) -> u16 {
        let ip = self.ipv6();
        match self.proto {
            Proto::Tcp => self.tcp_header().calc_checksum_ipv6(&ip, &self.payload).expect("TCP length"),
            Proto::Udp => {
                UdpHeader::with_ipv6_checksum(self.sport, self.dport, &ip, &self.payload).expect("UDP length").checksum
            }
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let csum = match self.l4_checksum {
            L4Checksum::Full => self.full_l4_checksum(),
            L4Checksum::None => 0,
            L4Checksum::Partial => self.l4_seed(),
        };
        let mut out = Vec::new();
        Ethernet2Header { source: self.smac, destination: self.dmac, ether_type: EtherType::IPV6 }
            .write(&mut out)
            .expect("write to a Vec");
        self.ipv6().write(&mut out).expect("write to a Vec");
        out.extend_from_slice(&self.ext_bytes());
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

    /// Read a frame back, refusing what this builder would not make (and a
    /// wrong L4 checksum, or a UDP checksum of 0, which IPv6 forbids).
    pub fn parse(frame: &[u8]) -> Result<Self, ParseError> {
        let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| ParseError::Header(e.to_string()))?;
        if eth.ether_type != EtherType::IPV6 {
            return Err(ParseError::NotIpv4(eth.ether_type.0));
        }
        let (ip, mut rest) = Ipv6Header::from_slice(rest).map_err(|e| ParseError::Header(e.to_string()))?;
        if usize::from(ip.payload_length) != rest.len() {
            return Err(ParseError::Length {
                what: "IPv6 payload length",
                claimed: ip.payload_length.into(),
                found: rest.len(),
            });
        }
        let mut next = ip.next_header.0;
        let mut ext = Vec::new();
        while matches!(next, 0 | 43 | 60) {
            if rest.len() < 8 {
                return Err(ParseError::Header("truncated extension header".into()));
            }
            let len = (usize::from(rest[1]) + 1) * 8;
            if rest.len() < len {
                return Err(ParseError::Header("truncated extension header".into()));
            }
            ext.push(Ext { kind: next, body: rest[2..len].to_vec() });
            next = rest[0];
            rest = &rest[len..];
        }
        let mut f = Self {
            dmac: eth.destination,
            smac: eth.source,
            src: ip.source.into(),
            dst: ip.destination.into(),
            hop_limit: ip.hop_limit,
            flow_label: ip.flow_label.value(),
            ext,
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
        let found = match next {
            6 => {
                let (t, payload) = TcpHeader::from_slice(rest).map_err(|e| ParseError::Header(e.to_string()))?;
                if !t.options.is_empty() || t.ns || t.urgent_pointer != 0 {
                    return Err(ParseError::Unsupported("TCP options, NS bit or urgent pointer"));
                }
                f.tcp_flags = tcp_flags(&t);
                (f.sport, f.dport, f.seq, f.ack_number, f.window) =
                    (t.source_port, t.destination_port, t.sequence_number, t.acknowledgment_number, t.window_size);
                f.payload = payload.to_vec();
                t.checksum
            }
            17 => {
                let (u, payload) = UdpHeader::from_slice(rest).map_err(|e| ParseError::Header(e.to_string()))?;
                if usize::from(u.length) != rest.len() {
                    return Err(ParseError::Length { what: "UDP length", claimed: u.length.into(), found: rest.len() });
                }
                f.proto = Proto::Udp;
                (f.sport, f.dport) = (u.source_port, u.destination_port);
                f.payload = payload.to_vec();
                u.checksum
            }
            other => return Err(ParseError::NotTcpUdp(other)),
        };
        let full = f.full_l4_checksum();
        f.l4_checksum = if found == full {
            L4Checksum::Full
        } else if found == f.l4_seed() {
            L4Checksum::Partial
        } else {
            return Err(ParseError::L4Checksum { found, full, partial: f.l4_seed() });
        };
        debug_assert_eq!(f.bytes(), frame, "a parsed frame rebuilds to its bytes");
        Ok(f)
    }
}

/// An ICMPv6 "packet too big" read back: addresses, MTU and the quoted
/// bytes, its checksum verified by etherparse.
#[derive(Debug, PartialEq, Eq)]
pub struct TooBig6 {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub mtu: u32,
    pub quoted: Vec<u8>,
}

pub fn parse_too_big6(frame: &[u8]) -> Result<TooBig6, String> {
    let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| e.to_string())?;
    let (ip, rest) = Ipv6Header::from_slice(rest).map_err(|e| e.to_string())?;
    if ip.next_header != IpNumber::IPV6_ICMP || usize::from(ip.payload_length) != rest.len() {
        return Err(format!("not an ICMPv6 message of its stated length: {ip:?}"));
    }
    let (icmp, quoted) = Icmpv6Header::from_slice(rest).map_err(|e| e.to_string())?;
    let Icmpv6Type::PacketTooBig { mtu } = icmp.icmp_type else {
        return Err(format!("not packet too big: {:?}", icmp.icmp_type));
    };
    let want = icmp.icmp_type.calc_checksum(ip.source, ip.destination, quoted).map_err(|e| e.to_string())?;
    if icmp.checksum != want {
        return Err(format!("ICMPv6 checksum {:#06x}, should be {want:#06x}", icmp.checksum));
    }
    Ok(TooBig6 {
        dmac: eth.destination,
        smac: eth.source,
        src: ip.source.into(),
        dst: ip.destination.into(),
        mtu,
        quoted: quoted.to_vec(),
    })
}

/// An ICMP "fragmentation needed" read back, its IP and ICMP checksums
/// verified by etherparse.
#[derive(Debug, PartialEq, Eq)]
pub struct FragNeeded {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub mtu: u16,
    pub quoted: Vec<u8>,
}

pub fn parse_frag_needed(frame: &[u8]) -> Result<FragNeeded, String> {
    let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| e.to_string())?;
    let (ip, rest) = Ipv4Header::from_slice(rest).map_err(|e| e.to_string())?;
    if ip.header_checksum != ip.calc_header_checksum() {
        return Err("IPv4 header checksum".into());
    }
    if ip.protocol != IpNumber::ICMP || usize::from(ip.total_len) != ip.header_len() + rest.len() {
        return Err(format!("not an ICMP message of its stated length: {ip:?}"));
    }
    let (icmp, quoted) = Icmpv4Header::from_slice(rest).map_err(|e| e.to_string())?;
    let Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded { next_hop_mtu }) =
        icmp.icmp_type
    else {
        return Err(format!("not fragmentation needed: {:?}", icmp.icmp_type));
    };
    let want = icmp.icmp_type.calc_checksum(quoted);
    if icmp.checksum != want {
        return Err(format!("ICMP checksum {:#06x}, should be {want:#06x}", icmp.checksum));
    }
    Ok(FragNeeded {
        dmac: eth.destination,
        smac: eth.source,
        src: ip.source.into(),
        dst: ip.destination.into(),
        mtu: next_hop_mtu,
        quoted: quoted.to_vec(),
    })
}

/// The length of the frame header up to the L4 header: Ethernet, IPv6 and
/// the extension headers.
pub fn l4_offset(f: &Frame6) -> usize {
    ETH_LEN + IPV6_LEN + f.ext_bytes().len()
}

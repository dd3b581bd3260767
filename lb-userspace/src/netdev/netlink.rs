//! Netlink framing for `netdev`: building requests and attributes,
//! splitting answers into messages and attributes, reading kernel errors
//! (with extended-ack messages), and a blocking socket that sends one
//! request and collects a whole dump. Hand-written for the reason given in
//! the parent module's comment.
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::Duration;

use super::NetdevError;

// <linux/netlink.h>
pub(super) const NLMSG_HDRLEN: usize = 16;
pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
pub(super) const NLM_F_DUMP_INTR: u16 = 0x10;
pub(super) const NLM_F_DUMP: u16 = 0x300;
/// NLMSG_ERROR flag: the request's payload was not echoed back.
pub(super) const NLM_F_CAPPED: u16 = 0x100;
/// NLMSG_ERROR/NLMSG_DONE flag: extended-ack attributes follow.
pub(super) const NLM_F_ACK_TLVS: u16 = 0x200;
pub(super) const NLMSG_NOOP: u16 = 1;
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
pub(super) const NLMSGERR_ATTR_MSG: u16 = 1;
pub(super) const SOL_NETLINK: libc::c_int = 270;
pub(super) const NETLINK_EXT_ACK: libc::c_int = 11;
/// Attribute type bits that are flags (NLA_F_NESTED, NLA_F_NET_BYTEORDER).
pub(super) const NLA_TYPE_MASK: u16 = 0x3fff;
// <linux/rtnetlink.h>, <linux/if_link.h>, <linux/if.h>
pub(super) const RTM_NEWLINK: u16 = 16;
pub(super) const RTM_GETLINK: u16 = 18;
pub(super) const IFINFOMSG_LEN: usize = 16;
pub(super) const IFLA_IFNAME: u16 = 3;
pub(super) const IFLA_MTU: u16 = 4;
pub(super) const IFLA_MASTER: u16 = 10;
pub(super) const IFLA_LINKINFO: u16 = 18;
pub(super) const IFLA_EXT_MASK: u16 = 29;
pub(super) const IFLA_INFO_KIND: u16 = 1;
pub(super) const IFLA_XDP: u16 = 43;
/// IFLA_XDP_PROG_ID (the one program) through IFLA_XDP_HW_PROG_ID: one
/// id per mode in use (drv 5, skb 6, hw 7 when several are).
pub(super) const IFLA_XDP_PROG_IDS: std::ops::RangeInclusive<u16> = 4..=7;
/// IFLA_XDP_ATTACHED (a u8: XDP_ATTACHED_*), IFLA_XDP_PROG_ID and
/// IFLA_XDP_SKB_PROG_ID.
pub(super) const IFLA_XDP_ATTACHED: u16 = 2;
pub(super) const IFLA_XDP_PROG_ID: u16 = 4;
pub(super) const IFLA_XDP_SKB_PROG_ID: u16 = 6;
/// The one program is attached in generic (skb) mode.
pub(super) const XDP_ATTACHED_SKB: u8 = 2;
pub(super) const RTEXT_FILTER_SKIP_STATS: u32 = 1 << 3;
// <linux/rtnetlink.h>: routes
pub(super) const RTM_NEWROUTE: u16 = 24;
pub(super) const RTM_GETROUTE: u16 = 26;
/// struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope,
/// type (a byte each), flags (u32).
pub(super) const RTMSG_LEN: usize = 12;
/// rtm_flags: answer with the FIB entry that matched, not the resolved
/// destination (4.13+).
pub(super) const RTM_F_FIB_MATCH: u32 = 0x2000;
pub(super) const RTA_DST: u16 = 1;
pub(super) const RTA_OIF: u16 = 4;
pub(super) const RTA_METRICS: u16 = 8;
pub(super) const RTA_TABLE: u16 = 15;
/// Inside RTA_METRICS: the bitmask of locked metrics (bit `RTAX_MTU` for
/// the MTU), and the MTU.
pub(super) const RTAX_LOCK: u16 = 1;
pub(super) const RTAX_MTU: u16 = 2;
pub(super) const IFF_UP: u32 = 1;
// <linux/genetlink.h>
pub(super) const GENL_HDRLEN: usize = 4;
pub(super) const GENL_ID_CTRL: u16 = 0x10;
pub(super) const CTRL_CMD_GETFAMILY: u8 = 3;
pub(super) const CTRL_ATTR_FAMILY_ID: u16 = 1;
pub(super) const CTRL_ATTR_FAMILY_NAME: u16 = 2;
// <linux/netdev.h> (6.3+)
pub(super) const NETDEV_CMD_DEV_GET: u8 = 1;
pub(super) const NETDEV_A_DEV_IFINDEX: u16 = 1;
pub(super) const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;

/// How long one recv may wait for the kernel.
pub(super) const RECV_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a dump is retried when the device list changed under it.
pub(super) const DUMP_ATTEMPTS: u32 = 5;

pub(super) fn align4(n: usize) -> usize {
    (n + 3) & !3
}

pub(super) fn malformed(what: &'static str, detail: &'static str) -> NetdevError {
    NetdevError::Malformed { what, detail }
}

/// One netlink message (header + payload), length aligned.
pub(super) fn message(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + payload.len();
    let mut m = Vec::with_capacity(align4(len));
    m.extend(u32::try_from(len).expect("a netlink message fits u32").to_ne_bytes());
    m.extend(kind.to_ne_bytes());
    m.extend(flags.to_ne_bytes());
    m.extend(seq.to_ne_bytes());
    m.extend(0u32.to_ne_bytes()); // port id: the kernel fills in ours
    m.extend(payload);
    m.resize(align4(len), 0);
    m
}

/// One attribute, padded to 4 bytes.
pub(super) fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut a = Vec::with_capacity(align4(len));
    a.extend(u16::try_from(len).expect("a netlink attribute fits u16").to_ne_bytes());
    a.extend(kind.to_ne_bytes());
    a.extend(value);
    a.resize(align4(len), 0);
    a
}

pub(super) struct Message<'a> {
    pub(super) kind: u16,
    pub(super) flags: u16,
    pub(super) seq: u32,
    pub(super) payload: &'a [u8],
}

/// The netlink messages in one datagram; None when a length is wrong.
pub(super) fn split_messages(mut buf: &[u8]) -> Option<Vec<Message<'_>>> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let len = u32::from_ne_bytes(buf.get(0..4)?.try_into().ok()?) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return None;
        }
        out.push(Message {
            kind: u16::from_ne_bytes(buf[4..6].try_into().ok()?),
            flags: u16::from_ne_bytes(buf[6..8].try_into().ok()?),
            seq: u32::from_ne_bytes(buf[8..12].try_into().ok()?),
            payload: &buf[NLMSG_HDRLEN..len],
        });
        buf = &buf[align4(len).min(buf.len())..];
    }
    Some(out)
}

/// Attributes (type without flag bits, value) in `buf`; None when a length
/// is wrong.
pub(super) fn attributes(mut buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes(buf[0..2].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(buf[2..4].try_into().ok()?) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Some(out)
}

pub(super) fn c_string(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

pub(super) fn u16_of(v: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(v.get(..2)?.try_into().ok()?))
}

pub(super) fn u32_of(v: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

pub(super) fn i32_of(v: &[u8]) -> Option<i32> {
    Some(i32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

/// A 64-bit attribute (the kernel's nla_put_u64_64bit); a 4-byte one is
/// taken too, as the kernel's variable-width "uint" attributes may be.
pub(super) fn u64_of(v: &[u8]) -> Option<u64> {
    match v.len() {
        8 => Some(u64::from_ne_bytes(v.try_into().ok()?)),
        4 => u32_of(v).map(u64::from),
        _ => None,
    }
}

/// The status in an NLMSG_ERROR or NLMSG_DONE payload: errno (positive; 0
/// for success) and the kernel's extended-ack message, if any.
pub(super) fn status(kind: u16, flags: u16, payload: &[u8]) -> Option<(i32, Option<String>)> {
    let errno = -i32_of(payload)?;
    if errno == 0 || flags & NLM_F_ACK_TLVS == 0 {
        return Some((errno, None));
    }
    // NLMSG_ERROR: struct nlmsgerr (error, the request's header), then,
    // unless capped, the request's payload; then the attributes.
    // NLMSG_DONE: the error, then the attributes.
    let tlvs = if kind == NLMSG_ERROR {
        let request_len = u32_of(payload.get(4..)?)? as usize;
        let echoed = if flags & NLM_F_CAPPED != 0 { NLMSG_HDRLEN } else { request_len.max(NLMSG_HDRLEN) };
        align4(4 + echoed)
    } else {
        4
    };
    // A malformed extended ack loses the message, not the error.
    let message = payload
        .get(tlvs..)
        .and_then(attributes)
        .and_then(|a| a.into_iter().find(|(t, _)| *t == NLMSGERR_ATTR_MSG))
        .map(|(_, v)| c_string(v));
    Some((errno, message))
}

/// Gathers the answer to one request out of the datagrams the kernel sends
/// back: the data messages of a (multi-part) dump up to NLMSG_DONE, or the
/// answer of a single request up to its acknowledgement.
pub(super) struct Collector {
    pub(super) what: &'static str,
    pub(super) seq: u32,
    pub(super) messages: Vec<(u16, Vec<u8>)>,
    pub(super) interrupted: bool,
}

impl Collector {
    pub(super) fn new(what: &'static str, seq: u32) -> Self {
        Self { what, seq, messages: Vec::new(), interrupted: false }
    }

    /// Take one datagram; Ok(true) once the answer is complete.
    pub(super) fn take(&mut self, datagram: &[u8]) -> Result<bool, NetdevError> {
        let what = self.what;
        for m in split_messages(datagram).ok_or_else(|| malformed(what, "netlink message length"))? {
            if m.seq != self.seq {
                // Not the answer to this request (a stale one).
                continue;
            }
            if m.flags & NLM_F_DUMP_INTR != 0 {
                self.interrupted = true;
            }
            match m.kind {
                NLMSG_NOOP => {}
                NLMSG_ERROR | NLMSG_DONE => {
                    let (errno, message) = match status(m.kind, m.flags, m.payload) {
                        Some(s) => s,
                        // An old kernel may send a DONE with no status.
                        None if m.kind == NLMSG_DONE => (0, None),
                        None => return Err(malformed(what, "NLMSG_ERROR payload")),
                    };
                    if errno != 0 {
                        return Err(NetdevError::Kernel { what, errno, message });
                    }
                    return Ok(true);
                }
                kind => self.messages.push((kind, m.payload.to_vec())),
            }
        }
        Ok(false)
    }
}

pub(super) struct Socket {
    pub(super) fd: OwnedFd,
    pub(super) seq: u32,
    pub(super) buf: Vec<u8>,
}

impl Socket {
    pub(super) fn open(protocol: libc::c_int, name: &'static str) -> Result<Self, NetdevError> {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
        if fd < 0 {
            return Err(NetdevError::Socket { protocol: name, source: io::Error::last_os_error() });
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let timeout = libc::timeval {
            tv_sec: libc::time_t::try_from(RECV_TIMEOUT.as_secs()).expect("a few seconds"),
            tv_usec: 0,
        };
        // SAFETY: valid fd; the option value is a timeval of the given size.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(NetdevError::Io { what: "setting the receive timeout", source: io::Error::last_os_error() });
        }
        let one: libc::c_int = 1;
        // SAFETY: valid fd; the option value is a c_int of the given size.
        // Best effort: without extended acks errors just carry no message.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                SOL_NETLINK,
                NETLINK_EXT_ACK,
                (&raw const one).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        Ok(Self { fd, seq: 0, buf: vec![0; 64 * 1024] })
    }

    /// Send one request and gather its answer. A dump ends at NLMSG_DONE;
    /// any other request is sent with NLM_F_ACK and ends at the ack.
    pub(super) fn request(
        &mut self,
        what: &'static str,
        kind: u16,
        dump: bool,
        payload: &[u8],
    ) -> Result<Collector, NetdevError> {
        self.seq = self.seq.wrapping_add(1);
        let flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { NLM_F_ACK };
        let msg = message(kind, flags, self.seq, payload);
        loop {
            // SAFETY: msg is a valid buffer of msg.len() bytes; the kernel is
            // the default destination of an unconnected netlink socket.
            let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
            if sent >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(NetdevError::Io { what, source: e });
            }
        }
        let mut answer = Collector::new(what, self.seq);
        loop {
            let n = self.recv(what)?;
            if answer.take(&self.buf[..n])? {
                return Ok(answer);
            }
        }
    }

    /// A dump, retried while the kernel flags it as interrupted by changes.
    pub(super) fn dump(
        &mut self,
        what: &'static str,
        kind: u16,
        payload: &[u8],
    ) -> Result<Vec<(u16, Vec<u8>)>, NetdevError> {
        for _ in 0..DUMP_ATTEMPTS {
            let answer = self.request(what, kind, true, payload)?;
            if !answer.interrupted {
                return Ok(answer.messages);
            }
        }
        Err(NetdevError::Inconsistent { what, attempts: DUMP_ATTEMPTS })
    }

    /// Receive one whole datagram into `self.buf`, growing it first when
    /// the datagram is larger; returns its length.
    pub(super) fn recv(&mut self, what: &'static str) -> Result<usize, NetdevError> {
        let fd = self.fd.as_raw_fd();
        let fail = |e: io::Error| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => NetdevError::Timeout { what, timeout: RECV_TIMEOUT },
            _ => NetdevError::Io { what, source: e },
        };
        loop {
            // SAFETY: peeks at the next datagram without copying any of it
            // (length 0); MSG_TRUNC makes netlink return its real length.
            let size = unsafe { libc::recv(fd, self.buf.as_mut_ptr().cast(), 0, libc::MSG_PEEK | libc::MSG_TRUNC) };
            if size < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(fail(e));
            }
            let size = size as usize;
            if size > self.buf.len() {
                self.buf.resize(size, 0);
            }
            // SAFETY: buf is a valid writable buffer of buf.len() bytes.
            let n = unsafe { libc::recv(fd, self.buf.as_mut_ptr().cast(), self.buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(fail(e));
            }
            return Ok(n as usize);
        }
    }
}

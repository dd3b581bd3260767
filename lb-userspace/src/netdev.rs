//! What the network devices of lbd's namespace are, and whether each can
//! transmit XDP-redirected frames: rtnetlink (RTM_GETLINK) for name, type,
//! kind, master and state; the netdev generic-netlink family
//! (NETDEV_CMD_DEV_GET) for the XDP features the kernel reports.
//!
//! Synchronous, blocking, no runtime: lbd calls it at attach and every few
//! seconds. Sockets are opened per call, so a call answers for the network
//! namespace of the calling thread.
//!
//! Why the netlink encoding is written here rather than taken from the
//! rust-netlink crates: this is two dump requests and a family lookup with
//! flat attribute walks (a few hundred lines with the error handling and
//! tests). `netlink-sys` + `netlink-packet-route` would cover the
//! rtnetlink half, but no crate knows the netdev family, so its
//! `GenlFamily` and attribute parsing would be hand-written here anyway.
//! That means four crates (core, route, generic, sys) whose APIs break
//! often between releases, to save the smaller half.
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::Duration;

/// NETDEV_XDP_ACT_BASIC: XDP_ABORTED/DROP/PASS/TX in native (driver) mode.
pub const XDP_ACT_BASIC: u64 = 1;
/// NETDEV_XDP_ACT_REDIRECT: the driver's XDP can return XDP_REDIRECT.
pub const XDP_ACT_REDIRECT: u64 = 2;
/// NETDEV_XDP_ACT_NDO_XMIT: the device can transmit frames redirected by
/// native XDP.
pub const XDP_ACT_NDO_XMIT: u64 = 4;
pub const XDP_ACT_XSK_ZEROCOPY: u64 = 8;
pub const XDP_ACT_HW_OFFLOAD: u64 = 16;
pub const XDP_ACT_RX_SG: u64 = 32;
pub const XDP_ACT_NDO_XMIT_SG: u64 = 64;

/// ARPHRD_ETHER.
const ARPHRD_ETHER: u16 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub ifindex: u32,
    pub name: String,
    /// rtnetlink IFLA_INFO_KIND ("veth", "bridge", "macvlan", "vxlan",
    /// ...); None for a physical NIC / no linkinfo.
    pub kind: Option<String>,
    /// ifi_type (ARPHRD_*): 1 = Ethernet. Only Ethernet devices can take a
    /// redirected Ethernet frame at all.
    pub link_type: u16,
    /// IFLA_MASTER: the bridge (or bond) this device is a port of.
    pub master: Option<u32>,
    /// IFF_UP set.
    pub up: bool,
    /// netdev genetlink NETDEV_A_DEV_XDP_FEATURES bits (`XDP_ACT_*`); None
    /// when the kernel has no netdev family or did not report the device.
    pub xdp_features: Option<u64>,
}

impl Link {
    /// Only an Ethernet device can take a redirected Ethernet frame.
    pub fn is_ethernet(&self) -> bool {
        self.link_type == ARPHRD_ETHER
    }

    /// Native XDP can redirect into this device (NDO_XMIT in xdp_features).
    pub fn native_xmit(&self) -> bool {
        self.xdp_features.is_some_and(|f| f & XDP_ACT_NDO_XMIT != 0)
    }

    /// The device supports native (driver-mode) XDP at all (BASIC bit).
    pub fn native_xdp(&self) -> bool {
        self.xdp_features.is_some_and(|f| f & XDP_ACT_BASIC != 0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetdevError {
    /// socket(2) failed.
    #[error("opening a {protocol} netlink socket: {source}")]
    Socket { protocol: &'static str, source: io::Error },
    /// send/recv (or a socket option) on the netlink socket failed.
    #[error("netlink {what}: {source}")]
    Io { what: &'static str, source: io::Error },
    /// The kernel did not answer in time.
    #[error("netlink {what}: no answer from the kernel within {timeout:?}")]
    Timeout { what: &'static str, timeout: Duration },
    /// The kernel refused the request (NLMSG_ERROR), or failed the dump
    /// part-way (an error in NLMSG_DONE). `errno` is positive; `message`
    /// is the kernel's extended-ack text, when it gave one.
    #[error("netlink {what}: the kernel answered: {}", kernel_says(*.errno, .message.as_deref()))]
    Kernel { what: &'static str, errno: i32, message: Option<String> },
    /// The answer does not parse; `detail` names the part that did not.
    #[error("netlink {what}: malformed answer ({detail})")]
    Malformed { what: &'static str, detail: &'static str },
    /// Devices kept changing while they were listed (NLM_F_DUMP_INTR on
    /// every attempt).
    #[error("netlink {what}: devices changed during the listing, {attempts} times in a row")]
    Inconsistent { what: &'static str, attempts: u32 },
}

fn kernel_says(errno: i32, message: Option<&str>) -> String {
    let e = io::Error::from_raw_os_error(errno);
    match message {
        Some(m) => format!("{e} ({m})"),
        None => e.to_string(),
    }
}

/// Every device of the current network namespace, by ifindex order.
pub fn links() -> Result<Vec<Link>, NetdevError> {
    let mut links = rt_links()?;
    if let Some(features) = xdp_features()? {
        for l in &mut links {
            l.xdp_features = features.get(&l.ifindex).copied();
        }
    }
    links.sort_by_key(|l| l.ifindex);
    Ok(links)
}

/// One device by name (None when absent).
pub fn link_by_name(name: &str) -> Result<Option<Link>, NetdevError> {
    Ok(links()?.into_iter().find(|l| l.name == name))
}

// ---------------------------------------------------------------- netlink

// <linux/netlink.h>
const NLMSG_HDRLEN: usize = 16;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLM_F_DUMP: u16 = 0x300;
/// NLMSG_ERROR flag: the request's payload was not echoed back.
const NLM_F_CAPPED: u16 = 0x100;
/// NLMSG_ERROR/NLMSG_DONE flag: extended-ack attributes follow.
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSG_NOOP: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSGERR_ATTR_MSG: u16 = 1;
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_EXT_ACK: libc::c_int = 11;
/// Attribute type bits that are flags (NLA_F_NESTED, NLA_F_NET_BYTEORDER).
const NLA_TYPE_MASK: u16 = 0x3fff;
// <linux/rtnetlink.h>, <linux/if_link.h>, <linux/if.h>
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFINFOMSG_LEN: usize = 16;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_EXT_MASK: u16 = 29;
const IFLA_INFO_KIND: u16 = 1;
const RTEXT_FILTER_SKIP_STATS: u32 = 1 << 3;
const IFF_UP: u32 = 1;
// <linux/genetlink.h>
const GENL_HDRLEN: usize = 4;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
// <linux/netdev.h> (6.3+)
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;

/// How long one recv may wait for the kernel.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a dump is retried when the device list changed under it.
const DUMP_ATTEMPTS: u32 = 5;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn malformed(what: &'static str, detail: &'static str) -> NetdevError {
    NetdevError::Malformed { what, detail }
}

/// One netlink message (header + payload), length aligned.
fn message(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
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
fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut a = Vec::with_capacity(align4(len));
    a.extend(u16::try_from(len).expect("a netlink attribute fits u16").to_ne_bytes());
    a.extend(kind.to_ne_bytes());
    a.extend(value);
    a.resize(align4(len), 0);
    a
}

struct Message<'a> {
    kind: u16,
    flags: u16,
    seq: u32,
    payload: &'a [u8],
}

/// The netlink messages in one datagram; None when a length is wrong.
fn split_messages(mut buf: &[u8]) -> Option<Vec<Message<'_>>> {
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
fn attributes(mut buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
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

fn c_string(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

fn u16_of(v: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(v.get(..2)?.try_into().ok()?))
}

fn u32_of(v: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

fn i32_of(v: &[u8]) -> Option<i32> {
    Some(i32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

/// A 64-bit attribute (the kernel's nla_put_u64_64bit); a 4-byte one is
/// taken too, as the kernel's variable-width "uint" attributes may be.
fn u64_of(v: &[u8]) -> Option<u64> {
    match v.len() {
        8 => Some(u64::from_ne_bytes(v.try_into().ok()?)),
        4 => u32_of(v).map(u64::from),
        _ => None,
    }
}

/// The status in an NLMSG_ERROR or NLMSG_DONE payload: errno (positive; 0
/// for success) and the kernel's extended-ack message, if any.
fn status(kind: u16, flags: u16, payload: &[u8]) -> Option<(i32, Option<String>)> {
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
struct Collector {
    what: &'static str,
    seq: u32,
    messages: Vec<(u16, Vec<u8>)>,
    interrupted: bool,
}

impl Collector {
    fn new(what: &'static str, seq: u32) -> Self {
        Self { what, seq, messages: Vec::new(), interrupted: false }
    }

    /// Take one datagram; Ok(true) once the answer is complete.
    fn take(&mut self, datagram: &[u8]) -> Result<bool, NetdevError> {
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

struct Socket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl Socket {
    fn open(protocol: libc::c_int, name: &'static str) -> Result<Self, NetdevError> {
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
    fn request(&mut self, what: &'static str, kind: u16, dump: bool, payload: &[u8]) -> Result<Collector, NetdevError> {
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
    fn dump(&mut self, what: &'static str, kind: u16, payload: &[u8]) -> Result<Vec<(u16, Vec<u8>)>, NetdevError> {
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
    fn recv(&mut self, what: &'static str) -> Result<usize, NetdevError> {
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

/// Parse one RTM_NEWLINK payload (struct ifinfomsg, then attributes).
fn parse_link(body: &[u8]) -> Option<Link> {
    if body.len() < IFINFOMSG_LEN {
        return None;
    }
    // ifinfomsg: family (u8), pad (u8), type (u16), index (i32), flags, change.
    let link_type = u16_of(&body[2..4])?;
    let ifindex = u32_of(&body[4..8])?;
    let flags = u32_of(&body[8..12])?;
    let mut name = None;
    let mut kind = None;
    let mut master = None;
    for (t, v) in attributes(&body[IFINFOMSG_LEN..])? {
        match t {
            IFLA_IFNAME => name = Some(c_string(v)),
            IFLA_MASTER => master = Some(u32_of(v)?),
            IFLA_LINKINFO => {
                for (it, iv) in attributes(v)? {
                    if it == IFLA_INFO_KIND {
                        kind = Some(c_string(iv));
                    }
                }
            }
            _ => {}
        }
    }
    Some(Link { ifindex, name: name?, kind, link_type, master, up: flags & IFF_UP != 0, xdp_features: None })
}

fn rt_links() -> Result<Vec<Link>, NetdevError> {
    const WHAT: &str = "RTM_GETLINK dump";
    let mut sock = Socket::open(libc::NETLINK_ROUTE, "route")?;
    // ifinfomsg all zero: AF_UNSPEC, every device; no statistics wanted.
    let mut req = vec![0u8; IFINFOMSG_LEN];
    req.extend(attr(IFLA_EXT_MASK, &RTEXT_FILTER_SKIP_STATS.to_ne_bytes()));
    sock.dump(WHAT, RTM_GETLINK, &req)?
        .iter()
        .filter(|(t, _)| *t == RTM_NEWLINK)
        .map(|(_, b)| parse_link(b).ok_or_else(|| malformed(WHAT, "RTM_NEWLINK payload")))
        .collect()
}

/// The family id in a CTRL_CMD_GETFAMILY answer (genlmsghdr, attributes).
fn parse_family_id(body: &[u8]) -> Option<u16> {
    attributes(body.get(GENL_HDRLEN..)?)?
        .into_iter()
        .find(|(t, _)| *t == CTRL_ATTR_FAMILY_ID)
        .and_then(|(_, v)| u16_of(v))
}

/// (ifindex, XDP features) of one NETDEV_CMD_DEV_GET answer; features
/// None when the kernel left them out.
fn parse_dev(body: &[u8]) -> Option<(u32, Option<u64>)> {
    let mut ifindex = None;
    let mut features = None;
    for (t, v) in attributes(body.get(GENL_HDRLEN..)?)? {
        match t {
            NETDEV_A_DEV_IFINDEX => ifindex = Some(u32_of(v)?),
            NETDEV_A_DEV_XDP_FEATURES => features = Some(u64_of(v)?),
            _ => {}
        }
    }
    Some((ifindex?, features))
}

/// The id of a generic-netlink family; None when the kernel has no such
/// family.
fn family_id(sock: &mut Socket, name: &str) -> Result<Option<u16>, NetdevError> {
    const LOOKUP: &str = "generic-netlink family lookup (CTRL_CMD_GETFAMILY)";
    // genlmsghdr: command, version, reserved.
    let mut req = vec![CTRL_CMD_GETFAMILY, 1, 0, 0];
    let mut c_name = name.as_bytes().to_vec();
    c_name.push(0);
    req.extend(attr(CTRL_ATTR_FAMILY_NAME, &c_name));
    let answer = match sock.request(LOOKUP, GENL_ID_CTRL, false, &req) {
        Ok(a) => a,
        Err(NetdevError::Kernel { errno: libc::ENOENT, .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    answer
        .messages
        .iter()
        .find(|(t, _)| *t == GENL_ID_CTRL)
        .and_then(|(_, b)| parse_family_id(b))
        .map(Some)
        .ok_or_else(|| malformed(LOOKUP, "no CTRL_ATTR_FAMILY_ID"))
}

/// ifindex -> XDP features; None when the kernel has no netdev family
/// (before 6.3).
fn xdp_features() -> Result<Option<HashMap<u32, u64>>, NetdevError> {
    const WHAT: &str = "NETDEV_CMD_DEV_GET dump";
    let mut sock = Socket::open(libc::NETLINK_GENERIC, "generic")?;
    let Some(family) = family_id(&mut sock, "netdev")? else { return Ok(None) };
    let mut out = HashMap::new();
    for (t, body) in sock.dump(WHAT, family, &[NETDEV_CMD_DEV_GET, 1, 0, 0])? {
        if t != family {
            continue;
        }
        if let (ifindex, Some(features)) = parse_dev(&body).ok_or_else(|| malformed(WHAT, "device attributes"))? {
            out.insert(ifindex, features);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    fn ifinfo(link_type: u16, ifindex: u32, flags: u32) -> Vec<u8> {
        let mut b = vec![0u8; IFINFOMSG_LEN];
        b[2..4].copy_from_slice(&link_type.to_ne_bytes());
        b[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        b[8..12].copy_from_slice(&flags.to_ne_bytes());
        b
    }

    #[test]
    fn link_attributes_parse_with_padding_and_nesting() {
        let mut body = ifinfo(1, 7, IFF_UP | 0x40);
        body.extend(attr(IFLA_IFNAME, b"veth0\0")); // 6 bytes: padded to 8
        body.extend(attr(IFLA_MASTER, &3u32.to_ne_bytes()));
        body.extend(attr(99, b"ignored"));
        // IFLA_LINKINFO carries NLA_F_NESTED; IFLA_INFO_DATA comes along.
        let mut info = attr(IFLA_INFO_KIND, b"veth\0");
        info.extend(attr(2 | 0x8000, &attr(1, &[0; 4])));
        body.extend(attr(IFLA_LINKINFO | 0x8000, &info));
        assert_eq!(
            parse_link(&body).unwrap(),
            Link {
                ifindex: 7,
                name: "veth0".into(),
                kind: Some("veth".into()),
                link_type: 1,
                master: Some(3),
                up: true,
                xdp_features: None
            }
        );
        // A physical NIC: no linkinfo, no master, down.
        let mut nic = ifinfo(1, 2, 0);
        nic.extend(attr(IFLA_IFNAME, b"eth0\0"));
        let l = parse_link(&nic).unwrap();
        assert_eq!((l.kind.as_deref(), l.master, l.up), (None, None, false));
        assert!(l.is_ethernet() && !l.native_xdp() && !l.native_xmit());
    }

    #[test]
    fn malformed_links_are_refused_not_read() {
        // An attribute length past the end.
        let mut bad = ifinfo(1, 1, 0);
        bad.extend([200, 0, 3, 0, b'x', 0, 0, 0]);
        assert!(parse_link(&bad).is_none());
        // A nested attribute length past the end of its parent.
        let mut bad = ifinfo(1, 1, 0);
        bad.extend(attr(IFLA_IFNAME, b"a\0"));
        bad.extend(attr(IFLA_LINKINFO, &[40, 0, 1, 0, b'v', 0, 0, 0]));
        assert!(parse_link(&bad).is_none());
        // A short IFLA_MASTER, no name, a short ifinfomsg.
        let mut bad = ifinfo(1, 1, 0);
        bad.extend(attr(IFLA_IFNAME, b"a\0"));
        bad.extend(attr(IFLA_MASTER, &[1, 0]));
        assert!(parse_link(&bad).is_none());
        assert!(parse_link(&ifinfo(1, 1, 0)).is_none());
        assert!(parse_link(&[0; 8]).is_none());
    }

    #[test]
    fn genl_answers_parse() {
        let mut fam = vec![1, 2, 0, 0];
        fam.extend(attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0"));
        fam.extend(attr(CTRL_ATTR_FAMILY_ID, &0x1au16.to_ne_bytes()));
        assert_eq!(parse_family_id(&fam), Some(0x1a));
        assert_eq!(parse_family_id(&[1, 2, 0, 0]), None);

        // As the kernel sends it: ifindex, a PAD attribute aligning the u64,
        // the u64, then attributes this module does not know.
        let mut dev = vec![NETDEV_CMD_DEV_GET, 1, 0, 0];
        dev.extend(attr(NETDEV_A_DEV_IFINDEX, &4u32.to_ne_bytes()));
        dev.extend(attr(2, &[]));
        let f = XDP_ACT_BASIC | XDP_ACT_REDIRECT | XDP_ACT_NDO_XMIT | XDP_ACT_RX_SG;
        dev.extend(attr(NETDEV_A_DEV_XDP_FEATURES, &f.to_ne_bytes()));
        dev.extend(attr(4, &0u32.to_ne_bytes()));
        assert_eq!(parse_dev(&dev), Some((4, Some(f))));
        let l = Link {
            ifindex: 4,
            name: "v".into(),
            kind: Some("veth".into()),
            link_type: 1,
            master: None,
            up: true,
            xdp_features: Some(f),
        };
        assert!(l.native_xdp() && l.native_xmit());
        let l = Link { xdp_features: Some(XDP_ACT_BASIC | XDP_ACT_REDIRECT), ..l };
        assert!(l.native_xdp() && !l.native_xmit());
        // No features reported; no ifindex; a 3-byte u64.
        let mut dev = vec![NETDEV_CMD_DEV_GET, 1, 0, 0];
        dev.extend(attr(NETDEV_A_DEV_IFINDEX, &9u32.to_ne_bytes()));
        assert_eq!(parse_dev(&dev), Some((9, None)));
        assert_eq!(parse_dev(&[NETDEV_CMD_DEV_GET, 1, 0, 0]), None);
        dev.extend(attr(NETDEV_A_DEV_XDP_FEATURES, &[1, 2, 3]));
        assert_eq!(parse_dev(&dev), None);
    }

    fn done(seq: u32, flags: u16, errno: i32, tlvs: &[u8]) -> Vec<u8> {
        let mut p = (-errno).to_ne_bytes().to_vec();
        p.extend(tlvs);
        message(NLMSG_DONE, flags, seq, &p)
    }

    #[test]
    fn a_dump_spans_datagrams_and_ends_at_done() {
        let mut c = Collector::new("test dump", 7);
        let mut d1 = message(RTM_NEWLINK, 2, 7, b"one\0");
        d1.extend(message(RTM_NEWLINK, 2, 6, b"stale")); // another request's
        d1.extend(message(NLMSG_NOOP, 0, 7, &[]));
        d1.extend(message(RTM_NEWLINK, 2, 7, b"two\0"));
        assert!(!c.take(&d1).unwrap());
        let mut d2 = message(RTM_NEWLINK, 2, 7, b"three"); // 5 bytes: padded
        d2.extend(done(7, 2, 0, &[]));
        assert!(c.take(&d2).unwrap());
        let bodies: Vec<&[u8]> = c.messages.iter().map(|(_, b)| &b[..]).collect();
        assert_eq!(bodies, [&b"one\0"[..], b"two\0", b"three"]);
        assert!(!c.interrupted);

        // NLM_F_DUMP_INTR on any part marks the whole answer.
        let mut c = Collector::new("test dump", 1);
        assert!(!c.take(&message(RTM_NEWLINK, 2 | NLM_F_DUMP_INTR, 1, b"x\0\0\0")).unwrap());
        assert!(c.take(&done(1, 2, 0, &[])).unwrap());
        assert!(c.interrupted);

        // A single request ends at its (capped) acknowledgement.
        let mut c = Collector::new("test get", 3);
        let mut d = message(0x1a, 0, 3, &[1, 2, 0, 0]);
        let mut ack = 0i32.to_ne_bytes().to_vec();
        ack.extend(message(0x1a, NLM_F_REQUEST | NLM_F_ACK, 3, &[])[..NLMSG_HDRLEN].iter());
        d.extend(message(NLMSG_ERROR, NLM_F_CAPPED, 3, &ack));
        assert!(c.take(&d).unwrap());
        assert_eq!(c.messages.len(), 1);
    }

    #[test]
    fn kernel_errors_name_the_request_errno_and_message() {
        // NLMSG_ERROR, not capped: the request is echoed, then the TLVs.
        let request = message(GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK, 4, b"netdev\0");
        let mut p = (-libc::ENOENT).to_ne_bytes().to_vec();
        p.extend(&request[..NLMSG_HDRLEN + 7]);
        p.resize(align4(p.len()), 0);
        p.extend(attr(NLMSGERR_ATTR_MSG, b"no such family\0"));
        let mut c = Collector::new("family lookup", 4);
        let e = c.take(&message(NLMSG_ERROR, NLM_F_ACK_TLVS, 4, &p)).unwrap_err();
        assert!(
            matches!(&e, NetdevError::Kernel { what: "family lookup", errno: libc::ENOENT, message: Some(m) } if m == "no such family"),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("family lookup") && text.contains("No such file") && text.contains("no such family"),
            "{text}"
        );

        // NLMSG_ERROR, capped, no TLVs.
        let mut p = (-libc::EPERM).to_ne_bytes().to_vec();
        p.extend(&request[..NLMSG_HDRLEN]);
        let e = Collector::new("dump", 4).take(&message(NLMSG_ERROR, NLM_F_CAPPED, 4, &p)).unwrap_err();
        assert!(matches!(e, NetdevError::Kernel { errno: libc::EPERM, message: None, .. }), "{e:?}");

        // A dump that fails part-way says so in NLMSG_DONE.
        let mut c = Collector::new("dump", 9);
        assert!(!c.take(&message(RTM_NEWLINK, 2, 9, b"x\0\0\0")).unwrap());
        let tlvs = attr(NLMSGERR_ATTR_MSG, b"dump failed\0");
        let e = c.take(&done(9, 2 | NLM_F_ACK_TLVS, libc::EMSGSIZE, &tlvs)).unwrap_err();
        assert!(
            matches!(&e, NetdevError::Kernel { errno: libc::EMSGSIZE, message: Some(m), .. } if m == "dump failed"),
            "{e:?}"
        );

        // Broken framing.
        let mut d = message(RTM_NEWLINK, 2, 1, b"abcd");
        d[0] = 200;
        assert!(matches!(Collector::new("dump", 1).take(&d), Err(NetdevError::Malformed { .. })));
        assert!(matches!(Collector::new("dump", 1).take(&[1, 2, 3]), Err(NetdevError::Malformed { .. })));
        let short_error = message(NLMSG_ERROR, 0, 1, &[0, 0]);
        assert!(matches!(Collector::new("get", 1).take(&short_error), Err(NetdevError::Malformed { .. })));
    }

    #[test]
    fn the_kernel_answers_lookups_and_refusals() {
        let mut sock = Socket::open(libc::NETLINK_GENERIC, "generic").unwrap();
        assert_eq!(family_id(&mut sock, "lbt-nofamily").unwrap(), None);
        let netdev = family_id(&mut sock, "netdev").unwrap().expect("kernel 6.3+ has the netdev family");
        assert_eq!(family_id(&mut sock, "nlctrl").unwrap(), Some(GENL_ID_CTRL));
        // A device that does not exist: an NLMSG_ERROR echoing the request.
        let mut req = vec![NETDEV_CMD_DEV_GET, 1, 0, 0];
        req.extend(attr(NETDEV_A_DEV_IFINDEX, &0x7fff_fff0u32.to_ne_bytes()));
        let e = sock.request("NETDEV_CMD_DEV_GET", netdev, false, &req).err().unwrap();
        assert!(matches!(e, NetdevError::Kernel { what: "NETDEV_CMD_DEV_GET", errno: libc::ENODEV, .. }), "{e:?}");
        // The same socket carries on after the refusal.
        let one = sock.request("NETDEV_CMD_DEV_GET", netdev, false, &[NETDEV_CMD_DEV_GET, 1, 0, 0]);
        assert!(matches!(one, Err(NetdevError::Kernel { .. })), "no ifindex given: refused");
        let all = sock.dump("NETDEV_CMD_DEV_GET dump", netdev, &[NETDEV_CMD_DEV_GET, 1, 0, 0]).unwrap();
        assert!(all.iter().any(|(_, b)| parse_dev(b).is_some_and(|(i, _)| i == 1)), "lo is listed");
        // rtnetlink in this namespace: lo, and ifindex order.
        let ls = links().unwrap();
        assert!(ls.iter().any(|l| l.ifindex == 1 && l.name == "lo"), "{ls:?}");
        assert!(ls.windows(2).all(|w| w[0].ifindex < w[1].ifindex));
    }

    /// A throwaway network namespace, deleted when dropped (also on panic).
    struct Ns(String);

    impl Drop for Ns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
        }
    }

    impl Ns {
        fn new() -> Self {
            let ns = Ns(format!("lbt-netdev-{}", std::process::id()));
            let _ = Command::new("ip").args(["netns", "del", &ns.0]).output();
            let out = Command::new("ip").args(["netns", "add", &ns.0]).output().unwrap();
            assert!(out.status.success(), "ip netns add {}: {}", ns.0, String::from_utf8_lossy(&out.stderr));
            ns
        }

        fn run(&self, cmd: &[&str]) {
            let out = Command::new("ip").args(["netns", "exec", &self.0]).args(cmd).output().unwrap();
            assert!(out.status.success(), "{cmd:?} in {}: {}", self.0, String::from_utf8_lossy(&out.stderr));
        }

        fn ip(&self, args: &str) {
            let mut cmd = vec!["ip"];
            cmd.extend(args.split(' '));
            self.run(&cmd);
        }

        /// Run `f` in a fresh thread that has entered the namespace.
        fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
            let path = format!("/run/netns/{}", self.0);
            std::thread::spawn(move || {
                let ns = std::fs::File::open(&path).unwrap();
                // SAFETY: setns(2) with a valid namespace fd; it moves only
                // this thread, which ends after `f`.
                let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns {path}: {}", io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap()
        }

        fn links(&self) -> Vec<Link> {
            self.within(|| links().unwrap())
        }
    }

    fn get(ls: &[Link], name: &str) -> Link {
        ls.iter().find(|l| l.name == name).cloned().unwrap_or_else(|| panic!("no {name} in {ls:?}"))
    }

    #[test]
    fn kinds_and_native_redirect_targets_as_the_kernel_reports_them() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root (it creates a network namespace)");
        let ns = Ns::new();
        ns.ip("link add va type veth peer name vb");
        ns.ip("link add br0 type bridge");
        ns.ip("link set va up");
        ns.ip("link set vb up");
        ns.ip("link set br0 up");
        // Default veths have GRO off; make sure of it on the peer.
        ns.run(&["ethtool", "-K", "vb", "gro", "off"]);

        let ls = ns.links();
        assert!(ls.windows(2).all(|w| w[0].ifindex < w[1].ifindex), "by ifindex: {ls:?}");
        let (lo, va, br) = (get(&ls, "lo"), get(&ls, "va"), get(&ls, "br0"));
        assert_eq!((lo.link_type, lo.kind.as_deref(), lo.up), (772, None, false));
        assert!(!lo.is_ethernet());
        assert_eq!(va.kind.as_deref(), Some("veth"));
        assert_eq!(br.kind.as_deref(), Some("bridge"));
        assert!(va.is_ethernet() && br.is_ethernet() && va.up && br.up);
        let veth_least = XDP_ACT_BASIC | XDP_ACT_REDIRECT | XDP_ACT_RX_SG;
        let f = va.xdp_features.expect("this kernel has the netdev family");
        assert_eq!(f & veth_least, veth_least, "{va:?}");
        assert!(va.native_xdp());
        assert!(!va.native_xmit(), "a veth whose peer has neither XDP nor GRO: {va:?}");
        assert!(!br.native_xmit() && !br.native_xdp(), "{br:?}");
        assert_eq!(va.master, None);

        // GRO on the peer makes the veth a native redirect target.
        ns.run(&["ethtool", "-K", "vb", "gro", "on"]);
        let va = ns.within(|| link_by_name("va").unwrap().unwrap());
        assert!(va.native_xmit(), "{va:?}");
        assert!(ns.within(|| link_by_name("nonexistent0").unwrap()).is_none());

        // A bridge port names its bridge.
        ns.ip("link set vb master br0");
        let ls = ns.links();
        assert_eq!(get(&ls, "vb").master, Some(get(&ls, "br0").ifindex));
        assert!(!get(&ls, "br0").native_xmit());
    }
}

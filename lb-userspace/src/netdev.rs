//! What the network devices of lbd's namespace are, and whether each can
//! transmit XDP-redirected frames: rtnetlink (RTM_GETLINK) for name, type,
//! kind, master and state; the netdev generic-netlink family
//! (NETDEV_CMD_DEV_GET) for the XDP features the kernel reports.
//!
//! The netlink encoding is written here rather than taken from a crate:
//! it is two dump requests and a flat attribute walk (about 150 lines),
//! the rust-netlink crates have no netdev-family support, and their
//! tokio connection machinery is more than a synchronous 2-second poll
//! needs.
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

pub const XDP_ACT_BASIC: u64 = 1;
pub const XDP_ACT_REDIRECT: u64 = 2;
/// The device can transmit frames redirected by native XDP.
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
    /// IFLA_INFO_KIND ("veth", "bridge", "macvlan", "vxlan", ...); None for
    /// a physical NIC.
    pub kind: Option<String>,
    /// ifi_type (ARPHRD_*): 1 = Ethernet.
    pub link_type: u16,
    /// IFLA_MASTER: the bridge or bond this device is a port of.
    pub master: Option<u32>,
    /// IFF_UP.
    pub up: bool,
    /// NETDEV_A_DEV_XDP_FEATURES (`XDP_ACT_*`); None when the kernel has no
    /// netdev family or did not report the device.
    pub xdp_features: Option<u64>,
}

impl Link {
    /// Only an Ethernet device can take a redirected Ethernet frame.
    pub fn is_ethernet(&self) -> bool {
        self.link_type == ARPHRD_ETHER
    }

    /// Native XDP can redirect into this device.
    pub fn native_xmit(&self) -> bool {
        self.xdp_features.is_some_and(|f| f & XDP_ACT_NDO_XMIT != 0)
    }

    /// The device runs XDP programs in native (driver) mode.
    pub fn native_xdp(&self) -> bool {
        self.xdp_features.is_some_and(|f| f & XDP_ACT_BASIC != 0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetdevError {
    #[error("netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("netlink {what}: {source}")]
    Io { what: &'static str, source: std::io::Error },
    #[error("netlink {what}: the kernel answered error {errno}")]
    Kernel { what: &'static str, errno: i32 },
    #[error("netlink {what}: malformed message")]
    Malformed { what: &'static str },
}

/// Every device of the current network namespace, by ifindex.
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

/// One device by name.
pub fn link_by_name(name: &str) -> Result<Option<Link>, NetdevError> {
    Ok(links()?.into_iter().find(|l| l.name == name))
}

// ---------------------------------------------------------------- netlink

const NLMSG_HDRLEN: usize = 16;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFF_UP: u32 = 1;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
/// Attribute type bits that are flags, not part of the type.
const NLA_TYPE_MASK: u16 = 0x3fff;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

struct Socket(OwnedFd);

impl Socket {
    fn open(protocol: i32) -> Result<Self, NetdevError> {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
        if fd < 0 {
            return Err(NetdevError::Socket(std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Send one request (header filled in here) and collect every reply
    /// message's (type, payload) until the dump ends (or, without
    /// NLM_F_DUMP, the one answer).
    fn request(
        &self,
        what: &'static str,
        kind: u16,
        flags: u16,
        payload: &[u8],
    ) -> Result<Vec<(u16, Vec<u8>)>, NetdevError> {
        let io = |source| NetdevError::Io { what, source };
        let len = NLMSG_HDRLEN + payload.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend((len as u32).to_ne_bytes());
        msg.extend(kind.to_ne_bytes());
        msg.extend((flags | NLM_F_REQUEST).to_ne_bytes());
        msg.extend(1u32.to_ne_bytes()); // sequence
        msg.extend(0u32.to_ne_bytes()); // port id: the kernel's
        msg.extend(payload);
        // SAFETY: msg is a valid buffer of msg.len() bytes; the kernel is
        // the default destination of an unbound netlink socket.
        let sent = unsafe { libc::send(self.0.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: buf is a valid writable buffer of buf.len() bytes.
            let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(io(e));
            }
            for (t, body) in split_messages(&buf[..n as usize]).ok_or(NetdevError::Malformed { what })? {
                match t {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let errno = i32::from_ne_bytes(
                            body.get(..4).ok_or(NetdevError::Malformed { what })?.try_into().expect("4 bytes"),
                        );
                        if errno == 0 {
                            // An acknowledgement: the end of a non-dump answer.
                            return Ok(out);
                        }
                        return Err(NetdevError::Kernel { what, errno: -errno });
                    }
                    _ => out.push((t, body.to_vec())),
                }
            }
            if flags & NLM_F_DUMP == 0 && !out.is_empty() {
                return Ok(out);
            }
        }
    }
}

/// Netlink messages in one datagram: (type, payload after the header).
fn split_messages(mut buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(buf[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(buf[4..6].try_into().ok()?);
        if len < NLMSG_HDRLEN || len > buf.len() {
            return None;
        }
        out.push((kind, &buf[NLMSG_HDRLEN..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Some(out)
}

/// Attributes (type without flag bits, value) in `buf`.
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

fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(align4(4 + value.len()));
    a.extend(((4 + value.len()) as u16).to_ne_bytes());
    a.extend(kind.to_ne_bytes());
    a.extend(value);
    a.resize(align4(a.len()), 0);
    a
}

fn c_string(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

fn u32_of(v: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

/// Parse one RTM_NEWLINK payload (ifinfomsg, then attributes).
fn parse_link(body: &[u8]) -> Option<Link> {
    if body.len() < 16 {
        return None;
    }
    let link_type = u16::from_ne_bytes(body[2..4].try_into().ok()?);
    let ifindex = i32::from_ne_bytes(body[4..8].try_into().ok()?) as u32;
    let flags = u32_of(&body[8..12])?;
    let mut link =
        Link { ifindex, name: String::new(), kind: None, link_type, master: None, up: flags & IFF_UP != 0, xdp_features: None };
    for (t, v) in attributes(&body[16..])? {
        match t {
            IFLA_IFNAME => link.name = c_string(v),
            IFLA_MASTER => link.master = u32_of(v),
            IFLA_LINKINFO => {
                for (it, iv) in attributes(v)? {
                    if it == IFLA_INFO_KIND {
                        link.kind = Some(c_string(iv));
                    }
                }
            }
            _ => {}
        }
    }
    Some(link)
}

fn rt_links() -> Result<Vec<Link>, NetdevError> {
    const WHAT: &str = "RTM_GETLINK dump";
    let sock = Socket::open(libc::NETLINK_ROUTE)?;
    let ifinfo = [0u8; 16]; // AF_UNSPEC, every device
    let replies = sock.request(WHAT, RTM_GETLINK, NLM_F_DUMP, &ifinfo)?;
    replies
        .iter()
        .filter(|(t, _)| *t == RTM_NEWLINK)
        .map(|(_, b)| parse_link(b).ok_or(NetdevError::Malformed { what: WHAT }))
        .collect()
}

/// ifindex -> XDP features; None when the kernel has no netdev family
/// (before 6.3).
fn xdp_features() -> Result<Option<std::collections::HashMap<u32, u64>>, NetdevError> {
    let sock = Socket::open(libc::NETLINK_GENERIC)?;
    // genlmsghdr: command, version, reserved.
    let mut req = vec![CTRL_CMD_GETFAMILY, 1, 0, 0];
    req.extend(attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0"));
    let family = match sock.request("netdev family lookup", GENL_ID_CTRL, 0, &req) {
        Ok(r) => r,
        Err(NetdevError::Kernel { errno, .. }) if errno == libc::ENOENT => return Ok(None),
        Err(e) => return Err(e),
    };
    let id = family
        .iter()
        .filter_map(|(_, b)| attributes(b.get(4..)?))
        .flatten()
        .find(|(t, _)| *t == CTRL_ATTR_FAMILY_ID)
        .and_then(|(_, v)| Some(u16::from_ne_bytes(v.get(..2)?.try_into().ok()?)))
        .ok_or(NetdevError::Malformed { what: "netdev family lookup" })?;
    const WHAT: &str = "netdev dev-get dump";
    let replies = sock.request(WHAT, id, NLM_F_DUMP, &[NETDEV_CMD_DEV_GET, 1, 0, 0])?;
    let mut out = std::collections::HashMap::new();
    for (_, body) in replies {
        let attrs = attributes(body.get(4..).ok_or(NetdevError::Malformed { what: WHAT })?)
            .ok_or(NetdevError::Malformed { what: WHAT })?;
        let mut ifindex = None;
        let mut features = None;
        for (t, v) in attrs {
            match t {
                NETDEV_A_DEV_IFINDEX => ifindex = u32_of(v),
                NETDEV_A_DEV_XDP_FEATURES => features = v.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_ne_bytes),
                _ => {}
            }
        }
        if let (Some(i), Some(f)) = (ifindex, features) {
            out.insert(i, f);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn attributes_parse_with_padding_and_nesting() {
        let mut body = vec![0u8; 16];
        body[2..4].copy_from_slice(&1u16.to_ne_bytes());
        body[4..8].copy_from_slice(&7i32.to_ne_bytes());
        body[8..12].copy_from_slice(&IFF_UP.to_ne_bytes());
        body.extend(attr(IFLA_IFNAME, b"veth0\0"));
        body.extend(attr(IFLA_MASTER, &3u32.to_ne_bytes()));
        body.extend(attr(IFLA_LINKINFO | 0x8000, &attr(IFLA_INFO_KIND, b"veth\0")));
        let l = parse_link(&body).unwrap();
        assert_eq!(
            l,
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
        // A length past the end is refused, not read.
        let mut bad = vec![0u8; 16];
        bad.extend([200, 0, 3, 0, b'x', 0, 0, 0]);
        assert!(parse_link(&bad).is_none());
    }

    struct Ns(String);

    impl Drop for Ns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
        }
    }

    fn ip(ns: &str, args: &str) {
        let out = Command::new("ip").args(["-n", ns]).args(args.split(' ')).output().unwrap();
        assert!(out.status.success(), "ip {args}: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn links_in(ns: &str) -> Vec<Link> {
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let f = std::fs::File::open(path).unwrap();
            // SAFETY: setns on this thread only, with a valid netns fd.
            assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
            links().unwrap()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn kinds_and_native_redirect_targets_as_the_kernel_reports_them() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            panic!("this test needs root (it creates a network namespace)");
        }
        let ns = Ns(format!("lbt-netdev-{}", std::process::id()));
        let _ = Command::new("ip").args(["netns", "del", &ns.0]).output();
        assert!(Command::new("ip").args(["netns", "add", &ns.0]).status().unwrap().success());
        ip(&ns.0, "link add va type veth peer name vb");
        ip(&ns.0, "link add br0 type bridge");
        ip(&ns.0, "link set va up");
        ip(&ns.0, "link set vb up");
        ip(&ns.0, "link set br0 up");
        let get = |ls: &[Link], n: &str| ls.iter().find(|l| l.name == n).cloned().unwrap();
        let ls = links_in(&ns.0);
        let (va, br) = (get(&ls, "va"), get(&ls, "br0"));
        assert_eq!(va.kind.as_deref(), Some("veth"));
        assert_eq!(br.kind.as_deref(), Some("bridge"));
        assert!(va.is_ethernet() && va.up && va.native_xdp());
        assert!(!br.native_xdp() && !br.native_xmit());
        assert!(!va.native_xmit(), "a veth whose peer has neither XDP nor GRO: {va:?}");
        assert_eq!(get(&ls, "lo").link_type, 772);
        // GRO on the peer makes the veth a native redirect target.
        let out = Command::new("ip").args(["netns", "exec", &ns.0, "ethtool", "-K", "vb", "gro", "on"]).output().unwrap();
        assert!(out.status.success());
        assert!(get(&links_in(&ns.0), "va").native_xmit());
        // A bridge port names its bridge.
        ip(&ns.0, "link set vb master br0");
        let ls = links_in(&ns.0);
        assert_eq!(get(&ls, "vb").master, Some(get(&ls, "br0").ifindex));
    }
}

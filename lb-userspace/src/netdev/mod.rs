//! What the network devices of lbd's namespace are, and whether each can
//! transmit XDP-redirected frames: rtnetlink (RTM_GETLINK) for name, type,
//! kind, master and state; the netdev generic-netlink family
//! (NETDEV_CMD_DEV_GET) for the XDP features the kernel reports; and the
//! route the FIB matches for an address, for its MTU (`route`).
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
mod netlink;
mod route;

pub use route::{RouteMtu, RouteMtuWatch, UnlockedRoute};

use std::collections::HashMap;
use std::io;
use std::time::Duration;

use netlink::*;

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
    /// IFLA_MTU (0 when not reported).
    pub mtu: u32,
    /// netdev genetlink NETDEV_A_DEV_XDP_FEATURES bits (`XDP_ACT_*`); None
    /// when the kernel has no netdev family or did not report the device.
    pub xdp_features: Option<u64>,
    /// Ids of the XDP programs attached to the device (IFLA_XDP), any mode.
    pub xdp_progs: Vec<u32>,
    /// The id of the program attached in generic (skb) mode, if any.
    pub xdp_generic_prog: Option<u32>,
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
    let mut mtu = 0;
    let mut xdp_progs = Vec::new();
    let (mut xdp_attached, mut xdp_one, mut xdp_skb) = (0, None, None);
    for (t, v) in attributes(&body[IFINFOMSG_LEN..])? {
        match t {
            IFLA_IFNAME => name = Some(c_string(v)),
            IFLA_MTU => mtu = u32_of(v)?,
            IFLA_MASTER => master = Some(u32_of(v)?),
            IFLA_LINKINFO => {
                for (it, iv) in attributes(v)? {
                    if it == IFLA_INFO_KIND {
                        kind = Some(c_string(iv));
                    }
                }
            }
            IFLA_XDP => {
                for (xt, xv) in attributes(v)? {
                    match xt {
                        IFLA_XDP_ATTACHED => xdp_attached = *xv.first()?,
                        IFLA_XDP_PROG_ID => xdp_one = Some(u32_of(xv)?),
                        IFLA_XDP_SKB_PROG_ID => xdp_skb = Some(u32_of(xv)?),
                        _ => {}
                    }
                    if IFLA_XDP_PROG_IDS.contains(&xt) {
                        let id = u32_of(xv)?;
                        if !xdp_progs.contains(&id) {
                            xdp_progs.push(id);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Some(Link {
        ifindex,
        name: name?,
        kind,
        link_type,
        master,
        up: flags & IFF_UP != 0,
        mtu,
        xdp_features: None,
        xdp_progs,
        // With one program the kernel names it in IFLA_XDP_PROG_ID and says
        // its mode in IFLA_XDP_ATTACHED; with several, one id per mode.
        xdp_generic_prog: xdp_skb.or(xdp_one.filter(|_| xdp_attached == XDP_ATTACHED_SKB)),
    })
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
mod tests;

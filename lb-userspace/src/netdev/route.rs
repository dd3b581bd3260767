//! The IPv4 route the kernel's FIB matches for an address, with its MTU
//! and whether that MTU is locked (RTM_GETROUTE with RTM_F_FIB_MATCH, as
//! `ip route get fibmatch` asks).
//!
//! Why lbd asks: the FIB helper the datapath uses answers by a route's own
//! MTU only when it is locked (or with `net.ipv4.ip_forward_use_pmtu`),
//! while the kernel's own IPv4 forwarding honours an unlocked one too. An
//! unlocked route MTU below its device's therefore binds the packets the
//! kernel forwards and not the ones XDP forwards; lbd warns about the
//! routes to its backends that have one ([`RouteMtuWatch`]).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use super::{Link, NetdevError, netlink::*, rt_links};

/// A FIB entry with an MTU of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RouteMtu {
    /// The route's destination prefix and its length.
    pub prefix: Ipv4Addr,
    pub prefix_len: u8,
    /// The routing table it is in.
    pub table: u32,
    /// Its output device (0 when the answer named none: a multipath route).
    pub oif: u32,
    pub mtu: u32,
    /// `mtu lock`.
    pub locked: bool,
}

/// For each of `dsts`, the route the FIB matches for it when that route
/// has an MTU of its own; None when it has none, or there is no route.
/// One socket for all the questions.
pub(super) fn route_mtus(dsts: &[Ipv4Addr]) -> Result<Vec<Option<RouteMtu>>, NetdevError> {
    let mut sock = Socket::open(libc::NETLINK_ROUTE, "route")?;
    dsts.iter().map(|&dst| ask(&mut sock, dst)).collect()
}

/// A route to a backend whose MTU is below its device's and not locked,
/// as [`RouteMtuWatch`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnlockedRoute {
    pub route: RouteMtu,
    /// The route's device and its MTU ("-" and 0 when the route names no
    /// single device, or the device was not found).
    pub device: String,
    pub device_mtu: u32,
    /// A backend address the route matched (the lowest).
    pub backend: Ipv4Addr,
}

/// The check of the routes to a set of IPv4 backends (lbd's, every few
/// seconds): which have an unlocked MTU below their device's, each
/// reported once while it stays so. A route whose MTU is not below its
/// device's is not remembered: it is judged again at every check, so
/// that it is reported once the device's MTU grows past it.
#[derive(Debug, Default)]
pub struct RouteMtuWatch {
    /// The routes reported, and still found so at the last check.
    reported: BTreeSet<RouteMtu>,
}

impl RouteMtuWatch {
    /// Ask the FIB about `backends` (blocking: one netlink socket, a
    /// question per address, and the device list when some route has an
    /// unlocked MTU) and answer the routes not reported before. Nothing is
    /// asked when `backends` is empty, or when `forward_use_pmtu` (asked
    /// only then: whether the sysctl `net.ipv4.ip_forward_use_pmtu`, under
    /// which the datapath's FIB lookups honour unlocked MTUs too, is set)
    /// says so.
    pub fn check(
        &mut self,
        backends: &[Ipv4Addr],
        forward_use_pmtu: impl FnOnce() -> bool,
    ) -> Result<Vec<UnlockedRoute>, NetdevError> {
        if backends.is_empty() || forward_use_pmtu() {
            self.reported.clear();
            return Ok(Vec::new());
        }
        let routes = route_mtus(backends)?;
        let mut unlocked: BTreeMap<RouteMtu, Ipv4Addr> = BTreeMap::new();
        for (r, &addr) in routes.into_iter().zip(backends) {
            if let Some(r) = r.filter(|r| !r.locked) {
                unlocked.entry(r).or_insert(addr);
            }
        }
        let links = if unlocked.is_empty() { Vec::new() } else { rt_links()? };
        Ok(self.judge(unlocked, &links))
    }

    /// [`check`](Self::check)'s verdict on the unlocked routes found
    /// (`unlocked`, each with a backend it matched) given the devices
    /// (`links`): the ones below their device's MTU not reported before.
    pub(super) fn judge(&mut self, unlocked: BTreeMap<RouteMtu, Ipv4Addr>, links: &[Link]) -> Vec<UnlockedRoute> {
        let mut reported = BTreeSet::new();
        let mut new = Vec::new();
        for (route, backend) in unlocked {
            let dev = links.iter().find(|l| l.ifindex == route.oif);
            let device_mtu = dev.map_or(0, |l| l.mtu);
            if device_mtu != 0 && route.mtu >= device_mtu {
                continue;
            }
            if !self.reported.contains(&route) {
                let device = dev.map_or_else(|| "-".to_owned(), |l| l.name.clone());
                new.push(UnlockedRoute { route, device, device_mtu, backend });
            }
            reported.insert(route);
        }
        self.reported = reported;
        new
    }
}

fn ask(sock: &mut Socket, dst: Ipv4Addr) -> Result<Option<RouteMtu>, NetdevError> {
    const WHAT: &str = "RTM_GETROUTE (fibmatch)";
    let mut req = vec![0u8; RTMSG_LEN];
    req[0] = libc::AF_INET as u8;
    req[1] = 32;
    req[8..12].copy_from_slice(&RTM_F_FIB_MATCH.to_ne_bytes());
    req.extend(attr(RTA_DST, &dst.octets()));
    let answer = match sock.request(WHAT, RTM_GETROUTE, false, &req) {
        Ok(a) => a,
        // No route to it (or a type the FIB answers with an error).
        Err(NetdevError::Kernel { errno, .. })
            if [libc::ENETUNREACH, libc::EHOSTUNREACH, libc::EACCES, libc::EINVAL].contains(&errno) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    match answer.messages.iter().find(|(t, _)| *t == RTM_NEWROUTE) {
        Some((_, body)) => parse_route(body).ok_or_else(|| malformed(WHAT, "RTM_NEWROUTE payload")),
        None => Ok(None),
    }
}

/// One RTM_NEWROUTE payload (struct rtmsg, then attributes): Some when
/// the route has an MTU metric; None inside Some(..) for one without.
pub(super) fn parse_route(body: &[u8]) -> Option<Option<RouteMtu>> {
    if body.len() < RTMSG_LEN || body[0] != libc::AF_INET as u8 {
        return None;
    }
    let prefix_len = body[1];
    let mut table = u32::from(body[4]);
    let (mut prefix, mut oif, mut mtu, mut lock) = (Ipv4Addr::UNSPECIFIED, 0, 0, 0);
    for (t, v) in attributes(&body[RTMSG_LEN..])? {
        match t {
            RTA_DST => prefix = Ipv4Addr::from(<[u8; 4]>::try_from(v).ok()?),
            RTA_OIF => oif = u32_of(v)?,
            RTA_TABLE => table = u32_of(v)?,
            RTA_METRICS => {
                for (m, mv) in attributes(v)? {
                    match m {
                        RTAX_LOCK => lock = u32_of(mv)?,
                        RTAX_MTU => mtu = u32_of(mv)?,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    if mtu == 0 {
        return Some(None);
    }
    Some(Some(RouteMtu { prefix, prefix_len, table, oif, mtu, locked: lock & (1 << RTAX_MTU) != 0 }))
}

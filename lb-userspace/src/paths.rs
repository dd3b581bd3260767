//! Which way a rewritten packet leaves the gateway, decided per ingress
//! interface and egress device from what the kernel says the devices can
//! do. Pure: the devices come from [`crate::netdev`], the decisions go to
//! the datapath's NETDEVS map (through `dataplane`) and to the logs, the
//! status report and the metrics.
//!
//! The rules (kernel 6.x):
//! - Native (driver) XDP can redirect a frame only into a device that
//!   transmits XDP frames: the kernel reports NDO_XMIT in its XDP features.
//!   A bridge never does; a veth does only while its peer has an XDP
//!   program or GRO on. A redirect into any other device is dropped
//!   silently by the kernel, so the datapath must not try.
//! - Generic (skb) XDP redirects by handing the skb to the device's
//!   transmit, which works for every Ethernet device that is up.
//! - Everything else takes the kernel's forwarding path: the datapath
//!   passes the rewritten packet up (TTL and MACs untouched) and the kernel
//!   routes it. Correct everywhere, slower.
//!
//! `xdp_mode: auto` attaches natively only where the device supports it
//! and native redirects reach every configured egress; otherwise generic,
//! which redirects everywhere. So `auto` never sends a packet to the slow
//! path for a reason it could have avoided at attach time.
use std::collections::BTreeMap;

use lb_common::{NETDEV_F_GENERIC, NETDEV_F_TX, NETDEV_F_XMIT_GENERIC, NETDEV_F_XMIT_NATIVE};
use serde::{Deserialize, Serialize};

use crate::{config::XdpMode, netdev::Link};

/// The mode a program runs in on one interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Native,
    Generic,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
        }
    }

    /// The `NETDEV_F_XMIT_*` flag an egress needs for a redirect from a
    /// program running in this mode (what the datapath tests).
    pub fn xmit_flag(self) -> u32 {
        match self {
            Self::Native => NETDEV_F_XMIT_NATIVE,
            Self::Generic => NETDEV_F_XMIT_GENERIC,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The path packets from one ingress take through one egress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    XdpRedirect,
    Kernel,
}

impl Path {
    /// The metric label (as serialized).
    pub fn label(self) -> &'static str {
        match self {
            Self::XdpRedirect => "xdp_redirect",
            Self::Kernel => "kernel",
        }
    }

    /// For logs and `lbctl status`.
    pub fn describe(self) -> &'static str {
        match self {
            Self::XdpRedirect => "XDP redirect",
            Self::Kernel => "kernel forwarding",
        }
    }
}

/// Where packets arriving on `iface` are forwarded to, among the
/// configured `interfaces`: the other ones (client side to backend side
/// and back), or `iface` itself on a one-arm gateway. A packet routed
/// elsewhere still takes a correct path: the datapath checks every egress.
pub fn egresses_of<'a>(iface: &str, interfaces: &'a [String]) -> Vec<&'a str> {
    let others: Vec<&str> = interfaces.iter().map(String::as_str).filter(|i| *i != iface).collect();
    if others.is_empty() { interfaces.iter().map(String::as_str).collect() } else { others }
}

/// What attaching to `iface` should try first, and why. `Native` may still
/// fail at attach time (the driver refuses): `auto` then falls back to
/// generic and says so.
pub fn choose_mode(requested: XdpMode, iface: &Link, egresses: &[&Link]) -> (Mode, String) {
    match requested {
        XdpMode::Native => (Mode::Native, "xdp_mode: native".into()),
        XdpMode::Generic => (Mode::Generic, "xdp_mode: generic".into()),
        XdpMode::Auto => {
            if !iface.native_xdp() {
                return (Mode::Generic, format!("auto: {} has no native XDP", describe(iface)));
            }
            let blocked: Vec<String> = egresses
                .iter()
                .filter(|e| !e.native_xmit())
                .map(|e| format!("{} ({})", e.name, why_no_native_xmit(e)))
                .collect();
            if blocked.is_empty() {
                (Mode::Native, "auto: native XDP, and every egress takes native redirects".into())
            } else {
                (
                    Mode::Generic,
                    format!(
                        "auto: native XDP could not redirect into {}; generic redirects into every Ethernet device",
                        blocked.join(", ")
                    ),
                )
            }
        }
    }
}

/// What `native` forced onto `iface` will not do, for the warning.
pub fn native_caveats(egresses: &[&Link]) -> Vec<String> {
    egresses
        .iter()
        .filter(|e| !e.native_xmit())
        .map(|e| format!("packets to {} take the kernel path ({})", e.name, why_no_native_xmit(e)))
        .collect()
}

fn describe(l: &Link) -> String {
    match &l.kind {
        Some(k) => format!("{} ({k})", l.name),
        None => l.name.clone(),
    }
}

/// Why native XDP cannot redirect into `l`.
pub fn why_no_native_xmit(l: &Link) -> String {
    if !l.up {
        return "down".into();
    }
    if !l.is_ethernet() {
        return "not an Ethernet device".into();
    }
    match l.kind.as_deref() {
        Some("veth") => "a veth whose peer has neither an XDP program nor GRO".into(),
        Some("bridge") => "a bridge cannot transmit XDP frames".into(),
        Some(k) => format!("{k} devices cannot transmit XDP frames"),
        None => "the driver cannot transmit XDP frames".into(),
    }
}

/// The datapath's NETDEVS contents: every device of the namespace with
/// what it can take, and the mode the program runs in where attached.
pub fn netdev_flags(links: &[Link], modes: &BTreeMap<String, Mode>) -> BTreeMap<u32, u32> {
    links
        .iter()
        .map(|l| {
            let mut f = 0;
            if modes.get(&l.name) == Some(&Mode::Generic) {
                f |= NETDEV_F_GENERIC;
            }
            if l.up && l.is_ethernet() {
                f |= NETDEV_F_XMIT_GENERIC;
            }
            if l.up && l.is_ethernet() && l.native_xmit() {
                f |= NETDEV_F_XMIT_NATIVE;
            }
            if tx_works(l, modes.get(&l.name)) {
                f |= NETDEV_F_TX;
            }
            // The MTU above the flags: a next hop into a device narrower
            // than the packet's ingress is not cached (see the datapath's
            // `forward::adopt_hop`).
            f |= l.mtu.min(0xffff) << lb_common::NETDEV_MTU_SHIFT;
            (l.ifindex, f)
        })
        .collect()
}

/// Whether `XDP_TX` back out of `l`, for the program attached to it in
/// `mode` (None: not attached, where no packet arrives), reaches the
/// other end (`NETDEV_F_TX`): in generic mode on any device, natively
/// on any but a veth. A veth's native `XDP_TX` wakes its peer only when
/// the peer runs an XDP program of its own, which a veth whose peer is in
/// another namespace does not show here; GRO at the peer (enough for
/// redirects) leaves `XDP_TX` frames unsent. There, packets back out of
/// their ingress go by redirect, which works as for any other egress.
pub fn tx_works(l: &Link, mode: Option<&Mode>) -> bool {
    match mode {
        Some(Mode::Generic) => true,
        Some(Mode::Native) => l.kind.as_deref() != Some("veth"),
        None => false,
    }
}

/// One row of the path report: packets arriving on `ingress` (program in
/// `mode`) and routed out of `egress`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathReport {
    pub ingress: String,
    pub mode: Mode,
    pub egress: String,
    pub path: Path,
    pub reason: String,
}

/// The path for every attached interface and each of its egresses
/// ([`egresses_of`]), exactly as the datapath decides it from
/// [`netdev_flags`].
pub fn report(links: &[Link], modes: &BTreeMap<String, Mode>) -> Vec<PathReport> {
    let flags = netdev_flags(links, modes);
    let by_name: BTreeMap<&str, &Link> = links.iter().map(|l| (l.name.as_str(), l)).collect();
    let names: Vec<String> = modes.keys().cloned().collect();
    let mut rows = Vec::new();
    for (ingress, &mode) in modes {
        for egress in egresses_of(ingress, &names) {
            let (path, reason) = match by_name.get(egress) {
                None => (Path::Kernel, "device not found".to_owned()),
                // The datapath's test, on the flags it is given.
                Some(e) if flags[&e.ifindex] & mode.xmit_flag() != 0 => {
                    let why = match mode {
                        Mode::Generic => "generic XDP redirects into any Ethernet device",
                        Mode::Native => "the device transmits native XDP redirects",
                    };
                    // Back out of their ingress: by XDP_TX where it works
                    // (the datapath's `forward::adopt_hop`).
                    let why = if egress != ingress {
                        why.to_owned()
                    } else if flags[&e.ifindex] & NETDEV_F_TX != 0 {
                        format!("{why}; sent back out of the interface it came in on, by XDP_TX")
                    } else {
                        format!(
                            "{why}; sent back out of the interface it came in on by redirect, not XDP_TX (a veth's native XDP_TX reaches its peer only when the peer runs XDP)"
                        )
                    };
                    (Path::XdpRedirect, why)
                }
                Some(e) => (Path::Kernel, why_no_native_xmit(e)),
            };
            rows.push(PathReport { ingress: ingress.clone(), mode, egress: egress.to_owned(), path, reason });
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netdev::{XDP_ACT_BASIC, XDP_ACT_NDO_XMIT, XDP_ACT_REDIRECT};

    fn link(ifindex: u32, name: &str, kind: Option<&str>, features: Option<u64>) -> Link {
        Link {
            ifindex,
            name: name.into(),
            kind: kind.map(String::from),
            link_type: 1,
            master: None,
            up: true,
            mtu: 1500,
            xdp_features: features,
            xdp_progs: Vec::new(),
            xdp_generic_prog: None,
        }
    }

    const VETH: u64 = XDP_ACT_BASIC | XDP_ACT_REDIRECT;
    const VETH_XMIT: u64 = XDP_ACT_BASIC | XDP_ACT_REDIRECT | XDP_ACT_NDO_XMIT;

    #[test]
    fn auto_is_native_only_when_every_egress_takes_native_redirects() {
        let eth0 = link(2, "eth0", Some("veth"), Some(VETH_XMIT));
        let eth1 = link(3, "eth1", Some("veth"), Some(VETH_XMIT));
        let br0 = link(4, "br0", Some("bridge"), Some(0));
        let plain = link(5, "eth2", Some("veth"), Some(VETH));
        assert_eq!(choose_mode(XdpMode::Auto, &eth0, &[&eth0, &eth1]).0, Mode::Native);
        let (m, why) = choose_mode(XdpMode::Auto, &eth0, &[&eth0, &br0]);
        assert_eq!(m, Mode::Generic);
        assert!(why.contains("br0 (a bridge cannot transmit XDP frames)"), "{why}");
        let (m, why) = choose_mode(XdpMode::Auto, &eth0, &[&eth0, &plain]);
        assert_eq!(m, Mode::Generic);
        assert!(why.contains("eth2 (a veth whose peer has neither"), "{why}");
        // A bridge itself has no native XDP.
        let (m, why) = choose_mode(XdpMode::Auto, &br0, &[&eth0, &br0]);
        assert_eq!(m, Mode::Generic);
        assert!(why.contains("br0 (bridge) has no native XDP"), "{why}");
        // Forced modes are taken as asked.
        assert_eq!(choose_mode(XdpMode::Native, &eth0, &[&br0]).0, Mode::Native);
        assert_eq!(native_caveats(&[&eth0, &br0]).len(), 1);
        assert_eq!(choose_mode(XdpMode::Generic, &eth0, &[&eth1]).0, Mode::Generic);
    }

    #[test]
    fn flags_and_report_agree() {
        let eth0 = link(2, "eth0", Some("veth"), Some(VETH_XMIT));
        let br0 = link(4, "br0", Some("bridge"), Some(0));
        let mut down = link(6, "eth9", Some("veth"), Some(VETH_XMIT));
        down.up = false;
        let links = vec![eth0, br0, down];
        let modes: BTreeMap<String, Mode> =
            [("eth0".to_owned(), Mode::Native), ("br0".to_owned(), Mode::Generic)].into();
        let flags = netdev_flags(&links, &modes);
        // Each device's MTU rides above its flags.
        let mtu = 1500 << lb_common::NETDEV_MTU_SHIFT;
        // eth0: a native veth, whose XDP_TX may not reach its peer; br0:
        // generic, where XDP_TX always works.
        assert_eq!(flags[&2], NETDEV_F_XMIT_GENERIC | NETDEV_F_XMIT_NATIVE | mtu);
        assert_eq!(flags[&4], NETDEV_F_GENERIC | NETDEV_F_XMIT_GENERIC | NETDEV_F_TX | mtu);
        assert_eq!(flags[&6], mtu);
        let rows = report(&links, &modes);
        let path = |i: &str, e: &str| rows.iter().find(|r| r.ingress == i && r.egress == e).unwrap().path;
        assert_eq!(path("eth0", "br0"), Path::Kernel);
        assert_eq!(path("br0", "eth0"), Path::XdpRedirect);
        assert_eq!(rows.len(), 2, "two-armed: each interface forwards to the other");
        // One arm: the interface forwards to itself.
        let one: BTreeMap<String, Mode> = [("br0".to_owned(), Mode::Generic)].into();
        let rows = report(&links, &one);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].egress.as_str(), rows[0].path), ("br0", Path::XdpRedirect));
        assert!(rows[0].reason.ends_with("by XDP_TX"), "{}", rows[0].reason);
        assert!(report(&links, &modes).iter().all(|r| !r.reason.contains("XDP_TX")), "two-armed: no XDP_TX");
        // A native veth back out of itself: by redirect.
        let one: BTreeMap<String, Mode> = [("eth0".to_owned(), Mode::Native)].into();
        let rows = report(&links, &one);
        assert_eq!((rows[0].egress.as_str(), rows[0].path), ("eth0", Path::XdpRedirect));
        assert!(rows[0].reason.contains("by redirect, not XDP_TX"), "{}", rows[0].reason);
        // A native device of another kind, and an unattached one.
        let nic = link(7, "enp1s0", None, Some(VETH_XMIT));
        assert!(tx_works(&nic, Some(&Mode::Native)));
        let veth = link(8, "veth8", Some("veth"), Some(VETH_XMIT));
        assert!(tx_works(&veth, Some(&Mode::Generic)) && !tx_works(&veth, Some(&Mode::Native)));
        assert!(!tx_works(&nic, None));
        assert_eq!(egresses_of("a", &["a".into(), "b".into(), "c".into()]), vec!["b", "c"]);
    }
}

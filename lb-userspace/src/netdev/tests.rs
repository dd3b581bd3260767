//! Tests of the device reader: encoded answers, and the kernel's own.
use std::{os::fd::AsRawFd as _, process::Command};

use super::{
    netlink::*,
    route::{parse_route, route_mtus},
    *,
};

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
    // IFLA_XDP: attached in two modes (ATTACHED_MULTI), the same program
    // also named as the one; IFLA_XDP_ATTACHED is not an id.
    let mut xdp = attr(2, &[3]);
    xdp.extend(attr(4, &41u32.to_ne_bytes()));
    xdp.extend(attr(5, &41u32.to_ne_bytes()));
    xdp.extend(attr(6, &42u32.to_ne_bytes()));
    body.extend(attr(IFLA_XDP | 0x8000, &xdp));
    assert_eq!(
        parse_link(&body).unwrap(),
        Link {
            ifindex: 7,
            name: "veth0".into(),
            kind: Some("veth".into()),
            link_type: 1,
            master: Some(3),
            up: true,
            mtu: 0,
            xdp_features: None,
            xdp_progs: vec![41, 42],
            xdp_generic_prog: Some(42),
        }
    );
    // One program: its mode is IFLA_XDP_ATTACHED's (2, skb: generic).
    for (attached, generic) in [(2u8, Some(43)), (1, None)] {
        let mut one = ifinfo(1, 8, IFF_UP);
        one.extend(attr(IFLA_IFNAME, b"eth1\0"));
        let mut xdp = attr(2, &[attached]);
        xdp.extend(attr(4, &43u32.to_ne_bytes()));
        one.extend(attr(IFLA_XDP | 0x8000, &xdp));
        let l = parse_link(&one).unwrap();
        assert_eq!((l.xdp_progs.clone(), l.xdp_generic_prog), (vec![43], generic), "attached {attached}");
    }
    // A physical NIC: no linkinfo, no master, down.
    let mut nic = ifinfo(1, 2, 0);
    nic.extend(attr(IFLA_IFNAME, b"eth0\0"));
    let l = parse_link(&nic).unwrap();
    assert_eq!((l.kind.as_deref(), l.master, l.up, l.xdp_progs.len()), (None, None, false, 0));
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
        mtu: 1500,
        xdp_features: Some(f),
        xdp_progs: Vec::new(),
        xdp_generic_prog: None,
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
    /// A namespace named for `tag` (each test its own: tests run at once).
    fn new(tag: &str) -> Self {
        let ns = Self(format!("lbt-{tag}-{}", std::process::id()));
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
    let ns = Ns::new("netdev");
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

fn rtmsg(dst_len: u8, table: u8) -> Vec<u8> {
    let mut b = vec![0u8; RTMSG_LEN];
    b[0] = libc::AF_INET as u8;
    b[1] = dst_len;
    b[4] = table;
    b
}

#[test]
fn a_route_answer_gives_its_prefix_table_device_and_mtu_lock() {
    let mut body = rtmsg(25, 254);
    body.extend(attr(RTA_TABLE, &254u32.to_ne_bytes()));
    body.extend(attr(RTA_DST, &[10, 20, 0, 0]));
    body.extend(attr(RTA_OIF, &3u32.to_ne_bytes()));
    let mut metrics = attr(RTAX_LOCK, &(1u32 << RTAX_MTU).to_ne_bytes());
    metrics.extend(attr(RTAX_MTU, &1400u32.to_ne_bytes()));
    body.extend(attr(RTA_METRICS | 0x8000, &metrics));
    let locked = RouteMtu {
        prefix: std::net::Ipv4Addr::new(10, 20, 0, 0),
        prefix_len: 25,
        table: 254,
        oif: 3,
        mtu: 1400,
        locked: true,
    };
    assert_eq!(parse_route(&body), Some(Some(locked)));
    // Another metric locked (the window, bit 3), not the MTU.
    let mut body = rtmsg(25, 254);
    body.extend(attr(RTA_DST, &[10, 20, 0, 0]));
    body.extend(attr(RTA_OIF, &3u32.to_ne_bytes()));
    let mut metrics = attr(RTAX_LOCK, &(1u32 << 3).to_ne_bytes());
    metrics.extend(attr(RTAX_MTU, &1400u32.to_ne_bytes()));
    body.extend(attr(RTA_METRICS, &metrics));
    assert_eq!(parse_route(&body), Some(Some(RouteMtu { locked: false, ..locked })));
    // No MTU metric; no attributes at all (a default route has no RTA_DST).
    let mut body = rtmsg(0, 254);
    body.extend(attr(RTA_METRICS, &attr(RTAX_LOCK, &0u32.to_ne_bytes())));
    assert_eq!(parse_route(&body), Some(None));
    assert_eq!(parse_route(&rtmsg(0, 254)), Some(None));
    // Not IPv4; too short; a bad attribute length.
    let mut v6 = rtmsg(0, 254);
    v6[0] = libc::AF_INET6 as u8;
    assert_eq!(parse_route(&v6), None);
    assert_eq!(parse_route(&[2, 0, 0]), None);
    let mut bad = rtmsg(0, 254);
    bad.extend([9, 0, 1, 0]);
    assert_eq!(parse_route(&bad), None);
}

#[test]
fn the_kernel_names_a_routes_mtu_and_its_lock() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root (it creates a network namespace)");
    let ns = Ns::new("route");
    ns.ip("link add va type veth peer name vb");
    ns.ip("link set va up");
    ns.ip("link set vb up");
    ns.ip("addr add 10.99.0.1/24 dev va");
    ns.ip("route add 10.98.0.0/24 dev va mtu 1400");
    ns.ip("route add 10.97.0.0/25 dev va mtu lock 1300");
    let va = get(&ns.links(), "va").ifindex;
    let asked = ns.within(|| {
        let dsts = ["10.98.0.5", "10.97.0.5", "10.99.0.7", "192.0.2.1"].map(|a| a.parse().unwrap());
        route_mtus(&dsts).unwrap()
    });
    let r = |prefix: [u8; 4], prefix_len, mtu, locked| RouteMtu {
        prefix: prefix.into(),
        prefix_len,
        table: 254,
        oif: va,
        mtu,
        locked,
    };
    assert_eq!(asked[0], Some(r([10, 98, 0, 0], 24, 1400, false)));
    assert_eq!(asked[1], Some(r([10, 97, 0, 0], 25, 1300, true)));
    // A route without an MTU; no route at all.
    assert_eq!(asked[2], None);
    assert_eq!(asked[3], None);
}

#[test]
fn an_unlocked_route_below_its_devices_mtu_is_reported_once_while_it_stays_so() {
    let dev = |ifindex, name: &str, mtu| Link {
        ifindex,
        name: name.into(),
        kind: Some("veth".into()),
        link_type: 1,
        master: None,
        up: true,
        mtu,
        xdp_features: None,
        xdp_progs: Vec::new(),
        xdp_generic_prog: None,
    };
    let route = |third: u8, oif, mtu| RouteMtu {
        prefix: std::net::Ipv4Addr::new(10, 20, third, 0),
        prefix_len: 24,
        table: 254,
        oif,
        mtu,
        locked: false,
    };
    let found = |routes: &[RouteMtu]| -> std::collections::BTreeMap<RouteMtu, std::net::Ipv4Addr> {
        routes.iter().map(|r| (*r, std::net::Ipv4Addr::new(10, 20, r.prefix.octets()[2], 7))).collect()
    };
    let narrow = route(1, 3, 1400);
    let as_wide = route(2, 4, 1500);
    let multipath = route(3, 0, 1300);
    let mut watch = RouteMtuWatch::default();
    let links = [dev(3, "eth1", 1500), dev(4, "eth2", 1500)];
    let first = watch.judge(found(&[narrow, as_wide, multipath]), &links);
    assert_eq!(
        first,
        vec![
            UnlockedRoute {
                route: narrow,
                device: "eth1".into(),
                device_mtu: 1500,
                backend: "10.20.1.7".parse().unwrap()
            },
            // A route over several devices names none: reported, as
            // nothing says its MTU is not the narrower one.
            UnlockedRoute {
                route: multipath,
                device: "-".into(),
                device_mtu: 0,
                backend: "10.20.3.7".parse().unwrap()
            },
        ]
    );
    // The same routes again: nothing new.
    assert_eq!(watch.judge(found(&[narrow, as_wide, multipath]), &links), vec![]);
    // eth2's MTU grows past its route's, which was not below it before:
    // that route is reported now.
    let grown = [dev(3, "eth1", 1500), dev(4, "eth2", 9000)];
    let now = watch.judge(found(&[narrow, as_wide, multipath]), &grown);
    assert_eq!(now.iter().map(|r| &r.route).collect::<Vec<_>>(), vec![&as_wide]);
    assert_eq!(now[0].device_mtu, 9000);
    // A route fixed (locked: no longer among the unlocked) and set back
    // unlocked later is reported again.
    assert_eq!(watch.judge(found(&[as_wide, multipath]), &grown), vec![]);
    let back = watch.judge(found(&[narrow, as_wide, multipath]), &grown);
    assert_eq!(back.iter().map(|r| &r.route).collect::<Vec<_>>(), vec![&narrow]);
    // Nothing asked, nothing remembered, with no backend or under
    // ip_forward_use_pmtu.
    assert_eq!(watch.check(&[], || false).unwrap(), vec![]);
    assert_eq!(watch.judge(found(std::slice::from_ref(&narrow)), &links).len(), 1);
    assert_eq!(watch.check(&["10.20.1.7".parse().unwrap()], || true).unwrap(), vec![]);
    assert_eq!(watch.judge(found(&[narrow]), &links).len(), 1);
}

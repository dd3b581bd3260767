//! The endpoint map (`ENDPOINTS`): backend (address, port, protocol) ->
//! the VIP key of the one service whose flows' replies come from it.
//!
//! A flow has one flow-table entry, keyed by the client's 5-tuple towards
//! the VIP. A reply (backend -> client) finds it by rebuilding that tuple
//! from its own destination and the VIP its source endpoint names. When two
//! services share a backend endpoint, it can name only one of them: the
//! other service's flows keep a reply entry besides the forward one
//! (`SVC_F_REPLY_ENTRY`), as every flow did before this map existed.
//!
//! Ownership is sticky: an endpoint stays with its service as long as that
//! service exists, even once it no longer lists the endpoint, because its
//! flows to it may still be open. An endpoint no service lists keeps its
//! entry too (the flows of a removed service still reply) until another
//! service needs it or the map needs the room.
use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv6Addr},
};

use lb_common::{MAX_ENDPOINTS, Vip6Key, VipKey, maps as names};

use super::{Dataplane, DataplaneError, map_err};
use crate::config::{Forwarding, ServiceConfig};

/// An (address, port, protocol) of either family: a service's VIP key, or
/// a backend's endpoint. Written to the IPv4 maps (`VipKey`) or the IPv6
/// ones (`Vip6Key`) by its address's family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Key {
    pub(super) addr: IpAddr,
    /// Host byte order.
    pub(super) port: u16,
    pub(super) proto: u8,
}

/// The 16 bytes of an IPv6 address as the datapath's maps hold them.
pub fn words6(a: &Ipv6Addr) -> [u32; 4] {
    let o = a.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
}

/// The IPv6 address the datapath's 16 bytes hold.
pub(crate) fn addr6(w: &[u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, x) in w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&x.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

impl Key {
    pub(super) fn v4(&self) -> Option<VipKey> {
        match self.addr {
            IpAddr::V4(a) => {
                Some(VipKey { addr: u32::from(a).to_be(), port: self.port.to_be(), proto: self.proto, _pad: 0 })
            }
            IpAddr::V6(_) => None,
        }
    }

    pub(super) fn v6(&self) -> Option<Vip6Key> {
        match self.addr {
            IpAddr::V6(a) => Some(Vip6Key { addr: words6(&a), port: self.port.to_be(), proto: self.proto, _pad: 0 }),
            IpAddr::V4(_) => None,
        }
    }

    pub(super) fn from_v4(k: &VipKey) -> Self {
        Self { addr: IpAddr::V4(u32::from_be(k.addr).into()), port: u16::from_be(k.port), proto: k.proto }
    }

    pub(super) fn from_v6(k: &Vip6Key) -> Self {
        Self { addr: IpAddr::V6(addr6(&k.addr)), port: u16::from_be(k.port), proto: k.proto }
    }
}

/// The VIP key of a service.
pub(super) fn vip_key(cfg: &ServiceConfig) -> Key {
    Key { addr: cfg.vip, port: cfg.port, proto: cfg.protocol.number() }
}

/// The endpoints of a service's backends whose replies come back through
/// the datapath (none for direct server return).
fn endpoints_of(cfg: &ServiceConfig) -> impl Iterator<Item = Key> + '_ {
    let proto = cfg.protocol.number();
    let nat = cfg.forwarding == Forwarding::Nat;
    cfg.backends.iter().filter(move |_| nat).map(move |b| Key { addr: b.address, port: b.port, proto })
}

/// What the endpoint map should hold for a set of services.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// The whole map, after the change.
    pub(super) owners: HashMap<Key, Key>,
    /// Services that use an endpoint another service owns: their new flows
    /// keep a reply entry.
    pub(super) reply_entry: HashSet<Key>,
}

/// Decide the endpoint map for `services` (in configuration order), given
/// what it holds now. See the module documentation for the rules.
pub(super) fn plan(current: &HashMap<Key, Key>, services: &[ServiceConfig], capacity: usize) -> Plan {
    let live: HashSet<Key> = services.iter().map(vip_key).collect();
    let mut owners = current.clone();
    let mut used: HashSet<Key> = HashSet::new();
    for s in services {
        let key = vip_key(s);
        for ep in endpoints_of(s) {
            used.insert(ep);
            match owners.get(&ep) {
                Some(owner) if live.contains(owner) => {}
                // Unowned, or owned by a service that is gone: the first
                // service (in configuration order) that lists it takes it.
                _ => {
                    owners.insert(ep, key);
                }
            }
        }
    }
    // Room: endpoints no service lists go first, those of gone services
    // before those of live ones.
    if owners.len() > capacity {
        let mut spare: Vec<(bool, Key)> =
            owners.iter().filter(|(ep, _)| !used.contains(ep)).map(|(ep, owner)| (live.contains(owner), *ep)).collect();
        spare.sort();
        for (_, ep) in spare.into_iter().take(owners.len() - capacity) {
            owners.remove(&ep);
        }
    }
    let reply_entry = services
        .iter()
        .map(|s| (vip_key(s), s))
        .filter(|(key, s)| endpoints_of(s).any(|ep| owners.get(&ep) != Some(key)))
        .map(|(key, _)| key)
        .collect();
    Plan { owners, reply_entry }
}

impl Dataplane {
    /// Read the endpoint map as a previous lbd left it (empty when fresh).
    pub(super) fn read_endpoints(&mut self) -> Result<(), DataplaneError> {
        let mut found = HashMap::new();
        for item in &self.maps.endpoints {
            let (k, v) = item.map_err(map_err(names::ENDPOINTS))?;
            found.insert(Key::from_v4(&k), Key::from_v4(&v));
        }
        for item in &self.maps.endpoints6 {
            let (k, v) = item.map_err(map_err(names::ENDPOINTS6))?;
            found.insert(Key::from_v6(&k), Key::from_v6(&v));
        }
        self.endpoints = found;
        Ok(())
    }

    /// Plan the endpoint map for `services` and write its new and changed
    /// entries: called before any service's table changes, so that a flow
    /// on a new backend finds its endpoint from its first reply. The plan's
    /// `reply_entry` names the services that must keep reply entries; its
    /// `owners` go to [`prune_endpoints`](Self::prune_endpoints) once the
    /// services changed.
    pub(super) fn write_endpoints(&mut self, services: &[ServiceConfig]) -> Result<Plan, DataplaneError> {
        let plan = plan(&self.endpoints, services, MAX_ENDPOINTS as usize);
        for (ep, owner) in &plan.owners {
            if self.endpoints.get(ep) != Some(owner) {
                match (ep.v4(), owner.v4(), ep.v6(), owner.v6()) {
                    (Some(e), Some(o), _, _) => {
                        self.maps.endpoints.insert(e, o, 0).map_err(map_err(names::ENDPOINTS))?;
                    }
                    (_, _, Some(e), Some(o)) => {
                        self.maps.endpoints6.insert(e, o, 0).map_err(map_err(names::ENDPOINTS6))?;
                    }
                    // A service is one family (the config says so).
                    _ => continue,
                }
                self.endpoints.insert(*ep, *owner);
            }
        }
        Ok(plan)
    }

    /// Remove the entries the plan (`owners`) dropped.
    pub(super) fn prune_endpoints(&mut self, owners: &HashMap<Key, Key>) -> Result<(), DataplaneError> {
        let gone: Vec<Key> = self.endpoints.keys().filter(|ep| !owners.contains_key(ep)).copied().collect();
        for ep in gone {
            if let Some(k) = ep.v4() {
                self.maps.endpoints.remove(&k).map_err(map_err(names::ENDPOINTS))?;
            }
            if let Some(k) = ep.v6() {
                self.maps.endpoints6.remove(&k).map_err(map_err(names::ENDPOINTS6))?;
            }
            self.endpoints.remove(&ep);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::config::{BackendConfig, ServiceConfig};

    fn svc(name: &str, port: u16, backends: &[(u8, u16)]) -> ServiceConfig {
        let backends = backends
            .iter()
            .map(|&(last, p)| BackendConfig {
                address: Ipv4Addr::new(10, 1, 0, last).into(),
                port: p,
                weight: 1,
                drain: false,
            })
            .collect();
        ServiceConfig::example(name, Ipv4Addr::new(10, 0, 0, 100), port, backends)
    }

    fn ep(last: u8, port: u16) -> Key {
        Key { addr: Ipv4Addr::new(10, 1, 0, last).into(), port, proto: 6 }
    }

    #[test]
    fn each_service_owns_its_own_endpoints() {
        let svcs = [svc("a", 80, &[(1, 8080), (2, 8080)]), svc("b", 81, &[(1, 9090)])];
        let p = plan(&HashMap::new(), &svcs, 100);
        assert_eq!(p.owners.len(), 3);
        assert_eq!(p.owners[&ep(1, 8080)], vip_key(&svcs[0]));
        assert_eq!(p.owners[&ep(1, 9090)], vip_key(&svcs[1]));
        assert!(p.reply_entry.is_empty());
    }

    #[test]
    fn a_shared_endpoint_stays_with_its_owner_and_the_other_service_keeps_reply_entries() {
        let a = svc("a", 80, &[(1, 8080)]);
        let b = svc("b", 81, &[(1, 8080), (2, 8080)]);
        // b came first: it owns 10.1.0.1:8080, then a is added before it
        // in the file. Ownership does not move.
        let first = plan(&HashMap::new(), std::slice::from_ref(&b), 100);
        let both = plan(&first.owners, &[a.clone(), b.clone()], 100);
        assert_eq!(both.owners[&ep(1, 8080)], vip_key(&b));
        assert_eq!(both.reply_entry, HashSet::from([vip_key(&a)]));
        // b drops the endpoint but lives on: it keeps it (its flows to it
        // may still be open), so a still keeps reply entries.
        let b2 = svc("b", 81, &[(2, 8080)]);
        let later = plan(&both.owners, &[a.clone(), b2.clone()], 100);
        assert_eq!(later.owners[&ep(1, 8080)], vip_key(&b));
        assert_eq!(later.reply_entry, HashSet::from([vip_key(&a)]));
        // b is removed: a takes the endpoint over and needs no reply entries.
        let last = plan(&later.owners, std::slice::from_ref(&a), 100);
        assert_eq!(last.owners[&ep(1, 8080)], vip_key(&a));
        assert!(last.reply_entry.is_empty());
        // b's other endpoint is kept for its last flows' replies.
        assert_eq!(last.owners[&ep(2, 8080)], vip_key(&b));
    }

    #[test]
    fn a_service_whose_vip_changes_takes_its_endpoints_along() {
        let a = svc("a", 80, &[(1, 8080)]);
        let first = plan(&HashMap::new(), std::slice::from_ref(&a), 100);
        let moved = svc("a", 8000, &[(1, 8080)]);
        let p = plan(&first.owners, std::slice::from_ref(&moved), 100);
        assert_eq!(p.owners[&ep(1, 8080)], vip_key(&moved));
        assert!(p.reply_entry.is_empty());
    }

    #[test]
    fn room_is_made_from_unlisted_endpoints_of_gone_services_first() {
        let a = svc("a", 80, &[(1, 8080), (2, 8080)]);
        let b = svc("b", 81, &[(3, 8080)]);
        let first = plan(&HashMap::new(), &[a.clone(), b.clone()], 100);
        // a is gone and b lists only 10.1.0.4 now; capacity 2.
        let b2 = svc("b", 81, &[(4, 8080)]);
        let p = plan(&first.owners, std::slice::from_ref(&b2), 2);
        assert_eq!(p.owners.len(), 2);
        assert_eq!(p.owners[&ep(4, 8080)], vip_key(&b2));
        // Kept: b's own unlisted endpoint (a live service) over a's.
        assert_eq!(p.owners[&ep(3, 8080)], vip_key(&b2));
    }

    #[test]
    fn ipv6_endpoints_are_planned_and_dsr_services_have_none() {
        let b6 = |last: u16| BackendConfig {
            address: Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, last).into(),
            port: 8080,
            weight: 1,
            drain: false,
        };
        let v6 = ServiceConfig::example(
            "v6",
            Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x100),
            80,
            vec![b6(0x11), b6(0x12)],
        );
        let dsr = ServiceConfig {
            forwarding: Forwarding::Dsr,
            ..ServiceConfig::example("dsr", Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x10a), 8080, vec![b6(0x11)])
        };
        let p = plan(&HashMap::new(), &[v6.clone(), dsr], 100);
        assert_eq!(p.owners.len(), 2, "the DSR service's backends reply around the datapath");
        let key = Key { addr: b6(0x11).address, port: 8080, proto: 6 };
        assert_eq!(p.owners[&key], vip_key(&v6));
        assert!(p.reply_entry.is_empty());
        // The map keys round-trip through the datapath's layout.
        let k6 = key.v6().unwrap();
        assert_eq!(Key::from_v6(&k6), key);
        assert_eq!(addr6(&words6(&"fd00:20::11".parse().unwrap())), "fd00:20::11".parse::<Ipv6Addr>().unwrap());
    }

    #[test]
    fn the_shared_endpoint_rule_holds_for_ipv6_and_dsr_services_stay_out_of_it() {
        let b6 = |last: u16| BackendConfig {
            address: Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, last).into(),
            port: 8080,
            weight: 1,
            drain: false,
        };
        let vip = |last: u16| Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, last);
        let a = ServiceConfig::example("a", vip(0x100), 80, vec![b6(0x11), b6(0x12)]);
        let b = ServiceConfig::example("b", vip(0x101), 80, vec![b6(0x11)]);
        let dsr = ServiceConfig {
            forwarding: Forwarding::Dsr,
            ..ServiceConfig::example("dsr", vip(0x10a), 8080, vec![b6(0x11), b6(0x13)])
        };
        let key = |b: &BackendConfig| Key { addr: b.address, port: b.port, proto: 6 };
        // b came first and owns [fd00:20::11]:8080; a, added before it in
        // the file, keeps reply entries; the DSR service never does.
        let first = plan(&HashMap::new(), &[dsr.clone(), b.clone()], 100);
        assert_eq!(first.owners.len(), 1, "{:?}", first.owners);
        let p = plan(&first.owners, &[dsr.clone(), a.clone(), b.clone()], 100);
        assert_eq!(p.owners[&key(&b6(0x11))], vip_key(&b));
        assert_eq!(p.owners[&key(&b6(0x12))], vip_key(&a));
        assert!(!p.owners.contains_key(&key(&b6(0x13))), "a DSR backend's replies bypass the datapath");
        assert_eq!(p.reply_entry, HashSet::from([vip_key(&a)]));
        // An IPv4 service at the same ports shares nothing with them.
        let v4 = svc("v4", 80, &[(0x11, 8080)]);
        let p = plan(&p.owners, &[dsr, a.clone(), b, v4.clone()], 100);
        assert_eq!(p.owners[&ep(0x11, 8080)], vip_key(&v4));
        assert_eq!(p.reply_entry, HashSet::from([vip_key(&a)]));
        // The map keys are the wire bytes: words6 is from_ne_bytes of
        // each 4-byte chunk, as the datapath reads the header.
        let k = key(&b6(0x11)).v6().unwrap();
        let bytes: Vec<u8> = k.addr.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(bytes, Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 0x11).octets());
        assert_eq!((k.port, k.proto), (8080u16.to_be(), 6));
    }

    #[test]
    fn backend_keys_keep_ipv4_tables_and_tell_ipv6_backends_apart() {
        use super::super::backend_key;
        // IPv4: the key every earlier release used (adopted tables stay).
        let a: Ipv4Addr = "10.20.0.11".parse().unwrap();
        assert_eq!(backend_key(a.into(), 8080), (u64::from(u32::from(a)) << 16) | 8080);
        let k = |s: &str, p| backend_key(s.parse().unwrap(), p);
        assert_eq!(k("fd00:20::11", 8080), k("fd00:20::11", 8080));
        let keys = [k("fd00:20::11", 8080), k("fd00:20::12", 8080), k("fd00:20::11", 8081), k("fd00:21::11", 8080)];
        for (i, x) in keys.iter().enumerate() {
            assert!(keys[i + 1..].iter().all(|y| y != x), "{keys:x?}");
        }
    }
}

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
use std::collections::{HashMap, HashSet};

use lb_common::{EndpointKey, MAX_ENDPOINTS, VipKey, maps as names};

use super::{Dataplane, DataplaneError, map_err};
use crate::config::ServiceConfig;

/// The VIP key of a service.
pub(super) fn vip_key(cfg: &ServiceConfig) -> VipKey {
    VipKey { addr: u32::from(cfg.vip).to_be(), port: cfg.port.to_be(), proto: cfg.protocol.number(), _pad: 0 }
}

/// The endpoints of a service's backends.
fn endpoints_of(cfg: &ServiceConfig) -> impl Iterator<Item = EndpointKey> + '_ {
    let proto = cfg.protocol.number();
    cfg.backends.iter().map(move |b| EndpointKey {
        addr: u32::from(b.address).to_be(),
        port: b.port.to_be(),
        proto,
        _pad: 0,
    })
}

/// What the endpoint map should hold for a set of services.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// The whole map, after the change.
    pub(super) owners: HashMap<EndpointKey, VipKey>,
    /// Services that use an endpoint another service owns: their new flows
    /// keep a reply entry.
    pub(super) reply_entry: HashSet<VipKey>,
}

/// Decide the endpoint map for `services` (in configuration order), given
/// what it holds now. See the module documentation for the rules.
pub(super) fn plan(current: &HashMap<EndpointKey, VipKey>, services: &[ServiceConfig], capacity: usize) -> Plan {
    let live: HashSet<VipKey> = services.iter().map(vip_key).collect();
    let mut owners = current.clone();
    let mut used: HashSet<EndpointKey> = HashSet::new();
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
        let mut spare: Vec<(bool, EndpointKey)> =
            owners.iter().filter(|(ep, _)| !used.contains(ep)).map(|(ep, owner)| (live.contains(owner), *ep)).collect();
        spare.sort_by_key(|&(is_live, ep)| (is_live, ep.addr, ep.port, ep.proto));
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
            found.insert(k, v);
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
        let map = &mut self.maps.endpoints;
        for (ep, owner) in &plan.owners {
            if self.endpoints.get(ep) != Some(owner) {
                map.insert(ep, owner, 0).map_err(map_err(names::ENDPOINTS))?;
                self.endpoints.insert(*ep, *owner);
            }
        }
        Ok(plan)
    }

    /// Remove the entries the plan (`owners`) dropped.
    pub(super) fn prune_endpoints(&mut self, owners: &HashMap<EndpointKey, VipKey>) -> Result<(), DataplaneError> {
        let gone: Vec<EndpointKey> = self.endpoints.keys().filter(|ep| !owners.contains_key(ep)).copied().collect();
        let map = &mut self.maps.endpoints;
        for ep in gone {
            map.remove(&ep).map_err(map_err(names::ENDPOINTS))?;
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
                address: Ipv4Addr::new(10, 1, 0, last),
                port: p,
                weight: 1,
                drain: false,
            })
            .collect();
        ServiceConfig::example(name, Ipv4Addr::new(10, 0, 0, 100), port, backends)
    }

    fn ep(last: u8, port: u16) -> EndpointKey {
        EndpointKey { addr: u32::from(Ipv4Addr::new(10, 1, 0, last)).to_be(), port: port.to_be(), proto: 6, _pad: 0 }
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
}

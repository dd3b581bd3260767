//! Turning the desired pool into map contents: services (VIP entries and
//! their selection tables, flipped atomically), backends, the address
//! filter and the VIP address set.
use std::{collections::HashSet, net::IpAddr};

use aya::maps::PerCpuValues;
use lb_common::{
    BACKEND_F_DOWN, BACKEND_F_V6, Backend, BackendStats, Conns, SELECT_LANES, SVC_F_DSR, SVC_F_NO_BACKEND,
    SVC_F_REPLY_ENTRY, Service, fold6, maps as names, select_slot,
};
use tracing::info;

use super::{
    AppliedBackend, AppliedService, BackendRuntime, Dataplane, DataplaneError, backend_key,
    endpoints::{Key, vip_key, words6},
    map_err,
};
use crate::{
    config::{BackendConfig, Forwarding, ServiceConfig},
    sched::{Builds, Member},
};

impl Dataplane {
    /// Make the maps carry exactly `services`. Services are matched by
    /// name, backends by address and port: unchanged parts keep their ids,
    /// their counters and their table region.
    ///
    /// `runtime` gives each backend's effective weight and down state
    /// (health, drain, slow start: the agent's business).
    pub fn apply(
        &mut self,
        services: &[ServiceConfig],
        runtime: &dyn Fn(&ServiceConfig, &BackendConfig) -> BackendRuntime,
    ) -> Result<(), DataplaneError> {
        let wanted: HashSet<&str> = services.iter().map(|s| s.name.as_str()).collect();
        let gone: Vec<String> = self.services.keys().filter(|n| !wanted.contains(n.as_str())).cloned().collect();
        for name in gone {
            self.remove_service(&name)?;
        }
        // New addresses enter the filter before anything can send to them.
        for s in services {
            self.known_backends.extend(s.backends.iter().map(|b| b.address));
        }
        self.write_filter(services.iter().map(|s| s.vip))?;
        // Endpoints before tables: a reply finds its flow from the first
        // flow on a new backend on.
        let endpoints = self.write_endpoints(services)?;
        let mut builds = Builds::default();
        for s in services {
            self.apply_service(s, runtime, endpoints.reply_entry.contains(&vip_key(s)), &mut builds)?;
        }
        // Adopted services the config no longer has.
        for (key, a) in std::mem::take(&mut self.adopted) {
            self.remove_vip(&key)?;
            if let Some((o, l)) = a.region {
                self.regions.free(o, l);
            }
            for (_, _, id) in a.backends {
                self.backend_ids.release(id);
            }
            self.service_ids.release(a.service_id);
        }
        self.prune_endpoints(&endpoints.owners)?;
        self.sync_vip_addrs()?;
        resolve_dsr_neighbours(services);
        Ok(())
    }

    /// [`apply`](Self::apply) with configuration-only weights.
    pub fn apply_admin(&mut self, services: &[ServiceConfig]) -> Result<(), DataplaneError> {
        self.apply(services, &|_, b| BackendRuntime::admin(b))
    }

    fn apply_service(
        &mut self,
        cfg: &ServiceConfig,
        runtime: &dyn Fn(&ServiceConfig, &BackendConfig) -> BackendRuntime,
        reply_entry: bool,
        builds: &mut Builds,
    ) -> Result<(), DataplaneError> {
        let key = vip_key(cfg);
        // Applied as it is now (configuration, seed, reply entries and
        // every backend's weight in force): nothing to write. So a probe
        // result that moves one backend reprograms its service alone, not
        // every service's tables copied and compared again (at 255
        // services of 65,537 entries that kept the agent busy for tens of
        // ms per health transition).
        if let Some(p) = self.services.get(&cfg.name)
            && p.config == *cfg
            && p.seed == self.maglev_seed
            && p.reply_entry == reply_entry
            && p.backends.len() == cfg.backends.len()
            && p.backends.iter().zip(&cfg.backends).all(|(o, b)| o.config == *b && o.runtime == runtime(cfg, b))
        {
            return Ok(());
        }
        let mut prev = self.services.get(&cfg.name).cloned();
        if prev.is_none()
            && let Some(a) = self.adopted.remove(&key)
        {
            // A service the previous lbd programmed: keep its ids; its table
            // is rebuilt (same content for the same pool) and flipped.
            prev = Some(AppliedService {
                id: a.service_id,
                config: cfg.clone(),
                backends: a
                    .backends
                    .iter()
                    .map(|&(address, port, id)| AppliedBackend {
                        id,
                        config: BackendConfig { address, port, weight: 0, drain: false },
                        runtime: BackendRuntime { weight: u32::MAX, down: false },
                    })
                    .collect(),
                key,
                region: a.region,
                table: Vec::new(),
                fallback_region: a.fallback_region,
                fallback: Vec::new(),
                seed: self.maglev_seed,
                reply_entry,
            });
        }
        let id = match &prev {
            Some(p) => p.id,
            None => self.service_ids.alloc().ok_or(DataplaneError::Ids { what: "service" })?,
        };

        // Backend ids: keep the ids of backends that stay.
        let mut backends = Vec::with_capacity(cfg.backends.len());
        let mut fresh = Vec::new();
        let mut changed = Vec::new();
        for b in &cfg.backends {
            let existing = prev
                .as_ref()
                .and_then(|p| p.backends.iter().find(|o| o.config.address == b.address && o.config.port == b.port));
            let rt = runtime(cfg, b);
            let bid = match existing {
                Some(o) => {
                    if o.runtime != rt {
                        changed.push(o.id);
                    }
                    if o.config.weight != b.weight && o.runtime.weight != u32::MAX {
                        info!(service = %cfg.name, backend = %std::net::SocketAddr::new(b.address, b.port),
                              from = o.config.weight, to = b.weight, "weight changed");
                    }
                    o.id
                }
                None => {
                    let Some(bid) = self.backend_ids.alloc() else {
                        for &f in &fresh {
                            self.backend_ids.release(f);
                        }
                        return Err(DataplaneError::Ids { what: "backend" });
                    };
                    fresh.push(bid);
                    bid
                }
            };
            backends.push(AppliedBackend { id: bid, config: b.clone(), runtime: rt });
        }
        if !fresh.is_empty() {
            // Counters of a fresh id start from zero (the id may have served
            // a backend removed long ago).
            let conns = &mut self.maps.conns;
            for &bid in &fresh {
                conns.set(bid, Conns::default(), 0).map_err(map_err(names::CONNS))?;
            }
            let expired = &mut self.maps.expired;
            for &bid in &fresh {
                expired.set(bid, 0, 0).map_err(map_err(names::EXPIRED))?;
            }
            for &bid in &fresh {
                let zeros = PerCpuValues::try_from(vec![Conns::default(); self.ncpus]).expect("one value per CPU");
                self.maps.conns_cpu.set(bid, zeros, 0).map_err(map_err(names::CONNS_CPU))?;
                self.maps.conns_sum.set(bid, Conns::default(), 0).map_err(map_err(names::CONNS_SUM))?;
            }
        }
        {
            let arr = &mut self.maps.backends;
            for b in backends.iter().filter(|b| fresh.contains(&b.id) || changed.contains(&b.id)) {
                let mut flags = if b.runtime.down { BACKEND_F_DOWN } else { 0 };
                let addr = match b.config.address {
                    IpAddr::V4(a) => u32::from(a).to_be(),
                    IpAddr::V6(a) => {
                        // The address first: the datapath reads it once
                        // the backend's slot says IPv6. It is not cleared
                        // when the id is released, as the BACKENDS slot is
                        // not: flows to a removed backend still find it
                        // (ICMP errors about them, a stale stateless pick),
                        // and an id reused for IPv4 drops BACKEND_F_V6, so
                        // nothing reads the old address.
                        let w = words6(&a);
                        self.maps.backend_addrs6.set(b.id, w, 0).map_err(map_err(names::BACKEND_ADDRS6))?;
                        flags |= BACKEND_F_V6;
                        fold6(&w)
                    }
                };
                let v = Backend {
                    addr,
                    port: b.config.port.to_be(),
                    _pad: 0,
                    service_id: id,
                    flags,
                    weight: b.runtime.weight,
                    _pad2: 0,
                };
                arr.set(b.id, v, 0).map_err(map_err(names::BACKENDS))?;
            }
        }
        if !fresh.is_empty() {
            let stats = &mut self.maps.backend_stats;
            for &bid in &fresh {
                let zero =
                    PerCpuValues::try_from(vec![BackendStats::default(); self.ncpus]).expect("one value per CPU");
                stats.set(bid, zero, 0).map_err(map_err(names::BACKEND_STATS))?;
            }
        }

        let scheduler = cfg.scheduler.datapath_id();
        // The tables depend only on the configuration, the members and the
        // seed: an untouched service keeps its tables without rebuilding
        // them (a weight change elsewhere then costs one build, not one per
        // service).
        let (table, fallback) = match &prev {
            Some(p) if keeps_tables(p, cfg, &backends, self.maglev_seed) => (p.table.clone(), p.fallback.clone()),
            _ => selection_tables(cfg, &backends, self.maglev_seed, builds),
        };
        let mut flags =
            if table.iter().all(|&b| u32::from(b) == lb_common::BACKEND_NONE) { SVC_F_NO_BACKEND } else { 0 };
        if cfg.forwarding == Forwarding::Dsr {
            flags |= SVC_F_DSR;
        } else if reply_entry {
            flags |= SVC_F_REPLY_ENTRY;
        }
        let region = self.place_table(&cfg.name, prev.as_ref().map(|p| (&p.table, p.region)), &table)?;
        let fallback_region =
            match self.place_table(&cfg.name, prev.as_ref().map(|p| (&p.fallback, p.fallback_region)), &fallback) {
                Ok(r) => r,
                Err(e) => {
                    // Nothing refers to the new main table yet.
                    if let Some((o, l)) = region
                        && prev.as_ref().is_none_or(|p| p.region != region)
                    {
                        self.regions.free(o, l);
                    }
                    return Err(e);
                }
            };
        // Without a fallback table of its own, a flow without an entry
        // hashes into the service's own (Maglev) table.
        let stateless = fallback_region.or(region);
        let value = Service {
            service_id: id,
            scheduler,
            table_off: region.map_or(0, |r| r.0),
            table_len: region.map_or(0, |r| r.1),
            flags,
            fallback_off: stateless.map_or(0, |r| r.0),
            fallback_len: stateless.map_or(0, |r| r.1),
            _pad: 0,
        };
        // The flip: one whole-value replace.
        self.insert_vip(&key, value)?;
        if let Some(p) = &prev
            && p.key != key
        {
            self.remove_vip(&p.key)?;
        }
        if let Some(p) = &prev {
            for (old, new) in [(p.region, region), (p.fallback_region, fallback_region)] {
                if old != new
                    && let Some((o, l)) = old
                {
                    self.regions.free(o, l);
                }
            }
            for ob in &p.backends {
                if !backends.iter().any(|b| b.id == ob.id) {
                    self.backend_ids.release(ob.id);
                }
            }
        }
        if prev.as_ref().map(|p| &p.config) != Some(cfg) {
            info!(service = %cfg.name, vip = %cfg.vip, port = cfg.port, protocol = %cfg.protocol,
                  scheduler = %cfg.scheduler, backends = cfg.backends.len(), "service applied");
        }
        self.services.insert(
            cfg.name.clone(),
            AppliedService {
                id,
                config: cfg.clone(),
                backends,
                key,
                region,
                table,
                fallback_region,
                fallback,
                seed: self.maglev_seed,
                reply_entry,
            },
        );
        Ok(())
    }

    /// Where `table` lives in SELECT: where it was (`prev`: the previous
    /// table and its region) if unchanged, else in a newly written region
    /// (the caller frees the old one once the service value points away).
    fn place_table(
        &mut self,
        service: &str,
        prev: Option<(&Vec<u16>, Region)>,
        table: &[u16],
    ) -> Result<Region, DataplaneError> {
        match prev {
            Some((t, region)) if t.as_slice() == table => return Ok(region),
            _ if table.is_empty() => return Ok(None),
            _ => {}
        }
        let len = table.len() as u32;
        let off = self.regions.alloc(len).ok_or_else(|| DataplaneError::TableSpace {
            service: service.to_owned(),
            need: len,
            capacity: self.table_capacity,
        })?;
        let mapped = self.select_memory.as_mut().is_some_and(|m| m.write(off, table));
        if !mapped {
            // Element by element, each read first: a region need not start
            // or end on an element's edge, and the entries of its
            // neighbours (live tables) are written back as they were.
            let sel = &mut self.maps.select;
            let mut k = 0;
            while k < table.len() {
                let (element, lane) = select_slot(off + k as u32);
                let mut word = sel.get(&element, 0).map_err(map_err(names::SELECT))?;
                for (slot, &b) in word[lane..].iter_mut().zip(&table[k..]) {
                    *slot = b;
                }
                sel.set(element, word, 0).map_err(map_err(names::SELECT))?;
                k += SELECT_LANES as usize - lane;
            }
        }
        Ok(Some((off, len)))
    }

    /// Put a service's value under its VIP key (VIPS or VIPS6).
    fn insert_vip(&mut self, key: &Key, value: Service) -> Result<(), DataplaneError> {
        match (key.v4(), key.v6()) {
            (Some(k), _) => self.maps.vips.insert(k, value, 0).map_err(map_err(names::VIPS)),
            (_, Some(k)) => self.maps.vips6.insert(k, value, 0).map_err(map_err(names::VIPS6)),
            _ => Ok(()),
        }
    }

    /// Remove a VIP key (absent: nothing to do).
    fn remove_vip(&mut self, key: &Key) -> Result<(), DataplaneError> {
        let r = match (key.v4(), key.v6()) {
            (Some(k), _) => self.maps.vips.remove(&k).map_err(map_err(names::VIPS)),
            (_, Some(k)) => self.maps.vips6.remove(&k).map_err(map_err(names::VIPS6)),
            _ => Ok(()),
        };
        match r {
            Err(DataplaneError::Map { source: aya::maps::MapError::KeyNotFound, .. }) => Ok(()),
            r => r,
        }
    }

    fn remove_service(&mut self, name: &str) -> Result<(), DataplaneError> {
        let Some(s) = self.services.remove(name) else { return Ok(()) };
        self.remove_vip(&s.key)?;
        for (o, l) in s.region.into_iter().chain(s.fallback_region) {
            self.regions.free(o, l);
        }
        for b in &s.backends {
            self.backend_ids.release(b.id);
        }
        self.service_ids.release(s.id);
        info!(service = %name, "service removed");
        Ok(())
    }

    /// Make ADDR_FILTER hold exactly the bits of the services' VIPs, of
    /// every backend address lbd knows, and of `more`.
    fn write_filter(&mut self, more: impl IntoIterator<Item = IpAddr>) -> Result<(), DataplaneError> {
        let vips = self.services.values().map(|s| s.key.addr);
        let words = bit_words(vips.chain(self.known_backends.iter().copied()).chain(more).map(filter_bit));
        write_words(&mut self.maps.addr_filter, &mut self.filter, words, names::ADDR_FILTER)
    }

    /// Make REPLY_HINT hold the bits of exactly the IPv4 TCP VIPs whose
    /// services keep reply entries (only a TCP SYN reads the hint).
    fn write_reply_hint(&mut self) -> Result<(), DataplaneError> {
        let bits = self
            .services
            .values()
            .filter(|s| s.reply_entry && s.key.proto == lb_common::PROTO_TCP)
            .filter_map(|s| s.key.v4())
            .map(|k| lb_common::reply_hint_bit(k.addr, k.port));
        let words = bit_words(bits);
        write_words(&mut self.maps.reply_hint, &mut self.reply_hint, words, names::REPLY_HINT)
    }

    fn sync_vip_addrs(&mut self) -> Result<(), DataplaneError> {
        self.write_filter(std::iter::empty())?;
        self.write_reply_hint()?;
        let want4: HashSet<u32> = self.services.values().filter_map(|s| s.key.v4()).map(|k| k.addr).collect();
        let want6: HashSet<[u32; 4]> = self.services.values().filter_map(|s| s.key.v6()).map(|k| k.addr).collect();
        sync_set(&mut self.maps.vip_addrs, &want4, names::VIP_ADDRS)?;
        sync_set(&mut self.maps.vip_addrs6, &want6, names::VIP_ADDRS6)?;
        Ok(())
    }
}

/// A bit set in `lb_common::filter_word`'s layout (ADDR_FILTER's and
/// REPLY_HINT's value) with exactly `bits` set. Boxed: the address filter
/// is 8 KiB.
fn bit_words<const N: usize>(bits: impl IntoIterator<Item = u32>) -> Box<[u64; N]> {
    let mut words = Box::new([0; N]);
    for bit in bits {
        let (word, mask) = lb_common::filter_word(bit);
        words[word] |= mask;
    }
    words
}

/// Whether `bit` is set in `words` (`lb_common::filter_word`'s layout),
/// by the test the datapath makes (`lb_common::bit_is_set`).
pub(super) fn has_bit(words: &[u64], bit: u32) -> bool {
    lb_common::bit_is_set(bit, |word| words[word])
}

/// Make the one value of `map` (a bit set) `words`: one write, only when a
/// word differs from `held`, what this process last wrote. The first write
/// after (re)loading goes out whatever it holds: an adopted map may hold
/// bits this process has not recorded.
fn write_words<const N: usize>(
    map: &mut aya::maps::Array<aya::maps::MapData, [u64; N]>,
    held: &mut Option<Box<[u64; N]>>,
    words: Box<[u64; N]>,
    name: &'static str,
) -> Result<(), DataplaneError> {
    if held.as_ref() != Some(&words) {
        map.set(0, *words, 0).map_err(map_err(name))?;
        *held = Some(words);
    }
    Ok(())
}

/// Make a set-like hash map (keys, value 1) hold exactly `want`.
fn sync_set<K: aya::Pod + Eq + std::hash::Hash>(
    map: &mut aya::maps::HashMap<aya::maps::MapData, K, u32>,
    want: &HashSet<K>,
    name: &'static str,
) -> Result<(), DataplaneError> {
    let have: HashSet<K> = map.keys().filter_map(Result::ok).collect();
    for a in have.difference(want) {
        map.remove(a).map_err(map_err(name))?;
    }
    for a in want.difference(&have) {
        map.insert(a, 1, 0).map_err(map_err(name))?;
    }
    Ok(())
}

/// Have the kernel resolve the link-layer address of every DSR backend.
/// The datapath sends a DSR packet to its backend's MAC and cannot fall
/// back on the kernel's forwarding (the packet is addressed to the VIP),
/// so without a neighbour entry it drops the packet (`fib_fallback`)
/// until something else (a health probe) made one. An empty datagram to
/// the discard port makes the kernel ask (ARP, neighbour discovery).
fn resolve_dsr_neighbours(services: &[ServiceConfig]) {
    for s in services.iter().filter(|s| s.forwarding == Forwarding::Dsr) {
        for b in &s.backends {
            let any: IpAddr = if b.address.is_ipv4() {
                std::net::Ipv4Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            };
            if let Ok(sock) = std::net::UdpSocket::bind((any, 0)) {
                let _ = sock.send_to(&[], (b.address, 9));
            }
        }
    }
}

/// Can a service keep its tables (`prev`'s) for this configuration and
/// these backends? Only if nothing they are built from changed: the
/// configuration, each backend's id and runtime, and the seed (a reload
/// that changes `maglev_seed` rebuilds every table). An adopted service
/// has none to keep.
fn keeps_tables(prev: &AppliedService, cfg: &ServiceConfig, backends: &[AppliedBackend], seed: u64) -> bool {
    !prev.table.is_empty()
        && prev.seed == seed
        && prev.config == *cfg
        && prev.backends.len() == backends.len()
        && prev.backends.iter().zip(backends).all(|(o, n)| o.id == n.id && o.runtime == n.runtime)
}

/// A service's selection table and its consistent-hash fallback (empty
/// when its scheduler needs none), as SELECT gets them: 16-bit ids, as
/// its lanes hold them, which is also how lbd keeps its copy of each (to
/// tell whether a rebuilt table changed; 128 KiB per 65,537 entries).
///
/// Which backend an entry names depends only on the pool (addresses,
/// ports, weights in force), the table size, the scheduler and `seed`:
/// neither the order of the backends in the configuration nor their ids
/// (node-local, allocated in the order backends were added) matter beyond
/// the id written. So balancer nodes behind one ECMP route, configured
/// alike, pick the same backend for a flow without sharing any state.
fn selection_tables(
    cfg: &ServiceConfig,
    backends: &[AppliedBackend],
    seed: u64,
    builds: &mut Builds,
) -> (Vec<u16>, Vec<u16>) {
    let members = members(backends);
    let table = cfg.scheduler.build(&members, cfg.table_size, seed, builds);
    let fallback = cfg.scheduler.build_fallback(&members, cfg.table_size, seed, builds).unwrap_or_default();
    (table, fallback)
}

/// A service's backends as its scheduler sees them: id, weight in force,
/// and the key Maglev derives a backend's slots from (its address and port,
/// see [`backend_key`]), in a canonical order: by key, then by address and
/// port (two IPv6 backends may share a key). Maglev breaks ties by position
/// and a round-robin sequence follows it, so the configuration's order
/// must not reach them.
fn members(backends: &[AppliedBackend]) -> Vec<Member> {
    let mut sorted: Vec<&AppliedBackend> = backends.iter().collect();
    sorted.sort_by_key(|b| (backend_key(b.config.address, b.config.port), b.config.address, b.config.port));
    sorted
        .into_iter()
        .map(|b| Member {
            // SELECT's lanes hold ids in 16 bits: ids are below MAX_BACKENDS (see lb-common).
            id: u16::try_from(b.id).expect("a backend id below MAX_BACKENDS"),
            key: backend_key(b.config.address, b.config.port),
            weight: b.runtime.weight,
        })
        .collect()
}

/// A table's place in SELECT: (first entry, length), or none.
type Region = Option<(u32, u32)>;

/// The address filter's bit of `a`, as the datapath computes it.
pub(super) fn filter_bit(a: IpAddr) -> u32 {
    match a {
        IpAddr::V4(a) => lb_common::addr_filter_bit(u32::from(a).to_be()),
        IpAddr::V6(a) => lb_common::addr_filter_bit6(&words6(&a)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::sched::Scheduler;

    /// Backends with ids 1.., the given weights, at `addr(i)`:8080.
    fn pool(weights: &[u32], addr: impl Fn(u16) -> IpAddr) -> Vec<AppliedBackend> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let config = BackendConfig { address: addr(i as u16 + 11), port: 8080, weight: w, drain: false };
                AppliedBackend { id: i as u32 + 1, runtime: BackendRuntime::admin(&config), config }
            })
            .collect()
    }

    /// The bit sets lbd writes (the address filter, the reply-entry hint)
    /// hold exactly the bits given, each in the word and position the
    /// datapath reads (`lb_common::filter_word`), and nothing else.
    #[test]
    fn bit_words_set_exactly_the_bits_given() {
        let bits = [0, 1, 63, 64, 130, 1023];
        let words: Box<lb_common::ReplyHint> = bit_words(bits);
        for bit in 0..lb_common::REPLY_HINT_BITS {
            assert_eq!(has_bit(&*words, bit), bits.contains(&bit), "bit {bit}");
        }
        assert_eq!(words[0], 0b11 | 1 << 63);
        assert_eq!(words[1], 1);
        assert_eq!(words[2], 1 << 2);
        assert_eq!(words[15], 1 << 63);
        assert_eq!(words.iter().map(|w| w.count_ones()).sum::<u32>(), bits.len() as u32);
    }

    /// What the table says about the address family: round-robin
    /// sequences are built from the weights in the members' canonical
    /// order (by key: IPv4 keys sort like the addresses, IPv6 keys are
    /// mixed), so an IPv6 pool's sequence holds each id as often as the
    /// IPv4 pool's with the same ids and weights, in another order.
    /// Maglev tables (maglev, source-hash, least-conn, least-time, and the
    /// sequences' consistent-hash fallback) place a backend by its key,
    /// which is its address and port: the two families' tables differ
    /// entry by entry (as two IPv4 pools at other addresses would), and
    /// each still gives every backend its weight's share.
    #[test]
    fn selection_tables_and_the_address_family() {
        let weights = [1, 2, 3, 1, 5];
        let v4 = members(&pool(&weights, |n| std::net::Ipv4Addr::new(10, 20, 0, n as u8).into()));
        let v6 = members(&pool(&weights, |n| std::net::Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, n).into()));
        let size = 65_537;
        for s in Scheduler::ALL {
            let (t4, t6) =
                (s.build(&v4, size, 0, &mut Builds::default()), s.build(&v6, size, 0, &mut Builds::default()));
            match s {
                Scheduler::Wrr | Scheduler::Rr => {
                    let sorted = |t: &[u16]| {
                        let mut t = t.to_vec();
                        t.sort_unstable();
                        t
                    };
                    assert_eq!(sorted(&t4), sorted(&t6), "{s}: a sequence's counts depend on the weights only");
                    let (f4, f6) = (
                        s.build_fallback(&v4, size, 0, &mut Builds::default()).unwrap(),
                        s.build_fallback(&v6, size, 0, &mut Builds::default()).unwrap(),
                    );
                    assert_ne!(f4, f6, "{s}: the fallback is a Maglev table, keyed by address");
                    assert_weight_shares(&f6, &weights);
                }
                _ => {
                    assert_ne!(t4, t6, "{s}: a Maglev table is keyed by address");
                    assert_weight_shares(&t4, &weights);
                    assert_weight_shares(&t6, &weights);
                }
            }
        }
    }

    /// Every id's entries within 1% of its weight's share.
    fn assert_weight_shares(table: &[u16], weights: &[u32]) {
        let mut counts: HashMap<u16, usize> = HashMap::new();
        for &id in table {
            *counts.entry(id).or_default() += 1;
        }
        let sum: u32 = weights.iter().sum();
        for (i, &w) in weights.iter().enumerate() {
            let want = table.len() as f64 * f64::from(w) / f64::from(sum);
            let got = counts.get(&(i as u16 + 1)).copied().unwrap_or(0) as f64;
            assert!((got - want).abs() <= 0.01 * want, "id {}: {got} entries, want {want:.0}", i + 1);
        }
    }

    /// One node's view of a pool: the backends in the order its
    /// configuration lists them, each with the id this node allocated.
    fn node(pool: &[(IpAddr, u16, u32)], order: &[usize], id: impl Fn(usize) -> u32) -> Vec<AppliedBackend> {
        order
            .iter()
            .enumerate()
            .map(|(pos, &i)| {
                let (address, port, weight) = pool[i];
                let config = BackendConfig { address, port, weight, drain: false };
                AppliedBackend { id: id(pos), runtime: BackendRuntime::admin(&config), config }
            })
            .collect()
    }

    /// A table as the backends it names: per entry, the address's octets
    /// and the port (big-endian); `-` for an empty entry.
    fn resolved(table: &[u16], backends: &[AppliedBackend]) -> Vec<u8> {
        let by_id: HashMap<u32, &BackendConfig> = backends.iter().map(|b| (b.id, &b.config)).collect();
        let mut out = Vec::new();
        for id in table.iter().map(|&id| u32::from(id)) {
            if id == lb_common::BACKEND_NONE {
                out.push(b'-');
                continue;
            }
            let b = by_id.get(&id).unwrap_or_else(|| panic!("entry {id} names no backend of the pool"));
            match b.address {
                IpAddr::V4(a) => out.extend(a.octets()),
                IpAddr::V6(a) => out.extend(a.octets()),
            }
            out.extend(b.port.to_be_bytes());
        }
        out
    }

    /// Both tables of a service (its own, then the fallback), resolved.
    fn node_tables(cfg: &ServiceConfig, backends: &[AppliedBackend], seed: u64) -> (Vec<u8>, Vec<u8>) {
        let (table, fallback) = selection_tables(cfg, backends, seed, &mut Builds::default());
        assert!(!table.is_empty(), "{}: no table", cfg.scheduler);
        (resolved(&table, backends), resolved(&fallback, backends))
    }

    /// Scaling out behind ECMP: any node may get any packet of a flow, so
    /// every node must pick the same backend for it without sharing state.
    /// Three independently started agents are given one pool: listed in
    /// three orders, and with ids allocated differently (in list order,
    /// descending with gaps, interleaved: as if backends had been added in
    /// other orders). Every scheduler's table, and the round-robin
    /// schedulers' consistent-hash fallback, names the same backend at
    /// every entry on all three, for IPv4 and IPv6 pools with unequal
    /// weights. The seed matters (another seed gives other Maglev tables,
    /// so the comparison is not of something constant) and 0 is the table
    /// the Maglev builder gives the keys unchanged.
    #[test]
    fn two_agents_given_one_pool_in_different_orders_build_byte_identical_tables() {
        let weights = [5, 1, 3, 2, 8, 1, 4];
        let v4: Vec<(IpAddr, u16, u32)> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| (std::net::Ipv4Addr::new(10, 30, 0, 20 + (i as u8 % 5)).into(), 8080 + i as u16, w))
            .collect();
        let v6: Vec<(IpAddr, u16, u32)> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                (std::net::Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 0x20 + (i as u16 % 5)).into(), 8080 + i as u16, w)
            })
            .collect();
        let n = weights.len();
        let listed: Vec<usize> = (0..n).collect();
        let reversed: Vec<usize> = (0..n).rev().collect();
        let shuffled: Vec<usize> = (0..n).map(|i| (i * 3 + 2) % n).collect();
        let seed = 0x5eed_ec3d_0b1a_57ed;
        for (family, pool, vip) in
            [("IPv4", &v4, IpAddr::from([10, 10, 0, 100])), ("IPv6", &v6, "fd00:10::100".parse().unwrap())]
        {
            let a = node(pool, &listed, |pos| pos as u32 + 1);
            let b = node(pool, &reversed, |pos| 1000 - 13 * pos as u32);
            let c = node(pool, &shuffled, |pos| if pos % 2 == 0 { 40 + pos as u32 } else { 7 * pos as u32 });
            for s in Scheduler::ALL {
                let cfg_of = |backends: &[AppliedBackend]| ServiceConfig {
                    scheduler: s,
                    ..ServiceConfig::example("web", vip, 80, backends.iter().map(|b| b.config.clone()).collect())
                };
                let (ca, cb, cc) = (cfg_of(&a), cfg_of(&b), cfg_of(&c));
                for seed in [0, seed] {
                    let ta = node_tables(&ca, &a, seed);
                    assert_eq!(ta, node_tables(&cb, &b, seed), "{family} {s}, seed {seed}: listed vs reversed");
                    assert_eq!(ta, node_tables(&cc, &c, seed), "{family} {s}, seed {seed}: listed vs shuffled");
                }
                // Another seed: other Maglev tables (a sequence's own table
                // is not a Maglev table and stays).
                let (zero, seeded) = (node_tables(&ca, &a, 0), node_tables(&ca, &a, seed));
                match s {
                    Scheduler::Wrr | Scheduler::Rr => {
                        assert_eq!(zero.0, seeded.0, "{family} {s}: the sequence ignores the seed");
                        assert_ne!(zero.1, seeded.1, "{family} {s}: the fallback is seeded");
                    }
                    _ => {
                        assert_ne!(zero.0, seeded.0, "{family} {s}: the table is seeded");
                        assert!(zero.1.is_empty() && seeded.1.is_empty(), "{family} {s}: no fallback");
                    }
                }
                // Seed 0 is the unseeded Maglev table of the sorted members.
                let direct: Vec<_> = members(&b)
                    .iter()
                    .map(|m| crate::sched::maglev::MaglevBackend { id: m.id, key: m.key, weight: m.weight })
                    .collect();
                let unseeded = crate::sched::maglev::build(&direct, cb.table_size).unwrap();
                let (table, fallback) = selection_tables(&cb, &b, 0, &mut Builds::default());
                match s {
                    Scheduler::Wrr | Scheduler::Rr => assert_eq!(fallback, unseeded, "{family} {s}"),
                    _ => assert_eq!(table, unseeded, "{family} {s}"),
                }
            }
        }
    }

    /// A reload that changes only `maglev_seed` rebuilds the tables; one
    /// that changes nothing keeps them.
    #[test]
    fn a_changed_seed_rebuilds_the_tables() {
        let backends = pool(&[1, 2, 3], |n| std::net::Ipv4Addr::new(10, 20, 0, n as u8).into());
        let cfg =
            ServiceConfig::example("web", [10, 10, 0, 100], 80, backends.iter().map(|b| b.config.clone()).collect());
        let (table, fallback) = selection_tables(&cfg, &backends, 7, &mut Builds::default());
        let applied = AppliedService {
            id: 1,
            config: cfg.clone(),
            backends: backends.clone(),
            key: vip_key(&cfg),
            region: Some((0, table.len() as u32)),
            table,
            fallback_region: None,
            fallback,
            seed: 7,
            reply_entry: false,
        };
        assert!(keeps_tables(&applied, &cfg, &backends, 7));
        assert!(!keeps_tables(&applied, &cfg, &backends, 8));
        assert!(!keeps_tables(&applied, &cfg, &backends, 0));
    }
}

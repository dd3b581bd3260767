//! Layout versions of the pinned datapath, and the migration from an
//! older one.
//!
//! The maps pinned under `pin_path/maps` carry their layout version in the
//! `LAYOUT` map (`lb_common::LAYOUT_VERSION`); maps pinned before versions
//! existed have no such map and are version 1. lbd reads the version before
//! it opens any other pinned map, and then:
//! - the same version: adopts the maps as they are;
//! - an older version it knows (1 to 6): migrates. The old maps are
//!   moved aside (`maps` -> `maps-v1`: a rename on bpffs, which reserves
//!   names with a dot; the running program keeps using them), fresh maps
//!   of this layout are created and pinned, and what the old ones hold is
//!   copied over, converted: services, backends, counters, endpoints and
//!   every flow, through the new datapath's insert (layouts 1 and 2 kept
//!   flows in kernel hash maps named `FLOWS` and `FLOWS6`; layout 3 in
//!   slots of its own placed by an unseeded hash, which layout 4 seeds at
//!   random per datapath, and layout 5 hashes from the client's side
//!   with reply entries' keys marked: so every entry moves; layout 6
//!   packs the selection tables' entries four to an element of SELECT,
//!   which the program reads another way, so its flows are copied as
//!   layout 5's into a fresh table; layout 7 keeps the flow tables' slots
//!   in arrays of 30 KB held by an array of maps, and their sizes in
//!   `FLOW_SEED`, so layout 6's flows are copied the same way, out of its
//!   one big array). The services' tables are rebuilt by the
//!   first `apply`, before anything is attached. Attaching then swaps the
//!   program in on its pinned links (one atomic link update per
//!   interface), and [`Dataplane::finish_migration`] copies the flows the
//!   old program made meanwhile, brings the flow counts up to date and
//!   removes the old maps;
//! - a newer version, or an older one it does not know: refuses, before
//!   touching anything, with one line that says what to do.
//!
//! Old bytes are never read as new types: each old layout's types are
//! spelled out here, and aya checks their sizes against the pinned maps'.
use std::{
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, PerCpuValues};
use lb_common::{
    Backend, BackendStats, Conns, CountsAdd, DIR_REPLY, EndpointKey, FLOW_COPY, FLOW_ESTABLISHED, FLOW_REPLIED, Flow,
    Flow6, FlowKey, FlowKey6, LAYOUT_IN_PLACE_FROM, LAYOUT_VERSION, MAX_BACKENDS, MAX_SERVICES, SLOT_BUCKET,
    SLOT_READY, SLOT_STATE, Service, Slot, SlotKey, Vip6Key, VipKey, maps as names,
};
use tracing::{info, warn};

use super::{Dataplane, DataplaneError, batch, map_err, sweep::Inserted};

/// The flow tables' pin names in layouts 1 and 2 (kernel hash maps).
pub(super) const OLD_FLOWS: &str = "FLOWS";
pub(super) const OLD_FLOWS6: &str = "FLOWS6";

/// The IPv4 flow table's pin name in layout `version`.
fn flows_name(version: u32) -> &'static str {
    if version <= 2 { OLD_FLOWS } else { names::FLOWS }
}

/// The IPv6 flow table's pin name in layout `version` (2 on).
fn flows6_name(version: u32) -> &'static str {
    if version <= 2 { OLD_FLOWS6 } else { names::FLOWS6 }
}

/// Layout 3's to 5's flow-table slots: the same bytes as layout 6's
/// (only where an entry sits changed: its hash was not seeded, then it
/// covered the whole key; and a reply key was not marked before layout
/// 5), spelled out as the old types are.
type BucketV3 = [Slot<FlowKey, Flow>; SLOT_BUCKET as usize];
type Bucket6V3 = [Slot<FlowKey6, Flow6>; SLOT_BUCKET as usize];

/// Old maps a migration moved aside under `pin` and did not finish with
/// (their flow table is still there): their layout and directory.
pub(super) fn aside_with_flows(pin: &Path) -> Option<(u32, PathBuf)> {
    (1..LAYOUT_VERSION).map(|v| (v, aside_dir(pin, v))).find(|(v, d)| d.join(flows_name(*v)).exists())
}

/// The flow tables' hash seed pinned in `maps_dir` (layout 4 on).
/// The slots of the pinned IPv4 and IPv6 flow tables, kept in `FLOW_SEED`
/// beside the seed (layout 7 on: `lb_common::FLOW_SEED_SLOTS`).
pub(super) fn pinned_slots(maps_dir: &Path) -> Result<(u32, u32), DataplaneError> {
    let seed: Array<MapData, u64> = open(&maps_dir.join(names::FLOW_SEED), names::FLOW_SEED)?;
    let get = |i: u32| -> Result<u32, DataplaneError> {
        let v = seed.get(&i, 0).map_err(map_err(names::FLOW_SEED))?;
        u32::try_from(v).map_err(|_| {
            DataplaneError::Layout(format!("the pinned {} says a flow table has {v} slots", names::FLOW_SEED))
        })
    };
    Ok((get(1)?, get(2)?))
}

pub(super) fn pinned_seed(maps_dir: &Path) -> Result<u64, DataplaneError> {
    let seed: Array<MapData, u64> = open(&maps_dir.join(names::FLOW_SEED), names::FLOW_SEED)?;
    seed.get(&0, 0).map_err(map_err(names::FLOW_SEED))
}

/// Seconds the new datapath holds TCP packets that find no entry while
/// a migration finishes (`lb_common::Flood::hold_until`).
pub(super) const HOLD_SECS: u64 = 10;

/// The version of the maps pinned in `maps_dir` (1 when they predate
/// versions).
pub(super) fn pinned_version(maps_dir: &Path) -> Result<u32, DataplaneError> {
    let path = maps_dir.join(names::LAYOUT);
    if !path.exists() {
        return Ok(1);
    }
    let layout: Array<MapData, u32> = open(&path, names::LAYOUT)?;
    layout.get(&0, 0).map_err(map_err(names::LAYOUT))
}

/// Maps an lbd pinned and was killed before it finished setting up.
pub(super) enum Unfinished {
    /// Its first start: no link is pinned, nothing runs on the maps.
    FirstStart,
    /// A migration: the old maps are still aside in this directory (and
    /// the old program, attached, still uses them).
    Migration(PathBuf),
}

/// Whether `maps_dir` holds maps an lbd pinned and was killed before it
/// set them up: every lbd that pins `LAYOUT` writes its version into it
/// before it swaps its program in anywhere, so a `LAYOUT` still holding
/// the 0 a new array starts with (or, beside old maps set aside for a
/// migration, none at all yet) marks them. aya pins maps one by one as it
/// creates them, so any of them may be missing.
pub(super) fn unfinished(pin: &Path, maps_dir: &Path) -> Result<Option<Unfinished>, DataplaneError> {
    let version = if maps_dir.join(names::LAYOUT).exists() { Some(pinned_version(maps_dir)?) } else { None };
    if version.is_some_and(|v| v != 0) {
        return Ok(None);
    }
    if let Some((_, aside)) = aside_with_flows(pin) {
        return Ok(Some(Unfinished::Migration(aside)));
    }
    if version.is_none() {
        // Nothing pinned, or an old release's datapath (no LAYOUT).
        return Ok(None);
    }
    let links = pin.join("links");
    let unused = match std::fs::read_dir(&links) {
        Ok(mut d) => d.next().is_none(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(source) => return Err(DataplaneError::Pin { path: links, source }),
    };
    Ok(unused.then_some(Unfinished::FirstStart))
}

/// What to do with a datapath pinned at version `found`: Ok(false) adopt
/// it, Ok(true) migrate it; Err: refuse, with the line that says why and
/// what to do.
pub(super) fn judge(found: u32, pin: &Path) -> Result<bool, DataplaneError> {
    match found {
        LAYOUT_IN_PLACE_FROM..=LAYOUT_VERSION => Ok(false),
        1..LAYOUT_IN_PLACE_FROM => Ok(true),
        v if v > LAYOUT_VERSION => Err(DataplaneError::Layout(format!(
            "the datapath pinned at {} has map layout version {v}, newer than this lbd's ({LAYOUT_VERSION}); \
             nothing was changed. Run the lbd version that pinned it, or, to start over without its flows, \
             stop that lbd, remove {} and start this one",
            pin.display(),
            pin.display()
        ))),
        v => Err(DataplaneError::Layout(format!(
            "the datapath pinned at {} has map layout version {v}, which this lbd cannot migrate \
             (it takes up versions 1 to {}); nothing was changed. Upgrade through a release that knows it, \
             or, to start over without its flows, stop that lbd, remove {} and start this one",
            pin.display(),
            LAYOUT_VERSION - 1,
            pin.display()
        ))),
    }
}

/// The maps layout 8 added to [`LAYOUT_IN_PLACE_FROM`]'s (layout 9 added
/// none), which an lbd taking a layout-7 datapath up in place creates
/// beside its maps.
const ADDED_BY_8: [&str; 3] = [names::FLOW_CREDIT, names::CONNS_CPU, names::CONNS_SUM];

/// The maps a take-up in place of a datapath of layout `from` adds.
pub(super) fn added_since(from: u32) -> &'static [&'static str] {
    if from < 8 { &ADDED_BY_8 } else { &[] }
}

/// Remove the maps a take-up in place of a datapath of layout `from`
/// added under `maps_dir` (it failed before its program ran: nothing uses
/// them). A layout-8 datapath's own maps stay: its program uses them.
pub(super) fn remove_added(maps_dir: &Path, from: u32) {
    for name in added_since(from) {
        let path = maps_dir.join(name);
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(path = %path.display(), error = %e, "removing a map the failed start added");
        }
    }
}

/// Undo a take-up in place of the datapath pinned in `maps_dir`, of layout
/// `from`, whose program was never swapped in: its `LAYOUT` says `from`
/// again, so that its own lbd adopts it, and the maps added go.
pub(super) fn give_back(maps_dir: &Path, from: u32) {
    let path = maps_dir.join(names::LAYOUT);
    match open::<Array<MapData, u32>>(&path, names::LAYOUT) {
        Ok(mut layout) => {
            if let Err(e) = layout.set(0, from, 0) {
                warn!(error = %e, "writing the pinned datapath's layout version back");
            }
        }
        Err(e) => warn!(error = %e, "opening the pinned datapath's layout version"),
    }
    remove_added(maps_dir, from);
}

/// The directory old maps are moved to during a migration from `version`.
pub(super) fn aside_dir(pin: &Path, version: u32) -> PathBuf {
    pin.join(format!("maps-v{version}"))
}

/// Undo the set-aside of a migration that has not replaced the running
/// program anywhere: the maps this build pinned in `maps_dir` go, and the
/// old maps in `aside` are put back as they were (the old program, still
/// attached, never stopped using them).
pub(super) fn put_back(maps_dir: &Path, aside: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(maps_dir) {
        // Killed before it made any: nothing to remove.
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::rename(aside, maps_dir)
}

pub(super) fn open<T: TryFrom<Map, Error = aya::maps::MapError>>(
    path: &Path,
    name: &'static str,
) -> Result<T, DataplaneError> {
    let data = MapData::from_pin(path).map_err(map_err(name))?;
    let map = Map::from_map_data(data).map_err(map_err(name))?;
    T::try_from(map).map_err(map_err(name))
}

/// Layout 1's service value: `Service` without the fallback table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ServiceV1 {
    service_id: u32,
    scheduler: u32,
    table_off: u32,
    table_len: u32,
    flags: u32,
    _pad: u32,
}

// SAFETY: repr(C), six u32 fields, no padding.
unsafe impl aya::Pod for ServiceV1 {}

/// A migration in progress: the old maps, set aside, and the flow counts
/// as they were copied (the old program goes on counting until it is
/// swapped out).
pub(super) struct Migration {
    from: u32,
    dir: PathBuf,
    /// Begun by this process (the old maps were set aside at this load),
    /// not resumed from an earlier start's.
    fresh: bool,
    flows: MapData,
    /// The IPv6 flow table (layout 2; layout 1 had none).
    flows6: Option<MapData>,
    conns: Array<MapData, Conns>,
    conns_copied: Vec<Conns>,
    stats: PerCpuArray<MapData, BackendStats>,
    /// Per-backend counters as copied (backends that had any).
    stats_copied: Vec<(u32, PerCpuValues<BackendStats>)>,
    /// The state each flow had when this process copied it (none for a
    /// migration resumed from an earlier start's: its copies are not
    /// known, and the late copy only inserts what is missing).
    copied: Option<Copied>,
}

/// The state bits of every flow a migration copied, by key: the late copy
/// brings what the old program saw since into the entries still those
/// copies (`Dataplane::merge_flows`). About 30 bytes a flow, for the
/// migration's length.
#[derive(Default)]
struct Copied {
    v4: std::collections::HashMap<FlowKey, u64>,
    v6: std::collections::HashMap<FlowKey6, u64>,
}

impl Migration {
    /// The old maps of layout `from` a migration left in `dir` before it
    /// finished: their flows are copied again after attaching (entries
    /// already copied stand), and the counts are taken as they are now.
    pub(super) fn resume(from: u32, dir: &Path) -> Result<Self, DataplaneError> {
        let (flows, flows6) = old_flow_maps(from, dir)?;
        let conns: Array<MapData, Conns> = open(&dir.join(names::CONNS), names::CONNS)?;
        let stats: PerCpuArray<MapData, BackendStats> = open(&dir.join(names::BACKEND_STATS), names::BACKEND_STATS)?;
        let mut conns_copied = vec![Conns::default(); MAX_BACKENDS as usize];
        let mut stats_copied = Vec::new();
        for id in 1..MAX_BACKENDS {
            conns_copied[id as usize] = conns.get(&id, 0).map_err(map_err(names::CONNS))?;
            stats_copied.push((id, stats.get(&id, 0).map_err(map_err(names::BACKEND_STATS))?));
        }
        info!(dir = %dir.display(), "an earlier migration did not finish: its flows are copied again after attaching");
        Ok(Self {
            from,
            dir: dir.to_path_buf(),
            fresh: false,
            flows,
            flows6,
            conns,
            conns_copied,
            stats,
            stats_copied,
            copied: None,
        })
    }
}

/// The flow tables of the layout-`from` maps in `dir`: IPv4's, and
/// IPv6's from layout 2 on.
fn old_flow_maps(from: u32, dir: &Path) -> Result<(MapData, Option<MapData>), DataplaneError> {
    let flows = MapData::from_pin(dir.join(flows_name(from))).map_err(map_err(names::FLOWS))?;
    let flows6 = if from >= 2 {
        Some(MapData::from_pin(dir.join(flows6_name(from))).map_err(map_err(names::FLOWS6))?)
    } else {
        None
    };
    Ok((flows, flows6))
}

/// Every entry (key and value) of the layout-`from` flow table `old`, read
/// in batches: a kernel hash's (layouts 1 and 2), or the whole entries of
/// a table of slots whose elements are `B` (layouts 3 to 6; an entry being
/// written as it is read is left out, the copy after the program swap
/// takes it). A reply entry's key (its value's direction, `dir`, is
/// `DIR_REPLY`) was the backend's bare 5-tuple before layout 5: it comes
/// back marked, so that it starts its probes beside its flow's forward
/// entry.
fn old_entries<K: aya::Pod + SlotKey, V: aya::Pod, B: aya::Pod + AsRef<[Slot<K, V>]>>(
    from: u32,
    old: &MapData,
    map: &'static str,
    dir: fn(&V) -> u8,
) -> Result<Vec<(K, V)>, DataplaneError> {
    let mut out = Vec::new();
    let fd = old.fd().as_fd();
    let read = if from >= 3 {
        batch::for_each::<u32, B>(fd, |_, bucket| {
            out.extend(bucket.as_ref().iter().filter(|s| s.claim & SLOT_STATE == SLOT_READY).map(|s| (s.key, s.value)));
        })
    } else {
        batch::for_each::<K, V>(fd, |k, v| out.push((*k, *v)))
    };
    read.map_err(|source| DataplaneError::Batch { map, source })?;
    for (k, v) in &mut out {
        k.set_reply(dir(v) == DIR_REPLY);
    }
    Ok(out)
}

impl Dataplane {
    /// Copy every flow of the old tables (of layout `from`) into this
    /// datapath's, through its insert: an entry the new program already
    /// made stands, unless `earlier` says it is this flow's earlier copy,
    /// which then takes what the old program saw since (see
    /// [`Dataplane::merge_flows`]). Returns how many were inserted and
    /// merged, and, for the first copy (no `earlier`), the state of every
    /// flow read.
    fn copy_flows(
        &self,
        from: u32,
        old: &MapData,
        old6: Option<&MapData>,
        earlier: Option<&Copied>,
    ) -> Result<(Inserted, Option<Copied>), DataplaneError> {
        let mut flows = old_entries::<FlowKey, Flow, BucketV3>(from, old, names::FLOWS, |f| f.dir)?;
        if from == 1 {
            for (_, f) in &mut flows {
                // Layout 1 did not track handshakes: every flow it knew is
                // taken as established (a half-open one then lives its
                // idle timeout, not the short one; no live flow is expired
                // early). Closed ones too: the late copy then judges a
                // close the old program saw since as the same connection's
                // (a view that lost a copied bit is a later connection).
                f.state |= FLOW_REPLIED | FLOW_ESTABLISHED;
            }
        }
        let first = earlier.is_none();
        let none = Copied::default();
        let earlier = earlier.unwrap_or(&none);
        // The record a late copy merges by (the state as the old program
        // left it); the late copy needs none.
        let mut read =
            first.then(|| Copied { v4: flows.iter().map(|(k, f)| (*k, f.state)).collect(), v6: Default::default() });
        // Every copied entry is marked, the late copy's too: the late copy
        // merges only into entries that still have the mark (a new
        // connection on the tuple drops it), and the datapath takes any
        // SYN on a half-open copy for the copy's own SYN retransmitted, as
        // the old layouts kept no sequence byte to tell (`syn_seq`, 0 in a
        // copy). Unmarked, a half-open flow the old program opened after
        // the first copy would have its SYN's retransmission counted as a
        // new connection.
        for (_, f) in &mut flows {
            f.state |= FLOW_COPY;
        }
        let mut done = self.merge_flows(&flows, &earlier.v4)?;
        drop(flows);
        if let Some(old6) = old6 {
            let mut flows6 = old_entries::<FlowKey6, Flow6, Bucket6V3>(from, old6, names::FLOWS6, |f| f.dir)?;
            if let Some(read) = &mut read {
                read.v6 = flows6.iter().map(|(k, f)| (*k, f.state)).collect();
            }
            for (_, f) in &mut flows6 {
                f.state |= FLOW_COPY;
            }
            let d6 = self.merge_flows6(&flows6, &earlier.v6)?;
            done += d6;
        }
        if done.no_room > 0 {
            warn!(
                flows = done.no_room,
                "flows of the old table found no free slot in the new one (a smaller conntrack_max?): they go on without an entry"
            );
        }
        Ok((done, read))
    }

    /// Copy what the set-aside maps of layout `from` (1 to 5) in `dir` hold
    /// into this datapath's fresh maps (see the module documentation).
    pub(super) fn migrate_from(&mut self, from: u32, dir: &Path) -> Result<Migration, DataplaneError> {
        let started = std::time::Instant::now();
        let at = |name: &str| dir.join(name);
        if from == 1 {
            let vips: HashMap<MapData, VipKey, ServiceV1> = open(&at(names::VIPS), names::VIPS)?;
            for item in &vips {
                let (k, v) = item.map_err(map_err(names::VIPS))?;
                let s = Service {
                    service_id: v.service_id,
                    scheduler: v.scheduler,
                    table_off: v.table_off,
                    table_len: v.table_len,
                    flags: v.flags,
                    fallback_off: 0,
                    fallback_len: 0,
                    _pad: 0,
                };
                self.maps.vips.insert(k, s, 0).map_err(map_err(names::VIPS))?;
            }
        } else {
            let vips: HashMap<MapData, VipKey, Service> = open(&at(names::VIPS), names::VIPS)?;
            for item in &vips {
                let (k, v) = item.map_err(map_err(names::VIPS))?;
                self.maps.vips.insert(k, v, 0).map_err(map_err(names::VIPS))?;
            }
            let vips6: HashMap<MapData, Vip6Key, Service> = open(&at(names::VIPS6), names::VIPS6)?;
            for item in &vips6 {
                let (k, v) = item.map_err(map_err(names::VIPS6))?;
                self.maps.vips6.insert(k, v, 0).map_err(map_err(names::VIPS6))?;
            }
            let addrs6: Array<MapData, [u32; 4]> = open(&at(names::BACKEND_ADDRS6), names::BACKEND_ADDRS6)?;
            for id in 1..MAX_BACKENDS {
                let a = addrs6.get(&id, 0).map_err(map_err(names::BACKEND_ADDRS6))?;
                if a != [0; 4] {
                    self.maps.backend_addrs6.set(id, a, 0).map_err(map_err(names::BACKEND_ADDRS6))?;
                }
            }
            let endpoints6: HashMap<MapData, Vip6Key, Vip6Key> = open(&at(names::ENDPOINTS6), names::ENDPOINTS6)?;
            for item in &endpoints6 {
                let (k, v) = item.map_err(map_err(names::ENDPOINTS6))?;
                self.maps.endpoints6.insert(k, v, 0).map_err(map_err(names::ENDPOINTS6))?;
            }
        }
        let backends: Array<MapData, Backend> = open(&at(names::BACKENDS), names::BACKENDS)?;
        let conns: Array<MapData, Conns> = open(&at(names::CONNS), names::CONNS)?;
        let expired: Array<MapData, u64> = open(&at(names::EXPIRED), names::EXPIRED)?;
        let stats: PerCpuArray<MapData, BackendStats> = open(&at(names::BACKEND_STATS), names::BACKEND_STATS)?;
        let mut conns_copied = vec![Conns::default(); MAX_BACKENDS as usize];
        let mut stats_copied = Vec::new();
        for id in 1..MAX_BACKENDS {
            let b = backends.get(&id, 0).map_err(map_err(names::BACKENDS))?;
            if b == Backend::default() {
                continue;
            }
            self.maps.backends.set(id, b, 0).map_err(map_err(names::BACKENDS))?;
            let c = conns.get(&id, 0).map_err(map_err(names::CONNS))?;
            self.maps.conns.set(id, c, 0).map_err(map_err(names::CONNS))?;
            conns_copied[id as usize] = c;
            let e = expired.get(&id, 0).map_err(map_err(names::EXPIRED))?;
            self.maps.expired.set(id, e, 0).map_err(map_err(names::EXPIRED))?;
            let s = stats.get(&id, 0).map_err(map_err(names::BACKEND_STATS))?;
            let copy = PerCpuValues::try_from(s.to_vec()).expect("one value per CPU");
            self.maps.backend_stats.set(id, copy, 0).map_err(map_err(names::BACKEND_STATS))?;
            stats_copied.push((id, s));
        }
        let seq: Array<MapData, u64> = open(&at(names::SEQ), names::SEQ)?;
        for i in 0..MAX_SERVICES {
            let v = seq.get(&i, 0).map_err(map_err(names::SEQ))?;
            self.maps.seq.set(i, v, 0).map_err(map_err(names::SEQ))?;
        }
        // Global counters: layout 1 had the first 9 of today's.
        self.copy_counters(&open(&at(names::COUNTERS), names::COUNTERS)?)?;
        let endpoints: HashMap<MapData, EndpointKey, VipKey> = open(&at(names::ENDPOINTS), names::ENDPOINTS)?;
        for item in &endpoints {
            let (k, v) = item.map_err(map_err(names::ENDPOINTS))?;
            self.maps.endpoints.insert(k, v, 0).map_err(map_err(names::ENDPOINTS))?;
        }
        let (flows, flows6) = old_flow_maps(from, dir)?;
        let (done, copied) = self.copy_flows(from, &flows, flows6.as_ref(), None)?;
        info!(
            flows = done.inserted,
            from,
            to = LAYOUT_VERSION,
            ms = started.elapsed().as_millis() as u64,
            "migrating the pinned datapath: maps copied"
        );
        Ok(Migration {
            from,
            dir: dir.to_path_buf(),
            fresh: true,
            flows,
            flows6,
            conns,
            conns_copied,
            stats,
            stats_copied,
            copied,
        })
    }

    /// After a start that failed (programming the services or attaching)
    /// before this build's program replaced the running one on any
    /// interface: undo the migration begun at load, so that the old
    /// datapath, still attached, keeps its maps where its own lbd finds
    /// them, and no half-made layout is left pinned beside them. Once
    /// some link runs this build's program, or for a migration resumed
    /// from an earlier start, the new maps are in use: they stay, and the
    /// next start finishes the migration.
    pub fn abandon_migration(&mut self) {
        if let (Some(pin), Some(from), false) = (&self.pin, self.taken_up_from, self.swapped) {
            give_back(&pin.join("maps"), from);
            info!(from, "the take-up of the pinned datapath was undone: it keeps its layout");
            self.taken_up_from = None;
        }
        let (Some(pin), Some(m)) = (&self.pin, &self.migration) else { return };
        if self.swapped || !m.fresh {
            info!(dir = %m.dir.display(), "the migration of the pinned datapath is left for the next start to finish");
            return;
        }
        let maps_dir = pin.join("maps");
        match put_back(&maps_dir, &m.dir) {
            Ok(()) => info!(from = m.from, "the migration was undone: the old datapath keeps its maps"),
            Err(e) => warn!(error = %e, dir = %m.dir.display(), "putting the old maps back"),
        }
        self.migration = None;
    }

    /// After attaching (the new program swapped in): copy the flows the
    /// old program made since the maps were copied, add the flows it
    /// opened and closed meanwhile to the counts, and remove the old maps.
    /// Nothing to do unless this lbd migrated.
    pub fn finish_migration(&mut self) -> Result<(), DataplaneError> {
        let Some(m) = self.migration.take() else { return Ok(()) };
        let (late, _) = self.copy_flows(m.from, &m.flows, m.flows6.as_ref(), m.copied.as_ref())?;
        // Every flow is in: stop holding packets without an entry.
        let flood = self.flood;
        self.set_flood(&flood)?;
        // The swap returned while the old program may still be running on
        // another CPU, in the middle of a packet: a new flow it counted
        // after the reads below was lost (upgrade tests counted one new
        // flow fewer than the backends served, in about 1 run of 4). It
        // runs inside RCU read-side sections (softirq), so after a grace
        // period (membarrier's GLOBAL command waits for one) every such
        // run is over. Without membarrier (nohz_full CPUs), a pause longer
        // than a grace period (about 9 ms here).
        if rustix::thread::membarrier(rustix::thread::MembarrierCommand::Global).is_err() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        // What the old program counted since the copy, added in the
        // kernel: the new program counts into the same words meanwhile.
        let mut adds: std::collections::BTreeMap<u32, CountsAdd> = std::collections::BTreeMap::new();
        fn entry(adds: &mut std::collections::BTreeMap<u32, CountsAdd>, id: u32) -> &mut CountsAdd {
            adds.entry(id).or_insert(CountsAdd { backend_id: id, ..CountsAdd::default() })
        }
        for id in 1..MAX_BACKENDS {
            let before = m.conns_copied[id as usize];
            let after = m.conns.get(&id, 0).map_err(map_err(names::CONNS))?;
            if after != before {
                let a = entry(&mut adds, id);
                a.opened = after.opened.saturating_sub(before.opened);
                a.closed = after.closed.saturating_sub(before.closed);
            }
        }
        for (id, before) in &m.stats_copied {
            let after = m.stats.get(id, 0).map_err(map_err(names::BACKEND_STATS))?;
            let mut delta = BackendStats::default();
            for (b, a) in before.iter().zip(after.iter()) {
                delta.add(&BackendStats {
                    new_flows: a.new_flows.saturating_sub(b.new_flows),
                    packets_in: a.packets_in.saturating_sub(b.packets_in),
                    bytes_in: a.bytes_in.saturating_sub(b.bytes_in),
                    packets_out: a.packets_out.saturating_sub(b.packets_out),
                    bytes_out: a.bytes_out.saturating_sub(b.bytes_out),
                });
            }
            if delta != BackendStats::default() {
                entry(&mut adds, *id).stats = delta;
            }
        }
        let adds: Vec<CountsAdd> = adds.into_values().collect();
        self.add_counts(&adds)?;
        std::fs::remove_dir_all(&m.dir).map_err(|source| DataplaneError::Pin { path: m.dir.clone(), source })?;
        info!(
            from = m.from,
            to = LAYOUT_VERSION,
            late_flows = late.inserted,
            merged_flows = late.merged,
            replaced_flows = late.replaced,
            "migrated the pinned datapath; the old maps are removed"
        );
        Ok(())
    }
}

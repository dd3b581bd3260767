//! Expiring idle flows from the flow table (the datapath only sees FIN and
//! RST), and the datapath's idle clock.
use std::collections::{HashMap, HashSet};

use aya::programs::{ProgramError, TestRun as _, TestRunOptions, Xdp};
use lb_common::{
    COPIED, COUNTS_BATCH, CountsAdd, DIR_DSR, DIR_FORWARD, DIR_REPLY, FLOW_ESTABLISHED, FLOW_FIN_CLIENT, FLOW_REOPENED,
    Flow, Flow6, FlowBucket, FlowBucket6, FlowKey, FlowKey6, INSERT_BATCH, INSERT_BATCH6, INSERT_EXISTS, INSERT_MERGED,
    INSERT_REPLACED, INSERTED, InsertItem, InsertItem6, PROTO_TCP, SLOT_BUCKET, SLOT_READY, SLOT_STATE, SWEEP_BATCH,
    SWEEP_BATCH6, SWEEP_BY_CLAIM, SWEEP_BY_KEY, SWEEP_CLOSED, SWEEP_COUNTS, SWEEP_INSERT, SWEEP_PROGRAM, SweepHeader,
    SweepItem, SweepItem6, flow_closed, maps as names,
};

use super::{
    Dataplane, DataplaneError,
    flows::{Buckets, FlowTable},
    map_err,
};

/// One flow table's key and value types, seen the same way by the sweep.
trait Table {
    type K: aya::Pod + Copy + Eq + std::hash::Hash;
    type V: aya::Pod + Copy;
    /// An element of the table's array: `SLOT_BUCKET` slots.
    type Bucket: Buckets;
    /// What `lb_sweep` is handed per flow (`lb_common::SweepItem`).
    type Item: aya::Pod + Copy;
    /// `SweepHeader::family` of this table, and items per `lb_sweep` run.
    const FAMILY: u32;
    const BATCH: usize;
    /// (dir, proto, state, last_seen, backend id, service id) of an entry.
    fn view(k: &Self::K, v: &Self::V) -> (u8, u8, u64, u64, u32, u32);
    /// The key of a forward entry's reply entry.
    fn reply_key(k: &Self::K, v: &Self::V) -> Self::K;
    /// The request to remove `k`, in slot `slot`, if its state and last
    /// packet are still these (`slot` `SWEEP_BY_KEY`: wherever, whatever).
    fn item(k: &Self::K, slot: u32, state: u64, last_seen: u64) -> Self::Item;
    /// The claim, key and value of slot `i` of an element.
    fn parts(b: &Self::Bucket, i: usize) -> (u64, &Self::K, &Self::V);
    /// What `lb_sweep` did with the item's entry: 0 nothing, 1 removed,
    /// `SWEEP_CLOSED`.
    fn removed(i: &Self::Item) -> u32;
    /// The key of the forward entry a reply entry (`k`, `v`) belongs to:
    /// the client's 5-tuple towards the VIP the reply entry names.
    fn forward_key(k: &Self::K, v: &Self::V) -> Self::K;
    /// `key`'s entry in `table` (of slot-hash seed `seed`), if it has one.
    fn lookup(table: &FlowTable<Self::Bucket>, seed: u64, key: &Self::K) -> Result<Option<Self::V>, DataplaneError>;
}

/// Reply entries that no forward entry named, by slot: the key and the
/// claim each was read with.
pub(super) type Orphans<K> = HashMap<u32, (K, u64)>;

struct V4;
struct V6;

/// `Table` for one family: the two differ only in their types (an IPv6
/// key's addresses are four words, an IPv4 key's one), so one body
/// serves both.
macro_rules! table_of_family {
    ($family:ident, $key:ident, $value:ident, $bucket:ident, $item:ident, $number:literal, $batch:ident) => {
        impl Table for $family {
            type K = $key;
            type V = $value;
            type Bucket = $bucket;
            type Item = $item;
            const FAMILY: u32 = $number;
            const BATCH: usize = $batch as usize;
            fn item(k: &$key, slot: u32, state: u64, last_seen: u64) -> $item {
                $item { key: *k, state, last_seen, removed: 0, slot }
            }
            fn parts(b: &$bucket, i: usize) -> (u64, &$key, &$value) {
                (b[i].claim, &b[i].key, &b[i].value)
            }
            fn removed(i: &$item) -> u32 {
                i.removed
            }
            fn forward_key(k: &$key, f: &$value) -> $key {
                $key {
                    src_addr: k.dst_addr,
                    dst_addr: f.nat_addr,
                    src_port: k.dst_port,
                    dst_port: f.nat_port,
                    proto: k.proto,
                    _pad: [0; 3],
                }
            }
            fn lookup(table: &FlowTable<$bucket>, seed: u64, key: &$key) -> Result<Option<$value>, DataplaneError> {
                super::find_slot(table, seed, key).map(|f| f.map(|(_, s)| s.value))
            }
            fn view(k: &$key, f: &$value) -> (u8, u8, u64, u64, u32, u32) {
                (f.dir, k.proto, f.state, f.last_seen, f.backend_id, f.service_id)
            }
            fn reply_key(k: &$key, f: &$value) -> $key {
                $key {
                    src_addr: f.nat_addr,
                    dst_addr: k.src_addr,
                    src_port: f.nat_port,
                    dst_port: k.src_port,
                    proto: k.proto,
                    _pad: [0; 3],
                }
                .reply()
            }
        }
    };
}

table_of_family!(V4, FlowKey, Flow, FlowBucket, SweepItem, 4, SWEEP_BATCH);
table_of_family!(V6, FlowKey6, Flow6, FlowBucket6, SweepItem6, 6, SWEEP_BATCH6);

/// A flow the sweep would remove, as the walk judged it.
struct Doomed<K> {
    key: K,
    slot: u32,
    /// Its reply entry's key, when it has one (removed with it).
    reply: Option<K>,
    /// Its backend, when it expired open (counted expired for it).
    expired_from: Option<u32>,
    half_open: bool,
    /// The entry's state bits and last packet the verdict rests on.
    state: u64,
    last_seen: u64,
}

/// What a sweep decides, for the limits in force.
struct Limits {
    /// The flow tables' slot-hash seed.
    seed: u64,
    now: u64,
    tcp_idle: u64,
    udp_idle: u64,
    half_open: u64,
    udp_by_service: HashMap<u32, u64>,
}

/// What the sweep does with one flow-table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// A reply entry: removed with its flow, never judged alone.
    Reply,
    Keep,
    /// A closed TCP flow past its linger: removed (the datapath counted
    /// it closed already).
    Closed,
    /// An open flow that expired: removed and counted expired for its
    /// backend; `half_open` when it never got established.
    Expired {
        half_open: bool,
    },
}

/// The sweep's rule for one entry (see [`Dataplane::sweep`]), by its
/// direction, protocol, state bits, last packet and service. A forward
/// entry (`DIR_FORWARD`, `DIR_FLOW`, `DIR_DSR`) holds its flow's state;
/// the same rule for both tables.
fn judge(dir: u8, proto: u8, state: u64, last_seen: u64, service: u32, l: &Limits) -> Verdict {
    if dir == DIR_REPLY {
        return Verdict::Reply;
    }
    let idle = l.now.saturating_sub(last_seen);
    if proto == PROTO_TCP && flow_closed(state) {
        return if idle > CLOSED_LINGER { Verdict::Closed } else { Verdict::Keep };
    }
    let limit = if proto != PROTO_TCP {
        l.udp_by_service.get(&service).copied().unwrap_or(l.udp_idle)
    } else if dir == DIR_DSR && state & FLOW_FIN_CLIENT != 0 {
        // The backend's FIN never passes the balancer, so a DSR flow is
        // never seen closed (only reset): once the client sent its FIN,
        // its silence means the connection is over (IPVS's direct routing
        // gives a client FIN its TIME_WAIT timeout, 2 min). Counted
        // expired: the datapath never counted it closed.
        l.tcp_idle.min(DSR_FIN_TIMEOUT)
    } else {
        l.tcp_idle
    };
    // A DSR flow never sees its backend's answers: the datapath marks it
    // established at the client's first packet after its opening, so the
    // half-open rule holds for it too.
    // A reopened entry (a reused tuple's new connection) is not half-open.
    let half_open = state & (FLOW_ESTABLISHED | FLOW_REOPENED) == 0;
    if idle > limit {
        Verdict::Expired { half_open: false }
    } else if half_open && idle > l.half_open {
        Verdict::Expired { half_open: true }
    } else {
        Verdict::Keep
    }
}

/// Sweep the next chunk of one flow table (see [`Dataplane::sweep`]):
/// expired flows counted into `expired_by`, the rest into `report`.
/// `remover` is `lb_sweep`.
fn sweep_chunk<T: Table>(
    table: &FlowTable<T::Bucket>,
    walk: &mut TableWalk,
    remover: &Xdp,
    l: &Limits,
    report: &mut SweepReport,
    expired_by: &mut HashMap<u32, u64>,
    orphans: (&Orphans<T::K>, &mut Orphans<T::K>),
) -> Result<(), DataplaneError> {
    // Judged once, as read. A closed flow's 5-tuple comes back when its
    // client reuses the port: the new connection's SYN replaces the entry
    // (same key). Deleting by key on the strength of that look would then
    // lose a live flow, whose next packets a round-robin service would
    // send to another backend (a reset connection: seen in the lab at 200
    // clients, once in about 31,000 new connections). So the removal is
    // `lb_sweep`'s: in the kernel, each entry goes only if its state bits
    // and last packet are still those judged here (see `lb-ebpf/src/sweep.rs`).
    let mut doomed: Vec<Doomed<T::K>> = Vec::new();
    // The reply entries read, and the reply keys the forward entries read
    // name (see `orphans_of`).
    let (mut replies_read, mut named) = (Vec::new(), HashSet::new());
    let mut read_one = |element: u32, b: &T::Bucket| {
        for i in 0..SLOT_BUCKET as usize {
            let (claim, k, f) = T::parts(b, i);
            if claim & SLOT_STATE != SLOT_READY {
                continue;
            }
            let slot = element * SLOT_BUCKET + i as u32;
            report.entries += 1;
            let (dir, proto, state, last_seen, backend, service) = T::view(k, f);
            if dir == DIR_FORWARD {
                named.insert(T::reply_key(k, f));
            }
            let verdict = judge(dir, proto, state, last_seen, service, l);
            if verdict == Verdict::Reply {
                replies_read.push(ReplyRead { slot, key: *k, claim, forward: T::forward_key(k, f) });
                continue;
            }
            report.scanned += 1;
            let (expired_from, half_open) = match verdict {
                Verdict::Reply | Verdict::Keep => continue,
                Verdict::Closed => (None, false),
                Verdict::Expired { half_open } => (Some(backend), half_open),
            };
            // Only a NAT flow with a reply entry of its own has one to remove.
            let reply = (dir == DIR_FORWARD).then(|| T::reply_key(k, f));
            doomed.push(Doomed { key: *k, slot, reply, expired_from, half_open, state, last_seen });
        }
    };
    // Whole arrays, until a part's worth of elements is read.
    let mut read = 0;
    while !walk.done && read < PART_ELEMENTS {
        read += table.read_array(walk.next, &mut read_one)?;
        walk.next += 1;
        walk.done = walk.next >= table.arrays();
    }
    let mut replies = Vec::new();
    let mut removed_here = 0;
    let items: Vec<T::Item> = doomed.iter().map(|d| T::item(&d.key, d.slot, d.state, d.last_seen)).collect();
    let done = remove_unchanged::<T>(remover, &items)?;
    // The flow's own entry went first: if a packet raced us and it is gone
    // already, nothing is counted twice.
    for (d, item) in doomed.iter().zip(&done) {
        match T::removed(item) {
            1 => {
                removed_here += 1;
                replies.extend(d.reply);
                if d.half_open {
                    report.half_open_expired += 1;
                }
            }
            // Not removed, but its close is ours to count: the flow,
            // judged open, was closed or replaced while `lb_sweep` had it
            // marked (the datapath counts no close of a marked entry).
            // Its entry (or the one in its place) stays, and so does its
            // reply entry.
            SWEEP_CLOSED => report.closed_while_marked += 1,
            _ => continue,
        }
        if let Some(b) = d.expired_from {
            *expired_by.entry(b).or_default() += 1;
            report.expired += 1;
        }
    }
    report.removed += removed_here;
    report.entries_removed += removed_here;
    if !replies.is_empty() {
        let items: Vec<T::Item> = replies.iter().map(|k| T::item(k, SWEEP_BY_KEY, 0, 0)).collect();
        let gone = remove_unchanged::<T>(remover, &items)?;
        report.entries_removed += gone.iter().filter(|i| T::removed(i) == 1).count() as u64;
    }
    let items = orphans_of::<T>(table, l.seed, &replies_read, &named, orphans)?;
    if !items.is_empty() {
        let gone = remove_unchanged::<T>(remover, &items)?.iter().filter(|i| T::removed(i) == 1).count() as u64;
        report.orphans_removed += gone;
        report.entries_removed += gone;
    }
    Ok(())
}

/// A reply entry as a sweep read it.
struct ReplyRead<K> {
    slot: u32,
    key: K,
    claim: u64,
    /// The key of the forward entry it belongs to.
    forward: K,
}

/// The reply entries among `read` that no forward entry names (their
/// flow's tuple taken by a new connection on another backend: the new
/// entry replaced the forward entry in place and made a reply entry of
/// its own, and nothing else ever removes the old one, which held its
/// room in the table for good). `named`: the reply keys of the forward
/// entries read in the same part; a reply entry not among them is looked
/// up by its forward key (its forward entry may lie in another part).
/// One found so is noted in `next` with the claim it was read with; the
/// removal requests returned are for those that `last`, the last sweep's
/// notes, holds with the same claim: found so twice, seconds apart. A
/// new flow's reply entry goes in just before its forward entry, so a
/// read between the two finds it alone once, never twice. The request
/// removes it only if its claim is still the one read
/// (`lb_common::SWEEP_BY_CLAIM`): a new flow that made that reply entry
/// anew since (the same tuple on the same backend) bumped its claim's
/// generation.
fn orphans_of<T: Table>(
    table: &FlowTable<T::Bucket>,
    seed: u64,
    read: &[ReplyRead<T::K>],
    named: &HashSet<T::K>,
    (last, next): (&Orphans<T::K>, &mut Orphans<T::K>),
) -> Result<Vec<T::Item>, DataplaneError> {
    let mut items = Vec::new();
    for r in read.iter().filter(|r| !named.contains(&r.key)) {
        if T::lookup(table, seed, &r.forward)?
            .is_some_and(|f| T::view(&r.forward, &f).0 == DIR_FORWARD && T::reply_key(&r.forward, &f) == r.key)
        {
            continue;
        }
        if last.get(&r.slot) == Some(&(r.key, r.claim)) {
            items.push(T::item(&r.key, r.slot, r.claim, SWEEP_BY_CLAIM));
        } else {
            next.insert(r.slot, (r.key, r.claim));
        }
    }
    Ok(items)
}

/// Array elements a sweep reads per part: about 8,192 slots (whole
/// arrays).
const PART_ELEMENTS: u32 = 8192 / SLOT_BUCKET;

/// Where a sweep's walk of one flow table is: the next array to read.
#[derive(Default)]
struct TableWalk {
    next: u32,
    done: bool,
}

impl TableWalk {
    fn started(&self) -> bool {
        self.next > 0 || self.done
    }
    fn done(&self) -> bool {
        self.done
    }
    /// End the walk before it starts (nothing to read).
    fn skip(&mut self) {
        self.done = true;
    }
}

/// `lb_sweep`'s answer to a request it carried out (XDP_PASS, linux/bpf.h).
const XDP_PASS: u32 = 2;

/// `lb_sweep` over `items`, in runs of `T::BATCH`: the items as the
/// program left them, each marked if its entry was removed.
fn remove_unchanged<T: Table>(remover: &Xdp, items: &[T::Item]) -> Result<Vec<T::Item>, DataplaneError> {
    request(remover, T::Bucket::NAME, T::FAMILY, T::BATCH, items)
}

/// `lb_sweep` over `items` (of the request `family`), in runs of `batch`:
/// the items as the program left them.
/// An insert item's `copied` word for a flow copied with `state` (0: not
/// copied before, a plain insert). The flow state bits all lie in the low
/// 32 (see `lb_common::MERGED_BITS`).
fn copied_word(state: Option<&u64>) -> u32 {
    state.map_or(0, |&s| COPIED | (s as u32 & !COPIED))
}

fn request<I: aya::Pod>(
    remover: &Xdp,
    map: &'static str,
    family: u32,
    batch: usize,
    items: &[I],
) -> Result<Vec<I>, DataplaneError> {
    let err = |source| DataplaneError::Sweep { map, source };
    let (hs, is) = (size_of::<SweepHeader>(), size_of::<I>());
    let mut done = Vec::with_capacity(items.len());
    let mut frame = Vec::with_capacity(hs + batch * is);
    let mut out = Vec::new();
    for run in items.chunks(batch) {
        let header = SweepHeader { family, count: u32::try_from(run.len()).unwrap_or(u32::MAX) };
        frame.clear();
        frame.resize(hs + run.len() * is, 0);
        // SAFETY: both are aya::Pod (repr(C) integers, no implicit
        // padding), so their bytes are initialised; the frame holds them
        // (sized above).
        unsafe {
            std::ptr::from_ref(&header).cast::<u8>().copy_to_nonoverlapping(frame.as_mut_ptr(), hs);
            run.as_ptr().cast::<u8>().copy_to_nonoverlapping(frame.as_mut_ptr().add(hs), run.len() * is);
        }
        out.clear();
        out.resize(frame.len(), 0);
        let res = remover
            .test_run(TestRunOptions { data_in: Some(&frame), data_out: Some(&mut out), ..TestRunOptions::default() })
            .map_err(|e| err(std::io::Error::other(e)))?;
        if res.return_value != XDP_PASS || res.data_size_out as usize != frame.len() {
            return Err(err(std::io::Error::other(format!(
                "the program refused a request of {} flows (answer {}, {} of {} bytes back)",
                run.len(),
                res.return_value,
                res.data_size_out,
                frame.len()
            ))));
        }
        done.extend((0..run.len()).map(|i| {
            // SAFETY: the program wrote back the whole frame (checked
            // above); I is Pod, so any bytes are a valid value.
            unsafe { out.as_ptr().add(hs + i * is).cast::<I>().read_unaligned() }
        }));
    }
    Ok(done)
}

/// What inserting flows (`Dataplane::insert_flows`) came to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Inserted {
    pub inserted: u64,
    /// Keys that had an entry already (which stands).
    pub existed: u64,
    /// Keys whose entry was the flow's earlier copy, into which the later
    /// view's bits or time went (see [`Dataplane::merge_flows`]).
    pub merged: u64,
    /// Keys whose entry was the flow's earlier copy, replaced by the later
    /// view of a later connection on the tuple (see
    /// [`Dataplane::merge_flows`]).
    pub replaced: u64,
    /// Flows for which the table had no free slot.
    pub no_room: u64,
}

impl std::ops::AddAssign for Inserted {
    fn add_assign(&mut self, o: Self) {
        self.inserted += o.inserted;
        self.existed += o.existed;
        self.merged += o.merged;
        self.replaced += o.replaced;
        self.no_room += o.no_room;
    }
}

impl Inserted {
    fn count(results: impl Iterator<Item = u32>) -> Self {
        let mut c = Self::default();
        for r in results {
            match r {
                INSERTED => c.inserted += 1,
                INSERT_EXISTS => c.existed += 1,
                INSERT_MERGED => c.merged += 1,
                INSERT_REPLACED => c.replaced += 1,
                _ => c.no_room += 1,
            }
        }
        c
    }
}

impl Dataplane {
    /// Remove each IPv4 flow of `items` whose entry still has the item's
    /// `state` and `last_seen`, as `sweep` removes the flows it judged
    /// (in the kernel, by `lb_sweep`); returns the items, those removed
    /// marked `removed`.
    pub fn remove_unchanged(&self, items: &[SweepItem]) -> Result<Vec<SweepItem>, DataplaneError> {
        remove_unchanged::<V4>(self.remover()?, items)
    }

    /// [`Dataplane::remove_unchanged`] for IPv6 flows.
    pub fn remove_unchanged6(&self, items: &[SweepItem6]) -> Result<Vec<SweepItem6>, DataplaneError> {
        remove_unchanged::<V6>(self.remover()?, items)
    }

    /// Insert the IPv4 flows `flows` into the flow table unless their key
    /// has an entry (which stands), through the datapath's own insert (by
    /// `lb_sweep`), safe while packets are balanced: a migration's copy.
    pub fn insert_flows(&self, flows: &[(FlowKey, Flow)]) -> Result<Inserted, DataplaneError> {
        self.merge_flows(flows, &HashMap::new())
    }

    /// [`Dataplane::insert_flows`] for IPv6 flows.
    pub fn insert_flows6(&self, flows: &[(FlowKey6, Flow6)]) -> Result<Inserted, DataplaneError> {
        self.merge_flows6(flows, &HashMap::new())
    }

    /// [`Dataplane::insert_flows`] of an old table's flows read again,
    /// some of which were copied before with the state bits `copied`
    /// gives: where a key's entry is still that copy, the handshake and
    /// close the old program saw since go into it, and its later time; the
    /// old program's view of a later connection on the tuple (a client
    /// reusing its port) replaces it (see `lb_common::InsertItem::copied`).
    /// Without this, a connection whose handshake completed under the old
    /// program after the copy stayed half-open here (and was expired after
    /// `half_open_timeout` of silence, while alive), and one it saw close
    /// stayed open until its idle timeout and was then counted expired as
    /// well as closed; a later connection on a closed copy's tuple went to
    /// the copy's backend, or was never counted closed.
    pub fn merge_flows(
        &self,
        flows: &[(FlowKey, Flow)],
        copied: &HashMap<FlowKey, u64>,
    ) -> Result<Inserted, DataplaneError> {
        let items: Vec<InsertItem> = flows
            .iter()
            .map(|&(key, value)| InsertItem { key, value, inserted: 0, copied: copied_word(copied.get(&key)) })
            .collect();
        let done = request(self.remover()?, names::FLOWS, SWEEP_INSERT | 4, INSERT_BATCH as usize, &items)?;
        Ok(Inserted::count(done.iter().map(|i| i.inserted)))
    }

    /// [`Dataplane::merge_flows`] for IPv6 flows.
    pub fn merge_flows6(
        &self,
        flows: &[(FlowKey6, Flow6)],
        copied: &HashMap<FlowKey6, u64>,
    ) -> Result<Inserted, DataplaneError> {
        let items: Vec<InsertItem6> = flows
            .iter()
            .map(|&(key, value)| InsertItem6 { key, value, inserted: 0, copied: copied_word(copied.get(&key)) })
            .collect();
        let done = request(self.remover()?, names::FLOWS6, SWEEP_INSERT | 6, INSERT_BATCH6 as usize, &items)?;
        Ok(Inserted::count(done.iter().map(|i| i.inserted)))
    }

    /// Add to backends' counts atomically, in the kernel (see
    /// `lb_common::SWEEP_COUNTS`): a read and write back from here would
    /// lose what the datapath counts between them. Answers how many items'
    /// backend ids had an entry to add to.
    pub fn add_counts(&self, adds: &[CountsAdd]) -> Result<usize, DataplaneError> {
        let done = request(self.remover()?, names::CONNS, SWEEP_COUNTS, COUNTS_BATCH as usize, adds)?;
        Ok(done.iter().filter(|a| a.added == 1).count())
    }

    fn remover(&self) -> Result<&Xdp, DataplaneError> {
        Ok(self.ebpf.program(SWEEP_PROGRAM).ok_or(ProgramError::NotLoaded)?.try_into()?)
    }

    /// Expire idle flows: an open flow silent for longer than its
    /// protocol's idle timeout (a UDP service's own, when it has one), or a
    /// half-open one (no `FLOW_ESTABLISHED`: the client never spoke after
    /// the backend answered) silent for longer than the flood settings'
    /// `half_open_timeout`, is removed (with its reply entry, if it has
    /// one) and counted as expired for its backend; a closed TCP flow is
    /// removed after `CLOSED_LINGER` seconds; a DSR flow whose client sent
    /// its FIN expires after `DSR_FIN_TIMEOUT` seconds of silence. `now` is in seconds of
    /// CLOCK_MONOTONIC_COARSE (see [`monotonic_coarse_secs`]). Both flow
    /// tables (IPv4 and IPv6) are read and pruned in batches (see `batch`).
    pub fn sweep(&mut self, now: u64, tcp_idle: u64, udp_idle: u64) -> Result<SweepReport, DataplaneError> {
        let mut run = self.sweep_begin(now, tcp_idle, udp_idle);
        loop {
            if let Some(report) = self.sweep_step(&mut run)? {
                return Ok(report);
            }
        }
    }

    /// A sweep (see [`Dataplane::sweep`]) to be run a part at a time by
    /// [`Dataplane::sweep_step`], its limits fixed now.
    pub fn sweep_begin(&self, now: u64, tcp_idle: u64, udp_idle: u64) -> SweepRun {
        // Services with a UDP idle timeout of their own, by service id.
        let udp_by_service: HashMap<u32, u64> =
            self.services.values().filter_map(|s| s.config.udp_idle_timeout.map(|t| (s.id, u64::from(t)))).collect();
        SweepRun {
            limits: Limits {
                seed: self.flow_seed,
                now,
                tcp_idle,
                udp_idle,
                half_open: u64::from(self.flood.half_open_timeout),
                udp_by_service,
            },
            v4: TableWalk::default(),
            v6: TableWalk::default(),
            report: SweepReport::default(),
            expired_by: HashMap::new(),
            orphans: Default::default(),
            started: std::time::Instant::now(),
        }
    }

    /// Sweep the next part of the flow tables: one batch of entries (up to
    /// 8,192) read, judged and removed, a few milliseconds at a million
    /// flows. The report once the run has swept both tables; until then
    /// None. Between steps the maps may change, and the caller may do
    /// anything else (lbd's agent lets other work have its lock).
    pub fn sweep_step(&mut self, run: &mut SweepRun) -> Result<Option<SweepReport>, DataplaneError> {
        let remover = self.remover()?;
        let SweepRun { limits, v4, v6, report, expired_by, orphans, started } = run;
        // A table the datapath counts empty as its walk would start is not
        // read: an IPv4-only gateway's sweep reads no IPv6 slots (120 bytes
        // each, 60% of the tables' memory). An entry inserted meanwhile is
        // judged by the next sweep, as one inserted behind a walk is.
        if !v4.started() && self.flow_counts()?.0 == 0 {
            v4.skip();
        }
        if v4.done() && !v6.started() && self.flow_counts()?.1 == 0 {
            v6.skip();
        }
        if !v4.done() {
            let o = (&self.orphans.0, &mut orphans.0);
            sweep_chunk::<V4>(&self.maps.flows, v4, remover, limits, report, expired_by, o)?;
            if v4.done() {
                self.orphans.0 = std::mem::take(&mut orphans.0);
            }
        } else if !v6.done() {
            let o = (&self.orphans.1, &mut orphans.1);
            sweep_chunk::<V6>(&self.maps.flows6, v6, remover, limits, report, expired_by, o)?;
            if v6.done() {
                self.orphans.1 = std::mem::take(&mut orphans.1);
            }
        }
        // Counted at once, part by part: a sweep may be left half done
        // (lbd stopping or restarting between parts), and the flows it
        // removed must still count as expired (active = opened - closed -
        // expired, which least-conn schedules by).
        let expired = &mut self.maps.expired;
        for (b, n) in expired_by.drain() {
            let cur = expired.get(&b, 0).map_err(map_err(names::EXPIRED))?;
            expired.set(b, cur + n, 0).map_err(map_err(names::EXPIRED))?;
        }
        if !(v4.done() && v6.done()) {
            return Ok(None);
        }
        report.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        Ok(Some(*report))
    }
}

/// A sweep under way ([`Dataplane::sweep_begin`]): its limits, where each
/// table's walk is, and what it did so far.
pub struct SweepRun {
    limits: Limits,
    v4: TableWalk,
    v6: TableWalk,
    report: SweepReport,
    expired_by: HashMap<u32, u64>,
    /// The reply entries this sweep found named by no forward entry
    /// (IPv4, IPv6): the next sweep's to check again.
    orphans: (Orphans<FlowKey>, Orphans<FlowKey6>),
    started: std::time::Instant,
}

/// Seconds a closed TCP flow's entries stay (late retransmissions, the
/// final ACK) before the sweeper removes them. Short, as Cilium's and
/// IPVS's close timeouts (10 s): the table does not evict, so a closed
/// flow holds room a new one could use (at 8,000 connections a second,
/// 60 s of lingering filled a 65,536-entry table and sent new flows down
/// the stateless path).
pub const CLOSED_LINGER: u64 = 10;

/// Seconds of silence after the client's FIN after which a DSR flow
/// expires (see `judge`): the backend's half of the close is never seen.
pub const DSR_FIN_TIMEOUT: u64 = 60;

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Entries in the flow tables (flows, and reply entries; IPv4 and IPv6).
    pub entries: u64,
    /// Flows looked at (reply entries are not).
    pub scanned: u64,
    /// Flows removed.
    pub removed: u64,
    /// Entries removed: the flows and their reply entries.
    pub entries_removed: u64,
    /// Open flows expired (idle, or half-open).
    pub expired: u64,
    /// Of those, half-open flows expired early (`flood.half_open_timeout`).
    pub half_open_expired: u64,
    /// Of `expired`, flows not removed but counted all the same: closed or
    /// replaced while `lb_sweep` had them marked (`lb_common::SWEEP_CLOSED`).
    pub closed_while_marked: u64,
    /// Reply entries removed that no forward entry named (see
    /// `orphans_of`), in `entries_removed` too.
    pub orphans_removed: u64,
    /// Milliseconds from the sweep's start to its end, pauses between its
    /// parts included.
    pub duration_ms: u64,
}

/// The datapath's idle clock: CLOCK_MONOTONIC_COARSE in whole seconds
/// (what `bpf_ktime_get_coarse_ns` reads).
pub fn monotonic_coarse_secs() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    u64::try_from(ts.tv_sec).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use lb_common::{
        DIR_FLOW, DIR_RETIRED, FLOW_FIN_BACKEND, FLOW_REPLIED, FLOW_RST, KEY_REPLY, PROTO_UDP, SlotKey as _,
    };

    use super::*;

    const NOW: u64 = 100_000;

    fn limits(udp_by_service: &HashMap<u32, u64>) -> Limits {
        Limits {
            seed: 0,
            now: NOW,
            tcp_idle: 900,
            udp_idle: 300,
            half_open: 10,
            udp_by_service: udp_by_service.clone(),
        }
    }

    /// An IPv6 flow entry, judged as the sweep judges FLOWS6's.
    fn judge6(dir: u8, proto: u8, state: u64, idle: u64, l: &Limits) -> Verdict {
        let k =
            FlowKey6 { src_addr: [1, 2, 3, 4], dst_addr: [5, 6, 7, 8], src_port: 1, dst_port: 2, proto, _pad: [0; 3] };
        let f = Flow6 { backend_id: 3, service_id: 7, dir, state, last_seen: NOW - idle, ..Flow6::default() };
        let (dir, proto, state, last_seen, _, service) = V6::view(&k, &f);
        judge(dir, proto, state, last_seen, service, l)
    }

    /// The same entry in FLOWS.
    fn judge4(dir: u8, proto: u8, state: u64, idle: u64, l: &Limits) -> Verdict {
        let k = FlowKey { src_addr: 1, dst_addr: 5, src_port: 1, dst_port: 2, proto, _pad: [0; 3] };
        let f = Flow { backend_id: 3, service_id: 7, dir, state, last_seen: NOW - idle, ..Flow::default() };
        let (dir, proto, state, last_seen, _, service) = V4::view(&k, &f);
        judge(dir, proto, state, last_seen, service, l)
    }

    const EXPIRED: Verdict = Verdict::Expired { half_open: false };
    const HALF_OPEN: Verdict = Verdict::Expired { half_open: true };
    const TCP: u8 = PROTO_TCP;

    #[test]
    fn both_tables_expire_alike() {
        let none = HashMap::new();
        let l = limits(&none);
        let open = FLOW_REPLIED | FLOW_ESTABLISHED;
        let cases = [
            // (dir, proto, state, idle) -> verdict
            ((DIR_REPLY, TCP, 0, 10_000), Verdict::Reply),
            ((DIR_FORWARD, TCP, open, 899), Verdict::Keep),
            ((DIR_FORWARD, TCP, open, 901), EXPIRED),
            ((DIR_FLOW, TCP, open, 901), EXPIRED),
            // Half-open: answered or not, never established.
            ((DIR_FORWARD, TCP, FLOW_REPLIED, 11), HALF_OPEN),
            ((DIR_FLOW, TCP, 0, 10), Verdict::Keep),
            ((DIR_FLOW, TCP, 0, 11), HALF_OPEN),
            // Closed: linger, then removed (not counted expired).
            ((DIR_FORWARD, TCP, open | FLOW_FIN_CLIENT | FLOW_FIN_BACKEND, 10), Verdict::Keep),
            ((DIR_FORWARD, TCP, open | FLOW_FIN_CLIENT | FLOW_FIN_BACKEND, 11), Verdict::Closed),
            ((DIR_FLOW, TCP, FLOW_RST, 11), Verdict::Closed),
            // A retired flow (always closed) lingers and goes like one.
            ((DIR_RETIRED, TCP, open | FLOW_FIN_CLIENT | FLOW_FIN_BACKEND, 10), Verdict::Keep),
            ((DIR_RETIRED, TCP, open | FLOW_FIN_CLIENT | FLOW_FIN_BACKEND, 11), Verdict::Closed),
            // One FIN is not a close for a NAT flow.
            ((DIR_FORWARD, TCP, open | FLOW_FIN_CLIENT, 899), Verdict::Keep),
            ((DIR_FORWARD, PROTO_UDP, open, 299), Verdict::Keep),
            ((DIR_FORWARD, PROTO_UDP, open, 301), EXPIRED),
            ((DIR_FLOW, PROTO_UDP, 0, 11), HALF_OPEN),
        ];
        for ((dir, proto, state, idle), want) in cases {
            assert_eq!(
                judge6(dir, proto, state, idle, &l),
                want,
                "FLOWS6 dir {dir} proto {proto} state {state:#x} idle {idle}"
            );
            assert_eq!(
                judge4(dir, proto, state, idle, &l),
                want,
                "FLOWS dir {dir} proto {proto} state {state:#x} idle {idle}"
            );
        }
    }

    #[test]
    fn dsr_flows_are_forward_entries_kept_by_establishment_alone() {
        let none = HashMap::new();
        let l = limits(&none);
        for judge in [judge4, judge6] {
            // Never FLOW_REPLIED: established is what keeps it past the
            // half-open timeout.
            assert_eq!(judge(DIR_DSR, TCP, FLOW_ESTABLISHED, 899, &l), Verdict::Keep);
            assert_eq!(judge(DIR_DSR, TCP, FLOW_ESTABLISHED, 901, &l), EXPIRED);
            assert_eq!(judge(DIR_DSR, TCP, 0, 10, &l), Verdict::Keep);
            assert_eq!(judge(DIR_DSR, TCP, 0, 11, &l), HALF_OPEN);
            assert_eq!(judge(DIR_DSR, PROTO_UDP, FLOW_ESTABLISHED, 299, &l), Verdict::Keep);
            assert_eq!(judge(DIR_DSR, PROTO_UDP, FLOW_ESTABLISHED, 301, &l), EXPIRED);
            // The client's FIN: the rest of the close is never seen.
            let fin = FLOW_ESTABLISHED | FLOW_FIN_CLIENT;
            assert_eq!(judge(DIR_DSR, TCP, fin, DSR_FIN_TIMEOUT, &l), Verdict::Keep);
            assert_eq!(judge(DIR_DSR, TCP, fin, DSR_FIN_TIMEOUT + 1, &l), EXPIRED);
            assert_eq!(judge(DIR_DSR, TCP, FLOW_ESTABLISHED | FLOW_RST, 11, &l), Verdict::Closed);
            // A reused tuple's new connection keeps the idle timeout.
            assert_eq!(judge(DIR_DSR, TCP, FLOW_REOPENED, 899, &l), Verdict::Keep);
            assert_eq!(judge(DIR_DSR, TCP, FLOW_REOPENED, 901, &l), EXPIRED);
        }
    }

    #[test]
    fn a_udp_service_timeout_applies_in_both_tables() {
        let by_service = HashMap::from([(7, 30)]);
        let l = limits(&by_service);
        for judge in [judge4, judge6] {
            assert_eq!(judge(DIR_FORWARD, PROTO_UDP, FLOW_ESTABLISHED, 30, &l), Verdict::Keep);
            assert_eq!(judge(DIR_FORWARD, PROTO_UDP, FLOW_ESTABLISHED, 31, &l), EXPIRED);
            assert_eq!(judge(DIR_FORWARD, TCP, FLOW_ESTABLISHED, 31, &l), Verdict::Keep, "TCP keeps the global");
        }
    }

    #[test]
    fn an_ipv6_reply_key_is_the_forward_key_reversed_through_the_backend() {
        let k = FlowKey6 {
            src_addr: [1, 2, 3, 4],
            dst_addr: [5, 6, 7, 8],
            src_port: 40_000,
            dst_port: 80,
            proto: TCP,
            _pad: [0; 3],
        };
        let f = Flow6 { nat_addr: [9, 10, 11, 12], nat_port: 8080, dir: DIR_FORWARD, ..Flow6::default() };
        let r = V6::reply_key(&k, &f);
        assert_eq!(
            (r.src_addr, r.dst_addr, r.src_port, r.dst_port, r.proto),
            ([9, 10, 11, 12], [1, 2, 3, 4], 8080, 40_000, TCP)
        );
        assert_eq!(r._pad[0], KEY_REPLY, "a reply key is marked");
        // It starts where the forward key does (layout 5).
        assert_eq!(r.slot_hash(7) as u32, k.slot_hash(7) as u32);
    }
}

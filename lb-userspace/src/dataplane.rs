//! The one module that touches BPF maps: loads the XDP program, attaches it,
//! turns the desired pool into map contents and reads the counters back.
//!
//! A service's change goes live atomically: its new selection table is
//! written into a free region of the SELECT array while the old one keeps
//! serving, then the service's VIP entry (a hash-map value, replaced whole by
//! the kernel) is pointed at the new region. The old region is reused only
//! after a grace period, long after any packet that read the old entry is done.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, MapError, PerCpuArray, PerCpuValues},
    programs::{ProgramError, Xdp, XdpMode as AyaXdpMode, xdp::XdpLinkId},
    util::nr_cpus,
};
use lb_common::{
    Backend, BackendStats, Conns, DIR_FORWARD, Flow, FlowKey, MAX_BACKENDS, MAX_SERVICES, PROTO_TCP,
    SCHED_FLOW_HASH, SCHED_LEAST_CONN, SCHED_SEQUENCE, SCHED_SOURCE_HASH, SVC_F_NO_BACKEND, Service,
    VipKey, counter, flow_closed,
};
use tracing::{info, warn};

use crate::{
    config::{Config, Scheduler, ServiceConfig, XdpMode},
    maglev, wrr,
};

/// The XDP program, built by build.rs and embedded in the binary.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-xdp"));

/// Name of the XDP entry point in the object.
pub const PROGRAM: &str = "lb_xdp";

/// How long a freed table region stays untouched before reuse.
const REGION_GRACE: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("loading the XDP program into the kernel: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("XDP program: {0}")]
    Program(#[from] ProgramError),
    #[error("BPF map {map}: {source}")]
    Map { map: &'static str, source: MapError },
    #[error("attaching XDP to {iface} in {mode} mode: {source}")]
    Attach { iface: String, mode: &'static str, source: ProgramError },
    #[error("the selection-table array ({capacity} entries) has no free run of {need} entries for service {service}")]
    TableSpace { service: String, need: u32, capacity: u32 },
    #[error("no free {what} id left")]
    Ids { what: &'static str },
    #[error("reading CPU count: {0}")]
    Cpus(std::io::Error),
}

fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

/// Where XDP is attached and how.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Attachment {
    pub interface: String,
    /// "native" or "generic".
    pub mode: String,
}

/// One backend as programmed into the maps.
#[derive(Clone, Debug)]
pub struct AppliedBackend {
    pub id: u32,
    pub config: crate::config::BackendConfig,
}

/// One service as programmed into the maps.
#[derive(Clone, Debug)]
pub struct AppliedService {
    pub id: u32,
    pub config: ServiceConfig,
    pub backends: Vec<AppliedBackend>,
    key: VipKey,
    region: Option<(u32, u32)>,
    table: Vec<u32>,
}

/// First-fit allocator over the SELECT array with a grace period on frees.
struct Regions {
    free: Vec<(u32, u32)>,
    pending: Vec<(u32, u32, Instant)>,
}

impl Regions {
    fn new(capacity: u32) -> Self {
        Self { free: vec![(0, capacity)], pending: Vec::new() }
    }

    fn release_expired(&mut self, now: Instant) {
        let (ready, wait): (Vec<_>, Vec<_>) =
            self.pending.drain(..).partition(|&(_, _, t)| now.duration_since(t) >= REGION_GRACE);
        self.pending = wait;
        self.free.extend(ready.into_iter().map(|(o, l, _)| (o, l)));
        self.free.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(self.free.len());
        for (o, l) in self.free.drain(..) {
            match merged.last_mut() {
                Some((mo, ml)) if *mo + *ml == o => *ml += l,
                _ => merged.push((o, l)),
            }
        }
        self.free = merged;
    }

    fn alloc(&mut self, len: u32) -> Option<u32> {
        loop {
            self.release_expired(Instant::now());
            if let Some(i) = self.free.iter().position(|&(_, l)| l >= len) {
                let (o, l) = self.free[i];
                if l == len {
                    self.free.remove(i);
                } else {
                    self.free[i] = (o + len, l - len);
                }
                return Some(o);
            }
            if self.pending.is_empty() {
                return None;
            }
            std::thread::sleep(REGION_GRACE / 4);
        }
    }

    fn free(&mut self, off: u32, len: u32) {
        self.pending.push((off, len, Instant::now()));
    }
}

/// Smallest unused id in `1..limit`, preferring ids never used before so
/// that counters of a removed backend are not inherited at once.
struct Ids {
    limit: u32,
    next: u32,
    used: HashSet<u32>,
}

impl Ids {
    fn new(limit: u32) -> Self {
        Self { limit, next: 1, used: HashSet::new() }
    }

    fn alloc(&mut self) -> Option<u32> {
        for _ in 0..self.limit {
            let id = self.next;
            self.next = if self.next + 1 >= self.limit { 1 } else { self.next + 1 };
            if self.used.insert(id) {
                return Some(id);
            }
        }
        None
    }

    fn release(&mut self, id: u32) {
        self.used.remove(&id);
    }
}

pub struct Dataplane {
    ebpf: Ebpf,
    attached: Vec<(Attachment, XdpLinkId)>,
    services: BTreeMap<String, AppliedService>,
    service_ids: Ids,
    backend_ids: Ids,
    regions: Regions,
    table_capacity: u32,
    ncpus: usize,
}

impl Dataplane {
    /// Load the program and create its maps, sized from `config`. Nothing
    /// is attached yet.
    pub fn load(config: &Config) -> Result<Self, DataplaneError> {
        // Kernel-side log statements exist only on error paths; keep them at
        // warn and above unless asked (level numbers follow aya-log-common).
        let level: u8 = if tracing::enabled!(tracing::Level::DEBUG) { 4 } else { 2 };
        let mut ebpf = EbpfLoader::new()
            .map_max_entries("FLOWS", config.conntrack_max.saturating_mul(2))
            .map_max_entries("SELECT", config.table_capacity)
            .override_global("AYA_LOG_LEVEL", &level, false)
            .load(EBPF_OBJECT)?;
        let prog: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or(ProgramError::NotLoaded)?
            .try_into()?;
        prog.load()?;
        let ncpus = nr_cpus().map_err(|(_, e)| DataplaneError::Cpus(e))?;
        Ok(Self {
            ebpf,
            attached: Vec::new(),
            services: BTreeMap::new(),
            service_ids: Ids::new(MAX_SERVICES),
            backend_ids: Ids::new(MAX_BACKENDS),
            regions: Regions::new(config.table_capacity),
            table_capacity: config.table_capacity,
            ncpus,
        })
    }

    /// The loaded object, for callers that need a map or the program
    /// (the log reader, tests running BPF_PROG_TEST_RUN).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn program(&self) -> &Xdp {
        self.ebpf
            .program(PROGRAM)
            .and_then(|p| <&Xdp>::try_from(p).ok())
            .expect("the XDP program was loaded in Dataplane::load")
    }

    /// Attach to every interface. `Auto` tries native mode and falls back
    /// to generic mode with a warning. On error, interfaces attached so far
    /// are detached again (nothing half-attached is left behind).
    pub fn attach(&mut self, interfaces: &[String], mode: XdpMode) -> Result<(), DataplaneError> {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROGRAM)
            .ok_or(ProgramError::NotLoaded)?
            .try_into()?;
        let mut done = Vec::new();
        let result = (|| {
            for iface in interfaces {
                let (link, mode_name) = match mode {
                    XdpMode::Native => (
                        prog.attach(iface, AyaXdpMode::Driver).map_err(|source| DataplaneError::Attach {
                            iface: iface.clone(),
                            mode: "native",
                            source,
                        })?,
                        "native",
                    ),
                    XdpMode::Generic => (
                        prog.attach(iface, AyaXdpMode::Skb).map_err(|source| DataplaneError::Attach {
                            iface: iface.clone(),
                            mode: "generic",
                            source,
                        })?,
                        "generic",
                    ),
                    XdpMode::Auto => match prog.attach(iface, AyaXdpMode::Driver) {
                        Ok(link) => (link, "native"),
                        Err(e) => {
                            warn!(interface = %iface, error = %e, "native XDP attach failed; falling back to generic mode");
                            (
                                prog.attach(iface, AyaXdpMode::Skb).map_err(|source| DataplaneError::Attach {
                                    iface: iface.clone(),
                                    mode: "generic",
                                    source,
                                })?,
                                "generic",
                            )
                        }
                    },
                };
                info!(interface = %iface, mode = mode_name, "XDP attached");
                done.push((Attachment { interface: iface.clone(), mode: mode_name.into() }, link));
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                self.attached.extend(done);
                Ok(())
            }
            Err(e) => {
                for (a, link) in done {
                    if let Err(de) = prog.detach(link) {
                        warn!(interface = %a.interface, error = %de, "detach after failed attach");
                    }
                }
                Err(e)
            }
        }
    }

    /// Detach from every interface.
    pub fn detach_all(&mut self) {
        let Some(prog) = self.ebpf.program_mut(PROGRAM).and_then(|p| <&mut Xdp>::try_from(p).ok()) else {
            return;
        };
        for (a, link) in self.attached.drain(..) {
            match prog.detach(link) {
                Ok(()) => info!(interface = %a.interface, "XDP detached"),
                Err(e) => warn!(interface = %a.interface, error = %e, "XDP detach failed"),
            }
        }
    }

    pub fn attachments(&self) -> Vec<Attachment> {
        self.attached.iter().map(|(a, _)| a.clone()).collect()
    }

    pub fn services(&self) -> impl Iterator<Item = &AppliedService> {
        self.services.values()
    }

    /// Make the maps carry exactly `services`. Services are matched by
    /// name, backends by address and port: unchanged parts keep their ids,
    /// their counters and their table region.
    pub fn apply(&mut self, services: &[ServiceConfig]) -> Result<(), DataplaneError> {
        let wanted: HashSet<&str> = services.iter().map(|s| s.name.as_str()).collect();
        let gone: Vec<String> = self.services.keys().filter(|n| !wanted.contains(n.as_str())).cloned().collect();
        for name in gone {
            self.remove_service(&name)?;
        }
        for s in services {
            self.apply_service(s)?;
        }
        self.sync_vip_addrs()
    }

    fn apply_service(&mut self, cfg: &ServiceConfig) -> Result<(), DataplaneError> {
        let key = VipKey {
            addr: u32::from(cfg.vip).to_be(),
            port: cfg.port.to_be(),
            proto: cfg.protocol.number(),
            _pad: 0,
        };
        let prev = self.services.get(&cfg.name).cloned();
        let id = match &prev {
            Some(p) => p.id,
            None => self.service_ids.alloc().ok_or(DataplaneError::Ids { what: "service" })?,
        };

        // Backend ids: keep the ids of backends that stay.
        let mut backends = Vec::with_capacity(cfg.backends.len());
        let mut fresh = Vec::new();
        let mut changed = Vec::new();
        for b in &cfg.backends {
            let existing = prev.as_ref().and_then(|p| {
                p.backends.iter().find(|o| o.config.address == b.address && o.config.port == b.port)
            });
            let bid = match existing {
                Some(o) => {
                    if o.config.weight != b.weight {
                        changed.push(o.id);
                        info!(service = %cfg.name, backend = %format!("{}:{}", b.address, b.port),
                              from = o.config.weight, to = b.weight, "weight changed");
                    }
                    o.id
                }
                None => {
                    let bid = match self.backend_ids.alloc() {
                        Some(bid) => bid,
                        None => {
                            for &f in &fresh {
                                self.backend_ids.release(f);
                            }
                            return Err(DataplaneError::Ids { what: "backend" });
                        }
                    };
                    fresh.push(bid);
                    bid
                }
            };
            backends.push(AppliedBackend { id: bid, config: b.clone() });
        }
        if !fresh.is_empty() {
            // Counters of a fresh id start from zero (the id may have served
            // a backend removed long ago).
            let mut conns: Array<&mut MapData, Conns> =
                Array::try_from(self.ebpf.map_mut("CONNS").expect("CONNS map")).map_err(map_err("CONNS"))?;
            for &bid in &fresh {
                conns.set(bid, Conns::default(), 0).map_err(map_err("CONNS"))?;
            }
            let mut expired: Array<&mut MapData, u64> =
                Array::try_from(self.ebpf.map_mut("EXPIRED").expect("EXPIRED map")).map_err(map_err("EXPIRED"))?;
            for &bid in &fresh {
                expired.set(bid, 0, 0).map_err(map_err("EXPIRED"))?;
            }
        }
        {
            let mut arr: Array<&mut MapData, Backend> =
                Array::try_from(self.ebpf.map_mut("BACKENDS").expect("BACKENDS map")).map_err(map_err("BACKENDS"))?;
            for b in backends.iter().filter(|b| fresh.contains(&b.id) || changed.contains(&b.id)) {
                let v = Backend {
                    addr: u32::from(b.config.address).to_be(),
                    port: b.config.port.to_be(),
                    _pad: 0,
                    service_id: id,
                    flags: 0,
                    weight: b.config.weight,
                    _pad2: 0,
                };
                arr.set(b.id, v, 0).map_err(map_err("BACKENDS"))?;
            }
        }
        if !fresh.is_empty() {
            let mut stats: PerCpuArray<&mut MapData, BackendStats> = PerCpuArray::try_from(
                self.ebpf.map_mut("BACKEND_STATS").expect("BACKEND_STATS map"),
            )
            .map_err(map_err("BACKEND_STATS"))?;
            for &bid in &fresh {
                let zero = PerCpuValues::try_from(vec![BackendStats::default(); self.ncpus])
                    .expect("one value per CPU");
                stats.set(bid, zero, 0).map_err(map_err("BACKEND_STATS"))?;
            }
        }

        let (scheduler, table) = build_table(cfg, &backends);
        let flags = if table.iter().all(|&b| b == lb_common::BACKEND_NONE) { SVC_F_NO_BACKEND } else { 0 };
        let region = match &prev {
            Some(p) if p.table == table => p.region,
            _ if table.is_empty() => None,
            _ => {
                let len = table.len() as u32;
                let off = self.regions.alloc(len).ok_or_else(|| DataplaneError::TableSpace {
                    service: cfg.name.clone(),
                    need: len,
                    capacity: self.table_capacity,
                })?;
                let mut sel: Array<&mut MapData, u32> =
                    Array::try_from(self.ebpf.map_mut("SELECT").expect("SELECT map")).map_err(map_err("SELECT"))?;
                for (i, &b) in table.iter().enumerate() {
                    sel.set(off + i as u32, b, 0).map_err(map_err("SELECT"))?;
                }
                Some((off, len))
            }
        };
        let value = Service {
            service_id: id,
            scheduler,
            table_off: region.map_or(0, |r| r.0),
            table_len: region.map_or(0, |r| r.1),
            flags,
            _pad: 0,
        };
        {
            let mut vips: BpfHashMap<&mut MapData, VipKey, Service> =
                BpfHashMap::try_from(self.ebpf.map_mut("VIPS").expect("VIPS map")).map_err(map_err("VIPS"))?;
            // The flip: one whole-value replace.
            vips.insert(key, value, 0).map_err(map_err("VIPS"))?;
            if let Some(p) = &prev
                && p.key != key
            {
                vips.remove(&p.key).map_err(map_err("VIPS"))?;
            }
        }
        if let Some(p) = &prev {
            if p.region != region
                && let Some((o, l)) = p.region
            {
                self.regions.free(o, l);
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
        self.services.insert(cfg.name.clone(), AppliedService { id, config: cfg.clone(), backends, key, region, table });
        Ok(())
    }

    fn remove_service(&mut self, name: &str) -> Result<(), DataplaneError> {
        let Some(s) = self.services.remove(name) else { return Ok(()) };
        let mut vips: BpfHashMap<&mut MapData, VipKey, Service> =
            BpfHashMap::try_from(self.ebpf.map_mut("VIPS").expect("VIPS map")).map_err(map_err("VIPS"))?;
        vips.remove(&s.key).map_err(map_err("VIPS"))?;
        if let Some((o, l)) = s.region {
            self.regions.free(o, l);
        }
        for b in &s.backends {
            self.backend_ids.release(b.id);
        }
        self.service_ids.release(s.id);
        info!(service = %name, "service removed");
        Ok(())
    }

    fn sync_vip_addrs(&mut self) -> Result<(), DataplaneError> {
        let want: HashSet<u32> = self.services.values().map(|s| s.key.addr).collect();
        let mut addrs: BpfHashMap<&mut MapData, u32, u32> =
            BpfHashMap::try_from(self.ebpf.map_mut("VIP_ADDRS").expect("VIP_ADDRS map")).map_err(map_err("VIP_ADDRS"))?;
        let have: Vec<u32> = addrs.keys().filter_map(Result::ok).collect();
        for a in &have {
            if !want.contains(a) {
                addrs.remove(a).map_err(map_err("VIP_ADDRS"))?;
            }
        }
        for a in want {
            if !have.contains(&a) {
                addrs.insert(a, 1, 0).map_err(map_err("VIP_ADDRS"))?;
            }
        }
        Ok(())
    }

    /// Per-backend counters summed over CPUs.
    pub fn backend_stats(&self, id: u32) -> Result<BackendStats, DataplaneError> {
        let stats: PerCpuArray<&MapData, BackendStats> =
            PerCpuArray::try_from(self.ebpf.map("BACKEND_STATS").expect("BACKEND_STATS map"))
                .map_err(map_err("BACKEND_STATS"))?;
        let mut total = BackendStats::default();
        for v in stats.get(&id, 0).map_err(map_err("BACKEND_STATS"))?.iter() {
            total.add(v);
        }
        Ok(total)
    }

    /// Global counters (`lb_common::counter`) by name, summed over CPUs.
    pub fn counters(&self) -> Result<BTreeMap<String, u64>, DataplaneError> {
        let c: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map("COUNTERS").expect("COUNTERS map")).map_err(map_err("COUNTERS"))?;
        let mut out = BTreeMap::new();
        for (i, name) in counter::NAMES.iter().enumerate() {
            let v: u64 = c.get(&(i as u32), 0).map_err(map_err("COUNTERS"))?.iter().sum();
            out.insert((*name).to_owned(), v);
        }
        Ok(out)
    }

    /// Active flows of a backend: opened - closed - expired.
    pub fn active_flows(&self, id: u32) -> Result<u64, DataplaneError> {
        let conns: Array<&MapData, Conns> =
            Array::try_from(self.ebpf.map("CONNS").expect("CONNS map")).map_err(map_err("CONNS"))?;
        let expired: Array<&MapData, u64> =
            Array::try_from(self.ebpf.map("EXPIRED").expect("EXPIRED map")).map_err(map_err("EXPIRED"))?;
        let c = conns.get(&id, 0).map_err(map_err("CONNS"))?;
        let e = expired.get(&id, 0).map_err(map_err("EXPIRED"))?;
        Ok(c.opened.saturating_sub(c.closed).saturating_sub(e))
    }

    /// Expire idle flows: an open flow silent for longer than its
    /// protocol's idle timeout is removed (both entries) and counted as
    /// expired for its backend; a closed TCP flow is removed after
    /// `CLOSED_LINGER` seconds. `now` is in seconds of CLOCK_MONOTONIC_COARSE
    /// (see [`monotonic_coarse_secs`]).
    pub fn sweep(&mut self, now: u64, tcp_idle: u64, udp_idle: u64) -> Result<SweepReport, DataplaneError> {
        let mut report = SweepReport::default();
        let mut doomed: Vec<(FlowKey, FlowKey, Option<u32>)> = Vec::new();
        {
            let flows: BpfHashMap<&MapData, FlowKey, Flow> =
                BpfHashMap::try_from(self.ebpf.map("FLOWS").expect("FLOWS map")).map_err(map_err("FLOWS"))?;
            for item in flows.iter() {
                // Entries can vanish while we walk (LRU eviction): skip errors.
                let Ok((k, f)) = item else { continue };
                if f.dir != DIR_FORWARD {
                    continue;
                }
                report.scanned += 1;
                let idle = now.saturating_sub(f.last_seen);
                let reply = FlowKey {
                    src_addr: f.nat_addr,
                    dst_addr: k.src_addr,
                    src_port: f.nat_port,
                    dst_port: k.src_port,
                    proto: k.proto,
                    _pad: [0; 3],
                };
                let closed = k.proto == PROTO_TCP && flow_closed(f.state);
                if closed {
                    if idle > CLOSED_LINGER {
                        doomed.push((k, reply, None));
                    }
                } else {
                    let limit = if k.proto == PROTO_TCP { tcp_idle } else { udp_idle };
                    if idle > limit {
                        doomed.push((k, reply, Some(f.backend_id)));
                    }
                }
            }
        }
        let mut expired_by: HashMap<u32, u64> = HashMap::new();
        {
            let mut flows: BpfHashMap<&mut MapData, FlowKey, Flow> =
                BpfHashMap::try_from(self.ebpf.map_mut("FLOWS").expect("FLOWS map")).map_err(map_err("FLOWS"))?;
            for (k, reply, backend) in doomed {
                // Removing the forward entry first: if a packet raced us and
                // the entry is gone already, nothing is counted twice.
                if flows.remove(&k).is_ok() {
                    let _ = flows.remove(&reply);
                    report.removed += 1;
                    if let Some(b) = backend {
                        *expired_by.entry(b).or_default() += 1;
                        report.expired += 1;
                    }
                }
            }
        }
        if !expired_by.is_empty() {
            let mut expired: Array<&mut MapData, u64> =
                Array::try_from(self.ebpf.map_mut("EXPIRED").expect("EXPIRED map")).map_err(map_err("EXPIRED"))?;
            for (b, n) in expired_by {
                let cur = expired.get(&b, 0).map_err(map_err("EXPIRED"))?;
                expired.set(b, cur + n, 0).map_err(map_err("EXPIRED"))?;
            }
        }
        Ok(report)
    }

    /// Service ids by name, for callers that need to find a service's maps.
    pub fn service_ids(&self) -> HashMap<String, u32> {
        self.services.iter().map(|(n, s)| (n.clone(), s.id)).collect()
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        self.detach_all();
    }
}

/// Seconds a closed TCP flow's entries stay (late retransmissions, the
/// final ACK) before the sweeper removes them.
pub const CLOSED_LINGER: u64 = 60;

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    pub scanned: u64,
    pub removed: u64,
    pub expired: u64,
}

/// The datapath's idle clock: CLOCK_MONOTONIC_COARSE in whole seconds
/// (what `bpf_ktime_get_coarse_ns` reads).
pub fn monotonic_coarse_secs() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64
}

/// The datapath scheduler id and selection table for a service.
fn build_table(cfg: &ServiceConfig, backends: &[AppliedBackend]) -> (u32, Vec<u32>) {
    match cfg.scheduler {
        Scheduler::Maglev | Scheduler::SourceHash | Scheduler::LeastConn => {
            let input: Vec<maglev::MaglevBackend> = backends
                .iter()
                .map(|b| maglev::MaglevBackend {
                    id: b.id,
                    key: backend_key(b.config.address, b.config.port),
                    weight: b.config.weight,
                })
                .collect();
            let table = maglev::build(&input, cfg.table_size)
                .expect("table size and backend count were validated with the config");
            let sched = match cfg.scheduler {
                Scheduler::Maglev => SCHED_FLOW_HASH,
                Scheduler::SourceHash => SCHED_SOURCE_HASH,
                _ => SCHED_LEAST_CONN,
            };
            (sched, table)
        }
        Scheduler::Wrr | Scheduler::Rr => {
            let input: Vec<wrr::WrrBackend> =
                backends.iter().map(|b| wrr::WrrBackend { id: b.id, weight: b.config.weight }).collect();
            let seq = if cfg.scheduler == Scheduler::Wrr {
                wrr::sequence(&input, crate::config::MAX_WRR_CYCLE).expect("cycle length was validated with the config")
            } else {
                wrr::round_robin(&input)
            };
            (SCHED_SEQUENCE, seq)
        }
    }
}

/// A backend's identity for Maglev: its address and port, so the same
/// backend gets the same permutation on every agent and every restart.
pub fn backend_key(addr: Ipv4Addr, port: u16) -> u64 {
    (u64::from(u32::from(addr)) << 16) | u64::from(port)
}

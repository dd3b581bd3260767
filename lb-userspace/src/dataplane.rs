//! The one module that touches BPF maps: loads the XDP program, attaches it,
//! turns the desired pool into map contents and reads the counters back.
//!
//! A service's change goes live atomically: its new selection table is
//! written into a free region of the SELECT array while the old one keeps
//! serving, then the service's VIP entry (a hash-map value, replaced whole by
//! the kernel) is pointed at the new region. The old region is reused only
//! after a grace period, long after any packet that read the old entry is done.
//!
//! The datapath outlives lbd: maps and XDP links are pinned under the
//! configured `pin_path`. A new lbd adopts what it finds there (the flow
//! table, counters, backend ids and tables) and swaps in its own program
//! with a link update, so restarts and upgrades never stop forwarding. Only
//! a clean shutdown ([`Dataplane::shutdown`]) detaches and unpins.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, MapError, PerCpuArray, PerCpuValues},
    programs::{
        ProgramError, Xdp, XdpMode as AyaXdpMode,
        links::{FdLink, LinkError, PinnedLink},
        xdp::{XdpLink, XdpLinkId},
    },
    util::nr_cpus,
};
use lb_common::{
    BACKEND_F_DOWN, Backend, BackendStats, Conns, DIR_FORWARD, Flow, FlowKey, MAX_BACKENDS, MAX_SERVICES, PROTO_TCP,
    SCHED_FLOW_HASH, SCHED_LEAST_CONN, SCHED_SEQUENCE, SCHED_SOURCE_HASH, SVC_F_NO_BACKEND, Service, VipKey, counter,
    flow_closed,
};
use tracing::{info, warn};

use crate::{
    config::{BackendConfig, Config, Scheduler, ServiceConfig, XdpMode},
    maglev, netdev,
    paths::{self, Mode, PathReport},
    wrr,
};

/// The XDP program, built by build.rs and embedded in the binary.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-xdp"));

/// The benchmark programs (floor_pass, floor_tx, bench_harness), built by
/// build.rs next to the XDP program, for `lb-bench` (its own crate). Only a
/// binary that names it carries it: lbd and lbctl do not.
pub static BENCH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bench-floor"));

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
    #[error("{0}")]
    Bpffs(String),
    #[error("pinning {path}: {source}")]
    Pin { path: PathBuf, source: std::io::Error },
    #[error("XDP link {path}: {source}")]
    Link { path: PathBuf, source: LinkError },
    #[error("reading the network devices: {0}")]
    Netdev(#[from] crate::netdev::NetdevError),
    #[error("interface {0} does not exist")]
    NoInterface(String),
}

/// Maps that live in bpffs (everything but aya-log's ring buffer and the
/// program's read-only globals).
pub const PINNED_MAPS: &[&str] = &[
    "VIPS",
    "VIP_ADDRS",
    "ADDR_FILTER",
    "BACKENDS",
    "SELECT",
    "SEQ",
    "FLOWS",
    "BACKEND_STATS",
    "COUNTERS",
    "CONNS",
    "EXPIRED",
    "NETDEVS",
    "NETDEV_GEN",
];

/// The mode (and the reason it was chosen) of the XDP link pinned for
/// `iface` under `links_dir`, when there is one: a pinned link is adopted in
/// the mode it has. Its `.mode` file says which (an older lbd wrote only the
/// mode, and only native links).
fn saved_mode(links_dir: Option<&Path>, iface: &str) -> Option<(Mode, String)> {
    let link = links_dir?.join(iface);
    if !link.exists() {
        return None;
    }
    let saved = std::fs::read_to_string(link.with_extension("mode")).unwrap_or_default();
    let mode = Mode::parse(saved.lines().next().unwrap_or("")).unwrap_or(Mode::Native);
    Some((mode, saved.lines().nth(1).unwrap_or_default().to_owned()))
}

/// bpffs magic number (statfs f_type).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: valid C string and out-pointer.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a plain libc call with valid arguments; it has no other preconditions.
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

/// Make sure `pin` can be created on a bpf filesystem. The standard place,
/// /sys/fs/bpf, is mounted if it is not yet (as systemd and libbpf do);
/// anywhere else the operator (or the lab) mounts it.
fn ensure_bpffs(pin: &Path) -> Result<(), DataplaneError> {
    let mut base = pin.to_path_buf();
    while !base.exists() {
        if !base.pop() {
            break;
        }
    }
    if is_bpffs(&base) {
        return Ok(());
    }
    let std_dir = Path::new("/sys/fs/bpf");
    if pin.starts_with(std_dir) && base.starts_with("/sys") && std_dir.is_dir() {
        let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
        let (src, dst, ty) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
        // SAFETY: valid C strings; a plain mount(2).
        let rc = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), ty.as_ptr(), 0, std::ptr::null()) };
        if rc == 0 && is_bpffs(std_dir) {
            info!("mounted bpffs on /sys/fs/bpf");
            return Ok(());
        }
    }
    Err(DataplaneError::Bpffs(format!(
        "pin_path {} is not on a bpf filesystem (found {} without one); mount it first: mount -t bpf bpf <dir>",
        pin.display(),
        base.display()
    )))
}

/// What the agent decided for a backend on top of its configuration:
/// the weight the schedulers use (health, drain and slow start applied)
/// and whether it is down (its pinned flows are re-dispatched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendRuntime {
    pub weight: u32,
    pub down: bool,
}

impl BackendRuntime {
    /// Configuration only: drained backends weigh 0, nothing is down.
    pub fn admin(b: &BackendConfig) -> Self {
        Self { weight: b.admin_weight(), down: false }
    }
}

enum AttachedLink {
    /// Pinned in bpffs: survives us; detached only by unpinning.
    Pinned { fd: FdLink, path: PathBuf },
    /// Owned by the program object (unpinned data planes, for tests).
    Owned(XdpLinkId),
}

struct Attached {
    attachment: Attachment,
    link: AttachedLink,
}

/// A service found in adopted maps: its id, table region and backend ids.
#[derive(Clone, Debug)]
struct Adopted {
    service_id: u32,
    region: Option<(u32, u32)>,
    backends: Vec<(Ipv4Addr, u16, u32)>,
}

fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

/// Where XDP is attached and how.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Attachment {
    pub interface: String,
    pub mode: Mode,
    /// Why this mode (what `xdp_mode` asked, what `auto` found).
    #[serde(default)]
    pub reason: String,
}

/// One backend as programmed into the maps.
#[derive(Clone, Debug)]
pub struct AppliedBackend {
    pub id: u32,
    pub config: BackendConfig,
    pub runtime: BackendRuntime,
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

    /// Mark `[off, off + len)` as in use (a region found in adopted maps).
    fn reserve(&mut self, off: u32, len: u32) -> bool {
        let Some(i) = self.free.iter().position(|&(o, l)| o <= off && off + len <= o + l) else {
            return false;
        };
        let (o, l) = self.free.remove(i);
        if off > o {
            self.free.push((o, off - o));
        }
        if off + len < o + l {
            self.free.push((off + len, o + l - (off + len)));
        }
        self.free.sort_unstable();
        true
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

    fn reserve(&mut self, id: u32) -> bool {
        id > 0 && id < self.limit && self.used.insert(id)
    }
}

pub struct Dataplane {
    ebpf: Ebpf,
    attached: Vec<Attached>,
    /// bpffs directory of this datapath; None for a private, unpinned one.
    pin: Option<PathBuf>,
    /// Services found in adopted maps, not yet claimed by the config.
    adopted: HashMap<VipKey, Adopted>,
    services: BTreeMap<String, AppliedService>,
    service_ids: Ids,
    backend_ids: Ids,
    regions: Regions,
    table_capacity: u32,
    ncpus: usize,
    /// Every backend address programmed in this datapath's life (replies
    /// of flows to a removed backend still need the datapath).
    known_backends: HashSet<u32>,
    /// What ADDR_FILTER holds, word by word.
    filter: Vec<u64>,
    filter_written: bool,
    /// What NETDEVS holds, and the path report derived with it.
    netdevs: BTreeMap<u32, u32>,
    netdevs_written: bool,
    paths: Vec<PathReport>,
}

impl Dataplane {
    /// Load the program with its maps pinned under `config.pin_path`,
    /// adopting maps already pinned there (a previous lbd's datapath).
    /// Nothing is attached yet.
    pub fn load(config: &Config) -> Result<Self, DataplaneError> {
        Self::load_inner(config, Some(&config.pin_path))
    }

    /// Load a private datapath whose maps and links vanish with it (tests).
    pub fn load_unpinned(config: &Config) -> Result<Self, DataplaneError> {
        Self::load_inner(config, None)
    }

    /// True when a datapath is pinned at `pin` (a previous lbd left it).
    pub fn pinned_at(pin: &Path) -> bool {
        pin.join("maps").join("FLOWS").exists()
    }

    fn load_inner(config: &Config, pin: Option<&Path>) -> Result<Self, DataplaneError> {
        // Kernel-side log statements exist only on error paths; keep them at
        // warn and above unless asked (level numbers follow aya-log-common).
        let level: u8 = if tracing::enabled!(tracing::Level::DEBUG) { 4 } else { 2 };
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries("FLOWS", config.conntrack_max.saturating_mul(2))
            .map_max_entries("SELECT", config.table_capacity)
            .override_global("AYA_LOG_LEVEL", &level, false);
        let mut adopting = false;
        let maps_dir = pin.map(|p| p.join("maps"));
        if let (Some(pin), Some(maps_dir)) = (pin, &maps_dir) {
            ensure_bpffs(pin)?;
            adopting = Self::pinned_at(pin);
            std::fs::create_dir_all(maps_dir)
                .map_err(|source| DataplaneError::Pin { path: maps_dir.clone(), source })?;
            // A global-counter map pinned by an older version has fewer
            // slots than this program counts into: replace it (those
            // counters restart from 0; flows, tables and per-backend
            // counters are kept).
            let counters = maps_dir.join("COUNTERS");
            if let Ok(info) = aya::maps::MapInfo::from_pin(&counters)
                && info.max_entries() < counter::COUNT
            {
                warn!(
                    pinned = info.max_entries(),
                    needed = counter::COUNT,
                    "the pinned global-counter map predates this version: replaced, its counters restart from 0"
                );
                let _ = std::fs::remove_file(&counters);
            }
            for name in PINNED_MAPS {
                loader.map_pin_path(name, maps_dir.join(name));
            }
        }
        let mut ebpf = loader.load(EBPF_OBJECT)?;
        let prog: &mut Xdp = ebpf.program_mut(PROGRAM).ok_or(ProgramError::NotLoaded)?.try_into()?;
        prog.load()?;
        let ncpus = nr_cpus().map_err(|(_, e)| DataplaneError::Cpus(e))?;
        let mut dp = Self {
            ebpf,
            attached: Vec::new(),
            pin: pin.map(Path::to_path_buf),
            adopted: HashMap::new(),
            services: BTreeMap::new(),
            service_ids: Ids::new(MAX_SERVICES),
            backend_ids: Ids::new(MAX_BACKENDS),
            regions: Regions::new(config.table_capacity),
            table_capacity: config.table_capacity,
            ncpus,
            known_backends: HashSet::new(),
            filter: vec![0; (lb_common::ADDR_FILTER_BITS / 64) as usize],
            filter_written: false,
            netdevs: BTreeMap::new(),
            netdevs_written: false,
            paths: Vec::new(),
        };
        if adopting {
            dp.adopt()?;
        }
        Ok(dp)
    }

    /// Rebuild what the pinned maps already hold: services by VIP key with
    /// their ids and table regions, backends with their ids, so that the
    /// first `apply` keeps ids (and so counters) and frees nothing in use.
    fn adopt(&mut self) -> Result<(), DataplaneError> {
        let mut found: HashMap<VipKey, Adopted> = HashMap::new();
        {
            let vips: BpfHashMap<&MapData, VipKey, Service> =
                BpfHashMap::try_from(self.ebpf.map("VIPS").expect("VIPS map")).map_err(map_err("VIPS"))?;
            for item in vips.iter() {
                let (k, v) = item.map_err(map_err("VIPS"))?;
                let region = (v.table_len > 0).then_some((v.table_off, v.table_len));
                found.insert(k, Adopted { service_id: v.service_id, region, backends: Vec::new() });
            }
        }
        let by_service: HashMap<u32, VipKey> = found.iter().map(|(k, a)| (a.service_id, *k)).collect();
        {
            let arr: Array<&MapData, Backend> =
                Array::try_from(self.ebpf.map("BACKENDS").expect("BACKENDS map")).map_err(map_err("BACKENDS"))?;
            for id in 1..MAX_BACKENDS {
                let b = arr.get(&id, 0).map_err(map_err("BACKENDS"))?;
                if b.addr == 0 {
                    continue;
                }
                self.known_backends.insert(b.addr);
                if let Some(key) = by_service.get(&b.service_id) {
                    let a = found.get_mut(key).expect("indexed above");
                    a.backends.push((Ipv4Addr::from(u32::from_be(b.addr)), u16::from_be(b.port), id));
                }
            }
        }
        for a in found.values() {
            self.service_ids.reserve(a.service_id);
            if let Some((o, l)) = a.region {
                self.regions.reserve(o, l);
            }
            for &(_, _, id) in &a.backends {
                self.backend_ids.reserve(id);
            }
        }
        info!(services = found.len(), "adopted the pinned datapath (flow table and counters kept)");
        self.adopted = found;
        Ok(())
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

    /// Attach to every interface, each in the mode [`paths::choose_mode`]
    /// picks from what the devices can do (`auto`), or as forced. Where a
    /// pinned link from a previous lbd exists, the program is swapped in
    /// atomically (link update) instead, keeping its mode. The NETDEVS map
    /// is filled first, so the first packet already knows its paths. On
    /// error, interfaces attached here are detached again.
    pub fn attach(&mut self, interfaces: &[String], requested: XdpMode) -> Result<(), DataplaneError> {
        let links_dir = self.pin.as_ref().map(|p| p.join("links"));
        if let Some(d) = &links_dir {
            std::fs::create_dir_all(d).map_err(|source| DataplaneError::Pin { path: d.clone(), source })?;
            // Interfaces no longer configured: unpinning detaches them.
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let iface = name.strip_suffix(".mode").unwrap_or(&name);
                    if !interfaces.iter().any(|i| i == iface) {
                        let _ = std::fs::remove_file(e.path());
                        if !name.ends_with(".mode") {
                            info!(interface = %iface, "detached (no longer configured)");
                        }
                    }
                }
            }
        }
        let links = netdev::links()?;
        let find = |name: &str| {
            links.iter().find(|l| l.name == name).ok_or_else(|| DataplaneError::NoInterface(name.to_owned()))
        };
        let mut plan: Vec<(String, Mode, String)> = Vec::new();
        for iface in interfaces {
            let egresses: Vec<&netdev::Link> =
                paths::egresses_of(iface, interfaces).into_iter().map(find).collect::<Result<_, _>>()?;
            let (mut mode, reason) = paths::choose_mode(requested, find(iface)?, &egresses);
            // A pinned link is adopted in the mode it has: plan with that one.
            if let Some((saved, _)) = saved_mode(links_dir.as_deref(), iface) {
                mode = saved;
            }
            if requested == XdpMode::Native {
                for c in paths::native_caveats(&egresses) {
                    warn!(interface = %iface, "xdp_mode native: {c}");
                }
            }
            plan.push((iface.clone(), mode, reason));
        }
        let planned: BTreeMap<String, Mode> = plan.iter().map(|(i, m, _)| (i.clone(), *m)).collect();
        self.write_netdevs(&paths::netdev_flags(&links, &planned))?;
        let mut done: Vec<Attached> = Vec::new();
        let mut result = Ok(());
        for (iface, mode, reason) in plan {
            match self.attach_one(&iface, mode, requested, reason, links_dir.as_deref()) {
                Ok(a) => done.push(a),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_err() {
            for a in done.drain(..) {
                self.detach_one(a);
            }
        }
        self.attached.extend(done);
        result?;
        self.refresh_paths().map(drop)
    }

    fn attach_one(
        &mut self,
        iface: &str,
        mode: Mode,
        requested: XdpMode,
        reason: String,
        links_dir: Option<&Path>,
    ) -> Result<Attached, DataplaneError> {
        let prog: &mut Xdp = self.ebpf.program_mut(PROGRAM).ok_or(ProgramError::NotLoaded)?.try_into()?;
        let pin_path = links_dir.map(|d| d.join(iface));
        if let Some(path) = pin_path.as_ref().filter(|p| p.exists()) {
            // Adopt: replace the program behind the existing link.
            let link_err = |source| DataplaneError::Link { path: path.clone(), source };
            let pinned = PinnedLink::from_pin(path).map_err(link_err)?;
            let xdp = XdpLink::try_from(FdLink::from(pinned)).map_err(link_err)?;
            let id = prog.attach_to_link(xdp)?;
            let fd = FdLink::try_from(prog.take_link(id)?).map_err(link_err)?;
            let (mode, reason) = saved_mode(links_dir, iface).unwrap_or((Mode::Native, String::new()));
            info!(interface = %iface, mode = mode.name(), "XDP program replaced on the pinned link");
            return Ok(Attached {
                attachment: Attachment { interface: iface.to_owned(), mode, reason },
                link: AttachedLink::Pinned { fd, path: path.clone() },
            });
        }
        let try_mode = |prog: &mut Xdp, m: Mode| {
            let aya_mode = match m {
                Mode::Native => AyaXdpMode::Driver,
                Mode::Generic => AyaXdpMode::Skb,
            };
            prog.attach(iface, aya_mode).map_err(|source| DataplaneError::Attach {
                iface: iface.to_owned(),
                mode: m.name(),
                source,
            })
        };
        let (id, mode, reason) = match (mode, requested) {
            (Mode::Native, XdpMode::Auto) => match try_mode(prog, Mode::Native) {
                Ok(id) => (id, Mode::Native, reason),
                Err(e) => {
                    warn!(interface = %iface, error = %e, "native XDP attach failed; falling back to generic mode");
                    (try_mode(prog, Mode::Generic)?, Mode::Generic, format!("auto: native attach failed ({e})"))
                }
            },
            (m, _) => (try_mode(prog, m)?, m, reason),
        };
        info!(interface = %iface, mode = mode.name(), reason = %reason, "XDP attached");
        let attachment = Attachment { interface: iface.to_owned(), mode, reason: reason.clone() };
        let Some(path) = pin_path else {
            return Ok(Attached { attachment, link: AttachedLink::Owned(id) });
        };
        let link_err = |source| DataplaneError::Link { path: path.clone(), source };
        let fd = FdLink::try_from(prog.take_link(id)?).map_err(link_err)?;
        let pinned = fd
            .pin(&path)
            .map_err(|e| DataplaneError::Pin { path: path.clone(), source: std::io::Error::other(e.to_string()) })?;
        let _ = std::fs::write(path.with_extension("mode"), format!("{}\n{reason}\n", mode.name()));
        Ok(Attached { attachment, link: AttachedLink::Pinned { fd: FdLink::from(pinned), path } })
    }

    /// Re-read the network devices and bring NETDEVS (which egress takes
    /// which path) up to date: at attach, and periodically, since a
    /// device's abilities change at run time (a veth peer's GRO or XDP, a
    /// bridge port added, a link going down). Every path that changes is
    /// logged, one line per ingress and egress. Returns whether anything
    /// changed.
    pub fn refresh_paths(&mut self) -> Result<bool, DataplaneError> {
        let links = netdev::links()?;
        let modes: BTreeMap<String, Mode> =
            self.attached.iter().map(|a| (a.attachment.interface.clone(), a.attachment.mode)).collect();
        self.write_netdevs(&paths::netdev_flags(&links, &modes))?;
        let rows = paths::report(&links, &modes);
        let mut changed = false;
        for r in &rows {
            if self.paths.iter().any(|old| old == r) {
                continue;
            }
            changed = true;
            let path = r.path.describe();
            match r.path {
                paths::Path::XdpRedirect => {
                    info!(ingress = %r.ingress, mode = r.mode.name(), egress = %r.egress, path, reason = %r.reason, "forwarding path")
                }
                paths::Path::Kernel => {
                    warn!(ingress = %r.ingress, mode = r.mode.name(), egress = %r.egress, path, reason = %r.reason, "forwarding path")
                }
            }
        }
        self.paths = rows;
        Ok(changed)
    }

    /// The current path report (see [`refresh_paths`](Self::refresh_paths)).
    pub fn paths(&self) -> &[PathReport] {
        &self.paths
    }

    /// Make NETDEVS hold exactly `flags` (ifindex -> `NETDEV_F_*`).
    pub fn write_netdevs(&mut self, flags: &BTreeMap<u32, u32>) -> Result<(), DataplaneError> {
        if self.netdevs_written && &self.netdevs == flags {
            return Ok(());
        }
        let mut map: BpfHashMap<&mut MapData, u32, u32> =
            BpfHashMap::try_from(self.ebpf.map_mut("NETDEVS").expect("NETDEVS map")).map_err(map_err("NETDEVS"))?;
        let have: Vec<u32> = map.keys().filter_map(Result::ok).collect();
        for (&i, &f) in flags {
            map.insert(i, f, 0).map_err(map_err("NETDEVS"))?;
        }
        for i in have {
            if !flags.contains_key(&i) {
                map.remove(&i).map_err(map_err("NETDEVS"))?;
            }
        }
        // Every cached next hop was checked against the old contents.
        let mut generation: Array<&mut MapData, u32> =
            Array::try_from(self.ebpf.map_mut("NETDEV_GEN").expect("NETDEV_GEN map")).map_err(map_err("NETDEV_GEN"))?;
        let g = generation.get(&0, 0).map_err(map_err("NETDEV_GEN"))?;
        generation.set(0, g.wrapping_add(1), 0).map_err(map_err("NETDEV_GEN"))?;
        self.netdevs = flags.clone();
        self.netdevs_written = true;
        Ok(())
    }

    fn detach_one(&mut self, a: Attached) {
        match a.link {
            AttachedLink::Pinned { fd, path } => {
                // Dropping the last reference (pin file and our fd) detaches.
                if let Err(e) = std::fs::remove_file(&path) {
                    warn!(interface = %a.attachment.interface, error = %e, "unpinning the XDP link");
                }
                let _ = std::fs::remove_file(path.with_extension("mode"));
                drop(fd);
            }
            AttachedLink::Owned(id) => {
                if let Some(prog) = self.ebpf.program_mut(PROGRAM).and_then(|p| <&mut Xdp>::try_from(p).ok())
                    && let Err(e) = prog.detach(id)
                {
                    warn!(interface = %a.attachment.interface, error = %e, "XDP detach failed");
                }
            }
        }
        info!(interface = %a.attachment.interface, "XDP detached");
    }

    /// Detach from every interface and unpin everything: the clean stop.
    /// The datapath is gone afterwards.
    pub fn shutdown(&mut self) {
        for a in std::mem::take(&mut self.attached) {
            self.detach_one(a);
        }
        if let Some(pin) = &self.pin {
            for name in PINNED_MAPS {
                let _ = std::fs::remove_file(pin.join("maps").join(name));
            }
            for d in [pin.join("maps"), pin.join("links"), pin.clone()] {
                if let Err(e) = std::fs::remove_dir(&d)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn!(path = %d.display(), error = %e, "removing pin directory");
                }
            }
            info!(path = %pin.display(), "unpinned the datapath");
        }
    }

    /// The XDP program's kernel id (changes when a new program is swapped in).
    pub fn program_id(&self) -> Option<u32> {
        self.program().info().ok().map(|i| i.id())
    }

    pub fn attachments(&self) -> Vec<Attachment> {
        self.attached.iter().map(|a| a.attachment.clone()).collect()
    }

    pub fn services(&self) -> impl Iterator<Item = &AppliedService> {
        self.services.values()
    }

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
        let mut addrs: HashSet<u32> = self.services.values().map(|s| s.key.addr).collect();
        for s in services {
            addrs.insert(u32::from(s.vip).to_be());
            for b in &s.backends {
                self.known_backends.insert(u32::from(b.address).to_be());
            }
        }
        addrs.extend(self.known_backends.iter().copied());
        self.write_filter(&addrs)?;
        for s in services {
            self.apply_service(s, runtime)?;
        }
        // Adopted services the config no longer has.
        for (key, a) in std::mem::take(&mut self.adopted) {
            let mut vips: BpfHashMap<&mut MapData, VipKey, Service> =
                BpfHashMap::try_from(self.ebpf.map_mut("VIPS").expect("VIPS map")).map_err(map_err("VIPS"))?;
            let _ = vips.remove(&key);
            if let Some((o, l)) = a.region {
                self.regions.free(o, l);
            }
            for (_, _, id) in a.backends {
                self.backend_ids.release(id);
            }
            self.service_ids.release(a.service_id);
        }
        self.sync_vip_addrs()
    }

    /// [`apply`](Self::apply) with configuration-only weights.
    pub fn apply_admin(&mut self, services: &[ServiceConfig]) -> Result<(), DataplaneError> {
        self.apply(services, &|_, b| BackendRuntime::admin(b))
    }

    fn apply_service(
        &mut self,
        cfg: &ServiceConfig,
        runtime: &dyn Fn(&ServiceConfig, &BackendConfig) -> BackendRuntime,
    ) -> Result<(), DataplaneError> {
        let key =
            VipKey { addr: u32::from(cfg.vip).to_be(), port: cfg.port.to_be(), proto: cfg.protocol.number(), _pad: 0 };
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
            backends.push(AppliedBackend { id: bid, config: b.clone(), runtime: rt });
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
                    flags: if b.runtime.down { BACKEND_F_DOWN } else { 0 },
                    weight: b.runtime.weight,
                    _pad2: 0,
                };
                arr.set(b.id, v, 0).map_err(map_err("BACKENDS"))?;
            }
        }
        if !fresh.is_empty() {
            let mut stats: PerCpuArray<&mut MapData, BackendStats> =
                PerCpuArray::try_from(self.ebpf.map_mut("BACKEND_STATS").expect("BACKEND_STATS map"))
                    .map_err(map_err("BACKEND_STATS"))?;
            for &bid in &fresh {
                let zero =
                    PerCpuValues::try_from(vec![BackendStats::default(); self.ncpus]).expect("one value per CPU");
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
        self.services
            .insert(cfg.name.clone(), AppliedService { id, config: cfg.clone(), backends, key, region, table });
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

    /// Make ADDR_FILTER hold exactly `addrs` (network order), writing only
    /// the words that change.
    fn write_filter(&mut self, addrs: &HashSet<u32>) -> Result<(), DataplaneError> {
        let mut words = vec![0u64; self.filter.len()];
        for &a in addrs {
            let bit = lb_common::addr_filter_bit(a);
            words[(bit / 64) as usize] |= 1u64 << (bit % 64);
        }
        let mut arr: Array<&mut MapData, u64> =
            Array::try_from(self.ebpf.map_mut("ADDR_FILTER").expect("ADDR_FILTER map"))
                .map_err(map_err("ADDR_FILTER"))?;
        for (i, (&new, old)) in words.iter().zip(self.filter.iter_mut()).enumerate() {
            // The first write after (re)loading goes out whole: an adopted
            // map may hold bits this process has not recorded.
            if new != *old || !self.filter_written {
                arr.set(i as u32, new, 0).map_err(map_err("ADDR_FILTER"))?;
                *old = new;
            }
        }
        self.filter_written = true;
        Ok(())
    }

    fn sync_vip_addrs(&mut self) -> Result<(), DataplaneError> {
        let mut all: HashSet<u32> = self.services.values().map(|s| s.key.addr).collect();
        all.extend(self.known_backends.iter().copied());
        self.write_filter(&all)?;
        let want: HashSet<u32> = self.services.values().map(|s| s.key.addr).collect();
        let mut addrs: BpfHashMap<&mut MapData, u32, u32> =
            BpfHashMap::try_from(self.ebpf.map_mut("VIP_ADDRS").expect("VIP_ADDRS map"))
                .map_err(map_err("VIP_ADDRS"))?;
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
                report.entries += 1;
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
}

impl Drop for Dataplane {
    /// A pinned datapath stays in place (lbd stopping without `shutdown`,
    /// e.g. to restart); an unpinned one goes with its program object.
    fn drop(&mut self) {}
}

/// Seconds a closed TCP flow's entries stay (late retransmissions, the
/// final ACK) before the sweeper removes them.
pub const CLOSED_LINGER: u64 = 60;

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Entries in the flow table (both directions).
    pub entries: u64,
    /// Forward entries looked at.
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
                    weight: b.runtime.weight,
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
                backends.iter().map(|b| wrr::WrrBackend { id: b.id, weight: b.runtime.weight }).collect();
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

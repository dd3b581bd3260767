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
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{IterableMap as _, MapData, MapError, PerCpuArray, PerCpuValues},
    programs::{Program, ProgramError, Xdp, links::LinkError},
    util::nr_cpus,
};
use lb_common::{
    BACKEND_F_V6, BackendStats, Flood, Flow, Flow6, FlowBucket, FlowBucket6, FlowKey, FlowKey6, LAYOUT_VERSION,
    MAX_BACKENDS, MAX_SERVICES, SELECT_LANES, SLOT_BUCKET, SLOT_EMPTY, SLOT_MATCH, SLOT_PROBES, SLOT_READY, SLOT_STATE,
    SLOT_TAG, SWEEP_BY_KEY, SWEEP_PROGRAM, Slot, SlotKey, SweepItem, SweepItem6, TAIL_CALLS, counter, flow_slots,
    maps as names, select_elements, select_slot,
};
use tracing::{info, warn};

use crate::{
    config::{BackendConfig, Config, FloodConfig, ServiceConfig},
    paths::{Mode, PathReport},
};

mod alloc;
mod attach;
mod batch;
mod endpoints;
mod flows;
mod layout;
mod maps;
mod memcg;
mod pin;
mod program;
mod sweep;
mod sys;

use alloc::{Ids, Regions};
use attach::Attached;
pub use endpoints::words6;
use flows::{Buckets, FlowTable};
pub use flows::{FLOW_ARRAY_NAME, FLOW_ARRAY_NAME6, fill_arrays, small_vmalloc_arrays};
use maps::{Maps, SelectMemory, map_err};
pub use sweep::{CLOSED_LINGER, DSR_FIN_TIMEOUT, Inserted, SweepReport, SweepRun, monotonic_coarse_secs};

/// The XDP program, built by build.rs and embedded in the binary.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-xdp"));

/// Empty a hash map with the flow table's key and value (`fd`; lb-bench's
/// own tables, `FLOW_TABLE` and `FLOW_LRU` of `BENCH_OBJECT`) in batches.
/// Returns the entries removed.
pub fn drain_flow_map(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u64> {
    batch::drain::<FlowKey, Flow>(fd)
}

/// Delete `keys` from a hash map with the flow table's key (`fd`: one of
/// lb-bench's own tables), in batches; returns how many of them were
/// there. For benchmarks, which take a run's new flows out again.
pub fn delete_flow_keys(fd: std::os::fd::BorrowedFd<'_>, keys: &[FlowKey]) -> std::io::Result<u64> {
    Ok(batch::delete(fd, keys)?.iter().filter(|&&removed| removed).count() as u64)
}

/// Put the maps `inner` (their descriptors) in the array of maps `fd` from
/// index `first` on, in one BPF_MAP_UPDATE_BATCH: each single update of an
/// array of maps waits for an RCU grace period (about 9 ms here), a batch
/// waits once. For lb-bench's own tables.
pub fn set_inner_maps(
    fd: std::os::fd::BorrowedFd<'_>,
    first: u32,
    inner: &[std::os::fd::BorrowedFd<'_>],
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let keys: Vec<u32> = (first..).take(inner.len()).collect();
    let values: Vec<u32> = inner.iter().map(|f| f.as_raw_fd() as u32).collect();
    batch::update(fd, &keys, &values)
}

/// The benchmark programs (floor_pass, floor_tx, floor_table, bench_harness), built by
/// build.rs next to the XDP program, for `lb-bench` (its own crate). Only a
/// binary that names it carries it: lbd and lbctl do not.
pub static BENCH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bench-floor"));

/// Name of the XDP entry point in the object.
pub const PROGRAM: &str = "lb_xdp";
/// Name of the tc ingress program beside it on every interface in generic
/// mode, which sends on the GSO packets of DSR services
/// (`lb_common::TcHandoff`; see `attach::attach_tc`).
pub const TC_PROGRAM: &str = "lb_tc";

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("loading the XDP program into the kernel: {0}")]
    Load(#[from] aya::EbpfError),
    #[error(
        "creating BPF map {map}: the kernel could not allocate it. {tables}: lower them, or give the machine (or lbd's memory cgroup) more memory: {source}"
    )]
    Memory { map: String, tables: TableMemory, source: std::io::Error },
    #[error(
        "{tables}; with about {} MB for lbd itself beside them (its copies of the services' selection tables \
         included), that is more than lbd's memory cgroup {} leaves: about {} MB free of its {} MB limit ({}). \
         Lower them, or raise the cgroup's limit; nothing was created",
        tables.own / 1_000_000, cgroup.cgroup, cgroup.free / 1_000_000, cgroup.limit / 1_000_000,
        cgroup.file
    )]
    Cgroup { tables: TableMemory, cgroup: memcg::Limit },
    #[error("XDP program: {0}")]
    Program(#[from] ProgramError),
    #[error("BPF map {map}: {source}")]
    Map { map: &'static str, source: MapError },
    #[error("BPF map {map}, batch operation: {source}")]
    Batch { map: &'static str, source: std::io::Error },
    #[error("BPF map {map}, removing expired flows (lb_sweep through BPF_PROG_TEST_RUN): {source}")]
    Sweep { map: &'static str, source: std::io::Error },
    #[error("attaching XDP to {iface} in {mode} mode{}: {source}", attach::hint(*mode, source))]
    Attach { iface: String, mode: Mode, source: ProgramError },
    #[error("the selection-table array ({capacity} entries) has no free run of {need} entries for service {service}")]
    TableSpace { service: String, need: u32, capacity: u32 },
    #[error("no free {what} id left")]
    Ids { what: &'static str },
    #[error("reading CPU count: {0}")]
    Cpus(std::io::Error),
    #[error("drawing the flow tables' hash seed (getrandom): {0}")]
    Random(std::io::Error),
    #[error("{0}")]
    Bpffs(String),
    #[error(
        "another lbd runs the datapath pinned at {0} (it holds the lock on that directory): stop it first, or give this lbd a pin_path and control_socket of its own"
    )]
    InUse(PathBuf),
    #[error("pinning {path}: {source}")]
    Pin { path: PathBuf, source: std::io::Error },
    #[error("XDP link {path}: {source}")]
    Link { path: PathBuf, source: LinkError },
    #[error("reading the network devices: {0}")]
    Netdev(#[from] crate::netdev::NetdevError),
    #[error("interface {0} does not exist")]
    NoInterface(String),
    #[error(
        "{iface} already runs an XDP program ({program}) that is not the datapath pinned at {pin}. If it is the \
         datapath of an lbd with another pin_path (was pin_path changed?), set pin_path back to that one, or stop \
         that datapath first (SIGTERM to the lbd running it, or remove its pins); otherwise another XDP user holds \
         {iface}. Nothing was attached"
    )]
    Taken { iface: String, program: String, pin: String },
    #[error("{0}")]
    Layout(String),
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

/// A service found in adopted maps: its id, table region and backend ids.
#[derive(Clone, Debug)]
struct Adopted {
    service_id: u32,
    region: Option<(u32, u32)>,
    /// The consistent-hash fallback table's, when it is not `region`.
    fallback_region: Option<(u32, u32)>,
    backends: Vec<(IpAddr, u16, u32)>,
}

/// Where XDP is attached and how.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Attachment {
    pub interface: String,
    pub mode: Mode,
    /// Why this mode (what `xdp_mode` asked, what `auto` found).
    #[serde(default)]
    pub reason: String,
    /// The program is not on the interface: the device is gone (deleted,
    /// or moved to another namespace), or it came back and attaching to
    /// it again failed. lbd attaches again when a device of that name is
    /// there (checked every second).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub missing: bool,
    /// The tc ingress link that takes DSR services' GSO packets from the
    /// XDP program (interfaces in generic mode; see `attach_tc`). None:
    /// the interface has none, as in native mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tc: Option<TcLink>,
}

/// An interface's tc ingress link (`Attachment::tc`).
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TcLink {
    /// Pinned under the pin directory: it stays while lbd is down.
    Pinned,
    /// lbd's own (no pin directory, or the pin failed): it goes when lbd
    /// exits.
    Owned,
    /// It could not be attached (a kernel without TCX): those packets are
    /// dropped.
    Failed,
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
    key: endpoints::Key,
    region: Option<(u32, u32)>,
    /// The selection table as written in its region (16-bit ids).
    table: Vec<u16>,
    /// The consistent-hash fallback table, for schedulers whose own table
    /// is not one (see `Scheduler::fallback_len`), and where it is.
    fallback_region: Option<(u32, u32)>,
    fallback: Vec<u16>,
    /// The `maglev_seed` both tables were built with.
    seed: u64,
    /// Whether its flows were given reply entries (`SVC_F_REPLY_ENTRY`).
    reply_entry: bool,
}

pub struct Dataplane {
    ebpf: Ebpf,
    /// Every map, taken out of `ebpf` at load.
    maps: Maps,
    /// SELECT mapped into memory (None: an old pinned map, written by syscall).
    select_memory: Option<SelectMemory>,
    attached: Vec<Attached>,
    /// The interfaces the tc program (`TC_PROGRAM`) was attached to, or
    /// tried, with the device's ifindex then and how it went (see
    /// `attach_tc`).
    tc: BTreeMap<String, (u32, TcLink)>,
    /// bpffs directory of this datapath; None for a private, unpinned one.
    pin: Option<PathBuf>,
    /// Services found in adopted maps, not yet claimed by the config.
    adopted: HashMap<endpoints::Key, Adopted>,
    services: BTreeMap<String, AppliedService>,
    service_ids: Ids,
    backend_ids: Ids,
    regions: Regions,
    table_capacity: u32,
    ncpus: usize,
    /// Every backend address programmed in this datapath's life (replies
    /// of flows to a removed backend still need the datapath).
    known_backends: HashSet<IpAddr>,
    /// What ADDR_FILTER holds; None until this process first wrote it.
    filter: Option<Box<lb_common::AddrFilter>>,
    /// What REPLY_HINT holds; None until this process first wrote it.
    reply_hint: Option<Box<lb_common::ReplyHint>>,
    /// What ENDPOINTS holds.
    endpoints: HashMap<endpoints::Key, endpoints::Key>,
    /// What NETDEVS holds, and the path report derived with it.
    netdevs: BTreeMap<u32, u32>,
    netdevs_written: bool,
    paths: Vec<PathReport>,
    /// Flood protection in force (`set_flood`).
    flood: FloodConfig,
    /// The `maglev_seed` the next `apply` builds tables with
    /// (`set_maglev_seed`).
    maglev_seed: u64,
    /// The entry limits in force (the adopted tables' sizes when they
    /// differ from the config's): IPv4's and IPv6's.
    conntrack_max: u32,
    conntrack_max_ipv6: u32,
    /// The flow tables' slot-hash seed (the program's `FLOW_HASH_SEED`).
    flow_seed: u64,
    /// Reply entries that no forward entry named when the last sweep
    /// read them, by slot, with their key and claim (IPv4, IPv6): removed
    /// when the next sweep finds them so again (`sweep.rs`).
    orphans: (sweep::Orphans<FlowKey>, sweep::Orphans<FlowKey6>),
    /// A migration from an older pinned layout, finished after attaching.
    migration: Option<layout::Migration>,
    /// The older layout of the pinned datapath this one took up in place
    /// (`lb_common::LAYOUT_IN_PLACE_FROM`), given back if it never swaps
    /// its program in.
    taken_up_from: Option<u32>,
    /// Whether this process swapped its program into a link a previous
    /// lbd pinned (from then on the running datapath is this build's).
    swapped: bool,
    /// What the last `attach` was given: the interfaces and the mode
    /// asked for (to attach again to an interface that was replaced).
    interfaces: Vec<String>,
    requested: crate::config::XdpMode,
    /// While migrating: until when (coarse seconds) the datapath holds
    /// TCP packets without an entry (see `lb_common::Flood::hold_until`).
    hold_until: u32,
    /// The lock on the pin directory (`pin::lock`), held while this
    /// process runs the datapath; None for an unpinned one.
    _pin_lock: Option<std::os::fd::OwnedFd>,
}

/// Kernel memory per array of a flow table (IPv4 and IPv6: the tables
/// have `flow_arrays` of their slots' arrays, allocated in full): 30 KB
/// of elements and the array's header, which kmalloc (or vmalloc, should
/// kmalloc find no free 32 KB) hands out as 32 KB; and per
/// selection-table entry, the selection table as `bpftool map` reported
/// it on kernel 6.18 (2,101,248 bytes for 1,048,576 entries, four to an
/// 8-byte element).
const FLOW_ARRAY_BYTES: u64 = lb_common::KMALLOC_ARRAY_MAX as u64;
const SELECT_BYTES: u64 = 2;

/// The entries the selection tables may take in SELECT: the config's
/// `table_capacity` when the array was made for it. Otherwise the array
/// was adopted from an lbd that ran with another size: said once, as a
/// warning, and all its elements' entries are what counts.
fn adopted_select(map: &MapData, configured: u32) -> Result<u32, DataplaneError> {
    let elements = map.info().map_err(map_err(names::SELECT))?.max_entries();
    if elements == select_elements(configured) {
        return Ok(configured);
    }
    let size = elements.saturating_mul(SELECT_LANES);
    warn!(
        map = names::SELECT,
        entries = size,
        "the adopted SELECT map has {size} entries, the config's table_capacity says {configured}: it keeps {size} until a clean stop (SIGTERM) and a fresh start"
    );
    Ok(size)
}

/// The entries a flow table of `slots` slots may hold: the config's
/// `conntrack_max` when the table was made for it, otherwise (a table
/// adopted from an lbd that ran with another size) half its slots. The
/// datapath's `FLOW_LIMIT` and lbd's reports both follow this.
fn flow_limit(slots: u32, configured: u32) -> u32 {
    if slots == flow_slots(configured) { configured } else { slots / 2 }
}

/// 64 random bits from the kernel (getrandom(2)), for a new flow table's
/// hash seed.
fn random_seed() -> Result<u64, DataplaneError> {
    let mut b = [0u8; 8];
    let mut filled = 0;
    while filled < b.len() {
        filled += rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(|e| DataplaneError::Random(e.into()))?;
    }
    Ok(u64::from_ne_bytes(b))
}

/// A slot's index and contents.
type Found<K, V> = Option<(u32, Slot<K, V>)>;

/// `key`'s slot in the flow table `table` and its contents, found as the
/// datapath finds it (`lb-ebpf/src/table.rs`), a few syscalls per element
/// read.
fn find_slot<K: SlotKey + aya::Pod, V: aya::Pod>(
    table: &FlowTable<[Slot<K, V>; SLOT_BUCKET as usize]>,
    seed: u64,
    key: &K,
) -> Result<Found<K, V>, DataplaneError>
where
    [Slot<K, V>; SLOT_BUCKET as usize]: Buckets,
{
    let mask = table.slots() - 1;
    let h = key.slot_hash(seed);
    let want = (h & SLOT_TAG) | SLOT_READY;
    let mut read: Option<(u32, [Slot<K, V>; SLOT_BUCKET as usize])> = None;
    for j in 0..SLOT_PROBES {
        let at = (h as u32).wrapping_add(j) & mask;
        let element = at / SLOT_BUCKET;
        let bucket = match read {
            Some((e, b)) if e == element => b,
            _ => {
                let b = table.element(element)?;
                read = Some((element, b));
                b
            }
        };
        let s = bucket[(at % SLOT_BUCKET) as usize];
        if s.claim == SLOT_EMPTY {
            return Ok(None);
        }
        // The claim's generation aside (`lb_common::SLOT_GEN`).
        if s.claim & SLOT_MATCH == want && s.key.same(key) {
            return Ok(Some((at, s)));
        }
    }
    Ok(None)
}

/// Bytes of kernel memory the flow tables (`conntrack_max`,
/// `conntrack_max_ipv6`) and the selection tables (`table_capacity`)
/// take, allocated in full at load.
pub fn table_memory(config: &Config) -> (u64, u64) {
    let arrays = u64::from(FlowTable::<FlowBucket>::arrays_for(flow_slots(config.conntrack_max)))
        + u64::from(FlowTable::<FlowBucket6>::arrays_for(flow_slots(config.conntrack_max_ipv6)));
    let flows = arrays * FLOW_ARRAY_BYTES;
    (flows, u64::from(config.table_capacity) * SELECT_BYTES)
}

/// A warning when `tables` would take more than half of `mem_total`
/// bytes of memory (new tables are allocated in full at load): the
/// machine's memory, or the limit of lbd's memory cgroup when that is
/// less (`whose` says which).
fn memory_warning(tables: &TableMemory, mem_total: u64, whose: &str) -> Option<String> {
    let all = tables.flows + tables.select;
    (all > mem_total / 2).then(|| {
        format!(
            "{tables}: about {} MB of kernel memory in all, {}% of {whose} {} MB",
            all / 1_000_000,
            all * 100 / mem_total,
            mem_total / 1_000_000
        )
    })
}

/// What lbd itself may take beside the tables, weighed with them against
/// its memory cgroup: it keeps a copy of each service's selection tables
/// (2 bytes an entry), builds new ones beside them on every change (2
/// bytes an entry, and the pool's positions), and the allocator keeps
/// some of what was freed. 32 MiB and 12 bytes an entry: with 3 services
/// lbd's anonymous memory stayed under 10 MB; at 255 services of 65,537
/// entries (234 MB reserved) it peaked at 170 MB at start and settled at
/// 104 MB with 4-byte copies, at 70 MB with 2-byte ones (release build,
/// glibc). The reserve was kept when the copies and the builds shrank.
fn own_memory(config: &Config) -> u64 {
    const BASE: u64 = 32 << 20;
    let entries: u64 = config.services.iter().map(crate::config::table_entries).sum();
    BASE + 3 * entries * size_of::<u32>() as u64
}

/// What the tables of a config take, said in an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableMemory {
    conntrack_max: u32,
    conntrack_max_ipv6: u32,
    table_capacity: u32,
    /// Bytes of the flow tables and of the selection tables.
    flows: u64,
    select: u64,
    /// Bytes lbd itself may take beside them ([`own_memory`]).
    own: u64,
}

impl TableMemory {
    fn of(config: &Config) -> Self {
        let (flows, select) = table_memory(config);
        Self {
            conntrack_max: config.conntrack_max,
            conntrack_max_ipv6: config.conntrack_max_ipv6,
            table_capacity: config.table_capacity,
            flows,
            select,
            own: own_memory(config),
        }
    }
}

impl std::fmt::Display for TableMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "The flow tables take about {} MB (conntrack_max: {}, conntrack_max_ipv6: {}) and the selection tables \
             about {} MB (table_capacity: {}), all allocated at start",
            self.flows / 1_000_000,
            self.conntrack_max,
            self.conntrack_max_ipv6,
            self.select / 1_000_000,
            self.table_capacity
        )
    }
}

/// The memory new tables will take, weighed once before any is created:
/// a warning when they take more than half of the machine's memory (or of
/// lbd's memory cgroup's limit, when that is less), and an error when
/// they and lbd's own memory do not fit what the cgroup leaves (see
/// [`memcg`]).
fn check_room(config: &Config) -> Result<(), DataplaneError> {
    let tables = TableMemory::of(config);
    // The machine's memory (sysinfo(2), as /proc/meminfo's MemTotal).
    let info = rustix::system::sysinfo();
    let ram = info.totalram * u64::from(info.mem_unit);
    let cgroup = memcg::tightest(ram);
    let warning = match &cgroup {
        Some(c) => memory_warning(&tables, c.limit, &format!("the limit of lbd's memory cgroup {}:", c.cgroup)),
        None => memory_warning(&tables, ram, "this machine's"),
    };
    if let Some(w) = warning {
        warn!("{w}");
    }
    fits(tables, cgroup)
}

/// An error when `tables` and lbd's own memory beside them take more than
/// `cgroup` leaves free: lbd would be killed by the cgroup's OOM killer
/// once it grows, rather than fail now with a reason.
fn fits(tables: TableMemory, cgroup: Option<memcg::Limit>) -> Result<(), DataplaneError> {
    match cgroup {
        Some(cgroup) if tables.flows + tables.select + tables.own > cgroup.free => {
            Err(DataplaneError::Cgroup { tables, cgroup })
        }
        _ => Ok(()),
    }
}

/// A map the kernel had no memory for, said with what takes the memory.
fn memory_hint(e: DataplaneError, config: &Config) -> DataplaneError {
    match e {
        DataplaneError::Load(aya::EbpfError::MapError(MapError::CreateError { name, io_error }))
            if io_error.raw_os_error() == Some(libc::ENOMEM) =>
        {
            DataplaneError::Memory { map: name, tables: TableMemory::of(config), source: io_error }
        }
        e => e,
    }
}

/// Load (verify) the programs `names` of `ebpf`, several at once: one
/// thread per CPU, up to one per program, each taking the next program
/// of the list (put the largest first). The verifier is most of a
/// start's time (on a 2-core AMD EPYC VM, loaded one after the other
/// under strace, 6.5 s of an 11.6 s migrating start, the IPv6 balancer
/// 2.3 s of it), and separate loads verify in parallel for a privileged
/// loader. Each load is retried on EAGAIN (see [`retry_eagain`]).
fn load_programs(ebpf: &mut Ebpf, names: &[&str]) -> Result<(), DataplaneError> {
    let mut todo: Vec<(usize, &mut Program)> = ebpf
        .programs_mut()
        .filter_map(|(name, prog)| names.iter().position(|n| *n == name).map(|at| (at, prog)))
        .collect();
    if todo.len() != names.len() {
        return Err(ProgramError::NotLoaded.into());
    }
    // The first named goes first.
    todo.sort_by_key(|(at, _)| *at);
    on_cpus(todo.into_iter().map(|(_, prog)| prog), |prog| match prog {
        Program::Xdp(p) => retry_eagain(|| p.load()),
        Program::SchedClassifier(p) => retry_eagain(|| p.load()),
        _ => Err(ProgramError::UnexpectedProgramType.into()),
    })
}

/// Run `work` on each of `tasks`, on one thread per CPU (at most one per
/// task), in the tasks' order: each thread takes the next task left.
/// After a task fails, no thread starts another; every thread is joined
/// before the first error is returned, and a panic in one is resumed
/// here. For a start's work that the kernel does in parallel for us
/// (verifying programs, making maps).
fn on_cpus<T: Send, E: Send>(
    tasks: impl IntoIterator<Item = T>,
    work: impl Fn(T) -> Result<(), E> + Sync,
) -> Result<(), E> {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let tasks: Vec<T> = tasks.into_iter().collect();
    let workers = std::thread::available_parallelism().map_or(1, usize::from).min(tasks.len());
    let queue = std::sync::Mutex::new(tasks.into_iter());
    let failed = AtomicBool::new(false);
    let next = || {
        if failed.load(Relaxed) {
            return None;
        }
        queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).next()
    };
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    while let Some(task) = next() {
                        if let Err(e) = work(task) {
                            failed.store(true, Relaxed);
                            return Err(e);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        let results: Vec<_> =
            threads.into_iter().map(|t| t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect();
        results.into_iter().collect()
    })
}

/// Run `load` (a program's load) again while the kernel answers EAGAIN,
/// up to five times in all (libbpf does the same). The verifier gives up
/// with EAGAIN when a signal is pending for the loading thread (a child's
/// SIGCHLD, a SIGHUP meant for lbd's handler), which says nothing of the
/// program: a test binary whose other threads ran commands failed a load
/// that way beside a CPU-bound process, where verifying takes longer.
/// (aya 0.14's load does not retry; the retry belongs there, and lives
/// here until aya can be upgraded.)
fn retry_eagain(mut load: impl FnMut() -> Result<(), ProgramError>) -> Result<(), DataplaneError> {
    const ATTEMPTS: u32 = 5;
    let mut attempt = 1;
    loop {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < ATTEMPTS =>
            {
                attempt += 1;
            }
            done => return Ok(done?),
        }
    }
}

/// What the program was loaded with for its flow tables: the slot hash's
/// seed (`FLOW_HASH_SEED`) and each table's entry limit (`FLOW_LIMIT`,
/// the `conntrack_max` in force, and `FLOW_LIMIT6`, the
/// `conntrack_max_ipv6` in force).
#[derive(Clone, Copy)]
struct FlowTables {
    seed: u64,
    limit: u32,
    limit6: u32,
    /// Each table's slots (kept beside the seed in `FLOW_SEED`).
    slots4: u32,
    slots6: u32,
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

    /// True when a datapath is pinned at `pin` (a previous lbd left it):
    /// its flow table, of this layout or an older one's.
    pub fn pinned_at(pin: &Path) -> bool {
        let maps = pin.join("maps");
        maps.join(names::FLOWS).exists() || maps.join(layout::OLD_FLOWS).exists()
    }

    fn load_inner(config: &Config, pin: Option<&Path>) -> Result<Self, DataplaneError> {
        // Before anything pinned is looked at: the datapath is this
        // process's alone.
        let lock = pin.map(pin::lock).transpose()?;
        let mut dp = Self::load_maps(config, pin)?;
        dp._pin_lock = lock;
        Ok(dp)
    }

    fn load_maps(config: &Config, pin: Option<&Path>) -> Result<Self, DataplaneError> {
        // Kernel-side log statements exist only on error paths; keep them at
        // warn and above unless asked (level numbers follow aya-log-common).
        let level: u8 = if tracing::enabled!(tracing::Level::DEBUG) { 4 } else { 2 };
        let mut loader = EbpfLoader::new();
        loader.map_max_entries("SELECT", select_elements(config.table_capacity)).override_global(
            "AYA_LOG_LEVEL",
            &level,
            false,
        );
        let mut adopting = false;
        // Old maps to migrate from (moved aside here), or left aside by a
        // migration that did not finish (its flows are copied again).
        let mut migrate_from: Option<(u32, PathBuf)> = None;
        let mut resume_from: Option<(u32, PathBuf)> = None;
        // A datapath of an older layout that this one takes up in place.
        let mut taken_up: Option<u32> = None;
        // An older version's global-counter map, which this one replaces
        // (see below): kept open, its counts copied once the new one exists.
        let mut old_counters: Option<PerCpuArray<MapData, u64>> = None;
        let maps_dir = pin.map(|p| p.join("maps"));
        if let (Some(pin), Some(maps_dir)) = (pin, &maps_dir) {
            // bpffs was checked (and mounted if need be) by `pin::lock`.
            match layout::unfinished(pin, maps_dir)? {
                // An lbd killed in its first start (SIGKILL, a start
                // timeout, the OOM killer) after its maps were pinned and
                // before it wrote their layout, which it does before
                // attaching anywhere: a datapath with no flows, no
                // counters and no traffic. Nothing to adopt.
                Some(layout::Unfinished::FirstStart) => {
                    warn!(
                        path = %maps_dir.display(),
                        "found maps an lbd pinned and never finished setting up (killed during its first start; nothing attached): removed, starting afresh"
                    );
                    std::fs::remove_dir_all(maps_dir)
                        .map_err(|source| DataplaneError::Pin { path: maps_dir.clone(), source })?;
                }
                // One killed while migrating, before its new maps were set
                // up: the old program still runs on the old maps, aside.
                // They go back, and are migrated again below.
                Some(layout::Unfinished::Migration(aside)) => {
                    warn!(
                        path = %maps_dir.display(),
                        old = %aside.display(),
                        "found maps a migrating lbd pinned and never finished setting up (killed before it swapped its program in): removed, the old maps put back and migrated again"
                    );
                    layout::put_back(maps_dir, &aside)
                        .map_err(|source| DataplaneError::Pin { path: aside.clone(), source })?;
                }
                None => {}
            }
            adopting = Self::pinned_at(pin);
            if adopting {
                // The version first: nothing else pinned is opened before.
                let found = layout::pinned_version(maps_dir)?;
                let aside = layout::aside_dir(pin, found);
                if layout::judge(found, pin)? {
                    info!(from = found, to = LAYOUT_VERSION, "the pinned datapath has an older map layout: migrating");
                    std::fs::rename(maps_dir, &aside)
                        .map_err(|source| DataplaneError::Pin { path: aside.clone(), source })?;
                    migrate_from = Some((found, aside));
                } else {
                    resume_from = layout::aside_with_flows(pin);
                    taken_up = (found != LAYOUT_VERSION).then_some(found);
                    if let Some(from) = taken_up {
                        info!(
                            from,
                            to = LAYOUT_VERSION,
                            "the pinned datapath has an older map layout: taking it up in place"
                        );
                    }
                }
            }
            std::fs::create_dir_all(maps_dir)
                .map_err(|source| DataplaneError::Pin { path: maps_dir.clone(), source })?;
            // A global-counter map pinned by an older version has fewer
            // slots than this program counts into: unpinned (this process
            // keeps it open) and replaced by a new one, which gets its
            // counts once the program is loaded (a counter the old version
            // did not have starts from 0).
            let counters = maps_dir.join(names::COUNTERS);
            if let Ok(info) = aya::maps::MapInfo::from_pin(&counters)
                && info.max_entries() < counter::COUNT
            {
                old_counters = Some(layout::open(&counters, names::COUNTERS)?);
                info!(
                    pinned = info.max_entries(),
                    needed = counter::COUNT,
                    "the pinned global-counter map predates this version: replaced, its counters carried over"
                );
                std::fs::remove_file(&counters)
                    .map_err(|source| DataplaneError::Pin { path: counters.clone(), source })?;
            }
            for name in names::ALL {
                loader.map_pin_path(name, maps_dir.join(name));
            }
        }
        // The flow tables' sizes: an adopted table's own (it keeps its
        // size until a clean stop), otherwise the config's. The program is
        // built with their masks as constants.
        // An adopted table of another size than the config's is said
        // once, as a warning, here where its size is read.
        let pinned_slots = match &maps_dir {
            Some(dir) if adopting && migrate_from.is_none() => Some(layout::pinned_slots(dir)?),
            _ => None,
        };
        let slots = |pinned: Option<u32>, name: &'static str, what: &str, key: &str, configured: u32| {
            let Some(n) = pinned else { return Ok(flow_slots(configured)) };
            if !n.is_power_of_two() || n < SLOT_BUCKET {
                return Err(DataplaneError::Layout(format!(
                    "the pinned {what} ({name}) has {n} slots by {}, not a power of two; nothing was changed",
                    names::FLOW_SEED
                )));
            }
            if n != flow_slots(configured) {
                warn!(
                    map = name,
                    slots = n,
                    "the adopted {what} has {n} slots, room for {} flows where the config's {key} says {configured}: it keeps its size until a clean stop (SIGTERM) and a fresh start",
                    n / 2
                );
            }
            Ok(n)
        };
        let slots4 =
            slots(pinned_slots.map(|s| s.0), names::FLOWS, "flow table", "conntrack_max", config.conntrack_max)?;
        let slots6 = slots(
            pinned_slots.map(|s| s.1),
            names::FLOWS6,
            "IPv6 flow table",
            "conntrack_max_ipv6",
            config.conntrack_max_ipv6,
        )?;
        let (mask4, mask6) = (slots4 - 1, slots6 - 1);
        // Entries each table may hold: the config's conntrack_max (and
        // conntrack_max_ipv6), or, for an adopted table of another size,
        // half its slots.
        let limit = flow_limit(slots4, config.conntrack_max);
        let limit6 = flow_limit(slots6, config.conntrack_max_ipv6);
        // The slot hash's seed: adopted tables keep theirs (a program with
        // another would not find their entries); new tables, a migration's
        // included, get one drawn at random.
        let seed = match &maps_dir {
            Some(dir) if adopting && migrate_from.is_none() => layout::pinned_seed(dir)?,
            _ => random_seed()?,
        };
        let tables = FlowTables { seed, limit, limit6, slots4, slots6 };
        loader
            .override_global("FLOW_HASH_SEED", &seed, true)
            .map_max_entries(FlowBucket::NAME, FlowTable::<FlowBucket>::arrays_for(slots4))
            .map_max_entries(FlowBucket6::NAME, FlowTable::<FlowBucket6>::arrays_for(slots6))
            .override_global("FLOW_SLOT_MASK", &mask4, true)
            .override_global("FLOW_SLOT_MASK6", &mask6, true)
            .override_global("FLOW_LIMIT", &limit, true)
            .override_global("FLOW_LIMIT6", &limit6, true);
        // New tables (a first start's, a migration's) get their arrays
        // before anything else sees them; adopted ones have theirs (a
        // layout is written only after).
        let fresh = !adopting || migrate_from.is_some();
        let room = if fresh { check_room(config) } else { Ok(()) };
        let loaded = room
            .and_then(|()| Self::load_program(loader))
            .and_then(|(mut ebpf, ncpus)| {
                if fresh {
                    let started = std::time::Instant::now();
                    FlowTable::<FlowBucket>::fill(&mut ebpf, small_vmalloc_arrays())
                        .and_then(|after| FlowTable::<FlowBucket6>::fill(&mut ebpf, after))
                        .map_err(|e| DataplaneError::Load(aya::EbpfError::MapError(e)))?;
                    info!(slots = slots4, slots6, ms = started.elapsed().as_millis() as u64, "flow tables made");
                }
                Ok((ebpf, ncpus))
            })
            .map_err(|e| memory_hint(e, config));
        match (&migrate_from, &maps_dir) {
            (Some((from, aside)), Some(maps_dir)) => {
                let dp = loaded.and_then(|(ebpf, ncpus)| {
                    Self::build(config, pin, ebpf, ncpus, tables, true, Some((*from, aside.as_path())), None)
                });
                if dp.is_err() {
                    let _ = layout::put_back(maps_dir, aside);
                }
                dp
            }
            _ => {
                let (ebpf, ncpus) = loaded.inspect_err(|_| {
                    // A first start that failed: the maps it created before
                    // the failing one were pinned; nothing uses them, and
                    // nothing of ours should stay.
                    if let (false, Some(pin), Some(maps_dir)) = (adopting, pin, &maps_dir) {
                        let _ = std::fs::remove_dir_all(maps_dir);
                        let _ = std::fs::remove_dir(pin);
                    }
                    // One that took up an older layout: the maps it added.
                    if let (Some(from), Some(maps_dir)) = (taken_up, &maps_dir) {
                        layout::remove_added(maps_dir, from);
                    }
                })?;
                let resume = resume_from.as_ref().map(|(v, d)| (*v, d.as_path()));
                let mut dp =
                    Self::build(config, pin, ebpf, ncpus, tables, adopting, None, resume).inspect_err(|_| {
                        if let (Some(from), Some(maps_dir)) = (taken_up, &maps_dir) {
                            layout::give_back(maps_dir, from);
                        }
                    })?;
                dp.taken_up_from = taken_up;
                if let Some(old) = &old_counters {
                    dp.copy_counters(old)?;
                }
                Ok(dp)
            }
        }
    }

    fn load_program(mut loader: EbpfLoader<'_>) -> Result<(Ebpf, usize), DataplaneError> {
        let mut ebpf = loader.load(EBPF_OBJECT)?;
        // The balancer; the programs it tail-calls, whose slots are written
        // once the maps are taken (`set_tail_calls`); the sweeper's
        // remover, run by `sweep`, never attached.
        // The largest first: the IPv6 and IPv4 balancers take longest.
        let started = std::time::Instant::now();
        let v6 = TAIL_CALLS[lb_common::PROG_V6 as usize].1;
        let mut names = vec![v6, PROGRAM];
        names.extend(TAIL_CALLS.iter().map(|(_, n)| *n).filter(|n| *n != v6));
        names.extend([SWEEP_PROGRAM, TC_PROGRAM]);
        load_programs(&mut ebpf, &names)?;
        info!(programs = names.len(), ms = started.elapsed().as_millis() as u64, "programs verified and loaded");
        let ncpus = nr_cpus().map_err(|(_, e)| DataplaneError::Cpus(e))?;
        Ok((ebpf, ncpus))
    }

    /// The datapath around a loaded program: maps taken, flood settings,
    /// the flow tables' hash seed and limit (`tables`, what the program was
    /// loaded with) and layout version written, old maps migrated from
    /// (`migrate_from`) or a stopped migration's flows to copy again
    /// (`resume_from`), then the pinned state adopted.
    #[expect(clippy::too_many_arguments, reason = "one call per way of loading; a struct would only rename them")]
    fn build(
        config: &Config,
        pin: Option<&Path>,
        mut ebpf: Ebpf,
        ncpus: usize,
        tables: FlowTables,
        adopting: bool,
        migrate_from: Option<(u32, &Path)>,
        resume_from: Option<(u32, &Path)>,
    ) -> Result<Self, DataplaneError> {
        let mut maps = Maps::take(&mut ebpf, tables.slots4, tables.slots6)?;
        // The tail-called programs into their slots, before anything is
        // attached (an adopted program array gets this build's programs:
        // the old program calls them until its link is swapped, which the
        // shared maps allow).
        for (slot, name) in TAIL_CALLS {
            let prog: &Xdp = ebpf.program(name).ok_or(ProgramError::NotLoaded)?.try_into()?;
            let fd = prog.fd()?.try_clone().map_err(|e| DataplaneError::Pin { path: name.into(), source: e })?;
            maps.progs.set(slot, &fd, 0).map_err(map_err(names::PROGS))?;
        }
        // The sizes the maps have: adopted maps keep the ones they were
        // made with, whatever the config now says (a change takes effect
        // after a clean stop), and limits, allocation and reports follow
        // the maps (the flow tables' read, and warned about, at load).
        let (flow_seed, conntrack_max, conntrack_max_ipv6) = (tables.seed, tables.limit, tables.limit6);
        let table_capacity = adopted_select(maps.select.map(), config.table_capacity)?;
        let select_memory = SelectMemory::map(&maps.select)
            .inspect_err(|e| {
                warn!(
                    "the selection-table array cannot be memory-mapped ({e}): its tables are written through the kernel instead, a read and a write per four entries (slower weight changes, same result)"
                );
            })
            .ok();
        let mut dp = Self {
            ebpf,
            maps,
            select_memory,
            attached: Vec::new(),
            tc: BTreeMap::new(),
            pin: pin.map(Path::to_path_buf),
            adopted: HashMap::new(),
            services: BTreeMap::new(),
            service_ids: Ids::new(MAX_SERVICES),
            backend_ids: Ids::new(MAX_BACKENDS),
            regions: Regions::new(table_capacity),
            table_capacity,
            ncpus,
            known_backends: HashSet::new(),
            filter: None,
            reply_hint: None,
            netdevs: BTreeMap::new(),
            netdevs_written: false,
            paths: Vec::new(),
            endpoints: HashMap::new(),
            flood: config.flood,
            maglev_seed: config.maglev_seed,
            conntrack_max,
            conntrack_max_ipv6,
            flow_seed,
            orphans: Default::default(),
            migration: None,
            taken_up_from: None,
            swapped: false,
            interfaces: Vec::new(),
            requested: crate::config::XdpMode::Auto,
            hold_until: 0,
            _pin_lock: None,
        };
        if let Some((from, dir)) = migrate_from {
            dp.migration = Some(dp.migrate_from(from, dir)?);
        } else if let Some((from, dir)) = resume_from {
            dp.migration = Some(layout::Migration::resume(from, dir)?);
        }
        if dp.migration.is_some() {
            // Ample for attaching and the last copy; should lbd die in
            // between, the hold lapses by itself.
            // SYNs too until every interface runs the new program
            // (`attach`: see `lb_common::HOLD_NEW`).
            dp.hold_until = (monotonic_coarse_secs() + layout::HOLD_SECS) as u32 | lb_common::HOLD_NEW;
        }
        // The seed before the version: a pinned LAYOUT of this version
        // always has its tables' seed beside it (an adopted one is written
        // again, unchanged).
        // With the tables' sizes, which the next lbd reads to adopt them.
        for (i, v) in [flow_seed, u64::from(tables.slots4), u64::from(tables.slots6)].into_iter().enumerate() {
            dp.maps.flow_seed.set(i as u32, v, 0).map_err(map_err(names::FLOW_SEED))?;
        }
        // Written last: a migration that failed leaves no mark of this version.
        dp.maps.layout.set(0, LAYOUT_VERSION, 0).map_err(map_err(names::LAYOUT))?;
        dp.set_flood(&config.flood)?;
        dp.read_endpoints()?;
        if adopting {
            dp.adopt()?;
        }
        Ok(dp)
    }

    /// Rebuild what the pinned maps already hold: services by VIP key with
    /// their ids and table regions, backends with their ids, so that the
    /// first `apply` keeps ids (and so counters) and frees nothing in use.
    fn adopt(&mut self) -> Result<(), DataplaneError> {
        let mut found: HashMap<endpoints::Key, Adopted> = HashMap::new();
        let adopted = |v: &lb_common::Service| {
            let region = (v.table_len > 0).then_some((v.table_off, v.table_len));
            let fallback = (v.fallback_len > 0).then_some((v.fallback_off, v.fallback_len));
            let fallback_region = fallback.filter(|&f| Some(f) != region);
            Adopted { service_id: v.service_id, region, fallback_region, backends: Vec::new() }
        };
        for item in &self.maps.vips {
            let (k, v) = item.map_err(map_err(names::VIPS))?;
            found.insert(endpoints::Key::from_v4(&k), adopted(&v));
        }
        for item in &self.maps.vips6 {
            let (k, v) = item.map_err(map_err(names::VIPS6))?;
            found.insert(endpoints::Key::from_v6(&k), adopted(&v));
        }
        let by_service: HashMap<u32, endpoints::Key> = found.iter().map(|(k, a)| (a.service_id, *k)).collect();
        {
            let arr = &self.maps.backends;
            for id in 1..MAX_BACKENDS {
                let b = arr.get(&id, 0).map_err(map_err(names::BACKENDS))?;
                if b.addr == 0 {
                    continue;
                }
                let addr = if b.flags & BACKEND_F_V6 != 0 {
                    let w = self.maps.backend_addrs6.get(&id, 0).map_err(map_err(names::BACKEND_ADDRS6))?;
                    IpAddr::V6(endpoints::addr6(&w))
                } else {
                    IpAddr::V4(u32::from_be(b.addr).into())
                };
                self.known_backends.insert(addr);
                if let Some(key) = by_service.get(&b.service_id) {
                    let a = found.get_mut(key).expect("indexed above");
                    a.backends.push((addr, u16::from_be(b.port), id));
                }
            }
        }
        for a in found.values() {
            self.service_ids.reserve(a.service_id);
            for (o, l) in a.region.into_iter().chain(a.fallback_region) {
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

    /// Put flood protection settings in force (at load, and on reload).
    pub fn set_flood(&mut self, flood: &FloodConfig) -> Result<(), DataplaneError> {
        let rate = flood.rate_per_cpu(self.conntrack_max, self.ncpus);
        let hold_until = if self.migration.is_some() { self.hold_until } else { 0 };
        self.write_flood(rate, hold_until)?;
        self.flood = *flood;
        Ok(())
    }

    /// Write the selection tables element by element through the kernel from
    /// now on, as where SELECT cannot be memory-mapped (tests: that path
    /// is otherwise reached only when mmap fails).
    #[doc(hidden)]
    pub fn unmap_select(&mut self) {
        self.select_memory = None;
    }

    /// Hold TCP packets other than SYNs that find no flow entry, or a
    /// closed one, for `secs` seconds from now (0: no longer), as a
    /// migration does while it copies the old datapath's last flows
    /// (`lb_common::Flood::hold_until`, counted `held`). The next
    /// [`set_flood`](Self::set_flood) outside a migration ends it.
    pub fn hold_for(&mut self, secs: u64) -> Result<(), DataplaneError> {
        let hold_until = if secs == 0 { 0 } else { (monotonic_coarse_secs() + secs) as u32 };
        self.write_flood(self.new_flow_rate(), hold_until)
    }

    /// As [`hold_for`](Self::hold_for), and TCP SYNs that would open a
    /// flow are held too, as during a migration's program swap
    /// (`lb_common::HOLD_NEW`).
    pub fn hold_new_for(&mut self, secs: u64) -> Result<(), DataplaneError> {
        let hold_until = if secs == 0 { 0 } else { (monotonic_coarse_secs() + secs) as u32 | lb_common::HOLD_NEW };
        self.write_flood(self.new_flow_rate(), hold_until)
    }

    /// The datapath's flood settings (`FLOOD`): the per-CPU new-flow rate
    /// and the hold.
    fn write_flood(&mut self, new_flow_rate_per_cpu: u32, hold_until: u32) -> Result<(), DataplaneError> {
        let v = Flood { new_flow_rate_per_cpu, hold_until };
        self.maps.flood.set(0, v, 0).map_err(map_err(names::FLOOD))
    }

    /// The `maglev_seed` for the tables the next [`apply`](Self::apply)
    /// builds (at load, and on reload). A service whose tables were built
    /// with another seed gets new ones then, even if nothing else changed.
    pub fn set_maglev_seed(&mut self, seed: u64) {
        self.maglev_seed = seed;
    }

    /// The per-CPU new-flow rate in force (0: no limit).
    pub fn new_flow_rate(&self) -> u32 {
        self.flood.rate_per_cpu(self.conntrack_max, self.ncpus)
    }

    /// The entries each flow table may hold, (IPv4, IPv6): the limits the
    /// program was loaded with, `conntrack_max` and `conntrack_max_ipv6`
    /// (an adopted table's size when it differs from the config's).
    pub fn flow_capacities(&self) -> (u32, u32) {
        (self.conntrack_max, self.conntrack_max_ipv6)
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

    /// The XDP program's kernel id (changes when a new program is swapped in).
    pub fn program_id(&self) -> Option<u32> {
        self.program().info().ok().map(|i| i.id())
    }

    pub fn attachments(&self) -> Vec<Attachment> {
        self.attached
            .iter()
            .map(|a| Attachment { tc: self.tc.get(&a.attachment.interface).map(|t| t.1), ..a.attachment.clone() })
            .collect()
    }

    pub fn services(&self) -> impl Iterator<Item = &AppliedService> {
        self.services.values()
    }

    /// `service`'s selection table and its fallback table, each as lbd
    /// built it beside what SELECT holds in its region, read back through
    /// the kernel (tests: the program picks from what was built, whatever
    /// element the region starts in); None for an unknown service.
    #[expect(clippy::type_complexity, reason = "two (built, read) pairs, named where used")]
    pub fn select_tables(&self, service: &str) -> Result<Option<[(Vec<u32>, Vec<u32>); 2]>, DataplaneError> {
        let Some(s) = self.services.get(service) else { return Ok(None) };
        let read = |region: Option<(u32, u32)>| -> Result<Vec<u32>, DataplaneError> {
            let Some((off, len)) = region else { return Ok(Vec::new()) };
            (off..off + len)
                .map(|i| {
                    let (element, lane) = select_slot(i);
                    let word = self.maps.select.get(&element, 0).map_err(map_err(names::SELECT))?;
                    Ok(u32::from(word[lane]))
                })
                .collect()
        };
        let built = |t: &[u16]| t.iter().map(|&id| u32::from(id)).collect::<Vec<u32>>();
        Ok(Some([(built(&s.table), read(s.region)?), (built(&s.fallback), read(s.fallback_region)?)]))
    }

    /// Where `service`'s selection table starts in SELECT, in entries
    /// (tests).
    pub fn select_offset(&self, service: &str) -> Option<u32> {
        self.services.get(service).and_then(|s| s.region).map(|r| r.0)
    }

    /// Per-backend counters summed over CPUs.
    pub fn backend_stats(&self, id: u32) -> Result<BackendStats, DataplaneError> {
        let stats = &self.maps.backend_stats;
        let mut total = BackendStats::default();
        for v in stats.get(&id, 0).map_err(map_err(names::BACKEND_STATS))?.iter() {
            total.add(v);
        }
        Ok(total)
    }

    /// Global counters (`lb_common::counter`) by name, summed over CPUs.
    /// Copy an older datapath's global counters (`old`, which may have
    /// fewer) into this one's, per CPU.
    fn copy_counters(&mut self, old: &PerCpuArray<MapData, u64>) -> Result<(), DataplaneError> {
        for i in 0..old.len().min(self.maps.counters.len()) {
            let v = old.get(&i, 0).map_err(map_err(names::COUNTERS))?;
            self.maps.counters.set(i, v, 0).map_err(map_err(names::COUNTERS))?;
        }
        Ok(())
    }

    pub fn counters(&self) -> Result<BTreeMap<String, u64>, DataplaneError> {
        let mut out = BTreeMap::new();
        for (i, name) in counter::NAMES.iter().enumerate() {
            out.insert((*name).to_owned(), self.counter(i as u32)?);
        }
        Ok(out)
    }

    /// One datapath counter (`lb_common::counter`), summed over the CPUs:
    /// one map read, where [`Self::counters`] makes one per counter.
    pub fn counter(&self, index: u32) -> Result<u64, DataplaneError> {
        Ok(self.maps.counters.get(&index, 0).map_err(map_err(names::COUNTERS))?.iter().sum())
    }

    /// Empty the flow tables (for benchmarks: flows are forgotten without
    /// being counted closed or expired; the datapath must be idle).
    /// Returns the entries removed.
    pub fn flush_flows(&mut self) -> Result<u64, DataplaneError> {
        let (held4, held6) = self.flow_counts()?;
        self.maps.flows.clear()?;
        self.maps.flows6.clear()?;
        for family in 0..2 {
            self.maps.flow_count.set(family, 0, 0).map_err(map_err(names::FLOW_COUNT))?;
            let zero = PerCpuValues::try_from(vec![0u64; self.ncpus]).expect("one value per CPU");
            self.maps.flow_credit.set(family, zero, 0).map_err(map_err(names::FLOW_CREDIT))?;
        }
        Ok(held4 + held6)
    }

    /// The keys of every IPv4 flow-table entry (for benchmarks), read in
    /// batches.
    pub fn flow_keys(&self) -> Result<Vec<FlowKey>, DataplaneError> {
        let mut keys = Vec::new();
        self.maps
            .flows
            .for_each(|_, b| keys.extend(b.iter().filter(|s| s.claim & SLOT_STATE == SLOT_READY).map(|s| s.key)))?;
        Ok(keys)
    }

    /// Forget the IPv4 flows `keys` (for benchmarks, as `flush_flows`);
    /// returns how many of them were there.
    pub fn forget_flows(&mut self, keys: &[FlowKey]) -> Result<u64, DataplaneError> {
        let items: Vec<SweepItem> =
            keys.iter().map(|&key| SweepItem { key, state: 0, last_seen: 0, removed: 0, slot: SWEEP_BY_KEY }).collect();
        Ok(self.remove_unchanged(&items)?.iter().filter(|i| i.removed == 1).count() as u64)
    }

    /// [`Dataplane::forget_flows`] for IPv6 flows.
    pub fn forget_flows6(&mut self, keys: &[FlowKey6]) -> Result<u64, DataplaneError> {
        let items: Vec<SweepItem6> = keys
            .iter()
            .map(|&key| SweepItem6 { key, state: 0, last_seen: 0, removed: 0, slot: SWEEP_BY_KEY })
            .collect();
        Ok(self.remove_unchanged6(&items)?.iter().filter(|i| i.removed == 1).count() as u64)
    }

    /// Whether `addr`'s bit is set in the address filter the datapath
    /// reads (read from the map): a packet between two addresses without
    /// it is passed before any other map is read.
    pub fn in_filter(&self, addr: IpAddr) -> Result<bool, DataplaneError> {
        let words = self.maps.addr_filter.get(&0, 0).map_err(map_err(names::ADDR_FILTER))?;
        Ok(program::has_bit(&words, program::filter_bit(addr)))
    }

    /// Whether the IPv4 TCP VIP (`addr`, `port`)'s bit is set in the
    /// reply-entry hint the datapath reads (read from the map): a SYN to
    /// it loads its second flow slot early (see `lb_common::ReplyHint`).
    pub fn in_reply_hint(&self, addr: std::net::Ipv4Addr, port: u16) -> Result<bool, DataplaneError> {
        let bit = lb_common::reply_hint_bit(u32::from(addr).to_be(), port.to_be());
        let words = self.maps.reply_hint.get(&0, 0).map_err(map_err(names::REPLY_HINT))?;
        Ok(program::has_bit(&words, bit))
    }

    /// The IPv4 flow-table entry of `key` (as on the wire), if there is one.
    pub fn flow(&self, key: &FlowKey) -> Result<Option<Flow>, DataplaneError> {
        find_slot(&self.maps.flows, self.flow_seed, key).map(|f| f.map(|(_, s)| s.value))
    }

    /// The IPv6 flow-table entry of `key` (as on the wire), if there is one.
    pub fn flow6(&self, key: &FlowKey6) -> Result<Option<Flow6>, DataplaneError> {
        find_slot(&self.maps.flows6, self.flow_seed, key).map(|f| f.map(|(_, s)| s.value))
    }

    /// Entries in the IPv4 and the IPv6 flow table, as the datapath counts
    /// them against `conntrack_max`.
    pub fn flow_counts(&self) -> Result<(u64, u64), DataplaneError> {
        // The count less the room the CPUs took and have not used (read
        // one after the other: while flows come and go, a figure of a
        // moment, as any count read during traffic).
        let held = |family: u32| -> Result<u64, DataplaneError> {
            let count = self.maps.flow_count.get(&family, 0).map_err(map_err(names::FLOW_COUNT))?;
            let credit = self.maps.flow_credit.get(&family, 0).map_err(map_err(names::FLOW_CREDIT))?;
            Ok(count.saturating_sub(credit.iter().sum()))
        };
        Ok((held(0)?, held(1)?))
    }

    /// The seed of the flow tables' slot hash (tests: where a key's
    /// entry goes).
    pub fn flow_seed(&self) -> u64 {
        self.flow_seed
    }

    /// The slot of `key`'s IPv4 entry, if it has one (tests).
    pub fn flow_slot(&self, key: &FlowKey) -> Result<Option<u32>, DataplaneError> {
        find_slot(&self.maps.flows, self.flow_seed, key).map(|f| f.map(|(at, _)| at))
    }

    /// The slot of `key`'s IPv6 entry, if it has one (tests).
    pub fn flow_slot6(&self, key: &FlowKey6) -> Result<Option<u32>, DataplaneError> {
        find_slot(&self.maps.flows6, self.flow_seed, key).map(|f| f.map(|(at, _)| at))
    }

    /// Set `bits` in the state word of `key`'s IPv4 entry (tests: the
    /// sweeper's mark, `lb_common::FLOW_DOOMED`, as `lb_sweep` leaves it
    /// between its check and its removal while its CPU is interrupted).
    /// False when `key` has no entry. Not atomic against the datapath:
    /// only while no packet runs.
    pub fn set_flow_state_bits(&self, key: &FlowKey, bits: u64) -> Result<bool, DataplaneError> {
        let Some((at, _)) = find_slot(&self.maps.flows, self.flow_seed, key)? else { return Ok(false) };
        let element = at / SLOT_BUCKET;
        let mut b = self.maps.flows.element(element)?;
        b[(at % SLOT_BUCKET) as usize].value.state |= bits;
        self.maps.flows.set_element(element, b)?;
        Ok(true)
    }

    /// A backend's connection counts: opened, closed and expired, its
    /// counts shared and per CPU together, unclamped (tests: every flow
    /// opened is closed or expired exactly once).
    pub fn connection_counts(&self, id: u32) -> Result<(u64, u64, u64), DataplaneError> {
        let c = self.conns_of(id)?;
        let e = self.maps.expired.get(&id, 0).map_err(map_err(names::EXPIRED))?;
        Ok((c.opened, c.closed, e))
    }

    /// Active flows of a backend: opened - closed - expired, its counts
    /// shared (`CONNS`) and per CPU (`CONNS_CPU`) together.
    pub fn active_flows(&self, id: u32) -> Result<u64, DataplaneError> {
        let c = self.conns_of(id)?;
        let e = self.maps.expired.get(&id, 0).map_err(map_err(names::EXPIRED))?;
        Ok(c.opened.saturating_sub(c.closed).saturating_sub(e))
    }

    /// Backend `id`'s connection counts: the shared ones and every CPU's.
    fn conns_of(&self, id: u32) -> Result<lb_common::Conns, DataplaneError> {
        let mut c = self.maps.conns.get(&id, 0).map_err(map_err(names::CONNS))?;
        let s = self.per_cpu_conns(id)?;
        c.opened += s.opened;
        c.closed += s.closed;
        Ok(c)
    }

    /// Backend `id`'s counts per CPU (`CONNS_CPU`), summed.
    fn per_cpu_conns(&self, id: u32) -> Result<lb_common::Conns, DataplaneError> {
        let per = self.maps.conns_cpu.get(&id, 0).map_err(map_err(names::CONNS_CPU))?;
        Ok(per.iter().fold(lb_common::Conns::default(), |a, c| lb_common::Conns {
            opened: a.opened + c.opened,
            closed: a.closed + c.closed,
        }))
    }

    /// Write what each backend of a least-conn or least-time service
    /// counted per CPU, summed, where their pick reads it (`CONNS_SUM`;
    /// no other scheduler reads it): lbd's tasks do it once a second.
    pub fn sum_conns(&mut self) -> Result<(), DataplaneError> {
        let ids: Vec<u32> = self
            .services
            .values()
            .filter(|s| lb_common::reads_conns(s.config.scheduler.datapath_id()))
            .flat_map(|s| s.backends.iter().map(|b| b.id))
            .collect();
        for id in ids {
            let sum = self.per_cpu_conns(id)?;
            self.maps.conns_sum.set(id, sum, 0).map_err(map_err(names::CONNS_SUM))?;
        }
        Ok(())
    }
}

impl Drop for Dataplane {
    /// A pinned datapath stays in place (lbd stopping without `shutdown`,
    /// e.g. to restart); an unpinned one goes with its program object.
    fn drop(&mut self) {}
}

/// A backend's identity for Maglev: its address and port, so the same
/// backend gets the same permutation on every agent and every restart.
/// IPv4: the address above the port (as ever). IPv6: the address's two
/// halves mixed (a fixed function of the bytes, the same everywhere)
/// above the port.
pub fn backend_key(addr: IpAddr, port: u16) -> u64 {
    match addr {
        IpAddr::V4(a) => (u64::from(u32::from(a)) << 16) | u64::from(port),
        IpAddr::V6(a) => {
            let v = u128::from(a);
            let (hi, lo) = ((v >> 64) as u64, v as u64);
            let mixed = (hi ^ lo.rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            (mixed << 16) | u64::from(port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Environment, parse};

    #[test]
    fn on_cpus_runs_every_task_once_and_stops_at_an_error() {
        use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
        let runs: Vec<AtomicU32> = (0..100).map(|_| AtomicU32::new(0)).collect();
        assert_eq!(
            on_cpus(0..runs.len(), |i| {
                runs[i].fetch_add(1, Relaxed);
                Ok::<_, usize>(())
            }),
            Ok(())
        );
        assert!(runs.iter().all(|r| r.load(Relaxed) == 1));
        // No tasks: nothing runs, and no thread is needed.
        assert_eq!(on_cpus(0..0, |_| Err(0)), Ok(()));
        // A task that fails: its error comes back. When every task fails,
        // each thread stops at its first: no more tasks start than there
        // are threads.
        assert_eq!(on_cpus([7], Err), Err(7));
        let started = AtomicU32::new(0);
        let threads = std::thread::available_parallelism().map_or(1, usize::from) as u32;
        let failed = on_cpus(0..1000, |i| {
            started.fetch_add(1, Relaxed);
            Err(i)
        });
        assert!(failed.is_err_and(|i| i < 1000));
        assert!(started.load(Relaxed) <= threads, "{} tasks started on {threads} threads", started.load(Relaxed));
    }

    struct AnyInterface;
    impl Environment for AnyInterface {
        fn interface_exists(&self, _: &str) -> bool {
            true
        }
    }

    fn config(conntrack_max: u32) -> Config {
        let text = format!("interfaces: [eth0]\nconntrack_max: {conntrack_max}\nservices: []\n");
        parse(&text, "lbd.yaml", &AnyInterface).unwrap()
    }

    #[test]
    fn tables_taking_over_half_the_memory_are_warned_about() {
        // The defaults: 1,048,576 flows (2,097,152 slots of each family:
        // 5,462 arrays of 384 IPv4 slots, 8,192 of 256 IPv6 ones, 32 KB
        // each) and 4,194,304 selection entries.
        let c = config(1 << 20);
        assert_eq!(table_memory(&c), ((5462 + 8192) * 32768, (1 << 22) * 2));
        // One more flow doubles the slots.
        assert_eq!(table_memory(&config((1 << 20) + 1)).0, (10923 + 16384) * 32768);
        let gib = 1 << 30;
        let machine = "this machine's";
        assert_eq!(memory_warning(&TableMemory::of(&c), 24 * gib, machine), None);
        // 64M flows on the 24 GiB machine the README speaks of: 28.6 GB
        // (and 8.4 MB of selection tables).
        let w = memory_warning(&TableMemory::of(&config(1 << 26)), 24 * gib, machine).expect("a warning");
        assert!(
            w.contains("conntrack_max: 67108864")
                && w.contains("about 28641 MB of kernel memory in all, 111% of this machine's 25769 MB"),
            "{w}"
        );
        assert!(memory_warning(&TableMemory::of(&c), gib / 2, machine).is_some());
        // An IPv4-only gateway's small IPv6 table: 2,048 slots, 8 arrays.
        let v4_only = Config { conntrack_max_ipv6: 1024, ..c.clone() };
        assert_eq!(table_memory(&v4_only).0, (5462 + 8) * 32768);
    }

    /// lbd's own memory (its copies of every service's selection tables)
    /// counts with the tables against its memory cgroup: tables that fit
    /// the cgroup exactly would leave lbd to its OOM killer later.
    #[test]
    fn lbds_own_memory_counts_with_the_tables_against_its_cgroup() {
        let mut text = String::from("interfaces: [eth0]\nconntrack_max: 1024\ntable_capacity: 8388608\nservices:\n");
        for n in 0..40 {
            text += &format!(
                "  - {{ name: s{n}, vip: 10.10.0.100, port: {}, backends: [{{ address: 10.20.0.11, port: 8080 }}] }}\n",
                1000 + n
            );
        }
        let c = parse(&text, "lbd.yaml", &AnyInterface).unwrap();
        let tables = TableMemory::of(&c);
        // 32 MiB and three copies of 40 tables of 65,537 u32 entries.
        assert_eq!(tables.own, (32 << 20) + 3 * 40 * 65_537 * 4);
        assert_eq!(TableMemory::of(&config(1024)).own, 32 << 20);
        let all = tables.flows + tables.select + tables.own;
        let limit = |free| memcg::Limit { cgroup: "/lbd".into(), file: "memory.max", limit: all + (50 << 20), free };
        assert!(fits(tables, Some(limit(all))).is_ok());
        assert!(fits(tables, None).is_ok());
        // Room for the tables alone is not enough.
        let e = fits(tables, Some(limit(all - 1))).unwrap_err().to_string();
        assert!(
            e.contains("; with about 65 MB for lbd itself beside them (its copies of the services' selection tables included), that is more than lbd's memory cgroup /lbd leaves"),
            "{e}"
        );
        // The warning weighs the tables against a cgroup's limit too.
        let w = memory_warning(&tables, tables.flows + tables.select, "the limit of lbd's memory cgroup /lbd:")
            .expect("tables over half of the limit");
        assert!(w.contains("100% of the limit of lbd's memory cgroup /lbd: 17 MB"), "{w}");
    }

    #[test]
    fn a_map_the_kernel_has_no_memory_for_is_said_with_the_tables_sizes() {
        let c = config(1 << 20);
        let enomem = |name: &str| {
            DataplaneError::Load(aya::EbpfError::MapError(MapError::CreateError {
                name: name.into(),
                io_error: std::io::Error::from_raw_os_error(libc::ENOMEM),
            }))
        };
        let e = memory_hint(enomem("FLOW_SLOTS_ARR"), &c).to_string();
        for want in [
            "creating BPF map FLOW_SLOTS_ARR: the kernel could not allocate it.",
            "The flow tables take about 447 MB (conntrack_max: 1048576, conntrack_max_ipv6: 1048576)",
            "the selection tables about 8 MB (table_capacity: 4194304)",
            "lower them, or give the machine (or lbd's memory cgroup) more memory",
            "Cannot allocate memory",
        ] {
            assert!(e.contains(want), "{want:?} not in {e:?}");
        }
        // Other errors pass through as they were.
        let other = DataplaneError::Load(aya::EbpfError::MapError(MapError::CreateError {
            name: "FLOW_SLOTS_ARR".into(),
            io_error: std::io::Error::from_raw_os_error(libc::EPERM),
        }));
        assert!(matches!(memory_hint(other, &c), DataplaneError::Load(_)));
        // Tables over a cgroup's room: said before anything is created.
        let cgroup = memcg::Limit { cgroup: "/lbd".into(), file: "memory.max", limit: 120 << 20, free: 100 << 20 };
        let e = DataplaneError::Cgroup { tables: TableMemory::of(&c), cgroup }.to_string();
        assert!(
            e.starts_with("The flow tables take about 447 MB")
                && e.contains(
                    "more than lbd's memory cgroup /lbd leaves: about 104 MB free of its 125 MB limit (memory.max)"
                )
                && e.ends_with("nothing was created"),
            "{e}"
        );
    }

    /// Every tail call in the datapath has its key set as a constant by
    /// the instruction right before its call, and no jump lands on the
    /// call: so the verifier sees one constant key there and the kernel
    /// makes the tail call a direct jump. Where LLVM had merged the call
    /// sites into one call with the key picked before it, every tail call
    /// was an indirect jump, through a retpoline on kernels that use
    /// them: 6-15 ns of an established IPv6 flow's 110-118 ns in
    /// `lb-bench packet` on an AMD EPYC VM. `maps::tail_call` in lb-ebpf
    /// keeps them apart.
    #[test]
    fn every_tail_call_has_a_constant_key_of_its_own() {
        use aya_obj::generated::{
            BPF_ALU64, BPF_CALL, BPF_EXIT, BPF_JA, BPF_JMP, BPF_JMP32, BPF_K, BPF_MOV, bpf_func_id::BPF_FUNC_tail_call,
        };
        let obj = aya_obj::Object::parse(EBPF_OBJECT).expect("the datapath's object parses");
        let mut keys = std::collections::BTreeSet::new();
        for f in obj.functions.values() {
            let insns = &f.instructions;
            // Where each jump of the function lands (`gotol` keeps its
            // offset in `imm`).
            let targets: HashSet<i64> = insns
                .iter()
                .enumerate()
                .filter(|(_, i)| {
                    let class = u32::from(i.code & 0x07);
                    let op = u32::from(i.code & 0xf0);
                    (class == BPF_JMP || class == BPF_JMP32) && op != BPF_CALL && op != BPF_EXIT
                })
                .map(|(at, i)| {
                    let long = u32::from(i.code) == BPF_JMP32 | BPF_JA;
                    at as i64 + 1 + if long { i64::from(i.imm) } else { i64::from(i.off) }
                })
                .collect();
            for (at, insn) in insns.iter().enumerate() {
                if u32::from(insn.code) != BPF_JMP | BPF_CALL
                    || insn.src_reg() != 0
                    || insn.imm != BPF_FUNC_tail_call as i32
                {
                    continue;
                }
                let key = at.checked_sub(1).map(|k| &insns[k]);
                let key = key.filter(|k| u32::from(k.code) == BPF_ALU64 | BPF_MOV | BPF_K && k.dst_reg() == 3);
                let Some(key) = key else {
                    panic!("{}: the tail call at instruction {at} has no constant key right before it", f.name);
                };
                assert!(
                    !targets.contains(&(at as i64)),
                    "{}: a jump lands on the tail call at instruction {at}, past its key",
                    f.name
                );
                keys.insert(key.imm as u32);
            }
        }
        // Each slot is called from somewhere.
        let slots: std::collections::BTreeSet<u32> = TAIL_CALLS.iter().map(|&(slot, _)| slot).collect();
        assert_eq!(keys, slots);
    }
}

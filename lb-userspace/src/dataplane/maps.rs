//! Typed handles of every datapath map, taken out of the loaded object once
//! at load: nothing looks a map up by name afterwards, and a wrong name or
//! type fails the load instead of a later update.
use std::{mem::size_of, os::fd::AsFd as _, ptr::NonNull};

use aya::{
    Ebpf,
    maps::{Array, HashMap, IterableMap as _, MapData, MapError, PerCpuArray, ProgramArray},
};
use lb_common::{
    Backend, BackendStats, ClockCache, Conns, EndpointKey, Flood, Flow, Flow6, FlowBucket, FlowBucket6, NextHop,
    RateWindow, SELECT_LANES, SelectWord, Service, Vip6Key, VipKey, maps as names,
};

use super::{
    DataplaneError,
    flows::{Buckets, FlowTable},
};

/// BPF_F_MMAPABLE (linux/bpf.h).
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// A failed operation on the map `map`.
pub(super) fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

/// Take map `name` out of `ebpf` untyped (a map whose value type only the
/// datapath knows).
fn take_raw(ebpf: &mut Ebpf, name: &'static str) -> Result<MapData, DataplaneError> {
    match ebpf.take_map(name) {
        Some(aya::maps::Map::PerCpuArray(m)) => Ok(m),
        _ => Err(DataplaneError::Map { map: name, source: MapError::InvalidName { name: name.to_owned() } }),
    }
}

/// Take map `name` out of `ebpf` as `T`.
fn take<T: TryFrom<aya::maps::Map, Error = MapError>>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<T, DataplaneError> {
    let map = ebpf
        .take_map(name)
        .ok_or(DataplaneError::Map { map: name, source: MapError::InvalidName { name: name.to_owned() } })?;
    T::try_from(map).map_err(map_err(name))
}

/// The SELECT array mapped into our memory (it is created with
/// BPF_F_MMAPABLE): a table is written with plain stores, tens of
/// microseconds for 65,537 entries instead of one syscall per entry.
/// Its elements (`SelectWord`, 8 bytes: no padding) lie back to back,
/// so the mapping is one array of 16-bit entries.
pub(super) struct SelectMemory {
    base: NonNull<u8>,
    len: usize,
    entries: u32,
}

// SAFETY: the mapping is owned by this value alone; the kernel side only
// reads it. Moving it to another thread moves that ownership.
unsafe impl Send for SelectMemory {}

/// The array's element stride (the kernel rounds values up to 8 bytes; a
/// `SelectWord` is 8) and an entry's size in it.
const STRIDE: usize = 8;
const ENTRY: usize = 2;
const _: () = assert!(size_of::<SelectWord>() == STRIDE && STRIDE == ENTRY * SELECT_LANES as usize);

/// Why SELECT could not be memory-mapped (lbd then writes its tables
/// element by element through the kernel, and says why).
#[derive(Debug, thiserror::Error)]
pub(super) enum NotMapped {
    #[error("reading the map's info: {0}")]
    Info(#[source] MapError),
    #[error("the array was created without BPF_F_MMAPABLE")]
    Flags,
    #[error("its {0} elements do not fit this machine's address space")]
    Size(u32),
    #[error("mmap: {0}")]
    Mmap(#[source] rustix::io::Errno),
}

impl SelectMemory {
    /// Map `select`; an error when it cannot be (an array created without
    /// BPF_F_MMAPABLE, or mmap refused), so the caller writes element by
    /// element.
    pub(super) fn map(select: &Array<MapData, SelectWord>) -> Result<Self, NotMapped> {
        let data = select.map();
        let info = data.info().map_err(NotMapped::Info)?;
        if info.map_flags() & BPF_F_MMAPABLE == 0 {
            return Err(NotMapped::Flags);
        }
        let elements = info.max_entries();
        let size = || -> Option<(u32, usize)> {
            Some((elements.checked_mul(SELECT_LANES)?, usize::try_from(elements).ok()?.checked_mul(STRIDE)?))
        };
        let (entries, len) = size().ok_or(NotMapped::Size(elements))?;
        // SAFETY: a fresh shared mapping of the map's fd (no address hint,
        // nothing else aliased); length and offset are what the kernel
        // allows for an mmapable array. Unmapped in Drop.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                data.fd().as_fd(),
                0,
            )
        }
        .map_err(NotMapped::Mmap)?;
        // mmap answers a valid address or an error, never null.
        let base = NonNull::new(base.cast()).ok_or(NotMapped::Mmap(rustix::io::Errno::FAULT))?;
        Ok(Self { base, len, entries })
    }

    /// Write `values` (backend ids) at entries `off..off + values.len()`;
    /// false (nothing written) when that runs past the array.
    pub(super) fn write(&mut self, off: u32, values: &[u16]) -> bool {
        let Some(end) = u32::try_from(values.len()).ok().and_then(|n| off.checked_add(n)) else { return false };
        if end > self.entries {
            return false;
        }
        for (i, &v) in values.iter().enumerate() {
            let at = (off as usize + i) * ENTRY;
            // SAFETY: at + 2 <= len (checked above), the mapping is live
            // and 8-byte aligned, and this region is not in use by any
            // service yet (the caller writes a freshly allocated region
            // before the VIP entry points at it), so no reader races it.
            // Entries of another region sharing the element are other
            // 16-bit words: not touched.
            unsafe { self.base.as_ptr().add(at).cast::<u16>().write_volatile(v) };
        }
        true
    }
}

impl Drop for SelectMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`, once.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// One field per map of `lb_common::maps::ALL`.
pub(super) struct Maps {
    pub(super) vips: HashMap<MapData, VipKey, Service>,
    pub(super) vip_addrs: HashMap<MapData, u32, u32>,
    pub(super) addr_filter: Array<MapData, lb_common::AddrFilter>,
    pub(super) reply_hint: Array<MapData, lb_common::ReplyHint>,
    pub(super) backends: Array<MapData, Backend>,
    pub(super) select: Array<MapData, SelectWord>,
    /// The shared round-robin positions: advanced by the datapath, written
    /// by userspace only when a migration copies them.
    pub(super) seq: Array<MapData, u64>,
    pub(super) flows: FlowTable<FlowBucket>,
    pub(super) backend_stats: PerCpuArray<MapData, BackendStats>,
    pub(super) counters: PerCpuArray<MapData, u64>,
    pub(super) conns: Array<MapData, Conns>,
    pub(super) expired: Array<MapData, u64>,
    pub(super) netdevs: HashMap<MapData, u32, u32>,
    pub(super) netdev_gen: Array<MapData, u32>,
    pub(super) endpoints: HashMap<MapData, EndpointKey, VipKey>,
    /// Written only by the datapath (next hops towards backends); held so
    /// that every map is taken and checked at load.
    pub(super) _next_hops: Array<MapData, NextHop>,
    pub(super) flood: Array<MapData, Flood>,
    /// Written only by the datapath (per-CPU new-flow counts).
    pub(super) _new_flow_rate: PerCpuArray<MapData, RateWindow>,
    pub(super) layout: Array<MapData, u32>,
    pub(super) flow_seed: Array<MapData, u64>,
    /// The datapath's per-CPU scratch entry; held so that every map is
    /// taken and checked at load.
    pub(super) _scratch: PerCpuArray<MapData, Flow>,
    pub(super) vips6: HashMap<MapData, Vip6Key, Service>,
    pub(super) vip_addrs6: HashMap<MapData, [u32; 4], u32>,
    pub(super) backend_addrs6: Array<MapData, [u32; 4]>,
    pub(super) endpoints6: HashMap<MapData, Vip6Key, Vip6Key>,
    pub(super) flows6: FlowTable<FlowBucket6>,
    /// Per-CPU scratch of the IPv6 path (and of FIB lookups); held so
    /// that every map is taken and checked at load.
    pub(super) _scratch6: PerCpuArray<MapData, Flow6>,
    /// The programs the balancer tail-calls (`lb_common::TAIL_CALLS`).
    pub(super) progs: ProgramArray<MapData>,
    /// Per-CPU lookup keys of the IPv6 path (the datapath's own type).
    pub(super) _keys6: MapData,
    /// The datapath's per-CPU idle-clock cache; held so that every map is
    /// taken and checked at load.
    pub(super) _clock: PerCpuArray<MapData, ClockCache>,
    /// Entries per flow table (0: IPv4, 1: IPv6), counted by the datapath,
    /// with the room each CPU took and has not used yet ...
    pub(super) flow_count: Array<MapData, u64>,
    /// ... which is here, per CPU.
    pub(super) flow_credit: PerCpuArray<MapData, u64>,
    /// Connection counts per backend of the flows counted per CPU
    /// (`lb_common::FLOW_CONNS_CPU`) ...
    pub(super) conns_cpu: PerCpuArray<MapData, Conns>,
    /// ... and their sums, as least-conn reads them (written by lbd).
    pub(super) conns_sum: Array<MapData, Conns>,
}

impl<B: Buckets> FlowTable<B> {
    /// The table of `slots` slots out of `ebpf`.
    fn take(ebpf: &mut Ebpf, slots: u32) -> Result<Self, DataplaneError> {
        Ok(Self::new(take(ebpf, B::NAME)?, slots))
    }
}

impl Maps {
    /// The maps out of `ebpf`, whose flow tables have `slots4` and `slots6`
    /// slots.
    pub(super) fn take(ebpf: &mut Ebpf, slots4: u32, slots6: u32) -> Result<Self, DataplaneError> {
        Ok(Self {
            vips: take(ebpf, names::VIPS)?,
            vip_addrs: take(ebpf, names::VIP_ADDRS)?,
            addr_filter: take(ebpf, names::ADDR_FILTER)?,
            reply_hint: take(ebpf, names::REPLY_HINT)?,
            backends: take(ebpf, names::BACKENDS)?,
            select: take(ebpf, names::SELECT)?,
            seq: take(ebpf, names::SEQ)?,
            flows: FlowTable::take(ebpf, slots4)?,
            backend_stats: take(ebpf, names::BACKEND_STATS)?,
            counters: take(ebpf, names::COUNTERS)?,
            conns: take(ebpf, names::CONNS)?,
            expired: take(ebpf, names::EXPIRED)?,
            netdevs: take(ebpf, names::NETDEVS)?,
            netdev_gen: take(ebpf, names::NETDEV_GEN)?,
            endpoints: take(ebpf, names::ENDPOINTS)?,
            _next_hops: take(ebpf, names::NEXT_HOPS)?,
            flood: take(ebpf, names::FLOOD)?,
            _new_flow_rate: take(ebpf, names::NEW_FLOW_RATE)?,
            layout: take(ebpf, names::LAYOUT)?,
            flow_seed: take(ebpf, names::FLOW_SEED)?,
            _scratch: take(ebpf, names::SCRATCH)?,
            vips6: take(ebpf, names::VIPS6)?,
            vip_addrs6: take(ebpf, names::VIP_ADDRS6)?,
            backend_addrs6: take(ebpf, names::BACKEND_ADDRS6)?,
            endpoints6: take(ebpf, names::ENDPOINTS6)?,
            flows6: FlowTable::take(ebpf, slots6)?,
            _scratch6: take(ebpf, names::SCRATCH6)?,
            progs: take(ebpf, names::PROGS)?,
            _keys6: take_raw(ebpf, names::KEYS6)?,
            _clock: take(ebpf, names::CLOCK)?,
            flow_count: take(ebpf, names::FLOW_COUNT)?,
            flow_credit: take(ebpf, names::FLOW_CREDIT)?,
            conns_cpu: take(ebpf, names::CONNS_CPU)?,
            conns_sum: take(ebpf, names::CONNS_SUM)?,
        })
    }
}

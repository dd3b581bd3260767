//! Typed handles of every datapath map, taken out of the loaded object once
//! at load: nothing looks a map up by name afterwards, and a wrong name or
//! type fails the load instead of a later update.
use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, MapError, PerCpuArray},
};
use lb_common::{Backend, BackendStats, Conns, Flow, FlowKey, Service, VipKey, maps as names};

use super::DataplaneError;

/// A failed operation on the map `map`.
pub(super) fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
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

/// One field per map of `lb_common::maps::ALL`.
pub(super) struct Maps {
    pub(super) vips: HashMap<MapData, VipKey, Service>,
    pub(super) vip_addrs: HashMap<MapData, u32, u32>,
    pub(super) addr_filter: Array<MapData, u64>,
    pub(super) backends: Array<MapData, Backend>,
    pub(super) select: Array<MapData, u32>,
    /// Read only by the datapath (the shared round-robin positions); held
    /// so that every map is taken and checked at load.
    pub(super) _seq: Array<MapData, u64>,
    pub(super) flows: HashMap<MapData, FlowKey, Flow>,
    pub(super) backend_stats: PerCpuArray<MapData, BackendStats>,
    pub(super) counters: PerCpuArray<MapData, u64>,
    pub(super) conns: Array<MapData, Conns>,
    pub(super) expired: Array<MapData, u64>,
    pub(super) netdevs: HashMap<MapData, u32, u32>,
    pub(super) netdev_gen: Array<MapData, u32>,
}

impl Maps {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            vips: take(ebpf, names::VIPS)?,
            vip_addrs: take(ebpf, names::VIP_ADDRS)?,
            addr_filter: take(ebpf, names::ADDR_FILTER)?,
            backends: take(ebpf, names::BACKENDS)?,
            select: take(ebpf, names::SELECT)?,
            _seq: take(ebpf, names::SEQ)?,
            flows: take(ebpf, names::FLOWS)?,
            backend_stats: take(ebpf, names::BACKEND_STATS)?,
            counters: take(ebpf, names::COUNTERS)?,
            conns: take(ebpf, names::CONNS)?,
            expired: take(ebpf, names::EXPIRED)?,
            netdevs: take(ebpf, names::NETDEVS)?,
            netdev_gen: take(ebpf, names::NETDEV_GEN)?,
        })
    }
}

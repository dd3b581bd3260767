//! The flow tables as userspace sees them: an array of maps (`FLOW_SLOTS`,
//! `FLOW_SLOTS6`) whose arrays of `lb_common::FLOW_ARRAY_ELEMENTS`
//! elements lbd makes when it creates a table (the kernel allocates each
//! in its linear map: see there). Userspace reads them by element index,
//! an array at a time; the datapath's inserts and removals, and the
//! sweeper's, go through `lb_sweep` in the kernel.
use std::os::fd::AsFd as _;

use aya::{
    Ebpf,
    maps::{Array, ArrayOfMaps, MapData, MapError},
};
use lb_common::{
    FLOW_ARRAY_ELEMENTS, FLOW_ARRAY_ELEMENTS6, FlowBucket, FlowBucket6, SLOT_BUCKET, flow_arrays, maps as names,
};

use tracing::warn;

use super::{DataplaneError, batch, map_err};

/// An element of a flow table (`SLOT_BUCKET` slots of one family), with
/// the map that holds that family's table and how many elements go in
/// each of its arrays: stated once here for the loader, the maps and the
/// sweeper.
pub(super) trait Buckets: aya::Pod + Copy {
    /// The table's outer array (an array of maps).
    const NAME: &'static str;
    /// The name each of its arrays gets (`bpftool map` shows it).
    const ARRAY_NAME: &'static str;
    /// Elements in each of its arrays.
    const PER: u32;
}

impl Buckets for FlowBucket {
    const NAME: &'static str = names::FLOWS;
    const ARRAY_NAME: &'static str = FLOW_ARRAY_NAME;
    const PER: u32 = FLOW_ARRAY_ELEMENTS;
}

impl Buckets for FlowBucket6 {
    const NAME: &'static str = names::FLOWS6;
    const ARRAY_NAME: &'static str = FLOW_ARRAY_NAME6;
    const PER: u32 = FLOW_ARRAY_ELEMENTS6;
}

/// The names of the flow tables' arrays (the kernel keeps 15 bytes of a
/// map's name).
pub const FLOW_ARRAY_NAME: &str = "FLOW_SLOTS_ARR";
pub const FLOW_ARRAY_NAME6: &str = "FLOW_SLOTS6_ARR";

/// Arrays put into the outer array per BPF_MAP_UPDATE_BATCH: each update
/// of an array of maps waits for an RCU grace period (about 9 ms on the
/// development VM), a batch once.
const FILL_BATCH: u32 = 512;

/// One flow table: its outer array, and its size.
pub(super) struct FlowTable<B: Buckets> {
    outer: ArrayOfMaps<MapData, Array<MapData, B>>,
    /// The table's slots (a power of two; the last array may be used in
    /// part).
    slots: u32,
}

impl<B: Buckets> FlowTable<B> {
    pub(super) fn new(outer: ArrayOfMaps<MapData, Array<MapData, B>>, slots: u32) -> Self {
        Self { outer, slots }
    }

    /// The arrays a table of `slots` slots takes (the outer array's size).
    pub(super) fn arrays_for(slots: u32) -> u32 {
        flow_arrays(slots, B::PER)
    }

    /// The table's slots.
    pub(super) fn slots(&self) -> u32 {
        self.slots
    }

    /// Elements in use (`slots / SLOT_BUCKET`).
    pub(super) fn elements(&self) -> u32 {
        self.slots / SLOT_BUCKET
    }

    /// Arrays in the table.
    pub(super) fn arrays(&self) -> u32 {
        Self::arrays_for(self.slots)
    }

    /// Array `i` (a descriptor of its own, closed on drop).
    fn array(&self, i: u32) -> Result<Array<MapData, B>, MapError> {
        self.outer.get(&i, 0)
    }

    /// Element `e` (one array looked up, one element read).
    pub(super) fn element(&self, e: u32) -> Result<B, DataplaneError> {
        self.array(e / B::PER).and_then(|a| a.get(&(e % B::PER), 0)).map_err(map_err(B::NAME))
    }

    /// Write element `e` (tests: one slot's value changed as the datapath
    /// would, between packets).
    pub(super) fn set_element(&self, e: u32, b: B) -> Result<(), DataplaneError> {
        self.array(e / B::PER).and_then(|mut a| a.set(e % B::PER, b, 0)).map_err(map_err(B::NAME))
    }

    /// Call `f` with (element index, element) for each element in use of
    /// array `i`, read in one batch. Returns how many elements that was.
    pub(super) fn read_array(&self, i: u32, mut f: impl FnMut(u32, &B)) -> Result<u32, DataplaneError> {
        let array = self.array(i).map_err(map_err(B::NAME))?;
        let first = i * B::PER;
        let n = B::PER.min(self.elements().saturating_sub(first));
        let mut walk = batch::Walk::<u32, B>::with_chunk(B::PER as usize);
        while !walk.done() {
            walk.next(aya::maps::IterableMap::map(&array).fd().as_fd(), false, |&e, b| {
                if e < n {
                    f(first + e, b);
                }
            })
            .map_err(|source| DataplaneError::Batch { map: B::NAME, source })?;
        }
        Ok(n)
    }

    /// Call `f` with every element in use, an array at a time.
    pub(super) fn for_each(&self, mut f: impl FnMut(u32, &B)) -> Result<(), DataplaneError> {
        for i in 0..self.arrays() {
            self.read_array(i, &mut f)?;
        }
        Ok(())
    }

    /// Write every element in use empty (zeros), an array at a time.
    pub(super) fn clear(&self) -> Result<(), DataplaneError> {
        // SAFETY: B is Pod (integers only): all zeros is a valid value,
        // the empty element.
        let zeros = vec![unsafe { std::mem::zeroed::<B>() }; B::PER as usize];
        for i in 0..self.arrays() {
            let array = self.array(i).map_err(map_err(B::NAME))?;
            let n = B::PER.min(self.elements() - i * B::PER);
            let keys: Vec<u32> = (0..n).collect();
            batch::update(aya::maps::IterableMap::map(&array).fd().as_fd(), &keys, &zeros[..n as usize])
                .map_err(|source| DataplaneError::Batch { map: B::NAME, source })?;
        }
        Ok(())
    }

    /// Make the arrays of this family's table in `ebpf` (just created by
    /// the loader, empty) and put them in it (`fill_arrays`). Warns when
    /// some of them fell back to vmalloc: the table works the same, but a
    /// new flow's slot in them also costs a page walk. `before` is
    /// [`small_vmalloc_arrays`] read just before; returns it read after,
    /// which is the next table's `before` (one read fewer).
    pub(super) fn fill(ebpf: &mut Ebpf, before: Option<usize>) -> Result<Option<usize>, MapError> {
        let n = fill_arrays::<B>(ebpf, B::NAME, B::ARRAY_NAME, B::PER)?;
        let after = small_vmalloc_arrays();
        if let (Some(before), Some(after)) = (before, after)
            && after > before
        {
            warn!(
                map = B::NAME,
                arrays = n,
                in_vmalloc = after - before,
                "about {} of the flow table's {n} arrays are in vmalloc'd memory (4 KB pages), not the kernel's linear map: the kernel found no free 32 KB blocks (fragmented memory). Flows work the same; a new flow whose slot is in one costs more (a TLB miss and a page walk). A fresh start once memory is less fragmented (or after a reboot) allocates them again",
                after - before
            );
        }
        Ok(after)
    }
}

/// Make the arrays of the array of maps `name` in `ebpf` (just created by
/// the loader, empty), `per` elements of `B` each, named `array_name`,
/// and put them in it, a batch at a time. The outer array holds them
/// from then on. Returns how many arrays that was. An error is the
/// loader's kind for a map it could not create, under the outer array's
/// name (the caller says what takes the memory). Public for lb-bench,
/// whose table alone is made the same way.
///
/// The batches are made on one thread per CPU (`on_cpus`): each array is
/// a syscall that allocates and charges its memory, each batch's update
/// waits for an RCU grace period, and neither holds a lock the others
/// wait for (a table of 1M flows is thousands of arrays: 0.6-0.85 s on
/// one thread on a 2-core VM). After an error, arrays already put in
/// stay in the outer array, which the caller drops.
pub fn fill_arrays<B: aya::Pod>(ebpf: &mut Ebpf, name: &str, array_name: &str, per: u32) -> Result<u32, MapError> {
    let outer = ebpf.map(name).ok_or_else(|| MapError::InvalidName { name: name.to_owned() })?;
    let aya::maps::Map::ArrayOfMaps(outer) = outer else {
        return Err(MapError::InvalidName { name: name.to_owned() });
    };
    let n = outer.info()?.max_entries();
    let outer = outer.fd().as_fd();
    super::on_cpus(0..n.div_ceil(FILL_BATCH), |b| {
        let first = b * FILL_BATCH;
        let arrays = (first..n.min(first + FILL_BATCH))
            .map(|_| {
                named_array::<B>(array_name, per).map_err(|e| match e {
                    MapError::CreateError { io_error, .. } => MapError::CreateError { name: name.to_owned(), io_error },
                    e => e,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fds: Vec<_> = arrays.iter().map(|a| aya::maps::IterableMap::map(a).fd().as_fd()).collect();
        super::set_inner_maps(outer, first, &fds).map_err(|io_error| {
            MapError::SyscallError(aya::sys::SyscallError { call: "bpf_map_update_batch", io_error })
        })
    })?;
    Ok(n)
}

/// A new BPF array of `per` elements of `B` named `name`: aya's
/// `Array::create` names every array it makes `standalone_array`, which
/// would list a table's thousands of arrays in `bpftool map` under a name
/// that says nothing of whose they are.
fn named_array<B: aya::Pod>(name: &str, per: u32) -> Result<Array<MapData, B>, MapError> {
    let def = aya_obj::Map::new_from_params(
        aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
        size_of::<u32>() as u32,
        size_of::<B>() as u32,
        per,
        0,
    );
    Array::try_from(aya::maps::Map::Array(MapData::create(def, name, None)?))
}

/// BPF arrays of 64 KB or less that the kernel allocated with vmalloc (in
/// 4 KB pages) rather than kmalloc, any process's, by `/proc/vmallocinfo`
/// (None when it cannot be read: it is root's). The kernel allocates an
/// array of up to 32 KB with kmalloc, and falls back to vmalloc when it
/// finds no free block that size. Counted before and after making a
/// table's arrays, the difference is about how many of them fell back
/// (another process's arrays made meanwhile count too).
pub fn small_vmalloc_arrays() -> Option<usize> {
    std::fs::read_to_string("/proc/vmallocinfo").ok().map(|info| count_small_vmalloc_arrays(&info))
}

/// [`small_vmalloc_arrays`] of `/proc/vmallocinfo`'s text: lines of an
/// area made by `array_map_alloc` whose size (second field, bytes, with
/// the guard page) is at most 64 KB.
fn count_small_vmalloc_arrays(info: &str) -> usize {
    info.lines()
        .filter(|l| l.contains("array_map_alloc"))
        .filter(|l| l.split_whitespace().nth(1).and_then(|b| b.parse::<u64>().ok()).is_some_and(|b| b <= 65536))
        .count()
}

#[cfg(test)]
mod tests {
    use super::count_small_vmalloc_arrays;

    #[test]
    fn only_small_bpf_arrays_in_vmalloc_are_counted() {
        let info = "\
0xffffc90000000000-0xffffc90000009000   36864 bpf_map_area_alloc+0x3c/0x60 pages=8 vmalloc N0=8
0xffffc90000009000-0xffffc90000012000   36864 array_map_alloc+0x9b/0x2a0 pages=8 vmalloc N0=8
0xffffc90000012000-0xffffc90000015000   12288 array_map_alloc+0x9b/0x2a0 pages=2 vmalloc N0=2
0xffffc90000100000-0xffffc90004101000 67112960 array_map_alloc+0x9b/0x2a0 pages=16384 vmalloc vpages N0=16384
0xffffc90004101000-0xffffc90004104000   12288 load_module+0x1e1/0x2010 pages=2 vmalloc N0=2
";
        assert_eq!(count_small_vmalloc_arrays(info), 2);
        assert_eq!(count_small_vmalloc_arrays(""), 0);
    }
}

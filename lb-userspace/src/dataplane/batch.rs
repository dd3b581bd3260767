//! Batched operations on a BPF map: BPF_MAP_LOOKUP_BATCH,
//! BPF_MAP_LOOKUP_AND_DELETE_BATCH and BPF_MAP_DELETE_BATCH on hash maps,
//! BPF_MAP_LOOKUP_BATCH and BPF_MAP_UPDATE_BATCH on arrays too.
//!
//! Kept here, on bpf(2) itself (`sys::bpf`), because aya 0.14 has no
//! batch operations: walking a map through aya's iterator costs two
//! syscalls per entry (next key, lookup), which at a million flows is
//! seconds of the sweeper's time; a batch costs one syscall per chunk of
//! thousands.
use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

/// The `batch` member of `union bpf_attr` (linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

use super::sys::{BPF_MAP_DELETE_BATCH, BPF_MAP_LOOKUP_AND_DELETE_BATCH, BPF_MAP_LOOKUP_BATCH, BPF_MAP_UPDATE_BATCH};

/// Entries per lookup chunk. A hash map's batch never splits a bucket, so
/// a chunk must hold the longest bucket: far more than any bucket has.
const CHUNK: usize = 8192;

fn bpf_batch(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid bpf_attr prefix for the batch commands; the
    // buffers it points at outlive the call (the callers' locals).
    unsafe { super::sys::bpf(cmd, attr) }.map(drop)
}

/// A walk over a hash map in chunks of up to [`CHUNK`] entries, one
/// syscall each, which can be paused between chunks (the map may change
/// meanwhile: entries added or removed may or may not be seen).
pub(super) struct Walk<K, V> {
    /// Entries per chunk.
    chunk: usize,
    keys: Vec<u8>,
    values: Vec<u8>,
    /// Where the next chunk starts (the kernel's token); None: the start.
    token: Option<u64>,
    done: bool,
    kv: std::marker::PhantomData<fn(K, V)>,
}

impl<K: aya::Pod, V: aya::Pod> Walk<K, V> {
    pub(super) fn new() -> Self {
        Self::with_chunk(CHUNK)
    }

    /// A walk of `chunk` entries a step (an array's elements may be large).
    pub(super) fn with_chunk(chunk: usize) -> Self {
        Self {
            chunk,
            keys: vec![0u8; chunk * size_of::<K>()],
            values: vec![0u8; chunk * size_of::<V>()],
            token: None,
            done: false,
            kv: std::marker::PhantomData,
        }
    }

    pub(super) fn done(&self) -> bool {
        self.done
    }

    /// Call `f` with each (key, value) of the next chunk of the hash map
    /// `fd`, deleting the chunk as it is read when `delete` is set.
    /// Returns how many it read; the walk is done once the map has no more.
    pub(super) fn next(&mut self, fd: BorrowedFd<'_>, delete: bool, mut f: impl FnMut(&K, &V)) -> io::Result<u64> {
        if self.done {
            return Ok(0);
        }
        let (ks, vs) = (size_of::<K>(), size_of::<V>());
        let mut token_out = 0u64;
        let mut attr = BatchAttr {
            in_batch: self.token.as_ref().map_or(0, |t| std::ptr::from_ref(t) as u64),
            out_batch: std::ptr::from_mut(&mut token_out) as u64,
            keys: self.keys.as_mut_ptr() as u64,
            values: self.values.as_mut_ptr() as u64,
            count: self.chunk as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let cmd = if delete { BPF_MAP_LOOKUP_AND_DELETE_BATCH } else { BPF_MAP_LOOKUP_BATCH };
        let rc = bpf_batch(cmd, &mut attr);
        // On ENOENT (the end) the last entries are still returned.
        let n = attr.count as usize;
        for i in 0..n.min(self.chunk) {
            // SAFETY: the kernel wrote `n` keys and values of these sizes
            // (the buffers were sized for K and V); K and V are Pod, so
            // any bytes are valid values of them.
            let (k, v) = unsafe {
                (
                    self.keys.as_ptr().add(i * ks).cast::<K>().read_unaligned(),
                    self.values.as_ptr().add(i * vs).cast::<V>().read_unaligned(),
                )
            };
            f(&k, &v);
        }
        match rc {
            Ok(()) => self.token = Some(token_out),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => self.done = true,
            Err(e) => return Err(e),
        }
        Ok(n as u64)
    }
}

/// Call `f` with every (key, value) of the hash map `fd`, read in chunks,
/// deleting each chunk as it is read when `delete` is set. Entries added
/// or removed meanwhile may or may not be seen. Returns the number seen.
fn walk<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>, delete: bool, mut f: impl FnMut(&K, &V)) -> io::Result<u64> {
    let mut w = Walk::<K, V>::new();
    let mut total = 0;
    while !w.done() {
        total += w.next(fd, delete, &mut f)?;
    }
    Ok(total)
}

/// Call `f` with every (key, value) of the hash map `fd`.
pub(super) fn for_each<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>, f: impl FnMut(&K, &V)) -> io::Result<u64> {
    walk(fd, false, f)
}

/// Empty the hash map `fd`; returns the number of entries removed.
pub(super) fn drain<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>) -> io::Result<u64> {
    walk::<K, V>(fd, true, |_, _| {})
}

/// Delete `keys` from the hash map `fd`. Returns, per key, whether this
/// call removed it (false: it was not there, e.g. evicted meanwhile).
pub(super) fn delete<K: aya::Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> io::Result<Vec<bool>> {
    let mut removed = vec![false; keys.len()];
    let mut at = 0;
    while at < keys.len() {
        let rest = &keys[at..];
        let mut attr = BatchAttr {
            keys: rest.as_ptr() as u64,
            count: u32::try_from(rest.len()).unwrap_or(u32::MAX),
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let rc = bpf_batch(BPF_MAP_DELETE_BATCH, &mut attr);
        // The kernel stops at the first key it cannot delete; `count` says
        // how many before it were deleted.
        let done = attr.count as usize;
        removed[at..at + done.min(rest.len())].fill(true);
        match rc {
            Ok(()) => return Ok(removed),
            // That key was missing: skip it and go on.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => at += done + 1,
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// Write `values[i]` at `keys[i]` in the map `fd`, in chunks of up to
/// [`CHUNK`] (one syscall each).
pub(super) fn update<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>, keys: &[K], values: &[V]) -> io::Result<()> {
    assert_eq!(keys.len(), values.len(), "a value per key");
    for (ks, vs) in keys.chunks(CHUNK).zip(values.chunks(CHUNK)) {
        let mut attr = BatchAttr {
            keys: ks.as_ptr() as u64,
            values: vs.as_ptr() as u64,
            count: ks.len() as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        bpf_batch(BPF_MAP_UPDATE_BATCH, &mut attr)?;
        if attr.count as usize != ks.len() {
            return Err(io::Error::other(format!("{} of {} entries written", attr.count, ks.len())));
        }
    }
    Ok(())
}

//! What one random load costs in memory the size of the flow table, on the
//! measuring CPU, in the same run as the per-packet figures.
//!
//! A new flow's slot is a random place in an array of hundreds of
//! megabytes (640 MB at 4M connections), which neither the caches nor the
//! TLB hold: whatever else a new flow does, it waits for that load. The
//! kernel allocates a BPF array with vmalloc in 4 KB pages, so every such
//! load also walks the page tables (in a VM, both the guest's and the
//! host's). This times that load from userspace: a pointer chase (each
//! load's address comes from the one before, so nothing overlaps) through
//! every cache line of an anonymous mapping of the same size, in a random
//! order, with 4 KB pages as the kernel's, and again with 2 MB pages
//! where the kernel gives them (transparent huge pages), to show what the
//! page walk costs.
use std::{num::NonZeroUsize, ptr::NonNull, time::Instant};

use anyhow::Context as _;
use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags, madvise, mmap_anonymous, munmap};

/// A cache line: the chase touches one word of each line it visits.
const LINE: usize = 64;
/// Loads timed per round (fewer in a region of fewer lines).
const STEPS: usize = 1 << 20;

/// An anonymous mapping, unmapped when dropped.
struct Region {
    base: NonNull<u8>,
    len: usize,
}

impl Region {
    fn new(len: usize, huge: bool) -> anyhow::Result<Self> {
        let size = NonZeroUsize::new(len).context("an empty region")?;
        // SAFETY: a fresh private anonymous mapping, no address hint.
        let base =
            unsafe { mmap_anonymous(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_PRIVATE) }
                .context("mmap")?
                .cast::<u8>();
        let region = Self { base, len };
        let advice = if huge { MmapAdvise::MADV_HUGEPAGE } else { MmapAdvise::MADV_NOHUGEPAGE };
        // SAFETY: advice on exactly this mapping.
        unsafe { madvise(base.cast(), len, advice) }.context("madvise")?;
        // Every page in place before timing (a fault is not a load).
        for off in (0..len).step_by(4096) {
            // SAFETY: inside the mapping.
            unsafe { base.as_ptr().add(off).write_volatile(1) };
        }
        Ok(region)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`, once.
        let _ = unsafe { munmap(self.base.cast(), self.len) };
    }
}

/// The process's anonymous memory in huge pages now, in kB
/// (`/proc/self/smaps_rollup`).
fn anon_huge_kb() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("AnonHugePages:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// One chase per page size, each timed `rounds` times.
pub(crate) struct Latency {
    /// ns per load, one per round, 4 KB pages.
    pub small_pages_ns: Vec<f64>,
    /// The same with 2 MB pages; None when the kernel gave the region
    /// (almost) none.
    pub huge_pages_ns: Option<Vec<f64>>,
}

/// Time random loads in `bytes` of memory, `rounds` times per page size.
pub(crate) fn random_load(bytes: usize, rounds: usize) -> anyhow::Result<Latency> {
    let small_pages_ns = chase(bytes, false, rounds)?.0;
    let before = anon_huge_kb();
    let (huge, huge_kb) = chase(bytes, true, rounds)?;
    // Most of the region in huge pages, or the figure is not theirs.
    let huge_pages_ns = (huge_kb.saturating_sub(before) * 1024 >= bytes as u64 * 3 / 4).then_some(huge);
    Ok(Latency { small_pages_ns, huge_pages_ns })
}

/// The chase in one region; also answers the huge pages it held (kB).
fn chase(bytes: usize, huge: bool, rounds: usize) -> anyhow::Result<(Vec<f64>, u64)> {
    let lines = bytes / LINE;
    anyhow::ensure!(lines >= 2, "{bytes} bytes: too small a region to time");
    let steps = STEPS.min(lines);
    let region = Region::new(bytes, huge)?;
    let huge_kb = anon_huge_kb();
    // Every line of the region in a random order (Fisher-Yates with
    // xorshift), linked into one cycle: each line's first word holds the
    // address of the next. All of them, as a new flow's slot may be any:
    // a subset would leave part of the walk in the caches.
    let mut order: Vec<u32> = (0..u32::try_from(lines).context("a region of over 2^32 lines")?).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..lines).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let at = |line: usize| -> *mut usize {
        // SAFETY: line < lines, so the word lies inside the mapping.
        unsafe { region.base.as_ptr().add(line * LINE).cast::<usize>() }
    };
    for (i, &line) in order.iter().enumerate() {
        let next = order[(i + 1) % lines];
        // SAFETY: an aligned word inside the mapping.
        unsafe { at(line as usize).write(at(next as usize) as usize) };
    }
    let first = order[0] as usize;
    drop(order);
    let walk = |steps: usize, from: *const usize| -> *const usize {
        let mut p = from;
        for _ in 0..steps {
            // SAFETY: every word on the cycle holds the address of another
            // word on it, inside the mapping.
            p = unsafe { p.read_volatile() } as *const usize;
        }
        p
    };
    let mut p = walk(steps / 8, at(first));
    let mut ns = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        p = walk(steps, p);
        ns.push(t.elapsed().as_secs_f64() * 1e9 / steps as f64);
    }
    std::hint::black_box(p);
    Ok((ns, huge_kb))
}

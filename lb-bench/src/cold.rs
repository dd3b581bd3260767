//! What a packet costs when what it touches is not in the caches.
//!
//! The per-packet rounds time one packet over and over: after the first
//! repeat, the program's code, the map values it reads and their page
//! translations are all in the caches and the TLB. A gateway does other
//! work between two packets of a flow (in the lab, the client's and three
//! backends' TCP stacks on the same two CPUs), and there the XDP program's
//! own run time per packet was several times the rounds' figures. This
//! times single runs (BPF_PROG_TEST_RUN with one repeat, so the frame is
//! fresh each time and no harness restores it) after reading a buffer on
//! the measuring CPU, at two depths: twice its private caches (L1 and L2
//! are evicted, the last-level cache keeps the program's code and hot
//! values), and four times its last-level cache (every cache and the data
//! TLB; in a VM every page walk is then cold too). What a gateway sees
//! lies between. Each case alternates with its base, the same way in with
//! nothing to do (the harness in front of `floor_pass` for a case that
//! goes through the harness, `floor_pass` itself for one run directly),
//! evicted the same way: the difference is the program's own cost at
//! that depth. Every run is checked as the rounds' runs are
//! (`Bench::measure_after`).
use anyhow::Context as _;

use crate::{cases::Item, measure::Bench};

/// The least the whole-cache eviction reads, whatever the caches say.
const MIN_EVICT_ALL: usize = 32 << 20;
/// A cache line: one read per line evicts it.
const LINE: usize = 64;

/// How much the runs find evicted.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Depth {
    /// The CPU's own caches (L1, L2): twice the largest of them is read.
    /// The last-level cache keeps what it held, as on a gateway whose
    /// other work between two packets fits in it.
    Private,
    /// Every cache: four times the last-level cache is read, at least
    /// [`MIN_EVICT_ALL`].
    All,
}

impl Depth {
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Self::Private => "private caches (L1, L2) evicted",
            Self::All => "all caches evicted",
        }
    }

    pub(crate) const fn key(self) -> &'static str {
        match self {
            Self::Private => "private",
            Self::All => "all",
        }
    }
}

/// A buffer whose reading evicts the measuring CPU's caches.
pub(crate) struct Evictor {
    words: Vec<u64>,
}

impl Evictor {
    /// The buffer for `depth` on `cpu` (sizes from sysfs); None when sysfs
    /// lists no cache below the last level (nothing private to evict).
    pub(crate) fn new(cpu: usize, depth: Depth) -> Option<Self> {
        let caches = caches(cpu);
        let last = caches.iter().map(|&(level, _)| level).max();
        let bytes = match depth {
            Depth::Private => 2 * caches.iter().filter(|&&(level, _)| Some(level) != last).map(|&(_, b)| b).max()?,
            Depth::All => (4 * caches.iter().map(|&(_, b)| b).max().unwrap_or(0)).max(MIN_EVICT_ALL),
        };
        // Every page written once, so that no read faults.
        Some(Self { words: (0..bytes / 8).map(|i| i as u64).collect() })
    }

    pub(crate) fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Read one word of every line, in order (the prefetchers make it
    /// quick), and keep the sum alive so that the reads are not dropped.
    pub(crate) fn evict(&self) {
        let step = LINE / 8;
        let mut sum = 0u64;
        for w in self.words.iter().step_by(step) {
            // SAFETY: a reference to an element of the vector, read once.
            sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(w) });
        }
        std::hint::black_box(sum);
    }
}

/// The caches sysfs lists for `cpu`: (level, bytes) each.
fn caches(cpu: usize) -> Vec<(u32, usize)> {
    let dir = format!("/sys/devices/system/cpu/cpu{cpu}/cache");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
            Some((read("level")?.trim().parse().ok()?, parse_size(read("size")?.trim())?))
        })
        .collect()
}

/// A sysfs cache size ("512K", "8192K", "32M") in bytes.
fn parse_size(s: &str) -> Option<usize> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: usize = num.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        "G" => Some(n << 30),
        _ => None,
    }
}

/// One case's cold runs and its base's, in ns each.
pub(crate) struct Cold<'a> {
    pub case: &'a Item,
    pub base: &'a Item,
    pub case_ns: Vec<f64>,
    pub base_ns: Vec<f64>,
}

/// Runs of every pair made before a time budget may end the measurement.
pub(crate) const MIN_RUNS: usize = 50;

/// `runs` cold runs of every (case, base) pair, interleaved: case, base,
/// next pair, ... so that drift during the measurement falls on both; or
/// fewer, but at least [`MIN_RUNS`], when `budget` (if any) has passed.
/// The budget is for the whole-cache depth on a machine whose sysfs gives
/// a large last-level cache: one eviction there reads four times it (2 GB
/// on an Intel VM that gives 504 MB), and 300 runs of three pairs took
/// about four minutes of a short bench (4 December 2026). The runs of
/// each case are its `case_ns.len()`.
pub(crate) fn measure<'a>(
    b: &mut Bench,
    ev: &Evictor,
    pairs: &[(&'a Item, &'a Item)],
    runs: usize,
    budget: Option<std::time::Duration>,
) -> anyhow::Result<Vec<Cold<'a>>> {
    let t0 = std::time::Instant::now();
    let mut out: Vec<Cold<'a>> = pairs
        .iter()
        .map(|&(case, base)| Cold { case, base, case_ns: Vec::with_capacity(runs), base_ns: Vec::with_capacity(runs) })
        .collect();
    for run in 0..runs {
        if run >= MIN_RUNS && budget.is_some_and(|d| t0.elapsed() >= d) {
            break;
        }
        for c in &mut out {
            for (item, ns) in [(c.case, &mut c.case_ns), (c.base, &mut c.base_ns)] {
                let s = b
                    .measure_after(item, 1, &mut || ev.evict())
                    .with_context(|| format!("cold run {run}, {}", item.label))?;
                ns.push(s.ns);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_sizes() {
        assert_eq!(parse_size("512K"), Some(512 << 10));
        assert_eq!(parse_size("32M"), Some(32 << 20));
        assert_eq!(parse_size("64"), Some(64));
        assert_eq!(parse_size("8X"), None);
        assert_eq!(parse_size(""), None);
    }
}

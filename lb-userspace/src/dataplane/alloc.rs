//! The dataplane's allocators: backend and service ids, and regions of the
//! SELECT array for selection tables. Pure bookkeeping, tested here; the
//! dataplane writes the maps.
use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

/// How long a freed table region stays untouched before reuse.
pub(super) const REGION_GRACE: Duration = Duration::from_millis(200);

/// First-fit allocator over the SELECT array with a grace period on frees.
pub(super) struct Regions {
    free: Vec<(u32, u32)>,
    pending: Vec<(u32, u32, Instant)>,
}

impl Regions {
    pub(super) fn new(capacity: u32) -> Self {
        Self { free: vec![(0, capacity)], pending: Vec::new() }
    }

    pub(super) fn release_expired(&mut self, now: Instant) {
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

    pub(super) fn alloc(&mut self, len: u32) -> Option<u32> {
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

    pub(super) fn free(&mut self, off: u32, len: u32) {
        self.pending.push((off, len, Instant::now()));
    }

    /// Mark `[off, off + len)` as in use (a region found in adopted maps).
    pub(super) fn reserve(&mut self, off: u32, len: u32) -> bool {
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
pub(super) struct Ids {
    limit: u32,
    next: u32,
    used: HashSet<u32>,
}

impl Ids {
    pub(super) fn new(limit: u32) -> Self {
        Self { limit, next: 1, used: HashSet::new() }
    }

    pub(super) fn alloc(&mut self) -> Option<u32> {
        for _ in 0..self.limit {
            let id = self.next;
            self.next = if self.next + 1 >= self.limit { 1 } else { self.next + 1 };
            if self.used.insert(id) {
                return Some(id);
            }
        }
        None
    }

    pub(super) fn release(&mut self, id: u32) {
        self.used.remove(&id);
    }

    pub(super) fn reserve(&mut self, id: u32) -> bool {
        id > 0 && id < self.limit && self.used.insert(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_first_fit_and_reused_only_after_the_grace_period() {
        let mut r = Regions::new(100);
        assert_eq!(r.alloc(40), Some(0));
        assert_eq!(r.alloc(40), Some(40));
        assert_eq!(r.alloc(30), None, "20 left");
        r.free(0, 40);
        let t = Instant::now();
        // Not at once: a packet may still read the old table. alloc waits
        // for the grace period rather than fail while a region is pending.
        assert_eq!(r.alloc(30), Some(0));
        assert!(t.elapsed() >= REGION_GRACE, "reused after {:?}", t.elapsed());
        // 10 left at 30..40 and 20 at 80..100: neither holds 25.
        assert_eq!(r.alloc(25), None);
        assert_eq!(r.alloc(20), Some(80));
        assert_eq!(r.alloc(10), Some(30));
    }

    #[test]
    fn freed_neighbours_merge() {
        let mut r = Regions::new(90);
        let (a, b, c) = (r.alloc(30).unwrap(), r.alloc(30).unwrap(), r.alloc(30).unwrap());
        r.free(a, 30);
        r.free(c, 30);
        r.free(b, 30);
        r.release_expired(Instant::now() + REGION_GRACE);
        assert_eq!(r.free, vec![(0, 90)]);
        assert_eq!(r.alloc(90), Some(0));
    }

    #[test]
    fn reserving_an_adopted_region_splits_the_free_space() {
        let mut r = Regions::new(100);
        assert!(r.reserve(20, 30));
        assert!(!r.reserve(40, 20), "overlaps the reserved region");
        assert_eq!(r.free, vec![(0, 20), (50, 50)]);
        assert_eq!(r.alloc(25), Some(50));
        assert_eq!(r.alloc(20), Some(0));
    }

    #[test]
    fn ids_prefer_ones_never_used_and_run_out_cleanly() {
        let mut ids = Ids::new(4); // ids 1..=3
        assert_eq!((ids.alloc(), ids.alloc()), (Some(1), Some(2)));
        ids.release(1);
        // 3 has never been used: it comes before the released 1.
        assert_eq!(ids.alloc(), Some(3));
        assert_eq!(ids.alloc(), Some(1));
        assert_eq!(ids.alloc(), None, "all of 1..=3 in use");
        ids.release(2);
        assert_eq!(ids.alloc(), Some(2));
    }

    #[test]
    fn reserving_ids_found_in_adopted_maps() {
        let mut ids = Ids::new(4);
        assert!(ids.reserve(2));
        assert!(!ids.reserve(2), "already taken");
        assert!(!ids.reserve(0) && !ids.reserve(4), "0 is reserved, 4 is past the limit");
        assert_eq!((ids.alloc(), ids.alloc(), ids.alloc()), (Some(1), Some(3), None));
    }
}

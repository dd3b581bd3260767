//! Weighted round robin as a precomputed sequence.
//!
//! The datapath walks a selection table with one shared counter, so a
//! scheduler here is just "one full cycle of picks". [`sequence`] uses the
//! smooth weighted round robin of nginx: on every pick each backend's
//! `current` grows by its weight, the backend with the largest `current` is
//! picked and the total weight is subtracted from it. After `sum(weights)`
//! picks every `current` is back to 0, so the cycle repeats exactly, each
//! backend appears `weight` times per cycle and its picks are spread out
//! instead of bunched together (5:1:1 gives `a a b a c a a`, not
//! `a a a a a b c`).

use std::fmt;

/// One backend for the round-robin schedulers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrrBackend {
    /// Value emitted in the sequence (16 bits, as the datapath's
    /// selection tables hold backend ids).
    pub id: u16,
    /// Relative number of picks per cycle; 0 means never picked.
    pub weight: u32,
}

/// Why a sequence could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrrError {
    /// One cycle (the sum of the gcd-reduced weights) is longer than allowed.
    TooLong { total: u64, max: u64 },
}

impl fmt::Display for WrrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLong { total, max } => {
                write!(f, "weighted round robin cycle of {total} picks exceeds the limit of {max}")
            }
        }
    }
}

impl std::error::Error for WrrError {}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Divides the weights by the gcd of the nonzero ones (5:5:10 -> 1:1:2) so
/// cycles stay short. Zero weights stay 0; an all-zero (or empty) input is
/// returned unchanged.
pub fn reduce(weights: &[u32]) -> Vec<u32> {
    let g = weights.iter().fold(0, |g, &w| gcd(g, w));
    if g <= 1 {
        return weights.to_vec();
    }
    weights.iter().map(|&w| w / g).collect()
}

/// `n` picks of the smooth weighted round robin over `weights`, as indexes
/// into `weights`, starting from all-zero state. Ties go to the lowest index.
/// Zero weights are never picked; `weights` must have a nonzero entry if
/// `n > 0`.
fn smooth_picks(weights: &[u32], n: u64) -> Vec<usize> {
    let total: i128 = weights.iter().map(|&w| i128::from(w)).sum();
    let mut current = vec![0i128; weights.len()];
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let mut best: Option<usize> = None;
        for (i, &w) in weights.iter().enumerate() {
            if w == 0 {
                continue;
            }
            current[i] += i128::from(w);
            // Strictly greater: on a tie the earlier backend keeps the pick.
            if best.is_none_or(|b| current[i] > current[b]) {
                best = Some(i);
            }
        }
        let Some(b) = best else { break };
        current[b] -= total;
        out.push(b);
    }
    out
}

/// One full cycle of the smooth weighted round robin, as backend ids.
///
/// Weights are first reduced by the gcd of the nonzero weights, so the cycle
/// has `sum(weights) / gcd` picks and each backend appears `weight / gcd`
/// times. Weight-0 backends never appear. Ties are broken by list order
/// (first wins). An empty list or all-zero weights give an empty `Vec`.
///
/// # Errors
///
/// [`WrrError::TooLong`] if the reduced cycle is longer than `max_len`
/// (checked before anything is allocated).
pub fn sequence(backends: &[WrrBackend], max_len: u64) -> Result<Vec<u16>, WrrError> {
    let weights: Vec<u32> = backends.iter().map(|b| b.weight).collect();
    let weights = reduce(&weights);
    let total = weights.iter().fold(0u64, |t, &w| t.saturating_add(u64::from(w)));
    if total > max_len {
        return Err(WrrError::TooLong { total, max: max_len });
    }
    Ok(smooth_picks(&weights, total).into_iter().map(|i| backends[i].id).collect())
}

/// Plain round robin: each backend with a weight > 0 once, in list order
/// (the weight's value is otherwise ignored).
pub fn round_robin(backends: &[WrrBackend]) -> Vec<u16> {
    backends.iter().filter(|b| b.weight > 0).map(|b| b.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u64 = 1 << 20;

    fn backends(weights: &[u32]) -> Vec<WrrBackend> {
        weights.iter().enumerate().map(|(i, &w)| WrrBackend { id: i as u16 + 1, weight: w }).collect()
    }

    /// Fixed-seed xorshift64*, for reproducible pseudo-random weight sets.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    fn weight_sets() -> Vec<Vec<u32>> {
        let mut sets: Vec<Vec<u32>> = vec![
            vec![5, 1, 1],
            vec![5, 3, 2],
            vec![1, 1, 1],
            vec![3, 0, 2],
            vec![100, 1],
            vec![1, 100],
            vec![7, 11, 13, 17],
            (1..=20).collect(),
            vec![5, 5, 10],
            vec![0, 4, 0, 6, 0],
            vec![1000, 999, 1],
            vec![2, 2],
            vec![42],
            vec![0, 9],
        ];
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        for _ in 0..40 {
            let n = 2 + (rng.next() % 12) as usize;
            let max_w = [3u64, 10, 50, 200][(rng.next() % 4) as usize];
            let mut set: Vec<u32> = (0..n).map(|_| (rng.next() % (max_w + 1)) as u32).collect();
            if set.iter().all(|&w| w == 0) {
                set[0] = 1;
            }
            sets.push(set);
        }
        sets
    }

    /// Longest run of consecutive equal ids for `id`, treating `seq` as a
    /// circle.
    fn longest_circular_run(seq: &[u16], id: u16) -> usize {
        let n = seq.len();
        if n == 0 {
            return 0;
        }
        if seq.iter().all(|&x| x == id) {
            return n;
        }
        let mut best = 0;
        let mut run = 0;
        // Two passes cover runs that wrap around the end.
        for k in 0..2 * n {
            if seq[k % n] == id {
                run += 1;
                best = best.max(run);
            } else {
                run = 0;
            }
        }
        best
    }

    #[test]
    fn each_backend_appears_weight_over_gcd_times() {
        for set in weight_sets() {
            let bs = backends(&set);
            let seq = sequence(&bs, MAX).unwrap();
            let reduced = reduce(&set);
            let g = set.iter().fold(0, |g, &w| gcd(g, w));
            assert_eq!(seq.len() as u64, reduced.iter().map(|&w| u64::from(w)).sum::<u64>());
            for (b, &r) in bs.iter().zip(&reduced) {
                assert_eq!(r, b.weight / g);
                let count = seq.iter().filter(|&&id| id == b.id).count();
                assert_eq!(count, r as usize, "weights {set:?}, backend {}", b.id);
            }
        }
    }

    #[test]
    fn runs_are_short() {
        for set in weight_sets() {
            let bs = backends(&set);
            let seq = sequence(&bs, MAX).unwrap();
            let reduced = reduce(&set);
            let s: u64 = reduced.iter().map(|&w| u64::from(w)).sum();
            for (b, &w) in bs.iter().zip(&reduced) {
                let w = u64::from(w);
                if w == 0 || w == s {
                    continue;
                }
                let bound = 2.0 * (w as f64 / (s - w) as f64 + 1.0);
                let run = longest_circular_run(&seq, b.id);
                assert!(
                    run as f64 <= bound,
                    "weights {set:?}: backend {} (w {w}, S {s}) has a run of {run} > {bound}",
                    b.id
                );
            }
        }
    }

    #[test]
    fn cycle_repeats_exactly() {
        // Replaying the stored cycle equals running the algorithm on and on.
        for set in weight_sets() {
            let reduced = reduce(&set);
            let s: u64 = reduced.iter().map(|&w| u64::from(w)).sum();
            let one = smooth_picks(&reduced, s);
            let three = smooth_picks(&reduced, 3 * s);
            assert_eq!(three, [one.clone(), one.clone(), one].concat(), "weights {set:?}");
        }
    }

    #[test]
    fn five_one_one_is_smooth() {
        let (a, b, c) = (10, 20, 30);
        let bs = [WrrBackend { id: a, weight: 5 }, WrrBackend { id: b, weight: 1 }, WrrBackend { id: c, weight: 1 }];
        assert_eq!(sequence(&bs, MAX).unwrap(), vec![a, a, b, a, c, a, a]);
        // Same after gcd reduction.
        let bs10: Vec<_> = bs.iter().map(|b| WrrBackend { weight: b.weight * 10, ..*b }).collect();
        assert_eq!(sequence(&bs10, MAX).unwrap(), vec![a, a, b, a, c, a, a]);
    }

    #[test]
    fn ties_go_to_list_order() {
        assert_eq!(sequence(&backends(&[1, 1, 1]), MAX).unwrap(), vec![1, 2, 3]);
        assert_eq!(sequence(&backends(&[3, 0, 2]), MAX).unwrap(), vec![1, 3, 1, 3, 1]);
    }

    #[test]
    fn empty_zero_and_too_long() {
        assert_eq!(sequence(&[], MAX).unwrap(), Vec::<u16>::new());
        assert_eq!(sequence(&backends(&[0, 0]), MAX).unwrap(), Vec::<u16>::new());
        assert_eq!(sequence(&backends(&[0, 0]), 0).unwrap(), Vec::<u16>::new());
        assert_eq!(sequence(&backends(&[7, 11, 13, 17]), 47), Err(WrrError::TooLong { total: 48, max: 47 }));
        assert_eq!(sequence(&backends(&[7, 11, 13, 17]), 48).unwrap().len(), 48);
        // The limit applies after gcd reduction.
        assert_eq!(sequence(&backends(&[1000, 2000]), 3).unwrap(), vec![2, 1, 2]);
        // Huge weights are rejected before any allocation.
        assert_eq!(
            sequence(&backends(&[u32::MAX, u32::MAX - 1]), MAX),
            Err(WrrError::TooLong { total: 2 * u64::from(u32::MAX) - 1, max: MAX })
        );
    }

    #[test]
    fn reduce_by_gcd() {
        assert_eq!(reduce(&[5, 5, 10]), vec![1, 1, 2]);
        assert_eq!(reduce(&[6, 0, 9]), vec![2, 0, 3]);
        assert_eq!(reduce(&[7, 11]), vec![7, 11]);
        assert_eq!(reduce(&[0, 8]), vec![0, 1]);
        assert_eq!(reduce(&[0, 0]), vec![0, 0]);
        assert_eq!(reduce(&[]), Vec::<u32>::new());
    }

    #[test]
    fn round_robin_ignores_weights() {
        let bs = [WrrBackend { id: 1, weight: 5 }, WrrBackend { id: 2, weight: 1 }, WrrBackend { id: 3, weight: 0 }];
        assert_eq!(round_robin(&bs), vec![1, 2]);
        assert_eq!(round_robin(&[]), Vec::<u16>::new());
    }
}

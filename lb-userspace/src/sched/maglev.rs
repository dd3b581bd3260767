//! Weighted Maglev consistent-hashing table builder (Eisenbud et al.,
//! "Maglev: A Fast and Reliable Software Network Load Balancer", NSDI 2016).
//!
//! Every backend owns a permutation of the table slots derived only from its
//! `key`: slot `j` of its preference list is `(offset + j * skip) % size`, with
//! `offset` and `skip` taken from two independent 64-bit hashes of the key.
//! Backends take turns claiming their next preferred free slot until the table
//! is full. Because a backend's preferences never depend on the other
//! backends, adding or removing one backend moves few entries of the others.
//!
//! Weights: instead of plain rounds (everyone takes one turn per round), turns
//! are scheduled like weighted fair queueing. Backend `i`'s turn number `k`
//! (k = 0, 1, 2, ...) happens at virtual time `k / weight_i`; turns are taken
//! in increasing virtual time, ties broken by list order. Every turn fills
//! exactly one slot, so when the table is full each backend holds within about
//! two entries of `size * weight_i / sum(weights)` entries. Turn 0 of every
//! backend is at time 0, so every backend with a nonzero weight gets at least
//! one entry however skewed the weights are (hence `size >= backends`). With
//! equal weights this is exactly the classic Maglev round-robin population.
//!
//! The build is deterministic: the same backends in the same order and the
//! same size always give the same table.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;

/// Table entry meaning "no backend" (matches `lb_common::BACKEND_NONE`).
pub const NO_BACKEND: u16 = 0;

/// Default table size: a prime comfortably larger than 100 x the number of
/// backends a service normally has.
pub const DEFAULT_TABLE_SIZE: u32 = 65537;

/// One backend as the builder sees it: a stable identity (hashed to derive
/// its permutation) and a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaglevBackend {
    /// Value written into the table entries this backend owns (16 bits,
    /// as the datapath's selection tables hold backend ids). Must not be
    /// [`NO_BACKEND`] (0) when `weight > 0`.
    pub id: u16,
    /// Stable identity of the backend (e.g. a hash of its address and port);
    /// only this decides the backend's slot preferences.
    pub key: u64,
    /// Relative share of the table. 0 means the backend gets no entries.
    pub weight: u32,
}

/// Why a table could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaglevError {
    /// The table size must be a prime number (so every skip is coprime to it
    /// and each preference list is a full permutation).
    SizeNotPrime(u32),
    /// The table has fewer entries than there are backends with a nonzero
    /// weight.
    SizeTooSmall { size: u32, backends: usize },
    /// The backend at `index` has a nonzero weight but id 0, which is the
    /// reserved "no backend" value.
    ReservedId { index: usize },
}

impl fmt::Display for MaglevError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SizeNotPrime(n) => write!(f, "maglev table size {n} is not prime"),
            Self::SizeTooSmall { size, backends } => {
                write!(f, "maglev table size {size} is smaller than the number of weighted backends ({backends})")
            }
            Self::ReservedId { index } => {
                write!(f, "maglev backend #{index} has id 0, which is reserved for \"no backend\"")
            }
        }
    }
}

impl std::error::Error for MaglevError {}

/// splitmix64 finalizer (Steele, Lea, Flood).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// MurmurHash3 64-bit finalizer, used as the second, independent mixer.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The two hashes of a backend key: (offset hash, skip hash).
fn key_hashes(key: u64) -> (u64, u64) {
    let h1 = splitmix64(key ^ 0x6a09_e667_f3bc_c908);
    let h2 = fmix64(key.rotate_left(29) ^ 0xbb67_ae85_84ca_a73b);
    (h1, h2)
}

/// Is `n` prime? Deterministic trial division by 6k +/- 1 (at most ~11k
/// divisions for any u32).
pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    if n < 4 {
        return true;
    }
    if n.is_multiple_of(2) || n.is_multiple_of(3) {
        return false;
    }
    let n = u64::from(n);
    let mut d: u64 = 5;
    while d * d <= n {
        if n.is_multiple_of(d) || n.is_multiple_of(d + 2) {
            return false;
        }
        d += 6;
    }
    true
}

/// A pending turn: backend `idx` takes its slot number `turn` at virtual time
/// `turn / weight`. Ordered so that `BinaryHeap` (a max-heap) pops the
/// earliest virtual time first, then the lowest list index.
struct Turn {
    turn: u64,
    weight: u64,
    idx: usize,
}

impl Turn {
    fn key_cmp(&self, other: &Self) -> Ordering {
        // turn/weight vs other.turn/other.weight, exactly, by cross-multiplying.
        let a = u128::from(self.turn) * u128::from(other.weight);
        let b = u128::from(other.turn) * u128::from(self.weight);
        a.cmp(&b).then(self.idx.cmp(&other.idx))
    }
}

impl Ord for Turn {
    fn cmp(&self, other: &Self) -> Ordering {
        other.key_cmp(self)
    }
}

impl PartialOrd for Turn {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Turn {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Turn {}

/// Builds a Maglev lookup table of `size` entries, each a backend `id`.
///
/// * Each backend's share of entries is proportional to its weight (within
///   about two entries of `size * weight / sum(weights)`).
/// * Backends with weight 0 get no entries; every backend with a nonzero
///   weight gets at least one.
/// * If the list is empty or all weights are 0, the result is
///   `vec![NO_BACKEND; size]` (all zeros), not an empty vector.
///
/// The result depends on the order of `backends` only through tie-breaking;
/// keep the order stable (e.g. sorted by key) for minimal disruption between
/// rebuilds.
///
/// # Errors
///
/// * [`MaglevError::SizeNotPrime`] if `size` is not prime (checked first).
/// * [`MaglevError::SizeTooSmall`] if `size` is less than the number of
///   backends with a nonzero weight.
/// * [`MaglevError::ReservedId`] if a backend with a nonzero weight has id 0.
pub fn build(backends: &[MaglevBackend], size: u32) -> Result<Vec<u16>, MaglevError> {
    if !is_prime(size) {
        return Err(MaglevError::SizeNotPrime(size));
    }
    let active = backends.iter().filter(|b| b.weight > 0).count();
    if active > size as usize {
        return Err(MaglevError::SizeTooSmall { size, backends: active });
    }
    if let Some(index) = backends.iter().position(|b| b.weight > 0 && b.id == NO_BACKEND) {
        return Err(MaglevError::ReservedId { index });
    }

    let m = u64::from(size);
    let mut table = vec![NO_BACKEND; size as usize];
    if active == 0 {
        return Ok(table);
    }

    // Per backend: current position in its permutation, as (slot, skip).
    // Walking slot += skip (mod m) visits every slot exactly once.
    let mut next_slot = vec![0u64; backends.len()];
    let mut skip = vec![1u64; backends.len()];
    let mut heap = BinaryHeap::with_capacity(active);
    for (idx, b) in backends.iter().enumerate() {
        if b.weight == 0 {
            continue;
        }
        let (h1, h2) = key_hashes(b.key);
        next_slot[idx] = h1 % m;
        skip[idx] = if m > 1 { h2 % (m - 1) + 1 } else { 1 };
        heap.push(Turn { turn: 0, weight: u64::from(b.weight), idx });
    }

    let mut filled: u64 = 0;
    while filled < m {
        // The heap always holds one pending turn per active backend.
        let Some(mut t) = heap.pop() else { break };
        let idx = t.idx;
        // Claim this backend's next free preferred slot. Terminates because
        // the table is not yet full and the walk is a full permutation.
        let mut slot = next_slot[idx];
        while table[slot as usize] != NO_BACKEND {
            slot += skip[idx];
            if slot >= m {
                slot -= m;
            }
        }
        table[slot as usize] = backends[idx].id;
        filled += 1;
        slot += skip[idx];
        if slot >= m {
            slot -= m;
        }
        next_slot[idx] = slot;
        t.turn += 1;
        heap.push(t);
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn backends_with(weights: &[u32]) -> Vec<MaglevBackend> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| MaglevBackend {
                id: i as u16 + 1,
                // Arbitrary stable identity, e.g. as if hashed from ip:port.
                key: 0x0a00_0000_0000_1f90 ^ ((i as u64 + 1) << 20),
                weight: w,
            })
            .collect()
    }

    fn counts(table: &[u16]) -> HashMap<u16, usize> {
        let mut c = HashMap::new();
        for &id in table {
            *c.entry(id).or_insert(0) += 1;
        }
        c
    }

    fn next_prime_from(mut n: u32) -> u32 {
        while !is_prime(n) {
            n += 1;
        }
        n
    }

    /// Checks every backend's count is within 1% (relative) of its weight
    /// share of `size`.
    fn assert_shares(bs: &[MaglevBackend], size: u32) {
        let table = build(bs, size).unwrap();
        assert_eq!(table.len(), size as usize);
        let c = counts(&table);
        assert_eq!(c.get(&NO_BACKEND), None, "table has empty entries");
        let sum: u64 = bs.iter().map(|b| u64::from(b.weight)).sum();
        for b in bs {
            let expected = f64::from(size) * f64::from(b.weight) / sum as f64;
            let got = *c.get(&b.id).unwrap_or(&0) as f64;
            assert!(
                (got - expected).abs() <= 0.01 * expected,
                "backend {} weight {}: {} entries, expected {:.2} (size {}, n {})",
                b.id,
                b.weight,
                got,
                expected,
                size,
                bs.len()
            );
        }
    }

    #[test]
    fn equal_weights_spread_evenly() {
        for n in [3usize, 10, 100] {
            assert_shares(&backends_with(&vec![1; n]), DEFAULT_TABLE_SIZE);
            // Equal but non-unit weights must behave the same.
            assert_shares(&backends_with(&vec![7; n]), DEFAULT_TABLE_SIZE);
        }
    }

    #[test]
    fn weighted_shares_follow_weights() {
        for n in [3u32, 10, 100] {
            let weights: Vec<u32> = (1..=n).collect();
            let sum: u32 = weights.iter().sum();
            // A relative 1% bound needs the smallest share (weight 1) to be
            // large enough that one-entry rounding is far below 1%. With
            // size 65537: N=3 -> ~10923 entries, N=10 -> ~1191 entries for
            // weight 1, fine. For N=100 (sum 5050) weight 1 would get only
            // ~13 entries, so use the smallest prime >= 1000 * 5050
            // (= 5,050,000 -> 5,050,021), giving the weight-1 backend ~1000
            // expected entries.
            let size = if DEFAULT_TABLE_SIZE / sum >= 1000 { DEFAULT_TABLE_SIZE } else { next_prime_from(1000 * sum) };
            assert_shares(&backends_with(&weights), size);
        }
    }

    fn disruption(n: usize, remove: usize) -> f64 {
        let bs = backends_with(&vec![1; n]);
        let before = build(&bs, DEFAULT_TABLE_SIZE).unwrap();
        let removed_id = bs[remove].id;
        let mut rest = bs.clone();
        rest.remove(remove);
        let after = build(&rest, DEFAULT_TABLE_SIZE).unwrap();
        let mut kept = 0usize;
        let mut changed = 0usize;
        for (a, b) in before.iter().zip(&after) {
            assert_ne!(*b, removed_id);
            if *a != removed_id {
                kept += 1;
                if a != b {
                    changed += 1;
                }
            }
        }
        changed as f64 / kept as f64
    }

    #[test]
    fn removing_a_backend_disrupts_little() {
        for n in [10usize, 100] {
            for remove in [0, n / 2, n - 1] {
                let frac = disruption(n, remove);
                assert!(frac <= 0.01, "n={n}, removed #{remove}: {:.3}% of surviving entries moved", frac * 100.0);
            }
        }
    }

    #[test]
    fn zero_weight_backends_get_nothing() {
        let bs = backends_with(&[3, 0, 2, 0, 1]);
        let table = build(&bs, DEFAULT_TABLE_SIZE).unwrap();
        let c = counts(&table);
        assert_eq!(c.get(&2), None);
        assert_eq!(c.get(&4), None);
        assert_eq!(c.get(&NO_BACKEND), None);
        // A zero-weight backend is allowed to have id 0 (it is ignored) and
        // does not count towards SizeTooSmall.
        let mut bs2 = bs.clone();
        bs2[1].id = 0;
        assert_eq!(build(&bs2, DEFAULT_TABLE_SIZE).unwrap(), table);
        // Adding a weight-0 backend is the same as leaving it out.
        let only: Vec<_> = bs.iter().copied().filter(|b| b.weight > 0).collect();
        assert_eq!(build(&only, DEFAULT_TABLE_SIZE).unwrap(), table);
    }

    #[test]
    fn empty_or_all_zero_is_all_no_backend() {
        assert_eq!(build(&[], 13).unwrap(), vec![NO_BACKEND; 13]);
        assert_eq!(build(&[], DEFAULT_TABLE_SIZE).unwrap(), vec![0; 65537]);
        let bs = backends_with(&[0, 0, 0]);
        assert_eq!(build(&bs, 7).unwrap(), vec![0; 7]);
    }

    #[test]
    fn rejects_bad_input() {
        let bs = backends_with(&[1, 1, 1]);
        assert_eq!(build(&bs, 65536), Err(MaglevError::SizeNotPrime(65536)));
        assert_eq!(build(&bs, 0), Err(MaglevError::SizeNotPrime(0)));
        assert_eq!(build(&bs, 1), Err(MaglevError::SizeNotPrime(1)));
        assert_eq!(build(&[], 10), Err(MaglevError::SizeNotPrime(10)));
        assert_eq!(build(&bs, 2), Err(MaglevError::SizeTooSmall { size: 2, backends: 3 }));
        // Exactly as many slots as backends: each gets one slot.
        let t = build(&bs, 3).unwrap();
        let mut s = t.clone();
        s.sort_unstable();
        assert_eq!(s, vec![1, 2, 3]);
        let mut bad = bs.clone();
        bad[2].id = 0;
        assert_eq!(build(&bad, 7), Err(MaglevError::ReservedId { index: 2 }));
    }

    #[test]
    fn deterministic() {
        let weights: Vec<u32> = (1..=50).map(|i| i * 3 % 17 + 1).collect();
        let bs = backends_with(&weights);
        let a = build(&bs, DEFAULT_TABLE_SIZE).unwrap();
        let b = build(&bs, DEFAULT_TABLE_SIZE).unwrap();
        assert_eq!(a, b);
        // Pinned values guard against accidental changes of the hash mixers
        // (which would remap flows after an upgrade).
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
    }

    #[test]
    fn extreme_weights() {
        // One huge weight and many tiny ones: every weighted backend still
        // gets at least one entry and the table is full.
        let mut weights = vec![u32::MAX];
        weights.extend(std::iter::repeat_n(1, 999));
        let bs = backends_with(&weights);
        let table = build(&bs, 1009).unwrap();
        let c = counts(&table);
        assert_eq!(c.get(&NO_BACKEND), None);
        assert_eq!(c.len(), 1000);
    }

    #[test]
    fn is_prime_known_values() {
        assert!(!is_prime(0));
        assert!(!is_prime(1));
        assert!(is_prime(2));
        assert!(is_prime(3));
        assert!(!is_prime(4));
        assert!(!is_prime(9));
        assert!(!is_prime(25));
        assert!(is_prime(65537));
        assert!(!is_prime(65536));
        assert!(is_prime(131071));
        assert!(!is_prime(65537 * 3));
        assert!(is_prime(4_294_967_291)); // largest u32 prime
        assert!(!is_prime(u32::MAX));
        assert!(!is_prime(65521 * 65521)); // square of a prime near the limit
    }
}

//! Schedulers: everything userspace knows about how a service picks a
//! backend for a new flow, in one place.
//!
//! A [`Scheduler`] answers every question the rest of the agent asks about
//! it: its name in the configuration, its datapath id, how long its
//! selection table is, what it needs from a service to be valid, how its
//! table is built from a neutral list of [`Member`]s, and what its fairness
//! index is computed on. The table builders are [`maglev`] (consistent
//! hashing) and [`wrr`] (round-robin sequences).
//!
//! The datapath half is `lb-ebpf/src/select.rs`: it reads the table built
//! here and applies the per-packet part of the scheduler (hash, shared
//! sequence counter, or two random choices compared on active flows).
//! Adding a scheduler means a variant here and, only if it needs a new
//! per-packet rule, a branch there.
use std::{collections::HashMap, fmt, time::Duration};

use lb_common::{SCHED_FLOW_HASH, SCHED_LEAST_CONN, SCHED_LEAST_TIME, SCHED_SEQUENCE, SCHED_SOURCE_HASH};
use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error as _};

pub mod maglev;
pub mod wrr;

/// Longest weighted-round-robin cycle a service may need.
pub const MAX_WRR_CYCLE: u64 = 1 << 20;

/// How a service picks a backend for a new flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Scheduler {
    /// Maglev consistent hashing of the 5-tuple (default).
    #[default]
    Maglev,
    /// Smooth weighted round robin over new flows.
    Wrr,
    /// Round robin (weights only decide in or out).
    Rr,
    /// Consistent hashing of the client address alone.
    SourceHash,
    /// Weighted least connections (power of two choices).
    LeastConn,
    /// Least response time: weighted least connections where a backend's
    /// weight is divided by its recent probe response time (see
    /// [`least_time_weight`]).
    LeastTime,
}

/// The selection table a scheduler's datapath half reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Table {
    /// A Maglev table of the service's `table_size` (a prime).
    Maglev,
    /// One full round-robin cycle, weighted or not.
    Sequence { weighted: bool },
}

/// One backend as a scheduler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// The datapath's backend id (what the table holds), 16 bits as the
    /// datapath's selection tables hold it (ids are below
    /// `lb_common::MAX_BACKENDS`).
    pub id: u16,
    /// A stable identity (Maglev derives the backend's slots from it).
    pub key: u64,
    /// The weight in force now (health, drain and slow start applied);
    /// 0 keeps the backend out of the table.
    pub weight: u32,
}

/// Maglev tables built during one reprogramming, for the services that
/// follow. A Maglev table depends only on the members in rotation (their
/// keys, seeded, their weights and their order) and the table size; the
/// ids it holds are each service's own. Services in front of the same
/// pool (many ports of one application, or the same hosts behind many
/// VIPs) so build it once: at 255 services over three hosts, a host going
/// down cost 255 builds of 1.5 ms each, with lbd's state locked, where it
/// now costs one build and 255 copies.
#[derive(Debug, Default)]
pub struct Builds {
    /// The table of each pool as positions in its list of members,
    /// 1-based (0 where nothing is, as in a table of ids). Positions fit
    /// 16 bits (a service has fewer than `MAX_BACKENDS` members), which
    /// halves what the builds hold while a reprogramming runs: one table
    /// per distinct pool, 128 KiB at 65,537 entries.
    maglev: HashMap<MaglevPool, Vec<u16>>,
}

/// What a Maglev table depends on: the (seeded key, weight) of each member
/// in rotation, in order, and the table size.
type MaglevPool = (Vec<(u64, u32)>, u32);

impl Builds {
    /// The Maglev table of `members` (ids), built or taken from an
    /// earlier service's build of the same pool.
    ///
    /// The same table as [`maglev::build`] over all of `members`: a member
    /// out of rotation (weight 0) takes no turn and no slot, and leaving it
    /// out keeps the others' order, which is all a tie looks at.
    fn maglev(&mut self, members: &[Member], table_size: u32, seed: u64) -> Vec<u16> {
        let active: Vec<&Member> = members.iter().filter(|m| m.weight > 0).collect();
        let pool: Vec<(u64, u32)> = active.iter().map(|m| (m.key ^ seed, m.weight)).collect();
        let positions = self.maglev.entry((pool, table_size)).or_insert_with_key(|(pool, size)| {
            // Positions as the ids: fewer members than MAX_BACKENDS, so
            // they fit the table's 16 bits as ids do.
            let input: Vec<maglev::MaglevBackend> = (1..)
                .zip(pool)
                .map(|(position, &(key, weight))| maglev::MaglevBackend { id: position, key, weight })
                .collect();
            maglev::build(&input, *size).expect("table size and backend count were validated with the config")
        });
        positions
            .iter()
            .map(|&p| if p == maglev::NO_BACKEND { maglev::NO_BACKEND } else { active[usize::from(p) - 1].id })
            .collect()
    }
}

/// What a scheduler needs to know about a service to validate it.
#[derive(Clone, Copy, Debug)]
pub struct Pool<'a> {
    /// The configured Maglev table size (a prime).
    pub table_size: u32,
    /// The backends' configured weights.
    pub weights: &'a [u32],
    /// Whether the service's health probes measure a response time (http
    /// probes: the time to the response's first line).
    pub measures_response: bool,
}

/// A service setting the scheduler cannot work with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The service's key at fault (`table_size`, `backends`, ...).
    pub field: &'static str,
    pub message: String,
}

impl Scheduler {
    /// Every scheduler, in the order the documentation lists them.
    pub const ALL: [Self; 6] = [Self::Maglev, Self::Wrr, Self::Rr, Self::SourceHash, Self::LeastConn, Self::LeastTime];

    /// The name used in the configuration, the API and the status.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Maglev => "maglev",
            Self::Wrr => "wrr",
            Self::Rr => "rr",
            Self::SourceHash => "source-hash",
            Self::LeastConn => "least-conn",
            Self::LeastTime => "least-time",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    /// "maglev, wrr, ..." for error messages.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// The `SCHED_*` id the datapath switches on (`lb-ebpf/src/select.rs`).
    pub const fn datapath_id(self) -> u32 {
        match self {
            Self::Maglev => SCHED_FLOW_HASH,
            Self::SourceHash => SCHED_SOURCE_HASH,
            Self::LeastConn => SCHED_LEAST_CONN,
            // Two random choices compared on active flows per unit of
            // weight: with the weight divided by the response time, that
            // compares active flows x response time (see select.rs for
            // backends alike).
            Self::LeastTime => SCHED_LEAST_TIME,
            Self::Wrr | Self::Rr => SCHED_SEQUENCE,
        }
    }

    const fn table(self) -> Table {
        match self {
            Self::Maglev | Self::SourceHash | Self::LeastConn | Self::LeastTime => Table::Maglev,
            Self::Wrr => Table::Sequence { weighted: true },
            Self::Rr => Table::Sequence { weighted: false },
        }
    }

    /// Entries of the selection table for a pool, at most (every backend
    /// at its configured weight).
    pub fn table_len(self, pool: &Pool<'_>) -> u64 {
        match self.table() {
            Table::Maglev => u64::from(pool.table_size),
            Table::Sequence { weighted: false } => pool.weights.len() as u64,
            Table::Sequence { weighted: true } => wrr::reduce(pool.weights).iter().map(|&w| u64::from(w)).sum(),
        }
    }

    /// Entries of the consistent-hash table a flow without a flow-table
    /// entry is routed by (a flood, a full table; see `lb_common::Service`),
    /// when it is not the scheduler's own table: round-robin sequences
    /// cannot give a flow the same answer twice, so they get a weighted
    /// Maglev table of `table_size` beside. 0 for the schedulers whose own
    /// table is a Maglev table (hashing picks from it directly; least
    /// connections and least time hash into it when there is no entry).
    pub fn fallback_len(self, pool: &Pool<'_>) -> u64 {
        match self.table() {
            Table::Maglev => 0,
            Table::Sequence { .. } => u64::from(pool.table_size),
        }
    }

    /// The consistent-hash fallback table of [`fallback_len`](Self::fallback_len)
    /// entries, when the scheduler needs one (a Maglev table, so `seed`
    /// applies as in [`build`](Self::build)).
    pub fn build_fallback(
        self,
        members: &[Member],
        table_size: u32,
        seed: u64,
        builds: &mut Builds,
    ) -> Option<Vec<u16>> {
        match self.table() {
            Table::Maglev => None,
            Table::Sequence { .. } => Some(builds.maglev(members, table_size, seed)),
        }
    }

    /// Every reason the pool cannot be scheduled this way.
    pub fn validate(self, pool: &Pool<'_>) -> Vec<Problem> {
        let mut problems = Vec::new();
        match self.table() {
            Table::Maglev if pool.weights.len() as u64 > u64::from(pool.table_size) => problems.push(Problem {
                field: "table_size",
                message: format!("{} entries cannot hold {} backends", pool.table_size, pool.weights.len()),
            }),
            Table::Sequence { .. } if pool.weights.len() as u64 > u64::from(pool.table_size) => {
                problems.push(Problem {
                    field: "table_size",
                    message: format!(
                        "{} entries cannot hold {} backends (the consistent-hash table flows without a flow-table entry use)",
                        pool.table_size,
                        pool.weights.len()
                    ),
                });
            }
            Table::Sequence { weighted: true } => {
                let cycle = self.table_len(pool);
                if cycle > MAX_WRR_CYCLE {
                    problems.push(Problem {
                        field: "backends",
                        message: format!(
                            "the weights make a round-robin cycle of {cycle} picks (at most {MAX_WRR_CYCLE}); use coarser weights"
                        ),
                    });
                }
            }
            _ => {}
        }
        if self == Self::LeastTime && !pool.measures_response {
            problems.push(Problem {
                field: "health",
                message: "least-time estimates response times from the health probes; set health.type: http".into(),
            });
        }
        problems
    }

    /// The selection table for the members. Only called on validated pools.
    ///
    /// The table depends on the members' order: Maglev breaks ties by
    /// position, and a round-robin sequence follows it (ties go to the
    /// earlier member; ids are never compared). Pass them in a canonical
    /// order (the dataplane sorts by address and port) so that every node
    /// given the same pool builds the same table, whatever its ids.
    ///
    /// `seed` (the configuration's `maglev_seed`) is XORed into every
    /// member's key before Maglev hashes it, giving every backend another
    /// permutation; 0 leaves the keys, and so the tables, as they were
    /// before the seed existed. Round-robin sequences ignore it.
    ///
    /// A Maglev table comes from `builds` when an earlier service of the
    /// same reprogramming had the same pool.
    pub fn build(self, members: &[Member], table_size: u32, seed: u64, builds: &mut Builds) -> Vec<u16> {
        match self.table() {
            Table::Maglev => builds.maglev(members, table_size, seed),
            Table::Sequence { weighted } => {
                let input: Vec<wrr::WrrBackend> =
                    members.iter().map(|m| wrr::WrrBackend { id: m.id, weight: m.weight }).collect();
                if weighted {
                    wrr::sequence(&input, MAX_WRR_CYCLE).expect("cycle length was validated with the config")
                } else {
                    wrr::round_robin(&input)
                }
            }
        }
    }

    /// What a backend's expected share of new flows is in proportion to,
    /// given its weight in force (0 when down or drained): that weight, or
    /// one per backend in rotation for a scheduler that ignores weights.
    pub fn share_basis(self, in_force: u32) -> f64 {
        match self.table() {
            Table::Sequence { weighted: false } => f64::from(u8::from(in_force > 0)),
            _ => f64::from(in_force),
        }
    }

    /// What the fairness index (Jain's) of a service is computed on, per
    /// backend: new flows per unit of weight, or raw counts for a scheduler
    /// that ignores weights.
    pub fn fairness_input(self, new_flows: u64, weight: u32) -> f64 {
        match self.table() {
            Table::Sequence { weighted: false } => new_flows as f64,
            _ => new_flows as f64 / f64::from(weight),
        }
    }

    /// The weight the datapath and the table use for a backend whose weight
    /// in force is `weight` (health, drain and slow start applied), given
    /// its recent probe response time when one is measured.
    pub fn effective_weight(self, weight: u32, response_time: Option<Duration>) -> u32 {
        match self {
            Self::LeastTime => least_time_weight(weight, response_time),
            _ => weight,
        }
    }
}

/// Response times at or below this count as equal. Below it, differences
/// between probe times are mostly scheduling noise on the prober, the
/// gateway and the backend: on a loaded 2-core lab, two idle backends'
/// estimates wandered around 1.2-1.3 ms, across a quarter-octave step of a
/// 1 ms floor, and their weights flipped against each other all run long.
pub const LEAST_TIME_FLOOR: Duration = Duration::from_millis(5);

/// Least time's weight: `weight x 1024 / (response time / floor)`, with the
/// ratio rounded to quarter octaves (steps of about 19%) so an estimate
/// wandering a little does not rebuild the table on every probe. A backend
/// not measured yet counts as answering at the floor. Never 0 for a weight
/// above 0; 0 stays 0 (down or drained).
pub fn least_time_weight(weight: u32, response_time: Option<Duration>) -> u32 {
    if weight == 0 {
        return 0;
    }
    let ratio =
        response_time.unwrap_or(LEAST_TIME_FLOOR).max(LEAST_TIME_FLOOR).as_secs_f64() / LEAST_TIME_FLOOR.as_secs_f64();
    let quarters = (4.0 * ratio.log2()).round();
    let scaled = f64::from(weight) * 1024.0 / (quarters / 4.0).exp2();
    // weight <= 2^20 (configured x slow start), so the product fits.
    (scaled.round() as u32).max(1)
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Scheduler {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Scheduler {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| D::Error::custom(format!("{s:?} is not one of {}", Self::names())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Members with ids from `first_id` on, keyed as backends at
    /// 10.20.0.n:8080 would be, with the given weights.
    fn members(first_id: u16, weights: &[u32]) -> Vec<Member> {
        (0..)
            .zip(weights)
            .map(|(n, &weight)| Member { id: first_id + n, key: 0x0a14_0000_1f90 + (u64::from(n) << 20), weight })
            .collect()
    }

    /// Every service's Maglev table from `Builds` is the one a build over
    /// its own members gives, out-of-rotation members and all; a pool seen
    /// before is built once, and each service gets its own ids.
    #[test]
    fn a_pool_is_built_once_per_reprogramming_with_each_services_ids() {
        let size = 65_537;
        let direct = |m: &[Member], seed: u64| {
            let input: Vec<maglev::MaglevBackend> =
                m.iter().map(|m| maglev::MaglevBackend { id: m.id, key: m.key ^ seed, weight: m.weight }).collect();
            maglev::build(&input, size).unwrap()
        };
        let mut builds = Builds::default();
        // Three in rotation among five (two down, one between them).
        let a = members(1, &[1, 0, 2, 0, 1]);
        let t = Scheduler::Maglev.build(&a, size, 9, &mut builds);
        assert_eq!(t, direct(&a, 9));
        // The same pool under other ids, and with its down members gone.
        let mut b = members(100, &[1, 0, 2, 0, 1]);
        assert_eq!(Scheduler::SourceHash.build(&b, size, 9, &mut builds), direct(&b, 9));
        b.retain(|m| m.weight > 0);
        assert_eq!(Scheduler::Wrr.build_fallback(&b, size, 9, &mut builds).unwrap(), direct(&b, 9));
        assert_eq!(builds.maglev.len(), 1, "one pool, one build");
        let ids: std::collections::BTreeSet<u16> =
            Scheduler::Maglev.build(&b, size, 9, &mut builds).into_iter().collect();
        assert_eq!(ids, [100, 102, 104].into(), "each service's own ids, every slot filled");
        // Another seed, weight or size is another pool.
        assert_eq!(Scheduler::Maglev.build(&a, size, 10, &mut builds), direct(&a, 10));
        let c = members(1, &[1, 0, 3, 0, 1]);
        assert_eq!(Scheduler::Maglev.build(&c, size, 9, &mut builds), direct(&c, 9));
        assert_eq!(
            Scheduler::Maglev.build(&a, 251, 9, &mut builds)[..],
            maglev::build(
                &a.iter()
                    .map(|m| maglev::MaglevBackend { id: m.id, key: m.key ^ 9, weight: m.weight })
                    .collect::<Vec<_>>(),
                251
            )
            .unwrap()[..]
        );
        assert_eq!(builds.maglev.len(), 4);
        // Nothing in rotation: an empty table of the size.
        let none = members(1, &[0, 0]);
        assert_eq!(Scheduler::Maglev.build(&none, size, 9, &mut builds), vec![0; size as usize]);
    }

    #[test]
    fn names_round_trip_and_are_unique() {
        for k in Scheduler::ALL {
            assert_eq!(Scheduler::parse(k.name()), Some(k));
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{}\"", k.name()));
            assert_eq!(serde_json::from_str::<Scheduler>(&format!("\"{k}\"")).unwrap(), k);
        }
        let mut names: Vec<_> = Scheduler::ALL.map(Scheduler::name).to_vec();
        names.dedup();
        assert_eq!(names.len(), Scheduler::ALL.len());
        assert_eq!(Scheduler::parse("random"), None);
        assert!(serde_json::from_str::<Scheduler>("\"random\"").unwrap_err().to_string().contains("maglev, wrr"));
    }

    #[test]
    fn tables_follow_the_scheduler() {
        let w = [4, 2, 2];
        let pool = Pool { table_size: 7, weights: &w, measures_response: false };
        assert_eq!(Scheduler::Maglev.table_len(&pool), 7);
        assert_eq!(Scheduler::Rr.table_len(&pool), 3);
        assert_eq!(Scheduler::Wrr.table_len(&pool), 4, "2:1:1 after the gcd");
        let m: Vec<Member> =
            w.iter().enumerate().map(|(i, &weight)| Member { id: i as u16 + 1, key: i as u64, weight }).collect();
        let mut wrr = Scheduler::Wrr.build(&m, 7, 0, &mut Builds::default());
        wrr.sort_unstable();
        assert_eq!(wrr, [1, 1, 2, 3]);
        assert_eq!(Scheduler::Rr.build(&m, 7, 0, &mut Builds::default()), [1, 2, 3]);
        let t = Scheduler::LeastConn.build(&m, 7, 0, &mut Builds::default());
        assert_eq!(t.len(), 7);
        assert!(t.iter().all(|&id| (1..=3).contains(&id)));
    }

    #[test]
    fn validation_names_the_field() {
        let w = [1; 8];
        let p = Scheduler::SourceHash.validate(&Pool { table_size: 7, weights: &w, measures_response: false });
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].field, "table_size");
        // Round robin's own table holds any number of backends; its
        // consistent-hash fallback table needs table_size >= backends.
        let p = Scheduler::Wrr.validate(&Pool { table_size: 7, weights: &w, measures_response: false });
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].field, "table_size");
        assert!(p[0].message.contains("consistent-hash table"), "{}", p[0].message);
        assert!(Scheduler::Wrr.validate(&Pool { table_size: 11, weights: &w, measures_response: false }).is_empty());
        let w: Vec<u32> = (0..17).map(|i| 65_535 - i).collect();
        let p = Scheduler::Wrr.validate(&Pool { table_size: 17, weights: &w, measures_response: false });
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].field, "backends");
        assert!(p[0].message.contains("cycle of 1113959 picks"), "{}", p[0].message);
    }

    #[test]
    fn least_time_needs_http_probes() {
        let w = [1, 1];
        let p = Scheduler::LeastTime.validate(&Pool { table_size: 7, weights: &w, measures_response: false });
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].field, "health");
        assert!(p[0].message.contains("health.type: http"), "{}", p[0].message);
        assert!(
            Scheduler::LeastTime.validate(&Pool { table_size: 7, weights: &w, measures_response: true }).is_empty()
        );
        assert_eq!(Scheduler::LeastTime.datapath_id(), SCHED_LEAST_TIME);
    }

    #[test]
    fn least_time_divides_the_weight_by_the_response_time() {
        let ms = |m: u64| Some(Duration::from_millis(m));
        let lt = |w, t| Scheduler::LeastTime.effective_weight(w, t);
        // At or under the floor, and unmeasured, all count the same.
        assert_eq!(lt(1, None), 1024);
        assert_eq!(lt(1, Some(Duration::from_micros(150))), 1024);
        assert_eq!(lt(1, ms(2)), 1024);
        assert_eq!(lt(3, ms(5)), 3072);
        // Twice the floor: half the weight; 50 ms: about a tenth.
        assert_eq!(lt(1, ms(10)), 512);
        let slow = lt(1, ms(50));
        assert!((95..=110).contains(&slow), "{slow}");
        // Small wanderings land on the same step.
        assert_eq!(lt(1, ms(52)), lt(1, ms(56)));
        // Down or drained stays out; very slow stays in.
        assert_eq!(lt(0, ms(20)), 0);
        assert_eq!(lt(1, Some(Duration::from_secs(3600))), 1);
        // Other schedulers ignore response times.
        assert_eq!(Scheduler::LeastConn.effective_weight(7, ms(50)), 7);
    }

    #[test]
    fn fairness_ignores_weights_only_for_round_robin() {
        assert_eq!(Scheduler::Rr.share_basis(30), 1.0);
        assert_eq!(Scheduler::Rr.share_basis(0), 0.0);
        assert_eq!(Scheduler::Wrr.share_basis(30), 30.0);
        assert_eq!(Scheduler::Rr.fairness_input(30, 3), 30.0);
        assert_eq!(Scheduler::Wrr.fairness_input(30, 3), 10.0);
        assert_eq!(Scheduler::Maglev.fairness_input(30, 3), 10.0);
    }
}

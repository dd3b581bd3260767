//! Backend health: the rise/fall state machine, slow start and the probes.
//!
//! - [`Checker`] turns a stream of probe results into Up/Down transitions
//!   with hysteresis: `fall` consecutive failures take an up backend out,
//!   `rise` consecutive successes bring a down one back. It is pure (no I/O,
//!   no timers) so the agent drives it and tests can feed it directly.
//! - [`slow_start_weight`] ramps the weight of a backend that just came up.
//! - [`probe`] (in `probe.rs`) runs one TCP or HTTP check, bounded by the
//!   configured timeout.

use std::{
    fmt,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use prometheus_client::metrics::{
    counter::Counter,
    family::Family,
    histogram::{Histogram, exponential_buckets},
};

mod probe;

pub use probe::{MAX_STATUS_LINE, ProbeError, probe, probe_target};

/// Health of one backend as seen by its probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Up,
    Down,
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Up => "up",
            Self::Down => "down",
        })
    }
}

/// Rise/fall hysteresis over consecutive probe results.
#[derive(Clone, Debug)]
pub struct Checker {
    state: Health,
    /// Consecutive successes (0 after any failure).
    successes: u32,
    /// Consecutive failures (0 after any success).
    failures: u32,
    /// When the last Down -> Up transition happened.
    up_since: Option<Instant>,
    /// Exponentially weighted moving average of successful probes' times
    /// (for http, the time to the first line of the response).
    response: Option<Duration>,
}

/// Weight of the newest probe time in [`Checker::response_time`]: an
/// estimate follows a lasting change within about five probes and a single
/// slow probe moves it by a quarter.
const RESPONSE_EWMA_WEIGHT: f64 = 0.25;

impl Default for Checker {
    fn default() -> Self {
        Self::new()
    }
}

impl Checker {
    /// Backends start Up (so a restart of the agent never takes traffic
    /// away before the first probes).
    pub fn new() -> Self {
        Self { state: Health::Up, successes: 0, failures: 0, up_since: None, response: None }
    }

    pub fn state(&self) -> Health {
        self.state
    }

    /// Record one probe result; returns `Some(new_state)` exactly when the
    /// state changed: Up -> Down after `fall` consecutive failures, Down -> Up
    /// after `rise` consecutive successes. A success resets the failure
    /// streak and vice versa. A `rise` or `fall` of 0 counts as 1.
    pub fn observe(&mut self, ok: bool, rise: u32, fall: u32) -> Option<Health> {
        let (rise, fall) = (rise.max(1), fall.max(1));
        if ok {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if self.state == Health::Down && self.successes >= rise {
                self.state = Health::Up;
                self.up_since = Some(Instant::now());
                return Some(Health::Up);
            }
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            if self.state == Health::Up && self.failures >= fall {
                self.state = Health::Down;
                return Some(Health::Down);
            }
        }
        None
    }

    /// When this backend last became Up (None if never changed since
    /// [`Checker::new`]; used for slow start).
    pub fn up_since(&self) -> Option<Instant> {
        self.up_since
    }

    /// Record how long a successful probe took (failed probes leave the
    /// estimate alone: health decides about those).
    pub fn record_response(&mut self, took: Duration) {
        self.response = Some(match self.response {
            None => took,
            Some(avg) => avg.mul_f64(1.0 - RESPONSE_EWMA_WEIGHT) + took.mul_f64(RESPONSE_EWMA_WEIGHT),
        });
    }

    /// The recent response time (see [`Checker::record_response`]); None
    /// before the first successful probe.
    pub fn response_time(&self) -> Option<Duration> {
        self.response
    }
}

/// Effective weight of a backend during slow start: ramps linearly from a
/// small value (1/10 of the weight, at least 1) at `elapsed == 0` to
/// `weight` at `elapsed >= window`; never 0 for weight > 0; 0 for weight 0.
/// A zero `window` means no slow start (the full weight at once).
pub fn slow_start_weight(weight: u32, elapsed: Duration, window: Duration) -> u32 {
    if weight == 0 {
        return 0;
    }
    if window.is_zero() || elapsed >= window {
        return weight;
    }
    let start = (weight / 10).max(1);
    let span = u128::from(weight - start);
    // span < 2^32 and elapsed < window < 2^94 ns: the product fits in u128,
    // and the quotient is below span, so the sum fits in u32.
    let ramp = span * elapsed.as_nanos() / window.as_nanos();
    start + u32::try_from(ramp).unwrap_or(weight - start)
}

// ------------------------------------------------------------ metrics

/// Label pairs of a metric series.
pub type Labels = Vec<(String, String)>;

fn histogram() -> Histogram {
    // 0.5 ms to about 4 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
}

/// Health-check series, kept here with the checks (the exporter reads
/// them; they accumulate between scrapes, everything else is read fresh).
#[derive(Clone)]
pub struct HealthMetrics {
    pub duration: Family<Labels, Histogram, fn() -> Histogram>,
    pub failures: Family<Labels, Counter>,
}

impl Default for HealthMetrics {
    fn default() -> Self {
        Self { duration: Family::new_with_constructor(histogram), failures: Family::default() }
    }
}

impl HealthMetrics {
    pub fn record(&self, service: &str, backend: &str, result: &Result<Duration, String>) {
        let labels = vec![("service".to_owned(), service.to_owned()), ("backend".to_owned(), backend.to_owned())];
        match result {
            Ok(d) => self.duration.get_or_create(&labels).observe(d.as_secs_f64()),
            Err(_) => {
                self.failures.get_or_create(&labels).inc();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // ---- Checker ----

    #[test]
    fn checker_starts_up_without_up_since() {
        let c = Checker::new();
        assert_eq!(c.state(), Health::Up);
        assert_eq!(c.up_since(), None);
        assert_eq!(Checker::default().state(), Health::Up);
    }

    #[test]
    fn checker_falls_after_fall_failures() {
        let mut c = Checker::new();
        assert_eq!(c.observe(false, 2, 3), None);
        assert_eq!(c.observe(false, 2, 3), None);
        assert_eq!(c.state(), Health::Up);
        assert_eq!(c.observe(false, 2, 3), Some(Health::Down));
        assert_eq!(c.state(), Health::Down);
        for _ in 0..10 {
            assert_eq!(c.observe(false, 2, 3), None);
        }
        assert_eq!(c.state(), Health::Down);
        assert_eq!(c.up_since(), None);
    }

    #[test]
    fn checker_rises_after_rise_successes() {
        let mut c = Checker::new();
        for _ in 0..3 {
            c.observe(false, 2, 3);
        }
        assert_eq!(c.state(), Health::Down);
        let before = Instant::now();
        assert_eq!(c.observe(true, 2, 3), None);
        assert_eq!(c.state(), Health::Down);
        assert_eq!(c.observe(true, 2, 3), Some(Health::Up));
        assert_eq!(c.state(), Health::Up);
        let since = c.up_since().expect("up_since set on Down -> Up");
        assert!(since >= before);
        assert_eq!(c.observe(true, 2, 3), None);
        assert_eq!(c.up_since(), Some(since));
    }

    #[test]
    fn checker_success_resets_failure_streak() {
        let mut c = Checker::new();
        for ok in [false, false, true, false, false] {
            assert_eq!(c.observe(ok, 2, 3), None);
        }
        assert_eq!(c.state(), Health::Up);
        assert_eq!(c.observe(false, 2, 3), Some(Health::Down));
    }

    #[test]
    fn checker_failure_resets_success_streak() {
        let mut c = Checker::new();
        c.observe(false, 3, 1);
        assert_eq!(c.state(), Health::Down);
        for ok in [true, true, false, true, true] {
            assert_eq!(c.observe(ok, 3, 1), None);
        }
        assert_eq!(c.state(), Health::Down);
        assert_eq!(c.observe(true, 3, 1), Some(Health::Up));
    }

    #[test]
    fn checker_zero_thresholds_act_as_one() {
        let mut c = Checker::new();
        assert_eq!(c.observe(false, 0, 0), Some(Health::Down));
        assert_eq!(c.observe(true, 0, 0), Some(Health::Up));
    }

    #[test]
    fn health_displays_lowercase() {
        assert_eq!(Health::Up.to_string(), "up");
        assert_eq!(Health::Down.to_string(), "down");
    }

    // ---- slow start ----

    #[test]
    fn slow_start_ramps_linearly() {
        let w = Duration::from_secs(10);
        assert_eq!(slow_start_weight(100, Duration::ZERO, w), 10);
        assert_eq!(slow_start_weight(100, Duration::from_secs(5), w), 55);
        assert_eq!(slow_start_weight(100, Duration::from_secs(10), w), 100);
        assert_eq!(slow_start_weight(100, Duration::from_secs(3600), w), 100);
    }

    #[test]
    fn slow_start_small_and_zero_weights() {
        let w = Duration::from_secs(10);
        for ms in [0, 1, 2_500, 9_999, 10_000, 50_000] {
            let e = Duration::from_millis(ms);
            assert_eq!(slow_start_weight(1, e, w), 1);
            assert_eq!(slow_start_weight(0, e, w), 0);
            assert!(slow_start_weight(5, e, w) >= 1);
        }
    }

    #[test]
    fn slow_start_zero_window_is_full_weight() {
        assert_eq!(slow_start_weight(100, Duration::ZERO, Duration::ZERO), 100);
    }

    #[test]
    fn slow_start_is_monotonic() {
        let w = Duration::from_secs(10);
        for weight in [1, 2, 9, 10, 11, 100, 65_535, u32::MAX] {
            let mut last = 0;
            for ms in (0..=11_000).step_by(37) {
                let v = slow_start_weight(weight, Duration::from_millis(ms), w);
                assert!(v >= last, "weight {weight} at {ms}ms: {v} < {last}");
                assert!((1..=weight).contains(&v));
                last = v;
            }
            assert_eq!(last, weight);
        }
    }

    #[test]
    fn response_time_is_a_moving_average_of_successful_probes() {
        let mut c = Checker::new();
        assert_eq!(c.response_time(), None);
        c.record_response(Duration::from_millis(40));
        assert_eq!(c.response_time(), Some(Duration::from_millis(40)), "the first probe sets it");
        c.record_response(Duration::from_millis(80));
        assert_eq!(c.response_time(), Some(Duration::from_millis(50)), "a quarter of the way to the new time");
        for _ in 0..30 {
            c.record_response(Duration::from_millis(2));
        }
        let d = c.response_time().unwrap();
        assert!(d >= Duration::from_millis(2) && d < Duration::from_micros(2050), "{d:?}");
    }
}

//! lbd's background loops: the probe supervisor (one probe loop per
//! endpoint and way of probing it, shared by the backends of every
//! service on it, following configuration changes), the
//! probe results' way to the state and the reprogramming after them, slow
//! start, the device watch, the check of the routes to the backends and
//! the flow sweeper.
//!
//! They drive anything that implements [`Driven`] (the [`Agent`] in lbd, a
//! recording fake in the tests below), on the periods in [`Periods`], so a
//! test can run them against a fake at a fast pace. Every loop runs until
//! its task is aborted; blocking work (map updates) runs on tokio's
//! blocking pool under the lock.
use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::{Notify, mpsc},
    task::JoinHandle,
    time::MissedTickBehavior,
};
use tracing::{debug, info, warn};

use crate::{
    agent::{Agent, BackendKey},
    bgp,
    config::HealthConfig,
    dataplane::{SweepReport, SweepRun},
    health,
    netdev::RouteMtuWatch,
};

/// What the loops need from the running state.
pub trait Driven: Send + 'static {
    /// Every backend to probe now: key, probe address, probe settings.
    fn probe_targets(&self) -> Vec<(BackendKey, SocketAddr, HealthConfig)>;
    /// One probe result (how long it took, or why it failed); true when
    /// the datapath must be reprogrammed for it (a health transition, a
    /// weight in force that moved), which [`reprogram_after_probes`] does.
    fn observe(&mut self, key: &BackendKey, result: Result<Duration, String>) -> bool;
    /// True while some backend's slow start is still ramping.
    fn ramping(&self) -> bool;
    /// Reprogram the datapath from the configuration and runtime state.
    fn reprogram(&mut self) -> Result<(), String>;
    /// Re-read the network devices; true when a forwarding path changed.
    fn refresh_devices(&mut self) -> Result<bool, String>;
    /// The IPv4 backend addresses whose routes [`watch_routes`] checks.
    fn ipv4_backends(&self) -> Vec<Ipv4Addr>;
    /// Sum each backend's connection counts kept per CPU where least-conn
    /// reads them (`Dataplane::sum_conns`).
    fn sum_conns(&mut self) -> Result<(), String>;
    /// A sweep of the flow tables under way.
    type Sweep: Send + 'static;
    /// Begin expiring idle flows.
    fn sweep_begin(&mut self) -> Self::Sweep;
    /// Sweep the next part; the report once the sweep is done.
    fn sweep_step(&mut self, run: &mut Self::Sweep) -> Result<Option<SweepReport>, String>;
}

impl Driven for Agent {
    fn probe_targets(&self) -> Vec<(BackendKey, SocketAddr, HealthConfig)> {
        Self::probe_targets(self)
    }
    fn observe(&mut self, key: &BackendKey, result: Result<Duration, String>) -> bool {
        Self::observe(self, key, result)
    }
    fn ramping(&self) -> bool {
        Self::ramping(self)
    }
    fn reprogram(&mut self) -> Result<(), String> {
        self.apply().map_err(|e| e.to_string())
    }
    fn refresh_devices(&mut self) -> Result<bool, String> {
        self.dp.refresh_paths().map_err(|e| e.to_string())
    }
    fn sum_conns(&mut self) -> Result<(), String> {
        self.dp.sum_conns().map_err(|e| e.to_string())
    }
    fn ipv4_backends(&self) -> Vec<Ipv4Addr> {
        Self::ipv4_backends(self)
    }
    type Sweep = SweepRun;
    fn sweep_begin(&mut self) -> SweepRun {
        Self::sweep_begin(self)
    }
    fn sweep_step(&mut self, run: &mut SweepRun) -> Result<Option<SweepReport>, String> {
        Self::sweep_step(self, run).map_err(|e| e.to_string())
    }
}

/// How often each loop runs.
#[derive(Clone, Copy, Debug)]
pub struct Periods {
    /// The probe supervisor's check for added, changed or removed targets.
    pub supervise: Duration,
    /// Slow start's reprogramming step.
    pub slow_start: Duration,
    /// Re-reading the network devices.
    pub devices: Duration,
    /// Asking the FIB about the routes to the backends.
    pub routes: Duration,
    /// Expiring idle flows.
    pub sweep: Duration,
    /// Summing the connection counts kept per CPU for least-conn.
    pub conns: Duration,
}

impl Default for Periods {
    fn default() -> Self {
        Self {
            supervise: Duration::from_millis(500),
            slow_start: Duration::from_millis(500),
            devices: Duration::from_secs(1),
            routes: Duration::from_secs(5),
            sweep: Duration::from_secs(5),
            conns: Duration::from_secs(1),
        }
    }
}

/// The running loops; dropping this aborts them all.
pub struct Tasks(Vec<JoinHandle<()>>);

impl Tasks {
    /// Start every loop on `state`.
    pub fn start<D: Driven>(state: &Arc<Mutex<D>>, periods: Periods) -> Self {
        let changed = Arc::new(Notify::new());
        let (results, to_observe) = mpsc::channel(RESULTS_QUEUE);
        Self(vec![
            tokio::spawn(supervise_probes(state.clone(), periods.supervise, results)),
            tokio::spawn(observe_results(state.clone(), to_observe, changed.clone())),
            tokio::spawn(reprogram_after_probes(state.clone(), changed)),
            tokio::spawn(slow_start(state.clone(), periods.slow_start)),
            tokio::spawn(watch_devices(state.clone(), periods.devices)),
            tokio::spawn(watch_routes(state.clone(), periods.routes)),
            tokio::spawn(sweep_flows(state.clone(), periods.sweep)),
            tokio::spawn(sum_conns(state.clone(), periods.conns)),
        ])
    }

    /// Abort every loop and wait until each has stopped (so none holds a
    /// clone of the state afterwards).
    pub async fn stop(mut self) {
        for t in std::mem::take(&mut self.0) {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// The lock, also after a panic of another holder (the state stays usable:
/// every change is applied whole or not at all).
pub fn lock<D>(state: &Mutex<D>) -> MutexGuard<'_, D> {
    state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Run `f` under the lock on the blocking pool.
async fn locked<D: Driven, R: Send + 'static>(
    state: &Arc<Mutex<D>>,
    f: impl FnOnce(&mut D) -> R + Send + 'static,
) -> Option<R> {
    let state = state.clone();
    blocking(move || f(&mut lock(&state))).await
}

/// Run `f` on the blocking pool; None when it panicked (logged).
async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => Some(r),
        Err(e) => {
            warn!(error = %e, "background task failed");
            None
        }
    }
}

fn interval(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick
}

/// What one probe loop does: the address it connects to (`health.port`
/// applied) and how it probes. Rise and fall are left out: each backend's
/// checker applies its own service's to the shared results.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ProbeSpec {
    target: SocketAddr,
    cfg: HealthConfig,
}

impl ProbeSpec {
    fn of(addr: SocketAddr, cfg: &HealthConfig) -> Self {
        // The port is resolved into `target`, so the spec keeps none.
        Self {
            target: health::probe_target(cfg, addr),
            cfg: HealthConfig { rise: 0, fall: 0, port: None, ..cfg.clone() },
        }
    }
}

/// Keep one probe loop per endpoint and way of probing it, restarting a
/// loop whose backends changed. Backends of several services on one
/// endpoint, probed the same way, share one probe (as HAProxy's `track`
/// shares a check): 255 services over the same three hosts cost three
/// probes an interval, not 765, and every one of those backends sees the
/// same result at the same moment.
async fn supervise_probes<D: Driven>(state: Arc<Mutex<D>>, period: Duration, results: mpsc::Sender<ProbeResult>) {
    // The probe loops, aborted with this task (dropping a JoinHandle only
    // detaches its task).
    struct Loops(HashMap<ProbeSpec, (Vec<BackendKey>, JoinHandle<()>)>);
    impl Drop for Loops {
        fn drop(&mut self) {
            for (_, task) in self.0.values() {
                task.abort();
            }
        }
    }
    let mut loops = Loops(HashMap::new());
    let running = &mut loops.0;
    let mut tick = interval(period);
    loop {
        tick.tick().await;
        let mut wanted: HashMap<ProbeSpec, Vec<BackendKey>> = HashMap::new();
        for (key, addr, cfg) in lock(&state).probe_targets() {
            wanted.entry(ProbeSpec::of(addr, &cfg)).or_default().push(key);
        }
        for keys in wanted.values_mut() {
            keys.sort();
        }
        running.retain(|spec, (keys, task)| {
            let keep = wanted.get(spec) == Some(keys);
            if !keep {
                task.abort();
            }
            keep
        });
        for (spec, keys) in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(spec) {
                let task = tokio::spawn(probe_loop(keys.clone(), slot.key().clone(), results.clone()));
                slot.insert((keys, task));
            }
        }
    }
}

/// One probe's outcome on its way to the state: which backend, and how
/// long the probe took or why it failed.
type ProbeResult = (BackendKey, Result<Duration, String>);

/// Probe results queued for [`observe_results`] (the probe loops wait
/// when it is full).
const RESULTS_QUEUE: usize = 8192;

/// Probe one endpoint every `spec.cfg.interval` and send each result on
/// for every backend that shares the probe.
async fn probe_loop(keys: Vec<BackendKey>, spec: ProbeSpec, results: mpsc::Sender<ProbeResult>) {
    let mut tick = interval(spec.cfg.interval);
    loop {
        tick.tick().await;
        let result = health::probe(&spec.cfg, spec.target).await.map_err(|e| e.to_string());
        for key in &keys {
            if results.send((key.clone(), result.clone())).await.is_err() {
                return;
            }
        }
    }
}

/// Hand the probe results to the state, every result waiting at once
/// under one hold of the lock (thousands of probes a second each taking
/// the lock on the blocking pool cost a third of a CPU in thread
/// switches); results that need the datapath reprogrammed wake
/// [`reprogram_after_probes`].
async fn observe_results<D: Driven>(
    state: Arc<Mutex<D>>,
    mut queue: mpsc::Receiver<ProbeResult>,
    changed: Arc<Notify>,
) {
    let mut batch = Vec::new();
    while queue.recv_many(&mut batch, RESULTS_QUEUE).await > 0 {
        let results = std::mem::take(&mut batch);
        // Every result observed: no short cut once one needs reprogramming.
        let observe = move |s: &mut D| results.into_iter().fold(false, |any, (key, r)| s.observe(&key, r) | any);
        if locked(&state, observe).await == Some(true) {
            changed.notify_one();
        }
    }
}

/// How long the reprogramming after a probe result waits for more results
/// that need it, so that they are applied together.
pub const PROBE_COALESCE: Duration = Duration::from_millis(5);

/// Reprogram the datapath after probe results that need it, several at
/// once: the results of one moment (many backends going down with a
/// shared host, every probe of a large pool landing on one tick) cost one
/// reprogramming, not one each. At 255 services and 4,095 backends, one
/// each kept the agent busy for seconds, and lbctl waited on it.
async fn reprogram_after_probes<D: Driven>(state: Arc<Mutex<D>>, changed: Arc<Notify>) {
    loop {
        changed.notified().await;
        tokio::time::sleep(PROBE_COALESCE).await;
        if let Some(Err(e)) = locked(&state, D::reprogram).await {
            warn!(error = %e, "reprogramming after probe results failed");
        }
    }
}

/// While a backend ramps up, reprogram every period, and once more after
/// the ramp ends to land on the full weight.
async fn slow_start<D: Driven>(state: Arc<Mutex<D>>, period: Duration) {
    let mut tick = interval(period);
    let mut was = false;
    loop {
        tick.tick().await;
        was = locked(&state, move |s| {
            let now = s.ramping();
            if (now || was)
                && let Err(e) = s.reprogram()
            {
                warn!(error = %e, "slow start: reprogramming failed");
            }
            now
        })
        .await
        .unwrap_or(false);
    }
}

/// Re-read the network devices: a device's ability to take XDP redirects
/// changes at run time (a veth peer's GRO or XDP program, a link going
/// down), and the datapath must never redirect into one that lost it. The
/// dataplane logs changes, one line per ingress and egress.
async fn watch_devices<D: Driven>(state: Arc<Mutex<D>>, period: Duration) {
    let mut tick = interval(period);
    loop {
        tick.tick().await;
        if let Some(Err(e)) = locked(&state, D::refresh_devices).await {
            warn!(error = %e, "re-reading the network devices failed");
        }
    }
}

/// Every period, [`Driven::sum_conns`]: least-conn sees a backend's flows
/// counted per CPU (`lb_common::FLOW_CONNS_CPU`) that much late at most.
async fn sum_conns<D: Driven>(state: Arc<Mutex<D>>, period: Duration) {
    let mut tick = interval(period);
    loop {
        tick.tick().await;
        if let Some(Err(e)) = locked(&state, D::sum_conns).await {
            warn!(error = %e, "summing the per-CPU connection counts failed");
        }
    }
}

/// Every period, [`check_routes`] for the configuration's IPv4 backends:
/// the addresses are taken under the state's lock, the FIB's answers
/// awaited without it (about 5 ms per 1,000 addresses, which health
/// transitions and lbctl requests would otherwise wait for).
async fn watch_routes<D: Driven>(state: Arc<Mutex<D>>, period: Duration) {
    let mut tick = interval(period);
    let mut watch = RouteMtuWatch::default();
    loop {
        tick.tick().await;
        let Some(backends) = locked(&state, |s| s.ipv4_backends()).await else { continue };
        // A panicked check loses what was reported: reported again.
        watch = blocking(move || {
            check_routes(&mut watch, &backends);
            watch
        })
        .await
        .unwrap_or_default();
    }
}

/// Warn about each route to an IPv4 backend that has an MTU of its own,
/// below its device's, and not locked: the kernel's IPv4 forwarding
/// honours such an MTU, but the FIB helper the datapath asks does not (it
/// answers by a route's MTU only when it is locked, or with
/// `net.ipv4.ip_forward_use_pmtu`), so the balanced packets to that
/// backend are held to the device's MTU alone, and the larger ones are
/// lost past the route's narrow part. Once per route while it stays so.
/// One FIB question per backend address: the routes that matter, without
/// a dump of a table that may hold a million.
fn check_routes(watch: &mut RouteMtuWatch, backends: &[Ipv4Addr]) {
    let use_pmtu = || std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward_use_pmtu").is_ok_and(|v| v.trim() == "1");
    let found = match watch.check(backends, use_pmtu) {
        Ok(f) => f,
        Err(e) => {
            debug!(error = %e, "asking the FIB for the backends' routes");
            return;
        }
    };
    for r in found {
        warn!(
            route = %format!("{}/{}", r.route.prefix, r.route.prefix_len),
            table = r.route.table,
            device = r.device,
            mtu = r.route.mtu,
            device_mtu = r.device_mtu,
            backend = %r.backend,
            "a route to a backend has an MTU that is not locked: the kernel's forwarding honours it, the XDP \
             datapath's FIB lookups do not, so balanced packets to the backend are held to the device's MTU \
             only; lock it (ip route change <route> ... mtu lock <mtu>) or set net.ipv4.ip_forward_use_pmtu=1"
        );
    }
}

/// Expire idle flows (the datapath only sees FIN and RST). A sweep holds
/// the state's lock one part at a time (a batch of entries, milliseconds),
/// letting go in between: at millions of flows a whole sweep takes
/// seconds, and a health change, a weight change or an lbctl request
/// would otherwise wait for it.
async fn sweep_flows<D: Driven>(state: Arc<Mutex<D>>, period: Duration) {
    let mut tick = interval(period);
    loop {
        tick.tick().await;
        let Some(mut run) = locked(&state, D::sweep_begin).await else { continue };
        let done = loop {
            match locked(&state, move |d| {
                let r = d.sweep_step(&mut run);
                (run, r)
            })
            .await
            {
                Some((_, Ok(Some(r)))) => break Ok(r),
                Some((next, Ok(None))) => run = next,
                Some((_, Err(e))) => break Err(e),
                // The step's task failed (logged by `locked`).
                None => break Err("the sweep's task failed".to_owned()),
            }
        };
        match done {
            Ok(r) if r.expired > 0 || r.removed > 0 => {
                debug!(scanned = r.scanned, removed = r.removed, expired = r.expired, "flow sweep");
            }
            Ok(_) => {}
            Err(e) => warn!(error = %e, "flow sweep failed"),
        }
    }
}

/// How often the announcer compares the VIPs to announce with BIRD's,
/// and reads the sessions' states.
pub const ANNOUNCE_PERIOD: Duration = Duration::from_millis(250);

/// Drive BIRD while the configuration has a `bgp:` section: start it (or
/// adopt the one lbd left running before a graceful restart), have it
/// announce exactly the VIPs with a healthy backend
/// ([`Agent::vips_to_announce`]), follow reloads of the section, restart it
/// if it exits, and keep [`Agent::bgp`] up to date.
///
/// Run it on lbd's main thread (polled by `block_on`, not spawned): BIRD's
/// parent-death signal follows the thread that started it, and only the
/// main thread lives through a restart's exec. Dropping this future stops
/// BIRD (the peers withdraw our routes), unless `keep` is set by then.
pub async fn announce_vips(state: Arc<Mutex<Agent>>, period: Duration, keep: Arc<AtomicBool>) {
    /// The speaker, kept running past the drop when `keep` says so.
    struct Held(Option<bgp::Speaker>, Arc<AtomicBool>);
    impl Drop for Held {
        fn drop(&mut self) {
            if let Some(sp) = self.0.as_mut()
                && self.1.load(Ordering::SeqCst)
            {
                sp.keep();
            }
        }
    }
    let mut held = Held(None, keep);
    let speaker = &mut held.0;
    let mut tick = interval(period);
    // A failing BIRD start is retried, at most every few seconds.
    let mut retry_at = tokio::time::Instant::now();
    let mut first = true;
    loop {
        tick.tick().await;
        let (cfg, vips, base) = {
            let a = lock(&state);
            (a.config.bgp.clone(), a.vips_to_announce(), a.config.control_socket.clone())
        };
        let Some(cfg) = cfg else {
            if speaker.take().is_some() {
                info!("bgp: section removed; BIRD stopped, every VIP withdrawn");
            }
            lock(&state).bgp = None;
            first = false;
            continue;
        };
        if std::mem::take(&mut first)
            && let Some(sp) = bgp::Speaker::adopt(&cfg, &base).await
        {
            info!("bgp: adopted the BIRD the previous lbd left running");
            *speaker = Some(sp);
        }
        if let Some(sp) = speaker.as_mut()
            && let Some(status) = sp.exited()
        {
            warn!(%status, "bgp: BIRD exited; starting it again");
            // Gone already: nothing to stop.
            sp.keep();
            *speaker = None;
        }
        let result = match speaker.as_mut() {
            Some(sp) => {
                let before = sp.vips.clone();
                match sp.set(&cfg, &vips).await {
                    Ok(()) => {
                        log_changes(&before, &vips);
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                }
            }
            None if tokio::time::Instant::now() < retry_at => Err("BIRD is not running".to_owned()),
            None => match bgp::Speaker::start(&cfg, &vips, &base).await {
                Ok(sp) => {
                    info!(vips = ?vips, peers = cfg.peers.len(), "bgp: BIRD started");
                    *speaker = Some(sp);
                    Ok(())
                }
                Err(e) => {
                    retry_at = tokio::time::Instant::now() + Duration::from_secs(3);
                    Err(e.to_string())
                }
            },
        };
        if let Err(e) = &result {
            warn!(error = %e, "bgp: driving BIRD failed");
        }
        let peers = match speaker.as_ref() {
            Some(sp) => sp.peers().await.unwrap_or_else(|_| unknown_peers(&cfg)),
            None => unknown_peers(&cfg),
        };
        let originated = speaker.as_ref().map(|sp| sp.vips.clone()).unwrap_or_default();
        lock(&state).bgp = Some(bgp::BgpStatus { peers, originated, error: result.err() });
    }
}

fn unknown_peers(cfg: &crate::config::BgpConfig) -> Vec<bgp::PeerStatus> {
    cfg.peers.iter().map(|p| bgp::PeerStatus { address: p.address, asn: p.asn, state: "unknown".into() }).collect()
}

fn log_changes(
    before: &std::collections::BTreeSet<std::net::IpAddr>,
    now: &std::collections::BTreeSet<std::net::IpAddr>,
) {
    for vip in now.difference(before) {
        info!(%vip, "bgp: announcing");
    }
    for vip in before.difference(now) {
        info!(%vip, "bgp: withdrawing (no healthy backend)");
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::config::ProbeKind;

    /// Records what the loops asked of it.
    #[derive(Default)]
    struct Fake {
        targets: Vec<(BackendKey, SocketAddr, HealthConfig)>,
        observed: Vec<(BackendKey, bool)>,
        ramp_left: u32,
        reprograms: u32,
        refreshes: u32,
        /// Sweeps begun and ended.
        sweeps: u32,
        /// Parts a sweep takes (at least one), and how long each holds the state.
        sweep_parts: u32,
        part_time: Duration,
        /// Parts left of the sweep under way, seen from outside.
        sweep_left: Option<u32>,
        fail: bool,
        /// Every probe result asks for reprogramming.
        every_result_changes: bool,
        /// Such results since the last reprogramming.
        unapplied: u32,
    }

    impl Driven for Fake {
        fn probe_targets(&self) -> Vec<(BackendKey, SocketAddr, HealthConfig)> {
            self.targets.clone()
        }
        fn observe(&mut self, key: &BackendKey, result: Result<Duration, String>) -> bool {
            self.observed.push((key.clone(), result.is_ok()));
            if self.every_result_changes {
                self.unapplied += 1;
            }
            self.every_result_changes
        }
        fn ramping(&self) -> bool {
            self.ramp_left > 0
        }
        fn reprogram(&mut self) -> Result<(), String> {
            self.reprograms += 1;
            self.unapplied = 0;
            self.ramp_left = self.ramp_left.saturating_sub(1);
            Ok(())
        }
        fn refresh_devices(&mut self) -> Result<bool, String> {
            self.refreshes += 1;
            if self.fail { Err("netlink said no".into()) } else { Ok(false) }
        }
        fn ipv4_backends(&self) -> Vec<Ipv4Addr> {
            Vec::new()
        }
        fn sum_conns(&mut self) -> Result<(), String> {
            Ok(())
        }
        type Sweep = u32;
        fn sweep_begin(&mut self) -> u32 {
            let parts = self.sweep_parts.max(1);
            self.sweep_left = Some(parts);
            parts
        }
        fn sweep_step(&mut self, left: &mut u32) -> Result<Option<SweepReport>, String> {
            std::thread::sleep(self.part_time);
            *left -= 1;
            self.sweep_left = Some(*left);
            if self.fail || *left == 0 {
                self.sweeps += 1;
                self.sweep_left = None;
            }
            if self.fail {
                return Err("map said no".into());
            }
            Ok((*left == 0).then(SweepReport::default))
        }
    }

    fn fast() -> Periods {
        let p = Duration::from_millis(20);
        Periods { supervise: p, slow_start: p, devices: p, routes: p, sweep: p, conns: p }
    }

    /// A TCP probe every `interval_ms`, given a second to answer: the
    /// probes' outcomes are the test's, not how fast a loaded machine
    /// answers on loopback.
    fn tcp(interval_ms: u64) -> HealthConfig {
        HealthConfig {
            kind: ProbeKind::Tcp,
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_secs(1),
            ..HealthConfig::default()
        }
    }

    async fn wait_for(state: &Arc<Mutex<Fake>>, what: &str, done: impl Fn(&Fake) -> bool) {
        for _ in 0..200 {
            if done(&lock(state)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    /// Probe results that need the datapath reprogrammed are applied
    /// together: a burst of them costs a few reprogrammings, not one
    /// each, and none is left unapplied once the results stop.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn probe_results_are_reprogrammed_together() {
        let closed_socket = tokio::net::TcpSocket::new_v4().unwrap();
        closed_socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let closed = closed_socket.local_addr().unwrap();
        let k = |port: u16| -> BackendKey { ("web".into(), IpAddr::V4(Ipv4Addr::LOCALHOST), port) };
        let state = Arc::new(Mutex::new(Fake {
            targets: (1..=40).map(|p| (k(p), closed, tcp(20))).collect(),
            every_result_changes: true,
            ..Fake::default()
        }));
        let tasks = Tasks::start(&state, fast());
        wait_for(&state, "400 probe results", |f| f.observed.len() >= 400).await;
        lock(&state).targets.clear();
        // Past the supervisor's next check, the results in flight and the
        // reprogramming after them.
        tokio::time::sleep(Duration::from_millis(300)).await;
        {
            let f = lock(&state);
            assert_eq!(f.unapplied, 0, "results left unapplied");
            let n = f.observed.len() as u32;
            assert!(f.reprograms >= 1 && f.reprograms * 4 <= n, "{} reprogrammings for {n} results", f.reprograms);
        }
        tasks.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn probes_follow_the_targets() {
        let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_addr = up.local_addr().unwrap();
        // Bound but not listening, for the whole test: connections are
        // refused, and no other socket can take the port meanwhile.
        let closed_socket = tokio::net::TcpSocket::new_v4().unwrap();
        closed_socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let closed = closed_socket.local_addr().unwrap();
        let k = |port: u16| -> BackendKey { ("web".into(), IpAddr::V4(Ipv4Addr::LOCALHOST), port) };
        let state = Arc::new(Mutex::new(Fake {
            targets: vec![(k(1), up_addr, tcp(20)), (k(2), closed, tcp(20))],
            ..Fake::default()
        }));
        let tasks = Tasks::start(&state, fast());
        wait_for(&state, "both backends probed twice", |f| {
            [k(1), k(2)].iter().all(|key| f.observed.iter().filter(|(o, _)| o == key).count() >= 2)
        })
        .await;
        {
            let f = lock(&state);
            assert!(f.observed.iter().filter(|(o, _)| *o == k(1)).all(|(_, ok)| *ok), "{:?}", f.observed);
            assert!(f.observed.iter().filter(|(o, _)| *o == k(2)).all(|(_, ok)| !ok), "{:?}", f.observed);
        }
        // Remove backend 2: its loop stops; backend 1 keeps being probed.
        {
            let mut f = lock(&state);
            f.targets.retain(|(key, _, _)| *key == k(1));
        }
        // Past the supervisor's next check and any result already in flight.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = lock(&state).observed.clone();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = lock(&state).observed.clone();
        let new = &after[before.len()..];
        assert!(new.iter().any(|(o, _)| *o == k(1)), "backend 1 still probed: {new:?}");
        assert!(new.iter().all(|(o, _)| *o == k(1)), "a removed backend is not probed: {new:?}");
        tasks.stop().await;
        // A probe result already handed to the blocking pool may still land
        // (it holds the state until done); after that, nothing does.
        for _ in 0..100 {
            if Arc::strong_count(&state) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(Arc::strong_count(&state), 1, "no loop holds the state after stop");
        let stopped = lock(&state).observed.len();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(lock(&state).observed.len(), stopped, "no probe after stop");
    }

    /// Backends of several services on one endpoint, probed the same way,
    /// share one probe: the endpoint sees one connection per round, and
    /// each backend gets every result. Another way of probing (here
    /// another interval) keeps a probe of its own; rise and fall, which
    /// each checker applies, do not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn backends_on_one_endpoint_share_a_probe() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        let server = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        let k = |service: &str| -> BackendKey { (service.into(), addr.ip(), addr.port()) };
        let other_rise = HealthConfig { rise: 5, fall: 1, ..tcp(30) };
        let state = Arc::new(Mutex::new(Fake {
            targets: vec![(k("a"), addr, tcp(30)), (k("b"), addr, other_rise), (k("c"), addr, tcp(45))],
            ..Fake::default()
        }));
        let tasks = Tasks::start(&state, fast());
        let count = |f: &Fake, key: &BackendKey| f.observed.iter().filter(|(o, ok)| o == key && *ok).count();
        wait_for(&state, "ten results for each backend", |f| ["a", "b", "c"].iter().all(|s| count(f, &k(s)) >= 10))
            .await;
        tasks.stop().await;
        // Stopped: no probe connects any more.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let connections = accepted.load(Ordering::SeqCst);
        server.abort();
        let f = lock(&state);
        let (a, b, c) = (count(&f, &k("a")), count(&f, &k("b")), count(&f, &k("c")));
        assert!(f.observed.iter().all(|(_, ok)| *ok), "{:?}", f.observed);
        // a and b share: the same results, one connection for both (the
        // stop may fall between a's copy of a result and b's).
        assert!(a.abs_diff(b) <= 1, "a and b share one probe, so they see the same results: {a} and {b}");
        // A probe may have connected without its result landing before
        // the stop: one more connection per loop at most.
        assert!(
            connections >= a + c && connections <= a + c + 2,
            "{connections} connections for {a} shared results (a, b) and {c} of c's own"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_start_reprograms_while_ramping_and_once_after() {
        let state = Arc::new(Mutex::new(Fake { ramp_left: 3, ..Fake::default() }));
        let tasks = Tasks::start(&state, fast());
        wait_for(&state, "the ramp to end", |f| f.ramp_left == 0).await;
        // The last reprogram comes a period after the ramp's end; then no
        // more.
        wait_for(&state, "three steps while ramping, one to land on the full weight", |f| f.reprograms >= 4).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = lock(&state).reprograms;
        tasks.stop().await;
        assert_eq!(n, 4, "three steps while ramping, one to land on the full weight");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn devices_and_sweeps_run_periodically_and_survive_errors() {
        let state = Arc::new(Mutex::new(Fake { fail: true, ..Fake::default() }));
        let tasks = Tasks::start(&state, fast());
        wait_for(&state, "repeated refreshes and sweeps despite errors", |f| f.refreshes >= 3 && f.sweeps >= 3).await;
        drop(tasks);
        // A run already handed to the blocking pool may still land: wait
        // for 100 ms without a change (the loops ran every 20 ms), within
        // 5 s, then make sure nothing more comes.
        let counts = || {
            let f = lock(&state);
            (f.refreshes, f.sweeps)
        };
        let mut last = counts();
        let mut still = 0;
        for _ in 0..500 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let now = counts();
            still = if now == last { still + 1 } else { 0 };
            last = now;
            if still >= 10 {
                break;
            }
        }
        assert!(still >= 10, "refreshes and sweeps still running 5 s after the tasks were dropped: {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(counts(), last, "dropping the tasks stops every loop");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_sweep_lets_go_of_the_state_between_its_parts() {
        // 40 parts of 5 ms: were the lock held for a whole sweep (200 ms),
        // nobody could ever see one half done.
        let parts = 40;
        let state =
            Arc::new(Mutex::new(Fake { sweep_parts: parts, part_time: Duration::from_millis(5), ..Fake::default() }));
        let tasks = Tasks::start(&state, fast());
        wait_for(&state, "the state taken in the middle of a sweep", |f| {
            f.sweep_left.is_some_and(|left| left > 0 && left < parts)
        })
        .await;
        wait_for(&state, "sweeps to end", |f| f.sweeps >= 2).await;
        tasks.stop().await;
    }
}

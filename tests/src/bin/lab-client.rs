//! Load client for the namespace lab. Each subcommand prints exactly one JSON
//! object on stdout. Every network operation is bounded by a timeout.
#![expect(unused_crate_dependencies, reason = "used by the lab library and the tests")]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand};
use lb_tests::http1;
use serde::Serialize;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

const MAX_ERRORS: usize = 10;

#[derive(Parser, Debug)]
#[command(about = "Lab load client; prints one JSON object on stdout")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// COUNT HTTP requests, each on a new TCP connection (`Connection: close`).
    Conns(ConnsArgs),
    /// Keep-alive connections doing sequential request/response rounds.
    Longlived(LonglivedArgs),
    /// UDP request/reply, one fresh socket per datagram.
    Udp(UdpArgs),
    /// A SYN flood from spoofed sources (raw socket).
    Flood(FloodArgs),
    /// Open keep-alive connections, one request each, hold them idle, then
    /// close them all (FIN, or RST with `--reset`).
    Hold(HoldArgs),
    /// Download BYTES over one connection (`GET /bytes/N`).
    Download(DownloadArgs),
    /// Upload BYTES over one connection (a POST body).
    Upload(DownloadArgs),
    /// Keep-alive requests at a fixed total rate, open loop (see
    /// `lb_tests::paced`): latency percentiles comparable across paths.
    Paced(PacedArgs),
}

#[derive(Args, Debug)]
struct PacedArgs {
    /// Where the connections go, comma separated: connection c to the
    /// (c mod n)-th target.
    #[arg(long, value_delimiter = ',', required = true)]
    target: Vec<SocketAddr>,
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Requests per second, all connections together.
    #[arg(long)]
    rate: f64,
    #[arg(long, default_value_t = 4.0)]
    secs: f64,
}

#[derive(Args, Debug)]
struct DownloadArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long)]
    bytes: u64,
    #[command(flatten)]
    src: SourceArgs,
    /// Bound on the whole download.
    #[arg(long, default_value_t = 120_000)]
    timeout_ms: u64,
}

#[derive(Args, Debug)]
struct HoldArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 30)]
    connections: usize,
    /// How long the connections stay open and idle after their request.
    #[arg(long)]
    hold_ms: u64,
    /// Close with a reset (SO_LINGER 0) instead of a FIN.
    #[arg(long)]
    reset: bool,
    #[command(flatten)]
    src: SourceArgs,
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

#[derive(Args, Debug)]
struct FloodArgs {
    #[arg(long)]
    target: std::net::SocketAddrV4,
    /// SYNs per second.
    #[arg(long)]
    rate: u64,
    #[arg(long)]
    duration_ms: u64,
    /// Spoofed sources: this network's addresses (a /16 by default).
    #[arg(long, default_value = "10.99.0.0")]
    sources: Ipv4Addr,
    #[arg(long, default_value_t = 16)]
    host_bits: u32,
}

#[derive(Args, Debug, Clone)]
struct SourceArgs {
    /// Source addresses to bind (round robin), comma separated; IPv4 or
    /// IPv6 (of the target's family).
    #[arg(long, value_delimiter = ',', conflicts_with = "sources_range")]
    sources: Vec<IpAddr>,
    /// Inclusive source range A-B: IPv4 with host parts .0 and .255
    /// skipped, or IPv6 (every address, e.g. fd00:10::1:1-fd00:10::1:64).
    #[arg(long)]
    sources_range: Option<String>,
}

impl SourceArgs {
    fn resolve(&self) -> anyhow::Result<Vec<IpAddr>> {
        let Some(range) = &self.sources_range else {
            return Ok(self.sources.clone());
        };
        let (a, b) = range.split_once('-').with_context(|| format!("--sources-range {range:?}: expected A-B"))?;
        if let (Ok(a), Ok(b)) = (a.trim().parse::<Ipv6Addr>(), b.trim().parse::<Ipv6Addr>()) {
            let (a, b) = (u128::from(a), u128::from(b));
            if a > b {
                bail!("--sources-range {range:?}: start is after end");
            }
            if b - a > 1 << 20 {
                bail!("--sources-range {range:?}: too many addresses");
            }
            return Ok((a..=b).map(|x| IpAddr::V6(Ipv6Addr::from(x))).collect());
        }
        let a: Ipv4Addr = a.trim().parse().with_context(|| format!("bad address {a:?}"))?;
        let b: Ipv4Addr = b.trim().parse().with_context(|| format!("bad address {b:?}"))?;
        let (a, b) = (u32::from(a), u32::from(b));
        if a > b {
            bail!("--sources-range {range:?}: start is after end");
        }
        if b - a > 1 << 20 {
            bail!("--sources-range {range:?}: too many addresses");
        }
        let v: Vec<IpAddr> =
            (a..=b).filter(|x| !matches!(x & 0xff, 0 | 255)).map(|x| IpAddr::V4(Ipv4Addr::from(x))).collect();
        if v.is_empty() {
            bail!("--sources-range {range:?} holds no usable address");
        }
        Ok(v)
    }
}

#[derive(Args, Debug)]
struct ConnsArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 1000)]
    count: usize,
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    #[command(flatten)]
    src: SourceArgs,
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Keep going for this long instead of stopping after `count` (each
    /// worker finishes its connection in flight).
    #[arg(long)]
    duration_ms: Option<u64>,
    /// Keep going until this file exists instead of stopping after
    /// `count` (a test's signal that what the load spans is over).
    #[arg(long)]
    stop_file: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
struct LonglivedArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Rounds per connection; with `stop_file`, at least these.
    #[arg(long, default_value_t = 100)]
    rounds: usize,
    #[command(flatten)]
    src: SourceArgs,
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Go on with rounds after `rounds` until this file exists.
    #[arg(long)]
    stop_file: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
struct UdpArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// Datagrams in flight at once (each still on its own socket).
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    #[command(flatten)]
    src: SourceArgs,
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    /// Datagrams sent one after another from each socket (one UDP flow):
    /// `count` is then the number of flows; a flow whose answers came from
    /// more than one backend counts in `flows_switched`.
    #[arg(long, default_value_t = 1)]
    per_socket: usize,
}

/// First few error strings, shared by all workers.
#[derive(Clone, Default)]
struct Errors(Arc<Mutex<Vec<String>>>);

impl Errors {
    /// Records `e` with the UTC time of day it happened, to be read
    /// beside lbd's log (whose lines carry UTC timestamps).
    fn push(&self, e: String) {
        let mut v = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if v.len() < MAX_ERRORS {
            v.push(format!("{e} (at {} UTC)", utc_time_of_day()));
        }
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// The time of day, UTC, as HH:MM:SS.mmm (only the clock: a whole date
/// formatter would be a dependency for a diagnostic).
fn utc_time_of_day() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let s = t.as_secs() % 86_400;
    format!("{:02}:{:02}:{:02}.{:03}", s / 3600, s / 60 % 60, s % 60, t.subsec_millis())
}

fn main() {
    let cli = Cli::parse();
    lb_tests::raise_nofile_limit();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lab-client: cannot start runtime: {e}");
            std::process::exit(2);
        }
    };
    let res = rt.block_on(async {
        match cli.cmd {
            Cmd::Conns(a) => run_conns(a).await,
            Cmd::Longlived(a) => run_longlived(a).await,
            Cmd::Udp(a) => run_udp(a).await,
            Cmd::Hold(a) => run_hold(a).await,
            Cmd::Download(a) => run_download(a).await,
            Cmd::Upload(a) => run_upload(a).await,
            Cmd::Paced(a) => tokio::task::spawn_blocking(move || {
                Ok(serde_json::to_value(lb_tests::paced::run(&a.target, a.connections, a.rate, a.secs)?)?)
            })
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("paced load: {e}"))),
            Cmd::Flood(a) => tokio::task::spawn_blocking(move || {
                let r = lb_tests::flood::syn_flood(
                    a.target,
                    a.sources,
                    a.host_bits,
                    a.rate,
                    Duration::from_millis(a.duration_ms),
                )?;
                Ok(serde_json::to_value(r)?)
            })
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("flood thread: {e}"))),
        }
    });
    match res {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("lab-client: {e:#}");
            std::process::exit(1);
        }
    }
    // Do not wait for stuck tasks; everything they could report is printed.
    rt.shutdown_background();
}

async fn timed<T>(
    what: impl FnOnce() -> String,
    ms: u64,
    fut: impl Future<Output = std::io::Result<T>>,
) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_millis(ms), fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{}: {e}", what())),
        Err(_) => Err(format!("{}: timed out after {ms} ms", what())),
    }
}

async fn connect(target: SocketAddr, src: Option<IpAddr>, timeout_ms: u64) -> Result<TcpStream, String> {
    let what = || match src {
        Some(s) => format!("connect {s} -> {target}"),
        None => format!("connect -> {target}"),
    };
    let sock = if target.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }
        .map_err(|e| format!("{}: socket: {e}", what()))?;
    if let Some(s) = src {
        // Defer port choice to connect() so the 4-tuple, not the bare
        // (address, port), has to be unique; this avoids ephemeral-port
        // exhaustion when binding many connections to one source address.
        let one: libc::c_int = 1;
        // SAFETY: valid fd and a c_int option value of the stated size.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                (&raw const one).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        sock.bind(SocketAddr::new(s, 0)).map_err(|e| format!("{}: bind: {e}", what()))?;
    }
    let stream = timed(what, timeout_ms, sock.connect(target)).await?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

fn request(target: SocketAddr, close: bool) -> String {
    let conn = if close { "close" } else { "keep-alive" };
    format!("GET / HTTP/1.1\r\nHost: {target}\r\nUser-Agent: lab-client\r\nAccept: */*\r\nConnection: {conn}\r\n\r\n")
}

/// Sends one request and reads its response; returns (backend, server closes).
async fn round_trip(stream: &mut TcpStream, buf: &mut Vec<u8>, req: &str) -> std::io::Result<(String, bool)> {
    stream.write_all(req.as_bytes()).await?;
    let head = read_ok_response(stream, buf).await?;
    let backend = head
        .header("x-backend")
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "response has no X-Backend header"))?
        .to_string();
    Ok((backend, head.connection_has("close")))
}

/// Reads one whole response, which must be a 200; returns its head.
async fn read_ok_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<http1::Head> {
    use std::io::{Error, ErrorKind};
    let head = http1::read_head(stream, buf)
        .await?
        .ok_or_else(|| Error::new(ErrorKind::UnexpectedEof, "connection closed before a response"))?;
    let status = head.status()?;
    let len = head.content_length()?;
    http1::read_body(stream, buf, len).await?;
    if status != 200 {
        return Err(Error::other(format!("HTTP status {status}")));
    }
    Ok(head)
}

async fn wait_eof(stream: &mut TcpStream) -> std::io::Result<()> {
    use tokio::io::AsyncReadExt as _;
    let mut b = [0u8; 512];
    while stream.read(&mut b).await? > 0 {}
    Ok(())
}

fn pick(sources: &[IpAddr], i: usize) -> Option<IpAddr> {
    (!sources.is_empty()).then(|| sources[i % sources.len()])
}

fn ms_since(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

// ---------------------------------------------------------------- conns

#[derive(Default)]
struct ConnsAgg {
    ok: u64,
    failed: u64,
    per_backend: BTreeMap<String, u64>,
    per_source: BTreeMap<String, BTreeSet<String>>,
}

async fn one_conn(target: SocketAddr, src: Option<IpAddr>, timeout_ms: u64) -> Result<(String, String), String> {
    let mut stream = connect(target, src, timeout_ms).await?;
    let local = stream.local_addr().map_or_else(|_| "?".into(), |a| a.ip().to_string());
    let mut buf = Vec::new();
    let req = request(target, true);
    let desc = || format!("request {local} -> {target}");
    let (backend, _) = timed(desc, timeout_ms, round_trip(&mut stream, &mut buf, &req)).await?;
    // Let the server close first so TIME_WAIT stays on its side; bounded.
    let _ = tokio::time::timeout(Duration::from_millis(timeout_ms), wait_eof(&mut stream)).await;
    Ok((local, backend))
}

async fn run_conns(a: ConnsArgs) -> anyhow::Result<serde_json::Value> {
    let sources = Arc::new(a.src.resolve()?);
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Errors::default();
    let mut workers = Vec::new();
    let open_ended = a.duration_ms.is_some() || a.stop_file.is_some();
    let workers_n = if open_ended { a.concurrency.max(1) } else { a.concurrency.max(1).min(a.count.max(1)) };
    for _ in 0..workers_n {
        let (sources, next, errors) = (sources.clone(), next.clone(), errors.clone());
        let (target, timeout_ms, stop_file) = (a.target, a.timeout_ms, a.stop_file.clone());
        let count = if open_ended { usize::MAX } else { a.count };
        let deadline = a.duration_ms.map(|ms| start + Duration::from_millis(ms));
        workers.push(tokio::spawn(async move {
            let mut agg = ConnsAgg::default();
            loop {
                if deadline.is_some_and(|d| Instant::now() >= d) || stop_file.as_ref().is_some_and(|f| f.exists()) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                match one_conn(target, pick(&sources, i), timeout_ms).await {
                    Ok((local, backend)) => {
                        agg.ok += 1;
                        *agg.per_backend.entry(backend.clone()).or_default() += 1;
                        agg.per_source.entry(local).or_default().insert(backend);
                    }
                    Err(e) => {
                        agg.failed += 1;
                        errors.push(e);
                    }
                }
            }
            agg
        }));
    }
    let mut total = ConnsAgg::default();
    for w in workers {
        let agg = w.await.context("worker panicked")?;
        total.ok += agg.ok;
        total.failed += agg.failed;
        for (k, v) in agg.per_backend {
            *total.per_backend.entry(k).or_default() += v;
        }
        for (k, v) in agg.per_source {
            total.per_source.entry(k).or_default().extend(v);
        }
    }
    #[derive(Serialize)]
    struct Out {
        ok: u64,
        failed: u64,
        per_backend: BTreeMap<String, u64>,
        per_source_backends: BTreeMap<String, BTreeSet<String>>,
        errors: Vec<String>,
        elapsed_ms: u64,
    }
    Ok(serde_json::to_value(Out {
        ok: total.ok,
        failed: total.failed,
        per_backend: total.per_backend,
        per_source_backends: total.per_source,
        errors: errors.take(),
        elapsed_ms: ms_since(start),
    })?)
}

// ------------------------------------------------------------------ hold

async fn run_hold(a: HoldArgs) -> anyhow::Result<serde_json::Value> {
    let sources = a.src.resolve()?;
    let start = Instant::now();
    let errors = Errors::default();
    let mut open = Vec::new();
    let mut per_backend: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed = 0u64;
    // One after another: each connection is scheduled knowing the ones
    // before it (what least-connections is about).
    for i in 0..a.connections {
        let step = async {
            let mut stream = connect(a.target, pick(&sources, i), a.timeout_ms).await?;
            let mut buf = Vec::new();
            let req = request(a.target, false);
            let desc = || format!("request {i} -> {}", a.target);
            let (backend, _) = timed(desc, a.timeout_ms, round_trip(&mut stream, &mut buf, &req)).await?;
            Ok::<_, String>((stream, backend))
        };
        match step.await {
            Ok((stream, backend)) => {
                *per_backend.entry(backend).or_default() += 1;
                open.push(stream);
            }
            Err(e) => {
                failed += 1;
                errors.push(e);
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(a.hold_ms)).await;
    for stream in open.drain(..) {
        if a.reset {
            // SO_LINGER with a zero timeout: close() sends a RST (and
            // does not block).
            let zero = libc::linger { l_onoff: 1, l_linger: 0 };
            let _ = nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &zero);
        }
        drop(stream);
    }
    // Give the FINs/RSTs time to leave before the process exits.
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(serde_json::json!({
        "connections": a.connections,
        "failed": failed,
        "per_backend": per_backend,
        "errors": errors.take(),
        "elapsed_ms": ms_since(start),
    }))
}

// ------------------------------------------------------------- longlived

struct LongResult {
    ok_rounds: u64,
    failed: u64,
    backends_seen: Vec<String>,
    /// The connection ended in an error before its last round.
    broken: bool,
    /// The slowest round trip (an interruption shows as one long round).
    max_round_ms: u64,
}

async fn run_longlived(a: LonglivedArgs) -> anyhow::Result<serde_json::Value> {
    let sources = a.src.resolve()?;
    let start = Instant::now();
    let errors = Errors::default();
    let barrier = Arc::new(tokio::sync::Barrier::new(a.connections));
    let mut tasks = Vec::new();
    for i in 0..a.connections {
        let (errors, barrier) = (errors.clone(), barrier.clone());
        let src = pick(&sources, i);
        let (target, rounds, timeout_ms, interval_ms) = (a.target, a.rounds, a.timeout_ms, a.interval_ms);
        let stop_file = a.stop_file.clone();
        // Whether round `n` is to be done; the rounds a failure leaves
        // undone count as failed (at least the one that failed).
        let more = move |n: usize| n < rounds || stop_file.as_ref().is_some_and(|f| !f.exists());
        let undone = move |n: usize| rounds.saturating_sub(n).max(1) as u64;
        tasks.push(tokio::spawn(async move {
            let conn = connect(target, src, timeout_ms).await;
            // All connections are open before any round starts.
            barrier.wait().await;
            let mut r =
                LongResult { ok_rounds: 0, failed: 0, backends_seen: Vec::new(), broken: false, max_round_ms: 0 };
            let mut stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    errors.push(e);
                    r.failed = rounds as u64;
                    return r;
                }
            };
            let mut buf = Vec::new();
            let req = request(target, false);
            for round in 0.. {
                if !more(round) {
                    break;
                }
                if round > 0 && interval_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(interval_ms)).await;
                }
                let desc = || format!("conn {i} round {round} -> {target}");
                let began = Instant::now();
                match timed(desc, timeout_ms, round_trip(&mut stream, &mut buf, &req)).await {
                    Ok((backend, closing)) => {
                        r.max_round_ms = r.max_round_ms.max(ms_since(began));
                        r.ok_rounds += 1;
                        if !r.backends_seen.contains(&backend) {
                            r.backends_seen.push(backend);
                        }
                        if closing && more(round + 1) {
                            errors.push(format!("conn {i} round {round}: server closed the keep-alive connection"));
                            r.failed += undone(round + 1);
                            r.broken = true;
                            break;
                        }
                    }
                    Err(e) => {
                        // The connection state is unknown now: this round and
                        // all remaining ones count as failed.
                        errors.push(e);
                        r.failed += undone(round);
                        r.broken = true;
                        break;
                    }
                }
            }
            r
        }));
    }
    let (mut ok_rounds, mut failed, mut switched, mut max_round_ms) = (0u64, 0u64, 0u64, 0u64);
    let mut per_backend: BTreeMap<String, u64> = BTreeMap::new();
    // Connections that ended in an error, by the backend that first
    // answered them ("-" for none).
    let mut broken_per_backend: BTreeMap<String, u64> = BTreeMap::new();
    for t in tasks {
        let r = t.await.context("connection task panicked")?;
        ok_rounds += r.ok_rounds;
        failed += r.failed;
        max_round_ms = max_round_ms.max(r.max_round_ms);
        if r.backends_seen.len() > 1 {
            switched += 1;
        }
        if let Some(first) = r.backends_seen.first() {
            *per_backend.entry(first.clone()).or_default() += 1;
        }
        if r.broken {
            let first = r.backends_seen.first().cloned().unwrap_or_else(|| "-".into());
            *broken_per_backend.entry(first).or_default() += 1;
        }
    }
    Ok(serde_json::json!({
        "connections": a.connections,
        "ok_rounds": ok_rounds,
        "failed": failed,
        "switched": switched,
        "per_backend": per_backend,
        "broken_per_backend": broken_per_backend,
        "max_round_ms": max_round_ms,
        "errors": errors.take(),
        "elapsed_ms": ms_since(start),
    }))
}

// -------------------------------------------------------------- download

async fn run_download(a: DownloadArgs) -> anyhow::Result<serde_json::Value> {
    use tokio::io::AsyncReadExt as _;
    let start = Instant::now();
    let src = a.src.resolve()?.first().copied();
    let work = async {
        let mut stream = connect(a.target, src, a.timeout_ms).await.map_err(anyhow::Error::msg)?;
        let req = format!("GET /bytes/{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", a.bytes, a.target);
        stream.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        let head = http1::read_head(&mut stream, &mut buf).await?.context("connection closed before a response")?;
        let len = head.content_length()?;
        let backend = head.header("x-backend").unwrap_or("?").to_string();
        // What came with the head, then the rest, counted not kept.
        let mut got = buf.len() as u64;
        let mut chunk = vec![0u8; 256 * 1024];
        while got < len as u64 {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            got += n as u64;
        }
        anyhow::Ok((backend, got, len as u64))
    };
    let (backend, got, len) = tokio::time::timeout(Duration::from_millis(a.timeout_ms), work)
        .await
        .map_err(|_| anyhow::anyhow!("download from {} timed out after {} ms", a.target, a.timeout_ms))??;
    let ms = ms_since(start);
    Ok(serde_json::json!({
        "backend": backend, "bytes": got, "expected": len, "complete": got == len,
        "ms": ms, "mbit_per_s": got as f64 * 8.0 / 1000.0 / ms.max(1) as f64,
    }))
}

async fn run_upload(a: DownloadArgs) -> anyhow::Result<serde_json::Value> {
    let start = Instant::now();
    let src = a.src.resolve()?.first().copied();
    let work = async {
        let mut stream = connect(a.target, src, a.timeout_ms).await.map_err(anyhow::Error::msg)?;
        let head = format!(
            "POST /upload HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            a.target, a.bytes
        );
        stream.write_all(head.as_bytes()).await?;
        let chunk = vec![b'u'; 64 * 1024];
        let mut left = a.bytes;
        while left > 0 {
            let k = left.min(chunk.len() as u64) as usize;
            stream.write_all(&chunk[..k]).await?;
            left -= k as u64;
        }
        let mut buf = Vec::new();
        let backend = read_ok_response(&mut stream, &mut buf).await?.header("x-backend").unwrap_or("?").to_string();
        anyhow::Ok(backend)
    };
    let backend = tokio::time::timeout(Duration::from_millis(a.timeout_ms), work)
        .await
        .map_err(|_| anyhow::anyhow!("upload to {} timed out after {} ms", a.target, a.timeout_ms))??;
    let ms = ms_since(start);
    Ok(serde_json::json!({ "backend": backend, "bytes": a.bytes, "complete": true, "ms": ms }))
}

// ------------------------------------------------------------------- udp

/// One UDP flow: `n` request/reply rounds from one socket. Returns the
/// backend of every answer, whether any answer came from another address,
/// and the socket's own address (two sockets one after the other may get
/// the same one: the same 5-tuple, which a balancer takes for one flow).
async fn one_udp(
    target: SocketAddr,
    src: Option<IpAddr>,
    timeout_ms: u64,
    n: usize,
) -> Result<(Vec<String>, bool, SocketAddr), String> {
    let any = if target.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(Ipv6Addr::UNSPECIFIED) };
    let bind = SocketAddr::new(src.unwrap_or(any), 0);
    let what = || format!("udp {} -> {target}", bind.ip());
    let sock = UdpSocket::bind(bind).await.map_err(|e| format!("{}: bind: {e}", what()))?;
    let local = sock.local_addr().map_err(|e| format!("{}: local address: {e}", what()))?;
    let mut backends = Vec::new();
    let mut other = false;
    for _ in 0..n.max(1) {
        timed(what, timeout_ms, sock.send_to(b"ping\n", target)).await?;
        let mut buf = [0u8; 2048];
        let (len, from) = timed(what, timeout_ms, sock.recv_from(&mut buf)).await?;
        let text = String::from_utf8_lossy(&buf[..len]);
        let backend =
            text.trim().strip_prefix("backend=").ok_or_else(|| format!("{}: unexpected reply {text:?}", what()))?;
        backends.push(backend.to_string());
        other |= from != target;
    }
    Ok((backends, other, local))
}

async fn run_udp(a: UdpArgs) -> anyhow::Result<serde_json::Value> {
    let sources = Arc::new(a.src.resolve()?);
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Errors::default();
    let tuples: Arc<Mutex<BTreeSet<SocketAddr>>> = Arc::default();
    let mut workers = Vec::new();
    for _ in 0..a.concurrency.max(1).min(a.count.max(1)) {
        let (sources, next, errors, tuples) = (sources.clone(), next.clone(), errors.clone(), tuples.clone());
        let (target, count, timeout_ms, per_socket) = (a.target, a.count, a.timeout_ms, a.per_socket);
        workers.push(tokio::spawn(async move {
            let (mut ok, mut failed, mut other, mut switched) = (0u64, 0u64, 0u64, 0u64);
            let mut per_backend: BTreeMap<String, u64> = BTreeMap::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                match one_udp(target, pick(&sources, i), timeout_ms, per_socket).await {
                    Ok((backends, from_other, local)) => {
                        tuples.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(local);
                        ok += backends.len() as u64;
                        other += u64::from(from_other);
                        switched += u64::from(backends.iter().any(|b| *b != backends[0]));
                        for b in backends {
                            *per_backend.entry(b).or_default() += 1;
                        }
                    }
                    Err(e) => {
                        failed += 1;
                        errors.push(e);
                    }
                }
            }
            (ok, failed, other, switched, per_backend)
        }));
    }
    let (mut ok, mut failed, mut other, mut switched) = (0u64, 0u64, 0u64, 0u64);
    let mut per_backend: BTreeMap<String, u64> = BTreeMap::new();
    for w in workers {
        let (o, f, x, sw, pb) = w.await.context("worker panicked")?;
        ok += o;
        switched += sw;
        failed += f;
        other += x;
        for (k, v) in pb {
            *per_backend.entry(k).or_default() += v;
        }
    }
    Ok(serde_json::json!({
        "ok": ok,
        "failed": failed,
        "per_backend": per_backend,
        "replies_from_other_addr": other,
        "flows_switched": switched,
        "distinct_flows": tuples.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len(),
        "errors": errors.take(),
        "elapsed_ms": ms_since(start),
    }))
}

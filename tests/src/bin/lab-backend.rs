//! Backend server for the namespace lab: HTTP/1.1 + UDP echo-ish service on
//! every `--listen` address, and a small stats/control HTTP API on `--stats`.
//!
//! The stats count the backend as a whole and, under `per_address`, each
//! served address apart (`10.20.0.11:8080`, `[fd00:20::11]:8080`, a DSR
//! VIP's): a balancer's per-backend counts are per service, and a lab
//! backend serves one service per address (and protocol). UDP is counted in
//! datagrams and in flows: distinct (address, port) peers since the last
//! reset, what a balancer counts as new flows.
#![expect(unused_crate_dependencies, reason = "used by the lab library and the tests")]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use lb_tests::http1::{self, Head};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};

#[derive(Parser, Debug)]
#[command(about = "Lab backend: HTTP/1.1 and UDP responder with a stats API")]
struct Args {
    /// Name reported in responses (`X-Backend`) and stats.
    #[arg(long)]
    name: String,
    /// TCP and UDP addresses to serve, e.g. 10.20.0.11:8080 (repeat the
    /// option for more: the IPv6 address, a DSR VIP held on loopback).
    #[arg(long, required = true)]
    listen: Vec<SocketAddr>,
    /// Address of the stats/control API.
    #[arg(long, default_value = "127.0.0.1:9000")]
    stats: SocketAddr,
}

#[derive(Default)]
struct State {
    /// Accepted connections since start / last reset.
    connections: AtomicU64,
    /// Currently open connections (a gauge: not reset).
    active: AtomicU64,
    /// HTTP requests answered since start / last reset.
    requests: AtomicU64,
    /// UDP datagrams received since start / last reset.
    udp_datagrams: AtomicU64,
    /// Each served address's own counters, in `--listen` order.
    per_address: Vec<AddressCounts>,
    /// Per-process connection sequence number (never reset).
    conn_seq: AtomicU64,
    /// Delay before each response on the main listener.
    delay_ms: AtomicU64,
    /// Status code of the main listener's responses (0: 200).
    status: AtomicU64,
    /// The service port is closed (the process, its open connections and
    /// the stats port stay).
    closed: AtomicBool,
}

/// What one served address counted since start / last reset.
struct AddressCounts {
    addr: SocketAddr,
    connections: AtomicU64,
    udp_datagrams: AtomicU64,
    /// Distinct UDP peers (address and port): the flows.
    udp_peers: Mutex<HashSet<SocketAddr>>,
}

impl AddressCounts {
    fn new(addr: SocketAddr) -> Self {
        Self { addr, connections: AtomicU64::new(0), udp_datagrams: AtomicU64::new(0), udp_peers: Mutex::default() }
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, HashSet<SocketAddr>> {
        self.udp_peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct ActiveGuard(Arc<State>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

fn tcp_listener(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let sock = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    sock.set_reuseaddr(true)?;
    sock.bind(addr).with_context(|| format!("binding TCP {addr}"))?;
    Ok(sock.listen(4096)?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    lb_tests::raise_nofile_limit();
    let name: Arc<str> = Arc::from(args.name.as_str());
    let state = Arc::new(State {
        per_address: args.listen.iter().map(|&a| AddressCounts::new(a)).collect(),
        ..State::default()
    });

    // Bound once here so that a bad address fails at start.
    for (idx, &addr) in args.listen.iter().enumerate() {
        let main_l = tcp_listener(addr)?;
        let udp = UdpSocket::bind(addr).await.with_context(|| format!("binding UDP {addr}"))?;
        tokio::spawn(serve_main(main_l, idx, name.clone(), state.clone()));
        tokio::spawn(serve_udp(udp, idx, name.clone(), state.clone()));
    }
    let stats_l = tcp_listener(args.stats)?;
    tokio::spawn(serve_stats(stats_l, name.clone(), state.clone()));
    eprintln!("lab-backend {name}: serving {:?} (tcp+udp), stats on {}", args.listen, args.stats);

    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    eprintln!(
        "lab-backend {name}: exiting (connections={} requests={} udp_datagrams={})",
        state.connections.load(Ordering::Relaxed),
        state.requests.load(Ordering::Relaxed),
        state.udp_datagrams.load(Ordering::Relaxed)
    );
    Ok(())
}

async fn accept_backoff(e: std::io::Error, what: &str) {
    eprintln!("{what}: accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// How often a closed service port looks whether to open again, and an
/// open one whether to close.
const LISTEN_POLL: Duration = Duration::from_millis(50);

/// Serves `--listen` address number `idx`.
async fn serve_main(first: TcpListener, idx: usize, name: Arc<str>, state: Arc<State>) {
    let addr = state.per_address[idx].addr;
    let mut l = Some(first);
    loop {
        // Closed on request (POST /listen?on=0): no listener, so connects
        // are refused, until opened again.
        if state.closed.load(Ordering::Relaxed) {
            l = None;
            tokio::time::sleep(LISTEN_POLL).await;
            continue;
        }
        let listener = match l.take() {
            Some(listener) => listener,
            None => match tcp_listener(addr) {
                Ok(listener) => listener,
                Err(e) => {
                    eprintln!("main listener: reopening {addr}: {e:#}");
                    tokio::time::sleep(LISTEN_POLL).await;
                    continue;
                }
            },
        };
        let accepted = tokio::select! {
            r = listener.accept() => Some(r),
            () = tokio::time::sleep(LISTEN_POLL) => None,
        };
        l = Some(listener);
        match accepted {
            None => {}
            Some(Ok((stream, _peer))) => {
                state.connections.fetch_add(1, Ordering::Relaxed);
                state.per_address[idx].connections.fetch_add(1, Ordering::Relaxed);
                state.active.fetch_add(1, Ordering::Relaxed);
                let conn_no = state.conn_seq.fetch_add(1, Ordering::Relaxed) + 1;
                let guard = ActiveGuard(state.clone());
                let (name, state) = (name.clone(), state.clone());
                tokio::spawn(async move {
                    let _guard = guard;
                    let _ = handle_main_conn(stream, &name, &state, conn_no).await;
                });
            }
            Some(Err(e)) => accept_backoff(e, "main listener").await,
        }
    }
}

async fn handle_main_conn(mut stream: TcpStream, name: &str, state: &State, conn_no: u64) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::new();
    let mut req_no = 0u64;
    loop {
        let Some(head) = http1::read_head(&mut stream, &mut buf).await? else {
            return Ok(());
        };
        let (_, target, version) = head.request_parts()?;
        let health_check = target.starts_with("/health");
        let keep_alive =
            if version == "HTTP/1.0" { head.connection_has("keep-alive") } else { !head.connection_has("close") };
        let body_len = head.content_length()?;
        http1::read_body(&mut stream, &mut buf, body_len).await?;

        req_no += 1;
        state.requests.fetch_add(1, Ordering::Relaxed);
        // A download: `GET /bytes/N` answers N bytes (streamed).
        if let Some(n) = target.strip_prefix("/bytes/").and_then(|n| n.parse::<u64>().ok()) {
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nX-Backend: {name}\r\n\r\n");
            stream.write_all(head.as_bytes()).await?;
            let chunk = vec![b'x'; 64 * 1024];
            let mut left = n;
            while left > 0 {
                let k = left.min(chunk.len() as u64) as usize;
                stream.write_all(&chunk[..k]).await?;
                left -= k as u64;
            }
            if !keep_alive {
                stream.shutdown().await?;
                return Ok(());
            }
            continue;
        }
        let delay = state.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        // The status set by POST /status applies to the health endpoint
        // only: the application keeps serving while it reports unhealthy.
        let code = match state.status.load(Ordering::Relaxed) {
            c if c != 0 && health_check => c,
            _ => 200,
        };
        let healthy = state.status.load(Ordering::Relaxed) == 0;
        let (status, health) = (if code == 200 { "200 OK" } else { "" }, if healthy { "ok" } else { "failing" });
        let status = if status.is_empty() { format!("{code} Status") } else { status.to_owned() };
        let body = format!("backend={name} conn={conn_no} req={req_no} health={health}\n");
        let conn_hdr = if keep_alive { "" } else { "Connection: close\r\n" };
        let resp = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nX-Backend: {name}\r\nContent-Type: text/plain\r\n{conn_hdr}\r\n{body}",
            body.len()
        );
        stream.write_all(resp.as_bytes()).await?;
        if !keep_alive {
            stream.shutdown().await?;
            return Ok(());
        }
    }
}

async fn serve_udp(sock: UdpSocket, idx: usize, name: Arc<str>, state: Arc<State>) {
    let reply = format!("backend={name}\n");
    let mut buf = vec![0u8; 65536];
    let counts = &state.per_address[idx];
    loop {
        match sock.recv_from(&mut buf).await {
            Ok((_, peer)) => {
                state.udp_datagrams.fetch_add(1, Ordering::Relaxed);
                counts.udp_datagrams.fetch_add(1, Ordering::Relaxed);
                counts.peers().insert(peer);
                if let Err(e) = sock.send_to(reply.as_bytes(), peer).await {
                    eprintln!("udp: reply to {peer} failed: {e}");
                }
            }
            Err(e) => {
                // ICMP errors from earlier replies surface here; keep going.
                eprintln!("udp: recv failed: {e}");
            }
        }
    }
}

async fn serve_stats(l: TcpListener, name: Arc<str>, state: Arc<State>) {
    loop {
        match l.accept().await {
            Ok((stream, _)) => {
                let (name, state) = (name.clone(), state.clone());
                tokio::spawn(async move {
                    let fut = handle_stats_conn(stream, &name, &state);
                    let _ = tokio::time::timeout(Duration::from_secs(10), fut).await;
                });
            }
            Err(e) => accept_backoff(e, "stats listener").await,
        }
    }
}

async fn handle_stats_conn(mut stream: TcpStream, name: &str, state: &State) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let Some(head) = http1::read_head(&mut stream, &mut buf).await? else {
        return Ok(());
    };
    let (status, body) = match route_stats(&head, name, state) {
        Ok(body) => ("200 OK", body),
        Err((status, msg)) => (status, format!("{{\"error\":{}}}", serde_json::Value::from(msg))),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

fn stats_json(name: &str, state: &State) -> String {
    let per_address: serde_json::Map<String, serde_json::Value> = state
        .per_address
        .iter()
        .map(|c| {
            let v = serde_json::json!({
                "connections": c.connections.load(Ordering::Relaxed),
                "udp_datagrams": c.udp_datagrams.load(Ordering::Relaxed),
                "udp_flows": c.peers().len(),
            });
            (c.addr.to_string(), v)
        })
        .collect();
    serde_json::json!({
        "name": name,
        "connections": state.connections.load(Ordering::Relaxed),
        "active": state.active.load(Ordering::Relaxed),
        "requests": state.requests.load(Ordering::Relaxed),
        "udp_datagrams": state.udp_datagrams.load(Ordering::Relaxed),
        "udp_flows": state.per_address.iter().map(|c| c.peers().len()).sum::<usize>(),
        "per_address": per_address,
        "delay_ms": state.delay_ms.load(Ordering::Relaxed),
        "status": state.status.load(Ordering::Relaxed),
        "closed": state.closed.load(Ordering::Relaxed),
    })
    .to_string()
}

/// The number `key=` carries in a query string.
fn query_value(query: &str, key: &str) -> Result<u64, (&'static str, String)> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .ok_or(("400 Bad Request", format!("missing {key}=")))?
        .parse::<u64>()
        .map_err(|e| ("400 Bad Request", format!("bad {key}: {e}")))
}

fn route_stats(head: &Head, name: &str, state: &State) -> Result<String, (&'static str, String)> {
    let (method, target, _) = head.request_parts().map_err(|e| ("400 Bad Request", e.to_string()))?;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match (method, path) {
        ("GET", "/stats") => Ok(stats_json(name, state)),
        ("POST", "/reset") => {
            state.connections.store(0, Ordering::Relaxed);
            state.requests.store(0, Ordering::Relaxed);
            state.udp_datagrams.store(0, Ordering::Relaxed);
            for c in &state.per_address {
                c.connections.store(0, Ordering::Relaxed);
                c.udp_datagrams.store(0, Ordering::Relaxed);
                c.peers().clear();
            }
            Ok(stats_json(name, state))
        }
        ("POST", "/delay") => {
            let ms = query_value(query, "ms")?;
            state.delay_ms.store(ms, Ordering::Relaxed);
            Ok(stats_json(name, state))
        }
        ("POST", "/status") => {
            // The status of the health endpoint (/health...) on the service
            // port, whose body then says health=failing; code=200 makes it
            // healthy again. Other requests are served as before.
            let code = query_value(query, "code")?;
            if !(100..=599).contains(&code) {
                return Err(("400 Bad Request", format!("status {code} out of 100-599")));
            }
            state.status.store(if code == 200 { 0 } else { code }, Ordering::Relaxed);
            Ok(stats_json(name, state))
        }
        ("POST", "/listen") => {
            // on=0 closes the service port (connects are refused; open
            // connections and the process stay), on=1 opens it again.
            let on = query_value(query, "on")?;
            state.closed.store(on == 0, Ordering::Relaxed);
            Ok(stats_json(name, state))
        }
        (_, "/stats" | "/reset" | "/delay" | "/status" | "/listen") => {
            Err(("405 Method Not Allowed", format!("{method} {path}")))
        }
        _ => Err(("404 Not Found", format!("no route {method} {path}"))),
    }
}

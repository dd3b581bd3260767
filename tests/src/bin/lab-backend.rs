//! Backend server for the namespace lab: HTTP/1.1 + UDP echo-ish service on
//! `--listen`, and a small stats/control HTTP API on `--stats`.
#![expect(unused_crate_dependencies, reason = "used by the lab library and the tests")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// TCP and UDP address to serve, e.g. 10.20.0.11:8080.
    #[arg(long)]
    listen: SocketAddr,
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
    /// Per-process connection sequence number (never reset).
    conn_seq: AtomicU64,
    /// Delay before each response on the main listener.
    delay_ms: AtomicU64,
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
    let state = Arc::new(State::default());

    let main_l = tcp_listener(args.listen)?;
    let udp = UdpSocket::bind(args.listen).await.with_context(|| format!("binding UDP {}", args.listen))?;
    let stats_l = tcp_listener(args.stats)?;

    tokio::spawn(serve_main(main_l, name.clone(), state.clone()));
    tokio::spawn(serve_udp(udp, name.clone(), state.clone()));
    tokio::spawn(serve_stats(stats_l, name.clone(), state.clone()));
    eprintln!("lab-backend {name}: serving {} (tcp+udp), stats on {}", args.listen, args.stats);

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

async fn serve_main(l: TcpListener, name: Arc<str>, state: Arc<State>) {
    loop {
        match l.accept().await {
            Ok((stream, _peer)) => {
                state.connections.fetch_add(1, Ordering::Relaxed);
                state.active.fetch_add(1, Ordering::Relaxed);
                let conn_no = state.conn_seq.fetch_add(1, Ordering::Relaxed) + 1;
                let guard = ActiveGuard(state.clone());
                let (name, state) = (name.clone(), state.clone());
                tokio::spawn(async move {
                    let _guard = guard;
                    let _ = handle_main_conn(stream, &name, &state, conn_no).await;
                });
            }
            Err(e) => accept_backoff(e, "main listener").await,
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
        let (_, _, version) = head.request_parts()?;
        let keep_alive =
            if version == "HTTP/1.0" { head.connection_has("keep-alive") } else { !head.connection_has("close") };
        let body_len = head.content_length()?;
        http1::read_body(&mut stream, &mut buf, body_len).await?;

        req_no += 1;
        state.requests.fetch_add(1, Ordering::Relaxed);
        let delay = state.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let body = format!("backend={name} conn={conn_no} req={req_no}\n");
        let conn_hdr = if keep_alive { "" } else { "Connection: close\r\n" };
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Backend: {name}\r\nContent-Type: text/plain\r\n{conn_hdr}\r\n{body}",
            body.len()
        );
        stream.write_all(resp.as_bytes()).await?;
        if !keep_alive {
            stream.shutdown().await?;
            return Ok(());
        }
    }
}

async fn serve_udp(sock: UdpSocket, name: Arc<str>, state: Arc<State>) {
    let reply = format!("backend={name}\n");
    let mut buf = vec![0u8; 65536];
    loop {
        match sock.recv_from(&mut buf).await {
            Ok((_, peer)) => {
                state.udp_datagrams.fetch_add(1, Ordering::Relaxed);
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
    serde_json::json!({
        "name": name,
        "connections": state.connections.load(Ordering::Relaxed),
        "active": state.active.load(Ordering::Relaxed),
        "requests": state.requests.load(Ordering::Relaxed),
        "udp_datagrams": state.udp_datagrams.load(Ordering::Relaxed),
        "delay_ms": state.delay_ms.load(Ordering::Relaxed),
    })
    .to_string()
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
            Ok(stats_json(name, state))
        }
        ("POST", "/delay") => {
            let ms = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("ms="))
                .ok_or(("400 Bad Request", "missing ms=".to_string()))?
                .parse::<u64>()
                .map_err(|e| ("400 Bad Request", format!("bad ms: {e}")))?;
            state.delay_ms.store(ms, Ordering::Relaxed);
            Ok(stats_json(name, state))
        }
        (_, "/stats" | "/reset" | "/delay") => Err(("405 Method Not Allowed", format!("{method} {path}"))),
        _ => Err(("404 Not Found", format!("no route {method} {path}"))),
    }
}

//! One health probe: TCP connect, or an HTTP GET whose status line is
//! checked, bounded by the configured timeout; it reports how long it took
//! (for http, the time to the response's first line).
use std::{
    fmt, io,
    net::SocketAddr,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

use crate::config::{HealthConfig, ProbeKind};

/// Longest HTTP status line an HTTP probe reads before giving up.
pub const MAX_STATUS_LINE: usize = 4096;
/// Most bytes of a response (headers and body) an HTTP probe with a body
/// check reads: the expected text must appear within them.
pub(super) const MAX_RESPONSE: usize = 64 * 1024;

/// Why a probe failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeError {
    /// The whole probe did not finish within `timeout`.
    Timeout,
    /// The TCP connect failed.
    Connect(String),
    /// The HTTP exchange failed (send, receive or a malformed response).
    Http(String),
    /// The HTTP status was outside the accepted range.
    Status(u16),
    /// The response body did not contain the expected text.
    Body,
}

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timeout => f.write_str("timed out"),
            Self::Connect(e) => write!(f, "connect: {e}"),
            Self::Http(e) => write!(f, "http: {e}"),
            Self::Status(code) => write!(f, "status {code} outside the expected range"),
            Self::Body => write!(f, "the response body lacks the expected text"),
        }
    }
}

impl std::error::Error for ProbeError {}

/// An I/O error as short text: "Connection refused", not
/// "Connection refused (os error 111)".
fn io_text(e: &io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error ") {
        Some(i) if s.ends_with(')') => s[..i].to_string(),
        _ => s,
    }
}

/// At most 64 characters of `s`, for error messages quoting the peer.
fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(MAX).collect();
        out.push('…');
        out
    }
}

/// The address a probe of backend `addr` connects to: `cfg.port`
/// replaces its port when set.
pub fn probe_target(cfg: &HealthConfig, addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip(), cfg.port.unwrap_or_else(|| addr.port()))
}

/// Probe backend `addr` at [`probe_target`].
///
/// - `Tcp`: connect, then close.
/// - `Http`: connect, send a `GET cfg.path` with `Connection: close`, read the
///   status line (at most [`MAX_STATUS_LINE`] bytes) and require its code to
///   lie within `cfg.expect` (inclusive); with `cfg.body`, read the rest of
///   the response (up to the end of the connection, at most
///   [`MAX_RESPONSE`] bytes) and require the body to contain that text.
/// - `None`: Ok at once, without connecting.
///
/// The whole probe is bounded by `cfg.timeout`. Returns how long it took.
pub async fn probe(cfg: &HealthConfig, addr: SocketAddr) -> Result<Duration, ProbeError> {
    if cfg.kind == ProbeKind::None {
        return Ok(Duration::ZERO);
    }
    let target = probe_target(cfg, addr);
    let started = Instant::now();
    let work = async {
        match cfg.kind {
            ProbeKind::None => Ok(()),
            ProbeKind::Tcp => tcp_probe(target).await,
            ProbeKind::Http => http_probe(cfg, target).await,
        }
    };
    match tokio::time::timeout(cfg.timeout, work).await {
        Ok(Ok(())) => Ok(started.elapsed()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ProbeError::Timeout),
    }
}

/// Connect for a probe. The probe's end is an abortive close (RST, as
/// HAProxy's checks end): a normal close from lbd's side would leave a
/// TIME_WAIT socket per probe on the gateway (a minute each), tens of
/// thousands at a few hundred probes a second, which slows every later
/// connect's search for a free local port.
async fn connect(target: SocketAddr) -> Result<TcpStream, ProbeError> {
    let stream = TcpStream::connect(target).await.map_err(|e| ProbeError::Connect(io_text(&e)))?;
    // The connection is made, which is what the probe asks; a socket that
    // refused the option would only close normally (one TIME_WAIT more).
    let _ = stream.set_zero_linger();
    Ok(stream)
}

/// The Host header of a probe: an IPv4 address alone (as ever), an IPv6
/// address in brackets with the port (`[fd00:20::11]:8080`): a bare IPv6
/// literal is not a valid `Host` (RFC 9110 7.2, RFC 3986 3.2.2).
fn host(target: SocketAddr) -> String {
    match target {
        SocketAddr::V4(a) => a.ip().to_string(),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

async fn tcp_probe(target: SocketAddr) -> Result<(), ProbeError> {
    // Dropping the stream closes it.
    connect(target).await.map(drop)
}

async fn http_probe(cfg: &HealthConfig, target: SocketAddr) -> Result<(), ProbeError> {
    let mut stream = connect(target).await?;
    let path = if cfg.path.is_empty() { "/" } else { cfg.path.as_str() };
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: lbd-health\r\nConnection: close\r\n\r\n", host(target));
    stream.write_all(request.as_bytes()).await.map_err(|e| ProbeError::Http(format!("send: {}", io_text(&e))))?;
    let (line, rest) = read_status_line(&mut stream).await?;
    let code = parse_status_line(&line)?;
    let (lo, hi) = cfg.expect;
    if !(lo..=hi).contains(&code) {
        return Err(ProbeError::Status(code));
    }
    match &cfg.body {
        Some(want) => check_body(&mut stream, rest, want).await,
        None => Ok(()),
    }
}

/// Read the rest of a response whose status line was read (`buf`: what
/// was read after it; `Connection: close` was asked, so it ends with the
/// connection, or once [`MAX_RESPONSE`] bytes arrived) and look for `want`
/// in its body.
async fn check_body<R: AsyncRead + Unpin>(r: &mut R, mut buf: Vec<u8>, want: &str) -> Result<(), ProbeError> {
    let mut chunk = [0u8; 4096];
    while buf.len() < MAX_RESPONSE {
        let n = r.read(&mut chunk).await.map_err(|e| ProbeError::Http(format!("receive: {}", io_text(&e))))?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if body_contains(&buf, want) {
            return Ok(());
        }
    }
    if body_contains(&buf, want) { Ok(()) } else { Err(ProbeError::Body) }
}

/// Does the body (after the blank line that ends the headers) of `resp`
/// contain `want`?
fn body_contains(resp: &[u8], want: &str) -> bool {
    let Some(end) = resp.windows(4).position(|w| w == b"\r\n\r\n") else { return false };
    let body = &resp[end + 4..];
    let want = want.as_bytes();
    want.is_empty() || body.windows(want.len()).any(|w| w == want)
}

/// Read up to the first `\r\n` (at most [`MAX_STATUS_LINE`] bytes) and
/// return the line without it, and whatever was read after it.
async fn read_status_line<R: AsyncRead + Unpin>(r: &mut R) -> Result<(Vec<u8>, Vec<u8>), ProbeError> {
    let mut buf = vec![0u8; MAX_STATUS_LINE];
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            return Err(ProbeError::Http(format!("no status line within the first {MAX_STATUS_LINE} bytes")));
        }
        let n = r.read(&mut buf[filled..]).await.map_err(|e| ProbeError::Http(format!("receive: {}", io_text(&e))))?;
        if n == 0 {
            return Err(ProbeError::Http(if filled == 0 {
                "connection closed without a response".to_string()
            } else {
                "connection closed inside the status line".to_string()
            }));
        }
        // A "\r" at the end of the previous read may pair with a "\n" now.
        let from = filled.saturating_sub(1);
        filled += n;
        if let Some(i) = buf[from..filled].windows(2).position(|w| w == b"\r\n") {
            buf.truncate(filled);
            let rest = buf.split_off(from + i + 2);
            buf.truncate(from + i);
            return Ok((buf, rest));
        }
    }
}

/// The status code of `HTTP/x.y NNN [reason]`.
fn parse_status_line(line: &[u8]) -> Result<u16, ProbeError> {
    let text = String::from_utf8_lossy(line);
    let bad = || ProbeError::Http(format!("malformed status line {:?}", shorten(&text)));
    let mut parts = text.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/") {
        return Err(bad());
    }
    let code = parts.next().unwrap_or_default();
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    code.parse().map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use tokio::net::TcpListener;

    use super::*;

    // ---- parsing ----

    #[test]
    fn a_body_check_looks_only_past_the_headers() {
        assert!(body_contains(b"Server: x\r\n\r\nstatus: ok\n", "ok"));
        assert!(!body_contains(b"X-Ok: ok\r\n\r\nstatus: failing\n", "ok"));
        assert!(!body_contains(b"X-Ok: ok\r\n", "ok"), "no end of headers yet");
    }

    #[tokio::test]
    async fn a_body_check_reads_to_the_end_and_stops_at_the_limit() {
        let mut r: &[u8] = b"Content-Length: 9\r\n\r\nall is ok";
        assert_eq!(check_body(&mut r, Vec::new(), "is ok").await, Ok(()));
        let mut r: &[u8] = b"Content-Length: 9\r\n\r\nall is bad";
        assert_eq!(check_body(&mut r, Vec::new(), "is ok").await, Err(ProbeError::Body));
        let long = [b"\r\n\r\n".as_slice(), &vec![b'x'; 2 * MAX_RESPONSE], b"ok"].concat();
        let mut r: &[u8] = &long;
        assert_eq!(check_body(&mut r, Vec::new(), "ok").await, Err(ProbeError::Body), "past the limit");
        // What the status line's read took already counts.
        let mut r: &[u8] = b" is ok";
        assert_eq!(check_body(&mut r, b"X: y\r\n\r\nall".to_vec(), "all is ok").await, Ok(()));
    }

    #[tokio::test]
    async fn the_status_line_read_keeps_what_follows_it() {
        let mut r: &[u8] = b"HTTP/1.1 200 OK\r\nX: y\r\n\r\nbody";
        let (line, rest) = read_status_line(&mut r).await.unwrap();
        assert_eq!((line.as_slice(), rest.as_slice()), (b"HTTP/1.1 200 OK".as_slice(), b"X: y\r\n\r\nbody".as_slice()));
    }

    #[test]
    fn status_line_parsing() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK"), Ok(200));
        assert_eq!(parse_status_line(b"HTTP/1.0 503 Service Unavailable"), Ok(503));
        assert_eq!(parse_status_line(b"HTTP/1.1 204"), Ok(204));
        for bad in [&b""[..], b"garbage", b"HTTP/1.1", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK", b"SSH-2.0 200"] {
            assert!(matches!(parse_status_line(bad), Err(ProbeError::Http(_))), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn status_line_reading() {
        let mut r: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(read_status_line(&mut r).await.unwrap().0, b"HTTP/1.1 200 OK");
        let mut r: &[u8] = b"HTTP/1.1 200 OK";
        assert!(matches!(read_status_line(&mut r).await, Err(ProbeError::Http(_))));
        let mut r: &[u8] = b"";
        assert!(matches!(read_status_line(&mut r).await, Err(ProbeError::Http(_))));
        let long = vec![b'x'; MAX_STATUS_LINE + 10];
        let mut r: &[u8] = &long;
        assert!(matches!(read_status_line(&mut r).await, Err(ProbeError::Http(_))));
    }

    #[tokio::test]
    async fn status_line_split_across_reads() {
        let (mut client, mut server) = tokio::io::duplex(64);
        let reader = tokio::spawn(async move { read_status_line(&mut client).await });
        server.write_all(b"HTTP/1.1 301 Moved\r").await.unwrap();
        tokio::task::yield_now().await;
        server.write_all(b"\nLocation: /\r\n\r\n").await.unwrap();
        assert_eq!(reader.await.unwrap().unwrap().0, b"HTTP/1.1 301 Moved");
    }

    #[test]
    fn error_display() {
        assert_eq!(ProbeError::Timeout.to_string(), "timed out");
        assert_eq!(ProbeError::Connect("Connection refused".into()).to_string(), "connect: Connection refused");
        assert_eq!(ProbeError::Status(503).to_string(), "status 503 outside the expected range");
        let e = io::Error::from_raw_os_error(libc::ECONNREFUSED);
        assert_eq!(io_text(&e), "Connection refused");
    }

    // ---- probes against local listeners ----

    fn cfg(kind: ProbeKind) -> HealthConfig {
        HealthConfig {
            kind,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(5),
            rise: 2,
            fall: 3,
            path: "/healthz".into(),
            expect: (200, 399),
            port: None,
            body: None,
        }
    }

    fn v4(l: &TcpListener) -> SocketAddr {
        l.local_addr().unwrap()
    }

    async fn listener() -> TcpListener {
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap()
    }

    /// A local address nobody listens on (bound, then released).
    async fn closed_addr() -> SocketAddr {
        let l = listener().await;
        let a = v4(&l);
        drop(l);
        a
    }

    /// Serve every connection: read the request head and answer with
    /// `status_line` if it is exactly the probe's request, else with 400.
    /// Connections that close early (TCP probes) are ignored.
    fn serve_http(l: TcpListener, status_line: &'static str) -> tokio::task::JoinHandle<()> {
        let host = match l.local_addr().unwrap() {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
        };
        let expected =
            format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\nUser-Agent: lbd-health\r\nConnection: close\r\n\r\n");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut req = Vec::new();
                let mut chunk = [0u8; 512];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => req.extend_from_slice(&chunk[..n]),
                    }
                }
                if req.is_empty() {
                    continue;
                }
                let status = if req == expected.as_bytes() { status_line } else { "HTTP/1.1 400 Bad Request" };
                // One write, body included: the status line's read takes
                // part of what follows it.
                let resp = format!("{status}\r\nContent-Length: 10\r\nConnection: close\r\n\r\nhealth=ok\n");
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.shutdown().await;
            }
        })
    }

    #[tokio::test]
    async fn http_probe_with_a_body_check() {
        let l = listener().await;
        let addr = v4(&l);
        let server = serve_http(l, "HTTP/1.1 200 OK");
        let mut c = cfg(ProbeKind::Http);
        c.body = Some("health=ok".into());
        assert!(probe(&c, addr).await.is_ok());
        c.body = Some("health=failing".into());
        assert_eq!(probe(&c, addr).await, Err(ProbeError::Body));
        server.abort();
    }

    #[tokio::test]
    async fn tcp_probe_ok() {
        let l = listener().await;
        let addr = v4(&l);
        let accept = tokio::spawn(async move { l.accept().await.map(|_| ()) });
        assert!(probe(&cfg(ProbeKind::Tcp), addr).await.is_ok());
        accept.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn tcp_probe_closed_port() {
        let addr = closed_addr().await;
        match probe(&cfg(ProbeKind::Tcp), addr).await {
            Err(ProbeError::Connect(msg)) => assert!(!msg.contains("os error"), "{msg}"),
            other => panic!("expected Connect error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn http_probe_ok() {
        let l = listener().await;
        let addr = v4(&l);
        let server = serve_http(l, "HTTP/1.1 200 OK");
        // The server answers 400 unless the request is exactly the expected one.
        assert!(probe(&cfg(ProbeKind::Http), addr).await.is_ok());
        let mut c = cfg(ProbeKind::Http);
        c.path = "/other".into();
        assert_eq!(probe(&c, addr).await, Err(ProbeError::Status(400)));
        server.abort();
    }

    #[tokio::test]
    async fn http_probe_bad_status() {
        let l = listener().await;
        let addr = v4(&l);
        let _server = serve_http(l, "HTTP/1.1 503 Service Unavailable");
        assert_eq!(probe(&cfg(ProbeKind::Http), addr).await, Err(ProbeError::Status(503)));
    }

    #[tokio::test]
    async fn http_probe_expect_is_inclusive() {
        let l = listener().await;
        let addr = v4(&l);
        let _server = serve_http(l, "HTTP/1.1 204 No Content");
        let mut c = cfg(ProbeKind::Http);
        c.expect = (204, 204);
        assert!(probe(&c, addr).await.is_ok());
        c.expect = (200, 203);
        assert_eq!(probe(&c, addr).await, Err(ProbeError::Status(204)));
        c.expect = (205, 299);
        assert_eq!(probe(&c, addr).await, Err(ProbeError::Status(204)));
    }

    #[tokio::test]
    async fn http_probe_not_http() {
        let l = listener().await;
        let addr = v4(&l);
        let _server = serve_http(l, "SSH-2.0-OpenSSH_9.6");
        assert!(matches!(probe(&cfg(ProbeKind::Http), addr).await, Err(ProbeError::Http(_))));
    }

    #[tokio::test]
    async fn http_probe_silent_server_times_out() {
        let l = listener().await;
        let addr = v4(&l);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // Accept and hold the connection open without answering.
        let _server = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let _ = rx.await;
            drop(s);
        });
        let mut c = cfg(ProbeKind::Http);
        c.timeout = Duration::from_millis(200);
        let started = Instant::now();
        assert_eq!(probe(&c, addr).await, Err(ProbeError::Timeout));
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
        drop(tx);
    }

    #[tokio::test]
    async fn probe_port_override() {
        let l = listener().await;
        let port = v4(&l).port();
        let addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), closed_addr().await.port());
        let _server = serve_http(l, "HTTP/1.1 200 OK");

        // The address's own port is closed...
        assert!(matches!(probe(&cfg(ProbeKind::Tcp), addr).await, Err(ProbeError::Connect(_))));
        // ...the override reaches the listener.
        let mut c = cfg(ProbeKind::Tcp);
        c.port = Some(port);
        assert!(probe(&c, addr).await.is_ok());
        let mut c = cfg(ProbeKind::Http);
        c.port = Some(port);
        assert!(probe(&c, addr).await.is_ok());
    }

    #[tokio::test]
    async fn ipv6_backends_are_probed_over_ipv6() {
        let l = TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        // The server answers 400 unless the Host is `[::1]:port`.
        let server = serve_http(l, "HTTP/1.1 200 OK");
        assert!(probe(&cfg(ProbeKind::Tcp), addr).await.is_ok());
        assert!(probe(&cfg(ProbeKind::Http), addr).await.is_ok());
        server.abort();
        let closed = {
            let l = TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).await.unwrap();
            l.local_addr().unwrap()
        };
        assert!(matches!(probe(&cfg(ProbeKind::Tcp), closed).await, Err(ProbeError::Connect(_))));
        assert_eq!(host(addr), format!("[::1]:{}", addr.port()));
        assert_eq!(host("10.20.0.11:8080".parse().unwrap()), "10.20.0.11");
    }

    #[tokio::test]
    async fn none_probe_does_not_connect() {
        // A closed port: any connect attempt would fail.
        let addr = closed_addr().await;
        let mut c = cfg(ProbeKind::None);
        c.timeout = Duration::ZERO;
        assert_eq!(probe(&c, addr).await, Ok(Duration::ZERO));
    }
}

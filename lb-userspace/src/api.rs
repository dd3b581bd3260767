//! The control API: newline-delimited JSON over a Unix socket (mode 0600,
//! root only). One request per line, one response line per request.
//!
//! Request:  `{"command":"status"}`
//! Response: `{"ok":true,"result":{...}}` or `{"ok":false,"error":"..."}`
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddr,
    os::unix::{fs::PermissionsExt as _, net::UnixStream as StdUnixStream},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader as TokioBufReader},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, warn};

use crate::{
    agent::{Agent, Change},
    report::status,
};

/// Longest request line accepted.
const MAX_REQUEST: usize = 64 * 1024;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "command", rename_all = "kebab-case")]
pub enum Request {
    Status,
    Reload,
    /// `backend` is "ADDRESS:PORT".
    BackendAdd {
        service: String,
        backend: String,
        #[serde(default = "one")]
        weight: u32,
    },
    BackendRemove {
        service: String,
        backend: String,
    },
    BackendWeight {
        service: String,
        backend: String,
        weight: u32,
    },
    BackendDrain {
        service: String,
        backend: String,
    },
    BackendEnable {
        service: String,
        backend: String,
    },
    /// `spec`: one service with the config file's keys.
    ServiceAdd {
        spec: serde_json::Value,
    },
    ServiceRemove {
        service: String,
    },
}

fn one() -> u32 {
    1
}

/// `ADDRESS:PORT`: `10.20.0.11:8080`, or `[fd00:20::11]:8080` for IPv6.
fn backend_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("backend {s:?} is not ADDRESS:PORT (an IPv4 address and a port, or [IPv6 address]:port)"))
}

impl Request {
    /// The pool change this request asks for, if it is one.
    pub fn change(&self) -> Result<Option<Change>, String> {
        let b = |s: &str| backend_addr(s);
        Ok(Some(match self {
            Self::Status | Self::Reload => return Ok(None),
            Self::BackendAdd { service, backend, weight } => {
                let a = b(backend)?;
                Change::BackendAdd { service: service.clone(), address: a.ip(), port: a.port(), weight: *weight }
            }
            Self::BackendRemove { service, backend } => {
                let a = b(backend)?;
                Change::BackendRemove { service: service.clone(), address: a.ip(), port: a.port() }
            }
            Self::BackendWeight { service, backend, weight } => {
                let a = b(backend)?;
                Change::BackendWeight { service: service.clone(), address: a.ip(), port: a.port(), weight: *weight }
            }
            Self::BackendDrain { service, backend } => {
                let a = b(backend)?;
                Change::BackendDrain { service: service.clone(), address: a.ip(), port: a.port() }
            }
            Self::BackendEnable { service, backend } => {
                let a = b(backend)?;
                Change::BackendEnable { service: service.clone(), address: a.ip(), port: a.port() }
            }
            Self::ServiceAdd { spec } => Change::ServiceAdd { spec: spec.clone() },
            Self::ServiceRemove { service } => Change::ServiceRemove { service: service.clone() },
        }))
    }
}

impl Request {
    /// Parse one request line strictly: a JSON object with a known
    /// `command` and no keys that command does not take.
    pub fn parse(line: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("malformed request: {e}"))?;
        let obj = v.as_object().ok_or("malformed request: expected a JSON object")?;
        let cmd =
            obj.get("command").and_then(|c| c.as_str()).ok_or("malformed request: missing string field \"command\"")?;
        let allowed: &[&str] = match cmd {
            "status" | "reload" => &["command"],
            "backend-add" => &["command", "service", "backend", "weight"],
            "backend-weight" => &["command", "service", "backend", "weight"],
            "backend-remove" | "backend-drain" | "backend-enable" => &["command", "service", "backend"],
            "service-add" => &["command", "spec"],
            "service-remove" => &["command", "service"],
            other => {
                return Err(format!(
                    "unknown command {other:?} (known: status, reload, backend-add, backend-remove, backend-weight, backend-drain, backend-enable, service-add, service-remove)"
                ));
            }
        };
        if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(format!("command {cmd:?} takes no field {k:?}"));
        }
        serde_json::from_value(v).map_err(|e| format!("malformed request: {e}"))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn ok(v: impl Serialize) -> Response {
    Response { ok: true, result: Some(serde_json::to_value(v).expect("serialisable")), error: None }
}

fn err(e: impl std::fmt::Display) -> Response {
    Response { ok: false, result: None, error: Some(e.to_string()) }
}

/// Handle one request line.
pub fn handle(agent: &Mutex<Agent>, line: &str) -> Response {
    let req = match Request::parse(line) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let mut agent = match agent.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    match req.change() {
        Err(e) => err(e),
        Ok(Some(change)) => agent.change(&change).map_or_else(err, ok),
        Ok(None) => match req {
            Request::Reload => agent.reload().map_or_else(err, ok),
            _ => status(&agent).map_or_else(err, ok),
        },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("another lbd is already serving {0}")]
    InUse(PathBuf),
    #[error("control socket {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// How long, and how much, lbd reads of a refused request before closing.
const REFUSED_DRAIN: Duration = Duration::from_secs(1);
const REFUSED_DRAIN_BYTES: u64 = 16 << 20;

/// Bind the control socket: parent directory created (0700 if new), a
/// stale socket file replaced, the socket itself mode 0600.
pub fn bind(path: &Path) -> Result<UnixListener, ApiError> {
    let io = |source| ApiError::Io { path: path.to_owned(), source };
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    if path.exists() {
        if StdUnixStream::connect(path).is_ok() {
            return Err(ApiError::InUse(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(io)?;
    }
    // Create the socket file without group/other bits from the start, so
    // there is no moment in which another user could connect.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let listener = UnixListener::bind(path);
    rustix::process::umask(old);
    let listener = listener.map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(listener)
}

/// Serve requests until the task is dropped.
pub async fn serve(listener: UnixListener, dp: Arc<Mutex<Agent>>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "control socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let dp = dp.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, dp).await {
                debug!(error = %e, "control connection ended");
            }
        });
    }
}

async fn connection(stream: UnixStream, dp: Arc<Mutex<Agent>>) -> std::io::Result<()> {
    // Only root (or whoever runs lbd) may drive the balancer; the file mode
    // already says so, this guards against a loosened mode.
    let me = rustix::process::geteuid().as_raw();
    let peer = stream.peer_cred()?.uid();
    let (rd, mut wr) = stream.into_split();
    let mut rd = TokioBufReader::new(rd);
    if peer != 0 && peer != me {
        return refuse(&mut rd, &mut wr, format!("permission denied for uid {peer}")).await;
    }
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = (&mut rd).take(MAX_REQUEST as u64 + 1).read_until(b'\n', &mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        let resp = if buf.len() > MAX_REQUEST {
            // Oversized: the rest of the line is garbage; refuse, and end
            // the connection.
            return refuse(&mut rd, &mut wr, format!("request longer than {MAX_REQUEST} bytes")).await;
        } else {
            match std::str::from_utf8(&buf) {
                Ok(line) => {
                    let dp = dp.clone();
                    let line = line.trim().to_owned();
                    tokio::task::spawn_blocking(move || handle(&dp, &line)).await.unwrap_or_else(|e| Response {
                        ok: false,
                        result: None,
                        error: Some(format!("internal error: {e}")),
                    })
                }
                Err(_) => Response { ok: false, result: None, error: Some("request is not UTF-8".into()) },
            }
        };
        wr.write_all(format!("{}\n", serde_json::to_string(&resp)?).as_bytes()).await?;
    }
}

/// Answer `error` and end the connection without cutting the peer off
/// mid-write: the answer goes out and the write side is shut, then what the
/// peer is still sending of its request line is read and discarded (at most
/// `REFUSED_DRAIN` long and `REFUSED_DRAIN_BYTES` bytes), so that its write
/// completes and it reads the answer, instead of failing with a broken pipe
/// because lbd closed first.
async fn refuse(
    rd: &mut TokioBufReader<tokio::net::unix::OwnedReadHalf>,
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    error: String,
) -> std::io::Result<()> {
    let resp = Response { ok: false, result: None, error: Some(error) };
    wr.write_all(format!("{}\n", serde_json::to_string(&resp)?).as_bytes()).await?;
    wr.shutdown().await?;
    let mut rest = rd.take(REFUSED_DRAIN_BYTES);
    let mut discard = Vec::new();
    let _ = tokio::time::timeout(REFUSED_DRAIN, rest.read_until(b'\n', &mut discard)).await;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to lbd at {path}: {source} (is lbd running? are you root?)")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("talking to lbd at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("lbd at {path} took the request but gave no answer in {after:?} (busy, or stuck: its log may say why)")]
    NoAnswer { path: PathBuf, after: Duration },
    #[error("lbd sent an unreadable answer: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("lbd: {0}")]
    Remote(String),
}

/// How long [`call`] waits for lbd's answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Send one request and wait for its answer (blocking; for lbctl and tests).
pub fn call(path: &Path, req: &Request) -> Result<serde_json::Value, ClientError> {
    let io = |source| ClientError::Io { path: path.to_owned(), source };
    let mut s =
        StdUnixStream::connect(path).map_err(|source| ClientError::Connect { path: path.to_owned(), source })?;
    s.set_read_timeout(Some(CALL_TIMEOUT)).map_err(io)?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    // lbd may answer and close before reading the request (a refused
    // peer): the write then fails (broken pipe), but the answer is already
    // waiting in our receive buffer, and it is what the user must see.
    let written = s.write_all(line.as_bytes());
    let mut answer = String::new();
    let read = BufReader::new(&s).read_line(&mut answer);
    if answer.trim().is_empty() {
        written.map_err(io)?;
        // The read timeout's error says only "Resource temporarily
        // unavailable".
        read.map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                ClientError::NoAnswer { path: path.to_owned(), after: CALL_TIMEOUT }
            }
            _ => io(e),
        })?;
        return Err(io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "lbd closed without an answer")));
    }
    let resp: Response = serde_json::from_str(&answer)?;
    if resp.ok {
        Ok(resp.result.unwrap_or(serde_json::Value::Null))
    } else {
        Err(ClientError::Remote(resp.error.unwrap_or_else(|| "unknown error".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_reported_even_when_the_request_write_fails() {
        // lbd answers and closes without reading; the request is larger
        // than the socket buffers, so the client's write fails (EPIPE).
        let dir = std::env::temp_dir().join(format!("lb-api-refusal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"{\"ok\":false,\"error\":\"permission denied for uid 65534\"}\n").unwrap();
        });
        let huge = serde_json::json!({ "name": "x".repeat(4 << 20) });
        let err = call(&path, &Request::ServiceAdd { spec: huge }).unwrap_err();
        server.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(&err, ClientError::Remote(m) if m == "permission denied for uid 65534"), "{err}");
    }

    #[test]
    fn a_refusing_server_lets_the_client_finish_its_write_and_read_the_answer() {
        // The client sends a 1 MiB request line; lbd reads only the start,
        // refuses, and must not close under the client's write.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (server, client) = std::os::unix::net::UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            let mut c = client;
            let mut line = vec![b'a'; 1 << 20];
            line.push(b'\n');
            let written = c.write_all(&line);
            let mut answer = String::new();
            BufReader::new(&c).read_line(&mut answer).unwrap();
            (written.map_err(|e| e.kind()), answer)
        });
        rt.block_on(async {
            server.set_nonblocking(true).unwrap();
            let (rd, mut wr) = UnixStream::from_std(server).unwrap().into_split();
            let mut rd = TokioBufReader::new(rd);
            let mut start = [0u8; 4096];
            rd.read_exact(&mut start).await.unwrap();
            refuse(&mut rd, &mut wr, "request longer than 65536 bytes".into()).await.unwrap();
        });
        let (written, answer) = writer.join().unwrap();
        assert_eq!(written, Ok(()), "the client's write was cut off");
        assert!(answer.contains("request longer than 65536 bytes"), "{answer:?}");
    }

    #[test]
    fn backend_requests_take_ipv6_in_brackets() {
        let req = |backend: &str| Request::BackendDrain { service: "web6".into(), backend: backend.into() };
        let Ok(Some(Change::BackendDrain { address, port, .. })) = req("[fd00:20::11]:8080").change() else {
            panic!("an IPv6 backend in brackets is refused")
        };
        assert_eq!((address, port), ("fd00:20::11".parse::<std::net::IpAddr>().unwrap(), 8080));
        let Ok(Some(Change::BackendDrain { address, .. })) = req("10.20.0.11:8080").change() else {
            panic!("an IPv4 backend is refused")
        };
        assert!(address.is_ipv4());
        // Without brackets the port cannot be told from the address.
        for bad in ["fd00:20::11:8080", "fd00:20::11", "[fd00:20::11]", "10.20.0.11"] {
            let e = req(bad).change().unwrap_err();
            assert!(e.contains("[IPv6 address]:port"), "{bad}: {e}");
        }
    }

    #[test]
    fn requests_parse_strictly() {
        assert_eq!(Request::parse(r#"{"command":"status"}"#).unwrap(), Request::Status);
        assert!(Request::parse(r#"{"command":"explode"}"#).unwrap_err().contains("unknown command"));
        assert!(Request::parse(r#"{"command":"status","x":1}"#).unwrap_err().contains("no field \"x\""));
        assert!(Request::parse("not json").unwrap_err().starts_with("malformed"));
        assert!(Request::parse("[1]").is_err());
        assert!(Request::parse(r#"{"command":7}"#).is_err());
    }
}

//! Open-loop keep-alive HTTP load: requests leave on a fixed schedule,
//! whatever the answers do, so every path under test gets the same request
//! rate. wrk keeps a fixed number of requests in flight instead, so a
//! faster path runs at a higher rate, and tail latencies taken at different
//! rates cannot be compared.
//!
//! `connections` keep-alive connections share `rate` requests per second:
//! connection `c` sends its `i`-th request at `t0 + (c + i * connections) /
//! rate`. A request's latency runs from that scheduled time to the end of
//! its response, so an answer that comes late delays the requests queued
//! behind it on the connection, and their waiting counts too (no
//! coordinated omission, as wrk2 corrects it).
//!
//! Everything runs on one thread (a current-thread tokio runtime): a
//! thread per connection cost the client more CPU than the paths it
//! measures, on a 2-CPU lab. A dispatcher wakes every [`TICK`] on a
//! periodic timerfd and hands each request whose time has come to its
//! connection (tokio's own timer rounds waits to a millisecond, and a
//! timer per request cost three system calls per request). A request may
//! so leave up to one tick after its time; that waiting counts in its
//! latency, the same for every path measured.
use std::{
    net::SocketAddr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::bail;
use serde::Serialize;
use tokio::{
    io::{AsyncWriteExt as _, unix::AsyncFd},
    net::TcpStream,
};

use crate::http1;

/// What a run measured, in the keys the benchmark reads from wrk.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Requests answered with a 2xx status.
    pub requests: u64,
    /// Requests that failed (error, timeout or another status), and those
    /// left unsent when a connection could not be reopened.
    pub failed: u64,
    /// The rate asked for, and the rate of answered requests achieved
    /// (over the run, or until the last answer if that came later).
    pub offered_rps: f64,
    pub rps: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Largest wait for one answer.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How often the dispatcher wakes.
const TICK: Duration = Duration::from_micros(100);

/// Run the load for `secs` seconds (`GET /` each time); connection `c`
/// goes to `targets[c % targets.len()]`, so several targets share the
/// connections and the rate evenly.
pub fn run(targets: &[SocketAddr], connections: usize, rate: f64, secs: f64) -> anyhow::Result<Report> {
    if targets.is_empty() || connections == 0 || rate.is_nan() || rate <= 0.0 || secs.is_nan() || secs <= 0.0 {
        bail!("paced load: targets, connections, rate and duration must be given and positive");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let t0 = Instant::now() + Duration::from_millis(100);
    let end = t0 + Duration::from_secs_f64(secs);
    let results = rt.block_on(async {
        let mut txs = Vec::with_capacity(connections);
        let mut tasks = Vec::with_capacity(connections);
        for c in 0..connections {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            txs.push(tx);
            tasks.push(tokio::spawn(connection(targets[c % targets.len()], rx)));
        }
        let ticker = Ticker::new(TICK)?;
        let at = |i: usize| t0 + Duration::from_secs_f64(i as f64 / rate);
        let mut i = 0;
        while at(i) < end {
            ticker.tick().await?;
            let now = Instant::now();
            while at(i) <= now && at(i) < end {
                // A connection whose task ended (it cannot fail) is not
                // given more.
                let _ = txs[i % connections].send(at(i));
                i += 1;
            }
        }
        // Closing the queues ends the connections once they are through.
        drop(txs);
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.map_err(|e| anyhow::anyhow!("a connection's task: {e}"))??);
        }
        anyhow::Ok(out)
    })?;
    // Until the last answer: past `end` when the answers fell behind.
    let wall = t0.elapsed().as_secs_f64().max(secs);
    let mut lat = Vec::new();
    let mut failed = 0;
    for (l, f) in results {
        lat.extend(l);
        failed += f;
    }
    lat.sort_unstable();
    let pct = |p: f64| -> f64 {
        if lat.is_empty() {
            return f64::NAN;
        }
        let i = ((p * lat.len() as f64).ceil() as usize).clamp(1, lat.len()) - 1;
        lat[i].as_secs_f64() * 1e3
    };
    Ok(Report {
        requests: lat.len() as u64,
        failed,
        offered_rps: rate,
        rps: lat.len() as f64 / wall,
        p50_ms: pct(0.50),
        p90_ms: pct(0.90),
        p99_ms: pct(0.99),
        max_ms: lat.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
    })
}

/// One connection: the requests the dispatcher hands it, each with its
/// scheduled time, sent in turn; their latencies and failures.
async fn connection(
    target: SocketAddr,
    mut due: tokio::sync::mpsc::UnboundedReceiver<Instant>,
) -> anyhow::Result<(Vec<Duration>, u64)> {
    let request = format!("GET / HTTP/1.1\r\nHost: {target}\r\n\r\n").into_bytes();
    let mut lat = Vec::new();
    let mut failed = 0;
    let mut conn: Option<(TcpStream, Vec<u8>)> = None;
    while let Some(at) = due.recv().await {
        if conn.is_none() {
            match tokio::time::timeout(TIMEOUT, TcpStream::connect(target)).await {
                Ok(Ok(s)) => {
                    s.set_nodelay(true)?;
                    conn = Some((s, Vec::new()));
                }
                _ => {
                    failed += 1;
                    continue;
                }
            }
        }
        let Some((stream, buf)) = conn.as_mut() else { continue };
        let answered = tokio::time::timeout(TIMEOUT, async {
            stream.write_all(&request).await?;
            let head = http1::read_head(stream, buf)
                .await?
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"))?;
            let len = head.content_length()?;
            http1::read_body(stream, buf, len).await?;
            head.status()
        })
        .await;
        match answered {
            Ok(Ok(status)) if (200..300).contains(&status) => lat.push(at.elapsed()),
            Ok(Ok(_)) => failed += 1,
            // A broken or stuck connection: opened again for the next one.
            _ => {
                failed += 1;
                conn = None;
            }
        }
    }
    Ok((lat, failed))
}

/// A periodic timerfd in the runtime's reactor. nix's `TimerFd` has no
/// async wait, and its `time` feature would be built for these calls only.
struct Ticker(AsyncFd<OwnedFd>);

impl Ticker {
    fn new(every: Duration) -> std::io::Result<Self> {
        // SAFETY: timerfd_create returns a new fd (or -1), which we own.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let period = libc::timespec {
            tv_sec: every.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(every.subsec_nanos() as i32),
        };
        let spec = libc::itimerspec { it_interval: period, it_value: period };
        // SAFETY: a valid timerfd and itimerspec; relative time.
        if unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &raw const spec, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the AsyncFd owns the fd, which stays open and the same
        // for as long as it is registered.
        match unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
            Ok(fd) => Ok(Self(fd)),
            Err(e) => Err(std::io::Error::other(e.to_string())),
        }
    }

    /// Wait for the next tick (at once if one or more have passed).
    async fn tick(&self) -> std::io::Result<()> {
        loop {
            let mut ready = self.0.readable().await?;
            let mut expirations = [0u8; 8];
            // SAFETY: reading 8 bytes into an 8-byte buffer.
            let n = unsafe { libc::read(self.0.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
            if n == 8 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(e);
            }
            ready.clear_ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    /// A server that answers every request after `delay`, one connection
    /// per thread.
    fn server(delay: Duration) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    let mut have = Vec::new();
                    loop {
                        while let Some(p) = have.windows(4).position(|w| w == b"\r\n\r\n") {
                            have.drain(..p + 4);
                            std::thread::sleep(delay);
                            if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").is_err() {
                                return;
                            }
                        }
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => have.extend_from_slice(&buf[..n]),
                        }
                    }
                });
            }
        });
        addr
    }

    #[test]
    fn requests_leave_on_schedule_at_the_rate_asked() {
        let r = run(&[server(Duration::ZERO), server(Duration::ZERO)], 4, 400.0, 1.0).unwrap();
        assert_eq!(r.failed, 0, "{r:?}");
        assert!((395..=400).contains(&r.requests), "400 requests in 1 s at 400/s: {r:?}");
        assert!(r.p50_ms < 5.0, "a prompt server: {r:?}");
    }

    /// A server slower than the schedule: the requests queued behind a
    /// slow answer count their waiting, so the latency grows through the
    /// run instead of staying at the server's 20 ms (as it would if each
    /// request were timed from when it was sent).
    #[test]
    fn waiting_behind_a_late_answer_counts() {
        // One connection, a request every 10 ms, each answered after 20 ms.
        let r = run(&[server(Duration::from_millis(20))], 1, 100.0, 1.0).unwrap();
        assert_eq!(r.failed, 0, "{r:?}");
        assert!(r.max_ms > 400.0, "the last requests waited for about half the run: {r:?}");
        assert!(r.rps < 60.0, "answered at the server's pace, not the schedule's: {r:?}");
    }
}

//! `lbctl watch`: a live per-backend view refreshed every second, in a
//! plain terminal (ANSI clear and home only). Keys are read unbuffered; `q`
//! or Ctrl-C quit and the terminal is restored, also on error.
use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

use crate::{
    api::{self, Request},
    report::Status,
};

/// Puts the terminal in non-canonical, no-echo mode; restores it on drop.
struct RawMode {
    saved: Option<libc::termios>,
}

impl RawMode {
    fn enter() -> Self {
        // SAFETY: tcgetattr/tcsetattr on fd 0 with a valid termios.
        unsafe {
            if libc::isatty(0) != 1 {
                return Self { saved: None };
            }
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &raw mut t) != 0 {
                return Self { saved: None };
            }
            let saved = t;
            // No line buffering, no echo, and Ctrl-C arrives as a byte we
            // handle ourselves (so the terminal is always restored).
            t.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG);
            t.c_cc[libc::VMIN] = 1;
            t.c_cc[libc::VTIME] = 0;
            libc::tcsetattr(0, libc::TCSANOW, &raw const t);
            Self { saved: Some(saved) }
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(t) = self.saved {
            // SAFETY: restoring the attributes read in enter().
            unsafe { libc::tcsetattr(0, libc::TCSANOW, &raw const t) };
            print!("\x1b[?25h");
            let _ = std::io::stdout().flush();
        }
    }
}

fn width() -> usize {
    // SAFETY: TIOCGWINSZ fills a winsize.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: a plain libc call with valid arguments; it has no other preconditions.
    let ok = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col > 0 { ws.ws_col as usize } else { 100 }
}

fn human(v: f64) -> String {
    let (v, unit) = if v >= 1e9 {
        (v / 1e9, "G")
    } else if v >= 1e6 {
        (v / 1e6, "M")
    } else if v >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    if unit.is_empty() { format!("{v:.0}") } else { format!("{v:.1}{unit}") }
}

type Key = (String, String);

pub struct Sample {
    at: Instant,
    per: HashMap<Key, (u64, u64, u64)>,
}

fn sample(s: &Status) -> Sample {
    let mut per = HashMap::new();
    for svc in &s.services {
        for b in &svc.backends {
            per.insert(
                (svc.name.clone(), format!("{}:{}", b.address, b.port)),
                (b.new_flows, b.packets_in + b.packets_out, b.bytes_in + b.bytes_out),
            );
        }
    }
    Sample { at: Instant::now(), per }
}

/// One screen of the view for a terminal `cols` wide.
pub fn screen(s: &Status, prev: Option<&Sample>, cols: usize) -> String {
    use std::fmt::Write as _;
    let now = sample(s);
    let dt = prev.map(|p| now.at.duration_since(p.at).as_secs_f64()).filter(|d| *d > 0.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "lbctl watch  (q or Ctrl-C to quit)  program {}",
        s.program_id.map_or("-".into(), |i| i.to_string())
    );
    // Columns by priority: narrow terminals drop the ones at the end.
    let wide = cols >= 96;
    let mid = cols >= 64;
    for svc in &s.services {
        let fair = svc.fairness.map_or("-".to_owned(), |f| format!("{f:.4}"));
        let head =
            format!("{} {}:{}/{} {} fairness {}", svc.name, svc.vip, svc.port, svc.protocol, svc.scheduler, fair);
        let _ = writeln!(out, "\n{}", &head[..head.len().min(cols.max(20))]);
        let mut hdr = format!("{:<21} {:<5} {:>6} {:>8}", "BACKEND", "STATE", "WEIGHT", "CONN/S");
        if mid {
            hdr.push_str(&format!(" {:>13}", "SHARE/EXPECT"));
        }
        if wide {
            hdr.push_str(&format!(" {:>8} {:>8} {:>7}", "PKT/S", "BYTE/S", "ACTIVE"));
        }
        let _ = writeln!(out, "{hdr}");
        for b in &svc.backends {
            let be = format!("{}:{}", b.address, b.port);
            let key = (svc.name.clone(), be.clone());
            let (c, p, by) = now.per[&key];
            let rate = |cur: u64, f: fn(&(u64, u64, u64)) -> u64| match (prev.and_then(|p| p.per.get(&key)), dt) {
                (Some(old), Some(dt)) => human(cur.saturating_sub(f(old)) as f64 / dt),
                _ => "-".to_owned(),
            };
            let state = format!("{:?}", b.state).to_lowercase();
            let mut line = format!("{be:<21} {state:<5} {:>6} {:>8}", b.weight, rate(c, |t| t.0));
            if mid {
                line.push_str(&format!(
                    " {:>13}",
                    format!("{:.1}/{:.1}%", b.observed_share * 100.0, b.expected_share * 100.0)
                ));
            }
            if wide {
                line.push_str(&format!(" {:>8} {:>8} {:>7}", rate(p, |t| t.1), rate(by, |t| t.2), b.active_flows));
            }
            let _ = writeln!(out, "{}", &line[..line.len().min(cols.max(20))]);
        }
    }
    let drops: Vec<String> = s.counters.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "\ndatapath: {}", if drops.is_empty() { "no drops".into() } else { drops.join(" ") });
    out
}

/// Run the view until q or Ctrl-C.
pub fn run(socket: &Path) -> Result<(), api::ClientError> {
    let _raw = RawMode::enter();
    let (tx, rx) = mpsc::channel::<u8>();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        while let Ok(1) = std::io::stdin().read(&mut b) {
            if tx.send(b[0]).is_err() {
                break;
            }
        }
    });
    let mut prev: Option<Sample> = None;
    loop {
        let v = api::call(socket, &Request::Status)?;
        let status: Status = serde_json::from_value(v)?;
        let text = screen(&status, prev.as_ref(), width());
        print!("\x1b[H\x1b[2J{}", text.replace('\n', "\r\n"));
        let _ = std::io::stdout().flush();
        prev = Some(sample(&status));
        let deadline = Instant::now() + Duration::from_secs(1);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(b'q' | b'Q' | 0x03) => {
                    println!("\r");
                    return Ok(());
                }
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                // stdin closed: keep refreshing until a signal ends us.
                Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(left),
            }
        }
    }
}

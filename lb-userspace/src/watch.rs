//! `lbctl watch`: a live per-backend view refreshed every second. The
//! terminal (raw mode, alternate screen, size, clearing, keys) is driven by
//! `crossterm`; `q` or Ctrl-C quit and the terminal is restored on every
//! exit: a guard's Drop on return, error or unwinding panic, and a panic
//! hook that restores it before the panic message is printed (so the
//! message lands on the normal screen, not the alternate one).
use std::{
    collections::HashMap,
    io::{IsTerminal as _, Write as _},
    path::Path,
    sync::{
        Once,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crossterm::{
    cursor::{Hide, MoveTo, Show},
    event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
    execute, queue,
    terminal::{self, Clear, ClearType, EnterAlternateScreen, LeaveAlternateScreen},
};

use crate::{
    api::{self, Request},
    report::Status,
};

/// Raw mode is on (this process changed the terminal's mode).
static RAW: AtomicBool = AtomicBool::new(false);
/// The alternate screen is shown (and the cursor hidden).
static ALTERNATE: AtomicBool = AtomicBool::new(false);

/// Put the terminal back as it was; each step once, however often called
/// (the panic hook and then the guard's Drop both call it on a panic).
fn restore() {
    if ALTERNATE.swap(false, Ordering::SeqCst) {
        let _ = execute!(std::io::stdout(), Show, LeaveAlternateScreen);
    }
    if RAW.swap(false, Ordering::SeqCst) {
        let _ = terminal::disable_raw_mode();
    }
}

/// While alive: raw mode (keys unbuffered and unechoed, Ctrl-C as a key)
/// when stdin is a terminal, and then the alternate screen with the cursor
/// hidden when stdout is one too. Dropping it restores the terminal.
/// Nothing to do when stdin is not a terminal.
struct Terminal {
    /// Keys can be read (raw mode is on).
    keys: bool,
}

impl Terminal {
    fn enter() -> Self {
        static HOOK: Once = Once::new();
        HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore();
                previous(info);
            }));
        });
        let keys = std::io::stdin().is_terminal() && terminal::enable_raw_mode().is_ok();
        RAW.store(keys, Ordering::SeqCst);
        // Only with keys: without raw mode Ctrl-C is a signal that ends the
        // process before it could leave the alternate screen.
        if keys && std::io::stdout().is_terminal() && execute!(std::io::stdout(), EnterAlternateScreen, Hide).is_ok() {
            ALTERNATE.store(true, Ordering::SeqCst);
        }
        Self { keys }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        restore();
    }
}

/// Columns of the terminal (100 when it cannot tell).
fn width() -> usize {
    match terminal::size() {
        Ok((cols, _)) if cols > 0 => usize::from(cols),
        _ => 100,
    }
}

/// True for the keys that end the view.
fn quits(k: &KeyEvent) -> bool {
    k.kind != KeyEventKind::Release
        && match k.code {
            KeyCode::Char('q' | 'Q') | KeyCode::Esc => true,
            KeyCode::Char('c') => k.modifiers.contains(KeyModifiers::CONTROL),
            _ => false,
        }
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
                (svc.name.clone(), std::net::SocketAddr::new(b.address, b.port).to_string()),
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
        let head = format!(
            "{} {}/{} {} fairness {}",
            svc.name,
            std::net::SocketAddr::new(svc.vip, svc.port),
            svc.protocol,
            svc.scheduler,
            fair
        );
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
            let be = std::net::SocketAddr::new(b.address, b.port).to_string();
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
    let term = Terminal::enter();
    let mut out = std::io::stdout();
    let mut prev: Option<Sample> = None;
    loop {
        let v = api::call(socket, &Request::Status)?;
        let status: Status = serde_json::from_value(v)?;
        let text = screen(&status, prev.as_ref(), width());
        let _ = queue!(out, MoveTo(0, 0), Clear(ClearType::All));
        let _ = write!(out, "{}", text.replace('\n', "\r\n"));
        let _ = out.flush();
        prev = Some(sample(&status));
        let deadline = Instant::now() + Duration::from_secs(1);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            if !term.keys {
                // No terminal to read keys from: refresh until a signal ends us.
                std::thread::sleep(left);
                break;
            }
            match event::poll(left) {
                Ok(true) => {
                    if let Ok(Event::Key(k)) = event::read()
                        && quits(&k)
                    {
                        let _ = write!(out, "\r\n");
                        return Ok(());
                    }
                }
                Ok(false) => break,
                Err(_) => std::thread::sleep(left),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q_escape_and_ctrl_c_quit_other_keys_do_not() {
        let key = |code, modifiers| KeyEvent::new(code, modifiers);
        assert!(quits(&key(KeyCode::Char('q'), KeyModifiers::NONE)));
        assert!(quits(&key(KeyCode::Char('Q'), KeyModifiers::SHIFT)));
        assert!(quits(&key(KeyCode::Esc, KeyModifiers::NONE)));
        assert!(quits(&key(KeyCode::Char('c'), KeyModifiers::CONTROL)));
        assert!(!quits(&key(KeyCode::Char('c'), KeyModifiers::NONE)));
        assert!(!quits(&key(KeyCode::Char('x'), KeyModifiers::NONE)));
    }
}

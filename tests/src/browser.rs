//! Headless Chromium (Debian's `chromium`) in a lab namespace, driven over
//! the DevTools protocol: evaluate JavaScript in a live page, take
//! screenshots. The protocol runs over a pipe (`--remote-debugging-pipe`:
//! the browser reads commands on fd 3 and writes answers on fd 4, each a
//! JSON message ended by a NUL byte), so no port is opened and the test,
//! outside the namespace, still reaches it. Our own small client: the
//! crates that speak the protocol bring a websocket stack and an async
//! runtime of their own for the four commands used here.
//!
//! Dropping a [`Browser`] kills the browser and removes its profile.
use std::{
    collections::HashMap,
    fs::File,
    io::{BufRead as _, BufReader, Write as _},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context as _, bail};
use base64::Engine as _;
use serde_json::{Value, json};

use crate::lab::Lab;

/// How long one protocol command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Browser {
    child: Child,
    commands: File,
    answers: mpsc::Receiver<Value>,
    next_id: u64,
    session: String,
    profile: PathBuf,
}

impl Browser {
    /// Start Chromium in the namespace of lab role `role`, showing `url`
    /// in a `width` x `height` window.
    pub fn open(lab: &Lab, role: &str, url: &str, width: u32, height: u32) -> anyhow::Result<Self> {
        let profile = PathBuf::from(format!("/tmp/{}-chromium", lab.spec.prefix));
        let _ = std::fs::remove_dir_all(&profile);
        std::fs::create_dir_all(&profile)?;
        // Our ends: we write commands into `to_browser`, read answers from
        // `from_browser`; the browser's ends become its fds 3 and 4.
        let (browser_in, to_browser) = pipe()?;
        let (from_browser, browser_out) = pipe()?;
        let mut cmd = lab.cmd(role, "chromium");
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--window-size={width},{height}"))
        .arg(url)
        // Its temporary files inside the profile too, removed with it.
        .env("TMPDIR", &profile)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(profile.with_extension("log"))?);
        hand_over(&mut cmd, [(browser_in, 3), (browser_out, 4)])?;
        let child = cmd.spawn().context("starting chromium (cargo xtask setup installs it)")?;
        // The child's copies are gone with `cmd`: our read end sees EOF when
        // the browser exits.
        drop(cmd);
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(File::from(from_browser));
            let mut buf = Vec::new();
            while r.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                if buf.last() == Some(&0) {
                    buf.pop();
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&buf)
                    && tx.send(v).is_err()
                {
                    return;
                }
                buf.clear();
            }
        });
        let mut b =
            Self { child, commands: File::from(to_browser), answers, next_id: 0, session: String::new(), profile };
        // Attach to the page the browser opened.
        let targets = b.call(None, "Target.getTargets", json!({}))?;
        let page = targets["targetInfos"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["targetId"].as_str())
            .with_context(|| format!("no page among the browser's targets: {targets}"))?
            .to_owned();
        let attached = b.call(None, "Target.attachToTarget", json!({ "targetId": page, "flatten": true }))?;
        b.session = attached["sessionId"].as_str().context("no session id")?.to_owned();
        Ok(b)
    }

    /// The value of JavaScript `expr` in the page (promises awaited).
    pub fn eval(&mut self, expr: &str) -> anyhow::Result<Value> {
        let session = self.session.clone();
        let r = self.call(
            Some(&session),
            "Runtime.evaluate",
            json!({ "expression": expr, "returnByValue": true, "awaitPromise": true }),
        )?;
        if let Some(e) = r.get("exceptionDetails") {
            bail!("{expr}: {e}");
        }
        Ok(r["result"]["value"].clone())
    }

    /// A PNG of the whole page as shown now (beyond the window if it is
    /// longer), written to `path`.
    pub fn screenshot(&mut self, path: &Path) -> anyhow::Result<()> {
        let session = self.session.clone();
        let m = self.call(Some(&session), "Page.getLayoutMetrics", json!({}))?;
        let size = &m["cssContentSize"];
        let (w, h) = (size["width"].as_f64().unwrap_or(1280.0), size["height"].as_f64().unwrap_or(900.0));
        let r = self.call(
            Some(&session),
            "Page.captureScreenshot",
            json!({
                "format": "png",
                "captureBeyondViewport": true,
                "clip": { "x": 0, "y": 0, "width": w, "height": h, "scale": 1 },
            }),
        )?;
        let data = r["data"].as_str().context("no screenshot data")?;
        let png = base64::engine::general_purpose::STANDARD.decode(data).context("screenshot data is not base64")?;
        std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
    }

    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> anyhow::Result<Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg)?;
        bytes.push(0);
        if let Err(e) = self.commands.write_all(&bytes) {
            bail!("sending {method} to chromium: {e}; {}", self.gone());
        }
        let deadline = std::time::Instant::now() + COMMAND_TIMEOUT;
        let mut events = HashMap::<String, u32>::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let v = self.answers.recv_timeout(left).map_err(|_| {
                anyhow::anyhow!(
                    "chromium did not answer {method} within {COMMAND_TIMEOUT:?} (events meanwhile: {events:?}); {}",
                    self.gone()
                )
            })?;
            if v["id"].as_u64() == Some(id) {
                if let Some(e) = v.get("error") {
                    bail!("{method}: {e}");
                }
                return Ok(v["result"].clone());
            }
            if let Some(m) = v["method"].as_str() {
                *events.entry(m.to_owned()).or_default() += 1;
            }
        }
    }
}

impl Browser {
    /// Whether the browser still runs, and its log so far: what a failed
    /// command's error needs.
    fn gone(&mut self) -> String {
        let state = match self.child.try_wait() {
            Ok(Some(status)) => format!("the browser exited ({status})"),
            Ok(None) => "the browser still runs".to_owned(),
            Err(e) => format!("the browser's state is unknown ({e})"),
        };
        let log = std::fs::read_to_string(self.profile.with_extension("log")).unwrap_or_default();
        format!("{state}; its log:\n{log}")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Closed by the protocol, so that its helper processes exit with
        // it; killed if it does not go within a few seconds.
        let _ = self.call(None, "Browser.close", json!({}));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !matches!(self.child.try_wait(), Ok(Some(_))) {
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Its last helpers may still be writing the profile for a moment.
        for _ in 0..50 {
            if std::fs::remove_dir_all(&self.profile).is_ok() || !self.profile.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = std::fs::remove_file(self.profile.with_extension("log"));
    }
}

/// Give the child `cmd` starts each fd at the number beside it (the
/// browser's 3 and 4), and nothing else of ours. The fds are first copied
/// above every target number, close-on-exec: a pipe end that happened to
/// be 3 or 4 itself (a parent started with few fds open, as under CI)
/// would otherwise be overwritten by the first dup2, or kept close-on-exec
/// by a dup2 onto itself, and the browser would start without its pipe.
/// The copies live in the closure, so they close when `cmd` is dropped.
fn hand_over<const N: usize>(cmd: &mut Command, fds: [(OwnedFd, RawFd); N]) -> anyhow::Result<()> {
    let above = fds.iter().map(|(_, to)| to + 1).max().unwrap_or(0).max(10);
    let mut high = Vec::with_capacity(N);
    for (fd, to) in fds {
        // SAFETY: F_DUPFD_CLOEXEC returns a new fd that we then own.
        let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, above) };
        if copy < 0 {
            bail!("copying fd {}: {}", fd.as_raw_fd(), std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd, owned by nobody else.
        high.push((unsafe { OwnedFd::from_raw_fd(copy) }, to));
    }
    // SAFETY: only dup2(2) between fork and exec; every source is above
    // every target, so no dup2 clobbers a later source, and each target is
    // a new fd without close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            for (from, to) in &high {
                if libc::dup2(from.as_raw_fd(), *to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(())
}

/// A pipe: (read end, write end), both close-on-exec (the browser gets
/// its ends by dup2, which clears the flag on the copies).
fn pipe() -> anyhow::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("pipe2: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fresh fds, owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;

    /// The worst numbering: each end goes to the number the other one has
    /// here, so a plain dup2 of the first would clobber the second. The
    /// child must still read what we write and answer on the other pipe,
    /// and the answer must end when it exits (no copy of its write end
    /// left open with us).
    #[test]
    fn fds_handed_to_a_child_arrive_whatever_their_numbers() {
        let (child_in, to_child) = pipe().unwrap();
        let (from_child, child_out) = pipe().unwrap();
        let (n_in, n_out) = (child_out.as_raw_fd(), child_in.as_raw_fd());
        let mut cmd = Command::new("bash");
        cmd.args(["-c", r#"read -r line <&"$1" && echo "got $line" >&"$2""#, "_"])
            .args([n_in.to_string(), n_out.to_string()]);
        hand_over(&mut cmd, [(child_in, n_in), (child_out, n_out)]).unwrap();
        let mut child = cmd.spawn().unwrap();
        drop(cmd);
        File::from(to_child).write_all(b"hello\n").unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut answer = String::new();
            let _ = tx.send(File::from(from_child).read_to_string(&mut answer).map(|_| answer));
        });
        let answer = rx.recv_timeout(Duration::from_secs(10)).expect("the answer ends when the child exits").unwrap();
        assert_eq!(answer, "got hello\n");
        assert!(child.wait().unwrap().success());
    }
}

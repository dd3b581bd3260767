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
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Stdio},
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
        let (fd_in, fd_out) = (browser_in.as_raw_fd(), browser_out.as_raw_fd());
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
        // SAFETY: only dup2(2) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for (from, to) in [(fd_in, 3), (fd_out, 4)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn().context("starting chromium (cargo xtask setup installs it)")?;
        drop((browser_in, browser_out));
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
        self.commands.write_all(&bytes).with_context(|| format!("sending {method} to chromium"))?;
        let deadline = std::time::Instant::now() + COMMAND_TIMEOUT;
        let mut events = HashMap::<String, u32>::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let v = self.answers.recv_timeout(left).map_err(|_| {
                anyhow::anyhow!(
                    "chromium did not answer {method} within {COMMAND_TIMEOUT:?} (events meanwhile: {events:?}); its log: {}",
                    std::fs::read_to_string(self.profile.with_extension("log")).unwrap_or_default()
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

//! Observability in the lab: the Prometheus exporter against the backends'
//! own counts, checked by promtool and by a real Prometheus server through
//! its query API; `lbctl watch` in a real terminal (tmux); a stopped
//! backend showing in the metrics, the live view and the log. Needs root.
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use lb_tests::{harness::Running, lab::Lab, lbd::wait_for};

const WEB: &str = "  - name: web
    vip: 10.10.0.100
    port: 80
    health: { type: http, path: /stats, port: 9000, interval: 500ms, timeout: 300ms, rise: 2, fall: 3 }
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 2 }
      - { address: 10.20.0.13, port: 8080, weight: 3 }
";

fn setup(prefix: &str) -> Running {
    Running::start(prefix, 3, WEB)
}

/// GET a URL from inside the gateway namespace (where lbd listens).
fn get(lab: &Lab, url: &str) -> String {
    let out = lab.cmd("gw", "curl").args(["-sf", "--max-time", "5", url]).output().unwrap();
    assert!(out.status.success(), "GET {url}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Samples of `name` from an exposition: label text -> value.
fn samples(text: &str, name: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            (n == name).then(|| (labels.to_owned(), value.parse().unwrap()))
        })
        .collect()
}

struct Prometheus {
    child: Child,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn metrics_equal_the_backends_counts_in_promtool_and_prometheus() {
    let s = setup("lbt-obs-prom");
    let r = s
        .lab
        .client(&["conns", "--target", "10.10.0.100:80", "--count", "1200", "--sources-range", "10.10.1.1-10.10.1.250"])
        .unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    let counts = s.lab.backend_counts().unwrap();
    let text = get(&s.lab, "http://127.0.0.1:9464/metrics");
    let conns = samples(&text, "lb_backend_connections_total");
    for (i, addr) in s.lab.backend_addrs().iter().enumerate() {
        let key = format!("service=\"web\",backend=\"{addr}:8080\"");
        assert_eq!(conns.get(&key).copied(), Some(counts[i].connections as f64), "{key} in\n{text}");
    }
    for name in lb_userspace::metrics::SERIES {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
    }
    assert_eq!(samples(&text, "lb_backend_up").values().sum::<f64>(), 3.0);
    assert!(samples(&text, "lb_health_check_duration_seconds_count").values().all(|v| *v > 0.0));

    // promtool's linter accepts the exposition.
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (cargo xtask setup installs prometheus)");
    use std::io::Write as _;
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // A real Prometheus scraping lbd returns the same numbers.
    let dir = PathBuf::from("/tmp/lbt-obs-prom-server");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("prometheus.yml"),
        "global: { scrape_interval: 1s }\nscrape_configs:\n  - job_name: lbd\n    static_configs: [{ targets: ['127.0.0.1:9464'] }]\n",
    )
    .unwrap();
    let child = s
        .lab
        .cmd("gw", "prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .args(["--web.listen-address=127.0.0.1:9090"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("log")).unwrap())
        .spawn()
        .unwrap();
    let _prom = Prometheus { child, dir: dir.clone() };
    let want: BTreeMap<String, u64> =
        s.lab.backend_addrs().iter().zip(&counts).map(|(a, c)| (format!("{a}:8080"), c.connections)).collect();
    let started = Instant::now();
    let got = wait_for(30, || {
        let out = s
            .lab
            .cmd("gw", "curl")
            .args(["-sf", "--max-time", "2", "http://127.0.0.1:9090/api/v1/query?query=lb_backend_connections_total"])
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let got: BTreeMap<String, u64> = v["data"]["result"]
            .as_array()?
            .iter()
            .map(|r| {
                (
                    r["metric"]["backend"].as_str().unwrap_or("").to_owned(),
                    r["value"][1].as_str().unwrap_or("0").parse().unwrap_or(0),
                )
            })
            .collect();
        (got == want).then_some(got)
    });
    let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    assert_eq!(got, Some(want.clone()), "Prometheus never returned {want:?}; its log:\n{log}");
    println!("Prometheus query API returned {want:?} after {:?}", started.elapsed());
}

struct Tmux(String);

impl Tmux {
    fn start(name: &str, cols: u16, cmd: &str) -> Self {
        let _ = Command::new("tmux").args(["kill-session", "-t", name]).output();
        let ok = Command::new("tmux")
            .args(["new-session", "-d", "-s", name, "-x", &cols.to_string(), "-y", "40", cmd])
            .status()
            .expect("tmux (cargo xtask setup installs it)");
        assert!(ok.success());
        Self(name.to_owned())
    }

    fn capture(&self) -> String {
        let out = Command::new("tmux").args(["capture-pane", "-p", "-t", &self.0]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn alive(&self) -> bool {
        Command::new("tmux").args(["has-session", "-t", &self.0]).output().unwrap().status.success()
    }

    fn keys(&self, k: &str) {
        assert!(Command::new("tmux").args(["send-keys", "-t", &self.0, k]).status().unwrap().success());
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["kill-session", "-t", &self.0]).output();
    }
}

#[test]
fn lbctl_watch_shows_backends_rates_and_states_and_a_stopped_backend() {
    let s = setup("lbt-obs-watch");
    let lbctl = s.lab.spec.bin_dir.join("lbctl");
    let cmd = format!("{} --socket {} watch", lbctl.display(), s.lbd.socket.display());
    let wide = Tmux::start("lbt-watch-wide", 120, &cmd);
    let narrow = Tmux::start("lbt-watch-narrow", 50, &cmd);
    std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            s.lab
                .client(&[
                    "conns",
                    "--target",
                    "10.10.0.100:80",
                    "--concurrency",
                    "2",
                    "--duration-ms",
                    "6000",
                    "--sources-range",
                    "10.10.1.1-10.10.1.250",
                ])
                .unwrap()
        });
        // Rates show while traffic flows.
        let screen = wait_for(10, || {
            let c = wide.capture();
            let rows: Vec<&str> = c.lines().filter(|l| l.starts_with("10.20.0.1")).collect();
            let moving = rows.len() == 3
                && rows.iter().all(|r| {
                    let f: Vec<&str> = r.split_whitespace().collect();
                    f.get(3).and_then(|v| v.trim_end_matches(['k', 'M']).parse::<f64>().ok()).is_some_and(|v| v > 0.0)
                });
            moving.then_some(c)
        })
        .unwrap_or_else(|| panic!("no rates on screen:\n{}", wide.capture()));
        println!("lbctl watch (120 columns):\n{screen}");
        for want in ["web 10.10.0.100:80/tcp", "CONN/S", "SHARE/EXPECT", "PKT/S", "BYTE/S", "16.7%", "33.3%", "50.0%"] {
            assert!(screen.contains(want), "{want:?} not on screen:\n{screen}");
        }
        assert_eq!(screen.lines().filter(|l| l.contains(" up ")).count(), 3, "{screen}");
        let small = narrow.capture();
        println!("lbctl watch (50 columns):\n{small}");
        assert!(small.lines().all(|l| l.chars().count() <= 50), "{small}");
        assert!(small.contains("10.20.0.13:8080") && small.contains("CONN/S"), "{small}");

        // Stop a backend: the view, the metrics and the log all say so
        // within the detection time (3 x 500 ms + 1 s).
        s.lab.stop_backend(1).unwrap();
        let t0 = Instant::now();
        wait_for(5, || {
            wide.capture().lines().any(|l| l.starts_with("10.20.0.12:8080") && l.contains(" down ")).then_some(())
        })
        .unwrap_or_else(|| panic!("watch never showed the backend down:\n{}", wide.capture()));
        let in_view = t0.elapsed();
        let text = get(&s.lab, "http://127.0.0.1:9464/metrics");
        assert_eq!(samples(&text, "lb_backend_up")["service=\"web\",backend=\"10.20.0.12:8080\""], 0.0);
        let downs: Vec<String> =
            s.lbd.log_text().lines().filter(|l| l.contains("backend down")).map(String::from).collect();
        assert_eq!(downs.len(), 1, "{downs:?}");
        assert!(downs[0].contains("service=web") && downs[0].contains("backend=10.20.0.12:8080"), "{downs:?}");
        println!("stopped backend shown down in watch after {in_view:?}");
        assert!(in_view <= Duration::from_millis(2500), "{in_view:?}");
        let r = load.join().unwrap();
        assert!(r["ok"].as_u64().unwrap() > 0);
    });
    // q quits and restores the terminal.
    wide.keys("q");
    narrow.keys("C-c");
    wait_for(5, || (!wide.alive() && !narrow.alive()).then_some(())).expect("lbctl watch did not exit on q / Ctrl-C");
}

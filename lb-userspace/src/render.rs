//! The configuration written back as YAML: a canonical, human-editable
//! form that [`config::parse`](crate::config::parse) reads back to an equal
//! [`Config`], and an atomic file replace to store it.
//!
//! Used when lbd/lbctl change the configuration (add a backend, drain one)
//! and persist the result. Comments of the original file are not kept; the
//! rendered file says so in its header. The YAML is written by serde
//! (`yaml_serde`, which also reads the file), so quoting is the library's;
//! the atomic replace uses `tempfile`.
use std::{
    borrow::Cow,
    fs::{self, File},
    io::{self, Write as _},
    net::IpAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Serialize;

use crate::{
    config::{BackendConfig, BgpConfig, Config, Forwarding, HealthConfig, ProbeKind, Protocol, ServiceConfig, XdpMode},
    sched::Scheduler,
};

const HEADER: &str = "\
# lbd configuration.
# This file is maintained by lbd/lbctl: changes made through them rewrite it
# in this canonical form, and comments are not preserved.
";

/// The file as written: the configuration's keys in a fixed order, per
/// service the optional keys (`slow_start`, `health`) only when they say
/// something.
#[derive(Serialize)]
struct FileView<'a> {
    interfaces: &'a [String],
    xdp_mode: XdpMode,
    forwarding: &'static str,
    control_socket: Cow<'a, str>,
    pin_path: Cow<'a, str>,
    conntrack_max: u32,
    /// Written only when it differs from `conntrack_max` (its default).
    #[serde(skip_serializing_if = "Option::is_none")]
    conntrack_max_ipv6: Option<u32>,
    table_capacity: u32,
    maglev_seed: u64,
    tcp_idle_timeout: u32,
    udp_idle_timeout: u32,
    flood: FloodView,
    metrics_listen: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    bgp: Option<&'a BgpConfig>,
    services: Vec<ServiceView<'a>>,
}

#[derive(Serialize)]
struct FloodView {
    new_flow_rate_per_cpu: Rate,
    half_open_timeout: u32,
}

/// `auto`, or a number.
#[derive(Serialize)]
#[serde(untagged)]
enum Rate {
    Auto(&'static str),
    PerSecond(u32),
}

#[derive(Serialize)]
struct ServiceView<'a> {
    name: &'a str,
    vip: IpAddr,
    port: u16,
    protocol: Protocol,
    /// Only when not the default (`nat`).
    #[serde(skip_serializing_if = "Option::is_none")]
    forwarding: Option<Forwarding>,
    scheduler: Scheduler,
    table_size: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    slow_start: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    udp_idle_timeout: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    health: Option<HealthView<'a>>,
    backends: Vec<BackendView>,
}

#[derive(Serialize)]
struct HealthView<'a> {
    #[serde(rename = "type")]
    kind: ProbeKind,
    interval: String,
    timeout: String,
    rise: u32,
    fall: u32,
    path: &'a str,
    expect: Expect,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<&'a str>,
}

/// One status code, or a range `lo-hi`.
#[derive(Serialize)]
#[serde(untagged)]
enum Expect {
    One(u16),
    Range(String),
}

#[derive(Serialize)]
struct BackendView {
    address: IpAddr,
    port: u16,
    weight: u32,
    #[serde(skip_serializing_if = "is_false")]
    drain: bool,
}

#[expect(clippy::trivially_copy_pass_by_ref, reason = "serde's skip_serializing_if passes a reference")]
fn is_false(b: &bool) -> bool {
    !*b
}

/// The configuration as YAML text that `config::parse` reads back to an
/// equal `Config`. Durations are whole milliseconds (`1500ms`) or whole
/// seconds (`10s`); finer precision is rounded to the millisecond. Paths
/// that are not valid UTF-8 are rendered lossily (the parser only produces
/// UTF-8 paths).
pub fn render(cfg: &Config) -> String {
    let view = FileView {
        interfaces: &cfg.interfaces,
        xdp_mode: cfg.xdp_mode,
        forwarding: "nat",
        control_socket: cfg.control_socket.to_string_lossy(),
        pin_path: cfg.pin_path.to_string_lossy(),
        conntrack_max: cfg.conntrack_max,
        conntrack_max_ipv6: (cfg.conntrack_max_ipv6 != cfg.conntrack_max).then_some(cfg.conntrack_max_ipv6),
        table_capacity: cfg.table_capacity,
        maglev_seed: cfg.maglev_seed,
        tcp_idle_timeout: cfg.tcp_idle_timeout,
        udp_idle_timeout: cfg.udp_idle_timeout,
        flood: FloodView {
            new_flow_rate_per_cpu: cfg.flood.new_flow_rate_per_cpu.map_or(Rate::Auto("auto"), Rate::PerSecond),
            half_open_timeout: cfg.flood.half_open_timeout,
        },
        metrics_listen: cfg.metrics_listen.to_string(),
        bgp: cfg.bgp.as_ref(),
        services: cfg.services.iter().map(service).collect(),
    };
    let body = yaml_serde::to_string(&view).expect("plain strings, numbers and lists always serialize");
    format!("{HEADER}{body}")
}

fn service(s: &ServiceConfig) -> ServiceView<'_> {
    ServiceView {
        name: &s.name,
        vip: s.vip,
        port: s.port,
        protocol: s.protocol,
        forwarding: (s.forwarding != Forwarding::Nat).then_some(s.forwarding),
        scheduler: s.scheduler,
        table_size: s.table_size,
        // A zero slow start means none (the parser reads `0s` as `None`).
        slow_start: s.slow_start.filter(|&d| round_ms(d) > 0).map(duration),
        udp_idle_timeout: s.udp_idle_timeout,
        health: (s.health.kind != ProbeKind::None || s.health != HealthConfig::default()).then(|| health(&s.health)),
        backends: s.backends.iter().map(backend).collect(),
    }
}

fn health(h: &HealthConfig) -> HealthView<'_> {
    let (lo, hi) = h.expect;
    HealthView {
        kind: h.kind,
        interval: duration(h.interval),
        timeout: duration(h.timeout),
        rise: h.rise,
        fall: h.fall,
        path: &h.path,
        expect: if lo == hi { Expect::One(lo) } else { Expect::Range(format!("{lo}-{hi}")) },
        port: h.port,
        body: h.body.as_deref(),
    }
}

fn backend(b: &BackendConfig) -> BackendView {
    BackendView { address: b.address, port: b.port, weight: b.weight, drain: b.drain }
}

/// Milliseconds, rounded to the nearest (durations parsed from `1.5s`
/// go through floating point and may be a nanosecond off).
fn round_ms(d: Duration) -> u128 {
    (d.as_nanos() + 500_000) / 1_000_000
}

/// `10s` for whole seconds, else `1500ms`.
fn duration(d: Duration) -> String {
    let ms = round_ms(d);
    if ms.is_multiple_of(1000) { format!("{}s", ms / 1000) } else { format!("{ms}ms") }
}

/// Write `text` to `path` atomically: a temp file in the same directory
/// (`tempfile`), fsynced, renamed over `path`, then the directory fsynced.
///
/// Readers see the old content or the new, never a mix, and after a crash
/// the file is one or the other. The new file keeps the existing file's
/// permission bits (and, where allowed, its owner and group); a new file
/// gets 0644. If `path` is a symlink, the file it points to is replaced
/// and the link kept. On failure nothing is left behind (the temp file is
/// removed when dropped).
pub fn write_atomic(path: &Path, text: &str) -> io::Result<()> {
    let target: PathBuf = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path)?,
        _ => path.to_path_buf(),
    };
    let Some(name) = target.file_name() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: not a file path", path.display())));
    };
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let existing = match fs::metadata(&target) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    let mode = existing.as_ref().map_or(0o644, |m| m.permissions().mode() & 0o7777);

    let mut tmp =
        tempfile::Builder::new().prefix(&format!(".{}.", name.to_string_lossy())).suffix(".tmp").tempfile_in(&dir)?;
    // Set explicitly: tempfile creates 0600.
    tmp.as_file().set_permissions(fs::Permissions::from_mode(mode))?;
    if let Some(m) = &existing {
        use std::os::unix::fs::MetadataExt as _;
        // Best effort: only root may give a file away.
        let _ = std::os::unix::fs::fchown(tmp.as_file(), Some(m.uid()), Some(m.gid()));
    }
    tmp.write_all(text.as_bytes())?;
    tmp.as_file().sync_all()?;
    tmp.persist(&target).map_err(|e| e.error)?;
    File::open(&dir)?.sync_all()
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::config::{
        DEFAULT_CONNTRACK_MAX, DEFAULT_CONTROL_SOCKET, DEFAULT_METRICS_LISTEN, DEFAULT_PIN_PATH,
        DEFAULT_TABLE_CAPACITY, DEFAULT_TCP_IDLE_TIMEOUT, DEFAULT_UDP_IDLE_TIMEOUT, Environment, ProbeKind, Protocol,
        parse,
    };
    use crate::sched::Scheduler;

    /// Every interface exists.
    struct AnyInterface;
    impl Environment for AnyInterface {
        fn interface_exists(&self, _: &str) -> bool {
            true
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn be(addr: &str, port: u16, weight: u32) -> BackendConfig {
        BackendConfig { address: ip(addr), port, weight, drain: false }
    }

    fn svc(name: &str, vip: &str, port: u16) -> ServiceConfig {
        ServiceConfig::example(name, ip(vip), port, vec![be("10.20.0.11", 8080, 1), be("10.20.0.12", 8080, 2)])
    }

    fn base() -> Config {
        Config {
            interfaces: vec!["eth0".into()],
            xdp_mode: XdpMode::Auto,
            control_socket: DEFAULT_CONTROL_SOCKET.into(),
            pin_path: DEFAULT_PIN_PATH.into(),
            conntrack_max: DEFAULT_CONNTRACK_MAX,
            conntrack_max_ipv6: DEFAULT_CONNTRACK_MAX,
            table_capacity: DEFAULT_TABLE_CAPACITY,
            maglev_seed: 0,
            tcp_idle_timeout: DEFAULT_TCP_IDLE_TIMEOUT,
            udp_idle_timeout: DEFAULT_UDP_IDLE_TIMEOUT,
            flood: Default::default(),
            metrics_listen: DEFAULT_METRICS_LISTEN.parse().unwrap(),
            bgp: None,
            services: vec![svc("web", "10.10.0.100", 80)],
        }
    }

    fn configs() -> Vec<(&'static str, Config)> {
        let mut v = vec![("defaults", base())];

        let mut c = base();
        c.services.clear();
        v.push(("zero services", c));

        for rate in [Some(0), Some(2500)] {
            let mut c = base();
            c.flood = crate::config::FloodConfig { new_flow_rate_per_cpu: rate, half_open_timeout: 3 };
            v.push(("flood", c));
        }

        for (sched, size) in Scheduler::ALL.into_iter().zip([65537, 251, 3, 1009, 65521].into_iter().cycle()) {
            let mut c = base();
            c.services[0].scheduler = sched;
            c.services[0].table_size = size;
            // Some schedulers weigh the probes' response times.
            c.services[0].health = HealthConfig { kind: ProbeKind::Http, ..HealthConfig::default() };
            v.push(("scheduler", c));
        }

        let mut c = base();
        c.services[0].protocol = Protocol::Udp;
        c.services[0].port = 53;
        c.xdp_mode = XdpMode::Native;
        c.interfaces = vec!["eth0".into(), "eth1".into(), "ens3f0.100".into()];
        v.push(("udp, native, several interfaces", c));

        let mut c = base();
        c.services[0].health = HealthConfig {
            kind: ProbeKind::Http,
            interval: Duration::from_millis(1500),
            timeout: Duration::from_millis(250),
            rise: 5,
            fall: 1,
            path: "/healthz?full=1&x=%20".into(),
            expect: (204, 204),
            port: Some(9000),
            body: Some("status: \"ok\" #1".into()),
        };
        v.push(("http health, port, single status, body", c));

        let mut c = base();
        c.services[0].health.kind = ProbeKind::Http;
        c.services[0].health.expect = (200, 299);
        v.push(("http health, range", c));

        let mut c = base();
        c.services[0].health.kind = ProbeKind::Tcp;
        c.services[0].health.interval = Duration::from_secs(3600);
        c.services[0].health.timeout = Duration::from_millis(10);
        v.push(("tcp health", c));

        let mut c = base();
        // Not probing, but with non-default settings kept for later.
        c.services[0].health.rise = 7;
        c.services[0].health.timeout = Duration::from_secs(5);
        v.push(("none health with settings", c));

        for d in
            [Duration::from_secs(10), Duration::from_millis(1500), Duration::from_millis(1), Duration::from_secs(3600)]
        {
            let mut c = base();
            c.services[0].slow_start = Some(d);
            v.push(("slow start", c));
        }

        let mut c = base();
        c.services[0].backends[1].drain = true;
        c.services[0].backends.push(BackendConfig { address: ip("10.20.0.13"), port: 1, weight: 0, drain: true });
        c.services[0].backends.push(be("10.20.0.14", 65535, 65535));
        v.push(("drain and extremes", c));

        let mut c = base();
        c.services[0].backends.clear();
        v.push(("no backends", c));

        let mut c = base();
        c.xdp_mode = XdpMode::Generic;
        c.control_socket = "/run/my lbd/ctl \"x\".sock".into();
        c.pin_path = "/sys/fs/bpf/lbd-été".into();
        c.conntrack_max = 1;
        c.table_capacity = 1 << 26;
        c.maglev_seed = u64::MAX;
        c.tcp_idle_timeout = 10;
        c.udp_idle_timeout = 86_400 * 7;
        c.interfaces = vec!["true".into(), "123".into(), "null".into(), "eth:0".into(), "-x".into()];
        let mut s2 = svc("123", "10.10.0.101", 443);
        s2.scheduler = Scheduler::Wrr;
        s2.slow_start = Some(Duration::from_millis(750));
        s2.health.kind = ProbeKind::Tcp;
        s2.health.port = Some(8443);
        let mut s3 = svc("true", "10.10.0.101", 443);
        s3.protocol = Protocol::Udp;
        s3.scheduler = Scheduler::LeastConn;
        s3.udp_idle_timeout = Some(45);
        let mut s4 = svc("1e3", "192.168.1.1", 1);
        s4.table_size = 7;
        let s5 = svc("null", "172.16.0.1", 2);
        let s6 = svc("0x1F", "172.16.0.1", 3);
        let s7 = svc("-", "172.16.0.1", 4);
        let s8 = svc("_", "172.16.0.1", 5);
        c.services.extend([s2, s3, s4, s5, s6, s7, s8]);
        v.push(("many services, awkward strings", c));

        let mut c = base();
        c.bgp = Some(BgpConfig {
            local_asn: 4_200_000_001,
            router_id: "10.40.1.2".parse().unwrap(),
            peers: vec![
                crate::config::BgpPeer { address: "10.40.1.1".parse().unwrap(), asn: 65000 },
                crate::config::BgpPeer { address: "fd00:40::1".parse().unwrap(), asn: 65000 },
            ],
            next_hop: Some("10.40.1.2".parse().unwrap()),
            communities: vec!["65001:100".into(), "0:65535".into()],
            med: Some(0),
            hold_time: 9,
            daemon: "/usr/sbin/bird".into(),
        });
        v.push(("a bgp section, every key", c));
        let mut c = base();
        c.bgp = Some(BgpConfig {
            local_asn: 65001,
            router_id: "10.40.1.2".parse().unwrap(),
            peers: vec![crate::config::BgpPeer { address: "10.40.1.1".parse().unwrap(), asn: 65000 }],
            next_hop: None,
            communities: Vec::new(),
            med: None,
            hold_time: crate::config::DEFAULT_BGP_HOLD_TIME,
            daemon: crate::config::DEFAULT_BGP_DAEMON.into(),
        });
        v.push(("a bgp section, required keys", c));

        v
    }

    #[test]
    fn round_trips() {
        for (what, c) in configs() {
            let text = render(&c);
            match parse(&text, "x", &AnyInterface) {
                Ok(back) => assert_eq!(back, c, "{what}:\n{text}"),
                Err(e) => panic!("{what}: rendered config does not parse:\n{e}\n{text}"),
            }
        }
    }

    #[test]
    fn rendering_is_idempotent() {
        for (what, c) in configs() {
            let text = render(&c);
            let again = render(&parse(&text, "x", &AnyInterface).unwrap());
            assert_eq!(again, text, "{what}");
        }
    }

    #[test]
    fn parsed_handwritten_config_renders_canonically() {
        let hand = "\
# my comment
interfaces: [eth0]
services:
  - name: web
    vip: 10.10.0.100
    port: 80
    slow_start: 1.5s
    health: { type: tcp, interval: 0.25s, timeout: 100ms }
    backends: [{ address: 10.20.0.11, port: 8080 }]
";
        let c = parse(hand, "x", &AnyInterface).unwrap();
        let text = render(&c);
        assert!(!text.contains("my comment"));
        assert!(text.contains("  slow_start: 1500ms\n"), "{text}");
        assert!(text.contains("    interval: 250ms\n    timeout: 100ms\n"), "{text}");
        assert_eq!(parse(&text, "x", &AnyInterface).unwrap(), c);
        assert_eq!(render(&parse(&text, "x", &AnyInterface).unwrap()), text);
    }

    #[test]
    fn durations() {
        assert_eq!(duration(Duration::from_secs(10)), "10s");
        assert_eq!(duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(duration(Duration::from_millis(2000)), "2s");
        assert_eq!(duration(Duration::from_nanos(1_499_999_999)), "1500ms");
        assert_eq!(duration(Duration::from_millis(50)), "50ms");
        assert_eq!(duration(Duration::ZERO), "0s");
        // Millisecond counts read back exactly.
        for ms in (0..=3_600_000u64).step_by(7).chain([1, 999, 1001, 3_599_999]) {
            let d = Duration::from_millis(ms);
            assert_eq!(crate::config::parse_duration(&duration(d)), Some(d), "{ms}");
        }
    }

    #[test]
    fn awkward_strings_read_back_as_written() {
        #[rustfmt::skip]
        const AWKWARD: &[&str] = &[
            "123", "1.5", "-1", ".inf", "-.Inf", ".NaN", "0x1F", "0o17", "1e3", "true", "False", "NULL", "~",
            "-", "---", "...", "a: b", "#x", "x #y", "[a]", "{a}", "a,b", "*a", "&a", "!a", "|", ">", "'a'", "\"a\"",
            "null", "Yes", "off", "0", "%a", "@a", "`a", "?", "? a", "- a", " a", "a ", "a\nb", "a\r\nb", "\u{1}\u{1f}\u{7f}\u{85}\u{feff}",
            "\u{1F600}", "/path with spaces/x", "é", "a\\b",
        ];
        for &s in AWKWARD {
            let mut c = base();
            c.interfaces = vec![s.to_owned(), "eth0".into()];
            c.control_socket = PathBuf::from(format!("/run/{s}"));
            // Names that look like numbers, booleans or null stay strings.
            if s.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_') {
                c.services[0].name = s.to_owned();
            }
            let text = render(&c);
            let back = parse(&text, "x", &AnyInterface).unwrap_or_else(|e| panic!("{s:?}: {e}\n{text}"));
            assert_eq!(back, c, "{s:?}:\n{text}");
        }
    }

    #[test]
    fn golden_output() {
        let mut c = base();
        c.interfaces = vec!["eth0".into(), "eth1".into()];
        c.services[0].slow_start = Some(Duration::from_secs(10));
        c.services[0].health = HealthConfig {
            kind: ProbeKind::Http,
            interval: Duration::from_millis(500),
            timeout: Duration::from_millis(200),
            rise: 2,
            fall: 3,
            path: "/healthz".into(),
            expect: (200, 299),
            port: Some(9000),
            body: None,
        };
        c.services[0].backends[1].drain = true;
        let mut dns = svc("dns", "10.10.0.53", 53);
        dns.protocol = Protocol::Udp;
        dns.scheduler = Scheduler::SourceHash;
        dns.table_size = 251;
        dns.backends = vec![be("10.20.1.1", 53, 1)];
        dns.health.kind = ProbeKind::Tcp;
        dns.health.expect = (204, 204);
        c.services.push(dns);
        let want = "\
# lbd configuration.
# This file is maintained by lbd/lbctl: changes made through them rewrite it
# in this canonical form, and comments are not preserved.
interfaces:
- eth0
- eth1
xdp_mode: auto
forwarding: nat
control_socket: /run/lbd/lbd.sock
pin_path: /sys/fs/bpf/lbd
conntrack_max: 1048576
table_capacity: 4194304
maglev_seed: 0
tcp_idle_timeout: 900
udp_idle_timeout: 300
flood:
  new_flow_rate_per_cpu: auto
  half_open_timeout: 10
metrics_listen: 127.0.0.1:9464
services:
- name: web
  vip: 10.10.0.100
  port: 80
  protocol: tcp
  scheduler: maglev
  table_size: 65537
  slow_start: 10s
  health:
    type: http
    interval: 500ms
    timeout: 200ms
    rise: 2
    fall: 3
    path: /healthz
    expect: 200-299
    port: 9000
  backends:
  - address: 10.20.0.11
    port: 8080
    weight: 1
  - address: 10.20.0.12
    port: 8080
    weight: 2
    drain: true
- name: dns
  vip: 10.10.0.53
  port: 53
  protocol: udp
  scheduler: source-hash
  table_size: 251
  health:
    type: tcp
    interval: 2s
    timeout: 1s
    rise: 2
    fall: 3
    path: /
    expect: 204
  backends:
  - address: 10.20.1.1
    port: 53
    weight: 1
";
        assert_eq!(render(&c), want);
        assert_eq!(parse(want, "x", &AnyInterface).unwrap(), c);

        let mut empty = base();
        empty.services.clear();
        assert!(render(&empty).ends_with(
            "udp_idle_timeout: 300\nflood:\n  new_flow_rate_per_cpu: auto\n  half_open_timeout: 10\nmetrics_listen: 127.0.0.1:9464\nservices: []\n"
        ));
    }

    /// A fresh directory (tempfile's), removed on drop.
    struct TempDir(tempfile::TempDir);
    impl TempDir {
        fn new(tag: &str) -> Self {
            Self(tempfile::Builder::new().prefix(&format!("lbd-render-{tag}-")).tempdir().unwrap())
        }
        fn path(&self) -> &Path {
            self.0.path()
        }
        fn entries(&self) -> Vec<String> {
            let mut v: Vec<String> = fs::read_dir(self.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        }
    }

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn write_atomic_creates_and_replaces() {
        let dir = TempDir::new("replace");
        let path = dir.path().join("lbd.yaml");
        write_atomic(&path, "first\n").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "first\n");
        assert_eq!(mode(&path), 0o644);
        write_atomic(&path, "second, longer\n").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "second, longer\n");
        write_atomic(&path, "").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "");
        assert_eq!(dir.entries(), ["lbd.yaml"]);
    }

    #[test]
    fn write_atomic_keeps_mode() {
        let dir = TempDir::new("mode");
        let path = dir.path().join("lbd.yaml");
        fs::write(&path, "old\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let text = render(&base());
        write_atomic(&path, &text).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), text);
        assert_eq!(mode(&path), 0o600);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        write_atomic(&path, "again\n").unwrap();
        assert_eq!(mode(&path), 0o640);
        assert_eq!(dir.entries(), ["lbd.yaml"]);
    }

    #[test]
    fn write_atomic_replaces_a_symlinks_target() {
        let dir = TempDir::new("link");
        let real = dir.path().join("real.yaml");
        let link = dir.path().join("lbd.yaml");
        fs::write(&real, "old\n").unwrap();
        std::os::unix::fs::symlink("real.yaml", &link).unwrap();
        write_atomic(&link, "new\n").unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(fs::read_to_string(&real).unwrap(), "new\n");
        assert_eq!(dir.entries(), ["lbd.yaml", "real.yaml"]);
    }

    #[test]
    fn write_atomic_failure_leaves_nothing_behind() {
        let dir = TempDir::new("fail");
        // The target is a non-empty directory: the rename fails.
        let path = dir.path().join("taken");
        fs::create_dir(&path).unwrap();
        fs::write(path.join("inside"), "x").unwrap();
        assert!(write_atomic(&path, "text").is_err());
        assert_eq!(dir.entries(), ["taken"]);
        // A missing directory is an error, not a panic.
        assert!(write_atomic(&dir.path().join("missing/lbd.yaml"), "text").is_err());
    }

    use crate::config::tests::MIXED;

    #[test]
    fn ipv6_and_dsr_render_back_to_the_same_config() {
        let c = parse(MIXED, "lab.yaml", &AnyInterface).unwrap();
        let text = render(&c);
        assert!(text.contains("forwarding: dsr"), "{text}");
        assert_eq!(parse(&text, "rendered.yaml", &AnyInterface).unwrap(), c, "{text}");
    }

    #[test]
    fn the_global_forwarding_key_is_the_services_default() {
        let text = MIXED.replace("interfaces: [eth0, eth1]\n", "interfaces: [eth0, eth1]\nforwarding: dsr\n");
        let text =
            text.replace("      - { address: 10.20.0.11, port: 8080 }", "      - { address: 10.20.0.11, port: 80 }");
        let text = text.replace(
            "fd00:20::11\", port: 8080 }\n      - { address: \"fd00:20::12\", port: 8080, weight: 3 }",
            "fd00:20::11\" }\n      - { address: \"fd00:20::12\", weight: 3 }",
        );
        let c = parse(&text, "lab.yaml", &AnyInterface).unwrap();
        assert!(c.services.iter().all(|s| s.forwarding == Forwarding::Dsr));
        assert_eq!(parse(&render(&c), "rendered.yaml", &AnyInterface).unwrap(), c);
    }
}

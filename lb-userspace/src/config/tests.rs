//! Tests of parsing and validation.
use super::*;

struct Fake;
impl Environment for Fake {
    fn interface_exists(&self, name: &str) -> bool {
        name == "eth0" || name == "eth1"
    }
}

const GOOD: &str = r#"
interfaces: [eth0, eth1]
xdp_mode: auto
forwarding: nat
control_socket: /run/lbd/lbd.sock
conntrack_max: 1048576
services:
  - name: web
    vip: 10.10.0.100
    port: 80
    protocol: tcp
    backends:
      - { address: 10.20.0.11, port: 8080, weight: 1 }
      - { address: 10.20.0.12, port: 8080, weight: 2 }
"#;

fn problems(text: &str) -> Vec<Problem> {
    parse(text, "lab.yaml", &Fake).expect_err("config should be rejected").problems
}

fn only(text: &str) -> Problem {
    let p = problems(text);
    assert_eq!(p.len(), 1, "expected exactly one problem, got {p:#?}");
    p.into_iter().next().unwrap()
}

#[test]
fn good_config_parses_with_defaults() {
    let c = parse(GOOD, "lab.yaml", &Fake).unwrap();
    assert_eq!(c.interfaces, vec!["eth0", "eth1"]);
    assert_eq!(c.xdp_mode, XdpMode::Auto);
    assert_eq!(c.services.len(), 1);
    let s = &c.services[0];
    assert_eq!(s.scheduler, Scheduler::Maglev);
    assert_eq!(s.table_size, 65537);
    assert_eq!(
        s.backends[1],
        BackendConfig { address: "10.20.0.12".parse().unwrap(), port: 8080, weight: 2, drain: false }
    );
    assert_eq!(s.health.kind, ProbeKind::None);
    assert_eq!(s.slow_start, None);
    assert_eq!(c.pin_path, PathBuf::from(DEFAULT_PIN_PATH));
}

#[test]
fn unknown_key_is_named_with_its_path() {
    let p = only(&GOOD.replace("weight: 2", "wieght: 2"));
    assert_eq!(p.file, "lab.yaml");
    assert_eq!(p.field, "services[0].backends[1].wieght");
    assert!(p.reason.contains("unknown key"), "{p}");
}

#[test]
fn invalid_address_is_rejected() {
    let p = only(&GOOD.replace("10.20.0.12", "10.20.0.300"));
    assert_eq!(p.field, "services[0].backends[1].address");
    assert!(p.reason.contains("not an IPv4 or IPv6 address"), "{p}");
    let p = only(&GOOD.replace("vip: 10.10.0.100", "vip: 224.0.0.1"));
    assert_eq!(p.field, "services[0].vip");
}

#[test]
fn duplicate_vip_is_rejected() {
    let text = format!(
        "{GOOD}  - name: web2\n    vip: 10.10.0.100\n    port: 80\n    backends: [{{ address: 10.20.0.13, port: 80 }}]\n"
    );
    let p = only(&text);
    assert_eq!(p.field, "services[1].vip");
    assert!(p.reason.contains("duplicate VIP 10.10.0.100:80/tcp"), "{p}");
    // The same address and port over UDP is a different VIP.
    let udp = text.replace("    port: 80\n    backends: [", "    port: 80\n    protocol: udp\n    backends: [");
    parse(&udp, "lab.yaml", &Fake).unwrap();
}

#[test]
fn negative_and_non_numeric_weights_are_rejected() {
    let p = only(&GOOD.replace("weight: 2", "weight: -1"));
    assert_eq!(p.field, "services[0].backends[1].weight");
    assert!(p.reason.contains("negative"), "{p}");
    let p = only(&GOOD.replace("weight: 2", "weight: heavy"));
    assert_eq!(p.field, "services[0].backends[1].weight");
    assert!(p.reason.contains("the string \"heavy\""), "{p}");
    let p = only(&GOOD.replace("weight: 2", "weight: 70000"));
    assert!(p.reason.contains("out of range"), "{p}");
}

#[test]
fn missing_port_is_rejected() {
    let p = only(&GOOD.replace("    port: 80\n", ""));
    assert_eq!(p.field, "services[0].port");
    assert!(p.reason.contains("missing"), "{p}");
    let p = only(&GOOD.replace("10.20.0.12, port: 8080,", "10.20.0.12,"));
    assert_eq!(p.field, "services[0].backends[1].port");
}

#[test]
fn missing_interface_is_rejected() {
    let p = only(&GOOD.replace("[eth0, eth1]", "[eth0, eth9]"));
    assert_eq!(p.field, "interfaces[1]");
    assert!(p.reason.contains("no network interface named \"eth9\""), "{p}");
}

#[test]
fn every_problem_is_listed_at_once() {
    let text = GOOD
        .replace("[eth0, eth1]", "[eth0, eth7]")
        .replace("weight: 2", "weight: -3")
        .replace("xdp_mode: auto", "xdp_mode: turbo")
        .replace("    port: 80\n", "    port: 0\n");
    let p = problems(&text);
    let fields: Vec<_> = p.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, ["interfaces[1]", "xdp_mode", "services[0].port", "services[0].backends[1].weight"]);
    let shown = ConfigError { problems: p }.to_string();
    assert!(shown.lines().all(|l| l.starts_with("lab.yaml: ")), "{shown}");
}

#[test]
fn table_size_must_be_prime_and_schedulers_known() {
    let p = only(&GOOD.replace("protocol: tcp", "protocol: tcp\n    table_size: 65536"));
    assert_eq!(p.field, "services[0].table_size");
    let p = only(&GOOD.replace("protocol: tcp", "protocol: tcp\n    scheduler: random"));
    assert_eq!(p.field, "services[0].scheduler");
    let c = parse(&GOOD.replace("protocol: tcp", "protocol: tcp\n    scheduler: source-hash"), "f", &Fake).unwrap();
    assert_eq!(c.services[0].scheduler, Scheduler::SourceHash);
}

#[test]
fn health_slow_start_and_drain_parse_and_validate() {
    let text = GOOD.replace(
            "    protocol: tcp\n",
            "    protocol: tcp\n    slow_start: 10s\n    health: { type: http, interval: 500ms, timeout: 200ms, rise: 2, fall: 3, path: /healthz, expect: 200-299, port: 9000, body: \"status: ok\" }\n",
        )
        .replace("weight: 2 }", "weight: 2, drain: true }");
    let c = parse(&text, "f", &Fake).unwrap();
    let s = &c.services[0];
    assert_eq!(s.slow_start, Some(Duration::from_secs(10)));
    assert_eq!(s.health.kind, ProbeKind::Http);
    assert_eq!(s.health.interval, Duration::from_millis(500));
    assert_eq!(s.health.timeout, Duration::from_millis(200));
    assert_eq!((s.health.rise, s.health.fall), (2, 3));
    assert_eq!(s.health.path, "/healthz");
    assert_eq!(s.health.expect, (200, 299));
    assert_eq!(s.health.port, Some(9000));
    assert_eq!(s.health.body.as_deref(), Some("status: ok"));
    assert!(s.backends[1].drain);
    assert_eq!(s.backends[1].admin_weight(), 0);

    let bad = GOOD.replace(
        "    protocol: tcp\n",
        "    protocol: tcp\n    slow_start: soon\n    health: { type: ping, interval: 1s, timeout: 2s, expect: 700 }\n",
    );
    let fields: Vec<String> = problems(&bad).into_iter().map(|p| p.field).collect();
    assert_eq!(fields, ["services[0].health.type", "services[0].health.expect", "services[0].slow_start"],);
    let p =
        only(&GOOD.replace(
            "    protocol: tcp\n",
            "    protocol: tcp\n    health: { type: tcp, interval: 1s, timeout: 2s }\n",
        ));
    assert_eq!(p.field, "services[0].health.timeout");
    let p = only(&GOOD.replace("    protocol: tcp\n", "    protocol: tcp\n    health: { type: tcp, body: ok }\n"));
    assert_eq!((p.field.as_str(), p.reason.as_str()), ("services[0].health.body", "a body check needs type: http"));
    // A UDP service's own idle timeout; refused on a TCP service.
    let c = parse(&GOOD.replace("    protocol: tcp\n", "    protocol: udp\n    udp_idle_timeout: 30\n"), "f", &Fake)
        .unwrap();
    assert_eq!(c.services[0].udp_idle_timeout, Some(30));
    let p = only(&GOOD.replace("    protocol: tcp\n", "    protocol: tcp\n    udp_idle_timeout: 30\n"));
    assert_eq!((p.field.as_str(), p.reason.as_str()), ("services[0].udp_idle_timeout", "applies to udp services only"));
}

#[test]
fn durations_and_status_ranges() {
    assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
    assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
    assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
    assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
    assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
    assert_eq!(parse_duration("-1s"), None);
    assert_eq!(parse_duration("fast"), None);
    assert_eq!(parse_status_range("200-399"), Some((200, 399)));
    assert_eq!(parse_status_range("204"), Some((204, 204)));
    assert_eq!(parse_status_range("399-200"), None);
    assert_eq!(parse_status_range("99"), None);
}

#[test]
fn not_yaml_is_reported_with_location() {
    let p = only("interfaces: [eth0\nservices: {");
    assert_eq!(p.file, "lab.yaml");
    assert!(p.reason.starts_with("not valid YAML"), "{p}");
}

/// IPv4, IPv6 and DSR services in one file (also rendered back in `render`).
pub(crate) const MIXED: &str = r#"
interfaces: [eth0, eth1]
services:
  - name: web
    vip: 10.10.0.100
    port: 80
    backends:
      - { address: 10.20.0.11, port: 8080 }
  - name: web6
    vip: "fd00:10::100"
    port: 80
    backends:
      - { address: "fd00:20::11", port: 8080 }
      - { address: "fd00:20::12", port: 8080, weight: 3 }
  - name: dsr6
    vip: "fd00:10::10a"
    port: 8080
    forwarding: dsr
    backends:
      - { address: "fd00:20::11" }
      - { address: "fd00:20::12", port: 8080 }
"#;

#[test]
fn ipv6_and_dsr_services_parse_beside_ipv4_ones() {
    let c = parse(MIXED, "lab.yaml", &Fake).unwrap();
    let [web, web6, dsr6] = &c.services[..] else { panic!("three services") };
    assert_eq!((web.vip.is_ipv4(), web.forwarding), (true, Forwarding::Nat));
    assert_eq!(web6.vip, "fd00:10::100".parse::<IpAddr>().unwrap());
    assert_eq!(web6.backends[1].address, "fd00:20::12".parse::<IpAddr>().unwrap());
    assert_eq!(web6.backends[1].weight, 3);
    assert_eq!(dsr6.forwarding, Forwarding::Dsr);
    // A DSR backend without a port takes the service's.
    assert_eq!(dsr6.backends[0].port, 8080);
}

#[test]
fn a_service_is_one_address_family() {
    let p = only(&MIXED.replace(r#""fd00:20::11", port: 8080 }"#, "10.20.0.11, port: 8080 }"));
    assert_eq!(p.field, "services[1].backends[0].address");
    assert!(p.reason.contains("address family"), "{p}");
}

#[test]
fn dsr_cannot_translate_ports() {
    let p = only(&MIXED.replace(r#""fd00:20::12", port: 8080 }"#, r#""fd00:20::12", port: 9090 }"#));
    assert_eq!(p.field, "services[2].backends[1].port");
    assert!(p.reason.contains("cannot translate ports"), "{p}");
    // Without DSR the same port is required as ever.
    let p = only(&MIXED.replace("    forwarding: dsr\n", ""));
    assert_eq!(p.field, "services[2].backends[0].port");
}

#[test]
fn unusable_ipv6_addresses_are_refused() {
    for (bad, why) in [("fe80::1", "link-local"), ("ff02::1", "unicast"), ("::", "unicast"), ("::1", "unicast")] {
        let p = only(&MIXED.replace("fd00:10::100", bad));
        assert_eq!(p.field, "services[1].vip");
        assert!(p.reason.contains(why), "{bad}: {p}");
    }
    // An unknown forwarding (and so no DSR port default for the backend
    // that names none).
    let p = problems(&MIXED.replace("forwarding: dsr", "forwarding: tunnel"));
    assert_eq!(p[0].field, "services[2].forwarding");
    assert!(p[0].reason.contains("not one of nat, dsr"), "{}", p[0]);
}

#[test]
fn ipv6_vips_and_backends_are_compared_as_addresses_not_text() {
    // The same VIP written two ways is one VIP.
    let text = format!(
        "{MIXED}  - name: web6b\n    vip: \"fd00:10:0:0::100\"\n    port: 80\n    backends: [{{ address: \"fd00:20::13\", port: 80 }}]\n"
    );
    let p = only(&text);
    assert_eq!(p.field, "services[3].vip");
    assert!(p.reason.contains("duplicate VIP [fd00:10::100]:80/tcp"), "{p}");
    // The same backend written two ways is listed twice.
    let p =
        only(&MIXED.replace(r#""fd00:20::12", port: 8080, weight: 3"#, r#""FD00:20:0::11", port: 8080, weight: 3"#));
    assert_eq!(p.field, "services[1].backends[1]");
    assert!(p.reason.contains("backend [fd00:20::11]:8080 is listed twice"), "{p}");
    // An IPv4 and an IPv6 service at the same port and protocol are two
    // VIPs.
    let c = parse(MIXED, "lab.yaml", &Fake).unwrap();
    assert_eq!((c.services[0].port, c.services[1].port), (80, 80));
}

#[test]
fn every_family_and_dsr_problem_is_reported_at_once() {
    let text = MIXED
        .replace(r#""fd00:20::11", port: 8080 }"#, "10.20.0.11, port: 8080 }")
        .replace(r#""fd00:20::12", port: 8080 }"#, r#""fd00:20::12", port: 9090 }"#);
    let p = problems(&text);
    let fields: Vec<&str> = p.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, ["services[1].backends[0].address", "services[2].backends[1].port"], "{p:#?}");
}

#[test]
fn maglev_seed_is_any_u64_and_defaults_to_0() {
    assert_eq!(parse(GOOD, "lab.yaml", &Fake).unwrap().maglev_seed, 0);
    for (text, want) in [("0", 0), ("42", 42), ("18446744073709551615", u64::MAX)] {
        let c = parse(&format!("maglev_seed: {text}\n{GOOD}"), "lab.yaml", &Fake).unwrap();
        assert_eq!(c.maglev_seed, want, "{text}");
    }
    let p = only(&format!("maglev_seed: -1\n{GOOD}"));
    assert_eq!(p.field, "maglev_seed");
    assert!(p.reason.contains("-1 is negative"), "{p}");
    let p = only(&format!("maglev_seed: \"ecmp\"\n{GOOD}"));
    assert_eq!(p.field, "maglev_seed");
    assert!(p.reason.contains("expected a whole number") && p.reason.contains("the string \"ecmp\""), "{p}");
    let p = only(&format!("maglev_seed: 1.5\n{GOOD}"));
    assert_eq!(p.field, "maglev_seed");
    assert!(p.reason.contains("the number 1.5"), "{p}");
    // One past u64::MAX: the YAML reader refuses it, naming the key.
    let p = only(&format!("maglev_seed: 18446744073709551616\n{GOOD}"));
    assert!(p.reason.contains("maglev_seed") && p.reason.contains("18446744073709551616"), "{p}");
}

const BGP: &str = r#"bgp:
  local_asn: 65001
  router_id: 10.40.1.2
  peers:
    - { address: 10.40.1.1, asn: 65000 }
    - { address: "fd00:40::1", asn: 4200000000 }
"#;

#[test]
fn bgp_section_parses_with_defaults() {
    let c = parse(&format!("{BGP}{GOOD}"), "lab.yaml", &Fake).unwrap();
    let b = c.bgp.as_ref().expect("bgp section");
    assert_eq!((b.local_asn, b.router_id), (65001, "10.40.1.2".parse().unwrap()));
    assert_eq!(b.peers[1], BgpPeer { address: "fd00:40::1".parse().unwrap(), asn: 4_200_000_000 });
    assert_eq!((b.next_hop, b.med, b.hold_time), (None, None, DEFAULT_BGP_HOLD_TIME));
    assert!(b.communities.is_empty());
    assert_eq!(b.daemon, PathBuf::from(DEFAULT_BGP_DAEMON));
    assert_eq!(parse(GOOD, "lab.yaml", &Fake).unwrap().bgp, None);
    let full = format!(
        "{BGP}  next_hop: 10.40.1.2\n  communities: [\"65001:100\", \"65001:7\"]\n  med: 20\n  hold_time: 9\n  daemon: /opt/bird/sbin/bird\n{GOOD}"
    );
    let c = parse(&full, "lab.yaml", &Fake).unwrap();
    let b = c.bgp.as_ref().unwrap();
    assert_eq!((b.med, b.hold_time, b.communities.len()), (Some(20), 9, 2));
    assert_eq!(b.next_hop, Some("10.40.1.2".parse().unwrap()));
}

#[test]
fn bgp_problems_are_named_by_field() {
    let cases: &[(&str, &str, &str)] = &[
        ("local_asn: 65001", "local_asn: 0", "bgp.local_asn"),
        ("router_id: 10.40.1.2", "router_id: \"fd00::1\"", "bgp.router_id"),
        ("asn: 65000 }", "asn: -3 }", "bgp.peers[0].asn"),
        ("{ address: 10.40.1.1,", "{ address: nowhere,", "bgp.peers[0].address"),
    ];
    for (from, to, field) in cases {
        let p = only(&format!("{}{GOOD}", BGP.replace(from, to)));
        assert_eq!(p.field, *field, "{p}");
    }
    let p = only(&format!("{BGP}  communities: [\"65001:70000\"]\n{GOOD}"));
    assert_eq!(p.field, "bgp.communities[0]");
    assert!(p.reason.contains("0 to 65535"), "{p}");
    let p = only(&format!("{BGP}  hold_time: 2\n{GOOD}"));
    assert_eq!(p.field, "bgp.hold_time");
    let p = only(&format!("{BGP}  nexthop: 10.40.1.2\n{GOOD}"));
    assert_eq!(p.field, "bgp.nexthop");
    assert!(p.reason.contains("unknown key"), "{p}");
    let p = only(&format!("bgp:\n  local_asn: 65001\n  router_id: 10.40.1.2\n  peers: []\n{GOOD}"));
    assert_eq!(p.field, "bgp.peers");
    let twice = BGP.replace("fd00:40::1", "10.40.1.1");
    let p = only(&format!("{twice}{GOOD}"));
    assert_eq!(p.field, "bgp.peers[1].address");
    assert!(p.reason.contains("listed twice"), "{p}");
}

#[test]
fn the_ipv6_flow_table_is_sized_by_conntrack_max_unless_conntrack_max_ipv6_says_otherwise() {
    let c = parse(GOOD, "lab.yaml", &Fake).unwrap();
    assert_eq!(c.conntrack_max_ipv6, c.conntrack_max, "the default follows conntrack_max");
    let small = GOOD.replace("conntrack_max: 1048576", "conntrack_max: 1048576\nconntrack_max_ipv6: 1024");
    let c2 = parse(&small, "lab.yaml", &Fake).unwrap();
    assert_eq!((c2.conntrack_max, c2.conntrack_max_ipv6), (1_048_576, 1024));
    assert_eq!(c.restart_only_changes(&c2), vec!["conntrack_max_ipv6"], "sized at start only");
    let p = only(&GOOD.replace("conntrack_max: 1048576", "conntrack_max: 1048576\nconntrack_max_ipv6: 0"));
    assert_eq!(p.field, "conntrack_max_ipv6");
}

/// A config of `services` services on ports 1000.., with `backends`
/// backends (distinct endpoints) spread over them, and a table capacity
/// that fits them all.
fn sized(services: usize, backends: usize) -> String {
    let mut text = String::from(
        "interfaces: [eth0, eth1]\ncontrol_socket: /run/lbd/lbd.sock\ntable_capacity: 40000000\nservices:\n",
    );
    for i in 0..services {
        text.push_str(&format!("  - name: s{i}\n    vip: 10.10.0.100\n    port: {}\n    backends:\n", 1000 + i));
        for n in (i..backends).step_by(services) {
            text.push_str(&format!("      - {{ address: 10.20.{}.{}, port: 8080 }}\n", n / 250, 1 + n % 250));
        }
    }
    text
}

#[test]
fn the_service_and_backend_limits_are_the_ids_there_are() {
    // Ids 1 to 255 (services) and 1 to 4095 (backends): 0 means none.
    let c = parse(&sized(255, 4095), "f", &Fake).unwrap();
    assert_eq!((c.services.len(), c.services.iter().map(|s| s.backends.len()).sum::<usize>()), (255, 4095));
    let p = only(&sized(256, 256));
    assert_eq!((p.field.as_str(), p.reason.as_str()), ("services", "256 services; at most 255 are supported"));
    let p = only(&sized(255, 4096));
    assert_eq!((p.field.as_str(), p.reason.as_str()), ("services", "4096 backends in all; at most 4095 are supported"));
}

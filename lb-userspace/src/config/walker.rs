//! The validating reader of the configuration: walks the YAML value tree
//! and collects every problem at once, each with its field path
//! (`services[0].backends[2].weight`) and what was wrong.
//!
//! Hand-written rather than derived with serde: a derive stops at the first
//! error and names neither every problem nor the field path the way an
//! operator needs; the unknown-key check and the duration parser are part
//! of that, so they are ours too.
use super::*;

pub(super) struct Walker<'a> {
    pub(super) file: &'a str,
    pub(super) problems: Vec<Problem>,
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "nothing (null)".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

impl Walker<'_> {
    pub(super) fn problem(&mut self, field: &str, reason: String) {
        self.problems.push(Problem { file: self.file.to_owned(), field: field.to_owned(), reason });
    }

    /// The mapping at `path`, with every key not in `known` reported.
    fn mapping<'v>(&mut self, v: &'v Value, path: &str, known: &[&str]) -> Option<&'v Mapping> {
        let Value::Mapping(m) = v else {
            self.problem(path, format!("expected a mapping, found {}", describe(v)));
            return None;
        };
        for k in m.keys() {
            match k.as_str() {
                Some(k) if known.contains(&k) => {}
                Some(k) => {
                    let field = if path.is_empty() { k.to_owned() } else { format!("{path}.{k}") };
                    self.problem(&field, format!("unknown key (known keys: {})", known.join(", ")));
                }
                None => self.problem(path, format!("key {} is not a string", describe(k))),
            }
        }
        Some(m)
    }

    fn field(path: &str, key: &str) -> String {
        if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") }
    }

    fn uint(&mut self, v: &Value, field: &str, min: u64, max: u64) -> Option<u64> {
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            Some(n) => {
                self.problem(field, format!("{n} is out of range ({min} to {max})"));
                None
            }
            None => {
                if let Some(n) = v.as_i64() {
                    self.problem(field, format!("{n} is negative; expected a whole number from {min} to {max}"));
                } else {
                    self.problem(field, format!("expected a whole number from {min} to {max}, found {}", describe(v)));
                }
                None
            }
        }
    }

    fn string<'v>(&mut self, v: &'v Value, field: &str) -> Option<&'v str> {
        match v.as_str() {
            Some(s) => Some(s),
            None => {
                self.problem(field, format!("expected a string, found {}", describe(v)));
                None
            }
        }
    }

    /// A unicast IPv4 or IPv6 address. IPv6 link-local addresses are
    /// refused: they mean nothing without an interface, and the datapath's
    /// FIB lookups have none to give.
    fn ip(&mut self, v: &Value, field: &str) -> Option<IpAddr> {
        let s = self.string(v, field)?;
        match s.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) if a.is_unspecified() || a.is_broadcast() || a.is_multicast() => {
                self.problem(field, format!("{s} is not a unicast address"));
                None
            }
            Ok(IpAddr::V6(a)) if a.is_unspecified() || a.is_multicast() || a.is_loopback() => {
                self.problem(field, format!("{s} is not a unicast address"));
                None
            }
            Ok(IpAddr::V6(a)) if a.is_unicast_link_local() => {
                self.problem(field, format!("{s} is link-local; use a global or unique-local address"));
                None
            }
            Ok(a) => Some(a),
            Err(_) => {
                self.problem(field, format!("{s:?} is not an IPv4 or IPv6 address"));
                None
            }
        }
    }

    fn forwarding(&mut self, v: &Value, field: &str) -> Option<Forwarding> {
        match self.string(v, field)? {
            "nat" => Some(Forwarding::Nat),
            "dsr" => Some(Forwarding::Dsr),
            other => {
                self.problem(field, format!("{other:?} is not one of nat, dsr"));
                None
            }
        }
    }

    fn required<'v>(&mut self, m: &'v Mapping, path: &str, key: &str) -> Option<&'v Value> {
        let v = m.get(key);
        if v.is_none() {
            self.problem(&Self::field(path, key), "missing (required)".into());
        }
        v
    }

    pub(super) fn config(&mut self, root: &Value, env: &dyn Environment) -> Option<Config> {
        const KEYS: &[&str] = &[
            "interfaces",
            "xdp_mode",
            "forwarding",
            "control_socket",
            "pin_path",
            "conntrack_max",
            "conntrack_max_ipv6",
            "table_capacity",
            "maglev_seed",
            "tcp_idle_timeout",
            "udp_idle_timeout",
            "flood",
            "metrics_listen",
            "bgp",
            "services",
        ];
        let m = self.mapping(root, "", KEYS)?;

        let mut interfaces = Vec::new();
        if let Some(v) = self.required(m, "", "interfaces") {
            match v.as_sequence() {
                Some(seq) if !seq.is_empty() => {
                    for (i, item) in seq.iter().enumerate() {
                        let field = format!("interfaces[{i}]");
                        let Some(name) = self.string(item, &field) else { continue };
                        if interfaces.iter().any(|n: &String| n == name) {
                            self.problem(&field, format!("interface {name} is listed twice"));
                        } else if !env.interface_exists(name) {
                            self.problem(&field, format!("no network interface named {name:?} exists"));
                        } else {
                            interfaces.push(name.to_owned());
                        }
                    }
                }
                Some(_) => self.problem("interfaces", "the list is empty; name at least one interface".into()),
                None => {
                    self.problem("interfaces", format!("expected a list of interface names, found {}", describe(v)));
                }
            }
        }

        let xdp_mode = match m.get("xdp_mode") {
            None => XdpMode::Auto,
            Some(v) => match self.string(v, "xdp_mode") {
                Some("native") => XdpMode::Native,
                Some("generic") => XdpMode::Generic,
                Some("auto") => XdpMode::Auto,
                Some(other) => {
                    self.problem("xdp_mode", format!("{other:?} is not one of native, generic, auto"));
                    XdpMode::Auto
                }
                None => XdpMode::Auto,
            },
        };

        // The services' default; each may say otherwise.
        let forwarding = match m.get("forwarding") {
            Some(v) => self.forwarding(v, "forwarding").unwrap_or_default(),
            None => Forwarding::Nat,
        };

        let control_socket = match m.get("control_socket") {
            None => PathBuf::from(DEFAULT_CONTROL_SOCKET),
            Some(v) => match self.string(v, "control_socket") {
                Some(s) if s.starts_with('/') => PathBuf::from(s),
                Some(s) => {
                    self.problem("control_socket", format!("{s:?} is not an absolute path"));
                    PathBuf::new()
                }
                None => PathBuf::new(),
            },
        };

        let pin_path = match m.get("pin_path") {
            None => PathBuf::from(DEFAULT_PIN_PATH),
            Some(v) => match self.string(v, "pin_path") {
                Some(s) if s.starts_with('/') && s.len() > 1 => PathBuf::from(s.trim_end_matches('/')),
                Some(s) => {
                    self.problem("pin_path", format!("{s:?} is not an absolute directory path"));
                    PathBuf::new()
                }
                None => PathBuf::new(),
            },
        };

        let conntrack_max = match m.get("conntrack_max") {
            None => DEFAULT_CONNTRACK_MAX,
            Some(v) => self.uint(v, "conntrack_max", 1, u64::from(MAX_CONNTRACK)).unwrap_or(1) as u32,
        };
        let conntrack_max_ipv6 = match m.get("conntrack_max_ipv6") {
            None => conntrack_max,
            Some(v) => self.uint(v, "conntrack_max_ipv6", 1, u64::from(MAX_CONNTRACK)).unwrap_or(1) as u32,
        };
        let table_capacity = match m.get("table_capacity") {
            None => DEFAULT_TABLE_CAPACITY,
            Some(v) => self.uint(v, "table_capacity", 1024, 1 << 26).unwrap_or(1024) as u32,
        };
        // Any 64-bit value; nodes behind one ECMP route need the same one.
        let maglev_seed = match m.get("maglev_seed") {
            None => 0,
            Some(v) => self.uint(v, "maglev_seed", 0, u64::MAX).unwrap_or(0),
        };

        let tcp_idle_timeout = match m.get("tcp_idle_timeout") {
            None => DEFAULT_TCP_IDLE_TIMEOUT,
            Some(v) => self.uint(v, "tcp_idle_timeout", 10, 86_400 * 7).unwrap_or(10) as u32,
        };
        let udp_idle_timeout = match m.get("udp_idle_timeout") {
            None => DEFAULT_UDP_IDLE_TIMEOUT,
            Some(v) => self.uint(v, "udp_idle_timeout", 10, 86_400 * 7).unwrap_or(10) as u32,
        };

        let flood = match m.get("flood") {
            None | Some(Value::Null) => FloodConfig::default(),
            Some(v) => self.flood(v),
        };

        let metrics_listen = match m.get("metrics_listen") {
            None => DEFAULT_METRICS_LISTEN.parse().expect("valid default"),
            Some(v) => match self.string(v, "metrics_listen") {
                Some(s) => match s.parse::<std::net::SocketAddr>() {
                    Ok(a) => a,
                    Err(_) => {
                        self.problem("metrics_listen", format!("{s:?} is not ADDRESS:PORT"));
                        DEFAULT_METRICS_LISTEN.parse().expect("valid default")
                    }
                },
                None => DEFAULT_METRICS_LISTEN.parse().expect("valid default"),
            },
        };

        let bgp = match m.get("bgp") {
            None | Some(Value::Null) => None,
            Some(v) => self.bgp(v),
        };

        let mut services = Vec::new();
        match m.get("services") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(seq)) => {
                for (i, s) in seq.iter().enumerate() {
                    if let Some(svc) = self.service(s, &format!("services[{i}]"), forwarding) {
                        services.push((i, svc));
                    }
                }
            }
            Some(v) => self.problem("services", format!("expected a list of services, found {}", describe(v))),
        }
        self.cross_service(&services, table_capacity);

        Some(Config {
            interfaces,
            xdp_mode,
            control_socket,
            pin_path,
            conntrack_max,
            conntrack_max_ipv6,
            table_capacity,
            maglev_seed,
            tcp_idle_timeout,
            udp_idle_timeout,
            flood,
            metrics_listen,
            bgp,
            services: services.into_iter().map(|(_, s)| s).collect(),
        })
    }

    /// The `bgp:` section.
    fn bgp(&mut self, v: &Value) -> Option<BgpConfig> {
        const KEYS: &[&str] =
            &["local_asn", "router_id", "peers", "next_hop", "communities", "med", "hold_time", "daemon"];
        let m = self.mapping(v, "bgp", KEYS)?;
        let before = self.problems.len();
        // 4-byte ASNs; 0 and 4294967295 are reserved (RFC 7607, RFC 7300).
        let asn = |w: &mut Self, v: &Value, field: &str| w.uint(v, field, 1, 4_294_967_294).map(|n| n as u32);
        let local_asn = self.required(m, "bgp", "local_asn").and_then(|v| asn(self, v, "bgp.local_asn"));
        let router_id = self.required(m, "bgp", "router_id").and_then(|v| match self.ip(v, "bgp.router_id")? {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(a) => {
                self.problem("bgp.router_id", format!("{a} is IPv6; a router id is an IPv4 address"));
                None
            }
        });
        let mut peers = Vec::new();
        match self.required(m, "bgp", "peers") {
            None => {}
            Some(Value::Sequence(seq)) if !seq.is_empty() => {
                for (i, p) in seq.iter().enumerate() {
                    let path = format!("bgp.peers[{i}]");
                    let Some(pm) = self.mapping(p, &path, &["address", "asn"]) else { continue };
                    let address =
                        self.required(pm, &path, "address").and_then(|v| self.ip(v, &Self::field(&path, "address")));
                    let peer_asn =
                        self.required(pm, &path, "asn").and_then(|v| asn(self, v, &Self::field(&path, "asn")));
                    if let (Some(address), Some(asn)) = (address, peer_asn) {
                        if peers.iter().any(|p: &BgpPeer| p.address == address) {
                            self.problem(&Self::field(&path, "address"), format!("peer {address} is listed twice"));
                        }
                        peers.push(BgpPeer { address, asn });
                    }
                }
            }
            Some(v) => self.problem(
                "bgp.peers",
                format!("expected a non-empty list of {{ address, asn }}, found {}", describe(v)),
            ),
        }
        let next_hop = m.get("next_hop").and_then(|v| self.ip(v, "bgp.next_hop"));
        let mut communities = Vec::new();
        match m.get("communities") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(seq)) => {
                for (i, c) in seq.iter().enumerate() {
                    let field = format!("bgp.communities[{i}]");
                    let text = match c {
                        Value::String(s) => s.clone(),
                        other => {
                            self.problem(
                                &field,
                                format!("expected ASN:VALUE (e.g. \"65001:100\"), found {}", describe(other)),
                            );
                            continue;
                        }
                    };
                    let ok =
                        text.split_once(':').is_some_and(|(a, b)| a.parse::<u16>().is_ok() && b.parse::<u16>().is_ok());
                    if ok {
                        communities.push(text);
                    } else {
                        self.problem(
                            &field,
                            format!("{text:?} is not a standard community ASN:VALUE, each 0 to 65535"),
                        );
                    }
                }
            }
            Some(v) => self.problem("bgp.communities", format!("expected a list of ASN:VALUE, found {}", describe(v))),
        }
        let med = m.get("med").and_then(|v| self.uint(v, "bgp.med", 0, u64::from(u32::MAX))).map(|n| n as u32);
        let hold_time = match m.get("hold_time") {
            None => DEFAULT_BGP_HOLD_TIME,
            Some(v) => self.uint(v, "bgp.hold_time", 3, 65_535).unwrap_or(u64::from(DEFAULT_BGP_HOLD_TIME)) as u32,
        };
        let daemon = match m.get("daemon") {
            None => PathBuf::from(DEFAULT_BGP_DAEMON),
            Some(v) => match self.string(v, "bgp.daemon") {
                Some(s) if s.starts_with('/') => PathBuf::from(s),
                Some(s) => {
                    self.problem("bgp.daemon", format!("{s:?} is not an absolute path to the BIRD binary"));
                    PathBuf::new()
                }
                None => PathBuf::new(),
            },
        };
        if let Some(nh) = next_hop
            && !peers.is_empty()
            && !peers.iter().any(|p| p.address.is_ipv4() == nh.is_ipv4())
        {
            self.problem("bgp.next_hop", format!("{nh} is of a family no peer has"));
        }
        if self.problems.len() != before {
            return None;
        }
        Some(BgpConfig {
            local_asn: local_asn?,
            router_id: router_id?,
            peers,
            next_hop,
            communities,
            med,
            hold_time,
            daemon,
        })
    }

    fn flood(&mut self, v: &Value) -> FloodConfig {
        let mut f = FloodConfig::default();
        let Some(m) = self.mapping(v, "flood", &["new_flow_rate_per_cpu", "half_open_timeout"]) else { return f };
        match m.get("new_flow_rate_per_cpu") {
            None => {}
            Some(Value::String(s)) if s == "auto" => {}
            Some(v @ Value::Number(_)) => {
                f.new_flow_rate_per_cpu =
                    self.uint(v, "flood.new_flow_rate_per_cpu", 0, u64::from(u32::MAX)).map(|n| n as u32);
            }
            Some(v) => self.problem(
                "flood.new_flow_rate_per_cpu",
                format!("expected auto or a number of new flows per second (0: no limit), found {}", describe(v)),
            ),
        }
        if let Some(v) = m.get("half_open_timeout") {
            f.half_open_timeout = self.uint(v, "flood.half_open_timeout", 1, 3600).unwrap_or(1) as u32;
        }
        f
    }

    fn service(&mut self, v: &Value, path: &str, default_forwarding: Forwarding) -> Option<ServiceConfig> {
        const KEYS: &[&str] = &[
            "name",
            "vip",
            "port",
            "protocol",
            "forwarding",
            "scheduler",
            "table_size",
            "health",
            "slow_start",
            "udp_idle_timeout",
            "backends",
        ];
        let m = self.mapping(v, path, KEYS)?;
        let before = self.problems.len();

        let name = self.required(m, path, "name").and_then(|v| self.string(v, &Self::field(path, "name")));
        if let Some(n) = name
            && (n.is_empty() || n.len() > 64 || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            self.problem(
                &Self::field(path, "name"),
                format!("{n:?} is not a valid name (1-64 letters, digits, '-' or '_')"),
            );
        }
        let vip = self.required(m, path, "vip").and_then(|v| self.ip(v, &Self::field(path, "vip")));
        let port = self.required(m, path, "port").and_then(|v| self.uint(v, &Self::field(path, "port"), 1, 65535));
        let forwarding = match m.get("forwarding") {
            None => Some(default_forwarding),
            Some(v) => self.forwarding(v, &Self::field(path, "forwarding")),
        };
        // DSR cannot translate ports: a backend's port is the service's
        // (and may be left out).
        let dsr_port = (forwarding == Some(Forwarding::Dsr)).then_some(port).flatten().map(|p| p as u16);
        let protocol = match m.get("protocol") {
            None => Some(Protocol::Tcp),
            Some(v) => match self.string(v, &Self::field(path, "protocol")) {
                Some("tcp") => Some(Protocol::Tcp),
                Some("udp") => Some(Protocol::Udp),
                Some(o) => {
                    self.problem(&Self::field(path, "protocol"), format!("{o:?} is not one of tcp, udp"));
                    None
                }
                None => None,
            },
        };
        let scheduler = match m.get("scheduler") {
            None => Some(Scheduler::default()),
            Some(v) => match self.string(v, &Self::field(path, "scheduler")) {
                Some(s) => match Scheduler::parse(s) {
                    Some(s) => Some(s),
                    None => {
                        self.problem(
                            &Self::field(path, "scheduler"),
                            format!("{s:?} is not one of {}", Scheduler::names()),
                        );
                        None
                    }
                },
                None => None,
            },
        };
        let table_size = match m.get("table_size") {
            None => Some(maglev::DEFAULT_TABLE_SIZE),
            Some(v) => {
                let field = Self::field(path, "table_size");
                match self.uint(v, &field, 3, 16_777_259) {
                    Some(n) if maglev::is_prime(n as u32) => Some(n as u32),
                    Some(n) => {
                        self.problem(&field, format!("{n} is not a prime number (Maglev needs a prime table size)"));
                        None
                    }
                    None => None,
                }
            }
        };

        let health = match m.get("health") {
            None => Some(HealthConfig::default()),
            Some(v) => self.health(v, &Self::field(path, "health")),
        };
        let slow_start = match m.get("slow_start") {
            None => Some(None),
            Some(v) => self
                .duration(v, &Self::field(path, "slow_start"), Duration::ZERO, Duration::from_secs(3600))
                .map(|d| if d.is_zero() { None } else { Some(d) }),
        };
        let udp_idle_timeout = match m.get("udp_idle_timeout") {
            None => Some(None),
            Some(_) if protocol.is_some_and(|p| p != Protocol::Udp) => {
                self.problem(&Self::field(path, "udp_idle_timeout"), "applies to udp services only".into());
                None
            }
            Some(v) => self.uint(v, &Self::field(path, "udp_idle_timeout"), 10, 86_400 * 7).map(|n| Some(n as u32)),
        };

        let mut backends = Vec::new();
        let bpath = Self::field(path, "backends");
        match m.get("backends") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(seq)) => {
                for (i, b) in seq.iter().enumerate() {
                    let field = format!("{bpath}[{i}]");
                    if let Some(b) = self.backend(b, &field, dsr_port) {
                        if let Some(vip) = vip
                            && vip.is_ipv4() != b.address.is_ipv4()
                        {
                            self.problem(
                                &format!("{field}.address"),
                                format!(
                                    "{} is not of the VIP's address family ({vip}): a service is all IPv4 or all IPv6",
                                    b.address
                                ),
                            );
                        }
                        if let Some(p) = dsr_port
                            && b.port != p
                        {
                            self.problem(
                                &format!("{field}.port"),
                                format!("{} differs from the service's port {p}: direct server return cannot translate ports", b.port),
                            );
                        }
                        if backends.iter().any(|o: &BackendConfig| o.address == b.address && o.port == b.port) {
                            self.problem(
                                &field,
                                format!("backend {} is listed twice", std::net::SocketAddr::new(b.address, b.port)),
                            );
                        } else {
                            backends.push(b);
                        }
                    }
                }
            }
            Some(v) => self.problem(&bpath, format!("expected a list of backends, found {}", describe(v))),
        }
        if let Some(scheduler) = scheduler {
            let weights: Vec<u32> = backends.iter().map(|b| b.weight).collect();
            // A table_size already refused is not judged again.
            let table_size = table_size.unwrap_or(u32::MAX);
            let measures_response = health.as_ref().is_some_and(|h| h.kind == ProbeKind::Http);
            for p in scheduler.validate(&Pool { table_size, weights: &weights, measures_response }) {
                self.problem(&Self::field(path, p.field), p.message);
            }
        }
        if self.problems.len() != before {
            return None;
        }
        Some(ServiceConfig {
            name: name?.to_owned(),
            vip: vip?,
            port: port? as u16,
            protocol: protocol?,
            forwarding: forwarding?,
            scheduler: scheduler?,
            table_size: table_size?,
            health: health?,
            slow_start: slow_start?,
            udp_idle_timeout: udp_idle_timeout?,
            backends,
        })
    }

    /// A duration: a number with a unit (`500ms`, `2s`, `1m`) or a bare
    /// number of seconds.
    fn duration(&mut self, v: &Value, field: &str, min: Duration, max: Duration) -> Option<Duration> {
        let d = match v {
            Value::Number(n) => n.as_u64().map(Duration::from_secs),
            Value::String(s) => parse_duration(s),
            _ => None,
        };
        match d {
            Some(d) if d >= min && d <= max => Some(d),
            Some(d) => {
                self.problem(field, format!("{d:?} is out of range ({min:?} to {max:?})"));
                None
            }
            None => {
                self.problem(field, format!("expected a duration such as 500ms, 2s or 1m, found {}", describe(v)));
                None
            }
        }
    }

    fn health(&mut self, v: &Value, path: &str) -> Option<HealthConfig> {
        let m =
            self.mapping(v, path, &["type", "interval", "timeout", "rise", "fall", "path", "expect", "port", "body"])?;
        let before = self.problems.len();
        let mut h = HealthConfig::default();
        let f = |k: &str| Self::field(path, k);
        match m.get("type") {
            None => self.problem(&f("type"), "missing (required): one of none, tcp, http".into()),
            Some(v) => match self.string(v, &f("type")) {
                Some("none") => h.kind = ProbeKind::None,
                Some("tcp") => h.kind = ProbeKind::Tcp,
                Some("http") => h.kind = ProbeKind::Http,
                Some(o) => self.problem(&f("type"), format!("{o:?} is not one of none, tcp, http")),
                None => {}
            },
        }
        if let Some(v) = m.get("interval")
            && let Some(d) = self.duration(v, &f("interval"), Duration::from_millis(50), Duration::from_secs(3600))
        {
            h.interval = d;
        }
        if let Some(v) = m.get("timeout")
            && let Some(d) = self.duration(v, &f("timeout"), Duration::from_millis(10), Duration::from_secs(600))
        {
            h.timeout = d;
        }
        if let Some(v) = m.get("rise")
            && let Some(n) = self.uint(v, &f("rise"), 1, 100)
        {
            h.rise = n as u32;
        }
        if let Some(v) = m.get("fall")
            && let Some(n) = self.uint(v, &f("fall"), 1, 100)
        {
            h.fall = n as u32;
        }
        if let Some(v) = m.get("path")
            && let Some(p) = self.string(v, &f("path"))
        {
            if p.starts_with('/') && !p.chars().any(|c| c.is_whitespace() || c.is_control()) {
                h.path = p.to_owned();
            } else {
                self.problem(&f("path"), format!("{p:?} is not an absolute URL path without spaces"));
            }
        }
        if let Some(v) = m.get("expect") {
            let text = match v {
                Value::Number(n) => Some(n.to_string()),
                Value::String(s) => Some(s.clone()),
                _ => None,
            };
            match text.as_deref().and_then(parse_status_range) {
                Some(r) => h.expect = r,
                None => self.problem(
                    &f("expect"),
                    format!("expected a status or range such as 200 or 200-399, found {}", describe(v)),
                ),
            }
        }
        if let Some(v) = m.get("port")
            && let Some(p) = self.uint(v, &f("port"), 1, 65535)
        {
            h.port = Some(p as u16);
        }
        if let Some(v) = m.get("body")
            && let Some(b) = self.string(v, &f("body"))
        {
            if h.kind != ProbeKind::Http {
                self.problem(&f("body"), "a body check needs type: http".into());
            } else if b.is_empty() || b.len() > 1024 {
                self.problem(&f("body"), format!("expected 1 to 1024 bytes of text, found {}", b.len()));
            } else {
                h.body = Some(b.to_owned());
            }
        }
        if h.kind != ProbeKind::None && h.timeout > h.interval {
            self.problem(&f("timeout"), format!("{:?} is longer than the interval {:?}", h.timeout, h.interval));
        }
        (self.problems.len() == before).then_some(h)
    }

    /// One backend; `default_port` (DSR services: the service's port) is
    /// its port when the entry names none.
    fn backend(&mut self, v: &Value, path: &str, default_port: Option<u16>) -> Option<BackendConfig> {
        let m = self.mapping(v, path, &["address", "port", "weight", "drain"])?;
        let address = self.required(m, path, "address").and_then(|v| self.ip(v, &Self::field(path, "address")));
        let port = match (m.get("port"), default_port) {
            (None, Some(p)) => Some(u64::from(p)),
            _ => self.required(m, path, "port").and_then(|v| self.uint(v, &Self::field(path, "port"), 1, 65535)),
        };
        let weight = match m.get("weight") {
            None => Some(1),
            Some(v) => self.uint(v, &Self::field(path, "weight"), 0, u64::from(MAX_WEIGHT)),
        };
        let drain = match m.get("drain") {
            None => Some(false),
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                self.problem(&Self::field(path, "drain"), format!("expected true or false, found {}", describe(v)));
                None
            }
        };
        Some(BackendConfig { address: address?, port: port? as u16, weight: weight? as u32, drain: drain? })
    }

    fn cross_service(&mut self, services: &[(usize, ServiceConfig)], table_capacity: u32) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut vips: BTreeMap<(IpAddr, u16, Protocol), usize> = BTreeMap::new();
        for (i, s) in services {
            if let Some(first) = names.insert(&s.name, *i) {
                self.problem(
                    &format!("services[{i}].name"),
                    format!("service name {:?} is already used by services[{first}]", s.name),
                );
            }
            if let Some(first) = vips.insert((s.vip, s.port, s.protocol), *i) {
                self.problem(
                    &format!("services[{i}].vip"),
                    format!(
                        "duplicate VIP {}/{}: already used by services[{first}]",
                        std::net::SocketAddr::new(s.vip, s.port),
                        s.protocol
                    ),
                );
            }
        }
        let backends: usize = services.iter().map(|(_, s)| s.backends.len()).sum();
        if backends >= lb_common::MAX_BACKENDS as usize {
            self.problem(
                "services",
                format!("{backends} backends in all; at most {} are supported", lb_common::MAX_BACKENDS - 1),
            );
        }
        // Service ids run from 1 to MAX_SERVICES - 1 (0 is "no service").
        if services.len() >= lb_common::MAX_SERVICES as usize {
            self.problem(
                "services",
                format!("{} services; at most {} are supported", services.len(), lb_common::MAX_SERVICES - 1),
            );
        }
        // Each table needs room for itself and for its replacement.
        let need: u64 = services.iter().map(|(_, s)| 2 * table_entries(s)).sum();
        if need > u64::from(table_capacity) {
            self.problem(
                "table_capacity",
                format!("the services' selection tables need {need} entries (twice their size, for atomic swaps); capacity is {table_capacity}"),
            );
        }
    }
}

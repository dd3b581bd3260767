//! The scale-out lab: balancer nodes behind a router that learns the VIPs
//! from them over BGP and spreads the clients' packets over them by ECMP.
//!
//! ```text
//!  {p}-client                {p}-rt (BIRD, AS 65000)        {p}-nK (lbd + its BIRD, AS 65001)
//!  eth0 10.10.0.2/16 ──── c0 10.10.0.1/16
//!  + 10.10.1.1.. /16         nK 10.40.K.1/24 ─────────────── eth0 10.40.K.2/24
//!                            b0 10.20.0.3/24 ──┐             eth1 10.20.0.{1,2,4,5..}/24 ──┐
//!                                              pb                                         qK
//!                                  {p}-sw br0 ─┴─ pN ── beN eth0 10.20.0.(10+N)/24  ───────┘
//!  beN lo: 10.10.0.110/32 (the DSR VIP)
//! ```
//!
//! - Every node runs its own lbd ([`Lab::node_config`]) with a `bgp:`
//!   section: its BIRD peers with the router over the node's uplink.
//! - The router's BIRD installs each VIP with one next hop per node that
//!   announces it (`merge paths`), and hashes flows over them by their
//!   5-tuple (`fib_multipath_hash_policy=1`).
//! - DSR, not NAT: every node reaches every backend on one L2 segment, and
//!   the backends answer from the VIP through the router (default route
//!   10.20.0.3), so no answer passes a node. With NAT, a reply goes back
//!   through whatever node the backend routes by, not the one the router
//!   hashed the request to, and losing a node would also need the
//!   backends' return route to move; DSR needs neither.
//! - Offloads are the kernel's defaults (the client's checksums arrive
//!   unfinished, and the nodes finish them) except one thing this veth lab
//!   needs and a physical network does not: the switch ends of the nodes'
//!   `eth1` have GRO on (native XDP redirects into a veth are delivered
//!   only then).
//! - IPv4 only.
use super::*;

/// The nodes' AS and the router's.
pub const NODE_ASN: u32 = 65001;
pub const ROUTER_ASN: u32 = 65000;

impl Lab {
    /// `["n1", "n2", ...]`.
    pub fn node_names(&self) -> Vec<String> {
        (1..=self.spec.nodes).map(|k| format!("n{k}")).collect()
    }

    /// Node `k`'s (1-based) address on its uplink to the router, and the
    /// router's end of that link.
    pub fn node_uplink(k: usize) -> (Ipv4Addr, Ipv4Addr) {
        (Ipv4Addr::new(10, 40, k as u8, 2), Ipv4Addr::new(10, 40, k as u8, 1))
    }

    /// Node `k`'s address on the backends' network (10.20.0.3 is the
    /// router's).
    pub fn node_backend_addr(k: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 20, 0, if k < 3 { k as u8 } else { k as u8 + 1 })
    }

    /// Node `k`'s lbd control socket (its BIRD's files sit beside it).
    pub fn node_socket(&self, k: usize) -> PathBuf {
        PathBuf::from(format!("/run/lbd/{}-n{k}.sock", self.spec.prefix))
    }

    /// A whole lbd config for node `k`: its interfaces, its own socket and
    /// pins, a `bgp:` section peering with the router (hold time `hold`
    /// seconds), and `services_yaml` (list items, indented).
    pub fn node_config(&self, k: usize, hold: u32, services_yaml: &str) -> String {
        let (me, router) = Self::node_uplink(k);
        format!(
            "interfaces: [eth0, eth1]\ncontrol_socket: {}\npin_path: {}/n{k}\nconntrack_max: 262144\nbgp:\n  local_asn: {NODE_ASN}\n  router_id: {me}\n  hold_time: {hold}\n  communities: [\"{NODE_ASN}:100\"]\n  peers:\n    - {{ address: {router}, asn: {ROUTER_ASN} }}\nservices:\n{services_yaml}",
            self.node_socket(k).display(),
            self.pin_dir().display(),
        )
    }

    /// The router's next hops for `dst` (a /32) now: empty when it has no
    /// route for it.
    pub fn router_next_hops(&self, dst: Ipv4Addr) -> anyhow::Result<Vec<Ipv4Addr>> {
        let out = run(Command::new("ip").arg("-n").arg(self.ns("rt")).args([
            "-j",
            "route",
            "show",
            "exact",
            &format!("{dst}/32"),
        ]))?;
        let v: serde_json::Value = serde_json::from_str(out.trim()).with_context(|| format!("ip -j route: {out:?}"))?;
        let mut hops = Vec::new();
        for r in v.as_array().into_iter().flatten() {
            let gws = match r["nexthops"].as_array() {
                Some(n) => n.iter().filter_map(|h| h["gateway"].as_str()).collect::<Vec<_>>(),
                None => r["gateway"].as_str().into_iter().collect(),
            };
            for g in gws {
                hops.push(g.parse().with_context(|| format!("gateway {g:?} in {out}"))?);
            }
        }
        hops.sort();
        Ok(hops)
    }

    /// The router BIRD's control socket.
    pub fn router_bird_ctl(&self) -> PathBuf {
        PathBuf::from(format!("/tmp/{}-rt-bird.ctl", self.spec.prefix))
    }

    pub(super) fn build_ecmp(&self) -> anyhow::Result<()> {
        let n = self.spec.backends;
        let (sw_ns, rt_ns) = (self.ns("sw"), self.ns("rt"));
        // The backends' segment: backends, every node's eth1, the router's b0.
        let mut sw = String::from("link add br0 type bridge stp_state 0\nlink set br0 up\n");
        for i in 1..=n {
            self.ip_ns(
                &format!("be{i}"),
                &["link", "add", "eth0", "type", "veth", "peer", "name", &format!("p{i}"), "netns", &sw_ns],
            )?;
            writeln!(sw, "link set p{i} master br0\nlink set p{i} up").unwrap();
        }
        for k in 1..=self.spec.nodes {
            let node = format!("n{k}");
            self.ip_ns(
                &node,
                &["link", "add", "eth1", "type", "veth", "peer", "name", &format!("q{k}"), "netns", &sw_ns],
            )?;
            self.ip_ns(&node, &["link", "add", "eth0", "type", "veth", "peer", "name", &node, "netns", &rt_ns])?;
            writeln!(sw, "link set q{k} master br0\nlink set q{k} up").unwrap();
        }
        self.ip_ns("rt", &["link", "add", "b0", "type", "veth", "peer", "name", "pb", "netns", &sw_ns])?;
        sw.push_str("link set pb master br0\nlink set pb up\n");
        self.ip_ns("client", &["link", "add", "eth0", "type", "veth", "peer", "name", "c0", "netns", &rt_ns])?;
        self.ip_batch("sw", &sw)?;
        for k in 1..=self.spec.nodes {
            self.ns_exec("sw", "ethtool", &["-K", &format!("q{k}"), "gro", "on"])?;
        }

        // The router.
        let mut rt = format!(
            "addr add 10.10.0.1/16 dev c0\nlink set c0 up\naddr add {BYPASS_ROUTER}/24 dev b0\nlink set b0 up\n"
        );
        for k in 1..=self.spec.nodes {
            let (_, router) = Self::node_uplink(k);
            writeln!(rt, "addr add {router}/24 dev n{k}\nlink set n{k} up").unwrap();
        }
        self.ip_batch("rt", &rt)?;
        self.forwarder("rt", &["net.ipv4.fib_multipath_hash_policy=1"])?;
        self.start_router_bird()?;

        // The nodes.
        for k in 1..=self.spec.nodes {
            let node = format!("n{k}");
            let (me, router) = Self::node_uplink(k);
            self.ip_batch(
                &node,
                &format!(
                    "addr add {me}/24 dev eth0\nlink set eth0 up\naddr add {}/24 dev eth1\nlink set eth1 up\nroute add default via {router}\n",
                    Self::node_backend_addr(k)
                ),
            )?;
            self.forwarder(&node, &["net.ipv4.conf.eth0.rp_filter=0", "net.ipv4.conf.eth1.rp_filter=0"])?;
        }

        // The client, as in every lab (its VIP route now leads to the router).
        self.ip_batch("client", &self.client_v4())?;
        self.client_sysctls()?;

        // The backends: DSR VIP on loopback, answers by the router.
        for (i, (addr, addr6)) in (1..=n).zip(self.backend_addrs().into_iter().zip(self.backend_addrs6())) {
            let role = format!("be{i}");
            self.ip_batch(
                &role,
                &format!(
                    "addr add {addr}/24 dev eth0\nlink set eth0 up\nroute add default via {BYPASS_ROUTER}\naddr add {addr6}/64 dev eth0 nodad\naddr add {DSR_VIP}/32 dev lo\naddr add {DSR_VIP6}/128 dev lo nodad\n"
                ),
            )?;
            self.hide_dsr_vips(&role)?;
        }
        for idx in 0..n {
            self.spawn_backend(idx)?;
        }
        for idx in 0..n {
            self.wait_backend_ready(idx)?;
        }
        Ok(())
    }

    /// Make `role` an IPv4 router without reverse-path filtering, with
    /// `more` sysctls.
    fn forwarder(&self, role: &str, more: &[&str]) -> anyhow::Result<()> {
        let mut args = vec![
            "-q",
            "-w",
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ];
        args.extend_from_slice(more);
        self.ns_exec(role, "sysctl", &args)
    }

    /// The router's BIRD: one session per node, every VIP learnt installed
    /// in the kernel with all equal paths merged into one ECMP route.
    fn start_router_bird(&self) -> anyhow::Result<()> {
        let p = &self.spec.prefix;
        let conf = PathBuf::from(format!("/tmp/{p}-rt-bird.conf"));
        let ctl = self.router_bird_ctl();
        let mut c = String::from(
            "router id 10.40.0.1;\nlog stderr { info, remote, warning, error, auth, fatal, bug };\nprotocol device { }\nprotocol kernel { ipv4 { import none; export all; }; merge paths on; }\n",
        );
        for k in 1..=self.spec.nodes {
            let (node, _) = Self::node_uplink(k);
            writeln!(
                c,
                "protocol bgp n{k} {{ local as {ROUTER_ASN}; neighbor {node} as {NODE_ASN}; hold time 9; keepalive time 3; connect retry time 1; error wait time 1, 5; ipv4 {{ import all; export none; }}; }}"
            )
            .unwrap();
        }
        std::fs::write(&conf, c).with_context(|| format!("writing {}", conf.display()))?;
        let log_path = PathBuf::from(format!("/tmp/{p}-rt-bird.log"));
        let log = File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let child = self
            .cmd("rt", "bird")
            .arg("-f")
            .arg("-c")
            .arg(&conf)
            .arg("-s")
            .arg(&ctl)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting bird in the router (cargo xtask setup installs bird2)")?;
        self.lock_daemons().push(child);
        let start = Instant::now();
        while run(Command::new("birdc").arg("-s").arg(&ctl).arg("show status")).is_err() {
            if start.elapsed() > READY_TIMEOUT {
                bail!(
                    "the router's bird did not answer within {READY_TIMEOUT:?}; log {}:\n{}",
                    log_path.display(),
                    log_tail(&log_path)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Files of the ecmp lab outside its namespaces: the router BIRD's, and
    /// what each node's lbd leaves beside its control socket.
    pub(super) fn ecmp_files(prefix: &str) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> =
            ["conf", "ctl"].iter().map(|e| PathBuf::from(format!("/tmp/{prefix}-rt-bird.{e}"))).collect();
        if let Ok(dir) = std::fs::read_dir("/run/lbd") {
            let node = format!("{prefix}-n");
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let is_node_file = name
                    .strip_prefix(&node)
                    .and_then(|r| r.split_once(".sock"))
                    .is_some_and(|(d, _)| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
                if is_node_file {
                    v.push(e.path());
                }
            }
        }
        v
    }
}

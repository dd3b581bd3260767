//! Network-namespace lab for the load balancer.
//!
//! ```text
//!  {p}-client            {p}-gw                  {p}-sw               {p}-beN
//!  eth0 10.10.0.2/16 ── eth0 10.10.0.1/16
//!  + 10.10.1.1.. /16     eth1 10.20.0.1/24 ──── p0 ┐
//!                                                   br0 ─ pN ─────── eth0 10.20.0.(10+N)/24
//! ```
//!
//! That is the `tuned` and `default` wiring ([`Topology`]); the variants
//! change only the gateway's side, never an address:
//!
//! ```text
//!  bridge-backend  client eth0 ── eth0 │ gw br0 10.20.0.1 ─ pN ──── beN eth0   (no switch)
//!  bridge-client   client eth0 ── c0 ─ br0 10.10.0.1 │ gw eth1 ── p0 (switch as above)
//!  one-arm         gw eth0 10.10.0.1 + 10.20.0.1 ── p0 ┐
//!                  client eth0 ─────────────────── pc ─ br0 ─ pN ── beN eth0
//!  mixed           as default, plus an XDP_PASS program (native) on the switch's p0
//! ```
//!
//! Only `tuned` touches offloads (TX checksum off on the client's and the
//! backends' eth0, GRO on on the client's eth0 and the switch's p0); every
//! other variant leaves kernel defaults. [`Lab::gw_interfaces`] names the
//! interfaces lbd attaches to.
//!
//! VIPs live in 10.10.0.96/28 (not configured on the gateway); the client
//! routes them (and 10.20.0.0/24, for direct-to-backend runs) via the
//! gateway, which forwards (ip_forward=1, rp_filter=0; send_redirects=0 in
//! one-arm). Each backend namespace runs `lab-backend` with its stats API on
//! port 9000 (all addresses: health checks use it).
//!
//! IPv6 beside IPv4, on the same devices in every topology:
//!
//! ```text
//!  client eth0 fd00:10::2/64        gw  fd00:10::1/64 (client side)
//!   + fd00:10::1:1.. /64 (deprecated:     fd00:20::1/64 (backend side)
//!     bound explicitly, never picked  beN eth0 fd00:20::(10+N)/64, e.g. be1 fd00:20::11
//!     as a default source)
//! ```
//!
//! IPv6 VIPs live in fd00:10::100/124, routed by the client to fd00:10::1
//! like fd00:20::/64; the gateway forwards (net.ipv6.conf.all.forwarding=1).
//! Every address is added `nodad` and every namespace has accept_dad=0, so
//! nothing (link-local addresses included) waits for duplicate address
//! detection. In one-arm the client and the backends ignore ICMPv6
//! redirects (IPv6 has no send_redirects). `lab-backend` serves its port
//! 8080 on the backend's IPv4 and IPv6 addresses.
//!
//! Direct server return ([`LabSpec::dsr`]; not with bridge-backend):
//!
//! ```text
//!  client eth0 ── gw ── sw br0 ─ pN ── beN eth0  (the forward path, as above)
//!  client eth1 10.30.0.2 ── c0 {p}-rt b0 10.20.0.3 ── pb ┘
//!              fd00:30::2      10.30.0.1  fd00:20::3
//!                              fd00:30::1
//!  beN lo: 10.10.0.110/32, fd00:10::10a/128 (the DSR VIPs)
//!  beN: from a DSR VIP -> table 100: default via 10.20.0.3 / fd00:20::3
//! ```
//!
//! The gateway reaches the backends on-link (the balancer changes only the
//! destination MAC). Each backend holds the DSR VIPs on loopback, where
//! nobody on eth0 learns of them (net.ipv4.conf.all.arp_ignore=1 and
//! arp_announce=2; IPv6 neighbour discovery answers only for the receiving
//! device's own addresses), and `lab-backend` also serves port 8080 on
//! them. Its answers from a DSR VIP take a policy route to a router
//! namespace `{p}-rt` on the backends' bridge, which routes the client
//! networks to a second client interface: the gateway never sees a reply.
//! Everything else a backend sends (NAT replies, from its own address)
//! still goes by the gateway. The client has rp_filter=0 (the answers from
//! a VIP arrive on eth1, the VIP routes by eth0).

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

mod ecmp;
mod sys;

pub use ecmp::{NODE_ASN, ROUTER_ASN};

use sys::*;

const STATS_URL: &str = "http://127.0.0.1:9000";

/// The gateway's IPv6 addresses on the client and backend sides.
pub const GW6_CLIENT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 1);
pub const GW6_BACKEND: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 1);
/// The `routed` topology's gateway end of its link to the backends'
/// router (/30 and /64; the router is .2 and ::2).
pub const ROUTED_GW: Ipv4Addr = Ipv4Addr::new(10, 21, 0, 1);
pub const ROUTED_GW6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x21, 0, 0, 0, 0, 0, 1);
/// The client's main IPv6 address.
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 2);
/// IPv6 VIPs live in this prefix, routed by the client to the gateway.
pub const VIPS6_NET: &str = "fd00:10::100/124";
/// The first IPv6 VIP (`fd00:10::100`).
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x100);
/// The DSR VIPs every backend holds on loopback in a DSR lab.
pub const DSR_VIP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 110);
pub const DSR_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x10a);
/// The bypass router's addresses on the backends' network in a DSR lab:
/// the backends' next hop for answers from a DSR VIP.
pub const BYPASS_ROUTER: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 3);
pub const BYPASS_ROUTER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 3);
const BACKEND_PORT: u16 = 8080;
const READY_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_BACKENDS: usize = 200;
/// 10.10.1.1 ..= 10.10.255.254 without .0/.255 host parts.
const MAX_CLIENT_SOURCES: usize = 255 * 254;

/// How the gateway is wired: the lab variants for real-world conditions.
/// Every one keeps the same addresses (clients 10.10.0.0/16 and
/// fd00:10::/64, backends 10.20.0.0/24 and fd00:20::/64, gateway .1 / ::1
/// in each, VIPs 10.10.0.96/28 and fd00:10::100/124 routed to it) and,
/// except `Tuned`, leaves every device's offloads at kernel defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Client veth, backend veth into a switch namespace's bridge; TX
    /// checksum offload off on the senders, GRO on on the gateway's veth
    /// peers (what native XDP redirects on veth need) and on the
    /// backends' eth0, TSO off on the switch's backend ports (so that each
    /// backend polls one receive queue, as behind a NIC).
    Tuned,
    /// The same wiring, kernel-default offloads.
    Default,
    /// The backends on ports of a Linux bridge inside the gateway (`br0`).
    BridgeBackend,
    /// The client behind a Linux bridge inside the gateway (`br0`).
    BridgeClient,
    /// One gateway interface for clients and backends (both subnets on it).
    OneArm,
    /// Default wiring and offloads, but the far end of the backend link runs
    /// its own XDP program: native redirects into `eth1` work, into `eth0` not.
    Mixed,
    /// The gateway's two interfaces are macvlan devices (bridge mode) whose
    /// lower devices, the switch's bridges, live in another namespace, as
    /// a container's do on its host's network.
    Macvlan,
    /// A veth to the client; the backends' network reached over VXLAN
    /// (`eth1`, VNI 42, UDP 4789) across an underlay veth (`u0`, MTU
    /// 1600) to the switch, whose VTEP is a port of the backends' bridge.
    Vxlan,
    /// The backends one router hop away: `eth1` is a point-to-point link
    /// (10.21.0.0/30, fd00:21::/64) to a router namespace (`br`), which is
    /// the backends' gateway (10.20.0.1, fd00:20::1) on their switch.
    Routed,
    /// Scale-out: [`LabSpec::nodes`] balancer nodes `n1`.. behind a BGP
    /// router doing ECMP (module `ecmp`); not one of [`Topology::ALL`],
    /// which are the single-gateway variants.
    Ecmp,
}

impl Topology {
    pub const ALL: [Self; 9] = [
        Self::Tuned,
        Self::Default,
        Self::BridgeBackend,
        Self::BridgeClient,
        Self::OneArm,
        Self::Mixed,
        Self::Macvlan,
        Self::Vxlan,
        Self::Routed,
    ];

    /// The name on the command line (`cargo xtask lab up --topology NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Tuned => "tuned",
            Self::Default => "default",
            Self::BridgeBackend => "bridge-backend",
            Self::BridgeClient => "bridge-client",
            Self::OneArm => "one-arm",
            Self::Mixed => "mixed",
            Self::Macvlan => "macvlan",
            Self::Vxlan => "vxlan",
            Self::Routed => "routed",
            Self::Ecmp => "ecmp",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Tuned => {
                "veth to the client, veth to a switch bridge; senders' TX checksum off, GRO on the gateway's veth peers and the backends' eth0"
            }
            Self::Default => "veth to the client, veth to a switch bridge; kernel-default offloads",
            Self::BridgeBackend => "veth to the client; the backends on ports of a bridge br0 inside the gateway",
            Self::BridgeClient => "the client on a port of a bridge br0 inside the gateway; veth to a switch bridge",
            Self::OneArm => "one veth to a switch bridge that holds the client and the backends",
            Self::Mixed => "default wiring and offloads; the switch end of eth1 runs an XDP program",
            Self::Macvlan => {
                "macvlan eth0 and eth1 on the switch's bridges (client's, backends'), lower devices in the switch namespace"
            }
            Self::Vxlan => {
                "veth to the client; eth1 a VXLAN device over an underlay veth to the switch, whose VTEP bridges to the backends"
            }
            Self::Routed => "veth to the client; eth1 a link to a router, the backends' gateway on their switch",
            Self::Ecmp => {
                "balancer nodes n1..nN behind a BIRD router spreading the VIPs over them by ECMP; DSR backends"
            }
        }
    }

    /// The gateway interfaces lbd attaches to, client side first.
    pub fn gw_interfaces(self) -> Vec<String> {
        let v: &[&str] = match self {
            Self::Tuned | Self::Default | Self::Mixed | Self::Macvlan | Self::Vxlan | Self::Routed | Self::Ecmp => {
                &["eth0", "eth1"]
            }
            Self::BridgeBackend => &["eth0", "br0"],
            Self::BridgeClient => &["br0", "eth1"],
            Self::OneArm => &["eth0"],
        };
        v.iter().map(|s| (*s).to_owned()).collect()
    }
}

impl std::str::FromStr for Topology {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().chain([Self::Ecmp]).find(|t| t.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().chain(&[Self::Ecmp]).map(|t| t.name()).collect();
            format!("unknown topology {s:?} (one of {})", names.join(", "))
        })
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to build.
#[derive(Debug, Clone)]
pub struct LabSpec {
    /// Namespace name prefix: namespaces are `{prefix}-client`, `-gw`, `-sw`, `-be1`...
    pub prefix: String,
    /// Number of backends (1..=200).
    pub backends: usize,
    /// Extra client source addresses (10.10.1.1, 10.10.1.2, ...).
    pub client_sources: usize,
    /// Directory holding the `lab-backend` and `lab-client` binaries.
    pub bin_dir: PathBuf,
    /// How the gateway is wired.
    pub topology: Topology,
    /// Direct server return wiring (see the module documentation): the
    /// DSR VIPs on every backend's loopback, and a path from the backends
    /// to the client that bypasses the gateway, taken by packets from a
    /// DSR VIP. Not with `bridge-backend` (the gateway holds the bridge).
    pub dsr: bool,
    /// Balancer nodes of the `ecmp` topology (2..=8; ignored otherwise).
    pub nodes: usize,
}

impl Default for LabSpec {
    fn default() -> Self {
        Self {
            prefix: "lb".into(),
            backends: 3,
            client_sources: 250,
            bin_dir: default_bin_dir(),
            topology: Topology::Tuned,
            dsr: false,
            nodes: 2,
        }
    }
}

/// Directory of the current executable; `target/debug` when called from a
/// test binary in `target/debug/deps`.
/// `LB_BIN_DIR` overrides it.
fn default_bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LB_BIN_DIR") {
        return PathBuf::from(d);
    }
    let Some(dir) = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)) else {
        return PathBuf::from(".");
    };
    if dir.file_name() == Some(OsStr::new("deps"))
        && let Some(parent) = dir.parent()
    {
        return parent.to_path_buf();
    }
    dir
}

/// A bpf filesystem shared by every lab (and every `ip netns exec`, which
/// remounts /sys but not /run), so that pins outlive one lbd process.
pub const BPFFS: &str = "/run/lbd/bpf";

/// Most bpf filesystems [`release_bpffs`] unmounts from [`BPFFS`] in one
/// call (a bound; one is what the labs mount).
const MAX_STACKED: usize = 8;

/// Whether a bpf filesystem is mounted on [`BPFFS`].
pub fn bpffs_mounted() -> bool {
    Command::new("stat")
        .args(["-f", "-c", "%T", BPFFS])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "bpf_fs")
}

/// Mount bpffs on [`BPFFS`] unless it is mounted already.
pub fn ensure_bpffs() -> anyhow::Result<()> {
    ensure_bpffs_for(None)
}

/// Where each lab that uses [`BPFFS`] leaves a file while it lives, named
/// for its prefix and holding the id of the process that owns it (or
/// `kept`, for a lab left up by `cargo xtask lab up`). A lab's teardown
/// unmounts the bpf filesystem only when no other live lab has one, so a
/// lab that has mounted it but pinned nothing yet keeps it. (It is kept
/// out of bpffs, which takes no regular files.)
const USERS_DIR: &str = "/run/lbd/bpffs-users";

/// As [`ensure_bpffs`], and, under the same lock (so that no release can
/// come between), the marker of lab `prefix` in [`USERS_DIR`].
fn ensure_bpffs_for(prefix: Option<&str>) -> anyhow::Result<()> {
    std::fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
    let _lock = bpffs_lock()?;
    if let Some(prefix) = prefix {
        mark_user(prefix, &std::process::id().to_string())?;
    }
    if bpffs_mounted() {
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS])).map(drop)
}

fn mark_user(prefix: &str, owner: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(USERS_DIR).with_context(|| format!("creating {USERS_DIR}"))?;
    let path = Path::new(USERS_DIR).join(prefix);
    std::fs::write(&path, owner).with_context(|| format!("writing {}", path.display()))
}

/// Whether a live lab other than those removed holds a marker in
/// [`USERS_DIR`]; the markers of processes that are gone (killed tests)
/// are removed on the way.
fn live_users() -> bool {
    let Ok(dir) = std::fs::read_dir(USERS_DIR) else { return false };
    let mut live = false;
    for e in dir.flatten() {
        let owner = std::fs::read_to_string(e.path()).unwrap_or_default();
        let alive =
            owner == "kept" || owner.parse::<u32>().is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if alive {
            live = true;
        } else {
            let _ = std::fs::remove_file(e.path());
        }
    }
    live
}

/// An exclusive lock on [`BPFFS`]'s parent directory, held while a bpffs
/// is looked for and mounted or unmounted there. Without it two labs
/// coming up at once (the tests of one binary run in parallel threads; a
/// demo or benchmark may run beside them) both find nothing mounted and
/// both mount: two bpf filesystems stacked on one directory, the lower
/// one's pins hidden, and a release that unmounts one leaves the other.
fn bpffs_lock() -> anyhow::Result<nix::fcntl::Flock<File>> {
    let parent = Path::new(BPFFS).parent().expect("BPFFS has a parent");
    let dir = File::open(parent).with_context(|| format!("opening {}", parent.display()))?;
    nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow::anyhow!("locking {}: {e}", parent.display()))
}

/// Unmount the labs' bpf filesystem ([`BPFFS`]) once nothing is pinned in
/// it (bpffs's own `maps.debug` and `progs.debug` aside) and no live lab
/// uses it ([`USERS_DIR`]), and remove the directories the labs and
/// benchmarks made under /run/lbd when they are empty. Leaves everything
/// as it is while a lab's pins remain. Returns whether it unmounted.
pub fn release_bpffs() -> anyhow::Result<bool> {
    let own = |n: &OsStr| n == "maps.debug" || n == "progs.debug";
    let mut unmounted = false;
    {
        let _lock = if Path::new(BPFFS).exists() { Some(bpffs_lock()?) } else { None };
        if live_users() {
            return Ok(false);
        }
        // Each mount stacked there (an earlier version's labs could stack
        // two when they came up at once), down to the directory itself.
        for _ in 0..MAX_STACKED {
            if !bpffs_mounted() {
                break;
            }
            let pinned = std::fs::read_dir(BPFFS)
                .with_context(|| format!("reading {BPFFS}"))?
                .flatten()
                .any(|e| !own(&e.file_name()));
            if pinned {
                return Ok(unmounted);
            }
            run(Command::new("umount").arg(BPFFS))?;
            unmounted = true;
        }
    }
    // Empty directories only (remove_dir refuses any other).
    for dir in [BPFFS, lb_testkit::sysctl::SAVED_DIR, USERS_DIR, "/run/lbd"] {
        let _ = std::fs::remove_dir(dir);
    }
    Ok(unmounted)
}

/// Counters reported by one backend's stats API: the whole backend, and
/// each address it serves apart ([`BackendCounts::at`]).
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
pub struct BackendCounts {
    pub name: String,
    pub connections: u64,
    pub active: u64,
    pub requests: u64,
    pub udp_datagrams: u64,
    /// Distinct UDP peers (address, port) of every served address.
    #[serde(default)]
    pub udp_flows: u64,
    /// By served address (`10.20.0.11:8080`, `[fd00:20::11]:8080`, a DSR
    /// VIP's): one service's share of the backend.
    #[serde(default)]
    pub per_address: std::collections::BTreeMap<String, AddressCounts>,
}

/// What a backend counted on one of its addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct AddressCounts {
    pub connections: u64,
    pub udp_datagrams: u64,
    /// Distinct UDP peers (address, port): the flows a balancer counts.
    pub udp_flows: u64,
}

impl BackendCounts {
    /// The counters of the service address `addr` (port 8080 in the lab).
    /// Panics when the backend does not serve it (a test comparing with
    /// zeros it never counted would prove nothing).
    pub fn at(&self, addr: IpAddr) -> AddressCounts {
        let key = SocketAddr::new(addr, BACKEND_PORT).to_string();
        *self.per_address.get(&key).unwrap_or_else(|| {
            panic!("backend {} does not serve {key} (it serves {:?})", self.name, self.per_address.keys())
        })
    }
}

/// A running lab. Dropping it tears everything down unless [`Lab::keep`] was called.
pub struct Lab {
    pub spec: LabSpec,
    keep: bool,
    /// `lab-backend` processes this handle started, by backend index.
    children: Mutex<Vec<Option<Child>>>,
    /// Other processes it started (the ecmp router's BIRD).
    daemons: Mutex<Vec<Child>>,
}

impl Lab {
    /// Builds the lab (after clearing leftovers of the same prefix). On any
    /// failure everything built so far is torn down and the error returned.
    pub fn up(spec: LabSpec) -> anyhow::Result<Self> {
        crate::require_root()?;
        validate(&spec)?;
        // A fresh lab starts lbd's log afresh (restarts within it append).
        let _ = std::fs::remove_file(format!("/tmp/{}-lbd.log", spec.prefix));
        Self::down(&spec.prefix).context("clearing leftovers of an earlier lab")?;
        ensure_bpffs_for(Some(&spec.prefix))?;
        let lab = Self {
            children: Mutex::new((0..spec.backends).map(|_| None).collect()),
            daemons: Mutex::new(Vec::new()),
            spec,
            keep: false,
        };
        match lab.build() {
            Ok(()) => Ok(lab),
            Err(e) => {
                let prefix = lab.spec.prefix.clone();
                drop(lab); // tears down
                Err(e.context(format!("bringing up lab {prefix:?} (torn down again)")))
            }
        }
    }

    /// Kills every process in the prefix's namespaces and deletes them.
    /// Idempotent; succeeds when nothing exists.
    pub fn down(prefix: &str) -> anyhow::Result<()> {
        let mut first_err: Option<anyhow::Error> = None;
        for ns in lab_namespaces(prefix)? {
            if let Err(e) = remove_ns(&ns) {
                // Keep going so as much as possible is removed.
                first_err.get_or_insert(e.context(format!("removing namespace {ns}")));
            }
        }
        // The mixed topology's peer XDP program.
        let peer = peer_xdp_pin(prefix);
        if peer.exists()
            && let Err(e) = std::fs::remove_file(&peer)
        {
            first_err.get_or_insert(anyhow::Error::from(e).context(format!("removing {}", peer.display())));
        }
        // The ecmp lab's files outside its namespaces.
        for f in Self::ecmp_files(prefix) {
            if f.exists()
                && let Err(e) = std::fs::remove_file(&f)
            {
                first_err.get_or_insert(anyhow::Error::from(e).context(format!("removing {}", f.display())));
            }
        }
        // Its mark as a user of the bpf filesystem.
        let mark = Path::new(USERS_DIR).join(prefix);
        if let Err(e) = std::fs::remove_file(&mark)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            first_err.get_or_insert(anyhow::Error::from(e).context(format!("removing {}", mark.display())));
        }
        // Whatever a killed lbd left pinned for this lab.
        let pins = Path::new(BPFFS).join(prefix);
        if pins.exists()
            && let Err(e) = std::fs::remove_dir_all(&pins)
        {
            first_err.get_or_insert(anyhow::Error::from(e).context(format!("removing {}", pins.display())));
        }
        match first_err {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Removes everything this project's labs and benchmarks may have left
    /// behind when they were killed: every lab (all prefixes: the demo's,
    /// the tests', the benchmark's), lb-bench's namespaces, the pins under
    /// [`BPFFS`], and `kernel.bpf_stats_enabled` as a benchmark found it.
    /// Idempotent; every step is tried even when one fails.
    pub fn down_all() -> anyhow::Result<()> {
        let mut first_err: Option<anyhow::Error> = None;
        let mut prefixes: Vec<String> =
            all_namespaces()?.iter().filter_map(|ns| lab_prefix_of(ns)).map(String::from).collect();
        prefixes.sort();
        prefixes.dedup();
        for prefix in &prefixes {
            if let Err(e) = Self::down(prefix) {
                first_err.get_or_insert(e.context(format!("removing lab {prefix}")));
            }
        }
        // lb-bench's named namespaces (`lbbench-<pid>`), which a killed
        // lb-bench of an earlier version left; lb-bench's namespace now
        // has no name and goes with the process.
        for ns in all_namespaces()?.into_iter().filter(|ns| ns.starts_with("lbbench-")) {
            if let Err(e) = remove_ns(&ns) {
                first_err.get_or_insert(e.context(format!("removing namespace {ns}")));
            }
        }
        // The datapath fixtures' namespaces of killed test processes.
        remove_stale_fixture_netns();
        // Pins of any lab's lbd: each lab pins under BPFFS/<prefix> (the
        // files beside them, maps.debug and progs.debug, are bpffs's own).
        if let Ok(dir) = std::fs::read_dir(BPFFS) {
            for entry in dir.flatten() {
                let path = entry.path();
                if !path.is_dir() || !entry.file_name().to_string_lossy().starts_with("lb") {
                    continue;
                }
                if let Err(e) = std::fs::remove_dir_all(&path) {
                    first_err.get_or_insert(anyhow::Error::from(e).context(format!("removing {}", path.display())));
                }
            }
        }
        // Every lab's mark as a user of the bpf filesystem: none is left.
        if let Err(e) = std::fs::remove_dir_all(USERS_DIR)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            first_err.get_or_insert(anyhow::Error::from(e).context(format!("removing {USERS_DIR}")));
        }
        match lb_testkit::sysctl::restore_saved() {
            Ok(restored) => {
                for r in restored {
                    println!("restored {r}");
                }
            }
            Err(e) => {
                first_err.get_or_insert(anyhow::Error::from(e).context("restoring saved sysctls"));
            }
        }
        for prefix in &prefixes {
            println!("removed lab {prefix}");
        }
        match release_bpffs() {
            Ok(true) => println!("unmounted {BPFFS}"),
            Ok(false) => {}
            Err(e) => {
                first_err.get_or_insert(e.context(format!("unmounting {BPFFS}")));
            }
        }
        match first_err {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// The bpffs directory lbd pins this lab's datapath under.
    pub fn pin_dir(&self) -> PathBuf {
        Path::new(BPFFS).join(&self.spec.prefix)
    }

    /// The gateway interfaces lbd attaches to in this lab's topology.
    pub fn gw_interfaces(&self) -> Vec<String> {
        self.spec.topology.gw_interfaces()
    }

    /// Leaves the lab running when this handle is dropped.
    pub fn keep(mut self) {
        // Its mark outlives this process: the lab stays until `lab down`.
        if let Err(e) = mark_user(&self.spec.prefix, "kept") {
            eprintln!("lab {}: {e:#}", self.spec.prefix);
        }
        self.keep = true;
    }

    /// Namespace name of a role: "client", "gw", "sw", "be1".."beN".
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.spec.prefix)
    }

    /// `ip netns exec <ns of role> <program>`.
    pub fn cmd(&self, role: &str, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec"]).arg(self.ns(role)).arg(program);
        c
    }

    /// `["be1", "be2", ...]`.
    pub fn backend_names(&self) -> Vec<String> {
        (1..=self.spec.backends).map(|i| format!("be{i}")).collect()
    }

    /// `[10.20.0.11, 10.20.0.12, ...]`.
    pub fn backend_addrs(&self) -> Vec<Ipv4Addr> {
        (1..=self.spec.backends).map(|i| Ipv4Addr::new(10, 20, 0, 10 + i as u8)).collect()
    }

    /// The backends' addresses in one family (IPv6 when `v6`).
    pub fn backend_ips(&self, v6: bool) -> Vec<IpAddr> {
        if v6 {
            self.backend_addrs6().into_iter().map(IpAddr::from).collect()
        } else {
            self.backend_addrs().into_iter().map(IpAddr::from).collect()
        }
    }

    /// Every link between the gateway and the backends at `mtu`, both ends
    /// of each: the gateway's `eth1` and the switch's port to it, each
    /// backend's link, and with `dsr` the router's link to the switch
    /// (the DSR answers' way). The labs whose gateway `eth1` faces the
    /// backends' switch (`tuned`, `default`, `mixed`).
    pub fn set_backend_side_mtu(&self, mtu: u32) -> anyhow::Result<()> {
        if !matches!(self.spec.topology, Topology::Tuned | Topology::Default | Topology::Mixed) {
            bail!("the {} lab's backend side is not the switch behind eth1", self.spec.topology.name());
        }
        self.set_mtu("gw", "eth1", mtu)?;
        self.set_mtu("sw", "p0", mtu)?;
        for (i, be) in self.backend_names().iter().enumerate() {
            self.set_mtu("sw", &format!("p{}", i + 1), mtu)?;
            self.set_mtu(be, "eth0", mtu)?;
        }
        if self.spec.dsr {
            self.set_mtu("sw", "pb", mtu)?;
            self.set_mtu("rt", "b0", mtu)?;
        }
        Ok(())
    }

    /// The extra client source addresses: 10.10.1.1, 10.10.1.2, ...
    pub fn client_sources(&self) -> Vec<Ipv4Addr> {
        client_source_addrs(self.spec.client_sources)
    }

    /// `[fd00:20::11, fd00:20::12, ...]`.
    pub fn backend_addrs6(&self) -> Vec<Ipv6Addr> {
        (1..=self.spec.backends).map(|i| Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 0x10 + i as u16)).collect()
    }

    /// The extra IPv6 client source addresses: fd00:10::1:1, fd00:10::1:2,
    /// ... (as many as IPv4 ones, at most 1,000).
    pub fn client_sources6(&self) -> Vec<Ipv6Addr> {
        (1..=self.spec.client_sources.min(1000)).map(|i| Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 1, i as u16)).collect()
    }

    /// Counters of every backend, in backend order.
    pub fn backend_counts(&self) -> anyhow::Result<Vec<BackendCounts>> {
        (0..self.spec.backends)
            .map(|i| {
                let out = self.stats_call(i, "GET", "/stats")?;
                serde_json::from_str(&out).with_context(|| format!("be{}: bad stats JSON {out:?}", i + 1))
            })
            .collect()
    }

    /// Connections the backends accepted in all, since their counters were
    /// last reset.
    pub fn connections_served(&self) -> anyhow::Result<u64> {
        Ok(self.backend_counts()?.iter().map(|c| c.connections).sum())
    }

    /// Zeroes every backend's counters (`active` is a gauge and stays).
    pub fn reset_backend_counts(&self) -> anyhow::Result<()> {
        for i in 0..self.spec.backends {
            self.stats_call(i, "POST", "/reset")?;
        }
        Ok(())
    }

    /// Makes backend `idx` (0-based) report unhealthy on its service port:
    /// its health endpoint (`/health...`) answers `code` with a body saying
    /// `health=failing` (200 restores it). Other requests are still served.
    pub fn set_backend_status(&self, idx: usize, code: u16) -> anyhow::Result<()> {
        self.stats_call(idx, "POST", &format!("/status?code={code}")).map(drop)
    }

    /// Closes (`open == false`) or reopens backend `idx`'s service port:
    /// new connections are refused while the process and its open
    /// connections stay.
    pub fn set_backend_listening(&self, idx: usize, open: bool) -> anyhow::Result<()> {
        self.stats_call(idx, "POST", &format!("/listen?on={}", u8::from(open))).map(drop)
    }

    /// Sets the response delay of backend `idx` (0-based); 0 disables it.
    pub fn set_backend_delay(&self, idx: usize, ms: u64) -> anyhow::Result<()> {
        self.check_idx(idx)?;
        self.stats_call(idx, "POST", &format!("/delay?ms={ms}")).map(drop)
    }

    /// Stops backend `idx`'s `lab-backend` process (no-op if not running).
    pub fn stop_backend(&self, idx: usize) -> anyhow::Result<()> {
        self.check_idx(idx)?;
        if let Some(mut child) = self.lock_children()[idx].take() {
            terminate_child(&mut child);
        }
        // Also one started by another handle (e.g. a kept lab).
        kill_ns_processes(&self.ns(&format!("be{}", idx + 1)), |pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "lab-backend")
        })
    }

    /// (Re)starts backend `idx` and waits until its stats API answers.
    pub fn start_backend(&self, idx: usize) -> anyhow::Result<()> {
        self.stop_backend(idx)?;
        self.spawn_backend(idx)?;
        self.wait_backend_ready(idx)
    }

    /// Runs `lab-client <args>` in the client namespace and parses its JSON.
    pub fn client(&self, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        self.client_from(&self.spec.bin_dir.join("lab-client"), args)
    }

    /// `lab-client conns`: `count` HTTP connections to `target`, one
    /// request each, `concurrency` at a time; `extra` adds arguments (the
    /// sources: `--sources-range a-b` or `--sources a,b`).
    pub fn conns(
        &self,
        target: &str,
        count: u32,
        concurrency: u32,
        extra: &[&str],
    ) -> anyhow::Result<serde_json::Value> {
        let (count, concurrency) = (count.to_string(), concurrency.to_string());
        let args = ["conns", "--target", target, "--count", &count, "--concurrency", &concurrency];
        self.client(&[&args[..], extra].concat())
    }

    /// `lab-client udp`: `count` UDP flows to `target`, `per_socket`
    /// datagrams each; `extra` adds arguments (sources, concurrency).
    pub fn udp(&self, target: &str, count: u32, per_socket: u32, extra: &[&str]) -> anyhow::Result<serde_json::Value> {
        let (count, per_socket) = (count.to_string(), per_socket.to_string());
        let args = ["udp", "--target", target, "--count", &count, "--per-socket", &per_socket];
        self.client(&[&args[..], extra].concat())
    }

    /// `lab-client longlived`: `connections` keep-alive connections to
    /// `target`, one from each of the first `connections` client sources
    /// (10.10.1.1 on), `rounds` requests each, `interval_ms` apart; `extra`
    /// adds arguments (a `--stop-file`).
    pub fn longlived(
        &self,
        target: &str,
        connections: u32,
        rounds: u32,
        interval_ms: u32,
        extra: &[&str],
    ) -> anyhow::Result<serde_json::Value> {
        // The lab's first sources are 10.10.1.1 to 10.10.1.254 (`client_source_addrs`).
        let sources = self.spec.client_sources.min(254);
        anyhow::ensure!(
            (1..=sources).contains(&(connections as usize)),
            "{connections} connections: the lab's sources in 10.10.1.0/24 are 10.10.1.1-{sources}"
        );
        let (connections, rounds, interval) = (connections.to_string(), rounds.to_string(), interval_ms.to_string());
        let sources = format!("10.10.1.1-10.10.1.{connections}");
        let args = ["longlived", "--target", target, "--connections", &connections, "--rounds", &rounds];
        self.client(&[&args[..], &["--interval-ms", &interval, "--sources-range", &sources], extra].concat())
    }

    /// [`Self::client`] with the `lab-client` binary `exe` (the benchmark
    /// runs an optimised one).
    pub fn client_from(&self, exe: &Path, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        let out = self
            .cmd("client", exe)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {} {}", exe.display(), args.join(" ")))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            bail!("lab-client {} failed ({}): {}", args.join(" "), out.status, stderr.trim());
        }
        serde_json::from_str(stdout.trim()).with_context(|| {
            format!(
                "lab-client {}: output is not JSON: {:?} (stderr: {})",
                args.join(" "),
                stdout.trim(),
                stderr.trim()
            )
        })
    }

    // ------------------------------------------------------------ internals

    fn check_idx(&self, idx: usize) -> anyhow::Result<()> {
        if idx >= self.spec.backends {
            bail!("backend index {idx} out of range (lab has {} backends)", self.spec.backends);
        }
        Ok(())
    }

    fn lock_children(&self) -> std::sync::MutexGuard<'_, Vec<Option<Child>>> {
        self.children.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_daemons(&self) -> std::sync::MutexGuard<'_, Vec<Child>> {
        self.daemons.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stats_call(&self, idx: usize, method: &str, path: &str) -> anyhow::Result<String> {
        let role = format!("be{}", idx + 1);
        let mut c = self.cmd(&role, "curl");
        c.args(["-sS", "-f", "--max-time", "3", "-X", method]).arg(format!("{STATS_URL}{path}"));
        run(&mut c).with_context(|| format!("{role} stats API {method} {path}"))
    }

    /// Each namespace's non-zero TCP counters (`nstat`), one line per
    /// role ("be1: TcpOutRsts=3 ..."): which host's TCP reset or dropped
    /// what, for a test's failure message. Reads absolute values and
    /// writes no history file.
    pub fn tcp_counters(&self) -> String {
        let mut out = String::new();
        for role in self.all_roles() {
            let Ok(o) = self.cmd(&role, "nstat").args(["-a", "-s"]).output() else { continue };
            let text = String::from_utf8_lossy(&o.stdout);
            // "TcpOutRsts   3   0.0" -> "TcpOutRsts=3"
            let counts: Vec<String> = text
                .lines()
                .filter(|l| l.starts_with("Tcp"))
                .filter_map(|l| {
                    let mut f = l.split_whitespace();
                    Some(format!("{}={}", f.next()?, f.next()?))
                })
                .collect();
            out.push_str(&format!("{role}: {}\n", counts.join(" ")));
        }
        out
    }

    /// Every namespace role of this lab, in its topology.
    pub fn all_roles(&self) -> Vec<String> {
        if self.spec.topology == Topology::Ecmp {
            let mut v: Vec<String> = ["client", "rt", "sw"].map(String::from).into();
            v.extend(self.node_names());
            v.extend(self.backend_names());
            return v;
        }
        let mut v: Vec<String> = ["client", "gw", "sw"].map(String::from).into();
        if self.spec.dsr {
            v.push("rt".into());
        }
        if self.spec.topology == Topology::Routed {
            v.push("br".into());
        }
        v.extend(self.backend_names());
        v
    }

    fn ip_ns(&self, role: &str, args: &[&str]) -> anyhow::Result<()> {
        run(Command::new("ip").arg("-n").arg(self.ns(role)).args(args)).map(drop)
    }

    fn ip_batch(&self, role: &str, script: &str) -> anyhow::Result<()> {
        let mut c = Command::new("ip");
        c.arg("-n").arg(self.ns(role)).args(["-batch", "-"]);
        run_with_stdin(&mut c, script).map(drop)
    }

    fn ns_exec(&self, role: &str, program: &str, args: &[&str]) -> anyhow::Result<()> {
        run(self.cmd(role, program).args(args)).map(drop)
    }

    fn build(&self) -> anyhow::Result<()> {
        for exe in ["lab-backend", "lab-client"] {
            let p = self.spec.bin_dir.join(exe);
            if !p.is_file() {
                bail!("{} not found (build the lb-tests binaries, or set LabSpec::bin_dir)", p.display());
            }
        }
        let n = self.spec.backends;
        for role in self.all_roles() {
            run(Command::new("ip").args(["netns", "add"]).arg(self.ns(&role)))?;
            self.ip_ns(&role, &["link", "set", "lo", "up"])?;
            // No duplicate address detection on any device made from here
            // on, link-local addresses included: `nodad` covers only the
            // addresses we add, and while a device's link-local address is
            // tentative (1-2 s after it comes up) the kernel sends no
            // neighbour solicitation from it, so the first IPv6 packets
            // forwarded through the gateway waited that long.
            self.ns_exec(
                &role,
                "sysctl",
                &["-q", "-w", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"],
            )?;
        }

        let topo = self.spec.topology;
        if topo == Topology::Ecmp {
            return self.build_ecmp();
        }
        let gw_ns = self.ns("gw");
        let sw_ns = self.ns("sw");
        // The backends' side: ports p1..pN of a bridge, in the switch
        // namespace or (bridge-backend) in the gateway itself.
        let be_bridge_ns = if topo == Topology::BridgeBackend { &gw_ns } else { &sw_ns };
        for i in 1..=n {
            let port = format!("p{i}");
            self.ip_ns(
                &format!("be{i}"),
                &["link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", be_bridge_ns],
            )?;
        }
        let ports = |first: usize| {
            let mut b = String::from("link add br0 type bridge stp_state 0\nlink set br0 up\n");
            for p in first..=n {
                writeln!(b, "link set p{p} master br0\nlink set p{p} up").unwrap();
            }
            b
        };
        let mut gw = String::new();
        match topo {
            Topology::Ecmp => bail!("the ecmp lab has no gateway (built by build_ecmp)"),
            Topology::Tuned | Topology::Default | Topology::Mixed => {
                self.ip_ns(
                    "client",
                    &["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &gw_ns],
                )?;
                self.ip_ns("gw", &["link", "add", "eth1", "type", "veth", "peer", "name", "p0", "netns", &sw_ns])?;
                self.ip_batch("sw", &ports(0))?;
                gw.push_str("addr add 10.10.0.1/16 dev eth0\nlink set eth0 up\naddr add 10.20.0.1/24 dev eth1\nlink set eth1 up\n");
            }
            Topology::BridgeBackend => {
                self.ip_ns(
                    "client",
                    &["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &gw_ns],
                )?;
                gw.push_str(&ports(1));
                gw.push_str("addr add 10.10.0.1/16 dev eth0\nlink set eth0 up\naddr add 10.20.0.1/24 dev br0\n");
            }
            Topology::BridgeClient => {
                self.ip_ns("client", &["link", "add", "eth0", "type", "veth", "peer", "name", "c0", "netns", &gw_ns])?;
                self.ip_ns("gw", &["link", "add", "eth1", "type", "veth", "peer", "name", "p0", "netns", &sw_ns])?;
                self.ip_batch("sw", &ports(0))?;
                gw.push_str(
                    "link add br0 type bridge stp_state 0\nlink set br0 up\nlink set c0 master br0\nlink set c0 up\n",
                );
                gw.push_str("addr add 10.10.0.1/16 dev br0\naddr add 10.20.0.1/24 dev eth1\nlink set eth1 up\n");
            }
            Topology::Macvlan => {
                // The client on a bridge of its own in the switch.
                self.ip_ns("client", &["link", "add", "eth0", "type", "veth", "peer", "name", "pc", "netns", &sw_ns])?;
                let mut sw = ports(1);
                sw.push_str(
                    "link add brc type bridge stp_state 0\nlink set brc up\nlink set pc master brc\nlink set pc up\n",
                );
                sw.push_str("link add eth0 link brc type macvlan mode bridge\nlink add eth1 link br0 type macvlan mode bridge\n");
                writeln!(sw, "link set eth0 netns {gw_ns}\nlink set eth1 netns {gw_ns}").unwrap();
                self.ip_batch("sw", &sw)?;
                gw.push_str("addr add 10.10.0.1/16 dev eth0\nlink set eth0 up\naddr add 10.20.0.1/24 dev eth1\nlink set eth1 up\n");
            }
            Topology::Vxlan => {
                self.ip_ns(
                    "client",
                    &["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &gw_ns],
                )?;
                self.ip_ns("gw", &["link", "add", "u0", "type", "veth", "peer", "name", "u1", "netns", &sw_ns])?;
                let mut sw = ports(1);
                sw.push_str("addr add 10.99.0.2/30 dev u1\nlink set u1 mtu 1600 up\n");
                sw.push_str("link add vx0 type vxlan id 42 local 10.99.0.2 remote 10.99.0.1 dstport 4789 dev u1\n");
                sw.push_str("link set vx0 mtu 1500 master br0 up\n");
                self.ip_batch("sw", &sw)?;
                gw.push_str("addr add 10.99.0.1/30 dev u0\nlink set u0 mtu 1600 up\n");
                gw.push_str("link add eth1 type vxlan id 42 local 10.99.0.1 remote 10.99.0.2 dstport 4789 dev u0\n");
                gw.push_str("link set eth1 mtu 1500\n");
                gw.push_str("addr add 10.10.0.1/16 dev eth0\nlink set eth0 up\naddr add 10.20.0.1/24 dev eth1\nlink set eth1 up\n");
            }
            Topology::Routed => {
                let br_ns = self.ns("br");
                self.ip_ns(
                    "client",
                    &["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &gw_ns],
                )?;
                self.ip_ns("gw", &["link", "add", "eth1", "type", "veth", "peer", "name", "r0", "netns", &br_ns])?;
                self.ip_ns("br", &["link", "add", "r1", "type", "veth", "peer", "name", "p0", "netns", &sw_ns])?;
                self.ip_batch("sw", &ports(0))?;
                self.ip_batch(
                    "br",
                    &format!(
                        "addr add 10.21.0.2/30 dev r0\naddr add fd00:21::2/64 dev r0 nodad\nlink set r0 up\naddr add 10.20.0.1/24 dev r1\naddr add {GW6_BACKEND}/64 dev r1 nodad\nlink set r1 up\nroute add 10.10.0.0/16 via {ROUTED_GW}\nroute add fd00:10::/64 via {ROUTED_GW6}\n"
                    ),
                )?;
                self.router_sysctls("br")?;
                writeln!(gw, "addr add 10.10.0.1/16 dev eth0\nlink set eth0 up\naddr add {ROUTED_GW}/30 dev eth1\nlink set eth1 up\nroute add 10.20.0.0/24 via 10.21.0.2").unwrap();
            }
            Topology::OneArm => {
                self.ip_ns("client", &["link", "add", "eth0", "type", "veth", "peer", "name", "pc", "netns", &sw_ns])?;
                self.ip_ns("gw", &["link", "add", "eth0", "type", "veth", "peer", "name", "p0", "netns", &sw_ns])?;
                let mut sw = ports(0);
                sw.push_str("link set pc master br0\nlink set pc up\n");
                self.ip_batch("sw", &sw)?;
                gw.push_str("addr add 10.10.0.1/16 dev eth0\naddr add 10.20.0.1/24 dev eth0\nlink set eth0 up\n");
            }
        }
        // IPv6 beside IPv4, on the same devices.
        let (v6_client_side, v6_backend_side) = match topo {
            Topology::Tuned
            | Topology::Default
            | Topology::Mixed
            | Topology::Macvlan
            | Topology::Vxlan
            | Topology::Routed
            | Topology::Ecmp => ("eth0", "eth1"),
            Topology::BridgeBackend => ("eth0", "br0"),
            Topology::BridgeClient => ("br0", "eth1"),
            Topology::OneArm => ("eth0", "eth0"),
        };
        writeln!(gw, "addr add {GW6_CLIENT}/64 dev {v6_client_side} nodad").unwrap();
        if topo == Topology::Routed {
            // The router is the backends' gateway; the gateway reaches them by it.
            writeln!(gw, "addr add {ROUTED_GW6}/64 dev eth1 nodad\nroute add fd00:20::/64 via fd00:21::2").unwrap();
        } else {
            writeln!(gw, "addr add {GW6_BACKEND}/64 dev {v6_backend_side} nodad").unwrap();
        }
        self.ip_batch("gw", &gw)?;
        let mut sysctls: Vec<String> = [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv6.conf.all.forwarding=1",
        ]
        .map(String::from)
        .into();
        for i in self.gw_interfaces() {
            sysctls.push(format!("net.ipv4.conf.{i}.rp_filter=0"));
        }
        if topo == Topology::OneArm {
            // A one-arm router would tell clients to talk to the backends
            // directly (ICMP redirect) for packets it forwards itself.
            for i in ["all", "default", "eth0"] {
                sysctls.push(format!("net.ipv4.conf.{i}.send_redirects=0"));
            }
        }
        let mut args = vec!["-q", "-w"];
        args.extend(sysctls.iter().map(String::as_str));
        self.ns_exec("gw", "sysctl", &args)?;
        if topo == Topology::OneArm {
            // IPv6 has no send_redirects: the gateway still sends its
            // redirects (Icmp6OutRedirects counts them), and the hosts
            // ignore them, so that their IPv6 keeps going by the gateway
            // as their IPv4 does (accepted, a redirect made the client's
            // route to a backend on-link).
            let mut hosts = vec!["client".to_owned()];
            hosts.extend(self.backend_names());
            for role in hosts {
                self.ns_exec(
                    &role,
                    "sysctl",
                    &[
                        "-q",
                        "-w",
                        "net.ipv6.conf.all.accept_redirects=0",
                        "net.ipv6.conf.default.accept_redirects=0",
                        "net.ipv6.conf.eth0.accept_redirects=0",
                    ],
                )?;
            }
        }

        // Client.
        let mut cl = self.client_v4();
        writeln!(cl, "addr add {CLIENT6}/64 dev eth0 nodad").unwrap();
        // The extra sources deprecated (preferred_lft 0): bound explicitly
        // they work, but the kernel never picks one by itself, so
        // fd00:10::2 is the default source as 10.10.0.2 is for IPv4.
        for a in self.client_sources6() {
            writeln!(cl, "addr add {a}/64 dev eth0 nodad preferred_lft 0").unwrap();
        }
        writeln!(cl, "route add {VIPS6_NET} via {GW6_CLIENT}\nroute add fd00:20::/64 via {GW6_CLIENT}").unwrap();
        self.ip_batch("client", &cl)?;
        self.client_sysctls()?;
        if topo == Topology::Tuned {
            self.ns_exec("sw", "ethtool", &["-K", "p0", "gro", "on"])?;
            self.ns_exec("client", "ethtool", &["-K", "eth0", "tx", "off"])?;
            self.ns_exec("client", "ethtool", &["-K", "eth0", "gro", "on"])?;
        }
        if topo == Topology::Mixed {
            let pin = peer_xdp_pin(&self.spec.prefix);
            load_pass_program(&pin)?;
            self.ip_ns("sw", &["link", "set", "dev", "p0", "xdpdrv", "pinned", &pin.to_string_lossy()])?;
        }

        if self.spec.dsr {
            self.dsr_bypass()?;
        }

        // Backends.
        for (i, (addr, addr6)) in (1..=n).zip(self.backend_addrs().into_iter().zip(self.backend_addrs6())) {
            let role = format!("be{i}");
            self.ip_batch(
                &role,
                &format!(
                    "addr add {addr}/24 dev eth0\nlink set eth0 up\nroute add default via 10.20.0.1\naddr add {addr6}/64 dev eth0 nodad\nroute add default via {GW6_BACKEND}\n"
                ),
            )?;
            if self.spec.dsr {
                // The DSR VIPs on loopback, never announced on eth0 (ARP
                // answers only for eth0's own addresses; IPv6 neighbour
                // discovery never answers for loopback's), and the
                // answers from them to the clients by the bypass.
                self.ip_batch(
                    &role,
                    &format!(
                        "addr add {DSR_VIP}/32 dev lo\naddr add {DSR_VIP6}/128 dev lo nodad\nrule add from {DSR_VIP} table 100\nroute add default via {BYPASS_ROUTER} table 100\n"
                    ),
                )?;
                // (Not in the batch: `ip -batch` takes no family option.)
                let (vip6, bypass6) = (DSR_VIP6.to_string(), BYPASS_ROUTER6.to_string());
                self.ip_ns(&role, &["-6", "rule", "add", "from", &vip6, "table", "100"])?;
                self.ip_ns(&role, &["-6", "route", "add", "default", "via", &bypass6, "table", "100"])?;
                self.hide_dsr_vips(&role)?;
            }
            if topo == Topology::Tuned {
                self.ns_exec(&role, "ethtool", &["-K", "eth0", "tx", "off"])?;
                // Each backend takes its packets in one receive queue,
                // polled on one CPU at a time, as a NIC's queue (RSS keeps
                // a flow on one) does: GRO on eth0 puts its veth in NAPI
                // mode, and the switch port's TSO off makes every packet
                // eligible for it (veth passes a packet from a device with
                // TSO on to the backlog of the CPU that sent it). Without
                // this, a connection's handshake ACK and its request, sent
                // by the gateway from two CPUs, reached the backend's TCP
                // on two CPUs at once, and about one connection in
                // 200,000 was reset by the backend kernel's socket-table
                // lookup race (the request met the listener: the kind
                // Linux 1532ed0d0753, "inet: Avoid ehash lookup race in
                // inet_ehash_insert()", closes for one window).
                self.ns_exec(&role, "ethtool", &["-K", "eth0", "gro", "on"])?;
                self.ns_exec("sw", "ethtool", &["-K", &format!("p{i}"), "tso", "off"])?;
            }
        }
        for idx in 0..n {
            self.spawn_backend(idx)?;
        }
        for idx in 0..n {
            self.wait_backend_ready(idx)?;
        }
        Ok(())
    }

    /// The client's IPv4 set-up, the same in every lab: 10.10.0.2 and the
    /// extra sources on eth0, the VIPs and the backends' network by
    /// 10.10.0.1 (the gateway, or the ecmp lab's router).
    fn client_v4(&self) -> String {
        let mut cl = String::from("addr add 10.10.0.2/16 dev eth0\nlink set eth0 up\n");
        for a in self.client_sources() {
            writeln!(cl, "addr add {a}/16 dev eth0").unwrap();
        }
        cl.push_str("route add 10.10.0.96/28 via 10.10.0.1\nroute add 10.20.0.0/24 via 10.10.0.1\n");
        cl
    }

    /// Room for many short connections from the client.
    fn client_sysctls(&self) -> anyhow::Result<()> {
        self.ns_exec(
            "client",
            "sysctl",
            &["-q", "-w", "net.ipv4.ip_local_port_range=1024 65000", "net.ipv4.tcp_tw_reuse=1"],
        )
    }

    /// A router namespace's settings: forwarding both families, no
    /// reverse-path filter.
    fn router_sysctls(&self, role: &str) -> anyhow::Result<()> {
        self.ns_exec(
            role,
            "sysctl",
            &[
                "-q",
                "-w",
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
        )
    }

    /// A DSR backend never tells its network about the VIPs on its
    /// loopback: ARP answers only for eth0's own addresses (IPv6 neighbour
    /// discovery never answers for loopback's).
    fn hide_dsr_vips(&self, role: &str) -> anyhow::Result<()> {
        self.ns_exec(
            role,
            "sysctl",
            &[
                "-q",
                "-w",
                "net.ipv4.conf.all.arp_ignore=1",
                "net.ipv4.conf.all.arp_announce=2",
                "net.ipv4.conf.eth0.arp_ignore=1",
                "net.ipv4.conf.eth0.arp_announce=2",
            ],
        )
    }

    /// The DSR bypass: a router namespace (`rt`) between the backends'
    /// bridge (`b0`, 10.20.0.3 / fd00:20::3) and a second client interface
    /// (`eth1` <-> `c0`, 10.30.0.0/24 and fd00:30::/64). Backends send
    /// answers from a DSR VIP to it; it routes the client networks to the
    /// client, and the VIPs (its ICMP errors about the answers) and
    /// everything else to the gateway, as a real network's router would.
    fn dsr_bypass(&self) -> anyhow::Result<()> {
        if self.spec.topology == Topology::BridgeBackend {
            bail!("the DSR lab needs the backends' bridge outside the gateway (not bridge-backend)");
        }
        if self.spec.topology == Topology::Routed {
            bail!("the DSR lab needs the backends on the gateway's own network (not routed)");
        }
        let (sw_ns, rt_ns) = (self.ns("sw"), self.ns("rt"));
        self.ip_ns("client", &["link", "add", "eth1", "type", "veth", "peer", "name", "c0", "netns", &rt_ns])?;
        self.ip_ns("rt", &["link", "add", "b0", "type", "veth", "peer", "name", "pb", "netns", &sw_ns])?;
        self.ip_batch("sw", "link set pb master br0\nlink set pb up\n")?;
        self.ip_batch(
            "rt",
            &format!(
                "addr add 10.30.0.1/24 dev c0\naddr add fd00:30::1/64 dev c0 nodad\nlink set c0 up\naddr add {BYPASS_ROUTER}/24 dev b0\naddr add {BYPASS_ROUTER6}/64 dev b0 nodad\nlink set b0 up\nroute add 10.10.0.0/16 via 10.30.0.2\nroute add fd00:10::/64 via fd00:30::2\nroute add 10.10.0.96/28 via 10.20.0.1\nroute add {VIPS6_NET} via {GW6_BACKEND}\nroute add default via 10.20.0.1\nroute add default via {GW6_BACKEND}\n"
            ),
        )?;
        self.router_sysctls("rt")?;
        self.ip_batch(
            "client",
            "addr add 10.30.0.2/24 dev eth1\naddr add fd00:30::2/64 dev eth1 nodad\nlink set eth1 up\n",
        )?;
        // Answers from a VIP arrive on eth1, while the VIP routes by eth0.
        self.ns_exec(
            "client",
            "sysctl",
            &[
                "-q",
                "-w",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.eth1.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
        )
    }

    /// Set the MTU of `dev` in the namespace of `role` (both ends of a
    /// link must agree: a veth drops a frame above its receiver's MTU).
    pub fn set_mtu(&self, role: &str, dev: &str, mtu: u32) -> anyhow::Result<()> {
        self.ip_ns(role, &["link", "set", "dev", dev, "mtu", &mtu.to_string()])
    }

    /// Run `ip ARGS` in the namespace of `role`.
    pub fn ip(&self, role: &str, args: &[&str]) -> anyhow::Result<()> {
        self.ip_ns(role, args)
    }

    /// (received, sent) bytes of device `dev` in the namespace of `role`,
    /// as the kernel counts them (`ip -s link`).
    pub fn link_bytes(&self, role: &str, dev: &str) -> anyhow::Result<(u64, u64)> {
        let out = run(Command::new("ip").arg("-n").arg(self.ns(role)).args(["-j", "-s", "link", "show", "dev", dev]))?;
        let v: serde_json::Value = serde_json::from_str(&out).with_context(|| format!("ip -j -s link: {out:?}"))?;
        let stats = &v[0]["stats64"];
        let n = |dir: &str| stats[dir]["bytes"].as_u64().with_context(|| format!("no {dir} bytes for {dev}: {out}"));
        Ok((n("rx")?, n("tx")?))
    }

    fn log_path(&self, idx: usize) -> PathBuf {
        PathBuf::from(format!("/tmp/{}-be{}.log", self.spec.prefix, idx + 1))
    }

    fn spawn_backend(&self, idx: usize) -> anyhow::Result<()> {
        let exe = self.spec.bin_dir.join("lab-backend");
        let name = format!("be{}", idx + 1);
        let mut listen = vec![
            SocketAddr::new(self.backend_addrs()[idx].into(), BACKEND_PORT),
            SocketAddr::new(self.backend_addrs6()[idx].into(), BACKEND_PORT),
        ];
        if self.spec.dsr || self.spec.topology == Topology::Ecmp {
            listen.push(SocketAddr::new(DSR_VIP.into(), BACKEND_PORT));
            listen.push(SocketAddr::new(DSR_VIP6.into(), BACKEND_PORT));
        }
        let listen: Vec<String> = listen.iter().flat_map(|a| ["--listen".to_owned(), a.to_string()]).collect();
        let log_path = self.log_path(idx);
        let log = File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let child = self
            .cmd(&name, &exe)
            .args(["--name", &name, "--stats", "0.0.0.0:9000"])
            .args(&listen)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} in {}", exe.display(), self.ns(&name)))?;
        self.lock_children()[idx] = Some(child);
        Ok(())
    }

    fn wait_backend_ready(&self, idx: usize) -> anyhow::Result<()> {
        let start = Instant::now();
        loop {
            if let Some(child) = self.lock_children()[idx].as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                bail!(
                    "lab-backend be{} exited during startup ({status}); log {}:\n{}",
                    idx + 1,
                    self.log_path(idx).display(),
                    log_tail(&self.log_path(idx))
                );
            }
            let Err(err) = self.stats_call(idx, "GET", "/stats") else { return Ok(()) };
            if start.elapsed() > READY_TIMEOUT {
                return Err(err.context(format!(
                    "lab-backend be{} not ready after {READY_TIMEOUT:?}; log {}:\n{}",
                    idx + 1,
                    self.log_path(idx).display(),
                    log_tail(&self.log_path(idx))
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn teardown(&mut self) {
        let children = std::mem::take(&mut *self.lock_children());
        for mut child in children.into_iter().flatten() {
            terminate_child(&mut child);
        }
        for mut child in std::mem::take(&mut *self.lock_daemons()) {
            terminate_child(&mut child);
        }
        if let Err(e) = Self::down(&self.spec.prefix) {
            eprintln!("lab {}: teardown failed: {e:#}", self.spec.prefix);
        }
        // The bpf filesystem, when this was the last lab using it.
        if let Err(e) = release_bpffs() {
            eprintln!("lab {}: releasing {BPFFS}: {e:#}", self.spec.prefix);
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.teardown()));
        if res.is_err() {
            eprintln!("lab {}: teardown panicked", self.spec.prefix);
        }
        // A lab whose test got this far without a panic takes its files
        // in /tmp (backend and lbd logs, generated configs, copied
        // binaries) with it; a failing test's stay there to be read.
        if !std::thread::panicking() {
            remove_tmp_files(&self.spec.prefix);
        }
    }
}

/// Stops the loads started with its file as `lab-client`'s `--stop-file`
/// when dropped: also when the test fails before it means to, so that
/// the loads end (and a scope's join of them, or a wait for them).
pub struct StopLoads<'a>(pub &'a Path);
impl Drop for StopLoads<'_> {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, b"");
    }
}

/// Remove `/tmp/{prefix}-*`, the files and directories the lab `prefix`
/// and its test wrote there. (Lab tests run one at a time, so none of
/// them belongs to a lab still running.)
pub fn remove_tmp_files(prefix: &str) {
    let Ok(dir) = std::fs::read_dir("/tmp") else { return };
    let start = format!("{prefix}-");
    for entry in dir.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&start) {
            continue;
        }
        let path = entry.path();
        let res = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if let Err(e) = res {
            eprintln!("lab {prefix}: could not remove {}: {e}", path.display());
        }
    }
}

/// Delete the datapath fixtures' namespaces (`fixture::Netns`,
/// `<NETNS_PREFIX><pid>-<n>`) whose process `pid` is gone: a test binary killed
/// mid-run (Ctrl-C, a timeout), which never ran their `Drop`s. Called by
/// the first fixture of every test process and by `cargo xtask lab down
/// --all`; a live process's namespaces are left alone. Errors are ignored:
/// a namespace that cannot go now is tried again next time.
pub fn remove_stale_fixture_netns() {
    let Ok(namespaces) = all_namespaces() else { return };
    for ns in namespaces {
        let pid = ns
            .strip_prefix(crate::fixture::NETNS_PREFIX)
            .and_then(|r| r.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok());
        if pid.is_some_and(pid_gone) {
            let _ = remove_ns(&ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_addresses_skip_network_and_broadcast() {
        let v = client_source_addrs(300);
        assert_eq!(v[0], Ipv4Addr::new(10, 10, 1, 1));
        assert_eq!(v[253], Ipv4Addr::new(10, 10, 1, 254));
        assert_eq!(v[254], Ipv4Addr::new(10, 10, 2, 1));
        assert_eq!(v.len(), 300);
    }

    #[test]
    fn namespace_matching_is_exact() {
        assert!(is_lab_ns("lb", "lb-client"));
        assert!(is_lab_ns("lb", "lb-be12"));
        assert!(!is_lab_ns("lb", "lb-be"));
        assert!(!is_lab_ns("lb", "lbt-smoke-client"));
        assert!(!is_lab_ns("lb", "lb-foo-client"));
        assert!(!is_lab_ns("lb", "lb-client2"));
    }
}

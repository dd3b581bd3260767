//! The benchmark's network namespace and the measuring thread's place in
//! it: a veth pair, routes and static neighbours so that `bpf_fib_lookup`
//! succeeds; the thread enters it and is pinned to one CPU. The `nix` crate
//! makes the system calls (setns, if_nametoindex, sched_{get,set}affinity);
//! `ip` and `sysctl` configure the namespace.
use std::{path::Path, process::Command};

use anyhow::{Context as _, anyhow, ensure};
use nix::sched::{CloneFlags, CpuSet};

use crate::cases::{BACKENDS, BACKENDS6, CLIENT, CLIENT_MAC, CLIENT6, GW_A_MAC, GW_B_MAC, backend_mac, backend_mac6};

/// The benchmark's network namespace; deleted on drop.
pub(crate) struct Netns {
    pub name: String,
}

fn sh(cmd: &str) -> anyhow::Result<()> {
    let args: Vec<&str> = cmd.split(' ').collect();
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("spawn {}", args[0]))?;
    ensure!(out.status.success(), "`{cmd}` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

impl Netns {
    pub(crate) fn create() -> anyhow::Result<Self> {
        // Namespaces left by an lb-bench that was killed (no destructor ran).
        if let Ok(rd) = std::fs::read_dir("/run/netns") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("lbbench-")
                    && !Path::new("/proc").join(pid).exists()
                {
                    let _ = Command::new("ip").args(["netns", "del", &name]).output();
                }
            }
        }
        let name = format!("lbbench-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&format!("ip netns add {name}"))?;
        let ns = Self { name };
        let n = &ns.name;
        let mut cmds = vec![
            format!(
                "ip -n {n} link add name gwa address {} type veth peer name gwb address {}",
                mac_str(GW_A_MAC),
                mac_str(GW_B_MAC)
            ),
            format!("ip -n {n} link set lo up"),
            format!("ip -n {n} link set dev gwa up"),
            format!("ip -n {n} link set dev gwb up"),
            format!("ip -n {n} addr add 10.10.0.1/16 dev gwa"),
            format!("ip -n {n} addr add 10.20.0.1/24 dev gwb"),
            format!("ip -n {n} neigh replace {CLIENT} lladdr {} dev gwa nud permanent", mac_str(CLIENT_MAC)),
            format!("ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"),
            // IPv6 (the FIB answers an IPv6 lookup only where forwarding
            // is on); no duplicate address detection, so the addresses
            // are usable at once.
            format!("ip netns exec {n} sysctl -qw net.ipv6.conf.all.forwarding=1"),
            format!("ip -n {n} -6 addr add fd00:a::1/64 dev gwa nodad"),
            format!("ip -n {n} -6 addr add fd00:14::1/64 dev gwb nodad"),
            format!("ip -n {n} -6 neigh replace {CLIENT6} lladdr {} dev gwa nud permanent", mac_str(CLIENT_MAC)),
        ];
        for b in BACKENDS {
            cmds.push(format!("ip -n {n} neigh replace {b} lladdr {} dev gwb nud permanent", mac_str(backend_mac(b))));
        }
        for b in BACKENDS6 {
            cmds.push(format!(
                "ip -n {n} -6 neigh replace {b} lladdr {} dev gwb nud permanent",
                mac_str(backend_mac6(b))
            ));
        }
        for c in cmds {
            sh(&c)?;
        }
        Ok(ns)
    }
}

/// Move the calling thread into namespace `name`.
pub(crate) fn enter_netns(name: &str) -> anyhow::Result<()> {
    let path = Path::new("/run/netns").join(name);
    let file = std::fs::File::open(&path).with_context(|| format!("open {}", path.display()))?;
    nix::sched::setns(file, CloneFlags::CLONE_NEWNET).context("setns")?;
    Ok(())
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

pub(crate) fn ifindex(name: &str) -> anyhow::Result<u32> {
    nix::net::if_::if_nametoindex(name).with_context(|| format!("interface {name}"))
}

/// Pin the calling thread to `cpu`, or to the last CPU it may run on.
pub(crate) fn pin_thread(cpu: Option<usize>) -> anyhow::Result<usize> {
    let this = nix::unistd::Pid::from_raw(0);
    let set = nix::sched::sched_getaffinity(this).context("sched_getaffinity")?;
    let allowed: Vec<usize> = (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect();
    let cpu = match cpu {
        Some(c) => {
            ensure!(allowed.contains(&c), "CPU {c} is not in this process's affinity mask {allowed:?}");
            c
        }
        None => *allowed.last().ok_or_else(|| anyhow!("empty CPU affinity mask"))?,
    };
    pin_to(cpu)?;
    Ok(cpu)
}

/// Pin the calling thread to `cpu`, whatever its affinity mask now (the
/// measuring thread moves its weight-change applies to another CPU).
pub(crate) fn pin_to(cpu: usize) -> anyhow::Result<()> {
    let mut one = CpuSet::new();
    one.set(cpu).context("CPU number")?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &one).with_context(|| format!("pinning to CPU {cpu}"))
}

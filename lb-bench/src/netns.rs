//! The benchmark's network namespace, the measuring thread's own: a veth
//! pair, routes and static neighbours so that `bpf_fib_lookup` succeeds;
//! the thread is pinned to one CPU. The `nix` crate
//! makes the system calls (unshare, if_nametoindex, sched_{get,set}affinity);
//! `ip` and `sysctl`, started from the thread, configure the namespace.
use std::process::Command;

use anyhow::{Context as _, anyhow, ensure};
use nix::sched::{CloneFlags, CpuSet};

use crate::cases::{BACKENDS, BACKENDS6, CLIENT, CLIENT_MAC, CLIENT6, GW_A_MAC, GW_B_MAC, backend_mac, backend_mac6};

fn sh(cmd: &str) -> anyhow::Result<()> {
    let args: Vec<&str> = cmd.split(' ').collect();
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("spawn {}", args[0]))?;
    ensure!(out.status.success(), "`{cmd}` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Move the calling thread into a network namespace of its own and set
/// it up. The namespace has no name (no mount under /run/netns): it lives
/// as long as this thread, the threads it starts and their children, so
/// it goes with the process however the process ends, SIGKILL included.
/// Children started from this thread (`ip`, `sysctl`) inherit it, which
/// is how they configure it.
pub(crate) fn private_netns() -> anyhow::Result<()> {
    nix::sched::unshare(CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
    let mut cmds = vec![
        format!(
            "ip link add name gwa address {} type veth peer name gwb address {}",
            mac_str(GW_A_MAC),
            mac_str(GW_B_MAC)
        ),
        "ip link set lo up".to_owned(),
        "ip link set dev gwa up".to_owned(),
        "ip link set dev gwb up".to_owned(),
        "ip addr add 10.10.0.1/16 dev gwa".to_owned(),
        "ip addr add 10.20.0.1/24 dev gwb".to_owned(),
        format!("ip neigh replace {CLIENT} lladdr {} dev gwa nud permanent", mac_str(CLIENT_MAC)),
        // The namespace's own sysctls (a child's /proc/sys/net is its
        // namespace's).
        "sysctl -qw net.ipv4.ip_forward=1".to_owned(),
        // IPv6 (the FIB answers an IPv6 lookup only where forwarding is
        // on); no duplicate address detection, so the addresses are
        // usable at once.
        "sysctl -qw net.ipv6.conf.all.forwarding=1".to_owned(),
        "ip -6 addr add fd00:a::1/64 dev gwa nodad".to_owned(),
        "ip -6 addr add fd00:14::1/64 dev gwb nodad".to_owned(),
        format!("ip -6 neigh replace {CLIENT6} lladdr {} dev gwa nud permanent", mac_str(CLIENT_MAC)),
    ];
    for b in BACKENDS {
        cmds.push(format!("ip neigh replace {b} lladdr {} dev gwb nud permanent", mac_str(backend_mac(b))));
    }
    for b in BACKENDS6 {
        cmds.push(format!("ip -6 neigh replace {b} lladdr {} dev gwb nud permanent", mac_str(backend_mac6(b))));
    }
    for c in cmds {
        sh(&c)?;
    }
    Ok(())
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

//! The memory lbd's memory cgroup leaves it: the tightest limit among its
//! cgroup and that cgroup's ancestors, cgroup v1's memory hierarchy or
//! cgroup v2's, whichever the machine mounts.
//!
//! BPF maps are charged to the memory cgroup of the process that creates
//! them. A map that does not fit gets ENOMEM only when the allocation that
//! crosses the limit is one the kernel lets fail (the tables' arrays are);
//! when it is another (a map's file, its dentry), the cgroup's OOM killer
//! kills lbd instead, and the start ends with no word of why. So lbd
//! compares what its tables take with this before it creates any.
//! (`/proc/self/cgroup` and `/proc/self/mountinfo` are read with procfs;
//! the cgroup's own files are one number or `key value` lines.)
use std::{
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

/// A cgroup whose memory limit binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// The cgroup, as `/proc/self/cgroup` names it (its path in the
    /// hierarchy).
    pub cgroup: String,
    /// The file that sets the limit (`memory.limit_in_bytes` or
    /// `memory.max`).
    pub file: &'static str,
    /// The limit, bytes.
    pub limit: u64,
    /// What is left under it: the limit less what the cgroup uses, file
    /// cache not counted (the kernel reclaims it before it fails a charge).
    pub free: u64,
}

/// The files of one cgroup version.
#[derive(Debug, Clone, Copy)]
struct Files {
    limit: &'static str,
    usage: &'static str,
    /// `memory.stat` keys of the cgroup's file cache, its children's
    /// included.
    cache: [&'static str; 2],
}

const V1: Files = Files {
    limit: "memory.limit_in_bytes",
    usage: "memory.usage_in_bytes",
    cache: ["total_inactive_file", "total_active_file"],
};
const V2: Files = Files { limit: "memory.max", usage: "memory.current", cache: ["inactive_file", "active_file"] };

/// The tightest memory limit over lbd's cgroup and its ancestors, among
/// limits under `ram` (the machine's memory: a larger limit never binds
/// first). None when no memory controller is on, nothing sets a limit, or
/// the hierarchy cannot be read: the start then goes ahead, and a map the
/// kernel refuses is still reported with ENOMEM.
pub(super) fn tightest(ram: u64) -> Option<Limit> {
    let me = procfs::process::Process::myself().ok()?;
    let groups = me.cgroups().ok()?.0;
    let mounts = me.mountinfo().map(|m| m.0).unwrap_or_default();
    // cgroup v1's memory hierarchy when the process is in one (a hybrid
    // machine has a v2 hierarchy too, without the memory controller),
    // else v2's. A hierarchy without the controller has no limit files,
    // which `limit_of` takes as no limit.
    let v1 = groups.iter().find(|g| g.controllers.iter().any(|c| c == "memory"));
    let (files, group) = match v1 {
        Some(g) => (V1, g),
        None => (V2, groups.iter().find(|g| g.hierarchy == 0)?),
    };
    let path = Path::new(&group.pathname);
    let visible = mounts.iter().find(|m| match v1 {
        Some(_) => m.fs_type == "cgroup" && m.super_options.contains_key("memory"),
        None => m.fs_type == "cgroup2",
    });
    if let Some(m) = visible {
        // The mount shows the hierarchy from `root` down; the process's
        // path is the whole one.
        let rel = path.strip_prefix(&m.root).unwrap_or(path);
        return tightest_under(&m.mount_point, rel, files, ram);
    }
    // Not mounted in this mount namespace (`ip netns exec` mounts a fresh
    // /sys, without /sys/fs/cgroup): a mount of our own, detached (never
    // in any directory, gone when its descriptor closes), read through
    // /proc/self/fd.
    let fd = detached(v1.map(|g| g.controllers.as_slice())).ok()?;
    tightest_under(Path::new(&format!("/proc/self/fd/{}", fd.as_raw_fd())), path, files, ram)
}

/// A detached, read-only mount of cgroup v1's hierarchy with
/// `controllers`, or (None) of cgroup v2's. Needs CAP_SYS_ADMIN.
fn detached(controllers: Option<&[String]>) -> std::io::Result<OwnedFd> {
    use rustix::mount::{
        FsMountFlags, FsOpenFlags, MountAttrFlags, fsconfig_create, fsconfig_set_flag, fsmount, fsopen,
    };
    let fs = fsopen(if controllers.is_some() { "cgroup" } else { "cgroup2" }, FsOpenFlags::FSOPEN_CLOEXEC)?;
    // A v1 mount names every controller its hierarchy has, or the kernel
    // refuses it.
    for c in controllers.unwrap_or_default() {
        fsconfig_set_flag(&fs, c.as_str())?;
    }
    fsconfig_create(&fs)?;
    let attrs = MountAttrFlags::MOUNT_ATTR_RDONLY
        | MountAttrFlags::MOUNT_ATTR_NOSUID
        | MountAttrFlags::MOUNT_ATTR_NODEV
        | MountAttrFlags::MOUNT_ATTR_NOEXEC;
    Ok(fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs)?)
}

/// [`tightest`] for a hierarchy mounted at `mount`, the cgroup at `rel`
/// under it.
fn tightest_under(mount: &Path, rel: &Path, files: Files, ram: u64) -> Option<Limit> {
    let rel = rel.strip_prefix("/").unwrap_or(rel);
    let mut best: Option<Limit> = None;
    let mut at: Option<&Path> = Some(rel);
    while let Some(dir) = at {
        if let Some(l) = limit_of(&mount.join(dir), dir, files, ram)
            && best.as_ref().is_none_or(|b| l.free < b.free)
        {
            best = Some(l);
        }
        at = dir.parent();
    }
    best
}

/// The limit of the cgroup in `dir` (named `rel`), if it sets one under
/// `ram`.
fn limit_of(dir: &Path, rel: &Path, files: Files, ram: u64) -> Option<Limit> {
    let number = |name: &str| -> Option<u64> { std::fs::read_to_string(dir.join(name)).ok()?.trim().parse().ok() };
    // cgroup v2 writes "max" for no limit, which does not parse.
    let limit = number(files.limit).filter(|&l| l < ram)?;
    let usage = number(files.usage)?;
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let cache: u64 = stat
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| files.cache.contains(k))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum();
    Some(Limit {
        cgroup: PathBuf::from("/").join(rel).display().to_string(),
        file: files.limit,
        limit,
        free: limit.saturating_sub(usage.saturating_sub(cache)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cgroup(root: &Path, rel: &str, files: Files, limit: &str, usage: u64, stat: &str) {
        let dir = root.join(rel);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(files.limit), format!("{limit}\n")).unwrap();
        std::fs::write(dir.join(files.usage), format!("{usage}\n")).unwrap();
        std::fs::write(dir.join("memory.stat"), stat).unwrap();
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_tightest_limit_among_the_cgroup_and_its_ancestors_binds() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // v1: the root's "no limit" (a page short of i64::MAX), a parent
        // of 2 GiB with 1.5 GiB used (0.5 GiB of it file cache), and
        // lbd's own cgroup of 4 GiB, nearly empty.
        cgroup(r, "", V1, "9223372036854771712", 20 * GIB, "total_inactive_file 1\n");
        cgroup(
            r,
            "svc",
            V1,
            &(2 * GIB).to_string(),
            3 * GIB / 2,
            "cache 9\ntotal_inactive_file 268435456\ntotal_active_file 268435456\n",
        );
        cgroup(r, "svc/lbd", V1, &(4 * GIB).to_string(), 1 << 20, "total_active_file 0\n");
        let l = tightest_under(r, Path::new("/svc/lbd"), V1, 24 * GIB).expect("a limit");
        assert_eq!(l, Limit { cgroup: "/svc".into(), file: "memory.limit_in_bytes", limit: 2 * GIB, free: GIB });
        // lbd's own limit binds once it leaves less.
        cgroup(r, "svc/lbd", V1, &(GIB / 2).to_string(), 1 << 20, "");
        let l = tightest_under(r, Path::new("/svc/lbd"), V1, 24 * GIB).expect("a limit");
        assert_eq!((l.cgroup.as_str(), l.limit, l.free), ("/svc/lbd", GIB / 2, GIB / 2 - (1 << 20)));
        // Limits at or over the machine's memory never bind first.
        assert_eq!(tightest_under(r, Path::new("/svc/lbd"), V1, GIB / 4), None);
    }

    #[test]
    fn cgroup_v2_without_a_limit_has_none() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // The v2 root has no memory.max; "max" is no limit.
        std::fs::write(r.join("memory.stat"), "file 1\n").unwrap();
        cgroup(r, "system.slice/lbd.service", V2, "max", 1 << 20, "inactive_file 0\n");
        assert_eq!(tightest_under(r, Path::new("/system.slice/lbd.service"), V2, 24 * GIB), None);
        cgroup(r, "system.slice", V2, "125829120", 100 << 20, "inactive_file 10485760\nactive_file 10485760\n");
        let l = tightest_under(r, Path::new("/system.slice/lbd.service"), V2, 24 * GIB).expect("a limit");
        assert_eq!(l, Limit { cgroup: "/system.slice".into(), file: "memory.max", limit: 120 << 20, free: 40 << 20 });
    }
}

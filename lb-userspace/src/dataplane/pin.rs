//! Where the datapath lives between lbd processes: the bpf filesystem
//! (checked, and mounted at the standard place when missing), the XDP
//! links' pins and the mode each runs in (the kernel's word), and the lock
//! that keeps a second lbd off a pinned datapath. `statfs`, `mount`,
//! `open` and `flock` come from rustix.
use std::{os::fd::OwnedFd, path::Path};

use rustix::{
    fs::{FlockOperation, Mode as FileMode, OFlags, flock, open, statfs},
    io::Errno,
    mount::{MountFlags, mount},
};
use tracing::info;

use super::DataplaneError;
use crate::{netdev, paths::Mode};

/// The mode of the XDP link pinned for `iface` under `links_dir`, when
/// there is one: a pinned link is adopted in the mode it has, and the
/// kernel says which: the link's program is the device's (`dev`'s)
/// generic-mode program or not. (Native when the kernel does not name the
/// link's program on the device at all. A file beside the pin cannot keep
/// the mode: bpffs takes no regular files.)
pub(super) fn pinned_mode(links_dir: Option<&Path>, iface: &str, dev: &netdev::Link) -> Option<Mode> {
    let link = links_dir?.join(iface);
    if !link.exists() {
        return None;
    }
    let prog = pinned_program(&link);
    let generic = prog.is_some_and(|id| dev.xdp_progs.contains(&id) && dev.xdp_generic_prog == Some(id));
    Some(if generic { Mode::Generic } else { Mode::Native })
}

/// The id of the program the XDP link pinned at `path` runs, if it is one.
pub(super) fn pinned_program(path: &Path) -> Option<u32> {
    super::sys::pinned_xdp_link(path).ok().flatten().map(|(prog, _)| prog)
}

/// Whether the XDP link pinned at `path` (for the device `dev`) was
/// severed: attached to no device, or to another one (its device was
/// deleted, and `dev` made again under the name, while no lbd ran); a pin
/// on a device without XDP is one too.
pub(super) fn severed(path: &Path, dev: &netdev::Link) -> bool {
    dev.xdp_progs.is_empty()
        || super::sys::pinned_xdp_link(path).is_ok_and(|l| l.is_some_and(|(_, ifindex)| ifindex != dev.ifindex))
}

/// bpffs magic number (statfs f_type).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(path: &Path) -> bool {
    // f_type is signed on x86-64 and aarch64 alike.
    statfs(path).is_ok_and(|st| st.f_type == BPF_FS_MAGIC)
}

/// Make sure `pin` can be created on a bpf filesystem. The standard place,
/// /sys/fs/bpf, is mounted if it is not yet (as systemd and libbpf do);
/// anywhere else the operator (or the lab) mounts it.
pub(super) fn ensure_bpffs(pin: &Path) -> Result<(), DataplaneError> {
    let mut base = pin.to_path_buf();
    while !base.exists() {
        if !base.pop() {
            break;
        }
    }
    if is_bpffs(&base) {
        return Ok(());
    }
    let std_dir = Path::new("/sys/fs/bpf");
    if pin.starts_with(std_dir)
        && base.starts_with("/sys")
        && std_dir.is_dir()
        && mount("bpf", std_dir, "bpf", MountFlags::empty(), None).is_ok()
        && is_bpffs(std_dir)
    {
        info!("mounted bpffs on /sys/fs/bpf");
        return Ok(());
    }
    Err(DataplaneError::Bpffs(format!(
        "pin_path {} is not on a bpf filesystem (found {} without one); mount it first: mount -t bpf bpf <dir>",
        pin.display(),
        base.display()
    )))
}

/// Take the datapath at `pin` for this process: an exclusive lock on the
/// directory (created if missing), held until the returned fd is closed,
/// which exiting and exec (a graceful restart) do. Another lbd holding it
/// (one with another control socket: the socket already keeps out a
/// second lbd on the same one) is an error: it would adopt the running
/// datapath and program its own services into it.
pub(super) fn lock(pin: &Path) -> Result<OwnedFd, DataplaneError> {
    ensure_bpffs(pin)?;
    let err = |source: std::io::Error| DataplaneError::Pin { path: pin.to_path_buf(), source };
    std::fs::create_dir_all(pin).map_err(err)?;
    let dir = open(pin, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, FileMode::empty())
        .map_err(|e| err(e.into()))?;
    match flock(&dir, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(dir),
        Err(Errno::WOULDBLOCK) => Err(DataplaneError::InUse(pin.to_path_buf())),
        Err(e) => Err(err(e.into())),
    }
}

//! Where the datapath lives between lbd processes: the bpf filesystem
//! (checked, and mounted at the standard place when missing) and the XDP
//! links' pin files with the mode each was attached in. `statfs` and
//! `mount` come from rustix.
use std::path::Path;

use rustix::{
    fs::statfs,
    mount::{MountFlags, mount},
};
use tracing::info;

use super::DataplaneError;
use crate::paths::Mode;

/// The mode (and the reason it was chosen) of the XDP link pinned for
/// `iface` under `links_dir`, when there is one: a pinned link is adopted in
/// the mode it has. Its `.mode` file says which (an older lbd wrote only the
/// mode, and only native links).
pub(super) fn saved_mode(links_dir: Option<&Path>, iface: &str) -> Option<(Mode, String)> {
    let link = links_dir?.join(iface);
    if !link.exists() {
        return None;
    }
    let saved = std::fs::read_to_string(mode_path(&link)).unwrap_or_default();
    let mode = Mode::parse(saved.lines().next().unwrap_or("")).unwrap_or(Mode::Native);
    Some((mode, saved.lines().nth(1).unwrap_or_default().to_owned()))
}

/// The file beside a pinned link that records the mode it was attached in:
/// the link's name with ".mode" appended (not an extension replaced: a
/// VLAN device's name, `eth0.100`, has a dot of its own).
pub(super) fn mode_path(link: &Path) -> std::path::PathBuf {
    let mut name = link.as_os_str().to_owned();
    name.push(".mode");
    name.into()
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::mode_path;

    #[test]
    fn each_interface_has_a_mode_file_of_its_own() {
        let links = Path::new("/sys/fs/bpf/lbd/links");
        assert_eq!(mode_path(&links.join("eth0")), links.join("eth0.mode"));
        // A VLAN device beside its parent: two files, not one.
        assert_eq!(mode_path(&links.join("eth0.100")), links.join("eth0.100.mode"));
    }
}

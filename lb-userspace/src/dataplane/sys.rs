//! The bpf(2) calls aya 0.14 does not offer, on `libc::syscall`: the map
//! batch operations (`batch`) and detaching a pinned link at once.
//!
//! Removing a link's pin alone does not detach when the call returns:
//! bpffs frees the pin's inode after an RCU grace period, and the link's
//! last reference is then dropped from a work queue, which can run after
//! lbd has exited. A clean stop followed by a start (of lbd, or of another
//! XDP program) would find the interface still taken. aya has no
//! link-detach call and does not hand out the fd inside an `FdLink`, so
//! [`detach_pinned`] takes a handle from the pin (BPF_OBJ_GET) and issues
//! BPF_LINK_DETACH on it.
//!
//! Putting a pinned link's previous program back ([`relink_pinned`]) after
//! a start that failed half-way needs that program held by id before the
//! swap (BPF_PROG_GET_FD_BY_ID, [`prog_by_id`]) and a link update with a
//! raw program fd (BPF_LINK_UPDATE), which aya does not offer either.
//! Nor does it make an XDP link for a program it did not load
//! ([`pin_xdp_link`]: BPF_LINK_CREATE and BPF_OBJ_PIN), which is how a
//! start that changed a link's mode and then failed gives the interface
//! its previous program back in its previous mode.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

/// bpf(2) command `cmd` with `attr`, a prefix of `union bpf_attr`
/// (linux/bpf.h) laid out for that command. Returns the call's
/// non-negative result (0, or a new fd).
///
/// # Safety
/// `attr` is a valid prefix for `cmd`, and every buffer it points at is
/// alive for the call and as large as the kernel reads or writes.
pub(super) unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: the caller's promise; the size passed is `attr`'s own.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>()) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// The `obj_pin`/`obj_get` member of `union bpf_attr`, up to `file_flags`.
#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// The `link_create` member of `union bpf_attr`, up to `flags` (for an
/// XDP link, the XDP_FLAGS_* mode).
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// The `link_detach` member of `union bpf_attr`.
#[repr(C)]
struct DetachAttr {
    link_fd: u32,
}

/// The `link_update` member of `union bpf_attr`.
#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// The id member of `union bpf_attr` (BPF_*_GET_FD_BY_ID).
#[repr(C)]
struct GetByIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

// bpf(2) commands (`enum bpf_cmd`, linux/bpf.h), every one used here or
// in `batch`.
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
pub(super) const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
pub(super) const BPF_MAP_LOOKUP_AND_DELETE_BATCH: libc::c_long = 25;
pub(super) const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
pub(super) const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;
/// `enum bpf_attach_type`'s BPF_XDP.
const BPF_XDP: u32 = 37;
/// linux/if_link.h: XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE.
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// A new fd the kernel returned.
fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    // SAFETY: the kernel just returned this fd to us (close-on-exec), and
    // nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `path` as the kernel takes a pathname.
fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// A handle on the object pinned at `path`.
fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let name = c_path(path)?;
    let mut get = ObjAttr { pathname: name.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    // SAFETY: an obj_get prefix; `name` outlives the call.
    owned(unsafe { bpf(BPF_OBJ_GET, &mut get) }?)
}

/// The XDP link pinned at `path`, as the kernel shows its descriptor
/// (`/proc/self/fdinfo`): the id of the program it runs and the index of
/// the device it is attached to, 0 once that device was deleted (the link
/// is severed). None when the object pinned there is not an XDP link (a
/// map's info read as a link's would give a made-up program id).
pub(super) fn pinned_xdp_link(path: &Path) -> io::Result<Option<(u32, u32)>> {
    let fd = obj_get(path)?;
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))?;
    let field =
        |name: &str| info.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':'))).map(str::trim);
    if field("link_type") != Some("xdp") {
        return Ok(None);
    }
    let number = |name: &str| field(name).and_then(|v| v.parse::<u32>().ok());
    Ok(number("prog_id").zip(number("ifindex")))
}

/// Detach the link pinned at `path` from its interface now. The pin stays
/// (the caller removes it); the link object, defunct, goes with its last
/// reference.
pub(super) fn detach_pinned(path: &Path) -> io::Result<()> {
    let fd = obj_get(path)?;
    let mut detach = DetachAttr { link_fd: fd.as_raw_fd().cast_unsigned() };
    // SAFETY: a link_detach prefix, no pointers.
    unsafe { bpf(BPF_LINK_DETACH, &mut detach) }.map(drop)
}

/// A reference to the loaded program `id` (it stays loaded while held).
pub(super) fn prog_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut get = GetByIdAttr { id, next_id: 0, open_flags: 0 };
    // SAFETY: a get-by-id prefix, no pointers.
    owned(unsafe { bpf(BPF_PROG_GET_FD_BY_ID, &mut get) }?)
}

/// Swap `prog` into the link pinned at `path` (atomically, as any link
/// update).
pub(super) fn relink_pinned(path: &Path, prog: &OwnedFd) -> io::Result<()> {
    let link = obj_get(path)?;
    let mut update = LinkUpdateAttr {
        link_fd: link.as_raw_fd().cast_unsigned(),
        new_prog_fd: prog.as_raw_fd().cast_unsigned(),
        flags: 0,
        old_prog_fd: 0,
    };
    // SAFETY: a link_update prefix, no pointers.
    unsafe { bpf(BPF_LINK_UPDATE, &mut update) }.map(drop)
}

/// Attach `prog` to the device `ifindex` by a new XDP link, in generic
/// (skb) mode or native (driver) mode, and pin the link at `path`.
pub(super) fn pin_xdp_link(prog: &OwnedFd, ifindex: u32, generic: bool, path: &Path) -> io::Result<()> {
    let mut create = LinkCreateAttr {
        prog_fd: prog.as_raw_fd().cast_unsigned(),
        target_ifindex: ifindex,
        attach_type: BPF_XDP,
        flags: if generic { XDP_FLAGS_SKB_MODE } else { XDP_FLAGS_DRV_MODE },
    };
    // SAFETY: a link_create prefix, no pointers.
    let link = owned(unsafe { bpf(BPF_LINK_CREATE, &mut create) }?)?;
    let name = c_path(path)?;
    let mut pin = ObjAttr { pathname: name.as_ptr() as u64, bpf_fd: link.as_raw_fd().cast_unsigned(), file_flags: 0 };
    // SAFETY: an obj_pin prefix; `name` outlives the call. On failure the
    // link goes with `link`, its only reference.
    unsafe { bpf(BPF_OBJ_PIN, &mut pin) }.map(drop)
}

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

/// The `link_detach` member of `union bpf_attr`.
#[repr(C)]
struct DetachAttr {
    link_fd: u32,
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;

/// Detach the link pinned at `path` from its interface now. The pin stays
/// (the caller removes it); the link object, defunct, goes with its last
/// reference.
pub(super) fn detach_pinned(path: &Path) -> io::Result<()> {
    let name = CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut get = ObjAttr { pathname: name.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    // SAFETY: an obj_get prefix; `name` outlives the call.
    let fd = unsafe { bpf(BPF_OBJ_GET, &mut get) }?;
    let fd = i32::try_from(fd).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    // SAFETY: the kernel just returned this fd to us (close-on-exec), and
    // nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut detach = DetachAttr { link_fd: fd.as_raw_fd().cast_unsigned() };
    // SAFETY: a link_detach prefix, no pointers.
    unsafe { bpf(BPF_LINK_DETACH, &mut detach) }.map(drop)
}

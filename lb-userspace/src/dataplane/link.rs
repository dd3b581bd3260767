//! Detaching a pinned XDP link at once: BPF_OBJ_GET on its pin for a
//! handle, then BPF_LINK_DETACH.
//!
//! Removing the pin alone does not detach when the call returns: bpffs
//! frees the pin's inode after an RCU grace period, and the link's last
//! reference is then dropped from a work queue, which can run after lbd
//! has exited. A clean stop followed by a start (of lbd, or of another
//! XDP program) would find the interface still taken. Kept here, on
//! `libc::syscall`, because aya 0.14 has no link-detach call and does not
//! hand out the fd inside an `FdLink`.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

/// The `obj_pin`/`obj_get` member of `union bpf_attr` (linux/bpf.h), up
/// to `file_flags`.
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
    // SAFETY: `get` is a valid bpf_attr prefix for BPF_OBJ_GET and `name`
    // outlives the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, std::ptr::from_mut(&mut get), size_of::<ObjAttr>()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    // SAFETY: the kernel just returned this fd to us (close-on-exec), and
    // nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut detach = DetachAttr { link_fd: fd.as_raw_fd().cast_unsigned() };
    // SAFETY: `detach` is a valid bpf_attr prefix for BPF_LINK_DETACH.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_LINK_DETACH, std::ptr::from_mut(&mut detach), size_of::<DetachAttr>())
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

//! End-to-end test support for the load balancer: a network-namespace lab
//! ([`lab`]) plus the `lab-backend` / `lab-client` helper binaries.
#![expect(unused_crate_dependencies, reason = "used by the lab binaries and the tests")]

pub mod browser;
pub mod fixture;
pub mod flood;
pub mod fuzz;
pub mod harness;
pub mod http1;
pub mod lab;
pub mod lbd;
pub mod paced;

/// Fails unless the effective user is root.
pub fn require_root() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!("this needs root (it creates network namespaces and loads BPF programs); run it as root");
    }
    Ok(())
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (best effort), so the
/// helper binaries can hold thousands of sockets.
pub fn raise_nofile_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) } == 0 && lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: `lim` is a valid rlimit; failure is harmless.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) };
    }
}

//! lbd (the agent) and lbctl (the CLI) share this library.
//!
//! - `config`: parse and validate the YAML, every problem at once.
//! - `maglev`, `wrr`: selection-table builders (pure, host-tested).
//! - `dataplane`: the only module touching BPF maps.
//! - `agent`: the running state (dataplane + config): reload, sweep.
//! - `api`: the control socket, its requests and the status report.
pub mod agent;
pub mod api;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod health;
pub mod maglev;
pub mod metrics;
pub mod netdev;
pub mod paths;
pub mod render;
pub mod watch;
pub mod wrr;

/// True when running as root (needed to load BPF and attach XDP).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

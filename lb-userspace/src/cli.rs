//! Command-line definitions of lbd and lbctl, in the library so that shell
//! completions and man pages are generated from the same clap definitions
//! (`cargo xtask install`).
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::{config::DEFAULT_CONTROL_SOCKET, sched::Scheduler};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The XDP layer-4 load balancer agent.
#[derive(Debug, Parser)]
#[command(name = "lbd", version, about)]
pub struct LbdArgs {
    /// Configuration file (YAML).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Validate the configuration and exit without touching the system.
    #[arg(long)]
    pub check: bool,
}

/// Control the XDP load balancer agent (lbd).
#[derive(Debug, Parser)]
#[command(name = "lbctl", version, about)]
pub struct LbctlArgs {
    /// lbd's control socket.
    #[arg(long, global = true, env = "LBD_SOCKET", default_value = DEFAULT_CONTROL_SOCKET)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Services, backends and their counters.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Live view of every backend, refreshed every second (q or Ctrl-C quits).
    Watch,
    /// Re-read lbd's configuration file and apply the difference (a file
    /// with any problem is rejected whole, and every problem is listed).
    Reload,
    /// Change a service's backends (saved to lbd's configuration file).
    Backend {
        #[command(subcommand)]
        action: BackendAction,
    },
    /// Add or remove a service (saved to lbd's configuration file).
    Service {
        #[command(subcommand)]
        action: ServiceAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum BackendAction {
    /// Add backends: lbctl backend add web 10.20.0.14:8080 [more...] [--weight N]
    /// (IPv6: [fd00:20::14]:8080)
    Add {
        service: String,
        #[arg(required = true, value_name = "ADDRESS:PORT")]
        backends: Vec<String>,
        #[arg(long, default_value_t = 1)]
        weight: u32,
    },
    /// Remove backends (their open connections continue until they close).
    Remove {
        service: String,
        #[arg(required = true, value_name = "ADDRESS:PORT")]
        backends: Vec<String>,
    },
    /// Set the weight: lbctl backend weight web 10.20.0.11:8080 5
    Weight {
        service: String,
        #[arg(value_name = "ADDRESS:PORT")]
        backend: String,
        weight: u32,
    },
    /// Drain: no new connections, open ones continue; the weight is kept.
    Drain {
        service: String,
        #[arg(required = true, value_name = "ADDRESS:PORT")]
        backends: Vec<String>,
    },
    /// Undo a drain.
    Enable {
        service: String,
        #[arg(required = true, value_name = "ADDRESS:PORT")]
        backends: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ServiceAction {
    /// Add a service: lbctl service add api --vip 10.10.0.101 --port 443 --backend 10.20.0.11:8443
    Add {
        name: String,
        #[arg(long)]
        vip: String,
        #[arg(long)]
        port: u16,
        #[arg(long, default_value = "tcp")]
        protocol: String,
        /// One of the schedulers of the configuration file.
        #[arg(long, default_value = Scheduler::Maglev.name())]
        scheduler: String,
        /// How packets reach the backends: nat (the default) or dsr
        /// (direct server return: backends hold the VIP and answer the
        /// clients themselves; their port is the service's).
        #[arg(long, value_name = "nat|dsr")]
        forwarding: Option<String>,
        /// ADDRESS:PORT or ADDRESS:PORT:WEIGHT, IPv6 as [ADDRESS]:PORT[:WEIGHT];
        /// the address alone for a dsr service (the service's port); repeat
        /// for more.
        #[arg(long = "backend", value_name = "ADDRESS:PORT[:WEIGHT]")]
        backends: Vec<String>,
    },
    /// Remove a service.
    Remove { name: String },
}

/// One `--backend` of `lbctl service add` as a backend entry of the
/// configuration file: `ADDRESS:PORT[:WEIGHT]`, an IPv6 address in brackets
/// (`[fd00:20::11]:8080:2`), or an address alone (`10.20.0.11`,
/// `fd00:20::11`, `[fd00:20::11]`), which leaves the port out for the
/// configuration's rules to judge (a DSR backend takes its service's).
/// Addresses and ranges are checked by lbd's configuration parser, as for
/// the file.
pub fn backend_spec(s: &str) -> Result<serde_json::Value, String> {
    let bad = || format!("{s:?} is not ADDRESS:PORT or ADDRESS:PORT:WEIGHT (IPv6: [ADDRESS]:PORT[:WEIGHT])");
    let (addr, rest): (&str, Vec<&str>) = if let Some(inner) = s.strip_prefix('[') {
        let (addr, after) = inner.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (addr, Vec::new()),
            a => (addr, a.strip_prefix(':').ok_or_else(bad)?.split(':').collect()),
        }
    } else if s.parse::<std::net::IpAddr>().is_ok() {
        (s, Vec::new())
    } else {
        let mut parts = s.split(':');
        (parts.next().unwrap_or_default(), parts.collect())
    };
    let (port, weight) = match rest.as_slice() {
        [] => (None, None),
        [p] => (Some(*p), None),
        [p, w] => (Some(*p), Some(*w)),
        _ => return Err(bad()),
    };
    if addr.is_empty() {
        return Err(bad());
    }
    let mut v = serde_json::json!({ "address": addr });
    if let Some(p) = port {
        let p: u64 = p.parse().map_err(|_| format!("{s:?}: port {p:?} is not a number"))?;
        v["port"] = p.into();
    }
    if let Some(w) = weight {
        let w: i64 = w.parse().map_err(|_| format!("{s:?}: weight {w:?} is not a number"))?;
        v["weight"] = w.into();
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::backend_spec;

    #[test]
    fn service_backends_take_both_families_and_the_address_alone() {
        let ok = |s: &str| backend_spec(s).unwrap();
        assert_eq!(ok("10.20.0.11:8080"), json!({ "address": "10.20.0.11", "port": 8080 }));
        assert_eq!(ok("10.20.0.11:8080:3"), json!({ "address": "10.20.0.11", "port": 8080, "weight": 3 }));
        assert_eq!(ok("[fd00:20::11]:8080"), json!({ "address": "fd00:20::11", "port": 8080 }));
        assert_eq!(ok("[fd00:20::11]:8080:3"), json!({ "address": "fd00:20::11", "port": 8080, "weight": 3 }));
        // The address alone (a DSR backend: the service's port).
        assert_eq!(ok("10.20.0.11"), json!({ "address": "10.20.0.11" }));
        assert_eq!(ok("fd00:20::11"), json!({ "address": "fd00:20::11" }));
        assert_eq!(ok("[fd00:20::11]"), json!({ "address": "fd00:20::11" }));
        for bad in ["", ":8080", "[fd00:20::11", "[fd00:20::11]8080", "10.20.0.11:8080:1:2", "[fd00::1]:x", "a:1:w"] {
            assert!(backend_spec(bad).is_err(), "{bad:?} accepted");
        }
    }
}

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
        /// ADDRESS:PORT or ADDRESS:PORT:WEIGHT; repeat for more.
        #[arg(long = "backend", value_name = "ADDRESS:PORT[:WEIGHT]")]
        backends: Vec<String>,
    },
    /// Remove a service.
    Remove { name: String },
}

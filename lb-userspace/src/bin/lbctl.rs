//! lbctl: talk to a running lbd over its control socket.
use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use lb_userspace::{
    api::{self, Request, Status},
    config::DEFAULT_CONTROL_SOCKET,
};

/// Control the XDP load balancer agent (lbd).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// lbd's control socket.
    #[arg(long, global = true, env = "LBD_SOCKET", default_value = DEFAULT_CONTROL_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Services, backends and their counters.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Re-read lbd's configuration file and apply the difference (a file
    /// with any problem is rejected whole, and every problem is listed).
    Reload,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.command {
        Command::Reload => match api::call(&args.socket, &Request::Reload) {
            Ok(v) => {
                let list = |k: &str| {
                    let items: Vec<String> =
                        v[k].as_array().into_iter().flatten().filter_map(|x| x.as_str().map(String::from)).collect();
                    if items.is_empty() { "-".to_owned() } else { items.join(", ") }
                };
                println!(
                    "reloaded: {} services (added {}; removed {}; changed {})",
                    v["services"],
                    list("added"),
                    list("removed"),
                    list("changed")
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("lbctl: reload rejected, running configuration unchanged:\n{e}");
                ExitCode::from(1)
            }
        },
        Command::Status { json } => match api::call(&args.socket, &Request::Status) {
            Ok(v) => {
                if json {
                    println!("{}", serde_json::to_string_pretty(&v).expect("JSON value prints"));
                } else {
                    match serde_json::from_value::<Status>(v) {
                        Ok(s) => print!("{}", render(&s)),
                        Err(e) => {
                            eprintln!("lbctl: lbd sent a status this lbctl cannot read: {e}");
                            return ExitCode::from(1);
                        }
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("lbctl: {e}");
                ExitCode::from(1)
            }
        },
    }
}

fn render(s: &Status) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let ifaces: Vec<String> = s.interfaces.iter().map(|a| format!("{} ({})", a.interface, a.mode)).collect();
    let _ = writeln!(out, "interfaces: {}", if ifaces.is_empty() { "none".into() } else { ifaces.join(", ") });
    for svc in &s.services {
        let fairness = svc.fairness.map_or_else(|| "-".to_owned(), |f| format!("{f:.4}"));
        let _ = writeln!(
            out,
            "\nservice {}  {}:{}/{}  scheduler {}  new flows {}  fairness {}",
            svc.name, svc.vip, svc.port, svc.protocol, svc.scheduler, svc.new_flows, fairness
        );
        let _ = writeln!(
            out,
            "  {:<21} {:>6} {:>8} {:>8} {:>10} {:>7} {:>10} {:>12} {:>10} {:>12}",
            "BACKEND", "WEIGHT", "EXPECTED", "OBSERVED", "NEW_FLOWS", "ACTIVE", "PKTS_IN", "BYTES_IN", "PKTS_OUT", "BYTES_OUT"
        );
        for b in &svc.backends {
            let _ = writeln!(
                out,
                "  {:<21} {:>6} {:>7.1}% {:>7.1}% {:>10} {:>7} {:>10} {:>12} {:>10} {:>12}",
                format!("{}:{}", b.address, b.port),
                b.weight,
                b.expected_share * 100.0,
                b.observed_share * 100.0,
                b.new_flows,
                b.active_flows,
                b.packets_in,
                b.bytes_in,
                b.packets_out,
                b.bytes_out
            );
        }
    }
    let drops: Vec<String> = s.counters.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "\ndatapath counters: {}", if drops.is_empty() { "all zero".into() } else { drops.join(" ") });
    out
}

//! lbctl: talk to a running lbd over its control socket.
#![expect(unused_crate_dependencies, reason = "used by the library and the other binaries")]
use std::process::ExitCode;

use clap::Parser as _;
use lb_userspace::{
    api::{self, Request},
    cli::{BackendAction, Command, LbctlArgs as Args, ServiceAction, backend_spec},
    dataplane::TcLink,
    report::Status,
};

/// Send each request in turn; stop at the first refusal.
fn send_all(socket: &std::path::Path, reqs: Vec<Request>) -> ExitCode {
    for req in reqs {
        match api::call(socket, &req) {
            Ok(_) => println!("ok: {}", describe(&req)),
            Err(e) => {
                eprintln!("lbctl: {}: refused, nothing changed:\n{e}", describe(&req));
                return ExitCode::from(1);
            }
        }
    }
    ExitCode::SUCCESS
}

fn describe(req: &Request) -> String {
    match req {
        Request::BackendAdd { service, backend, weight } => format!("{service}: added {backend} (weight {weight})"),
        Request::BackendRemove { service, backend } => format!("{service}: removed {backend}"),
        Request::BackendWeight { service, backend, weight } => format!("{service}: {backend} weight {weight}"),
        Request::BackendDrain { service, backend } => format!("{service}: draining {backend}"),
        Request::BackendEnable { service, backend } => format!("{service}: enabled {backend}"),
        Request::ServiceAdd { spec } => format!("added service {}", spec["name"]),
        Request::ServiceRemove { service } => format!("removed service {service}"),
        Request::Status | Request::Reload => String::new(),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.command {
        Command::Watch => match lb_userspace::watch::run(&args.socket) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lbctl: {e}");
                ExitCode::from(1)
            }
        },
        Command::Backend { action } => {
            let reqs = match action {
                BackendAction::Add { service, backends, weight } => backends
                    .into_iter()
                    .map(|backend| Request::BackendAdd { service: service.clone(), backend, weight })
                    .collect(),
                BackendAction::Remove { service, backends } => backends
                    .into_iter()
                    .map(|backend| Request::BackendRemove { service: service.clone(), backend })
                    .collect(),
                BackendAction::Weight { service, backend, weight } => {
                    vec![Request::BackendWeight { service, backend, weight }]
                }
                BackendAction::Drain { service, backends } => backends
                    .into_iter()
                    .map(|backend| Request::BackendDrain { service: service.clone(), backend })
                    .collect(),
                BackendAction::Enable { service, backends } => backends
                    .into_iter()
                    .map(|backend| Request::BackendEnable { service: service.clone(), backend })
                    .collect(),
            };
            send_all(&args.socket, reqs)
        }
        Command::Service { action } => {
            let req = match action {
                ServiceAction::Add { name, vip, port, protocol, scheduler, forwarding, backends } => {
                    let mut list = Vec::new();
                    for b in &backends {
                        match backend_spec(b) {
                            Ok(v) => list.push(v),
                            Err(e) => {
                                eprintln!("lbctl: --backend {e}");
                                return ExitCode::from(2);
                            }
                        }
                    }
                    let mut spec = serde_json::json!({
                        "name": name, "vip": vip, "port": port, "protocol": protocol,
                        "scheduler": scheduler, "backends": list,
                    });
                    if let Some(f) = forwarding {
                        spec["forwarding"] = f.into();
                    }
                    Request::ServiceAdd { spec }
                }
                ServiceAction::Remove { name } => Request::ServiceRemove { service: name },
            };
            send_all(&args.socket, vec![req])
        }
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
    if s.interfaces.is_empty() {
        let _ = writeln!(out, "interfaces: none");
    }
    for a in &s.interfaces {
        if a.missing {
            let _ = writeln!(
                out,
                "interface {} MISSING: XDP is not on it (the device is gone or was replaced); attached again when it is there",
                a.interface
            );
        } else {
            let _ = writeln!(out, "interface {} XDP {} ({})", a.interface, a.mode, a.reason);
        }
        let tc = match a.tc {
            None => continue,
            Some(TcLink::Pinned) => "pinned",
            Some(TcLink::Owned) => "lbd's own (not pinned: gone while lbd is down)",
            Some(TcLink::Failed) => "FAILED to attach: DSR services' GSO packets (bulk uploads) are dropped",
        };
        let _ = writeln!(out, "  tc ingress link for DSR services' GSO packets: {tc}");
    }
    for r in &s.paths {
        let _ = writeln!(out, "  path {} -> {}: {} ({})", r.ingress, r.egress, r.path.describe(), r.reason);
    }
    let count = |k: &str| s.counters.get(k).copied().unwrap_or(0);
    let kernel: u64 =
        lb_common::counter::KERNEL_PATH.iter().map(|&i| count(lb_common::counter::NAMES[i as usize])).sum();
    let total = count("xdp_redirect") + kernel;
    if total > 0 {
        // XDP_TX (a one-arm gateway's packets back out of their ingress)
        // is part of the XDP share.
        let tx = match count("xdp_tx") {
            0 => String::new(),
            n => format!(" ({n} of them back out of their interface by XDP_TX)"),
        };
        let _ = writeln!(
            out,
            "forwarded packets: {} by XDP redirect ({:.1}%){tx}, {} through the kernel",
            count("xdp_redirect"),
            100.0 * count("xdp_redirect") as f64 / total as f64,
            kernel
        );
    }
    if let Some(b) = &s.bgp {
        for p in &b.peers {
            let _ = writeln!(out, "bgp peer {} AS{}: {}", p.address, p.asn, p.state);
        }
        if let Some(e) = &b.error {
            let _ = writeln!(out, "bgp error: {e}");
        }
    }
    for svc in &s.services {
        let fairness = svc.fairness.map_or_else(|| "-".to_owned(), |f| format!("{f:.4}"));
        let bgp = match svc.announced {
            Some(true) => "  bgp announced",
            Some(false) => "  bgp withdrawn",
            None => "",
        };
        let _ = writeln!(
            out,
            "\nservice {}  {}/{}  {}  scheduler {}  new flows {}  fairness {}{bgp}",
            svc.name,
            std::net::SocketAddr::new(svc.vip, svc.port),
            svc.protocol,
            svc.forwarding,
            svc.scheduler,
            svc.new_flows,
            fairness
        );
        let _ = writeln!(
            out,
            "  {:<21} {:<5} {:>6} {:>9} {:>8} {:>8} {:>10} {:>7} {:>10} {:>12} {:>10} {:>12} {:>9}",
            "BACKEND",
            "STATE",
            "WEIGHT",
            "EFFECTIVE",
            "EXPECTED",
            "OBSERVED",
            "NEW_FLOWS",
            "ACTIVE",
            "PKTS_IN",
            "BYTES_IN",
            "PKTS_OUT",
            "BYTES_OUT",
            "RESPONSE"
        );
        for b in &svc.backends {
            let _ = writeln!(
                out,
                "  {:<21} {:<5} {:>6} {:>9} {:>7.1}% {:>7.1}% {:>10} {:>7} {:>10} {:>12} {:>10} {:>12} {:>9}",
                std::net::SocketAddr::new(b.address, b.port).to_string(),
                format!("{:?}", b.state).to_lowercase(),
                b.weight,
                b.effective_weight,
                b.expected_share * 100.0,
                b.observed_share * 100.0,
                b.new_flows,
                b.active_flows,
                b.packets_in,
                b.bytes_in,
                b.packets_out,
                b.bytes_out,
                b.response_time_ms.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.1}ms"))
            );
        }
    }
    let f = &s.flood;
    let _ = writeln!(
        out,
        "\nflood protection: flow table IPv4 {}/{}, IPv6 {}/{} entries{}; new flows above {} per second and CPU ({} so far) and into a full table ({} so far) routed by hash without an entry; {} replies without an entry; {} half-open flows expired after {}s",
        f.flow_tables.ipv4.entries,
        f.flow_tables.ipv4.capacity,
        f.flow_tables.ipv6.entries,
        f.flow_tables.ipv6.capacity,
        f.last_sweep_ms.map(|ms| format!(" (last sweep {ms} ms)")).unwrap_or_default(),
        if f.new_flow_rate_per_cpu == 0 { "no limit".to_owned() } else { f.new_flow_rate_per_cpu.to_string() },
        count("flood_rate"),
        count("table_full"),
        count("stateless_reply"),
        f.half_open_expired,
        f.half_open_timeout
    );
    let drops: Vec<String> = s.counters.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect();
    let _ =
        writeln!(out, "\ndatapath counters: {}", if drops.is_empty() { "all zero".into() } else { drops.join(" ") });
    out
}

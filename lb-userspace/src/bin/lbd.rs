//! lbd: the load-balancer agent. Loads and attaches the XDP program,
//! programs the pool into BPF maps and serves the control socket.
#![expect(unused_crate_dependencies, reason = "used by the library and the other binaries")]
use std::{
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use clap::Parser as _;
use lb_userspace::{
    agent::Agent,
    api,
    cli::{LbdArgs as Args, LogFormat},
    config::{self, System},
    dataplane::Dataplane,
    tasks::{Periods, Tasks, lock},
};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};
use tracing::{error, info, warn};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);

    let cfg = match config::load(&args.config, &System) {
        Ok(c) => c,
        Err(e) => {
            for p in &e.problems {
                eprintln!("lbd: invalid config: {p}");
            }
            return ExitCode::from(2);
        }
    };
    if args.check {
        println!("{}: valid ({} services)", args.config.display(), cfg.services.len());
        return ExitCode::SUCCESS;
    }
    if !lb_userspace::is_root() {
        eprintln!("lbd: must run as root: it loads an XDP program and attaches it to network interfaces");
        return ExitCode::from(1);
    }
    // glibc's malloc raises its mmap threshold to the size of each large
    // block freed, after which lbd's 256 KB selection tables (one per
    // service, rebuilt on every change) come from its heaps and stay there,
    // fragmented, once freed. Fixed at its default, they are mapped and
    // given back: at 255 services lbd's anonymous memory peaked at 170 MB at
    // start and settled at 104 MB, against 276 MB and 149 MB. Set before
    // any other thread exists, as glibc requires.
    #[cfg(target_env = "gnu")]
    // SAFETY: a plain call with constant arguments; no other thread yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lbd: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    // Where to find ourselves for a graceful restart (SIGUSR2): the path as
    // it is now, so that a binary replaced there since (an upgrade) is the
    // one that starts.
    let exe = std::env::current_exe().ok().map(|e| PathBuf::from(e.to_string_lossy().trim_end_matches(" (deleted)")));
    match rt.block_on(run(cfg, args.config, exe.clone())) {
        Ok(Exit::Stopped) => ExitCode::SUCCESS,
        Ok(Exit::Restart) => {
            drop(rt);
            let Some(exe) = exe else {
                eprintln!("lbd: cannot find my own executable to restart; the datapath stays pinned and forwarding");
                return ExitCode::from(1);
            };
            let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
            let err = std::os::unix::process::CommandExt::exec(std::process::Command::new(&exe).args(&args));
            eprintln!("lbd: restarting {}: {err}; the datapath stays pinned and forwarding", exe.display());
            ExitCode::from(1)
        }
        Err(e) => {
            let text = lb_userspace::error_text(&e);
            error!("{text}");
            eprintln!("lbd: {text}");
            ExitCode::from(1)
        }
    }
}

/// Forwarding the kernel must allow on the configured interfaces, for the
/// address families of the configured services (IPv4 when there are
/// none): the datapath's FIB lookup refuses to route a packet that
/// arrives on a device with forwarding off, and the kernel, which the
/// packet then falls back to, does not forward it either (IPv6 with
/// `all` on but the device's own off: it does, by the slow path).
fn forwarding_warnings(cfg: &config::Config) -> Vec<String> {
    let off = |path: String| std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "0");
    // The configured interfaces whose own forwarding is off, for `family`
    // (`ipv4`, `ipv6`).
    let devices_off = |family: &str| -> Vec<&String> {
        cfg.interfaces.iter().filter(|i| off(format!("/proc/sys/net/{family}/conf/{i}/forwarding"))).collect()
    };
    let v6 = cfg.services.iter().any(|s| s.vip.is_ipv6());
    let v4 = cfg.services.iter().any(|s| s.vip.is_ipv4()) || !v6;
    let mut w = Vec::new();
    let consequence = "the FIB refuses to route, so those packets fall back to the kernel, which will not forward them";
    if v4 && off("/proc/sys/net/ipv4/ip_forward".into()) {
        w.push(format!("net.ipv4.ip_forward is 0: for every IPv4 packet {consequence}"));
    } else if v4 {
        for i in devices_off("ipv4") {
            w.push(format!("net.ipv4.conf.{i}.forwarding is 0: for IPv4 packets arriving on {i} {consequence}"));
        }
    }
    if v6 && off("/proc/sys/net/ipv6/conf/all/forwarding".into()) {
        w.push(format!("net.ipv6.conf.all.forwarding is 0: for every IPv6 packet {consequence}"));
    } else if v6 {
        // The IPv6 FIB lookup reads the arriving device's own setting too,
        // but the kernel's IPv6 forwarding reads only `all`: such packets
        // still pass, by the kernel's slower path (fib_fallback).
        for i in devices_off("ipv6") {
            w.push(format!(
                "net.ipv6.conf.{i}.forwarding is 0: the FIB refuses to route IPv6 packets arriving on {i}, so they leave by the kernel's forwarding (fib_fallback), not by XDP redirect"
            ));
        }
    }
    w
}

/// Before a graceful restart: the binary it would run (`exe`) checks the
/// configuration file it would read (`--check`, with this run's
/// arguments). A restart into a file that no longer passes, or a binary
/// that cannot run, would leave the datapath without its agent (no health
/// checks, no control socket, no metrics) until someone starts one; this
/// lbd stays instead, and says why. What only the start itself can find
/// (an interface that refuses the mode) still ends the new lbd.
async fn restart_check(exe: Option<&std::path::Path>) -> Result<(), String> {
    let exe = exe.ok_or("cannot find my own executable")?;
    let run = tokio::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .arg("--check")
        .env("LBD_LOG", "error")
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(std::time::Duration::from_secs(30), run).await {
        Err(_) => return Err(format!("{} --check did not finish in 30 s", exe.display())),
        Ok(Err(e)) => return Err(format!("running {} --check: {e}", exe.display())),
        Ok(Ok(out)) => out,
    };
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Err(format!("{} --check failed ({}):\n{}", exe.display(), out.status, said.trim_end()))
}

/// How the agent ended.
enum Exit {
    /// SIGTERM/SIGINT: detached and unpinned, nothing left behind.
    Stopped,
    /// SIGUSR2: the datapath stays pinned and forwarding; start again
    /// (the same path, so an upgraded binary) and adopt it.
    Restart,
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_env("LBD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a terminal: logs in files and journals stay plain.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(cfg: config::Config, path: PathBuf, exe: Option<PathBuf>) -> anyhow::Result<Exit> {
    for w in forwarding_warnings(&cfg) {
        warn!("{w}");
    }
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;

    let listener = api::bind(&cfg.control_socket).context("opening the control socket")?;
    let metrics = tokio::net::TcpListener::bind(cfg.metrics_listen)
        .await
        .with_context(|| format!("listening for metrics on {}", cfg.metrics_listen))?;
    let result = serve(&cfg, path, exe, listener, metrics, &mut sigterm, &mut sigint).await;
    if let Err(e) = std::fs::remove_file(&cfg.control_socket) {
        warn!(path = %cfg.control_socket.display(), error = %e, "removing the control socket");
    }
    result
}

async fn serve(
    cfg: &config::Config,
    path: PathBuf,
    exe: Option<PathBuf>,
    listener: tokio::net::UnixListener,
    metrics: tokio::net::TcpListener,
    sigterm: &mut tokio::signal::unix::Signal,
    sigint: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<Exit> {
    let adopting = Dataplane::pinned_at(&cfg.pin_path);
    let mut dp = Dataplane::load(cfg).context("loading the datapath")?;
    let logger = match aya_log::EbpfLogger::init(dp.ebpf_mut()) {
        // SAFETY: the logger owns its ring-buffer fd and moves into the
        // AsyncFd, so the fd outlives the registration.
        Ok(l) => match unsafe { AsyncFd::register(l) } {
            Ok(fd) => Some(fd),
            Err(_) => {
                warn!("kernel-side logs unavailable: cannot poll the log buffer");
                None
            }
        },
        Err(e) => {
            warn!(error = %e, "kernel-side logs unavailable");
            None
        }
    };
    let mut agent = Agent::new(dp, cfg.clone(), path);
    // Fill the maps before attaching, so the first packet sees the whole pool.
    let programmed = agent.apply().context("programming the services");
    if let Err(e) = programmed.and_then(|()| agent.dp.attach(&cfg.interfaces, cfg.xdp_mode).context("attaching XDP")) {
        if adopting {
            // The running datapath stays; a layout migration this start
            // began is undone while the old program is still the one in use.
            agent.dp.abandon_migration();
        } else {
            // Nothing of ours is forwarding yet: leave nothing pinned.
            agent.dp.shutdown();
        }
        return Err(e);
    }
    // A migration from an older pinned layout: the new program is in
    // place on every interface; take over the old program's last flows.
    if let Err(e) = agent.dp.finish_migration() {
        warn!(error = %e, "finishing the migration of the pinned datapath");
    }
    // The signal handlers before the control socket answers: a caller
    // that takes an answer for "started" may send SIGHUP or SIGUSR2 at
    // once, and before the handlers their default action ended lbd (a
    // restart test under a CPU-bound process met that).
    let mut sighup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let mut sigusr2 = signal(SignalKind::user_defined2()).context("installing the SIGUSR2 handler")?;
    let agent = Arc::new(Mutex::new(agent));
    let api = tokio::spawn(api::serve(listener, agent.clone()));
    let exporter = tokio::spawn(lb_userspace::metrics::serve(metrics, agent.clone()));
    // Half-open flows are expired within half their timeout of being due
    // (sweeps every 1 to 5 s).
    let half_open = std::time::Duration::from_secs(u64::from(cfg.flood.half_open_timeout));
    let sweep = (half_open / 2).clamp(std::time::Duration::from_secs(1), Periods::default().sweep);
    let background = Tasks::start(&agent, Periods { sweep, ..Periods::default() });
    // VIP announcement (BIRD runs while the config has a bgp: section),
    // polled right here on the main thread (see announce_vips); a restart
    // sets `keep_bird` so that BIRD and its sessions outlive the exec.
    let keep_bird = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut announcer = Box::pin(lb_userspace::tasks::announce_vips(
        agent.clone(),
        lb_userspace::tasks::ANNOUNCE_PERIOD,
        keep_bird.clone(),
    ));
    let logs = logger.map(|mut fd| {
        tokio::spawn(async move {
            loop {
                let Ok(mut guard) = fd.readable_mut().await else { return };
                guard.get_inner_mut().flush();
                guard.clear_ready();
            }
        })
    });
    info!(socket = %cfg.control_socket.display(), services = cfg.services.len(), "lbd running");

    let exit = loop {
        tokio::select! {
            _ = sigterm.recv() => { info!("SIGTERM: shutting down"); break Exit::Stopped }
            _ = sigint.recv() => { info!("SIGINT: shutting down"); break Exit::Stopped }
            _ = sigusr2.recv() => {
                match restart_check(exe.as_deref()).await {
                    Ok(()) => {
                        info!("SIGUSR2: restarting; the datapath keeps forwarding meanwhile");
                        keep_bird.store(true, std::sync::atomic::Ordering::SeqCst);
                        break Exit::Restart
                    }
                    Err(why) => error!("SIGUSR2: restart refused, lbd runs on as it was: {why}"),
                }
            }
            () = &mut announcer => unreachable!("the announcer never returns"),
            _ = sighup.recv() => {
                info!("SIGHUP: reloading the configuration");
                let agent = agent.clone();
                // The agent logs the outcome; a rejected config lists every problem.
                let r = tokio::task::spawn_blocking(move || lock(&agent).reload()).await;
                match r {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => warn!("reload rejected, running configuration unchanged:\n{e}"),
                    Err(e) => warn!(error = %e, "reload task failed"),
                }
            }
        }
    };
    // First of all: BIRD stops and the peers withdraw our VIPs, unless this
    // is a restart (BIRD then keeps announcing; the new lbd adopts it).
    drop(announcer);
    for task in [api, exporter] {
        task.abort();
        let _ = task.await;
    }
    background.stop().await;
    if let Some(l) = logs {
        l.abort();
        let _ = l.await;
    }
    // Under the lock, not by unwrapping the Arc: a control or metrics
    // connection that is still being answered may hold a clone, and must
    // not turn a stop or a restart into an error.
    match exit {
        Exit::Stopped => {
            lock(&agent).dp.shutdown();
            info!("detached and stopped");
        }
        Exit::Restart => info!(pin = %cfg.pin_path.display(), "handing over: the datapath stays pinned"),
    }
    Ok(exit)
}

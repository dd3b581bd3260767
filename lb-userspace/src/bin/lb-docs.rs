//! `lb-docs DIR`: write shell completions (bash, zsh, fish) and man pages
//! (section 8) for lbd and lbctl, generated from their clap definitions in
//! `lb_userspace::cli`. `cargo xtask install` runs it and installs the files.
//!
//! Layout under DIR:
//!
//! ```text
//! completions/bash/{lbd,lbctl}
//! completions/zsh/{_lbd,_lbctl}
//! completions/fish/{lbd.fish,lbctl.fish}
//! man/man8/{lbd.8,lbctl.8,lbctl-status.8,lbctl-backend.8,lbctl-backend-add.8,...}
//! ```
use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use clap::CommandFactory as _;
use clap_complete::Shell;
use lb_userspace::cli::{LbctlArgs, LbdArgs};

const MANUAL: &str = "XDP load balancer";

const LBD_EXTRA: &str = "\
SIGNALS:
  SIGHUP   re-read the configuration file and apply the difference (a file with any problem is rejected whole)
  SIGTERM  stop cleanly: detach the XDP programs and remove the pinned datapath
  SIGUSR2  restart gracefully: re-execute lbd, keeping the pinned datapath so traffic is not dropped (systemctl kill -s USR2 lbd)

FILES:
  /etc/lbd/lbd.yaml   configuration (by convention; see --config)
  /run/lbd            control socket (lbd.sock) and runtime state
  /sys/fs/bpf         bpffs where the datapath's maps and programs are pinned

METRICS:
  Prometheus/OpenMetrics exposition on http://127.0.0.1:9464/metrics by default.

PRIVILEGES:
  lbd needs root or the capabilities CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN and CAP_PERFMON.

SEE ALSO:
  lbctl(8)";

const LBCTL_EXTRA: &str = "\
ENVIRONMENT:
  LBD_SOCKET   lbd's control socket (as --socket)

SEE ALSO:
  lbd(8)";

fn main() {
    if let Err(e) = real_main() {
        eprintln!("lb-docs: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        bail!("usage: lb-docs DIR  (writes DIR/completions/{{bash,zsh,fish}}/ and DIR/man/man8/)");
    };
    let dir = PathBuf::from(dir);
    if dir.to_str().is_some_and(|s| s == "-h" || s == "--help") {
        println!("usage: lb-docs DIR  (writes DIR/completions/{{bash,zsh,fish}}/ and DIR/man/man8/)");
        return Ok(());
    }

    let lbd = LbdArgs::command().after_long_help(LBD_EXTRA);
    let lbctl = LbctlArgs::command().after_long_help(LBCTL_EXTRA);

    for (name, cmd) in [("lbd", &lbd), ("lbctl", &lbctl)] {
        completions(&dir, name, cmd)?;
    }
    let man_dir = dir.join("man/man8");
    mkdir(&man_dir)?;
    for cmd in [lbd, lbctl] {
        let mut cmd = cmd.disable_help_subcommand(true);
        cmd.build();
        man_pages(&man_dir, cmd)?;
    }
    Ok(())
}

fn mkdir(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes).and_then(|()| f.flush()).with_context(|| format!("writing {}", path.display()))?;
    println!("{}", path.display());
    Ok(())
}

fn completions(dir: &Path, name: &str, cmd: &clap::Command) -> anyhow::Result<()> {
    for (shell, sub, file) in [
        (Shell::Bash, "bash", name.to_owned()),
        (Shell::Zsh, "zsh", format!("_{name}")),
        (Shell::Fish, "fish", format!("{name}.fish")),
    ] {
        let d = dir.join("completions").join(sub);
        mkdir(&d)?;
        let mut buf = Vec::new();
        clap_complete::generate(shell, &mut cmd.clone(), name, &mut buf);
        if buf.is_empty() {
            bail!("clap_complete produced an empty {sub} completion for {name}");
        }
        write(&d.join(file), &buf)?;
    }
    Ok(())
}

/// The man page of `cmd` (already built, so subcommands carry display names
/// such as `lbctl-backend-add`) and, recursively, of its visible subcommands.
fn man_pages(dir: &Path, cmd: clap::Command) -> anyhow::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        man_pages(dir, sub.clone())?;
    }
    let man = clap_mangen::Man::new(cmd).section("8").manual(MANUAL);
    let mut buf = Vec::new();
    man.render(&mut buf).context("rendering a man page")?;
    write(&dir.join(man.get_filename()), &buf)
}

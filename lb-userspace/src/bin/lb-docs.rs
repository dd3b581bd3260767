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
#![expect(unused_crate_dependencies, reason = "used by the library and the other binaries")]
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

/// Extra man page sections of lbd(8), in roff.
const LBD_EXTRA: &str = r#".SH SIGNALS
.TP
\fBSIGHUP\fR
Re-read the configuration file and apply the difference. A file with any
problem is rejected whole and the running configuration is kept.
.TP
\fBSIGTERM\fR
Stop cleanly.
.TP
\fBSIGUSR2\fR
Restart gracefully: lbd re-executes itself and the new process adopts the
pinned datapath, so traffic keeps flowing. Under systemd:
\fBsystemctl kill \-s USR2 lbd\fR.
.SH FILES
.TP
\fI/etc/lbd/lbd.yaml\fR
Configuration (the installed unit\*(Aqs \fB\-\-config\fR).
.TP
\fI/run/lbd\fR
Runtime directory: the control socket \fIlbd.sock\fR used by \fBlbctl\fR(8).
.TP
\fI/sys/fs/bpf\fR
bpffs on which the datapath's programs, links and maps are pinned
(\fBpin_path\fR in the configuration).
.SH METRICS
Prometheus/OpenMetrics exposition on
\fIhttp://127.0.0.1:9464/metrics\fR by default.
.SH PRIVILEGES
lbd needs root, or the capabilities CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN
and CAP_PERFMON.
.SH SEE ALSO
\fBlbctl\fR(8)
"#;

/// Extra man page sections of lbctl(8), in roff.
const LBCTL_EXTRA: &str = r#".SH ENVIRONMENT
.TP
\fBLBD_SOCKET\fR
lbd\*(Aqs control socket (as \fB\-\-socket\fR).
.SH SEE ALSO
\fBlbd\fR(8)
"#;

fn main() {
    if let Err(e) = real_main() {
        eprintln!("lb-docs: {}", lb_userspace::error_text(&e));
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

    let lbd = LbdArgs::command();
    let lbctl = LbctlArgs::command();

    for (name, cmd) in [("lbd", &lbd), ("lbctl", &lbctl)] {
        completions(&dir, name, cmd)?;
    }
    let man_dir = dir.join("man/man8");
    mkdir(&man_dir)?;
    for (cmd, extra) in [(lbd, LBD_EXTRA), (lbctl, LBCTL_EXTRA)] {
        let mut cmd = cmd.disable_help_subcommand(true);
        cmd.build();
        man_pages(&man_dir, cmd, extra)?;
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
/// `extra` (roff) goes into the top page only, before its VERSION section.
fn man_pages(dir: &Path, cmd: clap::Command, extra: &str) -> anyhow::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        man_pages(dir, sub.clone(), "")?;
    }
    let man = clap_mangen::Man::new(cmd).section("8").manual(MANUAL);
    let mut buf = Vec::new();
    man.render(&mut buf).context("rendering a man page")?;
    if !extra.is_empty() {
        let page = String::from_utf8(buf).context("man page is not UTF-8")?;
        let at = page.find("\n.SH VERSION\n").map_or(page.len(), |i| i + 1);
        buf = format!("{}{extra}{}", &page[..at], &page[at..]).into_bytes();
    }
    write(&dir.join(man.get_filename()), &buf)
}

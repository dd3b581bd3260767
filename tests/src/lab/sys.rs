//! The lab's process and namespace chores: running commands, killing a
//! namespace's processes, reading logs, validating a spec, the peer XDP
//! program of the mixed topology.

use super::*;

/// Where the mixed topology pins its peer's XDP program.
pub(super) fn peer_xdp_pin(prefix: &str) -> PathBuf {
    Path::new(BPFFS).join(format!("{prefix}-peer-xdp"))
}

/// Load an XDP program that returns XDP_PASS and pin it at `pin`.
///
/// Hand-written with bpf(2): the program is two instructions, and loading
/// it needs no ELF object, no libbpf and no aya in the lab library.
pub(super) fn load_pass_program(pin: &Path) -> anyhow::Result<()> {
    // struct bpf_insn, little endian: opcode, registers, offset, immediate.
    let insns: [u64; 2] = [
        0xb7 | (2u64 << 32), // r0 = 2 (XDP_PASS)
        0x95,                // exit
    ];
    let license = b"GPL\0";
    let name = b"lab_peer_pass\0";
    // union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns,
    // license, log fields (zero), kern_version, prog_flags, prog_name.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&6u32.to_ne_bytes()); // BPF_PROG_TYPE_XDP
    attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[48..48 + name.len()].copy_from_slice(name);
    // SAFETY: bpf(BPF_PROG_LOAD) reads `attr` and the buffers it points to,
    // all alive for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 5, attr.as_ptr(), attr.len()) };
    if fd < 0 {
        bail!("loading the peer XDP program: {}", std::io::Error::last_os_error());
    }
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes()).context("pin path")?;
    // union bpf_attr for BPF_OBJ_PIN: pathname, bpf_fd.
    let mut pin_attr = [0u8; 16];
    pin_attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    pin_attr[8..12].copy_from_slice(&(fd as u32).to_ne_bytes());
    // SAFETY: bpf(BPF_OBJ_PIN) reads `pin_attr` and the path it points to.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, 6, pin_attr.as_ptr(), pin_attr.len()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: fd is ours; the pin (if made) keeps the program alive.
    unsafe { libc::close(fd as i32) };
    if rc != 0 {
        bail!("pinning the peer XDP program at {}: {err}", pin.display());
    }
    Ok(())
}

pub(super) fn validate(spec: &LabSpec) -> anyhow::Result<()> {
    let p = &spec.prefix;
    if p.is_empty() || !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        bail!("lab prefix {p:?} must be non-empty and only contain [A-Za-z0-9_-]");
    }
    if !(1..=MAX_BACKENDS).contains(&spec.backends) {
        bail!("lab backends must be 1..={MAX_BACKENDS}, not {}", spec.backends);
    }
    if spec.topology == Topology::Ecmp && !(2..=8).contains(&spec.nodes) {
        bail!("the ecmp lab takes 2..=8 nodes, not {}", spec.nodes);
    }
    if spec.client_sources > MAX_CLIENT_SOURCES {
        bail!("lab client_sources must be at most {MAX_CLIENT_SOURCES}, not {}", spec.client_sources);
    }
    Ok(())
}

pub(super) fn client_source_addrs(n: usize) -> Vec<Ipv4Addr> {
    (u32::from(Ipv4Addr::new(10, 10, 1, 0))..)
        .filter(|a| !matches!(a & 0xff, 0 | 255))
        .take(n.min(MAX_CLIENT_SOURCES))
        .map(Ipv4Addr::from)
        .collect()
}

/// Whether `ns` is one of the namespaces a lab with `prefix` creates.
pub(super) fn is_lab_ns(prefix: &str, ns: &str) -> bool {
    let Some(role) = ns.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else {
        return false;
    };
    let numbered =
        |p: &str| role.strip_prefix(p).is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
    matches!(role, "client" | "gw" | "sw" | "rt" | "br") || numbered("be") || numbered("n")
}

/// The lab prefix of a namespace of one of this project's labs (`lb`,
/// `lbt-...`, `lbb`: the prefix followed by a lab role), if it is one.
pub(super) fn lab_prefix_of(ns: &str) -> Option<&str> {
    let (prefix, _) = ns.rsplit_once('-')?;
    (prefix.starts_with("lb") && is_lab_ns(prefix, ns)).then_some(prefix)
}

/// Every network namespace's name.
pub(super) fn all_namespaces() -> anyhow::Result<Vec<String>> {
    let out = run(Command::new("ip").args(["netns", "list"]))?;
    Ok(out.lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect())
}

/// Kill every process in the namespace `ns`, then delete it.
pub(super) fn remove_ns(ns: &str) -> anyhow::Result<()> {
    kill_ns_processes(ns, |_| true)?;
    run(Command::new("ip").args(["netns", "del", ns])).map(drop)
}

pub(super) fn lab_namespaces(prefix: &str) -> anyhow::Result<Vec<String>> {
    let out = run(Command::new("ip").args(["netns", "list"]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|ns| is_lab_ns(prefix, ns))
        .map(String::from)
        .collect())
}

pub(super) fn ns_pids(ns: &str) -> anyhow::Result<Vec<i32>> {
    let out = run(Command::new("ip").args(["netns", "pids", ns]))?;
    Ok(out.split_whitespace().filter_map(|p| p.parse().ok()).collect())
}

/// Whether `pid` is gone (or a zombie, i.e. no longer running anything).
pub(super) fn pid_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(s) => s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

pub(super) fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: plain kill(2); a stale pid just yields ESRCH.
    unsafe { libc::kill(pid, sig) };
}

/// SIGTERM, then SIGKILL after 2 s, every process in `ns` matching `filter`;
/// waits until they are gone.
pub(super) fn kill_ns_processes(ns: &str, filter: impl Fn(i32) -> bool) -> anyhow::Result<()> {
    let own = std::process::id() as i32;
    let pids: Vec<i32> = ns_pids(ns)?.into_iter().filter(|&p| p != own && filter(p)).collect();
    if pids.is_empty() {
        return Ok(());
    }
    for &p in &pids {
        signal(p, libc::SIGTERM);
    }
    let start = Instant::now();
    let mut killed = false;
    while !pids.iter().all(|&p| pid_gone(p)) {
        if start.elapsed() > Duration::from_secs(2) && !killed {
            for &p in &pids {
                signal(p, libc::SIGKILL);
            }
            killed = true;
        }
        if start.elapsed() > Duration::from_secs(5) {
            let left: Vec<i32> = pids.iter().copied().filter(|&p| !pid_gone(p)).collect();
            bail!("processes {left:?} in namespace {ns} survived SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// SIGTERM a child we started, SIGKILL after 2 s, and reap it.
pub(super) fn terminate_child(child: &mut Child) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    signal(child.id() as i32, libc::SIGTERM);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

pub(super) fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

pub(super) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn check_output(desc: String, out: std::io::Result<std::process::Output>) -> anyhow::Result<String> {
    let out = out.with_context(|| format!("running `{desc}`"))?;
    if !out.status.success() {
        bail!("`{desc}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command to completion; non-zero exit is an error naming the command
/// and carrying its stderr. Returns stdout.
pub(super) fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let desc = describe(cmd);
    let out = cmd.stdin(Stdio::null()).output();
    check_output(desc, out)
}

pub(super) fn run_with_stdin(cmd: &mut Command, input: &str) -> anyhow::Result<String> {
    use std::io::Write as _;
    let desc = describe(cmd);
    let spawned = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let out = spawned.and_then(|mut child| {
        let mut stdin = child.stdin.take().expect("piped stdin");
        // ip reads the whole script before we wait; small scripts fit the pipe,
        // larger ones are written from a thread to avoid a deadlock.
        let input = input.to_owned();
        let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
        let out = child.wait_with_output();
        let _ = writer.join();
        out
    });
    check_output(desc, out)
}

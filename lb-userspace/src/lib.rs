//! lbd (the agent) and lbctl (the CLI) share this library.
//!
//! - `config`: parse and validate the YAML, every problem at once.
//! - `sched`: the schedulers: names, datapath ids, validation, table
//!   builds (`sched::maglev`, `sched::wrr`), fairness input.
//! - `dataplane`: the only module touching BPF maps.
//! - `agent`: the running state (dataplane + config): reload, sweep.
//! - `netdev`, `paths`: what the gateway's devices can do, and which path
//!   (XDP redirect or kernel forwarding) a packet takes between them.
//! - `report`: the status report (shared by the API, the exporter, watch).
//! - `api`: the control socket and its requests.
//! - `bgp`: VIP announcement by a BIRD that lbd runs (config, control).
//! - `health`: probes, rise/fall, slow start, and their metrics.
//! - `tasks`: lbd's background loops (probes, slow start, device watch,
//!   flow sweeper), driven through a trait so tests can run them.
//! - `metrics`: the Prometheus exporter, and the HTTP listener it shares
//!   with the status page.
//! - `page`: the status page (`/`) and its document (`/status.json`).
//!
//! No module imports one that imports it back (a test below checks).
// Dependencies of the binaries only (the library does not need them).
use anyhow as _;
use aya_log as _;
use clap_complete as _;
use clap_mangen as _;
use tracing_subscriber as _;

pub mod agent;
pub mod api;
pub mod bgp;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod health;
pub mod metrics;
pub mod netdev;
pub mod page;
pub mod paths;
pub mod render;
pub mod report;
pub mod sched;
pub mod tasks;
pub mod watch;

/// An error and its causes on one line, each cause once. Most errors here
/// (and aya's) print their cause inside their own message and also hand it
/// on as their source, so `{:#}` would print it twice ("`bpf_link_create`
/// failed: `bpf_link_create` failed: ..."): a cause the text so far already
/// ends with is left out.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
    }
    text
}

/// True when running as root (needed to load BPF and attach XDP).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

#[cfg(test)]
mod tests {
    /// As aya's SyscallError: names the call, hands on the OS error.
    #[derive(Debug, thiserror::Error)]
    #[error("`bpf_link_create` failed")]
    struct Syscall(#[source] std::io::Error);

    /// As DataplaneError::Attach: prints its cause and hands it on.
    #[derive(Debug, thiserror::Error)]
    #[error("attaching XDP to br0 in native mode: {0}")]
    struct Attach(#[source] Syscall);

    #[test]
    fn an_error_line_names_each_cause_once() {
        let e = anyhow::Error::new(Attach(Syscall(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))))
            .context("attaching XDP");
        assert_eq!(
            super::error_text(&e),
            "attaching XDP: attaching XDP to br0 in native mode: `bpf_link_create` failed: Operation not supported (os error 95)",
            "{e:#}"
        );
        // A cause that is not part of the message before it stays.
        let e = anyhow::Error::new(Syscall(std::io::Error::from_raw_os_error(libc::ENOENT))).context("pinning");
        assert_eq!(super::error_text(&e), "pinning: `bpf_link_create` failed: No such file or directory (os error 2)");
    }
}

#[cfg(test)]
mod layout {
    use std::collections::{BTreeMap, BTreeSet};

    /// The crate's modules and, per module, the modules its non-test code
    /// names through `crate::`.
    fn imports() -> BTreeMap<String, BTreeSet<String>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = BTreeMap::new();
        // Non-test code of a file.
        let code = |p: &std::path::Path| {
            let text = std::fs::read_to_string(p).unwrap();
            text.split("#[cfg(test)]").next().unwrap_or("").to_owned()
        };
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(m) = name.strip_suffix(".rs")
                && m != "lib"
            {
                files.insert(m.to_owned(), code(&e.path()));
            } else if e.path().is_dir() && name != "bin" {
                // A module folder (`sched/`) is one module: its files together.
                let mut all = String::new();
                for f in std::fs::read_dir(e.path()).unwrap().flatten() {
                    if f.path().extension().is_some_and(|x| x == "rs") {
                        all.push_str(&code(&f.path()));
                    }
                }
                files.insert(name, all);
            }
        }
        let mods: BTreeSet<String> = files.keys().cloned().collect();
        files
            .iter()
            .map(|(m, code)| {
                // The identifier after `crate::`; for a `crate::{...}`
                // group, the first identifier of each top-level item.
                let mut used = BTreeSet::new();
                for (i, _) in code.match_indices("crate::") {
                    let rest = &code[i + "crate::".len()..];
                    let items: Vec<&str> = match rest.strip_prefix('{') {
                        None => vec![rest],
                        Some(group) => {
                            let (mut depth, mut from, mut items) = (0i32, 0, Vec::new());
                            for (j, c) in group.char_indices() {
                                match c {
                                    '{' => depth += 1,
                                    '}' if depth == 0 => {
                                        items.push(&group[from..j]);
                                        break;
                                    }
                                    '}' => depth -= 1,
                                    ',' if depth == 0 => {
                                        items.push(&group[from..j]);
                                        from = j + 1;
                                    }
                                    _ => {}
                                }
                            }
                            items
                        }
                    };
                    for item in items {
                        let word: String =
                            item.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                        if mods.contains(&word) && &word != m {
                            used.insert(word);
                        }
                    }
                }
                (m.clone(), used)
            })
            .collect()
    }

    #[test]
    fn no_module_imports_one_that_imports_it_back() {
        let deps = imports();
        assert!(
            deps["api"].contains("report") && deps["metrics"].contains("agent") && deps["dataplane"].contains("sched"),
            "the scan sees imports, also into module folders: {deps:?}"
        );
        for start in deps.keys() {
            // Depth-first search for a path back to `start`.
            let mut stack = vec![vec![start.clone()]];
            while let Some(path) = stack.pop() {
                for next in &deps[path.last().unwrap()] {
                    assert!(next != start, "import circle: {} -> {next}", path.join(" -> "));
                    if !path.contains(next) {
                        let mut p = path.clone();
                        p.push(next.clone());
                        stack.push(p);
                    }
                }
            }
        }
    }
}

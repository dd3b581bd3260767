//! Packaging artefacts: the Grafana dashboard only queries series lbd
//! exports, the systemd unit passes `systemd-analyze verify`, and `lb-docs`
//! writes every completion and man page that `cargo xtask install` installs.
//!
//! No root needed. The binaries (lbd, lb-docs) must be built first:
//! `cargo build --bins` (they are looked up where the lab finds its helper
//! binaries: `LB_BIN_DIR`, or target/debug next to this test).
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use lb_tests::lab::LabSpec;
use lb_userspace::metrics::SERIES;
use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// A directory of our own under /tmp, removed (with its content) on drop,
/// so even on a failed assertion.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let base = std::env::temp_dir();
        for n in 0..1000u32 {
            let p = base.join(format!("lb-packaging-{tag}.{}.{n}", std::process::id()));
            match fs::create_dir(&p) {
                Ok(()) => return Self(p),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("creating {}: {e}", p.display()),
            }
        }
        panic!("cannot create a temporary directory in {}", base.display());
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A built binary of the workspace; a clear failure if it is not built.
fn built(name: &str) -> PathBuf {
    let p = LabSpec::default().bin_dir.join(name);
    assert!(
        p.is_file(),
        "{} not found: build the workspace's binaries first (cargo build --bins), or set LB_BIN_DIR",
        p.display()
    );
    p
}

// ---------------------------------------------------------------- dashboard

fn dashboard() -> Value {
    let path = repo_root().join("configs/grafana-dashboard.json");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

/// Every panel, rows' nested panels included (rows themselves too).
fn all_panels(panels: &Value, out: &mut Vec<Value>) {
    for p in panels.as_array().into_iter().flatten() {
        out.push(p.clone());
        all_panels(&p["panels"], out);
    }
}

/// (where, PromQL) of every panel target and every templating query.
fn queries(dash: &Value) -> Vec<(String, String)> {
    let mut panels = Vec::new();
    all_panels(&dash["panels"], &mut panels);
    let mut out = Vec::new();
    for p in &panels {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr =
                t["expr"].as_str().unwrap_or_else(|| panic!("panel {:?}: a target without expr: {t}", p["title"]));
            out.push((format!("panel {:?} target {}", p["title"], t["refId"]), expr.to_owned()));
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        let name = format!("variable {}", v["name"]);
        match &v["query"] {
            Value::String(q) => out.push((name.clone(), q.clone())),
            Value::Object(o) => {
                if let Some(q) = o.get("query").and_then(Value::as_str) {
                    out.push((name.clone(), q.to_owned()));
                }
            }
            _ => {}
        }
        if let Some(d) = v["definition"].as_str() {
            out.push((format!("{name} definition"), d.to_owned()));
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Identifiers matching `lb_[a-z_]+` (at a word start) in a query.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut prev: Option<char> = None;
    for (i, c) in expr.char_indices() {
        if c == 'l' && expr[i..].starts_with("lb_") && !prev.is_some_and(is_ident) {
            let name: String = expr[i..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
            out.push(name);
        }
        prev = Some(c);
    }
    out
}

/// Whether lbd exports `name`: a family in SERIES, or a histogram family's
/// `_bucket` / `_sum` / `_count`.
fn exported(name: &str) -> bool {
    SERIES.contains(&name)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .any(|s| name.strip_suffix(s).is_some_and(|f| SERIES.contains(&f) && is_histogram(f)))
}

/// SERIES does not say which families are histograms; lbd's histograms are
/// its durations (`_seconds`), counters end in `_total`, gauges have units
/// or none.
fn is_histogram(family: &str) -> bool {
    family.ends_with("_seconds")
}

/// Label names used in `by (...)`, `without (...)`, `on (...)`,
/// `ignoring (...)`, `group_left (...)`, `group_right (...)` and in
/// selectors `{name=~"..."}`.
fn label_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    // Grouping clauses.
    for kw in ["by", "without", "on", "ignoring", "group_left", "group_right"] {
        let mut from = 0;
        while let Some(off) = expr[from..].find(kw) {
            let at = from + off;
            from = at + kw.len();
            let before_ok = at == 0 || !is_ident(bytes[at - 1] as char);
            let rest = expr[from..].trim_start();
            if !before_ok || !rest.starts_with('(') {
                continue;
            }
            if let Some(close) = rest.find(')') {
                for l in rest[1..close].split(',').map(str::trim).filter(|l| !l.is_empty()) {
                    if l.chars().all(is_ident) {
                        out.insert(l.to_owned());
                    }
                }
            }
        }
    }
    // Selectors.
    let mut from = 0;
    while let Some(off) = expr[from..].find('{') {
        let open = from + off;
        let Some(close) = expr[open..].find('}').map(|c| open + c) else { break };
        for m in expr[open + 1..close].split(',') {
            let name: String = m.trim().chars().take_while(|c| is_ident(*c)).collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
        from = close + 1;
    }
    out
}

#[test]
fn dashboard_queries_only_what_lbd_exports() {
    let dash = dashboard();

    // Imports as-is: a Prometheus datasource input that every panel and query uses.
    let inputs = dash["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs
            .iter()
            .any(|i| i["name"] == "DS_PROMETHEUS" && i["type"] == "datasource" && i["pluginId"] == "prometheus"),
        "no DS_PROMETHEUS prometheus datasource in __inputs: {inputs:?}"
    );
    let schema = dash["schemaVersion"].as_u64().expect("schemaVersion");
    assert!((36..=41).contains(&schema), "schemaVersion {schema}");

    let mut panels = Vec::new();
    all_panels(&dash["panels"], &mut panels);
    let visible: Vec<&Value> = panels.iter().filter(|p| p["type"] != "row").collect();
    assert!(visible.len() >= 8, "only {} panels", visible.len());
    let mut ids = BTreeSet::new();
    for p in &panels {
        let id = p["id"].as_u64().unwrap_or_else(|| panic!("panel {:?} has no id", p["title"]));
        assert!(ids.insert(id), "panel id {id} used twice");
        assert!(p["gridPos"]["w"].as_u64().is_some(), "panel {:?} has no gridPos", p["title"]);
    }
    for p in &visible {
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "panel {:?} datasource", p["title"]);
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("panel {:?} has no targets", p["title"]));
        assert!(!targets.is_empty(), "panel {:?} has no targets", p["title"]);
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "panel {:?} target datasource", p["title"]);
        }
    }

    // The service variable.
    let vars = dash["templating"]["list"].as_array().expect("templating.list");
    let service = vars.iter().find(|v| v["name"] == "service").expect("a `service` template variable");
    let q = service["query"]["query"].as_str().or(service["query"].as_str()).expect("service variable query");
    assert_eq!(q.replace(' ', ""), "label_values(lb_backend_connections_total,service)");
    let var_names: BTreeSet<String> = vars.iter().filter_map(|v| v["name"].as_str().map(str::to_owned)).collect();

    let queries = queries(&dash);
    assert!(queries.len() >= 8, "only {} queries", queries.len());
    let known_labels = ["service", "backend", "direction", "reason", "result", "version", "le", "instance", "job"];
    let mut used = BTreeSet::new();
    let mut unknown = Vec::new();
    for (place, expr) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty() || expr.is_empty(), "{place}: no lb_ metric in {expr:?}");
        for n in names {
            if !exported(&n) {
                unknown.push(format!("{place}: {n} (in {expr:?})"));
            }
            let family =
                ["_bucket", "_sum", "_count"].iter().find_map(|s| n.strip_suffix(s)).filter(|f| SERIES.contains(f));
            used.insert(family.unwrap_or(&n).to_owned());
        }
        for l in label_names(expr) {
            assert!(
                known_labels.contains(&l.as_str()),
                "{place}: label {l:?} is not one lbd (or Prometheus) sets: {expr:?}"
            );
        }
        // Every $variable is a template variable or a Grafana built-in.
        for (i, _) in expr.match_indices('$') {
            let v: String = expr[i + 1..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            assert!(
                var_names.contains(&v) || ["__rate_interval", "__interval", "__range"].contains(&v.as_str()),
                "{place}: unknown variable ${v} in {expr:?}"
            );
        }
    }
    assert!(unknown.is_empty(), "the dashboard queries series lbd does not export:\n{}", unknown.join("\n"));
    for family in [
        "lb_backend_connections_total",
        "lb_backend_up",
        "lb_dropped_packets_total",
        "lb_config_reloads_total",
        "lb_service_fairness",
        "lb_backend_effective_weight",
    ] {
        assert!(used.contains(family), "no panel uses {family}; used: {used:?}");
    }
    println!("{} panels, {} queries, families used: {used:?}", visible.len(), queries.len());
}

#[test]
fn metric_name_extraction() {
    assert_eq!(
        metric_names(
            r#"sum by (le) (rate(lb_health_check_duration_seconds_bucket{service=~"$service"}[5m])) / xlb_no"#
        ),
        ["lb_health_check_duration_seconds_bucket"]
    );
    assert!(exported("lb_health_check_duration_seconds_bucket"));
    assert!(exported("lb_health_check_duration_seconds_count"));
    assert!(!exported("lb_backend_up_bucket"));
    assert!(!exported("lb_backend_connections"));
    assert_eq!(
        label_names(r#"sum by (service, backend) (x{direction="in"}) / on (service) group_left sum by (service) (y)"#),
        ["backend", "direction", "service"].into_iter().map(str::to_owned).collect()
    );
}

// ---------------------------------------------------------------- systemd unit

fn unit_text() -> String {
    let path = repo_root().join("configs/lbd.service");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// `Key=value` directives of the unit (comments dropped), in order.
fn directives(unit: &str) -> Vec<(String, String)> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('['))
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())))
        .collect()
}

#[test]
fn unit_has_what_a_gateway_needs() {
    let unit = unit_text();
    let d = directives(&unit);
    let get = |k: &str| d.iter().filter(|(key, _)| key == k).map(|(_, v)| v.as_str()).collect::<Vec<_>>().join(" ");
    assert!(["simple", "exec"].contains(&get("Type").as_str()), "Type={}", get("Type"));
    assert_eq!(get("ExecStart"), "/usr/local/bin/lbd --config /etc/lbd/lbd.yaml");
    assert_eq!(get("ExecReload"), "/bin/kill -HUP $MAINPID");
    assert_eq!(get("Restart"), "on-failure");
    assert_eq!(get("KillSignal"), "SIGTERM");
    assert_eq!(get("LimitMEMLOCK"), "infinity");
    assert_eq!(get("RuntimeDirectory"), "lbd");
    assert_eq!(get("RuntimeDirectoryMode"), "0700");
    assert!(get("After").contains("network-online.target") && get("Wants").contains("network-online.target"));
    for key in ["CapabilityBoundingSet", "AmbientCapabilities"] {
        let caps = get(key);
        // The last for the BIRD lbd runs with a bgp: section (port 179).
        for cap in
            ["CAP_BPF", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_PERFMON", "CAP_SYS_RESOURCE", "CAP_NET_BIND_SERVICE"]
        {
            assert!(caps.split_whitespace().any(|c| c == cap), "{key} lacks {cap}: {caps}");
        }
    }
    // These would keep lbd from the host's interfaces or from bpffs.
    for (key, _) in &d {
        assert!(
            key != "PrivateNetwork" && !key.starts_with("ProtectKernel") && key != "User" && key != "DynamicUser",
            "{key}= would break BPF/XDP (or lbd's root check)"
        );
    }
    assert!(unit.contains("systemctl kill -s USR2 lbd"), "the unit should say how to restart gracefully");
}

#[test]
fn systemd_analyze_verifies_the_unit() {
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"].into_iter().map(Path::new).find(|p| p.is_file());
    let Some(analyze) = analyze else {
        panic!(
            "systemd-analyze is not installed, so the unit cannot be verified: install the `systemd` package \
             (cargo xtask setup does)"
        );
    };
    if !Path::new("/run/systemd/system").exists() {
        println!("this machine has no running systemd (PID 1 is not systemd): verifying the unit offline");
    }
    let lbd = built("lbd");
    let lb_docs = built("lb-docs");
    let tmp = TempDir::new("unit");

    // Stage the unit with ExecStart at the real binary (verify checks that
    // it exists and is executable); the rest as shipped.
    let unit = unit_text();
    let mut staged = String::new();
    let mut rewritten = false;
    for line in unit.lines() {
        if line.starts_with("ExecStart=") {
            assert!(line.contains("/usr/local/bin/lbd"), "unexpected {line}");
            staged.push_str(&line.replace("/usr/local/bin/lbd", lbd.to_str().expect("UTF-8 path")));
            rewritten = true;
        } else {
            staged.push_str(line);
        }
        staged.push('\n');
    }
    assert!(rewritten, "no ExecStart= line");
    let path = tmp.0.join("lbd.service");
    fs::write(&path, staged).expect("writing the staged unit");

    // Documentation=man:lbd(8) man:lbctl(8) is checked with man(1): point it
    // at the pages lb-docs generates (what cargo xtask install installs).
    let docs = tmp.0.join("docs");
    let out = Command::new(&lb_docs).arg(&docs).output().expect("running lb-docs");
    assert!(out.status.success(), "lb-docs failed: {}", String::from_utf8_lossy(&out.stderr));

    let out = Command::new(analyze)
        .arg("verify")
        .arg(&path)
        .env("MANPATH", docs.join("man"))
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .expect("running systemd-analyze");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("systemd-analyze verify {}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", path.display(), out.status);
    // Strict: any message about our unit (or its path) fails the test, a
    // warning included. Lines about other units (systemd also loads the
    // units ours refers to, e.g. network-online.target, and may comment on
    // those as installed on this machine) are not ours to fix.
    let ours: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("lbd") || l.contains(&*tmp.0.to_string_lossy()))
        .collect();
    assert!(ours.is_empty(), "systemd-analyze verify complains about the unit:\n{}", ours.join("\n"));
    assert!(out.status.success(), "systemd-analyze verify failed ({}):\n{stderr}", out.status);
}

// ---------------------------------------------------------------- lb-docs

#[test]
fn lb_docs_writes_completions_and_man_pages() {
    let lb_docs = built("lb-docs");
    let tmp = TempDir::new("docs");
    let out = Command::new(&lb_docs).arg(&tmp.0).output().expect("running lb-docs");
    assert!(out.status.success(), "lb-docs failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    let read = |rel: &str| -> String {
        let p = tmp.0.join(rel);
        let text = fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!text.trim().is_empty(), "{} is empty", p.display());
        text
    };
    for rel in [
        "completions/bash/lbd",
        "completions/bash/lbctl",
        "completions/zsh/_lbd",
        "completions/zsh/_lbctl",
        "completions/fish/lbd.fish",
        "completions/fish/lbctl.fish",
        "man/man8/lbd.8",
        "man/man8/lbctl.8",
        "man/man8/lbctl-status.8",
        "man/man8/lbctl-reload.8",
        "man/man8/lbctl-backend.8",
        "man/man8/lbctl-backend-add.8",
        "man/man8/lbctl-service.8",
    ] {
        read(rel);
    }
    let bash = read("completions/bash/lbctl");
    for word in ["backend", "reload", "status", "--socket"] {
        assert!(bash.contains(word), "the lbctl bash completion does not mention {word}");
    }
    assert!(read("completions/bash/lbd").contains("--config"));
    assert!(read("completions/zsh/_lbd").starts_with("#compdef lbd"));
    assert!(read("completions/zsh/_lbctl").starts_with("#compdef lbctl"));
    assert!(read("completions/fish/lbctl.fish").contains("complete -c lbctl"));
    let man = read("man/man8/lbctl.8");
    assert!(man.contains("status"), "lbctl.8 does not mention status");
    assert!(
        man.contains(".TH lbctl 8"),
        "lbctl.8 is not a section 8 page: {}",
        man.lines().take(3).collect::<Vec<_>>().join("\n")
    );
    let lbd_man = read("man/man8/lbd.8");
    for word in ["SIGHUP", "SIGUSR2", "\\-\\-config"] {
        assert!(lbd_man.contains(word), "lbd.8 does not mention {word}");
    }

    // The bash completions parse.
    for name in ["lbd", "lbctl"] {
        let p = tmp.0.join("completions/bash").join(name);
        match Command::new("bash").arg("-n").arg(&p).output() {
            Ok(o) => assert!(o.status.success(), "bash -n {}: {}", p.display(), String::from_utf8_lossy(&o.stderr)),
            Err(e) => println!("bash not runnable ({e}); skipped bash -n"),
        }
    }
    // The man pages format without warnings, where groff is installed.
    let mut pages: Vec<PathBuf> =
        fs::read_dir(tmp.0.join("man/man8")).expect("man8").map(|e| e.expect("entry").path()).collect();
    pages.sort();
    for p in &pages {
        match Command::new("groff").args(["-man", "-ww", "-z"]).arg(p).output() {
            Ok(o) => assert!(
                o.status.success() && o.stderr.is_empty(),
                "groff warns about {}: {}",
                p.display(),
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(_) => {
                println!("groff is not installed; man pages not formatted");
                break;
            }
        }
    }
}

//! The report: per case the median and min-max over rounds, the harness's
//! own cost subtracted, ratios to the XDP_TX floor and to Katran's figures;
//! printed as a table and returned as JSON for `cargo xtask bench`. `nix`
//! reads uname(2) for the kernel release.
use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::{
    PacketArgs,
    cases::{Item, MODE_NEW_TCP, MODE_NEW_TCP6, Prog, Via, katran},
    measure::Sample,
};

/// What the report says about the machine, read by the main thread (the
/// measuring thread sits in a namespace without the net.core sysctls).
pub(crate) struct HostInfo {
    pub bpf_stats_before: String,
    pub bpf_stats_during: String,
    pub bpf_jit_enable: String,
}

pub(crate) fn report(
    items: &[Item],
    samples: &[Vec<Sample>],
    args: &PacketArgs,
    cpu: usize,
    host: &HostInfo,
    conntrack_max: u32,
) -> Value {
    let stats_during = &host.bpf_stats_during;
    let rounds = samples[0].len();
    let raw = |key: &str| -> Vec<f64> {
        let i = items.iter().position(|i| i.key == key).expect("the floors and the harness are always measured");
        samples[i].iter().map(|s| s.ns).collect()
    };
    let diff = |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(x, y)| x - y).collect() };
    let floor_pass = raw("floor_pass");
    let floor_tx = raw("floor_tx");
    // The harness's own cost, per round and mode (same-round differences).
    let h_restore = diff(&raw("harness_restore"), &floor_pass);
    let h_new = diff(&raw("harness_new"), &floor_pass);
    let h_new6 = diff(&raw("harness_new6"), &floor_pass);
    let tx_via_harness = diff(&raw("harness_tx"), &h_restore);
    let tx_med = median(&floor_tx);

    let summary = |v: &[f64]| json!({"median_ns": round2(median(v)), "min_ns": round2(min(v)), "max_ns": round2(max(v)), "rounds_ns": v.iter().map(|x| round2(*x)).collect::<Vec<_>>()});

    let mut cases = Vec::new();
    let mut table = String::new();
    let _ = writeln!(
        table,
        "{:<48} {:<62} {:>9} {:>13} {:>10} {:>7} {:>8} {:>13}",
        "case", "path", "median ns", "min-max ns", "x floor_tx", "target", "Katran*", "vs Katran"
    );
    let mut targets = Vec::new();
    let pass_med = median(&floor_pass);
    // A target per case, in this run's floors: (limit in ns, how it reads).
    let target = |key: &str| -> Option<(f64, String)> {
        // The full-table variant has the same target.
        match key.strip_suffix("_full").unwrap_or(key) {
            "tcp_established" | "tcp_established_one_arm" | "tcp6_established" => {
                Some((3.0 * tx_med, "3x floor_tx".to_owned()))
            }
            k if k.starts_with("new_") => Some((14.0 * tx_med, "14x floor_tx".to_owned())),
            // Not a VIP, in either family.
            "non_vip" | "ipv6" => Some((pass_med + 5.0, "floor_pass + 5 ns".to_owned())),
            _ => None,
        }
    };
    let mut row = |label: &str, path: &str, v: &[f64], kat: Option<f64>, key: &str, cases: &mut Vec<Value>| {
        let med = median(v);
        let ratio_tx = med / tx_med;
        // Katran's figure is a multiple of its own XDP_TX floor: compare
        // floor multiples, so machine speed cancels.
        let vs_k = kat.map(|k| ratio_tx / k);
        let t = target(key);
        let _ = writeln!(
            table,
            "{:<48} {:<62} {:>9.1} {:>13} {:>10.1} {:>7} {:>8} {:>13}",
            label,
            path,
            med,
            format!("{:.1}-{:.1}", min(v), max(v)),
            ratio_tx,
            t.as_ref().map_or("-".into(), |(ns, _)| format!("{ns:.1}")),
            kat.map_or("-".into(), |k| format!("{k:.1}x")),
            vs_k.map_or("-".into(), |r| format!("{r:.2}")),
        );
        let mut c = summary(v);
        c["key"] = json!(key);
        c["name"] = json!(label);
        c["path"] = json!(path);
        c["ratio_to_floor_tx"] = json!(round2(ratio_tx));
        c["katran_floor_multiple"] = json!(kat);
        c["ratio_to_katran_in_floors"] = json!(vs_k.map(round2));
        if let Some((ns, how)) = &t {
            c["target_ns"] = json!(round2(*ns));
            c["target"] = json!(how);
            c["met"] = json!(med <= *ns);
        }
        cases.push(c);
        med
    };
    // Medians of the datapath's cases and of the table alone, by key.
    let mut medians: Vec<(&str, f64)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        if item.prog != Prog::Lb && !item.prog.table_alone() {
            continue;
        }
        let ns: Vec<f64> = samples[i].iter().map(|s| s.ns).collect();
        // A case run directly (the program passes the frame untouched) is
        // timed as the floors are; through the harness, its cost comes off.
        let v = match item.via {
            Via::Direct => ns,
            Via::Harness(MODE_NEW_TCP) => diff(&ns, &h_new),
            Via::Harness(MODE_NEW_TCP6) => diff(&ns, &h_new6),
            Via::Harness(_) => diff(&ns, &h_restore),
        };
        let med = row(&item.label, item.path, &v, item.katran, item.key, &mut cases);
        medians.push((item.key, med));
        if let Some((limit, how)) = target(item.key) {
            let k = item.katran.map_or(String::new(), |k| format!("; Katran* {k:.1}x"));
            targets.push(format!(
                "{}: {med:.1} ns = {:.1}x floor_tx (target at most {how} = {limit:.1} ns{k}): {}",
                item.label,
                med / tx_med,
                if med <= limit { "met" } else { "missed" }
            ));
        }
    }
    row("floor: return XDP_PASS", "direct", &floor_pass, None, "floor_pass", &mut cases);
    row("floor: swap MACs, XDP_TX", "direct", &floor_tx, None, "floor_tx", &mut cases);
    row(
        "floor: XDP_TX via harness",
        "harness -> floor_tx, minus harness cost (a check)",
        &tx_via_harness,
        None,
        "floor_tx_via_harness",
        &mut cases,
    );

    let table_share = table_shares(&medians, tx_med);

    let (release, uname) = kernel_release();
    let model = lb_testkit::cpu_model().unwrap_or_else(|| "?".into());
    println!();
    println!(
        "Per-packet cost through BPF_PROG_TEST_RUN: {} rounds x {} repeats ({} for a new flow), CPU {cpu} ({model}), kernel {release}",
        rounds,
        args.repeat,
        args.new_flow_repeat()
    );
    println!(
        "Each case: harness -> program, minus the harness's own cost (harness -> floor_pass, minus floor_pass);\n\
         a case whose frame the program passes untouched (not a VIP, in either family) runs directly, as the floors do.\n"
    );
    let missed = targets.iter().filter(|t| t.ends_with("missed")).count();
    println!("Targets: {} of {} met (read from this run, in its own floors)", targets.len() - missed, targets.len());
    for t in &targets {
        println!("  - {t}");
    }
    println!();
    if !table_share.is_empty() {
        println!("The flow table's own share (the kernel's hash alone, same key, value and size, same run):");
        for line in &table_share {
            println!("  - {line}");
        }
        println!();
    }
    print!("{table}");
    println!(
        "\nharness cost: restore {:.1} ns (min-max {:.1}-{:.1}), restore + new flow {:.1} ns ({:.1}-{:.1}), restore + new IPv6 flow {:.1} ns ({:.1}-{:.1})",
        median(&h_restore),
        min(&h_restore),
        max(&h_restore),
        median(&h_new),
        min(&h_new),
        max(&h_new),
        median(&h_new6),
        min(&h_new6),
        max(&h_new6)
    );
    println!(
        "timing: the kernel's mean per repeat (whole ns, truncated) + 0.5 ns; kernel.bpf_stats_enabled during the run: {stats_during}"
    );
    println!("vs Katran: (median / this run's floor_tx) / Katran*'s floor multiple");
    println!("* {}", katran::SOURCE);

    let raw_rounds: Vec<Value> = items
        .iter()
        .zip(samples)
        .map(|(item, s)| {
            json!({
                "key": item.key,
                "name": item.label,
                "via": match item.via { Via::Direct => "direct".to_owned(), Via::Harness(m) => format!("harness mode {m}") },
                "rounds": s.iter().map(|s| json!({
                    "ns": round2(s.ns),
                    "kernel_ns": s.kernel_ns,
                    "syscall_wall_ms": round2(s.wall_ms),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "benchmark": "packet",
        "method": "BPF_PROG_TEST_RUN with a large repeat count, thread pinned to one CPU, rounds interleaved; \
    every repeat sees the original frame (bench_harness restores it, drains the store buffer and tail-calls the program \
    under test); case cost = t(harness -> program) - (t(harness -> floor_pass) - t(floor_pass)); a case whose frame \
    the program passes untouched runs directly, as the floors do; new flows get a fresh source \
    address and port per repeat (checksums updated incrementally); a table is emptied (and filled, for the full-table variants) \
    before a run unless it holds just that: a new-flow run adds its repeats, other runs at most a few flows; \
    return value and output checked before and after timing, counters show every repeat took the intended path.",
        "rounds": rounds,
        "repeat": args.repeat,
        "repeat_new_flow": args.new_flow_repeat(),
        "cpu": cpu,
        "cpu_model": model,
        "cpus_online": read_trim("/sys/devices/system/cpu/online"),
        "kernel": release,
        "uname": uname,
        "bpf_stats_enabled_before": host.bpf_stats_before,
        "bpf_stats_enabled_during": stats_during,
        "bpf_jit_enable": host.bpf_jit_enable,
        "conntrack_max": conntrack_max,
        "timing": "ns = the kernel's mean per repeat (BPF_PROG_TEST_RUN duration, truncated to whole ns) + 0.5",
        "cases": cases,
        "harness": {
            "restore": summary(&h_restore),
            "restore_new_flow": summary(&h_new),
            "restore_new_ipv6_flow": summary(&h_new6),
        },
        "reference": {
            "source": katran::SOURCE,
            "established_x_floor_tx": katran::ESTABLISHED_X,
            "new_flow_x_floor_tx": katran::NEW_FLOW_X,
            "non_vip_x_floor_tx": katran::NON_VIP_X,
        },
        "targets": targets,
        "flow_table_share": table_share,
        "raw": raw_rounds,
    })
}

/// What a flow table alone costs of the datapath's established and new
/// flows, each with the same number of flows in the table: the
/// open-addressing table in 32 KB arrays (`floor_split`, the datapath's
/// kind of table since layout 7), and beside it the kernel hash the
/// datapath used up to layout 2 (`floor_table`), an LRU hash (Katran's
/// kind) and the same open-addressing table in one big array
/// (`floor_open`, layouts 3 to 6).
fn table_shares(medians: &[(&str, f64)], tx_med: f64) -> Vec<String> {
    let get = |k: &str| medians.iter().find(|(key, _)| *key == k).map(|&(_, v)| v);
    let mut out = Vec::new();
    for suffix in ["", "_full"] {
        let flows = if suffix.is_empty() { "empty table" } else { "full table" };
        for (case, alone, kernel, what) in [
            ("tcp_established", "split_hit", "table_hit", "a lookup hit"),
            ("new_maglev", "split_new", "table_new", "a lookup miss and an insert"),
        ] {
            let (Some(ours), Some(t)) = (get(&format!("{case}{suffix}")), get(&format!("{alone}{suffix}"))) else {
                continue;
            };
            let before = match get(&format!("{kernel}{suffix}")) {
                Some(k) => format!("; the kernel hash of layout 2 alone: {k:.1} ns"),
                None => String::new(),
            };
            // Two medians of different cells: when the part's is not below
            // the whole's, this run's spread is wider than the rest, and a
            // negative "rest" would be a figure that means nothing.
            let rest = if t < ours {
                format!("{t:.1} ns = {:.0}%; the rest {:.1} ns", 100.0 * t / ours, ours - t)
            } else {
                format!(
                    "{t:.1} ns, not below the whole case's median in this run: the rounds' spread (min-max in the table above) is wider than the rest, which this run does not resolve"
                )
            };
            out.push(format!(
                "{case} ({flows}): {ours:.1} ns, of which the open-addressing table in 32 KB arrays alone ({what}) {rest}{before}"
            ));
        }
        // Katran keeps its flows in LRU hashes (one per CPU): its new flow
        // costs at least such a table's miss and insert.
        if let Some(new) = get(&format!("lru_new{suffix}")) {
            let flows = if suffix.is_empty() { "empty" } else { "full" };
            out.push(format!(
                "an LRU hash of the same size alone ({flows}; Katran's kind of flow table): a new entry {new:.1} ns = \
{:.1}x floor_tx (Katran* gives 20.0x for its whole new flow)",
                new / tx_med
            ));
        }
        // The same open-addressing table in one big array, as up to layout
        // 6: the kernel allocates that with vmalloc, in 4 KB pages, where
        // arrays of 32 KB or less get kmalloc, in its linear map's huge
        // pages. What a new flow's random slot saves in page walks.
        for (flat, split, what) in [("open_new", "split_new", "a new entry"), ("open_hit", "split_hit", "a hit")] {
            if let (Some(f), Some(s)) = (get(&format!("{flat}{suffix}")), get(&format!("{split}{suffix}"))) {
                out.push(format!(
                    "the same table in one array (layout 6's; 4 KB pages, no array of maps) ({flows}): {what} {f:.1} ns = {:.1}x floor_tx; in 32 KB arrays {s:.1} ns, {:.2}x that",
                    f / tx_med,
                    s / f
                ));
            }
        }
    }
    out
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The `q`-quantile of `v` (nearest rank); NaN when `v` is empty.
pub(crate) fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// The median of `v` with its 10th and 90th percentiles.
pub(crate) fn spread(v: &[f64]) -> (f64, f64, f64) {
    (median(v), quantile(v, 0.1), quantile(v, 0.9))
}

/// The median of the case `key` in `report`'s output, if it was measured.
pub(crate) fn case_median(out: &Value, key: &str) -> Option<f64> {
    out["cases"].as_array()?.iter().find(|c| c["key"] == key)?["median_ns"].as_f64()
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn kernel_release() -> (String, String) {
    match nix::sys::utsname::uname() {
        Ok(u) => {
            let s = |f: &std::ffi::OsStr| f.to_string_lossy().into_owned();
            let full = format!("{} {} {} {}", s(u.sysname()), s(u.release()), s(u.version()), s(u.machine()));
            (s(u.release()), full)
        }
        Err(_) => ("?".into(), "?".into()),
    }
}

pub(crate) fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path).map_or_else(|_| "?".into(), |s| s.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::{quantile, table_shares};

    #[test]
    fn quantiles_by_nearest_rank() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn a_split_this_run_does_not_resolve_is_said_not_printed_as_a_negative_rest() {
        let medians = [("new_maglev", 363.5), ("split_new", 388.5), ("tcp_established", 89.5), ("split_hit", 32.5)];
        let lines = table_shares(&medians, 21.5);
        let new = lines.iter().find(|l| l.starts_with("new_maglev")).expect("a new_maglev line");
        assert!(new.contains("388.5 ns, not below the whole case's median in this run"), "{new}");
        assert!(!new.contains("the rest -"), "{new}");
        let est = lines.iter().find(|l| l.starts_with("tcp_established")).expect("a tcp_established line");
        assert!(est.contains("32.5 ns = 36%; the rest 57.0 ns"), "{est}");
    }
}

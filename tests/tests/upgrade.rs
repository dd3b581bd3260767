//! An upgrade across a changed map layout, under load (issue 12): lbd from
//! the last release before layout versions (layout 1: an LRU flow table,
//! a 24-byte service value) runs the datapath; its binary is replaced by
//! this build's (layout 2: a preallocated hash table, a service value
//! with a fallback table, new maps) and restarted in place. The new lbd
//! migrates the pinned maps, flows included, and swaps its program in:
//! no request fails, no live connection changes backend, the counters
//! carry on. A datapath pinned with a layout newer than this build knows
//! is refused before anything is touched, with one line that says what to
//! do. Needs root, and the old build, which `cargo xtask test` makes
//! (`LB_UPGRADE_FROM_LBD`).
#![expect(unused_crate_dependencies, reason = "each test file uses part of the lab crate's dependencies")]
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use lb_tests::{
    harness::{config_dir, serial, socket_for, web},
    lab::{Lab, LabSpec, StopLoads},
    lbd::{
        Lbd, kill_once_pinned, pinned_conns, pinned_layout, pinned_seed, wait_for, write_config, write_config_with,
        xdp_program_in_use,
    },
};

/// The old release's lbd: where `cargo xtask test` built it.
fn old_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_LBD", "upgrade-from", "the old release's")
}

/// The layout-2 release's lbd (flows in kernel hash maps): where `cargo
/// xtask test` built it.
fn v2_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V2_LBD", "upgrade-from-v2", "the layout-2 release's")
}

/// The layout-3 release's lbd (flows in slots placed by an unseeded
/// hash): where `cargo xtask test` built it.
fn v3_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V3_LBD", "upgrade-from-v3", "the layout-3 release's")
}

/// The layout-4 release's lbd (slots hashed over the whole 5-tuple,
/// reply entries' keys unmarked): where `cargo xtask test` built it.
fn v4_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V4_LBD", "upgrade-from-v4", "the layout-4 release's")
}

/// The layout-5 release's lbd (one selection-table entry to an element
/// of SELECT): where `cargo xtask test` built it.
fn v5_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V5_LBD", "upgrade-from-v5", "the layout-5 release's")
}

/// The layout-6 release's lbd (each flow table one array): where `cargo
/// xtask test` built it.
fn v6_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V6_LBD", "upgrade-from-v6", "the layout-6 release's")
}

/// The layout-7 release's lbd (before the counts kept per CPU): where
/// `cargo xtask test` built it.
fn v7_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V7_LBD", "upgrade-from-v7", "the layout-7 release's")
}

/// The layout-8 release's lbd (flow-table claims without a generation,
/// no sweeper's mark): where `cargo xtask test` built it.
fn v8_lbd(lab: &Lab) -> PathBuf {
    release_lbd(lab, "LB_UPGRADE_FROM_V8_LBD", "upgrade-from-v8", "the layout-8 release's")
}

/// An older release's lbd, which `cargo xtask test` builds into
/// target/`dir` and names in the environment variable `var`.
fn release_lbd(lab: &Lab, var: &str, dir: &str, what: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map_or_else(|| lab.spec.bin_dir.join(format!("../{dir}/target/debug/lbd")), PathBuf::from);
    assert!(
        path.exists(),
        "{} is missing: the upgrade test needs {what} lbd, which `cargo xtask test` builds",
        path.display()
    );
    path
}

/// An older release's lbd (`release`), copied to `/tmp/<prefix>-bin/lbd`,
/// where an upgrade replaces it, and started on a fresh lab with the web
/// service scheduled round robin: a flow hashed to another backend in the
/// switch-over would break, so the tests see it.
struct Staged {
    lab: Lab,
    lbd: Lbd,
    sock: PathBuf,
    config: PathBuf,
    bin: PathBuf,
    exe: PathBuf,
    maps: PathBuf,
}

fn start_release(prefix: &str, release: fn(&Lab) -> PathBuf) -> Staged {
    start_release_with(prefix, release, &web("    scheduler: rr\n", &[(1, 1), (2, 1), (3, 1)]))
}

/// [`start_release`] with the services `services`.
fn start_release_with(prefix: &str, release: fn(&Lab) -> PathBuf, services: &str) -> Staged {
    let lab = Lab::up(LabSpec { prefix: prefix.into(), ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let config = write_config(&config_dir(prefix), "lbd", &sock, services).unwrap();
    let bin = PathBuf::from(format!("/tmp/{prefix}-bin"));
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("lbd");
    std::fs::copy(release(&lab), &exe).unwrap();
    let maps = lab.pin_dir().join("maps");
    let lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
    Staged { lab, lbd, sock, config, bin, exe, maps }
}

/// The XDP program on the gateway's `eth0`, by id (the kernel's view,
/// not lbd's).
fn attached_program(lab: &Lab) -> u64 {
    xdp_program_in_use(lab, "eth0")
}

fn set_layout(maps: &Path, version: u32) {
    let [a, b, c, d] = version.to_le_bytes().map(|x| x.to_string());
    let pinned = maps.join("LAYOUT");
    let out = Command::new("bpftool")
        .args(["map", "update", "pinned"])
        .arg(&pinned)
        .args(["key", "0", "0", "0", "0", "value", &a, &b, &c, &d])
        .output()
        .unwrap();
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn an_upgrade_across_a_changed_layout_under_load_fails_nothing_and_a_newer_layout_is_refused() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-upgrade";
    let Staged { lab, mut lbd, sock, config, bin, exe, maps } = start_release(prefix, old_lbd);
    assert!(!maps.join("LAYOUT").exists(), "the old release pins no layout version");
    assert!(lbd.status().unwrap().get("flood").is_none(), "not the old release");
    lab.reset_backend_counts().unwrap();

    // An upgrade whose configuration cannot be attached everywhere (a
    // bridge in forced native mode) fails before the old program is
    // replaced on any interface: the migration it began is undone, the old
    // release's datapath forwards on its own maps, and the old lbd adopts
    // it again.
    let before = lbd.program_id().unwrap();
    lbd.kill().unwrap();
    let bridge = "lbtbr1";
    let services = web("    scheduler: rr\n", &[(1, 1), (2, 1), (3, 1)]);
    let text = start_with_a_bridge(&lab, prefix, &sock, bridge, &services);
    assert!(text.contains("the migration was undone"), "{text}");
    for iface in ["eth0", "eth1"] {
        assert_eq!(xdp_program_in_use(&lab, iface), before, "the failed upgrade replaced the old program on {iface}");
    }
    assert!(!lab.pin_dir().join("maps-v1").exists(), "the old maps were left aside");
    assert!(!maps.join("LAYOUT").exists(), "the new layout's maps were left pinned");
    let served = lab.connections_served().unwrap();
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "50"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(lab.connections_served().unwrap(), served + 50, "the old datapath did not balance: {r}");
    let mut lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
    assert!(lbd.status().unwrap().get("flood").is_none(), "not the old release");
    assert!(lbd.total_new_flows() >= 50, "the old release lost its counters: {}", lbd.total_new_flows());
    let old_program = lbd.program_id().unwrap();

    upgrade_under_load(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:80");
    let log = lbd.log_text();
    assert!(log.contains("migrated the pinned datapath"), "{log}");
    let status = lbd.status().unwrap();
    assert_eq!(status["flood"]["flow_capacity"], 262_144, "{}", status["flood"]);
    assert!(!lab.pin_dir().join("maps-v1").exists(), "the old maps were not removed");
    // Counters carried on through the migration: they equal what the backends saw.
    let counts = lab.connections_served().unwrap();
    let flows = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == counts));
    assert_eq!(flows, Some(counts), "lbd counted {} new flows, backends {counts}", lbd.total_new_flows());

    // A datapath pinned by a newer layout: refused, nothing touched, the
    // running program keeps forwarding.
    lbd.kill().unwrap();
    let program = attached_program(&lab);
    set_layout(&maps, 99);
    let err = Lbd::start_binary(&lab, &exe, &config, &sock).err().expect("a newer layout must be refused");
    let text = format!("{err:#}");
    assert!(text.contains("has map layout version 99, newer than this lbd's"), "{text}");
    assert_eq!(attached_program(&lab), program, "the refused lbd changed the attached program");
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "50"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    set_layout(&maps, lb_common::LAYOUT_VERSION);
    let mut lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(&bin);
}

#[test]
fn an_upgrade_killed_while_migrating_is_migrated_again_by_the_next_start() {
    killed_while_migrating("lbt-upgradek", old_lbd, 1, "FLOWS");
}

/// The same from layout 3, whose flow table (`FLOW_SLOTS`) the migration
/// reads slot by slot into the new, seeded one.
#[test]
fn an_upgrade_from_layout_3_killed_while_migrating_is_migrated_again_by_the_next_start() {
    killed_while_migrating("lbt-upgradek3", v3_lbd, 3, "FLOW_SLOTS");
}

/// An old release (`release`, of layout `from`, whose IPv4 flow table is
/// pinned as `flows`) runs; this build's lbd is killed as soon as it has
/// set the old maps aside; the next start puts them back and migrates.
fn killed_while_migrating(prefix: &str, release: fn(&Lab) -> PathBuf, from: u32, flows: &str) {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let lab = Lab::up(LabSpec { prefix: prefix.into(), ..LabSpec::default() }).unwrap();
    let sock = socket_for(prefix);
    let config =
        write_config(&config_dir(prefix), "lbd", &sock, &web("    scheduler: rr\n", &[(1, 1), (2, 1), (3, 1)]))
            .unwrap();
    let maps = lab.pin_dir().join("maps");
    let aside = lab.pin_dir().join(format!("maps-v{from}"));
    let mut old = Lbd::start_binary(&lab, &release(&lab), &config, &sock).unwrap();
    if from == 1 {
        assert!(!maps.join("LAYOUT").exists(), "not the layout-1 release");
    } else {
        assert_eq!(pinned_layout(&maps), from, "not the layout-{from} release");
    }
    lab.reset_backend_counts().unwrap();
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "100"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    let program = attached_program(&lab);
    old.kill().unwrap();

    // The new lbd is killed while migrating, as soon as the old maps are
    // aside: of its new maps none, some or all are pinned, their layout
    // not yet written; the old program is still attached and forwarding
    // on the old maps.
    kill_once_pinned(&lab, &lab.spec.bin_dir.join("lbd"), &config, &[aside.join(flows)]);
    assert!(aside.join(flows).exists(), "the killed start had not set the old maps aside");
    let pinned = std::fs::read_dir(&maps).map_or(0, Iterator::count);
    println!("the killed start had pinned {pinned} new maps");
    assert!(
        !maps.join("LAYOUT").exists() || pinned_layout(&maps) == 0,
        "the killed start had written its layout already"
    );
    assert_eq!(attached_program(&lab), program, "the killed start swapped its program in");
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "50"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(lab.connections_served().unwrap(), 150);

    // The next start puts the old maps back and migrates them, counters
    // and all, instead of refusing "layout version 0".
    let mut lbd = Lbd::start(&lab, &config, &sock).expect("the next start refused what the killed one left");
    let log = lbd.log_text();
    assert!(log.contains("never finished setting up"), "no word of the half-made maps in the log");
    assert!(log.contains("migrated the pinned datapath"), "not migrated");
    assert_ne!(attached_program(&lab), program);
    assert!(!aside.exists(), "the old maps were not removed after the migration");
    assert_eq!(pinned_layout(&maps), lb_common::LAYOUT_VERSION);
    assert_ne!(pinned_seed(&maps), 0, "the migrated tables were given no seed");
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "100"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    let served = lab.connections_served().unwrap();
    assert_eq!(served, 250);
    let flows = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == served));
    assert_eq!(flows, Some(served), "lbd counted {} new flows, the backends {served}", lbd.total_new_flows());
    assert!(lbd.stop().unwrap().success());
}

/// From layout 2 (flows in kernel hash maps, `FLOWS` and `FLOWS6`) to
/// this build's flow table of slots, under load: the restarted lbd copies
/// every flow through the new datapath's insert, swaps its program in and
/// copies the flows the old program made meanwhile; no request fails, no
/// live connection changes backend, counters carry on, and the old maps
/// are gone.
#[test]
fn an_upgrade_from_kernel_hash_flow_tables_keeps_every_flow() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let Staged { lab, mut lbd, bin, exe, maps, .. } = start_release("lbt-upgrade2", v2_lbd);
    assert_eq!(pinned_layout(&maps), 2, "not the layout-2 release");
    assert!(maps.join("FLOWS").exists() && !maps.join("FLOW_SLOTS").exists(), "not the layout-2 release's maps");
    lab.reset_backend_counts().unwrap();
    let old_program = lbd.program_id().unwrap();

    upgrade_under_load(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:80");
    migrated(&lab, &lbd, &maps, 2);
    assert!(maps.join("FLOW_SLOTS").exists() && !maps.join("FLOWS").exists(), "the flow tables were not replaced");
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(&bin);
}

/// From layout 3 (flows in slots placed by an unseeded hash) to this
/// build's seeded slots, under load: the restarted lbd draws a seed,
/// copies every entry of the old tables through the new datapath's
/// insert, swaps its program in and copies the entries the old program
/// made meanwhile; no request fails, no live connection changes backend,
/// counters carry on, the old maps are gone. A restart after it adopts
/// the tables with the seed they were filled under.
#[test]
fn an_upgrade_from_unseeded_flow_slots_keeps_every_flow_under_a_drawn_seed() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let Staged { lab, mut lbd, bin, exe, maps, .. } = start_release("lbt-upgrade3", v3_lbd);
    assert_eq!(pinned_layout(&maps), 3, "not the layout-3 release");
    assert!(maps.join("FLOW_SLOTS").exists() && !maps.join("FLOW_SEED").exists(), "not the layout-3 release's maps");
    lab.reset_backend_counts().unwrap();
    let old_program = lbd.program_id().unwrap();

    upgrade_under_load(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:80");
    migrated(&lab, &lbd, &maps, 3);
    let seed = pinned_seed(&maps);
    assert_ne!(seed, 0, "the migrated tables were given no seed");

    // A plain restart adopts the tables and their seed: every entry the
    // status counted is still there, and the connections open across it
    // (the upgrade's have all closed) keep their backends.
    let stop = bin.join("adopt-stop");
    let _ = std::fs::remove_file(&stop);
    std::thread::scope(|scope| {
        let stop_loads = StopLoads(&stop);
        let long = scope.spawn(|| {
            let stop = stop.to_str().unwrap();
            let args = ["longlived", "--target", "10.10.0.100:80", "--connections", "20", "--rounds", "1"];
            lab.client(&[&args[..], &["--interval-ms", "50", "--stop-file", stop]].concat()).unwrap()
        });
        let entries = || lbd.status().ok().and_then(|s| s["flood"]["flow_entries"].as_u64());
        let entries = wait_for(10, || entries().filter(|&n| n >= 20)).expect("the 20 connections' entries");
        lbd.restart().unwrap();
        assert_eq!(pinned_seed(&maps), seed, "the restart changed the adopted tables' seed");
        let after = lbd.status().unwrap()["flood"]["flow_entries"].as_u64().expect("flow_entries");
        assert!(after <= entries && after >= 20, "{entries} entries before the restart, {after} after");
        std::thread::sleep(Duration::from_millis(500));
        drop(stop_loads);
        let r = long.join().unwrap();
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["switched"], 0, "a live connection changed backend across the adoption: {r}");
    });
    let r = lab.client(&["conns", "--target", "10.10.0.100:80", "--count", "100"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(&bin);
}

/// From layout 4 (slots hashed over the whole 5-tuple, a reply entry
/// keyed by the backend's bare 5-tuple) to this build's (a slot hashed
/// from the client's side, reply keys marked), under load, with the
/// long-lived connections on a service whose backends another service
/// owns (`alt`: each flow has a reply entry, made by the old program
/// and migrated). Nothing fails or changes backend; once every
/// connection has closed, the sweeper empties the table: a reply entry
/// migrated without its mark would be one the sweeper never finds from
/// its forward entry, left behind for good.
#[test]
fn an_upgrade_from_whole_tuple_slots_keeps_every_flow_and_its_reply_entry() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let services = web_and_alt("rr");
    let Staged { lab, mut lbd, bin, exe, maps, .. } = start_release_with("lbt-upgrade4", v4_lbd, &services);
    assert_eq!(pinned_layout(&maps), 4, "not the layout-4 release");
    lab.reset_backend_counts().unwrap();
    let old_program = lbd.program_id().unwrap();

    upgrade_under_load(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:81");
    migrated(&lab, &lbd, &maps, 4);
    assert_ne!(pinned_seed(&maps), 0, "the migrated tables lost their seed");
    emptied_then_stopped(&lab, &mut lbd, &bin);
}

/// From layout 5 (a selection-table entry per 8-byte element of SELECT)
/// to this build's (four to an element), under load, with the
/// long-lived connections on a Maglev service whose backends another
/// service owns (`alt`: each flow has a reply entry): the old program
/// picks from its SELECT until the swap, this one from the packed copy
/// the first apply wrote. Nothing fails or changes backend; the pinned
/// SELECT is the packed one (8-byte elements, a quarter as many); new
/// connections after it spread over every backend; once every connection
/// has closed, the table empties.
#[test]
fn an_upgrade_from_unpacked_selection_tables_keeps_every_flow_and_picks_from_the_packed_ones() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let services = web_and_alt("maglev");
    let Staged { lab, mut lbd, bin, exe, maps, .. } = start_release_with("lbt-upgrade5", v5_lbd, &services);
    assert_eq!(pinned_layout(&maps), 5, "not the layout-5 release");
    let select = |maps: &Path| {
        let v = map_info(maps, "SELECT");
        (v["bytes_value"].as_u64(), v["max_entries"].as_u64())
    };
    // The lab config's table_capacity: the default, 4,194,304 entries.
    assert_eq!(select(&maps), (Some(4), Some(4_194_304)), "not layout 5's SELECT");
    lab.reset_backend_counts().unwrap();
    let old_program = lbd.program_id().unwrap();

    upgrade_under_load(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:81");
    migrated(&lab, &lbd, &maps, 5);
    assert_eq!(select(&maps), (Some(8), Some(1_048_576)), "SELECT is not packed four entries to an element");
    lab.reset_backend_counts().unwrap();
    // From sources the load to web just used: some reuse an address and
    // port whose web flow on the same backend has closed and lingers.
    let r = lab
        .client(&["conns", "--target", "10.10.0.100:81", "--count", "300", "--sources-range", "10.10.1.21-10.10.1.120"])
        .unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    let served: Vec<u64> = lab.backend_counts().unwrap().iter().map(|c| c.connections).collect();
    assert!(served.iter().all(|&n| n > 30), "Maglev's new connections after the upgrade: {served:?}");
    let entries = || lbd.status().ok().and_then(|s| s["flood"]["flow_entries"].as_u64());
    let left = wait_for(40, || entries().filter(|&n| n == 0));
    assert_eq!(left, Some(0), "entries left after every connection closed: {:?}", entries());
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(&bin);
}

/// From layout 6 (each flow table one array, in vmalloc's 4 KB pages) to
/// this build's (arrays of 30 KB held by an array of maps), under load,
/// with the long-lived connections on a service whose backends another
/// service owns (each flow has a reply entry): nothing fails or changes
/// backend, every flow is copied into the new tables, the pinned tables
/// are arrays of maps holding as many arrays as their slots need, and
/// `FLOW_SEED` keeps their sizes beside the seed. A restart adopts them,
/// keeping the flows; once every connection has closed, the table
/// empties.
#[test]
fn an_upgrade_from_one_array_flow_tables_keeps_every_flow_in_small_arrays() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let services = web_and_alt("maglev");
    let Staged { lab, mut lbd, bin, exe, maps, .. } = start_release_with("lbt-upgrade6", v6_lbd, &services);
    // The client's kernel picks its ports from 200: the load reuses every
    // tuple again and again, often within the upgrade's windows. A
    // connection the new program opened while the old one still ran on
    // the backends' side, then closed, left a half-open entry here, and
    // the client's next connection on its tuple went uncounted (lbd one
    // new flow under the backends' connections in about 1 run of 3 with
    // these ports, 1 of 8 with the kernel's default range).
    let ports = lab.cmd("client", "sysctl").args(["-qw", "net.ipv4.ip_local_port_range=40000 40199"]).status();
    assert!(ports.unwrap().success(), "narrowing the client's port range");
    assert_eq!(pinned_layout(&maps), 6, "not the layout-6 release");
    let show = |name: &str| map_info(&maps, name);
    assert_eq!(show("FLOW_SLOTS")["type"], "array", "not layout 6's flow table");
    lab.reset_backend_counts().unwrap();
    let old_program = lbd.program_id().unwrap();

    upgrade_under_load(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:81");
    migrated(&lab, &lbd, &maps, 6);
    // The lab config's conntrack_max (`write_config`): 262,144 flows in
    // 524,288 slots of each family.
    let slots = u64::from(lb_common::flow_slots(262_144));
    for (name, per) in
        [("FLOW_SLOTS", lb_common::FLOW_ARRAY_ELEMENTS), ("FLOW_SLOTS6", lb_common::FLOW_ARRAY_ELEMENTS6)]
    {
        let m = show(name);
        assert_eq!(m["type"], "array_of_maps", "{name}: {m}");
        let arrays = (slots / u64::from(lb_common::SLOT_BUCKET)).div_ceil(u64::from(per));
        assert_eq!(m["max_entries"].as_u64(), Some(arrays), "{name}: {m}");
    }
    let sizes = lb_tests::lbd::pinned_words(&maps, "FLOW_SEED");
    assert_eq!(sizes.len(), 3, "FLOW_SEED: {sizes:?}");
    assert_ne!(sizes[0], 0, "the migrated tables lost their seed");
    assert_eq!(&sizes[1..], &[slots, slots], "FLOW_SEED's table sizes");
    // A restart adopts the new tables with what they hold: round-robin
    // connections kept open across it stay on their backends (a lost
    // entry would send their next packets to the next backend in turn).
    let said = |lbd: &Lbd, what: &str| lbd.log_text().matches(what).count();
    let (adopted, migrations) = (said(&lbd, "adopted the pinned datapath"), said(&lbd, "migrating the pinned"));
    let r = std::thread::scope(|scope| {
        let long = scope.spawn(|| lab.longlived("10.10.0.100:80", 10, 100, 50, &[]).unwrap());
        std::thread::sleep(Duration::from_millis(1000));
        lbd.restart().unwrap();
        long.join().unwrap()
    });
    assert_eq!(said(&lbd, "adopted the pinned datapath"), adopted + 1, "{}", lbd.log_text());
    assert_eq!(said(&lbd, "migrating the pinned"), migrations, "migrated again: {}", lbd.log_text());
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["switched"], 0, "a connection changed backend across the restart: {r}");
    emptied_then_stopped(&lab, &mut lbd, &bin);
}

/// This build's lbd started on the lab of `prefix` (whose lbd was killed,
/// its datapath left running) with a bridge (`bridge`, made here) beside
/// the lab's interfaces in forced native mode, which it cannot attach to:
/// the start fails there, and what it said is returned.
fn start_with_a_bridge(lab: &Lab, prefix: &str, sock: &Path, bridge: &str, services: &str) -> String {
    lab.ip("gw", &["link", "add", bridge, "type", "bridge"]).unwrap();
    lab.ip("gw", &["link", "set", bridge, "up"]).unwrap();
    let bad = write_config_with(
        &config_dir(prefix),
        "bad",
        sock,
        &["eth0".into(), "eth1".into(), bridge.into()],
        "conntrack_max: 262144\nxdp_mode: native\n",
        services,
    )
    .unwrap();
    let err = Lbd::start_binary(lab, &lab.spec.bin_dir.join("lbd"), &bad, sock)
        .err()
        .expect("the new lbd started with a bridge in forced native mode");
    let text = format!("{err:#}");
    assert!(text.contains(&format!("attaching XDP to {bridge}")), "{text}");
    text
}

/// The maps layout 8 added to layout 7's (`dataplane::layout::added_since`).
const ADDED_IN_8: [&str; 3] = ["FLOW_CREDIT", "CONNS_CPU", "CONNS_SUM"];

#[test]
fn an_upgrade_from_layout_7_takes_its_maps_up_in_place_and_counts_per_cpu_from_then_on() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-upgrade7";
    // `alt` schedules by least connections: its flows stay counted in the
    // shared counts, `web`'s (round robin) go to the per-CPU ones.
    let services = web_and_alt("least-conn");
    let Staged { lab, mut lbd, sock, config, bin, exe, maps } = start_release_with(prefix, v7_lbd, &services);
    assert_eq!(pinned_layout(&maps), 7, "not the layout-7 release");
    for name in ADDED_IN_8 {
        assert!(!maps.join(name).exists(), "the layout-7 release pinned {name}");
    }
    lab.reset_backend_counts().unwrap();

    // A take-up that cannot attach everywhere (a bridge in forced native
    // mode) is undone: the pinned datapath says layout 7 again, the maps
    // it added go, and the old lbd adopts its datapath as it was.
    let before = lbd.program_id().unwrap();
    lbd.kill().unwrap();
    let text = start_with_a_bridge(&lab, prefix, &sock, "lbtbr7", &services);
    assert!(text.contains("taking it up in place"), "{text}");
    assert!(text.contains("the take-up of the pinned datapath was undone"), "{text}");
    assert_eq!(pinned_layout(&maps), 7, "the undone take-up left its layout version");
    for name in ADDED_IN_8 {
        assert!(!maps.join(name).exists(), "the undone take-up left {name} pinned");
    }
    for iface in ["eth0", "eth1"] {
        assert_eq!(xdp_program_in_use(&lab, iface), before, "the failed take-up replaced the old program on {iface}");
    }
    let mut lbd = Lbd::start_binary(&lab, &exe, &config, &sock).unwrap();
    assert!(lbd.log_text().contains("adopted the pinned datapath"), "{}", lbd.log_text());
    let old_program = lbd.program_id().unwrap();

    // The take-up under load: nothing fails, no live connection moves,
    // every count carries on (the upgrade's own checks), and then every
    // backend's active count returns to 0 as the connections close,
    // whichever program counted their opening and their close.
    upgrade_under_load_as(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:81", false);
    taken_up_in_place(&lab, &lbd, &maps);
    for name in ADDED_IN_8 {
        assert!(maps.join(name).exists(), "{name} was not pinned");
    }
    // From the take-up on, `web`'s new flows were counted per CPU, `alt`'s
    // in the shared counts (which also hold what the old program counted).
    let (per_cpu, shared) = (pinned_conns(&maps, "CONNS_CPU"), pinned_conns(&maps, "CONNS"));
    println!("connection counts (opened, closed): per CPU {per_cpu:?}, shared {shared:?}");
    assert!(per_cpu.0 > 0, "no flow was counted per CPU: {per_cpu:?}");
    assert!(shared.0 > 0, "no flow was counted in the shared counts: {shared:?}");
    emptied_then_stopped(&lab, &mut lbd, &bin);
}

/// The upgrade an operator of the last release makes: layout 8's tables
/// (claims without the generation layout 9 keeps in them, and no
/// sweeper's mark) taken up in place under load. Nothing fails, no live
/// connection moves, the new program and its sweeper go on with the
/// entries the old one made (a reply entry for each `alt` flow among
/// them) until every one is removed, and every count carries on.
#[test]
fn an_upgrade_from_layout_8_takes_its_tables_up_in_place_under_load() {
    let _serial = serial();
    lb_tests::require_root().expect("needs root");
    let prefix = "lbt-upgrade8";
    let services = web_and_alt("least-conn");
    let Staged { lab, mut lbd, bin, exe, maps, .. } = start_release_with(prefix, v8_lbd, &services);
    assert_eq!(pinned_layout(&maps), 8, "not the layout-8 release");
    lab.reset_backend_counts().unwrap();
    let old_program = lbd.program_id().unwrap();
    upgrade_under_load_as(&lab, &mut lbd, &bin, &exe, old_program, "10.10.0.100:81", false);
    taken_up_in_place(&lab, &lbd, &maps);
    emptied_then_stopped(&lab, &mut lbd, &bin);
}

/// Once every connection has closed, the table empties (its entries go
/// after the closed-flow linger, 10 s, at the next sweep, every 5 s);
/// `alt` still serves; a SIGTERM stops lbd and leaves no pins; the staged
/// binaries in `bin` go.
fn emptied_then_stopped(lab: &Lab, lbd: &mut Lbd, bin: &Path) {
    let entries = || lbd.status().ok().and_then(|s| s["flood"]["flow_entries"].as_u64());
    let left = wait_for(40, || entries().filter(|&n| n == 0));
    assert_eq!(left, Some(0), "entries left after every connection closed: {:?}", entries());
    let r = lab.client(&["conns", "--target", "10.10.0.100:81", "--count", "100"]).unwrap();
    assert_eq!(r["failed"], 0, "{r}");
    assert!(lbd.stop().unwrap().success());
    assert!(!lab.pin_dir().exists(), "pins left after SIGTERM");
    let _ = std::fs::remove_dir_all(bin);
}

/// The lab's `web` service (round robin over three backends) and `alt`
/// (port 81, `scheduler`) over the same three backends' addresses on
/// port 8080: each `alt` flow has a reply entry.
fn web_and_alt(scheduler: &str) -> String {
    let mut services = web("    scheduler: rr\n", &[(1, 1), (2, 1), (3, 1)]);
    services.push_str(&format!(
        "  - name: alt\n    vip: 10.10.0.100\n    port: 81\n    scheduler: {scheduler}\n    backends:\n"
    ));
    for n in 1..=3 {
        services.push_str(&format!("      - {{ address: 10.20.0.{}, port: 8080, weight: 1 }}\n", 10 + n));
    }
    services
}

/// `bpftool map show` of the map `name` pinned in `maps`.
fn map_info(maps: &Path, name: &str) -> serde_json::Value {
    let out = Command::new("bpftool").args(["-j", "map", "show", "pinned"]).arg(maps.join(name)).output().unwrap();
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// After an upgrade from a layout taken up in place (7 or 8): lbd says
/// so and migrated nothing, the pinned layout is this build's, and lbd's
/// new-flow count equals the connections the backends served.
fn taken_up_in_place(lab: &Lab, lbd: &Lbd, maps: &Path) {
    let log = lbd.log_text();
    assert!(log.contains("taking it up in place"), "{log}");
    assert!(!log.contains("migrating the pinned"), "{log}");
    assert_eq!(pinned_layout(maps), lb_common::LAYOUT_VERSION);
    let counts = lab.connections_served().unwrap();
    let flows = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == counts));
    assert_eq!(flows, Some(counts), "lbd counted {} new flows, backends {counts}", lbd.total_new_flows());
}

/// After an upgrade from layout `from`: lbd says it migrated, the pinned
/// layout is this build's, the old maps are gone, and lbd's new-flow
/// count equals the connections the backends served.
fn migrated(lab: &Lab, lbd: &Lbd, maps: &Path, from: u32) {
    let log = lbd.log_text();
    assert!(log.contains("migrated the pinned datapath"), "{log}");
    assert_eq!(pinned_layout(maps), lb_common::LAYOUT_VERSION);
    assert!(!lab.pin_dir().join(format!("maps-v{from}")).exists(), "the old maps were not removed");
    let counts = lab.connections_served().unwrap();
    let flows = wait_for(5, || Some(lbd.total_new_flows()).filter(|&n| n == counts));
    assert_eq!(flows, Some(counts), "lbd counted {} new flows, backends {counts}", lbd.total_new_flows());
}

/// The upgrade itself, under load: new connections from 230 sources and
/// 20 long-lived ones from 20 others run while this build's lbd replaces
/// the old binary `exe` on disk (staged in `bin`) and `lbd`'s graceful
/// restart runs it, migrating the maps and swapping its program in on the
/// pinned links (the long-lived ones to `long_target`). Both loads go on
/// until a while after the swap, so that the old program serves between
/// the migration's first copy of the flows and its late one. No
/// connection fails and no live one changes backend. The late copy took
/// flows made and changed in that window, and once every connection has
/// closed the table empties within the closed flows' linger (a flow whose
/// close only the old program saw would otherwise stay open here until
/// its idle timeout) and no backend counts an active flow. The two loads'
/// sources differ: a client that reuses one source address and port for
/// two services sharing a backend endpoint, at the same time and on the
/// same backend, collides on the backend's tuple whatever the balancer
/// does (README, "Shared endpoints"), and that is not what an upgrade test
/// is about.
fn upgrade_under_load(lab: &Lab, lbd: &mut Lbd, bin: &Path, exe: &Path, old_program: u64, long_target: &str) {
    upgrade_under_load_as(lab, lbd, bin, exe, old_program, long_target, true);
}

/// [`upgrade_under_load`], where `migrating` says whether the new build
/// migrates the maps (copies the flows, first and late) or takes them up
/// in place (nothing to copy: the checks of the late copy are left out).
fn upgrade_under_load_as(
    lab: &Lab,
    lbd: &mut Lbd,
    bin: &Path,
    exe: &Path,
    old_program: u64,
    long_target: &str,
    migrating: bool,
) {
    let stop = bin.join("load-stop");
    // Left by an earlier run that failed.
    let _ = std::fs::remove_file(&stop);
    let stop_arg = stop.to_str().unwrap();
    std::thread::scope(|scope| {
        let stop_loads = StopLoads(&stop);
        let load = scope.spawn(|| {
            lab.client(&[
                "conns",
                "--target",
                "10.10.0.100:80",
                "--concurrency",
                "10",
                "--stop-file",
                stop_arg,
                "--sources-range",
                "10.10.1.21-10.10.1.250",
            ])
            .unwrap()
        });
        let long = scope.spawn(|| lab.longlived(long_target, 20, 40, 50, &["--stop-file", stop_arg]).unwrap());
        std::thread::sleep(Duration::from_millis(2000));
        // The new build replaces the old one on disk; the graceful restart
        // runs it, it migrates the maps and swaps its program in.
        let staged = bin.join("lbd.new");
        std::fs::copy(lab.spec.bin_dir.join("lbd"), &staged).unwrap();
        std::fs::rename(&staged, exe).unwrap();
        let restarted = lbd.restart();
        // The loads go on through the new program for a while, and stop
        // however the restart went.
        std::thread::sleep(Duration::from_millis(1500));
        drop(stop_loads);
        let new_program = restarted.unwrap();
        assert_ne!(new_program, old_program);
        assert_eq!(attached_program(lab), new_program);

        let r = load.join().unwrap();
        println!(
            "new connections through the upgrade: ok {} failed {} per backend {}",
            r["ok"], r["failed"], r["per_backend"]
        );
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["ok"].as_u64().unwrap() > 500, "{r}");
        let r = long.join().unwrap();
        println!("long-lived connections through the upgrade: {r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["switched"], 0, "a live connection changed backend: {r}");
    });
    if migrating {
        let log = lbd.log_text();
        let done = log.lines().find(|l| l.contains("migrated the pinned datapath")).unwrap_or_else(|| panic!("{log}"));
        let field = |name: &str| -> u64 {
            let at = done.find(&format!("{name}=")).unwrap_or_else(|| panic!("no {name} in {done}"));
            done[at + name.len() + 1..].split(' ').next().unwrap().parse().unwrap()
        };
        assert!(field("late_flows") > 0, "no flow was made between the two copies: {done}");
        println!("{done}");
        let changed = field("merged_flows") + field("replaced_flows");
        assert!(changed > 0, "no copied flow changed between the two copies: {done}");
    }
    // Closed flows linger 10 s; sweeps run every 1 to 5 s.
    let entries = || lbd.status().ok().and_then(|s| s["flood"]["flow_entries"].as_u64());
    let left = wait_for(25, || entries().filter(|&n| n == 0));
    assert_eq!(left, Some(0), "entries left after every connection closed: {:?}", entries());
    let status = lbd.status().unwrap();
    let counters = &status["counters"];
    println!("held {} stale_backend {}", counters["held"], counters["stale_backend"]);
    for b in status["services"].as_array().unwrap().iter().flat_map(|s| s["backends"].as_array().unwrap()) {
        assert_eq!(b["active_flows"], 0, "a backend counts active flows after every connection closed: {b}");
    }
}

//! The setup every lab test starts from: one test at a time per test
//! binary, a fresh lab, lbd started with a generated config, backend
//! counters zeroed. Dropped in order: lbd, then the lab, then the lock.
use std::{
    path::PathBuf,
    sync::{Mutex, MutexGuard},
};

use crate::{
    lab::{Lab, LabSpec},
    lbd::{Lbd, write_config},
};

static SERIAL: Mutex<()> = Mutex::new(());

/// Lab tests of one binary run one at a time (they measure, and share the
/// machine's two cores).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// lbd's control socket for the lab `prefix`.
pub fn socket_for(prefix: &str) -> PathBuf {
    PathBuf::from(format!("/run/lbd/{prefix}.sock"))
}

/// Where the lab `prefix` keeps its generated configs.
pub fn config_dir(prefix: &str) -> PathBuf {
    PathBuf::from(format!("/tmp/{prefix}-cfg"))
}

/// A `web` service on 10.10.0.100:80: `extra` lines (indented as service
/// keys) and lab backends given as (1-based number, weight).
pub fn web(extra: &str, backends: &[(u8, u32)]) -> String {
    let mut s = format!("  - name: web\n    vip: 10.10.0.100\n    port: 80\n{extra}    backends:\n");
    for (n, w) in backends {
        s.push_str(&format!("      - {{ address: 10.20.0.{}, port: 8080, weight: {w} }}\n", 10 + n));
    }
    s
}

pub struct Running {
    pub lbd: Lbd,
    pub lab: Lab,
    pub config: PathBuf,
    _serial: MutexGuard<'static, ()>,
}

impl Running {
    /// A lab of `backends` backends with lbd serving `services`.
    pub fn start(prefix: &str, backends: usize, services: &str) -> Self {
        let guard = serial();
        crate::require_root().expect("lab tests need root");
        let lab = Lab::up(LabSpec { prefix: prefix.into(), backends, ..LabSpec::default() }).expect("lab up");
        let sock = socket_for(prefix);
        let config = write_config(&config_dir(prefix), "lbd", &sock, services).expect("config");
        let lbd = Lbd::start(&lab, &config, &sock).expect("lbd start");
        lab.reset_backend_counts().expect("reset backend counts");
        Self { lbd, lab, config, _serial: guard }
    }

    /// Rewrite the config file with `services` and `lbctl reload`.
    pub fn reconfigure(&self, services: &str) {
        let dir = self.config.parent().expect("config dir").to_owned();
        write_config(&dir, "lbd", &self.lbd.socket, services).expect("config");
        let out = self.lbd.lbctl(&["reload"]).expect("reload");
        assert!(out.starts_with("reloaded"), "{out}");
    }
}

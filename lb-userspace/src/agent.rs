//! The running agent's state: the dataplane plus the configuration it was
//! given. Every change (reload from the file, SIGHUP, the control API, the
//! flow sweeper) goes through here, under one lock, to the one writer of
//! the maps.
use std::path::PathBuf;

use tracing::{info, warn};

use crate::{
    config::{self, Config, ConfigError, Problem, System},
    dataplane::{Dataplane, DataplaneError, SweepReport, monotonic_coarse_secs},
};

pub struct Agent {
    pub dp: Dataplane,
    pub config: Config,
    pub config_path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("{0}")]
    Invalid(ConfigError),
    #[error("applying the new configuration failed ({0}); the previous one was restored")]
    Apply(DataplaneError),
}

/// What a successful reload changed.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ReloadSummary {
    pub services: usize,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl Agent {
    /// Re-read the config file, validate it in full and apply the
    /// difference. On any problem the running state stays exactly as it was.
    pub fn reload(&mut self) -> Result<ReloadSummary, ReloadError> {
        let new = config::load(&self.config_path, &System).map_err(ReloadError::Invalid)?;
        let restart: Vec<Problem> = self
            .config
            .restart_only_changes(&new)
            .into_iter()
            .map(|k| Problem {
                file: self.config_path.display().to_string(),
                field: k.to_owned(),
                reason: "changed, but this key only takes effect when lbd starts; restart lbd to change it".into(),
            })
            .collect();
        if !restart.is_empty() {
            return Err(ReloadError::Invalid(ConfigError { problems: restart }));
        }
        let old = &self.config.services;
        let summary = ReloadSummary {
            services: new.services.len(),
            added: new.services.iter().filter(|s| !old.iter().any(|o| o.name == s.name)).map(|s| s.name.clone()).collect(),
            removed: old.iter().filter(|o| !new.services.iter().any(|s| s.name == o.name)).map(|s| s.name.clone()).collect(),
            changed: new
                .services
                .iter()
                .filter(|s| old.iter().any(|o| o.name == s.name && o != *s))
                .map(|s| s.name.clone())
                .collect(),
        };
        if let Err(e) = self.dp.apply_admin(&new.services) {
            warn!(error = %e, "reload failed while applying; restoring the previous configuration");
            if let Err(e2) = self.dp.apply_admin(&self.config.services) {
                warn!(error = %e2, "restoring the previous configuration failed too");
            }
            return Err(ReloadError::Apply(e));
        }
        self.config.services = new.services;
        self.config.tcp_idle_timeout = new.tcp_idle_timeout;
        self.config.udp_idle_timeout = new.udp_idle_timeout;
        info!(added = ?summary.added, removed = ?summary.removed, changed = ?summary.changed, "reload applied");
        Ok(summary)
    }

    /// Expire idle flows now.
    pub fn sweep(&mut self) -> Result<SweepReport, DataplaneError> {
        self.dp.sweep(
            monotonic_coarse_secs(),
            u64::from(self.config.tcp_idle_timeout),
            u64::from(self.config.udp_idle_timeout),
        )
    }
}

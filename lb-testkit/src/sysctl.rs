//! Kernel settings a benchmark changes for its run, put back afterwards,
//! also after the run was killed: the value found is saved to a file under
//! [`SAVED_DIR`] before the change, the guard puts it back on drop and
//! removes the file, and [`restore_saved`] (called by the next guard and by
//! `cargo xtask lab down --all`) puts back whatever a killed run left.
use std::{
    io,
    path::{Path, PathBuf},
};

/// Where the values found are kept while a run has them changed.
pub const SAVED_DIR: &str = "/run/lbd/saved-sysctl";

fn proc_path(name: &str) -> PathBuf {
    Path::new("/proc/sys").join(name.replace('.', "/"))
}

/// A sysctl (`kernel.bpf_stats_enabled`) set for as long as this lives.
pub struct Sysctl {
    name: String,
    old: String,
}

impl Sysctl {
    /// Set `name` to `value`, first saving the value found (after putting
    /// back any value a killed run left changed).
    pub fn set(name: &str, value: &str) -> io::Result<Self> {
        restore_saved()?;
        let old = std::fs::read_to_string(proc_path(name))?.trim().to_owned();
        std::fs::create_dir_all(SAVED_DIR)?;
        std::fs::write(Path::new(SAVED_DIR).join(name), &old)?;
        write(name, value)?;
        Ok(Self { name: name.to_owned(), old })
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        match std::fs::write(proc_path(&self.name), &self.old) {
            Ok(()) => {
                let _ = std::fs::remove_file(Path::new(SAVED_DIR).join(&self.name));
            }
            Err(e) => eprintln!("restoring {}={}: {e} (saved in {SAVED_DIR})", self.name, self.old),
        }
    }
}

/// Write `value` to the sysctl `name` (`kernel.bpf_stats_enabled`), for
/// a change inside a run a [`Sysctl`] guard already covers.
pub fn write(name: &str, value: &str) -> io::Result<()> {
    std::fs::write(proc_path(name), value)
}

/// Put back every value a killed run left saved; returns the settings
/// restored.
pub fn restore_saved() -> io::Result<Vec<String>> {
    let dir = match std::fs::read_dir(SAVED_DIR) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut done = Vec::new();
    for entry in dir {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let value = std::fs::read_to_string(entry.path())?;
        std::fs::write(proc_path(&name), value.trim())?;
        std::fs::remove_file(entry.path())?;
        done.push(format!("{name}={}", value.trim()));
    }
    Ok(done)
}

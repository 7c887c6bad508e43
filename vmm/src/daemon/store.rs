//! VM records persisted under the state directory.
//!
//! Layout: `<state>/vms/<id>.json` (the record), `<state>/vms/<id>.lock` (its
//! lock), `<state>/vms/<id>/` (runtime files: serial log). A write takes the
//! record's `flock`, writes a temp file with a name no other writer can pick
//! (pid + process-wide counter, `O_EXCL`), fsyncs it and renames it over the
//! record: readers see the old or the new record, never half of one, and two
//! writers never share a temp file.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::VmConfig;
use crate::vstate::vm::{DeviceInfo, VmState};

/// Version of the record format.
pub const RECORD_VERSION: u32 = 1;

/// What k7d persists about one VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// Record format version.
    pub version: u32,
    /// VM id.
    pub id: String,
    /// The config as accepted.
    pub config: VmConfig,
    /// Current state.
    #[serde(flatten)]
    pub state: VmState,
    /// Devices as wired (effective, not requested).
    pub devices: Vec<DeviceInfo>,
    /// Serial log path.
    pub serial_log: PathBuf,
    /// pid of the daemon that owns the VM.
    pub daemon_pid: u32,
    /// Seconds since the epoch at creation.
    pub created_unix: u64,
    /// The VM process it runs in (absent: it runs inside the daemon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_process: Option<ProcessRecord>,
    /// The VM it was forked from (kept for a daemon that re-attaches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Its guest agent reseeded its kernel RNG, or a fork child's of it did
    /// (`info` says `rng_reseed: agent`; `daemon/agent_reseed.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rng_agent: bool,
}

/// Where a VM's process is, for the next daemon to re-attach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessRecord {
    /// Its host pid.
    pub pid: u32,
    /// When it started (clock ticks after boot): with the pid, what tells
    /// it from a later process that reused the pid.
    pub start_ticks: u64,
    /// Its uid and gid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// The unix socket it listens on for its next caller.
    pub socket: PathBuf,
    /// Its jail root's directory when it was a spare made ahead
    /// (`<state>/spares/<uid>`), removed with the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare_dir: Option<PathBuf>,
    /// What the `info` line of each of its NICs attached to a pod network
    /// adds (", datapath: MODE"): the datapath is the daemon's, so the VM
    /// process cannot say it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nic_notes: Vec<(u16, String)>,
    /// Its cgroup leaf (`jail/cgroup.rs`), removed with it; none with
    /// `--jail-cgroup off`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
    /// Whether its guest RAM can be sealed against its own writes: built
    /// by a daemon that seals (and for a fork child, from a source whose
    /// RAM could be). A fork of it refuses RAM it cannot seal; a VM
    /// process of an earlier k7d (false) forks unsealed, with a warning.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub seals_ram: bool,
}

/// Errors from the record store.
#[derive(Debug, Error)]
pub enum StoreError {
    /// A filesystem operation failed.
    #[error("state store: cannot {what} {path}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A record did not parse.
    #[error("state store: record {path} is corrupt")]
    Corrupt {
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
}

fn ioerr(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

/// Writes `value` as `<dir>/<id>.json` atomically: a temp file (unique by
/// pid and `seq`), written, synced and renamed into place; on failure the
/// temp file is removed and the old record stays.
pub(super) fn write_json_atomic(
    dir: &Path,
    id: &str,
    value: &impl serde::Serialize,
    seq: &AtomicU64,
) -> Result<(), StoreError> {
    let n = seq.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{id}.json.tmp.{}.{n}", std::process::id()));
    let body = serde_json::to_vec_pretty(value).map_err(|source| StoreError::Corrupt {
        path: tmp.clone(),
        source,
    })?;
    let res = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(ioerr("create", &tmp))?;
        f.write_all(&body).map_err(ioerr("write", &tmp))?;
        f.sync_all().map_err(ioerr("sync", &tmp))?;
        let dst = dir.join(format!("{id}.json"));
        fs::rename(&tmp, &dst).map_err(ioerr("rename into", &dst))
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// The records of one daemon.
#[derive(Debug)]
pub struct RecordStore {
    dir: PathBuf,
    seq: AtomicU64,
    /// `<state_dir>/events.jsonl` (`events.rs`).
    events: super::events::EventLog,
}

impl RecordStore {
    /// `<state_dir>/vms`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Opens (creating) `<state_dir>/vms`.
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        let dir = state_dir.join("vms");
        fs::create_dir_all(&dir).map_err(ioerr("create", &dir))?;
        Ok(Self {
            dir,
            seq: AtomicU64::new(0),
            events: super::events::EventLog::new(state_dir),
        })
    }

    /// The state directory's event log.
    pub fn events(&self) -> &super::events::EventLog {
        &self.events
    }

    fn json(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn lock_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.lock"))
    }

    /// The runtime directory of a VM (created on demand).
    pub fn runtime_dir(&self, id: &str) -> Result<PathBuf, StoreError> {
        let d = self.dir.join(id);
        fs::create_dir_all(&d).map_err(ioerr("create", &d))?;
        Ok(d)
    }

    fn lock(&self, id: &str) -> Result<crate::sys::FileLock, StoreError> {
        let p = self.lock_path(id);
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(ioerr("open lock", &p))?;
        crate::sys::flock(f, true).map_err(ioerr("lock", &p))
    }

    /// Writes `rec` atomically under its lock.
    pub fn save(&self, rec: &VmRecord) -> Result<(), StoreError> {
        let _g = self.lock(&rec.id)?;
        self.write_locked(rec)
    }

    fn write_locked(&self, rec: &VmRecord) -> Result<(), StoreError> {
        write_json_atomic(&self.dir, &rec.id, rec, &self.seq)
    }

    /// Reads, changes and writes a record under its lock; `Ok(None)` if it is gone.
    pub fn update(&self, id: &str, f: impl FnOnce(&mut VmRecord)) -> Result<Option<VmRecord>, StoreError> {
        let _g = self.lock(id)?;
        let Some(mut rec) = self.load(id)? else {
            return Ok(None);
        };
        f(&mut rec);
        self.write_locked(&rec)?;
        Ok(Some(rec))
    }

    /// Reads one record.
    pub fn load(&self, id: &str) -> Result<Option<VmRecord>, StoreError> {
        let p = self.json(id);
        let data = match fs::read(&p) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(ioerr("read", &p)(e)),
        };
        serde_json::from_slice(&data)
            .map(Some)
            .map_err(|source| StoreError::Corrupt { path: p, source })
    }

    /// Ids of every record on disk.
    pub fn ids(&self) -> Result<Vec<String>, StoreError> {
        let mut ids = Vec::new();
        for e in fs::read_dir(&self.dir).map_err(ioerr("list", &self.dir))? {
            let e = e.map_err(ioerr("list", &self.dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".json").filter(|n| !n.starts_with('.')) {
                ids.push(id.to_string());
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// Removes a record, its lock and its runtime directory; each of them
    /// even when another could not be removed (the first failure is returned).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let res = {
            let _g = self.lock(id)?;
            let p = self.json(id);
            let record = match fs::remove_file(&p) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(ioerr("remove", &p)(e)),
            };
            let d = self.dir.join(id);
            let runtime = if d.exists() {
                fs::remove_dir_all(&d).map_err(ioerr("remove", &d))
            } else {
                Ok(())
            };
            record.and(runtime)
        };
        let l = self.lock_path(id);
        let _ = fs::remove_file(&l);
        res
    }

    /// Removes the runtime directories (`<id>/`) and lock files (`<id>.lock`)
    /// that have no record (`<id>.json`): a daemon that died between
    /// creating a VM's runtime directory and writing its record, or while
    /// removing them, leaves them. Returns the names removed. Only entries
    /// named after a valid VM id are touched; a symbolic link is removed,
    /// never followed.
    pub fn sweep_orphans(&self) -> Vec<String> {
        let mut removed = Vec::new();
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return removed;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(md) = fs::symlink_metadata(e.path()) else {
                continue;
            };
            let ft = md.file_type();
            let orphan = |id: &str| crate::config::validate_id(id).is_ok() && !self.json(id).exists();
            let res = if ft.is_dir() && orphan(&name) {
                fs::remove_dir_all(e.path())
            } else if (ft.is_file() || ft.is_symlink()) && name.strip_suffix(".lock").is_some_and(orphan) {
                fs::remove_file(e.path())
            } else if ft.is_symlink() && !name.ends_with(".json") && orphan(&name) {
                // A link where a runtime directory would be.
                fs::remove_file(e.path())
            } else {
                continue;
            };
            match res {
                Ok(()) => removed.push(name),
                Err(err) => {
                    tracing::warn!(entry = %e.path().display(), error = %err, "cannot remove a VM's runtime files that have no record")
                }
            }
        }
        removed.sort();
        removed
    }

    /// Removes temp files a crashed writer left behind.
    pub fn sweep_temp_files(&self) -> usize {
        let mut n = 0;
        if let Ok(rd) = fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') && name.contains(".json.tmp.") && fs::remove_file(e.path()).is_ok() {
                    n += 1;
                }
            }
        }
        n
    }
}

/// Opens a file for the exclusive daemon lock of a state directory.
pub fn open_daemon_lock(state_dir: &Path) -> Result<File, StoreError> {
    let p = state_dir.join("daemon.lock");
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&p)
        .map_err(ioerr("open", &p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn rec(id: &str, n: u64) -> VmRecord {
        VmRecord {
            version: RECORD_VERSION,
            id: id.into(),
            config: VmConfig {
                memory_mib: n,
                ..Default::default()
            },
            state: VmState::Created,
            devices: vec![],
            serial_log: PathBuf::from("/dev/null"),
            daemon_pid: std::process::id(),
            created_unix: 0,
            vm_process: None,
            parent: None,
            rng_agent: false,
        }
    }

    #[test]
    fn concurrent_writers_never_collide() {
        let dir = std::env::temp_dir().join(format!("k7d-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let store = Arc::new(RecordStore::open(&dir).unwrap());
        store.save(&rec("a", 0)).unwrap();
        let hs: Vec<_> = (0..16)
            .map(|t| {
                let s = store.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        s.save(&rec("a", t * 100 + i)).unwrap();
                        s.update("a", |r| r.config.vcpus = 2).unwrap();
                        assert!(s.load("a").unwrap().is_some());
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(store.ids().unwrap(), vec!["a".to_string()]);
        assert_eq!(store.sweep_temp_files(), 0, "a temp file was left behind");
        store.remove("a").unwrap();
        assert_eq!(fs::read_dir(dir.join("vms")).unwrap().count(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }
}

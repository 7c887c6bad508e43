//! The daemon: many VMs in one process, their records, and the API.
//!
//! Forks (a later issue) happen in-process, so every VM lives in this one
//! process. [`Daemon`] executes API requests; [`server`] carries them over a
//! unix socket; [`client`] is the CLI side.

pub mod api;
pub mod client;
pub mod server;
pub mod store;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{Value, json};

use crate::config::VmConfig;
use crate::vstate::vm::{Vm, VmError, VmOptions, VmState};
use api::{ApiError, ErrorCode, Request, Response};
use store::{RecordStore, StoreError, VmRecord};

/// How long `pause` waits for every vCPU to park.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A record found at start whose VM no longer exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reconciled {
    /// VM id.
    pub id: String,
    /// What the record said.
    pub state: String,
    /// The daemon that owned it.
    pub daemon_pid: Option<u32>,
}

/// Daemon-level errors (startup).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Another daemon holds the state directory.
    #[error("another k7d daemon already uses the state directory {0}")]
    Busy(PathBuf),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A socket or file operation failed.
    #[error("{what}")]
    Io {
        /// What failed.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

enum Slot {
    /// An id taken by a create still in progress.
    Reserved,
    Vm(Arc<Mutex<Vm>>),
}

/// The VM owner.
pub struct Daemon {
    store: Arc<RecordStore>,
    vms: Mutex<HashMap<String, Slot>>,
    state_dir: PathBuf,
    node: crate::config::NodeConfig,
    _lock: crate::sys::FileLock,
}

fn internal(e: impl std::error::Error) -> ApiError {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    ApiError::new(ErrorCode::Internal, msg)
}

fn vm_error(e: VmError) -> ApiError {
    match e {
        VmError::State { .. } | VmError::Refused(_) => ApiError::new(ErrorCode::Conflict, e.to_string()),
        VmError::Guest(_) => ApiError::new(ErrorCode::InvalidArgument, e.to_string()),
        other => internal(other),
    }
}

fn lock_vm(vm: &Arc<Mutex<Vm>>) -> MutexGuard<'_, Vm> {
    vm.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Daemon {
    /// Takes the state directory (exclusively), sweeps leftovers, and
    /// reconciles records whose VMs no longer exist.
    pub fn open(state_dir: &Path) -> Result<(Self, Vec<Reconciled>), DaemonError> {
        std::fs::create_dir_all(state_dir).map_err(|source| DaemonError::Io {
            what: format!("cannot create the state directory {}", state_dir.display()),
            source,
        })?;
        let lock_file = store::open_daemon_lock(state_dir)?;
        let lock = crate::sys::flock(lock_file, false).map_err(|_| DaemonError::Busy(state_dir.to_path_buf()))?;
        let store = Arc::new(RecordStore::open(state_dir)?);
        let swept = store.sweep_temp_files();
        if swept > 0 {
            tracing::warn!(swept, "removed temp files left by an interrupted record write");
        }
        let mut reconciled = Vec::new();
        for id in store.ids()? {
            // VMs live inside the daemon process: a record on disk at start
            // belongs to a daemon that is gone, so its VM is gone too.
            let rec = store.load(&id).ok().flatten();
            let r = Reconciled {
                id: id.clone(),
                state: rec
                    .as_ref()
                    .map(|r| r.state.to_string())
                    .unwrap_or_else(|| "unreadable".into()),
                daemon_pid: rec.as_ref().map(|r| r.daemon_pid),
            };
            tracing::warn!(
                vm = %r.id,
                state = %r.state,
                daemon_pid = ?r.daemon_pid,
                "vm record left by a daemon that is gone; the VM no longer exists, removing its record"
            );
            store.remove(&id)?;
            reconciled.push(r);
        }
        Ok((
            Self {
                store,
                vms: Mutex::new(HashMap::new()),
                state_dir: state_dir.to_path_buf(),
                node: crate::config::NodeConfig::default(),
                _lock: lock,
            },
            reconciled,
        ))
    }

    /// Uses `node` (network queue/vhost policy) for every VM it builds.
    pub fn with_node_config(mut self, node: crate::config::NodeConfig) -> Self {
        self.node = node;
        self
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    fn vms(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: &str) -> Result<Arc<Mutex<Vm>>, ApiError> {
        match self.vms().get(id) {
            Some(Slot::Vm(v)) => Ok(v.clone()),
            Some(Slot::Reserved) => Err(ApiError::new(
                ErrorCode::Conflict,
                format!("vm {id} is still being created"),
            )),
            None => Err(ApiError::new(ErrorCode::NotFound, format!("vm {id} does not exist"))),
        }
    }

    /// Runs `f` on a VM (in-process users: tests, the fork path).
    pub fn with_vm<R>(&self, id: &str, f: impl FnOnce(&Vm) -> R) -> Result<R, ApiError> {
        let vm = self.get(id)?;
        let g = lock_vm(&vm);
        Ok(f(&g))
    }

    /// Executes one request line and returns the response line.
    pub fn handle_line(&self, line: &str) -> String {
        let resp = match api::parse_request(line) {
            Ok(req) => match self.handle(req) {
                Ok(v) => Response::ok(v),
                Err(e) => Response::err(e),
            },
            Err(e) => Response::err(e),
        };
        serde_json::to_string(&resp).unwrap_or_else(|_| r#"{"v":1,"ok":false}"#.into())
    }

    /// Executes a request.
    pub fn handle(&self, req: Request) -> Result<Value, ApiError> {
        match req {
            Request::Create { config, start } => self.create(config, start),
            Request::Start(id) => self.transition(&id, "running", |vm| vm.start()),
            Request::Pause(id) => self.transition(&id, "paused", |vm| vm.pause(PAUSE_TIMEOUT)),
            Request::Resume(id) => self.transition(&id, "running", |vm| vm.resume()),
            Request::Stop(id) => {
                let vm = self.get(&id)?;
                let mut g = lock_vm(&vm);
                if matches!(g.state(), VmState::Stopped { .. }) {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("vm {id} is already {}", g.state()),
                    ));
                }
                g.stop();
                self.persist(&g)?;
                Ok(self.info_of(&g))
            }
            Request::Delete(id) => self.delete(&id),
            Request::Info(id) => {
                let vm = self.get(&id)?;
                let g = lock_vm(&vm);
                Ok(self.info_of(&g))
            }
            Request::Snapshot { id, dir } => self.snapshot(&id, &dir),
            Request::Fork { id, count } => self.fork(&id, count),
            Request::Restore { dir, id } => self.restore(&dir, id),
            Request::Peek { id, addr, count } => {
                use vm_memory::{Bytes, GuestAddress};
                let vm = self.get(&id)?;
                let g = lock_vm(&vm);
                let mut words = Vec::with_capacity(count as usize);
                for i in 0..u64::from(count) {
                    let a = addr.checked_add(i * 4).ok_or_else(|| {
                        ApiError::new(
                            ErrorCode::InvalidArgument,
                            format!("address {addr:#x} + {count} words overflows"),
                        )
                    })?;
                    let w: u32 = g.memory().read_obj(GuestAddress(a)).map_err(|_| {
                        ApiError::new(
                            ErrorCode::InvalidArgument,
                            format!("address {a:#x} is not guest RAM of vm {id}"),
                        )
                    })?;
                    words.push(w);
                }
                Ok(json!({ "id": id, "addr": addr, "words": words }))
            }
            Request::List => {
                let vms: Vec<_> = self
                    .vms()
                    .values()
                    .filter_map(|s| match s {
                        Slot::Vm(v) => Some(v.clone()),
                        Slot::Reserved => None,
                    })
                    .collect();
                let mut out: Vec<Value> = vms
                    .iter()
                    .map(|v| {
                        let g = lock_vm(v);
                        json!({
                            "id": g.id(),
                            "status": g.state().to_string(),
                            "vcpus": g.config().vcpus,
                            "memory_mib": g.config().memory_mib,
                            "guest": g.config().guest.describe(),
                        })
                    })
                    .collect();
                out.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
                Ok(json!({ "vms": out }))
            }
            Request::Version => Ok(json!({
                "api_version": api::API_VERSION,
                "k7d": env!("CARGO_PKG_VERSION"),
                "pid": std::process::id(),
            })),
        }
    }

    fn transition(
        &self,
        id: &str,
        _to: &str,
        f: impl FnOnce(&mut Vm) -> Result<(), VmError>,
    ) -> Result<Value, ApiError> {
        let vm = self.get(id)?;
        let mut g = lock_vm(&vm);
        f(&mut g).map_err(vm_error)?;
        self.persist(&g)?;
        Ok(self.info_of(&g))
    }

    fn persist(&self, vm: &Vm) -> Result<(), ApiError> {
        let state = vm.state();
        self.store
            .update(vm.id(), |r| r.state = state)
            .map(|_| ())
            .map_err(internal)
    }

    fn info_of(&self, vm: &Vm) -> Value {
        let rec = self.store.load(vm.id()).ok().flatten();
        let state = vm.state();
        let since_start = vm.started_at().map(|s| s.elapsed().as_millis() as u64);
        let first_exit_us = match (vm.started_at(), vm.control().first_exit()) {
            (Some(s), Some(f)) => Some(f.saturating_duration_since(s).as_micros() as u64),
            _ => None,
        };
        json!({
            "id": vm.id(),
            "status": state.to_string(),
            "state": state,
            "config": vm.config(),
            "devices": vm.devices(),
            "serial_log": rec.as_ref().map(|r| r.serial_log.clone()),
            "daemon_pid": std::process::id(),
            "created_unix": rec.as_ref().map(|r| r.created_unix),
            "ms_since_start": since_start,
            "first_exit_us_after_start": first_exit_us,
            "exits": vm.control().exit_count(),
        })
    }

    fn new_id(&self) -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("vm-{:08x}", (t ^ n.rotate_left(16) ^ std::process::id().rotate_left(8)))
    }

    fn create(&self, mut config: VmConfig, start: bool) -> Result<Value, ApiError> {
        config
            .validate()
            .map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
        let id = {
            let mut vms = self.vms();
            let id = match &config.id {
                Some(id) => id.clone(),
                None => loop {
                    let id = self.new_id();
                    if !vms.contains_key(&id) {
                        break id;
                    }
                },
            };
            if vms.contains_key(&id) {
                return Err(ApiError::new(ErrorCode::Conflict, format!("vm {id} already exists")));
            }
            vms.insert(id.clone(), Slot::Reserved);
            id
        };
        config.id = Some(id.clone());
        match self.build(&id, &config, start) {
            Ok(info) => Ok(info),
            Err(e) => {
                // Roll back: nothing of this VM may remain.
                self.vms().remove(&id);
                if let Err(re) = self.store.remove(&id) {
                    tracing::error!(vm = %id, error = %re, "rolling back a failed create left files behind");
                }
                Err(e)
            }
        }
    }

    fn build(&self, id: &str, config: &VmConfig, start: bool) -> Result<Value, ApiError> {
        let serial_log = self.store.runtime_dir(id).map_err(internal)?.join("serial.log");
        let vm = Vm::new(
            id,
            config,
            &VmOptions {
                serial_log: Some(serial_log.clone()),
                node: self.node,
            },
        )
        .map_err(vm_error)?;
        self.adopt(id, vm, serial_log, start)
    }

    fn snapshot(&self, id: &str, dir: &Path) -> Result<Value, ApiError> {
        let vm = self.get(id)?;
        let g = lock_vm(&vm);
        let was_running = matches!(g.state(), VmState::Running);
        if was_running {
            g.pause(PAUSE_TIMEOUT).map_err(vm_error)?;
        }
        let t = std::time::Instant::now();
        let res = g.snapshot_to(dir);
        let took = t.elapsed();
        if was_running {
            g.resume().map_err(vm_error)?;
        }
        res.map_err(vm_error)?;
        Ok(json!({ "id": id, "dir": dir, "snapshot_ms": took.as_secs_f64() * 1000.0 }))
    }

    /// Registers a built VM (record, stop callback), starts it if asked, and
    /// puts it in the map under its (already reserved) id.
    fn adopt(&self, id: &str, mut vm: Vm, serial_log: PathBuf, start: bool) -> Result<Value, ApiError> {
        let rec = VmRecord {
            version: store::RECORD_VERSION,
            id: id.to_string(),
            config: vm.config().clone(),
            state: VmState::Created,
            devices: vm.devices().to_vec(),
            serial_log,
            daemon_pid: std::process::id(),
            created_unix: now_unix(),
        };
        self.store.save(&rec).map_err(internal)?;
        // The last vCPU thread to leave records why the VM stopped, also
        // when the guest stops it on its own.
        let store = self.store.clone();
        let vm_id = id.to_string();
        vm.control().set_on_stopped(Box::new(move |reason| {
            let reason = reason.clone();
            if let Err(e) = store.update(&vm_id, |r| r.state = VmState::Stopped { reason }) {
                tracing::error!(vm = %vm_id, error = %e, "cannot record the VM's stop");
            }
        }));
        if start {
            vm.start().map_err(vm_error)?;
            self.persist(&vm)?;
        }
        let info = self.info_of(&vm);
        self.vms().insert(id.to_string(), Slot::Vm(Arc::new(Mutex::new(vm))));
        Ok(info)
    }

    fn fork(&self, id: &str, count: u32) -> Result<Value, ApiError> {
        let vm = self.get(id)?;
        // Reserve the children's ids first.
        let ids: Vec<String> = {
            let mut vms = self.vms();
            let mut ids = Vec::new();
            let mut n = 0u32;
            while ids.len() < count as usize {
                n += 1;
                let cid = format!("{id}-f{n}");
                if cid.len() > 63 {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        format!("vm id {id} is too long to name its children"),
                    ));
                }
                if !vms.contains_key(&cid) && self.store.load(&cid).ok().flatten().is_none() {
                    vms.insert(cid.clone(), Slot::Reserved);
                    ids.push(cid);
                }
            }
            ids
        };
        let release = |from: usize| {
            let mut vms = self.vms();
            for cid in &ids[from..] {
                vms.remove(cid);
            }
        };
        let g = lock_vm(&vm);
        let was_running = matches!(g.state(), VmState::Running);
        let t0 = std::time::Instant::now();
        if was_running && let Err(e) = g.pause(PAUSE_TIMEOUT) {
            release(0);
            return Err(vm_error(e));
        }
        let paused = t0.elapsed();
        let mut built = Vec::new();
        let mut failure = None;
        for cid in &ids {
            let log = match self.store.runtime_dir(cid) {
                Ok(d) => d.join("serial.log"),
                Err(e) => {
                    failure = Some(internal(e));
                    break;
                }
            };
            let t = std::time::Instant::now();
            match g.fork(
                cid,
                &VmOptions {
                    serial_log: Some(log.clone()),
                    node: self.node,
                },
            ) {
                Ok(child) => built.push((cid.clone(), child, log, t.elapsed())),
                Err(e) => {
                    failure = Some(vm_error(e));
                    break;
                }
            }
        }
        let fork_total = t0.elapsed();
        if was_running && let Err(e) = g.resume() {
            tracing::error!(vm = %id, error = %e, "cannot resume the fork source");
        }
        drop(g);
        if let Some(e) = failure {
            // Roll back: no child of a failed fork survives.
            for (cid, child, _, _) in built {
                drop(child);
                let _ = self.store.remove(&cid);
            }
            for cid in &ids {
                let _ = self.store.remove(cid);
            }
            release(0);
            return Err(e);
        }
        let mut children = Vec::new();
        for (cid, child, log, took) in built {
            let mut info = self.adopt(&cid, child, log, true)?;
            info["fork_ms"] = json!(took.as_secs_f64() * 1000.0);
            children.push(info);
        }
        Ok(json!({
            "id": id,
            "children": children,
            "pause_ms": paused.as_secs_f64() * 1000.0,
            "source_paused_ms": fork_total.as_secs_f64() * 1000.0,
        }))
    }

    fn restore(&self, dir: &Path, id: Option<String>) -> Result<Value, ApiError> {
        let id = {
            let mut vms = self.vms();
            let id = id.unwrap_or_else(|| self.new_id());
            if vms.contains_key(&id) {
                return Err(ApiError::new(ErrorCode::Conflict, format!("vm {id} already exists")));
            }
            vms.insert(id.clone(), Slot::Reserved);
            id
        };
        let res = (|| {
            let serial_log = self.store.runtime_dir(&id).map_err(internal)?.join("serial.log");
            let vm = Vm::restore_from(
                &id,
                dir,
                &VmOptions {
                    serial_log: Some(serial_log.clone()),
                    node: self.node,
                },
            )
            .map_err(|e| match e {
                VmError::Persist(_) | VmError::Io { .. } => ApiError::new(ErrorCode::InvalidArgument, e.to_string()),
                other => vm_error(other),
            })?;
            self.adopt(&id, vm, serial_log, true)
        })();
        match res {
            Ok(info) => Ok(info),
            Err(e) => {
                self.vms().remove(&id);
                if let Err(re) = self.store.remove(&id) {
                    tracing::error!(vm = %id, error = %re, "rolling back a failed restore left files behind");
                }
                Err(e)
            }
        }
    }

    fn delete(&self, id: &str) -> Result<Value, ApiError> {
        let vm = self.get(id)?;
        {
            let mut g = lock_vm(&vm);
            if !matches!(g.state(), VmState::Stopped { .. }) {
                g.stop();
            }
        }
        // Take it out of the map first: no request can reach it any more.
        self.vms().remove(id);
        // Dropping the last handle closes the vCPU fds, the VM fd and the memfd.
        drop(vm);
        self.store.remove(id).map_err(internal)?;
        Ok(json!({ "id": id, "deleted": true }))
    }

    /// Stops and deletes every VM (daemon exit).
    pub fn shutdown(&self) {
        let ids: Vec<String> = self.vms().keys().cloned().collect();
        for id in ids {
            tracing::info!(vm = %id, "daemon exiting: stopping and deleting the VM");
            if let Err(e) = self.delete(&id) {
                tracing::error!(vm = %id, error = %e, "delete at daemon exit failed");
            }
        }
    }
}

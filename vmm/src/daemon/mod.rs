//! The daemon: many VMs, their records, and the API.
//!
//! A VM lives in this process (forks happen in-process), or, with `k7d
//! daemon --jail on`, in a jailed VM process of its own that outlives the
//! daemon (`processes.rs`, issue 36 in progress). [`Daemon`] executes API requests; `k7d_api::api` holds the request and
//! result types the daemon, the CLI and the shim share; [`server`] carries
//! them over a unix socket; `k7d_api::client` is the other side.

mod agent_conns;
mod agent_reseed;
mod clusters;
pub mod events;
mod exec;
pub mod metrics;
pub mod metrics_http;
mod periodic;
mod process_memory;
mod processes;
pub mod ram_usage;
mod rebaser;
mod reconcile;
mod recorder;
pub mod server;
mod shells;
pub mod store;
mod vm_samples;

// The wire types live in `k7d-api`, shared with the CLI and the shim.
use k7d_api::api;

pub use process_memory::{MEMORY_PERIOD, MemoryReader};
pub use processes::{IdRange, PROCESS_LOG, VmProcesses};
pub use rebaser::{REBASE_PERIOD, Rebaser};
pub use reconcile::{NicSweep, Reconciled};
pub use shells::{SHELL_PERIOD, ShellKeeper};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::VmConfig;
use crate::vstate::cluster::ClusterPause;
use crate::vstate::shell::ShellPool;
use crate::vstate::vm::{Vm, VmError, VmOptions, VmState};
use api::{
    ApiError, Deleted, ErrorCode, Forked, ForkedChild, Peeked, Reply, Request, Response, SnapshotWritten, VersionInfo,
    VmInfo, VmList, VmSummary,
};
use store::{RecordStore, StoreError, VmRecord};

/// How long `pause` waits for every vCPU to park.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a starting daemon waits for the state directory's lock: a daemon
/// killed with `kill -9` holds it until the kernel has torn the process down
/// (its guest RAM unmapped first), which can take a moment.
pub const STATE_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Daemon-level errors (startup).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Another daemon holds the state directory.
    #[error(
        "another k7d daemon already uses the state directory {}{}; waited {} s for it to let go",
        dir.display(),
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        waited.as_secs_f64()
    )]
    Busy {
        /// The state directory.
        dir: PathBuf,
        /// The pid the holder wrote into the lock file, if it did.
        holder: Option<u32>,
        /// How long this daemon waited for the lock.
        waited: Duration,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The daemon will not start as asked (the sentence says why).
    #[error("{0}")]
    Refused(String),
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

/// The VM a fork child came from.
#[derive(Debug, Clone)]
struct Parent {
    id: String,
    /// Deleted since (its children keep the base alive; a new VM that takes
    /// the id is not their parent).
    deleted: bool,
}

enum Slot {
    /// An id taken by a create, restore or fork still in progress.
    Reserved,
    /// An id whose VM is gone but whose files are still being removed: a
    /// new VM may not take it yet (the removal would take its files).
    Deleting,
    Vm(Arc<Mutex<Vm>>),
    /// A VM in a VM process of its own.
    Process(Arc<Mutex<processes::Remote>>),
}

/// The sentence for a request a VM process does not serve yet.
fn not_served_in_a_process(id: &str) -> String {
    format!(
        "vm {id} runs in a VM process of its own, which serves start, pause, resume, stop, delete, info, peek, snapshot, fork, rebase and clusters so far"
    )
}

/// What `Daemon::handle` does with a reply before it answers.
enum After {
    Fork,
    Restore,
    Info,
    Nothing,
}

/// The VM owner.
pub struct Daemon {
    store: Arc<RecordStore>,
    clusters: clusters::Clusters,
    vms: Mutex<HashMap<String, Slot>>,
    /// The snapshot tree: each fork child (reserved or live) and the VM it
    /// was forked from. Taken after `vms` when both are held.
    parents: Mutex<HashMap<String, Parent>>,
    node: crate::config::NodeConfig,
    /// Where LZ4 bzImages are unpacked once (`VmOptions::kernel_cache`).
    kernel_cache: Option<PathBuf>,
    recorder: recorder::Recorder,
    /// Shells made ahead for fork children (`fork.shells`, `shells.rs`).
    shells: Arc<ShellPool>,
    /// Where new VMs run in VM processes (`--jail on`); `None`: in this one.
    processes: Option<Arc<VmProcesses>>,
    /// The VMs re-attached at open, in their VM processes.
    reattached: Vec<String>,
    /// What a scrape reads (`metrics.rs`).
    metrics: Arc<metrics::Metrics>,
    /// Each VM process's memory as last read (`process_memory.rs`).
    vm_memory: process_memory::Readings,
    /// Fork children and restored VMs reseeded by their agents.
    agent_reseeds: agent_reseed::AgentReseeds,
    /// Connections to guest agents kept between `exec`s (`agent_conns.rs`).
    agent_conns: agent_conns::AgentConns,
    _lock: crate::sys::FileLock,
}

/// Ids reserved in the map for VMs being built. Dropping it releases every
/// id it still holds, with whatever files the build left under it; so every
/// early return of a create, restore or fork leaves nothing behind.
/// [`Reservation::fill`] hands the ids to the VMs built for them.
struct Reservation<'a> {
    daemon: &'a Daemon,
    ids: Vec<String>,
}

impl Reservation<'_> {
    fn ids(&self) -> &[String] {
        &self.ids
    }

    /// Puts `vms` in the map under the reserved ids, in order; those ids are
    /// theirs from now on. (Ids left without a VM are released.)
    fn fill(mut self, vms: Vec<Arc<Mutex<Vm>>>) {
        let n = vms.len().min(self.ids.len());
        let filled: Vec<String> = self.ids.drain(..n).collect();
        let mut map = self.daemon.vms();
        for (id, vm) in filled.into_iter().zip(vms) {
            map.insert(id, Slot::Vm(vm));
        }
    }

    /// Puts the VM process `remote` in the map under the (one) reserved id.
    fn fill_process(self, remote: processes::Remote) {
        self.fill_processes(vec![remote]);
    }

    /// Puts VM processes in the map under the reserved ids, in order.
    fn fill_processes(mut self, remotes: Vec<processes::Remote>) {
        let n = remotes.len().min(self.ids.len());
        let filled: Vec<String> = self.ids.drain(..n).collect();
        let mut map = self.daemon.vms();
        for (id, r) in filled.into_iter().zip(remotes) {
            map.insert(id, Slot::Process(Arc::new(Mutex::new(r))));
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        // Files first, then the ids: once an id is free, a new VM may take it
        // and write files of its own.
        for id in &self.ids {
            if let Err(e) = self.daemon.store.remove(id) {
                tracing::error!(vm = %id, error = %internal(&e), "rolling back a VM that was not built left files behind");
            }
        }
        let mut map = self.daemon.vms();
        let mut parents = self.daemon.parents();
        for id in &self.ids {
            if matches!(map.get(id), Some(Slot::Reserved)) {
                map.remove(id);
                parents.remove(id);
            }
        }
    }
}

/// The children of `id` in the tree `parents`, sorted.
fn children_in(parents: &HashMap<String, Parent>, id: &str) -> Vec<String> {
    let mut v: Vec<String> = parents
        .iter()
        .filter(|(_, p)| p.id == id && !p.deleted)
        .map(|(c, _)| c.clone())
        .collect();
    v.sort();
    v
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

/// A VM as `list` (and `cluster_info`) shows it.
/// The warning a fork of `vm` carries the first time its children go
/// without a reseed of their kernel RNGs (`Vm::first_unreseeded_fork`),
/// also logged.
fn rng_warning(vm: &Vm) -> Option<String> {
    vm.first_unreseeded_fork().then(|| {
        let w = format!(
            "{}: {}",
            agent_reseed::shared_rng_warning(vm.id()),
            vm.rng_reseed().describe()
        );
        tracing::warn!(vm = vm.id(), "{w}");
        w
    })
}

fn summary(vm: &Vm) -> VmSummary {
    VmSummary {
        id: vm.id().to_string(),
        status: vm.state().to_string(),
        vcpus: vm.config().vcpus,
        memory_mib: vm.config().memory_mib,
        guest: vm.config().guest.describe(),
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs `op` on `vm` with its vCPUs parked: a running VM is paused first and
/// resumed after, also when `op` failed; other states run `op` as they are.
/// `op` learns how long the pause took (zero without one). A failed resume
/// is an error even after `op` succeeded; after a failed `op` the error
/// names both failures.
pub fn with_paused<R>(vm: &Vm, op: impl FnOnce(&Vm, Duration) -> Result<R, ApiError>) -> Result<R, ApiError> {
    if !matches!(vm.state(), VmState::Running) {
        return op(vm, Duration::ZERO);
    }
    let t = Instant::now();
    vm.pause(PAUSE_TIMEOUT).map_err(vm_error)?;
    let res = op(vm, t.elapsed());
    match (res, vm.resume()) {
        (res, Ok(())) => res,
        (Ok(_), Err(resume)) => Err(vm_error(resume)),
        (Err(e), Err(resume)) => Err(ApiError::new(
            e.code,
            format!(
                "{e}; resuming vm {} afterwards failed too: {}",
                vm.id(),
                vm_error(resume)
            ),
        )),
    }
}

/// Takes `<state_dir>/daemon.lock`, retrying for `wait` while another
/// process holds it, and writes this process's pid into it (the next
/// daemon's refusal names it).
fn lock_state_dir(state_dir: &Path, wait: Duration) -> Result<crate::sys::FileLock, DaemonError> {
    use std::io::{Read, Seek, Write};
    let t = Instant::now();
    let mut logged = false;
    loop {
        let file = store::open_daemon_lock(state_dir)?;
        match crate::sys::flock(file, false) {
            Ok(lock) => {
                let mut f = lock.file();
                let wrote = f
                    .set_len(0)
                    .and_then(|()| f.seek(std::io::SeekFrom::Start(0)))
                    .and_then(|_| writeln!(f, "{}", std::process::id()));
                if let Err(e) = wrote {
                    tracing::warn!(error = %e, "cannot write this daemon's pid into the state directory's lock");
                }
                if logged {
                    tracing::info!(
                        waited_ms = t.elapsed().as_millis() as u64,
                        "the state directory is free now"
                    );
                }
                return Ok(lock);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(source) => {
                return Err(DaemonError::Io {
                    what: format!("cannot lock the state directory {}", state_dir.display()),
                    source,
                });
            }
        }
        if t.elapsed() >= wait {
            let mut text = String::new();
            let holder = store::open_daemon_lock(state_dir)
                .ok()
                .and_then(|mut f| f.read_to_string(&mut text).ok())
                .and_then(|_| text.trim().parse().ok());
            return Err(DaemonError::Busy {
                dir: state_dir.to_path_buf(),
                holder,
                waited: wait,
            });
        }
        if !logged {
            logged = true;
            tracing::info!(
                state_dir = %state_dir.display(),
                wait_s = wait.as_secs_f64(),
                "another daemon holds the state directory; waiting for it to let go"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Daemon {
    /// Takes the state directory (exclusively, waiting up to
    /// [`STATE_LOCK_WAIT`] for a daemon that is still going away), sweeps
    /// leftovers, and reconciles records whose VMs no longer exist.
    pub fn open(state_dir: &Path) -> Result<(Self, Vec<Reconciled>), DaemonError> {
        Self::open_waiting(state_dir, STATE_LOCK_WAIT)
    }

    /// [`Daemon::open`], waiting at most `lock_wait` for the state directory's lock.
    pub fn open_waiting(state_dir: &Path, lock_wait: Duration) -> Result<(Self, Vec<Reconciled>), DaemonError> {
        std::fs::create_dir_all(state_dir).map_err(|source| DaemonError::Io {
            what: format!("cannot create the state directory {}", state_dir.display()),
            source,
        })?;
        let lock = lock_state_dir(state_dir, lock_wait)?;
        let store = Arc::new(RecordStore::open(state_dir)?);
        let swept = store.sweep_temp_files();
        if swept > 0 {
            tracing::warn!(swept, "removed temp files left by an interrupted record write");
        }
        let mut reconciled = Vec::new();
        let mut reattached = HashMap::new();
        let mut reattached_parents = HashMap::new();
        let mut agent_reseeded = Vec::new();
        for id in store.ids()? {
            // A VM in a VM process of its own outlived its daemon: it is
            // served again if its process is still the one its record names.
            let rec = store.load(&id).ok().flatten();
            if let Some(r) = rec.as_ref().filter(|r| r.vm_process.is_some()) {
                match processes::Remote::attach(r, &store) {
                    Ok(remote) => {
                        tracing::info!(vm = %id, pid = remote.record().pid, "re-attached to the VM's process");
                        let mut f = serde_json::Map::new();
                        f.insert("pid".into(), serde_json::json!(remote.record().pid));
                        store.events().record("reattach", Some(("vm", &id)), f);
                        if let Err(e) = store.update(&id, |r| r.daemon_pid = std::process::id()) {
                            tracing::warn!(vm = %id, error = %e, "cannot record this daemon as the VM's owner");
                        }
                        if let Some(parent) = &r.parent {
                            reattached_parents.insert(
                                id.clone(),
                                Parent {
                                    id: parent.clone(),
                                    deleted: false,
                                },
                            );
                        }
                        if r.rng_agent {
                            agent_reseeded.push(id.clone());
                        }
                        reattached.insert(id.clone(), Slot::Process(Arc::new(Mutex::new(remote))));
                        continue;
                    }
                    Err(why) => tracing::warn!(vm = %id, "cannot re-attach to the VM's process: {why}"),
                }
            }
            // Any other VM lived inside the daemon process: a record on
            // disk at start belongs to a daemon that is gone, so its VM is
            // gone too.
            let r = Reconciled {
                id: id.clone(),
                state: rec
                    .as_ref()
                    .map(|r| r.state.to_string())
                    .unwrap_or_else(|| "unreadable".into()),
                daemon_pid: rec.as_ref().map(|r| r.daemon_pid),
                nics: rec
                    .as_ref()
                    .map(|r| reconcile::datapath_nics(&r.config.devices.nics))
                    .unwrap_or_default(),
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
        // With every record gone, a runtime directory or lock file still here
        // belonged to a VM whose record was never written or already removed.
        for name in store.sweep_orphans() {
            tracing::warn!(entry = %name, "removed a VM's runtime files that had no record");
        }
        let (clusters, gone) =
            clusters::Clusters::open(state_dir, &|id| reattached.contains_key(id)).map_err(|source| {
                DaemonError::Io {
                    what: format!("cannot open the cluster records in {}", state_dir.display()),
                    source,
                }
            })?;
        for id in gone {
            tracing::warn!(cluster = %id, "cluster record left by a daemon that is gone; its members no longer exist, removed");
        }
        let recorder = recorder::Recorder::start(store.clone()).map_err(|source| DaemonError::Io {
            what: "cannot start the thread that records VM stops".into(),
            source,
        })?;
        // A parent that was not re-attached is gone.
        for p in reattached_parents.values_mut() {
            p.deleted = !reattached.contains_key(&p.id);
        }
        let mut reattached_ids: Vec<String> = reattached.keys().cloned().collect();
        reattached_ids.sort();
        Ok((
            Self {
                store,
                clusters,
                vms: Mutex::new(reattached),
                parents: Mutex::new(reattached_parents),
                node: crate::config::NodeConfig::default(),
                kernel_cache: None,
                recorder,
                shells: ShellPool::new(),
                processes: None,
                reattached: reattached_ids,
                metrics: Arc::new(metrics::Metrics::new(false)),
                vm_memory: process_memory::Readings::default(),
                agent_reseeds: agent_reseed::AgentReseeds::with_known(agent_reseeded),
                agent_conns: agent_conns::AgentConns::default(),
                _lock: lock,
            },
            reconciled,
        ))
    }

    /// Shells ready in the pool, all shapes (`fork.shells`; shared by
    /// shape: a fork of any VM of a shape takes them).
    pub fn shells_ready(&self) -> usize {
        self.shells.total()
    }

    /// Shells ready for fork children, by shape.
    pub fn shells_ready_by_shape(&self) -> Vec<(crate::vstate::shell::Shape, usize)> {
        self.shells.by_shape()
    }

    /// Runs every VM it creates from now on in a VM process of its own
    /// (`--jail on`); the VM processes it re-attached keep their ids.
    pub fn with_vm_processes(mut self, procs: VmProcesses) -> Self {
        for s in self.vms().values() {
            if let Slot::Process(r) = s {
                procs.take(r.lock().unwrap_or_else(|p| p.into_inner()).record().uid);
            }
        }
        procs.sweep_cgroups();
        let spares = self.store.dir().with_file_name("spares");
        procs.set_spare_dir(spares);
        let procs = Arc::new(procs);
        processes::keep_spares(&procs);
        self.processes = Some(procs);
        self.metrics = Arc::new(metrics::Metrics::new(true));
        self
    }

    /// The VMs it re-attached to at open, in their VM processes.
    pub fn reattached(&self) -> &[String] {
        &self.reattached
    }

    /// Uses `node` (network queue/vhost policy) for every VM it builds.
    pub fn with_node_config(mut self, node: crate::config::NodeConfig) -> Self {
        self.node = node;
        self
    }

    /// Unpacks LZ4 bzImages once into `dir` and boots their ELF kernels
    /// (`arch::x86_64::unpack`); without it every boot runs the guest's
    /// decompressor.
    pub fn with_kernel_cache(mut self, dir: Option<PathBuf>) -> Self {
        self.kernel_cache = dir;
        self
    }

    fn parents(&self) -> MutexGuard<'_, HashMap<String, Parent>> {
        self.parents.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live (or reserved) fork children of `id`, sorted.
    fn children_of(&self, id: &str) -> Vec<String> {
        children_in(&self.parents(), id)
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
            Some(Slot::Deleting) => Err(ApiError::new(ErrorCode::Conflict, format!("vm {id} is being deleted"))),
            Some(Slot::Process(_)) => Err(ApiError::new(ErrorCode::Conflict, not_served_in_a_process(id))),
            None => Err(ApiError::new(ErrorCode::NotFound, format!("vm {id} does not exist"))),
        }
    }

    /// The VM process holding `id`, if a VM process holds it.
    fn process(&self, id: &str) -> Option<Arc<Mutex<processes::Remote>>> {
        match self.vms().get(id) {
            Some(Slot::Process(r)) => Some(r.clone()),
            _ => None,
        }
    }

    /// Runs `f` on a VM (in-process users: tests).
    pub fn with_vm<R>(&self, id: &str, f: impl FnOnce(&Vm) -> R) -> Result<R, ApiError> {
        let vm = self.get(id)?;
        let g = lock_vm(&vm);
        Ok(f(&g))
    }

    /// Executes one request line and returns the response line.
    pub fn handle_line(&self, line: &str) -> String {
        self.handle_line_with(line, None)
    }

    /// [`Daemon::handle_line`], with `emit` for the lines a streamed `exec`
    /// writes before its answer (the connection's; `exec.rs`).
    pub fn handle_line_with(&self, line: &str, emit: Option<exec::Emit<'_>>) -> String {
        let t = Instant::now();
        let res = match api::parse_request(line) {
            Ok(req) => {
                let op = req.op();
                let fork = match &req {
                    Request::Fork(a) => Some((self.is_cluster(&a.id), a.count)),
                    _ => None,
                };
                // What the event log needs of a request that changes something.
                let logged = (!matches!(
                    req,
                    Request::Info(_)
                        | Request::List
                        | Request::Version
                        | Request::Peek(_)
                        | Request::GuestRam(_)
                        | Request::ClusterInfo(_)
                        | Request::ClusterList
                ))
                .then(|| req.clone());
                let res = match (req, emit) {
                    (Request::Exec(a), Some(emit)) if a.stream => a
                        .validate()
                        .and_then(|()| exec::run(self, &a, Some(emit)))
                        .map(Reply::Executed),
                    (req, _) => self.handle(req),
                };
                self.metrics.observe(op, fork, t.elapsed(), &res);
                if let (Some(req), Ok(reply)) = (&logged, &res) {
                    self.store.events().request(req, reply, ms(t.elapsed()));
                }
                res
            }
            Err(e) => {
                self.metrics.observe_unparsed(t.elapsed());
                Err(e)
            }
        };
        let resp = match res {
            Ok(reply) => Response::ok(&reply),
            Err(e) => Response::err(e),
        };
        resp.to_line()
    }

    /// Executes a request; the reply is the type its op defines. A fork's
    /// children and a restored VM whose kernels have no vmgenid driver are
    /// reseeded through their agents before the answer (`agent_reseed.rs`).
    pub fn handle(&self, req: Request) -> Result<Reply, ApiError> {
        req.validate()?;
        let after = match &req {
            Request::Fork(a) if !a.reseed_by_caller => After::Fork,
            Request::Restore(_) => After::Restore,
            Request::Info(_) => After::Info,
            _ => After::Nothing,
        };
        let since = Instant::now();
        let mut reply = match self.handle_in_process(&req) {
            Some(reply) => reply?,
            None => self.handle_op(req)?,
        };
        let reseeded = match (after, &mut reply) {
            (After::Fork, Reply::Forked(f)) => self.agent_reseeds.forked(f, since, &self.agent_conns),
            (After::Restore, Reply::Vm(info)) => {
                if self.agent_reseeds.restored(info, &self.agent_conns) {
                    vec![info.id.clone()]
                } else {
                    Vec::new()
                }
            }
            (After::Info, Reply::Vm(info)) => {
                self.agent_reseeds.show(info);
                Vec::new()
            }
            _ => Vec::new(),
        };
        for id in reseeded {
            // What `info` says after a restart of the daemon.
            if let Err(e) = self.store.update(&id, |r| r.rng_agent = true) {
                tracing::warn!(vm = %id, error = %e, "cannot record the agent's reseed");
            }
        }
        Ok(reply)
    }

    fn handle_op(&self, req: Request) -> Result<Reply, ApiError> {
        Ok(match req {
            Request::Create(a) if self.processes.is_some() => {
                Reply::Vm(Box::new(self.create_process(a.config, a.start)?))
            }
            Request::Create(a) => Reply::Vm(Box::new(self.create(a.config, a.start)?)),
            Request::Start(id) => Reply::Vm(Box::new(self.transition(&id, |vm| vm.start())?)),
            Request::Pause(id) => Reply::Vm(Box::new(self.transition(&id, |vm| vm.pause(PAUSE_TIMEOUT))?)),
            Request::Resume(id) => Reply::Vm(Box::new(self.transition(&id, |vm| vm.resume())?)),
            Request::Stop(id) => Reply::Vm(Box::new(self.stop(&id)?)),
            Request::Delete(id) => Reply::Deleted(self.delete(&id)?),
            Request::Info(id) => {
                let vm = self.get(&id)?;
                let g = lock_vm(&vm);
                Reply::Vm(Box::new(self.info_of(&g)))
            }
            Request::GuestRam(id) => {
                let vm = self.get(&id)?;
                // The VM's lock only for its ranges, not for the smaps read.
                let ranges: Vec<(u64, u64)> = {
                    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
                    let g = lock_vm(&vm);
                    g.ram().memory().iter().map(|r| (r.as_ptr() as u64, r.len())).collect()
                };
                let usage = ram_usage::in_this_process(&ranges).map_err(|e| {
                    ApiError::new(
                        ErrorCode::Internal,
                        format!("vm {id}: cannot read this process's smaps: {e}"),
                    )
                })?;
                Reply::GuestRam(ram_usage::GuestRamUsage {
                    id: id.clone(),
                    ..usage
                })
            }
            Request::Snapshot(a) => match self.process(&a.id) {
                Some(r) => {
                    let t = Instant::now();
                    r.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .snapshot(&a.dir, a.replace)?;
                    Reply::Snapshot(SnapshotWritten {
                        id: a.id.clone(),
                        dir: a.dir.clone(),
                        snapshot_ms: ms(t.elapsed()),
                    })
                }
                None => Reply::Snapshot(self.snapshot(&a.id, &a.dir, a.replace)?),
            },
            Request::Restore(a) if self.processes.is_some() => Reply::Vm(Box::new(self.restore_process(&a.dir, a.id)?)),
            Request::Restore(a) => Reply::Vm(Box::new(self.restore(&a.dir, a.id)?)),
            Request::Fork(a) if self.is_cluster(&a.id) && a.shapes_the_child() => {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "{} is a cluster: its children's names, NICs and sockets are not chosen one by one",
                        a.id
                    ),
                ));
            }
            Request::Fork(a) if self.is_cluster(&a.id) => {
                Reply::Forked(self.cluster_fork(&a.id, a.count, !a.reseed_by_caller)?)
            }
            Request::Fork(a) => match self.process(&a.id) {
                Some(source) => Reply::Forked(self.fork_process(&a, &source)?),
                None => Reply::Forked(self.fork(&a)?),
            },
            Request::Peek(a) => Reply::Peek(self.peek(&a.id, a.addr, a.count)?),
            Request::Medium(a) => Reply::Vm(Box::new(self.transition(&a.id, |vm| {
                let disk = usize::try_from(a.disk).unwrap_or(usize::MAX);
                vm.change_medium(disk, a.path.as_deref())
            })?)),
            Request::NicAttach(a) => match self.process(&a.id) {
                Some(r) => Reply::Vm(Box::new(self.attach_process_nic(&a, &r)?)),
                None => Reply::Vm(Box::new(self.attach_nic(&a)?)),
            },
            Request::PodCgroup(a) => match self.process(&a.id) {
                Some(r) => Reply::Vm(Box::new(self.pod_cgroup_process(&a, &r)?)),
                None => {
                    self.get(&a.id)?;
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "vm {} runs inside the daemon (--jail off): it has no process of its own to put in its pod's cgroup",
                            a.id
                        ),
                    ));
                }
            },
            // On this connection's thread, no lock held while it runs.
            Request::Exec(a) => Reply::Executed(exec::run(self, &a, None)?),
            Request::List => Reply::List(self.list()),
            Request::Version => Reply::Version(VersionInfo {
                api_version: api::API_VERSION,
                k7d: env!("CARGO_PKG_VERSION").into(),
                pid: std::process::id(),
                vm_process_spares: self.processes.as_ref().map(|p| p.spares_ready() as u32),
            }),
            Request::ClusterCreate(a) => Reply::Cluster(self.cluster_create(&a.id, &a.members)?),
            Request::ClusterAdd(a) => Reply::Cluster(self.cluster_add(&a.id, &a.members)?),
            Request::ClusterInfo(id) => Reply::Cluster(self.cluster_info(&id)?),
            Request::ClusterDelete(id) => Reply::Deleted(self.cluster_delete(&id)?),
            Request::ClusterList => Reply::Clusters(self.cluster_list()),
            Request::Rebase(id) => {
                let vm = self.get(&id)?;
                let g = lock_vm(&vm);
                Reply::Rebased(g.rebase(PAUSE_TIMEOUT).map_err(vm_error)?)
            }
        })
    }

    fn transition(&self, id: &str, f: impl FnOnce(&mut Vm) -> Result<(), VmError>) -> Result<VmInfo, ApiError> {
        let vm = self.get(id)?;
        let mut g = lock_vm(&vm);
        f(&mut g).map_err(vm_error)?;
        self.persist(&g)?;
        Ok(self.info_of(&g))
    }

    /// `nic_attach`: the record keeps the attachment (what `info` and a
    /// reconcile read back), as a NIC attached at its build is recorded.
    fn attach_nic(&self, a: &api::NicAttachArgs) -> Result<VmInfo, ApiError> {
        let vm = self.get(&a.id)?;
        let mut g = lock_vm(&vm);
        let nic = usize::try_from(a.nic).unwrap_or(usize::MAX);
        g.attach_nic(nic, &a.datapath, &self.node).map_err(vm_error)?;
        self.store
            .update(g.id(), |r| {
                r.config = g.config().clone();
                r.devices = g.devices().to_vec();
            })
            .map_err(internal)?;
        Ok(self.info_of(&g))
    }

    fn stop(&self, id: &str) -> Result<VmInfo, ApiError> {
        let vm = self.get(id)?;
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

    fn peek(&self, id: &str, addr: u64, count: u32) -> Result<Peeked, ApiError> {
        use vm_memory::{Bytes, GuestAddress};
        let vm = self.get(id)?;
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
        Ok(Peeked {
            id: id.to_string(),
            addr,
            words,
        })
    }

    fn list(&self) -> VmList {
        let vms: Vec<_> = self
            .vms()
            .values()
            .filter_map(|s| match s {
                Slot::Vm(v) => Some(Ok(v.clone())),
                Slot::Process(r) => Some(Err(r.clone())),
                Slot::Reserved | Slot::Deleting => None,
            })
            .collect();
        let mut vms: Vec<VmSummary> = vms
            .iter()
            .map(|v| match v {
                Ok(v) => summary(&lock_vm(v)),
                Err(r) => self.process_summary(r),
            })
            .collect();
        vms.sort_by(|a, b| a.id.cmp(&b.id));
        VmList { vms }
    }

    fn persist(&self, vm: &Vm) -> Result<(), ApiError> {
        let state = vm.state();
        self.store
            .update(vm.id(), |r| r.state = state)
            .map(|_| ())
            .map_err(internal)
    }

    fn info_of(&self, vm: &Vm) -> VmInfo {
        let rec = self.store.load(vm.id()).ok().flatten();
        let state = vm.state();
        let ms_since_start = vm.started_at().map(|s| s.elapsed().as_millis() as u64);
        let first_exit_us_after_start = match (vm.started_at(), vm.control().first_exit()) {
            (Some(s), Some(f)) => Some(f.saturating_duration_since(s).as_micros() as u64),
            _ => None,
        };
        // (Its own statement: the guard must be gone before `children_of`
        // takes the lock again.)
        let parent = self.parents().get(vm.id()).map(|p| {
            if p.deleted {
                format!("{} (deleted)", p.id)
            } else {
                p.id.clone()
            }
        });
        VmInfo {
            id: vm.id().to_string(),
            status: state.to_string(),
            state,
            config: vm.config().clone(),
            devices: vm.devices().to_vec(),
            serial_log: rec.as_ref().map(|r| r.serial_log.clone()),
            daemon_pid: std::process::id(),
            created_unix: rec.as_ref().map(|r| r.created_unix),
            ms_since_start,
            first_exit_us_after_start,
            exits: vm.control().exit_count(),
            parent,
            children: self.children_of(vm.id()),
            rebases: vm.rebases(),
            shells_ready: vm.config().fork.shells.map(|_| self.shells.count(vm.shape()) as u32),
            rng_reseed: Some(vm.rng_reseed()),
            vmgenid: vm.generation_id().map(|g| crate::arch::x86_64::vmgenid::hex(&g)),
            vm_process: None,
        }
    }

    fn options(&self, serial_log: &Path) -> VmOptions {
        VmOptions {
            serial_log: Some(serial_log.to_path_buf()),
            node: self.node.clone(),
            kernel_cache: self.kernel_cache.clone(),
            files: Default::default(),
        }
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

    /// Reserves `id`, or a generated id when there is none.
    fn reserve(&self, id: Option<String>) -> Result<(Reservation<'_>, String), ApiError> {
        let mut vms = self.vms();
        let id = match id {
            Some(id) if matches!(vms.get(&id), Some(Slot::Deleting)) => {
                return Err(ApiError::new(ErrorCode::Conflict, format!("vm {id} is being deleted")));
            }
            Some(id) if vms.contains_key(&id) => {
                return Err(ApiError::new(ErrorCode::Conflict, format!("vm {id} already exists")));
            }
            Some(id) if self.clusters.contains(&id) => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("{id} is a cluster; a vm needs an id of its own"),
                ));
            }
            Some(id) => id,
            None => loop {
                let id = self.new_id();
                if !vms.contains_key(&id) && !self.clusters.contains(&id) {
                    break id;
                }
            },
        };
        vms.insert(id.clone(), Slot::Reserved);
        drop(vms);
        let held = Reservation {
            daemon: self,
            ids: vec![id.clone()],
        };
        Ok((held, id))
    }

    /// Reserves `count` free child ids of `source`: `<source>-f<n>`, the
    /// lowest `n` that neither a VM nor a record holds.
    fn reserve_children(&self, source: &str, count: u32, name: Option<&str>) -> Result<Reservation<'_>, ApiError> {
        // The source's budget (its config never changes) before the map:
        // the map is never held while waiting for a VM's lock.
        let (budget, memory_mib, disk_used) = match self.process(source) {
            Some(r) => {
                let g = r.lock().unwrap_or_else(|p| p.into_inner());
                (g.config().fork, g.config().memory_mib, 0)
            }
            None => self.with_vm(source, |vm| {
                (vm.config().fork, vm.config().memory_mib, vm.children_disk_bytes())
            })?,
        };
        let mut ids = Vec::new();
        let mut vms = self.vms();
        let live = self.parents().values().filter(|p| p.id == source && !p.deleted).count() as u32;
        if let Some(why) = budget.refusal(source, live, count, memory_mib, disk_used) {
            return Err(ApiError::new(ErrorCode::Conflict, why));
        }
        if let Some(name) = name {
            // One child under the name its client chose.
            if vms.contains_key(name) || self.clusters.contains(name) || self.store.load(name).ok().flatten().is_some()
            {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("vm {name} already exists: a fork child needs an id of its own"),
                ));
            }
            vms.insert(name.to_string(), Slot::Reserved);
            ids.push(name.to_string());
        }
        let mut n = 0u32;
        let complete = loop {
            if ids.len() == count as usize {
                break true;
            }
            n += 1;
            let cid = format!("{source}-f{n}");
            if cid.len() > 63 {
                break false;
            }
            if !vms.contains_key(&cid)
                && !self.clusters.contains(&cid)
                && self.store.load(&cid).ok().flatten().is_none()
            {
                vms.insert(cid.clone(), Slot::Reserved);
                ids.push(cid);
            }
        };
        {
            let mut parents = self.parents();
            for id in &ids {
                parents.insert(
                    id.clone(),
                    Parent {
                        id: source.to_string(),
                        deleted: false,
                    },
                );
            }
        }
        drop(vms);
        // From here on, every return releases what was reserved.
        let held = Reservation { daemon: self, ids };
        if !complete {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!("vm id {source} is too long to name its children"),
            ));
        }
        Ok(held)
    }

    /// Builds a VM under `id` (reserved here) with `build`, records it and
    /// starts it when `start`; on any failure nothing of it remains.
    fn install(
        &self,
        id: Option<String>,
        start: bool,
        build: impl FnOnce(&str, &VmOptions) -> Result<Vm, ApiError>,
    ) -> Result<VmInfo, ApiError> {
        let (held, id) = self.reserve(id)?;
        let serial_log = self.store.runtime_dir(&id).map_err(internal)?.join("serial.log");
        let vm = build(&id, &self.options(&serial_log))?;
        let (vm, info) = self.adopt(&id, vm, serial_log, start)?;
        held.fill(vec![vm]);
        Ok(info)
    }

    fn create(&self, config: VmConfig, start: bool) -> Result<VmInfo, ApiError> {
        config
            .validate()
            .map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
        self.install(config.id.clone(), start, move |id, opts| {
            let mut config = config;
            config.id = Some(id.to_string());
            Vm::new(id, &config, opts).map_err(vm_error)
        })
    }

    fn restore(&self, dir: &Path, id: Option<String>) -> Result<VmInfo, ApiError> {
        self.install(id, true, |id, opts| {
            Vm::restore_from(id, dir, opts).map_err(|e| match e {
                VmError::Persist(_) | VmError::Snapshot(_) | VmError::Io { .. } => {
                    ApiError::new(ErrorCode::InvalidArgument, e.to_string())
                }
                other => vm_error(other),
            })
        })
    }

    /// Records a built VM under its reserved id (record, stop callback) and
    /// starts it if asked. It joins the map when its reservation is filled;
    /// until then, dropping it stops it.
    fn adopt(
        &self,
        id: &str,
        mut vm: Vm,
        serial_log: PathBuf,
        start: bool,
    ) -> Result<(Arc<Mutex<Vm>>, VmInfo), ApiError> {
        let rec = VmRecord {
            version: store::RECORD_VERSION,
            id: id.to_string(),
            config: vm.config().clone(),
            state: VmState::Created,
            devices: vm.devices().to_vec(),
            serial_log,
            daemon_pid: std::process::id(),
            created_unix: now_unix(),
            vm_process: None,
            parent: None,
            rng_agent: false,
        };
        self.store.save(&rec).map_err(internal)?;
        // The last vCPU thread to leave records why the VM stopped, also
        // when the guest stops it on its own (through the record thread: a
        // vCPU thread touches no files).
        vm.control().set_on_stopped(self.recorder.on_stopped(id));
        if start {
            vm.start().map_err(vm_error)?;
            self.persist(&vm)?;
        }
        let info = self.info_of(&vm);
        Ok((Arc::new(Mutex::new(vm)), info))
    }

    fn snapshot(&self, id: &str, dir: &Path, replace: bool) -> Result<SnapshotWritten, ApiError> {
        let vm = self.get(id)?;
        let g = lock_vm(&vm);
        let took = with_paused(&g, |vm, _| {
            let t = Instant::now();
            vm.snapshot(dir, replace).map_err(vm_error)?;
            Ok(t.elapsed())
        })?;
        Ok(SnapshotWritten {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            snapshot_ms: ms(took),
        })
    }

    fn fork(&self, args: &api::ForkArgs) -> Result<Forked, ApiError> {
        let (id, count) = (args.id.as_str(), args.count);
        let spec = child_spec(args);
        let source = self.get(id)?;
        let held = self.reserve_children(id, count, args.name.as_deref())?;
        let (built, pause_ms, source_paused_ms, rebased) = {
            let g = lock_vm(&source);
            if count >= 2 && matches!(g.state(), VmState::Running | VmState::Paused | VmState::Created) {
                // A batch: one capture for all its children, re-based first
                // when that costs less than every child copying what the
                // source diverged (`docs/fork.md`, "Re-basing").
                let pause = ClusterPause::pause_for_batch(&[&*g], count, PAUSE_TIMEOUT).map_err(vm_error)?;
                let rebased = pause.rebased().iter().map(|r| r.id.clone()).collect();
                let rows: Vec<Vec<String>> = held.ids().iter().map(|c| vec![c.clone()]).collect();
                let logs: Vec<PathBuf> = held
                    .ids()
                    .iter()
                    .map(|c| Ok(self.store.runtime_dir(c).map_err(internal)?.join("serial.log")))
                    .collect::<Result<_, ApiError>>()?;
                let built = pause
                    .fork_in(
                        &rows,
                        |cid| {
                            let i = held.ids().iter().position(|c| c == cid).unwrap_or(0);
                            self.options(&logs[i])
                        },
                        Some(&self.shells),
                    )
                    .map_err(vm_error)
                    .map(|c| {
                        c.vms
                            .into_iter()
                            .flatten()
                            .zip(c.times.into_iter().flatten())
                            .zip(logs.iter().cloned())
                            .map(|((vm, t), log)| (vm, log, t))
                            .collect::<Vec<_>>()
                    });
                let (pause_ms, held_ms) = (ms(pause.took()), ms(pause.held_for()));
                match (built, pause.resume()) {
                    (Ok(b), Ok(())) => (b, pause_ms, held_ms, rebased),
                    (Err(e), Ok(())) => return Err(e),
                    (Ok(_), Err(r)) => return Err(vm_error(r)),
                    (Err(e), Err(r)) => {
                        return Err(ApiError::new(
                            e.code,
                            format!("{e}; resuming vm {id} afterwards failed too: {}", vm_error(r)),
                        ));
                    }
                }
            } else {
                with_paused(&g, |vm, paused| {
                    let t0 = Instant::now();
                    let built = self.build_children(vm, &held, &spec)?;
                    Ok((built, ms(paused), ms(paused + t0.elapsed()), Vec::new()))
                })?
            }
        };
        // Every child or none: when one cannot be recorded or started, the
        // `?` drops the ones adopted before it (which stops them) and then
        // `held`, which removes every child's files and frees its id.
        let mut vms = Vec::with_capacity(built.len());
        let mut children = Vec::with_capacity(built.len());
        for ((child, serial_log, took), cid) in built.into_iter().zip(held.ids()) {
            let from_shell = child.built_in_shell();
            let (vm, info) = self.adopt(cid, child, serial_log, true)?;
            vms.push(vm);
            children.push(ForkedChild {
                info,
                fork_ms: ms(took),
                shell: from_shell,
            });
        }
        held.fill(vms);
        Ok(Forked {
            id: id.to_string(),
            children,
            pause_ms,
            source_paused_ms,
            clusters: Vec::new(),
            rebased,
            warnings: rng_warning(&lock_vm(&source)).into_iter().collect(),
        })
    }

    /// Builds a child of the paused `vm` for every id `held` reserved.
    fn build_children(
        &self,
        vm: &Vm,
        held: &Reservation<'_>,
        spec: &crate::ChildSpec,
    ) -> Result<Vec<(Vm, PathBuf, Duration)>, ApiError> {
        let mut built = Vec::with_capacity(held.ids().len());
        for cid in held.ids() {
            let serial_log = self.store.runtime_dir(cid).map_err(internal)?.join("serial.log");
            let t = Instant::now();
            let capture = vm.capture().map_err(vm_error)?;
            let shell = self.shells.take(vm.shape());
            let child = vm
                .fork_child(&capture, cid, &self.options(&serial_log), shell, spec)
                .map_err(vm_error)?;
            built.push((child, serial_log, t.elapsed()));
        }
        Ok(built)
    }

    fn delete(&self, id: &str) -> Result<Deleted, ApiError> {
        // A new VM of this id has its agent's reseed to earn again (a
        // cluster's delete comes here for each member too).
        self.agent_reseeds.forget(id);
        self.agent_conns.forget(id);
        if let Some(r) = self.process(id) {
            return self.delete_process(id, &r);
        }
        let vm = self.get(id)?;
        {
            let mut g = lock_vm(&vm);
            if !matches!(g.state(), VmState::Stopped { .. }) {
                g.stop();
            }
        }
        // Out of reach first: no request can reach the VM any more, and no
        // new VM can take the id until its files are gone (the removal
        // below would take the new VM's files).
        // Out of its cluster in the same step (vms, then clusters): once
        // the id is free, a new VM taking it must not become a member.
        {
            let mut vms = self.vms();
            vms.insert(id.to_string(), Slot::Deleting);
            self.clusters.forget_member(id);
            // Out of the snapshot tree: its children outlive it (they hold
            // the base), a parent no more.
            let mut parents = self.parents();
            parents.remove(id);
            for p in parents.values_mut().filter(|p| p.id == id) {
                p.deleted = true;
            }
        }
        // Dropping the last handle closes the vCPU fds, the VM fd and the memfd.
        drop(vm);
        let removed = self.store.remove(id).map_err(internal);
        // The id is free again, whether or not the files went.
        {
            let mut vms = self.vms();
            if matches!(vms.get(id), Some(Slot::Deleting)) {
                vms.remove(id);
            }
        }
        removed?;
        Ok(Deleted {
            id: id.to_string(),
            deleted: true,
        })
    }

    /// Stops and deletes every VM in this process (daemon exit); a VM in
    /// a VM process of its own runs on, for the next daemon.
    pub fn shutdown(&self) {
        let ids: Vec<String> = self
            .vms()
            .iter()
            .filter(|(_, s)| !matches!(s, Slot::Process(_)))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            tracing::info!(vm = %id, "daemon exiting: stopping and deleting the VM");
            if let Err(e) = self.delete(&id) {
                tracing::error!(vm = %id, error = %e, "delete at daemon exit failed");
            }
        }
        // The clusters went with their members.
        self.clusters.remove_all();
    }
}

/// What the one child of `args` gets instead of its source's.
fn child_spec(args: &api::ForkArgs) -> crate::ChildSpec {
    crate::ChildSpec {
        nics: args.nics.clone(),
        vsock_uds: args.vsock_uds.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole answers of a version 1 daemon (captured from it, byte for
    /// byte; the list of known ops has grown by the cluster ops since) to
    /// requests that need no VM.
    const V1_ANSWERS: [(&str, &str); 6] = [
        (
            r#"{"v":1,"op":"explode"}"#,
            r#"{"v":1,"ok":false,"error":{"code":"bad_request","message":"unknown operation `explode` (known: create, start, pause, resume, stop, delete, info, snapshot, restore, fork, peek, list, version, cluster_create, cluster_add, cluster_info, cluster_delete, cluster_list, rebase, medium, nic_attach, guest_ram, exec, pod_cgroup)"}}"#,
        ),
        (
            r#"{"v":2,"op":"list"}"#,
            r#"{"v":1,"ok":false,"error":{"code":"unsupported_version","message":"API version 2 is not supported; this daemon speaks version 1"}}"#,
        ),
        (
            r#"{"v":1,"op":"peek","args":{"id":"web","addr":-1}}"#,
            r#"{"v":1,"ok":false,"error":{"code":"invalid_argument","message":"invalid arguments for `peek`: invalid value: integer `-1`, expected u64"}}"#,
        ),
        (
            r#"{"v":1,"op":"snapshot","args":{"id":"ghost","dir":"/tmp/x"}}"#,
            r#"{"v":1,"ok":false,"error":{"code":"not_found","message":"vm ghost does not exist"}}"#,
        ),
        (
            r#"{"args":{"id":"ghost"},"op":"delete","v":1}"#,
            r#"{"v":1,"ok":false,"error":{"code":"not_found","message":"vm ghost does not exist"}}"#,
        ),
        (
            r#"{"args":{},"op":"list","v":1}"#,
            r#"{"v":1,"ok":true,"result":{"vms":[]}}"#,
        ),
    ];

    #[test]
    fn answers_are_the_bytes_version_1_sent() {
        let dir = std::env::temp_dir().join(format!("k7d-daemon-answers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (d, reconciled) = Daemon::open(&dir).unwrap();
        assert!(reconciled.is_empty());
        for (line, answer) in V1_ANSWERS {
            assert_eq!(d.handle_line(line), answer, "{line}");
        }
        // A refused request reserved nothing and wrote nothing.
        assert!(d.vms().is_empty());
        assert_eq!(std::fs::read_dir(dir.join("vms")).unwrap().count(), 0);
        drop(d);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

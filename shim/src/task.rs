//! containerd's Task service (task v2) for one pod VM: every RPC, the
//! events in containerd's order, the watchers that report exits, and the
//! monitor that reports every task exited (137) when the VM dies.

use std::collections::HashMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use containerd_shim::api;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskPaused, TaskResumed,
    TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::{Message, MessageDyn, MessageField};
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Context as TtrpcCtx, ExitSignal, Task, TtrpcContext, TtrpcResult};
use k7d_agent::proto::{self, Binds, BlockMount, CreateContainer, Identity, Network, ProcessRef, Reply, Request};

use crate::agent::{Agent, CallError};
use crate::config::PodStart;
use crate::config::ShimConfig;
use crate::daemon::{Daemon, ForkedPod, PodNic, PodVmSpec, VmLife};
use crate::names::{PodNames, pod_names};
use crate::{binds, image, podnet, pool, stdio, template};

mod join;

/// How often the monitor asks the daemon whether the VM lives.
const MONITOR_PERIOD: Duration = Duration::from_millis(200);
/// An event's delivery limit.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// The status of a task whose VM died under it (SIGKILL, as runc reports).
pub const KILLED: u32 = 137;
/// The annotation CRI sets on every container: `sandbox` or `container`
/// (the agent reads it too).
pub use k7d_agent::proto::CONTAINER_TYPE;
/// The annotation naming an app container's sandbox.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The annotation carrying a CRI sandbox's pod UID.
pub const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";
/// The pod's namespace and name, as containerd's CRI plugin annotates its sandbox.
pub const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
pub const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";

/// The task service of one shim (one pod VM).
#[derive(Clone)]
pub struct Service {
    inner: Arc<Inner>,
}

struct Inner {
    namespace: String,
    daemon: Arc<dyn Daemon>,
    publisher: Mutex<RemotePublisher>,
    exit: Arc<ExitSignal>,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The pod VM, once a create booted it.
    pod: Option<Pod>,
    /// A create is booting the pod VM.
    booting: bool,
    /// containerd asked for Shutdown while a create was booting: the
    /// create rolls back and the shim exits when it ends.
    shutdown_requested: bool,
    tasks: HashMap<String, TaskEntry>,
    /// App containers whose create is joining the pod VM (their ids are
    /// taken until the create records them or rolls back).
    joining: std::collections::HashSet<String>,
}

struct Pod {
    names: PodNames,
    /// Who holds each of the VM's drives, by index (serial `k7d-disk<i>`):
    /// the sandbox's own image and binds, then the empty drives a CRI pod
    /// VM boots with, which app containers take and give back.
    drives: Vec<Option<String>>,
    agent: Agent,
    /// The task pid containerd sees: the pod VM's process (`--jail on`),
    /// else the daemon's (no container process runs on the host).
    host_pid: u32,
    paused: bool,
    dead: bool,
    /// The CRI sandbox's container id (a CRI pod's): its SIGKILL stops
    /// the pod VM through the daemon.
    sandbox: Option<String>,
}

struct TaskEntry {
    bundle: String,
    /// The pod VM drives this container's images are in (an app
    /// container's; the sandbox's own are the pod's).
    drives: Vec<u32>,
    /// "" is the init process; others are execs.
    procs: HashMap<String, Proc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Created,
    Running,
    Stopped,
}

struct Proc {
    life: Life,
    /// A Start is between the agent's start and the start event: an exit
    /// waits for it, so containerd never sees an exit before its start.
    starting: bool,
    exit_status: u32,
    exited_at: Option<Timestamp>,
    paths: stdio::Paths,
    relays: Option<Arc<stdio::Relays>>,
}

impl State {
    /// Process `exec_id` ("" for the init) of task `id`, or containerd's NotFound.
    fn process(&self, id: &str, exec_id: &str) -> TtrpcResult<&Proc> {
        self.tasks
            .get(id)
            .and_then(|t| t.procs.get(exec_id))
            .ok_or_else(|| not_found(format!("process {id}/{exec_id}")))
    }

    /// [`State::process`], to change it.
    fn process_mut(&mut self, id: &str, exec_id: &str) -> TtrpcResult<&mut Proc> {
        self.tasks
            .get_mut(id)
            .and_then(|t| t.procs.get_mut(exec_id))
            .ok_or_else(|| not_found(format!("process {id}/{exec_id}")))
    }
}

impl Proc {
    /// A process the agent created, not started yet.
    fn created(paths: stdio::Paths, relays: stdio::Relays) -> Self {
        Self {
            life: Life::Created,
            starting: false,
            exit_status: 0,
            exited_at: None,
            paths,
            relays: Some(Arc::new(relays)),
        }
    }
}

fn err(code: Code, msg: impl std::fmt::Display) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg.to_string()))
}

fn not_found(what: impl std::fmt::Display) -> ttrpc::Error {
    err(Code::NOT_FOUND, format!("{what} does not exist in this k7d shim"))
}

fn from_call(e: CallError) -> ttrpc::Error {
    match e {
        CallError::Refused {
            message,
            not_found: true,
        } => err(Code::NOT_FOUND, message),
        CallError::Refused { message, .. } => err(Code::FAILED_PRECONDITION, message),
        lost @ CallError::Lost(_) => err(Code::UNAVAILABLE, lost),
    }
}

/// Gives an agent connection a create's time to answer (`agent`'s limits).
fn for_creates(conn: &crate::agent::Conn, agent: &Agent) -> TtrpcResult<()> {
    conn.set_timeout(Some(agent.limits().create)).map_err(|e| {
        err(
            Code::INTERNAL,
            format!("cannot set the agent connection's timeout: {e}"),
        )
    })
}

fn internal(e: anyhow::Error) -> ttrpc::Error {
    err(Code::INTERNAL, format!("{e:#}"))
}

fn now() -> Timestamp {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut t = Timestamp::new();
    t.seconds = d.as_secs() as i64;
    t.nanos = d.subsec_nanos() as i32;
    t
}

fn pref(id: &str, exec_id: &str) -> ProcessRef {
    ProcessRef {
        container: id.to_string(),
        exec_id: (!exec_id.is_empty()).then(|| exec_id.to_string()),
    }
}

/// The container's root filesystem as one erofs image (packed now, or
/// found in the cache): the snapshotter's layers, or the spec's root path
/// when containerd sent no mounts (`ctr run --rootfs`).
fn packed_rootfs(
    cfg: &ShimConfig,
    bundle: &Path,
    spec: &serde_json::Value,
    req: &api::CreateTaskRequest,
) -> TtrpcResult<PathBuf> {
    let layers = if req.rootfs.is_empty() {
        let root = spec.pointer("/root/path").and_then(|p| p.as_str()).unwrap_or("rootfs");
        image::Layers(vec![bundle.join(root)])
    } else {
        image::layers(&req.rootfs).map_err(|e| err(Code::INVALID_ARGUMENT, format!("{e:#}")))?
    };
    let (erofs, cached) = image::packed(&layers, &cfg.image_dir, bundle).map_err(internal)?;
    tracing::info!(
        "rootfs of {}: {} ({})",
        req.id,
        erofs.display(),
        if cached { "cached" } else { "packed now" }
    );
    Ok(erofs)
}

/// The OCI spec containerd wrote into the bundle (bounded: 4 MiB).
fn read_spec(bundle: &Path) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    use std::io::Read;
    let p = bundle.join("config.json");
    let f = std::fs::File::open(&p).with_context(|| format!("cannot open the bundle's spec {}", p.display()))?;
    let mut buf = Vec::new();
    f.take(4 << 20)
        .read_to_end(&mut buf)
        .with_context(|| format!("cannot read {}", p.display()))?;
    serde_json::from_slice(&buf).with_context(|| format!("the bundle's spec {} is not valid JSON", p.display()))
}

/// The annotations of the spec in `bundle` (none when it cannot be read).
pub fn read_bundle_annotations(bundle: &Path) -> HashMap<String, String> {
    read_spec(bundle).map(|s| annotations(&s)).unwrap_or_default()
}

/// The spec's annotations.
pub fn annotations(spec: &serde_json::Value) -> HashMap<String, String> {
    spec.get("annotations")
        .and_then(|a| a.as_object())
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

impl Service {
    /// The service for containerd namespace `namespace`.
    pub fn new(namespace: &str, daemon: Arc<dyn Daemon>, publisher: RemotePublisher, exit: Arc<ExitSignal>) -> Self {
        Self {
            inner: Arc::new(Inner {
                namespace: namespace.to_string(),
                daemon,
                publisher: Mutex::new(publisher),
                exit,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let p = self.publisher.lock().unwrap_or_else(|e| e.into_inner());
        // A containerd that stops answering must not hold every RPC.
        let ctx = TtrpcCtx {
            timeout_nano: PUBLISH_TIMEOUT.as_nanos() as i64,
            ..Default::default()
        };
        if let Err(e) = p.publish(ctx, topic, &self.namespace, event) {
            tracing::warn!("cannot publish {topic} to containerd: {e}");
        }
    }

    fn agent(&self) -> Result<(Agent, u32), ttrpc::Error> {
        let st = self.lock();
        match &st.pod {
            Some(p) if p.dead => Err(err(Code::UNAVAILABLE, "the pod VM has stopped")),
            Some(p) if p.paused => Err(err(Code::FAILED_PRECONDITION, "the pod VM is paused (resume it first)")),
            Some(p) => Ok((p.agent.clone(), p.host_pid)),
            None => Err(err(Code::FAILED_PRECONDITION, "this shim has no pod VM")),
        }
    }

    fn call(&self, req: &Request) -> Result<Reply, ttrpc::Error> {
        let (agent, _) = self.agent()?;
        let mut c = agent
            .connect(agent.limits().call)
            .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
        c.call(req).map_err(from_call)
    }

    /// Records an exit once (the first report wins) and publishes it.
    ///
    /// An exit waits for a Start in flight (containerd must see the start
    /// first), but not once the pod VM is dead: that Start's agent call can
    /// only fail, and may wait for its limit first; it then publishes no
    /// start event (`Start`).
    fn exited(&self, id: &str, exec_id: &str, status: u32) {
        let (pid, at) = {
            let mut st = self.lock();
            while !st.pod.as_ref().is_some_and(|p| p.dead)
                && st
                    .tasks
                    .get(id)
                    .and_then(|t| t.procs.get(exec_id))
                    .is_some_and(|p| p.starting)
            {
                st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            let host_pid = st.pod.as_ref().map_or(0, |p| p.host_pid);
            let Some(p) = st.tasks.get_mut(id).and_then(|t| t.procs.get_mut(exec_id)) else {
                return;
            };
            if p.life == Life::Stopped {
                return;
            }
            p.life = Life::Stopped;
            p.exit_status = status;
            let at = now();
            p.exited_at = Some(at.clone());
            (host_pid, at)
        };
        self.changed.notify_all();
        self.publish(
            topics::TASK_EXIT_EVENT_TOPIC,
            Box::new(TaskExit {
                container_id: id.to_string(),
                id: if exec_id.is_empty() {
                    id.to_string()
                } else {
                    exec_id.to_string()
                },
                pid,
                exit_status: status,
                exited_at: MessageField::some(at),
                ..Default::default()
            }),
        );
    }

    /// Waits in the guest for the process to exit, then reports it (after
    /// its last output); a lost agent means the VM died: 137.
    fn watch(self: Arc<Self>, id: String, exec_id: String) {
        let r = loop {
            let r = self.agent_for_wait().and_then(|agent| {
                let mut c = agent.connect(agent.limits().call).map_err(|e| format!("{e:#}"))?;
                c.set_timeout(None).map_err(|e| e.to_string())?;
                c.call(&Request::Wait(pref(&id, &exec_id))).map_err(|e| e.to_string())
            });
            match r {
                Ok(reply) => break Ok(reply),
                Err(e) if !self.vm_alive() => break Err(e),
                Err(e) => {
                    // The VM lives (paused, busy, or the agent at its
                    // connection limit): the process may still run.
                    tracing::debug!("the wait on {id}/{exec_id} broke ({e}); the VM lives, waiting again");
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        };
        let (status, oom) = match r {
            Ok(Reply::Exited(x)) => (x.exit_status, x.oom_killed),
            Ok(other) => {
                tracing::warn!("the guest agent answered Wait with {other:?}");
                (KILLED, false)
            }
            Err(e) => {
                tracing::warn!("lost the wait on {id}/{exec_id}: {e}; reporting it killed");
                (KILLED, false)
            }
        };
        let relays = self
            .lock()
            .tasks
            .get(&id)
            .and_then(|t| t.procs.get(&exec_id))
            .and_then(|p| p.relays.clone());
        if let Some(r) = relays {
            r.wait_output(Duration::from_secs(2));
        }
        if oom {
            self.publish(
                topics::TASK_OOM_EVENT_TOPIC,
                Box::new(TaskOOM {
                    container_id: id.clone(),
                    ..Default::default()
                }),
            );
        }
        self.exited(&id, &exec_id, status);
    }

    /// The agent, for a watcher: also while the VM is paused (the wait's
    /// connection only blocks until it resumes).
    fn agent_for_wait(&self) -> Result<Agent, String> {
        match &self.lock().pod {
            Some(p) if !p.dead => Ok(p.agent.clone()),
            _ => Err("the pod VM has stopped".to_string()),
        }
    }

    /// Whether the pod VM still runs (or is paused), as far as the daemon
    /// says; with no daemon, whether its VM process outlived it.
    fn vm_alive(&self) -> bool {
        let vm_id = match self.lock().pod.as_ref() {
            Some(p) if !p.dead => p.names.vm_id.clone(),
            _ => return false,
        };
        match self.daemon.life(&vm_id) {
            Ok(VmLife::Stopped(_) | VmLife::Gone) => false,
            Ok(VmLife::DaemonGone) => self.vsock_served(),
            _ => true,
        }
    }

    /// Whether the pod VM's vsock socket is served: a VM in a process of
    /// its own (`k7d daemon --jail on`) serves it while no daemon exists,
    /// and the next daemon re-attaches to it; a VM that lived inside the
    /// daemon went with it (its socket refuses connections).
    ///
    /// The probe never blocks: a listener whose backlog is full (a paused
    /// VM accepts nothing) answers `EAGAIN`, which says it is there.
    fn vsock_served(&self) -> bool {
        let Some(path) = self.lock().pod.as_ref().map(|p| p.names.vsock.clone()) else {
            return false;
        };
        match k7d_sys::socket::connect_nonblocking(&path) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }

    fn spawn_watcher(self: Arc<Self>, id: &str, exec_id: &str) -> TtrpcResult<()> {
        let (id, exec_id) = (id.to_string(), exec_id.to_string());
        std::thread::Builder::new()
            .name("k7d-shim-wait".into())
            .spawn(move || self.watch(id, exec_id))
            .map(|_| ())
            .map_err(|e| err(Code::INTERNAL, format!("cannot start the exit watcher: {e}")))
    }

    /// Reports every process exited (137) once the pod VM is gone, and
    /// removes the VM from the daemon. A daemon gone while the VM's
    /// process serves its vsock socket is waited for.
    fn monitor(self: Arc<Self>, vm_id: String) {
        let mut waiting_for_daemon = false;
        loop {
            std::thread::sleep(MONITOR_PERIOD);
            if self.lock().pod.as_ref().is_none_or(|p| p.names.vm_id != vm_id) {
                return;
            }
            if self.lock().pod.as_ref().is_some_and(|p| p.dead) {
                return;
            }
            let why = match self.daemon.life(&vm_id) {
                Ok(VmLife::Running | VmLife::Paused) => {
                    if std::mem::take(&mut waiting_for_daemon) {
                        tracing::info!("a daemon serves the pod VM {vm_id} again");
                    }
                    continue;
                }
                Ok(VmLife::Stopped(r)) => format!("the pod VM stopped ({r})"),
                Ok(VmLife::Gone) => "the daemon no longer has the pod VM".to_string(),
                Ok(VmLife::DaemonGone) if self.vsock_served() => {
                    if !std::mem::replace(&mut waiting_for_daemon, true) {
                        tracing::warn!(
                            "the daemon is gone, but the pod VM {vm_id} runs on in its own process: waiting for the next daemon"
                        );
                    }
                    continue;
                }
                Ok(VmLife::DaemonGone) => {
                    "the daemon is gone (its socket refuses connections), and so is the pod VM's".to_string()
                }
                // A slow or busy daemon (a snapshot holds the VM) is not a dead VM.
                Err(e) => {
                    tracing::debug!("cannot ask the daemon about {vm_id}: {e:#}");
                    continue;
                }
            };
            tracing::warn!("{why}: every task of it exits with {KILLED}");
            self.end_vm(&vm_id);
            return;
        }
    }

    /// The pod VM is over (dead, or stopped on purpose): every live process
    /// of every task exits with [`KILLED`] at once (a Start in flight does
    /// not hold them back), and the daemon removes the VM, which also ends
    /// every agent call still waiting on it.
    fn end_vm(&self, vm_id: &str) {
        let live: Vec<(String, String)> = {
            let mut st = self.lock();
            if let Some(p) = st.pod.as_mut() {
                p.dead = true;
            }
            // Exits already waiting on a Start in flight go now.
            self.changed.notify_all();
            st.tasks
                .iter()
                .flat_map(|(id, t)| {
                    t.procs
                        .iter()
                        .filter(|(_, p)| p.life != Life::Stopped)
                        .map(move |(e, _)| (id.clone(), e.clone()))
                })
                .collect()
        };
        for (id, e) in live {
            self.exited(&id, &e, KILLED);
        }
        if let Err(e) = self.daemon.delete(vm_id) {
            tracing::warn!("cannot remove the pod VM {vm_id}: {e:#}");
        }
    }

    /// Removes the pod VM (a claimed pool member's, and any of the pod's
    /// own id) and its sockets (rollback and delete).
    fn remove_pod(&self, names: &PodNames) {
        for id in names.vm_ids() {
            if let Err(e) = self.daemon.delete(&id) {
                tracing::warn!("cannot remove the pod VM {id}: {e:#}");
            }
        }
        names.remove_dir();
    }

    fn create(self: &Arc<Self>, ctx: &TtrpcContext, req: &api::CreateTaskRequest) -> TtrpcResult<u32> {
        let deadline = (ctx.timeout_nano > 0).then(|| Instant::now() + Duration::from_nanos(ctx.timeout_nano as u64));
        if !proto::valid_id(&req.id) {
            return Err(err(
                Code::INVALID_ARGUMENT,
                format!("{:?} is not a container id", req.id),
            ));
        }
        if !req.checkpoint.is_empty() {
            return Err(err(
                Code::UNIMPLEMENTED,
                "k7d does not restore containers from checkpoints",
            ));
        }
        // The runtime class's config when its containerd entry names one
        // (`options.ConfigPath`), else the node's.
        let cfg = crate::runtime_options::config_path(req.options.as_ref())
            .and_then(|p| match p {
                Some(p) => ShimConfig::for_runtime_class(&p),
                None => ShimConfig::load(),
            })
            .map_err(|e| err(Code::FAILED_PRECONDITION, format!("{e:#}")))?;
        let bundle = PathBuf::from(&req.bundle);
        let mut spec = read_spec(&bundle).map_err(|e| err(Code::INVALID_ARGUMENT, format!("{e:#}")))?;
        // The rlimits runc would give it (crate::limits).
        crate::limits::Node::get()
            .fill_spec(&mut spec)
            .map_err(|e| err(Code::INVALID_ARGUMENT, e))?;
        let ann = annotations(&spec);
        if ann.get(CONTAINER_TYPE).map(String::as_str) == Some("container") {
            return self.create_in_pod(&cfg, &bundle, spec, &ann, req, deadline);
        }
        let (vcpus, memory_mib) = cfg
            .shape_for(&ann)
            .map_err(|e| err(Code::INVALID_ARGUMENT, format!("{e:#}")))?;
        {
            let mut st = self.lock();
            if st.pod.is_some() || st.booting || st.tasks.contains_key(&req.id) {
                return Err(err(
                    Code::ALREADY_EXISTS,
                    format!("this shim already runs a pod VM (asked for {})", req.id),
                ));
            }
            st.booting = true;
        }
        let r = self.boot_and_create(&cfg, &bundle, spec, req, (vcpus, memory_mib, &ann), deadline);
        let mut st = self.lock();
        st.booting = false;
        // App containers created meanwhile wait for the pod VM.
        self.changed.notify_all();
        let (pod, relays) = r?;
        if st.shutdown_requested {
            drop(st);
            self.remove_pod(&pod.names);
            self.exit.signal();
            return Err(err(
                Code::CANCELLED,
                format!(
                    "containerd shut this shim down while {} was created; rolled back",
                    req.id
                ),
            ));
        }
        let host_pid = pod.host_pid;
        let vm_id = pod.names.vm_id.clone();
        st.pod = Some(pod);
        self.record_created(st, req, relays, Vec::new());
        let me = self.clone();
        std::thread::Builder::new()
            .name("k7d-shim-monitor".into())
            .spawn(move || me.monitor(vm_id))
            .map_err(|e| err(Code::INTERNAL, format!("cannot start the pod VM monitor: {e}")))?;
        self.announce_created(req, host_pid)
    }

    /// Records a created container (its init process) under `st`'s lock,
    /// then lets the lock go.
    fn record_created(
        &self,
        mut st: MutexGuard<'_, State>,
        req: &api::CreateTaskRequest,
        relays: stdio::Relays,
        drives: Vec<u32>,
    ) {
        let paths = stdio::Paths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let mut procs = HashMap::new();
        procs.insert(String::new(), Proc::created(paths, relays));
        st.tasks.insert(
            req.id.clone(),
            TaskEntry {
                bundle: req.bundle.clone(),
                drives,
                procs,
            },
        );
    }

    /// `/tasks/create`, and the exit watcher of the new container's init.
    fn announce_created(self: &Arc<Self>, req: &api::CreateTaskRequest, host_pid: u32) -> TtrpcResult<u32> {
        self.publish(
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                }),
                checkpoint: req.checkpoint.clone(),
                pid: host_pid,
                ..Default::default()
            }),
        );
        // Watched from its creation: a created process that is killed
        // (containerd's cleanup of a failed pod) reports its exit too.
        self.clone().spawn_watcher(&req.id, "")?;
        Ok(host_pid)
    }

    /// Packs the image, boots the pod VM, creates the container in it and
    /// attaches its stdio; on any failure (or past containerd's deadline)
    /// everything created is removed.
    fn boot_and_create(
        &self,
        cfg: &ShimConfig,
        bundle: &Path,
        spec: serde_json::Value,
        req: &api::CreateTaskRequest,
        // The VM's shape and the spec's annotations, as the create read them.
        (vcpus, memory_mib, ann): (u8, u64, &HashMap<String, String>),
        deadline: Option<Instant>,
    ) -> TtrpcResult<(Pod, stdio::Relays)> {
        let t0 = Instant::now();
        // A CRI sandbox's VM boots empty drives for its app containers, and
        // a NIC in the pod's network as the CNI set it up (a plain `ctr run
        // --with-ns network:..` gets neither).
        let cri_sandbox = ann.get(CONTAINER_TYPE).map(String::as_str) == Some("sandbox");
        // Forked from the node's template of its shape (`crate::template`)
        // or a claimed warm pool member (`crate::pool`), its images put into
        // the booted VM's empty drives: CRI pods only.
        let mut start = if cri_sandbox {
            cfg.pod_start(ann)
                .map_err(|e| err(Code::INVALID_ARGUMENT, format!("{e:#}")))?
        } else {
            PodStart::Cold
        };
        // A shape other than the config's (the io.k7d.vcpus/memory_mib
        // annotations) boots cold: one template and one pool per config, so
        // pods cannot make the node keep booted VMs for every shape they ask for.
        if start != PodStart::Cold && (vcpus, memory_mib) != (cfg.vcpus, cfg.memory_mib) {
            tracing::info!(
                "{}: a {vcpus}-vCPU {memory_mib}-MiB pod is not the node's booted shape: it boots cold",
                req.id
            );
            start = PodStart::Cold;
        }
        let empty_drives = if cri_sandbox { cfg.pod_drives } else { 0 };
        let pod_net = match podnet::netns_path(&spec).filter(|_| cri_sandbox) {
            Some(ns) => Some(podnet::take(&ns).map_err(|e| err(Code::FAILED_PRECONDITION, format!("{e:#}")))?),
            None => None,
        };
        // A VM booted ahead of its pod has a bare tap in the daemon's netns
        // until the pod's network takes it: a pod without one (host
        // network) boots cold, so no tenant guest keeps a host-side tap.
        if start != PodStart::Cold && pod_net.is_none() {
            tracing::info!("{}: a pod without its own network boots cold", req.id);
            start = PodStart::Cold;
        }
        // A CRI sandbox's process is the agent's stand-in, which needs no
        // image (the VM is the pod: docs/containerd.md, "CRI pods"): its
        // image and bind mounts are neither packed nor put into the VM.
        let erofs = if cri_sandbox {
            None
        } else {
            Some(packed_rootfs(cfg, bundle, &spec, req)?)
        };
        let mut names = pod_names(&cfg.state_dir, &self.namespace, &req.id);
        // A VM of an earlier shim of this sandbox that nobody deleted (and
        // the pool member it claimed).
        for id in names.clone().resolved().vm_ids() {
            let _ = self.daemon.delete(&id);
        }
        names.remove_dir();
        // Private: the vsock socket inside reaches the guest agent.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&names.dir)
            .map_err(|e| err(Code::INTERNAL, format!("cannot create {}: {e}", names.dir.display())))?;
        let host_pid = match self.daemon.pid() {
            Ok(p) => p,
            Err(e) => {
                names.remove_dir();
                return Err(err(Code::UNAVAILABLE, format!("{e:#}")));
            }
        };
        // The host bind mounts, packed as disk 1 (the pod's own image).
        let packed = if cri_sandbox {
            Ok(None)
        } else {
            binds::pack(&spec, &names.dir, cfg.bind_max_mib << 20)
        };
        let carried = match packed {
            Ok(c) => c,
            Err(e) => {
                names.remove_dir();
                return Err(err(Code::INVALID_ARGUMENT, format!("{e:#}")));
            }
        };
        let mut disks: Vec<PathBuf> = erofs.into_iter().collect();
        let binds = carried.map(|c| {
            disks.push(c.image);
            Binds {
                disk: BlockMount {
                    serial: "k7d-disk1".into(),
                    fstype: "erofs".into(),
                    sectors: None,
                },
                mounts: c.mounts,
            }
        });
        let mut drives: Vec<Option<String>> = disks.iter().map(|_| Some(req.id.clone())).collect();
        // A booted VM's media arrive by a medium change: the agent waits
        // for each drive to show its image's size.
        let mut sectors = Vec::new();
        if start != PodStart::Cold {
            for d in &disks {
                match std::fs::metadata(d) {
                    Ok(m) => sectors.push(m.len() / 512),
                    Err(e) => {
                        names.remove_dir();
                        return Err(err(
                            Code::INTERNAL,
                            format!("cannot read the size of {}: {e}", d.display()),
                        ));
                    }
                }
            }
        }
        // A warm pool member, when one is ready: the pod's VM from now on
        // (claimed last, when nothing that can fail stands between the claim
        // and the pod's own removal of it).
        let pool = (start == PodStart::Pool).then(|| pool::for_shape(cfg, vcpus, memory_mib));
        if let Some(p) = &pool {
            match p.claim(&*self.daemon, &names) {
                Ok(Some(member)) => names.vm_id = member,
                Ok(None) => {
                    tracing::info!("{}: the warm pool has no member ready: it boots cold", req.id);
                    start = PodStart::Cold;
                }
                Err(e) => {
                    tracing::warn!(
                        "{}: no warm pool member could be claimed ({e:#}): it boots cold",
                        req.id
                    );
                    start = PodStart::Cold;
                }
            }
        }
        // The pool refills behind every pool pod, claimed or not.
        let _refill = pool.map(|p| RefillOnDrop {
            pool: p,
            cfg: cfg.clone(),
        });
        let booted = start != PodStart::Cold;
        let all_drives = if booted {
            usize::from(empty_drives + template::SANDBOX_DRIVES)
        } else {
            drives.len() + usize::from(empty_drives)
        };
        drives.resize(all_drives, None);
        let vm = PodVmSpec {
            id: names.vm_id.clone(),
            kernel: cfg.kernel.clone(),
            initramfs: cfg.initramfs.clone(),
            cmdline: cfg.cmdline.clone(),
            vcpus,
            memory_mib,
            disks,
            empty_drives,
            nic: pod_net.as_ref().map(|n| PodNic {
                netns: n.netns.clone(),
                pod_if: podnet::POD_IF.into(),
                mode: cfg.datapath.clone(),
                pod_uid: ann.get(SANDBOX_UID).cloned(),
                pod_namespace: ann.get(SANDBOX_NAMESPACE).cloned(),
                pod_name: ann.get(SANDBOX_NAME).cloned(),
            }),
            bare_nic: false,
            vsock_cid: 3,
            vsock_uds: names.vsock.clone(),
        };
        let vm_started = Instant::now();
        let made = match start {
            PodStart::Fork => self.fork_pod(cfg, &vm),
            PodStart::Pool => self.claimed_pod(&vm),
            PodStart::Cold => self.daemon.create(&vm),
        };
        if let Err(e) = made {
            // It may have built the VM before its answer was lost.
            self.remove_pod(&names);
            return Err(err(Code::UNAVAILABLE, format!("{e:#}")));
        }
        let t_vm = Instant::now();
        // The task's pid: the pod VM's own process where it has one (as
        // Kata reports its hypervisor's; it outlives the daemon, so the pid
        // stays true across a daemon's restart), else the daemon's.
        let vm_pid = self.daemon.vm_pid(&names.vm_id);
        let host_pid = match &vm_pid {
            Ok(p) => p.unwrap_or(host_pid),
            Err(e) => {
                tracing::warn!(
                    "{}: its pod VM's process is unknown ({e:#}): the daemon's pid stands for it",
                    req.id
                );
                host_pid
            }
        };
        // The pod's cgroup holds its VM's process, so the node's accounting
        // of the pod includes its VM (`pod_cgroup.rs`). A pod runs all the
        // same where that fails.
        if cri_sandbox && matches!(vm_pid, Ok(Some(_))) {
            match crate::pod_cgroup::of_sandbox(&spec, &self.namespace) {
                crate::pod_cgroup::PodCgroup::At(parent) => {
                    if let Err(e) = self.daemon.pod_cgroup(&names.vm_id, &parent) {
                        tracing::warn!("{}: its pod VM stays out of the pod's cgroup {parent}: {e:#}", req.id);
                    }
                }
                crate::pod_cgroup::PodCgroup::None => {}
                crate::pod_cgroup::PodCgroup::NotFollowed(why) => {
                    tracing::info!("{}: its pod VM stays out of the pod's cgroup: {why}", req.id);
                }
            }
        }
        let r = (|| {
            let agent = Agent::new(&names.vsock).with_limits(cfg.agent_limits());
            let vm_id = names.vm_id.clone();
            let daemon = self.daemon.clone();
            let mut conn = agent
                .wait_ready(Instant::now() + cfg.boot_timeout(), || match daemon.life(&vm_id) {
                    // A daemon too busy to answer in time (many pods at
                    // once) is not a death: the boot deadline bounds this.
                    Ok(VmLife::Running | VmLife::Paused) | Err(_) => Ok(()),
                    Ok(other) => anyhow::bail!("the pod VM {vm_id} died while booting: {other:?}"),
                })
                .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
            let t_agent = Instant::now();
            let paths = stdio::Paths {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            };
            for_creates(&conn, &agent)?;
            // The VM's own identity and the pod's network: both calls can be
            // made again. A fork child's guest handles its vsock's reset
            // (`docs/vsock.md`) on a work item of its own, which may reset a
            // connection made just before it ran: that one is made again once.
            let mut setup = Vec::new();
            if booted {
                setup.push(Request::Identity(new_identity().map_err(internal)?));
            }
            if let Some(n) = &pod_net {
                setup.push(Request::Network(Network {
                    mac: None,
                    address: n.address.clone(),
                    gateway: n.gateway.clone(),
                    mtu: Some(n.mtu),
                    // The template's MAC is every sibling's (a pool
                    // member's its own id's): this pod's own.
                    set_mac: booted.then(|| pod_mac(&names.vm_id)),
                }));
            }
            // Each call's time, for the phase line ("identity N ms, network N ms").
            let took = std::cell::RefCell::new(Vec::new());
            let call_all = |conn: &mut crate::agent::Conn| {
                setup.iter().try_for_each(|r| {
                    let t = Instant::now();
                    conn.call(r)?;
                    took.borrow_mut()
                        .push(format!("{} {} ms", setup_name(r), t.elapsed().as_millis()));
                    Ok(())
                })
            };
            match call_all(&mut conn) {
                Err(CallError::Lost(e)) if start == PodStart::Fork => {
                    tracing::info!(
                        "{}: the agent connection was lost once after the fork ({e}); again",
                        req.id
                    );
                    took.borrow_mut().push("the connection lost and made again".into());
                    conn = agent
                        .connect(agent.limits().call)
                        .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
                    for_creates(&conn, &agent)?;
                    call_all(&mut conn).map_err(from_call)?;
                }
                r => r.map_err(from_call)?,
            }
            let t_setup = Instant::now();
            // (A CRI sandbox's agent mounts no rootfs: its stand-in has none.)
            conn.call(&Request::CreateContainer(CreateContainer {
                id: req.id.clone(),
                spec,
                rootfs: BlockMount {
                    serial: "k7d-disk0".into(),
                    fstype: "erofs".into(),
                    sectors: sectors.first().copied(),
                },
                stdio: paths.spec(),
                binds: binds.map(|mut b| {
                    b.disk.sectors = sectors.get(1).copied();
                    b
                }),
                node: Some(crate::limits::Node::get().sysctls.clone()),
            }))
            .map_err(from_call)?;
            let relays = stdio::start(&agent, &pref(&req.id, ""), &paths).map_err(internal)?;
            // Where a pod's start goes (docs/containerd.md, "Pod start phases").
            let ms = |a: Instant, b: Instant| b.duration_since(a).as_millis();
            let t_end = Instant::now();
            tracing::info!(
                "pod VM of {} created ({}): prepare {} ms, vm {} ms, agent {} ms, setup {} ms ({}), container {} ms",
                req.id,
                start.name(),
                ms(t0, vm_started),
                ms(vm_started, t_vm),
                ms(t_vm, t_agent),
                ms(t_agent, t_setup),
                took.borrow().join(", "),
                ms(t_setup, t_end)
            );
            if deadline.is_some_and(|d| Instant::now() > d) {
                return Err(err(
                    Code::DEADLINE_EXCEEDED,
                    format!("creating {} took past containerd's deadline; rolled back", req.id),
                ));
            }
            Ok((agent, relays))
        })();
        match r {
            Ok((agent, relays)) => Ok((
                Pod {
                    names,
                    drives,
                    agent,
                    host_pid,
                    paused: false,
                    dead: false,
                    sandbox: cri_sandbox.then(|| req.id.clone()),
                },
                relays,
            )),
            Err(e) => {
                tracing::warn!("create of {} failed, rolling back: {e}", req.id);
                self.remove_pod(&names);
                Err(e)
            }
        }
    }
}

impl Inner {
    /// Forks the pod VM `vm` from the node's template of its shape (made
    /// first when missing) and puts its images into the first drives.
    fn fork_pod(&self, cfg: &ShimConfig, vm: &PodVmSpec) -> anyhow::Result<()> {
        let t = template::for_shape(cfg, vm.vcpus, vm.memory_mib);
        let t0 = Instant::now();
        t.ensure(&*self.daemon, cfg, (vm.vcpus, vm.memory_mib), cfg.boot_timeout())?;
        let t_template = Instant::now();
        self.daemon.fork(
            &t.vm_id,
            &ForkedPod {
                id: vm.id.clone(),
                nic: vm.nic.clone(),
                vsock_uds: vm.vsock_uds.clone(),
            },
        )?;
        let t_fork = Instant::now();
        self.put_media(vm)?;
        tracing::info!(
            "{} forked from {}: template {} ms, fork {} ms, media {} ms",
            vm.id,
            t.vm_id,
            t_template.duration_since(t0).as_millis(),
            t_fork.duration_since(t_template).as_millis(),
            t_fork.elapsed().as_millis()
        );
        Ok(())
    }

    /// Makes the claimed, paused warm pool member `vm.id` the pod's VM: its
    /// NIC joins the pod's network, it resumes, its images go in.
    fn claimed_pod(&self, vm: &PodVmSpec) -> anyhow::Result<()> {
        let t0 = Instant::now();
        if let Some(nic) = &vm.nic {
            self.daemon.attach_nic(&vm.id, nic)?;
        }
        let t_nic = Instant::now();
        self.daemon.resume(&vm.id)?;
        let t_resume = Instant::now();
        self.put_media(vm)?;
        tracing::info!(
            "{} claimed: nic {} ms, resume {} ms, media {} ms",
            vm.id,
            t_nic.duration_since(t0).as_millis(),
            t_resume.duration_since(t_nic).as_millis(),
            t_resume.elapsed().as_millis()
        );
        Ok(())
    }

    /// Puts the pod's images into the booted VM's first drives (medium changes).
    fn put_media(&self, vm: &PodVmSpec) -> anyhow::Result<()> {
        for (i, d) in vm.disks.iter().enumerate() {
            self.daemon.set_medium(&vm.id, u32::try_from(i)?, Some(d))?;
        }
        Ok(())
    }
}

/// Boots the warm pool full again in the background when dropped (the
/// pod's create is done, so its own boot or claim came first): a detached
/// `k7d pool-fill` of its own (this binary), which outlives the shim if
/// the pod goes first, waits `pool_refill_delay_s`, and logs into the
/// pool's directory.
struct RefillOnDrop {
    pool: pool::Pool,
    cfg: ShimConfig,
}

impl Drop for RefillOnDrop {
    fn drop(&mut self) {
        if let Err(e) = self.pool.spawn_refill(&self.cfg) {
            tracing::warn!("cannot start the warm pool's refill: {e:#}");
        }
    }
}

/// A setup call's name in the pod start phase line.
fn setup_name(r: &Request) -> &'static str {
    match r {
        Request::Identity(_) => "identity",
        Request::Network(n) if n.set_mac.is_some() => "network with the MAC",
        Request::Network(_) => "network",
        _ => "call",
    }
}

/// A fork child's own identity: host entropy, the host's clock, a fresh
/// machine-id.
fn new_identity() -> anyhow::Result<Identity> {
    use std::io::Read;
    let mut bytes = [0u8; 64 + 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| anyhow::anyhow!("cannot read /dev/urandom: {e}"))?;
    let (entropy, id) = bytes.split_at(64);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| anyhow::anyhow!("the host clock is before 1970: {e}"))?;
    let mut machine_id: String = id.iter().map(|b| format!("{b:02x}")).collect();
    if machine_id.bytes().all(|b| b == b'0') {
        machine_id.replace_range(31.., "1");
    }
    Ok(Identity {
        entropy: entropy.to_vec(),
        unix_time_ns: u64::try_from(now.as_nanos()).unwrap_or(u64::MAX),
        machine_id,
    })
}

/// A pod VM's own MAC (locally administered unicast, from its VM id): a
/// fork child's NIC otherwise keeps the template's.
fn pod_mac(vm_id: &str) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(vm_id.as_bytes());
    format!("02:6b:{:02x}:{:02x}:{:02x}:{:02x}", h[0], h[1], h[2], h[3])
}

impl Task for Service {
    fn state(&self, _ctx: &TtrpcContext, req: api::StateRequest) -> TtrpcResult<api::StateResponse> {
        let st = self.inner.lock();
        let t = st
            .tasks
            .get(&req.id)
            .ok_or_else(|| not_found(format!("task {}", req.id)))?;
        let p = t
            .procs
            .get(&req.exec_id)
            .ok_or_else(|| not_found(format!("process {}/{}", req.id, req.exec_id)))?;
        let paused = st.pod.as_ref().is_some_and(|p| p.paused);
        let status = match p.life {
            Life::Created => api::Status::CREATED,
            Life::Running if paused => api::Status::PAUSED,
            Life::Running => api::Status::RUNNING,
            Life::Stopped => api::Status::STOPPED,
        };
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle: t.bundle.clone(),
            pid: st.pod.as_ref().map_or(0, |p| p.host_pid),
            status: status.into(),
            stdin: p.paths.stdin.clone(),
            stdout: p.paths.stdout.clone(),
            stderr: p.paths.stderr.clone(),
            terminal: p.paths.terminal,
            exit_status: p.exit_status,
            exited_at: p.exited_at.clone().into(),
            exec_id: req.exec_id,
            ..Default::default()
        })
    }

    fn create(&self, ctx: &TtrpcContext, req: api::CreateTaskRequest) -> TtrpcResult<api::CreateTaskResponse> {
        let pid = self.inner.create(ctx, &req)?;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn start(&self, _ctx: &TtrpcContext, req: api::StartRequest) -> TtrpcResult<api::StartResponse> {
        self.start_process(req)
    }

    fn delete(&self, _ctx: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<api::DeleteResponse> {
        let (life, status, at, host_pid, dead) = {
            let st = self.inner.lock();
            let p = st.process(&req.id, &req.exec_id)?;
            let pod = st.pod.as_ref();
            (
                p.life,
                p.exit_status,
                p.exited_at.clone(),
                pod.map_or(0, |p| p.host_pid),
                pod.is_none_or(|p| p.dead),
            )
        };
        if life == Life::Running {
            return Err(err(
                Code::FAILED_PRECONDITION,
                format!("process {}/{} is still running", req.id, req.exec_id),
            ));
        }
        if !req.exec_id.is_empty() {
            if !dead {
                let _ = self.inner.call(&Request::DeleteExec(pref(&req.id, &req.exec_id)));
            }
            let mut st = self.inner.lock();
            if let Some(t) = st.tasks.get_mut(&req.id) {
                t.procs.remove(&req.exec_id);
            }
        } else {
            // The last container's VM is deleted right after: no guest call.
            let last = self.inner.lock().tasks.len() == 1;
            // Whether the agent unmounted the container's images for good
            // (its drives may then take another medium).
            let mut clean = false;
            if !dead && !last {
                clean = match self.inner.call(&Request::DeleteContainer {
                    container: req.id.clone(),
                }) {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!("deleting container {} in the pod VM: {e}", req.id);
                        false
                    }
                };
            }
            let (pod, drives) = {
                let mut st = self.inner.lock();
                let drives = st.tasks.remove(&req.id).map(|t| t.drives).unwrap_or_default();
                let names = st.pod.as_ref().map(|p| p.names.clone());
                let pod = if st.tasks.is_empty() { st.pod.take() } else { None };
                (pod, names.filter(|_| !drives.is_empty()).map(|n| (n, drives)))
            };
            if let Some(pod) = pod {
                self.inner.remove_pod(&pod.names);
            } else if let Some((names, drives)) = drives
                && !dead
            {
                // An app container: the agent unmounted its images above.
                self.inner
                    .give_back_drives(&names.vm_id, &names.dir, &req.id, &drives, clean);
            }
            self.inner.publish(
                topics::TASK_DELETE_EVENT_TOPIC,
                Box::new(TaskDelete {
                    container_id: req.id.clone(),
                    pid: host_pid,
                    exit_status: status,
                    exited_at: at.clone().into(),
                    id: req.id.clone(),
                    ..Default::default()
                }),
            );
        }
        self.inner.changed.notify_all();
        Ok(api::DeleteResponse {
            pid: host_pid,
            exit_status: status,
            exited_at: at.into(),
            ..Default::default()
        })
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        match self.inner.call(&Request::Pids {
            container: req.id.clone(),
        })? {
            Reply::Pids(pids) => Ok(api::PidsResponse {
                processes: pids
                    .into_iter()
                    .map(|pid| containerd_shim::protos::types::task::ProcessInfo {
                        pid,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            other => Err(err(
                Code::INTERNAL,
                format!("the guest agent answered Pids with {other:?}"),
            )),
        }
    }

    fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.pause_resume(&req.id, true)
    }

    fn resume(&self, _ctx: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        self.pause_resume(&req.id, false)
    }

    fn checkpoint(&self, _ctx: &TtrpcContext, _req: api::CheckpointTaskRequest) -> TtrpcResult<api::Empty> {
        Err(err(
            Code::UNIMPLEMENTED,
            "k7d does not checkpoint containers (snapshot or fork the pod VM instead)",
        ))
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let signal = i32::try_from(req.signal)
            .ok()
            .filter(|s| (1..=64).contains(s))
            .ok_or_else(|| err(Code::INVALID_ARGUMENT, format!("{} is not a signal number", req.signal)))?;
        // A CRI sandbox's SIGKILL (containerd's StopPodSandbox, once its app
        // containers are stopped) ends the pod: the daemon removes the pod
        // VM, with no guest call, so the stop takes what the daemon takes
        // whatever the guest is doing (as Kata stops its VM).
        let sandbox_vm = {
            let st = self.inner.lock();
            st.pod
                .as_ref()
                .filter(|p| {
                    signal == libc::SIGKILL
                        && req.exec_id.is_empty()
                        && !p.dead
                        && p.sandbox.as_deref() == Some(req.id.as_str())
                })
                .map(|p| p.names.vm_id.clone())
        };
        if let Some(vm_id) = sandbox_vm {
            tracing::info!("{}: the sandbox is killed: its pod VM {vm_id} is removed", req.id);
            if let Some(p) = self.inner.lock().pod.as_mut() {
                p.dead = true;
            }
            // The exits follow from the removal: each process's wait loses
            // the guest and reports it killed. The removal runs after this
            // call answers: the exit event lets containerd delete the task
            // and shut this shim down, which must not come before the answer
            // (containerd would read the kill as failed). A removal that
            // fails is tried again by the sandbox's delete.
            let daemon = self.inner.daemon.clone();
            std::thread::Builder::new()
                .name("k7d-shim-stop".into())
                .spawn(move || {
                    if let Err(e) = daemon.delete(&vm_id) {
                        tracing::warn!("cannot remove the pod VM {vm_id}: {e:#}");
                    }
                })
                .map_err(|e| err(Code::INTERNAL, format!("cannot start the pod VM's removal: {e}")))?;
            return Ok(api::Empty::new());
        }
        {
            let st = self.inner.lock();
            let p = st.process(&req.id, &req.exec_id)?;
            let dead = st.pod.as_ref().is_none_or(|p| p.dead);
            if p.life == Life::Stopped && (dead || req.all) {
                // Nothing left to signal (containerd's cleanup kills with
                // `all` after the VM died).
                return Ok(api::Empty::new());
            }
            if p.life == Life::Stopped {
                return Err(err(
                    Code::NOT_FOUND,
                    format!("process {}/{} has already finished", req.id, req.exec_id),
                ));
            }
        }
        self.inner.call(&Request::Signal {
            process: pref(&req.id, &req.exec_id),
            signal,
            all: req.all,
        })?;
        Ok(api::Empty::new())
    }

    fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        if !proto::valid_id(&req.exec_id) {
            return Err(err(
                Code::INVALID_ARGUMENT,
                format!("{:?} is not an exec id", req.exec_id),
            ));
        }
        let mut spec: serde_json::Value = serde_json::from_slice(&req.spec.value).map_err(|e| {
            err(
                Code::INVALID_ARGUMENT,
                format!("the exec's process spec is not OCI JSON: {e}"),
            )
        })?;
        crate::limits::Node::get()
            .fill_rlimits(&mut spec)
            .map_err(|e| err(Code::INVALID_ARGUMENT, format!("the exec's process spec: {e}")))?;
        {
            let st = self.inner.lock();
            let t = st
                .tasks
                .get(&req.id)
                .ok_or_else(|| not_found(format!("task {}", req.id)))?;
            if t.procs.contains_key(&req.exec_id) {
                return Err(err(
                    Code::ALREADY_EXISTS,
                    format!("exec {} already exists in {}", req.exec_id, req.id),
                ));
            }
        }
        let paths = stdio::Paths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let process = pref(&req.id, &req.exec_id);
        self.inner.call(&Request::Exec(proto::Exec {
            process: process.clone(),
            spec,
            stdio: paths.spec(),
        }))?;
        let (agent, _) = self.inner.agent()?;
        let relays = match stdio::start(&agent, &process, &paths) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.inner.call(&Request::DeleteExec(process));
                return Err(internal(e));
            }
        };
        {
            let mut st = self.inner.lock();
            let Some(t) = st.tasks.get_mut(&req.id) else {
                return Err(not_found(format!("task {}", req.id)));
            };
            t.procs.insert(req.exec_id.clone(), Proc::created(paths, relays));
        }
        self.inner.publish(
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            }),
        );
        self.inner.clone().spawn_watcher(&req.id, &req.exec_id)?;
        Ok(api::Empty::new())
    }

    fn resize_pty(&self, _ctx: &TtrpcContext, req: api::ResizePtyRequest) -> TtrpcResult<api::Empty> {
        self.inner.call(&Request::ResizePty {
            process: pref(&req.id, &req.exec_id),
            width: req.width,
            height: req.height,
        })?;
        Ok(api::Empty::new())
    }

    fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        if req.stdin {
            let relays = {
                let st = self.inner.lock();
                st.process(&req.id, &req.exec_id)?.relays.clone()
            };
            if let Some(r) = relays {
                r.close_stdin();
            }
            // The EOF travels down the stream once the copy drained the
            // FIFO; the agent then closes the process's stdin.
        }
        Ok(api::Empty::new())
    }

    fn update(&self, _ctx: &TtrpcContext, req: api::UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        let resources: serde_json::Value = serde_json::from_slice(&req.resources.value).map_err(|e| {
            err(
                Code::INVALID_ARGUMENT,
                format!("the resources are not OCI LinuxResources JSON: {e}"),
            )
        })?;
        self.inner.call(&Request::Update {
            container: req.id.clone(),
            resources,
        })?;
        Ok(api::Empty::new())
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let mut st = self.inner.lock();
        loop {
            let p = st.process(&req.id, &req.exec_id)?;
            if p.life == Life::Stopped {
                return Ok(api::WaitResponse {
                    exit_status: p.exit_status,
                    exited_at: p.exited_at.clone().into(),
                    ..Default::default()
                });
            }
            st = self.inner.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn stats(&self, _ctx: &TtrpcContext, req: api::StatsRequest) -> TtrpcResult<api::StatsResponse> {
        let s = match self.inner.call(&Request::Stats {
            container: req.id.clone(),
        })? {
            Reply::Stats(s) => s,
            other => {
                return Err(err(
                    Code::INTERNAL,
                    format!("the guest agent answered Stats with {other:?}"),
                ));
            }
        };
        let m = crate::metrics::v2(&s);
        let mut any = Any::new();
        any.type_url = crate::metrics::V2_TYPE_URL.to_string();
        any.value = m
            .write_to_bytes()
            .map_err(|e| err(Code::INTERNAL, format!("cannot encode the metrics: {e}")))?;
        Ok(api::StatsResponse {
            stats: MessageField::some(any),
            ..Default::default()
        })
    }

    fn connect(&self, _ctx: &TtrpcContext, _req: api::ConnectRequest) -> TtrpcResult<api::ConnectResponse> {
        let host_pid = self.inner.lock().pod.as_ref().map_or(0, |p| p.host_pid);
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid: host_pid,
            ..Default::default()
        })
    }

    fn shutdown(&self, _ctx: &TtrpcContext, _req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        let pod = {
            let mut st = self.inner.lock();
            if st.booting {
                st.shutdown_requested = true;
                return Ok(api::Empty::new());
            }
            if !st.tasks.is_empty() {
                return Ok(api::Empty::new());
            }
            st.pod.take()
        };
        if let Some(pod) = pod {
            self.inner.remove_pod(&pod.names);
        }
        self.inner.exit.signal();
        Ok(api::Empty::new())
    }
}

impl Service {
    /// containerd's Start ([`Task::start`]; it needs no context).
    fn start_process(&self, req: api::StartRequest) -> TtrpcResult<api::StartResponse> {
        {
            let mut st = self.inner.lock();
            let p = st.process_mut(&req.id, &req.exec_id)?;
            if p.life != Life::Created || p.starting {
                return Err(err(
                    Code::FAILED_PRECONDITION,
                    format!("process {}/{} was already started", req.id, req.exec_id),
                ));
            }
            p.starting = true;
        }
        // Clears `starting` however Start ends, and lets a waiting exit go
        // (after the start event, when it started).
        let done = |running: bool| {
            let mut st = self.inner.lock();
            if let Some(p) = st.tasks.get_mut(&req.id).and_then(|t| t.procs.get_mut(&req.exec_id)) {
                p.starting = false;
                if running && p.life == Life::Created {
                    p.life = Life::Running;
                }
            }
            drop(st);
            self.inner.changed.notify_all();
        };
        match self.inner.call(&Request::Start(pref(&req.id, &req.exec_id))) {
            Ok(Reply::Pid(_)) => {}
            Ok(other) => {
                done(false);
                return Err(err(
                    Code::INTERNAL,
                    format!("the guest agent answered Start with {other:?}"),
                ));
            }
            Err(e) => {
                done(false);
                return Err(e);
            }
        }
        let (host_pid, ended) = {
            let st = self.inner.lock();
            let ended = st
                .tasks
                .get(&req.id)
                .and_then(|t| t.procs.get(&req.exec_id))
                .is_none_or(|p| p.life == Life::Stopped);
            (st.pod.as_ref().map_or(0, |p| p.host_pid), ended)
        };
        if ended {
            // The pod VM died while the agent started it and its exit is
            // out already: a start event now would follow its exit.
            done(false);
            return Err(err(
                Code::UNAVAILABLE,
                format!("the pod VM stopped while process {}/{} started", req.id, req.exec_id),
            ));
        }
        if req.exec_id.is_empty() {
            self.inner.publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid: host_pid,
                    ..Default::default()
                }),
            );
        } else {
            self.inner.publish(
                topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid: host_pid,
                    ..Default::default()
                }),
            );
        }
        done(true);
        Ok(api::StartResponse {
            pid: host_pid,
            ..Default::default()
        })
    }

    fn pause_resume(&self, id: &str, pause: bool) -> TtrpcResult<api::Empty> {
        let vm_id = {
            let st = self.inner.lock();
            if !st.tasks.contains_key(id) {
                return Err(not_found(format!("task {id}")));
            }
            st.pod
                .as_ref()
                .map(|p| p.names.vm_id.clone())
                .ok_or_else(|| err(Code::FAILED_PRECONDITION, "no pod VM"))?
        };
        let r = if pause {
            self.inner.daemon.pause(&vm_id)
        } else {
            self.inner.daemon.resume(&vm_id)
        };
        r.map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
        if let Some(p) = self.inner.lock().pod.as_mut() {
            p.paused = pause;
        }
        if pause {
            self.inner.publish(
                topics::TASK_PAUSED_EVENT_TOPIC,
                Box::new(TaskPaused {
                    container_id: id.to_string(),
                    ..Default::default()
                }),
            );
        } else {
            self.inner.publish(
                topics::TASK_RESUMED_EVENT_TOPIC,
                Box::new(TaskResumed {
                    container_id: id.to_string(),
                    ..Default::default()
                }),
            );
        }
        Ok(api::Empty::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;
    use std::thread::JoinHandle;

    use containerd_shim::protos::shim::events::ForwardRequest;
    use containerd_shim::protos::{Events, create_events};

    use crate::agent::Limits;
    use crate::pool::tests::Lives;

    /// How long a test waits for what must happen at once.
    const LIMIT: Duration = Duration::from_secs(10);

    /// containerd's events service: what the shim published, in order.
    #[derive(Default)]
    struct Published {
        events: Mutex<Vec<(String, Any)>>,
        added: Condvar,
    }

    impl Events for Published {
        fn forward(&self, _ctx: &TtrpcContext, req: ForwardRequest) -> TtrpcResult<api::Empty> {
            let env = req.envelope.unwrap_or_default();
            let event = env.event.clone().unwrap_or_default();
            self.events.lock().unwrap().push((env.topic, event));
            self.added.notify_all();
            Ok(api::Empty::new())
        }
    }

    impl Published {
        fn topics(&self) -> Vec<String> {
            self.events.lock().unwrap().iter().map(|(t, _)| t.clone()).collect()
        }

        /// The (container, id, status) of every exit published, sorted,
        /// once there are `n` (or what there is after [`LIMIT`]).
        fn exits(&self, n: usize) -> Vec<(String, String, u32)> {
            let deadline = Instant::now() + LIMIT;
            let mut ev = self.events.lock().unwrap();
            let exits = |ev: &[(String, Any)]| -> Vec<(String, String, u32)> {
                let mut x: Vec<_> = ev
                    .iter()
                    .filter(|(t, _)| t == topics::TASK_EXIT_EVENT_TOPIC)
                    .map(|(_, a)| {
                        let e = TaskExit::parse_from_bytes(&a.value).unwrap();
                        (e.container_id, e.id, e.exit_status)
                    })
                    .collect();
                x.sort();
                x
            };
            while exits(&ev).len() < n && Instant::now() < deadline {
                ev = self.added.wait_timeout(ev, deadline - Instant::now()).unwrap().0;
            }
            exits(&ev)
        }
    }

    /// A pod VM's agent behind its vsock socket `uds`: it answers `Hello`,
    /// then holds one `Start` (runc busy in the guest; the VM may die
    /// meanwhile) and answers it with a pid once `answer` is sent to or
    /// dropped. `asked` gets the process that Start names.
    fn slow_agent(uds: &Path) -> (mpsc::Receiver<ProcessRef>, mpsc::Sender<()>) {
        let listener = UnixListener::bind(uds).unwrap();
        let (asked_tx, asked) = mpsc::channel();
        let (answer, answer_rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
                line.push(b[0]);
            }
            assert_eq!(line, format!("CONNECT {}", proto::PORT).as_bytes());
            s.write_all(b"OK 1\n").unwrap();
            loop {
                match proto::read_frame::<_, Request>(&mut s).unwrap() {
                    Request::Hello { .. } => {
                        let hello = Reply::Hello {
                            version: proto::VERSION,
                            kernel: "test".into(),
                        };
                        proto::write_frame(&mut s, &proto::Response::Ok(hello)).unwrap();
                    }
                    Request::Start(p) => {
                        asked_tx.send(p).unwrap();
                        let _ = answer_rx.recv();
                        let _ = proto::write_frame(&mut s, &proto::Response::Ok(Reply::Pid(42)));
                        return;
                    }
                    other => panic!("the test's agent was asked {other:?}"),
                }
            }
        });
        (asked, answer)
    }

    /// One shim's task service over a live pod VM (host pid 7) with task
    /// `c`: its init running, its exec `e` created. containerd's events
    /// service and the daemon are the test's; the agent is [`slow_agent`].
    struct Shim {
        svc: Service,
        published: Arc<Published>,
        daemon: Arc<Lives>,
        vm_id: String,
        events: Option<ttrpc::Server>,
        dir: PathBuf,
    }

    impl Drop for Shim {
        fn drop(&mut self) {
            if let Some(s) = self.events.take() {
                s.shutdown();
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn shim(tag: &str) -> (Shim, mpsc::Receiver<ProcessRef>, mpsc::Sender<()>) {
        let dir = std::env::temp_dir().join(format!("k7d-shim-task-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let names = pod_names(&dir, "k7d-test", "c");
        std::fs::create_dir_all(&names.dir).unwrap();
        let published = Arc::new(Published::default());
        let sock = dir.join("events.sock");
        let mut events = ttrpc::Server::new()
            .bind(&format!("unix://{}", sock.display()))
            .unwrap()
            .register_service(create_events(published.clone()));
        events.start().unwrap();
        let publisher = RemotePublisher::new(sock.to_str().unwrap()).unwrap();
        let (asked, answer) = slow_agent(&names.vsock);
        let daemon = Arc::new(Lives::default());
        daemon
            .lives
            .lock()
            .unwrap()
            .insert(names.vm_id.clone(), VmLife::Running);
        let proc = |life| Proc {
            life,
            starting: false,
            exit_status: 0,
            exited_at: None,
            paths: stdio::Paths::default(),
            relays: None,
        };
        let limits = Limits {
            call: Duration::from_secs(60),
            create: Duration::from_secs(60),
        };
        let state = State {
            pod: Some(Pod {
                names: names.clone(),
                drives: Vec::new(),
                agent: Agent::new(&names.vsock).with_limits(limits),
                host_pid: 7,
                paused: false,
                dead: false,
                sandbox: None,
            }),
            tasks: HashMap::from([(
                "c".to_string(),
                TaskEntry {
                    bundle: String::new(),
                    drives: Vec::new(),
                    procs: HashMap::from([
                        (String::new(), proc(Life::Running)),
                        ("e".to_string(), proc(Life::Created)),
                    ]),
                },
            )]),
            ..Default::default()
        };
        let svc = Service {
            inner: Arc::new(Inner {
                namespace: "k7d-test".into(),
                daemon: daemon.clone(),
                publisher: Mutex::new(publisher),
                exit: Arc::new(ExitSignal::default()),
                state: Mutex::new(state),
                changed: Condvar::new(),
            }),
        };
        let shim = Shim {
            svc,
            published,
            daemon,
            vm_id: names.vm_id,
            events: Some(events),
            dir,
        };
        (shim, asked, answer)
    }

    impl Shim {
        /// containerd's Start of exec `e`, in flight: the agent has it.
        fn start_exec(&self, asked: &mpsc::Receiver<ProcessRef>) -> JoinHandle<TtrpcResult<api::StartResponse>> {
            let svc = self.svc.clone();
            let start = std::thread::spawn(move || {
                svc.start_process(api::StartRequest {
                    id: "c".into(),
                    exec_id: "e".into(),
                    ..Default::default()
                })
            });
            assert_eq!(asked.recv_timeout(LIMIT).unwrap(), pref("c", "e"));
            start
        }

        /// A watcher's report of exec `e`'s exit, in its own thread.
        fn exec_exits(&self, status: u32) -> JoinHandle<()> {
            let inner = self.svc.inner.clone();
            std::thread::spawn(move || inner.exited("c", "e", status))
        }

        /// The monitor's end of the pod VM (it died), in its own thread.
        fn vm_dies(&self) -> JoinHandle<()> {
            let (inner, vm_id) = (self.svc.inner.clone(), self.vm_id.clone());
            std::thread::spawn(move || inner.end_vm(&vm_id))
        }
    }

    /// Both of task `c`'s processes killed with the pod VM.
    fn both_killed() -> Vec<(String, String, u32)> {
        vec![
            ("c".to_string(), "c".to_string(), KILLED),
            ("c".to_string(), "e".to_string(), KILLED),
        ]
    }

    /// While the pod VM lives, an exit reported during its process's Start
    /// waits for that Start: containerd sees the exec's start event first,
    /// then its exit.
    #[test]
    fn while_the_pod_vm_lives_an_exit_waits_for_its_start_in_flight() {
        let (shim, asked, answer) = shim("live");
        let start = shim.start_exec(&asked);
        let exit = shim.exec_exits(0);
        std::thread::sleep(Duration::from_millis(300));
        assert!(shim.published.topics().is_empty(), "{:?}", shim.published.topics());
        assert!(!exit.is_finished(), "the exit went before its Start's answer");
        answer.send(()).unwrap();
        assert_eq!(start.join().unwrap().unwrap().pid, 7);
        exit.join().unwrap();
        assert_eq!(
            shim.published.topics(),
            [topics::TASK_EXEC_STARTED_EVENT_TOPIC, topics::TASK_EXIT_EVENT_TOPIC]
        );
        assert_eq!(shim.published.exits(1), [("c".to_string(), "e".to_string(), 0)]);
    }

    /// Once the pod VM is dead its exits do not wait for a Start in flight
    /// (whose agent call can only fail, at worst at its limit): with the
    /// crashing exec's Start still waiting for the agent, `end_vm`
    /// publishes every process's exit (137) and removes the VM, and a
    /// watcher's exit that was waiting for that Start ends, published once.
    #[test]
    fn once_the_pod_vm_is_dead_its_exits_do_not_wait_for_a_start_in_flight() {
        let (shim, asked, answer) = shim("dead");
        let start = shim.start_exec(&asked);
        let waiting = shim.exec_exits(KILLED);
        std::thread::sleep(Duration::from_millis(300));
        assert!(shim.published.topics().is_empty(), "{:?}", shim.published.topics());
        let end = shim.vm_dies();
        assert_eq!(
            shim.published.exits(2),
            both_killed(),
            "exits while the Start is in flight"
        );
        assert!(!start.is_finished(), "the agent has not answered the Start yet");
        end.join().unwrap();
        waiting.join().unwrap();
        assert_eq!(*shim.daemon.deleted.lock().unwrap(), std::slice::from_ref(&shim.vm_id));
        assert_eq!(shim.published.topics().len(), 2, "{:?}", shim.published.topics());
        drop(answer);
        assert!(start.join().unwrap().is_err());
    }

    /// With no daemon (its socket refuses connections), a pod VM whose
    /// own process still serves its vsock socket (`k7d daemon --jail on`)
    /// lives on: no exit, no delete, until the socket goes too; then every
    /// process exits with 137 at once.
    #[test]
    fn with_no_daemon_a_pod_vm_lives_while_its_vsock_socket_is_served() {
        let (shim, _asked, _answer) = shim("nodaemon");
        let vsock = shim.svc.inner.lock().pod.as_ref().unwrap().names.vsock.clone();
        // The VM process's socket (the test agent's is unreachable now).
        std::fs::remove_file(&vsock).unwrap();
        let served = UnixListener::bind(&vsock).unwrap();
        shim.daemon
            .lives
            .lock()
            .unwrap()
            .insert(shim.vm_id.clone(), VmLife::DaemonGone);
        let (inner, vm_id) = (shim.svc.inner.clone(), shim.vm_id.clone());
        let monitor = std::thread::spawn(move || inner.monitor(vm_id));
        std::thread::sleep(MONITOR_PERIOD * 5);
        assert!(shim.published.topics().is_empty(), "{:?}", shim.published.topics());
        assert!(shim.daemon.deleted.lock().unwrap().is_empty());
        assert!(!monitor.is_finished(), "the monitor gave up on a VM that lives");
        // The VM process is gone too: its socket refuses connections.
        drop(served);
        assert_eq!(shim.published.exits(2), both_killed());
        monitor.join().unwrap();
    }

    /// A Start whose agent answers after its process's exit was published
    /// (the pod VM died in between) answers UNAVAILABLE and publishes no
    /// start event: containerd never sees a start after the exit, and the
    /// process stays stopped with 137.
    #[test]
    fn a_start_that_returns_after_its_exit_was_published_answers_unavailable_without_a_start_event() {
        let (shim, asked, answer) = shim("late-start");
        let start = shim.start_exec(&asked);
        let end = shim.vm_dies();
        assert_eq!(shim.published.exits(2), both_killed());
        end.join().unwrap();
        answer.send(()).unwrap();
        match start.join().unwrap() {
            Err(ttrpc::Error::RpcStatus(s)) => assert_eq!(s.code(), Code::UNAVAILABLE, "{}", s.message),
            other => panic!("the late Start answered {other:?}"),
        }
        assert_eq!(
            shim.published.topics(),
            [topics::TASK_EXIT_EVENT_TOPIC, topics::TASK_EXIT_EVENT_TOPIC]
        );
        let st = shim.svc.inner.lock();
        let p = st.process("c", "e").unwrap();
        assert_eq!((p.life, p.exit_status, p.starting), (Life::Stopped, KILLED, false));
    }

    #[test]
    fn a_fork_child_gets_its_own_mac_and_identity() {
        let a = pod_mac("pod-0123456789abcdef");
        assert_eq!(a, pod_mac("pod-0123456789abcdef"), "one pod, one MAC");
        assert_ne!(a, pod_mac("pod-0123456789abcdee"));
        let first = u8::from_str_radix(&a[..2], 16).unwrap();
        assert_eq!(first & 0b11, 0b10, "locally administered unicast: {a}");
        assert_eq!(a.split(':').count(), 6);
        let (x, y) = (new_identity().unwrap(), new_identity().unwrap());
        assert_eq!(x.entropy.len(), 64);
        assert!((proto::MIN_ENTROPY..=proto::MAX_ENTROPY).contains(&x.entropy.len()));
        assert_ne!(x.entropy, y.entropy);
        assert_ne!(x.machine_id, y.machine_id);
        assert!(
            x.machine_id.len() == 32
                && x.machine_id
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert!(x.unix_time_ns > 1_700_000_000_000_000_000);
    }
}

//! Containers, run by runc (the OCI reference runtime, a program in the
//! guest), and their processes.
//!
//! A container is a bundle directory `<state>/c/<id>` (its rootfs mounts,
//! `config.json`, pid files), its init process and its execs. The agent is
//! PID 1 (or a subreaper), so when `runc create`/`runc exec --detach` exit,
//! the processes they started become the agent's children and
//! [`Reaper`] collects their exits.

use crate::binds::{self, BindMounts};
use crate::disk::{self, RootfsMounts};
use crate::reaper::Reaper;
use crate::stdio::{Attach, ChildStdio, ProcStdio};
use crate::{cgroup, lock, spec, sys, sysctl};
use k7d_agent::proto::{
    self, CONTAINER_TYPE, CgroupStats, CreateContainer, Exec, Exited, ProcessRef, ProcessState, Status, StdioSpec,
    Stream,
};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a delete waits for the init's exit to be collected.
const DELETE_WAIT: Duration = Duration::from_secs(2);
/// The most execs a container keeps (deleted ones do not count).
const MAX_EXECS: usize = 1024;
/// `k7d-agent pause`: the agent as a pod sandbox's process.
pub const PAUSE_ARG: &str = "pause";

/// Where things are; the defaults are the pod VM's.
#[derive(Debug, Clone)]
pub struct Config {
    /// The agent's state: bundles (`c/`), runc logs (`log/`), console sockets (`s/`).
    pub state_dir: PathBuf,
    /// The OCI runtime: crun or runc (runc's command line either way).
    pub runc: PathBuf,
    /// The runtime's `--root`.
    pub runc_root: PathBuf,
    /// sysfs (disks are looked up under `<sysfs>/block`).
    pub sysfs: PathBuf,
    /// devtmpfs.
    pub dev: PathBuf,
    /// The cgroup v2 root; containers live in `<root>/k7d/<id>`.
    pub cgroup_root: PathBuf,
    /// Pass `--no-pivot` to `runc create` (the root is an initramfs).
    pub no_pivot: bool,
    /// How long an image disk may take to appear.
    pub disk_timeout: Duration,
    /// How long one runc command may take before it is killed (the pod
    /// VM's `k7d.runc_timeout_s`, `proto::runc_timeout`).
    pub runc_timeout: Duration,
    /// Where the kernel's sysctls are (`/proc/sys`; a plain directory in
    /// tests): the node's limits are written there.
    pub proc_sys: PathBuf,
    /// Set the VM's hostname from a spec's `hostname` (PID 1 only: a
    /// host-side test must not rename the host).
    pub set_hostname: bool,
    /// What a CRI pod sandbox's process runs (program, then arguments):
    /// the agent itself, waiting as the pause image's program does
    /// (`k7d-agent pause`).
    pub stand_in: Vec<OsString>,
}

impl Config {
    /// A layout under `dir` for tests: no runc, nothing of the host touched.
    #[cfg(test)]
    pub(crate) fn for_tests(dir: &std::path::Path, disk_timeout: Duration) -> Config {
        Config {
            state_dir: dir.join("state"),
            runc: "/nonexistent/runc".into(),
            runc_root: dir.join("runc"),
            sysfs: dir.join("sys"),
            dev: dir.join("dev"),
            cgroup_root: dir.join("cg"),
            proc_sys: dir.join("proc-sys"),
            no_pivot: false,
            disk_timeout,
            runc_timeout: Duration::from_secs(k7d_agent::proto::DEFAULT_RUNC_TIMEOUT_S),
            // The test binary is no agent: a stand-in that waits as long.
            stand_in: vec!["/bin/sleep".into(), "3600".into()],
            set_hostname: false,
        }
    }

    /// The pod VM's layout, with the OCI runtime found on the usual paths.
    pub fn guest() -> Config {
        Config {
            state_dir: "/run/k7d".into(),
            runc: find_runtime(),
            runc_root: "/run/runc".into(),
            sysfs: "/sys".into(),
            dev: "/dev".into(),
            cgroup_root: "/sys/fs/cgroup".into(),
            proc_sys: "/proc/sys".into(),
            no_pivot: false,
            disk_timeout: Duration::from_secs(10),
            runc_timeout: Duration::from_secs(k7d_agent::proto::DEFAULT_RUNC_TIMEOUT_S),
            stand_in: vec!["/proc/self/exe".into(), PAUSE_ARG.into()],
            set_hostname: true,
        }
    }
}

/// The OCI runtime the agent runs: crun, else runc, the first found on the
/// usual paths (`/usr/sbin/runc` when neither is). crun first: a container
/// starts 4-5 times faster with it in a pod VM, where each start of runc's
/// Go runtime costs (CHALLENGES.md, "Containers started slowly in the pod
/// VM").
pub fn find_runtime() -> PathBuf {
    let dirs = [
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
    ];
    runtime_in(&dirs.map(PathBuf::from)).unwrap_or_else(|| "/usr/sbin/runc".into())
}

/// crun in any of `dirs`, else runc in any of them.
fn runtime_in(dirs: &[PathBuf]) -> Option<PathBuf> {
    ["crun", "runc"]
        .into_iter()
        .flat_map(|name| dirs.iter().map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// A refused or failed request: one sentence, and whether the container or
/// process does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// What went wrong.
    pub message: String,
    /// containerd's NotFound.
    pub not_found: bool,
}

fn fail(message: impl Into<String>) -> Error {
    Error {
        message: message.into(),
        not_found: false,
    }
}

fn not_found(message: impl Into<String>) -> Error {
    Error {
        message: message.into(),
        not_found: true,
    }
}

type Result<T> = std::result::Result<T, Error>;

struct ProcState {
    pid: u32,
    status: Status,
    exit_status: u32,
    oom_killed: bool,
    /// Set when the process can no longer run: deleted, or its start failed.
    gone: Option<Error>,
}

/// A container's init or exec process.
pub struct Process {
    /// "container c1" or "exec e1 of container c1", for messages.
    label: String,
    state: Mutex<ProcState>,
    changed: Condvar,
    stdio: Arc<ProcStdio>,
    /// An exec's child stdio ends, until it is started.
    child: Mutex<Option<ChildStdio>>,
}

impl Process {
    fn new(label: String, stdio: ProcStdio, child: Option<ChildStdio>, pid: u32) -> Arc<Process> {
        Arc::new(Process {
            label,
            state: Mutex::new(ProcState {
                pid,
                status: Status::Created,
                exit_status: 0,
                oom_killed: false,
                gone: None,
            }),
            changed: Condvar::new(),
            stdio: Arc::new(stdio),
            child: Mutex::new(child),
        })
    }

    fn exited(&self, status: u32, oom_killed: bool) {
        let mut st = lock(&self.state);
        st.status = Status::Stopped;
        st.exit_status = status;
        st.oom_killed = oom_killed;
        drop(st);
        self.changed.notify_all();
    }

    fn set_gone(&self, why: Error) {
        let mut st = lock(&self.state);
        if st.gone.is_none() {
            st.gone = Some(why);
        }
        drop(st);
        lock(&self.child).take();
        self.stdio.abandon();
        self.changed.notify_all();
    }

    /// Waits until stopped (then its exit) or gone (then why).
    fn wait(&self, timeout: Option<Duration>) -> Result<Exited> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = lock(&self.state);
        loop {
            if st.status == Status::Stopped {
                return Ok(Exited {
                    pid: st.pid,
                    exit_status: st.exit_status,
                    oom_killed: st.oom_killed,
                });
            }
            if let Some(why) = &st.gone {
                return Err(why.clone());
            }
            st = match deadline {
                None => self.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let Some(left) = d.checked_duration_since(Instant::now()) else {
                        return Err(fail(format!("{} did not exit in time", self.label)));
                    };
                    self.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }
}

/// A container.
struct Container {
    id: String,
    bundle: PathBuf,
    cgroup: PathBuf,
    mounts: RootfsMounts,
    binds: BindMounts,
    init: Arc<Process>,
    execs: Mutex<HashMap<String, Arc<Process>>>,
    /// Serialises runc commands that change the container.
    ops: Mutex<()>,
    /// A CRI pod sandbox: no image, no runc; its init is the stand-in
    /// ([`Config::stand_in`]).
    stand_in: bool,
    /// The VM itself ([`proto::THE_VM`]): no image, no runc, no init; its
    /// execs run directly in the VM's root (`crate::vmexec`).
    the_vm: bool,
    /// A pod sandbox's /dev/shm for its pod's containers (a tmpfs mounted
    /// at `<bundle>/shm`), when it could be made.
    shm: Option<PathBuf>,
    /// A started pod sandbox's IPC namespace, pinned by a bind mount at
    /// `<bundle>/ipcns` (as `ip netns` pins a network namespace): the pod's
    /// containers join it by this path, never by a pid that could be reused.
    ipc_ns: Mutex<Option<PathBuf>>,
}

/// The size of a pod's /dev/shm: containerd's default for a sandbox's.
const POD_SHM_OPTIONS: &str = "mode=1777,size=65536k";

#[derive(Default)]
struct Table {
    live: HashMap<String, Arc<Container>>,
    /// Ids being created.
    reserved: HashSet<String>,
}

/// Every container in the VM.
pub struct Containers {
    cfg: Config,
    reaper: Arc<Reaper>,
    table: Mutex<Table>,
    seq: AtomicU64,
    /// The VM itself, for execs outside any container (`k7d exec`).
    the_vm: Arc<Container>,
}

/// Whether `spec` is a CRI pod sandbox's (containerd's CRI plugin marks it).
fn is_pod_sandbox(spec: &Value) -> bool {
    spec.get("annotations")
        .and_then(|a| a.get(CONTAINER_TYPE))
        .and_then(Value::as_str)
        == Some("sandbox")
}

fn check_id(id: &str, what: &str) -> Result<()> {
    if proto::valid_id(id) {
        Ok(())
    } else {
        let shown: String = id.chars().take(80).collect();
        Err(fail(format!("{what} id {shown:?} is not a valid identifier")))
    }
}

fn read_pid(path: &Path) -> std::result::Result<u32, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {} failed: {e}", path.display()))?;
    match text.trim().parse::<u32>() {
        Ok(pid) if pid > 1 => Ok(pid),
        _ => Err(format!("{} does not hold a pid", path.display())),
    }
}

/// The message of the last error runc logged (its JSON log), or of its
/// last line.
pub fn runc_log_message(log: &str) -> Option<String> {
    let msg = |line: &str| -> Option<(bool, String)> {
        let v: Value = serde_json::from_str(line).ok()?;
        let m = v.get("msg")?.as_str()?.to_owned();
        Some((v.get("level").and_then(Value::as_str) == Some("error"), m))
    };
    let lines: Vec<&str> = log.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines
        .iter()
        .rev()
        .find_map(|l| msg(l).filter(|(err, _)| *err).map(|(_, m)| m))
        .or_else(|| lines.last().map(|l| msg(l).map_or_else(|| (*l).to_owned(), |(_, m)| m)))
}

fn read_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len > max {
        let _ = f.seek(SeekFrom::Start(len - max));
    }
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// A console socket runc sends a pty master to; removed on drop.
struct ConsoleSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl ConsoleSocket {
    /// Receives the master runc sent (runc has exited by now, so the
    /// connection and its message are already queued).
    fn receive(&self) -> std::result::Result<File, String> {
        let (conn, _) = self
            .listener
            .accept()
            .map_err(|e| format!("runc did not send the terminal: {e}"))?;
        conn.set_nonblocking(false)
            .map_err(|e| format!("the console socket failed: {e}"))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| format!("the console socket failed: {e}"))?;
        let fd = sys::recv_fd(&conn).map_err(|e| format!("receiving the terminal from runc failed: {e}"))?;
        Ok(File::from(fd))
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Containers {
    /// An empty registry; makes the state directories.
    pub fn new(cfg: Config, reaper: Arc<Reaper>) -> std::io::Result<Containers> {
        for d in ["c", "log", "s", "vm"] {
            std::fs::create_dir_all(cfg.state_dir.join(d))?;
        }
        let bundle = cfg.state_dir.join("vm");
        let (stdio, _) = ProcStdio::new(StdioSpec::default())?;
        let the_vm = Arc::new(Container {
            id: proto::THE_VM.to_owned(),
            mounts: RootfsMounts::under(&bundle),
            bundle,
            // None of its own: its execs are the VM's.
            cgroup: cfg.cgroup_root.clone(),
            binds: BindMounts::default(),
            init: Process::new("the VM itself".into(), stdio, None, 1),
            execs: Mutex::new(HashMap::new()),
            ops: Mutex::new(()),
            stand_in: false,
            the_vm: true,
            shm: None,
            ipc_ns: Mutex::new(None),
        });
        Ok(Containers {
            cfg,
            reaper,
            table: Mutex::new(Table::default()),
            seq: AtomicU64::new(0),
            the_vm,
        })
    }

    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `runc <args>` with `stdio` (or /dev/null), waits for it through
    /// the reaper, and turns a failure into runc's own last error message.
    fn runc(&self, args: &[OsString], stdio: Option<ChildStdio>) -> std::result::Result<(), String> {
        // Messages name the runtime as it is: "crun create failed ...".
        let name = self
            .cfg
            .runc
            .file_name()
            .map_or_else(|| "runc".into(), |n| n.to_string_lossy().into_owned());
        let sub = format!(
            "{name} {}",
            args.first().map(|a| a.to_string_lossy()).unwrap_or_default()
        );
        let log = self.cfg.state_dir.join("log").join(format!("{}.json", self.next()));
        let mut cmd = Command::new(&self.cfg.runc);
        cmd.arg("--root")
            .arg(&self.cfg.runc_root)
            .arg("--log")
            .arg(&log)
            .arg("--log-format")
            .arg("json");
        cmd.args(args).env("PATH", crate::init::PATH);
        stdio
            .unwrap_or(ChildStdio {
                stdin: None,
                stdout: None,
                stderr: None,
            })
            .apply(&mut cmd);
        // A program path (no PATH search) and no pre_exec hook keep std on
        // posix_spawn, which never waits for the child itself (the reaper
        // would race it).
        let pid = self.reaper.spawn(&mut cmd);
        // Dropping the command closes the agent's copies of the child's
        // stdio ends: from now on only the process holds them.
        drop(cmd);
        let pid = pid.map_err(|e| format!("starting {} failed: {e}", self.cfg.runc.display()))?;
        let status = match self.reaper.wait_for_timeout(pid, self.cfg.runc_timeout) {
            Some(s) => s,
            None => {
                let _ = sys::kill(pid, libc::SIGKILL);
                self.reaper.wait_for(pid);
                let _ = std::fs::remove_file(&log);
                return Err(format!(
                    "{sub} did not finish in {} s and was killed",
                    self.cfg.runc_timeout.as_secs()
                ));
            }
        };
        let text = read_tail(&log, 64 << 10);
        let _ = std::fs::remove_file(&log);
        if status == 0 {
            return Ok(());
        }
        let why = runc_log_message(&text).unwrap_or_else(|| "it logged nothing".into());
        Err(format!("{sub} failed with exit status {status}: {why}"))
    }

    fn console_socket(&self) -> std::result::Result<ConsoleSocket, String> {
        // A short path: a bundle path with long ids would pass sun_path's 108 bytes.
        let path = self.cfg.state_dir.join("s").join(format!("{}.sock", self.next()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .map_err(|e| format!("creating the console socket {} failed: {e}", path.display()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("creating the console socket failed: {e}"))?;
        Ok(ConsoleSocket { listener, path })
    }

    /// Records `proc`'s exit (and whether the cgroup counted an OOM kill
    /// since now) when the reaper collects `pid`.
    fn watch(&self, proc: &Arc<Process>, pid: u32, cgroup: &Path) {
        let baseline = cgroup::oom_kills(cgroup);
        let (p, cg) = (Arc::clone(proc), cgroup.to_path_buf());
        self.reaper.on_exit(pid as i32, move |status| {
            let oom = cgroup::oom_kills(&cg) > baseline;
            p.exited(status, oom);
        });
    }

    fn container(&self, id: &str) -> Result<Arc<Container>> {
        if id == proto::THE_VM {
            return Ok(Arc::clone(&self.the_vm));
        }
        check_id(id, "container")?;
        lock(&self.table)
            .live
            .get(id)
            .cloned()
            .ok_or_else(|| not_found(format!("container {id} does not exist")))
    }

    fn process(&self, r: &ProcessRef) -> Result<(Arc<Container>, Arc<Process>)> {
        let c = self.container(&r.container)?;
        let p = match &r.exec_id {
            None => Arc::clone(&c.init),
            Some(e) => {
                check_id(e, "exec")?;
                lock(&c.execs)
                    .get(e)
                    .cloned()
                    .ok_or_else(|| not_found(format!("exec {e} of container {} does not exist", c.id)))?
            }
        };
        Ok((c, p))
    }

    /// The reaper every child of the agent's is collected by.
    pub fn reaper(&self) -> &Reaper {
        &self.reaper
    }

    /// `CreateContainer`: mounts the rootfs, writes the bundle, `runc create`.
    pub fn create(&self, req: CreateContainer) -> Result<u32> {
        let CreateContainer {
            id,
            spec,
            rootfs,
            stdio,
            binds,
            node,
        } = req;
        check_id(&id, "container")?;
        if !disk::valid_serial(&rootfs.serial) {
            return Err(fail(format!("container {id}: the rootfs disk serial is not valid")));
        }
        if !disk::valid_fstype(&rootfs.fstype) {
            return Err(fail(format!("container {id}: the rootfs filesystem type is not valid")));
        }
        if let Some(b) = &binds {
            let spec_mounts = spec
                .get("mounts")
                .and_then(Value::as_array)
                .map_or(&[][..], Vec::as_slice);
            binds::check(b, spec_mounts).map_err(|e| fail(format!("container {id}: {e}")))?;
        }
        if let Some(node) = &node {
            let written = sysctl::apply(&self.cfg.proc_sys, node)
                .map_err(|e| fail(format!("container {id}: the node's limits: {e}")))?;
            if !written.is_empty() {
                crate::log!("container {id}: the node's {} set in the VM", written.join(", "));
            }
        }
        {
            let mut t = lock(&self.table);
            if t.live.contains_key(&id) || !t.reserved.insert(id.clone()) {
                return Err(fail(format!("container {id} already exists")));
            }
        }
        let made = if is_pod_sandbox(&spec) {
            self.create_stand_in(&id, &spec, stdio)
        } else {
            self.create_reserved(&id, spec, &rootfs, binds.as_ref(), stdio)
        };
        let mut t = lock(&self.table);
        t.reserved.remove(&id);
        let c = made?;
        let pid = lock(&c.init.state).pid;
        t.live.insert(id, c);
        Ok(pid)
    }

    /// The VM's hostname from a container's spec (PID 1 only).
    fn set_hostname(&self, id: &str, hostname: Option<&str>) {
        let Some(h) = hostname.filter(|_| self.cfg.set_hostname) else {
            return;
        };
        if h.is_empty() || h.len() > 64 {
            crate::log!("container {id}: the hostname is not 1 to 64 bytes; not set");
        } else if let Err(e) = sys::sethostname(h) {
            crate::log!("container {id}: setting the hostname failed: {e}");
        }
    }

    /// A CRI pod sandbox. In k7d the VM is the pod: the app containers get
    /// their network namespace from it (`spec::rewrite` drops the host's
    /// namespace paths), so the sandbox's image (the pause image) has
    /// nothing to run. Its process is a stand-in that [`Containers::start`]
    /// spawns in an IPC namespace of its own, which the pod's containers
    /// join, and that waits for a signal as the pause program does; no
    /// image is mounted and no runc runs (each runc command costs a pod
    /// start about a second on the lab's emulated machines). It also holds
    /// the pod's /dev/shm (a tmpfs every container of the pod binds, as
    /// under runc). The spec's hostname is the VM's.
    fn create_stand_in(&self, id: &str, spec: &Value, stdio: StdioSpec) -> Result<Arc<Container>> {
        let ctx = |what: String| fail(format!("pod sandbox {id}: {what}"));
        if stdio.terminal {
            return Err(ctx("a pod sandbox has no terminal".into()));
        }
        let (pstdio, child) = ProcStdio::new(stdio).map_err(|e| ctx(format!("making stdio pipes failed: {e}")))?;
        let bundle = self.cfg.state_dir.join("c").join(id);
        std::fs::create_dir(&bundle)
            .map_err(|e| ctx(format!("creating the bundle {} failed: {e}", bundle.display())))?;
        self.set_hostname(id, spec.get("hostname").and_then(Value::as_str));
        let shm = bundle.join("shm");
        let shm = match std::fs::create_dir(&shm).and_then(|()| {
            sys::mount(
                OsStr::new("shm"),
                &shm,
                "tmpfs",
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                Some(POD_SHM_OPTIONS),
            )
        }) {
            Ok(()) => Some(shm),
            Err(e) => {
                crate::log!("pod sandbox {id}: no pod-wide /dev/shm (each container gets its own): {e}");
                None
            }
        };
        crate::log!("pod sandbox {id}: a stand-in process, no image (the VM is the pod)");
        Ok(Arc::new(Container {
            id: id.to_owned(),
            mounts: RootfsMounts::under(&bundle),
            bundle,
            cgroup: self.cfg.cgroup_root.join("k7d").join(id),
            binds: BindMounts::default(),
            init: Process::new(format!("pod sandbox {id}"), pstdio, Some(child), 0),
            execs: Mutex::new(HashMap::new()),
            ops: Mutex::new(()),
            stand_in: true,
            the_vm: false,
            shm,
            ipc_ns: Mutex::new(None),
        }))
    }

    /// What a new container of this VM's pod shares: the running pod
    /// sandbox stand-in's IPC namespace and /dev/shm (none without one).
    fn pod(&self) -> Option<spec::Pod> {
        let t = lock(&self.table);
        t.live.values().filter(|c| c.stand_in).find_map(|c| {
            let st = lock(&c.init.state);
            (st.status == Status::Running && st.pid != 0).then(|| spec::Pod {
                ipc: lock(&c.ipc_ns).as_ref().map_or_else(
                    || format!("/proc/{}/ns/ipc", st.pid),
                    |pin| pin.to_string_lossy().into_owned(),
                ),
                shm: c.shm.as_ref().map(|p| p.to_string_lossy().into_owned()),
            })
        })
    }

    /// Starts a pod sandbox's stand-in in the sandbox's cgroup.
    fn start_stand_in(&self, c: &Container, p: &Arc<Process>) -> Result<u32> {
        let ctx = |what: String| fail(format!("{}: {what}", p.label));
        let (program, args) = self
            .cfg
            .stand_in
            .split_first()
            .ok_or_else(|| ctx("no stand-in program is configured".into()))?;
        let child = lock(&p.child)
            .take()
            .ok_or_else(|| ctx("it was already started".into()))?;
        let mut cmd = Command::new(program);
        cmd.args(args).env_clear().env("PATH", crate::init::PATH);
        sys::in_new_ipc_namespace(&mut cmd);
        child.apply(&mut cmd);
        let pid = self.reaper.spawn(&mut cmd);
        drop(cmd);
        let pid = pid.map_err(|e| ctx(format!("starting its process failed: {e}")))?;
        // Its own cgroup, as runc would give it (Pids, Stats): one it
        // cannot be moved into only costs those figures.
        if let Err(e) = cgroup::enter(&c.cgroup, pid) {
            crate::log!("{}: joining the cgroup {} failed: {e}", p.label, c.cgroup.display());
        }
        // Its IPC namespace, pinned while the child is ours and unreaped
        // (its pid cannot name another process yet).
        let pin = c.bundle.join("ipcns");
        let ns = format!("/proc/{pid}/ns/ipc");
        match std::fs::File::create(&pin).and_then(|_| sys::mount(OsStr::new(&ns), &pin, "none", libc::MS_BIND, None)) {
            Ok(()) => *lock(&c.ipc_ns) = Some(pin),
            Err(e) => crate::log!(
                "{}: pinning its IPC namespace at {} failed ({e}): the pod's containers join it by pid",
                p.label,
                pin.display()
            ),
        }
        // A spawned child's pid is positive.
        let pid = pid.unsigned_abs();
        {
            let mut st = lock(&p.state);
            st.pid = pid;
            st.status = Status::Running;
        }
        self.watch(p, pid, &c.cgroup);
        Ok(pid)
    }

    fn create_reserved(
        &self,
        id: &str,
        mut spec: Value,
        rootfs: &proto::BlockMount,
        binds: Option<&proto::Binds>,
        stdio: StdioSpec,
    ) -> Result<Arc<Container>> {
        let ctx = |what: String| fail(format!("container {id}: {what}"));
        let bundle = self.cfg.state_dir.join("c").join(id);
        std::fs::create_dir(&bundle)
            .map_err(|e| ctx(format!("creating the bundle {} failed: {e}", bundle.display())))?;
        let mut undo = Rollback {
            agent: self,
            id,
            bundle: bundle.clone(),
            mounts: None,
            binds: None,
            runc: false,
        };

        let disk = disk::wait_by_serial(&self.cfg.sysfs, &rootfs.serial, rootfs.sectors, self.cfg.disk_timeout)
            .ok_or_else(|| {
                ctx(format!(
                    "no disk with serial {} appeared in {:?}",
                    rootfs.serial, self.cfg.disk_timeout
                ))
            })?;
        let device = disk::device_node(&disk, &self.cfg.dev, &bundle.join("disk"))
            .map_err(|e| ctx(format!("making a device node for disk {} failed: {e}", disk.name)))?;
        let mounts = RootfsMounts::under(&bundle);
        mounts.mount(&device, &rootfs.fstype).map_err(ctx)?;
        undo.mounts = Some(RootfsMounts::under(&bundle));

        let carried = match binds {
            None => HashMap::new(),
            Some(b) => {
                let spec_mounts = spec
                    .get("mounts")
                    .and_then(Value::as_array)
                    .map_or(&[][..], Vec::as_slice);
                let disk = binds::wait_disk(&self.cfg.sysfs, b, self.cfg.disk_timeout).map_err(ctx)?;
                let device = disk::device_node(&disk, &self.cfg.dev, &bundle.join("binds-disk"))
                    .map_err(|e| ctx(format!("making a device node for disk {} failed: {e}", disk.name)))?;
                // Recorded in the rollback as each mount is made.
                undo.binds
                    .get_or_insert_with(BindMounts::default)
                    .mount(&bundle, &mounts.rw, &device, b, spec_mounts)
                    .map_err(ctx)?
            }
        };
        let bind_mounts = undo.binds.clone().unwrap_or_default();
        for (i, source) in &carried {
            crate::log!("container {id}: the host bind mount {i} is carried in from {source}");
        }

        let root = mounts.rootfs.to_string_lossy().into_owned();
        let pod = self.pod();
        let changed = spec::rewrite(&mut spec, id, &root, stdio.terminal, &carried, pod.as_ref()).map_err(ctx)?;
        if changed.pod_ipc || changed.pod_shm {
            crate::log!(
                "container {id}: joins its pod's{}{}",
                if changed.pod_ipc { " IPC namespace" } else { "" },
                if changed.pod_shm { " /dev/shm" } else { "" }
            );
        }
        for m in &changed.dropped_mounts {
            crate::log!("container {id}: dropped the host bind mount at {m} (host paths do not exist in the guest)");
        }
        if !changed.dropped_namespace_paths.is_empty() {
            crate::log!(
                "container {id}: dropped host namespace paths of {:?}",
                changed.dropped_namespace_paths
            );
        }
        self.set_hostname(id, changed.hostname.as_deref());
        let config = serde_json::to_vec(&spec).map_err(|e| ctx(format!("encoding config.json failed: {e}")))?;
        std::fs::write(bundle.join("config.json"), config)
            .map_err(|e| ctx(format!("writing config.json failed: {e}")))?;

        let (pstdio, child) = ProcStdio::new(stdio).map_err(|e| ctx(format!("making stdio pipes failed: {e}")))?;
        let console = if stdio.terminal {
            Some(self.console_socket().map_err(ctx)?)
        } else {
            None
        };
        let pid_file = bundle.join("init.pid");
        let mut args: Vec<OsString> = vec![
            "create".into(),
            "--bundle".into(),
            bundle.clone().into(),
            "--pid-file".into(),
            pid_file.clone().into(),
        ];
        if let Some(c) = &console {
            args.extend(["--console-socket".into(), c.path.clone().into()]);
        }
        if self.cfg.no_pivot {
            args.push("--no-pivot".into());
        }
        args.push(id.into());
        undo.runc = true;
        self.runc(&args, Some(child)).map_err(ctx)?;
        let pid = read_pid(&pid_file).map_err(ctx)?;
        if let Some(c) = &console {
            let master = c.receive().map_err(ctx)?;
            pstdio
                .set_pty(master)
                .map_err(|e| ctx(format!("duplicating the terminal failed: {e}")))?;
        }
        drop(console);

        let cgroup = self.cfg.cgroup_root.join("k7d").join(id);
        let init = Process::new(format!("container {id}"), pstdio, None, pid);
        self.watch(&init, pid, &cgroup);
        undo.disarm();
        Ok(Arc::new(Container {
            id: id.to_owned(),
            bundle,
            cgroup,
            mounts,
            binds: bind_mounts,
            init,
            execs: Mutex::new(HashMap::new()),
            ops: Mutex::new(()),
            stand_in: false,
            the_vm: false,
            shm: None,
            ipc_ns: Mutex::new(None),
        }))
    }

    /// `Start`: `runc start` for the init, `runc exec --detach` for an exec.
    pub fn start(&self, r: &ProcessRef) -> Result<u32> {
        let (c, p) = self.process(r)?;
        let _ops = lock(&c.ops);
        {
            let st = lock(&p.state);
            if let Some(why) = &st.gone {
                return Err(why.clone());
            }
            if st.status != Status::Created || (r.exec_id.is_some() && st.pid != 0) {
                return Err(fail(format!("{} was already started", p.label)));
            }
        }
        match &r.exec_id {
            None if c.the_vm => Err(fail("the VM itself has no init process to start: exec in it")),
            Some(eid) if c.the_vm => self.start_vm_exec(&c, &p, eid).inspect_err(|e| p.set_gone(e.clone())),
            None if c.stand_in => self.start_stand_in(&c, &p).inspect_err(|e| p.set_gone(e.clone())),
            None => {
                self.runc(&["start".into(), c.id.clone().into()], None)
                    .map_err(|e| fail(format!("{}: {e}", p.label)))?;
                let mut st = lock(&p.state);
                if st.status == Status::Created {
                    st.status = Status::Running;
                }
                Ok(st.pid)
            }
            Some(eid) => self.start_exec(&c, &p, eid).inspect_err(|e| p.set_gone(e.clone())),
        }
    }

    fn start_exec(&self, c: &Container, p: &Arc<Process>, eid: &str) -> Result<u32> {
        let ctx = |what: String| fail(format!("{}: {what}", p.label));
        let child = lock(&p.child)
            .take()
            .ok_or_else(|| ctx("it was already started".into()))?;
        let console = if p.stdio.terminal() {
            Some(self.console_socket().map_err(ctx)?)
        } else {
            None
        };
        let pid_file = c.bundle.join(format!("exec-{eid}.pid"));
        let mut args: Vec<OsString> = vec![
            "exec".into(),
            "--detach".into(),
            "--pid-file".into(),
            pid_file.clone().into(),
            "--process".into(),
            c.bundle.join(format!("exec-{eid}.json")).into(),
        ];
        if let Some(s) = &console {
            args.extend(["--console-socket".into(), s.path.clone().into()]);
        }
        args.push(c.id.clone().into());
        self.runc(&args, Some(child)).map_err(ctx)?;
        let pid = read_pid(&pid_file).map_err(ctx)?;
        if let Some(s) = &console {
            let master = s.receive().map_err(ctx)?;
            p.stdio
                .set_pty(master)
                .map_err(|e| ctx(format!("duplicating the terminal failed: {e}")))?;
        }
        {
            let mut st = lock(&p.state);
            st.pid = pid;
            st.status = Status::Running;
        }
        self.watch(p, pid, &c.cgroup);
        Ok(pid)
    }

    /// Starts an exec in the VM itself: its process spec checked again (the
    /// VM may have changed since the exec was registered) and run directly.
    fn start_vm_exec(&self, c: &Container, p: &Arc<Process>, eid: &str) -> Result<u32> {
        let ctx = |what: String| fail(format!("{}: {what}", p.label));
        let path = c.bundle.join(format!("exec-{eid}.json"));
        let spec: Value = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            .map_err(|e| ctx(format!("reading {} failed: {e}", path.display())))?;
        let plan = crate::vmexec::plan(&spec, crate::init::PATH).map_err(ctx)?;
        let child = lock(&p.child)
            .take()
            .ok_or_else(|| ctx("it was already started".into()))?;
        let mut cmd = crate::vmexec::command(&plan);
        child.apply(&mut cmd);
        // With a terminal: a pty's peer is its stdin, stdout and stderr (and,
        // after its setsid, its controlling terminal); the master goes to
        // the process's relays, as runc's console does for a container.
        let master = if plan.terminal {
            let (master, peer) = sys::open_pty().map_err(|e| ctx(format!("opening a terminal failed: {e}")))?;
            let dup = |f: &File| {
                f.try_clone()
                    .map(std::process::Stdio::from)
                    .map_err(|e| ctx(format!("duplicating the terminal failed: {e}")))
            };
            cmd.stdin(dup(&peer)?)
                .stdout(dup(&peer)?)
                .stderr(std::process::Stdio::from(peer));
            Some(master)
        } else {
            None
        };
        let pid = self.reaper.spawn(&mut cmd);
        // The agent's copies of the child's stdio ends close here (the pty's
        // peer too: the master then sees EOF when the process is gone).
        drop(cmd);
        let pid = pid
            .map_err(|e| ctx(format!("starting {} failed: {e}", plan.program.display())))?
            .unsigned_abs();
        if let Some(m) = master
            && let Err(e) = p.stdio.set_pty(m)
        {
            // Its output cannot be relayed: the relays end rather than wait.
            crate::log!("{}: handing its terminal to the relays failed: {e}", p.label);
            p.stdio.abandon();
        }
        {
            let mut st = lock(&p.state);
            st.pid = pid;
            st.status = Status::Running;
        }
        self.watch(p, pid, &c.cgroup);
        crate::log!(
            "{}: {} as {}:{}, pid {pid}",
            p.label,
            plan.program.display(),
            plan.uid,
            plan.gid
        );
        Ok(pid)
    }

    /// `Exec`: registers an exec (started by [`Containers::start`]).
    pub fn exec(&self, req: Exec) -> Result<()> {
        let Exec {
            process,
            mut spec,
            stdio,
        } = req;
        let c = self.container(&process.container)?;
        let Some(eid) = process.exec_id else {
            return Err(fail(format!("an exec in container {} needs an exec id", c.id)));
        };
        check_id(&eid, "exec")?;
        if c.stand_in {
            return Err(fail(format!(
                "container {} is a pod sandbox: k7d runs no program of its image (the VM is the pod)",
                c.id
            )));
        }
        let label = if c.the_vm {
            format!("exec {eid} in the VM")
        } else {
            format!("exec {eid} of container {}", c.id)
        };
        if c.the_vm {
            // Refused now rather than at its start: a bad spec or a
            // program the VM lacks is this request's error.
            crate::vmexec::plan(&spec, crate::init::PATH).map_err(|e| fail(format!("{label}: {e}")))?;
        }
        let obj = spec
            .as_object_mut()
            .ok_or_else(|| fail(format!("{label}: the process spec is not a JSON object")))?;
        obj.insert("terminal".into(), Value::Bool(stdio.terminal));
        let mut execs = lock(&c.execs);
        if execs.contains_key(&eid) {
            return Err(fail(format!("{label} already exists")));
        }
        // An exec in the VM itself whose client went away before deleting
        // it (a `k7d exec` killed) is nobody's to delete: once it exited,
        // it makes room instead of filling the table for good.
        if c.the_vm && execs.len() >= MAX_EXECS {
            let gone: Vec<String> = execs
                .iter()
                .filter(|(_, p)| lock(&p.state).status == Status::Stopped)
                .map(|(e, _)| e.clone())
                .collect();
            for e in gone {
                execs.remove(&e);
                let _ = std::fs::remove_file(c.bundle.join(format!("exec-{e}.json")));
            }
        }
        if execs.len() >= MAX_EXECS {
            return Err(fail(format!(
                "container {} has {MAX_EXECS} execs; delete some first",
                c.id
            )));
        }
        let json = serde_json::to_vec(&spec).map_err(|e| fail(format!("{label}: encoding the process failed: {e}")))?;
        let path = c.bundle.join(format!("exec-{eid}.json"));
        std::fs::write(&path, json).map_err(|e| fail(format!("{label}: writing {} failed: {e}", path.display())))?;
        let (pstdio, child) =
            ProcStdio::new(stdio).map_err(|e| fail(format!("{label}: making stdio pipes failed: {e}")))?;
        execs.insert(eid, Process::new(label, pstdio, Some(child), 0));
        Ok(())
    }

    /// `Wait`: blocks until the process exits.
    pub fn wait(&self, r: &ProcessRef) -> Result<Exited> {
        let (_, p) = self.process(r)?;
        p.wait(None)
    }

    /// `Signal`.
    pub fn signal(&self, r: &ProcessRef, signal: i32, all: bool) -> Result<()> {
        if !(1..=64).contains(&signal) {
            return Err(fail(format!("signal {signal} is not in 1..=64")));
        }
        let (c, p) = self.process(r)?;
        if all && !c.stand_in && !c.the_vm {
            return self
                .runc(
                    &[
                        "kill".into(),
                        "--all".into(),
                        c.id.clone().into(),
                        signal.to_string().into(),
                    ],
                    None,
                )
                .map_err(|e| fail(format!("container {}: {e}", c.id)));
        }
        // The state lock is held across kill(2), so the exit cannot be
        // recorded (and the pid reused) in between.
        let st = lock(&p.state);
        if st.status == Status::Stopped {
            return Err(not_found(format!("{} has already exited", p.label)));
        }
        if st.pid == 0 {
            return Err(not_found(format!("{} has not been started", p.label)));
        }
        match sys::kill(st.pid as i32, signal) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                Err(not_found(format!("{} has already exited", p.label)))
            }
            Err(e) => Err(fail(format!("signalling {} failed: {e}", p.label))),
        }
    }

    /// `State`.
    pub fn state(&self, r: &ProcessRef) -> Result<ProcessState> {
        let (_, p) = self.process(r)?;
        let st = lock(&p.state);
        Ok(ProcessState {
            pid: st.pid,
            status: st.status,
            exit_status: st.exit_status,
        })
    }

    /// `Network`: the pod's address, MTU and default route on the VM's NIC
    /// (`crate::net`); the containers share the VM's network namespace.
    pub fn network(&self, n: &k7d_agent::proto::Network) -> Result<()> {
        let plan = crate::net::plan(n, &self.cfg.sysfs.join("class/net")).map_err(fail)?;
        crate::net::apply(&plan).map_err(fail)?;
        crate::log!(
            "network: {} {}/{} via {:?}",
            plan.interface,
            plan.address,
            plan.prefix,
            plan.gateway
        );
        Ok(())
    }

    /// `Identity`: a fork child's own entropy, clock and machine-id
    /// (`crate::identity`); the kernel's RNG and clock are touched only
    /// by the agent as PID 1 (a host-side test checks the plan and the
    /// machine-id file alone).
    pub fn identity(&self, id: &k7d_agent::proto::Identity) -> Result<()> {
        let plan = crate::identity::plan(id).map_err(fail)?;
        let etc = if self.cfg.set_hostname {
            std::path::PathBuf::from("/etc")
        } else {
            self.cfg.state_dir.join("etc")
        };
        crate::identity::apply(&plan, &etc, self.cfg.set_hostname).map_err(fail)?;
        crate::log!(
            "identity: entropy {} bytes, machine-id {}",
            plan.entropy.len(),
            plan.machine_id
        );
        Ok(())
    }

    /// `Reseed`: the entropy credited and the kernel's RNG reseeded, the
    /// VM's own or a pod's alike (the kernel is the VM's).
    pub fn reseed(&self, entropy: &[u8]) -> Result<()> {
        crate::identity::check_entropy(entropy).map_err(fail)?;
        crate::identity::reseed(entropy).map_err(fail)?;
        crate::log!("reseed: entropy {} bytes", entropy.len());
        Ok(())
    }

    /// `Pids`: the container cgroup's processes.
    pub fn pids(&self, id: &str) -> Result<Vec<u32>> {
        Ok(cgroup::pids(&self.container(id)?.cgroup))
    }

    /// `ResizePty`.
    pub fn resize(&self, r: &ProcessRef, width: u32, height: u32) -> Result<()> {
        let (_, p) = self.process(r)?;
        let (Ok(w), Ok(h)) = (u16::try_from(width), u16::try_from(height)) else {
            return Err(fail(format!("a terminal size of {width}x{height} is too large")));
        };
        p.stdio.resize(w, h).map_err(|e| fail(format!("{}: {e}", p.label)))
    }

    /// `CloseStdin`.
    pub fn close_stdin(&self, r: &ProcessRef) -> Result<()> {
        self.process(r)?.1.stdio.close_stdin();
        Ok(())
    }

    /// `Stats`.
    pub fn stats(&self, id: &str) -> Result<CgroupStats> {
        Ok(cgroup::stats(&self.container(id)?.cgroup))
    }

    /// `Update`: `runc update --resources`.
    pub fn update(&self, id: &str, resources: &Value) -> Result<()> {
        let c = self.container(id)?;
        if !resources.is_object() {
            return Err(fail(format!("container {id}: the resources are not a JSON object")));
        }
        if c.stand_in || c.the_vm {
            return Err(fail(format!(
                "container {id:?} is a pod sandbox or the VM itself: its resources are the VM's"
            )));
        }
        let _ops = lock(&c.ops);
        let path = c.bundle.join(format!("update-{}.json", self.next()));
        let body = serde_json::to_vec(resources).map_err(|e| fail(format!("container {id}: {e}")))?;
        std::fs::write(&path, body)
            .map_err(|e| fail(format!("container {id}: writing {} failed: {e}", path.display())))?;
        let r = self.runc(
            &["update".into(), "--resources".into(), path.clone().into(), id.into()],
            None,
        );
        let _ = std::fs::remove_file(&path);
        r.map_err(|e| fail(format!("container {id}: {e}")))
    }

    /// `DeleteExec`: forgets an exec that is not running.
    pub fn delete_exec(&self, r: &ProcessRef) -> Result<()> {
        let (c, p) = self.process(r)?;
        let Some(eid) = &r.exec_id else {
            return Err(fail(format!(
                "deleting container {}'s init needs DeleteContainer",
                c.id
            )));
        };
        if lock(&p.state).status == Status::Running {
            return Err(fail(format!("{} is still running", p.label)));
        }
        p.set_gone(not_found(format!("{} was deleted", p.label)));
        lock(&c.execs).remove(eid);
        for f in [format!("exec-{eid}.json"), format!("exec-{eid}.pid")] {
            let _ = std::fs::remove_file(c.bundle.join(f));
        }
        Ok(())
    }

    /// `DeleteContainer`: kills what is left, unmounts, forgets.
    pub fn delete(&self, id: &str) -> Result<()> {
        check_id(id, "container")?;
        let c = lock(&self.table)
            .live
            .remove(id)
            .ok_or_else(|| not_found(format!("container {id} does not exist")))?;
        let _ops = lock(&c.ops);
        if c.stand_in {
            let st = lock(&c.init.state);
            if st.status == Status::Running && st.pid != 0 {
                let _ = sys::kill(st.pid as i32, libc::SIGKILL);
            }
        } else if let Err(e) = self.runc(&["delete".into(), "--force".into(), id.into()], None) {
            crate::log!("container {id}: {e}");
        }
        // A stand-in never started has no process to wait for.
        let started = lock(&c.init.state).pid != 0;
        if (started || !c.stand_in)
            && let Err(e) = c.init.wait(Some(DELETE_WAIT))
            && lock(&c.init.state).gone.is_none()
        {
            crate::log!("{}", e.message);
        }
        let why = not_found(format!("container {id} was deleted"));
        c.init.set_gone(why.clone());
        for p in lock(&c.execs).drain().map(|(_, p)| p) {
            p.set_gone(why.clone());
        }
        if c.stand_in {
            // runc removes the cgroups of its containers; this one is the agent's.
            let _ = std::fs::remove_dir(&c.cgroup);
        }
        // The pod's IPC namespace pin: detached, as the pod's containers may
        // still be in it.
        let pin = lock(&c.ipc_ns).clone();
        if let Some(pin) = pin {
            if let Err(e) = sys::umount_detach(&pin) {
                crate::log!(
                    "container {id}: unmounting the pin of the pod's IPC namespace {} failed: {e}",
                    pin.display()
                );
                return Err(fail(format!(
                    "pod sandbox {id} was deleted but the pin of its IPC namespace is left in the VM"
                )));
            }
            *lock(&c.ipc_ns) = None;
        }
        // The pod's /dev/shm: detached, as a container of the pod may still
        // hold it; its memory goes with the last user.
        if let Some(shm) = &c.shm
            && let Err(e) = sys::umount_detach(shm)
        {
            crate::log!(
                "container {id}: unmounting the pod's /dev/shm {} failed: {e}",
                shm.display()
            );
            return Err(fail(format!(
                "pod sandbox {id} was deleted but its /dev/shm is left in the VM"
            )));
        }
        // The binds' overlays sit on the rootfs's writable tmpfs: first.
        let binds_clean = c.binds.unmount();
        if c.mounts.unmount() && binds_clean {
            if let Err(e) = std::fs::remove_dir_all(&c.bundle) {
                crate::log!("container {id}: removing {} failed: {e}", c.bundle.display());
            }
        } else {
            crate::log!(
                "container {id}: the bundle {} is kept (a mount is left)",
                c.bundle.display()
            );
            return Err(fail(format!(
                "container {id} was deleted but a mount of its images is left in the VM: its drives must not take another medium"
            )));
        }
        Ok(())
    }

    /// `Attach`: claims the stream (the caller answers, then relays).
    pub fn attach(&self, r: &ProcessRef, stream: Stream) -> Result<Attach> {
        let (_, p) = self.process(r)?;
        p.stdio.claim(stream).map_err(|e| fail(format!("{}: {e}", p.label)))
    }
}

/// Undoes a half-made container on drop unless disarmed.
struct Rollback<'a> {
    agent: &'a Containers,
    id: &'a str,
    bundle: PathBuf,
    mounts: Option<RootfsMounts>,
    binds: Option<BindMounts>,
    /// `runc create` was run (so `runc delete --force`).
    runc: bool,
}

impl Rollback<'_> {
    fn disarm(mut self) {
        self.mounts = None;
        self.binds = None;
        self.runc = false;
        self.bundle = PathBuf::new();
    }
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if self.bundle.as_os_str().is_empty() {
            return;
        }
        if self.runc
            && let Err(e) = self
                .agent
                .runc(&["delete".into(), "--force".into(), self.id.into()], None)
        {
            crate::log!("container {}: rolling back: {e}", self.id);
        }
        let binds_clean = self.binds.as_ref().is_none_or(BindMounts::unmount);
        let clean = self.mounts.as_ref().is_none_or(RootfsMounts::unmount) && binds_clean;
        if clean {
            let _ = std::fs::remove_dir_all(&self.bundle);
        } else {
            crate::log!(
                "container {}: rolling back left {} (a mount is left)",
                self.id,
                self.bundle.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn crun_is_taken_before_runc_wherever_each_lies() {
        let dir = std::env::temp_dir().join(format!("k7d-agent-rt-{}", std::process::id()));
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let dirs = [a.clone(), b.clone()];
        assert_eq!(runtime_in(&dirs), None);
        std::fs::write(a.join("runc"), b"elf").unwrap();
        assert_eq!(runtime_in(&dirs), Some(a.join("runc")));
        // crun in a later folder still wins over runc in an earlier one.
        std::fs::write(b.join("crun"), b"elf").unwrap();
        assert_eq!(runtime_in(&dirs), Some(b.join("crun")));
        // A folder named crun is no runtime.
        std::fs::remove_file(b.join("crun")).unwrap();
        std::fs::create_dir(b.join("crun")).unwrap();
        assert_eq!(runtime_in(&dirs), Some(a.join("runc")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn runcs_last_error_is_found_in_its_json_log() {
        let log = concat!(
            r#"{"level":"info","msg":"starting","time":"t"}"#,
            "\n",
            r#"{"level":"error","msg":"container_linux.go:380: starting container process caused: exec: \"nope\": executable file not found in $PATH","time":"t"}"#,
            "\n",
            r#"{"level":"warning","msg":"later","time":"t"}"#,
            "\n"
        );
        assert_eq!(
            runc_log_message(log).unwrap(),
            "container_linux.go:380: starting container process caused: exec: \"nope\": executable file not found in $PATH"
        );
        assert_eq!(runc_log_message("plain text\n").unwrap(), "plain text");
        assert_eq!(
            runc_log_message(r#"{"level":"info","msg":"only info"}"#).unwrap(),
            "only info"
        );
        assert_eq!(runc_log_message("\n\n"), None);
    }

    fn agent(tag: &str) -> (Containers, PathBuf) {
        let dir = std::env::temp_dir().join(format!("k7d-agent-ct-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = Config::for_tests(&dir, Duration::from_millis(100));
        (Containers::new(cfg, Reaper::new()).unwrap(), dir)
    }

    fn pref(c: &str, e: Option<&str>) -> ProcessRef {
        ProcessRef {
            container: c.into(),
            exec_id: e.map(Into::into),
        }
    }

    #[test]
    fn unknown_and_invalid_ids_are_told_apart() {
        let (a, dir) = agent("ids");
        let e = a.state(&pref("nope", None)).unwrap_err();
        assert!(e.not_found, "{e:?}");
        assert!(e.message.contains("nope"));
        let e = a.state(&pref("../etc", None)).unwrap_err();
        assert!(!e.not_found && e.message.contains("not a valid identifier"), "{e:?}");
        assert!(a.delete("gone").unwrap_err().not_found);
        assert!(!a.signal(&pref("c", None), 0, false).unwrap_err().not_found);
        assert!(!a.signal(&pref("c", None), 65, false).unwrap_err().not_found);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Runs `args` in the VM itself (as `user` when the test runs as root)
    /// and returns its exit status, stdout and stderr.
    fn run_in_the_vm(a: &Containers, eid: &str, spec: Value) -> (u32, String, String) {
        let r = pref(proto::THE_VM, Some(eid));
        a.exec(Exec {
            process: r.clone(),
            spec,
            stdio: StdioSpec {
                terminal: false,
                stdin: false,
                stdout: true,
                stderr: true,
            },
        })
        .unwrap();
        let read = |stream| {
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            let att = a.attach(&r, stream).unwrap();
            let relay = std::thread::spawn(move || att.relay(theirs));
            std::thread::spawn(move || {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut &ours, &mut s).unwrap();
                relay.join().unwrap();
                s
            })
        };
        let (out, err) = (read(Stream::Stdout), read(Stream::Stderr));
        let pid = a.start(&r).unwrap();
        let raw = sys::wait_pid(pid as i32).unwrap();
        a.reaper.record(pid as i32, crate::reaper::decode_status(raw));
        let status = a.wait(&r).unwrap().exit_status;
        let (out, err) = (out.join().unwrap(), err.join().unwrap());
        a.delete_exec(&r).unwrap();
        assert!(a.state(&r).unwrap_err().not_found, "a deleted exec is gone");
        (status, out, err)
    }

    /// Runs `spec` in the VM itself on a terminal (`k7d exec --tty`): its
    /// exit status and what the pty's master read (stdout and stderr both).
    fn run_in_the_vm_on_a_terminal(a: &Containers, eid: &str, spec: Value) -> (u32, String) {
        let r = pref(proto::THE_VM, Some(eid));
        a.exec(Exec {
            process: r.clone(),
            spec,
            stdio: StdioSpec {
                terminal: true,
                stdin: false,
                stdout: true,
                stderr: false,
            },
        })
        .unwrap();
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let att = a.attach(&r, Stream::Stdout).unwrap();
        let relay = std::thread::spawn(move || att.relay(theirs));
        let out = std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = std::io::Read::read_to_end(&mut &ours, &mut b);
            relay.join().unwrap();
            String::from_utf8_lossy(&b).into_owned()
        });
        let pid = a.start(&r).unwrap();
        let raw = sys::wait_pid(pid as i32).unwrap();
        a.reaper.record(pid as i32, crate::reaper::decode_status(raw));
        let status = a.wait(&r).unwrap().exit_status;
        let out = out.join().unwrap();
        a.delete_exec(&r).unwrap();
        (status, out)
    }

    #[test]
    fn an_exec_in_the_vm_itself_on_a_terminal_has_the_pty_as_its_controlling_terminal() {
        let _children = crate::test_children();
        let (a, dir) = agent("thevm-tty");
        let (status, out) = run_in_the_vm_on_a_terminal(
            &a,
            "t1",
            serde_json::json!({"args": ["sh", "-c",
                "tty; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-three; echo err >&2; read -r _ _ _ _ _ _ t _ </proc/self/stat; echo tty_nr=$t; exit 4"]}),
        );
        assert_eq!(status, 4, "{out}");
        let lines: Vec<&str> = out.split("\r\n").collect();
        assert!(lines[0].starts_with("/dev/pts/"), "tty names a pty: {out:?}");
        assert!(
            lines.contains(&"all-three") && lines.contains(&"err"),
            "stdin, stdout, stderr on it: {out:?}"
        );
        let nr = lines.iter().find_map(|l| l.strip_prefix("tty_nr=")).unwrap_or("0");
        assert_ne!(nr, "0", "the pty is the session's controlling terminal: {out:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_exec_in_the_vm_itself_runs_without_a_container_or_runc() {
        let _children = crate::test_children();
        let (a, dir) = agent("thevm");
        let (status, out, err) = run_in_the_vm(
            &a,
            "e1",
            serde_json::json!({"args": ["sh", "-c", "echo out; echo \"$A\" >&2; pwd; exit 7"], "env": ["A=from-env"], "cwd": "/tmp"}),
        );
        assert_eq!((status, out.as_str(), err.as_str()), (7, "out\n/tmp\n", "from-env\n"));
        // A signal is 128 + its number.
        let (status, _, _) = run_in_the_vm(&a, "e2", serde_json::json!({"args": ["sh", "-c", "kill -TERM $$"]}));
        assert_eq!(status, 143);
        if sys::is_root() {
            let (status, out, _) = run_in_the_vm(
                &a,
                "e3",
                serde_json::json!({"args": ["sh", "-c", "id -u; id -g; id -G"], "user": {"uid": 65534, "gid": 65533}}),
            );
            assert_eq!(
                (status, out.as_str()),
                (0, "65534\n65533\n65533\n"),
                "its user, no other group"
            );
        }
        // Refused when added, not when started: what the VM cannot run.
        let exec = |eid: &str, spec: Value, terminal: bool| {
            a.exec(Exec {
                process: pref(proto::THE_VM, Some(eid)),
                spec,
                stdio: StdioSpec {
                    terminal,
                    ..StdioSpec::default()
                },
            })
        };
        let e = exec("x1", serde_json::json!({"args": ["no-such-program-k7d"]}), false).unwrap_err();
        assert!(
            e.message.contains("exec x1 in the VM: no-such-program-k7d: not found"),
            "{e:?}"
        );
        // A terminal is served (`k7d exec --tty`), not refused.
        exec("x2", serde_json::json!({"args": ["sh"]}), true).unwrap();
        a.delete_exec(&pref(proto::THE_VM, Some("x2"))).unwrap();
        let e = exec("x3", serde_json::json!({"args": ["sh"], "capabilities": {}}), false).unwrap_err();
        assert!(e.message.contains("not capabilities"), "{e:?}");
        assert!(
            a.state(&pref(proto::THE_VM, Some("x1"))).unwrap_err().not_found,
            "a refused exec is not kept"
        );
        // Execs whose client never deleted them: a full table of exited
        // ones makes room; of running (or never started) ones, it refuses.
        let full = |status: Option<u32>| {
            let mut execs = lock(&a.the_vm.execs);
            execs.clear();
            for i in 0..MAX_EXECS {
                let (stdio, _) = ProcStdio::new(StdioSpec::default()).unwrap();
                let p = Process::new(format!("leaked {i}"), stdio, None, 0);
                if let Some(s) = status {
                    p.exited(s, false);
                }
                execs.insert(format!("leaked{i}"), p);
            }
        };
        let spec = || serde_json::json!({"args": ["true"]});
        full(None);
        let e = exec("y1", spec(), false).unwrap_err();
        assert!(e.message.contains("1024 execs"), "{e:?}");
        full(Some(0));
        exec("y2", spec(), false).unwrap();
        assert_eq!(lock(&a.the_vm.execs).len(), 1, "the exited ones made room");
        lock(&a.the_vm.execs).clear();
        // The VM itself is no container: nothing to start, delete or update.
        assert!(
            a.start(&pref(proto::THE_VM, None))
                .unwrap_err()
                .message
                .contains("no init process")
        );
        assert!(a.delete(proto::THE_VM).is_err());
        assert!(a.update(proto::THE_VM, &serde_json::json!({})).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_pod_sandbox_runs_a_stand_in_without_its_image_or_runc() {
        let _children = crate::test_children();
        let (a, dir) = agent("sandbox");
        let spec = serde_json::json!({
            "process": {"args": ["/pause"]},
            "annotations": {CONTAINER_TYPE: "sandbox"},
        });
        let req = CreateContainer {
            id: "sb".into(),
            spec,
            // No such disk exists: a sandbox never waits for its image.
            rootfs: proto::BlockMount {
                serial: "k7d-disk0".into(),
                fstype: "erofs".into(),
                sectors: None,
            },
            stdio: StdioSpec::default(),
            binds: None,
            node: None,
        };
        let mut tty = req.clone();
        tty.id = "tty".into();
        tty.stdio.terminal = true;
        assert!(a.create(tty).unwrap_err().message.contains("no terminal"));
        assert_eq!(a.create(req.clone()).unwrap(), 0, "nothing runs before Start");
        assert!(dir.join("state/c/sb").is_dir());
        assert_eq!(a.state(&pref("sb", None)).unwrap().status, Status::Created);
        assert_eq!(a.pod(), None, "no pod to join before the stand-in runs");
        let shm = dir.join("state/c/sb/shm");
        assert_eq!(
            sys::fs_magic(&shm).unwrap(),
            libc::TMPFS_MAGIC,
            "the pod's /dev/shm is a tmpfs"
        );
        let exec = Exec {
            process: pref("sb", Some("e1")),
            spec: serde_json::json!({"args": ["true"]}),
            stdio: StdioSpec::default(),
        };
        assert!(a.exec(exec).unwrap_err().message.contains("pod sandbox"));

        let pid = a.start(&pref("sb", None)).unwrap();
        assert!(pid > 0);
        assert!(a.start(&pref("sb", None)).is_err(), "started once");
        let st = a.state(&pref("sb", None)).unwrap();
        assert_eq!((st.pid, st.status), (pid, Status::Running));
        // (A vfork parent resumes before the child's exec renames it.)
        let comm = || std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while comm().trim() != "sleep" && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(comm().trim(), "sleep", "the configured stand-in runs, no runc");
        assert_eq!(cgroup::pids(&dir.join("cg/k7d/sb")), [pid], "in the sandbox's cgroup");
        // It holds an IPC namespace of its own, which the pod's containers join.
        let ipc = format!("/proc/{pid}/ns/ipc");
        assert_ne!(
            std::fs::read_link(&ipc).unwrap(),
            std::fs::read_link("/proc/self/ns/ipc").unwrap(),
            "the stand-in's IPC namespace is not the agent's"
        );
        let pod = a.pod().expect("a running stand-in is a pod to join");
        // Its namespace is pinned in the bundle, not named by its pid.
        assert_eq!(pod.ipc, dir.join("state/c/sb/ipcns").to_str().unwrap());
        let ino = |p: &str| {
            let m = std::fs::metadata(p).unwrap();
            (m.dev(), m.ino())
        };
        assert_eq!(ino(&pod.ipc), ino(&ipc), "the pin is the stand-in's IPC namespace");
        assert_eq!(pod.shm.as_deref(), shm.to_str());

        // `kill --all` on a sandbox signals its one process.
        a.signal(&pref("sb", None), libc::SIGKILL, true).unwrap();
        let raw = sys::wait_pid(pid as i32).unwrap();
        a.reaper.record(pid as i32, crate::reaper::decode_status(raw));
        assert_eq!(a.wait(&pref("sb", None)).unwrap().exit_status, 137);
        assert_eq!(a.pod(), None, "a stand-in that exited holds nothing to join");
        a.delete("sb").unwrap();
        assert!(
            !dir.join("state/c/sb").exists(),
            "the bundle (and its /dev/shm mount) is removed"
        );
        assert!(a.state(&pref("sb", None)).unwrap_err().not_found);

        // The node's limits are written before the container is made; a
        // limit the agent may not set fails the create and makes nothing.
        let threads_max = dir.join("proc-sys/kernel/threads-max");
        std::fs::create_dir_all(threads_max.parent().unwrap()).unwrap();
        std::fs::write(&threads_max, "1610\n").unwrap();
        let node = |name: &str, v: u64| proto::NodeLimits {
            sysctls: [(name.to_string(), v)].into(),
        };
        let bad = CreateContainer {
            id: "sb3".into(),
            node: Some(node("kernel.modprobe", 1)),
            ..req.clone()
        };
        let e = a.create(bad).unwrap_err().message;
        assert!(e.contains("the node's limits") && e.contains("kernel.modprobe"), "{e}");
        assert!(a.state(&pref("sb3", None)).unwrap_err().not_found);
        assert!(!dir.join("state/c/sb3").exists());

        // One never started is deleted at once, with nothing to wait for.
        a.create(CreateContainer {
            id: "sb2".into(),
            node: Some(node("kernel.threads-max", 21970)),
            ..req
        })
        .unwrap();
        assert_eq!(std::fs::read_to_string(&threads_max).unwrap(), "21970\n");
        let t = Instant::now();
        a.delete("sb2").unwrap();
        assert!(t.elapsed() < DELETE_WAIT, "no wait for a process that never ran");
        assert!(!dir.join("state/c/sb2").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_create_whose_disk_never_appears_fails_and_leaves_nothing_behind() {
        let (a, dir) = agent("nodisk");
        std::fs::create_dir_all(dir.join("sys/block")).unwrap();
        let req = CreateContainer {
            id: "c1".into(),
            spec: serde_json::json!({"process": {"args": ["true"]}}),
            rootfs: proto::BlockMount {
                serial: "k7d-disk9".into(),
                fstype: "erofs".into(),
                sectors: None,
            },
            stdio: StdioSpec::default(),
            binds: None,
            node: None,
        };
        let mut bad = req.clone();
        bad.rootfs.fstype = "erofs,ro".into();
        assert!(a.create(bad).unwrap_err().message.contains("filesystem type"));
        let mut bad = req.clone();
        bad.binds = Some(proto::Binds {
            disk: req.rootfs.clone(),
            mounts: vec![proto::Bind {
                index: 0,
                path: "0".into(),
                file: false,
                writable: false,
            }],
        });
        let e = a.create(bad).unwrap_err();
        assert!(e.message.contains("not a host bind mount"), "{e:?}");
        let start = Instant::now();
        let e = a.create(req.clone()).unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(100), "the disk is awaited");
        assert!(e.message.contains("no disk with serial k7d-disk9"), "{e:?}");
        assert!(!dir.join("state/c/c1").exists(), "the bundle is removed");
        assert!(lock(&a.table).reserved.is_empty(), "the id is free again");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

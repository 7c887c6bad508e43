//! The daemon's VMs that run in VM processes of their own (issue 36,
//! `vmproc/`): `k7d daemon --jail on`. Each such VM is a jailed process
//! with its own uid from the daemon's range, reached over its channel; its
//! record names the process (pid, start time, socket), so that a daemon
//! started after this one re-attaches to it instead of reconciling it
//! away. A watcher thread per VM process waits on its pidfd and records
//! why it ended when nobody asked it to (`kill -9`, a crash).
//!
//! What runs in a VM process so far: built-in guests, raw images and Linux
//! guests with disks, virtio-rng and NICs (on taps made here; on
//! vhost-net with `/dev/vhost-net` opened here),
//! every host file and tap queue opened here and handed over
//! (`host_files`), vsock with its host socket bound here (its guest's own
//! connections to the host are refused: the VM process has no path to
//! reach), NICs in pod networks attached here (at the build, or a bare
//! one later: `nic_attach`) and detached at delete; start, pause, resume,
//! stop, delete, info, list, peek, medium, rebase, snapshot, restore, fork
//! (each child's devices made here as for a build; a read-write disk's
//! overlay files made here too: `ForkedDisk`) and clusters (their members'
//! NICs on the cluster's private bridge, each fork's children's taps on a
//! bridge of that fork's own before they run). A request the VM process
//! does not serve yet is refused with a sentence.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::api::{ApiError, ErrorCode};
use super::store::{ProcessRecord, RecordStore, VmRecord};
use crate::config::{GuestSpec, VmConfig};
use crate::jail::JailConfig;
use crate::jail::cgroup::{self, CgroupRoot};
use crate::vmproc::handle::VmProcess;
use crate::vmproc::proto::{Reply, Request, UNKNOWN_REQUEST, VERSION, VmStatus};
use crate::vmproc::spawner::Spawner;
use crate::vstate::control::StopReason;
use crate::vstate::handed::FileRole;
use crate::vstate::vm::VmState;

/// How long a stopped VM process may take to exit before it is killed.
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// How long a call that found its VM process gone waits for the watcher
/// to record why (it takes moments: the process has ended).
const ENDED_WAIT: Duration = Duration::from_secs(1);
/// How many fork children are built at once, at most (bounded by the
/// host's CPUs too): each build waits mostly on its VM process.
const MAX_PARALLEL_BUILDS: usize = 8;
/// The longest unix socket path (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The uids (and gids, the same numbers) VM processes take, one each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    /// The first.
    pub base: u32,
    /// How many.
    pub count: u32,
}

impl IdRange {
    /// Refuses a range that holds root or wraps around.
    pub fn check(&self) -> Result<(), String> {
        if self.base == 0 || self.count == 0 || self.base.checked_add(self.count).is_none() {
            return Err(format!(
                "the VM processes' id range {}+{} must be non-empty, start above 0 and end below 2^32",
                self.base, self.count
            ));
        }
        Ok(())
    }
}

/// A VM process made ahead, jailed and waiting for the request that
/// builds its VM (a fork child's or a create's): its start is off the
/// request's path. It has no listening socket until then, so a spare
/// whose daemon goes away ends with it.
pub(super) struct Spare {
    proc: VmProcess,
    uid: u32,
    /// `<state>/spares/<uid>`, its jail root's parent.
    dir: std::path::PathBuf,
    /// Its cgroup leaf (limits set when it takes a VM).
    cgroup: Option<std::path::PathBuf>,
    /// When it was made (a surplus spare goes once it is old).
    made: Instant,
}

/// What a daemon with VM processes has: the spawner, the id range and the
/// spares made ahead.
pub struct VmProcesses {
    spawner: Spawner,
    ids: IdRange,
    /// Ids in use by a live VM process (spares included).
    used: Mutex<std::collections::BTreeSet<u32>>,
    spares: Mutex<Vec<Spare>>,
    /// How many spares to keep ready.
    spare_target: usize,
    /// Where spares' jail roots go (`<state>/spares`), set by the daemon.
    spare_dir: std::sync::OnceLock<std::path::PathBuf>,
    /// Where each VM process's cgroup leaf goes (none: `--jail-cgroup off`).
    cgroup: Option<CgroupRoot>,
    /// Whether the last spare could not be made: logged once when it
    /// starts failing and once when it recovers, not at every try.
    spares_failing: std::sync::atomic::AtomicBool,
}

impl VmProcesses {
    /// VM processes started by `spawner`, with ids from `ids`, keeping
    /// `spares` made ahead, each in a cgroup leaf under `cgroup` (the
    /// leaves of VM processes gone with an earlier daemon are removed once
    /// the daemon holds its state directory: [`VmProcesses::sweep_cgroups`]).
    pub fn new(spawner: Spawner, ids: IdRange, spares: usize, cgroup: Option<CgroupRoot>) -> Result<Self, String> {
        ids.check()?;
        Ok(Self {
            spawner,
            ids,
            used: Mutex::new(Default::default()),
            spares: Mutex::new(Vec::new()),
            spare_target: spares,
            spare_dir: std::sync::OnceLock::new(),
            cgroup,
            spares_failing: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Moves the new VM process `proc` (id `uid`) into its cgroup leaf,
    /// before it is handed anything of its VM; on failure it is stopped.
    fn enter_cgroup(&self, proc: &mut VmProcess, uid: u32) -> Result<Option<std::path::PathBuf>, String> {
        let Some(c) = &self.cgroup else {
            return Ok(None);
        };
        c.enter(uid, proc.pid).map(Some).inspect_err(|_| {
            let _ = proc.call(&Request::Stop);
            if let Ok(fd) = crate::sys::pidfd_open(proc.pid) {
                end_and_reap(&fd, proc.pid);
            }
        })
    }

    /// Where spares' jail roots go; their leftovers from an earlier daemon
    /// (whose spares ended with it) are removed, those of re-attached VMs
    /// kept.
    pub(super) fn set_spare_dir(&self, dir: std::path::PathBuf) {
        if let Ok(rd) = std::fs::read_dir(&dir) {
            let used = self.used().clone();
            for e in rd.flatten() {
                let keep = e
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<u32>().ok())
                    .is_some_and(|u| used.contains(&u));
                if !keep {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let _ = self.spare_dir.set(dir);
    }

    /// A spare, if one is ready.
    pub(super) fn take_spare(&self) -> Option<Spare> {
        lock(&self.spares).pop()
    }

    /// Spares ready.
    pub fn spares_ready(&self) -> usize {
        lock(&self.spares).len()
    }

    /// Makes spares until [`VmProcesses::new`]'s count are ready, and ends
    /// the surplus a request made ([`VmProcesses::ready_for`]) and did not
    /// take, once it has waited [`SURPLUS_AGE`].
    pub(super) fn top_up(&self) {
        while lock(&self.spares).len() < self.spare_target {
            use std::sync::atomic::Ordering;
            match self.make_spare() {
                Ok(s) => {
                    lock(&self.spares).push(s);
                    if self.spares_failing.swap(false, Ordering::Relaxed) {
                        tracing::info!("spare VM processes are made again");
                    }
                }
                Err(e) => {
                    if !self.spares_failing.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "cannot make a spare VM process; trying again, quietly, until one is made");
                    }
                    return;
                }
            }
        }
        let surplus: Vec<Spare> = {
            let mut g = lock(&self.spares);
            // `take_spare` takes the newest, from the end: the oldest are first.
            let old = g.iter().take_while(|s| s.made.elapsed() >= SURPLUS_AGE).count();
            let n = g.len().saturating_sub(self.spare_target).min(old);
            g.drain(..n).collect()
        };
        for s in surplus {
            self.discard(s);
        }
    }

    /// Makes spares until `n` are ready, several at once, for a request
    /// about to build `n` VMs (a batch or cluster fork): their processes
    /// start before it pauses its sources and before any of its VMs runs,
    /// instead of one at a time between children already running (under a
    /// batch's running guests, a start took 20–400 ms on a 2-CPU host
    /// instead of 4). Best effort: a VM without a spare starts its own.
    pub(super) fn ready_for(&self, n: usize) {
        let missing = n.saturating_sub(self.spares_ready());
        if missing == 0 {
            return;
        }
        let workers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_PARALLEL_BUILDS)
            .min(missing);
        let left = std::sync::atomic::AtomicUsize::new(missing);
        let work = || {
            use std::sync::atomic::Ordering::Relaxed;
            while left.fetch_update(Relaxed, Relaxed, |l| l.checked_sub(1)).is_ok() {
                match self.make_spare() {
                    Ok(s) => lock(&self.spares).push(s),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot make a VM process ahead; the VM starts its own");
                        left.store(0, Relaxed);
                    }
                }
            }
        };
        std::thread::scope(|s| {
            for _ in 1..workers {
                if let Err(e) = std::thread::Builder::new()
                    .name("k7d-vmproc-ahead".into())
                    .spawn_scoped(s, work)
                {
                    tracing::debug!(error = %e, "VM processes are made ahead by fewer threads");
                }
            }
            work();
        });
    }

    /// Ends spare `s`: stopped, reaped, its id, directory and leaf freed.
    fn discard(&self, s: Spare) {
        let Spare {
            mut proc,
            uid,
            dir,
            cgroup,
            ..
        } = s;
        let _ = proc.call(&Request::Stop);
        match crate::sys::pidfd_open(proc.pid) {
            Ok(fd) => end_and_reap(&fd, proc.pid),
            Err(e) => tracing::warn!(pid = proc.pid, error = %e, "cannot reap a surplus spare VM process"),
        }
        drop(proc);
        if let Some(l) = &cgroup {
            cgroup::remove(l);
        }
        let _ = std::fs::remove_dir_all(&dir);
        self.release(uid);
    }

    fn make_spare(&self) -> Result<Spare, String> {
        let base = self.spare_dir.get().ok_or("no directory for spares yet")?;
        let uid = self.allocate().map_err(|e| e.message)?;
        let dir = base.join(uid.to_string());
        let made = (|| {
            let _ = std::fs::remove_dir_all(&dir);
            let root = dir.join("root");
            std::fs::create_dir_all(&root).map_err(|e| format!("cannot make {}: {e}", root.display()))?;
            let jail = JailConfig {
                root,
                uid,
                gid: uid,
                keep_fds: Vec::new(),
            };
            // Its own log until its VM's replaces it.
            let log = crate::vstate::handed::open_log(&dir.join(PROCESS_LOG))
                .map_err(|e| format!("cannot open a spare's log in {}: {e}", dir.display()))?;
            let mut proc = self.spawner.spawn(&jail, &log, None)?;
            let cgroup = self.enter_cgroup(&mut proc, uid)?;
            Ok((proc, cgroup))
        })();
        match made {
            Ok((proc, cgroup)) => Ok(Spare {
                proc,
                uid,
                dir,
                cgroup,
                made: Instant::now(),
            }),
            Err(e) => {
                self.release(uid);
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    fn used(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<u32>> {
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `uid` taken (a re-attached VM process's).
    pub(super) fn take(&self, uid: u32) {
        self.used().insert(uid);
    }

    /// Removes the empty cgroup leaves of this range's ids not taken (VM
    /// processes gone with an earlier daemon); called by a daemon that
    /// holds its state directory and took its re-attached VMs' ids.
    pub(super) fn sweep_cgroups(&self) {
        let Some(c) = &self.cgroup else {
            return;
        };
        let used = self.used().clone();
        let range = self.ids.base..self.ids.base.saturating_add(self.ids.count);
        let swept = c.sweep(|u| range.contains(&u) && !used.contains(&u));
        if swept > 0 {
            tracing::info!(swept, cgroup = %c.dir().display(), "removed the empty cgroups of VM processes gone");
        }
    }

    /// The lowest free id, taken.
    fn allocate(&self) -> Result<u32, ApiError> {
        let mut used = self.used();
        let free = (self.ids.base..self.ids.base + self.ids.count).find(|u| !used.contains(u));
        let uid = free.ok_or_else(|| {
            ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "all {} ids of the VM processes' range are taken: no VM process can start",
                    self.ids.count
                ),
            )
        })?;
        used.insert(uid);
        Ok(uid)
    }

    pub(super) fn release(&self, uid: u32) {
        self.used().remove(&uid);
    }
}

/// How often the spare keeper looks.
const SPARE_PERIOD: Duration = Duration::from_millis(50);

/// How long a spare beyond the daemon's count, made ahead for a request
/// that did not take it, waits for another before it ends.
const SURPLUS_AGE: Duration = Duration::from_secs(10);

/// Starts the thread (`k7d-vmproc-spares`) that keeps `procs`' spares
/// ready; it ends with the last handle on `procs`.
pub(super) fn keep_spares(procs: &Arc<VmProcesses>) {
    // Also with no spares kept: it ends what a request made ahead and left.
    let weak = Arc::downgrade(procs);
    let spawned = std::thread::Builder::new()
        .name("k7d-vmproc-spares".into())
        .spawn(move || {
            while let Some(p) = weak.upgrade() {
                p.top_up();
                drop(p);
                std::thread::sleep(SPARE_PERIOD);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the thread that keeps VM processes ready; each is started when asked for");
    }
}

/// The taps of `config`'s NICs, made here (the VM process may not), each
/// queue as a file, and on the kernel's data plane one `/dev/vhost-net`
/// per queue pair: planned here as inside the daemon, and by the VM
/// process from what it was handed (vhost devices or none) with the same
/// node settings, so both settle on the same plane and queues. A tap goes
/// when the last of its queues closes: with the VM process, or here when
/// the build fails. A NIC in a pod network gets its tap in the pod netns
/// with the datapath around it (`attach_to_pod`, as a VM built here
/// does); its attachment comes back, detached if the build fails.
fn taps(id: &str, config: &VmConfig, node: &crate::config::NodeConfig, out: &mut Handover) -> Result<(), ApiError> {
    if config.devices.nics.is_empty() {
        return Ok(());
    }
    let bad = |m: String| ApiError::new(ErrorCode::InvalidArgument, format!("vm {id}: {m}"));
    let net = node.net().map_err(|e| bad(e.to_string()))?;
    let mut nl = None;
    for (i, n) in config.devices.nics.iter().enumerate() {
        let nic = u16::try_from(i).map_err(|_| bad("too many NICs".into()))?;
        // Planned as a VM built here plans it; on the kernel's data plane
        // the VM process is handed one /dev/vhost-net per pair (opened
        // here: it opens no path). One that cannot be opened falls back to
        // userspace as inside the daemon (refused when vhost was asked for
        // by name).
        use k7d_net::policy::VhostAvailability;
        let avail = crate::vstate::probe_vhost(&net, n);
        let mut plan =
            crate::vstate::nic_plan(&net, n, config.vcpus, avail).map_err(|e| bad(format!("nic {i}: {e}")))?;
        let mut vhost = Vec::new();
        if plan.vhost {
            match (0..plan.queue_pairs)
                .map(|_| k7d_devices::virtio::net::open_vhost_net())
                .collect::<std::io::Result<Vec<_>>>()
            {
                Ok(v) => vhost = v,
                Err(e) => {
                    let why =
                        VhostAvailability::Unavailable(format!("cannot open {}: {e}", k7d_net::policy::VHOST_NET_PATH));
                    plan = crate::vstate::nic_plan(&net, n, config.vcpus, why)
                        .map_err(|e| bad(format!("nic {i}: {e}")))?;
                }
            }
        }
        if let Some(w) = &plan.warning {
            tracing::warn!(vm = %id, nic = i, "{w}");
        }
        let tap = match &n.datapath {
            None => {
                let name = n.tap.clone().unwrap_or_else(|| k7d_net::nic_names(id, nic).tap);
                let nl = match &mut nl {
                    Some(nl) => nl,
                    None => nl.insert(
                        k7d_net::netlink::Netlink::open().map_err(|e| internal(&format!("vm {id}: netlink"), e))?,
                    ),
                };
                k7d_net::create_tap(nl, &name, plan.queue_pairs.into(), true)
                    .map_err(|e| internal(&format!("vm {id}: nic {i}: tap {name}"), e))?
            }
            Some(d) => {
                let dp = k7d_net::Datapath::new(node.datapath())
                    .map_err(|e| internal(&format!("vm {id}: nic {i}: the datapath"), e))?;
                let (att, note) = crate::vstate::attach_to_pod(&dp, id, nic, d, plan.queue_pairs.into(), false)
                    .map_err(|e| ApiError::new(ErrorCode::InvalidArgument, format!("vm {id}: {e}")))?;
                out.nets.push(crate::vstate::NetCleanup::new(
                    dp,
                    id.to_string(),
                    nic,
                    d.netns.clone(),
                    d.pod_if.clone(),
                ));
                out.notes.push((nic, note));
                att.tap
            }
        };
        for (q, fd) in tap.queues.into_iter().enumerate() {
            let queue = u16::try_from(q).map_err(|_| bad("too many queues".into()))?;
            out.roles.push(FileRole::TapQueue { nic, queue });
            out.files.push(std::fs::File::from(fd));
        }
        for (pair, f) in (0u16..).zip(vhost) {
            out.roles.push(FileRole::VhostNet { nic, pair });
            out.files.push(f);
        }
    }
    Ok(())
}

/// The name of a VM process's own log in its runtime directory.
pub const PROCESS_LOG: &str = "vm-process.log";

/// Opens `what` at `path` with `open`, or says why not in one sentence.
fn opened(
    id: &str,
    what: FileRole,
    path: &Path,
    open: impl FnOnce(&Path) -> std::io::Result<std::fs::File>,
) -> Result<std::fs::File, ApiError> {
    open(path).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidArgument,
            format!("vm {id}: cannot open {what} {}: {e}", path.display()),
        )
    })
}

/// A guest input file (kernel, initrd, raw image) opened for a VM process:
/// a regular file, as the VM would have refused anything else.
fn input(id: &str, what: FileRole, path: &Path) -> Result<std::fs::File, ApiError> {
    opened(id, what, path, |p| {
        let f = crate::vstate::handed::open_input(p)?;
        if !f.metadata()?.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "it is not a regular file",
            ));
        }
        Ok(f)
    })
}

/// A vsock host socket bound here for a VM process, removed when this is
/// dropped unless [`BoundSocket::keep`] handed it to the VM for good (its
/// delete removes it then).
pub(super) struct BoundSocket(Option<std::path::PathBuf>);

impl BoundSocket {
    /// The VM was built: the socket is its own from now on.
    pub(super) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            remove_vsock_socket(&p);
        }
    }
}

/// Removes a VM's vsock host socket (bound by this daemon or one before it).
fn remove_vsock_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot remove a vsock host socket");
    }
}

/// Binds `config`'s vsock host socket at its path for a VM process (which
/// may open no path: its guest's connections to the host are refused
/// there). An existing file at the path is an error, as for a VM built
/// here: it may be another VM's socket.
fn vsock_listener(id: &str, config: &VmConfig) -> Result<Option<(BoundSocket, std::fs::File)>, ApiError> {
    let Some(v) = &config.devices.vsock else {
        return Ok(None);
    };
    let l = std::os::unix::net::UnixListener::bind(&v.uds).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidArgument,
            format!("vm {id}: cannot bind vsock's host socket {}: {e}", v.uds.display()),
        )
    })?;
    let bound = BoundSocket(Some(v.uds.clone()));
    Ok(Some((bound, std::fs::File::from(OwnedFd::from(l)))))
}

/// What a VM process is handed for its build.
#[derive(Default)]
pub(super) struct Handover {
    /// What each file is.
    pub(super) roles: Vec<FileRole>,
    /// The files, in that order.
    pub(super) files: Vec<std::fs::File>,
    /// Its vsock socket, bound here: removed unless the build succeeds.
    pub(super) vsock: Option<BoundSocket>,
    /// Its NICs attached to pod networks here: detached unless the build
    /// succeeds.
    pub(super) nets: Vec<crate::vstate::NetCleanup>,
    /// What each of those NICs' `info` line adds (", datapath: MODE").
    pub(super) notes: Vec<(u16, String)>,
}

impl Handover {
    /// The VM was built: what was made here for it is its own now (its
    /// delete undoes it, from its record).
    fn keep(self) {
        if let Some(b) = self.vsock {
            b.keep();
        }
        for n in self.nets {
            n.keep();
        }
    }
}

/// The host files a VM process needs for `config` (its files under
/// `dir`), opened here with the flags the VM would have used, each named:
/// the VM process opens nothing itself. A fork child (`fork_child`) needs
/// no guest files: its RAM holds its guest. What was made here for it (a
/// vsock socket bound, NICs attached to pod networks) comes back too:
/// undone if the VM is not built.
pub(super) fn host_files(
    id: &str,
    config: &VmConfig,
    dir: &Path,
    kernel_cache: Option<&Path>,
    node: &crate::config::NodeConfig,
    fork_child: bool,
) -> Result<Handover, ApiError> {
    let mut out = Handover {
        roles: vec![FileRole::ProcessLog, FileRole::SerialLog],
        files: vec![
            opened(
                id,
                FileRole::ProcessLog,
                &dir.join(PROCESS_LOG),
                crate::vstate::handed::open_log,
            )?,
            opened(
                id,
                FileRole::SerialLog,
                &dir.join("serial.log"),
                crate::vstate::handed::open_log,
            )?,
        ],
        ..Handover::default()
    };
    // A fork child's RAM holds its guest: it needs no guest files, only
    // its devices' (the source's read-only images, its own taps, socket
    // and entropy source).
    match &config.guest {
        _ if fork_child => {}
        GuestSpec::Builtin { .. } => {}
        GuestSpec::Raw { path, .. } => {
            out.roles.push(FileRole::RawImage);
            out.files.push(input(id, FileRole::RawImage, path)?);
        }
        GuestSpec::Linux { kernel, initrd, .. } => {
            let mut k = input(id, FileRole::Kernel, kernel)?;
            // The daemon's cache of unpacked kernels, as a VM built here
            // would use it; without it the bzImage boots as it is.
            if let Some(cache) = kernel_cache {
                match crate::arch::x86_64::unpack::unpacked(kernel, &mut k, cache) {
                    Ok(Some(u)) => {
                        // Read-only: the cache entry is shared by every VM.
                        let f = opened(id, FileRole::UnpackedKernel, &u.path, crate::vstate::handed::open_input)?;
                        out.roles.push(FileRole::UnpackedKernel);
                        out.files.push(f);
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(vm = %id, "{e}; the kernel boots through its own decompressor"),
                }
            }
            out.roles.push(FileRole::Kernel);
            out.files.push(k);
            if let Some(i) = initrd {
                out.roles.push(FileRole::Initrd);
                out.files.push(input(id, FileRole::Initrd, i)?);
            }
        }
    }
    for (i, d) in config.devices.disks.iter().enumerate() {
        let Some(path) = &d.path else { continue };
        // A fork child's read-write disk is its source's frozen base and an
        // overlay of its own, which its build hands over (`build_child`).
        if fork_child && !d.read_only {
            continue;
        }
        let index = u16::try_from(i)
            .map_err(|_| ApiError::new(ErrorCode::InvalidArgument, format!("vm {id}: too many disks")))?;
        let role = FileRole::Disk { index };
        let f = k7d_devices::virtio::block::DiskImage::open_file(path, d.read_only)
            .map_err(|e| ApiError::new(ErrorCode::InvalidArgument, format!("vm {id}: {role}: {e}")))?;
        out.roles.push(role);
        out.files.push(f);
    }
    // Rng and vsock after the NICs: nothing after a NIC's attach can fail
    // but the entropy source's open and vsock's bind, and either failure
    // drops (so detaches) what was attached.
    taps(id, config, node, &mut out)?;
    if config.devices.rng {
        out.roles.push(FileRole::Entropy);
        out.files.push(opened(
            id,
            FileRole::Entropy,
            Path::new(k7d_devices::virtio::rng::ENTROPY_SOURCE),
            |p| std::fs::File::open(p),
        )?);
    }
    // Last: nothing after it can fail and leave it bound.
    if let Some((bound, f)) = vsock_listener(id, config)? {
        out.roles.push(FileRole::VsockListener);
        out.files.push(f);
        out.vsock = Some(bound);
    }
    Ok(out)
}

/// A VM in a VM process, from the daemon's side.
pub(super) struct Remote {
    id: String,
    config: VmConfig,
    /// The channel; `None` once the process is known to be gone.
    proc: Option<VmProcess>,
    rec: ProcessRecord,
    /// Why it stopped, once it has: set by a requested stop, or by the
    /// watcher when the process ended on its own.
    ended: Arc<Mutex<Option<StopReason>>>,
    pidfd: Arc<OwnedFd>,
    watcher: Option<JoinHandle<()>>,
    /// Whether a fork warned already that its children share its RNG
    /// state (once per source, as inside the daemon).
    rng_warned: bool,
    /// Its record's store (a VM process killed for breaking its channel
    /// is recorded stopped, with why).
    store: Arc<RecordStore>,
}

use crate::lock;

fn internal(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("{what}: {e}"))
}

impl Remote {
    /// Starts a VM process for `id` (its files under `runtime_dir`), builds
    /// `config` in it, and watches it. On any failure the process is gone.
    pub(super) fn spawn(
        procs: &VmProcesses,
        store: &Arc<RecordStore>,
        id: &str,
        config: &VmConfig,
        runtime_dir: &Path,
        node: &crate::config::NodeConfig,
        from: BuiltFrom<'_>,
    ) -> Result<Self, ApiError> {
        use std::os::fd::AsRawFd;
        // A restored VM's RAM holds its guest: no guest files, as for a
        // fork child.
        let (kernel_cache, restored) = match from {
            BuiltFrom::Boot { kernel_cache } => (kernel_cache, None),
            BuiltFrom::Snapshot(r) => (None, Some(r)),
        };
        let mut handed = host_files(id, config, runtime_dir, kernel_cache, node, restored.is_some())?;
        let files = std::mem::take(&mut handed.files);
        let roles = std::mem::take(&mut handed.roles);
        let serial_log = Some(runtime_dir.join("serial.log"));
        let build = match restored {
            None => Request::Build {
                id: id.to_string(),
                config: Box::new(config.clone()),
                files: roles,
                serial_log,
                node: node.clone(),
            },
            Some(r) => Request::BuildRestored {
                id: id.to_string(),
                config: Box::new(config.clone()),
                state: r.state.clone(),
                files: roles,
                serial_log,
                node: node.clone(),
            },
        };
        // The restored RAM first, its files, then its listening socket.
        let mut fds: Vec<_> = restored.map(|r| r.ram.as_raw_fd()).into_iter().collect();
        fds.extend(files.iter().map(|f| f.as_raw_fd()));
        if fds.len() >= crate::vmproc::wire::MAX_FDS {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "vm {id} needs {} host files, more than a VM process takes ({}): use fewer disks or NIC queues",
                    fds.len(),
                    crate::vmproc::wire::MAX_FDS - 1
                ),
            ));
        }
        let mut built = Self::spawn_with(procs, store, id, config, runtime_dir, &build, &fds)?;
        built.rec.nic_notes = std::mem::take(&mut handed.notes);
        handed.keep();
        Ok(built)
    }

    /// [`Remote::spawn`] with the build request `build` (a plain build, or
    /// a fork child's with its fork instant's descriptors `fds`).
    pub(super) fn spawn_with(
        procs: &VmProcesses,
        store: &Arc<RecordStore>,
        id: &str,
        config: &VmConfig,
        runtime_dir: &Path,
        build: &Request,
        fds: &[std::os::fd::RawFd],
    ) -> Result<Self, ApiError> {
        use std::os::fd::AsRawFd;
        let socket = runtime_dir.join("vm.sock");
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "vm {id}: its VM process's socket {} is longer than a unix socket path may be; use a shorter state directory",
                    socket.display()
                ),
            ));
        }
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(|e| internal(&format!("cannot listen at {}", socket.display()), e))?;
        // A spare made ahead when there is one (its listening socket goes
        // with the build request), else a VM process started now.
        let (mut proc, uid, spare_dir, with_listener, leaf) = match procs.take_spare() {
            Some(spare) => (spare.proc, spare.uid, Some(spare.dir), true, Ok(spare.cgroup)),
            None => {
                let root = runtime_dir.join("root");
                std::fs::create_dir(&root).map_err(|e| internal(&format!("cannot make {}", root.display()), e))?;
                let uid = procs.allocate()?;
                let jail = JailConfig {
                    root,
                    uid,
                    gid: uid,
                    keep_fds: Vec::new(),
                };
                let log = crate::vstate::handed::open_log(&runtime_dir.join(PROCESS_LOG))
                    .map_err(|e| internal(&format!("vm {id}: cannot open its VM process's log"), e))
                    .inspect_err(|_| procs.release(uid))?;
                let proc = procs
                    .spawner
                    .spawn(&jail, &log, Some(&listener))
                    .map_err(|e| internal(&format!("vm {id}: the VM process did not start"), e))
                    .inspect_err(|_| procs.release(uid))?;
                (proc, uid, None, false, Err(()))
            }
        };
        // Its cgroup leaf (a spare is in its own already), with the VM's
        // limits, before it is handed anything of the VM.
        let leaf = match leaf {
            Ok(l) => Ok(l),
            Err(()) => procs.enter_cgroup(&mut proc, uid),
        };
        let leaf = match leaf {
            Ok(l) => l,
            Err(e) => {
                procs.release(uid);
                if let Some(d) = &spare_dir {
                    let _ = std::fs::remove_dir_all(d);
                }
                return Err(internal(&format!("vm {id}"), e));
            }
        };
        let limited = leaf
            .as_deref()
            .map_or(Ok(()), |l| cgroup::limit(l, config.memory_mib, config.vcpus));
        let mut fds = fds.to_vec();
        if with_listener {
            fds.push(listener.as_raw_fd());
        }
        let built = Self::build_in(proc, id, build, &fds, limited);
        // Ours is a copy: the VM process listens on its own.
        drop(listener);
        let (proc, pidfd, start_ticks) = built.inspect_err(|_| {
            procs.release(uid);
            if let Some(d) = &spare_dir {
                let _ = std::fs::remove_dir_all(d);
            }
            if let Some(l) = &leaf {
                cgroup::remove(l);
            }
        })?;
        let rec = ProcessRecord {
            pid: proc.pid,
            start_ticks,
            uid,
            gid: uid,
            socket,
            spare_dir,
            nic_notes: Vec::new(),
            cgroup: leaf,
            // This daemon's VM processes make sealable RAM (a fork child's
            // is its source's: `build_child` says).
            seals_ram: true,
        };
        Ok(Self::watched(id, config.clone(), proc, rec, pidfd, store))
    }

    /// Builds the VM in `proc` with `build` (and `fds`); on failure the
    /// process is asked to stop, then killed.
    fn build_in(
        mut proc: VmProcess,
        id: &str,
        build: &Request,
        fds: &[std::os::fd::RawFd],
        limited: Result<(), String>,
    ) -> Result<(VmProcess, OwnedFd, u64), ApiError> {
        let pid = proc.pid;
        let pidfd = crate::sys::pidfd_open(pid).map_err(|e| internal(&format!("vm {id}: VM process {pid} is gone"), e));
        let start_ticks = crate::sys::process_start_ticks(pid)
            .map_err(|e| internal(&format!("vm {id}: VM process {pid} is gone"), e));
        let built = match (pidfd, start_ticks) {
            (Ok(fd), Ok(_)) if limited.is_err() => Err((
                Some(fd),
                internal(&format!("vm {id}"), limited.err().unwrap_or_default()),
            )),
            (Ok(fd), Ok(t)) => match proc.call_with_fds(build, fds).map(|(r, _)| r) {
                Ok(Reply::Ok) => Ok((fd, t)),
                Ok(Reply::Error { message }) => Err((
                    Some(fd),
                    ApiError::new(ErrorCode::InvalidArgument, format!("vm {id}: {message}")),
                )),
                Ok(other) => Err((Some(fd), internal(&format!("vm {id}: build"), format!("{other:?}")))),
                Err(e) => Err((Some(fd), internal(&format!("vm {id}: build"), e))),
            },
            (fd, t) => Err((fd.ok(), t.err().unwrap_or_else(|| internal("pidfd", "none")))),
        };
        match built {
            Ok((pidfd, start_ticks)) => Ok((proc, pidfd, start_ticks)),
            Err((pidfd, e)) => {
                // Nothing of it may stay: asked to stop, then killed.
                let _ = proc.call(&Request::Stop);
                if let Some(fd) = pidfd {
                    end_and_reap(&fd, pid);
                }
                Err(e)
            }
        }
    }

    /// Re-attaches to the VM process `rec` names, if it is still the one
    /// the record was written for (pid and start time) and holds this VM.
    pub(super) fn attach(rec: &VmRecord, store: &Arc<RecordStore>) -> Result<Self, String> {
        let Some(p) = rec.vm_process.clone() else {
            return Err("it ran inside the daemon that is gone".into());
        };
        match crate::sys::process_start_ticks(p.pid) {
            Ok(t) if t == p.start_ticks => {}
            Ok(_) => return Err(format!("pid {} is now another process", p.pid)),
            Err(_) => return Err(format!("its VM process {} is gone", p.pid)),
        }
        // The pidfd before the hello: the process checked above is the one
        // it names unless it ended in between, which the hello then finds.
        let pidfd = crate::sys::pidfd_open(p.pid).map_err(|e| format!("its VM process {} is gone: {e}", p.pid))?;
        let refused = match VmProcess::attach(&p.socket, p.pid, VERSION) {
            Ok((proc, Reply::Hello { vm: Some(vm), .. })) if vm == rec.id => {
                return Ok(Self::watched(&rec.id, rec.config.clone(), proc, p, pidfd, store));
            }
            Ok((_, Reply::Hello { vm, .. })) => format!("VM process {} holds {vm:?}, not this VM", p.pid),
            Ok((_, Reply::Error { message })) => message,
            Ok((_, other)) => format!("VM process {} answered hello with {other:?}", p.pid),
            Err(e) => e,
        };
        // Still the recorded process, but not one this daemon can serve (a
        // channel version it does not speak, a wrong answer): it would run
        // on unaccounted for, its uid free for the next VM. It is ended.
        let _ = crate::sys::pidfd_kill(&pidfd);
        Err(format!("{refused}; VM process {} was killed", p.pid))
    }

    fn watched(
        id: &str,
        config: VmConfig,
        proc: VmProcess,
        rec: ProcessRecord,
        pidfd: OwnedFd,
        store: &Arc<RecordStore>,
    ) -> Self {
        let ended = Arc::new(Mutex::new(None));
        let pidfd = Arc::new(pidfd);
        let (vm, pid, e, fd, st) = (id.to_string(), rec.pid, ended.clone(), pidfd.clone(), store.clone());
        let watcher = std::thread::Builder::new()
            .name("k7d-vmproc-watch".into())
            .spawn(move || watch(&vm, pid, &fd, &e, &st))
            .map_err(|e| tracing::error!(vm = %id, error = %e, "cannot start the thread that watches the VM process; its end will not be recorded"))
            .ok();
        Self {
            id: id.to_string(),
            config,
            proc: Some(proc),
            rec,
            ended,
            pidfd,
            watcher,
            rng_warned: false,
            store: store.clone(),
        }
    }

    pub(super) fn id(&self) -> &str {
        &self.id
    }

    pub(super) fn config(&self) -> &VmConfig {
        &self.config
    }

    pub(super) fn record(&self) -> &ProcessRecord {
        &self.rec
    }

    /// Puts the file at `path` (opened read-only here: the VM process may
    /// open nothing) in its read-only disk `disk` as the new medium, or
    /// empties the drive.
    pub(super) fn medium(&mut self, disk: u32, path: Option<&Path>) -> Result<(), ApiError> {
        use std::os::fd::AsRawFd;
        let id = self.id.clone();
        let count = self.config.devices.disks.len();
        let index = usize::try_from(disk).ok().filter(|&i| i < count).ok_or_else(|| {
            ApiError::new(
                ErrorCode::Conflict,
                format!("vm {id} has {count} disks, so it has no disk {disk}"),
            )
        })?;
        let file = match path {
            Some(p) => {
                let bad = |e: &dyn std::fmt::Display| {
                    ApiError::new(
                        ErrorCode::InvalidArgument,
                        format!("vm {id}: disk {disk}'s new medium: {e}"),
                    )
                };
                crate::config::check_disk_path(p).map_err(|e| bad(&e))?;
                Some(k7d_devices::virtio::block::DiskImage::open_file(p, true).map_err(|e| bad(&e))?)
            }
            None => None,
        };
        let fds: Vec<_> = file.iter().map(|f| f.as_raw_fd()).collect();
        let req = Request::Medium {
            disk,
            path: path.map(Path::to_path_buf),
        };
        self.call_fds(&req, &fds)?;
        self.config.devices.disks[index].path = path.map(Path::to_path_buf);
        Ok(())
    }

    fn ended(&self) -> Option<StopReason> {
        lock(&self.ended).clone()
    }

    /// [`Remote::ended`], waiting up to [`ENDED_WAIT`] for the watcher of a
    /// process that is ending to record why.
    fn ended_soon(&self) -> Option<StopReason> {
        let until = Instant::now() + ENDED_WAIT;
        loop {
            let e = self.ended();
            let watching = self.watcher.as_ref().is_some_and(|w| !w.is_finished());
            if e.is_some() || !watching || Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// One request; its error reply as a sentence naming the VM.
    pub(super) fn call(&mut self, req: &Request) -> Result<Reply, ApiError> {
        self.call_fds(req, &[]).map(|(r, _)| r)
    }

    /// [`Remote::call`] with descriptors both ways.
    pub(super) fn call_fds(
        &mut self,
        req: &Request,
        fds: &[std::os::fd::RawFd],
    ) -> Result<(Reply, Vec<OwnedFd>), ApiError> {
        if let Some(reason) = self.ended() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("vm {} is stopped ({reason})", self.id),
            ));
        }
        let id = &self.id;
        let proc = self
            .proc
            .as_mut()
            .ok_or_else(|| ApiError::new(ErrorCode::Conflict, format!("vm {id}'s VM process is gone")))?;
        match proc.call_with_fds(req, fds) {
            Ok((Reply::Error { message }, _)) => Err(ApiError::new(ErrorCode::Conflict, format!("vm {id}: {message}"))),
            Ok(r) => Ok(r),
            Err(e) if proc.is_broken() => {
                let e = format!("vm {id}: {e}");
                self.kill_broken(&e);
                Err(ApiError::new(ErrorCode::Internal, e))
            }
            Err(e) => Err(ApiError::new(ErrorCode::Internal, format!("vm {id}: {e}"))),
        }
    }

    /// Ends a VM process whose channel broke (a reply late, too long or
    /// unreadable: its caller can no longer tell which request a reply
    /// answers, and a process that stalls its caller is not waited on
    /// again), recording `why` as the VM's stop.
    fn kill_broken(&mut self, why: &str) {
        let reason = StopReason::ProcessEnded {
            message: format!("{why}; its VM process {} was killed", self.rec.pid),
        };
        {
            let mut e = lock(&self.ended);
            if e.is_none() {
                *e = Some(reason.clone());
            }
        }
        tracing::warn!(vm = %self.id, pid = self.rec.pid, "{reason}");
        self.proc = None;
        let _ = crate::sys::pidfd_kill(&self.pidfd);
        if let Err(err) = self.store.update(&self.id, |r| r.state = VmState::Stopped { reason }) {
            tracing::debug!(vm = %self.id, error = %err, "cannot record the VM process's end");
        }
    }

    /// The warning a fork of it gives, until one that gave it succeeded
    /// ([`Remote::rng_warned`]), when its children share its kernel RNG
    /// state (`Vm::first_unreseeded_fork`).
    pub(super) fn rng_warning(&mut self) -> Option<String> {
        let reseed = self.status().rng_reseed?;
        if reseed == crate::RngReseed::Vmgenid || self.rng_warned {
            return None;
        }
        Some(format!(
            "{}: {}",
            super::agent_reseed::shared_rng_warning(&self.id),
            reseed.describe()
        ))
    }

    /// A fork that carried `warning` ([`Remote::rng_warning`]) made its
    /// children: logged, and not given again (a fork that failed gives it
    /// again next time).
    pub(super) fn rng_warned(&mut self, warning: &str) {
        if !self.rng_warned {
            self.rng_warned = true;
            tracing::warn!(vm = %self.id, "{warning}");
        }
    }

    /// Exports its fork instant (the caller paused it). Each read-write
    /// disk is given two overlay files made here (a VM process creates
    /// none): its own, taken at its first fork, and its children's, which
    /// it fills with what it wrote since its base froze; and the image
    /// opened again read-only, which the source takes in place of its own
    /// read-write descriptor of the frozen base. The base is then opened
    /// again here, read-only, for the children ([`ForkedDisk`]).
    pub(super) fn capture(&mut self) -> Result<Capture, ApiError> {
        match self.capture_with(false, true) {
            // A VM process of a k7d before the read-only base swap does not
            // know `bases`: its frozen disk base stays writable to it, as
            // it was then.
            Err(e) if e.message.contains(UNKNOWN_REQUEST) => {
                tracing::warn!(vm = %self.id, "its VM process (of an earlier k7d) keeps its frozen disk bases writable");
                self.capture_with(false, false)
            }
            r => r,
        }
        .map(|(c, _)| c)
    }

    /// [`Remote::capture`] of a VM that may be running, for a single fork:
    /// its VM process pauses it (if it runs), exports the fork instant and
    /// resumes it in one round trip ([`Request::CaptureLive`]); with how
    /// long it took to pause and how long it stood still (ms). `None` from
    /// a VM process of a k7d before that request: the caller asks for each
    /// step.
    pub(super) fn capture_live(&mut self) -> Result<Option<(Capture, f64, f64)>, ApiError> {
        match self.capture_with(true, true) {
            Ok((c, Some((pause, still)))) => Ok(Some((c, pause, still))),
            Ok((_, None)) => Err(internal(
                &format!("vm {}: capture", self.id),
                "the reply did not say how long the VM stood still",
            )),
            Err(e) if e.message.contains(UNKNOWN_REQUEST) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn capture_with(&mut self, live: bool, with_bases: bool) -> Result<(Capture, Option<(f64, f64)>), ApiError> {
        use std::os::fd::AsRawFd;
        let id = self.id.clone();
        let rw: Vec<(u16, PathBuf)> = (0u16..)
            .zip(&self.config.devices.disks)
            .filter(|(_, d)| !d.read_only)
            .filter_map(|(i, d)| d.path.clone().map(|p| (i, p)))
            .collect();
        let mut overlays = Vec::with_capacity(rw.len() * 2);
        for (i, path) in &rw {
            for _ in 0..2 {
                let f = k7d_devices::virtio::block::overlay_file(path.parent()).map_err(|e| {
                    internal(
                        &format!("vm {id}: disk {i}: cannot make an overlay file for its fork"),
                        e,
                    )
                })?;
                overlays.push(f);
            }
        }
        // Each image opened again read-only: at its first fork the source
        // swaps its read-write descriptor of the now frozen base for it,
        // and so holds nothing that writes what its children read.
        let bases = rw
            .iter()
            .filter(|_| with_bases)
            .map(|(i, path)| {
                k7d_devices::virtio::block::DiskImage::open_file(path, true).map_err(|e| {
                    let cause = std::error::Error::source(&e)
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default();
                    ApiError::new(
                        ErrorCode::Conflict,
                        format!("vm {id} cannot be forked: disk {i}: {e}{cause}"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let disk_ids: Vec<u16> = rw.iter().map(|(i, _)| *i).collect();
        let req = match (live, rw.is_empty()) {
            (true, _) => Request::CaptureLive {
                bases: with_bases && !disk_ids.is_empty(),
                disks: disk_ids,
            },
            (false, true) => Request::Capture,
            (false, false) => Request::CaptureDisks {
                disks: disk_ids,
                bases: with_bases,
            },
        };
        // Per disk: its two overlays, then its read-only base if asked.
        let raw: Vec<_> = overlays
            .chunks(2)
            .enumerate()
            .flat_map(|(k, pair)| pair.iter().chain(bases.get(k)).map(|f| f.as_raw_fd()))
            .collect();
        let (reply, fds) = self.call_fds(&req, &raw)?;
        let Reply::Captured {
            state,
            diverged,
            disks,
            pause_us,
            still_us,
        } = reply
        else {
            return Err(internal(&format!("vm {id}: capture"), format!("{reply:?}")));
        };
        let ms = |us: u64| us as f64 / 1000.0;
        let stood = pause_us.zip(still_us).map(|(p, s)| (ms(p), ms(s)));
        drop(bases);
        // The children's overlays: the second of each disk's pair.
        let templates: Vec<std::fs::File> = overlays.into_iter().skip(1).step_by(2).collect();
        let disks = forked_disks(&id, &rw, disks, templates)?;
        if fds.len() != 2 {
            return Err(internal(
                &format!("vm {id}: capture"),
                format!("{} descriptors instead of the base and the diverged pages", fds.len()),
            ));
        }
        // The base goes to the children read-only (they map it privately):
        // a child may not write its source's and siblings' memory. Its
        // source sent it: it must be that VM's guest RAM memfd. Both it and
        // the diverged pages are sealed first against every write, the
        // source's own included: what a child maps or reads stays what it
        // was at the fork instant, whatever the source does later.
        let mut fds = fds;
        for (fd, prefix, what) in [
            (&fds[0], "/memfd:k7d-ram-", "base"),
            (&fds[1], "/memfd:k7d-delta-", "diverged pages"),
        ] {
            match sealed_memfd(fd, prefix) {
                Ok(()) => {}
                // Built by an earlier k7d: forked as it was then.
                Err(Unsealed::Refused(e)) if !self.rec.seals_ram => tracing::warn!(
                    vm = %id,
                    "its fork's {what} {e}; its children are forked unsealed (a VM process of an earlier k7d)"
                ),
                Err(Unsealed::Refused(e) | Unsealed::NotRam(e)) => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("vm {id} cannot be forked: its fork's {what} {e}"),
                    ));
                }
            }
        }
        let base =
            read_only_memfd(&fds[0], "/memfd:k7d-ram-").map_err(|e| internal(&format!("vm {id}: capture"), e))?;
        fds[0] = base;
        // A fork source's frozen base stays charged to it, and what it
        // writes from now on is copied on top: up to twice its RAM.
        if let Some(l) = &self.rec.cgroup
            && let Err(e) = cgroup::limit(l, self.config.memory_mib.saturating_mul(2), self.config.vcpus)
        {
            tracing::warn!(vm = %id, error = %e, "cannot raise a fork source's memory limit");
        }
        Ok((
            Capture {
                config: self.config.clone(),
                state,
                diverged,
                fds,
                disks,
                seals_ram: self.rec.seals_ram,
            },
            stood,
        ))
    }

    /// Writes a snapshot of it into `dir` (as [`crate::Vm::snapshot`]):
    /// paused (if it runs) for the write, its machine state and guest RAM
    /// fetched from its process ([`Request::SnapshotParts`]) and written
    /// here, under the config this daemon holds (never one from the VM
    /// process: a snapshot's config names the files a restore opens).
    pub(super) fn snapshot(&mut self, dir: &Path, replace: bool) -> Result<(), ApiError> {
        let was_running = matches!(self.status().state, VmState::Running);
        if was_running {
            self.call(&Request::Pause)?;
        }
        let written = self.write_snapshot(dir, replace);
        if !was_running {
            return written;
        }
        match (written, self.call(&Request::Resume)) {
            (w, Ok(_)) => w,
            (Ok(()), Err(r)) => Err(r),
            (Err(e), Err(r)) => Err(ApiError::new(
                e.code,
                format!("{e}; resuming vm {} afterwards failed too: {r}", self.id),
            )),
        }
    }

    fn write_snapshot(&mut self, dir: &Path, replace: bool) -> Result<(), ApiError> {
        let id = self.id.clone();
        let what = format!("vm {id}: snapshot");
        let (reply, fds) = self.call_fds(&Request::SnapshotParts, &[])?;
        let Reply::SnapshotParts { state, diverged } = reply else {
            return Err(internal(&what, format!("{reply:?}")));
        };
        let state: crate::vstate::persist::MachineState = serde_json::from_str(&state)
            .map_err(|e| internal(&what, format!("its machine state is unreadable: {e}")))?;
        let size = self.config.memory_bytes();
        let mut fds = fds;
        let ram = match (diverged, fds.len()) {
            (None, 1) => {
                let ram = read_only_memfd(&fds[0], "/memfd:k7d-ram-").map_err(|e| internal(&what, e))?;
                crate::vstate::memory::GuestRam::view_of(std::fs::File::from(ram), size)
            }
            (Some(words), 2) => {
                let delta = fds.pop().map(std::fs::File::from);
                let base = read_only_memfd(&fds[0], "/memfd:k7d-ram-").map_err(|e| internal(&what, e))?;
                let Some(delta) = delta else {
                    return Err(internal(&what, "no diverged pages"));
                };
                crate::vstate::memory::GuestRam::from_capture(std::fs::File::from(base), delta, &words, size)
            }
            (_, n) => {
                return Err(internal(&what, format!("{n} descriptors for its guest RAM")));
            }
        }
        .map_err(|e| internal(&what, e))?;
        let mut config = self.config.clone();
        crate::vstate::pin_macs(&mut config, &id);
        // What a restore checks first, checked before anything is written.
        crate::vstate::persist::check_fits(&config, &state).map_err(|e| internal(&what, e))?;
        crate::vstate::snapshot::write(dir, replace, &config, &state, &ram).map_err(|e| match e {
            crate::vstate::snapshot::SnapshotError::Refused(m) => ApiError::new(ErrorCode::Conflict, m),
            io => {
                let cause = std::error::Error::source(&io)
                    .map(|c| format!(": {c}"))
                    .unwrap_or_default();
                internal(&what, format!("{io}{cause}"))
            }
        })
    }

    /// Its state and the figures `info` shows.
    pub(super) fn status(&mut self) -> VmStatus {
        if let Some(reason) = self.ended() {
            return VmStatus::stopped(reason);
        }
        match self.call(&Request::Status) {
            Ok(Reply::Status(status)) => status,
            // The process died under the call (a guest that stopped ends
            // it): the watcher is recording why, within moments.
            _ => {
                let reason = self.ended_soon().unwrap_or_else(|| StopReason::ProcessEnded {
                    message: format!("vm {}: VM process {} does not answer", self.id, self.rec.pid),
                });
                VmStatus::stopped(reason)
            }
        }
    }

    /// Stops the VM (a requested stop) and waits until its process is gone.
    pub(super) fn stop(&mut self) {
        {
            let mut e = lock(&self.ended);
            if e.is_none() {
                *e = Some(StopReason::Requested);
            }
        }
        if let Some(mut p) = self.proc.take() {
            let _ = p.call(&Request::Stop);
        }
        self.reap();
    }

    /// Waits for the watcher (the process gone), killing the process if
    /// it outstays [`EXIT_WAIT`].
    fn reap(&mut self) {
        let Some(w) = self.watcher.take() else {
            return;
        };
        let until = Instant::now() + EXIT_WAIT;
        while !w.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
        if !w.is_finished() {
            tracing::warn!(vm = %self.id, pid = self.rec.pid, "the VM process did not exit when stopped; killing it");
            let _ = crate::sys::pidfd_kill(&self.pidfd);
        }
        let _ = w.join();
    }
}

/// Refuses, before anything is paused, a fork across processes of `id`
/// whose read-write disks' children have a budget
/// (`fork.max_children_disk_mib`): each child's overlay is another
/// process's to write, and no budget follows those yet. Never an
/// unenforced limit.
pub(super) fn refuse_unbudgeted_disks(id: &str, config: &VmConfig) -> Result<(), ApiError> {
    let rw = config.devices.disks.iter().any(|d| !d.read_only && d.path.is_some());
    if rw && config.fork.max_children_disk_mib.is_some() {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!(
                "vm {id} sets fork.max_children_disk_mib, which its children's disks cannot be held to in VM processes of their own yet: unset it to fork it"
            ),
        ));
    }
    Ok(())
}

/// A read-only open of the memfd `fd` (through `/proc/self/fd`), which
/// must be named `prefix…`: a base a child can map but not write.
/// Why [`sealed_memfd`] did not seal; each finishes a sentence about it.
enum Unsealed {
    /// It is not what a VM process sends.
    NotRam(String),
    /// The kernel refused the seals.
    Refused(String),
}

/// Checks that `fd` is a memfd named `prefix…` and seals it against every
/// write ([`crate::sys::seal_against_writes`]).
fn sealed_memfd(fd: &OwnedFd, prefix: &str) -> Result<(), Unsealed> {
    use std::os::fd::AsRawFd;
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| Unsealed::NotRam(format!("cannot be read: {e}")))?;
    if !target.to_string_lossy().starts_with(prefix) {
        return Err(Unsealed::NotRam(format!(
            "is {}, not what its VM process should send",
            target.display()
        )));
    }
    crate::sys::seal_against_writes(fd)
        .map_err(|e| Unsealed::Refused(format!("cannot be sealed against its source's writes ({e})")))
}

fn read_only_memfd(fd: &OwnedFd, prefix: &str) -> Result<OwnedFd, String> {
    use std::os::fd::AsRawFd;
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let target = std::fs::read_link(&link).map_err(|e| format!("the base memfd cannot be read: {e}"))?;
    if !target.to_string_lossy().starts_with(prefix) {
        return Err(format!("the base is {}, not guest RAM", target.display()));
    }
    std::fs::File::open(&link)
        .map(OwnedFd::from)
        .map_err(|e| format!("the base memfd cannot be reopened read-only: {e}"))
}

/// What a VM in a VM process is built from ([`Remote::spawn`]).
pub(super) enum BuiltFrom<'a> {
    /// Its config's guest, booted (a kernel unpacked in the daemon's cache
    /// where it has one).
    Boot {
        /// The daemon's cache of unpacked kernels.
        kernel_cache: Option<&'a Path>,
    },
    /// A snapshot the daemon verified and copied.
    Snapshot(&'a Restored),
}

/// What a VM restored in a VM process is built from: the snapshot's
/// machine state (JSON) and its guest RAM, a memfd the daemon filled from
/// the snapshot's memory file.
pub(super) struct Restored {
    /// The machine state.
    pub state: String,
    /// The guest RAM.
    pub ram: Arc<std::fs::File>,
}

/// One fork child to build ([`Daemon::build_process_children`]).
pub(super) struct ChildJob<'a> {
    /// Its source's id.
    pub parent: &'a str,
    /// Its own id.
    pub id: &'a str,
    /// Its source's exported fork instant.
    pub capture: &'a Capture,
    /// What it gets instead of its source's.
    pub spec: &'a crate::ChildSpec,
    /// The bridge its NICs of these indexes go on (a cluster fork's own),
    /// before it runs.
    pub bridge: Option<(&'a str, &'a [u16])>,
    /// Its own overlay of each of its source's read-write disks, in the
    /// capture's order ([`child_overlays`]).
    pub overlays: &'a [std::fs::File],
    /// Its agent reseeds its kernel RNG as soon as it runs, where its
    /// kernel would not on its own (not where the caller reseeds it: the
    /// shim's identity step).
    pub reseed: bool,
}

/// A read-write disk of an exported fork instant, as its children take it.
pub(super) struct ForkedDisk {
    /// What the source said of it: its place and its overlay's clusters.
    exported: crate::vstate::fork::ExportedDisk,
    /// The frozen base, opened again here read-only (checked to be the
    /// source's file) and share-locked: a child can read it, never write
    /// it, and it stays frozen while a child lives.
    base: std::fs::File,
    /// The children's overlay as the source filled it (copied for each
    /// child: the source may still hold it).
    template: std::fs::File,
    /// The image's length (each child's overlay's).
    len: u64,
    /// Where the children's own overlays are made (the image's directory).
    dir: Option<PathBuf>,
}

/// The read-write disks `rw` of vm `id` as its capture reply `said` of
/// them (the disks asked for, in order), each base opened again here
/// read-only: a base that is not the file the source froze (replaced
/// since: another device or inode) is refused, as is a reply about other
/// disks or an overlay of another length.
fn forked_disks(
    id: &str,
    rw: &[(u16, PathBuf)],
    said: Vec<crate::vstate::fork::ExportedDisk>,
    templates: Vec<std::fs::File>,
) -> Result<Vec<ForkedDisk>, ApiError> {
    use std::os::unix::fs::MetadataExt;
    let bad = |m: String| internal(&format!("vm {id}: capture"), m);
    if said.len() != rw.len() || said.iter().zip(rw).any(|(s, (i, _))| s.disk != *i) {
        return Err(bad(format!(
            "its VM process told of disks {:?}, asked for {:?}",
            said.iter().map(|s| s.disk).collect::<Vec<_>>(),
            rw.iter().map(|(i, _)| *i).collect::<Vec<_>>()
        )));
    }
    let mut out = Vec::with_capacity(rw.len());
    for ((exported, (i, path)), template) in said.into_iter().zip(rw).zip(templates) {
        let base = k7d_devices::virtio::block::DiskImage::open_file(path, true)
            .map_err(|e| ApiError::new(ErrorCode::Conflict, format!("vm {id}: disk {i}: {e}")))?;
        let meta = base.metadata().map_err(|e| bad(format!("disk {i}: {e}")))?;
        if (meta.dev(), meta.ino()) != (exported.dev, exported.ino) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "vm {id}: disk {i}'s image {} is no longer the file the VM froze (it was replaced): its children cannot be built from it",
                    path.display()
                ),
            ));
        }
        let len = meta.len();
        let have = template.metadata().map_err(|e| bad(format!("disk {i}: {e}")))?.len();
        if have != len {
            return Err(bad(format!(
                "disk {i}'s children's overlay is {have} bytes long, its image {len}"
            )));
        }
        if let Err(e) = k7d_sys::file::flock(&base, k7d_sys::file::Lock::Shared, false) {
            tracing::warn!(vm = %id, disk = i, error = %e, "cannot lock a frozen base for its children; a read-write open elsewhere is not refused");
        }
        out.push(ForkedDisk {
            exported,
            base,
            template,
            len,
            dir: path.parent().map(Path::to_path_buf),
        });
    }
    Ok(out)
}

/// The overlay files of `n` children of `cap`, per child one per
/// read-write disk (in `cap.disks`' order), each a copy made here of the
/// overlay the source filled. No child gets that one itself: the source
/// was handed it and may still hold it, and no VM process may write
/// another VM's disk.
pub(super) fn child_overlays(id: &str, cap: &Capture, n: usize) -> Result<Vec<Vec<std::fs::File>>, ApiError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut mine = Vec::with_capacity(cap.disks.len());
        for d in &cap.disks {
            let i = d.exported.disk;
            let f = k7d_devices::virtio::block::overlay_file(d.dir.as_deref())
                .and_then(|f| {
                    k7d_devices::virtio::block::copy_overlay(&d.template, &f, d.len, &d.exported.runs).map(|()| f)
                })
                .map_err(|e| internal(&format!("vm {id}: disk {i}: cannot make a fork child's overlay"), e))?;
            mine.push(f);
        }
        out.push(mine);
    }
    Ok(out)
}

/// A VM process's exported fork instant: what its children are built from.
pub(super) struct Capture {
    /// The source's config.
    config: VmConfig,
    /// Its machine state (JSON).
    state: String,
    /// The pages in the diverged-pages memfd.
    diverged: Vec<u64>,
    /// The base and the diverged-pages memfds.
    fds: Vec<OwnedFd>,
    /// Its read-write disks.
    disks: Vec<ForkedDisk>,
    /// Whether its RAM was sealed (its children's RAM can be).
    seals_ram: bool,
}

/// Stops VM processes built for a request that failed (every child or
/// none), frees their ids and removes the directories of those that were
/// spares; the reservation removes their VMs' files.
pub(super) fn stop_all(procs: &VmProcesses, node: &crate::config::NodeConfig, built: Vec<Remote>) {
    for mut r in built {
        r.stop();
        undo_host_side(node, &r);
        procs.release(r.record().uid);
    }
}

/// Undoes what this daemon (or one before it) made on the host for the
/// stopped VM process `r`: its spare's directory, its cgroup leaf, its
/// vsock socket, its NICs' pod-network attachments (a VM built inside a
/// daemon undoes the last two in its drop).
pub(super) fn undo_host_side(node: &crate::config::NodeConfig, r: &Remote) {
    let (p, config) = (r.record(), r.config());
    if let Some(d) = &p.spare_dir
        && let Err(e) = std::fs::remove_dir_all(d)
    {
        tracing::warn!(vm = %r.id, dir = %d.display(), error = %e, "cannot remove a spare's directory");
    }
    if let Some(l) = &p.cgroup {
        cgroup::remove(l);
    }
    if let Some(v) = &config.devices.vsock {
        remove_vsock_socket(&v.uds);
    }
    detach_nics(node, &r.id, config);
}

/// Detaches the datapath of `config`'s NICs in pod networks (a VM
/// process's, attached by this daemon or one before it); one that cannot
/// be detached is logged and left, as at a reconcile.
fn detach_nics(node: &crate::config::NodeConfig, id: &str, config: &VmConfig) {
    let nics = super::reconcile::datapath_nics(&config.devices.nics);
    if nics.is_empty() {
        return;
    }
    let dp = match k7d_net::Datapath::new(node.datapath()) {
        Ok(dp) => dp,
        Err(e) => {
            tracing::error!(vm = %id, error = %e, "cannot open the datapath to detach the VM's NICs");
            return;
        }
    };
    for (idx, d) in nics {
        if let Err(e) = dp.detach(id, idx, Some(&d.netns), &d.pod_if) {
            tracing::error!(vm = %id, nic = idx, error = %e, "datapath detach failed");
        }
    }
}

/// Kills the process behind `pidfd` and waits until it is gone.
fn end_and_reap(pidfd: &OwnedFd, pid: u32) {
    let _ = crate::sys::pidfd_kill(pidfd);
    if let Err(e) = crate::sys::pidfd_wait(pidfd) {
        tracing::warn!(pid, error = %e, "cannot wait for a VM process that was killed");
    }
}

/// The watcher: waits for the process to end, and when nobody asked it
/// to, records why as the VM's stop: the guest's own stop, which ends its
/// VM process with a status of its own (`vmproc::exit_code_of`), or one
/// sentence on how the process ended.
fn watch(id: &str, pid: u32, pidfd: &OwnedFd, ended: &Mutex<Option<StopReason>>, store: &RecordStore) {
    let status = crate::sys::pidfd_wait(pidfd);
    let guest = match &status {
        Ok(Some(Ok(code))) => crate::vmproc::reason_of_exit(*code, id, pid),
        _ => None,
    };
    let how = match status {
        Ok(Some(Ok(0))) => format!("VM process {pid} exited"),
        Ok(Some(Ok(crate::vmproc::PANIC_EXIT))) => {
            format!("VM process {pid} panicked and ended itself (its log has the panic)")
        }
        Ok(Some(Ok(code))) => format!("VM process {pid} exited with status {code}"),
        Ok(Some(Err(sig))) => format!("VM process {pid} was killed by signal {sig}"),
        Ok(None) => format!("VM process {pid} ended (an earlier daemon started it, so how is not known)"),
        Err(e) => format!("VM process {pid} cannot be waited for ({e})"),
    };
    let mut e = lock(ended);
    if e.is_some() {
        tracing::debug!(vm = %id, "{how}");
        return;
    }
    let reason = guest.unwrap_or_else(|| StopReason::ProcessEnded {
        message: format!("vm {id}: {how}"),
    });
    tracing::warn!(vm = %id, "{reason}");
    *e = Some(reason.clone());
    drop(e);
    store.events().stopped(id, &reason);
    if let Err(err) = store.update(id, |r| r.state = VmState::Stopped { reason }) {
        tracing::error!(vm = %id, error = %err, "cannot record the VM process's end");
    }
}

/// The first record of a VM just built in `remote` (files under `dir`).
fn record_of(id: &str, config: VmConfig, dir: &Path, remote: &Remote, parent: Option<&str>) -> VmRecord {
    VmRecord {
        version: super::store::RECORD_VERSION,
        id: id.to_string(),
        config,
        state: VmState::Created,
        devices: Vec::new(),
        serial_log: dir.join("serial.log"),
        daemon_pid: std::process::id(),
        created_unix: super::now_unix(),
        vm_process: Some(remote.record().clone()),
        parent: parent.map(str::to_string),
        rng_agent: false,
    }
}

impl super::Daemon {
    /// The requests a VM in a VM process takes (delete aside), served
    /// there; `None` for any other request, or a VM in this process.
    pub(super) fn handle_in_process(&self, req: &super::api::Request) -> Option<Result<super::api::Reply, ApiError>> {
        use super::api::{Peeked, Reply as ApiReply, Request as Api};
        let id = match req {
            Api::Start(id) | Api::Pause(id) | Api::Resume(id) | Api::Stop(id) | Api::Info(id) => id,
            Api::Peek(a) => &a.id,
            Api::GuestRam(id) => id,
            Api::Medium(a) => &a.id,
            Api::Rebase(id) => id,
            _ => return None,
        };
        let r = self.process(id)?;
        let mut g = lock(&r);
        let done = match req {
            // Read by the VM process from its own smaps: the daemon may not
            // read a process of another uid's (it lacks CAP_SYS_PTRACE by
            // design). A VM process of an earlier k7d that does not know
            // the request: read here, where this host allows it.
            Api::GuestRam(_) => {
                let usage = |resident, copied, pss| {
                    ApiReply::GuestRam(super::ram_usage::GuestRamUsage {
                        id: id.clone(),
                        resident,
                        copied,
                        pss,
                    })
                };
                return Some(match g.status().state {
                    s @ VmState::Stopped { .. } => Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("vm {id} is {s}: its VM process holds no guest RAM"),
                    )),
                    _ => match g.call(&Request::GuestRam) {
                        Ok(Reply::GuestRam {
                            resident, copied, pss, ..
                        }) => Ok(usage(resident, copied, pss)),
                        Ok(other) => Err(internal(&format!("vm {id}: guest RAM"), format!("{other:?}"))),
                        Err(e) if e.message.contains(UNKNOWN_REQUEST) => {
                            super::ram_usage::in_vm_process(g.record().pid)
                                .map(|u| usage(u.resident, u.copied, u.pss))
                                .map_err(|e| internal(&format!("vm {id}: cannot read its VM process's smaps"), e))
                        }
                        Err(e) => Err(e),
                    },
                });
            }
            Api::Start(_) => g.call(&Request::Start).map(drop),
            Api::Pause(_) => g.call(&Request::Pause).map(drop),
            Api::Resume(_) => g.call(&Request::Resume).map(drop),
            Api::Stop(_) => match g.status().state {
                s @ VmState::Stopped { .. } => {
                    Err(ApiError::new(ErrorCode::Conflict, format!("vm {id} is already {s}")))
                }
                _ => {
                    g.stop();
                    Ok(())
                }
            },
            // The record keeps the medium (what `info` and a re-attach
            // read back).
            Api::Medium(a) => g.medium(a.disk, a.path.as_deref()).and_then(|()| {
                let config = g.config().clone();
                self.store
                    .update(id, |r| r.config = config)
                    .map(drop)
                    .map_err(|e| internal(&format!("vm {id}: cannot record its medium"), e))
            }),
            Api::Rebase(_) => {
                return Some(match g.call(&Request::Rebase) {
                    Ok(Reply::Rebased(r)) if r.id == *id => Ok(ApiReply::Rebased(r)),
                    Ok(other) => Err(internal(&format!("vm {id}: rebase"), format!("{other:?}"))),
                    Err(e) => Err(e),
                });
            }
            Api::Peek(a) => {
                return Some(
                    match g.call(&Request::Peek {
                        addr: a.addr,
                        count: a.count,
                    }) {
                        Ok(Reply::Peeked { words }) => Ok(ApiReply::Peek(Peeked {
                            id: id.clone(),
                            addr: a.addr,
                            words,
                        })),
                        Ok(other) => Err(internal(&format!("vm {id}: peek"), format!("{other:?}"))),
                        Err(e) if e.code == ErrorCode::Conflict => {
                            Err(ApiError::new(ErrorCode::InvalidArgument, e.message))
                        }
                        Err(e) => Err(e),
                    },
                );
            }
            _ => Ok(()),
        };
        Some(done.and_then(|()| {
            let info = self.process_info(&mut g);
            if !matches!(req, Api::Info(_)) {
                let state = info.state.clone();
                self.store
                    .update(id, |r| r.state = state)
                    .map_err(|e| internal(&format!("vm {id}: cannot record its state"), e))?;
            }
            Ok(ApiReply::Vm(Box::new(info)))
        }))
    }

    /// `fork` of a VM in a VM process: the source exports its fork instant
    /// (paused for that only: the export is self-contained, the source
    /// runs on while the children are built), and each child is built in a
    /// VM process of its own from it, copy-on-write over the source's base.
    pub(super) fn fork_process(
        &self,
        args: &super::api::ForkArgs,
        source: &Arc<Mutex<Remote>>,
    ) -> Result<super::api::Forked, ApiError> {
        let id = args.id.as_str();
        let procs = self.forking_processes(id)?;
        refuse_unbudgeted_disks(id, lock(source).config())?;
        let spec = super::child_spec(args);
        let held = self.reserve_children(id, args.count, args.name.as_deref())?;
        procs.ready_for(held.ids().len());
        let t = Instant::now();
        let (cap, pause_ms, source_paused_ms, warnings) = {
            let mut g = lock(source);
            let warnings: Vec<String> = g.rng_warning().into_iter().collect();
            match g.capture_live()? {
                Some((cap, pause_ms, still_ms)) => (cap, pause_ms, still_ms, warnings),
                // A VM process of an earlier k7d: each step asked for.
                None => {
                    let was_running = matches!(g.status().state, VmState::Running);
                    if was_running {
                        g.call(&Request::Pause)?;
                    }
                    let pause_ms = super::ms(t.elapsed());
                    let got = g.capture();
                    if was_running {
                        g.call(&Request::Resume)?;
                    }
                    (got?, pause_ms, super::ms(t.elapsed()), warnings)
                }
            }
        };
        let overlays = child_overlays(id, &cap, held.ids().len())?;
        let jobs: Vec<ChildJob<'_>> = held
            .ids()
            .iter()
            .zip(&overlays)
            .map(|(cid, o)| ChildJob {
                parent: id,
                id: cid,
                capture: &cap,
                spec: &spec,
                bridge: None,
                overlays: o,
                reseed: !args.reseed_by_caller,
            })
            .collect();
        let (children, built) = self.build_process_children(&procs, &jobs)?;
        held.fill_processes(built);
        if let Some(w) = warnings.first() {
            lock(source).rng_warned(w);
        }
        Ok(super::api::Forked {
            id: id.to_string(),
            children,
            pause_ms,
            source_paused_ms,
            clusters: Vec::new(),
            rebased: Vec::new(),
            warnings,
        })
    }

    /// The daemon's VM processes, for the children of `id` (in a VM process).
    pub(super) fn forking_processes(&self, id: &str) -> Result<Arc<VmProcesses>, ApiError> {
        self.processes.clone().ok_or_else(|| {
            ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "vm {id} runs in a VM process, and so would its children, but this daemon runs none (--jail off)"
                ),
            )
        })
    }

    /// Builds every child of `jobs` ([`Daemon::build_child`]), several at
    /// once (each in a VM process of its own: a batch that outruns the
    /// spares waits for one process start at a time, not for all of them
    /// in turn), starts them once all are built ([`Daemon::start_children`]),
    /// and returns them in job order. Every child or none: when one fails,
    /// those built are stopped and the first failure in job order is
    /// returned.
    pub(super) fn build_process_children(
        &self,
        procs: &VmProcesses,
        jobs: &[ChildJob<'_>],
    ) -> Result<(Vec<super::api::ForkedChild>, Vec<Remote>), ApiError> {
        type Built = (Result<f64, ApiError>, Vec<Remote>);
        let workers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_PARALLEL_BUILDS)
            .min(jobs.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let slots: Vec<Mutex<Option<Built>>> = jobs.iter().map(|_| Mutex::new(None)).collect();
        let work = || {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(j) = jobs.get(i) else {
                    break;
                };
                let mut built = Vec::with_capacity(1);
                let r = self.build_child(procs, j, &mut built);
                if r.is_err() {
                    // The rest would be stopped anyway: none is started.
                    next.store(jobs.len(), std::sync::atomic::Ordering::Relaxed);
                }
                *lock(&slots[i]) = Some((r, built));
            }
        };
        std::thread::scope(|s| {
            for _ in 1..workers {
                // A helper that cannot start leaves its share to the others.
                if let Err(e) = std::thread::Builder::new()
                    .name("k7d-fork-build".into())
                    .spawn_scoped(s, work)
                {
                    tracing::debug!(error = %e, "a fork child is built by fewer threads");
                }
            }
            work();
        });
        let mut fork_ms = Vec::with_capacity(jobs.len());
        let mut remotes = Vec::with_capacity(jobs.len());
        let mut failed = None;
        for slot in slots {
            match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
                Some((r, built)) => {
                    remotes.extend(built);
                    match r {
                        Ok(ms) => fork_ms.push(ms),
                        Err(e) => {
                            failed.get_or_insert(e);
                        }
                    }
                }
                // Never started: an earlier one failed.
                None => {
                    failed.get_or_insert_with(|| internal("fork", "a child was not built after another failed"));
                }
            }
        }
        if let Some(e) = failed {
            stop_all(procs, &self.node, remotes);
            return Err(e);
        }
        self.start_children(procs, jobs, &fork_ms, remotes)
    }

    /// Builds the fork child of `job` from its source's exported fork
    /// instant in a VM process of its own (a spare when one is ready), its
    /// taps on the job's bridge first when it names one, and records it
    /// (not started: [`Daemon::start_children`]); it goes into `built` as
    /// soon as it exists, so that a caller that fails later stops it. Returns
    /// how long its build took (its `fork_ms`).
    pub(super) fn build_child(
        &self,
        procs: &VmProcesses,
        job: &ChildJob<'_>,
        built: &mut Vec<Remote>,
    ) -> Result<f64, ApiError> {
        use std::os::fd::AsRawFd;
        let (parent, cid, cap, spec) = (job.parent, job.id, job.capture, job.spec);
        let t = Instant::now();
        let dir = self
            .store
            .runtime_dir(cid)
            .map_err(|e| internal(&format!("vm {cid}: its runtime directory"), e))?;
        let c = spec.child_config(&cap.config, parent, cid).map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidArgument,
                format!("vm {parent} cannot be forked into {cid}: {e}"),
            )
        })?;
        let mut handed = host_files(cid, &c, &dir, None, &self.node, true)?;
        // Its taps exist now (they go with their last queue, so a failure
        // from here takes them off the bridge too).
        if let Some((bridge, nics)) = job.bridge {
            for &i in nics {
                let tap = k7d_net::nic_names(cid, i).tap;
                k7d_net::attach_port(bridge, &tap).map_err(|e| {
                    internal(
                        &format!("vm {cid}: cannot put nic {i}'s tap {tap} on bridge {bridge}"),
                        e,
                    )
                })?;
            }
        }
        let files = std::mem::take(&mut handed.files);
        let mut roles = std::mem::take(&mut handed.roles);
        if job.overlays.len() != cap.disks.len() {
            return Err(internal(
                &format!("vm {cid}"),
                format!(
                    "{} overlays for {} read-write disks",
                    job.overlays.len(),
                    cap.disks.len()
                ),
            ));
        }
        // Each read-write disk: the frozen base (read-only), its own overlay.
        let mut disk_fds = Vec::with_capacity(cap.disks.len() * 2);
        for (d, overlay) in cap.disks.iter().zip(job.overlays) {
            let index = d.exported.disk;
            roles.push(FileRole::Disk { index });
            roles.push(FileRole::DiskOverlay { index });
            disk_fds.push(d.base.as_raw_fd());
            disk_fds.push(overlay.as_raw_fd());
        }
        let build = Request::BuildFork {
            id: cid.to_string(),
            config: Box::new(c.clone()),
            state: cap.state.clone(),
            diverged: cap.diverged.clone(),
            files: roles,
            serial_log: Some(dir.join("serial.log")),
            disks: cap.disks.iter().map(|d| d.exported.clone()).collect(),
        };
        let mut fds: Vec<_> = cap.fds.iter().map(|f| f.as_raw_fd()).collect();
        fds.extend(files.iter().map(|f| f.as_raw_fd()));
        fds.extend(disk_fds);
        if fds.len() >= crate::vmproc::wire::MAX_FDS {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "vm {cid} needs {} descriptors, more than a VM process takes ({}): fork a VM with fewer disks or NIC queues",
                    fds.len(),
                    crate::vmproc::wire::MAX_FDS - 1
                ),
            ));
        }
        let mut remote = Remote::spawn_with(procs, &self.store, cid, &c, &dir, &build, &fds)?;
        // Its RAM is its source's base: sealed only if the source's was.
        remote.rec.seals_ram = cap.seals_ram;
        drop(files);
        remote.rec.nic_notes = std::mem::take(&mut handed.notes);
        handed.keep();
        let rec = record_of(cid, c, &dir, &remote, Some(parent));
        let saved = self
            .store
            .save(&rec)
            .map_err(|e| internal(&format!("vm {cid}: cannot write its record"), e));
        let fork_ms = super::ms(t.elapsed());
        built.push(remote);
        saved?;
        Ok(fork_ms)
    }

    /// Starts the built children of `jobs` (`remotes` and `children` in
    /// job order), each one's agent reseed begun as it starts where its job
    /// asks ([`super::agent_reseed::AgentReseeds::begin`]): a child runs
    /// only once all its siblings are built, so none of them spends the
    /// siblings' builds running with its source's RNG state, and its
    /// reseed does not wait behind them. The first failure stops them all.
    fn start_children(
        &self,
        procs: &VmProcesses,
        jobs: &[ChildJob<'_>],
        fork_ms: &[f64],
        mut remotes: Vec<Remote>,
    ) -> Result<(Vec<super::api::ForkedChild>, Vec<Remote>), ApiError> {
        let mut children = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.iter().enumerate() {
            let (Some(&ms), Some(r)) = (fork_ms.get(i), remotes.get_mut(i)) else {
                stop_all(procs, &self.node, remotes);
                return Err(internal("fork", format!("child {i} of {} was not built", jobs.len())));
            };
            if let Err(e) = r.call(&Request::Start) {
                stop_all(procs, &self.node, remotes);
                return Err(e);
            }
            let info = self.process_info(r);
            if job.reseed {
                self.agent_reseeds.begin(&info);
            }
            let st = info.state.clone();
            if let Err(e) = self.store.update(job.id, |r| r.state = st) {
                tracing::warn!(vm = %job.id, error = %e, "cannot record the VM's state");
            }
            children.push(super::api::ForkedChild {
                info,
                fork_ms: ms,
                shell: false,
            });
        }
        Ok((children, remotes))
    }

    /// `create` with `--jail on`: the VM built in a VM process of its own.
    pub(super) fn create_process(&self, config: VmConfig, start: bool) -> Result<super::api::VmInfo, ApiError> {
        config
            .validate()
            .map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
        let Some(procs) = self.processes.clone() else {
            return Err(internal("create", "this daemon runs no VM processes"));
        };
        let (held, id) = self.reserve(config.id.clone())?;
        let mut config = config;
        config.id = Some(id.clone());
        self.install_process(&procs, held, &id, config, start, None)
    }

    /// `restore` with `--jail on`: the snapshot opened and verified here,
    /// as a restore inside the daemon verifies it before any KVM object
    /// exists (format, manifest, config, sizes, and every chunk's checksum
    /// as its memory is copied into a new memfd), then the VM built over
    /// that memfd in a VM process of its own (which opens no file: the
    /// snapshot's, like every other, stays the daemon's) and started.
    pub(super) fn restore_process(&self, dir: &Path, id: Option<String>) -> Result<super::api::VmInfo, ApiError> {
        let Some(procs) = self.processes.clone() else {
            return Err(internal("restore", "this daemon runs no VM processes"));
        };
        let (held, id) = self.reserve(id)?;
        let bad = |e: &dyn std::fmt::Display| ApiError::new(ErrorCode::InvalidArgument, e.to_string());
        let snap = crate::vstate::snapshot::open(dir, &id).map_err(|e| bad(&e))?;
        crate::vstate::persist::check_fits(&snap.config, &snap.state).map_err(|e| bad(&e))?;
        let ram = crate::vstate::memory::GuestRam::new(&id, snap.config.memory_bytes())
            .map_err(|e| internal(&format!("vm {id}: its guest RAM"), e))?;
        snap.copy_memory_into(&ram).map_err(|e| bad(&e))?;
        let restored = Restored {
            state: serde_json::to_string(&snap.state)
                .map_err(|e| internal(&format!("vm {id}: its machine state"), e))?,
            ram: ram.memfd(),
        };
        // The VM process maps the memfd; this process keeps no view of it.
        drop(ram);
        let mut config = snap.config.clone();
        config.id = Some(id.clone());
        self.install_process(&procs, held, &id, config, true, Some(&restored))
    }

    /// Builds VM `id` (reserved by `held`) in a VM process of its own from
    /// `config` (or, `restored`, from a snapshot), records it and starts it
    /// if asked; on failure, whatever was made for it is undone.
    fn install_process(
        &self,
        procs: &Arc<VmProcesses>,
        held: super::Reservation<'_>,
        id: &str,
        config: VmConfig,
        start: bool,
        restored: Option<&Restored>,
    ) -> Result<super::api::VmInfo, ApiError> {
        let id = id.to_string();
        let dir = self
            .store
            .runtime_dir(&id)
            .map_err(|e| internal(&format!("vm {id}: its runtime directory"), e))?;
        let from = match restored {
            Some(r) => BuiltFrom::Snapshot(r),
            None => BuiltFrom::Boot {
                kernel_cache: self.kernel_cache.as_deref(),
            },
        };
        let mut remote = Remote::spawn(procs, &self.store, &id, &config, &dir, &self.node, from)?;
        let rec = record_of(&id, config.clone(), &dir, &remote, None);
        let started = self
            .store
            .save(&rec)
            .map_err(|e| internal(&format!("vm {id}: cannot write its record"), e))
            .and_then(|()| {
                if start {
                    remote.call(&Request::Start).map(drop)
                } else {
                    Ok(())
                }
            });
        if let Err(e) = started {
            // The reservation removes its files; the process goes first,
            // then what was made for it here.
            remote.stop();
            undo_host_side(&self.node, &remote);
            procs.release(remote.record().uid);
            return Err(e);
        }
        let info = self.process_info(&mut remote);
        let state = info.state.clone();
        if let Err(e) = self.store.update(&id, |r| r.state = state) {
            tracing::warn!(vm = %id, error = %e, "cannot record the VM's state");
        }
        held.fill_process(remote);
        Ok(info)
    }

    /// `delete` of a VM in a VM process: stopped, its process gone, its
    /// files and id freed.
    pub(super) fn delete_process(&self, id: &str, r: &Arc<Mutex<Remote>>) -> Result<super::api::Deleted, ApiError> {
        let uid = {
            let mut g = lock(r);
            g.stop();
            // Its vsock socket, pod networks and cgroup were made here,
            // not by the VM process: undone here.
            undo_host_side(&self.node, &g);
            g.record().uid
        };
        {
            let mut vms = self.vms();
            vms.insert(id.to_string(), super::Slot::Deleting);
            self.clusters.forget_member(id);
            let mut parents = self.parents();
            parents.remove(id);
            for p in parents.values_mut().filter(|p| p.id == id) {
                p.deleted = true;
            }
        }
        let removed = self
            .store
            .remove(id)
            .map_err(|e| internal(&format!("vm {id}: cannot remove its files"), e));
        {
            let mut vms = self.vms();
            if matches!(vms.get(id), Some(super::Slot::Deleting)) {
                vms.remove(id);
            }
        }
        if let Some(p) = &self.processes {
            p.release(uid);
        }
        removed?;
        Ok(super::api::Deleted {
            id: id.to_string(),
            deleted: true,
        })
    }

    /// A VM in a VM process as `list` and `cluster_info` show it.
    pub(super) fn process_summary(&self, r: &Arc<Mutex<Remote>>) -> super::api::VmSummary {
        let mut g = lock(r);
        let status = g.status().state.to_string();
        let c = g.config();
        super::api::VmSummary {
            id: g.id().to_string(),
            status,
            vcpus: c.vcpus,
            memory_mib: c.memory_mib,
            guest: c.guest.describe(),
        }
    }

    /// `nic_attach` of a VM in a VM process (a warm pool member claimed by
    /// a pod): its bare tap, made here at its build, moves into the pod
    /// netns with the datapath around it; the VM process keeps its queues
    /// and notices nothing. The same refusals as inside the daemon
    /// (`Vm::attach_nic`); the record keeps the attachment.
    pub(super) fn attach_process_nic(
        &self,
        a: &super::api::NicAttachArgs,
        r: &Arc<Mutex<Remote>>,
    ) -> Result<super::api::VmInfo, ApiError> {
        let mut g = lock(r);
        let id = g.id().to_string();
        let refuse = |why: String| {
            ApiError::new(
                ErrorCode::Conflict,
                format!("nic {} of vm {id} cannot be attached: {why}", a.nic),
            )
        };
        let index = usize::try_from(a.nic).unwrap_or(usize::MAX);
        crate::vstate::check_attachable(&id, g.config(), index, &a.datapath)
            .map_err(|m| ApiError::new(ErrorCode::Conflict, m))?;
        if let s @ VmState::Stopped { .. } = g.status().state {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("vm {id} is {s}: cannot attach a NIC"),
            ));
        }
        let idx = u16::try_from(index).map_err(|_| refuse("its index is out of range".into()))?;
        let dp = k7d_net::Datapath::new(self.node.datapath()).map_err(|e| refuse(e.to_string()))?;
        let (_, note) =
            crate::vstate::attach_to_pod(&dp, &id, idx, &a.datapath, 1, true).map_err(|e| refuse(e.to_string()))?;
        let cleanup =
            crate::vstate::NetCleanup::new(dp, id.clone(), idx, a.datapath.netns.clone(), a.datapath.pod_if.clone());
        g.config.devices.nics[index].datapath = Some(a.datapath.clone());
        g.rec.nic_notes.push((idx, note.clone()));
        let (config, rec) = (g.config.clone(), g.rec.clone());
        // Recorded, or undone: a daemon that re-attaches reads it back.
        // The attachment stays whatever the record says: undoing it would
        // delete the tap whose queues the VM process holds. Its delete
        // detaches it (this daemon knows it); a record not written is said.
        cleanup.keep();
        if let Err(e) = self.store.update(&id, |r| {
            r.config = config;
            r.vm_process = Some(rec);
        }) {
            return Err(internal(
                &format!(
                    "vm {id}: nic {index} is attached, but the attachment could not be recorded (a daemon that re-attaches would not detach it)"
                ),
                e,
            ));
        }
        tracing::info!(vm = %id, nic = index, netns = %a.datapath.netns.display(), "bare NIC attached to a pod network{note}");
        Ok(self.process_info(&mut g))
    }

    /// `pod_cgroup`: moves the VM's process out of its leaf under the
    /// daemon's cgroup root into a leaf of the same name under the pod's
    /// cgroup, with the same limits, so the kubelet's (and containerd's
    /// `PodSandboxStats`) accounting of the pod includes the VM. What it
    /// used before the move stays charged where it was. Refused for a
    /// stopped VM and with `--jail-cgroup off` (no leaves, no limits);
    /// the same pod again changes nothing; the record keeps the new leaf,
    /// which the VM's delete removes.
    pub(super) fn pod_cgroup_process(
        &self,
        a: &super::api::PodCgroupArgs,
        r: &Arc<Mutex<Remote>>,
    ) -> Result<super::api::VmInfo, ApiError> {
        let mut g = lock(r);
        let id = g.id().to_string();
        let refuse = |code: ErrorCode, why: String| {
            ApiError::new(
                code,
                format!("vm {id} cannot join the pod's cgroup {}: {why}", a.cgroup_parent),
            )
        };
        if let s @ VmState::Stopped { .. } = g.status().state {
            return Err(refuse(ErrorCode::Conflict, format!("it is {s}")));
        }
        let Some(old) = g.rec.cgroup.clone() else {
            return Err(refuse(
                ErrorCode::Conflict,
                "this daemon runs VM processes without cgroups (--jail-cgroup off)".into(),
            ));
        };
        super::api::check_cgroup_parent(&a.cgroup_parent).map_err(|m| refuse(ErrorCode::InvalidArgument, m))?;
        let pod = Path::new(cgroup::NODE_CGROUP_ROOT).join(a.cgroup_parent.trim_start_matches('/'));
        let name = cgroup::leaf_name(g.rec.uid);
        if old == pod.join(&name) {
            return Ok(self.process_info(&mut g));
        }
        let leaf = cgroup::enter_pod(&pod, &name, g.rec.pid).map_err(|m| refuse(ErrorCode::InvalidArgument, m))?;
        if let Err(m) = cgroup::limit(&leaf, g.config.memory_mib, g.config.vcpus) {
            // Back where it was: a leaf without limits is not kept.
            let back = std::fs::write(old.join("cgroup.procs"), g.rec.pid.to_string());
            if back.is_ok() {
                cgroup::remove(&leaf);
            }
            return Err(refuse(ErrorCode::Internal, m));
        }
        cgroup::remove(&old);
        g.rec.cgroup = Some(leaf.clone());
        let rec = g.rec.clone();
        if let Err(e) = self.store.update(&id, |r| r.vm_process = Some(rec)) {
            return Err(internal(
                &format!(
                    "vm {id}: its process is in {}, but the move could not be recorded (a daemon that re-attaches would not remove that cgroup)",
                    leaf.display()
                ),
                e,
            ));
        }
        tracing::info!(vm = %id, cgroup = %leaf.display(), "the VM's process joined its pod's cgroup");
        Ok(self.process_info(&mut g))
    }

    /// `info` of a VM in a VM process.
    pub(super) fn process_info(&self, g: &mut Remote) -> super::api::VmInfo {
        let rec = self.store.load(g.id()).ok().flatten();
        let VmStatus {
            state,
            exits,
            ms_since_start,
            first_exit_us_after_start,
            devices,
            rng_reseed,
            vmgenid,
            rebases,
            exits_by_reason: _,
            device_counters: _,
        } = g.status();
        let mut devices = devices;
        let p = g.record();
        // Its NICs in pod networks say so where a NIC attached inside a
        // daemon does: after its backend, before the transport's "; MSI-X".
        for (nic, note) in &p.nic_notes {
            if let Some(info) = devices
                .iter_mut()
                .filter(|i| i.kind == "virtio-net")
                .nth(usize::from(*nic))
                .filter(|i| !i.detail.contains(note.as_str()))
            {
                let at = info.detail.find("; MSI-X").unwrap_or(info.detail.len());
                info.detail.insert_str(at, note);
            }
        }
        // Its own statement: the guard must be gone before `children_of`
        // takes the lock again.
        let parent = self.parents().get(g.id()).map(|p| {
            if p.deleted {
                format!("{} (deleted)", p.id)
            } else {
                p.id.clone()
            }
        });
        super::api::VmInfo {
            id: g.id().to_string(),
            status: state.to_string(),
            state,
            config: g.config().clone(),
            devices,
            serial_log: rec.as_ref().map(|r| r.serial_log.clone()),
            daemon_pid: std::process::id(),
            created_unix: rec.as_ref().map(|r| r.created_unix),
            ms_since_start,
            first_exit_us_after_start,
            exits,
            parent,
            children: self.children_of(g.id()),
            rebases,
            shells_ready: None,
            rng_reseed,
            vmgenid,
            vm_process: Some(super::api::VmProcessInfo {
                pid: p.pid,
                uid: p.uid,
                gid: p.gid,
                cgroup: p.cgroup.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    /// A source that kept the overlay it filled must not reach any child's
    /// disk through it: each child gets a copy (its own inode) with the
    /// same clusters.
    #[test]
    fn every_fork_child_gets_a_copy_of_the_overlay_the_source_filled_never_that_file() {
        let len = 16 * 4096;
        let template = k7d_devices::virtio::block::overlay_file(None).unwrap();
        template.set_len(len).unwrap();
        template.write_all_at(&[0x5a; 4096], 4096).unwrap();
        let base = k7d_devices::virtio::block::overlay_file(None).unwrap();
        let ino = template.metadata().unwrap().ino();
        let cap = Capture {
            config: VmConfig::default(),
            state: String::new(),
            diverged: Vec::new(),
            fds: Vec::new(),
            disks: vec![ForkedDisk {
                exported: crate::vstate::fork::ExportedDisk {
                    disk: 0,
                    runs: vec![(1, 2)],
                    dev: 0,
                    ino: 0,
                },
                base,
                template,
                len,
                dir: None,
            }],
            seals_ram: true,
        };
        let kids = child_overlays("t", &cap, 3).unwrap();
        assert_eq!(kids.len(), 3);
        let mut inodes = std::collections::HashSet::new();
        for files in &kids {
            let [f] = files.as_slice() else {
                panic!("one overlay per read-write disk, got {}", files.len())
            };
            let m = f.metadata().unwrap();
            assert_ne!(m.ino(), ino, "a child got the overlay the source filled");
            assert!(inodes.insert(m.ino()), "two children share an overlay");
            assert_eq!(m.len(), len);
            let mut got = [0u8; 4096];
            f.read_exact_at(&mut got, 4096).unwrap();
            assert_eq!(got, [0x5a; 4096], "the copy lacks the source's cluster");
        }
    }
}

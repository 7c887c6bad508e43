//! Least privilege per thread (issue 12): a seccomp filter per thread kind,
//! compiled by [`tree`] (argument rules by `seccompiler`) from the lists in
//! [`lists`], `no_new_privs`, and
//! no capabilities at all in vCPU and device threads.
//!
//! - [`init`] (the main thread of `k7d run` and `k7d daemon`, before any VM
//!   exists and before the API accepts) compiles the filters, installs the
//!   `SIGSYS` handler, starts the reporter thread and puts the control filter
//!   on every thread of the process (TSYNC).
//! - [`enter`] first thing on each vCPU thread, and through
//!   `k7d_devices::sandbox` on each device worker: drops every capability,
//!   adds the kind's filter and registers the thread with its VM.
//! - A denied call traps (`SIGSYS`). The handler makes the call fail with
//!   `EPERM` and writes one record to a pipe, nothing else (it runs inside
//!   any code). The reporter thread logs one sentence (thread, kind, call
//!   number, VM) and stops the VM the thread worked for, whose stop reason
//!   then says the same. Nothing dies silently.
//!
//! `--seccomp off` runs without filters (for comparisons, `benches/`),
//! `--seccomp log` allows and audits what the filters would deny.

mod lists;
mod tree;

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::sync::atomic::{AtomicI32, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use seccompiler::{BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use crate::vstate::control::{StopReason, VmControl};

/// What the filters do with a call they do not list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Deny it: SIGSYS, reported, the call fails, the VM stops.
    Enforce,
    /// Allow it and log it to the kernel's audit log (finding what a new
    /// code path needs).
    Log,
    /// No filters and no capability drop (comparisons only).
    Off,
}

/// The kinds of threads, each with its own filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ThreadKind {
    /// Main, API, connection, signal and dump threads.
    Control = 1,
    /// A vCPU.
    Vcpu = 2,
    /// A device worker.
    Worker = 3,
}

/// Denied calls reported in this process, by thread kind (index: the
/// kind's `u8`; 0 unused).
static DENIED: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// The system calls this process's filters denied so far, by thread kind
/// (`control`, `vcpu`, `worker`): the metrics' `k7d_seccomp_denials_total`.
pub fn denials() -> [(&'static str, u64); 3] {
    [ThreadKind::Control, ThreadKind::Vcpu, ThreadKind::Worker]
        .map(|k| (k.label(), DENIED[k as usize].load(Ordering::Relaxed)))
}

impl ThreadKind {
    /// As a metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Control => "control",
            Self::Vcpu => "vcpu",
            Self::Worker => "worker",
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Control),
            2 => Some(Self::Vcpu),
            3 => Some(Self::Worker),
            _ => None,
        }
    }

    /// As shown in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Control => "control",
            Self::Vcpu => "vCPU",
            Self::Worker => "device worker",
        }
    }
}

/// Errors setting up the filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// A filter could not be built (a bug in the lists).
    #[error("the {kind} seccomp filter cannot be built: {source}")]
    Build {
        /// Which.
        kind: &'static str,
        /// Why.
        source: seccompiler::BackendError,
    },
    /// A filter's program could not be built (a bug in the lists).
    #[error("the {kind} seccomp filter cannot be compiled: {source}")]
    Compile {
        /// Which.
        kind: &'static str,
        /// Why.
        source: tree::TreeError,
    },
    /// The kernel refused a filter.
    #[error("the {kind} seccomp filter cannot be installed: {source}")]
    Install {
        /// Which.
        kind: &'static str,
        /// Why.
        source: seccompiler::Error,
    },
    /// An OS call failed.
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

struct Filters {
    vcpu: BpfProgram,
    worker: BpfProgram,
}

struct State {
    mode: Mode,
    filters: Option<Filters>,
}

static STATE: OnceLock<State> = OnceLock::new();
/// The write end of the report pipe (-1: none).
static REPORT_FD: AtomicI32 = AtomicI32::new(-1);

thread_local! {
    /// This thread's kind, for the SIGSYS record (0: not confined by k7d).
    static KIND: AtomicU8 = const { AtomicU8::new(0) };
    /// This thread's entry in the registry, for the SIGSYS record (0: none).
    static SEQ: AtomicU32 = const { AtomicU32::new(0) };
    /// The VM the thread works for, while it works for one (set on vCPU
    /// threads for their life and on control threads around a VM's start and
    /// resume): captured by device workers they spawn.
    static CURRENT_VM: std::cell::RefCell<Option<Weak<VmControl>>> = const { std::cell::RefCell::new(None) };
}

/// A confined thread: its name, the VM it works for, and since when it is
/// gone (entries outlive their thread by [`GONE_KEEP`]: a report may be
/// read after the thread that caused it ended).
struct Registered {
    name: String,
    vm: Option<Weak<VmControl>>,
    gone: Option<std::time::Instant>,
}
/// Registered threads by sequence number (never reused, unlike tids).
type Registry = HashMap<u32, Registered>;
static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);
static NEXT_SEQ: AtomicU32 = AtomicU32::new(1);
const GONE_KEEP: std::time::Duration = std::time::Duration::from_secs(60);

/// The mode in force ([`Mode::Off`] before [`init`]).
pub fn mode() -> Mode {
    STATE.get().map_or(Mode::Off, |s| s.mode)
}

fn program(
    kind: &'static str,
    lists: &[&[lists::Allowed]],
    ioctls: Option<&[(u64, u64, &str)]>,
    mode: Mode,
) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build { kind, source };
    let mut rules: std::collections::BTreeMap<i64, Vec<SeccompRule>> = std::collections::BTreeMap::new();
    for list in lists {
        for &(nr, _why) in *list {
            rules.entry(nr).or_default();
        }
    }
    // No rules for a call allows it whatever its arguments; a worker's
    // ioctl is allowed only for the listed requests.
    if let Some(ioctls) = ioctls {
        let mut allowed = Vec::new();
        for &(mask, value, _why) in ioctls {
            let cond = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(mask), value)
                .map_err(build)?;
            allowed.push(SeccompRule::new(vec![cond]).map_err(build)?);
        }
        rules.insert(libc::SYS_ioctl, allowed);
    }
    let mismatch = match mode {
        Mode::Log => SeccompAction::Log,
        _ => SeccompAction::Trap,
    };
    tree::compile(rules, mismatch, SeccompAction::Allow).map_err(|source| SeccompError::Compile { kind, source })
}

/// The capabilities control threads keep (bit numbers from
/// `linux/capability.h`); every other one is dropped from the process at
/// start. vCPU and device threads keep none.
const CONTROL_CAPS: &[(u32, &str)] = &[
    (0, "CAP_CHOWN: the API socket's group (--allow-gid)"),
    (1, "CAP_DAC_OVERRIDE: guest images and state files not owned by root"),
    (2, "CAP_DAC_READ_SEARCH: the same, for directories"),
    (3, "CAP_FOWNER: modes of files it did not create (the socket)"),
    (5, "CAP_KILL: liveness checks of another user's daemon (signal 0)"),
    (12, "CAP_NET_ADMIN: taps, tc filters, links in pod namespaces"),
    (14, "CAP_IPC_LOCK: eBPF maps on kernels that charge them to memlock"),
    (21, "CAP_SYS_ADMIN: entering a pod's network namespace (setns)"),
    (24, "CAP_SYS_RESOURCE: raising the memlock limit for eBPF maps"),
    (38, "CAP_PERFMON: loading the tc-eBPF program"),
    (39, "CAP_BPF: loading the tc-eBPF program and its maps"),
];

/// Narrows the calling (main) thread's capabilities to [`CONTROL_CAPS`]:
/// call before any other thread exists, so that all inherit it. A daemon run
/// without some of them keeps running without them (`docs/security.md`,
/// "Running as another user").
pub fn limit_control_capabilities() -> Result<(), SeccompError> {
    let keep = CONTROL_CAPS.iter().fold(0u64, |m, &(bit, _)| m | (1u64 << bit));
    let have = crate::sys::permitted_capabilities().map_err(|source| SeccompError::Os {
        what: "cannot read the process's capabilities",
        source,
    })?;
    crate::sys::set_capabilities(have & keep).map_err(|source| SeccompError::Os {
        what: "cannot narrow the process's capabilities",
        source,
    })
}

/// The set-up started by [`start_init`], until [`ready`] collects it.
type Pending = std::thread::JoinHandle<Result<(), SeccompError>>;
static PENDING: Mutex<Option<Pending>> = Mutex::new(None);
/// Whether that set-up is under way, for [`wait_set_up`].
static SETTING_UP: (Mutex<bool>, std::sync::Condvar) = (Mutex::new(false), std::sync::Condvar::new());

/// Marks the set-up done when dropped (whatever its outcome).
struct SetUpDone;

impl Drop for SetUpDone {
    fn drop(&mut self) {
        *SETTING_UP.0.lock().unwrap_or_else(|p| p.into_inner()) = false;
        SETTING_UP.1.notify_all();
    }
}

/// Returns once [`start_init`]'s work is over, successful or not (at once
/// when none was started). Unlike [`ready`] it neither collects nor reports
/// the outcome: standby vCPU threads wait here before they [`enter`], and
/// `Vm::start` calls [`ready`] before it hands them a vCPU.
pub fn wait_set_up() {
    let mut busy = SETTING_UP.0.lock().unwrap_or_else(|p| p.into_inner());
    while *busy {
        busy = SETTING_UP.1.wait(busy).unwrap_or_else(|p| p.into_inner());
    }
}

/// Sets the process up (see the module docs) and returns when it is done.
/// Call once, before any VM is built; later calls do nothing.
pub fn init(mode: Mode) -> Result<(), SeccompError> {
    start_init(mode)?;
    ready()
}

/// [`init`] on a helper thread, so that the main thread can build a VM
/// meanwhile (the kernel's work of attaching a filter is most of the cost
/// of confining `k7d run`; `benches/benches/seccomp.rs`). The control
/// filter reaches every thread, the main one included, through TSYNC.
/// [`ready`] (which [`crate::Vm::start`] calls) waits for it: no guest code
/// runs before every filter is in place.
pub fn start_init(mode: Mode) -> Result<(), SeccompError> {
    let mut pending = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    if STATE.get().is_some() || pending.is_some() {
        return Ok(());
    }
    *SETTING_UP.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
    let spawned = std::thread::Builder::new().name("k7d-confine".into()).spawn(move || {
        let _done = SetUpDone;
        init_now(mode)
    });
    match spawned {
        Ok(handle) => {
            *pending = Some(handle);
            Ok(())
        }
        Err(source) => {
            drop(SetUpDone);
            Err(SeccompError::Os {
                what: "cannot start the thread that installs the seccomp filters",
                source,
            })
        }
    }
}

/// Waits for [`start_init`]'s work; its error, once. Returns at once when
/// nothing is pending.
pub fn ready() -> Result<(), SeccompError> {
    let handle = PENDING.lock().unwrap_or_else(|p| p.into_inner()).take();
    match handle {
        None => Ok(()),
        Some(h) => h.join().unwrap_or_else(|_| {
            Err(SeccompError::Os {
                what: "the thread that installs the seccomp filters panicked",
                source: std::io::Error::other("panic"),
            })
        }),
    }
}

fn init_now(mode: Mode) -> Result<(), SeccompError> {
    if STATE.get().is_some() {
        return Ok(());
    }
    if mode == Mode::Off {
        let _ = STATE.set(State { mode, filters: None });
        tracing::warn!("seccomp filters are off (--seccomp off): no thread is confined");
        return Ok(());
    }
    let t0 = std::time::Instant::now();
    // Before any filter, on this helper thread: glibc would otherwise open
    // files from whichever thread first needs a new malloc arena or trims one
    // (CHALLENGES.md).
    crate::sys::prepare_malloc();
    let t_malloc = t0.elapsed();
    let control = program(
        "control",
        &[lists::WORKER, lists::VCPU_EXTRA, lists::CONTROL_EXTRA],
        None,
        mode,
    )?;
    let t_control = t0.elapsed();
    let filters = Filters {
        vcpu: program("vCPU", &[lists::WORKER, lists::VCPU_EXTRA], None, mode)?,
        worker: program("device worker", &[lists::WORKER], Some(lists::WORKER_IOCTLS), mode)?,
    };
    let t_compiled = t0.elapsed();
    let (rx, tx) = crate::sys::pipe_nonblocking_writer().map_err(|source| SeccompError::Os {
        what: "cannot create the seccomp report pipe",
        source,
    })?;
    std::thread::Builder::new()
        .name("k7d-seccomp".into())
        .spawn(move || report_loop(rx))
        .map_err(|source| SeccompError::Os {
            what: "cannot start the seccomp report thread",
            source,
        })?;
    let t_thread = t0.elapsed();
    REPORT_FD.store(std::os::fd::IntoRawFd::into_raw_fd(tx), Ordering::SeqCst);
    crate::sys::install_sigsys_handler(on_sigsys).map_err(|source| SeccompError::Os {
        what: "cannot install the SIGSYS handler",
        source,
    })?;
    *REGISTRY.lock().unwrap_or_else(|p| p.into_inner()) = Some(HashMap::new());
    let _ = STATE.set(State {
        mode,
        filters: Some(filters),
    });
    KIND.with(|k| k.store(ThreadKind::Control as u8, Ordering::Relaxed));
    let t_before_apply = t0.elapsed();
    seccompiler::apply_filter_all_threads(&control).map_err(|source| SeccompError::Install {
        kind: "control",
        source,
    })?;
    tracing::debug!(
        ?mode,
        malloc_us = t_malloc.as_micros() as u64,
        control_compiled_us = t_control.as_micros() as u64,
        compiled_us = t_compiled.as_micros() as u64,
        thread_us = t_thread.as_micros() as u64,
        before_apply_us = t_before_apply.as_micros() as u64,
        elapsed_us = t0.elapsed().as_micros() as u64,
        control_insns = control.len(),
        "seccomp filters installed"
    );
    Ok(())
}

/// Keeps a thread registered; marks it gone when dropped.
pub struct Entered {
    seq: u32,
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Some(e) = REGISTRY
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .and_then(|r| r.get_mut(&self.seq))
        {
            e.gone = Some(std::time::Instant::now());
        }
        CURRENT_VM.with(|c| c.borrow_mut().take());
    }
}

/// Confines the calling thread as `kind` (a vCPU or a device worker) working
/// for `vm`: every capability dropped, the kind's filter added. Does nothing
/// (`None`) when the filters are off or [`init`] never ran.
pub fn enter(kind: ThreadKind, name: &str, vm: Option<Weak<VmControl>>) -> Result<Option<Entered>, SeccompError> {
    let Some(filters) = STATE.get().and_then(|s| s.filters.as_ref()) else {
        return Ok(None);
    };
    let prog = match kind {
        ThreadKind::Vcpu => &filters.vcpu,
        ThreadKind::Worker => &filters.worker,
        ThreadKind::Control => return Ok(None),
    };
    crate::sys::drop_all_capabilities().map_err(|source| SeccompError::Os {
        what: "cannot drop the thread's capabilities",
        source,
    })?;
    let seq = NEXT_SEQ.fetch_add(1, Ordering::Relaxed);
    if let Some(r) = REGISTRY.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        r.retain(|_, e| e.gone.is_none_or(|t| t.elapsed() < GONE_KEEP));
        r.insert(
            seq,
            Registered {
                name: name.to_string(),
                vm: vm.clone(),
                gone: None,
            },
        );
    }
    let entered = Entered { seq };
    CURRENT_VM.with(|c| *c.borrow_mut() = vm);
    KIND.with(|k| k.store(kind as u8, Ordering::Relaxed));
    SEQ.with(|k| k.store(seq, Ordering::Relaxed));
    seccompiler::apply_filter(prog).map_err(|source| SeccompError::Install {
        kind: kind.name(),
        source,
    })?;
    Ok(Some(entered))
}

/// While alive, device workers spawned by this (control) thread work for `vm`.
pub struct VmScope(Option<Weak<VmControl>>);

/// See [`VmScope`].
pub fn vm_scope(vm: &Arc<VmControl>) -> VmScope {
    VmScope(CURRENT_VM.with(|c| c.borrow_mut().replace(Arc::downgrade(vm))))
}

impl Drop for VmScope {
    fn drop(&mut self) {
        let prev = self.0.take();
        CURRENT_VM.with(|c| *c.borrow_mut() = prev);
    }
}

/// The VM the calling thread works for, if any.
pub fn current_vm() -> Option<Weak<VmControl>> {
    CURRENT_VM.with(|c| c.borrow().clone())
}

/// The device crate's seam ([`k7d_devices::sandbox`]): workers enter as
/// [`ThreadKind::Worker`] for the VM their spawner worked for.
pub struct DeviceSandbox;

impl k7d_devices::sandbox::Sandbox for DeviceSandbox {
    fn capture(&self) -> Box<dyn std::any::Any + Send> {
        Box::new(current_vm())
    }

    fn enter(&self, token: Box<dyn std::any::Any + Send>, name: &str) -> Box<dyn std::any::Any> {
        let vm = token.downcast::<Option<Weak<VmControl>>>().ok().and_then(|b| *b);
        match enter(ThreadKind::Worker, name, vm) {
            Ok(e) => Box::new(e),
            Err(e) => {
                // The worker runs on under its spawner's filter (a vCPU's or
                // the control one): narrower would be better, but stopping a
                // device mid-activation is worse; the error says why.
                tracing::error!(thread = name, error = %e, "a device worker could not enter its sandbox");
                Box::new(())
            }
        }
    }
}

/// One SIGSYS: who and what. 16 bytes, written whole (< PIPE_BUF).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Record {
    tid: i32,
    syscall: i32,
    seq: u32,
    kind: u8,
    _pad: [u8; 3],
}

/// The SIGSYS handler: async-signal-safe only (atomics, `gettid`, `write`).
fn on_sigsys(syscall: i32) {
    let rec = Record {
        tid: crate::sys::gettid(),
        syscall,
        seq: SEQ.with(|k| k.load(Ordering::Relaxed)),
        kind: KIND.with(|k| k.load(Ordering::Relaxed)),
        _pad: [0; 3],
    };
    crate::sys::write_record(REPORT_FD.load(Ordering::Relaxed), &rec);
}

fn report_loop(mut rx: File) {
    let mut buf = [0u8; std::mem::size_of::<Record>()];
    loop {
        if let Err(e) = rx.read_exact(&mut buf) {
            tracing::error!(error = %e, "the seccomp report pipe failed; denied calls are no longer reported");
            return;
        }
        let tid = i32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let syscall = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let seq = u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]);
        let kind = ThreadKind::from_u8(buf[12]).unwrap_or(ThreadKind::Control);
        report(tid, seq, syscall, kind);
    }
}

fn report(tid: i32, seq: u32, syscall: i32, kind: ThreadKind) {
    DENIED[kind as usize].fetch_add(1, Ordering::Relaxed);
    let entry = REGISTRY
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .and_then(|r| r.get(&seq).map(|e| (e.name.clone(), e.vm.clone())));
    let (name, vm) = match entry {
        Some((name, vm)) => (name, vm.and_then(|w| w.upgrade())),
        None => (thread_name(tid), None),
    };
    let what = format!(
        "the {} thread {tid} ({name}) made system call {syscall}, which its seccomp filter denies (it failed with EPERM)",
        kind.name()
    );
    match vm {
        Some(ctl) => {
            let message = format!("vm {}: {what}; the VM was stopped", ctl.vm_id());
            tracing::error!("{message}");
            ctl.request_stop(StopReason::SeccompDenied {
                thread: name,
                syscall: i64::from(syscall),
                message,
            });
        }
        None => tracing::error!("{what}"),
    }
}

fn thread_name(tid: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

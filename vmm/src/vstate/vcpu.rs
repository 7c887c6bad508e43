//! vCPU setup (CPUID, real-mode registers, LAPIC LINT pins) and the run loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use thiserror::Error;

use super::control::{StopReason, VmControl};
use k7d_devices::bus::Bus;
use k7d_devices::virtio::diag::{now_ns, seconds_ago};

/// Errors from configuring a vCPU.
#[derive(Debug, Error)]
#[error("vCPU {index}: {what} failed")]
pub struct VcpuSetupError {
    /// The vCPU.
    pub index: u32,
    /// The step.
    pub what: &'static str,
    /// Cause.
    #[source]
    pub source: kvm_ioctls::Error,
}

fn step(index: u32, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuSetupError {
    move |source| VcpuSetupError { index, what, source }
}

/// The guest's port-I/O and MMIO buses.
#[derive(Default)]
pub struct Buses {
    /// Port I/O.
    pub pio: Bus,
    /// MMIO.
    pub mmio: Bus,
}

/// The CPUID a vCPU gets: what KVM supports, with this vCPU's APIC id.
pub fn cpuid_for(kvm: &Kvm, index: u32) -> Result<CpuId, VcpuSetupError> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(step(index, "KVM_GET_SUPPORTED_CPUID"))?;
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x00ff_ffff) | (index << 24);
                e.ecx |= 1 << 31; // hypervisor present
            }
            0xb | 0x1f => e.edx = index,
            _ => {}
        }
    }
    Ok(cpuid)
}

/// Sets the CPUID a new VM's vCPU `index` gets ([`cpuid_for`]); returns it.
pub fn set_default_cpuid(kvm: &Kvm, vcpu: &VcpuFd, index: u32) -> Result<CpuId, VcpuSetupError> {
    let cpuid = cpuid_for(kvm, index)?;
    vcpu.set_cpuid2(&cpuid).map_err(step(index, "KVM_SET_CPUID2"))?;
    Ok(cpuid)
}

/// Puts the boot vCPU in real mode at `cs = 0, ip = entry`, with 4 GiB data
/// segment limits ("big real mode"), and wires the LAPIC's LINT0 to the PIC
/// (ExtINT) and LINT1 to NMI, as firmware does.
pub fn setup_real_mode(vcpu: &VcpuFd, index: u32, entry: u64, stack: u64) -> Result<(), VcpuSetupError> {
    let mut sregs = vcpu.get_sregs().map_err(step(index, "KVM_GET_SREGS"))?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    for s in [
        &mut sregs.ds,
        &mut sregs.es,
        &mut sregs.ss,
        &mut sregs.fs,
        &mut sregs.gs,
    ] {
        s.base = 0;
        s.selector = 0;
        s.limit = 0xffff_ffff;
        // KVM's emulator keeps 20 limit bits: without the granularity bit a
        // 4 GiB limit silently becomes 1 MiB (see CHALLENGES.md).
        s.g = 1;
    }
    vcpu.set_sregs(&sregs).map_err(step(index, "KVM_SET_SREGS"))?;
    let mut regs = vcpu.get_regs().map_err(step(index, "KVM_GET_REGS"))?;
    regs.rip = entry;
    regs.rsp = stack;
    regs.rflags = 0x2;
    vcpu.set_regs(&regs).map_err(step(index, "KVM_SET_REGS"))?;
    let fpu = kvm_bindings::kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(step(index, "KVM_SET_FPU"))?;
    setup_lint(vcpu, index)
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(l: &kvm_bindings::kvm_lapic_state, off: usize) -> u32 {
    let b = &l.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(l: &mut kvm_bindings::kvm_lapic_state, off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        l.regs[off + i] = *b as _;
    }
}

/// LINT0 = ExtINT (the PIC's INTR reaches the CPU), LINT1 = NMI.
pub fn setup_lint(vcpu: &VcpuFd, index: u32) -> Result<(), VcpuSetupError> {
    let mut l = vcpu.get_lapic().map_err(step(index, "KVM_GET_LAPIC"))?;
    let mode = |v: u32, m: u32| (v & !0x700 & !(1 << 16)) | (m << 8);
    let v0 = lapic_reg(&l, APIC_LVT0);
    set_lapic_reg(&mut l, APIC_LVT0, mode(v0, APIC_MODE_EXTINT));
    let v1 = lapic_reg(&l, APIC_LVT1);
    set_lapic_reg(&mut l, APIC_LVT1, mode(v1, APIC_MODE_NMI));
    vcpu.set_lapic(&l).map_err(step(index, "KVM_SET_LAPIC"))
}

/// What a vCPU thread is doing, for the state dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VcpuRunState {
    /// The thread has not started.
    NotStarted,
    /// Inside `KVM_RUN` (running guest code, or halted in the kernel).
    KvmRun,
    /// In the VMM: serving an exit, or between two runs.
    Vmm,
    /// Parked on the control condvar (the VM is paused).
    Parked,
    /// The thread left.
    Exited,
}

impl VcpuRunState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::KvmRun,
            2 => Self::Vmm,
            3 => Self::Parked,
            4 => Self::Exited,
            _ => Self::NotStarted,
        }
    }

    /// The word the dump prints.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotStarted => "not_started",
            Self::KvmRun => "kvm_run",
            Self::Vmm => "vmm",
            Self::Parked => "parked",
            Self::Exited => "exited",
        }
    }
}

/// The kind of a vCPU's last exit to userspace, for the state dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitKind {
    /// No exit yet.
    None = 0,
    /// Port read (`port` recorded).
    IoIn,
    /// Port write (`port` recorded).
    IoOut,
    /// MMIO read (`addr` recorded).
    MmioRead,
    /// MMIO write (`addr` recorded).
    MmioWrite,
    /// `KVM_EXIT_HLT`.
    Hlt,
    /// `KVM_EXIT_SHUTDOWN`.
    Shutdown,
    /// `KVM_EXIT_FAIL_ENTRY`.
    FailEntry,
    /// `KVM_EXIT_INTERNAL_ERROR`.
    InternalError,
    /// `KVM_EXIT_SYSTEM_EVENT` (type recorded).
    SystemEvent,
    /// `KVM_EXIT_INTR` / `KVM_EXIT_IRQ_WINDOW_OPEN`.
    Intr,
    /// `KVM_RUN` returned `EINTR`/`EAGAIN` (a kick or a signal).
    Interrupted,
    /// Another exit.
    Other,
    /// `KVM_RUN` failed.
    RunFailed,
}

impl ExitKind {
    /// How many kinds there are.
    pub const COUNT: usize = 14;

    fn from_u8(v: u8) -> Self {
        Self::ALL.get(usize::from(v)).copied().unwrap_or(ExitKind::Other)
    }

    /// Every kind, in order of its number.
    pub const ALL: [ExitKind; Self::COUNT] = [
        ExitKind::None,
        ExitKind::IoIn,
        ExitKind::IoOut,
        ExitKind::MmioRead,
        ExitKind::MmioWrite,
        ExitKind::Hlt,
        ExitKind::Shutdown,
        ExitKind::FailEntry,
        ExitKind::InternalError,
        ExitKind::SystemEvent,
        ExitKind::Intr,
        ExitKind::Interrupted,
        ExitKind::Other,
        ExitKind::RunFailed,
    ];

    /// The word the dump prints, and the name of the recorded value.
    pub fn words(self) -> (&'static str, Option<&'static str>) {
        match self {
            Self::None => ("none", None),
            Self::IoIn => ("io_in", Some("port")),
            Self::IoOut => ("io_out", Some("port")),
            Self::MmioRead => ("mmio_read", Some("addr")),
            Self::MmioWrite => ("mmio_write", Some("addr")),
            Self::Hlt => ("hlt", None),
            Self::Shutdown => ("shutdown", None),
            Self::FailEntry => ("fail_entry", Some("reason")),
            Self::InternalError => ("internal_error", None),
            Self::SystemEvent => ("system_event", Some("type")),
            Self::Intr => ("intr", None),
            Self::Interrupted => ("eintr", None),
            Self::Other => ("other", None),
            Self::RunFailed => ("run_failed", Some("errno")),
        }
    }
}

/// One vCPU thread's state for the state dump (`diag.rs`): written only by
/// that thread (`Relaxed`, one clock read per exit), read by the dump thread.
#[derive(Debug, Default)]
pub struct VcpuDiag {
    tid: AtomicU64,
    state: AtomicU8,
    exits: AtomicU64,
    last_kind: AtomicU8,
    last_value: AtomicU64,
    last_exit_ns: AtomicU64,
    parked_since_ns: AtomicU64,
    /// Exits by kind (`ExitKind as usize`), for the metrics.
    by_kind: [AtomicU64; ExitKind::COUNT],
}

/// A [`VcpuDiag`] as read.
#[derive(Clone, Copy, Debug)]
pub struct VcpuView {
    /// OS thread id (0 before the thread started).
    pub tid: u64,
    /// What the thread is doing.
    pub state: VcpuRunState,
    /// Exits to userspace (including `EINTR` returns).
    pub exits: u64,
    /// The last exit.
    pub last_exit: ExitKind,
    /// Its port, address, type or errno (see [`ExitKind::words`]).
    pub last_value: u64,
    /// Seconds since the last exit (`None`: none yet).
    pub since_exit_s: Option<f64>,
    /// Seconds parked (when parked).
    pub parked_s: Option<f64>,
}

impl VcpuDiag {
    fn set(&self, s: VcpuRunState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }

    fn note_exit(&self, kind: ExitKind, value: u64) {
        self.last_exit_ns.store(now_ns(), Ordering::Relaxed);
        self.last_kind.store(kind as u8, Ordering::Relaxed);
        self.last_value.store(value, Ordering::Relaxed);
        self.exits.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.by_kind.get(kind as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.set(VcpuRunState::Vmm);
    }

    /// Exits so far by kind (`ExitKind as usize`).
    pub fn exits_by_kind(&self) -> [u64; ExitKind::COUNT] {
        std::array::from_fn(|i| self.by_kind[i].load(Ordering::Relaxed))
    }

    /// The state now.
    pub fn view(&self) -> VcpuView {
        let state = VcpuRunState::from_u8(self.state.load(Ordering::Relaxed));
        VcpuView {
            tid: self.tid.load(Ordering::Relaxed),
            state,
            exits: self.exits.load(Ordering::Relaxed),
            last_exit: ExitKind::from_u8(self.last_kind.load(Ordering::Relaxed)),
            last_value: self.last_value.load(Ordering::Relaxed),
            since_exit_s: seconds_ago(self.last_exit_ns.load(Ordering::Relaxed)),
            parked_s: (state == VcpuRunState::Parked)
                .then(|| seconds_ago(self.parked_since_ns.load(Ordering::Relaxed)))
                .flatten(),
        }
    }
}

fn classify(exit: &VcpuExit<'_>) -> (ExitKind, u64) {
    match exit {
        VcpuExit::IoIn(port, _) => (ExitKind::IoIn, u64::from(*port)),
        VcpuExit::IoOut(port, _) => (ExitKind::IoOut, u64::from(*port)),
        VcpuExit::MmioRead(addr, _) => (ExitKind::MmioRead, *addr),
        VcpuExit::MmioWrite(addr, _) => (ExitKind::MmioWrite, *addr),
        VcpuExit::Hlt => (ExitKind::Hlt, 0),
        VcpuExit::Shutdown => (ExitKind::Shutdown, 0),
        VcpuExit::FailEntry(reason, _) => (ExitKind::FailEntry, *reason),
        VcpuExit::InternalError => (ExitKind::InternalError, 0),
        VcpuExit::SystemEvent(kind, _) => (ExitKind::SystemEvent, u64::from(*kind)),
        VcpuExit::Intr | VcpuExit::IrqWindowOpen => (ExitKind::Intr, 0),
        _ => (ExitKind::Other, 0),
    }
}

/// What ended one `KVM_RUN`, without the borrow of the vCPU.
enum Outcome {
    Continue,
    Stop(StopReason),
}

/// The vCPU thread's body: run until the VM is stopped.
/// A vCPU fd shared between its thread (which holds the lock only around
/// `KVM_RUN`) and the VM's owner (which reads and writes the vCPU's state
/// while the VM is paused, when no thread holds it).
pub type SharedVcpu = Arc<std::sync::Mutex<VcpuFd>>;

/// Locks a shared vCPU (a poisoned lock still holds a usable fd).
pub fn lock_vcpu(v: &SharedVcpu) -> std::sync::MutexGuard<'_, VcpuFd> {
    v.lock().unwrap_or_else(|p| p.into_inner())
}

/// `confined` is the thread's confinement, done before it was handed the
/// vCPU (`standby.rs`): a vCPU that could not be confined does not run.
pub(crate) fn run_loop(
    shared: SharedVcpu,
    index: u32,
    ctl: Arc<VmControl>,
    buses: Arc<Buses>,
    diags: Arc<[VcpuDiag]>,
    confined: Result<Option<crate::seccomp::Entered>, crate::seccomp::SeccompError>,
) {
    // Whatever happens below, tell the control block this thread is gone.
    struct Exited<'a>(&'a VmControl, &'a VcpuDiag);
    impl Drop for Exited<'_> {
        fn drop(&mut self) {
            self.1.set(VcpuRunState::Exited);
            self.0.vcpu_exited();
        }
    }
    static NO_DIAG: VcpuDiag = VcpuDiag {
        tid: AtomicU64::new(0),
        state: AtomicU8::new(0),
        exits: AtomicU64::new(0),
        last_kind: AtomicU8::new(0),
        last_value: AtomicU64::new(0),
        last_exit_ns: AtomicU64::new(0),
        parked_since_ns: AtomicU64::new(0),
        by_kind: [const { AtomicU64::new(0) }; ExitKind::COUNT],
    };
    let diag = usize::try_from(index)
        .ok()
        .and_then(|i| diags.get(i))
        .unwrap_or(&NO_DIAG);
    diag.tid
        .store(k7d_devices::virtio::diag::current_tid(), Ordering::Relaxed);
    diag.set(VcpuRunState::Vmm);
    let _exited = Exited(&ctl, diag);
    // Confined before the guest runs a single instruction: no capabilities,
    // the vCPU filter (docs/security.md).
    let _confined = match confined {
        Ok(c) => c,
        Err(e) => {
            let message = format!("vm {} vcpu {index}: cannot confine the vCPU thread: {e}", ctl.vm_id());
            tracing::error!("{message}");
            ctl.request_stop(StopReason::VcpuError {
                vcpu: index,
                exit: "seccomp".into(),
                message,
            });
            return;
        }
    };
    let ptr: *mut u8 = &mut lock_vcpu(&shared).get_kvm_run().immediate_exit;
    // SAFETY: `ptr` points into the vCPU's kvm_run mapping, which lives as long
    // as the VcpuFd; `shared` keeps that alive until the end of this function,
    // after `_kick` (declared later, dropped earlier).
    let _kick = unsafe { crate::sys::VcpuKickGuard::register(ptr) };
    let vm_id = ctl.vm_id().to_string();
    let error = |exit: &str, detail: String| StopReason::VcpuError {
        vcpu: index,
        exit: exit.to_string(),
        message: format!("vm {vm_id} vcpu {index}: {exit}{detail}"),
    };
    let on_park = |parked: bool| {
        if parked {
            diag.parked_since_ns.store(now_ns(), Ordering::Relaxed);
            diag.set(VcpuRunState::Parked);
        } else {
            diag.set(VcpuRunState::Vmm);
        }
    };
    while ctl.checkpoint(on_park) {
        // Held only around one KVM_RUN and its exit: a paused vCPU's fd is free.
        let mut vcpu = lock_vcpu(&shared);
        diag.set(VcpuRunState::KvmRun);
        let ran = vcpu.run();
        match &ran {
            Ok(exit) => {
                let (kind, value) = classify(exit);
                diag.note_exit(kind, value);
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => diag.note_exit(ExitKind::Interrupted, 0),
            Err(e) => diag.note_exit(ExitKind::RunFailed, u64::try_from(e.errno()).unwrap_or(0)),
        }
        let outcome = match ran {
            Ok(exit) => {
                ctl.note_exit();
                match exit {
                    VcpuExit::IoOut(port, data) => {
                        tracing::trace!(vcpu = index, port, len = data.len(), "pio out");
                        if !buses.pio.write(port.into(), data) {
                            tracing::trace!(vm = %vm_id, port, "unhandled port write");
                        }
                        Outcome::Continue
                    }
                    VcpuExit::IoIn(port, data) => {
                        tracing::trace!(vcpu = index, port, len = data.len(), "pio in");
                        if !buses.pio.read(port.into(), data) {
                            data.fill(0xff);
                        }
                        Outcome::Continue
                    }
                    VcpuExit::MmioWrite(addr, data) => {
                        tracing::trace!(vcpu = index, addr, len = data.len(), "mmio write");
                        if !buses.mmio.write(addr, data) {
                            tracing::trace!(vm = %vm_id, addr, "unhandled MMIO write");
                        }
                        Outcome::Continue
                    }
                    VcpuExit::MmioRead(addr, data) => {
                        tracing::trace!(vcpu = index, addr, len = data.len(), "mmio read");
                        if !buses.mmio.read(addr, data) {
                            data.fill(0xff);
                        }
                        Outcome::Continue
                    }
                    VcpuExit::Hlt => Outcome::Stop(error(
                        "KVM_EXIT_HLT",
                        " (the guest halted with no in-kernel irqchip to wake it)".into(),
                    )),
                    VcpuExit::Shutdown => Outcome::Stop(error(
                        "KVM_EXIT_SHUTDOWN",
                        " (triple fault: the guest could not deliver an exception)".into(),
                    )),
                    VcpuExit::FailEntry(reason, cpu) => Outcome::Stop(error(
                        "KVM_EXIT_FAIL_ENTRY",
                        format!(" (hardware entry failure reason {reason:#x} on host cpu {cpu})"),
                    )),
                    VcpuExit::InternalError => Outcome::Stop(error("KVM_EXIT_INTERNAL_ERROR", String::new())),
                    VcpuExit::SystemEvent(kind, _) if kind == KVM_SYSTEM_EVENT_SHUTDOWN => {
                        Outcome::Stop(StopReason::GuestPoweroff)
                    }
                    VcpuExit::SystemEvent(kind, _) if kind == KVM_SYSTEM_EVENT_RESET => {
                        Outcome::Stop(StopReason::GuestReset)
                    }
                    VcpuExit::SystemEvent(kind, _) => {
                        Outcome::Stop(error("KVM_EXIT_SYSTEM_EVENT", format!(" (event type {kind})")))
                    }
                    VcpuExit::Intr | VcpuExit::IrqWindowOpen => Outcome::Continue,
                    other => Outcome::Stop(error("unexpected exit", format!(" {other:?}"))),
                }
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.set_kvm_immediate_exit(0);
                Outcome::Continue
            }
            Err(e) => Outcome::Stop(error("KVM_RUN failed", format!(": {e}"))),
        };
        drop(vcpu);
        if let Outcome::Stop(reason) = outcome {
            if let StopReason::VcpuError { message, .. } = &reason {
                tracing::error!("{message}");
            } else {
                tracing::info!(vm = %vm_id, vcpu = index, "{reason}");
            }
            ctl.request_stop(reason);
        }
    }
}

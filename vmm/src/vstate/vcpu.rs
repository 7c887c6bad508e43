//! vCPU setup (CPUID, real-mode registers, LAPIC LINT pins) and the run loop.

use std::sync::Arc;

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use thiserror::Error;

use super::control::{StopReason, VmControl};
use k7d_devices::bus::Bus;

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

pub(crate) fn run_loop(shared: SharedVcpu, index: u32, ctl: Arc<VmControl>, buses: Arc<Buses>) {
    // Whatever happens below, tell the control block this thread is gone.
    struct Exited<'a>(&'a VmControl);
    impl Drop for Exited<'_> {
        fn drop(&mut self) {
            self.0.vcpu_exited();
        }
    }
    let _exited = Exited(&ctl);
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
    while ctl.checkpoint() {
        // Held only around one KVM_RUN and its exit: a paused vCPU's fd is free.
        let mut vcpu = lock_vcpu(&shared);
        let outcome = match vcpu.run() {
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

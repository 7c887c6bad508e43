//! The process's `/dev/kvm`: opened by path, or, in a jailed VM process
//! (which has no `/dev`), the descriptor it was handed before it entered
//! its jail (issue 36: everything a VM needs arrives as a descriptor); and
//! the KVM objects every build makes from it (a VM, its irqchip and PIT,
//! its vCPUs), for a build and for a shell made ahead alike.

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::{Arc, OnceLock};

use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use super::error::VmError;
use super::vcpu::VcpuSetupError;

static HANDED: OnceLock<File> = OnceLock::new();

/// Makes `kvm` (an open `/dev/kvm`) the one every later [`open`] duplicates.
/// Once per process: a second call gives its file back.
pub fn hand_over(kvm: File) -> Result<(), File> {
    HANDED.set(kvm)
}

/// A KVM system handle: a duplicate of the handed descriptor, else
/// `/dev/kvm` opened by path.
pub fn open() -> Result<Kvm, kvm_ioctls::Error> {
    match HANDED.get() {
        Some(f) => {
            let dup = f
                .try_clone()
                .map_err(|e| kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EBADF)))?;
            // SAFETY: `dup` is a fresh descriptor of /dev/kvm that nothing
            // else owns; the Kvm takes it over (and closes it on drop).
            Ok(unsafe { Kvm::from_raw_fd(dup.into_raw_fd()) })
        }
        None => Kvm::new(),
    }
}

/// Where the VM's TSS goes (the three pages below the last 256 KiB under
/// 4 GiB, where Firecracker and Cloud Hypervisor put it too).
const TSS_ADDR: usize = 0xfffb_d000;

/// A KVM VM with its TSS placed (where the host wants one).
pub(super) fn create_vm(kvm: &Kvm) -> Result<Arc<VmFd>, VmError> {
    let vm_fd = Arc::new(kvm.create_vm().map_err(|e| VmError::Kvm("KVM_CREATE_VM", e))?);
    if let Err(e) = vm_fd.set_tss_address(TSS_ADDR) {
        tracing::debug!(error = %e, "KVM_SET_TSS_ADDR refused (not needed on this host)");
    }
    Ok(vm_fd)
}

/// The in-kernel irqchip (PIC, IOAPIC, LAPICs) and PIT, after the
/// memslots (CHALLENGES.md: a slot added after the irqchip's own waits for
/// an SRCU grace period).
pub(super) fn create_irqchip_and_pit(vm_fd: &VmFd) -> Result<(), VmError> {
    vm_fd
        .create_irq_chip()
        .map_err(|e| VmError::Kvm("KVM_CREATE_IRQCHIP", e))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm_fd.create_pit2(pit).map_err(|e| VmError::Kvm("KVM_CREATE_PIT2", e))
}

/// vCPU `index` of `vm_fd`.
pub(super) fn create_vcpu(vm_fd: &VmFd, index: u32) -> Result<VcpuFd, VcpuSetupError> {
    vm_fd.create_vcpu(index.into()).map_err(|source| VcpuSetupError {
        index,
        what: "KVM_CREATE_VCPU",
        source,
    })
}

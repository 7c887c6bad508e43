//! `VmError`, what building or driving a VM can fail with, and the one
//! helper that words a host I/O failure. A leaf: the modules that build and
//! drive a VM import it; it imports only the errors of the layers below.

use thiserror::Error;

use super::control::ControlError;
use super::memory::MemoryError;
use super::persist::PersistError;
use super::snapshot::SnapshotError;
use super::vcpu::VcpuSetupError;
use crate::arch::x86_64 as arch;

/// Errors from building or driving a VM.
#[derive(Debug, Error)]
pub enum VmError {
    /// /dev/kvm could not be opened.
    #[error("cannot open /dev/kvm (run `k7d check`)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// A VM-level KVM ioctl failed.
    #[error("{0} failed")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    /// Guest RAM.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// vCPU setup.
    #[error(transparent)]
    Vcpu(#[from] VcpuSetupError),
    /// The guest image.
    #[error("cannot load the guest: {0}")]
    Guest(String),
    /// A host resource (file, eventfd, thread).
    #[error("{what}")]
    Io {
        /// What failed.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Wrong state for the operation.
    #[error("vm {id} is {state}, cannot {op}")]
    State {
        /// VM id.
        id: String,
        /// Current state.
        state: String,
        /// The refused operation.
        op: &'static str,
    },
    /// The Linux kernel, initrd or command line was refused.
    #[error(transparent)]
    Boot(#[from] arch::BootError),
    /// A PCI or virtio device could not be set up.
    #[error("cannot set up the {what} device: {msg}")]
    Device {
        /// The device.
        what: &'static str,
        /// Why.
        msg: String,
    },
    /// What the VM holds cannot be carried into a fork or snapshot; the
    /// sentence names the VM and the device.
    #[error("{0}")]
    Refused(String),
    /// A device refused a lifecycle step (pause, resume); the sentence
    /// names the device, the VM and what state the VM was left in.
    #[error("{0}")]
    DeviceState(String),
    /// Saving or restoring machine state failed.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// A snapshot directory was refused or could not be read.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The threads could not be confined (seccomp), so the VM does not start.
    #[error("vm {id} cannot start: {source}")]
    Confine {
        /// VM id.
        id: String,
        /// Cause.
        #[source]
        source: crate::seccomp::SeccompError,
    },
    /// Pause/resume control.
    #[error("vm {id}: {source}")]
    Control {
        /// VM id.
        id: String,
        /// Cause.
        #[source]
        source: ControlError,
    },
}

/// A closure making a `VmError::Io` that names `what` failed.
pub(super) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}

/// A snapshot file operation's failure as a VM error: an I/O failure as
/// one, a refusal as the snapshot's.
pub(super) fn snapshot_io(e: SnapshotError) -> VmError {
    match e {
        SnapshotError::Io { what, source } => VmError::Io { what, source },
        other => VmError::Snapshot(other),
    }
}

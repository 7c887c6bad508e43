//! The running machine: guest memory, vCPUs, their control block, the VM.
//!
//! Imports point one way. The leaves: `control`, `handed`, `irq`,
//! `memory`, `persist`, `snapshot` (the file format), `vcpu`, `standby`,
//! `error` (`VmError`), `options` (`VmOptions`), `kvm` (the KVM objects a
//! build makes). Above them `device_manager` (the devices and their RAM
//! writers), then `vm` (the `Vm` and its run time), then what builds or
//! changes a `Vm`: `shell`, `builder`, `fork`, `vm_snapshot`, `rebase`,
//! `cluster`, `attach`.

mod attach;
mod builder;
pub mod cluster;
pub mod control;
mod device_manager;
mod error;
pub mod fork;
pub mod handed;
pub mod irq;
pub mod kvm;
pub mod memory;
mod options;
pub mod persist;
pub mod rebase;
pub mod shell;
pub mod snapshot;
mod standby;
pub mod vcpu;
pub mod vm;
mod vm_snapshot;

pub(crate) use attach::check_attachable;
pub(crate) use device_manager::{NetCleanup, attach_to_pod, pin_macs};
pub use device_manager::{nic_plan, probe_vhost};

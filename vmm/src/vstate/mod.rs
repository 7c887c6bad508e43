//! The running machine: guest memory, vCPUs, their control block, the VM.

mod attach;
mod builder;
pub mod cluster;
pub mod control;
mod device_manager;
pub mod fork;
pub mod handed;
pub mod irq;
pub mod kvm;
pub mod memory;
pub mod persist;
pub mod rebase;
pub mod shell;
pub mod snapshot;
mod standby;
pub mod vcpu;
pub mod vm;

pub(crate) use attach::check_attachable;
pub(crate) use device_manager::{NetCleanup, attach_to_pod, pin_macs};
pub use device_manager::{nic_plan, probe_vhost};

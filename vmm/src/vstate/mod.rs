//! The running machine: guest memory, vCPUs, their control block, the VM.

pub mod control;
pub mod irq;
pub mod memory;
pub mod persist;
pub mod snapshot;
mod standby;
pub mod vcpu;
pub mod vm;

//! The k7d VMM: VMs on KVM (memfd RAM, vCPU threads, device bus), the daemon
//! that owns them, its JSON API, and the CLI.
//!
//! Code map: [`config`] (what users ask for) → [`vstate`] (the machine:
//! memory, vCPUs, control, [`vstate::vm::Vm`]) → [`daemon`] (records, API
//! server, many VMs in one process) → `main.rs` (CLI). [`check`] reports host
//! readiness; [`budgets`] holds every latency budget; [`diag`] is the
//! `SIGUSR1` state dump.

pub mod arch;
pub mod budgets;
pub mod check;
pub mod config;
#[cfg(feature = "shim")]
pub mod cpcli;
pub mod daemon;
pub mod demo;
pub mod diag;
#[cfg(feature = "escape-drill")]
pub mod drill;
pub mod eventscli;
#[cfg(feature = "shim")]
pub mod execcli;
pub mod jail;
pub mod netcli;
pub mod seccomp;
#[cfg(feature = "shim")]
pub mod shim_host;
pub mod sys;
pub mod vmproc;
pub mod vstate;

pub use config::VmConfig;
pub use vstate::control::StopReason;
pub use vstate::fork::ChildSpec;
pub use vstate::vm::{RngReseed, Vm, VmError, VmOptions, VmState};

/// vm-memory, re-exported so tests use the exact version k7d maps RAM with.
pub use vm_memory as vm_memory_reexport;

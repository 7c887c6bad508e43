//! The k7d VMM: VMs on KVM (memfd RAM, vCPU threads, device bus), the daemon
//! that owns them and serves its JSON API, and the CLI.
//!
//! Code map: `k7d_api` (the wire types: what users ask for, the API, its
//! client) → [`vstate`] (the machine:
//! memory, vCPUs, control, [`vstate::vm::Vm`]) → [`daemon`] (records, API
//! server, many VMs in one process) → `main.rs` (CLI). [`check`] reports host
//! readiness; [`budgets`] holds every latency budget; [`diag`] is the
//! `SIGUSR1` state dump.

pub mod arch;
pub mod budgets;
pub mod check;
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
pub mod sys;
pub mod vmproc;
pub mod vstate;

// The wire types live in `k7d-api` (shared with the CLI and the shim); the
// runtime reaches its config as `crate::config`.
use k7d_api::config;

pub use k7d_api::{RngReseed, StopReason, VmConfig, VmState};
pub use vstate::fork::ChildSpec;
pub use vstate::vm::{Vm, VmError, VmOptions};

/// `m`'s guard, poisoned or not: a panic aborts the process (the `k7d`
/// binary's hook), so a lock is never met half-changed by one.
pub(crate) fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// vm-memory, re-exported so tests use the exact version k7d maps RAM with.
pub use vm_memory as vm_memory_reexport;

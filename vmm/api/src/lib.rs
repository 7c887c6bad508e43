//! k7d's wire types, shared by everything that speaks to the daemon: the
//! `k7d` CLI, the containerd shim, the daemon itself and the fuzz targets.
//!
//! Code map: [`config`] (what users ask for: a VM, its devices, the node),
//! [`state`] (what a VM reports: its state, why it stopped, its devices,
//! its RAM), [`api`] (the daemon's JSON API, version 1: every request,
//! result and error), [`client`] (a connection to a daemon's socket).
//! Nothing here touches KVM or a device: the runtime (`k7d-vmm`) and the
//! daemon depend on this crate, never the other way round.

pub mod api;
pub mod client;
pub mod config;
pub mod state;

pub use config::VmConfig;
pub use state::{RngReseed, StopReason, VmState};

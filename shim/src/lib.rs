//! `containerd-shim-k7d-v2`: containerd's runtime v2 shim for k7d
//! (`docs/containerd.md`). Part of the one `k7d` binary, which runs it when
//! invoked under the shim's name. A thin client: the k7d daemon owns every
//! VM ([`daemon::Daemon`]); the guest agent runs the containers
//! (`k7d_agent::proto`, over the pod VM's vsock).

pub mod agent;
pub mod api_daemon;
mod binds;
pub mod config;
pub mod daemon;
mod image;
mod limits;
mod metrics;
pub mod names;
mod pod_cgroup;
mod podnet;
mod pool;
mod retire;
mod runtime_options;
mod service;
mod stdio;
mod task;
mod template;

use std::path::Path;

pub use daemon::{Daemon, ForkedPod, PodNic, PodVmSpec, VmLife};

/// The binary name containerd runs for `io.containerd.k7d.v2`.
pub const SHIM_NAME: &str = "containerd-shim-k7d-v2";
/// The runtime's name in containerd.
pub const RUNTIME_ID: &str = "io.containerd.k7d.v2";

/// What `k7d pool-fill` did to a warm pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filled {
    /// The pool's name.
    pub pool: String,
    /// Members this call booted.
    pub booted: u32,
    /// Members this call removed (the config's `pool_size` was lowered).
    pub removed: usize,
    /// Members ready now.
    pub ready: usize,
}

/// Brings the warm pool of the shim config at `config` (default: as the
/// shim finds it) to its `pool_size`, for the node service before pods
/// arrive: boots the members it lacks, removes those beyond its size (all
/// of them at `pool_size = 0`).
pub fn fill_pool(config: Option<&Path>) -> anyhow::Result<Filled> {
    let cfg = read_config(config)?;
    tracing::info!(size = cfg.pool_size, "filling the warm pool");
    let daemon = api_daemon::connect(&cfg.daemon_socket);
    retire::sweep(&cfg, &*daemon)?;
    let p = pool::for_shape(&cfg, cfg.vcpus, cfg.memory_mib);
    let (booted, removed) = p.refill(&*daemon, &cfg, cfg.boot_timeout())?;
    Ok(Filled {
        pool: p.name(),
        booted,
        removed,
        ready: p.ready(&*daemon)?,
    })
}

/// Makes sure the fork template of the shim config at `config` (default:
/// as the shim finds it) is booted and paused, for the node service before
/// fork-started pods arrive. Returns the
/// template's VM id and whether this call booted it.
pub fn make_template(config: Option<&Path>) -> anyhow::Result<(String, bool)> {
    let cfg = read_config(config)?;
    let daemon = api_daemon::connect(&cfg.daemon_socket);
    retire::sweep(&cfg, &*daemon)?;
    let t = template::for_shape(&cfg, cfg.vcpus, cfg.memory_mib);
    let booted = t.ensure(&*daemon, &cfg, (cfg.vcpus, cfg.memory_mib), cfg.boot_timeout())?;
    Ok((t.vm_id, booted))
}

/// Empties the warm pool of the shim config at `config` (default: as the
/// shim finds it) before a node changes that config: returns the pool's
/// name, the members deleted, and those still booting (left to finish).
pub fn drain_pool(config: Option<&Path>) -> anyhow::Result<(String, usize, usize)> {
    let cfg = read_config(config)?;
    let daemon = api_daemon::connect(&cfg.daemon_socket);
    let p = pool::for_shape(&cfg, cfg.vcpus, cfg.memory_mib);
    let (removed, booting) = p.drain(&*daemon)?;
    Ok((p.name(), removed, booting))
}

/// Deletes the fork template of the shim config at `config` (default: as
/// the shim finds it) before a node changes that config: returns the
/// template's VM id and whether the daemon had it.
pub fn remove_template(config: Option<&Path>) -> anyhow::Result<(String, bool)> {
    let cfg = read_config(config)?;
    let daemon = api_daemon::connect(&cfg.daemon_socket);
    let t = template::for_shape(&cfg, cfg.vcpus, cfg.memory_mib);
    let had = t.remove(&*daemon, cfg.boot_timeout() + std::time::Duration::from_secs(30))?;
    Ok((t.vm_id, had))
}

fn read_config(config: Option<&Path>) -> anyhow::Result<config::ShimConfig> {
    match config {
        Some(p) => config::ShimConfig::read(p),
        None => config::ShimConfig::load(),
    }
}

/// Runs the shim (containerd's `start`, `delete`, or the server, from the
/// process's arguments). Exits the process with status 1 on failure, as
/// containerd's shims do.
pub fn run() {
    // No reaper: the library's SIGCHLD handler would reap the shim's own
    // children (mkfs.erofs) before `Command` could (ECHILD); the shim
    // starts no container process on the host, so there is nothing else
    // to reap and no need to be a subreaper.
    let config = containerd_shim::Config {
        no_reaper: true,
        no_sub_reaper: true,
        ..Default::default()
    };
    containerd_shim::run::<service::K7dShim>(RUNTIME_ID, Some(config));
}

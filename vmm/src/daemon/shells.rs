//! The `k7d-shells` thread: keeps the daemon's pool of VM shells
//! (`vstate/shell.rs`) at what its VMs ask for (`VmConfig.fork.shells`),
//! so that their fork children are built in shells made ahead instead of
//! from scratch (`docs/fork.md`, "Shells").
//!
//! The pool holds, for each shape (vCPUs, RAM), the sum of what the live
//! VMs of that shape ask for, and shells of at most [`POOL_VCPUS`] vCPUs in
//! all. A shell no VM asks for any more goes at the next pass. Shells are
//! the node's, shared by shape: a fork of any VM of that shape takes them.
//! On a host older than Linux 6.7 the pool stays empty
//! ([`crate::vstate::shell::check_host`]).

use std::collections::HashMap;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, Instant};

use super::Daemon;
use super::periodic::Periodic;
use crate::vstate::shell::{Shape, Shell};
use crate::vstate::vm::VmState;

/// How often the thread tops the pool up.
pub const SHELL_PERIOD: Duration = Duration::from_millis(100);

/// The most vCPUs the pool's shells hold, all shapes together (each shell
/// holds a KVM VM and its PIT's kernel thread, and per vCPU an fd and a
/// parked thread).
pub const POOL_VCPUS: usize = 256;

/// How long a shape whose shell could not be made is left alone.
const FAILED_WAIT: Duration = Duration::from_secs(30);

/// The running `k7d-shells` thread; dropping it stops and joins it.
pub struct ShellKeeper(#[expect(dead_code, reason = "held for its Drop")] Periodic);

impl ShellKeeper {
    /// Starts the thread: every `period` it tops the pool of `daemon` up to
    /// what its VMs ask for, one shell at a time, and drops the shells no
    /// VM asks for. It holds the daemon and the VMs weakly, and stops
    /// between two shells when dropped.
    pub fn start(daemon: &Arc<Daemon>, period: Duration) -> std::io::Result<Self> {
        let mut state = KeeperState::default();
        Periodic::start("k7d-shells", daemon, period, move |d, stop| {
            d.keep_shells(&mut state, stop)
        })
        .map(Self)
    }
}

/// What the thread remembers between passes.
#[derive(Default)]
pub(super) struct KeeperState {
    /// What each VM asked for when last seen unlocked (a VM a request
    /// holds keeps its share).
    wants: HashMap<String, (Shape, u32)>,
    /// Shapes whose last shell failed, and until when they rest.
    failed: HashMap<Shape, Instant>,
    /// Whether the host was found unable to use shells (said once).
    unsupported: bool,
}

impl Daemon {
    /// One pass of the `k7d-shells` thread; false when `stop` said to stop.
    pub(super) fn keep_shells(&self, state: &mut KeeperState, stop: &dyn Fn() -> bool) -> bool {
        let vms = self.live_vms_weakly();
        let live: std::collections::HashSet<&str> = vms.iter().map(|(id, _)| id.as_str()).collect();
        state.wants.retain(|id, _| live.contains(id.as_str()));
        for (id, vm) in vms {
            let Some(vm) = vm.upgrade() else {
                state.wants.remove(&id);
                continue;
            };
            let g = match vm.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            match g.config().fork.shells {
                Some(n) if !matches!(g.state(), VmState::Stopped { .. }) => {
                    state.wants.insert(id, (g.shape(), n));
                }
                _ => {
                    state.wants.remove(&id);
                }
            }
        }
        let mut targets: HashMap<Shape, usize> = HashMap::new();
        for &(shape, n) in state.wants.values() {
            *targets.entry(shape).or_default() += n as usize;
        }
        let gone = self.shells.trim(|shape| targets.get(&shape).copied().unwrap_or(0));
        if gone > 0 {
            tracing::debug!(gone, "shells no VM asks for dropped");
        }
        state.failed.retain(|_, t| Instant::now() < *t);
        if !targets.is_empty()
            && let Err(e) = crate::vstate::shell::check_host()
        {
            if !state.unsupported {
                tracing::warn!(error = %e, "no VM shells on this host; forks build their children from scratch");
                state.unsupported = true;
            }
            return true;
        }
        for (shape, want) in targets {
            if state.failed.contains_key(&shape) {
                continue;
            }
            while self.shells.count(shape) < want && self.shells.total_vcpus() + usize::from(shape.vcpus) <= POOL_VCPUS
            {
                if stop() {
                    return false;
                }
                match Shell::new(shape) {
                    Ok(s) => self.shells.put(s),
                    Err(e) => {
                        tracing::warn!(
                            vcpus = shape.vcpus,
                            ram_mib = shape.ram >> 20,
                            error = %e,
                            "cannot make a VM shell; forks build their children from scratch"
                        );
                        state.failed.insert(shape, Instant::now() + FAILED_WAIT);
                        break;
                    }
                }
            }
        }
        true
    }
}

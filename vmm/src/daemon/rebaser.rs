//! The `k7d-rebase` thread: re-bases the daemon's fork sources that ask
//! for it (`VmConfig.fork.rebase_at_percent`) once they have diverged from
//! their base by that share of their RAM, so that their forks copy at most
//! about that much whatever the source did since its first fork
//! (`docs/fork.md`, "Re-basing"), its own VMs and those in VM processes
//! alike.

use std::collections::HashMap;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, Instant};

use super::periodic::Periodic;
use super::{Daemon, PAUSE_TIMEOUT};
use crate::vstate::memory::PAGE;
use crate::vstate::vm::VmState;

/// How often the thread looks at each fork source's divergence.
pub const REBASE_PERIOD: Duration = Duration::from_millis(500);

/// How long a VM whose re-base (or divergence reading) failed is left alone.
const FAILED_WAIT: Duration = Duration::from_secs(30);

/// The running `k7d-rebase` thread; dropping it stops and joins it.
pub struct Rebaser(#[expect(dead_code, reason = "held for its Drop")] Periodic);

impl Rebaser {
    /// Starts the thread: every `period` it reads the divergence of each VM
    /// of `daemon` that has a threshold and has been forked (KVM's dirty
    /// log and the VMM's bitmaps, harvested while the VM runs) and
    /// re-bases those past it. It holds the daemon and the VMs weakly,
    /// skips a VM a request holds, and stops between two VMs when dropped.
    pub fn start(daemon: &Arc<Daemon>, period: Duration) -> std::io::Result<Self> {
        let mut not_before = HashMap::new();
        Periodic::start("k7d-rebase", daemon, period, move |d, stop| {
            d.rebase_diverged(period, &mut not_before, stop)
        })
        .map(Self)
    }
}

impl Daemon {
    /// One pass of the `k7d-rebase` thread over every VM; false when
    /// `stop` said to stop. A VM re-based waits at least ten times what its
    /// re-base took before the next (at most a tenth of a core on one
    /// VM's re-bases), one whose re-base failed waits [`FAILED_WAIT`].
    pub(super) fn rebase_diverged(
        &self,
        period: Duration,
        not_before: &mut HashMap<String, Instant>,
        stop: &dyn Fn() -> bool,
    ) -> bool {
        let vms = self.live_vms_weakly();
        let remotes = self.live_processes_weakly();
        not_before.retain(|id, _| {
            vms.iter()
                .map(|(v, _)| v)
                .chain(remotes.iter().map(|(r, _)| r))
                .any(|v| v == id)
        });
        for (id, vm) in vms {
            if stop() {
                return false;
            }
            if not_before.get(&id).is_some_and(|t| Instant::now() < *t) {
                continue;
            }
            // Deleted meanwhile: its last handle is not ours to hold.
            let Some(vm) = vm.upgrade() else { continue };
            let g = match vm.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let Some(pct) = g.config().fork.rebase_at_percent else {
                continue;
            };
            // A fork child that was never forked itself has nobody to copy
            // its divergence into.
            if !g.has_been_forked() || !matches!(g.state(), VmState::Running | VmState::Paused) {
                continue;
            }
            let pages = match g.divergence() {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(vm = %id, error = %e, "cannot read how far the vm diverged from its fork base");
                    not_before.insert(id, Instant::now() + FAILED_WAIT);
                    continue;
                }
            };
            if pages * PAGE * 100 < g.ram().size() * u64::from(pct) {
                continue;
            }
            let t = Instant::now();
            let wait = match g.rebase(PAUSE_TIMEOUT) {
                Ok(_) => (t.elapsed() * 10).max(period),
                Err(e) => {
                    tracing::warn!(vm = %id, error = %e, "the vm's threshold re-base failed");
                    FAILED_WAIT
                }
            };
            not_before.insert(id, Instant::now() + wait);
        }
        self.rebase_diverged_processes(remotes, period, not_before, stop)
    }

    /// [`Daemon::rebase_diverged`] for the VMs in VM processes: each VM
    /// process reads its own divergence and re-bases itself when asked
    /// (`divergence` and `rebase` on the channel).
    fn rebase_diverged_processes(
        &self,
        remotes: Vec<(String, std::sync::Weak<std::sync::Mutex<super::processes::Remote>>)>,
        period: Duration,
        not_before: &mut HashMap<String, Instant>,
        stop: &dyn Fn() -> bool,
    ) -> bool {
        use crate::vmproc::proto::{Reply, Request};
        for (id, r) in remotes {
            if stop() {
                return false;
            }
            if not_before.get(&id).is_some_and(|t| Instant::now() < *t) {
                continue;
            }
            let Some(r) = r.upgrade() else { continue };
            let mut g = match r.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let Some(pct) = g.config().fork.rebase_at_percent else {
                continue;
            };
            let ram = g.config().memory_bytes();
            let pages = match g.call(&Request::Divergence) {
                Ok(Reply::Divergence { pages: Some(p) }) => p,
                Ok(Reply::Divergence { pages: None }) => continue,
                Ok(other) => {
                    tracing::warn!(vm = %id, reply = ?other, "its VM process answered the divergence with something else");
                    not_before.insert(id, Instant::now() + FAILED_WAIT);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(vm = %id, error = %e, "cannot read how far the vm diverged from its fork base");
                    not_before.insert(id, Instant::now() + FAILED_WAIT);
                    continue;
                }
            };
            if pages * PAGE * 100 < ram * u64::from(pct) {
                continue;
            }
            let t = Instant::now();
            let wait = match g.call(&Request::Rebase) {
                Ok(Reply::Rebased(_)) => (t.elapsed() * 10).max(period),
                Ok(other) => {
                    tracing::warn!(vm = %id, reply = ?other, "its VM process answered the re-base with something else");
                    FAILED_WAIT
                }
                Err(e) => {
                    tracing::warn!(vm = %id, error = %e, "the vm's threshold re-base failed");
                    FAILED_WAIT
                }
            };
            not_before.insert(id, Instant::now() + wait);
        }
        true
    }
}

//! The `k7d-rebase` thread: re-bases the daemon's fork sources that ask
//! for it (`VmConfig.fork.rebase_at_percent`) once they have diverged from
//! their base by that share of their RAM, so that their forks copy at most
//! about that much whatever the source did since its first fork
//! (`docs/fork.md`, "Re-basing").

use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Daemon, PAUSE_TIMEOUT, Slot};
use crate::vstate::memory::PAGE;
use crate::vstate::vm::{Vm, VmState};

/// How often the thread looks at each fork source's divergence.
pub const REBASE_PERIOD: Duration = Duration::from_millis(500);

/// The running `k7d-rebase` thread; dropping it stops and joins it.
pub struct Rebaser {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Rebaser {
    /// Starts the thread: every `period` it reads the divergence of each VM
    /// of `daemon` that has a threshold (KVM's dirty log and the VMM's
    /// bitmaps, harvested while the VM runs) and re-bases those past it.
    /// It holds the daemon weakly, and skips a VM a request holds.
    pub fn start(daemon: &Arc<Daemon>, period: Duration) -> std::io::Result<Self> {
        let weak: Weak<Daemon> = Arc::downgrade(daemon);
        let (tx, rx) = channel::<()>();
        let thread = std::thread::Builder::new().name("k7d-rebase".into()).spawn(move || {
            loop {
                match rx.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
                let Some(d) = weak.upgrade() else { return };
                d.rebase_diverged();
            }
        })?;
        Ok(Self {
            stop: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for Rebaser {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Daemon {
    /// One pass of the `k7d-rebase` thread over every VM.
    pub(super) fn rebase_diverged(&self) {
        let vms: Vec<Arc<Mutex<Vm>>> = self
            .vms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(|s| match s {
                Slot::Vm(v) => Some(v.clone()),
                _ => None,
            })
            .collect();
        for vm in vms {
            let g = match vm.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let Some(pct) = g.config().fork.rebase_at_percent else {
                continue;
            };
            if !g.ram().is_frozen() || !matches!(g.state(), VmState::Running | VmState::Paused) {
                continue;
            }
            let pages = match g.divergence() {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(vm = %g.id(), error = %e, "cannot read how far the vm diverged from its fork base");
                    continue;
                }
            };
            if pages * PAGE * 100 < g.ram().size() * u64::from(pct) {
                continue;
            }
            if let Err(e) = g.rebase(PAUSE_TIMEOUT) {
                tracing::warn!(vm = %g.id(), error = %e, "re-basing the vm failed; it keeps its base");
            }
        }
    }
}

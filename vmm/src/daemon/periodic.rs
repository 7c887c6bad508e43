//! A daemon thread that runs one pass over the daemon every period until
//! it is dropped (`k7d-rebase`, `k7d-shells`). It holds the daemon weakly
//! (a pass upgrades it, and the thread ends once the daemon is gone), and
//! a pass is told through `stop` when to give up between two steps.

use std::sync::mpsc::{RecvTimeoutError, Sender, TryRecvError, channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Daemon;

/// The running thread; dropping it stops it (between two steps of a pass)
/// and joins it.
pub(super) struct Periodic {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Periodic {
    /// Starts thread `name`: every `period`, `pass(daemon, stop)`, until
    /// dropped, the daemon is gone, or a pass returns false (it saw
    /// `stop()` say so).
    pub(super) fn start(
        name: &str,
        daemon: &Arc<Daemon>,
        period: Duration,
        mut pass: impl FnMut(&Daemon, &dyn Fn() -> bool) -> bool + Send + 'static,
    ) -> std::io::Result<Self> {
        let weak: Weak<Daemon> = Arc::downgrade(daemon);
        let (tx, rx) = channel::<()>();
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            loop {
                match rx.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
                let Some(d) = weak.upgrade() else { return };
                let stop = || !matches!(rx.try_recv(), Err(TryRecvError::Empty));
                if !pass(&d, &stop) {
                    return;
                }
            }
        })?;
        Ok(Self {
            stop: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Daemon {
    /// Every VM in a VM process by id, held weakly (as
    /// [`Daemon::live_vms_weakly`]).
    pub(super) fn live_processes_weakly(&self) -> Vec<(String, Weak<std::sync::Mutex<super::processes::Remote>>)> {
        self.vms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(id, s)| match s {
                super::Slot::Process(r) => Some((id.clone(), Arc::downgrade(r))),
                _ => None,
            })
            .collect()
    }

    /// Every built VM by id, held weakly (for a pass that must not keep a
    /// deleted VM alive).
    pub(super) fn live_vms_weakly(&self) -> Vec<(String, Weak<std::sync::Mutex<crate::vstate::vm::Vm>>)> {
        self.vms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(id, s)| match s {
                super::Slot::Vm(v) => Some((id.clone(), Arc::downgrade(v))),
                _ => None,
            })
            .collect()
    }
}

impl Drop for Periodic {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

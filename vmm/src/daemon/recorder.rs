//! Records a VM's stop on behalf of its last vCPU thread.
//!
//! The last vCPU thread to leave runs the VM's stop callback, also when the
//! guest stops the VM on its own. vCPU threads may not open or lock files
//! (their seccomp filter, `docs/security.md`), so the callback hands the
//! record to this thread, a control thread, and waits (bounded) until it is
//! written: a stop is on disk before `stop` returns, as before.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};
use std::time::Duration;

use super::store::RecordStore;
use crate::vstate::control::{OnStopped, StopReason};
use crate::vstate::vm::VmState;

/// How long a vCPU thread waits for its record to be written.
const ACK_WAIT: Duration = Duration::from_secs(10);

struct Job {
    vm_id: String,
    reason: StopReason,
    done: SyncSender<()>,
}

/// The recording thread's handle; the thread ends when every handle and
/// every callback made by [`Recorder::on_stopped`] are gone.
pub(super) struct Recorder {
    tx: Sender<Job>,
}

impl Recorder {
    /// Starts the thread (named `k7d-record`).
    pub(super) fn start(store: Arc<RecordStore>) -> std::io::Result<Self> {
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name("k7d-record".into())
            .spawn(move || run(&store, &rx))?;
        Ok(Self { tx })
    }

    /// The stop callback for VM `vm_id`.
    pub(super) fn on_stopped(&self, vm_id: &str) -> OnStopped {
        let tx = self.tx.clone();
        let vm_id = vm_id.to_string();
        Box::new(move |reason| {
            let (done, wait) = sync_channel(1);
            let job = Job {
                vm_id: vm_id.clone(),
                reason: reason.clone(),
                done,
            };
            if tx.send(job).is_err() {
                tracing::error!(vm = %vm_id, "the record thread is gone; the VM's stop is not recorded");
                return;
            }
            if wait.recv_timeout(ACK_WAIT).is_err() {
                tracing::warn!(vm = %vm_id, "the VM's stop record was not written within {ACK_WAIT:?}");
            }
        })
    }
}

fn run(store: &RecordStore, rx: &Receiver<Job>) {
    for job in rx {
        if let Err(e) = store.update(&job.vm_id, |r| {
            r.state = VmState::Stopped {
                reason: job.reason.clone(),
            }
        }) {
            tracing::error!(vm = %job.vm_id, error = %e, "cannot record the VM's stop");
        }
        store.events().stopped(&job.vm_id, &job.reason);
        let _ = job.done.send(());
    }
}

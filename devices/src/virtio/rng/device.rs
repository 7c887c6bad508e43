//! The virtio-rng device: identity, features, worker start/stop.

use std::fs::File;

use tracing::info;
use virtio_queue::Queue;

use super::event_handler::RngWorker;
use super::{ENTROPY_SOURCE, QUEUE_SIZE};
use crate::virtio::worker::WorkerThread;
use crate::virtio::{
    ActivateContext, ForkBackend, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
    VirtioDevice, VirtioError,
};

/// A virtio entropy device.
pub struct Rng {
    source: File,
    queue_sizes: [u16; 1],
    worker: WorkerThread<RngWorker>,
}

impl std::fmt::Debug for Rng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rng")
            .field("active", &self.worker.is_running())
            .finish_non_exhaustive()
    }
}

impl Rng {
    /// A device reading from [`ENTROPY_SOURCE`].
    pub fn new() -> Result<Self, VirtioError> {
        let source = File::open(ENTROPY_SOURCE).map_err(|source| VirtioError::Open {
            path: ENTROPY_SOURCE.into(),
            source,
        })?;
        Ok(Self::with_source(source))
    }

    /// A device reading from `source` (any readable file; tests use this).
    pub fn with_source(source: File) -> Self {
        Self {
            source,
            queue_sizes: [QUEUE_SIZE],
            worker: WorkerThread::new("k7d-virtio-rng"),
        }
    }

    /// Whether a worker thread is running.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }

    /// Whether the device is paused (activated, worker parked).
    pub fn is_paused(&self) -> bool {
        self.worker.is_parked()
    }

    fn stop_worker(&mut self) -> Option<Queue> {
        self.worker.stop().map(|w| w.queue)
    }
}

impl VirtioDevice for Rng {
    fn name(&self) -> &'static str {
        "rng"
    }

    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_RING_F_INDIRECT_DESC
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), VirtioError> {
        if self.worker.is_active() {
            return Err(VirtioError::AlreadyActive(self.name()));
        }
        let got = ctx.queues.len();
        let Ok([q]) = <[_; 1]>::try_from(ctx.queues) else {
            return Err(VirtioError::QueueCount {
                device: "rng",
                expected: 1,
                got,
            });
        };
        let worker = RngWorker {
            mem: ctx.mem,
            queue: q.queue,
            index: q.index,
            notify: q.notify,
            interrupt: ctx.interrupt,
            source: self.source.try_clone().map_err(|source| VirtioError::Open {
                path: ENTROPY_SOURCE.into(),
                source,
            })?,
            malformed: 0,
        };
        self.worker.spawn(worker)?;
        info!(features = ctx.acked_features, "virtio-rng activated");
        Ok(())
    }

    fn reset(&mut self) -> Vec<Queue> {
        self.stop_worker().into_iter().collect()
    }

    /// Parks the worker after the chain it is serving (each chain is read
    /// and completed in one go): when this returns the device writes no
    /// guest memory. A device that is not active has nothing to pause.
    fn pause(&mut self) -> Result<(), VirtioError> {
        self.worker.park();
        Ok(())
    }

    /// Restarts a paused worker where it stopped (queue indexes kept).
    fn resume(&mut self) -> Result<(), VirtioError> {
        self.worker.unpark()
    }

    fn debug_state(&self) -> Vec<String> {
        vec![format!("backend worker={}", self.worker.state_word())]
    }

    /// A child reads entropy from its own source; rng keeps no state.
    fn can_fork(&self) -> Result<(), VirtioError> {
        Ok(())
    }

    fn fork_backend(&mut self) -> Result<ForkBackend, VirtioError> {
        Ok(ForkBackend::from_config())
    }

    /// rng keeps nothing beyond its queue, which the transport carries.
    fn snapshot(&mut self) -> Result<Vec<u8>, VirtioError> {
        Ok(Vec::new())
    }

    fn restore(&mut self, state: &[u8]) -> Result<(), VirtioError> {
        if !state.is_empty() {
            return Err(VirtioError::Restore {
                device: "rng",
                why: format!("rng keeps no state, but {} bytes were saved", state.len()),
            });
        }
        Ok(())
    }
}

impl Drop for Rng {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_hooks() {
        let mut r = Rng::new().unwrap();
        // Pausing an idle device is a no-op; its state is empty, and a state
        // that is not empty is refused with a sentence.
        r.pause().unwrap();
        r.resume().unwrap();
        assert!(!r.is_paused());
        assert_eq!(r.snapshot().unwrap(), Vec::<u8>::new());
        r.restore(&[]).unwrap();
        let e = r.restore(b"{}").unwrap_err();
        assert_eq!(
            e.to_string(),
            "the rng device cannot be restored: rng keeps no state, but 2 bytes were saved"
        );
        assert!(r.reset().is_empty());
        assert_eq!(r.avail_features() & VIRTIO_F_VERSION_1, VIRTIO_F_VERSION_1);
    }
}

//! One device worker thread that can be parked (pause) and restarted
//! (resume) with all its state, or stopped for good (reset). Shared by the
//! single-worker devices (rng, vsock).

use std::thread::JoinHandle;

use tracing::error;
use vmm_sys_util::eventfd::EventFd;

use super::VirtioError;

/// A worker body: runs until its stop eventfd fires, then returns itself.
pub(crate) trait ParkableWorker: Send + Sized + 'static {
    /// The thread's body.
    fn run(self) -> Self;
}

/// Running, parked, or neither (idle).
pub(crate) struct WorkerThread<W: ParkableWorker> {
    name: &'static str,
    running: Option<(EventFd, JoinHandle<W>)>,
    parked: Option<(EventFd, W)>,
}

impl<W: ParkableWorker> WorkerThread<W> {
    /// An idle slot for threads named `name`.
    pub(crate) fn new(name: &'static str) -> Self {
        Self {
            name,
            running: None,
            parked: None,
        }
    }

    /// Whether a thread runs now.
    pub(crate) fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Whether a worker is parked (paused).
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// Whether the device holds a worker at all (running or parked).
    pub(crate) fn is_active(&self) -> bool {
        self.is_running() || self.is_parked()
    }

    /// Starts `worker` on a thread; `stop` is the eventfd it watches.
    pub(crate) fn spawn(&mut self, stop: EventFd, worker: W, device: &'static str) -> Result<(), VirtioError> {
        let token = crate::sandbox::capture();
        let name = self.name;
        let handle = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || {
                let _sandbox = crate::sandbox::enter(token, name);
                worker.run()
            })
            .map_err(|e| VirtioError::Spawn(device, e))?;
        self.running = Some((stop, handle));
        Ok(())
    }

    /// Signals the running thread to stop after what it is serving and joins
    /// it; returns the worker with its stop eventfd (still set).
    fn join(&mut self) -> Option<(EventFd, W)> {
        let (stop, handle) = self.running.take()?;
        if let Err(e) = stop.write(1) {
            error!(thread = self.name, error = %e, "could not signal a device worker to stop");
        }
        match handle.join() {
            Ok(worker) => Some((stop, worker)),
            Err(_) => {
                error!(thread = self.name, "a device worker panicked; its queues are lost");
                None
            }
        }
    }

    /// Pause: joins the running thread and keeps its worker. Idle or already
    /// parked: nothing to do.
    pub(crate) fn park(&mut self) {
        if let Some(w) = self.join() {
            self.parked = Some(w);
        }
    }

    /// Resume: restarts a parked worker where it stopped.
    pub(crate) fn unpark(&mut self, device: &'static str) -> Result<(), VirtioError> {
        let Some((stop, worker)) = self.parked.take() else {
            return Ok(());
        };
        // Clear the stop that parked it, or the new thread leaves at once.
        let _ = stop.read();
        self.spawn(stop, worker, device)
    }

    /// Reset: stops a running worker (or drops a parked one's thread slot)
    /// and returns the worker so the device can take its queues back.
    pub(crate) fn stop(&mut self) -> Option<W> {
        let parked = self.parked.take();
        self.join().or(parked).map(|(_, w)| w)
    }
}

//! The one worker framework every virtio device uses (rng, blk, net, vsock).
//!
//! A device supplies an [`EpollWorker`]: the fds it waits on and what to do
//! when one fires. [`WorkerThread`] owns everything else: the thread (named,
//! entering the VMM's sandbox first), the epoll loop, the stop eventfd, and
//! the life cycle spawn → park (pause) → unpark (resume) → stop (reset).
//!
//! **The stop eventfd rule.** Each [`WorkerThread`] has one stop eventfd for
//! its whole life. [`WorkerThread::park`] and [`WorkerThread::stop`] write it
//! and join the thread; the loop never reads it (it only sees it readable and
//! returns); [`WorkerThread::spawn`] and [`WorkerThread::unpark`] clear it
//! before starting a thread. A stop seen in a batch of events wins over the
//! other events of that batch: they stay pending in their own fds (a queue's
//! notify eventfd keeps its count) and [`EpollWorker::on_start`] serves what
//! they announced when the worker runs again.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;

use tracing::error;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::diag::WorkerDiag;
use super::{Interrupt, VirtioError};

/// The token of the stop eventfd; a worker's own tokens must be below it.
pub(crate) const STOP_TOKEN: u64 = u64::MAX;

/// Most events taken from one `epoll_wait`.
const MAX_EVENTS: usize = 64;

/// Where a worker registers its fds for one run of its thread.
pub(crate) struct Registrar<'a> {
    epoll: &'a Epoll,
}

impl Registrar<'_> {
    /// Wakes the worker with `token` when `fd` has `events` (`EventSet::IN`,
    /// optionally `EDGE_TRIGGERED`).
    pub(crate) fn add(&self, fd: RawFd, events: EventSet, token: u64) -> io::Result<()> {
        if token == STOP_TOKEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a worker token collides with the stop token",
            ));
        }
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    }
}

/// A device worker body: its event sources and its event handling.
pub(crate) trait EpollWorker: Send + 'static {
    /// The device's short name (`rng`, `blk`, `net`, `vsock`), for errors.
    const DEVICE: &'static str;

    /// The interrupt (and through it the device's diagnostics).
    fn interrupt(&self) -> &Interrupt;

    /// The slot of this worker in the device's diagnostics.
    fn diag_slot(&self) -> u16;

    /// Registers the fds this worker waits on, once per run of its thread.
    fn register(&mut self, fds: &Registrar<'_>) -> io::Result<()>;

    /// First thing on a new thread, before [`EpollWorker::on_start`]
    /// (counters that say a worker runs).
    fn on_thread_start(&mut self) {}

    /// Serves what was posted before activation or while parked, before the
    /// first wait.
    fn on_start(&mut self) {}

    /// One event.
    fn handle_event(&mut self, token: u64, events: EventSet);

    /// After every batch of events (work that follows any of them).
    fn after_events(&mut self) {}

    /// Last thing before the thread returns the worker.
    fn on_thread_end(&mut self) {}
}

/// The thread's body: the epoll loop around `worker`, until `stop` fires.
fn run<W: EpollWorker>(mut worker: W, stop: &EventFd, name: &str) -> W {
    let diag = worker.interrupt().diag().clone();
    let me: &WorkerDiag = diag.worker(worker.diag_slot());
    me.started();
    worker.on_thread_start();
    let epoll = Epoll::new().and_then(|epoll| {
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP_TOKEN),
        )?;
        worker.register(&Registrar { epoll: &epoll })?;
        Ok(epoll)
    });
    match epoll {
        Ok(epoll) => serve(&mut worker, &epoll, me, name),
        Err(e) => {
            error!(thread = name, error = %e, "a device worker cannot set up epoll; it serves nothing until reset")
        }
    }
    worker.on_thread_end();
    me.parked();
    worker
}

fn serve<W: EpollWorker>(worker: &mut W, epoll: &Epoll, me: &WorkerDiag, name: &str) {
    worker.on_start();
    let mut events = [EpollEvent::default(); MAX_EVENTS];
    loop {
        me.waiting();
        let waited = epoll.wait(-1, &mut events);
        me.woke();
        let n = match waited {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                error!(thread = name, error = %e, "a device worker's epoll failed; it serves nothing until reset");
                return;
            }
        };
        let batch = &events[..n];
        if batch.iter().any(|ev| ev.data() == STOP_TOKEN) {
            return;
        }
        for ev in batch {
            worker.handle_event(ev.data(), ev.event_set());
        }
        worker.after_events();
    }
}

/// One device worker: idle, running on its thread, or parked (paused) with
/// all its state.
pub(crate) struct WorkerThread<W: EpollWorker> {
    name: String,
    /// Made at the first spawn and kept for the slot's life.
    stop: Option<EventFd>,
    running: Option<Handle<W>>,
    parked: Option<W>,
}

impl<W: EpollWorker> WorkerThread<W> {
    /// An idle slot whose threads are named `name`.
    pub(crate) fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            stop: None,
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

    /// Whether the slot holds a worker at all (running or parked).
    pub(crate) fn is_active(&self) -> bool {
        self.is_running() || self.is_parked()
    }

    /// The parked worker, if any.
    pub(crate) fn parked(&self) -> Option<&W> {
        self.parked.as_ref()
    }

    /// The parked worker, to change (a medium change while parked).
    pub(crate) fn parked_mut(&mut self) -> Option<&mut W> {
        self.parked.as_mut()
    }

    /// "running", "parked" or "none", for state dumps.
    pub(crate) fn state_word(&self) -> &'static str {
        if self.is_running() {
            "running"
        } else if self.is_parked() {
            "parked"
        } else {
            "none"
        }
    }

    /// Starts `worker` on a new thread. A slot that holds a worker refuses.
    pub(crate) fn spawn(&mut self, worker: W) -> Result<(), VirtioError> {
        if self.is_active() {
            return Err(VirtioError::AlreadyActive(W::DEVICE));
        }
        self.start(worker).map_err(|(_, e)| e)
    }

    /// Starts a thread for `worker`; on failure hands the worker back
    /// (`None` only if it was lost with a thread that never ran).
    fn start(&mut self, worker: W) -> Result<(), (Option<W>, VirtioError)> {
        let stop = match self.stop_fd() {
            Ok(s) => s,
            Err(e) => return Err((Some(worker), VirtioError::EventFd(e))),
        };
        let token = crate::sandbox::capture();
        let name = self.name.clone();
        // The worker travels through a slot it can be taken back from if
        // the thread cannot be created.
        let slot = std::sync::Arc::new(std::sync::Mutex::new(Some(worker)));
        let theirs = slot.clone();
        let spawned = std::thread::Builder::new().name(self.name.clone()).spawn(move || {
            let _sandbox = crate::sandbox::enter(token, &name);
            let worker = theirs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            // Always there: the spawner took it back only when this thread
            // was never created.
            worker.map(|w| run(w, &stop, &name))
        });
        match spawned {
            Ok(handle) => {
                self.running = Some(handle);
                Ok(())
            }
            Err(e) => {
                let w = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
                if w.is_none() {
                    error!(
                        thread = self.name,
                        "a device worker was lost while its thread failed to start"
                    );
                }
                Err((w, VirtioError::Spawn(W::DEVICE, e)))
            }
        }
    }

    /// The thread's copy of the stop eventfd, cleared: a stop left by the
    /// last park would make the new thread leave at once.
    fn stop_fd(&mut self) -> io::Result<EventFd> {
        let stop = match &self.stop {
            Some(s) => s,
            None => self.stop.insert(EventFd::new(EFD_NONBLOCK)?),
        };
        let _ = stop.read();
        stop.try_clone()
    }

    /// Tells a running thread to stop after the event it is handling.
    pub(crate) fn signal_stop(&self) {
        if self.running.is_some()
            && let Some(stop) = &self.stop
            && let Err(e) = stop.write(1)
        {
            error!(thread = self.name, error = %e, "could not signal a device worker to stop");
        }
    }

    /// Signals (if not yet) and joins a running thread; keeps its worker
    /// parked. Idle or already parked: nothing to do.
    pub(crate) fn park(&mut self) {
        self.signal_stop();
        let Some(handle) = self.running.take() else {
            return;
        };
        match handle.join() {
            Ok(Some(w)) => self.parked = Some(w),
            Ok(None) => {}
            Err(_) => error!(thread = self.name, "a device worker panicked; its queues are lost"),
        }
    }

    /// Restarts a parked worker where it stopped. If its thread cannot be
    /// created the worker stays parked.
    pub(crate) fn unpark(&mut self) -> Result<(), VirtioError> {
        let Some(worker) = self.parked.take() else {
            return Ok(());
        };
        self.start(worker).map_err(|(w, e)| {
            self.parked = w;
            e
        })
    }

    /// Reset: stops a running thread (or takes a parked worker) and returns
    /// the worker, so the device can take its queues back.
    pub(crate) fn stop(&mut self) -> Option<W> {
        self.park();
        self.parked.take()
    }
}

/// A join handle whose thread returns the worker (always `Some` unless the
/// thread never got it).
type Handle<W> = JoinHandle<Option<W>>;

impl<W: EpollWorker> Drop for WorkerThread<W> {
    fn drop(&mut self) {
        self.park();
    }
}

/// Parks every slot of a multi-worker device: every thread is told to stop
/// first, then each is joined, so they wind down in parallel.
pub(crate) fn park_all<W: EpollWorker>(slots: &mut [WorkerThread<W>]) {
    for s in slots.iter() {
        s.signal_stop();
    }
    for s in slots.iter_mut() {
        s.park();
    }
}

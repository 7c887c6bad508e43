//! Run/pause/stop control shared by a VM's owner and its vCPU threads.
//!
//! The owner sets a target (run, pause, stop) and kicks every vCPU thread out
//! of `KVM_RUN` (signal + `immediate_exit`). Each thread checks the target
//! between runs, parks on a condvar while paused, and leaves on stop. The last
//! thread to leave records why the VM stopped and calls the stop callback.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub use k7d_api::state::StopReason;
use thiserror::Error;

/// What the vCPU threads should be doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Run,
    Pause,
    Stop,
}

/// Called once, by the last vCPU thread to leave, with the stop reason.
pub type OnStopped = Box<dyn FnOnce(&StopReason) + Send>;

struct Ctl {
    target: Target,
    nvcpus: usize,
    parked: usize,
    exited: usize,
    reason: Option<StopReason>,
    on_stopped: Option<OnStopped>,
}

/// Errors from control operations.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ControlError {
    /// The VM has stopped.
    #[error("the VM has stopped")]
    Stopped,
    /// Not every vCPU parked in time.
    #[error("{parked} of {nvcpus} vCPUs parked within {timeout_ms} ms")]
    Timeout {
        /// Parked so far.
        parked: usize,
        /// Total.
        nvcpus: usize,
        /// Waited.
        timeout_ms: u128,
    },
}

/// Shared control block of one VM.
pub struct VmControl {
    /// Set once: at creation, or when a shell's block goes to its VM.
    vm_id: OnceLock<String>,
    ctl: Mutex<Ctl>,
    cv: Condvar,
    threads: Mutex<Vec<libc::pthread_t>>,
    first_exit: OnceLock<Instant>,
    exits: AtomicU32,
}

impl VmControl {
    /// A control block for `vm_id`.
    pub fn new(vm_id: &str) -> Self {
        let c = Self::unnamed();
        c.name(vm_id);
        c
    }

    /// A control block for a VM not known yet (a shell's, `vstate/shell.rs`):
    /// [`VmControl::name`] gives it its VM.
    pub fn unnamed() -> Self {
        Self {
            vm_id: OnceLock::new(),
            ctl: Mutex::new(Ctl {
                target: Target::Run,
                nvcpus: 0,
                parked: 0,
                exited: 0,
                reason: None,
                on_stopped: None,
            }),
            cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            first_exit: OnceLock::new(),
            exits: AtomicU32::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Names the VM this block controls; only the first name counts.
    pub fn name(&self, vm_id: &str) {
        if self.vm_id.set(vm_id.to_string()).is_err() {
            tracing::warn!(vm = vm_id, was = self.vm_id(), "a VM control block was named twice");
        }
    }

    /// The VM's id.
    pub fn vm_id(&self) -> &str {
        self.vm_id.get().map_or("(unnamed)", String::as_str)
    }

    /// Sets the callback run once, by the last vCPU thread to leave.
    pub fn set_on_stopped(&self, f: OnStopped) {
        self.lock().on_stopped = Some(f);
    }

    /// Declares the vCPU threads (called once, before they start).
    pub(crate) fn set_threads(&self, nvcpus: usize) {
        self.lock().nvcpus = nvcpus;
    }

    /// Records a started vCPU thread so it can be kicked.
    pub(crate) fn add_thread(&self, t: libc::pthread_t) {
        self.threads.lock().unwrap_or_else(|p| p.into_inner()).push(t);
    }

    /// Forgets the thread ids (before they are joined).
    pub(crate) fn clear_threads(&self) {
        self.threads.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn kick_all(&self) {
        for &t in self.threads.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            crate::sys::kick_thread(t);
        }
    }

    /// Asks every vCPU to leave; the first reason given is the one kept.
    pub fn request_stop(&self, reason: StopReason) {
        {
            let mut c = self.lock();
            if c.reason.is_none() {
                c.reason = Some(reason);
            }
            c.target = Target::Stop;
            self.cv.notify_all();
        }
        self.kick_all();
    }

    /// Parks every vCPU; returns once all are parked (or gone).
    pub fn pause(&self, timeout: Duration) -> Result<(), ControlError> {
        {
            let mut c = self.lock();
            if c.target == Target::Stop {
                return Err(ControlError::Stopped);
            }
            c.target = Target::Pause;
        }
        let deadline = Instant::now() + timeout;
        let mut c = self.lock();
        loop {
            if c.target == Target::Stop {
                return Err(ControlError::Stopped);
            }
            if c.parked + c.exited >= c.nvcpus {
                return Ok(());
            }
            drop(c);
            // Kick again on every round: a thread may have been between its
            // check and KVM_RUN when the first signal came (immediate_exit covers
            // that, the repeat covers a thread that had not registered yet).
            self.kick_all();
            c = self.lock();
            // Look again before waiting: a vCPU that parked between the kick
            // and this lock notified no one who was waiting yet, and the
            // wait below would sleep its whole slice (5 ms) for nothing.
            if c.target == Target::Stop {
                return Err(ControlError::Stopped);
            }
            if c.parked + c.exited >= c.nvcpus {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ControlError::Timeout {
                    parked: c.parked,
                    nvcpus: c.nvcpus,
                    timeout_ms: timeout.as_millis(),
                });
            }
            let wait = (deadline - now).min(Duration::from_millis(5));
            c = self.cv.wait_timeout(c, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Lets parked vCPUs run again.
    pub fn resume(&self) -> Result<(), ControlError> {
        let mut c = self.lock();
        if c.target == Target::Stop {
            return Err(ControlError::Stopped);
        }
        c.target = Target::Run;
        self.cv.notify_all();
        Ok(())
    }

    /// vCPU side: `true` to (re-)enter the guest, `false` to leave. Parks
    /// while paused, calling `on_park(true)` before and `on_park(false)`
    /// after (the state dump's view of the thread).
    pub(crate) fn checkpoint(&self, on_park: impl Fn(bool)) -> bool {
        let mut c = self.lock();
        loop {
            match c.target {
                Target::Run => return true,
                Target::Stop => return false,
                Target::Pause => {
                    on_park(true);
                    c.parked += 1;
                    self.cv.notify_all();
                    while c.target == Target::Pause {
                        c = self.cv.wait(c).unwrap_or_else(|p| p.into_inner());
                    }
                    c.parked -= 1;
                    on_park(false);
                }
            }
        }
    }

    /// For the state dump: the control state (`running`, `pausing`,
    /// `paused`, `stopping`, `stopped`), vCPUs declared, parked, exited.
    pub fn debug_view(&self) -> (&'static str, usize, usize, usize) {
        let c = self.lock();
        let word = match c.target {
            _ if c.nvcpus > 0 && c.exited == c.nvcpus => "stopped",
            Target::Run => "running",
            Target::Pause if c.parked + c.exited >= c.nvcpus => "paused",
            Target::Pause => "pausing",
            Target::Stop => "stopping",
        };
        (word, c.nvcpus, c.parked, c.exited)
    }

    /// vCPU side: this thread is leaving. The last one runs the stop callback.
    pub(crate) fn vcpu_exited(&self) {
        let mut c = self.lock();
        c.exited += 1;
        c.target = Target::Stop;
        if c.exited == c.nvcpus {
            let reason = c.reason.get_or_insert(StopReason::Requested).clone();
            let cb = c.on_stopped.take();
            self.cv.notify_all();
            drop(c);
            if let Some(cb) = cb {
                cb(&reason);
            }
        } else {
            self.cv.notify_all();
            drop(c);
            // The others must leave too.
            self.kick_all();
        }
    }

    /// Waits until every vCPU thread has left; the reason, or `None` on timeout.
    pub fn wait_stopped(&self, timeout: Duration) -> Option<StopReason> {
        let deadline = Instant::now() + timeout;
        let mut c = self.lock();
        loop {
            if c.nvcpus > 0 && c.exited == c.nvcpus {
                return c.reason.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            c = self
                .cv
                .wait_timeout(c, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The stop reason once every vCPU has left.
    pub fn stopped(&self) -> Option<StopReason> {
        let c = self.lock();
        (c.nvcpus > 0 && c.exited == c.nvcpus)
            .then(|| c.reason.clone())
            .flatten()
    }

    /// Whether all vCPUs are parked right now.
    pub fn is_paused(&self) -> bool {
        let c = self.lock();
        c.target == Target::Pause && c.parked == c.nvcpus
    }

    /// vCPU side: counts an exit to userspace, remembering the first one's time.
    pub(crate) fn note_exit(&self) {
        if self.exits.fetch_add(1, Ordering::Relaxed) == 0 {
            let _ = self.first_exit.set(Instant::now());
        }
    }

    /// When the first vCPU exit to userspace happened.
    pub fn first_exit(&self) -> Option<Instant> {
        self.first_exit.get().copied()
    }

    /// How many exits to userspace the vCPUs made.
    pub fn exit_count(&self) -> u32 {
        self.exits.load(Ordering::Relaxed)
    }
}

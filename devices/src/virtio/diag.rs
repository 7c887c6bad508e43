//! What a virtio function's workers leave behind for the state dump
//! (`SIGUSR1`, `vmm/src/diag.rs`, `docs/diagnostics.md`): per queue, where
//! the device stands in the rings and how often it was kicked and
//! interrupted; per worker thread, what it is doing right now.
//!
//! Everything is a `Relaxed` atomic written by the worker that owns the
//! queue and read by the dump thread, which never takes a lock a worker
//! holds. The values are a snapshot for a human, not a synchronisation
//! point: a dump taken while a worker runs may see a `next_used` one batch
//! older than `used.idx` in guest memory.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use virtio_queue::{Queue, QueueT};

/// Nanoseconds since the first call in this process: the clock every
/// diagnostic timestamp uses (device workers and vCPUs alike).
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A `since` timestamp from [`now_ns`] as seconds before now (`None` for "never").
pub fn seconds_ago(since_ns: u64) -> Option<f64> {
    (since_ns != 0).then(|| now_ns().saturating_sub(since_ns) as f64 / 1e9)
}

/// The OS thread id of the calling thread.
pub fn current_tid() -> u64 {
    u64::try_from(k7d_sys::thread::gettid()).unwrap_or(0)
}

const UNKNOWN: u32 = u32::MAX;

/// One queue, as its worker last left it.
#[derive(Debug)]
pub struct QueueDiag {
    next_avail: AtomicU32,
    next_used: AtomicU32,
    kicks: AtomicU64,
    interrupts: AtomicU64,
    suppressed: AtomicU64,
}

impl Default for QueueDiag {
    fn default() -> Self {
        Self::new()
    }
}

impl QueueDiag {
    /// Nothing known yet.
    pub const fn new() -> Self {
        Self {
            next_avail: AtomicU32::new(UNKNOWN),
            next_used: AtomicU32::new(UNKNOWN),
            kicks: AtomicU64::new(0),
            interrupts: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Records where the device stands in `q` (after serving it).
    pub fn note_position(&self, q: &Queue) {
        self.next_avail.store(u32::from(q.next_avail()), Ordering::Relaxed);
        self.next_used.store(u32::from(q.next_used()), Ordering::Relaxed);
    }

    /// Forgets the position (the queue went back to the transport).
    pub fn forget_position(&self) {
        self.next_avail.store(UNKNOWN, Ordering::Relaxed);
        self.next_used.store(UNKNOWN, Ordering::Relaxed);
    }

    /// Counts what a read of the queue's notify eventfd returned (the number
    /// of guest kicks since the last read; an error means none).
    pub fn note_kick(&self, read: std::io::Result<u64>) {
        if let Ok(n) = read {
            self.kicks.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Counts an interrupt raised for this queue (delivered or left pending).
    pub fn note_interrupt(&self) {
        self.interrupts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts used buffers the guest asked not to be interrupted for
    /// (EVENT_IDX said no).
    pub fn note_suppressed(&self) {
        self.suppressed.fetch_add(1, Ordering::Relaxed);
    }

    /// The device's `next_avail` and `next_used`, once a worker recorded them.
    pub fn position(&self) -> Option<(u16, u16)> {
        let a = self.next_avail.load(Ordering::Relaxed);
        let u = self.next_used.load(Ordering::Relaxed);
        Some((u16::try_from(a).ok()?, u16::try_from(u).ok()?))
    }

    /// Kicks received, interrupts raised, interrupts suppressed.
    pub fn counters(&self) -> (u64, u64, u64) {
        (
            self.kicks.load(Ordering::Relaxed),
            self.interrupts.load(Ordering::Relaxed),
            self.suppressed.load(Ordering::Relaxed),
        )
    }
}

/// What a worker thread is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerState {
    /// Never started.
    Idle,
    /// Blocked in `epoll_wait`.
    Epoll,
    /// Serving its queues (or its backend).
    Busy,
    /// Its thread returned: the device is paused or was reset.
    Parked,
}

impl WorkerState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Epoll,
            2 => Self::Busy,
            3 => Self::Parked,
            _ => Self::Idle,
        }
    }

    /// The word the dump prints.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Epoll => "epoll",
            Self::Busy => "busy",
            Self::Parked => "parked",
        }
    }
}

/// One worker thread.
#[derive(Debug)]
pub struct WorkerDiag {
    tid: AtomicU64,
    state: AtomicU8,
    since_ns: AtomicU64,
    wakeups: AtomicU64,
}

impl Default for WorkerDiag {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerDiag {
    /// Never started.
    pub const fn new() -> Self {
        Self {
            tid: AtomicU64::new(0),
            state: AtomicU8::new(0),
            since_ns: AtomicU64::new(0),
            wakeups: AtomicU64::new(0),
        }
    }

    fn set(&self, s: WorkerState) {
        let v = match s {
            WorkerState::Idle => 0,
            WorkerState::Epoll => 1,
            WorkerState::Busy => 2,
            WorkerState::Parked => 3,
        };
        self.state.store(v, Ordering::Relaxed);
        self.since_ns.store(now_ns(), Ordering::Relaxed);
    }

    /// The calling thread is this worker, starting (busy).
    pub fn started(&self) {
        self.tid.store(current_tid(), Ordering::Relaxed);
        self.set(WorkerState::Busy);
    }

    /// About to block in `epoll_wait`.
    pub fn waiting(&self) {
        self.set(WorkerState::Epoll);
    }

    /// Back from `epoll_wait`: counts a wakeup.
    pub fn woke(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        self.set(WorkerState::Busy);
    }

    /// The thread is leaving (pause or reset).
    pub fn parked(&self) {
        self.set(WorkerState::Parked);
    }

    /// `(tid, state, seconds in that state, wakeups)`; `None` if it never ran.
    pub fn snapshot(&self) -> Option<(u64, WorkerState, f64, u64)> {
        let tid = self.tid.load(Ordering::Relaxed);
        if tid == 0 {
            return None;
        }
        let state = WorkerState::from_u8(self.state.load(Ordering::Relaxed));
        let ago = seconds_ago(self.since_ns.load(Ordering::Relaxed)).unwrap_or(0.0);
        Some((tid, state, ago, self.wakeups.load(Ordering::Relaxed)))
    }
}

static NO_QUEUE: QueueDiag = QueueDiag::new();
static NO_WORKER: WorkerDiag = WorkerDiag::new();

/// The diagnostics of one virtio function: one [`QueueDiag`] per queue and
/// one [`WorkerDiag`] slot per queue (a worker uses the slot of the first
/// queue it serves: net pair k uses slot 2k, a single-worker device slot 0).
#[derive(Debug)]
pub struct DeviceDiag {
    queues: Box<[QueueDiag]>,
    workers: Box<[WorkerDiag]>,
}

impl DeviceDiag {
    /// Diagnostics for a function with `queues` queues.
    pub fn new(queues: usize) -> Self {
        Self {
            queues: (0..queues).map(|_| QueueDiag::new()).collect(),
            workers: (0..queues).map(|_| WorkerDiag::new()).collect(),
        }
    }

    /// Queue `index` (a shared dummy for an index the function does not have,
    /// so a worker never has to handle a missing slot).
    pub fn queue(&self, index: u16) -> &QueueDiag {
        self.queues.get(usize::from(index)).unwrap_or(&NO_QUEUE)
    }

    /// Worker slot `slot` (a shared dummy past the end).
    pub fn worker(&self, slot: u16) -> &WorkerDiag {
        self.workers.get(usize::from(slot)).unwrap_or(&NO_WORKER)
    }

    /// Number of queues (and worker slots).
    pub fn len(&self) -> usize {
        self.queues.len()
    }

    /// Whether the function has no queue.
    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_positions_and_out_of_range_slots() {
        let d = DeviceDiag::new(2);
        assert_eq!(d.queue(0).position(), None);
        let q = Queue::new(16).unwrap();
        d.queue(1).note_position(&q);
        assert_eq!(d.queue(1).position(), Some((0, 0)));
        d.queue(1).note_kick(Ok(3));
        d.queue(1)
            .note_kick(Err(std::io::Error::from_raw_os_error(libc::EAGAIN)));
        d.queue(1).note_interrupt();
        d.queue(1).note_suppressed();
        assert_eq!(d.queue(1).counters(), (3, 1, 1));
        d.queue(1).forget_position();
        assert_eq!(d.queue(1).position(), None);
        // Past the end: a dummy, never a panic.
        d.queue(7).note_interrupt();
        d.worker(9).started();
        assert_eq!(d.worker(0).snapshot(), None);
        d.worker(0).started();
        d.worker(0).waiting();
        let (tid, st, _, wakeups) = d.worker(0).snapshot().unwrap();
        assert_eq!((tid, st, wakeups), (current_tid(), WorkerState::Epoll, 0));
        d.worker(0).woke();
        d.worker(0).parked();
        let (_, st, _, wakeups) = d.worker(0).snapshot().unwrap();
        assert_eq!((st.as_str(), wakeups), ("parked", 1));
    }
}

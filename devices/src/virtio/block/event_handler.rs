//! The virtio-blk request path ([`RequestHandler`]) and the I/O worker loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;
use std::os::fd::AsRawFd;
use tracing::{debug, error, warn};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::Bytes;

use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{ID_BYTES, MAX_DESCRIPTORS, SECTOR_SHIFT, status};
use crate::virtio::worker::{EpollWorker, Registrar};
use crate::virtio::{GuestMemoryHandle, GuestMemoryTracked, Interrupt};
use k7d_disk::request::{Limits, Rejected, Request, RequestError, RequestType, Segment, parse};
use k7d_disk::{DiskAt, DiskImage};

/// How long the worker watches the ring after a batch before sleeping.
const POLL_AFTER_BATCH: std::time::Duration = std::time::Duration::from_micros(30);
/// Most batches served by one polling spell before the worker looks at its
/// eventfds again.
const POLL_ROUNDS: usize = 64;

const TOKEN_QUEUE: u64 = 0;

/// Counters of one device, as of a moment ([`BlockCounters::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Chains returned to the guest.
    pub completed: u64,
    /// Requests answered `VIRTIO_BLK_S_OK`.
    pub ok: u64,
    /// Requests answered IOERR / UNSUPP.
    pub errors: u64,
    /// Chains returned with length 0 (no usable status byte).
    pub dropped: u64,
    /// Reads answered OK.
    pub reads: u64,
    /// The bytes those reads returned.
    pub read_bytes: u64,
    /// Writes answered OK.
    pub writes: u64,
    /// The bytes those writes wrote.
    pub write_bytes: u64,
    /// Flushes answered OK.
    pub flushes: u64,
}

/// The device's live counters: written by its one worker at a time (each
/// activation's handler takes the device's), read by anyone at any time
/// (the daemon's scrape) without stopping the worker. Monotonic over the
/// device's life.
#[derive(Debug, Default)]
pub struct BlockCounters {
    completed: AtomicU64,
    ok: AtomicU64,
    errors: AtomicU64,
    dropped: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
}

/// Adds `n` to a counter that has one writer (the worker): a load and a
/// store, no locked read-modify-write on the request path.
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

impl BlockCounters {
    /// The counters now.
    pub fn stats(&self) -> BlockStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BlockStats {
            completed: r(&self.completed),
            ok: r(&self.ok),
            errors: r(&self.errors),
            dropped: r(&self.dropped),
            reads: r(&self.reads),
            read_bytes: r(&self.read_bytes),
            writes: r(&self.writes),
            write_bytes: r(&self.write_bytes),
            flushes: r(&self.flushes),
        }
    }
}

/// Most chains served before the worker looks at its stop eventfd again.
pub const MAX_BATCH: usize = 256;

/// What one [`RequestHandler::process_queue`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Chains returned to the guest.
    pub served: usize,
    /// The guest wants an interrupt for them (honours EVENT_IDX).
    pub notify: bool,
    /// The batch was cut at [`MAX_BATCH`]; more chains may be available.
    pub more: bool,
}

/// Serves a blk queue: pops every available chain, executes it, writes its
/// status, returns it. Used by the worker thread and by the fuzz targets.
#[derive(Debug)]
pub struct RequestHandler {
    disk: Arc<DiskImage>,
    serial: [u8; ID_BYTES],
    limits: Limits,
    counters: Arc<BlockCounters>,
}

impl RequestHandler {
    /// A handler for `disk` answering GET_ID with `serial` (NUL-padded),
    /// counting from zero.
    pub fn new(disk: Arc<DiskImage>, serial: [u8; ID_BYTES], limits: Limits) -> Self {
        Self::with_counters(disk, serial, limits, Arc::default())
    }

    /// As [`Self::new`], counting into `counters` (a device's, kept over
    /// its activations). One handler at a time may count into them.
    pub fn with_counters(
        disk: Arc<DiskImage>,
        serial: [u8; ID_BYTES],
        limits: Limits,
        counters: Arc<BlockCounters>,
    ) -> Self {
        Self {
            disk,
            serial,
            limits,
            counters,
        }
    }

    /// Serves `disk` within `limits` from the next request on (a medium
    /// change; the caller holds the worker parked).
    pub fn set_disk(&mut self, disk: Arc<DiskImage>, limits: Limits) {
        self.disk = disk;
        self.limits = limits;
    }

    /// Counters so far.
    pub fn stats(&self) -> BlockStats {
        self.counters.stats()
    }

    /// Drains the available ring (re-checking after re-enabling notifications,
    /// so a buffer posted in between is not missed), serving at most
    /// [`MAX_BATCH`] chains so a guest that keeps posting (or whose buffers
    /// overwrite its own avail ring) cannot keep the worker from seeing a
    /// stop. An error means the ring itself is unusable (outside memory);
    /// the device then waits for a reset.
    pub fn process_queue(&mut self, queue: &mut Queue, mem: &GuestMemoryTracked) -> Result<Batch, virtio_queue::Error> {
        let mut served = 0usize;
        let mut more = false;
        'outer: loop {
            queue.disable_notification(mem)?;
            while let Some(chain) = queue.pop_descriptor_chain(mem) {
                let head = chain.head_index();
                let len = self.handle_chain(chain);
                queue.add_used(mem, head, len)?;
                bump(&self.counters.completed, 1);
                served += 1;
                if served == MAX_BATCH {
                    more = true;
                    break 'outer;
                }
            }
            if !queue.enable_notification(mem)? {
                break;
            }
            if crate::virtio::ring_unpoppable(queue, mem) {
                return Err(virtio_queue::Error::InvalidAvailRingIndex);
            }
        }
        let notify = served > 0 && queue.needs_notification(mem)?;
        Ok(Batch { served, notify, more })
    }

    /// Serves one chain; returns the used length (bytes written into the
    /// chain's device-writable buffers).
    fn handle_chain(&mut self, chain: DescriptorChain<&GuestMemoryTracked>) -> u32 {
        let mem = chain.memory();
        // Inline for a usual chain: serving a request allocates nothing.
        let mut descs: SmallVec<[Descriptor; 8]> = SmallVec::new();
        for d in chain.clone() {
            if descs.len() == MAX_DESCRIPTORS {
                return self.reject(
                    mem,
                    Rejected {
                        status: None,
                        code: status::IOERR,
                        error: RequestError::TooLong(MAX_DESCRIPTORS),
                    },
                );
            }
            descs.push(d);
        }
        match parse(&descs, mem, &self.limits) {
            Ok(req) => self.execute(mem, &req),
            Err(rej) => self.reject(mem, rej),
        }
    }

    fn reject(&mut self, mem: &GuestMemoryTracked, rej: Rejected) -> u32 {
        let bad = self.counters.errors.load(Ordering::Relaxed) + self.counters.dropped.load(Ordering::Relaxed);
        if bad == 0 {
            warn!(error = %rej.error, "malformed virtio-blk request (further ones logged at debug)");
        } else {
            debug!(error = %rej.error, "malformed virtio-blk request");
        }
        match rej.status {
            Some(addr) => {
                bump(&self.counters.errors, 1);
                match mem.write_obj(rej.code, addr) {
                    Ok(()) => 1,
                    Err(_) => 0,
                }
            }
            None => {
                bump(&self.counters.dropped, 1);
                0
            }
        }
    }

    fn execute(&mut self, mem: &GuestMemoryTracked, req: &Request) -> u32 {
        let (result, written) = match req.kind {
            RequestType::In => {
                let r = self.read_sectors(mem, req);
                (r, req.data_len)
            }
            RequestType::Out => (self.write_sectors(mem, req), 0),
            RequestType::Flush => (self.disk.flush().map_err(|e| RequestError::Io(e.to_string())), 0),
            RequestType::GetId => (write_gather(mem, &req.data, &self.serial), ID_BYTES as u64),
            RequestType::Discard | RequestType::WriteZeroes => (self.discard(req), 0),
        };
        let (code, written) = match result {
            Ok(()) => {
                let c = &self.counters;
                bump(&c.ok, 1);
                match req.kind {
                    RequestType::In => {
                        bump(&c.reads, 1);
                        bump(&c.read_bytes, req.data_len);
                    }
                    RequestType::Out => {
                        bump(&c.writes, 1);
                        bump(&c.write_bytes, req.data_len);
                    }
                    RequestType::Flush => bump(&c.flushes, 1),
                    _ => {}
                }
                (status::OK, written)
            }
            Err(e) => {
                bump(&self.counters.errors, 1);
                warn!(kind = ?req.kind, sector = req.sector, error = %e, "virtio-blk request failed");
                (status::IOERR, 0)
            }
        };
        if mem.write_obj(code, req.status).is_err() {
            // Checked in parse; cannot happen with an immutable region map.
            error!("virtio-blk could not write a status byte that was inside guest memory");
            return 0;
        }
        u32::try_from(written.saturating_add(1)).unwrap_or(u32::MAX)
    }

    fn read_sectors(&self, mem: &GuestMemoryTracked, req: &Request) -> Result<(), RequestError> {
        let mut src = DiskAt {
            disk: &self.disk,
            offset: req.sector << SECTOR_SHIFT,
        };
        for s in &req.data {
            // Image (or overlay) bytes straight into guest RAM; DiskAt marks
            // the bitmap as FileAt does.
            mem.read_exact_volatile_from(s.addr, &mut src, s.len as usize)
                .map_err(|e| RequestError::Io(e.to_string()))?;
        }
        Ok(())
    }

    fn write_sectors(&self, mem: &GuestMemoryTracked, req: &Request) -> Result<(), RequestError> {
        if self.disk.read_only() {
            return Err(RequestError::ReadOnly);
        }
        let mut dst = DiskAt {
            disk: &self.disk,
            offset: req.sector << SECTOR_SHIFT,
        };
        for s in &req.data {
            mem.write_all_volatile_to(s.addr, &mut dst, s.len as usize)
                .map_err(|e| RequestError::Io(e.to_string()))?;
        }
        Ok(())
    }

    fn discard(&self, req: &Request) -> Result<(), RequestError> {
        if self.disk.read_only() {
            return Err(RequestError::ReadOnly);
        }
        for r in &req.ranges {
            let (off, len) = (r.sector << SECTOR_SHIFT, u64::from(r.sectors) << SECTOR_SHIFT);
            let res = if req.kind == RequestType::Discard {
                self.disk.discard(off, len)
            } else {
                self.disk.write_zeroes(off, len, r.unmap)
            };
            res.map_err(|e| RequestError::Io(e.to_string()))?;
        }
        Ok(())
    }
}

/// Scatters `bytes` over `segs` (checked ranges), through `Bytes`.
fn write_gather(mem: &GuestMemoryTracked, segs: &[Segment], bytes: &[u8]) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in segs {
        if done == bytes.len() {
            break;
        }
        let n = (bytes.len() - done).min(s.len as usize);
        mem.write_slice(&bytes[done..done + n], s.addr)
            .map_err(|e| RequestError::Io(e.to_string()))?;
        done += n;
    }
    Ok(())
}

/// One device's I/O worker: the queue and its notify eventfd (the worker
/// framework adds the stop eventfd).
pub(super) struct BlockWorker {
    pub(super) mem: GuestMemoryHandle,
    pub(super) queue: Queue,
    pub(super) index: u16,
    pub(super) notify: EventFd,
    pub(super) interrupt: Interrupt,
    pub(super) handler: RequestHandler,
    /// Set once the ring proved unusable; the worker idles until reset.
    pub(super) broken: bool,
}

/// A stop is seen between batches: I/O is synchronous, so nothing is in
/// flight when the worker parks.
impl EpollWorker for BlockWorker {
    const DEVICE: &'static str = "blk";

    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    fn diag_slot(&self) -> u16 {
        self.index
    }

    fn register(&mut self, fds: &Registrar<'_>) -> std::io::Result<()> {
        fds.add(self.notify.as_raw_fd(), EventSet::IN, TOKEN_QUEUE)
    }

    /// Buffers posted before activation / while paused.
    fn on_start(&mut self) {
        self.process();
    }

    fn handle_event(&mut self, token: u64, _: EventSet) {
        if token == TOKEN_QUEUE {
            // Non-blocking; EAGAIN only means another wakeup consumed it.
            self.interrupt.diag().queue(self.index).note_kick(self.notify.read());
            self.process();
            self.poll_briefly();
        }
    }
}

impl BlockWorker {
    /// After a batch, watches the avail ring for up to [`POLL_AFTER_BATCH`]
    /// before going back to sleep: a driver that keeps the queue busy posts
    /// its next requests within microseconds, and picking them up here saves
    /// it a kick and this thread a wakeup per batch (QEMU's iothreads poll
    /// for up to 32 us the same way). An idle queue costs one short spin.
    fn poll_briefly(&mut self) {
        if self.broken {
            return;
        }
        let mut deadline = std::time::Instant::now() + POLL_AFTER_BATCH;
        // Bounded: a guest that never stops posting still lets the worker see
        // its stop eventfd between rounds.
        for _ in 0..POLL_ROUNDS {
            loop {
                if std::time::Instant::now() >= deadline {
                    return;
                }
                let mem: &GuestMemoryTracked = &self.mem;
                match self.queue.avail_idx(mem, std::sync::atomic::Ordering::Acquire) {
                    Ok(idx) if idx.0 != self.queue.next_avail() => break,
                    Ok(_) => std::hint::spin_loop(),
                    Err(_) => return,
                }
            }
            self.process();
            if self.broken {
                return;
            }
            deadline = std::time::Instant::now() + POLL_AFTER_BATCH;
        }
    }

    fn process(&mut self) {
        if self.broken {
            return;
        }
        let mem: &GuestMemoryTracked = &self.mem;
        let r = self.handler.process_queue(&mut self.queue, mem);
        let qd = self.interrupt.diag().queue(self.index);
        qd.note_position(&self.queue);
        match r {
            Ok(batch) => {
                if batch.served > 0 && !batch.notify {
                    qd.note_suppressed();
                }
                if batch.notify
                    && let Err(e) = self.interrupt.signal_queue(self.index)
                {
                    warn!(error = %e, "blk could not signal the guest");
                }
                if batch.more
                    && let Err(e) = self.notify.write(1)
                {
                    // Cannot requeue ourselves: the rest waits for the next kick.
                    warn!(error = %e, "blk could not reschedule the rest of a long batch");
                }
            }
            Err(e) => {
                error!(error = ?e, "blk queue is broken; waiting for a reset");
                self.broken = true;
            }
        }
    }
}

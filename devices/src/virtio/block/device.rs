//! The virtio-blk device: identity, features, config space, worker
//! start/stop, pause/resume.

use std::sync::Arc;

use crate::virtio::worker::WorkerThread;
use tracing::info;
use virtio_queue::{Queue, QueueT};

use super::event_handler::{BlockCounters, BlockStats, BlockWorker, RequestHandler};
use super::memory::DeviceMemory;
use super::persist;
use super::{BlockError, CONFIG_LEN, ID_BYTES, MAX_DISCARD_SECTORS, QUEUE_SIZE, SECTOR_SIZE, features};
use crate::virtio::{
    ActivateContext, ForkBackend, RamWriteLog, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC, VirtioDevice, VirtioError,
};
use k7d_disk::DiskImage;
use k7d_disk::request::Limits;

/// The queue indexes of a paused device (what a snapshot must carry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueIndexes {
    /// Next available-ring entry the device will read.
    pub next_avail: u16,
    /// Next used-ring entry the device will write.
    pub next_used: u16,
}

/// A virtio-blk device over a raw image.
pub struct Block {
    disk: Arc<DiskImage>,
    serial: [u8; ID_BYTES],
    queue_sizes: [u16; 1],
    config: [u8; CONFIG_LEN],
    worker: WorkerThread<BlockWorker>,
    /// Counted by each activation's worker, over the device's life.
    counters: Arc<BlockCounters>,
    /// The device's own view of guest memory, when the VMM gave it one
    /// ([`Block::track_writes`]): reported as its RAM write log at a fork.
    view: Option<DeviceMemory>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("path", &self.disk.path())
            .field("read_only", &self.disk.read_only())
            .field("active", &self.is_active())
            .finish_non_exhaustive()
    }
}

impl Block {
    /// A device serving `disk`; GET_ID answers `serial` (at most 20 bytes,
    /// NUL-padded).
    pub fn new(disk: DiskImage, serial: &str) -> Result<Self, BlockError> {
        let s = serial.as_bytes();
        if s.len() > ID_BYTES {
            return Err(BlockError::SerialTooLong(s.len()));
        }
        let mut id = [0u8; ID_BYTES];
        id[..s.len()].copy_from_slice(s);
        let mut dev = Self {
            disk: Arc::new(disk),
            serial: id,
            queue_sizes: [QUEUE_SIZE],
            config: [0; CONFIG_LEN],
            worker: WorkerThread::new("k7d-virtio-blk"),
            counters: Arc::default(),
            view: None,
        };
        dev.config = dev.build_config();
        Ok(dev)
    }

    fn limits(&self) -> Limits {
        let rw = !self.disk.read_only();
        Limits {
            capacity: self.disk.sectors(),
            discard: rw,
            write_zeroes: rw,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_discard_seg: 1,
        }
    }

    /// `struct virtio_blk_config` up to `write_zeroes_may_unmap`.
    fn build_config(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let l = self.limits();
        c[0..8].copy_from_slice(&self.disk.sectors().to_le_bytes()); // capacity
        // size_max (8) unused: no VIRTIO_BLK_F_SIZE_MAX.
        c[12..16].copy_from_slice(&u32::from(QUEUE_SIZE - 2).to_le_bytes()); // seg_max
        c[20..24].copy_from_slice(&(SECTOR_SIZE as u32).to_le_bytes()); // blk_size
        if l.discard {
            c[36..40].copy_from_slice(&l.max_discard_sectors.to_le_bytes()); // max_discard_sectors
            c[40..44].copy_from_slice(&l.max_discard_seg.to_le_bytes()); // max_discard_seg
            c[44..48].copy_from_slice(&1u32.to_le_bytes()); // discard_sector_alignment
        }
        if l.write_zeroes {
            c[48..52].copy_from_slice(&l.max_discard_sectors.to_le_bytes()); // max_write_zeroes_sectors
            c[52..56].copy_from_slice(&l.max_discard_seg.to_le_bytes()); // max_write_zeroes_seg
            c[56] = 1; // write_zeroes_may_unmap
        }
        c
    }

    /// Tells the device that `view` is the memory it will be activated with
    /// (its own dirty bitmap, `DeviceMemory`): a fork drains it as this
    /// device's record of the guest pages it wrote.
    pub fn track_writes(&mut self, view: DeviceMemory) {
        self.view = Some(view);
    }

    /// Whether a worker thread is running (paused counts as not running).
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }

    /// Whether the device is paused (worker parked, queue held).
    pub fn is_paused(&self) -> bool {
        self.worker.is_parked()
    }

    /// Capacity in sectors.
    pub fn sectors(&self) -> u64 {
        self.disk.sectors()
    }

    /// A copy-on-write child of this device's disk as of now, for a forked
    /// VM's own `Block` (see [`DiskImage::fork`]). The first fork freezes
    /// the image file; this device keeps working on its own overlay.
    ///
    /// Call it while the device is paused (or was never activated), so no
    /// request runs on the disk meanwhile; a running device is refused.
    pub fn fork_disk(&self) -> Result<DiskImage, BlockError> {
        if self.is_active() {
            return Err(BlockError::ForkWhileRunning(self.disk.path().to_owned()));
        }
        Ok(self.disk.fork()?)
    }

    /// The disk (the VMM keeps a handle to fork it while the device is paused).
    pub fn disk(&self) -> &Arc<DiskImage> {
        &self.disk
    }

    /// Whether the disk is read-only.
    pub fn read_only(&self) -> bool {
        self.disk.read_only()
    }

    /// The queue indexes while paused (`None` otherwise).
    pub fn paused_queue_indexes(&self) -> Option<QueueIndexes> {
        self.worker.parked().map(|w| QueueIndexes {
            next_avail: w.queue.next_avail(),
            next_used: w.queue.next_used(),
        })
    }

    /// The device's counters now (its worker may be running).
    pub fn stats(&self) -> BlockStats {
        self.counters.stats()
    }
}

impl VirtioDevice for Block {
    fn name(&self) -> &'static str {
        "blk"
    }

    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK
    }

    fn pci_class(&self) -> (u8, u8) {
        // Mass storage, "other".
        (0x01, 0x80)
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_EVENT_IDX
            | VIRTIO_RING_F_INDIRECT_DESC
            | features::FLUSH
            | features::SEG_MAX
            | features::BLK_SIZE;
        if self.disk.read_only() {
            f |= features::RO;
        } else {
            f |= features::DISCARD | features::WRITE_ZEROES;
        }
        f
    }

    fn config_len(&self) -> u64 {
        CONFIG_LEN as u64
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        if start >= CONFIG_LEN {
            return;
        }
        let n = data.len().min(CONFIG_LEN - start);
        data[..n].copy_from_slice(&self.config[start..start + n]);
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), VirtioError> {
        if self.worker.is_active() {
            return Err(VirtioError::AlreadyActive(self.name()));
        }
        let got = ctx.queues.len();
        let Ok([q]) = <[_; 1]>::try_from(ctx.queues) else {
            return Err(VirtioError::QueueCount {
                device: "blk",
                expected: 1,
                got,
            });
        };
        let mut limits = self.limits();
        limits.discard &= ctx.acked_features & features::DISCARD != 0;
        limits.write_zeroes &= ctx.acked_features & features::WRITE_ZEROES != 0;
        let worker = BlockWorker {
            mem: ctx.mem,
            queue: q.queue,
            index: q.index,
            notify: q.notify,
            interrupt: ctx.interrupt,
            handler: RequestHandler::with_counters(self.disk.clone(), self.serial, limits, self.counters.clone()),
            broken: false,
        };
        self.worker.spawn(worker)?;
        info!(
            features = ctx.acked_features,
            path = self.disk.path(),
            "virtio-blk activated"
        );
        Ok(())
    }

    fn reset(&mut self) -> Vec<Queue> {
        self.worker.stop().map(|w| w.queue).into_iter().collect()
    }

    /// Stops the worker once its current batch is done (I/O is synchronous,
    /// so every popped chain has been completed and returned) and parks the
    /// queue. When this returns, the device writes no guest memory.
    /// Idle or already paused: nothing writes guest memory, nothing to do.
    fn pause(&mut self) -> Result<(), VirtioError> {
        self.worker.park();
        Ok(())
    }

    fn resume(&mut self) -> Result<(), VirtioError> {
        self.worker.unpark()
    }

    fn debug_state(&self) -> Vec<String> {
        let st = self.stats();
        vec![format!(
            "backend path={} read_only={} worker={} completed={} ok={} errors={} dropped={}",
            self.disk.path(),
            self.disk.read_only(),
            self.worker.state_word(),
            st.completed,
            st.ok,
            st.errors,
            st.dropped,
        )]
    }

    /// A child gets a copy-on-write view of the disk as of the fork (the
    /// first fork freezes a writable image); read-only images are shared.
    fn can_fork(&self) -> Result<(), VirtioError> {
        Ok(())
    }

    fn fork_backend(&mut self) -> Result<ForkBackend, VirtioError> {
        let disk = self.fork_disk().map_err(|e| {
            if let BlockError::Disk(d @ k7d_disk::DiskError::ChildrenBudget { .. }) = &e {
                return VirtioError::OverBudget(d.to_string());
            }
            let cause = std::error::Error::source(&e)
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            VirtioError::NotForkable {
                device: "blk",
                why: format!("could not give the child a copy-on-write disk: {e}{cause}"),
            }
        })?;
        Ok(ForkBackend::new(disk))
    }

    fn ram_write_logs(&mut self) -> Result<Vec<Arc<dyn RamWriteLog>>, VirtioError> {
        Ok(self
            .view
            .iter()
            .map(|v| Arc::new(v.clone()) as Arc<dyn RamWriteLog>)
            .collect())
    }

    /// A read-only drive takes a read-only medium (an image, or
    /// [`DiskImage::empty`] to eject): the worker is parked around the
    /// swap, so no request sees half of it, and an active driver gets a
    /// configuration-change interrupt (Linux re-reads the capacity). The
    /// read-only feature was negotiated once, so a writable drive or
    /// medium is refused, as is a change while the VM is paused (both
    /// before anything changed: `MediumRefused`). Any other error comes
    /// after the swap (the worker could not restart).
    fn change_medium(&mut self, medium: Arc<DiskImage>) -> Result<(), VirtioError> {
        if !self.disk.read_only() || !medium.read_only() {
            return Err(VirtioError::MediumRefused(
                "only a read-only drive takes a new medium, and only a read-only one".into(),
            ));
        }
        if self.worker.is_parked() {
            return Err(VirtioError::MediumRefused(
                "the drive is paused with its VM; resume the VM first".into(),
            ));
        }
        let was_running = self.worker.is_running();
        self.worker.park();
        self.disk = medium;
        self.config = self.build_config();
        let limits = self.limits();
        let interrupt = match self.worker.parked_mut() {
            Some(w) => {
                w.handler.set_disk(self.disk.clone(), limits);
                Some(w.interrupt.clone())
            }
            None => None,
        };
        info!(
            path = self.disk.path(),
            sectors = self.disk.sectors(),
            "virtio-blk medium changed"
        );
        // From here the new medium is in: an error says what did not
        // follow, and the caller records the change all the same.
        let restarted = if was_running { self.worker.unpark() } else { Ok(()) };
        if let Some(irq) = interrupt
            && let Err(e) = irq.signal_config()
        {
            tracing::warn!(error = %e, "the driver could not be told of the medium change");
        }
        restarted
    }

    /// Requests answered OK by kind and their bytes (reads: returned to
    /// the guest, writes: written to the disk), flushes, and the requests
    /// answered with an error or dropped; live, over the device's life.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        let st = self.stats();
        vec![
            ("read_requests", st.reads),
            ("read_bytes", st.read_bytes),
            ("write_requests", st.writes),
            ("write_bytes", st.write_bytes),
            ("flush_requests", st.flushes),
            ("failed_requests", st.errors.wrapping_add(st.dropped)),
        ]
    }

    fn snapshot(&mut self) -> Result<Vec<u8>, VirtioError> {
        persist::snapshot(self)
    }

    fn restore(&mut self, state: &[u8]) -> Result<(), VirtioError> {
        persist::restore(self, state)
    }
}

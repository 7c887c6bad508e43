//! virtio devices and the virtio-pci (modern, 1.x) transport.
//!
//! - [`VirtioDevice`] is what a device implements: identity, features, config
//!   space, and `activate`/`reset`, which start and stop the device's worker
//!   thread(s). Lifecycle hooks (pause, resume, snapshot, restore) fail loudly
//!   by default.
//! - [`transport::VirtioPciDevice`] wraps a device as a PCI function (the
//!   register map is in `docs/virtio-pci.md`).
//! - [`rng`] is the template device.
//!
//! Guest memory is a [`GuestMemoryHandle`]: an `Arc` of the VMM's
//! `GuestMemoryMmap<AtomicBitmap>`. The region map is immutable for a VM's
//! lifetime (no hotplug), so an `Arc` suffices and every worker reads it
//! without locks; a VMM that hands each device its own view of the same
//! mappings (own `AtomicBitmap`) gets a per-device dirty bitmap for free, since
//! devices write guest RAM only through vm-memory's `Bytes`.

pub mod block;
pub mod diag;
pub mod net;
pub mod rng;
pub mod transport;
pub mod vsock;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use thiserror::Error;
use tracing::debug;
use virtio_queue::Queue;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::pci::{MsixError, MsixVectors};

/// The guest memory type devices see (the VMM's, with a dirty bitmap).
pub type GuestMemoryTracked = GuestMemoryMmap<AtomicBitmap>;

/// Whether a queue cannot be popped although it may claim work: not ready,
/// avail ring at GPA 0 (virtio-queue refuses it), an unreadable avail index,
/// or one claiming more entries than the ring holds. `pop_descriptor_chain`
/// then returns `None` forever while `enable_notification` keeps reporting
/// work: every worker's "drain, re-enable, drain again" loop must check this
/// before going round again, or it spins on guest-written ring state (found
/// by the `net_tx` fuzz target; `devices/tests/ring_spin.rs`).
pub fn ring_unpoppable(q: &mut Queue, mem: &GuestMemoryTracked) -> bool {
    use virtio_queue::QueueOwnedT;
    q.iter(mem).is_err()
}
/// Starts `queue` where the guest's used ring says its device stopped:
/// `next_avail = next_used = used.idx`, read from guest memory (restore and
/// fork: never 0). Exact at a pause, where every popped chain is completed.
/// Returns that index.
pub fn seed_from_used_ring(queue: &mut Queue, mem: &GuestMemoryTracked) -> Result<u16, virtio_queue::Error> {
    use virtio_queue::QueueT;
    let idx = queue.used_idx(mem, Ordering::Acquire)?;
    queue.set_next_avail(idx.0);
    queue.set_next_used(idx.0);
    Ok(idx.0)
}

/// Shared handle to guest memory, cloned into each worker.
pub type GuestMemoryHandle = Arc<GuestMemoryTracked>;

/// `VIRTIO_F_VERSION_1`: the modern interface (required by this transport).
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
/// `VIRTIO_RING_F_INDIRECT_DESC`.
pub const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
/// `VIRTIO_RING_F_EVENT_IDX`.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
/// "No MSI-X vector" in the vector registers.
pub const VIRTIO_MSI_NO_VECTOR: u16 = 0xffff;

/// Device status bits (virtio 1.x §2.1).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u8 = 2;
    /// The driver is ready; the device goes live.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error and needs a reset.
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    /// The driver gave up, or (here) broke the protocol.
    pub const FAILED: u8 = 0x80;
}

/// ISR bit: a used buffer was added to a queue.
pub const ISR_QUEUE: u8 = 1;
/// ISR bit: the device configuration changed.
pub const ISR_CONFIG: u8 = 2;

/// Errors from virtio devices.
#[derive(Debug, Error)]
pub enum VirtioError {
    /// A fork child's copy does not fit the budget its source's owner set
    /// (a refusal, not a fault: deleting children makes room).
    #[error("{0}")]
    OverBudget(String),
    /// A medium change the drive refuses (a sentence: why).
    #[error("{0}")]
    MediumRefused(String),
    /// The device cannot be carried into a fork's child.
    #[error("its {device} device {why}")]
    NotForkable {
        /// Device name.
        device: &'static str,
        /// Why, as the end of a sentence ("cannot ...").
        why: String,
    },
    /// A lifecycle operation the device does not implement.
    #[error("the {device} device does not support {op}")]
    Unsupported {
        /// Device name.
        device: &'static str,
        /// The operation.
        op: &'static str,
    },
    /// The device's state could not be serialized.
    #[error("the state of the {device} device cannot be saved: {why}")]
    Save {
        /// Device name.
        device: &'static str,
        /// Why.
        why: String,
    },
    /// A saved state does not fit the device it is restored into.
    #[error("the {device} device cannot be restored: {why}")]
    Restore {
        /// Device name.
        device: &'static str,
        /// What did not fit.
        why: String,
    },
    /// Activation with the wrong queues.
    #[error("the {device} device needs {expected} ready queue(s), the driver enabled {got}")]
    QueueCount {
        /// Device name.
        device: &'static str,
        /// Queues it needs.
        expected: usize,
        /// Queues the driver made ready.
        got: usize,
    },
    /// Activation of an already active device.
    #[error("the {0} device is already active")]
    AlreadyActive(&'static str),
    /// A queue the driver configured is unusable.
    #[error("queue {0} is misconfigured or lies outside guest memory")]
    BadQueue(u16),
    /// Creating an eventfd failed.
    #[error("creating an eventfd failed")]
    EventFd(#[source] std::io::Error),
    /// Spawning a worker thread failed.
    #[error("spawning the {0} worker thread failed")]
    Spawn(&'static str, #[source] std::io::Error),
    /// Opening the device's host resource failed.
    #[error("opening {path} failed")]
    Open {
        /// What was opened.
        path: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// Signalling the guest failed.
    #[error("signalling the guest failed")]
    Interrupt(#[from] MsixError),
}

/// A queue handed to a device at activation.
#[derive(Debug)]
pub struct ActiveQueue {
    /// Queue index in the device.
    pub index: u16,
    /// The queue, ready and validated against guest memory.
    pub queue: Queue,
    /// Written by the guest's notify (an ioeventfd in KVM, or by the transport
    /// itself on a trapped notify write).
    pub notify: EventFd,
}

/// Interrupt status shared by a transport and its device's workers.
#[derive(Debug, Default)]
pub struct InterruptStatus {
    isr: AtomicU8,
    config_generation: AtomicU8,
}

impl InterruptStatus {
    /// Reads and clears the ISR (the guest's ISR read).
    pub fn take_isr(&self) -> u8 {
        self.isr.swap(0, Ordering::AcqRel)
    }
    /// The configuration generation counter.
    pub fn config_generation(&self) -> u8 {
        self.config_generation.load(Ordering::Acquire)
    }
    /// The ISR without clearing it (snapshot).
    pub fn isr(&self) -> u8 {
        self.isr.load(Ordering::Acquire)
    }
    /// Puts back an ISR and configuration generation (restore).
    pub fn restore(&self, isr: u8, config_generation: u8) {
        self.isr.store(isr, Ordering::Release);
        self.config_generation.store(config_generation, Ordering::Release);
    }
    /// Clears the ISR (device reset).
    pub fn reset(&self) {
        self.isr.store(0, Ordering::Release);
    }
}

/// How a device signals the guest: the MSI-X vectors the driver assigned,
/// fixed at DRIVER_OK. Cheap to clone into each worker. It also carries the
/// function's diagnostic counters ([`diag::DeviceDiag`], shared with the
/// transport for the state dump), so every worker has them at hand.
#[derive(Clone, Debug)]
pub struct Interrupt {
    msix: Arc<MsixVectors>,
    queue_vectors: Arc<[u16]>,
    config_vector: u16,
    status: Arc<InterruptStatus>,
    diag: Arc<diag::DeviceDiag>,
}

impl Interrupt {
    /// Vectors for queues `0..queue_vectors.len()` and the config vector
    /// ([`VIRTIO_MSI_NO_VECTOR`] where the driver assigned none).
    pub fn new(
        msix: Arc<MsixVectors>,
        queue_vectors: Vec<u16>,
        config_vector: u16,
        status: Arc<InterruptStatus>,
    ) -> Self {
        let diag = Arc::new(diag::DeviceDiag::new(queue_vectors.len()));
        Self::with_diag(msix, queue_vectors, config_vector, status, diag)
    }

    /// As [`Self::new`], counting into `diag` (the transport's, which the
    /// state dump reads).
    pub fn with_diag(
        msix: Arc<MsixVectors>,
        queue_vectors: Vec<u16>,
        config_vector: u16,
        status: Arc<InterruptStatus>,
        diag: Arc<diag::DeviceDiag>,
    ) -> Self {
        Self {
            msix,
            queue_vectors: queue_vectors.into(),
            config_vector,
            status,
            diag,
        }
    }

    /// The function's diagnostic counters (per queue, per worker slot).
    pub fn diag(&self) -> &Arc<diag::DeviceDiag> {
        &self.diag
    }

    /// The MSI-X vector of `queue`, if any. A backend that writes irqfds
    /// itself (vhost) uses `msix().irqfds()[vector]`.
    pub fn queue_vector(&self, queue: u16) -> Option<u16> {
        self.queue_vectors
            .get(usize::from(queue))
            .copied()
            .filter(|v| *v != VIRTIO_MSI_NO_VECTOR)
    }

    /// The MSI-X state (for the per-vector eventfds).
    pub fn msix(&self) -> &Arc<MsixVectors> {
        &self.msix
    }

    /// Tells the guest `queue` has new used buffers.
    pub fn signal_queue(&self, queue: u16) -> Result<(), MsixError> {
        self.status.isr.fetch_or(ISR_QUEUE, Ordering::AcqRel);
        self.diag.queue(queue).note_interrupt();
        match self.queue_vector(queue) {
            Some(v) => self.msix.trigger(v),
            None => {
                debug!(queue, "queue has no MSI-X vector (no INTx here); interrupt dropped");
                Ok(())
            }
        }
    }

    /// Tells the guest the device configuration changed (bumps the generation).
    pub fn signal_config(&self) -> Result<(), MsixError> {
        self.status.config_generation.fetch_add(1, Ordering::AcqRel);
        self.status.isr.fetch_or(ISR_CONFIG, Ordering::AcqRel);
        if self.config_vector == VIRTIO_MSI_NO_VECTOR {
            return Ok(());
        }
        self.msix.trigger(self.config_vector)
    }
}

/// Everything a device gets when the driver sets DRIVER_OK.
#[derive(Debug)]
pub struct ActivateContext {
    /// Guest memory (the device's view: its bitmap records the device's writes).
    pub mem: GuestMemoryHandle,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// The queues the driver made ready, by index.
    pub queues: Vec<ActiveQueue>,
    /// How to signal the guest.
    pub interrupt: Interrupt,
}

/// A record of the guest pages a device wrote that the VM's own bitmap
/// and KVM's dirty log do not see (the fork seam: `docs/fork.md`).
pub trait RamWriteLog: Send + Sync {
    /// Calls `page` with the guest-physical address of each page written
    /// since the last drain, and forgets them.
    fn drain(&self, page: &mut dyn FnMut(GuestAddress));
}

/// What the child's twin of a device takes from its source at a fork
/// ([`VirtioDevice::fork_backend`]), device-neutral: the VMM hands it to the
/// code that builds that kind of device, which takes its own type out.
#[derive(Default)]
pub struct ForkBackend(Option<Box<dyn std::any::Any + Send>>);

impl ForkBackend {
    /// The child's device is built from the VM's config alone.
    pub fn from_config() -> Self {
        Self(None)
    }

    /// The child's device takes `backend`.
    pub fn new<T: std::any::Any + Send>(backend: T) -> Self {
        Self(Some(Box::new(backend)))
    }

    /// The backend, if it is a `T`.
    pub fn take<T: std::any::Any>(self) -> Option<T> {
        self.0?.downcast::<T>().ok().map(|b| *b)
    }
}

impl std::fmt::Debug for ForkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ForkBackend(..)"
        } else {
            "ForkBackend(config)"
        })
    }
}

/// A virtio device, independent of its transport.
///
/// `activate` starts the device's worker(s); `reset` stops them and returns
/// the queues. Pause, resume, snapshot and restore fail by default: a device
/// must opt in, so nothing is ever silently left out of a snapshot.
pub trait VirtioDevice: Send {
    /// Short name for logs and errors ("rng", "blk", ...).
    fn name(&self) -> &'static str;
    /// virtio device ID (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;
    /// PCI (class, subclass) for the transport's header.
    fn pci_class(&self) -> (u8, u8) {
        (0xff, 0x00)
    }
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Features the device offers (must include [`VIRTIO_F_VERSION_1`]).
    fn avail_features(&self) -> u64;
    /// Size of the device-specific config space in bytes.
    fn config_len(&self) -> u64 {
        0
    }
    /// Reads the device config space (`offset + data.len() <= config_len()`).
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let _ = offset;
        data.fill(0);
    }
    /// Writes the device config space; read-only by default.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        debug!(
            device = self.name(),
            offset,
            len = data.len(),
            "ignoring write to read-only device config"
        );
    }
    /// Starts the device: it owns the queues and signals through the interrupt.
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), VirtioError>;
    /// Stops the worker(s), waits for them, and returns the queues (empty if
    /// the device was not active). The device is ready to be activated again.
    fn reset(&mut self) -> Vec<Queue>;
    /// Stops processing, leaving state consistent for a snapshot.
    fn pause(&mut self) -> Result<(), VirtioError> {
        Err(VirtioError::Unsupported {
            device: self.name(),
            op: "pause",
        })
    }
    /// Resumes after `pause`.
    fn resume(&mut self) -> Result<(), VirtioError> {
        Err(VirtioError::Unsupported {
            device: self.name(),
            op: "resume",
        })
    }
    /// Whether the paused device can be carried into a fork's child; asked
    /// of every device before anything is frozen, so a refusal leaves the
    /// source as it was. A device that has not thought about forks refuses.
    fn can_fork(&self) -> Result<(), VirtioError> {
        Err(VirtioError::NotForkable {
            device: self.name(),
            why: "does not support fork".into(),
        })
    }
    /// The backend the child's twin of this device takes, once per child,
    /// the device paused and the source frozen: a copy-on-write disk for
    /// blk, nothing for a device rebuilt from the config alone (rng; net,
    /// which gets its own tap). The default refuses.
    fn fork_backend(&mut self) -> Result<ForkBackend, VirtioError> {
        Err(VirtioError::NotForkable {
            device: self.name(),
            why: "does not support fork".into(),
        })
    }
    /// The records this device keeps of the guest RAM it writes outside
    /// the VM's own bitmap (blk's own view of guest memory; vhost's kernel
    /// log, switched on here). Asked once, at the first fork, the device
    /// paused; the fork path drains them with KVM's dirty log. A device
    /// that writes only through the memory handle the VM gave it has none.
    fn ram_write_logs(&mut self) -> Result<Vec<Arc<dyn RamWriteLog>>, VirtioError> {
        Ok(Vec::new())
    }
    /// The device's own lines for the state dump (`SIGUSR1`): workers,
    /// counters, backend state; no prefix, no newline. Called on the dump
    /// thread with the function's lock held: read atomics, take no lock a
    /// worker holds for long, never block.
    fn debug_state(&self) -> Vec<String> {
        Vec::new()
    }

    /// The device's monotonic counters for the daemon's metrics, as
    /// `(name, value)` (the names each device documents). Called with the
    /// function's lock held: read atomics only, never block. A device
    /// with none (or whose data plane counts nothing here) returns none.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Whether the guest's queue notifications reach this process's
    /// workers (their eventfds read here), so the transport can count
    /// them; false where a kernel backend reads them (vhost).
    fn notifications_reach_vmm(&self) -> bool {
        true
    }

    /// Replaces the device's medium (a drive's image) while the VM runs,
    /// and tells an active driver through a configuration-change interrupt.
    fn change_medium(&mut self, _medium: Arc<k7d_disk::DiskImage>) -> Result<(), VirtioError> {
        Err(VirtioError::Unsupported {
            device: self.name(),
            op: "a medium change",
        })
    }
    /// Serializes the paused device's state.
    fn snapshot(&mut self) -> Result<Vec<u8>, VirtioError> {
        Err(VirtioError::Unsupported {
            device: self.name(),
            op: "snapshot",
        })
    }
    /// Restores state produced by `snapshot`.
    fn restore(&mut self, state: &[u8]) -> Result<(), VirtioError> {
        let _ = state;
        Err(VirtioError::Unsupported {
            device: self.name(),
            op: "restore",
        })
    }
}

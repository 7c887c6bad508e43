//! virtio-blk: a raw image file, read-write or read-only (e.g. erofs).
//!
//! - [`DiskImage`] (crate `k7d-disk`, `devices/disk/`): the backing file, opened `O_RDWR` or
//!   `O_RDONLY`; capacity is its length in 512-byte sectors. [`DiskAt`] is
//!   the request path's positioned reader/writer on it.
//! - Copy-on-write overlay (`k7d-disk`): [`DiskImage::fork`] (through
//!   [`Block::fork_disk`], device paused) freezes a writable base and gives
//!   the source and each child their own unlinked, sparse overlay file with
//!   a map of the 4 KiB clusters it holds; reads take present clusters from
//!   it and the rest from the base, partial writes to an absent cluster
//!   copy it first. A fork copies only the parent's present clusters, so it
//!   costs what diverged, not the disk size; dropping a disk frees its
//!   overlay. Read-only images are shared.
//! - [`Block`] (`device.rs`): the [`crate::virtio::VirtioDevice`]: features,
//!   config space, one I/O worker on the worker framework, pause/resume, and
//!   its side of the fork seam (a copy-on-write disk for each child, its own
//!   view of guest memory as its record of the pages it wrote).
//! - `k7d_disk::request`: request parsing with the spec's validation
//!   (virtio 1.2 §5.2.6). No crate on crates.io does this.
//! - [`RequestHandler`] (`event_handler.rs`): drains the queue, executes
//!   requests, writes status bytes, returns chains, decides on one interrupt
//!   per batch; the worker loop around it.
//! - [`DeviceMemory`] (`memory.rs`): the device's own view of guest memory,
//!   whose dirty bitmap only this device marks.
//! - `persist.rs`: snapshot/restore of the device's own state (the disk's
//!   size and mode, checked on restore); the transport seeds the queue from
//!   the guest's used ring.
//!
//! # Dirty tracking
//!
//! Every byte the device writes into guest RAM goes through vm-memory:
//! data for IN (`read_exact_volatile_from` a positioned-file adapter, which
//! marks the slice's bitmap like vm-memory's own fd readers), GET_ID
//! (`write_slice`), status bytes (`write_obj`) and used-ring entries
//! (virtio-queue's `add_used`). Nothing is written through raw host addresses
//! without marking. So a device that is handed its own view of guest memory
//! records exactly the pages it wrote, and the fork path ORs that bitmap
//! into KVM's dirty log (which sees only vCPU writes).
//!
//! # Wiring a blk device (VMM)
//!
//! ```ignore
//! use k7d_devices::virtio::block::{Block, DeviceMemory, DiskImage};
//! use k7d_devices::virtio::transport::VirtioPciDevice;
//!
//! let disk = DiskImage::open("/var/lib/k7d/vm1/root.img", false)?;   // true: read-only (erofs)
//! let blk = Block::new(disk, "k7d-vm1-disk0")?;                       // serial <= 20 bytes
//! // SAFETY: `vm_mem` (the VMM's GuestMemoryMmap<AtomicBitmap>) keeps its
//! // mappings until the device, its transport and `dev_mem` are dropped.
//! let dev_mem = unsafe { DeviceMemory::new(&vm_mem)? };
//! let pci = VirtioPciDevice::new(Box::new(blk), dev_mem.handle(), router)?;
//! // ... root.add_device / bus insert / irqfds / ioeventfds as in docs/virtio-pci.md ...
//! // Fork path, after pausing every writer:
//! let dirty = dev_mem.take_dirty();            // per region: base, page size, bit words
//! ```
//!
//! The view must not outlive the VMM's mappings: it borrows them through
//! raw pointers (vm-memory's non-owning regions never unmap).

mod device;
mod event_handler;
mod memory;
mod persist;

pub use device::{Block, QueueIndexes};
pub use event_handler::{Batch, BlockCounters, BlockStats, MAX_BATCH, RequestHandler};
pub use k7d_disk::request::{DiscardRange, Limits, Rejected, Request, RequestError, RequestType, Segment, parse};
pub use k7d_disk::{
    CLUSTER_SIZE, DiskAt, DiskBudget, DiskError, DiskImage, EMPTY_MEDIUM, FileAt, copy_overlay, overlay_file,
};
pub use k7d_disk::{ID_BYTES, SECTOR_SHIFT, SECTOR_SIZE, status};
pub use memory::{DeviceMemory, RegionDirty, device_view};

use thiserror::Error;

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Length of the device config space we expose (through `write_zeroes_may_unmap`).
pub const CONFIG_LEN: usize = 60;
/// Most sectors one DISCARD / WRITE_ZEROES segment may cover (32 MiB).
pub const MAX_DISCARD_SECTORS: u32 = 1 << 16;
/// Most descriptors one request may have; longer chains are returned unused.
pub const MAX_DESCRIPTORS: usize = 1024;

/// Feature bits (`1 << VIRTIO_BLK_F_*`).
pub mod features {
    use virtio_bindings::virtio_blk as b;
    /// `seg_max` is valid.
    pub const SEG_MAX: u64 = 1 << b::VIRTIO_BLK_F_SEG_MAX;
    /// The device is read-only.
    pub const RO: u64 = 1 << b::VIRTIO_BLK_F_RO;
    /// `blk_size` is valid.
    pub const BLK_SIZE: u64 = 1 << b::VIRTIO_BLK_F_BLK_SIZE;
    /// FLUSH is supported.
    pub const FLUSH: u64 = 1 << b::VIRTIO_BLK_F_FLUSH;
    /// DISCARD is supported.
    pub const DISCARD: u64 = 1 << b::VIRTIO_BLK_F_DISCARD;
    /// WRITE_ZEROES is supported.
    pub const WRITE_ZEROES: u64 = 1 << b::VIRTIO_BLK_F_WRITE_ZEROES;
}

/// Errors of the virtio-blk device (setup and lifecycle; per-request errors
/// are [`RequestError`] and become status bytes).
#[derive(Debug, Error)]
pub enum BlockError {
    /// The disk image (open, overlay, fork).
    #[error(transparent)]
    Disk(#[from] k7d_disk::DiskError),
    /// The serial does not fit GET_ID's 20 bytes.
    #[error("the disk serial is {0} bytes long, at most 20 fit")]
    SerialTooLong(usize),
    /// Building the device's view of guest memory failed.
    #[error("building the device's view of guest memory failed: {0}")]
    MemoryView(String),
    /// The disk was to be forked while its device's worker was running.
    #[error("the disk {0} can only be forked while its device is paused")]
    ForkWhileRunning(String),
}

//! Disk images for k7d's virtio-blk, in their own crate as Cloud
//! Hypervisor's `block` and crosvm's `disk`: nothing here knows about the
//! virtio transport or worker threads.
//!
//! - [`DiskImage`] (`image.rs`): the backing file, opened `O_RDWR` or
//!   `O_RDONLY`; capacity is its length in 512-byte sectors. Its
//!   copy-on-write overlay: [`DiskImage::fork`] freezes a writable base and
//!   gives the source and each child their own unlinked, sparse overlay file
//!   with a map of the 4 KiB clusters it holds; a fork copies only the
//!   parent's present clusters. [`DiskAt`] / [`FileAt`] are the positioned
//!   readers/writers that move data between the image and guest memory
//!   (vm-memory's `ReadVolatile`/`WriteVolatile`, marking the dirty bitmap).
//! - [`request`]: virtio-blk request parsing with the spec's validation
//!   (virtio 1.2 §5.2.6). No crate on crates.io does this.

pub mod image;
pub mod request;

pub use image::{CLUSTER_SIZE, DiskAt, DiskBudget, DiskImage, EMPTY_MEDIUM, FileAt, copy_overlay, overlay_file};

use thiserror::Error;
use vm_memory::GuestMemoryMmap;
use vm_memory::bitmap::AtomicBitmap;

/// Guest memory with a dirty bitmap (the type the devices use).
pub type GuestMemoryTracked = GuestMemoryMmap<AtomicBitmap>;

/// Sector size of the virtio-blk protocol (fixed by the spec).
pub const SECTOR_SIZE: u64 = 512;
/// `log2(SECTOR_SIZE)`.
pub const SECTOR_SHIFT: u32 = 9;
/// Length of the GET_ID answer (`VIRTIO_BLK_ID_BYTES`).
pub const ID_BYTES: usize = virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES as usize;

/// Request status codes (`VIRTIO_BLK_S_*`).
pub mod status {
    /// Success.
    pub const OK: u8 = virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK as u8;
    /// Device or driver error.
    pub const IOERR: u8 = virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR as u8;
    /// Request not supported.
    pub const UNSUPP: u8 = virtio_bindings::virtio_blk::VIRTIO_BLK_S_UNSUPP as u8;
}

/// Errors of a disk image: opening it, its overlay, forking it.
#[derive(Debug, Error)]
pub enum DiskError {
    /// Opening the image failed.
    #[error("opening the disk image {path} failed")]
    Open {
        /// The image path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading the image's metadata failed.
    #[error("reading the size of the disk image failed")]
    Metadata(#[source] std::io::Error),
    /// The image is smaller than one sector.
    #[error("the disk image holds no complete 512-byte sector")]
    Empty,
    /// The memfd of an empty medium could not be created.
    #[error("creating an empty medium failed")]
    EmptyMedium(#[source] std::io::Error),
    /// Duplicating the base image's descriptor for a fork failed.
    #[error("duplicating the descriptor of the disk image {path} for a fork failed")]
    ForkBase {
        /// The image path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A fork child's overlay would pass its source's disk budget.
    #[error(
        "the disk {path}'s copy-on-write copy for a new fork child needs {need} bytes and the source's children hold {used} of the {cap} bytes their budget allows"
    )]
    ChildrenBudget {
        /// The image path.
        path: String,
        /// Bytes the new overlay copies.
        need: u64,
        /// Bytes the live children's overlays hold.
        used: u64,
        /// The budget.
        cap: u64,
    },
    /// Creating a copy-on-write overlay file failed.
    #[error("creating the copy-on-write overlay for {path} failed")]
    Overlay {
        /// The image path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Copying the parent's overlay into a fork's overlay failed.
    #[error("copying the copy-on-write overlay of {path} for a fork failed")]
    OverlayCopy {
        /// The image path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The frozen base could not be made read-only in this process.
    #[error("making the frozen base {path} read-only in this process failed")]
    ReadOnlyBase {
        /// The image path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The image is the frozen base of a forked VM's disk.
    #[error(
        "the disk image {0} is the frozen base of a forked VM's disk and cannot be opened read-write while that VM or its children live"
    )]
    FrozenBase(String),
}

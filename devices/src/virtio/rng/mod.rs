//! virtio-rng (entropy source): the template device.
//!
//! One queue; one worker thread that waits on the queue's notify eventfd and
//! a stop eventfd, fills every device-writable buffer from the host's
//! `/dev/urandom` directly into guest memory (through vm-memory, so the
//! writes are dirty-tracked), returns the chain, and signals the queue's
//! MSI-X vector.
//!
//! To write a new device, copy this folder: `device.rs` holds the
//! [`crate::virtio::VirtioDevice`] impl and the worker's start/stop,
//! `event_handler.rs` the worker loop and request handling.

mod device;
mod event_handler;

pub use device::Rng;

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most bytes served per descriptor chain (the device may return fewer than asked).
pub const MAX_BYTES_PER_CHAIN: u32 = 64 * 1024;
/// Where entropy comes from.
pub const ENTROPY_SOURCE: &str = "/dev/urandom";

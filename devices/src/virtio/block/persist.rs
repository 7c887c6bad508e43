//! Snapshot/restore of virtio-blk: NOT IMPLEMENTED, and says so loudly.
//!
//! What exists: the mechanism a restore needs for the queue, seeding
//! `next_avail`/`next_used` from the guest's own `used.idx` (issue 5, item 2).
//! For blk this is exact: the worker completes every chain it pops before it
//! parks, so at a pause `next_avail == next_used == used.idx`.
//!
//! What a snapshot must carry once it exists: acked features, queue
//! addresses/size/ready/vector, [`super::QueueIndexes`] (from
//! [`super::Block::paused_queue_indexes`]), the config space, and the image
//! path + read-only flag (the image itself is the fork issue's business).

use std::sync::atomic::Ordering;

use tracing::error;
use virtio_queue::{Queue, QueueT};

use super::{Block, BlockError};
use crate::virtio::{GuestMemoryTracked, VirtioError};

/// Starts `queue` where the guest's used ring says the device stopped:
/// `next_avail = next_used = used.idx` read from guest memory. Returns that
/// index.
pub fn seed_indexes_from_used_ring(queue: &mut Queue, mem: &GuestMemoryTracked) -> Result<u16, BlockError> {
    let idx = queue
        .used_idx(mem, Ordering::Acquire)
        .map_err(|e| BlockError::UsedRing(format!("{e:?}")))?;
    queue.set_next_avail(idx.0);
    queue.set_next_used(idx.0);
    Ok(idx.0)
}

pub(super) fn snapshot(dev: &mut Block) -> Result<Vec<u8>, VirtioError> {
    let _ = dev;
    let e = BlockError::NotImplemented("snapshot");
    error!(error = %e, "refusing to snapshot a virtio-blk device");
    Err(VirtioError::Unsupported {
        device: "blk",
        op: "snapshot",
    })
}

pub(super) fn restore(dev: &mut Block, state: &[u8]) -> Result<(), VirtioError> {
    let _ = (dev, state);
    let e = BlockError::NotImplemented("restore");
    error!(error = %e, "refusing to restore a virtio-blk device");
    Err(VirtioError::Unsupported {
        device: "blk",
        op: "restore",
    })
}

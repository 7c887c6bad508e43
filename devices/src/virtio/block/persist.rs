//! Snapshot/restore of virtio-blk.
//!
//! The transport carries the queue registers and, on restore, seeds the
//! queue from the guest's used ring (`crate::virtio::seed_from_used_ring`).
//! For blk it is exact: the worker completes every chain
//! it pops before it parks, so at a pause `next_avail == next_used ==
//! used.idx`. The device's own state is the disk's size and mode, checked
//! against the disk the restored device got.

use super::Block;
use crate::virtio::VirtioError;

/// What a blk snapshot carries: the image's identity as the guest saw it.
/// The image's contents are the VMM's business (a fork gives the child a
/// copy-on-write view; a cold restore reopens the configured path).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct BlockState {
    sectors: u64,
    read_only: bool,
}

pub(super) fn snapshot(dev: &mut Block) -> Result<Vec<u8>, VirtioError> {
    let st = BlockState {
        sectors: dev.sectors(),
        read_only: dev.read_only(),
    };
    serde_json::to_vec(&st).map_err(|e| VirtioError::Save {
        device: "blk",
        why: e.to_string(),
    })
}

pub(super) fn restore(dev: &mut Block, state: &[u8]) -> Result<(), VirtioError> {
    let bad = |why: String| VirtioError::Restore { device: "blk", why };
    let st: BlockState =
        serde_json::from_slice(state).map_err(|e| bad(format!("the saved state is unreadable: {e}")))?;
    if st.sectors != dev.sectors() || st.read_only != dev.read_only() {
        return Err(bad(format!(
            "the saved disk had {} sectors ({}), this one has {} ({})",
            st.sectors,
            if st.read_only { "read-only" } else { "read-write" },
            dev.sectors(),
            if dev.read_only() { "read-only" } else { "read-write" }
        )));
    }
    Ok(())
}

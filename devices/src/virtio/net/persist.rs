//! Snapshot/restore of virtio-net: not implemented, and loudly so.
//!
//! What a real implementation must save (for the fork/snapshot issue): each
//! queue's `QueueState` (`virtio-queue`'s `state()`), the acked features, the
//! active queue-pair count, the MAC, and any frame held in a worker's bounce
//! buffer (or an explicit decision to drop it). The tap is host state: a
//! restore re-creates it from the deterministic name. Until then every
//! lifecycle hook returns [`VirtioError::Unsupported`] and logs an error, so
//! a snapshot can never silently leave the NIC out.

use tracing::error;

use crate::virtio::VirtioError;

/// Fails `op` (pause, resume, snapshot, restore) with an explicit error.
pub fn unsupported<T>(op: &'static str) -> Result<T, VirtioError> {
    error!(
        op,
        "virtio-net does not implement {op}; refusing rather than saving an incomplete device"
    );
    Err(VirtioError::Unsupported { device: "net", op })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hook_fails_loudly() {
        for op in ["pause", "resume", "snapshot", "restore"] {
            let e = unsupported::<()>(op).unwrap_err();
            assert_eq!(e.to_string(), format!("the net device does not support {op}"));
        }
    }
}

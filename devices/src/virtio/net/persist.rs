//! Snapshot/restore of virtio-net.
//!
//! The transport carries the queue registers and seeds every ring from the
//! guest's used index on restore. The device adds what the guest set up
//! beyond them: the queue pairs it enabled with `VQ_PAIRS_SET` (applied to
//! the tap at the restored activation), checked against the MAC and the
//! number of pairs of the device it is restored into. The tap itself is host
//! state: a restored VM gets its own tap with the same MAC. A frame a worker
//! held for want of an RX buffer is not carried: the network may drop a
//! frame, and TCP retransmits it.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::Net;
use crate::virtio::VirtioError;

#[derive(Debug, Serialize, Deserialize)]
struct NetState {
    mac: [u8; 6],
    pairs: u16,
    active_pairs: u16,
}

fn bad(why: String) -> VirtioError {
    VirtioError::Restore { device: "net", why }
}

pub(super) fn snapshot(dev: &Net) -> Result<Vec<u8>, VirtioError> {
    let st = NetState {
        mac: dev.mac,
        pairs: dev.pairs,
        // A restored device not started yet still holds its pairs in
        // `restore_pairs`.
        active_pairs: dev
            .restore_pairs
            .unwrap_or_else(|| dev.stats.active_pairs.load(Ordering::Acquire)),
    };
    serde_json::to_vec(&st).map_err(|e| VirtioError::Save {
        device: "net",
        why: e.to_string(),
    })
}

pub(super) fn restore(dev: &mut Net, state: &[u8]) -> Result<(), VirtioError> {
    let st: NetState = serde_json::from_slice(state).map_err(|e| bad(format!("the saved state is unreadable: {e}")))?;
    if st.mac != dev.mac {
        return Err(bad(format!(
            "the saved NIC has MAC {:02x?}, this one {:02x?}",
            st.mac, dev.mac
        )));
    }
    if st.pairs != dev.pairs {
        return Err(bad(format!(
            "the saved NIC has {} queue pairs, this one {}",
            st.pairs, dev.pairs
        )));
    }
    if st.active_pairs > dev.pairs {
        return Err(bad(format!(
            "the guest had {} queue pairs enabled, more than the NIC's {}",
            st.active_pairs, dev.pairs
        )));
    }
    dev.restore_pairs = Some(st.active_pairs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_state_is_one_sentence() {
        let e =
            serde_json::from_slice::<NetState>(b"{").map_err(|e| bad(format!("the saved state is unreadable: {e}")));
        let msg = e.unwrap_err().to_string();
        assert!(
            msg.starts_with("the net device cannot be restored: the saved state is unreadable"),
            "{msg}"
        );
    }
}

//! Kernel vhost-net backend: a documented stub.
//!
//! This host has no `/dev/vhost-net`, so the backend cannot be exercised
//! here; it is not built yet and [`VhostNetBackend::new`] returns
//! [`NetError::VhostNotImplemented`]. The policy
//! (`k7d_net::policy::effective_data_plane`) never selects vhost on a host
//! without `/dev/vhost-net`, and a NIC that explicitly asks for vhost fails
//! there with the reason, so the stub cannot be reached by a defaulted NIC.
//!
//! The intended structure (needs `vhost = { version = "0.18", features =
//! ["vhost-net"] }` in devices/Cargo.toml):
//!
//! 1. One `vhost::net::Net::new(mem)` (one `/dev/vhost-net` open) per queue
//!    pair; `set_owner`; `get_features` → `set_features(acked & vhost's |
//!    VHOST_F_LOG_ALL when the fork path needs the dirty log)`.
//! 2. `set_mem_table` from the guest memory regions (GPA, length, HVA).
//! 3. For the pair's RX (local ring 0) and TX (ring 1): `set_vring_num`,
//!    `set_vring_addr` (GPAs of desc/avail/used, plus `log_addr` with
//!    `VHOST_VRING_F_LOG`), `set_vring_base(next_avail)`,
//!    `set_vring_kick(queue notify eventfd)` — the same eventfd KVM's
//!    ioeventfd writes — and `set_vring_call(irqfd of the queue's MSI-X
//!    vector)`, i.e. `Interrupt::msix().irqfds()[vector]` (vhost ignores
//!    MSI-X masking; the router is told about masks for that reason).
//! 4. `set_backend(0|1, Some(tap queue fd k))`.
//! 5. Control queue: still served in userspace (a worker like
//!    `event_handler`'s control path), attaching/detaching tap queues.
//! 6. Dirty log: `set_log_base` with a log covering guest RAM; the fork path
//!    ORs it into the device bitmap (vhost's writes bypass vm-memory and KVM).
//! 7. Reset: `set_backend(i, None)`, `get_vring_base` to save the indices,
//!    drop the fds.

use super::NetError;

/// The kernel vhost-net data plane for one NIC (not implemented yet).
#[derive(Debug)]
pub struct VhostNetBackend {
    _private: (),
}

impl VhostNetBackend {
    /// Always fails: the backend is not built yet.
    pub fn new(queue_pairs: u16) -> Result<Self, NetError> {
        tracing::error!(
            queue_pairs,
            "the kernel vhost-net backend was asked for but is not implemented"
        );
        Err(NetError::VhostNotImplemented)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stub_fails_with_an_explicit_error() {
        let e = VhostNetBackend::new(2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the kernel vhost-net backend is not implemented yet; use the userspace backend"
        );
    }
}

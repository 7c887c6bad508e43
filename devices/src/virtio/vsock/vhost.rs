//! Kernel vhost-vsock backend: a stub.
//!
//! `/dev/vhost-vsock` does not exist on the build hosts, so this backend is
//! not implemented: [`VhostVsock::open`] always returns
//! [`VsockError::VhostUnavailable`] with the reason (device node missing, or
//! present but not supported by k7d yet). Callers fall back to the hybrid
//! unix-socket backend ([`super::Vsock`]) or fail with the reason.

use super::VsockError;

/// The kernel's vhost-vsock device node.
pub const VHOST_VSOCK_PATH: &str = "/dev/vhost-vsock";

/// Handle of a kernel vhost-vsock backend (never constructed yet).
#[derive(Debug)]
pub struct VhostVsock {
    _private: (),
}

impl VhostVsock {
    /// Whether the host has the device node at all.
    pub fn node_exists() -> bool {
        std::path::Path::new(VHOST_VSOCK_PATH).exists()
    }

    /// Opens the kernel backend for guest `cid`; always fails, saying why.
    pub fn open(cid: u64) -> Result<Self, VsockError> {
        let reason = match std::fs::metadata(VHOST_VSOCK_PATH) {
            Err(e) => format!("{VHOST_VSOCK_PATH} is not usable ({e})"),
            Ok(_) => format!("k7d does not implement it yet (guest CID {cid}); use the unix-socket backend"),
        };
        Err(VsockError::VhostUnavailable { reason })
    }
}

//! Snapshot/restore of the vsock device: not implemented, and it fails loudly.
//!
//! Open connections are host unix streams that cannot be serialized; a restore
//! would also have to send the guest a TRANSPORT_RESET event so its sockets
//! learn their peers are gone (what Firecracker does). Until that exists,
//! [`save`] and [`restore`] return errors, and the device's `pause`,
//! `snapshot` and `restore` hooks refuse, so a snapshot never silently omits
//! the device.

use super::VsockError;

/// Would serialize the device; always refuses.
pub fn save() -> Result<Vec<u8>, VsockError> {
    Err(VsockError::PersistUnsupported("snapshot"))
}

/// Would restore the device; always refuses.
pub fn restore(state: &[u8]) -> Result<(), VsockError> {
    let _ = state;
    Err(VsockError::PersistUnsupported("restore"))
}

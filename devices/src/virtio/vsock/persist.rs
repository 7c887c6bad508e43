//! Snapshot/restore (and fork) of the vsock device, as Firecracker does it:
//! open connections are host unix streams that cannot be carried, so the
//! state is empty, the source keeps its connections, and the restored
//! device (a snapshot's VM or a fork's child, with a host socket of its
//! own) sends the guest a TRANSPORT_RESET event as the first thing it does
//! on the guest's rings (`event_handler.rs`). Linux's virtio_vsock then
//! resets every connected socket (ECONNRESET) and re-reads its CID;
//! listening sockets stay, so a guest service is reached again through
//! the new host socket. The queues themselves are the transport's state.

use super::VsockError;

/// The device's state: nothing.
pub fn save() -> Vec<u8> {
    Vec::new()
}

/// Checks a saved state: it must be empty.
pub fn restore(state: &[u8]) -> Result<(), VsockError> {
    if state.is_empty() {
        Ok(())
    } else {
        Err(VsockError::BadState(state.len()))
    }
}

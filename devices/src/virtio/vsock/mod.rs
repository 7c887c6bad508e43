//! virtio-vsock (in progress).

//! virtio-net (in progress).

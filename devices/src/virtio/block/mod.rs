//! virtio-block (in progress).

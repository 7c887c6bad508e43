//! virtio devices and the virtio-pci transport (filled in by the virtio-pci work).

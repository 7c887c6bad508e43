//! PCI: host bridge, config space, BARs, MSI-X (filled in by the virtio-pci work).

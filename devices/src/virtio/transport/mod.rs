//! virtio transports. Only virtio-pci (modern, 1.x) exists: see
//! `docs/virtio-pci.md` for why, and for the register map.

mod diag;
mod pci;
mod persist;

pub use pci::{IoEventFd, VirtioPciDevice, VirtioPciError};
pub use persist::{QueueRegsState, VirtioPciState};

/// Layout of BAR 0 and of the virtio PCI capabilities.
pub mod layout {
    /// BAR holding every virtio structure and the MSI-X table/PBA.
    pub const BAR_INDEX: u8 = 0;
    /// Size of BAR 0.
    pub const BAR_SIZE: u64 = 0x8000;
    /// Common configuration structure.
    pub const COMMON_CFG_OFFSET: u64 = 0x0000;
    /// Length of the common configuration structure (virtio 1.0 fields).
    pub const COMMON_CFG_LEN: u64 = 0x38;
    /// ISR status byte.
    pub const ISR_CFG_OFFSET: u64 = 0x1000;
    /// Length of the ISR structure.
    pub const ISR_CFG_LEN: u64 = 1;
    /// Device-specific configuration.
    pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
    /// Largest device-specific configuration.
    pub const DEVICE_CFG_MAX: u64 = 0x1000;
    /// Queue notify area: queue `n` is notified at `NOTIFY_OFFSET + n * NOTIFY_OFF_MULTIPLIER`.
    pub const NOTIFY_OFFSET: u64 = 0x3000;
    /// Bytes between two queues' notify addresses.
    pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
    /// MSI-X table.
    pub const MSIX_TABLE_OFFSET: u64 = 0x4000;
    /// MSI-X pending-bit array.
    pub const MSIX_PBA_OFFSET: u64 = 0x6000;
    /// Most MSI-X vectors (table space / 16).
    pub const MAX_VECTORS: u16 = ((MSIX_PBA_OFFSET - MSIX_TABLE_OFFSET) / 16) as u16;
    /// Most queues (one vector each plus the config vector).
    pub const MAX_QUEUES: u16 = MAX_VECTORS - 1;

    /// `cfg_type` of the common configuration capability.
    pub const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
    /// `cfg_type` of the notification capability.
    pub const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
    /// `cfg_type` of the ISR capability.
    pub const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
    /// `cfg_type` of the device-specific configuration capability.
    pub const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;
    /// `cfg_type` of the PCI configuration access capability.
    pub const VIRTIO_PCI_CAP_PCI_CFG: u8 = 5;

    /// Common configuration register offsets (virtio 1.x §4.1.4.3).
    pub mod common {
        /// le32 RW: selects which 32 bits `DEVICE_FEATURE` shows.
        pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
        /// le32 RO: offered features, 32 bits at a time.
        pub const DEVICE_FEATURE: u64 = 0x04;
        /// le32 RW: selects which 32 bits `DRIVER_FEATURE` sets.
        pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
        /// le32 RW: accepted features, 32 bits at a time.
        pub const DRIVER_FEATURE: u64 = 0x0c;
        /// le16 RW: MSI-X vector for configuration changes.
        pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
        /// le16 RO: number of queues.
        pub const NUM_QUEUES: u64 = 0x12;
        /// u8 RW: device status; writing 0 resets.
        pub const DEVICE_STATUS: u64 = 0x14;
        /// u8 RO: configuration generation.
        pub const CONFIG_GENERATION: u64 = 0x15;
        /// le16 RW: selects the queue the `QUEUE_*` registers address.
        pub const QUEUE_SELECT: u64 = 0x16;
        /// le16 RW: queue size (reads the maximum after reset).
        pub const QUEUE_SIZE: u64 = 0x18;
        /// le16 RW: MSI-X vector of the queue.
        pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
        /// le16 RW: 1 enables the queue.
        pub const QUEUE_ENABLE: u64 = 0x1c;
        /// le16 RO: the queue's notify offset (in multiplier units).
        pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
        /// le64 RW: descriptor table address.
        pub const QUEUE_DESC: u64 = 0x20;
        /// le64 RW: driver (available) ring address.
        pub const QUEUE_DRIVER: u64 = 0x28;
        /// le64 RW: device (used) ring address.
        pub const QUEUE_DEVICE: u64 = 0x30;
    }
}

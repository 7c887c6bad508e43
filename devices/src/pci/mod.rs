//! PCI: type 0 configuration space, BARs, the MSI-X capability, and a PCI root
//! (host bridge 00:00.0 plus one bus of devices) reachable through legacy port
//! I/O (CF8/CFC) and PCIe ECAM.
//!
//! Layering: nothing here knows about KVM. A device's BARs are ordinary
//! [`crate::bus::BusDevice`] ranges the VMM places on its MMIO bus; MSI-X
//! messages leave through the [`MsiRouter`] seam and per-vector eventfds the
//! VMM registers as irqfds.

mod config;
mod msix;
mod root;

pub use config::{BarKind, CapabilityInfo, NUM_BARS, PCI_CONFIG_SPACE_SIZE, PciConfiguration, PciHeader};
pub use msix::{
    MAX_MSIX_VECTORS, MSIX_ENTRY_SIZE, MsiMessage, MsiRouteError, MsiRouter, MsixCapability, MsixError, MsixSnapshot,
    MsixVectors, NoopMsiRouter,
};
pub use root::{
    BarAllocator, BarRelocator, ECAM_BUS_SIZE, HostBridge, PCI_CONFIG_IO_LEN, PCI_CONFIG_IO_PORT, PciAttachment,
    PciConfigIo, PciConfigMmio, PciRoot,
};

use thiserror::Error;

/// PCI capability ID of MSI-X.
pub const PCI_CAP_ID_MSIX: u8 = 0x11;
/// PCI capability ID of a vendor-specific capability (virtio uses these).
pub const PCI_CAP_ID_VENDOR: u8 = 0x09;

/// A bus/device/function address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciBdf {
    /// Bus number.
    pub bus: u8,
    /// Device number, 0..32.
    pub device: u8,
    /// Function number, 0..8.
    pub function: u8,
}

impl std::fmt::Display for PciBdf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "0000:{:02x}:{:02x}.{}", self.bus, self.device, self.function)
    }
}

/// Where a BAR sits in guest physical address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarRange {
    /// BAR index, 0..6 (a 64-bit BAR is named by its low half).
    pub index: u8,
    /// Guest physical base address.
    pub addr: u64,
    /// Length in bytes (a power of two).
    pub len: u64,
    /// Memory or I/O, 32 or 64 bits.
    pub kind: BarKind,
}

/// A BAR the guest has moved by programming a new base address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarMove {
    /// BAR index.
    pub index: u8,
    /// The previous base address.
    pub old: u64,
    /// The new base address.
    pub new: u64,
    /// Length of the BAR.
    pub len: u64,
}

/// Errors from building PCI config spaces and the PCI root.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PciError {
    /// A BAR index is out of range or already taken.
    #[error("BAR {0} is out of range or already in use")]
    BarInUse(u8),
    /// A BAR size is not a power of two or is too small.
    #[error("BAR size {0:#x} is not a power of two of at least 16 bytes")]
    BarSize(u64),
    /// The capability list does not fit in the 256-byte config space.
    #[error("capability of {0} bytes does not fit in the configuration space")]
    CapabilitySpace(usize),
    /// The BAR window is exhausted.
    #[error("no room for a {size:#x}-byte BAR in the {window} MMIO window")]
    WindowExhausted {
        /// Requested size.
        size: u64,
        /// Which window ("32-bit" or "64-bit").
        window: &'static str,
    },
    /// I/O BARs are not allocated (no I/O window).
    #[error("BAR {0} is an I/O BAR, which the PCI root does not allocate")]
    IoBar(u8),
    /// A saved configuration space does not fit this device.
    #[error("{0}")]
    Restore(String),
    /// All 31 device slots of bus 0 are taken.
    #[error("PCI bus 0 has no free device slot")]
    BusFull,
    /// A window given to the PCI root is empty or wraps.
    #[error("PCI MMIO window {base:#x}+{len:#x} is empty or wraps")]
    BadWindow {
        /// Window base.
        base: u64,
        /// Window length.
        len: u64,
    },
}

/// A function on the PCI bus: its configuration space and its BARs.
///
/// The BAR contents themselves are reached through the device's
/// [`crate::bus::BusDevice`] impl at the addresses reported by [`PciDevice::bars`]
/// (offsets relative to BAR 0 in this crate's devices, which all use one BAR).
pub trait PciDevice: Send {
    /// Reads 32-bit configuration register `reg` (byte offset `reg * 4`); registers past the
    /// implemented space read as zero.
    fn read_config_register(&mut self, reg: usize) -> u32;
    /// Writes `data` (1, 2 or 4 bytes) at byte `offset` within configuration register `reg`.
    /// Returns the BAR move the write caused, if any.
    fn write_config_register(&mut self, reg: usize, offset: u64, data: &[u8]) -> Option<BarMove>;
    /// The BARs the device needs, with their sizes; `addr` is ignored.
    fn bar_requests(&self) -> Vec<BarRange>;
    /// Places BAR `index` at `addr` (called by the PCI root at attach time).
    fn set_bar_address(&mut self, index: u8, addr: u64);
    /// The BARs with their current addresses.
    fn bars(&self) -> Vec<BarRange>;
}

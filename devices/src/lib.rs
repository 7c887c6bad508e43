//! Device models for k7d.
//!
//! Layering: this crate never imports the VMM. Devices see the outside world
//! through small seams: an [`bus::BusDevice`] for guest port/MMIO accesses, an
//! [`irq::IrqLine`] to raise interrupts, and plain callbacks for machine-level
//! events such as a reset.

#![deny(missing_docs)]

pub mod bus;
pub mod irq;
pub mod legacy;
pub mod pci;
pub mod sandbox;
pub mod virtio;

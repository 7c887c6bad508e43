//! Interrupt lines as seen by devices.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use vmm_sys_util::eventfd::EventFd;

/// An edge-triggered interrupt line backed by an eventfd that KVM consumes as
/// an irqfd (`KVM_IRQFD`): writing it injects the interrupt in the kernel.
#[derive(Debug)]
pub struct IrqLine {
    evt: EventFd,
    raised: Arc<AtomicU64>,
}

impl IrqLine {
    /// Wraps an eventfd already registered as an irqfd.
    pub fn new(evt: EventFd) -> Self {
        Self {
            evt,
            raised: Arc::new(AtomicU64::new(0)),
        }
    }

    /// How many times the line was raised, as a shared counter (the state
    /// dump reads it without the device's lock).
    pub fn raised(&self) -> Arc<AtomicU64> {
        self.raised.clone()
    }

    /// The eventfd, to register with KVM.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

impl vm_superio::Trigger for IrqLine {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.raised.fetch_add(1, Ordering::Relaxed);
        self.evt.write(1)
    }
}

//! Interrupt lines as seen by devices.

use vmm_sys_util::eventfd::EventFd;

/// An edge-triggered interrupt line backed by an eventfd that KVM consumes as
/// an irqfd (`KVM_IRQFD`): writing it injects the interrupt in the kernel.
#[derive(Debug)]
pub struct IrqLine {
    evt: EventFd,
}

impl IrqLine {
    /// Wraps an eventfd already registered as an irqfd.
    pub fn new(evt: EventFd) -> Self {
        Self { evt }
    }

    /// The eventfd, to register with KVM.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

impl vm_superio::Trigger for IrqLine {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.evt.write(1)
    }
}

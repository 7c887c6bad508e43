//! KVM interrupt routing: the legacy PIC/IOAPIC routes plus one MSI route per
//! MSI-X vector of each PCI device, kept in step with the guest's MSI-X tables.
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, so k7d keeps the table here
//! and sends all of it on every change: the 24 IOAPIC pins (and the 16 PIC
//! lines) that KVM installs by default must stay, or the serial port's IRQ 4
//! stops working the moment the first MSI vector is routed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use k7d_devices::pci::{MsiMessage, MsiRouteError, MsiRouter};
use kvm_bindings::{
    KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KvmIrqRouting, kvm_irq_routing_entry,
};
use kvm_ioctls::VmFd;

/// First GSI handed to MSI vectors (0..24 are the IOAPIC pins).
pub const MSI_GSI_BASE: u32 = 24;

/// The VM's routing table.
pub struct GsiRouting {
    vm: Arc<VmFd>,
    msi: Mutex<(BTreeMap<u32, MsiMessage>, u32)>,
}

fn irqchip(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    e.u.irqchip.irqchip = chip;
    e.u.irqchip.pin = pin;
    e
}

impl GsiRouting {
    /// Routing for `vm` with the default legacy routes.
    pub fn new(vm: Arc<VmFd>) -> Self {
        Self {
            vm,
            msi: Mutex::new((BTreeMap::new(), MSI_GSI_BASE)),
        }
    }

    /// Reserves `n` consecutive GSIs for a device's MSI-X vectors.
    pub fn allocate(&self, n: u32) -> u32 {
        let mut g = self.msi.lock().unwrap_or_else(|p| p.into_inner());
        let base = g.1;
        g.1 += n;
        base
    }

    fn set(&self, gsi: u32, msg: Option<MsiMessage>) -> Result<(), kvm_ioctls::Error> {
        let mut g = self.msi.lock().unwrap_or_else(|p| p.into_inner());
        match msg {
            Some(m) => g.0.insert(gsi, m),
            None => g.0.remove(&gsi),
        };
        let mut entries = Vec::with_capacity(40 + g.0.len());
        for pin in 0..24 {
            entries.push(irqchip(pin, KVM_IRQCHIP_IOAPIC, pin));
        }
        for pin in 0..16 {
            // GSI 2 is the cascade on the PIC side; KVM's default table skips it too.
            if pin == 2 {
                continue;
            }
            let (chip, p) = if pin < 8 {
                (KVM_IRQCHIP_PIC_MASTER, pin)
            } else {
                (KVM_IRQCHIP_PIC_SLAVE, pin - 8)
            };
            entries.push(irqchip(pin, chip, p));
        }
        for (&gsi, m) in &g.0 {
            let mut e = kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_MSI,
                ..Default::default()
            };
            e.u.msi.address_lo = m.address_lo;
            e.u.msi.address_hi = m.address_hi;
            e.u.msi.data = m.data;
            entries.push(e);
        }
        let mut table = KvmIrqRouting::new(entries.len()).map_err(|_| kvm_ioctls::Error::new(libc::ENOMEM))?;
        table.as_mut_slice().copy_from_slice(&entries);
        self.vm.set_gsi_routing(&table)
    }
}

/// One device's view: vector `v` is GSI `base + v`.
pub struct DeviceMsiRouter {
    routing: Arc<GsiRouting>,
    base: u32,
}

impl DeviceMsiRouter {
    /// A router for the vectors at `base..`.
    pub fn new(routing: Arc<GsiRouting>, base: u32) -> Self {
        Self { routing, base }
    }
}

impl MsiRouter for DeviceMsiRouter {
    fn route(&self, vector: u16, msg: MsiMessage, masked: bool) -> Result<(), MsiRouteError> {
        let gsi = self.base + u32::from(vector);
        self.routing
            .set(gsi, (!masked).then_some(msg))
            .map_err(|e| MsiRouteError {
                vector,
                source: Box::new(e),
            })
    }
}

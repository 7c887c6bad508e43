//! Snapshot and restore of a virtio-pci function: what the guest's driver
//! programmed (configuration space, MSI-X table, features, status, queue
//! registers) plus the device's own state ([`VirtioDevice::snapshot`]).
//!
//! Starting a restored live device (DRIVER_OK) activates it with every queue
//! seeded from the guest's own used ring (`next_avail = next_used =
//! used.idx`), never from 0: at a pause every device has completed each chain
//! it popped, so the used index is exactly where it stopped. The restored
//! device then gets one notification per queue (a kick the source had not
//! consumed yet is not lost) and one interrupt per queue with a vector (an
//! interrupt the source raised but the guest had not handled yet is not lost;
//! drivers take a spurious one in their stride).
//!
//! [`VirtioDevice::snapshot`]: crate::virtio::VirtioDevice::snapshot

use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::pci::{QueueRegs, VirtioPciDevice};
use crate::pci::MsixSnapshot;
use crate::virtio::{VirtioError, status};

/// The driver-visible registers of one queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRegsState {
    /// Queue size the driver chose.
    pub size: u16,
    /// MSI-X vector.
    pub vector: u16,
    /// QUEUE_ENABLE.
    pub ready: bool,
    /// Descriptor table GPA.
    pub desc: u64,
    /// Available (driver) ring GPA.
    pub driver: u64,
    /// Used (device) ring GPA.
    pub device: u64,
}

/// Everything a virtio-pci function carries across a snapshot or a fork.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioPciState {
    /// The device's name (`rng`, `blk`, `net`): a state restores only into
    /// the same kind of device.
    pub device: String,
    /// PCI configuration space registers (BARs, command, MSI-X control, ...).
    pub pci_config: Vec<u32>,
    /// MSI-X table, pending bits and control.
    pub msix: MsixSnapshot,
    /// Per queue registers.
    pub queues: Vec<QueueRegsState>,
    /// DEVICE_FEATURE_SELECT.
    pub device_feature_select: u32,
    /// DRIVER_FEATURE_SELECT.
    pub driver_feature_select: u32,
    /// Features the driver accepted.
    pub driver_features: u64,
    /// Device status byte.
    pub status: u8,
    /// Configuration-change MSI-X vector.
    pub config_vector: u16,
    /// QUEUE_SELECT.
    pub queue_select: u16,
    /// ISR bits not yet read by the driver.
    pub isr: u8,
    /// Configuration generation.
    pub config_generation: u8,
    /// The device's own state ([`crate::virtio::VirtioDevice::snapshot`]).
    pub device_state: Vec<u8>,
}

fn mismatch(device: &'static str, why: String) -> VirtioError {
    VirtioError::Restore { device, why }
}

impl VirtioPciDevice {
    /// The function's state. The device must be paused (or inactive): its
    /// queues then hold no chain in flight.
    pub fn save_state(&mut self) -> Result<VirtioPciState, VirtioError> {
        let device_state = self.device.snapshot()?;
        Ok(VirtioPciState {
            device: self.device.name().to_string(),
            pci_config: self.config.registers(),
            msix: self.msix.save(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueRegsState {
                    size: q.size,
                    vector: q.vector,
                    ready: q.ready,
                    desc: q.desc,
                    driver: q.driver,
                    device: q.device,
                })
                .collect(),
            device_feature_select: self.device_feature_select,
            driver_feature_select: self.driver_feature_select,
            driver_features: self.driver_features,
            status: self.status,
            config_vector: self.config_vector,
            queue_select: self.queue_select,
            isr: self.irq_status.isr(),
            config_generation: self.irq_status.config_generation(),
            device_state,
        })
    }

    /// Puts `st` into this freshly built function (same device kind, same
    /// place on the bus). A device the driver had live is started by
    /// [`Self::start_restored`]. On error the function is reset and the error
    /// says what did not fit.
    pub fn restore_state(&mut self, st: &VirtioPciState) -> Result<(), VirtioError> {
        let name = self.device.name();
        let r = self.try_restore(st);
        if r.is_err() {
            // Leave nothing half-restored: a reset device, no worker.
            self.reset();
        }
        r.map_err(|e| match e {
            e @ VirtioError::Restore { .. } => e,
            other => mismatch(name, other.to_string()),
        })
    }

    fn try_restore(&mut self, st: &VirtioPciState) -> Result<(), VirtioError> {
        let name = self.device.name();
        if self.active {
            return Err(mismatch(name, "the device is already live".into()));
        }
        if st.device != name {
            return Err(mismatch(name, format!("the saved state is of a {} device", st.device)));
        }
        if st.queues.len() != self.queues.len() {
            return Err(mismatch(
                name,
                format!(
                    "the saved state has {} queues, this device {}",
                    st.queues.len(),
                    self.queues.len()
                ),
            ));
        }
        let offered = self.device.avail_features();
        if st.driver_features & !offered != 0 {
            return Err(mismatch(
                name,
                format!(
                    "the driver accepted features {:#x} that this device does not offer ({offered:#x})",
                    st.driver_features
                ),
            ));
        }
        for (i, (q, s)) in self.queues.iter().zip(&st.queues).enumerate() {
            if s.size == 0 || !s.size.is_power_of_two() || s.size > q.max_size {
                return Err(mismatch(
                    name,
                    format!("queue {i} has size {} (max {})", s.size, q.max_size),
                ));
            }
        }
        self.config
            .restore_registers(&st.pci_config)
            .map_err(|e| mismatch(name, e.to_string()))?;
        self.msix.restore(&st.msix).map_err(|e| mismatch(name, e.to_string()))?;
        for (q, s) in self.queues.iter_mut().zip(&st.queues) {
            *q = QueueRegs {
                max_size: q.max_size,
                size: s.size,
                vector: s.vector,
                ready: s.ready,
                desc: s.desc,
                driver: s.driver,
                device: s.device,
            };
        }
        self.device_feature_select = st.device_feature_select;
        self.driver_feature_select = st.driver_feature_select;
        self.driver_features = st.driver_features;
        self.status = st.status;
        self.config_vector = st.config_vector;
        self.queue_select = st.queue_select;
        self.irq_status.restore(st.isr, st.config_generation);
        let live = st.status & status::DRIVER_OK != 0 && st.status & (status::FAILED | status::DEVICE_NEEDS_RESET) == 0;
        if !live {
            debug!(
                device = name,
                status = st.status,
                "restored a device the driver has not started"
            );
            return Ok(());
        }
        self.device.restore(&st.device_state)?;
        self.restored_live = true;
        Ok(())
    }

    /// Starts a device [`Self::restore_state`] left live: activates it on
    /// the guest's rings (seeded from `used.idx`), kicks every ready queue
    /// and signals it once. Called when the restored VM starts, so nothing
    /// touches guest RAM while it is only built. A no-op otherwise.
    pub fn start_restored(&mut self) -> Result<(), VirtioError> {
        if !std::mem::take(&mut self.restored_live) {
            return Ok(());
        }
        let name = self.device.name();
        if let Err(e) = self.activate(true) {
            self.reset();
            return Err(mismatch(name, format!("it did not start on the guest's rings: {e}")));
        }
        // A kick or an interrupt in flight at the pause is not lost.
        for (i, e) in self.notify.iter().enumerate() {
            if self.queues[i].ready
                && let Err(err) = e.write(1)
            {
                warn!(device = name, queue = i, error = %err, "could not kick a restored queue");
            }
        }
        let irq = self.interrupt();
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready
                && let Err(e) = irq.signal_queue(i as u16)
            {
                warn!(device = name, queue = i, error = %e, "could not signal a restored queue");
            }
        }
        info!(
            device = name,
            features = self.driver_features,
            "virtio device restored live"
        );
        Ok(())
    }
}

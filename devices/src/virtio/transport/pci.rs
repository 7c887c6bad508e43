//! The virtio-pci modern transport: one PCI function per device, every
//! structure in BAR 0, MSI-X for interrupts, no INTx.

use std::sync::Arc;

use thiserror::Error;
use tracing::{debug, error, info, warn};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::layout::{self, common};
use crate::bus::BusDevice;
use crate::pci::{
    BarKind, BarMove, BarRange, MsiRouter, MsixCapability, MsixError, MsixVectors, PCI_CAP_ID_MSIX, PCI_CAP_ID_VENDOR,
    PciConfiguration, PciDevice, PciError, PciHeader,
};
use crate::virtio::diag::DeviceDiag;
use crate::virtio::{
    ActivateContext, ActiveQueue, GuestMemoryHandle, Interrupt, InterruptStatus, VIRTIO_F_VERSION_1,
    VIRTIO_MSI_NO_VECTOR, VIRTIO_RING_F_EVENT_IDX, VirtioDevice, VirtioError, status,
};

/// PCI vendor ID of virtio devices.
pub const VIRTIO_PCI_VENDOR_ID: u16 = 0x1af4;
/// Modern virtio PCI device IDs are this plus the virtio device type.
pub const VIRTIO_PCI_DEVICE_ID_BASE: u16 = 0x1040;

/// Errors from building a virtio-pci device.
#[derive(Debug, Error)]
pub enum VirtioPciError {
    /// Too many queues for the BAR layout.
    #[error("a virtio-pci device supports at most {max} queues, not {got}")]
    TooManyQueues {
        /// Limit.
        max: u16,
        /// Requested.
        got: usize,
    },
    /// The device does not offer VIRTIO_F_VERSION_1.
    #[error("the {0} device does not offer VIRTIO_F_VERSION_1, which the modern transport requires")]
    NotModern(&'static str),
    /// Config space construction failed.
    #[error("building the PCI configuration space failed")]
    Pci(#[from] PciError),
    /// MSI-X setup failed.
    #[error("setting up MSI-X failed")]
    Msix(#[from] MsixError),
    /// Creating or duplicating an eventfd failed.
    #[error("creating a queue notify eventfd failed")]
    EventFd(#[source] std::io::Error),
}

/// A queue notification address for the VMM to register as an ioeventfd
/// (MMIO, no datamatch; kvm-ioctls' `NoDatamatch` gives length 0, matching
/// any access width).
#[derive(Debug)]
pub struct IoEventFd {
    /// Guest physical address of the queue's notify register.
    pub addr: u64,
    /// Queue index.
    pub queue: u16,
    /// The eventfd the device's worker waits on (a duplicate; register it).
    pub eventfd: EventFd,
}

/// Driver-visible state of one queue (registers, not the ring).
#[derive(Clone, Copy, Debug)]
pub(super) struct QueueRegs {
    pub(super) max_size: u16,
    pub(super) size: u16,
    pub(super) vector: u16,
    pub(super) ready: bool,
    pub(super) desc: u64,
    pub(super) driver: u64,
    pub(super) device: u64,
}

impl QueueRegs {
    pub(super) fn new(max_size: u16) -> Self {
        Self {
            max_size,
            size: max_size,
            vector: VIRTIO_MSI_NO_VECTOR,
            ready: false,
            desc: 0,
            driver: 0,
            device: 0,
        }
    }
}

fn set_half(v: &mut u64, high: bool, half: u32) {
    *v = if high {
        (*v & 0xffff_ffff) | u64::from(half) << 32
    } else {
        (*v & !0xffff_ffff) | u64::from(half)
    };
}

/// A [`VirtioDevice`] as a PCI function. Implements [`PciDevice`] (config
/// space, for the PCI root) and [`BusDevice`] (BAR 0, for the MMIO bus at the
/// BAR's address).
pub struct VirtioPciDevice {
    pub(super) config: PciConfiguration,
    pub(super) device: Box<dyn VirtioDevice>,
    pub(super) mem: GuestMemoryHandle,
    pub(super) msix: Arc<MsixVectors>,
    pub(super) msix_cap: usize,
    pub(super) pci_cfg_cap: usize,
    pub(super) irq_status: Arc<InterruptStatus>,
    pub(super) queues: Vec<QueueRegs>,
    pub(super) notify: Vec<EventFd>,
    pub(super) device_feature_select: u32,
    pub(super) driver_feature_select: u32,
    pub(super) driver_features: u64,
    pub(super) status: u8,
    pub(super) config_vector: u16,
    pub(super) queue_select: u16,
    pub(super) active: bool,
    /// Restored live, not started yet ([`Self::start_restored`]).
    pub(super) restored_live: bool,
    /// What the workers record for the state dump ([`Self::debug_state`]).
    pub(super) diag: Arc<DeviceDiag>,
}

impl std::fmt::Debug for VirtioPciDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("device", &self.device.name())
            .field("status", &self.status)
            .field("active", &self.active)
            .finish_non_exhaustive()
    }
}

fn virtio_cap(cfg_type: u8, bar: u8, offset: u64, length: u64, extra: &[u8]) -> Vec<u8> {
    // After ID and next: cap_len, cfg_type, bar, id, padding[2], offset, length, extra.
    let mut b = vec![(16 + extra.len()) as u8, cfg_type, bar, 0, 0, 0];
    b.extend_from_slice(&(offset as u32).to_le_bytes());
    b.extend_from_slice(&(length as u32).to_le_bytes());
    b.extend_from_slice(extra);
    b
}

impl VirtioPciDevice {
    /// Wraps `device`. `mem` is the memory its workers get at activation;
    /// `router` is told about every MSI-X table change. The device has one
    /// MSI-X vector per queue plus one for configuration changes.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryHandle,
        router: Arc<dyn MsiRouter>,
    ) -> Result<Self, VirtioPciError> {
        let nq = device.queue_max_sizes().len();
        if nq == 0 || nq > usize::from(layout::MAX_QUEUES) {
            return Err(VirtioPciError::TooManyQueues {
                max: layout::MAX_QUEUES,
                got: nq,
            });
        }
        if device.avail_features() & VIRTIO_F_VERSION_1 == 0 {
            return Err(VirtioPciError::NotModern(device.name()));
        }
        let num_vectors = nq as u16 + 1;
        let (class, subclass) = device.pci_class();
        let mut config = PciConfiguration::new(PciHeader {
            vendor_id: VIRTIO_PCI_VENDOR_ID,
            device_id: VIRTIO_PCI_DEVICE_ID_BASE + device.device_type() as u16,
            revision: 1,
            class,
            subclass,
            prog_if: 0,
            subsystem_vendor_id: VIRTIO_PCI_VENDOR_ID,
            subsystem_id: 0x40,
        });
        config.add_bar(
            layout::BAR_INDEX,
            layout::BAR_SIZE,
            BarKind::Memory32 { prefetchable: false },
        )?;

        let msix_cap = config.add_capability(
            PCI_CAP_ID_MSIX,
            &MsixCapability {
                table_size: num_vectors,
                table_bar: layout::BAR_INDEX,
                table_offset: layout::MSIX_TABLE_OFFSET as u32,
                pba_bar: layout::BAR_INDEX,
                pba_offset: layout::MSIX_PBA_OFFSET as u32,
            }
            .body(),
        )?;
        config.set_writable(msix_cap, &MsixCapability::writable_mask());
        let bar = layout::BAR_INDEX;
        config.add_capability(
            PCI_CAP_ID_VENDOR,
            &virtio_cap(
                layout::VIRTIO_PCI_CAP_COMMON_CFG,
                bar,
                layout::COMMON_CFG_OFFSET,
                layout::COMMON_CFG_LEN,
                &[],
            ),
        )?;
        config.add_capability(
            PCI_CAP_ID_VENDOR,
            &virtio_cap(
                layout::VIRTIO_PCI_CAP_ISR_CFG,
                bar,
                layout::ISR_CFG_OFFSET,
                layout::ISR_CFG_LEN,
                &[],
            ),
        )?;
        // Linux refuses a DEVICE_CFG capability of length 0, so a device without
        // config space still gets 4 bytes that read as zero.
        let dev_cfg_len = device.config_len().clamp(4, layout::DEVICE_CFG_MAX).next_multiple_of(4);
        config.add_capability(
            PCI_CAP_ID_VENDOR,
            &virtio_cap(
                layout::VIRTIO_PCI_CAP_DEVICE_CFG,
                bar,
                layout::DEVICE_CFG_OFFSET,
                dev_cfg_len,
                &[],
            ),
        )?;
        config.add_capability(
            PCI_CAP_ID_VENDOR,
            &virtio_cap(
                layout::VIRTIO_PCI_CAP_NOTIFY_CFG,
                bar,
                layout::NOTIFY_OFFSET,
                nq as u64 * u64::from(layout::NOTIFY_OFF_MULTIPLIER),
                &layout::NOTIFY_OFF_MULTIPLIER.to_le_bytes(),
            ),
        )?;
        let pci_cfg_cap = config.add_capability(
            PCI_CAP_ID_VENDOR,
            &virtio_cap(layout::VIRTIO_PCI_CAP_PCI_CFG, 0, 0, 0, &[0; 4]),
        )?;
        // cap.bar, cap.offset, cap.length and pci_cfg_data are the driver's to write.
        config.set_writable(pci_cfg_cap + 4, &[0xff]);
        config.set_writable(pci_cfg_cap + 8, &[0xff; 12]);

        let msix = Arc::new(MsixVectors::new(num_vectors, router)?);
        let notify = (0..nq)
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(VirtioPciError::EventFd)?;
        let queues = device.queue_max_sizes().iter().map(|m| QueueRegs::new(*m)).collect();
        Ok(Self {
            config,
            device,
            mem,
            msix,
            msix_cap,
            pci_cfg_cap,
            irq_status: Arc::new(InterruptStatus::default()),
            queues,
            notify,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_vector: VIRTIO_MSI_NO_VECTOR,
            queue_select: 0,
            active: false,
            restored_live: false,
            diag: Arc::new(DeviceDiag::new(nq)),
        })
    }

    /// The device's MSI-X state; `msix().irqfds()[v]` is vector `v`'s eventfd,
    /// to register as a KVM irqfd.
    pub fn msix(&self) -> &Arc<MsixVectors> {
        &self.msix
    }

    /// The notify addresses at the current BAR 0 address, one per queue, with
    /// duplicates of their eventfds. Call after the PCI root placed the
    /// device, and again after a BAR move.
    pub fn ioeventfds(&self) -> Result<Vec<IoEventFd>, VirtioPciError> {
        let base = self.config.bar_address(layout::BAR_INDEX) + layout::NOTIFY_OFFSET;
        self.notify
            .iter()
            .enumerate()
            .map(|(q, e)| {
                Ok(IoEventFd {
                    addr: base + q as u64 * u64::from(layout::NOTIFY_OFF_MULTIPLIER),
                    queue: q as u16,
                    eventfd: e.try_clone().map_err(VirtioPciError::EventFd)?,
                })
            })
            .collect()
    }

    /// The current device status byte.
    pub fn device_status(&self) -> u8 {
        self.status
    }

    /// Whether the device is live (DRIVER_OK accepted and activation succeeded).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Parks the device's workers (see [`VirtioDevice::pause`]): when this
    /// returns, the device writes no guest memory. Called with every vCPU
    /// parked, so no guest access races it. A device the driver has not
    /// started has nothing running: nothing to do.
    pub fn pause(&mut self) -> Result<(), VirtioError> {
        if self.active {
            self.device.pause()?;
        }
        Ok(())
    }

    /// See [`VirtioDevice::can_fork`].
    pub fn can_fork(&self) -> Result<(), VirtioError> {
        self.device.can_fork()
    }

    /// See [`VirtioDevice::fork_backend`].
    pub fn fork_backend(&mut self) -> Result<crate::virtio::ForkBackend, VirtioError> {
        self.device.fork_backend()
    }

    /// See [`VirtioDevice::ram_write_logs`].
    pub fn ram_write_logs(&mut self) -> Result<Vec<Arc<dyn crate::virtio::RamWriteLog>>, VirtioError> {
        self.device.ram_write_logs()
    }

    /// Stops the device and returns the function to its reset state (as a
    /// driver writing status 0 would): the VMM's undo of a failed start.
    pub fn reset_device(&mut self) {
        self.reset();
    }

    /// Restarts what [`Self::pause`] parked.
    pub fn resume(&mut self) -> Result<(), VirtioError> {
        if self.active {
            self.device.resume()?;
        }
        Ok(())
    }

    /// The device's name (`rng`, `blk`, `net`, `vsock`).
    pub fn device_name(&self) -> &'static str {
        self.device.name()
    }

    /// The device's counters (`VirtioDevice::counters`), and
    /// `notifications`: the guest's queue notifications (kicks) its workers
    /// read from the queues' eventfds, all queues, where they reach this
    /// process (not with a vhost backend).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut c = self.device.counters();
        if self.device.notifications_reach_vmm() {
            let kicks = (0..self.diag.len())
                .filter_map(|q| u16::try_from(q).ok())
                .map(|q| self.diag.queue(q).counters().0)
                .fold(0u64, u64::wrapping_add);
            c.push(("notifications", kicks));
        }
        c
    }

    /// A new medium for the device's drive (`VirtioDevice::change_medium`).
    pub fn change_medium(&mut self, medium: std::sync::Arc<k7d_disk::DiskImage>) -> Result<(), VirtioError> {
        self.device.change_medium(medium)
    }

    /// The PCI configuration space (read-only view, e.g. for tests and ACPI).
    pub fn config(&self) -> &PciConfiguration {
        &self.config
    }

    fn fail(&mut self, why: &str) {
        warn!(
            device = self.device.name(),
            status = self.status,
            why,
            "virtio driver broke the protocol; device FAILED until reset"
        );
        self.status |= status::FAILED;
    }

    pub(super) fn reset(&mut self) {
        if self.active {
            let queues = self.device.reset();
            debug!(
                device = self.device.name(),
                returned = queues.len(),
                "device worker stopped"
            );
        }
        self.active = false;
        self.restored_live = false;
        for q in &mut self.queues {
            *q = QueueRegs::new(q.max_size);
        }
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.config_vector = VIRTIO_MSI_NO_VECTOR;
        self.queue_select = 0;
        self.irq_status.reset();
        // Stale kicks from the old driver must not reach the next activation.
        for e in &self.notify {
            let _ = e.read();
        }
        for q in 0..self.queues.len() {
            self.diag.queue(q as u16).forget_position();
        }
        debug!(device = self.device.name(), "virtio device reset");
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if old & status::FAILED != 0 {
            debug!(v, "status write ignored: device FAILED until reset");
            return;
        }
        // NEEDS_RESET is the device's bit; drivers echo it back.
        let mut v = (v & !status::DEVICE_NEEDS_RESET) | (old & status::DEVICE_NEEDS_RESET);
        if v & status::FAILED != 0 {
            info!(device = self.device.name(), "driver set FAILED");
            self.status |= status::FAILED;
            return;
        }
        if v & old != old {
            self.fail("status write clears bits");
            return;
        }
        let new = v & !old;
        if new & status::FEATURES_OK != 0 {
            let offered = self.device.avail_features();
            if self.driver_features & !offered != 0 || self.driver_features & VIRTIO_F_VERSION_1 == 0 {
                warn!(
                    offered,
                    accepted = self.driver_features,
                    "refusing FEATURES_OK: features not offered, or VIRTIO_F_VERSION_1 missing"
                );
                v &= !status::FEATURES_OK;
            }
        }
        let in_order = (v & status::DRIVER == 0 || v & status::ACKNOWLEDGE != 0)
            && (v & status::FEATURES_OK == 0 || v & status::DRIVER != 0)
            && (v & status::DRIVER_OK == 0 || v & status::FEATURES_OK != 0);
        if !in_order {
            self.fail("status bits set out of order");
            return;
        }
        self.status = v;
        if new & status::DRIVER_OK != 0
            && v & status::DRIVER_OK != 0
            && let Err(e) = self.activate(false)
        {
            error!(device = self.device.name(), error = %e, "activation failed; device needs reset");
            self.status |= status::DEVICE_NEEDS_RESET;
            if let Err(e) = self.interrupt().signal_config() {
                warn!(error = %e, "could not signal the config change");
            }
        }
    }

    pub(super) fn interrupt(&self) -> Interrupt {
        Interrupt::with_diag(
            self.msix.clone(),
            self.queues.iter().map(|q| q.vector).collect(),
            self.config_vector,
            self.irq_status.clone(),
            self.diag.clone(),
        )
    }

    /// Hands the ready queues to the device. `seed_from_guest` (restore,
    /// fork): each queue starts where the guest's own used ring says the
    /// device stopped (`next_avail = next_used = used.idx`), never at 0.
    pub(super) fn activate(&mut self, seed_from_guest: bool) -> Result<(), VirtioError> {
        let event_idx = self.driver_features & VIRTIO_RING_F_EVENT_IDX != 0;
        let mut active = Vec::new();
        for (i, r) in self.queues.iter().enumerate() {
            if !r.ready {
                continue;
            }
            let bad = || VirtioError::BadQueue(i as u16);
            let mut q = Queue::new(r.max_size).map_err(|_| bad())?;
            q.try_set_size(r.size).map_err(|_| bad())?;
            q.try_set_desc_table_address(vm_memory::GuestAddress(r.desc))
                .map_err(|_| bad())?;
            q.try_set_avail_ring_address(vm_memory::GuestAddress(r.driver))
                .map_err(|_| bad())?;
            q.try_set_used_ring_address(vm_memory::GuestAddress(r.device))
                .map_err(|_| bad())?;
            q.set_event_idx(event_idx);
            q.set_ready(true);
            if !q.is_valid(&*self.mem) {
                return Err(bad());
            }
            if seed_from_guest {
                crate::virtio::seed_from_used_ring(&mut q, &self.mem).map_err(|_| bad())?;
            }
            let notify = self.notify[i].try_clone().map_err(VirtioError::EventFd)?;
            active.push(ActiveQueue {
                index: i as u16,
                queue: q,
                notify,
            });
        }
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            acked_features: self.driver_features,
            queues: active,
            interrupt: self.interrupt(),
        };
        self.device.activate(ctx)?;
        self.active = true;
        info!(
            device = self.device.name(),
            features = self.driver_features,
            "virtio device live"
        );
        Ok(())
    }

    fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(usize::from(self.queue_select))
    }

    fn read_common(&self, off: u64, len: usize) -> u64 {
        let q = self.selected();
        let qf = |f: fn(&QueueRegs) -> u64| q.map_or(0, f);
        let feat = |sel: u32, v: u64| match sel {
            0 => v & 0xffff_ffff,
            1 => v >> 32,
            _ => 0,
        };
        match (off, len) {
            (common::DEVICE_FEATURE_SELECT, 4) => u64::from(self.device_feature_select),
            (common::DEVICE_FEATURE, 4) => feat(self.device_feature_select, self.device.avail_features()),
            (common::DRIVER_FEATURE_SELECT, 4) => u64::from(self.driver_feature_select),
            (common::DRIVER_FEATURE, 4) => feat(self.driver_feature_select, self.driver_features),
            (common::CONFIG_MSIX_VECTOR, 2) => u64::from(self.config_vector),
            (common::NUM_QUEUES, 2) => self.queues.len() as u64,
            (common::DEVICE_STATUS, 1) => u64::from(self.status),
            (common::CONFIG_GENERATION, 1) => u64::from(self.irq_status.config_generation()),
            (common::QUEUE_SELECT, 2) => u64::from(self.queue_select),
            (common::QUEUE_SIZE, 2) => qf(|q| u64::from(q.size)),
            (common::QUEUE_MSIX_VECTOR, 2) => q.map_or(u64::from(VIRTIO_MSI_NO_VECTOR), |q| u64::from(q.vector)),
            (common::QUEUE_ENABLE, 2) => qf(|q| u64::from(q.ready)),
            (common::QUEUE_NOTIFY_OFF, 2) => q.map_or(0, |_| u64::from(self.queue_select)),
            (common::QUEUE_DESC, 8) => qf(|q| q.desc),
            (common::QUEUE_DRIVER, 8) => qf(|q| q.driver),
            (common::QUEUE_DEVICE, 8) => qf(|q| q.device),
            (0x20..=0x37, 4) if off.is_multiple_of(4) => {
                let v = match off & !7 {
                    common::QUEUE_DESC => qf(|q| q.desc),
                    common::QUEUE_DRIVER => qf(|q| q.driver),
                    _ => qf(|q| q.device),
                };
                if off.is_multiple_of(8) {
                    v & 0xffff_ffff
                } else {
                    v >> 32
                }
            }
            _ => {
                debug!(off, len, "unsupported common config read");
                0
            }
        }
    }

    fn write_common(&mut self, off: u64, data: &[u8]) {
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(b);
        let live = self.status & status::DRIVER_OK != 0;
        let features_locked = self.status & status::FEATURES_OK != 0;
        let num_vectors = self.msix.num_vectors();
        let vector_ok = |x: u16| if x < num_vectors { x } else { VIRTIO_MSI_NO_VECTOR };
        match (off, data.len()) {
            (common::DEVICE_FEATURE_SELECT, 4) => self.device_feature_select = v as u32,
            (common::DRIVER_FEATURE_SELECT, 4) => self.driver_feature_select = v as u32,
            (common::DRIVER_FEATURE, 4) if !features_locked => match self.driver_feature_select {
                0 => set_half(&mut self.driver_features, false, v as u32),
                1 => set_half(&mut self.driver_features, true, v as u32),
                sel => debug!(sel, "ignoring driver features beyond bit 63"),
            },
            (common::CONFIG_MSIX_VECTOR, 2) => self.config_vector = vector_ok(v as u16),
            (common::DEVICE_STATUS, 1) => self.write_status(v as u8),
            (common::QUEUE_SELECT, 2) => self.queue_select = v as u16,
            (common::QUEUE_MSIX_VECTOR, 2) if !live => {
                let vec = vector_ok(v as u16);
                if let Some(q) = self.queues.get_mut(usize::from(self.queue_select)) {
                    q.vector = vec;
                }
            }
            (common::QUEUE_SIZE | common::QUEUE_ENABLE | common::QUEUE_DESC..=0x37, _) if !live => {
                let Some(q) = self.queues.get_mut(usize::from(self.queue_select)) else {
                    debug!(queue = self.queue_select, "write to a queue that does not exist");
                    return;
                };
                match (off, data.len()) {
                    (common::QUEUE_SIZE, 2) => {
                        let s = v as u16;
                        if s == 0 || !s.is_power_of_two() || s > q.max_size {
                            warn!(size = s, max = q.max_size, "ignoring invalid queue size");
                        } else {
                            q.size = s;
                        }
                    }
                    (common::QUEUE_ENABLE, 2) => {
                        if v == 1 {
                            q.ready = true;
                        } else {
                            debug!(v, "ignoring queue_enable write other than 1");
                        }
                    }
                    (_, 8) if off.is_multiple_of(8) => match off {
                        common::QUEUE_DESC => q.desc = v,
                        common::QUEUE_DRIVER => q.driver = v,
                        _ => q.device = v,
                    },
                    (_, 4) if off.is_multiple_of(4) && off >= common::QUEUE_DESC => {
                        let f = match off & !7 {
                            common::QUEUE_DESC => &mut q.desc,
                            common::QUEUE_DRIVER => &mut q.driver,
                            _ => &mut q.device,
                        };
                        set_half(f, off % 8 == 4, v as u32);
                    }
                    _ => debug!(off, len = data.len(), "unsupported queue register write"),
                }
            }
            _ => debug!(off, len = data.len(), live, "ignored common config write"),
        }
    }

    fn bar_read(&mut self, offset: u64, data: &mut [u8]) {
        use layout::*;
        match offset {
            o if o < ISR_CFG_OFFSET => {
                if o + data.len() as u64 > COMMON_CFG_LEN || !matches!(data.len(), 1 | 2 | 4 | 8) {
                    data.fill(0);
                    return;
                }
                let v = self.read_common(o, data.len());
                data.copy_from_slice(&v.to_le_bytes()[..data.len()]);
            }
            o if o < DEVICE_CFG_OFFSET => {
                data.fill(0);
                if o == ISR_CFG_OFFSET && !data.is_empty() {
                    data[0] = self.irq_status.take_isr();
                }
            }
            o if o < NOTIFY_OFFSET => {
                let o = o - DEVICE_CFG_OFFSET;
                if o + data.len() as u64 <= self.device.config_len() {
                    self.device.read_config(o, data);
                } else {
                    data.fill(0);
                }
            }
            o if o < MSIX_TABLE_OFFSET => data.fill(0),
            o if o < MSIX_PBA_OFFSET => self.msix.read_table(o - MSIX_TABLE_OFFSET, data),
            o if o < BAR_SIZE => self.msix.read_pba(o - MSIX_PBA_OFFSET, data),
            _ => data.fill(0xff),
        }
    }

    fn bar_write(&mut self, offset: u64, data: &[u8]) {
        use layout::*;
        match offset {
            o if o < ISR_CFG_OFFSET => {
                if o + data.len() as u64 <= COMMON_CFG_LEN && matches!(data.len(), 1 | 2 | 4 | 8) {
                    self.write_common(o, data);
                }
            }
            o if o < DEVICE_CFG_OFFSET => debug!(o, "ignoring write to ISR"),
            o if o < NOTIFY_OFFSET => {
                let o = o - DEVICE_CFG_OFFSET;
                if o + data.len() as u64 <= self.device.config_len() {
                    self.device.write_config(o, data);
                }
            }
            o if o < MSIX_TABLE_OFFSET => {
                // Trapped notify (no ioeventfd registered for it): kick the worker ourselves.
                let q = (o - NOTIFY_OFFSET) / u64::from(NOTIFY_OFF_MULTIPLIER);
                match self.notify.get(q as usize) {
                    Some(e) => {
                        if let Err(err) = e.write(1) {
                            warn!(queue = q, error = %err, "queue notify failed");
                        }
                    }
                    None => debug!(q, "notify for a queue that does not exist"),
                }
            }
            o if o < MSIX_PBA_OFFSET => self.msix.write_table(o - MSIX_TABLE_OFFSET, data),
            _ => debug!(offset, "ignoring write to the PBA or past BAR 0"),
        }
    }

    /// The PCI_CFG capability window: (bar, offset, length) the driver set.
    fn pci_cfg_window(&self) -> Option<(u64, usize)> {
        let c = self.pci_cfg_cap;
        let bar = self.config.byte(c + 4);
        let off = u64::from(self.config.dword(c + 8));
        let len = self.config.dword(c + 12) as usize;
        (bar == layout::BAR_INDEX && matches!(len, 1 | 2 | 4) && off.checked_add(len as u64)? <= layout::BAR_SIZE)
            .then_some((off, len))
    }
}

impl PciDevice for VirtioPciDevice {
    fn read_config_register(&mut self, reg: usize) -> u32 {
        if reg == (self.pci_cfg_cap + 16) / 4 {
            if let Some((off, len)) = self.pci_cfg_window() {
                let mut b = [0u8; 4];
                self.bar_read(off, &mut b[..len]);
                return u32::from_le_bytes(b);
            }
            return 0;
        }
        self.config.read_reg(reg)
    }

    fn write_config_register(&mut self, reg: usize, offset: u64, data: &[u8]) -> Option<BarMove> {
        let mv = self.config.write_reg(reg, offset, data);
        if reg == self.msix_cap / 4 {
            let ctrl = (self.config.dword(self.msix_cap) >> 16) as u16;
            let (enabled, masked) = MsixCapability::decode_control(ctrl);
            self.msix.set_control(enabled, masked);
        } else if reg == (self.pci_cfg_cap + 16) / 4
            && let Some((off, len)) = self.pci_cfg_window()
        {
            let b = self.config.dword(self.pci_cfg_cap + 16).to_le_bytes();
            self.bar_write(off, &b[..len]);
        }
        mv
    }

    fn bar_requests(&self) -> Vec<BarRange> {
        self.config.bars()
    }

    fn set_bar_address(&mut self, index: u8, addr: u64) {
        self.config.set_bar_address(index, addr);
    }

    fn bars(&self) -> Vec<BarRange> {
        self.config.bars()
    }
}

impl BusDevice for VirtioPciDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.bar_read(offset, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.bar_write(offset, data);
    }
}

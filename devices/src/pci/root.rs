//! The PCI root: host bridge 00:00.0 and one bus of devices, with config
//! access through legacy port I/O (CF8/CFC) and ECAM, and BAR allocation.

use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{debug, info, warn};

use super::config::{BarKind, PciConfiguration, PciHeader};
use super::{BarMove, BarRange, PciBdf, PciDevice, PciError};
use crate::bus::BusDevice;

/// The legacy configuration mechanism #1 ports: address at 0xCF8, data at 0xCFC.
pub const PCI_CONFIG_IO_PORT: u64 = 0xcf8;
/// Length of the legacy configuration port range.
pub const PCI_CONFIG_IO_LEN: u64 = 8;
/// ECAM bytes per bus (32 devices × 8 functions × 4 KiB).
pub const ECAM_BUS_SIZE: u64 = 1 << 20;
const SLOTS: usize = 32;

/// Hands out naturally aligned BAR ranges from one MMIO window, bottom up.
#[derive(Clone, Debug)]
pub struct BarAllocator {
    base: u64,
    end: u64,
    next: u64,
}

impl BarAllocator {
    /// A window `[base, base + len)`.
    pub fn new(base: u64, len: u64) -> Result<Self, PciError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(PciError::BadWindow { base, len })?;
        Ok(Self { base, end, next: base })
    }

    /// The window this allocator serves, as (base, len).
    pub fn window(&self) -> (u64, u64) {
        (self.base, self.end - self.base)
    }

    /// A `size`-byte range aligned to `size` (a power of two), or `None`.
    pub fn allocate(&mut self, size: u64) -> Option<u64> {
        if !size.is_power_of_two() {
            return None;
        }
        let start = self.next.checked_add(size - 1)? & !(size - 1);
        let end = start.checked_add(size)?;
        (end <= self.end).then(|| {
            self.next = end;
            start
        })
    }
}

/// Told when the guest moves a BAR, so the VMM can move the device's bus
/// range and its ioeventfds. Called with the PCI root locked (the device is
/// not): it must not make config accesses.
pub trait BarRelocator: Send + Sync {
    /// Device `bdf` moved a BAR.
    fn move_bar(&self, bdf: PciBdf, mv: BarMove);
}

/// What [`PciRoot::add_device`] assigned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciAttachment {
    /// The device's address.
    pub bdf: PciBdf,
    /// Its BARs at their assigned addresses: place the device on the MMIO bus there.
    pub bars: Vec<BarRange>,
}

/// Host bridge at 00:00.0 (Red Hat's "QEMU PCIe host bridge" ID, class 06:00:00).
/// Linux's legacy-config sanity check looks for a host bridge on bus 0.
#[derive(Debug)]
pub struct HostBridge {
    config: PciConfiguration,
}

impl Default for HostBridge {
    fn default() -> Self {
        Self {
            config: PciConfiguration::new(PciHeader {
                vendor_id: 0x1b36,
                device_id: 0x0008,
                revision: 0,
                class: 0x06,
                subclass: 0x00,
                prog_if: 0,
                subsystem_vendor_id: 0x1af4,
                subsystem_id: 0x1100,
            }),
        }
    }
}

impl PciDevice for HostBridge {
    fn read_config_register(&mut self, reg: usize) -> u32 {
        self.config.read_reg(reg)
    }
    fn write_config_register(&mut self, reg: usize, offset: u64, data: &[u8]) -> Option<BarMove> {
        self.config.write_reg(reg, offset, data)
    }
    fn bar_requests(&self) -> Vec<BarRange> {
        Vec::new()
    }
    fn set_bar_address(&mut self, _index: u8, _addr: u64) {}
    fn bars(&self) -> Vec<BarRange> {
        Vec::new()
    }
}

type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

fn lock_dev(d: &SharedPciDevice) -> MutexGuard<'_, dyn PciDevice + 'static> {
    d.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bus 0: the host bridge in slot 0 and up to 31 devices (function 0 each).
pub struct PciRoot {
    slots: Vec<Option<SharedPciDevice>>,
    mmio32: BarAllocator,
    mmio64: Option<BarAllocator>,
    relocator: Option<Arc<dyn BarRelocator>>,
}

impl PciRoot {
    /// A root whose BARs come from `mmio32` (below 4 GiB) and, for 64-bit
    /// BARs, `mmio64` when given. These windows are what ACPI `_CRS` reports.
    pub fn new(mmio32: BarAllocator, mmio64: Option<BarAllocator>) -> Self {
        let mut slots: Vec<Option<SharedPciDevice>> = vec![None; SLOTS];
        slots[0] = Some(Arc::new(Mutex::new(HostBridge::default())));
        Self {
            slots,
            mmio32,
            mmio64,
            relocator: None,
        }
    }

    /// Installs the hook told about guest BAR moves.
    pub fn set_relocator(&mut self, r: Arc<dyn BarRelocator>) {
        self.relocator = Some(r);
    }

    /// Puts `dev` in the next free slot, allocates and programs its BARs.
    pub fn add_device(&mut self, dev: SharedPciDevice) -> Result<PciAttachment, PciError> {
        let slot = self.slots.iter().position(Option::is_none).ok_or(PciError::BusFull)?;
        let mut d = lock_dev(&dev);
        let mut bars = Vec::new();
        // Big BARs first keeps the window tight; natural alignment either way.
        let mut reqs = d.bar_requests();
        reqs.sort_by_key(|b| std::cmp::Reverse(b.len));
        for req in reqs {
            let addr = match req.kind {
                BarKind::Memory64 { .. } => match self.mmio64.as_mut() {
                    Some(w) => w.allocate(req.len).ok_or(PciError::WindowExhausted {
                        size: req.len,
                        window: "64-bit",
                    })?,
                    None => self.mmio32.allocate(req.len).ok_or(PciError::WindowExhausted {
                        size: req.len,
                        window: "32-bit",
                    })?,
                },
                BarKind::Memory32 { .. } => self.mmio32.allocate(req.len).ok_or(PciError::WindowExhausted {
                    size: req.len,
                    window: "32-bit",
                })?,
                BarKind::Io => return Err(PciError::IoBar(req.index)),
            };
            d.set_bar_address(req.index, addr);
            bars.push(BarRange { addr, ..req });
        }
        bars.sort_by_key(|b| b.index);
        drop(d);
        self.slots[slot] = Some(dev);
        let bdf = PciBdf {
            bus: 0,
            device: slot as u8,
            function: 0,
        };
        info!(%bdf, ?bars, "PCI device attached");
        Ok(PciAttachment { bdf, bars })
    }

    fn device(&self, bus: u8, dev: u8, func: u8) -> Option<&SharedPciDevice> {
        if bus != 0 || func != 0 {
            return None;
        }
        self.slots.get(usize::from(dev))?.as_ref()
    }

    /// Reads config register `reg` (dword index, 0..1024) of bus/dev/func;
    /// all ones where no function exists.
    pub fn config_read(&self, bus: u8, dev: u8, func: u8, reg: usize) -> u32 {
        match self.device(bus, dev, func) {
            Some(d) => lock_dev(d).read_config_register(reg),
            None => u32::MAX,
        }
    }

    /// Writes `data` at byte `offset` of config register `reg` of bus/dev/func.
    pub fn config_write(&self, bus: u8, dev: u8, func: u8, reg: usize, offset: u64, data: &[u8]) {
        let Some(d) = self.device(bus, dev, func) else { return };
        let mv = lock_dev(d).write_config_register(reg, offset, data);
        if let Some(mv) = mv {
            let bdf = PciBdf {
                bus,
                device: dev,
                function: func,
            };
            match &self.relocator {
                Some(r) => r.move_bar(bdf, mv),
                None => warn!(%bdf, ?mv, "guest moved a BAR and no relocator is installed"),
            }
        }
    }
}

fn read_bytes(dword: u32, offset: usize, data: &mut [u8]) {
    let bytes = dword.to_le_bytes();
    match bytes.get(offset..offset + data.len()) {
        Some(src) => data.copy_from_slice(src),
        None => data.fill(0xff),
    }
}

fn lock_root(r: &Arc<Mutex<PciRoot>>) -> MutexGuard<'_, PciRoot> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

/// Configuration mechanism #1: a [`BusDevice`] for ports 0xCF8..0xD00.
/// Only dword accesses to 0xCF8 latch the address (byte writes to 0xCF9, the
/// PC reset-control register, are ignored here).
pub struct PciConfigIo {
    root: Arc<Mutex<PciRoot>>,
    address: u32,
}

impl PciConfigIo {
    /// Config I/O over `root`.
    pub fn new(root: Arc<Mutex<PciRoot>>) -> Self {
        Self { root, address: 0 }
    }

    fn target(&self) -> Option<(u8, u8, u8, usize)> {
        (self.address & 0x8000_0000 != 0).then(|| {
            let a = self.address;
            (
                (a >> 16) as u8,
                ((a >> 11) & 0x1f) as u8,
                ((a >> 8) & 7) as u8,
                ((a >> 2) & 0x3f) as usize,
            )
        })
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 => match self.target() {
                Some((b, d, f, reg)) => {
                    let v = lock_root(&self.root).config_read(b, d, f, reg);
                    read_bytes(v, (offset - 4) as usize, data);
                }
                None => data.fill(0xff),
            },
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            0 if data.len() == 4 => {
                self.address = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) & 0x80ff_fffc;
            }
            4..=7 => {
                let off = offset - 4;
                if off as usize + data.len() > 4 {
                    return;
                }
                if let Some((b, d, f, reg)) = self.target() {
                    lock_root(&self.root).config_write(b, d, f, reg, off, data);
                }
            }
            _ => debug!(offset, len = data.len(), "ignoring write to PCI config port"),
        }
    }
}

/// PCIe ECAM (MMCONFIG): a [`BusDevice`] for an MMIO window of
/// `ECAM_BUS_SIZE` bytes per bus, starting at bus 0. The VMM picks the base
/// and reports it in the ACPI MCFG table.
pub struct PciConfigMmio {
    root: Arc<Mutex<PciRoot>>,
}

impl PciConfigMmio {
    /// ECAM over `root`.
    pub fn new(root: Arc<Mutex<PciRoot>>) -> Self {
        Self { root }
    }

    fn decode(offset: u64) -> (u8, u8, u8, usize, usize) {
        (
            ((offset >> 20) & 0xff) as u8,
            ((offset >> 15) & 0x1f) as u8,
            ((offset >> 12) & 7) as u8,
            ((offset & 0xfff) >> 2) as usize,
            (offset & 3) as usize,
        )
    }
}

impl BusDevice for PciConfigMmio {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let (b, d, f, reg, byte) = Self::decode(offset);
        if byte + data.len() > 4 {
            data.fill(0xff);
            return;
        }
        let v = lock_root(&self.root).config_read(b, d, f, reg);
        read_bytes(v, byte, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (b, d, f, reg, byte) = Self::decode(offset);
        if byte + data.len() > 4 {
            return;
        }
        lock_root(&self.root).config_write(b, d, f, reg, byte as u64, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_aligns_and_exhausts() {
        let mut a = BarAllocator::new(0xc000_1000, 0x10000).unwrap();
        assert_eq!(a.allocate(0x4000), Some(0xc000_4000));
        assert_eq!(a.allocate(0x1000), Some(0xc000_8000));
        assert_eq!(a.allocate(0x8000), None);
        assert_eq!(a.allocate(3), None);
        assert!(BarAllocator::new(u64::MAX, 2).is_err());
    }

    #[test]
    fn host_bridge_via_cf8_and_ecam() {
        let root = Arc::new(Mutex::new(PciRoot::new(
            BarAllocator::new(0xc000_0000, 0x1000_0000).unwrap(),
            None,
        )));
        let mut io = PciConfigIo::new(root.clone());
        io.write(0, &0x8000_0000u32.to_le_bytes());
        let mut v = [0u8; 4];
        io.read(0, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x8000_0000);
        io.read(4, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x0008_1b36);
        let mut w = [0u8; 2];
        io.read(6, &mut w);
        assert_eq!(u16::from_le_bytes(w), 0x0008);
        // Class code through ECAM.
        let mut ecam = PciConfigMmio::new(root.clone());
        ecam.read(8, &mut v);
        assert_eq!(u32::from_le_bytes(v) >> 8, 0x06_00_00);
        // Absent device and absent bus read as ones.
        ecam.read(1 << 15, &mut v);
        assert_eq!(v, [0xff; 4]);
        ecam.read(1 << 20, &mut v);
        assert_eq!(v, [0xff; 4]);
        // Disabled address latch.
        io.write(0, &0u32.to_le_bytes());
        io.read(4, &mut v);
        assert_eq!(v, [0xff; 4]);
    }
}

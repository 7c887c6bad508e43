//! A type 0 configuration space: header, BARs with the sizing protocol, and a
//! capability list.

use super::{BarMove, BarRange, PciError};

/// Size of the conventional configuration space this crate implements. ECAM
/// exposes 4 KiB per function; the extended part reads as zero (no extended
/// capabilities).
pub const PCI_CONFIG_SPACE_SIZE: usize = 256;
/// Number of BAR registers in a type 0 header.
pub const NUM_BARS: usize = 6;

const NUM_REGS: usize = PCI_CONFIG_SPACE_SIZE / 4;
const BAR0_REG: usize = 4;
const CAP_PTR_OFFSET: usize = 0x34;
const FIRST_CAP_OFFSET: usize = 0x40;
const STATUS_CAP_LIST: u32 = 1 << 20;

/// What a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    /// 32-bit memory BAR.
    Memory32 {
        /// Prefetchable.
        prefetchable: bool,
    },
    /// 64-bit memory BAR (takes two BAR registers).
    Memory64 {
        /// Prefetchable.
        prefetchable: bool,
    },
    /// I/O port BAR.
    Io,
}

impl BarKind {
    fn flag_bits(self) -> u32 {
        match self {
            BarKind::Memory32 { prefetchable } => u32::from(prefetchable) << 3,
            BarKind::Memory64 { prefetchable } => 0b100 | (u32::from(prefetchable) << 3),
            BarKind::Io => 0b1,
        }
    }

    fn addr_mask(self) -> u32 {
        match self {
            BarKind::Io => !0b11,
            _ => !0b1111,
        }
    }
}

/// The identity fields of a type 0 header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciHeader {
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
    /// Revision ID.
    pub revision: u8,
    /// Base class code.
    pub class: u8,
    /// Subclass code.
    pub subclass: u8,
    /// Programming interface.
    pub prog_if: u8,
    /// Subsystem vendor ID.
    pub subsystem_vendor_id: u16,
    /// Subsystem ID.
    pub subsystem_id: u16,
}

#[derive(Clone, Copy, Debug, Default)]
struct BarSlot {
    /// Size in bytes; 0 = unused.
    size: u64,
    kind: Option<BarKind>,
    /// Last programmed (non-sizing) base address.
    addr: u64,
}

/// One entry of the capability list, as found by walking it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapabilityInfo {
    /// Byte offset of the capability in config space.
    pub offset: usize,
    /// Capability ID.
    pub id: u8,
}

/// A type 0 configuration space with write masks.
#[derive(Clone, Debug)]
pub struct PciConfiguration {
    regs: [u32; NUM_REGS],
    wmask: [u32; NUM_REGS],
    bars: [BarSlot; NUM_BARS],
    next_cap: usize,
    last_cap: Option<usize>,
}

impl PciConfiguration {
    /// A header with the given identity, no BARs, no capabilities, no INTx pin.
    pub fn new(h: PciHeader) -> Self {
        let mut regs = [0u32; NUM_REGS];
        let mut wmask = [0u32; NUM_REGS];
        regs[0] = u32::from(h.device_id) << 16 | u32::from(h.vendor_id);
        // Command: I/O space, memory space, bus master, INTx disable are writable.
        wmask[1] = 0x0000_0407;
        regs[2] =
            u32::from(h.class) << 24 | u32::from(h.subclass) << 16 | u32::from(h.prog_if) << 8 | u32::from(h.revision);
        // Cache line size and latency timer are read/write scratch bytes; header type 0.
        wmask[3] = 0x0000_ffff;
        regs[11] = u32::from(h.subsystem_id) << 16 | u32::from(h.subsystem_vendor_id);
        // Interrupt line is scratch for the OS; interrupt pin 0 (no INTx).
        wmask[15] = 0x0000_00ff;
        Self {
            regs,
            wmask,
            bars: [BarSlot::default(); NUM_BARS],
            next_cap: FIRST_CAP_OFFSET,
            last_cap: None,
        }
    }

    /// Declares BAR `index` of `size` bytes (a power of two, at least 16; 4 for I/O).
    pub fn add_bar(&mut self, index: u8, size: u64, kind: BarKind) -> Result<(), PciError> {
        let i = usize::from(index);
        let wide = matches!(kind, BarKind::Memory64 { .. });
        if i >= NUM_BARS
            || (wide && i + 1 >= NUM_BARS)
            || self.bars[i].size != 0
            || (wide && self.bars[i + 1].size != 0)
        {
            return Err(PciError::BarInUse(index));
        }
        let min = if kind == BarKind::Io { 4 } else { 16 };
        if !size.is_power_of_two() || size < min || (!wide && size > 1 << 31) {
            return Err(PciError::BarSize(size));
        }
        self.bars[i] = BarSlot {
            size,
            kind: Some(kind),
            addr: 0,
        };
        self.regs[BAR0_REG + i] = kind.flag_bits();
        self.wmask[BAR0_REG + i] = kind.addr_mask() & !((size - 1) as u32);
        if wide {
            // The upper half is a plain address register; mark the slot taken.
            self.bars[i + 1] = BarSlot {
                size: u64::MAX,
                kind: None,
                addr: 0,
            };
            self.wmask[BAR0_REG + i + 1] = !((size - 1) >> 32) as u32;
        }
        Ok(())
    }

    /// Programs BAR `index` to `addr` (the firmware's job; the VMM plays firmware).
    pub fn set_bar_address(&mut self, index: u8, addr: u64) {
        let i = usize::from(index);
        let Some(kind) = self.bars.get(i).and_then(|b| b.kind) else {
            return;
        };
        let r = BAR0_REG + i;
        self.regs[r] = (addr as u32 & self.wmask[r]) | kind.flag_bits();
        if matches!(kind, BarKind::Memory64 { .. }) {
            self.regs[r + 1] = (addr >> 32) as u32 & self.wmask[r + 1];
        }
        self.bars[i].addr = self.decode_bar(i);
    }

    /// The whole register file (for a snapshot of the device).
    pub fn registers(&self) -> Vec<u32> {
        self.regs.to_vec()
    }

    /// Puts back a register file saved by [`Self::registers`] from the same
    /// kind of device (fork, restore). The BARs must decode to the addresses
    /// this space has now: a restored device sits where the VMM placed it.
    pub fn restore_registers(&mut self, regs: &[u32]) -> Result<(), PciError> {
        if regs.len() != NUM_REGS {
            return Err(PciError::Restore(format!(
                "the saved configuration space has {} registers, not {NUM_REGS}",
                regs.len()
            )));
        }
        if regs[0] != self.regs[0] || regs[2] != self.regs[2] {
            return Err(PciError::Restore(format!(
                "the saved configuration space is of device {:#010x} class {:#010x}, this one {:#010x} class {:#010x}",
                regs[0], regs[2], self.regs[0], self.regs[2]
            )));
        }
        let before: Vec<u64> = (0..NUM_BARS).map(|i| self.decode_bar(i)).collect();
        let saved = self.regs;
        // Only what a driver can write comes from the saved state; the rest
        // (identity, capability layout, read-only bits) is this device's.
        for (i, r) in self.regs.iter_mut().enumerate() {
            *r = (*r & !self.wmask[i]) | (regs[i] & self.wmask[i]);
        }
        for (i, was) in before.iter().enumerate() {
            if self.decode_bar(i) != *was {
                let got = self.decode_bar(i);
                self.regs = saved;
                return Err(PciError::Restore(format!(
                    "BAR {i} was saved at {got:#x}, but this device sits at {was:#x}"
                )));
            }
        }
        Ok(())
    }

    /// The current base address of BAR `index` (0 if absent).
    pub fn bar_address(&self, index: u8) -> u64 {
        self.bars
            .get(usize::from(index))
            .filter(|b| b.kind.is_some())
            .map_or(0, |b| b.addr)
    }

    /// All declared BARs with their current addresses.
    pub fn bars(&self) -> Vec<BarRange> {
        self.bars
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                b.kind.map(|kind| BarRange {
                    index: i as u8,
                    addr: b.addr,
                    len: b.size,
                    kind,
                })
            })
            .collect()
    }

    fn decode_bar(&self, i: usize) -> u64 {
        let Some(kind) = self.bars[i].kind else { return 0 };
        let lo = u64::from(self.regs[BAR0_REG + i] & kind.addr_mask());
        match kind {
            BarKind::Memory64 { .. } => lo | u64::from(self.regs[BAR0_REG + i + 1]) << 32,
            _ => lo,
        }
    }

    /// Appends a capability with ID `id`; `body` is everything after the ID and
    /// next-pointer bytes. Returns the capability's offset.
    pub fn add_capability(&mut self, id: u8, body: &[u8]) -> Result<usize, PciError> {
        let len = body.len() + 2;
        let off = self.next_cap;
        if off + len > PCI_CONFIG_SPACE_SIZE {
            return Err(PciError::CapabilitySpace(len));
        }
        self.set_byte(off, id);
        self.set_byte(off + 1, 0);
        for (k, b) in body.iter().enumerate() {
            self.set_byte(off + 2 + k, *b);
        }
        match self.last_cap {
            Some(prev) => self.set_byte(prev + 1, off as u8),
            None => {
                self.set_byte(CAP_PTR_OFFSET, off as u8);
                self.regs[1] |= STATUS_CAP_LIST;
            }
        }
        self.last_cap = Some(off);
        self.next_cap = (off + len + 3) & !3;
        Ok(off)
    }

    /// Makes the bits set in `mask` writable by the guest at byte `offset`.
    pub fn set_writable(&mut self, offset: usize, mask: &[u8]) {
        for (k, m) in mask.iter().enumerate() {
            let o = offset + k;
            if o < PCI_CONFIG_SPACE_SIZE {
                let shift = (o % 4) * 8;
                self.wmask[o / 4] = (self.wmask[o / 4] & !(0xff << shift)) | (u32::from(*m) << shift);
            }
        }
    }

    /// Walks the capability list from the capabilities pointer, as a driver does.
    pub fn capabilities(&self) -> Vec<CapabilityInfo> {
        let mut out = Vec::new();
        let mut ptr = usize::from(self.byte(CAP_PTR_OFFSET)) & !3;
        while ptr != 0 && out.len() < 48 {
            out.push(CapabilityInfo {
                offset: ptr,
                id: self.byte(ptr),
            });
            ptr = usize::from(self.byte(ptr + 1)) & !3;
        }
        out
    }

    /// Byte at `offset` (0 past the implemented space).
    pub fn byte(&self, offset: usize) -> u8 {
        self.regs.get(offset / 4).map_or(0, |r| (r >> ((offset % 4) * 8)) as u8)
    }

    /// Little-endian dword at byte `offset` (which need not be aligned).
    pub fn dword(&self, offset: usize) -> u32 {
        u32::from_le_bytes([
            self.byte(offset),
            self.byte(offset + 1),
            self.byte(offset + 2),
            self.byte(offset + 3),
        ])
    }

    /// Sets a byte regardless of the write mask (device side).
    pub fn set_byte(&mut self, offset: usize, v: u8) {
        if let Some(r) = self.regs.get_mut(offset / 4) {
            let shift = (offset % 4) * 8;
            *r = (*r & !(0xff << shift)) | (u32::from(v) << shift);
        }
    }

    /// Sets a little-endian dword regardless of the write mask (device side).
    pub fn set_dword(&mut self, offset: usize, v: u32) {
        for (k, b) in v.to_le_bytes().into_iter().enumerate() {
            self.set_byte(offset + k, b);
        }
    }

    /// Reads register `reg` (zero past the implemented space).
    pub fn read_reg(&self, reg: usize) -> u32 {
        self.regs.get(reg).copied().unwrap_or(0)
    }

    /// Guest write of `data` at byte `offset` of register `reg`, through the
    /// write masks. Returns the BAR move this caused, if any. Writes that are
    /// not 1, 2 or 4 bytes within one register are ignored.
    pub fn write_reg(&mut self, reg: usize, offset: u64, data: &[u8]) -> Option<BarMove> {
        let off = offset as usize;
        if reg >= NUM_REGS || !matches!(data.len(), 1 | 2 | 4) || off + data.len() > 4 {
            return None;
        }
        for (k, b) in data.iter().enumerate() {
            let shift = (off + k) * 8;
            let m = (self.wmask[reg] >> shift) as u8;
            let old = (self.regs[reg] >> shift) as u8;
            let new = (old & !m) | (b & m);
            self.regs[reg] = (self.regs[reg] & !(0xff << shift)) | (u32::from(new) << shift);
        }
        (BAR0_REG..BAR0_REG + NUM_BARS)
            .contains(&reg)
            .then(|| self.check_bar_move(reg - BAR0_REG))
            .flatten()
    }

    /// After a write to BAR register `i`, decides whether the guest moved a BAR.
    /// Sizing writes (all address bits ones) are not moves.
    fn check_bar_move(&mut self, i: usize) -> Option<BarMove> {
        // Name the BAR by its low half.
        let base = if self.bars[i].kind.is_none() && i > 0 && self.bars[i].size == u64::MAX {
            i - 1
        } else {
            i
        };
        let kind = self.bars[base].kind?;
        let r = BAR0_REG + base;
        let sizing = |reg: usize| self.regs[reg] & self.wmask[reg] == self.wmask[reg];
        if sizing(r) || (matches!(kind, BarKind::Memory64 { .. }) && sizing(r + 1) && self.wmask[r + 1] != 0) {
            return None;
        }
        let new = self.decode_bar(base);
        let old = self.bars[base].addr;
        if new == old {
            return None;
        }
        self.bars[base].addr = new;
        Some(BarMove {
            index: base as u8,
            old,
            new,
            len: self.bars[base].size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> PciHeader {
        PciHeader {
            vendor_id: 0x1af4,
            device_id: 0x1044,
            revision: 1,
            class: 0xff,
            subclass: 0,
            prog_if: 0,
            subsystem_vendor_id: 0x1af4,
            subsystem_id: 0x40,
        }
    }

    #[test]
    fn bar_sizing_32_and_64() {
        let mut c = PciConfiguration::new(hdr());
        c.add_bar(0, 0x8000, BarKind::Memory32 { prefetchable: false }).unwrap();
        c.add_bar(2, 0x1_0000_0000, BarKind::Memory64 { prefetchable: true })
            .unwrap();
        c.set_bar_address(0, 0xc000_0000);
        assert_eq!(c.read_reg(4), 0xc000_0000);
        assert_eq!(c.write_reg(4, 0, &[0xff; 4]), None);
        assert_eq!(c.read_reg(4), 0xffff_8000);
        assert_eq!(
            c.write_reg(4, 0, &0xc000_0000u32.to_le_bytes()),
            None,
            "restoring is not a move"
        );
        assert_eq!(c.read_reg(5), 0, "BAR 1 is unimplemented");
        c.write_reg(6, 0, &[0xff; 4]);
        c.write_reg(7, 0, &[0xff; 4]);
        assert_eq!(
            c.read_reg(6),
            0x0000_000c,
            "low half of a 4 GiB BAR has no writable bits"
        );
        assert_eq!(c.read_reg(7), 0xffff_ffff);
        assert!(c.add_bar(3, 16, BarKind::Io).is_err(), "BAR 3 is BAR 2's upper half");
        assert!(c.add_bar(4, 24, BarKind::Io).is_err());
    }

    #[test]
    fn bar_move_is_reported() {
        let mut c = PciConfiguration::new(hdr());
        c.add_bar(0, 0x1000, BarKind::Memory32 { prefetchable: false }).unwrap();
        c.set_bar_address(0, 0xc000_0000);
        let mv = c.write_reg(4, 0, &0xd000_0000u32.to_le_bytes());
        assert_eq!(
            mv,
            Some(BarMove {
                index: 0,
                old: 0xc000_0000,
                new: 0xd000_0000,
                len: 0x1000
            })
        );
        assert_eq!(c.bar_address(0), 0xd000_0000);
    }

    #[test]
    fn read_only_fields_stay() {
        let mut c = PciConfiguration::new(hdr());
        c.write_reg(0, 0, &[0; 4]);
        assert_eq!(c.read_reg(0), 0x1044_1af4);
        c.write_reg(1, 0, &[0xff, 0xff]);
        assert_eq!(c.read_reg(1) & 0xffff, 0x0407);
    }

    #[test]
    fn capability_chain() {
        let mut c = PciConfiguration::new(hdr());
        let a = c.add_capability(0x11, &[0; 10]).unwrap();
        let b = c.add_capability(0x09, &[1; 14]).unwrap();
        assert_eq!((a, b), (0x40, 0x4c));
        assert_ne!(c.read_reg(1) & STATUS_CAP_LIST, 0);
        let caps = c.capabilities();
        assert_eq!(
            caps,
            vec![
                CapabilityInfo { offset: 0x40, id: 0x11 },
                CapabilityInfo { offset: 0x4c, id: 9 }
            ]
        );
        assert!(c.add_capability(0x09, &[0; 200]).is_err());
    }
}

//! The ACPI PM1a register block the FADT points at (port I/O at
//! [`ACPI_PM_BASE`], [`ACPI_PM_LEN`] ports): how a guest `poweroff` reaches
//! the VMM.
//!
//! Linux powers off by entering S5: it reads `\_S5_` from the DSDT and writes
//! `SLP_TYP = 5` then `SLP_TYP = 5 | SLP_EN` to PM1a_CNT. This device calls
//! its handler on the second write. Layout from the base: PM1_STS (word,
//! write-1-to-clear), PM1_EN (word), PM1_CNT (word; SCI_EN reads as 1: the
//! machine is always in ACPI mode, the FADT has no SMI_CMD), 2 spare bytes.

use std::sync::Arc;

use k7d_devices::bus::BusDevice;

use super::layout::{ACPI_PM_BASE, ACPI_PM_LEN, ACPI_S5_SLP_TYP};

/// PM1_CNT: SCI enabled (always).
pub const PM1_CNT_SCI_EN: u16 = 1;
/// PM1_CNT: sleep enable (write-only).
pub const PM1_CNT_SLP_EN: u16 = 1 << 13;
/// PM1_CNT: sleep type field shift (3 bits).
pub const PM1_CNT_SLP_TYP_SHIFT: u16 = 10;

/// Called once the guest enters S5.
pub type PoweroffHandler = Arc<dyn Fn() + Send + Sync>;

/// The PM1a event + control registers.
pub struct AcpiPmDevice {
    regs: [u8; ACPI_PM_LEN as usize],
    on_poweroff: PoweroffHandler,
}

impl AcpiPmDevice {
    /// Where the VMM puts it on the PIO bus: `(base, length)`.
    pub const RANGE: (u64, u64) = (ACPI_PM_BASE as u64, ACPI_PM_LEN as u64);

    /// A device that calls `on_poweroff` when the guest enters S5.
    pub fn new(on_poweroff: PoweroffHandler) -> Self {
        let mut regs = [0; ACPI_PM_LEN as usize];
        regs[4] = PM1_CNT_SCI_EN as u8;
        Self { regs, on_poweroff }
    }

    fn cnt(&self) -> u16 {
        u16::from_le_bytes([self.regs[4], self.regs[5]])
    }
}

impl BusDevice for AcpiPmDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| self.regs.get(o + i))
                .copied()
                .unwrap_or(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(base) = usize::try_from(offset) else { return };
        let mut touched_cnt = false;
        for (i, &v) in data.iter().enumerate() {
            match base + i {
                o @ 0..=1 => self.regs[o] &= !v, // PM1_STS: write 1 to clear
                o @ 2..=3 => self.regs[o] = v,   // PM1_EN
                o @ 4..=5 => {
                    self.regs[o] = v;
                    touched_cnt = true;
                }
                _ => {}
            }
        }
        if !touched_cnt {
            return;
        }
        let cnt = self.cnt() | PM1_CNT_SCI_EN;
        let slp_typ = (cnt >> PM1_CNT_SLP_TYP_SHIFT) & 0x7;
        let stored = cnt & !PM1_CNT_SLP_EN;
        self.regs[4..6].copy_from_slice(&stored.to_le_bytes());
        if cnt & PM1_CNT_SLP_EN != 0 {
            if slp_typ == u16::from(ACPI_S5_SLP_TYP) {
                (self.on_poweroff)();
            } else {
                tracing::warn!(slp_typ, "guest asked for an unsupported ACPI sleep state; ignored");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn dev() -> (AcpiPmDevice, Arc<AtomicU32>) {
        let n = Arc::new(AtomicU32::new(0));
        let n2 = n.clone();
        (
            AcpiPmDevice::new(Arc::new(move || {
                n2.fetch_add(1, Ordering::SeqCst);
            })),
            n,
        )
    }

    #[test]
    fn linux_s5_sequence_powers_off_once() {
        let (mut d, n) = dev();
        let mut w = [0u8; 2];
        d.read(4, &mut w);
        assert_eq!(u16::from_le_bytes(w) & PM1_CNT_SCI_EN, 1, "always in ACPI mode");
        // ACPICA: write SLP_TYP, then SLP_TYP | SLP_EN (16-bit writes).
        let typ = u16::from(ACPI_S5_SLP_TYP) << PM1_CNT_SLP_TYP_SHIFT | PM1_CNT_SCI_EN;
        d.write(4, &typ.to_le_bytes());
        assert_eq!(n.load(Ordering::SeqCst), 0);
        d.write(4, &(typ | PM1_CNT_SLP_EN).to_le_bytes());
        assert_eq!(n.load(Ordering::SeqCst), 1);
        d.read(4, &mut w);
        assert_eq!(u16::from_le_bytes(w) & PM1_CNT_SLP_EN, 0, "SLP_EN reads as 0");
    }

    #[test]
    fn other_sleep_states_and_registers() {
        let (mut d, n) = dev();
        d.write(4, &((3 << PM1_CNT_SLP_TYP_SHIFT) | PM1_CNT_SLP_EN).to_le_bytes());
        assert_eq!(n.load(Ordering::SeqCst), 0, "S3 is not poweroff");
        // Byte-wise write of the high byte alone also works (SLP_EN | SLP_TYP 5).
        d.write(5, &[((PM1_CNT_SLP_EN | (5 << PM1_CNT_SLP_TYP_SHIFT)) >> 8) as u8]);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        d.write(2, &[0x21, 0x01]);
        let mut en = [0u8; 2];
        d.read(2, &mut en);
        assert_eq!(en, [0x21, 0x01]);
        let mut sts = [0xffu8; 2];
        d.read(0, &mut sts);
        assert_eq!(sts, [0, 0]);
        let mut past = [0xffu8; 4];
        d.read(6, &mut past);
        assert_eq!(past, [0, 0, 0, 0]);
    }
}

//! Guest-physical layout of a Linux guest and its e820 map.
//!
//! ```text
//! 0x0000_0000  real-mode IVT + BIOS data area (left zero: "no EBDA, no BIOS")
//! 0x0000_0500  boot GDT (6 descriptors)          0x0000_0580  boot IDT (empty)
//! 0x0000_0600  boot TSS (104 bytes, zero)
//! 0x0000_7000  zero page (struct boot_params)     0x0000_8ff0  boot stack top
//! 0x0000_9000  PML4   0x0000_a000  PDPT   0x0000_b000..0x0000_f000  4 PDs (2 MiB pages, 4 GiB)
//! 0x0002_0000  kernel command line (up to 64 KiB)
//! 0x0009_fc00  "EBDA" (reserved in e820, nothing there)
//! 0x000a_0000  VGA/ROM hole (not RAM for the guest)
//! 0x000e_0000  ACPI tables: RSDP first (the kernel's 0xE0000..0xFFFFF scan), then the others
//! 0x0010_0000  kernel (bzImage protected-mode part at code32_start; ELF at its p_paddr)
//!   ...        initrd: top of low RAM, page aligned, below initrd_addr_max
//! 0xc000_0000  32-bit MMIO hole: PCI BARs (512 MiB)
//! 0xe000_0000  PCIe ECAM / MMCONFIG (1 MiB per bus, 256 MiB reserved)
//! 0xf000_0000  platform MMIO (free for the VMM)
//! 0xfec0_0000  IOAPIC   0xfed0_0000 HPET (not emulated)   0xfee0_0000 LAPIC
//! 0xfffb_c000  KVM's EPT identity page + real-mode TSS (KVM_SET_TSS_ADDR in vm.rs)
//! 0x1_0000_0000 RAM above 4 GiB (what does not fit below the hole)
//! ```

use crate::vstate::memory::{HIGH_RAM_START, MMIO_HOLE_START};
use linux_loader::loader::bootparam::boot_e820_entry;

/// Boot GDT.
pub const BOOT_GDT_ADDR: u64 = 0x500;
/// Boot IDT (zeroed; the kernel installs its own before enabling interrupts).
pub const BOOT_IDT_ADDR: u64 = 0x580;
/// Boot TSS (zeroed; only there so TR holds a valid busy-TSS descriptor).
pub const BOOT_TSS_ADDR: u64 = 0x600;
/// Size of the boot TSS (a 64-bit TSS is 104 bytes).
pub const BOOT_TSS_SIZE: u64 = 0x68;
/// The zero page (`struct boot_params`, 4 KiB); RSI at entry.
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial RSP/RBP (the kernel switches to its own stack at once).
pub const BOOT_STACK_TOP: u64 = 0x8ff0;
/// Page-map level 4 (CR3).
pub const PML4_ADDR: u64 = 0x9000;
/// Page-directory-pointer table.
pub const PDPT_ADDR: u64 = 0xa000;
/// First of [`IDENTITY_MAP_GIB`] page directories (one per GiB, 2 MiB pages).
pub const PD_ADDR: u64 = 0xb000;
/// GiB identity-mapped by the boot page tables (covers low RAM, the initrd
/// at the top of low RAM, ACPI tables and the MMIO hole).
pub const IDENTITY_MAP_GIB: u64 = 4;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Most bytes (with the NUL) the command line may take at [`CMDLINE_ADDR`].
pub const CMDLINE_MAX_SIZE: usize = 0x1_0000;
/// Start of the (empty) extended BIOS data area: RAM below it is usable.
pub const EBDA_START: u64 = 0x9_fc00;
/// End of conventional memory (start of the VGA hole).
pub const LOW_MEM_END: u64 = 0xa_0000;
/// BIOS area holding the ACPI tables; the kernel scans it for the RSDP.
pub const ACPI_AREA_START: u64 = 0xe_0000;
/// End of the BIOS area (exclusive).
pub const ACPI_AREA_END: u64 = 0x10_0000;
/// The RSDP (16-byte aligned, first thing in the BIOS area).
pub const RSDP_ADDR: u64 = ACPI_AREA_START;
/// 1 MiB: where "high memory" and the kernel start.
pub const HIMEM_START: u64 = 0x10_0000;
/// Where a bzImage's protected-mode code is loaded (its usual `code32_start`).
pub const KERNEL_LOAD_ADDR: u64 = HIMEM_START;
/// Offset of the 64-bit entry point (`startup_64`) in a loaded bzImage.
pub const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;

/// Start of the 32-bit MMIO hole (same as guest RAM's layout).
pub const MMIO32_START: u64 = MMIO_HOLE_START;
/// PCI 32-bit memory window for BARs.
pub const PCI_MMIO32_START: u64 = MMIO32_START;
/// Size of the PCI 32-bit memory window.
pub const PCI_MMIO32_SIZE: u64 = 0x2000_0000;
/// PCIe ECAM (MMCONFIG) base: bus `b` dev `d` fn `f` at `base + (b << 20 | d << 15 | f << 12)`.
pub const PCIE_ECAM_START: u64 = 0xe000_0000;
/// Size reserved for ECAM (256 buses); only the buses up to [`PCI_LAST_BUS`] are described.
pub const PCIE_ECAM_RESERVED: u64 = 0x1000_0000;
/// Last PCI bus number the host bridge decodes (k7d has no bridges: bus 0 only).
pub const PCI_LAST_BUS: u8 = 0;
/// ECAM bytes per bus.
pub const PCIE_ECAM_BUS_SIZE: u64 = 1 << 20;
/// Platform MMIO the VMM may hand out (virtio-mmio and the like).
pub const PLATFORM_MMIO_START: u64 = 0xf000_0000;
/// End (exclusive) of the platform MMIO area.
pub const PLATFORM_MMIO_END: u64 = IOAPIC_ADDR;
/// KVM's in-kernel IOAPIC.
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
/// Pins of KVM's IOAPIC (GSIs 0..24).
pub const IOAPIC_PINS: u32 = 24;
/// Where HPET would be (not emulated; no HPET table is given).
pub const HPET_ADDR: u64 = 0xfed0_0000;
/// Local APIC base (each vCPU's, KVM in-kernel).
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// First address above 4 GiB.
pub const MMIO32_END: u64 = HIGH_RAM_START;
/// PCI I/O port window for BARs (the x86 kernel allocates from 0x1000 up).
pub const PCI_IO_START: u16 = 0x1000;
/// Last port of the PCI I/O window.
pub const PCI_IO_END: u16 = 0xffff;

/// ACPI PM register block (port I/O): PM1a event (4 bytes) then PM1a control (2 bytes).
pub const ACPI_PM_BASE: u16 = 0x600;
/// PM1a event block (PM1_STS word + PM1_EN word).
pub const ACPI_PM1A_EVT_BLK: u16 = ACPI_PM_BASE;
/// PM1a event block length.
pub const ACPI_PM1_EVT_LEN: u8 = 4;
/// PM1a control block (SCI_EN, SLP_TYP, SLP_EN).
pub const ACPI_PM1A_CNT_BLK: u16 = ACPI_PM_BASE + 4;
/// PM1a control block length.
pub const ACPI_PM1_CNT_LEN: u8 = 2;
/// Ports the PM device occupies from [`ACPI_PM_BASE`].
pub const ACPI_PM_LEN: u16 = 8;
/// SCI interrupt (ISA IRQ 9, level, active high, as on PIIX4/QEMU).
pub const ACPI_SCI_IRQ: u8 = 9;
/// SLP_TYP value the DSDT's `\_S5_` announces; PM1a_CNT with it and SLP_EN = poweroff.
pub const ACPI_S5_SLP_TYP: u8 = 5;

/// COM1 (the console, ttyS0).
pub const COM1_PORT: u16 = 0x3f8;
/// COM1's ISA IRQ.
pub const COM1_IRQ: u8 = 4;
/// i8042 data port (the command/status port is +4).
pub const I8042_DATA_PORT: u16 = 0x60;
/// i8042 command port: `0xfe` written here resets the machine.
pub const I8042_CMD_PORT: u16 = 0x64;
/// The i8042 "pulse reset line" command.
pub const I8042_RESET_CMD: u8 = 0xfe;

/// First GSI of the PCI INTx lines (`_PRT`): slot `s` pin `p` (0 = INTA) uses
/// `PCI_INTX_GSI_BASE + (s + p) % PCI_INTX_GSIS`, level-triggered.
pub const PCI_INTX_GSI_BASE: u32 = 16;
/// Number of GSIs the INTx lines are spread over (16..=23).
pub const PCI_INTX_GSIS: u32 = 8;

/// e820 entry types.
pub const E820_RAM: u32 = 1;
/// Reserved (firmware, ECAM).
pub const E820_RESERVED: u32 = 2;

/// The GSI of PCI slot `slot`'s interrupt pin `pin` (0 = INTA .. 3 = INTD), as the DSDT's `_PRT` says.
pub fn pci_intx_gsi(slot: u8, pin: u8) -> u32 {
    PCI_INTX_GSI_BASE + (u32::from(slot) + u32::from(pin)) % PCI_INTX_GSIS
}

/// The ECAM range that is described (MCFG, e820, `_CRS`): buses 0..=[`PCI_LAST_BUS`].
pub fn ecam_described() -> (u64, u64) {
    (PCIE_ECAM_START, (u64::from(PCI_LAST_BUS) + 1) * PCIE_ECAM_BUS_SIZE)
}

/// The e820 map for guest RAM given as `(guest address, length)` regions (as
/// [`crate::vstate::memory::layout`] makes them), plus the reserved ranges.
///
/// RAM at 0 is split around the (empty) EBDA and the VGA/BIOS area: usable
/// `[0, EBDA_START)`, reserved `[EBDA_START, LOW_MEM_END)` and
/// `[ACPI_AREA_START, ACPI_AREA_END)` (ACPI tables), usable from 1 MiB. Other
/// regions are usable as they are. `ecam` (when PCIe ECAM is described) is
/// reserved, which the kernel requires before it trusts MCFG.
pub fn e820_map(regions: &[(u64, u64)], ecam: Option<(u64, u64)>) -> Vec<boot_e820_entry> {
    let entry = |addr: u64, size: u64, r#type: u32| boot_e820_entry { addr, size, r#type };
    let mut map = Vec::new();
    for &(start, len) in regions {
        let end = start + len;
        if start < HIMEM_START {
            // The low region; the caller guarantees it starts at 0 and reaches past 1 MiB.
            map.push(entry(start, EBDA_START - start, E820_RAM));
            map.push(entry(EBDA_START, LOW_MEM_END - EBDA_START, E820_RESERVED));
            map.push(entry(ACPI_AREA_START, ACPI_AREA_END - ACPI_AREA_START, E820_RESERVED));
            if end > HIMEM_START {
                map.push(entry(HIMEM_START, end - HIMEM_START, E820_RAM));
            }
        } else {
            map.push(entry(start, len, E820_RAM));
        }
    }
    if let Some((base, len)) = ecam {
        map.push(entry(base, len, E820_RESERVED));
    }
    map.sort_by_key(|e| e.addr);
    map
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::layout;

    fn regions(size: u64) -> Vec<(u64, u64)> {
        layout(size).into_iter().map(|(gpa, _, len)| (gpa, len)).collect()
    }

    fn ram(map: &[boot_e820_entry]) -> Vec<(u64, u64)> {
        map.iter()
            .filter(|e| e.r#type == E820_RAM)
            .map(|e| (e.addr, e.addr + e.size))
            .collect()
    }

    fn assert_no_overlap(map: &[boot_e820_entry]) {
        for w in map.windows(2) {
            let (a, b) = (w[0], w[1]);
            let (a_addr, a_size, b_addr) = (a.addr, a.size, b.addr);
            assert!(
                a_addr + a_size <= b_addr,
                "{a_addr:#x}+{a_size:#x} overlaps {b_addr:#x}"
            );
        }
    }

    #[test]
    fn e820_below_the_hole() {
        let size = 256 << 20;
        let map = e820_map(&regions(size), None);
        assert_no_overlap(&map);
        assert_eq!(ram(&map), vec![(0, EBDA_START), (HIMEM_START, size)]);
        // Everything usable is backed by RAM; the firmware areas are reserved.
        let reserved: Vec<_> = map
            .iter()
            .filter(|e| e.r#type == E820_RESERVED)
            .map(|e| (e.addr, e.size))
            .collect();
        assert_eq!(reserved, vec![(EBDA_START, 0x400), (ACPI_AREA_START, 0x2_0000)]);
        let usable: u64 = map.iter().filter(|e| e.r#type == E820_RAM).map(|e| e.size).sum();
        assert_eq!(usable, size - (HIMEM_START - EBDA_START));
    }

    #[test]
    fn e820_exactly_the_hole_and_above() {
        let size = MMIO_HOLE_START;
        assert_eq!(ram(&e820_map(&regions(size), None))[1], (HIMEM_START, MMIO_HOLE_START));

        let size = 6 << 30;
        let ecam = ecam_described();
        let map = e820_map(&regions(size), Some(ecam));
        assert_no_overlap(&map);
        assert_eq!(
            ram(&map),
            vec![
                (0, EBDA_START),
                (HIMEM_START, MMIO_HOLE_START),
                (HIGH_RAM_START, HIGH_RAM_START + size - MMIO_HOLE_START)
            ]
        );
        // Nothing usable inside the hole; ECAM reserved inside it.
        for e in map.iter().filter(|e| e.r#type == E820_RAM) {
            let (a, s) = (e.addr, e.size);
            assert!(a + s <= MMIO_HOLE_START || a >= HIGH_RAM_START);
        }
        assert!(
            map.iter()
                .any(|e| e.addr == PCIE_ECAM_START && e.size == ecam.1 && e.r#type == E820_RESERVED)
        );
    }

    #[test]
    fn hole_layout_is_consistent() {
        const { assert!(PCI_MMIO32_START + PCI_MMIO32_SIZE <= PCIE_ECAM_START) };
        const { assert!(PCIE_ECAM_START + PCIE_ECAM_RESERVED <= PLATFORM_MMIO_START) };
        const { assert!(PLATFORM_MMIO_END <= IOAPIC_ADDR && IOAPIC_ADDR < HPET_ADDR && HPET_ADDR < LAPIC_ADDR) };
        const { assert!(PD_ADDR + IDENTITY_MAP_GIB * 0x1000 <= CMDLINE_ADDR) };
        const { assert!(BOOT_TSS_ADDR + BOOT_TSS_SIZE <= 0x7000 && ZERO_PAGE_ADDR + 0x1000 <= BOOT_STACK_TOP) };
        const { assert!(RSDP_ADDR.is_multiple_of(16)) };
        assert_eq!(pci_intx_gsi(0, 0), 16);
        assert_eq!(pci_intx_gsi(7, 1), 16);
        assert_eq!(pci_intx_gsi(31, 3), 18);
    }
}

//! ACPI tables for Linux guests, written into the BIOS area at 0xE0000.
//!
//! | table | why |
//! |---|---|
//! | RSDP (v2) | at 0xE0000 so the kernel's scan of 0xE0000..0xFFFFF finds it (also passed in `boot_params.acpi_rsdp_addr`) |
//! | XSDT | lists FADT, MADT and (with ECAM) MCFG |
//! | FADT | full (not hardware-reduced) ACPI: SCI on IRQ 9, PM1a event/control blocks at port 0x600 for S5 poweroff, reset register = i8042 port 0x64 value 0xFE, boot flags: legacy devices, no 8042, no VGA, no CMOS RTC |
//! | FACS | required by full ACPI (global lock, waking vector) |
//! | DSDT | `\_S5_` (poweroff), `\_SB.PCI0` host bridge (PNP0A08/PNP0A03, `_CRS`, `_PRT`), COM1 (PNP0501), motherboard resources (PNP0C02: ECAM, PM ports), the VM Generation ID `\_SB.VGEN` and its Generic Event Device `\_SB.GED0` (`vmgenid.rs`) |
//! | MADT | one local APIC per vCPU (x2APIC entry above id 254), the IOAPIC (GSI base 0), interrupt source overrides, LINT1 = NMI: without it the stock kernel (no MP-table parser) sees 1 CPU |
//! | MCFG | PCIe ECAM for bus 0 when the VMM emulates ECAM |
//!
//! Tables are built with the `acpi_tables` crate: its typed builders where
//! they fit (RSDP, XSDT, FADT, FACS, MCFG, AML), its generic [`Sdt`] for the
//! MADT (the crate's MADT has no ISO/NMI/x2APIC structures or PCAT_COMPAT).

use acpi_tables::Aml;
use acpi_tables::aml::{self, AddressSpace, AddressSpaceCacheable};
use acpi_tables::facs::FACS;
use acpi_tables::fadt::{FADTBuilder, Flags, PmProfile};
use acpi_tables::gas::{AccessSize, AddressSpace as GasSpace, GAS};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use vm_memory::{Bytes, GuestAddress};

use super::layout::*;
use crate::vstate::memory::GuestMemoryMmap;

/// OEM id in every table.
pub const OEM_ID: [u8; 6] = *b"K7D   ";
/// OEM table id in every table.
pub const OEM_TABLE_ID: [u8; 8] = *b"K7DVMM  ";
/// OEM revision.
pub const OEM_REVISION: u32 = 1;

/// IAPC_BOOT_ARCH: user-visible ISA/LPC devices (COM1) exist.
pub const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
/// IAPC_BOOT_ARCH: an 8042 is present (deliberately NOT set, see module docs).
pub const IAPC_8042: u16 = 1 << 1;
/// IAPC_BOOT_ARCH: no VGA.
pub const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
/// IAPC_BOOT_ARCH: MSI not supported (NOT set: virtio-pci uses MSI-X).
pub const IAPC_MSI_NOT_SUPPORTED: u16 = 1 << 3;
/// IAPC_BOOT_ARCH: no CMOS RTC.
pub const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;
/// The boot flags k7d announces.
pub const IAPC_BOOT_ARCH: u16 = IAPC_LEGACY_DEVICES | IAPC_VGA_NOT_PRESENT | IAPC_CMOS_RTC_NOT_PRESENT;

/// MADT flags: PC-AT dual 8259s present (KVM's in-kernel PIC).
pub const MADT_PCAT_COMPAT: u32 = 1;
/// MADT structure: processor local APIC.
pub const MADT_LAPIC: u8 = 0;
/// MADT structure: I/O APIC.
pub const MADT_IOAPIC: u8 = 1;
/// MADT structure: interrupt source override.
pub const MADT_ISO: u8 = 2;
/// MADT structure: local APIC NMI.
pub const MADT_LAPIC_NMI: u8 = 4;
/// MADT structure: processor local x2APIC.
pub const MADT_X2APIC: u8 = 9;
/// MPS INTI flags: active high, level triggered.
pub const MPS_INTI_LEVEL_HIGH: u16 = 0b1101;

/// What the tables describe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiConfig {
    /// vCPUs (APIC ids 0..vcpus).
    pub vcpus: u32,
    /// The PCI host bridge, if the VMM has one.
    pub pci: Option<PciConfig>,
    /// Add the ISA IRQ0 → GSI 2 override. Only right if the VMM routes the
    /// PIT (GSI 0) to IOAPIC pin 2 with `KVM_SET_GSI_ROUTING` as QEMU does;
    /// with KVM's default routing (what k7d uses) GSI 0 is IOAPIC pin 0 and
    /// the identity mapping, i.e. no override, is correct.
    pub irq0_override: bool,
    /// Describe the VM Generation ID device and its Generic Event Device
    /// (`vmgenid.rs`).
    pub vmgenid: bool,
}

/// The PCI host bridge the DSDT describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciConfig {
    /// Describe PCIe ECAM (MCFG + reservation); the VMM must then emulate
    /// config space at [`PCIE_ECAM_START`] (MMIO) besides 0xCF8/0xCFC.
    pub ecam: bool,
    /// A 64-bit MMIO window `(start, length)` for BARs, above RAM and below
    /// the guest's physical-address width; `None` for none.
    pub mmio64: Option<(u64, u64)>,
}

/// Errors from building the tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// They do not fit in the BIOS area.
    #[error("the ACPI tables need {need:#x} bytes but the BIOS area holds {have:#x}")]
    TooLarge {
        /// Bytes needed from the RSDP on.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// Guest memory write.
    #[error("writing the ACPI tables into guest memory failed: {0}")]
    Memory(String),
}

/// The tables, each with its guest address, RSDP first.
#[derive(Debug, Clone)]
pub struct AcpiTables {
    /// `(guest address, bytes)`.
    pub tables: Vec<(u64, Vec<u8>)>,
}

fn bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

/// `IRQNoFlags() {n}`: a small IRQ descriptor (edge, active high, exclusive),
/// the form legacy ISA devices use in `_CRS` (the crate only has the extended one).
struct IrqNoFlags(u8);

impl Aml for IrqNoFlags {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.byte(0x22); // small item: IRQ, 2 bytes
        sink.word(1u16 << self.0);
    }
}

/// The DSDT's AML body (without the table header).
pub fn dsdt_aml(cfg: &AcpiConfig) -> Vec<u8> {
    let mut body = Vec::new();
    // \_S5_: SLP_TYPa, SLP_TYPb, reserved, reserved.
    let s5 = ACPI_S5_SLP_TYP;
    aml::Name::new("_S5_".into(), &aml::Package::new(vec![&s5, &s5, &0u8, &0u8])).to_aml_bytes(&mut body);

    let hid = |id: &str| aml::Name::new("_HID".into(), &aml::EISAName::new(id));
    let com1_hid = hid("PNP0501");
    let com1_uid = aml::Name::new("_UID".into(), &1u8);
    let com1_io = aml::IO::new(COM1_PORT, COM1_PORT, 0, 8);
    let com1_irq = IrqNoFlags(COM1_IRQ);
    let com1_crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(vec![&com1_io, &com1_irq]));
    let com1 = aml::Device::new("COM1".into(), vec![&com1_hid, &com1_uid, &com1_crs]);

    // Motherboard resources: ports (and ECAM) the OS must not hand to devices.
    let (ecam_base, ecam_len) = ecam_described();
    let mres_hid = hid("PNP0C02");
    let mres_uid = aml::Name::new("_UID".into(), &0u8);
    let pm_io = aml::IO::new(ACPI_PM_BASE, ACPI_PM_BASE, 1, ACPI_PM_LEN as u8);
    let ecam_mem = aml::Memory32Fixed::new(true, ecam_base as u32, ecam_len as u32);
    let with_ecam = cfg.pci.as_ref().is_some_and(|p| p.ecam);
    let mut mres_res: Vec<&dyn Aml> = vec![&pm_io];
    if with_ecam {
        mres_res.push(&ecam_mem);
    }
    let mres_crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(mres_res));
    let mres = aml::Device::new("MRES".into(), vec![&mres_hid, &mres_uid, &mres_crs]);

    let mut sb_children: Vec<&dyn Aml> = vec![&com1, &mres];

    // The PCI host bridge.
    let pci_hid = hid("PNP0A08");
    let pci_cid = aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03"));
    let pci_seg = aml::Name::new("_SEG".into(), &0u8);
    let pci_uid = aml::Name::new("_UID".into(), &0u8);
    let pci_bbn = aml::Name::new("_BBN".into(), &0u8);
    let bus = AddressSpace::<u16>::new_bus_number(0, u16::from(PCI_LAST_BUS));
    let cfg_io = aml::IO::new(0xcf8, 0xcf8, 1, 8);
    let io_lo = AddressSpace::<u16>::new_io(0, 0xcf7, None);
    let io_hi = AddressSpace::<u16>::new_io(0xd00, PCI_IO_END, None);
    let mmio32 = AddressSpace::<u32>::new_memory(
        AddressSpaceCacheable::NotCacheable,
        true,
        PCI_MMIO32_START as u32,
        (PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32,
        None,
    );
    let mmio64 = cfg.pci.as_ref().and_then(|p| p.mmio64).map(|(start, len)| {
        AddressSpace::<u64>::new_memory(AddressSpaceCacheable::NotCacheable, true, start, start + len - 1, None)
    });
    let mut crs: Vec<&dyn Aml> = vec![&bus, &cfg_io, &io_lo, &io_hi, &mmio32];
    if let Some(m) = &mmio64 {
        crs.push(m);
    }
    let pci_crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(crs));
    // _PRT: slot s pin p → GSI 16 + (s + p) % 8 (level, active low per the PCI convention).
    let mut prt = aml::PackageBuilder::new();
    for slot in 0u8..32 {
        for pin in 0u8..4 {
            let addr = (u32::from(slot) << 16) | 0xffff;
            let gsi = pci_intx_gsi(slot, pin);
            prt.add_element(&aml::Package::new(vec![&addr, &pin, &0u8, &gsi]));
        }
    }
    let pci_prt = aml::Name::new("_PRT".into(), &prt);
    let pci0 = aml::Device::new(
        "PCI0".into(),
        vec![&pci_hid, &pci_cid, &pci_seg, &pci_uid, &pci_bbn, &pci_crs, &pci_prt],
    );
    if cfg.pci.is_some() {
        sb_children.push(&pci0);
    }
    if cfg.vmgenid {
        sb_children.push(&super::vmgenid::VmGenIdAml);
    }
    aml::Scope::new("\\_SB_".into(), sb_children).to_aml_bytes(&mut body);
    body
}

/// The MADT bytes (checksummed).
pub fn madt(cfg: &AcpiConfig) -> Vec<u8> {
    let mut t = Sdt::new(*b"APIC", 44, 5, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    t.write_u32(36, LAPIC_ADDR as u32);
    t.write_u32(40, MADT_PCAT_COMPAT);
    for id in 0..cfg.vcpus {
        if id < 255 {
            // Processor local APIC: uid, APIC id, flags = enabled.
            let mut s = vec![MADT_LAPIC, 8, id as u8, id as u8];
            s.extend_from_slice(&1u32.to_le_bytes());
            t.append_slice(&s);
        } else {
            let mut s = vec![MADT_X2APIC, 16, 0, 0];
            s.extend_from_slice(&id.to_le_bytes());
            s.extend_from_slice(&1u32.to_le_bytes());
            s.extend_from_slice(&id.to_le_bytes());
            t.append_slice(&s);
        }
    }
    // The IOAPIC: id 0 (KVM's reset value), GSI base 0.
    let mut io = vec![MADT_IOAPIC, 12, 0, 0];
    io.extend_from_slice(&(IOAPIC_ADDR as u32).to_le_bytes());
    io.extend_from_slice(&0u32.to_le_bytes());
    t.append_slice(&io);
    let iso = |irq: u8, gsi: u32, flags: u16| {
        let mut s = vec![MADT_ISO, 10, 0 /* ISA */, irq];
        s.extend_from_slice(&gsi.to_le_bytes());
        s.extend_from_slice(&flags.to_le_bytes());
        s
    };
    if cfg.irq0_override {
        t.append_slice(&iso(0, 2, 0));
    }
    t.append_slice(&iso(ACPI_SCI_IRQ, u32::from(ACPI_SCI_IRQ), MPS_INTI_LEVEL_HIGH));
    // LINT1 of every processor (uid 0xff) is NMI, edge/high (flags 0 = bus default).
    t.append_slice(&[MADT_LAPIC_NMI, 6, 0xff, 0, 0, 1]);
    t.as_slice().to_vec()
}

fn align(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Builds every table with its address (RSDP at [`RSDP_ADDR`]).
pub fn build_tables(cfg: &AcpiConfig) -> Result<AcpiTables, AcpiError> {
    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&dsdt_aml(cfg));
    let dsdt = dsdt.as_slice().to_vec();
    let facs = bytes(&FACS::new());
    let madt = madt(cfg);
    let mcfg = cfg.pci.as_ref().filter(|p| p.ecam).map(|_| {
        let mut m = MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
        m.add_ecam(PCIE_ECAM_START, 0, 0, PCI_LAST_BUS);
        bytes(&m)
    });

    let mut next = align(RSDP_ADDR + Rsdp::len() as u64, 64);
    let mut place = |len: usize| {
        let at = next;
        next = align(at + len as u64, 64);
        at
    };
    let dsdt_at = place(dsdt.len());
    let facs_at = place(facs.len());
    let madt_at = place(madt.len());
    let mcfg_at = mcfg.as_ref().map(|m| place(m.len()));

    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_at)
        .firmware_ctrl_64(facs_at)
        .flag(Flags::Wbinvd)
        .flag(Flags::ProcC1)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .flag(Flags::ResetRegSup)
        .preferred_pm_profile(PmProfile::EnterpriseServer);
    fadt.sci_int = u16::from(ACPI_SCI_IRQ).into();
    fadt.pm1a_evt_blk = u32::from(ACPI_PM1A_EVT_BLK).into();
    fadt.pm1_evt_len = ACPI_PM1_EVT_LEN;
    fadt.pm1a_cnt_blk = u32::from(ACPI_PM1A_CNT_BLK).into();
    fadt.pm1_cnt_len = ACPI_PM1_CNT_LEN;
    fadt.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    fadt.reset_reg = GAS::new(
        GasSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(I8042_CMD_PORT),
    );
    fadt.reset_value = I8042_RESET_CMD;
    let fadt = bytes(&fadt.finalize());
    let fadt_at = place(fadt.len());

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_at);
    xsdt.add_entry(madt_at);
    if let Some(at) = mcfg_at {
        xsdt.add_entry(at);
    }
    let xsdt = bytes(&xsdt);
    let xsdt_at = place(xsdt.len());
    let rsdp = bytes(&Rsdp::new(OEM_ID, xsdt_at));

    // The VM Generation ID's page closes the area.
    let limit = super::vmgenid::VMGENID_ADDR;
    if next > limit {
        return Err(AcpiError::TooLarge {
            need: next - RSDP_ADDR,
            have: limit - RSDP_ADDR,
        });
    }
    let mut tables = vec![
        (RSDP_ADDR, rsdp),
        (xsdt_at, xsdt),
        (fadt_at, fadt),
        (facs_at, facs),
        (dsdt_at, dsdt),
        (madt_at, madt),
    ];
    if let (Some(at), Some(m)) = (mcfg_at, mcfg) {
        tables.push((at, m));
    }
    Ok(AcpiTables { tables })
}

/// Builds the tables and writes them into guest memory; returns the RSDP address.
pub fn create_acpi_tables(mem: &GuestMemoryMmap, cfg: &AcpiConfig) -> Result<u64, AcpiError> {
    let t = build_tables(cfg)?;
    for (at, b) in &t.tables {
        mem.write_slice(b, GuestAddress(*at))
            .map_err(|e| AcpiError::Memory(e.to_string()))?;
    }
    Ok(RSDP_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::GuestRam;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    fn read(mem: &GuestMemoryMmap, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        mem.read_slice(&mut v, GuestAddress(at)).unwrap();
        v
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    /// Reads a whole table (header length) at `at`.
    fn table(mem: &GuestMemoryMmap, at: u64) -> Vec<u8> {
        let hdr = read(mem, at, 8);
        read(mem, at, u32_at(&hdr, 4) as usize)
    }

    /// What the kernel does: scan the BIOS area on 16-byte boundaries.
    fn scan_rsdp(mem: &GuestMemoryMmap) -> Option<u64> {
        (ACPI_AREA_START..ACPI_AREA_END).step_by(16).find(|&a| {
            let b = read(mem, a, 36);
            &b[..8] == b"RSD PTR " && sum(&b[..20]) == 0 && sum(&b) == 0
        })
    }

    fn cfg(vcpus: u32, ecam: bool) -> AcpiConfig {
        AcpiConfig {
            vcpus,
            pci: Some(PciConfig {
                ecam,
                mmio64: Some((0x100_0000_0000, 0x10_0000_0000)),
            }),
            irq0_override: false,
            vmgenid: true,
        }
    }

    /// Parses the MADT's structures into `(type, bytes)`.
    fn madt_structs(m: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut v = Vec::new();
        let mut off = 44;
        while off < m.len() {
            let len = m[off + 1] as usize;
            v.push((m[off], m[off..off + len].to_vec()));
            off += len;
        }
        assert_eq!(off, m.len(), "structures fill the table exactly");
        v
    }

    #[test]
    fn tables_are_found_checksummed_and_linked() {
        for (vcpus, ecam) in [(1, false), (2, true), (254, true)] {
            let ram = GuestRam::new("arch-acpi", 32 << 20).unwrap();
            let mem = ram.memory();
            assert_eq!(create_acpi_tables(mem, &cfg(vcpus, ecam)).unwrap(), RSDP_ADDR);
            let rsdp_at = scan_rsdp(mem).expect("RSDP found by the scan");
            assert_eq!(rsdp_at, RSDP_ADDR);
            let rsdp = read(mem, rsdp_at, 36);
            assert_eq!(rsdp[15], 2, "ACPI 2.0+ RSDP");
            assert_eq!(u32_at(&rsdp, 20), 36);
            let xsdt = table(mem, u64_at(&rsdp, 24));
            assert_eq!(&xsdt[..4], b"XSDT");
            assert_eq!(sum(&xsdt), 0);
            let entries: Vec<u64> = (36..xsdt.len()).step_by(8).map(|o| u64_at(&xsdt, o)).collect();
            let mut sigs: Vec<[u8; 4]> = Vec::new();
            for &at in &entries {
                let t = table(mem, at);
                assert_eq!(sum(&t), 0, "checksum of {:?}", String::from_utf8_lossy(&t[..4]));
                assert!((ACPI_AREA_START..ACPI_AREA_END).contains(&at));
                sigs.push(t[..4].try_into().unwrap());
            }
            let mut want: Vec<[u8; 4]> = vec![*b"FACP", *b"APIC"];
            if ecam {
                want.push(*b"MCFG");
            }
            assert_eq!(sigs, want, "XSDT lists every table");

            // FADT → DSDT and FACS.
            let fadt = table(mem, entries[0]);
            assert_eq!(fadt.len(), 276);
            let dsdt = table(mem, u64_at(&fadt, 140));
            assert_eq!(&dsdt[..4], b"DSDT");
            assert_eq!(sum(&dsdt), 0);
            let facs_at = u64_at(&fadt, 132);
            assert_eq!(facs_at % 64, 0, "FACS 64-byte aligned");
            assert_eq!(&read(mem, facs_at, 4), b"FACS");
            // Full (not hardware-reduced) ACPI with the PM blocks and SCI.
            assert_eq!(u32_at(&fadt, 112) & (1 << 20), 0, "not HW_REDUCED");
            assert_ne!(u32_at(&fadt, 112) & (1 << 10), 0, "reset register supported");
            assert_eq!(u16::from_le_bytes([fadt[46], fadt[47]]), 9, "SCI");
            assert_eq!(u32_at(&fadt, 56), u32::from(ACPI_PM1A_EVT_BLK));
            assert_eq!(u32_at(&fadt, 64), u32::from(ACPI_PM1A_CNT_BLK));
            assert_eq!((fadt[88], fadt[89]), (4, 2));
            let boot_arch = u16::from_le_bytes([fadt[109], fadt[110]]);
            assert_eq!(boot_arch & IAPC_8042, 0);
            assert_eq!(boot_arch & IAPC_MSI_NOT_SUPPORTED, 0);
            // Reset register: system I/O port 0x64, value 0xfe.
            assert_eq!((fadt[116], u64_at(&fadt, 120), fadt[128]), (1, 0x64, 0xfe));

            // MADT: N enabled processors with APIC ids 0..N, one IOAPIC at GSI 0.
            let madt = table(mem, entries[1]);
            assert_eq!(u32_at(&madt, 36), LAPIC_ADDR as u32);
            assert_eq!(u32_at(&madt, 40) & MADT_PCAT_COMPAT, 1);
            let s = madt_structs(&madt);
            let ids: Vec<u32> = s
                .iter()
                .filter_map(|(t, b)| match *t {
                    MADT_LAPIC if b[4] & 1 == 1 => Some(u32::from(b[3])),
                    MADT_X2APIC if b[8] & 1 == 1 => Some(u32_at(b, 4)),
                    _ => None,
                })
                .collect();
            assert_eq!(ids, (0..vcpus).collect::<Vec<_>>());
            let ioapics: Vec<_> = s.iter().filter(|(t, _)| *t == MADT_IOAPIC).collect();
            assert_eq!(ioapics.len(), 1);
            assert_eq!(u32_at(&ioapics[0].1, 4), IOAPIC_ADDR as u32);
            assert_eq!(u32_at(&ioapics[0].1, 8), 0);
            let isos: Vec<(u8, u32)> = s
                .iter()
                .filter(|(t, _)| *t == MADT_ISO)
                .map(|(_, b)| (b[3], u32_at(b, 4)))
                .collect();
            assert_eq!(isos, vec![(9, 9)], "SCI level override only (identity IRQ0)");
            assert!(s.iter().any(|(t, b)| *t == MADT_LAPIC_NMI && b[5] == 1));

            if ecam {
                let mcfg = table(mem, entries[2]);
                assert_eq!(u64_at(&mcfg, 44), PCIE_ECAM_START);
                assert_eq!((mcfg[54], mcfg[55]), (0, PCI_LAST_BUS));
            }
        }
    }

    #[test]
    fn irq0_override_when_asked() {
        let mut c = cfg(2, false);
        c.irq0_override = true;
        let m = madt(&c);
        let isos: Vec<_> = madt_structs(&m)
            .into_iter()
            .filter(|(t, _)| *t == MADT_ISO)
            .map(|(_, b)| (b[3], u32_at(&b, 4)))
            .collect();
        assert_eq!(isos, vec![(0, 2), (9, 9)]);
    }

    #[test]
    fn x2apic_entries_above_254() {
        let c = AcpiConfig {
            vcpus: 300,
            pci: None,
            irq0_override: false,
            vmgenid: false,
        };
        let s = madt_structs(&madt(&c));
        assert_eq!(s.iter().filter(|(t, _)| *t == MADT_LAPIC).count(), 255);
        assert_eq!(s.iter().filter(|(t, _)| *t == MADT_X2APIC).count(), 45);
    }

    fn contains(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn dsdt_describes_s5_com1_and_the_host_bridge() {
        let with = dsdt_aml(&cfg(2, true));
        // Name(_S5_, Package(4) {5, 5, 0, 0})
        assert!(contains(
            &with,
            &[0x08, b'_', b'S', b'5', b'_', 0x12, 0x08, 0x04, 0x0a, 5, 0x0a, 5, 0, 0]
        ));
        for name in [b"PCI0", b"COM1", b"MRES", b"_PRT", b"_CRS", b"_BBN"] {
            assert!(contains(&with, name), "{}", String::from_utf8_lossy(name));
        }
        // EISAID("PNP0A08") = 0x080ad041, little endian after the DWORD prefix.
        assert!(contains(&with, &[0x0c, 0x41, 0xd0, 0x0a, 0x08]));
        // EISAID("PNP0A03") and ("PNP0501").
        assert!(contains(&with, &[0x0c, 0x41, 0xd0, 0x0a, 0x03]));
        assert!(contains(&with, &[0x0c, 0x41, 0xd0, 0x05, 0x01]));
        // COM1's IRQNoFlags {4} and IO(0x3f8).
        assert!(contains(&with, &[0x22, 0x10, 0x00]));
        assert!(contains(&with, &[0x47, 0x01, 0xf8, 0x03, 0xf8, 0x03]));
        // The config ports IO(0xcf8, 0xcf8, 1, 8).
        assert!(contains(&with, &[0x47, 0x01, 0xf8, 0x0c, 0xf8, 0x0c, 0x01, 0x08]));
        // The 32-bit MMIO window min/max.
        let mut w = (PCI_MMIO32_START as u32).to_le_bytes().to_vec();
        w.extend_from_slice(&((PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32).to_le_bytes());
        assert!(contains(&with, &w));
        let without = dsdt_aml(&AcpiConfig {
            vcpus: 1,
            pci: None,
            irq0_override: false,
            vmgenid: false,
        });
        assert!(!contains(&without, b"PCI0"));
        assert!(contains(&without, b"COM1"));
        assert!(!contains(&without, b"VGEN") && !contains(&without, b"ACPI0013"));
    }

    #[test]
    fn dsdt_describes_the_vm_generation_id_and_its_event_device() {
        use super::super::vmgenid::{VMGENID_ADDR, VMGENID_BOUND_ADDR, VMGENID_GSI};
        let d = dsdt_aml(&cfg(1, true));
        for name in [
            &b"VGEN"[..],
            b"VMGENCTR\0",
            b"VM_Gen_Counter\0",
            b"ADDR",
            b"VGBD",
            b"GED0",
            b"ACPI0013\0",
            b"_EVT",
        ] {
            assert!(contains(&d, name), "{}", String::from_utf8_lossy(name));
        }
        // OperationRegion(VGBR, SystemMemory, DWord(bound byte), ...).
        let mut region = vec![0x5b, 0x80, b'V', b'G', b'B', b'R', 0x00, 0x0c];
        region.extend_from_slice(&(VMGENID_BOUND_ADDR as u32).to_le_bytes());
        assert!(contains(&d, &region), "the bound byte's region");
        // ADDR returns Package(2) {DWord(low), Zero (high)}.
        let mut pkg = vec![0x02, 0x0c];
        pkg.extend_from_slice(&(VMGENID_ADDR as u32).to_le_bytes());
        pkg.push(0x00);
        assert!(contains(&d, &pkg), "ADDR's package");
        // The GED's Interrupt(ResourceConsumer, Edge, ActiveHigh, Exclusive) {GSI}.
        let mut irq = vec![0x89, 0x06, 0x00, 0x03, 0x01];
        irq.extend_from_slice(&VMGENID_GSI.to_le_bytes());
        assert!(contains(&d, &irq), "the GED's interrupt");
    }

    /// Every table written to a file (`$K7D_ACPI_DUMP`, else a temporary
    /// folder) reads back with its signature, its length field equal to the
    /// file's size and a zero checksum, and ACPICA's own disassembler
    /// (`iasl -d`, Debian's acpica-tools, which CI installs) accepts it.
    #[test]
    fn dumped_tables_pass_acpicas_disassembler() {
        let keep = std::env::var_os("K7D_ACPI_DUMP").map(std::path::PathBuf::from);
        let dir = keep
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join(format!("k7d-acpi-{}", std::process::id())));
        std::fs::create_dir_all(&dir).unwrap();
        let mut files = Vec::new();
        for (_, t) in build_tables(&cfg(2, true)).unwrap().tables {
            let sig = if t.starts_with(b"RSD PTR ") {
                "RSDP".to_string()
            } else {
                String::from_utf8_lossy(&t[..4]).into_owned()
            };
            let path = dir.join(format!("{sig}.dat"));
            std::fs::write(&path, &t).unwrap();
            files.push((sig, path));
        }
        assert!(files.len() >= 5, "RSDP, XSDT, FADT, MADT, DSDT at least: {files:?}");
        let mut checked = 0;
        for (sig, path) in &files {
            let b = std::fs::read(path).unwrap();
            if sig == "RSDP" {
                assert_eq!(sum(&b[..20]), 0, "RSDP checksum");
                assert_eq!(sum(&b), 0, "RSDP extended checksum");
                continue;
            }
            assert_eq!(u32_at(&b, 4) as usize, b.len(), "{sig}: length field");
            // The FACS is the one table without a checksum (ACPI 6.5, 5.2.10).
            assert!(sig == "FACS" || sum(&b) == 0, "{sig}: checksum");
            let Ok(out) = std::process::Command::new("iasl").arg("-d").arg(path).output() else {
                k7d_test_skip::skip(
                    "dumped_tables_pass_acpicas_disassembler",
                    "iasl not found (apt-get install acpica-tools): tables checked without ACPICA",
                );
                break;
            };
            assert!(
                out.status.success(),
                "iasl -d {sig}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
        // What the guest's ACPICA will see of the VM Generation ID.
        if checked > 0 {
            let dsl = std::fs::read_to_string(dir.join("DSDT.dsl")).unwrap();
            for want in [
                "Device (VGEN)",
                "Name (_HID, \"VMGENCTR\")",
                "Name (_CID, \"VM_Gen_Counter\")",
                "Method (ADDR, 0, NotSerialized)",
                "VGBD = One",
                "Device (GED0)",
                "Name (_HID, \"ACPI0013\"",
                "Method (_EVT, 1, NotSerialized)",
                "Notify (\\_SB.VGEN, 0x80)",
            ] {
                assert!(dsl.contains(want), "iasl's DSDT lacks `{want}`:\n{dsl}");
            }
        }
        if keep.is_none() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
        eprintln!("{checked} tables disassembled by iasl");
    }
}

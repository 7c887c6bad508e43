//! The VM Generation ID (Microsoft's "Virtual Machine Generation ID"
//! specification; Linux's `drivers/virt/vmgenid.c`, `CONFIG_VMGENID`): 16
//! bytes of guest RAM that k7d changes in every fork child and every
//! restored VM before its vCPUs run, followed by an ACPI notification. A
//! guest with the driver mixes the new ID into its RNG and reseeds it at
//! once (Linux 5.18 and later: `add_vmfork_randomness`), so fork siblings,
//! and two restores of one snapshot, never go on drawing the same numbers.
//!
//! - The ID: [`VMGENID_ADDR`], 16 bytes in the ACPI area (reserved in the
//!   e820 map, below the tables' limit).
//! - The DSDT (`VmGenIdAml`): `\_SB.VGEN` (`_HID "VMGENCTR"`, `_CID
//!   "VM_Gen_Counter"`) whose `ADDR` method returns the ID's address as a
//!   package of two 32-bit halves, and first sets the byte at
//!   [`VMGENID_BOUND_ADDR`]: only the guest's driver evaluates `ADDR` (when
//!   it binds), so that byte tells k7d the guest has one ([`driver_bound`]).
//!   A guest can set it without a driver; it only misleads `k7d info` about
//!   itself.
//! - The notification: a Generic Event Device `\_SB.GED0` (`ACPI0013`,
//!   Linux's `evged`) with one edge-triggered interrupt on GSI
//!   [`VMGENID_GSI`], whose `_EVT` does `Notify(\_SB.VGEN, 0x80)`; k7d
//!   pulses that GSI ([`notify`]) after the restored irqchip and LAPICs are
//!   in place, so the interrupt is pending when the first vCPU runs.

use std::io;

use acpi_tables::Aml;
use acpi_tables::aml::{self, FieldAccessType, FieldEntry, FieldLockRule, FieldUpdateRule, OpRegionSpace};
use kvm_ioctls::VmFd;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{ACPI_AREA_END, ACPI_AREA_START};
use crate::vstate::memory::GuestMemoryMmap;

/// The generation ID's bytes (a 128-bit value; the spec's GUID).
pub type GenerationId = [u8; 16];

/// Where the ID lies: the last page of the ACPI area (the tables stay
/// below it, `acpi::build_tables`).
pub const VMGENID_ADDR: u64 = ACPI_AREA_END - 0x1000;
/// The byte `ADDR` sets when the guest's driver evaluates it.
pub const VMGENID_BOUND_ADDR: u64 = VMGENID_ADDR + 16;
/// The GSI the Generic Event Device's interrupt uses: an ISA line nothing
/// else in k7d uses (PIT 0, COM1 4, SCI 9, PCI INTx 16 to 23).
pub const VMGENID_GSI: u32 = 5;

const _: () = assert!(VMGENID_ADDR >= ACPI_AREA_START && VMGENID_BOUND_ADDR < ACPI_AREA_END);

/// A new ID from the host's CSPRNG.
pub fn fresh_id() -> io::Result<GenerationId> {
    let mut id = [0u8; 16];
    k7d_sys::random::fill(&mut id)?;
    Ok(id)
}

/// Writes `id` where the guest's driver reads it (the bound byte after it
/// is left alone).
pub fn write_id(mem: &GuestMemoryMmap, id: &GenerationId) -> Result<(), vm_memory::GuestMemoryError> {
    mem.write_slice(id, GuestAddress(VMGENID_ADDR))
}

/// The ID as guest RAM holds it now.
pub fn read_id(mem: &GuestMemoryMmap) -> Result<GenerationId, vm_memory::GuestMemoryError> {
    let mut id = [0u8; 16];
    mem.read_slice(&mut id, GuestAddress(VMGENID_ADDR))?;
    Ok(id)
}

/// Whether the guest's vmgenid driver has asked for the ID's address
/// (`ADDR` set the bound byte): its kernel reseeds when the ID changes.
pub fn driver_bound(mem: &GuestMemoryMmap) -> bool {
    mem.read_obj::<u8>(GuestAddress(VMGENID_BOUND_ADDR))
        .is_ok_and(|b| b != 0)
}

/// Raises and lowers the Generic Event Device's GSI: an edge the guest's
/// `evged` turns into `_EVT`, and so into `Notify(\_SB.VGEN, 0x80)`. A
/// guest that has not bound the device keeps the pin masked and sees
/// nothing; lowering the line leaves no latched edge behind.
pub fn notify(vm: &VmFd) -> Result<(), kvm_ioctls::Error> {
    vm.set_irq_line(VMGENID_GSI, true)?;
    vm.set_irq_line(VMGENID_GSI, false)
}

/// `id` in lowercase hex, as `k7d info` shows it.
pub fn hex(id: &GenerationId) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The DSDT's part: `\_SB.VGEN` and `\_SB.GED0` (module docs), placed in
/// the `\_SB_` scope by `acpi::dsdt_aml`.
pub struct VmGenIdAml;

impl Aml for VmGenIdAml {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        let hid: &'static str = "VMGENCTR";
        let cid: &'static str = "VM_Gen_Counter";
        let vgen_hid = aml::Name::new("_HID".into(), &hid);
        let vgen_cid = aml::Name::new("_CID".into(), &cid);
        let vgen_ddn = aml::Name::new("_DDN".into(), &cid);
        let bound_at = VMGENID_BOUND_ADDR;
        let region = aml::OpRegion::new("VGBR".into(), OpRegionSpace::SystemMemory, &bound_at, &1u8);
        let field = aml::Field::new(
            "VGBR".into(),
            FieldAccessType::Byte,
            FieldLockRule::NoLock,
            FieldUpdateRule::Preserve,
            vec![FieldEntry::Named(*b"VGBD", 8)],
        );
        let bound = aml::Path::new("VGBD");
        let set_bound = aml::Store::new(&bound, &aml::ONE);
        let (lo, hi) = ((VMGENID_ADDR & 0xffff_ffff) as u32, (VMGENID_ADDR >> 32) as u32);
        let addr_pkg = aml::Package::new(vec![&lo, &hi]);
        let ret = aml::Return::new(&addr_pkg);
        let addr = aml::Method::new("ADDR".into(), 0, false, vec![&set_bound, &ret]);
        aml::Device::new(
            "VGEN".into(),
            vec![&vgen_hid, &vgen_cid, &vgen_ddn, &region, &field, &addr],
        )
        .to_aml_bytes(sink);

        let ged_id: &'static str = "ACPI0013";
        let ged_hid = aml::Name::new("_HID".into(), &ged_id);
        let ged_uid = aml::Name::new("_UID".into(), &0u8);
        // Consumer, edge-triggered, active high, exclusive.
        let irq = aml::Interrupt::new(true, true, false, false, VMGENID_GSI);
        let ged_crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(vec![&irq]));
        let vgen = aml::Path::new("\\_SB_.VGEN");
        let notify = aml::Notify::new(&vgen, &0x80u8);
        let gsi = VMGENID_GSI;
        let ours = aml::Equal::new(&aml::Arg(0), &gsi);
        let when = aml::If::new(&ours, vec![&notify]);
        let evt = aml::Method::new("_EVT".into(), 1, false, vec![&when]);
        aml::Device::new("GED0".into(), vec![&ged_hid, &ged_uid, &ged_crs, &evt]).to_aml_bytes(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_ids_differ_and_are_written_before_the_bound_byte() {
        let a = fresh_id().unwrap();
        let b = fresh_id().unwrap();
        assert_ne!(a, b);
        assert_eq!(hex(&[0xab; 16]).len(), 32);
        let mem = crate::vstate::memory::GuestRam::new("vmgenid-unit", 2 << 20).unwrap();
        assert!(!driver_bound(mem.memory()));
        write_id(mem.memory(), &a).unwrap();
        assert_eq!(read_id(mem.memory()).unwrap(), a);
        // The ID leaves the bound byte alone, and the byte is what the
        // guest's `ADDR` stores.
        assert!(!driver_bound(mem.memory()));
        mem.memory().write_obj(1u8, GuestAddress(VMGENID_BOUND_ADDR)).unwrap();
        assert!(driver_bound(mem.memory()));
        write_id(mem.memory(), &b).unwrap();
        assert!(driver_bound(mem.memory()));
    }
}

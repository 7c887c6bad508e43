//! The boot GDT: the descriptors the 64-bit boot protocol asks for
//! (`__BOOT_CS` = 0x10 flat 64-bit code, `__BOOT_DS` = 0x18 flat data) plus a
//! TSS so TR is valid, and their `kvm_segment` form for `KVM_SET_SREGS`.

use kvm_bindings::kvm_segment;

use super::layout::{BOOT_TSS_ADDR, BOOT_TSS_SIZE};

/// Selector of the 64-bit code segment (`__BOOT_CS`).
pub const BOOT_CS: u16 = 0x10;
/// Selector of the data segment (`__BOOT_DS`).
pub const BOOT_DS: u16 = 0x18;
/// Selector of the TSS (a 16-byte system descriptor: entries 4 and 5).
pub const BOOT_TSS: u16 = 0x20;

// Access byte bits.
const PRESENT: u64 = 1 << 7;
const S_CODE_DATA: u64 = 1 << 4;
const TYPE_CODE_EXEC_READ_ACCESSED: u64 = 0xb;
const TYPE_DATA_RW_ACCESSED: u64 = 0x3;
const TYPE_TSS64_BUSY: u64 = 0xb;
// Flag nibble bits (descriptor bits 52..55).
const FLAG_L: u64 = 1 << 1;
const FLAG_DB: u64 = 1 << 2;
const FLAG_G: u64 = 1 << 3;

/// Encodes a segment descriptor from its base, 20-bit limit, access byte and flag nibble.
pub const fn descriptor(base: u32, limit: u32, access: u8, flags: u8) -> u64 {
    let (base, limit, access, flags) = (base as u64, limit as u64, access as u64, flags as u64);
    (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | (access << 40)
        | (((limit >> 16) & 0xf) << 48)
        | ((flags & 0xf) << 52)
        | (((base >> 24) & 0xff) << 56)
}

/// The boot GDT, entry by entry (the TSS takes two entries: its high half holds base bits 32..63).
pub fn boot_gdt() -> [u64; 6] {
    let code = descriptor(
        0,
        0xfffff,
        (PRESENT | S_CODE_DATA | TYPE_CODE_EXEC_READ_ACCESSED) as u8,
        (FLAG_G | FLAG_L) as u8,
    );
    let data = descriptor(
        0,
        0xfffff,
        (PRESENT | S_CODE_DATA | TYPE_DATA_RW_ACCESSED) as u8,
        (FLAG_G | FLAG_DB) as u8,
    );
    let tss = descriptor(
        BOOT_TSS_ADDR as u32,
        (BOOT_TSS_SIZE - 1) as u32,
        (PRESENT | TYPE_TSS64_BUSY) as u8,
        0,
    );
    [0, 0, code, data, tss, BOOT_TSS_ADDR >> 32]
}

/// Decodes GDT entry `selector >> 3` into the segment-register cache KVM wants.
/// System descriptors (S = 0) take their base bits 32..63 from the next entry.
pub fn segment(gdt: &[u64], selector: u16) -> kvm_segment {
    let index = usize::from(selector >> 3);
    let d = gdt[index];
    let mut base = ((d >> 16) & 0xff_ffff) | (((d >> 56) & 0xff) << 24);
    let s = ((d >> 44) & 1) as u8;
    if s == 0 && index + 1 < gdt.len() {
        base |= (gdt[index + 1] & 0xffff_ffff) << 32;
    }
    let raw_limit = ((d & 0xffff) | (((d >> 48) & 0xf) << 16)) as u32;
    let g = ((d >> 55) & 1) as u8;
    let present = ((d >> 47) & 1) as u8;
    kvm_segment {
        base,
        // With G set the limit counts 4 KiB pages: the cached limit is in bytes.
        limit: if g == 1 { (raw_limit << 12) | 0xfff } else { raw_limit },
        selector,
        type_: ((d >> 40) & 0xf) as u8,
        present,
        dpl: ((d >> 45) & 3) as u8,
        db: ((d >> 54) & 1) as u8,
        s,
        l: ((d >> 53) & 1) as u8,
        g,
        avl: ((d >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_encodings() {
        let gdt = boot_gdt();
        assert_eq!(gdt[0], 0);
        // The classic flat 64-bit code and flat data descriptors.
        assert_eq!(gdt[2], 0x00af_9b00_0000_ffff);
        assert_eq!(gdt[3], 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn code_segment_is_flat_64_bit_ring0() {
        let cs = segment(&boot_gdt(), BOOT_CS);
        assert_eq!((cs.base, cs.limit, cs.selector), (0, 0xffff_ffff, 0x10));
        assert_eq!((cs.type_, cs.s, cs.present, cs.dpl), (0xb, 1, 1, 0));
        // Long mode: L = 1 requires D/B = 0.
        assert_eq!((cs.l, cs.db, cs.g, cs.unusable), (1, 0, 1, 0));
    }

    #[test]
    fn data_segment_is_flat_rw() {
        let ds = segment(&boot_gdt(), BOOT_DS);
        assert_eq!((ds.base, ds.limit, ds.selector), (0, 0xffff_ffff, 0x18));
        assert_eq!((ds.type_, ds.s, ds.present, ds.dpl), (0x3, 1, 1, 0));
        assert_eq!((ds.l, ds.db, ds.g, ds.unusable), (0, 1, 1, 0));
    }

    #[test]
    fn tss_is_a_busy_64_bit_tss() {
        let tr = segment(&boot_gdt(), BOOT_TSS);
        assert_eq!((tr.base, tr.limit, tr.selector), (BOOT_TSS_ADDR, 0x67, 0x20));
        // VMX requires TR to be a present busy TSS (type 11) with S = 0 in long mode.
        assert_eq!((tr.type_, tr.s, tr.present, tr.g, tr.unusable), (0xb, 0, 1, 0, 0));
    }

    #[test]
    fn high_base_bits_of_system_descriptors() {
        let gdt = [0, descriptor(0x1234_5678, 0x67, 0x8b, 0), 0xffff_ffff];
        assert_eq!(segment(&gdt, 0x8).base, 0xffff_ffff_1234_5678);
    }
}

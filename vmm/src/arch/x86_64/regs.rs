//! The 64-bit entry state: boot GDT/IDT/TSS and identity page tables in guest
//! memory, and the vCPU registers (sregs, regs, FPU), MSRs, CPUID and LAPIC
//! LINT pins for the boot vCPU and the APs.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES, kvm_fpu, kvm_regs, kvm_sregs};
use kvm_ioctls::{Kvm, VcpuFd};
use vm_memory::{Bytes, GuestAddress};

use super::BootEntry;
use super::cpuid::{has_mtrr, linux_cpuid};
use super::gdt::{BOOT_CS, BOOT_DS, BOOT_TSS, boot_gdt, segment};
use super::layout::*;
use super::msr::setup_msrs;
use crate::vstate::memory::GuestMemoryMmap;
use crate::vstate::vcpu::{VcpuSetupError, setup_lint};

/// CR0: protected mode.
pub const CR0_PE: u64 = 1;
/// CR0: extension type (hard-wired 1 on every x86-64 CPU).
pub const CR0_ET: u64 = 1 << 4;
/// CR0: paging.
pub const CR0_PG: u64 = 1 << 31;
/// CR4: physical address extension (required for long mode).
pub const CR4_PAE: u64 = 1 << 5;
/// EFER: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER: long mode active.
pub const EFER_LMA: u64 = 1 << 10;

/// Page-table entry: present.
pub const PTE_PRESENT: u64 = 1;
/// Page-table entry: writable.
pub const PTE_RW: u64 = 1 << 1;
/// Page-directory entry: 2 MiB page.
pub const PTE_PS: u64 = 1 << 7;

/// Writes the boot GDT, a zeroed IDT and TSS, and the identity page tables.
pub fn write_entry_structures(mem: &GuestMemoryMmap) -> Result<(), vm_memory::GuestMemoryError> {
    for (i, d) in boot_gdt().iter().enumerate() {
        mem.write_obj(*d, GuestAddress(BOOT_GDT_ADDR + 8 * i as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_ADDR))?;
    mem.write_slice(&[0u8; BOOT_TSS_SIZE as usize], GuestAddress(BOOT_TSS_ADDR))?;
    write_page_tables(mem)
}

/// Identity-maps the first [`IDENTITY_MAP_GIB`] GiB with 2 MiB pages:
/// PML4[0] → PDPT; PDPT[g] → PD g; PD g[i] → (g GiB + i × 2 MiB).
pub fn write_page_tables(mem: &GuestMemoryMmap) -> Result<(), vm_memory::GuestMemoryError> {
    let mut pml4 = [0u64; 512];
    pml4[0] = PDPT_ADDR | PTE_PRESENT | PTE_RW;
    let mut pdpt = [0u64; 512];
    for g in 0..IDENTITY_MAP_GIB {
        let pd_addr = PD_ADDR + g * 0x1000;
        pdpt[g as usize] = pd_addr | PTE_PRESENT | PTE_RW;
        let mut pd = [0u64; 512];
        for (i, e) in pd.iter_mut().enumerate() {
            *e = ((g << 30) + ((i as u64) << 21)) | PTE_PRESENT | PTE_RW | PTE_PS;
        }
        mem.write_slice(&table_bytes(&pd), GuestAddress(pd_addr))?;
    }
    mem.write_slice(&table_bytes(&pdpt), GuestAddress(PDPT_ADDR))?;
    mem.write_slice(&table_bytes(&pml4), GuestAddress(PML4_ADDR))
}

fn table_bytes(table: &[u64; 512]) -> Vec<u8> {
    table.iter().flat_map(|e| e.to_le_bytes()).collect()
}

/// `base` (what KVM_GET_SREGS returned) changed to the 64-bit boot state:
/// GDT/IDT, flat CS/DS/ES/FS/GS/SS from the GDT, TR = the boot TSS, paging
/// on with CR3 = the identity tables, PAE, long mode active.
pub fn boot_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let gdt = boot_gdt();
    sregs.gdt.base = BOOT_GDT_ADDR;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = BOOT_IDT_ADDR;
    sregs.idt.limit = 0;
    sregs.cs = segment(&gdt, BOOT_CS);
    let data = segment(&gdt, BOOT_DS);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(&gdt, BOOT_TSS);
    sregs.cr0 = (sregs.cr0 | CR0_PE | CR0_ET | CR0_PG) & !((1 << 29) | (1 << 30)); // NW, CD off
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 |= CR4_PAE;
    sregs.efer |= EFER_LME | EFER_LMA;
    sregs
}

/// The general registers at the 64-bit entry: RIP = entry, RSI = zero page,
/// RFLAGS = 2 (reserved bit only: interrupts off), a small stack.
pub fn boot_regs(entry: &BootEntry) -> kvm_regs {
    kvm_regs {
        rip: entry.entry.0,
        rsi: entry.zero_page.0,
        rsp: BOOT_STACK_TOP,
        rbp: BOOT_STACK_TOP,
        rflags: 0x2,
        ..Default::default()
    }
}

/// x87 and SSE at their reset values (FCW 0x37f, MXCSR 0x1f80).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

fn step(index: u32, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuSetupError {
    move |source| VcpuSetupError { index, what, source }
}

fn vcpu_has_mtrr(vcpu: &VcpuFd, index: u32) -> Result<bool, VcpuSetupError> {
    let cpuid = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(step(index, "KVM_GET_CPUID2"))?;
    Ok(has_mtrr(&cpuid))
}

/// Sets up the boot vCPU (vCPU 0) for the 64-bit Linux entry. Call after
/// `KVM_SET_CPUID2` (see [`set_linux_cpuid`]) and after the in-kernel irqchip
/// exists (the LAPIC is programmed), before the vCPU first runs.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, index: u32, entry: &BootEntry) -> Result<(), VcpuSetupError> {
    setup_msrs(vcpu, index, vcpu_has_mtrr(vcpu, index)?)?;
    let sregs = vcpu.get_sregs().map_err(step(index, "KVM_GET_SREGS"))?;
    vcpu.set_sregs(&boot_sregs(sregs))
        .map_err(step(index, "KVM_SET_SREGS"))?;
    vcpu.set_regs(&boot_regs(entry)).map_err(step(index, "KVM_SET_REGS"))?;
    vcpu.set_fpu(&boot_fpu()).map_err(step(index, "KVM_SET_FPU"))?;
    setup_lint(vcpu, index)
}

/// Sets up an application processor: the same MSRs as the boot vCPU and the
/// LINT pins. Registers are not touched: KVM keeps an AP (any vCPU but the
/// boot one) in wait-for-SIPI, and the guest's INIT/SIPI sets its state.
/// Call after `KVM_SET_CPUID2` and after the in-kernel irqchip exists.
pub fn setup_ap_vcpu(vcpu: &VcpuFd, index: u32) -> Result<(), VcpuSetupError> {
    setup_msrs(vcpu, index, vcpu_has_mtrr(vcpu, index)?)?;
    setup_lint(vcpu, index)
}

/// `KVM_SET_CPUID2` with [`linux_cpuid`] for vCPU `index` of `vcpus`.
pub fn set_linux_cpuid(kvm: &Kvm, vcpu: &VcpuFd, index: u32, vcpus: u32) -> Result<CpuId, VcpuSetupError> {
    let cpuid = linux_cpuid(kvm, index, vcpus)?;
    vcpu.set_cpuid2(&cpuid).map_err(step(index, "KVM_SET_CPUID2"))?;
    Ok(cpuid)
}

/// Everything a vCPU of a Linux guest needs, in order: CPUID, then (vCPU 0)
/// [`setup_boot_vcpu`] or (others) [`setup_ap_vcpu`].
pub fn setup_linux_vcpu(
    kvm: &Kvm,
    vcpu: &VcpuFd,
    index: u32,
    vcpus: u32,
    entry: &BootEntry,
) -> Result<(), VcpuSetupError> {
    set_linux_cpuid(kvm, vcpu, index, vcpus)?;
    if index == 0 {
        setup_boot_vcpu(vcpu, index, entry)
    } else {
        setup_ap_vcpu(vcpu, index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::GuestRam;

    /// Walks the 4-level tables like the MMU does (4 KiB, 2 MiB or 1 GiB leaves).
    fn translate(mem: &GuestMemoryMmap, cr3: u64, va: u64) -> Option<u64> {
        let mut table = cr3 & !0xfff;
        for (level, shift) in [(4, 39), (3, 30), (2, 21), (1, 12)] {
            let e: u64 = mem.read_obj(GuestAddress(table + ((va >> shift) & 0x1ff) * 8)).ok()?;
            if e & PTE_PRESENT == 0 {
                return None;
            }
            let frame = e & 0x000f_ffff_ffff_f000;
            if level == 1 || (level < 4 && e & PTE_PS != 0) {
                let mask = (1u64 << shift) - 1;
                return Some((frame & !mask) | (va & mask));
            }
            table = frame;
        }
        None
    }

    #[test]
    fn page_tables_identity_map_four_gib() {
        let ram = GuestRam::new("arch-pt", 64 << 20).unwrap();
        let mem = ram.memory();
        write_entry_structures(mem).unwrap();
        for va in [
            0,
            0x1234,
            ZERO_PAGE_ADDR,
            KERNEL_LOAD_ADDR + 0x200,
            0x3fff_ffff,
            0x4000_0000,
            0xbfff_f000,
            IOAPIC_ADDR,
            LAPIC_ADDR + 0x30,
            0xffff_ffff,
        ] {
            assert_eq!(translate(mem, PML4_ADDR, va), Some(va), "va {va:#x}");
        }
        assert_eq!(translate(mem, PML4_ADDR, 0x1_0000_0000), None);
        assert_eq!(translate(mem, PML4_ADDR, 0x80_0000_0000), None);
        // Entries are writable 2 MiB pages.
        let pde: u64 = mem.read_obj(GuestAddress(PD_ADDR + 8)).unwrap();
        assert_eq!(pde, 0x20_0000 | PTE_PRESENT | PTE_RW | PTE_PS);
    }

    #[test]
    fn gdt_in_memory_decodes_to_the_boot_segments() {
        let ram = GuestRam::new("arch-gdt", 16 << 20).unwrap();
        let mem = ram.memory();
        write_entry_structures(mem).unwrap();
        let sregs = boot_sregs(kvm_sregs::default());
        let mut gdt = [0u64; 6];
        for (i, d) in gdt.iter_mut().enumerate() {
            *d = mem.read_obj(GuestAddress(sregs.gdt.base + 8 * i as u64)).unwrap();
        }
        assert_eq!(usize::from(sregs.gdt.limit) + 1, 8 * gdt.len());
        assert_eq!(segment(&gdt, sregs.cs.selector), sregs.cs);
        assert_eq!(segment(&gdt, sregs.ss.selector), sregs.ss);
        assert_eq!(segment(&gdt, sregs.tr.selector), sregs.tr);
        assert_eq!((sregs.cs.selector, sregs.ds.selector), (0x10, 0x18));
        assert_eq!(sregs.cs.l, 1);
        assert_eq!(sregs.cr3, PML4_ADDR);
        assert_eq!(sregs.cr0 & (CR0_PE | CR0_PG), CR0_PE | CR0_PG);
        assert_eq!(sregs.cr4 & CR4_PAE, CR4_PAE);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
    }

    #[test]
    fn regs_and_fpu() {
        let entry = BootEntry::for_test(0x10_0200);
        let r = boot_regs(&entry);
        assert_eq!((r.rip, r.rsi, r.rflags), (0x10_0200, ZERO_PAGE_ADDR, 2));
        let f = boot_fpu();
        assert_eq!((f.fcw, f.mxcsr), (0x37f, 0x1f80));
    }

    /// On a host with /dev/kvm: KVM accepts the whole setup (the vCPUs are
    /// not run: this host's PVM KVM cannot run ordinary long-mode code).
    #[test]
    fn kvm_accepts_the_boot_state() {
        let Ok(kvm) = Kvm::new() else {
            k7d_test_skip::skip("kvm_accepts_the_boot_state", "/dev/kvm cannot be opened");
            return;
        };
        let vm = kvm.create_vm().unwrap();
        let ram = GuestRam::new("arch-kvm", 64 << 20).unwrap();
        ram.register(&vm, false).unwrap();
        vm.create_irq_chip().unwrap();
        let entry = BootEntry::for_test(0x10_0200);
        let bsp = vm.create_vcpu(0).unwrap();
        let ap = vm.create_vcpu(1).unwrap();
        setup_linux_vcpu(&kvm, &bsp, 0, 2, &entry).unwrap();
        setup_linux_vcpu(&kvm, &ap, 1, 2, &entry).unwrap();
        let s = bsp.get_sregs().unwrap();
        assert_eq!((s.cs.selector, s.cs.l, s.cr3), (BOOT_CS, 1, PML4_ADDR));
        assert_eq!(s.efer & EFER_LMA, EFER_LMA);
        assert_eq!(bsp.get_regs().unwrap().rip, 0x10_0200);
        let c = ap.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
        let l1 = c.as_slice().iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ebx >> 24, 1);
    }
}

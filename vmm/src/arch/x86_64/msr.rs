//! The MSRs every vCPU of a Linux guest starts with.
//!
//! KVM resets most of these to 0 already; writing them makes the start state
//! explicit and identical on every vCPU (the kernel compares MTRRs across
//! CPUs, and TSC writes of 0 at setup let KVM keep the TSCs synchronised).

use kvm_bindings::{Msrs, kvm_msr_entry};
use kvm_ioctls::VcpuFd;

use crate::vstate::vcpu::VcpuSetupError;

/// IA32_TIME_STAMP_COUNTER.
pub const MSR_IA32_TSC: u32 = 0x10;
/// IA32_SYSENTER_CS.
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// IA32_SYSENTER_ESP.
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// IA32_SYSENTER_EIP.
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// IA32_MISC_ENABLE.
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MTRR_DEF_TYPE.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// STAR (SYSCALL segments).
pub const MSR_STAR: u32 = 0xc000_0081;
/// LSTAR (64-bit SYSCALL target).
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// CSTAR (compat SYSCALL target).
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// SFMASK (SYSCALL RFLAGS mask).
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// KERNEL_GS_BASE (SWAPGS).
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

/// IA32_MISC_ENABLE: fast-string operations enabled (as firmware leaves it).
pub const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRR default type: MTRRs enabled (bit 11), default memory type write-back (6).
/// No variable or fixed MTRRs are set, so all of RAM is WB; the kernel maps
/// MMIO uncached through PAT/ioremap itself.
pub const MTRR_DEF_TYPE_WB_ENABLED: u64 = (1 << 11) | 6;

/// `(index, value, step name)` of each boot MSR, in the order written.
pub const BOOT_MSRS: [(u32, u64, &str); 11] = [
    (MSR_IA32_SYSENTER_CS, 0, "KVM_SET_MSRS (IA32_SYSENTER_CS)"),
    (MSR_IA32_SYSENTER_ESP, 0, "KVM_SET_MSRS (IA32_SYSENTER_ESP)"),
    (MSR_IA32_SYSENTER_EIP, 0, "KVM_SET_MSRS (IA32_SYSENTER_EIP)"),
    (MSR_STAR, 0, "KVM_SET_MSRS (STAR)"),
    (MSR_LSTAR, 0, "KVM_SET_MSRS (LSTAR)"),
    (MSR_CSTAR, 0, "KVM_SET_MSRS (CSTAR)"),
    (MSR_SYSCALL_MASK, 0, "KVM_SET_MSRS (SFMASK)"),
    (MSR_KERNEL_GS_BASE, 0, "KVM_SET_MSRS (KERNEL_GS_BASE)"),
    (MSR_IA32_TSC, 0, "KVM_SET_MSRS (IA32_TSC)"),
    (
        MSR_IA32_MISC_ENABLE,
        MISC_ENABLE_FAST_STRING,
        "KVM_SET_MSRS (IA32_MISC_ENABLE)",
    ),
    (
        MSR_MTRR_DEF_TYPE,
        MTRR_DEF_TYPE_WB_ENABLED,
        "KVM_SET_MSRS (IA32_MTRR_DEF_TYPE)",
    ),
];

/// The boot MSR entries. `mtrr` says whether the vCPU's CPUID has MTRRs (leaf
/// 1 EDX bit 12); without them the MTRR MSR is left out (KVM would refuse it).
pub fn boot_msr_entries(mtrr: bool) -> Vec<(kvm_msr_entry, &'static str)> {
    BOOT_MSRS
        .iter()
        .filter(|(index, _, _)| mtrr || *index != MSR_MTRR_DEF_TYPE)
        .map(|&(index, data, name)| {
            (
                kvm_msr_entry {
                    index,
                    data,
                    ..Default::default()
                },
                name,
            )
        })
        .collect()
}

/// Writes the boot MSRs on `vcpu`; a refused MSR is named in the error.
pub fn setup_msrs(vcpu: &VcpuFd, index: u32, mtrr: bool) -> Result<(), VcpuSetupError> {
    let entries = boot_msr_entries(mtrr);
    let raw: Vec<kvm_msr_entry> = entries.iter().map(|(e, _)| *e).collect();
    let msrs = Msrs::from_entries(&raw).map_err(|_| VcpuSetupError {
        index,
        what: "building the KVM_SET_MSRS list",
        source: kvm_ioctls::Error::new(libc::E2BIG),
    })?;
    let set = vcpu.set_msrs(&msrs).map_err(|source| VcpuSetupError {
        index,
        what: "KVM_SET_MSRS",
        source,
    })?;
    // KVM stops at the first MSR it refuses and returns how many it set.
    if let Some((_, name)) = entries.get(set) {
        return Err(VcpuSetupError {
            index,
            what: name,
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_msrs() {
        let all = boot_msr_entries(true);
        assert_eq!(all.len(), 11);
        let get = |i: u32| all.iter().find(|(e, _)| e.index == i).map(|(e, _)| e.data);
        assert_eq!(get(MSR_MTRR_DEF_TYPE), Some(0x806));
        assert_eq!(get(MSR_IA32_MISC_ENABLE), Some(1));
        assert_eq!(get(MSR_LSTAR), Some(0));
        assert_eq!(get(MSR_IA32_TSC), Some(0));
        let no_mtrr = boot_msr_entries(false);
        assert_eq!(no_mtrr.len(), 10);
        assert!(no_mtrr.iter().all(|(e, _)| e.index != MSR_MTRR_DEF_TYPE));
    }
}

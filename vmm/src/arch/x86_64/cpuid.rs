//! CPUID for Linux guests: what KVM supports, with a per-vCPU topology that
//! is consistent with the vCPU count (1 socket, N cores, 1 thread per core,
//! APIC id = vCPU index), the hypervisor bit, TSC-deadline when KVM has it,
//! and KVM's paravirt leaves (0x4000_0000 signature, 0x4000_0001 features:
//! kvmclock, PV EOI, ...) as KVM reports them.
//!
//! Why the topology matters: Linux sizes its package map from CPUID (leaf
//! 0xB on Intel, 0x8000_0008/0x8000_001E on AMD) and refuses to bring up a
//! CPU whose APIC id falls outside it, so a host topology copied into an
//! N-vCPU guest can cost CPUs. The real-mode test guests keep
//! [`crate::vstate::vcpu::cpuid_for`].

use kvm_bindings::{CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX, KVM_MAX_CPUID_ENTRIES, kvm_cpuid_entry2};
use kvm_ioctls::{Cap, Kvm};

use crate::vstate::vcpu::VcpuSetupError;

/// Leaf 1 ECX: TSC-deadline timer.
const CPUID1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// Leaf 1 ECX: running under a hypervisor.
const CPUID1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX: multi-threading / multi-core package (HTT).
const CPUID1_EDX_HTT: u32 = 1 << 28;
/// Leaf 1 EDX: MTRRs.
pub const CPUID1_EDX_MTRR: u32 = 1 << 12;
/// Leaf 0x8000_0001 ECX: CmpLegacy (AMD: HTT means cores, not threads).
const CPUID_EXT1_ECX_CMP_LEGACY: u32 = 1 << 1;
/// KVM paravirt signature leaf.
pub const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
/// KVM paravirt features leaf.
pub const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
/// "KVMKVMKVM\0\0\0" in EBX, ECX, EDX.
const KVM_SIGNATURE: [u32; 3] = [0x4b4d_564b, 0x564b_4d56, 0x0000_004d];

/// Bits of the APIC id that number the cores of the one package.
pub fn core_bits(vcpus: u32) -> u32 {
    vcpus.max(1).next_power_of_two().trailing_zeros()
}

fn vendor_is_amd(cpuid: &CpuId) -> bool {
    cpuid.as_slice().iter().any(|e| {
        // "AuthenticAMD" / "HygonGenuine": EBX "Auth" / "Hygo".
        e.function == 0 && (e.ebx == 0x6874_7541 || e.ebx == 0x6f67_7948)
    })
}

fn topology_leaf(function: u32, index: u32, apic_id: u32, vcpus: u32) -> kvm_cpuid_entry2 {
    // Level 0: SMT (1 thread per core); level 1: core (all vCPUs); then invalid.
    let (eax, ebx, level_type) = match index {
        0 => (0, 1, 1),
        1 => (core_bits(vcpus), vcpus, 2),
        _ => (0, 0, 0),
    };
    kvm_cpuid_entry2 {
        function,
        index,
        flags: KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
        eax,
        ebx,
        ecx: (level_type << 8) | (index & 0xff),
        edx: apic_id,
        ..Default::default()
    }
}

/// Patches KVM's supported CPUID for vCPU `index` of `vcpus` (APIC id = index).
/// `tsc_deadline`: KVM has `KVM_CAP_TSC_DEADLINE_TIMER` (its supported CPUID
/// never advertises the bit itself).
pub fn patch_cpuid(cpuid: &mut CpuId, index: u32, vcpus: u32, tsc_deadline: bool) -> Result<(), CpuidError> {
    let vcpus = vcpus.max(1);
    let bits = core_bits(vcpus);
    let package_ids = 1u32 << bits;
    let amd = vendor_is_amd(cpuid);
    let max_basic = cpuid.as_slice().iter().find(|e| e.function == 0).map_or(0, |e| e.eax);
    let has_0x1f = cpuid.as_slice().iter().any(|e| e.function == 0x1f);

    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | ((package_ids.min(255) & 0xff) << 16) | ((index & 0xff) << 24);
                e.ecx |= CPUID1_ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= CPUID1_ECX_TSC_DEADLINE;
                } else {
                    e.ecx &= !CPUID1_ECX_TSC_DEADLINE;
                }
                if vcpus > 1 {
                    e.edx |= CPUID1_EDX_HTT;
                } else {
                    e.edx &= !CPUID1_EDX_HTT;
                }
            }
            // Intel deterministic cache parameters (and AMD's 0x8000_001D twin):
            // L1/L2 per core, L3 shared by the package.
            4 | 0x8000_001d if e.eax & 0x1f != 0 => {
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { package_ids - 1 } else { 0 };
                e.eax = (e.eax & !(0xfff << 14)) | ((sharing & 0xfff) << 14);
                if e.function == 4 {
                    e.eax = (e.eax & 0x03ff_ffff) | (((package_ids - 1) & 0x3f) << 26);
                }
            }
            0x8000_0001 if amd => {
                if vcpus > 1 {
                    e.ecx |= CPUID_EXT1_ECX_CMP_LEGACY;
                } else {
                    e.ecx &= !CPUID_EXT1_ECX_CMP_LEGACY;
                }
            }
            0x8000_0008 if amd => {
                // NC = cores - 1, ApicIdCoreIdSize = core bits.
                e.ecx = (e.ecx & !0xf0ff) | ((vcpus - 1) & 0xff) | (bits << 12);
            }
            0x8000_001e if amd => {
                e.eax = index; // extended APIC id
                e.ebx = index & 0xff; // compute unit id; 1 thread per unit
                e.ecx = 0; // node 0, 1 node per package
            }
            KVM_CPUID_SIGNATURE => {
                e.eax = e.eax.max(KVM_CPUID_FEATURES);
                [e.ebx, e.ecx, e.edx] = KVM_SIGNATURE;
            }
            _ => {}
        }
    }

    // Rebuild the extended topology leaves for this vCPU.
    cpuid.retain(|e| e.function != 0xb && e.function != 0x1f);
    let mut leaves = Vec::new();
    if max_basic >= 0xb {
        leaves.push(0xb);
    }
    if max_basic >= 0x1f && has_0x1f {
        leaves.push(0x1f);
    }
    for function in leaves {
        for sub in 0..3 {
            cpuid
                .push(topology_leaf(function, sub, index, vcpus))
                .map_err(|_| CpuidError::TooManyEntries)?;
        }
    }
    Ok(())
}

/// Errors from building the CPUID (besides the ioctl).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CpuidError {
    /// The CPUID list would exceed KVM's entry limit.
    #[error("the CPUID list would exceed {KVM_MAX_CPUID_ENTRIES} entries")]
    TooManyEntries,
}

/// The CPUID vCPU `index` of a `vcpus`-vCPU Linux guest gets.
pub fn linux_cpuid(kvm: &Kvm, index: u32, vcpus: u32) -> Result<CpuId, VcpuSetupError> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| VcpuSetupError {
            index,
            what: "KVM_GET_SUPPORTED_CPUID",
            source,
        })?;
    let tsc_deadline = kvm.check_extension(Cap::TscDeadlineTimer);
    patch_cpuid(&mut cpuid, index, vcpus, tsc_deadline).map_err(|_| VcpuSetupError {
        index,
        what: "building the Linux CPUID (too many entries)",
        source: kvm_ioctls::Error::new(libc::E2BIG),
    })?;
    Ok(cpuid)
}

/// Whether `cpuid` advertises MTRRs (then the MTRR MSRs may be written).
pub fn has_mtrr(cpuid: &CpuId) -> bool {
    cpuid
        .as_slice()
        .iter()
        .any(|e| e.function == 1 && e.edx & CPUID1_EDX_MTRR != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    /// A host-like Intel CPUID: 16 threads in 8 cores, 2 threads per core.
    fn intel() -> CpuId {
        CpuId::from_entries(&[
            entry(0, 0, 0x1f, 0x756e_6547, 0x6c65_746e, 0x4965_6e69),
            entry(1, 0, 0x906ea, 0x1010_0800, 0x7ffa_fbff, 0xbfeb_fbff),
            entry(4, 0, 0x1c00_4121, 0, 0, 0), // L1d, 2 threads
            entry(4, 1, 0x1c00_4143, 0, 0, 0), // L2
            entry(4, 2, 0x1c03_c163, 0, 0, 0), // L3, 16 threads
            entry(4, 3, 0, 0, 0, 0),           // end
            entry(0xb, 0, 1, 2, 0x100, 7),
            entry(0xb, 1, 4, 16, 0x201, 7),
            entry(0x1f, 0, 1, 2, 0x100, 7),
            entry(KVM_CPUID_SIGNATURE, 0, 0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d),
            entry(KVM_CPUID_FEATURES, 0, 0x0100_7afb, 0, 0, 0),
        ])
        .unwrap()
    }

    fn amd() -> CpuId {
        CpuId::from_entries(&[
            entry(0, 0, 0x10, 0x6874_7541, 0x444d_4163, 0x6974_6e65),
            entry(1, 0, 0x830f10, 0x0010_0800, 0x7ed8_320b, 0x178b_fbff),
            entry(0x8000_0001, 0, 0, 0, 0x75c2_37ff, 0x2fd3_fbff),
            entry(0x8000_0008, 0, 0x3030, 0, 0x700f, 0),
            entry(0x8000_001d, 0, 0x121, 0, 0, 0),
            entry(0x8000_001d, 3, 0x3c163, 0, 0, 0),
            entry(0x8000_001e, 0, 9, 0x104, 0, 0),
        ])
        .unwrap()
    }

    fn get(c: &CpuId, function: u32, index: u32) -> kvm_cpuid_entry2 {
        *c.as_slice()
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap_or_else(|| panic!("no leaf {function:#x}.{index}"))
    }

    #[test]
    fn core_bits_round_up() {
        assert_eq!([1, 2, 3, 4, 5, 254].map(core_bits), [0, 1, 2, 2, 3, 8]);
    }

    #[test]
    fn intel_topology_for_three_vcpus() {
        for index in 0..3 {
            let mut c = intel();
            patch_cpuid(&mut c, index, 3, true).unwrap();
            let l1 = get(&c, 1, 0);
            assert_eq!(l1.ebx >> 24, index, "initial APIC id");
            assert_eq!((l1.ebx >> 16) & 0xff, 4, "addressable ids in the package");
            assert_eq!(l1.ebx & 0xffff, 0x0800, "CLFLUSH size kept");
            assert_ne!(l1.ecx & CPUID1_ECX_HYPERVISOR, 0);
            assert_ne!(l1.ecx & CPUID1_ECX_TSC_DEADLINE, 0);
            assert_ne!(l1.edx & CPUID1_EDX_HTT, 0);
            for f in [0xb, 0x1f] {
                let smt = get(&c, f, 0);
                let core = get(&c, f, 1);
                let end = get(&c, f, 2);
                assert_eq!((smt.eax, smt.ebx, smt.ecx, smt.edx), (0, 1, 0x100, index));
                assert_eq!((core.eax, core.ebx, core.ecx, core.edx), (2, 3, 0x201, index));
                assert_eq!((end.ecx >> 8) & 0xff, 0, "level list terminates");
                assert_eq!(smt.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX, 1);
                // Every vCPU's APIC id lies inside package 0.
                assert_eq!(index >> core.eax, 0);
            }
            assert_eq!(c.as_slice().iter().filter(|e| e.function == 0xb).count(), 3);
            // Leaf 4: cores per package - 1 = 3; L1/L2 private, L3 shared by 4 ids.
            assert_eq!(get(&c, 4, 0).eax >> 26, 3);
            assert_eq!((get(&c, 4, 0).eax >> 14) & 0xfff, 0);
            assert_eq!((get(&c, 4, 2).eax >> 14) & 0xfff, 3);
            assert_eq!(get(&c, 4, 3).eax, 0, "terminator untouched");
            let sig = get(&c, KVM_CPUID_SIGNATURE, 0);
            assert_eq!(
                (sig.eax, sig.ebx, sig.ecx, sig.edx),
                (0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d)
            );
            assert_eq!(get(&c, KVM_CPUID_FEATURES, 0).eax, 0x0100_7afb, "KVM features kept");
        }
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let mut c = intel();
        patch_cpuid(&mut c, 0, 1, false).unwrap();
        assert_eq!(get(&c, 1, 0).edx & CPUID1_EDX_HTT, 0);
        assert_eq!(get(&c, 1, 0).ecx & CPUID1_ECX_TSC_DEADLINE, 0);
        assert_eq!((get(&c, 0xb, 1).eax, get(&c, 0xb, 1).ebx), (0, 1));
    }

    #[test]
    fn amd_topology_for_two_vcpus() {
        let mut c = amd();
        patch_cpuid(&mut c, 1, 2, false).unwrap();
        assert_eq!(get(&c, 1, 0).ebx >> 24, 1);
        assert_ne!(get(&c, 0x8000_0001, 0).ecx & CPUID_EXT1_ECX_CMP_LEGACY, 0);
        let ext8 = get(&c, 0x8000_0008, 0).ecx;
        assert_eq!((ext8 & 0xff, (ext8 >> 12) & 0xf), (1, 1));
        assert_eq!(ext8 & 0x30000, 0, "PerfTscSize untouched");
        let e = get(&c, 0x8000_001e, 0);
        assert_eq!((e.eax, e.ebx, e.ecx), (1, 1, 0));
        assert_eq!((get(&c, 0x8000_001d, 3).eax >> 14) & 0xfff, 1, "L3 shared by both");
        // Max basic leaf 0x10 >= 0xb: the topology leaf is added.
        assert_eq!(get(&c, 0xb, 1).ebx, 2);
        // No 0x4000_0000 in this list: nothing invented.
        assert!(c.as_slice().iter().all(|e| e.function != KVM_CPUID_SIGNATURE));
    }

    #[test]
    fn real_kvm_cpuid_if_available() {
        let Ok(kvm) = Kvm::new() else {
            k7d_test_skip::skip("real_kvm_cpuid_if_available", "/dev/kvm cannot be opened");
            return;
        };
        let c = linux_cpuid(&kvm, 1, 2).unwrap();
        assert_eq!(get(&c, 1, 0).ebx >> 24, 1);
        assert_ne!(get(&c, 1, 0).ecx & CPUID1_ECX_HYPERVISOR, 0);
        if c.as_slice().iter().any(|e| e.function == 0xb) {
            assert_eq!(get(&c, 0xb, 1).ebx, 2);
            assert_eq!(get(&c, 0xb, 0).edx, 1);
        }
    }
}

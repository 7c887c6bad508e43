//! The complete machine state of a paused VM, versioned and serde-serialized:
//! every latch a guest driver set once must survive a restore.
//!
//! Per vCPU: CPUID, regs, sregs, xsave (FPU/SSE/AVX), xcrs, debug registers,
//! vCPU events, MP state, LAPIC, and every MSR of `KVM_GET_MSR_INDEX_LIST`
//! that this host lets us read (kvmclock MSRs included). Per VM: PIT2 (a
//! fresh, unprogrammed PIT after restore freezes every timer-driven guest),
//! PIC master/slave, IOAPIC, the KVM clock. Devices: the serial port.
//!
//! Restore order matters: CPUID first (KVM checks MSRs and CR4 against it),
//! sregs before the LAPIC and MSRs, regs before vCPU events, and
//! `IA32_TSC_DEADLINE` after `IA32_TSC` in a separate, last `KVM_SET_MSRS`:
//! the deadline is a TSC value, and writing it before the TSC is restored
//! compares it with the wrong clock.

use std::sync::OnceLock;

use kvm_bindings::{
    CpuId, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_clock_data, kvm_cpuid_entry2,
    kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use k7d_devices::legacy::SerialSnapshot;

/// Version of [`MachineState`]; bumped on any incompatible change.
pub const STATE_VERSION: u32 = 1;

/// `IA32_TSC`.
pub const MSR_IA32_TSC: u32 = 0x10;
/// `IA32_TSC_DEADLINE`.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// Errors while saving or restoring state.
#[derive(Debug, Error)]
pub enum PersistError {
    /// A KVM ioctl failed.
    #[error("{what} failed for {whom}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// `vcpu N` or `the VM`.
        whom: String,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The state does not fit this VM.
    #[error("the saved state does not fit this VM: {0}")]
    Mismatch(String),
    /// A FAM wrapper could not be built.
    #[error("cannot build the {0} list")]
    Fam(&'static str),
}

/// Checks that `state` can be restored into a VM built from `config`: its
/// version is this k7d's and it has one saved vCPU per configured vCPU.
pub fn check_fits(config: &crate::config::VmConfig, state: &MachineState) -> Result<(), PersistError> {
    if state.version != STATE_VERSION {
        return Err(PersistError::Mismatch(format!(
            "state version {} is not {STATE_VERSION}",
            state.version
        )));
    }
    if state.vcpus.len() != usize::from(config.vcpus) {
        return Err(PersistError::Mismatch(format!(
            "the state has {} vCPUs, the config {}",
            state.vcpus.len(),
            config.vcpus
        )));
    }
    Ok(())
}

fn ioctl(what: &'static str, whom: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> PersistError {
    let whom = whom.into();
    move |source| PersistError::Kvm { what, whom, source }
}

/// One vCPU's state.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    /// CPUID entries as set.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// General registers.
    pub regs: kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Pending exceptions, interrupts, NMIs.
    pub events: kvm_vcpu_events,
    /// MP state (runnable, halted, waiting for SIPI).
    pub mp_state: kvm_mp_state,
    /// Local APIC registers.
    pub lapic: kvm_lapic_state,
    /// `(index, value)` of every readable MSR.
    pub msrs: Vec<(u32, u64)>,
}

/// VM-wide KVM state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmKvmState {
    /// The in-kernel PIT.
    pub pit: kvm_pit_state2,
    /// PIC master, PIC slave, IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    /// The KVM clock.
    pub clock: kvm_clock_data,
}

/// Everything needed to resume a paused VM elsewhere.
#[derive(Debug, Serialize, Deserialize)]
pub struct MachineState {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// Per vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// VM-wide state.
    pub vm: VmKvmState,
    /// The serial port.
    pub serial: SerialSnapshot,
    /// The virtio-pci functions, in bus order (Linux guests; empty for the
    /// real-mode test guests).
    #[serde(default)]
    pub virtio: Vec<k7d_devices::virtio::transport::VirtioPciState>,
}

/// MSRs this host lets us read (probed once per process).
fn readable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<&'static [u32], PersistError> {
    static LIST: OnceLock<Vec<u32>> = OnceLock::new();
    if let Some(l) = LIST.get() {
        return Ok(l);
    }
    let all = kvm
        .get_msr_index_list()
        .map_err(ioctl("KVM_GET_MSR_INDEX_LIST", "the host"))?;
    let mut ok = Vec::new();
    for &idx in all.as_slice() {
        let mut m = Msrs::from_entries(&[kvm_msr_entry {
            index: idx,
            ..Default::default()
        }])
        .map_err(|_| PersistError::Fam("MSR"))?;
        if vcpu.get_msrs(&mut m).map(|n| n == 1).unwrap_or(false) {
            ok.push(idx);
        }
    }
    Ok(LIST.get_or_init(|| ok))
}

/// Saves one (paused) vCPU.
pub fn save_vcpu(kvm: &Kvm, vcpu: &VcpuFd, index: u32) -> Result<VcpuState, PersistError> {
    let who = format!("vcpu {index}");
    // MP state first: reading it makes KVM flush pending APIC events into it.
    let mp_state = vcpu.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE", &who))?;
    let cpuid = vcpu
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_CPUID2", &who))?
        .as_slice()
        .to_vec();
    let list = readable_msrs(kvm, vcpu)?;
    let entries: Vec<kvm_msr_entry> = list
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs = Msrs::from_entries(&entries).map_err(|_| PersistError::Fam("MSR"))?;
    let n = vcpu.get_msrs(&mut msrs).map_err(ioctl("KVM_GET_MSRS", &who))?;
    if n != entries.len() {
        return Err(PersistError::Mismatch(format!(
            "{who}: read {n} of {} MSRs",
            entries.len()
        )));
    }
    Ok(VcpuState {
        cpuid,
        regs: vcpu.get_regs().map_err(ioctl("KVM_GET_REGS", &who))?,
        sregs: vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS", &who))?,
        xsave: vcpu.get_xsave().map_err(ioctl("KVM_GET_XSAVE", &who))?,
        xcrs: vcpu.get_xcrs().map_err(ioctl("KVM_GET_XCRS", &who))?,
        debugregs: vcpu.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS", &who))?,
        events: vcpu.get_vcpu_events().map_err(ioctl("KVM_GET_VCPU_EVENTS", &who))?,
        mp_state,
        lapic: vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC", &who))?,
        msrs: msrs.as_slice().iter().map(|e| (e.index, e.data)).collect(),
    })
}

fn set_msrs(vcpu: &VcpuFd, who: &str, list: &[(u32, u64)]) -> Result<(), PersistError> {
    if list.is_empty() {
        return Ok(());
    }
    let entries: Vec<kvm_msr_entry> = list
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|_| PersistError::Fam("MSR"))?;
    let n = vcpu.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS", who))?;
    if n != entries.len() {
        return Err(PersistError::Mismatch(format!(
            "{who}: KVM took {n} of {} MSRs (stopped at {:#x})",
            entries.len(),
            entries[n].index
        )));
    }
    Ok(())
}

/// Restores one vCPU (created, not yet run) from `st`. `cpuid_set`: the
/// CPUID entries the vCPU already has, where known (a shell's).
pub fn restore_vcpu(
    vcpu: &VcpuFd,
    index: u32,
    st: &VcpuState,
    cpuid_set: Option<&[kvm_cpuid_entry2]>,
) -> Result<(), PersistError> {
    let who = format!("vcpu {index}");
    // KVM_SET_CPUID2 is one of the dearer calls here (~0.2 ms on this
    // host): skipped when the vCPU (a shell's) already has these entries.
    if cpuid_set != Some(st.cpuid.as_slice()) {
        let cpuid = CpuId::from_entries(&st.cpuid).map_err(|_| PersistError::Fam("CPUID"))?;
        vcpu.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2", &who))?;
    }
    vcpu.set_sregs(&st.sregs).map_err(ioctl("KVM_SET_SREGS", &who))?;
    vcpu.set_regs(&st.regs).map_err(ioctl("KVM_SET_REGS", &who))?;
    // SAFETY: `st.xsave` is a complete kvm_xsave read by KVM_GET_XSAVE (the
    // legacy 4 KiB area, which is what this call copies).
    unsafe { vcpu.set_xsave(&st.xsave) }.map_err(ioctl("KVM_SET_XSAVE", &who))?;
    vcpu.set_xcrs(&st.xcrs).map_err(ioctl("KVM_SET_XCRS", &who))?;
    vcpu.set_debug_regs(&st.debugregs)
        .map_err(ioctl("KVM_SET_DEBUGREGS", &who))?;
    vcpu.set_lapic(&st.lapic).map_err(ioctl("KVM_SET_LAPIC", &who))?;
    // Every MSR but the TSC pair, then IA32_TSC, then IA32_TSC_DEADLINE.
    let (tsc_pair, rest): (Vec<_>, Vec<_>) = st
        .msrs
        .iter()
        .partition(|(i, _)| *i == MSR_IA32_TSC || *i == MSR_IA32_TSC_DEADLINE);
    set_msrs(vcpu, &who, &rest)?;
    let tsc = tsc_pair.iter().find(|(i, _)| *i == MSR_IA32_TSC).copied();
    if let Some(t) = tsc {
        set_msrs(vcpu, &who, &[t])?;
    }
    if let Some(&(i, deadline)) = tsc_pair.iter().find(|(i, _)| *i == MSR_IA32_TSC_DEADLINE) {
        // A deadline of 0 is "disarmed"; if the timer is in TSC-deadline mode
        // and its interrupt was in flight, that would leave the guest without
        // a timer forever: arm it at the current TSC so it fires at once.
        let tsc_deadline_mode = lapic_timer_mode(&st.lapic) == 2;
        let d = if deadline == 0 && tsc_deadline_mode {
            tsc.map(|t| t.1).unwrap_or(0)
        } else {
            deadline
        };
        set_msrs(vcpu, &who, &[(i, d)])?;
    }
    vcpu.set_vcpu_events(&st.events)
        .map_err(ioctl("KVM_SET_VCPU_EVENTS", &who))?;
    vcpu.set_mp_state(st.mp_state)
        .map_err(ioctl("KVM_SET_MP_STATE", &who))?;
    Ok(())
}

/// LVT timer mode bits (17..18): 0 one-shot, 1 periodic, 2 TSC-deadline.
fn lapic_timer_mode(l: &kvm_lapic_state) -> u32 {
    let b = &l.regs[0x320..0x324];
    let v = u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]);
    (v >> 17) & 0x3
}

fn irqchip(id: u32) -> kvm_irqchip {
    kvm_irqchip {
        chip_id: id,
        ..Default::default()
    }
}

/// Saves the VM-wide state (PIT2, PIC, IOAPIC, clock).
pub fn save_vm(vm: &VmFd) -> Result<VmKvmState, PersistError> {
    let mut irqchips = Vec::new();
    for id in [KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQCHIP_IOAPIC] {
        let mut c = irqchip(id);
        vm.get_irqchip(&mut c).map_err(ioctl("KVM_GET_IRQCHIP", "the VM"))?;
        irqchips.push(c);
    }
    Ok(VmKvmState {
        pit: vm.get_pit2().map_err(ioctl("KVM_GET_PIT2", "the VM"))?,
        irqchips,
        clock: vm.get_clock().map_err(ioctl("KVM_GET_CLOCK", "the VM"))?,
    })
}

/// Restores the VM-wide state into a VM with an irqchip and a PIT2.
pub fn restore_vm(vm: &VmFd, st: &VmKvmState) -> Result<(), PersistError> {
    vm.set_pit2(&st.pit).map_err(ioctl("KVM_SET_PIT2", "the VM"))?;
    for c in &st.irqchips {
        vm.set_irqchip(c).map_err(ioctl("KVM_SET_IRQCHIP", "the VM"))?;
    }
    // Only the clock value travels: the flags say how KVM read it, and the
    // host-time fields are this moment's, not the saved one's.
    let clock = kvm_clock_data {
        clock: st.clock.clock,
        ..Default::default()
    };
    vm.set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK", "the VM"))?;
    Ok(())
}

//! x86_64 Linux boot: everything between "guest RAM exists" and "vCPU 0
//! starts at the kernel's 64-bit entry".
//!
//! The VM builder calls, in order (see `docs/linux-boot.md`):
//! 1. [`probe_kernel`] (optional, before creating anything: refuses a bad
//!    kernel file without touching KVM),
//! 2. [`configure_linux`] once guest RAM exists: loads kernel, initrd and
//!    command line, writes the ACPI tables, GDT, page tables and zero page,
//!    and returns the [`BootEntry`],
//! 3. for each vCPU, after the in-kernel irqchip: [`setup_linux_vcpu`]
//!    (CPUID, MSRs, LINT pins; on vCPU 0 also the 64-bit entry registers),
//! 4. puts an [`AcpiPmDevice`] on the PIO bus so `poweroff` stops the VM.
//!
//! Modules: [`layout`] (addresses, e820), [`boot`] (kernel/initrd/cmdline,
//! zero page), [`gdt`], [`regs`] (page tables, registers, vCPU setup),
//! [`msr`], [`cpuid`], [`acpi`], [`pm`], [`unpack`] (a bzImage's LZ4
//! payload unpacked on the host once, so later boots skip the guest's
//! decompressor), [`vmgenid`] (the VM Generation ID a fork child's or a
//! restored guest's kernel reseeds its RNG from).

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod gdt;
pub mod layout;
pub mod msr;
pub mod pm;
pub mod regs;
pub mod unpack;
pub mod vmgenid;

use std::path::{Path, PathBuf};

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

pub use acpi::{AcpiConfig, PciConfig};
pub use boot::{KernelInfo, KernelKind, probe_kernel, probe_kernel_file};
pub use cpuid::linux_cpuid;
pub use pm::AcpiPmDevice;
pub use regs::{set_linux_cpuid, setup_ap_vcpu, setup_boot_vcpu, setup_linux_vcpu};

use crate::vstate::memory::GuestMemoryMmap;
use layout::*;

/// The command line k7d gives Linux unless told otherwise:
/// - `console=ttyS0`: the kernel console on COM1 (k7d's serial);
/// - `reboot=k`: reboot through the i8042 reset line (port 0x64 ← 0xFE),
///   which k7d turns into a clean stop (the FADT reset register points at the
///   same port, so a plain `reboot` works too);
/// - `panic=1`: a panic reboots after 1 s, i.e. the VM stops instead of hanging;
/// - `quiet`: only warnings reach the console. Every byte the serial console
///   prints is two port exits; a verbose boot prints about 40 KiB (in the
///   nested lab it took 13.6 s to init where quiet boots took 3.4–3.9 s). A
///   command line of the user's replaces this one: `loglevel=7` there shows
///   it all;
/// - `cryptomgr.notests`: no self-test of every built-in crypto algorithm at
///   boot (`crypto_algapi_init`, the longest initcall of Debian's cloud
///   kernel: 1.37 s of a 4.3 s nested-lab boot with `initcall_debug`). Kata's
///   default command line carries it too. A kernel booted with `fips=1` runs
///   the tests anyway;
/// - `no_timer_check`: the IO-APIC timer check, a wait for ticks on IRQ0 the
///   guest never uses (its timer is the LAPIC's TSC deadline), is skipped, as
///   Kata does.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 quiet cryptomgr.notests no_timer_check";

/// The default command line for a VM with (`pci = true`) or without a PCI
/// host bridge. Without one, `pci=off` keeps the kernel from probing config
/// space at 0xCF8 for nothing (dozens of port exits and the PCI core's init);
/// with one, no `pci=` option is needed: the DSDT's `_CRS` describes the
/// bridge windows (no DMI date, so the kernel trusts `_CRS`), `_PRT` the INTx
/// routing and MCFG (if any) the ECAM window, and the VMM pre-assigns BARs
/// inside those windows, which the kernel keeps.
pub fn default_cmdline(pci: bool) -> String {
    if pci {
        DEFAULT_CMDLINE.to_string()
    } else {
        format!("{DEFAULT_CMDLINE} pci=off")
    }
}

/// What [`configure_linux`] boots.
#[derive(Debug, Clone)]
pub struct LinuxBootConfig<'a> {
    /// bzImage or ELF vmlinux.
    pub kernel: &'a Path,
    /// Optional initramfs.
    pub initrd: Option<&'a Path>,
    /// The whole kernel command line (see [`default_cmdline`]).
    pub cmdline: &'a str,
    /// vCPUs (1 ..= 254: APIC ids 0..vcpus).
    pub vcpus: u32,
    /// The PCI host bridge, if the VMM has one.
    pub pci: Option<PciConfig>,
    /// See [`AcpiConfig::irq0_override`] (false with KVM's default routing).
    pub irq0_override: bool,
    /// Describe the VM Generation ID device ([`vmgenid`]).
    pub vmgenid: bool,
    /// Where unpacked kernels are cached ([`unpack`]). `Some`: an LZ4
    /// bzImage boots from its unpacked ELF (unpacked now if not there yet);
    /// `None`: every bzImage boots through its own decompressor.
    pub kernel_cache: Option<&'a Path>,
    /// The kernel, its unpacked ELF and the initrd opened elsewhere (a VM
    /// process, which opens nothing by path, is handed them); `None`: they
    /// are opened here by path.
    pub files: Option<&'a BootFiles>,
}

/// A Linux boot's files opened elsewhere and handed over
/// ([`LinuxBootConfig::files`]).
#[derive(Debug, Default)]
pub struct BootFiles {
    /// The kernel as configured.
    pub kernel: Option<std::fs::File>,
    /// The ELF its LZ4 payload unpacks to, from the daemon's cache.
    pub unpacked_kernel: Option<std::fs::File>,
    /// The initrd.
    pub initrd: Option<std::fs::File>,
}

/// Where and how the boot vCPU starts; returned by [`configure_linux`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootEntry {
    /// The 64-bit entry point (RIP).
    pub entry: GuestAddress,
    /// The zero page (RSI).
    pub zero_page: GuestAddress,
    /// Kernel format.
    pub kind: KernelKind,
    /// Kernel image in guest memory `[start, end)`.
    pub kernel: (u64, u64),
    /// initrd `(address, size)`.
    pub initrd: Option<(u64, u64)>,
    /// The RSDP.
    pub rsdp: GuestAddress,
}

impl BootEntry {
    #[cfg(test)]
    pub(crate) fn for_test(entry: u64) -> Self {
        Self {
            entry: GuestAddress(entry),
            zero_page: GuestAddress(ZERO_PAGE_ADDR),
            kind: KernelKind::BzImage,
            kernel: (KERNEL_LOAD_ADDR, KERNEL_LOAD_ADDR + 0x1000),
            initrd: None,
            rsdp: GuestAddress(RSDP_ADDR),
        }
    }
}

/// Errors from preparing a Linux boot; each message is one sentence naming
/// the file (if any) and the reason.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel or initrd cannot be opened or read.
    #[error("cannot read {what} {}: {reason}", path.display())]
    Unreadable {
        /// "kernel" or "initrd".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The kernel file is not a bzImage or an x86-64 ELF kernel.
    #[error("kernel {} is not a bzImage or ELF kernel: {reason}", path.display())]
    NotAKernel {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A kernel k7d cannot boot (truncated, 32-bit, too old, loader error).
    #[error("kernel {} cannot be booted: {reason}", path.display())]
    BadKernel {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Not enough RAM below the MMIO hole for the kernel.
    #[error(
        "kernel {} needs guest RAM up to {need_mib} MiB to decompress and run but RAM below the MMIO hole ends at {have_mib} MiB",
        path.display()
    )]
    KernelTooBig {
        /// The file.
        path: PathBuf,
        /// MiB of RAM needed from address 0.
        need_mib: u64,
        /// MiB of RAM below the hole.
        have_mib: u64,
    },
    /// The initrd cannot be placed or loaded.
    #[error("initrd {} cannot be loaded: {reason}", path.display())]
    Initrd {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The command line is refused.
    #[error("the kernel command line is invalid: {0}")]
    Cmdline(String),
    /// The VM shape does not fit the boot layout.
    #[error("the guest layout is unsupported: {0}")]
    Layout(String),
    /// ACPI tables.
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    /// A write into guest memory failed.
    #[error("writing the {what} into guest memory failed: {reason}")]
    Memory {
        /// What was written.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

/// Least RAM below the hole: boot structures, BIOS area and a little above 1 MiB.
pub const MIN_LOW_RAM: u64 = 2 << 20;
/// Most vCPUs (APIC ids 0..254; 255 is the xAPIC broadcast id).
pub const MAX_VCPUS: u32 = 254;

/// Prepares guest memory for booting Linux: kernel, initrd, command line,
/// ACPI tables, GDT/IDT/TSS, identity page tables and the zero page. Call
/// once guest RAM exists and before any vCPU runs; a bad kernel or initrd is
/// refused here with one sentence.
pub fn configure_linux(mem: &GuestMemoryMmap, cfg: &LinuxBootConfig) -> Result<BootEntry, BootError> {
    if cfg.vcpus == 0 || cfg.vcpus > MAX_VCPUS {
        return Err(BootError::Layout(format!(
            "{} vCPUs requested, 1 to {MAX_VCPUS} are supported",
            cfg.vcpus
        )));
    }
    let regions: Vec<(u64, u64)> = mem.iter().map(|r| (r.start_addr().0, r.len())).collect();
    let low_end = regions
        .iter()
        .find(|(start, _)| *start == 0)
        .map(|(_, len)| *len)
        .unwrap_or(0);
    if low_end < MIN_LOW_RAM {
        return Err(BootError::Layout(format!(
            "guest RAM at address 0 is {} KiB, Linux needs at least {} MiB",
            low_end >> 10,
            MIN_LOW_RAM >> 20
        )));
    }

    let kernel = boot::load_kernel(mem, cfg.kernel, low_end, cfg.kernel_cache, cfg.files)?;
    let header = kernel.info.header;
    let initrd = match cfg.initrd {
        Some(path) => {
            let max_addr = u64::from(header.initrd_addr_max);
            let max_end = if max_addr == 0 {
                low_end
            } else {
                low_end.min(max_addr + 1)
            };
            let min_start = kernel.end.max(kernel.info.needs_ram_to);
            Some(boot::load_initrd(mem, path, min_start, max_end, cfg.files)?)
        }
        None => None,
    };
    boot::write_cmdline(mem, cfg.cmdline, header.cmdline_size)?;

    let acpi_cfg = AcpiConfig {
        vcpus: cfg.vcpus,
        pci: cfg.pci.clone(),
        irq0_override: cfg.irq0_override,
        vmgenid: cfg.vmgenid,
    };
    let rsdp = acpi::create_acpi_tables(mem, &acpi_cfg)?;
    regs::write_entry_structures(mem).map_err(|e| BootError::Memory {
        what: "boot GDT and page tables",
        reason: e.to_string(),
    })?;
    let ecam = cfg.pci.as_ref().filter(|p| p.ecam).map(|_| ecam_described());
    let e820 = e820_map(&regions, ecam);
    boot::write_boot_params(mem, header, initrd, &e820, rsdp)?;
    Ok(BootEntry {
        entry: GuestAddress(kernel.entry),
        zero_page: GuestAddress(ZERO_PAGE_ADDR),
        kind: kernel.info.kind,
        kernel: (kernel.load, kernel.end),
        initrd,
        rsdp: GuestAddress(rsdp),
    })
}

#[cfg(test)]
mod tests;

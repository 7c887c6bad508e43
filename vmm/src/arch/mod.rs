//! Architecture support. Today: booting stock Linux guests on x86_64
//! ([`x86_64`]): guest layout, kernel/initrd loading, `boot_params`, the
//! 64-bit entry state, CPUID, boot MSRs, ACPI tables and the ACPI PM device.
//! The real-mode test guests keep using [`crate::vstate::vcpu`].

#[cfg(target_arch = "x86_64")]
pub mod x86_64;

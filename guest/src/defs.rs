//! Layout, parameters and program names shared by the guest programs (built
//! at compile time by `build.rs`) and the crate's users. No assembler here.

#![allow(dead_code)]

use thiserror::Error;

/// Where a program is loaded and where the BSP starts (`cs = 0`).
pub const LOAD_ADDR: u64 = 0x8000;
/// Where the AP starts after INIT/SIPI (vector `AP_ENTRY_ADDR >> 12`).
pub const AP_ENTRY_ADDR: u64 = 0x9000;
/// Parameter block written by the VMM (little-endian u32 slots).
pub const PARAMS_ADDR: u64 = 0x500;
/// Results block written by the guest (little-endian u32 slots).
pub const RESULTS_ADDR: u64 = 0x600;

/// Offsets inside the parameter block.
pub mod param {
    /// TSC ticks per millisecond (the VMM writes `KVM_GET_TSC_KHZ`).
    pub const TSC_PER_MS: u64 = 0x0;
    /// First program argument.
    pub const ARG0: u64 = 0x4;
    /// Second program argument.
    pub const ARG1: u64 = 0x8;
    /// Third program argument.
    pub const ARG2: u64 = 0xC;
}

/// Offsets inside the results block.
pub mod result {
    /// Timer ticks counted by the BSP (`pit`, `tscdeadline`, `smp`).
    pub const BSP_TICKS: u64 = 0x0;
    /// Set to 1 by the AP once it runs (`smp`).
    pub const AP_UP: u64 = 0x4;
    /// Timer ticks counted by the AP (`smp`).
    pub const AP_TICKS: u64 = 0x8;
    /// Set to 1 once `memwriter` has written its whole pattern.
    pub const PATTERN_DONE: u64 = 0xC;
    /// `memwriter`'s loop counter, incremented forever after the pattern.
    pub const LOOP_COUNTER: u64 = 0x10;
}

/// Number of program arguments the parameter block holds.
pub const MAX_ARGS: usize = 3;

/// Errors from building a guest program.
#[derive(Debug, Error)]
pub enum GuestError {
    /// The name is not one of [`BUILTIN_NAMES`].
    #[error("unknown built-in guest `{0}` (known: hello, idle, pit, tscdeadline, memwriter, smp, fault)")]
    Unknown(String),
    /// iced-x86 refused the program (a bug in this crate).
    #[error("assembling the `{name}` guest failed: {msg}")]
    Assemble {
        /// The program.
        name: &'static str,
        /// iced's message.
        msg: String,
    },
}

/// The built-in guest programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// Prints [`HELLO_TEXT`] on the serial port, then resets the machine (i8042).
    Hello,
    /// Prints `idle\n`, then halts forever with interrupts off (a VM that stays running).
    Idle,
    /// Programs the PIC and the PIT at 1 kHz and counts IRQ0 ticks into `BSP_TICKS`.
    Pit,
    /// Enables x2APIC through MSRs and counts TSC-deadline interrupts (1 per ms) into `BSP_TICKS`.
    TscDeadline,
    /// Fills `ARG0` pages from `ARG1` with [`memwriter_pattern`], sets `PATTERN_DONE`,
    /// then increments `LOOP_COUNTER` forever; with `ARG2 != 0` the loop also
    /// writes the counter into the first dword of page `counter % ARG0`.
    MemWriter,
    /// The BSP wakes the AP with INIT/SIPI through the x2APIC ICR; both print on
    /// serial, then each counts its own TSC-deadline ticks (1 per ms).
    Smp,
    /// Enters 32-bit protected mode and `iret`s into a `ud2` with no IDT: the
    /// error-path guest. PVM's emulator cannot `iret` in protected mode
    /// (`KVM_EXIT_INTERNAL_ERROR`); VMX/SVM triple-fault (`KVM_EXIT_SHUTDOWN`).
    Fault,
}

/// The text the `hello` guest prints.
pub const HELLO_TEXT: &str = "Hello from the k7d test guest!\n";

/// Names accepted by [`Builtin::from_name`].
pub const BUILTIN_NAMES: [&str; 7] = ["hello", "idle", "pit", "tscdeadline", "memwriter", "smp", "fault"];

impl Builtin {
    /// Parses a built-in guest name.
    pub fn from_name(name: &str) -> Result<Self, GuestError> {
        Ok(match name {
            "hello" => Self::Hello,
            "idle" => Self::Idle,
            "pit" => Self::Pit,
            "tscdeadline" => Self::TscDeadline,
            "memwriter" => Self::MemWriter,
            "smp" => Self::Smp,
            "fault" => Self::Fault,
            other => return Err(GuestError::Unknown(other.to_string())),
        })
    }

    /// The program's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hello => "hello",
            Self::Idle => "idle",
            Self::Pit => "pit",
            Self::TscDeadline => "tscdeadline",
            Self::MemWriter => "memwriter",
            Self::Smp => "smp",
            Self::Fault => "fault",
        }
    }

    /// How many vCPUs the program needs at least.
    pub fn min_vcpus(self) -> u8 {
        match self {
            Self::Smp => 2,
            _ => 1,
        }
    }
}

/// The dword `memwriter` stores across page `page` (index from `ARG1`).
pub fn memwriter_pattern(page: u32) -> u32 {
    page ^ 0x9e37_79b9
}

/// Size of the `-bios` image of `hello` (for the QEMU side of benchmarks).
pub const BIOS_IMAGE_SIZE: usize = 64 * 1024;

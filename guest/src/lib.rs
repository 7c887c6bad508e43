//! Small purpose-built guests for k7d's host-level tests.
//!
//! The host KVM on the development machines is PVM: stock Linux does not boot
//! there, real-mode code does (see `docs/testing.md`). These guests are 16-bit
//! real-mode programs assembled here, in Rust, with iced-x86's `code_asm`, so
//! building k7d needs no external assembler. Each program is loaded at
//! [`LOAD_ADDR`] and entered with `cs = 0, ip = LOAD_ADDR`.
//!
//! Guest memory layout shared by the VMM, the programs and the tests:
//!
//! | address | what |
//! |---|---|
//! | `0x0000..0x0400` | real-mode IVT (the guests install their handlers) |
//! | [`PARAMS_ADDR`] | parameters written by the VMM before the first instruction |
//! | [`RESULTS_ADDR`] | counters and flags written by the guest, read by tests |
//! | `0x6000`, `0x7000` | AP and BSP stack tops |
//! | [`LOAD_ADDR`] | program entry (BSP) |
//! | [`AP_ENTRY_ADDR`] | application-processor entry (SIPI vector `0x09`) |

mod programs;

pub use programs::{BIOS_IMAGE_SIZE, hello_bios_image, memwriter_pattern};

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
    #[error("unknown built-in guest `{0}` (known: hello, idle, pit, tscdeadline, memwriter, smp)")]
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
}

/// The text the `hello` guest prints.
pub const HELLO_TEXT: &str = "Hello from the k7d test guest!\n";

/// Names accepted by [`Builtin::from_name`].
pub const BUILTIN_NAMES: [&str; 6] = ["hello", "idle", "pit", "tscdeadline", "memwriter", "smp"];

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
        }
    }

    /// How many vCPUs the program needs at least.
    pub fn min_vcpus(self) -> u8 {
        match self {
            Self::Smp => 2,
            _ => 1,
        }
    }

    /// Assembles the program: bytes to load at [`LOAD_ADDR`] (for `smp` the
    /// image is longer than `AP_ENTRY_ADDR - LOAD_ADDR` and carries the AP code
    /// at that offset).
    pub fn image(self) -> Result<Vec<u8>, GuestError> {
        programs::build(self)
    }
}

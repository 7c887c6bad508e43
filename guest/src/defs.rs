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
    /// `uart`: COM1 interrupts taken.
    pub const SERIAL_IRQS: u64 = 0x14;
    /// `drill`: the drill device's answer to the last command, as read
    /// from its port: a status dword ([`super::drill`]), then 16 bytes.
    pub const DRILL_ANSWER: u64 = 0x40;
    /// `drill`: commands carried out so far.
    pub const DRILL_DONE: u64 = 0x54;
}

/// The escape drill's device (only in a k7d built with the test-only
/// `escape-drill` feature; `vmm/src/drill.rs`): its ports and commands.
pub mod drill {
    /// Command port (a byte write runs the command).
    pub const PORT: u16 = 0x7d0;
    /// Answer port (bytes read in turn: [`super::result::DRILL_ANSWER`]'s 20).
    pub const ANSWER_PORT: u16 = 0x7d1;
    /// Address port, low dword.
    pub const ADDR_LO_PORT: u16 = 0x7d2;
    /// Address port, high dword.
    pub const ADDR_HI_PORT: u16 = 0x7d6;
    /// Bytes of an answer.
    pub const ANSWER_LEN: u32 = 20;
    /// Read 16 bytes of the VMM process at the address.
    pub const CMD_READ: u32 = 1;
    /// Open `/etc/passwd` from the VMM process.
    pub const CMD_OPEN: u32 = 2;
    /// TCP connect to 127.0.0.1 at the port in the address's low 16 bits.
    pub const CMD_CONNECT: u32 = 3;
    /// Panic on the vCPU thread (a device model's bug that is caught).
    pub const CMD_PANIC: u32 = 4;
    /// Status: done (read, opened, connected).
    pub const DONE: u32 = 1;
    /// Status: the address is not mapped in the VMM process.
    pub const UNMAPPED: u32 = 2;
    /// Status: the call failed.
    pub const FAILED: u32 = 3;
}

/// Number of program arguments the parameter block holds.
pub const MAX_ARGS: usize = 3;

/// Errors from building a guest program.
#[derive(Debug, Error)]
pub enum GuestError {
    /// The name is not one of [`BUILTIN_NAMES`].
    #[error("unknown built-in guest `{0}` (known: hello, idle, pit, tscdeadline, memwriter, smp, fault, drill)")]
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
    /// The escape drill's attacker (issue 36): waits for a command in
    /// `ARG2` (the test writes `ARG0`/`ARG1`, the address, first), hands it
    /// to the drill device's ports, stores the answer at `DRILL_ANSWER`,
    /// clears `ARG2` and counts `DRILL_DONE`; forever.
    Drill,
    /// Routes COM1's IRQ4 through the IOAPIC to the x2APIC (PICs masked),
    /// turns on COM1's THR-empty interrupt (one interrupt: nothing more is
    /// written) and counts COM1 interrupts into `SERIAL_IRQS`, each
    /// acknowledged by an IIR read, as Linux's 8250 driver does.
    Uart,
}

/// The text the `hello` guest prints.
pub const HELLO_TEXT: &str = "Hello from the k7d test guest!\n";

/// Names accepted by [`Builtin::from_name`].
pub const BUILTIN_NAMES: [&str; 9] = [
    "hello",
    "idle",
    "pit",
    "tscdeadline",
    "memwriter",
    "smp",
    "fault",
    "drill",
    "uart",
];

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
            "drill" => Self::Drill,
            "uart" => Self::Uart,
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
            Self::Drill => "drill",
            Self::Uart => "uart",
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

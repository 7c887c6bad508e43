//! What a VM reports about itself: its state and why it stopped, its
//! devices, how its fork children reseed their RNGs, its guest RAM as the
//! host holds it, and what a re-base did. The runtime (`k7d-vmm`) makes
//! these; the API carries them.

use serde::{Deserialize, Serialize};

/// The states a VM moves through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum VmState {
    /// Built, not started.
    Created,
    /// vCPUs running.
    Running,
    /// vCPUs parked.
    Paused,
    /// vCPUs gone; why.
    Stopped {
        /// Why.
        reason: StopReason,
    },
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Created => f.write_str("created"),
            Self::Running => f.write_str("running"),
            Self::Paused => f.write_str("paused"),
            Self::Stopped { reason } => write!(f, "stopped ({reason})"),
        }
    }
}

/// One device as wired in this VM (reported by `info`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Kind (`serial`, `i8042`, ...).
    pub kind: String,
    /// Where the guest finds it.
    pub location: String,
    /// Backend details.
    pub detail: String,
}

/// How a VM's fork children (and its restores) come to draw random numbers
/// of their own (`docs/fork.md`, "What a child shares").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RngReseed {
    /// The guest's vmgenid driver reads the VM Generation ID: its kernel
    /// reseeds its RNG as a child or a restored VM first runs.
    Vmgenid,
    /// The VM has the device, but its guest has not bound a driver for it
    /// (not yet, or its kernel has none: Debian's cloud kernel).
    NoDriver,
    /// The VM has no VM Generation ID device.
    Off,
    /// Its guest has no vmgenid driver but k7d-agent answers in it: the
    /// daemon reseeds a fork child's or a restored VM's kernel RNG through
    /// the agent before it answers (the daemon's word, never a VM's own).
    Agent,
}

impl RngReseed {
    /// What it means for the VM's fork children, in one sentence.
    pub fn describe(self) -> &'static str {
        match self {
            RngReseed::Vmgenid => {
                "vmgenid: a fork child's or a restored guest's kernel reseeds its RNG before it runs on"
            }
            RngReseed::NoDriver => {
                "none: the guest has no vmgenid driver bound, so fork children draw the same random numbers until their kernels reseed on their own"
            }
            RngReseed::Off => {
                "none: the VM has no VM Generation ID device, so fork children draw the same random numbers until their kernels reseed on their own"
            }
            RngReseed::Agent => {
                "agent: k7d-agent in the guest reseeds a fork child's or a restored VM's kernel RNG with host entropy before the fork or restore answers"
            }
        }
    }
}

/// Why a VM stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StopReason {
    /// The guest reset the machine, i.e. rebooted (i8042 `0xfe`, the ACPI reset
    /// register, or `KVM_SYSTEM_EVENT_RESET`). Shown as "guest reboot".
    GuestReset,
    /// The guest powered off (`KVM_SYSTEM_EVENT_SHUTDOWN`).
    GuestPoweroff,
    /// Someone asked k7d to stop the VM.
    Requested,
    /// A vCPU stopped the VM on an exit k7d cannot continue from.
    VcpuError {
        /// The vCPU.
        vcpu: u32,
        /// The exit (`KVM_EXIT_SHUTDOWN`, ...).
        exit: String,
        /// One sentence naming the VM, the vCPU and the exit.
        message: String,
    },
    /// A thread of the VM (a vCPU or a device worker) made a system call its
    /// seccomp filter denies.
    SeccompDenied {
        /// The thread's name.
        thread: String,
        /// The call's number (x86_64).
        syscall: i64,
        /// One sentence naming the VM, the thread and the call.
        message: String,
    },
    /// The VM's process ended without being asked to (killed, crashed):
    /// what its daemon saw.
    ProcessEnded {
        /// One sentence naming the VM, its process and how it ended.
        message: String,
    },
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GuestReset => f.write_str("guest reboot"),
            Self::GuestPoweroff => f.write_str("guest poweroff"),
            Self::Requested => f.write_str("stop requested"),
            Self::VcpuError { message, .. } | Self::SeccompDenied { message, .. } | Self::ProcessEnded { message } => {
                f.write_str(message)
            }
        }
    }
}

impl StopReason {
    /// Its kind, as its serialized `kind` tag names it (a metrics label).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::GuestReset => "guest_reset",
            Self::GuestPoweroff => "guest_poweroff",
            Self::Requested => "requested",
            Self::VcpuError { .. } => "vcpu_error",
            Self::SeccompDenied { .. } => "seccomp_denied",
            Self::ProcessEnded { .. } => "process_ended",
        }
    }

    /// Whether the guest ended on its own terms (exit status 0 for `k7d run`).
    pub fn is_clean(&self) -> bool {
        !matches!(
            self,
            Self::VcpuError { .. } | Self::SeccompDenied { .. } | Self::ProcessEnded { .. }
        )
    }
}

/// A VM's guest RAM as the host holds it (bytes): `guest_ram`'s answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestRamUsage {
    /// The VM.
    pub id: String,
    /// Resident pages of its RAM mapping.
    pub resident: u64,
    /// Of those, its own copies: pages it wrote since its fork (for a VM
    /// that is no fork child, none: its RAM is its own memfd's).
    pub copied: u64,
    /// Its proportional share of the resident pages.
    pub pss: u64,
}

impl GuestRamUsage {
    /// The part of the resident pages still shared with its fork base.
    pub fn shared(&self) -> u64 {
        self.resident.saturating_sub(self.copied)
    }
}

/// What a re-base did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rebased {
    /// VM id.
    pub id: String,
    /// What the VM had diverged from its old base (MiB), which its next
    /// fork would have copied into the child.
    pub diverged_mib: f64,
    /// What the new base holds (MiB allocated): the old base's data and
    /// every page the VM wrote since.
    pub base_mib: f64,
    /// Pages written again because the VM wrote them during the pre-copy.
    pub recopied_pages: u64,
    /// Pre-copy rounds while the VM ran.
    pub rounds: u32,
    /// How long the VM stood still for the last round and the remap
    /// (zero for a VM that was paused already; with
    /// `Vm::rebase_and_hold`, up to its return).
    pub paused_ms: f64,
    /// The whole re-base.
    pub took_ms: f64,
}

//! The channel between a VM process and its caller: one JSON object per
//! line each way, a request answered by exactly one reply. The first
//! exchange is [`Request::Hello`] / [`Reply::Hello`] with [`VERSION`]; a
//! caller of another version is refused with a sentence, never guessed at.

use serde::{Deserialize, Serialize};

use crate::config::VmConfig;
use crate::vstate::vm::VmState;

/// The channel's version.
pub const VERSION: u32 = 1;

/// What the caller asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first request: the caller's channel version.
    Hello {
        /// [`VERSION`] of the caller.
        version: u32,
    },
    /// Build the VM (once).
    Build {
        /// Its id.
        id: String,
        /// Its config (built-in guests only, for now).
        config: Box<VmConfig>,
    },
    /// Build the VM (once) as a fork child of the fork instant another VM
    /// process exported ([`Reply::Captured`]): its base and diverged-pages
    /// memfds come with the request, in that order.
    BuildFork {
        /// Its id.
        id: String,
        /// Its config (the source's, with this id).
        config: Box<VmConfig>,
        /// The source's machine state at the fork instant (JSON).
        state: String,
        /// The pages in the diverged-pages memfd (bitmap words over the
        /// whole RAM).
        diverged: Vec<u64>,
    },
    /// Export this paused VM's fork instant: [`Reply::Captured`].
    Capture,
    /// Start its vCPUs.
    Start,
    /// Pause every vCPU and device.
    Pause,
    /// Resume.
    Resume,
    /// Read `count` u32 words of guest RAM at `addr` (at most 1024).
    Peek {
        /// Guest physical address.
        addr: u64,
        /// Words.
        count: u32,
    },
    /// The VM's state.
    Status,
    /// Stop the VM; the process exits after the reply.
    Stop,
}

/// What the VM process answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// To [`Request::Hello`].
    Hello {
        /// [`VERSION`] of the VM process.
        version: u32,
        /// Its pid in its own pid namespace (1).
        pid: u32,
        /// The id of the VM it holds, once built: what a caller that
        /// re-attaches checks against its record.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vm: Option<String>,
    },
    /// Done.
    Ok,
    /// To [`Request::Capture`]: the fork instant; the base and the
    /// diverged-pages memfds come with the reply, in that order.
    Captured {
        /// The machine state (JSON).
        state: String,
        /// The pages in the diverged-pages memfd.
        diverged: Vec<u64>,
    },
    /// Words read.
    Peeked {
        /// The words.
        words: Vec<u32>,
    },
    /// The VM's state and the figures `k7d info` shows.
    Status {
        /// The state.
        state: VmState,
        /// vCPU exits so far.
        exits: u32,
        /// Milliseconds since its vCPUs started.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ms_since_start: Option<u64>,
        /// Microseconds from the start to the first vCPU exit.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        first_exit_us_after_start: Option<u64>,
    },
    /// Refused or failed: one sentence.
    Error {
        /// The sentence.
        message: String,
    },
}

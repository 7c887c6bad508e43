//! The channel between a VM process and its caller: one JSON object per
//! line each way, a request answered by exactly one reply. The first
//! exchange is [`Request::Hello`] / [`Reply::Hello`] with [`VERSION`]; a
//! caller of another version is refused with a sentence, never guessed at.
//! A request added later is no new version: a VM process that does not
//! know it answers it with an error (`runtime.rs`), and keeps serving.

use serde::{Deserialize, Serialize};

use std::path::PathBuf;

use crate::config::VmConfig;
use crate::vstate::handed::FileRole;
use crate::vstate::vm::{DeviceInfo, VmState};

/// The channel's version (2: builds carry their files, status its
/// devices).
pub const VERSION: u32 = 2;

/// How a VM process's error reply to a request it does not know begins
/// (one added after it was built): its caller may then ask the older way.
pub const UNKNOWN_REQUEST: &str = "the request is not one this VM process knows";

/// What the caller asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first request: the caller's channel version.
    Hello {
        /// [`VERSION`] of the caller.
        version: u32,
    },
    /// Build the VM (once). Its host files come with the request as
    /// descriptors, in the order `files` names them, then (a spare's) its
    /// listening socket.
    Build {
        /// Its id.
        id: String,
        /// Its config.
        config: Box<VmConfig>,
        /// What each descriptor is.
        #[serde(default)]
        files: Vec<FileRole>,
        /// The serial log's path, for what `info` shows (the file itself
        /// is handed over).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        serial_log: Option<PathBuf>,
        /// The daemon's node settings (a NIC's queues are planned from
        /// them, by the daemon that made its tap and by the VM process).
        #[serde(default)]
        node: crate::config::NodeConfig,
    },
    /// Build the VM (once) as a fork child of the fork instant another VM
    /// process exported ([`Reply::Captured`]): its base and diverged-pages
    /// memfds come with the request, in that order, then its files as for
    /// [`Request::Build`], then (a spare's) its listening socket.
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
        /// What each file descriptor after the two memfds is.
        #[serde(default)]
        files: Vec<FileRole>,
        /// The serial log's path (as for [`Request::Build`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        serial_log: Option<PathBuf>,
        /// Its read-write disks' overlays' present clusters (their frozen
        /// bases and its own overlays come among `files`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disks: Vec<crate::vstate::fork::ExportedDisk>,
    },
    /// Build the VM (once) from a snapshot the caller opened and verified:
    /// its guest RAM, a memfd the caller filled from the snapshot's memory
    /// file, comes with the request first, then its files as for
    /// [`Request::Build`] (no guest files: its RAM holds its guest), then
    /// (a spare's) its listening socket.
    BuildRestored {
        /// Its id.
        id: String,
        /// The snapshot's config, with this id.
        config: Box<VmConfig>,
        /// The snapshot's machine state (JSON).
        state: String,
        /// What each file descriptor after the RAM memfd is.
        #[serde(default)]
        files: Vec<FileRole>,
        /// The serial log's path (as for [`Request::Build`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        serial_log: Option<PathBuf>,
        /// The daemon's node settings (as for [`Request::Build`]).
        #[serde(default)]
        node: crate::config::NodeConfig,
    },
    /// Export this paused VM's fork instant: [`Reply::Captured`].
    Capture,
    /// [`Request::Capture`] of a VM with read-write disks: for each disk
    /// of `disks`, in order, two new overlay files come with the request
    /// (the source's own, taken at its first fork, and the children's),
    /// and with `bases` a third, the image opened again read-only, which
    /// takes the place of the source's read-write descriptor of its frozen
    /// base: [`Reply::Captured`] with its `disks`.
    CaptureDisks {
        /// The read-write disks, by their place in the config's disks.
        disks: Vec<u16>,
        /// Whether each disk's read-only base comes too (absent: from a
        /// daemon before it, two files per disk).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        bases: bool,
    },
    /// A single fork's whole source side in one round trip: pause it if
    /// it runs, export its fork instant (as [`Request::Capture`], or as
    /// [`Request::CaptureDisks`] with its files when `disks` names any),
    /// and resume it if it ran: [`Reply::Captured`] with `pause_us` and
    /// `still_us`. (A cluster fork pauses every member before it exports
    /// any, so it asks for each step.)
    CaptureLive {
        /// The read-write disks, as for [`Request::CaptureDisks`].
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disks: Vec<u16>,
        /// As for [`Request::CaptureDisks`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        bases: bool,
    },
    /// What a snapshot of this paused VM is written from, by the caller
    /// (a VM process reaches no directory): [`Reply::SnapshotParts`].
    SnapshotParts,
    /// Re-base this fork source ([`crate::Vm::rebase`]): [`Reply::Rebased`].
    Rebase,
    /// How far this VM diverged from its fork base, for the daemon's
    /// threshold re-base: [`Reply::Divergence`].
    Divergence,
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
    /// Put another medium in read-only disk `disk` (none: empty it). The
    /// file, opened read-only by the caller, comes with the request.
    Medium {
        /// The disk's place in the config's disks.
        disk: u32,
        /// The new medium's path (what `info` shows), or none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        path: Option<PathBuf>,
    },
    /// What its guest RAM costs (from its own smaps: the daemon cannot
    /// read a VM process's): [`Reply::GuestRam`].
    GuestRam,
    /// The VM's state.
    Status,
    /// Stop the VM; the process exits after the reply.
    Stop,
}

/// What the VM process answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
        /// Its read-write disks' children's overlays ([`Request::CaptureDisks`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disks: Vec<crate::vstate::fork::ExportedDisk>,
        /// To [`Request::CaptureLive`]: microseconds until every vCPU
        /// stood still (0 when it was not running).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pause_us: Option<u64>,
        /// To [`Request::CaptureLive`]: microseconds from the request to
        /// the resume (the whole capture when it was not running).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        still_us: Option<u64>,
    },
    /// To [`Request::SnapshotParts`]: the machine state, and the guest
    /// RAM as descriptors: its memfd alone, or (`diverged` given: a fork
    /// source's RAM) the frozen base and the diverged-pages memfd, in that
    /// order, as for [`Reply::Captured`].
    SnapshotParts {
        /// The machine state (JSON).
        state: String,
        /// The pages in the diverged-pages memfd, for a fork source.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        diverged: Option<Vec<u64>>,
    },
    /// To [`Request::Rebase`]: what the re-base did.
    Rebased(crate::vstate::rebase::Rebased),
    /// To [`Request::Divergence`]: the pages that differ from its fork
    /// base, or none when it was never forked or neither runs nor is
    /// paused (nothing to re-base).
    Divergence {
        /// The pages (4 KiB).
        pages: Option<u64>,
    },
    /// To [`Request::GuestRam`], in bytes.
    GuestRam {
        /// Resident pages of its guest RAM.
        resident: u64,
        /// Of those, its own copies (written since its fork).
        copied: u64,
        /// Its proportional share.
        pss: u64,
        /// The whole process's resident set (guest RAM included).
        #[serde(default)]
        process_rss: u64,
        /// The whole process's proportional share.
        #[serde(default)]
        process_pss: u64,
    },
    /// Words read.
    Peeked {
        /// The words.
        words: Vec<u32>,
    },
    /// The VM's state and the figures `k7d info` shows (the fields of
    /// [`VmStatus`] beside the tag, as a struct variant's would be).
    Status(VmStatus),
    /// Refused or failed: one sentence.
    Error {
        /// The sentence.
        message: String,
    },
}

/// A VM's state and the figures `k7d info` shows, as its VM process
/// reports them ([`Reply::Status`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStatus {
    /// The state.
    pub state: VmState,
    /// vCPU exits so far.
    pub exits: u32,
    /// Milliseconds since its vCPUs started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ms_since_start: Option<u64>,
    /// Microseconds from the start to the first vCPU exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_exit_us_after_start: Option<u64>,
    /// Its devices, as `info` lists them.
    #[serde(default)]
    pub devices: Vec<DeviceInfo>,
    /// Whether its fork children reseed their RNGs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng_reseed: Option<crate::RngReseed>,
    /// Its VM Generation ID (hex), when it has the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmgenid: Option<String>,
    /// Re-bases so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rebases: u64,
    /// vCPU exits by kind (`Vm::exits_by_reason`); a VM process of an
    /// earlier k7d sends none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exits_by_reason: Vec<(String, u64)>,
    /// Its devices' counters (`Vm::device_counters`); a VM process of an
    /// earlier k7d sends none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_counters: Vec<(String, Vec<(String, u64)>)>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl VmStatus {
    /// A VM that stopped for `reason`, with nothing more to say.
    pub fn stopped(reason: crate::vstate::control::StopReason) -> Self {
        Self {
            state: VmState::Stopped { reason },
            exits: 0,
            ms_since_start: None,
            first_exit_us_after_start: None,
            devices: Vec::new(),
            rng_reseed: None,
            vmgenid: None,
            rebases: 0,
            exits_by_reason: Vec::new(),
            device_counters: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_reply_is_one_object_with_its_fields_beside_the_tag() {
        let r = Reply::Status(VmStatus {
            exits: 7,
            ..VmStatus::stopped(crate::vstate::control::StopReason::Requested)
        });
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            r#"{"reply":"status","state":{"state":"stopped","reason":{"kind":"requested"}},"exits":7,"devices":[]}"#
        );
        assert_eq!(serde_json::from_str::<Reply>(&line).unwrap(), r);
        // A field this side does not know is refused, not dropped.
        let extra = line.replace(r#""exits":7"#, r#""exits":7,"cpu":1"#);
        assert!(serde_json::from_str::<Reply>(&extra).is_err());
    }
}

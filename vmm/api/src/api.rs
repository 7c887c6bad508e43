//! The daemon's JSON API, version 1: every request and every result as a
//! serde type, shared by the daemon (which parses requests and writes
//! results) and its clients, the CLI and the containerd shim (which write
//! requests and read results).
//!
//! Transport: a unix stream socket; one request per line, one response line
//! per request. A request is `{"v":1,"op":"<verb>","args":{...}}` ([`Request`]
//! is the `op`/`args` part); a response is `{"v":1,"ok":true,"result":...}`
//! or `{"v":1,"ok":false,"error":{"code":"...","message":"..."}}`, and the
//! result of each op has one type ([`Reply::from_result`] names it).
//! Unknown fields in a request are refused, so a typo never silently does
//! less.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::VmConfig;
use crate::state::{DeviceInfo, VmState};

/// Most children one `fork` request makes.
pub const MAX_FORKS: u32 = 64;

/// Most members a cluster has.
pub const MAX_CLUSTER_MEMBERS: usize = 16;

/// Most words one `peek` request reads.
pub const MAX_PEEK_WORDS: u32 = 1024;

/// The API version this daemon speaks.
pub const API_VERSION: u32 = 1;

/// Most bytes of stdin one `exec` carries (decoded; base64 on the wire,
/// so the request line stays under the server's 1 MiB).
pub const MAX_EXEC_STDIN: usize = 512 << 10;

/// Most bytes of each output stream an `exec` answer carries; the rest is
/// counted (`stdout_bytes`, `stderr_bytes`), not kept.
pub const MAX_EXEC_OUTPUT: usize = 4 << 20;

/// `exec`'s timeout when none is given, in seconds.
pub const DEFAULT_EXEC_TIMEOUT_S: f64 = 600.0;

/// `exec`'s longest timeout, in seconds (a day).
pub const MAX_EXEC_TIMEOUT_S: f64 = 86_400.0;

/// A request: its `op` and its `args`, as they travel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Build a VM (and start it when `start`).
    Create(CreateArgs),
    /// Start a created VM.
    Start(#[serde(with = "id_args")] String),
    /// Park a running VM's vCPUs.
    Pause(#[serde(with = "id_args")] String),
    /// Unpark them.
    Resume(#[serde(with = "id_args")] String),
    /// Stop the vCPUs (the VM stays listed until deleted).
    Stop(#[serde(with = "id_args")] String),
    /// Stop if needed and remove the VM and its record.
    Delete(#[serde(with = "id_args")] String),
    /// One VM's record and live state.
    Info(#[serde(with = "id_args")] String),
    /// Pause a VM if needed, write a cold snapshot to a directory, resume it.
    Snapshot(SnapshotArgs),
    /// Build and start a VM from a snapshot directory.
    Restore(RestoreArgs),
    /// Fork a VM, or every member of a cluster under one pause, `count`
    /// times copy-on-write; the children start running (a cluster's
    /// children of one fork form a cluster of their own).
    Fork(ForkArgs),
    /// Read `count` little-endian u32 words of guest RAM at `addr` (debugging, tests).
    Peek(PeekArgs),
    /// What a VM's guest RAM costs the host: resident, its own copies, PSS
    /// (read from smaps when asked, so not part of `info`, which the
    /// containerd shim polls).
    GuestRam(#[serde(with = "id_args")] String),
    /// Every VM.
    List,
    /// Daemon and API version.
    Version,
    /// Name a set of existing VMs as a cluster.
    ClusterCreate(ClusterArgs),
    /// Add existing VMs to a cluster.
    ClusterAdd(ClusterArgs),
    /// One cluster and its members.
    ClusterInfo(#[serde(with = "id_args")] String),
    /// Delete a cluster and every member VM.
    ClusterDelete(#[serde(with = "id_args")] String),
    /// Every cluster.
    ClusterList,
    /// Give a fork source a new base holding its RAM as it is now (built
    /// while it runs; paused for the last round only), so its next fork
    /// copies only what it writes from now on.
    Rebase(#[serde(with = "id_args")] String),
    /// Put a read-only image into a VM's read-only drive, or take it out
    /// (no path): the guest sees the capacity change.
    Medium(MediumArgs),
    /// Attach a VM's bare NIC (made with `vhost = false`) to a pod's
    /// network through the datapath, running or paused: its tap moves into
    /// the pod netns (a warm pool member claimed by a pod).
    NicAttach(NicAttachArgs),
    /// Run a command in a running VM through its guest agent and answer
    /// when it has ended: stdin whole, stdout and stderr kept apart
    /// (`docs/exec.md`, "In the daemon's API").
    Exec(ExecArgs),
    /// Move a VM's process (`--jail on`) into a leaf of its own under the
    /// pod's cgroup (the kubelet's, as the pod's `cgroup_parent` names it),
    /// so the node's accounting of the pod includes its VM.
    PodCgroup(PodCgroupArgs),
}

/// `exec`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// VM (a fork child or a restored VM alike).
    pub id: String,
    /// The program (looked up in the guest's PATH) and its arguments.
    pub command: Vec<String>,
    /// `KEY=VALUE` entries; PATH is the agent's unless given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// The working directory in the guest (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The user it runs as (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Its group (default: the uid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Its stdin, base64 (at most [`MAX_EXEC_STDIN`] bytes decoded); none:
    /// empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Killed (SIGKILL, status 137) after this many seconds
    /// ([`DEFAULT_EXEC_TIMEOUT_S`] unless given, at most
    /// [`MAX_EXEC_TIMEOUT_S`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Stream the output: before the answer, one line
    /// `{"output":{"stream":"stdout"|"stderr","data":BASE64}}` per chunk as
    /// it comes, all of it; the answer's `stdout` and `stderr` are then
    /// empty (their byte counts still count).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
}

impl ExecArgs {
    /// Its arguments checked, before any guest sees them.
    pub fn validate(&self) -> Result<(), ApiError> {
        validate_exec(self).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e))
    }

    /// The timeout this exec runs under.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_s.unwrap_or(DEFAULT_EXEC_TIMEOUT_S))
    }
}

/// `cluster_create`'s and `cluster_add`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterArgs {
    /// The cluster (VM ids and cluster ids share one namespace).
    pub id: String,
    /// Its member VMs (each in at most one cluster).
    pub members: Vec<String>,
}

/// `create`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// The VM.
    pub config: VmConfig,
    /// Start it right away.
    #[serde(default)]
    pub start: bool,
}

/// `snapshot`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotArgs {
    /// VM.
    pub id: String,
    /// Target directory (created; absolute).
    pub dir: PathBuf,
    /// Replace an existing snapshot at `dir` atomically (otherwise it is
    /// refused and left untouched). Left out of the line when false, so
    /// version-1 lines are unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replace: bool,
}

/// `restore`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreArgs {
    /// Snapshot directory.
    pub dir: PathBuf,
    /// Id of the new VM (generated when absent).
    #[serde(default)]
    pub id: Option<String>,
}

/// `fork`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// Source VM or cluster.
    pub id: String,
    /// Number of children (1 to [`MAX_FORKS`]; for a cluster, forks times
    /// members is at most [`MAX_FORKS`]).
    #[serde(default = "one")]
    pub count: u32,
    /// The child's id (one child of a VM only; default `<id>-f<n>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The child's NIC `i` attached through the datapath to a pod's
    /// network instead of a bare tap (one child of a VM only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<Option<crate::config::DatapathNicConfig>>,
    /// The child's vsock host socket, absolute (one child of a VM only;
    /// default: the source's path with `-<child id>` appended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_uds: Option<PathBuf>,
    /// The caller gives the children their own kernel RNG state itself
    /// (the shim's `Identity` for a fork-started pod): the daemon does not
    /// reseed them through their agents (`docs/fork.md`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reseed_by_caller: bool,
}

/// One child of nothing: set `id` (and what else the fork needs).
impl Default for ForkArgs {
    fn default() -> Self {
        Self {
            id: String::new(),
            count: 1,
            name: None,
            nics: Vec::new(),
            vsock_uds: None,
            reseed_by_caller: false,
        }
    }
}

impl ForkArgs {
    /// Whether this names what its one child gets (name, NICs, socket).
    pub fn shapes_the_child(&self) -> bool {
        self.name.is_some() || !self.nics.is_empty() || self.vsock_uds.is_some()
    }
}

/// `medium`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MediumArgs {
    /// VM.
    pub id: String,
    /// The drive: its index among the VM's disks.
    pub disk: u32,
    /// The image (read-only); none ejects the medium.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
}

/// `nic_attach`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicAttachArgs {
    /// VM.
    pub id: String,
    /// The NIC: its index among the VM's NICs.
    pub nic: u32,
    /// The pod network it joins, and how.
    pub datapath: crate::config::DatapathNicConfig,
}

/// `pod_cgroup`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodCgroupArgs {
    /// VM.
    pub id: String,
    /// The pod's cgroup, as a path from the cgroup v2 root
    /// (`/kubepods/burstable/pod<uid>`).
    pub cgroup_parent: String,
}

/// The longest `cgroup_parent` taken.
pub const MAX_CGROUP_PARENT: usize = 512;

/// Checks a pod's cgroup path: absolute from the cgroup root, plain names
/// (letters, digits, `.`, `_`, `-`, `:`, `@`), no `.` or `..`, at most
/// [`MAX_CGROUP_PARENT`] bytes.
pub fn check_cgroup_parent(p: &str) -> Result<(), String> {
    let Some(rest) = p.strip_prefix('/') else {
        return Err(format!(
            "the pod's cgroup {p:?} is not a path from the cgroup root (it must start with /)"
        ));
    };
    if p.len() > MAX_CGROUP_PARENT {
        return Err(format!(
            "the pod's cgroup path is {} bytes, over {MAX_CGROUP_PARENT}",
            p.len()
        ));
    }
    for c in rest.split('/') {
        let plain = !c.is_empty()
            && c != "."
            && c != ".."
            && c.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-:@".contains(&b));
        if !plain {
            return Err(format!(
                "the pod's cgroup {p:?} has a component {c:?} that is not a plain name"
            ));
        }
    }
    Ok(())
}

/// `peek`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeekArgs {
    /// VM.
    pub id: String,
    /// Guest physical address.
    pub addr: u64,
    /// Words to read (1 to [`MAX_PEEK_WORDS`]).
    #[serde(default = "one")]
    pub count: u32,
}

fn one() -> u32 {
    1
}

/// The `{"id": ...}` arguments of the ops that name one VM, carried as a
/// plain `String` in [`Request`].
mod id_args {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct IdArgs {
        id: String,
    }

    pub fn serialize<S: Serializer>(id: &str, s: S) -> Result<S::Ok, S::Error> {
        IdArgs { id: id.to_string() }.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        IdArgs::deserialize(d).map(|a| a.id)
    }
}

impl Request {
    /// Every op, as named on the wire.
    pub const OPS: [&'static str; 24] = [
        "create",
        "start",
        "pause",
        "resume",
        "stop",
        "delete",
        "info",
        "snapshot",
        "restore",
        "fork",
        "peek",
        "list",
        "version",
        "cluster_create",
        "cluster_add",
        "cluster_info",
        "cluster_delete",
        "cluster_list",
        "rebase",
        "medium",
        "nic_attach",
        "guest_ram",
        "exec",
        "pod_cgroup",
    ];

    /// This request's op, as named on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Self::Create(_) => "create",
            Self::Start(_) => "start",
            Self::Pause(_) => "pause",
            Self::Resume(_) => "resume",
            Self::Stop(_) => "stop",
            Self::Delete(_) => "delete",
            Self::Info(_) => "info",
            Self::Snapshot(_) => "snapshot",
            Self::Restore(_) => "restore",
            Self::Fork(_) => "fork",
            Self::Peek(_) => "peek",
            Self::GuestRam(_) => "guest_ram",
            Self::List => "list",
            Self::Version => "version",
            Self::ClusterCreate(_) => "cluster_create",
            Self::ClusterAdd(_) => "cluster_add",
            Self::ClusterInfo(_) => "cluster_info",
            Self::ClusterDelete(_) => "cluster_delete",
            Self::ClusterList => "cluster_list",
            Self::Rebase(_) => "rebase",
            Self::Medium(_) => "medium",
            Self::NicAttach(_) => "nic_attach",
            Self::Exec(_) => "exec",
            Self::PodCgroup(_) => "pod_cgroup",
        }
    }

    /// Checks what the types alone cannot: VM ids and counts. (A `create`'s
    /// config is validated by the daemon, which knows the host.)
    pub fn validate(&self) -> Result<(), ApiError> {
        let id = |id: &str| {
            crate::config::validate_id(id).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))
        };
        match self {
            Self::Create(_) | Self::List | Self::Version | Self::ClusterList => Ok(()),
            Self::ClusterInfo(v) | Self::ClusterDelete(v) => id(v),
            Self::ClusterCreate(a) | Self::ClusterAdd(a) => {
                id(&a.id)?;
                if a.members.is_empty() || a.members.len() > MAX_CLUSTER_MEMBERS {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "{} members is out of range: a cluster has 1 to {MAX_CLUSTER_MEMBERS}",
                            a.members.len()
                        ),
                    ));
                }
                for m in &a.members {
                    id(m)?;
                }
                Ok(())
            }
            Self::Start(v)
            | Self::Pause(v)
            | Self::Resume(v)
            | Self::Stop(v)
            | Self::Delete(v)
            | Self::Info(v)
            | Self::GuestRam(v)
            | Self::Rebase(v) => id(v),
            Self::Snapshot(a) => id(&a.id),
            Self::Medium(a) => {
                id(&a.id)?;
                if a.path.as_ref().is_some_and(|p| !p.is_absolute()) {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        "a medium's path must be absolute (the daemon's working directory is not the client's)",
                    ));
                }
                Ok(())
            }
            Self::PodCgroup(a) => {
                id(&a.id)?;
                check_cgroup_parent(&a.cgroup_parent).map_err(|m| ApiError::new(ErrorCode::InvalidArgument, m))
            }
            Self::NicAttach(a) => {
                id(&a.id)?;
                if !a.datapath.netns.is_absolute() {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        "a pod network namespace's path must be absolute",
                    ));
                }
                Ok(())
            }
            Self::Restore(a) => a.id.as_deref().map_or(Ok(()), id),
            Self::Fork(a) => {
                id(&a.id)?;
                if a.count == 0 || a.count > MAX_FORKS {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "count = {} is out of range: fork makes 1 to {MAX_FORKS} children at a time",
                            a.count
                        ),
                    ));
                }
                if a.shapes_the_child() && a.count != 1 {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        "a child's name, NICs or vsock socket are given for one child at a time (count 1)",
                    ));
                }
                if let Some(n) = &a.name {
                    id(n)?;
                }
                // One PCI bus: fewer than 32 functions of any kind.
                if a.nics.len() > 32 {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        format!("{} NICs given, a VM has fewer than 32", a.nics.len()),
                    ));
                }
                for d in a.nics.iter().flatten() {
                    if !d.netns.is_absolute() {
                        return Err(ApiError::new(
                            ErrorCode::InvalidArgument,
                            "a pod network namespace must be an absolute path",
                        ));
                    }
                }
                if a.vsock_uds.as_ref().is_some_and(|p| !p.is_absolute()) {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        "a vsock socket's path must be absolute (the daemon's working directory is not the client's)",
                    ));
                }
                Ok(())
            }
            Self::Exec(a) => a.validate(),
            Self::Peek(a) => {
                id(&a.id)?;
                if a.count == 0 || a.count > MAX_PEEK_WORDS {
                    return Err(ApiError::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "count = {} is out of range: peek reads 1 to {MAX_PEEK_WORDS} words",
                            a.count
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Checks an `exec`'s arguments; the sentence that refuses them.
fn validate_exec(a: &ExecArgs) -> Result<(), String> {
    crate::config::validate_id(&a.id).map_err(|e| e.to_string())?;
    let Some(program) = a.command.first() else {
        return Err("an exec needs a command: its program and arguments".into());
    };
    if program.is_empty() {
        return Err("an exec's program is an empty string".into());
    }
    if a.command.iter().chain(&a.env).any(|s| s.contains('\0')) {
        return Err("an exec's command and environment cannot hold NUL bytes".into());
    }
    if let Some(bad) = a
        .env
        .iter()
        .find(|e| e.split_once('=').is_none_or(|(k, _)| k.is_empty()))
    {
        return Err(format!("the environment entry {bad:?} is not KEY=VALUE"));
    }
    if let Some(cwd) = &a.cwd
        && (!cwd.starts_with('/') || cwd.contains('\0'))
    {
        return Err(format!("the working directory {cwd:?} is not an absolute guest path"));
    }
    if a.gid.is_some() && a.uid.is_none() {
        return Err("an exec's gid is given with its uid".into());
    }
    if let Some(t) = a.timeout_s
        && !(t > 0.0 && t <= MAX_EXEC_TIMEOUT_S)
    {
        return Err(format!(
            "timeout_s = {t} is out of range: an exec runs for more than 0 and at most {MAX_EXEC_TIMEOUT_S} s"
        ));
    }
    if let Some(stdin) = &a.stdin {
        // Its length first: no decoding of what cannot be let in (base64's
        // 4 characters carry 3 bytes, so the length alone is not enough).
        if stdin.len() > MAX_EXEC_STDIN.div_ceil(3) * 4 || decode_stdin(stdin)?.len() > MAX_EXEC_STDIN {
            return Err(format!("an exec's stdin is more than {MAX_EXEC_STDIN} bytes"));
        }
    }
    Ok(())
}

/// An `exec`'s stdin, decoded (standard base64, padded).
pub fn decode_stdin(stdin: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(stdin)
        .map_err(|e| format!("an exec's stdin is not base64: {e}"))
}

/// Machine-readable error class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not JSON, or not a request.
    BadRequest,
    /// `v` is not a version this daemon speaks.
    UnsupportedVersion,
    /// A field value was refused.
    InvalidArgument,
    /// No such VM.
    NotFound,
    /// Duplicate id, or the VM is in the wrong state.
    Conflict,
    /// The host failed (KVM, memory, files).
    Internal,
    /// The daemon serves as many connections as it may; nothing was read
    /// from this one (try again later).
    Busy,
    /// The connecting process's credentials are not allowed to use the API.
    PermissionDenied,
}

/// An error as sent on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiError {
    /// Class.
    pub code: ErrorCode,
    /// One sentence.
    pub message: String,
}

impl ApiError {
    /// Builds an error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

/// A VM as `create`, `start`, `pause`, `resume`, `stop`, `info` and
/// `restore` answer it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmInfo {
    /// VM id.
    pub id: String,
    /// The state in words (`running`, `stopped (guest reboot)`, ...).
    pub status: String,
    /// The state.
    pub state: VmState,
    /// The config as accepted.
    pub config: VmConfig,
    /// Devices as wired.
    pub devices: Vec<DeviceInfo>,
    /// The serial log (from the record).
    pub serial_log: Option<PathBuf>,
    /// pid of the daemon.
    pub daemon_pid: u32,
    /// Seconds since the epoch at creation (from the record).
    pub created_unix: Option<u64>,
    /// Milliseconds since `start`.
    pub ms_since_start: Option<u64>,
    /// When the first vCPU exit came, in microseconds after `start`.
    pub first_exit_us_after_start: Option<u64>,
    /// vCPU exits so far.
    pub exits: u32,
    /// The VM this one was forked from (it may be gone: a child keeps its
    /// base alive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Its fork children that are not deleted (running, stopped, or
    /// being built by a fork in flight).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<String>,
    /// Times this fork source was given a new base (`rebase`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rebases: u64,
    /// Shells ready for its fork children, when it asks for some
    /// (`fork.shells`; shared with the VMs of the same vCPUs and RAM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shells_ready: Option<u32>,
    /// How its fork children and restores come to draw their own random
    /// numbers (`vmgenid`, `no_driver`, `off`; `docs/fork.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng_reseed: Option<crate::RngReseed>,
    /// Its VM Generation ID (32 hex digits), new in every fork child and
    /// restore, when it has the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmgenid: Option<String>,
    /// The VM process it runs in (absent: inside the daemon, `--jail off`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_process: Option<VmProcessInfo>,
}

/// A VM's own process (`k7d daemon --jail on`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmProcessInfo {
    /// Its host pid.
    pub pid: u32,
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its cgroup leaf (its memory and CPU limits); none with
    /// `k7d daemon --jail-cgroup off`.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `delete`'s result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deleted {
    /// VM id.
    pub id: String,
    /// Always true.
    pub deleted: bool,
}

/// `snapshot`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotWritten {
    /// VM id.
    pub id: String,
    /// The snapshot directory.
    pub dir: PathBuf,
    /// How long writing it took (the VM was paused for this and the pause).
    pub snapshot_ms: f64,
}

/// One child of a fork.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkedChild {
    /// The child, as `info` shows it.
    #[serde(flatten)]
    pub info: VmInfo,
    /// How long building it took.
    pub fork_ms: f64,
    /// Whether it was built in a shell made ahead (`fork.shells`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shell: bool,
}

/// `fork`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Forked {
    /// The source VM.
    pub id: String,
    /// The children, running.
    pub children: Vec<ForkedChild>,
    /// How long parking the source took.
    pub pause_ms: f64,
    /// How long the source stood still (pause and every child).
    pub source_paused_ms: f64,
    /// A cluster's fork: the clusters its children form, one per fork (the
    /// children are listed fork by fork, in member order).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<String>,
    /// The sources given a new base for this batch before it was captured
    /// (`docs/fork.md`, "Re-basing"): its children copied nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rebased: Vec<String>,
    /// What the caller should know (once per source: its children's kernel
    /// RNGs are not reseeded, `rng_reseed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A cluster as `cluster_create`, `cluster_add` and `cluster_info` answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterInfo {
    /// The cluster.
    pub id: String,
    /// Its members, in order, as `list` shows them (a member that is gone
    /// shows as `gone`).
    pub members: Vec<VmSummary>,
    /// The cluster's private bridge (`docs/fork.md`), once a member has a
    /// NIC on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// The members' NICs on that bridge: `<vm>:<nic index>:<tap>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
}

/// One cluster as `cluster_list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSummary {
    /// The cluster.
    pub id: String,
    /// Its member ids, in order.
    pub members: Vec<String>,
    /// Its private bridge, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
}

/// `cluster_list`'s result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterList {
    /// Every cluster, by id.
    pub clusters: Vec<ClusterSummary>,
}

/// `peek`'s result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peeked {
    /// VM id.
    pub id: String,
    /// Guest physical address of the first word.
    pub addr: u64,
    /// The words read.
    pub words: Vec<u32>,
}

/// One VM as `list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSummary {
    /// VM id.
    pub id: String,
    /// The state in words.
    pub status: String,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// The guest in words (`builtin:idle`, `linux:/boot/vmlinuz`, ...).
    pub guest: String,
}

/// `list`'s result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmList {
    /// Every VM, by id.
    pub vms: Vec<VmSummary>,
}

/// `exec`'s result: how the command ended and what it wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Executed {
    /// VM id.
    pub id: String,
    /// Its exit status; 128 + N for a signal N (137 when killed past its
    /// timeout); 127 when the program could not start.
    pub status: u8,
    /// The first [`MAX_EXEC_OUTPUT`] bytes of its stdout, base64.
    pub stdout: String,
    /// The first [`MAX_EXEC_OUTPUT`] bytes of its stderr, base64.
    pub stderr: String,
    /// All the bytes it wrote to stdout, kept or not.
    pub stdout_bytes: u64,
    /// All the bytes it wrote to stderr, kept or not.
    pub stderr_bytes: u64,
    /// It ran past its timeout and was killed.
    #[serde(default)]
    pub timed_out: bool,
    /// Why it did not run, when it could not start (status 127).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// From the request to the command's end and its output read.
    pub exec_ms: f64,
}

/// `version`'s result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    /// The API version.
    pub api_version: u32,
    /// The daemon's version.
    pub k7d: String,
    /// The daemon's pid.
    pub pid: u32,
    /// With `--jail on`: VM processes made ahead and ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_process_spares: Option<u32>,
}

/// A result: the one type its request's op defines. On the wire it is the
/// bare result object (no tag): the reader knows the op it asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    /// `create`, `start`, `pause`, `resume`, `stop`, `info`, `restore`.
    Vm(Box<VmInfo>),
    /// `delete`, `cluster_delete`.
    Deleted(Deleted),
    /// `snapshot`.
    Snapshot(SnapshotWritten),
    /// `fork`.
    Forked(Forked),
    /// `peek`.
    Peek(Peeked),
    /// `guest_ram`.
    GuestRam(crate::state::GuestRamUsage),
    /// `list`.
    List(VmList),
    /// `version`.
    Version(VersionInfo),
    /// `cluster_create`, `cluster_add`, `cluster_info`.
    Cluster(ClusterInfo),
    /// `cluster_list`.
    Clusters(ClusterList),
    /// `rebase`.
    Rebased(crate::state::Rebased),
    /// `exec`.
    Executed(Executed),
}

impl Reply {
    /// Reads `result` as the type `req`'s op defines.
    pub fn from_result(req: &Request, result: Value) -> Result<Self, serde_json::Error> {
        use serde_json::from_value;
        Ok(match req {
            Request::Create(_)
            | Request::Start(_)
            | Request::Pause(_)
            | Request::Resume(_)
            | Request::Stop(_)
            | Request::Info(_)
            | Request::Restore(_)
            | Request::Medium(_)
            | Request::NicAttach(_)
            | Request::PodCgroup(_) => Self::Vm(Box::new(from_value(result)?)),
            Request::Delete(_) | Request::ClusterDelete(_) => Self::Deleted(from_value(result)?),
            Request::ClusterCreate(_) | Request::ClusterAdd(_) | Request::ClusterInfo(_) => {
                Self::Cluster(from_value(result)?)
            }
            Request::ClusterList => Self::Clusters(from_value(result)?),
            Request::Snapshot(_) => Self::Snapshot(from_value(result)?),
            Request::Fork(_) => Self::Forked(from_value(result)?),
            Request::Peek(_) => Self::Peek(from_value(result)?),
            Request::GuestRam(_) => Self::GuestRam(from_value(result)?),
            Request::List => Self::List(from_value(result)?),
            Request::Version => Self::Version(from_value(result)?),
            Request::Rebase(_) => Self::Rebased(from_value(result)?),
            Request::Exec(_) => Self::Executed(from_value(result)?),
        })
    }
}

/// A response line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// API version.
    pub v: u32,
    /// Success?
    pub ok: bool,
    /// The result on success (a [`Reply`]; its type is the op's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// The error on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

impl Response {
    /// A success.
    pub fn ok(reply: &Reply) -> Self {
        match serde_json::to_value(reply) {
            Ok(result) => Self {
                v: API_VERSION,
                ok: true,
                result: Some(result),
                error: None,
            },
            Err(e) => Self::err(ApiError::new(
                ErrorCode::Internal,
                format!("the result cannot be written as JSON: {e}"),
            )),
        }
    }

    /// A failure.
    pub fn err(e: ApiError) -> Self {
        Self {
            v: API_VERSION,
            ok: false,
            result: None,
            error: Some(e),
        }
    }

    /// The response line (without its newline).
    pub fn to_line(&self) -> String {
        // A Value and an ApiError always serialize; the fallback is never sent.
        serde_json::to_string(self).unwrap_or_else(|_| r#"{"v":1,"ok":false}"#.into())
    }

    /// Into a Result.
    pub fn into_result(self) -> Result<Value, ApiError> {
        match (self.ok, self.result, self.error) {
            (true, r, _) => Ok(r.unwrap_or(Value::Null)),
            (false, _, Some(e)) => Err(e),
            (false, _, None) => Err(ApiError::new(
                ErrorCode::Internal,
                "the daemon failed without saying why",
            )),
        }
    }
}

/// The outside of a request line, read before the op is known.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    v: u32,
    op: String,
    #[serde(default)]
    args: Option<Value>,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// Parses and validates one request line.
pub fn parse_request(line: &str) -> Result<Request, ApiError> {
    let env: Envelope =
        serde_json::from_str(line).map_err(|e| bad(format!("the request is not a valid API envelope: {e}")))?;
    if env.v != API_VERSION {
        return Err(ApiError::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "API version {} is not supported; this daemon speaks version {API_VERSION}",
                env.v
            ),
        ));
    }
    let op = env.op.as_str();
    if !Request::OPS.contains(&op) {
        return Err(bad(format!(
            "unknown operation `{op}` (known: {})",
            Request::OPS.join(", ")
        )));
    }
    let args = env.args.unwrap_or_else(|| Value::Object(Map::new()));
    let tagged = |args: Option<Value>| {
        let mut m = Map::new();
        m.insert("op".into(), Value::String(op.to_string()));
        if let Some(a) = args {
            m.insert("args".into(), a);
        }
        Value::Object(m)
    };
    // An op without arguments is a unit variant: its name alone parses.
    if let Ok(req) = serde_json::from_value::<Request>(tagged(None)) {
        if args.as_object().is_some_and(|o| !o.is_empty()) {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!("`{op}` takes no arguments"),
            ));
        }
        return Ok(req);
    }
    let req: Request = serde_json::from_value(tagged(Some(args))).map_err(|e| {
        let code = if e.classify() == serde_json::error::Category::Data {
            ErrorCode::InvalidArgument
        } else {
            ErrorCode::BadRequest
        };
        ApiError::new(code, format!("invalid arguments for `{op}`: {e}"))
    })?;
    req.validate()?;
    Ok(req)
}

/// Writes a request as its wire line (for the client): `args` is always
/// there (`{}` for ops without arguments) and keys are in sorted order, as
/// version 1 clients have always written them.
pub fn request_line(req: &Request) -> Result<String, serde_json::Error> {
    let mut line = serde_json::to_value(req)?;
    if let Value::Object(m) = &mut line {
        m.entry("args").or_insert_with(|| Value::Object(Map::new()));
        m.insert("v".into(), Value::from(API_VERSION));
    }
    Ok(line.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        DatapathNicConfig, DevicesConfig, DiskConfig, GuestSpec, NicConfig, SerialConfig, VsockConfig,
    };
    use crate::state::StopReason;

    /// A config that uses every field.
    fn rich_config() -> VmConfig {
        VmConfig {
            id: Some("web".into()),
            vcpus: 2,
            memory_mib: 256,
            guest: GuestSpec::Linux {
                kernel: "/boot/vmlinuz".into(),
                initrd: Some("/boot/initrd.img".into()),
                cmdline: Some("console=ttyS0 quiet".into()),
            },
            serial: SerialConfig { console: false },
            devices: DevicesConfig {
                rng: true,
                disks: vec![DiskConfig {
                    path: Some("/var/lib/k7d/a.img".into()),
                    read_only: true,
                }],
                nics: vec![
                    NicConfig {
                        tap: Some("tap0".into()),
                        queues: Some(2),
                        vhost: Some(true),
                        mac: Some("52:54:00:12:34:56".into()),
                        datapath: None,
                    },
                    NicConfig {
                        datapath: Some(DatapathNicConfig {
                            mode: "direct".into(),
                            netns: "/run/netns/pod".into(),
                            pod_if: "eth0".into(),
                            pod_uid: Some("uid-1".into()),
                            pod_namespace: None,
                            pod_name: None,
                        }),
                        ..Default::default()
                    },
                ],
                vsock: Some(VsockConfig {
                    cid: 3,
                    uds: "/run/k7d/v.sock".into(),
                }),
                // (Unset, as version 1 wrote it: the lines below are v1's.)
                vmgenid: None,
            },
            fork: Default::default(),
        }
    }

    /// One request of every op (the match makes a new op fail to compile
    /// until it is added here).
    #[test]
    fn a_pod_cgroup_is_a_plain_path_from_the_cgroup_root() {
        for ok in [
            "/k7d-cri/pod1",
            "/kubepods/burstable/pod0b6f8a1e-6a55",
            "/a.slice/b@x:y_z",
        ] {
            assert_eq!(check_cgroup_parent(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "kubepods/pod1",
            "/",
            "/a//b",
            "/a/../b",
            "/a/./b",
            "/a/b c",
            "/a/b\n",
            "/a/\u{e9}",
        ] {
            let e = check_cgroup_parent(bad).unwrap_err();
            assert!(e.starts_with("the pod's cgroup"), "{bad}: {e}");
        }
        assert!(check_cgroup_parent(&format!("/{}", "a".repeat(MAX_CGROUP_PARENT))).is_err());
        let r = Request::PodCgroup(PodCgroupArgs {
            id: "pod-1".into(),
            cgroup_parent: "/a/../../etc".into(),
        });
        assert_eq!(r.validate().unwrap_err().code, ErrorCode::InvalidArgument);
    }

    fn every_request() -> Vec<Request> {
        let all = vec![
            Request::Create(CreateArgs {
                config: rich_config(),
                start: true,
            }),
            Request::Create(CreateArgs {
                config: VmConfig::default(),
                start: false,
            }),
            Request::Start("web".into()),
            Request::Pause("web".into()),
            Request::Resume("web".into()),
            Request::Stop("web".into()),
            Request::Delete("web".into()),
            Request::Info("web".into()),
            Request::Snapshot(SnapshotArgs {
                id: "web".into(),
                dir: "/tmp/web.snap".into(),
                replace: false,
            }),
            Request::Restore(RestoreArgs {
                dir: "/tmp/web.snap".into(),
                id: Some("web2".into()),
            }),
            Request::Restore(RestoreArgs {
                dir: "/tmp/web.snap".into(),
                id: None,
            }),
            Request::Fork(ForkArgs {
                id: "web".into(),
                count: 3,
                ..Default::default()
            }),
            Request::Peek(PeekArgs {
                id: "web".into(),
                addr: 0x600,
                count: 2,
            }),
            Request::List,
            Request::Version,
            // Newer than the version-1 capture below (V1_LINES pairs with
            // the requests before this one): `replace` rides in the args only
            // when true, so older lines are unchanged.
            Request::Snapshot(SnapshotArgs {
                id: "web".into(),
                dir: "/tmp/web.snap".into(),
                replace: true,
            }),
            // Newer still: the cluster ops (added to version 1; a version-1
            // line of the ops before is unchanged).
            Request::ClusterCreate(ClusterArgs {
                id: "lab".into(),
                members: vec!["a".into(), "b".into()],
            }),
            Request::ClusterAdd(ClusterArgs {
                id: "lab".into(),
                members: vec!["c".into()],
            }),
            Request::ClusterInfo("lab".into()),
            Request::ClusterDelete("lab".into()),
            Request::ClusterList,
            // Newer: re-basing a fork source.
            Request::Rebase("web".into()),
            // Newer still: a drive's medium.
            Request::Medium(MediumArgs {
                id: "pod".into(),
                disk: 2,
                path: Some("/var/lib/k7d/images/app.erofs".into()),
            }),
            // Newer still: a pool member's NIC joins its pod's network.
            Request::NicAttach(NicAttachArgs {
                id: "pool-1".into(),
                nic: 0,
                datapath: DatapathNicConfig {
                    mode: "auto".into(),
                    netns: "/var/run/netns/cni-1".into(),
                    pod_if: "eth0".into(),
                    pod_uid: Some("0b6f8a1e-6a55-4f7b-9d8c-1f2e3d4c5b6a".into()),
                    pod_namespace: None,
                    pod_name: None,
                },
            }),
            // Newer still: what a VM's guest RAM costs the host.
            Request::GuestRam("web".into()),
            // A command in a VM, through its agent.
            Request::Exec(ExecArgs {
                id: "web".into(),
                command: vec!["sh".into(), "-c".into(), "cat; exit 3".into()],
                env: vec!["A=1".into()],
                cwd: Some("/tmp".into()),
                uid: Some(65534),
                gid: Some(65533),
                stdin: Some("aGk=".into()),
                timeout_s: Some(1.5),
                stream: true,
            }),
            // A pod VM's process into its pod's cgroup.
            Request::PodCgroup(PodCgroupArgs {
                id: "pod-1".into(),
                cgroup_parent: "/kubepods/burstable/pod0b6f8a1e".into(),
            }),
        ];
        let mut seen: Vec<&str> = Vec::new();
        for r in &all {
            match r {
                Request::Create(_)
                | Request::Start(_)
                | Request::Pause(_)
                | Request::Resume(_)
                | Request::Stop(_)
                | Request::Delete(_)
                | Request::Info(_)
                | Request::Snapshot(_)
                | Request::Restore(_)
                | Request::Fork(_)
                | Request::Peek(_)
                | Request::GuestRam(_)
                | Request::List
                | Request::Version
                | Request::ClusterCreate(_)
                | Request::ClusterAdd(_)
                | Request::ClusterInfo(_)
                | Request::ClusterDelete(_)
                | Request::ClusterList
                | Request::Rebase(_)
                | Request::Medium(_)
                | Request::NicAttach(_)
                | Request::Exec(_)
                | Request::PodCgroup(_) => {}
            }
            if !seen.contains(&r.op()) {
                seen.push(r.op());
            }
        }
        assert_eq!(seen, Request::OPS, "every op once, in OPS order");
        all
    }

    /// The lines the hand-written `request_line` of version 1 wrote for
    /// `every_request()` (captured from it before requests became serde
    /// types), in the same order.
    const V1_LINES: [&str; 15] = [
        r#"{"args":{"config":{"devices":{"disks":[{"path":"/var/lib/k7d/a.img","read_only":true}],"nics":[{"datapath":null,"mac":"52:54:00:12:34:56","queues":2,"tap":"tap0","vhost":true},{"datapath":{"mode":"direct","netns":"/run/netns/pod","pod_if":"eth0","pod_uid":"uid-1"},"mac":null,"queues":null,"tap":null,"vhost":null}],"rng":true,"vsock":{"cid":3,"uds":"/run/k7d/v.sock"}},"guest":{"cmdline":"console=ttyS0 quiet","initrd":"/boot/initrd.img","kernel":"/boot/vmlinuz","kind":"linux"},"id":"web","memory_mib":256,"serial":{"console":false},"vcpus":2},"start":true},"op":"create","v":1}"#,
        r#"{"args":{"config":{"devices":{"disks":[],"nics":[],"rng":false,"vsock":null},"guest":{"args":[],"kind":"builtin","name":"hello"},"id":null,"memory_mib":64,"serial":{"console":false},"vcpus":1},"start":false},"op":"create","v":1}"#,
        r#"{"args":{"id":"web"},"op":"start","v":1}"#,
        r#"{"args":{"id":"web"},"op":"pause","v":1}"#,
        r#"{"args":{"id":"web"},"op":"resume","v":1}"#,
        r#"{"args":{"id":"web"},"op":"stop","v":1}"#,
        r#"{"args":{"id":"web"},"op":"delete","v":1}"#,
        r#"{"args":{"id":"web"},"op":"info","v":1}"#,
        r#"{"args":{"dir":"/tmp/web.snap","id":"web"},"op":"snapshot","v":1}"#,
        r#"{"args":{"dir":"/tmp/web.snap","id":"web2"},"op":"restore","v":1}"#,
        r#"{"args":{"dir":"/tmp/web.snap","id":null},"op":"restore","v":1}"#,
        r#"{"args":{"count":3,"id":"web"},"op":"fork","v":1}"#,
        r#"{"args":{"addr":1536,"count":2,"id":"web"},"op":"peek","v":1}"#,
        r#"{"args":{},"op":"list","v":1}"#,
        r#"{"args":{},"op":"version","v":1}"#,
    ];

    /// An exec with what it needs and `f` applied.
    fn exec_line(f: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut args = Map::new();
        args.insert("id".into(), "web".into());
        args.insert("command".into(), serde_json::json!(["true"]));
        f(&mut args);
        serde_json::json!({"v": 1, "op": "exec", "args": args}).to_string()
    }

    #[test]
    fn an_exec_is_checked_before_any_guest_sees_it() {
        use base64::Engine as _;
        let b64 = |n: usize| base64::engine::general_purpose::STANDARD.encode(vec![7u8; n]);
        let ok = parse_request(&exec_line(|a| {
            a.insert("stdin".into(), b64(MAX_EXEC_STDIN).into());
        }))
        .unwrap();
        let Request::Exec(a) = ok else { panic!("{ok:?}") };
        assert_eq!(decode_stdin(a.stdin.as_deref().unwrap()).unwrap().len(), MAX_EXEC_STDIN);
        assert_eq!(a.timeout(), std::time::Duration::from_secs(600), "the default timeout");
        let refused = |key: &str, value: Value, want: &str| {
            let e = parse_request(&exec_line(|a| {
                a.insert(key.into(), value);
            }))
            .unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
            assert!(e.message.contains(want), "{want:?} not in {e}");
        };
        use serde_json::json;
        refused("command", json!([]), "needs a command");
        refused("command", json!([""]), "empty string");
        refused("command", json!(["a\0b"]), "NUL");
        refused("env", json!(["NOEQUALS"]), "not KEY=VALUE");
        refused("env", json!(["=v"]), "not KEY=VALUE");
        refused("cwd", json!("tmp"), "not an absolute guest path");
        refused("gid", json!(5), "gid is given with its uid");
        refused("uid", json!(-1), "invalid arguments for `exec`");
        for t in [0.0, -1.0, 86_400.5] {
            refused("timeout_s", json!(t), "out of range");
        }
        refused("stdin", json!("!!!!"), "not base64");
        // One byte over: its base64 is as long as the largest let in (a
        // length check alone let it through), so it is decoded and counted.
        let over = b64(MAX_EXEC_STDIN + 1);
        assert_eq!(over.len(), b64(MAX_EXEC_STDIN).len());
        refused("stdin", json!(over), "more than 524288 bytes");
        refused("stdin", json!(b64(MAX_EXEC_STDIN + 3)), "more than 524288 bytes");
        refused("id", json!("../x"), "");
        refused("shell", json!(true), "unknown field");
    }

    #[test]
    fn every_op_round_trips_through_its_line() {
        for r in every_request() {
            let line = request_line(&r).unwrap();
            assert_eq!(parse_request(&line).unwrap(), r, "{line}");
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["op"], r.op(), "{line}");
            assert_eq!(v["v"], API_VERSION, "{line}");
            assert!(v["args"].is_object(), "{line}");
        }
    }

    #[test]
    fn version_1_lines_are_written_and_read_as_before() {
        for (r, old) in every_request().into_iter().zip(V1_LINES) {
            assert_eq!(request_line(&r).unwrap(), old, "the line of `{}` changed", r.op());
            assert_eq!(parse_request(old).unwrap(), r, "{old}");
        }
        // What other v1 clients write: fields in any order, defaults left out.
        let short = [
            (r#"{"v":1,"op":"list"}"#, Request::List),
            (r#"{"v":1,"op":"version","args":null}"#, Request::Version),
            (
                r#"{"v":1,"op":"create","args":{"config":{"id":"a","memory_mib":8}}}"#,
                Request::Create(CreateArgs {
                    config: VmConfig {
                        id: Some("a".into()),
                        memory_mib: 8,
                        ..Default::default()
                    },
                    start: false,
                }),
            ),
            (
                r#"{"op":"fork","v":1,"args":{"id":"s"}}"#,
                Request::Fork(ForkArgs {
                    id: "s".into(),
                    count: 1,
                    ..Default::default()
                }),
            ),
            (
                r#"{"v":1,"op":"peek","args":{"addr":4096,"id":"s"}}"#,
                Request::Peek(PeekArgs {
                    id: "s".into(),
                    addr: 4096,
                    count: 1,
                }),
            ),
            (
                r#"{"v":1,"op":"restore","args":{"dir":"/s"}}"#,
                Request::Restore(RestoreArgs {
                    dir: "/s".into(),
                    id: None,
                }),
            ),
        ];
        for (line, r) in short {
            assert_eq!(parse_request(line).unwrap(), r, "{line}");
        }
    }

    /// (request line, code, message) as the hand-written parser of version 1
    /// answered them (captured from it; the list of known ops has grown by
    /// the cluster ops since).
    const V1_REFUSALS: [(&str, ErrorCode, &str); 24] = [
        (
            r#"{"v":1,"op":"explode"}"#,
            ErrorCode::BadRequest,
            "unknown operation `explode` (known: create, start, pause, resume, stop, delete, info, snapshot, restore, fork, peek, list, version, cluster_create, cluster_add, cluster_info, cluster_delete, cluster_list, rebase, medium, nic_attach, guest_ram, exec, pod_cgroup)",
        ),
        (
            r#"{"v":1,"op":"Create","args":{"config":{}}}"#,
            ErrorCode::BadRequest,
            "unknown operation `Create` (known: create, start, pause, resume, stop, delete, info, snapshot, restore, fork, peek, list, version, cluster_create, cluster_add, cluster_info, cluster_delete, cluster_list, rebase, medium, nic_attach, guest_ram, exec, pod_cgroup)",
        ),
        (
            r#"{"v":2,"op":"list"}"#,
            ErrorCode::UnsupportedVersion,
            "API version 2 is not supported; this daemon speaks version 1",
        ),
        (
            r#"{"v":1,"op":"list","args":{"a":1}}"#,
            ErrorCode::InvalidArgument,
            "`list` takes no arguments",
        ),
        (
            r#"{"v":1,"op":"info","args":{"id":"../x"}}"#,
            ErrorCode::InvalidArgument,
            "vm id `../x` is invalid: use 1-63 letters, digits, `_`, `.` or `-`, starting with a letter or digit and without `..`",
        ),
        (
            r#"{"v":1,"op":"info","args":{"id":"a","b":1}}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `info`: unknown field `b`, expected `id`",
        ),
        (
            r#"{"v":1,"op":"info","args":5}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `info`: invalid type: integer `5`, expected struct IdArgs",
        ),
        (
            r#"{"v":1,"op":"info"}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `info`: missing field `id`",
        ),
        (
            r#"{"v":1,"op":"create","args":5}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `create`: invalid type: integer `5`, expected struct CreateArgs",
        ),
        (
            r#"{"v":1,"op":"create"}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `create`: missing field `config`",
        ),
        (
            r#"{"v":1,"op":"create","args":{"config":{"colour":"red"}}}"#,
            ErrorCode::InvalidArgument,
            // (the list of known fields has grown by `fork` since capture)
            "invalid arguments for `create`: unknown field `colour`, expected one of `id`, `vcpus`, `memory_mib`, `guest`, `serial`, `devices`, `fork`",
        ),
        (
            r#"{"v":1,"op":"create","args":{"config":{}, "start": "yes"}}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `create`: invalid type: string \"yes\", expected a boolean",
        ),
        (
            r#"{"v":1,"op":"medium","args":{"id":"pod","disk":2,"path":"app.erofs"}}"#,
            ErrorCode::InvalidArgument,
            "a medium's path must be absolute (the daemon's working directory is not the client's)",
        ),
        (
            r#"{"v":1,"op":"medium","args":{"id":"pod","disk":-1}}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `medium`: invalid value: integer `-1`, expected u32",
        ),
        (
            r#"{"v":1,"op":"fork","args":{"id":"web","count":65}}"#,
            ErrorCode::InvalidArgument,
            "count = 65 is out of range: fork makes 1 to 64 children at a time",
        ),
        (
            r#"{"v":1,"op":"fork","args":{"id":"web","count":0}}"#,
            ErrorCode::InvalidArgument,
            "count = 0 is out of range: fork makes 1 to 64 children at a time",
        ),
        (
            r#"{"v":1,"op":"fork","args":{"id":"../x","count":0}}"#,
            ErrorCode::InvalidArgument,
            "vm id `../x` is invalid: use 1-63 letters, digits, `_`, `.` or `-`, starting with a letter or digit and without `..`",
        ),
        (
            r#"{"v":1,"op":"peek","args":{"id":"web","addr":0,"count":1025}}"#,
            ErrorCode::InvalidArgument,
            "count = 1025 is out of range: peek reads 1 to 1024 words",
        ),
        (
            r#"{"v":1,"op":"peek","args":{"id":"web","addr":-1}}"#,
            ErrorCode::InvalidArgument,
            "invalid arguments for `peek`: invalid value: integer `-1`, expected u64",
        ),
        (
            r#"{"v":1,"op":"restore","args":{"dir":"/nonexistent","id":"a/b"}}"#,
            ErrorCode::InvalidArgument,
            "vm id `a/b` is invalid: use 1-63 letters, digits, `_`, `.` or `-`, starting with a letter or digit and without `..`",
        ),
        (
            r#"{"v":1,"op":5}"#,
            ErrorCode::BadRequest,
            "the request is not a valid API envelope: invalid type: integer `5`, expected a string at line 1 column 13",
        ),
        (
            r#"{"v":"1","op":"list"}"#,
            ErrorCode::BadRequest,
            "the request is not a valid API envelope: invalid type: string \"1\", expected u32 at line 1 column 8",
        ),
        (
            r#"{"op":"list"}"#,
            ErrorCode::BadRequest,
            "the request is not a valid API envelope: missing field `v` at line 1 column 13",
        ),
        (
            r#"[1,2]"#,
            ErrorCode::BadRequest,
            "the request is not a valid API envelope: invalid type: integer `2`, expected a string at line 1 column 4",
        ),
    ];

    #[test]
    fn refusals_keep_their_code_and_sentence() {
        for (line, code, message) in V1_REFUSALS {
            assert_eq!(parse_request(line), Err(ApiError::new(code, message)), "{line}");
        }
        let code = |l: &str| parse_request(l).unwrap_err().code;
        assert_eq!(code("{nope"), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"v":1,"op":"list","extra":1}"#), ErrorCode::BadRequest);
        // Version 1 took a list/version argument that is not an object as none.
        assert_eq!(parse_request(r#"{"v":1,"op":"list","args":5}"#), Ok(Request::List));
    }

    fn info(id: &str) -> VmInfo {
        VmInfo {
            id: id.into(),
            status: "stopped (stop requested)".into(),
            state: VmState::Stopped {
                reason: StopReason::Requested,
            },
            config: rich_config(),
            devices: vec![DeviceInfo {
                kind: "serial".into(),
                location: "ttyS0 port 0x3f8 irq 4".into(),
                detail: "/tmp/serial.log".into(),
            }],
            serial_log: Some("/tmp/serial.log".into()),
            daemon_pid: 42,
            created_unix: Some(1_796_135_691),
            ms_since_start: None,
            first_exit_us_after_start: Some(187),
            exits: 5,
            parent: None,
            children: Vec::new(),
            rebases: 0,
            shells_ready: None,
            rng_reseed: None,
            vmgenid: None,
            vm_process: Some(VmProcessInfo {
                pid: 4242,
                uid: 2_000_000_000,
                gid: 2_000_000_000,
                cgroup: Some("/sys/fs/cgroup/k7d/vm-2000000000".into()),
            }),
        }
    }

    #[test]
    fn info_says_how_a_vms_children_are_reseeded() {
        let mut i = info("web");
        i.rng_reseed = Some(crate::RngReseed::NoDriver);
        i.vmgenid = Some("00112233445566778899aabbccddeeff".into());
        let line = serde_json::to_string(&i).unwrap();
        assert!(line.contains(r#""rng_reseed":"no_driver""#), "{line}");
        assert!(
            line.contains(r#""vmgenid":"00112233445566778899aabbccddeeff""#),
            "{line}"
        );
        assert_eq!(serde_json::from_str::<VmInfo>(&line).unwrap(), i);
        for (r, word) in [
            (crate::RngReseed::Vmgenid, "vmgenid"),
            (crate::RngReseed::NoDriver, "none"),
            (crate::RngReseed::Off, "none"),
            (crate::RngReseed::Agent, "agent"),
        ] {
            assert!(r.describe().starts_with(word), "{r:?}: {}", r.describe());
        }
        // A reply without them (a daemon before issue 40) still reads.
        let old: VmInfo = serde_json::from_str(&serde_json::to_string(&info("web")).unwrap()).unwrap();
        assert_eq!((old.rng_reseed, old.vmgenid), (None, None));
    }

    /// A reply for `req` with every field set.
    fn reply_for(req: &Request) -> Reply {
        match req {
            Request::Create(_)
            | Request::Start(_)
            | Request::Pause(_)
            | Request::Resume(_)
            | Request::Stop(_)
            | Request::Info(_)
            | Request::Restore(_)
            | Request::Medium(_)
            | Request::NicAttach(_)
            | Request::PodCgroup(_) => Reply::Vm(Box::new(info("web"))),
            Request::Delete(_) => Reply::Deleted(Deleted {
                id: "web".into(),
                deleted: true,
            }),
            Request::Snapshot(_) => Reply::Snapshot(SnapshotWritten {
                id: "web".into(),
                dir: "/tmp/web.snap".into(),
                snapshot_ms: 8.406401,
            }),
            Request::Fork(_) => Reply::Forked(Forked {
                id: "web".into(),
                children: vec![
                    ForkedChild {
                        info: info("web-f1"),
                        fork_ms: 3.259828,
                        shell: true,
                    },
                    ForkedChild {
                        info: info("web-f2"),
                        fork_ms: 0.1,
                        shell: false,
                    },
                ],
                pause_ms: 0.25,
                source_paused_ms: 3.5,
                clusters: vec!["lab-f1".into()],
                rebased: vec!["web".into()],
                warnings: Vec::new(),
            }),
            Request::Peek(_) => Reply::Peek(Peeked {
                id: "web".into(),
                addr: 1536,
                words: vec![0, 7, u32::MAX],
            }),
            Request::GuestRam(_) => Reply::GuestRam(crate::state::GuestRamUsage {
                id: "web".into(),
                resident: 9 << 20,
                copied: 1 << 20,
                pss: 5 << 20,
            }),
            Request::List => Reply::List(VmList {
                vms: vec![VmSummary {
                    id: "web".into(),
                    status: "running".into(),
                    vcpus: 1,
                    memory_mib: 8,
                    guest: "builtin:idle".into(),
                }],
            }),
            Request::Version => Reply::Version(VersionInfo {
                api_version: API_VERSION,
                k7d: "0.1.0".into(),
                pid: 42,
                vm_process_spares: Some(2),
            }),
            Request::ClusterCreate(_) | Request::ClusterAdd(_) | Request::ClusterInfo(_) => {
                Reply::Cluster(ClusterInfo {
                    id: "lab".into(),
                    members: vec![VmSummary {
                        id: "a".into(),
                        status: "running".into(),
                        vcpus: 1,
                        memory_mib: 8,
                        guest: "builtin:idle".into(),
                    }],
                    bridge: Some("k7dc0123456789a".into()),
                    ports: vec!["a:0:k7dt0123456789a".into()],
                })
            }
            Request::ClusterDelete(_) => Reply::Deleted(Deleted {
                id: "lab".into(),
                deleted: true,
            }),
            Request::ClusterList => Reply::Clusters(ClusterList {
                clusters: vec![ClusterSummary {
                    id: "lab".into(),
                    members: vec!["a".into(), "b".into()],
                    bridge: None,
                }],
            }),
            Request::Rebase(_) => Reply::Rebased(crate::state::Rebased {
                id: "web".into(),
                diverged_mib: 25.5,
                base_mib: 256.0,
                recopied_pages: 17,
                rounds: 2,
                paused_ms: 0.8,
                took_ms: 130.5,
            }),
            Request::Exec(_) => Reply::Executed(Executed {
                id: "web".into(),
                status: 3,
                stdout: "aGkK".into(),
                stderr: String::new(),
                stdout_bytes: 3,
                stderr_bytes: 0,
                timed_out: true,
                error: Some("the start failed".into()),
                exec_ms: 412.5,
            }),
        }
    }

    #[test]
    fn every_reply_round_trips_through_its_line() {
        for req in every_request() {
            let reply = reply_for(&req);
            let line = Response::ok(&reply).to_line();
            let resp: Response = serde_json::from_str(&line).unwrap();
            let result = resp.into_result().unwrap();
            assert_eq!(Reply::from_result(&req, result).unwrap(), reply, "{line}");
        }
        let e = ApiError::new(ErrorCode::Conflict, "vm r is running, cannot start");
        let line = Response::err(e.clone()).to_line();
        assert_eq!(
            line,
            r#"{"v":1,"ok":false,"error":{"code":"conflict","message":"vm r is running, cannot start"}}"#
        );
        let resp: Response = serde_json::from_str(&line).unwrap();
        assert_eq!(resp.into_result(), Err(e));
    }

    /// Result lines a version 1 daemon sent (captured from it, byte for
    /// byte), one per result type, with the request that asked.
    const V1_RESULTS: [(&str, &str); 7] = [
        (
            r#"{"v":1,"op":"stop","args":{"id":"c"}}"#,
            r#"{"v":1,"ok":true,"result":{"config":{"devices":{"disks":[],"nics":[],"rng":false,"vsock":null},"guest":{"args":[],"kind":"builtin","name":"idle"},"id":"c","memory_mib":8,"serial":{"console":false},"vcpus":1},"created_unix":1796135691,"daemon_pid":24860,"devices":[{"detail":"/tmp/k7d-test-capture-24860-0/state/vms/c/serial.log","kind":"serial","location":"ttyS0 port 0x3f8 irq 4"},{"detail":"reset stops the VM","kind":"i8042","location":"ports 0x60-0x64"}],"exits":5,"first_exit_us_after_start":187,"id":"c","ms_since_start":1,"serial_log":"/tmp/k7d-test-capture-24860-0/state/vms/c/serial.log","state":{"reason":{"kind":"requested"},"state":"stopped"},"status":"stopped (stop requested)"}}"#,
        ),
        (
            r#"{"v":1,"op":"delete","args":{"id":"c"}}"#,
            r#"{"v":1,"ok":true,"result":{"deleted":true,"id":"c"}}"#,
        ),
        (
            r#"{"args":{"dir":"/tmp/k7d-test-capture-24860-0/snap","id":"web"},"op":"snapshot","v":1}"#,
            r#"{"v":1,"ok":true,"result":{"dir":"/tmp/k7d-test-capture-24860-0/snap","id":"web","snapshot_ms":8.406401}}"#,
        ),
        (
            r#"{"v":1,"op":"fork","args":{"id":"web","count":2}}"#,
            r#"{"v":1,"ok":true,"result":{"children":[{"config":{"devices":{"disks":[],"nics":[],"rng":false,"vsock":null},"guest":{"args":[],"kind":"builtin","name":"idle"},"id":"web-f1","memory_mib":8,"serial":{"console":false},"vcpus":1},"created_unix":1796135691,"daemon_pid":24860,"devices":[{"detail":"/tmp/k7d-test-capture-24860-0/state/vms/web-f1/serial.log","kind":"serial","location":"ttyS0 port 0x3f8 irq 4"},{"detail":"reset stops the VM","kind":"i8042","location":"ports 0x60-0x64"}],"exits":0,"first_exit_us_after_start":null,"fork_ms":3.259828,"id":"web-f1","ms_since_start":0,"serial_log":"/tmp/k7d-test-capture-24860-0/state/vms/web-f1/serial.log","state":{"state":"running"},"status":"running"},{"config":{"devices":{"disks":[],"nics":[],"rng":false,"vsock":null},"guest":{"args":[],"kind":"builtin","name":"idle"},"id":"web-f2","memory_mib":8,"serial":{"console":false},"vcpus":1},"created_unix":1796135691,"daemon_pid":24860,"devices":[{"detail":"/tmp/k7d-test-capture-24860-0/state/vms/web-f2/serial.log","kind":"serial","location":"ttyS0 port 0x3f8 irq 4"},{"detail":"reset stops the VM","kind":"i8042","location":"ports 0x60-0x64"}],"exits":0,"first_exit_us_after_start":null,"fork_ms":4.0160350000000005,"id":"web-f2","ms_since_start":0,"serial_log":"/tmp/k7d-test-capture-24860-0/state/vms/web-f2/serial.log","state":{"state":"running"},"status":"running"}],"id":"web","pause_ms":0.15857,"source_paused_ms":7.477421}}"#,
        ),
        (
            r#"{"v":1,"op":"peek","args":{"id":"web","addr":1536,"count":2}}"#,
            r#"{"v":1,"ok":true,"result":{"addr":1536,"id":"web","words":[0,0]}}"#,
        ),
        (
            r#"{"v":1,"op":"list"}"#,
            r#"{"v":1,"ok":true,"result":{"vms":[{"guest":"builtin:idle","id":"c","memory_mib":8,"status":"stopped (stop requested)","vcpus":1},{"guest":"builtin:idle","id":"r","memory_mib":8,"status":"running","vcpus":1},{"guest":"builtin:idle","id":"web","memory_mib":8,"status":"running","vcpus":1},{"guest":"builtin:idle","id":"web-f1","memory_mib":8,"status":"running","vcpus":1},{"guest":"builtin:idle","id":"web-f2","memory_mib":8,"status":"running","vcpus":1}]}}"#,
        ),
        (
            r#"{"v":1,"op":"version"}"#,
            r#"{"v":1,"ok":true,"result":{"api_version":1,"k7d":"0.1.0","pid":24860}}"#,
        ),
    ];

    #[test]
    fn version_1_results_are_read_as_their_ops_type_and_written_back_the_same() {
        for (req, line) in V1_RESULTS {
            let req = parse_request(req).unwrap();
            let resp: Response = serde_json::from_str(line).unwrap();
            let reply = Reply::from_result(&req, resp.into_result().unwrap())
                .unwrap_or_else(|e| panic!("`{}`: {e}: {line}", req.op()));
            let want = match req {
                Request::Stop(_) => matches!(reply, Reply::Vm(_)),
                Request::Delete(_) => matches!(reply, Reply::Deleted(_)),
                Request::Snapshot(_) => matches!(reply, Reply::Snapshot(_)),
                Request::Fork(_) => matches!(reply, Reply::Forked(_)),
                Request::Peek(_) => matches!(reply, Reply::Peek(_)),
                Request::List => matches!(reply, Reply::List(_)),
                Request::Version => matches!(reply, Reply::Version(_)),
                _ => false,
            };
            assert!(want, "`{}` was read as {reply:?}", req.op());
            // The daemon writes the same result the same way, byte for byte.
            assert_eq!(Response::ok(&reply).to_line(), line);
        }
        // A result of the wrong type is an error, not a guess.
        let deleted = serde_json::json!({"deleted": true, "id": "c"});
        assert!(Reply::from_result(&Request::Info("c".into()), deleted).is_err());
    }
}

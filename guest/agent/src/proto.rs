//! The shim ↔ agent protocol, version 1 (`docs/containerd.md`).
//!
//! The shim connects to the pod VM's hybrid vsock socket, asks for
//! [`PORT`] (`CONNECT 1024\n`, answered `OK <port>\n` by the VMM), and then
//! both sides speak *frames*: a 4-byte big-endian length, then that many
//! bytes of JSON. The first request on every connection is
//! [`Request::Hello`]; an agent of another version answers an error and
//! closes. Each request gets exactly one [`Response`] before the next is
//! read, so a connection is a sequence of calls; a call that blocks
//! ([`Request::Wait`]) takes a connection of its own.
//!
//! [`Request::Attach`] turns its connection into a raw byte stream after
//! the `Ok` response: the container's stdin (shim → agent; the shim's EOF
//! closes the process's stdin), or its stdout/stderr (agent → shim; EOF when
//! the process and every holder of the pipe closed it).
//!
//! [`Request::Run`] runs a command in the VM itself and answers on its own
//! connection with a sequence of frames: [`Reply::Output`] chunks of its
//! stdout and stderr as they come, then one [`Reply::Ran`] (or an error
//! frame, when it was refused before it started). The connection is then
//! back in step for the next request: a client that keeps one open (the
//! daemon's `exec`) pays one round trip per command.
//!
//! Why JSON frames rather than ttrpc (Kata's choice): both ends are ours
//! and in one repository, the OCI spec is already JSON, no protobuf code
//! generation is needed on either side, and a frame is readable in a log.
//! Every field a peer sends is checked by the receiver as hostile input
//! (ids, sizes, signal numbers); unknown fields are refused.

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

/// The protocol's version; [`Request::Hello`] carries it.
pub const VERSION: u32 = 1;
/// The agent's vsock port.
pub const PORT: u32 = 1024;
/// The largest frame either side reads (an OCI spec is a few KiB).
pub const MAX_FRAME: usize = 1 << 20;
/// The container id that names the VM itself (`k7d exec`): an exec in it
/// runs directly in the VM's own root and namespaces, not in a container
/// and not through the OCI runtime. Empty, which no containerd id is.
pub const THE_VM: &str = "";
/// The annotation containerd's CRI plugin sets on every container of a
/// pod: `sandbox` or `container`. The shim routes by it, and the agent runs
/// a `sandbox` as a stand-in (no image, no runc).
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// A framing or decoding failure.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection at a frame boundary.
    #[error("the peer closed the connection")]
    Closed,
    /// A read or write failed.
    #[error("the connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The length prefix is over [`MAX_FRAME`].
    #[error("a frame of {0} bytes is over the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    /// The body is not the expected JSON.
    #[error("a frame is not valid protocol JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Writes one frame holding `msg`.
pub fn write_frame<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    let body = serde_json::to_vec(msg)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge(body.len()))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame and decodes it as `T`.
pub fn read_frame<R: Read, T: for<'de> Deserialize<'de>>(r: &mut R) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

/// Which process of a container: its init (`exec_id` absent) or an exec.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessRef {
    /// The container.
    pub container: String,
    /// The exec, or `None` for the container's init process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_id: Option<String>,
}

/// The stdio a process gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdioSpec {
    /// A terminal (pty): stdout carries the pty's output, stderr is unused.
    #[serde(default)]
    pub terminal: bool,
    /// The shim will attach stdin (otherwise it is `/dev/null`).
    #[serde(default)]
    pub stdin: bool,
    /// The shim will attach stdout (otherwise output is discarded).
    #[serde(default)]
    pub stdout: bool,
    /// The shim will attach stderr (otherwise output is discarded).
    #[serde(default)]
    pub stderr: bool,
}

/// A block device attached to the VM, found by its virtio-blk serial
/// (`/sys/block/vd*/serial`; k7d names disk `i` `k7d-disk<i>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockMount {
    /// The disk's serial.
    pub serial: String,
    /// Its filesystem (`erofs`, `ext4`).
    pub fstype: String,
    /// Its size in 512-byte sectors, when the shim knows it: the agent
    /// waits for exactly that size (a drive whose medium was just changed
    /// may still show the previous medium's until the guest handled it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sectors: Option<u64>,
}

/// `create_container`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateContainer {
    /// The container id (containerd's: `[A-Za-z0-9]+([._-][A-Za-z0-9]+)*`, ≤ 76 bytes).
    pub id: String,
    /// The OCI runtime spec as containerd wrote it (`config.json`). The
    /// agent replaces `root` (its own rootfs), drops namespace paths (they
    /// name the host's namespaces) and keeps the rest.
    pub spec: serde_json::Value,
    /// The image's read-only layers, merged (one erofs image).
    pub rootfs: BlockMount,
    /// The init process's stdio.
    pub stdio: StdioSpec,
    /// The spec's host bind mounts whose content the shim carried in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binds: Option<Binds>,
    /// The node's kernel limits a container under runc would read
    /// ([`NodeLimits`]): the agent sets them in the VM before the container
    /// is made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeLimits>,
}

/// The node's values of the kernel limits a container reads
/// ([`NODE_SYSCTLS`]). A pod VM's kernel derives several from its small
/// RAM (`threads-max`, and from it the first process's `RLIMIT_NPROC`;
/// `file-max`; inotify watches), so a container under k7d would see far
/// lower limits than the same container under runc on the same node; the
/// agent writes the node's values instead. (The rlimits themselves travel
/// in the spec's `process.rlimits`, filled by the shim.)
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLimits {
    /// sysctl name (`kernel.pid_max`) → value; names from [`NODE_SYSCTLS`] only.
    pub sysctls: std::collections::BTreeMap<String, u64>,
}

/// The sysctls [`NodeLimits`] may carry, with the values the kernel takes.
pub const NODE_SYSCTLS: &[(&str, std::ops::RangeInclusive<u64>)] = &[
    // fs.nr_open first: an RLIMIT_NOFILE above the VM's default needs it.
    ("fs.nr_open", 64..=2_147_483_584),
    ("fs.file-max", 1..=i64::MAX as u64),
    ("fs.inotify.max_user_instances", 1..=i32::MAX as u64),
    ("fs.inotify.max_user_watches", 1..=i32::MAX as u64),
    ("kernel.pid_max", 301..=4_194_304),
    ("kernel.threads-max", 20..=0x3fff_ffff),
];

impl NodeLimits {
    /// Checks every entry against [`NODE_SYSCTLS`]; the first bad one's reason.
    pub fn check(&self) -> Result<(), String> {
        for (name, value) in &self.sysctls {
            match NODE_SYSCTLS.iter().find(|(n, _)| n == name) {
                None => return Err(format!("the sysctl {name:.64} is not one a node limit may set")),
                Some((_, range)) if !range.contains(value) => {
                    return Err(format!(
                        "{name} = {value} is outside {}..={}",
                        range.start(),
                        range.end()
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// `network`'s arguments: the pod's IPv4 configuration, as the CNI set it
/// up on the pod's interface on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// The NIC's MAC (`aa:bb:cc:dd:ee:ff`); none: the VM's only NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// The pod's address with its prefix length (`10.88.0.5/16`).
    pub address: String,
    /// The default gateway, if the pod has a default route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// The interface's MTU (68..=65535), if the CNI set one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// A MAC the interface takes first (a unicast `aa:bb:cc:dd:ee:ff`): a
    /// VM forked from a template has its template's, which every sibling
    /// on the pod network would share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set_mac: Option<String>,
}

/// A fork child's own identity (`Request::Identity`). Without it, every
/// child of one template would draw the same bytes from `/dev/urandom`
/// (the kernel's RNG state is in the copied RAM), tell the template's
/// time, and share its machine-id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Host random bytes ([`MIN_ENTROPY`]..=[`MAX_ENTROPY`]), credited and
    /// followed by a reseed of the kernel's RNG.
    pub entropy: Vec<u8>,
    /// The host's wall clock, nanoseconds since the Unix epoch.
    pub unix_time_ns: u64,
    /// The VM's machine-id: 32 lowercase hex digits, not all zero.
    pub machine_id: String,
}

/// Fewest entropy bytes an [`Identity`] carries (256 bits).
pub const MIN_ENTROPY: usize = 32;
/// Most entropy bytes an [`Identity`] carries.
pub const MAX_ENTROPY: usize = 512;

/// Host bind mounts carried into the guest: the shim packs every carried
/// source into one read-only disk (entry `<path>` at its root holds mount
/// `index`'s content) and the agent mounts each from there. A read-only
/// bind stays read-only; a writable one gets a writable layer in guest RAM
/// (an overlay for a directory, a copy for a file), whose writes the host
/// never sees (as an emptyDir's, they die with the pod). A host bind the
/// shim did not carry is dropped (a socket, a device, the host's /dev/shm).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binds {
    /// The disk holding every carried source.
    pub disk: BlockMount,
    /// One per carried mount.
    pub mounts: Vec<Bind>,
}

/// One carried bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bind {
    /// Its position in the spec's `mounts` (which must be a host bind).
    pub index: usize,
    /// The entry at the disk's root holding its content (one path component).
    pub path: String,
    /// A regular file (else a directory).
    pub file: bool,
    /// Writable in the container.
    pub writable: bool,
}

/// Whether an OCI mount names a host path to bind (`type` bind, or a
/// `bind`/`rbind` option, with an absolute `source`): the mounts the guest
/// cannot make from its own filesystems.
pub fn is_host_bind(m: &serde_json::Value) -> bool {
    let source_abs = m
        .get("source")
        .and_then(serde_json::Value::as_str)
        .is_some_and(|s| s.starts_with('/'));
    let typ_bind = m.get("type").and_then(serde_json::Value::as_str) == Some("bind");
    let opt_bind = m
        .get("options")
        .and_then(serde_json::Value::as_array)
        .is_some_and(|o| o.iter().any(|x| matches!(x.as_str(), Some("bind" | "rbind"))));
    source_abs && (typ_bind || opt_bind)
}

/// Whether an OCI mount's options make it read-only.
pub fn is_readonly(m: &serde_json::Value) -> bool {
    m.get("options")
        .and_then(serde_json::Value::as_array)
        .is_some_and(|o| o.iter().any(|x| x.as_str() == Some("ro")))
}

/// `exec`'s arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exec {
    /// The container and the new exec's id.
    pub process: ProcessRef,
    /// The OCI `process` object (args, env, cwd, user, terminal).
    pub spec: serde_json::Value,
    /// Its stdio.
    pub stdio: StdioSpec,
}

/// The most stdin a [`Run`] carries (sent whole in its request frame).
pub const MAX_RUN_STDIN: usize = 512 << 10;
/// The most output one [`Reply::Output`] frame carries.
pub const RUN_CHUNK: usize = 64 << 10;
/// The longest a [`Run`]'s command may run, in milliseconds (a day).
pub const MAX_RUN_TIMEOUT_MS: u64 = 86_400_000;

/// Bytes, as base64 in a frame (a JSON array of numbers would take up to
/// four times the room).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine as _;
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use base64::Engine as _;
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map(Bytes)
            .map_err(|e| serde::de::Error::custom(format!("not base64: {e}")))
    }
}

/// `run`'s arguments: a command in the VM itself ([`THE_VM`]), run and
/// answered on this connection (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Run {
    /// The OCI `process` object (args, env, cwd, user; no terminal).
    pub spec: serde_json::Value,
    /// Its whole stdin (at most [`MAX_RUN_STDIN`]); empty: `/dev/null`.
    #[serde(default)]
    pub stdin: Bytes,
    /// Killed (SIGKILL, status 137) past this many milliseconds
    /// (1..=[`MAX_RUN_TIMEOUT_MS`]).
    pub timeout_ms: u64,
    /// The most bytes of stdout, and of stderr, sent back; the rest is read
    /// (the command never blocks on a full pipe) and counted.
    pub max_output: u64,
}

/// How a [`Run`]'s command ended: the last frame of its answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ran {
    /// Its exit status (128 + N for a signal N; 127 when it did not start).
    pub status: u32,
    /// It ran past its timeout and was killed.
    pub timed_out: bool,
    /// Why it did not start, when it did not (status 127).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// How many bytes it wrote to stdout (sent back up to `max_output`).
    pub stdout_bytes: u64,
    /// How many bytes it wrote to stderr.
    pub stderr_bytes: u64,
}

/// Which stdio stream an [`Request::Attach`] connection carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// Shim → process.
    Stdin,
    /// Process → shim.
    Stdout,
    /// Process → shim.
    Stderr,
}

/// A request from the shim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// First on every connection: the shim's protocol version.
    Hello {
        /// [`VERSION`].
        version: u32,
    },
    /// Mount the rootfs and create the container (its init not yet running).
    CreateContainer(CreateContainer),
    /// Start a created container's init, or an added exec.
    Start(ProcessRef),
    /// Add an exec process (started by [`Request::Start`]).
    Exec(Exec),
    /// Block until the process exits.
    Wait(ProcessRef),
    /// Send a signal to the process, or with `all` to every process of the container.
    Signal {
        /// The process.
        process: ProcessRef,
        /// The signal number (1..=64).
        signal: i32,
        /// Every process of the container.
        #[serde(default)]
        all: bool,
    },
    /// The process's state.
    State(ProcessRef),
    /// The pids of every process in the container (guest pids).
    Pids {
        /// The container.
        container: String,
    },
    /// Resize the process's terminal.
    ResizePty {
        /// The process.
        process: ProcessRef,
        /// Columns.
        width: u32,
        /// Rows.
        height: u32,
    },
    /// Close the process's stdin.
    CloseStdin(ProcessRef),
    /// The container's cgroup v2 statistics.
    Stats {
        /// The container.
        container: String,
    },
    /// Apply OCI `linux.resources` to the container's cgroup.
    Update {
        /// The container.
        container: String,
        /// The OCI `LinuxResources` object.
        resources: serde_json::Value,
    },
    /// Forget an exited exec process.
    DeleteExec(ProcessRef),
    /// Kill what is left of the container, unmount its rootfs and forget it.
    DeleteContainer {
        /// The container.
        container: String,
    },
    /// Configure the pod's network on the VM's NIC (the pod's address as
    /// the CNI gave it): address, default route, link up.
    Network(Network),
    /// Give a VM forked from a template its own identity: fresh entropy
    /// mixed in and the kernel's RNG reseeded, the wall clock stepped to
    /// the host's, its own machine-id.
    Identity(Identity),
    /// Host random bytes ([`MIN_ENTROPY`]..=[`MAX_ENTROPY`]) credited to the
    /// kernel's pool and its RNG reseeded from them, nothing else: what the
    /// daemon sends a fork child or a restored VM whose kernel has no
    /// vmgenid driver, so that it draws other bytes than its siblings.
    Reseed {
        /// The entropy.
        entropy: Vec<u8>,
    },
    /// Run a command in the VM itself and answer with its output and its
    /// end on this connection (see the module documentation).
    Run(Run),
    /// This connection becomes one stdio stream of the process.
    Attach {
        /// The process.
        process: ProcessRef,
        /// The stream.
        stream: Stream,
    },
}

/// A process's life as the agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Created, not started.
    Created,
    /// Running.
    Running,
    /// Exited (see `exit_status`).
    Stopped,
}

/// A process's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessState {
    /// Its guest pid (0 before it exists).
    pub pid: u32,
    /// Its life.
    pub status: Status,
    /// Its exit status once stopped (128 + signal when killed).
    #[serde(default)]
    pub exit_status: u32,
}

/// An exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exited {
    /// Its guest pid.
    pub pid: u32,
    /// The exit status (128 + signal when killed).
    pub exit_status: u32,
    /// The container's cgroup counted an OOM kill.
    #[serde(default)]
    pub oom_killed: bool,
}

/// A container's cgroup v2 statistics (the files' fields, as read).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupStats {
    /// `pids.current`, `pids.max` (0 = max).
    pub pids_current: u64,
    /// `pids.max`, 0 when `max`.
    pub pids_limit: u64,
    /// `cpu.stat`: usage_usec, user_usec, system_usec, nr_periods, nr_throttled, throttled_usec.
    pub cpu: Vec<(String, u64)>,
    /// `memory.current`.
    pub memory_usage: u64,
    /// `memory.max`, 0 when `max`.
    pub memory_limit: u64,
    /// `memory.stat`'s fields.
    pub memory_stat: Vec<(String, u64)>,
    /// `memory.events`'s fields (oom, oom_kill, ...).
    pub memory_events: Vec<(String, u64)>,
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// Nothing to say.
    Done,
    /// [`Request::Hello`]'s answer.
    Hello {
        /// The agent's [`VERSION`].
        version: u32,
        /// The guest kernel's release (`uname -r`).
        kernel: String,
    },
    /// The process's guest pid (create, start, exec).
    Pid(u32),
    /// A process's state.
    State(ProcessState),
    /// An exit.
    Exited(Exited),
    /// Pids.
    Pids(Vec<u32>),
    /// Statistics.
    Stats(CgroupStats),
    /// A chunk of a [`Request::Run`]'s output (at most [`RUN_CHUNK`]).
    Output {
        /// Stdout or stderr.
        stream: Stream,
        /// The bytes.
        data: Bytes,
    },
    /// A [`Request::Run`]'s end: its last frame.
    Ran(Ran),
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    /// It was done.
    Ok(Reply),
    /// It was refused or failed: one sentence.
    Err {
        /// What went wrong.
        message: String,
        /// The container or process does not exist (containerd's NotFound).
        #[serde(default)]
        not_found: bool,
    },
}

/// The pod VM's kernel command line parameter that sets how long one runc
/// command may take in the guest (seconds, 1 to 3600; 60 when absent). The
/// shim sizes its own call limits from the same parameter.
pub const RUNC_TIMEOUT_PARAM: &str = "k7d.runc_timeout_s";
/// One runc command's limit when the command line does not set one.
pub const DEFAULT_RUNC_TIMEOUT_S: u64 = 60;

/// The runc limit a kernel command line sets ([`RUNC_TIMEOUT_PARAM`]; the
/// last one wins, as for the kernel's own parameters), or the default.
pub fn runc_timeout(cmdline: &str) -> Result<std::time::Duration, String> {
    let mut secs = DEFAULT_RUNC_TIMEOUT_S;
    for w in cmdline.split_ascii_whitespace() {
        if let Some(v) = w.strip_prefix(RUNC_TIMEOUT_PARAM).and_then(|r| r.strip_prefix('=')) {
            secs = v
                .parse::<u64>()
                .ok()
                .filter(|s| (1..=3600).contains(s))
                .ok_or_else(|| format!("{RUNC_TIMEOUT_PARAM}={v} is not 1 to 3600 seconds"))?;
        }
    }
    Ok(std::time::Duration::from_secs(secs))
}

/// Whether `id` is a container or exec id the agent accepts: containerd's
/// identifier grammar (`[A-Za-z0-9]+([._-][A-Za-z0-9]+)*`, at most 76
/// bytes), so it is always a safe single path component.
pub fn valid_id(id: &str) -> bool {
    let b = id.as_bytes();
    if b.is_empty() || b.len() > 76 {
        return false;
    }
    let mut prev_sep = true;
    for &c in b {
        let sep = matches!(c, b'.' | b'_' | b'-');
        if sep && prev_sep {
            return false;
        }
        if !sep && !c.is_ascii_alphanumeric() {
            return false;
        }
        prev_sep = sep;
    }
    !prev_sep
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_runc_limit_comes_from_the_command_line() {
        use std::time::Duration;
        assert_eq!(super::runc_timeout("console=ttyS0 quiet"), Ok(Duration::from_secs(60)));
        assert_eq!(
            super::runc_timeout("quiet k7d.runc_timeout_s=900 panic=1"),
            Ok(Duration::from_secs(900))
        );
        assert_eq!(
            super::runc_timeout("k7d.runc_timeout_s=5 k7d.runc_timeout_s=7"),
            Ok(Duration::from_secs(7))
        );
        // A longer name is another parameter.
        assert_eq!(
            super::runc_timeout("k7d.runc_timeout_sx=1"),
            Ok(Duration::from_secs(60))
        );
        for bad in ["0", "3601", "-1", "ten", ""] {
            assert_eq!(
                super::runc_timeout(&format!("k7d.runc_timeout_s={bad}")),
                Err(format!("k7d.runc_timeout_s={bad} is not 1 to 3600 seconds"))
            );
        }
    }

    use super::*;

    #[test]
    fn a_frame_round_trips_and_a_closed_peer_is_told_apart_from_a_torn_frame() {
        let req = Request::Signal {
            process: ProcessRef {
                container: "c1".into(),
                exec_id: Some("e1".into()),
            },
            signal: 15,
            all: false,
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &req).unwrap();
        let back: Request = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(back, req);
        assert!(matches!(
            read_frame::<_, Request>(&mut [].as_slice()),
            Err(FrameError::Closed)
        ));
        let torn = &buf[..buf.len() - 1];
        assert!(matches!(
            read_frame::<_, Request>(&mut &torn[..]),
            Err(FrameError::Io(_))
        ));
    }

    #[test]
    fn oversized_frames_and_unknown_fields_are_refused() {
        let len = (MAX_FRAME as u32 + 1).to_be_bytes();
        assert!(matches!(
            read_frame::<_, Request>(&mut &len[..]),
            Err(FrameError::TooLarge(_))
        ));
        let body = br#"{"op":"hello","args":{"version":1,"extra":2}}"#;
        let mut buf = (body.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(body);
        assert!(matches!(
            read_frame::<_, Request>(&mut buf.as_slice()),
            Err(FrameError::Json(_))
        ));
    }

    #[test]
    fn node_limits_take_only_known_sysctls_within_the_kernels_bounds() {
        let ok = NodeLimits {
            sysctls: [
                ("kernel.pid_max".to_string(), 4_194_304),
                ("fs.nr_open".to_string(), 1 << 20),
            ]
            .into(),
        };
        assert_eq!(ok.check(), Ok(()));
        let unknown = NodeLimits {
            sysctls: [("kernel.core_pattern".to_string(), 1)].into(),
        };
        assert!(unknown.check().unwrap_err().contains("kernel.core_pattern"));
        let high = NodeLimits {
            sysctls: [("kernel.pid_max".to_string(), 4_194_305)].into(),
        };
        assert!(high.check().unwrap_err().contains("outside 301..=4194304"));
        let low = NodeLimits {
            sysctls: [("kernel.threads-max".to_string(), 19)].into(),
        };
        assert!(low.check().is_err());
        // An older shim sends none: the field is optional.
        let json = r#"{"id":"c","spec":{},"rootfs":{"serial":"s","fstype":"erofs"},"stdio":{}}"#;
        let c: CreateContainer = serde_json::from_str(json).unwrap();
        assert_eq!(c.node, None);
    }

    #[test]
    fn ids_follow_containerds_grammar() {
        for ok in ["a", "t1", "abc.def-1_2", &"x".repeat(76)] {
            assert!(valid_id(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../x", "a/b", "a..b", "-a", "a-", "a b", &"x".repeat(77)] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}

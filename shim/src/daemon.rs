//! The shim's view of the k7d daemon, which owns every VM: the calls the
//! shim makes, implemented by the `k7d` binary over the daemon's API
//! socket (the shim crate never sees the API's wire format).

use std::path::PathBuf;

/// A pod VM as the shim asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodVmSpec {
    /// The VM id (derived from the sandbox: see `crate::names`).
    pub id: String,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The agent's initramfs.
    pub initramfs: PathBuf,
    /// The kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Read-only disks, in order: disk `i` is serial `k7d-disk<i>` in the guest.
    pub disks: Vec<PathBuf>,
    /// Empty read-only drives after the disks, for the images of app
    /// containers that join the pod later ([`Daemon::set_medium`]).
    pub empty_drives: u8,
    /// The pod's NIC, attached through k7d's datapath to the pod's
    /// interface in its network namespace; none without a pod network.
    pub nic: Option<PodNic>,
    /// A NIC on a bare tap of its own instead (a fork template's: each
    /// child's is attached to its pod's network at the fork; a warm pool
    /// member's: attached when a pod claims it).
    pub bare_nic: bool,
    /// The guest CID of its vsock.
    pub vsock_cid: u64,
    /// The host unix socket of its vsock (the agent is reached through it).
    pub vsock_uds: PathBuf,
}

/// A pod VM's NIC in the pod's network (`docs/datapath.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodNic {
    /// The pod's network namespace (the CNI's).
    pub netns: PathBuf,
    /// The pod's interface there (`eth0`).
    pub pod_if: String,
    /// `direct`, `bridge` or `auto`.
    pub mode: String,
    /// The pod UID (the datapath's policy identity).
    pub pod_uid: Option<String>,
    /// The pod's namespace and name (labels of the daemon's metrics).
    pub pod_namespace: Option<String>,
    pub pod_name: Option<String>,
}

/// A pod VM forked from a template (`crate::template`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForkedPod {
    /// The child's VM id.
    pub id: String,
    /// Its NIC 0 in the pod's network (the template's is a bare tap).
    pub nic: Option<PodNic>,
    /// Its vsock's host socket.
    pub vsock_uds: PathBuf,
}

/// A VM's life as the daemon reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmLife {
    /// Its vCPUs run.
    Running,
    /// Paused.
    Paused,
    /// Stopped, with the daemon's reason.
    Stopped(String),
    /// The daemon has no such VM.
    Gone,
    /// The daemon's socket refuses connections or is missing: the daemon
    /// is gone, and its VMs with it.
    DaemonGone,
}

/// The daemon calls. Every error is one sentence that says what failed and
/// where the shim looked (the socket path).
pub trait Daemon: Send + Sync {
    /// Create and start a VM.
    fn create(&self, spec: &PodVmSpec) -> anyhow::Result<()>;
    /// Fork the (paused) VM `template` into a running child.
    fn fork(&self, template: &str, child: &ForkedPod) -> anyhow::Result<()>;
    /// Stop and remove a VM; a VM the daemon does not have is not an error.
    fn delete(&self, id: &str) -> anyhow::Result<()>;
    /// Pause a VM's vCPUs and devices.
    fn pause(&self, id: &str) -> anyhow::Result<()>;
    /// Resume it.
    fn resume(&self, id: &str) -> anyhow::Result<()>;
    /// The VM's life; an unreachable daemon is an error.
    fn life(&self, id: &str) -> anyhow::Result<VmLife>;
    /// Puts the read-only image at `path` into drive `disk` of VM `id`, or
    /// ejects its medium (`None`); the guest sees the capacity change.
    fn set_medium(&self, id: &str, disk: u32, path: Option<&std::path::Path>) -> anyhow::Result<()>;
    /// Attaches NIC 0 of VM `id`, on a bare tap, to the pod's network
    /// (a claimed warm pool member's), running or paused.
    fn attach_nic(&self, id: &str, nic: &PodNic) -> anyhow::Result<()>;
    /// The daemon's pid (reported to containerd as the task's pid, as Kata
    /// reports its hypervisor's: no container process runs on the host).
    fn pid(&self) -> anyhow::Result<u32>;
    /// The pid of VM `id`'s own process (`k7d daemon --jail on`), `None`
    /// when it runs inside the daemon.
    fn vm_pid(&self, id: &str) -> anyhow::Result<Option<u32>>;
    /// Moves VM `id`'s process into a leaf under the pod's cgroup
    /// `cgroup_parent` (a path from the cgroup v2 root).
    fn pod_cgroup(&self, id: &str, cgroup_parent: &str) -> anyhow::Result<()>;
}

use std::path::PathBuf;

/// Errors of k7d-net; each message is one sentence naming the object and
/// the reason.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A netlink request failed at the protocol level.
    #[error("netlink request to {op} failed: {reason}")]
    Netlink { op: String, reason: String },
    /// A system call (or a netlink request the kernel refused) failed.
    #[error("could not {op}: {source}")]
    Os {
        op: String,
        #[source]
        source: std::io::Error,
    },
    /// A caller-supplied value was refused before anything was touched.
    #[error("{what} is invalid: {reason}")]
    Invalid { what: String, reason: String },
    /// The pod-side interface does not exist in the pod netns.
    #[error("pod interface {iface} does not exist in netns {netns}")]
    PodIfMissing { iface: String, netns: PathBuf },
    /// The l2 uplink interface does not exist.
    #[error("uplink interface {iface} does not exist in netns {netns}")]
    UplinkMissing { iface: String, netns: PathBuf },
    /// No l2-uplink state exists for the interface.
    #[error("uplink {iface} has no l2-uplink programs attached (nothing pinned at {dir})")]
    UplinkNotAttached { iface: String, dir: PathBuf },
    /// `direct` mode was requested but cannot be used.
    #[error("the direct datapath cannot be used for VM {vm} NIC {nic}: {reason}")]
    DirectRefused { vm: String, nic: u16, reason: String },
    /// The VM has no NIC with bpf state (policy needs the programs).
    #[error("VM {0} has no NIC with datapath programs attached")]
    NoPrograms(String),
    /// A bpf loader or map error.
    #[error(transparent)]
    Bpf(#[from] k7d_bpf::BpfError),
}

impl NetError {
    pub(crate) fn os(op: impl Into<String>, source: std::io::Error) -> Self {
        NetError::Os { op: op.into(), source }
    }
}

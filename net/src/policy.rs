//! The virtio-net data-plane policy: vhost on or off, and how many queue
//! pairs a NIC gets.
//!
//! A pure function of the node's configuration, the NIC's request, the VM's
//! vCPU count and whether `/dev/vhost-net` can be opened. The rules (from the
//! dstack vhost-net multiqueue review, see `docs/virtio-net.md`):
//!
//! - vhost is opt-in: the node default is off, a NIC may ask either way;
//! - with vhost on, queue pairs default to `min(vCPUs, 16)` and never exceed
//!   the node's `max_net_queues`; without vhost the default is 1;
//! - an explicit queue count is honoured with or without vhost, but a count
//!   over `max_net_queues` is refused with a sentence naming the cap;
//! - `max_net_queues` must be 1..=64, checked when the node config loads;
//! - when `/dev/vhost-net` is missing or cannot be opened, a NIC that only
//!   inherited vhost from the node falls back to userspace with one warning,
//!   and a NIC that asked for vhost explicitly fails with the reason.
//!
//! The result ([`EffectiveDataPlane`]) is settled once when the NIC is built;
//! the caller records it and reports that record (its `Display` is the
//! `info` line, `vhost: on, queues: 2`). It must never be recomputed later
//! from configuration that may have changed since.

use std::fmt;
use std::path::Path;

use thiserror::Error;

/// Hard ceiling on `max_net_queues` from any source.
pub const MAX_NET_QUEUES_LIMIT: u16 = 64;
/// The vCPU-scaled default never goes above this, whatever the node's cap:
/// raising `max_net_queues` widens what a NIC may ask for, not the default.
pub const DEFAULT_QUEUE_SCALING_CAP: u16 = 16;
/// `max_net_queues` when the node config does not set it.
pub const DEFAULT_MAX_NET_QUEUES: u16 = 16;
/// The kernel vhost-net device.
pub const VHOST_NET_PATH: &str = "/dev/vhost-net";

/// Why the policy refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PolicyError {
    /// The node's `max_net_queues` is outside 1..=64 (config load).
    #[error("max_net_queues = {0} is out of range: it must be between 1 and 64")]
    MaxQueuesOutOfRange(u16),
    /// A NIC asked for zero queue pairs.
    #[error("0 queue pairs requested, a NIC needs at least 1")]
    ZeroQueues,
    /// A NIC asked for more queue pairs than the node allows.
    #[error("{requested} queue pairs requested, this node allows at most {cap} (max_net_queues)")]
    OverCap {
        /// What the NIC asked for.
        requested: u16,
        /// The node's `max_net_queues`.
        cap: u16,
    },
    /// A NIC asked for vhost explicitly and the host cannot provide it.
    #[error("vhost-net was requested explicitly but cannot be used: {0}")]
    VhostUnavailable(String),
}

/// The node's networking settings, validated at config load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeNetConfig {
    vhost_default: bool,
    max_net_queues: u16,
}

impl Default for NodeNetConfig {
    /// vhost off (opt-in), `max_net_queues` = 16.
    fn default() -> Self {
        Self {
            vhost_default: false,
            max_net_queues: DEFAULT_MAX_NET_QUEUES,
        }
    }
}

impl NodeNetConfig {
    /// Validates the node's settings; `max_net_queues` outside 1..=64 is
    /// refused with a sentence. Call this when the node config loads.
    pub fn new(vhost_default: bool, max_net_queues: u16) -> Result<Self, PolicyError> {
        if !(1..=MAX_NET_QUEUES_LIMIT).contains(&max_net_queues) {
            return Err(PolicyError::MaxQueuesOutOfRange(max_net_queues));
        }
        Ok(Self {
            vhost_default,
            max_net_queues,
        })
    }

    /// Whether NICs that do not say get vhost.
    pub fn vhost_default(&self) -> bool {
        self.vhost_default
    }

    /// The most queue pairs one NIC may have.
    pub fn max_net_queues(&self) -> u16 {
        self.max_net_queues
    }
}

/// What one NIC asks for; `None` inherits the node's behaviour.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicNetRequest {
    /// `Some(true)`/`Some(false)`: explicit; `None`: the node's default.
    pub vhost: Option<bool>,
    /// Explicit queue-pair count; `None`: the default for the data plane.
    pub queues: Option<u16>,
}

/// Whether `/dev/vhost-net` can be used on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VhostAvailability {
    /// It opened read-write.
    Available,
    /// It is missing or cannot be opened; the reason is a sentence fragment.
    Unavailable(String),
}

impl VhostAvailability {
    /// Opens `path` read-write (and closes it) to see whether vhost-net can be
    /// used. Only call this when a NIC may use vhost.
    pub fn probe(path: &Path) -> Self {
        match std::fs::OpenOptions::new().read(true).write(true).open(path) {
            Ok(_) => Self::Available,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Self::Unavailable(format!("{} does not exist (is vhost_net loaded?)", path.display()))
            }
            Err(e) => Self::Unavailable(format!("{} cannot be opened: {e}", path.display())),
        }
    }
}

/// The data plane a NIC actually gets, settled once when it is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectiveDataPlane {
    /// Kernel vhost-net (true) or the userspace backend (false).
    pub vhost: bool,
    /// Queue pairs (tap queues, virtio-net `max_virtqueue_pairs`).
    pub queue_pairs: u16,
    /// The one warning to log when a defaulted NIC fell back to userspace.
    pub warning: Option<String>,
}

impl fmt::Display for EffectiveDataPlane {
    /// The `info` line: `vhost: on, queues: 2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "vhost: {}, queues: {}",
            if self.vhost { "on" } else { "off" },
            self.queue_pairs
        )
    }
}

/// Decides a NIC's data plane. `vhost` is only consulted when the NIC would
/// use vhost (pass [`VhostAvailability::probe`] of [`VHOST_NET_PATH`]).
pub fn effective_data_plane(
    node: &NodeNetConfig,
    nic: &NicNetRequest,
    vcpus: u16,
    vhost: &VhostAvailability,
) -> Result<EffectiveDataPlane, PolicyError> {
    if let Some(q) = nic.queues {
        if q == 0 {
            return Err(PolicyError::ZeroQueues);
        }
        if q > node.max_net_queues {
            return Err(PolicyError::OverCap {
                requested: q,
                cap: node.max_net_queues,
            });
        }
    }
    let wants_vhost = nic.vhost.unwrap_or(node.vhost_default);
    let mut warning = None;
    let use_vhost = match (wants_vhost, vhost) {
        (false, _) => false,
        (true, VhostAvailability::Available) => true,
        (true, VhostAvailability::Unavailable(reason)) => {
            if nic.vhost == Some(true) {
                return Err(PolicyError::VhostUnavailable(reason.clone()));
            }
            warning = Some(format!(
                "vhost-net is the node default but {reason}; this NIC uses the userspace backend"
            ));
            false
        }
    };
    let queue_pairs = match nic.queues {
        Some(q) => q,
        None if use_vhost => vcpus.clamp(1, DEFAULT_QUEUE_SCALING_CAP.min(node.max_net_queues)),
        None => 1,
    };
    Ok(EffectiveDataPlane {
        vhost: use_vhost,
        queue_pairs,
        warning,
    })
}

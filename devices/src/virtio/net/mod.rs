//! virtio-net, userspace backend over a multiqueue tap.
//!
//! - N queue pairs (`VIRTIO_NET_F_MQ`, `max_virtqueue_pairs` = N in config)
//!   plus a control queue (`VIRTIO_NET_F_CTRL_VQ`, only
//!   `VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET`); queue 2k is RX of pair k, 2k+1 its
//!   TX, 2N the control queue.
//! - **One worker thread per queue pair**, owning tap queue k
//!   (`IFF_MULTI_QUEUE`): TX pops chains and `writev`s them straight from
//!   guest memory into the tap; RX reads frames (when the tap is readable and
//!   RX buffers are posted) into a bounce buffer and copies them into the
//!   guest's buffers with vm-memory's `write_slice`, so the device's dirty
//!   bitmap records every byte. One interrupt per batch. Worker 0 also
//!   serves the control queue.
//! - Offloads: `CSUM`/`HOST_TSO4`/`HOST_TSO6` (the guest may send partial
//!   checksums and GSO frames, which the tap accepts as is) and
//!   `GUEST_CSUM`/`GUEST_TSO4`/`GUEST_TSO6` (mapped to `TUNSETOFFLOAD` at
//!   activation, so the tap hands us only what the guest accepted). Frames
//!   carry the 12-byte `virtio_net_hdr_v1`; `MRG_RXBUF` is not offered.
//! - Tap queues beyond the pairs the guest enabled are detached
//!   (`TUNSETQUEUE`), so the kernel never steers frames to a queue nobody
//!   reads.
//! - Malformed chains are returned with length 0 (RX) or dropped (TX), never
//!   a panic; the device keeps serving.
//! - The tap is created by the VMM (`k7d_net::create_tap` with the name from
//!   `k7d_net::nic_names`, `vnet_hdr = true`, one queue per pair); the device
//!   takes the [`k7d_sys::tap::Tap`].
//! - Or the kernel vhost-net data plane ([`Net::new_vhost`], [`vhost`]): one
//!   `/dev/vhost-net` per pair serves the rings; the control queue stays in
//!   a small userspace worker.
//! - Snapshot/restore ([`persist`]): the enabled queue pairs, checked MAC and pair count.
//!
//! See `docs/virtio-net.md`.

mod ctrl;
mod device;
mod event_handler;
#[doc(hidden)]
pub mod fuzz;
pub mod persist;
mod tap_queue;
pub mod vhost;

use thiserror::Error;

pub use device::{Net, NetConfig, NetStats, QueuePairStats};
pub use vhost::{VhostDirtyLog, VhostOptions, open_vhost_net};

/// Size of every queue.
pub const QUEUE_SIZE: u16 = 256;
/// `virtio_net_hdr_v1` (with `num_buffers`): what VERSION_1 uses and the tap is set to.
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame the tap can hand us (64 KiB GSO plus an Ethernet header and slack).
pub const MAX_FRAME_LEN: usize = 65_550;
/// Most queue pairs a device may have (the policy's hard ceiling).
pub const MAX_QUEUE_PAIRS: u16 = 64;
/// Frames handled per queue before signalling the guest (interrupt batching
/// bound, so a busy queue still interrupts regularly).
pub const BATCH: usize = 64;

/// Errors building a virtio-net device.
#[derive(Debug, Error)]
pub enum NetError {
    /// The queue-pair count is unusable.
    #[error("{0} queue pairs requested, a virtio-net device has between 1 and 64")]
    QueuePairs(u16),
    /// The tap's queue count does not match the device's.
    #[error("the tap has {tap} queue fd(s) but the device has {pairs} queue pair(s)")]
    TapQueues {
        /// Fds in the tap.
        tap: usize,
        /// Queue pairs asked for.
        pairs: u16,
    },
    /// The tap was opened without `IFF_VNET_HDR`.
    #[error("tap {0} was opened without IFF_VNET_HDR, which the virtio-net device needs")]
    NoVnetHdr(String),
    /// A tap ioctl failed.
    #[error("configuring tap {tap} failed: {what}")]
    Tap {
        /// The tap's name.
        tap: String,
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `/dev/vhost-net` could not be opened.
    #[error("cannot open {path}: {reason}")]
    VhostOpen {
        /// The device node.
        path: &'static str,
        /// The OS error.
        reason: std::io::Error,
    },
    /// A vhost ioctl failed.
    #[error("vhost-net {op} failed on queue pair {pair}: {reason}")]
    Vhost {
        /// Queue pair.
        pair: u16,
        /// The operation.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// Guest memory the kernel cannot map.
    #[error("guest memory has {0} regions; vhost-net takes between 1 and 64")]
    VhostMemory(usize),
    /// The kernel's vhost-net lacks a feature k7d needs.
    #[error("the kernel's vhost-net lacks {0}, which k7d needs")]
    VhostFeature(&'static str),
}

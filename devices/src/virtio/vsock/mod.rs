//! virtio-vsock (device type 19) with a Firecracker-style "hybrid" host side.
//!
//! The guest sees a standard virtio-vsock device (rx, tx and event queues; the
//! config space holds its CID). The host side is a unix socket, `uds_path`:
//!
//! - **host → guest**: a host process connects to `uds_path`, writes
//!   `CONNECT <port>\n`; the device asks the guest to accept a connection on
//!   `<port>` (VSOCK_OP_REQUEST) and, once the guest answers, writes
//!   `OK <local_port>\n` back. From then on the unix stream carries the bytes.
//! - **guest → host**: a guest connection to host CID 2, port `P`, is bridged to
//!   a unix socket listening at `<uds_path>_P`; no listener there means RST.
//!
//! Flow control is virtio-vsock's credit scheme (buf_alloc / fwd_cnt). One
//! worker thread serves the queues and every host stream (see
//! `event_handler.rs` and `muxer.rs`); every byte it writes into guest RAM
//! (RX headers and payloads, used-ring entries) goes through vm-memory, so the
//! device's dirty bitmap records it. Details: `docs/vsock.md`.
//!
//! The kernel vhost-vsock backend is a stub ([`vhost::VhostVsock`]) that
//! returns an explicit error. A snapshot or fork carries no connection: the
//! restored device resets the guest's (`persist.rs`).

mod connection;
mod device;
mod event_handler;
mod muxer;
pub mod persist;
pub mod vhost;

pub use device::Vsock;

use std::path::PathBuf;

use thiserror::Error;

/// Number of queues: rx, tx, event.
pub const NUM_QUEUES: usize = 3;
/// Maximum size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the RX queue (device → driver packets).
pub const RXQ: u16 = 0;
/// Index of the TX queue (driver → device packets).
pub const TXQ: u16 = 1;
/// Index of the event queue (transport resets only).
pub const EVQ: u16 = 2;

/// The host's CID, as the guest addresses it.
pub const VSOCK_HOST_CID: u64 = 2;
/// Largest payload accepted in one TX packet / written into one RX buffer.
pub const MAX_PKT_BUF_SIZE: u32 = 64 * 1024;
/// Receive buffer the device advertises per connection (bytes it will hold
/// for a slow host stream before the guest must wait for credit).
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Most simultaneous connections (host- and guest-initiated together).
pub const MAX_CONNECTIONS: usize = 1024;
/// First port the device hands out for host-initiated connections.
pub const LOCAL_PORT_BASE: u32 = 1 << 30;

/// Packet operations (virtio 1.2 §5.10.6).
pub mod op {
    /// Connection request.
    pub const REQUEST: u16 = 1;
    /// Connection accepted.
    pub const RESPONSE: u16 = 2;
    /// Connection reset.
    pub const RST: u16 = 3;
    /// Half or full shutdown (flags say which).
    pub const SHUTDOWN: u16 = 4;
    /// Data.
    pub const RW: u16 = 5;
    /// Credit information, unsolicited or answering a request.
    pub const CREDIT_UPDATE: u16 = 6;
    /// Asks the peer for a CREDIT_UPDATE.
    pub const CREDIT_REQUEST: u16 = 7;
}

/// The only event (virtio 1.2 §5.10.6.7): the guest resets its connections.
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;

/// `type` of stream sockets, the only one supported.
pub const VSOCK_TYPE_STREAM: u16 = 1;
/// SHUTDOWN flag: the sender will receive no more data.
pub const VSOCK_FLAGS_SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const VSOCK_FLAGS_SHUTDOWN_SEND: u32 = 2;

/// Errors from the vsock device and its backends.
#[derive(Debug, Error)]
pub enum VsockError {
    /// The CID is reserved (0, 1, 2 and `u32::MAX` are not guest CIDs).
    #[error("guest CID {0} is reserved or out of range (use 3..4294967295)")]
    BadCid(u64),
    /// Binding the host-side unix socket failed.
    #[error("binding the vsock unix socket at {path} failed")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Duplicating the listening socket for the worker failed.
    #[error("duplicating the vsock listening socket failed")]
    CloneListener(#[source] std::io::Error),
    /// The kernel vhost-vsock backend cannot be used.
    #[error("the vhost-vsock backend is unavailable: {reason}")]
    VhostUnavailable {
        /// Why (missing device node, or backend not implemented).
        reason: String,
    },
    /// A saved vsock state must be empty (connections are not carried).
    #[error("a saved vsock state holds {0} byte(s), but vsock carries no state (its connections are reset)")]
    BadState(usize),
}

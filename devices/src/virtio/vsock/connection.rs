//! One vsock connection: its host stream, state and credit accounting.

use std::io::{ErrorKind, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::CONN_BUF_ALLOC;

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ConnState {
    /// Host-initiated: REQUEST queued/sent to the guest, waiting for RESPONSE.
    LocalInit,
    /// Both sides agreed; data flows.
    Established,
}

/// A connection between a guest socket and a host unix stream.
#[derive(Debug)]
pub(super) struct Connection {
    pub(super) stream: UnixStream,
    pub(super) state: ConnState,
    /// epoll token of `stream`.
    pub(super) token: u64,
    /// The stream may have data (edge-triggered readiness not yet drained).
    pub(super) readable: bool,
    /// The host stream reached EOF (the host sends no more).
    pub(super) host_eof: bool,
    /// The guest said it will send no more.
    pub(super) guest_shut_send: bool,
    /// The guest said it will receive no more.
    pub(super) guest_shut_rcv: bool,
    /// Guest data not yet written to the host stream.
    pub(super) tx_buf: Vec<u8>,
    /// Bytes of guest data written to the host stream.
    pub(super) fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as last told to the guest.
    pub(super) last_fwd_cnt_sent: Wrapping<u32>,
    /// Bytes sent to the guest.
    pub(super) rx_cnt: Wrapping<u32>,
    /// The guest's receive buffer size.
    pub(super) peer_buf_alloc: u32,
    /// Bytes the guest has consumed.
    pub(super) peer_fwd_cnt: Wrapping<u32>,
    /// A CREDIT_REQUEST is outstanding (sent while the guest had no room).
    pub(super) credit_requested: bool,
}

impl Connection {
    pub(super) fn new(stream: UnixStream, state: ConnState, token: u64) -> Self {
        Self {
            stream,
            state,
            token,
            readable: true,
            host_eof: false,
            guest_shut_send: false,
            guest_shut_rcv: false,
            tx_buf: Vec::new(),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            credit_requested: false,
        }
    }

    /// Records the credit fields of a packet from the guest.
    pub(super) fn update_peer_credit(&mut self, buf_alloc: u32, fwd_cnt: u32) {
        self.peer_buf_alloc = buf_alloc;
        self.peer_fwd_cnt = Wrapping(fwd_cnt);
        self.credit_requested = false;
    }

    /// Bytes the guest can still take. A guest that reports more consumed than
    /// sent (or a shrunken buffer) gets 0, never a huge wrapped value.
    pub(super) fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether the host→guest direction wants an RX buffer now.
    pub(super) fn wants_rx(&self) -> bool {
        self.state == ConnState::Established
            && self.readable
            && !self.host_eof
            && !self.guest_shut_rcv
            && self.peer_credit() > 0
    }

    /// Whether the guest should be told about forwarded bytes unprompted.
    pub(super) fn needs_credit_update(&self) -> bool {
        (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CONN_BUF_ALLOC / 4
    }

    /// Writes as much of `tx_buf` to the host stream as it takes. Returns
    /// `Err` when the stream is broken.
    pub(super) fn flush(&mut self) -> std::io::Result<()> {
        let mut done = 0;
        while done < self.tx_buf.len() {
            match self.stream.write(&self.tx_buf[done..]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        self.tx_buf.drain(..done);
        self.fwd_cnt += Wrapping(done as u32);
        if self.tx_buf.is_empty() && self.guest_shut_send {
            // The guest sends no more and everything it sent is delivered.
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }
}

/// Connects to a unix socket without ever blocking: a listener whose backlog
/// is full (EAGAIN) counts as refusing, like one that does not exist.
pub(super) fn connect_nonblocking(path: &Path) -> std::io::Result<UnixStream> {
    k7d_sys::socket::connect_nonblocking(path)
}

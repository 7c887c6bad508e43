//! The host side of the hybrid vsock: the listening unix socket, host streams
//! still sending their `CONNECT <port>\n` line, and established connections,
//! keyed by (local port, guest port). It turns guest packets into stream I/O
//! and stream events into packets for the guest; it never touches guest
//! memory itself (the worker copies payloads in and out).

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::connection::{ConnState, Connection, connect_nonblocking};
use super::{
    CONN_BUF_ALLOC, LOCAL_PORT_BASE, MAX_CONNECTIONS, VSOCK_FLAGS_SHUTDOWN_RCV, VSOCK_FLAGS_SHUTDOWN_SEND,
    VSOCK_HOST_CID, VSOCK_TYPE_STREAM, op,
};

/// epoll token of the listening socket (the worker uses the ones below it).
pub(super) const TOKEN_LISTENER: u64 = 8;
const FIRST_STREAM_TOKEN: u64 = 16;
/// Longest `CONNECT <port>\n` line accepted.
const MAX_CONNECT_LINE: usize = 32;
/// Control packets the muxer may hold for the guest before the worker stops
/// taking TX packets (each TX packet yields at most one).
pub(super) const MAX_CONTROL_BACKLOG: usize = 2 * MAX_CONNECTIONS;

/// A vsock packet header, in host byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Hdr {
    pub(super) src_cid: u64,
    pub(super) dst_cid: u64,
    pub(super) src_port: u32,
    pub(super) dst_port: u32,
    pub(super) len: u32,
    pub(super) type_: u16,
    pub(super) op: u16,
    pub(super) flags: u32,
    pub(super) buf_alloc: u32,
    pub(super) fwd_cnt: u32,
}

/// A connection's identity: the host-side port and the guest-side port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct ConnKey {
    pub(super) local_port: u32,
    pub(super) peer_port: u32,
}

/// A host stream that has not finished its `CONNECT` line.
#[derive(Debug)]
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
}

/// Counters for what the muxer refused (tests and logs read them).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct MuxStats {
    /// TX packets dropped (wrong source CID).
    pub(super) dropped: u64,
    /// RSTs sent to the guest.
    pub(super) rst_sent: u64,
}

pub(super) struct Muxer {
    cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    conns: HashMap<ConnKey, Connection>,
    pending: HashMap<u64, PendingHost>,
    tokens: HashMap<u64, ConnKey>,
    /// Control packets (key, op, flags) waiting for an RX buffer.
    control: VecDeque<(ConnKey, u16, u32)>,
    next_token: u64,
    next_local_port: u32,
    pub(super) stats: MuxStats,
}

fn stream_events() -> EventSet {
    EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED
}

impl Muxer {
    /// `listener` must be non-blocking; it is added to `epoll`. Host-side
    /// ports are handed out from `first_local_port` (at least
    /// [`LOCAL_PORT_BASE`]).
    pub(super) fn new(
        cid: u64,
        uds_path: &Path,
        listener: UnixListener,
        epoll: Epoll,
        first_local_port: u32,
    ) -> std::io::Result<Self> {
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
        )?;
        Ok(Self {
            cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            epoll,
            conns: HashMap::new(),
            pending: HashMap::new(),
            tokens: HashMap::new(),
            control: VecDeque::new(),
            next_token: FIRST_STREAM_TOKEN,
            next_local_port: first_local_port.max(LOCAL_PORT_BASE),
            stats: MuxStats::default(),
        })
    }

    pub(super) fn epoll(&self) -> &Epoll {
        &self.epoll
    }

    /// Control packets waiting for RX buffers.
    pub(super) fn control_backlog(&self) -> usize {
        self.control.len()
    }

    fn alloc_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(FIRST_STREAM_TOKEN);
        t
    }

    fn alloc_local_port(&mut self) -> u32 {
        loop {
            let p = self.next_local_port;
            self.next_local_port = if p >= u32::MAX - 1 { LOCAL_PORT_BASE } else { p + 1 };
            // At most MAX_CONNECTIONS ports are taken, so this ends quickly.
            if !self.conns.keys().any(|k| k.local_port == p) {
                return p;
            }
        }
    }

    fn register(&self, stream: &UnixStream, token: u64, events: EventSet) -> std::io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            stream.as_raw_fd(),
            EpollEvent::new(events, token),
        )
    }

    fn deregister(&self, stream: &UnixStream) {
        let _ = self
            .epoll
            .ctl(ControlOperation::Delete, stream.as_raw_fd(), EpollEvent::default());
    }

    /// Handles readiness of the listener or a host stream.
    pub(super) fn handle_event(&mut self, token: u64, events: EventSet) {
        if token == TOKEN_LISTENER {
            self.accept_all();
        } else if self.pending.contains_key(&token) {
            self.read_connect_line(token);
        } else if let Some(key) = self.tokens.get(&token).copied() {
            let Some(conn) = self.conns.get_mut(&key) else {
                return;
            };
            if events.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR) {
                conn.readable = true;
            }
            if events.contains(EventSet::OUT) && !conn.tx_buf.is_empty() {
                if let Err(e) = conn.flush() {
                    debug!(port = key.peer_port, error = %e, "host stream write failed; resetting");
                    self.reset(key);
                    return;
                }
                if conn.needs_credit_update() {
                    self.control.push_back((key, op::CREDIT_UPDATE, 0));
                }
            }
        } else {
            debug!(token, "event for a stream that is already gone");
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.len() + self.pending.len() >= MAX_CONNECTIONS {
                        warn!(
                            max = MAX_CONNECTIONS,
                            "vsock connection limit reached; closing a host connection"
                        );
                        continue;
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        warn!(error = %e, "could not make a host vsock stream non-blocking; closing it");
                        continue;
                    }
                    let token = self.alloc_token();
                    if let Err(e) = self.register(
                        &stream,
                        token,
                        EventSet::IN | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
                    ) {
                        warn!(error = %e, "could not watch a host vsock stream; closing it");
                        continue;
                    }
                    self.pending.insert(
                        token,
                        PendingHost {
                            stream,
                            line: Vec::new(),
                        },
                    );
                    self.read_connect_line(token);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                // A peer that gave up before its accept: the next one may be fine.
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted) => continue,
                Err(e) => {
                    warn!(error = %e, "accepting on the vsock unix socket failed");
                    return;
                }
            }
        }
    }

    /// Reads the `CONNECT <port>\n` line one byte at a time (so nothing after
    /// it is consumed), then asks the guest for the connection.
    fn read_connect_line(&mut self, token: u64) {
        let Some(p) = self.pending.get_mut(&token) else {
            return;
        };
        let mut b = [0u8; 1];
        let port = loop {
            match p.stream.read(&mut b) {
                Ok(0) => break None,
                Ok(_) if b[0] == b'\n' => break parse_connect(&p.line),
                Ok(_) if p.line.len() >= MAX_CONNECT_LINE => break None,
                Ok(_) => p.line.push(b[0]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break None,
            }
        };
        let Some(p) = self.pending.remove(&token) else {
            return;
        };
        let Some(peer_port) = port else {
            debug!(line = %String::from_utf8_lossy(&p.line), "bad or missing CONNECT line; closing the host stream");
            self.deregister(&p.stream);
            return;
        };
        let key = ConnKey {
            local_port: self.alloc_local_port(),
            peer_port,
        };
        let ev = EpollEvent::new(stream_events(), token);
        if let Err(e) = self.epoll.ctl(ControlOperation::Modify, p.stream.as_raw_fd(), ev) {
            warn!(error = %e, "could not watch a host vsock stream; closing it");
            self.deregister(&p.stream);
            return;
        }
        debug!(local = key.local_port, port = peer_port, "host connects to the guest");
        self.tokens.insert(token, key);
        self.conns
            .insert(key, Connection::new(p.stream, ConnState::LocalInit, token));
        self.control.push_back((key, op::REQUEST, 0));
    }

    /// Removes a connection and tells the guest (RST).
    fn reset(&mut self, key: ConnKey) {
        self.remove(key);
        self.control.push_back((key, op::RST, 0));
    }

    /// Removes a connection silently (closes the host stream).
    fn remove(&mut self, key: ConnKey) {
        if let Some(c) = self.conns.remove(&key) {
            self.deregister(&c.stream);
            self.tokens.remove(&c.token);
        }
    }

    /// Handles one packet from the guest; `data` is its payload (RW only).
    pub(super) fn handle_tx(&mut self, h: &Hdr, data: &[u8]) {
        if h.src_cid != self.cid {
            self.stats.dropped += 1;
            debug!(src_cid = h.src_cid, "dropping a TX packet with a foreign source CID");
            return;
        }
        let key = ConnKey {
            local_port: h.dst_port,
            peer_port: h.src_port,
        };
        if h.dst_cid != VSOCK_HOST_CID || h.type_ != VSOCK_TYPE_STREAM {
            debug!(
                dst_cid = h.dst_cid,
                type_ = h.type_,
                "unsupported destination or socket type"
            );
            if h.op != op::RST {
                self.control.push_back((key, op::RST, 0));
            }
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            match h.op {
                op::REQUEST => self.guest_connect(key, h),
                op::RST => {}
                _ => self.control.push_back((key, op::RST, 0)),
            }
            return;
        };
        conn.update_peer_credit(h.buf_alloc, h.fwd_cnt);
        match (conn.state, h.op) {
            (_, op::RST) => self.remove(key),
            (ConnState::LocalInit, op::RESPONSE) => {
                conn.state = ConnState::Established;
                let line = format!("OK {}\n", key.local_port);
                if let Err(e) = conn.stream.write_all(line.as_bytes()) {
                    debug!(error = %e, "host stream went away before OK; resetting");
                    self.reset(key);
                } else {
                    info!(
                        local = key.local_port,
                        port = key.peer_port,
                        "host vsock connection established"
                    );
                }
            }
            (ConnState::Established, op::RW) => {
                if conn.guest_shut_send || conn.tx_buf.len() + data.len() > CONN_BUF_ALLOC as usize {
                    warn!(
                        port = key.peer_port,
                        "guest sent data past shutdown or credit; resetting"
                    );
                    self.reset(key);
                    return;
                }
                conn.tx_buf.extend_from_slice(data);
                if let Err(e) = conn.flush() {
                    debug!(error = %e, "host stream write failed; resetting");
                    self.reset(key);
                    return;
                }
                if conn.needs_credit_update() {
                    self.control.push_back((key, op::CREDIT_UPDATE, 0));
                }
            }
            (ConnState::Established, op::CREDIT_UPDATE) => {}
            (ConnState::Established, op::CREDIT_REQUEST) => self.control.push_back((key, op::CREDIT_UPDATE, 0)),
            (ConnState::Established, op::SHUTDOWN) => {
                if h.flags & VSOCK_FLAGS_SHUTDOWN_RCV != 0 {
                    conn.guest_shut_rcv = true;
                }
                if h.flags & VSOCK_FLAGS_SHUTDOWN_SEND != 0 {
                    conn.guest_shut_send = true;
                }
                let flushed = conn.flush();
                let both = conn.guest_shut_rcv && conn.guest_shut_send;
                if flushed.is_err() || both || (conn.guest_shut_send && conn.host_eof) {
                    // Linux's close() sends both flags and waits for our RST.
                    self.reset(key);
                }
            }
            (state, o) => {
                debug!(?state, op = o, "unexpected packet for a connection; resetting");
                self.reset(key);
            }
        }
    }

    /// The guest connects to host port `key.local_port`: bridge it to
    /// `<uds_path>_<port>`, or refuse.
    fn guest_connect(&mut self, key: ConnKey, h: &Hdr) {
        if self.conns.len() + self.pending.len() >= MAX_CONNECTIONS {
            warn!(
                max = MAX_CONNECTIONS,
                "vsock connection limit reached; refusing a guest connection"
            );
            self.control.push_back((key, op::RST, 0));
            return;
        }
        let mut path = OsString::from(self.uds_path.as_os_str());
        path.push(format!("_{}", key.local_port));
        let path = PathBuf::from(path);
        let stream = match connect_nonblocking(&path) {
            Ok(s) => s,
            Err(e) => {
                debug!(path = %path.display(), error = %e, "no host listener for a guest connection; RST");
                self.control.push_back((key, op::RST, 0));
                return;
            }
        };
        let token = self.alloc_token();
        if let Err(e) = self.register(&stream, token, stream_events()) {
            warn!(error = %e, "could not watch a host vsock stream; refusing the guest connection");
            self.control.push_back((key, op::RST, 0));
            return;
        }
        let mut conn = Connection::new(stream, ConnState::Established, token);
        conn.update_peer_credit(h.buf_alloc, h.fwd_cnt);
        self.tokens.insert(token, key);
        self.conns.insert(key, conn);
        info!(
            port = key.local_port,
            guest_port = key.peer_port,
            "guest vsock connection established"
        );
        self.control.push_back((key, op::RESPONSE, 0));
    }

    /// Whether a packet is ready for the guest.
    pub(super) fn has_rx_work(&self) -> bool {
        !self.control.is_empty() || self.conns.values().any(Connection::wants_rx)
    }

    fn header(&mut self, key: ConnKey, op: u16, flags: u32, len: u32) -> Hdr {
        let mut h = Hdr {
            src_cid: VSOCK_HOST_CID,
            dst_cid: self.cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            len,
            type_: VSOCK_TYPE_STREAM,
            op,
            flags,
            buf_alloc: 0,
            fwd_cnt: 0,
        };
        if let Some(c) = self.conns.get_mut(&key) {
            h.buf_alloc = CONN_BUF_ALLOC;
            h.fwd_cnt = c.fwd_cnt.0;
            c.last_fwd_cnt_sent = c.fwd_cnt;
        }
        if op == op::RST {
            self.stats.rst_sent += 1;
        }
        h
    }

    /// The next packet for the guest: control packets first, then data read
    /// from a host stream into `data` (at most the guest's credit). Returns
    /// the header and the payload length, or `None` when nothing fits.
    pub(super) fn next_rx(&mut self, data: &mut [u8]) -> Option<(Hdr, usize)> {
        loop {
            if let Some((key, o, flags)) = self.control.pop_front() {
                return Some((self.header(key, o, flags, 0), 0));
            }
            if data.is_empty() {
                return None;
            }
            let key = self.conns.iter().find(|(_, c)| c.wants_rx()).map(|(k, _)| *k)?;
            let conn = self.conns.get_mut(&key)?;
            let want = data.len().min(conn.peer_credit() as usize);
            match conn.stream.read(&mut data[..want]) {
                Ok(0) => {
                    conn.host_eof = true;
                    if conn.guest_shut_send {
                        self.reset(key);
                    } else {
                        debug!(port = key.peer_port, "host stream ended; telling the guest");
                        self.control.push_back((key, op::SHUTDOWN, VSOCK_FLAGS_SHUTDOWN_SEND));
                    }
                }
                Ok(n) => {
                    conn.rx_cnt += std::num::Wrapping(n as u32);
                    return Some((self.header(key, op::RW, 0, n as u32), n));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => conn.readable = false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(error = %e, "host stream read failed; resetting");
                    self.reset(key);
                }
            }
        }
    }

    /// Asks the guest for credit on connections stalled with data to send.
    pub(super) fn request_credit_where_stalled(&mut self) {
        let stalled: Vec<ConnKey> = self
            .conns
            .iter_mut()
            .filter(|(_, c)| {
                c.state == ConnState::Established
                    && c.readable
                    && !c.host_eof
                    && !c.guest_shut_rcv
                    && c.peer_credit() == 0
                    && !c.credit_requested
            })
            .map(|(k, c)| {
                c.credit_requested = true;
                *k
            })
            .collect();
        for key in stalled {
            self.control.push_back((key, op::CREDIT_REQUEST, 0));
        }
    }
}

fn parse_connect(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?;
    let s = s.strip_suffix('\r').unwrap_or(s);
    s.strip_prefix("CONNECT ")?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_line_parsing() {
        assert_eq!(parse_connect(b"CONNECT 1234"), Some(1234));
        assert_eq!(parse_connect(b"CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect(b"CONNECT -1"), None);
        assert_eq!(parse_connect(b"CONNECT 99999999999"), None);
        assert_eq!(parse_connect(b"connect 1"), None);
        assert_eq!(parse_connect(b"\xff\xfe"), None);
        assert_eq!(parse_connect(b""), None);
    }
}

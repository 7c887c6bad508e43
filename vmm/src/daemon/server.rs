//! The API over a unix stream socket: one accept thread, one thread per
//! connection, line-delimited JSON.
//!
//! Bounds (`docs/security.md`): a connection is admitted only when its peer's
//! credentials (`SO_PEERCRED`) are allowed and fewer than
//! [`ServerConfig::max_connections`] are open; a refused client gets one
//! error line and is closed. A request runs once its whole line has arrived;
//! a line longer than [`MAX_REQUEST_BYTES`], a line not completed within
//! [`ServerConfig::line_timeout`], or an answer the client does not read
//! within that time ends the connection; so does
//! [`ServerConfig::idle_timeout`] without a request. The accept thread waits
//! on the listener and an eventfd, so shutdown never depends on the socket
//! file.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::api::{ApiError, ErrorCode, Response};
use super::{Daemon, DaemonError};
use crate::sys::PeerCred;

/// Longest request line accepted (a config is a few hundred bytes).
pub const MAX_REQUEST_BYTES: u64 = 1 << 20;

/// Default most connections served at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// Default time a client has to complete a line it started, and to read an
/// answer.
pub const DEFAULT_LINE_TIMEOUT: Duration = Duration::from_secs(10);

/// Default time a connection may stay open without a request.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Default time shutdown waits for connection threads (requests in flight).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long a daemon checking whether a socket file is live waits for it to
/// accept.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(1);

/// Who may use the API: a peer is allowed when its uid or its gid (as
/// `SO_PEERCRED` reports them at connect time) is listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// Allowed uids.
    pub uids: Vec<u32>,
    /// Allowed (primary, effective) gids.
    pub gids: Vec<u32>,
}

impl Access {
    /// Root, and this process's own uid when it is not root (whoever runs
    /// the daemon owns its VMs already).
    pub fn owner_only() -> Self {
        let mut uids = vec![0];
        let me = crate::sys::euid();
        if me != 0 {
            uids.push(me);
        }
        Self { uids, gids: Vec::new() }
    }

    /// Whether `peer` may use the API.
    pub fn allows(&self, peer: &PeerCred) -> bool {
        self.uids.contains(&peer.uid) || self.gids.contains(&peer.gid)
    }

    /// Whether anyone but root and this process's uid is allowed.
    fn beyond_owner(&self) -> bool {
        let me = crate::sys::euid();
        !self.gids.is_empty() || self.uids.iter().any(|&u| u != 0 && u != me)
    }

    fn describe(&self) -> String {
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        if self.gids.is_empty() {
            format!("uids {}", list(&self.uids))
        } else {
            format!("uids {} and gids {}", list(&self.uids), list(&self.gids))
        }
    }
}

impl Default for Access {
    fn default() -> Self {
        Self::owner_only()
    }
}

/// How the server bounds its clients.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Most connections served at once; one more is refused.
    pub max_connections: usize,
    /// Time to complete a started request line, and to read an answer.
    pub line_timeout: Duration,
    /// Time a connection may stay open without sending a request.
    pub idle_timeout: Duration,
    /// Who may connect.
    pub access: Access,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            line_timeout: DEFAULT_LINE_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            access: Access::default(),
        }
    }
}

/// Live connections by number: a clone of each stream, so shutdown can close
/// them. A connection thread removes its own entry when it ends, so no fd
/// outlives its connection; the map's size is the number of live connections.
type Conns = Arc<Mutex<HashMap<u64, UnixStream>>>;

/// A running API server.
pub struct Server {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    grace: Arc<Mutex<Duration>>,
    accept: Option<JoinHandle<()>>,
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> DaemonError {
    move |source| DaemonError::Io { what, source }
}

/// Makes `socket` free for a new listener: nothing there, or a stale socket
/// (nobody accepts on it: connecting is refused), which is removed. Any
/// other file, a symbolic link, or a socket something listens on is refused
/// and left as it is.
fn clear_socket_path(socket: &Path) -> Result<(), DaemonError> {
    let md = match std::fs::symlink_metadata(socket) {
        Ok(md) => md,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(io_err(format!("cannot look at the socket path {}", socket.display()))(
                e,
            ));
        }
    };
    let ft = md.file_type();
    if !ft.is_socket() {
        let kind = if ft.is_symlink() {
            "a symbolic link"
        } else if ft.is_dir() {
            "a directory"
        } else if ft.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        return Err(DaemonError::Refused(format!(
            "the socket path {} is {kind}, which k7d never removes: remove it yourself or choose another --socket",
            socket.display()
        )));
    }
    match crate::sys::connect_unix(socket, LIVENESS_TIMEOUT) {
        Ok(_) => Err(DaemonError::Refused(format!(
            "another daemon is listening on {}; stop it or choose another --socket",
            socket.display()
        ))),
        Err(e) if e.kind() == ErrorKind::TimedOut => Err(DaemonError::Refused(format!(
            "another process is listening on {} (it accepts no connection); stop it or choose another --socket",
            socket.display()
        ))),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            tracing::info!(socket = %socket.display(), "removing a stale socket nobody listens on");
            match std::fs::remove_file(socket) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_err(format!("cannot remove the stale socket {}", socket.display()))(
                    e,
                )),
            }
        }
        Err(e) => Err(io_err(format!(
            "cannot tell whether something listens on the socket {}",
            socket.display()
        ))(e)),
    }
}

impl Server {
    /// Binds `socket` (replacing only a stale socket) and serves `daemon`
    /// with the default bounds: root and this process's uid only.
    pub fn start(daemon: Arc<Daemon>, socket: &Path) -> Result<Self, DaemonError> {
        Self::start_with(daemon, socket, ServerConfig::default())
    }

    /// Binds `socket` (replacing only a stale socket) and serves `daemon`
    /// within the bounds of `cfg`.
    pub fn start_with(daemon: Arc<Daemon>, socket: &Path, cfg: ServerConfig) -> Result<Self, DaemonError> {
        if let Some(dir) = socket.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
        }
        clear_socket_path(socket)?;
        let listener = UnixListener::bind(socket).map_err(io_err(format!("cannot listen on {}", socket.display())))?;
        // Only root and the daemon's user can open a 0600 socket; when others
        // are allowed, the file lets everyone connect and the peer check decides.
        let mode = if cfg.access.beyond_owner() { 0o666 } else { 0o600 };
        let set_up = std::fs::set_permissions(socket, std::fs::Permissions::from_mode(mode))
            .map_err(io_err(format!("cannot set the mode of {}", socket.display())))
            .and_then(|()| {
                listener
                    .set_nonblocking(true)
                    .map_err(io_err(format!("cannot set up {}", socket.display())))
            });
        let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
            .map_err(io_err("cannot create the API thread's wake-up eventfd".into()));
        let wake = match set_up.and(wake) {
            Ok(w) => Arc::new(w),
            Err(e) => {
                let _ = std::fs::remove_file(socket);
                return Err(e);
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let grace = Arc::new(Mutex::new(DEFAULT_SHUTDOWN_GRACE));
        let (stop2, wake2, grace2) = (stop.clone(), wake.clone(), grace.clone());
        let access = cfg.access.describe();
        let spawned = std::thread::Builder::new().name("k7d-api".into()).spawn(move || {
            Acceptor {
                listener,
                daemon,
                stop: stop2,
                wake: wake2,
                grace: grace2,
                cfg: Arc::new(cfg),
                conns: Arc::new(Mutex::new(HashMap::new())),
                refusals: Refusals::default(),
            }
            .run()
        });
        let accept = match spawned {
            Ok(h) => h,
            Err(e) => {
                let _ = std::fs::remove_file(socket);
                return Err(io_err("cannot spawn the API thread".into())(e));
            }
        };
        tracing::info!(socket = %socket.display(), mode = format!("{mode:o}"), allowed = %access, "API listening");
        Ok(Self {
            path: socket.to_path_buf(),
            stop,
            wake,
            grace,
            accept: Some(accept),
        })
    }

    /// Stops accepting, closes every connection, joins every connection
    /// thread (up to [`DEFAULT_SHUTDOWN_GRACE`] for requests still running),
    /// removes the socket.
    pub fn shutdown(self) {
        self.shutdown_within(DEFAULT_SHUTDOWN_GRACE);
    }

    /// [`Server::shutdown`], waiting at most `grace` for connection threads
    /// whose request is still running; those are left to finish (or to die
    /// with the process).
    pub fn shutdown_within(mut self, grace: Duration) {
        *self.grace.lock().unwrap_or_else(|p| p.into_inner()) = grace;
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept thread; it needs no socket file for that.
        if let Err(e) = self.wake.write(1) {
            tracing::error!(error = %e, "cannot wake the API thread");
        }
        // The accept thread closes every connection and joins their threads.
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove the API socket"),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop_all();
        }
    }
}

/// Counts refused connections so a flood of them logs a line a second, not
/// one per connection.
#[derive(Default)]
struct Refusals {
    last_log: Option<Instant>,
    unlogged: u64,
}

impl Refusals {
    /// Whether to log this refusal now; `n` is how many went unlogged before it.
    fn log_now(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last_log
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            self.unlogged += 1;
            return None;
        }
        self.last_log = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

struct Acceptor {
    listener: UnixListener,
    daemon: Arc<Daemon>,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    grace: Arc<Mutex<Duration>>,
    cfg: Arc<ServerConfig>,
    conns: Conns,
    refusals: Refusals,
}

/// Writes one error line to a client that is not served, without waiting
/// for it (a fresh socket's buffer holds it), and closes the connection.
fn refuse(stream: UnixStream, code: ErrorCode, message: String) {
    let line = format!("{}\n", Response::err(ApiError::new(code, message)).to_line());
    let _ = stream.set_nonblocking(true);
    let _ = (&stream).write_all(line.as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

impl Acceptor {
    fn run(mut self) {
        let mut handles: Vec<JoinHandle<()>> = Vec::new();
        let mut next: u64 = 0;
        while !self.stop.load(Ordering::SeqCst) {
            let ready = crate::sys::poll_readable(&[&self.listener, &*self.wake], None);
            if let Err(e) = ready {
                tracing::error!(error = %e, "waiting for API connections failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            loop {
                let stream = match self.listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // Out of fds, say: back off instead of spinning on a
                        // listener that stays readable.
                        tracing::warn!(error = %e, "accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                        break;
                    }
                };
                handles.retain(|h| !h.is_finished());
                if let Some(h) = self.admit(stream, next) {
                    handles.push(h);
                }
                next += 1;
            }
        }
        drop(self.listener);
        for (_, s) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let grace = *self.grace.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + grace;
        while handles.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let busy = handles.iter().filter(|h| !h.is_finished()).count();
        if busy > 0 {
            tracing::warn!(
                connections = busy,
                grace_s = grace.as_secs_f64(),
                "requests still running after the shutdown grace; not waiting for them"
            );
        }
        for h in handles.into_iter().filter(|h| h.is_finished()) {
            let _ = h.join();
        }
    }

    /// Checks a new connection's peer and the connection cap, then serves it
    /// on a thread of its own.
    fn admit(&mut self, stream: UnixStream, n: u64) -> Option<JoinHandle<()>> {
        let peer = match crate::sys::peer_cred(&stream) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "API connection refused: its peer credentials cannot be read");
                refuse(
                    stream,
                    ErrorCode::PermissionDenied,
                    "the daemon cannot read this connection's credentials, so it does not serve it".into(),
                );
                return None;
            }
        };
        if !self.cfg.access.allows(&peer) {
            if let Some(more) = self.refusals.log_now() {
                tracing::warn!(
                    pid = peer.pid,
                    uid = peer.uid,
                    gid = peer.gid,
                    allowed = %self.cfg.access.describe(),
                    refused_since_last_line = more,
                    "API connection refused: its peer is not allowed"
                );
            }
            refuse(
                stream,
                ErrorCode::PermissionDenied,
                format!(
                    "uid {} (gid {}) may not use this k7d daemon, which serves {} (see `k7d daemon --allow-uid/--allow-gid`)",
                    peer.uid,
                    peer.gid,
                    self.cfg.access.describe()
                ),
            );
            return None;
        }
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        if conns.len() >= self.cfg.max_connections {
            drop(conns);
            if let Some(more) = self.refusals.log_now() {
                tracing::warn!(
                    pid = peer.pid,
                    uid = peer.uid,
                    max = self.cfg.max_connections,
                    refused_since_last_line = more,
                    "API connection refused: the connection cap is reached"
                );
            }
            refuse(
                stream,
                ErrorCode::Busy,
                format!(
                    "the daemon already serves its maximum of {} connections; try again later",
                    self.cfg.max_connections
                ),
            );
            return None;
        }
        let Ok(clone) = stream.try_clone() else {
            return None;
        };
        conns.insert(n, clone);
        drop(conns);
        let (d, c, cfg) = (self.daemon.clone(), self.conns.clone(), self.cfg.clone());
        let spawned = std::thread::Builder::new().name("k7d-conn".into()).spawn(move || {
            // Leaves the table (closing the clone kept for shutdown) however
            // serve_conn ends, a panic included: a slot is never lost.
            let _slot = ConnSlot(c, n);
            serve_conn(stream, &d, &cfg, peer);
        });
        match spawned {
            Ok(h) => Some(h),
            Err(e) => {
                self.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&n);
                tracing::warn!(error = %e, "cannot spawn a connection thread");
                None
            }
        }
    }
}

/// A connection's entry in the table of open connections, removed on drop.
struct ConnSlot(Conns, u64);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.1);
    }
}

fn write_line(mut out: &UnixStream, line: &str) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(line.len() + 1);
    buf.extend_from_slice(line.as_bytes());
    buf.push(b'\n');
    out.write_all(&buf)
}

fn err_line(code: ErrorCode, message: String) -> String {
    Response::err(ApiError::new(code, message)).to_line()
}

/// Serves one connection: reads request lines (each runs once it arrived
/// whole) and writes one answer per request, within the bounds of `cfg`.
fn serve_conn(stream: UnixStream, daemon: &Daemon, cfg: &ServerConfig, peer: PeerCred) {
    let _counted = daemon.metrics().connection();
    // An answer the client does not read within the line timeout ends the connection.
    if stream.set_write_timeout(Some(cfg.line_timeout)).is_err() {
        return;
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    // When the connection last went idle (no partial line), and when the
    // partial line in `buf` started.
    let mut idle_since = Instant::now();
    let mut line_started: Option<Instant> = None;
    // How much of `buf` is known to hold no newline: each byte is looked at
    // once, however slowly a long line trickles in.
    let mut scanned = 0;
    loop {
        // Every complete line, in order.
        while let Some(off) = buf[scanned..].iter().position(|&b| b == b'\n') {
            let pos = scanned + off;
            scanned = 0;
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let now = match answer(&stream, daemon, &line) {
                Answer::End => return,
                // A blank line is no request: it keeps nothing alive.
                Answer::Blank => Instant::now(),
                Answer::Answered => {
                    idle_since = Instant::now();
                    idle_since
                }
            };
            line_started = (!buf.is_empty()).then_some(now);
        }
        scanned = buf.len();
        if buf.len() as u64 >= MAX_REQUEST_BYTES {
            let _ = write_line(
                &stream,
                &err_line(
                    ErrorCode::BadRequest,
                    format!("the request is longer than {MAX_REQUEST_BYTES} bytes"),
                ),
            );
            return;
        }
        let now = Instant::now();
        let deadline = match line_started {
            Some(t) => t + cfg.line_timeout,
            None => idle_since + cfg.idle_timeout,
        };
        if now >= deadline {
            if line_started.is_some() {
                tracing::debug!(
                    pid = peer.pid,
                    uid = peer.uid,
                    "API connection closed: a request line was not completed in time"
                );
                let _ = write_line(
                    &stream,
                    &err_line(
                        ErrorCode::BadRequest,
                        format!(
                            "the request line was not completed within {} s, so the daemon closes this connection",
                            cfg.line_timeout.as_secs_f64()
                        ),
                    ),
                );
            } else {
                tracing::debug!(pid = peer.pid, uid = peer.uid, "API connection closed: idle");
            }
            return;
        }
        if stream.set_read_timeout(Some(deadline - now)).is_err() {
            return;
        }
        let room = (MAX_REQUEST_BYTES as usize)
            .saturating_sub(buf.len())
            .clamp(1, chunk.len());
        match (&stream).read(&mut chunk[..room]) {
            Ok(0) => {
                // The client is done writing: a last line without its newline
                // is still a request (as it always was).
                if buf.iter().any(|b| !b.is_ascii_whitespace()) {
                    let _ = answer(&stream, daemon, &buf);
                }
                return;
            }
            Ok(n) => {
                if buf.is_empty() {
                    line_started = Some(Instant::now());
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

enum Answer {
    /// A request ran and its answer was written.
    Answered,
    /// The line was blank.
    Blank,
    /// The connection must end.
    End,
}

/// Runs one request line and writes its answer.
fn answer(stream: &UnixStream, daemon: &Daemon, line: &[u8]) -> Answer {
    let Ok(line) = std::str::from_utf8(line) else {
        let _ = write_line(
            stream,
            &err_line(
                ErrorCode::BadRequest,
                "the request could not be read: stream did not contain valid UTF-8".into(),
            ),
        );
        return Answer::End;
    };
    if line.trim().is_empty() {
        return Answer::Blank;
    }
    // A streamed exec's output lines go out before its answer.
    let mut emit = |l: &str| write_line(stream, l).is_ok();
    let resp = daemon.handle_line_with(line.trim_end(), Some(&mut emit));
    match write_line(stream, &resp) {
        Ok(()) => Answer::Answered,
        Err(_) => Answer::End,
    }
}

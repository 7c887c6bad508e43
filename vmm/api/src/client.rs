//! The CLI side of the API.
//!
//! Every wait is bounded by the client's timeout ([`DEFAULT_TIMEOUT`] unless
//! told otherwise): connecting, sending a request and reading its answer.
//! A daemon at its connection cap refuses a connection before reading
//! anything from it ([`ErrorCode::Busy`]); the client then connects again
//! until its timeout runs out.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::api::{self, ApiError, ErrorCode, Reply, Request, Response};

/// How long a client waits for the daemon by default: generous, because
/// `create`, `fork`, `snapshot` and `restore` of big VMs take time.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// A connection to a daemon.
pub struct Client {
    socket: PathBuf,
    timeout: Duration,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Whether a request was sent on this connection yet (a busy refusal
    /// only comes before the first one is read).
    used: bool,
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s} s")
    }
}

fn open(socket: &Path, timeout: Duration) -> Result<UnixStream, ApiError> {
    k7d_sys::socket::connect_with_timeout(socket, timeout).map_err(|e| {
        let msg = if e.kind() == ErrorKind::TimedOut {
            format!(
                "the k7d daemon at {} did not accept the connection within {} (--timeout)",
                socket.display(),
                secs(timeout)
            )
        } else if e.kind() == ErrorKind::PermissionDenied {
            format!(
                "this user may not open the k7d daemon's socket {} ({e}); a daemon serves root and its own user unless started with --allow-uid or --allow-gid",
                socket.display()
            )
        } else {
            format!(
                "cannot reach the k7d daemon at {} ({e}); start it with `k7d daemon`",
                socket.display()
            )
        };
        ApiError::new(ErrorCode::Internal, msg)
    })
}

impl Client {
    /// Connects to the daemon's socket; every wait is bounded by [`DEFAULT_TIMEOUT`].
    pub fn connect(socket: &Path) -> Result<Self, ApiError> {
        Self::connect_with_timeout(socket, DEFAULT_TIMEOUT)
    }

    /// Connects to the daemon's socket; connecting, and each request with
    /// its answer, wait at most `timeout`.
    pub fn connect_with_timeout(socket: &Path, timeout: Duration) -> Result<Self, ApiError> {
        let s = open(socket, timeout)?;
        Self::from_stream(socket, timeout, s)
    }

    fn from_stream(socket: &Path, timeout: Duration, s: UnixStream) -> Result<Self, ApiError> {
        let writer = s
            .try_clone()
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("socket clone failed: {e}")))?;
        Ok(Self {
            socket: socket.to_path_buf(),
            timeout,
            reader: BufReader::new(s),
            writer,
            used: false,
        })
    }

    /// Sends one request and returns its result as the daemon wrote it.
    pub fn call(&mut self, req: &Request) -> Result<Value, ApiError> {
        let line = api::request_line(req).map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidArgument,
                format!("the `{}` request cannot be written as JSON: {e}", req.op()),
            )
        })?;
        self.exchange(&line, &format!("`{}`", req.op()))?.into_result()
    }

    /// Sends one request and reads its result as the type its op defines.
    pub fn request(&mut self, req: &Request) -> Result<Reply, ApiError> {
        let result = self.call(req)?;
        Reply::from_result(req, result).map_err(|e| {
            ApiError::new(
                ErrorCode::Internal,
                format!("the daemon's answer to `{}` is not its result: {e}", req.op()),
            )
        })
    }

    /// Sends a raw line (tests use this for malformed input).
    pub fn call_raw(&mut self, line: &str) -> Result<Response, ApiError> {
        self.exchange(line, "the request")
    }

    /// Sends `line` and reads one answer, within the timeout; a busy
    /// refusal of a fresh connection is retried on a new one.
    fn exchange(&mut self, line: &str, what: &str) -> Result<Response, ApiError> {
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_millis(20);
        loop {
            let fresh = !self.used;
            self.used = true;
            let resp = self.send_and_read(line, what, deadline)?;
            let busy = resp.error.as_ref().is_some_and(|e| e.code == ErrorCode::Busy);
            if !(busy && fresh) {
                return Ok(resp);
            }
            // Nothing was read from the refused connection: the request did
            // not run. Try a new connection until the timeout.
            let now = Instant::now();
            if now + pause >= deadline {
                let e = resp.error.unwrap_or_else(|| ApiError::new(ErrorCode::Busy, ""));
                return Err(ApiError::new(
                    ErrorCode::Busy,
                    format!(
                        "the k7d daemon at {} kept refusing connections for {} (--timeout): {}",
                        self.socket.display(),
                        secs(self.timeout),
                        e.message
                    ),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
            let s = open(&self.socket, deadline.saturating_duration_since(Instant::now()))?;
            *self = Self::from_stream(&self.socket.clone(), self.timeout, s)?;
            self.used = false;
        }
    }

    fn send_and_read(&mut self, line: &str, what: &str, deadline: Instant) -> Result<Response, ApiError> {
        let timed_out = |what: &str, socket: &Path, timeout: Duration| {
            ApiError::new(
                ErrorCode::Internal,
                format!(
                    "the k7d daemon at {} did not answer {what} within {} (--timeout); the request may still complete there",
                    socket.display(),
                    secs(timeout)
                ),
            )
        };
        let io = |e: std::io::Error| ApiError::new(ErrorCode::Internal, format!("daemon connection failed: {e}"));
        let left = |deadline: Instant| {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        self.writer.set_write_timeout(Some(left(deadline))).map_err(io)?;
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        // A daemon that refused this connection has closed it: the write may
        // fail, and its refusal line is still there to read.
        let sent = self.writer.write_all(&buf);
        if let Err(e) = &sent
            && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
        {
            return Err(timed_out(what, &self.socket, self.timeout));
        }
        let mut resp = String::new();
        loop {
            self.reader
                .get_ref()
                .set_read_timeout(Some(left(deadline)))
                .map_err(io)?;
            match self.reader.read_line(&mut resp) {
                Ok(_) => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    if Instant::now() >= deadline {
                        return Err(timed_out(what, &self.socket, self.timeout));
                    }
                }
                Err(e) => {
                    return Err(io(sent.err().unwrap_or(e)));
                }
            }
        }
        if resp.is_empty() {
            return Err(match sent {
                Err(e) => io(e),
                Ok(()) => ApiError::new(ErrorCode::Internal, "the daemon closed the connection"),
            });
        }
        serde_json::from_str(&resp)
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("the daemon sent an invalid response: {e}")))
    }
}

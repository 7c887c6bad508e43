//! The shim's side of the agent protocol (`k7d_agent::proto`): a
//! connection through the pod VM's hybrid vsock socket.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k7d_agent::proto::{self, FrameError, Reply, Request, Response};

/// Why a call failed.
#[derive(Debug)]
pub enum CallError {
    /// The agent answered an error; `not_found` when the container or
    /// process does not exist.
    Refused {
        /// The agent's sentence.
        message: String,
        /// containerd's NotFound.
        not_found: bool,
    },
    /// The connection failed (the VM or the agent is gone, or a timeout).
    Lost(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused { message, .. } => write!(f, "the guest agent refused: {message}"),
            Self::Lost(why) => write!(f, "the guest agent is unreachable: {why}"),
        }
    }
}

impl std::error::Error for CallError {}

/// Where a pod VM's agent is reached.
#[derive(Debug, Clone)]
pub struct Agent {
    uds: PathBuf,
    limits: Limits,
}

/// How long the shim waits for the agent's answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Any call (a start, an exec or a kill runs runc in the guest).
    pub call: Duration,
    /// A container's create (its disks, then `runc create`).
    pub create: Duration,
}

impl Limits {
    /// For a guest whose runc commands may each take up to `runc`: past
    /// the agent's own bounds, so a slow guest answers with its reason
    /// (a create waits up to 10 s for each of two disks first).
    pub fn for_runc(runc: Duration) -> Self {
        Self {
            call: Duration::from_secs(30).max(runc + Duration::from_secs(30)),
            create: runc + Duration::from_secs(60),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::for_runc(Duration::from_secs(proto::DEFAULT_RUNC_TIMEOUT_S))
    }
}

/// One connection to the agent, past `Hello`.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
}

impl Agent {
    /// The agent behind the VM's vsock socket `uds`.
    pub fn new(uds: &Path) -> Self {
        Self {
            uds: uds.to_path_buf(),
            limits: Limits::default(),
        }
    }

    /// The same agent, waited for within `limits`.
    pub fn with_limits(self, limits: Limits) -> Self {
        Self { limits, ..self }
    }

    /// How long its answers are waited for.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A new connection: `CONNECT <port>`, the VMM's `OK`, then `Hello`.
    /// `timeout` bounds each step.
    pub fn connect(&self, timeout: Duration) -> anyhow::Result<Conn> {
        let mut stream = UnixStream::connect(&self.uds)
            .with_context(|| format!("cannot connect to the pod VM's vsock socket {}", self.uds.display()))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream
            .write_all(format!("CONNECT {}\n", proto::PORT).as_bytes())
            .context("cannot ask the pod VM's vsock for the agent's port")?;
        // The VMM's one-line answer, read a byte at a time so nothing past
        // it is consumed; a closed stream means nobody listens in the guest yet.
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        loop {
            match stream.read(&mut b) {
                Ok(0) => bail!("the guest agent is not listening on vsock port {} yet", proto::PORT),
                Ok(_) if b[0] == b'\n' => break,
                Ok(_) if line.len() < 32 => line.push(b[0]),
                Ok(_) => bail!("the pod VM's vsock answered a line over 32 bytes"),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("no answer from the pod VM's vsock"),
            }
        }
        if !line.starts_with(b"OK ") {
            bail!(
                "the pod VM's vsock answered {:?}, not OK",
                String::from_utf8_lossy(&line)
            );
        }
        let mut conn = Conn { stream };
        match conn.call(&Request::Hello {
            version: proto::VERSION,
        }) {
            Ok(Reply::Hello { version, .. }) if version == proto::VERSION => Ok(conn),
            Ok(other) => bail!(
                "the guest agent answered Hello with {other:?} (protocol version {})",
                proto::VERSION
            ),
            Err(e) => Err(e).context("the guest agent did not accept Hello"),
        }
    }

    /// Waits until the agent answers (the guest is booting), at most until `deadline`.
    pub fn wait_ready(&self, deadline: Instant, alive: impl Fn() -> anyhow::Result<()>) -> anyhow::Result<Conn> {
        let mut last = None;
        while Instant::now() < deadline {
            alive()?;
            match self.connect(Duration::from_secs(5)) {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        match last {
            Some(e) => Err(e).context("the guest agent did not answer before the boot deadline"),
            None => bail!("the guest agent did not answer before the boot deadline"),
        }
    }
}

impl Conn {
    /// One request and its answer.
    pub fn call(&mut self, req: &Request) -> Result<Reply, CallError> {
        proto::write_frame(&mut self.stream, req).map_err(|e| self.lost(e))?;
        match proto::read_frame::<_, Response>(&mut self.stream).map_err(|e| self.lost(e))? {
            Response::Ok(r) => Ok(r),
            Response::Err { message, not_found } => Err(CallError::Refused { message, not_found }),
        }
    }

    /// Runs a command in the VM itself on this connection (`Request::Run`):
    /// each chunk of its output to `output` as it comes (which answers
    /// false to give the run up: the connection is then dropped, and the
    /// agent kills the command), then how it ended. The connection is in
    /// step after an `Ok` or a `Refused` (it may be kept for the next
    /// call), not after a `Lost`. The caller sets the connection's timeout
    /// past the run's own.
    pub fn run(
        &mut self,
        run: &proto::Run,
        output: &mut dyn FnMut(proto::Stream, &[u8]) -> bool,
    ) -> Result<proto::Ran, CallError> {
        proto::write_frame(&mut self.stream, &Request::Run(run.clone())).map_err(|e| self.lost(e))?;
        loop {
            match proto::read_frame::<_, Response>(&mut self.stream).map_err(|e| self.lost(e))? {
                Response::Ok(Reply::Output { stream, data }) => {
                    if !output(stream, &data.0) {
                        let _ = self.stream.shutdown(std::net::Shutdown::Both);
                        return Err(CallError::Lost("its output is no longer read".into()));
                    }
                }
                Response::Ok(Reply::Ran(ran)) => return Ok(ran),
                Response::Ok(other) => {
                    return Err(CallError::Lost(format!(
                        "the guest agent answered a run with {other:?}"
                    )));
                }
                Response::Err { message, not_found } => return Err(CallError::Refused { message, not_found }),
            }
        }
    }

    /// Whether the connection is still open with nothing unread: one kept
    /// idle is worth reusing only then (the VM may have been stopped, or
    /// forked and restored, which closes its vsock connections).
    pub fn idle_and_open(&self) -> bool {
        k7d_sys::socket::idle_and_open(&self.stream)
    }

    /// Sets how long a call may wait for its answer (`None`: forever, for `Wait`).
    pub fn set_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.stream.set_read_timeout(t)
    }

    /// The connection, for a stream after `Attach`.
    pub fn into_stream(self) -> anyhow::Result<UnixStream> {
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(None)?;
        Ok(self.stream)
    }

    /// The failed call's reason: a read or write past the connection's
    /// limit is said as such (the socket reports it as EAGAIN).
    fn lost(&self, e: FrameError) -> CallError {
        match &e {
            FrameError::Io(io) if matches!(io.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                let limit = self.stream.read_timeout().ok().flatten();
                CallError::Lost(match limit {
                    Some(t) => format!("no answer within the call's limit of {} s", t.as_secs()),
                    None => "no answer within the call's limit".into(),
                })
            }
            _ => CallError::Lost(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limits_stay_above_the_agents_runc_limit() {
        let d = Limits::default();
        assert_eq!((d.call, d.create), (Duration::from_secs(90), Duration::from_secs(120)));
        let slow = Limits::for_runc(Duration::from_secs(900));
        assert!(slow.call > Duration::from_secs(900) && slow.create >= Duration::from_secs(900 + 20));
        let quick = Limits::for_runc(Duration::from_secs(1));
        assert_eq!(quick.call, Duration::from_secs(31));
    }

    #[test]
    fn a_call_past_its_limit_says_so() {
        let (ours, _silent_agent) = UnixStream::pair().unwrap();
        let mut conn = Conn { stream: ours };
        conn.set_timeout(Some(Duration::from_millis(1100))).unwrap();
        let e = conn
            .call(&Request::Hello {
                version: proto::VERSION,
            })
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "the guest agent is unreachable: no answer within the call's limit of 1 s"
        );
    }

    #[test]
    fn a_closed_agent_is_not_called_a_timeout() {
        let (ours, agent) = UnixStream::pair().unwrap();
        drop(agent);
        let mut conn = Conn { stream: ours };
        conn.set_timeout(Some(Duration::from_secs(5))).unwrap();
        let e = conn
            .call(&Request::Hello {
                version: proto::VERSION,
            })
            .unwrap_err()
            .to_string();
        assert!(!e.contains("limit"), "{e}");
        assert!(e.starts_with("the guest agent is unreachable: "), "{e}");
    }
}

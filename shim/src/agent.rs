//! The shim's side of the agent protocol (`k7d_agent::proto`): a
//! connection through the pod VM's hybrid vsock socket.

use std::io::{Read, Write};
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
}

/// One connection to the agent, past `Hello`.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
}

impl Agent {
    /// The agent behind the VM's vsock socket `uds`.
    pub fn new(uds: &Path) -> Self {
        Self { uds: uds.to_path_buf() }
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
        proto::write_frame(&mut self.stream, req).map_err(lost)?;
        match proto::read_frame::<_, Response>(&mut self.stream).map_err(lost)? {
            Response::Ok(r) => Ok(r),
            Response::Err { message, not_found } => Err(CallError::Refused { message, not_found }),
        }
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
}

fn lost(e: FrameError) -> CallError {
    CallError::Lost(e.to_string())
}

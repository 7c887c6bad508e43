//! A process's stdio: copies between containerd's FIFOs and the agent's
//! stream connections (`Request::Attach`), one thread per stream.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use k7d_agent::proto::{ProcessRef, Reply, Request, Stream};

use crate::agent::Agent;

/// containerd's FIFO paths for one process (empty: not wanted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Paths {
    /// stdin.
    pub stdin: String,
    /// stdout.
    pub stdout: String,
    /// stderr.
    pub stderr: String,
    /// A pty: stdout carries it, stderr is unused.
    pub terminal: bool,
}

impl Paths {
    /// What the agent must prepare.
    pub fn spec(&self) -> k7d_agent::proto::StdioSpec {
        k7d_agent::proto::StdioSpec {
            terminal: self.terminal,
            stdin: !self.stdin.is_empty(),
            stdout: !self.stdout.is_empty(),
            stderr: !self.stderr.is_empty() && !self.terminal,
        }
    }
}

/// The running copies of one process's stdio.
#[derive(Debug)]
pub struct Relays {
    /// The shim's own writer on the stdin FIFO (as runc's shim keeps one):
    /// the process sees EOF only after CloseIO, once what containerd wrote
    /// has been copied, not when one client closes its end.
    stdin_hold: Arc<Mutex<StdinHold>>,
    /// Output copies still running.
    out_left: Arc<(Mutex<usize>, Condvar)>,
    _threads: Vec<JoinHandle<()>>,
}

/// Attaches the process's streams and starts the copies.
pub fn start(agent: &Agent, process: &ProcessRef, paths: &Paths) -> anyhow::Result<Relays> {
    let spec = paths.spec();
    let out_left = Arc::new((Mutex::new(0usize), Condvar::new()));
    let mut threads = Vec::new();
    let stdin_hold = Arc::new(Mutex::new(StdinHold::default()));
    for (want, stream, fifo) in [
        (spec.stdout, Stream::Stdout, &paths.stdout),
        (spec.stderr, Stream::Stderr, &paths.stderr),
    ] {
        if !want {
            continue;
        }
        let conn = attach(agent, process, stream)?;
        let fifo = PathBuf::from(fifo);
        let left = out_left.clone();
        *left.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        threads.push(
            std::thread::Builder::new()
                .name("k7d-shim-out".into())
                .spawn(move || {
                    copy_out(conn, &fifo, stream);
                    let mut n = left.0.lock().unwrap_or_else(|e| e.into_inner());
                    *n = n.saturating_sub(1);
                    left.1.notify_all();
                })
                .context("cannot start a stdio copy thread")?,
        );
    }
    if spec.stdin {
        let conn = attach(agent, process, Stream::Stdin)?;
        let hold = stdin_hold.clone();
        let fifo = PathBuf::from(&paths.stdin);
        threads.push(
            std::thread::Builder::new()
                .name("k7d-shim-in".into())
                .spawn(move || copy_in(conn, &fifo, &hold))
                .context("cannot start a stdio copy thread")?,
        );
    }
    Ok(Relays {
        stdin_hold,
        out_left,
        _threads: threads,
    })
}

fn attach(agent: &Agent, process: &ProcessRef, stream: Stream) -> anyhow::Result<UnixStream> {
    let mut conn = agent.connect(Duration::from_secs(30))?;
    match conn.call(&Request::Attach {
        process: process.clone(),
        stream,
    }) {
        Ok(Reply::Done) => conn.into_stream(),
        Ok(other) => anyhow::bail!("the guest agent answered an attach with {other:?}"),
        Err(e) => Err(e).with_context(|| format!("cannot attach the {stream:?} of {process:?}")),
    }
}

/// Copies until EOF with read and write. Never `std::io::copy`: between a
/// socket and a FIFO it splices, and a splice from a socket into a pipe
/// holds the pipe's lock while it waits for the socket, so containerd's
/// side of the FIFO could not even close (CHALLENGES.md, "ctr run -d hung
/// in D state").
fn pump(from: &mut impl Read, to: &mut impl Write) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
    }
}

fn copy_out(mut conn: UnixStream, fifo: &PathBuf, stream: Stream) {
    // Read-write, as runc's shim opens it: the open never waits, and a
    // reader that goes away (ctr run -d exits, containerd restarts) never
    // turns the next write into EPIPE, which would end the copy for good.
    match OpenOptions::new().read(true).write(true).open(fifo) {
        Ok(mut f) => {
            if let Err(e) = pump(&mut conn, &mut f) {
                tracing::debug!("the {stream:?} copy to {} ended: {e}", fifo.display());
            }
        }
        Err(e) => tracing::warn!("cannot open the {stream:?} FIFO {}: {e}", fifo.display()),
    }
}

/// The shim's writer on a stdin FIFO, and whether CloseIO came.
#[derive(Debug, Default)]
struct StdinHold {
    writer: Option<std::fs::File>,
    closed: bool,
}

/// Opens the stdin FIFO's read end without waiting for a writer, then the
/// shim's own write end (which holds EOF back until CloseIO).
fn open_stdin(fifo: &PathBuf, hold: &Mutex<StdinHold>) -> std::io::Result<std::fs::File> {
    let reader = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(fifo)?;
    let writer = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(fifo)?;
    {
        let mut h = hold.lock().unwrap_or_else(|e| e.into_inner());
        if !h.closed {
            h.writer = Some(writer);
        }
    }
    // Reads wait for data from here.
    k7d_sys::fd::set_nonblocking(&reader, false)?;
    Ok(reader)
}

fn copy_in(mut conn: UnixStream, fifo: &PathBuf, hold: &Mutex<StdinHold>) {
    match open_stdin(fifo, hold) {
        Ok(mut f) => {
            if let Err(e) = pump(&mut f, &mut conn) {
                tracing::debug!("the stdin copy from {} ended: {e}", fifo.display());
            }
        }
        Err(e) => tracing::warn!("cannot open the stdin FIFO {}: {e}", fifo.display()),
    }
    let _ = conn.shutdown(Shutdown::Write);
}

impl Relays {
    /// containerd's CloseIO: the shim drops its writer on the stdin FIFO,
    /// so the copy reaches EOF once containerd's writer is closed and what
    /// it wrote has been copied; then the process's stdin closes.
    pub fn close_stdin(&self) {
        let mut h = self.stdin_hold.lock().unwrap_or_else(|e| e.into_inner());
        h.closed = true;
        h.writer = None;
    }

    /// Waits until every output copy reached EOF, at most `limit`: an exit
    /// is reported after the process's last output line.
    pub fn wait_output(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let (lock, cv) = &*self.out_left;
        let mut n = lock.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!("output copies still running after {limit:?}; reporting the exit anyway");
                return;
            }
            n = cv.wait_timeout(n, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn fifo(dir: &std::path::Path) -> PathBuf {
        let p = dir.join("fifo");
        k7d_sys::file::mkfifo(&p, 0o600).unwrap();
        p
    }

    /// containerd (the FIFO's reader) closes its end while the container
    /// prints nothing: the close must not wait for the container.
    #[test]
    fn the_fifo_reader_can_close_while_the_output_copy_waits_on_a_silent_process() {
        let dir = std::env::temp_dir().join(format!("k7d-shim-stdio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = fifo(&dir);
        let (agent_side, shim_side) = UnixStream::pair().unwrap();
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        let p = path.clone();
        let copier = std::thread::spawn(move || copy_out(shim_side, &p, Stream::Stdout));
        std::thread::sleep(Duration::from_millis(200));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            drop(reader);
            tx.send(()).unwrap();
        });
        let closed = rx.recv_timeout(Duration::from_secs(5)).is_ok();
        // Whatever happened, let the copy end.
        (&agent_side).write_all(b"late output\n").unwrap();
        drop(agent_side);
        copier.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            closed,
            "closing the FIFO's read end waited on the silent process's socket"
        );
    }
}

//! A process's stdio and the relay between it and the shim's attach
//! connections.
//!
//! Without a terminal each requested stream is a pipe: the agent keeps the
//! read end of stdout/stderr and the write end of stdin; the other ends go
//! to runc, which hands them to the container process (runc's pass-through
//! mode). The agent drops its copies of those child ends as soon as runc
//! has started (else EOF would never come). With a terminal, runc sends the
//! pty master over the console socket: reading it is stdout, writing a dup
//! of it is stdin, and stderr carries nothing.
//!
//! Output written before the shim attaches waits in the pipe. A stream is
//! attached at most once. An attached stdout/stderr is copied to the
//! connection until EOF (or, for a pty, `EIO` once the last slave fd
//! closed); then the connection's write side is shut down. An attached
//! stdin is copied to the process until the connection's EOF, then the
//! process's stdin is closed. [`ProcStdio::close_stdin`] closes it even
//! while the connection is open, after giving an attached relay a moment to
//! drain what the shim sent (the shim shuts the attach connection's write
//! side, then calls it).

use crate::lock;
use k7d_agent::proto::{StdioSpec, Stream};
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long [`ProcStdio::close_stdin`] lets an attached stdin relay drain.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

enum Slot<T> {
    /// Not there yet (a pty master arrives when runc starts the process).
    Pending,
    Ready(T),
    Closed,
}

/// One stream end the agent keeps, awaited by its relay.
struct End<T> {
    state: Mutex<(Slot<T>, bool)>,
    ready: Condvar,
}

impl<T> End<T> {
    fn new(slot: Slot<T>) -> End<T> {
        End {
            state: Mutex::new((slot, false)),
            ready: Condvar::new(),
        }
    }

    fn set(&self, value: T) {
        let mut st = lock(&self.state);
        if matches!(st.0, Slot::Pending) {
            st.0 = Slot::Ready(value);
        }
        drop(st);
        self.ready.notify_all();
    }

    fn close(&self) {
        lock(&self.state).0 = Slot::Closed;
        self.ready.notify_all();
    }

    fn close_if_pending(&self) {
        let mut st = lock(&self.state);
        if matches!(st.0, Slot::Pending) {
            st.0 = Slot::Closed;
        }
        drop(st);
        self.ready.notify_all();
    }

    /// Marks the end attached; false when it already was.
    fn mark_attached(&self) -> bool {
        let mut st = lock(&self.state);
        !std::mem::replace(&mut st.1, true)
    }

    /// Waits until the end is not pending.
    fn wait_ready(&self) -> std::sync::MutexGuard<'_, (Slot<T>, bool)> {
        let mut st = lock(&self.state);
        while matches!(st.0, Slot::Pending) {
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st
    }
}

/// The ends handed to runc for the process; `None` is /dev/null.
pub struct ChildStdio {
    /// The process's stdin.
    pub stdin: Option<OwnedFd>,
    /// The process's stdout.
    pub stdout: Option<OwnedFd>,
    /// The process's stderr.
    pub stderr: Option<OwnedFd>,
}

impl ChildStdio {
    /// Gives the ends to `cmd` (they close in the agent when `cmd` is dropped).
    pub fn apply(self, cmd: &mut Command) {
        cmd.stdin(self.stdin.map_or_else(Stdio::null, Stdio::from));
        cmd.stdout(self.stdout.map_or_else(Stdio::null, Stdio::from));
        cmd.stderr(self.stderr.map_or_else(Stdio::null, Stdio::from));
    }
}

/// The agent's side of a process's stdio.
pub struct ProcStdio {
    terminal: bool,
    stdin: End<Arc<File>>,
    stdout: End<File>,
    stderr: End<File>,
    pty: Mutex<Pty>,
}

/// The pty master (for resizing) and a size asked for before it came.
#[derive(Default)]
struct Pty {
    master: Option<File>,
    size: Option<(u16, u16)>,
}

fn pipe_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    // std's pipes are close-on-exec; the child's end becomes its fd 0/1/2
    // through dup2, which clears the flag there only.
    let (r, w) = io::pipe()?;
    Ok((r.into(), w.into()))
}

impl ProcStdio {
    /// The agent's ends and the child's for `spec`. With a terminal, the
    /// child gets /dev/null (runc replaces it with the pty) and the agent's
    /// ends wait for [`ProcStdio::set_pty`].
    pub fn new(spec: StdioSpec) -> io::Result<(ProcStdio, ChildStdio)> {
        if spec.terminal {
            let s = ProcStdio {
                terminal: true,
                stdin: End::new(if spec.stdin { Slot::Pending } else { Slot::Closed }),
                stdout: End::new(Slot::Pending),
                stderr: End::new(Slot::Closed),
                pty: Mutex::new(Pty::default()),
            };
            return Ok((
                s,
                ChildStdio {
                    stdin: None,
                    stdout: None,
                    stderr: None,
                },
            ));
        }
        let (stdin, child_in) = if spec.stdin {
            let (r, w) = pipe_pair()?;
            (Slot::Ready(Arc::new(File::from(w))), Some(r))
        } else {
            (Slot::Closed, None)
        };
        let out = |wanted: bool| -> io::Result<(Slot<File>, Option<OwnedFd>)> {
            if wanted {
                let (r, w) = pipe_pair()?;
                Ok((Slot::Ready(File::from(r)), Some(w)))
            } else {
                Ok((Slot::Closed, None))
            }
        };
        let (stdout, child_out) = out(spec.stdout)?;
        let (stderr, child_err) = out(spec.stderr)?;
        let s = ProcStdio {
            terminal: false,
            stdin: End::new(stdin),
            stdout: End::new(stdout),
            stderr: End::new(stderr),
            pty: Mutex::new(Pty::default()),
        };
        Ok((
            s,
            ChildStdio {
                stdin: child_in,
                stdout: child_out,
                stderr: child_err,
            },
        ))
    }

    /// Whether the process has a terminal.
    pub fn terminal(&self) -> bool {
        self.terminal
    }

    /// The pty master arrived: it becomes stdout, a dup of it stdin.
    pub fn set_pty(&self, master: File) -> io::Result<()> {
        let reader = master.try_clone()?;
        let writer = master.try_clone()?;
        let mut pty = lock(&self.pty);
        if let Some((cols, rows)) = pty.size.take()
            && let Err(e) = crate::sys::set_winsize(&master, cols, rows)
        {
            crate::log!("setting a terminal's size failed: {e}");
        }
        pty.master = Some(master);
        drop(pty);
        self.stdout.set(reader);
        self.stdin.set(Arc::new(writer));
        Ok(())
    }

    /// The process will never start (or is gone): relays waiting for a pty
    /// end.
    pub fn abandon(&self) {
        self.stdin.close_if_pending();
        self.stdout.close_if_pending();
        self.stderr.close_if_pending();
    }

    /// Resizes the terminal (remembered until the pty exists).
    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), String> {
        if !self.terminal {
            return Err("the process has no terminal".into());
        }
        let mut pty = lock(&self.pty);
        match &pty.master {
            Some(m) => sys_resize(m, cols, rows),
            None => {
                pty.size = Some((cols, rows));
                Ok(())
            }
        }
    }

    /// Closes the process's stdin (a no-op with a terminal: the pty stays
    /// open for output). When a stdin relay is attached it gets up to
    /// [`CLOSE_GRACE`] to reach its connection's EOF first, so bytes a shim
    /// sent before shutting the connection and calling this still arrive.
    pub fn close_stdin(&self) {
        if self.terminal {
            return;
        }
        let deadline = Instant::now() + CLOSE_GRACE;
        let mut st = lock(&self.stdin.state);
        while st.1 && matches!(st.0, Slot::Ready(_)) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            st = self
                .stdin
                .ready
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.0 = Slot::Closed;
        drop(st);
        self.stdin.ready.notify_all();
    }

    /// Claims `stream` for one attach connection; an error when it was
    /// attached before.
    pub fn claim(self: &Arc<Self>, stream: Stream) -> Result<Attach, String> {
        let first = match stream {
            Stream::Stdin => self.stdin.mark_attached(),
            Stream::Stdout => self.stdout.mark_attached(),
            Stream::Stderr => self.stderr.mark_attached(),
        };
        if !first {
            return Err(format!("its {} is already attached", name(stream)));
        }
        Ok(Attach {
            stdio: Arc::clone(self),
            stream,
        })
    }
}

fn sys_resize(master: &File, cols: u16, rows: u16) -> Result<(), String> {
    crate::sys::set_winsize(master, cols, rows).map_err(|e| format!("resizing the terminal failed: {e}"))
}

fn name(s: Stream) -> &'static str {
    match s {
        Stream::Stdin => "stdin",
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    }
}

/// A claimed stream, to be relayed over a connection.
pub struct Attach {
    stdio: Arc<ProcStdio>,
    stream: Stream,
}

impl Attach {
    /// Copies the stream over `conn` until it ends (runs in the caller's thread).
    pub fn relay(self, mut conn: UnixStream) {
        match self.stream {
            Stream::Stdin => relay_stdin(&self.stdio.stdin, &mut conn),
            Stream::Stdout => relay_out(&self.stdio.stdout, &mut conn),
            Stream::Stderr => relay_out(&self.stdio.stderr, &mut conn),
        }
    }
}

fn relay_out(end: &End<File>, conn: &mut UnixStream) {
    let source = {
        let mut st = end.wait_ready();
        match std::mem::replace(&mut st.0, Slot::Closed) {
            Slot::Ready(f) => Some(f),
            _ => None,
        }
    };
    if let Some(mut source) = source {
        let mut buf = vec![0u8; 32 << 10];
        loop {
            let n = match source.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // EIO: a pty whose last slave fd closed, the terminal's EOF.
                Err(_) => break,
            };
            if conn.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    }
    let _ = conn.shutdown(Shutdown::Write);
}

fn relay_stdin(end: &End<Arc<File>>, conn: &mut UnixStream) {
    drop(end.wait_ready());
    let mut buf = vec![0u8; 32 << 10];
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        // The sink is cloned per chunk so that CloseStdin can drop the
        // agent's reference while the relay waits on the connection.
        let sink = match &lock(&end.state).0 {
            Slot::Ready(f) => Arc::clone(f),
            _ => return,
        };
        if (&*sink).write_all(&buf[..n]).is_err() {
            break;
        }
    }
    end.close();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(terminal: bool) -> StdioSpec {
        StdioSpec {
            terminal,
            stdin: true,
            stdout: true,
            stderr: false,
        }
    }

    fn relay_in_thread(s: &Arc<ProcStdio>, stream: Stream) -> UnixStream {
        let (a, b) = UnixStream::pair().unwrap();
        let at = s.claim(stream).unwrap();
        std::thread::spawn(move || at.relay(a));
        b
    }

    #[test]
    fn output_before_attach_is_kept_and_eof_follows_the_last_writer() {
        let (s, child) = ProcStdio::new(spec(false)).unwrap();
        let s = Arc::new(s);
        assert!(child.stderr.is_none(), "stderr was not requested");
        // Play the process: write to the child's stdout end, then close it.
        let mut w = File::from(child.stdout.unwrap());
        w.write_all(b"early").unwrap();
        drop(w);
        let mut b = relay_in_thread(&s, Stream::Stdout);
        assert!(s.claim(Stream::Stdout).is_err(), "one attach per stream");
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"early");
        // Stderr was not requested: an attach ends at once.
        let mut b = relay_in_thread(&s, Stream::Stderr);
        assert_eq!(b.read(&mut [0u8; 4]).unwrap(), 0);
    }

    #[test]
    fn stdin_flows_to_the_process_and_the_connections_eof_closes_it() {
        let (s, child) = ProcStdio::new(spec(false)).unwrap();
        let s = Arc::new(s);
        let mut r = File::from(child.stdin.unwrap());
        let mut b = relay_in_thread(&s, Stream::Stdin);
        b.write_all(b"hello").unwrap();
        b.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"hello", "EOF arrives after the data");
    }

    #[test]
    fn close_stdin_closes_it_while_the_relay_waits_on_the_connection() {
        let (s, child) = ProcStdio::new(spec(false)).unwrap();
        let s = Arc::new(s);
        let mut r = File::from(child.stdin.unwrap());
        let mut b = relay_in_thread(&s, Stream::Stdin);
        b.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        r.read_exact(&mut one).unwrap();
        let t = Instant::now();
        s.close_stdin();
        assert!(t.elapsed() >= CLOSE_GRACE, "an attached relay got its grace period");
        assert_eq!(
            r.read(&mut one).unwrap(),
            0,
            "the process sees EOF though the connection is open"
        );
        drop(b);
    }

    #[test]
    fn close_stdin_after_the_shims_shutdown_loses_nothing() {
        let (s, child) = ProcStdio::new(spec(false)).unwrap();
        let s = Arc::new(s);
        let mut r = File::from(child.stdin.unwrap());
        let mut b = relay_in_thread(&s, Stream::Stdin);
        let data = vec![7u8; 40_000];
        b.write_all(&data).unwrap();
        b.shutdown(Shutdown::Write).unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            got
        });
        let t = Instant::now();
        s.close_stdin();
        assert!(t.elapsed() < CLOSE_GRACE, "the relay's EOF ended the wait");
        assert_eq!(reader.join().unwrap(), data);
    }

    #[test]
    fn a_terminal_waits_for_the_pty_and_abandon_ends_the_wait() {
        let (s, child) = ProcStdio::new(spec(true)).unwrap();
        assert!(child.stdin.is_none() && child.stdout.is_none());
        let s = Arc::new(s);
        s.resize(80, 24).unwrap();
        let mut b = relay_in_thread(&s, Stream::Stdout);
        // A pipe stands in for the pty master.
        let (pr, mut pw) = io::pipe().unwrap();
        s.set_pty(File::from(OwnedFd::from(pr))).ok();
        pw.write_all(b"tty").unwrap();
        drop(pw);
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"tty");

        let (s, _) = ProcStdio::new(spec(true)).unwrap();
        let s = Arc::new(s);
        let mut b = relay_in_thread(&s, Stream::Stdout);
        s.abandon();
        assert_eq!(
            b.read(&mut [0u8; 4]).unwrap(),
            0,
            "a process that never starts ends the relay"
        );
        assert!(ProcStdio::new(spec(false)).unwrap().0.resize(1, 1).is_err());
    }
}

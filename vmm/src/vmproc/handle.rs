//! The caller's side of a VM process: spawn `k7d vm-process` with
//! `/dev/kvm` and one end of a socket pair as its descriptors 3 and 4, read
//! the jailed process's host pid from the channel, say hello, then one
//! request and its reply at a time.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::proto::{Reply, Request, VERSION};
use super::wire::{Channel, MAX_LINE, MAX_SMALL_LINE};
use crate::jail::JailConfig;

/// The descriptor number `/dev/kvm` has in the VM process.
pub const KVM_FD: i32 = 3;
/// The descriptor number of its channel.
pub const CHANNEL_FD: i32 = 4;
/// The descriptor number of its listening socket, when it has one.
pub const LISTEN_FD: i32 = 5;
/// How long a reply may take by default, all of it (a pause waits at most
/// 2 s): a VM process that stops answering, or trickles its answer, is
/// reported, not waited on for ever. Also the bound on k7d's own steps
/// before a VM process runs anything of a guest's (its spawn, its pid).
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The reply timeout in force, in milliseconds: [`CALL_TIMEOUT`] unless
/// the daemon was told otherwise (`--vm-process-timeout`).
static CALL_TIMEOUT_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(30_000);

/// Sets how long a VM process has for a whole reply, for every VM process
/// of this process (the daemon does it once, at its start).
pub fn set_call_timeout(t: std::time::Duration) {
    let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1);
    CALL_TIMEOUT_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

/// How long a VM process has for a whole reply ([`set_call_timeout`]).
pub fn call_timeout() -> std::time::Duration {
    std::time::Duration::from_millis(CALL_TIMEOUT_MS.load(std::sync::atomic::Ordering::Relaxed))
}

/// A VM process, from its caller's side.
pub struct VmProcess {
    /// Its pid (in the caller's pid namespace).
    pub pid: u32,
    chan: Channel,
    /// Why its channel can no longer be trusted to pair a reply with its
    /// request (a reply late, too long or unreadable): every later call
    /// fails with this sentence.
    broken: Option<String>,
}

impl VmProcess {
    /// Spawns `k7d vm-process` (`k7d` is the binary) in the jail `jail`
    /// and says hello with this side's [`VERSION`].
    pub fn spawn(k7d: &Path, jail: &JailConfig) -> Result<Self, String> {
        Self::spawn_inner(k7d, jail, None)?.hello()
    }

    /// [`VmProcess::spawn`] with a listening unix socket bound at `socket`
    /// (which must not exist): when this caller goes away the VM runs on,
    /// and the next caller re-attaches there ([`VmProcess::attach`]).
    pub fn spawn_listening(k7d: &Path, jail: &JailConfig, socket: &Path) -> Result<Self, String> {
        let listener = std::os::unix::net::UnixListener::bind(socket)
            .map_err(|e| format!("cannot listen at {}: {e}", socket.display()))?;
        Self::spawn_inner(k7d, jail, Some(&listener))?.hello()
    }

    /// Says hello with this side's [`VERSION`]; another version is refused.
    pub(super) fn hello(mut self) -> Result<Self, String> {
        match self.call(&Request::Hello { version: VERSION })? {
            Reply::Hello { version, .. } if version == VERSION => Ok(self),
            other => Err(format!("the VM process answered hello with {other:?}")),
        }
    }

    /// Re-attaches to VM process `pid` listening at `socket`: says hello
    /// with `version` and returns its answer with the handle. A caller
    /// checks the answer (the VM's id) against its record.
    pub fn attach(socket: &Path, pid: u32, version: u32) -> Result<(Self, Reply), String> {
        let ours = UnixStream::connect(socket)
            .map_err(|e| format!("cannot reach VM process {pid} at {}: {e}", socket.display()))?;
        ours.set_read_timeout(Some(call_timeout())).map_err(|e| e.to_string())?;
        let mut p = Self {
            pid,
            chan: Channel::new(ours),
            broken: None,
        };
        let hello = p.call(&Request::Hello { version })?;
        Ok((p, hello))
    }

    /// [`VmProcess::spawn`] without the hello (a test says its own).
    pub fn spawn_unhello(k7d: &Path, jail: &JailConfig) -> Result<Self, String> {
        Self::spawn_inner(k7d, jail, None)
    }

    /// The `k7d vm-process` command line for `jail`, its descriptors at
    /// [`KVM_FD`], [`CHANNEL_FD`] and (with `listening`) [`LISTEN_FD`]:
    /// the caller places them.
    pub(super) fn command(k7d: &Path, jail: &JailConfig, listening: bool) -> Command {
        let mut cmd = Command::new(k7d);
        cmd.arg("vm-process")
            .arg("--root")
            .arg(&jail.root)
            .args(["--uid", &jail.uid.to_string(), "--gid", &jail.gid.to_string()])
            .args(["--kvm-fd", &KVM_FD.to_string(), "--channel-fd", &CHANNEL_FD.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if listening {
            cmd.args(["--listen-fd", &LISTEN_FD.to_string()]);
        }
        cmd
    }

    fn spawn_inner(
        k7d: &Path,
        jail: &JailConfig,
        listener: Option<&std::os::unix::net::UnixListener>,
    ) -> Result<Self, String> {
        jail.check().map_err(|e| e.to_string())?;
        // The jailed process outlives its first process: as a subreaper,
        // this one inherits it and can learn how it ended (`ended`).
        crate::sys::become_subreaper().map_err(|e| format!("cannot become a child subreaper: {e}"))?;
        let kvm = File::open("/dev/kvm").map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
        let (ours, theirs) = UnixStream::pair().map_err(|e| format!("cannot make the channel: {e}"))?;
        let (kvm_fd, chan_fd) = (kvm.as_raw_fd(), theirs.as_raw_fd());
        let listen_fd = listener.map(|l| l.as_raw_fd());
        let mut cmd = Self::command(k7d, jail, listen_fd.is_some());
        // SAFETY: the closure runs in the forked child before exec and
        // makes only async-signal-safe calls (fcntl, dup2) on descriptors
        // this process holds open until `spawn` returns.
        unsafe {
            cmd.pre_exec(move || match listen_fd {
                Some(l) => crate::sys::place_fds(&[(kvm_fd, KVM_FD), (chan_fd, CHANNEL_FD), (l, LISTEN_FD)]),
                None => crate::sys::place_fds(&[(kvm_fd, KVM_FD), (chan_fd, CHANNEL_FD)]),
            });
        }
        let mut first = cmd
            .spawn()
            .map_err(|e| format!("cannot run {} vm-process: {e}", k7d.display()))?;
        drop((kvm, theirs));
        let status = first.wait().map_err(|e| e.to_string())?;
        Self::from_channel(ours, &status.to_string())
    }

    /// The VM process on the other end of `ours`, once its first process
    /// has written the jailed process's host pid there; `started` says how
    /// the first process ended, for the error when it wrote none.
    pub(super) fn from_channel(ours: UnixStream, started: &str) -> Result<Self, String> {
        ours.set_read_timeout(Some(call_timeout())).map_err(|e| e.to_string())?;
        let mut chan = Channel::new(ours);
        // A pid line is short; its first process is k7d's own code, but
        // the wait is bounded all the same.
        let line = chan
            .recv_within(Some(std::time::Instant::now() + CALL_TIMEOUT), 4096)
            .map_err(|e| format!("cannot read the VM process's pid: {e}"))?
            .map(|(l, _)| l)
            .unwrap_or_default();
        let v = serde_json::from_str::<serde_json::Value>(&line).ok();
        if let Some(pid) = v
            .as_ref()
            .and_then(|v| v["jailed_pid"].as_u64())
            .and_then(|p| u32::try_from(p).ok())
        {
            return Ok(Self {
                pid,
                chan,
                broken: None,
            });
        }
        Err(match v.as_ref().and_then(|v| v["error"].as_str()) {
            Some(e) => format!("the VM process did not start: {e}"),
            None if line.trim().is_empty() => format!("the VM process did not start ({started})"),
            None => format!("the VM process did not start ({started}): `{}`", line.trim()),
        })
    }

    /// How the VM process ended, in one sentence, once it has (waiting at
    /// most `timeout`); `None` while it runs.
    pub fn ended(&self, timeout: std::time::Duration) -> Option<String> {
        let until = std::time::Instant::now() + timeout;
        loop {
            match crate::sys::try_reap(self.pid) {
                Ok(Some(Ok(0))) => return Some(format!("VM process {} exited", self.pid)),
                Ok(Some(Ok(code))) => return Some(format!("VM process {} exited with status {code}", self.pid)),
                Ok(Some(Err(sig))) => {
                    return Some(format!("VM process {} was killed by signal {sig}", self.pid));
                }
                Err(e) => return Some(format!("VM process {} cannot be waited for: {e}", self.pid)),
                Ok(None) if std::time::Instant::now() >= until => return None,
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(5)),
            }
        }
    }

    /// Sends `req` and returns its reply.
    pub fn call(&mut self, req: &Request) -> Result<Reply, String> {
        self.call_with_fds(req, &[]).map(|(r, _)| r)
    }

    /// Sends `req` with `fds` and returns its reply with the descriptors
    /// that came with it. The whole reply must arrive within
    /// [`call_timeout`] and within [`MAX_SMALL_LINE`] bytes ([`MAX_LINE`]
    /// for a capture); a reply that does not leaves the channel broken.
    pub fn call_with_fds(&mut self, req: &Request, fds: &[RawFd]) -> Result<(Reply, Vec<OwnedFd>), String> {
        if let Some(why) = &self.broken {
            return Err(why.clone());
        }
        self.exchange(req, fds).map_err(|(e, violation)| {
            if violation {
                self.broken = Some(e.clone());
            }
            e
        })
    }

    /// Whether its channel is broken ([`VmProcess::call_with_fds`]).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// One request and its reply; an error says whether the process broke
    /// the channel's rules (late, too long, unreadable: `true`) rather
    /// than went away (`false`, its end is its watcher's to explain).
    fn exchange(&mut self, req: &Request, fds: &[RawFd]) -> Result<(Reply, Vec<OwnedFd>), (String, bool)> {
        let line = serde_json::to_string(req).map_err(|e| (e.to_string(), false))?;
        self.chan
            .send(&line, fds)
            .map_err(|e| (format!("VM process {} is gone: {e}", self.pid), false))?;
        let max = match req {
            Request::Capture | Request::SnapshotParts => MAX_LINE,
            _ => MAX_SMALL_LINE,
        };
        let timeout = call_timeout();
        let deadline = std::time::Instant::now() + timeout;
        match self.chan.recv_within(Some(deadline), max) {
            Ok(None) => Err((format!("VM process {} closed its channel", self.pid), false)),
            Ok(Some((back, fds))) => serde_json::from_str(&back).map(|r| (r, fds)).map_err(|e| {
                let mut shown = back.trim().to_string();
                if shown.len() > 200 {
                    let mut end = 200;
                    while !shown.is_char_boundary(end) {
                        end -= 1;
                    }
                    shown.truncate(end);
                    shown.push('…');
                }
                (format!("VM process {} answered `{shown}`: {e}", self.pid), true)
            }),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Err((
                format!(
                    "VM process {} did not answer within {:.1} s",
                    self.pid,
                    timeout.as_secs_f64()
                ),
                true,
            )),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                Err((format!("VM process {} broke its channel: {e}", self.pid), true))
            }
            Err(e) => Err((format!("VM process {} is gone: {e}", self.pid), false)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};

    /// A handle whose other end is `peer` (a VM process stand-in, after
    /// it sent its pid line).
    fn handle() -> (VmProcess, std::io::BufReader<UnixStream>) {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(b"{\"jailed_pid\":4242}\n").unwrap();
        let p = VmProcess::from_channel(ours, "test").unwrap();
        assert_eq!(p.pid, 4242);
        (p, std::io::BufReader::new(theirs))
    }

    #[test]
    fn a_reply_too_long_or_unreadable_breaks_the_channel_for_every_later_call() {
        // Too long: a status reply past MAX_SMALL_LINE.
        let (mut p, mut peer) = handle();
        let answer = std::thread::spawn(move || {
            let mut req = String::new();
            peer.read_line(&mut req).unwrap();
            let _ = peer.get_mut().write_all(&vec![b' '; MAX_SMALL_LINE + 2]);
            peer
        });
        let e = p.call(&Request::Status).unwrap_err();
        assert!(e.contains("broke its channel") && e.contains("longer than"), "{e}");
        let mut peer = answer.join().unwrap();
        // Nothing more is sent on it: a late reply cannot answer another
        // request.
        let again = p.call(&Request::Status).unwrap_err();
        assert_eq!(again, e);
        drop(p);
        let mut rest = String::new();
        peer.read_line(&mut rest).unwrap();
        assert_eq!(rest, "", "a call was sent on a broken channel");

        // Unreadable: quoted back bounded, and broken too.
        let (mut p, mut peer) = handle();
        let answer = std::thread::spawn(move || {
            let mut req = String::new();
            peer.read_line(&mut req).unwrap();
            let mut junk = vec![b'z'; 5000];
            junk.push(b'\n');
            peer.get_mut().write_all(&junk).unwrap();
            peer
        });
        let e = p.call(&Request::Status).unwrap_err();
        assert!(e.starts_with("VM process 4242 answered `zzz") && e.len() < 400, "{e}");
        assert!(p.is_broken());
        drop(answer.join().unwrap());

        // An error reply is an answer: the channel stays whole.
        let (mut p, mut peer) = handle();
        let answer = std::thread::spawn(move || {
            for _ in 0..2 {
                let mut req = String::new();
                peer.read_line(&mut req).unwrap();
                peer.get_mut()
                    .write_all(b"{\"reply\":\"error\",\"message\":\"no\"}\n")
                    .unwrap();
            }
        });
        for _ in 0..2 {
            let r = p.call(&Request::Status).unwrap();
            assert_eq!(r, Reply::Error { message: "no".into() });
        }
        assert!(!p.is_broken());
        answer.join().unwrap();
    }
}

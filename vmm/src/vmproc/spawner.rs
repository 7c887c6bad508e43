//! Starting VM processes for a daemon whose threads may not `execve`
//! (their seccomp filter denies it, `seccomp/lists.rs`): a small helper
//! process, `k7d vm-spawner`, started before the daemon confines itself,
//! does the exec on the daemon's behalf.
//!
//! The daemon sends one message per VM process over a `SOCK_SEQPACKET`
//! pair: the jail (root, uid, gid) as JSON, with the VM process's channel,
//! its log and its listening socket as `SCM_RIGHTS` descriptors. The
//! spawner opens `/dev/kvm`, runs `k7d vm-process` with the channel,
//! `/dev/kvm` and the listening socket as descriptors and the log as its
//! standard error (never the daemon's), waits for
//! its first process (which reports the jailed one's pid on the channel,
//! to the daemon) and answers one message: `{"ok":true}` or
//! `{"error":"..."}`. It holds nothing of any VM between requests and
//! ends when the daemon's end closes.
//!
//! The jailed process is orphaned when its first process exits; the
//! daemon is a child subreaper (and the spawner is not), so the jailed
//! process becomes the daemon's child and the daemon learns how it ended.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::handle::{CHANNEL_FD, KVM_FD, LISTEN_FD, VmProcess};
use crate::jail::JailConfig;

/// The capabilities `k7d vm-process` needs before its jail, and all the
/// spawner keeps (its own and its bounding set, so the VM processes it
/// execs as root get no others).
pub const JAIL_CAPS: &[(u32, &str)] = &[
    (6, "CAP_SETGID: the jail's gid, no supplementary groups"),
    (7, "CAP_SETUID: the jail's uid"),
    (8, "CAP_SETPCAP: dropping the jailed process's bounding set"),
    (
        18,
        "CAP_SYS_CHROOT: the jail's root on a host whose own root is an initramfs, which pivot_root cannot leave",
    ),
    (
        21,
        "CAP_SYS_ADMIN: the namespaces, the mounts, pivot_root, the hostname",
    ),
];

/// [`JAIL_CAPS`] as a mask.
pub fn jail_caps_mask() -> u64 {
    JAIL_CAPS.iter().fold(0, |m, &(c, _)| m | (1u64 << c))
}

/// The descriptor number of the spawner's socket in the spawner.
pub const SOCKET_FD: i32 = 3;
/// Largest request or answer.
const MAX_MESSAGE: usize = 8192;

/// One VM process to start.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpawnRequest {
    root: PathBuf,
    uid: u32,
    gid: u32,
}

/// The spawner's answer.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpawnAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// The daemon's handle on its spawner.
pub struct Spawner {
    sock: Mutex<UnixStream>,
    child: Mutex<Child>,
}

impl Spawner {
    /// Starts `k7d vm-spawner` (`k7d` is the binary). Call before this
    /// process's seccomp filters deny `execve`.
    pub fn start(k7d: &Path) -> Result<Self, String> {
        let (ours, theirs) =
            crate::sys::seqpacket_pair().map_err(|e| format!("cannot make the spawner's socket: {e}"))?;
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(k7d);
        cmd.args(["vm-spawner", "--socket-fd", &SOCKET_FD.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // SAFETY: the closure runs in the forked child before exec and makes
        // only async-signal-safe calls (fcntl, dup2) on a descriptor this
        // process holds open until `spawn` returns.
        unsafe {
            cmd.pre_exec(move || crate::sys::place_fds(&[(fd, SOCKET_FD)]));
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot run {} vm-spawner: {e}", k7d.display()))?;
        drop(theirs);
        Ok(Self {
            sock: Mutex::new(ours),
            child: Mutex::new(child),
        })
    }

    /// The spawner's pid.
    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap_or_else(|p| p.into_inner()).id()
    }

    /// Starts a VM process in `jail`, writing its log to `log`, listening
    /// on `listener` for the callers after this one (without one: a spare,
    /// which gets its listening socket with the request that builds its
    /// VM), and says hello on its channel.
    pub fn spawn(
        &self,
        jail: &JailConfig,
        log: &std::fs::File,
        listener: Option<&UnixListener>,
    ) -> Result<VmProcess, String> {
        jail.check().map_err(|e| e.to_string())?;
        let (ours, theirs) = UnixStream::pair().map_err(|e| format!("cannot make the VM process's channel: {e}"))?;
        let req = serde_json::to_vec(&SpawnRequest {
            root: jail.root.clone(),
            uid: jail.uid,
            gid: jail.gid,
        })
        .map_err(|e| e.to_string())?;
        {
            let sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
            let mut fds = vec![theirs.as_raw_fd(), log.as_raw_fd()];
            fds.extend(listener.map(|l| l.as_raw_fd()));
            sock.send_with_fds(&[&req[..]], &fds)
                .map_err(|e| format!("the VM process spawner is gone: {e}"))?;
            drop(theirs);
            sock.set_read_timeout(Some(super::handle::CALL_TIMEOUT))
                .map_err(|e| e.to_string())?;
            let mut buf = vec![0u8; MAX_MESSAGE];
            let n = (&*sock)
                .read(&mut buf)
                .map_err(|e| format!("the VM process spawner did not answer: {e}"))?;
            if n == 0 {
                return Err("the VM process spawner is gone".into());
            }
            let answer: SpawnAnswer = serde_json::from_slice(&buf[..n])
                .map_err(|e| format!("the VM process spawner answered something unreadable: {e}"))?;
            // On an error the channel may still carry the jail's own sentence.
            let started = answer.error.unwrap_or_else(|| "its first process exited".into());
            VmProcess::from_channel(ours, &started)?.hello()
        }
    }
}

impl Drop for Spawner {
    fn drop(&mut self) {
        // Closing our end ends it; reap it (not with `Child::wait`: the
        // daemon's shutdown thread may not make `wait4`).
        let _ = self.sock.get_mut().map(|s| s.shutdown(std::net::Shutdown::Both));
        if let Ok(c) = self.child.get_mut()
            && let Err(e) = crate::sys::reap_child(c.id())
        {
            tracing::debug!(error = %e, "the VM process spawner was not reaped");
        }
    }
}

/// `k7d vm-spawner`: serves the daemon at descriptor [`SOCKET_FD`] until it
/// closes (module docs). `k7d` is this binary.
pub fn serve(sock: UnixStream, k7d: &Path) -> Result<(), String> {
    // Least privilege: what the jail needs, nothing else, for this process
    // and every VM process it execs.
    let keep = jail_caps_mask();
    crate::sys::drop_bounding_set_except(keep).map_err(|e| format!("cannot narrow the bounding set: {e}"))?;
    let have = crate::sys::permitted_capabilities().map_err(|e| format!("cannot read the capabilities: {e}"))?;
    crate::sys::set_capabilities(have & keep).map_err(|e| format!("cannot narrow the capabilities: {e}"))?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut fds: [RawFd; 3] = [-1; 3];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points at our own buffer of that length.
        let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut fds) }
            .map_err(|e| format!("cannot read the daemon's request: {e}"))?;
        // SAFETY: the first `nfds` entries are descriptors the kernel just
        // gave this process; nothing else owns them.
        let owned: Vec<OwnedFd> = fds[..nfds]
            .iter()
            .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
            .collect();
        if n == 0 && nfds == 0 {
            return Ok(());
        }
        for fd in &owned {
            crate::sys::set_cloexec(fd.as_raw_fd())
                .map_err(|e| format!("cannot mark a descriptor close-on-exec: {e}"))?;
        }
        let error = spawn_one(&buf[..n], &owned, k7d).err();
        if let Some(e) = &error {
            tracing::warn!(error = %e, "a VM process did not start");
        }
        let answer = serde_json::to_vec(&SpawnAnswer { error }).map_err(|e| e.to_string())?;
        (&sock)
            .write_all(&answer)
            .map_err(|e| format!("cannot answer the daemon: {e}"))?;
    }
}

fn spawn_one(req: &[u8], fds: &[OwnedFd], k7d: &Path) -> Result<(), String> {
    let req: SpawnRequest = serde_json::from_slice(req).map_err(|e| format!("the spawn request is unreadable: {e}"))?;
    let (channel, log, listener) = match fds {
        [c, g] => (c, g, None),
        [c, g, l] => (c, g, Some(l)),
        _ => return Err(format!("a spawn request carries 2 or 3 descriptors, not {}", fds.len())),
    };
    let jail = JailConfig {
        root: req.root,
        uid: req.uid,
        gid: req.gid,
        keep_fds: Vec::new(),
    };
    jail.check().map_err(|e| e.to_string())?;
    let kvm = std::fs::File::open("/dev/kvm").map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
    let mut cmd = VmProcess::command(k7d, &jail, listener.is_some());
    let log = log
        .try_clone()
        .map_err(|e| format!("cannot take the VM process's log: {e}"))?;
    cmd.stderr(std::process::Stdio::from(log));
    let (kvm_fd, chan_fd) = (kvm.as_raw_fd(), channel.as_raw_fd());
    let listen_fd = listener.map(|l| l.as_raw_fd());
    // SAFETY: the closure runs in the forked child before exec and makes
    // only async-signal-safe calls (fcntl, dup2) on descriptors this
    // process holds open until `spawn` returns.
    unsafe {
        cmd.pre_exec(move || match listen_fd {
            Some(l) => crate::sys::place_fds(&[(kvm_fd, KVM_FD), (chan_fd, CHANNEL_FD), (l, LISTEN_FD)]),
            None => crate::sys::place_fds(&[(kvm_fd, KVM_FD), (chan_fd, CHANNEL_FD)]),
        });
    }
    let status = cmd
        .spawn()
        .and_then(|mut c| c.wait())
        .map_err(|e| format!("cannot run {} vm-process: {e}", k7d.display()))?;
    if !status.success() {
        return Err(format!("k7d vm-process did not start its VM process ({status})"));
    }
    Ok(())
}

//! Connections to guest agents kept open between the API's `exec`s, so
//! that a command costs one round trip to the guest (`Run` on a connection
//! past its `Hello`) rather than a connect, a `CONNECT` line and a `Hello`
//! first: what an RL loop that acts in a VM many times a second pays.
//!
//! A connection is kept per VM, for the VM's vsock socket it was made to,
//! only when its last call left it in step, and it is used again only if
//! it is still open with nothing unread (a stopped, deleted, forked or
//! restored VM's connections are closed by its side). At most
//! [`PER_VM`] are kept per VM and [`MAX_VMS`] VMs in all, so a client
//! cannot make the daemon hold descriptors without bound; a VM's are
//! dropped when it is deleted.
// Without the agent's client (the fuzz build) nothing is kept.
#![cfg_attr(not(feature = "shim"), allow(dead_code))]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A connection to a guest agent, past its `Hello`.
#[cfg(feature = "shim")]
pub(super) type Conn = k7d_shim::agent::Conn;
#[cfg(not(feature = "shim"))]
pub(super) type Conn = ();

/// The most idle connections kept for one VM (execs at once beyond it
/// open their own and close them after).
pub(super) const PER_VM: usize = 4;
/// The most VMs with idle connections kept.
pub(super) const MAX_VMS: usize = 1024;

/// Idle connections by VM id.
#[derive(Default)]
pub(super) struct AgentConns {
    idle: Mutex<HashMap<String, (PathBuf, Vec<Conn>)>>,
}

impl AgentConns {
    fn idle(&self) -> std::sync::MutexGuard<'_, HashMap<String, (PathBuf, Vec<Conn>)>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection to `vm`'s agent at `uds` that is still open, if
    /// one is kept (the others of it are dropped).
    #[cfg(feature = "shim")]
    pub(super) fn take(&self, vm: &str, uds: &Path) -> Option<Conn> {
        let mut idle = self.idle();
        let (at, conns) = idle.get_mut(vm)?;
        if at != uds {
            idle.remove(vm);
            return None;
        }
        while let Some(c) = conns.pop() {
            if c.idle_and_open() {
                return Some(c);
            }
        }
        idle.remove(vm);
        None
    }

    /// Keeps `conn` (in step, to `vm`'s agent at `uds`) for the next exec,
    /// room permitting.
    pub(super) fn put(&self, vm: &str, uds: &Path, conn: Conn) {
        let mut idle = self.idle();
        if !idle.contains_key(vm) && idle.len() >= MAX_VMS {
            return;
        }
        let (at, conns) = idle
            .entry(vm.to_string())
            .or_insert_with(|| (uds.to_path_buf(), Vec::new()));
        if at != uds {
            *at = uds.to_path_buf();
            conns.clear();
        }
        if conns.len() < PER_VM {
            conns.push(conn);
        }
    }

    /// Drops what is kept for `vm` (deleted: a new VM may take its id).
    pub(super) fn forget(&self, vm: &str) {
        self.idle().remove(vm);
    }

    /// How many connections are kept for `vm`.
    #[cfg(test)]
    pub(super) fn kept(&self, vm: &str) -> usize {
        self.idle().get(vm).map_or(0, |(_, c)| c.len())
    }
}

#[cfg(all(test, feature = "shim"))]
mod tests {
    use super::*;
    use k7d_agent::proto::{self, Reply, Request, Response};
    use std::os::unix::net::UnixListener;

    /// An agent at a unix socket that answers the VMM's `CONNECT` line and
    /// `Hello`, then holds each connection until told to close them.
    fn agent(dir: &Path) -> (PathBuf, std::sync::mpsc::Sender<()>) {
        let uds = dir.join("vsock");
        let l = UnixListener::bind(&uds).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            l.set_nonblocking(true).unwrap();
            loop {
                if rx.try_recv().is_ok() {
                    held.clear();
                }
                match l.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false).unwrap();
                        let mut line = [0u8; 13];
                        std::io::Read::read_exact(&mut s, &mut line).unwrap();
                        std::io::Write::write_all(&mut s, b"OK 1024\n").unwrap();
                        let _: Request = proto::read_frame(&mut s).unwrap();
                        let hello = Reply::Hello {
                            version: proto::VERSION,
                            kernel: "test".into(),
                        };
                        proto::write_frame(&mut s, &Response::Ok(hello)).unwrap();
                        held.push(s);
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        });
        (uds, tx)
    }

    #[test]
    fn an_open_connection_is_reused_and_a_closed_or_moved_one_is_not() {
        let dir = std::env::temp_dir().join(format!("k7d-agent-conns-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (uds, close_all) = agent(&dir);
        let a = k7d_shim::agent::Agent::new(&uds);
        let conns = AgentConns::default();
        let timeout = std::time::Duration::from_secs(5);
        assert!(conns.take("x", &uds).is_none(), "nothing kept yet");
        for _ in 0..PER_VM + 2 {
            conns.put("x", &uds, a.connect(timeout).unwrap());
        }
        assert_eq!(conns.kept("x"), PER_VM, "kept up to its limit");
        assert!(conns.take("x", &uds).is_some());
        assert!(
            conns.take("x", Path::new("/elsewhere")).is_none(),
            "a VM whose socket moved starts afresh"
        );
        assert_eq!(conns.kept("x"), 0);
        conns.put("x", &uds, a.connect(timeout).unwrap());
        // The agent's side goes (the VM stopped or was restored).
        close_all.send(()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(conns.take("x", &uds).is_none(), "a closed connection is not handed out");
        conns.put("y", &uds, a.connect(timeout).unwrap());
        conns.forget("y");
        assert_eq!(conns.kept("y"), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

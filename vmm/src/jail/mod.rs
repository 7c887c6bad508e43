//! The jail a VM process enters before it touches guest input (issue 36,
//! `docs/security.md`): its own mount, pid, ipc, uts and network
//! namespaces, an empty root, a uid and gid of its own, no capabilities
//! (bounding set included) and `no_new_privs`. The VM process's per-thread
//! seccomp filters come after (`seccomp/`); the cgroup leaf is the
//! daemon's to make, from outside (`cgroup.rs`).
//!
//! [`enter`] runs in a fresh, single-threaded process (the namespaces and
//! the root are per thread until then): it unshares the namespaces, forks
//! once so that the jailed process is pid 1 of its pid namespace (the
//! first process reports the jailed one's host pid and exits), and then
//! confines the child. [`probe`] inspects a process from outside and lists
//! what of the jail it lacks: what the daemon and the tests check.
//!
//! `k7d jail-selftest` (hidden) enters the jail and reports what it can
//! reach from inside; `vmm/tests/jail.rs` drives it.

pub mod cgroup;
pub mod probe;

use std::io;
use std::path::PathBuf;

use crate::sys;

/// What the jail is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailConfig {
    /// The per-VM directory that becomes the process's `/`: it must exist,
    /// be empty, and be on a filesystem the process can bind-mount.
    pub root: PathBuf,
    /// The process's uid (not 0).
    pub uid: u32,
    /// The process's gid (not 0).
    pub gid: u32,
    /// The descriptors it keeps besides stdin, stdout and stderr (what the
    /// daemon handed it); every other one is closed on entry, so nothing it
    /// inherited by accident (a host directory, a pipe) crosses into the jail.
    pub keep_fds: Vec<i32>,
}

/// Why a step of the jail failed.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The configuration cannot make a jail.
    #[error("the jail cannot be made: {0}")]
    Config(String),
    /// A step failed.
    #[error("the jail's step `{step}` failed: {source}")]
    Step {
        /// The step.
        step: &'static str,
        /// The system call's error.
        #[source]
        source: io::Error,
    },
}

fn step(step: &'static str) -> impl FnOnce(io::Error) -> JailError {
    move |source| JailError::Step { step, source }
}

/// Which side of [`enter`]'s fork the caller is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entered {
    /// The first process: the jailed one is `pid` (in the host's pid
    /// namespace); this one holds nothing and should exit.
    Outside {
        /// The jailed process.
        pid: u32,
    },
    /// The jailed process (pid 1 of its pid namespace), confined.
    Inside,
}

impl JailConfig {
    /// Refuses what cannot make a jail, before anything is changed.
    pub fn check(&self) -> Result<(), JailError> {
        if self.uid == 0 || self.gid == 0 {
            return Err(JailError::Config(format!(
                "uid {} and gid {} must both be other than 0 (root)",
                self.uid, self.gid
            )));
        }
        if !self.root.is_absolute() {
            return Err(JailError::Config(format!(
                "the root {} is not an absolute path",
                self.root.display()
            )));
        }
        let mut entries = std::fs::read_dir(&self.root)
            .map_err(|e| JailError::Config(format!("the root {} cannot be read: {e}", self.root.display())))?;
        if entries.next().is_some() {
            return Err(JailError::Config(format!(
                "the root {} is not empty",
                self.root.display()
            )));
        }
        Ok(())
    }
}

/// The jailed process's own `/proc/self/smaps`, opened before its root
/// changed ([`enter`]); none outside a jail or when it could not be opened.
static OWN_SMAPS: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

/// This jailed process's own `smaps` (module docs of [`enter`]).
pub fn own_smaps() -> Option<&'static std::fs::File> {
    OWN_SMAPS.get()
}

/// Puts the calling process in the jail `cfg` describes (module docs). The
/// process must have one thread; on [`Entered::Outside`] the caller exits.
pub fn enter(cfg: &JailConfig) -> Result<Entered, JailError> {
    cfg.check()?;
    if sys::thread_count().map_err(step("count the process's threads"))? != 1 {
        return Err(JailError::Config(
            "the process has more than one thread: namespaces and the root would change for one of them only".into(),
        ));
    }
    sys::unshare_namespaces().map_err(step("unshare the mount, pid, ipc, uts and network namespaces"))?;
    // The jailed process is the first of the new pid namespace.
    if let Some(pid) = sys::fork_process().map_err(step("fork into the new pid namespace"))? {
        return Ok(Entered::Outside { pid });
    }
    confine(cfg)?;
    Ok(Entered::Inside)
}

/// The jailed child's steps, in order: every descriptor it was not given
/// closed, nothing of the host's mounts propagating in, the empty root as
/// `/` (the old one detached), then the ids, the capabilities (bounding set
/// first, while it may still be changed) and `no_new_privs`.
fn confine(cfg: &JailConfig) -> Result<(), JailError> {
    let (root, uid, gid) = (cfg.root.as_path(), cfg.uid, cfg.gid);
    let mut keep: Vec<i32> = vec![0, 1, 2];
    keep.extend(&cfg.keep_fds);
    sys::close_fds_except(&keep).map_err(step("close the descriptors it was not given"))?;
    // Its own smaps, opened while /proc is still reachable and the process
    // still root: read through this descriptor later, it tells what its
    // guest RAM costs (`own_smaps`). The daemon cannot read it from outside
    // once the process has its own uid: it lacks CAP_SYS_PTRACE by design.
    match std::fs::File::open("/proc/self/smaps") {
        Ok(f) => {
            let _ = OWN_SMAPS.set(f);
        }
        Err(e) => tracing::warn!(error = %e, "cannot open its own smaps: its guest RAM figures will be missing"),
    }
    sys::make_mounts_private().map_err(step("make every mount private"))?;
    if sys::pivot_into(root).map_err(step("make the empty root the process's /"))? == sys::RootChange::MovedAndChrooted
    {
        tracing::warn!(
            "pivot_root refused (EINVAL: the host's root is likely an initramfs): the jail's root was moved over / and chrooted into, which hides the host's mounts less well (docs/security.md)"
        );
    }
    sys::set_hostname("k7d-vm").map_err(step("set the uts namespace's hostname"))?;
    sys::drop_bounding_set().map_err(step("drop the capability bounding set"))?;
    sys::set_ids(uid, gid).map_err(step("switch to the jail's uid and gid"))?;
    sys::drop_all_capabilities().map_err(step("drop every capability"))?;
    sys::set_no_new_privs().map_err(step("set no_new_privs"))?;
    Ok(())
}

/// Reads `k7d jail-selftest`'s two JSON lines from its stdout, in whichever
/// order the two processes wrote them and skipping a guest's serial lines:
/// the jailed process's host pid and its report from inside.
pub fn read_selftest(out: impl std::io::BufRead) -> Result<(u32, serde_json::Value), String> {
    let (mut pid, mut inside) = (None, None);
    for line in out.lines() {
        let line = line.map_err(|e| format!("cannot read jail-selftest's output: {e}"))?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        match v.get("jailed_pid").and_then(serde_json::Value::as_u64) {
            Some(p) => pid = u32::try_from(p).ok(),
            None => inside = Some(v),
        }
        if let (Some(p), Some(i)) = (pid, &inside) {
            return Ok((p, i.clone()));
        }
    }
    Err(format!(
        "jail-selftest ended without {}",
        if pid.is_none() {
            "the jailed pid"
        } else {
            "a report from inside"
        }
    ))
}

//! Fork templates (`pod_start = "fork"`): one paused pod VM per shape on
//! the node, booted once (kernel up, agent answering), with empty drives
//! for every image a pod puts in, a NIC on a bare tap and a vsock. A pod
//! started by fork is a copy-on-write child of it: the daemon attaches the
//! child's NIC to the pod's network and gives it a vsock socket of its own
//! (the guest's connections are reset), and the shim gives it its own
//! identity through the agent (`Identity`: entropy and an RNG reseed, the
//! clock, the machine-id; `Network` with a MAC of its own).
//!
//! The template is the node's, not a pod's: it outlives every pod forked
//! from it and is made again when it is missing (the daemon restarted, or
//! someone deleted it). Shims of different pods agree on it through a
//! lock file; the first one boots it.

use std::fs::File;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

use crate::agent::Agent;
use crate::config::ShimConfig;
use crate::daemon::{Daemon, PodVmSpec, VmLife};

/// Drives a template has besides `pod_drives`: the sandbox's own image
/// and its bind mounts' image (a cold pod VM boots with them in).
pub const SANDBOX_DRIVES: u8 = 2;

/// A template of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// The daemon's VM id (`tmpl-<16 hex>`).
    pub vm_id: String,
    /// Its directory under the shim's state dir (its vsock socket).
    pub dir: PathBuf,
    /// The lock shims take while they check or make it.
    pub lock: PathBuf,
}

/// The template for pods of this shape under `cfg`: everything that makes
/// two templates' children differ (kernel, initramfs, command line, vCPUs,
/// memory, drives) and where it lives (daemon, state dir) is in the hash.
pub fn for_shape(cfg: &ShimConfig, vcpus: u8, memory_mib: u64) -> Template {
    named(cfg, &shape_hex(cfg, vcpus, memory_mib))
}

/// The template named `hex` under `cfg`'s state dir (an earlier version of
/// the config's, for `retire`).
pub(crate) fn named(cfg: &ShimConfig, hex: &str) -> Template {
    let root = cfg.state_dir.join("templates");
    Template {
        vm_id: format!("tmpl-{hex}"),
        dir: root.join(hex),
        lock: root.join(format!("{hex}.lock")),
    }
}

/// 16 hex digits that tell apart every two shapes whose booted VMs differ
/// (kernel, initramfs and those files' identity, command line, vCPUs,
/// memory, drives) or live apart
/// (daemon, state dir): a template's and a warm pool's name.
pub(crate) fn shape_hex(cfg: &ShimConfig, vcpus: u8, memory_mib: u64) -> String {
    let mut h = Sha256::new();
    // The daemon and the state dir too: shims of two configs never share
    // a template id under two locks.
    for part in [
        cfg.kernel.as_os_str().as_encoded_bytes(),
        cfg.initramfs.as_os_str().as_encoded_bytes(),
        cfg.cmdline.as_bytes(),
        cfg.daemon_socket.as_os_str().as_encoded_bytes(),
        cfg.state_dir.as_os_str().as_encoded_bytes(),
    ] {
        h.update(part);
        h.update([0]);
    }
    // The kernel's and initramfs's identity too: a file replaced at the
    // same path (a package upgrade) boots other VMs, so it names another
    // template and pool, and `retire` drains the old ones.
    for f in [&cfg.kernel, &cfg.initramfs] {
        h.update(file_identity(f));
    }
    h.update([vcpus, cfg.pod_drives]);
    h.update(memory_mib.to_le_bytes());
    h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// A file's device, inode, size and modification time (zeros when it
/// cannot be read: the boot then fails with its own reason).
fn file_identity(p: &Path) -> [u8; 32] {
    use std::os::unix::fs::MetadataExt;
    let mut out = [0u8; 32];
    if let Ok(m) = std::fs::metadata(p) {
        for (i, v) in [
            m.dev(),
            m.ino(),
            m.size(),
            (m.mtime() as u64) ^ ((m.mtime_nsec() as u64) << 32),
        ]
        .into_iter()
        .enumerate()
        {
            out[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// A pod VM booted ahead of its pod (a template, a warm pool member):
/// empty drives for every image a pod puts in, a NIC on a bare tap, a
/// vsock at `vsock_uds`.
pub(crate) fn booted_spec(cfg: &ShimConfig, id: &str, vsock_uds: PathBuf, (vcpus, memory_mib): (u8, u64)) -> PodVmSpec {
    PodVmSpec {
        id: id.to_string(),
        kernel: cfg.kernel.clone(),
        initramfs: cfg.initramfs.clone(),
        cmdline: cfg.cmdline.clone(),
        vcpus,
        memory_mib,
        disks: Vec::new(),
        empty_drives: cfg.pod_drives + SANDBOX_DRIVES,
        nic: None,
        bare_nic: true,
        vsock_cid: 3,
        vsock_uds,
    }
}

/// Boots `spec` until its agent answers (at most `boot`), then pauses it;
/// the caller removes it on failure.
pub(crate) fn boot_paused(daemon: &dyn Daemon, spec: &PodVmSpec, boot: Duration) -> anyhow::Result<()> {
    daemon.create(spec)?;
    let vm_id = spec.id.clone();
    let conn = Agent::new(&spec.vsock_uds).wait_ready(Instant::now() + boot, || match daemon.life(&vm_id) {
        // A busy daemon is not a death: the boot deadline bounds this.
        Ok(VmLife::Running | VmLife::Paused) | Err(_) => Ok(()),
        Ok(other) => bail!("{vm_id} died while booting: {other:?}"),
    })?;
    // No connection outlives the boot into a pod (or a fork child).
    drop(conn);
    daemon.pause(&spec.id)
}

impl Template {
    /// The template's PodVmSpec.
    fn spec(&self, cfg: &ShimConfig, vcpus: u8, memory_mib: u64) -> PodVmSpec {
        booted_spec(cfg, &self.vm_id, self.dir.join("vsock.sock"), (vcpus, memory_mib))
    }

    /// Makes sure the template is in the daemon, paused, booted: waits for
    /// another shim making it, or boots it (at most `boot` for the guest
    /// agent to answer). Returns whether this call booted it.
    pub fn ensure(
        &self,
        daemon: &dyn Daemon,
        cfg: &ShimConfig,
        shape: (u8, u64),
        boot: Duration,
    ) -> anyhow::Result<bool> {
        let deadline = Instant::now() + boot + Duration::from_secs(30);
        let _lock = self.hold(deadline)?;
        match life_until(daemon, &self.vm_id, deadline)? {
            VmLife::Paused => {
                // This config uses it too (`retire`).
                crate::retire::note_origin(&self.dir, cfg, shape)?;
                return Ok(false);
            }
            VmLife::DaemonGone => bail!("the k7d daemon is not running"),
            // Running: its maker died before pausing it (or someone resumed
            // it, and it diverged); stopped or gone: made again.
            VmLife::Running | VmLife::Stopped(_) | VmLife::Gone => {}
        }
        let _ = daemon.delete(&self.vm_id);
        remove_dir(&self.dir);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&self.dir)
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        let r = crate::retire::note_origin(&self.dir, cfg, shape)
            .and_then(|()| boot_paused(daemon, &self.spec(cfg, shape.0, shape.1), boot));
        if let Err(e) = r {
            let _ = daemon.delete(&self.vm_id);
            remove_dir(&self.dir);
            return Err(e.context(format!("cannot make the fork template {}", self.vm_id)));
        }
        tracing::info!(template = %self.vm_id, "fork template booted and paused");
        Ok(true)
    }

    /// The template's lock (its directory's parent made first, 0700),
    /// waited for until `deadline`.
    pub(crate) fn hold(&self, deadline: Instant) -> anyhow::Result<File> {
        if let Some(root) = self.lock.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(root)
                .with_context(|| format!("cannot create {}", root.display()))?;
        }
        lock(&self.lock, deadline)
    }

    /// Deletes the template and its directory, under its lock (no shim
    /// checks or makes it meanwhile; one that forks from it afterwards
    /// makes it again, from the config it has then), as a node does before
    /// it changes the config. Its fork children live on: each has its own
    /// copy-on-write view of its RAM. Returns whether the daemon had it.
    pub fn remove(&self, daemon: &dyn Daemon, wait: Duration) -> anyhow::Result<bool> {
        let _lock = self.hold(Instant::now() + wait)?;
        self.remove_held(daemon)
    }

    /// [`Template::remove`] with the lock held by the caller.
    pub(crate) fn remove_held(&self, daemon: &dyn Daemon) -> anyhow::Result<bool> {
        let had = match daemon.life(&self.vm_id)? {
            VmLife::DaemonGone => bail!("the k7d daemon is not running"),
            VmLife::Gone => false,
            VmLife::Paused | VmLife::Running | VmLife::Stopped(_) => {
                daemon
                    .delete(&self.vm_id)
                    .with_context(|| format!("cannot delete the fork template {}", self.vm_id))?;
                true
            }
        };
        remove_dir(&self.dir);
        Ok(had)
    }
}

/// The VM's life, asked again while the daemon is too busy to answer in
/// time (the forks of one template queue on it), until `deadline`.
pub(crate) fn life_until(daemon: &dyn Daemon, id: &str, deadline: Instant) -> anyhow::Result<VmLife> {
    loop {
        match daemon.life(id) {
            Ok(l) => return Ok(l),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("the daemon did not tell {id}'s life yet: {e:#}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

pub(crate) fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("cannot remove {}: {e}", dir.display());
    }
}

/// An exclusive `flock` on `path`, waited for until `deadline`; released
/// when the file is dropped.
pub(crate) fn lock(path: &Path, deadline: Instant) -> anyhow::Result<File> {
    loop {
        if let Some(f) = try_lock(path)? {
            return Ok(f);
        }
        if Instant::now() >= deadline {
            bail!("another shim held the lock {} past the deadline", path.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An exclusive `flock` on `path` if free now; `None` when another holds it.
pub(crate) fn try_lock(path: &Path) -> anyhow::Result<Option<File>> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open the shims' lock {}", path.display()))?;
    match k7d_sys::file::flock(&f, k7d_sys::file::Lock::Exclusive, false) {
        Ok(()) => Ok(Some(f)),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot lock {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(state: &str) -> ShimConfig {
        toml::from_str(&format!(
            "kernel = \"/k\"\ninitramfs = \"/i\"\nstate_dir = \"{state}\"\n"
        ))
        .unwrap()
    }

    #[test]
    fn one_template_per_shape_and_files() {
        let c = cfg("/run/k7d/shim");
        let a = for_shape(&c, 1, 256);
        assert!(a.vm_id.starts_with("tmpl-") && a.vm_id.len() == 21, "{}", a.vm_id);
        assert_eq!(a, for_shape(&c, 1, 256), "the same shape, the same template");
        assert_ne!(a.vm_id, for_shape(&c, 2, 256).vm_id);
        assert_ne!(a.vm_id, for_shape(&c, 1, 512).vm_id);
        let mut other = c.clone();
        other.cmdline.push_str(" loglevel=7");
        assert_ne!(a.vm_id, for_shape(&other, 1, 256).vm_id);
        let mut other = c.clone();
        other.daemon_socket = "/run/k7d/other.sock".into();
        assert_ne!(a.vm_id, for_shape(&other, 1, 256).vm_id);
        assert!(a.dir.starts_with("/run/k7d/shim/templates") && a.lock.starts_with("/run/k7d/shim/templates"));
        let s = a.spec(&c, 1, 256);
        assert_eq!(s.empty_drives, c.pod_drives + SANDBOX_DRIVES);
        assert!(s.bare_nic && s.nic.is_none() && s.disks.is_empty());
        assert!(s.vsock_uds.starts_with(&a.dir));
    }

    #[test]
    fn removing_a_template_deletes_its_vm_and_directory_under_its_lock() {
        use crate::pool::tests::Lives;
        let state = std::env::temp_dir().join(format!("k7d-tmpl-rm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let c = cfg(&state.display().to_string());
        let t = for_shape(&c, 1, 256);
        std::fs::create_dir_all(&t.dir).unwrap();
        std::fs::write(t.dir.join("vsock.sock"), b"").unwrap();
        let d = Lives::default();
        d.lives.lock().unwrap().insert(t.vm_id.clone(), VmLife::Paused);
        // Another shim checking or making it holds the lock: the removal waits, then says so.
        let held = lock(&t.lock, Instant::now()).unwrap();
        let e = format!("{:#}", t.remove(&d, Duration::from_millis(100)).unwrap_err());
        assert!(e.contains("held the lock"), "{e}");
        assert!(t.dir.exists() && d.deleted.lock().unwrap().is_empty());
        drop(held);
        assert!(t.remove(&d, Duration::from_secs(1)).unwrap());
        assert_eq!(d.deleted.lock().unwrap().as_slice(), std::slice::from_ref(&t.vm_id));
        assert!(!t.dir.exists());
        // Nothing to remove is not an error; a daemon gone is.
        assert!(!t.remove(&d, Duration::from_secs(1)).unwrap());
        d.lives.lock().unwrap().insert(t.vm_id.clone(), VmLife::DaemonGone);
        let e = format!("{:#}", t.remove(&d, Duration::from_secs(1)).unwrap_err());
        assert!(e.contains("daemon is not running"), "{e}");
        std::fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn the_lock_waits_and_times_out_with_a_sentence() {
        let dir = std::env::temp_dir().join(format!("k7d-tmpl-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.lock");
        let held = lock(&p, Instant::now()).unwrap();
        let t0 = Instant::now();
        let e = lock(&p, Instant::now() + Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert!(e.contains("held the lock") && e.contains("t.lock"), "{e}");
        drop(held);
        lock(&p, Instant::now()).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

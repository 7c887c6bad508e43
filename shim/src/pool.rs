//! Warm pools (`pod_start = "pool"`): booted, paused pod VMs kept per shim
//! config (kernel up, agent answered once, no pod state: empty drives, a
//! NIC on a bare tap, a vsock), each claimed whole by one pod. The claiming
//! shim moves the member's vsock socket into the pod's directory, the
//! daemon moves its tap into the pod's netns (`nic_attach`) and resumes
//! it; its images arrive by medium change and its identity and network
//! through the agent, as a fork child's do. The shim then boots members in
//! the background until the pool is full again.
//!
//! Shims of different pods agree on a pool through files under
//! `<state_dir>/pools/<hash>/`: `lock` (held to claim or to add a member),
//! `next` (the next member's number), and a directory per member holding
//! its vsock socket, `ready` once it is paused, and `boot.lock`, held by
//! the shim booting it. A member that is not ready and whose boot lock is
//! free was left by a shim that died; one that is ready but not paused was
//! resumed or lost by someone else: either is removed, never claimed.

use std::fs::File;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::config::ShimConfig;
use crate::daemon::{Daemon, VmLife};
use crate::names::PodNames;
use crate::template::{boot_paused, booted_spec, lock, remove_dir, shape_hex, try_lock};

/// The prefix of a member's directory while a claim takes it (under the
/// pool's lock): one seen by a survey was left by a shim that died mid-claim.
const CLAIMED: &str = "claimed-";

/// How long a claim waits for another shim's hold on the pool's lock
/// (held for a claim, or to add a member: never for a boot).
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// The warm pool of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    hex: String,
    root: PathBuf,
    size: u8,
    shape: (u8, u64),
}

/// The pool for pods of this shape under `cfg` (named as its template is).
pub fn for_shape(cfg: &ShimConfig, vcpus: u8, memory_mib: u64) -> Pool {
    named(cfg, &shape_hex(cfg, vcpus, memory_mib), (vcpus, memory_mib))
}

/// The pool named `hex` of `shape` under `cfg`'s state dir (an earlier
/// version of the config's, for `retire`).
pub(crate) fn named(cfg: &ShimConfig, hex: &str, shape: (u8, u64)) -> Pool {
    Pool {
        root: cfg.state_dir.join("pools").join(hex),
        hex: hex.to_string(),
        size: cfg.pool_size,
        shape,
    }
}

/// What a survey of the pool found (under its lock).
#[derive(Debug, Default)]
struct Survey {
    /// Members ready to claim, oldest first, as the daemon reported them.
    ready: Vec<u64>,
    /// Members a live shim is booting.
    booting: usize,
}

impl Pool {
    /// The pool's name (its members' id prefix).
    pub fn name(&self) -> String {
        format!("pool-{}", self.hex)
    }

    /// How many members are ready to claim now.
    pub fn ready(&self, daemon: &dyn Daemon) -> anyhow::Result<usize> {
        let _held = self.lock()?;
        Ok(self.survey(daemon)?.ready.len())
    }

    /// The daemon's id of member `n`.
    pub fn member_id(&self, n: u64) -> String {
        format!("pool-{}-{n}", self.hex)
    }

    fn member_dir(&self, n: u64) -> PathBuf {
        self.root.join(n.to_string())
    }

    /// The pool's lock (a claim, a refill, a drain and `retire` take it).
    pub(crate) fn lock(&self) -> anyhow::Result<File> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .with_context(|| format!("cannot create the warm pool's directory {}", self.root.display()))?;
        lock(&self.root.join("lock"), Instant::now() + LOCK_WAIT)
    }

    /// The members' numbers, in order (entries that are not a member's
    /// directory are no business of the pool's).
    fn members(&self) -> anyhow::Result<Vec<u64>> {
        let mut v = Vec::new();
        let rd = std::fs::read_dir(&self.root)
            .with_context(|| format!("cannot read the warm pool's directory {}", self.root.display()))?;
        for e in rd.flatten() {
            if let Some(n) = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok())
                && e.file_type().is_ok_and(|t| t.is_dir())
            {
                v.push(n);
            }
        }
        v.sort_unstable();
        Ok(v)
    }

    /// Sorts the members (the pool's lock held): ready and paused ones to
    /// claim, live boots to count, and removes what dead shims or someone
    /// else's resume left. A daemon that cannot tell a member's life is an
    /// error: nothing is removed on a guess.
    fn survey(&self, daemon: &dyn Daemon) -> anyhow::Result<Survey> {
        let mut s = Survey::default();
        for n in self.abandoned_claims() {
            tracing::warn!(
                "warm pool member {} was left mid-claim by a shim that died: removed",
                self.member_id(n)
            );
            if let Err(e) = daemon.delete(&self.member_id(n)) {
                tracing::warn!("cannot remove warm pool member {}: {e:#}", self.member_id(n));
            }
            remove_dir(&self.root.join(format!("{CLAIMED}{n}")));
        }
        for n in self.members()? {
            let dir = self.member_dir(n);
            let id = self.member_id(n);
            if dir.join("ready").exists() {
                match daemon.life(&id)? {
                    VmLife::Paused => s.ready.push(n),
                    VmLife::DaemonGone => bail!("the k7d daemon is not running"),
                    other => {
                        tracing::warn!("warm pool member {id} is {other:?}, not paused: removed");
                        self.remove(daemon, n);
                    }
                }
            } else if try_lock(&dir.join("boot.lock"))?.is_some() {
                tracing::warn!("warm pool member {id} was left half-booted by a shim that died: removed");
                self.remove(daemon, n);
            } else {
                s.booting += 1;
            }
        }
        Ok(s)
    }

    /// Members whose claim a dead shim left (`claimed-<n>` directories).
    fn abandoned_claims(&self) -> Vec<u64> {
        std::fs::read_dir(&self.root)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str()?.strip_prefix(CLAIMED)?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn remove(&self, daemon: &dyn Daemon, n: u64) {
        let id = self.member_id(n);
        if let Err(e) = daemon.delete(&id) {
            tracing::warn!("cannot remove warm pool member {id}: {e:#}");
        }
        remove_dir(&self.member_dir(n));
    }

    /// Claims a ready member for the pod `names`: taken out of the pool
    /// first (its directory renamed `claimed-<n>`, one atomic step under the
    /// pool's lock), then its VM id recorded in the pod's directory (so the
    /// stateless delete finds it) and its vsock socket moved to the pod's.
    /// `None` when no member is ready. The member stays paused, its NIC
    /// bare: the caller attaches and resumes it. A claim that fails once
    /// the member is out of the pool deletes it and its record.
    pub fn claim(&self, daemon: &dyn Daemon, names: &PodNames) -> anyhow::Result<Option<String>> {
        if self.size == 0 {
            return Ok(None);
        }
        let _held = self.lock()?;
        let Some(&n) = self.survey(daemon)?.ready.first() else {
            return Ok(None);
        };
        let id = self.member_id(n);
        let taken = self.root.join(format!("{CLAIMED}{n}"));
        std::fs::rename(self.member_dir(n), &taken)
            .with_context(|| format!("cannot take warm pool member {id} out of {}", self.root.display()))?;
        // A bound socket keeps its listener across a rename: the agent is
        // reached at the pod's path from now on.
        let r = names
            .record_vm(&id)
            .with_context(|| format!("cannot record the claim of {id} in {}", names.dir.display()))
            .and_then(|()| {
                std::fs::rename(taken.join("vsock.sock"), &names.vsock)
                    .with_context(|| format!("cannot move the vsock socket of {id} to {}", names.vsock.display()))
            });
        remove_dir(&taken);
        if let Err(e) = r {
            if let Err(d) = daemon.delete(&id) {
                tracing::warn!("cannot remove warm pool member {id} after a failed claim: {d:#}");
            }
            names.forget_vm();
            return Err(e);
        }
        tracing::info!(member = %id, "warm pool member claimed");
        Ok(Some(id))
    }

    /// Brings the pool to its size (ready or booting members): a pool
    /// that holds more (its `pool_size` was lowered, to 0 even) loses its
    /// newest ready members; one that holds fewer gets members booted one
    /// at a time, each at most `boot`. Returns how many this call booted
    /// and how many it removed.
    pub fn refill(&self, daemon: &dyn Daemon, cfg: &ShimConfig, boot: Duration) -> anyhow::Result<(u32, usize)> {
        let mut booted = 0;
        let mut removed = 0;
        loop {
            let (n, boot_lock) = {
                let _held = self.lock()?;
                // This config uses the pool (`retire`).
                crate::retire::note_origin(&self.root, cfg, self.shape)?;
                let s = self.survey(daemon)?;
                let size = usize::from(self.size);
                let excess = (s.ready.len() + s.booting).saturating_sub(size);
                for &n in s.ready.iter().rev().take(excess) {
                    tracing::info!(member = %self.member_id(n), "warm pool member removed: the pool keeps {size}");
                    self.remove(daemon, n);
                    removed += 1;
                }
                if s.ready.len() + s.booting >= size {
                    return Ok((booted, removed));
                }
                let n = self.next_number()?;
                let dir = self.member_dir(n);
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
                match try_lock(&dir.join("boot.lock")) {
                    Ok(Some(l)) => (n, l),
                    Ok(None) => bail!("the boot lock of a new warm pool member {} was taken", dir.display()),
                    Err(e) => {
                        remove_dir(&dir);
                        return Err(e);
                    }
                }
            };
            let id = self.member_id(n);
            let dir = self.member_dir(n);
            // Never a live VM's id (a `next` someone reset): nothing of its
            // is touched, and the boot is refused.
            match daemon.life(&id) {
                Ok(VmLife::Gone) => {}
                Ok(l) => {
                    let _held = self.lock()?;
                    remove_dir(&dir);
                    bail!(
                        "warm pool member {id} already exists in the daemon ({l:?}): {} is stale",
                        self.root.join("next").display()
                    );
                }
                Err(e) => {
                    let _held = self.lock()?;
                    remove_dir(&dir);
                    return Err(e);
                }
            }
            let spec = booted_spec(cfg, &id, dir.join("vsock.sock"), self.shape);
            let r = boot_paused(daemon, &spec, boot).and_then(|()| {
                std::fs::write(dir.join("ready"), b"").with_context(|| format!("cannot mark {} ready", dir.display()))
            });
            if let Err(e) = r {
                let _held = self.lock()?;
                self.remove(daemon, n);
                return Err(e.context(format!("cannot boot warm pool member {id}")));
            }
            drop(boot_lock);
            tracing::info!(member = %id, "warm pool member booted and paused");
            booted += 1;
        }
    }

    /// Empties the pool, as a node does before it changes the pool's
    /// config (the hash names a new pool then; Kata's equivalent for its VM
    /// templates is `kata-runtime factory destroy`): under the pool's lock,
    /// what dead shims left is swept (the survey) and every ready member is
    /// deleted; members another process is booting are left to finish and
    /// counted (drain again once they are ready). Returns (removed, booting).
    pub fn drain(&self, daemon: &dyn Daemon) -> anyhow::Result<(usize, usize)> {
        let _held = self.lock()?;
        self.drain_held(daemon)
    }

    /// [`Pool::drain`] with the pool's lock held by the caller ([`Pool::lock`]).
    pub(crate) fn drain_held(&self, daemon: &dyn Daemon) -> anyhow::Result<(usize, usize)> {
        let s = self.survey(daemon)?;
        for &n in &s.ready {
            self.remove(daemon, n);
        }
        Ok((s.ready.len(), s.booting))
    }

    /// Starts `k7d pool-fill --after-s <pool_refill_delay_s>` (this binary,
    /// with the config the pod's came from) in a process group of its own
    /// (containerd's signals to the shim do not reach it), its output
    /// appended to `fill.log` in the pool's directory.
    pub fn spawn_refill(&self, cfg: &ShimConfig) -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt;
        if self.size == 0 {
            return Ok(());
        }
        drop(self.lock()?);
        let log_path = self.root.join("fill.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        let mut cmd = std::process::Command::new("/proc/self/exe");
        cmd.arg("pool-fill")
            .arg("--after-s")
            .arg(cfg.pool_refill_delay_s.to_string());
        // The runtime class's config when the pod's came from one.
        if let Some(p) = &cfg.source {
            cmd.arg("--config").arg(p);
        }
        cmd.stdin(std::process::Stdio::null())
            .stdout(log.try_clone().context("cannot share the fill log")?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("cannot run k7d pool-fill")?;
        Ok(())
    }

    /// The next member's number (the pool's lock held).
    fn next_number(&self) -> anyhow::Result<u64> {
        let p = self.root.join("next");
        let n = match std::fs::read_to_string(&p) {
            Ok(s) => s
                .trim()
                .parse::<u64>()
                .with_context(|| format!("{} does not hold a member number", p.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", p.display())),
        };
        // Past every member there is, whatever `next` said.
        let n = n.max(self.members()?.last().map_or(0, |m| m + 1));
        // Written whole or not at all.
        let tmp = self.root.join("next.tmp");
        std::fs::write(&tmp, (n + 1).to_string())
            .and_then(|()| std::fs::rename(&tmp, &p))
            .with_context(|| format!("cannot write {}", p.display()))?;
        Ok(n)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use std::path::Path;

    use super::*;
    use crate::daemon::{ForkedPod, PodNic, PodVmSpec};

    /// A daemon that knows the lives it is told and records deletes (the
    /// template's tests use it too).
    #[derive(Default)]
    pub(crate) struct Lives {
        pub(crate) lives: Mutex<HashMap<String, VmLife>>,
        pub(crate) deleted: Mutex<Vec<String>>,
    }

    impl Daemon for Lives {
        fn create(&self, _: &PodVmSpec) -> anyhow::Result<()> {
            bail!("not in this test")
        }
        fn fork(&self, _: &str, _: &ForkedPod) -> anyhow::Result<()> {
            bail!("not in this test")
        }
        fn delete(&self, id: &str) -> anyhow::Result<()> {
            self.lives.lock().unwrap().remove(id);
            self.deleted.lock().unwrap().push(id.to_string());
            Ok(())
        }
        fn pause(&self, _: &str) -> anyhow::Result<()> {
            Ok(())
        }
        fn resume(&self, _: &str) -> anyhow::Result<()> {
            Ok(())
        }
        fn life(&self, id: &str) -> anyhow::Result<VmLife> {
            Ok(self.lives.lock().unwrap().get(id).cloned().unwrap_or(VmLife::Gone))
        }
        fn set_medium(&self, _: &str, _: u32, _: Option<&Path>) -> anyhow::Result<()> {
            Ok(())
        }
        fn attach_nic(&self, _: &str, _: &PodNic) -> anyhow::Result<()> {
            Ok(())
        }
        fn pid(&self) -> anyhow::Result<u32> {
            Ok(1)
        }
        fn vm_pid(&self, _id: &str) -> anyhow::Result<Option<u32>> {
            Ok(None)
        }
        fn pod_cgroup(&self, _: &str, _: &str) -> anyhow::Result<()> {
            bail!("not in this test")
        }
    }

    fn cfg(state: &Path) -> ShimConfig {
        toml::from_str(&format!(
            "kernel = \"/k\"\ninitramfs = \"/i\"\nstate_dir = \"{}\"\npool_size = 3\n",
            state.display()
        ))
        .unwrap()
    }

    /// Member `n` as a shim left it: a socket stand-in, ready or not.
    fn member(p: &Pool, n: u64, ready: bool) -> PathBuf {
        let dir = p.member_dir(n);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vsock.sock"), n.to_string()).unwrap();
        if ready {
            std::fs::write(dir.join("ready"), b"").unwrap();
        }
        dir
    }

    #[test]
    fn a_drain_deletes_the_ready_members_and_leaves_live_boots() {
        let state = std::env::temp_dir().join(format!("k7d-pool-drain-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let c = cfg(&state);
        let p = for_shape(&c, c.vcpus, c.memory_mib);
        let d = Lives::default();
        std::fs::create_dir_all(&p.root).unwrap();
        // 1, 2: ready and paused; 3: booting (its shim holds the boot lock);
        // 4: half-booted, its shim dead.
        member(&p, 1, true);
        member(&p, 2, true);
        let booting = member(&p, 3, false);
        let held = try_lock(&booting.join("boot.lock")).unwrap().unwrap();
        member(&p, 4, false);
        for n in [1, 2] {
            d.lives.lock().unwrap().insert(p.member_id(n), VmLife::Paused);
        }
        d.lives.lock().unwrap().insert(p.member_id(3), VmLife::Running);
        assert_eq!(p.drain(&d).unwrap(), (2, 1));
        let mut deleted = d.deleted.lock().unwrap().clone();
        deleted.sort();
        assert_eq!(deleted, [p.member_id(1), p.member_id(2), p.member_id(4)]);
        assert!(!p.member_dir(1).exists() && !p.member_dir(2).exists() && !p.member_dir(4).exists());
        assert!(booting.exists(), "a live boot is left to finish");
        assert_eq!(p.ready(&d).unwrap(), 0);
        // Once it is ready, the next drain takes it.
        drop(held);
        std::fs::write(booting.join("ready"), b"").unwrap();
        d.lives.lock().unwrap().insert(p.member_id(3), VmLife::Paused);
        assert_eq!(p.drain(&d).unwrap(), (1, 0));
        assert!(!booting.exists());
        // A daemon gone is an error, and nothing is removed on a guess.
        member(&p, 5, true);
        d.lives.lock().unwrap().insert(p.member_id(5), VmLife::DaemonGone);
        let e = format!("{:#}", p.drain(&d).unwrap_err());
        assert!(e.contains("daemon is not running"), "{e}");
        assert!(p.member_dir(5).exists());
        std::fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn a_refill_trims_a_pool_whose_size_was_lowered_newest_first() {
        let state = std::env::temp_dir().join(format!("k7d-pool-trim-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let mut c = cfg(&state);
        let p = for_shape(&c, c.vcpus, c.memory_mib);
        let d = Lives::default();
        std::fs::create_dir_all(&p.root).unwrap();
        for n in [1, 2, 3] {
            member(&p, n, true);
            d.lives.lock().unwrap().insert(p.member_id(n), VmLife::Paused);
        }
        // At its size: nothing booted (the fake daemon boots nothing), nothing removed.
        assert_eq!(p.refill(&d, &c, Duration::from_secs(1)).unwrap(), (0, 0));
        // Lowered to 1 (the pool's name does not hold its size): the two
        // newest go, the oldest stays to be claimed.
        c.pool_size = 1;
        let p1 = for_shape(&c, c.vcpus, c.memory_mib);
        assert_eq!(p1.name(), p.name());
        assert_eq!(p1.refill(&d, &c, Duration::from_secs(1)).unwrap(), (0, 2));
        assert_eq!(*d.deleted.lock().unwrap(), [p.member_id(3), p.member_id(2)]);
        assert!(p.member_dir(1).exists() && !p.member_dir(2).exists() && !p.member_dir(3).exists());
        // pool_size = 0 drains it.
        c.pool_size = 0;
        let p0 = for_shape(&c, c.vcpus, c.memory_mib);
        assert_eq!(p0.refill(&d, &c, Duration::from_secs(1)).unwrap(), (0, 1));
        assert_eq!(p0.ready(&d).unwrap(), 0);
        assert!(!p.member_dir(1).exists());
        std::fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn a_claim_takes_the_oldest_paused_member_and_clears_what_dead_shims_left() {
        let state = std::env::temp_dir().join(format!("k7d-pool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let c = cfg(&state);
        let p = for_shape(&c, c.vcpus, c.memory_mib);
        assert_eq!(p, for_shape(&c, c.vcpus, c.memory_mib));
        assert!(p.member_id(7).starts_with("pool-") && p.member_id(7).ends_with("-7"));
        let d = Lives::default();
        std::fs::create_dir_all(&p.root).unwrap();
        // 1: ready, but someone resumed it; 2: half-booted, its shim dead;
        // 3: booting (its shim holds the boot lock); 4, 5: ready and paused.
        member(&p, 1, true);
        member(&p, 2, false);
        let booting = member(&p, 3, false);
        let held = try_lock(&booting.join("boot.lock")).unwrap().unwrap();
        member(&p, 4, true);
        member(&p, 5, true);
        for (n, l) in [
            (1, VmLife::Running),
            (2, VmLife::Running),
            (3, VmLife::Running),
            (4, VmLife::Paused),
            (5, VmLife::Paused),
        ] {
            d.lives.lock().unwrap().insert(p.member_id(n), l);
        }
        let names = crate::names::pod_names(&state, "default", "sb1");
        std::fs::create_dir_all(&names.dir).unwrap();
        let got = p.claim(&d, &names).unwrap();
        assert_eq!(got.as_deref(), Some(p.member_id(4).as_str()));
        assert_eq!(
            std::fs::read_to_string(&names.vsock).unwrap(),
            "4",
            "the member's socket is the pod's"
        );
        assert_eq!(
            names.clone().resolved().vm_id,
            p.member_id(4),
            "the stateless delete finds it"
        );
        assert!(!p.member_dir(4).exists(), "a claimed member leaves the pool");
        let mut deleted = d.deleted.lock().unwrap().clone();
        deleted.sort();
        assert_eq!(
            deleted,
            [p.member_id(1), p.member_id(2)],
            "what dead shims and a resume left"
        );
        assert!(!p.member_dir(1).exists() && !p.member_dir(2).exists());
        assert!(booting.exists(), "a live boot is left alone");
        let s = p.survey(&d).unwrap();
        assert_eq!((s.ready, s.booting), (vec![5], 1));
        // The next number is past every member, whatever `next` said.
        std::fs::write(p.root.join("next"), "2").unwrap();
        assert_eq!(p.next_number().unwrap(), 6);
        assert_eq!(p.next_number().unwrap(), 7);
        // A daemon gone is an error, and nothing is removed on a guess.
        d.lives.lock().unwrap().insert(p.member_id(5), VmLife::DaemonGone);
        let names2 = crate::names::pod_names(&state, "default", "sb2");
        std::fs::create_dir_all(&names2.dir).unwrap();
        let e = format!("{:#}", p.claim(&d, &names2).unwrap_err());
        assert!(e.contains("daemon is not running"), "{e}");
        assert!(p.member_dir(5).exists());
        // The last one is claimed; then the pool is empty: `None`, not an error.
        d.lives.lock().unwrap().insert(p.member_id(5), VmLife::Paused);
        assert_eq!(p.claim(&d, &names2).unwrap(), Some(p.member_id(5)));
        drop(held);
        assert_eq!(
            p.claim(&d, &names2).unwrap(),
            None,
            "3 died too: removed, nothing ready"
        );
        assert!(!booting.exists());
        // A claim that fails once the member is out of the pool (here: its
        // socket is missing) deletes it and forgets the record.
        let m = member(&p, 8, true);
        std::fs::remove_file(m.join("vsock.sock")).unwrap();
        d.lives.lock().unwrap().insert(p.member_id(8), VmLife::Paused);
        let names3 = crate::names::pod_names(&state, "default", "sb3");
        std::fs::create_dir_all(&names3.dir).unwrap();
        let e = format!("{:#}", p.claim(&d, &names3).unwrap_err());
        assert!(e.contains("cannot move the vsock socket"), "{e}");
        assert!(d.deleted.lock().unwrap().contains(&p.member_id(8)));
        assert_eq!(names3.clone().resolved(), names3, "no record of a failed claim");
        assert!(!m.exists() && !p.root.join("claimed-8").exists());
        // A claim a dead shim left mid-way (`claimed-<n>`) is swept.
        std::fs::create_dir_all(p.root.join("claimed-9")).unwrap();
        d.lives.lock().unwrap().insert(p.member_id(9), VmLife::Paused);
        assert_eq!(p.claim(&d, &names3).unwrap(), None);
        assert!(d.deleted.lock().unwrap().contains(&p.member_id(9)));
        assert!(!p.root.join("claimed-9").exists());
        // A `next` that holds no number is an error, not member 0 again.
        std::fs::write(p.root.join("next"), "garbage").unwrap();
        assert!(p.next_number().is_err());
        // A pool of size 0 claims nothing.
        let mut c0 = c.clone();
        c0.pool_size = 0;
        assert_eq!(
            for_shape(&c0, c0.vcpus, c0.memory_mib).claim(&d, &names2).unwrap(),
            None
        );
        std::fs::remove_dir_all(&state).unwrap();
    }
}

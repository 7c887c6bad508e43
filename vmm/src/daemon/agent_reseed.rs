//! The kernel RNG of a fork child or a restored VM whose guest has no
//! vmgenid driver (Debian's cloud kernel), reseeded by k7d-agent in it
//! (issue 40, item 2): the daemon connects to each such VM's agent through
//! its vsock socket and sends host entropy (`Request::Reseed`), which the
//! agent credits to the kernel's pool and reseeds its RNG from. A child in a
//! VM process of its own is asked the moment it starts ([`AgentReseeds::begin`],
//! while its siblings are still being built), every other one once the fork
//! or the restore is done; the daemon answers once every one has answered,
//! or [`DEADLINE`] after the step began. Children of one source then draw
//! different bytes from their first draw after their reseed. A VM without
//! vsock, or without an agent listening, is left as it was (the fork's
//! once-per-source warning says so).
//!
//! `info` says `rng_reseed: agent` for a VM whose agent has reseeded it or
//! a child of it: remembered in its record (`VmRecord::rng_agent`), so a
//! daemon started again says the same, until the VM is deleted. `info`
//! itself asks no agent: it is the call `k7d exec` and the shim make before
//! each use.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::agent_conns::{AgentConns, Conn};
use super::api::{Forked, VmInfo};
use crate::RngReseed;

/// Entropy bytes sent to each VM (the agent takes 32 to 512).
#[cfg(feature = "shim")]
const ENTROPY: usize = 64;
/// How long a reseed's connect, `Hello` and `Reseed` may each take: an
/// agent answers in milliseconds on a host, in a second in the nested lab.
#[cfg(feature = "shim")]
const RESEED_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a fork's or a restore's answer waits for its reseeds in all,
/// from the moment the last of them began: an agent that has not answered
/// by then is reported as not reseeded (its reseed may still land later).
const DEADLINE: Duration = Duration::from_secs(15);
/// A reseed begun for a child whose fork then failed is dropped when
/// another begins this much later.
const STALE: Duration = Duration::from_secs(300);

/// A reseed under way in a thread of its own: its result arrives on `rx`,
/// the connection it was made on when it is done (in step, kept for the
/// VM's first `exec`, `agent_conns.rs`: a fork child's first command then
/// costs one round trip, not a connect too).
struct Begun {
    at: Instant,
    rx: mpsc::Receiver<Result<Conn, String>>,
}

/// VMs whose agent has answered (`info` says `agent` for them), and the
/// reseeds of fork children begun as they started.
pub(super) struct AgentReseeds {
    known: Mutex<HashSet<String>>,
    begun: Mutex<HashMap<String, Begun>>,
    /// [`DEADLINE`] (shorter in tests).
    deadline: Duration,
}

impl Default for AgentReseeds {
    fn default() -> Self {
        Self::with_known([])
    }
}

/// The vsock socket of a VM whose children would share its kernel RNG
/// without the agent: no vmgenid driver (or no device), and a vsock device.
fn wants_agent(info: &VmInfo) -> Option<PathBuf> {
    match info.rng_reseed? {
        RngReseed::NoDriver | RngReseed::Off | RngReseed::Agent => {}
        RngReseed::Vmgenid => return None,
    }
    info.config.devices.vsock.as_ref().map(|v| v.uds.clone())
}

/// The start of the once-per-source warning a fork of `source` carries
/// when its children share its kernel RNG (`rng_warning`).
pub(super) fn shared_rng_warning(source: &str) -> String {
    format!("vm {source}'s fork children share its kernel RNG state")
}

/// The reseed of the VM at `uds`, begun in a thread of its own.
fn spawn_reseed(id: &str, uds: PathBuf) -> Begun {
    let (tx, rx) = mpsc::channel();
    let vm = id.to_string();
    let spawned = std::thread::Builder::new().name("k7d-reseed".into()).spawn(move || {
        let t = Instant::now();
        let r = reseed(&uds);
        if r.is_ok() {
            // The window in which the VM drew with its source's state.
            let ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
            tracing::info!(vm = %vm, ms, "the kernel RNG was reseeded through the guest agent");
        }
        // The receiver may be gone (a fork that failed): nothing waits.
        let _ = tx.send(r);
    });
    if let Err(e) = spawned {
        tracing::warn!(vm = %id, error = %e, "cannot start a thread for the agent's reseed");
    }
    // A thread that did not start dropped its sender: the wait says so.
    Begun { at: Instant::now(), rx }
}

/// The results of `begun`, in order, each waited for until `deadline`.
fn wait_all(begun: Vec<Begun>, deadline: Instant) -> Vec<Result<Conn, String>> {
    begun
        .into_iter()
        .map(
            |b| match b.rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(r) => r,
                Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
                    "its agent did not answer within {} s",
                    deadline.saturating_duration_since(b.at).as_secs()
                )),
                Err(mpsc::RecvTimeoutError::Disconnected) => Err("the reseed's thread ended without an answer".into()),
            },
        )
        .collect()
}

impl AgentReseeds {
    /// What a daemon started again knows from the VMs' records: these VMs'
    /// agents (or their children's) reseeded them.
    pub(super) fn with_known(ids: impl IntoIterator<Item = String>) -> Self {
        Self {
            known: Mutex::new(ids.into_iter().collect()),
            begun: Mutex::default(),
            deadline: DEADLINE,
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begun(&self) -> std::sync::MutexGuard<'_, HashMap<String, Begun>> {
        self.begun.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `info`'s `rng_reseed` is `agent` where an agent reseeded the VM or
    /// a child of it.
    pub(super) fn show(&self, info: &mut VmInfo) {
        if wants_agent(info).is_some() && self.known().contains(&info.id) {
            info.rng_reseed = Some(RngReseed::Agent);
        }
    }

    /// A fork child that has just started (its vCPUs run) and whose kernel
    /// would not reseed on its own: its agent's reseed begins now, while
    /// its siblings are still being built, and the fork's answer waits for
    /// it ([`AgentReseeds::forked`]). The window in which the child draws
    /// what its source would is the child's start to this reseed, not the
    /// whole batch's build.
    pub(super) fn begin(&self, info: &VmInfo) {
        let Some(uds) = wants_agent(info) else {
            return;
        };
        let b = spawn_reseed(&info.id, uds);
        let mut begun = self.begun();
        begun.retain(|_, old| b.at.duration_since(old.at) < STALE);
        begun.insert(info.id.clone(), b);
    }

    /// A restored VM whose kernel would not reseed on its own: its agent
    /// reseeds it (logged if it cannot), and the connection is kept in
    /// `conns`. Returns whether it did, for its record.
    pub(super) fn restored(&self, info: &mut VmInfo, conns: &AgentConns) -> bool {
        let Some(uds) = wants_agent(info) else {
            return false;
        };
        let b = spawn_reseed(&info.id, uds.clone());
        let deadline = b.at + self.deadline;
        match wait_all(vec![b], deadline).remove(0) {
            Ok(conn) => {
                conns.put(&info.id, &uds, conn);
                self.known().insert(info.id.clone());
                info.rng_reseed = Some(RngReseed::Agent);
                true
            }
            Err(e) => {
                tracing::warn!(vm = %info.id, "a restored VM's kernel RNG was not reseeded through its agent: {e}");
                false
            }
        }
    }

    /// A fork's children whose kernels would not reseed on their own: each
    /// one's agent reseeds it (begun as it started, [`AgentReseeds::begin`],
    /// where the fork began at `since` or later; else now, all at once).
    /// A source all of whose children were reseeded so loses its shared-RNG
    /// warning; a child whose agent failed where its source's had answered
    /// gets a warning of its own. Each reseed's connection is kept in
    /// `conns` for the child's first `exec`. Returns the VMs now known
    /// (children and their sources), for their records.
    pub(super) fn forked(&self, forked: &mut Forked, since: Instant, conns: &AgentConns) -> Vec<String> {
        let targets: Vec<((usize, PathBuf), Begun)> = forked
            .children
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let uds = wants_agent(&c.info)?;
                let early = self.begun().remove(&c.info.id).filter(|b| b.at >= since);
                let b = early.unwrap_or_else(|| spawn_reseed(&c.info.id, uds.clone()));
                Some(((i, uds), b))
            })
            .collect();
        if targets.is_empty() {
            return Vec::new();
        }
        let (order, begun): (Vec<(usize, PathBuf)>, Vec<Begun>) = targets.into_iter().unzip();
        let results = order.into_iter().zip(wait_all(begun, Instant::now() + self.deadline));
        // Per source: whether every child of it that wanted the agent got it.
        let mut sources: Vec<(String, bool)> = Vec::new();
        let mut warnings = Vec::new();
        let mut newly = Vec::new();
        for ((i, uds), r) in results {
            let child = &mut forked.children[i];
            let source = child.info.parent.clone().unwrap_or_else(|| forked.id.clone());
            let ok = r.is_ok();
            match r {
                Ok(conn) => {
                    conns.put(&child.info.id, &uds, conn);
                    child.info.rng_reseed = Some(RngReseed::Agent);
                    let mut known = self.known();
                    for id in [&child.info.id, &source] {
                        if known.insert(id.clone()) {
                            newly.push(id.clone());
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(vm = %child.info.id, "no reseed through the agent: {e}");
                    if self.known().contains(&source) {
                        let w = format!(
                            "vm {}'s kernel RNG was not reseeded through its agent, so it may draw what its siblings draw: {e}",
                            child.info.id
                        );
                        tracing::warn!(vm = %child.info.id, "{w}");
                        warnings.push(w);
                    }
                }
            }
            match sources.iter_mut().find(|(s, _)| *s == source) {
                Some((_, all)) => *all &= ok,
                None => sources.push((source, ok)),
            }
        }
        for (source, all) in sources {
            if all {
                let w = shared_rng_warning(&source);
                forked.warnings.retain(|x| !x.starts_with(&w));
            }
        }
        forked.warnings.extend(warnings);
        newly
    }

    /// `id` is deleted: a new VM of that id is asked again.
    pub(super) fn forget(&self, id: &str) {
        self.known().remove(id);
        self.begun().remove(id);
    }
}

/// Reseeds the kernel RNG of the VM whose vsock socket is `uds` through
/// its agent; the connection, in step, comes back.
#[cfg(feature = "shim")]
fn reseed(uds: &std::path::Path) -> Result<Conn, String> {
    use k7d_agent::proto::{Reply, Request};
    let mut entropy = vec![0u8; ENTROPY];
    k7d_sys::random::fill(&mut entropy).map_err(|e| format!("cannot draw host entropy: {e}"))?;
    let mut conn = k7d_shim::agent::Agent::new(uds)
        .connect(RESEED_TIMEOUT)
        .map_err(|e| format!("{e:#}"))?;
    match conn.call(&Request::Reseed { entropy }) {
        Ok(Reply::Done) => Ok(conn),
        Ok(other) => Err(format!("the guest agent answered the reseed with {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(not(feature = "shim"))]
fn reseed(_: &std::path::Path) -> Result<Conn, String> {
    Err("this k7d is built without the agent's client".into())
}

#[cfg(all(test, feature = "shim"))]
mod tests {
    use super::*;
    use k7d_agent::proto::{Reply, Request, Response};
    use k7d_api::api::ForkedChild;
    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;

    /// A VM's vsock socket with an agent behind it, as the VMM and the
    /// agent answer: `OK <port>`, `Hello`, then `Reseed` (its entropy sent
    /// to `got`) answered `Done`, or refused when `refuse`.
    fn agent(dir: &std::path::Path, name: &str, refuse: bool, got: mpsc::Sender<Vec<u8>>) -> PathBuf {
        let uds = dir.join(name);
        crate::execcli::fake_agent(&uds, move |req| match req {
            Request::Reseed { entropy } if !refuse => {
                got.send(entropy).unwrap();
                Response::Ok(Reply::Done)
            }
            other => Response::Err {
                message: format!("not this one: {other:?}"),
                not_found: false,
            },
        });
        uds
    }

    /// A VM's vsock socket whose agent takes the connection and never
    /// answers.
    fn silent(dir: &std::path::Path, name: &str) -> PathBuf {
        let uds = dir.join(name);
        let l = UnixListener::bind(&uds).unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept() {
                held.push(s);
            }
        });
        uds
    }

    fn child(id: &str, parent: &str, reseed: RngReseed, uds: Option<PathBuf>) -> ForkedChild {
        let mut config = crate::VmConfig::default();
        config.devices.vsock = uds.map(|uds| crate::config::VsockConfig { cid: 3, uds });
        let info: VmInfo = serde_json::from_value(serde_json::json!({
            "id": id, "status": "running", "state": crate::VmState::Running,
            "config": config, "devices": [], "serial_log": null, "daemon_pid": 1,
            "created_unix": null, "ms_since_start": null, "first_exit_us_after_start": null,
            "exits": 0, "parent": parent, "rng_reseed": reseed,
        }))
        .unwrap();
        ForkedChild {
            info,
            fork_ms: 1.0,
            shell: false,
        }
    }

    fn forked(children: Vec<ForkedChild>, warnings: &[&str]) -> Forked {
        Forked {
            id: "src".into(),
            children,
            pause_ms: 1.0,
            source_paused_ms: 2.0,
            clusters: Vec::new(),
            rebased: Vec::new(),
            warnings: warnings.iter().map(|w| w.to_string()).collect(),
        }
    }

    #[test]
    fn children_without_a_vmgenid_driver_are_reseeded_through_their_agents() {
        let dir = std::env::temp_dir().join(format!("k7d-agent-reseed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (tx, rx) = mpsc::channel();
        let a1 = agent(&dir, "a1", false, tx.clone());
        let a2 = agent(&dir, "a2", false, tx.clone());
        let shared = format!("{}: none: ...", shared_rng_warning("src"));
        let reseeds = AgentReseeds::default();
        let conns = AgentConns::default();
        let mut f = forked(
            vec![
                child("src-f1", "src", RngReseed::NoDriver, Some(a1)),
                child("src-f2", "src", RngReseed::Off, Some(a2)),
                // Its kernel reseeds itself: its agent is not asked.
                child("src-f3", "src", RngReseed::Vmgenid, Some(dir.join("nobody"))),
            ],
            &[&shared],
        );
        reseeds.forked(&mut f, Instant::now(), &conns);
        let (e1, e2) = (rx.recv().unwrap(), rx.recv().unwrap());
        assert!(rx.try_recv().is_err(), "one reseed per child that wanted it");
        assert_eq!((e1.len(), e2.len()), (ENTROPY, ENTROPY));
        assert_ne!(e1, e2, "each child its own host entropy");
        let said: Vec<_> = f.children.iter().map(|c| c.info.rng_reseed).collect();
        assert_eq!(
            said,
            [Some(RngReseed::Agent), Some(RngReseed::Agent), Some(RngReseed::Vmgenid)]
        );
        // Each reseed's connection is kept for the child's first exec, in
        // step (open, nothing unread), at the child's own socket only.
        assert_eq!(
            (conns.kept("src-f1"), conns.kept("src-f2"), conns.kept("src-f3")),
            (1, 1, 0)
        );
        assert!(
            conns.take("src-f1", &dir.join("a2")).is_none(),
            "kept for its own socket only"
        );
        let mut kept = conns
            .take("src-f2", &dir.join("a2"))
            .expect("src-f2's reseed connection is kept");
        assert!(kept.idle_and_open());
        assert!(
            matches!(kept.call(&Request::Reseed { entropy: vec![1; 32] }), Ok(Reply::Done)),
            "the kept connection takes the next request"
        );
        assert_eq!(rx.recv().unwrap(), vec![1; 32]);
        assert!(
            f.warnings.is_empty(),
            "every child reseeded: no shared-RNG warning: {:?}",
            f.warnings
        );
        // `info` says agent for the source and the children from now on.
        let mut src = child("src", "", RngReseed::NoDriver, Some(dir.join("nobody"))).info;
        reseeds.show(&mut src);
        assert_eq!(src.rng_reseed, Some(RngReseed::Agent));

        // A child whose agent refuses, of a source whose agent answered
        // before: warned by name; a child without vsock keeps the shared
        // warning of its source (which has no agent known).
        let a3 = agent(&dir, "a3", true, tx.clone());
        let mut f = forked(
            vec![
                child("src-f4", "src", RngReseed::NoDriver, Some(a3)),
                child("other-f1", "other", RngReseed::NoDriver, Some(dir.join("nobody"))),
            ],
            &[&format!("{}: none: ...", shared_rng_warning("other"))],
        );
        reseeds.forked(&mut f, Instant::now(), &conns);
        assert_eq!(f.children[0].info.rng_reseed, Some(RngReseed::NoDriver));
        assert_eq!(f.warnings.len(), 2, "{:?}", f.warnings);
        assert!(
            f.warnings[0].starts_with(&shared_rng_warning("other")),
            "{:?}",
            f.warnings
        );
        assert!(
            f.warnings[1].starts_with("vm src-f4's kernel RNG was not reseeded through its agent")
                && f.warnings[1].contains("not this one"),
            "{:?}",
            f.warnings
        );
        // Deleted, and a VM of that id is asked again (nobody answers).
        reseeds.forget("src");
        let mut src = child("src", "", RngReseed::NoDriver, Some(dir.join("nobody"))).info;
        reseeds.show(&mut src);
        assert_eq!(src.rng_reseed, Some(RngReseed::NoDriver));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_child_reseeded_as_it_started_is_not_asked_again_and_a_silent_agent_costs_the_deadline() {
        let dir = std::env::temp_dir().join(format!("k7d-agent-reseed-early-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (tx, rx) = mpsc::channel();
        let reseeds = AgentReseeds {
            deadline: Duration::from_millis(300),
            ..Default::default()
        };
        let conns = AgentConns::default();

        // Begun as the child started: the fork's answer takes that reseed.
        let since = Instant::now();
        let early = child(
            "src-f1",
            "src",
            RngReseed::NoDriver,
            Some(agent(&dir, "a1", false, tx.clone())),
        );
        reseeds.begin(&early.info);
        let e1 = rx.recv_timeout(Duration::from_secs(10)).expect("begin reseeds at once");
        let mut f = forked(vec![early], &[&shared_rng_warning("src")]);
        let newly = reseeds.forked(&mut f, since, &conns);
        assert!(rx.try_recv().is_err(), "the child was not asked a second time");
        assert_eq!(e1.len(), ENTROPY);
        assert_eq!(f.children[0].info.rng_reseed, Some(RngReseed::Agent));
        assert!(f.warnings.is_empty(), "{:?}", f.warnings);
        assert_eq!(newly, ["src-f1", "src"], "both go in their records");

        // One begun before this fork (a failed fork's child of the same
        // id) is not taken for it: the child is asked again.
        let stale = child(
            "src-f2",
            "src",
            RngReseed::NoDriver,
            Some(agent(&dir, "a2", false, tx.clone())),
        );
        reseeds.begin(&stale.info);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let mut f = forked(vec![stale], &[]);
        let newly = reseeds.forked(&mut f, Instant::now(), &conns);
        rx.recv_timeout(Duration::from_secs(10)).expect("asked again");
        assert_eq!(newly, ["src-f2"], "src was known already");

        // An agent that never answers holds the answer for the deadline,
        // not for its socket's timeouts, and its child is warned by name.
        let t = Instant::now();
        let mut f = forked(
            vec![child("src-f3", "src", RngReseed::NoDriver, Some(silent(&dir, "a3")))],
            &[],
        );
        assert!(reseeds.forked(&mut f, t, &conns).is_empty());
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{took:?}"
        );
        assert_eq!(f.children[0].info.rng_reseed, Some(RngReseed::NoDriver));
        assert!(
            f.warnings.len() == 1 && f.warnings[0].contains("did not answer within"),
            "{:?}",
            f.warnings
        );

        // A daemon started again knows from the records.
        let again = AgentReseeds::with_known(["src".to_string()]);
        let mut src = child("src", "", RngReseed::NoDriver, Some(dir.join("nobody"))).info;
        again.show(&mut src);
        assert_eq!(src.rng_reseed, Some(RngReseed::Agent));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

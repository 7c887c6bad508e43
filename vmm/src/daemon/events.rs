//! The event log (issue 39, item 3; `docs/observability.md`, "Events"): one
//! JSON line per lifecycle event in `<state_dir>/events.jsonl`, so "what
//! happened to VM x" has an answer after the fact, across daemon restarts
//! (a new daemon appends to the same file). `k7d events` reads it.
//!
//! Each line has `ts` (Unix seconds, ms precision), `event`, the VM or
//! cluster (`vm` / `cluster`), what the event adds (a fork's `children`
//! and timings, a stop's `reason`), and the writing daemon's `daemon_pid`.
//! Events: `create`, `restore`, `start`, `pause`, `resume`, `stop` (asked),
//! `stopped` (the VM stopped, with why: asked, the guest, a crash, its
//! process's end), `snapshot`, `fork`, `rebase`, `medium`, `nic_attach`, `pod_cgroup`,
//! `delete`, `cluster_create`, `cluster_add`, `cluster_delete`,
//! `reattach` (a new daemon serving a VM process again).
//!
//! Bounded: past [`MAX_BYTES`] the file becomes `events.jsonl.1` (replacing
//! the one before) and a new one starts, so the log never holds more than
//! twice that. Writing is best effort: a failed write is logged, never
//! fails the request that made the event.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

use super::api::{Reply, Request};

/// The log's file name in the state directory.
pub const FILE: &str = "events.jsonl";

/// The size past which the log is rotated.
pub const MAX_BYTES: u64 = 8 << 20;

/// The log of one state directory.
#[derive(Debug)]
pub struct EventLog {
    path: PathBuf,
    max_bytes: u64,
    file: Mutex<Option<File>>,
}

/// The path of the rotated log next to `path`.
pub fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

impl EventLog {
    /// The log at `<state_dir>/events.jsonl` (opened at the first event).
    pub fn new(state_dir: &Path) -> Self {
        Self::with_max(state_dir, MAX_BYTES)
    }

    fn with_max(state_dir: &Path, max_bytes: u64) -> Self {
        Self {
            path: state_dir.join(FILE),
            max_bytes,
            file: Mutex::new(None),
        }
    }

    fn open(&self) -> std::io::Result<File> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&self.path)
    }

    /// Appends one event: `event`, its subject (`("vm", id)` or
    /// `("cluster", id)`) and `fields`.
    pub fn record(&self, event: &str, subject: Option<(&str, &str)>, fields: Map<String, Value>) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| (d.as_millis() as f64) / 1000.0)
            .unwrap_or(0.0);
        let mut line = Map::new();
        line.insert("ts".into(), json!(ts));
        line.insert("event".into(), json!(event));
        if let Some((k, v)) = subject {
            line.insert(k.into(), json!(v));
        }
        line.extend(fields);
        line.insert("daemon_pid".into(), json!(std::process::id()));
        let mut text = Value::Object(line).to_string();
        text.push('\n');
        if let Err(e) = self.append(text.as_bytes()) {
            tracing::warn!(path = %self.path.display(), error = %e, event, "cannot write to the event log");
        }
    }

    fn append(&self, line: &[u8]) -> std::io::Result<()> {
        let mut g = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(self.open()?);
        }
        let len = g
            .as_ref()
            .map(|f| f.metadata().map(|m| m.len()))
            .transpose()?
            .unwrap_or(0);
        if len > 0 && len + line.len() as u64 > self.max_bytes {
            std::fs::rename(&self.path, rotated(&self.path))?;
            *g = Some(self.open()?);
        }
        match g.as_mut() {
            Some(f) => f.write_all(line),
            None => Ok(()),
        }
    }

    /// The event a request that succeeded makes, if it changed anything.
    pub fn request(&self, req: &Request, reply: &Reply, took_ms: f64) {
        let mut f = Map::new();
        let ms = json!((took_ms * 1000.0).round() / 1000.0);
        let vm_event = |op: &str, id: &str, f: Map<String, Value>| self.record(op, Some(("vm", id)), f);
        match (req, reply) {
            (Request::Create(_), Reply::Vm(v)) => {
                f.insert("status".into(), json!(v.status));
                f.insert("guest".into(), json!(v.config.guest.describe()));
                f.insert("memory_mib".into(), json!(v.config.memory_mib));
                f.insert("ms".into(), ms);
                vm_event("create", &v.id, f);
            }
            (Request::Restore(a), Reply::Vm(v)) => {
                f.insert("dir".into(), json!(a.dir));
                f.insert("ms".into(), ms);
                vm_event("restore", &v.id, f);
            }
            (
                Request::Start(id) | Request::Pause(id) | Request::Resume(id) | Request::Stop(id) | Request::Rebase(id),
                _,
            ) => {
                f.insert("ms".into(), ms);
                vm_event(req.op(), id, f);
            }
            (Request::Medium(a), _) => {
                f.insert("disk".into(), json!(a.disk));
                f.insert("path".into(), json!(a.path));
                vm_event("medium", &a.id, f);
            }
            (Request::NicAttach(a), _) => {
                f.insert("nic".into(), json!(a.nic));
                f.insert("netns".into(), json!(a.datapath.netns));
                vm_event("nic_attach", &a.id, f);
            }
            (Request::PodCgroup(a), _) => {
                f.insert("cgroup_parent".into(), json!(a.cgroup_parent));
                vm_event("pod_cgroup", &a.id, f);
            }
            (Request::Delete(id), _) => vm_event("delete", id, f),
            (Request::Snapshot(a), Reply::Snapshot(s)) => {
                f.insert("dir".into(), json!(s.dir));
                f.insert("snapshot_ms".into(), json!(s.snapshot_ms));
                vm_event("snapshot", &a.id, f);
            }
            (Request::Fork(a), Reply::Forked(r)) => {
                let children: Vec<&str> = r.children.iter().map(|c| c.info.id.as_str()).collect();
                f.insert("children".into(), json!(children));
                f.insert("count".into(), json!(a.count));
                if !r.clusters.is_empty() {
                    f.insert("clusters".into(), json!(r.clusters));
                }
                f.insert("source_paused_ms".into(), json!(r.source_paused_ms));
                f.insert("ms".into(), ms);
                let subject = if r.clusters.is_empty() { "vm" } else { "cluster" };
                self.record("fork", Some((subject, &a.id)), f);
            }
            (Request::ClusterCreate(a) | Request::ClusterAdd(a), _) => {
                f.insert("members".into(), json!(a.members));
                self.record(req.op(), Some(("cluster", &a.id)), f);
            }
            (Request::ClusterDelete(id), _) => self.record("cluster_delete", Some(("cluster", id)), f),
            // The program, how it ended and its time: never its arguments,
            // environment or input, which may hold a user's secrets.
            (Request::Exec(a), Reply::Executed(x)) => {
                let program: String = a.command.first().map_or("", String::as_str).chars().take(256).collect();
                f.insert("program".into(), json!(program));
                f.insert("status".into(), json!(x.status));
                if x.timed_out {
                    f.insert("timed_out".into(), json!(true));
                }
                f.insert("ms".into(), json!(x.exec_ms));
                vm_event("exec", &a.id, f);
            }
            _ => {}
        }
    }

    /// A VM stopped (the reason says why).
    pub fn stopped(&self, vm: &str, reason: &impl std::fmt::Display) {
        let mut f = Map::new();
        f.insert("reason".into(), json!(reason.to_string()));
        self.record("stopped", Some(("vm", vm)), f);
    }
}

/// Whether a logged event concerns VM (or cluster) `id`: its subject, one
/// of its fork children, or one of a cluster's members.
pub fn concerns(event: &Value, id: &str) -> bool {
    let named = |k: &str| event.get(k).and_then(Value::as_str) == Some(id);
    let listed = |k: &str| {
        event
            .get(k)
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|v| v.as_str() == Some(id)))
    };
    named("vm") || named("cluster") || listed("children") || listed("members") || listed("clusters")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("k7d-events-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn events_are_json_lines_and_the_log_rotates_at_its_bound() {
        let d = scratch("rotate");
        let log = EventLog::with_max(&d, 1024);
        for i in 0..40 {
            let mut f = Map::new();
            f.insert("i".into(), json!(i));
            log.record("start", Some(("vm", "a")), f);
        }
        let now = std::fs::read_to_string(d.join(FILE)).unwrap();
        let before = std::fs::read_to_string(rotated(&d.join(FILE))).unwrap();
        assert!(
            now.len() as u64 <= 1024 && before.len() as u64 <= 1024,
            "{} {}",
            now.len(),
            before.len()
        );
        // The newest event is the last line, every line is one event.
        let last: Value = serde_json::from_str(now.lines().last().unwrap()).unwrap();
        assert_eq!(last["i"], 39);
        assert_eq!(last["event"], "start");
        assert_eq!(last["vm"], "a");
        for l in now.lines().chain(before.lines()) {
            let v: Value = serde_json::from_str(l).unwrap();
            assert!(v["ts"].as_f64().unwrap() > 1.7e9 && v["daemon_pid"].is_u64(), "{l}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_link_in_place_of_the_log_is_not_followed() {
        let d = scratch("link");
        let target = d.join("elsewhere");
        std::os::unix::fs::symlink(&target, d.join(FILE)).unwrap();
        EventLog::new(&d).record("create", Some(("vm", "a")), Map::new());
        assert!(!target.exists(), "the event log followed a symlink");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_event_concerns_its_subject_children_and_members() {
        let e = json!({"event": "fork", "vm": "a", "children": ["a-f1", "a-f2"]});
        assert!(concerns(&e, "a") && concerns(&e, "a-f2") && !concerns(&e, "a-f"));
        let c = json!({"event": "cluster_create", "cluster": "cl", "members": ["x", "y"]});
        assert!(concerns(&c, "cl") && concerns(&c, "y") && !concerns(&c, "z"));
    }
}

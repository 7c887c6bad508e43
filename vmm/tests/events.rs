//! The event log (issue 39, item 3): a forked VM's history, read with
//! `k7d events` after its daemon was killed and a new one re-attached to
//! it; a VM process's crash logged with why; a guest's own stop in a VM
//! process logged and recorded, its process gone; `--follow` prints events
//! as they are written; refusals in one sentence.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{K7D, Scratch, root_or_skip, text};

/// Kills this test's VM processes and daemons when dropped (a failed
/// assertion leaves nothing running).
struct Reaper(std::path::PathBuf, Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.1 {
            let _ = c.kill();
            let _ = c.wait();
        }
        common::kill_vm_processes_under(&self.0);
    }
}

fn daemon(dir: &Path) -> Child {
    common::start_daemon(
        Path::new(K7D),
        dir,
        &["--jail", "on", "--jail-cgroup", "off", "--jail-id-base", "2000000700"],
        true,
    )
}

fn cli(dir: &Path, args: &[&str]) -> Output {
    let o = Command::new(K7D)
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "k7d {args:?}: {:?}", text(&o));
    o
}

/// `k7d --json events --state-dir <dir>/state [--vm vm]`, parsed.
fn events(dir: &Path, vm: Option<&str>) -> Vec<serde_json::Value> {
    let mut args = vec!["--json".to_string(), "events".into(), "--state-dir".into()];
    args.push(dir.join("state").display().to_string());
    if let Some(v) = vm {
        args.extend(["--vm".into(), v.into()]);
    }
    let o = Command::new(K7D).args(&args).output().unwrap();
    assert!(o.status.success(), "k7d events: {:?}", text(&o));
    String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

fn names(ev: &[serde_json::Value]) -> Vec<String> {
    ev.iter().map(|e| e["event"].as_str().unwrap().to_string()).collect()
}

#[test]
fn a_forked_vms_history_survives_its_daemons_death_and_a_crash_is_logged_with_why() {
    if !root_or_skip("a_forked_vms_history_survives_its_daemons_death_and_a_crash_is_logged_with_why") {
        return;
    }
    let dir = Scratch::new("events");
    let d = &dir.0;
    let mut reaper = Reaper(d.clone(), Vec::new());
    reaper.1.push(daemon(d));
    cli(
        d,
        &["create", "--id", "a", "--builtin", "idle", "--memory", "16", "--start"],
    );
    cli(d, &["fork", "a", "--count", "2"]);
    cli(d, &["pause", "a-f1"]);
    // The daemon dies; its VM processes do not. A new one takes them over.
    let mut old = reaper.1.pop().unwrap();
    old.kill().unwrap();
    old.wait().unwrap();
    reaper.1.push(daemon(d));
    cli(d, &["resume", "a-f1"]);
    cli(d, &["delete", "a-f1"]);

    let f1 = events(d, Some("a-f1"));
    assert_eq!(
        names(&f1),
        ["fork", "pause", "reattach", "resume", "delete"],
        "a-f1's history: {f1:?}"
    );
    let fork = &f1[0];
    assert_eq!(fork["vm"], "a");
    assert_eq!(fork["children"], serde_json::json!(["a-f1", "a-f2"]));
    assert!(fork["source_paused_ms"].as_f64().unwrap() > 0.0, "{fork}");
    // Two daemons wrote it: the re-attach and what follows are the new one's.
    assert_ne!(f1[1]["daemon_pid"], f1[2]["daemon_pid"]);
    assert_eq!(f1[2]["daemon_pid"], f1[4]["daemon_pid"]);
    let ts: Vec<f64> = f1.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "not in order: {ts:?}");
    // The whole log has a's own creation first.
    let all = events(d, None);
    assert_eq!(all[0]["event"], "create");
    assert_eq!(all[0]["vm"], "a");

    // A VM process killed under the daemon: logged as stopped, with why,
    // when it happens (nobody asks for a-f2 in between).
    let pid =
        serde_json::from_slice::<serde_json::Value>(&cli(d, &["--json", "info", "a-f2"]).stdout).unwrap()["vm_process"]
            ["pid"]
            .as_u64()
            .unwrap() as i32;
    // SAFETY: kill takes integers; the VM process of this test's a-f2.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t = Instant::now();
    loop {
        let f2 = events(d, Some("a-f2"));
        if let Some(stop) = f2.iter().find(|e| e["event"] == "stopped") {
            let why = stop["reason"].as_str().unwrap();
            // (An earlier daemon started it: this one cannot learn how it
            // ended, only that it did.)
            assert!(
                why.contains(&format!("vm a-f2: VM process {pid} ")),
                "a-f2's stop: {why}"
            );
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no stop of a-f2 logged: {f2:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Humans get one line per event, with the time and the subject.
    let o = Command::new(K7D)
        .args(["events", "--vm", "a-f1", "--state-dir"])
        .arg(d.join("state"))
        .output()
        .unwrap();
    let (out, _) = text(&o);
    let first = out.lines().next().unwrap_or_default();
    assert!(
        first.contains("  fork  vm=a  ") && first.starts_with("20"),
        "first line: {first:?}"
    );
    cli(d, &["delete", "a-f2"]);
    cli(d, &["delete", "a"]);
}

#[test]
fn a_guest_that_stops_itself_in_a_vm_process_is_logged_and_recorded_and_its_process_ends() {
    let name = "a_guest_that_stops_itself_in_a_vm_process_is_logged_and_recorded_and_its_process_ends";
    if !root_or_skip(name) {
        return;
    }
    let dir = Scratch::new("events-selfstop");
    let d = &dir.0;
    let mut reaper = Reaper(d.clone(), Vec::new());
    reaper.1.push(daemon(d));
    // `hello` prints its text and resets the machine at once.
    // The create's own answer may come after the stop: it says why too,
    // not that the process went silent.
    let o = cli(
        d,
        &[
            "--json",
            "create",
            "--id",
            "h",
            "--builtin",
            "hello",
            "--memory",
            "8",
            "--start",
        ],
    );
    let created: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let status = created["status"].as_str().unwrap_or_default();
    assert!(status == "running" || status == "stopped (guest reboot)", "{created}");
    let t = Instant::now();
    let stop = loop {
        let h = events(d, Some("h"));
        if let Some(stop) = h.iter().find(|e| e["event"] == "stopped") {
            break stop.clone();
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no stop of h logged: {h:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(stop["reason"], "guest reboot", "{stop}");
    let info =
        |d: &Path| serde_json::from_slice::<serde_json::Value>(&cli(d, &["--json", "info", "h"]).stdout).unwrap();
    let i = info(d);
    assert_eq!(i["status"], "stopped (guest reboot)", "{i}");
    // Its VM process went with its guest (its RAM and KVM state freed).
    let pid = i["vm_process"]["pid"].as_u64().unwrap();
    let t = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "VM process {pid} outlived its guest"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Its record on disk says so too (what a re-attach reads).
    let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(d.join("state/vms/h.json")).unwrap()).unwrap();
    assert_eq!(rec["state"], "stopped", "{rec}");
    assert_eq!(rec["reason"]["kind"], "guest_reset", "{rec}");
    let stops = events(d, Some("h")).iter().filter(|e| e["event"] == "stopped").count();
    assert_eq!(stops, 1, "h's stop was logged {stops} times");
    cli(d, &["delete", "h"]);
    let left: Vec<_> = std::fs::read_dir(d.join("state/vms")).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn follow_prints_events_as_they_are_written() {
    if !root_or_skip("follow_prints_events_as_they_are_written") {
        return;
    }
    let dir = Scratch::new("events-follow");
    let d = &dir.0;
    let mut reaper = Reaper(d.clone(), Vec::new());
    reaper.1.push(daemon(d));
    let mut follow = Command::new(K7D)
        .args(["--json", "events", "--follow", "--state-dir"])
        .arg(d.join("state"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = follow.stdout.take().unwrap();
    reaper.1.push(follow);
    cli(
        d,
        &["create", "--id", "b", "--builtin", "idle", "--memory", "16", "--start"],
    );
    cli(d, &["delete", "b"]);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    let t = Instant::now();
    while seen.len() < 2 && t.elapsed() < Duration::from_secs(10) {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            let v: serde_json::Value = serde_json::from_str(&l).unwrap();
            if v["vm"] == "b" && (v["event"] == "create" || v["event"] == "delete") {
                seen.push(v["event"].as_str().unwrap().to_string());
            }
        }
    }
    assert_eq!(seen, ["create", "delete"], "k7d events --follow printed {seen:?}");
}

#[test]
fn events_refuses_a_state_dir_without_a_log_and_a_bad_id_in_one_sentence() {
    let dir = Scratch::new("events-none");
    let o = Command::new(K7D)
        .args(["events", "--state-dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("no event log at"), "{err}");
    std::fs::write(dir.0.join("events.jsonl"), b"").unwrap();
    let o = Command::new(K7D)
        .args(["events", "--vm", "../x", "--state-dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("--vm \"../x\""), "{err}");
}

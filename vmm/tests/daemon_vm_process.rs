//! `k7d daemon --jail on` (issue 36): every VM the daemon creates runs in
//! a jailed VM process of its own, which outlives the daemon. Three VMs:
//! three VM processes, each its own uid and jail, holding only its own
//! guest RAM; `kill -9` of one stops only that VM, and the daemon records
//! why in one sentence; `kill -9` of the daemon leaves the guests running
//! (read straight from their RAM while no daemon exists), and the next
//! daemon re-attaches to each and serves it; so does a daemon that exits
//! on SIGTERM; delete leaves nothing behind.

use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{K7D, Scratch, root_or_skip, text};

/// The memwriter's loop counter.
const COUNTER: u64 = k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER;

fn start_daemon(dir: &Path) -> Child {
    start_jailed_daemon(dir, "2000000200", &[])
}

/// A daemon with VM processes (the default: no `--jail`), no cgroup, ids
/// from `id_base`, and `extra`.
fn start_jailed_daemon(dir: &Path, id_base: &str, extra: &[&str]) -> Child {
    let mut args = vec!["--jail-cgroup", "off", "--jail-id-base", id_base];
    args.extend_from_slice(extra);
    common::start_daemon(Path::new(K7D), dir, &args, false)
}

fn cli(dir: &Path, args: &[&str]) -> Output {
    Command::new(K7D)
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(args)
        .output()
        .unwrap()
}

/// One request line on the API socket, its response.
fn api(dir: &Path, line: &str) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(dir.join("k7d.sock")).unwrap();
    writeln!(s, "{line}").unwrap();
    let mut back = String::new();
    std::io::BufReader::new(s).read_line(&mut back).unwrap();
    serde_json::from_str(&back).unwrap()
}

fn info(dir: &Path, id: &str) -> serde_json::Value {
    let o = cli(dir, &["--json", "info", id]);
    assert!(o.status.success(), "info {id}: {:?}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn pid_of(dir: &Path, id: &str) -> u32 {
    info(dir, id)["vm_process"]["pid"].as_u64().unwrap() as u32
}

fn counter(dir: &Path, id: &str) -> u32 {
    let o = cli(dir, &["--json", "peek", id, &format!("{COUNTER:#x}")]);
    assert!(o.status.success(), "peek {id}: {:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["words"][0].as_u64().unwrap() as u32
}

/// Whether `read` grows within 5 s.
fn grows(mut read: impl FnMut() -> u32) -> bool {
    let c = read();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if read() > c {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Asserts that no VM's record or runtime file is left under `dir`'s state.
fn assert_no_vm_files(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir.join("state/vms"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Whether process `pid` exists and is not a zombie (one an earlier
/// daemon started is reaped by whoever inherited it).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, r)| r.trim_start().starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

fn kill9(pid: u32) {
    // SAFETY: kill takes integers; the pid is a process this test started
    // (the daemon) or one the daemon started for it.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

/// Stops whatever a failed test left: the daemon, then every VM process
/// under the test's directory.
struct Cleanup<'a> {
    dir: &'a Path,
    daemon: Option<Child>,
    pids: Vec<u32>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        common::kill_vm_processes_under(self.dir);
    }
}

#[test]
fn vms_run_in_jailed_processes_that_outlive_the_daemon() {
    if !root_or_skip("vms_run_in_jailed_processes_that_outlive_the_daemon") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc");
    let dir = scratch.0.as_path();
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let daemon_pid = guard.daemon.as_ref().unwrap().id();
    // c's guest is a raw image file: the daemon opens it and hands it over,
    // as it does every VM's serial log and own log (the VM process has no
    // filesystem to open them in).
    let image = dir.join("memwriter.bin");
    std::fs::write(&image, k7d_guest::Builtin::MemWriter.image()).unwrap();
    let ids = ["a", "b", "c"];
    for id in ids {
        let guest = match id {
            "c" => [
                "--raw",
                image.to_str().unwrap(),
                "--arg",
                "64",
                "--arg",
                "2097152",
                "--arg",
                "1",
            ]
            .to_vec(),
            _ => ["--builtin", "memwriter"].to_vec(),
        };
        let mut args = vec!["create", "--id", id, "--memory", "16", "--start"];
        args.extend(guest);
        let o = cli(dir, &args);
        assert!(o.status.success(), "create {id}: {:?}", text(&o));
        guard.pids.push(pid_of(dir, id));
        assert!(grows(|| counter(dir, id)), "vm {id} does not run");
    }
    // Each VM in a process of its own: jailed, its own uid, holding its own
    // guest RAM and files and no other VM's. The daemon holds none of it.
    let mut uids = std::collections::HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        let pid = guard.pids[i];
        assert_ne!(pid, daemon_pid);
        let own = dir.join("state/vms").join(id);
        let uid = common::assert_jailed_vm_process_with(pid, &format!("vm {id}"), Some(&own));
        let serial = own.join("serial.log");
        assert_eq!(
            info(dir, id)["serial_log"].as_str(),
            serial.to_str(),
            "vm {id}'s serial log"
        );
        let held: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .collect();
        assert!(held.contains(&serial), "vm {id} does not hold its serial log: {held:?}");
        assert!(!uids.values().any(|&u| u == uid), "vm {id} shares uid {uid}");
        uids.insert(*id, uid);
        for other in ids {
            assert_eq!(
                common::holds_ram_of(pid, other),
                *id == other,
                "vm {id}'s process and vm {other}'s RAM"
            );
        }
        assert!(!common::holds_ram_of(daemon_pid, id), "the daemon maps vm {id}'s RAM");
    }
    // What a guest prints reaches the serial log the daemon opened for it.
    let hello = dir.join("hello.bin");
    std::fs::write(&hello, k7d_guest::Builtin::Hello.image()).unwrap();
    let o = cli(
        dir,
        &[
            "create",
            "--id",
            "h",
            "--raw",
            hello.to_str().unwrap(),
            "--memory",
            "16",
            "--start",
        ],
    );
    assert!(o.status.success(), "create h: {:?}", text(&o));
    let log = dir.join("state/vms/h/serial.log");
    let t = Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains(k7d_guest::HELLO_TEXT)
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "vm h's serial log: {:?}",
            std::fs::read_to_string(&log)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(cli(dir, &["delete", "h"]).status.success());
    let o = cli(dir, &["version"]);
    assert!(
        text(&o).0.contains("VM processes ready ahead (--jail on): "),
        "{:?}",
        text(&o)
    );
    let o = cli(dir, &["info", "a"]);
    assert!(
        text(&o).0.contains(&format!("vm process: pid {}", guard.pids[0])),
        "{:?}",
        text(&o)
    );
    // The spawner (the daemon's child that execs VM processes) keeps only
    // what the jail needs, in its own sets and its bounding set.
    let spawner = std::fs::read_to_string(format!("/proc/{daemon_pid}/task/{daemon_pid}/children"))
        .unwrap()
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("vm-spawner"))
        })
        .expect("the daemon has a spawner child");
    let status = std::fs::read_to_string(format!("/proc/{spawner}/status")).unwrap();
    let want = format!("{:016x}", k7d_vmm::vmproc::spawner::jail_caps_mask());
    for set in ["CapEff:", "CapPrm:", "CapBnd:"] {
        let have = status.lines().find_map(|l| l.strip_prefix(set)).unwrap().trim();
        assert_eq!(have, want, "the spawner's {set}");
    }
    // A snapshot of a VM process: written by the daemon from what the
    // process hands over (restores_by_a_jailed_daemon_... restores them).
    let o = cli(dir, &["snapshot", "a", &dir.join("snap").to_string_lossy()]);
    assert!(o.status.success(), "{:?}", text(&o));
    for f in ["manifest.json", "state.json", "memory"] {
        assert!(dir.join("snap").join(f).is_file(), "the snapshot has no {f}");
    }

    // kill -9 of one VM process stops only that VM, and says why.
    kill9(guard.pids[1]);
    let want = format!("stopped (vm b: VM process {} was killed by signal 9)", guard.pids[1]);
    let t = Instant::now();
    while info(dir, "b")["status"] != want.as_str() {
        assert!(t.elapsed() < Duration::from_secs(5), "{}", info(dir, "b"));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(grows(|| counter(dir, "a")) && grows(|| counter(dir, "c")));

    // kill -9 of the daemon: the guests run on without it.
    let mut d = guard.daemon.take().unwrap();
    kill9(d.id());
    let _ = d.wait();
    for (i, id) in [(0, "a"), (2, "c")] {
        let pid = guard.pids[i];
        assert!(
            grows(|| common::read_guest_u32(pid, id, COUNTER)),
            "vm {id} stopped with its daemon"
        );
    }
    let before: Vec<u32> = [(0, "a"), (2, "c")]
        .iter()
        .map(|&(i, id)| common::read_guest_u32(guard.pids[i], id, COUNTER))
        .collect();

    // The next daemon re-attaches to both and serves them; b's record, whose
    // process is gone, is reconciled away.
    guard.daemon = Some(start_daemon(dir));
    for ((i, id), b) in [(0, "a"), (2, "c")].into_iter().zip(before) {
        let v = info(dir, id);
        assert_eq!(v["status"], "running", "{v}");
        assert_eq!(v["vm_process"]["pid"].as_u64(), Some(u64::from(guard.pids[i])));
        assert!(counter(dir, id) > b, "vm {id}'s counter went back");
        assert!(grows(|| counter(dir, id)));
        let o = cli(dir, &["pause", id]);
        assert!(o.status.success(), "{:?}", text(&o));
        let c = counter(dir, id);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(counter(dir, id), c, "a paused VM ran");
        assert!(cli(dir, &["resume", id]).status.success());
    }
    assert_eq!(
        cli(dir, &["info", "b"]).status.code(),
        Some(1),
        "b's record outlived its process"
    );

    // A daemon that exits as asked (SIGTERM, an upgrade's first step)
    // leaves them running too, for the next.
    let mut d = guard.daemon.take().unwrap();
    // SAFETY: kill takes integers; the daemon is this test's child.
    assert_eq!(unsafe { libc::kill(d.id() as i32, libc::SIGTERM) }, 0);
    assert!(d.wait().unwrap().success());
    // And cleanly: no thread of its shutdown ran into its seccomp filter
    // (the spawner's reaping once made `wait4`, which it denies).
    let mut log = String::new();
    std::io::Read::read_to_string(&mut d.stderr.take().unwrap(), &mut log).unwrap();
    assert!(!log.contains("ERROR"), "the daemon's shutdown logged an error: {log}");
    for (i, id) in [(0, "a"), (2, "c")] {
        let pid = guard.pids[i];
        assert!(
            grows(|| common::read_guest_u32(pid, id, COUNTER)),
            "vm {id} stopped with a daemon that exited"
        );
    }
    guard.daemon = Some(start_daemon(dir));
    for id in ["a", "c"] {
        assert_eq!(info(dir, id)["status"], "running");
    }

    // A new VM takes a uid none of the re-attached ones holds (b's is free).
    let o = cli(
        dir,
        &[
            "create",
            "--id",
            "d",
            "--builtin",
            "memwriter",
            "--memory",
            "16",
            "--start",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let pd = pid_of(dir, "d");
    guard.pids.push(pd);
    let ud = common::assert_jailed_vm_process_with(pd, "vm d", Some(&dir.join("state/vms/d")));
    assert!(
        ud != uids["a"] && ud != uids["c"],
        "vm d shares a re-attached VM's uid {ud}"
    );

    // Delete leaves no process and no file.
    for id in ["a", "c", "d"] {
        let o = cli(dir, &["delete", id]);
        assert!(o.status.success(), "{:?}", text(&o));
    }
    for &p in &guard.pids {
        assert!(!alive(p), "VM process {p} outlived its delete");
    }
    assert_no_vm_files(dir);
}

/// Where `create_page_writer`'s guest writes, and how many pages.
const AREA: u64 = 0x20_0000;
const PAGES: u64 = 64;

/// Creates and starts `id`: a 16 MiB memwriter whose rounds each write its
/// counter into one of [`PAGES`] pages at [`AREA`] (ARG2 = 1).
fn create_page_writer(dir: &Path, id: &str) {
    create_page_writer_with(dir, id, &[]);
}

/// [`create_page_writer`] with `extra` arguments to `create`.
fn create_page_writer_with(dir: &Path, id: &str, extra: &[&str]) {
    let (area, pages) = (AREA.to_string(), PAGES.to_string());
    let mut args = vec![
        "create",
        "--id",
        id,
        "--builtin",
        "memwriter",
        "--memory",
        "16",
        "--arg",
        &pages,
        "--arg",
        &area,
        "--arg",
        "1",
        "--start",
    ];
    args.extend_from_slice(extra);
    let o = cli(dir, &args);
    assert!(o.status.success(), "create {id}: {:?}", text(&o));
}

/// Makes memwriter VM `vm` (process `pid`) only count from here: clears
/// ARG2, then waits until a round has begun since, so no round that read
/// ARG2 before the write can still write a page after a pause (the
/// pause could land between a round's check and its store, and the
/// children would finish that store).
fn stop_writing(pid: u32, vm: &str) {
    let arg2 = k7d_guest::PARAMS_ADDR + k7d_guest::param::ARG2;
    common::write_guest_u32(pid, vm, arg2, 0);
    let after = common::read_guest_u32(pid, vm, COUNTER);
    let t = Instant::now();
    while common::read_guest_u32(pid, vm, COUNTER) == after {
        assert!(t.elapsed() < Duration::from_secs(5), "{vm} stopped counting");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Forks `vm` once and checks the fork warns that its children share its
/// kernel RNG state (a built-in guest has no VM Generation ID).
fn fork_with_rng_warning(dir: &Path, vm: &str) {
    let o = cli(dir, &["--json", "fork", vm]);
    assert!(o.status.success(), "{:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = format!("vm {vm}'s fork children share its kernel RNG state");
    assert!(v["warnings"][0].as_str().is_some_and(|w| w.contains(&want)), "{v}");
}

/// Reads `pages` pages of VM `vm`'s guest RAM from `gpa` in process `pid`.
fn read_pages(pid: u32, vm: &str, gpa: u64, pages: u64) -> Vec<u32> {
    common::read_guest(pid, vm, gpa, (pages * 4096) as usize)
        .chunks(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A fork of a VM in a VM process (issue 36, item 3): the source exports
/// its fork instant (base memfd, the pages diverged since its first fork,
/// machine state) and each child is built in a jailed VM process of its
/// own from it. The children's RAM equals the source's at the fork
/// instant, pages written since the first fork included; a new daemon
/// re-attaches to the source and its children after a `kill -9`, the
/// snapshot tree included.
#[test]
fn forks_of_a_vm_process_are_vm_processes_equal_to_their_source() {
    if !root_or_skip("forks_of_a_vm_process_are_vm_processes_equal_to_their_source") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-fork");
    let dir = scratch.0.as_path();
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    // memwriter with ARG2 = 1: each round writes its counter into a page.
    create_page_writer(dir, "src");
    let src = pid_of(dir, "src");
    guard.pids.push(src);
    assert!(grows(|| counter(dir, "src")));
    // The first fork freezes the base; the source then writes on. It
    // warns, once, that the children share the guest's RNG state (a
    // built-in guest has no VM Generation ID), as a fork inside the
    // daemon does.
    assert_eq!(info(dir, "src")["rng_reseed"], "off");
    fork_with_rng_warning(dir, "src");
    guard.pids.push(pid_of(dir, "src-f1"));
    assert!(cli(dir, &["delete", "src-f1"]).status.success());
    std::thread::sleep(Duration::from_millis(100));
    // From here the source (and so its children) only counts: its pages
    // stay as the rounds since the freeze left them.
    stop_writing(src, "src");
    assert!(cli(dir, &["pause", "src"]).status.success());
    let at_fork = read_pages(src, "src", AREA, PAGES);
    let count_at_fork = counter(dir, "src");
    assert!(
        at_fork.chunks(1024).any(|p| p[0] != p[1]),
        "no page was written since the first fork: the test would not see a lost page"
    );
    // Both children from spares, made ahead (`--jail-spares`, default 2).
    let t = Instant::now();
    loop {
        let v = api(dir, r#"{"v":1,"op":"version"}"#);
        if v["result"]["vm_process_spares"].as_u64() >= Some(2) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no spares made: {v}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = cli(dir, &["--json", "fork", "src", "--count", "2"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut spare_dirs = Vec::new();
    for c in ["src-f1", "src-f2"] {
        let rec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("state/vms/{c}.json"))).unwrap()).unwrap();
        let d = rec["vm_process"]["spare_dir"].as_str().map(std::path::PathBuf::from);
        let d = d.unwrap_or_else(|| panic!("{c} was not built in a spare: {rec}"));
        assert!(d.starts_with(dir.join("state/spares")), "{}", d.display());
        spare_dirs.push(d);
    }
    let mut uids = std::collections::HashSet::new();
    for c in ["src-f1", "src-f2"] {
        let pid = pid_of(dir, c);
        guard.pids.push(pid);
        assert_ne!(pid, src);
        assert!(
            uids.insert(common::assert_jailed_vm_process_with(
                pid,
                c,
                Some(&dir.join("state/vms").join(c))
            )),
            "{c} shares a uid"
        );
        assert_eq!(info(dir, c)["parent"], "src");
        assert!(grows(|| counter(dir, c)), "{c} does not run");
        assert!(counter(dir, c) > count_at_fork, "{c} did not continue from the source");
        // It holds its source's base read-only: it cannot write the
        // memory its source and siblings still share.
        let base = access_of(pid, |t| t.to_string_lossy().starts_with("/memfd:k7d-ram-src "));
        assert!(!base.is_empty(), "{c} holds no descriptor of its source's base");
        assert!(
            base.iter().all(|a| *a == "r"),
            "{c} holds its source's base writable: {base:?}"
        );
        // Its RAM is the source's base (the memfd named after the source)
        // mapped copy-on-write, with the pages diverged since copied in.
        assert!(
            read_pages(pid, "src", AREA, PAGES) == at_fork,
            "{c}'s RAM differs from its source's at the fork instant"
        );
    }
    // The source still holds its base writable (it made it), but the
    // daemon sealed it at the fork: nobody, the source included, can
    // write, shrink or grow what its children map.
    assert_base_sealed(src, "src");
    assert_eq!(v["children"].as_array().map(Vec::len), Some(2), "{v}");
    assert!(
        v.get("warnings").is_none_or(|w| w == &serde_json::json!([])),
        "warned twice: {v}"
    );
    // A new daemon re-attaches to the source and both children, the
    // snapshot tree included.
    let mut d = guard.daemon.take().unwrap();
    kill9(d.id());
    let _ = d.wait();
    guard.daemon = Some(start_daemon(dir));
    for c in ["src-f1", "src-f2"] {
        let i = info(dir, c);
        assert_eq!(i["status"], "running", "{i}");
        assert_eq!(i["parent"], "src", "{i}");
        assert!(grows(|| counter(dir, c)));
    }
    assert_eq!(info(dir, "src")["children"], serde_json::json!(["src-f1", "src-f2"]));
    // The source stayed paused (it was), and resumes on its own.
    assert_eq!(info(dir, "src")["status"], "paused");
    assert!(cli(dir, &["resume", "src"]).status.success());
    assert!(grows(|| counter(dir, "src")));
    // `k7d rebase` in its VM process: a new base holding its RAM as it is,
    // built while it runs (it runs on); its next child is its RAM at that
    // fork. A VM never forked has no base to re-base (one sentence), and
    // a threshold no thread would watch in a VM process is refused.
    let o = cli(dir, &["--json", "rebase", "src"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["id"], "src", "{r}");
    assert!(
        r["diverged_mib"].as_f64().is_some_and(|m| m > 0.0),
        "nothing diverged: {r}"
    );
    let i = info(dir, "src");
    assert_eq!((&i["status"], &i["rebases"]), (&"running".into(), &1.into()), "{i}");
    assert!(grows(|| counter(dir, "src")), "src stopped at its re-base");
    assert!(cli(dir, &["pause", "src"]).status.success());
    let at_fork = read_pages(src, "src", AREA, PAGES);
    let count_at_fork = counter(dir, "src");
    let line = serde_json::json!({"v": 1, "op": "fork", "args": {"id": "src", "count": 1, "name": "after-rebase"}});
    let v = api(dir, &line.to_string());
    assert_eq!(v["ok"], true, "{v}");
    let pid = pid_of(dir, "after-rebase");
    guard.pids.push(pid);
    assert!(
        read_pages(pid, "src", AREA, PAGES) == at_fork,
        "the re-based source's child differs from it at the fork instant"
    );
    assert!(grows(|| counter(dir, "after-rebase")));
    assert!(counter(dir, "after-rebase") > count_at_fork);
    let o = cli(
        dir,
        &["create", "--id", "fresh", "--builtin", "memwriter", "--memory", "16"],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    guard.pids.push(pid_of(dir, "fresh"));
    let o = cli(dir, &["rebase", "fresh"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("fresh") && err.lines().count() == 1, "{err}");
    // A threshold is watched by the daemon's `k7d-rebase` thread in VM
    // processes too: forked once, a VM that writes 64 of its 4,096 pages
    // (1.6 %) passes 1 % and is re-based in its process without a request.
    create_page_writer_with(dir, "watched", &["--rebase-at", "1"]);
    guard.pids.push(pid_of(dir, "watched"));
    assert!(info(dir, "watched").get("rebases").is_none(), "re-based before a fork");
    assert!(cli(dir, &["fork", "watched"]).status.success());
    guard.pids.push(pid_of(dir, "watched-f1"));
    let t = Instant::now();
    while info(dir, "watched")["rebases"].as_u64().unwrap_or(0) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a VM process past its threshold was not re-based: {}",
            info(dir, "watched")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(grows(|| counter(dir, "watched")), "watched stopped at its re-base");
    for id in [
        "watched-f1",
        "watched",
        "fresh",
        "after-rebase",
        "src-f1",
        "src-f2",
        "src",
    ] {
        assert!(cli(dir, &["delete", id]).status.success());
    }
    for &p in &guard.pids {
        assert!(!alive(p), "VM process {p} outlived its delete");
    }
    for d in spare_dirs {
        assert!(!d.exists(), "{} outlived its VM", d.display());
    }
}

/// The members of cluster `id` (`cluster info`), by id and status.
fn cluster_members(dir: &Path, id: &str) -> Vec<(String, String)> {
    let o = cli(dir, &["--json", "cluster", "info", id]);
    assert!(o.status.success(), "cluster info {id}: {:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().into(), m["status"].as_str().unwrap().into()))
        .collect()
}

/// A cluster of VMs in VM processes (issue 36, items 3 and 4): its fork
/// pauses every member, exports each one's fork instant and resumes them,
/// then builds each child in a jailed VM process of its own, equal to its
/// member at that instant; each fork's children form a cluster. After
/// `kill -9` of the daemon the next one re-attaches every VM and keeps
/// every cluster, without a member whose process died meanwhile; cluster
/// delete ends its members' processes.
#[test]
fn clusters_of_vm_processes_fork_together_and_outlive_the_daemon() {
    if !root_or_skip("clusters_of_vm_processes_fork_together_and_outlive_the_daemon") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-cluster");
    let dir = scratch.0.as_path();
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let members = ["m1", "m2"];
    for m in members {
        create_page_writer(dir, m);
        guard.pids.push(pid_of(dir, m));
        assert!(grows(|| counter(dir, m)), "{m} does not run");
    }
    let o = cli(dir, &["cluster", "create", "cl", "m1", "m2"]);
    assert!(o.status.success(), "{:?}", text(&o));
    // From here the members (and so their children) only count, and
    // paused they keep their pages still: what each child must hold.
    let mut at_fork = std::collections::HashMap::new();
    for (i, m) in members.iter().enumerate() {
        stop_writing(guard.pids[i], m);
        assert!(cli(dir, &["pause", m]).status.success());
        at_fork.insert(*m, read_pages(guard.pids[i], m, AREA, PAGES));
    }
    let o = cli(dir, &["--json", "fork", "cl", "--count", "2"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["clusters"], serde_json::json!(["cl-f1", "cl-f2"]), "{v}");
    assert_eq!(v["children"].as_array().map(Vec::len), Some(4), "{v}");
    let mut uids = std::collections::HashSet::new();
    let mut child_pid = std::collections::HashMap::new();
    for f in ["f1", "f2"] {
        let want: Vec<(String, String)> = members
            .iter()
            .map(|m| (format!("{m}-{f}"), "running".to_string()))
            .collect();
        assert_eq!(cluster_members(dir, &format!("cl-{f}")), want);
        for m in members {
            let c = format!("{m}-{f}");
            let pid = pid_of(dir, &c);
            guard.pids.push(pid);
            child_pid.insert(c.clone(), pid);
            let own = dir.join("state/vms").join(&c);
            assert!(
                uids.insert(common::assert_jailed_vm_process_with(pid, &c, Some(&own))),
                "{c} shares a uid"
            );
            assert_eq!(info(dir, &c)["parent"], m);
            // More children than the daemon keeps spares (2): the fork made
            // the rest ahead, before it paused anything, so every child
            // was built in a process already started and jailed.
            let rec: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.join(format!("state/vms/{c}.json"))).unwrap()).unwrap();
            assert!(
                rec["vm_process"]["spare_dir"].is_string(),
                "{c} was not built in a VM process made ahead: {rec}"
            );
            assert!(
                read_pages(pid, m, AREA, PAGES) == at_fork[m],
                "{c}'s RAM differs from {m}'s at the fork instant"
            );
            assert!(grows(|| counter(dir, &c)), "{c} does not run");
        }
    }
    // The members stay as they were (paused).
    for m in members {
        assert_eq!(info(dir, m)["status"], "paused");
    }

    // kill -9 of the daemon, and of one child's process while no daemon
    // exists: the next daemon keeps every cluster, without that child.
    let mut d = guard.daemon.take().unwrap();
    kill9(d.id());
    let _ = d.wait();
    kill9(child_pid["m2-f2"]);
    guard.daemon = Some(start_daemon(dir));
    let o = cli(dir, &["--json", "cluster", "list"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let listed: Vec<(String, Vec<String>)> = v["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap().into(),
                c["members"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m.as_str().unwrap().into())
                    .collect(),
            )
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    assert_eq!(
        listed,
        vec![
            ("cl".into(), s(&["m1", "m2"])),
            ("cl-f1".into(), s(&["m1-f1", "m2-f1"])),
            ("cl-f2".into(), s(&["m1-f2"])),
        ]
    );
    for c in ["m1-f1", "m2-f1", "m1-f2"] {
        assert_eq!(info(dir, c)["status"], "running");
        assert!(grows(|| counter(dir, c)), "{c} stopped across the daemon's restart");
    }
    // A daemon that exits as asked (SIGTERM) keeps them too.
    let mut d = guard.daemon.take().unwrap();
    // SAFETY: kill takes integers; the daemon is this test's child.
    assert_eq!(unsafe { libc::kill(d.id() as i32, libc::SIGTERM) }, 0);
    assert!(d.wait().unwrap().success());
    guard.daemon = Some(start_daemon(dir));
    assert_eq!(
        cluster_members(dir, "cl-f2"),
        vec![("m1-f2".to_string(), "running".to_string())]
    );
    // A re-attached cluster forks again.
    for m in members {
        assert!(cli(dir, &["resume", m]).status.success());
    }
    let o = cli(dir, &["--json", "fork", "cl-f1"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["clusters"], serde_json::json!(["cl-f1-f1"]), "{v}");
    for c in ["m1-f1-f1", "m2-f1-f1"] {
        guard.pids.push(pid_of(dir, c));
        assert!(grows(|| counter(dir, c)), "{c} does not run");
    }
    // Cluster delete ends its members' processes; nothing is left.
    for cl in ["cl-f1-f1", "cl-f1", "cl-f2", "cl"] {
        let o = cli(dir, &["cluster", "delete", cl]);
        assert!(o.status.success(), "cluster delete {cl}: {:?}", text(&o));
    }
    for &p in &guard.pids {
        assert!(!alive(p), "VM process {p} outlived its delete");
    }
    for sub in ["state/vms", "state/clusters"] {
        let left: Vec<_> = std::fs::read_dir(dir.join(sub))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "left behind in {sub}: {left:?}");
    }
}

/// Bad input to a VM process's build (issue 36): a "kernel" that is not
/// one, handed over by the daemon, is refused by the VM process with one
/// sentence naming the file, and nothing is left (no process, no record,
/// no file, the id free again); a NIC the daemon cannot make for it (a
/// pod netns that is not there, vhost-net asked for by name) is refused
/// before anything starts.
#[test]
fn a_vm_process_refuses_bad_guest_files_with_a_sentence_and_leaves_nothing() {
    if !root_or_skip("a_vm_process_refuses_bad_guest_files_with_a_sentence_and_leaves_nothing") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-bad");
    let dir = scratch.0.as_path();
    let _guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let kernel = dir.join("not-a-kernel");
    std::fs::write(&kernel, b"this is not a kernel image").unwrap();
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let k = kernel.to_str().unwrap();
    let o = cli(
        dir,
        &["create", "--id", "bad", "--kernel", k, "--disk", disk.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("vm bad: ") && err.contains(k), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // A pod network that is not there, and vhost-net asked for by name on
    // a host without it (the daemon opens /dev/vhost-net for a VM process,
    // which opens no path): refused by the daemon before anything starts,
    // one sentence each.
    let no_vhost = !Path::new("/dev/vhost-net").exists();
    for (nic, says) in [
        (
            "datapath=direct,netns=/run/netns/k7d-bad,pod-if=eth0",
            "/run/netns/k7d-bad",
        ),
        ("vhost=on", "/dev/vhost-net does not exist"),
    ] {
        if nic == "vhost=on" && !no_vhost {
            continue;
        }
        let o = cli(dir, &["create", "--id", "bad", "--kernel", k, "--nic", nic]);
        assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
        let err = text(&o).1;
        assert!(err.contains("vm bad: ") && err.contains(says), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // Nothing left: no VM, no record or runtime file, no VM process.
    assert!(text(&cli(dir, &["list"])).0.lines().all(|l| !l.starts_with("bad")));
    assert_no_vm_files(dir);
    let dir_s = dir.to_string_lossy().into_owned();
    let spares = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&format!("{dir_s}/state/vms")))
        })
        .count();
    assert_eq!(spares, 0, "a VM process of the refused VM is still running");
}

/// A VM process is untrusted (issue 36): one that stops answering (here
/// SIGSTOP, as a hijacked process that stalls would) holds its caller no
/// longer than `--vm-process-timeout` for the whole reply, is killed, and
/// its VM recorded stopped with why. A cluster fork through it fails
/// without a child left, the other member resumed and running, and
/// without using up the other member's RNG warning.
#[test]
fn a_vm_process_that_stalls_its_channel_is_killed_and_stalls_no_cluster_fork() {
    let name = "a_vm_process_that_stalls_its_channel_is_killed_and_stalls_no_cluster_fork";
    if !root_or_skip(name) {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-stall");
    let dir = scratch.0.as_path();
    let daemon = start_jailed_daemon(dir, "2000000300", &["--vm-process-timeout", "2"]);
    let mut guard = Cleanup {
        dir,
        daemon: Some(daemon),
        pids: Vec::new(),
    };
    for m in ["m1", "m2"] {
        create_page_writer(dir, m);
        guard.pids.push(pid_of(dir, m));
    }
    let o = cli(dir, &["cluster", "create", "cl", "m1", "m2"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let (p1, p2) = (guard.pids[0], guard.pids[1]);
    // SAFETY: kill takes integers; p2 is this test's VM process.
    assert_eq!(unsafe { libc::kill(p2 as i32, libc::SIGSTOP) }, 0);
    let t = Instant::now();
    let o = cli(dir, &["fork", "cl"]);
    let took = t.elapsed();
    assert!(!o.status.success(), "a fork through a stalled member succeeded");
    let err = text(&o).1;
    assert!(
        err.contains("vm m2") && err.contains("did not answer within 2.0 s"),
        "{err}"
    );
    // Bounded by the timeout (2 s), far from the 30 s default.
    assert!(took < Duration::from_secs(20), "the fork took {took:?}");
    let t = Instant::now();
    while alive(p2) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "m2's stalled process {p2} was not killed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = info(dir, "m2")["status"].as_str().unwrap_or_default().to_string();
    assert!(
        status.starts_with("stopped") && status.contains("was killed") && status.contains("did not answer"),
        "{status}"
    );
    // Nothing more waits on it: a later request is refused at once.
    let t = Instant::now();
    let o = cli(dir, &["pause", "m2"]);
    assert!(
        !o.status.success() && t.elapsed() < Duration::from_secs(2),
        "{:?}",
        text(&o)
    );
    // m1 was resumed and runs; no child, child cluster or child files.
    assert_eq!(info(dir, "m1")["status"], "running");
    assert!(
        grows(|| common::read_guest_u32(p1, "m1", COUNTER)),
        "m1 was left paused"
    );
    let o = cli(dir, &["--json", "list"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut ids: Vec<String> = v["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["m1", "m2"]);
    let mut dirs: Vec<String> = std::fs::read_dir(dir.join("state/vms"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(dirs, ["m1", "m2"]);
    assert_eq!(
        cluster_members(dir, "cl"),
        vec![
            ("m1".to_string(), "running".to_string()),
            ("m2".to_string(), status.clone())
        ]
    );
    let o = cli(dir, &["cluster", "info", "cl-f1"]);
    assert!(!o.status.success(), "a child cluster was left: {:?}", text(&o));
    // The failed fork did not use up m1's warning that its children share
    // its RNG state: the first fork that succeeds gives it.
    fork_with_rng_warning(dir, "m1");
    guard.pids.push(pid_of(dir, "m1-f1"));
}

/// The inode of the unix socket listening at `path` (`/proc/net/unix` of
/// this network namespace, where the daemon bound it; the connections
/// waiting in its backlog carry its path too, but not `__SO_ACCEPTCON`).
fn unix_socket_inode(path: &Path) -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() >= 8 && f[3] == "00010000" && Path::new(f[7]) == path).then(|| f[6].to_string())
    })
}

/// Whether process `pid` holds the socket with inode `inode`.
fn holds_socket(pid: u32, inode: &str) -> bool {
    holds_file(pid, Path::new(&format!("socket:[{inode}]")))
}

/// The cached Debian cloud kernel (virtio devices need a Linux guest), or
/// the test's skip said.
fn kernel_or_skip(name: &str) -> Option<std::path::PathBuf> {
    let k = common::cached_cloud_kernel();
    if k.is_none() {
        k7d_test_skip::skip(
            name,
            "no Debian cloud kernel in the lab cache (tests/lab/run.sh --fetch puts it there; .ci/run does)",
        );
    }
    k
}

/// vsock in a VM process (issue 36): the daemon binds the VM's host socket
/// at its configured path and hands it over bound, so the VM process (no
/// filesystem) serves it and the daemon keeps no copy. Another VM naming
/// the same path is refused with a sentence and takes nothing of the
/// first's (its socket is still there and served). The socket is served
/// while no daemon exists (a pod's agent is reached through it), and a
/// delete by the next daemon removes it. A medium change goes to the VM
/// process with its file opened by the daemon; bad ones (no such disk, no
/// such file, a VM not running) are one sentence each. (virtio needs a Linux guest: it
/// is created, not started, as it could not run on a PVM host; the lab's
/// `k7d-shim` reaches a running guest's agent this way.)
#[test]
fn a_vm_process_serves_vsock_on_the_socket_its_daemon_bound_even_with_no_daemon() {
    let name = "a_vm_process_serves_vsock_on_the_socket_its_daemon_bound_even_with_no_daemon";
    if !root_or_skip(name) {
        return;
    }
    let Some(kernel) = kernel_or_skip(name) else {
        return;
    };
    let scratch = Scratch::new("daemon-vmproc-vsock");
    let dir = scratch.0.as_path();
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let daemon_pid = guard.daemon.as_ref().unwrap().id();
    let uds = dir.join("v.sock");
    let vsock = format!("cid=3,uds={}", uds.display());
    let image = dir.join("image.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let disk = format!("{},ro", image.display());
    let create = |id: &str| {
        cli(
            dir,
            &[
                "create",
                "--id",
                id,
                "--kernel",
                kernel.to_str().unwrap(),
                "--memory",
                "128",
                "--vsock",
                &vsock,
                "--disk",
                &disk,
            ],
        )
    };
    let o = create("v");
    assert!(o.status.success(), "create v: {:?}", text(&o));
    let pid = pid_of(dir, "v");
    guard.pids.push(pid);
    let devices = info(dir, "v")["devices"].to_string();
    assert!(
        devices.contains("virtio-vsock") && devices.contains(&format!("hybrid host socket {}", uds.display())),
        "{devices}"
    );
    let inode = unix_socket_inode(&uds).expect("the vsock socket is bound");
    assert!(
        holds_socket(pid, &inode),
        "the VM process does not hold its vsock socket"
    );
    assert!(
        !holds_socket(daemon_pid, &inode),
        "the daemon kept a copy of the vsock socket"
    );
    std::os::unix::net::UnixStream::connect(&uds).expect("the vsock socket is served");
    // A medium change reaches the VM process with its file opened here;
    // bad ones are one sentence each and change nothing.
    let medium = |args: &[&str]| {
        let mut a = vec!["medium", "v"];
        a.extend(args);
        let o = cli(dir, &a);
        assert_eq!(o.status.code(), Some(1), "medium {args:?}: {:?}", text(&o));
        let err = text(&o).1;
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        err
    };
    let other = dir.join("other.img");
    std::fs::write(&other, vec![0u8; 1 << 20]).unwrap();
    let err = medium(&["3", other.to_str().unwrap()]);
    assert!(err.contains("vm v has 1 disks, so it has no disk 3"), "{err}");
    let missing = dir.join("missing.img");
    let err = medium(&["0", missing.to_str().unwrap()]);
    assert!(
        err.contains("vm v: disk 0's new medium") && err.contains("missing.img"),
        "{err}"
    );
    // The VM process's own answer: a created VM takes no medium yet.
    let err = medium(&["0", other.to_str().unwrap()]);
    assert!(err.contains("vm v: ") && err.contains("change a medium"), "{err}");
    let disks = info(dir, "v")["config"]["devices"]["disks"].to_string();
    assert!(disks.contains("image.img") && !disks.contains("other.img"), "{disks}");
    // The same path for another VM: refused, and the first keeps its socket.
    let o = create("w");
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("vm w: cannot bind vsock's host socket"), "{err}");
    assert_eq!(
        unix_socket_inode(&uds).as_deref(),
        Some(inode.as_str()),
        "the first VM's socket was touched"
    );
    assert!(!dir.join("state/vms/w").exists(), "the refused VM left its files");
    // No daemon: the socket is still served by the VM process.
    kill9(daemon_pid);
    let _ = guard.daemon.take().unwrap().wait();
    std::os::unix::net::UnixStream::connect(&uds).expect("the vsock socket is served with no daemon");
    assert!(alive(pid));
    guard.daemon = Some(start_daemon(dir));
    assert_eq!(pid_of(dir, "v"), pid, "the next daemon re-attached to another process");
    std::os::unix::net::UnixStream::connect(&uds).expect("the vsock socket is served after the restart");
    let o = cli(dir, &["delete", "v"]);
    assert!(o.status.success(), "delete v: {:?}", text(&o));
    assert!(!alive(pid), "VM process {pid} outlived its delete");
    assert!(!uds.exists(), "the vsock socket outlived its VM");
}

/// A pod's network namespace for a test: `ip netns` NAME with `eth0`, the
/// peer of a veth whose other end stays here; deleted when dropped.
struct PodNetns(String);

impl PodNetns {
    fn new(name: String) -> Self {
        let _ = ip(&["netns", "del", &name]);
        assert!(ip(&["netns", "add", &name]).status.success());
        let peer = format!("vp{}", &name[name.len().saturating_sub(10)..]);
        let o = ip(&[
            "link", "add", &peer, "type", "veth", "peer", "name", "eth0", "netns", &name,
        ]);
        assert!(o.status.success(), "{}", text(&o).1);
        Self(name)
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.0)
    }

    /// Whether link `name` is in the namespace.
    fn has(&self, name: &str) -> bool {
        ip(&["-n", &self.0, "link", "show", name]).status.success()
    }
}

impl Drop for PodNetns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.0]);
    }
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().unwrap()
}

/// How many of process `pid`'s descriptors are tap queues.
fn tap_queues_held(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == Path::new("/dev/net/tun")))
        .count()
}

/// NICs in pod networks for VM processes (issue 36): the daemon makes a
/// datapath NIC's tap in the pod's netns with the datapath around it
/// (tc programs pinned) and hands its queue over, so the VM process holds
/// the tap and the daemon does not; a warm pool member's bare NIC is
/// attached later (`nic-attach`: its tap moves into the pod netns while
/// the VM process keeps its queue). `info` says so for both. Both outlive
/// a `kill -9` of the daemon (the next one re-attaches and detaches
/// nothing), and a delete detaches each: no pins, no tap in the pod netns,
/// the pod's own `eth0` left as it was. (Linux guests, created, not
/// started: they could not run on a PVM host.)
#[test]
fn nics_of_vm_processes_join_pod_networks_and_outlive_the_daemon() {
    let name = "nics_of_vm_processes_join_pod_networks_and_outlive_the_daemon";
    if !root_or_skip(name) {
        return;
    }
    let Some(kernel) = kernel_or_skip(name) else {
        return;
    };
    let scratch = Scratch::new("daemon-vmproc-podnet");
    let dir = scratch.0.as_path();
    let tag = std::process::id() % 100_000;
    let (ns_p, ns_b) = (
        PodNetns::new(format!("k7dvpp{tag}")),
        PodNetns::new(format!("k7dvpb{tag}")),
    );
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let daemon_pid = guard.daemon.as_ref().unwrap().id();
    let create = |id: &str, nic: &str| {
        let k = kernel.to_str().unwrap();
        let o = cli(
            dir,
            &["create", "--id", id, "--kernel", k, "--memory", "128", "--nic", nic],
        );
        assert!(o.status.success(), "create {id}: {:?}", text(&o));
    };
    let (p, b) = (format!("podnet-p{tag}"), format!("podnet-b{tag}"));
    create(&p, &format!("datapath=direct,netns={},pod-if=eth0", ns_p.path()));
    create(&b, "vhost=off");
    let o = cli(dir, &["nic-attach", &b, "--netns", &ns_b.path(), "--mode", "direct"]);
    assert!(o.status.success(), "nic-attach {b}: {:?}", text(&o));
    let pins = |id: &str| Path::new("/sys/fs/bpf/k7d").join(k7d_net::nic_names(id, 0).bpf_subdir);
    let tap = |id: &str| k7d_net::nic_names(id, 0).tap;
    let attached = |id: &str, ns: &PodNetns| {
        assert!(pins(id).is_dir(), "vm {id}: no pins at {}", pins(id).display());
        assert!(ns.has(&tap(id)), "vm {id}: its tap is not in the pod netns");
        assert!(ns.has("eth0"), "the pod's eth0 is gone");
        let devices = info(dir, id)["devices"].to_string();
        assert!(devices.contains(", datapath: direct"), "vm {id}: {devices}");
    };
    for (id, ns) in [(&p, &ns_p), (&b, &ns_b)] {
        attached(id, ns);
        let pid = pid_of(dir, id);
        guard.pids.push(pid);
        assert_eq!(tap_queues_held(pid), 1, "vm {id}'s process holds its tap queue");
    }
    assert_eq!(tap_queues_held(daemon_pid), 0, "the daemon kept a tap queue");
    // No daemon, then the next one: nothing detached, the same processes.
    kill9(daemon_pid);
    let _ = guard.daemon.take().unwrap().wait();
    guard.daemon = Some(start_daemon(dir));
    for (i, (id, ns)) in [(&p, &ns_p), (&b, &ns_b)].into_iter().enumerate() {
        assert_eq!(pid_of(dir, id), guard.pids[i], "vm {id} was not re-attached");
        attached(id, ns);
    }
    // A bare NIC attached already is refused, with a sentence.
    let o = cli(dir, &["nic-attach", &b, "--netns", &ns_b.path(), "--mode", "direct"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(
        text(&o).1.contains("it is already attached to a pod's network"),
        "{:?}",
        text(&o)
    );
    for (id, ns) in [(&p, &ns_p), (&b, &ns_b)] {
        let o = cli(dir, &["delete", id]);
        assert!(o.status.success(), "delete {id}: {:?}", text(&o));
        assert!(!pins(id).exists(), "vm {id}: pins left at {}", pins(id).display());
        assert!(!ns.has(&tap(id)), "vm {id}: its tap is left in the pod netns");
        assert!(ns.has("eth0"), "the pod's own eth0 is the CNI's: it stays");
    }
    for &pid in &guard.pids {
        assert!(!alive(pid), "VM process {pid} outlived its delete");
    }
}

/// The cgroup leaf (issue 36): a daemon with VM processes refuses to start
/// where it cannot give each its own cgroup v2 leaf with the memory and
/// cpu controllers (here a plain directory, and a relative path), in one
/// sentence that names `--jail-cgroup off`; it starts nothing (no API
/// socket) and makes nothing. (This host's cgroups are v1: the limits
/// themselves are proven in the lab's L1, `k7d-jail.l1.sh`.)
#[test]
fn a_daemon_that_cannot_give_vm_processes_a_cgroup_refuses_to_start() {
    let name = "a_daemon_that_cannot_give_vm_processes_a_cgroup_refuses_to_start";
    if !root_or_skip(name) {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-cgroup");
    let dir = scratch.0.as_path();
    std::fs::create_dir_all(dir.join("plain")).unwrap();
    let not_cgroup = dir.join("plain/k7d");
    for (cg, says) in [
        (
            not_cgroup.to_str().unwrap(),
            "is not a cgroup v2 directory (no cgroup.controllers: No such file or directory (os error 2)) (--jail-cgroup off runs VM processes without memory or CPU limits, --jail off every VM inside the daemon)",
        ),
        ("k7d", "give an absolute cgroup v2 directory, or off"),
    ] {
        let mut child = Command::new(K7D)
            // No --jail: VM processes are the default.
            .args(["daemon", "--jail-cgroup", cg, "--state-dir"])
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(dir.join("k7d.sock"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                panic!("the daemon started with --jail-cgroup {cg}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
        let err = text(&o).1;
        let last = err.trim().lines().last().unwrap_or_default().to_string();
        assert!(last.contains(says), "{err}");
        assert!(!dir.join("k7d.sock").exists(), "a refused daemon made its socket");
    }
    assert!(!not_cgroup.exists(), "a refused daemon made its cgroup");
}

/// VM processes are the default, and they need root: a daemon run as
/// another user with no `--jail` refuses to start in one sentence that
/// names `--jail off`, before it makes its socket or starts a spawner,
/// instead of starting and then failing every VM it builds.
#[test]
fn a_daemon_without_root_refuses_vm_processes_and_names_jail_off() {
    use std::os::unix::process::CommandExt;
    let name = "a_daemon_without_root_refuses_vm_processes_and_names_jail_off";
    if !root_or_skip(name) {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-nonroot");
    let dir = scratch.0.as_path();
    let o = Command::new(K7D)
        .args(["daemon", "--jail-cgroup", "off", "--state-dir"])
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    let last = err.trim().lines().last().unwrap_or_default().to_string();
    assert!(
        last.contains("--jail on (the default)")
            && last.contains("lacks CAP_SETGID, CAP_SETUID, CAP_SETPCAP, CAP_SYS_CHROOT, CAP_SYS_ADMIN")
            && last.contains("pass --jail off"),
        "{err}"
    );
    assert!(!dir.join("k7d.sock").exists(), "a refused daemon made its socket");
    assert!(!dir.join("state").exists(), "a refused daemon made its state directory");
}

/// Whether process `pid` holds an open file at `path`.
fn holds_file(pid: u32, path: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == path))
}

/// Forks of a VM process with devices (issue 36): each child is built in a
/// VM process of its own from the source's exported fork instant, with its
/// own devices made by the daemon: its read-only images handed open (the
/// source's), an empty drive empty, its own entropy source, its own tap
/// (named after it, the source's MAC), its own vsock socket (beside the
/// source's, or the one the fork named), and a NIC in a pod network when
/// the fork asks for one (a fork-started pod). A batch that fails leaves
/// nothing; deletes leave nothing either. (Linux guests: the source is created, not
/// started, as on a PVM host it could not run; the lab's `k7d-cri` with
/// `LAB_CRI_JAIL=on`, by hand, forks running pods this way.)
#[test]
fn forks_of_a_vm_process_with_devices_get_devices_of_their_own() {
    let name = "forks_of_a_vm_process_with_devices_get_devices_of_their_own";
    if !root_or_skip(name) {
        return;
    }
    let Some(kernel) = kernel_or_skip(name) else {
        return;
    };
    let scratch = Scratch::new("daemon-vmproc-forkdev");
    let dir = scratch.0.as_path();
    let tag = std::process::id() % 100_000;
    let ns = PodNetns::new(format!("k7dvpf{tag}"));
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let image = dir.join("image.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).unwrap();
    let ro = format!("{},ro", image.display());
    let src_sock = dir.join("s.sock");
    let vsock = format!("cid=3,uds={}", src_sock.display());
    let src = format!("fsrc{tag}");
    let k = kernel.to_str().unwrap();
    let o = cli(
        dir,
        &[
            "create",
            "--id",
            &src,
            "--kernel",
            k,
            "--memory",
            "128",
            "--rng",
            "--disk",
            &ro,
            "--empty-drives",
            "1",
            "--nic",
            "vhost=off",
            "--vsock",
            &vsock,
        ],
    );
    assert!(o.status.success(), "create {src}: {:?}", text(&o));
    guard.pids.push(pid_of(dir, &src));
    // One child into a pod network with a socket of its own.
    let pod_sock = dir.join("pod.sock");
    let line = serde_json::json!({"v": 1, "op": "fork", "args": {
        "id": src, "count": 1, "name": "podchild",
        "nics": [{"mode": "direct", "netns": ns.path(), "pod_if": "eth0"}],
        "vsock_uds": pod_sock,
    }});
    let v = api(dir, &line.to_string());
    assert_eq!(v["ok"], true, "{v}");
    // A batch whose second child cannot have its socket (a file is in its
    // place) fails whole, and the first child leaves nothing: no process,
    // no socket, no files.
    let sock_of = |c: &str| std::path::PathBuf::from(format!("{}-{c}", src_sock.display()));
    let blocker = sock_of(&format!("{src}-f2"));
    std::fs::write(&blocker, b"not a socket").unwrap();
    let before: Vec<u32> = guard.pids.clone();
    let line = serde_json::json!({"v": 1, "op": "fork", "args": {"id": src, "count": 2}});
    let v = api(dir, &line.to_string());
    assert_eq!(v["ok"], false, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("cannot bind vsock's host socket")),
        "{v}"
    );
    assert!(
        !sock_of(&format!("{src}-f1")).exists(),
        "the failed batch's first child left its vsock socket"
    );
    assert!(
        !dir.join(format!("state/vms/{src}-f1")).exists(),
        "the failed batch's first child left its files"
    );
    assert_eq!(
        std::fs::read(&blocker).unwrap(),
        b"not a socket",
        "the file in the way was touched"
    );
    std::fs::remove_file(&blocker).unwrap();
    assert_eq!(guard.pids, before);
    // Two plain children.
    let line = serde_json::json!({"v": 1, "op": "fork", "args": {"id": src, "count": 2}});
    let v = api(dir, &line.to_string());
    assert_eq!(v["ok"], true, "{v}");
    let plain: Vec<String> = (0..2)
        .map(|i| v["result"]["children"][i]["id"].as_str().unwrap().to_string())
        .collect();
    // The source's MAC (derived from its id): what its NIC's line shows.
    let mac_in = |devices: &str| {
        let at = devices.find(", mac ").expect("a NIC line with its MAC") + ", mac ".len();
        devices[at..at + 17].to_string()
    };
    let src_mac = mac_in(&info(dir, &src)["devices"].to_string());
    let children = ["podchild".to_string(), plain[0].clone(), plain[1].clone()];
    for c in &children {
        let pid = pid_of(dir, c);
        guard.pids.push(pid);
        assert_ne!(pid, guard.pids[0], "{c} shares its source's process");
        let i = info(dir, c);
        let devices = i["devices"].to_string();
        for kind in ["virtio-rng", "virtio-blk", "virtio-net", "virtio-vsock"] {
            assert!(devices.contains(kind), "{c} has no {kind}: {devices}");
        }
        assert!(
            holds_file(pid, &image),
            "{c}'s process does not hold its read-only image"
        );
        assert_eq!(tap_queues_held(pid), 1, "{c}'s process holds its own tap queue");
        let sock = if c == "podchild" {
            pod_sock.clone()
        } else {
            std::path::PathBuf::from(format!("{}-{c}", src_sock.display()))
        };
        let inode = unix_socket_inode(&sock).unwrap_or_else(|| panic!("{c}: no socket at {}", sock.display()));
        assert!(
            holds_socket(pid, &inode),
            "{c}'s process does not hold its vsock socket"
        );
        assert!(
            !holds_socket(guard.pids[0], &inode),
            "the source holds {c}'s vsock socket"
        );
        let tap = k7d_net::nic_names(c, 0).tap;
        let in_pod = ns.has(&tap);
        assert_eq!(in_pod, c == "podchild", "{c}'s tap {tap} in the pod netns");
        assert_eq!(
            devices.contains(", datapath: direct"),
            c == "podchild",
            "{c}: {devices}"
        );
        assert_eq!(mac_in(&devices), src_mac, "{c} keeps its source's MAC");
    }
    for id in children.iter().chain([&src]) {
        let o = cli(dir, &["delete", id]);
        assert!(o.status.success(), "delete {id}: {:?}", text(&o));
    }
    for &pid in &guard.pids {
        assert!(!alive(pid), "VM process {pid} outlived its delete");
    }
    assert!(
        !pod_sock.exists() && !src_sock.exists(),
        "a vsock socket outlived its VM"
    );
    assert!(
        !ns.has(&k7d_net::nic_names("podchild", 0).tap),
        "the pod child's tap is left in the pod netns"
    );
    assert_no_vm_files(dir);
}

/// The upgrade drill (issue 36): the VMs of a daemon of an earlier k7d (a
/// binary of an earlier commit, `K7D_UPGRADE_FROM_BIN`: `tests/run-all.sh`
/// keeps the release binary of each passing run on this machine for the
/// next) outlive its `kill -9`, and a daemon of this k7d serves them: it
/// re-attaches to each VM process (the same pid, the guest ran on without
/// any daemon, its fork child's parent known), or, if the two speak
/// different channel versions, refuses each with a sentence in its log
/// and leaves none running (never a guess). Then nothing is left.
#[test]
fn a_daemon_of_this_k7d_takes_over_the_vm_processes_of_an_earlier_one() {
    let name = "a_daemon_of_this_k7d_takes_over_the_vm_processes_of_an_earlier_one";
    if !root_or_skip(name) {
        return;
    }
    let Some(old) = std::env::var_os("K7D_UPGRADE_FROM_BIN").map(std::path::PathBuf::from) else {
        k7d_test_skip::skip(
            name,
            "K7D_UPGRADE_FROM_BIN is not set: no k7d of an earlier commit (tests/run-all.sh keeps one from the last passing run on this machine)",
        );
        return;
    };
    let version = |bin: &Path| {
        text(&Command::new(bin).arg("--version").output().unwrap())
            .0
            .trim()
            .to_string()
    };
    let scratch = Scratch::new("daemon-vmproc-upgrade");
    let dir = scratch.0.as_path();
    // An earlier k7d may not know --jail-cgroup (and then makes no cgroup).
    let help = text(&Command::new(&old).args(["daemon", "--help"]).output().unwrap()).0;
    let mut flags = vec!["--jail", "on", "--jail-id-base", "2000000700"];
    if help.contains("--jail-cgroup") {
        flags.extend(["--jail-cgroup", "off"]);
    }
    let old_daemon = common::start_daemon(&old, dir, &flags, true);
    let mut guard = Cleanup {
        dir,
        daemon: Some(old_daemon),
        pids: Vec::new(),
    };
    let old_cli = |args: &[&str]| {
        let o = Command::new(&old)
            .arg("--socket")
            .arg(dir.join("k7d.sock"))
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{} {args:?}: {:?}", old.display(), text(&o));
    };
    for id in ["up-a", "up-b"] {
        old_cli(&[
            "create",
            "--id",
            id,
            "--builtin",
            "memwriter",
            "--memory",
            "16",
            "--start",
        ]);
    }
    old_cli(&["fork", "up-a"]);
    // With the cloud kernel cached: a VM with a read-write disk (created,
    // not started: a Linux guest cannot run on a PVM host), forked under
    // this k7d after the takeover.
    let kernel = common::cached_cloud_kernel();
    let disk = dir.join("up-d.img");
    if let Some(k) = &kernel {
        std::fs::write(&disk, vec![7u8; 1 << 20]).unwrap();
        old_cli(&[
            "create",
            "--id",
            "up-d",
            "--kernel",
            k.to_str().unwrap(),
            "--memory",
            "128",
            "--disk",
            &format!("{},rw", disk.display()),
        ]);
    }
    let ids = ["up-a", "up-b", "up-a-f1"];
    let pids: Vec<u32> = ids.iter().map(|id| pid_of(dir, id)).collect();
    guard.pids = pids.clone();
    let old_pid = guard.daemon.as_ref().unwrap().id();
    kill9(old_pid);
    let _ = guard.daemon.take().unwrap().wait();
    // (A fork child's RAM is its source's base memfd, named after it.)
    for (id, &pid) in ids.iter().zip(&pids) {
        let ram = id.trim_end_matches("-f1");
        assert!(
            grows(|| read_pages(pid, ram, COUNTER, 1)[0]),
            "vm {id} stopped with the earlier daemon"
        );
    }
    // This k7d's daemon, its log kept.
    let mut new = Command::new(K7D)
        .args(["daemon", "--state-dir"])
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(["--jail", "on", "--jail-cgroup", "off", "--jail-id-base", "2000000700"])
        .env_remove("K7D_SOCKET")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("daemon.log")).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(dir.join("k7d.sock")).is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "this k7d's daemon did not start");
        assert!(new.try_wait().unwrap().is_none(), "this k7d's daemon exited at start");
        std::thread::sleep(Duration::from_millis(10));
    }
    guard.daemon = Some(new);
    let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap();
    let (from, to) = (version(&old), version(Path::new(K7D)));
    if log.contains("speaks version") {
        // Channel versions differ: refused, never guessed.
        for (id, &pid) in ids.iter().zip(&pids) {
            assert!(
                !alive(pid),
                "vm {id}'s process of the earlier k7d ({from}) runs on unserved"
            );
            assert!(!text(&cli(dir, &["list"])).0.contains(id), "{id} is listed");
        }
    } else {
        for (id, &pid) in ids.iter().zip(&pids) {
            assert_eq!(pid_of(dir, id), pid, "vm {id} ({from} -> {to}) was not re-attached");
            assert_eq!(info(dir, id)["status"].as_str(), Some("running"), "vm {id}");
            assert!(
                grows(|| counter(dir, id)),
                "vm {id} does not run under this k7d's daemon"
            );
        }
        assert_eq!(info(dir, "up-a-f1")["parent"].as_str(), Some("up-a"));
        // A VM of the earlier k7d forks under this one: its VM process may
        // not know the one-round-trip capture (asked step by step then),
        // nor make sealable RAM (its record says so: forked unsealed,
        // with a warning in the log, as before).
        let o = cli(dir, &["--json", "fork", "up-a"]);
        assert!(o.status.success(), "fork of the earlier k7d's up-a: {:?}", text(&o));
        guard.pids.push(pid_of(dir, "up-a-f2"));
        assert_eq!(info(dir, "up-a-f2")["parent"].as_str(), Some("up-a"));
        assert!(grows(|| counter(dir, "up-a-f2")), "up-a-f2 does not run");
        // Its read-write disk too: an earlier VM process may not know the
        // read-only base it is handed (asked without it then).
        if kernel.is_some() {
            guard.pids.push(pid_of(dir, "up-d"));
            let o = cli(dir, &["--json", "fork", "up-d"]);
            assert!(o.status.success(), "fork of the earlier k7d's up-d: {:?}", text(&o));
            guard.pids.push(pid_of(dir, "up-d-f1"));
            assert_eq!(info(dir, "up-d-f1")["parent"].as_str(), Some("up-d"));
        }
        let _ = std::io::Write::flush(&mut std::io::stderr());
        eprintln!("upgrade drill: {from} -> {to}: 3 VM processes re-attached, one forked");
    }
    for id in ["up-d-f1", "up-d", "up-a-f2", "up-a-f1", "up-a", "up-b"] {
        let _ = cli(dir, &["delete", id]);
    }
    for &pid in &guard.pids {
        assert!(!alive(pid), "VM process {pid} outlived its delete");
    }
    assert_no_vm_files(dir);
}

/// VM processes (not zombies) whose jail is under `dir` and that hold a
/// VM's guest RAM (spares made ahead, waiting for a build, hold none).
fn vm_processes_under(dir: &Path) -> Vec<u32> {
    common::vm_process_pids_under(dir)
        .into_iter()
        .filter(|pid| {
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
            maps.contains("memfd:k7d-ram-") && alive(*pid)
        })
        .collect()
}

/// A fork's children are built several at once (`k7d-fork-build`), and
/// still every child or none: with ids for two more VM processes, a fork
/// of three fails with the range's sentence, and no child, process,
/// record or id is left of it; the next fork of two gets both ids.
#[test]
fn a_fork_past_the_id_range_builds_no_child_and_frees_every_id() {
    if !root_or_skip("a_fork_past_the_id_range_builds_no_child_and_frees_every_id") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-fork-ids");
    let dir = scratch.0.as_path();
    let daemon = start_jailed_daemon(dir, "2000000400", &["--jail-id-count", "3", "--jail-spares", "0"]);
    let _guard = Cleanup {
        dir,
        daemon: Some(daemon),
        pids: Vec::new(),
    };
    create_page_writer(dir, "src");
    let src = pid_of(dir, "src");
    assert_eq!(vm_processes_under(dir), vec![src]);
    let o = cli(dir, &["fork", "src", "--count", "3"]);
    assert!(!o.status.success(), "a fork of 3 with 2 ids left: {:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("all 3 ids of the VM processes' range are taken"), "{err}");
    // Nothing of it: no child listed, recorded or running.
    let list = text(&cli(dir, &["list"])).0;
    assert!(!list.contains("src-f"), "{list}");
    let t = Instant::now();
    while vm_processes_under(dir) != vec![src] && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(vm_processes_under(dir), vec![src], "a child's VM process was left");
    let left: Vec<_> = std::fs::read_dir(dir.join("state/vms"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("src-f"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // Every id came back: two children fit.
    let o = cli(dir, &["fork", "src", "--count", "2"]);
    assert!(o.status.success(), "a fork of 2 with 2 ids left: {:?}", text(&o));
    for c in ["src-f1", "src-f2"] {
        assert_eq!(info(dir, c)["state"]["state"], "running", "{c}");
        assert!(grows(|| counter(dir, c)), "{c} does not run");
    }
    assert_eq!(vm_processes_under(dir).len(), 3);
}

/// Snapshots and restores with `--jail on` (issue 36). A snapshot of a VM
/// process is written by the daemon from the machine state and guest RAM
/// the process hands over (the memfd; after a fork the frozen base and the
/// diverged pages). A restore is verified and copied into a memfd by the
/// daemon, and runs in a jailed VM process of its own over that memfd,
/// holding no file of the snapshot. Each restore resumes with the pages
/// and counter its snapshot had; a snapshot with a flipped bit is refused
/// in one sentence and leaves no process, record or id behind.
#[test]
fn restores_by_a_jailed_daemon_run_in_vm_processes_of_their_own() {
    use std::os::unix::fs::FileExt;
    if !root_or_skip("restores_by_a_jailed_daemon_run_in_vm_processes_of_their_own") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-restore");
    let dir = scratch.0.as_path();
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_daemon(dir)),
        pids: Vec::new(),
    };
    let daemon_pid = guard.daemon.as_ref().unwrap().id();
    create_page_writer(dir, "src");
    let src = pid_of(dir, "src");
    guard.pids.push(src);
    assert!(grows(|| counter(dir, "src")));
    // Its pages stay as they are from here; it only counts.
    stop_writing(src, "src");
    let at = |snap: &str| -> (Vec<u32>, u32) {
        assert!(cli(dir, &["pause", "src"]).status.success());
        let seen = (read_pages(src, "src", AREA, PAGES), counter(dir, "src"));
        let o = cli(dir, &["snapshot", "src", &dir.join(snap).to_string_lossy()]);
        assert!(o.status.success(), "snapshot {snap}: {:?}", text(&o));
        assert_eq!(info(dir, "src")["state"]["state"], "paused", "a paused VM stays paused");
        assert!(cli(dir, &["resume", "src"]).status.success());
        seen
    };
    // One of its RAM as it is, one after a fork froze it (the counter's
    // page then diverges from the base).
    let (pages, whole_at) = at("whole");
    let o = cli(dir, &["fork", "src"]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(cli(dir, &["delete", "src-f1"]).status.success());
    assert!(grows(|| counter(dir, "src")));
    let (pages_forked, forked_at) = at("forked");
    assert_eq!(pages, pages_forked, "the written pages changed");
    assert!(forked_at > whole_at);
    for (id, snap, count) in [("r1", "whole", whole_at), ("r2", "forked", forked_at)] {
        let snap = dir.join(snap);
        let o = cli(dir, &["restore", &snap.to_string_lossy(), "--id", id]);
        assert!(o.status.success(), "restore {id}: {:?}", text(&o));
        let pid = pid_of(dir, id);
        assert!(pid != daemon_pid && !guard.pids.contains(&pid));
        guard.pids.push(pid);
        common::assert_jailed_vm_process_with(pid, id, Some(&dir.join("state/vms").join(id)));
        assert!(common::holds_ram_of(pid, id), "{id}'s process holds no RAM of its own");
        assert!(
            !holds_file(pid, &snap.join("memory")),
            "{id}'s process holds the snapshot's memory file"
        );
        // What the snapshot had: the pages, and the counter it resumes from.
        assert_eq!(read_pages(pid, id, AREA, PAGES), pages, "{id}'s pages");
        let c = counter(dir, id);
        assert!(c >= count, "{id} counts from {c}, its snapshot was at {count}");
        assert!(grows(|| counter(dir, id)), "{id} does not run");
    }
    // The daemon kept no view of a restored VM's RAM.
    assert!(!common::holds_ram_of(daemon_pid, "r1"), "the daemon kept r1's RAM");
    // A flipped bit in a memory file: one sentence, nothing left.
    let memory = dir.join("whole/memory");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&memory)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, AREA + 0x123).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], AREA + 0x123).unwrap();
    let whole = dir.join("whole").to_string_lossy().into_owned();
    let o = cli(dir, &["restore", &whole, "--id", "r3"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("do not match the manifest's checksum"), "{err}");
    assert!(!cli(dir, &["info", "r3"]).status.success(), "r3 exists");
    assert!(!dir.join("state/vms/r3").exists() && !dir.join("state/vms/r3.json").exists());
    let mut running = vm_processes_under(dir);
    running.sort();
    let mut want = guard.pids.clone();
    want.sort();
    assert_eq!(running, want, "a VM process was left by the refused restore");
    f.write_all_at(&b, AREA + 0x123).unwrap();
    let o = cli(dir, &["restore", &whole, "--id", "r3"]);
    assert!(o.status.success(), "restore r3 once mended: {:?}", text(&o));
    for id in ["r1", "r2", "r3", "src"] {
        assert!(cli(dir, &["delete", id]).status.success());
    }
    assert!(vm_processes_under(dir).is_empty());
    assert_no_vm_files(dir);
}

/// How process `pid` holds `image`: one "r" or "rw" per descriptor.
fn image_fds(pid: u32, image: &Path) -> Vec<&'static str> {
    access_of(pid, |l| l == image)
}

/// How process `pid` holds each file whose `/proc/<pid>/fd` link `names`
/// matches: one "r" (read-only) or "rw" per descriptor.
fn access_of(pid: u32, names: impl Fn(&Path) -> bool) -> Vec<&'static str> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        if std::fs::read_link(e.path()).is_ok_and(|l| names(&l)) {
            let fd = e.file_name();
            let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.to_string_lossy())).unwrap();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
                .unwrap();
            let read_only = flags & libc::O_ACCMODE as u32 == libc::O_RDONLY as u32;
            out.push(if read_only { "r" } else { "rw" });
        }
    }
    out
}

/// Checks that process `pid` holds the RAM memfd of `vm` (its base once
/// forked) writable, and that a write through it, opened again read-write
/// as root, fails: the memfd is sealed against writes, shrinking and
/// growth (`F_GET_SEALS`).
fn assert_base_sealed(pid: u32, vm: &str) {
    use std::os::unix::fs::FileExt;
    let name = format!("/memfd:k7d-ram-{vm} ");
    let fd = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with(&name)))
        .unwrap_or_else(|| panic!("process {pid} holds no RAM memfd of {vm}"));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(fd.path())
        .unwrap();
    // SAFETY: fcntl on a descriptor this test holds, no argument.
    let seals = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_GET_SEALS) };
    let want = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    assert_eq!(seals & want, want, "{vm}'s base has seals {seals:#x}");
    let e = f
        .write_at(&[0xaa], 0x20_0000)
        .expect_err("a write into a fork's base went through");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    assert!(f.set_len(4096).is_err(), "{vm}'s base could be shrunk");
}

/// How many copy-on-write overlays (unlinked files made in `dir`, the
/// image's directory) process `pid` holds.
fn overlays_held(pid: u32, dir: &Path) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|l| l.parent() == Some(dir) && l.to_string_lossy().ends_with(" (deleted)"))
        .count()
}

/// The bridge tap `tap` is a port of, if any.
fn master(tap: &str) -> Option<String> {
    k7d_net::master_of(tap).unwrap()
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// `cluster info`'s bridge and ports of cluster `id`.
fn cluster_ports(dir: &Path, id: &str) -> (Option<String>, Vec<String>) {
    let o = cli(dir, &["--json", "cluster", "info", id]);
    assert!(o.status.success(), "cluster info {id}: {:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ports = v["ports"]
        .as_array()
        .map(|a| a.iter().map(|p| p.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    (v["bridge"].as_str().map(String::from), ports)
}

/// Clusters of VM processes with NICs (issue 36): each member's tap (made
/// by the daemon, handed to its VM process) goes on the cluster's private
/// bridge, and each fork's children's taps on a bridge of that fork's own
/// before the children run, while the member's stays on the source's. A
/// daemon killed with `-9`, or one that exits on SIGTERM, leaves every
/// bridge with its ports for the next daemon, which keeps them, and makes
/// a bridge somebody deleted meanwhile again with its member's taps back
/// on it. A member with a read-write disk forks too (its child holds the
/// frozen base read-only and an overlay of its own). Cluster deletes leave no
/// bridge, tap, process or file. (Linux guests, created and not started:
/// on a PVM host they could not run; the lab's `k7d-cluster` with
/// `LAB_JAIL=on` runs guests that talk over these bridges across a fork.)
#[test]
fn clusters_of_vm_processes_keep_their_nics_on_private_bridges() {
    use k7d_net::{cluster_bridge_name as bridge_of, nic_names};
    let name = "clusters_of_vm_processes_keep_their_nics_on_private_bridges";
    if !root_or_skip(name) {
        return;
    }
    let Some(kernel) = kernel_or_skip(name) else {
        return;
    };
    let scratch = Scratch::new("daemon-vmproc-clbr");
    let dir = scratch.0.as_path();
    let tag = std::process::id() % 100_000;
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_jailed_daemon(dir, "2000000800", &[])),
        pids: Vec::new(),
    };
    let k = kernel.to_str().unwrap();
    let image = dir.join("image.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).unwrap();
    let rw = format!("{},rw", image.display());
    let (a, b, w) = (format!("cba{tag}"), format!("cbb{tag}"), format!("cbw{tag}"));
    for (id, disk) in [(&a, None), (&b, None), (&w, Some(rw.as_str()))] {
        let mut args = vec![
            "create",
            "--id",
            id,
            "--kernel",
            k,
            "--memory",
            "128",
            "--nic",
            "vhost=off",
        ];
        if let Some(d) = disk {
            args.extend(["--disk", d]);
        }
        let o = cli(dir, &args);
        assert!(o.status.success(), "create {id}: {:?}", text(&o));
        guard.pids.push(pid_of(dir, id));
    }
    let tap = |vm: &str| nic_names(vm, 0).tap;
    let cl = format!("cb{tag}");
    let o = cli(dir, &["cluster", "create", &cl, &a, &b]);
    assert!(o.status.success(), "{:?}", text(&o));
    let br = bridge_of(&cl);
    assert_eq!(
        cluster_ports(dir, &cl),
        (
            Some(br.clone()),
            vec![format!("{a}:0:{}", tap(&a)), format!("{b}:0:{}", tap(&b))]
        )
    );
    for m in [&a, &b] {
        assert_eq!(master(&tap(m)).as_deref(), Some(br.as_str()), "{m}'s tap");
    }

    // Two forks: each a cluster with a bridge of its own and its
    // children's taps on it.
    let o = cli(dir, &["--json", "fork", &cl, "--count", "2"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let forks = [format!("{cl}-f1"), format!("{cl}-f2")];
    assert_eq!(v["clusters"], serde_json::json!(forks), "{v}");
    let mut bridges = vec![br.clone()];
    for (n, f) in forks.iter().enumerate() {
        let fbr = bridge_of(f);
        assert!(!bridges.contains(&fbr));
        bridges.push(fbr.clone());
        let kids = [format!("{a}-f{}", n + 1), format!("{b}-f{}", n + 1)];
        assert_eq!(
            cluster_ports(dir, f),
            (
                Some(fbr.clone()),
                kids.iter().map(|c| format!("{c}:0:{}", tap(c))).collect()
            )
        );
        for c in &kids {
            let pid = pid_of(dir, c);
            assert!(!guard.pids.contains(&pid), "{c} shares a process");
            guard.pids.push(pid);
            assert_eq!(tap_queues_held(pid), 1, "{c}'s process holds its own tap queue");
            assert_eq!(master(&tap(c)).as_deref(), Some(fbr.as_str()), "{c}'s tap");
        }
    }
    for m in [&a, &b] {
        assert_eq!(master(&tap(m)).as_deref(), Some(br.as_str()), "{m}'s tap moved");
    }

    // kill -9 of the daemon; meanwhile somebody deletes the second fork's
    // bridge. The next daemon keeps every bridge, and makes that one again
    // with its children's taps on it.
    let mut d = guard.daemon.take().unwrap();
    kill9(d.id());
    let _ = d.wait();
    assert!(ip(&["link", "del", &bridges[2]]).status.success());
    guard.daemon = Some(start_jailed_daemon(dir, "2000000800", &[]));
    for (i, c) in [&cl, &forks[0], &forks[1]].into_iter().enumerate() {
        assert_eq!(cluster_ports(dir, c).0.as_deref(), Some(bridges[i].as_str()), "{c}");
    }
    for (c, want) in [
        (a.clone(), &bridges[0]),
        (format!("{a}-f1"), &bridges[1]),
        (format!("{b}-f2"), &bridges[2]),
    ] {
        assert_eq!(
            master(&tap(&c)).as_deref(),
            Some(want.as_str()),
            "{c}'s tap after the restart"
        );
    }
    // A daemon that exits as asked (SIGTERM) keeps them too.
    let mut d = guard.daemon.take().unwrap();
    // SAFETY: kill takes integers; the daemon is this test's child.
    assert_eq!(unsafe { libc::kill(d.id() as i32, libc::SIGTERM) }, 0);
    assert!(d.wait().unwrap().success());
    for bridge in &bridges {
        assert!(link_exists(bridge), "{bridge} went with a daemon that exited");
    }
    guard.daemon = Some(start_jailed_daemon(dir, "2000000800", &[]));
    assert_eq!(master(&tap(&format!("{b}-f1"))).as_deref(), Some(bridges[1].as_str()));

    // A member with a read-write disk: its child reads the frozen base
    // (read-only) through an overlay of its own.
    let clw = format!("cw{tag}");
    let o = cli(dir, &["cluster", "create", &clw, &w]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = cli(dir, &["fork", &clw]);
    assert!(o.status.success(), "{:?}", text(&o));
    let wc = format!("{w}-f1");
    let pid = pid_of(dir, &wc);
    guard.pids.push(pid);
    assert_eq!(image_fds(pid, &image), ["r"], "{wc} holds its base read-only");
    assert_eq!(overlays_held(pid, dir), 1, "{wc} holds an overlay of its own");
    bridges.push(bridge_of(&format!("{clw}-f1")));
    assert!(link_exists(&bridges[3]));

    // Cluster deletes: no bridge, tap, process or file is left.
    let mut taps: Vec<String> = [&a, &b, &w, &wc].iter().map(|m| tap(m)).collect();
    for n in 1..=2 {
        taps.extend([tap(&format!("{a}-f{n}")), tap(&format!("{b}-f{n}"))]);
    }
    for c in [&forks[1], &forks[0], &cl, &clw, &format!("{clw}-f1")] {
        let o = cli(dir, &["cluster", "delete", c]);
        assert!(o.status.success(), "cluster delete {c}: {:?}", text(&o));
    }
    for &p in &guard.pids {
        assert!(!alive(p), "VM process {p} outlived its delete");
    }
    for link in bridges.iter().chain(&taps) {
        assert!(!link_exists(link), "{link} outlived its cluster");
    }
    assert_no_vm_files(dir);
}

/// Forks of a VM process with a read-write disk (issue 36): the daemon
/// makes the overlay files (a VM process creates none), the source takes
/// its own at its first fork (its base freezes) and fills its children's
/// with what it wrote since; each child holds the frozen base read-only
/// (opened again by the daemon, checked to be the file the source froze)
/// and an overlay of its own, and so does a grandchild. The daemon keeps
/// none of them. A frozen base cannot be opened read-write by another VM;
/// an image replaced at its path since the source froze it is refused with
/// a sentence and leaves no child. After the deletes the image is free
/// again and nothing is left. (Linux guests, created and not started; what
/// their disks hold across a fork is `block_cow.rs`'s and, with running
/// guests, the lab's `k7d-fork` with `LAB_JAIL=on`.)
#[test]
fn forks_of_a_vm_process_with_a_read_write_disk_share_its_frozen_base() {
    let name = "forks_of_a_vm_process_with_a_read_write_disk_share_its_frozen_base";
    if !root_or_skip(name) {
        return;
    }
    let Some(kernel) = kernel_or_skip(name) else {
        return;
    };
    let scratch = Scratch::new("daemon-vmproc-rwfork");
    let dir = scratch.0.as_path();
    let mut guard = Cleanup {
        dir,
        daemon: Some(start_jailed_daemon(dir, "2000000900", &[])),
        pids: Vec::new(),
    };
    let daemon_pid = guard.daemon.as_ref().unwrap().id();
    let k = kernel.to_str().unwrap();
    let image = dir.join("image.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).unwrap();
    let rw = format!("{},rw", image.display());
    std::fs::write(dir.join("b.img"), vec![0u8; 1 << 20]).unwrap();
    let create = |id: &str| {
        cli(
            dir,
            &["create", "--id", id, "--kernel", k, "--memory", "128", "--disk", &rw],
        )
    };
    let o = create("rws");
    assert!(o.status.success(), "create rws: {:?}", text(&o));
    let src = pid_of(dir, "rws");
    guard.pids.push(src);
    assert_eq!(image_fds(src, &image), ["rw"]);
    assert_eq!(overlays_held(src, dir), 0, "no overlay before the first fork");

    let o = cli(dir, &["--json", "fork", "rws", "--count", "2"]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(
        overlays_held(src, dir),
        1,
        "the source writes an overlay of its own now"
    );
    // Its base froze: the source swapped its read-write descriptor of the
    // image for the read-only one its daemon opened, so it holds nothing
    // that writes what its children read.
    assert_eq!(
        image_fds(src, &image),
        ["r"],
        "the source still holds its frozen base writable"
    );
    let o = cli(dir, &["--json", "fork", "rws-f1"]);
    assert!(o.status.success(), "fork of a child: {:?}", text(&o));
    for c in ["rws-f1", "rws-f2", "rws-f1-f1"] {
        let pid = pid_of(dir, c);
        guard.pids.push(pid);
        assert_eq!(image_fds(pid, &image), ["r"], "{c} holds the frozen base read-only");
        assert_eq!(overlays_held(pid, dir), 1, "{c} holds an overlay of its own");
        assert_eq!(info(dir, c)["status"], "running", "{c}");
    }
    assert!(
        image_fds(daemon_pid, &image).is_empty(),
        "the daemon keeps the image open"
    );
    assert_eq!(overlays_held(daemon_pid, dir), 0, "the daemon keeps an overlay");
    // A disk budget its children's overlays could not be held to, in VM
    // processes of their own, is refused before anything is paused.
    let o = cli(
        dir,
        &[
            "create",
            "--id",
            "budget",
            "--kernel",
            k,
            "--memory",
            "128",
            "--disk",
            &format!("{},rw", dir.join("b.img").display()),
            "--max-children-disk",
            "4",
        ],
    );
    assert!(o.status.success(), "create budget: {:?}", text(&o));
    guard.pids.push(pid_of(dir, "budget"));
    let o = cli(dir, &["fork", "budget"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(text(&o).1.contains("fork.max_children_disk_mib"), "{:?}", text(&o));
    assert!(!dir.join("state/vms/budget-f1").exists());
    assert!(cli(dir, &["delete", "budget"]).status.success());
    // The base is frozen: no other VM may write it.
    let o = create("other");
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(text(&o).1.contains("frozen base"), "{:?}", text(&o));
    // An image replaced at its path is not the base the source froze.
    let keep = dir.join("image.keep");
    std::fs::hard_link(&image, &keep).unwrap();
    let other = dir.join("image.new");
    std::fs::write(&other, vec![8u8; 1 << 20]).unwrap();
    std::fs::rename(&other, &image).unwrap();
    let o = cli(dir, &["fork", "rws"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("is no longer the file the VM froze"), "{err}");
    assert!(
        !dir.join("state/vms/rws-f3").exists(),
        "the refused fork left a child's files"
    );
    std::fs::rename(&keep, &image).unwrap();

    for id in ["rws-f1-f1", "rws-f1", "rws-f2", "rws"] {
        let o = cli(dir, &["delete", id]);
        assert!(o.status.success(), "delete {id}: {:?}", text(&o));
    }
    for &pid in &guard.pids {
        assert!(!alive(pid), "VM process {pid} outlived its delete");
    }
    // The base is free again.
    let o = create("again");
    assert!(o.status.success(), "create again: {:?}", text(&o));
    guard.pids.push(pid_of(dir, "again"));
    assert!(cli(dir, &["delete", "again"]).status.success());
    assert_no_vm_files(dir);
}

/// `pod_cgroup` (issue 39): a pod VM's process joins its pod's cgroup only
/// where it has a cgroup leaf to move, and says why not in one sentence:
/// with `--jail-cgroup off` (this host's cgroups are v1, so here), for a
/// VM inside the daemon (`--jail off`), for a path that is not a plain one
/// from the cgroup root, for a VM the daemon does not have. Nothing moves.
/// (The move itself is proven in the lab's `k7d-cri`: the pod's node
/// cgroup shows the VM's working set and CPU.)
#[test]
fn a_vm_process_joins_its_pods_cgroup_only_where_it_can_and_says_why() {
    if !root_or_skip("a_vm_process_joins_its_pods_cgroup_only_where_it_can_and_says_why") {
        return;
    }
    let scratch = Scratch::new("daemon-vmproc-podcg");
    let dir = scratch.0.as_path();
    let _guard = Cleanup {
        dir,
        daemon: Some(start_jailed_daemon(dir, "2000001000", &[])),
        pids: Vec::new(),
    };
    create_page_writer(dir, "pc");
    let before = info(dir, "pc")["vm_process"].clone();
    let call = |dir: &Path, id: &str, parent: &str| {
        let line = serde_json::json!({"v": 1, "op": "pod_cgroup", "args": {"id": id, "cgroup_parent": parent}});
        let v = api(dir, &line.to_string());
        assert_eq!(v["ok"], false, "{v}");
        (
            v["error"]["code"].as_str().unwrap().to_string(),
            v["error"]["message"].as_str().unwrap().to_string(),
        )
    };
    let (code, msg) = call(dir, "pc", "/k7d-test/pod1");
    assert_eq!(code, "conflict", "{msg}");
    assert_eq!(
        msg,
        "vm pc cannot join the pod's cgroup /k7d-test/pod1: this daemon runs VM processes without cgroups (--jail-cgroup off)"
    );
    let (code, msg) = call(dir, "pc", "/k7d-test/../../etc");
    assert_eq!(code, "invalid_argument", "{msg}");
    assert!(msg.contains("is not a plain name"), "{msg}");
    let (code, msg) = call(dir, "nope", "/k7d-test/pod1");
    assert_eq!(code, "not_found", "{msg}");
    assert_eq!(
        info(dir, "pc")["vm_process"],
        before,
        "a refused move changed the VM's process"
    );
    assert!(grows(|| counter(dir, "pc")), "the VM stopped running");

    // A VM inside the daemon has no process of its own to move.
    let scratch2 = Scratch::new("daemon-inproc-podcg");
    let dir2 = scratch2.0.as_path();
    let _guard2 = Cleanup {
        dir: dir2,
        daemon: Some(start_jailed_daemon(dir2, "2000001100", &["--jail", "off"])),
        pids: Vec::new(),
    };
    create_page_writer(dir2, "here");
    let (code, msg) = call(dir2, "here", "/k7d-test/pod1");
    assert_eq!(code, "conflict", "{msg}");
    assert_eq!(
        msg,
        "vm here runs inside the daemon (--jail off): it has no process of its own to put in its pod's cgroup"
    );
}

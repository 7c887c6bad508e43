//! The daemon API: lifecycle, records, refusals of bad input, reconcile.

use std::time::Duration;

use k7d_api::api::{ErrorCode, Reply, Request};
use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::{TestDaemon, wait_for};
use k7d_vmm::daemon::store::VmRecord;
use serde_json::{Value, json};

fn create_line(config: Value, start: bool) -> String {
    json!({"v": 1, "op": "create", "args": {"config": config, "start": start}}).to_string()
}

fn record(d: &TestDaemon, id: &str) -> VmRecord {
    let p = d.dir.0.join(format!("state/vms/{id}.json"));
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

#[test]
fn lifecycle_is_recorded_and_pause_parks_the_guest() {
    let d = TestDaemon::start("lifecycle");
    let mut c = d.client();
    let cfg = json!({"id": "mw", "memory_mib": 16, "guest": {"kind": "builtin", "name": "memwriter", "args": [4, 2097152, 0]}});
    let r = c.call_raw(&create_line(cfg, false)).unwrap().into_result().unwrap();
    assert_eq!(r["status"], "created");
    assert_eq!(record(&d, "mw").state.to_string(), "created");
    let r = c.call(&Request::Start("mw".into())).unwrap();
    assert_eq!(r["status"], "running");
    assert_eq!(record(&d, "mw").state.to_string(), "running");

    // The guest's loop counter moves while running...
    let counter = || {
        let Reply::Vm(vm) = d.daemon.handle(Request::Info("mw".into())).unwrap() else {
            panic!("info did not answer with a VM")
        };
        assert_eq!(vm.id, "mw");
        read_counter(&d)
    };
    assert!(
        wait_for(Duration::from_secs(10), || counter() > 1000),
        "memwriter never looped"
    );
    // ...and not at all while paused.
    let r = c.call(&Request::Pause("mw".into())).unwrap();
    assert_eq!(r["status"], "paused");
    assert_eq!(record(&d, "mw").state.to_string(), "paused");
    let a = counter();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counter(), a, "the guest ran while paused");
    let r = c.call(&Request::Resume("mw".into())).unwrap();
    assert_eq!(r["status"], "running");
    assert!(
        wait_for(Duration::from_secs(5), || counter() > a),
        "the guest did not run after resume"
    );

    // Wrong-state requests are conflicts.
    let e = c.call(&Request::Start("mw".into())).unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);

    let r = c.call(&Request::Stop("mw".into())).unwrap();
    assert_eq!(r["status"], "stopped (stop requested)");
    assert_eq!(record(&d, "mw").state.to_string(), "stopped (stop requested)");
    let e = c.call(&Request::Pause("mw".into())).unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);
    c.call(&Request::Delete("mw".into())).unwrap();
    assert!(d.record_files().is_empty());
    let e = c.call(&Request::Info("mw".into())).unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
}

fn read_counter(d: &TestDaemon) -> u32 {
    // The daemon is in this process: read the guest RAM the vCPU writes.
    peek(d, "mw", RESULTS_ADDR + result::LOOP_COUNTER)
}

fn peek(d: &TestDaemon, id: &str, addr: u64) -> u32 {
    d.daemon.with_vm(id, |vm| k7d_tests::read_u32(vm, addr)).unwrap()
}

#[test]
fn a_guest_that_stops_itself_is_recorded() {
    let d = TestDaemon::start("selfstop");
    let mut c = d.client();
    let cfg = json!({"id": "h", "memory_mib": 8});
    c.call_raw(&create_line(cfg, true)).unwrap().into_result().unwrap();
    assert!(wait_for(Duration::from_secs(10), || record(&d, "h").state.to_string()
        == "stopped (guest reboot)"));
    let info = c.call(&Request::Info("h".into())).unwrap();
    assert_eq!(info["status"], "stopped (guest reboot)");
    let log = info["serial_log"].as_str().unwrap();
    assert_eq!(std::fs::read_to_string(log).unwrap(), k7d_guest::HELLO_TEXT);
    c.call(&Request::Delete("h".into())).unwrap();
    assert!(!std::path::Path::new(log).exists(), "delete left the serial log behind");
}

#[test]
fn bad_input_is_refused_with_one_sentence_and_creates_nothing() {
    let d = TestDaemon::start("badinput");
    let mut c = d.client();
    c.call_raw(&create_line(
        json!({"id": "taken", "memory_mib": 8, "guest": {"kind": "builtin", "name": "idle"}}),
        true,
    ))
    .unwrap()
    .into_result()
    .unwrap();
    let cases: Vec<(String, ErrorCode, &str)> = vec![
        (
            "{this is not json".into(),
            ErrorCode::BadRequest,
            "not a valid API envelope",
        ),
        (
            r#"{"v":1,"op":"create","args":{"config":{}},"extra":true}"#.into(),
            ErrorCode::BadRequest,
            "unknown field `extra`",
        ),
        (
            create_line(json!({"memory_mib": 8, "colour": "red"}), false),
            ErrorCode::InvalidArgument,
            "unknown field `colour`",
        ),
        (
            create_line(json!({"memory_mib": 0}), false),
            ErrorCode::InvalidArgument,
            "memory_mib = 0 is out of range",
        ),
        (
            create_line(json!({"memory_mib": 1u64 << 40}), false),
            ErrorCode::InvalidArgument,
            "is out of range",
        ),
        (
            create_line(json!({"vcpus": 0}), false),
            ErrorCode::InvalidArgument,
            "vcpus = 0 is out of range",
        ),
        (
            create_line(
                json!({"guest": {"kind": "raw", "path": "/nonexistent/k7d-guest.bin"}}),
                false,
            ),
            ErrorCode::InvalidArgument,
            "/nonexistent/k7d-guest.bin cannot be used",
        ),
        (
            create_line(json!({"guest": {"kind": "builtin", "name": "doom"}}), false),
            ErrorCode::InvalidArgument,
            "unknown built-in guest `doom`",
        ),
        (
            create_line(json!({"id": "taken"}), false),
            ErrorCode::Conflict,
            "vm taken already exists",
        ),
        (
            create_line(json!({"id": "a/b"}), false),
            ErrorCode::InvalidArgument,
            "vm id `a/b` is invalid",
        ),
        (
            create_line(json!({"id": "../x"}), false),
            ErrorCode::InvalidArgument,
            "vm id `../x` is invalid",
        ),
        (
            r#"{"v":7,"op":"list"}"#.into(),
            ErrorCode::UnsupportedVersion,
            "API version 7 is not supported",
        ),
        (
            r#"{"v":1,"op":"info","args":{"id":"ghost"}}"#.into(),
            ErrorCode::NotFound,
            "vm ghost does not exist",
        ),
    ];
    for (line, code, needle) in cases {
        let resp = c.call_raw(&line).unwrap();
        assert!(!resp.ok, "{line} was accepted");
        let e = resp.error.unwrap();
        assert_eq!(e.code, code, "{line}: {}", e.message);
        assert!(e.message.contains(needle), "{line}: {:?} lacks {needle:?}", e.message);
        let two_sentences = e
            .message
            .as_bytes()
            .windows(3)
            .any(|w| w[0] == b'.' && w[1] == b' ' && w[2].is_ascii_uppercase());
        assert!(
            !two_sentences && !e.message.contains('\n'),
            "more than one sentence: {}",
            e.message
        );
    }
    // Nothing was created: one VM, one record, no new fds; and the connection still works.
    let list = c.call(&Request::List).unwrap();
    assert_eq!(list["vms"].as_array().unwrap().len(), 1);
    assert_eq!(d.record_files(), vec!["taken.json".to_string()]);
    // (fd leaks are checked in daemon_leaks.rs, alone in its process)
    let mut entries = d.state_entries();
    entries.sort();
    assert_eq!(
        entries,
        vec!["taken", "taken.json", "taken.lock"],
        "a refused create left files"
    );
    assert_eq!(c.call(&Request::Info("taken".into())).unwrap()["status"], "running");
}

#[test]
fn stale_records_are_reconciled_and_the_state_dir_is_exclusive() {
    use k7d_vmm::daemon::store::{RECORD_VERSION, RecordStore};
    let dir = k7d_tests::TempDir::new("reconcile");
    let state = dir.0.join("state");
    // Records as a daemon that died would leave them (the crash itself, with
    // a real `kill -9` of a daemon process, is covered in vmm/tests/cli.rs).
    let store = RecordStore::open(&state).unwrap();
    let dead = VmRecord {
        version: RECORD_VERSION,
        id: "orphan".into(),
        config: k7d_tests::builtin("idle", 1, 8, &[]),
        state: k7d_vmm::VmState::Running,
        devices: vec![],
        serial_log: state.join("vms/orphan/serial.log"),
        daemon_pid: 999_999_999,
        created_unix: 0,
        vm_process: None,
        parent: None,
        rng_agent: false,
    };
    store.save(&dead).unwrap();
    std::fs::write(store.runtime_dir("orphan").unwrap().join("serial.log"), b"old").unwrap();
    std::fs::write(state.join("vms/.orphan.json.tmp.1.2"), b"{").unwrap();
    let (d, reconciled) = k7d_vmm::daemon::Daemon::open(&state).unwrap();
    assert_eq!(reconciled.len(), 1);
    assert_eq!(reconciled[0].id, "orphan");
    assert_eq!(reconciled[0].state, "running");
    assert_eq!(reconciled[0].daemon_pid, Some(999_999_999));
    let left: Vec<_> = std::fs::read_dir(state.join("vms"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "reconcile left {left:?}");
    // A second daemon on the same state dir is refused while the first lives.
    let e = k7d_vmm::daemon::Daemon::open(&state)
        .err()
        .expect("a second daemon was accepted");
    assert!(
        e.to_string()
            .contains("another k7d daemon already uses the state directory"),
        "{e}"
    );
    drop(d);
    k7d_vmm::daemon::Daemon::open(&state).expect("the state dir is free again once the daemon is gone");
}

fn idle(id: &str) -> k7d_vmm::VmConfig {
    let mut cfg = k7d_tests::builtin("idle", 1, 8, &[]);
    cfg.id = Some(id.into());
    cfg
}

/// Every op through the real socket: the typed client reads each result as
/// the type its op defines, and that type carries every field the daemon
/// sent (the raw result and the typed one written back are equal).
#[test]
fn every_op_answers_with_the_type_its_op_defines() {
    use k7d_api::api::{CreateArgs, ForkArgs, PeekArgs, RestoreArgs, SnapshotArgs};
    let d = TestDaemon::start("typed");
    let mut c = d.client();
    let snap = d.dir.0.join("snap");
    let ops = [
        Request::Create(CreateArgs {
            config: idle("t"),
            start: false,
        }),
        Request::Start("t".into()),
        Request::Pause("t".into()),
        Request::Resume("t".into()),
        Request::Info("t".into()),
        Request::Snapshot(SnapshotArgs {
            id: "t".into(),
            dir: snap.clone(),
            replace: false,
        }),
        Request::Restore(RestoreArgs {
            dir: snap.clone(),
            id: Some("r".into()),
        }),
        Request::Fork(ForkArgs {
            id: "t".into(),
            count: 2,
            ..Default::default()
        }),
        Request::Rebase("t".into()),
        Request::Peek(PeekArgs {
            id: "t".into(),
            addr: RESULTS_ADDR,
            count: 3,
        }),
        Request::List,
        Request::Version,
        Request::Stop("t".into()),
        Request::Delete("t".into()),
    ];
    for req in ops {
        let raw = c.call(&req).unwrap_or_else(|e| panic!("`{}`: {e}", req.op()));
        let reply = Reply::from_result(&req, raw.clone()).unwrap_or_else(|e| panic!("`{}`: {e}: {raw}", req.op()));
        assert_eq!(
            serde_json::to_value(&reply).unwrap(),
            raw,
            "`{}` lost a field",
            req.op()
        );
        match (&req, &reply) {
            (Request::Create(_), Reply::Vm(vm)) => assert_eq!((vm.id.as_str(), vm.status.as_str()), ("t", "created")),
            (Request::Start(_) | Request::Resume(_), Reply::Vm(vm)) => assert_eq!(vm.status, "running"),
            (Request::Pause(_), Reply::Vm(vm)) => assert_eq!(vm.status, "paused"),
            (Request::Info(_), Reply::Vm(vm)) => {
                assert_eq!(vm.state, k7d_vmm::VmState::Running);
                assert!(vm.serial_log.is_some() && vm.created_unix.is_some());
            }
            (Request::Snapshot(_), Reply::Snapshot(s)) => assert_eq!(s.dir, snap),
            (Request::Restore(_), Reply::Vm(vm)) => assert_eq!((vm.id.as_str(), vm.status.as_str()), ("r", "running")),
            (Request::Fork(_), Reply::Forked(f)) => {
                let ids: Vec<&str> = f.children.iter().map(|c| c.info.id.as_str()).collect();
                assert_eq!(ids, ["t-f1", "t-f2"]);
                assert!(f.source_paused_ms >= f.pause_ms);
            }
            (Request::Rebase(_), Reply::Rebased(r)) => {
                assert_eq!(r.id, "t");
                assert!(r.base_mib > 0.0 && r.took_ms >= r.paused_ms, "{r:?}");
            }
            (Request::Peek(_), Reply::Peek(p)) => assert_eq!(p.words.len(), 3),
            (Request::List, Reply::List(l)) => {
                let ids: Vec<&str> = l.vms.iter().map(|v| v.id.as_str()).collect();
                assert_eq!(ids, ["r", "t", "t-f1", "t-f2"]);
            }
            (Request::Version, Reply::Version(v)) => assert_eq!(v.pid, std::process::id()),
            (Request::Stop(_), Reply::Vm(vm)) => assert_eq!(vm.status, "stopped (stop requested)"),
            (Request::Delete(_), Reply::Deleted(del)) => assert!(del.deleted),
            _ => panic!("`{}` answered {reply:?}", req.op()),
        }
        // `Client::request` reads the same (asked again only where asking
        // twice changes nothing).
        if matches!(req, Request::Info(_) | Request::Peek(_) | Request::Version) {
            let again = c.request(&req).unwrap();
            assert_eq!(std::mem::discriminant(&again), std::mem::discriminant(&reply));
        }
    }
}

/// A fork whose second child cannot be recorded (its record path is taken
/// by a directory): the first child, already started, is stopped and
/// removed, every child id is free again and no child file remains; the
/// source runs on.
#[test]
fn a_fork_whose_child_cannot_be_recorded_leaves_no_child() {
    use k7d_api::api::{CreateArgs, ForkArgs};
    let d = TestDaemon::start("forkfail");
    let mut c = d.client();
    c.call(&Request::Create(CreateArgs {
        config: idle("src"),
        start: true,
    }))
    .unwrap();
    let blocker = d.dir.0.join("state/vms/src-f2.json");
    std::fs::create_dir(&blocker).unwrap();
    let fork = |c: &mut k7d_api::client::Client| {
        c.call(&Request::Fork(ForkArgs {
            id: "src".into(),
            count: 2,
            ..Default::default()
        }))
    };
    let e = fork(&mut c).unwrap_err();
    assert_eq!(e.code, ErrorCode::Internal, "{}", e.message);
    assert!(e.message.contains("src-f2.json"), "{}", e.message);
    let list = c.call(&Request::List).unwrap();
    let ids: Vec<&str> = list["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["src"], "a child of the failed fork survived");
    for child in ["src-f1", "src-f2"] {
        let e = c.call(&Request::Info(child.into())).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound, "{child} is still held: {}", e.message);
    }
    let mut entries = d.state_entries();
    entries.sort();
    assert_eq!(
        entries,
        ["src", "src-f2.json", "src.json", "src.lock"],
        "the failed fork left files"
    );
    assert_eq!(c.call(&Request::Info("src".into())).unwrap()["status"], "running");
    // The ids were released: the same fork succeeds once the path is free.
    std::fs::remove_dir(&blocker).unwrap();
    let r = fork(&mut c).unwrap();
    let ids: Vec<&str> = r["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["src-f1", "src-f2"]);
}

/// A source id too long to name its tenth child: the fork is refused and
/// the nine ids reserved before the refusal are free again.
#[test]
fn a_refused_fork_releases_the_ids_it_reserved() {
    use k7d_api::api::{CreateArgs, ForkArgs};
    let d = TestDaemon::start("forklong");
    let mut c = d.client();
    let id = "s".repeat(60); // "<id>-f9" is 63 bytes, "<id>-f10" is 64
    c.call(&Request::Create(CreateArgs {
        config: idle(&id),
        start: true,
    }))
    .unwrap();
    let e = c
        .call(&Request::Fork(ForkArgs {
            id: id.clone(),
            count: 10,
            ..Default::default()
        }))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
    assert!(e.message.contains("too long to name its children"), "{}", e.message);
    let r = c
        .call(&Request::Fork(ForkArgs {
            id: id.clone(),
            count: 9,
            ..Default::default()
        }))
        .unwrap();
    assert_eq!(r["children"].as_array().unwrap().len(), 9);
    assert_eq!(r["children"][0]["id"], format!("{id}-f1"));
    assert_eq!(d.record_files().len(), 10);
}

/// `with_paused` (snapshot and fork): the VM is resumed after a failed
/// operation; when the resume fails too, the error says both; when only the
/// resume fails, that is the error.
#[test]
fn with_paused_resumes_after_a_failure_and_reports_both_errors() {
    use k7d_api::api::ApiError;
    use k7d_vmm::StopReason;
    use k7d_vmm::daemon::with_paused;
    let dir = k7d_tests::TempDir::new("withpaused");
    let cfg = k7d_tests::builtin("memwriter", 1, 16, &[4, 2097152, 0]);
    let counter = |vm: &k7d_vmm::Vm| k7d_tests::read_u32(vm, RESULTS_ADDR + result::LOOP_COUNTER);

    // The operation fails, the resume works: the operation's error, and the guest runs on.
    let vm = k7d_tests::boot("wp1", &cfg, &dir.0.join("wp1.log"));
    assert!(wait_for(Duration::from_secs(10), || counter(&vm) > 1000));
    let e = with_paused(&vm, |vm, _| -> Result<(), ApiError> {
        assert_eq!(vm.state(), k7d_vmm::VmState::Paused);
        Err(ApiError::new(ErrorCode::Internal, "the operation failed"))
    })
    .unwrap_err();
    assert_eq!(e, ApiError::new(ErrorCode::Internal, "the operation failed"));
    assert_eq!(vm.state(), k7d_vmm::VmState::Running);
    let a = counter(&vm);
    assert!(wait_for(Duration::from_secs(5), || counter(&vm) > a), "not resumed");
    drop(vm);

    // Both fail: one error naming both, with the operation's code.
    let vm = k7d_tests::boot("wp2", &cfg, &dir.0.join("wp2.log"));
    let e = with_paused(&vm, |vm, _| -> Result<(), ApiError> {
        vm.control().request_stop(StopReason::Requested);
        Err(ApiError::new(ErrorCode::Conflict, "the operation failed"))
    })
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);
    assert!(
        e.message
            .starts_with("the operation failed; resuming vm wp2 afterwards failed too: vm wp2"),
        "{}",
        e.message
    );
    drop(vm);

    // Only the resume fails: its error, not the operation's result.
    let vm = k7d_tests::boot("wp3", &cfg, &dir.0.join("wp3.log"));
    let e = with_paused(&vm, |vm, paused| {
        vm.control().request_stop(StopReason::Requested);
        Ok(paused)
    })
    .unwrap_err();
    assert!(e.message.contains("vm wp3"), "{}", e.message);
}

/// Runtime directories and lock files without a record (a daemon died
/// after making a VM's runtime directory and before writing its record, or
/// while removing them) are swept when a daemon starts; a symbolic link is
/// removed, not followed, and entries that are no VM's are left alone.
#[test]
fn runtime_files_without_a_record_are_swept_at_start() {
    let dir = k7d_tests::TempDir::new("orphans");
    let state = dir.0.join("state");
    let vms = state.join("vms");
    std::fs::create_dir_all(vms.join("ghost")).unwrap();
    std::fs::write(vms.join("ghost/serial.log"), b"old").unwrap();
    std::fs::write(vms.join("ghost.lock"), b"").unwrap();
    std::fs::write(vms.join("other.lock"), b"").unwrap();
    let outside = dir.0.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("keep"), b"keep").unwrap();
    std::os::unix::fs::symlink(&outside, vms.join("link")).unwrap();
    // Not a VM's: a name no VM id can have.
    std::fs::create_dir_all(vms.join("_not-an-id")).unwrap();
    let (d, reconciled) = k7d_vmm::daemon::Daemon::open(&state).unwrap();
    assert!(reconciled.is_empty(), "{reconciled:?}");
    let mut left: Vec<String> = std::fs::read_dir(&vms)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["_not-an-id"], "orphans were not swept");
    assert_eq!(
        std::fs::read(outside.join("keep")).unwrap(),
        b"keep",
        "a link was followed"
    );
    drop(d);
}

/// An error with its sources, as the API reports it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(&format!(": {x}"));
        src = x.source();
    }
    s
}

/// Runs `f` on a thread and waits at most 5 s for it: whether it returned.
fn returns_in_time<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5)).ok()
}

/// A FIFO put where a guest image, a kernel or a disk was (after the
/// config was validated) is refused at once: opening it never waits for a
/// writer that will not come.
#[test]
fn a_fifo_in_place_of_a_guest_file_is_refused_without_blocking() {
    use k7d_api::config::GuestSpec;
    let dir = k7d_tests::TempDir::new("fifo");
    let fifo = dir.0.join("fifo");
    k7d_sys::file::mkfifo(&fifo, 0o600).unwrap();
    let opts = k7d_vmm::VmOptions {
        serial_log: Some(dir.0.join("serial.log")),
        ..Default::default()
    };
    for guest in [
        GuestSpec::Raw {
            path: fifo.clone(),
            args: vec![],
        },
        GuestSpec::Linux {
            kernel: fifo.clone(),
            initrd: None,
            cmdline: None,
        },
    ] {
        let cfg = k7d_vmm::VmConfig {
            memory_mib: 8,
            guest: guest.clone(),
            ..Default::default()
        };
        let opts = opts.clone();
        let res = returns_in_time(move || k7d_vmm::Vm::new("fifo", &cfg, &opts).err().map(|e| chain(&e)))
            .unwrap_or_else(|| panic!("building a VM from {guest:?} blocked on the FIFO"));
        let e = res.expect("a FIFO was accepted as a guest file");
        assert!(e.contains("not a regular file"), "{e}");
    }
    let f = fifo.clone();
    let res = returns_in_time(move || {
        k7d_devices::virtio::block::DiskImage::open(&f, true)
            .err()
            .map(|e| chain(&e))
    })
    .expect("opening a FIFO as a disk blocked");
    let e = res.expect("a FIFO was accepted as a disk");
    assert!(e.contains("neither a regular file nor a block device"), "{e}");
}

/// A delete racing a create of the same id never removes the new VM's
/// files: until the old VM's record and runtime dir are gone, the id is
/// taken ("being deleted"); once the create gets it, its record stays.
#[test]
fn a_create_racing_a_delete_of_its_id_keeps_its_record() {
    use k7d_api::api::CreateArgs;
    let d = TestDaemon::start("delete-race");
    let sock = d.dir.0.join("k7d.sock");
    for round in 0..60 {
        let mut c = d.client();
        c.call(&Request::Create(CreateArgs {
            config: idle("x"),
            start: true,
        }))
        .unwrap();
        let sock2 = sock.clone();
        let creator = std::thread::spawn(move || {
            let mut c = k7d_api::client::Client::connect(&sock2).unwrap();
            for _ in 0..20_000 {
                match c.call(&Request::Create(CreateArgs {
                    config: idle("x"),
                    start: false,
                })) {
                    Ok(_) => return true,
                    Err(e) if e.code == ErrorCode::Conflict => std::thread::yield_now(),
                    Err(e) => panic!("create during a delete: {e:?}"),
                }
            }
            false
        });
        c.call(&Request::Delete("x".into())).unwrap();
        assert!(creator.join().unwrap(), "round {round}: the create never got the id");
        // The new VM's record and runtime dir are there, and it answers.
        let rec = d.dir.0.join("state/vms/x.json");
        assert!(rec.exists(), "round {round}: the delete removed the new VM's record");
        c.call(&Request::Info("x".into())).unwrap();
        c.call(&Request::Delete("x".into())).unwrap();
    }
}

/// The snapshot tree (`docs/fork.md`): every child knows its parent and
/// every source its live children; a fork past the source's budget (live
/// children, or the RAM they may commit) is refused with a sentence and
/// makes nothing; a deleted child frees its place; a source deleted with
/// live children leaves them running on the base they hold.
#[test]
fn fork_budgets_refuse_with_a_sentence_and_children_outlive_their_source() {
    use k7d_api::api::ForkArgs;
    let d = TestDaemon::start("fork-budget");
    let mut cfg = k7d_tests::builtin("memwriter", 1, 8, &[16, 0x20_0000, 1]);
    cfg.id = Some("bud".into());
    cfg.fork.max_children = Some(3);
    d.daemon
        .handle(Request::Create(k7d_api::api::CreateArgs {
            config: cfg,
            start: true,
        }))
        .unwrap();
    let fork = |id: &str, count: u32| {
        d.daemon.handle(Request::Fork(ForkArgs {
            id: id.into(),
            count,
            ..Default::default()
        }))
    };
    let info = |id: &str| {
        let Reply::Vm(i) = d.daemon.handle(Request::Info(id.into())).unwrap() else {
            panic!("info answered another type")
        };
        i
    };
    let ids = || {
        let Reply::List(l) = d.daemon.handle(Request::List).unwrap() else {
            panic!()
        };
        let mut v: Vec<String> = l.vms.into_iter().map(|v| v.id).collect();
        v.sort();
        v
    };
    fork("bud", 2).unwrap();
    assert_eq!(info("bud").children, ["bud-f1", "bud-f2"]);
    assert_eq!(info("bud-f1").parent.as_deref(), Some("bud"));
    assert_eq!(info("bud").parent, None);

    let before = ids();
    let e = fork("bud", 2).unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);
    assert_eq!(
        e.message,
        "vm bud has 2 live fork children and its budget allows 3: 2 more are refused"
    );
    assert_eq!(ids(), before, "a refused fork makes nothing");
    fork("bud", 1).unwrap();
    assert_eq!(info("bud").children, ["bud-f1", "bud-f2", "bud-f3"]);
    assert!(fork("bud", 1).is_err(), "the budget is full");

    // A deleted child frees its place; the child's own children are its
    // own tree (it inherits the budget: 3 of its own).
    d.daemon.handle(Request::Delete("bud-f2".into())).unwrap();
    assert_eq!(info("bud").children, ["bud-f1", "bud-f3"]);
    fork("bud", 1).unwrap();
    fork("bud-f1", 3).unwrap();
    assert_eq!(info("bud-f1").children.len(), 3);
    assert_eq!(info("bud-f1-f1").parent.as_deref(), Some("bud-f1"));

    // The RAM budget: 8 MiB children, 20 MiB for all of them: two fit.
    let mut cfg = k7d_tests::builtin("memwriter", 1, 8, &[16, 0x20_0000, 1]);
    cfg.id = Some("ram".into());
    cfg.fork.max_children_memory_mib = Some(20);
    d.daemon
        .handle(Request::Create(k7d_api::api::CreateArgs {
            config: cfg,
            start: true,
        }))
        .unwrap();
    fork("ram", 2).unwrap();
    let e = fork("ram", 1).unwrap_err();
    assert_eq!(
        e.message,
        "vm ram's 3 fork children would commit 24 MiB of guest RAM and its budget allows 20 MiB: 1 more is refused"
    );

    // Deleting a source with live children: they keep running on the base
    // they hold, and say whose it was; a new VM under the old id is not
    // their parent.
    let counter = |id: &str| peek(&d, id, RESULTS_ADDR + result::LOOP_COUNTER);
    d.daemon.handle(Request::Delete("bud".into())).unwrap();
    let c0 = counter("bud-f3");
    assert!(
        wait_for(Duration::from_secs(10), || counter("bud-f3") > c0),
        "a child of a deleted source runs on"
    );
    assert_eq!(info("bud-f3").status, "running");
    assert_eq!(info("bud-f3").parent.as_deref(), Some("bud (deleted)"));
    d.daemon
        .handle(Request::Create(k7d_api::api::CreateArgs {
            config: idle("bud"),
            start: false,
        }))
        .unwrap();
    assert!(info("bud").children.is_empty(), "a new VM under the id has no children");
}

/// A fork that shapes its one child (what the shim's fork-started pods
/// ask): the child takes the chosen id; a name with a count, a relative
/// socket, a taken name, a NIC attachment in a bad mode, or a socket for a
/// source without vsock is refused with a sentence and makes nothing.
#[test]
fn a_fork_names_its_one_child_and_refuses_what_does_not_fit() {
    use k7d_api::api::ForkArgs;
    use k7d_api::config::DatapathNicConfig;
    let d = TestDaemon::start("fork-named");
    let mut cfg = k7d_tests::builtin("memwriter", 1, 8, &[16, 0x20_0000, 1]);
    cfg.id = Some("tpl".into());
    d.daemon
        .handle(Request::Create(k7d_api::api::CreateArgs {
            config: cfg,
            start: true,
        }))
        .unwrap();
    let ids = || {
        let Reply::List(l) = d.daemon.handle(Request::List).unwrap() else {
            panic!()
        };
        let mut v: Vec<String> = l.vms.into_iter().map(|v| v.id).collect();
        v.sort();
        v
    };
    let Reply::Forked(f) = d
        .daemon
        .handle(Request::Fork(ForkArgs {
            id: "tpl".into(),
            name: Some("pod-a".into()),
            ..Default::default()
        }))
        .unwrap()
    else {
        panic!("fork answered another type")
    };
    assert_eq!(f.children.len(), 1);
    assert_eq!(f.children[0].info.id, "pod-a");
    assert_eq!(ids(), ["pod-a", "tpl"]);
    let before = ids();
    let nic = |mode: &str, netns: &str| DatapathNicConfig {
        mode: mode.into(),
        netns: netns.into(),
        pod_if: "eth0".into(),
        pod_uid: None,
        pod_namespace: None,
        pod_name: None,
    };
    for (args, code, want) in [
        (
            ForkArgs {
                id: "tpl".into(),
                count: 2,
                name: Some("pod-b".into()),
                ..Default::default()
            },
            ErrorCode::InvalidArgument,
            "one child at a time",
        ),
        (
            ForkArgs {
                id: "tpl".into(),
                name: Some("pod-a".into()),
                ..Default::default()
            },
            ErrorCode::Conflict,
            "vm pod-a already exists",
        ),
        (
            ForkArgs {
                id: "tpl".into(),
                vsock_uds: Some("rel/v.sock".into()),
                ..Default::default()
            },
            ErrorCode::InvalidArgument,
            "must be absolute",
        ),
        (
            ForkArgs {
                id: "tpl".into(),
                name: Some("../x".into()),
                ..Default::default()
            },
            ErrorCode::InvalidArgument,
            "../x",
        ),
        (
            ForkArgs {
                id: "tpl".into(),
                nics: vec![Some(nic("direct", "run/netns/p"))],
                ..Default::default()
            },
            ErrorCode::InvalidArgument,
            "absolute",
        ),
        (
            ForkArgs {
                id: "tpl".into(),
                name: Some("pod-c".into()),
                nics: vec![Some(nic("direct", "/run/netns/p"))],
                ..Default::default()
            },
            ErrorCode::Conflict,
            "1 NIC attachment(s) given, the source has 0 NIC(s)",
        ),
        (
            ForkArgs {
                id: "tpl".into(),
                name: Some("pod-d".into()),
                vsock_uds: Some("/run/k7d-test-nowhere.sock".into()),
                ..Default::default()
            },
            ErrorCode::Conflict,
            "the source has no vsock",
        ),
    ] {
        let e = d.daemon.handle(Request::Fork(args.clone())).unwrap_err();
        assert!(
            e.message.contains(want) && !e.message.contains('\n'),
            "{args:?}: {}",
            e.message
        );
        assert_eq!(e.code, code, "{args:?}: {}", e.message);
        assert_eq!(ids(), before, "a refused fork made something: {args:?}");
    }
}

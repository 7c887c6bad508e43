//! The VM process's jail (issue 36, `vmm/src/jail/`), entered for real by
//! `k7d jail-selftest` and inspected from outside: its own uid and gid, no
//! capabilities, `no_new_privs`, its own mount, pid, net, ipc and uts
//! namespaces, an empty root, only the descriptors it was given; and from
//! inside: pid 1, no host file, no TCP, no unix socket. The probe that
//! judges it also judges this test process and finds every shortfall, so
//! the check can fail (`jail::probe` unit test too).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

mod common;
use common::{K7D, Scratch};

/// A uid and gid no account on a CI machine has.
const JAIL_ID: u32 = 2_000_000_000 + 36;

#[test]
fn a_jailed_process_holds_nothing_of_the_host() {
    if k7d_vmm::sys::euid() != 0 {
        k7d_test_skip::skip(
            "a_jailed_process_holds_nothing_of_the_host",
            "not root: namespaces, pivot_root and setresuid need it",
        );
        return;
    }
    let dir = Scratch::new("jail");
    let root = dir.0.join("root");
    std::fs::create_dir(&root).unwrap();
    let id = JAIL_ID.to_string();
    let root_arg = root.display().to_string();
    let mut first = Command::new(K7D)
        .args(["jail-selftest", "--root", &root_arg, "--uid", &id, "--gid", &id])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run k7d jail-selftest");
    // Held until the end: `Child::wait` would close it, and the jailed
    // process stays until its stdin closes.
    let stdin = first.stdin.take();
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    let outside: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let pid = outside["jailed_pid"].as_u64().expect("the jailed pid") as u32;
    let st = first.wait().unwrap();
    assert!(st.success(), "the first process: {st}");
    let inside: serde_json::Value = serde_json::from_str(&lines.next().expect("a line from inside").unwrap()).unwrap();

    // From outside.
    let v = k7d_vmm::jail::probe::violations(pid, &[0, 1, 2]);
    assert!(v.is_empty(), "the jailed process {pid} falls short: {v:#?}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status.lines().any(|l| l.starts_with("Uid:") && l.contains(&id)),
        "{status}"
    );

    // From inside.
    assert_eq!(inside["pid"], 1, "not pid 1 of its own namespace: {inside}");
    assert_eq!(inside["uid"], JAIL_ID, "{inside}");
    assert_eq!(inside["root_entries"], 0, "{inside}");
    for (what, want) in [
        ("open_host_file", "No such file"),
        ("tcp_connect", "unreachable"),
        ("unix_connect", "No such file"),
    ] {
        let e = inside[what]
            .as_str()
            .unwrap_or_else(|| panic!("{what} succeeded from inside: {inside}"));
        assert!(e.contains(want), "{what}: {e}");
    }

    // The probe is not blind: this test process, unjailed, falls short on
    // every count the jailed one passed.
    let me = k7d_vmm::jail::probe::violations(std::process::id(), &[0, 1, 2]);
    for want in [
        "NoNewPrivs",
        "CapEff",
        "uids are 0",
        "shares the mnt",
        "shares the pid",
        "shares the net",
        "shares the ipc",
        "shares the uts",
        "root directory is not empty",
    ] {
        assert!(
            me.iter().any(|s| s.contains(want)),
            "the probe missed `{want}` on an unjailed process: {me:#?}"
        );
    }

    // Closing its stdin ends it.
    drop(stdin.map(|mut s| s.flush()));
    let t = std::time::Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists() && t.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}/status")).exists() || {
            // A zombie until init reaps it.
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| s.contains("State:\tZ"))
        }
    );
}

#[test]
fn a_jail_refuses_root_ids_and_a_root_that_is_not_empty() {
    let dir = Scratch::new("jail-bad");
    let root = dir.0.join("root");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let root_arg = root.display().to_string();
    for (args, want) in [
        (vec!["--uid", "0", "--gid", "5"], "must both be other than 0"),
        (vec!["--uid", "5", "--gid", "5"], "is not empty"),
    ] {
        let o = Command::new(K7D)
            .args(["jail-selftest", "--root", &root_arg])
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
    // Nothing was changed in the refused root.
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 1);
}

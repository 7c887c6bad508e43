//! The VM process's jail (issue 36, `vmm/src/jail/`), entered for real by
//! `k7d jail-selftest` and inspected from outside: its own uid and gid, no
//! capabilities, `no_new_privs`, its own mount, pid, net, ipc and uts
//! namespaces, an empty root, only the descriptors it was given; and from
//! inside: pid 1, no host file, no TCP, no unix socket. The probe that
//! judges it also judges this test process and finds every shortfall, so
//! the check can fail (`jail::probe` unit test too).

use std::io::{BufReader, Write};
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
    let (pid, inside) = k7d_vmm::jail::read_selftest(BufReader::new(first.stdout.take().unwrap())).unwrap();
    let st = first.wait().unwrap();
    assert!(st.success(), "the first process: {st}");

    // From outside.
    let v = k7d_vmm::jail::probe::violations(pid, |_| false);
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
    let me = k7d_vmm::jail::probe::violations(std::process::id(), |_| false);
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

/// What a jailed VM process may hold: /dev/kvm (handed over), its KVM VM
/// and vCPU fds, its guest RAM's memfd, eventfds, pipes and epoll.
fn a_vm_processs_own(target: &str) -> bool {
    target == "/dev/kvm"
        || target.starts_with("anon_inode:kvm-")
        || target.starts_with("/memfd:")
        || target.starts_with("anon_inode:[eventfd]")
        || target.starts_with("anon_inode:[eventpoll]")
        || target.starts_with("pipe:[")
}

#[test]
fn a_guest_runs_in_the_jail_holding_only_its_own_descriptors() {
    if k7d_vmm::sys::euid() != 0 {
        k7d_test_skip::skip(
            "a_guest_runs_in_the_jail_holding_only_its_own_descriptors",
            "not root: namespaces, pivot_root and setresuid need it",
        );
        return;
    }
    let dir = Scratch::new("jail-vm");
    let root = dir.0.join("root");
    std::fs::create_dir(&root).unwrap();
    let id = (JAIL_ID + 1).to_string();
    let root_arg = root.display().to_string();
    let mut first = Command::new(K7D)
        .args([
            "jail-selftest",
            "--root",
            &root_arg,
            "--uid",
            &id,
            "--gid",
            &id,
            "--guest",
            "memwriter",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run k7d jail-selftest --guest memwriter");
    let stdin = first.stdin.take();
    let (pid, inside) = k7d_vmm::jail::read_selftest(BufReader::new(first.stdout.take().unwrap())).unwrap();
    assert!(first.wait().unwrap().success());
    assert!(
        inside["guest_loop_counter"].as_u64().unwrap_or(0) > 0,
        "the guest did not run in the jail: {inside}"
    );
    assert_eq!(inside["pid"], 1, "{inside}");

    // From outside: jailed, holding only a VM's own descriptors.
    let v = k7d_vmm::jail::probe::violations(pid, a_vm_processs_own);
    assert!(v.is_empty(), "the jailed VM process {pid} falls short: {v:#?}");
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|t| t.display().to_string())
        .collect();
    for want in ["/dev/kvm", "anon_inode:kvm-vm", "anon_inode:kvm-vcpu:0"] {
        assert!(fds.iter().any(|f| f == want), "no {want} among {fds:?}");
    }
    assert!(
        fds.iter().any(|f| f.starts_with("/memfd:")),
        "no guest RAM memfd among {fds:?}"
    );
    // Its vCPU thread runs under its seccomp filter.
    let mut filtered = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let seccomp = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .map(str::trim)
            .unwrap_or("?")
            .to_string();
        filtered.push((comm.trim().to_string(), seccomp));
    }
    assert!(
        filtered.iter().any(|(c, s)| c.starts_with("vcpu") && s == "2"),
        "no vCPU thread under a seccomp filter: {filtered:?}"
    );
    // A host path among its descriptors would be a leak the probe names.
    assert!(!a_vm_processs_own("/etc/passwd") && !a_vm_processs_own("socket:[1]"));
    drop(stdin);
}

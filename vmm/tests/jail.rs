//! The VM process's jail (issue 36, `vmm/src/jail/`), entered for real by
//! `k7d jail-selftest` and inspected from outside: its own uid and gid, no
//! capabilities, `no_new_privs`, its own mount, pid, net, ipc and uts
//! namespaces, an empty root, only the descriptors it was given; and from
//! inside: pid 1, no host file, no TCP, no unix socket. The probe that
//! judges it also judges this test process and finds every shortfall, so
//! the check can fail (`jail::probe` unit test too).

use std::io::{BufReader, Write};
use std::process::{ChildStdin, Command, Stdio};

mod common;
use common::{K7D, Scratch, a_vm_processs_own, jail_root, root_or_skip};

/// A uid and gid no account on a CI machine has.
const JAIL_ID: u32 = 2_000_000_000 + 36;

/// `k7d jail-selftest` in a fresh root as `id` (with `--guest` when one is
/// named), once its first process has exited: the jailed process's host
/// pid, its report from inside, and its stdin (it stays until that closes).
fn selftest(dir: &Scratch, id: u32, guest: Option<&str>) -> (u32, serde_json::Value, Option<ChildStdin>) {
    let root = jail_root(dir, "root");
    let id = id.to_string();
    let mut cmd = Command::new(K7D);
    cmd.arg("jail-selftest")
        .arg("--root")
        .arg(&root)
        .args(["--uid", &id, "--gid", &id]);
    if let Some(g) = guest {
        cmd.args(["--guest", g]);
    }
    let mut first = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run k7d jail-selftest");
    // Taken before the wait: `Child::wait` would close it.
    let stdin = first.stdin.take();
    let (pid, inside) = k7d_vmm::jail::read_selftest(BufReader::new(first.stdout.take().unwrap())).unwrap();
    let st = first.wait().unwrap();
    assert!(st.success(), "the first process: {st}");
    (pid, inside, stdin)
}

#[test]
fn a_jailed_process_holds_nothing_of_the_host() {
    if !root_or_skip("a_jailed_process_holds_nothing_of_the_host") {
        return;
    }
    let dir = Scratch::new("jail");
    let (pid, inside, stdin) = selftest(&dir, JAIL_ID, None);
    let id = JAIL_ID.to_string();

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

#[test]
fn a_guest_runs_in_the_jail_holding_only_its_own_descriptors() {
    if !root_or_skip("a_guest_runs_in_the_jail_holding_only_its_own_descriptors") {
        return;
    }
    let dir = Scratch::new("jail-vm");
    let (pid, inside, stdin) = selftest(&dir, JAIL_ID + 1, Some("memwriter"));
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

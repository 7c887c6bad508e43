//! The `k7d` binary as users run it: `demo`, `run`, `check`, and the daemon with the
//! CLI verbs, including a real crash (`kill -9`) of the daemon and the
//! reconcile on the next start.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{K7D, Scratch, cached_cloud_kernel, text};

fn k7d(args: &[&str]) -> Output {
    Command::new(K7D)
        .args(args)
        .env_remove("K7D_SOCKET")
        .output()
        .expect("run k7d")
}

#[test]
fn run_boots_the_embedded_guest() {
    let o = k7d(&["run"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout {out:?} stderr {err:?}");
    assert_eq!(out, "Hello from the k7d test guest!\n");
    assert!(err.contains("stopped (guest reboot)"), "{err}");
    assert!(err.contains("first guest exit"), "{err}");
    // The lab's boot waterfall reads k7d's own start-up cost from this line.
    let vcpus_at: f64 = err
        .split("vCPUs started ")
        .nth(1)
        .and_then(|r| r.split(" ms after k7d's start").next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no \"vCPUs started N ms after k7d's start\": {err}"));
    assert!(vcpus_at > 0.0 && vcpus_at < 60_000.0, "{err}");
}

/// The README's first command: a cluster of embedded guests forked as a
/// cluster, every child proven equal to its source, timings beside the floor.
#[test]
fn demo_forks_a_cluster_and_proves_every_child() {
    let o = k7d(&["demo", "--forks", "2", "--memory-mib", "16"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout {out:?} stderr {err:?}");
    assert!(out.contains("3 memwriter guests running"), "{out}");
    let proven = out
        .lines()
        .filter(|l| l.starts_with("fork ") && l.contains("every page of every child equals its member"))
        .count();
    assert_eq!(proven, 2, "{out}");
    assert!(out.contains("x the floor"), "{out}");

    let o = k7d(&["--json", "demo", "--members", "2", "--forks", "1", "--memory-mib", "16"]);
    let (out, err) = text(&o);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    assert_eq!(v["differing_pages"], 0);
    assert_eq!(v["forks"][0]["pages"], 2 * 16 * 256);
    assert_eq!(v["forks"][0]["children_ms"].as_array().unwrap().len(), 2);
    assert!(v["floor_ms"].as_f64().unwrap() > 0.0);

    let o = k7d(&["demo", "--members", "9"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("1 to 8 members"), "{err}");
}

#[test]
fn run_json_reports_serial_and_timings() {
    let o = k7d(&["run", "--json", "--builtin", "smp", "--vcpus", "2", "--timeout", "0.3"]);
    let (out, err) = text(&o);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    assert_eq!(o.status.code(), Some(2), "a timeout exits 2");
    assert_eq!(v["timed_out"], true);
    let serial = v["serial"].as_str().unwrap();
    assert!(
        serial.contains("smp: AP up") && serial.contains("smp: 2 vCPUs up"),
        "{serial}"
    );
    assert!(v["first_exit_after_start_ms"].as_f64().unwrap() > 0.0);
}

#[test]
fn an_unrecoverable_exit_is_a_clear_error_naming_vm_vcpu_and_exit() {
    // The `fault` guest enters protected mode and irets: PVM's emulator
    // cannot (KVM_EXIT_INTERNAL_ERROR); VMX/SVM run it into a triple fault
    // (KVM_EXIT_SHUTDOWN). Either way the VM stops with a vCPU error.
    let o = k7d(&["run", "--builtin", "fault", "--timeout", "20"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let named = err.contains("vcpu 0: KVM_EXIT_INTERNAL_ERROR") || err.contains("vcpu 0: KVM_EXIT_SHUTDOWN");
    assert!(named, "{err}");
    assert!(err.contains("stopped (vm run-"), "{err}");
}

#[test]
fn bad_kernel_path_is_one_sentence_naming_the_file() {
    let o = k7d(&["run", "--raw", "/nonexistent/guest.bin"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/guest.bin cannot be used"), "{err}");
}

#[test]
fn check_names_this_hosts_virtualization() {
    let o = k7d(&["check"]);
    let (out, _) = text(&o);
    let expect = if Path::new("/sys/module/kvm_pvm").exists() {
        "PVM (kvm-pvm"
    } else if std::fs::read_to_string("/proc/cpuinfo").unwrap().contains(" vmx") {
        "VMX"
    } else {
        "SVM"
    };
    let line = out
        .lines()
        .find(|l| l.contains("virtualization"))
        .expect("virtualization line");
    assert!(line.contains(expect), "{line}");
    if expect.starts_with("PVM") {
        assert!(line.contains("stock Linux guests do not boot"), "{line}");
    }
    for item in [
        "kvm",
        "dirty-log",
        "pit2",
        "tsc-deadline",
        "tun",
        "vhost-net",
        "vhost-vsock",
        "bpf",
        "memfd",
        "cgroup-v2",
        "jail",
    ] {
        assert!(
            out.lines().any(|l| l.split_whitespace().nth(1) == Some(item)),
            "no {item} line in {out}"
        );
    }
    // As root the jail is entered for real (`vmm/tests/jail.rs` proves it in detail).
    let jail = out
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("jail"))
        .unwrap();
    if k7d_vmm::sys::euid() == 0 {
        assert!(jail.starts_with("ok"), "{jail}");
    }
    assert!(o.status.success(), "this host has everything required: {out}");
}

struct DaemonProc {
    child: Child,
}

impl DaemonProc {
    fn start(dir: &Path) -> (Self, String) {
        let child = common::start_daemon(Path::new(K7D), dir, &["--jail", "off"], false);
        // Reconcile messages are printed before the socket appears.
        let err = String::new();
        (Self { child }, err)
    }

    fn stderr_after_exit(mut self) -> String {
        use std::io::Read;
        let _ = self.child.wait();
        let mut s = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

/// A failed test never leaves its daemon (and its VMs) running.
impl Drop for DaemonProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn cli(dir: &Path, args: &[&str]) -> Output {
    Command::new(K7D)
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(args)
        .output()
        .unwrap()
}

/// `k7d cluster ...` and `k7d fork <cluster>` as a user types them.
#[test]
fn cluster_verbs_through_the_cli() {
    let dir = Scratch::new("cli-cluster");
    let (_d, _) = DaemonProc::start(&dir.0);
    for id in ["a", "b"] {
        let o = cli(
            &dir.0,
            &["create", "--id", id, "--builtin", "idle", "--memory", "8", "--start"],
        );
        assert!(o.status.success(), "{:?}", text(&o));
    }
    let o = cli(&dir.0, &["cluster", "create", "lab", "a", "b"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    assert!(out.starts_with("cluster lab: 2 members"), "{out}");
    let o = cli(&dir.0, &["fork", "lab", "--count", "2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    for line in ["cluster lab-f1", "cluster lab-f2", "vm b-f2: running"] {
        assert!(out.lines().any(|l| l.starts_with(line)), "{line}: {out}");
    }
    let o = cli(&dir.0, &["cluster", "list"]);
    let (out, _) = text(&o);
    assert!(
        out.lines().any(|l| l.starts_with("lab-f2") && l.ends_with("a-f2 b-f2")),
        "{out}"
    );
    let o = cli(&dir.0, &["cluster", "delete", "lab-f1"]);
    assert_eq!(text(&o).0.trim(), "lab-f1 deleted");
    let o = cli(&dir.0, &["info", "a-f1"]);
    assert_eq!(o.status.code(), Some(1), "its members went with it");
    let o = cli(&dir.0, &["cluster", "create", "a", "b"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o).1.trim(), "k7d: a is a vm; a cluster needs an id of its own");
    let o = cli(&dir.0, &["cluster", "create", "x"]);
    assert!(!o.status.success(), "a cluster needs members");
}

#[test]
fn daemon_verbs_and_crash_reconcile() {
    let dir = Scratch::new("cli-daemon");
    let (d, _) = DaemonProc::start(&dir.0);
    let o = cli(
        &dir.0,
        &[
            "--json",
            "create",
            "--id",
            "web",
            "--builtin",
            "idle",
            "--memory",
            "8",
            "--start",
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "running");
    let o = cli(&dir.0, &["list"]);
    let (out, _) = text(&o);
    assert!(
        out.lines().any(|l| l.starts_with("web") && l.ends_with("running")),
        "{out}"
    );
    // The daemon's own version, through the API (not the CLI's --version).
    let o = cli(&dir.0, &["version"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    assert!(
        out.starts_with(&format!("k7d daemon {} (API version ", env!("CARGO_PKG_VERSION"))),
        "{out}"
    );
    assert!(!out.contains("VM processes ready"), "a --jail off daemon: {out}");
    let o = cli(&dir.0, &["pause", "web"]);
    assert!(text(&o).0.contains("vm web: paused"), "{:?}", text(&o));
    let o = cli(&dir.0, &["info", "web"]);
    let (out, _) = text(&o);
    assert!(out.contains("device serial: ttyS0 port 0x3f8 irq 4"), "{out}");
    // An unknown VM: exit 1 and one sentence.
    let o = cli(&dir.0, &["info", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o).1.trim(), "k7d: vm nope does not exist");

    // Crash the daemon for real: its VM dies with it, the record stays.
    let pid = d.child.id();
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = d.stderr_after_exit();
    assert!(dir.0.join("state/vms/web.json").exists());

    let (d2, _) = DaemonProc::start(&dir.0);
    assert!(
        !dir.0.join("state/vms/web.json").exists(),
        "the stale record was not reconciled"
    );
    let o = cli(&dir.0, &["--json", "list"]);
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).unwrap();
    assert!(v["vms"].as_array().unwrap().is_empty());
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d2.child.id() as i32, libc::SIGTERM) };
    let err = d2.stderr_after_exit();
    assert!(err.contains("reconciled vm web (paused, daemon pid"), "{err}");
    assert!(!dir.0.join("k7d.sock").exists(), "the socket outlived the daemon");
}

/// A daemon killed while a VM's NIC is in a pod network leaves what
/// outlives a process on purpose: the datapath's pins under the bpffs root
/// (a pinned TCX link keeps its program on the pod's interface). The next
/// daemon detaches them, by the record, before it builds anything, says
/// so, and leaves the pod's netns and interface as they were.
#[test]
fn a_crashed_daemons_pod_network_is_detached_at_the_next_start() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        k7d_test_skip::skip(
            "a_crashed_daemons_pod_network_is_detached_at_the_next_start",
            "taps, network namespaces and bpffs need root",
        );
        return;
    }
    // Virtio devices need a Linux guest; it is only created here (it could
    // not run on a PVM host), which builds its NIC's datapath.
    let Some(kernel) = cached_cloud_kernel() else {
        k7d_test_skip::skip(
            "a_crashed_daemons_pod_network_is_detached_at_the_next_start",
            "no Debian cloud kernel in the lab cache (tests/lab/run.sh --fetch puts it there; .ci/run does)",
        );
        return;
    };
    let ip = |args: &[&str]| Command::new("ip").args(args).output().unwrap();
    let ns = format!("k7dcrash{}", std::process::id());
    let peer = format!("crp{}", std::process::id() % 100_000);
    let _ = ip(&["netns", "del", &ns]);
    assert!(ip(&["netns", "add", &ns]).status.success());
    struct DelNs(String);
    impl Drop for DelNs {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
        }
    }
    let _del = DelNs(ns.clone());
    let o = ip(&[
        "link", "add", &peer, "type", "veth", "peer", "name", "eth0", "netns", &ns,
    ]);
    assert!(o.status.success(), "{}", text(&o).1);

    let dir = Scratch::new("cli-crashnet");
    let id = format!("crashnet-{}", std::process::id());
    let (d, _) = DaemonProc::start(&dir.0);
    let nic = format!("datapath=direct,netns=/run/netns/{ns},pod-if=eth0");
    let o = cli(
        &dir.0,
        &[
            "create",
            "--id",
            &id,
            "--kernel",
            kernel.to_str().unwrap(),
            "--memory",
            "128",
            "--nic",
            &nic,
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let names = k7d_net::nic_names(&id, 0);
    let pins = std::path::Path::new("/sys/fs/bpf/k7d").join(&names.bpf_subdir);
    assert!(pins.is_dir(), "no pins at {}", pins.display());
    let tap_in_pod = || ip(&["-n", &ns, "link", "show", &names.tap]).status.success();
    assert!(tap_in_pod(), "the tap is in the pod netns");

    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGKILL) };
    let _ = d.stderr_after_exit();
    assert!(pins.is_dir(), "the pins outlive the daemon (what this test is about)");

    let (d2, _) = DaemonProc::start(&dir.0);
    assert!(!pins.exists(), "the next daemon left the pins at {}", pins.display());
    assert!(!tap_in_pod(), "a tap is left in the pod netns");
    assert!(
        ip(&["-n", &ns, "link", "show", "eth0"]).status.success(),
        "the pod's own interface is the CNI's: it stays"
    );
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d2.child.id() as i32, libc::SIGTERM) };
    let err = d2.stderr_after_exit();
    assert!(
        err.contains(&format!("reconciled vm {id} (created, daemon pid")),
        "{err}"
    );
    assert!(
        err.contains(&format!("reconciled vm {id}: datapath of 1 NIC(s) detached\n")),
        "{err}"
    );
}

/// `k7d pool-drain` and `k7d template-remove` (what a node runs before it
/// changes a shim config): an empty pool drains to nothing without asking
/// the daemon; a template cannot be removed while the daemon is gone, and
/// says so in one sentence; a missing config is one sentence too.
#[test]
fn pool_drain_and_template_remove_answer_in_one_line() {
    let dir = Scratch::new("cli-drain");
    let config = dir.0.join("shim.toml");
    std::fs::write(
        &config,
        format!(
            "kernel = \"/k\"\ninitramfs = \"/i\"\nstate_dir = \"{}\"\ndaemon_socket = \"{}\"\npool_size = 1\n",
            dir.0.join("state").display(),
            dir.0.join("no-daemon.sock").display()
        ),
    )
    .unwrap();
    let c = config.to_str().unwrap();
    let o = k7d(&["pool-drain", "--config", c]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    assert!(
        out.starts_with("warm pool pool-") && out.trim_end().ends_with(": 0 member(s) removed, 0 still booting"),
        "{out}"
    );
    let o = k7d(&["--json", "pool-drain", "--config", c]);
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).unwrap();
    assert_eq!((v["removed"].as_u64(), v["booting"].as_u64()), (Some(0), Some(0)));
    let o = k7d(&["template-remove", "--config", c]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o).1;
    assert_eq!(err.lines().filter(|l| l.starts_with("k7d: ")).count(), 1, "{err}");
    assert!(err.contains("the k7d daemon is not running"), "{err}");
    let o = k7d(&["template-remove", "--config", dir.0.join("none.toml").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("cannot read the shim config"), "{:?}", text(&o));
}

#[test]
fn a_non_kernel_file_is_refused_before_any_vcpu_runs() {
    let dir = Scratch::new("cli-badkernel");
    let junk = dir.0.join("not-a-kernel");
    std::fs::write(&junk, vec![0x42u8; 8192]).unwrap();
    let o = k7d(&[
        "run",
        "--kernel",
        junk.to_str().unwrap(),
        "--vcpus",
        "2",
        "--memory",
        "128",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("kernel {} is not a bzImage or ELF kernel", junk.display())),
        "{err}"
    );
    assert!(!err.contains("first guest exit"), "a vCPU ran: {err}");
}

fn peek(dir: &Path, id: &str, addr: u64) -> u32 {
    let o = cli(dir, &["peek", id, &format!("{addr:#x}")]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "peek failed: {err}");
    out.trim()
        .parse()
        .unwrap_or_else(|e| panic!("peek printed {out:?}: {e}"))
}

#[test]
fn snapshot_then_restore_in_a_new_daemon_resumes_the_guest() {
    use std::os::unix::fs::FileExt;
    const TICKS: u64 = 0x600; // k7d_guest::RESULTS_ADDR + result::BSP_TICKS
    let dir = Scratch::new("cli-snap");
    let snap = dir.0.join("snap");
    let (d, _) = DaemonProc::start(&dir.0);
    let o = cli(
        &dir.0,
        &[
            "create",
            "--id",
            "t",
            "--builtin",
            "tscdeadline",
            "--memory",
            "8",
            "--start",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let t0 = Instant::now();
    while peek(&dir.0, "t", TICKS) < 200 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the guest never ticked");
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = cli(&dir.0, &["snapshot", "t", snap.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    assert!(out.contains("snapshot written to"), "{out}");
    // The source keeps running after its snapshot.
    let after = peek(&dir.0, "t", TICKS);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        peek(&dir.0, "t", TICKS) > after,
        "the source did not resume after the snapshot"
    );
    // The tick count the snapshot froze, read from the memory file itself.
    let mut b = [0u8; 4];
    std::fs::File::open(snap.join("memory"))
        .unwrap()
        .read_exact_at(&mut b, TICKS)
        .unwrap();
    let frozen = u32::from_le_bytes(b);
    assert!(frozen >= 200, "{frozen}");
    // A second snapshot to the same place is refused and leaves the first
    // one as it was; with --replace it replaces it as a whole.
    let o = cli(&dir.0, &["snapshot", "t", snap.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(
        !o.status.success(),
        "a second snapshot over the first was accepted: {out}"
    );
    assert!(err.contains("exists"), "{err}");
    let mut again = [0u8; 4];
    std::fs::File::open(snap.join("memory"))
        .unwrap()
        .read_exact_at(&mut again, TICKS)
        .unwrap();
    assert_eq!(
        u32::from_le_bytes(again),
        frozen,
        "the refused snapshot changed the first one"
    );
    let o = cli(&dir.0, &["snapshot", "t", snap.to_str().unwrap(), "--replace"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "--replace: {out} {err}");
    std::fs::File::open(snap.join("memory"))
        .unwrap()
        .read_exact_at(&mut b, TICKS)
        .unwrap();
    let frozen = u32::from_le_bytes(b);
    assert!(
        frozen > u32::from_le_bytes(again),
        "--replace kept the old snapshot ({frozen} ticks)"
    );

    // A new daemon process restores it: the guest goes on from `frozen`.
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let _ = d.stderr_after_exit();
    let (d2, _) = DaemonProc::start(&dir.0);
    let o = cli(&dir.0, &["--json", "restore", snap.to_str().unwrap(), "--id", "t2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "running");
    let first = peek(&dir.0, "t2", TICKS);
    assert!(
        first >= frozen,
        "the restored guest started from {first}, below the snapshot's {frozen}"
    );
    assert!(
        first < frozen + 2000,
        "the restored guest jumped from {frozen} to {first}"
    );
    std::thread::sleep(Duration::from_millis(300));
    let later = peek(&dir.0, "t2", TICKS);
    assert!(
        later > first + 100,
        "the restored guest is not ticking: {first} -> {later}"
    );
    // A directory that is not a snapshot is one clear sentence, and creates nothing.
    let o = cli(&dir.0, &["restore", dir.0.to_str().unwrap(), "--id", "bad"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("state.json"), "{:?}", text(&o));
    assert!(!dir.0.join("state/vms/bad.json").exists());
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d2.child.id() as i32, libc::SIGTERM) };
    let _ = d2.stderr_after_exit();
}

#[test]
fn fork_makes_running_children_that_continue_from_the_source() {
    const TICKS: u64 = 0x600; // k7d_guest::RESULTS_ADDR + result::BSP_TICKS
    let dir = Scratch::new("cli-fork");
    let (d, _) = DaemonProc::start(&dir.0);
    let o = cli(
        &dir.0,
        &[
            "create",
            "--id",
            "s",
            "--builtin",
            "tscdeadline",
            "--memory",
            "8",
            "--start",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let t0 = Instant::now();
    while peek(&dir.0, "s", TICKS) < 200 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the guest never ticked");
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = cli(&dir.0, &["--json", "fork", "s", "--count", "3"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let children: Vec<String> = v["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(children, vec!["s-f1", "s-f2", "s-f3"]);
    for c in &children {
        assert!(dir.0.join(format!("state/vms/{c}.json")).exists(), "no record for {c}");
        let a = peek(&dir.0, c, TICKS);
        assert!(a >= 200, "{c} started from {a}, not from the source's count");
        std::thread::sleep(Duration::from_millis(100));
        assert!(peek(&dir.0, c, TICKS) > a, "{c} is not ticking");
    }
    let a = peek(&dir.0, "s", TICKS);
    std::thread::sleep(Duration::from_millis(100));
    assert!(peek(&dir.0, "s", TICKS) > a, "the source did not resume");
    // A new base for the source, by the CLI; it ticks on.
    let o = cli(&dir.0, &["rebase", "s"]);
    let (out, err) = text(&o);
    assert!(o.status.success() && out.starts_with("re-based s: "), "{out} {err}");
    let a = peek(&dir.0, "s", TICKS);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        peek(&dir.0, "s", TICKS) > a,
        "the source did not resume after its re-base"
    );
    // A VM that asks for shells: the daemon makes them, and its forks'
    // children are built in them and tick on from the source's count.
    let o = cli(
        &dir.0,
        &[
            "create",
            "--id",
            "w",
            "--builtin",
            "tscdeadline",
            "--memory",
            "8",
            "--fork-shells",
            "2",
            "--start",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let t0 = Instant::now();
    loop {
        let (out, _) = text(&cli(&dir.0, &["info", "w"]));
        if out.contains("shells ready for its fork children: 2 of 2") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the daemon made no shells for w: {out}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    while peek(&dir.0, "w", TICKS) < 200 {
        assert!(t0.elapsed() < Duration::from_secs(20), "w never ticked");
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = cli(&dir.0, &["fork", "w", "--count", "2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out} {err}");
    assert_eq!(out.matches(", in a shell made ahead)").count(), 2, "{out}");
    for c in ["w-f1", "w-f2"] {
        let a = peek(&dir.0, c, TICKS);
        assert!(a >= 200, "{c} started from {a}, not from the source's count");
        std::thread::sleep(Duration::from_millis(100));
        assert!(peek(&dir.0, c, TICKS) > a, "{c}, built in a shell, is not ticking");
        assert!(cli(&dir.0, &["delete", c]).status.success());
    }
    assert!(cli(&dir.0, &["delete", "w"]).status.success());
    let o = cli(
        &dir.0,
        &["create", "--builtin", "idle", "--memory", "8", "--fork-shells", "65"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("shells = 65 is out of range"), "{:?}", text(&o));
    // Bad counts are one sentence and create nothing.
    let o = cli(&dir.0, &["fork", "s", "--count", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("count = 0 is out of range"), "{:?}", text(&o));
    for c in &children {
        assert!(cli(&dir.0, &["delete", c]).status.success());
    }
    assert!(!dir.0.join("state/vms/s-f1.json").exists());
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let _ = d.stderr_after_exit();
}

/// The text the CLI prints comes from the op's result type: `list`'s numbers
/// sit in their columns under the header (they were printed as JSON values,
/// which ignore widths), and a snapshot path that JSON cannot carry (not
/// UTF-8) is one sentence and exit 1, not a panic.
#[test]
fn list_columns_line_up_and_a_non_utf8_path_is_one_sentence() {
    use std::os::unix::ffi::OsStrExt;
    let dir = Scratch::new("cli-typed");
    let (d, _) = DaemonProc::start(&dir.0);
    let o = cli(
        &dir.0,
        &[
            "create",
            "--id",
            "w",
            "--builtin",
            "idle",
            "--memory",
            "8",
            "--vcpus",
            "2",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let o = cli(&dir.0, &["list"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let mut lines = out.lines();
    let header = lines.next().unwrap();
    let row = lines.next().unwrap();
    let end = |l: &str, what: &str| {
        l.find(what)
            .map(|i| i + what.len())
            .unwrap_or_else(|| panic!("{what} in {l:?}"))
    };
    assert_eq!(
        end(row, " 8 "),
        end(header, "MEM(MiB) "),
        "memory is not under its header:\n{out}"
    );
    assert_eq!(
        row.find("2 "),
        header.find("VCPUS"),
        "vcpus are not under their header:\n{out}"
    );
    assert_eq!(row.find("builtin:idle"), header.find("GUEST"), "{out}");

    let bad = dir.0.join(std::ffi::OsStr::from_bytes(b"snap-\xff"));
    let o = Command::new(K7D)
        .arg("--socket")
        .arg(dir.0.join("k7d.sock"))
        .arg("snapshot")
        .arg("w")
        .arg(&bad)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cannot be written as JSON"), "{err}");
    assert!(!bad.exists());
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let _ = d.stderr_after_exit();
}

/// `k7d info x | grep -q ...`: a reader that goes away ends the CLI quietly
/// (exit 0, nothing on stderr), where `println!` used to panic.
#[test]
fn a_reader_that_goes_away_ends_the_cli_quietly() {
    let mut child = Command::new(K7D)
        .arg("check")
        .env_remove("K7D_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run k7d");
    // The read end closes before k7d writes its first line.
    drop(child.stdout.take());
    let o = child.wait_with_output().expect("wait for k7d");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(o.status.success(), "{:?}: {err}", o.status);
}

/// `k7d run` (confined by its seccomp filter) unpacks Debian's LZ4 bzImage
/// once into `--kernel-cache`, loads the ELF kernel, and uses the cached
/// copy on the next run; `--no-kernel-cache` boots the bzImage as it is.
/// (The guest cannot run on a PVM host; what is checked is what k7d does
/// before it runs.)
#[test]
fn run_unpacks_an_lz4_kernel_once_into_its_cache() {
    use std::os::unix::fs::MetadataExt;
    let Some(kernel) = cached_cloud_kernel() else {
        k7d_test_skip::skip(
            "run_unpacks_an_lz4_kernel_once_into_its_cache",
            "no Debian cloud kernel in the lab cache (tests/lab/run.sh --fetch puts it there; .ci/run does)",
        );
        return;
    };
    let dir = Scratch::new("kcache");
    let cache = dir.0.join("kernels");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--memory",
            "256",
            "--timeout",
            "0.3",
            "--quiet",
            "--kernel-cache",
            cache.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = k7d(&args);
        text(&o).1
    };
    let entries = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&cache)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let err = run(&["--no-kernel-cache"]);
    assert!(err.contains("k7d: Linux loaded (bzImage"), "{err}");
    assert!(!cache.exists(), "--no-kernel-cache created {}", cache.display());

    let err = run(&[]);
    assert!(err.contains("k7d: Linux loaded (ELF kernel"), "{err}");
    let first = entries();
    assert_eq!(first.len(), 1, "{first:?}");
    let elf = std::fs::read(&first[0]).unwrap();
    assert!(elf.starts_with(b"\x7fELF"), "the cache entry is not an ELF kernel");
    let ino = std::fs::metadata(&first[0]).unwrap().ino();

    let err = run(&[]);
    assert!(err.contains("k7d: Linux loaded (ELF kernel"), "{err}");
    assert_eq!(entries(), first);
    assert_eq!(
        std::fs::metadata(&first[0]).unwrap().ino(),
        ino,
        "the cached kernel was written again"
    );
}

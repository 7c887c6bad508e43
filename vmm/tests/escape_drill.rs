//! The escape drill (issue 36): a guest that has turned a device model's
//! bug into arbitrary reads of its VMM process (`vmm/src/drill.rs`, only in
//! a k7d built with the test-only `escape-drill` feature, which
//! `tests/run-all.sh` builds and names in `K7D_DRILL_BIN`), next to a
//! victim VM whose RAM it wants.
//!
//! In a VM process (`--jail on`) the attacker reads its own RAM through the
//! VMM but the victim's RAM is not mapped there at all, a TCP connection to
//! the host's loopback fails (its own network namespace) and opening a
//! host file stops the VM (its vCPU's seccomp filter). Inside the daemon
//! (`--jail off`) the same drill reads the victim's RAM and reaches the
//! host's loopback: the drill can fail.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use k7d_guest::drill as d;
use k7d_guest::result;

mod common;
use common::{Scratch, root_or_skip, text};

/// Where the victim's pattern is (page 0 of `memwriter`'s area).
const VICTIM_AREA: u64 = 0x20_0000;

fn drill_bin(test: &str) -> Option<PathBuf> {
    if !root_or_skip(test) {
        return None;
    }
    match std::env::var_os("K7D_DRILL_BIN") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            k7d_test_skip::skip(
                test,
                "K7D_DRILL_BIN is not set: no k7d built with the test-only escape-drill feature (tests/run-all.sh builds one)",
            );
            None
        }
    }
}

struct Daemon {
    child: Child,
    bin: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    fn start(bin: &Path, dir: &Path, jail: bool) -> Self {
        let jail = if jail { "on" } else { "off" };
        let child = common::start_daemon(
            bin,
            dir,
            &["--jail", jail, "--jail-cgroup", "off", "--jail-id-base", "2000000300"],
            true,
        );
        Self {
            child,
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
        }
    }

    fn cli(&self, args: &[&str]) -> Output {
        Command::new(&self.bin)
            .arg("--socket")
            .arg(self.dir.join("k7d.sock"))
            .args(args)
            .output()
            .unwrap()
    }

    fn info(&self, id: &str) -> serde_json::Value {
        let o = self.cli(&["--json", "info", id]);
        assert!(o.status.success(), "info {id}: {:?}", text(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// The process that holds VM `id`'s RAM: its VM process, or the daemon.
    fn holder(&self, id: &str) -> u32 {
        self.info(id)["vm_process"]["pid"]
            .as_u64()
            .map_or(self.child.id(), |p| p as u32)
    }

    fn create(&self, id: &str, builtin: &str, args: &[&str]) {
        let mut a = vec!["create", "--id", id, "--builtin", builtin, "--memory", "16", "--start"];
        for x in args {
            a.extend(["--arg", x]);
        }
        let o = self.cli(&a);
        assert!(o.status.success(), "create {id}: {:?}", text(&o));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        for id in ["victim", "attacker", "crasher"] {
            let _ = self.cli(&["delete", id]);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        common::kill_vm_processes_under(&self.dir);
    }
}

/// Runs drill command `cmd` with `addr` in the attacker (held by process
/// `pid`): the parameters written into its RAM, the answer read back.
fn command(pid: u32, cmd: u32, addr: u64) -> (u32, [u8; 16]) {
    let at = |off: u64| k7d_guest::RESULTS_ADDR + off;
    let done = common::read_guest_u32(pid, "attacker", at(result::DRILL_DONE));
    common::write_guest_u32(
        pid,
        "attacker",
        k7d_guest::PARAMS_ADDR + k7d_guest::param::ARG0,
        addr as u32,
    );
    common::write_guest_u32(
        pid,
        "attacker",
        k7d_guest::PARAMS_ADDR + k7d_guest::param::ARG1,
        (addr >> 32) as u32,
    );
    common::write_guest_u32(pid, "attacker", k7d_guest::PARAMS_ADDR + k7d_guest::param::ARG2, cmd);
    let t = Instant::now();
    while common::read_guest_u32(pid, "attacker", at(result::DRILL_DONE)) == done {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the drill did not answer command {cmd}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let word = |i: u64| common::read_guest_u32(pid, "attacker", at(result::DRILL_ANSWER) + 4 * i);
    let mut data = [0u8; 16];
    for i in 0..4 {
        data[i * 4..i * 4 + 4].copy_from_slice(&word(1 + i as u64).to_le_bytes());
    }
    (word(0), data)
}

/// What the drill reached.
#[derive(Debug)]
struct Reached {
    own_ram: bool,
    victims_ram: bool,
    host_loopback: bool,
    open_stopped_the_vm: bool,
}

fn drill(bin: &Path, jail: bool) -> Reached {
    let scratch = Scratch::new(if jail { "drill-jail" } else { "drill-nojail" });
    let daemon = Daemon::start(bin, &scratch.0, jail);
    daemon.create("victim", "memwriter", &["4", &VICTIM_AREA.to_string(), "0"]);
    daemon.create("attacker", "drill", &[]);
    let (victim, attacker) = (daemon.holder("victim"), daemon.holder("attacker"));
    assert_eq!(victim == attacker, !jail, "where the two VMs run");
    let t = Instant::now();
    while common::read_guest_u32(victim, "victim", k7d_guest::RESULTS_ADDR + result::PATTERN_DONE) != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the victim did not write its pattern"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pattern: Vec<u8> = k7d_guest::memwriter_pattern(0).to_le_bytes().repeat(4);

    // Its own program, read through its own VMM process's mapping.
    let own = common::host_addr_of(attacker, "attacker", k7d_guest::LOAD_ADDR).unwrap();
    let (status, data) = command(attacker, d::CMD_READ, own);
    let own_ram = status == d::DONE && data[..] == k7d_guest::Builtin::Drill.image()[..16];
    // The victim's pattern, at the address where the victim's RAM is mapped
    // in the process that holds it (the attacker is told, as if it knew).
    let theirs = common::host_addr_of(victim, "victim", VICTIM_AREA).unwrap();
    let (status, data) = command(attacker, d::CMD_READ, theirs);
    let victims_ram = status == d::DONE && data[..] == pattern[..];
    if jail {
        assert!(
            !common::holds_ram_of(attacker, "victim"),
            "the attacker's VM process maps the victim's RAM"
        );
    }
    // The host's loopback.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let host_loopback = command(attacker, d::CMD_CONNECT, u64::from(port)).0 == d::DONE;
    // A host file: the vCPU's filter denies the open and stops the VM.
    let at = |off: u64| k7d_guest::PARAMS_ADDR + off;
    common::write_guest_u32(attacker, "attacker", at(k7d_guest::param::ARG2), d::CMD_OPEN);
    let t = Instant::now();
    let open_stopped_the_vm = loop {
        let s = daemon.info("attacker")["status"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if s.starts_with("stopped") {
            break s.contains("seccomp") || s.contains("denied");
        }
        if t.elapsed() > Duration::from_secs(5) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // A panic in the attacker's device model (a bug that is caught): in a
    // VM process it ends that process, and its daemon records why; the
    // victim runs on.
    if jail {
        daemon.create("crasher", "drill", &[]);
        let crasher = daemon.holder("crasher");
        common::write_guest_u32(crasher, "crasher", at(k7d_guest::param::ARG2), d::CMD_PANIC);
        let want =
            format!("stopped (vm crasher: VM process {crasher} panicked and ended itself (its log has the panic))");
        let t = Instant::now();
        while daemon.info("crasher")["status"] != want.as_str() {
            assert!(t.elapsed() < Duration::from_secs(5), "{}", daemon.info("crasher"));
            std::thread::sleep(Duration::from_millis(10));
        }
        let counter = || common::read_guest_u32(victim, "victim", k7d_guest::RESULTS_ADDR + result::LOOP_COUNTER);
        let c = counter();
        std::thread::sleep(Duration::from_millis(50));
        assert!(counter() > c, "the victim stopped with the crasher");
    }
    Reached {
        own_ram,
        victims_ram,
        host_loopback,
        open_stopped_the_vm,
    }
}

#[test]
fn a_guest_with_arbitrary_reads_of_its_vm_process_reaches_only_its_own_vm() {
    let Some(bin) = drill_bin("a_guest_with_arbitrary_reads_of_its_vm_process_reaches_only_its_own_vm") else {
        return;
    };
    let o = Command::new(&bin).arg("--version").output().unwrap();
    assert!(text(&o).0.contains("escape-drill"), "{:?}", text(&o));
    let jailed = drill(&bin, true);
    eprintln!("in a VM process: {jailed:?}");
    assert!(
        jailed.own_ram,
        "the drill cannot even read its own VM's RAM: it proves nothing"
    );
    assert!(!jailed.victims_ram, "a VM process read another VM's RAM");
    assert!(!jailed.host_loopback, "a VM process reached the host's loopback");
    assert!(jailed.open_stopped_the_vm, "a VM process opened a host file");
    // The same drill inside the daemon finds what the jail keeps away.
    let unjailed = drill(&bin, false);
    eprintln!("inside the daemon: {unjailed:?}");
    assert!(unjailed.own_ram);
    assert!(
        unjailed.victims_ram,
        "inside the daemon the drill should find the other VM's RAM"
    );
    assert!(
        unjailed.host_loopback,
        "inside the daemon the drill should reach the host's loopback"
    );
    assert!(unjailed.open_stopped_the_vm);
}

/// Whether VM `id`'s loop counter, read from process `pid`, moves within 5 s.
fn runs(pid: u32, id: &str) -> bool {
    let at = k7d_guest::RESULTS_ADDR + result::LOOP_COUNTER;
    let c = common::read_guest_u32(pid, id, at);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if common::read_guest_u32(pid, id, at) != c {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Failure stays local (issue 36): a panic in the daemon (the drill build's
/// `--drill-panic-after-ms`: one of its threads panics, as a bug would)
/// ends a daemon with `--jail on` at once (SIGABRT: nothing carries on with
/// what the panic left half-changed), its VM runs on in its VM process,
/// and the next daemon re-attaches to it. A daemon with `--jail off` holds
/// its VMs, so there the panic stays in its thread and the daemon serves on.
#[test]
fn a_panic_ends_a_daemon_with_vm_processes_and_its_vms_run_on() {
    let name = "a_panic_ends_a_daemon_with_vm_processes_and_its_vms_run_on";
    let Some(bin) = drill_bin(name) else {
        return;
    };
    use std::os::unix::process::ExitStatusExt;
    for jail in [true, false] {
        let scratch = Scratch::new(if jail { "drill-panic-on" } else { "drill-panic-off" });
        let dir = scratch.0.as_path();
        let mode = if jail { "on" } else { "off" };
        let child = common::start_daemon(
            &bin,
            dir,
            &[
                "--jail",
                mode,
                "--jail-cgroup",
                "off",
                "--jail-id-base",
                "2000000300",
                "--drill-panic-after-ms",
                "3000",
            ],
            true,
        );
        let mut d = Daemon {
            child,
            bin: bin.clone(),
            dir: dir.to_path_buf(),
        };
        d.create("victim", "memwriter", &[]);
        let pid = d.holder("victim");
        let t = Instant::now();
        let ended = loop {
            if let Some(st) = d.child.try_wait().unwrap() {
                break Some(st);
            }
            if t.elapsed() > Duration::from_secs(8) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if jail {
            let st = ended.expect("a daemon with VM processes served on after a panic");
            assert_eq!(st.signal(), Some(libc::SIGABRT), "the daemon ended with {st}");
            assert!(runs(pid, "victim"), "the VM stopped with its daemon's panic");
            d.child = common::start_daemon(&bin, dir, &["--jail", "on", "--jail-cgroup", "off"], true);
            assert_eq!(d.holder("victim"), pid, "the next daemon did not re-attach to the VM");
            assert_eq!(d.info("victim")["status"].as_str(), Some("running"));
        } else {
            assert!(
                ended.is_none(),
                "a daemon with its VMs inside ended on a thread's panic: {ended:?}"
            );
            assert!(runs(pid, "victim"), "the VM stopped after the daemon's thread panicked");
            assert_eq!(d.info("victim")["status"].as_str(), Some("running"));
        }
        let o = d.cli(&["delete", "victim"]);
        assert!(o.status.success(), "delete: {:?}", text(&o));
    }
}

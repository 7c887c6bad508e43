//! The `SIGUSR1` state dump (`docs/diagnostics.md`) of a real VM: `k7d run`
//! and `k7d daemon` answer the signal with a `k7d-dump:` block on stderr
//! (vCPUs, control state, serial port) and the guest runs on.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::{K7D, Scratch};
/// `k7d_guest::RESULTS_ADDR + result::BSP_TICKS`: the pit guest's tick counter.
const TICKS: u64 = 0x600;

/// Lines read from a child's pipe on a thread, so the child never blocks.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<String>>>);

impl Lines {
    fn follow<R: Read + Send + 'static>(pipe: R) -> Self {
        let l = Self::default();
        let out = l.0.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                match line {
                    Ok(s) => out.lock().unwrap().push(s),
                    Err(_) => return,
                }
            }
        });
        l
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// Waits until a line satisfies `pred` (10 s at most).
    fn wait_for(&self, what: &str, pred: impl Fn(&[String]) -> bool) {
        let t = Instant::now();
        while !pred(&self.all()) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "no {what} within 10 s; got:\n{}",
                self.all().join("\n")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The `k7d-dump:` blocks seen so far, each from `begin` to `end` (prefix removed).
    fn dumps(&self) -> Vec<Vec<String>> {
        let mut blocks = Vec::new();
        let mut cur: Option<Vec<String>> = None;
        for l in self.all() {
            let Some(rest) = l.strip_prefix("k7d-dump: ") else {
                continue;
            };
            if rest.starts_with("begin ") {
                cur = Some(Vec::new());
            }
            if let Some(c) = cur.as_mut() {
                c.push(rest.to_string());
            }
            if rest.starts_with("end ")
                && let Some(c) = cur.take()
            {
                blocks.push(c);
            }
        }
        blocks
    }
}

fn usr1(child: &Child) {
    // SAFETY: plain kill(2) of our own, not yet reaped child.
    let rc = unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    assert_eq!(rc, 0, "kill -USR1 failed");
}

/// The value of `key=` in `line` (up to the next space).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(' ')
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

fn line<'a>(block: &'a [String], starts: &str) -> &'a str {
    block
        .iter()
        .find(|l| l.starts_with(starts))
        .unwrap_or_else(|| panic!("no line starting {starts:?} in the dump:\n{}", block.join("\n")))
}

/// Checks one VM's part of a dump: control state, every vCPU, the serial port.
fn check_vm(block: &[String], vm: &str, vcpus: usize) {
    let ctl = line(block, &format!("vm={vm} control="));
    assert_eq!(field(ctl, "control"), "running", "{ctl}");
    assert_eq!(field(ctl, "vcpus"), vcpus.to_string(), "{ctl}");
    for i in 0..vcpus {
        let v = line(block, &format!("vm={vm} vcpu{i} "));
        let tid: u64 = field(v, "tid").parse().unwrap();
        assert!(tid > 0, "{v}");
        assert!(
            ["kvm_run", "vmm"].contains(&field(v, "state")),
            "a running vCPU is in KVM_RUN or the VMM: {v}"
        );
        let _: u64 = field(v, "exits").parse().unwrap();
        let _ = field(v, "last_exit");
        assert!(field(v, "since_exit").ends_with('s'), "{v}");
    }
    let s = line(block, &format!("vm={vm} serial "));
    for key in [
        "ier",
        "iir",
        "lsr",
        "irq_pending",
        "irqs_raised",
        "bytes_out",
        "writing_for",
    ] {
        let _ = field(s, key);
    }
    assert_eq!(field(s, "writing_for"), "no", "{s}");
}

#[test]
fn sigusr1_dumps_a_running_k7d_run_and_the_vm_runs_on() {
    let dir = Scratch::new("diag-run");
    let copy = dir.0.join("dumps.txt");
    let mut child = Command::new(K7D)
        .args(["run", "--builtin", "smp", "--vcpus", "2", "--timeout", "3"])
        .env("K7D_DUMP_FILE", &copy)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn k7d run");
    let out = Lines::follow(child.stdout.take().unwrap());
    let err = Lines::follow(child.stderr.take().unwrap());
    out.wait_for("smp: 2 vCPUs up", |l| l.iter().any(|l| l.contains("smp: 2 vCPUs up")));
    let printed: usize = out.all().iter().map(|l| l.len() + 1).sum();

    usr1(&child);
    err.wait_for("a dump", |_| err.dumps().len() == 1);
    let vm = format!("run-{}", child.id());
    let block = &err.dumps()[0];
    assert!(
        block[0].starts_with(&format!("begin pid={} vms=1 ", child.id())),
        "{block:?}"
    );
    check_vm(block, &vm, 2);
    let s = line(block, &format!("vm={vm} serial "));
    assert_eq!(
        field(s, "bytes_out"),
        printed.to_string(),
        "every byte the guest printed: {s}"
    );
    let v0 = line(block, &format!("vm={vm} vcpu0 "));
    assert_ne!(field(v0, "exits"), "0", "the BSP printed through port I/O: {v0}");
    assert!(block.last().unwrap().starts_with("end vms=1 "), "{block:?}");

    // The VM is still running, and a second signal gets a second dump.
    std::thread::sleep(Duration::from_millis(200));
    assert!(child.try_wait().unwrap().is_none(), "k7d run exited after SIGUSR1");
    usr1(&child);
    err.wait_for("a second dump", |_| err.dumps().len() == 2);
    check_vm(&err.dumps()[1], &vm, 2);

    // It ran to its timeout: stopped by k7d, not by the signal or a vCPU error.
    let st = child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let all = err.all().join("\n");
    assert_eq!(st.code(), Some(2), "a timeout exits 2: {all}");
    assert!(all.contains("stopped (stop requested) after the timeout"), "{all}");
    // $K7D_DUMP_FILE got the same two blocks.
    let copy = std::fs::read_to_string(&copy).expect("the dump file");
    let dumped: Vec<&str> = all.lines().filter(|l| l.starts_with("k7d-dump: ")).collect();
    let copied: Vec<&str> = copy.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(copied, dumped);
}

fn cli(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(K7D)
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn ticks(dir: &Path, id: &str) -> u32 {
    let (ok, out, err) = cli(dir, &["peek", id, &format!("{TICKS:#x}")]);
    assert!(ok, "peek failed: {err}");
    out.trim()
        .parse()
        .unwrap_or_else(|e| panic!("peek printed {out:?}: {e}"))
}

#[test]
fn sigusr1_dumps_every_daemon_vm_and_their_clocks_tick_on() {
    let dir = Scratch::new("diag-daemon");
    let mut d = Command::new(K7D)
        .args(["daemon", "--jail", "off", "--state-dir"])
        .arg(dir.0.join("state"))
        .arg("--socket")
        .arg(dir.0.join("k7d.sock"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = Lines::follow(d.stderr.take().unwrap());
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(dir.0.join("k7d.sock")).is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "daemon did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    for id in ["tick1", "tick2"] {
        let (ok, out, e) = cli(
            &dir.0,
            &["create", "--id", id, "--builtin", "pit", "--memory", "8", "--start"],
        );
        assert!(ok, "{out} {e}");
    }
    let t = Instant::now();
    while ticks(&dir.0, "tick2") == 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the pit guest never ticked");
        std::thread::sleep(Duration::from_millis(10));
    }

    usr1(&d);
    err.wait_for("a dump", |_| !err.dumps().is_empty());
    let block = &err.dumps()[0];
    assert!(field(&block[0], "vms") == "2", "{block:?}");
    check_vm(block, "tick1", 1);
    check_vm(block, "tick2", 1);

    // The guests' clocks run on after the dump.
    for id in ["tick1", "tick2"] {
        let before = ticks(&dir.0, id);
        std::thread::sleep(Duration::from_millis(100));
        let after = ticks(&dir.0, id);
        assert!(
            after > before,
            "vm {id} stopped ticking after the dump: {before} -> {after}"
        );
    }
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
    let st = d.wait().unwrap();
    assert!(st.success(), "the daemon exits cleanly after a dump: {st}");
}

//! The nested lab (`tests/lab/`, `docs/lab.md`): real Linux guests, booted one
//! level down inside a QEMU-TCG-emulated AMD host (L1), because the host KVM of
//! our machines (PVM) cannot boot a stock kernel.
//!
//! Each `lab_*` test runs one scenario through `tests/lab/run.sh` and asserts on
//! its `result.json`. They take a minute or more, need root, apt and the host
//! packages of `tests/lab/setup.sh`, so they are ignored by default:
//! `cargo test -p k7d-tests --test lab -- --ignored` (CI does). Logs stay in
//! `<target>/lab/<scenario>/` (or `$K7D_LAB_OUT/<scenario>/`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// This package's directory in the checkout under test: cargo's
/// `CARGO_MANIFEST_DIR` at run time. The compile-time one names the
/// checkout the binary was built in, and cargo does not rebuild a crate
/// when only its checkout moved (a CI clone reusing another clone's build
/// products ran that clone's lab scenarios: CHALLENGES.md).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn lab_dir() -> PathBuf {
    manifest_dir().join("lab")
}

/// The cargo target directory this test binary was built into
/// (`<target>/<profile>/deps/lab-<hash>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .nth(3)
        .expect("test binary under <target>/<profile>/deps")
        .to_path_buf()
}

fn out_dir(scenario: &str) -> PathBuf {
    match std::env::var_os("K7D_LAB_OUT") {
        Some(dir) => PathBuf::from(dir).join(scenario),
        None => target_dir().join("lab").join(scenario),
    }
}

/// Runs a scenario and returns its `result.json` once it passed; the error
/// carries the harness's output (which prints both logs on failure).
/// A failed attempt is retried only when the host's L1 watchdog recorded a
/// freeze of the emulated machine in it (`<out>/freezes.log`, written by
/// `tests/lab/lib/watchdog.sh` and nothing else: a rescue, or L1 frozen for
/// good), and then once ([`with_one_retry`]). Any other failure fails the
/// test at once: a race in k7d that fails one run in three must fail CI,
/// not pass on retry. A retry is never hidden: the first attempt's logs stay
/// in `<out>.attempt1/`, its failure is printed in full, and the scenario's
/// line in the lab summary (`<target>/lab/summary.tsv`, printed at the end
/// of CI by `tests/run-all.sh`) says "passed on retry" with the first
/// failure's reason and the freeze that bought the retry.
fn run_scenario(scenario: &str, bin: Option<&Path>) -> Result<Value> {
    run_scenario_with(scenario, bin, &[])
}

/// [`run_scenario`] with more `run.sh` options that take a path, e.g.
/// `("--test-bin", test binary)` (a host test binary to run in L1) or
/// `("--agent", k7d-agent)` (the pod initramfs's `/init`).
fn run_scenario_with(scenario: &str, bin: Option<&Path>, extra: &[(&str, &Path)]) -> Result<Value> {
    RAN.set(Duration::ZERO);
    let t0 = Ran;
    let out = out_dir(scenario);
    let mut attempt = 0;
    // K7D_LAB_JUDGE judges the last run again: nothing to retry.
    let judge = std::env::var_os("K7D_LAB_JUDGE").is_some();
    let done = with_one_retry(scenario, &out, !judge, || {
        attempt += 1;
        // The lab's bounds are part of each attempt: a figure stretched by
        // a recorded freeze gets the same one retry as any failure.
        run_scenario_once(scenario, bin, extra)
            .and_then(|r| {
                let plant = std::env::var("K7D_LAB_PLANTED_FLAKE").ok();
                planted_flake(plant.as_deref(), scenario, attempt, &out).map(|()| r)
            })
            .and_then(|r| check_bounds(scenario, &r).map(|()| r))
    });
    let r = done.result.as_ref().ok().cloned().unwrap_or(Value::Null);
    summary(
        scenario,
        done.verdict,
        done.attempts,
        t0.elapsed(),
        &r,
        done.first_failure.as_deref(),
    );
    done.result
}

/// What [`with_one_retry`] made of a scenario's attempts.
struct Attempts {
    result: Result<Value>,
    /// The lab summary's verdict.
    verdict: &'static str,
    attempts: u32,
    /// The first attempt's failure in one line, when it failed.
    first_failure: Option<String>,
}

/// The retry policy: `attempt` runs the scenario once (its logs in `out`);
/// a failure is retried once, and only when `out/freezes.log` (the L1
/// watchdog's record of a freeze) says the emulator froze in that attempt.
fn with_one_retry(scenario: &str, out: &Path, may_retry: bool, mut attempt: impl FnMut() -> Result<Value>) -> Attempts {
    let first = match attempt() {
        Ok(r) => {
            return Attempts {
                verdict: pass_verdict(&r),
                result: Ok(r),
                attempts: 1,
                first_failure: None,
            };
        }
        Err(e) => e,
    };
    let reason = one_line(&first);
    let record = freeze_record(out).or_else(|| emulator_fault_record(out));
    let Some(freeze) = record.filter(|_| may_retry) else {
        let why = if may_retry {
            format!(
                "the L1 watchdog recorded no freeze of the emulator in this attempt ({}/freezes.log), \
                 and its L2 log shows no fault only the emulated machine makes",
                out.display()
            )
        } else {
            "K7D_LAB_JUDGE judged the last run again".to_string()
        };
        return Attempts {
            result: Err(first.context(format!("{scenario} failed, not retried: {why}"))),
            verdict: "FAILED",
            attempts: 1,
            first_failure: Some(reason),
        };
    };
    let kept = out.with_file_name(format!("{scenario}.attempt1"));
    let _ = std::fs::remove_dir_all(&kept);
    let kept_note = match std::fs::rename(out, &kept) {
        Ok(()) => format!("its logs are kept in {}", kept.display()),
        Err(e) => format!("its logs could not be kept ({e})"),
    };
    eprintln!(
        "LAB RETRY: scenario {scenario} failed once with a recorded emulator fault ({freeze}; {kept_note}); its one retry. First failure:\n{first:#}"
    );
    let why = format!("{reason} [retried: {freeze}]");
    match attempt() {
        Ok(r) => Attempts {
            result: Ok(r),
            verdict: "passed on retry",
            attempts: 2,
            first_failure: Some(why),
        },
        Err(e) => Attempts {
            result: Err(e.context(format!(
                "{scenario} failed twice (the first attempt with a recorded emulator fault: {kept_note})"
            ))),
            verdict: "FAILED twice",
            attempts: 2,
            first_failure: Some(why),
        },
    }
}

/// The L1 watchdog's freeze record of the attempt whose logs are in `out`:
/// how many freezes and the first, or `None` when it recorded none.
fn freeze_record(out: &Path) -> Option<String> {
    let text = std::fs::read_to_string(out.join("freezes.log")).ok()?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let first = lines.first()?;
    Some(format!("{} freeze(s) recorded, the first: {first}", lines.len()))
}

/// The one L2 kernel death the lab blames on the emulated machine by its
/// signature (CHALLENGES.md, "An L2 double fault at SYSCALL's first
/// instruction"): in `out/l2.log`, a double fault whose RIP is
/// `entry_SYSCALL_64+0x0` and whose CR2 lies within 64 bytes below a user
/// RSP. SYSCALL leaves IF clear and the stack unswitched there, so only an
/// event no correct CPU delivers at that instruction pushes its frame onto
/// the user stack; k7d, a user process in L1 with the LAPIC in L1's kernel,
/// injects none. Any other guest death, double faults elsewhere included,
/// is no record.
fn emulator_fault_record(out: &Path) -> Option<String> {
    let text = std::fs::read_to_string(out.join("l2.log")).ok()?;
    let lines: Vec<&str> = text.lines().collect();
    let hex_after = |l: &str, key: &str| -> Option<u64> {
        let rest = &l[l.find(key)? + key.len()..];
        let word = rest.split_whitespace().next()?;
        let word = word.rsplit(':').next()?;
        u64::from_str_radix(word, 16).ok()
    };
    for (i, l) in lines.iter().enumerate() {
        if !l.contains("traps: PANIC: double fault") {
            continue;
        }
        let window = &lines[i..lines.len().min(i + 20)];
        let rip = window.iter().any(|l| l.contains("RIP: 0010:entry_SYSCALL_64+0x0/"));
        let rsp = window.iter().find_map(|l| hex_after(l, "RSP:"));
        let cr2 = window.iter().find_map(|l| hex_after(l, "CR2:"));
        if let (true, Some(rsp), Some(cr2)) = (rip, rsp, cr2)
            && rsp < 0x0000_8000_0000_0000
            && cr2 < rsp
            && rsp - cr2 <= 64
        {
            return Some(format!(
                "the L2 kernel's double fault at entry_SYSCALL_64+0x0 pushing onto the user stack \
                 (RSP {rsp:#x}, CR2 {cr2:#x}; l2.log line {}): the emulated machine's fault",
                i + 1
            ));
        }
    }
    None
}

/// An error's first line (the scenario's reason), tabs and all.
fn one_line(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("(no message)");
    line.replace('\t', " ").chars().take(300).collect()
}

/// `K7D_LAB_PLANTED_FLAKE=SCENARIO[:freeze]`, a plant for showing what CI
/// does with a flaky scenario (docs/lab.md, "Retries"): that scenario's
/// odd attempts fail after it ran, as a race in k7d failing one run in two
/// would; with `:freeze` the failed attempt
/// also gets a freeze record, as if the L1 watchdog had rescued L1 in it.
/// Unset (CI), nothing happens.
fn planted_flake(plant: Option<&str>, scenario: &str, attempt: u32, out: &Path) -> Result<()> {
    let Some(plant) = plant else {
        return Ok(());
    };
    let (name, freeze) = match plant.split_once(':') {
        Some((name, "freeze")) => (name, true),
        _ => (plant, false),
    };
    if name != scenario || attempt.is_multiple_of(2) {
        return Ok(());
    }
    if freeze {
        std::fs::write(
            out.join("freezes.log"),
            "planted: K7D_LAB_PLANTED_FLAKE says L1 froze\n",
        )
        .context("planting a freeze record")?;
    }
    bail!("lab scenario {scenario} failed: planted flake (K7D_LAB_PLANTED_FLAKE={plant}), attempt {attempt}")
}

thread_local! {
    /// The time this test's scenario attempts ran, from each one's turn in
    /// the gate to its end (the lab summary's wall: the wait is not in it).
    static RAN: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
}

/// Adds the attempt's run time to [`RAN`] when it ends.
struct Running(Instant);

impl Drop for Running {
    fn drop(&mut self) {
        RAN.set(RAN.get() + self.0.elapsed());
    }
}

/// What [`RAN`] holds so far.
struct Ran;

impl Ran {
    fn elapsed(&self) -> Duration {
        RAN.get()
    }
}

/// "pass", or "pass, rescued" when the L1 watchdog had to wake a frozen L1
/// (its `lab.rescues` metric; `tests/lab/lib/watchdog.sh`).
fn pass_verdict(r: &Value) -> &'static str {
    if r["metrics"]["lab.rescues"]["value"].as_f64().unwrap_or(0.0) > 0.0 {
        "pass, rescued"
    } else {
        "pass"
    }
}

/// One line per scenario in `<lab out>/summary.tsv`: name, verdict, attempts,
/// wall seconds (all attempts, each from its turn in the gate), the last
/// attempt's prepare and L1 seconds, and the first attempt's failure when
/// there was one (`-` otherwise).
fn summary(scenario: &str, verdict: &str, attempts: u32, wall: Duration, r: &Value, first_failure: Option<&str>) {
    let dir = out_dir(scenario).parent().map(Path::to_path_buf).unwrap_or_default();
    let line = format!(
        "{scenario}\t{verdict}\t{attempts}\t{:.1}\t{}\t{}\t{}\n",
        wall.as_secs_f64(),
        r["prepare_s"].as_f64().map_or("-".into(), |v| format!("{v:.1}")),
        r["l1_s"].as_f64().map_or("-".into(), |v| format!("{v:.1}")),
        first_failure.map_or("-".into(), |f| f.replace(['\t', '\n'], " ")),
    );
    eprintln!("lab summary: {}", line.trim_end());
    let written = std::fs::create_dir_all(&dir).and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("summary.tsv"))
            .and_then(|mut f| f.write_all(line.as_bytes()))
    });
    if let Err(e) = written {
        eprintln!(
            "lab summary: cannot append to {}: {e}",
            dir.join("summary.tsv").display()
        );
    }
}

fn run_scenario_once(scenario: &str, bin: Option<&Path>, extra: &[(&str, &Path)]) -> Result<Value> {
    let out = out_dir(scenario);
    if std::env::var_os("K7D_LAB_JUDGE").is_some() {
        return judge_again(scenario, &out);
    }
    let _turn = Gate::get().enter(scenario);
    let _ran = Running(Instant::now());
    let mut cmd = Command::new(lab_dir().join("run.sh"));
    cmd.arg("--out").arg(&out).env("K7D_LAB_QUIET", "1");
    if let Some(bin) = bin {
        cmd.arg("--bin").arg(bin);
    }
    for (flag, path) in extra {
        cmd.arg(flag).arg(path);
    }
    cmd.arg(scenario);
    let output = cmd.output().context("running tests/lab/run.sh")?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    let result: Option<Value> = std::fs::read(out.join("result.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    match result {
        Some(r) if output.status.success() && r["status"] == "pass" => {
            eprintln!("{text}");
            Ok(r)
        }
        Some(r) => {
            let rescues = r["metrics"]["lab.rescues"]["value"].as_f64().unwrap_or(0.0);
            let froze = if rescues > 0.0 {
                format!(" ({rescues} L1 watchdog rescue(s) in this attempt: the emulator froze L1)")
            } else {
                String::new()
            };
            bail!("lab scenario {scenario} failed{froze}: {}\n{text}", r["reason"])
        }
        None => bail!("lab scenario {scenario}: no result ({})\n{text}", output.status),
    }
}

/// `K7D_LAB_JUDGE=1`: the scenario's last `result.json` judged again (its
/// test's assertions and the lab's bounds), without running it: how a
/// bound is shown to fail on real figures (LATENCY_BUDGETS.md).
fn judge_again(scenario: &str, out: &Path) -> Result<Value> {
    let path = out.join("result.json");
    let r: Value =
        serde_json::from_slice(&std::fs::read(&path).with_context(|| format!("K7D_LAB_JUDGE: {}", path.display()))?)
            .with_context(|| format!("K7D_LAB_JUDGE: {} is not JSON", path.display()))?;
    if r["status"] != "pass" {
        bail!(
            "lab scenario {scenario} failed (K7D_LAB_JUDGE: its last run): {}",
            r["reason"]
        );
    }
    Ok(r)
}

/// A bound the lab asserts on a scenario's figures, at about 2x the
/// measured figure or at the goal where the goal is met: the lab's part of
/// LATENCY_BUDGETS.md ("The lab's bounds"), which must list each one with
/// the same limit (`lab_bounds_are_the_ones_latency_budgets_md_lists`).
struct Bound {
    scenario: &'static str,
    /// A metric of the scenario, or the ratio `a / b` of two.
    figure: &'static str,
    max: f64,
}

const LAB_BOUNDS: &[Bound] = &[
    // What a Linux VM costs beyond its guest, per VM of 20 (issue 13's goal,
    // met: 0.24-0.42 MiB inside the daemon; 1.35 MiB in VM processes of
    // their own, the default since session 37, against issue 36's 2.5).
    Bound {
        scenario: "k7d-memory",
        figure: "k7d.vmm_mib_per_vm_of_20",
        max: 3.0,
    },
    // k7d boots the same kernel, initramfs and command line no slower than
    // QEMU pc + SeaBIOS: each one's fastest of four boots (a median of
    // three read 0.58 in one run and 1.25 in the next, with one VMM's boots
    // 3.6-8.9 s apart: the emulator only adds time). k7d's kernel cache is
    // filled by a boot before the series: a CI run whose first k7d boot
    // filled it compared k7d's fastest of two with QEMU's of three (1.02).
    Bound {
        scenario: "boot-compare",
        figure: "k7d.spawn_to_init_min / qemu.spawn_to_init_min",
        max: 1.0,
    },
    // The pod VM's own part of a pod's start (the shim's create phases of
    // the sandbox: prepare, vm, agent, setup, container) for a pod forked from
    // the node's template, or claimed from the warm pool, against a cold pod
    // VM's: what the fork and the pool change. Fork 0.13-0.44 over 15 CI runs,
    // pool 0.06-0.22.
    Bound {
        scenario: "k7d-cri",
        figure: "k7d-fork.pod_vm_create / k7d.pod_vm_create",
        max: 0.6,
    },
    Bound {
        scenario: "k7d-cri",
        figure: "k7d-pool.pod_vm_create / k7d.pod_vm_create",
        max: 0.4,
    },
    // The whole pod start (RunPodSandbox to both app containers running)
    // against a cold pod's. Most of it is containerd, CNI and each app
    // container's create in the guest, one sample each on an emulated
    // machine: fork 0.45-1.19 over 16 CI runs (median 0.68; the fork child's
    // in-guest creates copy its template's pages on first touch, issue 38),
    // pool 0.35-0.84 (median 0.47). Issue 35 asked 0.8 for both: the fork's
    // misses it on that known gap, and the pool's 0.8 failed a run on a host
    // ~40 % slower than usual (0.83), so each is at about 2x its median.
    Bound {
        scenario: "k7d-cri",
        figure: "k7d_fork.pod_start_vs_cold",
        max: 1.4,
    },
    Bound {
        scenario: "k7d-cri",
        figure: "k7d_pool.pod_start_vs_cold",
        max: 1.0,
    },
    // k7d's own part of StopPodSandbox (the sandbox's SIGKILL to its shim gone), each kind of pod.
    // A cold pod's includes its VM process's exit, which frees ~92 MiB of
    // guest RAM in L1 (0.53-1.81 s since VM processes became the default,
    // median 1.08; 1.70 on a host ~40 % slower than usual; against 0.07-0.32
    // s inside the daemon; LATENCY_BUDGETS.md).
    Bound {
        scenario: "k7d-cri",
        figure: "k7d.pod_vm_stop",
        max: 2.5,
    },
    Bound {
        scenario: "k7d-cri",
        figure: "k7d-fork.pod_vm_stop",
        max: 1.0,
    },
    Bound {
        scenario: "k7d-cri",
        figure: "k7d-pool.pod_vm_stop",
        max: 1.0,
    },
    // A container's first output under k7d (its pod VM's boot in it) against runc's.
    Bound {
        scenario: "k7d-shim",
        figure: "k7d.first_output_vs_runc",
        max: 6.0,
    },
    // The daemon's `exec` of `true` from Python against its floor (an echo
    // on an open vsock connection plus the guest's own spawn of `true`):
    // issue 37's goal, met since the agent's `run` on a kept connection
    // (0.99; 4.6-5.0 with `k7d exec`'s five calls on four connections).
    Bound {
        scenario: "k7d-exec",
        figure: "k7d_exec.api_vs_floor",
        max: 1.5,
    },
];

/// Bounds a scenario asserts itself (its shell script fails past them):
/// (scenario, the text of its failure, the bound as LATENCY_BUDGETS.md names it).
const SCENARIO_BOUNDS: &[(&str, &str, &str)] = &[
    (
        "k7d-shim",
        "after its VM stopped (limit 2 s)",
        "crashed guest's task STOPPED after its VM stopped: 2 s",
    ),
    (
        "k7d-shim",
        "ended $exec_end_s s after its VM stopped (limit 5 s)",
        "crashing exec's ctr ended after its VM stopped: 5 s",
    ),
    (
        "k7d-exec",
        "k7d exec --timeout 1 of sleep 30 ended $took s after its start (limit 5 s)",
        "`k7d exec --timeout 1` of `sleep 30` ended: 5 s",
    ),
    (
        "k7d-exec",
        "the exec op's timeout_s 1 of sleep 30 ended $took s after its start (limit 5 s)",
        "the `exec` op's `timeout_s: 1` of `sleep 30` answered: 5 s",
    ),
];

/// A figure of `r`: a metric, or the ratio `a / b` of two.
fn figure(r: &Value, figure: &str) -> Result<f64> {
    let one = |name: &str| {
        r["metrics"][name.trim()]["value"]
            .as_f64()
            .with_context(|| format!("the scenario reported no metric {}", name.trim()))
    };
    match figure.split_once(" / ") {
        Some((a, b)) => {
            let (a, b) = (one(a)?, one(b)?);
            if b <= 0.0 {
                bail!("{figure}: the divisor is {b}");
            }
            Ok(a / b)
        }
        None => one(figure),
    }
}

/// Every bound of `scenario` in [`LAB_BOUNDS`] holds on its result; each
/// figure is printed beside its limit either way.
fn check_bounds(scenario: &str, r: &Value) -> Result<()> {
    let mut over = Vec::new();
    for b in LAB_BOUNDS.iter().filter(|b| b.scenario == scenario) {
        let v = figure(r, b.figure)?;
        let ok = v.is_finite() && v > 0.0 && v <= b.max;
        eprintln!(
            "lab bound: {scenario}: {} = {v:.2} (limit {}){}",
            b.figure,
            b.max,
            if ok { "" } else { ": OVER" }
        );
        if !ok {
            over.push(format!("{} = {v:.2}, limit {}", b.figure, b.max));
        }
    }
    if !over.is_empty() {
        bail!(
            "lab scenario {scenario} passed its own checks but not the lab's bounds (LATENCY_BUDGETS.md): {}",
            over.join("; ")
        );
    }
    Ok(())
}

/// Typical L1 seconds of each scenario in CI (the lab summary of a
/// fresh-clone run, 2026-12-07, rounded up): the gate starts the longest
/// first. A scenario missing here counts as 60 s.
const TYPICAL_L1_S: &[(&str, u32)] = &[
    ("k7d-cri", 300),
    ("k7d-exec", 250),
    ("k7d-shim", 185),
    ("k7d-vmgenid", 170),
    ("k7d-memory", 135),
    ("k7d-cluster", 90),
    ("k7d-direct-jail", 90),
    ("k7d-fork", 95),
    ("k7d-fork-vhost", 70),
    ("k7d-net-jail", 60),
    ("k7d-blk-jail", 60),
    ("k7d-net", 55),
    ("lab-l1-freeze", 55),
    ("k7d-fork-stall", 55),
    ("k7d-direct", 50),
    ("lab-silent", 50),
    ("k7d-net-vhost", 50),
    ("k7d-blk", 50),
    ("k7d-boot", 40),
    ("lab-stall", 35),
    ("k7d-policy", 25),
    ("host-tests-l1", 20),
    ("l1-net", 15),
];

/// The lab's scheduler inside this test process. CI runs every lab test at
/// once (`--test-threads` well above the slot count); each waits here for
/// its turn, and a turn goes to the waiting scenario with the longest
/// typical L1 time ([`TYPICAL_L1_S`]; an exclusive one such as
/// boot-compare, which takes every slot, before all), so the long ones
/// do not end up last on one slot while the other idles. The first turn
/// waits until no test arrived for a moment, so every test has queued.
/// `run.sh`'s own slot locks stay the authority between processes.
struct Gate {
    state: Mutex<GateState>,
    turn: Condvar,
}

struct GateState {
    free: u32,
    slots: u32,
    /// (rank, scenario): the higher rank goes first.
    waiting: Vec<(u32, String)>,
    last_arrival: Instant,
    started: bool,
}

/// A turn in the gate, given back on drop.
struct Turn {
    gate: &'static Gate,
    need: u32,
}

impl Gate {
    /// How long the first turn waits for no further arrival.
    const SETTLE: Duration = Duration::from_secs(3);

    fn get() -> &'static Gate {
        static GATE: OnceLock<Gate> = OnceLock::new();
        GATE.get_or_init(|| {
            let slots = std::env::var("K7D_LAB_SLOTS")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .filter(|n| (1..=8).contains(n))
                .unwrap_or(1);
            Gate::new(slots)
        })
    }

    fn new(slots: u32) -> Gate {
        Gate {
            state: Mutex::new(GateState {
                free: slots,
                slots,
                waiting: Vec::new(),
                last_arrival: Instant::now(),
                started: false,
            }),
            turn: Condvar::new(),
        }
    }

    fn enter(&'static self, scenario: &str) -> Turn {
        let exclusive = std::fs::read_to_string(lab_dir().join("scenarios").join(format!("{scenario}.sh")))
            .is_ok_and(|s| s.lines().any(|l| l.trim() == "# lab: exclusive=yes"));
        let typical = TYPICAL_L1_S
            .iter()
            .find(|(name, _)| *name == scenario)
            .map_or(60, |(_, s)| *s);
        let rank = if exclusive { u32::MAX } else { typical };
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let need = if exclusive { st.slots } else { 1 };
        st.waiting.push((rank, scenario.to_string()));
        st.last_arrival = Instant::now();
        self.turn.notify_all();
        loop {
            if !st.started {
                let quiet = st.last_arrival.elapsed();
                if quiet < Self::SETTLE {
                    st = self
                        .turn
                        .wait_timeout(st, Self::SETTLE - quiet)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    continue;
                }
                st.started = true;
            }
            let head = st
                .waiting
                .iter()
                .enumerate()
                .max_by_key(|(i, (rank, _))| (*rank, std::cmp::Reverse(*i)))
                .map(|(i, _)| i);
            let mine = st.waiting.iter().position(|(_, s)| s == scenario);
            if head.is_some() && head == mine && st.free >= need {
                st.free -= need;
                if let Some(i) = mine {
                    st.waiting.remove(i);
                }
                // The next in line may take a slot that is still free: it
                // waits untimed, and only a wakeup tells it it is the head.
                self.turn.notify_all();
                return Turn { gate: self, need };
            }
            st = self.turn.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut st = self.gate.state.lock().unwrap_or_else(|p| p.into_inner());
        st.free += self.need;
        self.gate.turn.notify_all();
    }
}

/// The gate gives a free slot to the longest waiting scenario, and an
/// exclusive one waits for every slot; fast, no lab.
#[test]
fn lab_gate_starts_the_longest_first() {
    let gate: &'static Gate = Box::leak(Box::new(Gate::new(2)));
    let order = std::sync::Arc::new(Mutex::new(Vec::new()));
    let (held, held2) = (gate.enter("l1-net"), gate.enter("k7d-policy"));
    let run = |name: &'static str, hold: Duration| {
        let order = order.clone();
        std::thread::spawn(move || {
            let _turn = gate.enter(name);
            order.lock().unwrap().push(name);
            std::thread::sleep(hold);
        })
    };
    // Three queue while both slots are held; the one slot given back goes
    // to the longest (k7d-cri), then to the next longest.
    let queued = [
        run("lab-stall", Duration::from_millis(100)),
        run("k7d-cri", Duration::from_millis(100)),
        run("k7d-blk", Duration::from_millis(100)),
    ];
    std::thread::sleep(Duration::from_millis(300));
    assert!(order.lock().unwrap().is_empty(), "a scenario started with no slot free");
    drop(held);
    for t in queued {
        t.join().unwrap();
    }
    drop(held2);
    assert_eq!(*order.lock().unwrap(), ["k7d-cri", "k7d-blk", "lab-stall"]);
    // boot-compare (exclusive) takes both slots: a held slot keeps it out.
    let held = gate.enter("l1-net");
    let t = run("boot-compare", Duration::ZERO);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        order.lock().unwrap().len(),
        3,
        "boot-compare started beside another scenario"
    );
    drop(held);
    t.join().unwrap();
    assert_eq!(order.lock().unwrap().last(), Some(&"boot-compare"));
    // Two slots free at once with two waiting: both start, the second
    // without waiting for the first to finish (a lost wakeup would leave
    // a slot idle until a turn is given back).
    let (held, held2) = (gate.enter("l1-net"), gate.enter("k7d-policy"));
    let both = std::sync::Arc::new(std::sync::Barrier::new(2));
    let pair = |name: &'static str| {
        let both = both.clone();
        std::thread::spawn(move || {
            let _turn = gate.enter(name);
            // Both hold a turn at once, or this never returns.
            both.wait();
        })
    };
    let (a, b) = (pair("k7d-shim"), pair("k7d-cluster"));
    std::thread::sleep(Duration::from_millis(300));
    drop((held, held2));
    let t0 = Instant::now();
    while !(a.is_finished() && b.is_finished()) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "two free slots, two waiting, one left idle"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    a.join().unwrap();
    b.join().unwrap();
}

/// A metric the scenario printed (`LAB-METRIC name value unit`), in seconds.
fn metric(result: &Value, name: &str) -> f64 {
    result["metrics"][name]["value"]
        .as_f64()
        .unwrap_or_else(|| panic!("metric {name} missing: {result:#}"))
}

/// Every scenario parses and declares its description and default; fast, no lab.
#[test]
fn lab_scenarios_are_well_formed() {
    let out = Command::new(lab_dir().join("run.sh"))
        .arg("--check")
        .output()
        .expect("run.sh --check");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// L1 offers what later network scenarios need (vhost-net, vhost-vsock,
/// multi-queue taps, clsact, tc mirred, iproute2); boots no guest.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_l1_has_vhost_and_taps() {
    run_scenario("l1-net", None).unwrap_or_else(|e| panic!("{e:#}"));
}

/// k7d boots the stock Debian cloud kernel in L1 with 2 vCPUs: nproc=2,
/// virtio-rng bound and read, poweroff and reboot reported, the daemon's record
/// says "guest_poweroff", a non-kernel file is refused (all asserted inside
/// the scenario, which fails otherwise). The binary is `$K7D_LAB_BIN`, else
/// `<target>/release/k7d`, built here.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_boots_linux() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-boot", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "k7d.guest_init_uptime") > 0.0);
    assert!(metric(&r, "k7d.spawn_to_init") < metric(&r, "k7d.wall"));
}

/// Boot-to-init of k7d next to QEMU + SeaBIOS (`-kernel`) and QEMU microvm,
/// same kernel, initramfs, command line and L1, interleaved runs, and k7d
/// with its own default command line: prints the medians and the ratios.
/// Figures of an emulated machine; the ratio is the comparison.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_boot_to_init_k7d_vs_qemu() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("boot-compare", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    let (k, q) = (metric(&r, "k7d.spawn_to_init"), metric(&r, "qemu.spawn_to_init"));
    let (kg, qg) = (
        metric(&r, "k7d.guest_init_uptime"),
        metric(&r, "qemu.guest_init_uptime"),
    );
    assert!(k > 0.0 && q > 0.0);
    println!("boot-to-init in the nested lab (emulated machine: compare within the run only)");
    println!(
        "  VMM spawn -> guest init, median: k7d {k:.2} s, QEMU 7.2 + SeaBIOS {q:.2} s, ratio {:.2} (goal <= 0.5)",
        k / q
    );
    println!(
        "  guest uptime at init, median:    k7d {kg:.2} s, QEMU {qg:.2} s, ratio {:.2}",
        kg / qg
    );
    let (m, mg) = (
        metric(&r, "microvm.spawn_to_init"),
        metric(&r, "microvm.guest_init_uptime"),
    );
    assert!(m > 0.0);
    println!(
        "  VMM spawn -> guest init, median: k7d {k:.2} s, QEMU microvm {m:.2} s, ratio {:.2} (goal <= 0.4)",
        k / m
    );
    println!(
        "  guest uptime at init, median:    k7d {kg:.2} s, QEMU microvm {mg:.2} s, ratio {:.2}",
        kg / mg
    );
    let d = metric(&r, "k7d_default.spawn_to_init");
    assert!(d > 0.0);
    println!(
        "  k7d with its default command line: spawn -> init {d:.2} s, ratio {:.2} to QEMU pc, {:.2} to microvm",
        d / q,
        d / m
    );
}

/// The stall watchdog (issue 10): a k7d guest that goes silent while it and
/// k7d keep running is detected after 10 s of silence, not at L1's timeout;
/// the evidence (k7d's threads and their kernel stacks, KVM's exit counters,
/// k7d's own SIGUSR1 dump, the guest's last lines) is printed and k7d killed.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_stall_watchdog_fires_with_evidence() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("lab-stall", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    let took = metric(&r, "stall.detected_after_init");
    assert!((10.0..45.0).contains(&took), "detected {took} s after init");
}

/// The host's L1 watchdog (issue 10): L1's CPU stopped through QEMU's monitor
/// (an emulator hang as it would look) is seen within the scenario's 15 s
/// heartbeat limit, with the emulator's evidence; the self-test scenario
/// fails unless the watchdog fired as `l1-froze` with QEMU's threads, L1's
/// registers and its last heartbeats.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_l1_watchdog_sees_a_frozen_l1() {
    if pending("lab-l1-freeze") {
        return;
    }
    let Some(key) = selfcheck_due("lab_l1_watchdog_sees_a_frozen_l1", "lab-l1-freeze") else {
        return;
    };
    let r = run_scenario("lab-l1-freeze", None).unwrap_or_else(|e| panic!("{e:#}"));
    let after = metric(&r, "watchdog.fired_after");
    assert!(
        (15.0..30.0).contains(&after),
        "fired after {after} s without a heartbeat (limit 15 s)"
    );
    let evidence = out_dir("lab-l1-freeze").join("l1-stall.log");
    let text = std::fs::read_to_string(&evidence).unwrap_or_else(|e| panic!("{}: {e}", evidence.display()));
    assert!(
        text.contains("VM status: paused"),
        "evidence without L1's machine state:\n{text}"
    );
    selfcheck_passed("lab-l1-freeze", &key);
}

/// The host's L1 watchdog (issue 10): a scenario that prints nothing while L1
/// lives is stopped after its 15 s silence limit, with L1's process table.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_l1_watchdog_stops_a_silent_scenario() {
    let Some(key) = selfcheck_due("lab_l1_watchdog_stops_a_silent_scenario", "lab-silent") else {
        return;
    };
    let r = run_scenario("lab-silent", None).unwrap_or_else(|e| panic!("{e:#}"));
    let after = metric(&r, "watchdog.fired_after");
    assert!(
        (15.0..30.0).contains(&after),
        "fired after {after} s of silence (limit 15 s)"
    );
    let evidence = out_dir("lab-silent").join("l1-stall.log");
    let text = std::fs::read_to_string(&evidence).unwrap_or_else(|e| panic!("{}: {e}", evidence.display()));
    assert!(
        text.contains("sh /lab/scenario.sh"),
        "evidence without L1's process table:\n{text}"
    );
    selfcheck_passed("lab-silent", &key);
}

/// Host-level tests the PVM host cannot run (no `vhost_net` in its kernel)
/// run inside L1 instead, from the same test binary: the vhost NIC fork test
/// with `K7D_NO_SKIP=1` (a skip there fails).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_host_tests_that_need_vhost_run_in_l1() {
    let bin = test_binary("fork_devices").unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario_with("host-tests-l1", None, &[("--test-bin", &bin)]).unwrap_or_else(|e| panic!("{e:#}"));
    let notes = r["notes"].to_string();
    for t in [
        "a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on",
        "every_fork_equals_its_source_while_frames_land_through_vhost_net",
    ] {
        assert!(
            notes.contains(&format!("{t} passed in L1 with /dev/vhost-net")),
            "{notes}"
        );
    }
}

/// k7d's virtio-blk with a real guest: mkfs.ext4 + mount + 16 MiB + sync on a
/// raw image that L1 then loop-mounts and finds the same sha256 in; an erofs
/// image attached read-only mounts, every file matches the host's manifest, a
/// file write fails with EROFS and a raw write is refused, in the guest, which
/// goes on; k7d exits 0 and the image is unchanged (all asserted in the scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_blk_ext4_and_erofs() {
    if pending("k7d-blk") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-blk", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "blk.guest_write_sync_s") > 0.0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("L1 loop-mount reads the same sha256"), "{notes}");
    assert!(notes.contains("files match ro.manifest"), "{notes}");
}

/// Issue 36: k7d-blk's VM built by `k7d daemon --jail on` in a jailed VM
/// process, its kernel, initrd, both images and serial log handed over as
/// descriptors: the same guest checks, and the VM process (asserted in the
/// scenario) ran as a non-root uid with no_new_privs, no capabilities, a
/// seccomp filter, an empty root and its own mount namespace, holding both
/// images and its own log as standard error.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_blk_in_a_jailed_vm_process() {
    if pending("k7d-blk-jail") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-blk-jail", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    let notes = r["notes"].to_string();
    assert!(notes.contains("L1 loop-mount reads the same sha256"), "{notes}");
    assert!(notes.contains("files match ro.manifest"), "{notes}");
    assert!(
        notes.contains("holding its files and serial log as handed descriptors"),
        "{notes}"
    );
    assert!(notes.contains("k7d-jail: its cgroup /sys/fs/cgroup/k7d/vm-"), "{notes}");
}

/// k7d's userspace virtio-net over a multi-queue tap, 2 vCPUs: the guest sees
/// 2 queue pairs, pings L1 3/3, and 16 MiB cross each way with matching
/// sha256; k7d reports "vhost: off, queues: 2" and removes its tap.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_net_userspace_two_queues() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-net", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "net.guest_to_l1_s") > 0.0);
    assert!(metric(&r, "net.l1_to_guest_s") > 0.0);
    let notes = r["notes"].to_string();
    assert!(
        notes.contains("k7d: nic 0: tap k7dlab0, vhost: off, queues: 2"),
        "{notes}"
    );
}

/// Issue 36: k7d-net-vhost's VM built by `k7d daemon --jail on` in a
/// jailed VM process: the daemon creates the tap and opens one
/// `/dev/vhost-net` per queue pair and hands them all over; the guest sees
/// 2 queue pairs on the kernel's data plane, pings L1 and moves 16 MiB
/// each way with matching sums, the daemon reports the NIC as `k7d run`
/// does, and the VM process (asserted in the scenario) was jailed holding
/// the tap's queues and both vhost devices.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_net_in_a_jailed_vm_process() {
    if pending("k7d-net-jail") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-net-jail", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "net.guest_to_l1_s") > 0.0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("tap k7dlab0, vhost: on, queues: 2"), "{notes}");
    assert!(
        notes.contains("holding its files and serial log as handed descriptors"),
        "{notes}"
    );
    assert!(notes.contains("k7d-jail: its cgroup /sys/fs/cgroup/k7d/vm-"), "{notes}");
}

/// Issue 6: a real Linux guest reaches a peer netns through the tc-eBPF
/// direct datapath (the VM's tap in the pod netns, programs on the tap and the
/// pod's veth): ping + 16 MiB each way with matching sums, nothing left.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_direct_datapath_real_guest() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-direct", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "net.guest_to_l1_s") > 0.0);
    assert!(metric(&r, "net.l1_to_guest_s") > 0.0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("datapath: direct"), "{notes}");
}

/// Issue 36: the same pod NIC for a VM in a jailed VM process (`k7d
/// daemon --jail on`): the daemon makes the tap in the pod netns with the
/// direct datapath around it and hands its queues over; the same guest
/// checks, the daemon reports "datapath: direct", the VM process was
/// jailed holding the tap's queues, and nothing is left after the delete
/// (all asserted in the scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_direct_datapath_for_a_jailed_vm_process() {
    if pending("k7d-direct-jail") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-direct-jail", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "net.guest_to_l1_s") > 0.0);
    assert!(metric(&r, "net.l1_to_guest_s") > 0.0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("datapath: direct"), "{notes}");
    assert!(
        notes.contains("holding its files and serial log as handed descriptors"),
        "{notes}"
    );
    assert!(notes.contains("k7d-jail: its cgroup /sys/fs/cgroup/k7d/vm-"), "{notes}");
}

/// The same over L1's kernel vhost-net (`vhost=on`): "vhost: on, queues: 2".
/// Pending while k7d-net-vhost.sh says `# lab: default=no` (the vhost-net
/// backend is a stub): skipped unless `K7D_LAB_RUN_PENDING=1`.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_net_vhost_two_queues() {
    if pending("k7d-net-vhost") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-net-vhost", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    let notes = r["notes"].to_string();
    assert!(
        notes.contains("k7d: nic 0: tap k7dlab0, vhost: on, queues: 2"),
        "{notes}"
    );
}

/// The NIC policy: 9 queue pairs on a `max_net_queues = 8` node and
/// `max_net_queues` 0 and 65 are refused with their sentences (exit 1, no
/// guest, no tap left); 8 queues and a defaulted 1-queue NIC boot.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_net_queue_policy() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-policy", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    let notes = r["notes"].to_string();
    for want in [
        "9 queue pairs requested, this node allows at most 8 (max_net_queues)",
        "max_net_queues = 0 is out of range",
        "max_net_queues = 65 is out of range",
    ] {
        assert!(notes.contains(want), "{want}: {notes}");
    }
}

/// Issue 5: a running Linux guest (2 vCPUs, a raw virtio-blk disk whose
/// sector 0 its init loop rewrites with a counter every 100 ms) is forked
/// through the daemon: the child ticks on from the source's counter, read off
/// its own disk; its `date` and uptime never go back and keep L1's pace;
/// `sleep 1` takes about 1 s; the source, paused 3 s after the fork, falls
/// behind and each VM reads back only its own counter; both are deleted with
/// nothing left and the daemon exits 0 (all asserted in the scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_fork_linux() {
    if pending("k7d-fork") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-fork", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "fork.ms") > 0.0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("child disk as of the fork"), "{notes}");
    assert!(notes.contains("each VM read back only its own counter"), "{notes}");
}

/// Issue 5 with a vhost-net NIC: the same fork checks as `lab_k7d_fork_linux`;
/// the first fork switches the kernel's dirty log on, and the child has its
/// own tap on vhost-net with the source's MAC.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_fork_linux_vhost() {
    if pending("k7d-fork-vhost") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-fork-vhost", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(metric(&r, "fork.ms") > 0.0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("both vhost-net"), "{notes}");
    assert!(notes.contains("each VM read back only its own counter"), "{notes}");
}

/// Issue 40: Debian's generic kernel (it has the vmgenid driver), 1 vCPU,
/// drawing from /dev/urandom every 3 s: in 6 forks of 8 children (20 by
/// hand, `LAB_VMGENID_ROUNDS`), each
/// child's kernel reseeded (one more "virtual machine fork" message) before
/// its first draw and no draw repeats among the children and their source;
/// two restores of one snapshot and a 3 × 2 cluster fork likewise; the same
/// forks of a VM made with `--no-vmgenid` repeat draws and warn once (all
/// asserted in the scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_vmgenid_reseeds_every_child() {
    if pending("k7d-vmgenid") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-vmgenid", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    let notes = r["notes"].to_string();
    assert!(notes.contains("every child reseeded before its first draw"), "{notes}");
    assert!(notes.contains("repeated draws in 4 forks of off"), "{notes}");
    assert!(notes.contains("two restores of one snapshot"), "{notes}");
}

/// Issue 16: a 3-VM cluster of Debian guests on its private bridge (a
/// streams TCP to b, and runs a request/response loop with c) is forked
/// twice under one pause: in both forks and in the source both connections
/// flow on with the source's IPs and MACs, each fork on a bridge of its
/// own; with each domain paused in turn no frame is sent towards it while
/// the others run; deleting the forks and the source leaves no VM, bridge,
/// tap, record or memfd (all asserted in the scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_cluster_forks_on_private_bridges() {
    if pending("k7d-cluster") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-cluster", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(r["status"], "pass", "{r:#}");
    assert!(metric(&r, "cluster_fork.source_paused_ms") > 0.0);
    let notes = r["notes"].to_string();
    for want in [
        "every eth0 has its source's IP and MAC",
        "4. cl-f2 paused 3 s",
        "every domain flows again",
        "cleanup: cl-f1 deleted",
    ] {
        assert!(notes.contains(want), "{want}: {notes}");
    }
}

/// Issue 10: the fork scenarios' own stall watchdog. With the daemon stopped
/// after the source booted, the watcher over the daemon's serial logs fires
/// after 10 s, gathers the evidence and kills the daemon (the scenario
/// passes only then, checking the evidence).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_fork_stall_is_seen() {
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-fork-stall", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(r["status"], "pass", "{r:#}");
    let log = std::fs::read_to_string(out_dir("k7d-fork-stall").join("l1.log")).unwrap_or_default();
    assert!(
        log.contains("LAB-STALL fork: no guest printed for 10 s"),
        "no stall line in l1.log"
    );
}

/// `k7d exec` (issue 37): commands run by the guest agent in a plain VM
/// under the daemon's default (a VM process), in two fork children and in
/// a restored VM: output, stdout and stderr apart, exit and signal status,
/// stdin, env/cwd/user, a timeout, refusals; the agent's reseed of fork
/// children before their first draw (all asserted in the scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_exec_in_vms_forks_and_restores() {
    if pending("k7d-exec") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let agent = k7d_agent_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario_with("k7d-exec", Some(&bin), &[("--agent", &agent)]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(r["status"], "pass", "{r:#}");
    for m in [
        "k7d_exec.first_ms",
        "k7d_exec.ms",
        "k7d_exec.child_ms",
        "k7d_exec.reseed_ms",
    ] {
        let v = metric(&r, m);
        assert!(v > 0.0 && v < 60_000.0, "{m} = {v} ms");
    }
}

/// containerd 1.6 in L1 runs the same three `ctr run` containers with runc
/// (the reference) and with `containerd-shim-k7d-v2` (one pod VM each, booted
/// by the k7d daemon from the L2 kernel and the pod initramfs of
/// `guest/agent/mkinitramfs.sh`): output, the L2 kernel's `uname -r`, the
/// image's files, a writable layer per container, `/dev`, exit code 3,
/// stdin and its end; afterwards no task, container, shim or VM is left (all
/// asserted in the scenario). Then `k7d daemon --jail on`: a task stays
/// RUNNING and takes execs across the daemon's `kill -9` and restart.
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_shim_containerd() {
    if pending("k7d-shim") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let agent = k7d_agent_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario_with("k7d-shim", Some(&bin), &[("--agent", &agent)]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(r["status"], "pass", "{r:#}");
    for m in ["containerd.start_s", "runc.first_output", "k7d.first_output"] {
        let v = metric(&r, m);
        assert!(v > 0.0 && v < 300.0, "{m} = {v} s");
    }
    let notes = r["notes"].to_string();
    assert!(notes.contains("k7d: nothing left"), "{notes}");
    // Issue 36: under `--jail on` a pod outlives its daemon's kill.
    assert!(
        notes.contains("k7d --jail on: the daemon killed -9 under a running task: the task stayed RUNNING"),
        "{notes}"
    );
    let pss = metric(&r, "k7d.pod_vm_process_pss_mib");
    assert!(pss > 0.0, "k7d.pod_vm_process_pss_mib = {pss}");
}

/// containerd 1.6 in L1 with its CRI plugin and CNI (Debian's bridge and
/// host-local plugins): `k7d-cri` (tests/cri, the kubelet's calls) runs one
/// two-container pod under the runtime handler runc (the reference), then
/// k7d (one pod VM for the pod: the app containers join the sandbox's VM):
/// the pod sandbox, both containers RUNNING, ExecSync, the CRI log, stop and
/// remove; then two pods talking over the pod network (runc; k7d with a
/// fork-started server and a client claimed from the warm pool, on the
/// direct datapath, each with its own address, hostname, RNG and boot id,
/// with a pod policy that blocks and is cleared; the pool refills itself);
/// then the same pod forked from the node's template (a k7d-fork
/// RuntimeClass) and claimed from the pool; then k7d on the bridge fallback
/// when the tc object cannot be loaded; nothing left (all asserted in the
/// scenario).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_cri_pods() {
    if pending("k7d-cri") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let agent = k7d_agent_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let cri = k7d_cri_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario_with("k7d-cri", Some(&bin), &[("--agent", &agent), ("--cri-bin", &cri)])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(r["status"], "pass", "{r:#}");
    for m in [
        "runc.pod_start",
        "k7d.pod_start",
        "k7d.pod_delete",
        "k7d-fork.pod_start",
        "k7d-fork.pod_delete",
        "k7d_fork.pod_start_vs_cold",
        "k7d-pool.pod_start",
        "k7d-pool.pod_delete",
        "k7d_pool.pod_start_vs_cold",
        "k7d.pod_vm_create",
        "k7d-fork.pod_vm_create",
        "k7d-pool.pod_vm_create",
        "pool.fill_s",
        "net-k7d.tcp_mib_s",
    ] {
        let v = metric(&r, m);
        assert!(v > 0.0 && v < 300.0, "{m} = {v}");
    }
    let notes = r["notes"].to_string();
    for want in [
        "k7d: nothing left",
        "k7d-fork: forked from the template",
        "net-k7d: the pod VMs' NICs",
        "net-k7d (a fork-started server, a pool-claimed client)",
        "net-k7d: each pod VM's machine-id",
        "net-k7d-forks (two children of one template)",
        "net-k7d-forks: each pod VM's machine-id",
        "two pool members: ",
        "warm pool: refilled after net-k7d's claim",
        "net-k7d-bridge: the pod VMs' NICs",
    ] {
        assert!(notes.contains(want), "no note {want:?}: {notes}");
    }
}

/// The schedule of the L1 watchdog's self-tests (`lab-l1-freeze`,
/// `lab-silent`; issue 35 allows "a stated schedule that CI enforces").
/// They run no k7d: their verdict depends on the harness (`tests/lab`,
/// this file) and QEMU alone. With `K7D_LAB_SELFCHECK=scheduled` (CI,
/// `tests/run-all.sh`) one runs when no pass on this machine is recorded
/// for the harness and QEMU as they are now, or the last is a day old; else
/// its test says a skip (listed in `tests/expected-skips.txt`). Unset (by
/// hand) or anything else: it always runs. `Some(key)`: run, then record
/// the pass under `key` ([`selfcheck_passed`]).
fn selfcheck_due(test: &str, scenario: &str) -> Option<String> {
    let key = harness_key(scenario).unwrap_or_else(|e| {
        eprintln!("lab: {scenario}: no key for the self-test schedule ({e:#}): it runs");
        String::new()
    });
    if std::env::var("K7D_LAB_SELFCHECK").as_deref() != Ok("scheduled") || key.is_empty() {
        return Some(key);
    }
    let stamp = std::fs::read_to_string(selfcheck_stamp(scenario)).unwrap_or_default();
    let Some(age) = selfcheck_fresh(&stamp, &key, now_epoch()) else {
        return Some(key);
    };
    k7d_test_skip::skip(
        test,
        &format!(
            "scheduled: {scenario} passed on this machine {:.1} h ago with this harness and QEMU; it runs again when either changes, or {} h after that pass (K7D_LAB_SELFCHECK unset runs it)",
            age as f64 / 3600.0,
            SELFCHECK_EVERY_S / 3600
        ),
    );
    None
}

/// A self-test runs at least this often under the schedule.
const SELFCHECK_EVERY_S: u64 = 24 * 3600;

/// The age in seconds of the pass `stamp` records ("KEY EPOCH") when it was
/// under `key` and is younger than [`SELFCHECK_EVERY_S`] at `now`; `None`:
/// the self-test is due.
fn selfcheck_fresh(stamp: &str, key: &str, now: u64) -> Option<u64> {
    let mut words = stamp.split_whitespace();
    let (Some(k), Some(at)) = (words.next(), words.next().and_then(|t| t.parse::<u64>().ok())) else {
        return None;
    };
    let age = now.checked_sub(at)?;
    (k == key && age < SELFCHECK_EVERY_S).then_some(age)
}

/// The schedule's decision: a self-test is skipped only after a pass
/// recorded under the same harness key less than a day ago.
#[test]
fn the_watchdog_self_tests_run_when_the_harness_changed_or_a_day_passed() {
    let now = 1_800_000_000;
    assert_eq!(selfcheck_fresh("", "k1", now), None, "no pass recorded");
    assert_eq!(selfcheck_fresh("garbage", "k1", now), None);
    assert_eq!(selfcheck_fresh(&format!("k1 {}", now - 3600), "k1", now), Some(3600));
    assert_eq!(
        selfcheck_fresh(&format!("k0 {}", now - 60), "k1", now),
        None,
        "the harness or QEMU changed"
    );
    assert_eq!(
        selfcheck_fresh(&format!("k1 {}", now - SELFCHECK_EVERY_S), "k1", now),
        None,
        "a day passed"
    );
    assert_eq!(
        selfcheck_fresh(&format!("k1 {}", now + 60), "k1", now),
        None,
        "a pass from the future"
    );
    let key = harness_key("lab-silent").expect("the harness's key");
    assert_eq!(key.len(), 64);
    assert_ne!(
        key,
        harness_key("lab-l1-freeze").unwrap(),
        "each scenario's own file is in its key"
    );
}

/// Records a self-test's pass under `key` (nothing for an empty key).
fn selfcheck_passed(scenario: &str, key: &str) {
    if key.is_empty() {
        return;
    }
    let path = selfcheck_stamp(scenario);
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&path, format!("{key} {}\n", now_epoch())));
    if let Err(e) = written {
        eprintln!("lab: cannot record {scenario}'s pass in {}: {e}", path.display());
    }
}

fn selfcheck_stamp(scenario: &str) -> PathBuf {
    let cache = std::env::var_os("K7D_LAB_CACHE").map_or_else(|| PathBuf::from("/var/cache/k7d-lab"), PathBuf::from);
    cache.join("selfcheck").join(scenario)
}

fn now_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// sha256 of what a self-test's verdict depends on: the harness's files
/// (`run.sh`, `setup.sh`, `lib/`, the scenario, this file) and QEMU's
/// version.
fn harness_key(scenario: &str) -> Result<String> {
    let lab = lab_dir();
    let mut files = vec![
        lab.join("run.sh"),
        lab.join("setup.sh"),
        lab.join("scenarios").join(format!("{scenario}.sh")),
        manifest_dir().join("tests").join("lab.rs"),
    ];
    let mut lib: Vec<PathBuf> = std::fs::read_dir(lab.join("lib"))
        .context("tests/lab/lib")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    lib.sort();
    files.extend(lib);
    let mut text = Vec::new();
    for f in &files {
        text.extend_from_slice(f.strip_prefix(manifest_dir()).unwrap_or(f).to_string_lossy().as_bytes());
        text.push(0);
        text.extend(std::fs::read(f).with_context(|| f.display().to_string())?);
        text.push(0);
    }
    // (No QEMU: no lab run either; the key still names the harness.)
    let qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .map_or_else(|_| b"no qemu-system-x86_64".to_vec(), |o| o.stdout);
    text.extend(qemu);
    let mut child = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("sha256sum")?;
    child.stdin.take().context("sha256sum's stdin")?.write_all(&text)?;
    let out = child.wait_with_output().context("sha256sum")?;
    let hex = String::from_utf8_lossy(&out.stdout);
    match hex.split_whitespace().next() {
        Some(h) if out.status.success() && h.len() == 64 => Ok(h.to_string()),
        _ => bail!("sha256sum said {hex:?}"),
    }
}

/// A scenario marked `# lab: default=no` is pending: its test skips itself
/// (saying so) unless `K7D_LAB_RUN_PENDING=1`.
fn pending(scenario: &str) -> bool {
    let path = lab_dir().join("scenarios").join(format!("{scenario}.sh"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let is_pending = text.lines().any(|l| l.trim() == "# lab: default=no");
    if is_pending && std::env::var_os("K7D_LAB_RUN_PENDING").is_none() {
        return k7d_test_skip::skip(
            &format!("lab {scenario}"),
            "pending (# lab: default=no); K7D_LAB_RUN_PENDING=1 runs it",
        );
    }
    false
}

/// `$K7D_LAB_BIN`, else `<target>/release/k7d`, (re)built by cargo first.
fn k7d_binary() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("K7D_LAB_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "-p", "k7d-vmm", "--bin", "k7d", "--target-dir"])
        .arg(target_dir())
        .status()
        .context("cargo build --release -p k7d-vmm")?;
    if !status.success() {
        bail!("cargo build --release -p k7d-vmm failed: {status}");
    }
    Ok(target_dir().join("release").join("k7d"))
}

/// `$K7D_LAB_AGENT`, else `<target>/release/k7d-agent`, (re)built by cargo
/// first: the guest agent, `/init` of the pod initramfs.
fn k7d_agent_binary() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("K7D_LAB_AGENT") {
        return Ok(PathBuf::from(bin));
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "k7d-agent",
            "--bin",
            "k7d-agent",
            "--target-dir",
        ])
        .arg(target_dir())
        .status()
        .context("cargo build --release -p k7d-agent")?;
    if !status.success() {
        bail!("cargo build --release -p k7d-agent failed: {status}");
    }
    Ok(target_dir().join("release").join("k7d-agent"))
}

/// `$K7D_LAB_CRI_BIN`, else `<target>/release/k7d-cri`, (re)built by cargo
/// first: the lab's CRI client (`tests/cri`; its build needs `protoc`).
fn k7d_cri_binary() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("K7D_LAB_CRI_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "k7d-cri",
            "--bin",
            "k7d-cri",
            "--target-dir",
        ])
        .arg(target_dir())
        .status()
        .context("cargo build --release -p k7d-cri")?;
    if !status.success() {
        bail!("cargo build --release -p k7d-cri failed: {status}");
    }
    Ok(target_dir().join("release").join("k7d-cri"))
}

/// The executable of the k7d-tests integration test `name`, as cargo builds
/// it for this profile (`cargo test --no-run --message-format=json`).
fn test_binary(name: &str) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "test",
            "--release",
            // The workspace's feature set, as tests/run-all.sh builds the
            // lab's own binary: nothing is compiled again.
            "--workspace",
            "--test",
            name,
            "--no-run",
            "--message-format=json",
            "--target-dir",
        ])
        .arg(target_dir())
        .output()
        .with_context(|| format!("cargo test --no-run --test {name}"))?;
    if !out.status.success() {
        bail!(
            "building the test {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo named no executable for the test {name}"))
}

/// What a Linux VM costs beyond its guest (issue 13): the daemon's PSS with
/// 0, 1 and 20 idle Linux VMs in L1, guest RAM counted apart. The figures
/// are reported (the goal, <= 3 MiB per VM, is a target, not asserted); what
/// is asserted is that 20 VMs ran and were measured, that each guest's RAM
/// shows up as such, and that the VMM's part stays below a guest's worth
/// (a per-VM leak of guest-sized buffers would fail it).
#[test]
#[ignore = "nested lab: slow; run with --ignored (CI does)"]
fn lab_k7d_memory_per_linux_vm() {
    if pending("k7d-memory") {
        return;
    }
    let bin = k7d_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let r = run_scenario("k7d-memory", Some(&bin)).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(r["status"], "pass", "{r:#}");
    let guest = metric(&r, "k7d.guest_ram_mib_per_vm_of_20");
    let per_vm = metric(&r, "k7d.vmm_mib_per_vm_of_20");
    assert!(guest > 8.0, "guest RAM per VM {guest} MiB: the guests did not run");
    assert!(
        (0.0..guest).contains(&per_vm),
        "the VMM's part per VM is {per_vm} MiB (guest RAM {guest} MiB)"
    );
    // One VM's part is a difference of two readings of the daemon's whole
    // PSS, which moves by up to ~2 MiB between runs of the same binary
    // (CI run 50 read -0.93 MiB where a by-hand run read +0.99 MiB, other
    // runs 0.9-1.1 MiB): checked within that, the average over 20 above.
    let one = metric(&r, "k7d.vmm_mib_1vm");
    assert!(
        (-2.5..guest).contains(&one),
        "one VM's part is {one} MiB (guest RAM {guest} MiB)"
    );
}

/// A passing attempt's result, as run.sh writes it.
fn passed() -> Value {
    serde_json::json!({"status": "pass", "metrics": {}})
}

/// The retry policy (fast, no lab): a failure without a freeze record is
/// not retried; one with a record gets one retry, never a second; a pass
/// with a retry carries the first failure's reason and the freeze.
#[test]
fn lab_retries_only_an_attempt_with_a_recorded_freeze() {
    let dir = k7d_tests::TempDir::new("retry");
    let out = dir.0.join("sc");
    let attempt_dir = |freeze: bool| {
        std::fs::create_dir_all(&out).unwrap();
        if freeze {
            std::fs::write(
                out.join("freezes.log"),
                "rescue 1 after 9 s without a heartbeat: HLT=1 IRR 236\n",
            )
            .unwrap();
        }
    };
    // A k7d race that fails one run in two, no freeze: fails at once.
    let mut n = 0;
    let a = with_one_retry("sc", &out, true, || {
        n += 1;
        attempt_dir(false);
        if n % 2 == 1 {
            bail!("lab scenario sc failed: \"a race\"")
        } else {
            Ok(passed())
        }
    });
    assert_eq!((n, a.attempts, a.verdict), (1, 1, "FAILED"));
    let e = format!("{:#}", a.result.unwrap_err());
    assert!(e.contains("not retried: the L1 watchdog recorded no freeze"), "{e}");
    assert!(a.first_failure.unwrap().contains("a race"));
    let _ = std::fs::remove_dir_all(&out);
    // The same with the emulator frozen in the failed attempt: one retry,
    // the first attempt's logs kept aside, the reason in the summary.
    let mut n = 0;
    let a = with_one_retry("sc", &out, true, || {
        n += 1;
        attempt_dir(n == 1);
        if n == 1 {
            bail!("lab scenario sc failed: \"stretched\"")
        } else {
            Ok(passed())
        }
    });
    assert_eq!((n, a.attempts, a.verdict), (2, 2, "passed on retry"));
    assert!(a.result.is_ok());
    let why = a.first_failure.unwrap();
    assert!(
        why.contains("stretched") && why.contains("1 freeze(s) recorded"),
        "{why}"
    );
    assert!(dir.0.join("sc.attempt1/freezes.log").exists());
    let _ = std::fs::remove_dir_all(&out);
    // A judgement again (K7D_LAB_JUDGE) is never retried, freeze or not.
    let _ = std::fs::remove_dir_all(&out);
    let mut n = 0;
    let a = with_one_retry("sc", &out, false, || {
        n += 1;
        attempt_dir(true);
        bail!("lab scenario sc failed: \"judged\"")
    });
    assert_eq!((n, a.attempts, a.verdict), (1, 1, "FAILED"));
    let _ = std::fs::remove_dir_all(&out);
    // Frozen in both failed attempts: still only one retry.
    let mut n = 0;
    let a = with_one_retry("sc", &out, true, || {
        n += 1;
        attempt_dir(true);
        bail!("lab scenario sc failed: \"again\"")
    });
    assert_eq!((n, a.attempts, a.verdict), (2, 2, "FAILED twice"));
    assert!(a.result.is_err());
    // An empty record is no record.
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("freezes.log"), "\n").unwrap();
    assert!(freeze_record(&out).is_none());
}

/// The emulated machine's known L2 fault (as CI on d799449 caught it in
/// `k7d-net-vhost`) is a record that buys one retry; a double fault
/// anywhere else, or one whose frame went to a kernel address, is not.
#[test]
fn lab_knows_the_emulators_double_fault_at_syscall_entry_and_nothing_else() {
    let dir = k7d_tests::TempDir::new("l2fault");
    let out = dir.0.join("sc");
    std::fs::create_dir_all(&out).unwrap();
    let log = |rip: &str, cr2: &str| {
        format!(
            "LAB-GUEST hb uptime=13.91\n\
             [   14.560744] traps: PANIC: double fault, error_code: 0x0\n\
             [   14.562152] double fault: 0000 [#1] PREEMPT SMP NOPTI\n\
             [   14.562776] CPU: 0 PID: 127 Comm: nc Tainted: G        W          6.1.0-57-cloud-amd64 #1\n\
             [   14.563010] RIP: 0010:{rip}\n\
             [   14.563861] RSP: 0018:00007fffcd1290c8 EFLAGS: 00000002\n\
             [   14.564464] CR2: {cr2} CR3: 000000001ff42000 CR4: 00000000003106b0\n\
             [   14.795958] Kernel panic - not syncing: Fatal exception in interrupt\n"
        )
    };
    std::fs::write(out.join("l2.log"), log("entry_SYSCALL_64+0x0/0x29", "00007fffcd1290b8")).unwrap();
    let r = emulator_fault_record(&out).expect("the signature is a record");
    assert!(r.contains("CR2 0x7fffcd1290b8") && r.contains("line 2"), "{r}");
    // Through the retry policy: one retry, its reason in the summary.
    let mut n = 0;
    let a = with_one_retry("sc", &out, true, || {
        n += 1;
        if n == 1 {
            bail!("lab scenario sc failed: \"the guest script did not finish\"")
        } else {
            Ok(passed())
        }
    });
    assert_eq!((n, a.attempts, a.verdict), (2, 2, "passed on retry"));
    assert!(a.first_failure.unwrap().contains("entry_SYSCALL_64"));
    std::fs::create_dir_all(&out).unwrap();
    for (rip, cr2) in [
        ("do_syscall_64+0x3b/0x90", "00007fffcd1290b8"),
        ("entry_SYSCALL_64+0x0/0x29", "ffffc90000003ff8"),
        ("entry_SYSCALL_64+0x0/0x29", "0000000000001000"),
    ] {
        std::fs::write(out.join("l2.log"), log(rip, cr2)).unwrap();
        assert!(emulator_fault_record(&out).is_none(), "{rip} {cr2}");
    }
    std::fs::write(out.join("l2.log"), "[    1.0] Kernel panic - not syncing: VFS\n").unwrap();
    assert!(emulator_fault_record(&out).is_none());
}

/// The planted flake (`K7D_LAB_PLANTED_FLAKE`) fails odd attempts of its
/// scenario only, and plants a freeze record only when asked; through the
/// retry policy, the plain plant fails and the freeze plant passes on retry.
#[test]
fn lab_planted_flake_fails_odd_attempts_of_its_scenario() {
    let dir = k7d_tests::TempDir::new("plant");
    let out = dir.0.join("sc");
    std::fs::create_dir_all(&out).unwrap();
    assert!(planted_flake(None, "sc", 1, &out).is_ok());
    assert!(planted_flake(Some("other"), "sc", 1, &out).is_ok());
    assert!(planted_flake(Some("sc"), "sc", 2, &out).is_ok());
    assert!(planted_flake(Some("sc"), "sc", 1, &out).is_err());
    assert!(freeze_record(&out).is_none());
    let runs = |plant: &'static str| {
        let mut n = 0;
        with_one_retry("sc", &out, true, || {
            n += 1;
            std::fs::create_dir_all(&out).unwrap();
            planted_flake(Some(plant), "sc", n, &out).map(|()| passed())
        })
    };
    let a = runs("sc");
    assert_eq!((a.attempts, a.verdict), (1, "FAILED"));
    let _ = std::fs::remove_dir_all(&out);
    let a = runs("sc:freeze");
    assert_eq!((a.attempts, a.verdict), (2, "passed on retry"));
}

/// The L1 watchdog's rescue decision (`l1_interrupt_lost` in
/// tests/lab/lib/watchdog.sh), on canned QEMU monitor output: two samples
/// a second apart must both show the lost interrupt.
#[test]
fn lab_rescue_decision_needs_the_lost_interrupt_in_both_samples() {
    const HALTED_IF: &str = "RIP=ffffffff81b0f0ee RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1";
    const HALTED_NO_IF: &str = "RIP=ffffffff81b0f0ee RFL=00000046 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1";
    const RUNNING_IF: &str = "RIP=ffffffffc0d3a1b2 RFL=00000286 [--S--P-] CPL=0 II=0 A20=1 SMM=0 HLT=0";
    const RUNNING_L2_USER: &str = "RIP=00007f3a12c4e9d0 RFL=00000202 [-------] CPL=3 II=0 A20=1 SMM=0 HLT=0";
    let lapic = |irr: &str| {
        format!(
            "dumping local APIC state for CPU 0\n\nLVT0\t 0x00010700 active-hi edge  masked                      ExtINT (vec 0)\n\
             LVTT\t 0x000400ec active-hi edge                 tsc-deadline Fixed  (vec 236)\n\
             Timer\t DCR=0x0 (divide by 2) initial_count = 0 current_count = 0\n\
             SPIV\t 0x000001ff APIC enabled, focus=off, spurious vec 255\nESR\t 0x00000000\nISR\t (none)\nIRR\t {irr}\n\n\
             APR 0x00 TPR 0x00 DFR 0x0f LDR 0x01PPR 0x00\n"
        )
    };
    let (pending, none, other) = (lapic("236"), lapic("(none)"), lapic("34"));
    let lost = |r1: &str, a1: &str, r2: &str, a2: &str| {
        let st = Command::new("bash")
            .arg("-c")
            .arg(r#". "$1" && l1_interrupt_lost "$2" "$3" "$4" "$5""#)
            .arg("watchdog")
            .arg(lab_dir().join("lib/watchdog.sh"))
            .args([r1, a1, r2, a2])
            .status()
            .expect("bash");
        match st.code() {
            Some(0) => true,
            Some(1) => false,
            c => panic!("l1_interrupt_lost exited {c:?}"),
        }
    };
    // Halted with interrupts on, in both samples: the freeze (CI runs 52-53).
    assert!(lost(HALTED_IF, &pending, HALTED_IF, &pending));
    assert!(lost(HALTED_IF, &none, HALTED_IF, &none));
    // Running with interrupts on and the same vector pending in both (CI run 53).
    assert!(lost(RUNNING_IF, &pending, RUNNING_IF, &pending));
    // A busy, healthy L1: a vector caught pending once, then taken (CI run
    // 55's two early rescues had IRR empty a second later).
    assert!(!lost(RUNNING_IF, &pending, RUNNING_IF, &none));
    assert!(!lost(RUNNING_IF, &none, RUNNING_IF, &pending));
    // ... or two different vectors, each taken in between.
    assert!(!lost(RUNNING_IF, &pending, RUNNING_IF, &other));
    // Running with nothing pending, or running L2's user code.
    assert!(!lost(RUNNING_IF, &none, RUNNING_IF, &none));
    assert!(!lost(RUNNING_L2_USER, &none, RUNNING_L2_USER, &none));
    // Halted once, then woken and running: it took its interrupt.
    assert!(!lost(HALTED_IF, &pending, RUNNING_IF, &none));
    // Interrupts off: not the lost interrupt (nothing a key press fixes).
    assert!(!lost(HALTED_NO_IF, &pending, HALTED_NO_IF, &pending));
    // No answer from the monitor (QEMU exiting): no rescue.
    assert!(!lost("", "", "", ""));
}

/// Every bound in [`LAB_BOUNDS`] and [`SCENARIO_BOUNDS`] is listed in
/// LATENCY_BUDGETS.md with the same limit, and each scenario-side bound
/// is still the scenario's own text (fast, no lab).
#[test]
fn lab_bounds_are_the_ones_latency_budgets_md_lists() {
    let md_path = lab_dir().join("../../LATENCY_BUDGETS.md");
    let md = std::fs::read_to_string(&md_path).unwrap();
    let section = md
        .split("## The lab's bounds")
        .nth(1)
        .expect("LATENCY_BUDGETS.md has no \"## The lab's bounds\"");
    let section = section.split("\n## ").next().unwrap_or(section);
    for b in LAB_BOUNDS {
        let row = format!("| `{}` | `{}` | {} |", b.scenario, b.figure, b.max);
        assert!(
            section.contains(&row),
            "LATENCY_BUDGETS.md's lab section lacks the row starting {row}"
        );
    }
    let rows = section.lines().filter(|l| l.starts_with("| `")).count();
    assert_eq!(
        rows,
        LAB_BOUNDS.len() + SCENARIO_BOUNDS.len(),
        "LATENCY_BUDGETS.md's lab section lists bounds the code does not"
    );
    for (scenario, text, doc) in SCENARIO_BOUNDS {
        let path = lab_dir().join("scenarios").join(format!("{scenario}.sh"));
        let script = std::fs::read_to_string(&path).unwrap();
        assert!(script.contains(text), "{} no longer says {text:?}", path.display());
        let row = format!("| `{scenario}` | {doc} |");
        assert!(section.contains(&row), "LATENCY_BUDGETS.md's lab section lacks {row}");
    }
    // A figure that is a ratio is one of two metrics, else one metric.
    let r = serde_json::json!({"metrics": {"a": {"value": 3.0}, "b": {"value": 2.0}, "z": {"value": 0.0}}});
    assert_eq!(figure(&r, "a / b").unwrap(), 1.5);
    assert!(figure(&r, "a / z").is_err());
    assert!(figure(&r, "c").is_err());
}

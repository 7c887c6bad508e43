//! A fork of a VM in a VM process of its own (issue 36, `k7d daemon --jail
//! on`: the source exports its fork instant, the child is built in a spare
//! VM process made ahead) against the same fork inside the daemon (`--jail
//! off`), same run, alternating: two daemons of this build, each with a
//! 256 MiB `memwriter` source, forked one child at a time at 0 % and 10 %
//! of its RAM dirtied since the last fork; the child is deleted after each.
//! Reported: the fork request's wall time (client to answer, the child
//! running) and how long the source stood still, medians, and their ratio.
//! Goal (issue 36): fork p50 ≤ 1.2× in-process.
//!
//! Then a cluster of 3 such sources (idle, 0 % dirty): one cluster fork
//! (one pause for the 3, 3 children) and a batch of `K7D_BENCH_BATCH`
//! (default 8) cluster forks in one request, in each daemon, medians of
//! `K7D_BENCH_CLUSTER_RUNS` (default 7). Goals (issue 36): a cluster fork
//! ≤ 1.2× in-process; a batch's time per cluster ≤ 0.5× a single cluster
//! fork, in VM processes as in the daemon.
//!
//! Run as root: `cargo build --release --bin k7d && cargo bench -p k7d-benches --bench vm_process_fork`
//! (`K7D_BENCH_RUNS` sets the run count, default 21; `K7D_BENCH_SPARES`
//! each daemon's `--jail-spares`, default 2).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_benches::{env_num, is_root, k7d_bin, kill_vm_processes_under, median};

const MIB: u64 = 256;
/// The dirtied area starts at 2 MiB.
const AREA: u64 = 0x20_0000;

struct Daemon {
    child: Child,
    sock: PathBuf,
}

impl Daemon {
    fn start(k7d: &Path, dir: &Path, jail: &str) -> Result<Self> {
        let sock = dir.join(format!("{jail}.sock"));
        let spares = std::env::var("K7D_BENCH_SPARES").unwrap_or_else(|_| "2".into());
        let child = Command::new(k7d)
            // No cgroup: this host may have none with the memory and cpu
            // controllers, and limits are not what is measured.
            .args([
                "daemon",
                "--jail",
                jail,
                "--jail-cgroup",
                "off",
                "--jail-id-base",
                "2000000600",
                "--jail-spares",
                &spares,
                "--state-dir",
            ])
            .arg(dir.join(format!("state-{jail}")))
            .arg("--socket")
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start a daemon")?;
        let t = Instant::now();
        while UnixStream::connect(&sock).is_err() {
            if t.elapsed() > Duration::from_secs(10) {
                bail!("the daemon did not start");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Self { child, sock })
    }

    /// One request line; the result, or the error as an error.
    fn call(&self, op: &str, args: serde_json::Value) -> Result<serde_json::Value> {
        k7d_benches::api_call(&self.sock, op, args)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.call("delete", serde_json::json!({"id": "src"}));
        let _ = self.call("cluster_delete", serde_json::json!({"id": "cl"}));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A source dirtying `pages` pages of its RAM in a loop (0: none).
fn source(d: &Daemon, pages: u64) -> Result<()> {
    let _ = d.call("delete", serde_json::json!({"id": "src"}));
    let (n, dirty) = if pages == 0 { (64, 0) } else { (pages, 1) };
    d.call(
        "create",
        serde_json::json!({
            "config": {
                "id": "src",
                "memory_mib": MIB,
                "guest": {"kind": "builtin", "name": "memwriter", "args": [n, AREA, dirty]},
            },
            "start": true,
        }),
    )?;
    Ok(())
}

/// One fork: the request's wall time and the source's standstill, in ms.
fn fork(d: &Daemon) -> Result<(f64, f64)> {
    // What the source dirtied since the last fork (its loop's pace).
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let r = d.call("fork", serde_json::json!({"id": "src"}))?;
    let took = t.elapsed().as_secs_f64() * 1e3;
    let paused = r["source_paused_ms"].as_f64().unwrap_or(f64::NAN);
    d.call("delete", serde_json::json!({"id": "src-f1"}))?;
    Ok((took, paused))
}

/// Cluster `cl` of 3 idle 256 MiB memwriters.
fn cluster(d: &Daemon) -> Result<()> {
    let _ = d.call("delete", serde_json::json!({"id": "src"}));
    let members: Vec<String> = (0..3).map(|i| format!("m{i}")).collect();
    for m in &members {
        d.call(
            "create",
            serde_json::json!({
                "config": {
                    "id": m,
                    "memory_mib": MIB,
                    "guest": {"kind": "builtin", "name": "memwriter", "args": [64, AREA, 0]},
                },
                "start": true,
            }),
        )?;
    }
    d.call("cluster_create", serde_json::json!({"id": "cl", "members": members}))?;
    Ok(())
}

/// `count` forks of cluster `cl` in one request: its wall time in ms; the
/// child clusters are deleted after.
fn cluster_fork(d: &Daemon, count: u32) -> Result<f64> {
    let t = Instant::now();
    let r = d.call("fork", serde_json::json!({"id": "cl", "count": count}))?;
    let took = t.elapsed().as_secs_f64() * 1e3;
    for c in r["clusters"].as_array().into_iter().flatten() {
        d.call("cluster_delete", serde_json::json!({"id": c}))?;
    }
    Ok(took)
}

fn main() -> Result<()> {
    if !is_root() {
        println!("vm_process_fork: skipped (VM processes need root)");
        return Ok(());
    }
    let runs = env_num("K7D_BENCH_RUNS", 21);
    let k7d = k7d_bin()?;
    let dir = std::env::temp_dir().join(format!("k7d-bench-vmproc-fork-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("scratch dir")?;
    let measured = measure(&k7d, &dir, runs);
    kill_vm_processes_under(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    measured
}

fn measure(k7d: &Path, dir: &Path, runs: usize) -> Result<()> {
    let inproc = Daemon::start(k7d, dir, "off")?;
    let vmproc = Daemon::start(k7d, dir, "on")?;
    println!("vm_process_fork: one child of a {MIB} MiB memwriter, median of {runs}, in the daemon vs in VM processes");
    let pages = MIB * 256;
    for (label, dirty) in [("0 % dirty", 0), ("10 % dirty", pages / 10)] {
        source(&inproc, dirty)?;
        source(&vmproc, dirty)?;
        let (mut a, mut b, mut pa, mut pb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            let (t, p) = fork(&inproc)?;
            a.push(t);
            pa.push(p);
            let (t, p) = fork(&vmproc)?;
            b.push(t);
            pb.push(p);
        }
        let (a, b) = (median(&mut a), median(&mut b));
        println!(
            "  {label:10}  fork: in the daemon {a:7.2} ms, in VM processes {b:7.2} ms ({:.2}x; goal <= 1.2x); source still: {:.2} vs {:.2} ms",
            b / a,
            median(&mut pa),
            median(&mut pb)
        );
    }
    let runs = env_num("K7D_BENCH_CLUSTER_RUNS", 7);
    let batch = env_num("K7D_BENCH_BATCH", 8) as u32;
    cluster(&inproc)?;
    cluster(&vmproc)?;
    let (mut a, mut b, mut ba, mut bb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        a.push(cluster_fork(&inproc, 1)?);
        b.push(cluster_fork(&vmproc, 1)?);
        ba.push(cluster_fork(&inproc, batch)? / f64::from(batch));
        bb.push(cluster_fork(&vmproc, batch)? / f64::from(batch));
    }
    let (a, b, ba, bb) = (median(&mut a), median(&mut b), median(&mut ba), median(&mut bb));
    println!(
        "  cluster of 3  fork: in the daemon {a:7.2} ms, in VM processes {b:7.2} ms ({:.2}x; goal <= 1.2x)",
        b / a
    );
    println!(
        "  batch of {batch}    per cluster: in the daemon {ba:7.2} ms ({:.2}x a single), in VM processes {bb:7.2} ms ({:.2}x; goal <= 0.5x)",
        ba / a,
        bb / b
    );
    Ok(())
}

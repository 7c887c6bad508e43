//! Cluster fork (issue 16), side by side in one run: a cluster of 3 × 256
//! MiB members forked under one pause against the sum of three single-VM
//! forks of the same members (each its own pause) and against a QEMU
//! stand-in for three VMs (QEMU has no fork: for each VM, stop, migrate to
//! a file on tmpfs, a new QEMU `-incoming` it, `cont`, timed from `stop` to
//! `cont` and summed over the three, `k7d_benches::qemu_fork`), at 0 / 1 /
//! 10 % of the pages dirtied since the bases froze; and a batch of N forks
//! under one pause (fresh members, 1 % dirtied; as the daemon does, the
//! members are re-based first when that costs less than every child
//! copying their divergence, so the batch shares one capture) against N
//! cluster forks one after another, per fork; both twice in the same
//! rounds: with every child built from scratch ("shells off"), and with
//! every child built in a shell made ahead ("shells ready": the pool is
//! filled before each timed fork, for the singles and the batch alike, and
//! what one shell costs to make is printed beside). Members are running
//! idle guests (the pause and resume are part of each figure).
//!
//! Goals (issue 16): a cluster fork ≤ 1.3× one single-VM fork of the same
//! total RAM; a batch ≤ 0.5× a single cluster fork per cluster.
//!
//! Run: `cargo bench -p k7d-benches --bench cluster_fork` (root, /dev/kvm).
//! `K7D_BENCH_FORKS` sets the samples per cell (default 11),
//! `K7D_BENCH_BATCH` the batch size (default 50), `K7D_BENCH_BATCHES` the
//! batches measured (default 5), `K7D_BENCH_QEMU_RUNS` the QEMU runs per
//! cell (default 3; 0 skips QEMU).

use std::time::{Duration, Instant};

use anyhow::Result;
use k7d_benches::qemu_fork::QemuFork;
use k7d_benches::{env_num, idle_vm, which};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::vstate::cluster::ClusterPause;
use k7d_vmm::vstate::shell::ShellPool;
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 256;
const MEMBERS: usize = 3;

/// Dirties `n` pages of `vm` spread over its RAM (above 1 MiB).
fn dirty(vm: &Vm, mib: u64, n: u64, round: u32) {
    let pages = (mib << 20) / 4096;
    let stride = (pages / n.max(1)).max(1);
    for i in 0..n {
        let gpa = ((i * stride) % pages * 4096).max(1 << 20);
        let _ = vm.memory().write_obj(round ^ i as u32, GuestAddress(gpa));
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn ids(forks: usize, round: usize) -> Vec<Vec<String>> {
    (0..forks)
        .map(|f| (0..MEMBERS).map(|m| format!("c{round}-{f}-{m}")).collect())
        .collect()
}

/// The QEMU stand-in for a cluster: one QEMU fork per member, each timed
/// from its `stop` to the new QEMU's `cont` (`QemuFork::run`, QEMU's
/// start-up not included), summed like the three single k7d forks.
fn qemu_cluster(q: &[QemuFork], dirty: u64, round: u32) -> Result<Duration> {
    q.iter().map(|q| q.run(dirty, round)).sum()
}

fn main() -> Result<()> {
    let samples = env_num("K7D_BENCH_FORKS", 11);
    let batch = env_num("K7D_BENCH_BATCH", 50).max(1);
    let batches = env_num("K7D_BENCH_BATCHES", 5).max(1);
    let qemu_runs = env_num("K7D_BENCH_QEMU_RUNS", 3);
    let scratch = std::path::Path::new("/dev/shm").join(format!("k7d-bench-cluster-{}", std::process::id()));
    let qemu: Vec<QemuFork> = match (qemu_runs, which("qemu-system-x86_64")) {
        (0, _) => Vec::new(),
        (_, None) => {
            println!("qemu-system-x86_64 not found: the QEMU column is skipped (apt-get install qemu-system-x86)");
            Vec::new()
        }
        (_, Some(q)) => {
            let bios = scratch.join("hello-bios.bin");
            std::fs::create_dir_all(&scratch)?;
            std::fs::write(&bios, k7d_guest::hello_bios_image())?;
            (0..MEMBERS)
                .map(|i| {
                    let dir = scratch.join(format!("vm{i}"));
                    std::fs::create_dir_all(&dir)?;
                    Ok(QemuFork::new(&q, &bios, &dir, MIB))
                })
                .collect::<Result<_>>()?
        }
    };
    let members: Vec<Vm> = (0..MEMBERS)
        .map(|i| idle_vm(&format!("m{i}"), MIB))
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(20));
    let refs: Vec<&Vm> = members.iter().collect();
    // Freeze every base with a first fork.
    let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
    drop(held.fork(&ids(1, 0), |_| VmOptions::default())?);
    held.resume()?;

    println!("k7d cluster fork: {MEMBERS} running idle members of {MIB} MiB ({samples} samples per cell, medians)");
    println!(
        "{:>6} {:>14} {:>16} {:>7} | {:>12} | {:>14} {:>8}",
        "dirty", "cluster ms", "3 singles ms", "ratio", "goal <= 1.3", "QEMU 3 VMs ms", "/QEMU"
    );
    let pages = (MIB << 20) / 4096;
    for (pct, n) in [(0.0, 0), (1.0, pages / 100), (10.0, pages / 10)] {
        let mut cluster = Vec::with_capacity(samples);
        let mut singles = Vec::with_capacity(samples);
        for r in 0..samples {
            for m in &members {
                dirty(m, MIB, n, r as u32);
            }
            let t = Instant::now();
            let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
            let children = held.fork(&ids(1, r + 1), |_| VmOptions::default())?;
            held.resume()?;
            cluster.push(t.elapsed());
            drop(children);

            for m in &members {
                dirty(m, MIB, n, r as u32 ^ 0x5a5a);
            }
            let mut sum = Duration::ZERO;
            for (i, m) in members.iter().enumerate() {
                let t = Instant::now();
                m.pause(Duration::from_secs(2))?;
                let child = m.fork(&format!("s{r}-{i}"), &VmOptions::default())?;
                m.resume()?;
                sum += t.elapsed();
                drop(child);
            }
            singles.push(sum);
        }
        let (c, s) = (median(cluster), median(singles));
        // A failed stand-in leaves its column empty and says why (the k7d
        // columns are the bench's subject).
        let q = if qemu.is_empty() {
            None
        } else {
            match (0..qemu_runs)
                .map(|r| qemu_cluster(&qemu, n, r as u32))
                .collect::<Result<Vec<_>>>()
            {
                Ok(v) => Some(median(v)),
                Err(e) => {
                    println!("(the QEMU stand-in failed at {pct}%: {e:#})");
                    None
                }
            }
        };
        println!(
            "{:>5}% {:>14.2} {:>16.2} {:>7.2} | {:>12} | {:>14} {:>8}",
            pct,
            ms(c),
            ms(s),
            ms(c) / ms(s),
            if ms(c) <= 1.3 * ms(s) { "met" } else { "not met" },
            q.map_or("-".into(), |q| format!("{:.1}", ms(q))),
            q.map_or("-".into(), |q| format!("{:.3}", ms(c) / ms(q)))
        );
    }

    drop(refs);
    for mut m in members {
        m.stop();
    }

    // Batches: fresh members (bases frozen by a first fork), 1 % of their
    // pages dirtied before each measurement, as a running cluster would.
    let fresh: Vec<Vm> = (0..MEMBERS)
        .map(|i| idle_vm(&format!("b{i}"), MIB))
        .collect::<Result<_>>()?;
    let refs: Vec<&Vm> = fresh.iter().collect();
    let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
    drop(held.fork(&ids(1, 300), |_| VmOptions::default())?);
    held.resume()?;
    let n = pages / 100;
    let shape = fresh[0].shape();
    let pool = ShellPool::new();
    // [shells off, shells ready] x [single cluster forks, batch], per cluster.
    let mut cells: [[Vec<Duration>; 2]; 2] = Default::default();
    let mut shell_cost = Vec::new();
    for r in 0..batches {
        for (mode, cell) in cells.iter_mut().enumerate() {
            let shells = (mode == 1).then_some(&*pool);
            // `batch` cluster forks one after another (each its own pause)...
            let mut sum = Duration::ZERO;
            for f in 0..batch {
                for m in &fresh {
                    dirty(m, MIB, n / batch as u64, (r * batch + f) as u32);
                }
                if let Some(p) = shells {
                    p.fill(shape, MEMBERS)?;
                }
                let t = Instant::now();
                let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
                let c = held.fork_in(&ids(1, 1000 + r * batch + f), |_| VmOptions::default(), shells)?;
                held.resume()?;
                sum += t.elapsed();
                drop(c);
            }
            cell[0].push(sum / batch as u32);
            // ... against one batch of `batch` under one pause, after the
            // same divergence.
            for m in &fresh {
                dirty(m, MIB, n, r as u32 ^ 0x77);
            }
            if let Some(p) = shells {
                let t = Instant::now();
                let made = p.fill(shape, MEMBERS * batch)?;
                shell_cost.push(t.elapsed() / made.max(1) as u32);
            }
            // As the daemon forks a batch: members re-based first when that
            // costs less than every child copying their divergence.
            let t = Instant::now();
            let held = ClusterPause::pause_for_batch(&refs, batch as u32, Duration::from_secs(2))?;
            let c = held.fork_in(&ids(batch, 5000 + r), |_| VmOptions::default(), shells)?;
            held.resume()?;
            cell[1].push(t.elapsed() / batch as u32);
            drop(c);
        }
    }
    for (mode, [singles, per_fork]) in cells.into_iter().enumerate() {
        let (o, b) = (median(singles), median(per_fork));
        println!(
            "batch of {batch} under one pause, {}: {:.2} ms per cluster vs {:.2} ms per cluster for {batch} single cluster forks: {:.2}x (goal <= 0.5: {})",
            if mode == 0 { "shells off" } else { "shells ready" },
            ms(b),
            ms(o),
            ms(b) / ms(o),
            if ms(b) <= 0.5 * ms(o) { "met" } else { "not met" }
        );
    }
    println!(
        "a shell made ahead (KVM VM, memslots, irqchip, PIT, vCPU, its confined thread): {:.2} ms each, off the fork path",
        ms(median(shell_cost))
    );
    drop(refs);
    for mut m in fresh {
        m.stop();
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

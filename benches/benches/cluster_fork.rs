//! Cluster fork (issue 16), side by side in one run: a cluster of 3 × 256
//! MiB members forked under one pause against the sum of three single-VM
//! forks of the same members (each its own pause), at 0 / 1 / 10 % of the
//! pages dirtied since the bases froze; and a batch of N forks under one
//! pause against N cluster forks one after another, per fork. Members are
//! running idle guests (the pause and resume are part of each figure). The
//! QEMU stand-in for three VMs is not measured here (`benches/benches/fork.rs`
//! has QEMU's single-VM equivalent).
//!
//! Goals (issue 16): a cluster fork ≤ 1.3× one single-VM fork of the same
//! total RAM; a batch ≤ 0.5× a single cluster fork per cluster.
//!
//! Run: `cargo bench -p k7d-benches --bench cluster_fork` (root, /dev/kvm).
//! `K7D_BENCH_FORKS` sets the samples per cell (default 11),
//! `K7D_BENCH_BATCH` the batch size (default 8).

use std::time::{Duration, Instant};

use anyhow::Result;
use k7d_benches::env_num;
use k7d_vmm::config::{GuestSpec, VmConfig};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::vstate::cluster::ClusterPause;
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 256;
const MEMBERS: usize = 3;

fn member(id: &str, mib: u64) -> Result<Vm> {
    let cfg = VmConfig {
        id: Some(id.into()),
        memory_mib: mib,
        guest: GuestSpec::Builtin {
            name: "idle".into(),
            args: vec![],
        },
        ..Default::default()
    };
    let mut vm = Vm::new(id, &cfg, &VmOptions::default())?;
    vm.start()?;
    Ok(vm)
}

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

fn main() -> Result<()> {
    let samples = env_num("K7D_BENCH_FORKS", 11);
    let batch = env_num("K7D_BENCH_BATCH", 8);
    let members: Vec<Vm> = (0..MEMBERS)
        .map(|i| member(&format!("m{i}"), MIB))
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(20));
    let refs: Vec<&Vm> = members.iter().collect();
    // Freeze every base with a first fork.
    let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
    drop(held.fork(&ids(1, 0), |_| VmOptions::default())?);
    held.resume()?;

    println!("k7d cluster fork: {MEMBERS} running idle members of {MIB} MiB ({samples} samples per cell, medians)");
    println!(
        "{:>6} {:>14} {:>16} {:>7} | {:>12}",
        "dirty", "cluster ms", "3 singles ms", "ratio", "goal <= 1.3"
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
        println!(
            "{:>5}% {:>14.2} {:>16.2} {:>7.2} | {:>12}",
            pct,
            ms(c),
            ms(s),
            ms(c) / ms(s),
            if ms(c) <= 1.3 * ms(s) { "met" } else { "not met" }
        );
    }

    let mut one = Vec::with_capacity(samples);
    let mut per_fork = Vec::with_capacity(samples);
    for r in 0..samples {
        let t = Instant::now();
        let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
        let c = held.fork(&ids(1, 100 + r), |_| VmOptions::default())?;
        held.resume()?;
        one.push(t.elapsed());
        drop(c);
        let t = Instant::now();
        let held = ClusterPause::pause(&refs, Duration::from_secs(2))?;
        let c = held.fork(&ids(batch, 200 + r), |_| VmOptions::default())?;
        held.resume()?;
        per_fork.push(t.elapsed() / batch as u32);
        drop(c);
    }
    let (o, b) = (median(one), median(per_fork));
    println!(
        "batch of {batch} under one pause: {:.2} ms per fork vs {:.2} ms for one cluster fork: {:.2}x (goal <= 0.5: {})",
        ms(b),
        ms(o),
        ms(b) / ms(o),
        if ms(b) <= 0.5 * ms(o) { "met" } else { "not met" }
    );
    drop(refs);
    for mut m in members {
        m.stop();
    }
    Ok(())
}

//! Re-basing (issue 16, `docs/fork.md` "Re-basing"), side by side in one
//! run: a 256 MiB source running an idle guest, forked once (its base
//! froze), then dirtied by 10 % and by 50 % of its pages; the fork that
//! follows, with re-basing off (the fork copies all that diverged since the
//! first fork) and on (the source was re-based after diverging, as the
//! daemon's `k7d-rebase` thread does past its threshold), against the fork
//! right after a re-base with nothing written since. Each fork is timed
//! from the pause to the resume. The re-base's own cost (all of it, and
//! the source's pause within it) is printed beside.
//!
//! Goal (issue 16): the fork after long divergence ≤ 1.2× the fork right
//! after a re-base.
//!
//! Run: `cargo bench -p k7d-benches --bench rebase` (root, /dev/kvm).
//! `K7D_BENCH_FORKS` sets the samples per cell (default 11).

use std::time::{Duration, Instant};

use anyhow::Result;
use k7d_benches::{env_num, idle_vm};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 256;

/// Dirties `n` pages spread over the RAM (above 1 MiB), the same pages
/// for every round (so the divergence stays `n` pages).
fn dirty(vm: &Vm, n: u64, round: u32) {
    let pages = (MIB << 20) / 4096;
    let stride = (pages / n.max(1)).max(1);
    for i in 0..n {
        let gpa = ((i * stride) % pages * 4096).max(1 << 20);
        let _ = vm.memory().write_obj(round ^ i as u32, GuestAddress(gpa));
    }
}

/// Pause, fork, resume: the fork as a running source pays for it.
fn fork(vm: &Vm, id: &str) -> Result<Duration> {
    let t = Instant::now();
    vm.pause(Duration::from_secs(2))?;
    let child = vm.fork(id, &VmOptions::default())?;
    vm.resume()?;
    let took = t.elapsed();
    drop(child);
    Ok(took)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let samples = env_num("K7D_BENCH_FORKS", 11).max(1);
    let vm = idle_vm("src", MIB)?;
    std::thread::sleep(Duration::from_millis(20));
    fork(&vm, "first")?;
    let pages = (MIB << 20) / 4096;

    // The floor of this table: a fork right after a re-base.
    let mut right_after = Vec::with_capacity(samples);
    for s in 0..samples {
        vm.rebase(Duration::from_secs(2))?;
        right_after.push(fork(&vm, &format!("r{s}"))?.as_secs_f64() * 1000.0);
    }
    let floor = median(right_after);
    println!("k7d re-basing: a running {MIB} MiB source, {samples} samples per cell, medians");
    println!("fork right after a re-base: {floor:.2} ms");
    println!(
        "{:>14} | {:>12} {:>7} | {:>12} {:>7} {:>12} | {:>16} {:>14}",
        "dirtied since", "off: fork ms", "/floor", "on: fork ms", "/floor", "goal <= 1.2", "re-base ms", "its pause ms"
    );
    for pct in [10u64, 50] {
        let n = pages * pct / 100;
        let (mut off, mut on, mut took, mut paused) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in 0..samples {
            // Off: the source diverged by `pct` since its base froze; the
            // fork copies all of it.
            vm.rebase(Duration::from_secs(2))?;
            dirty(&vm, n, s as u32);
            off.push(fork(&vm, &format!("off{pct}-{s}"))?.as_secs_f64() * 1000.0);
            // On: the same divergence, then the re-base the thread makes
            // past its threshold, then the fork.
            dirty(&vm, n, s as u32 ^ 0x5a5a);
            let r = vm.rebase(Duration::from_secs(2))?;
            took.push(r.took_ms);
            paused.push(r.paused_ms);
            on.push(fork(&vm, &format!("on{pct}-{s}"))?.as_secs_f64() * 1000.0);
        }
        let (off, on) = (median(off), median(on));
        println!(
            "{:>13}% | {:>12.2} {:>7.2} | {:>12.2} {:>7.2} {:>12} | {:>16.1} {:>14.2}",
            pct,
            off,
            off / floor,
            on,
            on / floor,
            if on <= 1.2 * floor { "met" } else { "not met" },
            median(took),
            median(paused)
        );
    }
    Ok(())
}

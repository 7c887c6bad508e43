//! Fork latency by guest RAM size and by the fraction of pages dirtied since
//! the source was prepared (frozen), printed with the floor pieces measured in
//! the same run: creating a KVM VM with its memslot, irqchip and vCPU, and
//! materialising the same number of dirty pages into a fresh private mapping.
//!
//! Beside them, in the same run: QEMU 7.2's nearest equivalent of a fork on
//! the same test guest and the same number of non-zero pages (stop, migrate
//! to a file, a new QEMU `-incoming` that file, `cont`;
//! `k7d_benches::qemu_fork`), and the memory each child costs: the process's
//! PSS growth per child (8 children held at once), against the divergence
//! copied into it.
//!
//! Run: `cargo bench -p k7d-benches --bench fork` (root, /dev/kvm).
//! `K7D_BENCH_FORKS` sets the forks per cell (default 21);
//! `K7D_BENCH_SIZES` the RAM sizes in MiB (default 64,256,1024,2048);
//! `K7D_BENCH_QEMU_RUNS` the QEMU runs per cell (default 5; 0 skips QEMU).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k7d_api::config::{GuestSpec, VmConfig};
use k7d_benches::qemu_fork::QemuFork;
use k7d_benches::{env_num, which};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};

fn pct(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn config(mib: u64) -> VmConfig {
    VmConfig {
        memory_mib: mib,
        guest: GuestSpec::Builtin {
            name: "idle".into(),
            args: vec![],
        },
        ..Default::default()
    }
}

/// Dirties `n` pages of the source (spread over its RAM) through its mapping:
/// the same divergence a guest's writes leave, recorded by the bitmap.
fn dirty(vm: &Vm, mib: u64, n: u64, round: u32) {
    let pages = (mib << 20) / 4096;
    let stride = (pages / n.max(1)).max(1);
    for i in 0..n {
        let page = (i * stride) % pages;
        // Skip the low 1 MiB (guest code, IVT).
        let gpa = (page * 4096).max(1 << 20);
        let _ = vm.memory().write_obj(round ^ i as u32, GuestAddress(gpa));
    }
}

/// The floor: KVM VM + memslot + irqchip + PIT + one vCPU.
fn floor_kvm(mib: u64) -> Result<Duration> {
    let t = Instant::now();
    let vm = Vm::new("floor", &config(mib), &VmOptions::default())?;
    let d = t.elapsed();
    drop(vm);
    Ok(d)
}

/// The floor: writing `n` pages into a fresh private mapping (page faults + copy).
fn floor_materialise(mib: u64, n: u64) -> Duration {
    let len = (mib << 20) as usize;
    // SAFETY: a fresh anonymous mapping we own and unmap below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let src = vec![0x5a_u8; 4096];
    let pages = len as u64 / 4096;
    let stride = (pages / n.max(1)).max(1);
    let t = Instant::now();
    for i in 0..n {
        let off = ((i * stride) % pages) as usize * 4096;
        // SAFETY: `off + 4096 <= len` inside our mapping.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (p as *mut u8).add(off), 4096) };
    }
    let d = t.elapsed();
    // SAFETY: unmapping exactly what we mapped.
    unsafe { libc::munmap(p, len) };
    d
}

/// This process's proportional set size in KiB (`/proc/self/smaps_rollup`).
fn pss_kib() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup")?;
    s.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no Pss line in /proc/self/smaps_rollup")
}

fn main() -> Result<()> {
    let forks: usize = std::env::var("K7D_BENCH_FORKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(21);
    let sizes: Vec<u64> = std::env::var("K7D_BENCH_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![64, 256, 1024, 2048]);
    let fractions = [0.0, 0.01, 0.1, 0.25, 0.5];
    let qemu_runs = env_num("K7D_BENCH_QEMU_RUNS", 5);
    let qemu = match (qemu_runs, which("qemu-system-x86_64")) {
        (0, _) => None,
        (_, Some(q)) => Some(q),
        (_, None) => {
            println!("qemu-system-x86_64 not found: the QEMU column is skipped (apt-get install qemu-system-x86)");
            None
        }
    };
    let scratch = std::path::Path::new("/dev/shm").join(format!("k7d-bench-fork-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let bios = scratch.join("hello-bios.bin");
    std::fs::write(&bios, k7d_guest::hello_bios_image())?;
    println!("k7d fork latency ({forks} forks per cell; source paused; child built, not started)");
    println!(
        "{:>6} {:>6} {:>7} {:>8} {:>8} | {:>8} {:>8} {:>6} | {:>8} {:>7} | {:>9} {:>9} {:>6}",
        "RAM",
        "dirty",
        "pages",
        "p50 ms",
        "p99 ms",
        "floor:VM",
        "floor:pg",
        "/floor",
        "QEMU ms",
        "/QEMU",
        "PSS/child",
        "diverged",
        "extra"
    );
    for &mib in &sizes {
        let mut src = Vm::new("src", &config(mib), &VmOptions::default())?;
        src.start()?;
        std::thread::sleep(Duration::from_millis(20));
        src.pause(Duration::from_secs(2))?;
        // Prepare: the first fork freezes the base.
        drop(src.fork("prep", &VmOptions::default())?);
        let q = qemu.as_ref().map(|q| QemuFork::new(q, &bios, &scratch, mib));
        for &f in &fractions {
            let n = (((mib << 20) / 4096) as f64 * f) as u64;
            let mut lat = Vec::new();
            for r in 0..forks {
                dirty(&src, mib, n, r as u32);
                let t = Instant::now();
                let child = src.fork("child", &VmOptions::default())?;
                lat.push(t.elapsed());
                drop(child);
            }
            // Memory per child: PSS growth with `held` children alive (fewer
            // for big VMs, whose diverged copies add up to gigabytes).
            let held_n = if mib <= 256 { 8 } else { 2 };
            let before = pss_kib()?;
            let held = (0..held_n)
                .map(|i| src.fork(&format!("held{i}"), &VmOptions::default()))
                .collect::<Result<Vec<_>, _>>()?;
            let per_child_kib = pss_kib()?.saturating_sub(before) as f64 / held_n as f64;
            drop(held);
            let diverged_kib = (src.ram().diverged_pages().len() * 4) as f64;
            let vm_floor = pct((0..5).map(|_| floor_kvm(mib)).collect::<Result<Vec<_>>>()?, 0.5);
            let mat = pct((0..5).map(|_| floor_materialise(mib, n)).collect(), 0.5);
            let qemu_p50 = match &q {
                Some(q) => Some(pct(
                    (0..qemu_runs).map(|r| q.run(n, r as u32)).collect::<Result<Vec<_>>>()?,
                    0.5,
                )),
                None => None,
            };
            let p50 = pct(lat.clone(), 0.5);
            println!(
                "{:>4}Mi {:>5.0}% {:>7} {:>8.2} {:>8.2} | {:>8.2} {:>8.2} {:>6.2} | {:>8} {:>7} | {:>7.2}Mi {:>7.2}Mi {:>4.2}Mi",
                mib,
                f * 100.0,
                n,
                ms(p50),
                ms(pct(lat, 0.99)),
                ms(vm_floor),
                ms(mat),
                ms(p50) / (ms(vm_floor) + ms(mat)).max(0.001),
                qemu_p50.map_or("-".into(), |d| format!("{:.1}", ms(d))),
                qemu_p50.map_or("-".into(), |d| format!("{:.3}", ms(p50) / ms(d))),
                per_child_kib / 1024.0,
                diverged_kib / 1024.0,
                (per_child_kib - diverged_kib) / 1024.0,
            );
        }
        src.stop();
    }
    let _ = std::fs::remove_dir_all(&scratch);
    println!("note: dirty pages are cumulative since the source was prepared (every fork copies them into the child).");
    println!(
        "PSS/child: this process's PSS growth per child with 8 children held (2 above 256 MiB); diverged: what each child holds copied; extra = PSS/child - diverged (goal <= 1 MiB)."
    );
    println!(
        "QEMU: stop, migrate to a file on tmpfs, a new QEMU -S -incoming it, cont; the source's RAM holds the same non-zero pages."
    );
    println!("goal: p50 <= 5 ms at 256 MiB with 10% dirty.");
    Ok(())
}

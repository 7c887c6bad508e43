//! The latency budgets of `k7d_vmm::budgets`, asserted on real KVM, and the
//! check that `LATENCY_BUDGETS.md` states the same numbers as the code.
//!
//! Timed assertions only hold for optimised builds: in a debug build the
//! timed tests are ignored (run `cargo test --release`, as CI does).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k7d_tests::{TempDir, builtin, read_u32};
use k7d_vmm::budgets::{self, Budget};
use k7d_vmm::{Vm, VmOptions};

/// Timed tests must not overlap: the pause test keeps a vCPU busy, which
/// would slow the boot test on a 2-core host.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn median_of(b: Budget, samples: &[Duration]) -> Duration {
    let m = median(samples.to_vec());
    let max = samples.iter().max().copied().unwrap_or_default();
    eprintln!("{}: median {:?}, max {:?}, budget {:?}", b.name, m, max, b.limit);
    m
}

/// One run of the machine-speed reference (see
/// [`budgets::REFERENCE_TYPICAL`]): fresh memory faulted in and copied into
/// fresh memory, then thread wake-ups. No k7d code runs in it.
fn reference_once() -> Duration {
    const LEN: usize = 16 << 20;
    let fresh = || {
        // SAFETY: a new private anonymous mapping; checked below, unmapped
        // by the caller. mmap, not the allocator: glibc would serve a
        // second 16 MiB from memory it already faulted in.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap of the reference's memory");
        p.cast::<u8>()
    };
    let t = Instant::now();
    let (a, b) = (fresh(), fresh());
    // SAFETY: `a` and `b` are distinct live mappings of LEN bytes each.
    unsafe {
        for off in (0..LEN).step_by(4096) {
            a.add(off).write_volatile(1);
        }
        std::ptr::copy_nonoverlapping(a, b, LEN);
        std::hint::black_box(b.add(LEN - 1).read_volatile());
        libc::munmap(a.cast(), LEN);
        libc::munmap(b.cast(), LEN);
    }
    for _ in 0..20 {
        std::thread::spawn(|| ()).join().unwrap();
    }
    t.elapsed()
}

/// How many times slower than typical the machine runs the reference now.
fn slowdown() -> f64 {
    let m = median((0..9).map(|_| reference_once()).collect());
    m.as_secs_f64() / budgets::REFERENCE_TYPICAL.as_secs_f64()
}

/// Asserts the median of `measure()` against `b`. A median over budget is
/// measured once more before failing: on a shared 2-core machine one burst
/// of other work (a build, the lab's emulator, another tenant of the host)
/// can cover a whole run of samples. The second measurement is bracketed by
/// the machine-speed reference; its limit is scaled by the smaller of the
/// two slowdowns (at most [`budgets::MAX_SLOWDOWN`]). A regression stays
/// over budget both times, and does not slow the reference.
fn check(b: Budget, measure: impl FnMut() -> Vec<Duration>) {
    check_with(b, measure, slowdown);
}

/// [`check`] with the reference read by `reference` (a test whose guest
/// keeps a core busy pauses it while the reference runs, so the reference
/// sees the machine the typical figure was taken on).
fn check_with(b: Budget, mut measure: impl FnMut() -> Vec<Duration>, reference: impl Fn() -> f64) {
    if median_of(b, &measure()) <= b.limit {
        return;
    }
    eprintln!(
        "{}: over budget, measuring once more beside the machine-speed reference",
        b.name
    );
    let before = reference();
    let m = median_of(b, &measure());
    let after = reference();
    let s = before.min(after).clamp(1.0, budgets::MAX_SLOWDOWN);
    let limit = b.limit.mul_f64(s);
    eprintln!(
        "{}: the reference ran {before:.2}x / {after:.2}x its typical {:?}: limit {limit:?}",
        b.name,
        budgets::REFERENCE_TYPICAL
    );
    assert!(
        m <= limit,
        "{}: median {m:?} is over the budget {:?} twice (the second time against {limit:?}, the machine running the reference {s:.2}x slower than typical)",
        b.name,
        b.limit
    );
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "latency budgets are for release builds: cargo test --release"
)]
fn vm_boot_to_first_exit_is_within_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TempDir::new("budget-boot");
    let cfg = builtin("hello", 1, 64, &[]);
    let measure = || {
        (0..21)
            .map(|i| {
                let t0 = Instant::now();
                let mut vm = Vm::new(
                    &format!("b{i}"),
                    &cfg,
                    &VmOptions {
                        serial_log: Some(dir.0.join("serial.log")),
                        ..Default::default()
                    },
                )
                .unwrap();
                vm.start().unwrap();
                vm.wait(Duration::from_secs(5)).expect("hello stops");
                vm.control().first_exit().expect("an exit happened").duration_since(t0)
            })
            .collect()
    };
    check(budgets::VM_BOOT_TO_FIRST_EXIT, measure);
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "latency budgets are for release builds: cargo test --release"
)]
fn vm_build_linux_is_within_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(kernel) = k7d_tests::cached_cloud_kernel() else {
        k7d_test_skip::skip(
            "vm_build_linux_is_within_budget",
            "no Debian cloud kernel in the lab cache (tests/lab/run.sh --fetch puts it there; .ci/run does)",
        );
        return;
    };
    let dir = TempDir::new("budget-build");
    let initrd = dir.0.join("initrd");
    std::fs::write(&initrd, vec![0x5au8; 2 << 20]).unwrap();
    let disk = dir.0.join("disk.raw");
    std::fs::File::create(&disk).unwrap().set_len(64 << 20).unwrap();
    let cfg = k7d_tests::linux_build_config(&kernel, &initrd, &disk);
    cfg.validate().unwrap();
    let measure = || {
        (0..11)
            .map(|i| {
                let t = Instant::now();
                let vm = Vm::new(&format!("lb{i}"), &cfg, &VmOptions::default()).unwrap();
                let d = t.elapsed();
                // What was timed is what the bench breaks down.
                assert!(vm.build_steps().iter().any(|(s, _)| s.starts_with("Linux loaded")));
                d
            })
            .collect()
    };
    check(budgets::VM_BUILD_LINUX, measure);
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "latency budgets are for release builds: cargo test --release"
)]
fn pause_and_resume_are_within_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TempDir::new("budget-pause");
    let mut vm = k7d_tests::boot(
        "p",
        &builtin("memwriter", 1, 16, &[4, 0x20_0000, 1]),
        &dir.0.join("s.log"),
    );
    let counter = |vm: &Vm| read_u32(vm, k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER);
    assert!(k7d_tests::wait_for(Duration::from_secs(10), || counter(&vm) > 100));
    let measure = |vm: &Vm| {
        let (mut pauses, mut resumes) = (Vec::new(), Vec::new());
        for _ in 0..51 {
            std::thread::sleep(Duration::from_millis(2));
            let t = Instant::now();
            vm.pause(Duration::from_secs(2)).unwrap();
            pauses.push(t.elapsed());
            let c = counter(vm);
            std::thread::sleep(Duration::from_millis(1));
            assert_eq!(counter(vm), c, "the guest ran while paused");
            let t = Instant::now();
            vm.resume().unwrap();
            // Resumed means the guest runs again: its counter moves.
            while counter(vm) == c {
                assert!(
                    t.elapsed() < Duration::from_secs(2),
                    "the guest did not run after resume"
                );
                std::hint::spin_loop();
            }
            resumes.push(t.elapsed());
        }
        (pauses, resumes)
    };
    // The guest spins on one of the two cores: the reference runs with it paused.
    let reference = || {
        vm.pause(Duration::from_secs(2)).unwrap();
        let s = slowdown();
        vm.resume().unwrap();
        s
    };
    check_with(budgets::PAUSE, || measure(&vm).0, reference);
    check_with(budgets::RESUME, || measure(&vm).1, reference);
    vm.stop();
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "latency budgets are for release builds: cargo test --release"
)]
fn fork_is_within_budget() {
    use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TempDir::new("budget-fork");
    const MIB: u64 = 256;
    let mut src = k7d_tests::boot("f", &builtin("idle", 1, MIB, &[]), &dir.0.join("s.log"));
    std::thread::sleep(Duration::from_millis(20));
    src.pause(Duration::from_secs(2)).unwrap();
    // Prepare: the first fork freezes the base.
    drop(src.fork("prep", &VmOptions::default()).unwrap());
    let measure = |src: &Vm, dirty_pages: u64| -> Vec<Duration> {
        (0..11)
            .map(|r| {
                let pages = (MIB << 20) / 4096;
                let stride = (pages / dirty_pages.max(1)).max(1);
                for i in 0..dirty_pages {
                    let gpa = ((i * stride) % pages * 4096).max(1 << 20);
                    src.memory().write_obj(r as u32 ^ i as u32, GuestAddress(gpa)).unwrap();
                }
                let t = Instant::now();
                let child = src.fork("child", &VmOptions::default()).unwrap();
                let d = t.elapsed();
                drop(child);
                d
            })
            .collect()
    };
    check(budgets::FORK_256M_CLEAN, || measure(&src, 0));
    check(budgets::FORK_256M_1PCT, || measure(&src, (MIB << 20) / 4096 / 100));
    check(budgets::FORK_256M_10PCT, || measure(&src, (MIB << 20) / 4096 / 10));
    src.stop();

    let mut big = k7d_tests::boot("g", &builtin("idle", 1, 2048, &[]), &dir.0.join("g.log"));
    std::thread::sleep(Duration::from_millis(20));
    big.pause(Duration::from_secs(2)).unwrap();
    drop(big.fork("prep", &VmOptions::default()).unwrap());
    check(budgets::FORK_2G_CLEAN, || {
        (0..11)
            .map(|_| {
                let t = Instant::now();
                let child = big.fork("child", &VmOptions::default()).unwrap();
                let d = t.elapsed();
                drop(child);
                d
            })
            .collect()
    });
    big.stop();
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "latency budgets are for release builds: cargo test --release"
)]
fn cluster_fork_is_within_budget() {
    use k7d_vmm::vstate::cluster::ClusterPause;
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TempDir::new("budget-cluster");
    let mut members: Vec<Vm> = (0..3)
        .map(|i| {
            k7d_tests::boot(
                &format!("m{i}"),
                &builtin("idle", 1, 256, &[]),
                &dir.0.join(format!("m{i}.log")),
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(20));
    let refs: Vec<&Vm> = members.iter().collect();
    // Prepare: the first fork freezes each member's base.
    let held = ClusterPause::pause(&refs, Duration::from_secs(2)).unwrap();
    let ids =
        |n: usize| -> Vec<Vec<String>> { (0..n).map(|f| (0..3).map(|m| format!("c{f}-{m}")).collect()).collect() };
    drop(held.fork(&ids(1), |_| VmOptions::default()).unwrap());
    held.resume().unwrap();
    let pool = k7d_vmm::vstate::shell::ShellPool::new();
    let batch = |forks: usize, shells: bool| -> Vec<Duration> {
        (0..11)
            .map(|_| {
                let pool = shells.then(|| {
                    pool.fill(refs[0].shape(), 3 * forks).unwrap();
                    &*pool
                });
                let t = Instant::now();
                let held = ClusterPause::pause(&refs, Duration::from_secs(2)).unwrap();
                let children = held.fork_in(&ids(forks), |_| VmOptions::default(), pool).unwrap();
                held.resume().unwrap();
                let d = t.elapsed() / forks as u32;
                assert!(children.vms.iter().flatten().all(|c| c.built_in_shell() == shells));
                drop(children);
                d
            })
            .collect()
    };
    check(budgets::CLUSTER_FORK_3X256M_CLEAN, || batch(1, false));
    check(budgets::CLUSTER_BATCH_8_PER_FORK, || batch(8, false));
    check(budgets::CLUSTER_BATCH_8_IN_SHELLS_PER_FORK, || batch(8, true));
    drop(refs);
    for m in &mut members {
        m.stop();
    }
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "latency budgets are for release builds: cargo test --release"
)]
fn restore_is_within_budget() {
    use k7d_guest::{RESULTS_ADDR, result};
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TempDir::new("budget-restore");
    // A 64 MiB guest that keeps writing (its loop counter moves).
    let mut src = k7d_tests::boot(
        "r",
        &builtin("memwriter", 1, 64, &[64, 0x20_0000, 1]),
        &dir.0.join("r.log"),
    );
    std::thread::sleep(Duration::from_millis(50));
    src.pause(Duration::from_secs(2)).unwrap();
    let snap = dir.0.join("snap");
    src.snapshot_to(&snap).unwrap();
    src.stop();
    let counter = RESULTS_ADDR + result::LOOP_COUNTER;
    check(budgets::RESTORE_64M, || {
        (0..11)
            .map(|i| {
                let t = Instant::now();
                let mut vm = Vm::restore_from(&format!("r{i}"), &snap, &VmOptions::default()).unwrap();
                let c0 = read_u32(&vm, counter);
                vm.start().unwrap();
                while read_u32(&vm, counter) == c0 {
                    assert!(t.elapsed() < Duration::from_secs(5), "the restored guest does not run");
                    std::hint::spin_loop();
                }
                let d = t.elapsed();
                vm.stop();
                d
            })
            .collect()
    });
}

/// `LATENCY_BUDGETS.md` and `budgets.rs` agree, row by row.
/// This package's directory in the checkout under test: cargo's
/// `CARGO_MANIFEST_DIR` at run time. The compile-time one names the
/// checkout the binary was built in, and cargo does not rebuild a crate
/// when only its checkout moved (a CI clone reusing another clone's build
/// products ran that clone's lab scenarios: CHALLENGES.md).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

#[test]
fn latency_budgets_md_matches_the_code() {
    let md = std::fs::read_to_string(manifest_dir().join("../LATENCY_BUDGETS.md")).unwrap();
    // The host budgets' table; the lab's bounds below it have their own
    // test (tests/tests/lab.rs, lab_bounds_are_the_ones_latency_budgets_md_lists).
    let host = md.split("## The lab's bounds").next().unwrap_or(&md);
    let mut seen = Vec::new();
    for line in host.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let name = cells[1].trim_matches('`');
        let (num, scale) = match cells[2] {
            c if c.ends_with("µs") => (c.trim_end_matches("µs"), 1e-3),
            c if c.ends_with("ms") => (c.trim_end_matches("ms"), 1.0),
            c => panic!("budget cell {c:?} for {name} has no unit (ms or µs)"),
        };
        let ms = num
            .trim()
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("bad budget cell {:?} for {name}", cells[2]))
            * scale;
        let b = budgets::ALL
            .iter()
            .find(|b| b.name == name)
            .unwrap_or_else(|| panic!("LATENCY_BUDGETS.md lists `{name}`, budgets.rs does not"));
        assert_eq!(
            Duration::from_nanos((ms * 1e6).round() as u64),
            b.limit,
            "`{name}`: the markdown says {ms} ms, the code {:?}",
            b.limit
        );
        seen.push(name.to_string());
    }
    let reference = format!(
        "reference workload: typical {} ms, limits scaled by at most {}x",
        budgets::REFERENCE_TYPICAL.as_millis(),
        budgets::MAX_SLOWDOWN
    );
    assert!(
        md.contains(&reference),
        "LATENCY_BUDGETS.md does not state the code's machine-speed reference: {reference:?}"
    );
    for b in budgets::ALL {
        assert!(
            seen.iter().any(|n| n == b.name),
            "budgets.rs has `{}`, LATENCY_BUDGETS.md does not",
            b.name
        );
    }
}

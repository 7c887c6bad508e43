//! Warm fork of a running VM: byte identity at the fork instant, and
//! isolation in both directions, including the MAP_PRIVATE-over-a-live-file
//! hazard (a child must never see its parent's later writes in a page the
//! child has not touched).

use std::time::{Duration, Instant};

use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::{Reaper, TempDir, boot_churning, builtin, read_u32, wait_for};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 1 << 20;
const PAGES: u32 = 64;
const BASE: u32 = 0x20_0000;

/// Guest RAM as the VM sees it (through its mapping, not the base memfd).
fn ram(vm: &Vm, size: u64) -> Vec<u8> {
    let mut v = vec![0u8; size as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// A `memwriter` that keeps dirtying its 64 pages (ARG2 = 1).
fn churning(dir: &TempDir, mib: u64) -> Vm {
    boot_churning(
        "src",
        &builtin("memwriter", 1, mib, &[PAGES, BASE, 1]),
        &dir.0.join("src.log"),
    )
}

fn opts(dir: &TempDir, name: &str) -> VmOptions {
    VmOptions {
        serial_log: Some(dir.0.join(format!("{name}.log"))),
        ..Default::default()
    }
}

#[test]
fn a_fork_is_isolated_both_ways() {
    const SIZE: u64 = 8 * MIB;
    let dir = TempDir::new("fork-iso");
    let mut src = churning(&dir, SIZE / MIB);
    src.pause(Duration::from_secs(2)).unwrap();
    let at_fork = ram(&src, SIZE);
    let mut child = src.fork("child", &opts(&dir, "child")).unwrap();
    assert_eq!(
        first_diff(&ram(&child, SIZE), &at_fork),
        None,
        "the child differs at the fork instant"
    );

    // The hazard: the parent writes pages the child has never touched, both
    // from its vCPU (memwriter churns its pages) and from the VMM (a page
    // outside the guest's working set). The child must not see any of it.
    let untouched = GuestAddress(6 * MIB + 0x123);
    src.memory().write_obj(0xfeed_f00d_u32, untouched).unwrap();
    src.resume().unwrap();
    let c = read_u32(&src, RESULTS_ADDR + result::LOOP_COUNTER);
    assert!(wait_for(Duration::from_secs(5), || read_u32(
        &src,
        RESULTS_ADDR + result::LOOP_COUNTER
    ) > c + 5000));
    src.pause(Duration::from_secs(2)).unwrap();
    let src_now = ram(&src, SIZE);
    assert_ne!(first_diff(&src_now, &at_fork), None, "the source did not run");
    assert_eq!(
        first_diff(&ram(&child, SIZE), &at_fork),
        None,
        "the child saw its parent's later writes"
    );

    // And the other way: the child runs and writes; the paused source does not change.
    child.start().unwrap();
    assert!(wait_for(Duration::from_secs(5), || read_u32(
        &child,
        RESULTS_ADDR + result::LOOP_COUNTER
    ) > c + 5000));
    child
        .memory()
        .write_obj(0xdead_beef_u32, GuestAddress(7 * MIB))
        .unwrap();
    child.pause(Duration::from_secs(2)).unwrap();
    assert_ne!(first_diff(&ram(&child, SIZE), &at_fork), None, "the child did not run");
    assert_eq!(
        first_diff(&ram(&src, SIZE), &src_now),
        None,
        "the source saw its child's writes"
    );

    // A second fork of the diverged source carries the source's state now
    // (pages written since the first fork come from the dirty log).
    let child2 = src.fork("child2", &opts(&dir, "child2")).unwrap();
    assert_eq!(
        first_diff(&ram(&child2, SIZE), &src_now),
        None,
        "the second fork missed diverged pages"
    );
    // A fork of the child (a grandchild) equals the child.
    let child_now = ram(&child, SIZE);
    let grandchild = child.fork("grandchild", &opts(&dir, "gc")).unwrap();
    assert_eq!(first_diff(&ram(&grandchild, SIZE), &child_now), None);
    drop((grandchild, child2));
    child.stop();
    src.stop();
}

#[test]
fn a_thousand_forks_are_byte_identical_to_the_source_at_the_fork_instant() {
    const SIZE: u64 = 4 * MIB;
    let forks = if cfg!(debug_assertions) { 100 } else { 1000 };
    let dir = TempDir::new("fork-ident");
    let mut src = churning(&dir, SIZE / MIB);
    let t = Instant::now();
    let mut differing = 0usize;
    // The children are dropped on threads of their own (`Reaper`).
    let mut reaper = Reaper::default();
    for i in 0..forks {
        // Let the guest dirty pages between forks.
        std::thread::sleep(Duration::from_micros(500));
        src.pause(Duration::from_secs(2)).unwrap();
        let at_fork = ram(&src, SIZE);
        let child = src.fork(&format!("c{i}"), &opts(&dir, "c")).unwrap();
        let got = ram(&child, SIZE);
        differing += at_fork
            .chunks(4096)
            .zip(got.chunks(4096))
            .filter(|(a, b)| a != b)
            .count();
        reaper.reap(child);
        src.resume().unwrap();
    }
    reaper.finish();
    let c = read_u32(&src, RESULTS_ADDR + result::LOOP_COUNTER);
    src.stop();
    eprintln!("{forks} forks in {:?}; source loop counter {c}", t.elapsed());
    assert_eq!(
        differing, 0,
        "{differing} pages differed between children and their source"
    );
}

#[test]
fn pause_is_total_guest_ram_does_not_change_for_200ms() {
    const SIZE: u64 = 8 * MIB;
    let dir = TempDir::new("pause-total");
    let mut src = churning(&dir, SIZE / MIB);
    let sum = |vm: &Vm| -> u64 {
        // FNV-1a over the whole RAM as the VM sees it.
        ram(vm, SIZE).iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    };
    for _ in 0..5 {
        // Running: RAM changes within a few milliseconds.
        let a = sum(&src);
        std::thread::sleep(Duration::from_millis(5));
        assert_ne!(sum(&src), a, "the guest is not writing, the test proves nothing");
        src.pause(Duration::from_secs(2)).unwrap();
        let p = sum(&src);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(sum(&src), p, "guest RAM changed while the VM was paused");
        src.resume().unwrap();
    }
    src.stop();
}

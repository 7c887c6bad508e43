//! Forks and pauses with a device writing guest RAM: a real virtio-blk
//! function whose driver the test plays (`k7d_tests::blk_driver`) keeps 4 KiB
//! reads in flight into random guest pages while `memwriter` dirties its own
//! pages on the vCPU. The blk worker writes through its own dirty bitmap,
//! which KVM's dirty log does not see: a fork path that forgot to merge it
//! would hand children stale pages, and a pause that left the worker running
//! would let guest RAM change while "paused".

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use k7d_api::config::{DiskConfig, VmConfig};
use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::blk_driver::{BLOCK, BlkDriver, Layout};
use k7d_tests::{Reaper, TempDir, boot, builtin, read_u32, wait_for};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
const PAGE: usize = 4096;
const IMAGE: u64 = 8 * MIB;
const LAYOUT: Layout = Layout {
    ring: 8 * MIB,
    data: 10 * MIB,
    data_pages: 1024,
};

/// An image whose every 4 KiB block differs from every other.
fn image(dir: &TempDir) -> std::path::PathBuf {
    let p = dir.0.join("disk.img");
    let mut v = vec![0u8; IMAGE as usize];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    std::fs::write(&p, v).unwrap();
    p
}

/// `memwriter` churning 64 pages at 2 MiB, plus a read-write disk.
fn config(dir: &TempDir) -> VmConfig {
    let mut c = builtin("memwriter", 1, SIZE / MIB, &[64, 0x20_0000, 1]);
    c.devices.disks.push(DiskConfig {
        path: Some(image(dir)),
        read_only: false,
    });
    c
}

fn ram(vm: &Vm) -> Vec<u8> {
    let mut v = vec![0u8; SIZE as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn differing_pages(a: &[u8], b: &[u8]) -> usize {
    a.chunks(PAGE).zip(b.chunks(PAGE)).filter(|(x, y)| x != y).count()
}

fn counter(vm: &Vm) -> u32 {
    read_u32(vm, RESULTS_ADDR + result::LOOP_COUNTER)
}

#[test]
fn every_fork_equals_its_source_while_blk_reads_land_in_guest_ram() {
    let dir = TempDir::new("fork-blk");
    let cfg = config(&dir);
    let src = boot("src", &cfg, &dir.0.join("src.log"));
    let drv = BlkDriver::init(&src, LAYOUT, IMAGE);
    let forks = if cfg!(debug_assertions) { 100 } else { 1000 };
    std::thread::scope(|s| {
        s.spawn(|| drv.run(&src, 7));
        let _stop = drv.stop_on_drop();
        assert!(
            wait_for(Duration::from_secs(20), || drv.done.load(Ordering::SeqCst) > 100
                && counter(&src) > 1000),
            "the blk reads or memwriter did not start"
        );
        let t0 = Instant::now();
        let (mut with_blk_writes, mut checked_pages) = (0u32, 0usize);
        let mut prev = ram(&src);
        let mut prev_done = drv.done.load(Ordering::SeqCst);
        // The children are dropped on threads of their own (`Reaper`).
        let mut reaper = Reaper::default();
        for i in 0..forks {
            // The guest's driver stops posting (the gate), then the VM
            // pauses: vCPUs parked, the blk worker drained and parked.
            let g = drv.gate();
            src.pause(Duration::from_secs(2)).unwrap();
            let at_fork = ram(&src);
            let done = drv.done.load(Ordering::SeqCst);
            // Pages the blk worker filled since the previous fork are in `at_fork`.
            let data = LAYOUT.data as usize..(LAYOUT.data + LAYOUT.data_pages * BLOCK) as usize;
            let moved = differing_pages(&at_fork[data.clone()], &prev[data]);
            if moved > 0 && done > prev_done {
                with_blk_writes += 1;
                checked_pages += moved;
            }
            let child = src
                .fork(&format!("c{i}"), &VmOptions::default())
                .unwrap_or_else(|e| panic!("fork {i}: {e}"));
            let diff = differing_pages(&ram(&child), &at_fork);
            assert_eq!(
                diff, 0,
                "fork {i}: {diff} pages of the child differ from the source at the fork instant"
            );
            reaper.reap(child);
            src.resume().unwrap();
            drop(g);
            prev = at_fork;
            prev_done = done;
            // The previous interval: blk reads and memwriter run.
            std::thread::sleep(Duration::from_millis(if i % 100 == 0 { 100 } else { 5 }));
        }
        drv.stop();
        assert_eq!(drv.failed.load(Ordering::SeqCst), 0, "some blk reads failed");
        // The check only means something if the device wrote between forks.
        assert!(
            with_blk_writes as usize > forks / 2,
            "only {with_blk_writes} of {forks} intervals had blk writes"
        );
        eprintln!(
            "{forks} forks in {:.1} s, 0 differing pages; {with_blk_writes} intervals with blk writes, {checked_pages} blk-written pages checked",
            t0.elapsed().as_secs_f64()
        );
    });
    let mut src = src;
    src.stop();
}

#[test]
fn pause_is_total_while_the_guest_and_blk_are_busy() {
    use std::os::unix::fs::FileExt;
    let dir = TempDir::new("pause-blk");
    let cfg = config(&dir);
    let vm = boot("busy", &cfg, &dir.0.join("busy.log"));
    let drv = BlkDriver::init(&vm, LAYOUT, IMAGE);
    // The memfd itself: never forked, so the VM writes it directly.
    let sum = |vm: &Vm| {
        let mut buf = vec![0u8; SIZE as usize];
        vm.memfd().read_exact_at(&mut buf, 0).unwrap();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for w in buf.chunks(8) {
            h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x100_0000_01b3);
        }
        h
    };
    std::thread::scope(|s| {
        s.spawn(|| drv.run(&vm, 11));
        let _stop = drv.stop_on_drop();
        assert!(wait_for(Duration::from_secs(20), || drv.done.load(Ordering::SeqCst)
            > 100
            && counter(&vm) > 1000));
        // Busy: the memfd changes within 200 ms while running.
        let a = sum(&vm);
        std::thread::sleep(Duration::from_millis(200));
        assert_ne!(sum(&vm), a, "the workload did not change guest RAM while running");
        for round in 0..5 {
            let g = drv.gate();
            vm.pause(Duration::from_secs(2)).unwrap();
            let (done, count) = (drv.done.load(Ordering::SeqCst), counter(&vm));
            let before = sum(&vm);
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(sum(&vm), before, "round {round}: guest RAM changed while paused");
            assert_eq!(counter(&vm), count);
            vm.resume().unwrap();
            drop(g);
            assert!(
                wait_for(Duration::from_secs(5), || drv.done.load(Ordering::SeqCst) > done + 50
                    && counter(&vm) > count + 1000),
                "round {round}: the guest or the disk did not go on after resume"
            );
        }
        drv.stop();
    });
    assert_eq!(drv.failed.load(Ordering::SeqCst), 0);
    let mut vm = vm;
    vm.stop();
}

#[test]
fn a_started_child_serves_the_reads_in_flight_at_the_fork_from_its_own_disk() {
    let dir = TempDir::new("fork-blk-start");
    let cfg = config(&dir);
    let img = std::fs::read(cfg.devices.disks[0].path.as_ref().unwrap()).unwrap();
    let src = boot("bsrc", &cfg, &dir.0.join("src.log"));
    let drv = BlkDriver::init(&src, LAYOUT, IMAGE).verify_against(img.clone());
    // The source's driver runs a while, then stops with reads in flight:
    // it posts a full batch and the VM pauses right away.
    let mut st = std::thread::scope(|s| {
        let h = s.spawn(|| drv.run(&src, 3));
        assert!(wait_for(Duration::from_secs(20), || drv.done.load(Ordering::SeqCst) > 500));
        drv.stop();
        h.join().unwrap()
    });
    drv.post(&src, &mut st);
    src.pause(Duration::from_secs(2)).unwrap();
    let in_flight = st.in_flight();
    assert!(in_flight > 0);
    let mut child = src.fork("bchild", &VmOptions::default()).unwrap();
    child.start().unwrap();
    src.resume().unwrap();
    // Both go on from the same driver state, each on its own rings, device
    // and copy-on-write disk: the child's device starts at the guest's
    // used.idx, serves what was in flight and what comes after.
    let cdrv = BlkDriver::attach(&child, LAYOUT, IMAGE).verify_against(img.clone());
    let sdrv = BlkDriver::attach(&src, LAYOUT, IMAGE).verify_against(img);
    std::thread::scope(|s| {
        let (cst, sst) = (st.clone(), st);
        let c = s.spawn(|| cdrv.run_from(&child, cst));
        let p = s.spawn(|| sdrv.run_from(&src, sst));
        let _stop = (cdrv.stop_on_drop(), sdrv.stop_on_drop());
        assert!(
            wait_for(Duration::from_secs(20), || cdrv.done.load(Ordering::SeqCst) > 2000
                && sdrv.done.load(Ordering::SeqCst) > 2000),
            "child {} / source {} reads after the fork",
            cdrv.done.load(Ordering::SeqCst),
            sdrv.done.load(Ordering::SeqCst)
        );
        cdrv.stop();
        sdrv.stop();
        let _ = (c.join(), p.join());
    });
    for (who, d) in [("child", &cdrv), ("source", &sdrv), ("source before the fork", &drv)] {
        assert_eq!(d.failed.load(Ordering::SeqCst), 0, "{who}: reads failed");
        assert_eq!(
            d.wrong_data.load(Ordering::SeqCst),
            0,
            "{who}: reads returned other bytes than the disk's"
        );
    }
    eprintln!(
        "{in_flight} reads in flight at the fork; after it the child served {} and the source {}",
        cdrv.done.load(Ordering::SeqCst),
        sdrv.done.load(Ordering::SeqCst)
    );
    child.stop();
    let mut src = src;
    src.stop();
}

/// A fork child is forked in turn while its own blk device writes its RAM:
/// the child's records of those writes (its device's own view, which the
/// child's KVM dirty log does not see) are collected at its own first fork,
/// so each grandchild equals the child at the fork instant.
#[test]
fn every_grandchild_equals_its_parent_while_the_parents_blk_reads_land() {
    let dir = TempDir::new("fork-blk-gc");
    let cfg = config(&dir);
    let src = boot("gsrc", &cfg, &dir.0.join("src.log"));
    let drv = BlkDriver::init(&src, LAYOUT, IMAGE);
    let st = std::thread::scope(|s| {
        let h = s.spawn(|| drv.run(&src, 13));
        assert!(wait_for(Duration::from_secs(20), || drv.done.load(Ordering::SeqCst) > 200));
        drv.stop();
        h.join().unwrap()
    });
    src.pause(Duration::from_secs(2)).unwrap();
    let mut child = src.fork("gchild", &VmOptions::default()).unwrap();
    child.start().unwrap();
    let cdrv = BlkDriver::attach(&child, LAYOUT, IMAGE);
    let rounds = if cfg!(debug_assertions) { 20 } else { 100 };
    std::thread::scope(|s| {
        s.spawn(|| cdrv.run_from(&child, st));
        let _stop = cdrv.stop_on_drop();
        assert!(
            wait_for(Duration::from_secs(20), || cdrv.done.load(Ordering::SeqCst) > 200
                && counter(&child) > 1000),
            "the child's blk reads or memwriter did not start"
        );
        let (mut with_blk_writes, mut prev) = (0usize, ram(&child));
        let data = LAYOUT.data as usize..(LAYOUT.data + LAYOUT.data_pages * BLOCK) as usize;
        // The children are dropped on threads of their own (`Reaper`).
        let mut reaper = Reaper::default();
        for i in 0..rounds {
            let g = cdrv.gate();
            child.pause(Duration::from_secs(2)).unwrap();
            let at_fork = ram(&child);
            if differing_pages(&at_fork[data.clone()], &prev[data.clone()]) > 0 {
                with_blk_writes += 1;
            }
            let grandchild = child
                .fork(&format!("gc{i}"), &VmOptions::default())
                .unwrap_or_else(|e| panic!("fork {i} of the child: {e}"));
            let diff = differing_pages(&ram(&grandchild), &at_fork);
            assert_eq!(
                diff, 0,
                "fork {i} of the child: {diff} pages of the grandchild differ from the child at the fork instant"
            );
            reaper.reap(grandchild);
            child.resume().unwrap();
            drop(g);
            prev = at_fork;
            std::thread::sleep(Duration::from_millis(5));
        }
        cdrv.stop();
        assert!(
            with_blk_writes > rounds / 2,
            "only {with_blk_writes} of {rounds} intervals had blk writes in the child"
        );
        eprintln!("{rounds} forks of a fork child, 0 differing pages; {with_blk_writes} intervals with blk writes");
    });
    assert_eq!(cdrv.failed.load(Ordering::SeqCst), 0, "the child's blk reads failed");
    child.stop();
    let mut src = src;
    src.stop();
}

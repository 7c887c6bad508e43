//! A cluster of VMs forked under one pause (issue 16): every page of every
//! child member equals its source member at the fork instant, over many
//! batches, and each batch pauses each member exactly once.

use std::time::Duration;

use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::{Reaper, TempDir, boot, builtin, read_u32, wait_for};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::vstate::cluster::ClusterPause;
use k7d_vmm::{Vm, VmOptions, VmState};

const MIB: u64 = 1 << 20;
/// Small members: the test reads every page of 3000 children.
const SIZE: u64 = 2 * MIB;
const PAGES: u32 = 64;
const BASE: u32 = 0x10_0000;

fn ram(vm: &Vm) -> Vec<u8> {
    let mut v = vec![0u8; SIZE as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

/// A `memwriter` that keeps dirtying its 64 pages.
fn churning(dir: &TempDir, name: &str) -> Vm {
    let vm = boot(
        name,
        &builtin("memwriter", 1, SIZE / MIB, &[PAGES, BASE, 1]),
        &dir.0.join(format!("{name}.log")),
    );
    assert!(
        wait_for(Duration::from_secs(20), || read_u32(
            &vm,
            RESULTS_ADDR + result::LOOP_COUNTER
        ) > 1000),
        "memwriter {name} did not start churning"
    );
    vm
}

#[test]
fn cluster_forks_equal_their_sources_at_the_instant_with_one_pause_per_batch() {
    // 1000 cluster forks (3000 children) in batches of 4.
    let batches = if cfg!(debug_assertions) { 25 } else { 250 };
    const PER_BATCH: usize = 4;
    let dir = TempDir::new("fork-cluster");
    let mut members: Vec<Vm> = ["a", "b", "c"].iter().map(|n| churning(&dir, n)).collect();
    // The members keep churning between the batches (asserted at the end).
    let counters_at_start: Vec<u32> = members
        .iter()
        .map(|m| read_u32(m, RESULTS_ADDR + result::LOOP_COUNTER))
        .collect();
    let opts = |id: &str| VmOptions {
        serial_log: Some(dir.0.join(format!("{id}.log"))),
        ..Default::default()
    };
    // Each batch's 12 children are dropped on threads of their own: their
    // KVM teardowns overlap (`Reaper`).
    let mut reaper = Reaper::default();
    let mut differing = 0usize;
    let mut children_checked = 0usize;
    let mut rebased = 0usize;
    for b in 0..batches {
        // Let every member dirty pages between batches; before every other
        // batch the VMM writes 150 more pages of each, enough for the
        // batch to re-base its members first (one capture for its four
        // forks, still one pause).
        std::thread::sleep(Duration::from_micros(300));
        if b % 2 == 1 {
            for (i, m) in members.iter().enumerate() {
                for p in 0..150u64 {
                    let gpa = GuestAddress(SIZE - 192 * 4096 + ((p + b as u64) % 192) * 4096);
                    m.memory().write_obj((b * 3 + i) as u32, gpa).unwrap();
                }
            }
        }
        let refs: Vec<&Vm> = members.iter().collect();
        let before: Vec<u64> = refs.iter().map(|m| m.pauses()).collect();
        let held = ClusterPause::pause_for_batch(&refs, PER_BATCH as u32, Duration::from_secs(2)).unwrap();
        rebased += held.rebased().len();
        assert!(refs.iter().all(|m| m.state() == VmState::Paused));
        let at_fork: Vec<Vec<u8>> = refs.iter().map(|m| ram(m)).collect();
        let ids: Vec<Vec<String>> = (0..PER_BATCH)
            .map(|f| ["a", "b", "c"].iter().map(|n| format!("{n}-b{b}-f{f}")).collect())
            .collect();
        let children = held.fork(&ids, opts).unwrap();
        held.resume().unwrap();
        let after: Vec<u64> = refs.iter().map(|m| m.pauses()).collect();
        for (m, (x, y)) in before.iter().zip(&after).enumerate() {
            assert_eq!(y - x, 1, "batch {b}: member {m} was paused {} times", y - x);
        }
        for fork in &children.vms {
            for (m, child) in fork.iter().enumerate() {
                differing += at_fork[m]
                    .chunks(4096)
                    .zip(ram(child).chunks(4096))
                    .filter(|(a, b)| a != b)
                    .count();
                children_checked += 1;
            }
        }
        assert!(
            refs.iter().all(|m| m.state() == VmState::Running),
            "the members run again"
        );
        children.vms.into_iter().flatten().for_each(|c| reaper.reap(c));
    }
    reaper.finish();
    let counters: Vec<u32> = members
        .iter()
        .map(|m| read_u32(m, RESULTS_ADDR + result::LOOP_COUNTER))
        .collect();
    for m in &mut members {
        m.stop();
    }
    eprintln!(
        "{batches} batches of {PER_BATCH} cluster forks of 3 members: {children_checked} children checked, {rebased} member re-bases; loop counters {counters:?}"
    );
    assert_eq!(
        rebased,
        batches / 2 * 3,
        "the batches after the VMM's writes re-base their 3 members, the others (memwriter's 64 pages) do not"
    );
    assert_eq!(children_checked, batches * PER_BATCH * 3);
    for (m, (a, z)) in counters_at_start.iter().zip(&counters).enumerate() {
        assert!(
            z.wrapping_sub(*a) as usize > batches * 100,
            "member {m} barely ran between the batches ({a} -> {z}): the forks did not meet a churning source"
        );
    }
    assert_eq!(
        differing, 0,
        "{differing} pages differed between children and their sources"
    );
}

#[test]
fn a_member_that_cannot_pause_leaves_the_others_running_and_no_child() {
    let dir = TempDir::new("fork-cluster-fail");
    let a = churning(&dir, "a");
    let mut b = churning(&dir, "b");
    b.stop();
    let refs = [&a, &b];
    // b is stopped: it is not paused (nothing runs), but it cannot be forked.
    let held = ClusterPause::pause(&refs, Duration::from_secs(2)).unwrap();
    assert_eq!(a.state(), VmState::Paused);
    let ids = vec![vec!["a-f1".to_string(), "b-f1".to_string()]];
    let e = held
        .fork(&ids, |_| VmOptions::default())
        .err()
        .expect("a stopped member cannot be forked");
    assert!(e.to_string().contains("b"), "{e}");
    drop(held);
    assert_eq!(a.state(), VmState::Running, "dropping the pause resumes what it paused");
    let mismatched = vec![vec!["a-f1".to_string()]];
    let held = ClusterPause::pause(&refs, Duration::from_secs(2)).unwrap();
    let e = held.fork(&mismatched, |_| VmOptions::default()).err().unwrap();
    assert!(e.to_string().contains("1 children for 2 members"), "{e}");
    held.resume().unwrap();
    assert_eq!(a.state(), VmState::Running);
}

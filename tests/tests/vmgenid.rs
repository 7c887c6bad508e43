//! The VM Generation ID (issue 40, `vmm/src/arch/x86_64/vmgenid.rs`): every
//! fork child (one or a batch from one capture, and a child's own child) and
//! every restore gets a fresh ID in guest RAM before it runs, while the rest
//! of its RAM stays byte-identical to the source's at the fork instant; the
//! source keeps its ID; a VM without the device gets none. The guest side
//! (Linux's driver reseeding its RNG) is the lab's `k7d-vmgenid`.

use std::collections::HashSet;
use std::time::Duration;

use k7d_tests::{TempDir, boot_churning, builtin};
use k7d_vmm::arch::x86_64::vmgenid::{self, VMGENID_ADDR};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{RngReseed, Vm, VmConfig, VmOptions};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;

fn opts(dir: &TempDir, name: &str) -> VmOptions {
    VmOptions {
        serial_log: Some(dir.0.join(format!("{name}.log"))),
        ..Default::default()
    }
}

/// Guest RAM as the VM sees it, with the generation ID's 16 bytes zeroed:
/// the one range a child may differ in from its source at the fork instant.
fn ram_but_the_id(vm: &Vm) -> Vec<u8> {
    let mut v = vec![0u8; SIZE as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v[VMGENID_ADDR as usize..VMGENID_ADDR as usize + 16].fill(0);
    v
}

/// The ID as the guest would read it.
fn id_in_ram(vm: &Vm) -> [u8; 16] {
    vmgenid::read_id(vm.memory()).unwrap()
}

/// A `memwriter` dirtying 64 pages, with the VM Generation ID asked for
/// (the real-mode test guests have it only when asked).
fn source(dir: &TempDir, vmgenid: Option<bool>) -> (Vm, VmConfig) {
    let mut cfg = builtin("memwriter", 1, SIZE / MIB, &[64, 0x20_0000, 1]);
    cfg.devices.vmgenid = vmgenid;
    let vm = boot_churning("src", &cfg, &dir.0.join("src.log"));
    (vm, cfg)
}

#[test]
fn every_fork_child_gets_its_own_generation_id_and_nothing_else_differs() {
    let dir = TempDir::new("vmgenid-fork");
    let (mut src, _) = source(&dir, Some(true));
    let g0 = src.generation_id().expect("a VM with the device has an ID");
    assert_eq!(id_in_ram(&src), g0, "the boot's ID is in guest RAM");
    assert_ne!(g0, [0u8; 16]);
    // The real-mode guest has no ACPI, so no driver: its forks would not reseed.
    assert_eq!(src.rng_reseed(), RngReseed::NoDriver);

    src.pause(Duration::from_secs(2)).unwrap();
    let at_fork = ram_but_the_id(&src);
    // A batch: three children of one capture.
    let capture = src.capture().unwrap();
    let kids: Vec<Vm> = (0..3)
        .map(|i| {
            src.fork_from(&capture, &format!("c{i}"), &opts(&dir, &format!("c{i}")))
                .unwrap()
        })
        .collect();
    let mut seen = HashSet::from([g0]);
    for k in &kids {
        let g = k.generation_id().expect("a child of a VM with the device has an ID");
        assert_eq!(id_in_ram(k), g, "{}: the child's ID is not in its RAM", k.id());
        assert!(seen.insert(g), "{}: its ID repeats its source's or a sibling's", k.id());
        assert!(
            ram_but_the_id(k) == at_fork,
            "{}: the child differs from its source beyond the ID",
            k.id()
        );
        // The page is the child's own write: recorded as diverged, so a
        // fork or snapshot of the child carries it.
        let page = k7d_vmm::vstate::memory::memfd_offset_of(VMGENID_ADDR) / 4096;
        assert!(
            k.ram().diverged_pages().contains(&page),
            "{}: the ID's page is not diverged",
            k.id()
        );
    }
    assert_eq!(id_in_ram(&src), g0, "the source's ID changed with its children's");

    // A child of a child gets its own too.
    let gc = kids[0].fork("gc", &opts(&dir, "gc")).unwrap();
    let g = gc.generation_id().unwrap();
    assert_eq!(id_in_ram(&gc), g);
    assert!(seen.insert(g), "the grandchild's ID repeats an ID before it");
    assert!(ram_but_the_id(&gc) == ram_but_the_id(&kids[0]));
    drop(gc);
    drop(kids);
    src.stop();
}

#[test]
fn two_restores_of_one_state_get_two_ids() {
    let dir = TempDir::new("vmgenid-restore");
    let (mut src, cfg) = source(&dir, Some(true));
    src.pause(Duration::from_secs(2)).unwrap();
    let state = src.save_state().unwrap();
    let at_save = ram_but_the_id(&src);
    let g0 = src.generation_id().unwrap();
    let restore = |id: &str| Vm::restore(id, &cfg, &opts(&dir, id), &state, &src.memfd()).unwrap();
    let (a, b) = (restore("r1"), restore("r2"));
    let (ga, gb) = (a.generation_id().unwrap(), b.generation_id().unwrap());
    assert_eq!(
        (id_in_ram(&a), id_in_ram(&b)),
        (ga, gb),
        "each restore's ID is in its RAM"
    );
    assert!(
        ga != gb && ga != g0 && gb != g0,
        "restores share an ID: {ga:02x?} {gb:02x?} {g0:02x?}"
    );
    assert!(ram_but_the_id(&a) == at_save && ram_but_the_id(&b) == at_save);
    drop((a, b));
    src.stop();
}

#[test]
fn without_the_device_a_child_is_identical_to_its_source_and_gets_no_id() {
    let dir = TempDir::new("vmgenid-off");
    // Unset: off for the real-mode guests (on for Linux, `VmConfig::vmgenid`).
    let (mut src, cfg) = source(&dir, None);
    assert!(!cfg.vmgenid());
    assert_eq!((src.generation_id(), src.rng_reseed()), (None, RngReseed::Off));
    assert!(src.first_unreseeded_fork(), "the first fork of such a source is warned");
    assert!(!src.first_unreseeded_fork(), "once per source");
    src.pause(Duration::from_secs(2)).unwrap();
    let mut at_fork = vec![0u8; SIZE as usize];
    src.memory().read_slice(&mut at_fork, GuestAddress(0)).unwrap();
    let child = src.fork("c", &opts(&dir, "c")).unwrap();
    let mut got = vec![0u8; SIZE as usize];
    child.memory().read_slice(&mut got, GuestAddress(0)).unwrap();
    assert!(got == at_fork, "a child without the device differs from its source");
    assert_eq!(child.generation_id(), None);
    drop(child);
    src.stop();
}

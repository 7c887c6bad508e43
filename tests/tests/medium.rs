//! A read-only drive changes its medium while the VM runs (`Vm::change_medium`,
//! the daemon's `medium` op): the containerd shim's way to give a running pod
//! VM an app container's image. The test plays the guest's virtio-blk driver
//! (`k7d_tests::blk_driver`) on a real VM: it reads the config capacity,
//! sees the configuration-change ISR bit and generation, and reads the new
//! medium's blocks; a fork child and a restored VM carry the medium.

use std::sync::atomic::Ordering;
use std::time::Duration;

use k7d_api::config::DiskConfig;
use k7d_devices::virtio::transport::layout::{self, common};
use k7d_tests::blk_driver::{BlkDriver, Layout};
use k7d_tests::{TempDir, boot, builtin, wait_for};
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 1 << 20;
const IMAGE: u64 = 2 * MIB;
const LAYOUT: Layout = Layout {
    ring: 8 * MIB,
    data: 10 * MIB,
    data_pages: 256,
};

fn bar0(vm: &Vm) -> u64 {
    vm.virtio_functions()
        .into_iter()
        .find(|(n, _)| *n == "blk")
        .map(|(_, b)| b)
        .unwrap()
}

/// The drive's capacity in sectors, as the guest reads it.
fn capacity(vm: &Vm) -> u64 {
    let mut c = [0u8; 8];
    assert!(vm.mmio_read(bar0(vm) + layout::DEVICE_CFG_OFFSET, &mut c));
    u64::from_le_bytes(c)
}

fn generation(vm: &Vm) -> u8 {
    let mut g = [0u8];
    assert!(vm.mmio_read(bar0(vm) + layout::COMMON_CFG_OFFSET + common::CONFIG_GENERATION, &mut g));
    g[0]
}

/// Reads (and so clears) the ISR.
fn isr(vm: &Vm) -> u8 {
    let mut b = [0u8];
    assert!(vm.mmio_read(bar0(vm) + layout::ISR_CFG_OFFSET, &mut b));
    b[0]
}

fn image(dir: &TempDir, name: &str, seed: u8) -> (std::path::PathBuf, Vec<u8>) {
    let p = dir.0.join(name);
    let v: Vec<u8> = (0..IMAGE as usize)
        .map(|i| (i / 4096) as u8 ^ seed ^ (i as u8))
        .collect();
    std::fs::write(&p, &v).unwrap();
    (p, v)
}

/// Reads through `drv` until `n` completed, or the limit passes.
fn read_some(vm: &Vm, drv: &BlkDriver, n: u64) {
    std::thread::scope(|s| {
        let h = s.spawn(|| drv.run(vm, 11));
        let _stop = drv.stop_on_drop();
        wait_for(Duration::from_secs(20), || {
            drv.done.load(Ordering::SeqCst) + drv.failed.load(Ordering::SeqCst) >= n
        });
        drv.stop();
        let _ = h.join();
    });
}

#[test]
fn an_empty_drive_takes_an_image_and_a_fork_and_a_restore_carry_it() {
    let dir = TempDir::new("medium");
    let (a, a_bytes) = image(&dir, "a.img", 0x11);
    let (b, b_bytes) = image(&dir, "b.img", 0x5a);
    let mut cfg = builtin("memwriter", 1, 16, &[16, 0x20_0000, 1]);
    cfg.devices.disks.push(DiskConfig::empty());
    let mut vm = boot("med", &cfg, &dir.0.join("med.log"));
    assert_eq!(capacity(&vm), 0, "an empty drive has no sector");
    let drv = BlkDriver::init(&vm, LAYOUT, IMAGE).verify_against(a_bytes.clone());
    let _ = isr(&vm);

    // The image goes in: the capacity, the change signalled (generation, ISR
    // config bit), and reads return its blocks.
    let g = generation(&vm);
    vm.change_medium(0, Some(&a)).unwrap();
    assert_eq!(capacity(&vm), IMAGE / 512);
    assert_eq!(generation(&vm), g.wrapping_add(1));
    assert_eq!(isr(&vm) & 2, 2, "the ISR's configuration-change bit");
    assert_eq!(vm.config().devices.disks[0].path.as_deref(), Some(a.as_path()));
    read_some(&vm, &drv, 200);
    assert!(drv.done.load(Ordering::SeqCst) >= 200, "reads of the new medium");
    assert_eq!(drv.failed.load(Ordering::SeqCst), 0);
    assert_eq!(drv.wrong_data.load(Ordering::SeqCst), 0, "every block is the image's");

    // Another image replaces it while the device is live; a driver that
    // starts over (reset, new rings) reads only its blocks.
    vm.change_medium(0, Some(&b)).unwrap();
    assert_eq!(isr(&vm) & 2, 2);
    let drv_b = BlkDriver::init(&vm, LAYOUT, IMAGE).verify_against(b_bytes);
    read_some(&vm, &drv_b, 200);
    assert!(drv_b.done.load(Ordering::SeqCst) >= 200);
    assert_eq!(drv_b.failed.load(Ordering::SeqCst), 0);
    assert_eq!(
        drv_b.wrong_data.load(Ordering::SeqCst),
        0,
        "served from the second image"
    );

    // A fork child and a restored VM have the medium as it is now.
    vm.pause(Duration::from_secs(2)).unwrap();
    let child = vm.fork("med-c", &VmOptions::default()).unwrap();
    assert_eq!(capacity(&child), IMAGE / 512);
    assert_eq!(child.config().devices.disks[0].path.as_deref(), Some(b.as_path()));
    let state = vm.save_state().unwrap();
    let restored = Vm::restore("med-r", vm.config(), &VmOptions::default(), &state, &vm.memfd()).unwrap();
    assert_eq!(capacity(&restored), IMAGE / 512);
    drop((child, restored));

    // Paused: refused, and the drive keeps its medium.
    let e = vm.change_medium(0, None).unwrap_err().to_string();
    assert_eq!(e, "vm med is paused, cannot change a medium");
    vm.resume().unwrap();

    // Ejected: no sector; a read fails rather than reaching an old medium.
    vm.change_medium(0, None).unwrap();
    assert_eq!(capacity(&vm), 0);
    assert_eq!(vm.config().devices.disks[0].path, None);
    let drv_e = BlkDriver::init(&vm, LAYOUT, IMAGE);
    read_some(&vm, &drv_e, 1);
    assert_eq!(drv_e.done.load(Ordering::SeqCst), 0);
    assert!(
        drv_e.failed.load(Ordering::SeqCst) >= 1,
        "a read of an empty drive fails"
    );

    // Refusals, one sentence each; the drive stays empty.
    let refused =
        |vm: &mut Vm, disk: usize, p: Option<&std::path::Path>| vm.change_medium(disk, p).unwrap_err().to_string();
    assert_eq!(refused(&mut vm, 1, Some(&a)), "vm med has 1 disks, so it has no disk 1");
    assert_eq!(
        refused(&mut vm, 0, Some(std::path::Path::new("/dev/null"))),
        "disk /dev/null cannot be used: a disk must be a regular file"
    );
    let e = refused(&mut vm, 0, Some(&dir.0.join("missing.img")));
    assert!(e.contains("missing.img cannot be used: no such file"), "{e}");
    assert_eq!(capacity(&vm), 0);
}

#[test]
fn a_read_write_drive_keeps_its_medium() {
    let dir = TempDir::new("medium-rw");
    let (a, _) = image(&dir, "a.img", 1);
    let mut cfg = builtin("idle", 1, 16, &[]);
    cfg.devices.disks.push(DiskConfig {
        path: Some(a.clone()),
        read_only: false,
    });
    let mut vm = boot("medrw", &cfg, &dir.0.join("rw.log"));
    let e = vm.change_medium(0, None).unwrap_err().to_string();
    assert_eq!(
        e,
        "disk 0 of vm medrw is read-write; only a read-only drive takes another medium"
    );
    assert_eq!(capacity(&vm), IMAGE / 512);
    // Built, not started (as a restored or forked VM before its start):
    // no worker to tell the driver, so refused.
    let mut ro = builtin("idle", 1, 16, &[]);
    ro.devices.disks.push(DiskConfig::empty());
    let mut created = Vm::new("medcr", &ro, &VmOptions::default()).unwrap();
    let e = created.change_medium(0, Some(&a)).unwrap_err().to_string();
    assert_eq!(e, "vm medcr is created, cannot change a medium");
    assert_eq!(created.config().devices.disks[0].path, None);
    // An empty drive must be declared read-only.
    let mut bad = builtin("idle", 1, 16, &[]);
    bad.devices.disks.push(DiskConfig {
        path: None,
        read_only: false,
    });
    let e = bad.validate_restored().unwrap_err().to_string();
    assert!(
        e.ends_with("disk 0 has no image, and an empty drive is read-only: set read_only"),
        "{e}"
    );
}

//! What a fork child gets besides RAM and vCPU state: its own tap with the
//! source's MAC (removed with the child), its own vsock socket, and a
//! clear refusal of what cannot be carried. And fork byte
//! identity with a NIC writing guest RAM, on the userspace data plane and on
//! kernel vhost-net (whose writes only its dirty log sees): the method of
//! `fork_blk.rs` with frames arriving from the tap while forks are taken.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k7d_api::config::{NicConfig, VsockConfig};
use k7d_guest::{RESULTS_ADDR, result};
use k7d_test_skip::skip;
use k7d_tests::net_driver::{BUF, Layout, NetDriver};
use k7d_tests::wire::Wire;
use k7d_tests::{Reaper, TempDir, boot, builtin, read_u32, wait_for};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};

/// `(tap name, mac)` from a VM's virtio-net line in `devices()`.
fn nic(vm: &Vm) -> (String, String) {
    let d = vm
        .devices()
        .iter()
        .find(|d| d.kind == "virtio-net")
        .expect("a virtio-net device")
        .detail
        .clone();
    let word_after = |key: &str| {
        d.split(key)
            .nth(1)
            .and_then(|r| r.split([',', ' ', ';']).find(|w| !w.is_empty()))
            .unwrap_or_else(|| panic!("no {key} in {d:?}"))
            .to_string()
    };
    (word_after("tap "), word_after("mac "))
}

fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

#[test]
fn a_child_gets_its_own_tap_with_the_sources_mac_and_loses_it_with_the_child() {
    if !k7d_tests::is_root()
        && skip(
            "a_child_gets_its_own_tap_with_the_sources_mac_and_loses_it_with_the_child",
            "creating taps needs root",
        )
    {
        return;
    }
    let dir = TempDir::new("fork-nic");
    let mut cfg = builtin("memwriter", 1, 16, &[64, 0x20_0000, 1]);
    cfg.devices.nics.push(NicConfig::default());
    let src = boot("fnic", &cfg, &dir.0.join("src.log"));
    let (src_tap, src_mac) = nic(&src);
    assert!(link_exists(&src_tap));
    src.pause(Duration::from_secs(2)).unwrap();
    let child = src.fork("fnic-c1", &VmOptions::default()).unwrap();
    let (child_tap, child_mac) = nic(&child);
    assert_ne!(child_tap, src_tap, "the child must not share the source's tap");
    assert_eq!(
        child_mac, src_mac,
        "the guest's driver holds the MAC: the child keeps it"
    );
    assert!(link_exists(&child_tap), "the child's tap {child_tap} does not exist");
    drop(child);
    assert!(!link_exists(&child_tap), "deleting the child left its tap {child_tap}");
    assert!(link_exists(&src_tap), "deleting the child removed the source's tap");
    src.resume().unwrap();
    let mut src = src;
    src.stop();
    drop(src);
    assert!(!link_exists(&src_tap));
}

/// A VM with vsock forks (and snapshots): the child's device listens on a
/// socket of its own (beside the source's by default, or where its
/// `ChildSpec` says), the source keeps its socket, and each socket goes
/// with its VM. The guest's side (the transport reset) is in
/// `devices/tests/vsock.rs` and the lab's k7d-cri pods.
#[test]
fn a_vm_with_vsock_forks_and_each_child_listens_on_its_own_socket() {
    let dir = TempDir::new("fork-vsock");
    let mut cfg = builtin("memwriter", 1, 16, &[64, 0x20_0000, 1]);
    let src_sock = dir.0.join("v.sock");
    cfg.devices.vsock = Some(VsockConfig {
        cid: 3,
        uds: src_sock.clone(),
    });
    let src = boot("fvsock", &cfg, &dir.0.join("src.log"));
    src.pause(Duration::from_secs(2)).unwrap();
    let c1 = src.fork("fvsock-c1", &VmOptions::default()).unwrap();
    let c1_sock = dir.0.join("v.sock-fvsock-c1");
    assert_eq!(c1.config().devices.vsock.as_ref().unwrap().uds, c1_sock);
    assert!(
        is_socket(&c1_sock),
        "the child's socket {} is missing",
        c1_sock.display()
    );
    let chosen = dir.0.join("pod.vsock");
    let capture = src.capture().unwrap();
    let spec = k7d_vmm::ChildSpec {
        vsock_uds: Some(chosen.clone()),
        ..Default::default()
    };
    let c2 = src
        .fork_child(&capture, "fvsock-c2", &VmOptions::default(), None, &spec)
        .unwrap();
    assert!(is_socket(&chosen), "the chosen socket {} is missing", chosen.display());
    // A socket that exists (another VM's) is refused with a sentence and
    // the source's socket is left alone.
    let e = src
        .fork_child(&capture, "fvsock-c3", &VmOptions::default(), None, &spec)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("vsock") && e.contains("pod.vsock") && !e.contains('\n'),
        "{e}"
    );
    assert!(is_socket(&chosen) && is_socket(&src_sock));
    // A snapshot carries no connection and no socket: it is written.
    let snap = dir.0.join("snap");
    src.snapshot_to(&snap).unwrap();
    assert!(snap.is_dir());
    drop((c1, c2));
    assert!(!c1_sock.exists() && !chosen.exists(), "a child's socket outlived it");
    assert!(
        is_socket(&src_sock),
        "deleting the children removed the source's socket"
    );
    src.resume().unwrap();
    let mut src = src;
    src.stop();
    drop(src);
    assert!(!src_sock.exists());
}

fn is_socket(p: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

#[test]
fn a_forked_disk_freezes_its_image_until_the_last_vm_is_gone() {
    use k7d_api::config::DiskConfig;
    let dir = TempDir::new("fork-frozen");
    let img = dir.0.join("disk.img");
    std::fs::write(&img, vec![7u8; 1 << 20]).unwrap();
    let mut cfg = builtin("memwriter", 1, 16, &[64, 0x20_0000, 1]);
    cfg.devices.disks.push(DiskConfig {
        path: Some(img.clone()),
        read_only: false,
    });
    let src = boot("ffrz", &cfg, &dir.0.join("src.log"));
    // Before any fork the image is an ordinary read-write image.
    let probe = |ro: bool| k7d_devices::virtio::block::DiskImage::open(&img, ro).map(drop);
    probe(false).unwrap();
    src.pause(Duration::from_secs(2)).unwrap();
    let child = src.fork("ffrz-c1", &VmOptions::default()).unwrap();
    // Frozen: another VM may read it, not write it.
    let e = probe(false).unwrap_err().to_string();
    assert!(e.contains("frozen base") && !e.contains('\n'), "{e}");
    probe(true).unwrap();
    // A snapshot could not carry what the overlays hold: refused, nothing written.
    let snap = dir.0.join("snap");
    let e = src.snapshot_to(&snap).unwrap_err().to_string();
    assert!(e.contains("cannot be snapshotted") && e.contains("disk 0"), "{e}");
    assert!(!snap.exists());
    // The lock outlives the source while a child holds the base.
    src.resume().unwrap();
    let mut src = src;
    src.stop();
    drop(src);
    assert!(
        probe(false).is_err(),
        "the base was writable while a child still read it"
    );
    drop(child);
    probe(false).unwrap();
}

#[test]
fn a_snapshot_keeps_the_nic_mac_when_restored_under_another_id() {
    if !k7d_tests::is_root()
        && skip(
            "a_snapshot_keeps_the_nic_mac_when_restored_under_another_id",
            "creating taps needs root",
        )
    {
        return;
    }
    let dir = TempDir::new("snap-mac");
    let mut cfg = builtin("memwriter", 1, 16, &[64, 0x20_0000, 1]);
    cfg.devices.nics.push(NicConfig::default());
    let src = boot("smac", &cfg, &dir.0.join("src.log"));
    let (_, mac) = nic(&src);
    src.pause(Duration::from_secs(2)).unwrap();
    let snap = dir.0.join("snap");
    src.snapshot_to(&snap).unwrap();
    let mut src = src;
    src.stop();
    drop(src);
    let restored = Vm::restore_from("smac-restored", &snap, &VmOptions::default()).unwrap();
    assert_eq!(nic(&restored).1, mac, "the restored guest's driver holds the old MAC");
}

#[test]
fn a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on() {
    if (!k7d_tests::is_root() || !std::path::Path::new("/dev/vhost-net").exists())
        && skip(
            "a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on",
            "needs root and /dev/vhost-net (this host's kernel has no vhost_net; the lab runs this test in L1: host-tests-l1)",
        )
    {
        return;
    }
    let dir = TempDir::new("fork-vhost");
    let mut cfg = builtin("memwriter", 1, 16, &[64, 0x20_0000, 1]);
    cfg.devices.nics.push(NicConfig {
        vhost: Some(true),
        ..Default::default()
    });
    let src = boot("fvh", &cfg, &dir.0.join("src.log"));
    assert!(
        src.devices()
            .iter()
            .any(|d| d.kind == "virtio-net" && d.detail.contains("vhost: on")),
        "{:?}",
        src.devices()
    );
    src.pause(Duration::from_secs(2)).unwrap();
    // The first fork switches the kernel's log on (the device is paused);
    // a second fork drains it; both children get their own vhost NIC.
    let c1 = src.fork("fvh-c1", &VmOptions::default()).unwrap();
    src.resume().unwrap();
    src.pause(Duration::from_secs(2)).unwrap();
    let c2 = src.fork("fvh-c2", &VmOptions::default()).unwrap();
    for c in [&c1, &c2] {
        let (tap, mac) = nic(c);
        assert_eq!(mac, nic(&src).1);
        assert!(link_exists(&tap));
    }
    drop((c1, c2));
    src.resume().unwrap();
    let mut src = src;
    src.stop();
}

const MIB: u64 = 1 << 20;
const NET_RAM: u64 = 16 * MIB;
const NET_LAYOUT: Layout = Layout {
    ring: 8 * MIB,
    data: 10 * MIB,
    data_pages: 1024,
};

fn whole_ram(vm: &Vm) -> Vec<u8> {
    let mut v = vec![0u8; NET_RAM as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn differing_pages(a: &[u8], b: &[u8]) -> usize {
    a.chunks(4096).zip(b.chunks(4096)).filter(|(x, y)| x != y).count()
}

/// Forks taken while frames arrive from the tap: `memwriter` churns its pages
/// on the vCPU, the played driver keeps RX buffers posted in 1024 data pages
/// and a wire floods the tap; each fork (the driver gated, the VM paused)
/// must equal the source at the fork instant, page for page. How many forks:
/// `K7D_FORK_ROUNDS` (the lab's L1 uses fewer), else 300 (30 in debug).
fn every_fork_equals_its_source_while_frames_land(id: &str, vhost: bool) {
    let dir = TempDir::new(id);
    let mut cfg = builtin("memwriter", 1, NET_RAM / MIB, &[64, 0x20_0000, 1]);
    cfg.devices.nics.push(NicConfig {
        vhost: Some(vhost),
        ..Default::default()
    });
    let src = boot(id, &cfg, &dir.0.join("src.log"));
    let plane = if vhost { "vhost: on" } else { "vhost: off" };
    assert!(
        src.devices()
            .iter()
            .any(|d| d.kind == "virtio-net" && d.detail.contains(plane)),
        "{:?}",
        src.devices()
    );
    let (tap, _) = nic(&src);
    let ifindex: u32 = std::fs::read_to_string(format!("/sys/class/net/{tap}/ifindex"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let wire = Wire::open(ifindex).unwrap();
    let drv = NetDriver::init(&src, NET_LAYOUT);
    let forks: usize = std::env::var("K7D_FORK_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) { 30 } else { 300 });
    let counter = |vm: &Vm| read_u32(vm, RESULTS_ADDR + result::LOOP_COUNTER);
    let flooding = AtomicBool::new(false);
    let stop_flood = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| drv.run(&src, 5));
        s.spawn(|| {
            flooding.store(true, Ordering::SeqCst);
            wire.flood(1000, &stop_flood)
        });
        struct Stop<'a>(&'a NetDriver, &'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.stop();
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let _stop = Stop(&drv, &stop_flood);
        assert!(
            wait_for(Duration::from_secs(20), || drv.received.load(Ordering::SeqCst) > 100
                && counter(&src) > 1000),
            "no frames reached the guest ({} received) or memwriter did not start",
            drv.received.load(Ordering::SeqCst)
        );
        let t0 = Instant::now();
        let (mut with_net_writes, mut checked_pages) = (0usize, 0usize);
        let data = NET_LAYOUT.data as usize..(NET_LAYOUT.data + NET_LAYOUT.data_pages * BUF) as usize;
        let mut prev = whole_ram(&src);
        // The children are dropped on threads of their own (`Reaper`).
        let mut reaper = Reaper::default();
        for i in 0..forks {
            let g = drv.gate();
            src.pause(Duration::from_secs(5)).unwrap();
            let at_fork = whole_ram(&src);
            let moved = differing_pages(&at_fork[data.clone()], &prev[data.clone()]);
            if moved > 0 {
                with_net_writes += 1;
                checked_pages += moved;
            }
            let child = src
                .fork(&format!("{id}-c{i}"), &VmOptions::default())
                .unwrap_or_else(|e| panic!("fork {i}: {e}"));
            let diff = differing_pages(&whole_ram(&child), &at_fork);
            assert_eq!(
                diff, 0,
                "fork {i}: {diff} pages of the child differ from the source at the fork instant ({plane})"
            );
            reaper.reap(child);
            src.resume().unwrap();
            drop(g);
            prev = at_fork;
            std::thread::sleep(Duration::from_millis(if i % 50 == 0 { 50 } else { 5 }));
        }
        // The check only means something if the device wrote between forks.
        assert!(
            with_net_writes > forks / 2,
            "only {with_net_writes} of {forks} intervals had frames written into guest RAM"
        );
        eprintln!(
            "{forks} forks ({plane}) in {:.1} s, 0 differing pages; {with_net_writes} intervals with RX writes, {checked_pages} RX-written pages checked, {} frames received",
            t0.elapsed().as_secs_f64(),
            drv.received.load(Ordering::SeqCst)
        );
    });
    let mut src = src;
    src.stop();
}

#[test]
fn every_fork_equals_its_source_while_frames_land_through_the_userspace_nic() {
    if !k7d_tests::is_root()
        && skip(
            "every_fork_equals_its_source_while_frames_land_through_the_userspace_nic",
            "creating taps and AF_PACKET sockets needs root",
        )
    {
        return;
    }
    every_fork_equals_its_source_while_frames_land("fbnet", false);
}

#[test]
fn every_fork_equals_its_source_while_frames_land_through_vhost_net() {
    if (!k7d_tests::is_root() || !std::path::Path::new("/dev/vhost-net").exists())
        && skip(
            "every_fork_equals_its_source_while_frames_land_through_vhost_net",
            "needs root and /dev/vhost-net (this host's kernel has no vhost_net; the lab runs this test in L1: host-tests-l1)",
        )
    {
        return;
    }
    every_fork_equals_its_source_while_frames_land("fbvh", true);
}

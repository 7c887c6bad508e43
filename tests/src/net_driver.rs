//! The guest's virtio-net driver, RX side, played from the host against a
//! VM's real virtio-pci function (as `blk_driver` does for blk): the test
//! programs the transport through the VM's MMIO bus and keeps RX buffers
//! posted in random data pages of guest RAM, while a [`crate::wire::Wire`] on the tap's
//! host side sends frames. The device (the userspace worker, or the kernel
//! with vhost-net) writes each frame into guest RAM, which is what the fork
//! tests need: a writer of guest RAM that KVM's dirty log does not see.
//!
//! The driver writes guest RAM (descriptors, avail ring) only while it holds
//! [`NetDriver::gate`]: a test takes the gate to stand for "the guest is
//! paused" before it pauses the VM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use k7d_devices::virtio::transport::layout::{self, common};
use k7d_vmm::Vm;
use vm_memory::{Address, Bytes, GuestAddress};

/// Queue size the driver programs (RX and TX).
pub const QSIZE: u16 = 64;
/// RX buffers posted at most.
pub const QD: u16 = 16;
/// Bytes per RX buffer (one page: a frame never spans two).
pub const BUF: u64 = 4096;
const F_WRITE: u16 = 2;

/// Where the driver keeps its rings and buffers in guest RAM.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// RX descriptor table (avail ring at +0x400, used ring at +0x1000); the
    /// TX queue, which the driver enables but never uses, at +0x4000.
    pub ring: u64,
    /// First data page.
    pub data: u64,
    /// Number of data pages frames land in.
    pub data_pages: u64,
}

impl Layout {
    fn desc(&self, q: u16) -> u64 {
        self.ring + 0x4000 * u64::from(q)
    }
    fn avail(&self, q: u16) -> u64 {
        self.desc(q) + 0x400
    }
    fn used(&self, q: u16) -> u64 {
        self.desc(q) + 0x1000
    }
}

/// The played RX driver of one virtio-net function.
pub struct NetDriver {
    bar0: u64,
    layout: Layout,
    gate: Mutex<()>,
    stop: AtomicBool,
    /// Frames the device placed in RX buffers.
    pub received: AtomicU64,
}

fn mmio_w(vm: &Vm, addr: u64, data: &[u8]) {
    assert!(vm.mmio_write(addr, data), "no device at {addr:#x}");
}

impl NetDriver {
    /// Initializes the VM's first virtio-net function (features: VERSION_1
    /// only: one queue pair, 12-byte headers), sets up RX and TX at `layout`
    /// and brings the device to DRIVER_OK.
    pub fn init(vm: &Vm, layout: Layout) -> Self {
        let bar0 = vm
            .virtio_functions()
            .into_iter()
            .find(|(n, _)| *n == "net")
            .map(|(_, b)| b)
            .expect("the VM has a net function");
        let cfg = bar0 + layout::COMMON_CFG_OFFSET;
        vm.memory()
            .write_slice(&[0u8; 0x8000], GuestAddress(layout.ring))
            .unwrap();
        for st in [0u8, 1, 3] {
            mmio_w(vm, cfg + common::DEVICE_STATUS, &[st]);
        }
        mmio_w(vm, cfg + common::DRIVER_FEATURE_SELECT, &1u32.to_le_bytes());
        mmio_w(vm, cfg + common::DRIVER_FEATURE, &1u32.to_le_bytes()); // VERSION_1 (bit 32)
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[0xb]);
        let mut st = [0u8];
        vm.mmio_read(cfg + common::DEVICE_STATUS, &mut st);
        assert_eq!(st[0] & 8, 8, "the device refused FEATURES_OK");
        for q in 0..2u16 {
            mmio_w(vm, cfg + common::QUEUE_SELECT, &q.to_le_bytes());
            mmio_w(vm, cfg + common::QUEUE_SIZE, &QSIZE.to_le_bytes());
            mmio_w(vm, cfg + common::QUEUE_DESC, &layout.desc(q).to_le_bytes());
            mmio_w(vm, cfg + common::QUEUE_DRIVER, &layout.avail(q).to_le_bytes());
            mmio_w(vm, cfg + common::QUEUE_DEVICE, &layout.used(q).to_le_bytes());
            mmio_w(vm, cfg + common::QUEUE_ENABLE, &1u16.to_le_bytes());
        }
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[0xf]);
        vm.mmio_read(cfg + common::DEVICE_STATUS, &mut st);
        assert_eq!(st[0], 0xf, "the device did not go live (status {:#x})", st[0]);
        Self {
            bar0,
            layout,
            gate: Mutex::new(()),
            stop: AtomicBool::new(false),
            received: AtomicU64::new(0),
        }
    }

    /// Holding this, the driver writes nothing into guest RAM.
    pub fn gate(&self) -> MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes [`Self::run`] return.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Keeps `QD` RX buffers posted, in random pages of each slot's share,
    /// until [`Self::stop`].
    pub fn run(&self, vm: &Vm, seed: u64) {
        let (mut free, mut avail_idx, mut last_used, mut rnd) = ((0..QD).collect::<Vec<_>>(), 0u16, 0u16, seed | 1);
        let mem = vm.memory();
        let l = self.layout;
        while !self.stop.load(Ordering::SeqCst) {
            if !free.is_empty() {
                let _g = self.gate();
                while let Some(slot) = free.pop() {
                    rnd ^= rnd << 13;
                    rnd ^= rnd >> 7;
                    rnd ^= rnd << 17;
                    let share = (l.data_pages / u64::from(QD)).max(1);
                    let page = (u64::from(slot) * share + rnd % share) % l.data_pages;
                    let at = GuestAddress(l.desc(0) + 16 * u64::from(slot));
                    mem.write_obj(l.data + page * BUF, at).unwrap();
                    mem.write_obj(BUF as u32, at.unchecked_add(8)).unwrap();
                    mem.write_obj(F_WRITE, at.unchecked_add(12)).unwrap();
                    mem.write_obj(0u16, at.unchecked_add(14)).unwrap();
                    let entry = l.avail(0) + 4 + 2 * u64::from(avail_idx % QSIZE);
                    mem.write_obj(slot, GuestAddress(entry)).unwrap();
                    avail_idx = avail_idx.wrapping_add(1);
                }
                fence(Ordering::SeqCst);
                mem.write_obj(avail_idx, GuestAddress(l.avail(0) + 2)).unwrap();
                fence(Ordering::SeqCst);
                mmio_w(vm, self.bar0 + layout::NOTIFY_OFFSET, &0u16.to_le_bytes());
            }
            let used: u16 = mem.read_obj(GuestAddress(l.used(0) + 2)).unwrap();
            fence(Ordering::SeqCst);
            if used == last_used {
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            while last_used != used {
                let e = l.used(0) + 4 + 8 * u64::from(last_used % QSIZE);
                let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
                free.push(id as u16);
                self.received.fetch_add(1, Ordering::SeqCst);
                last_used = last_used.wrapping_add(1);
            }
        }
    }
}

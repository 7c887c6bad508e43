//! The guest's virtio-blk driver, played from the host against a VM's real
//! virtio-pci function: the test programs the transport through the VM's
//! MMIO bus (as a vCPU's MMIO exits would), and keeps 4 KiB reads in flight
//! from random image blocks into random data pages of guest RAM. The real
//! device worker writes those pages (through its own dirty bitmap), which is
//! what the fork tests need: a writer of guest RAM that KVM's dirty log does
//! not see.
//!
//! The driver writes guest RAM (descriptors, headers, avail ring) only while
//! it holds [`BlkDriver::gate`]: a test takes the gate to stand for "the
//! guest is paused" before it pauses the VM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use k7d_devices::virtio::transport::layout::{self, common};
use k7d_vmm::Vm;
use vm_memory::{Address, Bytes, GuestAddress};

/// Queue size the driver programs.
pub const QSIZE: u16 = 64;
/// Requests in flight at most.
pub const QD: u16 = 16;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
/// virtio-blk request type IN (read).
const T_IN: u32 = 0;
/// Bytes per read.
pub const BLOCK: u64 = 4096;

/// Where the driver keeps its rings and buffers in guest RAM.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// Descriptor table (avail ring at +0x400, used ring at +0x1000,
    /// headers at +0x2000, status bytes at +0x3000).
    pub ring: u64,
    /// First data page.
    pub data: u64,
    /// Number of data pages reads land in.
    pub data_pages: u64,
}

impl Layout {
    fn desc(&self) -> u64 {
        self.ring
    }
    fn avail(&self) -> u64 {
        self.ring + 0x400
    }
    fn used(&self) -> u64 {
        self.ring + 0x1000
    }
    fn header(&self, slot: u16) -> u64 {
        self.ring + 0x2000 + 16 * u64::from(slot)
    }
    fn status(&self, slot: u16) -> u64 {
        self.ring + 0x3000 + u64::from(slot)
    }
}

/// Where a driver stopped: its ring positions and what each slot in flight
/// asked for. A fork child's driver goes on from the state its source's
/// driver had at the fork (the rings are in the child's RAM too).
#[derive(Clone, Debug)]
pub struct DriverState {
    free: Vec<u16>,
    avail_idx: u16,
    last_used: u16,
    /// Per slot: (image block, data page) of the read in flight.
    asked: Vec<(u64, u64)>,
    rnd: u64,
}

impl DriverState {
    /// A driver that has posted nothing yet.
    pub fn new(seed: u64) -> Self {
        Self {
            free: (0..QD).collect(),
            avail_idx: 0,
            last_used: 0,
            asked: vec![(0, 0); usize::from(QD)],
            rnd: seed | 1,
        }
    }

    /// Requests posted and not reaped yet.
    pub fn in_flight(&self) -> usize {
        usize::from(QD) - self.free.len()
    }
}

/// The played driver of one blk function.
pub struct BlkDriver {
    bar0: u64,
    layout: Layout,
    image_blocks: u64,
    /// When set, every completed read's data page is compared with it.
    image: Option<Vec<u8>>,
    /// Completed reads whose data differed from the image.
    pub wrong_data: AtomicU64,
    gate: Mutex<()>,
    stop: AtomicBool,
    /// Requests completed with status OK.
    pub done: AtomicU64,
    /// Requests completed with another status (must stay 0).
    pub failed: AtomicU64,
}

/// BAR 0 of the VM's first virtio-blk function.
fn blk_bar0(vm: &Vm) -> u64 {
    vm.virtio_functions()
        .into_iter()
        .find(|(n, _)| *n == "blk")
        .map(|(_, b)| b)
        .expect("the VM has a blk function")
}

fn mmio_w(vm: &Vm, addr: u64, data: &[u8]) {
    assert!(vm.mmio_write(addr, data), "no device at {addr:#x}");
}

impl BlkDriver {
    /// Initializes the VM's first virtio-blk function (features: VERSION_1
    /// only), sets up queue 0 at `layout` and brings the device to DRIVER_OK.
    pub fn init(vm: &Vm, layout: Layout, image_bytes: u64) -> Self {
        let bar0 = blk_bar0(vm);
        let cfg = bar0 + layout::COMMON_CFG_OFFSET;
        let mem = vm.memory();
        // Zero the rings.
        mem.write_slice(&[0u8; 0x4000], GuestAddress(layout.ring)).unwrap();
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[0]);
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[1]);
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[3]);
        mmio_w(vm, cfg + common::DRIVER_FEATURE_SELECT, &1u32.to_le_bytes());
        mmio_w(vm, cfg + common::DRIVER_FEATURE, &1u32.to_le_bytes()); // VERSION_1 (bit 32)
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[0xb]);
        let mut st = [0u8];
        vm.mmio_read(cfg + common::DEVICE_STATUS, &mut st);
        assert_eq!(st[0] & 8, 8, "the device refused FEATURES_OK");
        mmio_w(vm, cfg + common::QUEUE_SELECT, &0u16.to_le_bytes());
        mmio_w(vm, cfg + common::QUEUE_SIZE, &QSIZE.to_le_bytes());
        mmio_w(vm, cfg + common::QUEUE_DESC, &layout.desc().to_le_bytes());
        mmio_w(vm, cfg + common::QUEUE_DRIVER, &layout.avail().to_le_bytes());
        mmio_w(vm, cfg + common::QUEUE_DEVICE, &layout.used().to_le_bytes());
        mmio_w(vm, cfg + common::QUEUE_ENABLE, &1u16.to_le_bytes());
        mmio_w(vm, cfg + common::DEVICE_STATUS, &[0xf]);
        vm.mmio_read(cfg + common::DEVICE_STATUS, &mut st);
        assert_eq!(st[0], 0xf, "the device did not go live (status {:#x})", st[0]);
        Self::attach(vm, layout, image_bytes)
    }

    /// A driver for a blk function that is already live (a fork child's,
    /// restored with the rings its source's driver set up).
    pub fn attach(vm: &Vm, layout: Layout, image_bytes: u64) -> Self {
        let bar0 = blk_bar0(vm);
        Self {
            bar0,
            layout,
            image_blocks: image_bytes / BLOCK,
            image: None,
            wrong_data: AtomicU64::new(0),
            gate: Mutex::new(()),
            stop: AtomicBool::new(false),
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Compares every completed read with `image` (the disk's contents).
    pub fn verify_against(mut self, image: Vec<u8>) -> Self {
        self.image = Some(image);
        self
    }

    /// Holding this, the driver writes nothing into guest RAM.
    pub fn gate(&self) -> MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes [`Self::run`] return.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Stops the driver when dropped: a failing test's unwinding then ends
    /// the driver thread instead of leaving `thread::scope` waiting on it.
    pub fn stop_on_drop(&self) -> StopOnDrop<'_> {
        StopOnDrop(self)
    }

    /// Keeps `QD` reads in flight until [`Self::stop`]; `seed` varies the
    /// random blocks and pages.
    pub fn run(&self, vm: &Vm, seed: u64) -> DriverState {
        self.run_from(vm, DriverState::new(seed))
    }

    /// As [`Self::run`], going on from `st`; returns where it stopped (reads
    /// may still be in flight).
    pub fn run_from(&self, vm: &Vm, mut st: DriverState) -> DriverState {
        while !self.stop.load(Ordering::SeqCst) {
            self.post(vm, &mut st);
            if !self.reap(vm, &mut st) {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        st
    }

    /// Posts a read for every free slot and kicks the device.
    pub fn post(&self, vm: &Vm, st: &mut DriverState) {
        if st.free.is_empty() {
            return;
        }
        let mem = vm.memory();
        let l = self.layout;
        let _g = self.gate();
        while let Some(slot) = st.free.pop() {
            let d = 3 * slot;
            let mut rnd = || {
                st.rnd ^= st.rnd << 13;
                st.rnd ^= st.rnd >> 7;
                st.rnd ^= st.rnd << 17;
                st.rnd
            };
            let block = rnd() % self.image_blocks;
            // Each slot reads into its own share of the pages: two reads in
            // flight never land on the same page.
            let share = (l.data_pages / u64::from(QD)).max(1);
            let page = (u64::from(slot) * share + rnd() % share) % l.data_pages;
            st.asked[usize::from(slot)] = (block, page);
            let h = l.header(slot);
            mem.write_obj(T_IN, GuestAddress(h)).unwrap();
            mem.write_obj(0u32, GuestAddress(h + 4)).unwrap();
            mem.write_obj(block * (BLOCK / 512), GuestAddress(h + 8)).unwrap();
            mem.write_obj(0xffu8, GuestAddress(l.status(slot))).unwrap();
            let desc = |i: u16, addr: u64, len: u32, flags: u16, next: u16| {
                let at = GuestAddress(l.desc() + 16 * u64::from(i));
                mem.write_obj(addr, at).unwrap();
                mem.write_obj(len, at.unchecked_add(8)).unwrap();
                mem.write_obj(flags, at.unchecked_add(12)).unwrap();
                mem.write_obj(next, at.unchecked_add(14)).unwrap();
            };
            desc(d, h, 16, F_NEXT, d + 1);
            desc(d + 1, l.data + page * BLOCK, BLOCK as u32, F_WRITE | F_NEXT, d + 2);
            desc(d + 2, l.status(slot), 1, F_WRITE, 0);
            let entry = l.avail() + 4 + 2 * u64::from(st.avail_idx % QSIZE);
            mem.write_obj(d, GuestAddress(entry)).unwrap();
            st.avail_idx = st.avail_idx.wrapping_add(1);
        }
        fence(Ordering::SeqCst);
        mem.write_obj(st.avail_idx, GuestAddress(l.avail() + 2)).unwrap();
        fence(Ordering::SeqCst);
        mmio_w(vm, self.bar0 + layout::NOTIFY_OFFSET, &0u16.to_le_bytes());
    }

    /// Takes what the device completed; whether there was anything.
    fn reap(&self, vm: &Vm, st: &mut DriverState) -> bool {
        let mem = vm.memory();
        let l = self.layout;
        let used: u16 = mem.read_obj(GuestAddress(l.used() + 2)).unwrap();
        fence(Ordering::SeqCst);
        if used == st.last_used {
            return false;
        }
        while st.last_used != used {
            let e = l.used() + 4 + 8 * u64::from(st.last_used % QSIZE);
            let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
            let slot = (id / 3) as u16;
            let status: u8 = mem.read_obj(GuestAddress(l.status(slot))).unwrap();
            if status == 0 {
                self.done.fetch_add(1, Ordering::SeqCst);
                if let Some(img) = &self.image {
                    let (block, page) = st.asked[usize::from(slot)];
                    let mut got = vec![0u8; BLOCK as usize];
                    mem.read_slice(&mut got, GuestAddress(l.data + page * BLOCK)).unwrap();
                    let want = &img[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize];
                    if got != want {
                        self.wrong_data.fetch_add(1, Ordering::SeqCst);
                    }
                }
            } else {
                self.failed.fetch_add(1, Ordering::SeqCst);
            }
            st.free.push(slot);
            st.last_used = st.last_used.wrapping_add(1);
        }
        true
    }
}

/// See [`BlkDriver::stop_on_drop`].
pub struct StopOnDrop<'a>(&'a BlkDriver);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

//! The virtio-pci transport and virtio-rng, driven the way Linux's
//! virtio_pci_modern driver drives them: config cycles through CF8/CFC and
//! ECAM, BAR accesses through the MMIO bus, real (anonymous mmap) guest
//! memory with a dirty bitmap, and virtio-queue's mock driver-side rings.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k7d_devices::bus::{Bus, SharedDevice};
use k7d_devices::pci::{
    BarAllocator, MsiMessage, MsiRouteError, MsiRouter, PCI_CONFIG_IO_LEN, PCI_CONFIG_IO_PORT, PciConfigIo,
    PciConfigMmio, PciRoot,
};
use k7d_devices::virtio::rng::Rng;
use k7d_devices::virtio::status::*;
use k7d_devices::virtio::transport::VirtioPciDevice;
use k7d_devices::virtio::transport::layout::common;
use k7d_devices::virtio::{GuestMemoryTracked, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{RawDescriptor, split::Descriptor as SplitDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const MEM_SIZE: usize = 16 << 20;
const ECAM_BASE: u64 = 0xe000_0000;
const MMIO32_BASE: u64 = 0xc000_0000;
const QUEUE_BASE: u64 = 0x1_0000;
const QSIZE: u16 = 16;
const PAGE: u64 = 4096;
const CONFIG_VECTOR: u16 = 0;
const QUEUE_VECTOR: u16 = 1;

#[derive(Default)]
struct RecRouter(Mutex<Vec<(u16, MsiMessage, bool)>>);

impl MsiRouter for RecRouter {
    fn route(&self, vector: u16, msg: MsiMessage, masked: bool) -> Result<(), MsiRouteError> {
        self.0.lock().unwrap().push((vector, msg, masked));
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Caps {
    /// (cfg_type -> (bar, offset, length)) for the five virtio caps.
    virtio: Vec<(u8, u8, u32, u32)>,
    notify_mult: u32,
    msix_cap: u64,
    msix_table: u64,
    msix_pba: u64,
    all_ids: Vec<u8>,
}

impl Caps {
    fn offset(&self, cfg_type: u8) -> u64 {
        u64::from(self.virtio.iter().find(|c| c.0 == cfg_type).expect("virtio cap").2)
    }
}

struct Machine {
    mem: Arc<GuestMemoryTracked>,
    pio: Bus,
    mmio: Bus,
    dev: Arc<Mutex<VirtioPciDevice>>,
    router: Arc<RecRouter>,
    slot: u8,
    bar: u64,
    caps: Caps,
}

impl Machine {
    fn new() -> Self {
        Self::on(Arc::new(
            GuestMemoryTracked::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap(),
        ))
    }

    /// A machine on existing guest RAM (a restore target).
    fn on(mem: Arc<GuestMemoryTracked>) -> Self {
        let router = Arc::new(RecRouter::default());
        let vdev = VirtioPciDevice::new(Box::new(Rng::new().unwrap()), mem.clone(), router.clone()).unwrap();
        let dev = Arc::new(Mutex::new(vdev));
        let mut root = PciRoot::new(BarAllocator::new(MMIO32_BASE, 0x1000_0000).unwrap(), None);
        let att = root.add_device(dev.clone()).unwrap();
        let root = Arc::new(Mutex::new(root));
        let mut pio = Bus::new();
        pio.insert(
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_LEN,
            Arc::new(Mutex::new(PciConfigIo::new(root.clone()))),
        )
        .unwrap();
        let mut mmio = Bus::new();
        mmio.insert(ECAM_BASE, 1 << 20, Arc::new(Mutex::new(PciConfigMmio::new(root))))
            .unwrap();
        let bar = att.bars[0];
        let shared: SharedDevice = dev.clone();
        mmio.insert(bar.addr, bar.len, shared).unwrap();
        Self {
            mem,
            pio,
            mmio,
            dev,
            router,
            slot: att.bdf.device,
            bar: 0,
            caps: Caps::default(),
        }
    }

    // ---- config cycles ----
    fn cf8_read(&self, dev: u8, reg: u8) -> u32 {
        let addr = 0x8000_0000u32 | u32::from(dev) << 11 | u32::from(reg & 0xfc);
        assert!(self.pio.write(0xcf8, &addr.to_le_bytes()));
        let mut d = [0u8; 4];
        assert!(self.pio.read(0xcfc, &mut d));
        u32::from_le_bytes(d)
    }
    fn ecam(&self, off: u64) -> u64 {
        ECAM_BASE + (u64::from(self.slot) << 15) + off
    }
    fn cfg_r32(&self, off: u64) -> u32 {
        let mut d = [0u8; 4];
        assert!(self.mmio.read(self.ecam(off), &mut d));
        u32::from_le_bytes(d)
    }
    fn cfg_r8(&self, off: u64) -> u8 {
        let mut d = [0u8; 1];
        assert!(self.mmio.read(self.ecam(off), &mut d));
        d[0]
    }
    fn cfg_w32(&self, off: u64, v: u32) {
        assert!(self.mmio.write(self.ecam(off), &v.to_le_bytes()));
    }
    fn cfg_w16(&self, off: u64, v: u16) {
        assert!(self.mmio.write(self.ecam(off), &v.to_le_bytes()));
    }

    // ---- BAR accesses ----
    fn r(&self, off: u64, n: usize) -> u64 {
        let mut d = [0u8; 8];
        assert!(self.mmio.read(self.bar + off, &mut d[..n]), "BAR read at {off:#x}");
        u64::from_le_bytes(d)
    }
    fn w(&self, off: u64, n: usize, v: u64) {
        assert!(
            self.mmio.write(self.bar + off, &v.to_le_bytes()[..n]),
            "BAR write at {off:#x}"
        );
    }
    fn common_r(&self, reg: u64, n: usize) -> u64 {
        self.r(self.caps.offset(1) + reg, n)
    }
    fn common_w(&self, reg: u64, n: usize, v: u64) {
        self.w(self.caps.offset(1) + reg, n, v)
    }
    fn status(&self) -> u8 {
        self.common_r(common::DEVICE_STATUS, 1) as u8
    }
    fn add_status(&self, bits: u8) {
        self.common_w(common::DEVICE_STATUS, 1, u64::from(self.status() | bits));
    }

    /// What pci_scan_device + pci_read_bases + virtio_pci_modern_probe do.
    fn probe(&mut self) {
        // Enumeration over legacy config cycles: host bridge and our device.
        assert_eq!(self.cf8_read(0, 0), 0x0008_1b36);
        assert_eq!(self.cf8_read(0, 8) >> 8, 0x06_00_00);
        assert_eq!(self.cf8_read(self.slot, 0), 0x1044_1af4, "virtio 1.x rng (0x1040 + 4)");
        assert_eq!(self.cf8_read(self.slot, 8) & 0xff, 1, "modern virtio has revision >= 1");
        assert_eq!(self.cf8_read(self.slot, 0x2c) >> 16, 0x40);
        // BAR sizing over ECAM.
        let orig = self.cfg_r32(0x10);
        assert_eq!(orig & 0xf, 0, "32-bit non-prefetchable memory BAR");
        self.cfg_w32(0x10, 0xffff_ffff);
        assert_eq!(self.cfg_r32(0x10), 0xffff_8000, "32 KiB BAR");
        self.cfg_w32(0x10, orig);
        for bar in 1..6 {
            self.cfg_w32(0x10 + bar * 4, 0xffff_ffff);
            assert_eq!(self.cfg_r32(0x10 + bar * 4), 0, "BAR {bar} is unimplemented");
        }
        self.bar = u64::from(orig & !0xf);
        assert_eq!(self.bar, MMIO32_BASE);
        // Capability walk.
        assert_ne!(self.cfg_r32(4) & (1 << 20), 0, "capability list bit");
        let mut ptr = u64::from(self.cfg_r8(0x34));
        let mut caps = Caps::default();
        while ptr != 0 {
            let id = self.cfg_r8(ptr);
            caps.all_ids.push(id);
            match id {
                0x09 => {
                    let cfg_type = self.cfg_r8(ptr + 3);
                    let bar = self.cfg_r8(ptr + 4);
                    let offset = self.cfg_r32(ptr + 8);
                    let length = self.cfg_r32(ptr + 12);
                    if cfg_type == 2 {
                        caps.notify_mult = self.cfg_r32(ptr + 16);
                    }
                    caps.virtio.push((cfg_type, bar, offset, length));
                }
                0x11 => {
                    caps.msix_cap = ptr;
                    caps.msix_table = u64::from(self.cfg_r32(ptr + 4));
                    caps.msix_pba = u64::from(self.cfg_r32(ptr + 8));
                }
                _ => {}
            }
            ptr = u64::from(self.cfg_r8(ptr + 1));
            assert!(caps.all_ids.len() < 48, "capability loop");
        }
        self.caps = caps;
        // Memory decode + bus master.
        self.cfg_w16(4, 0x6);
    }

    fn msix_entry(&self, v: u16) -> u64 {
        (self.caps.msix_table & !7) + u64::from(v) * 16
    }

    /// pci_alloc_irq_vectors(MSIX) + vp_find_vqs_msix's vector programming.
    fn enable_msix(&self) {
        let ctrl_off = self.caps.msix_cap + 2;
        // Enable with the function masked, program, then unmask (as Linux does).
        self.cfg_w16(ctrl_off, 0xc000);
        for (v, data) in [(CONFIG_VECTOR, 0x30u32), (QUEUE_VECTOR, 0x31)] {
            let e = self.msix_entry(v);
            self.w(e, 4, 0xfee0_0000);
            self.w(e + 4, 4, 0);
            self.w(e + 8, 4, u64::from(data));
            self.w(e + 12, 4, 0);
        }
        self.cfg_w16(ctrl_off, 0x8000);
    }

    /// virtio_dev_probe + vp_modern_find_vqs + virtio_device_ready.
    fn driver_init(&self, features: u64, mq: &MockSplitQueue<'_, GuestMemoryTracked>) {
        self.common_w(common::DEVICE_STATUS, 1, 0);
        assert_eq!(self.status(), 0, "reset completes synchronously");
        self.add_status(ACKNOWLEDGE);
        self.add_status(DRIVER);
        let mut offered = 0u64;
        for sel in 0..2 {
            self.common_w(common::DEVICE_FEATURE_SELECT, 4, sel);
            offered |= self.common_r(common::DEVICE_FEATURE, 4) << (32 * sel);
        }
        assert_ne!(offered & VIRTIO_F_VERSION_1, 0);
        let accept = offered & features;
        for sel in 0..2 {
            self.common_w(common::DRIVER_FEATURE_SELECT, 4, sel);
            self.common_w(common::DRIVER_FEATURE, 4, (accept >> (32 * sel)) & 0xffff_ffff);
        }
        self.add_status(FEATURES_OK);
        assert_ne!(self.status() & FEATURES_OK, 0, "device accepted the features");
        self.common_w(common::CONFIG_MSIX_VECTOR, 2, u64::from(CONFIG_VECTOR));
        assert_eq!(self.common_r(common::CONFIG_MSIX_VECTOR, 2), u64::from(CONFIG_VECTOR));
        assert_eq!(self.common_r(common::NUM_QUEUES, 2), 1);
        self.common_w(common::QUEUE_SELECT, 2, 0);
        assert_eq!(
            self.common_r(common::QUEUE_SIZE, 2),
            256,
            "max size before the driver shrinks it"
        );
        assert_eq!(self.common_r(common::QUEUE_ENABLE, 2), 0);
        self.common_w(common::QUEUE_SIZE, 2, u64::from(QSIZE));
        // vp_iowrite64_twopart: low half then high half.
        for (reg, addr) in [
            (common::QUEUE_DESC, mq.desc_table_addr().0),
            (common::QUEUE_DRIVER, mq.avail_addr().0),
            (common::QUEUE_DEVICE, used_addr(mq).0),
        ] {
            self.common_w(reg, 4, addr & 0xffff_ffff);
            self.common_w(reg + 4, 4, addr >> 32);
        }
        assert_eq!(self.common_r(common::QUEUE_DESC, 8), mq.desc_table_addr().0);
        self.common_w(common::QUEUE_MSIX_VECTOR, 2, u64::from(QUEUE_VECTOR));
        assert_eq!(self.common_r(common::QUEUE_MSIX_VECTOR, 2), u64::from(QUEUE_VECTOR));
        assert_eq!(self.common_r(common::QUEUE_NOTIFY_OFF, 2), 0);
        self.common_w(common::QUEUE_ENABLE, 2, 1);
        self.add_status(DRIVER_OK);
        assert_eq!(self.status(), ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
        assert!(self.dev.lock().unwrap().is_active());
    }

    /// vp_notify: a 16-bit write of the queue index at its notify address.
    fn kick(&self, queue: u16) {
        let off = self.caps.offset(2) + u64::from(queue) * u64::from(self.caps.notify_mult);
        self.w(off, 2, u64::from(queue));
    }

    fn irq_count(&self, v: u16) -> u64 {
        self.dev.lock().unwrap().msix().irqfds()[usize::from(v)]
            .read()
            .unwrap_or(0)
    }

    fn wait_irq(&self, v: u16) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let n = self.irq_count(v);
            if n > 0 || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn dirty_pages(&self) -> Vec<u64> {
        let region = self.mem.iter().next().unwrap();
        let bm = (**region).bitmap();
        (0..MEM_SIZE as u64 / PAGE)
            .filter(|p| bm.is_addr_set((p * PAGE) as usize))
            .collect()
    }

    fn reset_dirty(&self) {
        for r in self.mem.iter() {
            (**r).bitmap().reset();
        }
    }
}

/// The used ring lives on its own page after the mock's descriptor table and
/// available ring. (virtio-queue 0.18's `MockSplitQueue` places its own used
/// ring right after `avail.ring` counted in elements, not bytes, so it
/// overlaps the available ring for queues of more than a few entries.)
fn used_addr(mq: &MockSplitQueue<'_, GuestMemoryTracked>) -> GuestAddress {
    GuestAddress(mq.desc_table_addr().0 + PAGE)
}

fn used_idx(mem: &GuestMemoryTracked, mq: &MockSplitQueue<'_, GuestMemoryTracked>) -> u16 {
    mem.read_obj::<u16>(GuestAddress(used_addr(mq).0 + 2)).unwrap()
}

/// (id, len) of used ring entry `i`.
fn used_elem(mem: &GuestMemoryTracked, mq: &MockSplitQueue<'_, GuestMemoryTracked>, i: usize) -> (u32, u32) {
    let at = used_addr(mq).0 + 4 + 8 * i as u64;
    (
        mem.read_obj::<u32>(GuestAddress(at)).unwrap(),
        mem.read_obj::<u32>(GuestAddress(at + 4)).unwrap(),
    )
}

fn wait_used(mem: &GuestMemoryTracked, mq: &MockSplitQueue<'_, GuestMemoryTracked>, idx: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while used_idx(mem, mq) != idx {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

fn wdesc(addr: u64, len: u32) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(addr, len, VRING_DESC_F_WRITE as u16, 0))
}

fn chain(descs: &[(u64, u32, u16)], first: u16) -> Vec<RawDescriptor> {
    // (addr, len, flags); NEXT/next are filled in so the slice is one chain
    // placed at descriptor index `first`.
    let n = descs.len();
    descs
        .iter()
        .enumerate()
        .map(|(i, (a, l, f))| {
            let (f, next) = if i + 1 < n {
                (f | VRING_DESC_F_NEXT as u16, first + i as u16 + 1)
            } else {
                (*f, 0)
            };
            RawDescriptor::from(SplitDescriptor::new(*a, *l, f, next))
        })
        .collect()
}

#[test]
fn capability_chain_has_msix_and_five_virtio_caps() {
    let mut m = Machine::new();
    m.probe();
    assert_eq!(m.caps.all_ids, vec![0x11, 9, 9, 9, 9, 9]);
    let mut types: Vec<u8> = m.caps.virtio.iter().map(|c| c.0).collect();
    types.sort();
    assert_eq!(types, vec![1, 2, 3, 4, 5]);
    for (t, bar, off, len) in &m.caps.virtio {
        if *t != 5 {
            assert_eq!(*bar, 0);
            assert!(*len > 0, "cap {t} has a length (Linux refuses 0)");
            assert!(u64::from(*off) + u64::from(*len) <= 0x8000, "cap {t} inside BAR 0");
            assert_eq!(off % 4, 0);
        }
    }
    assert_eq!(m.caps.notify_mult, 4);
    // MSI-X: 2 vectors (1 queue + config), table and PBA in BAR 0.
    let ctrl = m.cfg_r32(m.caps.msix_cap) >> 16;
    assert_eq!(ctrl & 0x7ff, 1);
    assert_eq!(m.caps.msix_table & 7, 0);
    assert_eq!(m.caps.msix_pba & 7, 0);
    assert_eq!(m.caps.msix_table, 0x4000);
    assert_eq!(m.caps.msix_pba, 0x6000);
    // Caps are read-only except where the spec says.
    m.cfg_w32(m.caps.msix_cap + 4, 0x1234_5678);
    assert_eq!(u64::from(m.cfg_r32(m.caps.msix_cap + 4)), m.caps.msix_table);
}

#[test]
fn rng_serves_a_request_end_to_end() {
    let mut m = Machine::new();
    m.probe();
    m.enable_msix();
    let mem = m.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    m.driver_init(VIRTIO_F_VERSION_1, &mq);
    // Routes: both vectors were routed unmasked with what the driver programmed.
    let routes = m.router.0.lock().unwrap().clone();
    assert!(routes.contains(&(
        QUEUE_VECTOR,
        MsiMessage {
            address_lo: 0xfee0_0000,
            address_hi: 0,
            data: 0x31
        },
        false
    )));

    // A 2-descriptor request: 4 KiB straddling pages 0x200/0x201, 100 bytes on page 0x300.
    let (a, b) = (0x20_0800u64, 0x30_0000u64);
    mq.add_desc_chains(
        &chain(
            &[
                (a, 4096, VRING_DESC_F_WRITE as u16),
                (b, 100, VRING_DESC_F_WRITE as u16),
            ],
            0,
        ),
        0,
    )
    .unwrap();
    m.reset_dirty();
    let notifications = || {
        let c = m.dev.lock().unwrap().counters();
        c.iter().find(|(k, _)| *k == "notifications").map(|(_, n)| *n)
    };
    assert_eq!(notifications(), Some(0), "no kick yet");
    m.kick(0);
    assert!(wait_used(&mem, &mq, 1), "request completed");
    assert_eq!(m.wait_irq(QUEUE_VECTOR), 1, "queue vector's irqfd fired once");
    assert_eq!(notifications(), Some(1), "the one kick, counted");
    assert_eq!(m.irq_count(CONFIG_VECTOR), 0);
    assert_eq!(used_elem(&mem, &mq, 0), (0, 4196));
    let mut buf = vec![0u8; 4096];
    mem.read_slice(&mut buf, GuestAddress(a)).unwrap();
    assert!(buf.iter().filter(|x| **x == 0).count() < 100, "random, not zeros");
    let mut tail = [0u8; 100];
    mem.read_slice(&mut tail, GuestAddress(b)).unwrap();
    assert_ne!(tail, [0u8; 100]);
    // Dirty bitmap: the data pages and the used-ring page, nothing else.
    let used_page = used_addr(&mq).0 / PAGE;
    assert_ne!(used_page, mq.avail_addr().0 / PAGE);
    let mut expect = vec![used_page, a / PAGE, a / PAGE + 1, b / PAGE];
    expect.sort();
    assert_eq!(m.dirty_pages(), expect);
    // ISR: queue bit, cleared on read.
    let isr = m.caps.offset(3);
    assert_eq!(m.r(isr, 1), 1);
    assert_eq!(m.r(isr, 1), 0);
}

#[test]
fn pause_parks_the_worker_and_resume_serves_what_was_posted() {
    let mut m = Machine::new();
    m.probe();
    m.enable_msix();
    let mem = m.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    m.driver_init(VIRTIO_F_VERSION_1, &mq);
    mq.add_desc_chains(&[wdesc(0x40_0000, 64)], 0).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq, 1));
    let idle = Arc::strong_count(&mem);

    m.dev.lock().unwrap().pause().unwrap();
    assert_eq!(
        Arc::strong_count(&mem),
        idle,
        "pause kept the worker (and its memory handle), it did not drop it"
    );
    // A request posted while paused is not served, and nothing is written.
    mq.add_desc_chains(&[wdesc(0x40_1000, 64)], 1).unwrap();
    m.reset_dirty();
    m.kick(0);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(used_idx(&mem, &mq), 1, "nothing served while paused");
    assert!(m.dirty_pages().is_empty(), "nothing written while paused");

    // Resume continues from the same ring position: the kick that arrived
    // while paused is served (entry 1), not lost and not served twice.
    m.dev.lock().unwrap().resume().unwrap();
    assert!(
        wait_used(&mem, &mq, 2),
        "the request posted while paused is served after resume"
    );
    assert_eq!(used_elem(&mem, &mq, 1), (1, 64));
    mq.add_desc_chains(&[wdesc(0x40_2000, 32)], 2).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq, 3));
    assert_eq!(used_elem(&mem, &mq, 2), (2, 32));
    // Pausing twice, resuming twice: harmless.
    m.dev.lock().unwrap().pause().unwrap();
    m.dev.lock().unwrap().pause().unwrap();
    m.dev.lock().unwrap().resume().unwrap();
    m.dev.lock().unwrap().resume().unwrap();
    // A reset while paused returns the device to idle.
    m.dev.lock().unwrap().pause().unwrap();
    m.common_w(common::DEVICE_STATUS, 1, 0);
    assert!(!m.dev.lock().unwrap().is_active());
    drop(m);
    assert_eq!(
        Arc::strong_count(&mem),
        1,
        "nothing holds guest memory after a reset while paused"
    );
}

#[test]
fn reset_stops_the_worker_and_the_device_comes_back() {
    let mut m = Machine::new();
    m.probe();
    m.enable_msix();
    let mem = m.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    let idle = Arc::strong_count(&mem);
    m.driver_init(VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX, &mq);
    assert_eq!(Arc::strong_count(&mem), idle + 1, "the worker holds guest memory");
    mq.add_desc_chains(&[wdesc(0x40_0000, 64)], 0).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq, 1));

    // Reset: the status write returns only after the worker thread was joined,
    // which dropped its handle on guest memory.
    m.common_w(common::DEVICE_STATUS, 1, 0);
    assert_eq!(m.status(), 0);
    assert!(!m.dev.lock().unwrap().is_active());
    assert_eq!(Arc::strong_count(&mem), idle, "worker thread is gone");
    // Queue registers are back to their reset values.
    m.common_w(common::QUEUE_SELECT, 2, 0);
    assert_eq!(m.common_r(common::QUEUE_ENABLE, 2), 0);
    assert_eq!(m.common_r(common::QUEUE_SIZE, 2), 256);
    assert_eq!(m.common_r(common::QUEUE_MSIX_VECTOR, 2), 0xffff);

    // Nobody serves a kick now.
    mq.add_desc_chains(&[wdesc(0x40_1000, 64)], 1).unwrap();
    m.kick(0);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(used_idx(&mem, &mq), 1);

    // A fresh driver (new rings, as after a guest reboot) gets a working device.
    let mq2 = MockSplitQueue::create(&*mem, GuestAddress(0x8_0000), QSIZE);
    m.driver_init(VIRTIO_F_VERSION_1, &mq2);
    mq2.add_desc_chains(&[wdesc(0x50_0000, 32)], 0).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq2, 1));
    assert_eq!(used_elem(&mem, &mq2, 0), (0, 32));
    drop(m);
    assert_eq!(Arc::strong_count(&mem), 1, "dropping the device stops its worker");
}

#[test]
fn masked_vector_pends_then_delivers_on_unmask() {
    let mut m = Machine::new();
    m.probe();
    m.enable_msix();
    let mem = m.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    m.driver_init(VIRTIO_F_VERSION_1, &mq);
    let ctrl = m.msix_entry(QUEUE_VECTOR) + 12;
    m.w(ctrl, 4, 1);
    assert!(
        m.router.0.lock().unwrap().last().unwrap().2,
        "router told the vector is masked"
    );
    mq.add_desc_chains(&[wdesc(0x40_0000, 16)], 0).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq, 1));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(m.irq_count(QUEUE_VECTOR), 0, "masked: no eventfd write");
    let pba = m.caps.msix_pba & !7;
    assert_eq!(m.r(pba, 8), 1 << QUEUE_VECTOR, "pending bit set");
    m.w(ctrl, 4, 0);
    assert_eq!(m.irq_count(QUEUE_VECTOR), 1, "delivered on unmask");
    assert_eq!(m.r(pba, 8), 0);
    assert!(
        !m.router.0.lock().unwrap().last().unwrap().2,
        "router told the vector is unmasked"
    );

    // Function mask behaves the same.
    let ctrl_off = m.caps.msix_cap + 2;
    m.cfg_w16(ctrl_off, 0xc000);
    mq.add_desc_chains(&[wdesc(0x40_1000, 16)], 1).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq, 2));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(m.irq_count(QUEUE_VECTOR), 0);
    assert_eq!(m.r(pba, 8), 1 << QUEUE_VECTOR);
    m.cfg_w16(ctrl_off, 0x8000);
    assert_eq!(m.irq_count(QUEUE_VECTOR), 1);
}

#[test]
fn malformed_chains_are_returned_empty_and_the_device_keeps_serving() {
    let mut m = Machine::new();
    m.probe();
    m.enable_msix();
    let mem = m.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    m.driver_init(VIRTIO_F_VERSION_1, &mq);
    let w = VRING_DESC_F_WRITE as u16;
    let end = MEM_SIZE as u64;
    // Marker bytes prove nothing was written into the good part of bad chains.
    mem.write_slice(&[0xaa; 64], GuestAddress(0x60_0000)).unwrap();
    let specs: Vec<Vec<(u64, u32, u16)>> = vec![
        vec![(0x40_0000, 64, 0)],                     // device-readable buffer
        vec![(0x60_0000, 64, w), (0x40_0000, 64, 0)], // writable then readable
        vec![(end + 0x1000, 64, w)],                  // outside guest memory
        vec![(end - 32, 64, w)],                      // runs off the end
        vec![(0x7fff_ffff_ffff_0000, u32::MAX, w)],   // absurd
        vec![(0x50_0000, 48, w)],                     // good
    ];
    let mut at = 0u16;
    let mut chains = Vec::new();
    for spec in &specs {
        let c = chain(spec, at);
        mq.add_desc_chains(&c, at).unwrap();
        at += c.len() as u16;
        chains.push(c);
    }
    // A chain whose next pointer loops back onto itself: bounded by the queue
    // size, never a hang; it is served (all its descriptors are writable).
    let looped = RawDescriptor::from(SplitDescriptor::new(0x51_0000, 16, w | VRING_DESC_F_NEXT as u16, at));
    mq.add_desc_chains(&[looped], at).unwrap();
    at += 1;
    // A chain pointing past the descriptor table ends there.
    let dangling = RawDescriptor::from(SplitDescriptor::new(0x52_0000, 16, w | VRING_DESC_F_NEXT as u16, 999));
    mq.add_desc_chains(&[dangling], at).unwrap();
    at += 1;
    m.kick(0);
    assert!(wait_used(&mem, &mq, chains.len() as u16 + 2));
    let lens: Vec<u32> = (0..chains.len() + 2).map(|i| used_elem(&mem, &mq, i).1).collect();
    assert_eq!(&lens[..6], &[0, 0, 0, 0, 0, 48]);
    assert!(lens[6] <= 16 * u32::from(QSIZE), "looped chain bounded: {}", lens[6]);
    assert!(lens[7] <= 16);
    let mut marker = [0u8; 64];
    mem.read_slice(&mut marker, GuestAddress(0x60_0000)).unwrap();
    assert_eq!(marker, [0xaa; 64]);
    assert!(m.wait_irq(QUEUE_VECTOR) >= 1);

    // Still serving.
    mq.add_desc_chains(&[wdesc(0x50_1000, 8)], at).unwrap();
    m.kick(0);
    assert!(wait_used(&mem, &mq, chains.len() as u16 + 3));
    assert_eq!(used_elem(&mem, &mq, chains.len() + 2), (9, 8));
}

#[test]
fn protocol_violations() {
    let mut m = Machine::new();
    m.probe();
    m.enable_msix();
    // Features without VERSION_1: FEATURES_OK is refused (the driver sees it unset).
    m.common_w(common::DEVICE_STATUS, 1, 0);
    m.add_status(ACKNOWLEDGE | DRIVER);
    m.common_w(common::DRIVER_FEATURE_SELECT, 4, 0);
    m.common_w(common::DRIVER_FEATURE, 4, 0);
    m.add_status(FEATURES_OK);
    assert_eq!(m.status() & FEATURES_OK, 0);
    // DRIVER_OK without FEATURES_OK: FAILED, and it sticks until reset.
    m.add_status(DRIVER_OK);
    assert_ne!(m.status() & FAILED, 0);
    m.common_w(common::DEVICE_STATUS, 1, 0xf);
    assert_ne!(m.status() & FAILED, 0);
    assert!(!m.dev.lock().unwrap().is_active());
    m.common_w(common::DEVICE_STATUS, 1, 0);
    assert_eq!(m.status(), 0);
    // A queue outside guest memory: DRIVER_OK leads to NEEDS_RESET and a config interrupt.
    m.add_status(ACKNOWLEDGE | DRIVER);
    m.common_w(common::DRIVER_FEATURE_SELECT, 4, 1);
    m.common_w(common::DRIVER_FEATURE, 4, 1);
    m.add_status(FEATURES_OK);
    m.common_w(common::CONFIG_MSIX_VECTOR, 2, u64::from(CONFIG_VECTOR));
    m.common_w(common::QUEUE_SELECT, 2, 0);
    m.common_w(common::QUEUE_DESC, 8, 0x7000_0000_0000);
    m.common_w(common::QUEUE_ENABLE, 2, 1);
    let gen_before = m.common_r(common::CONFIG_GENERATION, 1);
    m.add_status(DRIVER_OK);
    assert_ne!(m.status() & DEVICE_NEEDS_RESET, 0);
    assert!(!m.dev.lock().unwrap().is_active());
    assert_eq!(m.wait_irq(CONFIG_VECTOR), 1);
    assert_ne!(m.common_r(common::CONFIG_GENERATION, 1), gen_before);
    // Vector numbers beyond the table read back as NO_VECTOR; odd accesses are harmless.
    m.common_w(common::DEVICE_STATUS, 1, 0);
    m.common_w(common::QUEUE_MSIX_VECTOR, 2, 7);
    assert_eq!(m.common_r(common::QUEUE_MSIX_VECTOR, 2), 0xffff);
    m.common_w(common::QUEUE_SELECT, 2, 9);
    assert_eq!(m.common_r(common::QUEUE_SIZE, 2), 0, "no such queue");
    m.common_w(common::QUEUE_ENABLE, 2, 1);
    for off in [0x3u64, 0x37, 0x1001, 0x2000, 0x3ffe, 0x4003, 0x7ffc] {
        m.w(off, 1, 0xff);
        m.w(off & !3, 4, 0xffff_ffff);
        m.r(off, 1);
        m.r(off & !3, 4);
    }
}

#[test]
fn pci_cfg_capability_reaches_bar0() {
    let mut m = Machine::new();
    m.probe();
    let (cap_off, _) = {
        let mut ptr = u64::from(m.cfg_r8(0x34));
        let mut found = None;
        while ptr != 0 {
            if m.cfg_r8(ptr) == 9 && m.cfg_r8(ptr + 3) == 5 {
                found = Some((ptr, ()));
            }
            ptr = u64::from(m.cfg_r8(ptr + 1));
        }
        found.unwrap()
    };
    // Read NUM_QUEUES (common cfg offset 0x12, 2 bytes) through the window.
    m.cfg_w32(cap_off + 8, 0x12);
    m.cfg_w32(cap_off + 12, 2);
    assert_eq!(m.cfg_r32(cap_off + 16), 1);
    // Write device status ACKNOWLEDGE through it.
    m.cfg_w32(cap_off + 8, 0x14);
    m.cfg_w32(cap_off + 12, 1);
    m.cfg_w32(cap_off + 16, 1);
    assert_eq!(m.status(), ACKNOWLEDGE);
}

#[test]
fn bar_moves_are_reported() {
    use k7d_devices::pci::{BarMove, BarRelocator, PciBdf};
    #[derive(Default)]
    struct Rec(Mutex<Vec<(PciBdf, BarMove)>>);
    impl BarRelocator for Rec {
        fn move_bar(&self, bdf: PciBdf, mv: BarMove) {
            self.0.lock().unwrap().push((bdf, mv));
        }
    }
    let mem = Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap());
    let dev = Arc::new(Mutex::new(
        VirtioPciDevice::new(
            Box::new(Rng::new().unwrap()),
            mem,
            Arc::new(k7d_devices::pci::NoopMsiRouter),
        )
        .unwrap(),
    ));
    let mut root = PciRoot::new(BarAllocator::new(MMIO32_BASE, 0x1000_0000).unwrap(), None);
    let att = root.add_device(dev.clone()).unwrap();
    let rec = Arc::new(Rec::default());
    root.set_relocator(rec.clone());
    let d = att.bdf.device;
    // Sizing is not a move; a new address is.
    root.config_write(0, d, 0, 4, 0, &[0xff; 4]);
    root.config_write(0, d, 0, 4, 0, &0xc000_0000u32.to_le_bytes());
    assert!(rec.0.lock().unwrap().is_empty());
    root.config_write(0, d, 0, 4, 0, &0xd000_8000u32.to_le_bytes());
    let got = rec.0.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![(
            att.bdf,
            BarMove {
                index: 0,
                old: 0xc000_0000,
                new: 0xd000_8000,
                len: 0x8000
            }
        )]
    );
    let fds = dev.lock().unwrap().ioeventfds().unwrap();
    assert_eq!(fds.len(), 1);
    assert_eq!(fds[0].addr, 0xd000_8000 + 0x3000);
}

#[test]
fn a_restored_function_resumes_on_the_guests_rings_at_used_idx() {
    // The source: a live rng that served 3 requests; a 4th is posted and
    // kicked while it is paused (in flight at the snapshot).
    let mut src = Machine::new();
    src.probe();
    src.enable_msix();
    let mem = src.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    src.driver_init(VIRTIO_F_VERSION_1, &mq);
    for i in 0..3u16 {
        mq.add_desc_chains(&[wdesc(0x40_0000 + 0x1000 * u64::from(i), 64)], i)
            .unwrap();
        src.kick(0);
        assert!(wait_used(&mem, &mq, i + 1));
    }
    src.dev.lock().unwrap().pause().unwrap();
    mq.add_desc_chains(&[wdesc(0x40_3000, 48)], 3).unwrap();
    src.kick(0);
    let st = src.dev.lock().unwrap().save_state().unwrap();
    assert_eq!(st.device, "rng");
    assert!(st.msix.enabled && st.queues[0].ready);
    // The state survives serialization (snapshots are JSON).
    let st: k7d_devices::virtio::transport::VirtioPciState =
        serde_json::from_slice(&serde_json::to_vec(&st).unwrap()).unwrap();

    // A fresh function of the same kind on the same guest RAM (as a fork
    // child's RAM holds the source's): restore, then start.
    let mut dst = Machine::on(mem.clone());
    dst.probe(); // the test's view of the capabilities; restore rewrites config space
    dst.dev.lock().unwrap().restore_state(&st).unwrap();
    assert!(
        !dst.dev.lock().unwrap().is_active(),
        "a restored device waits for start"
    );
    // The guest's MSI-X programming reached the new VM's routes.
    let routes = dst.router.0.lock().unwrap().clone();
    assert!(
        routes
            .iter()
            .any(|(v, m, masked)| *v == QUEUE_VECTOR && m.data == 0x31 && !masked),
        "restore did not route the queue vector: {routes:?}"
    );
    assert_eq!(dst.dev.lock().unwrap().device_status(), st.status);
    dst.dev.lock().unwrap().start_restored().unwrap();
    assert!(dst.dev.lock().unwrap().is_active());
    // The request in flight at the snapshot is served as used entry 3 (a
    // device seeded from 0 would overwrite entry 0 and set used.idx to 1).
    assert!(
        wait_used(&mem, &mq, 4),
        "the in-flight request was not served after restore"
    );
    assert_eq!(used_elem(&mem, &mq, 3), (3, 48));
    assert_eq!(used_elem(&mem, &mq, 0), (0, 64), "entry 0 was rewritten");
    assert!(
        dst.wait_irq(QUEUE_VECTOR) >= 1,
        "the restored device signals its vector"
    );
    mq.add_desc_chains(&[wdesc(0x40_4000, 16)], 4).unwrap();
    dst.kick(0);
    assert!(wait_used(&mem, &mq, 5));
    assert_eq!(used_elem(&mem, &mq, 4), (4, 16));
    drop(src);
}

#[test]
fn a_state_that_does_not_fit_is_refused_with_a_sentence_and_nothing_runs() {
    let mut src = Machine::new();
    src.probe();
    src.enable_msix();
    let mem = src.mem.clone();
    let mq = MockSplitQueue::create(&*mem, GuestAddress(QUEUE_BASE), QSIZE);
    src.driver_init(VIRTIO_F_VERSION_1, &mq);
    src.dev.lock().unwrap().pause().unwrap();
    let good = src.dev.lock().unwrap().save_state().unwrap();
    type Edit = Box<dyn Fn(&mut k7d_devices::virtio::transport::VirtioPciState)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("a blk device", Box::new(|s| s.device = "blk".into())),
        ("queues", Box::new(|s| s.queues.push(s.queues[0]))),
        ("does not offer", Box::new(|s| s.driver_features |= 1 << 40)),
        ("BAR 0", Box::new(|s| s.pci_config[4] ^= 0x1000_0000)),
        ("size", Box::new(|s| s.queues[0].size = 3)),
        ("keeps no state", Box::new(|s| s.device_state = b"x".to_vec())),
    ];
    for (want, edit) in cases {
        let mut st = good.clone();
        edit(&mut st);
        let dst = Machine::new();
        let e = dst.dev.lock().unwrap().restore_state(&st).unwrap_err().to_string();
        assert!(e.starts_with("the rng device cannot be restored: "), "{e}");
        assert!(e.contains(want), "{want:?} not in {e:?}");
        assert!(!e.contains('\n'));
        let mut d = dst.dev.lock().unwrap();
        d.start_restored().unwrap();
        assert!(!d.is_active(), "a refused restore left the device live");
        assert_eq!(d.device_status(), 0, "a refused restore left state behind");
    }
}

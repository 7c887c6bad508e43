//! virtio-blk on real guest memory (a memfd mapped MAP_SHARED, like the VMM's),
//! with the device on its own view of that memory (its own dirty bitmap) and
//! virtio-queue's mock driver-side rings.

mod common;

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k7d_devices::pci::{MsixVectors, NoopMsiRouter};
use k7d_devices::virtio::block::{Block, DeviceMemory, DiskImage, features, status};
use k7d_devices::virtio::{
    ActivateContext, ActiveQueue, GuestMemoryTracked, Interrupt, InterruptStatus, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX, VirtioDevice,
};
use virtio_bindings::virtio_blk as b;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{RawDescriptor, split::Descriptor as SplitDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const MEM_SIZE: usize = 16 << 20;
const PAGE: u64 = 4096;
const QUEUE_BASE: u64 = 0x1_0000; // descriptor table + avail ring: page 0x10
const USED_RING: u64 = 0x1_1000; // own page 0x11 (see MockSplitQueue note in virtio_pci.rs)
const HDRS: u64 = 0x2_0000; // request headers: page 0x20 (device only reads)
const QSIZE: u16 = 64;
const W: u16 = VRING_DESC_F_WRITE as u16;
const QUEUE_VECTOR: u16 = 1;

fn memfd_memory() -> Arc<GuestMemoryTracked> {
    common::memfd_memory(MEM_SIZE, c"k7d-blk-test")
}

struct TempImage(PathBuf);

impl TempImage {
    fn new(contents: &[u8]) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "k7d-blk-{}-{}.img",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = File::create(&p).unwrap();
        f.write_all(contents).unwrap();
        Self(p)
    }
    fn read(&self) -> Vec<u8> {
        std::fs::read(&self.0).unwrap()
    }
}

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 512) as u8).collect()
}

/// Fields drop in order: the device (and its worker) before the memory
/// view before the guest memory, whose mapping the view borrows.
struct Rig {
    dev: Block,
    dev_mem: DeviceMemory,
    msix: Arc<MsixVectors>,
    notify: EventFd,
    vmm_mem: Arc<GuestMemoryTracked>,
    image: TempImage,
}

impl Rig {
    fn new(image: &[u8], read_only: bool) -> Self {
        let vmm_mem = memfd_memory();
        // SAFETY: `vmm_mem` is held by this Rig and dropped after `dev_mem`
        // and `dev` (field order), so the mapping outlives the view.
        let dev_mem = unsafe { DeviceMemory::new(&vmm_mem).unwrap() };
        let image = TempImage::new(image);
        let dev = Block::new(DiskImage::open(&image.0, read_only).unwrap(), "k7d-serial-0001").unwrap();
        let msix = Arc::new(MsixVectors::new(2, Arc::new(NoopMsiRouter)).unwrap());
        msix.set_control(true, false);
        msix.write_table(u64::from(QUEUE_VECTOR) * 16 + 12, &0u32.to_le_bytes());
        Self {
            vmm_mem,
            dev_mem,
            msix,
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
            dev,
            image,
        }
    }

    fn queue(&self, mq: &MockSplitQueue<'_, GuestMemoryTracked>, event_idx: bool) -> Queue {
        let mut q: Queue = mq.create_queue().unwrap();
        q.set_used_ring_address(Some(USED_RING as u32), Some(0));
        q.set_event_idx(event_idx);
        assert!(q.is_valid(&*self.vmm_mem));
        q
    }

    fn activate(&mut self, q: Queue, acked: u64) {
        let ctx = ActivateContext {
            mem: self.dev_mem.handle(),
            acked_features: acked,
            queues: vec![ActiveQueue {
                index: 0,
                queue: q,
                notify: self.notify.try_clone().unwrap(),
            }],
            interrupt: Interrupt::new(
                self.msix.clone(),
                vec![QUEUE_VECTOR],
                0,
                Arc::new(InterruptStatus::default()),
            ),
        };
        self.dev.activate(ctx).unwrap();
    }

    fn kick(&self) {
        self.notify.write(1).unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.vmm_mem.read_obj(GuestAddress(USED_RING + 2)).unwrap()
    }

    fn wait_used(&self, n: u16) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.used_idx() == n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// (id, len) of used ring entry `i`.
    fn used_elem(&self, i: u64) -> (u32, u32) {
        let at = USED_RING + 4 + 8 * i;
        (
            self.vmm_mem.read_obj(GuestAddress(at)).unwrap(),
            self.vmm_mem.read_obj(GuestAddress(at + 4)).unwrap(),
        )
    }

    fn irqs(&self) -> u64 {
        self.msix.irqfds()[usize::from(QUEUE_VECTOR)].read().unwrap_or(0)
    }

    fn status_at(&self, addr: u64) -> u8 {
        self.vmm_mem.read_obj(GuestAddress(addr)).unwrap()
    }

    /// Writes a request header at `at`.
    fn header(&self, at: u64, t: u32, sector: u64) {
        let m = &self.vmm_mem;
        m.write_obj(t, GuestAddress(at)).unwrap();
        m.write_obj(0u32, GuestAddress(at + 4)).unwrap();
        m.write_obj(sector, GuestAddress(at + 8)).unwrap();
    }
}

/// The device's live counters (`VirtioDevice::counters`, as the daemon's
/// scrape reads them while the worker runs), by name.
fn counters(dev: &Block) -> std::collections::HashMap<&'static str, u64> {
    dev.counters().into_iter().collect()
}

fn mock(mem: &GuestMemoryTracked) -> MockSplitQueue<'_, GuestMemoryTracked> {
    MockSplitQueue::create(mem, GuestAddress(QUEUE_BASE), QSIZE)
}

/// A chain placed at descriptor index `first`: (addr, len, flags); NEXT/next filled in.
fn chain(descs: &[(u64, u32, u16)], first: u16) -> Vec<RawDescriptor> {
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

/// Adds chains one after another from descriptor 0; returns the next free index.
fn add_all(mq: &MockSplitQueue<'_, GuestMemoryTracked>, specs: &[Vec<(u64, u32, u16)>], mut at: u16) -> u16 {
    for s in specs {
        let c = chain(s, at);
        mq.add_desc_chains(&c, at).unwrap();
        at += c.len() as u16;
    }
    at
}

const BASE_FEATURES: u64 = VIRTIO_F_VERSION_1 | features::FLUSH | features::SEG_MAX | features::BLK_SIZE;

#[test]
fn batch_of_reads_dirties_exactly_data_used_ring_and_status_pages() {
    let img = pattern(64 * 1024);
    let mut r = Rig::new(&img, false);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let q = r.queue(&mq, false);
    // Three reads in one batch:
    //  A: 8 sectors from sector 2 into 0x10_0800 (straddles pages 0x100, 0x101), status 0x3_0000
    //  B: 2 sectors from sector 40 into 0x20_0000 (page 0x200),                  status 0x3_1005
    //  C: 1 sector from sector 100 into 0x30_0000 (page 0x300),                  status 0x3_0001
    for (i, sector) in [2u64, 40, 100].iter().enumerate() {
        r.header(HDRS + 16 * i as u64, b::VIRTIO_BLK_T_IN, *sector);
    }
    let specs = vec![
        vec![(HDRS, 16, 0), (0x10_0800, 4096, W), (0x3_0000, 1, W)],
        vec![(HDRS + 16, 16, 0), (0x20_0000, 1024, W), (0x3_1005, 1, W)],
        vec![(HDRS + 32, 16, 0), (0x30_0000, 512, W), (0x3_0001, 1, W)],
    ];
    add_all(&mq, &specs, 0);
    for a in [0x3_0000u64, 0x3_1005, 0x3_0001] {
        r.vmm_mem.write_obj(0xffu8, GuestAddress(a)).unwrap();
    }
    r.dev_mem.reset_dirty();
    // The chains were posted before DRIVER_OK: the worker serves them as one batch.
    r.activate(q, BASE_FEATURES);
    assert!(r.wait_used(3), "three requests completed");

    // Data = image bytes; statuses OK; used lengths = data + status byte.
    let mut got = vec![0u8; 4096];
    r.vmm_mem.read_slice(&mut got, GuestAddress(0x10_0800)).unwrap();
    assert_eq!(got, img[2 * 512..2 * 512 + 4096]);
    let mut got = vec![0u8; 1024];
    r.vmm_mem.read_slice(&mut got, GuestAddress(0x20_0000)).unwrap();
    assert_eq!(got, img[40 * 512..40 * 512 + 1024]);
    let mut got = vec![0u8; 512];
    r.vmm_mem.read_slice(&mut got, GuestAddress(0x30_0000)).unwrap();
    assert_eq!(got, img[100 * 512..101 * 512]);
    for a in [0x3_0000u64, 0x3_1005, 0x3_0001] {
        assert_eq!(r.status_at(a), status::OK);
    }
    assert_eq!(
        (0..3).map(|i| r.used_elem(i)).collect::<Vec<_>>(),
        vec![(0, 4097), (3, 1025), (6, 513)]
    );
    // One interrupt for the batch.
    assert_eq!(r.irqs(), 1);

    // The device's bitmap: exactly the data pages, the used-ring page and the
    // status pages. Descriptor table / avail ring (0x10) and headers (0x20) clean.
    let used_page = USED_RING / PAGE;
    assert_ne!(used_page, mq.avail_addr().0 / PAGE);
    let mut expect = vec![used_page, 0x30, 0x31, 0x100, 0x101, 0x200, 0x300];
    expect.sort();
    assert_eq!(r.dev_mem.dirty_pages(), expect);
    // The harvest clears it; nothing further is written while idle.
    let taken = r.dev_mem.take_dirty();
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].dirty_addrs().count(), expect.len());
    assert!(r.dev_mem.dirty_pages().is_empty());
    // The VMM's own bitmap saw only the driver's (mock) writes, not the device's data pages.
    let vmm_bm = (**r.vmm_mem.iter().next().unwrap()).bitmap();
    assert!(!vmm_bm.is_addr_set(0x10_0000) && !vmm_bm.is_addr_set(0x20_0000));
}

#[test]
fn writes_reach_the_file_and_flush_and_get_id_work() {
    let img = vec![0u8; 8192];
    let mut r = Rig::new(&img, false);
    assert_eq!(r.dev.sectors(), 16);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let q = r.queue(&mq, true);
    r.activate(
        q,
        BASE_FEATURES | VIRTIO_RING_F_EVENT_IDX | features::WRITE_ZEROES | features::DISCARD,
    );
    let data = pattern(1024);
    r.vmm_mem.write_slice(&data, GuestAddress(0x10_0000)).unwrap();
    r.header(HDRS, b::VIRTIO_BLK_T_OUT, 3);
    r.header(HDRS + 16, b::VIRTIO_BLK_T_FLUSH, 0);
    r.header(HDRS + 32, b::VIRTIO_BLK_T_GET_ID, 0);
    let specs = vec![
        // Data split over two descriptors.
        vec![
            (HDRS, 16, 0),
            (0x10_0000, 512, 0),
            (0x10_0200, 512, 0),
            (0x3_0000, 1, W),
        ],
        vec![(HDRS + 16, 16, 0), (0x3_0001, 1, W)],
        vec![(HDRS + 32, 16, 0), (0x40_0000, 20, W), (0x3_0002, 1, W)],
    ];
    add_all(&mq, &specs, 0);
    r.kick();
    assert!(r.wait_used(3));
    assert_eq!(r.status_at(0x3_0000), status::OK);
    assert_eq!(r.status_at(0x3_0001), status::OK);
    assert_eq!(r.status_at(0x3_0002), status::OK);
    // Another fd sees the write.
    let file = r.image.read();
    assert_eq!(&file[3 * 512..3 * 512 + 1024], &data[..]);
    assert!(file[..3 * 512].iter().all(|b| *b == 0));
    let mut id = [0u8; 20];
    r.vmm_mem.read_slice(&mut id, GuestAddress(0x40_0000)).unwrap();
    assert_eq!(&id[..15], b"k7d-serial-0001");
    assert_eq!(&id[15..], &[0u8; 5]);
    assert_eq!(r.used_elem(0).1, 1);
    assert_eq!(r.used_elem(2).1, 21);
    assert!(r.irqs() >= 1);
    // Counted live, the worker still running: one write of 1 KiB and one
    // flush (GET_ID is neither).
    assert!(r.dev.is_active());
    let c = counters(&r.dev);
    assert_eq!(
        [
            c["write_requests"],
            c["write_bytes"],
            c["flush_requests"],
            c["read_requests"],
            c["failed_requests"]
        ],
        [1, 1024, 1, 0, 0],
        "{c:?}"
    );

    // WRITE_ZEROES over half of the written range.
    let mut seg = Vec::new();
    seg.extend_from_slice(&4u64.to_le_bytes());
    seg.extend_from_slice(&1u32.to_le_bytes());
    seg.extend_from_slice(&0u32.to_le_bytes());
    r.vmm_mem.write_slice(&seg, GuestAddress(HDRS + 0x100)).unwrap();
    r.header(HDRS + 48, b::VIRTIO_BLK_T_WRITE_ZEROES, 0);
    add_all(
        &mq,
        &[vec![(HDRS + 48, 16, 0), (HDRS + 0x100, 16, 0), (0x3_0003, 1, W)]],
        9,
    );
    r.kick();
    assert!(r.wait_used(4));
    assert_eq!(r.status_at(0x3_0003), status::OK);
    let file = r.image.read();
    assert!(file[4 * 512..5 * 512].iter().all(|b| *b == 0), "sector 4 zeroed");
    assert_eq!(&file[3 * 512..4 * 512], &data[..512], "sector 3 kept");
    assert_eq!(file.len(), 8192, "size kept");
}

#[test]
fn config_space_and_features() {
    let r = Rig::new(&[0u8; 3 * 512 + 100], false);
    let mut c = [0u8; 60];
    r.dev.read_config(0, &mut c);
    assert_eq!(
        u64::from_le_bytes(c[0..8].try_into().unwrap()),
        3,
        "capacity in sectors"
    );
    assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 254, "seg_max");
    assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512, "blk_size");
    let f = r.dev.avail_features();
    for bit in [
        VIRTIO_F_VERSION_1,
        features::FLUSH,
        features::SEG_MAX,
        features::BLK_SIZE,
        features::DISCARD,
    ] {
        assert_ne!(f & bit, 0);
    }
    assert_eq!(f & features::RO, 0);
    assert_eq!(r.dev.device_type(), 2);
    let mut tail = [0xaau8; 8];
    r.dev.read_config(56, &mut tail);
    assert_eq!(tail, [1, 0, 0, 0, 0, 0, 0, 0], "past the end reads 0");
    let ro = Rig::new(&[0u8; 512], true);
    assert_ne!(ro.dev.avail_features() & features::RO, 0);
    assert_eq!(ro.dev.avail_features() & features::DISCARD, 0);
}

#[test]
fn read_only_device_refuses_writes_with_ioerr() {
    let img = pattern(4096);
    let mut r = Rig::new(&img, true);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let q = r.queue(&mq, false);
    r.activate(q, BASE_FEATURES | features::RO);
    r.vmm_mem.write_slice(&[0x55; 512], GuestAddress(0x10_0000)).unwrap();
    r.header(HDRS, b::VIRTIO_BLK_T_OUT, 0);
    r.header(HDRS + 16, b::VIRTIO_BLK_T_DISCARD, 0);
    r.header(HDRS + 32, b::VIRTIO_BLK_T_IN, 1);
    let specs = vec![
        vec![(HDRS, 16, 0), (0x10_0000, 512, 0), (0x3_0000, 1, W)],
        vec![(HDRS + 16, 16, 0), (HDRS + 0x100, 16, 0), (0x3_0001, 1, W)],
        vec![(HDRS + 32, 16, 0), (0x20_0000, 512, W), (0x3_0002, 1, W)],
    ];
    add_all(&mq, &specs, 0);
    r.kick();
    assert!(r.wait_used(3));
    assert_eq!(r.status_at(0x3_0000), status::IOERR);
    assert_eq!(
        r.status_at(0x3_0001),
        status::UNSUPP,
        "DISCARD not offered on a read-only disk"
    );
    assert_eq!(r.status_at(0x3_0002), status::OK, "reads still work");
    assert_eq!(r.image.read(), img, "file unchanged");
}

#[test]
fn malformed_chains_get_errors_and_the_device_keeps_serving() {
    let img = pattern(16 * 512);
    let mut r = Rig::new(&img, false);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let q = r.queue(&mq, false);
    r.activate(q, BASE_FEATURES);
    let end = MEM_SIZE as u64;
    r.header(HDRS, b::VIRTIO_BLK_T_IN, 0);
    r.header(HDRS + 16, b::VIRTIO_BLK_T_IN, 15); // last sector: 2 sectors overflow
    r.header(HDRS + 32, 99, 0); // unknown type
    r.header(HDRS + 48, b::VIRTIO_BLK_T_IN, u64::MAX); // sector + len overflows
    // Marker bytes: nothing may be written into the data buffers of refused chains.
    r.vmm_mem.write_slice(&[0xaa; 1024], GuestAddress(0x50_0000)).unwrap();
    for i in 0..16u64 {
        r.vmm_mem.write_obj(0xeeu8, GuestAddress(0x3_0000 + i)).unwrap();
    }
    let specs: Vec<Vec<(u64, u32, u16)>> = vec![
        // 0: no status descriptor (last one readable) -> len 0
        vec![(HDRS, 16, 0), (0x50_0000, 512, W), (0x3_0000, 1, 0)],
        // 1: out of range -> IOERR
        vec![(HDRS + 16, 16, 0), (0x50_0000, 1024, W), (0x3_0001, 1, W)],
        // 2: IN with device-readable data -> IOERR
        vec![(HDRS, 16, 0), (0x50_0000, 512, 0), (0x3_0002, 1, W)],
        // 3: huge length -> IOERR (outside memory)
        vec![(HDRS, 16, 0), (0x50_0000, u32::MAX - 1024, W), (0x3_0003, 1, W)],
        // 4: data outside RAM -> IOERR
        vec![(HDRS, 16, 0), (end + 0x1000, 512, W), (0x3_0004, 1, W)],
        // 5: status outside RAM -> len 0
        vec![(HDRS, 16, 0), (0x50_0000, 512, W), (end + 5, 1, W)],
        // 6: header outside RAM -> IOERR
        vec![(end - 8, 16, 0), (0x3_0006, 1, W)],
        // 7: unknown type -> UNSUPP
        vec![(HDRS + 32, 16, 0), (0x3_0007, 1, W)],
        // 8: sector overflow -> IOERR
        vec![(HDRS + 48, 16, 0), (0x50_0000, 512, W), (0x3_0008, 1, W)],
        // 9: unaligned length -> IOERR
        vec![(HDRS, 16, 0), (0x50_0000, 100, W), (0x3_0009, 1, W)],
        // 10: short header -> IOERR
        vec![(HDRS, 8, 0), (0x3_000a, 1, W)],
        // 11: writable status but zero length -> len 0
        vec![(HDRS, 16, 0), (0x3_000b, 0, W)],
    ];
    let mut at = add_all(&mq, &specs, 0);
    // 12: a descriptor whose next points at itself (a loop): bounded by the
    // queue size, it is a chain of readable descriptors -> no status, len 0.
    let looped = RawDescriptor::from(SplitDescriptor::new(HDRS, 16, VRING_DESC_F_NEXT as u16, at));
    mq.add_desc_chains(&[looped], at).unwrap();
    at += 1;
    // 13: next pointing past the table: the chain ends at the readable header -> len 0.
    let dangling = RawDescriptor::from(SplitDescriptor::new(HDRS, 16, VRING_DESC_F_NEXT as u16, 999));
    mq.add_desc_chains(&[dangling], at).unwrap();
    at += 1;
    let n = specs.len() as u16 + 2;
    r.kick();
    assert!(r.wait_used(n), "every chain returned");
    let lens: Vec<u32> = (0..u64::from(n)).map(|i| r.used_elem(i).1).collect();
    assert_eq!(lens, vec![0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]);
    let st: Vec<u8> = (0..12).map(|i| r.status_at(0x3_0000 + i)).collect();
    let (e, i, u) = (0xee, status::IOERR, status::UNSUPP);
    assert_eq!(st, vec![e, i, i, i, i, e, i, u, i, i, i, e]);
    let mut marker = [0u8; 1024];
    r.vmm_mem.read_slice(&mut marker, GuestAddress(0x50_0000)).unwrap();
    assert_eq!(marker, [0xaa; 1024], "refused chains wrote no data");
    // Each of the 14 refused or dropped chains counted, none as a read.
    let c = counters(&r.dev);
    assert_eq!(
        (c["failed_requests"], c["read_requests"], c["read_bytes"]),
        (14, 0, 0),
        "{c:?}"
    );

    // Still serving.
    mq.add_desc_chains(&chain(&[(HDRS, 16, 0), (0x60_0000, 512, W), (0x3_0010, 1, W)], at), at)
        .unwrap();
    r.kick();
    assert!(r.wait_used(n + 1));
    assert_eq!(r.status_at(0x3_0010), status::OK);
    let mut got = [0u8; 512];
    r.vmm_mem.read_slice(&mut got, GuestAddress(0x60_0000)).unwrap();
    assert_eq!(&got[..], &img[..512]);
    assert!(r.dev.is_active());
    let c = counters(&r.dev);
    assert_eq!(
        (c["failed_requests"], c["read_requests"], c["read_bytes"]),
        (14, 1, 512),
        "{c:?}"
    );
}

#[test]
fn worker_stops_on_reset_and_drop() {
    let mut r = Rig::new(&pattern(4096), false);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let handle = r.dev_mem.handle();
    let idle = Arc::strong_count(&handle);
    let q = r.queue(&mq, false);
    r.activate(q, BASE_FEATURES);
    assert!(r.dev.is_active());
    assert_eq!(Arc::strong_count(&handle), idle + 1, "the worker holds the memory view");
    let queues = r.dev.reset();
    assert_eq!(queues.len(), 1);
    assert!(!r.dev.is_active());
    assert_eq!(Arc::strong_count(&handle), idle, "worker thread joined");
    // A kick now is served by nobody.
    r.header(HDRS, b::VIRTIO_BLK_T_IN, 0);
    add_all(&mq, &[vec![(HDRS, 16, 0), (0x10_0000, 512, W), (0x3_0000, 1, W)]], 0);
    r.kick();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(r.used_idx(), 0);
    // Activate again (the driver re-initialises), then drop the device.
    let q = r.queue(&mq, false);
    r.activate(q, BASE_FEATURES);
    assert!(r.wait_used(1));
    assert_eq!(Arc::strong_count(&handle), idle + 1);
    let Rig { dev, .. } = r;
    drop(dev);
    assert_eq!(
        Arc::strong_count(&handle),
        idle,
        "dropping the device joined its worker"
    );
}

#[test]
fn pause_drains_and_hands_back_indexes_and_restore_seeds_from_used_idx() {
    let img = pattern(8192);
    let mut r = Rig::new(&img, false);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let q = r.queue(&mq, true);
    r.activate(q, BASE_FEATURES | VIRTIO_RING_F_EVENT_IDX);
    r.header(HDRS, b::VIRTIO_BLK_T_IN, 1);
    let one = |i: u64| vec![(HDRS, 16, 0), (0x10_0000 + i * PAGE, 512, W), (0x3_0000 + i, 1, W)];
    add_all(&mq, &[one(0), one(1)], 0);
    r.kick();
    assert!(r.wait_used(2));
    r.dev.pause().unwrap();
    assert!(r.dev.is_paused() && !r.dev.is_active());
    let idx = r.dev.paused_queue_indexes().unwrap();
    assert_eq!((idx.next_avail, idx.next_used), (2, 2));
    // Paused: the device writes nothing.
    r.dev_mem.reset_dirty();
    add_all(&mq, &[one(2)], 6);
    r.kick();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(r.used_idx(), 2);
    assert!(r.dev_mem.dirty_pages().is_empty(), "pause is total");
    // The snapshot carries the disk's identity, and restores only into a
    // device on a disk of the same size and mode.
    let snap = r.dev.snapshot().unwrap();
    let mut same = Block::new(DiskImage::open(&r.image.0, false).unwrap(), "y").unwrap();
    same.restore(&snap).unwrap();
    let other = TempImage::new(&pattern(4096));
    let mut smaller = Block::new(DiskImage::open(&other.0, false).unwrap(), "z").unwrap();
    let e = smaller.restore(&snap).unwrap_err().to_string();
    assert!(
        e.starts_with("the blk device cannot be restored: the saved disk had 16 sectors"),
        "{e}"
    );
    r.dev.resume().unwrap();
    assert!(r.wait_used(3), "the request posted while paused is served on resume");

    // Restore: a fresh device on the same (mid-conversation) rings starts at
    // the guest's used.idx, not 0, so it neither re-serves nor skips chains.
    let queues = r.dev.reset();
    assert_eq!(queues[0].next_avail(), 3);
    let mut fresh = Block::new(DiskImage::open(&r.image.0, false).unwrap(), "x").unwrap();
    std::mem::swap(&mut r.dev, &mut fresh);
    drop(fresh);
    let mut q = r.queue(&mq, true); // next_avail = next_used = 0, as a restore would build it
    // The seeding the transport does when it starts a restored device.
    assert_eq!(k7d_devices::virtio::seed_from_used_ring(&mut q, &mem).unwrap(), 3);
    r.activate(q, BASE_FEATURES | VIRTIO_RING_F_EVENT_IDX);
    add_all(&mq, &[one(3)], 9);
    r.kick();
    assert!(r.wait_used(4));
    assert_eq!(r.used_elem(3).0, 9, "the new chain, not a replay of chain 0");
    assert_eq!(r.status_at(0x3_0003), status::OK);
}

#[test]
fn a_read_only_drive_changes_medium_while_the_driver_runs() {
    let first = pattern(4096);
    let mut r = Rig::new(&first, true);
    let second_bytes: Vec<u8> = pattern(8192).iter().map(|b| b ^ 0xa5).collect();
    let second = TempImage::new(&second_bytes);
    let mem = r.vmm_mem.clone();
    let mq = mock(&mem);
    let q = r.queue(&mq, false);
    // Config changes go to vector 0, unmasked.
    const CONFIG_VECTOR: u16 = 0;
    r.msix
        .write_table(u64::from(CONFIG_VECTOR) * 16 + 12, &0u32.to_le_bytes());
    let irq_status = Arc::new(InterruptStatus::default());
    let ctx = ActivateContext {
        mem: r.dev_mem.handle(),
        acked_features: BASE_FEATURES | features::RO,
        queues: vec![ActiveQueue {
            index: 0,
            queue: q,
            notify: r.notify.try_clone().unwrap(),
        }],
        interrupt: Interrupt::new(r.msix.clone(), vec![QUEUE_VECTOR], CONFIG_VECTOR, irq_status.clone()),
    };
    r.dev.activate(ctx).unwrap();
    let capacity = |dev: &Block| {
        let mut c = [0u8; 8];
        dev.read_config(0, &mut c);
        u64::from_le_bytes(c)
    };
    let config_irqs = |r: &Rig| r.msix.irqfds()[usize::from(CONFIG_VECTOR)].read().unwrap_or(0);
    // One read of sector `s` into page `i`'s buffer, status at 0x3_0000 + i.
    let read = |r: &Rig, i: u64, s: u64| {
        r.header(HDRS + 16 * i, b::VIRTIO_BLK_T_IN, s);
        vec![
            (HDRS + 16 * i, 16, 0),
            (0x10_0000 + i * PAGE, 512, W),
            (0x3_0000 + i, 1, W),
        ]
    };
    let got = |i: u64| {
        let mut buf = vec![0u8; 512];
        mem.read_slice(&mut buf, GuestAddress(0x10_0000 + i * PAGE)).unwrap();
        buf
    };
    assert_eq!(capacity(&r.dev), 8);
    add_all(&mq, &[read(&r, 0, 1)], 0);
    r.kick();
    assert!(r.wait_used(1));
    assert_eq!(got(0), first[512..1024]);

    // A new medium: the capacity, a config interrupt (ISR bit and
    // generation), and the next read comes from it.
    let generation = irq_status.config_generation();
    r.dev
        .change_medium(Arc::new(DiskImage::open(&second.0, true).unwrap()))
        .unwrap();
    assert!(r.dev.is_active(), "the worker runs again after the change");
    assert_eq!(capacity(&r.dev), 16);
    assert_eq!(config_irqs(&r), 1, "one configuration-change interrupt");
    assert_eq!(irq_status.config_generation(), generation.wrapping_add(1));
    assert_eq!(
        irq_status.take_isr() & k7d_devices::virtio::ISR_CONFIG,
        k7d_devices::virtio::ISR_CONFIG
    );
    add_all(&mq, &[read(&r, 1, 9)], 3);
    r.kick();
    assert!(r.wait_used(2));
    assert_eq!(r.status_at(0x3_0001), status::OK);
    assert_eq!(got(1), second_bytes[9 * 512..10 * 512], "served from the new medium");

    // Ejected: no sector, and a read fails rather than reaching the old medium.
    r.dev.change_medium(Arc::new(DiskImage::empty().unwrap())).unwrap();
    assert_eq!(capacity(&r.dev), 0);
    assert_eq!(config_irqs(&r), 1);
    add_all(&mq, &[read(&r, 2, 0)], 6);
    r.kick();
    assert!(r.wait_used(3));
    assert_eq!(r.status_at(0x3_0002), status::IOERR);

    // Refusals, each a sentence, each leaving the drive as it was.
    let e = r
        .dev
        .change_medium(Arc::new(DiskImage::open(&second.0, false).unwrap()))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "only a read-only drive takes a new medium, and only a read-only one");
    r.dev.pause().unwrap();
    let e = r
        .dev
        .change_medium(Arc::new(DiskImage::open(&second.0, true).unwrap()))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "the drive is paused with its VM; resume the VM first");
    assert_eq!(capacity(&r.dev), 0);
    r.dev.resume().unwrap();
    assert!(r.dev.is_active());
    // Stopped before the Rig unmaps the memory it serves.
    r.dev.reset();
    let mut writable = Rig::new(&first, false);
    let e = writable
        .dev
        .change_medium(Arc::new(DiskImage::empty().unwrap()))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "only a read-only drive takes a new medium, and only a read-only one");
    assert_eq!(capacity(&writable.dev), 8);
}

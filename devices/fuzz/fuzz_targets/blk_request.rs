//! Arbitrary guest memory and descriptor chains fed to the virtio-blk request
//! path (`RequestHandler::process_queue`: pop, parse, execute, status, used
//! ring), exactly as the worker runs it.
//!
//! Input layout: byte 0 picks the queue size (1..=64) and byte 1 the flags
//! (bit 0 EVENT_IDX, bit 1 read-only disk, bit 2 DISCARD/WRITE_ZEROES offered);
//! the rest is copied over guest memory, which holds the descriptor table
//! (0x0), the avail ring (0x1000) and the used ring (0x2000) as well as every
//! buffer, so descriptors, ring indexes, headers and data are all fuzzed.
//! Guest memory is two regions with a hole between them.
//!
//! Invariants: no panic, no hang (each call serves a bounded batch), and
//! every status byte written is OK, IOERR or UNSUPP.

#![no_main]

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::{Arc, OnceLock};

use k7d_devices::virtio::GuestMemoryTracked;
use k7d_devices::virtio::block::{DiskImage, Limits, MAX_BATCH, MAX_DISCARD_SECTORS, RequestHandler};
use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const REGION0: usize = 0x8000;
const REGION1_BASE: u64 = 0xc000;
const REGION1: usize = 0x4000;
const DISK_SECTORS: u64 = 64;

fn disk(read_only: bool) -> Arc<DiskImage> {
    static RW: OnceLock<Arc<DiskImage>> = OnceLock::new();
    static RO: OnceLock<Arc<DiskImage>> = OnceLock::new();
    let make = || {
        // SAFETY: memfd_create with a NUL-terminated name; the fd is owned below.
        let fd = unsafe { libc::memfd_create(c"k7d-fuzz-disk".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create failed");
        // SAFETY: a fresh descriptor nothing else owns.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(DISK_SECTORS * 512).expect("sizing the fuzz disk");
        Arc::new(DiskImage::from_file(f, read_only, "fuzz".into()).expect("fuzz disk"))
    };
    if read_only {
        RO.get_or_init(make).clone()
    } else {
        RW.get_or_init(make).clone()
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let qsize = 1u16 << (data[0] % 7); // 1..=64
    let flags = data[1];
    let body = &data[2..];

    let mem = GuestMemoryTracked::from_ranges(&[(GuestAddress(0), REGION0), (GuestAddress(REGION1_BASE), REGION1)])
        .expect("guest memory");
    let n0 = body.len().min(REGION0);
    mem.write_slice(&body[..n0], GuestAddress(0)).expect("fill region 0");
    let rest = &body[n0..];
    let n1 = rest.len().min(REGION1);
    mem.write_slice(&rest[..n1], GuestAddress(REGION1_BASE))
        .expect("fill region 1");

    let mut q = Queue::new(64).expect("queue");
    q.set_size(qsize);
    q.set_desc_table_address(Some(0), Some(0));
    q.set_avail_ring_address(Some(0x1000), Some(0));
    q.set_used_ring_address(Some(0x2000), Some(0));
    q.set_event_idx(flags & 1 != 0);
    q.set_ready(true);
    if !q.is_valid(&mem) {
        return;
    }

    let read_only = flags & 2 != 0;
    let offer = flags & 4 != 0 && !read_only;
    let limits = Limits {
        capacity: DISK_SECTORS,
        discard: offer,
        write_zeroes: offer,
        max_discard_sectors: MAX_DISCARD_SECTORS,
        max_discard_seg: 1,
    };
    let mut h = RequestHandler::new(disk(read_only), *b"k7d-fuzz-serial\0\0\0\0\0", limits);
    // The worker calls this once per wakeup; a cut batch reschedules itself.
    // Three rounds cover the cut without letting a self-feeding ring spin.
    for _ in 0..3 {
        match h.process_queue(&mut q, &mem) {
            Ok(b) => {
                assert!(b.served <= MAX_BATCH);
                if !b.more {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let s = h.stats();
    assert!(s.completed <= s.ok + s.errors + s.dropped);
});

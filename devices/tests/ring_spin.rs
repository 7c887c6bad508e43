//! A guest can write ring state that virtio-queue refuses to pop while
//! `enable_notification` keeps reporting work (avail index more than the ring
//! size ahead). Every worker's drain loop must stop on it instead of spinning
//! (`k7d_devices::virtio::ring_unpoppable`, shared by blk, net, rng, vsock).
//! Each case runs in a thread with a deadline: a spin fails the test.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use k7d_devices::virtio::block::{DiskImage, Limits, RequestHandler};
use k7d_devices::virtio::{GuestMemoryTracked, ring_unpoppable};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const AVAIL: u64 = 0x1000;
const DESC: u64 = 0x2000;
const USED: u64 = 0x3000;

fn memory() -> Arc<GuestMemoryTracked> {
    Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory"))
}

/// A ready 8-entry queue whose avail index claims `avail_idx` entries.
fn queue(mem: &GuestMemoryTracked, avail_idx: u16) -> Queue {
    let mut q = Queue::new(256).expect("queue");
    q.set_size(8);
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_event_idx(true);
    q.set_ready(true);
    assert!(q.is_valid(mem));
    mem.write_obj(avail_idx, GuestAddress(AVAIL + 2)).expect("avail idx");
    q
}

fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what} did not return within 5 s: the drain loop spins"))
}

#[test]
fn the_shared_check_tells_a_poppable_ring_from_one_running_ahead() {
    let mem = memory();
    assert!(!ring_unpoppable(&mut queue(&mem, 0), &mem));
    assert!(!ring_unpoppable(&mut queue(&mem, 3), &mem));
    assert!(
        ring_unpoppable(&mut queue(&mem, 8 + 5), &mem),
        "an index 13 entries ahead of an 8-entry ring"
    );
}

#[test]
fn blk_stops_on_a_ring_whose_index_runs_ahead() {
    let mem = memory();
    let dir = std::env::temp_dir().join(format!("k7d-ring-spin-{}", std::process::id()));
    std::fs::write(&dir, vec![0u8; 1 << 20]).unwrap();
    let disk = Arc::new(DiskImage::open(&dir, false).unwrap());
    let _ = std::fs::remove_file(&dir);
    let mut handler = RequestHandler::new(
        disk,
        [0; k7d_devices::virtio::block::ID_BYTES],
        Limits {
            capacity: 2048,
            discard: false,
            write_zeroes: false,
            max_discard_sectors: 0,
            max_discard_seg: 0,
        },
    );
    let res = within("blk process_queue", move || {
        let mut q = queue(&mem, 8 + 5);
        handler.process_queue(&mut q, &mem).map(|b| b.served)
    });
    assert!(res.is_err(), "the broken ring was served: {res:?}");
}

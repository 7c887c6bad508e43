//! Inputs the `net_tx` fuzz target found (devices/fuzz), replayed through the
//! same harness: each must finish (no spin) and leave the device serving.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use k7d_devices::virtio::GuestMemoryTracked;
use k7d_devices::virtio::net::fuzz::PairHarness;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

fn queue(mem: &GuestMemoryTracked, size: u16, i: u64, event_idx: bool) -> Queue {
    let mut q = Queue::new(256).expect("queue");
    q.set_size(size);
    q.set_avail_ring_address(Some((i * 0x100) as u32), Some(0));
    q.set_desc_table_address(Some((0x400 + i * 0x400) as u32), Some(0));
    q.set_used_ring_address(Some((0x1000 + i * 0x400) as u32), Some(0));
    q.set_event_idx(event_idx);
    q.set_ready(true);
    assert!(q.is_valid(mem));
    q
}

/// Guest memory with `bytes` at GPA 0, the TX queue (size `size`) and a
/// control queue, served once each, on a watchdog thread.
fn serve(bytes: &[u8], size: u16, event_idx: bool, ctrl: bool) -> PairHarness {
    let mem = GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 0x8000)]).expect("memory");
    mem.write_slice(bytes, GuestAddress(0)).expect("fill");
    let tx = queue(&mem, size, 0, event_idx);
    let rx = queue(&mem, size, 2, event_idx);
    let c = ctrl.then(|| queue(&mem, 32, 1, event_idx));
    let (dev_end, host_end) = common::socketpair();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut h = PairHarness::new(Arc::new(mem), rx, tx, c, 4, dev_end).expect("harness");
        h.tx();
        h.ctrl();
        let _ = done_tx.send(h);
        drop(host_end);
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the worker spun on a guest-written ring")
}

#[test]
fn avail_index_beyond_the_ring_does_not_spin() {
    // TX avail idx = 10 on a 1-entry ring (fuzz: timeout-865b963f).
    let h = serve(&[0x00, 0x00, 0x0a], 1, true, true);
    assert_eq!(h.stats().pairs[0].tx_frames.load(Ordering::Relaxed), 0);
}

#[test]
fn avail_ring_at_gpa_0_does_not_spin() {
    // fuzz: 04 01 00 28 da 01 00 — size 16, EVENT_IDX, avail ring at GPA 0
    // with idx 1: virtio-queue refuses to pop a ring at GPA 0 while
    // `enable_notification` reports work. The queue is marked broken.
    let h = serve(&[0x28, 0xda, 0x01, 0x00], 16, true, false);
    assert_eq!(h.stats().pairs[0].tx_dropped.load(Ordering::Relaxed), 0);
}

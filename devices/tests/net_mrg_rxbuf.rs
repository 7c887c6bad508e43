//! `VIRTIO_NET_F_MRG_RXBUF` on the userspace data plane: a frame larger
//! than one RX buffer spans as many chains as it needs, with their count in
//! its header's `num_buffers`; when the ring runs dry mid-frame the chains
//! taken are given back and the frame waits for the next buffer; a
//! malformed chain is given back empty. Driven through the worker's real
//! code (`PairHarness`) over a datagram socket standing in for the tap.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use k7d_devices::virtio::GuestMemoryTracked;
use k7d_devices::virtio::net::fuzz::PairHarness;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const SIZE: u16 = 16;
const AVAIL: u64 = 0x200;
const DESC: u64 = 0xc00;
const USED: u64 = 0x1800;
const BUF: u64 = 0x4000;
const BUF_LEN: u32 = 256;
const HDR: usize = 12;
const WRITE: u16 = 2;

fn queue(mem: &GuestMemoryTracked, avail: u64, desc: u64, used: u64, event_idx: bool) -> Queue {
    let mut q = Queue::new(256).expect("queue");
    q.set_size(SIZE);
    q.set_avail_ring_address(Some(avail as u32), Some(0));
    q.set_desc_table_address(Some(desc as u32), Some(0));
    q.set_used_ring_address(Some(used as u32), Some(0));
    q.set_event_idx(event_idx);
    q.set_ready(true);
    assert!(q.is_valid(mem));
    q
}

struct Rig {
    mem: Arc<GuestMemoryTracked>,
    h: PairHarness,
    host: OwnedFd,
    posted: u16,
}

impl Rig {
    fn new(mergeable: bool) -> Self {
        Self::with_event_idx(mergeable, false)
    }

    fn with_event_idx(mergeable: bool, event_idx: bool) -> Self {
        let mem = Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("memory"));
        let rx = queue(&mem, AVAIL, DESC, USED, event_idx);
        let tx = queue(&mem, 0x100, 0x800, 0x1400, event_idx);
        let (dev, host) = common::socketpair();
        let h = PairHarness::new(mem.clone(), rx, tx, None, 1, dev)
            .expect("harness")
            .mergeable(mergeable);
        Self {
            mem,
            h,
            host,
            posted: 0,
        }
    }

    /// Posts descriptor `i` (buffer `i`, device-writable unless `readable`) as a chain of its own.
    fn post(&mut self, i: u16, readable: bool) {
        let d = DESC + 16 * u64::from(i);
        let m = &self.mem;
        m.write_obj(BUF + u64::from(i) * u64::from(BUF_LEN), GuestAddress(d))
            .unwrap();
        m.write_obj(BUF_LEN, GuestAddress(d + 8)).unwrap();
        m.write_obj(if readable { 0u16 } else { WRITE }, GuestAddress(d + 12))
            .unwrap();
        m.write_obj(0u16, GuestAddress(d + 14)).unwrap();
        m.write_obj(i, GuestAddress(AVAIL + 4 + 2 * u64::from(self.posted % SIZE)))
            .unwrap();
        self.posted += 1;
        m.write_obj(self.posted, GuestAddress(AVAIL + 2)).unwrap();
    }

    /// A frame: the 12-byte header (num_buffers 0, as a tap leaves it) and `len` bytes.
    fn send(&self, len: usize) -> Vec<u8> {
        let mut f = vec![0u8; HDR];
        f.extend((0..len).map(|i| (i * 7 + 3) as u8));
        // SAFETY: sends from a live buffer of f.len() bytes on our socket.
        let n = unsafe { libc::send(self.host.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
        assert_eq!(n, f.len() as isize);
        f
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    /// Used element `k`: (descriptor id, length).
    fn used(&self, k: u16) -> (u32, u32) {
        let e = USED + 4 + 8 * u64::from(k);
        (
            self.mem.read_obj(GuestAddress(e)).unwrap(),
            self.mem.read_obj(GuestAddress(e + 4)).unwrap(),
        )
    }

    /// The bytes the used elements `from..to` hold, in order.
    fn gathered(&self, from: u16, to: u16) -> Vec<u8> {
        let mut out = Vec::new();
        for k in from..to {
            let (id, len) = self.used(k);
            let mut b = vec![0u8; len as usize];
            self.mem
                .read_slice(&mut b, GuestAddress(BUF + u64::from(id) * u64::from(BUF_LEN)))
                .unwrap();
            out.extend(b);
        }
        out
    }
}

fn num_buffers(frame: &[u8]) -> u16 {
    u16::from_le_bytes([frame[10], frame[11]])
}

#[test]
fn a_frame_larger_than_one_buffer_spans_chains_with_their_count_in_its_header() {
    let mut r = Rig::new(true);
    for i in 0..4 {
        r.post(i, false);
    }
    let sent = r.send(600); // 612 bytes: three buffers of 256
    r.h.rx();
    assert_eq!(r.used_idx(), 3, "three chains used");
    assert_eq!(
        (0..3).map(|k| r.used(k)).collect::<Vec<_>>(),
        vec![(0, 256), (1, 256), (2, 100)]
    );
    let got = r.gathered(0, 3);
    assert_eq!(num_buffers(&got), 3);
    assert_eq!(got[HDR..], sent[HDR..], "the payload, in order across the chains");
    assert_eq!(r.h.stats().pairs[0].rx_frames.load(Ordering::Relaxed), 1);
    // The fourth buffer takes the next small frame alone.
    let small = r.send(40);
    r.h.rx();
    assert_eq!(r.used_idx(), 4);
    let got = r.gathered(3, 4);
    assert_eq!(num_buffers(&got), 1);
    assert_eq!(got[HDR..], small[HDR..]);
}

#[test]
fn chains_taken_when_the_ring_runs_dry_mid_frame_are_given_back_and_the_frame_waits() {
    let mut r = Rig::with_event_idx(true, true);
    r.post(0, false);
    r.post(1, false);
    let sent = r.send(600);
    r.h.rx();
    assert_eq!(r.used_idx(), 0, "two buffers cannot hold 612 bytes: nothing used");
    // The avail event (after the used ring) asks for a kick at the guest's
    // next buffer: past the two given back, or the guest would never kick.
    let avail_event: u16 = r.mem.read_obj(GuestAddress(USED + 4 + 8 * u64::from(SIZE))).unwrap();
    assert_eq!(avail_event, 2);
    assert_eq!(r.h.stats().pairs[0].rx_frames.load(Ordering::Relaxed), 0);
    r.post(2, false);
    r.h.rx();
    assert_eq!(r.used_idx(), 3, "the same two chains and the new one took the frame");
    assert_eq!(
        (0..3).map(|k| r.used(k).0).collect::<Vec<_>>(),
        vec![0, 1, 2],
        "the chains given back were taken again, in order"
    );
    let got = r.gathered(0, 3);
    assert_eq!(num_buffers(&got), 3);
    assert_eq!(got[HDR..], sent[HDR..]);
}

#[test]
fn a_malformed_chain_is_given_back_empty_and_the_frame_waits_for_good_ones() {
    let mut r = Rig::new(true);
    r.post(0, false);
    r.post(1, true); // device-readable: not an RX buffer
    for i in 2..5 {
        r.post(i, false);
    }
    let sent = r.send(600);
    r.h.rx();
    assert!(r.h.stats().pairs[0].malformed.load(Ordering::Relaxed) >= 1);
    assert_eq!(
        (r.used(0), r.used(1)),
        ((0, 0), (1, 0)),
        "both chains of the failed attempt given back empty"
    );
    assert_eq!(r.used_idx(), 5, "then the frame took the next three");
    let got = r.gathered(2, 5);
    assert_eq!(num_buffers(&got), 3);
    assert_eq!(got[HDR..], sent[HDR..]);
}

#[test]
fn without_mrg_rxbuf_a_frame_larger_than_its_buffer_is_dropped_whole() {
    let mut r = Rig::new(false);
    for i in 0..4 {
        r.post(i, false);
    }
    r.send(600);
    r.h.rx();
    assert_eq!(r.h.stats().pairs[0].rx_dropped.load(Ordering::Relaxed), 1);
    assert_eq!(r.h.stats().pairs[0].rx_frames.load(Ordering::Relaxed), 0);
    let small = r.send(40);
    r.h.rx();
    let (id, len) = r.used(r.used_idx() - 1);
    assert_eq!(len as usize, HDR + 40);
    let mut b = vec![0u8; len as usize];
    r.mem
        .read_slice(&mut b, GuestAddress(BUF + u64::from(id) * u64::from(BUF_LEN)))
        .unwrap();
    assert_eq!(num_buffers(&b), 1);
    assert_eq!(b[HDR..], small[HDR..]);
}

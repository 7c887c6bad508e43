//! Arbitrary guest memory and descriptor chains fed to the virtio-net worker
//! of one queue pair (`net::fuzz::PairHarness`: the real `PairWorker`): the
//! TX path (pop, check, `writev` into the tap, used ring, notification), the
//! control-queue parser (`VQ_PAIRS_SET` and garbage, ack byte) and, when
//! asked, one RX frame from the tap into the guest's buffers.
//!
//! Input layout: byte 0 picks the TX queue size (1..=64), byte 1 the flags
//! (bit 0 EVENT_IDX, bit 1 serve the control queue, bit 2 deliver an RX
//! frame, bits 3-5 the control queue size 1..=64 as `1 << n`), byte 2 the RX
//! frame length (`26 + 6 * b`). The rest is copied over guest memory, which
//! holds every ring (avail rings of TX/control/RX at 0x100/0x200/0x300, their
//! descriptor tables at 0x400/0x800/0xc00, used rings at
//! 0x1000/0x1400/0x1800) and every buffer, in two regions with a hole
//! between them. The "tap" is a datagram socket
//! pair: what TX writes is read back and checked; the RX frame is sent into
//! it.
//!
//! Invariants: no panic, no hang; every frame handed to the tap carries at
//! least the 12-byte header and at most 64 KiB + header; a malformed chain
//! is counted and dropped.

#![no_main]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use k7d_devices::virtio::GuestMemoryTracked;
use k7d_devices::virtio::net::fuzz::PairHarness;
use k7d_devices::virtio::net::{MAX_FRAME_LEN, VNET_HDR_LEN};
use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const REGION0: usize = 0x8000;
const REGION1_BASE: u64 = 0xc000;
const REGION1: usize = 0x4000;

/// Queue `i`'s rings: the avail rings first (not at GPA 0, which
/// virtio-queue treats as "not ready"; `tests/net_fuzz_regressions.rs` covers
/// that case) and the descriptor tables next, so short inputs already reach
/// them; the used rings after.
fn queue(mem: &GuestMemoryTracked, size: u16, i: u64, event_idx: bool) -> Option<Queue> {
    let mut q = Queue::new(256).ok()?;
    q.set_size(size);
    q.set_avail_ring_address(Some((0x100 + i * 0x100) as u32), Some(0));
    q.set_desc_table_address(Some((0x400 + i * 0x400) as u32), Some(0));
    q.set_used_ring_address(Some((0x1000 + i * 0x400) as u32), Some(0));
    q.set_event_idx(event_idx);
    q.set_ready(true);
    q.is_valid(mem).then_some(q)
}

fn socketpair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair writes two descriptors into the live 2-int array.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair failed");
    // SAFETY: two fresh descriptors nothing else owns.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

fn grow_sndbuf(fd: &OwnedFd) {
    let v: libc::c_int = 1 << 20;
    // SAFETY: setsockopt reads one int from a live local.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let tx_size = 1u16 << (data[0] % 7);
    let flags = data[1];
    let event_idx = flags & 1 != 0;
    let ctrl_size = 1u16 << ((flags >> 3) % 7);
    let rx_len = 26 + 6 * usize::from(data[2]);
    let body = &data[3..];

    let mem = GuestMemoryTracked::from_ranges(&[(GuestAddress(0), REGION0), (GuestAddress(REGION1_BASE), REGION1)])
        .expect("guest memory");
    let n0 = body.len().min(REGION0);
    mem.write_slice(&body[..n0], GuestAddress(0)).expect("fill region 0");
    let rest = &body[n0..];
    let n1 = rest.len().min(REGION1);
    mem.write_slice(&rest[..n1], GuestAddress(REGION1_BASE))
        .expect("fill region 1");

    let Some(tx) = queue(&mem, tx_size, 0, event_idx) else {
        return;
    };
    let ctrl = if flags & 2 != 0 {
        queue(&mem, ctrl_size, 1, event_idx)
    } else {
        None
    };
    let rx = queue(&mem, tx_size, 2, event_idx);
    let want_rx = flags & 4 != 0 && rx.is_some();
    let rx = rx.unwrap_or_else(|| Queue::new(256).expect("queue"));

    let (worker_end, host_end) = socketpair();
    grow_sndbuf(&worker_end);
    let mut h = PairHarness::new(Arc::new(mem), rx, tx, ctrl, 4, worker_end).expect("harness");

    h.tx();
    // What TX wrote into the "tap": every frame a plausible size.
    let mut buf = vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN + 16];
    loop {
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
        let n = unsafe { libc::recv(host_end.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            break;
        }
        let n = n as usize;
        assert!(n >= VNET_HDR_LEN, "TX handed the tap a {n}-byte frame");
        assert!(n <= VNET_HDR_LEN + MAX_FRAME_LEN, "TX handed the tap a {n}-byte frame");
    }
    h.ctrl();
    if want_rx {
        let frame: Vec<u8> = body.iter().copied().cycle().take(rx_len).collect();
        // SAFETY: `frame` is a live buffer of `frame.len()` bytes.
        unsafe { libc::send(host_end.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        h.rx();
    }
    let s = &h.stats().pairs[0];
    assert!(s.rx_frames.load(Ordering::Relaxed) <= 1);
});

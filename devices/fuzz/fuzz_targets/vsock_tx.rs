//! Arbitrary guest memory and descriptor chains fed to the virtio-vsock
//! device through its public lifecycle: `activate` starts the real worker,
//! which serves the TX ring (packet parsing, the muxer: connection requests
//! to host ports, data, credit, shutdown, reset) and then fills RX buffers
//! with the muxer's replies; `reset` stops it and joins the thread. So every
//! iteration runs TX → muxer → RX exactly once on guest-controlled bytes.
//!
//! Input layout: byte 0 picks the queue size of all three queues (1..=64),
//! byte 1 bit 0 EVENT_IDX. The rest is copied over guest memory: avail rings
//! of RX/TX/event at 0x100/0x200/0x300, descriptor tables at
//! 0x400/0x800/0xc00, used rings at 0x1000/0x1400/0x1800, buffers
//! everywhere, two regions with a hole.
//! Host ports resolve to `<uds>_<port>` sockets that do not exist, so a
//! guest connection attempt gets a reset.
//!
//! Invariants: no panic, no hang (reset returns: the worker came back), and
//! the device hands all three queues back.

#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use k7d_devices::pci::{MsixVectors, NoopMsiRouter};
use k7d_devices::virtio::vsock::Vsock;
use k7d_devices::virtio::{
    ActivateContext, ActiveQueue, GuestMemoryTracked, Interrupt, InterruptStatus, VIRTIO_F_VERSION_1,
    VIRTIO_MSI_NO_VECTOR, VirtioDevice,
};
use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const REGION0: usize = 0x8000;
const REGION1_BASE: u64 = 0xc000;
const REGION1: usize = 0x4000;

fn device() -> &'static Mutex<Vsock> {
    static DEV: OnceLock<Mutex<Vsock>> = OnceLock::new();
    DEV.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("k7d-fuzz-vsock-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("v.sock");
        let _ = std::fs::remove_file(&path);
        Mutex::new(Vsock::new(3, path).expect("vsock device"))
    })
}

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

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let size = 1u16 << (data[0] % 7);
    let event_idx = data[1] & 1 != 0;
    let body = &data[2..];

    let mem = GuestMemoryTracked::from_ranges(&[(GuestAddress(0), REGION0), (GuestAddress(REGION1_BASE), REGION1)])
        .expect("guest memory");
    let n0 = body.len().min(REGION0);
    mem.write_slice(&body[..n0], GuestAddress(0)).expect("fill region 0");
    let rest = &body[n0..];
    let n1 = rest.len().min(REGION1);
    mem.write_slice(&rest[..n1], GuestAddress(REGION1_BASE))
        .expect("fill region 1");

    let mut queues = Vec::with_capacity(3);
    for i in 0..3u64 {
        let Some(q) = queue(&mem, size, i, event_idx) else {
            return;
        };
        queues.push(ActiveQueue {
            index: i as u16,
            queue: q,
            notify: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        });
    }
    let msix = MsixVectors::new(4, Arc::new(NoopMsiRouter)).expect("msix");
    let interrupt = Interrupt::new(
        Arc::new(msix),
        vec![0, 1, 2],
        VIRTIO_MSI_NO_VECTOR,
        Arc::new(InterruptStatus::default()),
    );
    let ctx = ActivateContext {
        mem: Arc::new(mem),
        acked_features: VIRTIO_F_VERSION_1,
        queues,
        interrupt,
    };
    let mut dev = device().lock().unwrap_or_else(|p| p.into_inner());
    dev.activate(ctx).expect("activate");
    let back = dev.reset();
    assert_eq!(back.len(), 3, "the vsock device lost a queue");
});

//! Entry points for the fuzz targets (`devices/fuzz/fuzz_targets/net_tx.rs`):
//! the real worker code, driven synchronously on one thread. Not an API.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use k7d_sys::tap::Tap;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::device::NetStats;
use super::event_handler::{CtrlQueue, PairWorker};
use crate::pci::{MsixVectors, NoopMsiRouter};
use crate::virtio::{ActiveQueue, GuestMemoryHandle, Interrupt, InterruptStatus, VIRTIO_MSI_NO_VECTOR};

/// One queue pair's worker (plus the control queue) on a fake tap: `tap_fd`
/// stands in for tap queue 0 (a non-blocking datagram socket works: TX
/// frames are written to it, RX frames read from it).
pub struct PairHarness {
    worker: PairWorker,
    stats: Arc<NetStats>,
}

impl std::fmt::Debug for PairHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PairHarness").finish_non_exhaustive()
    }
}

impl PairHarness {
    /// Queues 0 (RX), 1 (TX) and, if given, 2 (control, for `max_pairs`
    /// pairs), all already set up against `mem`.
    pub fn new(
        mem: GuestMemoryHandle,
        rx: Queue,
        tx: Queue,
        ctrl: Option<Queue>,
        max_pairs: u16,
        tap_fd: OwnedFd,
    ) -> std::io::Result<Self> {
        let active = |index: u16, queue: Queue| -> std::io::Result<ActiveQueue> {
            Ok(ActiveQueue {
                index,
                queue,
                notify: EventFd::new(EFD_NONBLOCK)?,
            })
        };
        let msix = MsixVectors::new(4, Arc::new(NoopMsiRouter)).map_err(std::io::Error::other)?;
        let interrupt = Interrupt::new(
            Arc::new(msix),
            vec![0, 1, 2],
            VIRTIO_MSI_NO_VECTOR,
            Arc::new(InterruptStatus::default()),
        );
        let ctrl = match ctrl {
            Some(q) => Some(CtrlQueue {
                queue: active(2, q)?,
                max_pairs,
            }),
            None => None,
        };
        let stats = Arc::new(NetStats::new(max_pairs.max(1)));
        let tap = Tap {
            name: "k7d-fuzz".into(),
            ifindex: 0,
            queues: vec![tap_fd],
            vnet_hdr: true,
        };
        let worker = PairWorker::new(
            0,
            mem,
            active(0, rx)?,
            active(1, tx)?,
            ctrl,
            Arc::new(tap),
            interrupt,
            stats.clone(),
        );
        Ok(Self { worker, stats })
    }

    /// As if the driver acked `VIRTIO_NET_F_MRG_RXBUF` (or not).
    pub fn mergeable(mut self, on: bool) -> Self {
        self.worker = self.worker.mergeable(on);
        self
    }

    /// One TX wakeup: pop, check, `writev` every chain, used ring, signal.
    pub fn tx(&mut self) {
        self.worker.process_tx();
    }

    /// One RX wakeup: frames from the fake tap into RX buffers.
    pub fn rx(&mut self) {
        self.worker.process_rx();
    }

    /// One control-queue wakeup: parse, act, ack.
    pub fn ctrl(&mut self) {
        self.worker.process_ctrl();
    }

    /// The counters.
    pub fn stats(&self) -> &NetStats {
        &self.stats
    }
}

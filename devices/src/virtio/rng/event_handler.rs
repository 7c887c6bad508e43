//! The virtio-rng worker: waits on the queue's notify eventfd (the worker
//! framework adds the stop eventfd) and serves requests.

use std::fs::File;

use std::os::fd::AsRawFd;
use tracing::{debug, error, warn};
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestMemoryBackend};

use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::MAX_BYTES_PER_CHAIN;
use crate::virtio::worker::{EpollWorker, Registrar};
use crate::virtio::{GuestMemoryHandle, GuestMemoryTracked, Interrupt};

const TOKEN_QUEUE: u64 = 0;

pub(super) struct RngWorker {
    pub(super) mem: GuestMemoryHandle,
    pub(super) queue: Queue,
    pub(super) index: u16,
    pub(super) notify: EventFd,
    pub(super) interrupt: Interrupt,
    pub(super) source: File,
    pub(super) malformed: u64,
}

impl EpollWorker for RngWorker {
    const DEVICE: &'static str = "rng";

    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    fn diag_slot(&self) -> u16 {
        self.index
    }

    fn register(&mut self, fds: &Registrar<'_>) -> std::io::Result<()> {
        fds.add(self.notify.as_raw_fd(), EventSet::IN, TOKEN_QUEUE)
    }

    /// Buffers posted before activation or while parked (their notify is in
    /// the eventfd too, but serving them now costs nothing).
    fn on_start(&mut self) {
        self.process_queue();
    }

    fn handle_event(&mut self, token: u64, _: EventSet) {
        match token {
            TOKEN_QUEUE => {
                // Non-blocking; EAGAIN only means another wakeup consumed it.
                self.interrupt.diag().queue(self.index).note_kick(self.notify.read());
                self.process_queue();
                self.interrupt.diag().queue(self.index).note_position(&self.queue);
            }
            other => warn!(token = other, "rng worker got an unknown epoll token"),
        }
    }
}

impl RngWorker {
    /// Drains the available ring, re-checking after re-enabling notifications
    /// so a buffer posted in between is not missed, then signals once.
    fn process_queue(&mut self) {
        let mem: &GuestMemoryTracked = &self.mem;
        let mut used = false;
        loop {
            if let Err(e) = self.queue.disable_notification(mem) {
                error!(error = ?e, "rng queue is broken; waiting for a reset");
                return;
            }
            while let Some(chain) = self.queue.pop_descriptor_chain(mem) {
                let head = chain.head_index();
                let len = fill_chain(chain, &mut self.source, &mut self.malformed);
                if let Err(e) = self.queue.add_used(mem, head, len) {
                    error!(error = ?e, "rng could not return a buffer; waiting for a reset");
                    return;
                }
                used = true;
            }
            match self.queue.enable_notification(mem) {
                Ok(true) if crate::virtio::ring_unpoppable(&mut self.queue, mem) => {
                    error!("rng queue is broken (avail ring unreadable or ahead); waiting for a reset");
                    return;
                }
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    error!(error = ?e, "rng queue is broken; waiting for a reset");
                    return;
                }
            }
        }
        if !used {
            return;
        }
        match self.queue.needs_notification(mem) {
            Ok(true) => {
                if let Err(e) = self.interrupt.signal_queue(self.index) {
                    warn!(error = %e, "rng could not signal the guest");
                }
            }
            Ok(false) => self.interrupt.diag().queue(self.index).note_suppressed(),
            Err(e) => error!(error = ?e, "rng could not read the event index"),
        }
    }
}

/// Fills one request with random bytes; returns the number written. A chain
/// with a device-readable descriptor or a buffer outside guest memory is
/// malformed: nothing is written and it is returned at length 0.
fn fill_chain(chain: DescriptorChain<&GuestMemoryTracked>, source: &mut File, malformed: &mut u64) -> u32 {
    let mem = chain.memory();
    let mut bufs = Vec::new();
    for d in chain.clone() {
        let ok = d.is_write_only() && GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize);
        if !ok {
            *malformed += 1;
            if *malformed == 1 {
                warn!(
                    addr = d.addr().0,
                    len = d.len(),
                    writable = d.is_write_only(),
                    "malformed rng request returned empty (further ones logged at debug)"
                );
            } else {
                debug!(addr = d.addr().0, len = d.len(), "malformed rng request returned empty");
            }
            return 0;
        }
        bufs.push((d.addr(), d.len()));
    }
    let mut total = 0u32;
    for (addr, len) in bufs {
        let want = len.min(MAX_BYTES_PER_CHAIN - total);
        if want == 0 {
            break;
        }
        // Straight from the entropy fd into guest RAM, through vm-memory so the
        // region's bitmap records it.
        match mem.read_exact_volatile_from(addr, source, want as usize) {
            Ok(()) => total += want,
            Err(e) => {
                warn!(error = %e, "reading entropy into guest memory failed");
                break;
            }
        }
    }
    total
}

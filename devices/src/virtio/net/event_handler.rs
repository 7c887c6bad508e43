//! One virtio-net worker per queue pair, on the worker framework: waits on
//! the pair's RX and TX notify eventfds and its tap queue fd
//! (edge-triggered); worker 0 also serves the control queue. With vhost-net
//! one worker serves only the control queue.
//!
//! TX: pop chains, check them, `writev` the device-readable descriptors
//! straight from guest memory into the tap (no copy; reads of guest memory
//! need no dirty tracking). RX: read one frame into a bounce buffer, pop an
//! RX chain, copy the frame in with vm-memory's `write_slice` (the device's
//! bitmap records every byte written). A frame read while no RX buffer is
//! posted waits in the bounce buffer until the guest posts one. With
//! `VIRTIO_NET_F_MRG_RXBUF` a frame spans as many RX chains as it needs
//! (`num_buffers` in its header says how many), so a guest posts buffers of
//! a page or two instead of one of 64 KiB per frame (Linux's "big packets"
//! with TSO offered: 18 pages per buffer, 18 MiB for a ring of 256). Used
//! entries are added as they complete; the guest is signalled once per batch
//! (at most [`BATCH`] frames) and only when the event index asks for it.

use crate::virtio::ring_unpoppable;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use k7d_sys::tap::Tap;
use tracing::{debug, error, warn};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::epoll::EventSet;

use super::ctrl::{self, CtrlCommand};
use super::device::NetStats;
use super::{BATCH, MAX_FRAME_LEN, VNET_HDR_LEN};
use crate::virtio::worker::{EpollWorker, Registrar};
use crate::virtio::{ActiveQueue, GuestMemoryHandle, GuestMemoryTracked, Interrupt};

const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_TAP: u64 = 2;
const TOKEN_CTRL: u64 = 3;

/// Most iovecs in one TX frame (`UIO_MAXIOV`).
const MAX_IOV: usize = 1024;
/// Offset of `num_buffers` in `virtio_net_hdr_v1`.
const NUM_BUFFERS_OFF: usize = 10;

/// The control queue and the pair count it may set.
pub(super) struct CtrlQueue {
    pub(super) queue: ActiveQueue,
    pub(super) max_pairs: u16,
}

pub(super) struct PairWorker {
    pair: u16,
    mem: GuestMemoryHandle,
    rx: ActiveQueue,
    tx: ActiveQueue,
    ctrl: Option<CtrlQueue>,
    tap: Arc<Tap>,
    interrupt: Interrupt,
    stats: Arc<NetStats>,
    /// One frame from the tap, header first.
    bounce: Vec<u8>,
    /// Length of a frame in `bounce` still waiting for an RX buffer.
    pending: Option<usize>,
    iov: Vec<libc::iovec>,
    /// Queues that broke (the guest put garbage in the rings): served no more
    /// until reset.
    broken: [bool; 3],
    /// `VIRTIO_NET_F_MRG_RXBUF` acked: a frame may span several RX chains.
    mergeable: bool,
    /// `place_merged`'s scratch, kept so a frame allocates nothing: the
    /// chains taken (head, end of its buffers in `rx_bufs`) and their buffers.
    rx_chains: Vec<(u16, usize)>,
    rx_bufs: Vec<(GuestAddress, usize)>,
}

// SAFETY: `iov` only ever holds pointers while `process_tx` builds and sends
// one frame; between calls it is empty (cleared after use), so moving the
// worker to its thread moves no live raw pointer.
unsafe impl Send for PairWorker {}

/// What happened to one TX chain.
enum TxOutcome {
    Sent(usize),
    Malformed(&'static str),
    Refused(std::io::Error),
}

/// A queue pair's worker (`k7d-vnet-q<k>`); pair 0 also serves the control
/// queue.
impl EpollWorker for PairWorker {
    const DEVICE: &'static str = "net";

    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    fn diag_slot(&self) -> u16 {
        2 * self.pair
    }

    fn register(&mut self, fds: &Registrar<'_>) -> std::io::Result<()> {
        fds.add(self.rx.notify.as_raw_fd(), EventSet::IN, TOKEN_RX)?;
        fds.add(self.tx.notify.as_raw_fd(), EventSet::IN, TOKEN_TX)?;
        fds.add(
            self.fd().as_raw_fd(),
            EventSet::IN | EventSet::EDGE_TRIGGERED,
            TOKEN_TAP,
        )?;
        if let Some(c) = &self.ctrl {
            fds.add(c.queue.notify.as_raw_fd(), EventSet::IN, TOKEN_CTRL)?;
        }
        Ok(())
    }

    fn on_thread_start(&mut self) {
        self.stats.workers_running.fetch_add(1, Ordering::AcqRel);
        let tid = crate::virtio::diag::current_tid();
        if let Some(s) = self.stats.pairs.get(usize::from(self.pair)) {
            s.worker_tid.store(tid, Ordering::Release);
        }
    }

    /// Work posted before activation or while parked.
    fn on_start(&mut self) {
        self.process_tx();
        self.process_rx();
        self.process_ctrl();
    }

    fn handle_event(&mut self, token: u64, _: EventSet) {
        let diag = self.interrupt.diag();
        match token {
            TOKEN_TX => {
                // Non-blocking; EAGAIN only means another wakeup consumed it.
                diag.queue(self.tx.index).note_kick(self.tx.notify.read());
                self.process_tx();
            }
            TOKEN_RX => {
                diag.queue(self.rx.index).note_kick(self.rx.notify.read());
                self.process_rx();
            }
            TOKEN_TAP => {
                if let Some(s) = self.pair_stats() {
                    s.tap_wakeups.fetch_add(1, Ordering::Relaxed);
                }
                self.process_rx();
            }
            TOKEN_CTRL => {
                if let Some(c) = &self.ctrl {
                    diag.queue(c.queue.index).note_kick(c.queue.notify.read());
                }
                self.process_ctrl();
            }
            other => warn!(token = other, "net worker got an unknown epoll token"),
        }
    }

    fn on_thread_end(&mut self) {
        self.stats.workers_running.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PairWorker {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        pair: u16,
        mem: GuestMemoryHandle,
        rx: ActiveQueue,
        tx: ActiveQueue,
        ctrl: Option<CtrlQueue>,
        tap: Arc<Tap>,
        interrupt: Interrupt,
        stats: Arc<NetStats>,
    ) -> Self {
        Self {
            pair,
            mem,
            rx,
            tx,
            ctrl,
            tap,
            interrupt,
            stats,
            bounce: vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN],
            pending: None,
            iov: Vec::with_capacity(64),
            broken: [false; 3],
            mergeable: false,
            rx_chains: Vec::new(),
            rx_bufs: Vec::new(),
        }
    }

    /// With `VIRTIO_NET_F_MRG_RXBUF` acked: frames may span RX chains.
    pub(super) fn mergeable(mut self, on: bool) -> Self {
        self.mergeable = on;
        self
    }

    fn fd(&self) -> &OwnedFd {
        &self.tap.queues[usize::from(self.pair)]
    }

    /// The queues (RX, TX, control if it had it).
    pub(super) fn into_queues(self) -> Vec<ActiveQueue> {
        let mut out = vec![self.rx, self.tx];
        out.extend(self.ctrl.map(|c| c.queue));
        out
    }

    fn signal(&mut self, which: usize) {
        let mem: &GuestMemoryTracked = &self.mem;
        let q = match which {
            0 => &mut self.rx,
            1 => &mut self.tx,
            _ => match &mut self.ctrl {
                Some(c) => &mut c.queue,
                None => return,
            },
        };
        match q.queue.needs_notification(mem) {
            Ok(true) => {
                if let Some(s) = self.stats.pairs.get(usize::from(self.pair)) {
                    s.interrupts.fetch_add(1, Ordering::Relaxed);
                }
                if let Err(e) = self.interrupt.signal_queue(q.index) {
                    warn!(queue = q.index, error = %e, "net could not signal the guest");
                }
            }
            Ok(false) => self.interrupt.diag().queue(q.index).note_suppressed(),
            Err(e) => error!(queue = q.index, error = ?e, "net could not read the event index"),
        }
    }

    fn mark_broken(&mut self, which: usize, e: &dyn std::fmt::Debug) {
        if !self.broken[which] {
            error!(pair = self.pair, queue = which, error = ?e, "net queue is broken; waiting for a reset");
        }
        self.broken[which] = true;
    }

    fn pair_stats(&self) -> Option<&super::QueuePairStats> {
        self.stats.pairs.get(usize::from(self.pair))
    }

    fn count_malformed(&self, what: &str, why: &str) {
        if let Some(s) = self.pair_stats() {
            let n = s.malformed.fetch_add(1, Ordering::Relaxed);
            if n == 0 {
                warn!(
                    pair = self.pair,
                    what, why, "malformed virtio-net chain dropped (further ones logged at debug)"
                );
            } else {
                debug!(pair = self.pair, what, why, "malformed virtio-net chain dropped");
            }
        }
    }

    // ---------------------------------------------------------------- TX

    pub(super) fn process_tx(&mut self) {
        if self.broken[1] {
            return;
        }
        let mem_handle = self.mem.clone();
        let mem: &GuestMemoryTracked = &mem_handle;
        let mut done = 0usize;
        loop {
            if let Err(e) = self.tx.queue.disable_notification(mem) {
                return self.mark_broken(1, &e);
            }
            while let Some(chain) = self.tx.queue.pop_descriptor_chain(mem) {
                let head = chain.head_index();
                match self.send_chain(chain) {
                    TxOutcome::Sent(n) => {
                        if let Some(s) = self.pair_stats() {
                            s.tx_frames.fetch_add(1, Ordering::Relaxed);
                            s.tx_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    }
                    TxOutcome::Malformed(why) => {
                        self.count_malformed("tx", why);
                        if let Some(s) = self.pair_stats() {
                            s.tx_dropped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    TxOutcome::Refused(e) => {
                        if let Some(s) = self.pair_stats() {
                            if e.kind() == ErrorKind::WouldBlock {
                                s.tx_eagain.fetch_add(1, Ordering::Relaxed);
                            }
                            let n = s.tx_dropped.fetch_add(1, Ordering::Relaxed);
                            if n == 0 {
                                warn!(pair = self.pair, error = %e, "the tap refused a frame; dropped (further ones logged at debug)");
                            } else {
                                debug!(pair = self.pair, error = %e, "the tap refused a frame; dropped");
                            }
                        }
                    }
                }
                // TX buffers are returned with length 0 (nothing written).
                if let Err(e) = self.tx.queue.add_used(mem, head, 0) {
                    return self.mark_broken(1, &e);
                }
                done += 1;
                if done.is_multiple_of(BATCH) {
                    self.signal(1);
                }
            }
            match self.tx.queue.enable_notification(mem) {
                Ok(true) if ring_unpoppable(&mut self.tx.queue, mem) => {
                    return self.mark_broken(1, &"the driver's avail ring cannot be read");
                }
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => return self.mark_broken(1, &e),
            }
        }
        if done > 0 {
            self.signal(1);
        }
        self.interrupt.diag().queue(self.tx.index).note_position(&self.tx.queue);
    }

    /// Gathers one TX chain and writes it to the tap with one `writev`.
    fn send_chain(&mut self, chain: DescriptorChain<&GuestMemoryTracked>) -> TxOutcome {
        let mem = chain.memory();
        self.iov.clear();
        let mut total = 0usize;
        for d in chain.clone() {
            if d.is_write_only() {
                self.iov.clear();
                return TxOutcome::Malformed("device-writable descriptor in a TX chain");
            }
            total += d.len() as usize;
            if total > VNET_HDR_LEN + MAX_FRAME_LEN {
                self.iov.clear();
                return TxOutcome::Malformed("TX frame larger than 64 KiB");
            }
            for s in GuestMemoryBackend::get_slices(mem, d.addr(), d.len() as usize) {
                let Ok(s) = s else {
                    self.iov.clear();
                    return TxOutcome::Malformed("TX buffer outside guest memory");
                };
                if self.iov.len() == MAX_IOV {
                    self.iov.clear();
                    return TxOutcome::Malformed("TX chain has too many pieces");
                }
                self.iov.push(libc::iovec {
                    iov_base: s.ptr_guard().as_ptr().cast_mut().cast(),
                    iov_len: s.len(),
                });
            }
        }
        if total < VNET_HDR_LEN {
            self.iov.clear();
            return TxOutcome::Malformed("TX chain shorter than the virtio-net header");
        }
        // SAFETY: every entry was built from a checked descriptor range of
        // mmap'd guest RAM, which `self.mem` keeps mapped (the region map
        // never changes), or from the worker's own header buffer; writev
        // only reads them.
        let r = unsafe { k7d_sys::fd::writev(&self.tap.queues[usize::from(self.pair)], &self.iov) };
        self.iov.clear();
        match r {
            Ok(n) => TxOutcome::Sent(n),
            Err(e) => TxOutcome::Refused(e),
        }
    }

    // ---------------------------------------------------------------- RX

    /// Moves frames from the tap into RX buffers until the tap is empty or
    /// the guest has no buffer left (then asks to be notified when it posts
    /// one). The frame in hand when buffers ran out stays in `bounce`.
    pub(super) fn process_rx(&mut self) {
        if self.broken[0] {
            return;
        }
        let mem_handle = self.mem.clone();
        let mem: &GuestMemoryTracked = &mem_handle;
        let mut done = 0usize;
        loop {
            let len = match self.pending {
                Some(n) => n,
                None => match self.read_frame() {
                    Some(n) => n,
                    None => break,
                },
            };
            self.pending = Some(len);
            if self.mergeable {
                match self.place_merged(mem, len) {
                    Merged::Placed(n) => {
                        let before = done;
                        done += n;
                        if done / BATCH != before / BATCH {
                            self.signal(0);
                        }
                        continue;
                    }
                    Merged::Dropped => continue,
                    // The ring ran dry before the frame was placed (the
                    // chains taken were given back, the guest's next buffer
                    // kicks this worker), or it broke.
                    Merged::NoBuffer | Merged::Broken => break,
                }
            }
            let Some(chain) = self.rx.queue.pop_descriptor_chain(mem) else {
                match self.rx.queue.enable_notification(mem) {
                    Ok(true) if ring_unpoppable(&mut self.rx.queue, mem) => {
                        self.mark_broken(0, &"the driver's avail ring cannot be read");
                        break;
                    }
                    // A buffer arrived meanwhile: take it.
                    Ok(true) => {
                        if let Err(e) = self.rx.queue.disable_notification(mem) {
                            self.mark_broken(0, &e);
                            break;
                        }
                        continue;
                    }
                    Ok(false) => {
                        // The frame in hand waits for the guest's next RX buffer
                        // (its kick wakes this worker).
                        if let Some(s) = self.pair_stats() {
                            s.rx_no_buffer.fetch_add(1, Ordering::Relaxed);
                        }
                        break;
                    }
                    Err(e) => {
                        self.mark_broken(0, &e);
                        break;
                    }
                }
            };
            let head = chain.head_index();
            let written = match self.fill_chain(chain, len) {
                Ok(n) => {
                    self.pending = None;
                    if let Some(s) = self.pair_stats() {
                        s.rx_frames.fetch_add(1, Ordering::Relaxed);
                        s.rx_bytes.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    n as u32
                }
                Err(RxReject::TooSmall) => {
                    // The frame cannot fit this guest's buffers; drop it
                    // rather than stall the queue.
                    self.pending = None;
                    if let Some(s) = self.pair_stats() {
                        s.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    debug!(
                        pair = self.pair,
                        len, "RX frame larger than the guest's buffer; dropped"
                    );
                    0
                }
                Err(RxReject::Malformed(why)) => {
                    // The frame stays pending for the next buffer.
                    self.count_malformed("rx", why);
                    0
                }
            };
            if let Err(e) = self.rx.queue.add_used(mem, head, written) {
                self.mark_broken(0, &e);
                break;
            }
            done += 1;
            if done.is_multiple_of(BATCH) {
                self.signal(0);
            }
        }
        if done > 0 {
            self.signal(0);
        }
        self.interrupt.diag().queue(self.rx.index).note_position(&self.rx.queue);
        if let Some(s) = self.pair_stats() {
            s.rx_frame_waiting.store(self.pending.is_some(), Ordering::Relaxed);
        }
    }

    /// One frame from the tap into `bounce`; `None` when none is waiting (or
    /// the queue is detached).
    fn read_frame(&mut self) -> Option<usize> {
        loop {
            let r = k7d_sys::fd::read(&self.tap.queues[usize::from(self.pair)], &mut self.bounce);
            match r {
                Ok(n) if n < VNET_HDR_LEN + 14 => {
                    if let Some(s) = self.pair_stats() {
                        s.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    debug!(pair = self.pair, n, "runt frame from the tap dropped");
                    continue;
                }
                Ok(n) => return Some(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // EBADFD: the queue is detached (the guest uses fewer pairs).
                Err(e) if e.raw_os_error() == Some(libc::EBADFD) => return None,
                Err(e) => {
                    warn!(pair = self.pair, error = %e, "reading the tap failed");
                    return None;
                }
            }
        }
    }

    /// `MRG_RXBUF`: places the frame in `bounce[..len]` across as many RX
    /// chains as it needs, each checked before anything is written, with
    /// their count in the header's `num_buffers`. Chains are taken only
    /// when the frame fits: when the ring runs dry first they are given back
    /// (`NoBuffer`, the frame stays pending, notifications on). A malformed chain ends the
    /// attempt: every chain taken goes back used with length 0 (the guest
    /// drops them) and the frame waits for the next. A frame that the
    /// whole ring could not hold is dropped.
    fn place_merged(&mut self, mem: &GuestMemoryTracked, len: usize) -> Merged {
        let (mut taken, mut bufs) = (std::mem::take(&mut self.rx_chains), std::mem::take(&mut self.rx_bufs));
        taken.clear();
        bufs.clear();
        let r = self.place_merged_into(mem, len, &mut taken, &mut bufs);
        (self.rx_chains, self.rx_bufs) = (taken, bufs);
        r
    }

    fn place_merged_into(
        &mut self,
        mem: &GuestMemoryTracked,
        len: usize,
        taken: &mut Vec<(u16, usize)>,
        bufs: &mut Vec<(GuestAddress, usize)>,
    ) -> Merged {
        let mut cap = 0usize;
        let mut malformed = None;
        while cap < len {
            if taken.len() >= usize::from(self.rx.queue.size()) {
                // Even the whole ring is too small: give it back, drop the frame.
                for _ in 0..taken.len() {
                    self.rx.queue.go_to_previous_position();
                }
                self.pending = None;
                if let Some(s) = self.pair_stats() {
                    s.rx_dropped.fetch_add(1, Ordering::Relaxed);
                }
                debug!(
                    pair = self.pair,
                    len, "RX frame larger than the guest's whole ring; dropped"
                );
                return Merged::Dropped;
            }
            let Some(chain) = self.rx.queue.pop_descriptor_chain(mem) else {
                // Notifications on while the chains taken still count as
                // seen: with EVENT_IDX the avail event then asks for a kick
                // at the guest's next buffer, not at these (given back below).
                match self.rx.queue.enable_notification(mem) {
                    Ok(true) if ring_unpoppable(&mut self.rx.queue, mem) => {
                        self.mark_broken(0, &"the driver's avail ring cannot be read");
                        return Merged::Broken;
                    }
                    // A buffer arrived meanwhile: take it.
                    Ok(true) => {
                        if let Err(e) = self.rx.queue.disable_notification(mem) {
                            self.mark_broken(0, &e);
                            return Merged::Broken;
                        }
                        continue;
                    }
                    Ok(false) => {
                        for _ in 0..taken.len() {
                            self.rx.queue.go_to_previous_position();
                        }
                        if let Some(s) = self.pair_stats() {
                            s.rx_no_buffer.fetch_add(1, Ordering::Relaxed);
                        }
                        return Merged::NoBuffer;
                    }
                    Err(e) => {
                        self.mark_broken(0, &e);
                        return Merged::Broken;
                    }
                }
            };
            let head = chain.head_index();
            let mut chain_cap = 0usize;
            for d in chain {
                if !d.is_write_only() {
                    malformed = Some("device-readable descriptor in an RX chain");
                } else if !GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize) {
                    malformed = Some("RX buffer outside guest memory");
                }
                bufs.push((d.addr(), d.len() as usize));
                chain_cap = chain_cap.saturating_add(d.len() as usize);
            }
            if taken.is_empty() && chain_cap < VNET_HDR_LEN {
                malformed = malformed.or(Some("RX chain shorter than the virtio-net header"));
            }
            taken.push((head, bufs.len()));
            if malformed.is_some() {
                break;
            }
            cap = cap.saturating_add(chain_cap);
        }
        if let Some(why) = malformed {
            self.count_malformed("rx", why);
            for &(head, _) in taken.iter() {
                if let Err(e) = self.rx.queue.add_used(mem, head, 0) {
                    self.mark_broken(0, &e);
                    return Merged::Broken;
                }
            }
            return Merged::Placed(taken.len());
        }
        let count = u16::try_from(taken.len()).unwrap_or(u16::MAX);
        self.bounce[NUM_BUFFERS_OFF..NUM_BUFFERS_OFF + 2].copy_from_slice(&count.to_le_bytes());
        let mut off = 0usize;
        let mut from = 0usize;
        for &(head, end) in taken.iter() {
            let start = off;
            for &(addr, blen) in &bufs[from..end] {
                let take = blen.min(len - off);
                if take == 0 {
                    break;
                }
                // Through vm-memory: the device's dirty bitmap records these pages.
                if mem.write_slice(&self.bounce[off..off + take], addr).is_err() {
                    // Checked above: only a guest memory change could fail it.
                    self.mark_broken(0, &"an RX buffer write failed");
                    return Merged::Broken;
                }
                off += take;
            }
            from = end;
            if let Err(e) = self.rx.queue.add_used(mem, head, (off - start) as u32) {
                self.mark_broken(0, &e);
                return Merged::Broken;
            }
        }
        self.pending = None;
        if let Some(s) = self.pair_stats() {
            s.rx_frames.fetch_add(1, Ordering::Relaxed);
            s.rx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
        Merged::Placed(taken.len())
    }

    /// Copies the frame in `bounce[..len]` into an RX chain; returns the bytes
    /// written. The whole chain is checked before anything is written.
    fn fill_chain(&mut self, chain: DescriptorChain<&GuestMemoryTracked>, len: usize) -> Result<usize, RxReject> {
        let mem = chain.memory();
        let mut bufs: Vec<(GuestAddress, usize)> = Vec::new();
        let mut cap = 0usize;
        for d in chain.clone() {
            if !d.is_write_only() {
                return Err(RxReject::Malformed("device-readable descriptor in an RX chain"));
            }
            if !GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize) {
                return Err(RxReject::Malformed("RX buffer outside guest memory"));
            }
            if cap < len {
                bufs.push((d.addr(), d.len() as usize));
            }
            cap = cap.saturating_add(d.len() as usize);
        }
        if cap < VNET_HDR_LEN {
            return Err(RxReject::Malformed("RX chain shorter than the virtio-net header"));
        }
        if cap < len {
            return Err(RxReject::TooSmall);
        }
        // No MRG_RXBUF: one buffer per frame (the tap leaves this field alone).
        self.bounce[NUM_BUFFERS_OFF..NUM_BUFFERS_OFF + 2].copy_from_slice(&1u16.to_le_bytes());
        let mut off = 0usize;
        for (addr, blen) in bufs {
            let take = blen.min(len - off);
            // Through vm-memory: the device's dirty bitmap records these pages.
            mem.write_slice(&self.bounce[off..off + take], addr)
                .map_err(|_| RxReject::Malformed("RX buffer write failed"))?;
            off += take;
            if off == len {
                break;
            }
        }
        Ok(off)
    }

    // ---------------------------------------------------------------- control

    pub(super) fn process_ctrl(&mut self) {
        if self.broken[2] {
            return;
        }
        let mem_handle = self.mem.clone();
        let Some(c) = self.ctrl.as_mut() else { return };
        let r = serve_ctrl(c, &mem_handle, &self.tap, &self.stats);
        self.interrupt.diag().queue(c.queue.index).note_position(&c.queue.queue);
        match r {
            Ok(0) => {}
            Ok(_) => self.signal(2),
            Err(e) => self.mark_broken(2, &e),
        }
    }
}

/// Serves every pending control command: parse, act (`VQ_PAIRS_SET` attaches
/// tap queues), ack byte through vm-memory, used entry. Returns the chains
/// completed; an error means the ring itself is broken.
pub(super) fn serve_ctrl(
    c: &mut CtrlQueue,
    mem: &GuestMemoryTracked,
    tap: &Tap,
    stats: &NetStats,
) -> Result<usize, virtio_queue::Error> {
    let mut done = 0usize;
    loop {
        c.queue.queue.disable_notification(mem)?;
        while let Some(chain) = c.queue.queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let (cmd, ack) = ctrl::parse(chain, c.max_pairs);
            let ok = match cmd {
                CtrlCommand::SetPairs(n) => set_pairs(tap, stats, n),
                CtrlCommand::Refused => false,
            };
            let counter = if ok { &stats.ctrl_ok } else { &stats.ctrl_err };
            counter.fetch_add(1, Ordering::Relaxed);
            let mut len = 0;
            if let Some(at) = ack {
                // Through vm-memory, so the bitmap records the ack byte.
                if mem.write_obj(ctrl::ack_byte(ok), at).is_ok() {
                    len = 1;
                }
            }
            c.queue.queue.add_used(mem, head, len)?;
            done += 1;
        }
        if !c.queue.queue.enable_notification(mem)? {
            break;
        }
        if ring_unpoppable(&mut c.queue.queue, mem) {
            return Err(virtio_queue::Error::InvalidAvailRingIndex);
        }
    }
    Ok(done)
}

/// Attaches tap queues `0..n` and detaches the rest.
pub(super) fn set_pairs(tap: &Tap, stats: &NetStats, n: u16) -> bool {
    let queues = &tap.queues;
    if queues.len() > 1 {
        // Attach first so at least one queue is attached throughout.
        for fd in queues.iter().take(usize::from(n)) {
            if let Err(e) = k7d_sys::tap::set_attached(fd, true) {
                warn!(tap = %tap.name, error = %e, "attaching a tap queue failed");
                return false;
            }
        }
        for fd in queues.iter().skip(usize::from(n)) {
            if let Err(e) = k7d_sys::tap::set_attached(fd, false) {
                warn!(tap = %tap.name, error = %e, "detaching a tap queue failed");
                return false;
            }
        }
    }
    stats.active_pairs.store(n, Ordering::Release);
    debug!(tap = %tap.name, pairs = n, "guest set the queue-pair count");
    true
}

/// The control queue of a vhost-net device (`k7d-vnet-ctrl`): the kernel
/// serves the rings, this thread only `VQ_PAIRS_SET`.
pub(super) struct CtrlWorker {
    pub(super) mem: GuestMemoryHandle,
    pub(super) ctrl: CtrlQueue,
    pub(super) tap: Arc<Tap>,
    pub(super) interrupt: Interrupt,
    pub(super) stats: Arc<NetStats>,
    /// The ring broke in this run of the thread: commands are not served.
    pub(super) broken: bool,
}

impl EpollWorker for CtrlWorker {
    const DEVICE: &'static str = "net";

    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    fn diag_slot(&self) -> u16 {
        self.ctrl.queue.index
    }

    fn register(&mut self, fds: &Registrar<'_>) -> std::io::Result<()> {
        fds.add(self.ctrl.queue.notify.as_raw_fd(), EventSet::IN, TOKEN_CTRL)
    }

    fn on_thread_start(&mut self) {
        self.stats.workers_running.fetch_add(1, Ordering::AcqRel);
    }

    /// Commands posted before activation or while parked.
    fn on_start(&mut self) {
        self.broken = !self.serve();
    }

    fn handle_event(&mut self, token: u64, _: EventSet) {
        match token {
            TOKEN_CTRL => {
                self.interrupt
                    .diag()
                    .queue(self.ctrl.queue.index)
                    .note_kick(self.ctrl.queue.notify.read());
                if !self.broken {
                    self.broken = !self.serve();
                }
            }
            other => warn!(token = other, "net control worker got an unknown epoll token"),
        }
    }

    fn on_thread_end(&mut self) {
        self.stats.workers_running.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CtrlWorker {
    /// The control queue.
    pub(super) fn into_queues(self) -> Vec<ActiveQueue> {
        vec![self.ctrl.queue]
    }

    /// One round of commands; false when the ring broke.
    fn serve(&mut self) -> bool {
        let mem: &GuestMemoryTracked = &self.mem;
        let r = serve_ctrl(&mut self.ctrl, mem, &self.tap, &self.stats);
        let qd = self.interrupt.diag().queue(self.ctrl.queue.index);
        qd.note_position(&self.ctrl.queue.queue);
        match r {
            Ok(0) => true,
            Ok(_) => {
                let q = &mut self.ctrl.queue;
                match q.queue.needs_notification(mem) {
                    Ok(true) => {
                        if let Err(e) = self.interrupt.signal_queue(q.index) {
                            warn!(queue = q.index, error = %e, "net could not signal the guest");
                        }
                    }
                    Ok(false) => qd.note_suppressed(),
                    Err(e) => error!(queue = q.index, error = ?e, "net could not read the event index"),
                }
                true
            }
            Err(e) => {
                error!(error = ?e, "net control queue is broken; waiting for a reset");
                false
            }
        }
    }
}

/// A net worker thread's body: a queue pair (userspace data plane) or the
/// control queue of a vhost-net device.
pub(super) enum Worker {
    Pair(Box<PairWorker>),
    Ctrl(Box<CtrlWorker>),
}

impl EpollWorker for Worker {
    const DEVICE: &'static str = "net";

    fn interrupt(&self) -> &Interrupt {
        match self {
            Self::Pair(w) => w.interrupt(),
            Self::Ctrl(w) => w.interrupt(),
        }
    }

    fn diag_slot(&self) -> u16 {
        match self {
            Self::Pair(w) => w.diag_slot(),
            Self::Ctrl(w) => w.diag_slot(),
        }
    }

    fn register(&mut self, fds: &Registrar<'_>) -> std::io::Result<()> {
        match self {
            Self::Pair(w) => w.register(fds),
            Self::Ctrl(w) => w.register(fds),
        }
    }

    fn on_thread_start(&mut self) {
        match self {
            Self::Pair(w) => w.on_thread_start(),
            Self::Ctrl(w) => w.on_thread_start(),
        }
    }

    fn on_start(&mut self) {
        match self {
            Self::Pair(w) => w.on_start(),
            Self::Ctrl(w) => w.on_start(),
        }
    }

    fn handle_event(&mut self, token: u64, events: EventSet) {
        match self {
            Self::Pair(w) => w.handle_event(token, events),
            Self::Ctrl(w) => w.handle_event(token, events),
        }
    }

    fn on_thread_end(&mut self) {
        match self {
            Self::Pair(w) => w.on_thread_end(),
            Self::Ctrl(w) => w.on_thread_end(),
        }
    }
}

impl Worker {
    pub(super) fn into_queues(self) -> Vec<ActiveQueue> {
        match self {
            Self::Pair(w) => w.into_queues(),
            Self::Ctrl(w) => w.into_queues(),
        }
    }
}

enum RxReject {
    TooSmall,
    Malformed(&'static str),
}

/// What became of one frame with `MRG_RXBUF` ([`PairWorker::place_merged`]).
enum Merged {
    /// Used entries added (chains that took the frame, or malformed ones given back).
    Placed(usize),
    /// The frame was larger than the guest's whole ring.
    Dropped,
    /// The ring ran dry first: nothing taken, the frame waits.
    NoBuffer,
    /// The used ring could not be written: the queue is marked broken.
    Broken,
}

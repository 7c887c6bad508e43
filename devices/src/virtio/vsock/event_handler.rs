//! The vsock worker: one thread on the worker framework, waiting on the
//! three queue notify eventfds and the muxer's epoll (the listening unix
//! socket and every host stream, edge-triggered), nested in the worker's. TX packets go to the muxer; whatever the muxer has
//! for the guest (control packets, then stream data within the guest's
//! credit) is written into RX buffers through vm-memory.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;

use tracing::{debug, error, warn};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use virtio_vsock::packet::{PKT_HEADER_SIZE, VsockPacket};
use vm_memory::Bytes;
use vmm_sys_util::epoll::{EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::muxer::{Hdr, MAX_CONTROL_BACKLOG, Muxer, TOKEN_LISTENER};
use super::{EVQ, MAX_PKT_BUF_SIZE, RXQ, TXQ, VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, op};
use crate::virtio::worker::{EpollWorker, Registrar};
use crate::virtio::{GuestMemoryHandle, GuestMemoryTracked, Interrupt};

/// The muxer's own epoll (the listener and every host stream), nested in
/// the worker's: readable when one of them has an event.
const TOKEN_MUXER: u64 = 3;
const _: () = assert!(TOKEN_MUXER < TOKEN_LISTENER && (EVQ as u64) < TOKEN_MUXER);

pub(super) struct VsockWorker {
    pub(super) mem: GuestMemoryHandle,
    /// rx, tx, event (by queue index).
    pub(super) queues: Vec<Queue>,
    pub(super) notify: Vec<EventFd>,
    pub(super) interrupt: Interrupt,
    pub(super) muxer: Muxer,
    pub(super) malformed: u64,
    /// TX processing paused because the muxer's control backlog is full.
    pub(super) tx_stalled: bool,
    pub(super) buf: Vec<u8>,
    /// The guest kicked TX in the batch of events being handled.
    pub(super) tx_kick: bool,
    /// Events taken from the muxer's epoll.
    pub(super) mux_events: Vec<EpollEvent>,
    /// A TRANSPORT_RESET event is owed to the guest (a restored or forked
    /// device); sent before any packet, as soon as an event buffer is posted.
    pub(super) pending_reset: bool,
}

impl EpollWorker for VsockWorker {
    const DEVICE: &'static str = "vsock";

    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    fn diag_slot(&self) -> u16 {
        0
    }

    fn register(&mut self, fds: &Registrar<'_>) -> std::io::Result<()> {
        for (i, fd) in self.notify.iter().enumerate() {
            fds.add(fd.as_raw_fd(), EventSet::IN, i as u64)?;
        }
        fds.add(self.muxer.epoll().as_raw_fd(), EventSet::IN, TOKEN_MUXER)
    }

    /// Buffers posted before activation or while parked.
    fn on_start(&mut self) {
        self.send_transport_reset();
        self.process_tx();
        self.process_rx();
    }

    fn handle_event(&mut self, token: u64, _: EventSet) {
        match token {
            TOKEN_MUXER => self.drain_muxer(),
            t => {
                // Non-blocking; EAGAIN only means another wakeup consumed it.
                if let Some(fd) = self.notify.get(t as usize) {
                    self.interrupt.diag().queue(t as u16).note_kick(fd.read());
                }
                self.tx_kick |= t == u64::from(TXQ);
            }
        }
    }

    fn after_events(&mut self) {
        self.send_transport_reset();
        if std::mem::take(&mut self.tx_kick) || self.tx_stalled {
            self.process_tx();
        }
        self.muxer.request_credit_where_stalled();
        self.process_rx();
        let diag = self.interrupt.diag();
        for (i, q) in self.queues.iter().enumerate() {
            diag.queue(i as u16).note_position(q);
        }
    }
}

impl VsockWorker {
    /// Hands up to 64 ready events of the listener and the host streams to
    /// the muxer, without waiting (the outer epoll said some are ready). One
    /// batch per wakeup, as before the nesting: the outer registration is
    /// level-triggered, so what remains wakes the worker again after the
    /// queues had their turn, and busy host sockets cannot starve them.
    fn drain_muxer(&mut self) {
        if self.mux_events.is_empty() {
            self.mux_events = vec![EpollEvent::default(); 64];
        }
        let n = match self.muxer.epoll().wait(0, &mut self.mux_events) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => return,
            Err(e) => {
                error!(error = %e, "the vsock muxer's epoll failed");
                return;
            }
        };
        for ev in &self.mux_events[..n] {
            self.muxer.handle_event(ev.data(), ev.event_set());
        }
    }

    /// Writes the owed TRANSPORT_RESET event (le32 id 0) into the guest's
    /// first well-formed event buffer (a malformed one is given back empty
    /// and the next is tried). With none posted yet it stays owed: the
    /// guest's kick of the event queue wakes the worker again.
    fn send_transport_reset(&mut self) {
        if !self.pending_reset {
            return;
        }
        let mem: &GuestMemoryTracked = &self.mem;
        let q = usize::from(EVQ);
        let mut used = false;
        while self.pending_reset {
            let Some(chain) = self.queues[q].pop_descriptor_chain(mem) else {
                debug!("vsock owes the guest a transport reset; no event buffer posted yet");
                break;
            };
            let head = chain.head_index();
            let len = match chain.clone().next() {
                Some(d) if d.is_write_only() && d.len() >= 4 => {
                    match mem.write_obj(VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le(), d.addr()) {
                        Ok(()) => 4,
                        Err(e) => {
                            warn!(error = %e, "writing the vsock transport reset into guest memory failed");
                            0
                        }
                    }
                }
                _ => {
                    note_malformed(
                        &mut self.malformed,
                        EVQ,
                        &"an event buffer that is not a writable 4 bytes",
                    );
                    0
                }
            };
            if let Err(e) = self.queues[q].add_used(mem, head, len) {
                error!(error = ?e, "vsock could not return an event buffer; waiting for a reset");
                break;
            }
            used = true;
            if len == 4 {
                self.pending_reset = false;
                debug!("vsock sent the guest a transport reset");
            }
        }
        if used {
            signal(&mut self.queues[q], mem, &self.interrupt, EVQ);
        }
    }

    /// Takes packets from the guest until the TX ring is empty (or the muxer
    /// cannot queue more replies). Every chain is returned with length 0: the
    /// device writes nothing into TX buffers.
    fn process_tx(&mut self) {
        // Field borrows, not an Arc clone: the memory's strong count says
        // exactly whether a worker holds it.
        let mem: &GuestMemoryTracked = &self.mem;
        let q = usize::from(TXQ);
        self.tx_stalled = false;
        let mut used = false;
        'outer: loop {
            if let Err(e) = self.queues[q].disable_notification(mem) {
                error!(error = ?e, "vsock tx queue is broken; waiting for a reset");
                return;
            }
            while let Some(mut chain) = self.queues[q].pop_descriptor_chain(mem) {
                if self.muxer.control_backlog() >= MAX_CONTROL_BACKLOG {
                    // The guest is not taking RX packets; resume after it does.
                    self.queues[q].go_to_previous_position();
                    self.tx_stalled = true;
                    break 'outer;
                }
                let head = chain.head_index();
                match VsockPacket::from_tx_virtq_chain(mem, &mut chain, MAX_PKT_BUF_SIZE) {
                    Ok(pkt) => {
                        let h = Hdr {
                            src_cid: pkt.src_cid(),
                            dst_cid: pkt.dst_cid(),
                            src_port: pkt.src_port(),
                            dst_port: pkt.dst_port(),
                            len: pkt.len(),
                            type_: pkt.type_(),
                            op: pkt.op(),
                            flags: pkt.flags(),
                            buf_alloc: pkt.buf_alloc(),
                            fwd_cnt: pkt.fwd_cnt(),
                        };
                        let mut n = 0;
                        if h.op == op::RW
                            && let Some(s) = pkt.data_slice()
                        {
                            n = (h.len as usize).min(s.len()).min(self.buf.len());
                            n = s.subslice(0, n).map_or(0, |s| s.copy_to(&mut self.buf[..n]));
                        }
                        self.muxer.handle_tx(&h, &self.buf[..n]);
                    }
                    Err(e) => note_malformed(&mut self.malformed, TXQ, &e),
                }
                if let Err(e) = self.queues[q].add_used(mem, head, 0) {
                    error!(error = ?e, "vsock could not return a tx buffer; waiting for a reset");
                    return;
                }
                used = true;
            }
            match self.queues[q].enable_notification(mem) {
                Ok(true) if crate::virtio::ring_unpoppable(&mut self.queues[q], mem) => {
                    error!("vsock tx queue is broken (avail ring unreadable or ahead); waiting for a reset");
                    break;
                }
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    error!(error = ?e, "vsock tx queue is broken; waiting for a reset");
                    return;
                }
            }
        }
        if used {
            signal(&mut self.queues[q], mem, &self.interrupt, TXQ);
        }
    }

    /// Fills RX buffers with whatever the muxer has for the guest.
    fn process_rx(&mut self) {
        if !self.muxer.has_rx_work() {
            return;
        }
        let mem: &GuestMemoryTracked = &self.mem;
        let q = usize::from(RXQ);
        let mut used = false;
        'outer: loop {
            if let Err(e) = self.queues[q].disable_notification(mem) {
                error!(error = ?e, "vsock rx queue is broken; waiting for a reset");
                return;
            }
            while self.muxer.has_rx_work() {
                let Some(mut chain) = self.queues[q].pop_descriptor_chain(mem) else {
                    break;
                };
                let head = chain.head_index();
                let len = match VsockPacket::from_rx_virtq_chain(mem, &mut chain, MAX_PKT_BUF_SIZE) {
                    Err(e) => {
                        note_malformed(&mut self.malformed, RXQ, &e);
                        0
                    }
                    Ok(mut pkt) => {
                        let cap = pkt.data_slice().map_or(0, |s| s.len()).min(self.buf.len());
                        match self.muxer.next_rx(&mut self.buf[..cap]) {
                            None if cap > 0 => {
                                // The stream had nothing after all; keep the buffer.
                                self.queues[q].go_to_previous_position();
                                break 'outer;
                            }
                            None => {
                                note_malformed(&mut self.malformed, RXQ, &"an RX buffer without room for data");
                                0
                            }
                            Some((h, n)) => write_packet(&mut pkt, &h, &self.buf[..n]),
                        }
                    }
                };
                if let Err(e) = self.queues[q].add_used(mem, head, len) {
                    error!(error = ?e, "vsock could not return an rx buffer; waiting for a reset");
                    return;
                }
                used = true;
            }
            match self.queues[q].enable_notification(mem) {
                Ok(true) if self.muxer.has_rx_work() && crate::virtio::ring_unpoppable(&mut self.queues[q], mem) => {
                    error!("vsock rx queue is broken (avail ring unreadable or ahead); waiting for a reset");
                    break;
                }
                Ok(true) if self.muxer.has_rx_work() => continue,
                Ok(_) => break,
                Err(e) => {
                    error!(error = ?e, "vsock rx queue is broken; waiting for a reset");
                    return;
                }
            }
        }
        if used {
            signal(&mut self.queues[q], mem, &self.interrupt, RXQ);
        }
    }
}

fn note_malformed(count: &mut u64, queue: u16, what: &dyn std::fmt::Display) {
    *count += 1;
    if *count == 1 {
        warn!(queue, error = %what, "malformed vsock chain dropped (further ones logged at debug)");
    } else {
        debug!(queue, error = %what, "malformed vsock chain dropped");
    }
}

fn signal(queue: &mut Queue, mem: &GuestMemoryTracked, interrupt: &Interrupt, index: u16) {
    match queue.needs_notification(mem) {
        Ok(true) => {
            if let Err(e) = interrupt.signal_queue(index) {
                warn!(error = %e, "vsock could not signal the guest");
            }
        }
        Ok(false) => interrupt.diag().queue(index).note_suppressed(),
        Err(e) => error!(error = ?e, "vsock could not read the event index"),
    }
}

/// Writes header and payload into an RX buffer (through the buffer's
/// `VolatileSlice`s, which mark the dirty bitmap); returns the used length.
fn write_packet<B: vm_memory::bitmap::BitmapSlice>(pkt: &mut VsockPacket<'_, B>, h: &Hdr, data: &[u8]) -> u32 {
    if !data.is_empty() {
        let Some(slice) = pkt.data_slice() else {
            return 0;
        };
        if let Err(e) = slice.write_slice(data, 0) {
            warn!(error = %e, "writing vsock payload into guest memory failed");
            return 0;
        }
    }
    let mut raw = [0u8; PKT_HEADER_SIZE];
    raw[0..8].copy_from_slice(&h.src_cid.to_le_bytes());
    raw[8..16].copy_from_slice(&h.dst_cid.to_le_bytes());
    raw[16..20].copy_from_slice(&h.src_port.to_le_bytes());
    raw[20..24].copy_from_slice(&h.dst_port.to_le_bytes());
    raw[24..28].copy_from_slice(&h.len.to_le_bytes());
    raw[28..30].copy_from_slice(&h.type_.to_le_bytes());
    raw[30..32].copy_from_slice(&h.op.to_le_bytes());
    raw[32..36].copy_from_slice(&h.flags.to_le_bytes());
    raw[36..40].copy_from_slice(&h.buf_alloc.to_le_bytes());
    raw[40..44].copy_from_slice(&h.fwd_cnt.to_le_bytes());
    if let Err(e) = pkt.set_header_from_raw(&raw) {
        warn!(error = %e, "writing a vsock header into guest memory failed");
        return 0;
    }
    (PKT_HEADER_SIZE + data.len()) as u32
}

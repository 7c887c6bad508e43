//! The state dump of one virtio-pci function (`SIGUSR1`, see
//! `docs/diagnostics.md`): registers, every queue with the guest's view of
//! its rings read from guest memory, MSI-X, the worker threads, and the
//! device's own counters. Read-only: nothing here changes what the guest or
//! the workers see.

use vm_memory::{Bytes, GuestAddress};

use super::pci::VirtioPciDevice;
use crate::virtio::{GuestMemoryTracked, VIRTIO_MSI_NO_VECTOR, VIRTIO_RING_F_EVENT_IDX, status};

/// `VRING_AVAIL_F_NO_INTERRUPT`: the driver asks for no interrupts.
const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// `VRING_USED_F_NO_NOTIFY`: the device asks for no kicks.
const USED_F_NO_NOTIFY: u16 = 1;

/// A little-endian u16 at `base + off` in guest memory; `None` when the
/// address overflows or lies outside guest RAM (the guest wrote it).
fn read_u16(mem: &GuestMemoryTracked, base: u64, off: u64) -> Option<u16> {
    let at = base.checked_add(off)?;
    mem.read_obj::<u16>(GuestAddress(at)).ok().map(u16::from_le)
}

fn opt(v: Option<u16>) -> String {
    v.map_or_else(|| "?".into(), |v| v.to_string())
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// The status byte as `0x0f(acknowledge,driver,features_ok,driver_ok)`.
pub(crate) fn status_words(s: u8) -> String {
    let names = [
        (status::ACKNOWLEDGE, "acknowledge"),
        (status::DRIVER, "driver"),
        (status::FEATURES_OK, "features_ok"),
        (status::DRIVER_OK, "driver_ok"),
        (status::DEVICE_NEEDS_RESET, "needs_reset"),
        (status::FAILED, "failed"),
    ];
    let words: Vec<&str> = names.iter().filter(|(b, _)| s & b != 0).map(|(_, n)| *n).collect();
    format!(
        "{s:#04x}({})",
        if words.is_empty() {
            "reset".into()
        } else {
            words.join(",")
        }
    )
}

/// A thread's name from procfs, or `gone` when the thread no longer exists.
fn thread_name(tid: u64) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "gone".into())
}

impl VirtioPciDevice {
    /// The function's state as dump lines (no prefix, no newline): first the
    /// function, then `q<i>` per queue, `worker<slot>` per worker thread
    /// that ever ran, then the device's own lines.
    pub fn debug_state(&self) -> Vec<String> {
        let mut out = Vec::new();
        let event_idx = self.driver_features & VIRTIO_RING_F_EVENT_IDX != 0;
        let (msix_on, fmask) = self.msix.debug_control();
        out.push(format!(
            "status={} features={:#x} event_idx={} active={} msix={} fmask={} config_vector={} isr={:#x}",
            status_words(self.status),
            self.driver_features,
            yes(event_idx),
            yes(self.active),
            if msix_on { "on" } else { "off" },
            yes(fmask),
            self.vector_words(self.config_vector),
            self.irq_status.isr(),
        ));
        for (i, r) in self.queues.iter().enumerate() {
            let d = self.diag.queue(i as u16);
            let mut line = format!(
                "q{i} size={} ready={} vector={}",
                r.size,
                u8::from(r.ready),
                self.vector_words(r.vector)
            );
            let pos = d.position();
            match pos {
                Some((a, u)) => line.push_str(&format!(" next_avail={a} next_used={u}")),
                None => line.push_str(" next_avail=? next_used=?"),
            }
            if r.ready {
                line.push_str(&ring_words(&self.mem, r.driver, r.device, r.size, event_idx, pos));
            }
            let (kicks, irqs, suppressed) = d.counters();
            line.push_str(&format!(" kicks={kicks} irqs={irqs} suppressed={suppressed}"));
            out.push(line);
        }
        for slot in 0..self.queues.len() {
            if let Some((tid, state, ago, wakeups)) = self.diag.worker(slot as u16).snapshot() {
                out.push(format!(
                    "worker{slot} tid={tid} name={} state={} for={ago:.3}s wakeups={wakeups}",
                    thread_name(tid),
                    state.as_str()
                ));
            }
        }
        out.extend(self.device.debug_state());
        out
    }

    /// `none`, or `<v>(masked=..,pending=..)` for an MSI-X vector.
    fn vector_words(&self, v: u16) -> String {
        if v == VIRTIO_MSI_NO_VECTOR {
            return "none".into();
        }
        match self.msix.debug_vector(v) {
            Some((masked, pending)) => format!("{v}(masked={},pending={})", yes(masked), yes(pending)),
            None => format!("{v}(no such vector)"),
        }
    }
}

/// The guest's side of a queue's rings: `avail.idx`, `avail.flags`,
/// `used.idx`, `used.flags`, and with EVENT_IDX `used_event` (the driver's,
/// at the end of the avail ring) and `avail_event` (the device's, at the end
/// of the used ring); `to_pop` is how many buffers the guest posted that the
/// device has not taken. Unreadable fields print `?`.
fn ring_words(
    mem: &GuestMemoryTracked,
    avail: u64,
    used: u64,
    size: u16,
    event_idx: bool,
    pos: Option<(u16, u16)>,
) -> String {
    let size = u64::from(size);
    let avail_flags = read_u16(mem, avail, 0);
    let avail_idx = read_u16(mem, avail, 2);
    let used_flags = read_u16(mem, used, 0);
    let used_idx = read_u16(mem, used, 2);
    let mut s = format!(
        " avail.idx={} avail.flags={}{} used.idx={} used.flags={}{}",
        opt(avail_idx),
        avail_flags.map_or_else(|| "?".into(), |f| format!("{f:#x}")),
        if avail_flags.is_some_and(|f| f & AVAIL_F_NO_INTERRUPT != 0) {
            "(no_interrupt)"
        } else {
            ""
        },
        opt(used_idx),
        used_flags.map_or_else(|| "?".into(), |f| format!("{f:#x}")),
        if used_flags.is_some_and(|f| f & USED_F_NO_NOTIFY != 0) {
            "(no_notify)"
        } else {
            ""
        },
    );
    if event_idx {
        let used_event = read_u16(mem, avail, 4 + 2 * size);
        let avail_event = read_u16(mem, used, 4 + 8 * size);
        s.push_str(&format!(
            " used_event={} avail_event={}",
            opt(used_event),
            opt(avail_event)
        ));
    }
    if let (Some(idx), Some((next_avail, _))) = (avail_idx, pos) {
        s.push_str(&format!(" to_pop={}", idx.wrapping_sub(next_avail)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;
    use vm_memory::bitmap::AtomicBitmap;

    /// A live rng function driven as Linux drives it (EVENT_IDX, MSI-X):
    /// after one request the dump shows both sides of the ring, the kick,
    /// the interrupt and the worker back in epoll; after a reset, the
    /// worker parked and the position forgotten.
    #[test]
    fn a_live_queue_shows_both_sides_of_its_ring_and_its_worker() {
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
        use virtio_queue::desc::{RawDescriptor, split::Descriptor};
        use virtio_queue::mock::MockSplitQueue;

        use crate::bus::BusDevice;
        use crate::pci::NoopMsiRouter;
        use crate::virtio::rng::Rng;
        use crate::virtio::transport::layout::{NOTIFY_OFFSET, common};

        let mem = Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap());
        let rng = Rng::new().unwrap();
        let mut d = VirtioPciDevice::new(Box::new(rng), mem.clone(), Arc::new(NoopMsiRouter)).unwrap();
        d.msix().set_control(true, false);
        for v in 0..2u64 {
            d.msix().write_table(v * 16 + 12, &0u32.to_le_bytes());
        }
        let w = |d: &mut VirtioPciDevice, off: u64, n: usize, v: u64| d.write(off, &v.to_le_bytes()[..n]);
        let mq = MockSplitQueue::create(&*mem, GuestAddress(0x1_0000), 16);
        w(&mut d, common::DEVICE_STATUS, 1, 0x03);
        w(&mut d, common::DRIVER_FEATURE_SELECT, 4, 1);
        w(&mut d, common::DRIVER_FEATURE, 4, 1); // VERSION_1
        w(&mut d, common::DRIVER_FEATURE_SELECT, 4, 0);
        w(&mut d, common::DRIVER_FEATURE, 4, 1 << 29); // EVENT_IDX
        w(&mut d, common::DEVICE_STATUS, 1, 0x0b);
        w(&mut d, common::CONFIG_MSIX_VECTOR, 2, 0);
        w(&mut d, common::QUEUE_SELECT, 2, 0);
        w(&mut d, common::QUEUE_SIZE, 2, 16);
        w(&mut d, common::QUEUE_DESC, 8, mq.desc_table_addr().0);
        w(&mut d, common::QUEUE_DRIVER, 8, mq.avail_addr().0);
        w(&mut d, common::QUEUE_DEVICE, 8, mq.desc_table_addr().0 + 4096);
        w(&mut d, common::QUEUE_MSIX_VECTOR, 2, 1);
        w(&mut d, common::QUEUE_ENABLE, 2, 1);
        w(&mut d, common::DEVICE_STATUS, 1, 0x0f);
        assert!(d.is_active());

        let desc = RawDescriptor::from(Descriptor::new(0x40_0000, 64, VRING_DESC_F_WRITE as u16, 0));
        mq.add_desc_chains(&[desc], 0).unwrap();
        w(&mut d, NOTIFY_OFFSET, 2, 0); // a trapped kick
        let t = Instant::now();
        let worker_waiting = |d: &VirtioPciDevice| {
            d.debug_state()
                .iter()
                .any(|l| l.starts_with("worker0 ") && l.contains(" state=epoll ") && l.contains(" wakeups=1"))
        };
        while d.msix().irqfds()[1].read().is_err() || !worker_waiting(&d) {
            assert!(t.elapsed() < Duration::from_secs(5), "{:#?}", d.debug_state());
            std::thread::sleep(Duration::from_millis(5));
        }
        let lines = d.debug_state();
        assert_eq!(
            lines[0],
            "status=0x0f(acknowledge,driver,features_ok,driver_ok) features=0x120000000 event_idx=yes active=yes msix=on fmask=no config_vector=0(masked=no,pending=no) isr=0x1"
        );
        assert_eq!(
            lines[1],
            "q0 size=16 ready=1 vector=1(masked=no,pending=no) next_avail=1 next_used=1 avail.idx=1 avail.flags=0x0 used.idx=1 used.flags=0x0 used_event=0 avail_event=1 to_pop=0 kicks=1 irqs=1 suppressed=0"
        );
        assert!(lines[2].starts_with("worker0 tid="), "{lines:?}");
        assert!(lines[2].contains(" name=k7d-virtio-rng state=epoll "), "{lines:?}");
        assert_eq!(lines[3], "backend worker=running");

        // Reset: the worker leaves, the queue is the transport's again.
        w(&mut d, common::DEVICE_STATUS, 1, 0);
        let lines = d.debug_state();
        assert!(
            lines[1].starts_with("q0 size=256 ready=0 vector=none next_avail=? next_used=? kicks=1"),
            "{lines:?}"
        );
        assert!(lines[2].contains(" state=parked "), "{lines:?}");
        assert_eq!(lines[3], "backend worker=none");
    }

    #[test]
    fn ring_reads_are_bounds_checked() {
        let mem: GuestMemoryTracked =
            GuestMemoryMmap::<AtomicBitmap>::from_ranges(&[(GuestAddress(0), 0x4000)]).unwrap();
        // avail ring at 0x1000: flags 1, idx 7, used_event (size 4) 5.
        mem.write_obj(1u16.to_le(), GuestAddress(0x1000)).unwrap();
        mem.write_obj(7u16.to_le(), GuestAddress(0x1002)).unwrap();
        mem.write_obj(5u16.to_le(), GuestAddress(0x1000 + 4 + 8)).unwrap();
        // used ring at 0x2000: idx 6, avail_event 6.
        mem.write_obj(6u16.to_le(), GuestAddress(0x2002)).unwrap();
        mem.write_obj(6u16.to_le(), GuestAddress(0x2000 + 4 + 32)).unwrap();
        let s = ring_words(&mem, 0x1000, 0x2000, 4, true, Some((6, 6)));
        assert_eq!(
            s,
            " avail.idx=7 avail.flags=0x1(no_interrupt) used.idx=6 used.flags=0x0 used_event=5 avail_event=6 to_pop=1"
        );
        // Outside guest memory, or an address that overflows: `?`, no panic.
        let s = ring_words(&mem, u64::MAX - 1, 0x10_0000, 256, true, None);
        assert_eq!(
            s,
            " avail.idx=? avail.flags=? used.idx=? used.flags=? used_event=? avail_event=?"
        );
        assert_eq!(status_words(0x0f), "0x0f(acknowledge,driver,features_ok,driver_ok)");
        assert_eq!(status_words(0), "0x00(reset)");
    }
}

//! The guest driver's side of a split virtqueue, for device benchmarks: the
//! descriptor table, avail ring and used ring live in real guest memory (a
//! memfd mapped like k7d maps guest RAM), the bench writes descriptors and
//! avail entries as Linux's virtio driver does, kicks the device's notify
//! eventfd and waits on the vector's irqfd for used entries.
//!
//! No EVENT_IDX: the device signals once per batch it completes; the driver
//! kicks after a batch it posts unless the device set `VRING_USED_F_NO_NOTIFY`
//! (it is still draining), as Linux's virtio driver does.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result, bail};
use k7d_devices::virtio::GuestMemoryTracked;
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::{AtomicBitmap, NewBitmap};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestRegionMmap};
use vmm_sys_util::eventfd::EventFd;

/// `VRING_DESC_F_NEXT`.
pub const F_NEXT: u16 = 1;
/// `VRING_DESC_F_WRITE`.
pub const F_WRITE: u16 = 2;

/// Guest RAM as k7d has it: one memfd, `MAP_SHARED`, with a dirty bitmap.
pub fn guest_memory(size: usize) -> Result<Arc<GuestMemoryTracked>> {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"k7d-bench-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create");
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64).context("sizing the memfd")?;
    let region = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::with_len(size))
        .with_file_offset(FileOffset::new(file, 0))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .build()
        .context("mapping the memfd")?;
    let region = GuestRegionMmap::new(region, GuestAddress(0)).context("guest region")?;
    Ok(Arc::new(
        GuestMemoryTracked::from_regions(vec![region]).context("guest memory")?,
    ))
}

/// One split ring, driver side. Layout from `base`: descriptor table
/// (16 bytes each), avail ring right after it, used ring on the next 4 KiB
/// boundary.
pub struct DriverRing {
    mem: Arc<GuestMemoryTracked>,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    avail_idx: u16,
    used_seen: u16,
}

impl DriverRing {
    /// A ring of `size` entries (a power of two) at `base`; bytes it spans.
    pub fn new(mem: Arc<GuestMemoryTracked>, base: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4096);
        Self {
            mem,
            size,
            desc,
            avail,
            used,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// Bytes from `base` to the end of the used ring.
    pub fn span(size: u16) -> u64 {
        let avail = 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4096);
        (used + 6 + 8 * u64::from(size)).next_multiple_of(4096)
    }

    /// The device's `Queue`, configured as the transport would after the
    /// driver wrote the addresses and set `queue_enable`.
    pub fn queue(&self) -> Result<Queue> {
        let mut q = Queue::new(self.size).context("Queue::new")?;
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
        if !q.is_valid(&*self.mem) {
            bail!("the bench's queue at {:#x} is not valid", self.desc);
        }
        Ok(q)
    }

    /// Ring size.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Writes descriptor `i`.
    pub fn set_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) -> Result<()> {
        let at = GuestAddress(self.desc + 16 * u64::from(i));
        self.mem.write_obj(addr, at)?;
        self.mem.write_obj(len, at.unchecked_add(8))?;
        self.mem.write_obj(flags, at.unchecked_add(12))?;
        self.mem.write_obj(next, at.unchecked_add(14))?;
        Ok(())
    }

    /// Makes chain `head` available (not yet visible: see [`Self::publish`]).
    pub fn push(&mut self, head: u16) -> Result<()> {
        let slot = u64::from(self.avail_idx % self.size);
        self.mem.write_obj(head, GuestAddress(self.avail + 4 + 2 * slot))?;
        self.avail_idx = self.avail_idx.wrapping_add(1);
        Ok(())
    }

    /// Publishes everything pushed: `avail.idx` with release ordering.
    pub fn publish(&self) -> Result<()> {
        self.mem
            .store(self.avail_idx, GuestAddress(self.avail + 2), Ordering::Release)?;
        Ok(())
    }

    /// Whether the device wants a kick for what was just published: Linux's
    /// `virtqueue_kick_prepare` without EVENT_IDX, i.e. `VRING_USED_F_NO_NOTIFY`
    /// clear. A worker that is still draining the ring sets the flag, so a
    /// busy device is not woken for every request.
    pub fn needs_kick(&self) -> Result<bool> {
        // The avail index store must be visible before the flag is read (the
        // device does the mirror image: flag clear, fence, avail re-read).
        std::sync::atomic::fence(Ordering::SeqCst);
        let flags: u16 = self.mem.load(GuestAddress(self.used), Ordering::Acquire)?;
        Ok(flags & 1 == 0)
    }

    /// The device's `used.idx` (acquire).
    pub fn used_idx(&self) -> Result<u16> {
        Ok(self.mem.load(GuestAddress(self.used + 2), Ordering::Acquire)?)
    }

    /// Used entries not yet reaped: (number of the first, how many); marks
    /// them seen.
    pub fn reap(&mut self) -> Result<(u16, u16)> {
        let now = self.used_idx()?;
        let first = self.used_seen;
        let n = now.wrapping_sub(first);
        if n > self.size {
            bail!("used.idx {now} ran {n} entries past {first}, more than the ring holds");
        }
        self.used_seen = now;
        Ok((first, n))
    }

    /// (id, len) of used entry number `i` (counting from the ring's start).
    pub fn used_elem(&self, i: u16) -> Result<(u32, u32)> {
        let at = self.used + 4 + 8 * u64::from(i % self.size);
        Ok((
            self.mem.read_obj(GuestAddress(at))?,
            self.mem.read_obj(GuestAddress(at + 4))?,
        ))
    }

    /// Chains posted and not yet used.
    pub fn in_flight(&self) -> u16 {
        self.avail_idx.wrapping_sub(self.used_seen)
    }
}

/// Waits up to `ms` for `irqfd` (an MSI-X vector's eventfd) and drains it.
pub fn wait_irq(irqfd: &EventFd, ms: i32) {
    let mut p = libc::pollfd {
        fd: irqfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) };
    let _ = irqfd.read();
}

//! Kernel vhost-net backend: the guest's RX/TX rings are served by the host
//! kernel (`vhost_net.ko`), one `/dev/vhost-net` instance per queue pair.
//!
//! Built by [`super::Net::new_vhost`]; the control queue stays in userspace
//! (a small worker, `k7d-vnet-ctrl`, that attaches/detaches tap queues on
//! `VQ_PAIRS_SET`).
//!
//! - **Open** ([`VhostNetBackend::open`], at NIC build time so a failure can
//!   still fall back to userspace): one `/dev/vhost-net` per pair,
//!   `VHOST_SET_OWNER`, `VHOST_GET_FEATURES` (must contain `VERSION_1`, and
//!   `VHOST_F_LOG_ALL` when the dirty log is asked for).
//! - **Features**: the device offers the userspace set, with the
//!   ring/header features the kernel implements ([`VHOST_GOVERNED`]) limited
//!   to what the kernel reports, plus `MRG_RXBUF` when the kernel has it
//!   ([`offered_features`]). At activation the kernel gets guest-acked ∩
//!   kernel-supported (+ `VHOST_F_LOG_ALL` with the dirty log)
//!   ([`kernel_features`]). Offloads (`CSUM`, `TSO`) are the tap's business
//!   (`TUNSETOFFLOAD`), not vhost's. The tap carries the virtio-net header
//!   (`VHOST_NET_F_VIRTIO_NET_HDR` is never set), sized 12 bytes
//!   ([`vnet_hdr_len`]: `VERSION_1` is always negotiated).
//! - **Activate** ([`VhostNetBackend::start`]), per active pair:
//!   `SET_FEATURES`, `SET_MEM_TABLE` (every guest RAM region: GPA, size,
//!   HVA; [`mem_table`]), `SET_LOG_BASE` (dirty log), then for local ring 0
//!   (RX) and 1 (TX): `SET_VRING_NUM`, `SET_VRING_ADDR` (desc/avail/used
//!   GPAs translated to HVAs by the `vhost` crate; `VHOST_VRING_F_LOG` with
//!   the used ring's GPA when logging), `SET_VRING_BASE(next_avail)`,
//!   `SET_VRING_KICK(queue notify eventfd)` (the eventfd the VMM registered
//!   as the queue's ioeventfd), `SET_VRING_CALL(irqfd of the queue's MSI-X
//!   vector)`, and last `NET_SET_BACKEND(tap queue fd k)`.
//! - **Stop** ([`VhostNetBackend::stop`], on reset and drop):
//!   `NET_SET_BACKEND(-1)`, `GET_VRING_BASE` → the queue's `next_avail`
//!   (`next_used` from the used ring's `idx`), so the queues handed back to
//!   the transport are exact. The fds stay open for the next activation and
//!   close on drop.
//! - **MSI-X masking**: vhost writes the vector's irqfd directly, bypassing
//!   `MsixVectors::trigger`'s pending bit. While a vector is masked the VMM
//!   disables its KVM route, so those writes are dropped (acceptable: Linux
//!   does not mask virtio-net queue vectors in normal operation; a VMM that
//!   wants no loss writes the irqfd once on unmask, a spurious virtio
//!   interrupt being harmless).
//! - **Dirty log** ([`VhostDirtyLog`], `VhostOptions::dirty_log`): the kernel
//!   writes RX buffers and used rings behind vm-memory's and KVM's back. With
//!   the log on, `VHOST_F_LOG_ALL` is acked and `SET_LOG_BASE` points at a
//!   bitmap (bit n = guest page n, 4 KiB, little-endian words) that the
//!   kernel sets for every page it writes; the fork path calls
//!   [`VhostDirtyLog::drain_into`] (after `Net` reset or with the guest
//!   paused) to OR it into the device's vm-memory bitmap.
//! - Counters: frames moved by the kernel are not counted in
//!   [`super::NetStats`] (only the control queue's are).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::{debug, info, warn};
use vhost::net::VhostNet;
use vhost::vhost_kern::VhostKernBackend;
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;
use virtio_queue::QueueT;
use vm_memory::bitmap::Bitmap;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::{NetError, VNET_HDR_LEN};
use crate::virtio::{
    ActiveQueue, GuestMemoryHandle, GuestMemoryTracked, Interrupt, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};

/// The kernel's vhost-net device node.
pub const VHOST_NET_PATH: &str = "/dev/vhost-net";
/// `VHOST_F_LOG_ALL`: the kernel logs every guest page it writes.
pub const VHOST_F_LOG_ALL: u64 = 1 << 26;
/// `VHOST_NET_F_VIRTIO_NET_HDR`: vhost adds/strips the header itself (never
/// used: the tap carries it). Same bit as the legacy `VIRTIO_F_ANY_LAYOUT`.
pub const VHOST_NET_F_VIRTIO_NET_HDR: u64 = 1 << 27;
/// `VHOST_VRING_F_LOG` as a `vhost_vring_addr.flags` bit.
const VRING_F_LOG: u32 = 1 << 0;
/// Page size of the vhost dirty log.
pub const VHOST_LOG_PAGE: u64 = 4096;
/// Memory regions the kernel accepts by default (`max_mem_regions`).
pub const VHOST_MAX_REGIONS: usize = 64;

/// Features the device offers that the kernel implements (ring layout and
/// RX buffer handling): offered only when `VHOST_GET_FEATURES` has them.
pub const VHOST_GOVERNED: u64 =
    VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_RING_F_INDIRECT_DESC | (1 << VIRTIO_NET_F_MRG_RXBUF);

/// Knobs of the vhost data plane, fixed when the NIC is built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VhostOptions {
    /// Ack `VHOST_F_LOG_ALL` and keep a [`VhostDirtyLog`] (needed by the fork
    /// path; costs the kernel one bit-set per page it writes).
    pub dirty_log: bool,
}

/// Features a vhost NIC offers: the userspace device's set (`userspace`) plus
/// `MRG_RXBUF`, with the [`VHOST_GOVERNED`] bits limited to the kernel's
/// (`kernel`, from `VHOST_GET_FEATURES`).
pub fn offered_features(userspace: u64, kernel: u64) -> u64 {
    let wanted = userspace | (1 << VIRTIO_NET_F_MRG_RXBUF);
    (wanted & !VHOST_GOVERNED) | (wanted & VHOST_GOVERNED & kernel)
}

/// What `VHOST_SET_FEATURES` gets: guest-acked ∩ kernel-supported, never
/// `VHOST_NET_F_VIRTIO_NET_HDR` (the tap carries the header), plus
/// `VHOST_F_LOG_ALL` when the dirty log is on.
pub fn kernel_features(acked: u64, kernel: u64, dirty_log: bool) -> u64 {
    let mut f = acked & kernel & !(VHOST_F_LOG_ALL | VHOST_NET_F_VIRTIO_NET_HDR);
    if dirty_log {
        f |= VHOST_F_LOG_ALL;
    }
    f
}

/// The tap's virtio-net header size for the acked features: 12 bytes
/// (`virtio_net_hdr_v1`) with `VERSION_1` or `MRG_RXBUF`, else the legacy 10.
pub fn vnet_hdr_len(acked: u64) -> usize {
    if acked & (VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_MRG_RXBUF)) != 0 {
        VNET_HDR_LEN
    } else {
        10
    }
}

/// The kernel memory table for `mem`: one entry per region (GPA, size, host
/// virtual address). Fails on an empty memory or more than
/// [`VHOST_MAX_REGIONS`] regions.
pub fn mem_table(mem: &GuestMemoryTracked) -> Result<Vec<VhostUserMemoryRegionInfo>, NetError> {
    let n = mem.num_regions();
    if n == 0 || n > VHOST_MAX_REGIONS {
        return Err(NetError::VhostMemory(n));
    }
    let mut table = Vec::with_capacity(n);
    for r in mem.iter() {
        let hva = r
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|_| NetError::VhostMemory(n))?;
        table.push(VhostUserMemoryRegionInfo {
            guest_phys_addr: r.start_addr().raw_value(),
            memory_size: r.len(),
            userspace_addr: hva as u64,
            mmap_offset: 0,
            mmap_handle: -1,
        });
    }
    Ok(table)
}

/// The vhost dirty log: one bit per 4 KiB guest page from GPA 0 to the end
/// of guest memory, set by the kernel (atomically, as little-endian words)
/// for every page it writes while `VHOST_F_LOG_ALL` is acked.
pub struct VhostDirtyLog {
    words: Box<[AtomicU64]>,
}

impl std::fmt::Debug for VhostDirtyLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostDirtyLog")
            .field("pages", &(self.words.len() * 64))
            .finish()
    }
}

impl crate::virtio::RamWriteLog for VhostDirtyLog {
    fn drain(&self, page: &mut dyn FnMut(GuestAddress)) {
        VhostDirtyLog::drain(self, page);
    }
}

impl VhostDirtyLog {
    /// A clear log covering every page of `mem`.
    pub fn for_memory(mem: &GuestMemoryTracked) -> Self {
        let end = mem.last_addr().raw_value().saturating_add(1);
        let pages = end.div_ceil(VHOST_LOG_PAGE);
        let words = usize::try_from(pages.div_ceil(64)).unwrap_or(0).max(1);
        Self {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The address handed to `VHOST_SET_LOG_BASE`.
    fn base(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// Pages the log covers.
    pub fn pages(&self) -> u64 {
        self.words.len() as u64 * 64
    }

    /// Clears the log, calling `f` with the GPA of each page that was
    /// dirty; returns how many there were.
    pub fn drain(&self, mut f: impl FnMut(GuestAddress)) -> usize {
        let mut n = 0;
        for (i, w) in self.words.iter().enumerate() {
            let mut bits = w.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                f(GuestAddress((i as u64 * 64 + b) * VHOST_LOG_PAGE));
                n += 1;
            }
        }
        n
    }

    /// Clears the log and marks each page it had in `mem`'s dirty bitmap
    /// (the device's view); returns the pages drained.
    pub fn drain_into(&self, mem: &GuestMemoryTracked) -> usize {
        self.drain(|gpa| {
            if let Some(r) = mem.find_region(gpa) {
                let off = gpa.raw_value() - r.start_addr().raw_value();
                let len = (r.len() - off).min(VHOST_LOG_PAGE);
                r.bitmap().mark_dirty(off as usize, len as usize);
            }
        })
    }

    /// Sets page `page`'s bit, as the kernel does (tests).
    #[cfg(test)]
    fn set_page(&self, page: u64) {
        let w = usize::try_from(page / 64).expect("page index");
        self.words[w].fetch_or(1 << (page % 64), Ordering::AcqRel);
    }
}

fn vhost_err(pair: u16, op: &'static str) -> impl Fn(vhost::Error) -> NetError {
    move |e| match e {
        vhost::Error::VhostOpen(source) => NetError::VhostOpen {
            path: VHOST_NET_PATH,
            reason: source,
        },
        other => NetError::Vhost {
            pair,
            op,
            reason: other.to_string(),
        },
    }
}

/// Opens `/dev/vhost-net` as a pair's device: what a daemon opens for a
/// VM process (which opens no path) and hands over, and what
/// [`VhostNetBackend::open`] opens itself.
pub fn open_vhost_net() -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(VHOST_NET_PATH)
}

/// One `/dev/vhost-net` instance over an open descriptor (the `vhost`
/// crate's kernel backend opens the path itself, which a VM process with
/// no filesystem cannot): the crate's ioctls through [`VhostKernBackend`],
/// and `VHOST_NET_SET_BACKEND`.
struct VhostNetDevice {
    fd: File,
    mem: GuestMemoryHandle,
}

impl std::os::fd::AsRawFd for VhostNetDevice {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

impl VhostKernBackend for VhostNetDevice {
    type AS = GuestMemoryHandle;

    fn mem(&self) -> &GuestMemoryHandle {
        &self.mem
    }
}

impl VhostNet for VhostNetDevice {
    fn set_backend(&self, queue_idx: usize, fd: Option<&File>) -> vhost::Result<()> {
        use std::os::fd::AsRawFd;
        let file = vhost::vhost_kern::vhost_binding::vhost_vring_file {
            index: u32::try_from(queue_idx)
                .map_err(|_| vhost::Error::IoctlError(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?,
            fd: fd.map_or(-1, |f| f.as_raw_fd()),
        };
        // SAFETY: the descriptor is this device's own /dev/vhost-net, the
        // request is VHOST_NET_SET_BACKEND, whose argument is the
        // `vhost_vring_file` passed by reference and only read by the
        // kernel; the return value is checked.
        let rc = unsafe {
            vmm_sys_util::ioctl::ioctl_with_ref(self, vhost::vhost_kern::vhost_binding::VHOST_NET_SET_BACKEND(), &file)
        };
        if rc < 0 {
            return Err(vhost::Error::IoctlError(std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

/// The kernel vhost-net data plane of one NIC: one `/dev/vhost-net` per
/// queue pair.
pub struct VhostNetBackend {
    /// Dropped first: the kernel stops using the log and guest memory when
    /// these close.
    pairs: Vec<VhostNetDevice>,
    kernel: u64,
    log: Option<Arc<VhostDirtyLog>>,
    /// The VM's RAM (a log switched on later is sized for it).
    mem: GuestMemoryHandle,
    /// Written by vhost for rings whose queue has no MSI-X vector (the
    /// driver assigned none: nobody is listening).
    no_vector: EventFd,
    /// Pairs with a backend set (`0..started`).
    started: usize,
}

impl std::fmt::Debug for VhostNetBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostNetBackend")
            .field("pairs", &self.pairs.len())
            .field("kernel_features", &format_args!("{:#x}", self.kernel))
            .field("dirty_log", &self.log.is_some())
            .field("started", &self.started)
            .finish()
    }
}

impl VhostNetBackend {
    /// Opens one `/dev/vhost-net` per pair, takes ownership (`SET_OWNER`) and
    /// reads the kernel's features. `mem` must be the VM's RAM (the mapping
    /// the device is activated with).
    pub fn open(mem: GuestMemoryHandle, queue_pairs: u16, opts: VhostOptions) -> Result<Self, NetError> {
        let devices = (0..queue_pairs)
            .map(|k| open_vhost_net().map_err(|e| vhost_err(k, "open")(vhost::Error::VhostOpen(e))))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_devices(mem, devices, opts)
    }

    /// [`VhostNetBackend::open`] over `devices`, one `/dev/vhost-net` per
    /// queue pair opened by the caller ([`open_vhost_net`]; a VM process is
    /// handed them). `VHOST_SET_OWNER` is done here: the kernel's worker
    /// then serves this process's memory.
    pub fn with_devices(mem: GuestMemoryHandle, devices: Vec<File>, opts: VhostOptions) -> Result<Self, NetError> {
        let log = opts.dirty_log.then(|| Arc::new(VhostDirtyLog::for_memory(&mem)));
        let queue_pairs = u16::try_from(devices.len()).map_err(|_| NetError::Vhost {
            pair: 0,
            op: "open",
            reason: format!("{} vhost-net devices for one NIC", devices.len()),
        })?;
        let mut pairs = Vec::with_capacity(devices.len());
        let mut kernel = u64::MAX;
        for (k, fd) in (0u16..).zip(devices) {
            let net = VhostNetDevice { fd, mem: mem.clone() };
            net.set_owner().map_err(vhost_err(k, "VHOST_SET_OWNER"))?;
            kernel &= net.get_features().map_err(vhost_err(k, "VHOST_GET_FEATURES"))?;
            pairs.push(net);
        }
        if kernel & VIRTIO_F_VERSION_1 == 0 {
            return Err(NetError::VhostFeature("VIRTIO_F_VERSION_1"));
        }
        if opts.dirty_log && kernel & VHOST_F_LOG_ALL == 0 {
            return Err(NetError::VhostFeature("VHOST_F_LOG_ALL"));
        }
        let no_vector = EventFd::new(EFD_NONBLOCK).map_err(|e| NetError::Vhost {
            pair: 0,
            op: "eventfd",
            reason: e.to_string(),
        })?;
        info!(
            pairs = queue_pairs,
            kernel_features = kernel,
            dirty_log = opts.dirty_log,
            "vhost-net opened"
        );
        Ok(Self {
            pairs,
            kernel,
            log,
            mem,
            no_vector,
            started: 0,
        })
    }

    /// `VHOST_GET_FEATURES` (the intersection over all pairs).
    pub fn kernel_supported(&self) -> u64 {
        self.kernel
    }

    /// The dirty log, when built with one or switched on.
    pub fn dirty_log(&self) -> Option<Arc<VhostDirtyLog>> {
        self.log.clone()
    }

    /// Switches the dirty log on (idempotent) for the next [`Self::start`]:
    /// the kernel then logs every page it writes (`VHOST_F_LOG_ALL`). Only
    /// while stopped (the device is paused): a running backend keeps its
    /// features until it is started again.
    pub fn enable_dirty_log(&mut self) -> Result<Arc<VhostDirtyLog>, NetError> {
        if let Some(l) = &self.log {
            return Ok(l.clone());
        }
        if self.kernel & VHOST_F_LOG_ALL == 0 {
            return Err(NetError::VhostFeature("VHOST_F_LOG_ALL"));
        }
        if self.started > 0 {
            return Err(NetError::Vhost {
                pair: 0,
                op: "enable the dirty log",
                reason: "the backend is running; pause the device first".into(),
            });
        }
        let log = Arc::new(VhostDirtyLog::for_memory(&self.mem));
        self.log = Some(log.clone());
        info!("vhost-net dirty log on from the next start");
        Ok(log)
    }

    /// Whether any pair is running.
    pub fn is_started(&self) -> bool {
        self.started > 0
    }

    /// Hands `rings` (RX of pair 0, TX of pair 0, RX of pair 1, ...) to the
    /// kernel, pair k on tap queue `tap_queues[k]`. On error the caller calls
    /// [`Self::stop`] to undo the pairs already started.
    pub fn start(
        &mut self,
        acked: u64,
        rings: &[ActiveQueue],
        tap_queues: &[OwnedFd],
        interrupt: &Interrupt,
    ) -> Result<(), NetError> {
        let features = kernel_features(acked, self.kernel, self.log.is_some());
        for (k, pair) in rings.chunks(2).enumerate() {
            let kp = k as u16;
            let (Some(dev), Some(tap), [rx, tx]) = (self.pairs.get(k), tap_queues.get(k), pair) else {
                return Err(NetError::Vhost {
                    pair: kp,
                    op: "start",
                    reason: "the device has fewer vhost instances or tap queues than rings".into(),
                });
            };
            dev.set_features(features)
                .map_err(vhost_err(kp, "VHOST_SET_FEATURES"))?;
            let table = mem_table(dev.mem())?;
            dev.set_mem_table(&table)
                .map_err(vhost_err(kp, "VHOST_SET_MEM_TABLE"))?;
            if let Some(log) = &self.log {
                dev.set_log_base(log.base(), None)
                    .map_err(vhost_err(kp, "VHOST_SET_LOG_BASE"))?;
            }
            for (i, q) in [rx, tx].into_iter().enumerate() {
                let cfg = VringConfigData {
                    queue_max_size: q.queue.max_size(),
                    queue_size: q.queue.size(),
                    flags: if self.log.is_some() { VRING_F_LOG } else { 0 },
                    desc_table_addr: q.queue.desc_table(),
                    used_ring_addr: q.queue.used_ring(),
                    avail_ring_addr: q.queue.avail_ring(),
                    log_addr: self.log.as_ref().map(|_| q.queue.used_ring()),
                };
                dev.set_vring_num(i, q.queue.size())
                    .map_err(vhost_err(kp, "VHOST_SET_VRING_NUM"))?;
                dev.set_vring_addr(i, &cfg)
                    .map_err(vhost_err(kp, "VHOST_SET_VRING_ADDR"))?;
                dev.set_vring_base(i, q.queue.next_avail())
                    .map_err(vhost_err(kp, "VHOST_SET_VRING_BASE"))?;
                dev.set_vring_kick(i, &q.notify)
                    .map_err(vhost_err(kp, "VHOST_SET_VRING_KICK"))?;
                let call = match interrupt.queue_vector(q.index).and_then(|v| {
                    let fd = interrupt.msix().irqfds().get(usize::from(v))?;
                    // The kernel writes this irqfd behind the MSI-X state:
                    // replay it on unmask (see `set_kernel_writer`).
                    interrupt.msix().set_kernel_writer(v, true);
                    Some(fd)
                }) {
                    Some(fd) => fd,
                    None => {
                        warn!(
                            queue = q.index,
                            "virtio-net queue has no MSI-X vector; the kernel's completions will not interrupt the guest"
                        );
                        &self.no_vector
                    }
                };
                dev.set_vring_call(i, call)
                    .map_err(vhost_err(kp, "VHOST_SET_VRING_CALL"))?;
            }
            let file = File::from(tap.try_clone().map_err(|e| NetError::Vhost {
                pair: kp,
                op: "dup tap queue",
                reason: e.to_string(),
            })?);
            // Counted before the ioctls so a half-started pair is stopped too.
            self.started = k + 1;
            for i in 0..2 {
                dev.set_backend(i, Some(&file))
                    .map_err(vhost_err(kp, "VHOST_NET_SET_BACKEND"))?;
            }
            debug!(pair = k, features, "vhost-net pair started");
        }
        Ok(())
    }

    /// Detaches the tap from every started pair and writes the kernel's ring
    /// positions back into `rings` (same order as [`Self::start`]).
    pub fn stop(&mut self, rings: &mut [ActiveQueue]) {
        for (k, pair) in rings.chunks_mut(2).enumerate().take(self.started) {
            let Some(dev) = self.pairs.get(k) else { break };
            for (i, q) in pair.iter_mut().enumerate() {
                if let Err(e) = dev.set_backend(i, None) {
                    warn!(pair = k, ring = i, error = %e, "detaching the vhost-net backend failed");
                }
                match dev.get_vring_base(i) {
                    Ok(base) => q.queue.set_next_avail(base as u16),
                    Err(e) => warn!(pair = k, ring = i, error = %e, "reading the vhost ring base failed"),
                }
                let used_idx = GuestAddress(q.queue.used_ring()).checked_add(2);
                if let Some(Ok(idx)) = used_idx.map(|a| dev.mem().read_obj::<u16>(a)) {
                    q.queue.set_next_used(u16::from_le(idx));
                }
            }
        }
        self.started = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::{VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
    use virtio_bindings::virtio_net::{VIRTIO_NET_F_CSUM, VIRTIO_NET_F_MAC};

    const fn bit(b: u32) -> u64 {
        1 << b
    }

    /// What a 6.x kernel reports (VHOST_NET_FEATURES).
    const KERNEL: u64 = (1 << 24)
        | VIRTIO_RING_F_INDIRECT_DESC
        | VIRTIO_RING_F_EVENT_IDX
        | VHOST_F_LOG_ALL
        | (1 << 27)
        | VIRTIO_F_VERSION_1
        | bit(VIRTIO_NET_F_MRG_RXBUF)
        | (1 << 33);

    #[test]
    fn offered_features_follow_the_kernel() {
        let user = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | bit(VIRTIO_NET_F_CSUM) | bit(VIRTIO_NET_F_MAC);
        let o = offered_features(user, KERNEL);
        assert_eq!(o, user | bit(VIRTIO_NET_F_MRG_RXBUF), "MRG_RXBUF added, offloads kept");
        // A kernel without EVENT_IDX or MRG_RXBUF: neither is offered.
        let old = KERNEL & !(VIRTIO_RING_F_EVENT_IDX | bit(VIRTIO_NET_F_MRG_RXBUF));
        let o = offered_features(user, old);
        assert_eq!(o & VIRTIO_RING_F_EVENT_IDX, 0);
        assert_eq!(o & bit(VIRTIO_NET_F_MRG_RXBUF), 0);
        assert_ne!(o & bit(VIRTIO_NET_F_CSUM), 0);
        // Never offers vhost-only bits.
        assert_eq!(o & (VHOST_F_LOG_ALL | VHOST_NET_F_VIRTIO_NET_HDR), 0);
    }

    #[test]
    fn kernel_gets_acked_intersect_supported() {
        let acked = VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_EVENT_IDX
            | bit(VIRTIO_NET_F_MRG_RXBUF)
            | bit(VIRTIO_NET_F_CSUM)
            | bit(VIRTIO_NET_F_MAC);
        let f = kernel_features(acked, KERNEL, false);
        assert_eq!(
            f,
            VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | bit(VIRTIO_NET_F_MRG_RXBUF)
        );
        assert_eq!(kernel_features(acked, KERNEL, true), f | VHOST_F_LOG_ALL);
        // Bit 27 (VHOST_NET_F_VIRTIO_NET_HDR) never reaches the kernel.
        assert_eq!(kernel_features(acked | (1 << 27), KERNEL, false), f);
    }

    #[test]
    fn header_is_12_bytes_with_version_1_or_mrg_rxbuf() {
        assert_eq!(vnet_hdr_len(VIRTIO_F_VERSION_1), 12);
        assert_eq!(vnet_hdr_len(bit(VIRTIO_NET_F_MRG_RXBUF)), 12);
        assert_eq!(vnet_hdr_len(VIRTIO_F_VERSION_1 | bit(VIRTIO_NET_F_MRG_RXBUF)), 12);
        assert_eq!(vnet_hdr_len(0), 10);
    }

    fn two_regions() -> GuestMemoryTracked {
        GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 0x10_0000), (GuestAddress(0x1_0000_0000), 0x2_0000)])
            .expect("guest memory")
    }

    #[test]
    fn mem_table_lists_every_region() {
        let mem = two_regions();
        let t = mem_table(&mem).expect("table");
        assert_eq!(t.len(), 2);
        for (e, r) in t.iter().zip(mem.iter()) {
            assert_eq!(e.guest_phys_addr, r.start_addr().raw_value());
            assert_eq!(e.memory_size, r.len());
            let hva = r.get_host_address(MemoryRegionAddress(0)).expect("hva") as u64;
            assert_eq!(e.userspace_addr, hva);
        }
        assert_eq!(t[1].guest_phys_addr, 0x1_0000_0000);
        assert_eq!(t[1].memory_size, 0x2_0000);
    }

    #[test]
    fn mem_table_refuses_too_many_regions() {
        let ranges: Vec<_> = (0..65u64).map(|i| (GuestAddress(i * 0x2000), 0x1000)).collect();
        let mem = GuestMemoryTracked::from_ranges(&ranges).expect("guest memory");
        let Err(e) = mem_table(&mem) else {
            panic!("65 regions accepted")
        };
        assert_eq!(
            e.to_string(),
            "guest memory has 65 regions; vhost-net takes between 1 and 64"
        );
    }

    #[test]
    fn dirty_log_covers_memory_and_drains_into_the_bitmap() {
        let mem = two_regions();
        let log = VhostDirtyLog::for_memory(&mem);
        assert!(log.pages() * VHOST_LOG_PAGE >= 0x1_0002_0000);
        log.set_page(3);
        log.set_page(0x1_0000_0000 / VHOST_LOG_PAGE + 1);
        assert_eq!(log.drain_into(&mem), 2);
        let r0 = mem.find_region(GuestAddress(0)).expect("region 0");
        assert!(r0.bitmap().dirty_at(3 * 4096));
        assert!(!r0.bitmap().dirty_at(2 * 4096));
        let r1 = mem.find_region(GuestAddress(0x1_0000_0000)).expect("region 1");
        assert!(r1.bitmap().dirty_at(4096));
        assert!(!r1.bitmap().dirty_at(0));
        assert_eq!(log.drain(|_| {}), 0, "drain clears");
    }

    #[test]
    fn missing_device_node_is_one_sentence_naming_the_path() {
        // This test is about hosts without vhost-net (CI's PVM host has none).
        if std::path::Path::new(VHOST_NET_PATH).exists()
            && k7d_test_skip::skip(
                "missing_device_node_is_one_sentence_naming_the_path",
                "this host has /dev/vhost-net",
            )
        {
            return;
        }
        let mem = Arc::new(two_regions());
        let e = VhostNetBackend::open(mem, 2, VhostOptions::default()).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("cannot open /dev/vhost-net: "), "{s}");
        assert!(s.contains("No such file or directory"), "{s}");
        assert_eq!(s.matches(". ").count(), 0, "one sentence: {s}");
    }
}

//! The virtio-net device: identity, features, config space, and the start and
//! stop of one worker per queue pair.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};

use k7d_sys::tap::Tap;
use tracing::{error, info};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ, VIRTIO_NET_F_MRG_RXBUF,
    VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP,
};
use virtio_queue::Queue;

use super::event_handler::{CtrlQueue, CtrlWorker, PairWorker, Worker};
use super::vhost::{self, VhostDirtyLog, VhostNetBackend, VhostOptions};
use super::{MAX_QUEUE_PAIRS, NetError, QUEUE_SIZE, persist, tap_queue};
use crate::virtio::worker::{WorkerThread, park_all};
use crate::virtio::{
    ActivateContext, ActiveQueue, ForkBackend, GuestMemoryHandle, RamWriteLog, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC, VirtioDevice, VirtioError,
};

/// Length of the config space: `mac[6]`, `status`, `max_virtqueue_pairs`, `mtu`.
const CONFIG_LEN: usize = 12;
/// MTU reported in config (informational: `VIRTIO_NET_F_MTU` is not offered).
const CONFIG_MTU: u16 = 1500;

const fn bit(b: u32) -> u64 {
    1u64 << b
}

/// What the VMM decides for one NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// The guest's MAC (from config, or derived from the VM id).
    pub mac: [u8; 6],
    /// Queue pairs (the policy's `EffectiveDataPlane::queue_pairs`); the
    /// tap must have this many queue fds.
    pub queue_pairs: u16,
}

/// Counters of one queue pair, written only by that pair's worker.
#[derive(Debug, Default)]
pub struct QueuePairStats {
    /// Frames sent from the guest into the tap.
    pub tx_frames: AtomicU64,
    /// Bytes of those frames (virtio-net header included).
    pub tx_bytes: AtomicU64,
    /// TX chains dropped (malformed, or the tap refused them).
    pub tx_dropped: AtomicU64,
    /// Frames delivered from the tap into guest buffers.
    pub rx_frames: AtomicU64,
    /// Bytes of those frames (virtio-net header included).
    pub rx_bytes: AtomicU64,
    /// Frames dropped on RX (too big for the guest's buffer, or runt).
    pub rx_dropped: AtomicU64,
    /// Malformed chains seen on this pair (RX or TX).
    pub malformed: AtomicU64,
    /// Interrupts raised for this pair's queues.
    pub interrupts: AtomicU64,
    /// The OS thread id of the worker that last served this pair.
    pub worker_tid: AtomicU64,
    /// Times RX stopped with a frame in hand because the guest had posted
    /// no buffer (the worker then waits for the guest's RX kick).
    pub rx_no_buffer: AtomicU64,
    /// Whether a frame read from the tap is waiting for an RX buffer now.
    pub rx_frame_waiting: AtomicBool,
    /// TX frames the tap refused with `EAGAIN` (counted in `tx_dropped` too).
    pub tx_eagain: AtomicU64,
    /// Wakeups for the tap queue becoming readable (edge-triggered).
    pub tap_wakeups: AtomicU64,
}

/// Device counters, shared with the workers.
#[derive(Debug)]
pub struct NetStats {
    /// One entry per queue pair.
    pub pairs: Vec<QueuePairStats>,
    /// Queue pairs the guest uses (1 until `VQ_PAIRS_SET`).
    pub active_pairs: AtomicU16,
    /// Worker threads running now.
    pub workers_running: AtomicUsize,
    /// Control commands answered OK / refused.
    pub ctrl_ok: AtomicU64,
    /// Control commands refused.
    pub ctrl_err: AtomicU64,
}

impl NetStats {
    pub(super) fn new(pairs: u16) -> Self {
        Self {
            pairs: (0..pairs).map(|_| QueuePairStats::default()).collect(),
            active_pairs: AtomicU16::new(0),
            workers_running: AtomicUsize::new(0),
            ctrl_ok: AtomicU64::new(0),
            ctrl_err: AtomicU64::new(0),
        }
    }
}

struct Running {
    /// One slot per queue pair (or the control queue's, with vhost).
    workers: Vec<WorkerThread<Worker>>,
    /// Queues the driver enabled that no worker uses (returned on reset).
    spare: Vec<ActiveQueue>,
    /// Rings handed to the kernel (vhost): RX 0, TX 0, RX 1, ...
    vhost_rings: Vec<ActiveQueue>,
    /// What vhost needs to start again after a pause.
    acked: u64,
    interrupt: crate::virtio::Interrupt,
}

/// A paused device: workers joined with all their state, vhost rings
/// detached from the kernel with their positions read back.
struct Paused {
    /// The slots, their workers parked.
    workers: Vec<WorkerThread<Worker>>,
    spare: Vec<ActiveQueue>,
    vhost_rings: Vec<ActiveQueue>,
    acked: u64,
    interrupt: crate::virtio::Interrupt,
}

/// A virtio-net device on a (multiqueue) tap.
pub struct Net {
    tap: Arc<Tap>,
    pub(super) mac: [u8; 6],
    pub(super) pairs: u16,
    queue_sizes: Vec<u16>,
    pub(super) stats: Arc<NetStats>,
    running: Option<Running>,
    paused: Option<Paused>,
    /// The kernel data plane, when built with [`Net::new_vhost`].
    vhost: Option<VhostNetBackend>,
    /// Queue pairs the guest had enabled, applied at the next activation
    /// (restore; see `persist.rs`).
    pub(super) restore_pairs: Option<u16>,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("tap", &self.tap.name)
            .field("pairs", &self.pairs)
            .field("vhost", &self.vhost.is_some())
            .field("active", &self.running.is_some())
            .finish_non_exhaustive()
    }
}

impl Net {
    /// A device serving `tap` (created with `vnet_hdr = true` and
    /// `config.queue_pairs` queues).
    pub fn new(tap: Tap, config: NetConfig) -> Result<Self, NetError> {
        let pairs = config.queue_pairs;
        if pairs == 0 || pairs > MAX_QUEUE_PAIRS {
            return Err(NetError::QueuePairs(pairs));
        }
        if tap.queues.len() != usize::from(pairs) {
            return Err(NetError::TapQueues {
                tap: tap.queues.len(),
                pairs,
            });
        }
        if !tap.vnet_hdr {
            return Err(NetError::NoVnetHdr(tap.name.clone()));
        }
        // Until the guest negotiates offloads, the tap hands us plain frames.
        tap.set_offload(0).map_err(|source| NetError::Tap {
            tap: tap.name.clone(),
            what: "clearing offloads".into(),
            source,
        })?;
        Ok(Self {
            tap: Arc::new(tap),
            mac: config.mac,
            pairs,
            queue_sizes: vec![QUEUE_SIZE; 2 * usize::from(pairs) + 1],
            stats: Arc::new(NetStats::new(pairs)),
            running: None,
            paused: None,
            vhost: None,
            restore_pairs: None,
        })
    }

    /// A device whose RX/TX rings the kernel serves (vhost-net): opens one
    /// `/dev/vhost-net` per queue pair now, so a missing or unusable vhost
    /// fails here (and the VMM can fall back to [`Net::new`] with a fresh
    /// tap). `mem` is the VM's RAM, the same handle the transport activates
    /// the device with. The control queue is served in userspace.
    pub fn new_vhost(
        tap: Tap,
        config: NetConfig,
        mem: GuestMemoryHandle,
        opts: VhostOptions,
    ) -> Result<Self, NetError> {
        let mut net = Self::new(tap, config)?;
        net.vhost = Some(VhostNetBackend::open(mem, config.queue_pairs, opts)?);
        Ok(net)
    }

    /// [`Net::new_vhost`] over `/dev/vhost-net` devices the caller opened,
    /// one per queue pair (a VM process, which opens no path, is handed
    /// them).
    pub fn new_vhost_with(
        tap: Tap,
        config: NetConfig,
        mem: GuestMemoryHandle,
        opts: VhostOptions,
        devices: Vec<std::fs::File>,
    ) -> Result<Self, NetError> {
        if devices.len() != usize::from(config.queue_pairs) {
            return Err(NetError::Vhost {
                pair: 0,
                op: "open",
                reason: format!(
                    "{} vhost-net devices for {} queue pairs",
                    devices.len(),
                    config.queue_pairs
                ),
            });
        }
        let mut net = Self::new(tap, config)?;
        net.vhost = Some(VhostNetBackend::with_devices(mem, devices, opts)?);
        Ok(net)
    }

    /// Whether the kernel serves the rings (the data plane settled at build).
    pub fn is_vhost(&self) -> bool {
        self.vhost.is_some()
    }

    /// The vhost dirty log (pages the kernel wrote), when built with
    /// `VhostOptions { dirty_log: true }`; the fork path drains it into the
    /// device's bitmap ([`VhostDirtyLog::drain_into`]).
    pub fn vhost_dirty_log(&self) -> Option<Arc<VhostDirtyLog>> {
        self.vhost.as_ref().and_then(VhostNetBackend::dirty_log)
    }

    /// Counters (per queue pair, control queue, running workers).
    pub fn stats(&self) -> Arc<NetStats> {
        self.stats.clone()
    }

    /// The tap's name.
    pub fn tap_name(&self) -> &str {
        &self.tap.name
    }

    /// Whether the workers are running.
    pub fn is_active(&self) -> bool {
        self.running.is_some()
    }

    /// Whether the device is paused (activated, workers parked).
    pub fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    /// Stops the workers after what each is serving (every popped chain is
    /// completed before a worker looks at its stop) and detaches vhost.
    fn park(&mut self) -> Option<Paused> {
        let mut r = self.running.take()?;
        park_all(&mut r.workers);
        let mut rings = r.vhost_rings;
        if let Some(v) = self.vhost.as_mut() {
            v.stop(&mut rings);
        }
        Some(Paused {
            workers: r.workers,
            spare: r.spare,
            vhost_rings: rings,
            acked: r.acked,
            interrupt: r.interrupt,
        })
    }

    fn stop_workers(&mut self) -> Vec<Queue> {
        let parked = self.park();
        let Some(p) = parked.or_else(|| self.paused.take()) else {
            return Vec::new();
        };
        let mut queues: Vec<ActiveQueue> = p.spare;
        for mut slot in p.workers {
            queues.extend(slot.stop().into_iter().flat_map(Worker::into_queues));
        }
        queues.extend(p.vhost_rings);
        queues.sort_by_key(|q| q.index);
        self.stats.active_pairs.store(0, Ordering::Release);
        queues.into_iter().map(|q| q.queue).collect()
    }

    /// A started worker: pair `k`'s (`Some(k)`) or the control queue's.
    fn spawn_worker(k: Option<u16>, worker: Worker) -> Result<WorkerThread<Worker>, VirtioError> {
        let mut slot = WorkerThread::new(match k {
            Some(k) => format!("k7d-vnet-q{k}"),
            None => "k7d-vnet-ctrl".into(),
        });
        slot.spawn(worker)?;
        Ok(slot)
    }

    /// The vhost half of `activate`: rings of pairs `0..pairs` to the
    /// kernel, the control queue (if any) to a userspace worker.
    #[allow(clippy::too_many_arguments)]
    fn activate_vhost(
        &mut self,
        mem: GuestMemoryHandle,
        acked: u64,
        interrupt: crate::virtio::Interrupt,
        mut by_index: BTreeMap<u16, ActiveQueue>,
        ctrl: Option<CtrlQueue>,
        pairs: u16,
    ) -> Result<(), VirtioError> {
        let hdr = vhost::vnet_hdr_len(acked);
        for fd in &self.tap.queues {
            k7d_sys::tap::set_vnet_hdr_size(fd, hdr).map_err(|e| self.bad_tap("TUNSETVNETHDRSZ", e))?;
        }
        let mut rings = Vec::with_capacity(2 * usize::from(pairs));
        for i in 0..2 * pairs {
            match by_index.remove(&i) {
                Some(q) => rings.push(q),
                None => {
                    return Err(VirtioError::QueueCount {
                        device: "net",
                        expected: 2 * usize::from(pairs),
                        got: rings.len(),
                    });
                }
            }
        }
        let Some(backend) = self.vhost.as_mut() else {
            return Err(VirtioError::Unsupported {
                device: "net",
                op: "vhost activation without a vhost backend",
            });
        };
        if let Err(e) = backend.start(acked, &rings, &self.tap.queues, &interrupt) {
            backend.stop(&mut rings);
            error!(tap = %self.tap.name, error = %e, "vhost-net activation failed");
            return Err(VirtioError::Open {
                path: format!("{} for tap {}", vhost::VHOST_NET_PATH, self.tap.name),
                source: std::io::Error::other(e),
            });
        }
        let mut workers = Vec::new();
        if let Some(ctrl) = ctrl {
            let worker = CtrlWorker {
                mem,
                ctrl,
                tap: self.tap.clone(),
                interrupt: interrupt.clone(),
                stats: self.stats.clone(),
                broken: false,
            };
            match Self::spawn_worker(None, Worker::Ctrl(Box::new(worker))) {
                Ok(h) => workers.push(h),
                Err(e) => {
                    if let Some(b) = self.vhost.as_mut() {
                        b.stop(&mut rings);
                    }
                    return Err(e);
                }
            }
        }
        self.running = Some(Running {
            workers,
            spare: by_index.into_values().collect(),
            vhost_rings: rings,
            acked,
            interrupt,
        });
        info!(tap = %self.tap.name, features = acked, pairs, vnet_hdr = hdr, "virtio-net activated (vhost-net)");
        Ok(())
    }

    /// Features of the userspace data plane (vhost adjusts the ring ones).
    fn userspace_features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_EVENT_IDX
            | VIRTIO_RING_F_INDIRECT_DESC
            | bit(VIRTIO_NET_F_CSUM)
            | bit(VIRTIO_NET_F_GUEST_CSUM)
            | bit(VIRTIO_NET_F_GUEST_TSO4)
            | bit(VIRTIO_NET_F_GUEST_TSO6)
            | bit(VIRTIO_NET_F_HOST_TSO4)
            | bit(VIRTIO_NET_F_HOST_TSO6)
            | bit(VIRTIO_NET_F_MAC)
            | bit(VIRTIO_NET_F_MRG_RXBUF)
            | bit(VIRTIO_NET_F_STATUS)
            | bit(VIRTIO_NET_F_CTRL_VQ);
        if self.pairs > 1 {
            f |= bit(VIRTIO_NET_F_MQ);
        }
        f
    }

    fn bad_tap(&self, what: &str, e: std::io::Error) -> VirtioError {
        VirtioError::Open {
            path: format!("tap {} ({what})", self.tap.name),
            source: e,
        }
    }
}

impl VirtioDevice for Net {
    fn name(&self) -> &'static str {
        "net"
    }

    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_NET
    }

    fn pci_class(&self) -> (u8, u8) {
        (0x02, 0x00) // network controller, Ethernet
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        let f = self.userspace_features();
        match &self.vhost {
            Some(v) => vhost::offered_features(f, v.kernel_supported()),
            None => f,
        }
    }

    fn config_len(&self) -> u64 {
        CONFIG_LEN as u64
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut cfg = [0u8; CONFIG_LEN];
        cfg[..6].copy_from_slice(&self.mac);
        cfg[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        cfg[8..10].copy_from_slice(&self.pairs.to_le_bytes());
        cfg[10..12].copy_from_slice(&CONFIG_MTU.to_le_bytes());
        data.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        if start < CONFIG_LEN {
            let n = data.len().min(CONFIG_LEN - start);
            data[..n].copy_from_slice(&cfg[start..start + n]);
        }
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), VirtioError> {
        if self.running.is_some() || self.paused.is_some() {
            return Err(VirtioError::AlreadyActive(self.name()));
        }
        let acked = ctx.acked_features;
        let mq = self.pairs > 1 && acked & bit(VIRTIO_NET_F_MQ) != 0;
        let pairs = if mq { self.pairs } else { 1 };
        let ctrl_index = (acked & bit(VIRTIO_NET_F_CTRL_VQ) != 0).then_some(if mq { 2 * pairs } else { 2 });
        let got = ctx.queues.len();
        let mut by_index: BTreeMap<u16, ActiveQueue> = ctx.queues.into_iter().map(|q| (q.index, q)).collect();
        let needed = 2 * usize::from(pairs) + usize::from(ctrl_index.is_some());
        let has_all = (0..2 * pairs).chain(ctrl_index).all(|i| by_index.contains_key(&i));
        if !has_all {
            return Err(VirtioError::QueueCount {
                device: "net",
                expected: needed,
                got,
            });
        }

        let offloads = tap_queue::offload_flags(acked);
        self.tap
            .set_offload(offloads)
            .map_err(|e| self.bad_tap("TUNSETOFFLOAD", e))?;
        // Until VQ_PAIRS_SET the guest uses pair 0 only (virtio 1.x §5.1.6.5.5):
        // the kernel must not steer frames to queues nobody reads.
        if self.tap.queues.len() > 1 {
            for (k, fd) in self.tap.queues.iter().enumerate() {
                k7d_sys::tap::set_attached(fd, k == 0).map_err(|e| self.bad_tap("TUNSETQUEUE", e))?;
            }
        }
        self.stats.active_pairs.store(1, Ordering::Release);
        if let Some(n) = self.restore_pairs.take()
            && n > 1
            && n <= pairs
            && !super::event_handler::set_pairs(&self.tap, &self.stats, n)
        {
            return Err(self.bad_tap(
                "TUNSETQUEUE",
                std::io::Error::other("restoring the queue-pair count failed"),
            ));
        }

        let mut ctrl = ctrl_index.and_then(|i| by_index.remove(&i)).map(|q| CtrlQueue {
            queue: q,
            max_pairs: pairs,
        });
        if self.vhost.is_some() {
            return self.activate_vhost(ctx.mem, acked, ctx.interrupt, by_index, ctrl, pairs);
        }
        let mut workers = Vec::with_capacity(usize::from(pairs));
        for k in 0..pairs {
            let (Some(rx), Some(tx)) = (by_index.remove(&(2 * k)), by_index.remove(&(2 * k + 1))) else {
                // Checked above; unreachable, but no panic on guest-driven state.
                return Err(VirtioError::QueueCount {
                    device: "net",
                    expected: needed,
                    got,
                });
            };
            let worker = PairWorker::new(
                k,
                ctx.mem.clone(),
                rx,
                tx,
                if k == 0 { ctrl.take() } else { None },
                self.tap.clone(),
                ctx.interrupt.clone(),
                self.stats.clone(),
            )
            .mergeable(acked & bit(VIRTIO_NET_F_MRG_RXBUF) != 0);
            match Self::spawn_worker(Some(k), Worker::Pair(Box::new(worker))) {
                Ok(slot) => workers.push(slot),
                Err(e) => {
                    // Stop the ones already started before failing.
                    park_all(&mut workers);
                    return Err(e);
                }
            }
        }
        self.running = Some(Running {
            workers,
            spare: by_index.into_values().collect(),
            vhost_rings: Vec::new(),
            acked,
            interrupt: ctx.interrupt,
        });
        info!(
            tap = %self.tap.name,
            features = acked,
            pairs,
            offloads,
            "virtio-net activated"
        );
        Ok(())
    }

    fn reset(&mut self) -> Vec<Queue> {
        self.stop_workers()
    }

    /// Parks every worker after the chain it is serving and, with vhost,
    /// detaches the tap from the kernel (which flushes its in-flight work)
    /// and reads the ring positions back. When this returns nothing writes
    /// guest memory for this device; frames arriving meanwhile wait in the
    /// tap. A device that is not active has nothing to pause.
    fn pause(&mut self) -> Result<(), VirtioError> {
        if let Some(p) = self.park() {
            self.paused = Some(p);
        }
        Ok(())
    }

    /// Restarts the workers (and vhost) where they stopped.
    fn resume(&mut self) -> Result<(), VirtioError> {
        let Some(p) = self.paused.take() else {
            return Ok(());
        };
        let mut rings = p.vhost_rings;
        if let Some(v) = self.vhost.as_mut()
            && !rings.is_empty()
            && let Err(e) = v.start(p.acked, &rings, &self.tap.queues, &p.interrupt)
        {
            v.stop(&mut rings);
            error!(tap = %self.tap.name, error = %e, "vhost-net could not restart after a pause");
            self.paused = Some(Paused {
                vhost_rings: rings,
                ..p
            });
            return Err(VirtioError::Open {
                path: format!("{} for tap {}", vhost::VHOST_NET_PATH, self.tap.name),
                source: std::io::Error::other(e),
            });
        }
        let mut workers = p.workers;
        if let Err(e) = workers.iter_mut().try_for_each(WorkerThread::unpark) {
            // Put back what runs: the device stays paused as a whole.
            park_all(&mut workers);
            if let Some(v) = self.vhost.as_mut() {
                v.stop(&mut rings);
            }
            self.paused = Some(Paused {
                workers,
                spare: p.spare,
                vhost_rings: rings,
                acked: p.acked,
                interrupt: p.interrupt,
            });
            return Err(e);
        }
        self.running = Some(Running {
            workers,
            spare: p.spare,
            vhost_rings: rings,
            acked: p.acked,
            interrupt: p.interrupt,
        });
        Ok(())
    }

    fn snapshot(&mut self) -> Result<Vec<u8>, VirtioError> {
        persist::snapshot(self)
    }

    /// One line for the device, one per queue pair (its worker's counters).
    /// The userspace data plane's frames, bytes and drops, summed over the
    /// queue pairs, from the guest's side: `rx_*` delivered to the guest,
    /// `tx_*` sent by it; and the interrupts raised. None with vhost-net
    /// (the kernel moves the frames and counts nothing here).
    fn notifications_reach_vmm(&self) -> bool {
        self.vhost.is_none()
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        if self.vhost.is_some() {
            return Vec::new();
        }
        let sum = |f: fn(&QueuePairStats) -> &AtomicU64| {
            self.stats
                .pairs
                .iter()
                .map(|p| f(p).load(Ordering::Relaxed))
                .fold(0u64, u64::wrapping_add)
        };
        vec![
            ("rx_frames", sum(|p| &p.rx_frames)),
            ("rx_bytes", sum(|p| &p.rx_bytes)),
            ("rx_dropped", sum(|p| &p.rx_dropped)),
            ("tx_frames", sum(|p| &p.tx_frames)),
            ("tx_bytes", sum(|p| &p.tx_bytes)),
            ("tx_dropped", sum(|p| &p.tx_dropped)),
            ("interrupts", sum(|p| &p.interrupts)),
        ]
    }

    fn debug_state(&self) -> Vec<String> {
        let st = &self.stats;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = vec![format!(
            "backend tap={} pairs={} active_pairs={} plane={} running={} paused={} workers_running={} ctrl_ok={} ctrl_err={}",
            self.tap.name,
            self.pairs,
            st.active_pairs.load(Ordering::Relaxed),
            if self.vhost.is_some() {
                "vhost(frames not counted)"
            } else {
                "userspace"
            },
            self.running.is_some(),
            self.paused.is_some(),
            st.workers_running.load(Ordering::Relaxed),
            r(&st.ctrl_ok),
            r(&st.ctrl_err),
        )];
        for (k, p) in st.pairs.iter().enumerate() {
            out.push(format!(
                "pair{k} tid={} rx_frames={} rx_bytes={} rx_dropped={} rx_no_buffer={} rx_frame_waiting={} tap_wakeups={} tx_frames={} tx_bytes={} tx_dropped={} tx_eagain={} malformed={} interrupts={}",
                r(&p.worker_tid),
                r(&p.rx_frames),
                r(&p.rx_bytes),
                r(&p.rx_dropped),
                r(&p.rx_no_buffer),
                p.rx_frame_waiting.load(Ordering::Relaxed),
                r(&p.tap_wakeups),
                r(&p.tx_frames),
                r(&p.tx_bytes),
                r(&p.tx_dropped),
                r(&p.tx_eagain),
                r(&p.malformed),
                r(&p.interrupts),
            ));
        }
        out
    }

    /// vhost writes guest RAM from the kernel, past the memory handle's
    /// bitmap: switch its dirty log on (the device is paused, so the kernel
    /// acks `VHOST_F_LOG_ALL` at resume) and hand it over.
    fn ram_write_logs(&mut self) -> Result<Vec<Arc<dyn RamWriteLog>>, VirtioError> {
        let Some(v) = self.vhost.as_mut() else {
            return Ok(Vec::new());
        };
        let log: Arc<VhostDirtyLog> = v.enable_dirty_log().map_err(|e| VirtioError::Open {
            path: format!("{} for tap {}", vhost::VHOST_NET_PATH, self.tap.name),
            source: std::io::Error::other(e),
        })?;
        Ok(vec![log])
    }

    /// A child gets its own tap (named after it) from its config, with the
    /// source's MAC; nothing of this device's backend is shared.
    fn can_fork(&self) -> Result<(), VirtioError> {
        Ok(())
    }

    fn fork_backend(&mut self) -> Result<ForkBackend, VirtioError> {
        Ok(ForkBackend::from_config())
    }

    fn restore(&mut self, state: &[u8]) -> Result<(), VirtioError> {
        persist::restore(self, state)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.stop_workers();
    }
}

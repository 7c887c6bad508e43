//! virtio-net end to end: a real multiqueue tap (in a throwaway netns) behind
//! the device, the device behind the virtio-pci transport, and a test that
//! plays Linux's virtio_net driver with virtio-queue's mock rings on real
//! guest memory with a dirty bitmap. The far side of the tap is an
//! AF_PACKET socket bound to it: frames the device writes into the tap
//! arrive there, frames sent there come out of the tap into the device.
//!
//! Needs root (netns, tap); skipped with a message otherwise.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k7d_devices::bus::{Bus, SharedDevice};
use k7d_devices::pci::{BarAllocator, NoopMsiRouter, PciConfigMmio, PciRoot};
use k7d_devices::virtio::net::{Net, NetConfig, NetStats};
use k7d_devices::virtio::status::*;
use k7d_devices::virtio::transport::VirtioPciDevice;
use k7d_devices::virtio::transport::layout::{self, common};
use k7d_devices::virtio::{GuestMemoryTracked, VIRTIO_F_VERSION_1};
use k7d_tests::wire::{ETHERTYPE_TEST, Wire};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ,
    VIRTIO_NET_F_STATUS,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{RawDescriptor, split::Descriptor as SplitDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const MEM_SIZE: usize = 32 << 20;
const ECAM_BASE: u64 = 0xe000_0000;
const MMIO32_BASE: u64 = 0xc000_0000;
const PAGE: u64 = 4096;
const QSIZE: u16 = 64;
/// Queue n's rings live at QUEUES_BASE + n * 0x1_0000 (used ring one page in).
const QUEUES_BASE: u64 = 0x10_0000;
/// TX frames are staged here.
const TX_BASE: u64 = 0x80_0000;
/// RX buffer i of RX queue k sits alone on page RX_BASE/PAGE + k*QSIZE + i.
const RX_BASE: u64 = 0x100_0000;
const RX_BUF: u32 = 2048;
const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const PAIRS: u16 = 2;
const NQUEUES: u16 = 2 * PAIRS + 1;
const CONFIG_VECTOR: u16 = 0;
const HDR: usize = 12;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn run(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A named netns, deleted on drop.
struct Netns(String);

impl Netns {
    fn new() -> Self {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!("k7dvnet{}x{}", std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst));
        run(&["ip", "netns", "del", &name]);
        assert!(run(&["ip", "netns", "add", &name]), "ip netns add {name}");
        let ns = Self(name);
        // No IPv6 chatter on the tap.
        for k in ["all", "default"] {
            run(&[
                "ip",
                "netns",
                "exec",
                &ns.0,
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.{k}.disable_ipv6=1"),
            ]);
        }
        ns
    }
    fn path(&self) -> std::path::PathBuf {
        format!("/run/netns/{}", self.0).into()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        run(&["ip", "netns", "del", &self.0]);
    }
}

fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A test-ethertype frame from the guest MAC.
fn test_frame(seed: u64, len: usize) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&ETHERTYPE_TEST.to_be_bytes());
    f.extend_from_slice(&payload(seed, len));
    f
}

fn ip_checksum(h: &[u8]) -> u16 {
    let mut s: u32 = h.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// An IPv4/UDP frame to the guest MAC, from source port `sport` (so frames
/// hash to different tap queues).
fn udp_frame(sport: u16, data: &[u8]) -> Vec<u8> {
    let mut f = MAC.to_vec();
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let total = (20 + 8 + data.len()) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    let c = ip_checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&9000u16.to_be_bytes());
    f.extend_from_slice(&(8 + data.len() as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]); // no UDP checksum (IPv4 allows it)
    f.extend_from_slice(data);
    f
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
}

/// A driver-side queue: mock rings, used ring on its own page.
struct DQueue<'a> {
    mq: MockSplitQueue<'a, GuestMemoryTracked>,
    next_desc: u16,
    posted: u16,
}

impl<'a> DQueue<'a> {
    fn new(mem: &'a GuestMemoryTracked, n: u16) -> Self {
        let base = QUEUES_BASE + u64::from(n) * 0x1_0000;
        Self {
            mq: MockSplitQueue::create(mem, GuestAddress(base), QSIZE),
            next_desc: 0,
            posted: 0,
        }
    }
    fn used_addr(&self) -> GuestAddress {
        GuestAddress(self.mq.desc_table_addr().0 + PAGE)
    }
    /// Posts one chain of (addr, len, write) pieces; returns its head index.
    fn post(&mut self, pieces: &[(u64, u32, bool)]) -> u16 {
        let first = self.next_desc;
        let n = pieces.len() as u16;
        assert!(first + n <= QSIZE && self.posted < QSIZE, "test queue full");
        let descs: Vec<RawDescriptor> = pieces
            .iter()
            .enumerate()
            .map(|(i, (a, l, w))| {
                let mut f = if *w { VRING_DESC_F_WRITE as u16 } else { 0 };
                let mut next = 0;
                if (i as u16) + 1 < n {
                    f |= VRING_DESC_F_NEXT as u16;
                    next = first + i as u16 + 1;
                }
                desc(*a, *l, f, next)
            })
            .collect();
        self.mq.add_desc_chains(&descs, first).unwrap();
        self.next_desc += n;
        self.posted += 1;
        first
    }
    fn used_idx(&self, mem: &GuestMemoryTracked) -> u16 {
        mem.read_obj::<u16>(GuestAddress(self.used_addr().0 + 2)).unwrap()
    }
    fn used_elem(&self, mem: &GuestMemoryTracked, i: u16) -> (u32, u32) {
        let at = self.used_addr().0 + 4 + 8 * u64::from(i);
        (
            mem.read_obj::<u32>(GuestAddress(at)).unwrap(),
            mem.read_obj::<u32>(GuestAddress(at + 4)).unwrap(),
        )
    }
    fn wait_used(&self, mem: &GuestMemoryTracked, idx: u16) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.used_idx(mem) < idx {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

struct Machine {
    mem: Arc<GuestMemoryTracked>,
    mmio: Bus,
    dev: Arc<Mutex<VirtioPciDevice>>,
    bar: u64,
    slot: u8,
}

impl Machine {
    fn new(net: Net) -> Self {
        let mem = Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap());
        let vdev = VirtioPciDevice::new(Box::new(net), mem.clone(), Arc::new(NoopMsiRouter)).unwrap();
        let dev = Arc::new(Mutex::new(vdev));
        let mut root = PciRoot::new(BarAllocator::new(MMIO32_BASE, 0x1000_0000).unwrap(), None);
        let att = root.add_device(dev.clone()).unwrap();
        let root = Arc::new(Mutex::new(root));
        let mut mmio = Bus::new();
        mmio.insert(ECAM_BASE, 1 << 20, Arc::new(Mutex::new(PciConfigMmio::new(root))))
            .unwrap();
        let bar = att.bars[0];
        let shared: SharedDevice = dev.clone();
        mmio.insert(bar.addr, bar.len, shared).unwrap();
        let m = Self {
            mem,
            mmio,
            dev,
            bar: bar.addr,
            slot: att.bdf.device,
        };
        // Memory decode + bus master.
        m.cfg_w(4, 2, 0x6);
        m
    }
    fn ecam(&self, off: u64) -> u64 {
        ECAM_BASE + (u64::from(self.slot) << 15) + off
    }
    fn cfg_r(&self, off: u64, n: usize) -> u64 {
        let mut d = [0u8; 8];
        assert!(self.mmio.read(self.ecam(off), &mut d[..n]));
        u64::from_le_bytes(d)
    }
    fn cfg_w(&self, off: u64, n: usize, v: u64) {
        assert!(self.mmio.write(self.ecam(off), &v.to_le_bytes()[..n]));
    }
    fn r(&self, off: u64, n: usize) -> u64 {
        let mut d = [0u8; 8];
        assert!(self.mmio.read(self.bar + off, &mut d[..n]));
        u64::from_le_bytes(d)
    }
    fn w(&self, off: u64, n: usize, v: u64) {
        assert!(self.mmio.write(self.bar + off, &v.to_le_bytes()[..n]));
    }
    fn status(&self) -> u8 {
        self.r(common::DEVICE_STATUS, 1) as u8
    }
    fn add_status(&self, bits: u8) {
        self.w(common::DEVICE_STATUS, 1, u64::from(self.status() | bits));
    }

    /// MSI-X on, vector v+1 for queue v, vector 0 for config.
    fn enable_msix(&self) {
        // Find the MSI-X capability.
        let mut ptr = self.cfg_r(0x34, 1);
        while ptr != 0 && self.cfg_r(ptr, 1) != 0x11 {
            ptr = self.cfg_r(ptr + 1, 1);
        }
        assert_ne!(ptr, 0, "MSI-X capability");
        self.cfg_w(ptr + 2, 2, 0xc000);
        for v in 0..=NQUEUES {
            let e = layout::MSIX_TABLE_OFFSET + u64::from(v) * 16;
            self.w(e, 4, 0xfee0_0000);
            self.w(e + 4, 4, 0);
            self.w(e + 8, 4, 0x30 + u64::from(v));
            self.w(e + 12, 4, 0);
        }
        self.cfg_w(ptr + 2, 2, 0x8000);
    }

    fn driver_init(&self, features: u64, queues: &[DQueue<'_>]) -> u64 {
        self.w(common::DEVICE_STATUS, 1, 0);
        self.add_status(ACKNOWLEDGE);
        self.add_status(DRIVER);
        let mut offered = 0u64;
        for sel in 0..2 {
            self.w(common::DEVICE_FEATURE_SELECT, 4, sel);
            offered |= self.r(common::DEVICE_FEATURE, 4) << (32 * sel);
        }
        let accept = offered & features;
        for sel in 0..2 {
            self.w(common::DRIVER_FEATURE_SELECT, 4, sel);
            self.w(common::DRIVER_FEATURE, 4, (accept >> (32 * sel)) & 0xffff_ffff);
        }
        self.add_status(FEATURES_OK);
        assert_ne!(self.status() & FEATURES_OK, 0);
        self.w(common::CONFIG_MSIX_VECTOR, 2, u64::from(CONFIG_VECTOR));
        assert_eq!(self.r(common::NUM_QUEUES, 2), u64::from(NQUEUES));
        for (n, q) in queues.iter().enumerate() {
            self.w(common::QUEUE_SELECT, 2, n as u64);
            self.w(common::QUEUE_SIZE, 2, u64::from(QSIZE));
            self.w(common::QUEUE_DESC, 8, q.mq.desc_table_addr().0);
            self.w(common::QUEUE_DRIVER, 8, q.mq.avail_addr().0);
            self.w(common::QUEUE_DEVICE, 8, q.used_addr().0);
            self.w(common::QUEUE_MSIX_VECTOR, 2, n as u64 + 1);
            self.w(common::QUEUE_ENABLE, 2, 1);
        }
        self.add_status(DRIVER_OK);
        assert_eq!(self.status(), ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
        assert!(self.dev.lock().unwrap().is_active());
        accept
    }

    fn kick(&self, queue: u16) {
        self.w(
            layout::NOTIFY_OFFSET + u64::from(queue) * u64::from(layout::NOTIFY_OFF_MULTIPLIER),
            2,
            u64::from(queue),
        );
    }

    fn irqs(&self, v: u16) -> u64 {
        self.dev.lock().unwrap().msix().irqfds()[usize::from(v)]
            .read()
            .unwrap_or(0)
    }

    fn dirty_pages(&self) -> BTreeSet<u64> {
        let region = self.mem.iter().next().unwrap();
        let bm = (**region).bitmap();
        (0..MEM_SIZE as u64 / PAGE)
            .filter(|p| bm.is_addr_set((p * PAGE) as usize))
            .collect()
    }

    fn reset_dirty(&self) {
        for r in self.mem.iter() {
            (**r).bitmap().reset();
        }
    }
}

/// Creates the 2-queue tap and the wire socket inside `ns`.
fn tap_in(ns: &Netns) -> (k7d_net::Tap, Wire) {
    k7d_net::in_netns(Some(&ns.path()), || {
        let mut nl = k7d_net::netlink::Netlink::open()?;
        let name = k7d_net::nic_names("vnet-e2e", 0).tap;
        let tap = k7d_net::create_tap(&mut nl, &name, usize::from(PAIRS), true)?;
        let wire = Wire::open(tap.ifindex).map_err(|e| k7d_net::NetError::Invalid {
            what: "AF_PACKET socket".into(),
            reason: e.to_string(),
        })?;
        Ok((tap, wire))
    })
    .unwrap()
}

fn bit(b: u32) -> u64 {
    1u64 << b
}

#[test]
fn multiqueue_tx_rx_through_a_real_tap() {
    if !is_root()
        && k7d_test_skip::skip(
            "multiqueue_tx_rx_through_a_real_tap",
            "needs root for a netns and a tap",
        )
    {
        return;
    }
    let ns = Netns::new();
    let (tap, wire) = tap_in(&ns);
    let tap_name = tap.name.clone();
    let net = Net::new(
        tap,
        NetConfig {
            mac: MAC,
            queue_pairs: PAIRS,
        },
    )
    .unwrap();
    let stats: Arc<NetStats> = net.stats();
    let m = Machine::new(net);
    let mem = m.mem.clone();
    let mem_refs_idle = Arc::strong_count(&mem);
    m.enable_msix();

    // Config space: MAC, link up, 2 pairs.
    let cfg = layout::DEVICE_CFG_OFFSET;
    let mac: Vec<u8> = (0..6).map(|i| m.r(cfg + i, 1) as u8).collect();
    assert_eq!(mac, MAC);
    assert_eq!(m.r(cfg + 6, 2), 1, "VIRTIO_NET_S_LINK_UP");
    assert_eq!(m.r(cfg + 8, 2), u64::from(PAIRS), "max_virtqueue_pairs");

    let mut qs: Vec<DQueue<'_>> = (0..NQUEUES).map(|n| DQueue::new(&mem, n)).collect();
    let want = VIRTIO_F_VERSION_1
        | bit(VIRTIO_NET_F_MQ)
        | bit(VIRTIO_NET_F_CTRL_VQ)
        | bit(VIRTIO_NET_F_MAC)
        | bit(VIRTIO_NET_F_STATUS)
        | bit(VIRTIO_NET_F_CSUM)
        | bit(VIRTIO_NET_F_GUEST_CSUM);
    let acked = m.driver_init(want, &qs);
    assert_eq!(acked, want, "the device offers everything this driver wants");
    assert!(wait_workers(&stats, usize::from(PAIRS)), "one worker per pair");
    assert_eq!(
        stats.active_pairs.load(Ordering::Acquire),
        1,
        "pair 0 only until VQ_PAIRS_SET"
    );

    // ---- control queue: VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET 2 (queue 2N = 4).
    let ctrl_q = 2 * PAIRS;
    mem.write_slice(&[4u8, 0, 2, 0], GuestAddress(TX_BASE)).unwrap();
    mem.write_obj(0xeeu8, GuestAddress(TX_BASE + 0x100)).unwrap();
    qs[usize::from(ctrl_q)].post(&[(TX_BASE, 2, false), (TX_BASE + 2, 2, false), (TX_BASE + 0x100, 1, true)]);
    // And an unsupported command (CTRL_RX promisc): refused with ERR.
    mem.write_slice(&[0u8, 0, 1], GuestAddress(TX_BASE + 0x200)).unwrap();
    qs[usize::from(ctrl_q)].post(&[(TX_BASE + 0x200, 3, false), (TX_BASE + 0x300, 1, true)]);
    m.kick(ctrl_q);
    assert!(qs[usize::from(ctrl_q)].wait_used(&mem, 2));
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(TX_BASE + 0x100)).unwrap(),
        0,
        "VIRTIO_NET_OK"
    );
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(TX_BASE + 0x300)).unwrap(),
        1,
        "VIRTIO_NET_ERR"
    );
    assert_eq!(stats.active_pairs.load(Ordering::Acquire), 2);

    // ---- TX: one frame on each TX queue (header and frame in separate
    // descriptors), plus malformed chains on TX queue 0 first.
    let end = MEM_SIZE as u64;
    let tx0 = 1usize;
    qs[tx0].post(&[(TX_BASE + 0x1000, 64, true)]); // device-writable in TX
    qs[tx0].post(&[(end + 0x1000, 64, false)]); // outside guest memory
    qs[tx0].post(&[(TX_BASE + 0x1000, 4, false)]); // shorter than the header
    let mut sent = BTreeMap::new();
    for k in 0..PAIRS {
        let frame = test_frame(u64::from(k) + 1, 300 + 100 * usize::from(k));
        let hdr_at = TX_BASE + 0x2000 + u64::from(k) * 0x1_0000;
        mem.write_slice(&[0u8; HDR], GuestAddress(hdr_at)).unwrap();
        mem.write_slice(&frame, GuestAddress(hdr_at + 0x100)).unwrap();
        let q = usize::from(2 * k + 1);
        qs[q].post(&[(hdr_at, HDR as u32, false), (hdr_at + 0x100, frame.len() as u32, false)]);
        sent.insert(fnv(&frame[14..]), k);
    }
    m.kick(1);
    m.kick(3);
    assert!(qs[1].wait_used(&mem, 4), "TX 0 returned all chains");
    assert!(qs[3].wait_used(&mem, 1), "TX 1 returned its chain");
    let got = wire.recv_test_frames(2, Duration::from_secs(5));
    assert_eq!(got.len(), 2, "both TX frames came out of the tap");
    let mut seen = BTreeSet::new();
    for f in &got {
        let k = sent.get(&fnv(&f[14..])).expect("payload checksum matches a sent frame");
        seen.insert(*k);
    }
    assert_eq!(seen, (0..PAIRS).collect());
    for k in 0..usize::from(PAIRS) {
        assert_eq!(
            stats.pairs[k].tx_frames.load(Ordering::Relaxed),
            1,
            "pair {k} sent its own frame"
        );
    }
    assert_eq!(stats.pairs[0].malformed.load(Ordering::Relaxed), 3);
    assert_eq!(stats.pairs[1].malformed.load(Ordering::Relaxed), 0);
    assert!(m.irqs(2) >= 1 && m.irqs(4) >= 1, "TX queues interrupted");
    // Each worker is its own thread.
    let t0 = stats.pairs[0].worker_tid.load(Ordering::Acquire);
    let t1 = stats.pairs[1].worker_tid.load(Ordering::Acquire);
    assert!(
        t0 != 0 && t1 != 0 && t0 != t1,
        "one worker thread per pair ({t0}, {t1})"
    );

    // ---- RX: two malformed chains at the head of RX queue 0, then
    // single-buffer chains on both RX queues, each buffer on its own page.
    let rxpage = |k: u16, i: u16| RX_BASE + (u64::from(k) * u64::from(QSIZE) + u64::from(i)) * PAGE;
    let rx0 = &mut qs[0];
    rx0.post(&[(rxpage(0, 60), RX_BUF, false)]); // device-readable in RX
    rx0.post(&[(end + 0x4000, RX_BUF, true)]); // outside guest memory
    let mut bufs: BTreeMap<(u16, u16), u64> = BTreeMap::new(); // (queue, head) -> addr
    for k in 0..PAIRS {
        for i in 0..40u16 {
            let q = &mut qs[usize::from(2 * k)];
            let head = q.post(&[(rxpage(k, i), RX_BUF, true)]);
            bufs.insert((2 * k, head), rxpage(k, i));
        }
    }
    m.kick(0);
    m.kick(2);
    std::thread::sleep(Duration::from_millis(50));
    m.reset_dirty();

    let nframes = 32u16;
    let mut expect = BTreeMap::new();
    for i in 0..nframes {
        let data = payload(1000 + u64::from(i), 200 + usize::from(i) * 37);
        let f = udp_frame(10_000 + i, &data);
        expect.insert(10_000 + i, fnv(&f));
        wire.send(&f);
    }
    // Wait until every frame was delivered to one of the queues.
    let deadline = Instant::now() + Duration::from_secs(5);
    let delivered = |qs: &[DQueue<'_>]| {
        stats
            .pairs
            .iter()
            .map(|p| p.rx_frames.load(Ordering::Acquire))
            .sum::<u64>()
            >= u64::from(nframes)
            && qs[0].used_idx(&mem) >= 2
    };
    while !delivered(&qs) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        delivered(&qs),
        "all {nframes} frames delivered: {:?}",
        rx_counts(&stats)
    );

    let mut got = BTreeMap::new();
    let mut data_pages = BTreeSet::new();
    let mut per_queue = [0u64; PAIRS as usize];
    for k in 0..PAIRS {
        let q = &qs[usize::from(2 * k)];
        for u in 0..q.used_idx(&mem) {
            let (head, len) = q.used_elem(&mem, u);
            let Some(addr) = bufs.get(&(2 * k, head as u16)) else {
                assert_eq!(len, 0, "a malformed RX chain is returned empty");
                continue;
            };
            assert!(len as usize > HDR);
            let mut b = vec![0u8; len as usize];
            mem.read_slice(&mut b, GuestAddress(*addr)).unwrap();
            assert_eq!(u16::from_le_bytes([b[10], b[11]]), 1, "num_buffers = 1");
            let f = &b[HDR..];
            if f.len() < 42 || u16::from_be_bytes([f[12], f[13]]) != 0x0800 {
                continue; // not ours
            }
            let sport = u16::from_be_bytes([f[34], f[35]]);
            got.insert(sport, fnv(f));
            data_pages.insert(addr / PAGE);
            per_queue[usize::from(k)] += 1;
        }
    }
    assert_eq!(got, expect, "every frame arrived intact (payload checksums match)");
    for k in 0..usize::from(PAIRS) {
        assert_eq!(
            stats.pairs[k].rx_frames.load(Ordering::Relaxed),
            per_queue[k],
            "pair {k}'s worker filled exactly its own RX queue"
        );
        assert!(
            per_queue[k] > 0,
            "frames were steered to both tap queues: {per_queue:?}"
        );
    }
    assert_eq!(
        stats.pairs[0].malformed.load(Ordering::Relaxed),
        5,
        "2 malformed RX chains"
    );
    assert!(m.irqs(1) >= 1 && m.irqs(3) >= 1, "RX queues interrupted");
    // The daemon's metrics read the same counters through the transport
    // (`VirtioDevice::counters`: summed over pairs, the guest's side).
    let sum = |f: fn(&k7d_devices::virtio::net::QueuePairStats) -> &std::sync::atomic::AtomicU64| {
        stats.pairs.iter().map(|p| f(p).load(Ordering::Relaxed)).sum::<u64>()
    };
    let counters: BTreeMap<&str, u64> = m.dev.lock().unwrap().counters().into_iter().collect();
    assert_eq!(counters["rx_frames"], per_queue.iter().sum::<u64>());
    assert_eq!(counters["tx_frames"], u64::from(PAIRS), "one TX frame per pair");
    assert_eq!(counters["rx_bytes"], sum(|p| &p.rx_bytes));
    assert!(counters["rx_bytes"] > 0 && counters["tx_bytes"] > 0, "{counters:?}");
    assert_eq!(counters["tx_bytes"], sum(|p| &p.tx_bytes));
    assert_eq!(counters["interrupts"], sum(|p| &p.interrupts));

    // Dirty bitmap: exactly the RX data pages written and the two RX used-ring pages.
    let mut want_dirty = data_pages.clone();
    for k in 0..PAIRS {
        want_dirty.insert(qs[usize::from(2 * k)].used_addr().0 / PAGE);
    }
    assert_eq!(
        m.dirty_pages(),
        want_dirty,
        "bitmap = RX data pages + RX used-ring pages"
    );

    // ---- still serving after the malformed chains: another TX on queue 0.
    let frame = test_frame(77, 500);
    mem.write_slice(&[0u8; HDR], GuestAddress(TX_BASE + 0x3000)).unwrap();
    mem.write_slice(&frame, GuestAddress(TX_BASE + 0x3100)).unwrap();
    qs[1].post(&[
        (TX_BASE + 0x3000, HDR as u32, false),
        (TX_BASE + 0x3100, frame.len() as u32, false),
    ]);
    m.kick(1);
    let got = wire.recv_test_frames(1, Duration::from_secs(5));
    assert_eq!(got.len(), 1);
    assert_eq!(fnv(&got[0][14..]), fnv(&frame[14..]));

    // ---- pause: every worker parks; frames that arrive meanwhile wait in the
    // tap and nothing is written into guest memory; resume delivers them.
    let rx_before: u64 = rx_counts(&stats).iter().sum();
    m.dev.lock().unwrap().pause().unwrap();
    assert_eq!(
        stats.workers_running.load(Ordering::Acquire),
        0,
        "pause joined every worker"
    );
    m.reset_dirty();
    let paused_frames = 8u16;
    for i in 0..paused_frames {
        wire.send(&udp_frame(20_000 + i, &payload(2000 + u64::from(i), 300)));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        rx_counts(&stats).iter().sum::<u64>(),
        rx_before,
        "no frame delivered while paused"
    );
    assert!(
        m.dirty_pages().is_empty(),
        "nothing written into guest memory while paused: {:?}",
        m.dirty_pages()
    );
    m.dev.lock().unwrap().resume().unwrap();
    assert!(
        wait_workers(&stats, usize::from(PAIRS)),
        "resume restarted every worker"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while rx_counts(&stats).iter().sum::<u64>() < rx_before + u64::from(paused_frames) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        rx_counts(&stats).iter().sum::<u64>(),
        rx_before + u64::from(paused_frames),
        "the frames that waited in the tap arrive after resume"
    );

    // ---- reset: workers stop and are joined before the status write returns.
    m.w(common::DEVICE_STATUS, 1, 0);
    assert_eq!(m.status(), 0);
    assert!(!m.dev.lock().unwrap().is_active());
    assert_eq!(stats.workers_running.load(Ordering::Acquire), 0, "all workers joined");
    assert_eq!(
        Arc::strong_count(&mem),
        mem_refs_idle,
        "workers dropped their memory handles"
    );

    // Re-activation works (the tap is reused).
    drop(qs);
    let qs: Vec<DQueue<'_>> = (0..NQUEUES).map(|n| DQueue::new(&mem, n + 8)).collect();
    m.driver_init(want, &qs);
    assert!(wait_workers(&stats, usize::from(PAIRS)), "workers restarted");
    drop(qs);
    drop(m);
    assert_eq!(
        stats.workers_running.load(Ordering::Acquire),
        0,
        "dropping the device stops its workers"
    );
    // The tap closes with the device.
    drop(wire);
    drop(ns);
    assert!(
        !run(&["ip", "link", "show", &tap_name]),
        "no tap left in the host netns"
    );
}

fn wait_workers(stats: &NetStats, n: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while stats.workers_running.load(Ordering::Acquire) != n {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

fn rx_counts(stats: &NetStats) -> Vec<u64> {
    stats
        .pairs
        .iter()
        .map(|p| p.rx_frames.load(Ordering::Acquire))
        .collect()
}

#[test]
fn device_refuses_a_tap_that_does_not_match() {
    if !is_root()
        && k7d_test_skip::skip(
            "device_refuses_a_tap_that_does_not_match",
            "needs root for a netns and a tap",
        )
    {
        return;
    }
    let ns = Netns::new();
    let (tap, _wire) = tap_in(&ns);
    let e = Net::new(
        tap,
        NetConfig {
            mac: MAC,
            queue_pairs: 3,
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "the tap has 2 queue fd(s) but the device has 3 queue pair(s)"
    );
    let (tap, _wire) = tap_in(&ns);
    let e = Net::new(
        tap,
        NetConfig {
            mac: MAC,
            queue_pairs: 0,
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "0 queue pairs requested, a virtio-net device has between 1 and 64"
    );
}

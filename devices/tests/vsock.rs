//! virtio-vsock end to end: the device behind the virtio-pci transport, a
//! simulated guest vsock driver working split rings on real guest memory
//! (anonymous mmap with a dirty bitmap), and host processes on the hybrid
//! unix socket.
//!
//! The driver side writes its rings by hand rather than with virtio-queue's
//! `MockSplitQueue` (whose `add_desc_chains` neither wraps the available ring
//! nor keeps the used ring off it); each ring is on its own page.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k7d_devices::bus::{Bus, SharedDevice};
use k7d_devices::pci::{BarAllocator, NoopMsiRouter, PciConfigMmio, PciRoot};
use k7d_devices::virtio::status::*;
use k7d_devices::virtio::transport::VirtioPciDevice;
use k7d_devices::virtio::transport::layout::{self, common};
use k7d_devices::virtio::vsock::{Vsock, op};
use k7d_devices::virtio::{GuestMemoryTracked, VIRTIO_F_VERSION_1};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const MEM_SIZE: usize = 32 << 20;
const ECAM_BASE: u64 = 0xe000_0000;
const MMIO32_BASE: u64 = 0xc000_0000;
const PAGE: u64 = 4096;
const QSIZE: u16 = 128;
const CID: u64 = 52;
const HDR: usize = 44;
const RX_BUFS: usize = 32;
const RX_HDR_BASE: u64 = 0x10_0000;
const RX_DATA_BASE: u64 = 0x20_0000;
const RX_DATA_LEN: u32 = 4096;
const TX_SLOTS: usize = 64;
const TX_HDR_BASE: u64 = 0x40_0000;
const TX_DATA_BASE: u64 = 0x50_0000;
const GUEST_BUF_ALLOC: u32 = 16 * 1024;
const TIMEOUT: Duration = Duration::from_secs(5);

fn uds(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("k7d-vsock-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// A vsock packet as the guest sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Pkt {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    type_: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

impl Pkt {
    fn to_bytes(&self) -> [u8; HDR] {
        let mut r = [0u8; HDR];
        r[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        r[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        r[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        r[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        r[24..28].copy_from_slice(&self.len.to_le_bytes());
        r[28..30].copy_from_slice(&self.type_.to_le_bytes());
        r[30..32].copy_from_slice(&self.op.to_le_bytes());
        r[32..36].copy_from_slice(&self.flags.to_le_bytes());
        r[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        r[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        r
    }
    fn from_bytes(r: &[u8; HDR]) -> Self {
        let u32_at = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().unwrap());
        Self {
            src_cid: u64::from_le_bytes(r[0..8].try_into().unwrap()),
            dst_cid: u64::from_le_bytes(r[8..16].try_into().unwrap()),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16::from_le_bytes([r[28], r[29]]),
            op: u16::from_le_bytes([r[30], r[31]]),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
    /// A stream packet from the guest, `src` → host port `dst`.
    fn guest(op: u16, src: u32, dst: u32) -> Self {
        Self {
            src_cid: CID,
            dst_cid: 2,
            src_port: src,
            dst_port: dst,
            type_: 1,
            op,
            buf_alloc: GUEST_BUF_ALLOC,
            ..Self::default()
        }
    }
}

/// Driver side of one split virtqueue: descriptor table, available ring and
/// used ring each on their own page.
#[derive(Clone)]
struct Vq {
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
    last_used: u16,
}

impl Vq {
    fn new(base: u64) -> Self {
        Self {
            desc: base,
            avail: base + PAGE,
            used: base + 2 * PAGE,
            next_desc: 0,
            avail_idx: 0,
            last_used: 0,
        }
    }

    /// Posts a chain of (addr, len, device-writable) buffers; returns the head.
    fn add(&mut self, mem: &GuestMemoryTracked, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, (addr, len, write)) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            self.next_desc = (self.next_desc + 1) % QSIZE;
            let mut flags = if *write { 2u16 } else { 0 };
            if i + 1 < bufs.len() {
                flags |= 1;
            }
            let d = self.desc + 16 * u64::from(idx);
            mem.write_obj(*addr, GuestAddress(d)).unwrap();
            mem.write_obj(*len, GuestAddress(d + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
            mem.write_obj(self.next_desc, GuestAddress(d + 14)).unwrap();
        }
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2)).unwrap();
        head
    }

    fn used_idx(&self, mem: &GuestMemoryTracked) -> u16 {
        mem.read_obj::<u16>(GuestAddress(self.used + 2)).unwrap()
    }

    /// The next used element (id, len), if the device returned one.
    fn pop_used(&mut self, mem: &GuestMemoryTracked) -> Option<(u16, u32)> {
        if self.used_idx(mem) == self.last_used {
            return None;
        }
        fence(Ordering::SeqCst);
        let e = self.used + 4 + 8 * u64::from(self.last_used % QSIZE);
        self.last_used = self.last_used.wrapping_add(1);
        let id = mem.read_obj::<u32>(GuestAddress(e)).unwrap();
        let len = mem.read_obj::<u32>(GuestAddress(e + 4)).unwrap();
        Some((id as u16, len))
    }
}

struct Machine {
    mem: Arc<GuestMemoryTracked>,
    mmio: Bus,
    dev: Arc<Mutex<VirtioPciDevice>>,
    slot: u8,
    bar: u64,
}

impl Machine {
    fn new(path: &PathBuf) -> Self {
        let mem = Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap());
        Self::on(mem, path)
    }

    /// A vsock function on `mem` (a fork child's RAM holds the source's).
    fn on(mem: Arc<GuestMemoryTracked>, path: &PathBuf) -> Self {
        let vsock = Vsock::new(CID, path).unwrap();
        let vdev = VirtioPciDevice::new(Box::new(vsock), mem.clone(), Arc::new(NoopMsiRouter)).unwrap();
        let dev = Arc::new(Mutex::new(vdev));
        let mut root = PciRoot::new(BarAllocator::new(MMIO32_BASE, 0x1000_0000).unwrap(), None);
        let att = root.add_device(dev.clone()).unwrap();
        let mut mmio = Bus::new();
        mmio.insert(
            ECAM_BASE,
            1 << 20,
            Arc::new(Mutex::new(PciConfigMmio::new(Arc::new(Mutex::new(root))))),
        )
        .unwrap();
        let bar = att.bars[0];
        let shared: SharedDevice = dev.clone();
        mmio.insert(bar.addr, bar.len, shared).unwrap();
        let m = Self {
            mem,
            mmio,
            dev,
            slot: att.bdf.device,
            bar: bar.addr,
        };
        assert_eq!(m.cfg_r32(0), 0x1053_1af4, "virtio 1.x vsock (0x1040 + 19)");
        m.cfg_w16(4, 0x6);
        m
    }

    fn ecam(&self, off: u64) -> u64 {
        ECAM_BASE + (u64::from(self.slot) << 15) + off
    }
    fn cfg_r32(&self, off: u64) -> u32 {
        let mut d = [0u8; 4];
        assert!(self.mmio.read(self.ecam(off), &mut d));
        u32::from_le_bytes(d)
    }
    fn cfg_w16(&self, off: u64, v: u16) {
        assert!(self.mmio.write(self.ecam(off), &v.to_le_bytes()));
    }
    fn r(&self, off: u64, n: usize) -> u64 {
        let mut d = [0u8; 8];
        assert!(self.mmio.read(self.bar + off, &mut d[..n]));
        u64::from_le_bytes(d)
    }
    fn w(&self, off: u64, n: usize, v: u64) {
        assert!(self.mmio.write(self.bar + off, &v.to_le_bytes()[..n]));
    }
    fn common_r(&self, reg: u64, n: usize) -> u64 {
        self.r(layout::COMMON_CFG_OFFSET + reg, n)
    }
    fn common_w(&self, reg: u64, n: usize, v: u64) {
        self.w(layout::COMMON_CFG_OFFSET + reg, n, v)
    }
    fn status(&self) -> u8 {
        self.common_r(common::DEVICE_STATUS, 1) as u8
    }
    fn add_status(&self, bits: u8) {
        self.common_w(common::DEVICE_STATUS, 1, u64::from(self.status() | bits));
    }
    fn kick(&self, q: u16) {
        self.w(
            layout::NOTIFY_OFFSET + u64::from(q) * u64::from(layout::NOTIFY_OFF_MULTIPLIER),
            2,
            u64::from(q),
        );
    }

    /// virtio_vsock_probe through virtio-pci: features, three queues, DRIVER_OK.
    fn driver_init(&self, vqs: &[&Vq; 3]) {
        self.common_w(common::DEVICE_STATUS, 1, 0);
        self.add_status(ACKNOWLEDGE | DRIVER);
        let mut offered = 0u64;
        for sel in 0..2 {
            self.common_w(common::DEVICE_FEATURE_SELECT, 4, sel);
            offered |= self.common_r(common::DEVICE_FEATURE, 4) << (32 * sel);
        }
        assert_eq!(offered, VIRTIO_F_VERSION_1);
        self.common_w(common::DRIVER_FEATURE_SELECT, 4, 1);
        self.common_w(common::DRIVER_FEATURE, 4, 1);
        self.add_status(FEATURES_OK);
        assert_ne!(self.status() & FEATURES_OK, 0);
        // Device config: the guest CID, le64.
        let cfg = layout::DEVICE_CFG_OFFSET;
        assert_eq!(self.r(cfg, 4) | self.r(cfg + 4, 4) << 32, CID);
        assert_eq!(self.common_r(common::NUM_QUEUES, 2), 3);
        for (i, vq) in vqs.iter().enumerate() {
            self.common_w(common::QUEUE_SELECT, 2, i as u64);
            self.common_w(common::QUEUE_SIZE, 2, u64::from(QSIZE));
            self.common_w(common::QUEUE_DESC, 8, vq.desc);
            self.common_w(common::QUEUE_DRIVER, 8, vq.avail);
            self.common_w(common::QUEUE_DEVICE, 8, vq.used);
            self.common_w(common::QUEUE_ENABLE, 2, 1);
        }
        self.add_status(DRIVER_OK);
        assert_eq!(self.status(), ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
        assert!(self.dev.lock().unwrap().is_active());
    }

    fn dirty_pages(&self) -> Vec<u64> {
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

/// The simulated guest driver: RX buffers kept posted, TX packets sent from
/// a ring of slots.
struct Guest {
    m: Machine,
    rx: Vq,
    tx: Vq,
    ev: Vq,
    /// RX head descriptor → buffer index.
    rx_heads: HashMap<u16, usize>,
    tx_slot: usize,
    tx_outstanding: usize,
    /// RX used entries of length 0 (buffers the device rejected).
    rx_empty: usize,
}

impl Guest {
    fn new(path: &PathBuf) -> Self {
        let m = Machine::new(path);
        let mut g = Self {
            m,
            rx: Vq::new(0x1_0000),
            tx: Vq::new(0x2_0000),
            ev: Vq::new(0x3_0000),
            rx_heads: HashMap::new(),
            tx_slot: 0,
            tx_outstanding: 0,
            rx_empty: 0,
        };
        g.m.driver_init(&[&g.rx, &g.tx, &g.ev]);
        for i in 0..RX_BUFS {
            g.post_rx(i);
        }
        g.m.kick(0);
        g
    }

    fn rx_hdr(i: usize) -> u64 {
        RX_HDR_BASE + 64 * i as u64
    }
    fn rx_data(i: usize) -> u64 {
        RX_DATA_BASE + u64::from(RX_DATA_LEN) * i as u64
    }

    fn post_rx(&mut self, i: usize) {
        let mem = self.m.mem.clone();
        let head = self.rx.add(
            &mem,
            &[
                (Self::rx_hdr(i), HDR as u32, true),
                (Self::rx_data(i), RX_DATA_LEN, true),
            ],
        );
        self.rx_heads.insert(head, i);
    }

    /// Sends one packet (payload `data`, `len` set from it).
    fn send(&mut self, mut p: Pkt, data: &[u8]) {
        assert!(data.len() <= 4096);
        while self.tx_outstanding >= TX_SLOTS / 2 {
            self.reap_tx();
        }
        p.len = data.len() as u32;
        self.send_raw(&p.to_bytes(), data, None);
    }

    /// Sends a header and payload as the two descriptors of one chain; `lens`
    /// overrides the descriptor lengths (for malformed chains).
    fn send_raw(&mut self, hdr: &[u8], data: &[u8], lens: Option<(u32, u32)>) {
        let mem = self.m.mem.clone();
        let s = self.tx_slot;
        self.tx_slot = (self.tx_slot + 1) % TX_SLOTS;
        let (h, d) = (TX_HDR_BASE + 64 * s as u64, TX_DATA_BASE + 4096 * s as u64);
        mem.write_slice(hdr, GuestAddress(h)).unwrap();
        mem.write_slice(data, GuestAddress(d)).unwrap();
        let (hl, dl) = lens.unwrap_or((hdr.len() as u32, data.len() as u32));
        if dl == 0 {
            self.tx.add(&mem, &[(h, hl, false)]);
        } else {
            self.tx.add(&mem, &[(h, hl, false), (d, dl, false)]);
        }
        self.tx_outstanding += 1;
        self.m.kick(1);
    }

    fn reap_tx(&mut self) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let mem = self.m.mem.clone();
            let mut got = false;
            while let Some((_, len)) = self.tx.pop_used(&mem) {
                assert_eq!(len, 0, "the device writes nothing into TX buffers");
                self.tx_outstanding -= 1;
                got = true;
            }
            if got || self.tx_outstanding == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "TX chains never came back");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits for every TX chain to be returned.
    fn drain_tx(&mut self) {
        while self.tx_outstanding > 0 {
            self.reap_tx();
        }
    }

    /// The next packet from the device, with its payload.
    fn try_recv(&mut self, timeout: Duration) -> Option<(Pkt, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        loop {
            let mem = self.m.mem.clone();
            if let Some((head, len)) = self.rx.pop_used(&mem) {
                let i = self.rx_heads.remove(&head).expect("used id is a posted RX head");
                if len == 0 {
                    self.rx_empty += 1;
                    self.post_rx(i);
                    self.m.kick(0);
                    continue;
                }
                let mut raw = [0u8; HDR];
                mem.read_slice(&mut raw, GuestAddress(Self::rx_hdr(i))).unwrap();
                let p = Pkt::from_bytes(&raw);
                assert_eq!(
                    len as usize,
                    HDR + p.len as usize,
                    "used length covers header and payload"
                );
                let mut data = vec![0u8; p.len as usize];
                mem.read_slice(&mut data, GuestAddress(Self::rx_data(i))).unwrap();
                self.post_rx(i);
                self.m.kick(0);
                assert_eq!((p.src_cid, p.dst_cid, p.type_), (2, CID, 1), "{p:?}");
                return Some((p, data));
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn recv(&mut self) -> (Pkt, Vec<u8>) {
        self.try_recv(TIMEOUT).expect("a packet from the device")
    }
}

/// A guest-side stream connection with its credit bookkeeping.
struct GuestConn {
    port: u32,
    peer: u32,
    fwd_cnt: u32,
    fwd_cnt_sent: u32,
    rx_total: u32,
    credit_updates_sent: u32,
    credit_requests_seen: u32,
}

impl GuestConn {
    fn pkt(&self, op: u16) -> Pkt {
        let mut p = Pkt::guest(op, self.port, self.peer);
        p.fwd_cnt = self.fwd_cnt;
        p
    }

    /// Receives `n` bytes, consuming them as they arrive and granting credit
    /// every 8 KiB (and when asked); checks the device never exceeds it.
    fn recv_bytes(&mut self, g: &mut Guest, n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        while out.len() < n {
            let (p, data) = g.recv();
            assert_eq!((p.src_port, p.dst_port), (self.peer, self.port), "{p:?}");
            match p.op {
                op::RW => {
                    self.rx_total = self.rx_total.wrapping_add(p.len);
                    assert!(
                        self.rx_total.wrapping_sub(self.fwd_cnt_sent) <= GUEST_BUF_ALLOC,
                        "the device sent past the guest's credit"
                    );
                    out.extend_from_slice(&data);
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(p.len);
                    if self.fwd_cnt.wrapping_sub(self.fwd_cnt_sent) >= 8192 {
                        self.grant(g);
                    }
                }
                op::CREDIT_REQUEST => {
                    self.credit_requests_seen += 1;
                    self.grant(g);
                }
                op::CREDIT_UPDATE => {}
                other => panic!("unexpected op {other} while receiving: {p:?}"),
            }
        }
        out
    }

    /// The next packet that is not credit traffic (answering CREDIT_REQUESTs).
    fn recv_ctl(&mut self, g: &mut Guest) -> Pkt {
        loop {
            let (p, _) = g.recv();
            match p.op {
                op::CREDIT_REQUEST => {
                    self.credit_requests_seen += 1;
                    self.grant(g);
                }
                op::CREDIT_UPDATE => {}
                _ => return p,
            }
        }
    }

    fn grant(&mut self, g: &mut Guest) {
        g.send(self.pkt(op::CREDIT_UPDATE), &[]);
        self.fwd_cnt_sent = self.fwd_cnt;
        self.credit_updates_sent += 1;
    }

    /// Sends `data` in 4 KiB RW packets, within the device's credit.
    fn send_bytes(&mut self, g: &mut Guest, data: &[u8], dev_buf_alloc: u32) {
        let mut dev_fwd = 0u32;
        let mut sent = 0u32;
        for chunk in data.chunks(4096) {
            while dev_buf_alloc - sent.wrapping_sub(dev_fwd) < chunk.len() as u32 {
                let (p, _) = g.recv();
                match p.op {
                    op::CREDIT_UPDATE => dev_fwd = p.fwd_cnt,
                    op::CREDIT_REQUEST => self.grant(g),
                    _ => panic!("unexpected packet while sending: {p:?}"),
                }
            }
            g.send(self.pkt(op::RW), chunk);
            sent += chunk.len() as u32;
        }
        g.drain_tx();
    }
}

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn checksum(d: &[u8]) -> u64 {
    d.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}

/// Host connects with `CONNECT <port>`; the guest accepts. Returns the host
/// stream and the guest's view of the connection.
fn host_connect(g: &mut Guest, path: &PathBuf, port: u32) -> (UnixStream, GuestConn) {
    let mut host = UnixStream::connect(path).unwrap();
    host.set_read_timeout(Some(TIMEOUT)).unwrap();
    host.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let (req, _) = g.recv();
    assert_eq!(req.op, op::REQUEST, "{req:?}");
    assert_eq!(req.dst_port, port);
    assert!(req.src_port >= 1 << 30, "device-chosen local port");
    assert!(req.buf_alloc > 0);
    let conn = GuestConn {
        port,
        peer: req.src_port,
        fwd_cnt: 0,
        fwd_cnt_sent: 0,
        rx_total: 0,
        credit_updates_sent: 0,
        credit_requests_seen: 0,
    };
    g.send(conn.pkt(op::RESPONSE), &[]);
    assert_eq!(read_line(&mut host), format!("OK {}", req.src_port));
    (host, conn)
}

#[test]
fn host_initiated_connection_moves_64k_both_ways_and_shuts_down() {
    let path = uds("a");
    let mut g = Guest::new(&path);
    let (mut host, mut conn) = host_connect(&mut g, &path, 1234);

    // Host → guest: 64 KiB against a 16 KiB guest buffer, so the device must
    // stop at the credit limit and wait for CREDIT_UPDATEs.
    let up = pattern(64 * 1024, 7);
    let mut writer = host.try_clone().unwrap();
    let sent = up.clone();
    let t = std::thread::spawn(move || writer.write_all(&sent).unwrap());
    let got = conn.recv_bytes(&mut g, up.len());
    t.join().unwrap();
    assert_eq!(got.len(), up.len());
    assert_eq!(checksum(&got), checksum(&up));
    assert!(
        conn.credit_updates_sent >= 6,
        "credit flowed: {}",
        conn.credit_updates_sent
    );

    // Guest → host: 64 KiB.
    let down = pattern(64 * 1024, 99);
    conn.send_bytes(&mut g, &down, 256 * 1024);
    let mut back = vec![0u8; down.len()];
    host.read_exact(&mut back).unwrap();
    assert_eq!(checksum(&back), checksum(&down));

    // Host half-closes: the guest sees SHUTDOWN(SEND). The guest closes: both
    // flags, answered with RST; the host stream reaches EOF.
    host.shutdown(std::net::Shutdown::Write).unwrap();
    let p = conn.recv_ctl(&mut g);
    assert_eq!((p.op, p.flags), (op::SHUTDOWN, 2), "{p:?}");
    g.send(conn.pkt(op::SHUTDOWN), &[]);
    let mut close = conn.pkt(op::SHUTDOWN);
    close.flags = 3;
    g.send(close, &[]);
    let p = conn.recv_ctl(&mut g);
    assert_eq!(p.op, op::RST, "{p:?}");
    let mut rest = Vec::new();
    host.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    assert!(
        g.try_recv(Duration::from_millis(50)).is_none(),
        "nothing more for the guest"
    );
}

#[test]
fn pause_holds_host_data_in_the_socket_and_resume_delivers_it() {
    let path = uds("p");
    let mut g = Guest::new(&path);
    let (mut host, mut conn) = host_connect(&mut g, &path, 4321);
    let first = pattern(1000, 3);
    host.write_all(&first).unwrap();
    assert_eq!(checksum(&conn.recv_bytes(&mut g, first.len())), checksum(&first));

    g.m.dev.lock().unwrap().pause().unwrap();
    g.m.reset_dirty();
    // Data the host sends while the VM is paused waits in the socket: no
    // packet reaches the guest and nothing is written into guest memory.
    let second = pattern(3000, 5);
    host.write_all(&second).unwrap();
    assert!(
        g.try_recv(Duration::from_millis(150)).is_none(),
        "nothing delivered while paused"
    );
    assert!(g.m.dirty_pages().is_empty(), "nothing written while paused");

    // Resume: the same connection (the muxer and its state survived) delivers it.
    g.m.dev.lock().unwrap().resume().unwrap();
    assert_eq!(checksum(&conn.recv_bytes(&mut g, second.len())), checksum(&second));
}

#[test]
fn guest_initiated_connection_reaches_the_port_listener() {
    let path = uds("b");
    let mut lpath = path.clone().into_os_string();
    lpath.push("_5000");
    let _ = std::fs::remove_file(&lpath);
    let listener = UnixListener::bind(&lpath).unwrap();
    let mut g = Guest::new(&path);
    let mut conn = GuestConn {
        port: 40000,
        peer: 5000,
        fwd_cnt: 0,
        fwd_cnt_sent: 0,
        rx_total: 0,
        credit_updates_sent: 0,
        credit_requests_seen: 0,
    };
    g.send(conn.pkt(op::REQUEST), &[]);
    let (p, _) = g.recv();
    assert_eq!((p.op, p.src_port, p.dst_port), (op::RESPONSE, 5000, 40000), "{p:?}");
    let (mut host, _) = listener.accept().unwrap();
    host.set_read_timeout(Some(TIMEOUT)).unwrap();

    let down = pattern(20_000, 3);
    conn.send_bytes(&mut g, &down, p.buf_alloc);
    let mut back = vec![0u8; down.len()];
    host.read_exact(&mut back).unwrap();
    assert_eq!(back, down);

    let up = pattern(30_000, 4);
    host.write_all(&up).unwrap();
    assert_eq!(conn.recv_bytes(&mut g, up.len()), up);

    // Guest closes; RST back; host sees EOF.
    let mut close = conn.pkt(op::SHUTDOWN);
    close.flags = 3;
    g.send(close, &[]);
    let p = conn.recv_ctl(&mut g);
    assert_eq!(p.op, op::RST);
    assert_eq!(host.read(&mut [0u8; 8]).unwrap(), 0);
    drop(g);
    let _ = std::fs::remove_file(&lpath);
}

#[test]
fn guest_connection_without_listener_gets_rst() {
    let path = uds("c");
    let mut g = Guest::new(&path);
    g.send(Pkt::guest(op::REQUEST, 40001, 6000), &[]);
    let (p, _) = g.recv();
    assert_eq!((p.op, p.src_port, p.dst_port), (op::RST, 6000, 40001), "{p:?}");
    // Data for a connection that does not exist: RST too.
    g.send(Pkt::guest(op::RW, 40001, 6000), b"hello");
    let (p, _) = g.recv();
    assert_eq!(p.op, op::RST);
    // An RST for nothing gets no answer.
    g.send(Pkt::guest(op::RST, 40001, 6000), &[]);
    assert!(g.try_recv(Duration::from_millis(50)).is_none());
}

#[test]
fn malformed_chains_are_dropped_and_the_device_keeps_serving() {
    let path = uds("d");
    let mut g = Guest::new(&path);
    let mem = g.m.mem.clone();
    let good = Pkt::guest(op::REQUEST, 40002, 6001);
    let mut long = Pkt::guest(op::RW, 40002, 6001);
    long.len = 100_000;
    let mut short_data = Pkt::guest(op::RW, 40002, 6001);
    short_data.len = 4096;
    let mut foreign = good.clone();
    foreign.src_cid = 99;
    let unknown_op = Pkt::guest(99, 40003, 6001);
    let mut seqpacket = Pkt::guest(op::REQUEST, 40004, 6001);
    seqpacket.type_ = 2;
    let mut to_other_cid = Pkt::guest(op::REQUEST, 40005, 6001);
    to_other_cid.dst_cid = 7;

    g.send_raw(&good.to_bytes()[..20], &[], Some((20, 0))); // header too short
    g.send_raw(&long.to_bytes(), &[0; 16], Some((HDR as u32, 16))); // len past the limit
    g.send_raw(&short_data.to_bytes(), &[0; 100], Some((HDR as u32, 100))); // len beyond the buffer
    g.send_raw(&foreign.to_bytes(), &[], None); // wrong source CID: dropped, no RST
    g.send_raw(&unknown_op.to_bytes(), &[], None); // RST
    g.send_raw(&seqpacket.to_bytes(), &[], None); // RST
    g.send_raw(&to_other_cid.to_bytes(), &[], None); // RST
    // Write-only head, and a header outside guest memory.
    g.tx.add(&mem, &[(TX_HDR_BASE, HDR as u32, true)]);
    g.tx.add(&mem, &[(1 << 40, HDR as u32, false)]);
    g.tx.add(&mem, &[(MEM_SIZE as u64 - 8, HDR as u32, false)]);
    g.tx_outstanding += 3;
    g.m.kick(1);
    g.drain_tx();
    let mut rsts = Vec::new();
    while let Some((p, _)) = g.try_recv(Duration::from_millis(100)) {
        assert_eq!(p.op, op::RST, "{p:?}");
        rsts.push(p.dst_port);
    }
    rsts.sort();
    assert_eq!(rsts, vec![40003, 40004, 40005]);

    // A bad RX buffer (device-readable), queued behind the posted good ones:
    // once the device reaches it, it is returned empty and the next one used.
    let bad_head = g.rx.add(&mem, &[(RX_HDR_BASE + 0xf00, HDR as u32, false)]);
    g.rx_heads.insert(bad_head, 0);
    for _ in 0..RX_BUFS + 2 {
        g.send(Pkt::guest(op::RW, 40009, 6009), b"x");
        assert_eq!(g.recv().0.op, op::RST);
    }
    assert_eq!(g.rx_empty, 1, "the bad RX buffer came back empty");

    // A valid exchange afterwards.
    let mut lpath = path.clone().into_os_string();
    lpath.push("_6001");
    let _ = std::fs::remove_file(&lpath);
    let listener = UnixListener::bind(&lpath).unwrap();
    g.send(good, &[]);
    let (p, _) = g.recv();
    assert_eq!(p.op, op::RESPONSE, "{p:?}");
    let (mut host, _) = listener.accept().unwrap();
    g.send(Pkt::guest(op::RW, 40002, 6001), b"still alive");
    let mut buf = [0u8; 11];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"still alive");
    drop(g);
    let _ = std::fs::remove_file(&lpath);
}

#[test]
fn reset_and_drop_stop_the_worker_and_remove_the_socket() {
    let path = uds("e");
    let mut g = Guest::new(&path);
    let mem = g.m.mem.clone();
    let (mut host, _conn) = host_connect(&mut g, &path, 77);
    let baseline = 3; // `mem` here, the Machine, the transport
    assert_eq!(Arc::strong_count(&mem), baseline + 1, "the worker holds guest memory");

    // Device reset: the worker is joined (its memory handle is gone) and its
    // connections are closed.
    g.m.common_w(common::DEVICE_STATUS, 1, 0);
    assert_eq!(g.m.status(), 0);
    assert!(!g.m.dev.lock().unwrap().is_active());
    assert_eq!(Arc::strong_count(&mem), baseline, "worker thread is gone");
    assert_eq!(host.read(&mut [0u8; 4]).unwrap(), 0, "host stream closed on reset");
    assert!(path.exists(), "the socket outlives a reset");

    // A fresh driver gets a working device (and host connections wait in the
    // backlog until then).
    let mut g2 = Guest::new_on(g.m);
    let (_host2, _c2) = host_connect(&mut g2, &path, 78);

    drop(g2);
    assert_eq!(Arc::strong_count(&mem), 1, "dropping the device stops its worker");
    assert!(!path.exists(), "the unix socket is removed with the device");
}

#[test]
fn rx_writes_mark_the_dirty_bitmap() {
    let path = uds("f");
    let mut g = Guest::new(&path);
    let (mut host, conn) = host_connect(&mut g, &path, 88);
    let mem = g.m.mem.clone();
    g.drain_tx();
    std::thread::sleep(Duration::from_millis(20));
    g.m.reset_dirty();
    let before = g.rx.used_idx(&mem);
    host.write_all(&[0x5a; 100]).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while g.rx.used_idx(&mem) == before {
        assert!(Instant::now() < deadline, "no RX packet");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Only the device wrote since the reset (the guest just reads).
    let e = g.rx.used + 4 + 8 * u64::from(before % QSIZE);
    let head = mem.read_obj::<u32>(GuestAddress(e)).unwrap() as u16;
    let i = g.rx_heads[&head];
    let mut expect = vec![Guest::rx_hdr(i) / PAGE, Guest::rx_data(i) / PAGE, g.rx.used / PAGE];
    expect.sort();
    assert_eq!(g.m.dirty_pages(), expect);
    let (p, data) = g.recv();
    assert_eq!((p.op, p.dst_port), (op::RW, conn.port));
    assert_eq!(data, vec![0x5a; 100]);
}

impl Guest {
    /// A new driver instance on an existing machine (as after a guest reboot).
    fn new_on(m: Machine) -> Self {
        let mut g = Self {
            m,
            rx: Vq::new(0x8_0000),
            tx: Vq::new(0x9_0000),
            ev: Vq::new(0xa_0000),
            rx_heads: HashMap::new(),
            tx_slot: 0,
            tx_outstanding: 0,
            rx_empty: 0,
        };
        g.m.driver_init(&[&g.rx, &g.tx, &g.ev]);
        for i in 0..RX_BUFS {
            g.post_rx(i);
        }
        g.m.kick(0);
        g
    }
}

/// A fork child's (or a restored snapshot's) vsock: the state carries no
/// connection, the child's device listens on its own socket, and its first
/// act on the guest's rings is a TRANSPORT_RESET event, so the guest drops
/// the connections it thinks it has; the source keeps its connection.
#[test]
fn a_restored_device_resets_the_guests_connections_and_serves_its_own_socket() {
    const EV_BUF: u64 = 0x6_0000;
    let path = uds("r-src");
    let mut g = Guest::new(&path);
    let (mut host, mut conn) = host_connect(&mut g, &path, 77);
    // The guest's event buffers (Linux posts 8 at probe), filled with a
    // pattern so the device's write shows; the first is malformed (not
    // device-writable): it is given back empty and the next one is used.
    g.m.mem.write_slice(&[0xa5; 24], GuestAddress(EV_BUF)).unwrap();
    g.ev.add(&g.m.mem, &[(EV_BUF + 16, 8, false)]);
    for i in 0..2 {
        g.ev.add(&g.m.mem, &[(EV_BUF + 8 * i, 8, true)]);
    }
    g.m.kick(2);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(g.ev.used_idx(&g.m.mem), 0, "a live device sent an event");

    g.m.dev.lock().unwrap().pause().unwrap();
    let st = g.m.dev.lock().unwrap().save_state().unwrap();
    assert!(st.device_state.is_empty(), "vsock carries no state");
    // The child: a copy of the guest's RAM, a function of its own.
    let child_mem = Arc::new(GuestMemoryTracked::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap());
    let mut bytes = vec![0u8; MEM_SIZE];
    g.m.mem.read_slice(&mut bytes, GuestAddress(0)).unwrap();
    child_mem.write_slice(&bytes, GuestAddress(0)).unwrap();
    let child_path = uds("r-child");
    let m2 = Machine::on(child_mem, &child_path);
    m2.dev.lock().unwrap().restore_state(&st).unwrap();
    m2.dev.lock().unwrap().start_restored().unwrap();
    let mut child = Guest {
        m: m2,
        rx: g.rx.clone(),
        tx: g.tx.clone(),
        ev: g.ev.clone(),
        rx_heads: g.rx_heads.clone(),
        tx_slot: g.tx_slot,
        tx_outstanding: g.tx_outstanding,
        rx_empty: g.rx_empty,
    };
    let t0 = Instant::now();
    let mut used = Vec::new();
    while used.len() < 2 {
        if let Some(u) = child.ev.pop_used(&child.m.mem) {
            used.push(u);
            continue;
        }
        assert!(t0.elapsed() < TIMEOUT, "no transport reset event: {used:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        used,
        [(0, 0), (1, 4)],
        "the malformed buffer empty, then the event in the next"
    );
    let skipped: u32 = child.m.mem.read_obj(GuestAddress(EV_BUF + 16)).unwrap();
    assert_eq!(skipped, 0xa5a5_a5a5, "the device wrote into a buffer it may only read");
    let id: u32 = child.m.mem.read_obj(GuestAddress(EV_BUF)).unwrap();
    assert_eq!(id, 0, "VIRTIO_VSOCK_EVENT_TRANSPORT_RESET");
    let untouched: u32 = child.m.mem.read_obj(GuestAddress(EV_BUF + 8)).unwrap();
    assert_eq!(untouched, 0xa5a5_a5a5, "one event, not two");
    std::thread::sleep(Duration::from_millis(50));
    assert!(child.ev.pop_used(&child.m.mem).is_none(), "the reset is sent once");

    // The child's own socket reaches the guest's listener.
    let (mut child_host, mut child_conn) = host_connect(&mut child, &child_path, 77);
    let data = pattern(3000, 11);
    child_host.write_all(&data).unwrap();
    assert_eq!(
        checksum(&child_conn.recv_bytes(&mut child, data.len())),
        checksum(&data)
    );
    // The source kept its connection.
    g.m.dev.lock().unwrap().resume().unwrap();
    let data = pattern(2000, 12);
    host.write_all(&data).unwrap();
    assert_eq!(checksum(&conn.recv_bytes(&mut g, data.len())), checksum(&data));
}

//! Per-frame cost of k7d's userspace virtio-net path (tap <-> virtqueue) next
//! to the raw tap read/write floor, for 1, 2 and 4 queue pairs, in one run.
//!
//! The device is the real one (`k7d_devices::virtio::net::Net`: one worker
//! per queue pair, a real `IFF_MULTI_QUEUE|IFF_VNET_HDR` tap in a throwaway
//! netns) on real guest memory (a memfd mapped as k7d maps guest RAM). The
//! bench plays Linux's virtio_net driver, one thread per queue pair (as one
//! vCPU per queue would): it sets the pair count over the control queue,
//! keeps each ring full and waits on the vector's irqfd.
//!
//! * TX: each pair sends N 60-byte frames (+ 12-byte virtio-net header, an
//!   ethertype nobody handles, so the netns drops it at once). Floor: one
//!   thread per queue `write()`s the same 72 bytes to its queue fd of a
//!   second tap with the same queue count.
//! * RX: frames of one UDP flow per queue are injected into the tap from the
//!   kernel side (AF_PACKET); tun's automatic queue steering puts each flow on
//!   the queue that last sent it, so each pair first sends one frame of its
//!   flow. The injection happens while no RX buffer is posted; the clock runs
//!   from posting buffers until every frame is in guest memory. Floor: the
//!   same frames, injected the same way, `read()` from the second tap's fds.
//!
//! Printed: ns per frame (wall time / frames, all pairs together), the ratio
//! to the floor (goal <= 2), and throughput scaling from 1 pair (goal >=
//! 0.8 x N up to the core count). Root only (netns, taps).
//! `cargo bench -p k7d-benches --bench virtio_net`; `K7D_BENCH_FRAMES`
//! (100000 TX frames per pair and round), `K7D_BENCH_RX_FRAMES` (2048 per
//! queue and injection), `K7D_BENCH_ROUNDS` (3), `K7D_BENCH_PAIRS` (1,2,4).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k7d_benches::ring::{DriverRing, F_NEXT, F_WRITE, guest_memory, wait_irq};
use k7d_benches::{env_num, is_root, median};
use k7d_devices::pci::{MsixVectors, NoopMsiRouter};
use k7d_devices::virtio::net::{Net, NetConfig};
use k7d_devices::virtio::{
    ActivateContext, ActiveQueue, GuestMemoryTracked, Interrupt, InterruptStatus, VIRTIO_F_VERSION_1, VirtioDevice,
};
use k7d_net::Tap;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const MEM: usize = 64 << 20;
const QSIZE: u16 = 256;
const RINGS: u64 = 0x10_0000;
const CTRL_BUF: u64 = 0x8_0000;
const TX_BUFS: u64 = 0x100_0000;
const TX_SLOT: u64 = 128;
const RX_BUFS: u64 = 0x200_0000;
const RX_SLOT: u64 = 2048;
const HDR: usize = 12;
const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0xbe, 0x0c, 0x01];
const F_MAC: u64 = 1 << 5;
const F_CTRL_VQ: u64 = 1 << 17;
const F_MQ: u64 = 1 << 22;

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("cannot run {args:?}"))?;
    ensure!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// A throwaway netns, deleted on drop (taking its taps with it).
struct Netns(String);

impl Netns {
    fn new() -> Result<Self> {
        let name = format!("k7dbnet{}", std::process::id());
        let _ = sh(&["ip", "netns", "del", &name]);
        sh(&["ip", "netns", "add", &name])?;
        let ns = Self(name);
        let _ = sh(&[
            "ip",
            "netns",
            "exec",
            &ns.0,
            "sysctl",
            "-qw",
            "net.ipv6.conf.all.disable_ipv6=1",
        ]);
        let _ = sh(&[
            "ip",
            "netns",
            "exec",
            &ns.0,
            "sysctl",
            "-qw",
            "net.ipv6.conf.default.disable_ipv6=1",
        ]);
        Ok(ns)
    }
    fn path(&self) -> std::path::PathBuf {
        format!("/run/netns/{}", self.0).into()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.0]);
    }
}

/// An AF_PACKET socket that sends into a tap from the kernel side (and
/// receives nothing: protocol 0).
struct Injector(OwnedFd, u32);

impl Injector {
    fn open(ifindex: u32) -> std::io::Result<Self> {
        // SAFETY: plain socket(2); the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }, ifindex))
    }

    fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        // SAFETY: an all-zero sockaddr_ll is a valid value of this C struct.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        sll.sll_ifindex = self.1 as i32;
        sll.sll_halen = 6;
        // SAFETY: `frame` and `sll` are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// A 60-byte frame: TX frames carry an unhandled ethertype; flow frames are
/// IPv4/UDP between 10.77.9.2:(1000 + k) (the guest) and 10.77.9.1:2000.
fn frame(kind: Frame) -> Vec<u8> {
    let mut f = vec![0u8; 60];
    match kind {
        Frame::Tx => {
            f[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
            f[6..12].copy_from_slice(&MAC);
            f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
        }
        Frame::Flow { queue, to_guest } => {
            let (src_mac, dst_mac) = if to_guest {
                ([0x02, 0, 0, 0, 0, 1], MAC)
            } else {
                (MAC, [0x02, 0, 0, 0, 0, 1])
            };
            f[0..6].copy_from_slice(&dst_mac);
            f[6..12].copy_from_slice(&src_mac);
            f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
            let guest = [10, 77, 9, 2];
            let peer = [10, 77, 9, 1];
            let (sip, dip, sport, dport) = if to_guest {
                (peer, guest, 2000u16, 1000 + queue)
            } else {
                (guest, peer, 1000 + queue, 2000u16)
            };
            let ip = &mut f[14..34];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&46u16.to_be_bytes());
            ip[8] = 64;
            ip[9] = 17;
            ip[12..16].copy_from_slice(&sip);
            ip[16..20].copy_from_slice(&dip);
            let mut sum = 0u32;
            for c in ip.chunks(2) {
                sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
            }
            while sum > 0xffff {
                sum = (sum & 0xffff) + (sum >> 16);
            }
            ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
            let udp = &mut f[34..42];
            udp[0..2].copy_from_slice(&sport.to_be_bytes());
            udp[2..4].copy_from_slice(&dport.to_be_bytes());
            udp[4..6].copy_from_slice(&26u16.to_be_bytes());
        }
    }
    f
}

#[derive(Clone, Copy)]
enum Frame {
    Tx,
    Flow { queue: u16, to_guest: bool },
}

fn with_hdr(f: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; HDR];
    v.extend_from_slice(f);
    v
}

fn make_tap(ns: &Netns, name: &str, pairs: u16) -> Result<(Tap, Injector)> {
    let name = name.to_string();
    let r = k7d_net::in_netns(Some(&ns.path()), move || {
        let mut nl = k7d_net::netlink::Netlink::open()?;
        let tap = k7d_net::create_tap(&mut nl, &name, usize::from(pairs), true)?;
        let inj = Injector::open(tap.ifindex).map_err(|e| k7d_net::NetError::Invalid {
            what: "an AF_PACKET socket on the tap".into(),
            reason: e.to_string(),
        })?;
        Ok((tap, inj))
    })?;
    // tun's per-queue ring is txqueuelen long: room for one injection.
    sh(&["ip", "-n", &ns.0, "link", "set", "dev", &r.0.name, "txqueuelen", "8192"])?;
    Ok(r)
}

/// The device and the driver's rings.
struct Device {
    /// In a mutex: a paused device keeps its workers' state, which is Send
    /// but not Sync.
    dev: Mutex<Net>,
    mem: Arc<GuestMemoryTracked>,
    msix: Arc<MsixVectors>,
    pairs: Vec<Mutex<Pair>>,
}

struct Pair {
    k: u16,
    rx: DriverRing,
    tx: DriverRing,
    rx_notify: EventFd,
    tx_notify: EventFd,
}

fn queue_base(i: u16) -> u64 {
    RINGS + u64::from(i) * DriverRing::span(QSIZE)
}

impl Device {
    fn new(tap: Tap, pairs: u16) -> Result<Self> {
        let mem = guest_memory(MEM)?;
        let mut dev = Net::new(
            tap,
            NetConfig {
                mac: MAC,
                queue_pairs: pairs,
            },
        )?;
        let nq = 2 * pairs + u16::from(pairs > 1);
        let msix = Arc::new(MsixVectors::new(nq + 1, Arc::new(NoopMsiRouter))?);
        msix.set_control(true, false);
        for v in 0..=nq {
            msix.write_table(u64::from(v) * 16 + 12, &0u32.to_le_bytes());
        }
        let mut queues = Vec::new();
        let mut ps = Vec::new();
        for k in 0..pairs {
            let rx = DriverRing::new(mem.clone(), queue_base(2 * k), QSIZE);
            let tx = DriverRing::new(mem.clone(), queue_base(2 * k + 1), QSIZE);
            let (rxn, txn) = (EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?);
            queues.push(ActiveQueue {
                index: 2 * k,
                queue: rx.queue()?,
                notify: rxn.try_clone()?,
            });
            queues.push(ActiveQueue {
                index: 2 * k + 1,
                queue: tx.queue()?,
                notify: txn.try_clone()?,
            });
            // TX descriptors: slot i holds one 72-byte frame.
            let f = with_hdr(&frame(Frame::Tx));
            for i in 0..QSIZE {
                let at = TX_BUFS + (u64::from(k) * u64::from(QSIZE) + u64::from(i)) * TX_SLOT;
                mem.write_slice(&f, GuestAddress(at))?;
                tx.set_desc(i, at, f.len() as u32, 0, 0)?;
            }
            for i in 0..QSIZE {
                let at = RX_BUFS + (u64::from(k) * u64::from(QSIZE) + u64::from(i)) * RX_SLOT;
                rx.set_desc(i, at, RX_SLOT as u32, F_WRITE, 0)?;
            }
            ps.push(Mutex::new(Pair {
                k,
                rx,
                tx,
                rx_notify: rxn,
                tx_notify: txn,
            }));
        }
        let mut ctrl = None;
        if pairs > 1 {
            let r = DriverRing::new(mem.clone(), queue_base(2 * pairs), QSIZE);
            let n = EventFd::new(EFD_NONBLOCK)?;
            queues.push(ActiveQueue {
                index: 2 * pairs,
                queue: r.queue()?,
                notify: n.try_clone()?,
            });
            ctrl = Some((r, n));
        }
        let vectors: Vec<u16> = (1..=nq).collect();
        let mut features = VIRTIO_F_VERSION_1 | F_MAC;
        if pairs > 1 {
            features |= F_MQ | F_CTRL_VQ;
        }
        dev.activate(ActivateContext {
            mem: mem.clone(),
            acked_features: features,
            queues,
            interrupt: Interrupt::new(msix.clone(), vectors, 0, Arc::new(InterruptStatus::default())),
        })
        .context("activating virtio-net")?;
        if let Some((mut r, n)) = ctrl {
            // VIRTIO_NET_CTRL_MQ / VQ_PAIRS_SET, as the driver does after probe.
            mem.write_slice(&[4u8, 0], GuestAddress(CTRL_BUF))?;
            mem.write_obj(pairs, GuestAddress(CTRL_BUF + 2))?;
            mem.write_obj(0xffu8, GuestAddress(CTRL_BUF + 4))?;
            r.set_desc(0, CTRL_BUF, 2, F_NEXT, 1)?;
            r.set_desc(1, CTRL_BUF + 2, 2, F_NEXT, 2)?;
            r.set_desc(2, CTRL_BUF + 4, 1, F_WRITE, 0)?;
            r.push(0)?;
            r.publish()?;
            n.write(1)?;
            let deadline = Instant::now() + Duration::from_secs(5);
            while r.used_idx()? != 1 {
                ensure!(Instant::now() < deadline, "the device never answered VQ_PAIRS_SET");
                std::thread::sleep(Duration::from_millis(1));
            }
            let ack: u8 = mem.read_obj(GuestAddress(CTRL_BUF + 4))?;
            ensure!(ack == 0, "VQ_PAIRS_SET {pairs} was refused (ack {ack})");
        }
        Ok(Self {
            dev: Mutex::new(dev),
            mem,
            msix,
            pairs: ps,
        })
    }

    fn irqfd(&self, queue: u16) -> &EventFd {
        &self.msix.irqfds()[usize::from(queue) + 1]
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.dev.lock().unwrap_or_else(|p| p.into_inner()).reset();
    }
}

/// Driver side of TX on one pair: `n` frames, ring kept full.
fn dev_tx(d: &Device, p: &mut Pair, n: usize) -> Result<()> {
    let irq = d.irqfd(2 * p.k + 1);
    let mut next = 0u16;
    let (mut issued, mut done) = (0usize, 0usize);
    while done < n {
        let mut posted = false;
        while issued < n && p.tx.in_flight() < QSIZE {
            p.tx.push(next % QSIZE)?;
            next = next.wrapping_add(1);
            issued += 1;
            posted = true;
        }
        if posted {
            p.tx.publish()?;
            if p.tx.needs_kick()? {
                p.tx_notify.write(1)?;
            }
        }
        let (_, got) = p.tx.reap()?;
        if got == 0 {
            wait_irq(irq, 1000);
        }
        done += usize::from(got);
    }
    Ok(())
}

/// The pair's flow: one frame guest -> peer through the device, so tun
/// steers the reverse flow to this queue.
fn dev_prime(d: &Device, p: &mut Pair) -> Result<()> {
    let f = with_hdr(&frame(Frame::Flow {
        queue: p.k,
        to_guest: false,
    }));
    // Borrow TX slot 0's buffer for the one frame, then put the TX frame back.
    let at = TX_BUFS + u64::from(p.k) * u64::from(QSIZE) * TX_SLOT;
    let keep = with_hdr(&frame(Frame::Tx));
    d.mem.write_slice(&f, GuestAddress(at))?;
    let slot = p.tx.in_flight(); // always 0 between runs
    ensure!(slot == 0, "TX ring busy");
    dev_tx_one(d, p)?;
    d.mem.write_slice(&keep, GuestAddress(at))?;
    Ok(())
}

fn dev_tx_one(d: &Device, p: &mut Pair) -> Result<()> {
    // Descriptor 0 is used for the one frame: the ring's next slot may hold
    // any descriptor index.
    p.tx.push(0)?;
    p.tx.publish()?;
    p.tx_notify.write(1)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, got) = p.tx.reap()?;
        if got == 1 {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "priming TX frame never completed");
        wait_irq(d.irqfd(2 * p.k + 1), 10);
    }
}

/// Driver side of RX on one pair: posts buffers for exactly `n` frames
/// (never more, so nothing is left posted for the next injection) and
/// waits until all are used.
fn dev_rx(d: &Device, p: &mut Pair, n: usize, abort: &AtomicBool) -> Result<()> {
    let irq = d.irqfd(2 * p.k);
    let (mut posted_total, mut done) = (0usize, 0usize);
    let mut next = 0u16;
    let deadline = Instant::now() + Duration::from_secs(10);
    while done < n {
        let mut posted = false;
        while posted_total < n && p.rx.in_flight() < QSIZE {
            p.rx.push(next % QSIZE)?;
            next = next.wrapping_add(1);
            posted_total += 1;
            posted = true;
        }
        if posted {
            p.rx.publish()?;
            if p.rx.needs_kick()? {
                p.rx_notify.write(1)?;
            }
        }
        let (_, got) = p.rx.reap()?;
        if got == 0 {
            if abort.load(Ordering::Relaxed) || Instant::now() > deadline {
                bail!("RX queue {} got {done} of {n} frames (flow steering missed?)", p.k);
            }
            wait_irq(irq, 10);
        }
        done += usize::from(got);
    }
    Ok(())
}

/// Runs `f(pair)` on one thread per pair after a common start; wall seconds.
fn parallel<F>(pairs: u16, f: F) -> Result<f64>
where
    F: Fn(u16, &AtomicBool) -> Result<()> + Sync,
{
    let start = Barrier::new(usize::from(pairs) + 1);
    let abort = AtomicBool::new(false);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..pairs)
            .map(|k| {
                let (start, abort, f) = (&start, &abort, &f);
                s.spawn(move || {
                    start.wait();
                    let r = f(k, abort);
                    if r.is_err() {
                        abort.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        for h in hs {
            h.join().map_err(|_| anyhow::anyhow!("a bench thread panicked"))??;
        }
        Ok(t0.elapsed().as_secs_f64())
    })
}

fn write_fd(fd: &OwnedFd, b: &[u8]) -> std::io::Result<()> {
    // SAFETY: `b` is valid for `b.len()` bytes.
    let n = unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), b.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn inject(inj: &Injector, pairs: u16, n: usize) -> Result<()> {
    let frames: Vec<Vec<u8>> = (0..pairs)
        .map(|k| {
            frame(Frame::Flow {
                queue: k,
                to_guest: true,
            })
        })
        .collect();
    for _ in 0..n {
        for f in &frames {
            inj.send(f).context("injecting a frame into the tap")?;
        }
    }
    Ok(())
}

struct Results {
    tx: Vec<f64>,
    tx_floor: Vec<f64>,
    rx: Vec<f64>,
    rx_floor: Vec<f64>,
}

fn bench_pairs(ns: &Netns, pairs: u16, n_tx: usize, n_rx: usize, rounds: usize) -> Result<Results> {
    let (dtap, dinj) = make_tap(ns, &format!("k7dbd{pairs}"), pairs)?;
    let (ftap, finj) = make_tap(ns, &format!("k7dbf{pairs}"), pairs)?;
    let dev = Device::new(dtap, pairs)?;
    let txf = with_hdr(&frame(Frame::Tx));
    let injections = 8;
    let mut r = Results {
        tx: vec![],
        tx_floor: vec![],
        rx: vec![],
        rx_floor: vec![],
    };
    for round in 0..=rounds {
        // Round 0 warms up and is not kept.
        let keep = round > 0;
        let t = parallel(pairs, |k, _| {
            dev_tx(&dev, &mut dev.pairs[usize::from(k)].lock().unwrap(), n_tx)
        })?;
        let tf = parallel(pairs, |k, _| {
            for _ in 0..n_tx {
                write_fd(&ftap.queues[usize::from(k)], &txf)?;
            }
            Ok(())
        })?;
        // RX: prime steering, inject while nothing is posted, time the drain.
        let (mut rx, mut rxf) = (0.0, 0.0);
        for _ in 0..injections {
            for p in &dev.pairs {
                dev_prime(&dev, &mut p.lock().unwrap())?;
            }
            for k in 0..pairs {
                let f = with_hdr(&frame(Frame::Flow {
                    queue: k,
                    to_guest: false,
                }));
                write_fd(&ftap.queues[usize::from(k)], &f)?;
            }
            inject(&dinj, pairs, n_rx)?;
            rx += parallel(pairs, |k, abort| {
                dev_rx(&dev, &mut dev.pairs[usize::from(k)].lock().unwrap(), n_rx, abort)
            })?;
            inject(&finj, pairs, n_rx)?;
            let got = AtomicUsize::new(0);
            rxf += parallel(pairs, |k, abort| {
                let fd = &ftap.queues[usize::from(k)];
                let mut buf = vec![0u8; 2048];
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut mine = 0;
                while mine < n_rx {
                    match k7d_net::read_frame(fd, &mut buf)? {
                        Some(_) => mine += 1,
                        None => {
                            if abort.load(Ordering::Relaxed) || Instant::now() > deadline {
                                bail!("floor RX queue {k} got {mine} of {n_rx} frames (flow steering missed?)");
                            }
                            k7d_net::wait_readable(fd, 10)?;
                        }
                    }
                }
                got.fetch_add(mine, Ordering::Relaxed);
                Ok(())
            })?;
        }
        if keep {
            let frames_tx = (n_tx * usize::from(pairs)) as f64;
            let frames_rx = (n_rx * usize::from(pairs) * injections) as f64;
            r.tx.push(t * 1e9 / frames_tx);
            r.tx_floor.push(tf * 1e9 / frames_tx);
            r.rx.push(rx * 1e9 / frames_rx);
            r.rx_floor.push(rxf * 1e9 / frames_rx);
        }
    }
    let stats = dev.dev.lock().unwrap_or_else(|p| p.into_inner()).stats();
    let malformed: u64 = stats.pairs.iter().map(|s| s.malformed.load(Ordering::Relaxed)).sum();
    ensure!(malformed == 0, "the device counted {malformed} malformed chains");
    drop(dev);
    drop((ftap, finj, dinj));
    Ok(r)
}

fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    if !is_root() {
        println!("virtio_net bench skipped: needs root (a netns and taps)");
        return Ok(());
    }
    let n_tx = env_num("K7D_BENCH_FRAMES", 100_000);
    let n_rx = env_num("K7D_BENCH_RX_FRAMES", 2048).min(8000);
    let rounds = env_num("K7D_BENCH_ROUNDS", 3).max(1);
    let pair_list: Vec<u16> = std::env::var("K7D_BENCH_PAIRS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .filter(|p| (1..=16).contains(p))
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ns = Netns::new()?;
    let mut rows = Vec::new();
    for &p in &pair_list {
        let mut r = bench_pairs(&ns, p, n_tx, n_rx, rounds).with_context(|| format!("{p} queue pair(s)"))?;
        rows.push((
            p,
            median(&mut r.tx),
            median(&mut r.tx_floor),
            median(&mut r.rx),
            median(&mut r.rx_floor),
        ));
    }
    println!(
        "virtio-net userspace path vs raw tap floor: ns per frame (wall / frames, all pairs), medians of {rounds} rounds; {cores} cores"
    );
    println!("  TX {n_tx} frames/pair/round; RX 8 x {n_rx} frames/queue/round; 60-byte frames + 12-byte vnet header");
    println!(
        "{:<6} {:>9} {:>9} {:>6} {:>8} {:>9} {:>9} {:>6} {:>8}",
        "pairs", "tx k7d", "tx floor", "ratio", "scale", "rx k7d", "rx floor", "ratio", "scale"
    );
    let base = rows.iter().find(|r| r.0 == 1).map(|r| (r.1, r.3));
    for &(p, tx, txf, rx, rxf) in &rows {
        let (stx, srx) = base.map_or((f64::NAN, f64::NAN), |(b_tx, b_rx)| (b_tx / tx, b_rx / rx));
        println!(
            "{:<6} {:>9.0} {:>9.0} {:>6.2} {:>7.2}x {:>9.0} {:>9.0} {:>6.2} {:>7.2}x",
            p,
            tx,
            txf,
            tx / txf,
            stx,
            rx,
            rxf,
            rx / rxf,
            srx
        );
    }
    println!(
        "goals: ratio <= 2.0; scale >= 0.8 x pairs up to the core count ({cores}); a pair needs two threads (driver + worker) here, the floor one"
    );
    Ok(())
}

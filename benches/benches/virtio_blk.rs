//! Per-request cost of k7d's virtio-blk next to `pread`/`pwrite` of the same
//! file, measured in one run.
//!
//! The device is the real one (`k7d_devices::virtio::block::Block`, its
//! worker thread, its own dirty-tracked view of guest memory) on real guest
//! memory (a memfd mapped as k7d maps guest RAM). The bench plays the guest
//! driver: 4 KiB requests at pseudo-random 4 KiB-aligned offsets of a 64 MiB
//! raw image, [`QD`] in flight (header, data, status: three descriptors
//! each), one kick per batch posted, woken by the MSI-X irqfd. The floor is
//! one thread doing `pread`/`pwrite` of 4 KiB at the same offsets of the same
//! (page-cache-warm) file. Rounds alternate device and floor; medians.
//!
//! `cargo bench -p k7d-benches --bench virtio_blk`; `K7D_BENCH_REQUESTS`
//! (50000 per round and variant) and `K7D_BENCH_ROUNDS` (5) lengthen it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use k7d_benches::ring::{DriverRing, F_NEXT, F_WRITE, guest_memory, wait_irq};
use k7d_benches::{env_num, median};
use k7d_devices::pci::{MsixVectors, NoopMsiRouter};
use k7d_devices::virtio::block::{Block, DeviceMemory, DiskImage, features};
use k7d_devices::virtio::{ActivateContext, ActiveQueue, Interrupt, InterruptStatus, VIRTIO_F_VERSION_1, VirtioDevice};
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const MEM: usize = 32 << 20;
const IMAGE: u64 = 64 << 20;
const BS: u32 = 4096;
const QSIZE: u16 = 256;
/// Requests in flight (3 descriptors each, so 3 * QD <= QSIZE).
const QD: u16 = 64;
const RING: u64 = 0x1_0000;
const HDRS: u64 = 0x10_0000;
const STATUS: u64 = 0x11_0000;
const DATA: u64 = 0x20_0000;
const VECTOR: u16 = 1;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;

struct TempImage(PathBuf);

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Offsets (4 KiB aligned) from a fixed xorshift sequence.
fn offsets(n: usize) -> Vec<u64> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (IMAGE / u64::from(BS))) * u64::from(BS)
        })
        .collect()
}

struct Rig {
    mem: Arc<vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>>,
    _dev_mem: DeviceMemory,
    dev: Block,
    ring: DriverRing,
    notify: EventFd,
    msix: Arc<MsixVectors>,
}

impl Rig {
    fn new(image: &std::path::Path) -> Result<Self> {
        let mem = guest_memory(MEM)?;
        // SAFETY: `mem` (a field of this Rig, declared before `dev` is used
        // and dropped after the device is reset in `Drop`) keeps the mapping
        // alive for as long as the view exists.
        let dev_mem = unsafe { DeviceMemory::new(&mem) }.context("device view")?;
        let mut dev = Block::new(DiskImage::open(image, false)?, "k7d-bench")?;
        let msix = Arc::new(MsixVectors::new(2, Arc::new(NoopMsiRouter))?);
        msix.set_control(true, false);
        msix.write_table(u64::from(VECTOR) * 16 + 12, &0u32.to_le_bytes());
        let ring = DriverRing::new(mem.clone(), RING, QSIZE);
        let notify = EventFd::new(EFD_NONBLOCK)?;
        dev.activate(ActivateContext {
            mem: dev_mem.handle(),
            acked_features: VIRTIO_F_VERSION_1 | features::FLUSH | features::SEG_MAX | features::BLK_SIZE,
            queues: vec![ActiveQueue {
                index: 0,
                queue: ring.queue()?,
                notify: notify.try_clone()?,
            }],
            interrupt: Interrupt::new(msix.clone(), vec![VECTOR], 0, Arc::new(InterruptStatus::default())),
        })
        .context("activating virtio-blk")?;
        Ok(Self {
            mem,
            _dev_mem: dev_mem,
            dev,
            ring,
            notify,
            msix,
        })
    }

    /// Runs `offs.len()` requests of type `t`, QD in flight; returns seconds.
    fn run(&mut self, t: u32, offs: &[u64]) -> Result<f64> {
        let data_flags = if t == T_IN { F_WRITE } else { 0 };
        for slot in 0..QD {
            let d = 3 * slot;
            let s = u64::from(slot);
            self.ring.set_desc(d, HDRS + 16 * s, 16, F_NEXT, d + 1)?;
            self.ring
                .set_desc(d + 1, DATA + u64::from(BS) * s, BS, data_flags | F_NEXT, d + 2)?;
            self.ring.set_desc(d + 2, STATUS + s, 1, F_WRITE, 0)?;
        }
        let irq = &self.msix.irqfds()[usize::from(VECTOR)];
        let mut free: Vec<u16> = (0..QD).rev().collect();
        let (mut issued, mut done) = (0usize, 0usize);
        let t0 = Instant::now();
        while done < offs.len() {
            let mut posted = false;
            while issued < offs.len() {
                let Some(slot) = free.pop() else { break };
                let h = GuestAddress(HDRS + 16 * u64::from(slot));
                self.mem.write_obj(t, h)?;
                self.mem.write_obj(offs[issued] / 512, h.unchecked_add(8))?;
                self.mem.write_obj(0xffu8, GuestAddress(STATUS + u64::from(slot)))?;
                self.ring.push(3 * slot)?;
                issued += 1;
                posted = true;
            }
            if posted {
                self.ring.publish()?;
                if self.ring.needs_kick()? {
                    self.notify.write(1)?;
                }
            }
            let (first, n) = self.ring.reap()?;
            if n == 0 {
                wait_irq(irq, 1000);
                continue;
            }
            for i in 0..n {
                let (id, _len) = self.ring.used_elem(first.wrapping_add(i))?;
                let slot = u16::try_from(id / 3).context("used id")?;
                let st: u8 = self.mem.read_obj(GuestAddress(STATUS + u64::from(slot)))?;
                ensure!(st == 0, "request in slot {slot} completed with status {st}");
                free.push(slot);
            }
            done += usize::from(n);
        }
        Ok(t0.elapsed().as_secs_f64())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.dev.reset();
    }
}

fn floor(file: &File, write: bool, offs: &[u64]) -> Result<f64> {
    let mut buf = vec![0x5au8; BS as usize];
    let t0 = Instant::now();
    for &o in offs {
        if write {
            file.write_all_at(&buf, o)?;
        } else {
            file.read_exact_at(&mut buf, o)?;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let n = env_num("K7D_BENCH_REQUESTS", 50_000);
    let rounds = env_num("K7D_BENCH_ROUNDS", 5).max(1);
    let path = std::env::temp_dir().join(format!("k7d-bench-blk-{}.img", std::process::id()));
    let image = TempImage(path.clone());
    {
        let f = File::create(&image.0).with_context(|| format!("creating {}", path.display()))?;
        let chunk = vec![0xa5u8; 1 << 20];
        for i in 0..IMAGE / (1 << 20) {
            f.write_all_at(&chunk, i << 20)?;
        }
        f.sync_all()?;
    }
    let file = File::options().read(true).write(true).open(&image.0)?;
    // Warm the page cache: both sides then measure the same cached file.
    let mut sink = vec![0u8; 1 << 20];
    for i in 0..IMAGE / (1 << 20) {
        file.read_exact_at(&mut sink, i << 20)?;
    }
    let offs = offsets(n);
    let mut rig = Rig::new(&image.0)?;
    // One unmeasured pass each: threads started, caches and TLBs warm.
    rig.run(T_IN, &offs[..n.min(5000)])?;
    floor(&file, false, &offs[..n.min(5000)])?;

    let (mut dr, mut fr, mut dw, mut fw) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        dr.push(rig.run(T_IN, &offs)? * 1e9 / n as f64);
        fr.push(floor(&file, false, &offs)? * 1e9 / n as f64);
        dw.push(rig.run(T_OUT, &offs)? * 1e9 / n as f64);
        fw.push(floor(&file, true, &offs)? * 1e9 / n as f64);
    }
    drop(rig);
    let (dr, fr, dw, fw) = (median(&mut dr), median(&mut fr), median(&mut dw), median(&mut fw));
    println!(
        "virtio-blk per request: 4 KiB at random offsets of a {} MiB raw image (page cache), {n} requests x {rounds} rounds, medians",
        IMAGE >> 20
    );
    println!(
        "  device: QD {QD}, one worker, guest driver played on memfd guest RAM; floor: one thread, same offsets, same file"
    );
    println!("{:<8} {:>16} {:>16} {:>8}", "op", "k7d ns/req", "floor ns/req", "ratio");
    println!(
        "{:<8} {:>16.0} {:>16.0} {:>8.2}   (floor: pread)",
        "read",
        dr,
        fr,
        dr / fr
    );
    println!(
        "{:<8} {:>16.0} {:>16.0} {:>8.2}   (floor: pwrite)",
        "write",
        dw,
        fw,
        dw / fw
    );
    println!("goal: ratio <= 2.0");
    Ok(())
}

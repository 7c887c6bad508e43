//! Copy-on-write disks for `k7d fork`: [`DiskImage::fork`] and
//! [`Block::fork_disk`]. Through the real device and its worker (memfd guest
//! memory, virtio-queue's mock driver rings, as in `block.rs`), and on the
//! `DiskImage` + `DiskAt` level for the cluster edge cases.

mod common;

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k7d_devices::pci::{MsixVectors, NoopMsiRouter};
use k7d_devices::virtio::block::{
    Block, BlockError, CLUSTER_SIZE, DeviceMemory, DiskAt, DiskBudget, DiskImage, features, status,
};
use k7d_devices::virtio::{
    ActivateContext, ActiveQueue, GuestMemoryTracked, Interrupt, InterruptStatus, VIRTIO_F_VERSION_1, VirtioDevice,
    VirtioError,
};
use virtio_bindings::virtio_blk as b;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const CS: u64 = CLUSTER_SIZE;

// ---------------------------------------------------------------------------
// Files: one directory per test, so its listing and the fds pointing into it
// belong to that test alone.

struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "k7d-cow-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&p).unwrap();
        Self(p)
    }

    fn image(&self, name: &str, contents: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, contents).unwrap();
        p
    }

    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Open descriptors of this process on unlinked files of this directory
    /// (an `O_TMPFILE` shows as `<dir>/#<ino> (deleted)`).
    fn overlay_fds(&self) -> usize {
        let prefix = format!("{}/", self.0.display());
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .map(|t| t.to_string_lossy().into_owned())
            .filter(|t| t.starts_with(&prefix) && t.ends_with(" (deleted)"))
            .count()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add((i / 512) as u8) ^ seed)
        .collect()
}

/// A small deterministic PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------
// DiskImage + DiskAt on plain guest memory (with a dirty bitmap).

type Mem = GuestMemoryMmap<AtomicBitmap>;
const STAGE: u64 = 0x10_0000;

fn plain_memory() -> Mem {
    Mem::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap()
}

fn dwrite(disk: &DiskImage, mem: &Mem, offset: u64, data: &[u8]) {
    mem.write_slice(data, GuestAddress(STAGE)).unwrap();
    mem.write_all_volatile_to(GuestAddress(STAGE), &mut DiskAt { disk, offset }, data.len())
        .unwrap();
}

fn dread(disk: &DiskImage, mem: &Mem, offset: u64, len: usize) -> Vec<u8> {
    let mut at = DiskAt { disk, offset };
    mem.read_exact_volatile_from(GuestAddress(STAGE), &mut at, len).unwrap();
    assert_eq!(at.offset, offset + len as u64, "DiskAt advanced by what it read");
    let mut out = vec![0u8; len];
    mem.read_slice(&mut out, GuestAddress(STAGE)).unwrap();
    out
}

fn read_all(disk: &DiskImage, mem: &Mem) -> Vec<u8> {
    dread(disk, mem, 0, (disk.sectors() * 512) as usize)
}

#[test]
fn partial_cluster_writes_read_back_on_both_sides() {
    let dir = TestDir::new("partial");
    let orig = pattern(16 * CS as usize, 0);
    let path = dir.image("disk.img", &orig);
    let src = DiskImage::open(&path, false).unwrap();
    let mem = plain_memory();
    let child = src.fork().unwrap();
    assert!(src.is_frozen() && child.is_frozen());
    assert_eq!((src.overlay_bytes(), child.overlay_bytes()), (0, 0));

    let mut want_src = orig.clone();
    let mut want_child = orig.clone();
    let put = |disk: &DiskImage, model: &mut Vec<u8>, off: u64, data: &[u8]| {
        dwrite(disk, &mem, off, data);
        model[off as usize..off as usize + data.len()].copy_from_slice(data);
    };
    // One 512-byte sector inside cluster 1 (read-modify-write of an absent cluster).
    put(&src, &mut want_src, CS + 1024, &[0x11; 512]);
    // Again in the same, now present, cluster.
    put(&src, &mut want_src, CS + 3072, &[0x12; 512]);
    // Spanning clusters 2..5: partial head, two whole clusters, partial tail.
    put(
        &src,
        &mut want_src,
        3 * CS - 1536,
        &pattern(2 * CS as usize + 2048, 0x33),
    );
    // Exactly one whole cluster.
    put(&src, &mut want_src, 8 * CS, &[0x44; CS as usize]);
    // The last sector of the disk.
    put(&src, &mut want_src, 16 * CS - 512, &[0x55; 512]);
    // The child writes different sectors of the same clusters.
    put(&child, &mut want_child, CS, &[0xa1; 512]);
    put(&child, &mut want_child, 4 * CS + 512, &pattern(CS as usize, 0xa2));

    assert_eq!(read_all(&src, &mem), want_src);
    assert_eq!(read_all(&child, &mem), want_child);
    // Unaligned reads across present and absent clusters.
    for (off, len) in [
        (CS - 512, 1024usize),
        (2 * CS + 512, 3 * CS as usize),
        (7 * CS + 512, 2 * CS as usize),
    ] {
        assert_eq!(dread(&src, &mem, off, len), want_src[off as usize..off as usize + len]);
        assert_eq!(
            dread(&child, &mem, off, len),
            want_child[off as usize..off as usize + len]
        );
    }
    // Touched clusters: src 1, 2, 3, 4, 5, 8, 15; child 1, 4, 5.
    assert_eq!(src.overlay_bytes(), 7 * CS);
    assert_eq!(child.overlay_bytes(), 3 * CS);
    assert_eq!(std::fs::read(&path).unwrap(), orig, "the frozen base is never written");
}

#[test]
fn the_children_s_overlays_stay_within_their_source_s_disk_budget() {
    let dir = TestDir::new("budget");
    let path = dir.image("disk.img", &pattern(64 * CS as usize, 0));
    let src = DiskImage::open(&path, false).unwrap();
    let budget = std::sync::Arc::new(DiskBudget::new(10 * CS));
    src.set_children_budget(budget.clone());
    let mem = plain_memory();
    let write = |disk: &DiskImage, off: u64, len: usize| {
        mem.write_slice(&vec![0x77; len], GuestAddress(STAGE)).unwrap();
        mem.write_all_volatile_to(GuestAddress(STAGE), &mut DiskAt { disk, offset: off }, len)
    };
    let a = src.fork().unwrap();
    let b = src.fork().unwrap();
    // The source's own writes are not its children's.
    write(&src, 0, 20 * CS as usize).unwrap();
    assert_eq!(budget.used(), 0);
    // a takes 6 clusters (a partial write takes its whole cluster), b 3.
    write(&a, 0, 5 * CS as usize + 512).unwrap();
    write(&b, 40 * CS, 3 * CS as usize).unwrap();
    assert_eq!(budget.used(), 9 * CS);
    // Rewriting present clusters costs nothing; 2 new ones do not fit.
    write(&a, 0, 6 * CS as usize).unwrap();
    let e = write(&b, 50 * CS, 2 * CS as usize).unwrap_err();
    assert!(e.to_string().contains("No space left on device"), "{e}");
    assert_eq!(budget.used(), 9 * CS, "a refused write charges nothing");
    assert_ne!(
        dread(&b, &mem, 50 * CS, 16),
        vec![0x77; 16],
        "a refused write wrote nothing"
    );
    write(&b, 50 * CS, CS as usize).unwrap();
    assert_eq!(budget.used(), 10 * CS);
    // A fork copies the source's 20 clusters into its child's overlay:
    // refused with a sentence, and nothing is left of it.
    let e = src.fork().unwrap_err().to_string();
    assert!(e.contains("budget allows"), "{e}");
    assert_eq!(budget.used(), 10 * CS);
    // Through the device, the fork path's seam: a refusal (the daemon
    // answers `conflict`), not a device fault.
    let mut dev = Block::new(src, "budget").unwrap();
    match dev.fork_backend() {
        Err(VirtioError::OverBudget(m)) => assert!(m.contains("budget allows"), "{m}"),
        Err(other) => panic!("over its budget, the blk device failed another way: {other}"),
        Ok(_) => panic!("the blk device forked past its budget"),
    }
    assert_eq!(budget.used(), 10 * CS);
    // A child that goes gives its clusters back.
    drop(a);
    assert_eq!(budget.used(), 4 * CS);
    drop(b);
    assert_eq!(budget.used(), 0);
    assert_eq!(dir.overlay_fds(), 1, "only the source's own overlay is left");
}

#[test]
fn discard_and_write_zeroes_after_fork_read_zero_and_leave_base_alone() {
    let dir = TestDir::new("zeroes");
    let orig = pattern(32 * CS as usize, 9);
    let path = dir.image("disk.img", &orig);
    let src = DiskImage::open(&path, false).unwrap();
    let mem = plain_memory();
    let child = src.fork().unwrap();
    let mut want_src = orig.clone();
    let mut want_child = orig.clone();
    let zero = |model: &mut Vec<u8>, off: u64, len: u64| model[off as usize..(off + len) as usize].fill(0);

    // Child: DISCARD with a partial head, whole clusters and a partial tail.
    let (off, len) = (2 * CS + 1536, 5 * CS);
    child.discard(off, len).unwrap();
    zero(&mut want_child, off, len);
    // Child: write into a cluster, then zero part of it (present cluster).
    dwrite(&child, &mem, 12 * CS, &[0x77; CS as usize]);
    want_child[12 * CS as usize..13 * CS as usize].fill(0x77);
    child.write_zeroes(12 * CS + 512, 1024, false).unwrap();
    zero(&mut want_child, 12 * CS + 512, 1024);
    // Source: WRITE_ZEROES without unmap (ZERO_RANGE), and with unmap, over
    // partial clusters and the end of the disk.
    src.write_zeroes(20 * CS - 512, CS + 1024, false).unwrap();
    zero(&mut want_src, 20 * CS - 512, CS + 1024);
    src.write_zeroes(30 * CS + 512, 2 * CS - 512, true).unwrap();
    zero(&mut want_src, 30 * CS + 512, 2 * CS - 512);
    // A single sector in an absent cluster.
    src.discard(5 * CS, 512).unwrap();
    zero(&mut want_src, 5 * CS, 512);

    assert_eq!(read_all(&src, &mem), want_src);
    assert_eq!(read_all(&child, &mem), want_child);
    src.flush().unwrap();
    child.flush().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), orig, "the frozen base is never written");
    // Out of range is refused, not written past the image.
    assert!(src.discard(31 * CS, 2 * CS).is_err());
}

/// A fork whose child lives in another process (a VM process of its own,
/// issue 36): the overlay files come from the caller (`fork_into`), and the
/// child is rebuilt from parts (`from_parts`: the frozen base opened again
/// read-only, its overlay, the present clusters). The first fork freezes
/// the base with the given file; each child sees the source as of the fork
/// and nothing after; a second child's overlay is a copy made by the
/// caller (`copy_overlay`); a later fork of the frozen source needs no
/// file of its own; a grandchild of a rebuilt child is exact; bad runs and
/// an overlay of another length are refused; the base is never written.
#[test]
fn a_fork_handed_to_another_process_is_the_source_at_its_fork_instant() {
    use k7d_devices::virtio::block::{copy_overlay, overlay_file};
    let dir = TestDir::new("handed");
    let orig = pattern(16 * CS as usize, 9);
    let path = dir.image("disk.img", &orig);
    let src = DiskImage::open(&path, false).unwrap();
    let mem = plain_memory();
    let label = path.display().to_string();
    let base = || DiskImage::open_file(&path, true).unwrap();
    // Before any fork writes go to the image file.
    dwrite(&src, &mem, 0, &[1; 512]);
    let mut want = orig.clone();
    want[..512].fill(1);
    let orig = want.clone();

    // The first fork needs the source's own overlay file.
    let template = overlay_file(Some(dir.0.as_path())).unwrap();
    let refused = src.fork_into(None, &template).unwrap_err();
    assert!(
        std::error::Error::source(&refused).is_some_and(|c| c.to_string().contains("no file was given")),
        "{refused}"
    );
    assert!(!src.is_frozen(), "a refused first fork leaves the image as it was");
    let runs = src
        .fork_into(Some(overlay_file(Some(dir.0.as_path())).unwrap()), &template)
        .unwrap();
    assert!(src.is_frozen());
    assert!(runs.is_empty(), "nothing diverged since the base froze: {runs:?}");
    // The source moves on after the fork: partial and whole clusters.
    dwrite(&src, &mem, CS + 512, &[2; 1024]);
    dwrite(&src, &mem, 5 * CS, &[3; 2 * CS as usize]);
    let mut want_src = orig.clone();
    want_src[CS as usize + 512..CS as usize + 1536].fill(2);
    want_src[5 * CS as usize..7 * CS as usize].fill(3);
    let child = DiskImage::from_parts(base(), template, &runs, label.clone()).unwrap();
    assert_eq!(read_all(&child, &mem), orig, "the child: the source at the fork");
    assert_eq!(read_all(&src, &mem), want_src);

    // A second fork of the frozen source: no own file needed; its present
    // clusters go to the child, and a third child gets the caller's copy.
    let t2 = overlay_file(Some(dir.0.as_path())).unwrap();
    let runs2 = src.fork_into(None, &t2).unwrap();
    assert_eq!(runs2, vec![(1, 2), (5, 7)]);
    let t3 = overlay_file(None).unwrap();
    copy_overlay(&t2, &t3, 16 * CS, &runs2).unwrap();
    let second = DiskImage::from_parts(base(), t2, &runs2, label.clone()).unwrap();
    let third = DiskImage::from_parts(base(), t3, &runs2, label.clone()).unwrap();
    assert_eq!(second.overlay_bytes(), 3 * CS);
    dwrite(&second, &mem, 9 * CS, &[4; 512]);
    dwrite(&src, &mem, 9 * CS, &[5; 512]);
    let mut want_second = want_src.clone();
    want_second[9 * CS as usize..9 * CS as usize + 512].fill(4);
    assert_eq!(read_all(&second, &mem), want_second);
    assert_eq!(
        read_all(&third, &mem),
        want_src,
        "the copy: the source at the second fork"
    );
    want_src[9 * CS as usize..9 * CS as usize + 512].fill(5);
    assert_eq!(read_all(&src, &mem), want_src);

    // A grandchild of a rebuilt child (its base read-only: never written).
    let t4 = overlay_file(None).unwrap();
    let runs4 = second.fork_into(Some(overlay_file(None).unwrap()), &t4).unwrap();
    dwrite(&second, &mem, 0, &[6; 512]);
    let grand = DiskImage::from_parts(base(), t4, &runs4, label.clone()).unwrap();
    assert_eq!(read_all(&grand, &mem), want_second);

    // Bad parts are refused with a sentence.
    let bad = |runs: &[(u64, u64)], len: u64| {
        let f = overlay_file(None).unwrap();
        f.set_len(len).unwrap();
        DiskImage::from_parts(base(), f, runs, label.clone()).unwrap_err()
    };
    for (runs, why) in [
        (vec![(3, 3)], "out of order"),
        (vec![(4, 6), (2, 3)], "out of order"),
        (vec![(15, 17)], "past the image"),
        (vec![(u64::MAX - 1, u64::MAX)], "past the image"),
    ] {
        let e = bad(&runs, 16 * CS);
        let cause = std::error::Error::source(&e).map(|c| c.to_string()).unwrap_or_default();
        assert!(cause.contains(why), "{runs:?}: {e}: {cause}");
    }
    let e = bad(&[], 15 * CS);
    let cause = std::error::Error::source(&e).map(|c| c.to_string()).unwrap_or_default();
    assert!(cause.contains("the overlay is"), "{e}: {cause}");
    assert_eq!(std::fs::read(&path).unwrap(), orig, "the frozen base is never written");
}

#[test]
fn grandchild_sees_its_parent_at_its_fork_instant() {
    let dir = TestDir::new("grand");
    let orig = pattern(16 * CS as usize, 3);
    let path = dir.image("disk.img", &orig);
    let src = DiskImage::open(&path, false).unwrap();
    let mem = plain_memory();
    // Before any fork writes go to the image file itself.
    dwrite(&src, &mem, 0, &[1; 4096]);
    let child = src.fork().unwrap();
    dwrite(&child, &mem, CS + 512, &[2; 1024]); // partial: RMW in the child
    dwrite(&child, &mem, 4 * CS, &[3; 2 * CS as usize]);
    child.discard(10 * CS, CS).unwrap();
    let at_fork = read_all(&child, &mem);
    let grandchild = child.fork().unwrap();
    assert_eq!(grandchild.overlay_bytes(), child.overlay_bytes());
    assert_eq!(grandchild.overlay_bytes(), 4 * CS);
    // Everybody moves on.
    dwrite(&child, &mem, CS, &[4; 512]);
    dwrite(&child, &mem, 4 * CS, &[5; 512]);
    dwrite(&src, &mem, 4 * CS, &[6; 512]);
    dwrite(&grandchild, &mem, 14 * CS, &[7; 512]);

    let mut want = at_fork.clone();
    want[14 * CS as usize..14 * CS as usize + 512].fill(7);
    assert_eq!(
        read_all(&grandchild, &mem),
        want,
        "the grandchild: its parent at its fork, plus its own"
    );
    let mut want_child = at_fork;
    want_child[CS as usize..CS as usize + 512].fill(4);
    want_child[4 * CS as usize..4 * CS as usize + 512].fill(5);
    assert_eq!(read_all(&child, &mem), want_child);
    let mut want_src = orig.clone();
    want_src[..4096].fill(1);
    want_src[4 * CS as usize..4 * CS as usize + 512].fill(6);
    assert_eq!(read_all(&src, &mem), want_src);
    // A second fork of the source copies the source's own divergence.
    let second = src.fork().unwrap();
    assert_eq!(second.overlay_bytes(), CS);
    assert_eq!(read_all(&second, &mem), want_src);
}

#[test]
fn random_io_across_forks_matches_a_model() {
    // Capacity not a multiple of the cluster size: a short last cluster.
    const LEN: usize = 16 * CS as usize + 3 * 512;
    let dir = TestDir::new("model");
    let mem = plain_memory();
    for seed in 1..=6u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let orig = pattern(LEN, seed as u8);
        let path = dir.image("disk.img", &orig);
        let mut disks: Vec<(DiskImage, Vec<u8>)> = vec![(DiskImage::open(&path, false).unwrap(), orig.clone())];
        let mut base_at_freeze: Option<Vec<u8>> = None;
        for step in 0..400 {
            let i = rng.below(disks.len() as u64) as usize;
            let sectors = (LEN / 512) as u64;
            let s = rng.below(sectors);
            let n = 1 + rng.below(24.min(sectors - s));
            let (off, len) = (s * 512, n * 512);
            let range = off as usize..(off + len) as usize;
            match rng.below(10) {
                0..=4 => {
                    let data = pattern(len as usize, rng.next() as u8);
                    dwrite(&disks[i].0, &mem, off, &data);
                    disks[i].1[range].copy_from_slice(&data);
                }
                5 => {
                    disks[i].0.discard(off, len).unwrap();
                    disks[i].1[range].fill(0);
                }
                6 => {
                    disks[i].0.write_zeroes(off, len, rng.below(2) == 0).unwrap();
                    disks[i].1[range].fill(0);
                }
                7 => {
                    let got = dread(&disks[i].0, &mem, off, len as usize);
                    assert_eq!(got, disks[i].1[range], "seed {seed} step {step}: read of disk {i}");
                }
                8 if disks.len() < 5 => {
                    if base_at_freeze.is_none() {
                        base_at_freeze = Some(std::fs::read(&path).unwrap());
                    }
                    let child = disks[i].0.fork().unwrap();
                    let model = disks[i].1.clone();
                    disks.push((child, model));
                }
                _ if disks.len() > 1 => {
                    disks.swap_remove(i);
                }
                _ => {}
            }
        }
        for (i, (disk, model)) in disks.iter().enumerate() {
            assert_eq!(&read_all(disk, &mem), model, "seed {seed}: final contents of disk {i}");
        }
        if let Some(base) = base_at_freeze {
            assert_eq!(std::fs::read(&path).unwrap(), base, "seed {seed}: base frozen");
        }
        drop(disks);
        assert_eq!(dir.overlay_fds(), 0);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn reads_through_an_overlay_mark_every_guest_page_they_write() {
    let dir = TestDir::new("dirty");
    let path = dir.image("disk.img", &pattern(8 * CS as usize, 5));
    let src = DiskImage::open(&path, false).unwrap();
    let _child = src.fork().unwrap();
    let mem = plain_memory();
    // Cluster 2 present in the overlay, 1 and 3 only in the base.
    dwrite(&src, &mem, 2 * CS, &[9; CS as usize]);
    let bitmap = (**mem.iter().next().unwrap()).bitmap();
    bitmap.reset();
    // 3 clusters less 1 KiB, from the middle of cluster 1, to guest 0x20_0200:
    // guest pages 0x200..=0x202 receive data, 0x1ff and 0x203 do not.
    let len = 3 * CS as usize - 1024;
    mem.read_exact_volatile_from(
        GuestAddress(0x20_0200),
        &mut DiskAt {
            disk: &src,
            offset: CS + 512,
        },
        len,
    )
    .unwrap();
    let dirty: Vec<u64> = (0x1feu64..0x205)
        .filter(|p| bitmap.is_addr_set((p * 4096) as usize))
        .collect();
    assert_eq!(dirty, vec![0x200, 0x201, 0x202]);
    let mut got = vec![0u8; len];
    mem.read_slice(&mut got, GuestAddress(0x20_0200)).unwrap();
    let mut want = pattern(8 * CS as usize, 5)[(CS + 512) as usize..(CS + 512) as usize + len].to_vec();
    want[(CS - 512) as usize..(2 * CS - 512) as usize].fill(9);
    assert_eq!(got, want);
}

#[test]
fn fork_cost_follows_divergence_not_disk_size() {
    const DISK: u64 = 4 << 30;
    const MIB: u64 = 1 << 20;
    let dir = TestDir::new("cost");
    let path = dir.0.join("big.img");
    File::create(&path).unwrap().set_len(DISK).unwrap();
    let src = DiskImage::open(&path, false).unwrap();
    let mem = plain_memory();

    let t = Instant::now();
    let first = src.fork().unwrap();
    let first_took = t.elapsed();
    assert_eq!(first.overlay_bytes(), 0);
    let alloc = |d: &DiskImage| d.overlay_file().unwrap().metadata().unwrap().blocks() * 512;
    assert_eq!(alloc(&first), 0, "an empty overlay allocates nothing");
    assert_eq!(first.overlay_file().unwrap().metadata().unwrap().len(), DISK);

    // 1 MiB of divergence, not cluster aligned: 257 clusters.
    let at = 3 * (DISK / 4) + 512;
    let data = pattern(MIB as usize, 0x5a);
    dwrite(&src, &mem, at, &data);
    assert_eq!(src.overlay_bytes(), MIB + CS);

    let t = Instant::now();
    let second = src.fork().unwrap();
    let second_took = t.elapsed();
    eprintln!(
        "fork of a 4 GiB image: first (freeze, empty overlays) {first_took:?}; \
         with 1 MiB diverged {second_took:?}"
    );
    assert_eq!(second.overlay_bytes(), MIB + CS);
    let allocated = alloc(&second);
    eprintln!(
        "child overlay: {} bytes held, {allocated} bytes allocated",
        second.overlay_bytes()
    );
    assert!(allocated <= 2 * MIB, "the child overlay allocated {allocated} bytes");
    assert_eq!(dread(&second, &mem, at, MIB as usize), data);
    assert_eq!(dread(&second, &mem, at - 512, 512), vec![0; 512]);
    assert_eq!(
        dread(&first, &mem, at, 4096),
        vec![0; 4096],
        "the first child forked before the write"
    );
    assert_eq!(
        std::fs::metadata(&path).unwrap().blocks(),
        0,
        "the sparse base was never written"
    );
}

#[test]
fn dropping_forks_leaves_nothing_behind() {
    let dir = TestDir::new("leftovers");
    let path = dir.image("disk.img", &pattern(8 * CS as usize, 1));
    let ro_path = dir.image("ro.img", &pattern(4 * CS as usize, 2));
    let before = dir.entries();
    let mem = plain_memory();
    let src = DiskImage::open(&path, false).unwrap();
    let ro = DiskImage::open(&ro_path, true).unwrap();
    assert_eq!(dir.overlay_fds(), 0);
    let child = src.fork().unwrap();
    // The overlays live next to the image (same filesystem), unlinked.
    assert_eq!(dir.overlay_fds(), 2, "one overlay for the source, one for the child");
    dwrite(&child, &mem, 0, &[1; 8192]);
    let grandchild = child.fork().unwrap();
    let ro_child = ro.fork().unwrap();
    assert_eq!(dir.overlay_fds(), 3);
    assert_eq!(dir.entries(), before, "overlays have no name");
    drop(child);
    assert_eq!(dir.overlay_fds(), 2);
    drop(grandchild);
    drop(ro_child);
    assert_eq!(dir.overlay_fds(), 1, "the source keeps its own");
    drop(src);
    drop(ro);
    assert_eq!(dir.overlay_fds(), 0);
    assert_eq!(dir.entries(), before);
}

#[test]
fn overlays_of_an_unnamed_image_go_to_the_temp_dir() {
    // A memfd has no directory: the overlay falls back to temp_dir().
    // SAFETY: memfd_create with a NUL-terminated name; the fd is owned below.
    let fd = unsafe { libc::memfd_create(c"k7d-cow-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(4 * CS).unwrap();
    let src = DiskImage::from_file(file, false, "memfd".into()).unwrap();
    let mem = plain_memory();
    dwrite(&src, &mem, 0, &[8; 512]);
    let child = src.fork().unwrap();
    dwrite(&src, &mem, 0, &[9; 512]);
    assert_eq!(dread(&child, &mem, 0, 512), vec![8; 512]);
    assert_eq!(dread(&src, &mem, 0, 512), vec![9; 512]);
    assert!(child.overlay_file().is_some());
}

// ---------------------------------------------------------------------------
// Through the device: a Block per VM, each with its own guest memory and
// worker thread.

const MEM_SIZE: usize = 16 << 20;
const QUEUE_BASE: u64 = 0x1_0000;
const AVAIL: u64 = QUEUE_BASE + 16 * QSIZE as u64;
const USED_RING: u64 = 0x1_1000;
const HDRS: u64 = 0x2_0000;
const STATUS: u64 = 0x3_0000;
const DATA: u64 = 0x10_0000;
const QSIZE: u16 = 64;
const W: u16 = VRING_DESC_F_WRITE as u16;
const QUEUE_VECTOR: u16 = 1;
const FEATURES: u64 = VIRTIO_F_VERSION_1
    | features::FLUSH
    | features::SEG_MAX
    | features::BLK_SIZE
    | features::DISCARD
    | features::WRITE_ZEROES;

fn memfd_memory() -> Arc<GuestMemoryTracked> {
    common::memfd_memory(MEM_SIZE, c"k7d-cow-guest")
}

/// One VM's blk device. Fields drop in order: the device (and its worker)
/// before the memory view before the guest memory.
struct Vm {
    dev: Block,
    dev_mem: DeviceMemory,
    _msix: Arc<MsixVectors>,
    notify: EventFd,
    mem: Arc<GuestMemoryTracked>,
    posted: u16,
}

impl Vm {
    fn new(disk: DiskImage) -> Self {
        let mem = memfd_memory();
        // SAFETY: `mem` is held by this Vm and dropped after `dev_mem` and
        // `dev` (field order), so the mapping outlives the view.
        let dev_mem = unsafe { DeviceMemory::new(&mem).unwrap() };
        let msix = Arc::new(MsixVectors::new(2, Arc::new(NoopMsiRouter)).unwrap());
        msix.set_control(true, false);
        msix.write_table(u64::from(QUEUE_VECTOR) * 16 + 12, &0u32.to_le_bytes());
        let mut vm = Self {
            dev: Block::new(disk, "k7d-cow").unwrap(),
            dev_mem,
            _msix: msix.clone(),
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
            mem,
            posted: 0,
        };
        let mq = MockSplitQueue::create(&*vm.mem, GuestAddress(QUEUE_BASE), QSIZE);
        assert_eq!(mq.avail_addr(), GuestAddress(AVAIL));
        let mut q: Queue = mq.create_queue().unwrap();
        q.set_used_ring_address(Some(USED_RING as u32), Some(0));
        let ro = vm.dev.avail_features() & features::RO;
        let ctx = ActivateContext {
            mem: vm.dev_mem.handle(),
            acked_features: (FEATURES | ro) & vm.dev.avail_features(),
            queues: vec![ActiveQueue {
                index: 0,
                queue: q,
                notify: vm.notify.try_clone().unwrap(),
            }],
            interrupt: Interrupt::new(msix, vec![QUEUE_VECTOR], 0, Arc::new(InterruptStatus::default())),
        };
        vm.dev.activate(ctx).unwrap();
        vm
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED_RING + 2)).unwrap()
    }

    /// Posts one request (header, optional data, status) as the driver
    /// would, kicks, waits for it and returns its status. Each request waits
    /// for the previous one, so descriptors 0.. are reused.
    fn request(&mut self, t: u32, sector: u64, data: Option<(u32, bool)>) -> u8 {
        let m = &self.mem;
        m.write_obj(t, GuestAddress(HDRS)).unwrap();
        m.write_obj(0u32, GuestAddress(HDRS + 4)).unwrap();
        m.write_obj(sector, GuestAddress(HDRS + 8)).unwrap();
        m.write_obj(0xeeu8, GuestAddress(STATUS)).unwrap();
        let mut descs = vec![(HDRS, 16u32, 0u16)];
        if let Some((len, device_writes)) = data {
            descs.push((DATA, len, if device_writes { W } else { 0 }));
        }
        descs.push((STATUS, 1, W));
        let n = descs.len();
        for (i, (addr, len, flags)) in descs.into_iter().enumerate() {
            let (flags, next) = if i + 1 < n {
                (flags | VRING_DESC_F_NEXT as u16, i as u16 + 1)
            } else {
                (flags, 0)
            };
            let at = QUEUE_BASE + 16 * i as u64;
            m.write_obj(addr, GuestAddress(at)).unwrap();
            m.write_obj(len, GuestAddress(at + 8)).unwrap();
            m.write_obj(flags, GuestAddress(at + 12)).unwrap();
            m.write_obj(next, GuestAddress(at + 14)).unwrap();
        }
        // (MockSplitQueue::create would reset the ring indexes: post by hand.)
        let idx: u16 = m.read_obj(GuestAddress(AVAIL + 2)).unwrap();
        m.write_obj(0u16, GuestAddress(AVAIL + 4 + 2 * u64::from(idx % QSIZE)))
            .unwrap();
        m.store(idx.wrapping_add(1), GuestAddress(AVAIL + 2), Ordering::Release)
            .unwrap();
        self.posted = self.posted.wrapping_add(1);
        self.notify.write(1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.used_idx() != self.posted {
            assert!(
                Instant::now() < deadline,
                "request {t} at sector {sector} not completed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        self.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
        self.mem.write_slice(data, GuestAddress(DATA)).unwrap();
        self.request(b::VIRTIO_BLK_T_OUT, sector, Some((data.len() as u32, false)))
    }

    fn read(&mut self, sector: u64, len: usize) -> Vec<u8> {
        let st = self.request(b::VIRTIO_BLK_T_IN, sector, Some((len as u32, true)));
        assert_eq!(st, status::OK, "read of {len} bytes at sector {sector}");
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(DATA)).unwrap();
        out
    }

    /// DISCARD or WRITE_ZEROES of `sectors` from `sector` (one segment).
    fn zero(&mut self, t: u32, sector: u64, sectors: u32, unmap: bool) -> u8 {
        let mut seg = Vec::new();
        seg.extend_from_slice(&sector.to_le_bytes());
        seg.extend_from_slice(&sectors.to_le_bytes());
        seg.extend_from_slice(&u32::from(unmap).to_le_bytes());
        self.mem.write_slice(&seg, GuestAddress(DATA)).unwrap();
        self.request(t, 0, Some((16, false)))
    }

    fn flush(&mut self) -> u8 {
        self.request(b::VIRTIO_BLK_T_FLUSH, 0, None)
    }
}

fn splice(img: &mut [u8], sector: u64, data: &[u8]) {
    let at = (sector * 512) as usize;
    img[at..at + data.len()].copy_from_slice(data);
}

#[test]
fn device_fork_child_sees_the_fork_instant_and_the_two_diverge() {
    let dir = TestDir::new("device");
    let orig = pattern(64 * CS as usize, 0x21);
    let path = dir.image("root.img", &orig);
    let before = dir.entries();
    let mut src = Vm::new(DiskImage::open(&path, false).unwrap());

    // Before the fork: whole clusters and one lone sector, into the file itself.
    let a = pattern(8192, 0xa0);
    let a1 = [0xa1u8; 512];
    assert_eq!(src.write(8, &a), status::OK);
    assert_eq!(src.write(33, &a1), status::OK);
    let mut at_fork = orig.clone();
    splice(&mut at_fork, 8, &a);
    splice(&mut at_fork, 33, &a1);
    assert_eq!(std::fs::read(&path).unwrap(), at_fork, "unforked disks write the image");

    assert!(
        matches!(src.dev.fork_disk(), Err(BlockError::ForkWhileRunning(_))),
        "a running device is not forked"
    );
    src.dev.pause().unwrap();
    let child_disk = src.dev.fork_disk().unwrap();
    src.dev.resume().unwrap();
    assert!(child_disk.is_frozen());
    assert_eq!(dir.overlay_fds(), 2);

    // The source moves on: overwrites, a partial write into an untouched
    // cluster, a write spanning clusters, a discard, a write-zeroes, a flush.
    let b1 = pattern(8192, 0xb0);
    let b2 = [0xb2u8; 512];
    let b3 = pattern(3 * 4096, 0xb3);
    assert_eq!(src.write(8, &b1), status::OK);
    assert_eq!(src.write(41, &b2), status::OK);
    assert_eq!(src.write(60, &b3), status::OK);
    assert_eq!(src.zero(b::VIRTIO_BLK_T_DISCARD, 120, 20, false), status::OK);
    assert_eq!(src.zero(b::VIRTIO_BLK_T_WRITE_ZEROES, 200, 9, false), status::OK);
    assert_eq!(src.flush(), status::OK);
    let mut src_view = at_fork.clone();
    splice(&mut src_view, 8, &b1);
    splice(&mut src_view, 41, &b2);
    splice(&mut src_view, 60, &b3);
    splice(&mut src_view, 120, &[0; 20 * 512]);
    splice(&mut src_view, 200, &[0; 9 * 512]);

    // The child VM, on the child disk: the disk as it was at the fork.
    let mut child = Vm::new(child_disk);
    assert_eq!(child.read(0, 128 * 1024), at_fork[..128 * 1024]);
    assert_eq!(child.read(256, 128 * 1024), at_fork[128 * 1024..]);
    // Its own writes (partial and whole clusters) it sees, the source does not.
    let c1 = pattern(4096 + 1024, 0xc1);
    assert_eq!(child.write(99, &c1), status::OK);
    assert_eq!(child.write(33, &[0xc2; 512]), status::OK);
    assert_eq!(child.flush(), status::OK);
    let mut child_view = at_fork.clone();
    splice(&mut child_view, 99, &c1);
    splice(&mut child_view, 33, &[0xc2; 512]);
    assert_eq!(child.read(0, 128 * 1024), child_view[..128 * 1024]);

    assert_eq!(src.read(0, 128 * 1024), src_view[..128 * 1024]);
    assert_eq!(src.read(256, 128 * 1024), src_view[128 * 1024..]);
    assert_eq!(std::fs::read(&path).unwrap(), at_fork, "the base froze at the fork");

    // A second fork of the running source (paused for it) copies only what
    // the source changed since the base froze.
    src.dev.pause().unwrap();
    let second = src.dev.fork_disk().unwrap();
    src.dev.resume().unwrap();
    assert!(
        second.overlay_bytes() <= 16 * CS,
        "{} bytes copied",
        second.overlay_bytes()
    );
    let mut second = Vm::new(second);
    assert_eq!(second.read(0, 128 * 1024), src_view[..128 * 1024]);
    assert_eq!(second.read(256, 128 * 1024), src_view[128 * 1024..]);

    drop(child);
    drop(second);
    assert_eq!(dir.overlay_fds(), 1, "only the source's overlay is left");
    drop(src);
    assert_eq!(dir.overlay_fds(), 0);
    assert_eq!(dir.entries(), before, "nothing left in the image's directory");
    assert_eq!(std::fs::read(&path).unwrap(), at_fork);
}

#[test]
fn read_only_image_forks_by_sharing_and_still_refuses_writes() {
    let dir = TestDir::new("ro");
    let img = pattern(16 * CS as usize, 0x42);
    let path = dir.image("rootfs.erofs", &img);
    let mut src = Vm::new(DiskImage::open(&path, true).unwrap());
    src.dev.pause().unwrap();
    let child_disk = src.dev.fork_disk().unwrap();
    src.dev.resume().unwrap();
    assert!(child_disk.read_only());
    assert!(!child_disk.is_frozen() && child_disk.overlay_file().is_none());
    assert_eq!(child_disk.overlay_bytes(), 0);
    assert_eq!(dir.overlay_fds(), 0, "no overlay for a read-only image");

    let mut child = Vm::new(child_disk);
    assert_ne!(child.dev.avail_features() & features::RO, 0);
    assert_eq!(child.write(0, &[1; 512]), status::IOERR);
    assert_eq!(src.write(0, &[1; 512]), status::IOERR);
    assert_eq!(child.read(0, 64 * 1024), img[..64 * 1024]);
    assert_eq!(src.read(0, 64 * 1024), img[..64 * 1024]);
    assert_eq!(std::fs::read(&path).unwrap(), img);
}

//! The backing image: a raw file, read-write or read-only, and the
//! copy-on-write overlay a fork puts in front of a writable one.
//!
//! # Copy-on-write overlay
//!
//! [`DiskImage::fork`] gives a child VM its own view of the disk as of the
//! fork instant without copying the disk. The first fork of a writable image
//! **freezes** its base file: from then on neither the source nor any child
//! writes it. Each of them writes an [`Overlay`] instead: an unlinked
//! temporary file (`O_TMPFILE` in the image's directory, else in
//! `std::env::temp_dir()`), sparse and as long as the image, plus a map of
//! the [`CLUSTER_SIZE`] clusters it holds.
//!
//! - A read takes each run of clusters from the overlay when they are
//!   present there, else from the base, straight into guest RAM.
//! - A write goes to the overlay. A cluster that is neither present nor
//!   completely overwritten is first read from the base and merged
//!   (read-modify-write through a one-cluster bounce buffer).
//! - DISCARD and WRITE_ZEROES zero (punch) the range in the overlay, and
//!   mark it present, so it reads as zeros; the base is untouched.
//! - A later fork copies the parent's present clusters into the child's new
//!   overlay (`copy_file_range`, holes skipped): the cost follows what the
//!   parent changed since the base froze, not the disk size.
//!
//! Dropping a [`DiskImage`] closes its overlay, which frees it: nothing is
//! left on disk. Read-only images are shared by forks as they are.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use k7d_sys::file::{Fallocate, Lock, copy_file_range, fallocate, flock, next_data};
use tracing::{info, warn};
use vm_memory::VolatileMemoryError;
use vm_memory::VolatileSlice;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, WriteVolatile};

use crate::{DiskError, SECTOR_SHIFT, SECTOR_SIZE};

/// Granularity of the copy-on-write overlay: the unit it copies from the
/// base on a partial write and tracks as present.
pub const CLUSTER_SIZE: u64 = 4096;

/// Clusters per word of [`ClusterMap`].
const WORD_BITS: u64 = u64::BITS as u64;

/// Bytes moved per `read`/`write` when `copy_file_range` is unavailable.
const COPY_CHUNK: usize = 256 * 1024;

/// What the copy-on-write overlays of one fork source's children may hold
/// together (`fork.max_children_disk_mib`): each new cluster a child's
/// overlay takes, by a write or by the copy a fork makes, is charged here
/// first, and a write that would pass the cap fails with `ENOSPC` (the
/// guest's request completes with an I/O error, as on a full thin pool);
/// a child's overlay gives its clusters back when it goes.
#[derive(Debug)]
pub struct DiskBudget {
    cap: u64,
    used: std::sync::atomic::AtomicU64,
}

impl DiskBudget {
    /// A budget of `cap` bytes.
    pub fn new(cap: u64) -> Self {
        Self {
            cap,
            used: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Bytes the children's overlays hold now.
    pub fn used(&self) -> u64 {
        self.used.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The cap in bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    fn charge(&self, bytes: u64) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        self.used
            .fetch_update(SeqCst, SeqCst, |u| u.checked_add(bytes).filter(|n| *n <= self.cap))
            .map(drop)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::ENOSPC))
    }

    fn release(&self, bytes: u64) {
        use std::sync::atomic::Ordering::SeqCst;
        let _ = self
            .used
            .fetch_update(SeqCst, SeqCst, |u| Some(u.saturating_sub(bytes)));
    }
}

/// The label of an empty medium ([`DiskImage::empty`]).
pub const EMPTY_MEDIUM: &str = "(empty)";

/// A raw disk image, with the copy-on-write overlay a fork installs.
#[derive(Debug)]
pub struct DiskImage {
    file: File,
    read_only: bool,
    sectors: u64,
    path: String,
    /// Where overlays are created first (the image's directory), if known.
    overlay_dir: Option<PathBuf>,
    /// Set at most once, by the first [`DiskImage::fork`] of a writable
    /// image (or at birth for a fork child); the base is frozen from then on.
    overlay: OnceLock<Overlay>,
    /// What this image's fork children's overlays may hold together.
    children_budget: OnceLock<Arc<DiskBudget>>,
}

impl DiskImage {
    /// Opens `path`: `O_RDWR`, or `O_RDONLY` when `read_only` (the device then
    /// advertises `VIRTIO_BLK_F_RO` and fails writes with IOERR).
    pub fn open(path: impl AsRef<std::path::Path>, read_only: bool) -> Result<Self, DiskError> {
        let p = path.as_ref();
        let file = Self::open_file(p, read_only)?;
        let mut disk = Self::from_file(file, read_only, p.display().to_string())?;
        disk.overlay_dir = Some(match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        });
        Ok(disk)
    }

    /// The file [`DiskImage::open`] wraps, with its checks: what a daemon
    /// opens for a VM process, which wraps it with [`DiskImage::from_file`].
    pub fn open_file(p: &std::path::Path, read_only: bool) -> Result<File, DiskError> {
        let open_err = |source| DiskError::Open {
            path: p.display().to_string(),
            source,
        };
        // O_NONBLOCK: a FIFO in the image's place must not block the opener
        // (it is refused below); for regular files and block devices the
        // flag changes nothing.
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(p)
            .map_err(open_err)?;
        {
            use std::os::unix::fs::FileTypeExt;
            let ft = file.metadata().map_err(open_err)?.file_type();
            if !ft.is_file() && !ft.is_block_device() {
                return Err(open_err(std::io::Error::new(
                    ErrorKind::InvalidInput,
                    "it is neither a regular file nor a block device",
                )));
            }
        }
        // A base frozen by a fork holds a shared lock for as long as any of
        // its VMs lives; writing it would change every child's disk.
        if !read_only && flock(&file, Lock::Exclusive, false).is_err() {
            return Err(DiskError::FrozenBase(p.display().to_string()));
        }
        if !read_only {
            let _ = flock(&file, Lock::Unlock, false);
        }
        Ok(file)
    }

    /// Wraps an open file (tests, memfds). `read_only` must match how it was
    /// opened if writes are to fail in the device rather than in the kernel.
    /// When `path` names an existing file, a fork's overlays go to its
    /// directory first; otherwise (a label such as a memfd's) to
    /// `std::env::temp_dir()`.
    pub fn from_file(file: File, read_only: bool, path: String) -> Result<Self, DiskError> {
        let len = file.metadata().map_err(DiskError::Metadata)?.len();
        let sectors = len >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(DiskError::Empty);
        }
        if !len.is_multiple_of(SECTOR_SIZE) {
            warn!(
                path,
                len, "disk image length is not a multiple of 512; the tail is not visible"
            );
        }
        info!(path, sectors, read_only, "virtio-blk image opened");
        let p = Path::new(&path);
        let overlay_dir = if p.is_file() {
            p.parent().filter(|d| !d.as_os_str().is_empty()).map(Path::to_path_buf)
        } else {
            None
        };
        Ok(Self {
            file,
            read_only,
            sectors,
            path,
            overlay_dir,
            overlay: OnceLock::new(),
            children_budget: OnceLock::new(),
        })
    }

    /// An empty medium: no sector, read-only (the drive of a slot that
    /// waits for an image, as a CD drive without a disc). Reads and writes
    /// fail as out of range; a fork child shares it.
    pub fn empty() -> Result<Self, DiskError> {
        // SAFETY: memfd_create reads the NUL-terminated name and returns a
        // new descriptor or -1; nothing else is touched.
        let fd = unsafe { libc::memfd_create(c"k7d-empty-medium".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(DiskError::EmptyMedium(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Self {
            file,
            read_only: true,
            sectors: 0,
            path: EMPTY_MEDIUM.to_string(),
            overlay_dir: None,
            overlay: OnceLock::new(),
            children_budget: OnceLock::new(),
        })
    }

    /// Whether this is an empty medium ([`DiskImage::empty`]).
    pub fn is_empty_medium(&self) -> bool {
        self.sectors == 0
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// Capacity in bytes.
    fn len_bytes(&self) -> u64 {
        // `sectors` is the file length shifted right: this cannot overflow.
        self.sectors << SECTOR_SHIFT
    }

    /// Whether the image is read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The path it was opened from (for logs).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The base file. Once [`DiskImage::is_frozen`] it must not be written:
    /// other forks read it. I/O should go through [`DiskAt`], which knows
    /// about the overlay.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether the base file is frozen: a fork installed a copy-on-write
    /// overlay and every write now lands there.
    pub fn is_frozen(&self) -> bool {
        self.overlay.get().is_some()
    }

    /// Charges this image's fork children's overlays to `budget` (shared
    /// by the disks of one VM); set once, before the first fork.
    pub fn set_children_budget(&self, budget: Arc<DiskBudget>) {
        let _ = self.children_budget.set(budget);
    }

    /// What this image's fork children's overlays hold now, if it has a
    /// budget for them.
    pub fn children_budget_used(&self) -> Option<u64> {
        self.children_budget.get().map(|b| b.used())
    }

    /// Bytes the copy-on-write overlay holds (present clusters; 0 without
    /// an overlay). What the next fork of this image copies.
    pub fn overlay_bytes(&self) -> u64 {
        self.overlay.get().map_or(0, Overlay::bytes)
    }

    /// The overlay's (unlinked) file, if there is one: for tests and
    /// diagnostics (`fstat` for its allocation). Writing it corrupts the disk.
    pub fn overlay_file(&self) -> Option<&File> {
        self.overlay.get().map(|o| &o.file)
    }

    /// A copy-on-write child of this image as of now, for a forked VM.
    ///
    /// - Read-only image: the child shares the base file (a new descriptor
    ///   on it) and has no overlay.
    /// - Writable image, first fork: installs an empty overlay on `self`,
    ///   which freezes the base file (this image's later writes go to its
    ///   overlay), and gives the child the base plus an empty overlay of its
    ///   own.
    /// - Writable image with an overlay: the child gets the base and a new
    ///   overlay holding a copy of this image's present clusters. The cost is
    ///   proportional to those (the divergence since the base froze), not to
    ///   the disk size.
    ///
    /// The caller guarantees that no I/O runs on `self` meanwhile (the
    /// device is paused: `k7d_devices`' `Block::fork_disk`); a concurrent
    /// write would still be memory-safe, but the child might or might not
    /// see it. If this fails after freezing the base, `self` keeps its
    /// (empty) overlay and reads and writes exactly as before.
    pub fn fork(&self) -> Result<DiskImage, DiskError> {
        let started = std::time::Instant::now();
        let file = self.file.try_clone().map_err(|source| DiskError::ForkBase {
            path: self.path.clone(),
            source,
        })?;
        let overlay = if self.read_only {
            OnceLock::new()
        } else {
            let parent = self.own_overlay(|| tmpfile(self.overlay_dir.as_deref(), self.len_bytes()))?;
            OnceLock::from(parent.duplicate(
                self.overlay_dir.as_deref(),
                &self.path,
                self.children_budget.get().cloned(),
            )?)
        };
        let child = DiskImage {
            file,
            read_only: self.read_only,
            sectors: self.sectors,
            path: self.path.clone(),
            overlay_dir: self.overlay_dir.clone(),
            overlay,
            children_budget: OnceLock::new(),
        };
        info!(
            path = self.path,
            copied = child.overlay_bytes(),
            us = started.elapsed().as_micros() as u64,
            "virtio-blk disk forked"
        );
        Ok(child)
    }

    /// This writable image's overlay, installed from `make` if it has none
    /// yet: the first fork freezes the base.
    fn own_overlay(&self, make: impl FnOnce() -> std::io::Result<File>) -> Result<&Overlay, DiskError> {
        if let Some(o) = self.overlay.get() {
            return Ok(o);
        }
        let own = make()
            .map(|file| Overlay::over(file, self.len_bytes()))
            .map_err(|source| DiskError::Overlay {
                path: self.path.clone(),
                source,
            })?;
        // Under the caller's guarantee nobody else installs one; if
        // somebody did, theirs wins and `own` is dropped.
        let installed = self.overlay.get_or_init(|| own);
        // Frozen: a shared lock (held by this open file, which every
        // child's descriptor shares) makes a read-write `open` of the base
        // fail until the last VM is gone.
        if flock(&self.file, Lock::Shared, false).is_err() {
            warn!(
                path = self.path,
                "could not lock the frozen base image; a read-write open elsewhere is not refused"
            );
        }
        info!(
            path = self.path,
            "virtio-blk base image frozen; writes go to an overlay"
        );
        Ok(installed)
    }

    /// Makes this frozen image's base read-only in this process: `base`,
    /// the same file opened again read-only by whoever may open files (a VM
    /// process's daemon), takes the place of the descriptor the image was
    /// opened with (`dup3` onto its number, so every reader keeps its
    /// handle), share-locked first as a frozen base is. From then on this
    /// process holds nothing that writes the base its fork children read.
    /// Refused, with nothing changed, unless the base is frozen and `base`
    /// is read-only and the same file (device and inode); nothing to do
    /// when the base is read-only already.
    pub fn make_base_read_only(&self, base: File) -> Result<(), DiskError> {
        use std::os::unix::fs::MetadataExt;
        let fail = |source: std::io::Error| DiskError::ReadOnlyBase {
            path: self.path.clone(),
            source,
        };
        let refuse = |why: &str| fail(std::io::Error::new(ErrorKind::InvalidInput, why.to_string()));
        if self.overlay.get().is_none() {
            return Err(refuse("its base is not frozen (it has no overlay)"));
        }
        if k7d_sys::fd::is_read_only(&self.file).map_err(fail)? {
            return Ok(());
        }
        if !k7d_sys::fd::is_read_only(&base).map_err(fail)? {
            return Err(refuse("the file given for it is writable"));
        }
        let (ours, given) = (
            self.file.metadata().map_err(DiskError::Metadata)?,
            base.metadata().map_err(DiskError::Metadata)?,
        );
        if (ours.dev(), ours.ino()) != (given.dev(), given.ino()) {
            return Err(refuse("the file given for it is another file (replaced since)"));
        }
        if flock(&base, Lock::Shared, false).is_err() {
            warn!(
                path = self.path,
                "could not lock the frozen base image again; a read-write open elsewhere is not refused"
            );
        }
        k7d_sys::fd::dup_over(&base, &self.file).map_err(fail)
    }

    /// [`DiskImage::fork`] for a child built in another process (a VM
    /// process of its own), with the overlay files made by the caller (a
    /// VM process creates no file): `own` becomes this image's overlay if it
    /// has none yet (the first fork freezes the base; `None` then refuses),
    /// and `child`, emptied to the image's length, gets a copy of this
    /// image's present clusters. Returns them as `[first, end)` runs of
    /// [`CLUSTER_SIZE`] clusters: what [`DiskImage::from_parts`] takes with
    /// `child`. Not charged to a children's budget (the child's overlay is
    /// another process's). Same guarantee as [`DiskImage::fork`]: no I/O on
    /// `self` meanwhile.
    pub fn fork_into(&self, own: Option<File>, child: &File) -> Result<Vec<(u64, u64)>, DiskError> {
        let fail = |source| DiskError::Overlay {
            path: self.path.clone(),
            source,
        };
        if self.read_only {
            return Err(fail(std::io::Error::new(
                ErrorKind::InvalidInput,
                "a read-only image is shared, not given an overlay",
            )));
        }
        let len = self.len_bytes();
        let parent = self.own_overlay(|| {
            let f =
                own.ok_or_else(|| std::io::Error::new(ErrorKind::InvalidInput, "no file was given for its overlay"))?;
            f.set_len(len)?;
            Ok(f)
        })?;
        let runs = parent.map().runs();
        copy_overlay(&parent.file, child, parent.len, &runs).map_err(|source| DiskError::OverlayCopy {
            path: self.path.clone(),
            source,
        })?;
        Ok(runs)
    }

    /// A fork child's disk from the parts [`DiskImage::fork_into`] made,
    /// handed to its process: the frozen `base` (read-only is enough: it is
    /// never written), its own `overlay` and the overlay's present clusters
    /// (`runs`, checked: a run past the image, out of order or overlapping
    /// is refused, as is an overlay whose length is not the image's).
    pub fn from_parts(base: File, overlay: File, runs: &[(u64, u64)], path: String) -> Result<Self, DiskError> {
        let mut disk = Self::from_file(base, false, path)?;
        let len = disk.len_bytes();
        let bad = |why: String| DiskError::Overlay {
            path: disk.path.clone(),
            source: std::io::Error::new(ErrorKind::InvalidData, why),
        };
        let have = overlay.metadata().map_err(DiskError::Metadata)?.len();
        if have != len {
            return Err(bad(format!("the overlay is {have} bytes long, the image {len}")));
        }
        let clusters = len.div_ceil(CLUSTER_SIZE);
        let mut map = ClusterMap::default();
        let mut last = 0u64;
        for &(first, end) in runs {
            if first < last || end <= first || end > clusters {
                return Err(bad(format!(
                    "the run of clusters [{first}, {end}) is out of order or past the image's {clusters}"
                )));
            }
            map.mark(first, end);
            last = end;
        }
        disk.overlay_dir = None;
        disk.overlay = OnceLock::from(Overlay {
            file: overlay,
            len,
            map: Mutex::new(map),
            budget: None,
        });
        Ok(disk)
    }

    /// Makes written data durable (`fdatasync` of the overlay when there is
    /// one, else of the image).
    pub fn flush(&self) -> std::io::Result<()> {
        match self.overlay.get() {
            Some(o) => o.file.sync_data(),
            None => self.file.sync_data(),
        }
    }

    /// Deallocates `[offset, offset + len)` (`FALLOC_FL_PUNCH_HOLE`). Discard
    /// is advisory: a filesystem without hole punching makes it a no-op.
    /// With an overlay the range is zeroed there (it then reads as zeros,
    /// as a punched hole does) and the base is left alone.
    pub fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        if let Some(o) = self.overlay.get() {
            return o.write(&self.file, offset, len, &Zeros { punch: true });
        }
        match fallocate(&self.file, Fallocate::PunchHole, offset, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r,
        }
    }

    /// Zeroes `[offset, offset + len)`: punches a hole when `unmap` is allowed,
    /// else `FALLOC_FL_ZERO_RANGE`, falling back to writing zeros. With an
    /// overlay this happens there and the base is left alone.
    pub fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> std::io::Result<()> {
        if let Some(o) = self.overlay.get() {
            return o.write(&self.file, offset, len, &Zeros { punch: unmap });
        }
        zero_range(&self.file, offset, len, unmap)
    }
}

/// The copy-on-write layer of a frozen image: an unlinked sparse file as
/// long as the image and the map of the clusters it holds. Clusters not
/// present read from the base.
#[derive(Debug)]
struct Overlay {
    file: File,
    /// The image's capacity in bytes (the overlay file's length).
    len: u64,
    /// Present clusters. One worker thread does the I/O, but the overlay
    /// sits in an `Arc` shared with the device, so it is locked (uncontended:
    /// once per transfer, not per cluster).
    map: Mutex<ClusterMap>,
    /// The budget a fork child's overlay is charged to (its source's).
    budget: Option<Arc<DiskBudget>>,
}

impl Drop for Overlay {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.release(self.charged());
        }
    }
}

impl Overlay {
    /// An empty overlay for an image of `len` bytes.
    fn over(file: File, len: u64) -> Self {
        Self {
            file,
            len,
            map: Mutex::new(ClusterMap::default()),
            budget: None,
        }
    }

    fn map(&self) -> MutexGuard<'_, ClusterMap> {
        // The map is updated only after the I/O it records succeeded, so a
        // panic while it was held cannot have left it inconsistent.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bytes(&self) -> u64 {
        self.map().count.saturating_mul(CLUSTER_SIZE).min(self.len)
    }

    /// A new overlay with a copy of this one's present clusters, charged to
    /// `budget` (refused when they do not fit).
    fn duplicate(&self, dir: Option<&Path>, path: &str, budget: Option<Arc<DiskBudget>>) -> Result<Self, DiskError> {
        let map = self.map().clone();
        let bytes = map.count.saturating_mul(CLUSTER_SIZE);
        if let Some(b) = &budget {
            b.charge(bytes).map_err(|_| DiskError::ChildrenBudget {
                path: path.to_owned(),
                need: bytes,
                used: b.used(),
                cap: b.cap(),
            })?;
        }
        let file = match tmpfile(dir, self.len) {
            Ok(f) => f,
            Err(source) => {
                if let Some(b) = &budget {
                    b.release(bytes);
                }
                return Err(DiskError::Overlay {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        // From here the new overlay gives the charge back when it goes,
        // also on a failed copy below.
        let fresh = Self {
            file,
            len: self.len,
            map: Mutex::new(map.clone()),
            budget,
        };
        for (first, end) in map.runs() {
            let start = first.saturating_mul(CLUSTER_SIZE);
            let stop = end.saturating_mul(CLUSTER_SIZE).min(self.len);
            copy_data(&self.file, &fresh.file, start, stop).map_err(|source| DiskError::OverlayCopy {
                path: path.to_owned(),
                source,
            })?;
        }
        Ok(fresh)
    }

    /// Charges the clusters of `[first, end)` that are not present yet to
    /// the budget, if any (`ENOSPC` past it; nothing is written then);
    /// returns the bytes charged, which a failed write refunds.
    fn charge(&self, map: &ClusterMap, first: u64, end: u64) -> std::io::Result<u64> {
        let Some(b) = &self.budget else { return Ok(0) };
        let mut new = 0u64;
        let mut c = first;
        while c < end {
            let (present, n) = map.run(c, end - c);
            if !present {
                new += n;
            }
            c += n.max(1);
        }
        let bytes = new.saturating_mul(CLUSTER_SIZE);
        b.charge(bytes).map(|()| bytes)
    }

    fn refund(&self, bytes: u64) {
        if let Some(b) = &self.budget {
            b.release(bytes);
        }
    }

    /// What this overlay is charged: every present cluster, whole.
    fn charged(&self) -> u64 {
        self.map().count.saturating_mul(CLUSTER_SIZE)
    }

    /// Reads `buf.len()` bytes at `offset` into guest memory: each run of
    /// present clusters from the overlay, each run of absent ones from
    /// `base`, every piece through [`FileAt`] (which marks what it wrote in
    /// the slice's dirty bitmap). Returns the bytes read (short only at the
    /// end of a file).
    fn read<B: BitmapSlice>(
        &self,
        base: &File,
        offset: u64,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let map = self.map();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset
                .checked_add(done as u64)
                .ok_or_else(|| VolatileMemoryError::IOError(ErrorKind::InvalidInput.into()))?;
            let want = buf.len() - done;
            let skip = pos % CLUSTER_SIZE;
            let max_clusters = skip.saturating_add(want as u64).div_ceil(CLUSTER_SIZE);
            let (present, clusters) = map.run(pos / CLUSTER_SIZE, max_clusters);
            let run = clusters.saturating_mul(CLUSTER_SIZE).saturating_sub(skip);
            let n = usize::try_from(run).unwrap_or(usize::MAX).min(want);
            let mut piece = buf.subslice(done, n)?;
            let mut src = FileAt {
                file: if present { &self.file } else { base },
                offset: pos,
            };
            let got = src.read_volatile(&mut piece)?;
            done += got;
            if got < n {
                break;
            }
        }
        Ok(done)
    }

    /// Writes `len` bytes of `src` at `offset`: whole clusters (and parts
    /// of present ones) straight into the overlay; a part of an absent
    /// cluster merged with the base's copy of it first. Marks the clusters
    /// present once their data is in.
    fn write(&self, base: &File, offset: u64, len: u64, src: &impl Source) -> std::io::Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= self.len)
            .ok_or_else(|| std::io::Error::from(ErrorKind::InvalidInput))?;
        let mut map = self.map();
        let mut pos = offset;
        while pos < end {
            let c = pos / CLUSTER_SIZE;
            let c_start = c * CLUSTER_SIZE;
            let c_end = c_start.saturating_add(CLUSTER_SIZE).min(self.len);
            if pos == c_start && end >= c_end {
                // Whole clusters from here on: the last boundary before
                // `end`, or the end of the image (a short last cluster).
                let full_end = if end == self.len { end } else { end - end % CLUSTER_SIZE };
                let charged = self.charge(&map, c, full_end.div_ceil(CLUSTER_SIZE))?;
                if let Err(e) = src.write_to(&self.file, pos, pos - offset, full_end - pos) {
                    self.refund(charged);
                    return Err(e);
                }
                map.mark(c, full_end.div_ceil(CLUSTER_SIZE));
                pos = full_end;
                continue;
            }
            let piece_end = end.min(c_end);
            if map.contains(c) {
                src.write_to(&self.file, pos, pos - offset, piece_end - pos)?;
            } else {
                let charged = self.charge(&map, c, c + 1)?;
                let mut bounce = [0u8; CLUSTER_SIZE as usize];
                // `c_end - c_start <= CLUSTER_SIZE`: these are in bounds.
                let cluster = &mut bounce[..(c_end - c_start) as usize];
                let (lo, hi) = ((pos - c_start) as usize, (piece_end - c_start) as usize);
                let copied = read_full_at(base, cluster, c_start)
                    .and_then(|()| src.copy_to(pos - offset, &mut cluster[lo..hi]))
                    .and_then(|()| self.file.write_all_at(cluster, c_start));
                if let Err(e) = copied {
                    self.refund(charged);
                    return Err(e);
                }
                map.mark(c, c + 1);
            }
            pos = piece_end;
        }
        Ok(())
    }
}

/// Which clusters an overlay holds: a sparse bitmap (a word of 64 clusters
/// per key, only non-zero words stored), so its size and the cost of
/// copying it follow the divergence, not the disk size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ClusterMap {
    words: BTreeMap<u64, u64>,
    /// Number of set bits.
    count: u64,
}

impl ClusterMap {
    fn contains(&self, c: u64) -> bool {
        self.words
            .get(&(c / WORD_BITS))
            .is_some_and(|w| (w >> (c % WORD_BITS)) & 1 == 1)
    }

    /// Whether cluster `c` is present, and how many clusters from `c` (at
    /// most `max`) are in that same state.
    fn run(&self, c: u64, max: u64) -> (bool, u64) {
        let present = self.contains(c);
        let mut n = 0u64;
        let mut at = c;
        while n < max {
            let word = self.words.get(&(at / WORD_BITS)).copied().unwrap_or(0);
            let same = if present { word } else { !word };
            let shift = at % WORD_BITS;
            let left = WORD_BITS - shift;
            // Bits shifted in from the top are 0: at most `left` ones.
            let take = u64::from((same >> shift).trailing_ones()).min(left);
            n = n.saturating_add(take);
            if take < left {
                break;
            }
            match at.checked_add(take) {
                Some(next) => at = next,
                None => break,
            }
        }
        (present, n.min(max))
    }

    /// Marks clusters `[first, end)` present.
    fn mark(&mut self, first: u64, end: u64) {
        let mut c = first;
        while c < end {
            let w = c / WORD_BITS;
            let lo = c % WORD_BITS;
            let hi = (end - w * WORD_BITS).min(WORD_BITS);
            let width = hi - lo;
            let mask = if width == WORD_BITS {
                u64::MAX
            } else {
                ((1u64 << width) - 1) << lo
            };
            let word = self.words.entry(w).or_insert(0);
            self.count += u64::from((mask & !*word).count_ones());
            *word |= mask;
            c = w * WORD_BITS + hi;
        }
    }

    /// The present clusters as `[first, end)` runs, in order.
    fn runs(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (&w, &word) in &self.words {
            let mut bits = word;
            while bits != 0 {
                let lo = u64::from(bits.trailing_zeros());
                let width = u64::from((bits >> lo).trailing_ones());
                let first = w * WORD_BITS + lo;
                let end = first + width;
                match out.last_mut() {
                    Some(last) if last.1 == first => last.1 = end,
                    _ => out.push((first, end)),
                }
                bits = if lo + width == WORD_BITS {
                    0
                } else {
                    bits & (u64::MAX << (lo + width))
                };
            }
        }
        out
    }
}

/// Where the bytes of an overlay write come from.
trait Source {
    /// Writes this source's bytes `[at, at + len)` into `file` at `file_offset`.
    fn write_to(&self, file: &File, file_offset: u64, at: u64, len: u64) -> std::io::Result<()>;
    /// Copies this source's bytes `[at, at + dst.len())` into `dst`.
    fn copy_to(&self, at: u64, dst: &mut [u8]) -> std::io::Result<()>;
}

/// Guest memory being written to the disk.
struct Guest<'a, 'b, B: BitmapSlice>(&'a VolatileSlice<'b, B>);

impl<B: BitmapSlice> Guest<'_, '_, B> {
    fn piece(&self, at: u64, len: u64) -> std::io::Result<VolatileSlice<'_, B>> {
        let (Ok(at), Ok(len)) = (usize::try_from(at), usize::try_from(len)) else {
            return Err(ErrorKind::InvalidInput.into());
        };
        self.0.subslice(at, len).map_err(std::io::Error::other)
    }
}

impl<B: BitmapSlice> Source for Guest<'_, '_, B> {
    fn write_to(&self, file: &File, file_offset: u64, at: u64, len: u64) -> std::io::Result<()> {
        let piece = self.piece(at, len)?;
        let mut dst = FileAt {
            file,
            offset: file_offset,
        };
        // FileAt writes everything or fails.
        dst.write_volatile(&piece).map(drop).map_err(into_io)
    }

    fn copy_to(&self, at: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let piece = self.piece(at, dst.len() as u64)?;
        if piece.copy_to(dst) == dst.len() {
            Ok(())
        } else {
            Err(ErrorKind::UnexpectedEof.into())
        }
    }
}

/// Zeros (DISCARD, WRITE_ZEROES); `punch` deallocates where it can.
struct Zeros {
    punch: bool,
}

impl Source for Zeros {
    fn write_to(&self, file: &File, file_offset: u64, _at: u64, len: u64) -> std::io::Result<()> {
        zero_range(file, file_offset, len, self.punch)
    }

    fn copy_to(&self, _at: u64, dst: &mut [u8]) -> std::io::Result<()> {
        dst.fill(0);
        Ok(())
    }
}

fn into_io(e: VolatileMemoryError) -> std::io::Error {
    match e {
        VolatileMemoryError::IOError(e) => e,
        other => std::io::Error::other(other),
    }
}

/// Copies the clusters of `runs` (`[first, end)`, as
/// [`DiskImage::fork_into`] returns them) of the overlay `from` into `to`,
/// which is first emptied to `len` bytes (the image's): another fork
/// child's overlay made from the same fork instant. Holes stay holes.
pub fn copy_overlay(from: &File, to: &File, len: u64, runs: &[(u64, u64)]) -> std::io::Result<()> {
    to.set_len(0)?;
    to.set_len(len)?;
    for &(first, end) in runs {
        let start = first.saturating_mul(CLUSTER_SIZE).min(len);
        let stop = end.saturating_mul(CLUSTER_SIZE).min(len);
        copy_data(from, to, start, stop)?;
    }
    Ok(())
}

/// A new overlay file for a fork (what a daemon makes for a fork child in
/// a VM process, which creates no file): unlinked and sparse, `O_TMPFILE`
/// in `dir` (the image's directory), else in `std::env::temp_dir()`.
/// [`DiskImage::fork_into`] and [`copy_overlay`] give it its length.
pub fn overlay_file(dir: Option<&Path>) -> std::io::Result<File> {
    tmpfile(dir, 0)
}

/// An unlinked, sparse file of `len` bytes: `O_TMPFILE` in `dir`, else in
/// `std::env::temp_dir()`. Closing it frees it.
fn tmpfile(dir: Option<&Path>, len: u64) -> std::io::Result<File> {
    let open = |d: &Path| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(d)
    };
    if let Some(d) = dir {
        match open(d) {
            Ok(file) => {
                file.set_len(len)?;
                return Ok(file);
            }
            Err(e) => warn!(
                dir = %d.display(),
                error = %e,
                "cannot create a copy-on-write overlay next to the image; using the temp dir"
            ),
        }
    }
    let file = open(&std::env::temp_dir())?;
    file.set_len(len)?;
    Ok(file)
}

/// Reads `buf.len()` bytes at `offset`; what lies past the end of the file
/// reads as zeros.
fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let at = offset
            .checked_add(done as u64)
            .ok_or_else(|| std::io::Error::from(ErrorKind::InvalidInput))?;
        match file.read_at(&mut buf[done..], at) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Copies `[start, end)` of `src` to the same offsets of `dst`, skipping
/// holes (`dst` is sparse, so they stay holes).
fn copy_data(src: &File, dst: &File, start: u64, end: u64) -> std::io::Result<()> {
    let mut pos = start;
    while pos < end {
        let Some(data) = next_data(src, pos, end)? else {
            break;
        };
        copy_range(src, dst, data.start, data.end)?;
        pos = data.end;
    }
    Ok(())
}

/// Copies `[pos, end)` of `src` to `dst` with `copy_file_range`, falling
/// back to reads and writes where the kernel cannot.
fn copy_range(src: &File, dst: &File, mut pos: u64, end: u64) -> std::io::Result<()> {
    while pos < end {
        let want = usize::try_from(end - pos).unwrap_or(usize::MAX).min(1 << 30);
        match copy_file_range(src, dst, pos, want) {
            // The source ended early: the rest stays a hole (zeros), which is
            // what the source reads there too.
            Ok(0) => return Ok(()),
            Ok(n) => pos += n as u64,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL)
                ) =>
            {
                return copy_by_reading(src, dst, pos, end);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn copy_by_reading(src: &File, dst: &File, mut pos: u64, end: u64) -> std::io::Result<()> {
    let mut buf = vec![0u8; COPY_CHUNK];
    while pos < end {
        let n = usize::try_from(end - pos).unwrap_or(COPY_CHUNK).min(COPY_CHUNK);
        let got = match src.read_at(&mut buf[..n], pos) {
            Ok(0) => return Ok(()),
            Ok(got) => got,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        dst.write_all_at(&buf[..got], pos)?;
        pos += got as u64;
    }
    Ok(())
}

/// Zeroes `[offset, offset + len)` of `file`: punches a hole when `punch`,
/// else `FALLOC_FL_ZERO_RANGE`, falling back to writing zeros.
fn zero_range(file: &File, offset: u64, len: u64, punch: bool) -> std::io::Result<()> {
    let mode = if punch {
        Fallocate::PunchHole
    } else {
        Fallocate::ZeroRange
    };
    match fallocate(file, mode, offset, len) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            let zeros = vec![0u8; 64 * 1024];
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(zeros.len() as u64) as usize;
                let at = offset
                    .checked_add(done)
                    .ok_or_else(|| std::io::Error::from(ErrorKind::InvalidInput))?;
                file.write_all_at(&zeros[..n], at)?;
                done += n as u64;
            }
            Ok(())
        }
        r => r,
    }
}

/// A position on a [`DiskImage`], as vm-memory's `ReadVolatile` /
/// `WriteVolatile`: what the request path reads guest data from and writes
/// it to. Without an overlay it is exactly [`FileAt`] on the image file
/// (one `pread`/`pwrite` per segment). With one, a transfer is split at
/// cluster boundaries between the overlay and the frozen base (see the
/// module docs); reads still go straight from the files into guest RAM and
/// mark it dirty as [`FileAt`] does. The position advances by what was
/// transferred.
#[derive(Debug)]
pub struct DiskAt<'a> {
    /// The disk.
    pub disk: &'a DiskImage,
    /// Byte offset of the next transfer.
    pub offset: u64,
}

impl ReadVolatile for DiskAt<'_> {
    fn read_volatile<B: BitmapSlice>(&mut self, buf: &mut VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let Some(overlay) = self.disk.overlay.get() else {
            let mut src = FileAt {
                file: &self.disk.file,
                offset: self.offset,
            };
            let r = src.read_volatile(buf);
            self.offset = src.offset;
            return r;
        };
        let n = overlay.read(&self.disk.file, self.offset, buf)?;
        self.offset = self.offset.saturating_add(n as u64);
        Ok(n)
    }
}

impl WriteVolatile for DiskAt<'_> {
    fn write_volatile<B: BitmapSlice>(&mut self, buf: &VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let Some(overlay) = self.disk.overlay.get() else {
            let mut dst = FileAt {
                file: &self.disk.file,
                offset: self.offset,
            };
            let r = dst.write_volatile(buf);
            self.offset = dst.offset;
            return r;
        };
        overlay
            .write(&self.disk.file, self.offset, buf.len() as u64, &Guest(buf))
            .map_err(VolatileMemoryError::IOError)?;
        self.offset = self.offset.saturating_add(buf.len() as u64);
        Ok(buf.len())
    }
}

/// A file at a position: `pread`/`pwrite` as vm-memory's `ReadVolatile` /
/// `WriteVolatile`, so `GuestMemory::read_exact_volatile_from(addr, &mut
/// FileAt, len)` moves image bytes straight into guest RAM **and marks the
/// destination in the region's dirty bitmap** (as vm-memory's own fd readers
/// do). The position advances by what was transferred.
#[derive(Debug)]
pub struct FileAt<'a> {
    /// The file.
    pub file: &'a File,
    /// Byte offset of the next transfer.
    pub offset: u64,
}

impl ReadVolatile for FileAt<'_> {
    fn read_volatile<B: BitmapSlice>(&mut self, buf: &mut VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let result = k7d_sys::fd::pread_volatile(self.file, buf, self.offset);
        // The write into guest memory bypassed `Bytes`, so mark it here:
        // everything on error (a partial read may have happened), else what
        // was read. Marking after the copy is the order that cannot lose a
        // write to a concurrent harvest.
        match &result {
            Ok(n) => {
                buf.bitmap().mark_dirty(0, *n);
                self.offset += *n as u64;
            }
            Err(_) => buf.bitmap().mark_dirty(0, buf.len()),
        }
        result.map_err(VolatileMemoryError::IOError)
    }
}

impl WriteVolatile for FileAt<'_> {
    fn write_volatile<B: BitmapSlice>(&mut self, buf: &VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let n = k7d_sys::fd::pwrite_volatile(self.file, buf, self.offset).map_err(VolatileMemoryError::IOError)?;
        self.offset += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The map against a plain `Vec<bool>`.
    #[test]
    fn cluster_map_matches_a_flat_bitmap() {
        const N: u64 = 700;
        let mut map = ClusterMap::default();
        let mut flat = vec![false; N as usize];
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..200 {
            let first = rand(N);
            let end = (first + 1 + rand(150)).min(N);
            map.mark(first, end);
            flat[first as usize..end as usize].fill(true);
            assert_eq!(map.count, flat.iter().filter(|b| **b).count() as u64);
            for c in 0..N {
                assert_eq!(map.contains(c), flat[c as usize], "cluster {c}");
            }
            let c = rand(N);
            let max = 1 + rand(N - c);
            let (present, n) = map.run(c, max);
            let same = flat[c as usize..(c + max) as usize]
                .iter()
                .take_while(|b| **b == flat[c as usize])
                .count() as u64;
            assert_eq!((present, n), (flat[c as usize], same), "run({c}, {max})");
            let mut runs = Vec::new();
            let mut c = 0usize;
            while c < flat.len() {
                if flat[c] {
                    let s = c;
                    while c < flat.len() && flat[c] {
                        c += 1;
                    }
                    runs.push((s as u64, c as u64));
                } else {
                    c += 1;
                }
            }
            assert_eq!(map.runs(), runs);
        }
    }

    #[test]
    fn cluster_map_edges() {
        let mut map = ClusterMap::default();
        assert_eq!(map.run(5, 10), (false, 10));
        assert_eq!(map.run(u64::MAX, 10), (false, 1), "the last cluster ends the run");
        map.mark(64, 128);
        assert_eq!(map.words.len(), 1);
        assert_eq!(map.words[&1], u64::MAX);
        assert_eq!(map.run(0, 1000), (false, 64));
        assert_eq!(map.run(64, 1000), (true, 64));
        map.mark(128, 129);
        map.mark(63, 64);
        assert_eq!(map.runs(), vec![(63, 129)]);
        assert_eq!(map.count, 66);
        map.mark(60, 70);
        assert_eq!(map.count, 69, "marking twice counts once");
        map.mark(10, 10);
        assert_eq!(map.count, 69);
    }
}

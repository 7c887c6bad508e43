//! Guest RAM: ONE memfd, mapped through vm-memory with the dirty-bitmap
//! backend, registered with KVM as one memslot per region with dirty logging.
//!
//! Layout: RAM below the 32-bit MMIO hole sits at GPA 0; what does not fit
//! continues at 4 GiB. Both regions are windows of the same memfd, so a fork
//! (a later issue) can map the whole file privately.

use std::fs::File;
use std::num::NonZeroUsize;
use std::sync::Arc;

use kvm_bindings::{KVM_MEM_LOG_DIRTY_PAGES, kvm_userspace_memory_region};
use kvm_ioctls::VmFd;
use thiserror::Error;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

/// Guest memory with per-page dirty bitmaps (vm-memory's bitmap backend).
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;

/// Start of the 32-bit MMIO hole (devices, LAPIC, IOAPIC, firmware).
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// First address above 4 GiB.
pub const HIGH_RAM_START: u64 = 0x1_0000_0000;

/// Errors from setting up guest RAM.
#[derive(Debug, Error)]
pub enum MemoryError {
    /// memfd_create or ftruncate failed.
    #[error("could not create the {size_mib} MiB guest RAM memfd")]
    Memfd {
        /// Requested size.
        size_mib: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// mmap of the memfd failed.
    #[error("could not map guest RAM")]
    Mmap(#[source] vm_memory::mmap::MmapRegionError),
    /// vm-memory refused the region layout.
    #[error("invalid guest memory layout")]
    Layout(#[source] vm_memory::GuestRegionCollectionError),
    /// A child was asked of a VM whose RAM is not a frozen base.
    #[error("the source's RAM is not frozen as a fork base")]
    NotFrozen,
    /// Remapping RAM privately over its memfd failed.
    #[error("cannot remap guest RAM privately over its memfd")]
    Freeze(#[source] std::io::Error),
    /// Copying a page into a child failed.
    #[error("cannot copy page {0} into the child")]
    Copy(u64),
    /// Building a new base failed.
    #[error("{what}")]
    Base {
        /// What failed.
        what: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// KVM refused a memslot.
    #[error("KVM refused memslot {slot}")]
    Memslot {
        /// Slot index.
        slot: u32,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// A guest's RAM: the memfd and the mapping KVM and devices use.
///
/// Fork model: while a VM has never been forked, its RAM is the memfd mapped
/// shared. [`GuestRam::freeze`] turns the memfd into a frozen *base*: the
/// VM's own mapping becomes private (copy-on-write over the base) at the same
/// address, so from then on nobody writes the base. A child maps the base
/// privately ([`GuestRam::new_child`]) and gets the source's pages that
/// differ from the base copied in. Because no mapping of a base is ever
/// shared after the freeze, a child can never see its parent's later writes
/// through a page it has not touched yet (the MAP_PRIVATE-over-a-live-file
/// hazard); `tests/tests/fork.rs` guards it.
pub struct GuestRam {
    /// The memfd the mapping shows: the VM's own RAM, or once frozen its
    /// base (a re-base replaces it, `vmm/src/vstate/rebase.rs`).
    memfd: std::sync::RwLock<Arc<File>>,
    mem: GuestMemoryMmap,
    size: u64,
    frozen: std::sync::atomic::AtomicBool,
    /// Pages (by index over the whole RAM) that differ from the base since
    /// the freeze: every harvest of KVM's dirty log and device bitmaps is ORed in.
    diverged: std::sync::Mutex<Vec<u64>>,
    /// A capture view's diverged pages ([`GuestRam::from_capture`]), at
    /// their memfd offsets: children read them with `pread`, never through
    /// a mapping (every page of a mapping is a fault of its own, which a
    /// 10 %-dirty fork of 256 MiB paid 6,500 times on these hosts).
    delta: Option<File>,
}

impl GuestRam {
    /// Creates a memfd of `size` bytes named after the VM and maps it shared.
    pub fn new(vm_id: &str, size: u64) -> Result<Self, MemoryError> {
        let size_mib = size >> 20;
        let memfd = crate::sys::memfd(&format!("k7d-ram-{vm_id}"), size)
            .map_err(|source| MemoryError::Memfd { size_mib, source })?;
        Self::map(Arc::new(memfd), size, libc::MAP_SHARED, false)
    }

    /// RAM over `memfd`, a memfd of exactly `size` bytes that another
    /// process made and filled (a restore's, handed to a VM process),
    /// mapped shared as [`GuestRam::new`]'s own; one of another size is
    /// refused (a shorter one would fault the VMM at its end).
    pub fn from_memfd(memfd: File, size: u64) -> Result<Self, MemoryError> {
        Self::map_handed(memfd, size, libc::MAP_SHARED)
    }

    /// A snapshot writer's view of guest RAM another process holds
    /// ([`crate::vstate::snapshot::write`] reads only through the memfd of
    /// a RAM that is not frozen): `memfd`, of exactly `size` bytes and
    /// possibly opened read-only, mapped privately and never touched.
    pub fn view_of(memfd: File, size: u64) -> Result<Self, MemoryError> {
        Self::map_handed(memfd, size, libc::MAP_PRIVATE)
    }

    /// Maps `memfd`, made by another process, as RAM of `size` bytes
    /// (`share`: `MAP_SHARED` or `MAP_PRIVATE`), once it holds exactly
    /// that: a shorter one would fault its reader at its end.
    fn map_handed(memfd: File, size: u64, share: i32) -> Result<Self, MemoryError> {
        let size_mib = size >> 20;
        let len = memfd
            .metadata()
            .map_err(|source| MemoryError::Memfd { size_mib, source })?
            .len();
        if len != size {
            return Err(MemoryError::Memfd {
                size_mib,
                source: std::io::Error::other(format!("the guest RAM memfd handed over holds {len} bytes, not {size}")),
            });
        }
        Self::map(Arc::new(memfd), size, share, false)
    }

    /// RAM for a fork child: the frozen base of `parent` mapped privately
    /// (nothing is copied here; see [`GuestRam::copy_diverged_from`]).
    pub fn new_child(parent: &GuestRam) -> Result<Self, MemoryError> {
        if !parent.is_frozen() {
            return Err(MemoryError::NotFrozen);
        }
        Self::map(parent.memfd(), parent.size, libc::MAP_PRIVATE, true)
    }

    /// RAM for a fork child over `reserved`, address space reserved ahead
    /// of the fork for `parent`'s size ([`reserve`], a VM shell's, whose
    /// memslots may already point at it): the frozen base of `parent` is
    /// mapped privately over it.
    pub fn new_child_in(parent: &GuestRam, reserved: GuestMemoryMmap) -> Result<Self, MemoryError> {
        if !parent.is_frozen() {
            return Err(MemoryError::NotFrozen);
        }
        Self::map_over(reserved, parent.memfd(), parent.size, libc::MAP_PRIVATE, true)
    }

    fn map(memfd: Arc<File>, size: u64, share: i32, frozen: bool) -> Result<Self, MemoryError> {
        Self::map_over(reserve(size)?, memfd, size, share, frozen)
    }

    fn map_over(
        mem: GuestMemoryMmap,
        memfd: Arc<File>,
        size: u64,
        share: i32,
        frozen: bool,
    ) -> Result<Self, MemoryError> {
        let expected = layout(size);
        if mem.num_regions() != expected.len()
            || mem
                .iter()
                .zip(&expected)
                .any(|(r, &(gpa, _, len))| r.start_addr().0 != gpa || r.len() != len)
        {
            return Err(MemoryError::Memfd {
                size_mib: size >> 20,
                source: std::io::Error::other("the reserved address space does not fit this RAM's layout"),
            });
        }
        for (region, (_, off, _)) in mem.iter().zip(expected) {
            let len = region.len() as usize;
            // SAFETY: `region` is `len` bytes that vm-memory reserved (see
            // `reserve`) and that nothing but a memslot of a VM that has not
            // run points at; the memfd replaces them at the same address
            // (KVM drops whatever it mapped there through its MMU notifier)
            // and vm-memory unmaps the range, whatever maps it.
            unsafe { crate::sys::remap_fixed(region.as_ptr(), len, &memfd, off, share) }
                .map_err(MemoryError::Freeze)?;
            // A VM's own RAM (not a fork's private view) asks for 2 MiB pages:
            // one fault and one page-cache entry per 2 MiB instead of 512,
            // which is most of a Linux guest's boot under nested
            // virtualization (docs/linux-boot.md, "Huge pages"). Only advice:
            // the host's shmem_enabled decides; `k7d check` reports it.
            if share == libc::MAP_SHARED
                && let Err(e) = crate::sys::advise_huge_pages(region.as_ptr(), len)
            {
                tracing::debug!(
                    "guest RAM at {:#x}: MADV_HUGEPAGE refused ({e}); 4 KiB pages",
                    region.start_addr().0
                );
            }
        }
        let pages = size.div_ceil(PAGE) as usize;
        Ok(Self {
            memfd: std::sync::RwLock::new(memfd),
            mem,
            size,
            frozen: std::sync::atomic::AtomicBool::new(frozen),
            diverged: std::sync::Mutex::new(vec![0; pages.div_ceil(64)]),
            delta: None,
        })
    }

    /// A fork source's RAM at its fork instant, seen from another process
    /// (a child's VM process, `vmproc/`, or the daemon writing a VM
    /// process's snapshot), for reading only: its memfd is `base` (the
    /// source's frozen base, which a child maps privately,
    /// [`GuestRam::new_child`]), and `delta` holds the pages set in `words`
    /// (those that differed from the base) at their memfd offsets, which
    /// are read from it with `pread` ([`GuestRam::copy_diverged_from`]
    /// straight into a child's mapping, [`GuestRam::read_as_seen`]). Its
    /// own mapping is the base's, private and never touched.
    pub fn from_capture(base: File, delta: File, words: &[u64], size: u64) -> Result<Self, MemoryError> {
        let mut view = Self::map(Arc::new(base), size, libc::MAP_PRIVATE, true)?;
        view.delta = Some(delta);
        view.add_diverged(words, 0);
        Ok(view)
    }

    /// Whether the memfd is a frozen base (this VM maps it privately).
    pub fn is_frozen(&self) -> bool {
        self.frozen.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes the memfd a frozen base: remaps this VM's RAM privately over it
    /// at the same addresses (KVM's memslots keep their host addresses; its
    /// MMU notifier drops the old translations). Idempotent. Call with every
    /// writer of guest RAM paused.
    pub fn freeze(&self) -> Result<(), MemoryError> {
        if self.is_frozen() {
            return Ok(());
        }
        self.remap_private_over(&self.memfd())?;
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
        // Writes the VMM made before the freeze are in the base already.
        for region in self.mem.iter() {
            region.get_mmap().bitmap().reset();
        }
        Ok(())
    }

    /// Remaps every region privately over `file` at the same host
    /// addresses. Every writer of guest RAM is paused.
    fn remap_private_over(&self, file: &File) -> Result<(), MemoryError> {
        for (_, off, len) in layout(self.size) {
            let host = self
                .mem
                .get_host_address(GuestAddress(gpa_of(off)))
                .map_err(|_| MemoryError::Freeze(std::io::Error::from_raw_os_error(libc::EFAULT)))?;
            let len =
                usize::try_from(len).map_err(|_| MemoryError::Freeze(std::io::Error::other("region too large")))?;
            // SAFETY: `host..host+len` is one of our own regions' mappings,
            // at `off` of a file that holds exactly the bytes the VM sees
            // there (its memfd at a freeze, a new base at a re-base), with
            // every writer paused: the private mapping shows the same bytes,
            // and vm-memory and the devices' views only hold the address
            // (vm-memory unmaps the range when its region goes, whatever
            // maps it then).
            unsafe { crate::sys::remap_private(host, len, file, off) }.map_err(MemoryError::Freeze)?;
        }
        Ok(())
    }

    /// Makes `base` this VM's frozen base: `base` holds exactly the RAM this
    /// VM sees now (every writer paused, every write harvested), the
    /// mapping is remapped privately over it at the same addresses (the
    /// VM's private copies go back to the host), and nothing differs from
    /// the base any more. The old base lives on in the children that map it.
    pub fn switch_base(&self, base: File) -> Result<(), MemoryError> {
        if !self.is_frozen() {
            return Err(MemoryError::NotFrozen);
        }
        let base = Arc::new(base);
        self.remap_private_over(&base)?;
        *self.memfd.write().unwrap_or_else(|p| p.into_inner()) = base;
        self.diverged.lock().unwrap_or_else(|p| p.into_inner()).fill(0);
        for region in self.mem.iter() {
            region.get_mmap().bitmap().reset();
        }
        Ok(())
    }

    /// Folds every write since the last harvest into the diverged set: KVM's
    /// dirty log (vCPU writes) and vm-memory's bitmaps (writes the VMM made
    /// through this mapping). Call with every writer paused.
    pub fn harvest(&self, vm: &VmFd) -> Result<(), MemoryError> {
        self.take_writes(vm).map(drop)
    }

    /// [`GuestRam::harvest`], returning the pages written since the last
    /// harvest (bitmap words over the whole RAM, page `i` is bit `i % 64`
    /// of word `i / 64`). Safe while the VM runs: KVM write-protects the
    /// pages it reports, and vm-memory marks a page after writing it, so a
    /// write that lands after this harvest is in the next one.
    pub fn take_writes(&self, vm: &VmFd) -> Result<Vec<u64>, MemoryError> {
        let mut words = vec![0u64; self.size.div_ceil(PAGE).div_ceil(64) as usize];
        for (slot, region) in self.mem.iter().enumerate() {
            let slot = slot as u32;
            let first = memfd_offset_of(region.start_addr().0) / PAGE;
            let len = usize::try_from(region.len()).unwrap_or(usize::MAX);
            // Each region's bits join the diverged set as soon as they are
            // read (KVM and vm-memory cleared them): a failure at a later
            // region loses none.
            let kvm_bits = vm
                .get_dirty_log(slot, len)
                .map_err(|source| MemoryError::Memslot { slot, source })?;
            self.add_diverged(&kvm_bits, first);
            or_bits(&mut words, &kvm_bits, first);
            let vmm_bits = region.get_mmap().bitmap().get_and_reset();
            self.add_diverged(&vmm_bits, first);
            or_bits(&mut words, &vmm_bits, first);
        }
        Ok(words)
    }

    /// How many pages differ from the base.
    pub fn diverged_count(&self) -> u64 {
        let d = self.diverged.lock().unwrap_or_else(|p| p.into_inner());
        d.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The set of pages that differ from the base (words as
    /// [`GuestRam::take_writes`]).
    pub fn diverged_words(&self) -> Vec<u64> {
        self.diverged.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Writes the pages set in `words` (as [`GuestRam::take_writes`]) from
    /// this VM's mapping into `file` at their memfd offsets, a run of
    /// consecutive pages per `pwrite`; returns the pages written. The
    /// kernel allocates and fills `file`'s pages itself, which costs a
    /// fifth of faulting them into a mapping on this host (`docs/fork.md`).
    pub fn write_pages_to(&self, file: &File, words: &[u64]) -> Result<u64, MemoryError> {
        let pages = self.size.div_ceil(PAGE);
        let mut written = 0;
        for (first, n) in page_runs(set_bits(words).into_iter().filter(|&p| p < pages)) {
            let len = usize::try_from(n * PAGE).map_err(|_| MemoryError::Copy(first))?;
            let slice = self
                .mem
                .get_slice(GuestAddress(gpa_of(first * PAGE)), len)
                .map_err(|_| MemoryError::Copy(first))?;
            k7d_sys::fd::pwrite_volatile(file, &slice, first * PAGE).map_err(|source| MemoryError::Base {
                what: "cannot write diverged pages into the new base",
                source,
            })?;
            written += n;
        }
        Ok(written)
    }

    /// Copies what the current base holds (its data extents; holes stay
    /// holes) into `file`, in the kernel (`copy_file_range`, reads and
    /// writes where the kernel cannot); returns the bytes copied.
    pub fn copy_base_to(&self, file: &File) -> Result<u64, MemoryError> {
        let base = self.memfd();
        let mut copied = 0;
        for r in data_extents(&base, self.size) {
            let mut off = r.start;
            while off < r.end {
                let want = usize::try_from((r.end - off).min(1 << 30)).unwrap_or(1 << 30);
                let n = match k7d_sys::file::copy_file_range(&*base, file, off, want) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL)
                        ) =>
                    {
                        copy_by_hand(&base, file, off, want).map_err(|source| MemoryError::Base {
                            what: "cannot copy the old base into the new one",
                            source,
                        })?
                    }
                    Err(source) => {
                        return Err(MemoryError::Base {
                            what: "cannot copy the old base into the new one",
                            source,
                        });
                    }
                };
                off += n as u64;
                copied += n as u64;
            }
        }
        Ok(copied)
    }

    /// Reads `buf.len()` bytes of RAM at memfd offset `off` as this VM sees
    /// them, without allocating a page: the memfd is read with `pread` (a
    /// hole reads as zeros and stays a hole), and after a fork the pages this
    /// VM wrote since the freeze (its private copies, see
    /// [`GuestRam::harvest`]) are read from its mapping over that (from its
    /// delta file for a capture view). Call with
    /// every writer paused and, after a fork, just after a harvest.
    pub fn read_as_seen(&self, off: u64, buf: &mut [u8]) -> Result<(), std::io::Error> {
        use std::os::unix::fs::FileExt;
        self.memfd().read_exact_at(buf, off)?;
        if !self.is_frozen() {
            return Ok(());
        }
        let end = off + buf.len() as u64;
        let d = self.diverged.lock().unwrap_or_else(|p| p.into_inner());
        let mut page = off / PAGE;
        while page * PAGE < end {
            let word = d.get((page / 64) as usize).copied().unwrap_or(0);
            if word == 0 {
                page = (page / 64 + 1) * 64;
                continue;
            }
            if word & (1 << (page % 64)) != 0 {
                let from = (page * PAGE).max(off);
                let to = ((page + 1) * PAGE).min(end);
                let dst = &mut buf[(from - off) as usize..(to - off) as usize];
                match &self.delta {
                    Some(delta) => delta.read_exact_at(dst, from)?,
                    None => self
                        .mem
                        .read_slice(dst, GuestAddress(gpa_of(from)))
                        .map_err(|e| std::io::Error::other(e.to_string()))?,
                }
            }
            page += 1;
        }
        Ok(())
    }

    /// ORs page indexes (bitmap words over the whole RAM) into the set of
    /// pages that differ from the base.
    pub fn add_diverged(&self, words: &[u64], first_page: u64) {
        or_bits(
            &mut self.diverged.lock().unwrap_or_else(|p| p.into_inner()),
            words,
            first_page,
        );
    }

    /// Marks the pages holding these guest physical addresses as differing
    /// from the base (device writes; addresses outside RAM are ignored).
    pub fn add_diverged_gpas(&self, gpas: impl Iterator<Item = u64>) {
        let mut d = self.diverged.lock().unwrap_or_else(|p| p.into_inner());
        for gpa in gpas {
            if self.mem.address_in_range(GuestAddress(gpa)) {
                let page = memfd_offset_of(gpa) / PAGE;
                if let Some(slot) = d.get_mut((page / 64) as usize) {
                    *slot |= 1 << (page % 64);
                }
            }
        }
    }

    /// The pages holding these guest physical addresses (words as
    /// [`GuestRam::take_writes`]; addresses outside RAM are ignored), also
    /// marked as differing from the base.
    pub fn words_of_gpas(&self, gpas: &[u64]) -> Vec<u64> {
        let mut words = vec![0u64; self.size.div_ceil(PAGE).div_ceil(64) as usize];
        for &gpa in gpas {
            if self.mem.address_in_range(GuestAddress(gpa)) {
                let page = memfd_offset_of(gpa) / PAGE;
                if let Some(slot) = words.get_mut((page / 64) as usize) {
                    *slot |= 1 << (page % 64);
                }
            }
        }
        self.add_diverged(&words, 0);
        words
    }

    /// Page indexes that differ from the base.
    pub fn diverged_pages(&self) -> Vec<u64> {
        set_bits(&self.diverged.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Copies `pages` (ascending indexes over the whole RAM) from `src`'s view
    /// into this RAM: the child gets the parent's pages that differ from their
    /// base. Runs of consecutive pages are copied in one go (host mapping to
    /// host mapping, or for a capture view one `pread` of its delta file),
    /// and marked diverged under one lock.
    pub fn copy_diverged_from(&self, src: &GuestRam, pages: &[u64]) -> Result<(), MemoryError> {
        for (first, n) in page_runs(pages.iter().copied()) {
            let gpa = gpa_of(first * PAGE);
            let len = usize::try_from(n * PAGE).map_err(|_| MemoryError::Copy(first))?;
            let mut to = self
                .mem
                .get_slice(GuestAddress(gpa), len)
                .map_err(|_| MemoryError::Copy(first))?;
            match &src.delta {
                Some(delta) => {
                    let read = k7d_sys::fd::pread_volatile(delta, &mut to, first * PAGE).map_err(|source| {
                        MemoryError::Base {
                            what: "cannot read a fork's diverged pages",
                            source,
                        }
                    })?;
                    if read != len {
                        return Err(MemoryError::Copy(first + (read as u64) / PAGE));
                    }
                }
                None => src
                    .mem
                    .get_slice(GuestAddress(gpa), len)
                    .map_err(|_| MemoryError::Copy(first))?
                    .copy_to_volatile_slice(to),
            }
        }
        let mut d = self.diverged.lock().unwrap_or_else(|p| p.into_inner());
        for &p in pages {
            if let Some(w) = d.get_mut((p / 64) as usize) {
                *w |= 1 << (p % 64);
            }
        }
        Ok(())
    }

    /// Registers every region with KVM as a memslot, with KVM's dirty log on
    /// or off. Off by default: with it on, KVM write-protects guest pages and
    /// every first write to a page faults, which a Linux boot (decompressing
    /// tens of MiB) pays for at every page. The fork path switches it on when
    /// it prepares a VM as a fork source ([`GuestRam::set_dirty_log`]).
    pub fn register(&self, vm: &VmFd, dirty_log: bool) -> Result<(), MemoryError> {
        register(&self.mem, vm, dirty_log)
    }

    /// Switches KVM's dirty log on or off for every memslot (re-registers
    /// the slots with the new flags; the mapping does not move).
    pub fn set_dirty_log(&self, vm: &VmFd, on: bool) -> Result<(), MemoryError> {
        self.register(vm, on)
    }

    /// The guest memory (vm-memory `Bytes` access marks the dirty bitmap).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// The memfd backing all of RAM (once frozen: the base this VM's
    /// private mapping is over).
    pub fn memfd(&self) -> Arc<File> {
        self.memfd.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// RAM size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// Reserves address space for `size` bytes of guest RAM laid out as
/// [`layout`] says, one vm-memory region per RAM region, mapping nothing
/// yet ([`GuestRam`] maps a memfd over it).
///
/// vm-memory owns the address range (an anonymous reservation, unmapped
/// when the last handle to the region goes, as with any region of its own)
/// but holds no file: so nothing but the VMs that map a base keeps it open
/// (a re-base's old base goes with its last child), and a clone of the
/// memory handle keeps the range mapped as long as it lives.
pub fn reserve(size: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let size_mib = size >> 20;
    let page = NonZeroUsize::new(crate::sys::page_size()).unwrap_or(NonZeroUsize::MIN);
    let mut regions = Vec::new();
    for (gpa, _, len) in layout(size) {
        let len = usize::try_from(len).map_err(|_| MemoryError::Memfd {
            size_mib,
            source: std::io::Error::other("region larger than the address space"),
        })?;
        let region = MmapRegionBuilder::new_with_bitmap(len, AtomicBitmap::new(len, page))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
            .build()
            .map_err(MemoryError::Mmap)?;
        let region = GuestRegionMmap::new(region, GuestAddress(gpa)).ok_or_else(|| MemoryError::Memfd {
            size_mib,
            source: std::io::Error::other("region wraps the guest address space"),
        })?;
        regions.push(region);
    }
    GuestMemoryMmap::from_regions(regions).map_err(MemoryError::Layout)
}

/// Registers every region of `mem` with KVM as a memslot (slot = region
/// index), with KVM's dirty log on or off.
pub fn register(mem: &GuestMemoryMmap, vm: &VmFd, dirty_log: bool) -> Result<(), MemoryError> {
    for (slot, region) in mem.iter().enumerate() {
        let slot = slot as u32;
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(|_| MemoryError::Memslot {
                slot,
                source: kvm_ioctls::Error::new(libc::EFAULT),
            })?;
        let r = kvm_userspace_memory_region {
            slot,
            flags: if dirty_log { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region maps `memory_size` bytes at `userspace_addr`,
        // and the mapping lives as long as `mem`. A VM that runs never
        // outlives it (the VM fd is closed before this memory is dropped;
        // see `Vm`'s and `Shell`'s field order); a build that fails may
        // drop it first, but that VM never ran and KVM reaches a slot's
        // memory only on a vCPU's fault.
        unsafe { vm.set_user_memory_region(r) }.map_err(|source| MemoryError::Memslot { slot, source })?;
    }
    Ok(())
}

/// Guest page size used for divergence tracking.
pub const PAGE: u64 = 4096;

/// ORs `bits` (a bitmap whose bit 0 is page `first`) into `words`.
fn or_bits(words: &mut [u64], bits: &[u64], first: u64) {
    for (wi, &w) in bits.iter().enumerate() {
        let mut b = w;
        while b != 0 {
            let i = b.trailing_zeros() as u64;
            b &= b - 1;
            let page = first + wi as u64 * 64 + i;
            if let Some(slot) = words.get_mut((page / 64) as usize) {
                *slot |= 1 << (page % 64);
            }
        }
    }
}

/// The indexes of the set bits of `words` (bit `i % 64` of word `i / 64`),
/// ascending.
fn set_bits(words: &[u64]) -> Vec<u64> {
    let mut v = Vec::new();
    for (wi, &w) in words.iter().enumerate() {
        let mut bits = w;
        while bits != 0 {
            v.push(wi as u64 * 64 + u64::from(bits.trailing_zeros()));
            bits &= bits - 1;
        }
    }
    v
}

/// Ascending page indexes grouped into `(first, count)` runs of pages that
/// are consecutive in the memfd and in guest-physical space too (a run
/// never crosses the MMIO hole): one copy or write per run.
fn page_runs(pages: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for p in pages {
        match runs.last_mut() {
            Some((first, n)) if p == *first + *n && gpa_of(p * PAGE) == gpa_of(*first * PAGE) + *n * PAGE => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// Copies `[off, off + len)` of `src` into `dst` at the same offset with a
/// buffer (where `copy_file_range` cannot); returns the bytes copied.
fn copy_by_hand(src: &File, dst: &File, off: u64, len: usize) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len.min(1 << 20)];
    let n = src.read_at(&mut buf, off)?;
    dst.write_all_at(&buf[..n], off)?;
    Ok(n)
}

/// The guest physical address of memfd offset `off`.
pub fn gpa_of(off: u64) -> u64 {
    if off < MMIO_HOLE_START {
        off
    } else {
        off - MMIO_HOLE_START + HIGH_RAM_START
    }
}

/// The memfd offset of guest address `gpa` (inside RAM).
pub fn memfd_offset_of(gpa: u64) -> u64 {
    if gpa < HIGH_RAM_START {
        gpa
    } else {
        gpa - HIGH_RAM_START + MMIO_HOLE_START
    }
}

/// `(guest address, memfd offset, length)` of each RAM region.
pub fn layout(size: u64) -> Vec<(u64, u64, u64)> {
    let low = size.min(MMIO_HOLE_START);
    let mut v = vec![(0, 0, low)];
    if size > low {
        v.push((HIGH_RAM_START, low, size - low));
    }
    v
}

/// The data extents of `file` within `[0, len)`, in order, found with
/// `SEEK_DATA`/`SEEK_HOLE`: every byte outside them reads as zero. This is
/// the one sparse walk k7d has: the snapshot writer walks a VM's memfd with
/// it, and restore walks the memory file (so holes stay holes both ways). A
/// file system that cannot answer reports the rest of the file as one extent
/// (correct, only slower).
pub fn data_extents(file: &File, len: u64) -> DataExtents<'_> {
    DataExtents { file, len, off: 0 }
}

/// The iterator of [`data_extents`].
pub struct DataExtents<'a> {
    file: &'a File,
    len: u64,
    off: u64,
}

impl Iterator for DataExtents<'_> {
    type Item = std::ops::Range<u64>;

    fn next(&mut self) -> Option<Self::Item> {
        // A file system that fails the walk reports the rest as one extent.
        let r = k7d_sys::file::next_data(self.file, self.off, self.len).unwrap_or_else(|e| {
            tracing::debug!(error = %e, "SEEK_DATA/SEEK_HOLE failed; treating the rest as data");
            Some(self.off..self.len)
        })?;
        self.off = r.end;
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use vm_memory::Bytes;

    /// The VmFlags line of the mapping that starts at `addr` in /proc/self/smaps.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut found = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((start, _)) = range.split_once('-')
                && let Ok(start) = usize::from_str_radix(start, 16)
            {
                found = start == addr;
            } else if found && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
        panic!("no mapping at {addr:#x} in /proc/self/smaps");
    }

    #[test]
    fn a_vms_own_ram_asks_for_huge_pages_and_a_forks_view_does_not() {
        let ram = GuestRam::new("thp-test", 8 << 20).unwrap();
        let region = ram.memory().find_region(GuestAddress(0)).unwrap();
        let flags = vm_flags(region.as_ptr() as usize);
        assert!(flags.split(' ').any(|f| f == "hg"), "MADV_HUGEPAGE missing: {flags}");
        ram.freeze().unwrap();
        let child = GuestRam::new_child(&ram).unwrap();
        let region = child.memory().find_region(GuestAddress(0)).unwrap();
        let flags = vm_flags(region.as_ptr() as usize);
        assert!(
            !flags.split(' ').any(|f| f == "hg"),
            "a fork's private view was advised: {flags}"
        );
    }

    #[test]
    fn runs_group_consecutive_pages_but_never_across_the_hole() {
        let h = MMIO_HOLE_START / PAGE;
        assert_eq!(set_bits(&[0b1110, 1 << 63, 1]), vec![1, 2, 3, 127, 128]);
        assert_eq!(
            page_runs([1, 2, 3, 5, 127, 128, h - 2, h - 1, h, h + 1]),
            vec![(1, 3), (5, 1), (127, 2), (h - 2, 2), (h, 2)]
        );
        assert!(page_runs(std::iter::empty()).is_empty());
    }

    #[test]
    fn layout_splits_around_the_hole() {
        assert_eq!(layout(64 << 20), vec![(0, 0, 64 << 20)]);
        assert_eq!(
            layout(4 << 30),
            vec![
                (0, 0, MMIO_HOLE_START),
                (HIGH_RAM_START, MMIO_HOLE_START, (4 << 30) - MMIO_HOLE_START)
            ]
        );
    }

    #[test]
    fn writes_reach_the_memfd_and_mark_the_bitmap() {
        let ram = GuestRam::new("unit", 4 << 20).unwrap();
        ram.memory().write_obj(0xdead_beef_u32, GuestAddress(0x3000)).unwrap();
        let mut b = [0u8; 4];
        ram.memfd().read_exact_at(&mut b, 0x3000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
        let region = ram.memory().find_region(GuestAddress(0)).unwrap();
        let mmap = region.get_mmap();
        let bm = mmap.bitmap();
        assert!(bm.is_addr_set(0x3000));
        assert!(!bm.is_addr_set(0x4000));
    }
}

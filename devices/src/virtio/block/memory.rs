//! A device's own view of guest memory, with its own dirty bitmap.
//!
//! The VMM maps guest RAM once (`GuestMemoryMmap<AtomicBitmap>`). A device
//! gets a second `GuestMemoryMmap` whose regions point at the *same* host
//! mappings (vm-memory non-owning regions, `with_raw_mmap_pointer`) but carry
//! a fresh `AtomicBitmap`. Writes through the view land in the shared pages
//! (the guest and the VMM see them at once) and mark only the view's bitmap,
//! so the fork path can ask exactly "which pages did this device write".

use std::sync::Arc;

use vm_memory::Address;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::bitmap::NewBitmap;
use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

use super::BlockError;
use crate::virtio::{GuestMemoryHandle, GuestMemoryTracked};

/// Builds a view of `mem` over the same host mappings, with fresh (clean)
/// bitmaps of the same page granularity.
///
/// # Safety
///
/// The view borrows `mem`'s mappings through raw pointers and never unmaps
/// them. The caller must keep `mem`'s mappings alive (not drop the VMM's
/// `GuestMemoryMmap` nor anything else that unmaps them) for as long as the
/// view, any clone of it, or any device/worker holding it exists. In k7d the
/// VMM's memory lives for the VM's lifetime and devices are dropped (workers
/// joined) before it.
pub unsafe fn device_view(mem: &GuestMemoryTracked) -> Result<GuestMemoryTracked, BlockError> {
    let mut regions = Vec::new();
    for r in mem.iter() {
        let mmap: &MmapRegion<AtomicBitmap> = r;
        let size = mmap.size();
        let mut builder = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::with_len(size))
            .with_mmap_prot(mmap.prot())
            .with_mmap_flags(mmap.flags());
        if let Some(fo) = mmap.file_offset() {
            builder = builder.with_file_offset(FileOffset::from_arc(fo.arc().clone(), fo.start()));
        }
        // SAFETY: `mmap.as_ptr()` and `size` are exactly an existing mapping
        // of this process (the VMM's region). The caller guarantees it stays
        // mapped while the view exists (see this function's contract); the
        // resulting region is non-owning, so dropping it never unmaps.
        let builder = unsafe { builder.with_raw_mmap_pointer(mmap.as_ptr()) };
        let view = builder.build().map_err(|e| BlockError::MemoryView(e.to_string()))?;
        let region = GuestRegionMmap::new(view, r.start_addr())
            .ok_or_else(|| BlockError::MemoryView("a region wraps the guest address space".into()))?;
        regions.push(region);
    }
    GuestMemoryTracked::from_regions(regions).map_err(|e| BlockError::MemoryView(e.to_string()))
}

/// The page size `AtomicBitmap::with_len` uses (one bit per host page).
fn host_page_size() -> u64 {
    k7d_sys::file::page_size() as u64
}

/// Dirty bits of one region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionDirty {
    /// Guest physical base of the region.
    pub base: GuestAddress,
    /// Region length in bytes.
    pub len: u64,
    /// Bytes per bit.
    pub page_size: u64,
    /// Bit `i` of word `i / 64` (LSB first) is page `i` of the region.
    pub bits: Vec<u64>,
}

impl RegionDirty {
    /// Guest physical addresses of the dirty pages.
    pub fn dirty_addrs(&self) -> impl Iterator<Item = GuestAddress> + '_ {
        self.bits.iter().enumerate().flat_map(move |(w, word)| {
            (0..64)
                .filter(move |b| word & (1u64 << b) != 0)
                .map(move |b| self.base.unchecked_add((w as u64 * 64 + b) * self.page_size))
        })
    }
}

/// A device's memory view plus access to its bitmap, for the VMM's fork
/// path. Cheap to clone.
#[derive(Clone, Debug)]
pub struct DeviceMemory {
    view: GuestMemoryHandle,
}

impl DeviceMemory {
    /// A fresh view of `mem` (see [`device_view`]).
    ///
    /// # Safety
    ///
    /// As [`device_view`]: `mem`'s mappings must outlive the view and every
    /// handle to it.
    pub unsafe fn new(mem: &GuestMemoryTracked) -> Result<Self, BlockError> {
        // SAFETY: forwarded contract (the caller keeps the mappings alive).
        let view = unsafe { device_view(mem)? };
        Ok(Self { view: Arc::new(view) })
    }

    /// Wraps a memory handle as it is (its bitmap is then shared with
    /// whoever else writes through it; tests and single-device setups).
    pub fn shared(mem: GuestMemoryHandle) -> Self {
        Self { view: mem }
    }

    /// The handle to give the transport (`VirtioPciDevice::new`).
    pub fn handle(&self) -> GuestMemoryHandle {
        self.view.clone()
    }

    /// The dirty bitmap as it is now (not cleared).
    pub fn dirty_bitmap(&self) -> Vec<RegionDirty> {
        self.collect(|bm| bm.clone().get_and_reset())
    }

    /// The dirty bitmap, atomically cleared word by word (SeqCst). A write
    /// racing the harvest is kept for the next one (vm-memory marks after
    /// copying); the final harvest must follow a pause of the device.
    pub fn take_dirty(&self) -> Vec<RegionDirty> {
        self.collect(|bm| bm.get_and_reset())
    }

    /// Guest page numbers (`gpa / page_size`) dirty now, ascending.
    pub fn dirty_pages(&self) -> Vec<u64> {
        self.dirty_bitmap()
            .iter()
            .flat_map(|r| r.dirty_addrs().map(|a| a.0 / r.page_size).collect::<Vec<_>>())
            .collect()
    }

    /// Clears every bit.
    pub fn reset_dirty(&self) {
        for r in self.view.iter() {
            (**r).bitmap().reset();
        }
    }

    fn collect(&self, f: impl Fn(&AtomicBitmap) -> Vec<u64>) -> Vec<RegionDirty> {
        self.view
            .iter()
            .map(|r| {
                let bm = (**r).bitmap();
                RegionDirty {
                    base: r.start_addr(),
                    len: r.len(),
                    page_size: host_page_size(),
                    bits: f(bm),
                }
            })
            .collect()
    }
}

impl crate::virtio::RamWriteLog for DeviceMemory {
    fn drain(&self, page: &mut dyn FnMut(GuestAddress)) {
        for region in self.take_dirty() {
            region.dirty_addrs().for_each(&mut *page);
        }
    }
}

//! Guest RAM: ONE memfd, mapped through vm-memory with the dirty-bitmap
//! backend, registered with KVM as one memslot per region with dirty logging.
//!
//! Layout: RAM below the 32-bit MMIO hole sits at GPA 0; what does not fit
//! continues at 4 GiB. Both regions are windows of the same memfd, so a fork
//! (a later issue) can map the whole file privately.

use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use kvm_bindings::{KVM_MEM_LOG_DIRTY_PAGES, kvm_userspace_memory_region};
use kvm_ioctls::VmFd;
use thiserror::Error;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

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
pub struct GuestRam {
    memfd: Arc<File>,
    mem: GuestMemoryMmap,
    size: u64,
}

impl GuestRam {
    /// Creates a memfd of `size` bytes named after the VM and maps it shared.
    pub fn new(vm_id: &str, size: u64) -> Result<Self, MemoryError> {
        let size_mib = size >> 20;
        let memfd = crate::sys::memfd(&format!("k7d-ram-{vm_id}"), size)
            .map_err(|source| MemoryError::Memfd { size_mib, source })?;
        let memfd = Arc::new(memfd);
        let page = NonZeroUsize::new(crate::sys::page_size()).unwrap_or(NonZeroUsize::MIN);
        let mut regions = Vec::new();
        for (gpa, off, len) in layout(size) {
            let len = usize::try_from(len).map_err(|_| MemoryError::Memfd {
                size_mib,
                source: std::io::Error::other("region larger than the address space"),
            })?;
            let region = MmapRegionBuilder::new_with_bitmap(len, AtomicBitmap::new(len, page))
                .with_file_offset(FileOffset::from_arc(memfd.clone(), off))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
                .build()
                .map_err(MemoryError::Mmap)?;
            let region = GuestRegionMmap::new(region, GuestAddress(gpa)).ok_or_else(|| MemoryError::Memfd {
                size_mib,
                source: std::io::Error::other("region wraps the guest address space"),
            })?;
            regions.push(region);
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(MemoryError::Layout)?;
        Ok(Self { memfd, mem, size })
    }

    /// Registers every region with KVM as a memslot, with KVM's dirty log on
    /// or off. Off by default: with it on, KVM write-protects guest pages and
    /// every first write to a page faults, which a Linux boot (decompressing
    /// tens of MiB) pays for at every page. The fork path switches it on when
    /// it prepares a VM as a fork source ([`GuestRam::set_dirty_log`]).
    pub fn register(&self, vm: &VmFd, dirty_log: bool) -> Result<(), MemoryError> {
        for (slot, region) in self.mem.iter().enumerate() {
            let slot = slot as u32;
            let host = self
                .mem
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
            // SAFETY: the region maps `memory_size` bytes at `userspace_addr`, and the
            // mapping lives as long as `self`, which the VM that uses it never outlives
            // (the VM fd is closed before this memory is dropped; see `Vm`'s field order).
            unsafe { vm.set_user_memory_region(r) }.map_err(|source| MemoryError::Memslot { slot, source })?;
        }
        Ok(())
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

    /// The memfd backing all of RAM.
    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// RAM size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The memfd's fd number (for diagnostics).
    pub fn memfd_raw(&self) -> i32 {
        self.memfd.as_raw_fd()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use vm_memory::Bytes;

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

//! Helpers shared by the device integration tests (each test binary uses
//! some of them).
#![allow(dead_code)]

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use k7d_devices::virtio::GuestMemoryTracked;
use vm_memory::bitmap::{AtomicBitmap, NewBitmap};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestRegionMmap};

/// Guest RAM as the VMM has it: a memfd of `size` bytes, MAP_SHARED, with
/// the VMM's bitmap.
pub fn memfd_memory(size: usize, name: &CStr) -> Arc<GuestMemoryTracked> {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is owned below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64).unwrap();
    let region = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::with_len(size))
        .with_file_offset(FileOffset::new(file, 0))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .build()
        .unwrap();
    Arc::new(GuestMemoryTracked::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()]).unwrap())
}

/// A non-blocking datagram socket pair: the first end stands in for a tap
/// queue (frames written to it are read whole from the second, and back).
pub fn socketpair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair writes two descriptors into the live 2-int array.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: two fresh descriptors nothing else owns.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

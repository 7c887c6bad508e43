//! Raw tap-queue I/O for the workers: `writev` of a TX chain, `read` of one
//! frame, attaching/detaching a queue (`TUNSETQUEUE`), and the mapping of
//! the guest's accepted features to `TUNSETOFFLOAD` bits.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use virtio_bindings::virtio_net::{VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6};

/// `TUNSETOFFLOAD` bits for the offloads the guest accepted on RX. TSO needs
/// checksum offload (the kernel refuses TSO without `TUN_F_CSUM`, and the
/// virtio spec makes `GUEST_TSO*` depend on `GUEST_CSUM`).
pub(super) fn offload_flags(acked: u64) -> u32 {
    let has = |bit: u32| acked & (1u64 << bit) != 0;
    if !has(VIRTIO_NET_F_GUEST_CSUM) {
        return 0;
    }
    let mut flags = k7d_net::TUN_F_CSUM;
    if has(VIRTIO_NET_F_GUEST_TSO4) {
        flags |= k7d_net::TUN_F_TSO4;
    }
    if has(VIRTIO_NET_F_GUEST_TSO6) {
        flags |= k7d_net::TUN_F_TSO6;
    }
    flags
}

/// Writes one frame gathered from `iov` (each entry points into guest memory
/// or a local buffer that outlives the call); returns the bytes written.
pub(super) fn writev(fd: &OwnedFd, iov: &[libc::iovec]) -> io::Result<usize> {
    let cnt = libc::c_int::try_from(iov.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `iov` is a live slice of `cnt` iovecs; the caller guarantees each
    // one describes readable memory that stays mapped for the call (guest RAM
    // held by the worker's `Arc`), and writev only reads it.
    let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), cnt) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Sets the size of the virtio-net header the tap queue reads and writes
/// (`TUNSETVNETHDRSZ`).
pub(super) fn set_vnet_hdr_size(fd: &OwnedFd, size: usize) -> io::Result<()> {
    let size = libc::c_int::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which points
    // at a live local; the fd is an open tap queue.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ, &size as *const libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads one frame into `buf`.
pub(super) fn read(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

#[repr(C)]
struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Attaches (`true`) or detaches a queue of a multiqueue tap. A detached
/// queue gets no frames from the kernel.
pub(super) fn set_attached(fd: &OwnedFd, attach: bool) -> io::Result<()> {
    let mut req = IfReqFlags {
        name: [0; libc::IFNAMSIZ],
        flags: (if attach {
            libc::IFF_ATTACH_QUEUE
        } else {
            libc::IFF_DETACH_QUEUE
        }) as libc::c_short,
        _pad: [0; 22],
    };
    // SAFETY: TUNSETQUEUE reads a `struct ifreq` (40 bytes, flags at offset
    // 16); `req` is a live #[repr(C)] value of that size and the fd is an open
    // tap queue.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETQUEUE, &mut req as *mut IfReqFlags) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        // Attaching an attached queue / detaching a detached one is EINVAL;
        // the state is what was asked for.
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloads_follow_the_guest() {
        let b = |bit: u32| 1u64 << bit;
        assert_eq!(offload_flags(0), 0);
        assert_eq!(
            offload_flags(b(VIRTIO_NET_F_GUEST_TSO4)),
            0,
            "TSO without CSUM is not set"
        );
        assert_eq!(offload_flags(b(VIRTIO_NET_F_GUEST_CSUM)), k7d_net::TUN_F_CSUM);
        assert_eq!(
            offload_flags(b(VIRTIO_NET_F_GUEST_CSUM) | b(VIRTIO_NET_F_GUEST_TSO4) | b(VIRTIO_NET_F_GUEST_TSO6)),
            k7d_net::TUN_F_CSUM | k7d_net::TUN_F_TSO4 | k7d_net::TUN_F_TSO6
        );
    }
}

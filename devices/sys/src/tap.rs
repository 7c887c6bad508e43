//! Tap queues: opening one (`TUNSETIFF`), its virtio-net header size, the
//! offloads it may hand the guest, and attaching it (`TUNSETQUEUE`).
//! Creating the link and bringing it up is netlink work (`k7d_net::create_tap`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

/// `TUNSETOFFLOAD` bit: the tap may hand over frames with partial checksums.
pub const TUN_F_CSUM: u32 = 0x01;
/// `TUNSETOFFLOAD` bit: TCPv4 segmentation offload.
pub const TUN_F_TSO4: u32 = 0x02;
/// `TUNSETOFFLOAD` bit: TCPv6 segmentation offload.
pub const TUN_F_TSO6: u32 = 0x04;

/// Length of the virtio-net header k7d's taps carry (`virtio_net_hdr_v1`,
/// also the `mrg_rxbuf` layout).
pub const VNET_HDR_LEN: usize = 12;

/// A tap device and one fd per queue (the VMM's side).
#[derive(Debug)]
pub struct Tap {
    /// Interface name.
    pub name: String,
    /// Interface index.
    pub ifindex: u32,
    /// One fd per queue pair (`IFF_MULTI_QUEUE` when more than one).
    pub queues: Vec<OwnedFd>,
    /// Whether frames carry a [`VNET_HDR_LEN`]-byte virtio-net header.
    pub vnet_hdr: bool,
}

impl Tap {
    /// Tells every queue which offloads the guest accepted (`TUN_F_*` bits).
    pub fn set_offload(&self, flags: u32) -> io::Result<()> {
        self.queues.iter().try_for_each(|fd| set_offload(fd, flags))
    }
}

#[repr(C)]
struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl IfReqFlags {
    fn new(flags: libc::c_int) -> Self {
        Self {
            name: [0; libc::IFNAMSIZ],
            flags: flags as libc::c_short,
            _pad: [0; 22],
        }
    }
}

/// Opens `/dev/net/tun` (close-on-exec, non-blocking) and binds the fd to tap
/// `name` (created in the calling thread's netns if missing) with
/// `IFF_TAP|IFF_NO_PI`, plus `IFF_VNET_HDR` ([`VNET_HDR_LEN`] bytes) and
/// `IFF_MULTI_QUEUE` when asked.
pub fn open_queue(name: &str, vnet_hdr: bool, multi_queue: bool) -> io::Result<OwnedFd> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.as_bytes().contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad interface name"));
    }
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open("/dev/net/tun")?;
    let mut flags = libc::IFF_TAP | libc::IFF_NO_PI;
    if vnet_hdr {
        flags |= libc::IFF_VNET_HDR;
    }
    if multi_queue {
        flags |= libc::IFF_MULTI_QUEUE;
    }
    let mut req = IfReqFlags::new(flags);
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq` (40 bytes: name +
    // union); `req` is a live, correctly sized #[repr(C)] value and the fd is
    // an open /dev/net/tun file owned by `file`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut IfReqFlags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = OwnedFd::from(file);
    if vnet_hdr {
        set_vnet_hdr_size(&fd, VNET_HDR_LEN)?;
    }
    Ok(fd)
}

/// Sets the offloads of a tap queue fd (`TUN_F_*` bits).
pub fn set_offload(fd: &impl AsRawFd, flags: u32) -> io::Result<()> {
    // SAFETY: TUNSETOFFLOAD takes its argument by value (an unsigned long);
    // no memory is passed.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETOFFLOAD, flags as libc::c_ulong) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the size of the virtio-net header a tap queue reads and writes
/// (`TUNSETVNETHDRSZ`).
pub fn set_vnet_hdr_size(fd: &impl AsRawFd, size: usize) -> io::Result<()> {
    let size = libc::c_int::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which points
    // at a live local; the fd is an open tap queue.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ, &size as *const libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Attaches (`true`) or detaches a queue of a multiqueue tap. A detached
/// queue gets no frames from the kernel. Asking for the state a queue is
/// already in succeeds.
pub fn set_attached(fd: &impl AsRawFd, attach: bool) -> io::Result<()> {
    let mut req = IfReqFlags::new(if attach {
        libc::IFF_ATTACH_QUEUE
    } else {
        libc::IFF_DETACH_QUEUE
    });
    // SAFETY: TUNSETQUEUE reads a `struct ifreq` (40 bytes, flags at offset
    // 16); `req` is a live #[repr(C)] value of that size and the fd is an
    // open tap queue.
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
    fn an_ifreq_has_the_kernels_size() {
        assert_eq!(std::mem::size_of::<IfReqFlags>(), 40);
    }

    #[test]
    fn bad_names_are_refused_before_any_syscall() {
        for name in ["", "a-name-of-16-chr", "nul\0"] {
            assert_eq!(
                open_queue(name, true, false).unwrap_err().kind(),
                io::ErrorKind::InvalidInput,
                "{name:?}"
            );
        }
    }
}

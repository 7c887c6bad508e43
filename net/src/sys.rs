//! Every `unsafe` of k7d-net lives here: tun ioctls, setns, statfs/mount of
//! bpffs, and raw reads/writes on tap fds.
use std::{
    ffi::CString,
    fs::{File, OpenOptions},
    io,
    os::fd::{AsRawFd, OwnedFd},
    path::Path,
};

/// Offloads a tap can be told about (TUNSETOFFLOAD bits).
pub const TUN_F_CSUM: u32 = 0x01;
pub const TUN_F_TSO4: u32 = 0x02;
pub const TUN_F_TSO6: u32 = 0x04;

const IFNAMSIZ: usize = 16;

#[repr(C)]
struct IfReqFlags {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Opens `/dev/net/tun` and binds the fd to tap `name` (created in the
/// calling thread's netns if missing) with `IFF_TAP|IFF_NO_PI`, plus
/// `IFF_VNET_HDR` and `IFF_MULTI_QUEUE` when asked.
pub fn open_tap_queue(name: &str, vnet_hdr: bool, multi_queue: bool) -> io::Result<OwnedFd> {
    if name.is_empty() || name.len() >= IFNAMSIZ || name.as_bytes().contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad interface name"));
    }
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags_cloexec_nonblock()
        .open("/dev/net/tun")?;
    let mut req = IfReqFlags {
        name: [0; IFNAMSIZ],
        flags: 0,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    let mut flags = libc::IFF_TAP | libc::IFF_NO_PI;
    if vnet_hdr {
        flags |= libc::IFF_VNET_HDR;
    }
    if multi_queue {
        flags |= libc::IFF_MULTI_QUEUE;
    }
    req.flags = flags as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq` (40 bytes: name +
    // union); `req` is a live, correctly sized #[repr(C)] value and the fd is
    // an open /dev/net/tun file owned by `file`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut IfReqFlags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if vnet_hdr {
        let size: libc::c_int = 12; // virtio_net_hdr_v1 / mrg_rxbuf
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which
        // points at a live local.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &size as *const libc::c_int) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(OwnedFd::from(file))
}

/// Sets the offloads of a tap queue fd (`TUN_F_*` bits).
pub fn set_tap_offload(fd: &OwnedFd, flags: u32) -> io::Result<()> {
    // SAFETY: TUNSETOFFLOAD takes its argument by value (an unsigned long);
    // no memory is passed.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETOFFLOAD, flags as libc::c_ulong) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

trait CloexecNonblock {
    fn custom_flags_cloexec_nonblock(&mut self) -> &mut Self;
}

impl CloexecNonblock for OpenOptions {
    fn custom_flags_cloexec_nonblock(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
    }
}

/// Moves the calling thread into the network namespace open at `ns`.
pub fn setns_net(ns: &File) -> io::Result<()> {
    // SAFETY: setns only reads the fd number; `ns` keeps it open for the call.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// True when `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> io::Result<bool> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))?;
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated string and `st` a live, writable
    // statfs for the kernel to fill.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::try_from(st.f_type).ok() == u64::try_from(libc::BPF_FS_MAGIC).ok())
}

/// Mounts a bpf filesystem at `path` (which must exist).
pub fn mount_bpffs(path: &Path) -> io::Result<()> {
    let target = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))?;
    let fstype = c"bpf";
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the
    // call; data is null, which mount(2) accepts for bpffs.
    let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `read(2)` into `buf`.
pub fn read_fd(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// `write(2)` of `buf`.
pub fn write_fd(fd: &OwnedFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, readable slice of `buf.len()` bytes.
    let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Waits until `fd` is readable or `timeout_ms` passes; true when readable.
pub fn poll_readable(fd: &OwnedFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd is passed with count 1.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0 && (p.revents & libc::POLLIN) != 0)
}

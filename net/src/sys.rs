//! Every `unsafe` of k7d-net lives here: statfs/mount of bpffs. Tap
//! queues, raw fd I/O and setns are `k7d_sys`'s.
use std::{ffi::CString, io, path::Path};

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

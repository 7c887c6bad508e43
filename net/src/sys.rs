//! bpffs: whether a path is on one, and mounting one (through
//! `k7d_sys::mount`, where every mount and statfs of k7d is wrapped). Tap
//! queues, raw fd I/O and setns are `k7d_sys`'s too: k7d-net has no
//! `unsafe` of its own.
use std::{ffi::CString, io, path::Path};

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))
}

/// True when `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> io::Result<bool> {
    let t = k7d_sys::mount::filesystem_type(&c_path(path)?)?;
    Ok(u64::try_from(t).ok() == u64::try_from(libc::BPF_FS_MAGIC).ok())
}

/// Mounts a bpf filesystem at `path` (which must exist).
pub fn mount_bpffs(path: &Path) -> io::Result<()> {
    k7d_sys::mount::mount(Some(c"bpf"), &c_path(path)?, Some(c"bpf"), 0, None)
}

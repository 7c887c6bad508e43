//! Mounts and the filesystems under paths: `mount(2)`, a lazy unmount, a
//! mount namespace of one's own, `statfs(2)`'s filesystem type and
//! `statx(2)`'s mount-root attribute. [`mount`] and
//! [`unshare_mount_namespace`] allocate nothing: a forked child may call
//! them before it execs.

use std::ffi::CStr;
use std::io;

/// `mount(2)`: `source` at `target`, of type `fstype`, with `flags`
/// (`MS_*`) and filesystem `data`; `None` passes a null pointer.
pub fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let ptr = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is null or a NUL-terminated string the caller
    // keeps alive for the call; the kernel keeps none of them.
    let rc = unsafe { libc::mount(ptr(source), target.as_ptr(), ptr(fstype), flags, ptr(data).cast()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A bind mount of `source` at `target`.
pub fn bind(source: &CStr, target: &CStr) -> io::Result<()> {
    mount(Some(source), target, None, libc::MS_BIND, None)
}

/// Makes every mount under `/` of the calling process's mount namespace
/// private (`MS_REC | MS_PRIVATE`): nothing mounted afterwards propagates
/// to a namespace it was copied from.
pub fn make_private() -> io::Result<()> {
    mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)
}

/// `umount2(target, MNT_DETACH)`: detaches what is mounted at `target`.
pub fn unmount_detach(target: &CStr) -> io::Result<()> {
    // SAFETY: `target` is a NUL-terminated path kept alive for the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `unshare(CLONE_NEWNS)`: the calling process gets a mount namespace of
/// its own (a copy of the one it had).
pub fn unshare_mount_namespace() -> io::Result<()> {
    // SAFETY: unshare takes flags only.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `cmd`'s child, between its fork and its exec, enter a mount
/// namespace of its own (private, so nothing propagates back) and bind
/// each `(source, target)` of `binds` there: the binds exist only for that
/// program and vanish with it.
pub fn bind_in_child(cmd: &mut std::process::Command, binds: Vec<(std::ffi::CString, std::ffi::CString)>) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and makes
    // only async-signal-safe system calls (unshare, mount: this module's
    // wrappers allocate nothing) on C strings built before the fork.
    unsafe {
        cmd.pre_exec(move || {
            unshare_mount_namespace()?;
            // Private first: a bind made under a shared root would
            // propagate to the namespace it was copied from.
            make_private()?;
            for (src, at) in &binds {
                bind(src, at)?;
            }
            Ok(())
        });
    }
}

/// The type (`statfs(2)`'s `f_type`, a filesystem magic) of the
/// filesystem `path` is on.
pub fn filesystem_type(path: &CStr) -> io::Result<i64> {
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` a live, writable `statfs`.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// Whether `path` (not followed if a symlink) is the root of a mount:
/// `statx(2)`'s `STATX_ATTR_MOUNT_ROOT` (a bind of a directory on the same
/// filesystem keeps its device number, so the device alone cannot tell).
pub fn is_mount_root(path: &CStr) -> io::Result<bool> {
    // SAFETY: an all-zero `statx` is a valid value of this plain C struct.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` a live, writable `statx`.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS,
            &mut st,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let bit = libc::STATX_ATTR_MOUNT_ROOT as u64;
    Ok(st.stx_attributes_mask & bit != 0 && st.stx_attributes & bit != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_a_mount_root_and_proc_is_procfs() {
        assert!(is_mount_root(c"/").unwrap());
        assert!(!is_mount_root(c"/proc/self/status").unwrap());
        assert_eq!(filesystem_type(c"/proc").unwrap(), libc::PROC_SUPER_MAGIC);
        let e = filesystem_type(c"/no/such/path").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}

//! PID 1 leaves the initramfs for a tmpfs root, as `switch_root` does, so
//! that runc can `pivot_root` into each container's rootfs. The kernel's
//! rootfs can never be pivoted away from, and runc's `--no-pivot` fallback
//! confines a container by a chroot only, which a process holding
//! `CAP_SYS_CHROOT` (a default capability) can leave for the pod VM's root.
//!
//! The initramfs's files are copied onto a tmpfs (all but `/init`, the
//! running agent), the originals deleted (their memory comes back), the
//! tmpfs moved onto `/` and entered with `chroot`. A failure before the
//! deletion leaves the initramfs as it was (runc then runs `--no-pivot`);
//! nothing is mounted yet, so the deletion never crosses a mount.

use crate::sys;
use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Where the new root is built.
const NEW_ROOT: &str = "/.k7d-root";
/// ramfs and tmpfs: what the kernel's rootfs is.
const RAMFS_MAGIC: i64 = 0x8584_58f6;
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Leaves the initramfs when `/` is the kernel's rootfs (PID 1, before any
/// mount); true when the root is now a tmpfs.
pub fn leave_initramfs() -> bool {
    let root = Path::new("/");
    match sys::fs_magic(root) {
        Ok(m) if m == RAMFS_MAGIC || m == TMPFS_MAGIC => {}
        Ok(_) => return false,
        Err(e) => {
            crate::log!("statfs of / failed: {e}; the root stays");
            return false;
        }
    }
    let new = Path::new(NEW_ROOT);
    if let Err(e) = build(new) {
        crate::log!("building a tmpfs root failed: {e}; runc will run --no-pivot");
        let _ = sys::umount_detach(new);
        let _ = std::fs::remove_dir(new);
        return false;
    }
    remove_old(root, new);
    match enter(new) {
        Ok(()) => true,
        Err(e) => {
            crate::log!("moving the tmpfs root onto / failed: {e}");
            false
        }
    }
}

/// Mounts a tmpfs at `new` and copies the initramfs into it.
fn build(new: &Path) -> io::Result<()> {
    std::fs::create_dir(new)?;
    sys::mount(OsStr::new("tmpfs"), new, "tmpfs", 0, Some("mode=0755"))?;
    copy_tree(Path::new("/"), new, &[OsStr::new(".k7d-root"), OsStr::new("init")])
}

/// Copies the tree at `src` into the existing directory `dst`: directories
/// (with their modes), regular files (content and mode) and symbolic links;
/// device nodes, fifos and sockets are left out. Top-level names in `skip`
/// are left out too.
pub fn copy_tree(src: &Path, dst: &Path, skip: &[&OsStr]) -> io::Result<()> {
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let name = entry.file_name();
        if skip.contains(&name.as_os_str()) {
            continue;
        }
        let (from, to) = (entry.path(), dst.join(&name));
        let md = std::fs::symlink_metadata(&from)?;
        let ft = md.file_type();
        if ft.is_dir() {
            std::fs::create_dir(&to)?;
            copy_tree(&from, &to, &[])?;
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(md.mode() & 0o7777))?;
        } else if ft.is_file() {
            std::fs::copy(&from, &to)?;
        } else if ft.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&from)?, &to)?;
        }
    }
    Ok(())
}

/// Deletes the initramfs's entries but `new`, never crossing into another
/// filesystem (an entry on another device is left alone).
fn remove_old(root: &Path, new: &Path) {
    let Ok(root_dev) = std::fs::symlink_metadata(root).map(|m| m.dev()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let p = entry.path();
        if p == new {
            continue;
        }
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if md.dev() != root_dev {
            continue;
        }
        let r = if md.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        if let Err(e) = r {
            crate::log!("removing {} from the initramfs failed: {e}", p.display());
        }
    }
}

/// Moves the mount at `new` onto `/` and makes it this process's root.
fn enter(new: &Path) -> io::Result<()> {
    std::env::set_current_dir(new)?;
    sys::move_mount(Path::new("."), Path::new("/"))?;
    sys::chroot(Path::new("."))?;
    std::env::set_current_dir("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_is_copied_with_modes_and_links_and_without_skipped_or_special_entries() {
        let d = std::env::temp_dir().join(format!("k7d-agent-newroot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let (src, dst) = (d.join("src"), d.join("dst"));
        std::fs::create_dir_all(src.join("usr/sbin")).unwrap();
        std::fs::create_dir_all(src.join("tmp")).unwrap();
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::write(src.join("usr/sbin/runc"), b"elf").unwrap();
        std::fs::set_permissions(src.join("usr/sbin/runc"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(src.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        std::os::unix::fs::symlink("usr/sbin", src.join("sbin")).unwrap();
        std::fs::write(src.join("init"), b"agent").unwrap();
        let sock = std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();
        copy_tree(&src, &dst, &[OsStr::new("init")]).unwrap();
        assert_eq!(std::fs::read(dst.join("usr/sbin/runc")).unwrap(), b"elf");
        let mode = |p: &str| std::fs::metadata(dst.join(p)).unwrap().mode() & 0o7777;
        assert_eq!(mode("usr/sbin/runc"), 0o755);
        assert_eq!(mode("tmp"), 0o1777);
        assert_eq!(std::fs::read_link(dst.join("sbin")).unwrap(), Path::new("usr/sbin"));
        assert!(!dst.join("init").exists(), "skipped");
        assert!(!dst.join("sock").exists(), "a socket is left out");
        drop(sock);
        std::fs::remove_dir_all(&d).unwrap();
    }
}

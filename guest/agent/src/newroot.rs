//! PID 1 leaves the initramfs for a tmpfs root, as `switch_root` does, so
//! that runc can `pivot_root` into each container's rootfs. The kernel's
//! rootfs can never be pivoted away from, and runc's `--no-pivot` fallback
//! confines a container by a chroot only, which a process holding
//! `CAP_SYS_CHROOT` (a default capability) can leave for the pod VM's root.
//!
//! The initramfs's files are copied onto a tmpfs (all but `/init`, the
//! running agent), the originals deleted (their memory comes back; the
//! deletion never crosses into another filesystem), the tmpfs moved onto
//! `/` and entered with `chroot`. A failure before the deletion leaves the
//! initramfs as it was; one after it still enters the copy (by `chroot`
//! alone); in both cases runc then runs `--no-pivot`.

use crate::sys;
use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

/// Where the new root is built.
const NEW_ROOT: &str = "/.k7d-root";
/// ramfs and tmpfs: what the kernel's rootfs is.
const RAMFS_MAGIC: i64 = 0x8584_58f6;
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Where PID 1's root ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Root {
    /// A tmpfs mounted on `/`: runc can pivot.
    Tmpfs,
    /// Left as it was (not the kernel's rootfs, or the copy failed).
    Unchanged,
    /// The copy is the root by `chroot` alone (moving it onto `/` failed
    /// after the initramfs was emptied): runc must run `--no-pivot`.
    ChrootOnly,
}

/// Leaves the initramfs when `/` is the kernel's rootfs (PID 1, before any
/// mount).
pub fn leave_initramfs() -> Root {
    let root = Path::new("/");
    match sys::fs_magic(root) {
        Ok(m) if m == RAMFS_MAGIC || m == TMPFS_MAGIC => {}
        Ok(_) => return Root::Unchanged,
        Err(e) => {
            crate::log!("statfs of / failed: {e}; the root stays");
            return Root::Unchanged;
        }
    }
    let new = Path::new(NEW_ROOT);
    if let Err(e) = build(new).and_then(|()| std::env::set_current_dir(new)) {
        crate::log!("building a tmpfs root failed: {e}; runc will run --no-pivot");
        let _ = sys::umount_detach(new);
        let _ = std::fs::remove_dir(new);
        return Root::Unchanged;
    }
    remove_old(root, new);
    if let Err(e) = sys::move_mount(Path::new("."), root) {
        crate::log!("moving the tmpfs root onto / failed: {e}; entering it by chroot only");
        return match sys::chroot(Path::new(".")).and_then(|()| std::env::set_current_dir("/")) {
            Ok(()) => Root::ChrootOnly,
            Err(e) => {
                crate::log!("entering the tmpfs root failed: {e}");
                Root::ChrootOnly
            }
        };
    }
    match sys::chroot(Path::new(".")).and_then(|()| std::env::set_current_dir("/")) {
        Ok(()) => Root::Tmpfs,
        Err(e) => {
            crate::log!("entering the tmpfs root on / failed: {e}");
            Root::ChrootOnly
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
        } else if ft.is_char_device() || ft.is_block_device() {
            // /dev/console: PID 1's fallback if devtmpfs cannot be mounted.
            sys::mknod(&to, md.mode(), md.rdev())?;
        }
    }
    Ok(())
}

/// Deletes the initramfs's entries but `new`, never crossing into another
/// filesystem: an entry on another device, at any depth, is left alone.
pub fn remove_old(root: &Path, new: &Path) {
    let Ok(root_dev) = std::fs::symlink_metadata(root).map(|m| m.dev()) else {
        return;
    };
    if let Err(e) = remove_children(root, root_dev, Some(new)) {
        crate::log!("emptying the initramfs failed: {e}");
    }
}

/// Removes everything under `dir` on device `dev` but `keep`.
fn remove_children(dir: &Path, dev: u64, keep: Option<&Path>) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        if Some(p.as_path()) == keep {
            continue;
        }
        let md = std::fs::symlink_metadata(&p)?;
        if md.dev() != dev {
            continue;
        }
        // One entry that cannot go must not keep the rest in RAM.
        let r = if md.is_dir() {
            remove_children(&p, dev, None).and_then(|()| std::fs::remove_dir(&p))
        } else {
            std::fs::remove_file(&p)
        };
        if let Err(e) = r {
            crate::log!("removing {} from the initramfs failed: {e}", p.display());
        }
    }
    Ok(())
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

    #[test]
    fn emptying_a_tree_keeps_the_named_entry_and_other_filesystems() {
        let d = std::env::temp_dir().join(format!("k7d-agent-empty-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("a/b")).unwrap();
        std::fs::create_dir_all(d.join("keep")).unwrap();
        std::fs::write(d.join("a/b/f"), b"x").unwrap();
        std::fs::write(d.join("keep/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/", d.join("link")).unwrap();
        // A directory on another filesystem (/proc) stands for a mount.
        let dev = std::fs::symlink_metadata(&d).unwrap().dev();
        remove_children(&d, dev, Some(&d.join("keep"))).unwrap();
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["keep"]);
        assert!(d.join("keep/f").exists());
        let proc_dev = std::fs::symlink_metadata("/proc").unwrap().dev();
        assert_ne!(proc_dev, dev);
        remove_children(Path::new("/proc/self"), dev, None).unwrap();
        assert!(
            Path::new("/proc/self/status").exists(),
            "another filesystem is not touched"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}

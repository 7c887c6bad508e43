//! A container's root filesystem: the image disk found by its virtio-blk
//! serial, mounted read-only, under an overlay whose writable layer is a
//! tmpfs.
//!
//! Why the writable layer is guest tmpfs: nothing on the host to create or
//! clean up; it lives in guest RAM, so a VM fork shares it copy-on-write
//! with the rest of memory; and a pod's writes die with its VM, as a
//! container's writable layer dies with the container.

use crate::sys;
use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How often sysfs is looked at while a disk is awaited.
const POLL: Duration = Duration::from_millis(20);

/// A block device found in sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disk {
    /// Its kernel name (`vdb`).
    pub name: String,
    /// Its major and minor numbers.
    pub major: u32,
    /// See `major`.
    pub minor: u32,
}

/// Whether `s` is a serial the agent looks for: 1..=64 printable ASCII
/// characters, no whitespace (virtio-blk serials are at most 20 bytes).
pub fn valid_serial(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Whether `s` is a filesystem type name the agent passes to `mount`.
pub fn valid_fstype(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
}

fn parse_dev(text: &str) -> Option<(u32, u32)> {
    let (maj, min) = text.trim().split_once(':')?;
    Some((maj.parse().ok()?, min.parse().ok()?))
}

/// Looks once through `<sysfs>/block/vd*` for the disk whose `serial` is
/// `serial` (trailing NULs and whitespace ignored) and that has a medium:
/// an empty drive (a pod VM's slot before the shim puts an image in it)
/// has size 0 until the kernel handled the capacity change. With
/// `sectors`, only a disk of exactly that size is the one.
pub fn find_by_serial(sysfs: &Path, serial: &str, sectors: Option<u64>) -> Option<Disk> {
    let entries = std::fs::read_dir(sysfs.join("block")).ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("vd") {
            continue;
        }
        let dir = entry.path();
        let Ok(found) = std::fs::read(dir.join("serial")) else {
            continue;
        };
        let found = String::from_utf8_lossy(&found);
        if found.trim_end_matches(|c: char| c == '\0' || c.is_whitespace()) != serial {
            continue;
        }
        let size = std::fs::read_to_string(dir.join("size"))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok());
        if size.is_none_or(|n| n == 0 || sectors.is_some_and(|want| want != n)) {
            continue;
        }
        let Ok(dev) = std::fs::read_to_string(dir.join("dev")) else {
            continue;
        };
        let Some((major, minor)) = parse_dev(&dev) else {
            continue;
        };
        return Some(Disk {
            name: name.to_owned(),
            major,
            minor,
        });
    }
    None
}

/// [`find_by_serial`], polled every 20 ms for up to `timeout` (the disk may
/// still be enumerating).
pub fn wait_by_serial(sysfs: &Path, serial: &str, sectors: Option<u64>, timeout: Duration) -> Option<Disk> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(d) = find_by_serial(sysfs, serial, sectors) {
            return Some(d);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// A path to a block node for `disk`: `<dev>/<name>` when it is that
/// device, else a node made at `fallback`.
pub fn device_node(disk: &Disk, dev: &Path, fallback: &Path) -> io::Result<PathBuf> {
    let p = dev.join(&disk.name);
    if let Ok(m) = std::fs::metadata(&p)
        && m.file_type().is_block_device()
        && m.rdev() == libc::makedev(disk.major, disk.minor)
    {
        return Ok(p);
    }
    sys::mknod_block(fallback, disk.major, disk.minor)?;
    Ok(fallback.to_path_buf())
}

/// Unmounts an image's own mount (the erofs of a drive) for good: not
/// detached, so that when this returns true nothing holds the image's
/// superblock and the drive may take another medium (a lazily detached
/// mount could keep it, and the next mount of the device would reuse it).
/// Retries for a second while the mount is busy; then detaches it and
/// answers false (the drive must not be reused).
pub fn unmount_image(target: &Path) -> bool {
    for _ in 0..50 {
        match sys::umount(target) {
            Ok(()) => return true,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => return true,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::sleep(POLL),
            Err(e) => {
                crate::log!("unmounting {} failed: {e}", target.display());
                return false;
            }
        }
    }
    crate::log!("{} stayed busy; detached, its drive is not reused", target.display());
    let _ = sys::umount_detach(target);
    false
}

/// Unmounts (detaching) each of `mounts` in the order given, every one even
/// when another fails; true when none is left mounted. A path that is not
/// a mount point (never mounted) or is gone counts as unmounted.
pub fn unmount_all<'a>(mounts: impl IntoIterator<Item = &'a PathBuf>) -> bool {
    let mut clean = true;
    for m in mounts {
        match sys::umount_detach(m) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {}
            Err(e) => {
                crate::log!("unmounting {} failed: {e}", m.display());
                clean = false;
            }
        }
    }
    clean
}

/// The mounts under a bundle directory, in mount order.
#[derive(Debug)]
pub struct RootfsMounts {
    /// The image, read-only.
    pub lower: PathBuf,
    /// The tmpfs holding `upper` and `work`.
    pub rw: PathBuf,
    /// The overlay: the container's root.
    pub rootfs: PathBuf,
}

impl RootfsMounts {
    /// The mount points under `bundle`.
    pub fn under(bundle: &Path) -> RootfsMounts {
        RootfsMounts {
            lower: bundle.join("lower"),
            rw: bundle.join("rw"),
            rootfs: bundle.join("rootfs"),
        }
    }

    /// Mounts `device` (`fstype`, read-only) at `lower`, a tmpfs at `rw` and
    /// the overlay at `rootfs`. On failure, what was mounted is unmounted.
    pub fn mount(&self, device: &Path, fstype: &str) -> Result<(), String> {
        for d in [&self.lower, &self.rw, &self.rootfs] {
            std::fs::create_dir_all(d).map_err(|e| format!("creating {} failed: {e}", d.display()))?;
        }
        sys::mount(
            device.as_os_str(),
            &self.lower,
            fstype,
            libc::MS_RDONLY | libc::MS_NODEV,
            None,
        )
        .map_err(|e| {
            format!(
                "mounting the image disk {} ({fstype}) read-only failed: {e}",
                device.display()
            )
        })?;
        if let Err(e) = sys::mount(
            OsStr::new("tmpfs"),
            &self.rw,
            "tmpfs",
            libc::MS_NODEV,
            Some("mode=0755"),
        ) {
            self.unmount();
            return Err(format!(
                "mounting the writable tmpfs at {} failed: {e}",
                self.rw.display()
            ));
        }
        let (upper, work) = (self.rw.join("upper"), self.rw.join("work"));
        for d in [&upper, &work] {
            if let Err(e) = std::fs::create_dir(d) {
                self.unmount();
                return Err(format!("creating {} failed: {e}", d.display()));
            }
        }
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            self.lower.display(),
            upper.display(),
            work.display()
        );
        if let Err(e) = sys::mount(OsStr::new("overlay"), &self.rootfs, "overlay", 0, Some(&opts)) {
            self.unmount();
            return Err(format!("mounting the overlay at {} failed: {e}", self.rootfs.display()));
        }
        Ok(())
    }

    /// Unmounts (detaching) the overlay, the tmpfs and the image; true when
    /// none is left mounted (so the directory may be removed).
    pub fn unmount(&self) -> bool {
        let upper = unmount_all([&self.rootfs, &self.rw]);
        unmount_image(&self.lower) && upper
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_sysfs(tag: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("k7d-agent-sysfs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (name, serial, dev) in [
            ("vda", "k7d-disk0\n", "254:0\n"),
            ("vdb", "k7d-disk1\0\0\0", "254:16\n"),
            ("sda", "k7d-disk2", "8:0"),
        ] {
            let d = root.join("block").join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("serial"), serial).unwrap();
            std::fs::write(d.join("dev"), dev).unwrap();
            std::fs::write(d.join("size"), "16\n").unwrap();
        }
        root
    }

    #[test]
    fn a_disk_is_found_by_its_serial_with_padding_trimmed() {
        let root = fake_sysfs("find");
        assert_eq!(
            find_by_serial(&root, "k7d-disk1", None),
            Some(Disk {
                name: "vdb".into(),
                major: 254,
                minor: 16
            })
        );
        assert_eq!(
            find_by_serial(&root, "k7d-disk0", None).map(|d| d.name),
            Some("vda".into())
        );
        assert_eq!(find_by_serial(&root, "k7d-disk2", None), None, "only virtio disks");
        assert_eq!(find_by_serial(&root, "k7d-disk", None), None, "no prefix match");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_empty_drive_is_found_once_its_medium_is_in() {
        let root = fake_sysfs("medium");
        let d = root.join("block/vdc");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("serial"), "k7d-disk3").unwrap();
        std::fs::write(d.join("dev"), "254:32\n").unwrap();
        std::fs::write(d.join("size"), "0\n").unwrap();
        assert_eq!(find_by_serial(&root, "k7d-disk3", None), None, "no medium yet");
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            // The previous medium's size first, then the awaited one's.
            std::fs::write(d.join("size"), "2048\n").unwrap();
            std::thread::sleep(Duration::from_millis(100));
            std::fs::write(d.join("size"), "4096\n").unwrap();
        });
        assert_eq!(
            wait_by_serial(&root, "k7d-disk3", Some(4096), Duration::from_millis(100)),
            None,
            "not the size asked for"
        );
        let got = wait_by_serial(&root, "k7d-disk3", Some(4096), Duration::from_secs(5));
        t.join().unwrap();
        assert_eq!(got.map(|d| d.name), Some("vdc".into()));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn waiting_sees_a_disk_that_appears_later_and_gives_up_on_one_that_does_not() {
        let root = fake_sysfs("wait");
        let r2 = root.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let d = r2.join("block/vdc");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("dev"), "254:32\n").unwrap();
            std::fs::write(d.join("serial"), "late").unwrap();
            std::fs::write(d.join("size"), "8\n").unwrap();
        });
        let got = wait_by_serial(&root, "late", None, Duration::from_secs(5));
        t.join().unwrap();
        assert_eq!(got.map(|d| d.minor), Some(32));
        let start = Instant::now();
        assert_eq!(wait_by_serial(&root, "never", None, Duration::from_millis(100)), None);
        assert!(start.elapsed() >= Duration::from_millis(100));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn serials_and_fstypes_are_checked() {
        assert!(valid_serial("k7d-disk0"));
        assert!(!valid_serial(""));
        assert!(!valid_serial("a b"));
        assert!(!valid_serial(&"x".repeat(65)));
        assert!(valid_fstype("erofs") && valid_fstype("ext4"));
        assert!(!valid_fstype("ext4,ro") && !valid_fstype("") && !valid_fstype("a\0b"));
    }
}

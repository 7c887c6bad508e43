//! Host bind mounts carried into the guest (`proto::Binds`): the shim's
//! disk holding every carried source is mounted read-only once per
//! container; a read-only bind is a path on it; a writable directory gets
//! an overlay whose upper layer is on the container's writable tmpfs; a
//! writable file is copied onto that tmpfs. Writes stay in guest RAM: the
//! host never sees them (a pod VM shares no filesystem with the host).

use crate::disk::{self, Disk};
use crate::sys;
use k7d_agent::proto::{Bind, Binds, is_host_bind};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Whether `s` is an entry name the agent accepts at the disk's root: one
/// path component of 1..=64 ASCII letters, digits, `-`, `_`, `.`, never
/// `.` or `..` (it ends up in an overlay option, so no `,` or `:`).
pub fn valid_entry(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The mounts made for a container's carried binds, unmounted in reverse.
#[derive(Debug, Clone, Default)]
pub struct BindMounts {
    made: Vec<PathBuf>,
}

impl BindMounts {
    /// Checks `binds` against the spec's `mounts`, mounts the disk `device`
    /// read-only under `<bundle>/binds/ro` and prepares each bind; returns
    /// the guest source of each carried mount by its index in `mounts`.
    /// Writable layers go under `rw` (the container's writable tmpfs). Every
    /// mount made is recorded in `self` as it is made, so a caller's
    /// rollback unmounts what a failure left.
    pub fn mount(
        &mut self,
        bundle: &Path,
        rw: &Path,
        device: &Path,
        binds: &Binds,
        mounts: &[Value],
    ) -> Result<HashMap<usize, String>, String> {
        check(binds, mounts)?;
        self.mount_checked(bundle, rw, device, binds)
    }

    fn mount_checked(
        &mut self,
        bundle: &Path,
        rw: &Path,
        device: &Path,
        binds: &Binds,
    ) -> Result<HashMap<usize, String>, String> {
        let ro = bundle.join("binds").join("ro");
        std::fs::create_dir_all(&ro).map_err(|e| format!("creating {} failed: {e}", ro.display()))?;
        sys::mount(
            device.as_os_str(),
            &ro,
            &binds.disk.fstype,
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID,
            None,
        )
        .map_err(|e| {
            format!(
                "mounting the bind-mount disk {} ({}) read-only failed: {e}",
                device.display(),
                binds.disk.fstype
            )
        })?;
        self.made.push(ro.clone());
        let mut carried = HashMap::new();
        for (n, b) in binds.mounts.iter().enumerate() {
            let src = ro.join(&b.path);
            let md = std::fs::symlink_metadata(&src)
                .map_err(|e| format!("bind {}: the disk has no entry {}: {e}", b.index, b.path))?;
            if b.file != md.is_file() || !b.file && !md.is_dir() {
                return Err(format!(
                    "bind {}: the disk's entry {} is not a {}",
                    b.index,
                    b.path,
                    if b.file { "regular file" } else { "directory" }
                ));
            }
            let source = match (b.writable, b.file) {
                (false, _) => src,
                (true, true) => {
                    let dir = rw.join("binds");
                    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {} failed: {e}", dir.display()))?;
                    let copy = dir.join(format!("{n}.file"));
                    std::fs::copy(&src, &copy)
                        .map_err(|e| format!("bind {}: copying {} failed: {e}", b.index, src.display()))?;
                    same_owner_and_mode(&md, &copy).map_err(|e| format!("bind {}: {e}", b.index))?;
                    copy
                }
                (true, false) => {
                    let layer = rw.join("binds").join(n.to_string());
                    let (upper, work) = (layer.join("upper"), layer.join("work"));
                    let target = bundle.join("binds").join(format!("rw{n}"));
                    for d in [&upper, &work, &target] {
                        std::fs::create_dir_all(d).map_err(|e| format!("creating {} failed: {e}", d.display()))?;
                    }
                    // The overlay's root takes the upper directory's owner
                    // and mode: the source's (an emptyDir is 0777, an
                    // fsGroup's directory its group's).
                    same_owner_and_mode(&md, &upper).map_err(|e| format!("bind {}: {e}", b.index))?;
                    let opts = format!(
                        "lowerdir={},upperdir={},workdir={}",
                        src.display(),
                        upper.display(),
                        work.display()
                    );
                    sys::mount(OsStr::new("overlay"), &target, "overlay", libc::MS_NODEV, Some(&opts))
                        .map_err(|e| format!("bind {}: mounting its overlay failed: {e}", b.index))?;
                    self.made.push(target.clone());
                    target
                }
            };
            carried.insert(b.index, source.to_string_lossy().into_owned());
        }
        Ok(carried)
    }

    /// Unmounts every mount made, last first (the overlays detached, the
    /// image for good); true when none is left mounted.
    pub fn unmount(&self) -> bool {
        // The first mount made is the drive's image: unmounted for good,
        // after what sits on it.
        let upper = disk::unmount_all(self.made.iter().skip(1).rev());
        self.made.first().is_none_or(|image| disk::unmount_image(image)) && upper
    }
}

/// Gives `path` the owner, group and mode (permission bits) in `md`.
fn same_owner_and_mode(md: &std::fs::Metadata, path: &Path) -> Result<(), String> {
    std::os::unix::fs::chown(path, Some(md.uid()), Some(md.gid()))
        .map_err(|e| format!("giving {} its source's owner failed: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(md.mode() & 0o7777))
        .map_err(|e| format!("giving {} its source's mode failed: {e}", path.display()))
}

/// Refuses a [`Binds`] that does not fit the spec: a disk serial or
/// filesystem that is not valid, an entry that is not one plain name, an
/// index that is not a host bind of the spec, or an index or entry given
/// twice.
pub fn check(binds: &Binds, mounts: &[Value]) -> Result<(), String> {
    if !disk::valid_serial(&binds.disk.serial) {
        return Err("the bind-mount disk serial is not valid".into());
    }
    if !disk::valid_fstype(&binds.disk.fstype) {
        return Err("the bind-mount disk's filesystem type is not valid".into());
    }
    let (mut indexes, mut entries) = (HashSet::new(), HashSet::new());
    for Bind { index, path, .. } in &binds.mounts {
        if !valid_entry(path) {
            return Err(format!("bind {index}: the entry name {path:?} is not one plain name"));
        }
        if !mounts.get(*index).is_some_and(is_host_bind) {
            return Err(format!(
                "bind {index}: the spec's mount {index} is not a host bind mount"
            ));
        }
        if !indexes.insert(*index) || !entries.insert(path.as_str()) {
            return Err(format!("bind {index}: given twice"));
        }
    }
    Ok(())
}

/// The disk of `binds`, awaited for up to `timeout`.
pub fn wait_disk(sysfs: &Path, binds: &Binds, timeout: std::time::Duration) -> Result<Disk, String> {
    disk::wait_by_serial(sysfs, &binds.disk.serial, binds.disk.sectors, timeout).ok_or_else(|| {
        format!(
            "no bind-mount disk with serial {} appeared in {timeout:?}",
            binds.disk.serial
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k7d_agent::proto::BlockMount;
    use serde_json::json;

    fn binds(list: Vec<Bind>) -> Binds {
        Binds {
            disk: BlockMount {
                serial: "k7d-disk1".into(),
                fstype: "erofs".into(),
                sectors: None,
            },
            mounts: list,
        }
    }

    fn bind(index: usize, path: &str) -> Bind {
        Bind {
            index,
            path: path.into(),
            file: false,
            writable: false,
        }
    }

    #[test]
    fn a_writable_layer_gets_its_sources_owner_and_mode() {
        let d = std::env::temp_dir().join(format!("k7d-agent-binds-owner-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let (src, upper, file) = (d.join("src"), d.join("upper"), d.join("copy"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&upper).unwrap();
        std::fs::write(&file, b"x").unwrap();
        std::os::unix::fs::chown(&src, Some(1000), Some(2000)).unwrap();
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let md = std::fs::symlink_metadata(&src).unwrap();
        for p in [&upper, &file] {
            same_owner_and_mode(&md, p).unwrap();
            let got = std::fs::metadata(p).unwrap();
            assert_eq!(
                (got.uid(), got.gid(), got.mode() & 0o7777),
                (1000, 2000, 0o1777),
                "{}",
                p.display()
            );
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn entries_are_single_plain_names() {
        for ok in ["0", "b12", "a.b-c_d"] {
            assert!(valid_entry(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "/a", "a,b", "a:b", "a b", &"x".repeat(65)] {
            assert!(!valid_entry(bad), "{bad:?}");
        }
    }

    #[test]
    fn binds_that_do_not_fit_the_spec_are_refused() {
        let mounts = vec![
            json!({"destination": "/proc", "type": "proc", "source": "proc"}),
            json!({"destination": "/a", "type": "bind", "source": "/srv/a", "options": ["rbind"]}),
            json!({"destination": "/b", "source": "/srv/b", "options": ["rbind", "ro"]}),
        ];
        assert_eq!(check(&binds(vec![bind(1, "0"), bind(2, "1")]), &mounts), Ok(()));
        let refused = [
            (binds(vec![bind(0, "0")]), "not a host bind"),
            (binds(vec![bind(3, "0")]), "not a host bind"),
            (binds(vec![bind(1, "0"), bind(1, "1")]), "given twice"),
            (binds(vec![bind(1, "0"), bind(2, "0")]), "given twice"),
            (binds(vec![bind(1, "../etc")]), "not one plain name"),
        ];
        for (b, why) in refused {
            let e = check(&b, &mounts).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        let mut b = binds(vec![]);
        b.disk.serial = "a b".into();
        assert!(check(&b, &mounts).unwrap_err().contains("serial"));
        let mut b = binds(vec![]);
        b.disk.fstype = "erofs,dax".into();
        assert!(check(&b, &mounts).unwrap_err().contains("filesystem"));
    }
}

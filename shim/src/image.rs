//! Container images reach the pod VM as read-only block devices, never as
//! a shared filesystem (an out-of-process device is a fork liability, seed
//! 003): the layers containerd's snapshotter hands over are merged and
//! packed into one erofs image (`mkfs.erofs`, Debian's erofs-utils),
//! cached by the layers' identity so a second container from the same
//! image pays nothing.

use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use containerd_shim::protos::types::mount::Mount;
use sha2::{Digest, Sha256};

/// The read-only layers of a container's rootfs, top first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layers(pub Vec<PathBuf>);

/// The layers in containerd's rootfs mounts: an overlay's `lowerdir`s
/// (and its `upperdir` when it already holds files), or a bind mount's
/// source. The container's own writes never go here (they live in the
/// guest, on tmpfs under an overlay).
pub fn layers(mounts: &[Mount]) -> anyhow::Result<Layers> {
    let [m] = mounts else {
        bail!(
            "the rootfs has {} mounts; k7d takes one (overlay or bind)",
            mounts.len()
        );
    };
    let mut dirs = Vec::new();
    match m.type_.as_str() {
        "overlay" => {
            let mut upper = None;
            for o in &m.options {
                if let Some(l) = o.strip_prefix("lowerdir=") {
                    dirs.extend(l.split(':').map(PathBuf::from));
                } else if let Some(u) = o.strip_prefix("upperdir=") {
                    upper = Some(PathBuf::from(u));
                }
            }
            if let Some(u) = upper
                && std::fs::read_dir(&u).map(|mut d| d.next().is_some()).unwrap_or(false)
            {
                dirs.insert(0, u);
            }
        }
        "bind" | "rbind" => dirs.push(PathBuf::from(&m.source)),
        other => bail!("the rootfs mount type {other:?} is not supported (overlay or bind)"),
    }
    if dirs.is_empty() {
        bail!("the rootfs overlay names no lower directory");
    }
    for d in &dirs {
        if !d.is_absolute() || d.as_os_str().as_bytes().iter().any(|&c| c == b',' || c == b':') {
            bail!(
                "the rootfs layer path {} is not an absolute path without ',' or ':'",
                d.display()
            );
        }
        if !d.is_dir() {
            bail!("the rootfs layer {} is not a directory", d.display());
        }
    }
    Ok(Layers(dirs))
}

impl Layers {
    /// The cache key: each layer's path and identity (device, inode, change
    /// time), so a snapshot id reused by a fresh containerd never hits an
    /// old image.
    pub fn key(&self) -> anyhow::Result<String> {
        let mut h = Sha256::new();
        for d in &self.0 {
            let md = std::fs::metadata(d).with_context(|| format!("cannot stat the rootfs layer {}", d.display()))?;
            h.update(d.as_os_str().as_bytes());
            h.update([0]);
            h.update(format!("{}:{}:{}.{}", md.dev(), md.ino(), md.ctime(), md.ctime_nsec()).as_bytes());
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// The erofs image of `layers` in `image_dir`, packed now unless cached.
/// `scratch` (the bundle) holds the merge mount while packing. Returns the
/// image and whether it was cached.
pub fn packed(layers: &Layers, image_dir: &Path, scratch: &Path) -> anyhow::Result<(PathBuf, bool)> {
    let image = image_dir.join(format!("{}.erofs", layers.key()?));
    if image.is_file() {
        return Ok((image, true));
    }
    // Root only: the images hold the layers' files, which containerd keeps
    // under its own 0700 root.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(image_dir)
        .with_context(|| format!("cannot create the image cache {}", image_dir.display()))?;
    std::fs::set_permissions(image_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make the image cache {} private", image_dir.display()))?;
    sweep_partial(image_dir);
    let tmp = image_dir.join(format!(".{}.{}.tmp", std::process::id(), image_file_stem(&image)));
    let result = match layers.0.as_slice() {
        [one] => mkfs(&tmp, one),
        many => {
            let merged = scratch.join("k7d-pack");
            std::fs::create_dir_all(&merged).with_context(|| format!("cannot create {}", merged.display()))?;
            let lower: Vec<_> = many.iter().map(|d| d.display().to_string()).collect();
            let r = mount_overlay_ro(&merged, &lower.join(":")).and_then(|()| {
                let r = mkfs(&tmp, &merged);
                umount(&merged);
                r
            });
            let _ = std::fs::remove_dir(&merged);
            r
        }
    };
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &image).with_context(|| format!("cannot move the packed image to {}", image.display()))?;
    Ok((image, false))
}

/// Removes the partial images (`.<pid>.<key>.tmp`) of shims that died while
/// packing: their pid no longer runs.
fn sweep_partial(image_dir: &Path) {
    let Ok(dir) = std::fs::read_dir(image_dir) else { return };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = partial_owner(name) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!("removing {name}, a partial image of a shim that is gone");
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The pid in a partial image's name (`.<pid>.<key>.tmp`).
fn partial_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    rest.split('.').next()?.parse().ok()
}

fn image_file_stem(p: &Path) -> String {
    p.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// How long packing an image's layers may take.
const MKFS_TIMEOUT: Duration = Duration::from_secs(600);

fn mkfs(out: &Path, dir: &Path) -> anyhow::Result<()> {
    let mut cmd = Command::new("mkfs.erofs");
    cmd.arg("--quiet").arg(out).arg(dir);
    run_mkfs(&mut cmd, &dir.display().to_string(), MKFS_TIMEOUT)
}

/// Runs a prepared `mkfs.erofs` command packing `what`: its stderr drained
/// beside it (a full pipe would stall it; the first 64 KiB kept for the
/// error), killed past `timeout` (a source on a hung network filesystem
/// must not hold a create past containerd's deadline) and then reaped
/// beside the caller (a process stuck in the kernel may take its time).
pub(crate) fn run_mkfs(cmd: &mut Command, what: &str, timeout: Duration) -> anyhow::Result<()> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run mkfs.erofs (install erofs-utils)")?;
    let stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut kept = Vec::new();
        if let Some(mut e) = stderr {
            let _ = (&mut e).take(64 << 10).read_to_end(&mut kept);
            let _ = std::io::copy(&mut e, &mut std::io::sink());
        }
        String::from_utf8_lossy(&kept).into_owned()
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                std::thread::spawn(move || {
                    let _ = child.wait();
                });
                bail!("mkfs.erofs of {what} took over {} s and was killed", timeout.as_secs());
            }
            Err(e) => bail!("cannot wait for mkfs.erofs of {what}: {e}"),
        }
    };
    let err = reader.join().unwrap_or_default();
    if !status.success() {
        bail!(
            "mkfs.erofs of {what} failed ({status}): {}",
            err.lines().last().unwrap_or("").trim()
        );
    }
    Ok(())
}

fn mount_overlay_ro(target: &Path, lower: &str) -> anyhow::Result<()> {
    let t = CString::new(target.as_os_str().as_bytes())?;
    let data = CString::new(format!("lowerdir={lower}"))?;
    k7d_sys::mount::mount(Some(c"overlay"), &t, Some(c"overlay"), libc::MS_RDONLY, Some(&data))
        .with_context(|| format!("cannot merge the image layers at {}", target.display()))
}

/// Detaches whatever is mounted at `target` (nothing mounted is fine).
pub fn umount(target: &Path) {
    let Ok(t) = CString::new(target.as_os_str().as_bytes()) else {
        return;
    };
    let _ = k7d_sys::mount::unmount_detach(&t);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(type_: &str, source: &str, options: &[&str]) -> Mount {
        let mut m = Mount::new();
        m.type_ = type_.into();
        m.source = source.into();
        m.options = options.iter().map(|s| s.to_string()).collect();
        m
    }

    #[test]
    fn overlay_lowerdirs_are_the_layers_top_first_and_an_empty_upper_is_left_out() {
        let t = std::env::temp_dir().join(format!("k7d-layers-{}", std::process::id()));
        for d in ["l1", "l2", "up", "work"] {
            std::fs::create_dir_all(t.join(d)).unwrap();
        }
        let p = |d: &str| t.join(d).display().to_string();
        let ov = mount(
            "overlay",
            "overlay",
            &[
                &format!("workdir={}", p("work")),
                &format!("upperdir={}", p("up")),
                &format!("lowerdir={}:{}", p("l2"), p("l1")),
            ],
        );
        assert_eq!(
            layers(std::slice::from_ref(&ov)).unwrap(),
            Layers(vec![t.join("l2"), t.join("l1")])
        );
        let key = layers(std::slice::from_ref(&ov)).unwrap().key().unwrap();
        std::fs::write(t.join("up/f"), "x").unwrap();
        let with_upper = layers(&[ov]).unwrap();
        assert_eq!(with_upper.0[0], t.join("up"));
        assert_ne!(with_upper.key().unwrap(), key, "the key names the layers");
        assert_eq!(
            layers(&[mount("bind", &p("l1"), &["ro", "rbind"])]).unwrap(),
            Layers(vec![t.join("l1")])
        );
        std::fs::remove_dir_all(t).unwrap();
    }

    #[test]
    fn partial_images_of_dead_shims_are_swept_and_live_ones_kept() {
        assert_eq!(partial_owner(".123.abcd.tmp"), Some(123));
        assert_eq!(partial_owner("abcd.erofs"), None);
        assert_eq!(partial_owner(".x.abcd.tmp"), None);
        let t = std::env::temp_dir().join(format!("k7d-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&t).unwrap();
        let mine = t.join(format!(".{}.k.tmp", std::process::id()));
        // A pid above the kernel's pid_max never runs.
        let dead = t.join(".4194305.k.tmp");
        let image = t.join("k.erofs");
        for f in [&mine, &dead, &image] {
            std::fs::write(f, b"x").unwrap();
        }
        sweep_partial(&t);
        assert!(mine.exists() && image.exists());
        assert!(!dead.exists());
        std::fs::remove_dir_all(t).unwrap();
    }

    #[test]
    fn hostile_or_odd_mounts_are_refused_with_a_sentence() {
        assert!(layers(&[]).is_err());
        let e = layers(&[mount("overlay", "overlay", &["lowerdir=relative/dir"])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not an absolute path"), "{e}");
        let e = layers(&[mount("tmpfs", "tmpfs", &[])]).unwrap_err().to_string();
        assert!(e.contains("not supported"), "{e}");
        assert!(layers(&[mount("overlay", "overlay", &["lowerdir=/nonexistent-k7d"])]).is_err());
    }
}

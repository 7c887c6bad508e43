//! A container's host bind mounts (ConfigMap- and Secret-like files,
//! resolv.conf, hosts, emptyDir-like directories) reach the pod VM the way
//! its image does: as a read-only block device, never a shared filesystem
//! (an out-of-process device is a fork liability, seed 003). Every carried
//! source becomes entry `<index>` of one erofs image (`mkfs.erofs` run in a
//! private mount namespace where each entry is a bind of its source, so the
//! host's mount table never changes and nothing is copied twice); the agent
//! mounts each from there, writable ones under a layer in guest RAM
//! (`k7d_agent::proto::Binds`).
//!
//! The image is the pod's own (its content changes between pods), in the
//! pod's private directory, removed with the pod. What is not carried: a
//! source that is neither a regular file nor a directory (a socket, a
//! device: no such object crosses into a VM), a source on a kernel
//! pseudo-filesystem (`/proc`, `/sys`, cgroup, bpf...: sizes that say
//! nothing of what a read returns, and the host's own state), a mount below
//! a source directory (the bind is not recursive), and the host's
//! `/dev/shm` (the guest has its own). Writes to a writable bind stay in the guest.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use k7d_agent::proto::{Bind, is_host_bind, is_readonly};
use serde_json::Value;

/// The most entries (files, directories, links) the sources may hold.
const MAX_ENTRIES: u64 = 100_000;
/// How long packing the sources may take.
const MKFS_TIMEOUT: Duration = Duration::from_secs(60);

/// A container's carried binds: the image to attach and what is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    /// The erofs image.
    pub image: PathBuf,
    /// One per carried mount: entry `path` holds mount `index`'s content.
    pub mounts: Vec<Bind>,
}

/// One host bind to carry.
struct Source {
    bind: Bind,
    source: PathBuf,
}

/// Packs `spec`'s host bind mounts into `<pod_dir>/binds.erofs`; `None`
/// when the spec has none to carry. The sources may hold at most
/// `max_bytes` of file data. On failure nothing is left in `pod_dir`.
pub fn pack(spec: &Value, pod_dir: &Path, max_bytes: u64) -> anyhow::Result<Option<Carried>> {
    let sources = sources(spec)?;
    if sources.is_empty() {
        return Ok(None);
    }
    let mut budget = Budget {
        bytes: 0,
        entries: 0,
        max_bytes,
    };
    for s in &sources {
        budget
            .add(&s.source)
            .with_context(|| format!("the bind mount source {} cannot be carried", s.source.display()))?;
    }
    let image = pod_dir.join("binds.erofs");
    let stage = pod_dir.join("binds.src");
    let r = make(&sources, &stage, &image);
    remove_stage(&stage, &sources);
    if let Err(e) = r {
        let _ = std::fs::remove_file(&image);
        return Err(e);
    }
    Ok(Some(Carried {
        image,
        mounts: sources.into_iter().map(|s| s.bind).collect(),
    }))
}

/// The spec's host binds that are carried, in spec order.
fn sources(spec: &Value) -> anyhow::Result<Vec<Source>> {
    let Some(mounts) = spec.get("mounts").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (index, m) in mounts.iter().enumerate() {
        if !is_host_bind(m) {
            continue;
        }
        let dest = m.get("destination").and_then(Value::as_str).unwrap_or("");
        let source = PathBuf::from(m.get("source").and_then(Value::as_str).unwrap_or(""));
        if Path::new(dest).components().eq(Path::new("/dev/shm").components()) {
            tracing::info!("the bind mount at /dev/shm is not carried: the guest has its own");
            continue;
        }
        let md = std::fs::metadata(&source)
            .with_context(|| format!("the bind mount source {} (for {dest}) cannot be read", source.display()))?;
        if !md.is_file() && !md.is_dir() {
            tracing::info!(
                "the bind mount {} at {dest} is not carried: only files and directories reach a pod VM",
                source.display()
            );
            continue;
        }
        if let Some(fs) = pseudo_fs(&source) {
            // /proc, /sys and their kind: files whose size says nothing of
            // what a read returns (/proc/kcore), and the host's own state.
            tracing::info!(
                "the bind mount {} at {dest} is not carried: it is on the kernel's {fs} filesystem",
                source.display()
            );
            continue;
        }
        out.push(Source {
            bind: Bind {
                index,
                path: index.to_string(),
                file: md.is_file(),
                writable: !is_readonly(m),
            },
            source,
        });
    }
    Ok(out)
}

/// The kernel pseudo-filesystem holding `path`, if it is on one.
fn pseudo_fs(path: &Path) -> Option<&'static str> {
    const PSEUDO: [(i64, &str); 11] = [
        (0x9fa0, "proc"),
        (0x6265_6572, "sysfs"),
        (0x6462_6720, "debugfs"),
        (0x7472_6163, "tracefs"),
        (0x7363_6673, "securityfs"),
        (0x6367_7270, "cgroup2"),
        (0x0027_e0eb, "cgroup"),
        (0xcafe_4a11, "bpf"),
        (0x6265_6570, "configfs"),
        (0xde5e_81e4, "efivarfs"),
        (0x1cd1, "devpts"),
    ];
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    let magic = k7d_sys::mount::filesystem_type(&c).ok()?;
    PSEUDO.iter().find(|(m, _)| *m == magic).map(|(_, n)| *n)
}

/// What the sources hold so far, against the limits.
struct Budget {
    bytes: u64,
    entries: u64,
    max_bytes: u64,
}

impl Budget {
    /// Counts `path` (following it if it is a link, as a bind mount does)
    /// and, for a directory, everything under it on its filesystem (links
    /// not followed; a mount below it is not carried: the bind is not
    /// recursive).
    fn add(&mut self, path: &Path) -> anyhow::Result<()> {
        let md = std::fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?;
        self.count(path, &md)?;
        if md.is_dir() {
            self.walk(path, md.dev())?;
        }
        Ok(())
    }

    fn walk(&mut self, dir: &Path, dev: u64) -> anyhow::Result<()> {
        let entries = std::fs::read_dir(dir).with_context(|| format!("cannot read the directory {}", dir.display()))?;
        for e in entries {
            let e = e.with_context(|| format!("cannot read the directory {}", dir.display()))?;
            let p = e.path();
            let md = std::fs::symlink_metadata(&p).with_context(|| format!("cannot stat {}", p.display()))?;
            if md.dev() != dev {
                continue;
            }
            self.count(&p, &md)?;
            if md.is_dir() {
                self.walk(&p, dev)?;
            }
        }
        Ok(())
    }

    fn count(&mut self, path: &Path, md: &std::fs::Metadata) -> anyhow::Result<()> {
        self.entries += 1;
        if md.is_file() {
            self.bytes += md.len();
        }
        if self.bytes > self.max_bytes {
            bail!(
                "the bind mounts hold more than {} MiB (at {}); k7d copies bind mounts into the pod VM (bind_max_mib in the shim config)",
                self.max_bytes >> 20,
                path.display()
            );
        }
        if self.entries > MAX_ENTRIES {
            bail!(
                "the bind mounts hold more than {MAX_ENTRIES} files (at {}); k7d copies bind mounts into the pod VM",
                path.display()
            );
        }
        Ok(())
    }
}

/// Makes the stage (an empty file or directory per entry, private), then
/// runs `mkfs.erofs image stage` in a new mount namespace of its own where
/// each entry is a bind of its source (not recursive: a mount below a
/// source is not carried, as the size walk does not count it). The namespace dies with
/// the process: the host's mount table is never touched.
fn make(sources: &[Source], stage: &Path, image: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(stage)
        .with_context(|| format!("cannot create {}", stage.display()))?;
    let mut binds = Vec::with_capacity(sources.len());
    for s in sources {
        let at = stage.join(&s.bind.path);
        if s.bind.file {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&at)
                .with_context(|| format!("cannot create {}", at.display()))?;
        } else {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&at)
                .with_context(|| format!("cannot create {}", at.display()))?;
        }
        binds.push((cpath(&s.source)?, cpath(&at)?));
    }
    let mut cmd = Command::new("mkfs.erofs");
    cmd.arg("--quiet").arg(image).arg(stage);
    k7d_sys::mount::bind_in_child(&mut cmd, binds);
    crate::image::run_mkfs(&mut cmd, "the bind mounts", MKFS_TIMEOUT)
}

/// Removes the stage without ever recursing: each entry is an empty file or
/// directory here (the binds lived only in mkfs's namespace), so a bind
/// still mounted would make removal fail rather than delete its source.
fn remove_stage(stage: &Path, sources: &[Source]) {
    for s in sources {
        let at = stage.join(&s.bind.path);
        let r = if s.bind.file {
            std::fs::remove_file(&at)
        } else {
            std::fs::remove_dir(&at)
        };
        if let Err(e) = r
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("cannot remove {}: {e}", at.display());
        }
    }
    if let Err(e) = std::fs::remove_dir(stage)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("cannot remove {}: {e}", stage.display());
    }
}

fn cpath(p: &Path) -> anyhow::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).with_context(|| format!("the path {} holds a NUL byte", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("k7d-shim-binds-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn extract(image: &Path, to: &Path) {
        let o = Command::new("fsck.erofs")
            .arg(format!("--extract={}", to.display()))
            .arg(image)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }

    #[test]
    fn files_and_directories_are_packed_by_index_and_the_rest_is_left_out() {
        let d = scratch("pack");
        let host = d.join("host");
        std::fs::create_dir_all(host.join("cfg/sub")).unwrap();
        std::fs::write(host.join("cfg/key"), "value").unwrap();
        std::fs::write(host.join("cfg/sub/deep"), "deeper").unwrap();
        std::os::unix::fs::symlink("key", host.join("cfg/link")).unwrap();
        std::fs::write(host.join("resolv.conf"), "nameserver 10.0.0.10\n").unwrap();
        std::fs::create_dir_all(host.join("empty")).unwrap();
        let sock = std::os::unix::net::UnixListener::bind(host.join("sock")).unwrap();
        let h = |p: &str| host.join(p).to_string_lossy().into_owned();
        let spec = json!({"mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/etc/config", "type": "bind", "source": h("cfg"), "options": ["rbind", "ro"]},
            {"destination": "/etc/resolv.conf", "source": h("resolv.conf"), "options": ["rbind"]},
            {"destination": "//dev/shm/", "type": "bind", "source": h("empty"), "options": ["rbind"]},
            {"destination": "/run/s.sock", "type": "bind", "source": h("sock"), "options": ["rbind"]},
            {"destination": "/scratch", "type": "bind", "source": h("empty"), "options": ["rbind", "rw"]}
        ]});
        let pod = d.join("pod");
        std::fs::create_dir_all(&pod).unwrap();
        let c = pack(&spec, &pod, 1 << 20).unwrap().unwrap();
        let got: Vec<(usize, &str, bool, bool)> = c
            .mounts
            .iter()
            .map(|b| (b.index, b.path.as_str(), b.file, b.writable))
            .collect();
        assert_eq!(
            got,
            [(1, "1", false, false), (2, "2", true, true), (5, "5", false, true)]
        );
        assert_eq!(c.image, pod.join("binds.erofs"));
        assert!(!pod.join("binds.src").exists(), "the stage is removed");

        let out = d.join("out");
        extract(&c.image, &out);
        assert_eq!(std::fs::read_to_string(out.join("1/key")).unwrap(), "value");
        assert_eq!(std::fs::read_to_string(out.join("1/sub/deep")).unwrap(), "deeper");
        assert_eq!(std::fs::read_link(out.join("1/link")).unwrap(), Path::new("key"));
        assert_eq!(
            std::fs::read_to_string(out.join("2")).unwrap(),
            "nameserver 10.0.0.10\n"
        );
        assert!(out.join("5").is_dir() && std::fs::read_dir(out.join("5")).unwrap().next().is_none());

        // The host's sources and mount table are untouched.
        assert_eq!(std::fs::read_to_string(host.join("cfg/key")).unwrap(), "value");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(&pod.to_string_lossy().into_owned()), "{mounts}");
        drop(sock);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn kernel_filesystems_and_mounts_below_a_source_are_not_carried() {
        let d = scratch("pseudo");
        let top = d.join("top");
        std::fs::create_dir_all(top.join("mnt")).unwrap();
        std::fs::write(top.join("a"), "a").unwrap();
        // A tmpfs mounted below the source, holding more than the limit.
        let at = CString::new(top.join("mnt").as_os_str().as_bytes()).unwrap();
        k7d_sys::mount::mount(Some(c"tmpfs"), &at, Some(c"tmpfs"), 0, None).expect("mount tmpfs");
        std::fs::write(top.join("mnt/hidden"), vec![1u8; 3 << 20]).unwrap();
        let spec = json!({"mounts": [
            {"destination": "/s", "type": "bind", "source": "/proc/self/status", "options": ["rbind", "ro"]},
            {"destination": "/k", "type": "bind", "source": "/sys/kernel", "options": ["rbind", "ro"]},
            {"destination": "/t", "type": "bind", "source": top.to_string_lossy(), "options": ["rbind", "ro"]}
        ]});
        let pod = d.join("pod");
        std::fs::create_dir_all(&pod).unwrap();
        let packed = pack(&spec, &pod, 2 << 20);
        k7d_sys::mount::unmount_detach(&at).unwrap();
        let c = packed.unwrap().unwrap();
        let got: Vec<usize> = c.mounts.iter().map(|b| b.index).collect();
        assert_eq!(got, [2], "only the directory on a real filesystem is carried");
        let out = d.join("out");
        extract(&c.image, &out);
        assert_eq!(std::fs::read_to_string(out.join("2/a")).unwrap(), "a");
        assert!(out.join("2/mnt").is_dir(), "the mount point is there, empty");
        assert!(
            !out.join("2/mnt/hidden").exists(),
            "what is mounted below is not carried"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Where `/` is a shared mount (systemd's default), a bind made in a
    /// copied namespace propagates back unless the copy is made private
    /// first. The test runs itself again in a mount namespace of its own
    /// whose root is shared, and packs there.
    #[test]
    fn packing_under_a_shared_root_leaves_no_mount_behind() {
        let exe = std::env::current_exe().unwrap();
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "shared", "--"])
            .arg(&exe)
            .args([
                "binds::tests::pack_in_this_namespace",
                "--exact",
                "--ignored",
                "--test-threads=1",
            ])
            .env("K7D_BINDS_SHARED_NS", "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
    }

    #[test]
    #[ignore = "run in a shared-root mount namespace by packing_under_a_shared_root_leaves_no_mount_behind"]
    fn pack_in_this_namespace() {
        assert_eq!(
            std::env::var("K7D_BINDS_SHARED_NS").as_deref(),
            Ok("1"),
            "run through packing_under_a_shared_root_leaves_no_mount_behind"
        );
        let root_shared = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some("/") && l.contains(" shared:"));
        assert!(
            root_shared,
            "the namespace's root is not shared: the test proves nothing"
        );
        let d = scratch("shared");
        std::fs::create_dir_all(d.join("src")).unwrap();
        std::fs::write(d.join("src/f"), b"x").unwrap();
        let spec = json!({"mounts": [{"destination": "/d", "type": "bind",
                                      "source": d.join("src").to_string_lossy(), "options": ["rbind", "ro"]}]});
        let pod = d.join("pod");
        std::fs::create_dir_all(&pod).unwrap();
        pack(&spec, &pod, 1 << 20).unwrap().unwrap();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(&*d.to_string_lossy()), "{mounts}");
        assert!(!pod.join("binds.src").exists(), "the stage is removed");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn no_binds_is_no_image_and_limits_and_missing_sources_fail_leaving_nothing() {
        let d = scratch("limits");
        let pod = d.join("pod");
        std::fs::create_dir_all(&pod).unwrap();
        let none = json!({"mounts": [{"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}]});
        assert_eq!(pack(&none, &pod, 1 << 20).unwrap(), None);
        assert_eq!(pack(&json!({}), &pod, 1 << 20).unwrap(), None);

        let big = d.join("big");
        std::fs::create_dir_all(&big).unwrap();
        std::fs::write(big.join("blob"), vec![7u8; 3 << 20]).unwrap();
        let spec = json!({"mounts": [{"destination": "/big", "type": "bind",
                                      "source": big.to_string_lossy(), "options": ["rbind", "ro"]}]});
        let e = format!("{:#}", pack(&spec, &pod, 2 << 20).unwrap_err());
        assert!(e.contains("more than 2 MiB") && e.contains("bind_max_mib"), "{e}");

        let spec = json!({"mounts": [{"destination": "/x", "type": "bind", "source": "/nonexistent/k7d"}]});
        let e = format!("{:#}", pack(&spec, &pod, 1 << 20).unwrap_err());
        assert!(e.contains("/nonexistent/k7d") && e.contains("/x"), "{e}");
        assert_eq!(std::fs::read_dir(&pod).unwrap().count(), 0, "nothing is left");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

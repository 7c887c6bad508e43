//! The agent in a VM that boots a root disk of its own (a user's image with
//! no agent installed, issue 37): k7d's initramfs runs the agent first, as
//! initramfs-tools' `/init` would run. PID 1 reads the kernel command line
//! as initramfs-tools does (`root=` a path or `UUID=`, `LABEL=`,
//! `PARTUUID=`, `PARTLABEL=`: [`crate::rootdev`]; `rootfstype=`, `ro`/`rw`,
//! `init=`), mounts the root, moves `/dev`, `/proc`, `/sys` and `/run` onto it, frees
//! the initramfs, makes the disk the root, then forks: the child serves the
//! agent's protocol on vsock (from the image's root, in a session of its
//! own) and PID 1 executes the image's own init (systemd, busybox init,
//! anything). With `k7d.agent=image` the image has the agent installed as
//! a service of its own (`k7d-agent --vsock`): PID 1 forks no agent and
//! only executes the image's init. A root that cannot be mounted or holds no init leaves PID 1
//! as the agent of the initramfs, with the reason on the console: the VM
//! stays reachable through `k7d exec`.

use crate::rootdev::RootSpec;
use crate::sys;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where the root disk is mounted before it becomes `/`.
const NEW_ROOT: &str = "/.k7d-disk";
/// How long the root device may take to appear.
const DEVICE_WAIT: Duration = Duration::from_secs(10);
/// Filesystems tried, in order, when `rootfstype=` names none.
const FSTYPES: [&str; 3] = ["ext4", "erofs", "xfs"];

/// What the kernel command line asks of the root disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handover {
    /// The root device (`root=`).
    pub root: RootSpec,
    /// Its filesystem (`rootfstype=`), else each of [`FSTYPES`].
    pub fstype: Option<String>,
    /// Mounted read-only (`ro`, the default, as initramfs-tools does; `rw`
    /// mounts it writable: the image's init usually remounts it).
    pub read_only: bool,
    /// The image's init (`init=`, default `/sbin/init`).
    pub init: PathBuf,
    /// The image runs its own agent, installed as a service
    /// (`k7d.agent=image`): PID 1 hands over and serves nothing itself.
    pub image_agent: bool,
}

/// The kernel command line parameter that says the root disk's image has
/// k7d-agent installed as a service of its own (`docs/exec.md`).
pub const IMAGE_AGENT_PARAM: &str = "k7d.agent=image";

/// The handover the kernel command line `cmdline` asks for: none without
/// `root=`; an error (one sentence) for one the agent cannot do.
pub fn wanted(cmdline: &str) -> Result<Option<Handover>, String> {
    let (mut root, mut fstype, mut read_only, mut init) = (None, None, true, None);
    let mut image_agent = false;
    for word in cmdline.split_whitespace() {
        if word == IMAGE_AGENT_PARAM {
            image_agent = true;
            continue;
        }
        match word.split_once('=') {
            Some(("root", v)) => root = Some(v),
            Some(("rootfstype", v)) => fstype = Some(v),
            Some(("init", v)) => init = Some(v),
            None if word == "ro" => read_only = true,
            None if word == "rw" => read_only = false,
            _ => {}
        }
    }
    let Some(root) = root else {
        return Ok(None);
    };
    let root = RootSpec::parse(root)?;
    let init = init.unwrap_or("/sbin/init");
    if !crate::rootdev::plain_path(init, "/") {
        return Err(format!("init={init} is not a plain absolute path"));
    }
    let init = PathBuf::from(init);
    if let Some(t) = fstype
        && (t.is_empty() || t.len() > 32 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
    {
        return Err(format!("rootfstype={t} is not a filesystem name"));
    }
    Ok(Some(Handover {
        root,
        fstype: fstype.map(str::to_string),
        read_only,
        init,
        image_agent,
    }))
}

/// Mounts `h`'s root and makes it `/`: returns once PID 1 is in it (then
/// the caller forks the agent and executes the image's init), or with why
/// not, the root disk unmounted again (with whatever was moved onto it):
/// the caller then unmounts the API filesystems ([`unmount_api_filesystems`])
/// and PID 1 serves from the initramfs (emptied, if the failure came after
/// [`crate::newroot::remove_old`], the point of no return).
pub fn enter(h: &Handover) -> Result<(), String> {
    let new = Path::new(NEW_ROOT);
    let r = enter_at(h, new);
    if r.is_err() {
        // Not mounted yet: EINVAL, nothing to undo.
        let _ = sys::umount_detach(new);
    }
    r
}

fn enter_at(h: &Handover, new: &Path) -> Result<(), String> {
    let until = Instant::now() + DEVICE_WAIT;
    let (sys_block, dev) = (Path::new("/sys/class/block"), Path::new("/dev"));
    let device = loop {
        if let Some(d) = h.root.find(sys_block, dev) {
            break d;
        }
        if Instant::now() >= until {
            return Err(format!(
                "root={} did not appear within {} s (block devices: {})",
                h.root,
                DEVICE_WAIT.as_secs(),
                RootSpec::seen(sys_block, dev)
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !matches!(h.root, RootSpec::Path(_)) {
        crate::log!("root={} is {}", h.root, device.display());
    }
    std::fs::create_dir_all(new).map_err(|e| format!("cannot make {NEW_ROOT}: {e}"))?;
    let flags = if h.read_only { libc::MS_RDONLY } else { 0 };
    let types: Vec<&str> = match &h.fstype {
        Some(t) => vec![t.as_str()],
        None => FSTYPES.to_vec(),
    };
    let mut tried = Vec::new();
    let mounted = types
        .iter()
        .find(|t| match sys::mount(device.as_os_str(), new, t, flags, None) {
            Ok(()) => true,
            Err(e) => {
                tried.push(format!("{t}: {e}"));
                false
            }
        });
    if mounted.is_none() {
        return Err(format!("cannot mount root={} ({})", h.root, tried.join("; ")));
    }
    let init = new.join(h.init.strip_prefix("/").unwrap_or(&h.init));
    if std::fs::metadata(&init).is_err() {
        return Err(format!("root={} has no {}", h.root, h.init.display()));
    }
    // The API filesystems go with it, as initramfs-tools moves them; a
    // root without the folder leaves that one behind (its init mounts it).
    for api in ["dev", "proc", "sys", "run"] {
        let to = new.join(api);
        if to.is_dir()
            && let Err(e) = sys::move_mount(&Path::new("/").join(api), &to)
        {
            crate::log!("moving /{api} onto the root disk failed: {e}");
        }
    }
    crate::newroot::remove_old(Path::new("/"), new);
    std::env::set_current_dir(new).map_err(|e| format!("cannot enter {NEW_ROOT}: {e}"))?;
    sys::move_mount(Path::new("."), Path::new("/")).map_err(|e| format!("cannot move the root disk onto /: {e}"))?;
    sys::chroot(Path::new("."))
        .and_then(|()| std::env::set_current_dir("/"))
        .map_err(|e| format!("cannot enter the root disk: {e}"))?;
    Ok(())
}

/// PID 1, once in the root disk: executes the image's init. Returns only
/// on failure, with why.
pub fn exec_init(h: &Handover) -> String {
    use std::os::unix::process::CommandExt;
    let e = std::process::Command::new(&h.init).arg0(h.init.as_os_str()).exec();
    format!("executing the image's init {} failed: {e}", h.init.display())
}

/// Undoes [`mount_api_filesystems`] (what is still mounted there): the
/// initramfs's own path copies `/`, which must hold no mount.
pub fn unmount_api_filesystems() {
    for api in ["/run", "/sys", "/proc", "/dev/pts", "/dev"] {
        let _ = sys::umount_detach(Path::new(api));
    }
}

/// The mounts `enter` needs before the root exists: `/dev` (with
/// `/dev/pts`), `/proc`, `/sys` and a `/run` tmpfs (initramfs-tools hands
/// the same to the image's init).
pub fn mount_api_filesystems() {
    let nosuid_nodev_noexec = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    for (src, target, fstype, flags, data) in [
        ("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, Some("mode=0755")),
        // As initramfs-tools' init mounts it (moved with /dev): a terminal
        // for `k7d exec --tty` under an init that mounts none (busybox's).
        (
            "devpts",
            "/dev/pts",
            "devpts",
            libc::MS_NOSUID | libc::MS_NOEXEC,
            Some("gid=5,mode=0620,ptmxmode=0666"),
        ),
        ("proc", "/proc", "proc", nosuid_nodev_noexec, None),
        ("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, None),
        (
            "tmpfs",
            "/run",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            Some("mode=0755"),
        ),
    ] {
        let _ = std::fs::create_dir_all(target);
        if let Err(e) = sys::mount(OsStr::new(src), Path::new(target), fstype, flags, data)
            && e.raw_os_error() != Some(libc::EBUSY)
        {
            crate::log!("mounting {fstype} at {target} failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_read_as_initramfs_tools_reads_it() {
        assert_eq!(
            wanted("console=ttyS0 quiet panic=-1"),
            Ok(None),
            "no root=: no handover"
        );
        assert_eq!(
            wanted("console=ttyS0 root=/dev/vda1 quiet"),
            Ok(Some(Handover {
                root: RootSpec::Path("/dev/vda1".into()),
                fstype: None,
                read_only: true,
                init: "/sbin/init".into(),
                image_agent: false,
            }))
        );
        assert!(
            wanted("root=/dev/vda k7d.agent=image").unwrap().unwrap().image_agent,
            "the image's own agent serves"
        );
        assert!(!wanted("root=/dev/vda k7d.agent=imagex").unwrap().unwrap().image_agent);
        let h = wanted("root=/dev/vdb rootfstype=erofs rw init=/lib/systemd/systemd ro rw")
            .unwrap()
            .unwrap();
        assert_eq!(
            (h.fstype.as_deref(), h.read_only, h.init.as_path()),
            (Some("erofs"), false, Path::new("/lib/systemd/systemd")),
            "the last of ro and rw wins"
        );
        assert_eq!(
            wanted("root=UUID=1234-ABCD").unwrap().unwrap().root,
            RootSpec::Uuid("1234-abcd".into())
        );
        for bad in [
            "root=UUID=",
            "root=LABEL=a/b",
            "root=/dev/../etc/passwd",
            "root=/tmp/x",
            "root=/dev/vda init=sbin/init",
            "root=/dev/vda init=/sbin/../bin/sh",
            "root=/dev/vda rootfstype=ext4,ro",
            "root=/dev/vda rootfstype=",
        ] {
            let e = wanted(bad).unwrap_err();
            assert!(!e.is_empty() && !e.contains('\n'), "{bad}: {e}");
        }
    }
}

//! PID 1's setup of the pod VM: filesystems, console, kernel modules,
//! cgroups, hostname, loopback. Every step logs its failure and the rest
//! goes on: PID 1 must come up as far as it can and never exit.

use crate::sys;
use std::ffi::OsStr;
use std::path::Path;

/// The `PATH` children (runc, containers' hooks) get.
pub const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";
/// Where the initramfs keeps modules and their load order.
pub const MODULES: &str = "/lib/modules-k7d";
/// The hostname until a container names the pod.
const HOSTNAME: &str = "k7d-pod";

fn mount(source: &str, target: &str, fstype: &str, flags: libc::c_ulong, data: Option<&str>) {
    if let Err(e) = std::fs::create_dir_all(target) {
        crate::log!("creating {target} failed: {e}");
    }
    match sys::mount(OsStr::new(source), Path::new(target), fstype, flags, data) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => crate::log!("{target} is already mounted"),
        Err(e) => crate::log!("mounting {fstype} at {target} failed: {e}"),
    }
}

/// Brings the VM up (PID 1 only).
pub fn setup() {
    let nosuid_nodev_noexec = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, Some("mode=0755"));
    console();
    mount("proc", "/proc", "proc", nosuid_nodev_noexec, None);
    mount("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, None);
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    );
    // Since Linux 4.7 the devtmpfs /dev/ptmx node opens the devpts instance
    // mounted at /dev/pts; without a node, point it there.
    if std::fs::symlink_metadata("/dev/ptmx").is_err()
        && let Err(e) = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx")
    {
        crate::log!("linking /dev/ptmx failed: {e}");
    }
    mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=1777"),
    );
    mount(
        "tmpfs",
        "/run",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=0755"),
    );
    mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=1777"),
    );
    load_modules(Path::new(MODULES));
    mount("cgroup2", "/sys/fs/cgroup", "cgroup2", nosuid_nodev_noexec, None);
    enable_controllers(Path::new("/sys/fs/cgroup"));
    if let Err(e) = sys::sethostname(HOSTNAME) {
        crate::log!("setting the hostname failed: {e}");
    }
    if let Err(e) = sys::interface_up("lo") {
        crate::log!("bringing up lo failed: {e}");
    }
    // SAFETY: called from `main` before any other thread exists, so nothing
    // reads the environment concurrently.
    unsafe { std::env::set_var("PATH", PATH) };
}

/// Makes fds 0, 1 and 2 the console when the kernel could not open it
/// (an initramfs without /dev/console): otherwise the first files the agent
/// opens would become its stdio.
pub fn console() {
    let open = (0..3).all(sys::fd_is_open);
    if open {
        return;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
        .or_else(|_| std::fs::OpenOptions::new().read(true).write(true).open("/dev/null"));
    if let Ok(f) = file {
        for fd in 0..3 {
            if !sys::fd_is_open(fd) {
                let _ = sys::dup_onto(&f, fd);
            }
        }
        // `f` may itself have landed on 0..2; keep it open then.
        std::mem::forget(f);
    }
}

/// The module file names listed in an `order` file: one per line,
/// dependencies first; blank lines, comments and anything but a plain
/// `.ko` file name are skipped.
pub fn module_order(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| l.ends_with(".ko") && !l.contains('/') && !l.starts_with('.'))
        .collect()
}

/// Loads the modules in `<dir>/order` (already there: `EEXIST` is fine).
pub fn load_modules(dir: &Path) {
    let order = match std::fs::read_to_string(dir.join("order")) {
        Ok(t) => t,
        Err(e) => {
            crate::log!("reading {}/order failed: {e}; no modules loaded", dir.display());
            return;
        }
    };
    for name in module_order(&order) {
        let path = dir.join(name);
        let result = std::fs::File::open(&path).and_then(|f| sys::finit_module(&f));
        match result {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => crate::log!("loading module {name} failed: {e}"),
        }
    }
}

/// The controllers to enable for containers' cgroups that `available`
/// (`cgroup.controllers`) offers.
pub fn wanted_controllers(available: &str) -> Vec<&'static str> {
    let have: Vec<&str> = available.split_whitespace().collect();
    ["cpu", "memory", "pids", "io"]
        .into_iter()
        .filter(|c| have.contains(c))
        .collect()
}

fn enable_controllers(root: &Path) {
    let available = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
    for c in wanted_controllers(&available) {
        if let Err(e) = std::fs::write(root.join("cgroup.subtree_control"), format!("+{c}")) {
            crate::log!("enabling the {c} cgroup controller failed: {e}");
        }
    }
}

/// Whether `/` is the initramfs (`rootfs`), where `pivot_root` is refused
/// (runc must then be told `--no-pivot`).
pub fn root_is_initramfs() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|t| mountinfo_root_is_rootfs(&t))
}

/// [`root_is_initramfs`] on a mountinfo text.
pub fn mountinfo_root_is_rootfs(mountinfo: &str) -> bool {
    mountinfo.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let mount_point = fields.get(4).copied();
        let fstype = fields
            .iter()
            .position(|&f| f == "-")
            .and_then(|i| fields.get(i + 1))
            .copied();
        mount_point == Some("/") && fstype == Some("rootfs")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_module_order_keeps_plain_ko_names_in_order() {
        let text =
            "vsock.ko\n\n# comment\nvmw_vsock_virtio_transport_common.ko\n../evil.ko\nsub/x.ko\nREADME\n  erofs.ko  \n";
        assert_eq!(
            module_order(text),
            ["vsock.ko", "vmw_vsock_virtio_transport_common.ko", "erofs.ko"]
        );
    }

    #[test]
    fn only_available_controllers_are_enabled() {
        assert_eq!(
            wanted_controllers("cpuset cpu io memory hugetlb pids rdma misc\n"),
            ["cpu", "memory", "pids", "io"]
        );
        assert_eq!(wanted_controllers("memory\n"), ["memory"]);
        assert!(wanted_controllers("").is_empty());
    }

    #[test]
    fn an_initramfs_root_is_recognised_in_mountinfo() {
        let initramfs = "1 1 0:2 / / rw - rootfs rootfs rw,size=1000k\n22 1 0:20 / /proc rw,relatime - proc proc rw\n";
        let disk = "25 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n22 25 0:20 / /proc rw - proc proc rw\n";
        assert!(mountinfo_root_is_rootfs(initramfs));
        assert!(!mountinfo_root_is_rootfs(disk));
    }
}

//! `k7d check`: is this host ready to run k7d VMs? One line per item, with the
//! fix in the sentence when something is missing.

use std::path::Path;

use kvm_ioctls::{Cap, Kvm};
use serde::Serialize;

/// Outcome of one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Present.
    Ok,
    /// Missing but optional; some features are off.
    Warn,
    /// Missing and required.
    Fail,
    /// Informational.
    Info,
}

/// One report line.
#[derive(Debug, Clone, Serialize)]
pub struct Item {
    /// Short name.
    pub name: &'static str,
    /// Outcome.
    pub level: Level,
    /// One sentence.
    pub detail: String,
}

/// Which hardware virtualization this host's KVM uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Virt {
    /// Intel VT-x.
    Vmx,
    /// AMD-V.
    Svm,
    /// KVM served by kvm-pvm (no VMX/SVM).
    Pvm,
    /// Neither detected.
    Unknown,
}

/// Detects VMX / SVM / PVM.
pub fn virt() -> Virt {
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Virt::Pvm;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    if flags.contains(&"vmx") {
        Virt::Vmx
    } else if flags.contains(&"svm") {
        Virt::Svm
    } else {
        Virt::Unknown
    }
}

fn item(name: &'static str, level: Level, detail: impl Into<String>) -> Item {
    Item {
        name,
        level,
        detail: detail.into(),
    }
}

fn dev_item(name: &'static str, path: &str, missing: Level, why: &str, fix: &str) -> Item {
    match std::fs::OpenOptions::new().read(true).write(true).open(path) {
        Ok(_) => item(name, Level::Ok, format!("{path} opens read-write")),
        Err(e) => item(name, missing, format!("{path} cannot be opened ({e}): {why}; {fix}")),
    }
}

fn bpf_works() -> Result<(), std::io::Error> {
    // BPF_MAP_CREATE of a one-entry array: the real syscall, nothing simulated.
    #[repr(C)]
    #[derive(Default)]
    struct MapAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        _pad: [u32; 27],
    }
    let attr = MapAttr {
        map_type: 2, // BPF_MAP_TYPE_ARRAY
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid, fully initialised bpf_attr prefix of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0, /* BPF_MAP_CREATE */
            &attr as *const MapAttr,
            std::mem::size_of::<MapAttr>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned here.
    unsafe { libc::close(fd as i32) };
    Ok(())
}

/// Runs every check.
pub fn run() -> Vec<Item> {
    let mut out = Vec::new();
    let kvm = match Kvm::new() {
        Ok(k) => {
            let v = k.get_api_version();
            out.push(if v == 12 {
                item("kvm", Level::Ok, "/dev/kvm opens, KVM API version 12")
            } else {
                item(
                    "kvm",
                    Level::Fail,
                    format!("KVM API version is {v}, k7d needs 12; use a newer host kernel"),
                )
            });
            Some(k)
        }
        Err(e) => {
            out.push(item(
                "kvm",
                Level::Fail,
                format!(
                    "/dev/kvm cannot be opened ({e}): load kvm-intel or kvm-amd and run k7d as root or in the kvm group"
                ),
            ));
            None
        }
    };
    out.push(match virt() {
        Virt::Vmx => item(
            "virtualization",
            Level::Ok,
            "VMX (Intel VT-x): any x86-64 Linux guest boots",
        ),
        Virt::Svm => item("virtualization", Level::Ok, "SVM (AMD-V): any x86-64 Linux guest boots"),
        Virt::Pvm => item(
            "virtualization",
            Level::Warn,
            "PVM (kvm-pvm, no VMX/SVM): stock Linux guests do not boot on this host, only PVM-aware kernels and \
             real-mode guests (the built-in test guests) do; prove Linux guests in the nested lab (docs/lab.md)",
        ),
        Virt::Unknown => item(
            "virtualization",
            Level::Warn,
            "neither VMX, SVM nor PVM detected: enable virtualization in firmware or load kvm-intel/kvm-amd",
        ),
    });
    if let Some(k) = &kvm {
        let cap = |name: &'static str, c: Cap, required: bool, what: &str| {
            if k.check_extension(c) {
                item(name, Level::Ok, format!("{what} supported"))
            } else if required {
                item(
                    name,
                    Level::Fail,
                    format!("{what} missing: k7d needs it; use a host kernel with it"),
                )
            } else {
                item(
                    name,
                    Level::Warn,
                    format!("{what} missing: the features that use it are off"),
                )
            }
        };
        out.push(cap(
            "irqchip",
            Cap::Irqchip,
            true,
            "in-kernel irqchip (KVM_CAP_IRQCHIP)",
        ));
        out.push(cap("pit2", Cap::Pit2, true, "in-kernel PIT (KVM_CAP_PIT2)"));
        let manual = k.check_extension_raw(kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into()) > 0;
        let ring = k.check_extension(Cap::DirtyLogRing);
        out.push(item(
            "dirty-log",
            Level::Ok,
            format!(
                "KVM_GET_DIRTY_LOG with per-slot dirty logging (manual protect: {}, dirty ring: {})",
                if manual { "yes" } else { "no" },
                if ring { "yes" } else { "no" }
            ),
        ));
        out.push(cap(
            "tsc-deadline",
            Cap::TscDeadlineTimer,
            false,
            "TSC-deadline timer (KVM_CAP_TSC_DEADLINE_TIMER)",
        ));
        out.push(cap("irqfd", Cap::Irqfd, true, "irqfd (KVM_CAP_IRQFD)"));
    }
    out.push(match crate::sys::memfd("k7d-check", 1 << 20) {
        Ok(_) => item("memfd", Level::Ok, "memfd_create works (guest RAM is one memfd)"),
        Err(e) => item(
            "memfd",
            Level::Fail,
            format!("memfd_create failed ({e}): k7d needs Linux >= 3.17 with memfd"),
        ),
    });
    out.push(thp_item(crate::sys::shmem_thp_policy().as_deref()));
    out.push(dev_item(
        "tun",
        "/dev/net/tun",
        Level::Warn,
        "virtio-net taps cannot be created",
        "load the tun module (modprobe tun)",
    ));
    out.push(dev_item(
        "vhost-net",
        "/dev/vhost-net",
        Level::Info,
        "NICs use the userspace data plane (vhost is opt-in)",
        "load vhost_net to allow kernel vhost-net",
    ));
    out.push(dev_item(
        "vhost-vsock",
        "/dev/vhost-vsock",
        Level::Info,
        "vsock uses the userspace (hybrid, unix-socket) backend",
        "load vhost_vsock to allow kernel vhost-vsock",
    ));
    out.push(match bpf_works() {
        Ok(()) => item("bpf", Level::Ok, "bpf(2) creates maps: the tc-eBPF direct datapath can load"),
        Err(e) => item(
            "bpf",
            Level::Warn,
            format!("bpf(2) failed ({e}): the direct datapath is unavailable, NICs in auto mode use the bridge chain; run as root on a kernel with CONFIG_BPF_SYSCALL"),
        ),
    });
    out.push(tc_object_item(k7d_net::tc_object_missing_reason()));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    out.push(cgroup_item(&mountinfo, |m| {
        std::fs::read_to_string(m.join("cgroup.controllers")).ok()
    }));
    #[cfg(feature = "shim")]
    out.extend(shim_items());
    out
}

/// Where cgroup v2 is mounted (`/proc/self/mountinfo` text) and which
/// controllers its root offers (`read_controllers` reads a mount point's
/// `cgroup.controllers`): a VM process's memory and CPU limits need
/// `memory` and `cpu` there (issue 36; a hybrid host binds them to v1).
pub fn cgroup_item(mountinfo: &str, read_controllers: impl Fn(&Path) -> Option<String>) -> Item {
    let mount = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2").then(|| left.split_whitespace().nth(4).map(str::to_string))?
    });
    let Some(mount) = mount else {
        return item(
            "cgroup-v2",
            Level::Warn,
            "no cgroup v2 is mounted: a VM process's memory and CPU limits cannot be set (mount cgroup2 with the memory and cpu controllers)",
        );
    };
    let controllers = read_controllers(Path::new(&mount)).unwrap_or_default();
    let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
    let missing: Vec<&str> = ["memory", "cpu"].into_iter().filter(|c| !has(c)).collect();
    if missing.is_empty() {
        item(
            "cgroup-v2",
            Level::Ok,
            format!(
                "cgroup v2 at {mount} offers memory and cpu: a VM process can get its limits (`k7d daemon --jail on --jail-cgroup`)"
            ),
        )
    } else {
        item(
            "cgroup-v2",
            Level::Warn,
            format!(
                "cgroup v2 at {mount} lacks the {} controller{} (bound to cgroup v1 on this host?): a VM process's limits cannot be set there",
                missing.join(" and "),
                if missing.len() > 1 { "s" } else { "" }
            ),
        )
    }
}

/// The jail a VM process enters (issue 36), entered for real: `k7d
/// jail-selftest` (the binary `k7d`) in a scratch root, then judged from
/// outside (`jail::probe`) and by what it reached from inside.
pub fn jail_item(k7d: &Path) -> Item {
    match jail_selftest(k7d) {
        Ok(()) => item(
            "jail",
            Level::Ok,
            "a process can be jailed: own mount, pid, net, ipc and uts namespaces, an empty root, its own uid, no capabilities, no_new_privs (what `k7d daemon --jail on` gives each VM process)",
        ),
        Err(why) => item(
            "jail",
            Level::Warn,
            format!(
                "a process cannot be jailed here: {why} (`k7d daemon --jail on` cannot run; with --jail off VMs run in the daemon, unjailed)"
            ),
        ),
    }
}

fn jail_selftest(k7d: &Path) -> Result<(), String> {
    use std::io::BufReader;
    use std::process::{Command, Stdio};
    if crate::sys::euid() != 0 {
        return Err("it needs root (namespaces, pivot_root, setresuid)".into());
    }
    let dir = std::env::temp_dir().join(format!("k7d-check-jail-{}", std::process::id()));
    let root = dir.join("root");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&root).map_err(|e| format!("cannot make {}: {e}", root.display()))?;
    let id = (2_000_000_000u32 + 37).to_string();
    let result = (|| {
        let mut child = Command::new(k7d)
            .arg("jail-selftest")
            .arg("--root")
            .arg(&root)
            .args(["--uid", &id, "--gid", &id])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {} jail-selftest: {e}", k7d.display()))?;
        let stdin = child.stdin.take();
        let report = crate::jail::read_selftest(BufReader::new(child.stdout.take().ok_or("no stdout")?));
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(err.trim().lines().last().unwrap_or("it failed").to_string());
        }
        let (pid, inside) = report?;
        let v = crate::jail::probe::violations(pid, |_| false);
        drop(stdin);
        if !v.is_empty() {
            return Err(v.join("; "));
        }
        if inside["pid"] != 1 || inside["open_host_file"].is_null() || inside["tcp_connect"].is_null() {
            return Err(format!("from inside it reached more than it should: {inside}"));
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Whether the containerd shim can run pods here: its config, the kernel
/// and initramfs it names, the daemon it calls, `mkfs.erofs`, and the
/// shim's name on `PATH` (docs/containerd.md). Warnings, not failures:
/// plain VMs do not need any of it.
#[cfg(feature = "shim")]
fn shim_items() -> Vec<Item> {
    use k7d_shim::config::{DEFAULT_PATH, ShimConfig};
    let path = std::env::var_os("K7D_SHIM_CONFIG").map_or_else(|| DEFAULT_PATH.into(), std::path::PathBuf::from);
    if !path.exists() {
        return vec![item(
            "shim-config",
            Level::Info,
            format!(
                "no {}: the containerd shim is not configured (docs/containerd.md)",
                path.display()
            ),
        )];
    }
    let cfg = match ShimConfig::read(&path) {
        Ok(c) => c,
        Err(e) => return vec![item("shim-config", Level::Warn, format!("{e:#}"))],
    };
    let mut out = vec![item("shim-config", Level::Ok, format!("{} is valid", path.display()))];
    for (name, p) in [("shim-kernel", &cfg.kernel), ("shim-initramfs", &cfg.initramfs)] {
        out.push(match std::fs::File::open(p) {
            Ok(_) => item(name, Level::Ok, format!("{} is readable", p.display())),
            Err(e) => item(
                name,
                Level::Warn,
                format!("{} cannot be read ({e}): pods cannot boot", p.display()),
            ),
        });
    }
    let daemon = k7d_shim::api_daemon::connect(&cfg.daemon_socket);
    out.push(match daemon.pid() {
        Ok(pid) => item(
            "shim-daemon",
            Level::Ok,
            format!("the daemon at {} answers (pid {pid})", cfg.daemon_socket.display()),
        ),
        Err(e) => item("shim-daemon", Level::Warn, format!("{e:#}")),
    });
    let on_path = |tool: &str| {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false)
    };
    out.push(if on_path("mkfs.erofs") {
        item(
            "shim-erofs",
            Level::Ok,
            "mkfs.erofs is on PATH: images are packed as erofs",
        )
    } else {
        item(
            "shim-erofs",
            Level::Warn,
            "mkfs.erofs is not on PATH: the shim cannot pack images (apt-get install erofs-utils)",
        )
    });
    out.push(if on_path(k7d_shim::SHIM_NAME) {
        item("shim-binary", Level::Ok, format!("{} is on PATH", k7d_shim::SHIM_NAME))
    } else {
        item(
            "shim-binary",
            Level::Warn,
            format!(
                "{} is not on PATH: link it to this binary (ln -s $(command -v k7d) /usr/local/bin/{})",
                k7d_shim::SHIM_NAME,
                k7d_shim::SHIM_NAME
            ),
        )
    });
    out
}

/// Whether guest RAM (a shared memfd that k7d advises `MADV_HUGEPAGE`) can
/// get transparent huge pages: `shmem_enabled` must be `advise`,
/// `within_size`, `always` or `force`.
fn thp_item(policy: Option<&str>) -> Item {
    match policy {
        Some("advise" | "within_size" | "always" | "force") => item(
            "thp-shmem",
            Level::Ok,
            format!(
                "shmem_enabled is {}: guest RAM gets 2 MiB pages",
                policy.unwrap_or_default()
            ),
        ),
        Some(p) => item(
            "thp-shmem",
            Level::Info,
            format!(
                "shmem_enabled is {p}: guest RAM uses 4 KiB pages; `echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled` lets k7d ask for 2 MiB pages (faster guest boot, fewer faults)"
            ),
        ),
        None => item(
            "thp-shmem",
            Level::Info,
            "no transparent huge pages in this kernel: guest RAM uses 4 KiB pages",
        ),
    }
}

/// Whether this binary embeds the tc-eBPF object (decided when it was built).
fn tc_object_item(missing: Option<&str>) -> Item {
    match missing {
        None => item(
            "tc-object",
            Level::Ok,
            "the tc-eBPF object is embedded in this binary (clang built it)",
        ),
        Some(why) => item(
            "tc-object",
            Level::Warn,
            format!(
                "no tc-eBPF object is embedded in this binary ({why}): datapath=direct NICs are refused and \
                 datapath=auto NICs use the bridge chain; install clang (apt-get install clang libbpf-dev) and \
                 rebuild k7d"
            ),
        ),
    }
}

/// Whether any required item failed.
pub fn failed(items: &[Item]) -> bool {
    items.iter().any(|i| i.level == Level::Fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_line_says_whether_a_vm_process_can_get_limits() {
        let hybrid = "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                      35 25 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        let pure = "29 24 0:25 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let none = "22 1 0:21 / / rw - ext4 /dev/vda1 rw\n";
        let empty = cgroup_item(hybrid, |_| Some(String::new()));
        assert_eq!(empty.level, Level::Warn);
        assert!(
            empty
                .detail
                .contains("/sys/fs/cgroup/unified lacks the memory and cpu controllers"),
            "{}",
            empty.detail
        );
        let only_memory = cgroup_item(pure, |_| Some("cpuset io memory pids\n".into()));
        assert!(
            only_memory.detail.contains("lacks the cpu controller "),
            "{}",
            only_memory.detail
        );
        let full = cgroup_item(pure, |m| {
            assert_eq!(m, Path::new("/sys/fs/cgroup"));
            Some("cpuset cpu io memory hugetlb pids rdma misc\n".into())
        });
        assert_eq!(full.level, Level::Ok, "{}", full.detail);
        assert!(
            cgroup_item(none, |_| None)
                .detail
                .starts_with("no cgroup v2 is mounted")
        );
    }

    #[test]
    fn tc_object_line_says_whether_and_why_not() {
        let ok = tc_object_item(None);
        assert_eq!((ok.name, ok.level), ("tc-object", Level::Ok));
        assert!(ok.detail.contains("embedded"), "{}", ok.detail);
        let missing = tc_object_item(Some("clang was not found in PATH at build time"));
        assert_eq!(missing.level, Level::Warn);
        assert!(
            missing.detail.contains("(clang was not found in PATH at build time)"),
            "{}",
            missing.detail
        );
        assert!(missing.detail.contains("bridge chain"), "{}", missing.detail);
    }

    #[test]
    fn thp_line_says_whether_guest_ram_gets_huge_pages() {
        for p in ["advise", "within_size", "always", "force"] {
            assert_eq!(thp_item(Some(p)).level, Level::Ok, "{p}");
        }
        let never = thp_item(Some("never"));
        assert_eq!(never.level, Level::Info);
        assert!(never.detail.contains("echo advise"), "{}", never.detail);
        assert_eq!(thp_item(None).level, Level::Info);
    }

    #[test]
    fn run_reports_the_tc_object_of_this_build() {
        let items = run();
        let line = items.iter().find(|i| i.name == "tc-object").expect("a tc-object line");
        assert_eq!(
            line.level == Level::Ok,
            k7d_net::tc_object_embedded(),
            "{}",
            line.detail
        );
    }
}

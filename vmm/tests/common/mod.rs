//! Helpers shared by the `k7d` binary's integration tests
//! (`mod common;` in each test file).
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};

/// The `k7d` binary cargo built for these tests.
pub const K7D: &str = env!("CARGO_BIN_EXE_k7d");

/// A process's stdout and stderr as text.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A fresh scratch directory under the system temp dir (unique per process
/// and call), removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// `<tmp>/k7d-<tag>-<pid>-<n>`, empty.
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "k7d-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// True when this test runs as root; otherwise records a skip (a jail
/// needs namespaces, `pivot_root` and `setresuid`) and returns false.
pub fn root_or_skip(test: &str) -> bool {
    if k7d_vmm::sys::euid() == 0 {
        return true;
    }
    k7d_test_skip::skip(test, "not root: namespaces, pivot_root and setresuid need it");
    false
}

/// An empty directory `<scratch>/<name>` for a jail's root.
pub fn jail_root(dir: &Scratch, name: &str) -> PathBuf {
    let root = dir.0.join(name);
    std::fs::create_dir(&root).unwrap();
    root
}

/// What a jailed VM process may hold besides stdio: the `/dev/kvm` it was
/// handed, its KVM VM and vCPU fds, its guest RAM's memfd, eventfds, pipes
/// and epoll (`jail::probe::violations`'s `allowed`).
pub fn a_vm_processs_own(target: &str) -> bool {
    target == "/dev/kvm"
        || target.starts_with("anon_inode:kvm-")
        || target.starts_with("/memfd:k7d-ram-")
        || target.starts_with("anon_inode:[eventfd]")
        || target.starts_with("anon_inode:[eventpoll]")
        || target.starts_with("pipe:[")
}

/// What a jailed VM process may hold: [`a_vm_processs_own`], and its
/// channel's and listening sockets.
pub fn a_vm_processs_own_or_socket(target: &str) -> bool {
    a_vm_processs_own(target) || target.starts_with("socket:[")
}

/// Asserts what VM process `pid` (`label` in messages) must be: nothing of
/// its jail missing (`jail::probe`), every thread (a vCPU among them) under
/// its seccomp filter, with `no_new_privs` and no effective capability.
/// Returns its uid.
pub fn assert_jailed_vm_process(pid: u32, label: &str) -> u32 {
    assert_jailed_vm_process_with(pid, label, None)
}

/// [`assert_jailed_vm_process`] of a daemon's VM process whose files are
/// in `own_dir` (its runtime directory): besides its own descriptors it
/// holds only files there (its serial log, its disks' images are named by
/// the caller's config, not here), its standard input and output are
/// `/dev/null` and its standard error is its own log there, never the
/// daemon's.
pub fn assert_jailed_vm_process_with(pid: u32, label: &str, own_dir: Option<&Path>) -> u32 {
    let proc = format!("/proc/{pid}");
    let own = |t: &str| a_vm_processs_own_or_socket(t) || own_dir.is_some_and(|d| Path::new(t).starts_with(d));
    let v = k7d_vmm::jail::probe::violations(pid, own);
    assert!(v.is_empty(), "{label} (pid {pid}) falls short of its jail: {v:#?}");
    if let Some(d) = own_dir {
        let fd = |n: u32| std::fs::read_link(format!("{proc}/fd/{n}")).unwrap_or_default();
        assert_eq!(fd(0), Path::new("/dev/null"), "{label}: stdin");
        assert_eq!(fd(1), Path::new("/dev/null"), "{label}: stdout");
        assert_eq!(
            fd(2),
            d.join(k7d_vmm::daemon::PROCESS_LOG),
            "{label}: its standard error is not its own log"
        );
    }
    let status = std::fs::read_to_string(format!("{proc}/status")).unwrap();
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .unwrap();
    assert_ne!(uid, 0, "{label} runs as root");
    let mut threads = Vec::new();
    for t in std::fs::read_dir(format!("{proc}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let st = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        for want in ["Seccomp:\t2", "NoNewPrivs:\t1", "CapEff:\t0000000000000000"] {
            assert!(
                st.lines().any(|l| l == want),
                "{label}: thread {} lacks `{want}`",
                comm.trim()
            );
        }
        threads.push(comm.trim().to_string());
    }
    assert!(
        threads.iter().any(|c| c.starts_with("vcpu")),
        "{label}: no vCPU thread: {threads:?}"
    );
    uid
}

/// Whether process `pid` holds guest RAM of VM `vm`, as a descriptor or a
/// mapping.
pub fn holds_ram_of(pid: u32, vm: &str) -> bool {
    let name = format!("memfd:k7d-ram-{vm} ");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .any(|t| format!("{} ", t.display()).contains(&name))
        })
        .unwrap_or(false);
    fds || maps.contains(&name)
}

/// Reads a u32 of VM `vm`'s guest RAM at guest address `gpa` straight
/// from the mapping in VM process `pid` (`/proc/<pid>/mem`, as root):
/// what a test reads while no daemon exists to ask.
pub fn read_guest_u32(pid: u32, vm: &str, gpa: u64) -> u32 {
    let b = read_guest(pid, vm, gpa, 4);
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// [`read_guest_u32`] for `len` bytes (within one mapping).
pub fn read_guest(pid: u32, vm: &str, gpa: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let at = host_addr_of(pid, vm, gpa).unwrap_or_else(|| panic!("process {pid} maps no RAM of {vm} at {gpa:#x}"));
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut b = vec![0u8; len];
    mem.read_exact_at(&mut b, at).unwrap();
    b
}

/// Where guest address `gpa` of VM `vm` is mapped in process `pid`
/// (`/proc/<pid>/maps`), if it is.
pub fn host_addr_of(pid: u32, vm: &str, gpa: u64) -> Option<u64> {
    let name = format!("/memfd:k7d-ram-{vm} ");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().filter(|l| format!("{l} ").contains(&name)).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let offset = u64::from_str_radix(f[2], 16).ok()?;
        let (lo, hi) = f[0].split_once('-')?;
        let (lo, hi) = (u64::from_str_radix(lo, 16).ok()?, u64::from_str_radix(hi, 16).ok()?);
        (gpa >= offset && gpa + 4 <= offset + (hi - lo)).then(|| lo + gpa - offset)
    })
}

/// Writes a u32 into VM `vm`'s guest RAM at `gpa` through its mapping in
/// process `pid` (`/proc/<pid>/mem`, as root).
pub fn write_guest_u32(pid: u32, vm: &str, gpa: u64, v: u32) {
    use std::os::unix::fs::FileExt;
    let at = host_addr_of(pid, vm, gpa).unwrap_or_else(|| panic!("process {pid} maps no RAM of {vm} at {gpa:#x}"));
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .unwrap();
    mem.write_all_at(&v.to_le_bytes(), at).unwrap();
}

/// Kills (`SIGKILL`) every VM process whose command line names `dir` (its
/// jail root is under it): VM processes outlive their daemon by design, so
/// a test that fails half-way must not leave them running (and spinning)
/// after it. Returns how many it killed.
pub fn kill_vm_processes_under(dir: &std::path::Path) -> usize {
    let pids = vm_process_pids_under(dir);
    for &pid in &pids {
        // SAFETY: kill takes integers; the process is a VM process this
        // test's daemon started (its jail root is under the test's dir).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    pids.len()
}

/// The VM processes (any state) whose jail root is under `dir`.
pub fn vm_process_pids_under(dir: &std::path::Path) -> Vec<u32> {
    let dir = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            (cmdline.contains("vm-process") && cmdline.contains(&dir)).then_some(pid)
        })
        .collect()
}

/// Starts `bin daemon` with its state directory and socket under `dir`
/// (`<dir>/state`, `<dir>/k7d.sock`) and `extra` flags, its stderr piped
/// (`stderr_null`: discarded), and waits until its socket accepts (a
/// killed daemon leaves its socket file, so the file alone says nothing).
/// A daemon that exits first fails the test.
pub fn start_daemon(bin: &Path, dir: &Path, extra: &[&str], stderr_null: bool) -> std::process::Child {
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .arg("daemon")
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(extra)
        .env_remove("K7D_SOCKET")
        .stdout(Stdio::null())
        .stderr(if stderr_null { Stdio::null() } else { Stdio::piped() })
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(dir.join("k7d.sock")).is_err() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the daemon did not start"
        );
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the daemon exited early: {st}");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child
}

/// The Debian cloud kernel the lab fetched (`tests/lab/run.sh --fetch`).
pub fn cached_cloud_kernel() -> Option<std::path::PathBuf> {
    let cache = std::env::var_os("K7D_LAB_CACHE").map_or_else(
        || std::path::PathBuf::from("/var/cache/k7d-lab"),
        std::path::PathBuf::from,
    );
    std::fs::read_dir(cache.join("pkgs"))
        .ok()?
        .flatten()
        .filter(|p| p.file_name().to_string_lossy().starts_with("linux-image-"))
        .filter_map(|p| std::fs::read_dir(p.path().join("boot")).ok())
        .flat_map(|d| d.flatten())
        .map(|f| f.path())
        .find(|f| {
            let n = f.file_name().unwrap_or_default().to_string_lossy();
            n.starts_with("vmlinuz-") && n.ends_with("-cloud-amd64")
        })
}

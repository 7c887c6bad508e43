//! Helpers for k7d's host-level integration tests (real KVM, test guests).

pub mod blk_driver;
pub mod net_driver;
pub mod wire;

use std::path::PathBuf;
use std::time::Duration;

use k7d_api::config::{GuestSpec, VmConfig};
use k7d_vmm::{Vm, VmOptions};

/// A unique scratch directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates `/tmp/k7d-test-<tag>-<pid>-<n>`.
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "k7d-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The lab's download cache (`$K7D_LAB_CACHE`, by default `/var/cache/k7d-lab`).
pub fn lab_cache() -> PathBuf {
    std::env::var_os("K7D_LAB_CACHE").map_or_else(|| PathBuf::from("/var/cache/k7d-lab"), PathBuf::from)
}

/// The Debian cloud kernel the lab unpacked (`$K7D_LAB_CACHE/pkgs`, by
/// default `/var/cache/k7d-lab`); `.ci/run` fetches it
/// (`tests/lab/run.sh --fetch`) before the tests.
pub fn cached_cloud_kernel() -> Option<PathBuf> {
    for pkg in std::fs::read_dir(lab_cache().join("pkgs")).ok()?.flatten() {
        for f in std::fs::read_dir(pkg.path().join("boot"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.starts_with("vmlinuz-") && name.ends_with("-cloud-amd64") {
                return Some(f.path());
            }
        }
    }
    None
}

/// The Linux VM whose build `benches/benches/vm_build.rs` times and the
/// `vm_build_linux` budget bounds: `kernel` and `initrd`, 2 vCPUs,
/// 256 MiB, virtio-pci blk (`disk`), net (its own tap) and rng.
pub fn linux_build_config(kernel: &std::path::Path, initrd: &std::path::Path, disk: &std::path::Path) -> VmConfig {
    use k7d_api::config::{DevicesConfig, DiskConfig, NicConfig};
    VmConfig {
        vcpus: 2,
        memory_mib: 256,
        guest: GuestSpec::Linux {
            kernel: kernel.to_path_buf(),
            initrd: Some(initrd.to_path_buf()),
            cmdline: None,
        },
        devices: DevicesConfig {
            rng: true,
            disks: vec![DiskConfig {
                path: Some(disk.to_path_buf()),
                read_only: false,
            }],
            nics: vec![NicConfig::default()],
            vsock: None,
            vmgenid: None,
        },
        ..Default::default()
    }
}

/// A config for a built-in guest.
pub fn builtin(name: &str, vcpus: u8, memory_mib: u64, args: &[u32]) -> VmConfig {
    VmConfig {
        vcpus,
        memory_mib,
        guest: GuestSpec::Builtin {
            name: name.into(),
            args: args.to_vec(),
        },
        ..Default::default()
    }
}

/// Builds and starts a VM logging serial output to `log`.
pub fn boot(id: &str, cfg: &VmConfig, log: &std::path::Path) -> Vm {
    let mut vm = Vm::new(
        id,
        cfg,
        &VmOptions {
            serial_log: Some(log.to_path_buf()),
            ..Default::default()
        },
    )
    .expect("build vm");
    vm.start().expect("start vm");
    vm
}

/// Boots `cfg` (a `memwriter` guest) as `id` and waits until its loop
/// has run 1000 times, so that it is churning its pages.
pub fn boot_churning(id: &str, cfg: &VmConfig, log: &std::path::Path) -> Vm {
    let vm = boot(id, cfg, log);
    let counter = k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER;
    assert!(
        wait_for(Duration::from_secs(20), || read_u32(&vm, counter) > 1000),
        "{id}: memwriter did not start churning"
    );
    vm
}

/// Reads a u32 from guest RAM.
pub fn read_u32(vm: &Vm, addr: u64) -> u32 {
    use k7d_vmm::vstate::memory::GuestMemoryMmap;
    fn rd(m: &GuestMemoryMmap, a: u64) -> u32 {
        use vm_memory::Bytes;
        m.read_obj(vm_memory::GuestAddress(a)).expect("read guest u32")
    }
    rd(vm.memory(), addr)
}

/// Polls `f` every 5 ms until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A daemon served in this process on a socket in a scratch directory.
pub struct TestDaemon {
    /// The daemon.
    pub daemon: std::sync::Arc<k7d_vmm::daemon::Daemon>,
    /// Its server (None after `shutdown`).
    pub server: Option<k7d_vmm::daemon::server::Server>,
    /// Scratch dir: `state/` and `k7d.sock`.
    pub dir: TempDir,
}

impl TestDaemon {
    /// Opens a daemon on a fresh state dir and serves it.
    pub fn start(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let (d, reconciled) = k7d_vmm::daemon::Daemon::open(&dir.0.join("state")).expect("open daemon");
        assert!(reconciled.is_empty());
        let d = std::sync::Arc::new(d);
        let server = k7d_vmm::daemon::server::Server::start(d.clone(), &dir.0.join("k7d.sock")).expect("serve");
        Self {
            daemon: d,
            server: Some(server),
            dir,
        }
    }

    /// A new API connection.
    pub fn client(&self) -> k7d_api::client::Client {
        k7d_api::client::Client::connect(&self.dir.0.join("k7d.sock")).expect("connect")
    }

    /// Record files (`*.json`) in the state dir.
    pub fn record_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.dir.0.join("state/vms"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(".json"))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Every entry under `state/vms` (records, locks, runtime dirs, temp files).
    pub fn state_entries(&self) -> Vec<String> {
        std::fs::read_dir(self.dir.0.join("state/vms"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        self.daemon.shutdown();
    }
}

/// Targets of `/proc/self/fd` links.
pub fn open_fds() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|p| p.to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Number of threads of this process.
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map(|rd| rd.count()).unwrap_or(0)
}

/// Names (`comm`) of this process's threads.
pub fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .map(|s| s.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Drops VMs on threads of their own, so that their teardowns overlap.
///
/// A KVM VM's last close waits for the kernel's grace periods: 15-27 ms per
/// VM on this host (`strace -T` on a stress test: `close` of the VM fd),
/// nearly all of it waiting, not working. The fork stress tests drop a
/// thousand children or more, one after another, and spent most of their
/// time there (`cluster_forks_equal_...`: 70 s, 17 s with the drops
/// overlapped). Closes in flight at once share the wait. Dropping the
/// reaper (or [`Reaper::finish`]) waits for every VM it was given.
#[derive(Default)]
pub struct Reaper(Vec<std::thread::JoinHandle<()>>);

impl Reaper {
    /// Stops and drops `vm` on a thread of its own.
    pub fn reap(&mut self, vm: Vm) {
        self.0.retain(|h| !h.is_finished());
        self.0.push(std::thread::spawn(move || drop(vm)));
    }

    /// Waits until every VM given is gone; a panic in a VM's drop is re-raised.
    pub fn finish(mut self) {
        self.join_all();
    }

    fn join_all(&mut self) {
        for h in self.0.drain(..) {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.join_all();
        }
    }
}

/// Whether any vCPU or API-connection thread is alive.
pub fn vm_threads_alive() -> bool {
    thread_names().iter().any(|n| n.starts_with("vcpu") || n == "k7d-conn")
}

/// Whether this process runs as root (taps, netns).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

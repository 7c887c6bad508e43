//! Helpers for k7d's host-level integration tests (real KVM, test guests).

use std::path::PathBuf;
use std::time::Duration;

use k7d_vmm::config::{GuestSpec, VmConfig};
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
        },
    )
    .expect("build vm");
    vm.start().expect("start vm");
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


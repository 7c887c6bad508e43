//! Helpers shared by the `k7d` binary's integration tests
//! (`mod common;` in each test file).
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
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

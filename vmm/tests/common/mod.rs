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

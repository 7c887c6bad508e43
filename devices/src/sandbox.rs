//! The seam through which the VMM confines device worker threads.
//!
//! This crate never imports the VMM, yet every thread it spawns must enter the
//! VMM's sandbox (seccomp filter, no capabilities) before it touches guest
//! data, and a denied system call must be traced back to its VM. So the VMM
//! installs a [`Sandbox`] once per process; every spawn site calls
//! [`capture`] on the spawning thread (the VM it works for is known there)
//! and [`enter`] first thing on the new thread, keeping the returned guard
//! for the thread's life. Without an installed sandbox (this crate's own
//! tests, the fuzz targets) both are no-ops.

use std::any::Any;
use std::sync::OnceLock;

/// What the VMM does for each device worker thread.
pub trait Sandbox: Send + Sync {
    /// On the spawning thread: what the new thread needs to enter its
    /// sandbox (for k7d, the VM the spawning thread works for).
    fn capture(&self) -> Box<dyn Any + Send>;
    /// First thing on the new thread, named `name`: confines it. The
    /// returned guard is dropped when the thread's work ends. An error is
    /// logged by the implementation; the thread then runs on unconfined only
    /// if the implementation allows it.
    fn enter(&self, token: Box<dyn Any + Send>, name: &str) -> Box<dyn Any>;
}

static SANDBOX: OnceLock<&'static dyn Sandbox> = OnceLock::new();

/// Installs the process's sandbox; the first call wins (returns false after).
pub fn install(sandbox: &'static dyn Sandbox) -> bool {
    SANDBOX.set(sandbox).is_ok()
}

/// What a new worker thread takes along (see [`capture`]).
pub struct Token(Option<Box<dyn Any + Send>>);

/// On the spawning thread, before the spawn.
pub fn capture() -> Token {
    Token(SANDBOX.get().map(|s| s.capture()))
}

/// Keeps a worker thread's sandbox entry for the thread's life.
pub struct Guard {
    _inner: Option<Box<dyn Any>>,
}

/// First thing on a new worker thread named `name`.
pub fn enter(token: Token, name: &str) -> Guard {
    let inner = match (SANDBOX.get(), token.0) {
        (Some(s), Some(t)) => Some(s.enter(t, name)),
        _ => None,
    };
    Guard { _inner: inner }
}

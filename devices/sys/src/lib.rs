//! The system-call wrappers that more than one k7d crate needs, each written
//! once: every `unsafe` block behind them lives in this crate, next to its
//! `// SAFETY:` argument, and callers see safe functions returning
//! [`std::io::Result`] (`EINTR` retried where a call can be retried).
//!
//! - [`fd`]: raw `read`/`write`/`writev`, positioned reads and writes
//!   between files and guest memory (vm-memory's `VolatileSlice`), `poll`,
//!   `O_NONBLOCK` on and off.
//! - [`file`]: `flock`, the page size, data extents (`SEEK_DATA` /
//!   `SEEK_HOLE`), `copy_file_range`, `fallocate`, `mkfifo`, `getrlimit`.
//! - [`mount`]: `mount(2)` (binds, private propagation), lazy unmounts, a
//!   mount namespace of one's own (also for a child before its exec, with
//!   binds), a path's filesystem type and whether it is a mount's root.
//! - [`netif`]: a thread's network namespace (`setns`) and its interfaces'
//!   IPv4 address and MTU (`getifaddrs`, `SIOC*IF*`).
//! - [`random`]: the kernel's CSPRNG (`getrandom`).
//! - [`socket`]: connecting unix stream sockets without blocking; whether
//!   a kept connection is idle and open.
//! - [`thread`]: the calling thread's id.
//! - [`tap`]: tap queues (`TUNSETIFF`, `TUNSETOFFLOAD`, `TUNSETVNETHDRSZ`,
//!   `TUNSETQUEUE`) and the [`tap::Tap`] a virtio-net device takes.
//!
//! Crate-specific calls stay in their crate's own sys module (`vmm/src/sys.rs`
//! for KVM-adjacent and process-wide calls, `net/src/sys.rs` for bpffs).

pub mod fd;
pub mod file;
pub mod mount;
pub mod netif;
pub mod random;
pub mod socket;
pub mod tap;
pub mod thread;

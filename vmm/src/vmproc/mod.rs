//! The VM process (issue 36, in progress): one VM in a jailed process of
//! its own, driven over one typed, versioned channel. `proto.rs` is the
//! channel's messages, `runtime.rs` the VM process's side (`k7d
//! vm-process`: the jail first, then the VM, then requests until the
//! channel closes), `handle.rs` the caller's side (spawn, call).
//!
//! What exists: a VM process runs one built-in guest (the real-mode test
//! guests need no files), handed `/dev/kvm`, its channel and optionally a
//! listening socket as descriptors at spawn; start, pause, resume, peek,
//! status, stop; it outlives its caller when it has the socket, and the
//! next caller re-attaches there. Not yet: Linux guests and devices (their
//! files and taps as descriptors), fork across processes, the daemon using
//! it and re-attaching from its records after a restart.

/// The exit status of a VM process that panicked (its panic hook ends it:
/// nothing carries on with what the panic left half-changed).
pub const PANIC_EXIT: i32 = 101;

pub mod handle;
pub mod proto;
pub mod runtime;
pub mod spawner;
pub mod wire;

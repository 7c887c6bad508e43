//! The VM process (issue 36, in progress): one VM in a jailed process of
//! its own, driven over one typed, versioned channel. `proto.rs` is the
//! channel's messages, `runtime.rs` the VM process's side (`k7d
//! vm-process`: the jail first, then the VM, then requests until the
//! channel closes), `handle.rs` the caller's side (spawn, call).
//!
//! What exists: a VM process runs one built-in guest (the real-mode test
//! guests need no files), handed `/dev/kvm` and its channel as descriptors
//! at spawn; start, pause, resume, peek, status, stop. Not yet: Linux
//! guests and devices (their files and taps as descriptors), fork across
//! processes, the daemon using it, re-attach after a daemon restart.

pub mod handle;
pub mod proto;
pub mod runtime;

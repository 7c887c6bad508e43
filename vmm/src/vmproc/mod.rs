//! The VM process (issue 36, in progress): one VM in a jailed process of
//! its own, driven over one typed, versioned channel. `proto.rs` is the
//! channel's messages, `runtime.rs` the VM process's side (`k7d
//! vm-process`: the jail first, then the VM, then requests until the
//! channel closes), `handle.rs` the caller's side (spawn, call).
//!
//! What exists: a VM process is handed `/dev/kvm`, its channel and
//! optionally a listening socket as descriptors at spawn, and its VM's host
//! files (kernel, initrd, raw image, disks, tap queues, serial log, its own
//! log) with the build request (`vstate::handed`): it opens nothing by path. Start,
//! pause, resume, peek, status, stop, capture and fork-child builds; it
//! outlives its caller when it has the socket, and the next caller
//! re-attaches there (the daemon does, from its records:
//! `daemon/processes.rs`). vsock's host socket arrives bound (the guest's
//! own connections to the host, by path, are refused), a NIC's tap queues
//! arrive open (in a pod's netns with the datapath around them, for a
//! datapath NIC: the daemon's to detach), a new medium arrives open; a
//! fork child's devices are built from files handed over the same way
//! (a read-write disk's: its frozen base read-only and an overlay of its
//! own, made by the caller, which also hands the source the overlay files
//! a fork takes); a NIC on vhost-net gets its `/dev/vhost-net` devices
//! handed over too; snapshots' parts and re-bases are served.

/// The exit status of a VM process that panicked (its panic hook ends it:
/// nothing carries on with what the panic left half-changed).
pub const PANIC_EXIT: i32 = 101;

pub mod handle;
pub mod proto;
pub mod runtime;
pub mod spawner;
pub mod wire;

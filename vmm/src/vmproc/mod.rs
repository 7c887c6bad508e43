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

/// The exit status of a VM process whose guest reset the machine.
pub const GUEST_RESET_EXIT: i32 = 90;
/// The exit status of a VM process whose guest powered off.
pub const GUEST_POWEROFF_EXIT: i32 = 91;
/// The exit status of a VM process whose vCPU stopped the VM on an exit
/// k7d cannot continue from (its log names the vCPU and the exit).
pub const VCPU_ERROR_EXIT: i32 = 92;
/// The exit status of a VM process one of whose threads made a system
/// call its seccomp filter denies (its log names the thread and the call).
pub const SECCOMP_EXIT: i32 = 93;

/// The status a VM process exits with when its VM stopped for `reason`
/// by itself (as Firecracker's process ends with its guest: the guest's
/// RAM and KVM state go at once, and the daemon's watcher learns of the
/// stop from the process's end); `None` for a requested stop, which its
/// caller asked for and is told of in the reply.
pub fn exit_code_of(reason: &StopReason) -> Option<i32> {
    match reason {
        StopReason::GuestReset => Some(GUEST_RESET_EXIT),
        StopReason::GuestPoweroff => Some(GUEST_POWEROFF_EXIT),
        StopReason::VcpuError { .. } => Some(VCPU_ERROR_EXIT),
        StopReason::SeccompDenied { .. } => Some(SECCOMP_EXIT),
        StopReason::Requested | StopReason::ProcessEnded { .. } => None,
    }
}

/// Why VM `id`'s process `pid` ended with exit status `code`, when that
/// status is one [`exit_code_of`] gives (else `None`). The guest's own
/// stops keep their kinds; a vCPU error or seccomp denial is told in one
/// sentence pointing at the process's log (`PROCESS_LOG` in the VM's
/// directory), which has the whole reason.
pub fn reason_of_exit(code: i32, id: &str, pid: u32) -> Option<StopReason> {
    let told_in_log = |what: &str| StopReason::ProcessEnded {
        message: format!("vm {id}: {what}; VM process {pid} ended (its log names them)"),
    };
    match code {
        GUEST_RESET_EXIT => Some(StopReason::GuestReset),
        GUEST_POWEROFF_EXIT => Some(StopReason::GuestPoweroff),
        VCPU_ERROR_EXIT => Some(told_in_log("a vCPU stopped the VM on an exit k7d cannot continue from")),
        SECCOMP_EXIT => Some(told_in_log(
            "a thread of the VM made a system call its seccomp filter denies",
        )),
        _ => None,
    }
}

use crate::vstate::control::StopReason;

pub mod handle;
pub mod proto;
pub mod runtime;
pub mod spawner;
pub mod wire;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guests_own_stop_is_told_by_the_exit_status_and_read_back() {
        for reason in [StopReason::GuestReset, StopReason::GuestPoweroff] {
            let code = exit_code_of(&reason).unwrap();
            assert_eq!(reason_of_exit(code, "v", 7), Some(reason));
        }
        let vcpu = StopReason::VcpuError {
            vcpu: 1,
            exit: "KVM_EXIT_SHUTDOWN".into(),
            message: "m".into(),
        };
        let back = reason_of_exit(exit_code_of(&vcpu).unwrap(), "v", 7).unwrap();
        assert_eq!(
            back.to_string(),
            "vm v: a vCPU stopped the VM on an exit k7d cannot continue from; VM process 7 ended (its log names them)"
        );
        // A requested stop is its caller's to report; other statuses
        // (a clean exit, a panic) are not a guest's stop.
        assert_eq!(exit_code_of(&StopReason::Requested), None);
        for code in [0, 1, PANIC_EXIT] {
            assert_eq!(reason_of_exit(code, "v", 7), None);
        }
        let codes: std::collections::HashSet<_> = [
            GUEST_RESET_EXIT,
            GUEST_POWEROFF_EXIT,
            VCPU_ERROR_EXIT,
            SECCOMP_EXIT,
            PANIC_EXIT,
        ]
        .into();
        assert_eq!(codes.len(), 5);
    }
}

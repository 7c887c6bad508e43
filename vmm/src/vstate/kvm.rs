//! The process's `/dev/kvm`: opened by path, or, in a jailed VM process
//! (which has no `/dev`), the descriptor it was handed before it entered
//! its jail (issue 36: everything a VM needs arrives as a descriptor).

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::OnceLock;

use kvm_ioctls::Kvm;

static HANDED: OnceLock<File> = OnceLock::new();

/// Makes `kvm` (an open `/dev/kvm`) the one every later [`open`] duplicates.
/// Once per process: a second call gives its file back.
pub fn hand_over(kvm: File) -> Result<(), File> {
    HANDED.set(kvm)
}

/// A KVM system handle: a duplicate of the handed descriptor, else
/// `/dev/kvm` opened by path.
pub fn open() -> Result<Kvm, kvm_ioctls::Error> {
    match HANDED.get() {
        Some(f) => {
            let dup = f
                .try_clone()
                .map_err(|e| kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EBADF)))?;
            // SAFETY: `dup` is a fresh descriptor of /dev/kvm that nothing
            // else owns; the Kvm takes it over (and closes it on drop).
            Ok(unsafe { Kvm::from_raw_fd(dup.into_raw_fd()) })
        }
        None => Kvm::new(),
    }
}

//! `VmOptions`: how the host runs a VM, apart from what its guest sees.

use std::path::PathBuf;

/// Host-side options that are not part of the guest-visible config.
#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    /// Append the guest's serial output to this file.
    pub serial_log: Option<PathBuf>,
    /// Node-wide settings (network queue/vhost policy).
    pub node: crate::config::NodeConfig,
    /// Where LZ4 bzImages are unpacked once and cached
    /// (`arch::x86_64::unpack`); `None` boots them through their own
    /// decompressor.
    pub kernel_cache: Option<PathBuf>,
    /// Where the VM's host files come from: opened by path, or handed over
    /// to a VM process ([`super::handed`]).
    pub files: super::handed::HostFiles,
}

//! Where a VM's host files come from: opened by path where the VM is built
//! (`k7d run`, a daemon without VM processes), or handed over as open
//! descriptors to a VM process, which has no filesystem of its own
//! (issue 36: an empty root, so a path it opened itself would name
//! nothing). The daemon opens each file with the flags the VM would have
//! used ([`open_input`], `k7d_disk::open_image`, [`open_log`]) and sends
//! them with the build request, each named by its [`FileRole`].

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// What a handed-over file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "file", rename_all = "snake_case", deny_unknown_fields)]
pub enum FileRole {
    /// The Linux kernel as configured (bzImage or ELF).
    Kernel,
    /// The ELF the kernel's LZ4 payload unpacks to, from the daemon's
    /// kernel cache (`arch::x86_64::unpack`).
    UnpackedKernel,
    /// The initramfs.
    Initrd,
    /// A raw real-mode image.
    RawImage,
    /// Disk `index`'s image, opened read-write or read-only as configured.
    Disk {
        /// Its place in the config's disks.
        index: u16,
    },
    /// Read-write disk `index`'s copy-on-write overlay (a fork child's own,
    /// made by the caller; its `Disk` is then the frozen base, read-only).
    DiskOverlay {
        /// Its place in the config's disks.
        index: u16,
    },
    /// The guest's serial log, opened for appending.
    SerialLog,
    /// virtio-rng's entropy source.
    Entropy,
    /// Queue `queue` of NIC `nic`'s tap (made by the daemon, which may).
    TapQueue {
        /// Its place in the config's NICs.
        nic: u16,
        /// The queue (pair) index.
        queue: u16,
    },
    /// `/dev/vhost-net` for queue pair `pair` of NIC `nic` (opened by the
    /// daemon, which may; the VM process takes ownership of it): handed
    /// over only when the daemon planned the NIC on the kernel's data plane.
    VhostNet {
        /// Its place in the config's NICs.
        nic: u16,
        /// The queue pair.
        pair: u16,
    },
    /// The VM process's own log: it becomes its standard error.
    ProcessLog,
    /// vsock's host socket, bound and listening (the daemon binds it at
    /// the configured path, and removes it).
    VsockListener,
}

impl std::fmt::Display for FileRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Kernel => f.write_str("the kernel"),
            Self::UnpackedKernel => f.write_str("the unpacked kernel"),
            Self::Initrd => f.write_str("the initrd"),
            Self::RawImage => f.write_str("the guest image"),
            Self::Disk { index } => write!(f, "disk {index}'s image"),
            Self::DiskOverlay { index } => write!(f, "disk {index}'s overlay"),
            Self::VhostNet { nic, pair } => write!(f, "nic {nic}'s /dev/vhost-net for queue pair {pair}"),
            Self::SerialLog => f.write_str("the serial log"),
            Self::Entropy => f.write_str("the entropy source"),
            Self::TapQueue { nic, queue } => write!(f, "queue {queue} of nic {nic}'s tap"),
            Self::ProcessLog => f.write_str("the VM process's log"),
            Self::VsockListener => f.write_str("vsock's host socket"),
        }
    }
}

/// Files handed over, each taken once by the part of the build that uses it.
#[derive(Debug, Default)]
pub struct HandedFiles {
    files: Mutex<HashMap<FileRole, File>>,
}

impl HandedFiles {
    /// The files `roles` names, in the order of `files`; a role named twice
    /// or a count that differs is refused with a sentence.
    pub fn new(roles: &[FileRole], files: Vec<File>) -> Result<Self, String> {
        if roles.len() != files.len() {
            return Err(format!(
                "{} files are named but {} descriptors came with them",
                roles.len(),
                files.len()
            ));
        }
        let mut map = HashMap::new();
        for (&role, f) in roles.iter().zip(files) {
            if map.insert(role, f).is_some() {
                return Err(format!("{role} is named twice"));
            }
        }
        Ok(Self { files: Mutex::new(map) })
    }

    /// Takes the file for `role`, if it was handed over.
    pub fn take(&self, role: FileRole) -> Option<File> {
        self.files.lock().unwrap_or_else(|p| p.into_inner()).remove(&role)
    }
}

/// Where the VM's files come from (module docs).
#[derive(Debug, Clone, Default)]
pub enum HostFiles {
    /// The VM opens its files by path.
    #[default]
    Paths,
    /// The VM may open nothing: every file was handed over.
    Handed(Arc<HandedFiles>),
}

impl HostFiles {
    /// The handed-over file for `role` (`Ok(None)`: open the path), or why
    /// there is none in a VM that may open nothing.
    pub fn take(&self, role: FileRole) -> Result<Option<File>, String> {
        match self {
            Self::Paths => Ok(None),
            Self::Handed(h) => h
                .take(role)
                .map(Some)
                .ok_or_else(|| format!("{role} was not handed to this VM process")),
        }
    }

    /// Whether `role` was handed over (and not taken yet).
    pub fn has(&self, role: FileRole) -> bool {
        match self {
            Self::Paths => false,
            Self::Handed(h) => h.files.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&role),
        }
    }

    /// Whether files arrive handed over.
    pub fn handed(&self) -> bool {
        matches!(self, Self::Handed(_))
    }
}

/// Why a NIC in a VM process has no kernel vhost-net data plane: its
/// daemon handed it no `/dev/vhost-net` (it planned the NIC in userspace,
/// and said why in its own log).
pub const NO_VHOST_HANDED: &str = "its daemon handed it no /dev/vhost-net: the NIC runs in userspace";

/// Opens a guest input file (kernel, initrd, raw image) read-only as the
/// VM would: `O_NONBLOCK` so that a FIFO put in its place does not wait
/// for a writer (the caller refuses anything but a regular file).
pub fn open_input(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

/// Opens (creating) a serial log for appending.
pub fn open_log(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new().create(true).append(true).open(path)
}

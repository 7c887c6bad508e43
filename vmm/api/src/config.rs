//! VM configuration as users write it (API JSON, CLI flags), and its validation.
//!
//! Every refusal is one sentence that names the field and the reason; nothing
//! is created before a config validates.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Most vCPUs a VM may have (x2APIC ids fit a byte in the test guests' CPUID).
pub const MAX_VCPUS: u8 = 254;
/// Largest guest RAM accepted, whatever the host has (1 TiB).
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Largest raw real-mode image (it must fit between the load address and 0x9f000).
pub const MAX_RAW_IMAGE: u64 = 0x9_f000 - k7d_guest::LOAD_ADDR;

/// What runs in the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum GuestSpec {
    /// One of the test guests assembled into k7d (`hello`, `pit`, ...).
    Builtin {
        /// Program name.
        name: String,
        /// Up to three u32 arguments written to the guest's parameter block.
        #[serde(default)]
        args: Vec<u32>,
    },
    /// A Linux kernel (bzImage or ELF vmlinux), booted through the 64-bit
    /// boot protocol with ACPI tables.
    Linux {
        /// The kernel image.
        kernel: PathBuf,
        /// An initramfs.
        #[serde(default)]
        initrd: Option<PathBuf>,
        /// The kernel command line (k7d's default when absent).
        #[serde(default)]
        cmdline: Option<String>,
    },
    /// A flat real-mode binary loaded at 0x8000 and entered with `cs = 0`.
    Raw {
        /// Path to the image.
        path: PathBuf,
        /// Up to three u32 arguments written to the guest's parameter block.
        #[serde(default)]
        args: Vec<u32>,
    },
}

impl GuestSpec {
    /// The arguments of either kind.
    pub fn args(&self) -> &[u32] {
        match self {
            Self::Builtin { args, .. } | Self::Raw { args, .. } => args,
            Self::Linux { .. } => &[],
        }
    }

    /// A short description for listings.
    pub fn describe(&self) -> String {
        match self {
            Self::Builtin { name, .. } => format!("builtin:{name}"),
            Self::Raw { path, .. } => format!("raw:{}", path.display()),
            Self::Linux { kernel, .. } => format!("linux:{}", kernel.display()),
        }
    }
}

impl Default for GuestSpec {
    fn default() -> Self {
        Self::Builtin {
            name: "hello".into(),
            args: Vec::new(),
        }
    }
}

/// Serial console settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialConfig {
    /// Also copy guest output to the VMM's stdout (only sensible for `k7d run`).
    #[serde(default)]
    pub console: bool,
}

/// A virtio-blk disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// Raw image (or erofs image when read-only); none: an empty drive, a
    /// slot that takes a read-only image later (`change_medium`), as a
    /// drive without a disc.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Open the image read-only; guest writes fail in the guest. An empty
    /// drive is read-only.
    #[serde(default)]
    pub read_only: bool,
}

impl DiskConfig {
    /// A read-only drive with no medium.
    pub fn empty() -> Self {
        Self {
            path: None,
            read_only: true,
        }
    }
}

/// A virtio-net NIC backed by a tap.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicConfig {
    /// Tap name (default: derived from the VM id and NIC index).
    #[serde(default)]
    pub tap: Option<String>,
    /// Queue pairs (default: the node policy's).
    #[serde(default)]
    pub queues: Option<u16>,
    /// Kernel vhost-net (default: the node's `vhost_default`).
    #[serde(default)]
    pub vhost: Option<bool>,
    /// Guest MAC `aa:bb:cc:dd:ee:ff` (default: derived from the VM id).
    #[serde(default)]
    pub mac: Option<String>,
    /// Attach the tap to a pod's network through k7d's datapath (tc-eBPF
    /// direct, bridge chain, or auto) instead of leaving a bare tap.
    #[serde(default)]
    pub datapath: Option<DatapathNicConfig>,
}

/// How a NIC reaches its pod (`docs/datapath.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatapathNicConfig {
    /// `direct`, `bridge` or `auto`.
    pub mode: String,
    /// The pod's network namespace (e.g. `/run/netns/pod`); the tap is created there.
    pub netns: PathBuf,
    /// The pod's interface (the CNI veth inside `netns`, e.g. `eth0`).
    pub pod_if: String,
    /// The pod UID (policy identity).
    #[serde(default)]
    pub pod_uid: Option<String>,
    /// The pod's Kubernetes namespace (the metrics' `k7d_vm_pod_info`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// The pod's name (the metrics' `k7d_vm_pod_info`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
}

/// The longest pod name Kubernetes allows (a DNS-1123 subdomain).
const MAX_POD_NAME: usize = 253;
/// The longest namespace Kubernetes allows (a DNS-1123 label).
const MAX_POD_NAMESPACE: usize = 63;

/// A Kubernetes namespace name: a DNS-1123 label.
pub fn valid_pod_namespace(s: &str) -> bool {
    dns_1123(s, MAX_POD_NAMESPACE, false)
}

/// A Kubernetes pod name: a DNS-1123 subdomain.
pub fn valid_pod_name(s: &str) -> bool {
    dns_1123(s, MAX_POD_NAME, true)
}

/// A client's name as an error shows it: escaped, and cut at 64
/// characters (`…` after).
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(64).flat_map(char::escape_debug).collect();
    if s.chars().nth(64).is_some() {
        out.push('…');
    }
    out
}

/// `s` is a DNS-1123 name of at most `max` bytes: lower-case letters,
/// digits, `-` (and `.` where `dots`), starting and ending alphanumeric.
fn dns_1123(s: &str, max: usize, dots: bool) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !s.is_empty()
        && s.len() <= max
        && edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || (dots && c == '.'))
}

impl DatapathNicConfig {
    /// Checks what a create's config, a fork child's attachment, a
    /// `nic_attach` and a record reconciled at start share: the mode is one
    /// the datapath knows, and the pod netns is an absolute path (a relative
    /// one would be opened against the daemon's working directory).
    pub fn check(&self) -> Result<(), String> {
        self.mode
            .parse::<k7d_net::Mode>()
            .map_err(|_| format!("datapath mode `{}` is unknown (use direct, bridge or auto)", self.mode))?;
        if !self.netns.is_absolute() {
            return Err(format!(
                "the pod network namespace {} is not an absolute path",
                self.netns.display()
            ));
        }
        if let Some(ns) = &self.pod_namespace
            && !valid_pod_namespace(ns)
        {
            return Err(format!(
                "the pod namespace `{}` is not a Kubernetes namespace name (lower-case letters, digits and -, at most {MAX_POD_NAMESPACE})",
                shown(ns)
            ));
        }
        if let Some(name) = &self.pod_name
            && !valid_pod_name(name)
        {
            return Err(format!(
                "the pod name `{}` is not a Kubernetes pod name (lower-case letters, digits, - and ., at most {MAX_POD_NAME})",
                shown(name)
            ));
        }
        Ok(())
    }
}

/// A virtio-vsock device with the hybrid (unix socket) host side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// Guest context id (3..2^32-1).
    pub cid: u64,
    /// Host unix socket; host-initiated connections send `CONNECT <port>\n`.
    pub uds: PathBuf,
}

/// Optional devices (PCI: Linux guests only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesConfig {
    /// A virtio-rng device.
    #[serde(default)]
    pub rng: bool,
    /// virtio-blk disks, in order (/dev/vda, /dev/vdb, ...).
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// virtio-net NICs.
    #[serde(default)]
    pub nics: Vec<NicConfig>,
    /// A virtio-vsock device.
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// The VM Generation ID (`arch/x86_64/vmgenid.rs`): a fresh ID in every
    /// fork child and restored VM, from which a guest kernel with the driver
    /// reseeds its RNG. Unset: on for Linux guests, off for the real-mode
    /// test guests (which have no ACPI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmgenid: Option<bool>,
}

impl VmConfig {
    /// Whether this VM has the VM Generation ID ([`DevicesConfig::vmgenid`]).
    pub fn vmgenid(&self) -> bool {
        self.devices
            .vmgenid
            .unwrap_or(matches!(self.guest, GuestSpec::Linux { .. }))
    }
}

impl DevicesConfig {
    /// Whether any PCI device is asked for.
    pub fn any(&self) -> bool {
        self.rng || !self.disks.is_empty() || !self.nics.is_empty() || self.vsock.is_some()
    }
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return None;
        }
        *m = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
}

fn default_vcpus() -> u8 {
    1
}

fn default_memory() -> u64 {
    64
}

/// A VM as requested.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// VM id; generated when absent. `[A-Za-z0-9][A-Za-z0-9_.-]{0,62}`, no `..`.
    #[serde(default)]
    pub id: Option<String>,
    /// Number of vCPUs (1..=254).
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest RAM in MiB (1..=host RAM).
    #[serde(default = "default_memory")]
    pub memory_mib: u64,
    /// What to run.
    #[serde(default)]
    pub guest: GuestSpec,
    /// Serial console.
    #[serde(default)]
    pub serial: SerialConfig,
    /// Optional devices.
    #[serde(default)]
    pub devices: DevicesConfig,
    /// What this VM's live fork children may hold (unset: no limit beyond
    /// the daemon's per-request cap). Children inherit it.
    #[serde(default, skip_serializing_if = "ForkBudget::is_unset")]
    pub fork: ForkBudget,
}

/// A fork source's budget (`docs/fork.md`, "The snapshot tree"): how many
/// live children it may have, and how much guest RAM they may commit
/// together. A copy-on-write child can come to own every page of its RAM,
/// so each counts its whole `memory_mib`. A fork that would pass either is
/// refused with a sentence, before anything is paused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkBudget {
    /// Live children at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_children: Option<u32>,
    /// The guest RAM of all live children together, in MiB, at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_children_memory_mib: Option<u64>,
    /// What the copy-on-write disk overlays of all live children may hold
    /// together, in MiB: a fork whose copy would pass it is refused, and a
    /// child's write past it fails with an I/O error in the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_children_disk_mib: Option<u64>,
    /// Re-base this VM (a new base holding its RAM as it is, built while
    /// it runs) once it has been forked and has diverged from its base by
    /// this percentage of its RAM (1 to 100): its forks then copy at most
    /// about that much (`docs/fork.md`, "Re-basing"). Unset: never on its
    /// own (`k7d rebase` does it on request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebase_at_percent: Option<u32>,
    /// Keep this many VM shells (KVM VM, memslots, irqchip, vCPUs and
    /// their threads, made ahead; 1 to [`MAX_SHELLS`], at most
    /// [`MAX_SHELL_VCPUS`] vCPUs in all) ready for this VM's fork children:
    /// the daemon makes them in the background (on Linux 6.7 or later), and
    /// a fork builds its children in them (`docs/fork.md`, "Shells made
    /// ahead"). Not inherited by the children.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shells: Option<u32>,
}

/// The most shells one VM may ask to keep ready (`fork.shells`).
pub const MAX_SHELLS: u32 = 64;

/// The most vCPUs the shells one VM asks for may hold together
/// (`fork.shells` × `vcpus`): each is a vCPU fd and a parked thread.
pub const MAX_SHELL_VCPUS: u32 = 256;

impl ForkBudget {
    /// No limit set.
    pub fn is_unset(&self) -> bool {
        *self == Self::default()
    }

    /// Why `more` children of `memory_mib` each cannot join `live` live
    /// ones of source `id`, if they cannot.
    /// `disk_used`: bytes the live children's disk overlays hold now.
    pub fn refusal(&self, id: &str, live: u32, more: u32, memory_mib: u64, disk_used: u64) -> Option<String> {
        let total = u64::from(live) + u64::from(more);
        if let Some(max) = self.max_children
            && total > u64::from(max)
        {
            return Some(format!(
                "vm {id} has {live} live fork children and its budget allows {max}: {more} more {} refused",
                if more == 1 { "is" } else { "are" }
            ));
        }
        if let Some(cap) = self.max_children_disk_mib
            && disk_used >= cap << 20
        {
            return Some(format!(
                "vm {id}'s fork children hold {:.1} MiB of copy-on-write disk and its budget allows {cap} MiB: {more} more {} refused",
                disk_used as f64 / (1u64 << 20) as f64,
                if more == 1 { "is" } else { "are" }
            ));
        }
        if let Some(cap) = self.max_children_memory_mib {
            let need = total.saturating_mul(memory_mib);
            if need > cap {
                return Some(format!(
                    "vm {id}'s {total} fork children would commit {need} MiB of guest RAM and its budget allows {cap} MiB: {more} more {} refused",
                    if more == 1 { "is" } else { "are" }
                ));
            }
        }
        None
    }
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            id: None,
            vcpus: default_vcpus(),
            memory_mib: default_memory(),
            guest: GuestSpec::default(),
            serial: SerialConfig::default(),
            devices: DevicesConfig::default(),
            fork: ForkBudget::default(),
        }
    }
}

/// Whether `path` can be a disk: a regular file or a block device.
pub fn check_disk_path(path: &Path) -> Result<(), ConfigError> {
    let md = std::fs::metadata(path).map_err(|e| ConfigError::Disk {
        path: path.to_path_buf(),
        reason: e.to_string().to_lowercase(),
    })?;
    if !md.is_file() && !md.file_type().is_block_device_like() {
        return Err(ConfigError::Disk {
            path: path.to_path_buf(),
            reason: "a disk must be a regular file".into(),
        });
    }
    Ok(())
}

/// `FileType::is_block_device` without importing the unix extension everywhere.
trait BlockDeviceLike {
    fn is_block_device_like(&self) -> bool;
}

impl BlockDeviceLike for std::fs::FileType {
    fn is_block_device_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_block_device()
    }
}

/// Node-wide settings (`--node-config FILE`, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Most queue pairs a NIC may have (1..=64).
    #[serde(default = "default_max_net_queues")]
    pub max_net_queues: u16,
    /// NICs that do not say get kernel vhost-net (opt-in: default false).
    #[serde(default)]
    pub vhost_default: bool,
    /// The tc-eBPF object the direct datapath loads (an absolute path);
    /// default: the one built into k7d. One that cannot be loaded makes
    /// `auto` NICs fall back to the bridge chain with the reason.
    #[serde(default)]
    pub tc_object: Option<PathBuf>,
}

fn default_max_net_queues() -> u16 {
    k7d_net::policy::DEFAULT_MAX_NET_QUEUES
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            max_net_queues: default_max_net_queues(),
            vhost_default: false,
            tc_object: None,
        }
    }
}

impl NodeConfig {
    /// Loads and validates a node config file.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the node config {}: {e}", path.display()))?;
        let c: NodeConfig =
            serde_json::from_str(&text).map_err(|e| format!("the node config {} is invalid: {e}", path.display()))?;
        c.net()
            .map_err(|e| format!("the node config {} is invalid: {e}", path.display()))?;
        if let Some(o) = &c.tc_object
            && !o.is_absolute()
        {
            return Err(format!(
                "the node config {} is invalid: tc_object must be an absolute path, not {}",
                path.display(),
                o.display()
            ));
        }
        Ok(c)
    }

    /// The networking part, validated.
    pub fn net(&self) -> Result<k7d_net::policy::NodeNetConfig, k7d_net::policy::PolicyError> {
        k7d_net::policy::NodeNetConfig::new(self.vhost_default, self.max_net_queues)
    }

    /// The datapath's settings: where its tc object comes from.
    pub fn datapath(&self) -> k7d_net::DatapathConfig {
        k7d_net::DatapathConfig {
            object: self
                .tc_object
                .clone()
                .map_or(k7d_net::ObjectSource::Embedded, k7d_net::ObjectSource::File),
            ..Default::default()
        }
    }
}

/// Why a config was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Bad id.
    #[error(
        "vm id `{0}` is invalid: use 1-63 letters, digits, `_`, `.` or `-`, starting with a letter or digit and without `..`"
    )]
    BadId(String),
    /// vcpus out of range.
    #[error("vcpus = {0} is out of range: a VM needs 1 to {MAX_VCPUS} vCPUs")]
    Vcpus(u64),
    /// memory out of range.
    #[error("memory_mib = {got} is out of range: use 1 to {max} MiB (this host has {host} MiB)")]
    Memory {
        /// Requested.
        got: u64,
        /// Accepted maximum.
        max: u64,
        /// Host RAM.
        host: u64,
    },
    /// Unknown builtin or bad args.
    #[error("guest: {0}")]
    Guest(String),
    /// A fork setting is out of range.
    #[error("{0}")]
    Fork(String),
    /// A disk image is unusable.
    #[error("disk {path} cannot be used: {reason}")]
    Disk {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Raw image path unusable.
    #[error("guest image {path} cannot be used: {reason}")]
    Image {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Checks a VM id against the naming rule (ids become file names).
pub fn validate_id(id: &str) -> Result<(), ConfigError> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
        && !id.contains("..");
    if ok {
        Ok(())
    } else {
        Err(ConfigError::BadId(id.to_string()))
    }
}

/// What a config is validated for (see [`VmConfig::validate_restored`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A new VM: its guest is loaded from the image files.
    Create,
    /// A restored VM: its RAM and saved state already hold the guest and its
    /// devices.
    Restore,
    /// A new VM in a VM process: its files arrive open (`vstate::handed`),
    /// checked by the daemon that opened them; no path is looked at.
    Handed,
}

impl VmConfig {
    /// Validates everything that can be checked before any resource exists.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check(Purpose::Create)
    }

    /// Validates the config of a snapshot being restored, through the same
    /// checks as [`VmConfig::validate`] (id, vCPU and memory limits, disks,
    /// NICs, vsock, guest name, vCPUs and arguments) but two that are about
    /// loading a new guest: the guest's image files (kernel, initrd, raw
    /// image) are not looked at, because the restored RAM already holds the
    /// guest and restore never opens them; and virtio devices on a real-mode
    /// test guest are not refused, because the saved state already holds
    /// them (host tests play their drivers; restore checks that the saved
    /// devices match the config's).
    pub fn validate_restored(&self) -> Result<(), ConfigError> {
        self.check(Purpose::Restore)
    }

    /// Validates the config of a VM built in a VM process, whose files the
    /// daemon opened and handed over: [`VmConfig::validate`] without looking
    /// at any path (the process has no filesystem).
    pub fn validate_handed(&self) -> Result<(), ConfigError> {
        self.check(Purpose::Handed)
    }

    fn check(&self, purpose: Purpose) -> Result<(), ConfigError> {
        if let Some(id) = &self.id {
            validate_id(id)?;
        }
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ConfigError::Vcpus(self.vcpus.into()));
        }
        let host = host_ram_bytes() >> 20;
        let max = host.min(MAX_MEMORY_MIB);
        if self.memory_mib == 0 || self.memory_mib > max {
            return Err(ConfigError::Memory {
                got: self.memory_mib,
                max,
                host,
            });
        }
        if let Some(p) = self.fork.rebase_at_percent
            && !(1..=100).contains(&p)
        {
            return Err(ConfigError::Fork(format!(
                "rebase_at_percent = {p} is out of range: use 1 to 100 (percent of the VM's RAM)"
            )));
        }
        if let Some(n) = self.fork.shells
            && !(1..=MAX_SHELLS).contains(&n)
        {
            return Err(ConfigError::Fork(format!(
                "shells = {n} is out of range: use 1 to {MAX_SHELLS} (shells kept ready for this VM's fork children)"
            )));
        }
        if let Some(n) = self.fork.shells
            && n * u32::from(self.vcpus) > MAX_SHELL_VCPUS
        {
            return Err(ConfigError::Fork(format!(
                "shells = {n} of {} vCPUs each would hold {} vCPUs, more than {MAX_SHELL_VCPUS}: ask for fewer shells",
                self.vcpus,
                n * u32::from(self.vcpus)
            )));
        }
        if purpose != Purpose::Restore && self.devices.any() && !matches!(self.guest, GuestSpec::Linux { .. }) {
            return Err(ConfigError::Guest(
                "virtio devices need a Linux guest (the real-mode test guests have no PCI bus)".into(),
            ));
        }
        for (i, d) in self.devices.disks.iter().enumerate() {
            match &d.path {
                Some(_) if purpose == Purpose::Handed => {}
                Some(p) => check_disk_path(p)?,
                None if !d.read_only => {
                    return Err(ConfigError::Guest(format!(
                        "disk {i} has no image, and an empty drive is read-only: set read_only"
                    )));
                }
                None => {}
            }
        }
        for (i, n) in self.devices.nics.iter().enumerate() {
            if let Some(d) = &n.datapath {
                d.check().map_err(|e| ConfigError::Guest(format!("nic {i}: {e}")))?;
            }
            if let Some(m) = &n.mac
                && parse_mac(m).is_none()
            {
                return Err(ConfigError::Guest(format!(
                    "nic {i}: mac `{m}` is not of the form aa:bb:cc:dd:ee:ff"
                )));
            }
            if let Some(t) = &n.tap
                && (t.is_empty() || t.len() > 15 || t.contains('/') || t.contains(char::is_whitespace))
            {
                return Err(ConfigError::Guest(format!(
                    "nic {i}: tap name `{t}` is invalid: use 1 to 15 characters without `/` or spaces"
                )));
            }
        }
        if let Some(v) = &self.devices.vsock
            && !(3..u64::from(u32::MAX)).contains(&v.cid)
        {
            return Err(ConfigError::Guest(format!(
                "vsock cid {} is out of range: use 3 to 4294967294",
                v.cid
            )));
        }
        if self.guest.args().len() > k7d_guest::MAX_ARGS {
            return Err(ConfigError::Guest(format!(
                "{} arguments given, a guest takes at most {}",
                self.guest.args().len(),
                k7d_guest::MAX_ARGS
            )));
        }
        match &self.guest {
            GuestSpec::Builtin { name, .. } => {
                let b = k7d_guest::Builtin::from_name(name).map_err(|e| ConfigError::Guest(e.to_string()))?;
                if self.vcpus < b.min_vcpus() {
                    return Err(ConfigError::Guest(format!(
                        "the `{name}` guest needs at least {} vCPUs, {} given",
                        b.min_vcpus(),
                        self.vcpus
                    )));
                }
            }
            GuestSpec::Linux { .. } | GuestSpec::Raw { .. } if purpose != Purpose::Create => {}
            GuestSpec::Linux { kernel, initrd, .. } => {
                for p in std::iter::once(kernel).chain(initrd) {
                    let md = std::fs::metadata(p).map_err(|e| ConfigError::Image {
                        path: p.clone(),
                        reason: e.to_string().to_lowercase(),
                    })?;
                    if !md.is_file() || md.len() == 0 {
                        return Err(ConfigError::Image {
                            path: p.clone(),
                            reason: "it is not a non-empty regular file".into(),
                        });
                    }
                }
            }
            GuestSpec::Raw { path, .. } => {
                let img = |reason: String| ConfigError::Image {
                    path: path.clone(),
                    reason,
                };
                let md = std::fs::metadata(path).map_err(|e| img(e.to_string().to_lowercase()))?;
                if !md.is_file() {
                    return Err(img("it is not a regular file".into()));
                }
                if md.len() == 0 || md.len() > MAX_RAW_IMAGE {
                    return Err(img(format!(
                        "its size is {} bytes, a real-mode image must be 1 to {MAX_RAW_IMAGE} bytes",
                        md.len()
                    )));
                }
            }
        }
        Ok(())
    }

    /// RAM in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib << 20
    }
}

/// The host's RAM (`MemTotal` of `/proc/meminfo`) in bytes; `u64::MAX`
/// where it cannot be read (a VM process has no `/proc`), so that the
/// daemon's own check is the one that counts.
fn host_ram_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_config_names_the_tc_object_by_an_absolute_path() {
        let dir = std::env::temp_dir().join(format!("k7d-node-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("node.json");
        std::fs::write(&p, r#"{"tc_object": "/usr/lib/k7d/k7d_tc.o"}"#).unwrap();
        let c = NodeConfig::load(&p).unwrap();
        assert_eq!(
            c.datapath().object,
            k7d_net::ObjectSource::File("/usr/lib/k7d/k7d_tc.o".into())
        );
        assert_eq!(NodeConfig::default().datapath().object, k7d_net::ObjectSource::Embedded);
        std::fs::write(&p, r#"{"tc_object": "k7d_tc.o"}"#).unwrap();
        let e = NodeConfig::load(&p).unwrap_err();
        assert!(e.ends_with("tc_object must be an absolute path, not k7d_tc.o"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_full_children_disk_budget_refuses_a_fork_in_one_sentence() {
        let b = ForkBudget {
            max_children_disk_mib: Some(2),
            ..Default::default()
        };
        assert_eq!(
            b.refusal("db", 3, 1, 64, (2 << 20) - 4096),
            None,
            "under the cap: allowed"
        );
        assert_eq!(
            b.refusal("db", 3, 2, 64, 3 << 20).as_deref(),
            Some(
                "vm db's fork children hold 3.0 MiB of copy-on-write disk and its budget allows 2 MiB: 2 more are refused"
            )
        );
        assert_eq!(ForkBudget::default().refusal("db", 3, 1, 64, u64::MAX), None, "no cap");
    }

    #[test]
    fn ids() {
        for ok in ["a", "vm-1", "A.b_c", "0"] {
            validate_id(ok).unwrap();
        }
        for bad in ["", "../x", "a/b", "a..b", ".hidden", "-x", &"x".repeat(64), "sp ace"] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits() {
        let mut c = VmConfig::default();
        c.validate().unwrap();
        c.vcpus = 0;
        assert_eq!(c.validate(), Err(ConfigError::Vcpus(0)));
        c.vcpus = 1;
        c.memory_mib = 0;
        assert!(matches!(c.validate(), Err(ConfigError::Memory { got: 0, .. })));
        c.memory_mib = u64::MAX >> 20;
        assert!(matches!(c.validate(), Err(ConfigError::Memory { .. })));
    }

    #[test]
    fn pod_names_and_namespaces_must_be_kubernetes_names() {
        for ok in ["default", "k7d-lab", "a", "kube-system", &"a".repeat(63)] {
            assert!(valid_pod_namespace(ok), "{ok}");
        }
        for bad in ["", "Default", "-a", "a-", "a.b", "a_b", "a b", "a\n", &"a".repeat(64)] {
            assert!(!valid_pod_namespace(bad), "{bad:?}");
        }
        for ok in ["web-0", "net-k7d-server", "a.b-c.d", &"a".repeat(253)] {
            assert!(valid_pod_name(ok), "{ok}");
        }
        for bad in ["", "Web", ".a", "a.", "a/b", "a\"b", "a}", &"a".repeat(254)] {
            assert!(!valid_pod_name(bad), "{bad:?}");
        }
        let d = DatapathNicConfig {
            mode: "direct".into(),
            netns: "/run/netns/p".into(),
            pod_if: "eth0".into(),
            pod_uid: None,
            pod_namespace: Some("k7d-lab".into()),
            pod_name: Some("web\"} 1\nk7d_vms 9".into()),
        };
        assert_eq!(
            d.check(),
            Err("the pod name `web\\\"} 1\\nk7d_vms 9` is not a Kubernetes pod name (lower-case letters, digits, - and ., at most 253)".into())
        );
        let d = DatapathNicConfig {
            pod_namespace: Some("Kube".into()),
            pod_name: None,
            ..d
        };
        assert!(d.check().unwrap_err().starts_with("the pod namespace `Kube` is not"));
        // A long one is cut in the sentence.
        let d = DatapathNicConfig {
            pod_namespace: Some("X".repeat(100_000)),
            ..d
        };
        let e = d.check().unwrap_err();
        assert!(e.len() < 300 && e.contains(&format!("`{}…`", "X".repeat(64))), "{e}");
    }

    #[test]
    fn a_pod_netns_must_be_an_absolute_path_wherever_a_nic_names_one() {
        let d = |netns: &str| DatapathNicConfig {
            mode: "direct".into(),
            netns: netns.into(),
            pod_if: "eth0".into(),
            pod_uid: None,
            pod_namespace: None,
            pod_name: None,
        };
        assert_eq!(d("/run/netns/p").check(), Ok(()));
        assert_eq!(
            d("run/netns/p").check(),
            Err("the pod network namespace run/netns/p is not an absolute path".into())
        );
        // A create's config (the daemon's working directory is no pod netns).
        let c = VmConfig {
            guest: GuestSpec::Linux {
                kernel: "/k".into(),
                initrd: None,
                cmdline: None,
            },
            devices: DevicesConfig {
                nics: vec![NicConfig {
                    datapath: Some(d("netns/p")),
                    ..Default::default()
                }],
                ..Default::default()
            },
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("nic 0: the pod network namespace netns/p is not an absolute path"),
            "{e}"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<VmConfig>(r#"{"vcpus":1,"colour":"red"}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `colour`"), "{e}");
        let e = serde_json::from_str::<VmConfig>(r#"{"guest":{"kind":"builtin","name":"hello","x":1}}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `x`"), "{e}");
    }

    #[test]
    fn smp_needs_two_vcpus() {
        let c = VmConfig {
            guest: GuestSpec::Builtin {
                name: "smp".into(),
                args: vec![],
            },
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("at least 2 vCPUs"));
    }
}

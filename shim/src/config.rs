//! `/etc/k7d/shim.toml` (or `$K7D_SHIM_CONFIG`) and the per-pod
//! annotations that override it (`io.k7d.vcpus`, `io.k7d.memory_mib`,
//! `io.k7d.pod-start`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;

/// Where the config is read from unless `$K7D_SHIM_CONFIG` says otherwise.
pub const DEFAULT_PATH: &str = "/etc/k7d/shim.toml";
/// The kernel command line a pod VM gets unless the config says otherwise:
/// the console on k7d's serial, only warnings on it, a panic stops the VM,
/// and no boot-time crypto self-tests or IO-APIC timer check (the two cost
/// about a second of an emulated boot; `docs/linux-boot.md`, "The command
/// line").
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check";

/// Empty drives per CRI pod VM unless the config says otherwise.
pub const DEFAULT_POD_DRIVES: u8 = 6;
/// The most empty drives a pod VM may have (each is a PCI function).
pub const MAX_POD_DRIVES: u8 = 16;

/// The shim's settings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShimConfig {
    /// The guest kernel (the stock Debian cloud kernel).
    pub kernel: PathBuf,
    /// The initramfs with the agent (`guest/agent/mkinitramfs.sh`).
    pub initramfs: PathBuf,
    /// The daemon's API socket.
    #[serde(default = "default_socket")]
    pub daemon_socket: PathBuf,
    /// vCPUs per pod VM.
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest RAM per pod VM, MiB.
    #[serde(default = "default_memory")]
    pub memory_mib: u64,
    /// The pod VM's kernel command line.
    #[serde(default = "default_cmdline")]
    pub cmdline: String,
    /// Where per-pod sockets live.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Where packed images (erofs) are cached.
    #[serde(default = "default_image_dir")]
    pub image_dir: PathBuf,
    /// The most a container's host bind mounts may hold, MiB: their
    /// content is copied into a disk for the pod VM (`crate::binds`).
    #[serde(default = "default_bind_max")]
    pub bind_max_mib: u64,
    /// Empty drives a CRI pod VM boots with, for the images of its app
    /// containers (one each, two with host bind mounts); a drive is freed
    /// when its container is deleted.
    #[serde(default = "default_pod_drives")]
    pub pod_drives: u8,
    /// How a pod VM's NIC reaches the pod's network: `direct` (tc-eBPF),
    /// `bridge`, or `auto` (direct, else the bridge with its reason).
    #[serde(default = "default_datapath")]
    pub datapath: String,
    /// How a CRI pod's VM starts: `cold` (boots its kernel), `fork`
    /// (forked from the node's paused template of its shape, booted once;
    /// `crate::template`) or `pool` (claims a booted, paused member of the
    /// node's warm pool; `crate::pool`). A pod's `io.k7d.pod-start`
    /// annotation overrides.
    #[serde(default = "default_pod_start")]
    pub pod_start: String,
    /// Booted, paused VMs the warm pool keeps for `pool` pods (0 to 16): a
    /// claim takes one and the claiming shim boots its replacement.
    #[serde(default = "default_pool_size")]
    pub pool_size: u8,
    /// Seconds a pool pod's shim waits after the pod's create before it
    /// boots the pool full again (0 to 3600; 0: at once), so a burst of
    /// pod starts does not share the node's CPUs with the refill.
    #[serde(default)]
    pub pool_refill_delay_s: u64,
    /// How long a pod VM (or a fork template) may take to boot until its
    /// agent answers, seconds (5 to 3600).
    #[serde(default = "default_boot_timeout")]
    pub boot_timeout_s: u64,
    /// The file this config was read from (set by [`ShimConfig::read`]).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// The pod annotation that chooses `cold` or `fork` for one pod.
pub const POD_START_ANNOTATION: &str = "io.k7d.pod-start";

fn default_socket() -> PathBuf {
    "/run/k7d/k7d.sock".into()
}
fn default_vcpus() -> u8 {
    1
}
fn default_memory() -> u64 {
    256
}
fn default_cmdline() -> String {
    DEFAULT_CMDLINE.into()
}
fn default_state_dir() -> PathBuf {
    "/run/k7d/shim".into()
}
fn default_bind_max() -> u64 {
    256
}
fn default_datapath() -> String {
    "auto".into()
}
fn default_boot_timeout() -> u64 {
    60
}
fn default_pool_size() -> u8 {
    2
}
/// The most members a warm pool may keep.
pub const MAX_POOL_SIZE: u8 = 16;
fn default_pod_start() -> String {
    "cold".into()
}
fn default_pod_drives() -> u8 {
    DEFAULT_POD_DRIVES
}
fn default_image_dir() -> PathBuf {
    "/var/lib/k7d/images".into()
}

/// The largest shim config read (a real one is well under 4 KiB).
const MAX_CONFIG_BYTES: u64 = 64 << 10;

impl ShimConfig {
    /// The config at `$K7D_SHIM_CONFIG`, else [`DEFAULT_PATH`].
    pub fn load() -> anyhow::Result<Self> {
        let path = std::env::var_os("K7D_SHIM_CONFIG").map_or_else(|| PathBuf::from(DEFAULT_PATH), PathBuf::from);
        Self::read(&path)
    }

    /// The config in `path`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        // A regular file of a sane size: a runtime class's ConfigPath names
        // it, and a FIFO or a device there must not hang or flood the shim.
        let bytes = k7d_sys::file::read_regular_file(path, MAX_CONFIG_BYTES)
            .with_context(|| format!("cannot read the shim config {}", path.display()))?;
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            bail!("the shim config {} is over {MAX_CONFIG_BYTES} bytes", path.display());
        }
        let text = String::from_utf8(bytes)
            .map_err(|_| anyhow::anyhow!("the shim config {} is not UTF-8 text", path.display()))?;
        let mut cfg: Self =
            toml::from_str(&text).with_context(|| format!("the shim config {} is not valid", path.display()))?;
        cfg.source = Some(path.to_path_buf());
        cfg.check()
            .with_context(|| format!("the shim config {} is not valid", path.display()))?;
        Ok(cfg)
    }

    /// A runtime class's config at `path` (containerd's `ConfigPath`). Its
    /// `state_dir` and `daemon_socket` must be the node's (the config
    /// [`ShimConfig::load`] finds, or the defaults): containerd's stateless
    /// `delete` knows no runtime class and finds pods through those.
    pub fn for_runtime_class(path: &Path) -> anyhow::Result<Self> {
        let cfg = Self::read(path)?;
        let (state_dir, socket) = match Self::load() {
            Ok(n) => (n.state_dir, n.daemon_socket),
            Err(_) => (default_state_dir(), default_socket()),
        };
        if cfg.state_dir != state_dir || cfg.daemon_socket != socket {
            bail!(
                "the runtime class's shim config {} must keep the node's state_dir ({}) and daemon_socket ({}): the stateless delete finds pods through them",
                path.display(),
                state_dir.display(),
                socket.display()
            );
        }
        Ok(cfg)
    }

    fn check(&self) -> anyhow::Result<()> {
        for (what, p) in [
            ("kernel", &self.kernel),
            ("initramfs", &self.initramfs),
            ("daemon_socket", &self.daemon_socket),
            ("state_dir", &self.state_dir),
            ("image_dir", &self.image_dir),
        ] {
            if !p.is_absolute() {
                bail!("{what} must be an absolute path, not {}", p.display());
            }
        }
        if !matches!(self.datapath.as_str(), "direct" | "bridge" | "auto") {
            bail!("datapath = {:?} is not direct, bridge or auto", self.datapath);
        }
        check_pod_start(&self.pod_start)?;
        if self.pool_refill_delay_s > 3600 {
            bail!(
                "pool_refill_delay_s = {} is more than 3600 seconds",
                self.pool_refill_delay_s
            );
        }
        if self.pool_size > MAX_POOL_SIZE {
            bail!(
                "pool_size = {} is more than a warm pool may keep ({MAX_POOL_SIZE})",
                self.pool_size
            );
        }
        k7d_agent::proto::runc_timeout(&self.cmdline).map_err(|e| anyhow::anyhow!("cmdline: {e}"))?;
        if !(5..=3600).contains(&self.boot_timeout_s) {
            bail!("boot_timeout_s = {} is not 5 to 3600 seconds", self.boot_timeout_s);
        }
        if self.pod_drives > MAX_POD_DRIVES {
            bail!(
                "pod_drives = {} is more than a pod VM may have ({MAX_POD_DRIVES})",
                self.pod_drives
            );
        }
        check_shape(self.vcpus, self.memory_mib)
    }

    /// This pod's vCPUs and memory: the config's, overridden by the
    /// sandbox's `io.k7d.vcpus` / `io.k7d.memory_mib` annotations.
    pub fn shape_for(&self, annotations: &HashMap<String, String>) -> anyhow::Result<(u8, u64)> {
        let mut vcpus = self.vcpus;
        let mut memory = self.memory_mib;
        if let Some(v) = annotations.get("io.k7d.vcpus") {
            vcpus = v
                .parse()
                .with_context(|| format!("the annotation io.k7d.vcpus={v:?} is not a number of vCPUs"))?;
        }
        if let Some(v) = annotations.get("io.k7d.memory_mib") {
            memory = v
                .parse()
                .with_context(|| format!("the annotation io.k7d.memory_mib={v:?} is not a size in MiB"))?;
        }
        check_shape(vcpus, memory)?;
        Ok((vcpus, memory))
    }
}

/// How a CRI pod's VM starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodStart {
    /// Boots its kernel.
    Cold,
    /// Forked from the node's paused template (`crate::template`).
    Fork,
    /// A warm pool member, claimed (`crate::pool`).
    Pool,
}

impl PodStart {
    /// The name the config and the annotation use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cold => "cold",
            Self::Fork => "fork",
            Self::Pool => "pool",
        }
    }
}

fn check_pod_start(v: &str) -> anyhow::Result<PodStart> {
    Ok(match v {
        "cold" => PodStart::Cold,
        "fork" => PodStart::Fork,
        "pool" => PodStart::Pool,
        _ => bail!("pod_start = {v:?} is not cold, fork or pool"),
    })
}

impl ShimConfig {
    /// How long the shim waits for a pod VM's agent: past the runc limit
    /// the VM's command line gives the agent (`k7d.runc_timeout_s`).
    pub fn agent_limits(&self) -> crate::agent::Limits {
        let runc = k7d_agent::proto::runc_timeout(&self.cmdline)
            .unwrap_or(std::time::Duration::from_secs(k7d_agent::proto::DEFAULT_RUNC_TIMEOUT_S));
        crate::agent::Limits::for_runc(runc)
    }

    /// How long a pod VM may take to boot.
    pub fn boot_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.boot_timeout_s)
    }

    /// How this pod's VM starts: the config's `pod_start`, overridden by
    /// the pod's [`POD_START_ANNOTATION`].
    pub fn pod_start(&self, annotations: &HashMap<String, String>) -> anyhow::Result<PodStart> {
        let v = annotations.get(POD_START_ANNOTATION).unwrap_or(&self.pod_start);
        check_pod_start(v).with_context(|| format!("the annotation {POD_START_ANNOTATION}={v:?} is not valid"))
    }
}

fn check_shape(vcpus: u8, memory_mib: u64) -> anyhow::Result<()> {
    if !(1..=64).contains(&vcpus) {
        bail!("a pod VM has 1 to 64 vCPUs, not {vcpus}");
    }
    if !(64..=1 << 20).contains(&memory_mib) {
        bail!("a pod VM has 64 MiB to 1 TiB of memory, not {memory_mib} MiB");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (PathBuf, anyhow::Result<ShimConfig>) {
        let dir = std::env::temp_dir().join(format!("k7d-shim-cfg-{}-{}", std::process::id(), text.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("shim.toml");
        std::fs::write(&p, text).unwrap();
        let r = ShimConfig::read(&p);
        (dir, r)
    }

    #[test]
    fn defaults_fill_in_and_annotations_override_the_shape() {
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\n");
        let cfg = cfg.unwrap();
        assert_eq!(cfg.daemon_socket, PathBuf::from("/run/k7d/k7d.sock"));
        assert_eq!((cfg.vcpus, cfg.memory_mib, cfg.bind_max_mib), (1, 256, 256));
        assert_eq!(cfg.pod_drives, DEFAULT_POD_DRIVES);
        assert_eq!(cfg.datapath, "auto");
        assert_eq!(cfg.pod_start, "cold");
        assert_eq!(cfg.boot_timeout(), std::time::Duration::from_secs(60));
        assert_eq!(cfg.pool_size, 2);
        let mut ann = HashMap::new();
        assert_eq!(cfg.pod_start(&ann).unwrap(), PodStart::Cold);
        ann.insert(POD_START_ANNOTATION.to_string(), "fork".to_string());
        assert_eq!(cfg.pod_start(&ann).unwrap(), PodStart::Fork);
        ann.insert(POD_START_ANNOTATION.to_string(), "pool".to_string());
        assert_eq!(cfg.pod_start(&ann).unwrap(), PodStart::Pool);
        ann.insert(POD_START_ANNOTATION.to_string(), "warm".to_string());
        let e = format!("{:#}", cfg.pod_start(&ann).unwrap_err());
        assert!(
            e.contains("io.k7d.pod-start") && e.contains("not cold, fork or pool"),
            "{e}"
        );
        ann.clear();
        ann.insert("io.k7d.vcpus".to_string(), "2".to_string());
        ann.insert("io.k7d.memory_mib".to_string(), "512".to_string());
        assert_eq!(cfg.shape_for(&ann).unwrap(), (2, 512));
        ann.insert("io.k7d.memory_mib".to_string(), "lots".to_string());
        let e = format!("{:#}", cfg.shape_for(&ann).unwrap_err());
        assert!(e.contains("io.k7d.memory_mib"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_bad_config_is_one_sentence_naming_the_file_and_the_field() {
        let (dir, cfg) = write("kernel = \"k\"\ninitramfs = \"/i\"\n");
        let e = format!("{:#}", cfg.unwrap_err());
        assert!(
            e.contains("shim.toml") && e.contains("kernel must be an absolute path"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\nvcpus = 0\nbogus = 1\n");
        assert!(cfg.is_err());
        std::fs::remove_dir_all(dir).unwrap();
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\npod_drives = 17\n");
        let e = format!("{:#}", cfg.unwrap_err());
        assert!(
            e.ends_with("pod_drives = 17 is more than a pod VM may have (16)"),
            "{e}"
        );
        std::fs::remove_dir_all(dir).unwrap();
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\npool_size = 17\n");
        let e = format!("{:#}", cfg.unwrap_err());
        assert!(
            e.ends_with("pool_size = 17 is more than a warm pool may keep (16)"),
            "{e}"
        );
        std::fs::remove_dir_all(dir).unwrap();
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\nboot_timeout_s = 2\n");
        let e = format!("{:#}", cfg.unwrap_err());
        assert!(e.ends_with("boot_timeout_s = 2 is not 5 to 3600 seconds"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\ncmdline = \"quiet k7d.runc_timeout_s=0\"\n");
        let e = format!("{:#}", cfg.unwrap_err());
        assert!(
            e.ends_with("cmdline: k7d.runc_timeout_s=0 is not 1 to 3600 seconds"),
            "{e}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_config_that_is_no_regular_file_or_too_big_is_refused() {
        let (dir, _) = write("kernel = \"/k\"\ninitramfs = \"/i\"\n");
        let fifo = dir.join("fifo.toml");
        k7d_sys::file::mkfifo(&fifo, 0o600).unwrap();
        let e = format!("{:#}", ShimConfig::read(&fifo).unwrap_err());
        assert!(e.ends_with("it is not a regular file"), "{e}");
        let big = dir.join("big.toml");
        std::fs::write(
            &big,
            format!("kernel = \"/k\"\ninitramfs = \"/i\"\n#{}\n", "x".repeat(70 << 10)),
        )
        .unwrap();
        let e = format!("{:#}", ShimConfig::read(&big).unwrap_err());
        assert!(e.ends_with("is over 65536 bytes"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_agent_limits_follow_the_vms_runc_limit() {
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\ncmdline = \"quiet k7d.runc_timeout_s=900\"\n");
        let l = cfg.unwrap().agent_limits();
        assert_eq!(l, crate::agent::Limits::for_runc(std::time::Duration::from_secs(900)));
        std::fs::remove_dir_all(dir).unwrap();
        let (dir, cfg) = write("kernel = \"/k\"\ninitramfs = \"/i\"\n");
        assert_eq!(cfg.unwrap().agent_limits(), crate::agent::Limits::default());
        std::fs::remove_dir_all(dir).unwrap();
    }
}

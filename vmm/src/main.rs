//! `k7d`: the CLI and the daemon entry point.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use k7d_api::api::{
    ApiError, ClusterArgs, CreateArgs, ForkArgs, MediumArgs, PeekArgs, Reply, Request, RestoreArgs, SnapshotArgs,
    VmInfo, VmList,
};
use k7d_api::client::{self, Client};
use k7d_api::config::{
    DevicesConfig, DiskConfig, GuestSpec, NicConfig, NodeConfig, SerialConfig, VmConfig, VsockConfig,
};
use k7d_vmm::daemon::Daemon;
use k7d_vmm::daemon::server::{self, Access, Server, ServerConfig};
use k7d_vmm::netcli::NetCmd;
use k7d_vmm::{StopReason, Vm, VmOptions, check};

/// `println!` for the CLI's output: a reader that went away (`k7d info x |
/// grep -q ...`) ends the command quietly, as it ends a C tool, where
/// `println!` would panic; any other failure to write says so.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("k7d: cannot write to standard output: {e}");
            std::process::exit(1);
        }
    }};
}

/// Default API socket.
const DEFAULT_SOCKET: &str = "/run/k7d/k7d.sock";
/// Default state directory.
const DEFAULT_STATE_DIR: &str = "/run/k7d/state";
/// Where LZ4 bzImages are unpacked once (`arch::x86_64::unpack`) when k7d
/// runs as root; other users get their own cache (see [`default_kernel_cache`]).
const DEFAULT_KERNEL_CACHE: &str = "/var/cache/k7d/kernels";

/// Where a bzImage's LZ4 payload is unpacked once, so that later boots load
/// the kernel directly instead of running its decompressor in the guest.
#[derive(Debug, Clone, clap::Args)]
struct KernelCacheArgs {
    /// Directory of unpacked kernels (created 0700; at most 4 are kept).
    /// Default: /var/cache/k7d/kernels as root, else
    /// $XDG_CACHE_HOME/k7d/kernels or ~/.cache/k7d/kernels.
    #[arg(long, env = "K7D_KERNEL_CACHE")]
    kernel_cache: Option<PathBuf>,
    /// Boot bzImages through their own decompressor, as QEMU does.
    #[arg(long)]
    no_kernel_cache: bool,
}

impl KernelCacheArgs {
    fn dir(&self) -> Option<PathBuf> {
        if self.no_kernel_cache {
            return None;
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        self.kernel_cache.clone().or_else(|| {
            default_kernel_cache(
                euid,
                std::env::var_os("XDG_CACHE_HOME").as_deref(),
                std::env::var_os("HOME").as_deref(),
            )
        })
    }
}

/// The kernel cache a user gets without `--kernel-cache`: the node's for
/// root, the user's own cache directory otherwise (a relative or missing
/// `XDG_CACHE_HOME` falls back to `~/.cache`, as the XDG spec says); `None`
/// (boot the decompressor) when there is no home to put it in.
fn default_kernel_cache(
    euid: u32,
    xdg_cache_home: Option<&std::ffi::OsStr>,
    home: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    if euid == 0 {
        return Some(PathBuf::from(DEFAULT_KERNEL_CACHE));
    }
    let base = xdg_cache_home
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            home.map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .map(|h| h.join(".cache"))
        })?;
    Some(base.join("k7d").join("kernels"))
}

/// `k7d --version`: a build with the test-only escape drill says so
/// (`vmm/src/drill.rs`; CI checks the release binary's does not).
#[cfg(not(feature = "escape-drill"))]
const VERSION: &str = env!("CARGO_PKG_VERSION");
#[cfg(feature = "escape-drill")]
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (escape-drill: a test-only build, never for production)"
);

#[derive(Parser)]
#[command(
    name = "k7d",
    version = VERSION,
    about = "k7d: light VMs for secure containers and forkable RL rollouts"
)]
struct Cli {
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// The daemon's API socket.
    #[arg(long, global = true, env = "K7D_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// How long a daemon verb waits for the daemon (connecting, then its
    /// answer), in seconds; `create`, `fork`, `snapshot` and `restore` of big
    /// VMs take a while.
    #[arg(long, env = "K7D_TIMEOUT", default_value_t = client::DEFAULT_TIMEOUT.as_secs_f64(), value_parser = parse_secs)]
    timeout: f64,
    /// Seccomp filters for `run` and `daemon`: enforce (deny what a thread
    /// kind does not need), log (allow and audit it), or off.
    #[arg(long, global = true, env = "K7D_SECCOMP", value_enum, default_value = "enforce")]
    seccomp: k7d_vmm::seccomp::Mode,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct GuestArgs {
    /// A built-in test guest: hello, idle, pit, tscdeadline, memwriter, smp, fault, drill, uart.
    #[arg(long, conflicts_with = "raw")]
    builtin: Option<String>,
    /// A flat real-mode image, loaded at 0x8000 and entered with cs = 0.
    #[arg(long, conflicts_with = "kernel")]
    raw: Option<PathBuf>,
    /// A Linux kernel (bzImage or ELF vmlinux).
    #[arg(long, conflicts_with = "builtin")]
    kernel: Option<PathBuf>,
    /// An initramfs for --kernel.
    #[arg(long, requires = "kernel")]
    initrd: Option<PathBuf>,
    /// The kernel command line for --kernel (default: console=ttyS0 ...).
    #[arg(long, requires = "kernel")]
    cmdline: Option<String>,
    /// A u32 argument for the guest's parameter block (repeatable, up to 3).
    #[arg(long = "arg")]
    args: Vec<u32>,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Guest RAM in MiB.
    #[arg(long = "memory", default_value_t = 64)]
    memory_mib: u64,
    /// Add a virtio-rng device (PCI; Linux guests).
    #[arg(long)]
    rng: bool,
    /// A virtio-blk disk: `PATH` (read-write) or `PATH,ro` (repeatable; /dev/vda, /dev/vdb, ...).
    #[arg(long = "disk")]
    disks: Vec<String>,
    /// Read-only drives without a medium after the disks, for images
    /// inserted later (`k7d medium`).
    #[arg(long = "empty-drives", default_value_t = 0)]
    empty_drives: u8,
    /// A virtio-net NIC: `tap=NAME[,queues=N][,vhost=on|off][,mac=..]`, or attached to a pod:
    /// `datapath=direct|bridge|auto,netns=PATH,pod-if=NAME[,pod-uid=UID][,queues=N]` (repeatable).
    #[arg(long = "nic")]
    nics: Vec<String>,
    /// A virtio-vsock device: `cid=N,uds=PATH`.
    #[arg(long)]
    vsock: Option<String>,
    /// No VM Generation ID device (on by default for Linux guests): fork
    /// children's and restored guests' kernels are then not told to reseed
    /// their RNGs.
    #[arg(long = "no-vmgenid")]
    no_vmgenid: bool,
    /// Fork budget: live fork children at most (children inherit it).
    #[arg(long)]
    max_children: Option<u32>,
    /// Fork budget: the guest RAM all live fork children may commit together, in MiB.
    #[arg(long = "max-children-memory")]
    max_children_memory_mib: Option<u64>,
    /// Fork budget: what the copy-on-write disk overlays of all live fork children may hold together, in MiB.
    #[arg(long = "max-children-disk")]
    max_children_disk_mib: Option<u64>,
    /// Re-base the VM on its own once it has diverged from its fork base by this percentage of its RAM (1-100).
    #[arg(long = "rebase-at")]
    rebase_at_percent: Option<u32>,
    /// Keep this many VM shells ready for the VM's fork children (1-64; made by the daemon in the background).
    #[arg(long = "fork-shells")]
    shells: Option<u32>,
}

fn parse_disk(s: &str) -> Result<DiskConfig> {
    let (path, ro) = match s.rsplit_once(',') {
        Some((p, "ro")) => (p, true),
        Some((p, "rw")) => (p, false),
        Some((_, other)) => anyhow::bail!("--disk {s}: unknown option `{other}` (use PATH, PATH,ro or PATH,rw)"),
        None => (s, false),
    };
    Ok(DiskConfig {
        path: Some(PathBuf::from(path)),
        read_only: ro,
    })
}

fn parse_kv(flag: &str, s: &str) -> Result<Vec<(String, String)>> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| anyhow!("--{flag} {s}: `{p}` is not key=value"))
        })
        .collect()
}

fn parse_nic(s: &str) -> Result<NicConfig> {
    let mut n = NicConfig::default();
    let (mut mode, mut netns, mut pod_if, mut pod_uid) = (None, None, None, None);
    let (mut pod_namespace, mut pod_name) = (None, None);
    for (k, v) in parse_kv("nic", s)? {
        match k.as_str() {
            "datapath" => mode = Some(v),
            "netns" => netns = Some(PathBuf::from(v)),
            "pod-if" => pod_if = Some(v),
            "pod-uid" => pod_uid = Some(v),
            "pod-namespace" => pod_namespace = Some(v),
            "pod-name" => pod_name = Some(v),
            "tap" => n.tap = Some(v),
            "queues" => {
                n.queues = Some(
                    v.parse()
                        .map_err(|_| anyhow!("--nic {s}: queues=`{v}` is not a number"))?,
                )
            }
            "vhost" => {
                n.vhost = Some(match v.as_str() {
                    "on" | "true" => true,
                    "off" | "false" => false,
                    _ => anyhow::bail!("--nic {s}: vhost=`{v}` must be on or off"),
                })
            }
            "mac" => n.mac = Some(v),
            _ => anyhow::bail!(
                "--nic {s}: unknown key `{k}` (known: tap, queues, vhost, mac, datapath, netns, pod-if, pod-uid, pod-namespace, pod-name)"
            ),
        }
    }
    if let Some(mode) = mode {
        n.datapath = Some(k7d_api::config::DatapathNicConfig {
            mode,
            netns: netns.ok_or_else(|| anyhow!("--nic {s}: datapath= needs netns=PATH (the pod's netns)"))?,
            pod_if: pod_if.ok_or_else(|| anyhow!("--nic {s}: datapath= needs pod-if=NAME (the pod's veth)"))?,
            pod_uid,
            pod_namespace,
            pod_name,
        });
    } else if netns.is_some() || pod_if.is_some() || pod_uid.is_some() || pod_namespace.is_some() || pod_name.is_some()
    {
        anyhow::bail!(
            "--nic {s}: netns/pod-if/pod-uid/pod-namespace/pod-name only make sense with datapath=direct|bridge|auto"
        );
    }
    Ok(n)
}

fn parse_vsock(s: &str) -> Result<VsockConfig> {
    let (mut cid, mut uds) = (None, None);
    for (k, v) in parse_kv("vsock", s)? {
        match k.as_str() {
            "cid" => {
                cid = Some(
                    v.parse()
                        .map_err(|_| anyhow!("--vsock {s}: cid=`{v}` is not a number"))?,
                )
            }
            "uds" => uds = Some(PathBuf::from(v)),
            _ => anyhow::bail!("--vsock {s}: unknown key `{k}` (known: cid, uds)"),
        }
    }
    Ok(VsockConfig {
        cid: cid.ok_or_else(|| anyhow!("--vsock {s}: cid=N is missing"))?,
        uds: uds.ok_or_else(|| anyhow!("--vsock {s}: uds=PATH is missing"))?,
    })
}

fn load_node(path: &Option<PathBuf>) -> Result<NodeConfig> {
    match path {
        Some(p) => NodeConfig::load(p).map_err(|e| anyhow!("{e}")),
        None => Ok(NodeConfig::default()),
    }
}

impl GuestArgs {
    fn config(&self, id: Option<String>, console: bool) -> Result<VmConfig> {
        let guest = match (&self.builtin, &self.raw) {
            _ if self.kernel.is_some() => GuestSpec::Linux {
                kernel: self.kernel.clone().unwrap_or_default(),
                initrd: self.initrd.clone(),
                cmdline: self.cmdline.clone(),
            },
            (_, Some(path)) => GuestSpec::Raw {
                path: path.clone(),
                args: self.args.clone(),
            },
            (name, None) => GuestSpec::Builtin {
                name: name.clone().unwrap_or_else(|| "hello".into()),
                args: self.args.clone(),
            },
        };
        Ok(VmConfig {
            id,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            guest,
            serial: SerialConfig { console },
            devices: DevicesConfig {
                rng: self.rng,
                disks: self
                    .disks
                    .iter()
                    .map(|d| parse_disk(d))
                    .chain((0..self.empty_drives).map(|_| Ok(DiskConfig::empty())))
                    .collect::<Result<_>>()?,
                nics: self.nics.iter().map(|n| parse_nic(n)).collect::<Result<_>>()?,
                vsock: self.vsock.as_deref().map(parse_vsock).transpose()?,
                vmgenid: self.no_vmgenid.then_some(false),
            },
            fork: k7d_api::config::ForkBudget {
                max_children: self.max_children,
                max_children_memory_mib: self.max_children_memory_mib,
                max_children_disk_mib: self.max_children_disk_mib,
                rebase_at_percent: self.rebase_at_percent,
                shells: self.shells,
            },
        })
    }
}

/// Where and as whom a jailed process runs (`k7d_vmm::jail`).
#[derive(Args)]
struct JailArgs {
    /// An empty directory, the jail's root.
    #[arg(long)]
    root: PathBuf,
    /// The jailed process's uid (not 0).
    #[arg(long)]
    uid: u32,
    /// Its gid (not 0).
    #[arg(long)]
    gid: u32,
}

impl JailArgs {
    /// The jail, keeping `keep_fds` besides stdio.
    fn config(self, keep_fds: Vec<i32>) -> k7d_vmm::jail::JailConfig {
        k7d_vmm::jail::JailConfig {
            root: self.root,
            uid: self.uid,
            gid: self.gid,
            keep_fds,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a small cluster of embedded test guests, fork it as a cluster,
    /// prove every child equals its source and print the timings beside
    /// their floor (no daemon; any KVM host).
    Demo {
        /// Cluster members.
        #[arg(long, default_value_t = 3)]
        members: usize,
        /// Cluster forks.
        #[arg(long, default_value_t = 5)]
        forks: usize,
        /// Guest RAM per member, MiB.
        #[arg(long, default_value_t = 64)]
        memory_mib: u64,
    },
    /// Boot one VM in the foreground, without a daemon (default: the embedded `hello` guest).
    Run {
        #[command(flatten)]
        guest: GuestArgs,
        /// Stop the VM after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// Also append the guest's serial output to this file.
        #[arg(long)]
        serial_log: Option<PathBuf>,
        /// Do not copy the guest's serial output to stdout.
        #[arg(long)]
        quiet: bool,
        /// Node settings (JSON: max_net_queues, vhost_default).
        #[arg(long)]
        node_config: Option<PathBuf>,
        #[command(flatten)]
        kernels: KernelCacheArgs,
    },
    /// Enter a VM process's jail and report what can be reached from
    /// inside (the jail's own test, `vmm/tests/jail.rs`): prints the jailed
    /// process's host pid, then one JSON line from inside, and waits for
    /// stdin to close.
    #[command(hide = true)]
    JailSelftest {
        #[command(flatten)]
        jail: JailArgs,
        /// Also run this built-in guest inside the jail (its serial on
        /// stdout), /dev/kvm handed over as a descriptor.
        #[arg(long)]
        guest: Option<String>,
    },
    /// Start VM processes on behalf of a daemon whose threads may not exec
    /// (`k7d_vmm::vmproc::spawner`), until its socket closes.
    #[command(hide = true)]
    VmSpawner {
        /// The descriptor of the daemon's socket.
        #[arg(long)]
        socket_fd: i32,
    },
    /// Run one VM in a jailed process of its own, driven over the channel
    /// at `--channel-fd` (issue 36; spawned by `k7d_vmm::vmproc::handle`).
    #[command(hide = true)]
    VmProcess {
        #[command(flatten)]
        jail: JailArgs,
        /// The descriptor of `/dev/kvm` it was handed.
        #[arg(long)]
        kvm_fd: i32,
        /// The descriptor of its channel (a unix stream socket).
        #[arg(long)]
        channel_fd: i32,
        /// A listening unix socket's descriptor: the next caller
        /// re-attaches there when this one goes away.
        #[arg(long)]
        listen_fd: Option<i32>,
    },
    /// Run the daemon that owns VMs and serves the API.
    Daemon {
        /// Where VM records live.
        #[arg(long, env = "K7D_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Node settings (JSON: max_net_queues, vhost_default).
        #[arg(long)]
        node_config: Option<PathBuf>,
        #[command(flatten)]
        limits: DaemonLimits,
        #[command(flatten)]
        kernels: KernelCacheArgs,
        #[command(flatten)]
        jail: DaemonJail,
        /// Serve Prometheus scrapes (`GET /metrics`) on this TCP address,
        /// e.g. 127.0.0.1:9477 (docs/observability.md); off by default.
        /// Whoever reaches it may read what the node runs.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<std::net::SocketAddr>,
    },
    #[command(flatten)]
    Api(ApiCmd),
    /// Run a command in a VM through its guest agent (k7d-agent; a fork
    /// child or a restored VM alike): stdin forwarded, stdout and stderr
    /// apart, the command's exit status as k7d's own (docs/exec.md).
    ///
    /// Example: `k7d exec web --env A=1 --cwd /tmp -- sh -c 'echo $A'`.
    #[cfg(feature = "shim")]
    Exec(k7d_vmm::execcli::ExecArgs),
    /// Copy a file or directory between the host and a VM (one side
    /// VM:PATH) through its guest agent: a tar stream, with tar and sh in
    /// the guest; modes, symbolic links and (as root) owners kept; a copy
    /// from a VM is checked entry by entry and bounded (docs/exec.md).
    ///
    /// Example: `k7d cp ./policy web:/opt/` then `k7d cp web-f1:/tmp/obs ./obs-1`.
    #[cfg(feature = "shim")]
    Cp(k7d_vmm::cpcli::CpArgs),
    /// Report whether this host can run k7d.
    Check,
    /// The daemon's event log, oldest first: every create, fork (with its
    /// children and timings), pause, snapshot, restore, stop (with why),
    /// delete and re-attach, across daemon restarts (docs/observability.md).
    Events {
        /// The daemon's state directory (the log is its events.jsonl).
        #[arg(long, env = "K7D_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Only the events of this VM or cluster: its own, the fork that made
        /// it, the clusters it joined.
        #[arg(long)]
        vm: Option<String>,
        /// Keep printing events as they are written, until interrupted.
        #[arg(long)]
        follow: bool,
    },
    /// Pod policy and drop counters of a VM's datapath NICs.
    Net {
        #[command(subcommand)]
        cmd: NetCmd,
    },
    /// Bring the containerd shim's warm pool to `pool_size` booted, paused
    /// pod VMs of the shim config's shape (docs/kubernetes.md), as a node
    /// service does before pods arrive: boots the members it lacks, removes
    /// those beyond it (all at `pool_size = 0`); returns once it is so.
    #[cfg(feature = "shim")]
    PoolFill {
        /// The shim config (default: $K7D_SHIM_CONFIG, else /etc/k7d/shim.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Wait this many seconds first (a shim's refill after a claim).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3600))]
        after_s: u64,
    },
    /// Empty the containerd shim's warm pool (every ready member deleted;
    /// members still booting are counted and left to finish), as a node
    /// does before it changes the shim config (docs/kubernetes.md).
    #[cfg(feature = "shim")]
    PoolDrain {
        /// The shim config (default: $K7D_SHIM_CONFIG, else /etc/k7d/shim.toml).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Delete the containerd shim's fork template (its fork children live
    /// on), as a node does before it changes the shim config.
    #[cfg(feature = "shim")]
    TemplateRemove {
        /// The shim config (default: $K7D_SHIM_CONFIG, else /etc/k7d/shim.toml).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Boot the containerd shim's fork template (a booted, paused pod VM
    /// of the shim config's shape that fork-started pods are forked from;
    /// docs/kubernetes.md), as a node service does before pods arrive;
    /// returns once it is paused.
    #[cfg(feature = "shim")]
    TemplateMake {
        /// The shim config (default: $K7D_SHIM_CONFIG, else /etc/k7d/shim.toml).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

/// Where the daemon runs its VMs (`docs/security.md`, "The jail").
#[derive(Args, Clone)]
struct DaemonJail {
    /// `on` (the default; needs root): every VM the daemon creates runs in
    /// a jailed VM process of its own, which outlives the daemon; `off`:
    /// every VM inside the daemon, unjailed (for development, or a host
    /// that cannot jail; `k7d info` and `k7d check` say so).
    #[arg(long, value_enum, default_value_t = JailMode::On)]
    jail: JailMode,
    /// The first uid (and gid) of the range VM processes take, one each.
    #[arg(long, default_value_t = 2_000_000_000, value_parser = clap::value_parser!(u32).range(1..))]
    jail_id_base: u32,
    /// How many ids the range holds (the most VM processes at once).
    #[arg(long, default_value_t = 65_536, value_parser = clap::value_parser!(u32).range(1..))]
    jail_id_count: u32,
    /// VM processes kept started and jailed ahead, waiting for a fork
    /// child or a VM to build (their start is off the request's path).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=256))]
    jail_spares: u32,
    /// Seconds a VM process has for a whole reply; one that stalls or
    /// breaks its channel is killed, its VM recorded stopped with why.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    vm_process_timeout: u64,
    /// The cgroup v2 directory under which each VM process gets a leaf
    /// with its VM's memory and CPU limits (made if missing; its parent
    /// must have the memory and cpu controllers, or the daemon refuses to
    /// start), or `off`: VM processes without limits (each VM's `info`
    /// says so).
    #[arg(long, default_value = "/sys/fs/cgroup/k7d")]
    jail_cgroup: String,
    /// Test-only (the escape drill's build): a thread of the daemon panics
    /// this many milliseconds after the start, as a bug in the daemon
    /// would (`vmm/tests/escape_drill.rs`).
    #[cfg(feature = "escape-drill")]
    #[arg(long, hide = true)]
    drill_panic_after_ms: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum JailMode {
    On,
    Off,
}

/// Who may use the daemon's API and how it bounds its clients (`docs/security.md`).
#[derive(Args, Clone)]
struct DaemonLimits {
    /// Also serve this uid (repeatable). Root and the daemon's own uid are
    /// always served; others are refused unless listed here or by gid.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
    /// Also serve a client whose (effective, primary) gid is this (repeatable).
    #[arg(long = "allow-gid", value_name = "GID")]
    allow_gids: Vec<u32>,
    /// Most API connections served at once; one more gets a refusal line.
    #[arg(long, default_value_t = server::DEFAULT_MAX_CONNECTIONS as u32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_connections: u32,
    /// Seconds a client has to finish a request line it started (and to read an answer).
    #[arg(long, default_value_t = server::DEFAULT_LINE_TIMEOUT.as_secs_f64(), value_parser = parse_secs)]
    line_timeout: f64,
    /// Seconds an API connection may stay open without a request.
    #[arg(long, default_value_t = server::DEFAULT_IDLE_TIMEOUT.as_secs_f64(), value_parser = parse_secs)]
    idle_timeout: f64,
    /// Seconds the daemon takes at most to exit after SIGTERM or SIGINT,
    /// whatever a request is doing.
    #[arg(long, default_value_t = server::DEFAULT_SHUTDOWN_GRACE.as_secs_f64(), value_parser = parse_secs)]
    shutdown_timeout: f64,
}

fn parse_secs(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("`{s}` is not a number of seconds: {e}"))?;
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0 * 365.0) {
        return Err(format!(
            "`{s}` is out of range: use more than 0 and at most a year of seconds"
        ));
    }
    Ok(v)
}

/// The verbs that are requests to the daemon.
// Parsed once per process: `create`'s flags may make it the big one.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum ApiCmd {
    /// Create a VM in the daemon.
    Create {
        /// VM id (generated when absent).
        #[arg(long)]
        id: Option<String>,
        #[command(flatten)]
        guest: GuestArgs,
        /// Read the VM config from this JSON file instead of flags.
        #[arg(long, conflicts_with_all = ["builtin", "raw", "kernel"])]
        config: Option<PathBuf>,
        /// Start it right away.
        #[arg(long)]
        start: bool,
    },
    /// Start a created VM.
    Start { id: String },
    /// Pause a running VM (every vCPU parked).
    Pause { id: String },
    /// Resume a paused VM.
    Resume { id: String },
    /// Stop a VM's vCPUs.
    Stop { id: String },
    /// Stop and remove a VM.
    Delete { id: String },
    /// Show a VM.
    Info { id: String },
    /// Write a cold snapshot of a VM (state + memory) into a directory.
    Snapshot {
        id: String,
        dir: PathBuf,
        /// Replace an existing snapshot at DIR atomically (without it, an
        /// existing DIR is refused and left as it is).
        #[arg(long)]
        replace: bool,
    },
    /// Start a new VM from a snapshot directory.
    Restore {
        dir: PathBuf,
        /// Id of the new VM (generated when absent).
        #[arg(long)]
        id: Option<String>,
    },
    /// Fork a running VM, or a cluster under one pause, copy-on-write; the
    /// children start at once (a cluster's fork is a cluster of its own).
    Fork {
        /// A VM or a cluster.
        id: String,
        /// Number of children.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Leave the children's kernel RNGs as the source's where their
        /// guest has no vmgenid driver: the caller reseeds them itself (as
        /// the containerd shim does), else siblings draw the same bytes.
        #[arg(long)]
        no_agent_reseed: bool,
    },
    /// Give a forked VM a new base holding its RAM as it is now (built
    /// while it runs, paused for the last round only): its next forks copy
    /// only what it writes from now on.
    Rebase { id: String },
    /// What a VM's guest RAM costs the host: resident, its own copies
    /// (pages written since a fork), PSS.
    GuestRam { id: String },
    /// Read u32 words of a VM's guest RAM (debugging).
    Peek {
        id: String,
        /// Guest physical address (decimal or 0x hex).
        #[arg(value_parser = parse_u64)]
        addr: u64,
        /// Number of words.
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// Put a read-only image into a VM's read-only drive (`--empty-drives`,
    /// or a `,ro` disk), or take it out when no PATH is given: the guest
    /// sees the capacity change, as with a disc in a drive.
    Medium {
        id: String,
        /// The drive's index among the VM's disks.
        disk: u32,
        /// The image; none ejects the medium.
        path: Option<PathBuf>,
    },
    /// Attach a VM's bare NIC (made with `vhost = false`) to a pod's network
    /// through the datapath, while it runs or stands paused: its tap moves
    /// into the pod's netns.
    NicAttach {
        id: String,
        /// The NIC's index among the VM's NICs.
        #[arg(long, default_value_t = 0)]
        nic: u32,
        /// The pod's network namespace (e.g. /run/netns/pod).
        #[arg(long)]
        netns: PathBuf,
        /// The pod's interface inside it.
        #[arg(long, default_value = "eth0")]
        pod_if: String,
        /// `direct`, `bridge` or `auto`.
        #[arg(long, default_value = "auto")]
        mode: String,
        /// The pod UID (its policy identity).
        #[arg(long)]
        pod_uid: Option<String>,
        /// The pod's Kubernetes namespace (a label of the daemon's metrics).
        #[arg(long)]
        pod_namespace: Option<String>,
        /// The pod's name (a label of the daemon's metrics).
        #[arg(long)]
        pod_name: Option<String>,
    },
    /// List VMs.
    List,
    /// The daemon's version, API version and pid (with `--jail on`, also
    /// how many VM processes are ready ahead).
    Version,
    /// Clusters: named sets of VMs forked together (`k7d fork <cluster>`).
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

/// `k7d cluster ...`.
#[derive(Subcommand)]
enum ClusterCmd {
    /// Name existing VMs as a cluster.
    Create {
        /// The cluster's id (VMs and clusters share ids).
        id: String,
        /// Its member VMs.
        #[arg(required = true)]
        members: Vec<String>,
    },
    /// Add existing VMs to a cluster.
    Add {
        id: String,
        #[arg(required = true)]
        members: Vec<String>,
    },
    /// A cluster and its members.
    Info { id: String },
    /// Delete a cluster and every member VM.
    Delete { id: String },
    /// List clusters.
    List,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn catch_signals() -> Result<()> {
    for s in [libc::SIGINT, libc::SIGTERM] {
        vmm_sys_util::signal::register_signal_handler(s, on_signal).context("cannot install the signal handler")?;
    }
    Ok(())
}

/// Least privilege for `run` and `daemon` (docs/security.md): the signal
/// handling and the SIGUSR1 dump thread first (they block signals that every
/// later thread inherits), then the seccomp filters on every thread, before
/// any VM exists or the API accepts.
fn confine(mode: k7d_vmm::seccomp::Mode) -> Result<()> {
    if mode != k7d_vmm::seccomp::Mode::Off {
        k7d_vmm::seccomp::limit_control_capabilities().context("cannot narrow k7d's capabilities")?;
    }
    catch_signals()?;
    k7d_vmm::diag::install().context("cannot start the SIGUSR1 state dump thread")?;
    k7d_devices::sandbox::install(&k7d_vmm::seccomp::DeviceSandbox);
    // Installed on a helper thread while the caller builds its first VM;
    // `Vm::start` (and the daemon, before its API accepts) waits for it.
    k7d_vmm::seccomp::start_init(mode).context("cannot confine k7d's threads")?;
    Ok(())
}

/// The vsock socket through which `k7d exec` reaches vm `id`'s guest agent
/// (its `info`, so the API's access rules apply).
#[cfg(feature = "shim")]
fn exec_socket(client: &mut Client, id: &str) -> Result<std::path::PathBuf> {
    let req = Request::Info(id.to_string());
    let result = client.call(&req).map_err(|e| anyhow!("{e}"))?;
    let Reply::Vm(info) = Reply::from_result(&req, result)
        .with_context(|| format!("the daemon's answer to `{}` is not its result", req.op()))?
    else {
        anyhow::bail!("the daemon's answer to `info` is not a VM");
    };
    match &info.config.devices.vsock {
        Some(v) => Ok(v.uds.clone()),
        None => anyhow::bail!(
            "vm {id} has no vsock device, through which k7d exec reaches its guest agent (create it with --vsock)"
        ),
    }
}

fn init_logs(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("K7D_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colours for a terminal only: a log file or journald would keep the
    // escape codes, and `grep 'ms=' daemon.log` would miss every field.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let start = Instant::now();
    // Installed as containerd-shim-k7d-v2 (a link to this binary):
    // containerd's shim protocol, not this CLI (docs/containerd.md).
    #[cfg(feature = "shim")]
    if std::env::args_os()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_name().map(|n| n == k7d_shim::SHIM_NAME))
        .unwrap_or(false)
    {
        k7d_shim::run();
        return ExitCode::SUCCESS;
    }
    let cli = Cli::parse();
    let json_out = cli.json;
    match real_main(cli, start) {
        Ok(code) => code,
        Err(e) => {
            let msg = format!("{e:#}");
            if json_out {
                out!("{}", json!({"ok": false, "error": {"message": msg}}));
            } else {
                eprintln!("k7d: {msg}");
            }
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli, process_start: Instant) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Demo {
            members,
            forks,
            memory_mib,
        } => {
            init_logs("warn");
            confine(cli.seccomp)?;
            demo(
                &k7d_vmm::demo::DemoConfig {
                    members,
                    forks,
                    memory_mib,
                },
                cli.json,
            )
        }
        Cmd::Run {
            guest,
            timeout,
            serial_log,
            quiet,
            node_config,
            kernels,
        } => {
            init_logs("warn");
            let node = load_node(&node_config)?;
            confine(cli.seccomp)?;
            run_foreground(
                &guest,
                timeout,
                serial_log,
                quiet,
                cli.json,
                process_start,
                node,
                kernels.dir(),
            )
        }
        Cmd::JailSelftest { jail, guest } => jail_selftest(jail, guest),
        Cmd::VmProcess {
            jail,
            kvm_fd,
            channel_fd,
            listen_fd,
        } => vm_process(jail, kvm_fd, channel_fd, listen_fd),
        Cmd::VmSpawner { socket_fd } => {
            init_logs("warn");
            vm_spawner(socket_fd)
        }
        Cmd::Daemon {
            state_dir,
            node_config,
            limits,
            kernels,
            jail,
            metrics_listen,
        } => {
            init_logs("info");
            let node = load_node(&node_config)?;
            // Before the filters deny exec: the spawner does it for the
            // daemon. As a subreaper the daemon learns how its VM
            // processes end.
            let procs = match jail.jail {
                JailMode::On => Some(vm_processes(&jail)?),
                JailMode::Off => None,
            };
            if procs.is_some() {
                abort_on_panic();
            }
            #[cfg(feature = "escape-drill")]
            if let Some(ms) = jail.drill_panic_after_ms {
                std::thread::Builder::new()
                    .name("k7d-drill-panic".into())
                    .spawn(move || {
                        std::thread::sleep(std::time::Duration::from_millis(ms));
                        panic!("escape drill: a bug in the daemon");
                    })
                    .context("cannot start the drill's panicking thread")?;
            }
            confine(cli.seccomp)?;
            daemon(
                &state_dir,
                &cli.socket,
                node,
                &limits,
                kernels.dir(),
                procs,
                metrics_listen,
            )
        }
        Cmd::Net { cmd } => {
            init_logs("warn");
            k7d_vmm::netcli::run(cmd, cli.json)
        }
        #[cfg(feature = "shim")]
        Cmd::PoolFill { config, after_s } => {
            init_logs("info");
            std::thread::sleep(std::time::Duration::from_secs(after_s));
            let f = k7d_shim::fill_pool(config.as_deref())?;
            if cli.json {
                out!(
                    "{}",
                    json!({"pool": f.pool, "booted": f.booted, "removed": f.removed, "ready": f.ready})
                );
            } else {
                let removed = match f.removed {
                    0 => String::new(),
                    n => format!(", {n} removed (beyond its pool_size)"),
                };
                out!(
                    "warm pool {}: {} member(s) booted{removed}, {} ready",
                    f.pool,
                    f.booted,
                    f.ready
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "shim")]
        Cmd::PoolDrain { config } => {
            init_logs("info");
            let (pool, removed, booting) = k7d_shim::drain_pool(config.as_deref())?;
            if cli.json {
                out!("{}", json!({"pool": pool, "removed": removed, "booting": booting}));
            } else {
                out!("warm pool {pool}: {removed} member(s) removed, {booting} still booting");
            }
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "shim")]
        Cmd::TemplateRemove { config } => {
            init_logs("info");
            let (vm, had) = k7d_shim::remove_template(config.as_deref())?;
            if cli.json {
                out!("{}", json!({"template": vm, "removed": had}));
            } else {
                out!("fork template {vm}: {}", if had { "removed" } else { "none to remove" });
            }
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "shim")]
        Cmd::TemplateMake { config } => {
            init_logs("info");
            let (vm, booted) = k7d_shim::make_template(config.as_deref())?;
            if cli.json {
                out!("{}", json!({"template": vm, "booted": booted}));
            } else {
                out!(
                    "fork template {vm}: {}",
                    if booted { "booted and paused" } else { "already paused" }
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Events { state_dir, vm, follow } => {
            init_logs("warn");
            k7d_vmm::eventscli::run(&state_dir, vm.as_deref(), follow, cli.json)
        }
        Cmd::Check => {
            init_logs("warn");
            let mut items = check::run();
            // (Here, not in `check::run`: it runs this binary's `jail-selftest`.)
            items.push(check::jail_item(
                &std::env::current_exe().context("cannot find k7d's own binary")?,
            ));
            if cli.json {
                out!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"items": items, "ready": !check::failed(&items)}))?
                );
            } else {
                for i in &items {
                    let tag = match i.level {
                        check::Level::Ok => "ok  ",
                        check::Level::Warn => "WARN",
                        check::Level::Fail => "FAIL",
                        check::Level::Info => "info",
                    };
                    out!("{tag} {:<15} {}", i.name, i.detail);
                }
            }
            Ok(if check::failed(&items) {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        #[cfg(feature = "shim")]
        Cmd::Cp(a) => {
            init_logs("warn");
            let mut client = Client::connect_with_timeout(&cli.socket, Duration::from_secs_f64(cli.timeout))
                .map_err(|e: ApiError| anyhow!("{e}"))?;
            k7d_vmm::cpcli::run(&a, |vm| exec_socket(&mut client, vm))
        }
        #[cfg(feature = "shim")]
        Cmd::Exec(a) => {
            init_logs("warn");
            let mut client = Client::connect_with_timeout(&cli.socket, Duration::from_secs_f64(cli.timeout))
                .map_err(|e: ApiError| anyhow!("{e}"))?;
            if let Some(cl) = &a.cluster {
                let req = Request::ClusterInfo(cl.clone());
                let result = client.call(&req).map_err(|e| anyhow!("{e}"))?;
                let Reply::Cluster(info) = Reply::from_result(&req, result)
                    .with_context(|| format!("the daemon's answer to `{}` is not its result", req.op()))?
                else {
                    anyhow::bail!("the daemon's answer to `cluster info` is not a cluster");
                };
                if info.members.is_empty() {
                    anyhow::bail!("cluster {cl} has no members to run the command in");
                }
                let members = info
                    .members
                    .iter()
                    .map(|m| Ok((m.id.clone(), exec_socket(&mut client, &m.id)?)))
                    .collect::<Result<Vec<_>>>()?;
                return Ok(k7d_vmm::execcli::run_cluster(&members, &a));
            }
            let vm = a.vm.as_deref().context("k7d exec needs a VM or --cluster")?;
            if a.api {
                drop(client);
                return k7d_vmm::execcli::run_through_daemon(&cli.socket, vm, &a);
            }
            let uds = exec_socket(&mut client, vm)?;
            k7d_vmm::execcli::run(vm, uds, &a)
        }
        Cmd::Api(cmd) => {
            init_logs("warn");
            let req = api_request(cmd)?;
            let mut client = Client::connect_with_timeout(&cli.socket, Duration::from_secs_f64(cli.timeout))
                .map_err(|e: ApiError| anyhow!("{e}"))?;
            let result = client.call(&req).map_err(|e| anyhow!("{e}"))?;
            // The result is read as the type its op defines; --json prints
            // it as the daemon wrote it.
            let reply = Reply::from_result(&req, result.clone())
                .with_context(|| format!("the daemon's answer to `{}` is not its result", req.op()))?;
            if cli.json {
                out!("{}", serde_json::to_string_pretty(&result)?);
            } else {
                print_reply(&reply);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The request a daemon verb sends.
fn api_request(cmd: ApiCmd) -> Result<Request> {
    Ok(match cmd {
        ApiCmd::Create {
            id,
            guest,
            config,
            start,
        } => {
            let config = match config {
                Some(path) => {
                    let text = std::fs::read_to_string(&path)
                        .with_context(|| format!("cannot read the config file {}", path.display()))?;
                    let mut c: VmConfig = serde_json::from_str(&text)
                        .with_context(|| format!("the config file {} is invalid", path.display()))?;
                    if id.is_some() {
                        c.id = id;
                    }
                    c
                }
                None => guest.config(id, false)?,
            };
            Request::Create(CreateArgs { config, start })
        }
        ApiCmd::Start { id } => Request::Start(id),
        ApiCmd::Pause { id } => Request::Pause(id),
        ApiCmd::Resume { id } => Request::Resume(id),
        ApiCmd::Stop { id } => Request::Stop(id),
        ApiCmd::Delete { id } => Request::Delete(id),
        ApiCmd::Info { id } => Request::Info(id),
        ApiCmd::Snapshot { id, dir, replace } => Request::Snapshot(SnapshotArgs {
            id,
            dir: std::path::absolute(&dir).unwrap_or(dir),
            replace,
        }),
        ApiCmd::Restore { dir, id } => Request::Restore(RestoreArgs {
            dir: std::path::absolute(&dir).unwrap_or(dir),
            id,
        }),
        ApiCmd::Peek { id, addr, count } => Request::Peek(PeekArgs { id, addr, count }),
        ApiCmd::GuestRam { id } => Request::GuestRam(id),
        ApiCmd::Medium { id, disk, path } => Request::Medium(MediumArgs {
            id,
            disk,
            path: path.map(|p| std::path::absolute(&p).unwrap_or(p)),
        }),
        ApiCmd::Fork {
            id,
            count,
            no_agent_reseed,
        } => Request::Fork(ForkArgs {
            id,
            count,
            reseed_by_caller: no_agent_reseed,
            ..Default::default()
        }),
        ApiCmd::NicAttach {
            id,
            nic,
            netns,
            pod_if,
            mode,
            pod_uid,
            pod_namespace,
            pod_name,
        } => Request::NicAttach(k7d_api::api::NicAttachArgs {
            id,
            nic,
            datapath: k7d_api::config::DatapathNicConfig {
                mode,
                netns: std::path::absolute(&netns).unwrap_or(netns),
                pod_if,
                pod_uid,
                pod_namespace,
                pod_name,
            },
        }),
        ApiCmd::List => Request::List,
        ApiCmd::Version => Request::Version,
        ApiCmd::Rebase { id } => Request::Rebase(id),
        ApiCmd::Cluster(c) => match c {
            ClusterCmd::Create { id, members } => Request::ClusterCreate(ClusterArgs { id, members }),
            ClusterCmd::Add { id, members } => Request::ClusterAdd(ClusterArgs { id, members }),
            ClusterCmd::Info { id } => Request::ClusterInfo(id),
            ClusterCmd::Delete { id } => Request::ClusterDelete(id),
            ClusterCmd::List => Request::ClusterList,
        },
    })
}

/// `k7d demo`: the lines as it goes, then the summary; fails when a child
/// differed from its source.
fn demo(cfg: &k7d_vmm::demo::DemoConfig, json_out: bool) -> Result<ExitCode> {
    use k7d_vmm::demo::ms;
    let report = k7d_vmm::demo::run(cfg, |line| {
        if !json_out {
            out!("{line}");
        }
    })?;
    let mut totals: Vec<f64> = report.batches.iter().map(|b| ms(b.total())).collect();
    totals.sort_by(f64::total_cmp);
    let p50 = totals[totals.len() / 2];
    let floor = ms(report.floor_vm) * cfg.members as f64;
    let differing: usize = report.batches.iter().map(|b| b.differing).sum();
    if json_out {
        let batches: Vec<_> = report
            .batches
            .iter()
            .map(|b| {
                json!({
                    "pause_ms": ms(b.pause),
                    "children_ms": b.children.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
                    "total_ms": ms(b.total()),
                    "pages": b.pages,
                    "differing": b.differing,
                })
            })
            .collect();
        out!(
            "{}",
            json!({"members": cfg.members, "memory_mib": cfg.memory_mib, "forks": batches,
                   "fork_p50_ms": p50, "floor_vm_ms": ms(report.floor_vm), "floor_ms": floor,
                   "loop_counters": report.counters, "differing_pages": differing})
        );
    } else {
        out!(
            "cluster fork of {} members, median of {}: {p50:.2} ms; floor {floor:.2} ms ({} bare KVM VMs of {} MiB at {:.2} ms each, built in this run): {:.1}x the floor",
            cfg.members,
            report.batches.len(),
            cfg.members,
            cfg.memory_mib,
            ms(report.floor_vm),
            p50 / floor.max(0.001)
        );
    }
    if differing > 0 {
        eprintln!("k7d: {differing} pages of the children differed from their sources");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_reply(reply: &Reply) {
    match reply {
        Reply::Vm(vm) => print_vm(vm),
        Reply::Deleted(d) => out!("{} deleted", d.id),
        Reply::Snapshot(s) => out!(
            "vm {}: snapshot written to {} in {:.1} ms",
            s.id,
            s.dir.display(),
            s.snapshot_ms
        ),
        Reply::Forked(f) => {
            for c in &f.children {
                let shell = if c.shell { ", in a shell made ahead" } else { "" };
                out!(
                    "vm {}: {} (forked in {:.2} ms{shell})",
                    c.info.id,
                    c.info.status,
                    c.fork_ms
                );
            }
            for c in &f.clusters {
                out!("cluster {c}");
            }
            if !f.rebased.is_empty() {
                out!("re-based first (the batch shares one capture): {}", f.rebased.join(" "));
            }
            out!("source {} paused for {:.2} ms", f.id, f.source_paused_ms);
            for w in &f.warnings {
                eprintln!("k7d: warning: {w}");
            }
        }
        Reply::Cluster(c) => {
            out!("cluster {}: {} members", c.id, c.members.len());
            for m in &c.members {
                out!("  {:<24} {}", m.id, m.status);
            }
            if let Some(b) = &c.bridge {
                out!("bridge {b}: {}", c.ports.join(" "));
            }
        }
        Reply::Clusters(l) => {
            out!("{:<24} {:<16} MEMBERS", "CLUSTER", "BRIDGE");
            for c in &l.clusters {
                out!(
                    "{:<24} {:<16} {}",
                    c.id,
                    c.bridge.as_deref().unwrap_or("-"),
                    c.members.join(" ")
                );
            }
        }
        Reply::Peek(p) => {
            let words: Vec<String> = p.words.iter().map(|w| w.to_string()).collect();
            out!("{}", words.join(" "));
        }
        Reply::GuestRam(r) => {
            let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
            out!(
                "vm {}'s guest RAM on the host: {:.1} MiB resident, {:.1} MiB of them its own copies (pages written since a fork), PSS {:.1} MiB",
                r.id,
                mib(r.resident),
                mib(r.copied),
                mib(r.pss)
            );
        }
        Reply::List(l) => print_list(l),
        Reply::Rebased(r) => out!(
            "re-based {}: {:.1} MiB had diverged from its base; new base {:.1} MiB in {:.1} ms ({} rounds, paused {:.2} ms)",
            r.id,
            r.diverged_mib,
            r.base_mib,
            r.took_ms,
            r.rounds,
            r.paused_ms
        ),
        Reply::Executed(x) => out!(
            "vm {}: exited {} in {:.1} ms ({} bytes of stdout, {} of stderr{})",
            x.id,
            x.status,
            x.exec_ms,
            x.stdout_bytes,
            x.stderr_bytes,
            if x.timed_out { "; killed past its timeout" } else { "" }
        ),
        Reply::Version(v) => {
            out!("k7d daemon {} (API version {}, pid {})", v.k7d, v.api_version, v.pid);
            if let Some(n) = v.vm_process_spares {
                out!("  VM processes ready ahead (--jail on): {n}");
            }
        }
    }
}

fn parse_u64(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("`{s}` is not a number: {e}"))
}

fn print_list(l: &VmList) {
    out!("{:<24} {:<5} {:>8}  {:<18} STATUS", "ID", "VCPUS", "MEM(MiB)", "GUEST");
    for vm in &l.vms {
        out!(
            "{:<24} {:<5} {:>8}  {:<18} {}",
            vm.id,
            vm.vcpus,
            vm.memory_mib,
            vm.guest,
            vm.status
        );
    }
}

/// In a jailed process, before its VM: the `/dev/kvm` it was handed for
/// every KVM call, then its threads' sandbox and seccomp filters.
fn confine_jailed_vm(kvm: std::fs::File) -> Result<()> {
    k7d_vmm::vstate::kvm::hand_over(kvm).map_err(|_| anyhow::anyhow!("a KVM descriptor was handed over twice"))?;
    k7d_devices::sandbox::install(&k7d_vmm::seccomp::DeviceSandbox);
    k7d_vmm::seccomp::start_init(k7d_vmm::seccomp::Mode::Enforce).context("cannot confine the jailed VM's threads")?;
    Ok(())
}

/// `k7d vm-process`: the jail (keeping only `/dev/kvm` and the channel),
/// then the VM's threads under their seccomp filters, then the channel
/// served (`k7d_vmm::vmproc::runtime`). The first process writes the
/// jailed one's host pid on the channel and exits.
fn vm_process(jail: JailArgs, kvm_fd: i32, channel_fd: i32, listen_fd: Option<i32>) -> Result<ExitCode> {
    use k7d_vmm::jail::{Entered, enter};
    use std::io::Write;
    use std::os::fd::FromRawFd;
    let mut fds = vec![(kvm_fd, "--kvm-fd"), (channel_fd, "--channel-fd")];
    fds.extend(listen_fd.map(|l| (l, "--listen-fd")));
    for (i, &(fd, what)) in fds.iter().enumerate() {
        if fd < 3 || !k7d_vmm::sys::fd_is_open(fd) {
            anyhow::bail!("{what} {fd} is not a descriptor this process was handed");
        }
        if let Some((_, other)) = fds[..i].iter().find(|(f, _)| *f == fd) {
            anyhow::bail!("{other} and {what} are both {fd}");
        }
    }
    // SAFETY: checked open above, this process's own, handed over at spawn
    // as a listening socket; nothing else owns it.
    let listener = listen_fd.map(|l| unsafe { std::os::unix::net::UnixListener::from_raw_fd(l) });
    // SAFETY: both were checked open above and are this process's own,
    // handed over at spawn for exactly these uses; nothing else owns them.
    let (kvm, mut channel) = unsafe {
        (
            std::fs::File::from_raw_fd(kvm_fd),
            std::os::unix::net::UnixStream::from_raw_fd(channel_fd),
        )
    };
    let cfg = jail.config(fds.iter().map(|(f, _)| *f).collect());
    match enter(&cfg) {
        Ok(Entered::Outside { pid }) => {
            writeln!(channel, "{}", json!({ "jailed_pid": pid })).context("cannot write on the channel")?;
            return Ok(ExitCode::SUCCESS);
        }
        Ok(Entered::Inside) => {}
        Err(e) => {
            let _ = writeln!(channel, "{}", json!({ "error": e.to_string() }));
            return Err(e).context("cannot enter the VM process's jail");
        }
    }
    // A panic ends the VM process (issue 36, "failure stays local"):
    // nothing carries on with the state a panic left half-changed; its
    // daemon records why as the VM's stop. (Not `abort`: the jailed
    // process is pid 1 of its namespace, which ignores a SIGABRT it sends
    // itself.)
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        k7d_vmm::sys::exit_now(k7d_vmm::vmproc::PANIC_EXIT);
    }));
    confine_jailed_vm(kvm)?;
    k7d_vmm::vmproc::runtime::serve(channel, listener).map_err(|e| anyhow::anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}

/// `k7d jail-selftest`: the jail entered (`k7d_vmm::jail`), then what the
/// jailed process reaches from inside, as one JSON line: its pid in its own
/// namespace, its ids, the host's `/etc/passwd`, a TCP connection to
/// 127.0.0.1 and a unix socket at the daemon's default path. With `--guest`
/// it first opens /dev/kvm (the one descriptor it takes into the jail),
/// then runs that built-in guest in the jail, its threads under their
/// seccomp filters, and reports the guest's loop counter. Waits for stdin
/// to close (the caller inspects it from outside meanwhile).
fn jail_selftest(jail: JailArgs, guest: Option<String>) -> Result<ExitCode> {
    use k7d_vmm::jail::{Entered, enter};
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let kvm = match &guest {
        Some(_) => Some(std::fs::File::open("/dev/kvm").context("cannot open /dev/kvm")?),
        None => None,
    };
    let cfg = jail.config(kvm.iter().map(|f| f.as_raw_fd()).collect());
    match enter(&cfg).context("cannot enter the jail")? {
        Entered::Outside { pid } => {
            println!("{}", json!({ "jailed_pid": pid }));
            return Ok(ExitCode::SUCCESS);
        }
        Entered::Inside => {}
    }
    let err = |r: std::io::Result<()>| r.err().map(|e| e.to_string());
    let host_file = err(std::fs::File::open("/etc/passwd").map(drop));
    let tcp = err(std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], 22).into(), Duration::from_secs(1)).map(drop));
    let unix = err(std::os::unix::net::UnixStream::connect("/run/k7d/k7d.sock").map(drop));
    let root_entries = std::fs::read_dir("/").map(|d| d.count()).unwrap_or(usize::MAX);
    // The guest, built and run in the jail (threads only now: the jail
    // wanted one).
    let mut vm = None;
    let mut counter = None;
    if let (Some(name), Some(kvm)) = (guest, kvm) {
        confine_jailed_vm(kvm)?;
        let config = VmConfig {
            guest: GuestSpec::Builtin { name, args: Vec::new() },
            serial: SerialConfig { console: true },
            ..Default::default()
        };
        let mut v = Vm::new("jailed", &config, &VmOptions::default()).context("cannot build the VM in the jail")?;
        v.start().context("cannot start the VM in the jail")?;
        let at = k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER;
        let t = Instant::now();
        let read = |v: &Vm| {
            k7d_vmm::vm_memory_reexport::Bytes::read_obj::<u32>(
                v.memory(),
                k7d_vmm::vm_memory_reexport::GuestAddress(at),
            )
            .unwrap_or(0)
        };
        while read(&v) == 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        counter = Some(read(&v));
        vm = Some(v);
    }
    println!(
        "{}",
        json!({
            "pid": std::process::id(),
            "uid": k7d_vmm::sys::euid(),
            "root_entries": root_entries,
            "open_host_file": host_file,
            "tcp_connect": tcp,
            "unix_connect": unix,
            "guest_loop_counter": counter,
        })
    );
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    if let Some(mut v) = vm {
        v.stop();
    }
    Ok(ExitCode::SUCCESS)
}

fn print_vm(vm: &VmInfo) {
    out!("vm {}: {}", vm.id, vm.status);
    out!("  vcpus: {}, memory: {} MiB", vm.config.vcpus, vm.config.memory_mib);
    for d in &vm.devices {
        out!("  device {}: {} ({})", d.kind, d.location, d.detail);
    }
    if let Some(p) = &vm.serial_log {
        out!("  serial log: {}", p.display());
    }
    if let Some(p) = &vm.parent {
        out!("  forked from: {p}");
    }
    if !vm.children.is_empty() {
        out!("  fork children: {}", vm.children.join(" "));
    }
    if vm.rebases > 0 {
        out!("  re-based: {} times", vm.rebases);
    }
    if let (Some(want), Some(ready)) = (vm.config.fork.shells, vm.shells_ready) {
        out!("  shells ready for its fork children: {ready} of {want}");
    }
    if let Some(r) = vm.rng_reseed {
        out!("  rng reseed after a fork or restore: {}", r.describe());
    }
    if let Some(g) = &vm.vmgenid {
        out!("  vm generation id: {g}");
    }
    match &vm.vm_process {
        Some(p) => out!(
            "  vm process: pid {}, uid {}, gid {} (jailed), {}",
            p.pid,
            p.uid,
            p.gid,
            p.cgroup.as_ref().map_or_else(
                || "no cgroup (--jail-cgroup off: no memory or CPU limit)".to_string(),
                |c| format!("cgroup {}", c.display())
            )
        ),
        None => out!("  vm process: none (runs inside the daemon: --jail off)"),
    }
}

/// The daemon's VM processes (`--jail on`): the spawner started and this
/// process a child subreaper.
fn vm_processes(jail: &DaemonJail) -> Result<k7d_vmm::daemon::VmProcesses> {
    // What the spawner must hand its VM processes before their jail: a
    // daemon without it would start and then fail every VM it builds.
    let caps = k7d_vmm::sys::permitted_capabilities().context("cannot read this process's capabilities")?;
    let missing: Vec<&str> = k7d_vmm::vmproc::spawner::JAIL_CAPS
        .iter()
        .filter(|&&(c, _)| caps & (1u64 << c) == 0)
        .map(|&(_, what)| what.split(':').next().unwrap_or(what))
        .collect();
    if !missing.is_empty() {
        anyhow::bail!(
            "--jail on (the default) runs each VM in a jailed process of its own and needs root, and this daemon lacks {}: run it as root, or pass --jail off to run every VM inside the daemon without a jail (for development)",
            missing.join(", ")
        );
    }
    // The cgroup first: a daemon that cannot have it starts nothing.
    let cgroup = match jail.jail_cgroup.as_str() {
        "off" => {
            tracing::warn!(
                "--jail-cgroup off: VM processes run without a cgroup of their own (no memory or CPU limit)"
            );
            None
        }
        dir if !std::path::Path::new(dir).is_absolute() => {
            anyhow::bail!("--jail-cgroup {dir}: give an absolute cgroup v2 directory, or off")
        }
        dir => Some(
            k7d_vmm::jail::cgroup::CgroupRoot::prepare(std::path::Path::new(dir)).map_err(|e| anyhow::anyhow!(e))?,
        ),
    };
    let k7d = std::env::current_exe().context("cannot find this binary to run VM processes with")?;
    k7d_vmm::sys::become_subreaper().context("cannot become a child subreaper")?;
    k7d_vmm::vmproc::handle::set_call_timeout(std::time::Duration::from_secs(jail.vm_process_timeout));
    let spawner = k7d_vmm::vmproc::spawner::Spawner::start(&k7d).map_err(|e| anyhow::anyhow!(e))?;
    let ids = k7d_vmm::daemon::IdRange {
        base: jail.jail_id_base,
        count: jail.jail_id_count,
    };
    k7d_vmm::daemon::VmProcesses::new(spawner, ids, jail.jail_spares as usize, cgroup).map_err(|e| anyhow::anyhow!(e))
}

/// A panic anywhere in a daemon whose VMs run in VM processes ends the
/// daemon (issue 36, "failure stays local"): nothing carries on with the
/// state a panic left half-changed, its VMs run on in their processes,
/// and the next daemon (its supervisor restarts it) re-attaches to them.
/// Inside a daemon with `--jail off` a panic stays in its thread: ending
/// the daemon would end every VM.
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!("the daemon panicked: it ends now; its VM processes run on for the next daemon");
        std::process::abort();
    }));
}

/// `k7d vm-spawner`: serves its daemon (`k7d_vmm::vmproc::spawner`).
fn vm_spawner(socket_fd: i32) -> Result<ExitCode> {
    use std::os::fd::FromRawFd;
    if socket_fd < 3 || !k7d_vmm::sys::fd_is_open(socket_fd) {
        anyhow::bail!("--socket-fd {socket_fd} is not a descriptor this process was handed");
    }
    // SAFETY: checked open above; handed over at spawn for this use only.
    let sock = unsafe { std::os::unix::net::UnixStream::from_raw_fd(socket_fd) };
    let k7d = std::env::current_exe().context("cannot find this binary to run VM processes with")?;
    k7d_vmm::vmproc::spawner::serve(sock, &k7d).map_err(|e| anyhow::anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}

fn daemon(
    state_dir: &std::path::Path,
    socket: &std::path::Path,
    node: NodeConfig,
    limits: &DaemonLimits,
    kernel_cache: Option<PathBuf>,
    procs: Option<k7d_vmm::daemon::VmProcesses>,
    metrics_listen: Option<std::net::SocketAddr>,
) -> Result<ExitCode> {
    k7d_vmm::seccomp::ready().context("cannot confine k7d's threads")?;
    // A few fds per VM and per shell: the default soft limit (1024) would
    // stop a busy node long before its memory does.
    match k7d_vmm::sys::raise_nofile_limit() {
        Ok(n) => tracing::debug!(open_files = n, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit; it stays as it was"),
    }
    let (d, reconciled) = Daemon::open(state_dir)?;
    let mut d = d.with_node_config(node).with_kernel_cache(kernel_cache);
    if let Some(p) = procs {
        d = d.with_vm_processes(p);
    }
    for id in d.reattached() {
        eprintln!("k7d: re-attached vm {id} in its VM process");
    }
    for r in &reconciled {
        eprintln!(
            "k7d: reconciled vm {} ({}, daemon pid {:?} is gone): record removed",
            r.id, r.state, r.daemon_pid
        );
    }
    // Before any VM is built: what outlived the gone daemon's VMs on purpose
    // (datapath pins, links in pod netns that still exist).
    for s in d.detach_leftover_nics(&reconciled) {
        eprintln!(
            "k7d: reconciled vm {}: datapath of {} NIC(s) detached{}",
            s.id,
            s.detached,
            if s.failed.is_empty() {
                String::new()
            } else {
                format!(", {} could not be (see the log)", s.failed.len())
            }
        );
    }
    let mut access = Access::owner_only();
    for &u in &limits.allow_uids {
        if !access.uids.contains(&u) {
            access.uids.push(u);
        }
    }
    for &g in &limits.allow_gids {
        if !access.gids.contains(&g) {
            access.gids.push(g);
        }
    }
    tracing::info!(
        uids = ?access.uids,
        gids = ?access.gids,
        "API clients allowed: root and this daemon's own uid always (they own every VM already), and those given by --allow-uid/--allow-gid"
    );
    let cfg = ServerConfig {
        max_connections: limits.max_connections as usize,
        line_timeout: Duration::from_secs_f64(limits.line_timeout),
        idle_timeout: Duration::from_secs_f64(limits.idle_timeout),
        access,
    };
    let d = std::sync::Arc::new(d);
    // Before the API: an address that cannot be had refuses the start
    // before any client was served.
    let metrics = match metrics_listen {
        Some(addr) => {
            let m = k7d_vmm::daemon::metrics_http::MetricsServer::start(d.clone(), addr)?;
            eprintln!("k7d: metrics at http://{}/metrics", m.addr());
            Some(m)
        }
        None => None,
    };
    let server = Server::start_with(d.clone(), socket, cfg)?;
    let rebaser = k7d_vmm::daemon::Rebaser::start(&d, k7d_vmm::daemon::REBASE_PERIOD)
        .context("cannot spawn the re-base thread")?;
    let keeper = k7d_vmm::daemon::ShellKeeper::start(&d, k7d_vmm::daemon::SHELL_PERIOD)
        .context("cannot spawn the shell thread")?;
    tracing::info!(state_dir = %state_dir.display(), pid = std::process::id(), "k7d daemon ready");
    while !INTERRUPTED.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Shut down on a thread of its own and wait for it a bounded time: a
    // request that is still running (and may hold a VM) cannot keep the
    // daemon from exiting.
    let bound = Duration::from_secs_f64(limits.shutdown_timeout);
    tracing::info!(bound_s = bound.as_secs_f64(), "signal received: shutting down");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let socket_path = socket.to_path_buf();
    let shutdown = std::thread::Builder::new()
        .name("k7d-shutdown".into())
        .spawn(move || {
            // No re-base starts from now on (one under way ends first,
            // within the bound).
            drop(rebaser);
            drop(keeper);
            drop(metrics);
            // Half the bound for connections to finish their requests, the
            // rest for stopping and deleting the VMs.
            server.shutdown_within(bound / 2);
            d.shutdown();
            let _ = done_tx.send(());
        })
        .context("cannot spawn the shutdown thread")?;
    match done_rx.recv_timeout(bound) {
        Ok(()) => {
            let _ = shutdown.join();
            Ok(ExitCode::SUCCESS)
        }
        Err(_) => {
            tracing::error!(
                bound_s = bound.as_secs_f64(),
                "shutdown did not finish within the bound (a request is still running): exiting anyway; the VMs end with this process and their records are reconciled at the next start"
            );
            // The accept thread has stopped (it never waits on a client), so
            // the socket can go; the server removes it too when it gets there.
            let _ = std::fs::remove_file(&socket_path);
            Ok(ExitCode::FAILURE)
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[allow(clippy::too_many_arguments)]
fn run_foreground(
    guest: &GuestArgs,
    timeout: Option<f64>,
    serial_log: Option<PathBuf>,
    quiet: bool,
    json_out: bool,
    process_start: Instant,
    node: NodeConfig,
    kernel_cache: Option<PathBuf>,
) -> Result<ExitCode> {
    let id = format!("run-{}", std::process::id());
    let console = !quiet && !json_out;
    let config = guest.config(Some(id.clone()), console)?;
    config.validate()?;
    // With --json the serial output goes into the JSON, through a temp log.
    let tmp_log = (json_out && serial_log.is_none()).then(|| std::env::temp_dir().join(format!("k7d-{id}.serial")));
    let log = serial_log.clone().or_else(|| tmp_log.clone());
    let mut vm = Vm::new(
        &id,
        &config,
        &VmOptions {
            serial_log: log.clone(),
            node,
            kernel_cache,
            files: Default::default(),
        },
    )?;
    let built = vm.created_at().elapsed();
    // How the kernel went in: unpacked ELF (docs/linux-boot.md) or bzImage.
    if let Some((step, took)) = vm.build_steps().iter().find(|(s, _)| s.starts_with("Linux loaded")) {
        eprintln!("k7d: {step}: {:.1} ms", ms(*took));
    }
    // The effective data plane of each NIC, settled once at build.
    for (i, d) in vm.devices().iter().filter(|d| d.kind == "virtio-net").enumerate() {
        let line = d.detail.split("; MSI-X").next().unwrap_or(&d.detail);
        eprintln!("k7d: nic {i}: {line}");
    }
    vm.start()?;
    let started = vm.started_at().unwrap_or_else(Instant::now);
    let deadline = timeout.map(|t| started + Duration::from_secs_f64(t.max(0.0)));
    let mut timed_out = false;
    let reason = loop {
        if let Some(r) = vm.wait(Duration::from_millis(50)) {
            break r;
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            break vm.stop();
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            timed_out = true;
            break vm.stop();
        }
    };
    let ran = started.elapsed();
    let first_exit = vm.control().first_exit().map(|f| f.saturating_duration_since(started));
    let exits = vm.control().exit_count();
    drop(vm);
    let serial = tmp_log.as_ref().and_then(|p| {
        let s = std::fs::read_to_string(p).ok();
        let _ = std::fs::remove_file(p);
        s
    });
    if json_out {
        out!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "ok": reason.is_clean() && !timed_out,
                "id": id,
                "guest": config.guest.describe(),
                "status": format!("stopped ({reason})"),
                "reason": reason,
                "timed_out": timed_out,
                "build_ms": ms(built),
                "process_start_to_guest_start_ms": ms(started.duration_since(process_start)),
                "process_start_to_first_exit_ms": first_exit.map(|f| ms(started.duration_since(process_start) + f)),
                "first_exit_after_start_ms": first_exit.map(ms),
                "ran_ms": ms(ran),
                "exits": exits,
                "serial": serial,
            }))?
        );
    } else {
        eprintln!(
            "k7d: vm {id} ({}, {} vCPU, {} MiB) stopped ({reason}){}: built in {:.2} ms, vCPUs started {:.2} ms after k7d's start, first guest exit {} after start, {} exits, ran {:.1} ms",
            config.guest.describe(),
            config.vcpus,
            config.memory_mib,
            if timed_out { " after the timeout" } else { "" },
            ms(built),
            ms(started.duration_since(process_start)),
            first_exit
                .map(|f| format!("{:.3} ms", ms(f)))
                .unwrap_or_else(|| "never".into()),
            exits,
            ms(ran),
        );
    }
    Ok(match (&reason, timed_out) {
        (_, true) => ExitCode::from(2),
        (r, false) if r.is_clean() => ExitCode::SUCCESS,
        (StopReason::VcpuError { .. } | StopReason::SeccompDenied { .. }, _) | (_, false) => ExitCode::FAILURE,
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::path::PathBuf;

    use super::default_kernel_cache;

    #[test]
    fn the_default_kernel_cache_is_the_nodes_for_root_and_the_users_own_otherwise() {
        let home = Some(OsStr::new("/home/ann"));
        assert_eq!(
            default_kernel_cache(0, None, home),
            Some(PathBuf::from("/var/cache/k7d/kernels"))
        );
        assert_eq!(
            default_kernel_cache(1000, Some(OsStr::new("/xdg")), home),
            Some(PathBuf::from("/xdg/k7d/kernels"))
        );
        assert_eq!(
            default_kernel_cache(1000, None, home),
            Some(PathBuf::from("/home/ann/.cache/k7d/kernels"))
        );
        // A relative XDG_CACHE_HOME is ignored, as the XDG spec says.
        assert_eq!(
            default_kernel_cache(1000, Some(OsStr::new("rel")), home),
            Some(PathBuf::from("/home/ann/.cache/k7d/kernels"))
        );
        assert_eq!(default_kernel_cache(1000, None, None), None);
        assert_eq!(default_kernel_cache(1000, None, Some(OsStr::new("rel"))), None);
    }
}

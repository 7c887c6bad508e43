//! What a node's monitoring scrapes (issue 39, `docs/observability.md`):
//! the daemon's Prometheus families, in the text exposition format that
//! `prometheus-client` writes.
//!
//! Two kinds of families:
//! - **events**, counted as they happen ([`Metrics::observe`], called once
//!   per API request with its outcome): requests by op and result code, their
//!   latency, forks by kind with their durations and standstills, children
//!   made;
//! - **state**, read at each scrape ([`Daemon::render_metrics`]): VMs by
//!   state, one small set of series per VM (gone with the VM), shells and
//!   VM processes made ahead, the datapath's drop counters.
//!
//! Labels stay bounded: ops, codes, fork kinds and states are fixed sets;
//! the only open label is the VM id, and a deleted VM's series go with it.
//! A scrape never waits on a VM busy with a request (a fork, a snapshot):
//! such a VM is read from its record, without its live counters.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use super::api::{ApiError, ErrorCode, Reply};
use super::{Daemon, Slot};
use crate::vstate::vm::VmState;

/// The `Content-Type` of a scrape's answer.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Latency buckets (seconds): 0.5 ms to about 16 s, doubling.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0005, 2.0, 16)
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    op: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ForkLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    api_version: String,
    vm_processes: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmLabels {
    vm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NetLabels {
    vm: String,
    device: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    vm: String,
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ThreadLabels {
    thread: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StopLabels {
    vm: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExitLabels {
    vm: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmStateLabels {
    vm: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmInfoLabels {
    vm: String,
    parent: String,
    guest: String,
    process: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    vm: String,
    namespace: String,
    name: String,
    uid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    vm: String,
    reason: &'static str,
    direction: &'static str,
}

/// A fork request's kind, as its label says.
fn fork_kind(cluster: bool, count: u32) -> &'static str {
    match (cluster, count > 1) {
        (false, false) => "single",
        (false, true) => "batch",
        (true, false) => "cluster",
        (true, true) => "cluster_batch",
    }
}

/// An error code as its label says (the wire's snake case).
fn code_label(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::BadRequest => "bad_request",
        ErrorCode::UnsupportedVersion => "unsupported_version",
        ErrorCode::InvalidArgument => "invalid_argument",
        ErrorCode::NotFound => "not_found",
        ErrorCode::Conflict => "conflict",
        ErrorCode::Internal => "internal",
        ErrorCode::Busy => "busy",
        ErrorCode::PermissionDenied => "permission_denied",
    }
}

/// A VM state as its label says (a stop's reason is the VM's `info`'s).
fn state_label(s: &VmState) -> &'static str {
    match s {
        VmState::Created => "created",
        VmState::Running => "running",
        VmState::Paused => "paused",
        VmState::Stopped { .. } => "stopped",
    }
}

/// The warm pool a VM belongs to: the `<hex>` of a containerd shim's pool
/// member id, `pool-<16 hex>-<n>` (`shim/src/pool.rs`); none for others.
fn pool_of(id: &str) -> Option<&str> {
    let (hex, n) = id.strip_prefix("pool-")?.split_once('-')?;
    (hex.len() == 16
        && hex.bytes().all(|b| b.is_ascii_hexdigit())
        && !n.is_empty()
        && n.len() <= 20
        && n.bytes().all(|b| b.is_ascii_digit()))
    .then_some(hex)
}

/// A pool member's state: `claimed` once a pod's NIC is attached to it,
/// else `ready` while paused (the shim pauses a member once its agent
/// answered), `booting` while it runs, `stopped`.
fn pool_state(state: &'static str, has_pod: bool) -> &'static str {
    match (has_pod, state) {
        (true, _) => "claimed",
        (false, "paused") => "ready",
        (false, "stopped") => "stopped",
        (false, _) => "booting",
    }
}

/// Why a stopped VM stopped (its reason's kind); none while it is not.
fn stop_kind(s: &VmState) -> Option<&'static str> {
    match s {
        VmState::Stopped { reason } => Some(reason.kind()),
        _ => None,
    }
}

/// Every state a VM can be in, so each has a series even at zero.
const STATES: [&str; 4] = ["created", "running", "paused", "stopped"];

/// The families counted as things happen.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Family<OpLabels, Histogram, fn() -> Histogram>,
    forks: Family<ForkLabels, Histogram, fn() -> Histogram>,
    fork_paused: Family<ForkLabels, Histogram, fn() -> Histogram>,
    fork_children: Family<ForkLabels, Counter>,
    child_build: Histogram,
    connections: Gauge<i64, AtomicI64>,
    scrapes: Counter,
    last_scrape: Gauge<f64, AtomicU64>,
}

impl Metrics {
    /// The families, registered; `vm_processes`: whether VMs run in VM
    /// processes of their own (`--jail on`), said by the build info.
    pub fn new(vm_processes: bool) -> Self {
        let mut registry = Registry::with_prefix("k7d");
        registry.register(
            "build",
            "This k7d: its version, API version and where its VMs run (always 1).",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                api_version: super::api::API_VERSION.to_string(),
                vm_processes: if vm_processes { "on" } else { "off" },
            }),
        );
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "api_requests",
            "API requests answered, by op and result code (ok or the error's code).",
            requests.clone(),
        );
        let latency = Family::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "api_request_duration",
            "How long the daemon took to answer an API request, by op.",
            Unit::Seconds,
            latency.clone(),
        );
        let forks = Family::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "fork_duration",
            "How long a fork request that succeeded took, by kind (single, batch, cluster, cluster_batch): one observation per request.",
            Unit::Seconds,
            forks.clone(),
        );
        let fork_paused = Family::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "fork_source_paused",
            "How long a fork's source (every member, for a cluster) stood still, by kind.",
            Unit::Seconds,
            fork_paused.clone(),
        );
        let fork_children = Family::<ForkLabels, Counter>::default();
        registry.register(
            "fork_children",
            "Fork children made, by the kind of the fork that made them.",
            fork_children.clone(),
        );
        let child_build = latency_histogram();
        registry.register_with_unit(
            "fork_child_build",
            "How long building one fork child took.",
            Unit::Seconds,
            child_build.clone(),
        );
        let connections = Gauge::<i64, AtomicI64>::default();
        registry.register("api_connections", "API connections open now.", connections.clone());
        let scrapes = Counter::default();
        registry.register("metrics_scrapes", "Scrapes of this endpoint answered.", scrapes.clone());
        let last_scrape = Gauge::<f64, AtomicU64>::default();
        registry.register_with_unit(
            "metrics_scrape_duration",
            "How long the previous scrape took to render.",
            Unit::Seconds,
            last_scrape.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            forks,
            fork_paused,
            fork_children,
            child_build,
            connections,
            scrapes,
            last_scrape,
        }
    }

    /// Counts a request that could not be parsed (no op known).
    pub fn observe_unparsed(&self, took: Duration) {
        self.requests
            .get_or_create(&RequestLabels {
                op: "unparsed",
                code: "bad_request",
            })
            .inc();
        self.latency
            .get_or_create(&OpLabels { op: "unparsed" })
            .observe(took.as_secs_f64());
    }

    /// Counts one answered request: `op`, the fork's `count` and whether
    /// its source was a cluster (forks only), and its outcome.
    pub fn observe(&self, op: &'static str, fork: Option<(bool, u32)>, took: Duration, res: &Result<Reply, ApiError>) {
        let code = match res {
            Ok(_) => "ok",
            Err(e) => code_label(e.code),
        };
        self.requests.get_or_create(&RequestLabels { op, code }).inc();
        self.latency.get_or_create(&OpLabels { op }).observe(took.as_secs_f64());
        if let (Some((cluster, count)), Ok(Reply::Forked(f))) = (fork, res) {
            let kind = ForkLabels {
                kind: fork_kind(cluster || !f.clusters.is_empty(), count),
            };
            self.forks.get_or_create(&kind).observe(took.as_secs_f64());
            self.fork_paused
                .get_or_create(&kind)
                .observe(f.source_paused_ms / 1000.0);
            self.fork_children.get_or_create(&kind).inc_by(f.children.len() as u64);
            for c in &f.children {
                self.child_build.observe(c.fork_ms / 1000.0);
            }
        }
    }

    /// One more API connection open; the guard counts it closed.
    pub fn connection(self: &Arc<Self>) -> ConnectionGuard {
        self.connections.inc();
        ConnectionGuard(self.clone())
    }
}

/// Counts an API connection while it lives.
pub struct ConnectionGuard(Arc<Metrics>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.dec();
    }
}

/// Where a VM runs, as the daemon's map holds it.
enum Held {
    /// In this process.
    Here(Arc<std::sync::Mutex<crate::vstate::vm::Vm>>),
    /// In a VM process of its own.
    Process(Arc<std::sync::Mutex<super::processes::Remote>>),
}

/// One VM as a scrape sees it.
struct VmSample {
    id: String,
    state: &'static str,
    /// Why it stopped, once it has.
    stop: Option<&'static str>,
    vcpus: u8,
    memory_mib: u64,
    /// Live counters; `None` while the VM is busy with a request.
    exits: Option<u64>,
    /// vCPU exits by kind (empty: a VM process of an earlier k7d).
    exits_by_reason: Vec<(String, u64)>,
    /// Its devices' counters (`Vm::device_counters`).
    device_counters: Vec<(String, Vec<(String, u64)>)>,
    rebases: Option<u64>,
    parent: Option<String>,
    guest: String,
    /// Its VM process (`--jail on`).
    pid: Option<u32>,
    /// Its VM process's RSS and PSS (bytes).
    mem: Option<(u64, u64)>,
    datapath: bool,
    /// The pod it serves: (namespace, name, uid), from its NICs' attachment.
    pod: Option<(String, String, String)>,
}

/// The pod a VM serves, as the shim named it when it attached the VM's NIC
/// to the pod's network (`DatapathNicConfig`); none for a VM with no pod NIC.
fn pod_of(c: &crate::config::VmConfig) -> Option<(String, String, String)> {
    c.devices.nics.iter().filter_map(|n| n.datapath.as_ref()).find_map(|d| {
        (d.pod_uid.is_some() || d.pod_name.is_some()).then(|| {
            (
                d.pod_namespace.clone().unwrap_or_default(),
                d.pod_name.clone().unwrap_or_default(),
                d.pod_uid.clone().unwrap_or_default(),
            )
        })
    })
}

/// A scrape samples VMs in up to this many threads ...
const SAMPLE_THREADS: usize = 4;
/// ... one per this many VMs.
const SAMPLES_PER_THREAD: usize = 16;

/// `Rss` and `Pss` of `/proc/<pid>/smaps_rollup`, in bytes.
fn rss_pss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("Rss:")?, field("Pss:")?))
}

impl Daemon {
    /// The metrics counted as things happen (the API server counts its
    /// connections there).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn vm_samples(&self, parents: &std::collections::HashMap<String, super::Parent>) -> Vec<VmSample> {
        let slots: Vec<(String, Held)> = self
            .vms()
            .iter()
            .filter_map(|(id, s)| match s {
                Slot::Vm(v) => Some((id.clone(), Held::Here(v.clone()))),
                Slot::Process(r) => Some((id.clone(), Held::Process(r.clone()))),
                Slot::Reserved | Slot::Deleting => None,
            })
            .collect();
        // In a few threads: a VM process's sample is a round trip on its
        // channel and a read of its smaps_rollup, mostly waiting.
        let threads = slots.len().div_ceil(SAMPLES_PER_THREAD).clamp(1, SAMPLE_THREADS);
        let mut out: Vec<VmSample> = std::thread::scope(|scope| {
            let slots = &slots;
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        slots
                            .iter()
                            .skip(t)
                            .step_by(threads)
                            .filter_map(|(id, slot)| self.sample(id, slot, parents))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
        });
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// One VM's sample, with its VM process's memory (none: it went away).
    fn sample(
        &self,
        id: &str,
        slot: &Held,
        parents: &std::collections::HashMap<String, super::Parent>,
    ) -> Option<VmSample> {
        let id = id.to_string();
        let parent = parents.get(&id).filter(|p| !p.deleted).map(|p| p.id.clone());
        let mut sample = match slot {
            Held::Here(vm) => match vm.try_lock() {
                Ok(g) => VmSample {
                    state: state_label(&g.state()),
                    stop: stop_kind(&g.state()),
                    vcpus: g.config().vcpus,
                    memory_mib: g.config().memory_mib,
                    exits: Some(u64::from(g.control().exit_count())),
                    exits_by_reason: g.exits_by_reason(),
                    device_counters: g.device_counters(),
                    rebases: Some(g.rebases()),
                    guest: g.config().guest.describe(),
                    pid: None,
                    mem: None,
                    datapath: g.config().devices.nics.iter().any(|n| n.datapath.is_some()),
                    pod: pod_of(g.config()),
                    parent,
                    id,
                },
                Err(_) => self.sample_from_record(id, parent)?,
            },
            Held::Process(r) => match r.try_lock() {
                Ok(mut g) => {
                    let status = g.status();
                    let c = g.config();
                    VmSample {
                        state: state_label(&status.state),
                        stop: stop_kind(&status.state),
                        vcpus: c.vcpus,
                        memory_mib: c.memory_mib,
                        exits: Some(u64::from(status.exits)),
                        exits_by_reason: status.exits_by_reason.clone(),
                        device_counters: status.device_counters.clone(),
                        rebases: Some(status.rebases),
                        guest: c.guest.describe(),
                        datapath: c.devices.nics.iter().any(|n| n.datapath.is_some()),
                        pod: pod_of(c),
                        pid: (!matches!(status.state, VmState::Stopped { .. })).then(|| g.record().pid),
                        mem: None,
                        parent,
                        id,
                    }
                }
                Err(_) => self.sample_from_record(id, parent)?,
            },
        };
        sample.mem = sample.pid.and_then(rss_pss);
        Some(sample)
    }

    /// A VM busy with a request, as its record says (no live counters).
    fn sample_from_record(&self, id: String, parent: Option<String>) -> Option<VmSample> {
        let rec = self.store.load(&id).ok().flatten()?;
        Some(VmSample {
            state: state_label(&rec.state),
            stop: stop_kind(&rec.state),
            vcpus: rec.config.vcpus,
            memory_mib: rec.config.memory_mib,
            exits: None,
            exits_by_reason: Vec::new(),
            device_counters: Vec::new(),
            rebases: None,
            guest: rec.config.guest.describe(),
            pid: rec.vm_process.as_ref().map(|p| p.pid),
            mem: None,
            datapath: rec.config.devices.nics.iter().any(|n| n.datapath.is_some()),
            pod: pod_of(&rec.config),
            parent,
            id,
        })
    }

    /// One scrape: the counted families, then the node's state now.
    pub fn render_metrics(&self) -> String {
        let t = Instant::now();
        let m = &self.metrics;
        m.scrapes.inc();
        let mut state = Registry::with_prefix("k7d");
        let vms = Family::<StateLabels, Gauge>::default();
        state.register("vms", "VMs this daemon serves, by state.", vms.clone());
        let vm_state = Family::<VmStateLabels, Gauge>::default();
        state.register("vm_state", "A VM's state: 1 for the state it is in.", vm_state.clone());
        let vm_info = Family::<VmInfoLabels, Gauge>::default();
        state.register(
            "vm_info",
            "A VM's fork parent (empty: none alive), guest and whether it runs in a VM process of its own (always 1).",
            vm_info.clone(),
        );
        let net_bytes = Family::<NetLabels, Counter>::default();
        state.register_with_unit(
            "vm_net",
            "Bytes a VM's virtio-net NIC moved, from the guest's side (rx: delivered to it, tx: sent by it; virtio-net header included); userspace data plane only (vhost-net NICs have none).",
            Unit::Bytes,
            net_bytes.clone(),
        );
        let net_frames = Family::<NetLabels, Counter>::default();
        state.register(
            "vm_net_frames",
            "Frames a VM's virtio-net NIC moved, from the guest's side (userspace data plane only).",
            net_frames.clone(),
        );
        let net_dropped = Family::<NetLabels, Counter>::default();
        state.register(
            "vm_net_dropped",
            "Frames a VM's virtio-net NIC dropped (rx: too big for the guest's buffer or runt; tx: malformed or refused by the tap).",
            net_dropped.clone(),
        );
        let interrupts = Family::<DeviceLabels, Counter>::default();
        state.register(
            "vm_device_interrupts",
            "Interrupts a VM's virtio device raised for its queues (userspace data planes).",
            interrupts.clone(),
        );
        let pools = Family::<PoolLabels, Gauge>::default();
        state.register(
            "pool_members",
            "Warm pool members (the containerd shim's pool-<pool>-<n> VMs) by pool and state: ready (paused, unclaimed), claimed (a pod's NIC attached), booting, stopped.",
            pools.clone(),
        );
        let stop_reason = Family::<StopLabels, Gauge>::default();
        state.register(
            "vm_stop_reason",
            "Why a stopped VM stopped (requested, guest_poweroff, guest_reset, vcpu_error, seccomp_denied, process_ended): always 1.",
            stop_reason.clone(),
        );
        let denials = Family::<ThreadLabels, Counter>::default();
        state.register(
            "seccomp_denials",
            "System calls the daemon process's seccomp filters denied, by thread kind (each stops the VM whose thread made it; a VM process's own show as its k7d_vm_stop_reason seccomp_denied).",
            denials.clone(),
        );
        for (thread, n) in crate::seccomp::denials() {
            denials.get_or_create(&ThreadLabels { thread }).inc_by(n);
        }
        let pod_info = Family::<PodLabels, Gauge>::default();
        state.register(
            "vm_pod_info",
            "The Kubernetes pod a VM serves (namespace, name, uid, as its containerd shim attached it to the pod's network): always 1; join on vm.",
            pod_info.clone(),
        );
        let vcpus = Family::<VmLabels, Gauge>::default();
        state.register("vm_vcpus", "A VM's vCPUs.", vcpus.clone());
        let ram = Family::<VmLabels, Gauge>::default();
        state.register_with_unit("vm_guest_memory", "A VM's guest RAM.", Unit::Bytes, ram.clone());
        let exits = Family::<ExitLabels, Counter>::default();
        state.register(
            "vm_exits",
            "A VM's vCPU exits to the VMM since it started, all vCPUs, by reason (io_in, io_out, mmio_read, mmio_write, hlt, intr, eintr, ...; unknown: a VM process of an earlier k7d, its total).",
            exits.clone(),
        );
        let rebases = Family::<VmLabels, Counter>::default();
        state.register(
            "vm_rebases",
            "Times a fork source was given a new base.",
            rebases.clone(),
        );
        let children = Family::<VmLabels, Gauge>::default();
        state.register("vm_fork_children", "A fork source's live children.", children.clone());
        let rss = Family::<VmLabels, Gauge>::default();
        state.register_with_unit(
            "vm_process_resident_memory",
            "Resident memory of a VM's process (--jail on), guest RAM it touched included.",
            Unit::Bytes,
            rss.clone(),
        );
        let pss = Family::<VmLabels, Gauge>::default();
        state.register_with_unit(
            "vm_process_pss",
            "Proportional set size of a VM's process (--jail on): pages shared with its fork relatives counted in part.",
            Unit::Bytes,
            pss.clone(),
        );
        let drops = Family::<DropLabels, Counter>::default();
        state.register(
            "datapath_drops",
            "Packets the direct datapath dropped for a VM's NICs, by reason and direction.",
            drops.clone(),
        );
        let shells = Gauge::<i64, AtomicI64>::default();
        state.register(
            "fork_shells_ready",
            "Shells made ahead for fork children, ready now.",
            shells.clone(),
        );
        shells.set(self.shells_ready() as i64);
        if let Some(p) = &self.processes {
            let spares = Gauge::<i64, AtomicI64>::default();
            state.register(
                "vm_process_spares_ready",
                "VM processes started and jailed ahead, waiting for a VM.",
                spares.clone(),
            );
            spares.set(p.spares_ready() as i64);
        }
        // The snapshot tree once, for parents and children alike.
        let tree = self.parents().clone();
        let samples = self.vm_samples(&tree);
        for s in STATES {
            vms.get_or_create(&StateLabels { state: s }).set(0);
        }
        let datapath = samples
            .iter()
            .any(|s| s.datapath)
            .then(|| self.open_datapath())
            .flatten();
        for s in &samples {
            vms.get_or_create(&StateLabels { state: s.state }).inc();
            let vm = VmLabels { vm: s.id.clone() };
            vm_state
                .get_or_create(&VmStateLabels {
                    vm: s.id.clone(),
                    state: s.state,
                })
                .set(1);
            vm_info
                .get_or_create(&VmInfoLabels {
                    vm: s.id.clone(),
                    parent: s.parent.clone().unwrap_or_default(),
                    guest: s.guest.clone(),
                    process: if s.pid.is_some() || self.process(&s.id).is_some() {
                        "yes"
                    } else {
                        "no"
                    },
                })
                .set(1);
            for (device, counters) in &s.device_counters {
                for (name, n) in counters {
                    let (family, direction) = match name.as_str() {
                        "rx_bytes" => (&net_bytes, "rx"),
                        "tx_bytes" => (&net_bytes, "tx"),
                        "rx_frames" => (&net_frames, "rx"),
                        "tx_frames" => (&net_frames, "tx"),
                        "rx_dropped" => (&net_dropped, "rx"),
                        "tx_dropped" => (&net_dropped, "tx"),
                        "interrupts" => {
                            interrupts
                                .get_or_create(&DeviceLabels {
                                    vm: s.id.clone(),
                                    device: device.clone(),
                                })
                                .inc_by(*n);
                            continue;
                        }
                        _ => continue,
                    };
                    family
                        .get_or_create(&NetLabels {
                            vm: s.id.clone(),
                            device: device.clone(),
                            direction,
                        })
                        .inc_by(*n);
                }
            }
            if let Some(pool) = pool_of(&s.id) {
                pools
                    .get_or_create(&PoolLabels {
                        pool: pool.to_string(),
                        state: pool_state(s.state, s.pod.is_some()),
                    })
                    .inc();
            }
            if let Some(reason) = s.stop {
                stop_reason
                    .get_or_create(&StopLabels {
                        vm: s.id.clone(),
                        reason,
                    })
                    .set(1);
            }
            if let Some((namespace, name, uid)) = &s.pod {
                pod_info
                    .get_or_create(&PodLabels {
                        vm: s.id.clone(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                        uid: uid.clone(),
                    })
                    .set(1);
            }
            vcpus.get_or_create(&vm).set(i64::from(s.vcpus));
            ram.get_or_create(&vm)
                .set(i64::try_from(s.memory_mib.saturating_mul(1 << 20)).unwrap_or(i64::MAX));
            match (s.exits, s.exits_by_reason.is_empty()) {
                (_, false) => {
                    for (reason, n) in &s.exits_by_reason {
                        exits
                            .get_or_create(&ExitLabels {
                                vm: s.id.clone(),
                                reason: reason.clone(),
                            })
                            .inc_by(*n);
                    }
                }
                (Some(n), true) if n > 0 => {
                    exits
                        .get_or_create(&ExitLabels {
                            vm: s.id.clone(),
                            reason: "unknown".into(),
                        })
                        .inc_by(n);
                }
                _ => {}
            }
            if let Some(n) = s.rebases {
                rebases.get_or_create(&vm).inc_by(n);
            }
            let kids = super::children_in(&tree, &s.id).len();
            children.get_or_create(&vm).set(kids as i64);
            if let Some((r, p)) = s.mem {
                rss.get_or_create(&vm).set(i64::try_from(r).unwrap_or(i64::MAX));
                pss.get_or_create(&vm).set(i64::try_from(p).unwrap_or(i64::MAX));
            }
            if let (true, Some(dp)) = (s.datapath, datapath.as_ref()) {
                match dp.drops(&s.id) {
                    Ok(counts) => {
                        for c in counts {
                            drops
                                .get_or_create(&DropLabels {
                                    vm: s.id.clone(),
                                    reason: c.reason.name(),
                                    direction: match c.direction {
                                        k7d_net::Direction::Egress => "egress",
                                        k7d_net::Direction::Ingress => "ingress",
                                    },
                                })
                                .inc_by(c.packets);
                        }
                    }
                    Err(e) => tracing::debug!(vm = %s.id, error = %e, "no drop counters for the scrape"),
                }
            }
        }
        let mut out = String::new();
        let wrote =
            prometheus_text::encode(&mut out, &m.registry).and_then(|()| prometheus_text::encode(&mut out, &state));
        if let Err(e) = wrote {
            tracing::error!(error = %e, "cannot encode the metrics");
            out.clear();
            let _ = writeln!(out, "# k7d: the metrics could not be encoded");
        }
        m.last_scrape.set(t.elapsed().as_secs_f64());
        out
    }

    /// The node's direct datapath, to read drop counters (none: no scrape
    /// of them).
    fn open_datapath(&self) -> Option<k7d_net::Datapath> {
        match k7d_net::Datapath::new(self.node.datapath()) {
            Ok(dp) => Some(dp),
            Err(e) => {
                tracing::debug!(error = %e, "no datapath to read drop counters from");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_members_are_known_by_the_shims_ids_and_their_state() {
        assert_eq!(pool_of("pool-0123456789abcdef-7"), Some("0123456789abcdef"));
        for not in [
            "pool-0123456789abcdef-",
            "pool-0123456789abcdeg-1",
            "pool-0123456789abcde-1",
            "pool-0123456789abcdef-1x",
            "pod-0123456789abcdef",
            "pool-0123456789abcdef",
            "web",
        ] {
            assert_eq!(pool_of(not), None, "{not}");
        }
        assert_eq!(pool_state("paused", false), "ready");
        assert_eq!(pool_state("running", false), "booting");
        assert_eq!(pool_state("created", false), "booting");
        assert_eq!(pool_state("running", true), "claimed");
        assert_eq!(pool_state("paused", true), "claimed");
        assert_eq!(pool_state("stopped", false), "stopped");
    }

    #[test]
    fn a_vm_serves_the_pod_its_pod_nic_names() {
        use crate::config::{DatapathNicConfig, NicConfig, VmConfig};
        let mut c = VmConfig::default();
        assert_eq!(pod_of(&c), None);
        c.devices.nics.push(NicConfig::default());
        assert_eq!(pod_of(&c), None, "a bare tap serves no pod");
        let dp = DatapathNicConfig {
            mode: "direct".into(),
            netns: "/run/netns/p".into(),
            pod_if: "eth0".into(),
            pod_uid: None,
            pod_namespace: Some("ns".into()),
            pod_name: None,
        };
        c.devices.nics.push(NicConfig {
            datapath: Some(dp.clone()),
            ..Default::default()
        });
        assert_eq!(pod_of(&c), None, "a namespace alone names no pod");
        c.devices.nics[1].datapath = Some(DatapathNicConfig {
            pod_uid: Some("u-1".into()),
            pod_name: Some("web".into()),
            ..dp
        });
        assert_eq!(pod_of(&c), Some(("ns".into(), "web".into(), "u-1".into())));
    }

    #[test]
    fn fork_kinds_and_codes_are_the_documented_labels() {
        assert_eq!(fork_kind(false, 1), "single");
        assert_eq!(fork_kind(false, 8), "batch");
        assert_eq!(fork_kind(true, 1), "cluster");
        assert_eq!(fork_kind(true, 2), "cluster_batch");
        // Every code's label is its wire name.
        for code in [
            ErrorCode::BadRequest,
            ErrorCode::UnsupportedVersion,
            ErrorCode::InvalidArgument,
            ErrorCode::NotFound,
            ErrorCode::Conflict,
            ErrorCode::Internal,
            ErrorCode::Busy,
            ErrorCode::PermissionDenied,
        ] {
            let wire = serde_json::to_string(&code).unwrap();
            assert_eq!(wire.trim_matches('"'), code_label(code));
        }
    }

    #[test]
    fn requests_are_counted_by_op_and_code_with_their_latency() {
        let m = Metrics::new(false);
        let err = ApiError::new(ErrorCode::NotFound, "vm x does not exist");
        m.observe("info", None, Duration::from_millis(2), &Err(err));
        m.observe(
            "list",
            None,
            Duration::from_millis(1),
            &Ok(Reply::List(super::super::api::VmList { vms: vec![] })),
        );
        m.observe_unparsed(Duration::from_micros(10));
        let mut text = String::new();
        prometheus_text::encode(&mut text, &m.registry).unwrap();
        assert!(
            text.contains("k7d_api_requests_total{op=\"info\",code=\"not_found\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("k7d_api_requests_total{op=\"list\",code=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("k7d_api_requests_total{op=\"unparsed\",code=\"bad_request\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("k7d_api_request_duration_seconds_count{op=\"info\"} 1"),
            "{text}"
        );
        assert!(text.contains("k7d_build_info{"), "{text}");
    }

    #[test]
    fn smaps_rollup_of_this_process_parses() {
        let (rss, pss) = rss_pss(std::process::id()).expect("this process's smaps_rollup");
        assert!(rss > 0 && pss > 0 && pss <= rss, "rss {rss} pss {pss}");
    }
}

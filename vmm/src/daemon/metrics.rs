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

use super::Daemon;
use super::api::{ApiError, ErrorCode, Reply};
use super::vm_samples::{pool_of, pool_state};

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
struct BlkLabels {
    vm: String,
    device: String,
    op: &'static str,
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
struct FallbackLabels {
    reason: &'static str,
}

/// A shell's shape: its vCPUs and guest RAM in bytes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShapeLabels {
    vcpus: u8,
    memory_bytes: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    vm: String,
    direction: &'static str,
}

fn direction_label(d: k7d_net::Direction) -> &'static str {
    match d {
        k7d_net::Direction::Egress => "egress",
        k7d_net::Direction::Ingress => "ingress",
    }
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

impl Daemon {
    /// The metrics counted as things happen (the API server counts its
    /// connections there).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
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
        let blk_requests = Family::<BlkLabels, Counter>::default();
        state.register(
            "vm_blk_requests",
            "Requests a VM's virtio-blk drive answered OK, by op (read, write, flush).",
            blk_requests.clone(),
        );
        let blk_bytes = Family::<BlkLabels, Counter>::default();
        state.register_with_unit(
            "vm_blk",
            "Bytes a VM's virtio-blk drive read for the guest or wrote for it, by op (read, write).",
            Unit::Bytes,
            blk_bytes.clone(),
        );
        let blk_failed = Family::<DeviceLabels, Counter>::default();
        state.register(
            "vm_blk_failed_requests",
            "Requests a VM's virtio-blk drive answered with an error or could not answer (malformed).",
            blk_failed.clone(),
        );
        let interrupts = Family::<DeviceLabels, Counter>::default();
        state.register(
            "vm_device_interrupts",
            "Interrupts a VM's virtio device raised for its queues (userspace data planes).",
            interrupts.clone(),
        );
        let notifications = Family::<DeviceLabels, Counter>::default();
        state.register(
            "vm_device_notifications",
            "Queue notifications (kicks) a VM's guest gave its virtio device, all queues (userspace data planes: none counted with vhost-net).",
            notifications.clone(),
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
        let ram_resident = Family::<VmLabels, Gauge>::default();
        state.register_with_unit(
            "vm_guest_ram_resident",
            "Guest RAM pages present in a VM's process (--jail on): its guest's populated memory, its fork base's pages it reads included.",
            Unit::Bytes,
            ram_resident.clone(),
        );
        let ram_copied = Family::<VmLabels, Gauge>::default();
        state.register_with_unit(
            "vm_guest_ram_copied",
            "Of a VM's resident guest RAM, its own copies (--jail on): pages its guest wrote since its fork (a child) or since its base was frozen (a source); 0 for a VM never forked.",
            Unit::Bytes,
            ram_copied.clone(),
        );
        let drops = Family::<DropLabels, Counter>::default();
        state.register(
            "datapath_drops",
            "Packets the direct datapath dropped for a VM's NICs, by reason and direction.",
            drops.clone(),
        );
        let fwd_packets = Family::<DirectionLabels, Counter>::default();
        state.register(
            "datapath_forwarded_packets",
            "Frames the direct datapath passed on for a VM's NICs, by direction (egress: from the guest).",
            fwd_packets.clone(),
        );
        let fwd_bytes = Family::<DirectionLabels, Counter>::default();
        state.register_with_unit(
            "datapath_forwarded",
            "Bytes of the frames the direct datapath passed on for a VM's NICs (Ethernet headers included), by direction.",
            Unit::Bytes,
            fwd_bytes.clone(),
        );
        let fallbacks = Family::<FallbackLabels, Counter>::default();
        state.register(
            "datapath_fallbacks",
            "NICs this daemon put on the bridge chain because auto could not go direct, by reason.",
            fallbacks.clone(),
        );
        for (r, n) in k7d_net::fallbacks() {
            fallbacks.get_or_create(&FallbackLabels { reason: r.name() }).inc_by(n);
        }
        let shells = Family::<ShapeLabels, Gauge>::default();
        state.register(
            "fork_shells_ready",
            "Shells made ahead for fork children (--jail off), ready now, by shape (only shapes with one).",
            shells.clone(),
        );
        for (shape, n) in self.shells_ready_by_shape() {
            shells
                .get_or_create(&ShapeLabels {
                    vcpus: shape.vcpus,
                    memory_bytes: shape.ram,
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
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
                        "read_requests" | "write_requests" | "flush_requests" | "read_bytes" | "write_bytes" => {
                            let (family, op) = match name.as_str() {
                                "read_requests" => (&blk_requests, "read"),
                                "write_requests" => (&blk_requests, "write"),
                                "flush_requests" => (&blk_requests, "flush"),
                                "read_bytes" => (&blk_bytes, "read"),
                                _ => (&blk_bytes, "write"),
                            };
                            family
                                .get_or_create(&BlkLabels {
                                    vm: s.id.clone(),
                                    device: device.clone(),
                                    op,
                                })
                                .inc_by(*n);
                            continue;
                        }
                        "failed_requests" => {
                            blk_failed
                                .get_or_create(&DeviceLabels {
                                    vm: s.id.clone(),
                                    device: device.clone(),
                                })
                                .inc_by(*n);
                            continue;
                        }
                        "notifications" => {
                            notifications
                                .get_or_create(&DeviceLabels {
                                    vm: s.id.clone(),
                                    device: device.clone(),
                                })
                                .inc_by(*n);
                            continue;
                        }
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
            if let Some((resident, copied)) = s.guest_ram {
                ram_resident
                    .get_or_create(&vm)
                    .set(i64::try_from(resident).unwrap_or(i64::MAX));
                ram_copied
                    .get_or_create(&vm)
                    .set(i64::try_from(copied).unwrap_or(i64::MAX));
            }
            if let (true, Some(dp)) = (s.datapath, datapath.as_ref()) {
                match dp.drops(&s.id) {
                    Ok(counts) => {
                        for c in counts {
                            drops
                                .get_or_create(&DropLabels {
                                    vm: s.id.clone(),
                                    reason: c.reason.name(),
                                    direction: direction_label(c.direction),
                                })
                                .inc_by(c.packets);
                        }
                    }
                    Err(e) => tracing::debug!(vm = %s.id, error = %e, "no drop counters for the scrape"),
                }
                match dp.forwarded(&s.id) {
                    Ok(both) => {
                        for f in both {
                            let labels = DirectionLabels {
                                vm: s.id.clone(),
                                direction: direction_label(f.direction),
                            };
                            fwd_packets.get_or_create(&labels).inc_by(f.packets);
                            fwd_bytes.get_or_create(&labels).inc_by(f.bytes);
                        }
                    }
                    Err(e) => tracing::debug!(vm = %s.id, error = %e, "no forwarded counters for the scrape"),
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
}

//! The kubelet's stats calls (`ContainerStats`, `ListContainerStats`,
//! `PodSandboxStats`) and the pod cgroup the kubelet makes for each pod.
//!
//! containerd 1.6 answers a container's stats from its task's metrics (for a
//! k7d pod: the shim's `Stats`, the guest's cgroup v2 through the agent) and
//! a pod's from the node's cgroup at the pod's `cgroup_parent` (refused when
//! there is none) and from `eth0` in the pod's network namespace.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_cri::v1::{
    ContainerStats, ContainerStatsFilter, ContainerStatsRequest, CpuUsage, ListContainerStatsRequest, MemoryUsage,
    PodSandboxStats, PodSandboxStatsRequest,
};

use crate::{Client, exec, rpc};

/// The cgroup v2 root the lab mounts.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Where the pods' cgroups are made (the kubelet's `kubepods`).
const PODS: &str = "k7d-cri";
/// What container B writes into its writable layer: the memory the stats must show.
pub const BALLAST_MIB: u64 = 64;

/// A pod's cgroup on the node, made before `RunPodSandbox` as the kubelet
/// makes one, and removed after `RemovePodSandbox`.
pub struct PodCgroup {
    /// The `cgroup_parent` the pod is given (`/k7d-cri/pod<uid>`).
    pub parent: String,
    dir: PathBuf,
}

impl PodCgroup {
    /// Makes the pod's cgroup; none where the node has no cgroup v2 at
    /// `/sys/fs/cgroup` (containerd then refuses `PodSandboxStats`).
    pub fn make(uid: &str) -> Result<Option<Self>> {
        let root = PathBuf::from(CGROUP_ROOT);
        if !root.join("cgroup.controllers").exists() {
            return Ok(None);
        }
        // The controllers the pod's stats read, for the pods' cgroup and
        // each pod's (the kubelet enables them on kubepods the same way).
        let enable = |dir: &std::path::Path| {
            std::fs::write(dir.join("cgroup.subtree_control"), "+cpu +memory +pids")
                .with_context(|| format!("cannot enable cpu, memory and pids in {}", dir.display()))
        };
        let pods = root.join(PODS);
        enable(&root)?;
        match std::fs::create_dir(&pods) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("cannot make {}", pods.display())),
        }
        enable(&pods)?;
        let name = format!("pod{uid}");
        let dir = pods.join(&name);
        std::fs::create_dir(&dir).with_context(|| format!("cannot make the pod's cgroup {}", dir.display()))?;
        Ok(Some(Self {
            parent: format!("/{PODS}/{name}"),
            dir,
        }))
    }

    /// Removes the pod's cgroup: an error if anything was left in it.
    pub fn remove(self) -> Result<()> {
        std::fs::remove_dir(&self.dir).with_context(|| {
            format!(
                "the pod's cgroup {} cannot be removed after the pod was (something was left in it)",
                self.dir.display()
            )
        })
    }
}

/// CPU time (ns) and memory working set (bytes), 0 where missing.
fn cpu_and_ws(cpu: Option<&CpuUsage>, memory: Option<&MemoryUsage>) -> (u64, u64) {
    let cpu = cpu
        .and_then(|c| c.usage_core_nano_seconds.as_ref())
        .map_or(0, |v| v.value);
    let ws = memory.and_then(|m| m.working_set_bytes.as_ref()).map_or(0, |v| v.value);
    (cpu, ws)
}

/// A container's CPU time (ns) and memory working set (bytes).
fn usage(s: &ContainerStats) -> (u64, u64) {
    cpu_and_ws(s.cpu.as_ref(), s.memory.as_ref())
}

fn id_of(s: &ContainerStats) -> &str {
    s.attributes.as_ref().map_or("", |a| a.id.as_str())
}

/// The pod's stats (`PodSandboxStats`).
pub async fn pod_stats(client: &mut Client, sandbox: &str) -> Result<PodSandboxStats> {
    client
        .pod_sandbox_stats(PodSandboxStatsRequest {
            pod_sandbox_id: sandbox.to_string(),
        })
        .await
        .map_err(rpc)
        .context("PodSandboxStats failed")?
        .into_inner()
        .stats
        .context("PodSandboxStats answered no stats")
}

/// The pod's default interface's received and sent bytes.
pub fn net_bytes(s: &PodSandboxStats) -> Result<(u64, u64)> {
    let i = s
        .linux
        .as_ref()
        .and_then(|l| l.network.as_ref())
        .and_then(|n| n.default_interface.as_ref())
        .context("PodSandboxStats has no default interface")?;
    let v = |x: &Option<k8s_cri::v1::UInt64Value>| x.as_ref().map_or(0, |v| v.value);
    Ok((v(&i.rx_bytes), v(&i.tx_bytes)))
}

/// B writes [`BALLAST_MIB`] MiB into its writable layer; then the stats
/// calls must show it: B's working set at least that much (from the pod
/// VM's guest cgroup under k7d), A's and B's CPU time above zero, both
/// containers in `ListContainerStats` of the pod and in its
/// `PodSandboxStats`, with their processes counted. With `vm_runtime` (a
/// pod VM) the pod's node cgroup holds the VM's process: its working set
/// at least the ballast (written into the guest's RAM) and CPU time above
/// zero.
pub async fn check(
    client: &mut Client,
    sandbox: &str,
    (a, b): (&str, &str),
    vm_runtime: bool,
    limit: Duration,
) -> Result<()> {
    let bytes = BALLAST_MIB << 20;
    exec(
        client,
        b,
        &[
            "dd",
            "if=/dev/zero",
            "of=/tmp/k7d-cri-ballast",
            "bs=1M",
            &format!("count={BALLAST_MIB}"),
        ],
        limit,
    )
    .await
    .context("B could not write its ballast")?;
    let one = |s: Option<ContainerStats>, name: &str| s.with_context(|| format!("ContainerStats of {name} is empty"));
    let sa = one(
        client
            .container_stats(ContainerStatsRequest {
                container_id: a.to_string(),
            })
            .await
            .map_err(rpc)
            .context("ContainerStats of A failed")?
            .into_inner()
            .stats,
        "A",
    )?;
    let sb = one(
        client
            .container_stats(ContainerStatsRequest {
                container_id: b.to_string(),
            })
            .await
            .map_err(rpc)
            .context("ContainerStats of B failed")?
            .into_inner()
            .stats,
        "B",
    )?;
    let (cpu_a, ws_a) = usage(&sa);
    let (cpu_b, ws_b) = usage(&sb);
    println!(
        "cri: stats: container A cpu {:.3} s, working set {} KiB; container B cpu {:.3} s, working set {} KiB",
        cpu_a as f64 / 1e9,
        ws_a >> 10,
        cpu_b as f64 / 1e9,
        ws_b >> 10
    );
    if ws_b < bytes {
        bail!(
            "B wrote {BALLAST_MIB} MiB but its working set is {} KiB (ContainerStats)",
            ws_b >> 10
        );
    }
    if cpu_a == 0 || cpu_b == 0 {
        bail!("a container that ran has no CPU time: A {cpu_a} ns, B {cpu_b} ns (ContainerStats)");
    }
    let listed = client
        .list_container_stats(ListContainerStatsRequest {
            filter: Some(ContainerStatsFilter {
                pod_sandbox_id: sandbox.to_string(),
                ..Default::default()
            }),
        })
        .await
        .map_err(rpc)
        .context("ListContainerStats failed")?
        .into_inner()
        .stats;
    let mut ids: Vec<&str> = listed.iter().map(id_of).collect();
    ids.sort_unstable();
    let mut want = [a, b];
    want.sort_unstable();
    if ids != want {
        bail!("ListContainerStats of the pod lists {ids:?}, expected A and B {want:?}");
    }
    let lb = listed.iter().find(|s| id_of(s) == b).map_or((0, 0), usage);
    if lb.1 < bytes {
        bail!(
            "ListContainerStats shows B's working set at {} KiB, under its ballast",
            lb.1 >> 10
        );
    }
    let pod = pod_stats(client, sandbox).await?;
    let linux = pod.linux.as_ref().context("PodSandboxStats has no Linux stats")?;
    let mut in_pod: Vec<&str> = linux.containers.iter().map(id_of).collect();
    in_pod.sort_unstable();
    if in_pod != want {
        bail!("PodSandboxStats lists containers {in_pod:?}, expected A and B {want:?}");
    }
    let procs = linux
        .process
        .as_ref()
        .and_then(|p| p.process_count.as_ref())
        .map_or(0, |v| v.value);
    if procs < 2 {
        bail!("PodSandboxStats counts {procs} processes in the pod's two running containers");
    }
    let (pod_cpu, pod_ws) = cpu_and_ws(linux.cpu.as_ref(), linux.memory.as_ref());
    let (rx, tx) = net_bytes(&pod)?;
    println!(
        "cri: stats: pod: {procs} processes; its node cgroup: cpu {:.3} s, working set {} KiB; eth0 rx {rx} B, tx {tx} B",
        pod_cpu as f64 / 1e9,
        pod_ws >> 10
    );
    if vm_runtime && (pod_ws < bytes || pod_cpu == 0) {
        bail!(
            "the pod's node cgroup shows cpu {pod_cpu} ns and a working set of {} KiB, under B's {BALLAST_MIB} MiB: its pod VM's process is not in it",
            pod_ws >> 10
        );
    }
    Ok(())
}

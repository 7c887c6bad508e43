//! What a scrape reads of each VM (`metrics.rs` encodes it): its state,
//! counters and config from the VM itself, or from its VM process over
//! its channel, or from its record while a request holds it; its VM
//! process's memory as the `k7d-vm-memory` thread last read it
//! (`process_memory.rs`); the pod and warm pool it serves.
//! VMs are sampled in a few threads: a VM process's sample is mostly
//! waiting (its status round trip).

use std::sync::Arc;

use super::{Daemon, Slot};
use crate::vstate::vm::VmState;

/// A VM state as its label says (a stop's reason is the VM's `info`'s).
pub(super) fn state_label(s: &VmState) -> &'static str {
    match s {
        VmState::Created => "created",
        VmState::Running => "running",
        VmState::Paused => "paused",
        VmState::Stopped { .. } => "stopped",
    }
}

/// The warm pool a VM belongs to: the containerd shim's own reading of
/// its pool member ids (`k7d_shim::names::pool_of`); none for others, and
/// for every VM in a build without the shim.
pub(super) fn pool_of(id: &str) -> Option<&str> {
    #[cfg(feature = "shim")]
    return k7d_shim::names::pool_of(id);
    #[cfg(not(feature = "shim"))]
    {
        let _ = id;
        None
    }
}

/// A pool member's state: `claimed` once a pod's NIC is attached to it,
/// else `ready` while paused (the shim pauses a member once its agent
/// answered), `booting` while it runs, `stopped`.
pub(super) fn pool_state(state: &'static str, has_pod: bool) -> &'static str {
    match (has_pod, state) {
        (true, _) => "claimed",
        (false, "paused") => "ready",
        (false, "stopped") => "stopped",
        (false, _) => "booting",
    }
}

/// Why a stopped VM stopped (its reason's kind); none while it is not.
pub(super) fn stop_kind(s: &VmState) -> Option<&'static str> {
    match s {
        VmState::Stopped { reason } => Some(reason.kind()),
        _ => None,
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
pub(super) struct VmSample {
    pub(super) id: String,
    pub(super) state: &'static str,
    /// Why it stopped, once it has.
    pub(super) stop: Option<&'static str>,
    pub(super) vcpus: u8,
    pub(super) memory_mib: u64,
    /// Live counters; `None` while the VM is busy with a request.
    pub(super) exits: Option<u64>,
    /// vCPU exits by kind (empty: a VM process of an earlier k7d).
    pub(super) exits_by_reason: Vec<(String, u64)>,
    /// Its devices' counters (`Vm::device_counters`).
    pub(super) device_counters: Vec<(String, Vec<(String, u64)>)>,
    pub(super) rebases: Option<u64>,
    pub(super) parent: Option<String>,
    pub(super) guest: String,
    /// Its VM process (`--jail on`).
    pub(super) pid: Option<u32>,
    /// Its VM process's RSS and PSS (bytes).
    pub(super) mem: Option<(u64, u64)>,
    /// Its guest RAM as its VM process maps it (bytes): pages present, and
    /// of those its own copies, written since its fork. From the same
    /// reading as `mem`; none for a VM in the daemon.
    pub(super) guest_ram: Option<(u64, u64)>,
    pub(super) datapath: bool,
    /// The pod it serves: (namespace, name, uid), from its NICs' attachment.
    pub(super) pod: Option<(String, String, String)>,
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
pub(super) fn rss_pss(pid: u32) -> Option<(u64, u64)> {
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
    /// Every VM's sample, sorted by id.
    pub(super) fn vm_samples(&self, parents: &std::collections::HashMap<String, super::Parent>) -> Vec<VmSample> {
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
        // channel, mostly waiting.
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
        let sample = match slot {
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
                    guest_ram: None,
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
                    let live = !matches!(status.state, VmState::Stopped { .. });
                    let pid = live.then(|| g.record().pid);
                    // Its memory as the `k7d-vm-memory` thread last read
                    // it (`process_memory.rs`): none before its first reading.
                    let reading = pid.and_then(|p| self.vm_memory.get(&id, p));
                    let (mem, guest_ram) = (reading.and_then(|r| r.process), reading.and_then(|r| r.guest_ram));
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
                        pid,
                        mem,
                        guest_ram,
                        parent,
                        id,
                    }
                }
                Err(_) => self.sample_from_record(id, parent)?,
            },
        };
        Some(sample)
    }

    /// A VM busy with a request, as its record says (no live counters).
    fn sample_from_record(&self, id: String, parent: Option<String>) -> Option<VmSample> {
        let rec = self.store.load(&id).ok().flatten()?;
        // (Busy with a request: its memory's last reading.)
        let reading = rec.vm_process.as_ref().and_then(|p| self.vm_memory.get(&id, p.pid));
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
            mem: reading.and_then(|r| r.process),
            guest_ram: reading.and_then(|r| r.guest_ram),
            datapath: rec.config.devices.nics.iter().any(|n| n.datapath.is_some()),
            pod: pod_of(&rec.config),
            parent,
            id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_members_are_known_by_the_shims_ids_and_their_state() {
        #[cfg(feature = "shim")]
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
    fn smaps_rollup_of_this_process_parses() {
        let (rss, pss) = rss_pss(std::process::id()).expect("this process's smaps_rollup");
        assert!(rss > 0 && pss > 0 && pss <= rss, "rss {rss} pss {pss}");
    }
}

//! Attaching a live VM's bare NIC to a pod's network (a warm pool member
//! claimed by a pod, `docs/kubernetes.md`): the tap the VM already serves
//! moves into the pod netns and the datapath is set up around it, so the
//! device, its queues and the guest's driver never notice.

use super::device_manager::{NetCleanup, attach_to_pod};
use super::vm::{Vm, VmError, VmState};
use crate::config::DatapathNicConfig;

impl Vm {
    /// Attaches NIC `index`, on a bare tap, to the pod network `d` through
    /// the datapath (`node`'s), while the VM runs or stands paused. The NIC
    /// must be on the userspace plane (`vhost = false` in its config) and
    /// its tap k7d's own name for it. A refusal or a failed attach leaves
    /// the NIC on its bare tap, as it was.
    pub fn attach_nic(
        &mut self,
        index: usize,
        d: &DatapathNicConfig,
        node: &crate::config::NodeConfig,
    ) -> Result<(), VmError> {
        let id = self.id().to_string();
        let refuse = |why: String| VmError::Refused(format!("nic {index} of vm {id} cannot be attached: {why}"));
        check_attachable(&id, self.config(), index, d).map_err(VmError::Refused)?;
        if matches!(self.state(), VmState::Stopped { .. }) {
            return Err(self.state_error("attach a NIC"));
        }
        let idx = u16::try_from(index).map_err(|_| refuse("its index is out of range".into()))?;
        let dp = k7d_net::Datapath::new(node.datapath()).map_err(|e| refuse(e.to_string()))?;
        // The queue count is the device's, not the request's: the VM holds them.
        let (_, note) = attach_to_pod(&dp, &id, idx, d, 1, true)?;
        // Detached (filters, pins, bridge, the tap in the pod netns) when
        // the VM goes away, as a NIC attached at its build is.
        let cleanup = NetCleanup::new(dp, id.clone(), idx, d.netns.clone(), d.pod_if.clone());
        self.config_mut().devices.nics[index].datapath = Some(d.clone());
        // Where a NIC attached at its build says it: after its backend,
        // before the transport's "; MSI-X ...".
        if let Some(info) = self.device_manager_mut().attached_nic(index, Some(cleanup)) {
            let at = info.detail.find("; MSI-X").unwrap_or(info.detail.len());
            info.detail.insert_str(at, &note);
        }
        tracing::info!(vm = %id, nic = index, netns = %d.netns.display(), "bare NIC attached to a pod network{note}");
        Ok(())
    }
}

/// Refuses, in one sentence, attaching NIC `index` of VM `id` (config
/// `config`) to the pod network `d` later: only a bare NIC k7d named, made
/// with `vhost = false`, not attached already (inside a daemon and for a
/// VM process alike, `daemon/processes.rs`).
pub(crate) fn check_attachable(
    id: &str,
    config: &crate::config::VmConfig,
    index: usize,
    d: &DatapathNicConfig,
) -> Result<(), String> {
    let refuse = |why: &str| format!("nic {index} of vm {id} cannot be attached: {why}");
    let Some(n) = config.devices.nics.get(index) else {
        return Err(format!(
            "vm {id} has {} NIC(s), so it has no nic {index}",
            config.devices.nics.len()
        ));
    };
    if n.datapath.is_some() {
        return Err(refuse("it is already attached to a pod's network"));
    }
    if n.vhost != Some(false) {
        return Err(refuse(
            "it may be served by vhost-net; only a NIC made with vhost = false is attached later",
        ));
    }
    if n.tap.is_some() {
        return Err(refuse("its tap was named by the config, not by k7d"));
    }
    d.check().map_err(|e| refuse(&e))
}

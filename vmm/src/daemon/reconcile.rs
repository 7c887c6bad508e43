//! What a daemon that is gone left behind, found and removed at the next
//! start.
//!
//! VMs live inside the daemon process, so a record on disk at start belongs
//! to a VM that died with its daemon ([`super::Daemon::open`] removes the
//! record). The kernel tears down what the process held (guest RAM, taps,
//! vhost workers), but not what outlives a process by design: a NIC's
//! datapath pins under the bpffs root (a pinned TCX link keeps its program
//! attached to the pod's interface), and, in a pod netns that still exists,
//! the bridge chain's links and netlink filters. The record says which NICs
//! had a datapath, and [`super::Daemon::detach_leftover_nics`] detaches each
//! one by its VM id and NIC index, so a VM of another daemon sharing the
//! bpffs root is never touched.

use crate::config::{DatapathNicConfig, NicConfig};

/// A record found at start whose VM no longer exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// VM id.
    pub id: String,
    /// What the record said.
    pub state: String,
    /// The daemon that owned it.
    pub daemon_pid: Option<u32>,
    /// The NICs the record says had a datapath (index, attachment).
    pub nics: Vec<(u16, DatapathNicConfig)>,
}

/// The NICs of `nics` attached through the datapath, by index.
pub(super) fn datapath_nics(nics: &[NicConfig]) -> Vec<(u16, DatapathNicConfig)> {
    nics.iter()
        .enumerate()
        .filter_map(|(i, n)| Some((u16::try_from(i).ok()?, n.datapath.clone()?)))
        .collect()
}

/// What [`super::Daemon::detach_leftover_nics`] did with one VM's NICs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicSweep {
    /// VM id.
    pub id: String,
    /// NICs whose datapath was detached.
    pub detached: usize,
    /// NICs that could not be, with the reason (logged too).
    pub failed: Vec<(u16, String)>,
}

impl super::Daemon {
    /// Detaches the datapath of every NIC of the VMs `reconciled` names
    /// (their pins, and in a pod netns that still exists, k7d's links and
    /// filters there), with the node's datapath config. Call before any VM
    /// is built. A NIC that cannot be detached is logged and left; the rest
    /// go on.
    pub fn detach_leftover_nics(&self, reconciled: &[Reconciled]) -> Vec<NicSweep> {
        let mut out = Vec::new();
        let mut dp = None;
        for r in reconciled.iter().filter(|r| !r.nics.is_empty()) {
            let mut sweep = NicSweep {
                id: r.id.clone(),
                detached: 0,
                failed: Vec::new(),
            };
            if dp.is_none() {
                match k7d_net::Datapath::new(self.node.datapath()) {
                    Ok(d) => dp = Some(d),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot open the datapath to detach what a gone daemon left");
                    }
                }
            }
            for (idx, nic) in &r.nics {
                let res = match &dp {
                    None => Err("the datapath could not be opened".to_string()),
                    // The record is the daemon's own, still checked as a
                    // create's config is (an absolute netns path).
                    Some(dp) => nic.check().and_then(|()| {
                        dp.detach(&r.id, *idx, Some(&nic.netns), &nic.pod_if)
                            .map_err(|e| e.to_string())
                    }),
                };
                match res {
                    Ok(()) => sweep.detached += 1,
                    Err(e) => {
                        tracing::warn!(vm = %r.id, nic = idx, netns = %nic.netns.display(), error = %e,
                            "cannot detach the datapath a gone daemon left for this NIC");
                        sweep.failed.push((*idx, e));
                    }
                }
            }
            out.push(sweep);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(netns: &str) -> NicConfig {
        NicConfig {
            datapath: Some(DatapathNicConfig {
                mode: "direct".into(),
                netns: netns.into(),
                pod_if: "eth0".into(),
                pod_uid: None,
                pod_namespace: None,
                pod_name: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_nics_with_a_datapath_are_swept_by_their_index() {
        let nics = [
            NicConfig::default(),
            nic("/run/netns/a"),
            NicConfig::default(),
            nic("/run/netns/b"),
        ];
        let got = datapath_nics(&nics);
        assert_eq!(
            got.iter()
                .map(|(i, n)| (*i, n.netns.display().to_string()))
                .collect::<Vec<_>>(),
            [(1, "/run/netns/a".to_string()), (3, "/run/netns/b".to_string())]
        );
        assert!(datapath_nics(&[NicConfig::default()]).is_empty());
    }

    #[test]
    fn a_relative_netns_is_never_entered() {
        let e = nic("run/netns/x").datapath.unwrap().check().unwrap_err();
        assert_eq!(e, "the pod network namespace run/netns/x is not an absolute path");
        assert!(nic("/run/netns/x").datapath.unwrap().check().is_ok());
    }
}

//! Finding and removing what a crashed k7d left behind.
use std::path::{Path, PathBuf};

use tracing::info;

use crate::{
    Datapath, NetError,
    datapath::drop_empty_clsact,
    names::{LINK_PREFIX, nic_names},
    netlink::{CLSACT_EGRESS, CLSACT_INGRESS, Netlink},
    netns::in_netns,
};

/// k7d objects present in some namespaces and under the bpffs root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    /// Links whose name starts with `k7d`, as `netns:name`.
    pub links: Vec<String>,
    /// Links with a clsact (or ingress) qdisc, as `netns:name`.
    pub qdiscs: Vec<String>,
    /// bpf filters whose program name starts with `k7d_`, as `netns:link:name`.
    pub filters: Vec<String>,
    /// TCX programs attached to any link, as `netns:link:count`.
    pub tcx: Vec<String>,
    /// Files and directories under the bpffs root.
    pub pins: Vec<PathBuf>,
}

impl Inventory {
    /// True when nothing is left.
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
            && self.qdiscs.is_empty()
            && self.filters.is_empty()
            && self.tcx.is_empty()
            && self.pins.is_empty()
    }
}

/// What a reconcile removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub links: usize,
    pub filters: usize,
    pub nic_dirs: usize,
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.clone());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                walk(&p, out);
            }
        }
    }
}

impl Datapath {
    /// Lists k7d leftovers in `netns` (each path a netns file) and under the
    /// bpffs root.
    pub fn inventory(&self, netns: &[&Path]) -> Result<Inventory, NetError> {
        let mut inv = Inventory::default();
        for ns in netns {
            let tag = ns.display().to_string();
            let part = in_netns(Some(ns), || {
                let mut inv = Inventory::default();
                let mut nl = Netlink::open()?;
                let links = nl.links()?;
                for l in &links {
                    if l.name.starts_with(LINK_PREFIX) {
                        inv.links.push(format!("{tag}:{}", l.name));
                    }
                    for p in [CLSACT_INGRESS, CLSACT_EGRESS] {
                        for f in nl.filters(l.index, p)? {
                            if f.bpf_name.as_deref().is_some_and(|n| n.starts_with("k7d_")) {
                                inv.filters
                                    .push(format!("{tag}:{}:{}", l.name, f.bpf_name.unwrap_or_default()));
                            }
                        }
                    }
                    let n = k7d_bpf::tcx_program_count(&l.name).unwrap_or(0);
                    if n > 0 {
                        inv.tcx.push(format!("{tag}:{}:{n}", l.name));
                    }
                }
                for q in nl.qdiscs()? {
                    if q.kind == "clsact" || q.kind == "ingress" {
                        let name = links
                            .iter()
                            .find(|l| l.index == q.ifindex)
                            .map(|l| l.name.clone())
                            .unwrap_or_else(|| q.ifindex.to_string());
                        inv.qdiscs.push(format!("{tag}:{name}"));
                    }
                }
                Ok(inv)
            })?;
            inv.links.extend(part.links);
            inv.qdiscs.extend(part.qdiscs);
            inv.filters.extend(part.filters);
            inv.tcx.extend(part.tcx);
        }
        walk(&self.config().bpffs_root, &mut inv.pins);
        Ok(inv)
    }

    /// Removes k7d links, k7d bpf filters (and clsact qdiscs they leave
    /// empty) in each of `netns`, and every NIC pin directory under the
    /// bpffs root, except those of the NICs in `keep` (VM id, NIC index).
    /// Unpinning a TCX link detaches its program, so pins are removed even
    /// for namespaces that are gone.
    pub fn reconcile(&self, netns: &[&Path], keep: &[(&str, u16)]) -> Result<ReconcileReport, NetError> {
        let kept: Vec<_> = keep.iter().map(|(vm, nic)| nic_names(vm, *nic)).collect();
        let mut report = ReconcileReport::default();
        let root = self.config().bpffs_root.clone();
        // Pins first: detaches TCX programs everywhere.
        if let Ok(rd) = std::fs::read_dir(&root) {
            for vm in rd.flatten() {
                // l2 uplinks are not NICs: `Datapath::uplink_detach` owns them.
                if vm.file_name() == crate::uplink::UPLINKS_DIR {
                    continue;
                }
                let vm_path = vm.path();
                if let Ok(nics) = std::fs::read_dir(&vm_path) {
                    for nic in nics.flatten() {
                        let rel = format!(
                            "{}/{}",
                            vm.file_name().to_string_lossy(),
                            nic.file_name().to_string_lossy()
                        );
                        if kept.iter().any(|k| k.bpf_subdir == rel) {
                            continue;
                        }
                        k7d_bpf::detach_nic(&nic.path(), None, None)?;
                        report.nic_dirs += 1;
                    }
                }
                let _ = std::fs::remove_dir(&vm_path);
            }
        }
        for ns in netns {
            let (links, filters) = in_netns(Some(ns), || {
                let mut nl = Netlink::open()?;
                let links = nl.links()?;
                let keep_pod_filters = links.iter().any(|l| kept.iter().any(|k| k.tap == l.name));
                let mut nf = 0;
                for l in &links {
                    let mut touched = false;
                    for p in [CLSACT_INGRESS, CLSACT_EGRESS] {
                        for f in nl.filters(l.index, p)? {
                            let Some(name) = f.bpf_name.as_deref() else {
                                continue;
                            };
                            if !name.starts_with("k7d_") {
                                continue;
                            }
                            let kept_link = kept.iter().any(|k| k.tap == l.name);
                            if kept_link || (keep_pod_filters && name == "k7d_pod_in") {
                                continue;
                            }
                            nl.del_filter(&f)?;
                            nf += 1;
                            touched = true;
                        }
                    }
                    if touched {
                        drop_empty_clsact(&mut nl, l.index);
                    }
                }
                // Bridges first (releases their ports), then the rest.
                let mut doomed: Vec<_> = links
                    .iter()
                    .filter(|l| l.name.starts_with(LINK_PREFIX))
                    .filter(|l| !kept.iter().any(|k| k.tap == l.name || k.bridge == l.name))
                    .collect();
                doomed.sort_by_key(|l| l.kind.as_deref() != Some("bridge"));
                for l in &doomed {
                    nl.del_link(l.index)?;
                }
                Ok((doomed.len(), nf))
            })?;
            report.links += links;
            report.filters += filters;
        }
        if report != ReconcileReport::default() {
            info!(
                links = report.links,
                filters = report.filters,
                nic_dirs = report.nic_dirs,
                "reconcile removed k7d leftovers"
            );
        }
        Ok(report)
    }
}

//! Clusters (issue 16, `docs/fork.md`): named sets of the daemon's VMs,
//! forked together under one pause. Cluster ids and VM ids share one
//! namespace (`k7d fork <id>` forks whichever it names); a VM belongs to at
//! most one cluster. A cluster's record (`<state>/clusters/<id>.json`) is
//! written on every change; like a VM's record, one found when a daemon
//! starts belonged to a daemon that is gone, with its members, and is
//! removed (with its bridge).
//!
//! A cluster's private bridge (`k7d_net::create_private_bridge`) holds its
//! members' NICs, except a NIC whose tap the user named (it stays outside,
//! the user's to wire) and one attached through the datapath (its pod's).
//! Each fork of the cluster gets a bridge of its own with the children's
//! taps on it: the same MACs and IPs on disjoint layer-2 domains.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::api::{
    ApiError, ClusterInfo, ClusterList, ClusterSummary, Deleted, ErrorCode, Forked, ForkedChild, MAX_CLUSTER_MEMBERS,
    MAX_FORKS, VmSummary,
};
use super::store::{StoreError, write_json_atomic};
use super::{Daemon, PAUSE_TIMEOUT, Reservation, Slot, internal, lock_vm, ms, summary, vm_error};
use crate::vstate::cluster::ClusterPause;
use crate::vstate::vm::Vm;

/// A cluster record's format version.
const CLUSTER_RECORD_VERSION: u32 = 2;

/// A cluster as its record holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterRecord {
    version: u32,
    id: String,
    members: Vec<Member>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bridge: Option<String>,
}

/// A member VM and its NICs on the cluster's bridge (by index).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Member {
    id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    bridged: Vec<u16>,
}

impl Member {
    /// The taps of this member's bridged NICs: `(nic index, tap)`. A
    /// bridged NIC's tap is named after its VM (the user named none).
    fn ports(&self) -> impl Iterator<Item = (u16, String)> + '_ {
        self.bridged.iter().map(|&i| (i, k7d_net::nic_names(&self.id, i).tap))
    }
}

/// A cluster: its members, in order, and its bridge once one has a NIC on it.
#[derive(Debug, Clone, Default)]
pub(super) struct Cluster {
    members: Vec<Member>,
    bridge: Option<String>,
}

impl Cluster {
    fn ids(&self) -> Vec<String> {
        self.members.iter().map(|m| m.id.clone()).collect()
    }

    fn has(&self, vm: &str) -> bool {
        self.members.iter().any(|m| m.id == vm)
    }
}

/// A cluster id in the daemon's map.
#[derive(Debug, Clone)]
pub(super) enum ClusterSlot {
    /// Taken by a fork still building the cluster.
    Reserved,
    Ready(Cluster),
}

/// The clusters and their records.
pub(super) struct Clusters {
    dir: PathBuf,
    map: Mutex<BTreeMap<String, ClusterSlot>>,
    /// Makes every temporary record file name unique.
    seq: AtomicU64,
}

impl Clusters {
    /// Opens `<state_dir>/clusters`. A record of members that outlived the
    /// daemon that wrote it (re-attached in their VM processes: `live`) is
    /// kept with those members and its bridge (which the kernel kept with
    /// their taps on it; put back if somebody took it away: [`rewire`]);
    /// any other was left by a gone daemon whose members went with it and
    /// is removed, with its bridge. Returns the ids removed.
    pub(super) fn open(state_dir: &Path, live: &dyn Fn(&str) -> bool) -> Result<(Self, Vec<String>), std::io::Error> {
        let dir = state_dir.join("clusters");
        fs::create_dir_all(&dir)?;
        let mut removed = Vec::new();
        let mut kept = BTreeMap::new();
        let mut members_kept = std::collections::HashSet::new();
        let mut changed = Vec::new();
        for e in fs::read_dir(&dir)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !e.file_type()?.is_file() {
                tracing::warn!(entry = %name, "not a cluster record; left alone");
                continue;
            }
            let rec = fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<ClusterRecord>(&b).ok())
                .filter(|r| r.version == CLUSTER_RECORD_VERSION && name == format!("{}.json", r.id))
                .map(|mut r| {
                    // A member whose process is gone is out, as a deleted
                    // member is; so is one named twice or held by a cluster
                    // kept already (a VM belongs to one cluster at most).
                    let before = r.members.len();
                    let mut own = std::collections::HashSet::new();
                    r.members
                        .retain(|m| live(&m.id) && !members_kept.contains(&m.id) && own.insert(m.id.clone()));
                    if r.members.len() != before {
                        changed.push(r.id.clone());
                    }
                    r
                })
                .filter(|r| !r.members.is_empty());
            if let Some(r) = rec {
                members_kept.extend(r.members.iter().map(|m| m.id.clone()));
                tracing::info!(cluster = %r.id, "kept: its members were re-attached in their VM processes");
                if let Some(b) = &r.bridge {
                    rewire(&r.id, b, &r.members);
                }
                kept.insert(
                    r.id.clone(),
                    ClusterSlot::Ready(Cluster {
                        members: r.members,
                        bridge: r.bridge,
                    }),
                );
                continue;
            }
            fs::remove_file(e.path())?;
            if let Some(id) = name.strip_suffix(".json").filter(|n| !n.starts_with('.')) {
                remove_bridge(&k7d_net::cluster_bridge_name(id));
                removed.push(id.to_string());
            }
        }
        removed.sort();
        let clusters = Self {
            dir,
            map: Mutex::new(kept),
            seq: AtomicU64::new(0),
        };
        // A kept record that lost members says so on disk too: a new VM
        // that takes a lost member's id must not join it at the next start.
        for id in changed {
            if let Some(c) = clusters.get(&id) {
                clusters.save(&id, &c).map_err(std::io::Error::other)?;
            }
        }
        Ok((clusters, removed))
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<String, ClusterSlot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `id` names a cluster (or one being built).
    pub(super) fn contains(&self, id: &str) -> bool {
        self.map().contains_key(id)
    }

    /// Cluster `id`, if it is one.
    fn get(&self, id: &str) -> Option<Cluster> {
        match self.map().get(id) {
            Some(ClusterSlot::Ready(c)) => Some(c.clone()),
            _ => None,
        }
    }

    /// Writes the record of `id` atomically.
    fn save(&self, id: &str, c: &Cluster) -> Result<(), StoreError> {
        let rec = ClusterRecord {
            version: CLUSTER_RECORD_VERSION,
            id: id.to_string(),
            members: c.members.clone(),
            bridge: c.bridge.clone(),
        };
        write_json_atomic(&self.dir, id, &rec, &self.seq)
    }

    fn remove_record(&self, id: &str) -> Result<(), std::io::Error> {
        match fs::remove_file(self.dir.join(format!("{id}.json"))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Forgets every cluster and removes its record and bridge (the daemon
    /// exits, and the members inside it with it), but a cluster whose
    /// members run on in VM processes.
    pub(super) fn remove_all(&self) {
        let all = std::mem::take(&mut *self.map());
        for (id, slot) in all {
            // Members left at exit run in VM processes, which outlive the
            // daemon: their cluster does too (with its bridge, which holds
            // their taps), for the next daemon.
            if let ClusterSlot::Ready(c) = &slot
                && !c.members.is_empty()
            {
                tracing::info!(cluster = %id, "kept: its members run on in their VM processes");
                continue;
            }
            if let ClusterSlot::Ready(Cluster { bridge: Some(b), .. }) = slot {
                remove_bridge(&b);
            }
            if let Err(e) = self.remove_record(&id) {
                tracing::error!(cluster = %id, error = %e, "cannot remove the cluster's record");
            }
        }
    }

    /// Takes `member` out of whichever cluster holds it (a deleted VM).
    pub(super) fn forget_member(&self, member: &str) {
        let mut map = self.map();
        let holder = map.iter_mut().find_map(|(id, slot)| match slot {
            ClusterSlot::Ready(c) if c.has(member) => Some((id.clone(), c)),
            _ => None,
        });
        if let Some((id, c)) = holder {
            c.members.retain(|x| x.id != member);
            if let Err(e) = self.save(&id, c) {
                tracing::error!(cluster = %id, error = %e, "cannot rewrite the cluster's record");
            }
        }
    }
}

/// Cluster ids reserved for a fork's children: released (with any record
/// and bridge) on drop unless filled.
struct ClusterReservation<'a> {
    clusters: &'a Clusters,
    ids: Vec<String>,
    /// The bridges made for them so far.
    bridges: Vec<String>,
}

impl ClusterReservation<'_> {
    /// Puts the made child clusters `made` in the map under the reserved
    /// ids (their records written already), which are then no longer the
    /// reservation's to remove; returns the ids.
    fn publish(&mut self, made: Vec<Cluster>) -> Vec<String> {
        let names = std::mem::take(&mut self.ids);
        let mut map = self.clusters.map();
        for (cid, c) in names.iter().zip(made) {
            map.insert(cid.clone(), ClusterSlot::Ready(c));
        }
        names
    }
}

impl Drop for ClusterReservation<'_> {
    fn drop(&mut self) {
        for b in &self.bridges {
            remove_bridge(b);
        }
        let mut map = self.clusters.map();
        for id in &self.ids {
            if matches!(map.get(id), Some(ClusterSlot::Reserved)) {
                map.remove(id);
            }
            let _ = self.clusters.remove_record(id);
        }
    }
}

/// Deletes bridge `name` if it exists; a failure is logged (a cleanup path).
fn remove_bridge(name: &str) {
    match k7d_net::delete_bridge(name) {
        Ok(true) => tracing::info!(bridge = name, "cluster bridge removed"),
        Ok(false) => {}
        Err(e) => tracing::error!(bridge = name, error = %e, "cannot remove a cluster bridge"),
    }
}

/// Puts a kept cluster's bridge back as its record says (a daemon found
/// it at its start): the bridge made again if it is gone, and each live
/// member's bridged tap that is on no bridge put on it. A tap on another
/// bridge is somebody's and stays; what cannot be done is logged (the
/// cluster is kept: its members run, and its delete removes what there is).
fn rewire(cluster: &str, bridge: &str, members: &[Member]) {
    let exists = k7d_net::netlink::Netlink::open().and_then(|mut nl| nl.link(bridge).map(|l| l.is_some()));
    match exists {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(cluster, bridge, "the cluster's bridge is gone; making it again");
            if let Err(e) = k7d_net::create_private_bridge(bridge) {
                tracing::error!(cluster, bridge, error = %e, "cannot make the cluster's bridge again");
                return;
            }
        }
        Err(e) => {
            tracing::error!(cluster, bridge, error = %e, "cannot look for the cluster's bridge");
            return;
        }
    }
    for m in members {
        for (nic, tap) in m.ports() {
            match k7d_net::master_of(&tap) {
                Ok(Some(b)) if b == bridge => {}
                Ok(Some(other)) => {
                    tracing::warn!(cluster, vm = %m.id, nic, tap = %tap, bridge = %other, "the member's tap is on another bridge; left there");
                }
                Ok(None) => {
                    if let Err(e) = k7d_net::attach_port(bridge, &tap) {
                        tracing::error!(cluster, vm = %m.id, nic, tap = %tap, error = %e, "cannot put the member's tap back on the cluster's bridge");
                    } else {
                        tracing::warn!(cluster, vm = %m.id, nic, tap = %tap, "the member's tap was put back on the cluster's bridge");
                    }
                }
                Err(e) => {
                    tracing::error!(cluster, vm = %m.id, nic, tap = %tap, error = %e, "cannot look at the member's tap");
                }
            }
        }
    }
}

/// Takes `members`' bridged NICs off their bridge again and deletes
/// `bridge` when given (the undo of a [`wire`] whose step failed later).
fn unwire(members: &[Member], bridge: Option<&str>) {
    for m in members {
        for (_, tap) in m.ports() {
            if let Err(e) = k7d_net::detach_port(&tap) {
                tracing::error!(tap = %tap, error = %e, "cannot take a tap off a cluster bridge");
            }
        }
    }
    if let Some(b) = bridge {
        remove_bridge(b);
    }
}

/// Puts `members`' bridged NICs on `bridge`, creating it first when
/// `create`: every port or none (on failure the ports put on so far are
/// taken off again, and a bridge made here is deleted).
fn wire(cluster: &str, bridge: &str, create: bool, members: &[Member]) -> Result<(), ApiError> {
    let ports: Vec<(&str, u16, String)> = members
        .iter()
        .flat_map(|m| m.ports().map(move |(i, tap)| (m.id.as_str(), i, tap)))
        .collect();
    if ports.is_empty() {
        return Ok(());
    }
    // A tap somebody put on a bridge is theirs: refused, nothing changed.
    for (vm, nic, tap) in &ports {
        match k7d_net::master_of(tap) {
            Ok(Some(m)) if m != bridge => {
                return Err(conflict(format!(
                    "cluster {cluster}: vm {vm}'s nic {nic} (tap {tap}) is on bridge {m} already; only a bare tap goes on the cluster's bridge"
                )));
            }
            Ok(_) => {}
            Err(e) => {
                return Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("cluster {cluster}: cannot look at vm {vm}'s tap {tap}: {e}"),
                ));
            }
        }
    }
    if create {
        k7d_net::create_private_bridge(bridge).map_err(|e| {
            ApiError::new(
                ErrorCode::Internal,
                format!("cluster {cluster}: cannot create its bridge {bridge}: {e}"),
            )
        })?;
    }
    for (n, (vm, nic, tap)) in ports.iter().enumerate() {
        if let Err(e) = k7d_net::attach_port(bridge, tap) {
            for (_, _, t) in &ports[..n] {
                if let Err(e) = k7d_net::detach_port(t) {
                    tracing::error!(tap = %t, error = %e, "cannot take a tap off a cluster bridge");
                }
            }
            if create {
                remove_bridge(bridge);
            }
            return Err(ApiError::new(
                ErrorCode::Internal,
                format!("cluster {cluster}: cannot put vm {vm}'s nic {nic} (tap {tap}) on its bridge {bridge}: {e}"),
            ));
        }
    }
    Ok(())
}

fn conflict(msg: String) -> ApiError {
    ApiError::new(ErrorCode::Conflict, msg)
}

impl Daemon {
    /// Refuses members that a cluster cannot hold together: VMs in VM
    /// processes next to VMs inside the daemon (one pause cannot take
    /// both). `have`: the cluster's members so far.
    fn check_member_kinds(&self, members: &[String], have: &[String]) -> Result<(), ApiError> {
        let kinds: std::collections::BTreeSet<bool> =
            members.iter().chain(have).map(|m| self.process(m).is_some()).collect();
        if kinds.len() > 1 {
            return Err(conflict(
                "a cluster's members must all run in VM processes or all inside the daemon: one pause cannot take both"
                    .into(),
            ));
        }
        Ok(())
    }

    /// `cluster_create`.
    pub(super) fn cluster_create(&self, id: &str, members: &[String]) -> Result<ClusterInfo, ApiError> {
        self.check_member_kinds(members, &[])?;
        let new = self.members_of(members);
        {
            // The VM map first, then the cluster map: the order every
            // path that takes both keeps. Both are held while the NICs go
            // on the bridge: no member can go meanwhile.
            let vms = self.vms();
            if vms.contains_key(id) || self.store.load(id).ok().flatten().is_some() {
                return Err(conflict(format!("{id} is a vm; a cluster needs an id of its own")));
            }
            let mut map = self.clusters.map();
            if map.contains_key(id) {
                return Err(conflict(format!("cluster {id} already exists")));
            }
            self.check_new_members(&vms, &map, members, &[])?;
            let bridge = k7d_net::cluster_bridge_name(id);
            wire(id, &bridge, true, &new)?;
            let c = Cluster {
                bridge: new.iter().any(|m| !m.bridged.is_empty()).then_some(bridge),
                members: new,
            };
            if let Err(e) = self.clusters.save(id, &c) {
                unwire(&c.members, c.bridge.as_deref());
                return Err(internal(e));
            }
            map.insert(id.to_string(), ClusterSlot::Ready(c));
        }
        self.cluster_info(id)
    }

    /// `members` as cluster members: each with its NICs that go on the
    /// cluster's bridge (neither a tap the user named nor a datapath NIC),
    /// whether it runs here or in a VM process (whose taps are made here,
    /// named after it, and handed over: the bridge is the daemon's either
    /// way). A VM that is not there gets none (the checks refuse it).
    fn members_of(&self, members: &[String]) -> Vec<Member> {
        let bridged = |nics: &[crate::config::NicConfig]| -> Vec<u16> {
            (0u16..)
                .zip(nics)
                .filter(|(_, n)| n.tap.is_none() && n.datapath.is_none())
                .map(|(i, _)| i)
                .collect()
        };
        members
            .iter()
            .map(|m| Member {
                id: m.clone(),
                bridged: match self.process(m) {
                    Some(r) => bridged(&r.lock().unwrap_or_else(|p| p.into_inner()).config().devices.nics),
                    None => self
                        .get(m)
                        .map(|vm| bridged(&lock_vm(&vm).config().devices.nics))
                        .unwrap_or_default(),
                },
            })
            .collect()
    }

    /// `cluster_add`.
    pub(super) fn cluster_add(&self, id: &str, members: &[String]) -> Result<ClusterInfo, ApiError> {
        let have = self.clusters.get(id).map(|c| c.ids()).unwrap_or_default();
        self.check_member_kinds(members, &have)?;
        let new = self.members_of(members);
        {
            let vms = self.vms();
            let mut map = self.clusters.map();
            let Some(ClusterSlot::Ready(have)) = map.get(id) else {
                return Err(ApiError::new(
                    ErrorCode::NotFound,
                    format!("cluster {id} does not exist"),
                ));
            };
            let mut c = have.clone();
            if c.members.len() + members.len() > MAX_CLUSTER_MEMBERS {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("cluster {id} would have more than {MAX_CLUSTER_MEMBERS} members"),
                ));
            }
            self.check_new_members(&vms, &map, members, &c.ids())?;
            let create = c.bridge.is_none();
            let bridge = c.bridge.clone().unwrap_or_else(|| k7d_net::cluster_bridge_name(id));
            wire(id, &bridge, create, &new)?;
            if new.iter().any(|m| !m.bridged.is_empty()) {
                c.bridge = Some(bridge.clone());
            }
            let wired = new.clone();
            c.members.extend(new);
            if let Err(e) = self.clusters.save(id, &c) {
                unwire(&wired, create.then_some(bridge.as_str()));
                return Err(internal(e));
            }
            map.insert(id.to_string(), ClusterSlot::Ready(c));
        }
        self.cluster_info(id)
    }

    /// Refuses members that are not live VMs, are named twice, or belong to
    /// a cluster already.
    fn check_new_members(
        &self,
        vms: &std::collections::HashMap<String, Slot>,
        map: &BTreeMap<String, ClusterSlot>,
        members: &[String],
        have: &[String],
    ) -> Result<(), ApiError> {
        for (i, m) in members.iter().enumerate() {
            match vms.get(m) {
                Some(Slot::Vm(_) | Slot::Process(_)) => {}
                _ => return Err(ApiError::new(ErrorCode::NotFound, format!("vm {m} does not exist"))),
            }
            if members[..i].contains(m) || have.contains(m) {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("vm {m} is named twice"),
                ));
            }
            let holder = map.iter().find_map(|(id, slot)| match slot {
                ClusterSlot::Ready(c) if c.has(m) => Some(id.as_str()),
                _ => None,
            });
            if let Some(h) = holder {
                return Err(conflict(format!("vm {m} is a member of cluster {h} already")));
            }
        }
        Ok(())
    }

    /// `cluster_info`.
    pub(super) fn cluster_info(&self, id: &str) -> Result<ClusterInfo, ApiError> {
        let c = self
            .clusters
            .get(id)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("cluster {id} does not exist")))?;
        let ports = c
            .members
            .iter()
            .flat_map(|m| m.ports().map(move |(i, tap)| format!("{}:{i}:{tap}", m.id)))
            .collect();
        let members = c
            .members
            .iter()
            .map(|m| match (self.process(&m.id), self.get(&m.id)) {
                (Some(r), _) => self.process_summary(&r),
                (None, Ok(vm)) => summary(&lock_vm(&vm)),
                (None, Err(_)) => VmSummary {
                    id: m.id.clone(),
                    status: "gone".into(),
                    vcpus: 0,
                    memory_mib: 0,
                    guest: String::new(),
                },
            })
            .collect();
        Ok(ClusterInfo {
            id: id.to_string(),
            members,
            bridge: c.bridge,
            ports,
        })
    }

    /// `cluster_list`.
    pub(super) fn cluster_list(&self) -> ClusterList {
        let clusters = self
            .clusters
            .map()
            .iter()
            .filter_map(|(id, slot)| match slot {
                ClusterSlot::Ready(c) => Some(ClusterSummary {
                    id: id.clone(),
                    members: c.ids(),
                    bridge: c.bridge.clone(),
                }),
                ClusterSlot::Reserved => None,
            })
            .collect();
        ClusterList { clusters }
    }

    /// `cluster_delete`: every member VM, then the bridge, then the
    /// cluster. A member that cannot be deleted stays a member, and the
    /// cluster stays (so does it when its bridge cannot go).
    pub(super) fn cluster_delete(&self, id: &str) -> Result<Deleted, ApiError> {
        let c = self
            .clusters
            .get(id)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("cluster {id} does not exist")))?;
        for m in &c.ids() {
            match self.delete(m) {
                Ok(_) => {}
                Err(e) if e.code == ErrorCode::NotFound => self.clusters.forget_member(m),
                Err(e) => {
                    return Err(ApiError::new(
                        e.code,
                        format!("cluster {id} is kept: deleting its member {m} failed: {e}"),
                    ));
                }
            }
        }
        if let Some(b) = &c.bridge {
            k7d_net::delete_bridge(b).map_err(|e| {
                ApiError::new(
                    ErrorCode::Internal,
                    format!("cluster {id} is kept: its members are deleted, but its bridge {b} is not: {e}"),
                )
            })?;
        }
        self.clusters.map().remove(id);
        self.clusters.remove_record(id).map_err(internal)?;
        Ok(Deleted {
            id: id.to_string(),
            deleted: true,
        })
    }

    /// Whether `id` is a cluster (`fork` then forks the cluster).
    pub(super) fn is_cluster(&self, id: &str) -> bool {
        self.clusters.get(id).is_some()
    }

    /// `fork` of a cluster: every member paused at once (all or none),
    /// `count` children of each built from that instant, the members
    /// resumed; each fork's children form cluster `<id>-f<n>`. Every child
    /// and child cluster, or none.
    pub(super) fn cluster_fork(&self, id: &str, count: u32, reseed: bool) -> Result<Forked, ApiError> {
        let source = self
            .clusters
            .get(id)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("cluster {id} does not exist")))?;
        let members = source.ids();
        if members.is_empty() {
            return Err(conflict(format!("cluster {id} has no members to fork")));
        }
        let total = members.len() as u64 * u64::from(count);
        if total > u64::from(MAX_FORKS) {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "{count} forks of cluster {id}'s {} members make {total} VMs: one fork request makes at most {MAX_FORKS}",
                    members.len()
                ),
            ));
        }
        let remotes: Vec<_> = members.iter().map(|m| self.process(m)).collect();
        if remotes.iter().any(Option::is_some) {
            let Some(remotes) = remotes.into_iter().collect::<Option<Vec<_>>>() else {
                return Err(conflict(format!(
                    "cluster {id} has members in VM processes and members inside the daemon: it cannot be forked under one pause"
                )));
            };
            return self.cluster_fork_processes(id, &source.members, &remotes, count, reseed);
        }
        let handles: Vec<Arc<Mutex<Vm>>> = members.iter().map(|m| self.get(m)).collect::<Result<_, _>>()?;
        let mut child_clusters = self.reserve_child_clusters(id, count)?;
        // Per member: its children's ids, one per fork.
        let held: Vec<Reservation<'_>> = members
            .iter()
            .map(|m| self.reserve_children(m, count, None))
            .collect::<Result<_, _>>()?;
        let ids: Vec<Vec<String>> = (0..count as usize)
            .map(|f| held.iter().map(|r| r.ids()[f].clone()).collect())
            .collect();
        let mut logs = std::collections::HashMap::new();
        for cid in ids.iter().flatten() {
            let log = self.store.runtime_dir(cid).map_err(internal)?.join("serial.log");
            logs.insert(cid.clone(), log);
        }

        // Lock every member in id order (no deadlock with another cluster's
        // fork), keep them in member order.
        let mut order: Vec<usize> = (0..handles.len()).collect();
        order.sort_by(|&a, &b| members[a].cmp(&members[b]));
        let mut guards: Vec<Option<MutexGuard<'_, Vm>>> = (0..handles.len()).map(|_| None).collect();
        for i in order {
            guards[i] = Some(lock_vm(&handles[i]));
        }
        let refs: Vec<&Vm> = guards.iter().flatten().map(|g| &**g).collect();
        let pause = ClusterPause::pause_for_batch(&refs, count, PAUSE_TIMEOUT).map_err(vm_error)?;
        let pause_ms = ms(pause.took());
        let rebased: Vec<String> = pause.rebased().iter().map(|r| r.id.clone()).collect();
        let built = pause.fork_in(
            &ids,
            |cid| self.options(logs.get(cid).map_or(Path::new(""), PathBuf::as_path)),
            Some(&self.shells),
        );
        let source_paused_ms = ms(pause.held_for());
        let resumed = pause.resume();
        drop(refs);
        drop(guards);
        let children = match (built, resumed) {
            (Ok(c), Ok(())) => c,
            (Err(e), Ok(())) => return Err(vm_error(e)),
            (Ok(_), Err(r)) => return Err(vm_error(r)),
            (Err(e), Err(r)) => {
                let e = vm_error(e);
                return Err(ApiError::new(
                    e.code,
                    format!("{e}; resuming cluster {id}'s members afterwards failed too: {r}"),
                ));
            }
        };

        // Each fork is a cluster of the children, each member's with the
        // member's NICs on a bridge of the fork's own, wired before any
        // child runs (a failure drops the children, and the reservation
        // deletes the bridges made so far).
        let mut made = Vec::with_capacity(count as usize);
        for (f, cid) in child_clusters.ids.clone().iter().enumerate() {
            let kids: Vec<Member> = source
                .members
                .iter()
                .zip(&ids[f])
                .map(|(m, child)| Member {
                    id: child.clone(),
                    bridged: m.bridged.clone(),
                })
                .collect();
            let bridge = kids
                .iter()
                .any(|m| !m.bridged.is_empty())
                .then(|| k7d_net::cluster_bridge_name(cid));
            if let Some(b) = &bridge {
                wire(cid, b, true, &kids)?;
                child_clusters.bridges.push(b.clone());
            }
            made.push(Cluster { members: kids, bridge });
        }

        // Adopt (record and start) every child; a failure drops the ones
        // adopted so far and every reservation, which removes them all.
        let mut per_member: Vec<Vec<Arc<Mutex<Vm>>>> = (0..members.len()).map(|_| Vec::new()).collect();
        let mut out = Vec::with_capacity(total as usize);
        for (fork, times) in children.vms.into_iter().zip(children.times) {
            for (m, (child, took)) in fork.into_iter().zip(times).enumerate() {
                let cid = child.id().to_string();
                let log = logs.remove(&cid).unwrap_or_default();
                let shell = child.built_in_shell();
                let (vm, info) = self.adopt(&cid, child, log, true)?;
                per_member[m].push(vm);
                out.push(ForkedChild {
                    info,
                    fork_ms: ms(took),
                    shell,
                });
            }
        }
        for (cid, c) in child_clusters.ids.iter().zip(&made) {
            self.clusters.save(cid, c).map_err(internal)?;
        }
        // The child clusters first, then the children: a child deleted as
        // soon as it is reachable is taken out of its cluster.
        child_clusters.bridges.clear();
        let names = child_clusters.publish(made);
        for (r, vms) in held.into_iter().zip(per_member) {
            r.fill(vms);
        }
        Ok(Forked {
            id: id.to_string(),
            children: out,
            pause_ms,
            source_paused_ms,
            clusters: names,
            rebased,
            warnings: handles.iter().filter_map(|h| super::rng_warning(&lock_vm(h))).collect(),
        })
    }

    /// [`Daemon::cluster_fork`] of a cluster whose members run in VM
    /// processes (`remotes`, in member order): every member paused (all or
    /// none), each member's fork instant exported, the members resumed
    /// (one pause for the whole batch); then each fork's children are built
    /// in VM processes of their own and form cluster `<id>-f<n>`. Every
    /// child and child cluster, or none.
    fn cluster_fork_processes(
        &self,
        id: &str,
        members: &[Member],
        remotes: &[Arc<Mutex<super::processes::Remote>>],
        count: u32,
        reseed: bool,
    ) -> Result<Forked, ApiError> {
        use crate::vstate::vm::VmState;
        let ids_of: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
        let procs = self.forking_processes(id)?;
        for r in remotes {
            let g = r.lock().unwrap_or_else(|p| p.into_inner());
            super::processes::refuse_unbudgeted_disks(g.id(), g.config())?;
        }
        let mut child_clusters = self.reserve_child_clusters(id, count)?;
        let held: Vec<Reservation<'_>> = ids_of
            .iter()
            .map(|m| self.reserve_children(m, count, None))
            .collect::<Result<_, _>>()?;
        procs.ready_for(held.iter().map(|h| h.ids().len()).sum());
        // Lock every member in id order (as the in-daemon fork does).
        let mut order: Vec<usize> = (0..remotes.len()).collect();
        order.sort_by(|&a, &b| ids_of[a].cmp(&ids_of[b]));
        let mut guards: Vec<Option<MutexGuard<'_, super::processes::Remote>>> =
            (0..remotes.len()).map(|_| None).collect();
        for &i in &order {
            guards[i] = Some(remotes[i].lock().unwrap_or_else(|p| p.into_inner()));
        }
        // Given by every fork until one succeeds (`Remote::rng_warned`).
        let warned: Vec<(usize, String)> = guards
            .iter_mut()
            .enumerate()
            .filter_map(|(i, g)| g.as_mut().expect("locked above").rng_warning().map(|w| (i, w)))
            .collect();
        let t = std::time::Instant::now();
        let mut paused = Vec::new();
        let mut captured = Vec::with_capacity(remotes.len());
        let mut failed = None;
        // Pause all, then export each: the one instant every child shares.
        for (i, g) in guards.iter_mut().enumerate() {
            let g = g.as_mut().expect("locked above");
            if matches!(g.status().state, VmState::Running) {
                match g.call(&crate::vmproc::proto::Request::Pause) {
                    Ok(_) => paused.push(i),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        let pause_ms = ms(t.elapsed());
        if failed.is_none() {
            for g in guards.iter_mut() {
                match g.as_mut().expect("locked above").capture() {
                    Ok(c) => captured.push(c),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        let mut resume_failed = Vec::new();
        for &i in &paused {
            if let Err(e) = guards[i]
                .as_mut()
                .expect("locked above")
                .call(&crate::vmproc::proto::Request::Resume)
            {
                resume_failed.push(e.message);
            }
        }
        let source_paused_ms = ms(t.elapsed());
        drop(guards);
        if let Some(e) = failed {
            return Err(match resume_failed.is_empty() {
                true => e,
                false => ApiError::new(
                    e.code,
                    format!(
                        "{e}; resuming cluster {id}'s members afterwards failed too: {}",
                        resume_failed.join("; ")
                    ),
                ),
            });
        }
        if let Some(r) = resume_failed.first() {
            return Err(ApiError::new(ErrorCode::Internal, format!("cluster {id}: {r}")));
        }

        let mut per_member: Vec<Vec<super::processes::Remote>> = (0..members.len()).map(|_| Vec::new()).collect();
        let spec = crate::ChildSpec::default();
        // Each fork is a cluster of the children, each with its member's
        // bridged NICs on a bridge of the fork's own, made now; each
        // child's taps go on it before the child runs (the reservation
        // deletes the bridges if the fork fails).
        let mut made = Vec::with_capacity(count as usize);
        for cid in child_clusters.ids.clone() {
            let bridge = members
                .iter()
                .any(|m| !m.bridged.is_empty())
                .then(|| k7d_net::cluster_bridge_name(&cid));
            if let Some(b) = &bridge {
                k7d_net::create_private_bridge(b).map_err(|e| {
                    ApiError::new(
                        ErrorCode::Internal,
                        format!("cluster {cid}: cannot create its bridge {b}: {e}"),
                    )
                })?;
                child_clusters.bridges.push(b.clone());
            }
            made.push(Cluster {
                members: Vec::with_capacity(members.len()),
                bridge,
            });
        }
        // Children in fork order, member within fork.
        // Each member's children's own overlays of its read-write disks,
        // all made before any child runs.
        let overlays: Vec<Vec<Vec<std::fs::File>>> = captured
            .iter()
            .zip(&ids_of)
            .map(|(cap, m)| super::processes::child_overlays(m, cap, count as usize))
            .collect::<Result<_, _>>()?;
        let mut jobs = Vec::with_capacity(count as usize * members.len());
        for (f, c) in made.iter_mut().enumerate() {
            for (m, r) in held.iter().enumerate() {
                c.members.push(Member {
                    id: r.ids()[f].clone(),
                    bridged: members[m].bridged.clone(),
                });
            }
        }
        for (f, c) in made.iter().enumerate() {
            for (m, cap) in captured.iter().enumerate() {
                jobs.push(super::processes::ChildJob {
                    parent: &ids_of[m],
                    id: &held[m].ids()[f],
                    capture: cap,
                    spec: &spec,
                    bridge: c.bridge.as_deref().map(|b| (b, members[m].bridged.as_slice())),
                    overlays: &overlays[m][f],
                    reseed,
                });
            }
        }
        let (out, built) = self.build_process_children(&procs, &jobs)?;
        drop(jobs);
        for (cid, c) in child_clusters.ids.iter().zip(&made) {
            if let Err(e) = self.clusters.save(cid, c) {
                super::processes::stop_all(&procs, &self.node, built);
                return Err(internal(e));
            }
        }
        // Children in fork order, member within fork: back to each
        // member's reservation, in its fork order.
        for (k, r) in built.into_iter().enumerate() {
            per_member[k % members.len()].push(r);
        }
        // The bridges are the published clusters' now.
        child_clusters.bridges.clear();
        let names = child_clusters.publish(made);
        for (r, remotes) in held.into_iter().zip(per_member) {
            r.fill_processes(remotes);
        }
        for (i, w) in &warned {
            remotes[*i].lock().unwrap_or_else(|p| p.into_inner()).rng_warned(w);
        }
        Ok(Forked {
            id: id.to_string(),
            children: out,
            pause_ms,
            source_paused_ms,
            clusters: names,
            rebased: Vec::new(),
            warnings: warned.into_iter().map(|(_, w)| w).collect(),
        })
    }

    /// Reserves `count` free child cluster ids of `id`: `<id>-f<n>`, the
    /// lowest `n` that no cluster, VM or VM record holds.
    fn reserve_child_clusters(&self, id: &str, count: u32) -> Result<ClusterReservation<'_>, ApiError> {
        let vms = self.vms();
        let mut map = self.clusters.map();
        let mut held = ClusterReservation {
            clusters: &self.clusters,
            ids: Vec::new(),
            bridges: Vec::new(),
        };
        let mut n = 0u32;
        while held.ids.len() < count as usize {
            n += 1;
            let cid = format!("{id}-f{n}");
            if cid.len() > 63 {
                drop(map);
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("cluster id {id} is too long to name its forks"),
                ));
            }
            if !map.contains_key(&cid) && !vms.contains_key(&cid) && self.store.load(&cid).ok().flatten().is_none() {
                map.insert(cid.clone(), ClusterSlot::Reserved);
                held.ids.push(cid);
            }
        }
        drop(map);
        drop(vms);
        Ok(held)
    }
}

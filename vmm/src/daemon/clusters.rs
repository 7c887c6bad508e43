//! Clusters (issue 16, `docs/fork.md`): named sets of the daemon's VMs,
//! forked together under one pause. Cluster ids and VM ids share one
//! namespace (`k7d fork <id>` forks whichever it names); a VM belongs to at
//! most one cluster. A cluster's record (`<state>/clusters/<id>.json`) is
//! written on every change; like a VM's record, one found when a daemon
//! starts belonged to a daemon that is gone, with its members, and is
//! removed.

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
const CLUSTER_RECORD_VERSION: u32 = 1;

/// A cluster as its record holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterRecord {
    version: u32,
    id: String,
    members: Vec<String>,
}

/// A cluster id in the daemon's map.
#[derive(Debug, Clone)]
pub(super) enum ClusterSlot {
    /// Taken by a fork still building the cluster.
    Reserved,
    /// The members, in order.
    Ready(Vec<String>),
}

/// The clusters and their records.
pub(super) struct Clusters {
    dir: PathBuf,
    map: Mutex<BTreeMap<String, ClusterSlot>>,
    /// Makes every temporary record file name unique.
    seq: AtomicU64,
}

impl Clusters {
    /// Opens `<state_dir>/clusters`, removing the records a gone daemon
    /// left (their members went with it); returns the ids removed.
    pub(super) fn open(state_dir: &Path) -> Result<(Self, Vec<String>), std::io::Error> {
        let dir = state_dir.join("clusters");
        fs::create_dir_all(&dir)?;
        let mut removed = Vec::new();
        for e in fs::read_dir(&dir)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !e.file_type()?.is_file() {
                tracing::warn!(entry = %name, "not a cluster record; left alone");
                continue;
            }
            fs::remove_file(e.path())?;
            if let Some(id) = name.strip_suffix(".json").filter(|n| !n.starts_with('.')) {
                removed.push(id.to_string());
            }
        }
        removed.sort();
        Ok((
            Self {
                dir,
                map: Mutex::new(BTreeMap::new()),
                seq: AtomicU64::new(0),
            },
            removed,
        ))
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<String, ClusterSlot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `id` names a cluster (or one being built).
    pub(super) fn contains(&self, id: &str) -> bool {
        self.map().contains_key(id)
    }

    /// The members of cluster `id`, if it is one.
    fn members(&self, id: &str) -> Option<Vec<String>> {
        match self.map().get(id) {
            Some(ClusterSlot::Ready(m)) => Some(m.clone()),
            _ => None,
        }
    }

    /// Writes the record of `id` atomically.
    fn save(&self, id: &str, members: &[String]) -> Result<(), StoreError> {
        let rec = ClusterRecord {
            version: CLUSTER_RECORD_VERSION,
            id: id.to_string(),
            members: members.to_vec(),
        };
        write_json_atomic(&self.dir, id, &rec, &self.seq)
    }

    fn remove_record(&self, id: &str) -> Result<(), std::io::Error> {
        match fs::remove_file(self.dir.join(format!("{id}.json"))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Forgets every cluster and removes its record (the daemon exits, and
    /// the members with it).
    pub(super) fn remove_all(&self) {
        let ids: Vec<String> = std::mem::take(&mut *self.map()).into_keys().collect();
        for id in ids {
            if let Err(e) = self.remove_record(&id) {
                tracing::error!(cluster = %id, error = %e, "cannot remove the cluster's record");
            }
        }
    }

    /// Takes `member` out of whichever cluster holds it (a deleted VM).
    pub(super) fn forget_member(&self, member: &str) {
        let mut map = self.map();
        let holder = map.iter_mut().find_map(|(id, slot)| match slot {
            ClusterSlot::Ready(m) if m.iter().any(|x| x == member) => Some((id.clone(), m)),
            _ => None,
        });
        if let Some((id, members)) = holder {
            members.retain(|x| x != member);
            if let Err(e) = self.save(&id, members) {
                tracing::error!(cluster = %id, error = %e, "cannot rewrite the cluster's record");
            }
        }
    }
}

/// Cluster ids reserved for a fork's children: released (with any record)
/// on drop unless filled.
struct ClusterReservation<'a> {
    clusters: &'a Clusters,
    ids: Vec<String>,
}

impl Drop for ClusterReservation<'_> {
    fn drop(&mut self) {
        let mut map = self.clusters.map();
        for id in &self.ids {
            if matches!(map.get(id), Some(ClusterSlot::Reserved)) {
                map.remove(id);
            }
            let _ = self.clusters.remove_record(id);
        }
    }
}

fn conflict(msg: String) -> ApiError {
    ApiError::new(ErrorCode::Conflict, msg)
}

impl Daemon {
    /// `cluster_create`.
    pub(super) fn cluster_create(&self, id: &str, members: &[String]) -> Result<ClusterInfo, ApiError> {
        {
            // The VM map first, then the cluster map: the order every
            // path that takes both keeps.
            let vms = self.vms();
            if vms.contains_key(id) || self.store.load(id).ok().flatten().is_some() {
                return Err(conflict(format!("{id} is a vm; a cluster needs an id of its own")));
            }
            let mut map = self.clusters.map();
            if map.contains_key(id) {
                return Err(conflict(format!("cluster {id} already exists")));
            }
            self.check_new_members(&vms, &map, members, &[])?;
            map.insert(id.to_string(), ClusterSlot::Ready(members.to_vec()));
        }
        if let Err(e) = self.clusters.save(id, members) {
            self.clusters.map().remove(id);
            return Err(internal(e));
        }
        self.cluster_info(id)
    }

    /// `cluster_add`.
    pub(super) fn cluster_add(&self, id: &str, members: &[String]) -> Result<ClusterInfo, ApiError> {
        {
            let vms = self.vms();
            let mut map = self.clusters.map();
            let Some(ClusterSlot::Ready(have)) = map.get(id) else {
                return Err(ApiError::new(
                    ErrorCode::NotFound,
                    format!("cluster {id} does not exist"),
                ));
            };
            let have = have.clone();
            if have.len() + members.len() > MAX_CLUSTER_MEMBERS {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("cluster {id} would have more than {MAX_CLUSTER_MEMBERS} members"),
                ));
            }
            self.check_new_members(&vms, &map, members, &have)?;
            let mut all = have;
            all.extend(members.iter().cloned());
            if let Err(e) = self.clusters.save(id, &all) {
                return Err(internal(e));
            }
            map.insert(id.to_string(), ClusterSlot::Ready(all));
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
            if !matches!(vms.get(m), Some(Slot::Vm(_))) {
                return Err(ApiError::new(ErrorCode::NotFound, format!("vm {m} does not exist")));
            }
            if members[..i].contains(m) || have.contains(m) {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("vm {m} is named twice"),
                ));
            }
            let holder = map.iter().find_map(|(id, slot)| match slot {
                ClusterSlot::Ready(list) if list.contains(m) => Some(id.as_str()),
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
        let members = self
            .clusters
            .members(id)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("cluster {id} does not exist")))?;
        let members = members
            .iter()
            .map(|m| match self.get(m) {
                Ok(vm) => summary(&lock_vm(&vm)),
                Err(_) => VmSummary {
                    id: m.clone(),
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
        })
    }

    /// `cluster_list`.
    pub(super) fn cluster_list(&self) -> ClusterList {
        let clusters = self
            .clusters
            .map()
            .iter()
            .filter_map(|(id, slot)| match slot {
                ClusterSlot::Ready(m) => Some(ClusterSummary {
                    id: id.clone(),
                    members: m.clone(),
                }),
                ClusterSlot::Reserved => None,
            })
            .collect();
        ClusterList { clusters }
    }

    /// `cluster_delete`: every member VM, then the cluster. A member that
    /// cannot be deleted stays a member, and the cluster stays.
    pub(super) fn cluster_delete(&self, id: &str) -> Result<Deleted, ApiError> {
        let members = self
            .clusters
            .members(id)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("cluster {id} does not exist")))?;
        for m in &members {
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
        self.clusters.map().remove(id);
        self.clusters.remove_record(id).map_err(internal)?;
        Ok(Deleted {
            id: id.to_string(),
            deleted: true,
        })
    }

    /// Whether `id` is a cluster (`fork` then forks the cluster).
    pub(super) fn is_cluster(&self, id: &str) -> bool {
        self.clusters.members(id).is_some()
    }

    /// `fork` of a cluster: every member paused at once (all or none),
    /// `count` children of each built from that instant, the members
    /// resumed; each fork's children form cluster `<id>-f<n>`. Every child
    /// and child cluster, or none.
    pub(super) fn cluster_fork(&self, id: &str, count: u32) -> Result<Forked, ApiError> {
        let members = self
            .clusters
            .members(id)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("cluster {id} does not exist")))?;
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
        let handles: Vec<Arc<Mutex<Vm>>> = members.iter().map(|m| self.get(m)).collect::<Result<_, _>>()?;
        let child_clusters = self.reserve_child_clusters(id, count)?;
        // Per member: its children's ids, one per fork.
        let held: Vec<Reservation<'_>> = members
            .iter()
            .map(|m| self.reserve_children(m, count))
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
        let pause = ClusterPause::pause(&refs, PAUSE_TIMEOUT).map_err(vm_error)?;
        let pause_ms = ms(pause.took());
        let built = pause.fork(&ids, |cid| {
            self.options(logs.get(cid).map_or(Path::new(""), PathBuf::as_path))
        });
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

        // Adopt (record and start) every child; a failure drops the ones
        // adopted so far and every reservation, which removes them all.
        let mut per_member: Vec<Vec<Arc<Mutex<Vm>>>> = (0..members.len()).map(|_| Vec::new()).collect();
        let mut out = Vec::with_capacity(total as usize);
        for (fork, times) in children.vms.into_iter().zip(children.times) {
            for (m, (child, took)) in fork.into_iter().zip(times).enumerate() {
                let cid = child.id().to_string();
                let log = logs.remove(&cid).unwrap_or_default();
                let (vm, info) = self.adopt(&cid, child, log, true)?;
                per_member[m].push(vm);
                out.push(ForkedChild {
                    info,
                    fork_ms: ms(took),
                });
            }
        }
        for (f, cid) in child_clusters.ids.iter().enumerate() {
            self.clusters.save(cid, &ids[f]).map_err(internal)?;
        }
        // The child clusters first, then the children: a child deleted as
        // soon as it is reachable is taken out of its cluster.
        let mut child_clusters = child_clusters;
        let names = std::mem::take(&mut child_clusters.ids);
        {
            let mut map = self.clusters.map();
            for (f, cid) in names.iter().enumerate() {
                map.insert(cid.clone(), ClusterSlot::Ready(ids[f].clone()));
            }
        }
        for (r, vms) in held.into_iter().zip(per_member) {
            r.fill(vms);
        }
        Ok(Forked {
            id: id.to_string(),
            children: out,
            pause_ms,
            source_paused_ms,
            clusters: names,
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

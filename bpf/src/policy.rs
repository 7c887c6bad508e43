use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    path::Path,
};

use aya::maps::{Array, HashMap, Map, PerCpuArray};

use crate::{
    BpfError, PodUid,
    identity::pod_identity,
    loader::{map_error, open_pinned},
};

const VERDICT_ALLOW: u32 = 1;
const VERDICT_DENY: u32 = 2;
const MAX_PEERS: usize = 4096;
const MAX_ADDRS: usize = 16384;
const DEFAULT_DENY_SLOT: usize = 5;

/// A peer pod: its UID (which gives its identity) and its addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub uid: PodUid,
    pub addrs: Vec<IpAddr>,
}

/// A VM's pod policy. Peers not listed have no identity in the datapath.
///
/// Evaluation per IP packet (ARP and neighbour discovery always pass): a
/// denied peer is dropped (`pod-policy-deny`); with `default_deny`, a peer
/// that is not allowed is dropped (`pod-policy-default-deny`); else it passes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub default_deny: bool,
    pub allow: Vec<Peer>,
    pub deny: Vec<Peer>,
}

/// Why a packet was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// The peer is on the deny list.
    PolicyDeny = 1,
    /// Default-deny is on and the peer is not on the allow list.
    DefaultDeny = 2,
    /// The frame was too short to parse.
    Malformed = 3,
    /// The NIC config had no redirect target.
    NoTarget = 4,
}

impl DropReason {
    const ALL: [DropReason; 4] = [
        DropReason::PolicyDeny,
        DropReason::DefaultDeny,
        DropReason::Malformed,
        DropReason::NoTarget,
    ];

    /// The reason's name as shown by `k7d net drops`.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::PolicyDeny => "pod-policy-deny",
            DropReason::DefaultDeny => "pod-policy-default-deny",
            DropReason::Malformed => "malformed-frame",
            DropReason::NoTarget => "no-redirect-target",
        }
    }
}

/// Which way a packet was going.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Guest → pod network (seen at the tap's ingress).
    Egress = 0,
    /// Pod network → guest (seen at the pod device's ingress).
    Ingress = 1,
}

/// One non-zero drop counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropCount {
    pub reason: DropReason,
    pub direction: Direction,
    pub packets: u64,
}

impl std::fmt::Display for DropCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = match self.direction {
            Direction::Egress => "egress",
            Direction::Ingress => "ingress",
        };
        write!(f, "{} {} {}", self.reason.name(), dir, self.packets)
    }
}

fn addr_key(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// Computes (ipcache, verdicts) for `policy`, refusing contradictions.
/// Address → identity, and identity → verdict.
type Compiled = (BTreeMap<[u8; 16], u32>, BTreeMap<u32, u32>);

fn compile(policy: &Policy) -> Result<Compiled, BpfError> {
    let mut verdicts = BTreeMap::new();
    let mut ipcache = BTreeMap::new();
    for (peers, verdict) in [(&policy.allow, VERDICT_ALLOW), (&policy.deny, VERDICT_DENY)] {
        for peer in peers {
            let id = pod_identity(&peer.uid);
            if let Some(old) = verdicts.insert(id, verdict)
                && old != verdict
            {
                return Err(BpfError::InvalidPolicy(format!(
                    "peer {} is both allowed and denied",
                    peer.uid
                )));
            }
            for ip in &peer.addrs {
                if let Some(other) = ipcache.insert(addr_key(*ip), id)
                    && other != id
                {
                    return Err(BpfError::InvalidPolicy(format!("address {ip} is claimed by two peers")));
                }
            }
        }
    }
    if verdicts.len() > MAX_PEERS || ipcache.len() > MAX_ADDRS {
        return Err(BpfError::InvalidPolicy(format!(
            "it names {} peers and {} addresses, over the limits {MAX_PEERS} and {MAX_ADDRS}",
            verdicts.len(),
            ipcache.len()
        )));
    }
    Ok((ipcache, verdicts))
}

fn sync_hash<K: aya::Pod + Ord + Eq + std::hash::Hash>(
    dir: &Path,
    name: &str,
    want: &BTreeMap<K, u32>,
) -> Result<(), BpfError> {
    let data = open_pinned(dir, name)?;
    let mut map: HashMap<_, K, u32> =
        HashMap::try_from(Map::HashMap(data)).map_err(|e| map_error(name, "opened", e))?;
    for (k, v) in want {
        map.insert(k, v, 0).map_err(|e| map_error(name, "written", e))?;
    }
    let stale: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !want.contains_key(k))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    for k in stale {
        map.remove(&k).map_err(|e| map_error(name, "written", e))?;
    }
    Ok(())
}

fn set_default_deny(dir: &Path, on: bool) -> Result<(), BpfError> {
    let data = open_pinned(dir, "k7d_cfg")?;
    let mut cfg: Array<_, [u32; 6]> =
        Array::try_from(Map::Array(data)).map_err(|e| map_error("k7d_cfg", "opened", e))?;
    let mut v = cfg.get(&0, 0).map_err(|e| map_error("k7d_cfg", "read", e))?;
    v[DEFAULT_DENY_SLOT] = u32::from(on);
    cfg.set(0, v, 0).map_err(|e| map_error("k7d_cfg", "written", e))
}

/// Reads the default-deny flag of a NIC.
pub fn read_policy_flag(nic_dir: &Path) -> Result<bool, BpfError> {
    let data = open_pinned(nic_dir, "k7d_cfg")?;
    let cfg: Array<_, [u32; 6]> = Array::try_from(Map::Array(data)).map_err(|e| map_error("k7d_cfg", "opened", e))?;
    let v = cfg.get(&0, 0).map_err(|e| map_error("k7d_cfg", "read", e))?;
    Ok(v[DEFAULT_DENY_SLOT] != 0)
}

/// Replaces the policy of the NIC whose pins are in `nic_dir`. The policy is
/// validated first; an invalid one changes nothing.
pub fn set_policy(nic_dir: &Path, policy: &Policy) -> Result<(), BpfError> {
    let (ipcache, verdicts) = compile(policy)?;
    if !nic_dir.exists() {
        return Err(BpfError::NotAttached(nic_dir.to_path_buf()));
    }
    sync_hash(nic_dir, "k7d_peer_verdict", &verdicts)?;
    sync_hash(nic_dir, "k7d_ipcache", &ipcache)?;
    set_default_deny(nic_dir, policy.default_deny)
}

/// Removes the NIC's policy: everything passes again.
pub fn clear_policy(nic_dir: &Path) -> Result<(), BpfError> {
    set_policy(nic_dir, &Policy::default())
}

/// The NIC's non-zero drop counters, summed over CPUs.
pub fn drops(nic_dir: &Path) -> Result<Vec<DropCount>, BpfError> {
    let data = open_pinned(nic_dir, "k7d_drops")?;
    let map: PerCpuArray<_, u64> =
        PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(|e| map_error("k7d_drops", "opened", e))?;
    let mut out = Vec::new();
    for reason in DropReason::ALL {
        for direction in [Direction::Egress, Direction::Ingress] {
            let idx = reason as u32 * 2 + direction as u32;
            let values = map.get(&idx, 0).map_err(|e| map_error("k7d_drops", "read", e))?;
            let packets: u64 = values.iter().sum();
            if packets > 0 {
                out.push(DropCount {
                    reason,
                    direction,
                    packets,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: &str, ip: &str) -> Peer {
        Peer {
            uid: PodUid::parse(uid).unwrap(),
            addrs: vec![ip.parse().unwrap()],
        }
    }

    #[test]
    fn contradictions_are_refused() {
        let p = Policy {
            default_deny: false,
            allow: vec![peer("b", "10.0.0.1")],
            deny: vec![peer("b", "10.0.0.1")],
        };
        assert!(matches!(compile(&p), Err(BpfError::InvalidPolicy(_))));
        let p = Policy {
            default_deny: false,
            allow: vec![peer("b", "10.0.0.1"), peer("c", "10.0.0.1")],
            deny: vec![],
        };
        assert!(compile(&p).unwrap_err().to_string().contains("claimed by two peers"));
    }

    #[test]
    fn ipv4_keys_are_v4_mapped() {
        let (ipcache, verdicts) = compile(&Policy {
            default_deny: true,
            allow: vec![peer("c", "10.1.2.3")],
            deny: vec![],
        })
        .unwrap();
        let key = *ipcache.keys().next().unwrap();
        assert_eq!(&key[10..], &[0xff, 0xff, 10, 1, 2, 3]);
        assert_eq!(verdicts.values().copied().collect::<Vec<_>>(), vec![VERDICT_ALLOW]);
    }

    #[test]
    fn unattached_dir_is_a_clear_error() {
        let e = drops(Path::new("/nonexistent/k7d/nic0")).unwrap_err();
        assert!(matches!(e, BpfError::NotAttached(_)), "{e}");
    }
}

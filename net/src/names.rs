//! Deterministic interface names and bpffs directory names.
use crate::NetError;

/// Every link k7d creates starts with this prefix (reconcile looks for it).
pub const LINK_PREFIX: &str = "k7d";

/// Names of one NIC's host objects. All fit IFNAMSIZ (15 characters).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NicNames {
    /// `k7dt` + 11 hex digits.
    pub tap: String,
    /// `k7db` + 11 hex digits.
    pub bridge: String,
    /// bpffs directory of the NIC, relative to the bpffs root:
    /// `<vm tag>/nic<idx>`.
    pub bpf_subdir: String,
}

pub(crate) fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separator so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Refuses VM ids that are empty, over 128 bytes or contain control
/// characters or `/`.
pub fn validate_vm_id(vm_id: &str) -> Result<(), NetError> {
    let bad = |reason: &str| NetError::Invalid {
        what: format!("VM id {:?}", vm_id.chars().take(40).collect::<String>()),
        reason: reason.to_string(),
    };
    if vm_id.is_empty() {
        return Err(bad("it is empty"));
    }
    if vm_id.len() > 128 {
        return Err(bad("it is longer than 128 bytes"));
    }
    if vm_id.chars().any(|c| c.is_control() || c == '/') {
        return Err(bad("it contains a control character or '/'"));
    }
    Ok(())
}

/// The 16-hex-digit tag of a VM (its bpffs directory name).
pub fn vm_tag(vm_id: &str) -> String {
    format!("{:016x}", fnv1a64(&[b"k7d-vm", vm_id.as_bytes()]))
}

/// Names for NIC `nic_idx` of VM `vm_id`. 44 bits of hash per name: the
/// chance of any collision among 10,000 NICs is about 3·10⁻⁶.
pub fn nic_names(vm_id: &str, nic_idx: u16) -> NicNames {
    let h = fnv1a64(&[b"k7d-nic", vm_id.as_bytes(), &nic_idx.to_le_bytes()]);
    let hex = format!("{:011x}", h & 0x0fff_ffff_ffff);
    NicNames {
        tap: format!("{LINK_PREFIX}t{hex}"),
        bridge: format!("{LINK_PREFIX}b{hex}"),
        bpf_subdir: format!("{}/nic{nic_idx}", vm_tag(vm_id)),
    }
}

/// The private bridge of cluster `cluster_id` (`docs/fork.md`): `k7dc` +
/// 11 hex digits.
pub fn cluster_bridge_name(cluster_id: &str) -> String {
    let h = fnv1a64(&[b"k7d-cluster", cluster_id.as_bytes()]);
    format!("{LINK_PREFIX}c{:011x}", h & 0x0fff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_fit_ifnamsiz_and_are_deterministic() {
        let n = nic_names("vm-1", 0);
        assert_eq!(n, nic_names("vm-1", 0));
        assert_eq!(n.tap.len(), 15);
        assert_eq!(n.bridge.len(), 15);
        assert!(n.tap.starts_with("k7dt") && n.bridge.starts_with("k7db"));
        assert_ne!(n.tap, nic_names("vm-1", 1).tap);
        assert_ne!(n.tap, nic_names("vm-2", 0).tap);
        assert!(n.bpf_subdir.ends_with("/nic0"));
        let c = cluster_bridge_name("lab");
        assert_eq!(c, cluster_bridge_name("lab"));
        assert_eq!(c.len(), 15);
        assert!(c.starts_with("k7dc"));
        assert_ne!(c, cluster_bridge_name("lab-f1"));
    }

    #[test]
    fn no_collisions_over_many_nics() {
        let mut seen = HashSet::new();
        for vm in 0..5000 {
            for nic in 0..4u16 {
                assert!(seen.insert(nic_names(&format!("vm-{vm}"), nic).tap));
            }
        }
    }

    #[test]
    fn bad_vm_ids_are_refused() {
        for id in ["", "a/b", "x\n", &"v".repeat(129)] {
            assert!(validate_vm_id(id).is_err(), "{id:?}");
        }
        validate_vm_id("4f1c2a9e-vm").unwrap();
    }
}

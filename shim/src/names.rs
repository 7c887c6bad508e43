//! The names a pod gets on the host, derived from containerd's namespace
//! and the sandbox id alone, so the stateless `delete` finds them again.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// A pod's host-side names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodNames {
    /// The daemon's VM id (`pod-<16 hex>`; the daemon's id grammar).
    pub vm_id: String,
    /// The pod's directory under the shim's state dir (sockets).
    pub dir: PathBuf,
    /// The pod VM's hybrid vsock socket.
    pub vsock: PathBuf,
}

/// The names of sandbox `sandbox_id` in containerd namespace `namespace`.
/// Hashed: containerd ids are up to 76 bytes and unix socket paths at most
/// 108, and a hash is a safe path component whatever the id holds.
pub fn pod_names(state_dir: &Path, namespace: &str, sandbox_id: &str) -> PodNames {
    let mut h = Sha256::new();
    h.update(namespace.as_bytes());
    h.update([0]);
    h.update(sandbox_id.as_bytes());
    let hex: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let dir = state_dir.join(&hex);
    PodNames {
        vm_id: format!("pod-{hex}"),
        vsock: dir.join("vsock.sock"),
        dir,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_stable_distinct_per_namespace_and_safe() {
        let a = pod_names(Path::new("/run/k7d/shim"), "default", "t1");
        assert_eq!(a, pod_names(Path::new("/run/k7d/shim"), "default", "t1"));
        let b = pod_names(Path::new("/run/k7d/shim"), "k8s.io", "t1");
        assert_ne!(a.vm_id, b.vm_id);
        let evil = pod_names(Path::new("/run/k7d/shim"), "default", "../../etc");
        assert!(evil.dir.starts_with("/run/k7d/shim") && evil.dir.components().count() == 5);
        assert_eq!(a.vm_id.len(), 4 + 16);
    }
}

//! The names a pod gets on the host, derived from containerd's namespace
//! and the sandbox id alone, so the stateless `delete` finds them again.

use std::os::unix::fs::MetadataExt;
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

/// The file in a pod's directory naming the warm pool member it claimed.
const CLAIMED_VM: &str = "vm";

impl PodNames {
    /// Records in the pod's directory that its VM is `vm_id` (a claimed
    /// warm pool member), for the stateless delete ([`PodNames::resolved`]).
    pub fn record_vm(&self, vm_id: &str) -> std::io::Result<()> {
        std::fs::write(self.dir.join(CLAIMED_VM), vm_id)
    }

    /// Forgets a recorded claim (it failed; its member is gone).
    pub fn forget_vm(&self) {
        let _ = std::fs::remove_file(self.dir.join(CLAIMED_VM));
    }

    /// Every VM id the pod may hold: its VM's, and its own `pod-<hex>` when
    /// that VM is a claimed pool member (a claim that fell back to a cold
    /// boot, or a cold boot after a claim left its record).
    pub fn vm_ids(&self) -> Vec<String> {
        let own = self
            .dir
            .file_name()
            .and_then(|n| n.to_str())
            .map(|hex| format!("pod-{hex}"));
        let mut ids = vec![self.vm_id.clone()];
        ids.extend(own.filter(|o| *o != self.vm_id));
        ids
    }

    /// These names with the VM the pod's directory records, if it records
    /// a warm pool member's id (`pool-<hex>-<n>`; anything else is ignored).
    pub fn resolved(mut self) -> Self {
        if let Ok(id) = std::fs::read_to_string(self.dir.join(CLAIMED_VM))
            && is_pool_member(&id)
        {
            self.vm_id = id;
        }
        self
    }

    /// Removes the pod's directory and everything in it, never entering a
    /// mount (another filesystem, or a bind on the same one: it is left,
    /// and so is the directory holding it) and never following a link: whatever went
    /// wrong before, removing a pod cannot delete a host file outside it.
    pub fn remove_dir(&self) {
        let Ok(md) = std::fs::symlink_metadata(&self.dir) else {
            return;
        };
        if !md.is_dir() {
            return;
        }
        if let Err(e) = remove_tree(&self.dir, md.dev()) {
            tracing::warn!("cannot remove the pod directory {}: {e}", self.dir.display());
        }
    }
}

/// Whether `id` is a warm pool member's VM id (`crate::pool`).
fn is_pool_member(id: &str) -> bool {
    pool_of(id).is_some()
}

/// The pool a warm pool member's VM id (`pool-<16 hex>-<n>`, `crate::pool`)
/// names, its 16 hex digits; none for any other id (the daemon's metrics
/// count members by it).
pub fn pool_of(id: &str) -> Option<&str> {
    let (hex, n) = id.strip_prefix("pool-")?.split_once('-')?;
    (hex.len() == 16
        && hex.bytes().all(|b| b.is_ascii_hexdigit())
        && !n.is_empty()
        && n.len() <= 20
        && n.bytes().all(|b| b.is_ascii_digit()))
    .then_some(hex)
}

/// Whether `p` is the root of a mount (a bind of a directory on the same
/// filesystem keeps its device number, so the device alone cannot tell).
fn is_mount_root(p: &Path) -> std::io::Result<bool> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::other(format!("{} holds a NUL byte", p.display())))?;
    k7d_sys::mount::is_mount_root(&c)
}

/// Removes `dir` and what is under it on device `dev`, entering no mount.
fn remove_tree(dir: &Path, dev: u64) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        let md = std::fs::symlink_metadata(&p)?;
        if md.dev() != dev {
            return Err(std::io::Error::other(format!(
                "{} is on another filesystem",
                p.display()
            )));
        }
        if md.is_dir() && is_mount_root(&p)? {
            return Err(std::io::Error::other(format!("{} is a mount", p.display())));
        }
        if md.is_dir() {
            remove_tree(&p, dev)?;
        } else {
            std::fs::remove_file(&p)?;
        }
    }
    std::fs::remove_dir(dir)
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

    #[test]
    fn a_claimed_pool_member_is_found_again_and_nothing_else_is() {
        let state = std::env::temp_dir().join(format!("k7d-shim-claimed-{}", std::process::id()));
        let n = pod_names(&state, "default", "t1");
        std::fs::create_dir_all(&n.dir).unwrap();
        assert_eq!(n.clone().resolved(), n, "no record: the pod's own VM");
        n.record_vm("pool-0123456789abcdef-7").unwrap();
        let claimed = n.clone().resolved();
        assert_eq!(claimed.vm_id, "pool-0123456789abcdef-7");
        assert_eq!(
            claimed.vm_ids(),
            ["pool-0123456789abcdef-7".to_string(), n.vm_id.clone()]
        );
        assert_eq!(n.vm_ids(), vec![n.vm_id.clone()], "a pod's own VM is one id");
        for bad in [
            "pod-x",
            "pool-0123456789abcdef-",
            "pool-0123456789abcdeg-1",
            "pool-0123456789abcdef-1/..",
            "tmpl-0123456789abcdef",
        ] {
            n.record_vm(bad).unwrap();
            assert_eq!(n.clone().resolved().vm_id, n.vm_id, "{bad} is not a member's id");
        }
        std::fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn a_pod_dir_is_removed_without_following_links_or_crossing_filesystems() {
        let state = std::env::temp_dir().join(format!("k7d-shim-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let outside = state.join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("precious"), b"x").unwrap();
        let n = pod_names(&state, "default", "t1");
        std::fs::create_dir_all(n.dir.join("sub")).unwrap();
        std::fs::write(n.dir.join("sub/f"), b"x").unwrap();
        std::os::unix::fs::symlink(&outside, n.dir.join("link")).unwrap();
        n.remove_dir();
        assert!(!n.dir.exists());
        assert!(outside.join("precious").exists(), "a link is not followed");
        n.remove_dir(); // gone already: nothing to do

        // A directory on another filesystem (here /proc) is never entered.
        let dev = std::fs::symlink_metadata(&state).unwrap().dev();
        let e = remove_tree(Path::new("/proc/self"), dev).unwrap_err();
        assert!(e.to_string().contains("another filesystem"), "{e}");
        assert!(Path::new("/proc/self/status").exists());

        // Nor is a bind of a directory on the same filesystem (the device
        // number is the same): its source keeps its files.
        std::fs::create_dir_all(n.dir.join("bound")).unwrap();
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        let (src, at) = (c(&outside), c(&n.dir.join("bound")));
        k7d_sys::mount::bind(&src, &at).expect("bind mount");
        n.remove_dir();
        k7d_sys::mount::unmount_detach(&at).unwrap();
        assert!(outside.join("precious").exists(), "a bind's source is never emptied");
        assert!(n.dir.join("bound").exists(), "the directory holding the mount is kept");
        std::fs::remove_dir_all(&state).unwrap();
    }
}

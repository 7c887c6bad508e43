//! The pod's cgroup, from the sandbox's OCI spec: where the daemon puts the
//! pod VM's process (`pod_cgroup`), so the kubelet's accounting of the pod
//! (and containerd's `PodSandboxStats`, read from that cgroup) includes
//! its VM, as Kata's `sandbox_cgroup_only` does.
//!
//! containerd gives a CRI sandbox `linux.cgroupsPath` = the pod's
//! `cgroup_parent` + `/` + the sandbox id (the cgroupfs driver): the pod's
//! cgroup is that path's parent. A systemd driver's `slice:prefix:name`
//! is not followed (the VM stays in the daemon's cgroup; said once), nor
//! is containerd's own default, `/<namespace>/<id>`, which a sandbox
//! without a `cgroup_parent` gets: that is no pod's cgroup.

use serde_json::Value;

/// What the sandbox's spec says of its pod's cgroup.
#[derive(Debug, PartialEq, Eq)]
pub enum PodCgroup {
    /// The pod's cgroup, as a path from the cgroup v2 root.
    At(String),
    /// The spec names none (no `linux.cgroupsPath`).
    None,
    /// One the shim does not follow, and why.
    NotFollowed(String),
}

/// The pod's cgroup named by the sandbox's `spec`, in containerd namespace
/// `namespace`.
pub fn of_sandbox(spec: &Value, namespace: &str) -> PodCgroup {
    let Some(path) = spec.pointer("/linux/cgroupsPath").and_then(Value::as_str) else {
        return PodCgroup::None;
    };
    if path.is_empty() {
        return PodCgroup::None;
    }
    if !path.starts_with('/') {
        return PodCgroup::NotFollowed(format!(
            "its cgroupsPath {path:?} is not a cgroupfs path (a systemd driver's slice is not followed)"
        ));
    }
    match path.trim_end_matches('/').rsplit_once('/') {
        Some((parent, _)) if parent.strip_prefix('/') == Some(namespace) => PodCgroup::None,
        Some((parent, _)) if !parent.is_empty() => match k7d_api::api::check_cgroup_parent(parent) {
            Ok(()) => PodCgroup::At(parent.to_string()),
            Err(e) => PodCgroup::NotFollowed(e),
        },
        _ => PodCgroup::NotFollowed(format!("its cgroupsPath {path:?} has no pod cgroup above the sandbox")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_pods_cgroup_is_the_parent_of_the_sandboxs() {
        let spec = json!({"linux": {"cgroupsPath": "/kubepods/burstable/pod1/0123abcd"}});
        assert_eq!(
            of_sandbox(&spec, "k8s.io"),
            PodCgroup::At("/kubepods/burstable/pod1".into())
        );
        assert_eq!(of_sandbox(&json!({"linux": {}}), "k8s.io"), PodCgroup::None);
        assert_eq!(
            of_sandbox(&json!({"linux": {"cgroupsPath": ""}}), "k8s.io"),
            PodCgroup::None
        );
        // containerd's default for a sandbox without a cgroup_parent.
        let default = json!({"linux": {"cgroupsPath": "/k8s.io/0123abcd"}});
        assert_eq!(of_sandbox(&default, "k8s.io"), PodCgroup::None);
        assert_eq!(of_sandbox(&default, "other"), PodCgroup::At("/k8s.io".into()));
        for bad in [
            "kubepods-burstable-pod1.slice:cri-containerd:0123",
            "/0123abcd",
            "/kubepods/../etc/0123",
        ] {
            let got = of_sandbox(&json!({"linux": {"cgroupsPath": bad}}), "k8s.io");
            assert!(matches!(got, PodCgroup::NotFollowed(_)), "{bad}: {got:?}");
        }
    }
}

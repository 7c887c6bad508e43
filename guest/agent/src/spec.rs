//! Rewriting containerd's OCI runtime spec for the guest.
//!
//! containerd wrote the spec for the host: its root, namespace paths,
//! cgroup path, hooks and bind-mount sources name host objects. The guest
//! has none of them, so they are replaced (root, cgroup path) or dropped.

use k7d_agent::proto::is_host_bind;
use serde_json::{Map, Value, json};
use std::collections::HashMap;

/// What [`rewrite`] changed that is worth a log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rewritten {
    /// Destinations of host bind mounts that were dropped.
    pub dropped_mounts: Vec<String>,
    /// Namespaces whose host path was dropped (`type` names).
    pub dropped_namespace_paths: Vec<String>,
    /// Default mounts added because the spec lacked them.
    pub added_mounts: Vec<String>,
    /// `spec.hostname`, if any.
    pub hostname: Option<String>,
    /// The container joins the pod's IPC namespace ([`Pod::ipc`]).
    pub pod_ipc: bool,
    /// The container's /dev/shm is the pod's ([`Pod::shm`]).
    pub pod_shm: bool,
}

/// What the containers of one pod share in its VM: the pod sandbox's
/// stand-in holds them, as the pause container does under runc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// The stand-in's IPC namespace: its pin (`<bundle>/ipcns`, a bind
    /// mount of `/proc/<pid>/ns/ipc`), else `/proc/<pid>/ns/ipc`.
    pub ipc: String,
    /// The pod's /dev/shm (a tmpfs in the VM), if it has one.
    pub shm: Option<String>,
}

/// The mounts every container gets (containerd's defaults), in order.
fn default_mounts() -> [Value; 5] {
    [
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ]
}

fn object<'a>(v: &'a mut Value, what: &str) -> Result<&'a mut Map<String, Value>, String> {
    v.as_object_mut()
        .ok_or_else(|| format!("the spec's {what} is not a JSON object"))
}

/// Rewrites `spec` in place for container `id` whose rootfs is mounted at
/// `rootfs` (an absolute guest path), with a terminal or not:
///
/// * `root` = `{path: rootfs, readonly}` (readonly kept when the spec says true);
/// * `process.terminal` = `terminal` (runc insists it matches `--console-socket`);
/// * every `linux.namespaces` entry loses its `path` (a host path), except a
///   `network` entry with a path, which is removed: joining the pod's
///   network namespace means, in the pod VM, sharing the VM's own network
///   namespace, where the VM's NIC is; and an `ipc` entry with a path,
///   which joins the `pod`'s IPC namespace when there is a pod;
/// * `linux.cgroupsPath` = `/k7d/<id>`;
/// * `hooks` removed (host programs);
/// * a bind mount of a host path gets `carried[its index]` as its source
///   (the guest copy the agent prepared; its options kept, `ro` included),
///   or, at /dev/shm (the CRI's pod-wide shm), the `pod`'s shm, or is
///   removed (the guest has no such path);
/// * containerd's default /proc, /dev, /dev/pts, /dev/shm, /sys mounts added
///   where missing (a CRI spec bind-mounts /dev/shm from the host).
pub fn rewrite(
    spec: &mut Value,
    id: &str,
    rootfs: &str,
    terminal: bool,
    carried: &HashMap<usize, String>,
    pod: Option<&Pod>,
) -> Result<Rewritten, String> {
    let mut out = Rewritten::default();
    let top = object(spec, "top level")?;

    let readonly = top
        .get("root")
        .and_then(|r| r.get("readonly"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    top.insert("root".into(), json!({"path": rootfs, "readonly": readonly}));
    top.remove("hooks");

    match top.get_mut("process") {
        Some(p) => {
            object(p, "process")?.insert("terminal".into(), Value::Bool(terminal));
        }
        None => return Err("the spec has no process".into()),
    }

    out.hostname = top.get("hostname").and_then(Value::as_str).map(str::to_owned);

    let linux = top.entry("linux").or_insert_with(|| json!({}));
    let linux = object(linux, "linux")?;
    linux.insert("cgroupsPath".into(), Value::String(format!("/k7d/{id}")));
    if let Some(ns) = linux.get_mut("namespaces") {
        let ns = ns.as_array_mut().ok_or("the spec's linux.namespaces is not an array")?;
        let mut kept = Vec::with_capacity(ns.len());
        for mut n in ns.drain(..) {
            let entry = object(&mut n, "namespace entry")?;
            let typ = entry.get("type").and_then(Value::as_str).unwrap_or("").to_owned();
            if entry.remove("path").is_some() {
                match (typ.as_str(), pod) {
                    ("network", _) => {
                        out.dropped_namespace_paths.push(typ);
                        continue;
                    }
                    ("ipc", Some(pod)) => {
                        entry.insert("path".into(), Value::String(pod.ipc.clone()));
                        out.pod_ipc = true;
                    }
                    _ => out.dropped_namespace_paths.push(typ),
                }
            }
            kept.push(n);
        }
        *ns = kept;
    }

    let mounts = top.entry("mounts").or_insert_with(|| json!([]));
    let mounts = mounts.as_array_mut().ok_or("the spec's mounts is not an array")?;
    let mut kept = Vec::with_capacity(mounts.len());
    for (i, mut m) in mounts.drain(..).enumerate() {
        if !is_host_bind(&m) {
            kept.push(m);
            continue;
        }
        let dest = m.get("destination").and_then(Value::as_str).unwrap_or("?");
        let pod_shm = pod
            .and_then(|p| p.shm.as_ref())
            .filter(|_| dest.trim_end_matches('/') == "/dev/shm");
        let Some(source) = carried.get(&i).or(pod_shm) else {
            out.dropped_mounts.push(dest.to_owned());
            continue;
        };
        out.pod_shm |= !carried.contains_key(&i);
        let entry = object(&mut m, "mount")?;
        entry.insert("source".into(), Value::String(source.clone()));
        entry.insert("type".into(), Value::String("bind".into()));
        kept.push(m);
    }
    *mounts = kept;
    let dest_of = |m: &Value| {
        m.get("destination")
            .and_then(Value::as_str)
            .map(|d| d.trim_end_matches('/').to_owned())
    };
    let mut front = 0;
    for d in default_mounts() {
        let dest = dest_of(&d).unwrap_or_default();
        if mounts.iter().any(|m| dest_of(m).as_deref() == Some(dest.as_str())) {
            continue;
        }
        // /dev/pts and /dev/shm go right after a /dev mount (else it would hide them).
        let parent = dest.rfind('/').map(|i| &dest[..i]).filter(|p| !p.is_empty());
        let at = match parent.and_then(|p| mounts.iter().position(|m| dest_of(m).as_deref() == Some(p))) {
            Some(i) => {
                let prefix = format!("{}/", parent.unwrap_or_default());
                let mut at = i + 1;
                while mounts.get(at).and_then(dest_of).is_some_and(|d| d.starts_with(&prefix)) {
                    at += 1;
                }
                at
            }
            None => front,
        };
        if at <= front {
            front += 1;
        }
        out.added_mounts.push(dest);
        mounts.insert(at.min(mounts.len()), d);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of a containerd CRI container spec (trimmed).
    fn cri_spec() -> Value {
        json!({
            "ociVersion": "1.1.0",
            "process": {"terminal": true, "args": ["/pause"], "cwd": "/", "env": ["PATH=/bin"]},
            "root": {"path": "rootfs", "readonly": true},
            "hostname": "pod-a",
            "hooks": {"createRuntime": [{"path": "/usr/bin/nvidia-hook"}]},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid"]},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]},
                {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["newinstance"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
                {"destination": "/etc/resolv.conf", "type": "bind",
                 "source": "/var/lib/containerd/sandboxes/x/resolv.conf", "options": ["rbind", "ro"]},
                {"destination": "/dev/shm", "type": "bind", "source": "/run/containerd/sandboxes/x/shm",
                 "options": ["rbind", "ro"]},
                {"destination": "/data", "source": "/srv/data", "options": ["rbind"]},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": []}
            ],
            "linux": {
                "cgroupsPath": "kubepods-besteffort.slice:cri-containerd:abc",
                "namespaces": [
                    {"type": "pid"},
                    {"type": "ipc", "path": "/proc/42/ns/ipc"},
                    {"type": "uts", "path": "/proc/42/ns/uts"},
                    {"type": "mount"},
                    {"type": "network", "path": "/var/run/netns/cni-1234"}
                ],
                "resources": {"memory": {"limit": 1048576}}
            }
        })
    }

    #[test]
    fn a_cri_spec_is_rewritten_for_the_guest() {
        let mut spec = cri_spec();
        let r = rewrite(&mut spec, "c1", "/run/k7d/c/c1/rootfs", false, &HashMap::new(), None).unwrap();
        assert_eq!(spec["root"], json!({"path": "/run/k7d/c/c1/rootfs", "readonly": true}));
        assert_eq!(spec["linux"]["cgroupsPath"], "/k7d/c1");
        assert!(spec.get("hooks").is_none());
        assert_eq!(spec["process"]["terminal"], false);
        assert_eq!(spec["process"]["args"], json!(["/pause"]), "the process is kept");
        assert_eq!(
            spec["linux"]["resources"],
            json!({"memory": {"limit": 1048576}}),
            "resources are kept"
        );
        assert_eq!(
            spec["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]),
            "paths dropped; a joined network namespace means the VM's own"
        );
        assert_eq!(r.dropped_namespace_paths, ["ipc", "uts", "network"]);
        assert_eq!(r.dropped_mounts, ["/etc/resolv.conf", "/dev/shm", "/data"]);
        assert_eq!(r.added_mounts, ["/dev/shm"]);
        assert_eq!(r.hostname.as_deref(), Some("pod-a"));
        let dests: Vec<&str> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        assert_eq!(dests, ["/proc", "/dev", "/dev/pts", "/dev/shm", "/sys", "/tmp"]);
        assert_eq!(spec["mounts"][3]["type"], "tmpfs");
    }

    #[test]
    fn a_pod_container_joins_the_pods_ipc_namespace_and_shm() {
        let pod = Pod {
            ipc: "/proc/7/ns/ipc".into(),
            shm: Some("/run/k7d/c/sb/shm".into()),
        };
        let mut spec = cri_spec();
        let r = rewrite(&mut spec, "c1", "/r", false, &HashMap::new(), Some(&pod)).unwrap();
        assert_eq!(
            spec["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "ipc", "path": "/proc/7/ns/ipc"}, {"type": "uts"}, {"type": "mount"}]),
            "the pod's IPC namespace, not the host path"
        );
        assert!(r.pod_ipc && r.pod_shm);
        assert_eq!(r.dropped_namespace_paths, ["uts", "network"]);
        assert_eq!(r.dropped_mounts, ["/etc/resolv.conf", "/data"]);
        assert!(
            r.added_mounts.is_empty(),
            "no per-container /dev/shm: {:?}",
            r.added_mounts
        );
        let shm: Vec<&Value> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["destination"] == "/dev/shm")
            .collect();
        assert_eq!(
            shm,
            [&json!({"destination": "/dev/shm", "type": "bind",
                     "source": "/run/k7d/c/sb/shm", "options": ["rbind", "ro"]})]
        );

        // A pod without a shm of its own: the container's own tmpfs.
        let mut spec = cri_spec();
        let no_shm = Pod { shm: None, ..pod };
        let r = rewrite(&mut spec, "c1", "/r", false, &HashMap::new(), Some(&no_shm)).unwrap();
        assert!(r.pod_ipc && !r.pod_shm);
        assert_eq!(r.added_mounts, ["/dev/shm"]);
    }

    #[test]
    fn carried_binds_get_their_guest_source_and_keep_their_options() {
        let mut spec = cri_spec();
        let carried = HashMap::from([
            (4, "/run/k7d/c/c1/binds/ro/0".to_owned()),
            (6, "/run/k7d/c/c1/binds/rw/1".to_owned()),
        ]);
        let r = rewrite(&mut spec, "c1", "/r", false, &carried, None).unwrap();
        assert_eq!(r.dropped_mounts, ["/dev/shm"], "the uncarried bind is dropped");
        let m = spec["mounts"].as_array().unwrap();
        let find = |d: &str| m.iter().find(|x| x["destination"] == d).unwrap().clone();
        assert_eq!(
            find("/etc/resolv.conf"),
            json!({"destination": "/etc/resolv.conf", "type": "bind",
                   "source": "/run/k7d/c/c1/binds/ro/0", "options": ["rbind", "ro"]})
        );
        assert_eq!(
            find("/data"),
            json!({"destination": "/data", "type": "bind",
                   "source": "/run/k7d/c/c1/binds/rw/1", "options": ["rbind"]})
        );
        assert_eq!(find("/dev/shm")["type"], "tmpfs", "the guest's own /dev/shm");
    }

    #[test]
    fn a_writable_root_stays_writable_and_missing_defaults_are_added_in_order() {
        let mut spec = json!({"process": {"args": ["sh"]}, "root": {"path": "/host/rootfs"}});
        let r = rewrite(&mut spec, "x", "/b/rootfs", true, &HashMap::new(), None).unwrap();
        assert_eq!(spec["root"], json!({"path": "/b/rootfs", "readonly": false}));
        assert_eq!(spec["process"]["terminal"], true);
        assert_eq!(spec["linux"]["cgroupsPath"], "/k7d/x");
        assert_eq!(r.added_mounts, ["/proc", "/dev", "/dev/pts", "/dev/shm", "/sys"]);
        let dests: Vec<&str> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        assert_eq!(dests, ["/proc", "/dev", "/dev/pts", "/dev/shm", "/sys"]);
    }

    #[test]
    fn malformed_specs_are_refused_with_a_reason() {
        for bad in [
            json!([1]),
            json!({"root": {}}),
            json!({"process": 3}),
            json!({"process": {}, "linux": {"namespaces": 1}}),
            json!({"process": {}, "mounts": {}}),
        ] {
            let mut s = bad.clone();
            assert!(
                rewrite(&mut s, "x", "/r", false, &HashMap::new(), None).is_err(),
                "{bad}"
            );
        }
    }
}

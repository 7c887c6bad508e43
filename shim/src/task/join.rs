//! App containers joining a CRI pod's VM (`io.kubernetes.cri.container-type
//! = container`): the sandbox's create booted the VM with empty read-only
//! drives; an app container's image (and its bind mounts' image) go into
//! free drives through the daemon (`Daemon::set_medium`, a medium change
//! the guest sees as a capacity change), the agent creates the container
//! from them, and its delete gives the drives back.
//!
//! Why drives made at boot and not PCI hotplug: a medium change is one
//! config interrupt the stock virtio-blk driver handles, the VM's device
//! set never changes (a fork or snapshot sees the same functions), and
//! Firecracker-backed Kata does the same (placeholder drives swapped by
//! `PATCH /drives`).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use containerd_shim::TtrpcResult;
use containerd_shim::api;
use containerd_shim::protos::ttrpc::Code;
use k7d_agent::proto::{Binds, BlockMount, CreateContainer, Request};

use super::{BOOT_TIMEOUT, CALL_TIMEOUT, CREATE_TIMEOUT, Inner, SANDBOX_ID, err, from_call, internal, pref};
use crate::config::ShimConfig;
use crate::{binds, stdio};

/// A pod VM drive's serial in the guest.
fn serial(drive: u32) -> String {
    format!("k7d-disk{drive}")
}

/// Where an app container's own files (its bind mounts' image) live: the
/// pod's private directory. Container ids are safe path components
/// (`proto::valid_id`, checked before this).
fn container_dir(pod_dir: &Path, id: &str) -> PathBuf {
    pod_dir.join("containers").join(id)
}

impl Inner {
    /// Creates app container `req.id` in the pod VM of the sandbox it names:
    /// waits for the VM while the sandbox's create boots it, packs the
    /// images, takes free drives, and has the agent create the container.
    /// A failure (or a finish past containerd's deadline) gives back
    /// everything it took.
    pub(super) fn create_in_pod(
        self: &Arc<Self>,
        cfg: &ShimConfig,
        bundle: &Path,
        spec: serde_json::Value,
        ann: &std::collections::HashMap<String, String>,
        req: &api::CreateTaskRequest,
        deadline: Option<Instant>,
    ) -> TtrpcResult<u32> {
        let sandbox = ann.get(SANDBOX_ID).map(String::as_str).unwrap_or_default();
        let (names, agent, host_pid) = {
            let mut st = self.lock();
            let until = Instant::now() + BOOT_TIMEOUT;
            while st.booting {
                let now = Instant::now();
                if now >= until {
                    break;
                }
                st = self
                    .changed
                    .wait_timeout(st, until - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let Some(pod) = st.pod.as_ref().filter(|_| st.tasks.contains_key(sandbox)) else {
                return Err(err(
                    Code::FAILED_PRECONDITION,
                    format!(
                        "app container {} joins sandbox {sandbox:?}, whose pod VM this shim does not run",
                        req.id
                    ),
                ));
            };
            if pod.dead {
                return Err(err(
                    Code::UNAVAILABLE,
                    format!("the pod VM of sandbox {sandbox} has stopped"),
                ));
            }
            if st.tasks.contains_key(&req.id) || pod.drives.iter().any(|d| d.as_deref() == Some(req.id.as_str())) {
                return Err(err(
                    Code::ALREADY_EXISTS,
                    format!("container {} already exists in this pod", req.id),
                ));
            }
            (pod.names.clone(), pod.agent.clone(), pod.host_pid)
        };
        let erofs = super::packed_rootfs(cfg, bundle, &spec, req)?;
        let dir = container_dir(&names.dir, &req.id);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| err(Code::INTERNAL, format!("cannot create {}: {e}", dir.display())))?;
        let carried = match binds::pack(&spec, &dir, cfg.bind_max_mib << 20) {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(err(Code::INVALID_ARGUMENT, format!("{e:#}")));
            }
        };
        let mut images = vec![erofs];
        images.extend(carried.as_ref().map(|c| c.image.clone()));
        let drives = match self.take_drives(&req.id, images.len()) {
            Ok(d) => d,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let paths = stdio::Paths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let mut created = false;
        let r = (|| {
            for (d, image) in drives.iter().zip(&images) {
                self.daemon
                    .set_medium(&names.vm_id, *d, Some(image))
                    .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
            }
            let mut conn = agent
                .connect(CALL_TIMEOUT)
                .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
            conn.set_timeout(Some(CREATE_TIMEOUT)).map_err(|e| {
                err(
                    Code::INTERNAL,
                    format!("cannot set the agent connection's timeout: {e}"),
                )
            })?;
            conn.call(&Request::CreateContainer(CreateContainer {
                id: req.id.clone(),
                spec,
                rootfs: BlockMount {
                    serial: serial(drives[0]),
                    fstype: "erofs".into(),
                },
                stdio: paths.spec(),
                binds: carried.map(|c| Binds {
                    disk: BlockMount {
                        serial: serial(drives[1]),
                        fstype: "erofs".into(),
                    },
                    mounts: c.mounts,
                }),
            }))
            .map_err(from_call)?;
            created = true;
            let relays = stdio::start(&agent, &pref(&req.id, ""), &paths).map_err(internal)?;
            if deadline.is_some_and(|d| Instant::now() > d) {
                return Err(err(
                    Code::DEADLINE_EXCEEDED,
                    format!("creating {} took past containerd's deadline; rolled back", req.id),
                ));
            }
            Ok(relays)
        })();
        let relays = match r {
            Ok(relays) => relays,
            Err(e) => {
                tracing::warn!("create of {} in pod {} failed, rolling back: {e}", req.id, names.vm_id);
                if created {
                    let _ = self.call(&Request::DeleteContainer {
                        container: req.id.clone(),
                    });
                }
                self.give_back_drives(&names.vm_id, &names.dir, &req.id, &drives);
                return Err(e);
            }
        };
        let st = self.lock();
        self.record_created(st, req, relays, drives);
        self.announce_created(req, host_pid)
    }

    /// Marks `n` free drives of the pod VM as `id`'s, lowest first; none
    /// when fewer are free.
    fn take_drives(&self, id: &str, n: usize) -> TtrpcResult<Vec<u32>> {
        let mut st = self.lock();
        let Some(pod) = st.pod.as_mut() else {
            return Err(err(Code::UNAVAILABLE, "the pod VM is gone"));
        };
        let free: Vec<usize> = pod
            .drives
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_none())
            .map(|(i, _)| i)
            .take(n)
            .collect();
        if free.len() < n {
            return Err(err(
                Code::RESOURCE_EXHAUSTED,
                format!(
                    "container {id} needs {n} free drives in its pod VM and {} are free (pod_drives in the shim config sets how many a pod VM boots with)",
                    free.len()
                ),
            ));
        }
        let mut taken = Vec::with_capacity(n);
        for i in free {
            pod.drives[i] = Some(id.to_string());
            taken.push(u32::try_from(i).map_err(|_| err(Code::INTERNAL, "a drive index overflows"))?);
        }
        Ok(taken)
    }

    /// Ejects `drives`' media (the agent has unmounted them: the container
    /// is deleted) and frees them; removes the container's own files. A
    /// failed eject is logged: the next container's image replaces it.
    pub(super) fn give_back_drives(&self, vm_id: &str, pod_dir: &Path, id: &str, drives: &[u32]) {
        for d in drives {
            if let Err(e) = self.daemon.set_medium(vm_id, *d, None) {
                tracing::warn!("cannot eject drive {d} of the pod VM {vm_id}: {e:#}");
            }
        }
        if let Some(pod) = self.lock().pod.as_mut() {
            for d in drives {
                if let Some(slot) = pod.drives.get_mut(*d as usize)
                    && slot.as_deref() == Some(id)
                {
                    *slot = None;
                }
            }
        }
        let dir = container_dir(pod_dir, id);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("cannot remove {}: {e}", dir.display());
        }
    }
}

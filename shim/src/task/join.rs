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
use containerd_shim::protos::ttrpc::{self, Code};
use k7d_agent::proto::{Binds, BlockMount, CreateContainer, Request};

use super::{Inner, SANDBOX_ID, err, for_creates, from_call, internal, pref};
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

/// Makes a container's directory in the pod's (never the pod's directory
/// itself: a pod removed meanwhile is not recreated); one left by an
/// earlier attempt of the same id is replaced.
fn make_container_dir(dir: &Path) -> TtrpcResult<()> {
    let mk = |p: &Path| std::fs::DirBuilder::new().mode(0o700).create(p);
    let parent = dir.parent().unwrap_or(dir);
    if let Err(e) = mk(parent)
        && e.kind() != std::io::ErrorKind::AlreadyExists
    {
        return Err(err(
            Code::UNAVAILABLE,
            format!("cannot create {}: {e}", parent.display()),
        ));
    }
    let _ = std::fs::remove_dir_all(dir);
    mk(dir).map_err(|e| err(Code::INTERNAL, format!("cannot create {}: {e}", dir.display())))
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
            let until = Instant::now() + cfg.boot_timeout();
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
            if st.tasks.contains_key(&req.id) || st.joining.contains(&req.id) {
                return Err(err(
                    Code::ALREADY_EXISTS,
                    format!("container {} already exists in this pod", req.id),
                ));
            }
            let taken = (pod.names.clone(), pod.agent.clone(), pod.host_pid);
            st.joining.insert(req.id.clone());
            taken
        };
        let r = self.join(cfg, bundle, spec, req, deadline, &names, &agent, host_pid);
        self.lock().joining.remove(&req.id);
        r
    }

    /// [`Inner::create_in_pod`] once the id is taken.
    #[allow(clippy::too_many_arguments)]
    fn join(
        self: &Arc<Self>,
        cfg: &ShimConfig,
        bundle: &Path,
        spec: serde_json::Value,
        req: &api::CreateTaskRequest,
        deadline: Option<Instant>,
        names: &crate::names::PodNames,
        agent: &crate::agent::Agent,
        host_pid: u32,
    ) -> TtrpcResult<u32> {
        let t0 = Instant::now();
        let erofs = super::packed_rootfs(cfg, bundle, &spec, req)?;
        let dir = container_dir(&names.dir, &req.id);
        make_container_dir(&dir)?;
        let carried = match binds::pack(&spec, &dir, cfg.bind_max_mib << 20) {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(err(Code::INVALID_ARGUMENT, format!("{e:#}")));
            }
        };
        let mut images = vec![erofs];
        images.extend(carried.as_ref().map(|c| c.image.clone()));
        // Each image's size: the agent waits for its drive to show exactly
        // that (not a previous medium's).
        let mut sectors = Vec::with_capacity(images.len());
        for i in &images {
            match std::fs::metadata(i) {
                Ok(m) => sectors.push(m.len() / 512),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    return Err(err(
                        Code::INTERNAL,
                        format!("cannot read the size of {}: {e}", i.display()),
                    ));
                }
            }
        }
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
        // Set once the agent was asked to create: a rollback then deletes
        // (it may have finished after a lost reply).
        let mut asked = false;
        let r = (|| {
            let t_images = Instant::now();
            for (d, image) in drives.iter().zip(&images) {
                self.daemon
                    .set_medium(&names.vm_id, *d, Some(image))
                    .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
            }
            let t_media = Instant::now();
            let mut conn = agent
                .connect(agent.limits().call)
                .map_err(|e| err(Code::UNAVAILABLE, format!("{e:#}")))?;
            for_creates(&conn, agent)?;
            asked = true;
            conn.call(&Request::CreateContainer(CreateContainer {
                id: req.id.clone(),
                spec,
                rootfs: BlockMount {
                    serial: serial(drives[0]),
                    fstype: "erofs".into(),
                    sectors: Some(sectors[0]),
                },
                stdio: paths.spec(),
                binds: carried.map(|c| Binds {
                    disk: BlockMount {
                        serial: serial(drives[1]),
                        fstype: "erofs".into(),
                        sectors: sectors.get(1).copied(),
                    },
                    mounts: c.mounts,
                }),
                node: Some(crate::limits::Node::get().sysctls.clone()),
            }))
            .map_err(from_call)?;
            let relays = stdio::start(agent, &pref(&req.id, ""), &paths).map_err(internal)?;
            // Where an app container's create goes (docs/containerd.md,
            // "Pod start phases").
            let ms = |a: Instant, b: Instant| b.duration_since(a).as_millis();
            tracing::info!(
                "{} joined the pod VM {}: images {} ms, media {} ms, container {} ms",
                req.id,
                names.vm_id,
                ms(t0, t_images),
                ms(t_images, t_media),
                ms(t_media, Instant::now())
            );
            if deadline.is_some_and(|d| Instant::now() > d) {
                return Err(err(
                    Code::DEADLINE_EXCEEDED,
                    format!("creating {} took past containerd's deadline; rolled back", req.id),
                ));
            }
            Ok(relays)
        })();
        // The pod VM must still be the one the drives were taken in.
        let r = r.and_then(|relays| {
            let st = self.lock();
            match st.pod.as_ref() {
                Some(p) if p.names.vm_id == names.vm_id && !p.dead => Ok((st, relays)),
                _ => Err(err(
                    Code::UNAVAILABLE,
                    format!("the pod VM {} went away while {} was created", names.vm_id, req.id),
                )),
            }
        });
        match r {
            Ok((st, relays)) => {
                self.record_created(st, req, relays, drives);
                self.announce_created(req, host_pid)
            }
            Err(e) => {
                tracing::warn!("create of {} in pod {} failed, rolling back: {e}", req.id, names.vm_id);
                // A drive is reused only when the agent surely let go of it.
                let clean = !asked
                    || match self.call(&Request::DeleteContainer {
                        container: req.id.clone(),
                    }) {
                        Ok(_) => true,
                        Err(ttrpc::Error::RpcStatus(s)) => s.code() == Code::NOT_FOUND,
                        Err(_) => false,
                    };
                self.give_back_drives(&names.vm_id, &names.dir, &req.id, &drives, clean);
                Err(e)
            }
        }
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

    /// Ejects `drives`' media and frees them for the next container when
    /// `clean` (the agent unmounted the container's images for good) and
    /// the eject worked; otherwise the drive stays taken, marked unusable:
    /// a mount left in the guest could reuse its superblock for the next
    /// medium. Removes the container's own files.
    pub(super) fn give_back_drives(&self, vm_id: &str, pod_dir: &Path, id: &str, drives: &[u32], clean: bool) {
        let mut freed = Vec::new();
        for d in drives {
            match self.daemon.set_medium(vm_id, *d, None) {
                Ok(()) if clean => freed.push(*d),
                Ok(()) => {
                    tracing::warn!("drive {d} of the pod VM {vm_id} is not reused: {id}'s images may still be mounted")
                }
                Err(e) => tracing::warn!("cannot eject drive {d} of the pod VM {vm_id}, so it is not reused: {e:#}"),
            }
        }
        if let Some(pod) = self.lock().pod.as_mut().filter(|p| p.names.vm_id == vm_id) {
            for d in drives {
                if let Some(slot) = pod.drives.get_mut(*d as usize)
                    && slot.as_deref() == Some(id)
                {
                    *slot = if freed.contains(d) {
                        None
                    } else {
                        Some(format!("{id} (unusable)"))
                    };
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

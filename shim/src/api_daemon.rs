//! [`Daemon`] over the k7d daemon's API socket (`k7d_api`'s client and
//! wire types): the shim stays a thin client of the daemon that owns every
//! VM. A pod VM's `VmConfig` is made here, from the shim's [`PodVmSpec`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use k7d_api::api::{
    ApiError, CreateArgs, ErrorCode, ForkArgs, MediumArgs, NicAttachArgs, PodCgroupArgs, Reply, Request,
};
use k7d_api::client::Client;
use k7d_api::config::{
    DatapathNicConfig, DevicesConfig, DiskConfig, GuestSpec, NicConfig, SerialConfig, VmConfig, VsockConfig,
    valid_pod_name, valid_pod_namespace,
};
use k7d_api::state::VmState;

use crate::daemon::{Daemon, ForkedPod, PodNic, PodVmSpec, VmLife};

/// A quick call's limit (life, pause, resume, version).
const QUICK: Duration = Duration::from_secs(2);
/// A delete's limit (connect and answer each): the shim's `delete` must
/// end inside containerd's 5 s.
const DELETE: Duration = Duration::from_secs(2);
/// A medium change's limit (opening the image, a worker park and restart).
const MEDIUM: Duration = Duration::from_secs(5);
/// A create's limit (building the VM, not its boot).
const CREATE: Duration = Duration::from_secs(30);

/// The daemon at one socket.
struct ApiDaemon {
    socket: PathBuf,
}

/// The daemon at `socket` (connected per call).
pub fn connect(socket: &Path) -> Arc<dyn Daemon> {
    Arc::new(ApiDaemon {
        socket: socket.to_path_buf(),
    })
}

impl ApiDaemon {
    fn request(&self, req: &Request, timeout: Duration) -> Result<Reply, ApiError> {
        Client::connect_with_timeout(&self.socket, timeout)?.request(req)
    }
}

/// The daemon's config of a pod VM.
fn vm_config(spec: &PodVmSpec) -> VmConfig {
    VmConfig {
        id: Some(spec.id.clone()),
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        guest: GuestSpec::Linux {
            kernel: spec.kernel.clone(),
            initrd: Some(spec.initramfs.clone()),
            cmdline: Some(spec.cmdline.clone()),
        },
        serial: SerialConfig::default(),
        devices: DevicesConfig {
            rng: true,
            disks: spec
                .disks
                .iter()
                .map(|p| DiskConfig {
                    path: Some(p.clone()),
                    read_only: true,
                })
                .chain((0..spec.empty_drives).map(|_| DiskConfig::empty()))
                .collect(),
            nics: spec
                .nic
                .iter()
                .map(|n| NicConfig {
                    datapath: Some(datapath(n)),
                    ..Default::default()
                })
                // A template's bare tap: the userspace plane, as each
                // child's datapath NIC has (its driver state carries over).
                .chain(spec.bare_nic.then(|| NicConfig {
                    vhost: Some(false),
                    ..Default::default()
                }))
                .collect(),
            vsock: Some(VsockConfig {
                cid: spec.vsock_cid,
                uds: spec.vsock_uds.clone(),
            }),
            // A Linux guest's default: on (a fork-started pod's agent
            // reseeds too, for kernels without the driver).
            vmgenid: None,
        },
        fork: Default::default(),
    }
}

fn datapath(n: &PodNic) -> DatapathNicConfig {
    DatapathNicConfig {
        mode: n.mode.clone(),
        netns: n.netns.clone(),
        pod_if: n.pod_if.clone(),
        pod_uid: n.pod_uid.clone(),
        // Labels only: a name Kubernetes would not have made is left out
        // (with a warning) rather than failing the pod.
        pod_namespace: label(&n.pod_namespace, valid_pod_namespace, "namespace"),
        pod_name: label(&n.pod_name, valid_pod_name, "name"),
    }
}

fn label(v: &Option<String>, valid: fn(&str) -> bool, what: &str) -> Option<String> {
    let v = v.as_deref()?;
    if valid(v) {
        Some(v.to_string())
    } else {
        tracing::warn!(value = %v.escape_debug(), "the pod {what} is not a Kubernetes name: left out of the VM's metrics labels");
        None
    }
}

impl Daemon for ApiDaemon {
    fn fork(&self, template: &str, child: &ForkedPod) -> anyhow::Result<()> {
        let req = Request::Fork(ForkArgs {
            id: template.to_string(),
            count: 1,
            name: Some(child.id.clone()),
            nics: child.nic.iter().map(|n| Some(datapath(n))).collect(),
            vsock_uds: Some(child.vsock_uds.clone()),
            // Its agent is given the pod's identity (entropy included) next.
            reseed_by_caller: true,
        });
        self.request(&req, CREATE)?;
        Ok(())
    }

    fn create(&self, spec: &PodVmSpec) -> anyhow::Result<()> {
        let req = Request::Create(CreateArgs {
            config: vm_config(spec),
            start: true,
        });
        self.request(&req, CREATE)?;
        Ok(())
    }

    fn delete(&self, id: &str) -> anyhow::Result<()> {
        match self.request(&Request::Delete(id.to_string()), DELETE) {
            Ok(_) => Ok(()),
            Err(e) if e.code == ErrorCode::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn pause(&self, id: &str) -> anyhow::Result<()> {
        self.request(&Request::Pause(id.to_string()), QUICK)?;
        Ok(())
    }

    fn resume(&self, id: &str) -> anyhow::Result<()> {
        self.request(&Request::Resume(id.to_string()), QUICK)?;
        Ok(())
    }

    fn life(&self, id: &str) -> anyhow::Result<VmLife> {
        match self.request(&Request::Info(id.to_string()), QUICK) {
            Ok(Reply::Vm(info)) => Ok(match info.state {
                VmState::Created | VmState::Running => VmLife::Running,
                VmState::Paused => VmLife::Paused,
                VmState::Stopped { reason } => VmLife::Stopped(reason.to_string()),
            }),
            Ok(_) => bail!(
                "the k7d daemon at {} answered info with another type",
                self.socket.display()
            ),
            Err(e) if e.code == ErrorCode::NotFound => Ok(VmLife::Gone),
            // Refused or missing: no daemon listens (it was killed). Anything
            // else (a slow or busy daemon) is an error, not a death. Asked
            // only after a failure: a poll makes one connection.
            Err(e) => match std::os::unix::net::UnixStream::connect(&self.socket) {
                Err(c)
                    if matches!(
                        c.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) =>
                {
                    Ok(VmLife::DaemonGone)
                }
                _ => Err(e.into()),
            },
        }
    }

    fn set_medium(&self, id: &str, disk: u32, path: Option<&Path>) -> anyhow::Result<()> {
        let req = Request::Medium(MediumArgs {
            id: id.to_string(),
            disk,
            path: path.map(Path::to_path_buf),
        });
        self.request(&req, MEDIUM)?;
        Ok(())
    }

    fn attach_nic(&self, id: &str, nic: &PodNic) -> anyhow::Result<()> {
        let req = Request::NicAttach(NicAttachArgs {
            id: id.to_string(),
            nic: 0,
            datapath: datapath(nic),
        });
        self.request(&req, CREATE)?;
        Ok(())
    }

    fn pod_cgroup(&self, id: &str, cgroup_parent: &str) -> anyhow::Result<()> {
        let req = Request::PodCgroup(PodCgroupArgs {
            id: id.to_string(),
            cgroup_parent: cgroup_parent.to_string(),
        });
        self.request(&req, QUICK)?;
        Ok(())
    }

    fn pid(&self) -> anyhow::Result<u32> {
        match self.request(&Request::Version, QUICK)? {
            Reply::Version(v) => Ok(v.pid),
            _ => bail!(
                "the k7d daemon at {} answered version with another type",
                self.socket.display()
            ),
        }
    }

    fn vm_pid(&self, id: &str) -> anyhow::Result<Option<u32>> {
        match self.request(&Request::Info(id.to_string()), QUICK)? {
            Reply::Vm(info) => Ok(info.vm_process.map(|p| p.pid)),
            _ => bail!(
                "the k7d daemon at {} answered info with another type",
                self.socket.display()
            ),
        }
    }
}

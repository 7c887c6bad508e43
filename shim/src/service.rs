//! The shim's life as containerd drives it (`containerd_shim::Shim`):
//! `start` (one server per sandbox: app containers get the sandbox's
//! address), the server, and the stateless `delete`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, DeleteResponse, ExitSignal, Flags, Shim, StartOpts};

use crate::config::ShimConfig;
use crate::names::pod_names;
use crate::task::{self, CONTAINER_TYPE, SANDBOX_ID, Service};

/// The shim of one sandbox.
pub struct K7dShim {
    id: String,
    namespace: String,
    bundle: PathBuf,
    exit: Arc<ExitSignal>,
}

fn other(msg: String) -> containerd_shim::Error {
    containerd_shim::Error::Other(msg)
}

/// The sandbox whose shim serves container `id` of the bundle's spec: its
/// own (a sandbox, or a plain `ctr run`), or the CRI sandbox it joins.
fn grouping(bundle: &Path, id: &str) -> String {
    let ann = crate::task::read_bundle_annotations(bundle);
    match (ann.get(CONTAINER_TYPE).map(String::as_str), ann.get(SANDBOX_ID)) {
        (Some("container"), Some(sb)) if k7d_agent::proto::valid_id(sb) => sb.clone(),
        _ => id.to_string(),
    }
}

fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

impl Shim for K7dShim {
    type T = Service;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        let bundle = if args.bundle.is_empty() {
            std::env::current_dir().unwrap_or_default()
        } else {
            PathBuf::from(&args.bundle)
        };
        Self {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            bundle,
            exit: Arc::new(ExitSignal::default()),
        }
    }

    fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        let group = grouping(&self.bundle, &opts.id);
        let address = containerd_shim::socket_address(&opts.address, &opts.namespace, &group);
        // The sandbox's shim already serves: app containers join it.
        if std::os::unix::net::UnixStream::connect(socket_path(&address)).is_ok() {
            containerd_shim::util::write_address(&address)?;
            return Ok(address);
        }
        let exe = std::env::current_exe().map_err(|e| other(format!("cannot find the k7d binary: {e}")))?;
        let mut cmd = Command::new(exe);
        cmd.arg0(crate::SHIM_NAME)
            .current_dir(&self.bundle)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .args([
                "-namespace",
                &opts.namespace,
                "-id",
                &opts.id,
                "-address",
                &opts.address,
                "-socket",
                &address,
            ])
            // Its own process group: signals to containerd's group do not reach it.
            .process_group(0);
        if opts.debug {
            cmd.arg("-debug");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| other(format!("cannot start the shim server: {e}")))?;
        // The server closes its stdout once it serves.
        if let Some(mut out) = child.stdout.take() {
            let _ = std::io::copy(&mut out, &mut std::io::sink());
        }
        containerd_shim::util::write_address(&address)?;
        Ok(address)
    }

    fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        // Stateless and bounded (containerd gives it 5 s): no guest calls,
        // only the daemon's delete of the pod VM and the pod's sockets.
        let group = grouping(&self.bundle, &self.id);
        if group == self.id {
            let (state_dir, socket) = match ShimConfig::load() {
                Ok(c) => (c.state_dir, c.daemon_socket),
                Err(_) => (PathBuf::from("/run/k7d/shim"), PathBuf::from("/run/k7d/k7d.sock")),
            };
            let names = pod_names(&state_dir, &self.namespace, &self.id).resolved();
            let daemon = crate::api_daemon::connect(&socket);
            for id in names.vm_ids() {
                if let Err(e) = daemon.delete(&id) {
                    tracing::warn!("delete: cannot remove the pod VM {id}: {e:#}");
                }
            }
            names.remove_dir();
        }
        crate::image::umount(&self.bundle.join("k7d-pack"));
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        let mut at = containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp::new();
        at.seconds = d.as_secs() as i64;
        at.nanos = d.subsec_nanos() as i32;
        Ok(DeleteResponse {
            exit_status: task::KILLED,
            exited_at: Some(at).into(),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> Service {
        let socket = ShimConfig::load().map_or_else(|_| PathBuf::from("/run/k7d/k7d.sock"), |c| c.daemon_socket);
        Service::new(
            &self.namespace,
            crate::api_daemon::connect(&socket),
            publisher,
            self.exit.clone(),
        )
    }
}

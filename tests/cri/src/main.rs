//! `k7d-cri`: a small CRI client for the lab (`tests/lab/scenarios/k7d-cri.sh`).
//!
//! Debian bookworm has no `crictl`, so the lab drives containerd's CRI plugin
//! (the `runtime.v1` API, as the kubelet does) with this binary:
//!
//! - `k7d-cri pod --runtime-handler H --image REF --name N --log-dir DIR`:
//!   one pod of two containers under the runtime handler `H`, every step
//!   timed (`cri: step NAME MS ms`) and checked; exit status 0 only when
//!   every check held. The last line gives the pod's start (RunPodSandbox,
//!   CreateContainer and StartContainer until container A's first line is in
//!   its CRI log) and delete (StopPodSandbox + RemovePodSandbox) times.
//!   Both containers must report the same kernel boot id (one kernel for
//!   the pod: the node's, or the pod VM's).
//! - `k7d-cri net --runtime-handler H --image REF --name N --log-dir DIR`:
//!   two pods talk over the pod network (ping, 4 MiB over TCP, sums match).
//! - `k7d-cri cleanup`: stops and removes every pod sandbox.
//! - `k7d-cri list`: every pod sandbox and container, then their counts.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatusRequest, CreateContainerRequest, DnsConfig,
    ExecSyncRequest, ImageSpec, Int64Value, LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, ListContainersRequest, ListPodSandboxRequest, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopPodSandboxRequest, VersionRequest,
};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

mod limits;
mod many;
mod net;
mod stats;

type Client = RuntimeServiceClient<Channel>;

/// Container A: its first output line, then a tick a second.
const SCRIPT_A: &str = "echo a-started; i=0; while true; do echo tick $i; i=$((i+1)); sleep 1; done";
/// Container B: its first output line, then it sleeps.
const SCRIPT_B: &str = "echo b-started; sleep 3600";
/// The file the lab's busybox image carries, and its content.
const MARKER: &str = "/etc/k7d-image-marker";
const MARKER_TEXT: &str = "from-the-image";
/// The running kernel's random boot id: one per kernel instance.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";
/// A file container A writes into the pod's /dev/shm and B reads.
const SHM_PROBE: &str = "/dev/shm/k7d-cri-probe";
/// How often a log file is read again while a line is awaited.
const LOG_POLL: Duration = Duration::from_millis(20);

#[derive(Parser)]
#[command(
    name = "k7d-cri",
    about = "A CRI client for the k7d lab: one two-container pod, timed and checked"
)]
struct Cli {
    /// containerd's socket (its CRI plugin serves runtime.v1 there).
    #[arg(long, default_value = "/run/containerd/containerd.sock")]
    socket: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs one pod of two containers and checks every step.
    Pod(PodArgs),
    /// Two pods talk over the pod network: ping and 4 MiB over TCP.
    Net(net::NetArgs),
    /// Many pods created at once, all must start; then all removed.
    Many(many::ManyArgs),
    /// Stops and removes every pod sandbox (and so every container).
    Cleanup {
        /// The limit for each CRI call, in seconds.
        #[arg(long, default_value_t = 60)]
        timeout_s: u64,
    },
    /// Lists every pod sandbox and container, then their counts.
    List,
}

#[derive(Args)]
struct PodArgs {
    /// The CRI runtime handler (containerd's runtimes.<NAME>).
    #[arg(long)]
    runtime_handler: String,
    /// The containers' image, already in containerd's k8s.io namespace.
    #[arg(long)]
    image: String,
    /// The pod's name (and hostname).
    #[arg(long)]
    name: String,
    /// The pod's log directory (created when missing); the containers log to a.log and b.log in it.
    #[arg(long)]
    log_dir: PathBuf,
    /// The limit for each step, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// k7d's `io.k7d.pod-start` annotation on the pod (`cold` or `fork`);
    /// none: the shim config's choice.
    #[arg(long)]
    pod_start: Option<String>,
    /// Also check the kubelet's stats calls: B writes 64 MiB, which its
    /// `ContainerStats` must show (the pod gets a node cgroup, as the
    /// kubelet gives it one, where cgroup v2 is mounted).
    #[arg(long)]
    stats: bool,
    /// Container B runs as a non-root user (65534) and writes the limits
    /// it sees (`ulimit -a`, the kernel's process and file limits) to FILE,
    /// then starts 1 000 processes.
    #[arg(long, value_name = "FILE")]
    limits_out: Option<PathBuf>,
    /// As --limits-out, and the limits B sees must equal FILE's line by line.
    #[arg(long, value_name = "FILE")]
    limits_like: Option<PathBuf>,
    /// After the exec that follows the pod's start (A ticking, B asleep),
    /// waits (at most the step limit) until FILE exists: a watcher
    /// measures the idle pod at that point, then creates FILE.
    #[arg(long, value_name = "FILE")]
    hold_until: Option<PathBuf>,
}

impl PodArgs {
    fn limits(&self) -> bool {
        self.limits_out.is_some() || self.limits_like.is_some()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("k7d-cri: error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("k7d-cri: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let mut client = connect(&cli.socket).await?;
    match cli.cmd {
        Cmd::Pod(args) => pod(&mut client, &args).await,
        Cmd::Net(args) => net::net(&mut client, &args).await,
        Cmd::Many(args) => many::many(&mut client, &args).await,
        Cmd::Cleanup { timeout_s } => cleanup(&mut client, Duration::from_secs(timeout_s)).await,
        Cmd::List => list(&mut client).await,
    }
}

/// A CRI client over containerd's unix socket (tonic wants a URI; the
/// connector ignores it).
async fn connect(socket: &Path) -> Result<Client> {
    let path = socket.to_path_buf();
    let connector = service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    });
    let channel = tokio::time::timeout(
        Duration::from_secs(30),
        Endpoint::from_static("http://[::]").connect_with_connector(connector),
    )
    .await
    .map_err(|_| anyhow!("connecting to {} took more than 30 s", socket.display()))?
    .with_context(|| format!("cannot connect to containerd's socket {}", socket.display()))?;
    Ok(RuntimeServiceClient::new(channel))
}

/// A gRPC status as one sentence: its message and code.
fn rpc(status: tonic::Status) -> anyhow::Error {
    anyhow!("{} (gRPC {:?})", status.message(), status.code())
}

/// Runs one step under `limit`, prints `cri: step NAME MS ms` and returns
/// its value and duration; an error names the step.
async fn step<T, F>(name: &str, limit: Duration, f: F) -> Result<(T, Duration)>
where
    F: Future<Output = Result<T>>,
{
    let t0 = Instant::now();
    let out = tokio::time::timeout(limit, f)
        .await
        .map_err(|_| anyhow!("step {name}: no answer within {} s", limit.as_secs()))?
        .with_context(|| format!("step {name} failed"))?;
    let took = t0.elapsed();
    println!("cri: step {name} {} ms", took.as_millis());
    Ok((out, took))
}

fn sandbox_config(args: &PodArgs, uid: &str, log_dir: &Path, cgroup_parent: Option<&str>) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: args.name.clone(),
            uid: uid.to_string(),
            namespace: "k7d-lab".to_string(),
            attempt: 0,
        }),
        hostname: args.name.clone(),
        log_directory: log_dir.to_string_lossy().into_owned(),
        // The kubelet always sends one: the pod's resolv.conf is made from it.
        dns_config: Some(DnsConfig {
            servers: vec!["10.88.0.1".to_string()],
            searches: vec!["k7d.lab".to_string()],
            options: vec![],
        }),
        labels: HashMap::from([("k7d-lab".to_string(), args.name.clone())]),
        annotations: args
            .pod_start
            .iter()
            .map(|v| ("io.k7d.pod-start".to_string(), v.clone()))
            .collect(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
            cgroup_parent: cgroup_parent.unwrap_or_default().to_string(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The kubelet's defaults, for the pod and again for each container: the
/// pod's network and IPC namespaces, a PID namespace per container.
fn namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Pod as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

fn container_config(name: &str, image: &str, script: &str) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_string(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image.to_string(),
            ..Default::default()
        }),
        command: vec!["/bin/sh".to_string(), "-c".to_string(), script.to_string()],
        log_path: format!("{name}.log"),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One line of a CRI log file: `<time> <stream> <P|F> <content>`.
struct LogLine<'a> {
    stream: &'a str,
    content: &'a str,
}

fn parse_log_line(line: &str) -> Option<LogLine<'_>> {
    let mut parts = line.splitn(4, ' ');
    let _time = parts.next()?;
    let stream = parts.next()?;
    let _tag = parts.next()?;
    Some(LogLine {
        stream,
        content: parts.next().unwrap_or(""),
    })
}

/// The stdout lines of a CRI log file so far (none while it does not exist).
async fn stdout_lines(path: &Path) -> Result<Vec<String>> {
    let text = match tokio::fs::read(path).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    // Only whole lines: the last one may still be being written.
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    Ok(whole
        .lines()
        .filter_map(parse_log_line)
        .filter(|l| l.stream == "stdout")
        .map(|l| l.content.to_string())
        .collect())
}

/// Waits until the log at `path` has at least `n` stdout lines; returns them.
async fn await_lines(path: &Path, n: usize) -> Result<Vec<String>> {
    loop {
        let lines = stdout_lines(path).await?;
        if lines.len() >= n {
            return Ok(lines);
        }
        tokio::time::sleep(LOG_POLL).await;
    }
}

/// Waits until `file` exists, at most `limit` (--hold-until).
async fn hold_until(file: &Path, limit: Duration) -> Result<()> {
    println!("cri: holding the idle pod until {} exists", file.display());
    let t = Instant::now();
    while !file.exists() {
        if t.elapsed() > limit {
            bail!(
                "{} did not appear within {} s: the watcher never released the held pod",
                file.display(),
                limit.as_secs()
            );
        }
        tokio::time::sleep(LOG_POLL).await;
    }
    Ok(())
}

/// Runs `cmd` in `container` (ExecSync): its stdout, trimmed, once it exited 0.
async fn exec(client: &mut Client, container: &str, cmd: &[&str], limit: Duration) -> Result<String> {
    let r = client
        .exec_sync(ExecSyncRequest {
            container_id: container.to_string(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: i64::try_from(limit.as_secs()).unwrap_or(i64::MAX),
        })
        .await
        .map_err(rpc)?
        .into_inner();
    let stdout = String::from_utf8_lossy(&r.stdout).trim().to_string();
    if r.exit_code != 0 {
        bail!(
            "{} exited {} (stdout '{stdout}', stderr '{}')",
            cmd.join(" "),
            r.exit_code,
            String::from_utf8_lossy(&r.stderr).trim()
        );
    }
    Ok(stdout)
}

async fn create(client: &mut Client, sandbox: &str, config: &PodSandboxConfig, c: ContainerConfig) -> Result<String> {
    let id = client
        .create_container(CreateContainerRequest {
            pod_sandbox_id: sandbox.to_string(),
            config: Some(c),
            sandbox_config: Some(config.clone()),
        })
        .await
        .map_err(rpc)?
        .into_inner()
        .container_id;
    if id.is_empty() {
        bail!("containerd returned an empty container id");
    }
    Ok(id)
}

async fn start(client: &mut Client, id: &str) -> Result<()> {
    client
        .start_container(StartContainerRequest {
            container_id: id.to_string(),
        })
        .await
        .map_err(rpc)?;
    Ok(())
}

async fn stop_and_remove(client: &mut Client, id: &str, limit: Duration) -> Result<(Duration, Duration)> {
    let (_, stop) = step("stop_pod_sandbox", limit, async {
        client
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.to_string(),
            })
            .await
            .map_err(rpc)
    })
    .await?;
    let (_, remove) = step("remove_pod_sandbox", limit, async {
        client
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.to_string(),
            })
            .await
            .map_err(rpc)
    })
    .await?;
    Ok((stop, remove))
}

async fn pod(client: &mut Client, args: &PodArgs) -> Result<()> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let uid = format!("{}-{}-{nanos}", args.name, std::process::id());
    // The stats check needs the pod's node cgroup (containerd reads it).
    let cgroup = if args.stats {
        stats::PodCgroup::make(&uid)?
    } else {
        None
    };
    if args.stats && cgroup.is_none() {
        bail!("--stats needs cgroup v2 at /sys/fs/cgroup: containerd reads a pod's stats from its node cgroup");
    }
    let mut sandbox = None;
    let mut result = pod_steps(client, args, &uid, nanos, cgroup.as_ref(), &mut sandbox).await;
    if let (Err(_), Some(id)) = (&result, sandbox) {
        // Leave no pod behind a failed check; the failure itself is what counts.
        let limit = Duration::from_secs(args.timeout_s);
        match stop_and_remove(client, &id, limit).await {
            Ok(_) => println!("cri: after the failure: pod sandbox {id} stopped and removed"),
            Err(e) => println!("cri: after the failure: pod sandbox {id} not removed: {e:#}"),
        }
    }
    if let Some(cg) = cgroup {
        let removed = cg.remove();
        if result.is_ok() {
            result = removed;
        }
    }
    result
}

/// The pod's steps; `sandbox` holds its id from RunPodSandbox until
/// RemovePodSandbox succeeded.
async fn pod_steps(
    client: &mut Client,
    args: &PodArgs,
    uid: &str,
    nanos: u128,
    cgroup: Option<&stats::PodCgroup>,
    sandbox: &mut Option<String>,
) -> Result<()> {
    let limit = Duration::from_secs(args.timeout_s);
    let log_dir = std::path::absolute(&args.log_dir)
        .with_context(|| format!("the log directory {} has no absolute path", args.log_dir.display()))?;
    tokio::fs::create_dir_all(&log_dir)
        .await
        .with_context(|| format!("cannot create the log directory {}", log_dir.display()))?;
    let config = sandbox_config(args, uid, &log_dir, cgroup.map(|c| c.parent.as_str()));

    let (v, _) = step("version", limit, async {
        client
            .version(VersionRequest {
                version: "v1".to_string(),
            })
            .await
            .map_err(rpc)
    })
    .await?;
    let v = v.into_inner();
    println!(
        "cri: runtime {} {} (CRI {}), handler {}",
        v.runtime_name, v.runtime_version, v.runtime_api_version, args.runtime_handler
    );

    let t_pod = Instant::now();
    let (id, _) = step("run_pod_sandbox", limit, async {
        let r = client
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: args.runtime_handler.clone(),
            })
            .await
            .map_err(rpc)?
            .into_inner();
        if r.pod_sandbox_id.is_empty() {
            bail!("containerd returned an empty pod sandbox id");
        }
        Ok(r.pod_sandbox_id)
    })
    .await?;
    *sandbox = Some(id.clone());
    println!("cri: pod sandbox {id}");

    let (a, _) = step(
        "create_container_a",
        limit,
        create(client, &id, &config, container_config("a", &args.image, SCRIPT_A)),
    )
    .await?;
    let (b, _) = step(
        "create_container_b",
        limit,
        create(client, &id, &config, {
            let mut b = container_config("b", &args.image, SCRIPT_B);
            if args.limits() {
                // A non-root container, for the process limit.
                if let Some(sc) = b.linux.as_mut().and_then(|l| l.security_context.as_mut()) {
                    sc.run_as_user = Some(Int64Value { value: limits::USER });
                }
            }
            b
        }),
    )
    .await?;
    step("start_container_a", limit, start(client, &a)).await?;
    step("start_container_b", limit, start(client, &b)).await?;
    let log_a = log_dir.join("a.log");
    let (first, _) = step("first_log_line_a", limit, await_lines(&log_a, 1)).await?;
    let pod_start = t_pod.elapsed();
    if first[0] != "a-started" {
        bail!(
            "step first_log_line_a: the first line of {} is '{}', expected a-started",
            log_a.display(),
            first[0]
        );
    }

    let (marker, _) = step("exec_sync_marker", limit, exec(client, &a, &["cat", MARKER], limit)).await?;
    if marker != MARKER_TEXT {
        bail!("step exec_sync_marker: {MARKER} reads '{marker}', expected {MARKER_TEXT}");
    }
    println!("cri: exec cat {MARKER}: {marker}");
    let (kernel, _) = step("exec_sync_uname", limit, exec(client, &a, &["uname", "-r"], limit)).await?;
    println!("cri: exec uname -r: {kernel}");
    if let Some(file) = &args.hold_until {
        hold_until(file, limit).await?;
    }
    // One kernel instance for the whole pod: A and B see the same boot id
    // (the node's under runc, the pod VM's under a VM runtime). And the
    // pod's containers share one IPC namespace and one /dev/shm, as
    // Kubernetes gives every pod: what A writes there, B reads.
    let (boot_id, _) = step("exec_sync_boot_id", limit, async {
        // Digits only: the pod's name (`--name`) never reaches the shell.
        let token = format!("{}-{nanos}", std::process::id());
        let write = format!("cat {BOOT_ID} && readlink /proc/self/ns/ipc && echo {token} >{SHM_PROBE}");
        let read = format!("cat {BOOT_ID} && readlink /proc/self/ns/ipc && cat {SHM_PROBE}");
        let in_a = exec(client, &a, &["sh", "-c", &write], limit).await?;
        let in_b = exec(client, &b, &["sh", "-c", &read], limit).await?;
        let (a_lines, b_lines): (Vec<&str>, Vec<&str>) = (in_a.lines().collect(), in_b.lines().collect());
        let (&[a_boot, a_ipc], &[b_boot, b_ipc, shared]) = (a_lines.as_slice(), b_lines.as_slice()) else {
            bail!("unexpected output: '{in_a}' from A, '{in_b}' from B");
        };
        if a_boot != b_boot {
            bail!("containers A and B run on different kernels: boot id {a_boot} in A, {b_boot} in B");
        }
        if a_ipc != b_ipc {
            bail!("containers A and B have different IPC namespaces: {a_ipc} in A, {b_ipc} in B");
        }
        if shared != token {
            bail!("B read '{shared}' from {SHM_PROBE}, where A wrote {token}: the pod's /dev/shm is not shared");
        }
        Ok((a_boot.to_string(), a_ipc.to_string()))
    })
    .await?;
    println!("cri: exec boot id (A and B): {}", boot_id.0);
    println!("cri: exec IPC namespace (A and B): {}, one /dev/shm", boot_id.1);

    step("container_status", limit, async {
        for (name, cid) in [("a", &a), ("b", &b)] {
            let status = client
                .container_status(ContainerStatusRequest {
                    container_id: cid.clone(),
                    verbose: false,
                })
                .await
                .map_err(rpc)?
                .into_inner()
                .status
                .with_context(|| format!("container {name} has no status"))?;
            let state = ContainerState::try_from(status.state).map_or_else(
                |_| format!("unknown state {}", status.state),
                |s| s.as_str_name().to_string(),
            );
            if status.state != ContainerState::ContainerRunning as i32 {
                bail!("container {name} is {state}, expected CONTAINER_RUNNING");
            }
            println!("cri: container {name} {cid}: {state}");
        }
        Ok(())
    })
    .await?;

    if args.limits() {
        let (out, like) = (args.limits_out.as_deref(), args.limits_like.as_deref());
        step(
            "limits",
            limits::step_limit(limit),
            limits::check(client, &b, limit, out, like),
        )
        .await?;
    }
    if args.stats {
        step(
            "stats",
            limit,
            stats::check(client, &id, (&a, &b), args.runtime_handler != "runc", limit),
        )
        .await?;
    }

    step("log_lines", limit, async {
        // A logs on (a tick after its first line); B's first line is there.
        let lines = await_lines(&log_a, 2).await?;
        if !lines[1].starts_with("tick ") {
            bail!("the second line of A's log is '{}', expected a tick", lines[1]);
        }
        let log_b = log_dir.join("b.log");
        let lines = await_lines(&log_b, 1).await?;
        if lines[0] != "b-started" {
            bail!(
                "the first line of {} is '{}', expected b-started",
                log_b.display(),
                lines[0]
            );
        }
        Ok(())
    })
    .await?;

    let (stop, remove) = stop_and_remove(client, &id, limit).await?;
    *sandbox = None;
    let pod_delete = stop + remove;

    step("list_after_remove", limit, async {
        let sandboxes = client
            .list_pod_sandbox(ListPodSandboxRequest { filter: None })
            .await
            .map_err(rpc)?
            .into_inner()
            .items;
        if let Some(s) = sandboxes.iter().find(|s| s.id == id) {
            bail!(
                "ListPodSandbox still lists the removed pod sandbox {} (state {})",
                s.id,
                s.state
            );
        }
        let containers = client
            .list_containers(ListContainersRequest { filter: None })
            .await
            .map_err(rpc)?
            .into_inner()
            .containers;
        if let Some(c) = containers
            .iter()
            .find(|c| c.pod_sandbox_id == id || c.id == a || c.id == b)
        {
            bail!("ListContainers still lists container {} of the removed pod", c.id);
        }
        Ok(())
    })
    .await?;
    println!(
        "cri: pod start {} ms, pod delete {} ms ({}: handler {}, kernel {kernel})",
        pod_start.as_millis(),
        pod_delete.as_millis(),
        args.name,
        args.runtime_handler
    );
    Ok(())
}

async fn cleanup(client: &mut Client, limit: Duration) -> Result<()> {
    let (sandboxes, _) = step("list_pod_sandbox", limit, async {
        client
            .list_pod_sandbox(ListPodSandboxRequest { filter: None })
            .await
            .map_err(rpc)
    })
    .await?;
    let sandboxes = sandboxes.into_inner().items;
    for s in &sandboxes {
        println!("cri: cleanup: pod sandbox {} (state {})", s.id, s.state);
        stop_and_remove(client, &s.id, limit).await?;
    }
    let left = client
        .list_pod_sandbox(ListPodSandboxRequest { filter: None })
        .await
        .map_err(rpc)
        .context("ListPodSandbox after the cleanup failed")?
        .into_inner()
        .items;
    if !left.is_empty() {
        let ids: Vec<&str> = left.iter().map(|s| s.id.as_str()).collect();
        bail!("pod sandboxes left after the cleanup: {}", ids.join(" "));
    }
    println!("cri: cleanup: {} pod sandboxes stopped and removed", sandboxes.len());
    Ok(())
}

async fn list(client: &mut Client) -> Result<()> {
    let sandboxes = client
        .list_pod_sandbox(ListPodSandboxRequest { filter: None })
        .await
        .map_err(rpc)
        .context("ListPodSandbox failed")?
        .into_inner()
        .items;
    for s in &sandboxes {
        let name = s.metadata.as_ref().map_or("?", |m| m.name.as_str());
        println!(
            "cri: pod sandbox {} {name} state {} handler {}",
            s.id, s.state, s.runtime_handler
        );
    }
    let containers = client
        .list_containers(ListContainersRequest { filter: None })
        .await
        .map_err(rpc)
        .context("ListContainers failed")?
        .into_inner()
        .containers;
    for c in &containers {
        let name = c.metadata.as_ref().map_or("?", |m| m.name.as_str());
        println!(
            "cri: container {} {name} pod {} state {}",
            c.id, c.pod_sandbox_id, c.state
        );
    }
    println!(
        "cri: {} pod sandboxes, {} containers",
        sandboxes.len(),
        containers.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_log_lines_parse() {
        let l = parse_log_line("2026-12-03T00:05:57.123456789Z stdout F a-started").expect("a line");
        assert_eq!((l.stream, l.content), ("stdout", "a-started"));
        let l = parse_log_line("2026-12-03T00:05:57Z stderr P part of a line").expect("a line");
        assert_eq!((l.stream, l.content), ("stderr", "part of a line"));
        let l = parse_log_line("2026-12-03T00:05:57Z stdout F").expect("an empty line");
        assert_eq!(l.content, "");
        assert!(parse_log_line("garbage").is_none());
    }

    #[tokio::test]
    async fn only_whole_stdout_lines_count() {
        let dir = std::env::temp_dir().join(format!("k7d-cri-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("a.log");
        assert!(stdout_lines(&path).await.expect("missing file").is_empty());
        std::fs::write(&path, "t stderr F err\nt stdout F a-started\nt stdout F tick").expect("write");
        assert_eq!(stdout_lines(&path).await.expect("read"), ["a-started"]);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}

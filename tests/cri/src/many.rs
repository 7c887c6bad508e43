//! `k7d-cri many`: N pods created at once, as a node scaling a Deployment
//! out sees them: each pod's sandbox, one container, its first log line;
//! every pod must get there (0 failures), then all are stopped and removed
//! at once and the node lists none. The pods' start modes (k7d's
//! `io.k7d.pod-start`) are taken in turn from `--pod-start` (e.g.
//! `cold,fork`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_cri::v1::{ListPodSandboxRequest, RunPodSandboxRequest};
use tokio::task::JoinSet;

use crate::{Client, PodArgs, await_lines, container_config, create, rpc, sandbox_config, start, stop_and_remove};

/// `many`'s arguments.
#[derive(clap::Args)]
pub struct ManyArgs {
    /// The CRI runtime handler.
    #[arg(long)]
    runtime_handler: String,
    /// The containers' image.
    #[arg(long)]
    image: String,
    /// The pods' name prefix.
    #[arg(long)]
    name: String,
    /// Where the pods' log directories are made.
    #[arg(long)]
    log_dir: PathBuf,
    /// How many pods (1 to 64).
    #[arg(long, default_value_t = 20)]
    count: u32,
    /// The limit for each pod's start and each removal, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Start modes taken in turn, comma-separated (`cold,fork`); none: the
    /// shim config's.
    #[arg(long, value_delimiter = ',')]
    pod_start: Vec<String>,
}

/// Starts every pod at once, then removes every pod at once.
pub async fn many(client: &mut Client, args: &ManyArgs) -> Result<()> {
    if !(1..=64).contains(&args.count) {
        bail!("--count {} is out of range: 1 to 64 pods", args.count);
    }
    let limit = Duration::from_secs(args.timeout_s);
    let t0 = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..args.count {
        let mode = (!args.pod_start.is_empty()).then(|| args.pod_start[i as usize % args.pod_start.len()].clone());
        let p = PodArgs {
            runtime_handler: args.runtime_handler.clone(),
            image: args.image.clone(),
            name: format!("{}-{i}", args.name),
            log_dir: std::path::absolute(args.log_dir.join(i.to_string()))
                .context("the log directory has no absolute path")?,
            timeout_s: args.timeout_s,
            pod_start: mode.clone(),
            stats: false,
            limits_out: None,
            limits_like: None,
            hold_until: None,
        };
        let mut c = client.clone();
        set.spawn(async move {
            let r = tokio::time::timeout(limit, one(&mut c, &p)).await;
            let r = r.unwrap_or_else(|_| Err(anyhow::anyhow!("not ready within {} s", limit.as_secs())));
            (p.name, mode, r)
        });
    }
    let (mut ready, mut failed, mut sandboxes) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(j) = set.join_next().await {
        let (name, mode, r) = j.context("a pod's task panicked")?;
        let mode = mode.unwrap_or_else(|| "default".into());
        match r {
            Ok((sandbox, took)) => {
                println!("cri: many: {name} ({mode}) ready in {:.2} s", took.as_secs_f64());
                sandboxes.push(sandbox);
                ready.push((mode, took));
            }
            Err(e) => {
                println!("cri: many: {name} ({mode}) FAILED: {e:#}");
                failed.push(name);
            }
        }
    }
    let all_ready = t0.elapsed();
    // The pods that were started, and any a failed start left: every
    // sandbox of this run's name prefix.
    let listed = client
        .list_pod_sandbox(ListPodSandboxRequest { filter: None })
        .await
        .map_err(rpc)?
        .into_inner()
        .items;
    for s in listed {
        let ours = s
            .metadata
            .as_ref()
            .is_some_and(|m| m.name.starts_with(&format!("{}-", args.name)));
        if ours && !sandboxes.contains(&s.id) {
            sandboxes.push(s.id);
        }
    }
    let t1 = Instant::now();
    let mut set = JoinSet::new();
    for id in sandboxes {
        let mut c = client.clone();
        set.spawn(async move { (id.clone(), stop_and_remove_until_gone(&mut c, &id, limit).await) });
    }
    let mut not_removed = Vec::new();
    while let Some(j) = set.join_next().await {
        let (id, r) = j.context("a removal's task panicked")?;
        if let Err(e) = r {
            println!("cri: many: pod sandbox {id} not removed: {e:#}");
            not_removed.push(id);
        }
    }
    let removed_in = t1.elapsed();
    let left = client
        .list_pod_sandbox(ListPodSandboxRequest { filter: None })
        .await
        .map_err(rpc)?
        .into_inner()
        .items
        .len();
    let mut modes: Vec<String> = ready.iter().map(|(m, _)| m.clone()).collect();
    modes.sort();
    modes.dedup();
    for m in &modes {
        let mut t: Vec<f64> = ready
            .iter()
            .filter(|(x, _)| x == m)
            .map(|(_, d)| d.as_secs_f64())
            .collect();
        t.sort_by(f64::total_cmp);
        println!(
            "cri: many: {m}: {} pods, start median {:.2} s, slowest {:.2} s",
            t.len(),
            t[t.len() / 2],
            t[t.len() - 1]
        );
    }
    println!(
        "cri: many: {} pods at once: {} ready, {} failures, all ready after {:.2} s; removed in {:.2} s; {left} pod sandboxes left",
        args.count,
        ready.len(),
        failed.len(),
        all_ready.as_secs_f64(),
        removed_in.as_secs_f64()
    );
    if !failed.is_empty() || !not_removed.is_empty() || left != 0 {
        bail!(
            "{} of {} pods failed ({}), {} not removed, {left} left",
            failed.len(),
            args.count,
            failed.join(" "),
            not_removed.len()
        );
    }
    Ok(())
}

/// One pod: sandbox, one container, its first log line `ready`; its
/// sandbox id and how long that took.
async fn one(client: &mut Client, p: &PodArgs) -> Result<(String, Duration)> {
    let t0 = Instant::now();
    tokio::fs::create_dir_all(&p.log_dir)
        .await
        .with_context(|| format!("cannot create {}", p.log_dir.display()))?;
    let uid = format!("{}-{}", p.name, std::process::id());
    let config = sandbox_config(p, &uid, &p.log_dir, None);
    let id = client
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: p.runtime_handler.clone(),
        })
        .await
        .map_err(rpc)
        .context("RunPodSandbox")?
        .into_inner()
        .pod_sandbox_id;
    let c = create(
        client,
        &id,
        &config,
        container_config("a", &p.image, "echo ready; exec sleep 3600"),
    )
    .await
    .context("CreateContainer")?;
    start(client, &c).await.context("StartContainer")?;
    let lines = await_lines(&p.log_dir.join("a.log"), 1).await?;
    if lines[0] != "ready" {
        bail!("its container logged '{}' first, expected ready", lines[0]);
    }
    Ok((id, t0.elapsed()))
}

/// Stops and removes a pod sandbox as the kubelet does: again, every 5 s,
/// until it is gone or `limit` has passed. A pod whose start was given up
/// on may still have a container start in flight in containerd: a stop
/// skips that container while it is being created, and the remove then
/// finds its task running.
async fn stop_and_remove_until_gone(client: &mut Client, id: &str, limit: Duration) -> Result<()> {
    let until = Instant::now() + limit;
    let mut tries = 1;
    loop {
        match stop_and_remove(client, id, limit).await {
            Ok(_) => {
                if tries > 1 {
                    println!("cri: many: pod sandbox {id} removed at try {tries}");
                }
                return Ok(());
            }
            Err(e) if Instant::now() + Duration::from_secs(5) < until => {
                println!("cri: many: pod sandbox {id}: try {tries} to remove it failed ({e:#}); again in 5 s");
                tokio::time::sleep(Duration::from_secs(5)).await;
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

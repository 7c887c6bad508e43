//! `k7d-cri net`: two pods under one runtime handler talk over the pod
//! network: the client pod pings the server pod's address and fetches
//! 4 MiB from its HTTP server (busybox `httpd`/`wget`); the sums must match.
//! Under k7d the traffic crosses both pod VMs' NICs and k7d's datapath.
//!
//! With `--hook CMD`, the pod policy too: `CMD deny SANDBOX` must block the
//! client's ping to the server pod, `CMD drops SANDBOX` must succeed (the
//! hook checks the drop counters), and after `CMD clear SANDBOX` the ping
//! passes again. The hook is run with `sh -c`.
//!
//! Each pod gets a node cgroup (where cgroup v2 is mounted), as the kubelet
//! gives it one, and the pods' network counters (`PodSandboxStats`, read
//! by containerd from `eth0` in each pod's netns) must move with the 4 MiB:
//! the client's received bytes always, the server's sent bytes with
//! `--expect-tx` (runc, k7d's bridge datapath; the direct datapath's
//! `bpf_redirect_peer` skips `eth0`'s transmit, `docs/datapath.md`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_cri::v1::{ExecSyncRequest, PodSandboxStatusRequest, RunPodSandboxRequest};

use crate::stats::{PodCgroup, net_bytes, pod_stats};
use crate::{
    Client, PodArgs, await_lines, container_config, create, exec, rpc, sandbox_config, start, step, stop_and_remove,
};

/// The server: 4 MiB of random data and its sum, then an HTTP server.
const SERVER: &str = "mkdir -p /www && head -c 4194304 /dev/urandom >/www/data && md5sum /www/data | cut -d' ' -f1 >/www/sum && echo ready && exec httpd -f -p 8080 -h /www";
/// The client: idles; the checks run in it through ExecSync.
const CLIENT: &str = "echo ready; exec sleep 3600";

/// `net`'s arguments.
#[derive(clap::Args)]
pub struct NetArgs {
    /// The CRI runtime handler.
    #[arg(long)]
    runtime_handler: String,
    /// The containers' image (busybox with ping, httpd, wget, md5sum).
    #[arg(long)]
    image: String,
    /// The pods' name prefix.
    #[arg(long)]
    name: String,
    /// Where the pods' log directories are made.
    #[arg(long)]
    log_dir: PathBuf,
    /// The limit for each step, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// A command that sets the server pod's policy: run as
    /// `sh -c 'HOOK deny|drops|clear SANDBOX_ID'`.
    #[arg(long)]
    hook: Option<String>,
    /// k7d's `io.k7d.pod-start` annotation: one for both pods, or the
    /// server's and the client's, comma-separated (`fork,pool`).
    #[arg(long, value_delimiter = ',')]
    pod_start: Vec<String>,
    /// The server pod's `eth0` must count the 4 MiB it sent.
    #[arg(long)]
    expect_tx: bool,
}

/// Runs the check; the pods are stopped and removed whatever happened.
pub async fn net(client: &mut Client, args: &NetArgs) -> Result<()> {
    let mut pods = Vec::new();
    let mut cgroups = Vec::new();
    let mut r = steps(client, args, &mut pods, &mut cgroups).await;
    let limit = Duration::from_secs(args.timeout_s);
    for id in pods {
        if let Err(e) = stop_and_remove(client, &id, limit).await {
            println!("cri: net: pod sandbox {id} not removed: {e:#}");
        }
    }
    for cg in cgroups {
        let removed = cg.remove();
        if r.is_ok() {
            r = removed;
        }
    }
    r
}

/// One pod with one container running `script`: its address and container
/// id, once the container logged `ready` (its sandbox id is pushed onto
/// `pods`).
async fn pod(
    client: &mut Client,
    args: &NetArgs,
    role: &str,
    script: &str,
    pods: &mut Vec<String>,
    cgroups: &mut Vec<PodCgroup>,
) -> Result<(String, String)> {
    let limit = Duration::from_secs(args.timeout_s);
    let p = PodArgs {
        runtime_handler: args.runtime_handler.clone(),
        image: args.image.clone(),
        name: format!("{}-{role}", args.name),
        log_dir: std::path::absolute(args.log_dir.join(role)).context("the log directory has no absolute path")?,
        timeout_s: args.timeout_s,
        // The server's mode first, the client's second (or the one for both).
        pod_start: match (role, args.pod_start.as_slice()) {
            (_, []) => None,
            ("client", [.., last]) => Some(last.clone()),
            (_, [first, ..]) => Some(first.clone()),
        },
        stats: false,
        limits_out: None,
        limits_like: None,
        hold_until: None,
    };
    tokio::fs::create_dir_all(&p.log_dir)
        .await
        .with_context(|| format!("cannot create {}", p.log_dir.display()))?;
    let uid = format!("{}-{}", p.name, std::process::id());
    let cgroup = PodCgroup::make(&uid)?;
    let config = sandbox_config(&p, &uid, &p.log_dir, cgroup.as_ref().map(|c| c.parent.as_str()));
    cgroups.extend(cgroup);
    let (id, _) = step(&format!("net_run_pod_sandbox_{role}"), limit, async {
        Ok(client
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: p.runtime_handler.clone(),
            })
            .await
            .map_err(rpc)?
            .into_inner()
            .pod_sandbox_id)
    })
    .await?;
    pods.push(id.clone());
    let (status, _) = step(&format!("net_status_{role}"), limit, async {
        Ok(client
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.clone(),
                verbose: false,
            })
            .await
            .map_err(rpc)?
            .into_inner())
    })
    .await?;
    let ip = status
        .status
        .and_then(|s| s.network)
        .map(|n| n.ip)
        .filter(|ip| !ip.is_empty())
        .with_context(|| format!("pod {role} has no address (PodSandboxStatus)"))?;
    let (c, _) = step(
        &format!("net_create_{role}"),
        limit,
        create(client, &id, &config, container_config(role, &p.image, script)),
    )
    .await?;
    step(&format!("net_start_{role}"), limit, start(client, &c)).await?;
    let log = p.log_dir.join(format!("{role}.log"));
    let (lines, _) = step(&format!("net_ready_{role}"), limit, await_lines(&log, 1)).await?;
    if lines[0] != "ready" {
        bail!("pod {role}'s container logged '{}' first, expected ready", lines[0]);
    }
    println!("cri: net: pod {role} {id} at {ip}");
    Ok((ip, c))
}

async fn steps(
    client: &mut Client,
    args: &NetArgs,
    pods: &mut Vec<String>,
    cgroups: &mut Vec<PodCgroup>,
) -> Result<()> {
    let limit = Duration::from_secs(args.timeout_s);
    let (server_ip, server) = pod(client, args, "server", SERVER, pods, cgroups).await?;
    let (client_ip, client_c) = pod(client, args, "client", CLIENT, pods, cgroups).await?;
    let counted = !cgroups.is_empty();
    // Every VM runtime gives each pod a kernel of its own.
    let own_kernels = args.runtime_handler != "runc";
    // Every call is bounded here too, not only by containerd's ExecSync
    // timeout: a hang shows as the step that hung.
    step(
        "net_identities",
        limit,
        identities(
            client,
            &[(&server_ip, &server), (&client_ip, &client_c)],
            own_kernels,
            limit,
        ),
    )
    .await?;
    let (out, _) = step(
        "net_ping",
        limit,
        exec(client, &client_c, &["ping", "-c", "3", "-W", "3", &server_ip], limit),
    )
    .await?;
    let summary = out
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or("")
        .to_string();
    if !summary.contains("3 packets received") {
        bail!("ping from the client pod to {server_ip}: {summary}");
    }
    println!("cri: net ping {server_ip}: {summary}");
    let (want, _) = step(
        "net_server_sum",
        limit,
        exec(client, &server, &["cat", "/www/sum"], limit),
    )
    .await?;
    let before = if counted {
        Some(step("net_stats_before", limit, net_counters(client, pods)).await?.0)
    } else {
        None
    };
    let t = Instant::now();
    let url = format!("http://{server_ip}:8080/data");
    let fetch = format!("wget -q -O - {url} | md5sum | cut -d' ' -f1");
    let (got, took) = step(
        "net_tcp_4mib",
        limit,
        exec(client, &client_c, &["sh", "-c", &fetch], limit),
    )
    .await?;
    if got != want {
        bail!("the client pod fetched {url} with sum '{got}', the server's file has {want}");
    }
    println!(
        "cri: net tcp 4 MiB from {server_ip}: sums match ({want}), {:.2} s ({:.1} MiB/s)",
        t.elapsed().as_secs_f64(),
        4.0 / took.as_secs_f64().max(1e-3)
    );
    if let Some(before) = before {
        let (after, _) = step("net_stats_after", limit, net_counters(client, pods)).await?;
        moved(&before, &after, args.expect_tx)?;
    }
    if let Some(hook) = &args.hook {
        let server_pod = pods.first().cloned().context("the server pod has no sandbox id")?;
        policy(client, hook, &server_pod, &client_c, &server_ip, limit).await?;
    }
    Ok(())
}

/// Each pod's `eth0` counters from `PodSandboxStats`: (rx, tx) for the
/// server, then the client.
async fn net_counters(client: &mut Client, pods: &[String]) -> Result<[(u64, u64); 2]> {
    let [server, client_pod] = pods else {
        bail!("expected the server's and the client's pod sandboxes, have {pods:?}");
    };
    let s = net_bytes(&pod_stats(client, server).await?).context("the server pod's network counters")?;
    let c = net_bytes(&pod_stats(client, client_pod).await?).context("the client pod's network counters")?;
    Ok([s, c])
}

/// The 4 MiB fetch shows in the pods' counters: the client received it
/// (and the server sent it, with `expect_tx`).
fn moved(before: &[(u64, u64); 2], after: &[(u64, u64); 2], expect_tx: bool) -> Result<()> {
    const DATA: u64 = 4 << 20;
    let d = |i: usize| {
        (
            after[i].0.saturating_sub(before[i].0),
            after[i].1.saturating_sub(before[i].1),
        )
    };
    let ((s_rx, s_tx), (c_rx, c_tx)) = (d(0), d(1));
    println!(
        "cri: net stats: during the 4 MiB: server eth0 rx +{s_rx} B, tx +{s_tx} B; client eth0 rx +{c_rx} B, tx +{c_tx} B (PodSandboxStats)"
    );
    if c_rx < DATA {
        bail!("the client pod fetched 4 MiB but its eth0 counted {c_rx} bytes received (PodSandboxStats)");
    }
    if expect_tx && s_tx < DATA {
        bail!("the server pod sent 4 MiB but its eth0 counted {s_tx} bytes sent (PodSandboxStats)");
    }
    Ok(())
}

/// Each pod has its own identity (two pods forked from one template
/// would otherwise share all of it): its address, its hostname, its NIC's
/// MAC, the first 16 bytes its kernel's RNG hands out, its kernel's boot id.
async fn identities(client: &mut Client, pods: &[(&str, &str)], own_kernels: bool, limit: Duration) -> Result<()> {
    let mut seen = Vec::new();
    for (ip, c) in pods {
        let host = exec(client, c, &["hostname"], limit).await?;
        let rng = exec(
            client,
            c,
            &["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'"],
            limit,
        )
        .await?;
        if rng.len() != 32 {
            bail!("pod at {ip}: 16 bytes of /dev/urandom read as '{rng}'");
        }
        let boot = exec(client, c, &["cat", "/proc/sys/kernel/random/boot_id"], limit).await?;
        // The first interface that is not lo (eth0 under runc and k7d).
        let mac = exec(
            client,
            c,
            &[
                "sh",
                "-c",
                "for i in /sys/class/net/*; do [ \"${i##*/}\" = lo ] || { cat \"$i/address\"; break; }; done",
            ],
            limit,
        )
        .await?;
        if mac.len() != 17 {
            bail!("pod at {ip}: its NIC's MAC read as '{mac}'");
        }
        println!("cri: net identity: pod at {ip}: hostname {host}, mac {mac}, urandom {rng}, boot id {boot}");
        seen.push((ip.to_string(), host, rng, boot, mac));
    }
    for (i, a) in seen.iter().enumerate() {
        for b in &seen[i + 1..] {
            // runc's pods share the node's kernel, and so its boot id.
            if a.0 == b.0 || a.1 == b.1 || a.2 == b.2 || (own_kernels && a.3 == b.3) || a.4 == b.4 {
                bail!("two pods share an identity: {a:?} and {b:?}");
            }
        }
    }
    if own_kernels {
        println!("cri: net identity: every pod's address, hostname, MAC, urandom and boot id differ");
    } else {
        println!("cri: net identity: every pod's address, hostname, MAC and urandom differ (one kernel, one boot id)");
    }
    Ok(())
}

/// Runs `hook VERB SANDBOX`; an error unless it exits 0.
async fn run_hook(hook: &str, verb: &str, sandbox: &str) -> Result<String> {
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{hook} {verb} {sandbox}"))
        .output()
        .await
        .with_context(|| format!("cannot run the hook {hook:?}"))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        bail!(
            "the hook `{hook} {verb}` failed ({}): {} {}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(text)
}

/// `ping -c 2` from the client container: whether every packet came back.
async fn pings(client: &mut Client, container: &str, ip: &str, limit: Duration) -> Result<bool> {
    let r = client
        .exec_sync(ExecSyncRequest {
            container_id: container.to_string(),
            cmd: ["ping", "-c", "2", "-W", "2", ip]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            timeout: i64::try_from(limit.as_secs()).unwrap_or(i64::MAX),
        })
        .await
        .map_err(rpc)?
        .into_inner();
    Ok(r.exit_code == 0 && String::from_utf8_lossy(&r.stdout).contains("2 packets received"))
}

/// Default-deny on the server pod blocks the client's ping; clearing the
/// policy lets it through again.
async fn policy(
    client: &mut Client,
    hook: &str,
    server_pod: &str,
    client_c: &str,
    ip: &str,
    limit: Duration,
) -> Result<()> {
    run_hook(hook, "deny", server_pod).await?;
    let (through, _) = step("net_ping_denied", limit, pings(client, client_c, ip, limit)).await?;
    if through {
        bail!("the server pod's default-deny policy let the client's ping to {ip} through");
    }
    let drops = run_hook(hook, "drops", server_pod).await?;
    println!("cri: net policy: default-deny on the server blocked the ping; drops: {drops}");
    run_hook(hook, "clear", server_pod).await?;
    let (through, _) = step("net_ping_cleared", limit, pings(client, client_c, ip, limit)).await?;
    if !through {
        bail!("the client's ping to {ip} still fails after the server pod's policy was cleared");
    }
    println!("cri: net policy: cleared, the ping passes again");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fetch_must_show_in_the_client_rx_and_where_expected_the_server_tx() {
        let before = [(100, 200), (300, 400)];
        let full = [(5_000, 200 + (4 << 20)), (300 + (4 << 20), 5_000)];
        assert!(moved(&before, &full, true).is_ok());
        // The direct datapath: the server's eth0 never transmitted.
        let direct = [(5_000, 270), (300 + (4 << 20), 400)];
        assert!(moved(&before, &direct, false).is_ok());
        assert!(moved(&before, &direct, true).is_err());
        // Counters that did not move fail either way (and never underflow).
        assert!(moved(&before, &before, false).is_err());
        assert!(moved(&full, &before, false).is_err());
    }
}

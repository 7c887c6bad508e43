//! `k7d net ...`: the pod policy and drop counters of a VM's datapath NICs.
//!
//! Both act directly on the VM's pinned bpf maps through
//! [`k7d_net::Datapath`] (the pins live under the bpffs root, by default
//! `/sys/fs/bpf/k7d/<vm tag>/nic<idx>/`), so no daemon is needed and the
//! result is the same whichever process attached the NICs.

use std::{net::IpAddr, path::PathBuf, process::ExitCode};

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};
use k7d_net::{Datapath, DatapathConfig, Direction, NetError, Peer, PodUid, Policy, vm_tag};
use serde_json::json;

/// `k7d net` subcommands.
#[derive(Clone, Debug, Subcommand)]
pub enum NetCmd {
    /// Replace a VM's pod policy (all its NICs), or clear it.
    ///
    /// Example: `k7d net policy web --default-deny --allow 9f1c-b2=10.0.1.7,10.0.1.8`.
    Policy {
        /// The VM id.
        vm: String,
        /// Drop traffic with every peer that is not allowed.
        #[arg(long, conflicts_with = "clear")]
        default_deny: bool,
        /// Allow a peer pod: its UID and addresses (repeatable).
        #[arg(long = "allow", value_name = "UID=IP[,IP...]", value_parser = parse_peer, conflicts_with = "clear")]
        allow: Vec<Peer>,
        /// Deny a peer pod: its UID and addresses (repeatable).
        #[arg(long = "deny", value_name = "UID=IP[,IP...]", value_parser = parse_peer, conflicts_with = "clear")]
        deny: Vec<Peer>,
        /// Remove the policy: all traffic passes again.
        #[arg(long)]
        clear: bool,
        #[command(flatten)]
        root: BpffsRoot,
    },
    /// Show a VM's non-zero drop counters: one `reason direction packets` line each.
    Drops {
        /// The VM id.
        vm: String,
        #[command(flatten)]
        root: BpffsRoot,
    },
    /// Show what the direct datapath passed on for a VM: one `direction
    /// packets bytes` line each, egress (from the guest) then ingress.
    Forwarded {
        /// The VM id.
        vm: String,
        #[command(flatten)]
        root: BpffsRoot,
    },
}

/// Where the datapath pins live.
#[derive(Clone, Debug, Args)]
pub struct BpffsRoot {
    /// The datapath's bpffs root.
    #[arg(long = "bpffs-root", env = "K7D_BPFFS_ROOT", default_value = "/sys/fs/bpf/k7d")]
    pub bpffs_root: PathBuf,
}

/// Parses `UID=IP[,IP...]`.
pub fn parse_peer(s: &str) -> Result<Peer, String> {
    let (uid, ips) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not UID=IP[,IP...]"))?;
    let uid = PodUid::parse(uid).map_err(|e| e.to_string())?;
    let addrs = ips
        .split(',')
        .map(|ip| {
            ip.trim()
                .parse::<IpAddr>()
                .map_err(|_| format!("{ip:?} in {s:?} is not an IP address"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Peer { uid, addrs })
}

fn datapath(vm: &str, root: &BpffsRoot) -> Result<Datapath> {
    let vm_dir = root.bpffs_root.join(vm_tag(vm));
    if !vm_dir.is_dir() {
        return Err(no_nic(vm, &root.bpffs_root));
    }
    Datapath::new(DatapathConfig {
        bpffs_root: root.bpffs_root.clone(),
        ..DatapathConfig::default()
    })
    .map_err(|e| anyhow!("cannot open the datapath of vm {vm}: {e}"))
}

fn no_nic(vm: &str, root: &std::path::Path) -> anyhow::Error {
    anyhow!(
        "vm {vm} has no direct-datapath NIC pinned under {}",
        root.join(vm_tag(vm)).display()
    )
}

fn net_err(vm: &str, what: &str, root: &BpffsRoot, e: NetError) -> anyhow::Error {
    match e {
        NetError::NoPrograms(_) => no_nic(vm, &root.bpffs_root),
        e => anyhow!("cannot {what} of vm {vm}: {e}"),
    }
}

fn peers_json(peers: &[Peer]) -> serde_json::Value {
    peers
        .iter()
        .map(|p| json!({"uid": p.uid.as_str(), "addrs": p.addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>()}))
        .collect()
}

/// Runs `cmd` and returns what it prints (JSON when `json`).
pub fn render(cmd: &NetCmd, json: bool) -> Result<String> {
    match cmd {
        NetCmd::Policy {
            vm,
            default_deny,
            allow,
            deny,
            clear,
            root,
        } => {
            if !clear && !default_deny && allow.is_empty() && deny.is_empty() {
                return Err(anyhow!(
                    "no policy given for vm {vm}: use --default-deny, --allow, --deny or --clear"
                ));
            }
            let dp = datapath(vm, root)?;
            if *clear {
                dp.clear_policy(vm)
                    .map_err(|e| net_err(vm, "clear the policy", root, e))?;
                return Ok(if json {
                    json!({"ok": true, "vm": vm, "cleared": true}).to_string()
                } else {
                    format!("vm {vm}: policy cleared, all traffic passes")
                });
            }
            let policy = Policy {
                default_deny: *default_deny,
                allow: allow.clone(),
                deny: deny.clone(),
            };
            dp.set_policy(vm, &policy)
                .map_err(|e| net_err(vm, "set the policy", root, e))?;
            Ok(if json {
                json!({
                    "ok": true,
                    "vm": vm,
                    "policy": {
                        "default_deny": default_deny,
                        "allow": peers_json(allow),
                        "deny": peers_json(deny),
                    }
                })
                .to_string()
            } else {
                format!(
                    "vm {vm}: policy set (default-deny {}, {} allowed and {} denied peer(s))",
                    if *default_deny { "on" } else { "off" },
                    allow.len(),
                    deny.len()
                )
            })
        }
        NetCmd::Drops { vm, root } => {
            let dp = datapath(vm, root)?;
            let drops = dp
                .drops(vm)
                .map_err(|e| net_err(vm, "read the drop counters", root, e))?;
            Ok(if json {
                let items: Vec<_> = drops
                    .iter()
                    .map(|d| {
                        json!({
                            "reason": d.reason.name(),
                            "direction": match d.direction {
                                Direction::Egress => "egress",
                                Direction::Ingress => "ingress",
                            },
                            "packets": d.packets,
                        })
                    })
                    .collect();
                json!({"ok": true, "vm": vm, "drops": items}).to_string()
            } else {
                drops.iter().map(|d| format!("{d}\n")).collect()
            })
        }
        NetCmd::Forwarded { vm, root } => {
            let dp = datapath(vm, root)?;
            let both = dp
                .forwarded(vm)
                .map_err(|e| net_err(vm, "read the forwarded counters", root, e))?;
            let name = |d: Direction| match d {
                Direction::Egress => "egress",
                Direction::Ingress => "ingress",
            };
            Ok(if json {
                let items: Vec<_> = both
                    .iter()
                    .map(|f| json!({"direction": name(f.direction), "packets": f.packets, "bytes": f.bytes}))
                    .collect();
                json!({"ok": true, "vm": vm, "forwarded": items}).to_string()
            } else {
                both.iter()
                    .map(|f| format!("{} {} {}\n", name(f.direction), f.packets, f.bytes))
                    .collect()
            })
        }
    }
}

/// Runs `cmd`, printing its result on stdout.
pub fn run(cmd: NetCmd, json: bool) -> Result<ExitCode> {
    let out = render(&cmd, json)?;
    if json {
        println!("{out}");
    } else {
        print!(
            "{}",
            if out.is_empty() || out.ends_with('\n') {
                out
            } else {
                out + "\n"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

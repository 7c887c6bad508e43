//! `k7d net policy` / `k7d net drops` / `k7d net forwarded` on a real direct-datapath attach (the
//! net crate's lab: netns, a pod veth, peers B and C, a relayed guest):
//! flags parsed by clap, policy set through the CLI function blocks traffic,
//! drops are counted and shown, clear restores it; errors name the VM.
//! Needs root, iproute2, ping and the bpf object built by clang.
#[path = "../../net/tests/common/mod.rs"]
mod common;

use std::process::ExitCode;

use clap::Parser;
use common::*;
use k7d_net::{AttachMethod, Mode, ObjectSource};
use k7d_vmm::netcli::{NetCmd, render, run};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: NetCmd,
}

fn cmd(args: &[&str]) -> NetCmd {
    let mut v = vec!["k7d-net"];
    v.extend_from_slice(args);
    Cli::try_parse_from(v).unwrap_or_else(|e| panic!("{args:?}: {e}")).cmd
}

/// (reason, direction) of every `drops` line whose count is at least 2 (each
/// refused ping sends two packets).
fn counts(drops: &str) -> Vec<(&str, &str)> {
    drops
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (reason, dir, n) = (w.next()?, w.next()?, w.next()?.parse::<u64>().ok()?);
            (n >= 2).then_some((reason, dir))
        })
        .collect()
}

#[test]
fn policy_and_drops_through_the_cli_functions() {
    let lab = Lab::new();
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    let vm = "vm-cli";
    let att = dp
        .attach(&lab.request(vm, Mode::Direct, Some("pod-a")))
        .expect("attach");
    let _guest = Guest::start(&lab, &att);
    let root = lab.bpffs.display().to_string();
    let pairs = || {
        [
            lab.guest.ping(B_IP),
            lab.b.ping(GUEST_IP),
            lab.guest.ping(C_IP),
            lab.c.ping(GUEST_IP),
        ]
    };
    assert_eq!(pairs(), [true; 4], "no policy");
    assert_eq!(render(&cmd(&["drops", vm, "--bpffs-root", &root]), false).unwrap(), "");
    // What passed: each direction carried at least the four pings' two
    // echo packets (requests one way, replies the other).
    let fwd = render(&cmd(&["forwarded", vm, "--bpffs-root", &root]), false).unwrap();
    let lines: Vec<Vec<&str>> = fwd.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(
        lines.iter().map(|l| l[0]).collect::<Vec<_>>(),
        ["egress", "ingress"],
        "{fwd}"
    );
    for l in &lines {
        let (packets, bytes): (u64, u64) = (l[1].parse().unwrap(), l[2].parse().unwrap());
        assert!(packets >= 4 && bytes >= 4 * 98, "{fwd}");
    }
    let j: serde_json::Value =
        serde_json::from_str(&render(&cmd(&["forwarded", vm, "--bpffs-root", &root]), true).unwrap()).unwrap();
    assert_eq!(j["forwarded"][1]["direction"], "ingress", "{j}");
    assert!(j["forwarded"][1]["packets"].as_u64().is_some_and(|n| n >= 4), "{j}");

    // default-deny + allow only C (two addresses for C, one of them unused).
    let set = cmd(&[
        "policy",
        vm,
        "--default-deny",
        "--allow",
        &format!("pod-c={C_IP},10.77.0.99"),
        "--bpffs-root",
        &root,
    ]);
    assert_eq!(run(set.clone(), false).unwrap(), ExitCode::SUCCESS);
    let shown = render(&set, false).unwrap();
    assert!(shown.contains("default-deny on, 1 allowed and 0 denied"), "{shown}");
    assert_eq!(pairs(), [false, false, true, true], "default-deny + allow C");
    let drops = render(&cmd(&["drops", vm, "--bpffs-root", &root]), false).unwrap();
    // Both pings' two packets were dropped and counted. At least two, not
    // exactly: a neighbour probe from B whose entry went stale while a loaded
    // machine ran the test is dropped (and counted) too.
    assert_eq!(
        counts(&drops),
        [
            ("pod-policy-default-deny", "egress"),
            ("pod-policy-default-deny", "ingress")
        ],
        "{drops}"
    );
    let j: serde_json::Value =
        serde_json::from_str(&render(&cmd(&["drops", vm, "--bpffs-root", &root]), true).unwrap()).unwrap();
    assert_eq!(j["vm"], vm);
    assert_eq!(j["drops"][0]["reason"], "pod-policy-default-deny");
    assert_eq!(j["drops"][0]["direction"], "egress");
    assert!(j["drops"][0]["packets"].as_u64().is_some_and(|n| n >= 2), "{j}");

    // Clear: everything passes, counters stay.
    let out = render(&cmd(&["policy", vm, "--clear", "--bpffs-root", &root]), true).unwrap();
    assert!(out.contains("\"cleared\":true"), "{out}");
    assert_eq!(pairs(), [true; 4], "cleared");

    // Deny B only.
    run(
        cmd(&["policy", vm, "--deny", &format!("pod-b={B_IP}"), "--bpffs-root", &root]),
        false,
    )
    .unwrap();
    assert_eq!(pairs(), [false, false, true, true], "deny B");
    let drops = render(&cmd(&["drops", vm, "--bpffs-root", &root]), false).unwrap();
    let deny: Vec<_> = counts(&drops)
        .into_iter()
        .filter(|(r, _)| *r == "pod-policy-deny")
        .collect();
    assert_eq!(
        deny,
        [("pod-policy-deny", "egress"), ("pod-policy-deny", "ingress")],
        "{drops}"
    );
    run(cmd(&["policy", vm, "--clear", "--bpffs-root", &root]), false).unwrap();
    assert_eq!(pairs(), [true; 4], "cleared again");

    // Refusals: bad flags are clap errors; a contradiction and an unknown VM
    // are one sentence naming the VM.
    let bad = Cli::try_parse_from(["k", "policy", vm, "--allow", "../x=10.0.0.1"]);
    assert!(bad.is_err_and(|e| e.to_string().contains("pod UID")));
    let bad = Cli::try_parse_from(["k", "policy", vm, "--allow", "pod-c=nope"]);
    assert!(bad.is_err_and(|e| e.to_string().contains("not an IP address")));
    assert!(Cli::try_parse_from(["k", "policy", vm, "--clear", "--default-deny"]).is_err());
    let e = render(
        &cmd(&[
            "policy",
            vm,
            "--allow",
            "pod-b=10.77.0.2",
            "--deny",
            "pod-b=10.77.0.2",
            "--bpffs-root",
            &root,
        ]),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("cannot set the policy of vm vm-cli: policy is invalid"),
        "{e}"
    );
    let e = render(&cmd(&["policy", vm, "--bpffs-root", &root]), false)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("no policy given for vm vm-cli"), "{e}");
    let e = run(cmd(&["drops", "web", "--bpffs-root", &root]), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!("vm web has no direct-datapath NIC pinned under {root}/")),
        "{e}"
    );

    drop(_guest);
    dp.detach(vm, 0, Some(&lab.pod.path()), "eth0").unwrap();
    drop(att);
    lab.assert_clean(&dp);
    let e = render(&cmd(&["drops", vm, "--bpffs-root", &root]), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no direct-datapath NIC pinned"), "{e}");
}

//! Clusters through the daemon's API (issue 16): create, add, info, list,
//! a fork of a cluster under one pause (its children running, each fork a
//! cluster of its own), delete as one, the shared id namespace, bad input
//! refused with a sentence, and nothing left.

use k7d_api::api::{ClusterArgs, CreateArgs, ErrorCode, ForkArgs, Reply, Request};
use k7d_tests::{TestDaemon, wait_for};
use std::time::Duration;

fn memwriter(id: &str) -> k7d_vmm::VmConfig {
    let mut cfg = k7d_tests::builtin("memwriter", 1, 8, &[16, 0x20_0000, 1]);
    cfg.id = Some(id.into());
    cfg
}

fn create(d: &TestDaemon, id: &str) {
    d.daemon
        .handle(Request::Create(CreateArgs {
            config: memwriter(id),
            start: true,
        }))
        .unwrap();
}

fn cluster(id: &str, members: &[&str]) -> ClusterArgs {
    ClusterArgs {
        id: id.into(),
        members: members.iter().map(|m| m.to_string()).collect(),
    }
}

fn err(d: &TestDaemon, req: Request) -> (ErrorCode, String) {
    let e = d.daemon.handle(req).unwrap_err();
    (e.code, e.message)
}

fn pauses(d: &TestDaemon, id: &str) -> u64 {
    d.daemon.with_vm(id, |vm| vm.pauses()).unwrap()
}

#[test]
fn a_cluster_forks_under_one_pause_into_clusters_of_its_own() {
    let d = TestDaemon::start("clusters");
    for id in ["a", "b", "c"] {
        create(&d, id);
    }
    let Reply::Cluster(info) = d
        .daemon
        .handle(Request::ClusterCreate(cluster("lab", &["a", "b"])))
        .unwrap()
    else {
        panic!("cluster_create answered another type")
    };
    assert_eq!(
        info.members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    let Reply::Cluster(info) = d.daemon.handle(Request::ClusterAdd(cluster("lab", &["c"]))).unwrap() else {
        panic!("cluster_add answered another type")
    };
    assert!(info.members.iter().all(|m| m.status == "running"), "{info:?}");
    assert!(
        d.dir.0.join("state/clusters/lab.json").exists(),
        "the cluster has a record"
    );

    let before: Vec<u64> = ["a", "b", "c"].iter().map(|m| pauses(&d, m)).collect();
    let Reply::Forked(f) = d
        .daemon
        .handle(Request::Fork(ForkArgs {
            id: "lab".into(),
            count: 2,
            ..Default::default()
        }))
        .unwrap()
    else {
        panic!("fork answered another type")
    };
    let after: Vec<u64> = ["a", "b", "c"].iter().map(|m| pauses(&d, m)).collect();
    for (m, (x, y)) in before.iter().zip(&after).enumerate() {
        assert_eq!(y - x, 1, "member {m}: one pause for the whole batch");
    }
    let ids: Vec<&str> = f.children.iter().map(|c| c.info.id.as_str()).collect();
    assert_eq!(ids, ["a-f1", "b-f1", "c-f1", "a-f2", "b-f2", "c-f2"]);
    assert!(f.children.iter().all(|c| c.info.status == "running"));
    assert_eq!(f.clusters, ["lab-f1", "lab-f2"]);
    assert!(f.source_paused_ms >= f.pause_ms);
    let Reply::Cluster(child) = d.daemon.handle(Request::ClusterInfo("lab-f2".into())).unwrap() else {
        panic!("cluster_info answered another type")
    };
    assert_eq!(
        child.members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["a-f2", "b-f2", "c-f2"]
    );
    // The children run (their guests' loop counters move).
    let counter = |id: &str| {
        d.daemon
            .with_vm(id, |vm| {
                k7d_tests::read_u32(vm, k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER)
            })
            .unwrap()
    };
    let c0 = counter("b-f1");
    assert!(
        wait_for(Duration::from_secs(5), || counter("b-f1") > c0),
        "a child does not run"
    );

    // A fork of a fork's cluster.
    let Reply::Forked(g) = d
        .daemon
        .handle(Request::Fork(ForkArgs {
            id: "lab-f1".into(),
            count: 1,
            ..Default::default()
        }))
        .unwrap()
    else {
        panic!("fork answered another type")
    };
    assert_eq!(g.clusters, ["lab-f1-f1"]);

    let Reply::Clusters(l) = d.daemon.handle(Request::ClusterList).unwrap() else {
        panic!("cluster_list answered another type")
    };
    let names: Vec<&str> = l.clusters.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(names, ["lab", "lab-f1", "lab-f1-f1", "lab-f2"]);

    // Deleting one member leaves the cluster with the others.
    d.daemon.handle(Request::Delete("c-f2".into())).unwrap();
    let Reply::Cluster(child) = d.daemon.handle(Request::ClusterInfo("lab-f2".into())).unwrap() else {
        panic!()
    };
    assert_eq!(child.members.len(), 2);

    // Delete as one: every member VM and the record.
    for c in ["lab-f1-f1", "lab-f2", "lab-f1", "lab"] {
        d.daemon.handle(Request::ClusterDelete(c.into())).unwrap();
        assert!(!d.dir.0.join(format!("state/clusters/{c}.json")).exists());
    }
    let Reply::List(vms) = d.daemon.handle(Request::List).unwrap() else {
        panic!()
    };
    assert!(vms.vms.is_empty(), "left: {:?}", vms.vms);
    assert!(d.record_files().is_empty(), "left: {:?}", d.record_files());
}

#[test]
fn bad_cluster_requests_are_refused_with_a_sentence_and_change_nothing() {
    let d = TestDaemon::start("clusters-bad");
    for id in ["a", "b"] {
        create(&d, id);
    }
    d.daemon.handle(Request::ClusterCreate(cluster("lab", &["a"]))).unwrap();
    let cases = [
        (
            Request::ClusterCreate(cluster("x", &["ghost"])),
            ErrorCode::NotFound,
            "vm ghost does not exist",
        ),
        (
            Request::ClusterCreate(cluster("x", &["b", "b"])),
            ErrorCode::InvalidArgument,
            "named twice",
        ),
        (
            Request::ClusterCreate(cluster("x", &["a"])),
            ErrorCode::Conflict,
            "member of cluster lab already",
        ),
        (
            Request::ClusterCreate(cluster("b", &["a"])),
            ErrorCode::Conflict,
            "b is a vm",
        ),
        (
            Request::ClusterCreate(cluster("lab", &["b"])),
            ErrorCode::Conflict,
            "cluster lab already exists",
        ),
        (
            Request::ClusterCreate(cluster("x", &[])),
            ErrorCode::InvalidArgument,
            "out of range",
        ),
        (
            Request::ClusterCreate(cluster("../x", &["b"])),
            ErrorCode::InvalidArgument,
            "",
        ),
        (
            Request::ClusterAdd(cluster("nope", &["b"])),
            ErrorCode::NotFound,
            "cluster nope does not exist",
        ),
        (
            Request::ClusterAdd(cluster("lab", &["a"])),
            ErrorCode::InvalidArgument,
            "named twice",
        ),
        (
            Request::ClusterInfo("nope".into()),
            ErrorCode::NotFound,
            "cluster nope does not exist",
        ),
        (
            Request::ClusterDelete("nope".into()),
            ErrorCode::NotFound,
            "cluster nope does not exist",
        ),
        (
            Request::Fork(ForkArgs {
                id: "lab".into(),
                count: 65,
                ..Default::default()
            }),
            ErrorCode::InvalidArgument,
            "out of range",
        ),
    ];
    for (req, code, msg) in cases {
        let what = format!("{req:?}");
        let (c, m) = err(&d, req);
        assert_eq!(c, code, "{what}: {m}");
        assert!(m.contains(msg), "{what}: {m}");
    }
    // A VM may not take a cluster's id.
    let (c, m) = err(
        &d,
        Request::Create(CreateArgs {
            config: memwriter("lab"),
            start: false,
        }),
    );
    assert_eq!(c, ErrorCode::Conflict, "{m}");
    assert!(m.contains("lab is a cluster"), "{m}");
    // Forks times members past the limit.
    d.daemon.handle(Request::ClusterAdd(cluster("lab", &["b"]))).unwrap();
    let (c, m) = err(
        &d,
        Request::Fork(ForkArgs {
            id: "lab".into(),
            count: 40,
            ..Default::default()
        }),
    );
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    assert!(m.contains("make 80 VMs"), "{m}");
    // Nothing changed: one cluster of a and b, two VMs.
    let Reply::Clusters(l) = d.daemon.handle(Request::ClusterList).unwrap() else {
        panic!()
    };
    assert_eq!(l.clusters.len(), 1);
    assert_eq!(l.clusters[0].members, ["a", "b"]);
    let Reply::List(vms) = d.daemon.handle(Request::List).unwrap() else {
        panic!()
    };
    assert_eq!(vms.vms.len(), 2);
    d.daemon.handle(Request::ClusterDelete("lab".into())).unwrap();
    assert!(d.record_files().is_empty());
}

#[test]
fn a_cluster_fork_that_cannot_build_a_child_leaves_no_child_and_the_members_running() {
    let d = TestDaemon::start("clusters-fail");
    for id in ["a", "b"] {
        create(&d, id);
    }
    d.daemon
        .handle(Request::ClusterCreate(cluster("lab", &["a", "b"])))
        .unwrap();
    // b-f1's record path is taken by a directory: its record cannot be written.
    std::fs::create_dir_all(d.dir.0.join("state/vms/b-f1.json")).unwrap();
    let (c, m) = err(
        &d,
        Request::Fork(ForkArgs {
            id: "lab".into(),
            count: 1,
            ..Default::default()
        }),
    );
    assert_eq!(c, ErrorCode::Internal, "{m}");
    std::fs::remove_dir(d.dir.0.join("state/vms/b-f1.json")).unwrap();
    let Reply::List(vms) = d.daemon.handle(Request::List).unwrap() else {
        panic!()
    };
    let ids: Vec<&str> = vms.vms.iter().map(|v| v.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"], "no child is left");
    assert!(vms.vms.iter().all(|v| v.status == "running"), "{vms:?}");
    let Reply::Clusters(l) = d.daemon.handle(Request::ClusterList).unwrap() else {
        panic!()
    };
    assert_eq!(l.clusters.len(), 1, "no child cluster is left: {l:?}");
    assert!(!d.dir.0.join("state/clusters/lab-f1.json").exists());
    // The ids are free again: the same fork now works.
    let Reply::Forked(f) = d
        .daemon
        .handle(Request::Fork(ForkArgs {
            id: "lab".into(),
            count: 1,
            ..Default::default()
        }))
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(f.clusters, ["lab-f1"]);
    d.daemon.handle(Request::ClusterDelete("lab-f1".into())).unwrap();
    d.daemon.handle(Request::ClusterDelete("lab".into())).unwrap();
    assert!(d.record_files().is_empty());
}

#[test]
fn a_deleted_member_leaves_its_cluster_and_its_id_does_not_rejoin() {
    let d = TestDaemon::start("clusters-delete");
    for id in ["a", "b"] {
        create(&d, id);
    }
    d.daemon
        .handle(Request::ClusterCreate(cluster("lab", &["a", "b"])))
        .unwrap();
    d.daemon.handle(Request::Delete("a".into())).unwrap();
    create(&d, "a");
    let Reply::Cluster(info) = d.daemon.handle(Request::ClusterInfo("lab".into())).unwrap() else {
        panic!()
    };
    let members: Vec<&str> = info.members.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(members, ["b"], "the new vm a is not a member");
    let rec = std::fs::read_to_string(d.dir.0.join("state/clusters/lab.json")).unwrap();
    assert!(!rec.contains("\"a\""), "{rec}");
    d.daemon.handle(Request::ClusterDelete("lab".into())).unwrap();
    let Reply::List(vms) = d.daemon.handle(Request::List).unwrap() else {
        panic!()
    };
    let ids: Vec<&str> = vms.vms.iter().map(|v| v.id.as_str()).collect();
    assert_eq!(ids, ["a"], "deleting the cluster leaves the vm that is not its member");
    d.daemon.handle(Request::Delete("a".into())).unwrap();
}

#[test]
fn cluster_records_go_at_shutdown_and_a_stale_one_goes_at_start() {
    let d = TestDaemon::start("clusters-records");
    create(&d, "a");
    d.daemon.handle(Request::ClusterCreate(cluster("lab", &["a"]))).unwrap();
    let dir = d.dir.0.join("state/clusters");
    assert!(dir.join("lab.json").exists());
    d.daemon.shutdown();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no cluster record is left");

    // A record a killed daemon left, and something that is not a record.
    let state = d.dir.0.join("state2");
    std::fs::create_dir_all(state.join("clusters/not-a-record")).unwrap();
    std::fs::write(
        state.join("clusters/brold.json"),
        r#"{"version":2,"id":"brold","members":[{"id":"x","bridged":[0]}],"bridge":"k7dc0"}"#,
    )
    .unwrap();
    // ... and its bridge, which the killed daemon left too.
    let stale = k7d_net::cluster_bridge_name("brold");
    let ip = |args: &[&str]| {
        let st = std::process::Command::new("ip").args(args).status().unwrap();
        assert!(st.success(), "ip {args:?}");
    };
    ip(&["link", "add", &stale, "type", "bridge"]);
    let (d2, _) = k7d_vmm::daemon::Daemon::open(&state).unwrap();
    assert!(
        !state.join("clusters/brold.json").exists(),
        "the stale record is removed"
    );
    assert!(
        !std::path::Path::new("/sys/class/net").join(&stale).exists(),
        "the stale record's bridge is removed"
    );
    assert!(
        state.join("clusters/not-a-record").is_dir(),
        "a directory is left alone"
    );
    let Reply::Clusters(l) = d2.handle(Request::ClusterList).unwrap() else {
        panic!()
    };
    assert!(l.clusters.is_empty());
}

/// The IPv6 switch of link `name` (`disable_ipv6`).
fn ipv6_off(name: &str) -> bool {
    std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6")).map_or(true, |s| s.trim() == "1")
}

fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

/// The MAC the daemon gave NIC `i` of `vm` (its device line).
fn guest_mac(d: &TestDaemon, vm: &str) -> Vec<String> {
    let Reply::Vm(info) = d.daemon.handle(Request::Info(vm.into())).unwrap() else {
        panic!("info answered another type")
    };
    info.devices
        .iter()
        .filter_map(|dev| dev.detail.split("mac ").nth(1))
        .map(|m| m.chars().take(17).collect())
        .collect()
}

#[test]
fn a_cluster_has_a_private_bridge_and_each_fork_one_of_its_own() {
    use k7d_net::{cluster_bridge_name as bridge_of, master_of, nic_names};
    // NICs are virtio-pci functions, which only Linux guests get. Stock
    // Linux does not run on this host's KVM (PVM): the members are built
    // and never started; their children start and may stop at once, but
    // every VM holds its taps until it is deleted, which is what this
    // test is about (the lab runs real guests on these bridges: k7d-cluster).
    let Some(kernel) = k7d_tests::cached_cloud_kernel() else {
        k7d_test_skip::skip(
            "a_cluster_has_a_private_bridge_and_each_fork_one_of_its_own",
            "no Debian cloud kernel in the lab cache (tests/lab/run.sh --fetch puts it there; .ci/run does)",
        );
        return;
    };
    let d = TestDaemon::start("clusters-bridges");
    let initrd = d.dir.0.join("initrd");
    std::fs::write(&initrd, vec![0x5au8; 1 << 20]).unwrap();
    // bra, brb: one NIC each, on the bridge; brc: one on it, and one whose
    // tap the user named, which stays outside.
    let out_tap = "k7dxbrout0";
    for (id, nics) in [("bra", 1), ("brb", 1), ("brc", 2)] {
        let mut cfg = k7d_tests::linux_build_config(&kernel, &initrd, std::path::Path::new("/dev/null"));
        cfg.id = Some(id.into());
        cfg.vcpus = 1;
        cfg.memory_mib = 128;
        cfg.devices.disks.clear();
        cfg.devices.rng = false;
        cfg.devices.nics = (0..nics)
            .map(|i| k7d_api::config::NicConfig {
                tap: (i == 1).then(|| out_tap.to_string()),
                ..Default::default()
            })
            .collect();
        d.daemon
            .handle(Request::Create(CreateArgs {
                config: cfg,
                start: false,
            }))
            .unwrap();
    }
    let tap = |vm: &str, i: u16| nic_names(vm, i).tap;
    // A tap somebody put on a bridge is theirs: the create is refused and
    // changes nothing.
    let theirs = "k7dxbrtheirs";
    let ip = |args: &[&str]| {
        let st = std::process::Command::new("ip").args(args).status().unwrap();
        assert!(st.success(), "ip {args:?}");
    };
    ip(&["link", "add", theirs, "type", "bridge"]);
    ip(&["link", "set", &tap("brb", 0), "master", theirs]);
    let (code, msg) = err(&d, Request::ClusterCreate(cluster("brnet", &["bra", "brb", "brc"])));
    assert_eq!(code, ErrorCode::Conflict, "{msg}");
    assert!(msg.contains(&format!("is on bridge {theirs} already")), "{msg}");
    assert!(
        !link_exists(&bridge_of("brnet")),
        "no bridge is left of the refused create"
    );
    assert_eq!(master_of(&tap("bra", 0)).unwrap(), None, "bra's tap was not moved");
    assert_eq!(master_of(&tap("brb", 0)).unwrap().as_deref(), Some(theirs));
    ip(&["link", "del", theirs]);
    let Reply::Cluster(info) = d
        .daemon
        .handle(Request::ClusterCreate(cluster("brnet", &["bra", "brb", "brc"])))
        .unwrap()
    else {
        panic!("cluster_create answered another type")
    };
    let br = bridge_of("brnet");
    assert_eq!(info.bridge.as_deref(), Some(br.as_str()));
    assert_eq!(
        info.ports,
        [
            format!("bra:0:{}", tap("bra", 0)),
            format!("brb:0:{}", tap("brb", 0)),
            format!("brc:0:{}", tap("brc", 0))
        ]
    );
    for vm in ["bra", "brb", "brc"] {
        assert_eq!(
            master_of(&tap(vm, 0)).unwrap().as_deref(),
            Some(br.as_str()),
            "{vm}'s tap"
        );
        assert!(ipv6_off(&tap(vm, 0)), "{vm}'s tap has IPv6 off");
    }
    assert!(ipv6_off(&br), "the bridge has IPv6 off");
    assert_eq!(master_of(out_tap).unwrap(), None, "a tap the user named stays outside");

    let Reply::Forked(f) = d
        .daemon
        .handle(Request::Fork(ForkArgs {
            id: "brnet".into(),
            count: 2,
            ..Default::default()
        }))
        .unwrap()
    else {
        panic!("fork answered another type")
    };
    assert_eq!(f.clusters, ["brnet-f1", "brnet-f2"]);
    let mut bridges = vec![br.clone()];
    for (n, cid) in f.clusters.iter().enumerate() {
        let Reply::Cluster(ci) = d.daemon.handle(Request::ClusterInfo(cid.clone())).unwrap() else {
            panic!()
        };
        let cbr = bridge_of(cid);
        assert_eq!(
            ci.bridge.as_deref(),
            Some(cbr.as_str()),
            "fork {n} has a bridge of its own"
        );
        assert!(!bridges.contains(&cbr));
        bridges.push(cbr.clone());
        assert!(ipv6_off(&cbr));
        for (m, src) in ci.members.iter().zip(["bra", "brb", "brc"]) {
            assert_eq!(
                master_of(&tap(&m.id, 0)).unwrap().as_deref(),
                Some(cbr.as_str()),
                "child {}'s tap is on its fork's bridge",
                m.id
            );
            assert!(ipv6_off(&tap(&m.id, 0)));
            assert_eq!(
                guest_mac(&d, &m.id),
                guest_mac(&d, src),
                "child {} keeps {src}'s MACs",
                m.id
            );
        }
        // The outside NIC's twin: a tap of its own, on no bridge.
        let c_out = tap(&ci.members[2].id, 1);
        assert!(link_exists(&c_out), "the child has a tap for the outside NIC");
        assert_eq!(
            master_of(&c_out).unwrap(),
            None,
            "the outside NIC's twin is on no bridge"
        );
    }
    // Each bridge's ports are its own cluster's taps only.
    let ports = |b: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(format!("/sys/class/net/{b}/brif"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    for (b, cid) in bridges.iter().zip(["brnet", "brnet-f1", "brnet-f2"]) {
        let Reply::Cluster(ci) = d.daemon.handle(Request::ClusterInfo(cid.into())).unwrap() else {
            panic!()
        };
        let mut want: Vec<String> = ci.members.iter().map(|m| tap(&m.id, 0)).collect();
        want.sort();
        assert_eq!(ports(b), want, "bridge {b} of {cid}");
    }

    // Deleting a fork takes its bridge; the others stay. Then the source,
    // then the last fork: nothing of the clusters is left.
    d.daemon.handle(Request::ClusterDelete("brnet-f1".into())).unwrap();
    assert!(!link_exists(&bridges[1]), "the deleted fork's bridge is gone");
    assert!(link_exists(&bridges[0]) && link_exists(&bridges[2]));
    d.daemon.handle(Request::ClusterDelete("brnet".into())).unwrap();
    assert!(!link_exists(&bridges[0]));
    d.daemon.handle(Request::ClusterDelete("brnet-f2".into())).unwrap();
    for b in &bridges {
        assert!(!link_exists(b), "bridge {b} is left");
    }
    for c in f
        .children
        .iter()
        .map(|c| c.info.id.as_str())
        .chain(["bra", "brb", "brc"])
    {
        assert!(!link_exists(&tap(c, 0)), "{c}'s tap is left");
    }
    assert!(!link_exists(out_tap));
    let Reply::List(l) = d.daemon.handle(Request::List).unwrap() else {
        panic!()
    };
    assert!(l.vms.is_empty(), "{:?}", l.vms);
    assert_eq!(
        std::fs::read_dir(d.dir.0.join("state/clusters")).unwrap().count(),
        0,
        "no cluster record is left"
    );
}

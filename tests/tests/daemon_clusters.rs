//! Clusters through the daemon's API (issue 16): create, add, info, list,
//! a fork of a cluster under one pause (its children running, each fork a
//! cluster of its own), delete as one, the shared id namespace, bad input
//! refused with a sentence, and nothing left.

use k7d_tests::{TestDaemon, wait_for};
use k7d_vmm::daemon::api::{ClusterArgs, CreateArgs, ErrorCode, ForkArgs, Reply, Request};
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
        state.join("clusters/old.json"),
        r#"{"version":1,"id":"old","members":["x"]}"#,
    )
    .unwrap();
    let (d2, _) = k7d_vmm::daemon::Daemon::open(&state).unwrap();
    assert!(!state.join("clusters/old.json").exists(), "the stale record is removed");
    assert!(
        state.join("clusters/not-a-record").is_dir(),
        "a directory is left alone"
    );
    let Reply::Clusters(l) = d2.handle(Request::ClusterList).unwrap() else {
        panic!()
    };
    assert!(l.clusters.is_empty());
}

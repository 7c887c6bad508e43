//! Datapath tests: real traffic through direct, bridge and auto; the policy
//! matrix; fallback; rollback; teardown; concurrency; reconcile. They need
//! root, iproute2, ping and (for direct) the bpf object built by clang.
mod common;

use std::{
    collections::HashSet,
    io::Write,
    sync::{Arc, Mutex},
};

use common::*;
use k7d_net::{
    AttachMethod, Direction, DropReason, EffectiveMode, FallbackReason, Mode, NetError, ObjectSource, Peer, PodUid,
    Policy,
};

fn traffic(lab: &Lab, att: &k7d_net::Attached) {
    let _guest = Guest::start(lab, att);
    assert!(lab.guest.ping(B_IP), "guest -> B ping failed");
    assert!(lab.b.ping(GUEST_IP), "B -> guest ping failed");
    tcp_roundtrip(&lab.b, B_IP, &lab.guest, 4 << 20);
    tcp_roundtrip(&lab.guest, GUEST_IP, &lab.b, 4 << 20);
}

fn mode_traffic(mode: Mode, method: AttachMethod, want: EffectiveMode) {
    init_tracing();
    let lab = Lab::new();
    let dp = lab.datapath(ObjectSource::Embedded, method);
    let att = dp
        .attach(&lab.request("vm-traffic", mode, Some("pod-a")))
        .expect("attach");
    assert_eq!(att.effective_mode, want);
    assert_eq!(att.reason, None);
    assert_eq!(att.fallback, None);
    if want == EffectiveMode::Direct {
        assert!(att.redirect_peer, "pod eth0 is a veth with its peer in N");
        assert!(att.bridge.is_none());
    } else {
        assert!(att.bridge.is_some());
    }
    let inv = dp.inventory(&[&lab.pod.path()]).unwrap();
    match (want, method) {
        (EffectiveMode::Direct, AttachMethod::Netlink) => {
            assert_eq!(inv.filters.len(), 2, "{inv:?}");
            assert_eq!(inv.qdiscs.len(), 2, "{inv:?}");
        }
        (EffectiveMode::Direct, _) => assert_eq!(inv.tcx.len(), 2, "{inv:?}"),
        (EffectiveMode::Bridge, _) => assert_eq!(inv.links.len(), 2, "{inv:?}"),
    }
    let before = att
        .bpf_dir
        .as_ref()
        .map(|_| dp.forwarded("vm-traffic").expect("forwarded counters"));
    traffic(&lab, &att);
    // What the programs passed on is counted: 4 MiB and more each way
    // (the frames' headers on top), by direction.
    if let Some(before) = before {
        let after = dp.forwarded("vm-traffic").expect("forwarded counters");
        for (b, a) in before.iter().zip(&after) {
            assert!(
                a.bytes - b.bytes >= 4 << 20 && a.packets > b.packets,
                "{:?}: {} packets, {} bytes passed on for 4 MiB each way",
                a.direction,
                a.packets - b.packets,
                a.bytes - b.bytes
            );
        }
        assert_eq!(after.map(|f| f.direction), [Direction::Egress, Direction::Ingress]);
    }
    // The path really is the one claimed: in direct mode there is no k7d
    // bridge, in bridge mode eth0 is a port of the k7d bridge.
    let links = lab
        .pod
        .exec(&["ip", "-o", "link", "show", "master", att.names.bridge.as_str()]);
    let listing = String::from_utf8_lossy(&links.stdout);
    assert_eq!(listing.contains("eth0@"), want == EffectiveMode::Bridge, "{listing}");
    dp.detach("vm-traffic", 0, Some(&lab.pod.path()), "eth0")
        .expect("detach");
    drop(att);
    lab.assert_clean(&dp);
    assert!(matches!(dp.forwarded("vm-traffic"), Err(NetError::NoPrograms(_))));
    // Detach is idempotent.
    dp.detach("vm-traffic", 0, Some(&lab.pod.path()), "eth0")
        .expect("detach again");
}

#[test]
fn direct_mode_carries_ping_and_tcp_both_ways() {
    mode_traffic(Mode::Direct, AttachMethod::Auto, EffectiveMode::Direct);
}

#[test]
fn direct_mode_over_clsact_netlink_filters() {
    mode_traffic(Mode::Direct, AttachMethod::Netlink, EffectiveMode::Direct);
}

#[test]
fn bridge_mode_carries_ping_and_tcp_both_ways() {
    mode_traffic(Mode::Bridge, AttachMethod::Auto, EffectiveMode::Bridge);
}

#[test]
fn auto_mode_picks_direct_and_carries_traffic() {
    mode_traffic(Mode::Auto, AttachMethod::Auto, EffectiveMode::Direct);
}

fn peer(uid: &str, ip: &str) -> Peer {
    Peer {
        uid: PodUid::parse(uid).unwrap(),
        addrs: vec![ip.parse().unwrap()],
    }
}

fn count(dp: &k7d_net::Datapath, vm: &str, r: DropReason, d: Direction) -> u64 {
    dp.drops(vm)
        .unwrap()
        .iter()
        .filter(|c| c.reason == r && c.direction == d)
        .map(|c| c.packets)
        .sum()
}

fn policy_matrix(mode: Mode) {
    init_tracing();
    let lab = Lab::new();
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    let vm = "vm-policy";
    let att = dp.attach(&lab.request(vm, mode, Some("pod-a"))).expect("attach");
    assert!(att.bpf_dir.is_some());
    let _guest = Guest::start(&lab, &att);
    let pairs = |want: [bool; 4], phase: &str| {
        let got = [
            lab.guest.ping(B_IP),
            lab.b.ping(GUEST_IP),
            lab.guest.ping(C_IP),
            lab.c.ping(GUEST_IP),
        ];
        assert_eq!(got, want, "{phase}: [A->B, B->A, A->C, C->A]");
    };
    // 1. No policy: everything passes, nothing is counted.
    pairs([true; 4], "no policy");
    assert!(dp.drops(vm).unwrap().is_empty());
    // 2. default-deny + allow only C.
    dp.set_policy(
        vm,
        &Policy {
            default_deny: true,
            allow: vec![peer("pod-c", C_IP)],
            deny: vec![],
        },
    )
    .unwrap();
    pairs([false, false, true, true], "default-deny + allow C");
    // Both refused pings of each direction are counted. Exact totals flaked
    // in CI (one packet too many, rarely): a just-created interface also
    // sends link-local control traffic of its own for a couple of seconds
    // (see CHALLENGES.md), so the test asks for at least the pings.
    let deny_out = count(&dp, vm, DropReason::DefaultDeny, Direction::Egress);
    let deny_in = count(&dp, vm, DropReason::DefaultDeny, Direction::Ingress);
    assert!(
        deny_out >= 2,
        "default-deny egress counted {deny_out}, expected both pings"
    );
    assert!(
        deny_in >= 2,
        "default-deny ingress counted {deny_in}, expected both pings"
    );
    assert_eq!(count(&dp, vm, DropReason::PolicyDeny, Direction::Egress), 0);
    // 3. Cleared: all pass, counters do not move.
    dp.clear_policy(vm).unwrap();
    pairs([true; 4], "cleared");
    assert_eq!(count(&dp, vm, DropReason::DefaultDeny, Direction::Egress), deny_out);
    assert_eq!(count(&dp, vm, DropReason::DefaultDeny, Direction::Ingress), deny_in);
    // 4. Deny B only.
    dp.set_policy(
        vm,
        &Policy {
            default_deny: false,
            allow: vec![],
            deny: vec![peer("pod-b", B_IP)],
        },
    )
    .unwrap();
    pairs([false, false, true, true], "deny B");
    let pdeny_out = count(&dp, vm, DropReason::PolicyDeny, Direction::Egress);
    assert!(pdeny_out >= 2, "policy-deny egress counted {pdeny_out}");
    assert!(count(&dp, vm, DropReason::PolicyDeny, Direction::Ingress) >= 2);
    let shown: Vec<String> = dp.drops(vm).unwrap().iter().map(|c| c.to_string()).collect();
    assert!(
        shown.contains(&format!("pod-policy-deny egress {pdeny_out}")),
        "{shown:?}"
    );
    // A contradictory policy is refused and changes nothing.
    let bad = Policy {
        default_deny: true,
        allow: vec![peer("pod-b", B_IP)],
        deny: vec![peer("pod-b", B_IP)],
    };
    assert!(dp.set_policy(vm, &bad).is_err());
    pairs([false, false, true, true], "after refused policy");
    drop(_guest);
    dp.detach(vm, 0, Some(&lab.pod.path()), "eth0").unwrap();
    drop(att);
    lab.assert_clean(&dp);
    assert!(matches!(dp.drops(vm), Err(NetError::NoPrograms(_))));
}

#[test]
fn policy_matrix_direct() {
    policy_matrix(Mode::Direct);
}

#[test]
fn policy_matrix_bridge() {
    policy_matrix(Mode::Bridge);
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn auto_without_object_falls_back_with_one_log_line_and_direct_refuses() {
    let lab = Lab::new();
    let dp = lab.datapath(object_missing(), AttachMethod::Auto);
    // direct: refused with the reason, nothing left behind.
    let err = dp
        .attach(&lab.request("vm-fb", Mode::Direct, Some("pod-a")))
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, NetError::DirectRefused { .. }), "{msg}");
    assert!(msg.contains("bpf object missing"), "{msg}");
    lab.assert_clean(&dp);
    // auto: bridge chain, one log line with the reason.
    let cap = Capture::default();
    let sink = cap.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let counted = |r: FallbackReason| k7d_net::fallbacks().iter().find(|(c, _)| *c == r).unwrap().1;
    let before = counted(FallbackReason::NoObject);
    let att = tracing::subscriber::with_default(sub, || dp.attach(&lab.request("vm-fb", Mode::Auto, Some("pod-a"))))
        .expect("auto attach");
    // Counted for the scrape under its class (other tests of this binary
    // may fall back at the same time: at least this one).
    assert_eq!(att.fallback, Some(FallbackReason::NoObject));
    assert!(counted(FallbackReason::NoObject) > before);
    let log = String::from_utf8(cap.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("falling back to the bridge chain"), "{log}");
    assert!(lines[0].contains("bpf object missing"), "{log}");
    assert_eq!(att.effective_mode, EffectiveMode::Bridge);
    assert!(att.reason.as_deref().unwrap().contains("bpf object missing"));
    assert!(att.bpf_dir.is_none(), "no object, so no policy programs");
    assert_ne!(Some(att.guest_mac), None);
    traffic(&lab, &att);
    dp.detach("vm-fb", 0, Some(&lab.pod.path()), "eth0").unwrap();
    drop(att);
    lab.assert_clean(&dp);
}

#[test]
fn unsupported_shape_falls_back_or_is_refused() {
    let lab = Lab::new();
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    let why = "1 Multus secondary NIC(s) are not supported with the direct datapath yet";
    let mut req = lab.request("vm-shape", Mode::Direct, None);
    req.unsupported = Some(why.into());
    let err = dp.attach(&req).unwrap_err();
    assert!(err.to_string().ends_with(why), "{err}");
    lab.assert_clean(&dp);
    req.mode = Mode::Auto;
    let att = dp.attach(&req).unwrap();
    assert_eq!(att.effective_mode, EffectiveMode::Bridge);
    assert_eq!(att.reason.as_deref(), Some(why));
    assert_eq!(att.fallback, Some(FallbackReason::Unsupported));
    dp.detach("vm-shape", 0, Some(&lab.pod.path()), "eth0").unwrap();
    drop(att);
    lab.assert_clean(&dp);
}

#[test]
fn a_failed_direct_attempt_rolls_everything_back() {
    let lab = Lab::new();
    // A corrupt object: the tap is created, then loading fails.
    let bad = lab.bpffs.with_extension("bad.o");
    let bad = std::env::temp_dir().join(bad.file_name().unwrap());
    std::fs::write(&bad, b"\x7fELF not really").unwrap();
    let dp = lab.datapath(ObjectSource::File(bad.clone()), AttachMethod::Auto);
    let err = dp.attach(&lab.request("vm-rb", Mode::Direct, None)).unwrap_err();
    assert!(err.to_string().contains("could not be loaded"), "{err}");
    lab.assert_clean(&dp);
    // Attaching to an interface that does not exist fails in both modes.
    let mut req = lab.request("vm-rb", Mode::Auto, None);
    req.pod_if = "nope0";
    assert!(dp.attach(&req).is_err());
    lab.assert_clean(&dp);
    let _ = std::fs::remove_file(bad);
}

#[test]
fn invalid_pod_uid_is_refused_and_consumes_nothing() {
    let lab = Lab::new();
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    for uid in ["../x", "a/b", ""] {
        for mode in [Mode::Direct, Mode::Bridge, Mode::Auto] {
            let err = dp.attach(&lab.request("vm-uid", mode, Some(uid))).unwrap_err();
            assert!(err.to_string().starts_with("pod UID"), "{err}");
        }
    }
    lab.assert_clean(&dp);
}

#[test]
fn hundred_create_delete_cycles_leave_nothing() {
    let lab = Lab::new();
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    for i in 0..100u32 {
        let mode = if i % 2 == 0 { Mode::Direct } else { Mode::Bridge };
        let vm = format!("vm-cycle-{}", i % 7);
        let att = dp
            .attach(&lab.request(&vm, mode, Some("pod-a")))
            .unwrap_or_else(|e| panic!("cycle {i}: {e}"));
        if i % 10 == 0 {
            // Idempotent create: attaching again replaces, never duplicates.
            drop(att);
            let att = dp.attach(&lab.request(&vm, mode, Some("pod-a"))).unwrap();
            drop(att);
        } else {
            drop(att);
        }
        dp.detach(&vm, 0, Some(&lab.pod.path()), "eth0").unwrap();
    }
    lab.assert_clean(&dp);
}

#[test]
fn twenty_vms_attach_concurrently_without_collisions() {
    let lab = Lab::new();
    for i in 0..20 {
        lab.pod.ip(&[
            "link",
            "add",
            &format!("ceth{i}"),
            "type",
            "veth",
            "peer",
            "name",
            &format!("cl{i}"),
            "netns",
            &lab.node.name,
        ]);
    }
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    let pod = lab.pod.path();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..20)
            .map(|i| {
                let dp = &dp;
                let pod = &pod;
                s.spawn(move || {
                    let vm = format!("vm-par-{i}");
                    let iface = format!("ceth{i}");
                    let uid = format!("pod-{i}");
                    dp.attach(&k7d_net::NicRequest {
                        vm_id: &vm,
                        nic_idx: 0,
                        mode: Mode::Direct,
                        pod_netns: pod,
                        pod_if: &iface,
                        queues: 2,
                        vnet_hdr: true,
                        pod_uid: Some(&uid),
                        unsupported: None,
                        adopt: false,
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut taps = HashSet::new();
    let mut dirs = HashSet::new();
    for r in &results {
        let a = r.as_ref().expect("attach");
        assert_eq!(a.effective_mode, EffectiveMode::Direct);
        assert_eq!(a.tap.queues.len(), 2);
        assert!(taps.insert(a.tap.name.clone()));
        assert!(dirs.insert(a.bpf_dir.clone().unwrap()));
    }
    let inv = dp.inventory(&[&pod]).unwrap();
    assert_eq!(inv.links.len(), 20, "{:?}", inv.links);
    assert_eq!(inv.tcx.len(), 40, "{:?}", inv.tcx);
    std::thread::scope(|s| {
        for i in 0..20 {
            let dp = &dp;
            let pod = &pod;
            s.spawn(move || {
                dp.detach(&format!("vm-par-{i}"), 0, Some(pod), &format!("ceth{i}"))
                    .unwrap()
            });
        }
    });
    drop(results);
    lab.assert_clean(&dp);
}

#[test]
fn reconcile_removes_what_a_crashed_daemon_left() {
    let lab = Lab::new();
    lab.pod.ip(&[
        "link",
        "add",
        "eth1",
        "type",
        "veth",
        "peer",
        "name",
        "lx1",
        "netns",
        &lab.node.name,
    ]);
    lab.pod.ip(&[
        "link",
        "add",
        "eth2",
        "type",
        "veth",
        "peer",
        "name",
        "lx2",
        "netns",
        &lab.node.name,
    ]);
    let tcx = lab.datapath(ObjectSource::Embedded, AttachMethod::Tcx);
    let nl = lab.datapath(ObjectSource::Embedded, AttachMethod::Netlink);
    let mut r0 = lab.request("vm-crash-0", Mode::Direct, None);
    r0.pod_if = "eth0";
    let mut r1 = lab.request("vm-crash-1", Mode::Direct, None);
    r1.pod_if = "eth1";
    let mut r2 = lab.request("vm-crash-2", Mode::Bridge, None);
    r2.pod_if = "eth2";
    let a0 = tcx.attach(&r0).unwrap();
    let a1 = nl.attach(&r1).unwrap();
    let a2 = tcx.attach(&r2).unwrap();
    // The "crash": fds close, nothing is detached. Taps vanish with their
    // fds; pins, TCX links, the netlink filter + clsact and the bridge stay.
    drop((a0, a1, a2));
    let inv = tcx.inventory(&[&lab.pod.path()]).unwrap();
    assert!(
        !inv.pins.is_empty() && !inv.filters.is_empty() && !inv.qdiscs.is_empty(),
        "{inv:?}"
    );
    assert!(inv.links.iter().any(|l| l.contains("k7db")), "{inv:?}");
    assert!(!inv.tcx.is_empty(), "{inv:?}");
    // Keep vm-crash-0: its pins survive, the rest goes.
    let rep = tcx.reconcile(&[&lab.pod.path()], &[("vm-crash-0", 0)]).unwrap();
    assert_eq!(rep.nic_dirs, 2);
    assert_eq!(rep.links, 1);
    assert!(rep.filters >= 1);
    let inv = tcx.inventory(&[&lab.pod.path()]).unwrap();
    assert!(
        inv.links.is_empty() && inv.filters.is_empty() && inv.qdiscs.is_empty(),
        "{inv:?}"
    );
    assert!(!inv.pins.is_empty());
    tcx.reconcile(&[&lab.pod.path()], &[]).unwrap();
    lab.assert_clean(&tcx);
}

#[test]
fn multi_queue_tap_has_one_fd_per_queue() {
    let ns = Netns::new("mq");
    let tap = k7d_net::in_netns(Some(&ns.path()), || {
        let mut nl = k7d_net::netlink::Netlink::open()?;
        let t = k7d_net::create_tap(&mut nl, "k7dtmq", 4, true)?;
        // Creating again replaces the tap (idempotent create).
        drop(t);
        let t = k7d_net::create_tap(&mut nl, "k7dtmq", 4, true)?;
        let n = nl.links()?.iter().filter(|l| l.name == "k7dtmq").count();
        assert_eq!(n, 1);
        Ok(t)
    })
    .unwrap();
    assert_eq!(tap.queues.len(), 4);
    tap.set_offload(k7d_net::TUN_F_CSUM).unwrap();
    // A frame written on every queue is accepted (12-byte vnet header).
    let mut frame = vec![0u8; 12 + 60];
    frame[12..18].copy_from_slice(&[0xff; 6]);
    frame[18..24].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
    frame[24..26].copy_from_slice(&[0x88, 0xb5]);
    for q in &tap.queues {
        k7d_net::write_frame(q, &frame).unwrap();
    }
    let out = ns.exec(&["cat", "/proc/net/dev"]);
    let dev = String::from_utf8_lossy(&out.stdout);
    let line = dev.lines().find(|l| l.contains("k7dtmq")).unwrap();
    let rx_packets: u64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(rx_packets, 4, "{line}");
    drop(tap);
    let out = ns.exec(&["ip", "link", "show", "k7dtmq"]);
    assert!(!out.status.success(), "non-persistent tap must vanish with its fds");
}

/// Whether link `name` is in netns `ns`, and up.
fn link_in(ns: &Netns, name: &str) -> Option<bool> {
    let out = ns.exec(&["ip", "-o", "link", "show", name]);
    let s = String::from_utf8_lossy(&out.stdout);
    out.status.success().then(|| s.contains(",UP") || s.contains("<UP"))
}

#[test]
fn an_adopted_tap_moves_in_carries_the_vms_traffic_and_goes_home_on_failure() {
    init_tracing();
    let lab = Lab::new();
    // The daemon's netns, where a warm pool member's bare tap was made at
    // its boot; the VM (here: this test) keeps its queue fds throughout.
    let home = Netns::new("h");
    let vm = "vm-adopt";
    let name = k7d_net::nic_names(vm, 0).tap;
    let tap = k7d_net::in_netns(Some(&home.path()), || {
        let mut nl = k7d_net::netlink::Netlink::open()?;
        k7d_net::create_tap(&mut nl, &name, 1, true)
    })
    .unwrap();
    let dp = lab.datapath(ObjectSource::Embedded, AttachMethod::Auto);
    let attach = |req: &k7d_net::NicRequest<'_>| k7d_net::in_netns(Some(&home.path()), || dp.attach(req));
    // A failure after the move (a bridge cannot be a bridge's port): the
    // tap goes home, down, and the pod netns keeps nothing.
    lab.pod.ip(&["link", "add", "brx", "type", "bridge"]);
    let mut req = lab.request(vm, Mode::Bridge, None);
    req.adopt = true;
    req.pod_if = "brx";
    let e = attach(&req).unwrap_err().to_string();
    assert!(e.contains("set master"), "the failure comes after the move: {e}");
    assert_eq!(link_in(&home, &name), Some(false), "the tap is home, down");
    assert_eq!(link_in(&lab.pod, &name), None);
    lab.pod.ip(&["link", "del", "brx"]);
    lab.assert_clean(&dp);
    // A tap that is not in the caller's netns is refused with a sentence.
    let mut stray = lab.request("vm-none", Mode::Direct, None);
    stray.adopt = true;
    let e = attach(&stray).unwrap_err().to_string();
    assert!(e.contains("not in the daemon's netns"), "{e}");
    lab.assert_clean(&dp);
    // A link of that name that is not a tap is not a VM's to adopt.
    let dummy = k7d_net::nic_names("vm-dummy", 0).tap;
    home.ip(&["link", "add", &dummy, "type", "veth", "peer", "name", "k7dpeer"]);
    let mut not_tap = lab.request("vm-dummy", Mode::Direct, None);
    not_tap.adopt = true;
    let e = attach(&not_tap).unwrap_err().to_string();
    assert!(e.contains("not a tap"), "{e}");
    assert_eq!(link_in(&home, &dummy), Some(false), "left where it was");
    lab.assert_clean(&dp);
    // The attach: the VM's own tap, now in the pod netns, direct.
    req.pod_if = "eth0";
    req.mode = Mode::Direct;
    let att = attach(&req).expect("adopting attach");
    assert_eq!(att.effective_mode, EffectiveMode::Direct);
    assert!(att.tap.queues.is_empty(), "the VM holds the queues");
    assert_eq!(link_in(&home, &name), None, "the tap left home");
    assert_eq!(link_in(&lab.pod, &name), Some(true));
    // Traffic flows through the fds the VM held from before the move.
    {
        let _guest = Guest::start_on(&lab.guest, &tap, att.guest_mac, &format!("{GUEST_IP}/24"));
        assert!(lab.guest.ping(B_IP), "guest -> B ping through the adopted tap");
        assert!(lab.b.ping(GUEST_IP), "B -> guest ping through the adopted tap");
    }
    dp.detach(vm, 0, Some(&lab.pod.path()), "eth0").expect("detach");
    drop(att);
    drop(tap);
    lab.assert_clean(&dp);
    assert_eq!(link_in(&home, &name), None);
}

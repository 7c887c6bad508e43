//! The virtio-net queue/vhost policy, rule by rule.

use k7d_net::policy::{
    DEFAULT_MAX_NET_QUEUES, EffectiveDataPlane, NicNetRequest, NodeNetConfig, PolicyError, VhostAvailability,
    effective_data_plane,
};

fn node(vhost: bool, cap: u16) -> NodeNetConfig {
    NodeNetConfig::new(vhost, cap).unwrap()
}

fn nic(vhost: Option<bool>, queues: Option<u16>) -> NicNetRequest {
    NicNetRequest { vhost, queues }
}

const OK: VhostAvailability = VhostAvailability::Available;

fn missing() -> VhostAvailability {
    VhostAvailability::Unavailable("/dev/vhost-net does not exist (is vhost_net loaded?)".into())
}

fn plane(vhost: bool, queue_pairs: u16) -> EffectiveDataPlane {
    EffectiveDataPlane {
        vhost,
        queue_pairs,
        warning: None,
    }
}

#[test]
fn max_net_queues_is_validated_at_load() {
    assert_eq!(
        NodeNetConfig::new(false, 0).unwrap_err().to_string(),
        "max_net_queues = 0 is out of range: it must be between 1 and 64"
    );
    assert_eq!(
        NodeNetConfig::new(true, 65).unwrap_err().to_string(),
        "max_net_queues = 65 is out of range: it must be between 1 and 64"
    );
    assert_eq!(NodeNetConfig::new(false, 1).unwrap().max_net_queues(), 1);
    assert_eq!(NodeNetConfig::new(false, 64).unwrap().max_net_queues(), 64);
}

#[test]
fn vhost_is_opt_in_by_default() {
    let d = NodeNetConfig::default();
    assert!(!d.vhost_default());
    assert_eq!(d.max_net_queues(), DEFAULT_MAX_NET_QUEUES);
    // A stock node: userspace, one queue pair, whatever the vCPU count.
    assert_eq!(
        effective_data_plane(&d, &nic(None, None), 8, &OK).unwrap(),
        plane(false, 1)
    );
}

#[test]
fn vhost_default_queue_pairs_follow_vcpus_up_to_16() {
    let n = node(true, 64);
    for (vcpus, want) in [(0, 1), (1, 1), (2, 2), (8, 8), (16, 16), (20, 16), (64, 16)] {
        assert_eq!(
            effective_data_plane(&n, &nic(None, None), vcpus, &OK).unwrap(),
            plane(true, want),
            "{vcpus} vCPUs"
        );
    }
}

#[test]
fn lowering_the_cap_lowers_the_default_raising_it_does_not_raise_it() {
    assert_eq!(
        effective_data_plane(&node(true, 2), &nic(None, None), 16, &OK).unwrap(),
        plane(true, 2)
    );
    assert_eq!(
        effective_data_plane(&node(true, 32), &nic(None, None), 24, &OK).unwrap(),
        plane(true, 16)
    );
}

#[test]
fn without_vhost_the_default_is_one() {
    assert_eq!(
        effective_data_plane(&node(false, 16), &nic(None, None), 8, &OK).unwrap(),
        plane(false, 1)
    );
    // A NIC turning vhost off on a vhost node gets the old shape too.
    assert_eq!(
        effective_data_plane(&node(true, 16), &nic(Some(false), None), 8, &OK).unwrap(),
        plane(false, 1)
    );
}

#[test]
fn explicit_counts_are_honoured_with_or_without_vhost() {
    assert_eq!(
        effective_data_plane(&node(false, 16), &nic(None, Some(4)), 2, &OK).unwrap(),
        plane(false, 4)
    );
    assert_eq!(
        effective_data_plane(&node(true, 16), &nic(Some(false), Some(4)), 8, &OK).unwrap(),
        plane(false, 4)
    );
    assert_eq!(
        effective_data_plane(&node(true, 16), &nic(None, Some(1)), 8, &OK).unwrap(),
        plane(true, 1)
    );
    // Above the 16 default cap but within max_net_queues: honoured.
    assert_eq!(
        effective_data_plane(&node(true, 32), &nic(None, Some(24)), 4, &OK).unwrap(),
        plane(true, 24)
    );
    // Exactly at the cap: accepted.
    assert_eq!(
        effective_data_plane(&node(false, 8), &nic(None, Some(8)), 1, &OK).unwrap(),
        plane(false, 8)
    );
}

#[test]
fn a_request_over_the_cap_is_refused_naming_it() {
    let e = effective_data_plane(&node(true, 8), &nic(None, Some(9)), 16, &OK).unwrap_err();
    assert_eq!(e, PolicyError::OverCap { requested: 9, cap: 8 });
    assert_eq!(
        e.to_string(),
        "9 queue pairs requested, this node allows at most 8 (max_net_queues)"
    );
    // Refused whatever the data plane.
    assert!(effective_data_plane(&node(false, 8), &nic(Some(false), Some(9)), 1, &OK).is_err());
}

#[test]
fn zero_queues_is_refused_not_read_as_unset() {
    let e = effective_data_plane(&node(true, 8), &nic(None, Some(0)), 4, &OK).unwrap_err();
    assert_eq!(e.to_string(), "0 queue pairs requested, a NIC needs at least 1");
}

#[test]
fn missing_vhost_defaulted_nic_falls_back_with_one_warning() {
    let p = effective_data_plane(&node(true, 16), &nic(None, None), 4, &missing()).unwrap();
    assert!(!p.vhost);
    assert_eq!(p.queue_pairs, 1, "userspace default");
    let w = p.warning.expect("one warning");
    assert!(w.contains("/dev/vhost-net does not exist"), "{w}");
    assert!(w.contains("userspace backend"), "{w}");
    // An explicit count still applies on the fallback.
    let p = effective_data_plane(&node(true, 16), &nic(None, Some(3)), 4, &missing()).unwrap();
    assert_eq!((p.vhost, p.queue_pairs), (false, 3));
    assert!(p.warning.is_some());
}

#[test]
fn missing_vhost_explicit_request_fails_with_the_reason() {
    let e = effective_data_plane(&node(false, 16), &nic(Some(true), None), 4, &missing()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "vhost-net was requested explicitly but cannot be used: /dev/vhost-net does not exist (is vhost_net loaded?)"
    );
    assert!(effective_data_plane(&node(true, 16), &nic(Some(true), Some(2)), 4, &missing()).is_err());
}

#[test]
fn vhost_off_never_looks_at_availability() {
    let p = effective_data_plane(&node(false, 16), &nic(None, None), 4, &missing()).unwrap();
    assert_eq!(p, plane(false, 1), "no warning when vhost was never wanted");
    let p = effective_data_plane(&node(true, 16), &nic(Some(false), Some(2)), 4, &missing()).unwrap();
    assert_eq!(p, plane(false, 2));
}

#[test]
fn explicit_vhost_on_a_vhost_off_node() {
    assert_eq!(
        effective_data_plane(&node(false, 16), &nic(Some(true), None), 4, &OK).unwrap(),
        plane(true, 4)
    );
}

#[test]
fn info_line_and_probe() {
    assert_eq!(plane(true, 2).to_string(), "vhost: on, queues: 2");
    assert_eq!(plane(false, 1).to_string(), "vhost: off, queues: 1");
    let p = VhostAvailability::probe(std::path::Path::new("/nonexistent/vhost-net"));
    match p {
        VhostAvailability::Unavailable(r) => assert!(r.contains("does not exist"), "{r}"),
        VhostAvailability::Available => panic!("a missing path cannot be available"),
    }
}

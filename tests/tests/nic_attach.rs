//! A running VM's bare NIC joins a pod's network (`Vm::attach_nic`, what a
//! warm pool member's claim does): its tap moves into the pod's netns and
//! the direct datapath is built around it; what cannot be adopted is
//! refused with one sentence, a failed attach leaves the NIC bare with its
//! tap at home, and the attachment leaves with the VM.

use k7d_api::config::{DatapathNicConfig, NicConfig, NodeConfig};
use k7d_test_skip::skip;
use k7d_tests::{TempDir, boot, builtin};

fn ip(args: &[&str]) -> std::process::Output {
    std::process::Command::new("ip").args(args).output().expect("ip")
}

/// A pod netns with `eth0`, a veth whose peer is in the test's netns;
/// deleted on drop.
struct PodNs(String);

impl PodNs {
    fn new() -> Self {
        let name = format!("k7dna{}", std::process::id());
        let _ = ip(&["netns", "del", &name]);
        assert!(ip(&["netns", "add", &name]).status.success());
        let peer = format!("k7dnap{}", std::process::id() % 100_000);
        let out = ip(&[
            "link", "add", &peer, "type", "veth", "peer", "name", "eth0", "netns", &name,
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        Self(name)
    }
    fn path(&self) -> String {
        format!("/run/netns/{}", self.0)
    }
    /// Whether link `name` is in this netns, and its `ip -o link` line.
    fn link(&self, name: &str) -> Option<String> {
        let out = ip(&["-n", &self.0, "-o", "link", "show", name]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for PodNs {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.0]);
    }
}

fn link_at_home(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

fn nic(mode: &str, netns: &str) -> DatapathNicConfig {
    DatapathNicConfig {
        mode: mode.into(),
        netns: netns.into(),
        pod_if: "eth0".into(),
        pod_uid: None,
        pod_namespace: None,
        pod_name: None,
    }
}

#[test]
fn a_running_vms_bare_nic_joins_a_pod_network_and_leaves_with_the_vm() {
    if !k7d_tests::is_root()
        && skip(
            "a_running_vms_bare_nic_joins_a_pod_network_and_leaves_with_the_vm",
            "taps and network namespaces need root",
        )
    {
        return;
    }
    let dir = TempDir::new("nic-attach");
    let mut cfg = builtin("memwriter", 1, 16, &[64, 0x20_0000, 1]);
    // NIC 0 as a warm pool member's (the userspace plane, k7d's tap name);
    // NIC 1 as the node's default (vhost-net when it can).
    cfg.devices.nics = vec![
        NicConfig {
            vhost: Some(false),
            ..Default::default()
        },
        NicConfig::default(),
    ];
    let mut vm = boot("natt", &cfg, &dir.0.join("serial.log"));
    let node = NodeConfig::default();
    let tap = k7d_net::nic_names("natt", 0).tap;
    assert!(link_at_home(&tap));
    let pod = PodNs::new();
    let refused = |vm: &mut k7d_vmm::Vm, i: usize, d: DatapathNicConfig, want: &str| {
        let e = vm.attach_nic(i, &d, &node).unwrap_err().to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    };
    refused(
        &mut vm,
        2,
        nic("direct", &pod.path()),
        "has 2 NIC(s), so it has no nic 2",
    );
    refused(&mut vm, 1, nic("direct", &pod.path()), "may be served by vhost-net");
    refused(
        &mut vm,
        0,
        nic("sideways", &pod.path()),
        "datapath mode `sideways` is unknown",
    );
    refused(&mut vm, 0, nic("direct", "run/netns/x"), "not an absolute path");
    // A pod netns that is not there: the attach fails, the NIC stays bare
    // with its tap at home, and nothing is recorded.
    let e = vm
        .attach_nic(0, &nic("direct", "/run/netns/k7d-test-no-such-pod"), &node)
        .unwrap_err()
        .to_string();
    assert!(!e.contains('\n'), "{e}");
    assert!(link_at_home(&tap), "a failed attach loses nothing: {e}");
    assert!(vm.config().devices.nics.iter().all(|n| n.datapath.is_none()));
    // The attach: the tap leaves home for the pod netns, up, with the
    // direct path's programs on it; the VM says so where a NIC attached at
    // its build does (before the transport's MSI-X text).
    vm.attach_nic(0, &nic("direct", &pod.path()), &node).expect("attach");
    assert!(!link_at_home(&tap), "the tap left the daemon's netns");
    let line = pod.link(&tap).expect("the tap is in the pod netns");
    assert!(line.contains(",UP") || line.contains("<UP"), "{line}");
    let d = &vm.devices().iter().find(|d| d.kind == "virtio-net").unwrap().detail;
    let at = d.find("datapath: direct").unwrap_or_else(|| panic!("{d}"));
    assert!(d.find("; MSI-X").is_none_or(|m| at < m), "{d}");
    assert_eq!(vm.config().devices.nics[0].datapath, Some(nic("direct", &pod.path())));
    // The programs' pins (TCX links or clsact filters alike).
    let pins = node
        .datapath()
        .bpffs_root
        .join(k7d_net::nic_names("natt", 0).bpf_subdir);
    assert!(pins.is_dir(), "no pins at {}", pins.display());
    refused(&mut vm, 0, nic("direct", &pod.path()), "already attached");
    // It leaves with the VM: the tap, and the programs on the pod's eth0.
    vm.stop();
    drop(vm);
    assert!(pod.link(&tap).is_none(), "the tap went with the VM");
    assert!(!pins.exists(), "the pins went with the VM: {}", pins.display());
    let f = ip(&["-n", &pod.0, "-d", "link", "show", "eth0"]);
    assert!(f.status.success());
    let tc = std::process::Command::new("ip")
        .args([
            "netns", "exec", &pod.0, "tc", "filter", "show", "dev", "eth0", "ingress",
        ])
        .output()
        .expect("tc");
    assert!(
        String::from_utf8_lossy(&tc.stdout).trim().is_empty(),
        "filters left on eth0"
    );
}

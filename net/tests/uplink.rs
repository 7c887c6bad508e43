//! Standalone l2-uplink mode: a LAN peer netns on a veth "uplink" (no bridge,
//! no master), two guests on it with declared IPv4 addresses (each a tap in
//! the host netns whose frames the test relays to a `gtap` in the guest's
//! netns). ARP steering, LAN ↔ guests, guest ↔ guest locally, teardown.
//! Needs root, iproute2, ping and the bpf object built by clang.
mod common;

use std::{net::Ipv4Addr, path::PathBuf, sync::atomic::Ordering};

use common::*;
use k7d_net::{AttachMethod, Datapath, DatapathConfig, NetError, ObjectSource, UplinkGuest, UplinkNic, UplinkRequest};

const LAN_IP: &str = "10.88.0.1";
const G1_IP: &str = "10.88.0.11";
const G2_IP: &str = "10.88.0.12";

/// Host H holds the uplink `up0`; its veth peer `eth0` is the LAN peer L.
struct UplinkLab {
    host: Netns,
    lan: Netns,
    g1: Netns,
    g2: Netns,
    bpffs: PathBuf,
}

impl UplinkLab {
    fn new() -> Self {
        let host = Netns::new("h");
        let lan = Netns::new("l");
        let g1 = Netns::new("g1");
        let g2 = Netns::new("g2");
        lan.ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "up0", "netns", &host.name,
        ]);
        lan.ip(&["addr", "add", &format!("{LAN_IP}/24"), "dev", "eth0"]);
        lan.ip(&["link", "set", "eth0", "up"]);
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/{}", uniq("bpf")));
        UplinkLab {
            host,
            lan,
            g1,
            g2,
            bpffs,
        }
    }

    fn datapath(&self, object: ObjectSource) -> Datapath {
        Datapath::new(DatapathConfig {
            bpffs_root: self.bpffs.clone(),
            object,
            attach_method: AttachMethod::Auto,
        })
        .expect("datapath")
    }

    fn request(&self) -> UplinkRequest<'static> {
        UplinkRequest {
            netns: Some(leak_path(self.host.path())),
            uplink_if: "up0",
        }
    }

    fn assert_clean(&self, dp: &Datapath) {
        let inv = dp.inventory(&[&self.host.path()]).expect("inventory");
        assert!(inv.is_empty(), "leftovers: {inv:?}");
    }

    fn link_line(&self, iface: &str) -> String {
        let out = self.host.exec(&["ip", "-o", "link", "show", iface]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for UplinkLab {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.bpffs);
    }
}

fn guest<'a>(vm: &'a str, ips: &'a [Ipv4Addr], mac: Option<[u8; 6]>) -> UplinkGuest<'a> {
    UplinkGuest {
        vm_id: vm,
        nic_idx: 0,
        mac,
        ips,
        queues: 1,
        vnet_hdr: true,
    }
}

/// The MAC `ns` resolved for `ip` (from its neighbour table).
fn neigh_mac(ns: &Netns, ip: &str) -> Option<[u8; 6]> {
    let out = ns.exec(&["ip", "neigh", "show", ip]);
    let s = String::from_utf8_lossy(&out.stdout);
    let w: Vec<&str> = s.split_whitespace().collect();
    let at = w.iter().position(|x| *x == "lladdr")?;
    let mut mac = [0u8; 6];
    for (i, b) in w.get(at + 1)?.split(':').enumerate() {
        *mac.get_mut(i)? = u8::from_str_radix(b, 16).ok()?;
    }
    Some(mac)
}

fn rx_packets(ns: &Netns, iface: &str) -> u64 {
    let out = ns.exec(&["cat", "/proc/net/dev"]);
    let dev = String::from_utf8_lossy(&out.stdout);
    let line = dev
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{iface}:")))
        .unwrap_or_else(|| panic!("{iface} not in /proc/net/dev: {dev}"));
    line.split(':')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn l2_uplink_steers_arp_and_switches_guests_without_a_bridge() {
    init_tracing();
    let lab = UplinkLab::new();
    let dp = lab.datapath(ObjectSource::Embedded);
    let req = lab.request();
    assert!(!lab.link_line("up0").contains("PROMISC"));
    let up = dp.uplink_attach(&req).expect("uplink attach");
    assert!(lab.link_line("up0").contains("PROMISC"), "{}", lab.link_line("up0"));
    // Attaching again returns the same uplink (idempotent, one program).
    let again = dp.uplink_attach(&req).expect("uplink attach again");
    assert_eq!((again.ifindex, &again.dir), (up.ifindex, &up.dir));
    let inv = dp.inventory(&[&lab.host.path()]).unwrap();
    assert_eq!(inv.tcx, vec![format!("{}:up0:1", lab.host.path().display())]);

    let ip1 = [G1_IP.parse().unwrap()];
    let ip2 = [G2_IP.parse().unwrap()];
    let mac2 = [0x02, 0x6b, 0xaa, 0, 0, 0x22];
    let n1: UplinkNic = up.add_guest(&guest("vm-ul-1", &ip1, None)).expect("guest 1");
    let n2 = up.add_guest(&guest("vm-ul-2", &ip2, Some(mac2))).expect("guest 2");
    assert_eq!(n2.guest_mac, mac2);
    assert_ne!(n1.guest_mac, mac2);
    let g1 = Guest::start_on(&lab.g1, &n1.tap, n1.guest_mac, &format!("{G1_IP}/24"));
    let g2 = Guest::start_on(&lab.g2, &n2.tap, n2.guest_mac, &format!("{G2_IP}/24"));

    // LAN -> guest 1: the broadcast ARP request is steered to guest 1 only.
    assert!(lab.lan.ping(G1_IP), "LAN -> guest 1");
    assert_eq!(neigh_mac(&lab.lan, G1_IP), Some(n1.guest_mac));
    assert_eq!(
        g2.rx.load(Ordering::Relaxed),
        0,
        "guest 2 saw guest 1's traffic (flooded)"
    );
    // LAN -> guest 2.
    assert!(lab.lan.ping(G2_IP), "LAN -> guest 2");
    assert_eq!(neigh_mac(&lab.lan, G2_IP), Some(mac2));
    // guest 1 -> LAN, resolving the LAN peer itself (ARP out of the uplink).
    lab.g1.ip(&["neigh", "flush", "all"]);
    assert!(lab.g1.ping(LAN_IP), "guest 1 -> LAN");
    tcp_roundtrip(&lab.lan, LAN_IP, &lab.g1, 1 << 20);
    tcp_roundtrip(&lab.g2, G2_IP, &lab.lan, 1 << 20);

    // guest 1 <-> guest 2: switched locally, the LAN sees none of it.
    lab.g1.ip(&["neigh", "flush", "all"]);
    lab.g2.ip(&["neigh", "flush", "all"]);
    let lan_rx = rx_packets(&lab.lan, "eth0");
    assert!(lab.g1.ping(G2_IP), "guest 1 -> guest 2");
    assert!(lab.g2.ping(G1_IP), "guest 2 -> guest 1");
    tcp_roundtrip(&lab.g2, G2_IP, &lab.g1, 4 << 20);
    tcp_roundtrip(&lab.g1, G1_IP, &lab.g2, 4 << 20);
    assert_eq!(neigh_mac(&lab.g1, G2_IP), Some(mac2));
    assert_eq!(
        rx_packets(&lab.lan, "eth0"),
        lan_rx,
        "guest <-> guest frames reached the LAN"
    );

    // No bridge anywhere, and the uplink has no master.
    assert!(!lab.link_line("up0").contains(" master "), "{}", lab.link_line("up0"));
    let bridges = lab.host.exec(&["ip", "-o", "link", "show", "type", "bridge"]);
    assert!(
        bridges.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&bridges.stdout)
    );

    // The maps list both guests.
    let guests = up.guests().unwrap();
    assert_eq!(guests.len(), 2, "{guests:?}");
    assert!(
        guests
            .iter()
            .any(|g| g.tap_ifindex == n1.tap.ifindex && g.ipv4 == ip1 && g.macs == [n1.guest_mac])
    );
    assert!(
        guests
            .iter()
            .any(|g| g.tap_ifindex == n2.tap.ifindex && g.ipv4 == ip2 && g.macs == [mac2])
    );

    // A third guest claiming guest 1's address (or guest 2's MAC) is
    // refused and leaves no tap.
    let err = up.add_guest(&guest("vm-ul-3", &ip1, None)).unwrap_err();
    assert!(err.to_string().contains("10.88.0.11 is already declared"), "{err}");
    let ip3 = ["10.88.0.13".parse().unwrap()];
    let err = up.add_guest(&guest("vm-ul-3", &ip3, Some(mac2))).unwrap_err();
    assert!(err.to_string().contains("is already used"), "{err}");
    let inv = dp.inventory(&[&lab.host.path()]).unwrap();
    assert_eq!(inv.links.len(), 2, "{inv:?}");
    assert_eq!(up.guests().unwrap().len(), 2);

    // Removing guest 1 forgets it; guest 2 still works.
    drop(g1);
    up.remove_guest("vm-ul-1", 0).unwrap();
    drop(n1);
    up.remove_guest("vm-ul-1", 0).expect("idempotent");
    assert_eq!(up.guests().unwrap().len(), 1);
    assert!(lab.lan.ping(G2_IP), "LAN -> guest 2 after guest 1 left");

    drop(g2);
    dp.uplink_detach(&req).expect("uplink detach");
    drop(n2);
    assert!(!lab.link_line("up0").contains("PROMISC"), "promisc not restored");
    lab.assert_clean(&dp);
    dp.uplink_detach(&req).expect("detach is idempotent");
    assert!(matches!(dp.uplink(&req), Err(NetError::UplinkNotAttached { .. })));
}

#[test]
fn l2_uplink_refusals_leave_nothing() {
    let lab = UplinkLab::new();
    let dp = lab.datapath(ObjectSource::Embedded);
    // A missing uplink.
    let missing = UplinkRequest {
        netns: Some(leak_path(lab.host.path())),
        uplink_if: "nope0",
    };
    let err = dp.uplink_attach(&missing).unwrap_err();
    assert!(matches!(err, NetError::UplinkMissing { .. }), "{err}");
    // An uplink that is a bridge port.
    lab.host.ip(&["link", "add", "k7tbr", "type", "bridge"]);
    lab.host.ip(&["link", "set", "up0", "master", "k7tbr"]);
    let err = dp.uplink_attach(&lab.request()).unwrap_err();
    assert!(err.to_string().contains("bridge port"), "{err}");
    lab.host.ip(&["link", "del", "k7tbr"]);
    // No bpf object.
    let nobj = lab.datapath(object_missing());
    let err = nobj.uplink_attach(&lab.request()).unwrap_err();
    assert!(err.to_string().starts_with("bpf object missing"), "{err}");
    // Bad guest declarations.
    let up = dp.uplink_attach(&lab.request()).unwrap();
    let none: [Ipv4Addr; 0] = [];
    assert!(up.add_guest(&guest("vm-ul-x", &none, None)).is_err());
    let bcast = [Ipv4Addr::BROADCAST];
    assert!(up.add_guest(&guest("vm-ul-x", &bcast, None)).is_err());
    let ok = ["10.88.0.20".parse().unwrap()];
    assert!(up.add_guest(&guest("vm-ul-x", &ok, Some([1, 0, 0, 0, 0, 1]))).is_err());
    assert!(up.guests().unwrap().is_empty());
    // Adding the same NIC twice replaces it: one tap, one port.
    let a = up.add_guest(&guest("vm-ul-x", &ok, None)).unwrap();
    drop(a);
    let a = up.add_guest(&guest("vm-ul-x", &ok, None)).unwrap();
    assert_eq!(up.guests().unwrap().len(), 1);
    assert_eq!(dp.inventory(&[&lab.host.path()]).unwrap().links.len(), 1);
    // A handle from the pins alone (a restarted daemon) can detach it.
    let again = dp.uplink(&lab.request()).unwrap();
    again.remove_guest("vm-ul-x", 0).unwrap();
    drop(a);
    dp.uplink_detach(&lab.request()).unwrap();
    lab.assert_clean(&dp);
}

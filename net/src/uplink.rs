//! Standalone l2-uplink mode (FluxVM's "standalone direct"): guests sit on a
//! host uplink interface (a NIC or a veth, given by name) with declared IPv4
//! addresses, and no Linux bridge is involved:
//!
//! * at the uplink's ingress (`k7d_ul_up_in`): frames to a guest MAC go to
//!   that guest's tap; an ARP request for a declared guest address goes to
//!   that guest's tap only (not flooded); everything else goes to the host;
//! * at each guest tap's ingress (`k7d_ul_tap_in`): frames to another local
//!   guest's MAC, or ARP requests for its address, go straight to its tap
//!   (guest ↔ guest switching without a bridge); everything else leaves by
//!   the uplink.
//!
//! The uplink keeps no master. Taps are created in the uplink's netns (a
//! redirect cannot cross namespaces). State is only kernel objects and pins
//! under `<bpffs root>/uplinks/<tag>/`, so a restarted daemon finds it again.
use std::{
    net::Ipv4Addr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use k7d_bpf::{UplinkPort, UplinkPortInfo, UplinkPrograms};
use tracing::{debug, info, warn};

use crate::{
    Datapath, NetError, Tap,
    datapath::bridge_guest_mac,
    names::{NicNames, fnv1a64, nic_names, validate_vm_id},
    netlink::Netlink,
    netns::in_netns,
    tap::create_tap,
};

/// Directory under the bpffs root that holds every uplink's state.
pub const UPLINKS_DIR: &str = "uplinks";

/// The uplink interface to serve, in `netns` (the caller's when `None`).
#[derive(Clone, Copy, Debug)]
pub struct UplinkRequest<'a> {
    pub netns: Option<&'a Path>,
    pub uplink_if: &'a str,
}

/// A handle to an attached uplink (cheap; holds no kernel object).
#[derive(Clone, Debug)]
pub struct Uplink {
    pub iface: String,
    pub ifindex: u32,
    pub netns: Option<PathBuf>,
    /// The uplink's bpffs directory.
    pub dir: PathBuf,
}

/// One guest NIC to put on an uplink.
#[derive(Clone, Debug)]
pub struct UplinkGuest<'a> {
    pub vm_id: &'a str,
    pub nic_idx: u16,
    /// The guest's MAC; a locally administered one derived from the names
    /// when `None`.
    pub mac: Option<[u8; 6]>,
    /// Declared guest IPv4 addresses (at least one): ARP requests for them
    /// are steered to this guest.
    pub ips: &'a [Ipv4Addr],
    pub queues: usize,
    pub vnet_hdr: bool,
}

/// A guest NIC on an uplink.
#[derive(Debug)]
pub struct UplinkNic {
    /// The tap (in the uplink's netns) and its queue fds for the VMM.
    pub tap: Tap,
    pub guest_mac: [u8; 6],
    pub ips: Vec<Ipv4Addr>,
    pub names: NicNames,
}

fn netns_id(netns: Option<&Path>) -> Result<(u64, u64), NetError> {
    let p = netns.unwrap_or(Path::new("/proc/thread-self/ns/net"));
    let md = std::fs::metadata(p).map_err(|e| NetError::os(format!("stat netns {}", p.display()), e))?;
    Ok((md.dev(), md.ino()))
}

fn validate_ifname(name: &str) -> Result<(), NetError> {
    if name.is_empty() || name.len() > 15 || name.contains(['/', '\0']) || name.chars().any(char::is_whitespace) {
        return Err(NetError::Invalid {
            what: format!("interface name {name:?}"),
            reason: "it must be 1 to 15 characters without '/' or spaces".into(),
        });
    }
    Ok(())
}

impl Datapath {
    fn uplink_dir(&self, req: &UplinkRequest<'_>) -> Result<PathBuf, NetError> {
        validate_ifname(req.uplink_if)?;
        let (dev, ino) = netns_id(req.netns)?;
        let tag = fnv1a64(&[
            b"k7d-uplink",
            &dev.to_le_bytes(),
            &ino.to_le_bytes(),
            req.uplink_if.as_bytes(),
        ]);
        Ok(self.config().bpffs_root.join(UPLINKS_DIR).join(format!("{tag:016x}")))
    }

    /// Attaches the l2-uplink programs to `req.uplink_if`: sets it up and
    /// promiscuous (recorded, undone by [`Datapath::uplink_detach`]). The
    /// uplink must exist and must not be a bridge port. Attaching an uplink
    /// that is already attached returns the existing one (its guests stay);
    /// stale state (the interface was re-created) is replaced.
    pub fn uplink_attach(&self, req: &UplinkRequest<'_>) -> Result<Uplink, NetError> {
        let dir = self.uplink_dir(req)?;
        let object = k7d_bpf::load_object(&self.config().object)?;
        let iface = req.uplink_if;
        let ifindex = in_netns(req.netns, || {
            let mut nl = Netlink::open()?;
            let link = nl.link(iface)?.ok_or_else(|| NetError::UplinkMissing {
                iface: iface.to_string(),
                netns: req.netns.map(Path::to_path_buf).unwrap_or_else(|| "(current)".into()),
            })?;
            if link.master.is_some() {
                return Err(NetError::Invalid {
                    what: format!("uplink {iface}"),
                    reason: "it is a bridge port, and l2-uplink mode replaces the bridge".into(),
                });
            }
            if dir.exists() {
                if k7d_bpf::uplink_ifindex(&dir).ok() == Some(link.index) && k7d_bpf::tcx_program_count(iface)? > 0 {
                    return Ok(link.index);
                }
                info!(uplink = iface, "stale l2-uplink state removed before attach");
                k7d_bpf::detach_uplink(&dir)?;
            }
            let promisc_set = !link.promisc;
            if promisc_set {
                nl.set_promisc(link.index, true)?;
            }
            if !link.up {
                nl.set_up(link.index, true)?;
            }
            let progs = UplinkPrograms {
                uplink_if: iface,
                uplink_ifindex: link.index,
                promisc_set,
            };
            if let Err(e) = progs.attach(&object, &dir) {
                if promisc_set {
                    let _ = nl.set_promisc(link.index, false);
                }
                return Err(e.into());
            }
            info!(uplink = iface, "l2-uplink attached");
            Ok(link.index)
        })?;
        Ok(Uplink {
            iface: iface.to_string(),
            ifindex,
            netns: req.netns.map(Path::to_path_buf),
            dir,
        })
    }

    /// A handle to an uplink attached before (by this or an earlier process).
    pub fn uplink(&self, req: &UplinkRequest<'_>) -> Result<Uplink, NetError> {
        let dir = self.uplink_dir(req)?;
        let ifindex = k7d_bpf::uplink_ifindex(&dir).map_err(|_| NetError::UplinkNotAttached {
            iface: req.uplink_if.to_string(),
            dir: dir.clone(),
        })?;
        Ok(Uplink {
            iface: req.uplink_if.to_string(),
            ifindex,
            netns: req.netns.map(Path::to_path_buf),
            dir,
        })
    }

    /// Detaches the uplink: deletes every guest tap on it, unpins (which
    /// detaches the programs and frees the maps) and turns promiscuous mode
    /// off again if the attach turned it on. Idempotent.
    pub fn uplink_detach(&self, req: &UplinkRequest<'_>) -> Result<(), NetError> {
        let dir = self.uplink_dir(req)?;
        if !dir.exists() {
            return Ok(());
        }
        let promisc_set = k7d_bpf::uplink_promisc_set(&dir).unwrap_or(false);
        let taps: Vec<String> = std::fs::read_dir(&dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.split('_').next())
                            .map(String::from)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let ns_alive = req.netns.is_none_or(Path::exists);
        k7d_bpf::detach_uplink(&dir)?;
        let _ = std::fs::remove_dir(dir.parent().unwrap_or(&dir));
        if ns_alive {
            in_netns(req.netns, || {
                let mut nl = Netlink::open()?;
                for t in &taps {
                    nl.del_link_by_name(t)?;
                }
                if promisc_set && let Some(l) = nl.link(req.uplink_if)? {
                    nl.set_promisc(l.index, false)?;
                }
                Ok(())
            })?;
        }
        info!(uplink = req.uplink_if, guests = taps.len(), "l2-uplink detached");
        Ok(())
    }
}

impl Uplink {
    /// Creates the guest's tap in the uplink's netns, attaches the tap
    /// program and declares its MAC and addresses. A MAC or address another
    /// guest already declared is refused; on any error nothing is left.
    /// Adding the same NIC again replaces it.
    pub fn add_guest(&self, g: &UplinkGuest<'_>) -> Result<UplinkNic, NetError> {
        validate_vm_id(g.vm_id)?;
        if g.ips.is_empty() {
            return Err(NetError::Invalid {
                what: format!("guest NIC {} of VM {}", g.nic_idx, g.vm_id),
                reason: "it declares no IPv4 address".into(),
            });
        }
        if let Some(ip) = g
            .ips
            .iter()
            .find(|ip| ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() || ip.is_loopback())
        {
            return Err(NetError::Invalid {
                what: format!("declared guest address {ip}"),
                reason: "it is not a unicast address".into(),
            });
        }
        let names = nic_names(g.vm_id, g.nic_idx);
        if let Some(m) = g.mac
            && (m[0] & 1 == 1 || m == [0; 6])
        {
            return Err(NetError::Invalid {
                what: format!("guest MAC of VM {} NIC {}", g.vm_id, g.nic_idx),
                reason: "it is a multicast or zero address".into(),
            });
        }
        self.remove_guest(g.vm_id, g.nic_idx)?;
        let r = in_netns(self.netns.as_deref(), || {
            let mut nl = Netlink::open()?;
            let up = nl.link(&self.iface)?.ok_or_else(|| NetError::UplinkMissing {
                iface: self.iface.clone(),
                netns: self.netns.clone().unwrap_or_else(|| "(current)".into()),
            })?;
            let mac = g
                .mac
                .unwrap_or_else(|| bridge_guest_mac(&names, up.mac.unwrap_or_default()));
            let tap = create_tap(&mut nl, &names.tap, g.queues, g.vnet_hdr)?;
            let port = UplinkPort {
                tap_if: &names.tap,
                tap_ifindex: tap.ifindex,
                mac,
                ipv4: g.ips,
            };
            if let Err(e) = k7d_bpf::attach_uplink_port(&self.dir, &port) {
                drop(tap);
                let _ = nl.del_link_by_name(&names.tap);
                return Err(e.into());
            }
            Ok((tap, mac))
        });
        match r {
            Ok((tap, guest_mac)) => {
                debug!(vm = g.vm_id, nic = g.nic_idx, tap = %names.tap, uplink = %self.iface, "guest added to the l2 uplink");
                Ok(UplinkNic {
                    tap,
                    guest_mac,
                    ips: g.ips.to_vec(),
                    names,
                })
            }
            Err(e) => {
                if let Err(e2) = k7d_bpf::detach_uplink_port(&self.dir, &names.tap) {
                    warn!(error = %e2, "rollback of a failed uplink guest was incomplete");
                }
                Err(e)
            }
        }
    }

    /// Removes a guest NIC: forgets its MAC and addresses, detaches its tap
    /// program and deletes its tap. Idempotent.
    pub fn remove_guest(&self, vm_id: &str, nic_idx: u16) -> Result<(), NetError> {
        validate_vm_id(vm_id)?;
        let names = nic_names(vm_id, nic_idx);
        k7d_bpf::detach_uplink_port(&self.dir, &names.tap)?;
        if self.netns.as_deref().is_none_or(Path::exists) {
            in_netns(self.netns.as_deref(), || {
                Netlink::open()?.del_link_by_name(&names.tap)?;
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The guests on this uplink, as recorded in its maps.
    pub fn guests(&self) -> Result<Vec<UplinkPortInfo>, NetError> {
        Ok(k7d_bpf::uplink_ports(&self.dir)?)
    }
}

//! Standalone l2-uplink mode: guests share a host uplink interface (a NIC or
//! a veth) without a Linux bridge. One object load per uplink; its maps are
//! shared by `k7d_ul_up_in` (uplink ingress) and every guest tap's
//! `k7d_ul_tap_in`, and everything is pinned under the uplink's directory:
//!
//! ```text
//! <dir>/k7d_ul_cfg k7d_ul_fdb k7d_ul_arp   maps
//! <dir>/up_in                              TCX link at the uplink's ingress
//! <dir>/tap_in_prog                        the tap program (attached per guest)
//! <dir>/<tap>_<ifindex>/tap_in             TCX link at one guest tap's ingress
//! ```
//!
//! Only TCX attachments are used (kernel ≥ 6.6). Like the per-NIC state,
//! nothing lives in memory: ports are found again from the pins and maps.
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData},
    programs::{LinkOrder, SchedClassifier, TcAttachType, links::FdLink, tc::TcAttachOptions},
};
use tracing::{debug, warn};

use crate::{
    BpfError,
    loader::{attach_err, map_error, open_pinned, pin_err, remove_dir_pins},
};

/// Kernel names of the uplink programs (uplink ingress, guest tap ingress).
pub const UPLINK_PROG_NAMES: [&str; 2] = ["k7d_ul_up_in", "k7d_ul_tap_in"];
/// Pin names of the uplink's maps.
pub const UPLINK_MAP_PINS: [&str; 3] = ["k7d_ul_cfg", "k7d_ul_fdb", "k7d_ul_arp"];
const UP_LINK_PIN: &str = "up_in";
const TAP_PROG_PIN: &str = "tap_in_prog";
const TAP_LINK_PIN: &str = "tap_in";

type MacKey = [u8; 8];

fn mac_key(mac: [u8; 6]) -> MacKey {
    let mut k = [0u8; 8];
    k[..6].copy_from_slice(&mac);
    k
}

/// The uplink to attach to, as seen from the calling thread's netns.
#[derive(Clone, Debug)]
pub struct UplinkPrograms<'a> {
    pub uplink_if: &'a str,
    pub uplink_ifindex: u32,
    /// Whether the caller turned promiscuous mode on (recorded so the
    /// detach can turn it off again).
    pub promisc_set: bool,
}

impl UplinkPrograms<'_> {
    /// Loads `object`, pins the shared maps and the tap program under `dir`
    /// (created), and attaches `k7d_ul_up_in` at the uplink's ingress. On
    /// error everything this call created is removed.
    pub fn attach(&self, object: &[u8], dir: &Path) -> Result<(), BpfError> {
        if dir.exists() {
            return Err(pin_err(
                dir,
                "created",
                std::io::Error::other("it already exists (stale state: detach first)"),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| pin_err(dir, "created", e))?;
        let r = self.attach_inner(object, dir);
        if r.is_err()
            && let Err(e) = remove_dir_pins(dir)
        {
            warn!(error = %e, "rollback of a failed uplink attach was incomplete");
        }
        r
    }

    fn attach_inner(&self, object: &[u8], dir: &Path) -> Result<(), BpfError> {
        let mut bpf: Ebpf = EbpfLoader::new()
            .load(object)
            .map_err(|e| BpfError::Load(e.to_string()))?;
        {
            let map = bpf
                .map_mut("k7d_ul_cfg")
                .ok_or_else(|| BpfError::Load("the object has no k7d_ul_cfg map".into()))?;
            let mut cfg: Array<&mut MapData, [u32; 2]> =
                Array::try_from(map).map_err(|e| map_error("k7d_ul_cfg", "opened", e))?;
            cfg.set(0, [self.uplink_ifindex, u32::from(self.promisc_set)], 0)
                .map_err(|e| map_error("k7d_ul_cfg", "written", e))?;
        }
        for name in UPLINK_MAP_PINS {
            let map = bpf
                .map(name)
                .ok_or_else(|| BpfError::Load(format!("the object has no {name} map")))?;
            let path = dir.join(name);
            map.pin(&path).map_err(|e| pin_err(&path, "created", e))?;
        }
        for name in UPLINK_PROG_NAMES {
            let prog: &mut SchedClassifier = bpf
                .program_mut(name)
                .ok_or_else(|| BpfError::Load(format!("the object has no {name} program")))?
                .try_into()
                .map_err(|e| BpfError::Load(format!("{name} is not a classifier: {e}")))?;
            prog.load()
                .map_err(|e| BpfError::Load(format!("{name} was refused: {e}")))?;
        }
        let tap_prog: &mut SchedClassifier = bpf
            .program_mut(UPLINK_PROG_NAMES[1])
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| BpfError::Load("k7d_ul_tap_in vanished".into()))?;
        let pin = dir.join(TAP_PROG_PIN);
        tap_prog.pin(&pin).map_err(|e| pin_err(&pin, "created", e))?;
        let up_prog: &mut SchedClassifier = bpf
            .program_mut(UPLINK_PROG_NAMES[0])
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| BpfError::Load("k7d_ul_up_in vanished".into()))?;
        attach_tcx_pinned(up_prog, UPLINK_PROG_NAMES[0], self.uplink_if, &dir.join(UP_LINK_PIN))?;
        debug!(dir = %dir.display(), uplink = self.uplink_if, "l2-uplink programs attached");
        Ok(())
    }
}

fn attach_tcx_pinned(prog: &mut SchedClassifier, name: &'static str, iface: &str, pin: &Path) -> Result<(), BpfError> {
    let id = prog
        .attach_with_options(
            iface,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .map_err(|e| attach_err(name, iface, e))?;
    let link = prog.take_link(id).map_err(|e| attach_err(name, iface, e))?;
    let fd: FdLink = link.try_into().map_err(|e| attach_err(name, iface, e))?;
    fd.pin(pin).map_err(|e| pin_err(pin, "created", e))?;
    Ok(())
}

fn cfg(dir: &Path) -> Result<[u32; 2], BpfError> {
    let data = open_pinned(dir, "k7d_ul_cfg")?;
    let cfg: Array<_, [u32; 2]> =
        Array::try_from(Map::Array(data)).map_err(|e| map_error("k7d_ul_cfg", "opened", e))?;
    cfg.get(&0, 0).map_err(|e| map_error("k7d_ul_cfg", "read", e))
}

/// Whether the attach recorded that it turned promiscuous mode on.
pub fn uplink_promisc_set(dir: &Path) -> Result<bool, BpfError> {
    Ok(cfg(dir)?[1] != 0)
}

/// The uplink ifindex recorded at attach.
pub fn uplink_ifindex(dir: &Path) -> Result<u32, BpfError> {
    Ok(cfg(dir)?[0])
}

fn fdb(dir: &Path) -> Result<HashMap<MapData, MacKey, u32>, BpfError> {
    let data = open_pinned(dir, "k7d_ul_fdb")?;
    HashMap::try_from(Map::HashMap(data)).map_err(|e| map_error("k7d_ul_fdb", "opened", e))
}

fn arp(dir: &Path) -> Result<HashMap<MapData, u32, u32>, BpfError> {
    let data = open_pinned(dir, "k7d_ul_arp")?;
    HashMap::try_from(Map::HashMap(data)).map_err(|e| map_error("k7d_ul_arp", "opened", e))
}

/// One guest tap to add to an uplink (names and ifindex of the uplink's netns).
#[derive(Clone, Debug)]
pub struct UplinkPort<'a> {
    pub tap_if: &'a str,
    pub tap_ifindex: u32,
    pub mac: [u8; 6],
    /// Declared guest IPv4 addresses: ARP requests for them are steered to
    /// this tap.
    pub ipv4: &'a [Ipv4Addr],
}

/// A guest port as recorded in the uplink's maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UplinkPortInfo {
    pub tap_ifindex: u32,
    pub macs: Vec<[u8; 6]>,
    pub ipv4: Vec<Ipv4Addr>,
}

fn port_dir(dir: &Path, tap_if: &str, ifindex: u32) -> PathBuf {
    dir.join(format!("{tap_if}_{ifindex}"))
}

/// Attaches `k7d_ul_tap_in` to the port's tap (link pinned under the
/// uplink's directory) and records its MAC and addresses. A MAC or address
/// already declared by another port is refused and changes nothing.
pub fn attach_uplink_port(dir: &Path, port: &UplinkPort<'_>) -> Result<(), BpfError> {
    let refused = |reason: String| BpfError::PortRefused {
        port: port.tap_if.to_string(),
        reason,
    };
    let mut fdb = fdb(dir)?;
    let mut arp = arp(dir)?;
    let mk = mac_key(port.mac);
    if let Ok(other) = fdb.get(&mk, 0)
        && other != port.tap_ifindex
    {
        return Err(refused(format!(
            "MAC {} is already used by the guest tap with ifindex {other}",
            fmt_mac(port.mac)
        )));
    }
    for ip in port.ipv4 {
        if let Ok(other) = arp.get(&u32::from_ne_bytes(ip.octets()), 0)
            && other != port.tap_ifindex
        {
            return Err(refused(format!(
                "address {ip} is already declared by the guest tap with ifindex {other}"
            )));
        }
    }
    let pdir = port_dir(dir, port.tap_if, port.tap_ifindex);
    let r = (|| {
        std::fs::create_dir_all(&pdir).map_err(|e| pin_err(&pdir, "created", e))?;
        let pin = dir.join(TAP_PROG_PIN);
        let mut prog = SchedClassifier::from_pin(&pin).map_err(|e| pin_err(&pin, "opened", e))?;
        attach_tcx_pinned(&mut prog, UPLINK_PROG_NAMES[1], port.tap_if, &pdir.join(TAP_LINK_PIN))?;
        for ip in port.ipv4 {
            arp.insert(u32::from_ne_bytes(ip.octets()), port.tap_ifindex, 0)
                .map_err(|e| map_error("k7d_ul_arp", "written", e))?;
        }
        fdb.insert(mk, port.tap_ifindex, 0)
            .map_err(|e| map_error("k7d_ul_fdb", "written", e))
    })();
    if r.is_err() {
        let _ = remove_entries(dir, port.tap_ifindex);
        let _ = remove_dir_pins(&pdir);
    }
    r
}

fn remove_entries(dir: &Path, ifindex: u32) -> Result<(), BpfError> {
    let mut fdb = fdb(dir)?;
    let stale: Vec<MacKey> = fdb
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| *v == ifindex)
        .map(|(k, _)| k)
        .collect();
    for k in stale {
        fdb.remove(&k).map_err(|e| map_error("k7d_ul_fdb", "written", e))?;
    }
    let mut arp = arp(dir)?;
    let stale: Vec<u32> = arp
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| *v == ifindex)
        .map(|(k, _)| k)
        .collect();
    for k in stale {
        arp.remove(&k).map_err(|e| map_error("k7d_ul_arp", "written", e))?;
    }
    Ok(())
}

/// Detaches the port of tap `tap_if` (found by name among the pinned ports,
/// so it works after the tap is gone) and forgets its MAC and addresses.
/// Idempotent.
pub fn detach_uplink_port(dir: &Path, tap_if: &str) -> Result<(), BpfError> {
    let prefix = format!("{tap_if}_");
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(pin_err(dir, "listed", e)),
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(ifindex) = name.strip_prefix(&prefix).and_then(|i| i.parse::<u32>().ok()) else {
            continue;
        };
        remove_entries(dir, ifindex)?;
        remove_dir_pins(&e.path())?;
        debug!(tap = tap_if, ifindex, "l2-uplink guest port detached");
    }
    Ok(())
}

/// The uplink's guest ports (from its maps), by tap ifindex.
pub fn uplink_ports(dir: &Path) -> Result<Vec<UplinkPortInfo>, BpfError> {
    let mut out: Vec<UplinkPortInfo> = Vec::new();
    let entry = |out: &mut Vec<UplinkPortInfo>, ifindex: u32| -> usize {
        match out.iter().position(|p| p.tap_ifindex == ifindex) {
            Some(i) => i,
            None => {
                out.push(UplinkPortInfo {
                    tap_ifindex: ifindex,
                    macs: Vec::new(),
                    ipv4: Vec::new(),
                });
                out.len() - 1
            }
        }
    };
    for (k, v) in fdb(dir)?.iter().filter_map(Result::ok) {
        let i = entry(&mut out, v);
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&k[..6]);
        out[i].macs.push(mac);
    }
    for (k, v) in arp(dir)?.iter().filter_map(Result::ok) {
        let i = entry(&mut out, v);
        out[i].ipv4.push(Ipv4Addr::from(k.to_ne_bytes()));
    }
    for p in &mut out {
        p.macs.sort();
        p.ipv4.sort();
    }
    out.sort_by_key(|p| p.tap_ifindex);
    Ok(out)
}

/// Removes the uplink's pins: unpinning detaches the uplink program and
/// every guest tap program, and frees the maps. Idempotent.
pub fn detach_uplink(dir: &Path) -> Result<(), BpfError> {
    remove_dir_pins(dir)
}

fn fmt_mac(m: [u8; 6]) -> String {
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        m[0], m[1], m[2], m[3], m[4], m[5]
    )
}

//! A cluster's private layer-2 domain (issue 16, `docs/fork.md`): a bridge
//! that k7d creates and owns, with the member VMs' taps as its only ports.
//! The host takes no part in it: no address on the bridge, IPv6 off on the
//! bridge and on every port (no router solicitations, MLD reports or DAD
//! from the host), so every frame on it comes from a guest. Each fork of a
//! cluster gets a bridge of its own, so forks that carry the same MACs and
//! IPs never share a frame.

use crate::NetError;
use crate::netlink::Netlink;

/// Creates bridge `name` (a stale link of that name is deleted first), IPv6
/// off, up. Deleted again if a later step fails.
pub fn create_private_bridge(name: &str) -> Result<(), NetError> {
    let mut nl = Netlink::open()?;
    if nl.del_link_by_name(name)? {
        tracing::warn!(bridge = name, "stale bridge removed before create");
    }
    nl.add_bridge(name)?;
    let made = (|| {
        disable_ipv6(name)?;
        let link = nl.link(name)?.ok_or_else(|| NetError::Invalid {
            what: format!("bridge {name}"),
            reason: "it vanished right after creation".into(),
        })?;
        nl.set_up(link.index, true)
    })();
    if let Err(e) = made {
        let _ = nl.del_link_by_name(name);
        return Err(e);
    }
    Ok(())
}

/// Makes tap `tap` a port of bridge `bridge`, with IPv6 off on the tap.
pub fn attach_port(bridge: &str, tap: &str) -> Result<(), NetError> {
    let mut nl = Netlink::open()?;
    let missing = |what: &str, name: &str| NetError::Invalid {
        what: format!("{what} {name}"),
        reason: "it does not exist".into(),
    };
    let br = nl.link(bridge)?.ok_or_else(|| missing("bridge", bridge))?;
    let port = nl.link(tap)?.ok_or_else(|| missing("tap", tap))?;
    disable_ipv6(tap)?;
    nl.set_master(port.index, Some(br.index))
}

/// Takes tap `tap` off whatever bridge holds it; a missing tap is not an error.
pub fn detach_port(tap: &str) -> Result<(), NetError> {
    let mut nl = Netlink::open()?;
    match nl.link(tap)? {
        Some(l) if l.master.is_some() => nl.set_master(l.index, None),
        _ => Ok(()),
    }
}

/// Deletes bridge `name` (its ports are released, not deleted); true if it
/// existed.
pub fn delete_bridge(name: &str) -> Result<bool, NetError> {
    Netlink::open()?.del_link_by_name(name)
}

/// The name of the bridge that holds link `name`, if any.
pub fn master_of(name: &str) -> Result<Option<String>, NetError> {
    let mut nl = Netlink::open()?;
    let Some(master) = nl.link(name)?.and_then(|l| l.master) else {
        return Ok(None);
    };
    Ok(nl.links()?.into_iter().find(|l| l.index == master).map(|l| l.name))
}

/// `net.ipv6.conf.<name>.disable_ipv6 = 1`; nothing to do on a kernel
/// without IPv6. `name` is one of k7d's own link names (checked: no `/`).
fn disable_ipv6(name: &str) -> Result<(), NetError> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(NetError::Invalid {
            what: format!("link name {name:?}"),
            reason: "it cannot name a sysctl directory".into(),
        });
    }
    let path = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
    match std::fs::write(&path, b"1") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !std::path::Path::new("/proc/sys/net/ipv6").exists() => {
            Ok(())
        }
        r => r.map_err(|source| NetError::Os {
            op: format!("turn IPv6 off on {name} ({path})"),
            source,
        }),
    }
}

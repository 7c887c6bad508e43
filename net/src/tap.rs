use std::os::fd::OwnedFd;

pub use k7d_sys::tap::Tap;

use crate::{NetError, netlink::Netlink};

/// Creates tap `name` in the calling thread's netns with `queues` queues
/// (`IFF_TAP|IFF_NO_PI`, `IFF_VNET_HDR` when `vnet_hdr`, `IFF_MULTI_QUEUE`
/// when `queues > 1`) and sets it up. A stale link of that name is deleted
/// first, so creating twice leaves one tap. Not persistent: the tap goes
/// away when the last fd closes.
pub fn create_tap(nl: &mut Netlink, name: &str, queues: usize, vnet_hdr: bool) -> Result<Tap, NetError> {
    if queues == 0 || queues > 256 {
        return Err(NetError::Invalid {
            what: format!("queue count {queues} for tap {name}"),
            reason: "it must be between 1 and 256".into(),
        });
    }
    if nl.del_link_by_name(name)? {
        tracing::info!(tap = name, "stale tap removed before create");
    }
    let multi = queues > 1;
    let mut fds = Vec::with_capacity(queues);
    for q in 0..queues {
        let fd = k7d_sys::tap::open_queue(name, vnet_hdr, multi)
            .map_err(|e| NetError::os(format!("open queue {q} of tap {name}"), e))?;
        fds.push(fd);
    }
    let link = nl.link(name)?.ok_or_else(|| NetError::Invalid {
        what: format!("tap {name}"),
        reason: "it vanished right after creation".into(),
    })?;
    nl.set_up(link.index, true)?;
    Ok(Tap {
        name: name.to_string(),
        ifindex: link.index,
        queues: fds,
        vnet_hdr,
    })
}

/// Reads one frame from a (non-blocking) tap queue; `Ok(None)` when none
/// is waiting.
pub fn read_frame(fd: &OwnedFd, buf: &mut [u8]) -> Result<Option<usize>, NetError> {
    match k7d_sys::fd::read(fd, buf) {
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(NetError::os("read a frame from a tap", e)),
    }
}

/// Writes one frame to a tap queue.
pub fn write_frame(fd: &OwnedFd, frame: &[u8]) -> Result<(), NetError> {
    match k7d_sys::fd::write(fd, frame) {
        Ok(n) if n == frame.len() => Ok(()),
        Ok(n) => Err(NetError::os(
            "write a frame to a tap",
            std::io::Error::other(format!("short write of {n} bytes")),
        )),
        Err(e) => Err(NetError::os("write a frame to a tap", e)),
    }
}

/// Waits up to `timeout_ms` for a frame on `fd`.
pub fn wait_readable(fd: &OwnedFd, timeout_ms: u64) -> Result<bool, NetError> {
    k7d_sys::fd::poll_readable(&[fd], Some(std::time::Duration::from_millis(timeout_ms)))
        .map(|r| r[0])
        .map_err(|e| NetError::os("poll a tap", e))
}

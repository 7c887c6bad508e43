//! What a NIC's programs passed on, per direction (`k7d_fwd`): the
//! datapath's own packet and byte counts, beside its drops
//! ([`crate::drops`]).

use std::path::Path;

use aya::maps::{Map, PerCpuArray};

use crate::{
    BpfError, Direction,
    loader::{map_error, open_pinned},
};

/// Frames one direction's program passed on (redirected, or let through in
/// policy-only mode), summed over CPUs; bytes include the Ethernet header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forwarded {
    pub direction: Direction,
    pub packets: u64,
    pub bytes: u64,
}

/// The NIC's forwarded counts, egress then ingress. A NIC attached by a k7d
/// from before the counters has no `k7d_fwd` pin: an error, as for a NIC
/// that is not attached.
pub fn forwarded(nic_dir: &Path) -> Result<[Forwarded; 2], BpfError> {
    let data = open_pinned(nic_dir, "k7d_fwd")?;
    let map: PerCpuArray<_, [u64; 2]> =
        PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(|e| map_error("k7d_fwd", "opened", e))?;
    let mut out = [Direction::Egress, Direction::Ingress].map(|direction| Forwarded {
        direction,
        packets: 0,
        bytes: 0,
    });
    for f in &mut out {
        let values = map
            .get(&(f.direction as u32), 0)
            .map_err(|e| map_error("k7d_fwd", "read", e))?;
        for [packets, bytes] in values.iter() {
            f.packets = f.packets.saturating_add(*packets);
            f.bytes = f.bytes.saturating_add(*bytes);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unattached_dir_is_a_clear_error() {
        let e = forwarded(Path::new("/nonexistent/k7d/nic0")).unwrap_err();
        assert!(matches!(e, BpfError::NotAttached(_)), "{e}");
    }
}

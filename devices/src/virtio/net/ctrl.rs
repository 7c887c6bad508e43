//! The control queue: `VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET` only (the device
//! offers no other control feature). A command is a device-readable header
//! (`class`, `cmd`) plus data, then a device-writable ack byte.

use tracing::{debug, warn};
use virtio_bindings::virtio_net::{VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, VIRTIO_NET_ERR, VIRTIO_NET_OK};
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::virtio::GuestMemoryTracked;

/// Most command bytes read (header + data); MQ needs 4.
const MAX_CMD: usize = 64;

/// What a control command asks of the device.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum CtrlCommand {
    /// Use `n` queue pairs (already range-checked against the device).
    SetPairs(u16),
    /// Anything else, or a malformed command: answered `VIRTIO_NET_ERR`.
    Refused,
}

/// Parses one control chain against a device with `max_pairs` pairs.
/// Returns the command and where to write the ack (None: the chain has no
/// writable descriptor, so nothing can be acknowledged).
pub(super) fn parse(
    chain: DescriptorChain<&GuestMemoryTracked>,
    max_pairs: u16,
) -> (CtrlCommand, Option<GuestAddress>) {
    let mem = chain.memory();
    let mut cmd = [0u8; MAX_CMD];
    let mut have = 0usize;
    let mut ack = None;
    let mut bad = false;
    for d in chain.clone() {
        if !GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize) {
            bad = true;
            continue;
        }
        if d.is_write_only() {
            if ack.is_none() && d.len() >= 1 {
                ack = Some(d.addr());
            }
            continue;
        }
        if ack.is_some() {
            // Readable after writable: out of order.
            bad = true;
            continue;
        }
        let take = (d.len() as usize).min(MAX_CMD - have);
        if take > 0 && mem.read_slice(&mut cmd[have..have + take], d.addr()).is_ok() {
            have += take;
        }
    }
    if bad || have < 2 {
        debug!(have, bad, "malformed control command refused");
        return (CtrlCommand::Refused, ack);
    }
    let (class, code) = (u32::from(cmd[0]), u32::from(cmd[1]));
    if class == VIRTIO_NET_CTRL_MQ && code == VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET && have >= 4 {
        let n = u16::from_le_bytes([cmd[2], cmd[3]]);
        if (1..=max_pairs).contains(&n) {
            return (CtrlCommand::SetPairs(n), ack);
        }
        warn!(
            n,
            max_pairs, "guest asked for an out-of-range queue-pair count; refused"
        );
        return (CtrlCommand::Refused, ack);
    }
    debug!(class, code, "unsupported control command refused");
    (CtrlCommand::Refused, ack)
}

/// The ack byte for a command's outcome.
pub(super) fn ack_byte(ok: bool) -> u8 {
    if ok { VIRTIO_NET_OK as u8 } else { VIRTIO_NET_ERR as u8 }
}

//! The mapping of the guest's accepted features to `TUNSETOFFLOAD` bits.
//! The tap-queue calls themselves (`writev`, `read`, `TUNSETQUEUE`,
//! `TUNSETVNETHDRSZ`) are `k7d_sys`'s.

use k7d_sys::tap::{TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6};
use virtio_bindings::virtio_net::{VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6};

/// `TUNSETOFFLOAD` bits for the offloads the guest accepted on RX. TSO needs
/// checksum offload (the kernel refuses TSO without `TUN_F_CSUM`, and the
/// virtio spec makes `GUEST_TSO*` depend on `GUEST_CSUM`).
pub(super) fn offload_flags(acked: u64) -> u32 {
    let has = |bit: u32| acked & (1u64 << bit) != 0;
    if !has(VIRTIO_NET_F_GUEST_CSUM) {
        return 0;
    }
    let mut flags = TUN_F_CSUM;
    if has(VIRTIO_NET_F_GUEST_TSO4) {
        flags |= TUN_F_TSO4;
    }
    if has(VIRTIO_NET_F_GUEST_TSO6) {
        flags |= TUN_F_TSO6;
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloads_follow_the_guest() {
        let b = |bit: u32| 1u64 << bit;
        assert_eq!(offload_flags(0), 0);
        assert_eq!(
            offload_flags(b(VIRTIO_NET_F_GUEST_TSO4)),
            0,
            "TSO without CSUM is not set"
        );
        assert_eq!(offload_flags(b(VIRTIO_NET_F_GUEST_CSUM)), TUN_F_CSUM);
        assert_eq!(
            offload_flags(b(VIRTIO_NET_F_GUEST_CSUM) | b(VIRTIO_NET_F_GUEST_TSO4) | b(VIRTIO_NET_F_GUEST_TSO6)),
            TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6
        );
    }
}

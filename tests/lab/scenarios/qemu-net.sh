# lab: description=reference for k7d-net: the same guest script and checks with QEMU 7.2 (-netdev tap,queues=2; LAB_NET_VHOST=on for vhost-net)
# lab: default=no
# lab: by-hand=by hand: QEMU's reference figures for k7d-net, a comparison read by a person (k7d-net's own checks run in CI)
# lab: timeout=900
# lab: needs=qemu
# lab: guest=k7d-net
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun vhost_net
# lab: l1-bins=ip
# lab: files=tests/lab/scenarios/k7d-net.sh
#
# Proves the guest script and every check of k7d-net (and, with
# LAB_NET_VHOST=on, of k7d-net-vhost) against Debian's QEMU, which creates
# and removes the tap itself, as k7d does. Not in CI.
# By hand: tests/lab/run.sh qemu-net; LAB_NET_VHOST=on tests/lab/run.sh qemu-net
# shellcheck disable=SC2034  # read by the sourced scenario
NET_VMM=qemu NET_VHOST=${LAB_NET_VHOST:-off}
# shellcheck source=k7d-net.sh
. /lab/files/k7d-net.sh

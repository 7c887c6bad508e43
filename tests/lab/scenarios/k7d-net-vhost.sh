# lab: description=k7d-net with --nic ...,vhost=on over L1's /dev/vhost-net; expects "vhost: on, queues: 2"
# lab: default=yes
# lab: timeout=900

# lab: bin=required
# lab: guest=k7d-net
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun vhost_net
# lab: l1-bins=ip
# lab: files=tests/lab/scenarios/k7d-net.sh
#
# One L1 vCPU, like every scenario: with 100 MiB each way, L1's vhost worker
# and the guest's vCPUs sharing it took over 900 s, so this scenario had two
# (and the emulator fault in CHALLENGES.md, "Guests (and L1 itself) dying
# under nested I/O", that comes with them); with 16 MiB it takes ~30 s.
# Issue 4: the same checks as k7d-net with the kernel vhost-net data plane
# (L1 loads tun vhost_iotlb vhost tap vhost_net): --nic tap=k7dlab0,queues=2,vhost=on,
# and k7d must print "k7d: nic 0: tap k7dlab0, vhost: on, queues: 2".
# Pending until k7d's vhost-net backend is real: then set default=yes.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-net-vhost
# shellcheck disable=SC2034  # read by the sourced scenario
NET_VHOST=on
# shellcheck source=k7d-net.sh
. /lab/files/k7d-net.sh

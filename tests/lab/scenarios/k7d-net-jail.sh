# lab: description=k7d-net with the VM in a jailed VM process of `k7d daemon --jail on`, on vhost-net: the daemon creates the tap (2 queues) and opens /dev/vhost-net per pair and hands every descriptor over; the same guest script and checks
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest=k7d-net
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun vhost_net
# lab: l1-bins=ip
# lab: files=tests/lab/scenarios/k7d-net.sh tests/lab/scenarios/k7d-jail.l1.sh
#
# Issue 36: a NIC in a VM process. The VM process has no network of its own
# (its own empty network namespace), no filesystem and no capability: the
# daemon creates the tap in L1's namespace, opens its queues and one
# /dev/vhost-net per queue pair, and hands them over with the build
# request; the VM process takes ownership of each vhost device
# (VHOST_SET_OWNER: the kernel's worker serves the VM process's memory);
# the tap goes when the VM process's descriptors close. k7d-net's guest
# script and checks (2 queue pairs, ping, 16 MiB each way) on vhost-net,
# plus what the VM process was (lab_jail_check) and that it held the tap's
# queues and both vhost devices. (A userspace NIC in a VM process carries
# traffic in k7d-direct-jail.)
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-net-jail
# shellcheck disable=SC2034  # read by the sourced scenario
NET_VMM=k7d-jail
NET_VHOST=on
# shellcheck source=k7d-net.sh
. /lab/files/k7d-net.sh

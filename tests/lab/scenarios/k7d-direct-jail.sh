# lab: description=k7d-direct with the VM in a jailed VM process of `k7d daemon --jail on`: the daemon makes the tap in the pod netns with the direct datapath around it and hands its queues over; the same guest script and checks, nothing left after the delete
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest=k7d-net
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun veth sch_ingress cls_bpf act_mirred
# lab: l1-bins=ip tc
# lab: files=tests/lab/scenarios/k7d-net.sh tests/lab/scenarios/k7d-jail.l1.sh
#
# Issue 36: a pod's NIC in a VM process. The VM process has no network and
# no capability of its own: the daemon makes the tap in the pod's netns
# (k7dpod), attaches the tc programs to it and the pod's eth0, and hands the
# tap's 2 queues over with the build; the VM process holds them, and the
# daemon detaches the datapath when the VM is deleted. k7d-direct's guest
# script and checks (ping, 16 MiB each way, nothing left: no tap in the pod,
# no filter, no pin), plus what the VM process was (lab_jail_check).
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-direct-jail
# shellcheck disable=SC2034  # read by the sourced scenario
NET_VMM=k7d-jail
NET_DATAPATH=direct
# shellcheck source=k7d-net.sh
. /lab/files/k7d-net.sh

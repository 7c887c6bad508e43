# lab: description=k7d-net through the tc-eBPF direct datapath: the guest owns the pod's address and reaches the pod veth's peer (ping + 16 MiB each way, sums match), nothing left after exit
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest=k7d-net
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun veth sch_ingress cls_bpf act_mirred
# lab: l1-bins=ip tc
# lab: files=tests/lab/scenarios/k7d-net.sh
#
# Issue 6, "a real Linux guest in the lab reaches a peer netns through the
# direct datapath": L1 makes a pod (netns k7dpod, CNI veth eth0, peer k7dpeer
# 10.77.0.1 in the root netns); k7d runs with
# --nic datapath=direct,netns=/run/netns/k7dpod,pod-if=eth0,queues=2, which
# creates the VM's tap in the pod and attaches the tc programs (L1's 6.1
# kernel has no TCX: clsact + cls_bpf). The guest (10.77.0.2) pings k7dpeer and
# moves 16 MiB each way; k7d must report "datapath: direct" and leave no tap,
# filter or pin behind.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-direct
# shellcheck disable=SC2034  # read by the sourced scenario
NET_DATAPATH=direct
# shellcheck source=k7d-net.sh
. /lab/files/k7d-net.sh

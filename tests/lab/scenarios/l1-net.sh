# lab: description=L1 has what later network scenarios need: vhost-net, vhost-vsock, multi-queue taps, clsact + cls_bpf, iproute2 (no L2 boot)
# lab: default=yes
# lab: timeout=300
# lab: l1-modules=tun tap vhost_net vhost_vsock sch_ingress cls_bpf cls_matchall act_mirred
# lab: l1-bins=ip tc
#
# A check of the lab itself for the scenarios of later issues; boots no guest.
. /lab/lib.sh

for dev in /dev/vhost-net /dev/vhost-vsock /dev/net/tun; do
  [ -c "$dev" ] || lab_fail "no $dev in L1"
done
ip -V | grep -q iproute2 || lab_fail "ip is not iproute2's"
ip tuntap add dev lab0 mode tap multi_queue || lab_fail "ip tuntap add (multi_queue) failed"
ip link set lab0 up || lab_fail "ip link set lab0 up failed"
tc qdisc add dev lab0 clsact || lab_fail "tc qdisc add clsact failed"
tc filter add dev lab0 ingress matchall action mirred egress redirect dev lo ||
  lab_fail "tc matchall + mirred filter failed"
lab_note "$(tc filter show dev lab0 ingress | head -n1)"
ip tuntap del dev lab0 mode tap multi_queue
lab_pass "l1-net: vhost-net, vhost-vsock, multi-queue tap, clsact, mirred"

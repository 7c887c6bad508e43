# lab: description=k7d virtio-net userspace (tap, 2 queue pairs, 2 vCPUs): the guest sees 2 queue pairs, pings L1, LAB_NET_MIB (16) MiB each way with matching sha256
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun vhost_net
# lab: l1-bins=ip
#
# Issue 4, "Lab, real Linux guest", virtio-net: k7d run --vcpus 2 --nic
# tap=k7dlab0,queues=2 (the node policy leaves vhost off, although L1 has
# /dev/vhost-net). k7d creates the tap; L1 gives it 10.77.0.1/24 once it
# exists. The guest (k7d-net.guest.sh) must see rx-0 rx-1 tx-0 tx-1, answer 3/3
# pings and move LAB_NET_MIB (default 16) MiB each way over TCP (busybox nc) with the same sha256 at
# both ends. k7d must print "k7d: nic 0: tap k7dlab0, vhost: off, queues: 2" and
# remove the tap when it exits.
# Variants source this file: k7d-net-vhost (NET_VHOST=on: --nic ...,vhost=on),
# qemu-net (NET_VMM=qemu: the reference, with QEMU's own tap backend),
# k7d-direct (NET_DATAPATH=direct), and k7d-net-jail and k7d-direct-jail
# (NET_VMM=k7d-jail: the VM in a VM process of `k7d daemon --jail on`).
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-net
. /lab/lib.sh

VMM=${NET_VMM:-k7d} VHOST=${NET_VHOST:-off} DIRECT=${NET_DATAPATH:-}
# LAB_NET_MIB each way (default 16: ~11k segments each way, every ring wraps
# many times; the lab proves correctness, benches/ measure throughput).
MIB=${LAB_NET_MIB:-16}
TAP=k7dlab0 SIZE=$((MIB * 1048576)) LOG=/tmp/l2-net.log
[ -c /dev/net/tun ] || lab_fail "no /dev/net/tun in L1"
ip link show "$TAP" >/dev/null 2>&1 && lab_fail "$TAP exists before the VMM started"
if [ -n "$DIRECT" ]; then
  # A pod: netns k7dpod with the CNI veth eth0; its peer k7dpeer in L1's root
  # netns is the host the guest talks to (10.77.0.1) through k7d's datapath.
  grep -q " /sys/fs/bpf " /proc/mounts || mount -t bpf bpf /sys/fs/bpf || lab_fail "cannot mount bpffs"
  ip netns add k7dpod || lab_fail "ip netns add failed"
  ip link add k7dpeer type veth peer name eth0 netns k7dpod || lab_fail "veth creation failed"
  ip addr add 10.77.0.1/24 dev k7dpeer && ip link set k7dpeer up && ip -n k7dpod link set eth0 up ||
    lab_fail "configuring the pod veth failed"
  TAP=k7dpeer
fi
rm -f /tmp/net.*

# What L1 sends, and an endless stdin for its listener (see the guest script).
head -c "$SIZE" /dev/urandom >/tmp/net.l1-tx || lab_fail "cannot write /tmp/net.l1-tx"
l1_tx_sum=$(sha256sum </tmp/net.l1-tx | cut -d' ' -f1)
mkfifo /tmp/net.hold && exec 3<>/tmp/net.hold

# guest -> L1 on port 5001: listening before the tap even exists, so before the guest can connect.
(timeout 1200 nc -l -p 5001 <&3 >/tmp/net.l1-rx 2>/tmp/net.l1-rx.err; echo $? >/tmp/net.l1-rx.rc) &
rx_pid=$!
# L1's side of the tap, then L1 -> guest on port 5002 once the guest's send is done.
(
  i=0
  until [ -e "/sys/class/net/$TAP" ]; do
    i=$((i + 1)); [ "$i" -lt 3000 ] || { echo "the tap $TAP never appeared in L1" >/tmp/net.agent-err; exit 1; }
    sleep 0.1
  done
  if [ -z "$DIRECT" ]; then
    { ip addr add 10.77.0.1/24 dev "$TAP" && ip link set "$TAP" up; } 2>/tmp/net.ip.err ||
      { echo "configuring $TAP failed: $(cat /tmp/net.ip.err)" >/tmp/net.agent-err; exit 1; }
  fi
  lab_now >/tmp/net.tap-up
  i=0
  until [ -s /tmp/net.l1-rx.rc ]; do
    i=$((i + 1)); [ "$i" -lt 6000 ] || { echo "the guest's $MIB MiB never finished arriving" >/tmp/net.agent-err; exit 1; }
    sleep 0.2
  done
  i=0
  until timeout 900 nc 10.77.0.2 5002 </tmp/net.l1-tx >/dev/null 2>/tmp/net.l1-tx.err; do
    i=$((i + 1)); [ "$i" -lt 600 ] || { echo "could not send to 10.77.0.2:5002: $(cat /tmp/net.l1-tx.err)" >/tmp/net.agent-err; exit 1; }
    sleep 0.3
  done
  echo ok >/tmp/net.l1-tx.done
) &
agent_pid=$!

nic="tap=$TAP,queues=2"
[ "$VHOST" = on ] && nic="$nic,vhost=on"
[ -n "$DIRECT" ] && nic="datapath=$DIRECT,netns=/run/netns/k7dpod,pod-if=eth0,queues=2"
case $VMM in
  k7d)
    [ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
    lab_run_l2 net "${LAB_L2_TIMEOUT:-780}" "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
      --cmdline "$LAB_CMDLINE lab.mib=$MIB" --vcpus 2 --memory 512 --nic "$nic" ;;
  k7d-jail)
    # The same VM built by `k7d daemon --jail on` in a jailed VM process:
    # the daemon makes the tap and hands its queues over (k7d-net-jail).
    [ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
    lab_run_l2 net "${LAB_L2_TIMEOUT:-780}" sh /lab/files/k7d-jail.l1.sh "$LAB_BIN" --kernel "$LAB_KERNEL" \
      --initrd "$LAB_INITRD" --cmdline "$LAB_CMDLINE lab.mib=$MIB" --vcpus 2 --memory 512 --nic "$nic" ;;
  qemu)
    lab_note "$(qemu-system-x86_64 --version | head -n1)"
    lab_run_l2 net "${LAB_L2_TIMEOUT:-780}" qemu-system-x86_64 -accel kvm -cpu host -machine pc -smp 2 -m 512 \
      -nodefaults -no-user-config -display none -serial stdio -no-reboot \
      -kernel "$LAB_KERNEL" -initrd "$LAB_INITRD" -append "$LAB_CMDLINE lab.mib=$MIB" \
      -netdev "tap,id=n0,ifname=$TAP,script=no,downscript=no,queues=2,vhost=$VHOST" \
      -device virtio-net-pci,netdev=n0,mq=on,vectors=6 ;;
  *) lab_fail "unknown NET_VMM=$VMM" ;;
esac
exec 3<&-
kill "$agent_pid" "$rx_pid" 2>/dev/null
wait "$agent_pid" "$rx_pid" 2>/dev/null

err=$(sed -n 's/.*LAB-GUEST error //p' "$LOG" | head -n1)
[ ! -s /tmp/net.agent-err ] || lab_fail "L1: $(cat /tmp/net.agent-err)${err:+; guest: $err}"
[ -z "$err" ] || lab_fail "guest: $err"
[ "$L2_RC" != 137 ] || lab_fail "$VMM killed after ${LAB_L2_TIMEOUT:-780} s: $(grep -v LAB-GUEST "$LOG" | tail -n3 | tr '\n' ' ')"
[ "$L2_RC" = 0 ] || lab_fail "$VMM exited $L2_RC: $(grep -v LAB-GUEST "$LOG" | tail -n3 | tr '\n' ' ')"
grep -q "LAB-GUEST net-done=yes" "$LOG" || lab_fail "the guest script did not finish"
grep -q "LAB-GUEST end rc=0" "$LOG" || lab_fail "the guest script did not end with rc=0"
if [ -n "$DIRECT" ]; then
  if [ "$VMM" = k7d-jail ]; then
    # The daemon's create said it; the VM process held the tap's queues.
    line=$(grep "k7d-jail: create: device virtio-net" "$LOG" | head -n1)
    [ "$(grep -c ' -> /dev/net/tun$' /tmp/k7d-jail/fds)" = 2 ] ||
      lab_fail "the VM process does not hold the tap's 2 queues: $(tr '\n' ' ' </tmp/k7d-jail/fds)"
    grep -q "stopped (guest poweroff)" "$LOG" || lab_fail "k7d did not report the guest poweroff"
    lab_jail_check
  else
    line=$(grep "k7d: nic 0: tap k7dt" "$LOG" | head -n1)
  fi
  case $line in
    *"vhost: off, queues: 2,"*"datapath: $DIRECT"*) lab_note "$line" ;;
    *) lab_fail "k7d did not report 'vhost: off, queues: 2 ... datapath: $DIRECT' (it printed: $line)" ;;
  esac
  # Nothing of the NIC may remain: no tap in the pod, no filters, no pins.
  left=$(ip -n k7dpod -o link show | grep -c k7dt)
  [ "$left" = 0 ] || lab_fail "a tap is still in the pod netns after k7d exited"
  [ -z "$(ls -A /sys/fs/bpf/k7d 2>/dev/null)" ] || lab_fail "bpf pins left: $(ls -R /sys/fs/bpf/k7d)"
  [ -z "$(/usr/bin/tc -n k7dpod filter show dev eth0 ingress 2>/dev/null)" ] || lab_fail "tc filters left on the pod's eth0"
elif [ "$VMM" = k7d ]; then
  line="k7d: nic 0: tap $TAP, vhost: $VHOST, queues: 2"
  grep -qF "$line" "$LOG" || lab_fail "k7d did not print '$line' (it printed: $(grep 'k7d: nic' "$LOG" | head -n2 | tr '\n' ' '))"
  lab_note "$line"
elif [ "$VMM" = k7d-jail ]; then
  line=$(grep "k7d-jail: create: device virtio-net" "$LOG" | head -n1)
  case $line in
    *"(tap $TAP, vhost: $VHOST, queues: 2,"*) lab_note "$line" ;;
    *) lab_fail "the daemon did not report 'tap $TAP, vhost: $VHOST, queues: 2' (it printed: $line)" ;;
  esac
  grep -q "stopped (guest poweroff)" "$LOG" || lab_fail "k7d did not report the guest poweroff"
  # Its tap's two queues among its descriptors, and on vhost-net one
  # /dev/vhost-net per queue pair (handed over: it opens no path).
  [ "$(grep -c ' -> /dev/net/tun$' /tmp/k7d-jail/fds)" = 2 ] ||
    lab_fail "the VM process does not hold the tap's 2 queues: $(tr '\n' ' ' </tmp/k7d-jail/fds)"
  want=0
  [ "$VHOST" = on ] && want=2
  [ "$(grep -c ' -> /dev/vhost-net$' /tmp/k7d-jail/fds)" = "$want" ] ||
    lab_fail "the VM process does not hold $want vhost-net devices: $(tr '\n' ' ' </tmp/k7d-jail/fds)"
  lab_jail_check
fi
[ -n "$DIRECT" ] || ! ip link show "$TAP" >/dev/null 2>&1 || lab_fail "the tap $TAP is still there after $VMM exited"

q=$(lab_guest net-queues net)
[ "$q" = "rx-0,rx-1,tx-0,tx-1" ] || lab_fail "the guest's eth0 has queues $q, expected rx-0,rx-1,tx-0,tx-1 (2 queue pairs)"
[ "$(lab_guest ping net)" = 3/3 ] || lab_fail "ping 10.77.0.1 from the guest: $(lab_guest ping net) answered, expected 3/3"
# guest -> L1
[ "$(cat /tmp/net.l1-rx.rc 2>/dev/null)" = 0 ] || lab_fail "L1's listener on 5001 ended with rc $(cat /tmp/net.l1-rx.rc 2>/dev/null): $(cat /tmp/net.l1-rx.err 2>/dev/null)"
gtx=$(lab_guest net-tx-sha net) rx=$(sha256sum </tmp/net.l1-rx | cut -d' ' -f1) rxb=$(wc -c </tmp/net.l1-rx)
[ "$rxb" = "$SIZE" ] || lab_fail "guest -> L1: L1 received $rxb bytes, expected $SIZE"
[ "$rx" = "$gtx" ] || lab_fail "guest -> L1: sha256 differs: guest sent $gtx, L1 received $rx"
# L1 -> guest
[ -e /tmp/net.l1-tx.done ] || lab_fail "L1 -> guest: L1's send did not complete"
[ "$(lab_guest net-rx-bytes net)" = "$SIZE" ] || lab_fail "L1 -> guest: the guest received $(lab_guest net-rx-bytes net) bytes, expected $SIZE"
[ "$(lab_guest net-rx-sha net)" = "$l1_tx_sum" ] || lab_fail "L1 -> guest: sha256 differs: L1 sent $l1_tx_sum, the guest received $(lab_guest net-rx-sha net)"
rm -f /tmp/net.l1-tx /tmp/net.l1-rx

lab_note "guest eth0 queues $q, mac $(lab_guest net-mac net), ping 3/3; $MIB MiB guest->L1 sha256 $gtx, L1->guest sha256 $l1_tx_sum"
lab_metric net.mib "$MIB" MiB
lab_metric net.guest_to_l1_s "$(lab_guest net-tx-s net)" s
lab_metric net.l1_to_guest_s "$(lab_guest net-rx-s net)" s
lab_note "timings of an emulated machine (L1 is QEMU TCG): not performance figures"
lab_pass "$VMM-net (vhost $VHOST${DIRECT:+, datapath $DIRECT}): 2 queue pairs, ping 3/3, $MIB MiB each way, sums match, nothing left"

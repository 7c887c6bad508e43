# lab: description=soak (not in CI): 2 vCPUs, 2 queue pairs of virtio-net streaming both ways while a raw disk is hammered with O_DIRECT writes/reads, mkfs.ext4 and process churn for LAB_SOAK_S (90) seconds; the guest must survive and every read must match (LAB_SOAK_VMM=qemu: the same under QEMU)
# lab: default=no
# lab: by-hand=by hand: a soak of LAB_SOAK_S seconds, too long for CI by design
# lab: timeout=900
# lab: needs=qemu
# lab: guest-modules=virtio_pci virtio_blk virtio_net
# lab: l1-modules=loop crc32c_generic ext4 tun vhost_net
# lab: l1-bins=ip
# lab: l2-bins=mkfs.ext4
#
# A reproducer for intermittent guest crashes under I/O (CHALLENGES.md, "An
# intermittent guest crash under I/O"): more exposure per L1 boot than the
# functional scenarios. The guest (soak.guest.sh) reads its duration from
# the kernel command line (soak_s=, passed to init's environment).
# By hand: tests/lab/run.sh --bin target/release/k7d soak
#          LAB_SOAK_VMM=qemu tests/lab/run.sh soak
. /lab/lib.sh

VMM=${LAB_SOAK_VMM:-k7d} SOAK=${LAB_SOAK_S:-90}
IMG=/tmp/soak.img LOG=/tmp/l2-soak.log
truncate -s 268435456 "$IMG" || lab_fail "cannot create $IMG"
cmdline="$LAB_CMDLINE soak_s=$SOAK"
TAP=k7dlab0 NET=${LAB_SOAK_NET-1}  # LAB_SOAK_NET= (empty): no NIC
# L1's side: address the tap once it exists, sink what the guest sends
# (port 5001), stream zeros to the guest (port 5002) until the VMM exits.
(
  i=0
  until [ -e "/sys/class/net/$TAP" ]; do i=$((i + 1)); [ "$i" -lt 3000 ] || exit 1; sleep 0.1; done
  ip addr add 10.77.0.1/24 dev "$TAP" && ip link set "$TAP" up
  while :; do nc 10.77.0.2 5002 </dev/zero >/dev/null 2>&1; sleep 0.2; done
) &
agent=$!
mkfifo /tmp/soak.hold && exec 3<>/tmp/soak.hold
(while :; do nc -l -p 5001 <&3 >/dev/null 2>&1; done) &
sink=$!
case $VMM in
  k7d)
    [ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
    lab_run_l2 soak "$((SOAK + 300))" "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
      --cmdline "$cmdline" --vcpus 2 --memory 512 --disk "$IMG" ${NET:+--nic "tap=$TAP,queues=2${LAB_SOAK_VHOST:+,vhost=on}"} ;;
  qemu)
    lab_note "$(qemu-system-x86_64 --version | head -n1)"
    lab_run_l2 soak "$((SOAK + 300))" qemu-system-x86_64 -accel kvm -cpu host -machine pc -smp 2 -m 512 \
      -nodefaults -no-user-config -display none -serial stdio -no-reboot \
      -kernel "$LAB_KERNEL" -initrd "$LAB_INITRD" -append "$cmdline" \
      -drive "file=$IMG,if=virtio,format=raw" \
      ${NET:+-netdev "tap,id=n0,ifname=$TAP,script=no,downscript=no,queues=2,vhost=off"} \
      ${NET:+-device virtio-net-pci,netdev=n0,mq=on,vectors=6} ;;
  *) lab_fail "unknown LAB_SOAK_VMM=$VMM" ;;
esac
kill "$agent" "$sink" 2>/dev/null
pkill -x nc 2>/dev/null
err=$(sed -n 's/.*LAB-GUEST error //p' "$LOG" | head -n1)
[ -z "$err" ] || lab_fail "guest: $err"
[ "$L2_RC" = 0 ] || lab_fail "$VMM exited $L2_RC after $(sed -n "s/.*LAB-GUEST soak-rounds-so-far=\([0-9]*\).*/\1/p" "$LOG" | tail -n1) rounds: $(grep -v LAB-GUEST "$LOG" | tail -n3 | tr '\n' ' ')"
rounds=$(sed -n "s/.*LAB-GUEST soak-rounds-so-far=\([0-9]*\).*/\1/p" "$LOG" | tail -n1)
if ! grep -q "LAB-GUEST soak-done=yes" "$LOG"; then
  # QEMU -no-reboot exits 0 on a guest reset, triple faults included.
  grep -q "reboot: Power down" "$LOG" || lab_fail "the guest died abruptly after ${rounds:-0} rounds: no panic message, no power-down (a reset or triple fault)"
  lab_fail "the guest did not finish the soak (${rounds:-0} rounds)"
fi
lab_metric soak.rounds "$(lab_guest soak-rounds soak)" rounds
lab_metric soak.net_rx_mib "$(lab_guest soak-net-rx-mib soak)" MiB
lab_pass "$VMM survived ${SOAK}s of ${NET:+network streams both ways (vhost ${LAB_SOAK_VHOST:-off}), }disk I/O and process churn: $(lab_guest soak-rounds soak) rounds, every read matched"

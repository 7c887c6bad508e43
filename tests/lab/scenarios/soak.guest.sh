# The guest of the soak scenario: for $soak_s seconds (from the kernel
# command line), on /dev/vda: 16 MiB O_DIRECT write + read-back + compare at
# rotating offsets, a mkfs.ext4 every 8th round (discards, zeroing), while a
# second shell churns processes (fork/exec/exit: TLB shootdowns on both vCPUs)
# and eth0 (10.77.0.2) streams zeros to L1 (10.77.0.1:5001) and takes L1's
# stream on port 5002.
g() { echo "LAB-GUEST $*"; }
fail() { g "error $*"; exit 1; }
now() { read -r _n _ </proc/uptime; echo "${_n%.*}"; }
[ -e /sys/block/vda ] || fail "no /dev/vda"
dur=${soak_s:-90}
head -c 16777216 /dev/urandom >/tmp/chunk || fail "cannot make the chunk"
want=$(sha256sum </tmp/chunk | cut -d' ' -f1)
(while :; do /bin/true; /bin/true; done) &
churn=$!
pids=$churn
if [ -d /sys/class/net/eth0 ]; then
  ip link set lo up
  ip addr add 10.77.0.2/24 dev eth0 && ip link set eth0 up || fail "configuring eth0 failed"
  (while :; do nc 10.77.0.1 5001 </dev/zero >/dev/null 2>&1; sleep 0.2; done) &
  pids="$pids $!"
  # A listener's stdin that never ends (busybox nc ends on stdin EOF).
  mkfifo /tmp/hold && exec 3<>/tmp/hold
  (while :; do nc -l -p 5002 <&3 >/dev/null 2>&1; done) &
  pids="$pids $!"
fi
end=$(( $(now) + dur )) i=0
while [ "$(now)" -lt "$end" ]; do
  off=$(( (i % 14) * 16 ))
  dd if=/tmp/chunk of=/dev/vda bs=1M seek="$off" oflag=direct conv=notrunc 2>/tmp/dd.err || fail "write round $i: $(cat /tmp/dd.err)"
  got=$(dd if=/dev/vda bs=1M skip="$off" count=16 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || fail "round $i: read back $got, wrote $want"
  if [ $((i % 8)) = 7 ]; then
    mkfs.ext4 -q -F /dev/vda >/tmp/mkfs.log 2>&1 || fail "mkfs.ext4 round $i: $(tail -n2 /tmp/mkfs.log)"
  fi
  i=$((i + 1))
  g "soak-rounds-so-far=$i"
done
# Stop the loops and their nc children: a stream still running into
# poweroff -f can spin the guest's TX path on a queue the shutdown broke.
kill $pids
killall nc 2>/dev/null
sleep 1
g "soak-net-rx-mib=$(( $(cat /sys/class/net/eth0/statistics/rx_bytes 2>/dev/null || echo 0) / 1048576 ))"
g "soak-rounds=$i"
g "soak-done=yes"

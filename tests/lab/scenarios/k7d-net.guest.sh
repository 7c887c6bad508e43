# The guest of k7d-net, k7d-net-vhost and qemu-net, busybox sh after /init
# loaded virtio_pci and virtio_net. One NIC, eth0, 2 queue pairs expected; L1
# is 10.77.0.1/24 on the tap. It prints the queues, pings L1, then moves
# lab.mib= MiB (kernel command line, default 16) each way with busybox nc, sums printed for the scenario to compare:
#   guest -> L1: the guest connects to 10.77.0.1:5001 and sends /tmp/tx
#   L1 -> guest: the guest listens on 5002 and keeps what arrives in /tmp/rx
# "LAB-GUEST error ..." and a non-zero rc on the first thing that goes wrong.
g() { echo "LAB-GUEST $*"; }
fail() { g "error $*"; exit 1; }
now() { read -r _n _ </proc/uptime; echo "$_n"; }
dt() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", b - a}'; }
# The size comes from the scenario (LAB_NET_MIB): enough TCP segments to wrap
# every ring many times; throughput is for benches/, not the lab.
MIB=$(sed -n 's/.*[[:space:]]lab\.mib=\([0-9]*\).*/\1/p' </proc/cmdline | tr -d '\n')
SIZE=$((${MIB:-16} * 1048576))

[ -d /sys/class/net/eth0 ] || fail "no eth0 (virtio-net not bound): $(cd /sys/class/net && echo *)"
g "net-queues=$(cd /sys/class/net/eth0/queues && echo * | tr ' ' ',')"
g "net-mac=$(cat /sys/class/net/eth0/address)"
ip link set lo up
ip addr add 10.77.0.2/24 dev eth0 || fail "ip addr add on eth0 failed"
ip link set eth0 up || fail "ip link set eth0 up failed"

# The bytes to send, made while L1 configures its side of the tap.
head -c "$SIZE" /dev/urandom >/tmp/tx || fail "cannot write /tmp/tx"
g "net-tx-sha=$(sha256sum </tmp/tx | cut -d' ' -f1)"

i=0
until ping -c 1 -W 1 10.77.0.1 >/dev/null 2>&1; do
  i=$((i + 1))
  [ "$i" -lt 120 ] || fail "10.77.0.1 (L1's end of the tap) never answered a ping"
  sleep 0.5
done
ping -c 3 -W 2 10.77.0.1 >/tmp/ping 2>&1
g "ping=$(sed -n 's/^\([0-9]*\) packets transmitted, \([0-9]*\) packets received.*/\2\/\1/p' /tmp/ping)"

# A listener's stdin that never ends (busybox nc closes its sending half on
# stdin EOF, which would end the peer early): a FIFO held open read-write.
mkfifo /tmp/hold && exec 3<>/tmp/hold

t0=$(now)
timeout 900 nc 10.77.0.1 5001 </tmp/tx >/dev/null 2>/tmp/nc-tx.err
rc=$?
t1=$(now)
g "net-tx-rc=$rc"
[ "$rc" = 0 ] || fail "sending $SIZE bytes to 10.77.0.1:5001 failed (rc $rc, 143: timed out): $(cat /tmp/nc-tx.err)"
g "net-tx-s=$(dt "$t0" "$t1")"
rm -f /tmp/tx

t0=$(now)
timeout 900 nc -l -p 5002 <&3 >/tmp/rx 2>/tmp/nc-rx.err
rc=$?
t1=$(now)
g "net-rx-rc=$rc"
[ "$rc" = 0 ] || fail "receiving on port 5002 failed (rc $rc, 143: timed out): $(cat /tmp/nc-rx.err)"
g "net-rx-bytes=$(wc -c </tmp/rx)"
g "net-rx-sha=$(sha256sum </tmp/rx | cut -d' ' -f1)"
g "net-rx-s=$(dt "$t0" "$t1")"
rm -f /tmp/rx
g "net-done=yes"

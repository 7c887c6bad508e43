# The guest of k7d-cluster (busybox sh, run by /init after it loaded
# virtio_pci and virtio_net). Three VMs boot it; `lab.role=a|b|c` on the
# kernel command line says which one this is. eth0 sits on the cluster's
# private bridge: a is 10.78.0.1, b 10.78.0.2, c 10.78.0.3 (/24).
#   b  listens on 6001 and keeps what arrives in /tmp/rx (a's stream)
#   c  listens on 6002 and echoes every byte back (a's requests)
#   a  streams 1 KiB every 0.2 s to b:6001 over one TCP connection, and
#      sends "req <n>" to c:6002 over another, reading each answer back
#      before the next request
# Every second each prints one status line:
#   LAB-GUEST st role=<r> ip=<address on eth0> mac=<eth0's MAC> <counters> end
# with a: tx=<KiB handed to the stream> rr=<requests answered>, b: rx=<bytes
# received>, c: nothing more; and a gratuitous ARP (a broadcast). The trailing " end" marks a complete line (a
# fork child's log can begin in the middle of one). A connection that ends
# (a reset: its nc exits) or an answer that is not the request is printed
# as "LAB-GUEST error ..."; the scenario fails on any. The connections are
# made once: after a fork, each child's connections are the source's own,
# carried over in guest RAM.
g() { echo "LAB-GUEST $*"; }
fail() { g "error $*"; exit 1; }
ROLE=$(sed -n 's/.*[[:space:]]lab\.role=\([abc]\).*/\1/p' </proc/cmdline)
case $ROLE in
  a) IP=10.78.0.1 ;;
  b) IP=10.78.0.2 ;;
  c) IP=10.78.0.3 ;;
  *) fail "no lab.role=a|b|c on the kernel command line: $(cat /proc/cmdline)" ;;
esac
[ -d /sys/class/net/eth0 ] || fail "no eth0 (virtio-net not bound): $(cd /sys/class/net && echo *)"
# A listener's stdin that never ends (busybox nc closes its sending half on
# stdin EOF): a FIFO held open read-write.
mkfifo /tmp/hold /tmp/loop && exec 3<>/tmp/hold 6<>/tmp/loop || fail "mkfifo failed"
# b and c listen before they have an address: once a can reach them, they listen.
case $ROLE in
  b) nc -l -p 6001 <&3 >/tmp/rx 2>/tmp/nc.err & NCPID=$! ;;
  c) nc -l -p 6002 <&6 >&6 2>/tmp/nc.err & NCPID=$! ;;
esac
ip link set lo up
ip addr add "$IP/24" dev eth0 || fail "ip addr add $IP/24 on eth0 failed"
ip link set eth0 up || fail "ip link set eth0 up failed"
g "net role=$ROLE ip=$IP mac=$(cat /sys/class/net/eth0/address) end"

# addr: the IPv4 address eth0 has now (read each time: after a fork, what
# the child's kernel holds).
addr() { ip -4 -o addr show dev eth0 | sed -n 's/.* inet \([0-9.]*\)\/.*/\1/p' | head -n1; }
# status: the status line, and one gratuitous ARP (a broadcast: a bridge
# floods it to every port, so a frame leaking between domains would reach
# even a paused domain's taps, where the scenario counts frames).
status() {
  g "st role=$ROLE ip=$(addr) mac=$(cat /sys/class/net/eth0/address) $* end"
  arping -q -U -c 1 -I eth0 "$IP" >/dev/null 2>&1 &
}
# gone PID NAME: reports once that connection NAME's nc has exited.
gone() {
  kill -0 "$1" 2>/dev/null && return 1
  wait "$1"
  g "error the connection $2 ended (nc exited $?: $(cat /tmp/nc*.err 2>/dev/null | tr '\n' ' '))"
}

if [ "$ROLE" != a ]; then
  dead=
  while :; do
    if [ "$ROLE" = b ]; then status "rx=$(wc -c </tmp/rx)"; else status; fi
    [ -n "$dead" ] || { gone "$NCPID" "to $ROLE" && dead=1; }
    sleep 1
  done
fi

# a: wait until b and c answer, then open both connections once.
for peer in 10.78.0.2 10.78.0.3; do
  i=0
  until ping -c 1 -W 1 "$peer" >/dev/null 2>&1; do
    i=$((i + 1)); [ "$i" -lt 240 ] || fail "$peer never answered a ping"
    sleep 0.5
  done
done
echo 0 >/tmp/txn
(
  i=0
  while :; do
    head -c 1024 /dev/zero || exit
    i=$((i + 1))
    echo "$i" >/tmp/txn
    sleep 0.2
  done
) | nc 10.78.0.2 6001 >/dev/null 2>/tmp/nc-b.err &
BPID=$!
mkfifo /tmp/req /tmp/resp && exec 4<>/tmp/req 5<>/tmp/resp || fail "mkfifo for the requests failed"
nc 10.78.0.3 6002 </tmp/req >/tmp/resp 2>/tmp/nc-c.err &
CPID=$!
g "connected role=a end"

n=0 bdead= cdead= shown=
while :; do
  n=$((n + 1))
  echo "req $n" >&4
  # The answer may wait out a paused peer and TCP's retransmissions: read
  # until it comes (60 s at most), each wait 2 s, a byte at a time: when
  # its time runs out mid-line, busybox's `read -t` drops what it read of
  # the line (an answer whose first byte landed at a deadline came out as
  # 'eq 8'); `read -n 1` returns each byte it got.
  w=0 line=
  while :; do
    if IFS= read -t 2 -n 1 -r ch <&5; then
      if [ -n "$ch" ]; then
        line="$line$ch"
        continue
      fi
      [ "$line" = "req $n" ] && break
      g "error request $n was answered with '$line'"
      line=
    else
      w=$((w + 1))
      [ "$w" -lt 30 ] || { g "error request $n was not answered within 60 s"; break; }
      [ -n "$cdead" ] || { gone "$CPID" "to c" && cdead=1; }
    fi
  done
  # A status line once a second (uptime's whole seconds).
  read -r u _ </proc/uptime
  if [ "${u%.*}" != "$shown" ]; then
    shown=${u%.*}
    status "tx=$(cat /tmp/txn) rr=$n"
    [ -n "$bdead" ] || { gone "$BPID" "to b" && bdead=1; }
    [ -n "$cdead" ] || { gone "$CPID" "to c" && cdead=1; }
  fi
  sleep 0.2
done

# lab: description=k7d forks a 3-VM cluster on its private bridge (issue 16): in each of 2 forks a's TCP stream to b and its request/response loop with c keep flowing, same IPs and MACs, no frame crosses between forks or the source, nothing left
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun bridge sch_ingress cls_matchall act_gact
# lab: l1-bins=ip tc
#
# Issue 16, "Lab, real Linux guests". Three VMs a, b, c (stock Debian cloud
# kernel, 1 vCPU, 256 MiB, one NIC each) form cluster `cl`; k7d puts their
# taps on the cluster's private bridge. The guest (k7d-cluster.guest.sh):
# a streams to b over one TCP connection and runs a request/response loop
# with c over another, each printing a status line a second (ip, mac,
# counters). Through the daemon, this proves:
#  1. the cluster has a bridge whose ports are exactly its members' taps,
#     IPv6 off on all of them (the host sends nothing into it).
#  2. `k7d fork cl --count 2` makes clusters cl-f1 and cl-f2, each on a
#     bridge of its own whose ports are exactly its children's taps; every
#     child keeps its source member's MAC.
#  3. in every fork and in the source, a's requests (rr) and b's received
#     bytes (rx) go on from where the source was (no fresh boot, no
#     connection ended, no wrong answer), and every guest's eth0 has the
#     source's IP and MAC.
#  4. isolation: each of the three domains in turn is paused while the
#     other two run; over 3 s no frame is sent towards the paused domain's
#     guests (tc matchall counters on the egress of its taps stand still)
#     while the others' counters advance. Every guest broadcasts a
#     gratuitous ARP each second, which a bridge floods to all its ports:
#     a frame of one domain reaching another would show here. Then every
#     domain flows again.
#  5. cleanup: deleting fork cl-f1 takes its VMs, taps and bridge while the
#     source runs on; deleting cl and cl-f2 leaves no VM, bridge, tap,
#     record or memfd; the daemon exits 0 on SIGTERM with no ERROR.
# Timings are an emulated machine's (L1 is QEMU TCG, one vCPU for nine
# guests): bounds are loose on purpose.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-cluster
# shellcheck disable=SC2015  # "A && B || fail ...": fail exits
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
W=/tmp/k7d-cluster
st=$W/state sock=$W/k7d.sock DLOG=$W/daemon.log
rm -rf "$W" && mkdir -p "$W" || lab_fail "cannot make $W"
dpid='' relayed=
T0=$(lab_now)
# at: seconds since the scenario began (in the notes: where the time goes).
at() { lab_sub "$(lab_now)" "$T0"; }
kct() { _t=$1; shift; timeout -s KILL "$_t" "$LAB_BIN" --socket "$sock" "$@"; }
kc() { kct 60 "$@"; }
log_of() { echo "$st/vms/$1/serial.log"; }
# relay_logs: every VM's serial log to l2.log (once).
relay_logs() {
  [ -z "$relayed" ] || return 0
  relayed=1
  for _l in "$st"/vms/*/serial.log "$W"/logs/*.log; do
    [ -f "$_l" ] || continue
    echo "=== lab: cluster: serial log $_l" >/dev/ttyS1
    tr -d '\r' <"$_l" | tail -n 60 >/dev/ttyS1
    echo "=== lab: cluster: end" >/dev/ttyS1
  done
}
fail() {
  [ -z "$dpid" ] || ! lab_alive "$dpid" || lab_diag cluster "$dpid" "$(log_of a)"
  relay_logs
  [ ! -s "$DLOG" ] || echo "lab: k7d daemon log (tail): $(tail -n 5 "$DLOG" | tr '\n' ' ')"
  lab_fail "$*"
}
# last VM KEY: KEY's value in VM's last complete status line ("" without one).
last() {
  tr -d '\r' <"$(log_of "$1")" 2>/dev/null | grep -E '^LAB-GUEST st .* end$' | tail -n1 |
    sed -n "s/.* $2=\([^ ]*\).*/\1/p"
}
# first VM KEY: the same of the first complete status line.
first() {
  tr -d '\r' <"$(log_of "$1")" 2>/dev/null | grep -E 'LAB-GUEST st .* end$' | head -n1 |
    sed -n "s/.* $2=\([^ ]*\).*/\1/p"
}
# members CLUSTER: its member ids, in order (k7d cluster info's text).
# (asked once per cluster, as info_of below)
cinfo() { [ -s "$W/cinfo-$1.txt" ] || kc cluster info "$1" >"$W/cinfo-$1.txt" 2>&1; cat "$W/cinfo-$1.txt"; }
members() { cinfo "$1" | sed -n 's/^  \([^ ]*\) .*/\1/p'; }
bridge_of() { cinfo "$1" | sed -n 's/^bridge \([^:]*\):.*/\1/p'; }
# tap_of VM / mac_of VM: its NIC's tap and MAC, from `k7d info` (asked once
# per VM: a CLI call is slow on the emulated machine).
info_of() { [ -s "$W/info-$1.txt" ] || kc info "$1" >"$W/info-$1.txt" 2>&1 || fail "k7d info $1 failed: $(cat "$W/info-$1.txt")"; }
tap_of() { info_of "$1"; sed -n 's/.*tap \([^,]*\),.*/\1/p' "$W/info-$1.txt" | head -n1; }
mac_of() { info_of "$1"; sed -n 's/.*mac \([0-9a-f:]*\).*/\1/p' "$W/info-$1.txt" | head -n1; }
ports() { ip -o link show master "$1" | sed -n 's/^[0-9]*: \([^:@]*\).*/\1/p' | sort | tr '\n' ' '; }
# ipv6_off LINK: IPv6 is off on LINK (a kernel without IPv6 has it off everywhere).
ipv6_off() {
  [ -n "$1" ] || return 1
  [ -d /proc/sys/net/ipv6 ] || return 0
  [ "$(cat "/proc/sys/net/ipv6/conf/$1/disable_ipv6" 2>/dev/null)" = 1 ]
}
# sum_egress TAP...: the frames sent towards the guests on these taps (their
# egress matchall counters), in one tc process (tc is slow to start on the
# emulated machine).
sum_egress() {
  for _t in "$@"; do echo "filter show dev $_t egress"; done >"$W/tc-show.batch"
  tc -s -batch "$W/tc-show.batch" | sed -n 's/.*Sent [0-9]* bytes \([0-9]*\) pkt.*/\1/p' | awk '{s += $1} END {print s + 0}'
}
# count VM: one awk over VM's log (the lab's one vCPU runs the guests
# too: few processes per look): its first error line as "error: ...", else
# the counter of its last complete status line (a: rr, b: rx), else 0.
count() {
  awk '{ sub(/\r+$/, "") }
    /LAB-GUEST error / { if (e == "") e = $0 }
    /LAB-GUEST st .* end$/ { n = 0; for (i = 1; i <= NF; i++) if ($i ~ /^(rr|rx)=/) n = substr($i, 4) + 0; l = n }
    END { if (e != "") { sub(/.*LAB-GUEST error /, "", e); print "error: " e } else print l + 0 }' "$(log_of "$1")" 2>/dev/null || echo 0
}
# wait_flow SECS VM...: until every a among VMs answered 2 more requests
# and every b received more bytes than now (their counters).
wait_flow() {
  _secs=$1; shift
  _want=''
  for _v in "$@"; do
    _c=$(count "$_v")
    case $_c in error:*) fail "$_v: ${_c#error: }" ;; esac
    _want="$_want $_v:$_c"
  done
  _i=0
  while :; do
    _ok=1
    for _p in $_want; do
      _v=${_p%%:*} _was=${_p#*:}
      _now=$(count "$_v")
      case $_now in error:*) fail "$_v: ${_now#error: }" ;; esac
      # (a's counter counts requests, b's bytes: 2 more of either is flow)
      [ "$_now" -ge $((_was + 2)) ] || _ok=
    done
    [ -n "$_ok" ] && return 0
    _i=$((_i + 1))
    [ "$_i" -lt "$_secs" ] || return 1
    sleep 1
  done
}

# --- the daemon and the cluster ---------------------------------------------------
export K7D_DUMP_FILE=$W/k7d-dump
lab_daemon_start "$st" "$sock" "$DLOG"
for r in a b c; do
  kc create --id "$r" --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" --cmdline "$LAB_CMDLINE lab.role=$r" \
    --vcpus 1 --memory 256 --nic queues=1 >"$W/create-$r.out" 2>&1 || fail "k7d create $r failed: $(cat "$W/create-$r.out")"
done
kc cluster create cl a b c >"$W/cluster.out" 2>&1 || fail "k7d cluster create cl a b c failed: $(cat "$W/cluster.out")"
# (info_of in this shell: its fail exits the scenario; tap_of and mac_of run
# in command substitutions and read what it kept)
for r in a b c; do info_of "$r"; [ -n "$(tap_of "$r")" ] || fail "k7d info $r names no tap"; done
BR=$(bridge_of cl)
[ -n "$BR" ] || fail "cluster cl has no bridge: $(kc cluster info cl | tr '\n' ' ')"
want="$(for r in a b c; do tap_of "$r"; done | sort | tr '\n' ' ')"
[ "$(ports "$BR")" = "$want" ] || fail "bridge $BR's ports are '$(ports "$BR")', not the members' taps '$want'"
for l in "$BR" $want; do ipv6_off "$l" || fail "$l has IPv6 on: the host would send into the cluster's layer 2"; done
lab_note "1. cluster cl: bridge $BR, ports $want(IPv6 off on all)"
for r in a b c; do
  kc start "$r" >"$W/start.out" 2>&1 || fail "k7d start $r failed: $(cat "$W/start.out")"
done
# Until a has answers from c and b has bytes from a (boot of three guests
# on one emulated vCPU: ~30-60 s).
i=0
while :; do
  ca=$(count a) cb=$(count b) cc=$(count c)
  for p in "a:$ca" "b:$cb" "c:$cc"; do
    case ${p#*:} in error:*) fail "source ${p%%:*}: ${p#*: }" ;; esac
  done
  [ "$ca" -ge 3 ] && [ "$cb" -ge 2048 ] && break
  i=$((i + 1)); [ "$i" -lt 240 ] || fail "the source cluster did not get going within 240 s: a rr=$ca b rx=$cb"
  sleep 1
done
src_ip_a=$(last a ip) src_ip_b=$(last b ip) src_ip_c=$(last c ip)
lab_note "source running at $(at) s: a rr=$(last a rr) tx=$(last a tx), b rx=$(last b rx); ips $src_ip_a $src_ip_b $src_ip_c"

# --- 2. the fork --------------------------------------------------------------------
pre_rr=$(last a rr) pre_rx=$(last b rx)
kct 240 --json fork cl --count 2 >"$W/fork.json" 2>"$W/fork.err" || fail "k7d fork cl --count 2 failed: $(cat "$W/fork.err" "$W/fork.json" | tr '\n' ' ')"
grep -q '"cl-f1"' "$W/fork.json" && grep -q '"cl-f2"' "$W/fork.json" || fail "the fork did not name clusters cl-f1 and cl-f2: $(tr '\n' ' ' <"$W/fork.json")"
paused_ms=$(sed -n 's/.*"source_paused_ms": *\([0-9.]*\).*/\1/p' "$W/fork.json" | head -n1)
lab_metric cluster_fork.source_paused_ms "$paused_ms" ms
for c in cl cl-f1 cl-f2; do
  m=$(members "$c" | tr '\n' ' ')
  [ "$(echo "$m" | wc -w)" = 3 ] || fail "cluster $c has members '$m'"
  for v in $m; do info_of "$v"; [ -n "$(tap_of "$v")" ] && [ -n "$(mac_of "$v")" ] || fail "k7d info $v names no tap or MAC"; done
done
F1=$(members cl-f1 | tr '\n' ' ') F2=$(members cl-f2 | tr '\n' ' ')
bridges=''
for c in cl-f1 cl-f2; do
  b=$(bridge_of "$c")
  [ -n "$b" ] || fail "fork $c has no bridge"
  case " $BR $bridges " in *" $b "*) fail "fork $c's bridge $b is not its own" ;; esac
  bridges="$bridges $b"
  want="$(for v in $(members "$c"); do tap_of "$v"; done | sort | tr '\n' ' ')"
  [ "$(ports "$b")" = "$want" ] || fail "fork $c's bridge $b has ports '$(ports "$b")', not its children's taps '$want'"
  set -- $(members "$c")
  for r in a b c; do
    [ "$(mac_of "$1")" = "$(mac_of "$r")" ] || fail "child $1's MAC $(mac_of "$1") is not $r's $(mac_of "$r")"
    ipv6_off "$(tap_of "$1")" || fail "child $1's tap has IPv6 on"
    shift
  done
  lab_note "2. fork $c: members $(members "$c" | tr '\n' ' ')on bridge $b, ports $want"
done
lab_where "$sock" a b c $(members cl-f1) $(members cl-f2)
lab_note "2. where: $where"

# --- 3. every domain flows on, from the source's state ------------------------------
set -- $F1; f1a=$1 f1b=$2 f1c=$3
set -- $F2; f2a=$1 f2b=$2 f2c=$3
wait_flow 120 a b "$f1a" "$f1b" "$f2a" "$f2b" ||
  fail "not every domain flows after the fork: a rr=$(last a rr) b rx=$(last b rx); $f1a rr=$(last "$f1a" rr) $f1b rx=$(last "$f1b" rx); $f2a rr=$(last "$f2a" rr) $f2b rx=$(last "$f2b" rx)"
for v in $F1 $F2; do
  ! tr -d '\r' <"$(log_of "$v")" | grep -q 'LAB-GUEST net role' || fail "child $v configured its network anew: it booted instead of going on from the source"
done
for p in "$f1a:a" "$f1b:b" "$f1c:c" "$f2a:a" "$f2b:b" "$f2c:c"; do
  v=${p%%:*} r=${p#*:}
  [ "$(last "$v" ip)" = "$(last "$r" ip)" ] && [ -n "$(last "$v" ip)" ] || fail "child $v's eth0 has IP '$(last "$v" ip)', its source $r '$(last "$r" ip)'"
  [ "$(last "$v" mac)" = "$(last "$r" mac)" ] || fail "child $v's eth0 has MAC '$(last "$v" mac)', its source $r '$(last "$r" mac)'"
done
for v in "$f1a" "$f2a"; do
  fr=$(first "$v" rr)
  [ "$fr" -ge "$pre_rr" ] || fail "child $v's first rr=$fr is below the source's $pre_rr before the fork: it did not go on from the source"
done
for v in "$f1b" "$f2b"; do
  fr=$(first "$v" rx)
  [ "$fr" -ge "$pre_rx" ] || fail "child $v's first rx=$fr is below the source's $pre_rx before the fork"
done
lab_note "3. at $(at) s, after the fork: source a rr=$(last a rr) b rx=$(last b rx); cl-f1 $f1a rr=$(first "$f1a" rr)->$(last "$f1a" rr) $f1b rx=$(first "$f1b" rx)->$(last "$f1b" rx); cl-f2 $f2a rr=$(first "$f2a" rr)->$(last "$f2a" rr) $f2b rx=$(first "$f2b" rx)->$(last "$f2b" rx); every eth0 has its source's IP and MAC"

# --- 4. isolation: pause one domain, count frames sent towards it ---------------------
for v in a b c $F1 $F2; do
  t=$(tap_of "$v")
  echo "qdisc add dev $t clsact" >>"$W/tc-add.batch"
  echo "filter add dev $t egress matchall action ok" >>"$W/tc-add.batch"
  eval "TAP_$(echo "$v" | tr -c 'a-z0-9\n' '_')=$t"
done
tc -batch "$W/tc-add.batch" >"$W/tc-add.out" 2>&1 || fail "tc matchall counters on the taps failed: $(cat "$W/tc-add.out")"
taps() { for _v in "$@"; do eval "echo \$TAP_$(echo "$_v" | tr -c 'a-z0-9\n' '_')"; done; }
for d in cl cl-f1 cl-f2; do
  case $d in
    cl) mine="a b c" others="$F1 $F2" ;;
    cl-f1) mine="$F1" others="a b c $F2" ;;
    cl-f2) mine="$F2" others="a b c $F1" ;;
  esac
  for v in $mine; do kc pause "$v" >/dev/null 2>&1 || fail "k7d pause $v failed"; done
  sleep 0.5
  m0=$(sum_egress $(taps $mine)) o0=$(sum_egress $(taps $others))
  sleep 3
  m1=$(sum_egress $(taps $mine)) o1=$(sum_egress $(taps $others))
  for v in $mine; do kc resume "$v" >/dev/null 2>&1 || fail "k7d resume $v failed"; done
  [ "$m1" = "$m0" ] || fail "while $d was paused, $((m1 - m0)) frames were sent towards its guests: another domain's frames reach it"
  [ "$o1" -gt "$o0" ] || fail "while $d was paused the other domains sent nothing ($o0 -> $o1 frames): the check proves nothing"
  lab_note "4. $d paused 3 s (at $(at) s): frames towards its guests $m0 -> $m1; towards the others' $o0 -> $o1"
done
wait_flow 120 a b "$f1a" "$f1b" "$f2a" "$f2b" ||
  fail "not every domain flows after the isolation rounds: a rr=$(last a rr); $f1a rr=$(last "$f1a" rr); $f2a rr=$(last "$f2a" rr)"
lab_note "4. at $(at) s every domain flows again: a rr=$(last a rr), $f1a rr=$(last "$f1a" rr), $f2a rr=$(last "$f2a" rr)"

# --- 5. cleanup -----------------------------------------------------------------------
mkdir -p "$W/logs"
for v in a b c $F1 $F2; do cp "$(log_of "$v")" "$W/logs/$v.log" 2>/dev/null; done
b1=$(bridge_of cl-f1)
f1taps=$(taps $F1)
kc cluster delete cl-f1 >"$W/del.out" 2>&1 || fail "k7d cluster delete cl-f1 failed: $(cat "$W/del.out")"
[ ! -e "/sys/class/net/$b1" ] || fail "fork cl-f1's bridge $b1 is left after its delete"
for t in $f1taps; do [ ! -e "/sys/class/net/$t" ] || fail "fork cl-f1's tap $t is left after its delete"; done
wait_flow 60 a b || fail "the source stopped flowing after fork cl-f1 was deleted"
kc cluster delete cl >"$W/del.out" 2>&1 || fail "k7d cluster delete cl failed: $(cat "$W/del.out")"
kc cluster delete cl-f2 >"$W/del.out" 2>&1 || fail "k7d cluster delete cl-f2 failed: $(cat "$W/del.out")"
kc --json list >"$W/list.json" 2>&1 || fail "k7d --json list failed"
grep -q '"vms": \[\]' "$W/list.json" || fail "VMs are left: $(tr '\n' ' ' <"$W/list.json")"
kc cluster list >"$W/clist.out" 2>&1 || fail "k7d cluster list failed"
[ "$(wc -l <"$W/clist.out")" = 1 ] || fail "clusters are left: $(tr '\n' ' ' <"$W/clist.out")"
left_links=$(ip -o link show | sed -n 's/^[0-9]*: \(k7d[^:@]*\).*/\1/p' | tr '\n' ' ')
[ -z "$left_links" ] || fail "links are left: $left_links"
left=$(ls -A "$st/vms" "$st/clusters" 2>&1 | grep -v ':$' | grep -v '^$')
[ -z "$left" ] || fail "the state dir still holds: $(echo "$left" | tr '\n' ' ')"
memfds=$(for f in /proc/"$dpid"/fd/*; do readlink "$f"; done 2>/dev/null | grep -c memfd)
[ "$memfds" = 0 ] || fail "the daemon still holds $memfds memfds"
lab_daemon_stop "$DLOG"
relay_logs
lab_note "5. at $(at) s, cleanup: cl-f1 deleted with its bridge and taps while the source ran on; then cl and cl-f2: no VM, cluster, k7d link, record or memfd left; daemon exited 0"
lab_pass "k7d-cluster: 3-VM cluster forked twice on private bridges; TCP stream and request/response flow on in every fork with the source's IPs and MACs; no frame crosses domains; nothing left"

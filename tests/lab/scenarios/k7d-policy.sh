# lab: description=k7d NIC policy: a 9-queue NIC on a max_net_queues=8 node is refused, max_net_queues 0 and 65 refused at config load, no tap left behind; 8 queues accepted
# lab: default=yes
# lab: timeout=600
# lab: bin=required
# lab: guest-modules=virtio_pci virtio_net
# lab: l1-modules=tun vhost_net
# lab: l1-bins=ip
#
# Issue 4, the queue/vhost policy (--node-config FILE, JSON):
# - max_net_queues 8 and --nic tap=k7dlab0,queues=9: k7d exits 1 with
#   "9 queue pairs requested, this node allows at most 8 (max_net_queues)";
# - max_net_queues 0 (no NIC at all: refused at config load) and 65 (with a
#   NIC): exit 1 with "max_net_queues = N is out of range";
# - no refused start runs the guest or leaves the tap k7dlab0 behind;
# - the control: the same node with queues=8 on nic 0 and a defaulted nic 1
#   boots (the guest binds virtio-net), prints "vhost: off, queues: 8" and
#   "vhost: off, queues: 1" (vhost off by node default: 1 queue pair), and
#   both taps are gone after the guest's poweroff.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-policy
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
node() { printf '{"max_net_queues": %s, "vhost_default": false}\n' "$1" >"/tmp/node-$1.json"; }
node 8; node 0; node 65

# refused CASE WANT ARGS...: k7d must exit 1 at once, print WANT on stderr, run
# no guest and leave no tap.
refused() {
  _case=$1 _want=$2; shift 2
  timeout -s KILL 120 "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" --cmdline "$LAB_CMDLINE" \
    --vcpus 2 --memory 256 "$@" </dev/null >"/tmp/$_case.out" 2>"/tmp/$_case.err"
  _rc=$?
  { echo "=== lab: $_case: $LAB_BIN run ... $*"; cat "/tmp/$_case.out" "/tmp/$_case.err"; } >/dev/ttyS1
  [ "$_rc" = 1 ] || lab_fail "$_case: k7d exited $_rc, expected 1 (137: still running after 120 s): $(tail -n2 "/tmp/$_case.err" | tr '\n' ' ')"
  grep -qF "$_want" "/tmp/$_case.err" || lab_fail "$_case: stderr lacks '$_want': $(cat "/tmp/$_case.err")"
  grep -q "panicked" "/tmp/$_case.err" && lab_fail "$_case: k7d panicked: $(cat "/tmp/$_case.err")"
  grep -q "LAB-GUEST" "/tmp/$_case.out" && lab_fail "$_case: the guest ran"
  ip link show k7dlab0 >/dev/null 2>&1 && lab_fail "$_case: the tap k7dlab0 was left behind"
  lab_note "$_case: exit 1: $(grep -F "$_want" "/tmp/$_case.err" | head -n1)"
}

refused queues9 "9 queue pairs requested, this node allows at most 8 (max_net_queues)" \
  --node-config /tmp/node-8.json --nic tap=k7dlab0,queues=9
refused max0 "max_net_queues = 0 is out of range" --node-config /tmp/node-0.json
refused max65 "max_net_queues = 65 is out of range" --node-config /tmp/node-65.json --nic tap=k7dlab0

# The control: within the cap, it boots; a defaulted NIC gets 1 queue pair.
lab_run_l2 control "${LAB_L2_TIMEOUT:-240}" "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --node-config /tmp/node-8.json \
  --nic tap=k7dlab0,queues=8 --nic tap=k7dlab1
log=/tmp/l2-control.log
[ "$L2_RC" = 0 ] || lab_fail "control (queues=8 on a max 8 node): k7d exited $L2_RC: $(grep -v LAB-GUEST "$log" | tail -n3 | tr '\n' ' ')"
grep -q "LAB-GUEST end rc=0" "$log" || lab_fail "control: the guest script did not end with rc=0"
for want in "k7d: nic 0: tap k7dlab0, vhost: off, queues: 8" "k7d: nic 1: tap k7dlab1, vhost: off, queues: 1"; do
  grep -qF "$want" "$log" || lab_fail "control: k7d did not print '$want' (it printed: $(grep 'k7d: nic' "$log" | tr '\n' ' '))"
done
[ "$(grep -o ':0x0001' "$log" | wc -l)" = 2 ] || lab_fail "control: the guest does not see 2 virtio-net devices: $(lab_guest virtio control)"
for t in k7dlab0 k7dlab1; do
  ip link show "$t" >/dev/null 2>&1 && lab_fail "control: the tap $t is still there after k7d exited"
done
lab_note "control: queues=8 and a defaulted NIC booted: $(grep -F 'k7d: nic' "$log" | tr '\n' ';')"
lab_pass "k7d-policy: 9 > max 8 refused, max_net_queues 0 and 65 refused, no tap left; 8 queues and the 1-queue default accepted"

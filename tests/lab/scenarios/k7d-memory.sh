# lab: description=what a k7d VM costs in memory beyond its guest: the daemon's PSS with 0, 1 and 20 idle Linux VMs, guest RAM counted apart
# lab: default=yes
# lab: timeout=1200
# lab: bin=required
# lab: guest-modules=virtio_pci virtio-rng
#
# Issue 13: "VMM memory per VM: the daemon's PSS growth per idle Linux VM
# beyond the guest pages it touched, measured for 1 and 20 VMs" (goal
# <= 3 MiB per VM; anchors: Firecracker documents a few MiB per microVM,
# Kata ~123 MB per pod with virtiofsd). Through the daemon, in L1:
#   0. the daemon alone: its PSS (the sum over /proc/PID/smaps);
#   1. one idle Linux VM (1 vCPU, 128 MiB, virtio-rng; the cloud kernel
#      unpacked once, the busybox initramfs): the daemon's PSS, split into
#      guest RAM (the /memfd:k7d-ram-* mappings of /proc/PID/smaps) and the
#      rest, which is the VMM's (threads' stacks, device state, buffers);
#   2. twenty such VMs: the same.
# Reported: the VMM's part beyond the daemon alone, for 1 VM and per VM
# averaged over the 20 (the first included). Not counted: KVM's kernel memory per VM (vCPU state, shadow or nested
# page tables, the memslot's dirty bitmap), which PSS does not show.
# With LAB_JAIL=on (the default) the daemon's child processes are summed with
# it (its VM processes, spares and spawner): what a VM in a VM process of
# its own costs beyond its guest (issue 36's goal: <= 2.5 MiB).
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-memory
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
W=/tmp/k7d-memory st=/tmp/k7d-memory/state sock=/tmp/k7d-memory/k7d.sock DLOG=/tmp/k7d-memory/daemon.log
mkdir -p "$W"
dpid=
kc() { timeout -s KILL 60 "$LAB_BIN" --socket "$sock" "$@"; }
fail() {
  [ ! -s "$DLOG" ] || echo "lab: k7d daemon log (tail): $(tail -n 5 "$DLOG" | tr '\n' ' ')"
  [ -z "$dpid" ] || kill -9 "$dpid" 2>/dev/null
  lab_fail "$*"
}
# pss: "TOTAL_KIB RAM_KIB" of the daemon and its child processes (with
# LAB_JAIL=on its VM processes, spares and spawner: the daemon is their
# subreaper; with --jail off it has none): all their PSS, and that of
# their guest RAM mappings.
pss() {
  _procs="/proc/$dpid/smaps"
  for _s in /proc/[0-9]*/stat; do
    [ "$(sed 's/.*) //' "$_s" 2>/dev/null | cut -d' ' -f2)" = "$dpid" ] && _procs="$_procs ${_s%stat}smaps"
  done
  # shellcheck disable=SC2086
  cat $_procs 2>/dev/null | awk '/^[0-9a-f]+-[0-9a-f]+ / { ram = ($0 ~ /memfd:k7d-ram/) }
       /^Pss:/ { t += $2; if (ram) r += $2 }
       END { printf "%d %d\n", t, r }'
}
mib() { awk -v k="$1" 'BEGIN { printf "%.2f", k / 1024 }'; }
# up N...: waits (300 s) until each VM's serial log says the guest is idle.
up() {
  for id in "$@"; do
    i=0
    until grep -q "LAB-GUEST idle" "$st/vms/$id/serial.log" 2>/dev/null; do
      i=$((i + 1)); [ "$i" -lt 3000 ] || fail "VM $id did not come up within 300 s: $(tail -c 300 "$st/vms/$id/serial.log" 2>/dev/null)"
      sleep 0.1
    done
  done
}
create() {
  kc create --id "$1" --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" --cmdline "$LAB_CMDLINE" \
    --vcpus 1 --memory 128 --rng --start >"$W/create-$1.out" 2>&1 || fail "k7d create $1 failed: $(cat "$W/create-$1.out")"
}

lab_daemon_start "$st" "$sock" "$DLOG"
sleep 1
read -r p0 r0 <<EOF2
$(pss)
EOF2
lab_note "0. the daemon alone (--jail ${LAB_JAIL:-on}; with on, its spares and spawner too): PSS $(mib "$p0") MiB"

create m1
up m1
sleep 2
read -r p1 r1 <<EOF2
$(pss)
EOF2
v1=$((p1 - r1 - p0))
lab_note "1. one idle Linux VM: daemon PSS $(mib "$p1") MiB, of it guest RAM $(mib "$r1") MiB; the VMM's part beyond the daemon alone $(mib "$v1") MiB"

ids=
n=2
while [ "$n" -le 20 ]; do create "m$n"; ids="$ids m$n"; n=$((n + 1)); done
# shellcheck disable=SC2086
up $ids
sleep 2
read -r p20 r20 <<EOF2
$(pss)
EOF2
v20=$((p20 - r20 - p0))
running=$(kc list 2>/dev/null | awk 'NR > 1 && $NF == "running"' | grep -c .)
[ "$running" = 20 ] || fail "$running of 20 VMs are running: $(kc list 2>&1 | tr '\n' ' ')"
lab_note "2. twenty idle Linux VMs: daemon PSS $(mib "$p20") MiB, of it guest RAM $(mib "$r20") MiB ($(mib $((r20 / 20))) MiB per guest); the VMM's part beyond the daemon alone $(mib "$v20") MiB, $(mib $((v20 / 20))) MiB per VM (averaged over the 20)"
lab_metric k7d.daemon_pss_alone "$(mib "$p0")" MiB
lab_metric k7d.vmm_mib_1vm "$(mib "$v1")" MiB
lab_metric k7d.vmm_mib_per_vm_of_20 "$(mib $((v20 / 20)))" MiB
lab_metric k7d.guest_ram_mib_per_vm_of_20 "$(mib $((r20 / 20)))" MiB

for id in m1 $ids; do kc delete "$id" >/dev/null 2>&1 || fail "k7d delete $id failed"; done
left=$(kc list 2>&1 | tail -n +2 | grep -c .)
[ "$left" = 0 ] || fail "VMs left after delete: $(kc list 2>&1 | tr '\n' ' ')"
memfds=$(for f in /proc/"$dpid"/fd/*; do readlink "$f"; done 2>/dev/null | grep -c memfd)
[ "$memfds" = 0 ] || fail "the daemon still holds $memfds memfds"
lab_daemon_stop "$DLOG"
lab_pass "k7d-memory: beyond guest RAM, $(mib "$v1") MiB for 1 VM, $(mib $((v20 / 20))) MiB per VM averaged over 20 (goal <= 3 MiB)"

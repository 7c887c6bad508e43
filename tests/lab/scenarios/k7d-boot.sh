# lab: description=k7d boots the stock Debian cloud kernel in L1 with 2 vCPUs: poweroff, reboot, record, bad kernel
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest-modules=virtio_pci virtio-rng
#
# Issue 3's checks on a real guest: nproc=2, kernel version and uptime
# printed by the guest, a virtio-rng device bound by the stock driver and read,
# poweroff -> k7d exits 0 with "stopped (guest poweroff)", the same through
# the daemon with the record on disk saying so, a guest `reboot -f` reported
# as a reboot, and a non-kernel file refused before any vCPU runs.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-boot
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
lab_vmm k7d '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --rng'
lab_boot_series "${LAB_RUNS:-1}" k7d
log=/tmp/l2-k7d-1.log
grep -q "stopped (guest poweroff)" "$log" || lab_fail "k7d run did not report the guest poweroff"
grep -q "LAB-GUEST virtio=.*:0x0004" "$log" || lab_fail "the guest did not bind the virtio-rng device"
grep -q "LAB-GUEST hwrng=virtio_rng.0 bytes=16" "$log" || lab_fail "the guest could not read 16 bytes from virtio-rng"
lab_note "poweroff: k7d exited 0, stopped (guest poweroff); virtio-rng bound and read"

# A guest reboot -f is reported as a reboot.
lab_run_l2 k7d-reboot 240 "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
  --cmdline "$LAB_CMDLINE lab.end=reboot" --vcpus 2 --memory 256
[ "$L2_RC" = 0 ] || lab_fail "reboot run: k7d exited $L2_RC"
grep -q "LAB-GUEST rebooting" /tmp/l2-k7d-reboot.log || lab_fail "reboot run: the guest never rebooted"
grep -q "stopped (guest reboot)" /tmp/l2-k7d-reboot.log || lab_fail "reboot run: k7d did not report the guest reboot"
lab_note "reboot -f: k7d exited 0, stopped (guest reboot)"

# The same boot through the daemon (its default: the VM in a jailed VM
# process of its own, in a cgroup v2 leaf): the record on disk says why it
# stopped.
st=/tmp/k7d-state sock=/tmp/k7d.sock
lab_cgroup2
"$LAB_BIN" daemon --state-dir "$st" --socket "$sock" 2>/tmp/daemon.log &
dpid=$!
i=0
while ! "$LAB_BIN" --socket "$sock" list >/dev/null 2>&1; do
  i=$((i + 1)); [ "$i" -lt 300 ] || lab_fail "the k7d daemon did not come up: $(cat /tmp/daemon.log)"
  sleep 0.1
done
"$LAB_BIN" --socket "$sock" create --id lx --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --rng --start >/tmp/create.log 2>&1 ||
  lab_fail "daemon create failed: $(cat /tmp/create.log)"
i=0
until "$LAB_BIN" --socket "$sock" info lx 2>/dev/null | grep -q "stopped"; do
  i=$((i + 1)); [ "$i" -lt 2400 ] || lab_fail "the daemon's VM did not stop within 240 s"
  sleep 0.1
done
status=$("$LAB_BIN" --socket "$sock" info lx | head -n1)
cat "$st/vms/lx/serial.log" >/dev/ttyS1
grep -q "LAB-GUEST nproc=2" "$st/vms/lx/serial.log" || lab_fail "daemon VM: guest did not print nproc=2"
grep -q '"kind": "guest_poweroff"' "$st/vms/lx.json" || lab_fail "the record does not say guest_poweroff: $(cat "$st/vms/lx.json")"
[ "$status" = "vm lx: stopped (guest poweroff)" ] || lab_fail "daemon info says: $status"
"$LAB_BIN" --socket "$sock" delete lx >/dev/null || lab_fail "delete failed"
[ ! -e "$st/vms/lx.json" ] || lab_fail "delete left the record"
kill "$dpid"; wait "$dpid" 2>/dev/null
lab_note "daemon: $status; record kind guest_poweroff; deleted"

# A file that is not a kernel is refused before any vCPU runs, in one sentence.
if "$LAB_BIN" run --kernel /lab/lib.sh --vcpus 2 --memory 256 >/tmp/bad.out 2>/tmp/bad.err; then
  lab_fail "k7d accepted /lab/lib.sh as a kernel"
fi
[ "$(wc -l </tmp/bad.err)" = 1 ] || lab_fail "bad kernel: more than one line: $(cat /tmp/bad.err)"
grep -q "kernel /lab/lib.sh is not a bzImage or ELF kernel" /tmp/bad.err || lab_fail "bad kernel: $(cat /tmp/bad.err)"
grep -q "first guest exit" /tmp/bad.err && lab_fail "bad kernel: a vCPU ran"
lab_note "bad kernel: $(cat /tmp/bad.err)"
lab_pass "k7d-boot: nproc=2, poweroff, reboot, daemon record, bad kernel"

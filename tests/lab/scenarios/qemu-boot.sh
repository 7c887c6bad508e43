# lab: description=QEMU 7.2 + SeaBIOS (-kernel/-initrd) boots the stock Debian cloud kernel in L1, 2 vCPUs: the reference k7d is compared with
# lab: default=no
# lab: by-hand=by hand (for CI's time budget, ~118 s of L1): QEMU pc's boots alone; boot-compare boots the same QEMU line in CI, with this scenario's virtio-rng check
# lab: timeout=900
# lab: needs=qemu
# lab: guest-modules=virtio_pci virtio-rng
#
# Runs inside L1 (busybox sh). Boots the guest LAB_RUNS times (default 3) with
# the reference QEMU line (lab_vmm qemu in lib/l1-lib.sh); each must exit 0 with
# the guest printing nproc=2 and binding virtio-rng. Prints the medians.
. /lab/lib.sh

lab_note "$(qemu-system-x86_64 --version | head -n1)"
lab_boot_series "${LAB_RUNS:-3}" qemu
for r in $(seq 1 "${LAB_RUNS:-3}"); do
  grep -q "LAB-GUEST virtio=.*:0x0004" "/tmp/l2-qemu-$r.log" || lab_fail "qemu run $r: the guest did not bind virtio-rng"
done
lab_pass "qemu-boot: ${LAB_RUNS:-3} boots, nproc=2"

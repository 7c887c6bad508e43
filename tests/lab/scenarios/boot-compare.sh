# lab: description=boot-to-init of k7d next to QEMU + SeaBIOS, same kernel, initramfs and L1, interleaved runs
# lab: default=yes
# lab: timeout=1200
# lab: needs=qemu
# lab: bin=required
# lab: guest-modules=virtio_pci virtio-rng
#
# By hand: tests/lab/run.sh --bin target/release/k7d --runs 5 boot-compare
# Prints both medians and the ratios k7d/QEMU (issue 3's goal: <= 0.5 for
# spawn_to_init). Emulated-machine figures: meaningful only as a ratio.
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
lab_note "$(qemu-system-x86_64 --version | head -n1)"
lab_vmm k7d '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --rng'
lab_boot_series "${LAB_RUNS:-3}" k7d qemu
for m in spawn_to_init guest_init_uptime wall; do lab_ratio k7d qemu "$m"; done
lab_pass "boot-compare: ${LAB_RUNS:-3} boots each"

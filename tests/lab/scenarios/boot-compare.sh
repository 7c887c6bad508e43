# lab: description=boot-to-init of k7d next to QEMU pc + SeaBIOS and QEMU microvm (direct kernel boot), same kernel, initramfs, command line and L1, interleaved runs
# lab: default=yes
# lab: timeout=1200
# lab: exclusive=yes
# lab: needs=qemu
# lab: bin=required
# lab: guest-modules=virtio_pci virtio_mmio virtio-rng
#
# By hand: tests/lab/run.sh --bin target/release/k7d --runs 5 boot-compare
# Prints the medians and the ratios k7d/QEMU pc and k7d/QEMU microvm (goals,
# issue 13: <= 0.5 and <= 0.4 for spawn_to_init). microvm is the fair peer
# for a VMM without firmware: no SeaBIOS, the kernel loaded directly, its
# virtio-rng on virtio-mmio (described in its ACPI tables; the guest loads
# virtio_mmio). Emulated-machine figures: meaningful only as a ratio.
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
lab_note "$(qemu-system-x86_64 --version | head -n1)"
lab_vmm k7d '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --rng'
# k7d with no --cmdline: its own default (DEFAULT_CMDLINE: console=ttyS0
# reboot=k panic=1 quiet cryptomgr.notests no_timer_check).
lab_vmm k7d_default '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --vcpus 2 --memory 256 --rng'
lab_vmm microvm 'qemu-system-x86_64 -M microvm -accel kvm -cpu host -smp 2 -m 256
  -nodefaults -no-user-config -display none -serial stdio -no-reboot
  -kernel "$LAB_KERNEL" -initrd "$LAB_INITRD" -append "$LAB_CMDLINE"
  -device virtio-rng-device'
# k7d unpacks the bzImage's LZ4 payload once into its kernel cache and boots
# the ELF kernel (docs/linux-boot.md); the first k7d boot of the series pays
# the unpack. LAB_DECOMP=1 adds k7d booting the bzImage through the guest's
# decompressor (--no-kernel-cache), as QEMU does, to show the difference.
extra=
if [ "${LAB_DECOMP:-0}" = 1 ]; then
  lab_vmm k7d_decomp '"$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD"
  --cmdline "$LAB_CMDLINE" --vcpus 2 --memory 256 --rng --no-kernel-cache'
  extra=k7d_decomp
fi
# shellcheck disable=SC2086 # $extra: no name or one (L1's shell has no arrays)
lab_boot_series "${LAB_RUNS:-3}" k7d k7d_default $extra qemu microvm
# shellcheck disable=SC2086
lab_waterfall k7d k7d_default $extra qemu microvm
for m in spawn_to_init guest_init_uptime wall; do lab_ratio k7d qemu "$m"; lab_ratio k7d microvm "$m"; done
for m in spawn_to_init guest_init_uptime; do lab_ratio k7d_default qemu "$m"; lab_ratio k7d_default microvm "$m"; done
lab_pass "boot-compare: ${LAB_RUNS:-3} boots each"

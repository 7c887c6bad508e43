# lab: description=k7d virtio-blk: mkfs.ext4 + 64 MiB + sync on a raw image read back by L1; an erofs image read-only, sums checked, writes refused in the guest
# lab: default=yes
# lab: timeout=600
# lab: bin=required
# lab: guest-modules=virtio_pci virtio_blk erofs
# lab: l1-modules=loop crc32c_generic ext4
# lab: l2-bins=mkfs.ext4
# lab: prepare=k7d-blk
#
# Issue 4, "Lab, real Linux guest", virtio-blk:
# - a 256 MiB sparse raw image as /dev/vda (--disk PATH): the guest runs
#   mkfs.ext4, mounts it, writes 64 MiB of random data, syncs, reads it back and
#   unmounts; after k7d exits, L1 loop-mounts the image and finds the same bytes;
# - ro.erofs (built on the host by k7d-blk.prepare.sh, with ro.manifest) as
#   /dev/vdb (--disk PATH,ro): it mounts, every file's sha256 matches the
#   manifest, a file write fails with EROFS and a raw write to the device is
#   refused, in the guest; the guest goes on, k7d exits 0, the image is unchanged.
# The guest script is k7d-blk.guest.sh. qemu-blk runs this file with QEMU as the
# VMM (BLK_VMM=qemu): the reference for the guest script and the checks.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-blk
. /lab/lib.sh

VMM=${BLK_VMM:-k7d}
# LAB_BLK_MIB of random data through ext4 (default 16: many requests, both
# queues' rings wrap; write throughput belongs in benches/).
MIB=${LAB_BLK_MIB:-16}
IMG=/tmp/disk.img RO=/lab/files/ro.erofs MANIFEST=/lab/files/ro.manifest
LOG=/tmp/l2-blk.log
{ [ -s "$RO" ] && [ -s "$MANIFEST" ]; } || lab_fail "no $RO / $MANIFEST (prepare=k7d-blk)"
rm -f "$IMG"
truncate -s 268435456 "$IMG" || lab_fail "cannot create the 256 MiB image $IMG"
ro_sum=$(sha256sum <"$RO" | cut -d' ' -f1)
ro_bytes=$(wc -c <"$RO")

case $VMM in
  k7d)
    [ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
    lab_run_l2 blk "${LAB_L2_TIMEOUT:-300}" "$LAB_BIN" run --kernel "$LAB_KERNEL" --initrd "$LAB_INITRD" \
      --cmdline "$LAB_CMDLINE lab.mib=$MIB" --vcpus 2 --memory 512 --disk "$IMG" --disk "$RO,ro" ;;
  k7d-jail)
    # The same VM built by `k7d daemon --jail on` in a jailed VM process of
    # its own: the daemon opens the kernel, initrd, both images and the
    # serial log and hands them over as descriptors (the process has no
    # filesystem); k7d-jail.l1.sh follows the serial log as the console.
    [ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
    lab_run_l2 blk "${LAB_L2_TIMEOUT:-300}" sh /lab/files/k7d-jail.l1.sh "$LAB_BIN" --kernel "$LAB_KERNEL" \
      --initrd "$LAB_INITRD" --cmdline "$LAB_CMDLINE lab.mib=$MIB" --vcpus 2 --memory 512 --disk "$IMG" --disk "$RO,ro" ;;
  qemu)
    lab_note "$(qemu-system-x86_64 --version | head -n1)"
    lab_run_l2 blk "${LAB_L2_TIMEOUT:-300}" qemu-system-x86_64 -accel kvm -cpu host -machine pc -smp 2 -m 512 \
      -nodefaults -no-user-config -display none -serial stdio -no-reboot \
      -kernel "$LAB_KERNEL" -initrd "$LAB_INITRD" -append "$LAB_CMDLINE lab.mib=$MIB" \
      -drive "file=$IMG,if=virtio,format=raw" -drive "file=$RO,if=virtio,format=raw,readonly=on" ;;
  *) lab_fail "unknown BLK_VMM=$VMM" ;;
esac

# The guest's own verdict first: its first error says most.
err=$(sed -n 's/.*LAB-GUEST error //p' "$LOG" | head -n1)
[ -z "$err" ] || lab_fail "guest: $err"
[ "$L2_RC" != 137 ] || lab_fail "$VMM killed after ${LAB_L2_TIMEOUT:-300} s: $(grep -v LAB-GUEST "$LOG" | tail -n3 | tr '\n' ' ')"
[ "$L2_RC" = 0 ] || lab_fail "$VMM exited $L2_RC: $(grep -v LAB-GUEST "$LOG" | tail -n3 | tr '\n' ' ')"
grep -q "LAB-GUEST blk-done=yes" "$LOG" || lab_fail "the guest script did not finish"
grep -q "LAB-GUEST end rc=0" "$LOG" || lab_fail "the guest script did not end with rc=0"
[ "$VMM" = qemu ] || grep -q "stopped (guest poweroff)" "$LOG" || lab_fail "k7d did not report the guest poweroff"
[ "$VMM" != k7d-jail ] || lab_jail_check "$IMG" "$RO"

# What the guest saw of the two devices.
[ "$(lab_guest vda-sectors blk)" = 524288 ] || lab_fail "guest /dev/vda has $(lab_guest vda-sectors blk) sectors, expected 524288 (256 MiB)"
[ "$(lab_guest vda-ro blk)" = 0 ] || lab_fail "guest /dev/vda is read-only"
[ "$(lab_guest vdb-sectors blk)" = "$((ro_bytes / 512))" ] ||
  lab_fail "guest /dev/vdb has $(lab_guest vdb-sectors blk) sectors, expected $((ro_bytes / 512)) (ro.erofs)"
[ "$(lab_guest vdb-ro blk)" = 1 ] || lab_fail "guest /dev/vdb is not read-only (/sys/block/vdb/ro=$(lab_guest vdb-ro blk)): the device must offer VIRTIO_BLK_F_RO"

# /dev/vda: the guest wrote 64 MiB, read the same back; L1 reads the same bytes from the image.
gsum=$(lab_guest rw-sha blk)
[ ${#gsum} = 64 ] || lab_fail "the guest printed no sha256 of its $MIB MiB file"
[ "$(lab_guest rw-bytes blk)" = $((MIB * 1048576)) ] || lab_fail "the guest's file has $(lab_guest rw-bytes blk) bytes, expected $((MIB * 1048576))"
[ "$(lab_guest rw-readback-sha blk)" = "$gsum" ] || lab_fail "the guest read back other bytes than it wrote (after drop_caches): $(lab_guest rw-readback-sha blk) != $gsum"
[ "$(wc -c <"$IMG")" = 268435456 ] || lab_fail "the image changed size: $(wc -c <"$IMG") bytes"
mkdir -p /mnt/check
mount -t ext4 -o loop,ro "$IMG" /mnt/check || lab_fail "L1 cannot loop-mount the image the guest formatted"
hsum=$(sha256sum </mnt/check/f | cut -d' ' -f1)
hbytes=$(wc -c </mnt/check/f)
umount /mnt/check
[ "$hsum" = "$gsum" ] || lab_fail "the image holds other bytes than the guest wrote: L1 $hsum ($hbytes bytes), guest $gsum"
lab_note "vda: ext4 + $MIB MiB written and synced by the guest; L1 loop-mount reads the same sha256 $gsum"
lab_metric blk.mib "$MIB" MiB
lab_metric blk.guest_write_sync_s "$(lab_guest rw-write-sync-s blk)" s

# /dev/vdb: every manifest file, same sums; writes refused in the guest; the image untouched.
n=0
while IFS= read -r line; do
  grep -qF "LAB-GUEST erofs-file $line" "$LOG" || lab_fail "erofs: the guest did not read '$line' (manifest)"
  n=$((n + 1))
done <"$MANIFEST"
seen=$(grep -c "LAB-GUEST erofs-file " "$LOG")
[ "$seen" = "$n" ] || lab_fail "erofs: the guest found $seen files, the manifest lists $n"
grep -q "LAB-GUEST erofs-write=refused" "$LOG" || lab_fail "erofs: the guest's write was not refused"
grep -q "LAB-GUEST erofs-write-error .*Read-only file system" "$LOG" ||
  lab_fail "erofs: the write failed, but not with EROFS: $(sed -n 's/.*erofs-write-error //p' "$LOG")"
grep -q "LAB-GUEST vdb-raw-write=refused" "$LOG" || lab_fail "vdb: a raw write was not refused"
[ "$(lab_guest erofs-after-refusals-hello-sha blk)" = "$(grep ' hello.txt$' "$MANIFEST" | cut -d' ' -f1)" ] ||
  lab_fail "vdb: reads after the refused writes return other bytes"
[ "$(sha256sum <"$RO" | cut -d' ' -f1)" = "$ro_sum" ] || lab_fail "ro.erofs changed on the L1 side"
lab_note "vdb: erofs read-only, $n files match ro.manifest; file write: $(sed -n 's/.*erofs-write-error //p' "$LOG" | head -n1); raw write: $(sed -n 's/.*vdb-raw-write-error //p' "$LOG" | head -n1); image unchanged"
lab_note "timings of an emulated machine (L1 is QEMU TCG): not performance figures"
lab_pass "$VMM-blk: ext4 $MIB MiB round trip through the image, erofs read-only with matching sums, writes refused in the guest"

# The guest of k7d-blk (and qemu-blk), busybox sh after /init loaded
# virtio_pci, virtio_blk and erofs. The VMM gives it
#   /dev/vda  a 256 MiB raw image, read-write (sparse, empty)
#   /dev/vdb  ro.erofs, read-only (files listed in ro.manifest on the L1 side)
# It prints LAB-GUEST lines the scenario checks; "LAB-GUEST error ..." and a
# non-zero rc on the first thing that goes wrong. mkfs.ext4 is e2fsprogs'
# (l2-bins). Every refused write is refused inside the guest: the script goes
# on, and the VMM must keep running.
g() { echo "LAB-GUEST $*"; }
fail() { g "error $*"; exit 1; }
now() { read -r _n _ </proc/uptime; echo "$_n"; }

for d in vda vdb; do
  [ -e "/sys/block/$d" ] || fail "no /dev/$d (virtio-blk not bound: $(cd /sys/block && echo *))"
  g "$d-sectors=$(cat "/sys/block/$d/size")"
  g "$d-ro=$(cat "/sys/block/$d/ro")"
done
mkdir -p /mnt/rw /mnt/ro

# /dev/vda: ext4, lab.mib= MiB (kernel command line, default 16) of random data, sync; read back after dropping caches.
mkfs.ext4 -q -F /dev/vda >/tmp/mkfs.log 2>&1 || fail "mkfs.ext4 /dev/vda failed: $(tail -n3 /tmp/mkfs.log)"
mount -t ext4 /dev/vda /mnt/rw || fail "mount -t ext4 /dev/vda failed"
t0=$(now)
# The sum of the stream as generated, before it touches the disk.
MIB=$(sed -n 's/.*[[:space:]]lab\.mib=\([0-9]*\).*/\1/p' </proc/cmdline | tr -d '\n')
sum=$(head -c $((${MIB:-16} * 1048576)) /dev/urandom | tee /mnt/rw/f | sha256sum | cut -d' ' -f1)
sync || fail "sync failed"
t1=$(now)
g "rw-sha=$sum"
g "rw-bytes=$(wc -c </mnt/rw/f)"
g "rw-write-sync-s=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}')"
echo 3 >/proc/sys/vm/drop_caches
g "rw-readback-sha=$(sha256sum /mnt/rw/f | cut -d' ' -f1)"
umount /mnt/rw || fail "umount /dev/vda failed"
g "rw-umounted=yes"

# /dev/vdb: erofs, read-only. Every file's sum ("<sum>  <path>", as in ro.manifest).
mount -t erofs -o ro /dev/vdb /mnt/ro || fail "mount -t erofs /dev/vdb failed"
(cd /mnt/ro && find . -type f | sed 's|^\./||' | sort | while read -r f; do
  echo "LAB-GUEST erofs-file $(sha256sum "$f")"
done)
# A write there fails in the guest (EROFS) and nothing else happens.
# (The shell reports a failed redirection: catch its stderr around the block.)
if { echo "written by the guest" >/mnt/ro/new-file; } 2>/tmp/werr; then
  fail "writing a file on the erofs mount succeeded"
fi
g "erofs-write=refused"
g "erofs-write-error $(cat /tmp/werr)"
umount /mnt/ro || fail "umount /dev/vdb failed"
# The block device itself is read-only (VIRTIO_BLK_F_RO): a raw write is refused too.
if dd if=/dev/zero of=/dev/vdb bs=4096 count=1 conv=fsync 2>/tmp/derr; then
  fail "a raw write to the read-only /dev/vdb succeeded"
fi
g "vdb-raw-write=refused"
g "vdb-raw-write-error $(grep -v records /tmp/derr | head -n1)"
# Still alive and the device still serves reads.
mount -t erofs -o ro /dev/vdb /mnt/ro || fail "erofs remount after the refused writes failed"
g "erofs-after-refusals-hello-sha=$(sha256sum /mnt/ro/hello.txt | cut -d' ' -f1)"
umount /mnt/ro
g "blk-done=yes"

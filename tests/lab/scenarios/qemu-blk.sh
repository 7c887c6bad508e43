# lab: description=reference for k7d-blk: the same guest script and checks with QEMU 7.2 (-drive if=virtio)
# lab: default=no
# lab: by-hand=by hand: QEMU's reference figures for k7d-blk, a comparison read by a person (k7d-blk's own checks run in CI)
# lab: timeout=900
# lab: needs=qemu
# lab: guest=k7d-blk
# lab: guest-modules=virtio_pci virtio_blk erofs
# lab: l1-modules=loop crc32c_generic ext4
# lab: l2-bins=mkfs.ext4
# lab: prepare=k7d-blk
# lab: files=tests/lab/scenarios/k7d-blk.sh
#
# Proves the guest script, the erofs image and every check of k7d-blk against
# Debian's QEMU (virtio-blk-pci, readonly=on for the erofs image). Not in CI.
# By hand: tests/lab/run.sh qemu-blk
# shellcheck disable=SC2034  # read by the sourced scenario
BLK_VMM=qemu
# shellcheck source=k7d-blk.sh
. /lab/files/k7d-blk.sh

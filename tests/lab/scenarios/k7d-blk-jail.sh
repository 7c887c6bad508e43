# lab: description=k7d-blk with the VM in a jailed VM process of `k7d daemon --jail on`: kernel, initrd, both disks and the serial log handed over as descriptors; the same guest script and checks
# lab: default=yes
# lab: timeout=600
# lab: bin=required
# lab: guest=k7d-blk
# lab: guest-modules=virtio_pci virtio_blk erofs
# lab: l1-modules=loop crc32c_generic ext4
# lab: l2-bins=mkfs.ext4
# lab: prepare=k7d-blk
# lab: files=tests/lab/scenarios/k7d-blk.sh tests/lab/scenarios/k7d-jail.l1.sh
#
# Issue 36: a Linux guest with disks in a VM process. The VM process has an
# empty root and no filesystem, so every file the VM needs arrives open from
# the daemon. k7d-blk's guest script and checks, plus what the VM process was
# while the guest ran (uid, no_new_privs, capabilities, seccomp, root, mount
# namespace, its descriptors).
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-blk-jail
# shellcheck disable=SC2034  # read by the sourced scenario
BLK_VMM=k7d-jail
# shellcheck source=k7d-blk.sh
. /lab/files/k7d-blk.sh

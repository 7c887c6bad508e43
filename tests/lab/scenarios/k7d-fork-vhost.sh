# lab: description=k7d-fork with a vhost-net NIC: the first fork switches the kernel's dirty log on, both NICs stay on vhost-net with their own taps and the same MAC, and every k7d-fork check holds
# lab: default=yes
# lab: timeout=900
# lab: bin=required
# lab: guest=k7d-fork
# lab: guest-modules=virtio_pci virtio_blk virtio_net
# lab: l1-modules=tun vhost_net
# lab: files=tests/lab/scenarios/k7d-fork.sh
#
# The same guest and checks as k7d-fork, with `--nic vhost=on`: the guest's
# virtio_net driver brings the NIC up, so the kernel serves its rings when the
# source is forked. The fork pauses the device (vhost detached), switches the
# kernel's dirty log on (VHOST_F_LOG_ALL from the resume on), and the child
# gets its own tap on vhost-net with the source's MAC.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-fork-vhost
# One vCPU here (k7d-fork forks a 2-vCPU guest): with two, L2's IPI waits
# (smp_call_function_many_cond) on L1's one emulated CPU were where QEMU's
# nested SVM froze most often (CHALLENGES.md, "The lab's stalls").
# shellcheck disable=SC2034  # read by the sourced scenario
FORK_NIC=vhost=on
# shellcheck disable=SC2034  # read by the sourced scenario
FORK_VCPUS=1
# shellcheck source=k7d-fork.sh
. /lab/files/k7d-fork.sh

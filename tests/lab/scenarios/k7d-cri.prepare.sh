#!/usr/bin/env bash
# lab: packages=umoci
# Host side of k7d-cri, run by run.sh as "prepare=k7d-cri" with an empty
# output folder; cached (see prepared in lib/host.sh). Writes:
#   pause-oci.tar  the pod sandbox ("pause") image, built here: no registry
#                  is reachable. An OCI image archive of one layer: the lab's
#                  busybox-static as /bin/busybox and nothing else;
#                  Entrypoint ["/bin/busybox", "sleep", "2147483647"] (the
#                  pause process: it only holds the pod's namespaces, and
#                  containerd stops it with SIGKILL). Its index names the
#                  manifest "1": import it with ctr -n k8s.io images import
#                  --base-name docker.io/library/k7d-pause to get
#                  docker.io/library/k7d-pause:1 (containerd's sandbox_image).
# The containers' image is k7d-shim.prepare.sh's busybox-oci.tar (the
# scenario names both: prepare=k7d-shim k7d-cri).
set -euo pipefail
out=$1
BB=${LAB_BUSYBOX:?run by run.sh, which sets LAB_BUSYBOX}
[[ -x $BB ]] || { echo "k7d-cri.prepare: no busybox at $BB" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"/{bin,dev,proc,sys,etc}
cp "$BB" "$root/bin/busybox"
chmod 0755 "$root/bin/busybox"
# One layer, every entry owned by root, fixed times: the same inputs give the
# same layer digest.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$work/layer.tar" .
img=$work/oci
umoci init --layout "$img"
umoci new --image "$img:1"
umoci raw add-layer --image "$img:1" "$work/layer.tar"
umoci config --image "$img:1" --os linux --architecture amd64 \
  --config.entrypoint /bin/busybox --config.entrypoint sleep --config.entrypoint 2147483647
umoci gc --layout "$img"
tar --sort=name --owner=0 --group=0 --numeric-owner -C "$img" -cf "$out/pause-oci.tar" .
echo "k7d-cri.prepare: pause-oci.tar $(stat -c %s "$out/pause-oci.tar") bytes" >&2

#!/usr/bin/env bash
# Installs what the nested lab needs on the host (CI runs this; idempotent).
# The kernels and busybox that go into the images are not installed: run.sh
# fetches them with apt-get download into $K7D_LAB_CACHE.
set -euo pipefail
# erofs-utils: mkfs.erofs for k7d-blk's read-only image (k7d-blk.prepare.sh);
# e2fsprogs: mkfs.ext4, copied into the k7d-blk guest (l2-bins).
# containerd, runc: copied into L1 by k7d-shim (l1-bins); crun: the pod
# initramfs's OCI runtime (mkinitramfs.sh); umoci: k7d-shim.prepare.sh builds the OCI image with it. Not
# busybox-static: it conflicts with Debian's busybox, so the image takes the
# lab's cached busybox-static instead ($LAB_BUSYBOX).
PKGS=(qemu-system-x86 cpio kmod xz-utils zstd iproute2 util-linux coreutils erofs-utils e2fsprogs containerd runc crun umoci)
[[ $EUID -eq 0 ]] || { echo "setup.sh: run as root (apt-get install)" >&2; exit 2; }
missing=()
for p in "${PKGS[@]}"; do
  [[ $(dpkg-query -W -f '${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || missing+=("$p")
done
# The lab resolves package versions with apt-cache: lists must be present.
if [[ ${#missing[@]} -gt 0 || -z $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -print -quit) ]]; then
  timeout 600 apt-get update -q
fi
if [[ ${#missing[@]} -gt 0 ]]; then
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
mkdir -p "${K7D_LAB_CACHE:-/var/cache/k7d-lab}"
echo "lab setup: ok ($(qemu-system-x86_64 --version | head -n1))"

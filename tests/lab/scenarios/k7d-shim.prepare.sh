#!/usr/bin/env bash
# lab: packages=umoci
# Host side of k7d-shim, run by run.sh as "prepare=k7d-shim" with an empty
# output folder; cached (see prepared in lib/host.sh). Writes:
#   busybox-oci.tar  an OCI image archive (an OCI layout, tarred) of one layer:
#                    /bin/busybox and a link per applet, /etc/passwd,
#                    /etc/group, /etc/k7d-image-marker ("from-the-image");
#                    Cmd ["/bin/sh"], Env PATH. Its index names the manifest
#                    "1" (org.opencontainers.image.ref.name): import it with
#                    ctr images import --base-name docker.io/library/k7d-busybox
#                    to get docker.io/library/k7d-busybox:1.
# Busybox is the lab's busybox-static ($LAB_BUSYBOX, from the lab cache: the
# package conflicts with Debian's busybox, so setup.sh does not install it).
set -euo pipefail
out=$1
BB=${LAB_BUSYBOX:?run by run.sh, which sets LAB_BUSYBOX}
[[ -x $BB ]] || { echo "k7d-shim.prepare: no busybox at $BB" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"/{bin,etc,tmp,root,proc,sys,dev}
chmod 1777 "$root/tmp"
cp "$BB" "$root/bin/busybox"
chmod 0755 "$root/bin/busybox"
for a in $("$BB" --list); do
  [[ $a == busybox || -e $root/bin/$a ]] || ln -s busybox "$root/bin/$a"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
printf 'from-the-image\n' >"$root/etc/k7d-image-marker"
# One layer, every entry owned by root, fixed times: the same inputs give the
# same layer digest.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$work/layer.tar" .
img=$work/oci
umoci init --layout "$img"
umoci new --image "$img:1"
umoci raw add-layer --image "$img:1" "$work/layer.tar"
umoci config --image "$img:1" --os linux --architecture amd64 \
  --config.cmd /bin/sh --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
umoci gc --layout "$img"
tar --sort=name --owner=0 --group=0 --numeric-owner -C "$img" -cf "$out/busybox-oci.tar" .
echo "k7d-shim.prepare: busybox-oci.tar $(stat -c %s "$out/busybox-oci.tar") bytes, $("$BB" --list | wc -l) applets" >&2

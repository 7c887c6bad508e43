#!/usr/bin/env bash
# lab: packages=erofs-utils
# Host side of k7d-blk (and qemu-blk), run by run.sh as "prepare=k7d-blk" with an
# empty output folder; cached by a hash of this file (see prepared in
# lib/host.sh). Writes:
#   ro.erofs     a read-only erofs image (mkfs.erofs, uncompressed) of a small
#                tree of generated files: text, random data, a size that is not
#                a multiple of the block size, a nested folder, an empty file
#   ro.manifest  their sha256 sums, sha256sum's format ("<sum>  <path>", the
#                path relative to the image root, sorted)
set -euo pipefail
out=$1
PATH=$PATH:/usr/sbin:/sbin
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
mkdir -p "$src/sub/deeper"
printf 'k7d lab: a read-only erofs image on virtio-blk\n' >"$src/hello.txt"
head -c 1048576 /dev/urandom >"$src/random-1m.bin"
head -c 3145851 /dev/urandom >"$src/sub/random-3m-odd.bin"
head -c 4097 /dev/urandom >"$src/sub/deeper/small.bin"
: >"$src/sub/empty"
(cd "$src" && find . -type f | sed 's|^\./||' | LC_ALL=C sort | xargs sha256sum) >"$out/ro.manifest"
mkfs.erofs --quiet -T0 --all-root "$out/ro.erofs" "$src"
[[ $(wc -l <"$out/ro.manifest") -eq 5 && -s $out/ro.erofs ]]
echo "k7d-blk.prepare: ro.erofs $(stat -c %s "$out/ro.erofs") bytes, $(wc -l <"$out/ro.manifest") files" >&2

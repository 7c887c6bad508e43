#!/usr/bin/env bash
# Builds the pod VM's initramfs: the guest agent as /init, the OCI runtime
# (crun, else runc), and the kernel modules the agent loads.
#
#   guest/agent/mkinitramfs.sh --kernel-tree DIR --krel KREL --agent PATH [--runtime PATH] --out FILE
#
#   --kernel-tree DIR  a root holding lib/modules/KREL or usr/lib/modules/KREL
#                      with a modules.dep ("/" on a node)
#   --krel KREL        the pod VM kernel's release (uname -r)
#   --agent PATH       the k7d-agent binary: /init
#   --runtime PATH     the OCI runtime (runc's command line), at /usr/sbin/<its
#                      name> (default: crun on PATH, else runc; --runc is the
#                      same option)
#   --out FILE         the archive: cpio newc, uncompressed, every file owned 0:0
#
# crun first: in a pod VM a container starts 4-5 times faster with it than
# with runc, whose Go runtime starts for `runc create`, its `runc init` child
# and `runc start` (CHALLENGES.md, "Containers started slowly in the pod
# VM"). The agent takes the first of crun and runc it finds.
#
# Contents: /init (debug info stripped when `strip` exists) and
# /usr/sbin/crun (or runc) with the shared libraries ldd names (under
# usr/lib*, with the lib -> usr/lib and lib64 -> usr/lib64 links); the empty
# folders /proc /sys /dev /run /tmp /etc /var; the modules below and their
# dependencies, decompressed, in /lib/modules-k7d/, with their load order
# (dependencies first, one file name per line) in /lib/modules-k7d/order.
# Modules built into the kernel (modules.builtin) are left out; a module that
# is neither built in nor in modules.dep is an error.
# Needs: bash, cpio, ldd, find, sort; xz/zstd/gzip for compressed modules.
set -euo pipefail

MODULES=(virtio_pci virtio_blk vmw_vsock_virtio_transport erofs overlay ext4)
OPTIONAL_MODULES=(virtio_net af_packet)  # taken when the kernel has them as modules

die() { printf 'mkinitramfs: error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '5,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

TREE='' KREL='' AGENT='' RUNTIME='' OUT=''
while [[ $# -gt 0 ]]; do
  case $1 in
    --kernel-tree) TREE=${2:?}; shift 2 ;;
    --krel) KREL=${2:?}; shift 2 ;;
    --agent) AGENT=${2:?}; shift 2 ;;
    --runtime | --runc) RUNTIME=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    *) printf 'mkinitramfs: unknown argument %s\n' "$1" >&2; usage ;;
  esac
done
[[ -n $TREE && -n $KREL && -n $AGENT && -n $OUT ]] || usage
[[ -n $RUNTIME ]] || RUNTIME=$(command -v crun || command -v runc) || die "neither crun nor runc on PATH (give --runtime PATH)"
[[ -x $AGENT && -f $AGENT ]] || die "--agent $AGENT is not an executable file"
[[ -x $RUNTIME && -f $RUNTIME ]] || die "--runtime $RUNTIME is not an executable file"
MDIR=$TREE/lib/modules/$KREL
[[ -f $MDIR/modules.dep ]] || MDIR=$TREE/usr/lib/modules/$KREL
[[ -f $MDIR/modules.dep ]] || die "no modules.dep in $TREE/lib/modules/$KREL or $TREE/usr/lib/modules/$KREL (run depmod)"

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{proc,sys,dev,run,tmp,etc,var,usr/lib,usr/lib64,usr/sbin}
ln -s usr/lib "$STAGE/lib" && ln -s usr/lib64 "$STAGE/lib64"
MODOUT=$STAGE/usr/lib/modules-k7d  # /lib/modules-k7d through the lib link
mkdir -p "$MODOUT"

# stage_elf FILE AS: FILE at AS in the image, with the libraries ldd names.
stage_elf() {
  local file=$1 as=$2 lib rel
  mkdir -p "$STAGE/$(dirname "$as")"
  cp -L "$file" "$STAGE/$as"
  chmod 0755 "$STAGE/$as"
  while read -r lib; do
    [[ -e $lib ]] || continue
    case $lib in /lib/* | /lib64/*) rel=usr$lib ;; *) rel=${lib#/} ;; esac
    mkdir -p "$STAGE/$(dirname "$rel")"
    [[ -e $STAGE/$rel ]] || cp -L "$lib" "$STAGE/$rel"
  done < <(ldd "$file" 2>/dev/null | sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) .*/\1/p')
}
# /dev/console for PID 1's stdio: without it the kernel starts /init with
# fds 0-2 closed and Rust's runtime aborts before main. (Kernels also carry
# it in their built-in initramfs; this does not rely on that.)
if [[ $EUID -eq 0 ]]; then
  mknod -m 600 "$STAGE/dev/console" c 5 1
  mknod -m 666 "$STAGE/dev/null" c 1 3
else
  printf 'mkinitramfs: not root: no /dev/console in the image (the kernel'"'"'s built-in initramfs must provide it)\n' >&2
fi
stage_elf "$AGENT" /init
# The agent's debug info (a release build keeps it: 7.5 MB of 8.8) is not
# carried into every pod VM's RAM; its symbols stay for backtraces.
if command -v strip >/dev/null; then
  strip --strip-debug "$STAGE/init"
fi
stage_elf "$RUNTIME" "/usr/sbin/$(basename "$RUNTIME")"

# The modules, dependencies first (a walk over modules.dep).
declare -A seen=()
order=()
visit() {  # $1: a path relative to $MDIR, as modules.dep names it
  local rel=$1 line d
  [[ -z ${seen[$rel]:-} ]] || return 0
  seen[$rel]=1
  line=$(awk -F: -v r="$rel" '$1 == r { print; exit }' "$MDIR/modules.dep")
  [[ -n $line ]] || die "$rel is not in modules.dep"
  for d in ${line#*:}; do visit "$d"; done
  order+=("$rel")
}
# find_module NAME: its modules.dep path; empty when built in; dies when absent
# (unless $2 is "optional").
find_module() {
  local re=${1//[-_]/[-_]} rel
  rel=$(grep -m1 -E "(^|/)${re}\.ko(\.xz|\.zst|\.gz)?:" "$MDIR/modules.dep" | cut -d: -f1) || true
  if [[ -z $rel ]] && ! grep -qE "(^|/)${re}\.ko\$" "$MDIR/modules.builtin" 2>/dev/null && [[ ${2:-} != optional ]]; then
    die "module $1: neither in modules.dep nor built in (modules.builtin) for kernel $KREL"
  fi
  printf '%s\n' "$rel"
}
for m in "${MODULES[@]}"; do rel=$(find_module "$m"); [[ -z $rel ]] || visit "$rel"; done
for m in "${OPTIONAL_MODULES[@]}"; do rel=$(find_module "$m" optional); [[ -z $rel ]] || visit "$rel"; done
: >"$MODOUT/order"
for rel in "${order[@]}"; do
  src=$MDIR/$rel
  base=$(basename "$rel"); base=${base%.xz}; base=${base%.zst}; base=${base%.gz}
  case $src in
    *.xz) xz -dc "$src" >"$MODOUT/$base" ;;
    *.zst) zstd -qdc "$src" >"$MODOUT/$base" ;;
    *.gz) gzip -dc "$src" >"$MODOUT/$base" ;;
    *) cp "$src" "$MODOUT/$base" ;;
  esac
  printf '%s\n' "$base" >>"$MODOUT/order"
done

mkdir -p "$(dirname "$OUT")"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$OUT.part"
mv "$OUT.part" "$OUT"
printf 'mkinitramfs: %s: %s MiB, OCI runtime %s, modules for %s: %s\n' "$OUT" "$(($(stat -c %s "$OUT") / 1048576))" "$(basename "$RUNTIME")" "$KREL" "$(tr '\n' ' ' <"$MODOUT/order")" >&2

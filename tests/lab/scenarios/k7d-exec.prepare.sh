#!/usr/bin/env bash
# lab: packages=erofs-utils
# Host side of k7d-exec, run by run.sh as "prepare=k7d-exec" with an empty
# output folder; cached by a hash of this file and busybox's version (see
# prepared in lib/host.sh). Writes:
#   image-root.erofs  a user's root disk with no k7d agent in it (part 10:
#                     the agent's handover to the image's own init): static
#                     busybox as /bin/busybox with its applets linked in
#                     /bin, /sbin/init (busybox init),
#                     an /etc/inittab whose sysinit line says "LAB-GUEST
#                     image-init" on the console, and /etc/image-marker;
#                     filesystem UUID 6b376b37-0d1e-4c0a-9e5f-2a7e00c0ffee
#   image-agent.erofs the same image with the agent under test (LAB_AGENT,
#                     run.sh --agent) installed as a service: at
#                     /usr/local/bin/k7d-agent with the libraries ldd names,
#                     its inittab running `k7d-agent --vsock` when the kernel
#                     command line says k7d.agent=image (part 10b)
set -euo pipefail
out=$1
PATH=$PATH:/usr/sbin:/sbin
[[ -x ${LAB_BUSYBOX:-} ]] || { echo "k7d-exec.prepare: no busybox (LAB_BUSYBOX)" >&2; exit 1; }
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
# The image's root as an image has it (mktemp's is 0700: no other user
# could reach /bin).
chmod 755 "$src"
mkdir -p "$src"/{bin,sbin,etc,dev,proc,sys,run,tmp}
cp "$LAB_BUSYBOX" "$src/bin/busybox"
ln -s busybox "$src/bin/sh"
# Its applets on PATH (tar, dirname, ...: what k7d cp runs in a guest), as
# an image's own shell and tools are.
for a in $("$LAB_BUSYBOX" --list); do
  [[ -e $src/bin/$a || $a == init ]] || ln -s busybox "$src/bin/$a"
done
ln -s ../bin/busybox "$src/sbin/init"
cat >"$src/etc/inittab" <<'TAB'
::sysinit:/bin/busybox sh -c 'echo "LAB-GUEST image-init ran (pid 1: $(/bin/busybox readlink /proc/1/exe))" >/dev/console'
::respawn:/bin/busybox sleep 86400
TAB
echo "k7d lab: a user's root disk, no agent in it" >"$src/etc/image-marker"
# A UUID of its own: part 10 names the root as root=UUID=..., as an
# image's own command line does (k7d-exec.sh's IMG_UUID).
mkfs.erofs --quiet -T0 --all-root -U 6b376b37-0d1e-4c0a-9e5f-2a7e00c0ffee "$out/image-root.erofs" "$src"
[[ -s $out/image-root.erofs ]]
echo "k7d-exec.prepare: image-root.erofs $(stat -c %s "$out/image-root.erofs") bytes" >&2

# The agent installed in the image, as a user installs it
# (guest/agent/systemd/k7d-agent.service runs the same command).
[[ -x ${LAB_AGENT:-} ]] || { echo "k7d-exec.prepare: no agent (LAB_AGENT)" >&2; exit 1; }
mkdir -p "$src/usr/local/bin"
strip -o "$src/usr/local/bin/k7d-agent" "$LAB_AGENT"
while read -r lib; do
  mkdir -p "$src$(dirname "$lib")"
  cp -L "$lib" "$src$lib"
done < <(ldd "$LAB_AGENT" | sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) .*/\1/p')
cat >"$src/etc/inittab" <<'TAB'
::sysinit:/bin/busybox sh -c 'echo "LAB-GUEST image-init ran (pid 1: $(/bin/busybox readlink /proc/1/exe))" >/dev/console'
::respawn:/bin/busybox sh -c 'if /bin/busybox grep -qw k7d.agent=image /proc/cmdline; then exec /usr/local/bin/k7d-agent --vsock; fi; exec /bin/busybox sleep 86400'
TAB
echo "k7d lab: a user's root disk, its own agent installed" >"$src/etc/image-marker"
mkfs.erofs --quiet -T0 --all-root -U 6b376b37-0d1e-4c0a-9e5f-2a7e00c0ffee "$out/image-agent.erofs" "$src"
[[ -s $out/image-agent.erofs ]]
echo "k7d-exec.prepare: image-agent.erofs $(stat -c %s "$out/image-agent.erofs") bytes" >&2

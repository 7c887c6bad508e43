#!/usr/bin/env bash
# The nested lab: boots L1 (a Debian kernel on QEMU TCG emulating an AMD CPU
# with SVM), runs a scenario inside it that drives a VMM to boot a real Linux
# L2 guest, and judges the result. See docs/lab.md.
#
#   tests/lab/run.sh [--bin PATH] [--test-bin PATH] [--agent PATH] [--cri-bin PATH] [--out DIR] [--runs N] [--timeout S] SCENARIO
#   tests/lab/run.sh --list | --check | --by-hand | --fetch
#
# Exit status: 0 pass, 1 scenario failed, 2 harness error.
set -euo pipefail
shopt -s inherit_errexit

LAB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The pod VM's initramfs builder (a product tool; "# lab: pod-initramfs=required").
MKPOD=$LAB/../../guest/agent/mkinitramfs.sh
# shellcheck source=lib/host.sh
. "$LAB/lib/host.sh"
# shellcheck source=lib/watchdog.sh
. "$LAB/lib/watchdog.sh"

usage() { sed -n '6,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
# header FILE KEY [DEFAULT]: the value of "# lab: KEY=value" in a scenario.
header() { local v; v=$(sed -n "s/^# lab: *$2=//p" "$1" | head -n1); printf '%s\n' "${v:-${3:-}}"; }

BIN='' TEST_BIN='' AGENT='' CRI_BIN='' OUT='' TIMEOUT='' SCEN='' FETCH=''
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin) BIN=$(realpath "$2"); shift 2 ;;
    --test-bin) TEST_BIN=$(realpath "$2"); shift 2 ;;  # a host test binary to run inside L1 (LAB_TEST_BIN)
    --agent) AGENT=$(realpath "$2"); shift 2 ;;  # k7d-agent, /init of the pod initramfs (pod-initramfs=)
    --cri-bin) CRI_BIN=$(realpath "$2"); shift 2 ;;  # k7d-cri, the CRI client (tests/cri), at $LAB_CRI_BIN in L1
    --out) OUT=$2; shift 2 ;;
    --runs) export LAB_RUNS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --list)
      for f in "$LAB"/scenarios/*.sh; do
        [[ $f == *.guest.sh || $f == *.prepare.sh || $f == *.l1.sh ]] && continue
        printf '%-16s default=%-3s %s\n' "$(basename "$f" .sh)" "$(header "$f" default no)" "$(header "$f" description)"
      done
      exit 0 ;;
    --check)  # syntax and headers of every scenario; needs no network, no root
      rc=0
      for f in "$LAB"/scenarios/*.sh "$LAB"/lib/*.sh; do
        if head -n3 "$f" | grep -q bash; then bash -n "$f"; else sh -n "$f"; fi || { echo "syntax error: $f"; rc=1; }
        [[ $f == */scenarios/*.sh && $f != *.guest.sh && $f != *.prepare.sh && $f != *.l1.sh ]] || continue
        [[ -n $(header "$f" description) && $(header "$f" default) =~ ^(yes|no)$ ]] ||
          { echo "$f: needs '# lab: description=' and '# lab: default=yes|no'"; rc=1; }
        # Nothing silent: a scenario runs in CI through its test in
        # tests/tests/lab.rs, or says why it is by hand (default=no), which
        # CI's summary lists (--by-hand).
        n=$(basename "$f" .sh)
        if tr -d ' \n' <"$LAB/../tests/lab.rs" | grep -qE "run_scenario(_with)?\(\"$n\""; then
          [[ -z $(header "$f" by-hand) ]] || { echo "$f: has a test in tests/tests/lab.rs and says by-hand="; rc=1; }
        elif [[ -z $(header "$f" by-hand) ]]; then
          echo "$f: no test in tests/tests/lab.rs runs it and it says no '# lab: by-hand=why': it would never run, silently"; rc=1
        elif [[ $(header "$f" default) != no ]]; then
          echo "$f: by-hand= needs default=no"; rc=1
        fi
        for k in guest:guest prepare:prepare; do  # the files these headers name must exist
          for v in $(header "$f" "${k%%:*}"); do
            [[ -f $LAB/scenarios/$v.${k#*:}.sh ]] || { echo "$f: no scenarios/$v.${k#*:}.sh"; rc=1; }
          done
        done
        for v in $(header "$f" l1-debs); do  # PACKAGE:PATH words
          [[ $v =~ ^[a-z0-9][a-z0-9.+-]*:/?[^:]+$ ]] || { echo "$f: l1-debs takes PACKAGE:PATH words, not '$v'"; rc=1; }
        done
        case $(header "$f" pod-initramfs) in
          '') ;;
          required) bash -n "$MKPOD" || { echo "$f: pod-initramfs=required: $MKPOD is missing or does not parse"; rc=1; } ;;
          *) echo "$f: pod-initramfs= takes only 'required'"; rc=1 ;;
        esac
      done
      exit $rc ;;
    --by-hand)  # the scenarios no test runs, each with why
      for f in "$LAB"/scenarios/*.sh; do
        [[ $f == *.guest.sh || $f == *.prepare.sh || $f == *.l1.sh ]] && continue
        why=$(header "$f" by-hand)
        [[ -z $why ]] || printf '%-14s %s\n' "$(basename "$f" .sh)" "$why"
      done
      exit 0 ;;
    --fetch) FETCH=1; shift ;;  # only download and unpack the kernels and busybox into the cache
    -h | --help) usage ;;
    -*) die "unknown option $1" ;;
    *) SCEN=$1; shift ;;
  esac
done
if [[ -n $FETCH ]]; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/lock"
  flock -w 1800 9 || die "another lab run holds $CACHE/lock"
  # (a die inside "<<<$(...)" would not stop the script: each step is checked)
  t1=$(kernel_tree linux-image-amd64) && t2=$(kernel_tree linux-image-cloud-amd64) || die "fetching the lab's kernels failed"
  read -r _ L1_KREL <<<"$t1"
  read -r L2_TREE L2_KREL <<<"$t2"
  [[ -n $L1_KREL && -n $L2_KREL && -d $L2_TREE ]] || die "fetching the lab's kernels gave no kernel ($t1 / $t2)"
  bb=$(pkg_version busybox-static) && unpack busybox-static "$bb" >/dev/null || die "fetching busybox-static failed"
  log "fetched: L1 kernel $L1_KREL, L2 kernel $L2_KREL ($L2_TREE), busybox-static"
  exit 0
fi
[[ -n $SCEN ]] || usage
SCRIPT=$LAB/scenarios/$SCEN.sh
[[ -f $SCRIPT ]] || die "no scenario $SCEN ($SCRIPT)"
# The guest script: "# lab: guest=NAME" (scenarios/NAME.guest.sh), else the
# scenario's own scenarios/<name>.guest.sh, else lib/default.guest.sh.
GUEST_SCRIPT=$LAB/scenarios/$(header "$SCRIPT" guest "$SCEN").guest.sh
[[ -f $GUEST_SCRIPT || -z $(header "$SCRIPT" guest) ]] || die "scenario $SCEN: no $GUEST_SCRIPT"
[[ -f $GUEST_SCRIPT ]] || GUEST_SCRIPT=$LAB/lib/default.guest.sh
TIMEOUT=${TIMEOUT:-${K7D_LAB_TIMEOUT:-$(header "$SCRIPT" timeout 600)}}
[[ $(header "$SCRIPT" bin) != required || -n $BIN ]] || die "scenario $SCEN needs --bin PATH"
[[ -z $BIN || -x $BIN ]] || die "--bin $BIN is not an executable"
[[ $(header "$SCRIPT" test-bin) != required || -n $TEST_BIN ]] || die "scenario $SCEN needs --test-bin PATH"
[[ -z $TEST_BIN || -x $TEST_BIN ]] || die "--test-bin $TEST_BIN is not an executable"
[[ $(header "$SCRIPT" cri-bin) != required || -n $CRI_BIN ]] || die "scenario $SCEN needs --cri-bin PATH (k7d-cri: cargo build --release -p k7d-cri)"
[[ -z $CRI_BIN || -x $CRI_BIN ]] || die "--cri-bin $CRI_BIN is not an executable"
POD_INITRAMFS=$(header "$SCRIPT" pod-initramfs)
[[ $POD_INITRAMFS != required || -n $AGENT ]] || die "scenario $SCEN needs --agent PATH (k7d-agent, for the pod initramfs)"
[[ -z $AGENT || -x $AGENT ]] || die "--agent $AGENT is not an executable"
OUT=${OUT:-${K7D_LAB_OUT:-${TMPDIR:-/tmp}/k7d-lab/$SCEN}}
rm -rf "$OUT" && mkdir -p "$OUT/work"
OUT=$(realpath "$OUT")
t_start=$(date +%s.%N)

# One preparation at a time per cache (the cached images); the L1 run takes a
# slot below ("a run slot").
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock -w "$TIMEOUT" 9 || die "another lab run holds $CACHE/lock"

# --- inputs: Debian packages, by version -----------------------------------
read -r L1_TREE L1_KREL <<<"$(kernel_tree linux-image-amd64)"
# The L2 guest's kernel: Debian's cloud kernel unless the scenario asks for
# the generic one ("# lab: l2-kernel=generic", e.g. for its CONFIG_VMGENID).
case $(header "$SCRIPT" l2-kernel cloud) in
  cloud) L2_PKG=linux-image-cloud-amd64 ;;
  generic) L2_PKG=linux-image-amd64 ;;
  *) die "scenario $SCEN: l2-kernel=$(header "$SCRIPT" l2-kernel) (cloud or generic)" ;;
esac
read -r L2_TREE L2_KREL <<<"$(kernel_tree "$L2_PKG")"
BB_VER=$(pkg_version busybox-static)
BB=$(unpack busybox-static "$BB_VER")/bin/busybox
[[ -x $BB ]] || die "busybox-static has no bin/busybox"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing: run tests/lab/setup.sh"
read -ra L1_MODS <<<"irqbypass kvm ccp kvm-amd $(header "$SCRIPT" l1-modules)"
read -ra L2_MODS <<<"$(header "$SCRIPT" guest-modules 'virtio_pci virtio-rng')"
L2_CMDLINE=${LAB_CMDLINE:-console=ttyS0 panic=-1 quiet}
# The L1 watchdog's limits (lib/watchdog.sh): L1's heartbeat silent this long
# means L1 froze; the L1 console and the L2 serial both silent this long (the
# heartbeat going on) means the scenario is stuck. "expect=stall:KIND" makes a
# scenario the watchdog's self-test: it passes only if the watchdog fires so.
L1_STALL_S=${K7D_LAB_L1_STALL_S:-$(header "$SCRIPT" l1-stall-s 60)}
SILENT_S=${K7D_LAB_SILENT_S:-$(header "$SCRIPT" silent-s 180)}
EXPECT=$(header "$SCRIPT" expect)

# --- cached images ------------------------------------------------------------
build_base() {  # STAGE INIT TREE KREL MOD...: busybox, /init, modules
  local stage=$1 init=$2 tree=$3 krel=$4; shift 4
  mkdir -p "$stage"/{bin,dev,proc,sys,tmp,usr/lib,usr/lib64,lab}
  ln -s usr/lib "$stage/lib" && ln -s usr/lib64 "$stage/lib64"
  cp "$BB" "$stage/bin/busybox"
  install -m 0755 "$init" "$stage/init"
  stage_modules "$tree" "$krel" "$stage" "$@"
}
build_l1_base() { build_base "$1" "$LAB/lib/l1-init.sh" "$L1_TREE" "$L1_KREL" "${L1_MODS[@]}"; }
build_l2_base() {
  build_base "$1" "$LAB/lib/l2-init.sh" "$L2_TREE" "$L2_KREL" "${L2_MODS[@]}"
  mv "$1/lab/modules" "$1/modules" && mv "$1/lab/modules.order" "$1/modules.order" && rmdir "$1/lab"
}
build_qemu() {  # QEMU as Debian installed it on this host, at the same paths
  local stage=$1 d
  stage_elf "$(command -v qemu-system-x86_64)" "$stage" /usr/bin/qemu-system-x86_64
  for d in /usr/share/seabios /usr/share/qemu /usr/lib/ipxe/qemu; do
    [[ -d $d ]] && mkdir -p "$stage$d" && cp -rL "$d/." "$stage$d/"
  done
}
qemu_versions=$(dpkg-query -W qemu-system-x86 qemu-system-data seabios ipxe-qemu 2>/dev/null | tr '\t\n' '= ')
L1_BASE=$(cached_image l1-base "$(key "$L1_KREL" "$L1_TREE" "$BB_VER" "${L1_MODS[@]}" -- "$LAB/lib/l1-init.sh" "$LAB/lib/host.sh" "$LAB/run.sh")" build_l1_base)
L2_BASE=$(cached_image l2-base "$(key "$L2_KREL" "$L2_TREE" "$BB_VER" "${L2_MODS[@]}" -- "$LAB/lib/l2-init.sh" "$LAB/lib/host.sh" "$LAB/run.sh")" build_l2_base)
IMAGES=("$L1_BASE")
if [[ $(header "$SCRIPT" needs) == *qemu* ]]; then
  IMAGES+=("$(cached_image qemu "$(key "$qemu_versions" -- "$LAB/lib/host.sh" "$LAB/run.sh")" build_qemu)")
fi

# --- this run: scenario, guest, binary under test, declared files ------------
RUN=$OUT/work/run
mkdir -p "$RUN/lab/l2" "$RUN/lab/bin" "$RUN/lab/files"
install -m 0755 "$SCRIPT" "$RUN/lab/scenario.sh"
cp "$LAB/lib/l1-lib.sh" "$RUN/lab/lib.sh"
cp "$L2_TREE/boot/vmlinuz-$L2_KREL" "$RUN/lab/l2/vmlinuz"
# The guest's part of this run: /guest.sh and the scenario's l2-bins (host
# executables with their libraries at /usr/bin/<tool>, on the guest's PATH
# before busybox's /bin). Busybox sh runs its applets before PATH, so a tool
# whose name is an applet and a shell name gets a function in front of the
# script; others are found on PATH (or call /usr/bin/<tool>).
mkdir -p "$OUT/work/guest"
L2_BINS=$(header "$SCRIPT" l2-bins)
{
  if [[ -n $L2_BINS ]]; then
    echo "# l2-bins ($L2_BINS), added by run.sh: copied host tools win over busybox applets"
    for tool in $L2_BINS; do
      [[ $tool =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] && printf '%s() { /usr/bin/%s "$@"; }\n' "$tool" "$tool"
    done
  fi
  cat "$GUEST_SCRIPT"
} >"$OUT/work/guest/guest.sh"
for tool in $L2_BINS; do
  p=$(host_tool "$tool") || die "scenario $SCEN wants $tool in the guest: not on this host (tests/lab/setup.sh)"
  stage_elf "$p" "$OUT/work/guest" "/usr/bin/$tool"
done
mkcpio "$OUT/work/guest" "$OUT/work/guest.cpio"
cat "$L2_BASE" "$OUT/work/guest.cpio" >"$RUN/lab/l2/initrd.cpio"
[[ -z $BIN ]] || stage_elf "$BIN" "$RUN" "/lab/bin/$(basename "$BIN")"
[[ -z $TEST_BIN ]] || stage_elf "$TEST_BIN" "$RUN" /lab/bin/test-bin
[[ -z $CRI_BIN ]] || stage_elf "$CRI_BIN" "$RUN" /lab/bin/k7d-cri
for tool in $(header "$SCRIPT" l1-bins); do
  p=$(host_tool "$tool") || die "scenario $SCEN wants $tool in L1: not on this host (tests/lab/setup.sh)"
  stage_elf "$p" "$RUN" "/usr/bin/$tool"
done
# "# lab: l1-debs=PACKAGE:PATH ...": files of Debian packages that need not be
# installed on the host (e.g. the CNI plugins), fetched and unpacked into the
# lab cache like the kernels, each copied into L1 at its own path with its
# libraries.
for word in $(header "$SCRIPT" l1-debs); do
  pkg=${word%%:*} path=${word#*:}
  path=/${path#/}
  dir=$(unpack "$pkg") || die "scenario $SCEN wants the Debian package $pkg: fetching it failed"
  [[ -f $dir$path ]] || die "scenario $SCEN wants $path from $pkg: the package has no such file"
  stage_elf "$dir$path" "$RUN" "$path"
done
# "# lab: l1-python=MODULE...": Debian's Python 3.11 in L1 with what
# importing MODULE... loads (the k7d client among them: vmm/python/src at
# /lab/python), so a scenario drives the daemon from Python as an RL team's
# code does (host.sh, stage_python).
L1_PYTHON=$(header "$SCRIPT" l1-python)
# shellcheck disable=SC2086 # a list of module names
[[ -z $L1_PYTHON ]] || stage_python "$RUN" "$LAB/../../vmm/python/src" $L1_PYTHON
for f in $(header "$SCRIPT" files); do
  [[ $f == /* ]] || f=$LAB/../../$f
  cp -rL "$f" "$RUN/lab/files/"
done
# "# lab: pod-initramfs=required": the pod VM's initramfs (guest/agent/mkinitramfs.sh:
# the agent as /init, the host's crun, the L2 kernel's modules) at /lab/pod/initrd.cpio.
# K7D_LAB_POD_RUNTIME=runc (or a path) puts another OCI runtime there, to compare.
if [[ $POD_INITRAMFS == required ]]; then
  rt=${K7D_LAB_POD_RUNTIME:-crun}
  if [[ $rt == */* ]]; then rt_path=$rt; else rt_path=$(host_tool "$rt") || rt_path=''; fi
  [[ -n $rt_path && -x $rt_path ]] || die "scenario $SCEN wants $rt for the pod initramfs: not on this host (tests/lab/setup.sh)"
  timeout 300 bash "$MKPOD" --kernel-tree "$L2_TREE" --krel "$L2_KREL" --agent "$AGENT" --runtime "$rt_path" \
    --out "$RUN/lab/pod/initrd.cpio" || die "guest/agent/mkinitramfs.sh failed"
fi
# "# lab: prepare=NAME": scenarios/NAME.prepare.sh built host-side files (an erofs
# image, ...), cached by a hash of its inputs; they join /lab/files/.
# Several names: each one's files, in order.
for PREP in $(header "$SCRIPT" prepare); do
  PREP_DIR=$(prepared "$PREP")
  cp -r "$PREP_DIR/." "$RUN/lab/files/"
done
{
  q() { printf "export %s='%s'\n" "$1" "${2//\'/\'\\\'\'}"; }
  q LAB_SCENARIO "$SCEN"
  q LAB_SCENARIO_TIMEOUT "$((TIMEOUT > 90 ? TIMEOUT - 30 : TIMEOUT * 2 / 3))"
  q LAB_KERNEL /lab/l2/vmlinuz
  q LAB_INITRD /lab/l2/initrd.cpio
  q LAB_CMDLINE "$L2_CMDLINE"
  q LAB_L2_KERNEL_RELEASE "$L2_KREL"
  q LAB_L1_BINS "$(header "$SCRIPT" l1-bins)"
  [[ -z $BIN ]] || q LAB_BIN "/lab/bin/$(basename "$BIN")"
  [[ -z $TEST_BIN ]] || q LAB_TEST_BIN /lab/bin/test-bin
  [[ -z $CRI_BIN ]] || q LAB_CRI_BIN /lab/bin/k7d-cri
  [[ $POD_INITRAMFS != required ]] || q LAB_POD_INITRD /lab/pod/initrd.cpio
  [[ $POD_INITRAMFS != required ]] || q LAB_POD_RUNTIME "$(basename "$rt_path")"
  while IFS='=' read -r name value; do q "$name" "$value"; done < <(env | grep -E '^LAB_[A-Za-z0-9_]*=' | grep -vE '^LAB_(KERNEL|INITRD|BIN|TEST_BIN|CRI_BIN|POD_INITRD|POD_RUNTIME|CMDLINE|SCENARIO.*|L1_BINS|L2_KERNEL_RELEASE)=')
} >"$RUN/lab/env"
mkcpio "$RUN" "$OUT/work/run.cpio"
cat "${IMAGES[@]}" "$OUT/work/run.cpio" >"$OUT/work/l1-initrd.cpio"
t_prep=$(date +%s.%N)
log "prepared in $(awk -v a="$t_start" -v b="$t_prep" 'BEGIN{printf "%.1f", b-a}') s: L1 $L1_KREL, L2 $L2_KREL, $(du -m "$OUT/work/l1-initrd.cpio" | cut -f1) MiB initramfs; booting L1 (timeout ${TIMEOUT}s)"

# --- a run slot -------------------------------------------------------------------
# The preparation above (cached images) ran under $CACHE/lock. The L1 run
# takes one of K7D_LAB_SLOTS slots (default 1: one L1 at a time). An L1 with
# one vCPU is one busy TCG thread, so a 2-core host runs two scenarios side by
# side (CI does: tests/run-all.sh). A scenario whose header says
# "# lab: exclusive=yes" (its figures are the measurement, e.g. boot-compare)
# takes every slot, so it runs alone.
SLOTS=${K7D_LAB_SLOTS:-1}
[[ $SLOTS =~ ^[1-8]$ ]] || die "K7D_LAB_SLOTS=$SLOTS: 1 to 8 slots"
exec 9>&-
slot_deadline=$(( $(date +%s) + TIMEOUT ))
if [[ $(header "$SCRIPT" exclusive no) == yes || $SLOTS == 1 ]]; then
  for ((i = 0; i < SLOTS; i++)); do
    exec {fd}>"$CACHE/slot.$i"
    flock -w "$TIMEOUT" "$fd" || die "no lab slot within ${TIMEOUT}s ($CACHE/slot.$i is held)"
  done
  SLOT=all
else
  SLOT=
  while [[ -z $SLOT ]]; do
    for ((i = 0; i < SLOTS; i++)); do
      exec {fd}>"$CACHE/slot.$i"
      if flock -n "$fd"; then SLOT=$i; break; fi
      exec {fd}>&-
    done
    [[ -n $SLOT ]] && break
    (( $(date +%s) < slot_deadline )) || die "no lab slot free within ${TIMEOUT}s"
    sleep 1
  done
fi
t_slot=$(date +%s.%N)
[[ $SLOTS == 1 ]] || log "lab slot: $SLOT of $SLOTS (waited $(awk -v a="$t_prep" -v b="$t_slot" 'BEGIN{printf "%.1f", b-a}') s)"

# --- boot L1 --------------------------------------------------------------------
L0_QEMU=("${K7D_LAB_QEMU:-qemu-system-x86_64}")
# L1's vCPUs: one unless the scenario asks otherwise (docs/lab.md, "l1-smp").
L1_SMP=${K7D_LAB_L1_SMP:-$(header "$SCRIPT" l1-smp 1)}
# L1's memory in MiB: 3072 unless asked (a by-hand run of many pods at once).
L1_MIB=${K7D_LAB_L1_MIB:-3072}
[[ $L1_MIB =~ ^[0-9]+$ ]] && ((L1_MIB >= 1024)) || { echo "K7D_LAB_L1_MIB must be a number of MiB, at least 1024: $L1_MIB" >&2; exit 2; }
[[ -z ${K7D_LAB_QEMU_DATA:-} ]] || L0_QEMU+=(-L "$K7D_LAB_QEMU_DATA")
: >"$OUT/l2.log"
: >"$OUT/l1.log"
: >"$OUT/l1-hb.log"
rm -f "$OUT/rescues.log"
# The L1 watchdog (lib/watchdog.sh) reads QEMU's monitor through two FIFOs.
mkfifo "$OUT/work/mon.in" "$OUT/work/mon.out"
WATCH_KIND=$OUT/work/stall-kind WATCH_WHY=$OUT/work/stall-why
l1_watchdog "$OUT" "$L1_STALL_S" "$SILENT_S" "$EXPECT" &
watchdog=$!
set +e
timeout -k 10 "$TIMEOUT" "${L0_QEMU[@]}" -accel "tcg,thread=${K7D_LAB_TCG_THREAD:-multi}" -cpu "${K7D_LAB_L1_CPU:-EPYC,+svm}" -smp "$L1_SMP" -m "$L1_MIB" \
  -nic none -nographic -monitor none -serial stdio -serial "file:$OUT/l2.log" -serial "file:$OUT/l1-hb.log" -no-reboot \
  -chardev "pipe,id=mon0,path=$OUT/work/mon" -mon chardev=mon0,mode=readline -pidfile "$OUT/work/qemu.pid" \
  -kernel "$L1_TREE/boot/vmlinuz-$L1_KREL" -initrd "$OUT/work/l1-initrd.cpio" \
  -append "console=ttyS0 panic=-1 quiet nokaslr ${K7D_LAB_L1_APPEND:-}" </dev/null 2>&1 |
  if [[ -n ${K7D_LAB_QUIET:-} ]]; then cat >"$OUT/l1.log"; else tee "$OUT/l1.log"; fi
qemu_rc=${PIPESTATUS[0]}
: >"$OUT/work/qemu.done"
wait "$watchdog"
set -e
t_end=$(date +%s.%N)

# --- verdict ----------------------------------------------------------------------
tr -d '\r' <"$OUT/l1.log" >"$OUT/l1.log.tmp" && mv "$OUT/l1.log.tmp" "$OUT/l1.log"
# The watchdog's rescues of a frozen L1 (lib/watchdog.sh): in the result.
if [[ -s $OUT/rescues.log ]]; then
  sed 's/^/LAB-NOTE L1 watchdog /' "$OUT/rescues.log" >>"$OUT/l1.log"
  echo "LAB-METRIC lab.rescues $(grep -c '^rescue [0-9]*:' "$OUT/rescues.log")" >>"$OUT/l1.log"
fi
# Every freeze the watchdog recorded (a rescue, or L1 frozen for good).
[[ ! -s $OUT/freezes.log ]] || echo "LAB-METRIC lab.freezes $(grep -c . "$OUT/freezes.log")" >>"$OUT/l1.log"
reason=
if [[ -s $WATCH_KIND || -n $EXPECT ]]; then
  # The watchdog fired (or a self-test expected it to): its verdict rules.
  reason=$(l1_watchdog_verdict "$OUT" "$EXPECT")
  if [[ -z $reason && -s $WATCH_KIND ]]; then
    echo "LAB-METRIC watchdog.fired_after $(cat "$OUT/work/stall-after") s" >>"$OUT/l1.log"
    echo "LAB-PASS the L1 watchdog fired as expected ($(cat "$WATCH_KIND")) with its evidence" >>"$OUT/l1.log"
  fi
elif [[ $qemu_rc -eq 124 || $qemu_rc -eq 137 ]]; then reason="L1 killed after ${TIMEOUT}s (global timeout)"
elif grep -q '^LAB-FAIL' "$OUT/l1.log"; then reason=$(grep -m1 '^LAB-FAIL' "$OUT/l1.log" | sed 's/^LAB-FAIL *//')
elif ! grep -q '^LAB-END rc=0' "$OUT/l1.log"; then reason="scenario did not end with rc=0 ($(grep -m1 '^LAB-END' "$OUT/l1.log" || echo 'no LAB-END line'); qemu rc=$qemu_rc)"
elif ! grep -q '^LAB-PASS' "$OUT/l1.log"; then reason="no LAB-PASS line"
fi
status=pass; [[ -z $reason ]] || status=fail
prep_s=$(awk -v a="$t_start" -v b="$t_prep" 'BEGIN{printf "%.1f", b-a}')
l1_s=$(awk -v a="$t_slot" -v b="$t_end" 'BEGIN{printf "%.1f", b-a}')
# result.json: the verdict, the times and every LAB-METRIC / LAB-NOTE line.
SCEN="$SCEN" STATUS="$status" REASON="$reason" PREP="$prep_s" L1S="$l1_s" L1K="$L1_KREL" L2K="$L2_KREL" OUTD="$OUT" \
  LC_ALL=C awk '
  function s(x,   o, i, c) {  # a JSON string; control characters dropped
    o = ""
    for (i = 1; i <= length(x); i++) {
      c = substr(x, i, 1)
      if (c == "\\" || c == "\"") o = o "\\" c; else if (c >= " ") o = o c
    }
    return "\"" o "\""
  }
  /^LAB-METRIC / { v = ($3 ~ /^-?[0-9]+(\.[0-9]+)?$/) ? $3 : s($3)
                   m = m (m ? ",\n" : "") "    " s($2) ": {\"value\": " v ", \"unit\": " s($4) "}" }
  /^LAB-NOTE /   { sub(/^LAB-NOTE /, ""); n = n (n ? ",\n" : "") "    " s($0) }
  END {
    printf "{\n  \"scenario\": %s,\n  \"status\": %s,\n", s(ENVIRON["SCEN"]), s(ENVIRON["STATUS"])
    printf "  \"reason\": %s,\n", ENVIRON["REASON"] == "" ? "null" : s(ENVIRON["REASON"])
    printf "  \"prepare_s\": %s,\n  \"l1_s\": %s,\n", ENVIRON["PREP"], ENVIRON["L1S"]
    printf "  \"l1_kernel\": %s,\n  \"l2_kernel\": %s,\n", s(ENVIRON["L1K"]), s(ENVIRON["L2K"])
    printf "  \"metrics\": {\n%s\n  },\n  \"notes\": [\n%s\n  ],\n", m, n
    printf "  \"l1_log\": %s,\n  \"l2_log\": %s\n}\n", s(ENVIRON["OUTD"] "/l1.log"), s(ENVIRON["OUTD"] "/l2.log")
  }' "$OUT/l1.log" >"$OUT/result.json"
rm -f "$OUT/work/l1-initrd.cpio"  # a concatenation of cached images and run.cpio
[[ $status == fail ]] || rm -rf "$OUT/work"

echo
echo "==== lab: $SCEN: $status${reason:+: $reason}"
echo "     prepare ${prep_s}s, L1 run ${l1_s}s; logs: $OUT/l1.log (L1 console), $OUT/l2.log (L2 serial)"
grep -E '^LAB-(METRIC|NOTE)' "$OUT/l1.log" | sed 's/^/     /' || true
if [[ $status == fail ]]; then
  echo "---- L1 console ($OUT/l1.log) ----"; cat "$OUT/l1.log"
  echo "---- L2 serial ($OUT/l2.log) ----"; cat "$OUT/l2.log"
  [[ ! -s $OUT/l1-stall.log ]] || { echo "---- the L1 watchdog's evidence ($OUT/l1-stall.log) ----"; cat "$OUT/l1-stall.log"; }
  exit 1
fi

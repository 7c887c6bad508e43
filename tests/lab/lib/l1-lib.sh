# Helpers for scenarios, sourced inside L1 as /lab/lib.sh (busybox ash).
# Environment: LAB_KERNEL, LAB_INITRD, LAB_CMDLINE (the L2 guest), LAB_BIN (the
# binary under test, if given), LAB_RUNS, plus every LAB_* variable the harness
# was given on the host.

_CR=$(printf '\r')

# Debian's busybox runs its own applets in preference to PATH, so a tool copied
# in with "# lab: l1-bins=ip tc" would lose to the "ip" applet: wrap each in a
# function. Where a function cannot reach (timeout, xargs), use /usr/bin/<tool>.
# A name that is not a shell name (mkfs.erofs, containerd-shim-runc-v2) gets no
# function (ash refuses it); no applet has such a name, so PATH finds it.
for _t in ${LAB_L1_BINS:-}; do
  case $_t in [!A-Za-z_]* | *[!A-Za-z0-9_]*) continue ;; esac
  eval "$_t() { /usr/bin/$_t \"\$@\"; }"
done

lab_pass() { echo "LAB-PASS $*"; exit 0; }
lab_fail() { echo "LAB-FAIL $*"; exit 1; }
lab_note() { echo "LAB-NOTE $*"; }
# lab_metric NAME VALUE [UNIT]: one figure for result.json.
lab_metric() { echo "LAB-METRIC $1 $2 ${3:-}"; }
lab_now() { read -r _now _ </proc/uptime; echo "$_now"; }
# lab_median V...: the median of numbers.
lab_median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {if (NR%2) print v[(NR+1)/2]; else printf "%.2f\n", (v[NR/2]+v[NR/2+1])/2}'; }
lab_sub() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f\n", a-b}'; }

# lab_run_l2 LABEL TIMEOUT CMD...: run CMD (a VMM booting the L2 guest) with its
# output streamed to the L2 serial channel (l2.log on the host) and kept in
# /tmp/l2-LABEL.log. Sets L2_RC (exit status, 137 = killed at TIMEOUT), L2_WALL
# (seconds from spawn to exit) and L2_INIT_WALL (seconds from spawn to the
# guest's "LAB-GUEST init" line; empty if never seen) and L2_STALLED (1 when
# the watchdog killed it). Resolution 10 ms.
# A stall watchdog runs beside it: the guest's /init prints a heartbeat every
# few seconds, so output that stops for LAB_STALL_S seconds (default 60) means
# the guest, its serial path or the VMM is stuck. The watchdog then gathers
# the evidence (lab_diag), kills the VMM and the scenario fails at once with
# "stalled", instead of waiting for the L2 or L1 timeout.
lab_run_l2() {
  _label=$1 _timeout=$2; shift 2
  _log=/tmp/l2-$_label.log
  : >"$_log"; rm -f "$_log.stamped" /tmp/.l2-rc /tmp/.l2-init /tmp/.l2-pid /tmp/.l2-stall "/tmp/k7d-dump-$_label"
  # k7d also writes its SIGUSR1 dump here: its stderr is the same pipe as the
  # guest's console, and a stalled pipe is one way a guest stops printing.
  export K7D_DUMP_FILE=/tmp/k7d-dump-$_label
  echo "=== lab: $_label: $*" >/dev/ttyS1
  _t0=$(lab_now)
  # Busybox timeout execs CMD in its own process (the watcher is a child), so
  # $! is the VMM's pid.
  # fd 7 (L1's held-open ttyS1) is not the VMM's business: closed for it.
  { timeout -s KILL "$_timeout" "$@" </dev/null 7>&- 2>&1 & echo $! >/tmp/.l2-pid; wait $!; echo $? >/tmp/.l2-rc; } |
    while IFS= read -r _line || [ -n "$_line" ]; do
      _line=${_line%"$_CR"}
      case $_line in *"LAB-GUEST init"*) lab_now >/tmp/.l2-init ;; esac
      printf '%s\n' "$_line" >>"$_log"
      # LAB_L2_STAMP=1: each line again, after L1's clock when it arrived.
      [ -z "${LAB_L2_STAMP:-}" ] || printf '%s %s\n' "$(lab_now)" "$_line" >>"$_log.stamped"
      printf '%s\n' "$_line" >/dev/ttyS1
    done &
  _reader=$!
  _lab_watchdog "$_label" "$_log"
  wait "$_reader"
  _t1=$(lab_now)
  L2_RC=$(cat /tmp/.l2-rc 2>/dev/null || echo 255)
  L2_WALL=$(lab_sub "$_t1" "$_t0")
  L2_INIT_WALL=
  [ -s /tmp/.l2-init ] && L2_INIT_WALL=$(lab_sub "$(cat /tmp/.l2-init)" "$_t0")
  echo "=== lab: $_label: rc=$L2_RC wall=${L2_WALL}s spawn-to-init=${L2_INIT_WALL:-?}s" >/dev/ttyS1
  echo "lab: $_label: rc=$L2_RC wall=${L2_WALL}s spawn-to-init=${L2_INIT_WALL:-?}s"
  L2_STALLED=0
  [ ! -e /tmp/.l2-stall ] || L2_STALLED=1
  # The watchdog's own self-test (lab-stall) expects the stall; every other run fails on it.
  [ "$L2_STALLED" = 0 ] || [ -n "${LAB_STALL_EXPECTED:-}" ] ||
    lab_fail "stalled: $_label: $(cat /tmp/.l2-stall) (evidence: LAB-DIAG lines in l1.log)"
}

# _lab_watchdog LABEL LOG: returns when the VMM has exited; if LOG does not grow
# for LAB_STALL_S seconds first, gathers the evidence, kills the VMM and
# leaves the reason in /tmp/.l2-stall.
_lab_watchdog() {
  _wl=$1 _wlog=$2 _wlast=-1 _wstill=0 _wlimit=${LAB_STALL_S:-60}
  while [ ! -e /tmp/.l2-rc ]; do
    sleep 1
    _wsz=$(wc -c <"$_wlog" 2>/dev/null || echo 0)
    if [ "$_wsz" != "$_wlast" ]; then _wlast=$_wsz _wstill=0; continue; fi
    _wstill=$((_wstill + 1))
    [ "$_wstill" -ge "$_wlimit" ] || continue
    _wpid=$(cat /tmp/.l2-pid 2>/dev/null)
    echo "no output from the guest or the VMM for ${_wlimit} s (last: $(grep -v 'LAB-GUEST hb' "$_wlog" | grep -v k7d-dump | tail -n1 | cut -c1-160))" >/tmp/.l2-stall
    echo "LAB-STALL $_wl: $(cat /tmp/.l2-stall)"
    lab_diag "$_wl" "$_wpid" "$_wlog"
    [ -z "$_wpid" ] || kill -KILL "$_wpid" 2>/dev/null
    return
  done
}

# lab_diag LABEL PID LOG: what tells a stuck VMM from a stuck emulator, as
# "LAB-DIAG" lines on L1's console: L1's load and interrupts; each VMM thread's
# state, wait channel, syscall, kernel stack and CPU use over 2 s; KVM's exit
# counters over the same 2 s (the guest runs or it does not); k7d's own dump
# (SIGUSR1: vCPUs, virtio queues, serial), and the guest's last lines.
lab_diag() {
  _dl=$1 _dp=$2 _dlog=$3
  _d() { echo "LAB-DIAG $_dl: $*"; }
  _d "L1 uptime $(cat /proc/uptime) loadavg $(cat /proc/loadavg)"
  grep -q " /sys/kernel/debug " /proc/mounts || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
  _kvmstats() { for _f in exits halt_exits halt_wakeup halt_successful_poll irq_injections nmi_injections io_exits mmio_exits signal_exits irq_exits req_event; do
      [ -r "/sys/kernel/debug/kvm/$_f" ] && printf '%s=%s ' "$_f" "$(cat "/sys/kernel/debug/kvm/$_f")"; done; }
  _cpu() { for _t in /proc/"$_dp"/task/*; do
      [ -r "$_t/stat" ] || continue
      # fields after "(comm)": state is $1, utime $12, stime $13
      printf '%s:%s ' "${_t##*/}" "$(sed 's/^.*) //' "$_t/stat" | awk '{print $12 + $13}')"; done; }
  if [ -n "$_dp" ] && [ -d "/proc/$_dp" ]; then
    _d "VMM pid $_dp: $(tr '\0' ' ' <"/proc/$_dp/cmdline" | cut -c1-200)"
    _d "VMM status: $(grep -E '^(State|Threads|VmRSS|SigPnd|ShdPnd)' "/proc/$_dp/status" | tr '\n\t' '  ')"
    _k0=$(_kvmstats) _c0=$(_cpu)
    sleep 2
    _k1=$(_kvmstats) _c1=$(_cpu)
    _d "kvm counters t0: $_k0"
    _d "kvm counters t0+2s: $_k1"
    _d "thread cpu ticks t0: $_c0"
    _d "thread cpu ticks t0+2s: $_c1"
    for _t in /proc/"$_dp"/task/*; do
      [ -r "$_t/stat" ] || continue
      _d "thread ${_t##*/} $(cat "$_t/comm" 2>/dev/null): state $(sed 's/^.*) //' "$_t/stat" | cut -d' ' -f1) wchan $(cat "$_t/wchan" 2>/dev/null) syscall $(cut -d' ' -f1-3 "$_t/syscall" 2>/dev/null)"
      [ -r "$_t/stack" ] && _d "  stack: $(head -n 8 "$_t/stack" | sed 's/^\[<[0-9a-f]*>\] //' | tr '\n' ' ')"
    done
    case $(cat "/proc/$_dp/comm" 2>/dev/null) in
      k7d*)
        kill -USR1 "$_dp" 2>/dev/null && sleep 2
        _d "k7d's own dump (SIGUSR1, from \$K7D_DUMP_FILE):"
        head -n 200 "${K7D_DUMP_FILE:-/dev/null}" 2>/dev/null | sed "s/^/LAB-DIAG $_dl:   /"
        ;;
    esac
  else
    _d "VMM pid ${_dp:-?} is gone"
  fi
  _d "L1 interrupts: $(grep -E 'virtio|ttyS|LOC|RES|CAL|TLB|NMI' /proc/interrupts 2>/dev/null | tr -s ' ' | tr '\n' '|' | cut -c1-600)"
  # Every user process's state and wait channel: the relay of the VMM's output
  # (this shell's read loop, writing to /dev/ttyS1) blocked in a tty write
  # would stall the VMM's console writes, and so the guest.
  for _p in /proc/[0-9]*; do
    # (proc files have size 0: a kernel thread is one with an empty cmdline)
    [ -n "$(tr '\0' ' ' <"$_p/cmdline" 2>/dev/null)" ] || continue
    _d "L1 process ${_p#/proc/} $(cat "$_p/comm" 2>/dev/null): state $(sed 's/^.*) //' "$_p/stat" 2>/dev/null | cut -d' ' -f1) wchan $(cat "$_p/wchan" 2>/dev/null)"
  done
  _d "the guest's last lines:"
  grep -v 'LAB-GUEST hb' "$_dlog" | grep -v k7d-dump | tail -n 15 | sed "s/^/LAB-DIAG $_dl:   /"
}

# lab_alive PID: the process runs (an exited, unreaped child is a zombie:
# kill -0 still works on it).
lab_alive() { [ -e "/proc/$1" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" != Z ]; }

# lab_daemon_start STATE_DIR SOCKET LOG: starts "$LAB_BIN daemon" in the
# background (its stderr to LOG), sets dpid, and waits up to 30 s for its
# API to answer. Calls the scenario's fail (which must exist) if the daemon
# exits or does not answer. LAB_JAIL (default on, k7d's default) is the
# daemon's --jail: on, every VM in a jailed VM process of its own (issue
# 36), in a cgroup v2 leaf (cgroup2 mounted here for it); off (by hand),
# every VM inside the daemon.
lab_daemon_start() {
  if [ "${LAB_JAIL:-on}" = on ]; then
    lab_cgroup2
  fi
  "$LAB_BIN" daemon --jail "${LAB_JAIL:-on}" --state-dir "$1" --socket "$2" 2>"$3" &
  dpid=$!
  local deadline=$(( $(date +%s) + 30 ))
  while ! timeout -s KILL 10 "$LAB_BIN" --socket "$2" list >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "the k7d daemon did not come up within 30 s: $(tail -n3 "$3")"
    lab_alive "$dpid" || fail "the k7d daemon exited at start: $(tail -n3 "$3")"
    sleep 0.1
  done
}

# lab_cgroup2: cgroup v2 at /sys/fs/cgroup (L1 boots with none mounted),
# where runc keeps its containers and a daemon with --jail on gives each VM
# process its leaf; the scenario fails if it cannot be mounted.
lab_cgroup2() {
  grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts || mount -t cgroup2 cgroup2 /sys/fs/cgroup ||
    lab_fail "cannot mount cgroup2 at /sys/fs/cgroup (runc and a k7d daemon with --jail on need it)"
}

# lab_where SOCKET VM...: sets `where` to where the VMs run: with
# LAB_JAIL=on each VM's VM process pid ("in VM processes: vm=pid ..."),
# failing (the scenario's fail) for a VM that runs inside the daemon; with
# the jail off, "in the daemon". What a scenario notes so that its result
# says where its VMs ran (call it outside $(...): fail must end the script).
lab_where() {
  local sock=$1 v pid
  shift
  if [ "${LAB_JAIL:-on}" != on ]; then
    where="in the daemon"
    return
  fi
  where="in VM processes:"
  for v in "$@"; do
    pid=$(timeout -s KILL 10 "$LAB_BIN" --socket "$sock" --json info "$v" | tr -d ' \n' |
      sed -n 's/.*"vm_process":{[^}]*"pid":\([0-9]*\).*/\1/p')
    [ -n "$pid" ] || fail "LAB_JAIL=on, but vm $v runs in no VM process"
    where="$where $v=$pid"
  done
}

# lab_daemon_stop LOG: SIGTERM to $dpid; it must exit 0 within 30 s and
# leave no ERROR in LOG (else the scenario's fail).
lab_daemon_stop() {
  kill -TERM "$dpid"
  local i=0 rc
  while lab_alive "$dpid"; do
    i=$((i + 1)); [ "$i" -lt 300 ] || fail "the k7d daemon did not exit within 30 s of SIGTERM"
    sleep 0.1
  done
  wait "$dpid"
  rc=$?
  [ "$rc" = 0 ] || fail "the k7d daemon exited $rc on SIGTERM: $(tail -n3 "$1" | tr '\n' ' ')"
  ! grep -q 'ERROR' "$1" || fail "the daemon logged an error: $(grep -m1 'ERROR' "$1")"
}

# lab_jail_check FILE...: what the VM process of k7d-jail.l1.sh was while its
# guest ran (it recorded /proc in /tmp/k7d-jail): a non-root uid,
# no_new_privs, no capabilities, a seccomp filter, an empty root, a mount
# namespace not L1's, its serial log and each FILE among its descriptors
# (handed over by the daemon: it has no filesystem), its stderr its own log.
lab_jail_check() {
  _j=/tmp/k7d-jail _v=/tmp/k7d-jail/state/vms/vm
  [ -s $_j/status ] || lab_fail "k7d-jail: no record of the VM process"
  _uid=$(awk '/^Uid:/ {print $2}' $_j/status)
  [ -n "$_uid" ] && [ "$_uid" != 0 ] || lab_fail "k7d-jail: the VM process ran as uid '$_uid'"
  grep -q "^NoNewPrivs:.1" $_j/status || lab_fail "k7d-jail: the VM process lacks no_new_privs: $(cat $_j/status)"
  grep -q "^CapEff:.0000000000000000" $_j/status || lab_fail "k7d-jail: the VM process has capabilities: $(cat $_j/status)"
  grep -q "^Seccomp:.2" $_j/status || lab_fail "k7d-jail: the VM process has no seccomp filter"
  [ ! -s $_j/root ] || lab_fail "k7d-jail: the VM process's root is not empty: $(cat $_j/root)"
  [ "$(cat $_j/mnt-ns)" != "$(readlink /proc/self/ns/mnt)" ] || lab_fail "k7d-jail: the VM process shares L1's mount namespace"
  for _f in "$_v/serial.log" "$@"; do
    grep -q " -> $_f\$" $_j/fds || lab_fail "k7d-jail: the VM process does not hold $_f: $(tr '\n' ' ' <$_j/fds)"
  done
  grep -q " 2 -> $_v/vm-process.log\$" $_j/fds || lab_fail "k7d-jail: the VM process's stderr is not its own log"
  lab_note "k7d-jail: the VM ran in VM process uid $_uid (no_new_privs, no capabilities, seccomp, empty root, own mount namespace), holding its files and serial log as handed descriptors"
  # Its cgroup v2 leaf: the VM's RAM plus the VMM allowance (128 MiB), a
  # CPU per vCPU plus one; removed with the VM.
  _cg=$(cat $_j/cgroup-dir)
  [ -n "$_cg" ] || lab_fail "k7d-jail: the VM process has no cgroup"
  grep -qx "0::${_cg#/sys/fs/cgroup}" $_j/cgroup || lab_fail "k7d-jail: the VM process was in cgroup '$(cat $_j/cgroup)', not $_cg"
  _mem=$((($(cat $_j/memory_mib) + 128) * 1048576)) _cpu=$((($(cat $_j/vcpus) + 1) * 100000))
  [ "$(cat $_j/memory.max)" = "$_mem" ] || lab_fail "k7d-jail: its cgroup's memory.max is '$(cat $_j/memory.max)', not $_mem"
  [ "$(cat $_j/cpu.max)" = "$_cpu 100000" ] || lab_fail "k7d-jail: its cgroup's cpu.max is '$(cat $_j/cpu.max)', not '$_cpu 100000'"
  [ ! -e "$_cg" ] || lab_fail "k7d-jail: its cgroup $_cg outlived the VM"
  lab_note "k7d-jail: its cgroup $_cg held it to memory.max $_mem, cpu.max $_cpu 100000, and went with the VM"
}

# lab_guest KEY LABEL: the value the guest printed as "LAB-GUEST KEY=value" in run LABEL.
lab_guest() { sed -n "s/.*LAB-GUEST $1=\([^[:space:]]*\).*/\1/p" "/tmp/l2-$2.log" | tr -d '\r' | head -n1; }
lab_guest_init_uptime() { sed -n 's/.*LAB-GUEST init uptime=\([0-9.]*\).*/\1/p' "/tmp/l2-$1.log" | head -n1; }

# lab_vmm NAME 'COMMAND': name a VMM command line that boots the L2 guest.
# Single-quote it: it is evaluated at each run, so "$LAB_KERNEL" etc. expand
# then. It may span lines (newlines are read as spaces).
lab_vmm() {
  case $1 in *[!A-Za-z0-9_]*) lab_fail "lab_vmm: $1 is not a shell name (letters, digits, _)" ;; esac
  _v=$(printf '%s' "$2" | tr '\n' ' '); eval "_vmm_$1=\$_v"; }

# The reference: Debian's QEMU + SeaBIOS, -kernel/-initrd, 2 vCPUs, 256 MiB,
# one virtio-rng-pci. Every scenario that compares with QEMU uses this line.
lab_vmm qemu 'qemu-system-x86_64 -accel kvm -cpu host -machine pc -smp 2 -m 256
  -nodefaults -no-user-config -display none -serial stdio -no-reboot
  -kernel "$LAB_KERNEL" -initrd "$LAB_INITRD" -append "$LAB_CMDLINE"
  -device virtio-rng-pci'

# lab_boot_series RUNS NAME[:N]...: boot the guest RUNS times with each named
# VMM, interleaved (run 1 of each, then run 2 of each, ...: load drift on the
# host hits all alike); NAME:N boots only in the first N rounds (a VMM read,
# not bounded, needs fewer). Each run must exit 0 with the guest printing
# nproc=2 and its script ending rc=0. Prints, per NAME, the medians as metrics
# NAME.guest_init_uptime (guest clock at init: kernel boot only),
# NAME.spawn_to_init (VMM spawn to the guest's init: the boot-to-init figure)
# and NAME.wall (VMM spawn to VMM exit after the guest's poweroff).
lab_boot_series() {
  _runs=$1; shift
  rm -rf /tmp/lab-series && mkdir -p /tmp/lab-series
  _i=1
  while [ "$_i" -le "$_runs" ]; do
    for _n in "$@"; do
      case $_n in *:*) [ "$_i" -le "${_n#*:}" ] || continue; _n=${_n%%:*} ;; esac
      eval "_cmd=\${_vmm_$_n:-}"
      [ -n "$_cmd" ] || lab_fail "no VMM named $_n (lab_vmm $_n '...')"
      eval "lab_run_l2 \"\$_n-\$_i\" \"\${LAB_L2_TIMEOUT:-240}\" $_cmd"
      [ "$L2_RC" = 0 ] || lab_fail "$_n run $_i: VMM exited $L2_RC (137: killed after ${LAB_L2_TIMEOUT:-240} s)"
      _up=$(lab_guest_init_uptime "$_n-$_i")
      [ -n "$_up" ] || lab_fail "$_n run $_i: the guest never reached init"
      _np=$(lab_guest nproc "$_n-$_i")
      [ "$_np" = 2 ] || lab_fail "$_n run $_i: guest nproc=${_np:-?}, expected 2"
      grep -q "LAB-GUEST end rc=0" "/tmp/l2-$_n-$_i.log" || lab_fail "$_n run $_i: guest script failed"
      echo "lab: $_n run $_i: guest uname=$(lab_guest uname "$_n-$_i") nproc=$_np init-uptime=${_up}s"
      echo "$_up" >>"/tmp/lab-series/$_n.guest_init_uptime"
      echo "$L2_INIT_WALL" >>"/tmp/lab-series/$_n.spawn_to_init"
      echo "$L2_WALL" >>"/tmp/lab-series/$_n.wall"
      # The waterfall's inputs: before the guest's clock (VMM, firmware,
      # decompression: spawn to init minus the guest's uptime at init), then
      # the phases the guest printed from its kernel log.
      lab_sub "$L2_INIT_WALL" "$_up" >>"/tmp/lab-series/$_n.phase.0-before-guest-clock"
      # k7d's own part of it: from its main() to its vCPUs' start (its line
      # "vCPUs started N ms after k7d's start"); other VMMs print none.
      _vmm=$(sed -n "s/.*vCPUs started \([0-9.]*\) ms after k7d's start.*/\1/p" "/tmp/l2-$_n-$_i.log" | head -n1)
      [ -z "$_vmm" ] || awk -v m="$_vmm" 'BEGIN {printf "%.2f\n", m / 1000}' >>"/tmp/lab-series/$_n.phase.0a-k7d-main-to-vcpus"
      sed -n 's/.*LAB-GUEST phase \([0-9a-z-]*\)=\([0-9.]*\).*/\1 \2/p' "/tmp/l2-$_n-$_i.log" | tr -d '\r' |
        while read -r _ph _t; do echo "$_t" >>"/tmp/lab-series/$_n.phase.$_ph"; done
    done
    _i=$((_i + 1))
  done
  for _n in "$@"; do
    _n=${_n%%:*} _d=/tmp/lab-series/${_n%%:*}
    lab_note "$_n over $(wc -l <"$_d.spawn_to_init") runs (s): guest uptime at init: $(tr '\n' ' ' <"$_d.guest_init_uptime");" \
      "spawn to init: $(tr '\n' ' ' <"$_d.spawn_to_init"); spawn to exit: $(tr '\n' ' ' <"$_d.wall")"
    for _m in guest_init_uptime spawn_to_init wall; do
      lab_metric "$_n.$_m" "$(lab_median $(cat "/tmp/lab-series/$_n.$_m"))" s
    done
    # The fastest boot: the emulator only ever adds time (a boot of one
    # series read 3.6 s and 8.9 s), so the least disturbed run is what the
    # lab's bound compares (tests/tests/lab.rs, LAB_BOUNDS).
    lab_metric "$_n.spawn_to_init_min" "$(sort -n "$_d.spawn_to_init" | head -n1)" s
  done
  lab_note "figures of an emulated machine (L1 is QEMU TCG, L2 runs on nested SVM): compare VMMs within one run; they are not absolute performance"
}

# lab_waterfall NAME...: after lab_boot_series, each phase of the boot side
# by side, medians in seconds: the time before the guest's clock starts
# (VMM start, firmware, decompression), then the guest's own timestamps of
# the lines that end each phase (kernel log), then init.
lab_waterfall() {
  lab_note "boot waterfall, medians in s (0: spawn to the guest's clock start, 0a: k7d's main() to its vCPUs' start, within 0; 1-6: the guest's clock when each phase ended):"
  for _f in /tmp/lab-series/"$1".phase.*; do
    [ -e "$_f" ] || continue
    _ph=${_f##*.phase.} _row=""
    for _n in "$@"; do
      _v=$(cat "/tmp/lab-series/$_n.phase.$_ph" 2>/dev/null)
      _row="$_row $_n $([ -n "$_v" ] && lab_median $_v || echo -)"
    done
    lab_note "  $_ph:$_row"
  done
}

# lab_ratio A B METRIC: metric A_vs_B.METRIC = median(A) / median(B) from the
# last lab_boot_series.
lab_ratio() {
  _a=$(lab_median $(cat "/tmp/lab-series/$1.$3")) _b=$(lab_median $(cat "/tmp/lab-series/$2.$3"))
  lab_metric "$1_vs_$2.$3" "$(awk -v a="$_a" -v b="$_b" 'BEGIN {printf "%.2f\n", (b > 0 ? a / b : 0)}')" x
}

# --- guests that draw in a loop (scenarios/k7d-vmgenid.guest.sh) -----------
# Used by k7d-vmgenid and k7d-exec. The scenario defines fail MESSAGE, kc
# (its k7d client), log_of VM (the VM's serial log) and W (its work dir).
# rng_lines LOG: "n forks draw" of each complete draw line, in order.
rng_lines() {
  [ -f "$1" ] || return 0
  tr -d '\r' <"$1" | sed -n 's/.*LAB-GUEST rng n=\([0-9]*\) forks=\([0-9]*\) draw=\([0-9a-f]\{32\}\) end$/\1 \2 \3/p'
}
first_rng() { rng_lines "$1" | head -n1; }
rng_last_n() { rng_lines "$1" | tail -n1 | cut -d' ' -f1; }
rng_at() { rng_lines "$1" | awk -v n="$2" '$1 == n {print $2, $3; exit}'; }
# wait_first LOG WHAT / wait_at LOG N WHAT: until LOG has a draw (n=N), 60 s.
wait_first() {
  _i=0
  until [ -n "$(first_rng "$1")" ]; do
    _i=$((_i + 1)); [ "$_i" -lt 300 ] || fail "$2: no draw within 60 s: $(tr -d '\r' <"$1" 2>/dev/null | tail -n2 | tr '\n' ' ')"
    sleep 0.2
  done
}
wait_at() {
  _i=0
  until [ -n "$(rng_at "$1" "$2")" ]; do
    _i=$((_i + 1)); [ "$_i" -lt 300 ] || fail "$3: no draw n=$2 within 60 s (last n=$(rng_last_n "$1"))"
    sleep 0.2
  done
}
# after_next_draw LOG WHAT: returns as LOG gains a draw, so that what follows
# (a fork) lands early in the 3 s before the next one.
after_next_draw() {
  _n0=$(rng_last_n "$1") _i=0
  while [ "$(rng_last_n "$1")" = "$_n0" ]; do
    _i=$((_i + 1)); [ "$_i" -lt 600 ] || fail "$2: no new draw within 60 s (last n=$_n0)"
    sleep 0.1
  done
}
# pin_asleep VM WHAT: VM paused while asleep: right after one of its draw
# lines, `k7d pause`, and its log checked for a wake after that line (a
# count begun before the pause landed). Such a pause is undone and the next
# draw waited for, 5 tries. CI saw a pause land inside the next line: the
# guest's count and draw take seconds in L2, and a busy L1 (a batch of 8 VM
# processes just deleted) delayed the pause past the next wake.
asleep() {
  _last=$(tr -d '\r' <"$1" | grep -E 'wake n=[0-9]+|LAB-GUEST rng n=[0-9]+ forks=[0-9]+ draw=[0-9a-f]{32} end$' | tail -n1)
  case $_last in *" end") return 0 ;; *) return 1 ;; esac
}
# PIN_FRESH_S (unset: any): the pause must also land within this many
# seconds of the draw line it follows (L1's time: from seeing the line to
# the pause's answer), so that the paused VM has most of its sleep left; a
# later one is undone like a pause inside a draw.
PINS=
pin_asleep() {
  _try=1
  while :; do
    after_next_draw "$(log_of "$1")" "$2: $1"
    _seen=$(lab_now)
    kc pause "$1" >"$W/pause.out" 2>&1 || fail "$2: k7d pause $1 failed: $(cat "$W/pause.out")"
    _late=$(awk -v a="$_seen" -v b="$(lab_now)" -v f="${PIN_FRESH_S:-}" 'BEGIN {print (f != "" && b - a > f) ? 1 : 0}')
    asleep "$(log_of "$1")" && [ "$_late" = 0 ] && break
    [ "$_try" -lt 5 ] || fail "$2: $1 was paused inside a draw or late $_try times in a row (its log ends: $(tr -d '\r' <"$(log_of "$1")" | tail -n2 | tr '\n' ' '))"
    kc resume "$1" >"$W/resume.out" 2>&1 || fail "$2: k7d resume $1 failed: $(cat "$W/resume.out")"
    _try=$((_try + 1))
  done
  PINS="$PINS $_try"
}
unpin() {
  kc resume "$1" >"$W/resume.out" 2>&1 || fail "$2: k7d resume $1 failed: $(cat "$W/resume.out")"
}
# delete_all WHAT VM...: deletes the VMs at once (a round's children: one
# at a time they cost a draw period of the round), each answer checked.
delete_all() {
  _what=$1; shift
  _pids=
  for _v in "$@"; do
    kc delete "$_v" >"$W/delete-$_v.out" 2>&1 &
    _pids="$_pids $_v:$!"
  done
  for _p in $_pids; do
    wait "${_p#*:}" || fail "$_what: k7d delete ${_p%%:*} failed: $(cat "$W/delete-${_p%%:*}.out")"
  done
}

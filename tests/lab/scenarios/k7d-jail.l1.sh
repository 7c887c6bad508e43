# The VMM command of the scenarios that run their VM in a VM process
# (k7d-blk-jail, k7d-net-jail): `sh k7d-jail.l1.sh K7D CREATE-ARGS...` runs
# one VM (id vm) under `k7d daemon --jail on`, prints what `create` said
# ("k7d-jail: create: ..." lines: its devices), then its serial log as a
# console would, until the VM stops; then the daemon's last word on it
# ("k7d: vm vm: stopped (guest poweroff)") and exit 0 when the guest powered
# off. While the guest runs it records what the VM process is, for the
# scenario's checks: /tmp/k7d-jail/{status,root,mnt-ns,fds}, and its cgroup
# leaf (the daemon's default, under /sys/fs/cgroup/k7d on cgroup v2):
# /tmp/k7d-jail/{cgroup,cgroup-dir,memory.max,cpu.max,memory_mib,vcpus}.
set -u
K=$1
shift
J=/tmp/k7d-jail
rm -rf "$J"
mkdir -p "$J"
grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts || mount -t cgroup2 cgroup2 /sys/fs/cgroup ||
  { echo "k7d-jail: cannot mount cgroup2 at /sys/fs/cgroup"; exit 93; }
"$K" daemon --jail on --state-dir "$J/state" --socket "$J/k7d.sock" >"$J/daemon.log" 2>&1 &
D=$!
stop() {
  "$K" --socket "$J/k7d.sock" delete vm >/dev/null 2>&1
  kill "$D" 2>/dev/null
  wait "$D" 2>/dev/null
}
trap stop EXIT
k() { "$K" --socket "$J/k7d.sock" "$@"; }
i=0
until k list >/dev/null 2>&1; do
  i=$((i + 1))
  [ $i -lt 600 ] || { echo "k7d-jail: the daemon did not start: $(tail -n3 "$J/daemon.log")"; exit 90; }
  sleep 0.1
done
k create --id vm "$@" --start >"$J/create.out" 2>&1 || { echo "k7d-jail: create failed: $(cat "$J/create.out")"; exit 91; }
sed 's/^ */k7d-jail: create: /' "$J/create.out"
LOG=$J/state/vms/vm/serial.log
# What the guest printed since the last call: bytes from offset $off on.
# (Not `tail -f`: killed when the VM stops, it could leave the log's last
# lines unprinted; the guest's final verdict is in them.)
off=0
flush() {
  size=$(wc -c <"$LOG")
  if [ "$size" -gt "$off" ]; then
    tail -c +$((off + 1)) "$LOG" | head -c $((size - off))
    off=$size
  fi
}
info=$(k --json info vm | tr -d ' \n')
pid=$(printf '%s' "$info" | sed -n 's/.*"vm_process":{[^}]*"pid":\([0-9]*\).*/\1/p')
[ -n "$pid" ] || { echo "k7d-jail: vm vm has no VM process: $(k info vm)"; exit 92; }
cg=$(printf '%s' "$info" | sed -n 's/.*"vm_process":{[^}]*"cgroup":"\([^"]*\)".*/\1/p')
printf '%s\n' "$cg" >"$J/cgroup-dir"
cat "/proc/$pid/cgroup" >"$J/cgroup"
[ -z "$cg" ] || { cat "$cg/memory.max" >"$J/memory.max"; cat "$cg/cpu.max" >"$J/cpu.max"; }
printf '%s' "$info" | sed -n 's/.*"memory_mib":\([0-9]*\).*/\1/p' >"$J/memory_mib"
printf '%s' "$info" | sed -n 's/.*"vcpus":\([0-9]*\).*/\1/p' >"$J/vcpus"
grep -E '^(Uid|NoNewPrivs|CapEff|Seccomp):' "/proc/$pid/status" >"$J/status"
ls -A "/proc/$pid/root" >"$J/root" 2>&1
readlink "/proc/$pid/ns/mnt" >"$J/mnt-ns"
ls -l "/proc/$pid/fd" | sed 's/^.* \([0-9]* -> \)/\1/' >"$J/fds.tmp"
sed 's/^/ /' "$J/fds.tmp" >"$J/fds"
while :; do
  flush
  st=$(k info vm 2>&1 | head -n1)
  case $st in *stopped*) break ;; esac
  sleep 0.5
done
# The VM is stopped: its serial log is complete.
flush
echo "k7d: $st"
case $st in *"stopped (guest poweroff)"*) exit 0 ;; *) exit 1 ;; esac

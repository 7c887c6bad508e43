# lab: description=k7d exec (issue 37) and the agent's reseed of fork children (issue 40): commands run in a plain VM by its guest agent, through the daemon's default (a VM process): output and exit status, stdout and stderr apart, stdin, env, cwd and user, a timeout, refusals; the same in two fork children (each its own) and in a VM restored from a snapshot
# lab: default=yes
# lab: timeout=600
# lab: bin=required
# lab: pod-initramfs=required
# lab: guest=k7d-vmgenid
# lab: prepare=k7d-exec
# lab: l1-python=k7d hashlib argparse locale shutil textwrap struct fcntl termios select
# lab: files=vmm/python/examples/rollout.py
#
# Issue 37, item 2: `k7d exec VM [--env K=V] [--cwd DIR] [--user U:G]
# [--timeout S] -- CMD ARGS...` in a plain VM (not a pod), a fork child and
# a restored VM alike. The VM boots the pod initramfs (k7d-agent as its
# init) with the lab's busybox initramfs unpacked under it (so the guest
# has /bin/busybox to run; the agent's /init wins), 1 vCPU, 256 MiB and a
# vsock device, under `k7d daemon` with its default (--jail on). Checks:
#  1. `uname -r` prints the L2 kernel's release (not L1's);
#  2. `sh -c 'echo out; echo err >&2; exit 7'`: stdout "out", stderr
#     "err", apart, and k7d exec exits 7; a command killed by SIGTERM
#     exits 143;
#  2b. --tty: the command on a pty (`tty` names /dev/pts/N; stdin, stdout
#     and stderr all terminals; stderr comes through it, with the pty's
#     \r\n line endings), its exit status k7d exec's;
#  2c. --tty follows a resize: k7d exec on a pty of L1's (Python's), the
#     guest's `stty size` 24 80, then 50 132 once L1's pty is resized
#     (SIGWINCH);
#  3. stdin is forwarded to `cat` and its end ends it; 1 MiB of random
#     stdin has the same sha256 in the guest;
#  4. --env, --cwd and --user reach the command (`echo $A $(pwd) uid:gid`);
#  5. --timeout 1 kills `sleep 30`: exit 137 within 5 s (a budget);
#  6. refused with one sentence: a program the guest lacks, a VM without
#     vsock; nothing of the exec is left in the agent (a second exec works);
#  6c. the daemon's `exec` op, as `k7d exec --api` (and the Python
#      client's Client.exec) send it: exit 7 with stdout and stderr apart,
#      256 KiB of stdin summed in the guest, env/cwd/user, a timeout as
#      137, a missing program in the agent's words; the event log has an
#      exec event per command with its program and status, no arguments;
#  6b. `k7d cp` both ways (busybox's applets linked in the guest for tar
#     and sh): a tree of a 1 MiB random file (mode 751, owner 1234:5678), a
#     symlink and an empty directory into x and back out, its sum, mode,
#     owner and link kept; a file to a new name; 4 MiB past --max-size 1 MiB
#     refused with nothing left; a missing path refused in one sentence;
#  7. fork --count 2: exec works in each child at its own socket; a file
#     one child writes is not in the other child nor in the source;
#  7c. the `exec` op from Python: Debian's Python 3.11 in L1 (l1-python)
#      with the k7d client: Client.exec in x-f1 and x-f2 (exit 7 with the
#      streams apart, 256 KiB of stdin summed in the guest, a child's own
#      file read as 65534:65533 in a given cwd, a 1 s timeout as 137 and
#      timed_out, a missing program raised as InvalidArgument); streamed
#      with on_output (the first chunk before the command ends, 5 MiB past
#      the buffered bound whole, stderr apart); and
#      Client.copy_to/copy_from in x-f2: a tree (1 MiB 751 1234:5678, a
#      symlink: sliced through the guest's /tmp) in and back alike, 4 MiB
#      back in slices, a copy past max_size refused, nothing left; a
#      hostile guest (a fake sh first on the agent's PATH) answering a
#      copy out with an entry "tree/../../escape" or one claiming 10 GiB:
#      refused by Client.copy_from and by k7d cp, nothing written outside;
#  7d. exec against its floor (issue 37's benchmark, figures only): the
#      API's exec of `true` (p50 of 20; the daemon's part of it; the
#      agent's `run` of it on an open connection) beside a request's round
#      trip to the agent on an open vsock connection, a new connection's,
#      and the guest's own spawn of `true` (k7d_exec.api_true_ms,
#      .daemon_exec_ms, .agent_run_ms, .vsock_echo_ms, .vsock_connect_ms,
#      .guest_spawn_ms, .api_vs_floor);
#  7b. `k7d exec --cluster`: x-f1, x-f2 and a third child form cluster cl,
#     `fork cl` makes cluster cl-f1 (3 children, each reseeded through its
#     agent, no warning); `exec --cluster cl-f1 -- cat /tmp/mark` answers 3
#     lines, each after its member's id, each member its own source's mark
#     (child-one for x-f1's child); a write through it reaches no source;
#     each member's stderr lines come apart; `exit 3` in all gives 3;
#  8. the agent reseeds (issue 40, item 2: this cloud kernel has no vmgenid
#     driver): `k7d info x` says rng_reseed agent (x-f1 and x-f2 were
#     reseeded through their agents, so x has one). x then runs the draw
#     loop of k7d-vmgenid.guest.sh (started through exec, on its serial
#     console: every $LAB_RESEED_NAP s, default 20, a wake line, then 0.2 s
#     later 16 bytes of /dev/urandom). $LAB_RESEED_ROUNDS times (1; 20 by
#     hand for issue 40's count): x paused asleep (pin_asleep, as in
#     k7d-vmgenid, within 3 s of its draw line: $LAB_RESEED_FRESH_S),
#     `fork x --count 8`, x resumed: the answer says
#     rng_reseed agent for each child and carries no shared-RNG warning;
#     each child's agent logged "reseed: entropy 64 bytes" (once both ioctls
#     succeeded) before the child's first wake line, so before its first
#     draw; the 8 children's first draws and x's at the same n are 9
#     different draws. The check can fail: with --no-agent-reseed (the
#     caller's reseed, which nobody makes here) no child logs a reseed,
#     each says no_driver, and at least one first draw repeats another
#     (one vCPU: the same RNG state draws the same bytes), in one of up to
#     3 such forks (the kernel's own reseed, a minute after its last, may
#     fall on a first draw and part the children). Then the daemon
#     is killed -9 and started again: x is re-attached and info still says
#     agent (the VM's record keeps it).
#  9. snapshot, delete, restore: exec works in the restored VM and sees the
#     file the source wrote before the snapshot, and it was reseeded
#     (rng_reseed agent).
#  9b. the rollout example (vmm/python/examples/rollout.py, Debian's Python
#      in L1) on r: 3 steps of 4 children through Client.exec, each child
#      its source's state and its own action only, the best child the next
#      source (a fork of a fork), nothing left after; fork to the first
#      exec's answer in a child (p50) beside an exec on the source.
# 10. the agent in a user's image (issue 37, item 1): a VM boots k7d's pod
#     initramfs alone with root=UUID=... rootfstype=erofs ro (its filesystem UUID), the disk an
#     image with no agent (k7d-exec.prepare.sh: busybox, its init and an
#     inittab): exec runs in the image's root (its marker file), PID 1 is
#     the image's /sbin/init, whose inittab ran, exit 5 comes back, the
#     agent said it handed over; the battery of parts 1-6b in it (echo,
#     streams and exit 7, 1 MiB of stdin, env/cwd/user, a timeout, --tty
#     with a resize, k7d cp both ways with sum, mode, owner and link); a fork of it is reached at its own socket
#     and reseeded through its agent. A VM with root=/dev/vdz (no such
#     disk): the agent says the root did not appear and serves from the
#     initramfs (PID 1 is the agent).
# 10b. the agent installed as a service (issue 37, item 1: "a user who
#     prefers can install it as a service"): the image with k7d-agent in
#     /usr/local/bin and an inittab line running `k7d-agent --vsock`, booted
#     with k7d.agent=image: exec is run by the image's agent (its parent's
#     exe and command line), in the image's root.
# Metrics: k7d_exec.first_ms (`true`, connect to exit), k7d_exec.ms (median
# of 5 `true`), k7d_exec.child_ms (the first exec in a fork child),
# k7d_exec.reseed_ms (median: a fork child's start to its agent's reseed),
# k7d_rollout.fork_to_first_exec_ms, .exec_in_child_ms, .exec_on_source_ms
# (p50s of the rollout example).
# By hand: tests/lab/run.sh --bin target/release/k7d --agent target/release/k7d-agent k7d-exec
# Issue 40's 20 rounds (~20 min of L1, a round's ~50 s without a line on
# the console): LAB_RESEED_ROUNDS=20 K7D_LAB_SILENT_S=900 K7D_LAB_TIMEOUT=2400
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
[ -f "${LAB_POD_INITRD:-}" ] || lab_fail "no pod initramfs (run.sh --agent PATH)"
W=/tmp/k7d-exec st=/tmp/k7d-exec/state sock=/tmp/k7d-exec/k7d.sock DLOG=/tmp/k7d-exec/daemon.log
mkdir -p "$W"
dpid=
# The draw loop's sleep (part 8) and how soon after a draw line x must be
# paused. A fork child's guest clock reads host time: the seconds the
# daemon takes to build a batch of 8 in L1 (5-10 s) count against the sleep
# it inherits, and its agent's reseed lands 1-4 s after its start; 20 s,
# paused within 3 s, leaves each child at least 17 s from the fork instant
# to its first draw (CHALLENGES.md).
NAP=${LAB_RESEED_NAP:-20} PIN_FRESH_S=${LAB_RESEED_FRESH_S:-3}
kc() { timeout -s KILL 60 "$LAB_BIN" --socket "$sock" "$@"; }
# ex VM ARGS... -- CMD...: k7d exec, stdout to $W/o, stderr to $W/e, rc in $rc.
ex() {
  timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec "$@" >"$W/o" 2>"$W/e" </dev/null
  rc=$?
}
# booted VM: k7d exec of `true` in VM until it answers (its guest booted
# and its agent serves), at most 180 s from t0.
booted() {
  until ex "$1" -- busybox true && [ "$rc" = 0 ]; do
    [ $(($(date +%s) - t0)) -lt 180 ] || fail "$1: k7d exec never succeeded within 180 s: rc $rc: $(cat "$W/e") (serial: $(tail -c 600 "$st/vms/$1/serial.log" | tr '\n' '|'))"
    sleep 1
  done
}
fail() {
  [ ! -s "$DLOG" ] || echo "lab: k7d daemon log (tail): $(tail -n 5 "$DLOG" | tr '\n' ' ')"
  for v in x x-f1 x-f2 r; do
    [ ! -s "$st/vms/$v/serial.log" ] || echo "lab: $v serial (tail): $(tail -c 600 "$st/vms/$v/serial.log" | tr '\n' '|')"
  done
  [ -z "$dpid" ] || kill -9 "$dpid" 2>/dev/null
  lab_fail "$*"
}
json_str() { sed -n "s/.*\"$1\": *\"\([^\"]*\)\".*/\1/p" "$2" | head -n1; }
ms_now() { awk -v t="$(lab_now)" 'BEGIN { printf "%d", t * 1000 }'; }

# The guest's initramfs: busybox first, the agent's archive over it.
cat "$LAB_INITRD" "$LAB_POD_INITRD" >"$W/initrd.cpio"
lab_daemon_start "$st" "$sock" "$DLOG"
kc create --id x --kernel "$LAB_KERNEL" --initrd "$W/initrd.cpio" \
  --cmdline "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check" \
  --vcpus 1 --memory 256 --vsock "cid=3,uds=$W/x.vsock" --start >"$W/create.out" 2>&1 ||
  fail "k7d create failed: $(cat "$W/create.out")"
lab_where "$sock" x
lab_note "vm x $where"

# The agent answers once the guest has booted.
t0=$(date +%s)
booted x
lab_note "the agent answered $(($(date +%s) - t0)) s after the create"
t=$(ms_now); ex x -- busybox true; first=$(($(ms_now) - t))
[ "$rc" = 0 ] || fail "exec true: rc $rc: $(cat "$W/e")"
lab_metric k7d_exec.first_ms "$first" ms
times=
for _ in 1 2 3 4 5; do
  t=$(ms_now); ex x -- busybox true; times="$times $(($(ms_now) - t))"
  [ "$rc" = 0 ] || fail "exec true: rc $rc: $(cat "$W/e")"
done
med=$(printf '%s\n' $times | sort -n | sed -n 3p)
lab_metric k7d_exec.ms "$med" ms
lab_note "exec true: $times ms"

# 1. The guest's kernel.
ex x -- busybox uname -r
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "$LAB_L2_KERNEL_RELEASE" ] ||
  fail "uname -r: rc $rc, out '$(cat "$W/o")', want $LAB_L2_KERNEL_RELEASE (L1 is $(uname -r))"
lab_note "uname -r: $(cat "$W/o")"

# 2. Streams apart, the exit status, a signal.
ex x -- busybox sh -c 'echo out; echo err >&2; exit 7'
[ "$rc" = 7 ] || fail "exit 7: k7d exec exited $rc ($(cat "$W/e"))"
[ "$(cat "$W/o")" = out ] && [ "$(cat "$W/e")" = err ] ||
  fail "streams: stdout '$(cat "$W/o")' stderr '$(cat "$W/e")', want out / err"
ex x -- busybox sh -c 'kill -TERM $$'
[ "$rc" = 143 ] || fail "a command killed by SIGTERM: k7d exec exited $rc, want 143"
lab_note "stdout and stderr apart, exit 7, SIGTERM as 143"

# 2b. --tty: a pty of the agent's, the command's stdin, stdout and stderr.
ex x --tty -- busybox sh -c 'busybox tty; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-three; echo err >&2; exit 4'
tr -d '\r' <"$W/o" >"$W/o2"
[ "$rc" = 4 ] && grep -q '^/dev/pts/[0-9]' "$W/o2" && grep -qx all-three "$W/o2" && grep -qx err "$W/o2" && [ ! -s "$W/e" ] ||
  fail "--tty: rc $rc, out '$(tr '\n' '|' <"$W/o2")', err '$(cat "$W/e")' (want 4, a /dev/pts name, all-three and err on stdout)"
grep -q "$(printf '\r')" "$W/o" || fail "--tty: the output has no carriage return: it did not pass a pty's line discipline"
lab_note "--tty: the command on $(head -n1 "$W/o2"), stdin, stdout and stderr terminals, stderr through it, exit 4"

# 2c. --tty follows a resize: k7d exec on a pty of L1's (Python's, its
# controlling terminal, 24x80); once the guest's pty says 24 80, the L1
# pty is resized to 50x132 (the kernel sends k7d SIGWINCH), and the
# guest's pty must come to say 50 132.
# winch VM: k7d exec --tty in VM follows a resize (part 2c; part 10 in a
# user's image).
winch() {
  PYTHONPATH=/lab/python timeout -s KILL 120 python3 - "$LAB_BIN" "$sock" "$1" >"$W/winch.out" 2>&1 <<'PY'
import fcntl
import os
import select
import struct
import sys
import termios
import time

k7d, sock, vm = sys.argv[1], sys.argv[2], sys.argv[3]
script = ('busybox stty size; i=0; while [ "$(busybox stty size)" = "24 80" ] && [ $i -lt 150 ]; '
          'do busybox sleep 0.2; i=$((i+1)); done; busybox stty size; exit 4')
m, s = os.openpty()
fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
pid = os.fork()
if pid == 0:
    os.setsid()
    fcntl.ioctl(s, termios.TIOCSCTTY, 0)
    for fd in (0, 1, 2):
        os.dup2(s, fd)
    os.execv(k7d, [k7d, "--socket", sock, "exec", "--tty", vm, "--", "busybox", "sh", "-c", script])
os.close(s)
out, resized, deadline = b"", False, time.monotonic() + 90
while time.monotonic() < deadline:
    if select.select([m], [], [], 0.5)[0]:
        try:
            chunk = os.read(m, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    if not resized and b"24 80" in out:
        fcntl.ioctl(m, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))
        resized = True
_, status = os.waitpid(pid, 0)
lines = out.replace(b"\r", b"").decode(errors="replace").split("\n")
print("lines:", lines, "status:", os.waitstatus_to_exitcode(status))
assert resized and "24 80" in lines and "50 132" in lines and os.waitstatus_to_exitcode(status) == 4
print("winch-ok")
PY
  rc=$?
  [ "$rc" = 0 ] && grep -qx winch-ok "$W/winch.out" || fail "$1: --tty did not follow a resize: rc $rc: $(tail -c 1500 "$W/winch.out")"
}
winch x
lab_note "--tty follows a resize: the guest's pty said 24 80, then 50 132 after L1's pty was resized (SIGWINCH), exit 4"

# 3. stdin.
printf 'line one\nline two\n' | timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec x -- busybox cat >"$W/o" 2>"$W/e"
rc=$?
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "$(printf 'line one\nline two')" ] ||
  fail "stdin: rc $rc, out '$(cat "$W/o")' ($(cat "$W/e"))"
head -c 1048576 /dev/urandom >"$W/mib"
timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec x -- busybox sha256sum <"$W/mib" >"$W/o" 2>"$W/e"
rc=$?
[ "$rc" = 0 ] && [ "$(cut -d' ' -f1 "$W/o")" = "$(sha256sum <"$W/mib" | cut -d' ' -f1)" ] ||
  fail "1 MiB of stdin: rc $rc, the guest's sum '$(cat "$W/o")' ($(cat "$W/e"))"
lab_note "stdin forwarded to cat, its end ended it; 1 MiB of stdin summed alike in the guest"

# 4. env, cwd, user.
ex x --env A=b --env B='c d' --cwd /tmp --user 65534:65533 -- \
  busybox sh -c 'echo "$A|$B|$(busybox pwd)|$(busybox id -u):$(busybox id -g)|$(busybox id -G)"'
want="b|c d|/tmp|65534:65533|65533"
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "$want" ] || fail "env/cwd/user: rc $rc, out '$(cat "$W/o")', want '$want' ($(cat "$W/e"))"
lab_note "env, cwd, user: $(cat "$W/o")"

# 5. A timeout.
t=$(date +%s)
ex x --timeout 1 -- busybox sleep 30
took=$(($(date +%s) - t))
[ "$rc" = 137 ] || fail "--timeout 1 sleep 30: k7d exec exited $rc ($(cat "$W/e"))"
# A budget (LATENCY_BUDGETS.md): killed and reported 1-2 s after the start
# (whole seconds), so 5 s.
[ "$took" -le 5 ] || fail "k7d exec --timeout 1 of sleep 30 ended $took s after its start (limit 5 s)"
grep -q "ran past --timeout 1 s and was killed" "$W/e" || fail "--timeout: it did not say so: $(cat "$W/e")"
lab_note "--timeout 1: killed, 137, after $took s"

# 6. Refusals, in one sentence each; the agent serves on.
ex x -- no-such-program
[ "$rc" != 0 ] || fail "a missing program: k7d exec exited 0"
[ "$(wc -l <"$W/e")" = 1 ] && grep -q "no-such-program: not found in the VM's PATH" "$W/e" ||
  fail "a missing program: $(cat "$W/e")"
lab_note "a missing program: $(cat "$W/e")"
kc create --id plain --builtin hello >"$W/create-plain.out" 2>&1 || fail "create plain: $(cat "$W/create-plain.out")"
ex plain -- busybox true
[ "$rc" != 0 ] && grep -q "vm plain has no vsock device" "$W/e" || fail "a VM without vsock: rc $rc: $(cat "$W/e")"
kc delete plain >/dev/null || fail "delete plain failed"
ex x -- busybox true
[ "$rc" = 0 ] || fail "exec after the refusals: rc $rc ($(cat "$W/e"))"

# 6c. The daemon's `exec` op (the API's, and the Python client's): k7d exec
# --api sends it; the daemon runs the agent calls and answers once.
ex x --api -- busybox sh -c 'echo out; echo err >&2; exit 7'
[ "$rc" = 7 ] && [ "$(cat "$W/o")" = out ] && [ "$(cat "$W/e")" = err ] ||
  fail "exec --api: rc $rc, stdout '$(cat "$W/o")', stderr '$(cat "$W/e")' (want 7, out, err)"
head -c 262144 /dev/urandom >"$W/api-in"
timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec --api x -- busybox sha256sum <"$W/api-in" >"$W/o" 2>"$W/e"
rc=$?
[ "$rc" = 0 ] && [ "$(cut -d' ' -f1 "$W/o")" = "$(sha256sum <"$W/api-in" | cut -d' ' -f1)" ] ||
  fail "exec --api with 256 KiB of stdin: rc $rc, '$(cat "$W/o")' ($(cat "$W/e"))"
ex x --api --cwd /tmp --user 65534:65533 --env A=b -- busybox sh -c 'echo "$A|$(busybox pwd)|$(busybox id -u):$(busybox id -g)"'
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "b|/tmp|65534:65533" ] || fail "exec --api env/cwd/user: rc $rc, '$(cat "$W/o")' ($(cat "$W/e"))"
t=$(date +%s)
ex x --api --timeout 1 -- busybox sleep 30
took=$(($(date +%s) - t))
[ "$took" -le 5 ] || fail "the exec op's timeout_s 1 of sleep 30 ended $took s after its start (limit 5 s)"
[ "$rc" = 137 ] && grep -q "ran past its timeout (1 s) and was killed" "$W/e" ||
  fail "exec --api --timeout 1 sleep 30: rc $rc after $took s ($(cat "$W/e"))"
ex x --api -- no-such-program
[ "$rc" != 0 ] && grep -q "no-such-program: not found in the VM's PATH" "$W/e" || fail "exec --api, a missing program: rc $rc ($(cat "$W/e"))"
# The event log says what ran and how it ended, never its arguments.
grep '"event":"exec"' "$st/events.jsonl" >"$W/exec-events" || fail "no exec event in $st/events.jsonl"
grep -q '"program":"busybox".*"status":7' "$W/exec-events" || fail "the exec events: $(cat "$W/exec-events")"
! grep -q 'echo out' "$W/exec-events" || fail "an exec event holds the command's arguments: $(cat "$W/exec-events")"
lab_note "the daemon's exec op (k7d exec --api): exit 7 with stdout and stderr apart, 256 KiB of stdin summed in the guest, env, cwd and user, --timeout 1 as 137 after $took s, a missing program refused in the agent's words; $(wc -l <"$W/exec-events") exec events, none with arguments"

# 6b. k7d cp both ways (tar and sh in the guest: busybox's applets linked).
ex x -- busybox --install -s /bin
[ "$rc" = 0 ] || fail "linking busybox's applets: rc $rc ($(cat "$W/e"))"
mkdir -p "$W/cpsrc/tree/sub/empty" && head -c 1048576 /dev/urandom >"$W/cpsrc/tree/sub/rand.bin" &&
  chmod 751 "$W/cpsrc/tree/sub/rand.bin" && chown 1234:5678 "$W/cpsrc/tree/sub/rand.bin" &&
  ln -s sub/rand.bin "$W/cpsrc/tree/link" || fail "making the tree to copy failed"
sum=$(sha256sum <"$W/cpsrc/tree/sub/rand.bin" | cut -d' ' -f1)
kc cp "$W/cpsrc/tree" x:/tmp/ >"$W/cp.out" 2>&1 || fail "k7d cp tree x:/tmp/ failed: $(cat "$W/cp.out")"
ex x -- busybox sh -c 'cd /tmp/tree && busybox sha256sum <sub/rand.bin | busybox cut -d" " -f1 && busybox stat -c "%a %u:%g" sub/rand.bin && busybox readlink link && busybox test -d sub/empty && echo dir'
[ "$rc" = 0 ] && [ "$(tr '\n' '|' <"$W/o")" = "$sum|751 1234:5678|sub/rand.bin|dir|" ] ||
  fail "k7d cp into x: the guest has '$(tr '\n' '|' <"$W/o")' (rc $rc, $(cat "$W/e")), want $sum, 751 1234:5678, the link, the empty dir"
kc cp x:/tmp/tree "$W/back" >"$W/cp.out" 2>&1 || fail "k7d cp x:/tmp/tree back failed: $(cat "$W/cp.out")"
[ "$(sha256sum <"$W/back/sub/rand.bin" | cut -d' ' -f1)" = "$sum" ] && [ "$(stat -c '%a %u:%g' "$W/back/sub/rand.bin")" = "751 1234:5678" ] &&
  [ "$(readlink "$W/back/link")" = sub/rand.bin ] && [ -d "$W/back/sub/empty" ] ||
  fail "k7d cp from x: $(ls -lR "$W/back" 2>&1 | tr '\n' '|')"
kc cp "$W/cpsrc/tree/sub/rand.bin" x:/tmp/r2.bin >"$W/cp.out" 2>&1 || fail "k7d cp a file to a new name failed: $(cat "$W/cp.out")"
ex x -- busybox sh -c 'busybox sha256sum </tmp/r2.bin | busybox cut -d" " -f1'
[ "$(cat "$W/o")" = "$sum" ] || fail "k7d cp a file to a new name: '$(cat "$W/o")'"
# Bounded: a copy past --max-size is refused and leaves nothing.
ex x -- busybox dd if=/dev/zero of=/tmp/big bs=1048576 count=4
kc cp --max-size 1048576 x:/tmp/big "$W/big" >"$W/cp.out" 2>&1 && fail "k7d cp of 4 MiB with --max-size 1 MiB succeeded"
grep -q "larger than 1048576 bytes" "$W/cp.out" || fail "k7d cp past --max-size: $(cat "$W/cp.out")"
[ ! -e "$W/big" ] && [ -z "$(ls -A "$W" | grep '^\.k7d-cp')" ] || fail "k7d cp past --max-size left $(ls -A "$W" | tr '\n' ' ')"
kc cp x:/no/such "$W/none" >"$W/cp.out" 2>&1 && fail "k7d cp of a missing path succeeded"
[ "$(wc -l <"$W/cp.out")" = 1 ] && grep -q "packing /no/such failed" "$W/cp.out" || fail "k7d cp of a missing path: $(cat "$W/cp.out")"
lab_note "k7d cp: a tree (1 MiB random file 751 1234:5678, a symlink, an empty dir) in and out with its sum, mode, owner and link kept; a file to a new name; 4 MiB past --max-size 1 MiB refused, nothing left; a missing path: $(cat "$W/cp.out")"

# 7. Fork children: each its own agent at its own socket.
ex x -- busybox sh -c 'echo before-fork >/tmp/mark'
[ "$rc" = 0 ] || fail "writing the mark: rc $rc ($(cat "$W/e"))"
kc fork x --count 2 >"$W/fork.out" 2>&1 || fail "fork failed: $(cat "$W/fork.out")"
lab_where "$sock" x-f1 x-f2
lab_note "children $where"
t=$(ms_now); ex x-f1 -- busybox cat /tmp/mark; child=$(($(ms_now) - t))
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = before-fork ] || fail "x-f1 reads the mark: rc $rc out '$(cat "$W/o")' ($(cat "$W/e"))"
lab_metric k7d_exec.child_ms "$child" ms
ex x-f1 -- busybox sh -c 'echo child-one >/tmp/mark'
[ "$rc" = 0 ] || fail "x-f1 writes: rc $rc ($(cat "$W/e"))"
ex x-f2 -- busybox cat /tmp/mark
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = before-fork ] || fail "x-f2 sees '$(cat "$W/o")' (rc $rc), want before-fork"
ex x -- busybox cat /tmp/mark
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = before-fork ] || fail "the source sees '$(cat "$W/o")' (rc $rc), want before-fork"
ex x-f1 -- busybox cat /tmp/mark
[ "$(cat "$W/o")" = child-one ] || fail "x-f1 lost its own write: '$(cat "$W/o")'"
lab_note "fork children: each exec'd at its own socket, a child's write in that child only"

# 7c. The daemon's exec op from Python (Debian's Python in L1 and the k7d
# client, l1-python), in the fork children, as an RL loop acts in them.
PYTHONPATH=/lab/python timeout -s KILL 180 python3 - "$sock" >"$W/py.out" 2>&1 <<'PY'
import hashlib
import sys

import k7d

k = k7d.Client(sys.argv[1], timeout=60)
r = k.exec("x-f2", ["busybox", "sh", "-c", "echo out; echo err >&2; exit 7"])
assert (r.status, r.stdout, r.stderr, r.timed_out, r.truncated) == (7, b"out\n", b"err\n", False, False), r
data = bytes(range(256)) * 1024
r = k.exec("x-f2", ["busybox", "sha256sum"], stdin=data)
assert r.status == 0 and r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest(), r
r = k.exec("x-f1", ["busybox", "sh", "-c", "busybox cat mark; busybox id -u; busybox id -g"], user=(65534, 65533), cwd="/tmp")
assert r.status == 0 and r.stdout.split() == [b"child-one", b"65534", b"65533"], r
r = k.exec("x-f2", ["busybox", "sleep", "30"], timeout=1)
assert r.status == 137 and r.timed_out, r
try:
    k.exec("x-f1", ["no-such-program"])
    raise SystemExit("a missing program ran")
except k7d.InvalidArgument as e:
    assert "not found in the VM's PATH" in str(e), e
# Streamed (on_output): each chunk as it comes, the first before the
# command's end, 5 MiB (past the buffered 4 MiB bound) whole.
import time

chunks = []
t0 = time.monotonic()
r = k.exec(
    "x-f2",
    ["sh", "-c", "echo first; sleep 2; echo err >&2; dd if=/dev/zero bs=1048576 count=5 2>/dev/null"],
    on_output=lambda stream, data: chunks.append((stream, data, time.monotonic() - t0)),
)
total = time.monotonic() - t0
assert (r.status, r.stdout, r.stderr, r.truncated) == (0, b"", b"", False), r
assert b"".join(d for s, d, _ in chunks if s == "stdout") == b"first\n" + bytes(5 << 20)
assert b"".join(d for s, d, _ in chunks if s == "stderr") == b"err\n"
assert chunks[0][1].startswith(b"first") and chunks[0][2] < total - 1.5, (chunks[0][2], total)
# Files both ways (Client.copy_to, Client.copy_from): a tree whose 1 MiB
# file is more than one exec's stdin (sliced through the guest's /tmp),
# 4 MiB back (more than one exec's output: sliced), a copy past max_size.
import os
import tempfile

work = tempfile.mkdtemp(prefix="k7d-pycp.", dir="/tmp")
tree = os.path.join(work, "tree")
os.makedirs(os.path.join(tree, "sub"))
blob = os.urandom(1 << 20)
with open(os.path.join(tree, "sub", "rand.bin"), "wb") as f:
    f.write(blob)
os.chmod(os.path.join(tree, "sub", "rand.bin"), 0o751)
os.chown(os.path.join(tree, "sub", "rand.bin"), 1234, 5678)
os.symlink("sub/rand.bin", os.path.join(tree, "link"))
want = hashlib.sha256(blob).hexdigest().encode()
k.copy_to("x-f2", tree, "/tmp/")
r = k.exec("x-f2", ["sh", "-c", "cd /tmp/tree && sha256sum <sub/rand.bin | cut -d' ' -f1 && stat -c '%a %u:%g' sub/rand.bin && readlink link"])
assert r.status == 0 and r.stdout.split(b"\n")[:3] == [want, b"751 1234:5678", b"sub/rand.bin"], r
back = os.path.join(work, "back")
os.mkdir(back)
k.copy_from("x-f2", "/tmp/tree", back)
got = os.path.join(back, "tree", "sub", "rand.bin")
st = os.stat(got)
with open(got, "rb") as f:
    assert hashlib.sha256(f.read()).hexdigest().encode() == want
assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o751, 1234, 5678), st
assert os.readlink(os.path.join(back, "tree", "link")) == "sub/rand.bin"
k.copy_from("x-f2", "/tmp/big", back)
assert os.path.getsize(os.path.join(back, "big")) == 4 << 20
try:
    k.copy_from("x-f2", "/tmp/big", os.path.join(back, "big2"), max_size=1 << 20)
    raise SystemExit("a copy past max_size was taken")
except k7d.CopyRefused as e:
    assert "larger than 1048576 bytes" in str(e), e
assert sorted(os.listdir(back)) == ["big", "tree"], os.listdir(back)
r = k.exec("x-f2", ["sh", "-c", "ls -a /tmp | grep -c '^.k7d-cp' || true"])
assert r.stdout.strip() == b"0", r
# A hostile guest: a `sh` first on the agent's PATH (/usr/sbin; busybox's
# own shell runs its applets, so a fake `tar` would not be reached)
# answers a copy out with an entry outside the copy, or one that claims
# 10 GiB.
import tarfile


def hostile(name, size, data):
    m = tarfile.TarInfo(name)
    m.size = size
    return m.tobuf(format=tarfile.GNU_FORMAT) + data + bytes(-len(data) % 512) + bytes(1024)


for name, data in (("escape", hostile("tree/../../escape", 4, b"evil")), ("huge", hostile("tree", 10 << 30, b"x" * 4096))):
    r = k.exec("x-f2", ["busybox", "sh", "-c", 'busybox cat >"/tmp/$1.tar"', "sh", name], stdin=data)
    assert r.status == 0, r
fake = "printf '#!/bin/busybox sh\\nexec /bin/busybox cat /tmp/%s.tar\\n' \"$1\" >/usr/sbin/sh && busybox chmod 755 /usr/sbin/sh"
for name, says in (("escape", "outside the copy"), ("huge", "broken")):
    r = k.exec("x-f2", ["busybox", "sh", "-c", fake, "sh", name])
    assert r.status == 0, r
    dest = os.path.join(work, "hostile-" + name)
    try:
        k.copy_from("x-f2", "/tmp/tree", dest)
        raise SystemExit(f"the hostile copy {name} was taken")
    except k7d.CopyRefused as e:
        assert says in str(e), (name, e)
    assert not os.path.lexists(dest) and not os.path.lexists(os.path.join(work, "escape")), os.listdir(work)
    assert not [p for p in os.listdir(work) if p.startswith(".k7d-cp")], os.listdir(work)
r = k.exec("x-f2", ["busybox", "rm", "-f", "/usr/sbin/sh"])
assert r.status == 0, r
print("python-exec-ok")
PY
rc=$?
[ "$rc" = 0 ] && grep -qx python-exec-ok "$W/py.out" || fail "the Python client's exec: rc $rc: $(tail -c 1500 "$W/py.out")"
# The same hostile guest against k7d cp: refused, nothing written outside.
for h in escape huge; do
  ex x-f2 -- busybox sh -c "printf '#!/bin/busybox sh\\nexec /bin/busybox cat /tmp/$h.tar\\n' >/usr/sbin/sh && busybox chmod 755 /usr/sbin/sh"
  [ "$rc" = 0 ] || fail "x-f2: the fake sh ($h): rc $rc ($(cat "$W/e"))"
  kc cp x-f2:/tmp/tree "$W/hostile-$h" >"$W/cp.out" 2>&1 && fail "k7d cp took the hostile copy $h"
  [ ! -e "$W/hostile-$h" ] && [ ! -e "$W/escape" ] && [ ! -e /tmp/escape ] && [ -z "$(ls -A "$W" | grep '^\.k7d-cp')" ] ||
    fail "k7d cp of the hostile copy $h left $(ls -A "$W" | tr '\n' ' ')"
  lab_note "k7d cp, a hostile guest's tar ($h): $(head -c 300 "$W/cp.out")"
done
ex x-f2 -- busybox rm -f /usr/sbin/sh /tmp/escape.tar /tmp/huge.tar
[ "$rc" = 0 ] || fail "x-f2: removing the fake sh: rc $rc ($(cat "$W/e"))"
lab_note "Client.exec from Debian's Python in L1, in the fork children: exit 7 with stdout and stderr apart, 256 KiB of stdin summed in x-f2, x-f1's own mark read as 65534:65533 in /tmp, a 1 s timeout as 137, a missing program raised as InvalidArgument; streamed (on_output): the first chunk before the end, 5 MiB whole, stderr apart; Client.copy_to and copy_from: a tree (1 MiB 751 1234:5678, a symlink) in and back with its sum, mode, owner and link, 4 MiB back in slices, past max_size refused, nothing left either side; a hostile guest's tar (an entry tree/../../escape, one claiming 10 GiB) refused, nothing written"

# 7d. exec against its floor (issue 37's benchmark; figures, not bounds):
# in x-f2, the API's exec of `true` (p50 of 20, from Python; and the
# daemon's own time for it, its `exec_ms`; and the agent's `run` of it on
# an open vsock connection, the part of it in the guest) beside one
# request's round trip to the agent on an open vsock connection (a Hello,
# p50 of 20), a new connection's (connect, CONNECT, Hello; an exec opens
# several), and the guest's own spawn of `true` (timed inside the guest).
PYTHONPATH=/lab/python timeout -s KILL 180 python3 - "$sock" >"$W/floor.out" 2>&1 <<'PY'
import json
import socket
import struct
import sys
import time

import k7d

k = k7d.Client(sys.argv[1], timeout=60)
uds = k.info("x-f2")["config"]["devices"]["vsock"]["uds"]
HELLO = json.dumps({"op": "hello", "args": {"version": 1}}).encode()


def p50(xs):
    return sorted(xs)[len(xs) // 2]


def roundtrip(s):
    """One request and its answer (a second Hello is answered with an
    error at once: the agent's least work)."""
    s.sendall(struct.pack(">I", len(HELLO)) + HELLO)
    n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
    return s.recv(n, socket.MSG_WAITALL)


def hello(s):
    assert b'"hello"' in roundtrip(s)


def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(uds)
    s.sendall(b"CONNECT 1024\n")
    line = b""
    while not line.endswith(b"\n"):
        line += s.recv(1)
    assert line.startswith(b"OK "), line
    hello(s)
    return s


def timed(f, n=20):
    out = []
    for _ in range(n):
        t = time.monotonic()
        f()
        out.append((time.monotonic() - t) * 1000)
    return p50(out)


RUN = json.dumps({"op": "run", "args": {"spec": {"args": ["busybox", "true"]}, "timeout_ms": 60000, "max_output": 4096}}).encode()


def run(s):
    """The agent's `run` of `true` on an open connection: frames up to its end."""
    s.sendall(struct.pack(">I", len(RUN)) + RUN)
    while True:
        n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
        frame = json.loads(s.recv(n, socket.MSG_WAITALL))
        assert "ok" in frame, frame
        if frame["ok"]["kind"] == "ran":
            assert frame["ok"]["value"]["status"] == 0, frame
            return


daemon_ms = []


def api_exec():
    r = k.exec("x-f2", ["busybox", "true"])
    assert r.status == 0, r
    daemon_ms.append(r.exec_ms)


api = timed(api_exec)
daemon = p50(daemon_ms)
s = connect()
echo = timed(lambda: roundtrip(s))
agent_run = timed(lambda: run(s))
s.close()
conn = timed(lambda: connect().close())
loop = "a=$(busybox cut -d' ' -f1 /proc/uptime); i=0; while [ $i -lt 50 ]; do /bin/busybox true; i=$((i+1)); done; busybox cut -d' ' -f1 /proc/uptime; echo $a"
r = k.exec("x-f2", ["busybox", "sh", "-c", loop])
b, a = (float(x) for x in r.stdout.split())
spawn = (b - a) * 1000 / 50
floor = echo + spawn
print("floor:", json.dumps({"api_true_ms": round(api, 1), "daemon_exec_ms": round(daemon, 2), "agent_run_ms": round(agent_run, 2),
                            "vsock_echo_ms": round(echo, 2), "vsock_connect_ms": round(conn, 2),
                            "guest_spawn_ms": round(spawn, 2), "api_vs_floor": round(api / floor, 2)}, sort_keys=True))
PY
rc=$?
line=$(sed -n 's/^floor: //p' "$W/floor.out")
[ "$rc" = 0 ] && [ -n "$line" ] || fail "exec against its floor: rc $rc: $(tail -c 1500 "$W/floor.out")"
for m in api_true_ms daemon_exec_ms agent_run_ms vsock_echo_ms vsock_connect_ms guest_spawn_ms; do
  lab_metric "k7d_exec.$m" "$(echo "$line" | sed -n "s/.*\"$m\": \([0-9.]*\).*/\1/p")" ms
done
lab_metric k7d_exec.api_vs_floor "$(echo "$line" | sed -n 's/.*"api_vs_floor": \([0-9.]*\).*/\1/p')" x
lab_note "exec against its floor in x-f2 (p50 of 20; issue 37's goal: exec <= 1.5x the floor, an echo on an open vsock connection plus the guest's spawn of true): $line"

# 7b. k7d exec --cluster.
timeout -s KILL 60 "$LAB_BIN" --socket "$sock" --json fork x >"$W/fork3.json" 2>&1 || fail "fork x (a third child) failed: $(cat "$W/fork3.json")"
c3=$(sed -n 's/.*"id": *"\(x-f[0-9]*\)".*/\1/p' "$W/fork3.json" | head -n1)
[ -n "$c3" ] || fail "fork x named no child: $(tr '\n' ' ' <"$W/fork3.json")"
kc cluster create cl x-f1 x-f2 "$c3" >"$W/cl.out" 2>&1 || fail "k7d cluster create cl x-f1 x-f2 $c3 failed: $(cat "$W/cl.out")"
timeout -s KILL 180 "$LAB_BIN" --socket "$sock" --json fork cl >"$W/fork-cl.json" 2>"$W/fork-cl.err" ||
  fail "fork cl failed: $(cat "$W/fork-cl.err" "$W/fork-cl.json" | tr '\n' ' ')"
! grep -q '"warnings"' "$W/fork-cl.json" || fail "fork cl warns: $(grep -A2 '"warnings"' "$W/fork-cl.json" | tr '\n' ' ')"
[ "$(grep -c '"rng_reseed": *"agent"' "$W/fork-cl.json")" = 3 ] ||
  fail "fork cl: not 3 children reseeded through their agents: $(grep '"rng_reseed"' "$W/fork-cl.json" | tr '\n' ' ')"
ckids=$(sed -n 's/.*"id": *"\(x-f[0-9]*-f[0-9]*\)".*/\1/p' "$W/fork-cl.json" | sort -u)
[ "$(echo "$ckids" | wc -l)" = 3 ] || fail "fork cl: not 3 children: $(tr '\n' ' ' <"$W/fork-cl.json")"
ex --cluster cl-f1 -- busybox cat /tmp/mark
[ "$rc" = 0 ] && [ "$(wc -l <"$W/o")" = 3 ] || fail "exec --cluster cl-f1 cat: rc $rc, out '$(tr '\n' '|' <"$W/o")' ($(cat "$W/e"))"
for k in $ckids; do
  kc --json info "$k" >"$W/info-$k.json" 2>&1 || fail "k7d info $k failed: $(cat "$W/info-$k.json")"
  case $(json_str parent "$W/info-$k.json") in
    x-f1) want=child-one ;;
    x-f2 | "$c3") want=before-fork ;;
    *) fail "cluster child $k: parent '$(json_str parent "$W/info-$k.json")' is not a member of cl" ;;
  esac
  grep -qxF "$k: $want" "$W/o" || fail "exec --cluster: $k did not answer '$want' from its own fork: '$(tr '\n' '|' <"$W/o")'"
done
ex --cluster cl-f1 -- busybox sh -c 'echo mine >/tmp/mark; echo to-err >&2'
[ "$rc" = 0 ] && [ "$(grep -c ': to-err$' "$W/e")" = 3 ] || fail "exec --cluster cl-f1 write: rc $rc, err '$(tr '\n' '|' <"$W/e")'"
ex x-f1 -- busybox cat /tmp/mark
[ "$(cat "$W/o")" = child-one ] || fail "a write through exec --cluster cl-f1 reached its source x-f1: '$(cat "$W/o")'"
ex --cluster cl-f1 -- busybox sh -c 'exit 3'
[ "$rc" = 3 ] && [ "$(grep -c 'exited 3' "$W/e")" = 3 ] || fail "exec --cluster cl-f1 exit 3: rc $rc, err '$(tr '\n' '|' <"$W/e")'"
lab_note "exec --cluster cl-f1 (a cluster fork of x-f1, x-f2, $c3, each child reseeded through its agent): each member answered from its own fork, its writes its own, exit 3 from all as 3"
kc cluster delete cl-f1 >"$W/del.out" 2>&1 && kc cluster delete cl >"$W/del.out" 2>&1 || fail "deleting the clusters failed: $(cat "$W/del.out")"

# 8. The agent reseeds fork children whose kernel has no vmgenid driver.
kc --json info x >"$W/info-x.json" 2>&1 || fail "k7d info x failed: $(cat "$W/info-x.json")"
[ "$(json_str rng_reseed "$W/info-x.json")" = agent ] ||
  fail "k7d info x: rng_reseed is '$(json_str rng_reseed "$W/info-x.json")', not agent (the cloud kernel has no vmgenid driver, the agent answers)"
# The draw loop (k7d-vmgenid.guest.sh, /guest.sh of the busybox initramfs)
# in x, started through exec in a session of its own, on the serial console.
log_of() { echo "$st/vms/$1/serial.log"; }
ex x --env NAP="$NAP" -- busybox sh -c 'busybox setsid busybox sh /guest.sh </dev/null >/dev/ttyS0 2>&1 &'
[ "$rc" = 0 ] || fail "starting the draw loop: rc $rc ($(cat "$W/e"))"
wait_first "$(log_of x)" "x's draw loop"
# judge_agent LABEL RESEED VM...: each VM's first draw after the fork and
# x's draw at the same n. RESEED=yes: each VM's agent logged its reseed
# before the VM's first wake line (so before its first draw), and the draws
# are all different; RESEED=no: no VM logged a reseed, and REPEATS counts
# the draws equal to another. The draws are kept in $W/draws-LABEL.
judge_agent() {
  _label=$1 _reseed=$2; shift 2
  : >"$W/draws-$_label"
  for _v in "$@"; do
    wait_first "$(log_of "$_v")" "$_label: $_v"
    read -r _n _f _d <<EOF
$(first_rng "$(log_of "$_v")")
EOF
    wait_at "$(log_of x)" "$_n" "$_label: x"
    read -r _sf _sd <<EOF
$(rng_at "$(log_of x)" "$_n")
EOF
    _first=$(tr -d '\r' <"$(log_of "$_v")" | awk '/k7d-agent: reseed: entropy/ {print "reseed"; exit} /LAB-GUEST wake n=/ {print "wake"; exit}')
    if [ "$_reseed" = yes ]; then
      [ "$_first" = reseed ] || fail "$_label: $_v woke to draw before its agent's reseed (its log: $(tr -d '\r' <"$(log_of "$_v")" | head -c 400 | tr '\n' '|'))"
    else
      ! grep -q "k7d-agent: reseed:" "$(log_of "$_v")" || fail "$_label: $_v's agent was reseeded"
    fi
    echo "$_v n=$_n $_d" >>"$W/draws-$_label"
    grep -q "^x n=$_n " "$W/draws-$_label" || echo "x n=$_n $_sd" >>"$W/draws-$_label"
  done
  REPEATS=$(($(wc -l <"$W/draws-$_label") - $(cut -d' ' -f3 "$W/draws-$_label" | sort -u | wc -l)))
  [ "$_reseed" = no ] || [ "$REPEATS" = 0 ] || fail "$_label: draws repeat: $(tr '\n' ';' <"$W/draws-$_label")"
}
R=${LAB_RESEED_ROUNDS:-1} r=1
while [ "$r" -le "$R" ]; do
  pin_asleep x "reseed round $r"
  timeout -s KILL 180 "$LAB_BIN" --socket "$sock" --json fork x --count 8 >"$W/fork-$r.json" 2>"$W/fork-$r.err" ||
    fail "reseed round $r: fork x --count 8 failed: $(cat "$W/fork-$r.err" "$W/fork-$r.json" | tr '\n' ' ')"
  unpin x "reseed round $r"
  ! grep -q '"warnings"' "$W/fork-$r.json" || fail "reseed round $r: the fork warns: $(grep -A2 '"warnings"' "$W/fork-$r.json" | tr '\n' ' ')"
  [ "$(grep -c '"rng_reseed": *"agent"' "$W/fork-$r.json")" = 8 ] ||
    fail "reseed round $r: not 8 children with rng_reseed agent: $(grep '"rng_reseed"' "$W/fork-$r.json" | tr '\n' ' ')"
  kids=$(sed -n 's/.*"id": *"\(x-f[0-9]*\)".*/\1/p' "$W/fork-$r.json" | sort -u)
  [ "$(echo "$kids" | wc -l)" = 8 ] || fail "reseed round $r: not 8 child ids: $(tr '\n' ' ' <"$W/fork-$r.json")"
  judge_agent "round-$r" yes $kids
  delete_all "reseed round $r" $kids
  [ "$r" -gt 1 ] || lab_note "reseed round 1's first draws: $(tr '\n' ';' <"$W/draws-round-1")"
  r=$((r + 1))
done
# How long each child ran with its source's RNG state: its start (its
# reseed begins then) to its agent's answer, as the daemon logs it.
grep 'reseeded through the guest agent' "$DLOG" | sed -n 's/.* ms=\([0-9]*\).*/\1/p' >"$W/reseed-ms"
[ "$(wc -l <"$W/reseed-ms")" -ge $((R * 8)) ] || fail "the daemon logged $(wc -l <"$W/reseed-ms") agent reseeds, not $((R * 8)) or more"
lab_metric k7d_exec.reseed_ms "$(lab_median $(cat "$W/reseed-ms"))" ms
lab_note "the agent's reseed, from each child's start: median $(lab_median $(cat "$W/reseed-ms")) ms, max $(sort -n "$W/reseed-ms" | tail -n1) ms"
lab_note "the agent reseeded $((R * 8)) children of $R forks of 8 (x pinned asleep, tries:$PINS; draws every $NAP s; no warning, each child's agent logged its reseed before the child's first draw, 9 different first draws per fork)"
# Without a reseed each child's first draw is its source's, unless the
# guest kernel's own reseed (a minute after its last) falls on that draw and
# mixes in what each child's interrupts added since the fork: up to 3 forks.
c=1
while :; do
  pin_asleep x "--no-agent-reseed"
  timeout -s KILL 180 "$LAB_BIN" --socket "$sock" --json fork x --count 8 --no-agent-reseed >"$W/fork-ctl.json" 2>"$W/fork-ctl.err" ||
    fail "fork x --count 8 --no-agent-reseed failed: $(cat "$W/fork-ctl.err" "$W/fork-ctl.json" | tr '\n' ' ')"
  unpin x "--no-agent-reseed"
  ! grep -q '"rng_reseed": *"agent"' "$W/fork-ctl.json" || fail "--no-agent-reseed: a child says rng_reseed agent"
  kids=$(sed -n 's/.*"id": *"\(x-f[0-9]*\)".*/\1/p' "$W/fork-ctl.json" | sort -u)
  [ "$(grep -c '"rng_reseed": *"no_driver"' "$W/fork-ctl.json")" = 8 ] ||
    fail "--no-agent-reseed: not 8 children with rng_reseed no_driver: $(grep '"rng_reseed"' "$W/fork-ctl.json" | tr '\n' ' ')"
  judge_agent ctl no $kids
  delete_all "--no-agent-reseed" $kids
  [ "$REPEATS" = 0 ] || break
  lab_note "--no-agent-reseed fork $c: no first draw repeated: $(tr '\n' ';' <"$W/draws-ctl")"
  [ "$c" -lt 3 ] || fail "--no-agent-reseed: no first draw repeated in 3 forks, so the check above could not fail"
  c=$((c + 1))
done
lab_note "without the agent's reseed (--no-agent-reseed): no child logged one, rng_reseed no_driver, $REPEATS of 9 first draws repeat another: $(tr '\n' ';' <"$W/draws-ctl")"
# What info says outlives the daemon: x's record says its children's agents
# reseeded them.
kill -9 "$dpid" && wait "$dpid" 2>/dev/null
lab_daemon_start "$st" "$sock" "$W/daemon2.log"
DLOG=$W/daemon2.log
kc --json info x >"$W/info-x2.json" 2>&1 || fail "k7d info x after the daemon's restart failed: $(cat "$W/info-x2.json")"
[ "$(json_str rng_reseed "$W/info-x2.json")" = agent ] ||
  fail "after the daemon's restart, k7d info x says rng_reseed '$(json_str rng_reseed "$W/info-x2.json")', not agent"
lab_note "a daemon killed -9 and started again: x re-attached, info says rng_reseed agent (from its record)"

# 9. Snapshot, delete, restore.
kc snapshot x "$W/snap" >"$W/snap.out" 2>&1 || fail "snapshot failed: $(cat "$W/snap.out")"
kc delete x >/dev/null || fail "delete x failed"
kc restore "$W/snap" --id r >"$W/restore.out" 2>&1 || fail "restore failed: $(cat "$W/restore.out")"
ex r -- busybox cat /tmp/mark
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = before-fork ] || fail "the restored VM: rc $rc out '$(cat "$W/o")' ($(cat "$W/e"))"
kc --json info r >"$W/info-r.json" 2>&1 || fail "k7d info r failed: $(cat "$W/info-r.json")"
[ "$(json_str rng_reseed "$W/info-r.json")" = agent ] || fail "the restored VM: rng_reseed is '$(json_str rng_reseed "$W/info-r.json")', not agent"
lab_note "restored VM: exec works and sees the source's file; reseeded through its agent"

# 9b. The rollout example (vmm/python/examples/rollout.py) on r, run by
# Debian's Python in L1: the state prepared once in r (a file, and a
# process holding a running total in memory), 3 steps of 4 children, each
# child observing its source's state and its own action only, in the file
# and in its copy of the process alike, the best child the next source (a
# fork of a fork), nothing left after (the example checks each, and fails
# otherwise; it prints each step).
PYTHONPATH=/lab/python timeout -s KILL 300 python3 /lab/files/rollout.py --socket "$sock" --source r --steps 3 --children 4 >"$W/rollout.out" 2>&1
rc=$?
line=$(sed -n 's/^rollout: //p' "$W/rollout.out")
[ "$rc" = 0 ] && [ -n "$line" ] || fail "the rollout example: rc $rc: $(tail -c 1500 "$W/rollout.out")"
echo "$line" | grep -qF '"chosen": ["r-f4", "r-f4-f4", "r-f4-f4-f4"]' && echo "$line" | grep -qF '"final_state": [103, 203, 303]' &&
  echo "$line" | grep -qF '"final_memory": 609' && grep -q '^  r-f4-f4-f4: action 303: observed \[103, 203, 303\], 609 in memory' "$W/rollout.out" ||
  fail "the rollout example's choices or final state: $line"
for m in fork_to_first_exec exec_in_child exec_on_source; do
  lab_metric "k7d_rollout.${m}_ms" "$(echo "$line" | sed -n "s/.*\"${m}_ms_p50\": \([0-9.]*\).*/\1/p")" ms
done
lab_note "the rollout example on r: 3 steps x 4 children, each child its source's state plus its own action on disk and in its process's memory, the best kept as the next source (r-f4, r-f4-f4, r-f4-f4-f4), nothing left; $(grep -c '^  r-' "$W/rollout.out") children's lines; $line"
kc delete r >/dev/null || fail "delete r failed"

# 10. The agent in a user's image: k7d's pod initramfs alone, the root named
# by its filesystem's UUID (root=UUID=..., as an image's own command line
# names it; upper case, which blkid's matching ignores too) on a disk whose
# image has no agent (k7d-exec.prepare.sh).
IMG=/lab/files/image-root.erofs IMG_UUID=6b376b37-0d1e-4c0a-9e5f-2a7e00c0ffee
[ -s "$IMG" ] || fail "no $IMG (prepare=k7d-exec)"
kc create --id img --kernel "$LAB_KERNEL" --initrd "$LAB_POD_INITRD" \
  --cmdline "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check root=UUID=$(echo "$IMG_UUID" | tr a-f A-F) rootfstype=erofs ro" \
  --vcpus 1 --memory 256 --vsock "cid=4,uds=$W/img.vsock" --disk "$IMG,ro" --start >"$W/create-img.out" 2>&1 ||
  fail "k7d create img failed: $(cat "$W/create-img.out")"
t0=$(date +%s)
booted img
ex img -- busybox cat /etc/image-marker
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "k7d lab: a user's root disk, no agent in it" ] ||
  fail "img: the command did not run in the image's root: rc $rc, '$(cat "$W/o")' ($(cat "$W/e"))"
# PID 1 runs the image's busybox (its init); the agent, the initramfs's
# /init, is gone from any filesystem.
ex img -- busybox readlink /proc/1/exe
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = /bin/busybox ] || fail "img: PID 1 is not the image's init: '$(cat "$W/o")' ($(cat "$W/e"))"
ex img -- busybox sh -c 'exit 5'
[ "$rc" = 5 ] || fail "img: exit 5 gave $rc ($(cat "$W/e"))"
# The battery of parts 1-6b in the user's image (a root disk with no agent
# installed): echo, streams apart and exit 7, 1 MiB of stdin summed,
# env/cwd/user, a timeout, --tty with a resize, k7d cp both ways (into
# /run, the image's one writable place: the tmpfs the handover moved onto
# it).
ex img -- busybox echo hello
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = hello ] || fail "img: echo: rc $rc '$(cat "$W/o")' ($(cat "$W/e"))"
ex img -- busybox sh -c 'echo out; echo err >&2; exit 7'
[ "$rc" = 7 ] && [ "$(cat "$W/o")" = out ] && [ "$(cat "$W/e")" = err ] ||
  fail "img: streams and exit 7: rc $rc, '$(cat "$W/o")', '$(cat "$W/e")'"
head -c 1048576 /dev/urandom >"$W/img-in"
timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec img -- busybox sha256sum <"$W/img-in" >"$W/o" 2>"$W/e"
rc=$?
[ "$rc" = 0 ] && [ "$(cut -d' ' -f1 "$W/o")" = "$(sha256sum <"$W/img-in" | cut -d' ' -f1)" ] ||
  fail "img: 1 MiB of stdin: rc $rc, '$(cat "$W/o")' ($(cat "$W/e"))"
ex img --env A=b --cwd /run --user 65534:65533 -- busybox sh -c 'echo "$A|$(busybox pwd)|$(busybox id -u):$(busybox id -g)"'
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "b|/run|65534:65533" ] || fail "img: env/cwd/user: rc $rc, '$(cat "$W/o")' ($(cat "$W/e"))"
ex img --timeout 1 -- busybox sleep 30
[ "$rc" = 137 ] || fail "img: --timeout 1 of sleep 30 gave $rc ($(cat "$W/e"))"
winch img
kc cp "$W/cpsrc/tree" img:/run/ >"$W/cp.out" 2>&1 || fail "img: k7d cp into /run failed: $(cat "$W/cp.out")"
ex img -- busybox sh -c 'cd /run/tree && busybox sha256sum <sub/rand.bin | busybox cut -d" " -f1 && busybox stat -c "%a %u:%g" sub/rand.bin && busybox readlink link'
[ "$rc" = 0 ] && [ "$(tr '\n' '|' <"$W/o")" = "$sum|751 1234:5678|sub/rand.bin|" ] ||
  fail "img: k7d cp into the image: '$(tr '\n' '|' <"$W/o")' (rc $rc, $(cat "$W/e"))"
kc cp img:/run/tree "$W/back-img" >"$W/cp.out" 2>&1 || fail "img: k7d cp out of /run failed: $(cat "$W/cp.out")"
[ "$(sha256sum <"$W/back-img/sub/rand.bin" | cut -d' ' -f1)" = "$sum" ] &&
  [ "$(stat -c '%a %u:%g' "$W/back-img/sub/rand.bin")" = "751 1234:5678" ] && [ "$(readlink "$W/back-img/link")" = sub/rand.bin ] ||
  fail "img: k7d cp out of the image: $(ls -lR "$W/back-img" 2>&1 | tr '\n' '|')"
lab_note "the battery in a user's image with no agent (root=UUID, erofs, busybox init): echo, exit 7 with the streams apart, 1 MiB of stdin summed, env/cwd/user, --timeout 1 as 137, --tty with a resize, k7d cp of a tree into /run and back (sum, 751 1234:5678, the link)"
tr -d '\r' <"$st/vms/img/serial.log" | grep -q "k7d-agent: root=UUID=$IMG_UUID is /dev/vda" ||
  fail "img: the agent did not say which device has the root's UUID: $(tail -c 600 "$st/vms/img/serial.log" | tr '\n' '|')"
tr -d '\r' <"$st/vms/img/serial.log" | grep -q "k7d-agent: the root is UUID=$IMG_UUID (ro); its /sbin/init takes PID 1" ||
  fail "img: the agent did not say it handed over: $(tail -c 600 "$st/vms/img/serial.log" | tr '\n' '|')"
tr -d '\r' <"$st/vms/img/serial.log" | grep -q "LAB-GUEST image-init ran (pid 1: /bin/busybox)" ||
  fail "img: the image's inittab did not run: $(tail -c 600 "$st/vms/img/serial.log" | tr '\n' '|')"
timeout -s KILL 60 "$LAB_BIN" --socket "$sock" --json fork img >"$W/fork-img.json" 2>&1 || fail "fork img failed: $(cat "$W/fork-img.json")"
grep -q '"rng_reseed": *"agent"' "$W/fork-img.json" || fail "fork img: its child was not reseeded through its agent: $(tr '\n' ' ' <"$W/fork-img.json")"
ikid=$(sed -n 's/.*"id": *"\(img-f[0-9]*\)".*/\1/p' "$W/fork-img.json" | head -n1)
[ -n "$ikid" ] || fail "fork img named no child: $(tr '\n' ' ' <"$W/fork-img.json")"
ex "$ikid" -- busybox cat /etc/image-marker
[ "$rc" = 0 ] && [ -n "$(cat "$W/o")" ] || fail "$ikid: exec in the fork child: rc $rc ($(cat "$W/e"))"
lab_note "a user's image with no agent (erofs root named by its UUID, busybox init): the agent handed PID 1 to the image's /sbin/init and serves exec from the image's root (its file, exit 5), in a fork child too (reseeded through its agent)"
kc delete "$ikid" >/dev/null && kc delete img >/dev/null || fail "deleting img and $ikid failed"
# 10b. The agent installed as a service in the image (k7d-agent --vsock,
# started by the image's own init: k7d-exec.prepare.sh), as a user who
# prefers it installs it; with k7d.agent=image k7d's initramfs only mounts
# the root and hands over, and the image's agent serves.
IMG2=/lab/files/image-agent.erofs
[ -s "$IMG2" ] || fail "no $IMG2 (prepare=k7d-exec)"
kc create --id svc --kernel "$LAB_KERNEL" --initrd "$LAB_POD_INITRD" \
  --cmdline "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check root=UUID=$IMG_UUID rootfstype=erofs ro k7d.agent=image" \
  --vcpus 1 --memory 256 --vsock "cid=6,uds=$W/svc.vsock" --disk "$IMG2,ro" --start >"$W/create-svc.out" 2>&1 ||
  fail "k7d create svc failed: $(cat "$W/create-svc.out")"
t0=$(date +%s)
booted svc
ex svc -- busybox sh -c 'busybox cat /etc/image-marker; busybox readlink /proc/$PPID/exe; busybox tr "\0" " " </proc/$PPID/cmdline; echo; busybox readlink /proc/1/exe'
[ "$rc" = 0 ] && [ "$(tr '\n' '|' <"$W/o")" = "k7d lab: a user's root disk, its own agent installed|/usr/local/bin/k7d-agent|/usr/local/bin/k7d-agent --vsock |/bin/busybox|" ] ||
  fail "svc: the command was not run by the image's installed agent: rc $rc, '$(tr '\n' '|' <"$W/o")' ($(cat "$W/e"))"
tr -d '\r' <"$st/vms/svc/serial.log" | grep -q "k7d-agent: k7d.agent=image: the image's own k7d-agent serves" ||
  fail "svc: the initramfs's agent did not say it leaves serving to the image's: $(tail -c 600 "$st/vms/svc/serial.log" | tr '\n' '|')"
tr -d '\r' <"$st/vms/svc/serial.log" | grep -q "k7d-agent: serving on vsock port 1024" ||
  fail "svc: the installed agent did not say it serves: $(tail -c 600 "$st/vms/svc/serial.log" | tr '\n' '|')"
lab_note "the agent installed as a service in a user's image (k7d-agent --vsock from its inittab, k7d.agent=image): exec ran by /usr/local/bin/k7d-agent --vsock in the image's root, PID 1 the image's init"
kc delete svc >/dev/null || fail "delete svc failed"
# A root that never appears: the agent says so, with what each block device
# holds, and serves from the initramfs (busybox's, under it), as a VM
# without root= does.
kc create --id noroot --kernel "$LAB_KERNEL" --initrd "$W/initrd.cpio" \
  --cmdline "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check root=/dev/vdz" \
  --vcpus 1 --memory 256 --vsock "cid=5,uds=$W/noroot.vsock" --start >"$W/create-noroot.out" 2>&1 ||
  fail "k7d create noroot failed: $(cat "$W/create-noroot.out")"
t0=$(date +%s)
booted noroot
tr -d '\r' <"$st/vms/noroot/serial.log" | grep -q "k7d-agent: root=/dev/vdz did not appear within 10 s (block devices: no block device): the agent serves from the initramfs instead" ||
  fail "noroot: the agent did not say why it kept the initramfs: $(tail -c 600 "$st/vms/noroot/serial.log" | tr '\n' '|')"
ex noroot -- busybox readlink /proc/1/exe
[ "$rc" = 0 ] && [ "$(cat "$W/o")" != /bin/busybox ] || fail "noroot: PID 1 is '$(cat "$W/o")' (rc $rc), not the agent"
lab_note "root=/dev/vdz (no such disk): the agent said so after 10 s and served from the initramfs (PID 1 $(cat "$W/o"))"
kc delete noroot >/dev/null || fail "delete noroot failed"
left=$(kc list | tail -n +2)
[ -z "$left" ] || fail "VMs left: $left"
lab_daemon_stop "$DLOG"
lab_pass "k7d exec: output, streams, exit and signal status, stdin, env/cwd/user, timeout, refusals, fork children, a restored VM; the agent reseeds fork children before their first draw, and a restore; the mark outlives the daemon; the agent hands a user's image its own init and serves from it"

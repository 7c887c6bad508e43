# lab: description=k7d exec (issue 37): commands run in a plain VM by its guest agent, through the daemon's default (a VM process): output and exit status, stdout and stderr apart, stdin, env, cwd and user, a timeout, refusals; the same in two fork children (each its own) and in a VM restored from a snapshot
# lab: default=yes
# lab: timeout=600
# lab: bin=required
# lab: pod-initramfs=required
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
#  3. stdin is forwarded to `cat` and its end ends it;
#  4. --env, --cwd and --user reach the command (`echo $A $(pwd) uid:gid`);
#  5. --timeout 1 kills `sleep 30`: exit 137 within 15 s;
#  6. refused with one sentence: a program the guest lacks, a VM without
#     vsock; nothing of the exec is left in the agent (a second exec works);
#  7. fork --count 2: exec works in each child at its own socket; a file
#     one child writes is not in the other child nor in the source;
#  8. the agent reseeds (issue 40, item 2: this cloud kernel has no vmgenid
#     driver): `k7d info x` says rng_reseed agent (x-f1 and x-f2 were
#     reseeded through their agents, so x has one); $LAB_RESEED_ROUNDS
#     times `fork x --count 8` answers with each child's rng_reseed agent
#     and no shared-RNG warning, each child's serial log has its agent's
#     "reseed: entropy 64 bytes" (logged once both ioctls succeeded), and a
#     draw of 16 bytes from /dev/urandom through exec in each child and in
#     x gives 9 different draws. The check can fail: a fork with
#     --no-agent-reseed (the caller's reseed, which nobody makes here) says
#     no_driver for its children and no child logs a reseed. (Its
#     children's exec draws are noted, not judged: they repeated in one
#     run and differed in another, as the guest kernel's own 60 s reseed
#     decides, so the draws alone prove nothing.)
#  9. snapshot, delete, restore: exec works in the restored VM and sees the
#     file the source wrote before the snapshot, and it was reseeded
#     (rng_reseed agent).
# Metrics: k7d_exec.first_ms (`true`, connect to exit), k7d_exec.ms (median
# of 5 `true`), k7d_exec.child_ms (the first exec in a fork child).
# By hand: tests/lab/run.sh --bin target/release/k7d --agent target/release/k7d-agent k7d-exec
. /lab/lib.sh

[ -x "${LAB_BIN:-}" ] || lab_fail "no binary under test (run.sh --bin PATH)"
[ -f "${LAB_POD_INITRD:-}" ] || lab_fail "no pod initramfs (run.sh --agent PATH)"
W=/tmp/k7d-exec st=/tmp/k7d-exec/state sock=/tmp/k7d-exec/k7d.sock DLOG=/tmp/k7d-exec/daemon.log
mkdir -p "$W"
dpid=
kc() { timeout -s KILL 60 "$LAB_BIN" --socket "$sock" "$@"; }
# ex VM ARGS... -- CMD...: k7d exec, stdout to $W/o, stderr to $W/e, rc in $rc.
ex() {
  timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec "$@" >"$W/o" 2>"$W/e" </dev/null
  rc=$?
}
fail() {
  [ ! -s "$DLOG" ] || echo "lab: k7d daemon log (tail): $(tail -n 5 "$DLOG" | tr '\n' ' ')"
  for v in x x-f1 x-f2 r; do
    [ ! -s "$st/vms/$v/serial.log" ] || echo "lab: $v serial (tail): $(tail -c 600 "$st/vms/$v/serial.log" | tr '\n' '|')"
  done
  [ -z "$dpid" ] || kill -9 "$dpid" 2>/dev/null
  lab_fail "$*"
}
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
until ex x -- busybox true && [ "$rc" = 0 ]; do
  [ $(($(date +%s) - t0)) -lt 180 ] || fail "k7d exec never succeeded within 180 s: rc $rc: $(cat "$W/e")"
  sleep 1
done
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

# 3. stdin.
printf 'line one\nline two\n' | timeout -s KILL 60 "$LAB_BIN" --socket "$sock" exec x -- busybox cat >"$W/o" 2>"$W/e"
rc=$?
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = "$(printf 'line one\nline two')" ] ||
  fail "stdin: rc $rc, out '$(cat "$W/o")' ($(cat "$W/e"))"
lab_note "stdin forwarded to cat, its end ended it"

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
[ "$took" -lt 15 ] || fail "--timeout 1 sleep 30 took $took s"
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

kc delete x-f1 >/dev/null && kc delete x-f2 >/dev/null || fail "deleting the children failed"

# 8. The agent reseeds fork children whose kernel has no vmgenid driver.
json_str() { sed -n "s/.*\"$1\": *\"\([^\"]*\)\".*/\1/p" "$2" | head -n1; }
kc --json info x >"$W/info-x.json" 2>&1 || fail "k7d info x failed: $(cat "$W/info-x.json")"
[ "$(json_str rng_reseed "$W/info-x.json")" = agent ] ||
  fail "k7d info x: rng_reseed is '$(json_str rng_reseed "$W/info-x.json")', not agent (the cloud kernel has no vmgenid driver, the agent answers)"
# draw_all WHAT VM...: 16 bytes of /dev/urandom through exec in each VM
# and in x, "vm hex" lines in $W/draws.
draw_all() {
  _what=$1; shift
  : >"$W/draws"
  for _v in "$@" x; do
    ex "$_v" -- busybox sh -c 'busybox od -An -tx1 -N16 /dev/urandom | busybox tr -d " \n"'
    [ "$rc" = 0 ] && grep -qxE '[0-9a-f]{32}' "$W/o" || fail "$_what: a draw in $_v: rc $rc, '$(cat "$W/o")' ($(cat "$W/e"))"
    echo "$_v $(cat "$W/o")" >>"$W/draws"
  done
}
R=${LAB_RESEED_ROUNDS:-2} r=1
while [ "$r" -le "$R" ]; do
  timeout -s KILL 180 "$LAB_BIN" --socket "$sock" --json fork x --count 8 >"$W/fork-$r.json" 2>"$W/fork-$r.err" ||
    fail "reseed round $r: fork x --count 8 failed: $(cat "$W/fork-$r.err" "$W/fork-$r.json" | tr '\n' ' ')"
  ! grep -q '"warnings"' "$W/fork-$r.json" || fail "reseed round $r: the fork warns: $(grep -A2 '"warnings"' "$W/fork-$r.json" | tr '\n' ' ')"
  [ "$(grep -c '"rng_reseed": *"agent"' "$W/fork-$r.json")" = 8 ] ||
    fail "reseed round $r: not 8 children with rng_reseed agent: $(grep '"rng_reseed"' "$W/fork-$r.json" | tr '\n' ' ')"
  kids=$(sed -n 's/.*"id": *"\(x-f[0-9]*\)".*/\1/p' "$W/fork-$r.json" | sort -u)
  [ "$(echo "$kids" | wc -l)" = 8 ] || fail "reseed round $r: not 8 child ids: $(tr '\n' ' ' <"$W/fork-$r.json")"
  for v in $kids; do
    grep -q "k7d-agent: reseed: entropy 64 bytes" "$st/vms/$v/serial.log" ||
      fail "reseed round $r: $v's agent logged no reseed: $(tail -c 300 "$st/vms/$v/serial.log" | tr '\n' '|')"
  done
  draw_all "reseed round $r" $kids
  [ "$(cut -d' ' -f2 "$W/draws" | sort -u | wc -l)" = 9 ] || fail "reseed round $r: draws repeat: $(tr '\n' ';' <"$W/draws")"
  for v in $kids; do kc delete "$v" >/dev/null || fail "reseed round $r: delete $v failed"; done
  [ "$r" -gt 1 ] || lab_note "reseed round 1's draws: $(tr '\n' ';' <"$W/draws")"
  r=$((r + 1))
done
lab_note "the agent reseeded $((R * 8)) children of $R forks of 8 (info x: rng_reseed agent; no warning; each child's agent logged its reseed; 9 different draws per fork)"
timeout -s KILL 180 "$LAB_BIN" --socket "$sock" --json fork x --count 8 --no-agent-reseed >"$W/fork-ctl.json" 2>"$W/fork-ctl.err" ||
  fail "fork x --count 8 --no-agent-reseed failed: $(cat "$W/fork-ctl.err" "$W/fork-ctl.json" | tr '\n' ' ')"
! grep -q '"rng_reseed": *"agent"' "$W/fork-ctl.json" || fail "--no-agent-reseed: a child says rng_reseed agent"
kids=$(sed -n 's/.*"id": *"\(x-f[0-9]*\)".*/\1/p' "$W/fork-ctl.json" | sort -u)
[ "$(grep -c '"rng_reseed": *"no_driver"' "$W/fork-ctl.json")" = 8 ] ||
  fail "--no-agent-reseed: not 8 children with rng_reseed no_driver: $(grep '"rng_reseed"' "$W/fork-ctl.json" | tr '\n' ' ')"
draw_all "--no-agent-reseed" $kids
for v in $kids; do
  ! grep -q "k7d-agent: reseed:" "$st/vms/$v/serial.log" || fail "--no-agent-reseed: $v's agent was reseeded"
done
ctl=$(cut -d' ' -f2 "$W/draws" | sort -u | wc -l)
for v in $kids; do kc delete "$v" >/dev/null || fail "--no-agent-reseed: delete $v failed"; done
lab_note "without the agent's reseed (--no-agent-reseed): no child logged one, rng_reseed no_driver; their exec draws: $ctl different of 9: $(tr '\n' ';' <"$W/draws")"

# 9. Snapshot, delete, restore.
kc snapshot x "$W/snap" >"$W/snap.out" 2>&1 || fail "snapshot failed: $(cat "$W/snap.out")"
kc delete x >/dev/null || fail "delete x failed"
kc restore "$W/snap" --id r >"$W/restore.out" 2>&1 || fail "restore failed: $(cat "$W/restore.out")"
ex r -- busybox cat /tmp/mark
[ "$rc" = 0 ] && [ "$(cat "$W/o")" = before-fork ] || fail "the restored VM: rc $rc out '$(cat "$W/o")' ($(cat "$W/e"))"
kc --json info r >"$W/info-r.json" 2>&1 || fail "k7d info r failed: $(cat "$W/info-r.json")"
[ "$(json_str rng_reseed "$W/info-r.json")" = agent ] || fail "the restored VM: rng_reseed is '$(json_str rng_reseed "$W/info-r.json")', not agent"
lab_note "restored VM: exec works and sees the source's file; reseeded through its agent"
kc delete r >/dev/null || fail "delete r failed"
left=$(kc list | tail -n +2)
[ -z "$left" ] || fail "VMs left: $left"
lab_daemon_stop "$DLOG"
lab_pass "k7d exec: output, streams, exit and signal status, stdin, env/cwd/user, timeout, refusals, fork children, a restored VM; the agent reseeds fork children and a restore"

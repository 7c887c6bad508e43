# shellcheck shell=bash
# The host's L1 watchdog, sourced by tests/lab/run.sh (bash). It watches one
# L1 run from outside and tells the three ways a scenario can hang apart:
#   l1-froze  L1's heartbeat (l1-init.sh, every 5 s on its third serial port,
#             l1-hb.log) stopped: L1's kernel or the emulator under it froze.
#             Nothing inside L1 can see this, so only the host can bound it.
#   silent    the heartbeat goes on but neither L1's console (l1.log) nor the
#             L2 serial (l2.log) grew: the scenario, a VMM or a guest is stuck
#             with L1 alive (scenarios bound their own waits; this is the net
#             under them). The last heartbeat's process table says where.
# Either way it gathers the evidence into $OUT/l1-stall.log (QEMU's threads and
# their CPU use over 2 s, L1's vCPU state and registers twice 2 s apart through
# QEMU's monitor, L1's last heartbeats, the last console and serial lines),
# then stops QEMU: a stall costs its limit plus seconds, not the global timeout.
# Inside L1, lab_run_l2's own watchdog (l1-lib.sh) covers a silent L2 guest.

# _hmp OUT CMD: one human-monitor command; prints its answer (escapes and echo
# stripped). The monitor's output FIFO is drained into work/monitor.log by
# the watchdog for the whole run.
_hmp() {
  local out=$1 before
  before=$(stat -c %s "$out/work/monitor.log" 2>/dev/null || echo 0)
  # Opening the FIFO blocks until QEMU reads it: bounded, for a QEMU that
  # is exiting or gone.
  timeout 3 bash -c 'printf "%s\n" "$1" >"$2"' _ "$2" "$out/work/mon.in" || return 0
  sleep 1
  tail -c +"$((before + 1))" "$out/work/monitor.log" 2>/dev/null | tr -d '\r' |
    sed -e 's/\x1b\[[0-9;]*[A-Za-z]//g' -e 's/\x1b[A-Za-z]//g' | grep -v '^(qemu)' | grep -vF -- "$2" | grep -v '^[[:space:]]*$' | head -n 60
  return 0
}

# _qemu_threads PID: each thread's name, state, CPU ticks (user + system) and wait channel.
_qemu_threads() {
  local t
  for t in /proc/"$1"/task/*; do
    [[ -r $t/stat ]] || continue
    # after "(comm) ": $1 state, $12 utime, $13 stime
    printf '  thread %s %-16s %s\n' "${t##*/}" "$(cat "$t/comm" 2>/dev/null)" \
      "$(sed 's/^.*) //' "$t/stat" 2>/dev/null | awk '{printf "state %s ticks %d", $1, $12 + $13}') wchan $(cat "$t/wchan" 2>/dev/null)"
  done
}

# _l1_evidence OUT PID KIND WHY: the evidence file.
_l1_evidence() {
  local out=$1 pid=$2
  {
    echo "LAB-L1-STALL $3: $4"
    echo "host: $(date -u +%FT%TZ) loadavg $(cat /proc/loadavg); QEMU pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)"
    echo "QEMU's threads, t0:"
    _qemu_threads "$pid"
    echo "L1's machine state (QEMU monitor), t0:"
    _hmp "$out" "info status" | sed 's/^/  /'
    _hmp "$out" "info cpus" | sed 's/^/  /'
    _hmp "$out" "info registers" | grep -E '^(RAX|RSI|R8 |R12|RIP|ES |CS |SS |CR0|EFER|HLT)' | sed 's/^/  /'
    echo "QEMU's threads, t0+2s (ticks that grew: the emulator runs L1's code):"
    _qemu_threads "$pid"
    echo "L1's registers, t0+2s (a RIP that moves: L1 runs):"
    _hmp "$out" "info registers" | grep -E '^(RIP|RSP|CS |CR0|HLT)' | sed 's/^/  /'
    # Where L1 is: RIP sampled five times, and the code there. L1 boots with
    # nokaslr, so a kernel RIP is the same address on every run of this
    # kernel and resolves offline with the kernel's -dbg package.
    echo "L1's RIP, 5 samples 0.5 s apart:"
    for _ in 1 2 3 4 5; do
      _hmp "$out" "info registers" | sed -n 's/^\(RIP=[0-9a-f]*\).*\(CPL=[0-9]\).*\(HLT=[0-9]\).*/  \1 \2 \3/p' | head -n1
      sleep 0.5
    done
    # L1 boots with nokaslr: its kernel text is at 0xffffffff81000000 and
    # up (some 30 MiB). A CPL 0 RIP elsewhere is a nested guest's (L2's)
    # kernel: the emulated CPU is running L2 and L1 never gets it back.
    rip=$(_hmp "$out" "info registers" | sed -n 's/^RIP=\([0-9a-f]*\).*CPL=\([0-9]\).*/\1 \2/p' | head -n1)
    local regs halted=''
    regs=$(_hmp "$out" "info registers" | grep -m1 '^RIP=')
    if [[ $regs == *HLT=1* && $regs =~ RFL=([0-9a-f]+) ]] && (( 0x${BASH_REMATCH[1]} & 0x200 )); then
      halted=1
    fi
    if _hmp "$out" "info status" | grep -q paused; then
      rip="$rip paused"
    fi
    case $rip in
      *paused) echo "where: the emulated machine is stopped (VM status: paused), RIP ${rip%% *}" ;;
      ffffffff8[1-3]*" 0") if [[ -n $halted ]]; then
          echo "where: RIP ${rip% *} is L1's kernel, halted (HLT=1) with interrupts enabled (IF=1): L1 waits for an interrupt (its timer at least) that the emulator never delivers; see its local APIC below"
        else
          echo "where: RIP ${rip% *} is L1's kernel (its text, nokaslr)"
        fi ;;
      *" 0") echo "where: RIP ${rip% *} at CPL 0 is outside L1's kernel text: the CPU runs a nested guest (L2) kernel and L1 never gets it back" ;;
      *" 3") echo "where: RIP ${rip% *} at CPL 3: user code (L1's or L2's)" ;;
      *) echo "where: RIP unknown (${rip:-no answer})" ;;
    esac
    echo "L1's local APIC (info lapic: a vector in IRR, or an armed timer, on a halted CPU is an interrupt never delivered):"
    _hmp "$out" "info lapic" | sed 's/^/  /'
    echo "L1's code at RIP (x/12i \$pc; unreadable while the CPU runs L2, whose page tables the monitor cannot follow):"
    _hmp "$out" 'x/12i $pc' | sed 's/^/  /'
    echo "L1's last heartbeats (l1-hb.log):"
    tail -n 40 "$out/l1-hb.log" | tr -d '\r' | sed 's/^/  /'
    echo "L1's console, last lines:"
    tail -n 15 "$out/l1.log" | tr -d '\r' | sed 's/^/  /'
    echo "the L2 serial, last lines:"
    tail -n 15 "$out/l2.log" | tr -d '\r' | sed 's/^/  /'
  } >"$out/l1-stall.log" 2>&1
}

# l1_interrupt_lost REGS1 LAPIC1 REGS2 LAPIC2: whether two samples of L1's
# CPU taken a second apart (REGS: the monitor's "info registers" line that
# starts with RIP=; LAPIC: its "info lapic") show the emulator's lost
# interrupt (CHALLENGES.md, "The lab's stalls"): in BOTH samples interrupts
# are enabled (RFL bit 9) and the CPU is halted (an idle L1 would have run
# its heartbeat) or a vector waits in IRR; when the CPU runs in both, the
# same vector waits in both (a healthy CPU takes a pending vector within
# microseconds, so a busy L1 caught with one in IRR once is no freeze).
# Exit 0: lost, rescue now.
l1_interrupt_lost() {
  local v1 v2
  v1=$(_l1_pending "$1" "$2") || return 1
  v2=$(_l1_pending "$3" "$4") || return 1
  [[ $1 == *HLT=1* && $3 == *HLT=1* ]] && return 0
  [[ -n $v1 && $v1 == "$v2" ]]
}

# _l1_pending REGS LAPIC: fails unless interrupts are enabled and the CPU is
# halted or has a vector in IRR; prints IRR's vectors (may be empty).
_l1_pending() {
  local irr
  [[ $1 =~ RFL=([0-9a-f]+) ]] && (( 0x${BASH_REMATCH[1]} & 0x200 )) || return 1
  irr=$(printf '%s\n' "$2" | sed -n 's/^[[:space:]]*IRR[[:space:]]*//p' | head -n1)
  [[ $irr =~ ^[0-9] ]] || irr=''
  [[ $1 == *HLT=1* || -n $irr ]] || return 1
  printf '%s\n' "$irr"
}

# l1_interrupt_lost_why REGS LAPIC: one sample in a few words (RIP, HLT, IRR).
l1_interrupt_lost_why() {
  local irr
  irr=$(printf '%s\n' "$2" | sed -n 's/^[[:space:]]*IRR[[:space:]]*//p' | head -n1)
  printf '%s IRR %s' "$(grep -oE 'RIP=[0-9a-f]+|RFL=[0-9a-f]+|HLT=[0-9]' <<<"$1" | tr '\n' ' ')" "${irr:-?}"
}

# l1_watchdog OUT L1_STALL_S SILENT_S EXPECT: runs beside QEMU until
# OUT/work/qemu.done exists. On a stall it writes work/stall-kind and
# work/stall-why, the evidence file, and stops QEMU (TERM, then KILL).
# A self-test (EXPECT=stall:l1-froze) may ask, with a "LAB-SELFTEST freeze-l1"
# line on L1's console, that L1's CPUs be stopped through the monitor: a
# real frozen machine, as an emulator hang would leave it.
l1_watchdog() {
  # A background job: run.sh's errexit and pipefail must not end it at the
  # first grep that finds nothing (a self-test run once did: the watchdog
  # died silently and the frozen L1 ran into the global timeout).
  set +e +o pipefail
  local out=$1 hb_limit=$2 silent_limit=$3 expect=$4
  local pid='' hb=-1 hb_t=$SECONDS io=-1 io_t=$SECONDS s kind='' why='' froze='' after=''
  # The rescue (CHALLENGES.md, "The lab's stalls"): QEMU's TCG loses L1's
  # pending interrupt (IRR holds the timer's vector, the CPU halts or runs L2
  # forever). Any new interrupt at the LAPIC makes QEMU look at IRR again: a
  # key press on L1's i8042 (IRQ 1) is one. After rescue_s without a
  # heartbeat, at most 3 times (K7D_LAB_RESCUE_MAX: more for a long by-hand
  # run), 15 s apart; each is logged to rescues.log and reported in the
  # scenario's result and the lab summary.
  # Sooner when it is certain: from nudge_s without a heartbeat (it comes
  # every 5 s), L1's CPU is sampled twice a second apart, and when both
  # samples show the lost interrupt (l1_interrupt_lost: halted with
  # interrupts enabled, or running with them enabled and the same vector
  # left pending in IRR) the rescue goes at once. A freeze then costs a
  # scenario about 10 s instead of 24 (CHALLENGES.md, "A frozen L1 ate 20 s
  # of a pod start"); one sample alone fired on a busy, healthy L1 (CI run
  # 55). Every rescue and every l1-froze is recorded in freezes.log, the
  # only evidence that buys a failed attempt its retry (tests/tests/lab.rs).
  local rescue_s=${K7D_LAB_RESCUE_S:-20} rescue_max=${K7D_LAB_RESCUE_MAX:-3} rescues=0 rescue_t=-100 rescued_hb=''
  local nudge_s=${K7D_LAB_NUDGE_S:-7} probe_t=-100 lost='' probe=''
  local boot_s=${K7D_LAB_BOOT_S:-60}
  [[ $boot_s =~ ^[0-9]+$ ]] || boot_s=60
  [[ $nudge_s =~ ^[0-9]+$ ]] || nudge_s=7
  [[ $rescue_max =~ ^[0-9]+$ ]] || rescue_max=3
  cat "$out/work/mon.out" >"$out/work/monitor.log" 2>/dev/null &
  local drain=$!
  while [[ ! -e $out/work/qemu.done ]]; do
    sleep 1
    [[ -n $pid ]] || { pid=$(cat "$out/work/qemu.pid" 2>/dev/null) || pid=''; }
    [[ -n $pid ]] || continue
    if [[ -z $froze && $expect == stall:l1-froze ]] && grep -q '^LAB-SELFTEST freeze-l1' "$out/l1.log" 2>/dev/null; then
      froze=1
      _hmp "$out" stop >/dev/null
    fi
    s=$(stat -c %s "$out/l1-hb.log" 2>/dev/null || echo 0)
    if [[ $s != "$hb" ]]; then
      if [[ -n $rescued_hb ]]; then
        echo "rescue $rescues worked: L1's heartbeat came back $((SECONDS - rescue_t)) s after it" >>"$out/rescues.log"
        rescued_hb=''
      fi
      hb=$s hb_t=$SECONDS
    fi
    lost=''
    if ((nudge_s > 0 && nudge_s < rescue_s && rescue_s < hb_limit && hb > 0 && rescues < rescue_max)) &&
      ((SECONDS - hb_t >= nudge_s && SECONDS - hb_t < rescue_s && SECONDS - rescue_t >= 15 && SECONDS - probe_t >= 2)) &&
      [[ -z $froze && ! -e $out/work/qemu.done ]]; then
      probe_t=$SECONDS
      # Two samples a second apart (_hmp waits 1 s for each answer): the
      # decision is l1_interrupt_lost's, tested on canned monitor output
      # (tests/tests/lab.rs, lab_rescue_decision_*).
      local r1 a1 r2 a2
      r1=$(_hmp "$out" "info registers" | grep -m1 '^RIP=')
      a1=$(_hmp "$out" "info lapic")
      r2=$(_hmp "$out" "info registers" | grep -m1 '^RIP=')
      a2=$(_hmp "$out" "info lapic")
      if l1_interrupt_lost "$r1" "$a1" "$r2" "$a2"; then
        lost=1
        probe="$(l1_interrupt_lost_why "$r1" "$a1") / $(l1_interrupt_lost_why "$r2" "$a2")"
      fi
    fi
    if ((rescue_s > 0 && rescue_s < hb_limit && hb > 0 && rescues < rescue_max)) &&
      { [[ -n $lost ]] || ((SECONDS - hb_t >= rescue_s)); } && ((SECONDS - rescue_t >= 15)) && [[ -z $froze ]] &&
      [[ ! -e $out/work/qemu.done ]] && kill -0 "$pid" 2>/dev/null; then
      rescues=$((rescues + 1)) rescue_t=$SECONDS rescued_hb=1
      local quiet_s=$((SECONDS - hb_t))
      local seen
      if [[ -n $lost ]]; then
        seen="the lost interrupt, seen twice a second apart: $probe"
      else
        seen="$(_hmp "$out" "info registers" | grep -m1 -oE 'RIP=[0-9a-f]+ RFL=[0-9a-f]+ .*HLT=[0-9]') $(_hmp "$out" "info lapic" | grep -E '^ *(IRR|ISR)' | tr -s ' \t' ' ' | tr '\n' ';')"
      fi
      echo "rescue $rescues: no heartbeat from L1 for $quiet_s s; $seen; a key press sent to L1 (sendkey shift)" >>"$out/rescues.log"
      # The freeze record (freezes.log): the evidence that buys a failed
      # attempt its one retry (tests/tests/lab.rs, with_one_retry).
      echo "rescue $rescues after $quiet_s s without a heartbeat: $seen" >>"$out/freezes.log"
      _hmp "$out" "sendkey shift" >/dev/null
      echo "lab: L1 watchdog: no heartbeat for $quiet_s s: rescue $rescues (a key press makes QEMU re-read L1's pending interrupts; $out/rescues.log)" >&2
    fi
    s=$(($(stat -c %s "$out/l1.log" 2>/dev/null || echo 0) + $(stat -c %s "$out/l2.log" 2>/dev/null || echo 0)))
    [[ $s == "$io" ]] || { io=$s io_t=$SECONDS; }
    # Before the first heartbeat, L1 is still booting (firmware, the
    # initramfs, the kernel: 12-17 s on a loaded host, where the self-test's
    # 15 s limit once fired on a healthy boot, CHALLENGES.md): the limit is
    # then at least boot_s.
    local limit=$hb_limit
    ((hb > 0 || limit >= boot_s)) || limit=$boot_s
    if ((SECONDS - hb_t >= limit)); then
      kind=l1-froze after=$((SECONDS - hb_t))
      why="L1 froze: no heartbeat from it for $((SECONDS - hb_t)) s"
      ((hb > 0)) || why="L1 never started its heartbeat within $limit s"
    elif ((SECONDS - io_t >= silent_limit)); then
      kind=silent after=$((SECONDS - io_t))
      why="the scenario went silent: no L1 console or L2 serial output for $((SECONDS - io_t)) s while L1's heartbeat went on"
    else
      continue
    fi
    echo "lab: L1 watchdog: $why; gathering evidence into $out/l1-stall.log and stopping L1" >&2
    _l1_evidence "$out" "$pid" "$kind" "$why"
    [[ $kind != l1-froze || $expect == stall:l1-froze ]] || echo "l1-froze: $why" >>"$out/freezes.log"
    printf '%s\n' "$kind" >"$out/work/stall-kind"
    printf '%s\n' "$why" >"$out/work/stall-why"
    printf '%s\n' "$after" >"$out/work/stall-after"
    kill -TERM "$pid" 2>/dev/null
    for _ in 1 2 3 4 5; do [[ -e /proc/$pid ]] || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null
    break
  done
  kill "$drain" 2>/dev/null
  wait "$drain" 2>/dev/null
  return 0
}

# l1_watchdog_verdict OUT EXPECT: the failure reason ("" = pass) of a run the
# watchdog fired in, or of a self-test (EXPECT=stall:KIND) whatever happened.
l1_watchdog_verdict() {
  local out=$1 expect=$2 kind why want
  kind=$(cat "$out/work/stall-kind" 2>/dev/null) || kind=''
  why=$(cat "$out/work/stall-why" 2>/dev/null) || why=''
  if [[ -z $expect ]]; then
    echo "$why (the L1 watchdog's evidence: $out/l1-stall.log)"
    return
  fi
  [[ $expect == "stall:$kind" ]] || { echo "the L1 watchdog's self-test expected '$expect', got '${kind:-no stall}'${why:+ ($why)}"; return; }
  # The evidence must hold what tells the emulator from the scenario.
  for want in "LAB-L1-STALL $kind" "QEMU's threads, t0:" "  thread " "L1's machine state" "RIP=" "LAB-L1 hb"; do
    grep -qF -- "$want" "$out/l1-stall.log" || { echo "the L1 watchdog's evidence lacks '$want'"; return; }
  done
  if [[ $kind == l1-froze ]]; then
    grep -q 'VM status: paused' "$out/l1-stall.log" || { echo "the frozen L1 does not show as paused in the evidence"; return; }
  fi
  echo ""
}

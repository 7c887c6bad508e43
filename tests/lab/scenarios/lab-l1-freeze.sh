# lab: description=the host's L1 watchdog self-test, frozen machine: L1's CPU is stopped (through QEMU's monitor, as an emulator hang would leave it); the host sees L1's heartbeat stop within l1-stall-s, gathers the emulator's view (QEMU's threads, L1's registers, L1's last heartbeats) and stops QEMU
# lab: default=yes
# lab: timeout=300
# lab: expect=stall:l1-froze
# lab: l1-stall-s=15
#
# Issue 10: a hang of L1 itself (its kernel or the emulator) is invisible from
# inside L1, so the host bounds it (tests/lab/lib/watchdog.sh). This scenario
# passes only if the watchdog fires as "l1-froze" with its evidence.
# In CI's default set (about 50 s of one slot): the watchdog's freeze record
# is what buys a failed scenario its one retry (tests/tests/lab.rs), so its
# detection is proven on every run. By hand: tests/lab/run.sh lab-l1-freeze.
. /lab/lib.sh

# Two heartbeats first, so the evidence has some to show.
sleep 6
echo "LAB-SELFTEST freeze-l1"
sleep 600
lab_fail "L1 was not frozen"

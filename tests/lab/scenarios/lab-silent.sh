# lab: description=the host's L1 watchdog self-test, stuck scenario: L1 runs (its heartbeat goes on) but the scenario prints nothing and no L2 serial grows; the host fires after silent-s with L1's process table and stops QEMU
# lab: default=yes
# lab: timeout=300
# lab: expect=stall:silent
# lab: silent-s=15
#
# Issue 10: a scenario stuck with L1 alive (a wait it does not bound, a VMM
# or guest that hangs outside lab_run_l2) costs silent-s, not the global
# timeout. This scenario passes only if the watchdog fires as "silent".
# By hand: tests/lab/run.sh lab-silent
. /lab/lib.sh

lab_note "going silent"
sleep 600
lab_fail "the watchdog did not stop L1"

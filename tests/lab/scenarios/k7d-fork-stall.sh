# lab: description=the fork scenarios' stall watchdog self-test: the daemon is stopped (SIGSTOP) with its guest running; the watchdog sees the guests' serial logs stop within LAB_STALL_S (here 10 s), gathers the evidence and kills the daemon, and the scenario fails at once saying "stalled"
# lab: default=yes
# lab: timeout=300
# lab: bin=required
# lab: guest=k7d-fork
# lab: guest-modules=virtio_pci virtio_blk
# lab: files=tests/lab/scenarios/k7d-fork.sh
#
# Issue 10: the daemon-driven fork scenarios do not run their guests through
# lab_run_l2, so k7d-fork.sh has its own watcher over every serial log in the
# daemon's state dir. This runs k7d-fork.sh up to the fork with the daemon
# stopped: it passes only if the watchdog fired with its evidence.
# By hand: tests/lab/run.sh --bin target/release/k7d k7d-fork-stall
# shellcheck disable=SC2034  # read by the sourced scenario
FORK_STALL_SELFTEST=1 LAB_STALL_S=10
# shellcheck source=k7d-fork.sh
. /lab/files/k7d-fork.sh
lab_fail "the stopped daemon went unnoticed"

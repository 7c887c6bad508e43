# lab: description=host-level tests whose prerequisite the PVM host lacks, run inside L1 (/dev/vhost-net): the vhost NIC fork tests (kernel dirty log switched on; byte identity with frames landing through vhost-net)
# lab: default=yes
# lab: timeout=300
# lab: test-bin=required
# lab: l1-modules=tun vhost_net
#
# The host's kernel ships no vhost_net, so on the host
# tests/tests/fork_devices.rs::a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on
# and ::every_fork_equals_its_source_while_frames_land_through_vhost_net can
# only say they skipped. L1 has /dev/vhost-net and KVM (nested SVM), so the
# same test binary (--test-bin, built on the host by cargo) runs them here for
# real: a memwriter VM with a vhost-net NIC forked twice, the kernel's dirty
# log switched on by the first fork and drained by the second, each child on
# its own tap with the source's MAC; then forks taken while frames flood the
# tap and the kernel writes them into guest RAM, each child equal to its
# source page for page (K7D_FORK_ROUNDS forks: fewer than on the host, L1 is
# emulated). K7D_NO_SKIP=1: a skip here is a failure.
# By hand: tests/lab/run.sh --test-bin target/release/deps/fork_devices-HASH host-tests-l1
. /lab/lib.sh

[ -x "${LAB_TEST_BIN:-}" ] || lab_fail "no test binary (run.sh --test-bin PATH)"
[ -c /dev/vhost-net ] || lab_fail "no /dev/vhost-net in L1"
[ -c /dev/net/tun ] || lab_fail "no /dev/net/tun in L1"
for T in a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on \
         every_fork_equals_its_source_while_frames_land_through_vhost_net; do
  K7D_FORK_ROUNDS=30 K7D_NO_SKIP=1 RUST_BACKTRACE=1 timeout 120 "$LAB_TEST_BIN" --exact "$T" --test-threads=1 --nocapture >/tmp/host-tests.out 2>&1
  rc=$?
  cat /tmp/host-tests.out
  [ "$rc" = 0 ] || lab_fail "$T failed in L1 (rc $rc): $(grep -m1 -E 'panicked|K7D-SKIP|error' /tmp/host-tests.out)"
  # The test's own eprintln may share the `test ... ok` line: check the name
  # ran, and the binary's count.
  grep -q "^test $T \.\.\. " /tmp/host-tests.out || lab_fail "$T did not run in L1"
  grep -q "test result: ok. 1 passed" /tmp/host-tests.out || lab_fail "the test binary did not report 1 passed for $T"
  lab_note "$T passed in L1 with /dev/vhost-net: $(grep -m1 -oE '[0-9]+ forks \(vhost: on\).*differing pages; [0-9]+ intervals with RX writes, [0-9]+ RX-written pages checked' /tmp/host-tests.out || echo 'no byte-identity line')"
done
lab_pass "host-level vhost fork tests passed in L1"

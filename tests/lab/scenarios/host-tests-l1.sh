# lab: description=host-level tests whose prerequisite the PVM host lacks, run inside L1 (/dev/vhost-net): the vhost NIC fork test
# lab: default=yes
# lab: timeout=300
# lab: test-bin=required
# lab: l1-modules=tun vhost_net
#
# The host's kernel ships no vhost_net, so on the host
# tests/tests/fork_devices.rs::a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on
# can only say it skipped. L1 has /dev/vhost-net and KVM (nested SVM), so the
# same test binary (--test-bin, built on the host by cargo) runs it here for
# real: a memwriter VM with a vhost-net NIC forked twice, the kernel's dirty
# log switched on by the first fork and drained by the second, each child on
# its own tap with the source's MAC. K7D_NO_SKIP=1: a skip here is a failure.
# By hand: tests/lab/run.sh --test-bin target/release/deps/fork_devices-HASH host-tests-l1
. /lab/lib.sh

[ -x "${LAB_TEST_BIN:-}" ] || lab_fail "no test binary (run.sh --test-bin PATH)"
[ -c /dev/vhost-net ] || lab_fail "no /dev/vhost-net in L1"
[ -c /dev/net/tun ] || lab_fail "no /dev/net/tun in L1"
T=a_vhost_nic_is_forked_with_its_kernel_dirty_log_switched_on
K7D_NO_SKIP=1 RUST_BACKTRACE=1 timeout 200 "$LAB_TEST_BIN" --exact "$T" --test-threads=1 --nocapture >/tmp/host-tests.out 2>&1
rc=$?
cat /tmp/host-tests.out
[ "$rc" = 0 ] || lab_fail "$T failed in L1 (rc $rc): $(grep -m1 -E 'panicked|K7D-SKIP|error' /tmp/host-tests.out)"
grep -q "^test $T ... ok" /tmp/host-tests.out || lab_fail "$T did not run in L1"
grep -q "test result: ok. 1 passed" /tmp/host-tests.out || lab_fail "the test binary did not report 1 passed"
lab_note "$T passed in L1 with /dev/vhost-net"
lab_pass "host-level vhost fork test passed in L1"

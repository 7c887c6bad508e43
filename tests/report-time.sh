#!/bin/sh
# Cargo's runner for the host-level tests (tests/run-all.sh sets it for that
# one command): each libtest binary prints every test's wall time
# ("test NAME ... ok <1.234s>"), which the run's summary ranks. libtest's
# --report-time is unstable, so RUSTC_BOOTSTRAP=1 is set for the test
# process only: a runner changes nothing cargo builds (RUSTC_BOOTSTRAP on
# cargo itself would rebuild every crate).
bin=$1
shift
RUSTC_BOOTSTRAP=1 exec "$bin" -Z unstable-options --report-time "$@"

#!/usr/bin/env bash
# Runs every k7d test on this machine, installing what the tests need first.
#
#   tests/run-all.sh            # style checks, all host-level tests (release), fuzz smoke, the nested lab
#   K7D_SKIP_LAB=1 tests/run-all.sh    # everything but the lab (said and counted as a skip)
#   K7D_SKIP_FUZZ=1 tests/run-all.sh   # everything but the fuzz smoke (said and counted as a skip)
#
# Needs root (KVM, taps, network namespaces, bpf) and apt (Debian packages).
# Every phase prints its time; the output ends with the lab's per-scenario
# table, the count of skipped test bodies and of lab scenarios that passed
# only on retry, and the total time.
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$(date +%s)
PHASES=()
phase_t=$T0 phase_name=
log() { printf '\n=== %s\n' "$*"; }
# phase NAME: closes the previous phase (its time is kept for the summary) and opens NAME.
phase() {
  local now; now=$(date +%s)
  [[ -z $phase_name ]] || PHASES+=("$(printf '%5d s  %s' $((now - phase_t)) "$phase_name")")
  phase_name=$1 phase_t=$now
  [[ -z $1 ]] || log "$1"
}

if [ "$(id -u)" -ne 0 ]; then
  echo "tests/run-all.sh needs root (KVM, taps, netns, bpf): run it with sudo" >&2
  exit 1
fi

# The lab tests' output folder (as tests/tests/lab.rs picks it); each
# scenario adds a line to summary.tsv, emptied first so no earlier run's
# table is ever shown. A retried scenario's first attempt is kept in
# <scenario>.attempt1: an earlier run's are removed too, or the summary
# would list their rescues as this run's (a CI run of 2026-12-07 listed two).
LAB_OUT=${K7D_LAB_OUT:-${CARGO_TARGET_DIR:-$(pwd)/target}/lab}
rm -f "$LAB_OUT/summary.tsv"
rm -rf "$LAB_OUT"/*.attempt1
# Skipped test bodies are appended here (k7d-test-skip) and counted at the end.
export K7D_SKIP_LOG
K7D_SKIP_LOG=$(mktemp /tmp/k7d-skips.XXXXXX)
SKIPS_SAID=()
said_skip() { SKIPS_SAID+=("$1"); echo "SKIPPED: $1"; }

# A run leaves tracked files as it found them (a build that rewrites a
# committed Cargo.lock, say, fails it): their diff against HEAD is compared
# at the end with the one at the start.
tracked() { git diff HEAD 2>/dev/null | sha256sum | cut -c1-16; }
TRACKED0=$(tracked)

# ---- summary: printed at the end, and also when a step fails ------------------
summary() {
  local rc=$? retried=0 rescued=0 skipped name verdict attempts wall prep l1 lab_total=0 s
  phase ""
  log "summary"
  printf '%s\n' "${PHASES[@]}"
  if [ -s "$LAB_OUT/summary.tsv" ]; then
    echo
    printf '%-16s %-16s %8s %10s %10s %8s\n' scenario verdict attempts wall_s prepare_s l1_s
    while IFS=$'\t' read -r name verdict attempts wall prep l1 first; do
      printf '%-16s %-16s %8s %10s %10s %8s\n' "$name" "$verdict" "$attempts" "$wall" "$prep" "$l1"
      # The first attempt's failure, for a retry or a failure (lab.rs).
      [[ -z $first || $first == - ]] || printf '  %s first failed: %s\n' "$name" "$first"
      [[ $verdict != "passed on retry" ]] || retried=$((retried + 1))
      [[ $verdict != "pass, rescued" ]] || rescued=$((rescued + 1))
      lab_total=$(awk -v a="$lab_total" -v b="$wall" 'BEGIN {printf "%.1f", a + b}')
    done <"$LAB_OUT/summary.tsv"
    echo "lab total: ${lab_total} s over $(wc -l <"$LAB_OUT/summary.tsv") scenarios"
    # Why each rescue fired (the watchdog's samples of L1's CPU), first attempts' too.
    for f in "$LAB_OUT"/*/rescues.log; do
      [[ -s $f ]] || continue
      f_dir=${f%/rescues.log}
      sed "s|^|  ${f_dir##*/}: |" "$f"
    done
  fi
  if [[ -s ${HOST_TIMES:-} ]]; then
    echo
    echo "host-level tests: $(grep -cE '^test .* <[0-9.]+s>$' "$HOST_TIMES") timed, $(grep -E '^test .* <[0-9.]+s>$' "$HOST_TIMES" |
      sed -E 's/.*<([0-9.]+)s>$/\1/' | awk '{s += $1} END {printf "%.0f", s}') s in all (each binary's tests run two at a time); the slowest:"
    grep -E '^test .* <[0-9.]+s>$' "$HOST_TIMES" | sed -E 's/^test (.*) \.\.\. [a-zA-Z]+ <([0-9.]+)s>$/\2 \1/' |
      sort -rn | awk 'NR <= 12 {printf "  %7.1f s  %s\n", $1, $2}'
  fi
  rm -f "${HOST_TIMES:-}"
  if [ -z "${K7D_SKIP_LAB:-}" ]; then
    echo
    echo "lab scenarios run by hand only (no test runs them; tests/lab/run.sh --check holds each to a reason):"
    tests/lab/run.sh --by-hand | sed 's/^/  /'
  fi
  skipped=$(sort -u "$K7D_SKIP_LOG" | wc -l)
  echo
  echo "skipped test bodies: $((skipped + ${#SKIPS_SAID[@]}))"
  sort -u "$K7D_SKIP_LOG" | sed 's/^/  /'
  for s in "${SKIPS_SAID[@]}"; do echo "  $s"; done
  # An unexpected skip fails the run: each skip's test must be on the
  # allowlist (tests/expected-skips.txt, with why this machine skips it).
  local unexpected
  unexpected=$(sort -u "$K7D_SKIP_LOG" | sed -n 's/^K7D-SKIP \([^:]*\):.*/\1/p' | while read -r t; do
    grep -qxF -- "$t" <(sed -n 's/^\([^#][^|]*[^ |]\) *|.*/\1/p' tests/expected-skips.txt) || echo "$t"
  done)
  if [[ -n $unexpected ]]; then
    echo "UNEXPECTED SKIPS (not in tests/expected-skips.txt): a check that silently stopped running fails CI:"
    printf '%s\n' "$unexpected" | sed 's/^/  /'
    [[ $rc -ne 0 ]] || rc=3
  fi
  echo "lab scenarios that passed after the L1 watchdog woke a frozen L1 (rescued): $rescued"
  echo "lab scenarios that passed only on retry: $retried"
  rm -f "$K7D_SKIP_LOG"
  if [[ $(tracked) != "$TRACKED0" ]]; then
    echo "TRACKED FILES CHANGED by this run (a test or build rewrote them):"
    git status --porcelain --untracked-files=no | sed 's/^/  /'
    [[ $rc -ne 0 ]] || rc=4
  fi
  if [ "$rc" -eq 0 ]; then log "all tests passed in $(( $(date +%s) - T0 )) s"; else log "FAILED (rc $rc) after $(( $(date +%s) - T0 )) s"; fi
  exit "$rc"
}
trap summary EXIT

# Host packages: clang/libbpf for the tc programs, iproute2/ping/procps for the
# netns tests, qemu-system-x86 for the peer side of benches and the lab,
# acpica-tools (iasl) to check k7d's ACPI tables with ACPICA's disassembler,
# protobuf-compiler (protoc) for the CRI protos of tests/cri (k8s-cri's build).
phase "host packages"
# prometheus (and its promtool) scrapes the daemon in vmm/tests/metrics.rs;
# the test starts its own on loopback, so the package's service is stopped.
# e2fsprogs, erofs-utils and fdisk (sfdisk) make the real filesystems and
# partition tables k7d-agent reads for root=UUID=/PARTUUID=
# (guest/agent/src/rootdev.rs).
PKGS=(clang llvm libbpf-dev iproute2 iputils-ping procps qemu-system-x86 acpica-tools protobuf-compiler prometheus e2fsprogs erofs-utils fdisk)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi
if [ -z "${K7D_SKIP_LAB:-}" ]; then
  phase "lab host packages and kernels"
  tests/lab/setup.sh
  # The real-kernel boot-params test reads the cloud kernel from the lab cache.
  tests/lab/run.sh --fetch
fi

phase "build and host readiness (k7d check)"
# The escape drill's k7d (the test-only `escape-drill` feature,
# vmm/src/drill.rs) for vmm/tests/escape_drill.rs, in the `drill` profile
# (Cargo.toml: unoptimized, its own folder): its k7d-vmm compiles in 11 s
# where a release build took 57 s, and the release binary never carries it.
cargo build --profile drill --bin k7d --features k7d-vmm/escape-drill
K7D_DRILL_BIN=$(cd "${CARGO_TARGET_DIR:-target}/drill" && pwd)/k7d
export K7D_DRILL_BIN
# The release binary every later phase runs is the one `cargo test
# --workspace` builds (its features unify the workspace's dev-dependencies):
# built here once with the test binaries, so the host-level tests compile
# nothing again and no plain `cargo build` makes a binary they would replace.
cargo test --workspace --release --no-run
if "${CARGO_TARGET_DIR:-target}/release/k7d" --version | grep -q escape-drill; then
  echo "FAIL: the release build of k7d carries the test-only escape drill" >&2
  exit 1
fi
# The lab runs this same k7d: left to itself it builds `-p k7d-vmm --bin
# k7d`, whose dependencies' features differ from the workspace's, so it
# compiled k7d-vmm a third time (72 s of both cores, while the first L1s
# ran) and replaced the binary the host tests had used. The guest agent and
# the lab's CRI client (which `cargo test` does not build) are built here,
# before any L1 competes for the cores; the lab finds them fresh.
K7D_LAB_BIN=$(cd "${CARGO_TARGET_DIR:-target}/release" && pwd)/k7d
export K7D_LAB_BIN
cargo build --release -p k7d-agent --bin k7d-agent
cargo build --release -p k7d-cri --bin k7d-cri
"${CARGO_TARGET_DIR:-target}/release/k7d" check || true

phase "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo clippy -p k7d-vmm --lib --release --features escape-drill -- -D warnings

phase "host-level tests (real KVM, release)"
# The upgrade drill (vmm/tests/daemon_vm_process.rs): a k7d of an earlier
# commit, the release binary of the last run that passed on this machine
# (kept at the end of this script), whose daemon's VMs this k7d's daemon
# takes over. The first run on a machine has none (an expected skip).
UPGRADE_CACHE=${K7D_UPGRADE_CACHE:-/var/cache/k7d-upgrade}
if [ -x "$UPGRADE_CACHE/k7d" ] && [ "$(cat "$UPGRADE_CACHE/commit" 2>/dev/null)" != "$(git rev-parse HEAD)" ]; then
  export K7D_UPGRADE_FROM_BIN=$UPGRADE_CACHE/k7d
  echo "upgrade drill: from k7d of commit $(cat "$UPGRADE_CACHE/commit") ($("$K7D_UPGRADE_FROM_BIN" --version))"
fi
# Each test's wall time (tests/report-time.sh, cargo's runner for this
# command only) goes to HOST_TIMES; the summary ranks the slowest.
HOST_TIMES=$(mktemp /tmp/k7d-host-times.XXXXXX)
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$(pwd)/tests/report-time.sh \
  cargo test --workspace --release 2>&1 | tee "$HOST_TIMES"

phase "python client (pytest against a real daemon; rollouts over a two-node Ray cluster)"
# pytest and Ray from PyPI, cached outside the checkout by version (vmm/python/run-tests.sh).
vmm/python/run-tests.sh "$(cd "${CARGO_TARGET_DIR:-target}/release" && pwd)/k7d"

phase "tc object: no clang embeds nothing, a plain rebuild after clang appears embeds it"
bpf/tests/clang-appears.sh

if [ -z "${K7D_SKIP_FUZZ:-}" ]; then
  phase "fuzz smoke (every target, bounded; stable toolchain + RUSTC_BOOTSTRAP=1)"
  # A broken or empty target list must fail the smoke, never pass it.
  devices/fuzz/smoke-selftest.sh
  # Build products and cargo-fuzz are cached outside the repo (the fuzz crate is its own workspace).
  FUZZ_TARGET_DIR=${FUZZ_TARGET_DIR:-/var/cache/k7d-fuzz-target} devices/fuzz/smoke.sh "${K7D_FUZZ_SECS:-6}"
  # The daemon's parsers (API requests, snapshot files): their own crate and target dir.
  K7D_FUZZ_DIR=vmm/fuzz FUZZ_TARGET_DIR=${FUZZ_TARGET_DIR:-/var/cache/k7d-fuzz-target}-vmm devices/fuzz/smoke.sh "${K7D_FUZZ_SECS:-6}"
else
  said_skip "fuzz smoke (K7D_SKIP_FUZZ is set)"
fi

if [ -z "${K7D_SKIP_LAB:-}" ]; then
  phase "nested lab (real Linux guests)"
  # Two scenarios at a time: each L1 is one TCG thread, the host has 2 cores
  # (docs/lab.md, K7D_LAB_SLOTS); boot-compare runs alone (exclusive=yes).
  # Every lab test starts at once and queues in the test binary's gate,
  # which starts the longest scenarios first (tests/tests/lab.rs, Gate).
  # --workspace: the feature set the host-level tests were built with, so
  # nothing is compiled again.
  slots=${K7D_LAB_SLOTS:-$(( $(nproc) >= 2 ? 2 : 1 ))}
  # The L1 watchdog's self-tests (lab-l1-freeze, lab-silent: no k7d in
  # them) run on their schedule: when the harness or QEMU changed since
  # their last pass here, or a day after it (tests/tests/lab.rs, selfcheck_due).
  K7D_LAB_SELFCHECK=scheduled K7D_LAB_SLOTS=$slots cargo test --release --workspace --test lab -- --ignored \
    --test-threads=64 --nocapture
else
  said_skip "nested lab (K7D_SKIP_LAB is set)"
fi

# This run passed: its k7d is the next run's k7d of an earlier commit.
mkdir -p "$UPGRADE_CACHE"
cp "${CARGO_TARGET_DIR:-target}/release/k7d" "$UPGRADE_CACHE/k7d.new"
mv "$UPGRADE_CACHE/k7d.new" "$UPGRADE_CACHE/k7d"
git rev-parse HEAD >"$UPGRADE_CACHE/commit"

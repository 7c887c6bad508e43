#!/usr/bin/env bash
# Runs every k7d test on this machine, installing what the tests need first.
#
#   tests/run-all.sh            # style checks, all host-level tests (release), the nested lab
#   K7D_SKIP_LAB=1 tests/run-all.sh   # everything but the lab
#
# Needs root (KVM, taps, network namespaces, bpf) and apt (Debian packages).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n=== %s\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "tests/run-all.sh needs root (KVM, taps, netns, bpf): run it with sudo" >&2
  exit 1
fi

# Host packages: clang/libbpf for the tc programs, iproute2/ping/procps for the
# netns tests, qemu-system-x86 for the peer side of benches and the lab.
PKGS=(clang llvm libbpf-dev iproute2 iputils-ping procps qemu-system-x86)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ -z "${K7D_SKIP_LAB:-}" ] && [ -x tests/lab/setup.sh ]; then
  log "lab host packages"
  tests/lab/setup.sh
fi

log "host readiness (k7d check)"
cargo build --release --bin k7d
./target/release/k7d check || true

log "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings

log "host-level tests (real KVM, release build: latency budgets are asserted)"
cargo test --workspace --release

if [ -z "${K7D_SKIP_FUZZ:-}" ]; then
  if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
    log "fuzz smoke (every target, bounded)"
    # Build products cached outside the repo (the fuzz crate is its own workspace).
    FUZZ_TARGET_DIR=${FUZZ_TARGET_DIR:-/var/cache/k7d-fuzz-target} devices/fuzz/smoke.sh "${K7D_FUZZ_SECS:-20}"
  else
    log "fuzz smoke skipped: no nightly toolchain (cargo-fuzz needs one; see docs/fuzzing.md)"
  fi
fi

if [ -z "${K7D_SKIP_LAB:-}" ]; then
  log "nested lab (real Linux guests)"
  cargo test --release -p k7d-tests --test lab -- --ignored --test-threads=1 --nocapture
fi
log "all tests passed"

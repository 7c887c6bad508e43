#!/usr/bin/env bash
# Proves that devices/fuzz/smoke.sh fails loudly instead of passing with zero
# targets: against a copy of the fuzz crate whose Cargo.toml is corrupted
# (`cargo fuzz list` fails) and against one that declares no target (the list
# is empty). Nothing is built, so this takes about a second (cargo-fuzz must
# be installed, or smoke.sh installs it first).
#   devices/fuzz/smoke-selftest.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d /tmp/k7d-fuzz-selftest.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT

fails=0
# expect_failure NAME DIR MESSAGE: smoke.sh on DIR must exit non-zero and say MESSAGE.
expect_failure() {
    local name="$1" dir="$2" msg="$3" out rc=0
    out=$(K7D_FUZZ_DIR="$dir" FUZZ_TARGET_DIR="$tmp/target" "$here/smoke.sh" 1 2>&1) || rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "smoke selftest: FAIL $name: smoke.sh exited 0; output:"
        echo "$out"
        fails=$((fails + 1))
    elif ! grep -qF "$msg" <<<"$out"; then
        echo "smoke selftest: FAIL $name: exit $rc but no '$msg' in the output:"
        echo "$out"
        fails=$((fails + 1))
    else
        echo "smoke selftest: ok   $name: exit $rc, $(grep -F "$msg" <<<"$out" | head -n 1 | cut -c1-160)"
    fi
}

# cargo-fuzz finds its crate as `fuzz/` under the nearest non-fuzz cargo
# package (devices/ for the real one), so each case is <case>/fuzz with a
# plain package manifest in <case>/.
with_parent() {
    mkdir -p "$1/fuzz/fuzz_targets"
    printf '[package]\nname = "k7d-fuzz-selftest-parent"\nversion = "0.0.0"\nedition = "2024"\n' >"$1/Cargo.toml"
}

# 1. A broken manifest: cargo fuzz list fails.
with_parent "$tmp/broken"
cp "$here"/fuzz_targets/*.rs "$tmp/broken/fuzz/fuzz_targets/"
cp "$here/Cargo.toml" "$tmp/broken/fuzz/Cargo.toml"
printf '\n[[bin]\nname = "unterminated\n' >>"$tmp/broken/fuzz/Cargo.toml"
expect_failure "broken Cargo.toml" "$tmp/broken/fuzz" "fuzz smoke: cargo fuzz list failed"

# 2. A valid fuzz manifest without any [[bin]] target: the list is empty.
with_parent "$tmp/empty"
printf '%s\n' '[package]' 'name = "k7d-fuzz-selftest-empty"' 'version = "0.0.0"' 'edition = "2024"' \
    '' '[package.metadata]' 'cargo-fuzz = true' '' '[workspace]' >"$tmp/empty/fuzz/Cargo.toml"
expect_failure "no targets" "$tmp/empty/fuzz" "fuzz smoke: cargo fuzz list found no targets"

if [ "$fails" -ne 0 ]; then
    echo "smoke selftest: $fails case(s) failed"
    exit 1
fi
echo "smoke selftest: 2 cases, smoke.sh fails on a broken and on an empty target list"

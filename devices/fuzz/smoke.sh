#!/usr/bin/env bash
# Fuzz smoke for CI: runs every target for a bounded time (default 30 s each)
# and fails on the first crash, leak, timeout or OOM.
#   devices/fuzz/smoke.sh [seconds]
# Needs: rustup nightly + `cargo install cargo-fuzz`.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-30}"
target_dir="${FUZZ_TARGET_DIR:-target}"
for t in $(cargo +nightly fuzz list); do
    echo "== fuzz smoke: $t for ${secs}s"
    mkdir -p "corpus/$t"
    cargo +nightly fuzz run "$t" --target-dir "$target_dir" "corpus/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
done

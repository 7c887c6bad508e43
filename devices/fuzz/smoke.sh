#!/usr/bin/env bash
# Fuzz smoke for CI: runs every target for a bounded time (default 30 s each)
# and fails on the first crash, leak, timeout or OOM, on a failing or empty
# target list, and when no target ran.
#   devices/fuzz/smoke.sh [seconds]
#   K7D_FUZZ_DIR=vmm/fuzz devices/fuzz/smoke.sh [seconds]   # the daemon's parsers
#
# Works with the stable toolchain: cargo-fuzz passes `-Z` sanitizer flags, so
# RUSTC_BOOTSTRAP=1 is set (nightly is not needed). Environment:
#   K7D_FUZZ_TOOLCHAIN  run `cargo +<toolchain> fuzz` instead of plain
#                       `cargo fuzz` (e.g. nightly); unset: the default toolchain
#   FUZZ_TARGET_DIR     build products (default /var/cache/k7d-fuzz-target,
#                       outside the repo; the fuzz crate is its own workspace)
#   K7D_FUZZ_DIR        the cargo-fuzz crate to run (default: this folder;
#                       smoke-selftest.sh points it at a broken copy)
#   K7D_CARGO_FUZZ_VERSION  cargo-fuzz installed when missing (default 0.13.2,
#                       builds with Rust 1.95)
set -euo pipefail

secs="${1:-30}"
case "$secs" in
'' | *[!0-9]*)
    echo "fuzz smoke: seconds must be a positive integer, got '$secs'" >&2
    exit 2
    ;;
esac
if [ "$secs" -eq 0 ]; then
    echo "fuzz smoke: seconds must be a positive integer, got '$secs'" >&2
    exit 2
fi

fuzz_dir="${K7D_FUZZ_DIR:-$(dirname "$0")}"

# One path for every clone. The fuzz crate is a workspace of its own, and
# cargo names a path dependency outside the building workspace (k7d-devices,
# k7d-vmm and theirs) by its absolute path in the build products' hash: each
# fresh clone at a new path rebuilt them all, sanitized (2.5 minutes of CI
# for k7d-vmm alone), and left another copy in the target dir. As root, the
# smoke reruns itself in a mount namespace of its own, where the repository
# is bound at K7D_FUZZ_SRC (default /var/cache/k7d-fuzz-src, an empty folder
# outside it); the bind ends with the namespace. Where that cannot be done
# it runs in place, said once.
if [ -z "${K7D_FUZZ_BOUND:-}" ] && [ "$(id -u)" -eq 0 ] &&
    top=$(git -C "$fuzz_dir" rev-parse --show-toplevel 2>/dev/null); then
    src="${K7D_FUZZ_SRC:-/var/cache/k7d-fuzz-src}"
    rel=$(realpath --relative-to="$top" "$fuzz_dir")
    self=$(realpath --relative-to="$top" "$0")
    if mkdir -p "$src" && unshare --mount --propagation private true 2>/dev/null; then
        K7D_FUZZ_BOUND=1 K7D_FUZZ_SHOWN="$top/$rel" K7D_FUZZ_DIR="$src/$rel" exec unshare --mount --propagation private \
            bash -c 'mount --bind "$1" "$2" && exec "$2/$3" "$4"' bind "$top" "$src" "$self" "$secs"
    fi
    echo "fuzz smoke: cannot bind the repository at $src in a mount namespace of its own: building in place (path dependencies rebuild when the clone's path is new)"
fi

cd "$fuzz_dir" || {
    echo "fuzz smoke: cannot enter the fuzz crate $fuzz_dir" >&2
    exit 1
}
# Where the fuzz crate is for the person reading the messages (not the bind).
shown="${K7D_FUZZ_SHOWN:-$PWD}"
target_dir="${FUZZ_TARGET_DIR:-/var/cache/k7d-fuzz-target}"
mkdir -p "$target_dir" || {
    echo "fuzz smoke: cannot create FUZZ_TARGET_DIR $target_dir; set FUZZ_TARGET_DIR to a writable folder" >&2
    exit 1
}

if ! cargo fuzz --version >/dev/null 2>&1; then
    version="${K7D_CARGO_FUZZ_VERSION:-0.13.2}"
    echo "fuzz smoke: cargo-fuzz missing, installing $version from crates.io"
    cargo install --locked cargo-fuzz --version "$version" || {
        echo "fuzz smoke: cargo install --locked cargo-fuzz --version $version failed" >&2
        exit 1
    }
fi

# cargo-fuzz adds -Zsanitizer=... and friends; let a stable rustc accept them.
export RUSTC_BOOTSTRAP="${RUSTC_BOOTSTRAP:-1}"
cargo_fuzz=(cargo)
if [ -n "${K7D_FUZZ_TOOLCHAIN:-}" ]; then
    cargo_fuzz+=("+$K7D_FUZZ_TOOLCHAIN")
fi
cargo_fuzz+=(fuzz)

rustc_cmd=(rustc)
if [ -n "${K7D_FUZZ_TOOLCHAIN:-}" ]; then
    rustc_cmd=(rustup run "$K7D_FUZZ_TOOLCHAIN" rustc)
fi
echo "fuzz smoke: $("${rustc_cmd[@]}" --version), $(cargo fuzz --version), RUSTC_BOOTSTRAP=$RUSTC_BOOTSTRAP, target dir $target_dir"

# The list goes into a variable first: a failure inside `for t in $(...)`
# escapes `set -e` and would run zero targets and pass.
list_err=$(mktemp)
trap 'rm -f "$list_err"' EXIT
list=$("${cargo_fuzz[@]}" list 2>"$list_err") || {
    # One line: the error and its causes, without anyhow's backtrace.
    echo "fuzz smoke: cargo fuzz list failed in $shown: $(sed '/^Stack backtrace:/,$d' "$list_err" | tr -s '\n ' ' ')" >&2
    exit 1
}
if [ -z "${list//[[:space:]]/}" ]; then
    echo "fuzz smoke: cargo fuzz list found no targets in $shown/Cargo.toml" >&2
    exit 1
fi

ran=0
for t in $list; do
    echo "== fuzz smoke: $t for ${secs}s"
    mkdir -p "corpus/$t"
    # Committed seeds (seeds/<target>/, read only) join the working corpus.
    dirs=("corpus/$t")
    [ ! -d "seeds/$t" ] || dirs+=("seeds/$t")
    # 16 codegen units, not cargo-fuzz's 1 for release builds: a run that
    # changed k7d-vmm rebuilds it in 84 s instead of 126 s on 2 cores, and
    # the slower code it gives (no ThinLTO imports across units) costs
    # executions, not coverage, in a smoke of seconds.
    if ! "${cargo_fuzz[@]}" run "$t" --codegen-units 16 --target-dir "$target_dir" "${dirs[@]}" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; then
        echo "fuzz smoke: $t failed (build error, or a crash, leak, timeout or OOM: see $shown/artifacts/$t/)" >&2
        exit 1
    fi
    ran=$((ran + 1))
done
if [ "$ran" -eq 0 ]; then
    echo "fuzz smoke: no target ran" >&2
    exit 1
fi
echo "fuzz smoke: $ran targets ran, 0 crashes"

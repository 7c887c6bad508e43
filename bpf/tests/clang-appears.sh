#!/usr/bin/env bash
# Proves that the tc object gets embedded once clang appears, without
# `cargo clean` and without changing PATH ("build without clang, then
# apt-get install clang, then cargo build"):
#   1. clang hidden, CI=true: the build fails with a clear message;
#   2. clang hidden: the build succeeds, embeds nothing and says why; a second
#      build is fresh (no rebuild loop);
#   3. clang "installed": a symlink appears in the same PATH folder, with the
#      package's old mtime as dpkg leaves it;
#   4. plain `cargo build`: the build script reruns and the object is embedded
#      (k7d_bpf::tc_object_embedded() says so); a second build is fresh.
# PATH hides clang by replacing every PATH folder that holds one with a
# folder of symlinks to everything else in it. Uses its own CARGO_TARGET_DIR.
#   bpf/tests/clang-appears.sh        (needs clang installed; no root)
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="${K7D_CLANG_APPEARS_DIR:-/tmp/k7d-clang-appears}"
export CARGO_TARGET_DIR="$work/target"
unset K7D_CLANG K7D_BPF_SKIP_BUILD CI

fail() {
    echo "clang-appears: FAIL: $*" >&2
    exit 1
}
step() { echo "== clang-appears: $*"; }

real_clang="$(command -v clang)" || fail "clang is not installed (apt-get install clang); this test needs one to reveal"
cd "$repo"

# Hidden-clang PATH: folders holding clang are replaced by shadow folders.
rm -rf "$work/shadow"
mkdir -p "$work/shadow"
new_path=""
n=0
shadowed=()
IFS=: read -r -a dirs <<<"$PATH"
for d in "${dirs[@]}"; do
    [ -n "$d" ] || continue
    if [ -x "$d/clang" ] && [ ! -d "$d/clang" ]; then
        n=$((n + 1))
        s="$work/shadow/$n"
        mkdir -p "$s"
        for e in "$d"/* "$d"/.[!.]*; do
            [ -e "$e" ] || [ -L "$e" ] || continue
            case "$(basename "$e")" in clang*) continue ;; esac
            ln -s "$e" "$s/$(basename "$e")"
        done
        shadowed+=("$d=$s")
        d="$s"
    fi
    new_path="${new_path:+$new_path:}$d"
done
[ "$n" -gt 0 ] || fail "no PATH folder holds clang, yet command -v found $real_clang"
export PATH="$new_path"
if command -v clang >/dev/null; then
    fail "clang still visible after hiding: $(command -v clang)"
fi
echo "clang-appears: hid clang: ${shadowed[*]}"

# out_dir of k7d-bpf's build script from cargo's JSON messages.
object_of() {
    local out
    out=$(sed -n '/"reason":"build-script-executed"/{/k7d-bpf@/s/.*"out_dir":"\([^"]*\)".*/\1/p}' "$1" | tail -n 1)
    [ -n "$out" ] || fail "no build-script-executed message for k7d-bpf in $1"
    echo "$out/k7d_tc.o"
}
# status: what the crate itself says (the test prints it).
status() {
    cargo test -q -p k7d-bpf --test object -- --exact tc_object_status_matches_the_object --nocapture 2>&1 |
        grep '^tc object: ' || fail "no 'tc object:' line from the k7d-bpf status test"
}

cargo clean -q -p k7d-bpf

step "1. no clang, CI=true: the build must fail"
if CI=true cargo build -p k7d-bpf >"$work/ci.log" 2>&1; then
    fail "CI=true build without clang succeeded"
fi
grep -q "CI=true and the tc object cannot be built" "$work/ci.log" ||
    fail "CI=true build failed without the message: $(tail -n 5 "$work/ci.log")"
echo "clang-appears: ok: $(grep -o 'CI=true and the tc object cannot be built[^.]*' "$work/ci.log" | head -n 1)"

step "2. no clang: plain cargo build"
cargo build -p k7d-bpf --message-format=json-render-diagnostics >"$work/build1.json" 2>"$work/build1.log" ||
    fail "build without clang failed: $(tail -n 5 "$work/build1.log")"
obj="$(object_of "$work/build1.json")"
[ -f "$obj" ] && [ ! -s "$obj" ] || fail "expected an empty object at $obj"
grep -h "embedding no bpf object" "$work/build1.log" | head -n 1
st="$(status)"
echo "clang-appears: $st"
case "$st" in "tc object: missing (clang was not found in PATH at build time)") ;; *) fail "unexpected: $st" ;; esac
cargo build -v -p k7d-bpf >"$work/build1b.log" 2>&1 || fail "second build without clang failed"
grep -q "Fresh k7d-bpf" "$work/build1b.log" || fail "second build without clang was not fresh: $(grep k7d-bpf "$work/build1b.log")"
echo "clang-appears: ok: second build without clang is fresh"

step "3. apt-get install clang (simulated): clang appears in the same PATH folder"
first="${shadowed[0]}"
s="${first#*=}"
ln -s "$real_clang" "$s/clang"
touch -h -r "$real_clang" "$s/clang" # dpkg keeps the package's mtime
ls -l --time-style=long-iso "$s/clang"
[ "$(command -v clang)" = "$s/clang" ] || fail "clang not visible after install: $(command -v clang || true)"

step "4. plain cargo build again (same PATH)"
cargo build -v -p k7d-bpf --message-format=json-render-diagnostics >"$work/build2.json" 2>"$work/build2.log" ||
    fail "build with clang failed: $(tail -n 5 "$work/build2.log")"
grep -h "Dirty k7d-bpf" "$work/build2.log" | head -n 1 || fail "k7d-bpf was not rebuilt after clang appeared"
obj="$(object_of "$work/build2.json")"
[ -s "$obj" ] || fail "object still empty at $obj after clang appeared"
echo "clang-appears: object $obj, $(stat -c %s "$obj") bytes"
st="$(status)"
echo "clang-appears: $st"
[ "$st" = "tc object: embedded" ] || fail "unexpected: $st"
cargo build -v -p k7d-bpf >"$work/build2b.log" 2>&1 || fail "second build with clang failed"
grep -q "Fresh k7d-bpf" "$work/build2b.log" || fail "second build with clang was not fresh: $(grep k7d-bpf "$work/build2b.log")"
echo "clang-appears: ok: second build with clang is fresh"
echo "clang-appears: passed (no clang: nothing embedded, CI=true refused; clang appears: plain cargo build embeds the object)"

#!/usr/bin/env bash
# Proves .ci/mtimes.sh on a scratch repository: an unchanged file gets its
# recorded mtime back, a changed one keeps its new mtime, a manifest that a
# later build outdated (a fingerprint newer than it) restores nothing, and a
# manifest is used once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
d=$(mktemp -d /tmp/k7d-mtimes-test.XXXXXX)
trap 'rm -rf "$d"' EXIT
fail() { echo "mtimes self-test: $*" >&2; exit 1; }

mkdir -p "$d/repo/.ci" "$d/target/release/.fingerprint/x"
# The cached build, made before the manifest is saved.
touch -m -d @1000000001 "$d/target/release/.fingerprint/x/dep" "$d/target/release/.fingerprint/x"
cp "$here/mtimes.sh" "$d/repo/.ci/"
cd "$d/repo"
git init -q
printf 'a\n' >same.rs
printf 'b\n' >changed.rs
git add -A
git -c user.name=t -c user.email=t@t commit -qm one
touch -m -d @1000000000 same.rs changed.rs
.ci/mtimes.sh save "$d/manifest"

# A fresh checkout: every file new.
touch same.rs changed.rs .ci/mtimes.sh
printf 'c\n' >changed.rs
.ci/mtimes.sh restore "$d/manifest" "$d/target" >/dev/null
[ "$(stat -c %Y same.rs)" = 1000000000 ] || fail "an unchanged file did not get its recorded mtime back"
[ "$(stat -c %Y changed.rs)" -gt 1000000001 ] || fail "a changed file got an old mtime: cargo would not rebuild it"
[ ! -e "$d/manifest" ] || fail "the manifest was left for a second use"

# Something built after the manifest was saved: nothing is restored.
.ci/mtimes.sh save "$d/manifest"
touch same.rs
sleep 1.1
touch "$d/target/release/.fingerprint/x/dep"
out=$(.ci/mtimes.sh restore "$d/manifest" "$d/target")
[ "$(stat -c %Y same.rs)" -gt 1000000001 ] || fail "restored from a manifest older than a build: $out"
echo "mtimes self-test: passed"

#!/usr/bin/env bash
# Keeps cargo's cached build products valid across fresh clones.
#
#   .ci/mtimes.sh restore MANIFEST TARGET_DIR...   # before the first build
#   .ci/mtimes.sh save MANIFEST                    # after the last one
#
# Cargo (stable) decides whether a workspace crate is stale by its sources'
# mtimes, and a fresh clone gives every file a new one: each CI run rebuilt
# every workspace crate in every profile (minutes), though most files did not
# change. `save` records each tracked file's git blob hash and mtime;
# `restore` gives a file whose content has the same hash its recorded mtime
# back (older than the products built from it), so only changed files look
# newer than their products. A file with other content keeps its new mtime
# and cargo rebuilds what uses it.
#
# The manifest is only trusted when it describes the last builds into these
# target dirs: `restore` deletes it (a run that dies before its `save` leaves
# none, and the next run rebuilds), and ignores it when any fingerprint in a
# target dir is newer than the manifest (something built there since, from
# content the manifest does not describe).
set -euo pipefail
cd "$(dirname "$0")/.."

# Lines "<path>\t<blob hash>" for every tracked file, hashed as it is now.
current() {
  paste <(git ls-files) <(git ls-files | git hash-object --stdin-paths)
}

case "${1:-}" in
  restore)
    manifest=$2
    shift 2
    [ -f "$manifest" ] || { echo "mtimes: no manifest ($manifest): cargo rebuilds the workspace's crates"; exit 0; }
    newer=$(find "$@" -path '*/.fingerprint/*' -newer "$manifest" -print -quit 2>/dev/null || true)
    if [ -n "$newer" ]; then
      echo "mtimes: $newer was built after the manifest was saved: not restoring"
      rm -f "$manifest"
      exit 0
    fi
    n=0
    while IFS=$'\t' read -r m p; do
      touch -m -d "@$m" -- "$p"
      n=$((n + 1))
    done < <(awk -F'\t' 'NR == FNR {m[$3 "\t" $1] = $2; next} ($1 "\t" $2) in m {print m[$1 "\t" $2] "\t" $1}' \
      "$manifest" <(current))
    rm -f "$manifest"
    echo "mtimes: $n of $(git ls-files | wc -l) tracked files are unchanged since the cached build: their mtimes restored"
    ;;
  save)
    manifest=$2
    tmp=$(mktemp "$manifest.XXXXXX")
    # "<blob hash>\t<mtime, whole seconds: never later than the real one>\t<path>"
    paste <(current) <(git ls-files -z | xargs -0 stat -c %Y --) |
      awk -F'\t' '{print $2 "\t" $3 "\t" $1}' >"$tmp"
    mv "$tmp" "$manifest"
    ;;
  *)
    echo "usage: $0 restore MANIFEST TARGET_DIR... | save MANIFEST" >&2
    exit 2
    ;;
esac

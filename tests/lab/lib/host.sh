# Host-side helpers of the nested lab: Debian packages into a version-keyed
# cache, and the cpio images built from them. Sourced by tests/lab/run.sh.
# shellcheck shell=bash

CACHE=${K7D_LAB_CACHE:-/var/cache/k7d-lab}
APT_TIMEOUT=${K7D_LAB_APT_TIMEOUT:-600}

log() { printf 'lab: %s\n' "$*" >&2; }
die() { printf 'lab: error: %s\n' "$*" >&2; exit 2; }

# pkg_version NAME: the version apt would install now (the candidate); with no
# usable apt lists, the newest version already in the cache (offline runs).
pkg_version() {
  local v
  v=$(timeout 60 apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  if [[ -z $v || $v == "(none)" ]]; then
    v=$(find "$CACHE/debs" -maxdepth 1 -name "${1}_*.deb" -printf '%f\n' 2>/dev/null |
        sed "s/^${1}_//; s/\.deb\$//" | sort -V | tail -n1)
    [[ -n $v ]] || die "no candidate for package $1 (run apt-get update, or tests/lab/setup.sh)"
    log "apt knows no candidate for $1: using cached $v"
  fi
  printf '%s\n' "$v"
}

# kernel_pkg META: the versioned image package a kernel metapackage depends on
# (linux-image-amd64 -> linux-image-6.1.0-57-amd64), printed as "name version".
kernel_pkg() {
  local meta=$1 ver dep
  ver=$(pkg_version "$meta")
  dep=$(timeout 60 apt-cache show "$meta=$ver" 2>/dev/null | sed -n 's/^Depends: //p' | head -n1 |
        tr ',' '\n' | sed -n 's/^ *\(linux-image-[^ ]*\) *(= *\([^)]*\)).*/\1 \2/p' | head -n1)
  if [[ -z $dep ]]; then  # offline: the newest cached image of that flavour
    local flavour=${meta#linux-image-}
    dep=$(find "$CACHE/debs" -maxdepth 1 -name "linux-image-*-${flavour}_*.deb" -printf '%f\n' 2>/dev/null |
          sort -V | tail -n1 | sed 's/\.deb$//; s/_/ /')
    [[ -n $dep ]] || die "cannot resolve $meta to a kernel image package"
  fi
  printf '%s\n' "$dep"
}

# fetch NAME [VERSION]: $CACHE/debs/NAME_VERSION.deb, downloaded once; prints its path.
fetch() {
  local name=$1 ver=${2:-} deb tmp
  [[ -n $ver ]] || ver=$(pkg_version "$name")
  deb="$CACHE/debs/${name}_${ver}.deb"
  if [[ ! -s $deb ]]; then
    log "downloading $name $ver"
    mkdir -p "$CACHE/debs" "$CACHE/tmp"
    tmp=$(mktemp -d "$CACHE/tmp/dl.XXXXXX")
    # apt drops privileges to _apt for downloads when it can write there.
    if [[ $EUID -eq 0 ]] && id _apt >/dev/null 2>&1; then chown _apt "$tmp"; fi
    (cd "$tmp" && timeout "$APT_TIMEOUT" apt-get download -q "$name=$ver" >&2) ||
      die "apt-get download $name=$ver failed"
    mv "$tmp"/*.deb "$deb.part" && mv "$deb.part" "$deb"
    rm -rf "$tmp"
  fi
  printf '%s\n' "$deb"
}

# unpack NAME [VERSION]: the .deb's files under $CACHE/pkgs/NAME_VERSION/ (dpkg-deb -x,
# never installed); prints that folder.
unpack() {
  local name=$1 ver=${2:-} deb dir
  [[ -n $ver ]] || ver=$(pkg_version "$name")
  dir="$CACHE/pkgs/${name}_${ver}"
  if [[ ! -e $dir/.done ]]; then
    deb=$(fetch "$name" "$ver")
    rm -rf "$dir" && mkdir -p "$dir"
    timeout 300 dpkg-deb -x "$deb" "$dir" || die "dpkg-deb -x $deb failed"
    touch "$dir/.done"
  fi
  printf '%s\n' "$dir"
}

# kernel_tree META: unpack the kernel image behind META, run depmod on its module
# tree once, and print "tree kernel-release" (the tree has boot/vmlinuz-<release>).
kernel_tree() {
  local name ver dir krel kp
  kp=$(kernel_pkg "$1")
  read -r name ver <<<"$kp"
  dir=$(unpack "$name" "$ver")
  krel=$(find "$dir/boot" -name 'vmlinuz-*' -printf '%f\n' | sed 's/^vmlinuz-//' | head -n1)
  [[ -n $krel ]] || die "$name $ver has no boot/vmlinuz-*"
  if [[ ! -e $dir/.depmod ]]; then
    # depmod -b wants <base>/lib/modules/<release>; Debian ships usr/lib or lib.
    local base=$dir
    [[ -d $dir/lib/modules/$krel ]] || base=$dir/usr
    timeout 300 depmod -b "$base" "$krel" || die "depmod on $name failed"
    touch "$dir/.depmod"
  fi
  printf '%s %s\n' "$dir" "$krel"
}

# modules_in_order TREE KREL MOD...: the .ko paths to insmod, dependencies first
# (busybox insmod resolves nothing); built-in modules are skipped.
modules_in_order() {
  local tree=$1 krel=$2; shift 2
  local mdir=$tree/lib/modules/$krel
  [[ -d $mdir ]] || mdir=$tree/usr/lib/modules/$krel
  local -A seen=()
  local out=()
  _dep_visit() {  # $1: path relative to $mdir
    local rel=$1 line d
    [[ -n ${seen[$rel]:-} ]] && return 0
    seen[$rel]=1
    line=$(grep -m1 "^${rel}:" "$mdir/modules.dep") || die "$rel not in modules.dep"
    for d in ${line#*:}; do _dep_visit "$d"; done
    out+=("$mdir/$rel")
  }
  local m re rel
  for m in "$@"; do
    re=${m//[-_]/[-_]}
    rel=$(grep -m1 -E "(^|/)${re}\.ko(\.xz|\.zst|\.gz)?:" "$mdir/modules.dep" | cut -d: -f1) || true
    if [[ -z $rel ]]; then
      grep -qE "/${re}\.ko\$" "$mdir/modules.builtin" 2>/dev/null && continue
      die "module $m not found for kernel $krel"
    fi
    _dep_visit "$rel"
  done
  printf '%s\n' "${out[@]}"
}

# copy_module SRC DEST_DIR: a .ko (decompressed if shipped .ko.xz/.ko.zst/.ko.gz);
# prints the module file name written.
copy_module() {
  local src=$1 dest=$2 base
  base=$(basename "$src"); base=${base%.xz}; base=${base%.zst}; base=${base%.gz}
  case $src in
    *.xz) xz -dc "$src" >"$dest/$base" ;;
    *.zst) zstd -qdc "$src" >"$dest/$base" ;;
    *.gz) gzip -dc "$src" >"$dest/$base" ;;
    *) cp "$src" "$dest/$base" ;;
  esac
  printf '%s\n' "$base"
}

# stage_modules TREE KREL DEST MOD...: copy the modules and their dependencies into
# DEST/lab/modules and list them, in load order, in DEST/lab/modules.order.
stage_modules() {
  local tree=$1 krel=$2 dest=$3; shift 3
  mkdir -p "$dest/lab/modules"
  : >"$dest/lab/modules.order"
  [[ $# -gt 0 ]] || return 0
  local kos ko
  kos=$(modules_in_order "$tree" "$krel" "$@")
  for ko in $kos; do
    copy_module "$ko" "$dest/lab/modules" >>"$dest/lab/modules.order"
  done
}

# stage_elf FILE DEST [AS]: copy an executable and the shared libraries ldd finds
# into the staging root DEST. Libraries land under usr/lib* (the images have the
# merged-/usr symlinks lib -> usr/lib, lib64 -> usr/lib64, as Debian does).
stage_elf() {
  local file=$1 dest=$2 as=${3:-$1} lib
  mkdir -p "$dest/$(dirname "$as")"
  cp -L "$file" "$dest/$as"
  while read -r lib; do
    [[ -e $lib ]] || continue
    case $lib in /lib/* | /lib64/*) rel=usr$lib ;; *) rel=${lib#/} ;; esac
    mkdir -p "$dest/$(dirname "$rel")"
    [[ -e $dest/$rel ]] || cp -L "$lib" "$dest/$rel"
  done < <(ldd "$file" 2>/dev/null | sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) .*/\1/p')
}

# mkcpio DIR OUT: an uncompressed newc archive of DIR, owned by root. Images are
# left uncompressed: unpacking is cheap, decompressing under TCG is not.
mkcpio() {
  (cd "$1" && find . -mindepth 1 | LC_ALL=C sort | timeout 300 cpio -o -H newc -R 0:0 --quiet) >"$2.part" &&
    mv "$2.part" "$2"
}

# key TEXT... : a short content key (sha256) of strings and of the files named
# after "--".
key() {
  local files=() words=() a seen_sep=
  for a in "$@"; do
    if [[ $a == -- ]]; then seen_sep=1; continue; fi
    if [[ -n $seen_sep ]]; then files+=("$a"); else words+=("$a"); fi
  done
  { printf '%s\n' "${words[@]}"; [[ ${#files[@]} -eq 0 ]] || cat "${files[@]}"; } | sha256sum | cut -c1-16
}

# cached_image NAME KEY BUILDER ARGS...: $CACHE/images/NAME-KEY.cpio, built by
# "BUILDER STAGING_DIR ARGS..." only when missing. Scenarios with different
# module lists use different keys side by side; images unused for 14 days go.
cached_image() {
  local name=$1 k=$2 builder=$3; shift 3
  local img="$CACHE/images/$name-$k.cpio" stage
  if [[ ! -s $img ]]; then
    log "building image $name ($k)"
    mkdir -p "$CACHE/images" "$CACHE/tmp"
    stage=$(mktemp -d "$CACHE/tmp/$name.XXXXXX")
    "$builder" "$stage" "$@"
    mkcpio "$stage" "$img"
    rm -rf "$stage"
    find "$CACHE/images" -maxdepth 1 -name '*.cpio' -mtime +14 -delete
  fi
  touch "$img"
  printf '%s\n' "$img"
}

# host_tool NAME: the path of a host executable (PATH, then the sbin folders a
# non-root PATH may lack).
host_tool() {
  local p d
  if p=$(command -v "$1" 2>/dev/null) && [[ $p == /* ]]; then printf '%s\n' "$p"; return 0; fi
  for d in /usr/local/sbin /usr/sbin /sbin; do
    [[ -x $d/$1 ]] && { printf '%s\n' "$d/$1"; return 0; }
  done
  return 1
}

# prepared NAME: run scenarios/NAME.prepare.sh OUTDIR on the host once per input
# and print OUTDIR ($CACHE/prepared/NAME-KEY/files). The key hashes the script, this
# file and the installed versions of the Debian packages its
# "# lab: packages=..." header names (its tools, e.g. erofs-utils); those must
# be installed (tests/lab/setup.sh). The script gets the lab's busybox-static
# as $LAB_BUSYBOX (run.sh's $BB; its path, which names the version, is in the
# key). Unused outputs go after 14 days.
prepared() {
  local name=$1 script pkgs versions k dir tmp p
  script=$LAB/scenarios/$name.prepare.sh
  [[ -f $script ]] || die "no $script"
  pkgs=$(sed -n 's/^# lab: *packages=//p' "$script" | head -n1)
  versions=
  if [[ -n $pkgs ]]; then
    # shellcheck disable=SC2086
    versions=$(dpkg-query -W -f '${Package}=${Version} ${db:Status-Status}\n' $pkgs 2>/dev/null) || true
    for p in $pkgs; do
      grep -q "^$p=.* installed\$" <<<"$versions" || die "$name.prepare.sh needs the Debian package $p: run tests/lab/setup.sh"
    done
  fi
  # A script that takes the agent under test (LAB_AGENT: an image with it
  # installed) is keyed by it too.
  local agent=()
  if grep -q LAB_AGENT "$script"; then
    [[ -n ${AGENT:-} ]] || die "$name.prepare.sh needs the agent under test: run.sh --agent PATH"
    agent=("$AGENT")
  fi
  k=$(key "$name" "$versions" "${BB:-}" -- "$script" "$LAB/lib/host.sh" "${agent[@]}")
  dir=$CACHE/prepared/$name-$k
  if [[ ! -e $dir/.done ]]; then
    log "preparing $name ($k)"
    mkdir -p "$CACHE/prepared" "$CACHE/tmp"
    tmp=$(mktemp -d "$CACHE/tmp/prep-$name.XXXXXX")
    mkdir "$tmp/files"
    LAB_BUSYBOX=${BB:-} LAB_AGENT=${AGENT:-} timeout 300 bash "$script" "$tmp/files" >&2 || die "$script failed"
    rm -rf "$dir" && mv "$tmp" "$dir" && touch "$dir/.done"
    find "$CACHE/prepared" -mindepth 1 -maxdepth 1 -type d -mtime +14 -exec rm -rf {} +
  fi
  touch "$dir"
  printf '%s\n' "$dir/files"
}

# PY_PKGS: Debian's Python 3.11, interpreter and standard library.
PY_PKGS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib"

# python_tree: Debian's Python 3.11 unpacked into one tree (never installed:
# its packages' files merged under $CACHE/python/KEY/usr), its modules
# compiled once; prints the tree.
python_tree() {
  local p v versions='' dir tmp
  for p in $PY_PKGS; do v=$(pkg_version "$p"); versions="$versions ${p}_$v"; done
  dir="$CACHE/python/$(key "$versions")"
  if [[ ! -e $dir/.done ]]; then
    rm -rf "$dir" && mkdir -p "$CACHE/python"
    tmp=$(mktemp -d "$CACHE/python/tmp.XXXXXX")
    for p in $versions; do
      cp -a "$(unpack "${p%%_*}" "${p#*_}")/usr" "$tmp/" || die "cannot merge ${p%%_*} into $tmp"
    done
    mv "$tmp" "$dir" && touch "$dir/.done"
  fi
  printf '%s\n' "$dir"
}

# stage_python RUN SRC MODULE...: Debian's Python in RUN as /usr/bin/python3,
# with only the files that importing MODULE... loads (SRC on its path, for
# the k7d client: vmm/python/src), each with its compiled .pyc so L1 does not
# compile them under TCG. The scenario runs `PYTHONPATH=/lab/python python3`.
stage_python() {
  local run=$1 src=$2 tree lib f rel; shift 2
  tree=$(python_tree)
  lib=$tree/usr/lib/python3.11
  stage_elf "$tree/usr/bin/python3.11" "$run" /usr/bin/python3
  # Its libraries: the extension modules' too.
  mkdir -p "$run/lab/python"
  # The files the imports load (the interpreter run here, on the same tree
  # as in L1), .pyc written beside each source in the tree or in a copy
  # of SRC (the checkout stays untouched).
  cp -r "$src/." "$run/lab/python/"
  env -u PYTHONDONTWRITEBYTECODE PYTHONHOME="$tree/usr" PYTHONPATH="$run/lab/python" timeout 60 "$tree/usr/bin/python3.11" -c '
import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
for m in list(sys.modules.values()):
    for a in ("__file__", "__cached__"):
        f = getattr(m, a, None)
        if f:
            print(f)
' "$@" >"$run/lab/python.files" || die "Debian's Python in $tree cannot import $*"
  while read -r f; do
    [[ -f $f ]] || continue
    case $f in
      "$lib"/*) rel=usr/lib/python3.11/${f#"$lib"/} ;;
      "$run"/*) continue ;;  # the copy of SRC: in place already
      *) die "stage_python: $f is outside Debian's Python tree" ;;
    esac
    mkdir -p "$run/$(dirname "$rel")"
    cp -p "$f" "$run/$rel"
    [[ $f != *.so ]] || stage_elf "$f" "$run" "$rel"
  done <"$run/lab/python.files"
  # The landmarks the interpreter finds its prefix and exec prefix by (os
  # may be frozen into it, and no extension module may have been loaded).
  cp -p "$lib/os.py" "$run/usr/lib/python3.11/os.py"
  mkdir -p "$run/usr/lib/python3.11/lib-dynload"
  log "Debian's Python in L1: $(wc -l <"$run/lab/python.files") files for $*"
  rm -f "$run/lab/python.files"
}

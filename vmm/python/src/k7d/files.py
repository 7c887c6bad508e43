"""Files and directories between this host and a VM, as `k7d cp` copies
them (`vmm/src/cpcli.rs`, `docs/exec.md`): a tar stream made on one side
and unpacked on the other, carried by the API's `exec` with `sh` and
`tar` in the guest. Modes, symbolic links and (as root) owners are kept;
setuid and setgid bits coming from a guest are not.

What comes back from a guest is hostile input. :func:`unpack` writes it
into a fresh directory beside the destination, entry by entry, refusing
any entry outside the copy's own name, any that is not a file, directory
or symbolic link, any path through a symbolic link, and more than the
caller's byte and entry limits; only a whole copy is renamed into place,
so a failed one leaves nothing.

`exec` carries at most 512 KiB of stdin and 4 MiB of output per command,
so a larger copy goes in slices through a file in the guest's /tmp
(removed after, whatever happened).
"""

from __future__ import annotations

import io
import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
from typing import Any, Callable, List, Tuple

#: The most stdin one `exec` carries (the daemon's `MAX_EXEC_STDIN`).
STDIN_SLICE = 512 << 10
#: The most output of one `exec` the daemon keeps (`MAX_EXEC_OUTPUT`).
OUTPUT_SLICE = 4 << 20
#: The most entries a copy from a VM may hold.
MAX_ENTRIES = 1 << 20

#: The guest's side of a copy into it: the archive `$3` (a file in the
#: guest) or stdin; its one top entry `$2` goes into `$1` when that is a
#: directory, else becomes `$1`.
GUEST_UNPACK = r"""set -e
dst=$1 name=$2 from=${3:--}
if [ -d "$dst" ]; then exec tar -x -f "$from" -C "$dst"; fi
parent=$(dirname "$dst")
t=$(mktemp -d "$parent/.k7d-cp.XXXXXX")
trap 'rm -rf "$t"' EXIT
tar -x -f "$from" -C "$t"
mv "$t/$name" "$dst"
"""

#: The guest's side of a copy out of it: `$1` as a tar stream on stdout,
#: or with `$2` into that file, whose size is then printed.
GUEST_PACK = r"""set -e
cd "$(dirname "$1")"
if [ -z "$2" ]; then exec tar -c -f - "$(basename "$1")"; fi
tar -c -f "$2" "$(basename "$1")"
wc -c <"$2"
"""

#: A run of `exec` as the client makes it: (command, stdin) to
#: (status, stdout, stderr, truncated).
Exec = Callable[[List[str], bytes], Tuple[int, bytes, bytes, bool]]


class CopyRefused(Exception):
    """A copy from a VM held something it may not write."""


def base_name(path: str) -> str:
    """The last component of `path`, which must name something."""
    name = posixpath.basename(path.rstrip("/"))
    if name in ("", ".", ".."):
        raise ValueError(f"{path}: names no file or directory to copy")
    return name


def pack(src: str, name: str) -> bytes:
    """`src` (a file, directory or symbolic link on this host) as a tar
    stream whose top entry is `name`; symbolic links are not followed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, dereference=False) as t:
        t.add(src, arcname=name, recursive=True)
    return buf.getvalue()


def _inside(member: str, name: str) -> bool:
    parts = member.split("/")
    while parts and parts[-1] == "":
        parts.pop()  # "dir/" is a directory's own name
    return bool(parts) and parts[0] == name and all(p not in ("", ".", "..") for p in parts)


def unpack(data: bytes, dest_dir: str, name: str, *, max_entries: int = MAX_ENTRIES) -> None:
    """Unpacks the tar stream `data` into the empty directory `dest_dir`:
    every entry must be `name` or under it (relative, no `..`), a file,
    directory or symbolic link, reached through no symbolic link. The first
    refusal raises :class:`CopyRefused`."""
    as_root = os.geteuid() == 0
    dirs: List[Tuple[str, int]] = []
    n = 0
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as e:
        raise CopyRefused(f"the copy is not a tar stream: {e}") from e
    with archive:
        while True:
            try:
                m = archive.next()
            except tarfile.TarError as e:
                raise CopyRefused(f"the copy's tar stream is broken: {e}") from e
            if m is None:
                break
            n += 1
            if n > max_entries:
                raise CopyRefused(f"the copy has more than {max_entries} entries")
            if not _inside(m.name, name):
                raise CopyRefused(f"the entry {m.name!r} is outside the copy of {name}")
            if not (m.isfile() or m.isdir() or m.issym()):
                raise CopyRefused(f"the entry {m.name!r} is not a file, directory or symbolic link")
            rel = m.name.rstrip("/")
            target = os.path.join(dest_dir, *rel.split("/"))
            at = dest_dir
            for part in rel.split("/")[:-1]:
                at = os.path.join(at, part)
                if os.path.islink(at):
                    raise CopyRefused(f"the entry {m.name!r} goes through the symbolic link {at}")
            mode = m.mode & 0o1777
            if m.isdir():
                if not os.path.isdir(target) or os.path.islink(target):
                    os.mkdir(target, 0o700)
                dirs.append((target, mode))
            elif m.issym():
                os.symlink(m.linkname, target)
            else:
                src = archive.extractfile(m)
                if src is None:
                    raise CopyRefused(f"the entry {m.name!r} has no data")
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    try:
                        shutil.copyfileobj(src, f)
                    except (tarfile.TarError, EOFError) as e:
                        raise CopyRefused(f"the copy's tar stream is broken in {m.name!r}: {e}") from e
                    os.fchmod(f.fileno(), mode)
            if as_root:
                os.lchown(target, m.uid, m.gid)
    if n == 0:
        raise CopyRefused("the copy is empty")
    if not os.path.lexists(os.path.join(dest_dir, name)):
        raise CopyRefused(f"the copy holds no {name}")
    # Directories' own modes last: a read-only one must not stop the
    # entries under it.
    for path, mode in reversed(dirs):
        os.chmod(path, mode)


def copy_to(run: Exec, src: str, dest: str) -> None:
    """Copies `src` on this host to `dest` in the VM (an existing
    directory receives it under its own name)."""
    name = base_name(src)
    os.lstat(src)  # a missing source is this host's error, said as such
    data = pack(src, name)
    if len(data) <= STDIN_SLICE:
        _checked(run(["sh", "-c", GUEST_UNPACK, "sh", dest, name], data), f"unpacking into {dest}")
        return
    tmp = _checked(run(["mktemp", "/tmp/.k7d-cp.XXXXXX"], b""), "making a file in the guest's /tmp").decode().strip()
    try:
        for at in range(0, len(data), STDIN_SLICE):
            _checked(run(["sh", "-c", 'cat >>"$1"', "sh", tmp], data[at : at + STDIN_SLICE]), f"writing {tmp}")
        _checked(run(["sh", "-c", GUEST_UNPACK, "sh", dest, name, tmp], b""), f"unpacking into {dest}")
    finally:
        _forget(run, tmp)


def copy_from(run: Exec, src: str, dest: str, *, max_size: int) -> None:
    """Copies `src` in the VM to `dest` on this host (an existing directory
    receives it under its own name); at most `max_size` bytes of tar."""
    name = base_name(src)
    final = os.path.join(dest, name) if os.path.isdir(dest) else dest
    if os.path.lexists(final):
        raise FileExistsError(f"{final} exists: k7d copies into a new name only")
    status, out, err, truncated = run(["sh", "-c", GUEST_PACK, "sh", src, ""], b"")
    if status != 0:
        raise CopyRefused(f"packing {src} in the VM failed (status {status}): {_said(err)}")
    if truncated:
        out = _staged(run, src, max_size)
    if len(out) > max_size:
        raise CopyRefused(f"the copy is larger than {max_size} bytes (max_size)")
    parent = os.path.dirname(os.path.abspath(final))
    work = tempfile.mkdtemp(prefix=".k7d-cp.", dir=parent)
    try:
        unpack(out, work, name)
        os.rename(os.path.join(work, name), final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _staged(run: Exec, src: str, max_size: int) -> bytes:
    """`src` packed into a file in the guest's /tmp and read in slices."""
    tmp = _checked(run(["mktemp", "/tmp/.k7d-cp.XXXXXX"], b""), "making a file in the guest's /tmp").decode().strip()
    try:
        said = _checked(run(["sh", "-c", GUEST_PACK, "sh", src, tmp], b""), f"packing {src}").split()
        size = int(said[-1]) if said and said[-1].isdigit() else -1
        if size < 0:
            raise CopyRefused(f"the guest did not say how large its copy of {src} is")
        if size > max_size:
            raise CopyRefused(f"the copy is larger than {max_size} bytes (max_size)")
        blocks = OUTPUT_SLICE // 65536
        parts: List[bytes] = []
        for i in range(0, size, OUTPUT_SLICE):
            parts.append(
                _checked(
                    run(["dd", f"if={tmp}", "bs=65536", f"skip={i // 65536}", f"count={blocks}"], b""),
                    f"reading {tmp}",
                )
            )
        data = b"".join(parts)
        if len(data) != size:
            raise CopyRefused(f"the guest's copy of {src} was {size} bytes, {len(data)} came")
        return data
    finally:
        _forget(run, tmp)


def _checked(result: Tuple[int, bytes, bytes, bool], what: str) -> bytes:
    status, out, err, truncated = result
    if status != 0:
        raise CopyRefused(f"{what} in the VM failed (status {status}): {_said(err)}")
    if truncated:
        raise CopyRefused(f"{what} in the VM wrote more than one exec carries")
    return out


def _forget(run: Exec, tmp: str) -> None:
    try:
        run(["rm", "-f", tmp], b"")
    except Exception:  # noqa: BLE001 - the copy's own error is the one to raise
        pass


def _said(err: bytes) -> str:
    return err[-2000:].decode(errors="replace").strip() or "(nothing on stderr)"


__all__: List[Any] = ["CopyRefused", "copy_from", "copy_to", "pack", "unpack"]

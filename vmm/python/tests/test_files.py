"""The Python client's file copies (k7d.files) without a VM: the guest's
side runs here, in a scratch directory, through the same `sh` scripts
and `tar` a guest runs; so the copies' round trips (small, and sliced
through the guest's /tmp), and what the host refuses of a hostile tar
stream, are checked here; the lab's k7d-exec runs them in Linux guests."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import List, Tuple

import pytest

from k7d import files
from k7d.files import CopyRefused


def local(command: List[str], stdin: bytes) -> Tuple[int, bytes, bytes, bool]:
    """`exec` with this host as the guest: the daemon's output limit kept."""
    p = subprocess.run(command, input=stdin, capture_output=True, check=False)
    keep = files.OUTPUT_SLICE
    return p.returncode, p.stdout[:keep], p.stderr[:keep], len(p.stdout) > keep or len(p.stderr) > keep


def tree(root: Path) -> dict:
    """Each entry under root: its kind, mode and content's (or target's) sum."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                what = "link:" + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                what = "dir"
            else:
                what = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), what)
    return out


def staged() -> set:
    """The slices' files in the guest's /tmp."""
    return {p for p in os.listdir("/tmp") if p.startswith(".k7d-cp.")}


def make_tree(at: Path, big: int) -> Path:
    src = at / "data"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello\n")
    (src / "sub" / "big.bin").write_bytes(os.urandom(big))
    os.chmod(src / "a.txt", 0o640)
    os.chmod(src / "sub", 0o750)
    (src / "link").symlink_to("sub/big.bin")
    return src


@pytest.mark.parametrize("big", [1000, 3 * files.STDIN_SLICE + 17])
def test_a_tree_goes_into_a_guest_and_back_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, big: int) -> None:
    # Small output slices: the way back is sliced through the guest's /tmp.
    monkeypatch.setattr(files, "OUTPUT_SLICE", 256 << 10)
    src = make_tree(tmp_path, big)
    staged_before = staged()
    guest = tmp_path / "guest"
    guest.mkdir()
    files.copy_to(local, str(src), str(guest))
    assert tree(guest / "data") == tree(src)
    files.copy_to(local, str(src / "a.txt"), str(guest / "renamed.txt"))
    assert (guest / "renamed.txt").read_bytes() == b"hello\n"
    back = tmp_path / "back"
    back.mkdir()
    files.copy_from(local, str(guest / "data"), str(back), max_size=1 << 30)
    assert tree(back / "data") == tree(src)
    # Nothing left in the guest's /tmp or beside the destinations.
    assert staged() == staged_before
    assert sorted(os.listdir(back)) == ["data"]
    with pytest.raises(FileExistsError):
        files.copy_from(local, str(guest / "data"), str(back), max_size=1 << 30)
    with pytest.raises(CopyRefused, match="larger than 1000 bytes"):
        files.copy_from(local, str(guest / "data"), str(back / "other"), max_size=1000)
    assert sorted(os.listdir(back)) == ["data"], "a refused copy leaves nothing"


def hostile(entries: List[Tuple[str, bytes, str]]) -> bytes:
    """A tar stream as a hostile guest could write it: (name, type, link or data)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, kind, extra in entries:
            m = tarfile.TarInfo(name)
            m.type = kind
            data = b""
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                m.linkname = extra
            elif kind == tarfile.REGTYPE:
                data = extra.encode()
                m.size = len(data)
            m.mode = 0o6755
            t.addfile(m, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(
    "entries, says",
    [
        ([("x/../../escape", tarfile.REGTYPE, "x")], "outside the copy"),
        ([("/etc/evil", tarfile.REGTYPE, "x")], "outside the copy"),
        ([("other", tarfile.REGTYPE, "x")], "outside the copy"),
        ([("x", tarfile.DIRTYPE, ""), ("x/dev", tarfile.CHRTYPE, "")], "not a file, directory or symbolic link"),
        ([("x", tarfile.DIRTYPE, ""), ("x/hard", tarfile.LNKTYPE, "/etc/passwd")], "not a file, directory"),
        (
            [("x", tarfile.DIRTYPE, ""), ("x/up", tarfile.SYMTYPE, "/tmp"), ("x/up/planted", tarfile.REGTYPE, "x")],
            "through the symbolic link",
        ),
        ([], "empty"),
    ],
)
def test_what_a_hostile_guest_sends_is_refused_and_writes_nothing_outside(
    tmp_path: Path, entries: list, says: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(CopyRefused, match=says):
        files.unpack(hostile(entries), str(work), "x")
    assert not (tmp_path / "escape").exists() and not Path("/tmp/planted").exists()


def test_too_many_entries_or_no_tar_at_all_are_refused(tmp_path: Path) -> None:
    many = hostile([("x", tarfile.DIRTYPE, "")] + [(f"x/{i}", tarfile.REGTYPE, "") for i in range(3)])
    with pytest.raises(CopyRefused, match="more than 2 entries"):
        files.unpack(many, str(tmp_path), "x", max_entries=2)
    with pytest.raises(CopyRefused, match="not a tar stream|broken|empty"):
        files.unpack(b"\x00garbage" * 100, str(tmp_path), "y")
    # Cut in a file's data (a guest that stopped, an output cut at a limit).
    whole = hostile([("z", tarfile.REGTYPE, "x" * 5000)])
    with pytest.raises(CopyRefused, match="broken"):
        files.unpack(whole[:2048], str(tmp_path), "z")


def test_setuid_bits_from_a_guest_are_dropped(tmp_path: Path) -> None:
    files.unpack(hostile([("x", tarfile.REGTYPE, "data")]), str(tmp_path), "x")
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o755

"""The Python client against a real daemon (issue 37): every operation of
the API (exec's refusals here; a command run in a Linux guest is the
lab's), errors as
exceptions carrying the daemon's sentence, and context managers that
delete what they made. Guests are k7d's built-in test guests: `memwriter`
counts rounds at a fixed guest address and, with ARG2 = 1, writes its
count into each of its pages, so a child's RAM can be read against its
source's (`peek`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import k7d
from k7d import Client, builtin

# k7d_guest::RESULTS_ADDR + result::LOOP_COUNTER (guest/src/defs.rs) and the
# area memwriter writes.
COUNTER = 0x600 + 0x10
AREA = 0x20_0000
PAGES = 32


def memwriter(id: str, write: int = 1) -> dict:
    return builtin("memwriter", id=id, memory_mib=16, args=[PAGES, AREA, write])


def count(k: Client, id: str) -> int:
    return k.peek(id, COUNTER)[0]


def grows(k: Client, id: str) -> bool:
    c = count(k, id)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if count(k, id) > c:
            return True
        time.sleep(0.005)
    return False


def test_a_vm_runs_pauses_resumes_and_goes_with_its_block(daemon: Client) -> None:
    k = daemon
    v = k.version()
    assert v["api_version"] == k7d.client.API_VERSION and v["pid"] > 0
    with k.vm(memwriter("w")) as vm:
        assert vm["id"] == "w" and vm["status"] == "running"
        assert [s["id"] for s in k.list()] == ["w"]
        assert grows(k, "w")
        assert k.pause("w")["status"] == "paused"
        c = count(k, "w")
        time.sleep(0.05)
        assert count(k, "w") == c, "a paused VM ran"
        assert k.resume("w")["status"] == "running"
        assert grows(k, "w")
        info = k.info("w")
        assert info["config"]["guest"]["name"] == "memwriter"
        # k7d's default: the VM runs in a jailed VM process of its own.
        assert info["vm_process"]["pid"] > 0 and info["vm_process"]["uid"] >= 2000001200, info
    assert k.list() == [], "the block's VM outlived it"


def test_errors_carry_the_daemons_sentence_and_change_nothing(daemon: Client) -> None:
    k = daemon
    with pytest.raises(k7d.NotFound) as e:
        k.info("nope")
    assert e.value.code == "not_found" and str(e.value) == "vm nope does not exist"
    with k.vm(memwriter("dup")):
        with pytest.raises(k7d.Conflict) as e:
            k.create(memwriter("dup"))
        assert "dup" in str(e.value)
        with pytest.raises(k7d.Conflict):
            k.start("dup")
        with pytest.raises(k7d.InvalidArgument) as e:
            k.fork("dup", count=0)
        assert "count" in str(e.value)
        assert [s["id"] for s in k.list()] == ["dup"]
    with pytest.raises(k7d.InvalidArgument):
        k.create(builtin("no-such-guest", id="bad"))
    assert k.list() == []
    # Any exception of the block still deletes what it made.
    with pytest.raises(RuntimeError):
        with k.vm(memwriter("boom")):
            raise RuntimeError("the caller's own failure")
    assert k.list() == []


def test_exec_refuses_what_cannot_run_with_the_daemons_sentence(daemon: Client) -> None:
    """`exec` needs a running VM with a vsock device and k7d-agent in its
    guest (the lab proves a real one on a Debian guest; a built-in guest
    has no virtio devices); every refusal here is the daemon's own
    sentence, and the VM runs on unchanged."""
    k = daemon
    with pytest.raises(k7d.NotFound) as e:
        k.exec("nope", ["true"])
    assert str(e.value) == "vm nope does not exist"
    with k.vm(memwriter("plain")):
        with pytest.raises(k7d.InvalidArgument) as e:
            k.exec("plain", ["true"])
        assert "has no vsock device" in str(e.value)
        # The daemon's own checks, before any guest sees the request.
        for kwargs, want in [
            ({"command": []}, "needs a command"),
            ({"command": ["true"], "timeout": 0}, "out of range"),
            ({"command": ["true"], "timeout": 90000}, "out of range"),
            ({"command": ["true"], "cwd": "tmp"}, "not an absolute guest path"),
            ({"command": ["true"], "env": {"": "x"}}, "not KEY=VALUE"),
            ({"command": ["true"], "stdin": b"x" * (512 * 1024 + 1)}, "more than 524288 bytes"),
        ]:
            with pytest.raises(k7d.InvalidArgument) as e:
                k.exec("plain", **kwargs)
            assert want in str(e.value), (kwargs.keys(), str(e.value))
        # The client's own: one string is not a command.
        with pytest.raises(k7d.InvalidArgument) as e:
            k.exec("plain", "ls -l")
        assert "not one string" in str(e.value)
        assert grows(k, "plain")
        # A VM that is not running, before anything else is asked of it.
        k.pause("plain")
        with pytest.raises(k7d.Conflict) as e:
            k.exec("plain", ["true"])
        assert str(e.value) == "vm plain is paused: a command runs only in a running VM"
        k.resume("plain")
        assert grows(k, "plain")
        # Streamed: refused alike, before any output.
        seen: list = []
        with pytest.raises(k7d.InvalidArgument) as e:
            k.exec("plain", ["true"], on_output=lambda s, b: seen.append((s, b)))
        assert "has no vsock device" in str(e.value) and seen == []


def test_a_thread_keeps_its_connection_and_a_closed_one_is_replaced(daemon: Client) -> None:
    """Calls reuse the calling thread's connection (no connect per call);
    another thread has its own; one the daemon closed (a restart, its idle
    timeout) is replaced before anything is sent on it."""
    import socket
    import threading

    k = Client(daemon.socket_path)
    k.version()
    first = k._local.conn
    for _ in range(5):
        k.list()
    assert k._local.conn is first, "a new connection per call"
    other: list = []
    t = threading.Thread(target=lambda: (k.version(), other.append(k._local.conn)))
    t.start()
    t.join()
    assert other and other[0] is not first
    # The daemon's side goes: the next call makes another, and answers.
    first.sock.shutdown(socket.SHUT_RDWR)
    assert k.version()["api_version"] == 1
    assert k._local.conn is not first
    k.close()
    assert k._local.conn is None
    with Client(daemon.socket_path) as c:
        c.version()
    assert c._local.conn is None, "the block's end closes it"


def test_no_daemon_is_one_exception(tmp_path: Path) -> None:
    with pytest.raises(k7d.Unreachable) as e:
        Client(tmp_path / "none.sock").list()
    assert "none.sock" in str(e.value)


def test_forks_equal_their_source_and_go_with_their_block(daemon: Client) -> None:
    k = daemon
    with k.vm(memwriter("src")):
        assert grows(k, "src")
        k.pause("src")
        at_fork = k.peek("src", AREA, 1024)
        assert len(set(at_fork)) > 1, "memwriter wrote nothing yet"
        with k.forked("src", count=3) as f:
            ids = [c["id"] for c in f["children"]]
            assert ids == ["src-f1", "src-f2", "src-f3"]
            assert all(c["fork_ms"] > 0 for c in f["children"])
            for c in ids:
                info = k.info(c)
                assert info["parent"] == "src"
                assert grows(k, c), f"{c} does not run"
            # Each child went on from the source's RAM at the fork.
            assert k.info("src")["children"] == ids
            ram = k.guest_ram("src-f1")
            assert ram["id"] == "src-f1" and 0 < ram["copied"] <= ram["resident"], ram
            with k.forked("src-f1", name="grandchild") as g:
                assert [c["id"] for c in g["children"]] == ["grandchild"]
                assert k.info("grandchild")["parent"] == "src-f1"
            assert "grandchild" not in [s["id"] for s in k.list()]
        assert [s["id"] for s in k.list()] == ["src"], "the children outlived their block"
        assert k.peek("src", AREA, 1024) == at_fork, "the paused source changed"
        k.resume("src")


def test_a_snapshot_restores_into_a_vm_equal_to_it(daemon: Client, tmp_path: Path) -> None:
    k = daemon
    snap = tmp_path / "snap"
    with k.vm(memwriter("s", write=0)):
        assert grows(k, "s")
        k.pause("s")
        at = k.peek("s", COUNTER)[0]
        k.snapshot("s", snap)
        with pytest.raises(k7d.Conflict):
            k.snapshot("s", snap)
        k.snapshot("s", snap, replace=True)
        assert k.info("s")["status"] == "paused"
        restored = k.restore(snap, id="r")
        try:
            assert restored["id"] == "r"
            assert count(k, "r") >= at
            assert grows(k, "r")
        finally:
            k.delete("r")


def test_clusters_fork_together_into_clusters_of_their_own(daemon: Client) -> None:
    k = daemon
    k.create(memwriter("a"), start=True)
    k.create(memwriter("b"), start=True)
    with k.cluster("cl", ["a"]) as c:
        assert [m["id"] for m in c["members"]] == ["a"]
        assert [m["id"] for m in k.cluster_add("cl", ["b"])["members"]] == ["a", "b"]
        with pytest.raises(k7d.Conflict):
            k.cluster_create("other", ["a"])
        with k.forked("cl", count=2) as f:
            assert f["clusters"] == ["cl-f1", "cl-f2"]
            assert len(f["children"]) == 4
            assert [m["id"] for m in k.cluster_info("cl-f1")["members"]] == ["a-f1", "b-f1"]
            assert sorted(c["id"] for c in k.cluster_list()) == ["cl", "cl-f1", "cl-f2"]
            for m in ["a-f1", "b-f2"]:
                assert grows(k, m)
        assert [c["id"] for c in k.cluster_list()] == ["cl"]
        assert sorted(s["id"] for s in k.list()) == ["a", "b"]
    # The cluster went, and its members with it.
    assert k.cluster_list() == [] and k.list() == []


def test_the_client_installs_from_its_path_with_pip(tmp_path: Path) -> None:
    """`pip install` from the repository's path (its own copy: the build
    writes beside the sources) into a new virtual environment (pip fetches
    the build backend, setuptools, from PyPI into its build environment)."""
    src = Path(__file__).resolve().parents[1]
    copy = tmp_path / "k7d-python"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", str(copy)],
        check=True,
    )
    out = subprocess.run(
        [str(py), "-c", "import k7d, pathlib; print(k7d.Client().socket_path); print(pathlib.Path(k7d.__file__).parent.joinpath('py.typed').exists())"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.split()
    assert out == [k7d.DEFAULT_SOCKET, "True"]

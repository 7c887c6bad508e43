"""A real `k7d daemon` for the client's tests: the binary named by
`K7D_BIN` (the release build, as CI builds it), its state and socket in a
directory of the test's own, stopped with SIGTERM at the end (it must exit
0 and leave no VM)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from k7d import Client

REPO = Path(__file__).resolve().parents[3]


def k7d_bin() -> Path:
    given = os.environ.get("K7D_BIN")
    if given:
        return Path(given)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "release" / "k7d"


@contextlib.contextmanager
def running_daemon(dir: Path, id_base: int = 2000001200) -> Iterator[Client]:
    """A daemon with its state and socket in `dir`; at the end it must be
    empty, exit 0 on SIGTERM. It runs k7d's default: each VM in a jailed
    VM process of its own, with uids from `id_base` (two daemons at once
    take ranges apart), without a cgroup (this host may have cgroup v1:
    the limits are the lab's to prove)."""
    binary = k7d_bin()
    if not binary.is_file():
        pytest.fail(f"no k7d binary at {binary} (build it, or set K7D_BIN)")
    if os.geteuid() != 0:
        pytest.fail("the k7d daemon needs root (KVM): run the client's tests as root")
    dir.mkdir(parents=True, exist_ok=True)
    sock = dir / "k7d.sock"
    log = open(dir / "daemon.log", "wb")
    proc = subprocess.Popen(
        [
            str(binary),
            "daemon",
            "--jail-cgroup",
            "off",
            "--jail-id-base",
            str(id_base),
            "--jail-id-count",
            "1000",
            "--state-dir",
            str(dir / "state"),
            "--socket",
            str(sock),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = Client(sock, timeout=60)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.version()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.close()
                pytest.fail(f"the daemon did not come up: {(dir / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
    try:
        yield client
        left = client.list()
        assert left == [], f"VMs left behind: {left}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
    assert rc == 0, f"the daemon exited {rc}: {(dir / 'daemon.log').read_text()[-2000:]}"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Client]:
    with running_daemon(tmp_path) as client:
        yield client

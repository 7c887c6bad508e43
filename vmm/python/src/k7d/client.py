"""The k7d daemon's API over its unix socket (`vmm/src/daemon/api.rs`): one JSON
request per line, one response line per request, a connection per thread
kept open between calls.

Every operation of the API has a method; results are the daemon's JSON
objects (typed as :class:`typing.TypedDict`s of their main fields), errors
are :class:`K7dError`s carrying the daemon's code and sentence. The
context managers (:meth:`Client.vm`, :meth:`Client.forked`,
:meth:`Client.cluster`) delete what they created when the block ends,
whatever ended it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import select
import socket
import threading
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, TypedDict, Union

from . import files

#: Where `k7d daemon` listens unless told otherwise (as the CLI's `--socket`).
DEFAULT_SOCKET = "/run/k7d/k7d.sock"

#: The API version this client speaks.
API_VERSION = 1

#: The longest response line read (a `list` of many VMs fits easily).
MAX_LINE = 16 << 20

PathLike = Union[str, "os.PathLike[str]"]


class K7dError(Exception):
    """The daemon refused or failed a request: its code and its sentence."""

    code: str = "error"

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class BadRequest(K7dError):
    """Not JSON, or not a request (a bug of the client)."""

    code = "bad_request"


class UnsupportedVersion(K7dError):
    """The daemon does not speak this client's API version."""

    code = "unsupported_version"


class InvalidArgument(K7dError):
    """A field value was refused."""

    code = "invalid_argument"


class NotFound(K7dError):
    """No such VM or cluster."""

    code = "not_found"


class Conflict(K7dError):
    """A duplicate id, or a VM in the wrong state."""

    code = "conflict"


class Internal(K7dError):
    """The host failed (KVM, memory, files)."""

    code = "internal"


class Busy(K7dError):
    """The daemon serves as many connections as it may: try again later."""

    code = "busy"


class PermissionDenied(K7dError):
    """This process's credentials may not use the API."""

    code = "permission_denied"


class Unreachable(K7dError):
    """No daemon answered at the socket (not running, or no permission)."""

    code = "unreachable"


_BY_CODE: Dict[str, Type[K7dError]] = {
    c.code: c
    for c in (BadRequest, UnsupportedVersion, InvalidArgument, NotFound, Conflict, Internal, Busy, PermissionDenied)
}


class VmSummary(TypedDict, total=False):
    """One VM of `list` (and of a cluster's members)."""

    id: str
    status: str
    vcpus: int
    memory_mib: int
    guest: str


class VmInfo(TypedDict, total=False):
    """`info` (and the result of create, start, pause, resume, stop, restore)."""

    id: str
    status: str
    state: Dict[str, Any]
    config: Dict[str, Any]
    devices: List[Dict[str, Any]]
    parent: Optional[str]
    children: List[str]
    exits: int
    rebases: int
    serial_log: str
    vm_process: Dict[str, Any]


class GuestRam(TypedDict):
    """`guest_ram`'s result (bytes)."""

    id: str
    resident: int
    copied: int
    pss: int


class ForkedChild(TypedDict, total=False):
    """One child of a fork: its `info` fields, and what its fork took."""

    id: str
    status: str
    fork_ms: float
    shell: bool


class Forked(TypedDict, total=False):
    """`fork`'s result."""

    id: str
    children: List[ForkedChild]
    pause_ms: float
    source_paused_ms: float
    clusters: List[str]
    rebased: List[str]
    warnings: List[str]


class ClusterInfo(TypedDict, total=False):
    """`cluster_info` (and the result of cluster_create and cluster_add)."""

    id: str
    members: List[VmSummary]
    bridge: Optional[str]
    ports: List[str]


@dataclasses.dataclass(frozen=True)
class Executed:
    """How a command run by :meth:`Client.exec` ended, and what it wrote."""

    #: Its exit status: 128 + N for a signal N (137 when killed past its
    #: timeout), 127 when the program could not start.
    status: int
    #: Its stdout: the first 4 MiB (see :attr:`truncated`).
    stdout: bytes
    #: Its stderr: the first 4 MiB.
    stderr: bytes
    #: It wrote more than the daemon keeps to stdout or stderr.
    truncated: bool
    #: It ran past its timeout and was killed.
    timed_out: bool
    #: Why it did not start (status 127), if it did not.
    error: Optional[str]
    #: From the request to its end, in the daemon.
    exec_ms: float


class Deleted(TypedDict):
    """`delete`'s and `cluster_delete`'s result."""

    id: str
    deleted: bool


def builtin(
    name: str,
    *,
    args: Sequence[int] = (),
    memory_mib: int = 16,
    vcpus: int = 1,
    id: Optional[str] = None,
) -> Dict[str, Any]:
    """The config of a VM running one of k7d's built-in test guests
    (`k7d guests` lists them; `memwriter` writes pages and counts)."""
    config: Dict[str, Any] = {
        "vcpus": vcpus,
        "memory_mib": memory_mib,
        "guest": {"kind": "builtin", "name": name, "args": list(args)},
    }
    if id is not None:
        config["id"] = id
    return config


def linux(
    kernel: PathLike,
    *,
    initrd: Optional[PathLike] = None,
    cmdline: Optional[str] = None,
    memory_mib: int = 512,
    vcpus: int = 1,
    id: Optional[str] = None,
    devices: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """The config of a Linux guest (`devices`: disks, NICs, rng, vsock as
    `VmConfig` holds them, `vmm/src/config.rs`)."""
    guest: Dict[str, Any] = {"kind": "linux", "kernel": os.fspath(kernel)}
    if initrd is not None:
        guest["initrd"] = os.fspath(initrd)
    if cmdline is not None:
        guest["cmdline"] = cmdline
    config: Dict[str, Any] = {"vcpus": vcpus, "memory_mib": memory_mib, "guest": guest}
    if devices is not None:
        config["devices"] = dict(devices)
    if id is not None:
        config["id"] = id
    return config


class _Conn:
    """One connection to the daemon, with what was read past a line."""

    def __init__(self, path: str, timeout: Optional[float]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self.buf = bytearray()

    def open_and_idle(self) -> bool:
        """Still open, with nothing unread (the daemon closes a connection
        idle for 60 s; a closed one is never written to)."""
        if self.buf:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def read_line(self) -> bytes:
        """One line (without its newline); ConnectionError if the daemon
        closed the connection first."""
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[: nl + 1]
                return line
            if len(self.buf) > MAX_LINE:
                raise BadRequest(f"the daemon's answer is longer than {MAX_LINE} bytes")
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the daemon closed the connection before it answered")
            self.buf += chunk

    def close(self) -> None:
        self.sock.close()


class Client:
    """The daemon at `socket_path`. Each thread that uses a client keeps a
    connection of its own open between calls (a call costs no connect),
    so one client may be used from several threads at once; :meth:`close`
    (or the end of a ``with`` block) closes the calling thread's."""

    def __init__(self, socket_path: PathLike = DEFAULT_SOCKET, *, timeout: Optional[float] = 120.0) -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout
        self._local = threading.local()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes this thread's connection (the next call opens another)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    # -- the wire ---------------------------------------------------------

    def _conn(self, wait: Optional[float]) -> _Conn:
        conn: Optional[_Conn] = getattr(self._local, "conn", None)
        if conn is not None and not conn.open_and_idle():
            conn.close()
            conn = None
        if conn is None:
            conn = _Conn(self.socket_path, wait)
            self._local.conn = conn
        conn.sock.settimeout(wait)
        return conn

    def call(
        self,
        op: str,
        args: Optional[Mapping[str, Any]] = None,
        *,
        timeout: Optional[float] = None,
        on_line: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> Any:
        """Sends one request and returns its result, or raises the
        daemon's error (:class:`K7dError`). `timeout`: this call's wait,
        the client's unless given. `on_line`: each line the daemon writes
        before the answer (a streamed exec's output), as JSON."""
        wait = self.timeout if timeout is None else timeout
        request: Dict[str, Any] = {"v": API_VERSION, "op": op}
        if args is not None:
            request["args"] = dict(args)
        line = (json.dumps(request, separators=(",", ":")) + "\n").encode()
        try:
            conn = self._conn(wait)
            conn.sock.sendall(line)
            while True:
                answer = conn.read_line().decode()
                if on_line is None or answer.startswith('{"ok"'):
                    break
                try:
                    event = json.loads(answer)
                except ValueError as e:
                    raise BadRequest(f"the daemon's line during {op} is not JSON: {answer[:200]!r}") from e
                if not isinstance(event, dict) or "ok" in event:
                    break
                on_line(event)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as e:
            self.close()
            raise Unreachable(f"no k7d daemon answers at {self.socket_path}: {e.strerror or e}") from e
        except socket.timeout as e:
            self.close()
            raise Unreachable(f"the k7d daemon at {self.socket_path} did not answer {op} within {wait} s") from e
        except OSError as e:
            # ConnectionError included: what the daemon did is unknown, so
            # nothing is sent again.
            self.close()
            raise Unreachable(f"the k7d daemon at {self.socket_path} did not answer {op}: {e}") from e
        except BaseException:
            # A callback's own error, or an interrupt: the answer is unread.
            self.close()
            raise
        try:
            response = json.loads(answer)
        except ValueError as e:
            raise BadRequest(f"the daemon's answer to {op} is not JSON: {answer[:200]!r}") from e
        if not isinstance(response, dict) or "ok" not in response:
            raise BadRequest(f"the daemon's answer to {op} is not a response: {answer[:200]!r}")
        if response["ok"]:
            return response.get("result")
        error = response.get("error") or {}
        code = str(error.get("code", "error"))
        message = str(error.get("message", f"{op} failed"))
        raise _BY_CODE.get(code, K7dError)(message, code)

    # -- VMs --------------------------------------------------------------

    def version(self) -> Dict[str, Any]:
        """The daemon's API version, k7d version and pid."""
        return self.call("version")

    def list(self) -> List[VmSummary]:
        """Every VM."""
        return self.call("list")["vms"]

    def info(self, id: str) -> VmInfo:
        """One VM's record and live state."""
        return self.call("info", {"id": id})

    def create(self, config: Mapping[str, Any], *, start: bool = False) -> VmInfo:
        """Builds a VM from `config` (:func:`builtin`, :func:`linux`, or a
        config file's contents as a dict), started when `start`."""
        return self.call("create", {"config": dict(config), "start": start})

    def start(self, id: str) -> VmInfo:
        """Starts a created VM."""
        return self.call("start", {"id": id})

    def pause(self, id: str) -> VmInfo:
        """Parks a running VM's vCPUs (and its devices)."""
        return self.call("pause", {"id": id})

    def resume(self, id: str) -> VmInfo:
        """Unparks a paused VM."""
        return self.call("resume", {"id": id})

    def stop(self, id: str) -> VmInfo:
        """Stops a VM (it stays listed until deleted)."""
        return self.call("stop", {"id": id})

    def delete(self, id: str) -> Deleted:
        """Stops a VM if needed and removes it."""
        return self.call("delete", {"id": id})

    def snapshot(self, id: str, dir: PathLike, *, replace: bool = False) -> Dict[str, Any]:
        """Writes a cold snapshot of `id` into the absolute directory `dir`
        (a running VM is paused for it and resumed)."""
        args: Dict[str, Any] = {"id": id, "dir": os.fspath(dir)}
        if replace:
            args["replace"] = True
        return self.call("snapshot", args)

    def restore(self, dir: PathLike, *, id: Optional[str] = None) -> VmInfo:
        """Builds and starts a VM from the snapshot in `dir`."""
        args: Dict[str, Any] = {"dir": os.fspath(dir)}
        if id is not None:
            args["id"] = id
        return self.call("restore", args)

    def fork(self, id: str, *, count: int = 1, name: Optional[str] = None) -> Forked:
        """Forks the VM or cluster `id` `count` times, copy-on-write; the
        children run at once (a cluster's children of one fork form a
        cluster of their own). `name`: the one child's id."""
        args: Dict[str, Any] = {"id": id, "count": count}
        if name is not None:
            args["name"] = name
        return self.call("fork", args)

    def rebase(self, id: str) -> Dict[str, Any]:
        """Gives the fork source `id` a new base holding its RAM as it is."""
        return self.call("rebase", {"id": id})

    def peek(self, id: str, addr: int, count: int = 1) -> List[int]:
        """`count` little-endian 32-bit words of guest RAM at `addr`."""
        return self.call("peek", {"id": id, "addr": addr, "count": count})["words"]

    def guest_ram(self, id: str) -> GuestRam:
        """What VM `id`'s guest RAM costs the host, in bytes: `resident`,
        `copied` (a fork child's own pages, written since its fork) and
        `pss` (docs/observability.md)."""
        return self.call("guest_ram", {"id": id})

    def exec(
        self,
        id: str,
        command: Sequence[str],
        *,
        stdin: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[Union[int, Tuple[int, int]]] = None,
        timeout: Optional[float] = None,
        on_output: Optional[Callable[[str, bytes], None]] = None,
    ) -> Executed:
        """Runs `command` (the program and its arguments) in the running VM
        `id` through its guest agent and returns when it has ended: its
        status, stdout and stderr apart (`docs/exec.md`). `stdin`: at most
        512 KiB; `user`: a uid, or (uid, gid); `timeout`: seconds, after
        which it is killed (status 137, `timed_out`), 600 unless given.
        A fork child or a restored VM alike; the VM needs a vsock device
        and k7d-agent in its guest.

        `on_output`: streamed instead: each chunk of output is passed to it
        as it comes, as ("stdout" or "stderr", bytes), all of it (no
        4 MiB bound), and the result's `stdout` and `stderr` are empty. An
        exception it raises ends the exec (the command is killed)."""
        if isinstance(command, (str, bytes)):
            raise InvalidArgument("command is a sequence of the program and its arguments, not one string")
        args: Dict[str, Any] = {"id": id, "command": [str(c) for c in command]}
        if stdin:
            args["stdin"] = base64.b64encode(bytes(stdin)).decode()
        if env:
            args["env"] = [f"{k}={v}" for k, v in env.items()]
        if cwd is not None:
            args["cwd"] = cwd
        if user is not None:
            uid, gid = (user, user) if isinstance(user, int) else user
            args["uid"], args["gid"] = uid, gid
        if timeout is not None:
            args["timeout_s"] = timeout
        # The daemon answers when the command has ended.
        wait = (600.0 if timeout is None else float(timeout)) + 30.0
        if on_output is None:
            r = self.call("exec", args, timeout=wait)
        else:
            args["stream"] = True

            def line(event: Dict[str, Any]) -> None:
                chunk = event.get("output") or {}
                on_output(str(chunk.get("stream", "stdout")), base64.b64decode(chunk.get("data", "")))

            r = self.call("exec", args, timeout=wait, on_line=line)
        out, err = base64.b64decode(r["stdout"]), base64.b64decode(r["stderr"])
        return Executed(
            status=int(r["status"]),
            stdout=out,
            stderr=err,
            truncated=on_output is None and (len(out) < int(r["stdout_bytes"]) or len(err) < int(r["stderr_bytes"])),
            timed_out=bool(r.get("timed_out", False)),
            error=r.get("error"),
            exec_ms=float(r["exec_ms"]),
        )

    def copy_to(self, id: str, src: PathLike, dest: str, *, timeout: Optional[float] = None) -> None:
        """Copies `src` (a file, directory or symbolic link on this host) to
        the absolute path `dest` in VM `id`, as `k7d cp` does: an existing
        directory receives it under its own name, anything else is the
        copy's own name. Modes, symbolic links and (as root) owners are
        kept. Needs `sh` and `tar` in the guest (`docs/exec.md`); each
        `exec` it makes may take `timeout` seconds."""
        files.copy_to(self._runner(id, timeout), os.fspath(src), _guest_path(dest))

    def copy_from(
        self,
        id: str,
        src: str,
        dest: PathLike,
        *,
        max_size: int = 1 << 30,
        timeout: Optional[float] = None,
    ) -> None:
        """Copies the absolute path `src` in VM `id` to `dest` on this host
        (an existing directory receives it under its own name; any other
        existing name is refused). What the guest sends is hostile input:
        an entry outside the copy, a device, a path through a symbolic
        link or more than `max_size` bytes raises
        :class:`k7d.files.CopyRefused` and leaves nothing behind."""
        files.copy_from(self._runner(id, timeout), _guest_path(src), os.fspath(dest), max_size=max_size)

    def _runner(self, id: str, timeout: Optional[float]) -> files.Exec:
        def run(command: List[str], stdin: bytes) -> Tuple[int, bytes, bytes, bool]:
            r = self.exec(id, command, stdin=stdin, timeout=timeout)
            if r.error is not None:
                raise InvalidArgument(f"vm {id}: {command[0]} did not start: {r.error}")
            return r.status, r.stdout, r.stderr, r.truncated

        return run

    # -- clusters ---------------------------------------------------------

    def cluster_create(self, id: str, members: Sequence[str]) -> ClusterInfo:
        """Names existing VMs as cluster `id` (forked together, one pause)."""
        return self.call("cluster_create", {"id": id, "members": list(members)})

    def cluster_add(self, id: str, members: Sequence[str]) -> ClusterInfo:
        """Adds existing VMs to cluster `id`."""
        return self.call("cluster_add", {"id": id, "members": list(members)})

    def cluster_info(self, id: str) -> ClusterInfo:
        """One cluster and its members."""
        return self.call("cluster_info", {"id": id})

    def cluster_list(self) -> List[Dict[str, Any]]:
        """Every cluster."""
        return self.call("cluster_list")["clusters"]

    def cluster_delete(self, id: str) -> Deleted:
        """Deletes cluster `id` and every member VM."""
        return self.call("cluster_delete", {"id": id})

    # -- what deletes what it made ----------------------------------------

    @contextlib.contextmanager
    def vm(self, config: Mapping[str, Any], *, start: bool = True) -> Iterator[VmInfo]:
        """A VM for the block: created (and started), deleted at its end."""
        info = self.create(config, start=start)
        try:
            yield info
        finally:
            _forget(self.delete, info["id"])

    @contextlib.contextmanager
    def forked(self, id: str, *, count: int = 1, name: Optional[str] = None) -> Iterator[Forked]:
        """`count` children of `id` for the block, deleted at its end (a
        cluster's forks: each child cluster, with its members)."""
        forked = self.fork(id, count=count, name=name)
        try:
            yield forked
        finally:
            for c in forked.get("clusters", []):
                _forget(self.cluster_delete, c)
            if not forked.get("clusters"):
                for child in forked["children"]:
                    _forget(self.delete, child["id"])

    @contextlib.contextmanager
    def cluster(self, id: str, members: Sequence[str]) -> Iterator[ClusterInfo]:
        """Cluster `id` of `members` for the block; at its end the cluster
        is deleted, and with it (as the daemon does) its members."""
        info = self.cluster_create(id, members)
        try:
            yield info
        finally:
            _forget(self.cluster_delete, id)


def _guest_path(p: str) -> str:
    if not p.startswith("/") or "\0" in p or len(p) > 4096:
        raise InvalidArgument(f"{p!r}: a path in a VM is absolute")
    return p


def _forget(delete: Any, id: str) -> None:
    """Deletes `id`; one that is gone already is what was wanted."""
    try:
        delete(id)
    except NotFound:
        pass

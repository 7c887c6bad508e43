"""A client of the k7d daemon's API (issue 37): VMs, forks and clusters
from Python, standard library only.

    from k7d import Client, builtin

    k = Client("/run/k7d/k7d.sock")
    with k.vm(builtin("memwriter", args=[64, 0x20_0000, 1])) as vm:
        with k.forked(vm["id"], count=4) as f:
            for child in f["children"]:
                print(child["id"], child["fork_ms"])

Files and directories move with :meth:`Client.copy_to` and
:meth:`Client.copy_from` (`k7d.files`).

Errors are exceptions that carry the daemon's own sentence
(:class:`K7dError` and its subclasses, one per error code).
"""

from .client import (
    DEFAULT_SOCKET,
    BadRequest,
    Busy,
    Client,
    Conflict,
    Executed,
    Internal,
    InvalidArgument,
    K7dError,
    NotFound,
    PermissionDenied,
    Unreachable,
    UnsupportedVersion,
    builtin,
    linux,
)
from .files import CopyRefused

__all__ = [
    "DEFAULT_SOCKET",
    "BadRequest",
    "Busy",
    "Client",
    "Conflict",
    "CopyRefused",
    "Executed",
    "Internal",
    "InvalidArgument",
    "K7dError",
    "NotFound",
    "PermissionDenied",
    "Unreachable",
    "UnsupportedVersion",
    "builtin",
    "linux",
]

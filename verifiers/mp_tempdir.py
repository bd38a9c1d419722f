"""A temp dir for multiprocessing's sockets that is short enough to hold them.

The pool's forkserver (api.py) listens on an AF_UNIX socket at
``<multiprocessing's temp dir>/listener-XXXXXXXX``, that dir being ``$TMPDIR/pymp-XXXXXXXX``,
and a socket path holds at most 107 bytes (``sun_path``): with a TMPDIR longer than 75
bytes (a scheduler's per-job dir, a deep work tree) the pool could not start at all
("AF_UNIX path too long"). Python 3.14 falls back to a short dir by itself; before it,
``short_socket_dir`` gives multiprocessing a private dir under a short system temp dir,
removed at exit as multiprocessing removes its own.
"""
from __future__ import annotations

import os
import shutil
import tempfile

SOCKET_PATH_MAX = 107  # bytes of a socket path (Linux sun_path: 108 with its NUL)
_LISTENER = len("/listener-") + 8  # the name multiprocessing gives a listening socket
_OWN_DIR = len("/pymp-") + 8  # the dir multiprocessing makes for itself under TMPDIR
SHORT_BASES = ("/tmp", "/var/tmp", "/dev/shm")


class SocketDirError(RuntimeError):
    """No temp dir here is short enough for multiprocessing's sockets."""


def socket_dir_fits(path: str) -> bool:
    return len(os.fsencode(path)) + _LISTENER <= SOCKET_PATH_MAX


def short_socket_dir() -> str:
    """The dir multiprocessing makes its sockets in, made short first when the one it has (or
    would make under TMPDIR) is too long for them. Call before anything starts the forkserver."""
    from multiprocessing import process, util

    config = process.current_process()._config  # where multiprocessing keeps its temp dir (util.get_temp_dir)
    current = config.get("tempdir")
    if current is not None and socket_dir_fits(current):
        return current
    if current is None and len(os.fsencode(tempfile.gettempdir())) + _OWN_DIR + _LISTENER <= SOCKET_PATH_MAX:
        return util.get_temp_dir()
    for base in SHORT_BASES:
        if not socket_dir_fits(os.path.join(base, "pymp-XXXXXXXX")):
            continue
        try:
            short = tempfile.mkdtemp(prefix="pymp-", dir=base)  # 0700: private as TMPDIR's own would be
        except OSError:
            continue
        config["tempdir"] = short
        util.Finalize(None, shutil.rmtree, args=(short,), kwargs={"ignore_errors": True}, exitpriority=-100)
        return short
    raise SocketDirError(
        f"the verifier pool's sockets go under the temp dir {current or tempfile.gettempdir()!r}, too long for a "
        f"socket path ({SOCKET_PATH_MAX} bytes), and none of {list(SHORT_BASES)} can hold them: set TMPDIR to a "
        f"dir of at most {SOCKET_PATH_MAX - _OWN_DIR - _LISTENER} bytes")

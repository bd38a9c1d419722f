"""One memory and process limit for a whole sandboxed program, children and threads included.

Modes, best first (``memory_mode()`` picks the first this machine allows, once per process):

- ``cgroup2``: a child cgroup of the unified (v2) hierarchy with ``memory.max``,
  ``memory.swap.max = 0``, ``memory.oom.group = 1`` (an overrun kills the whole program) and
  ``pids.max``. It is made under the nearest cgroup of ours (our own or an ancestor) whose
  ``cgroup.subtree_control`` already delegates ``memory`` and ``pids`` and where we may make
  directories (root, or a delegated subtree).
- ``cgroup1``: child cgroups of the v1 ``memory`` and ``pids`` hierarchies under our own
  cgroup in each, with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where
  swap is accounted) and ``pids.max`` (hybrid hierarchies, e.g. this project's machines).
- ``rlimit``: no cgroup can be made here. The program's process count is bounded by
  RLIMIT_NPROC (``nproc``, in its own user namespace) and each process's address space by
  ``memory_mb // nproc``, so that all of them together stay within ``memory_mb``.

In the cgroup modes the limit covers every page the program charges: its processes'
memory, its files in the sandbox's tmpfs ``/work`` and ``/tmp``, and the launcher's two small
processes (``LAUNCHER_MB`` of headroom is added for them). The launcher joins the cgroup
first thing, while it is the program's only process (``ProgramLimit.procs_files``), so
nothing the program starts can be outside it. When it ends, whatever is left in the cgroup is killed and
the cgroup removed. ``ProgramLimit.oom_kills`` tells the verifier that the program hit its
limit (the kernel killed part of it), which fails the test whatever the program printed.

``RING_SANDBOX_MEMORY`` = ``auto`` (default) | ``cgroup2`` | ``cgroup1`` | ``rlimit`` forces a
mode; a forced cgroup mode the machine cannot give raises (fail closed), it never falls back.
"""
from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass

MODE_ENV = "RING_SANDBOX_MEMORY"
MODES = ("cgroup2", "cgroup1", "rlimit")
LAUNCHER_MB = 32  # the launcher's two small Python processes, charged to the program's cgroup
LAUNCHER_PIDS = 1  # the launcher outside the namespace (its PID 1 counts in nproc already)
PREFIX = "ring-sbx-"


class LimitUnavailable(OSError):
    """The requested whole-program limit cannot be set up on this machine."""


# ---- where the hierarchies are ------------------------------------------------------------
def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, fs type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if rest and rest[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], fields[3], rest[0], set(rest[2].split(",")) if len(rest) > 2 else set()))
    return out


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> our cgroup path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _host_dir(mount: str, mount_root: str, cgroup_path: str) -> str:
    rel = os.path.relpath(cgroup_path, mount_root) if mount_root != "/" else cgroup_path.lstrip("/")
    if rel.startswith(".."):
        raise LimitUnavailable(f"our cgroup {cgroup_path} is outside the mount at {mount} ({mount_root})")
    return os.path.normpath(os.path.join(mount, rel))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read_key(path: str, key: str) -> int:
    """The value of `key` in a flat keyed file (memory.events, memory.oom_control); 0 if absent."""
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except OSError:
        pass
    return 0


# ---- the two cgroup backends -------------------------------------------------------------
def _v2_parent() -> str:
    mount = next(((m, r) for m, r, t, _ in _mounts() if t == "cgroup2"), None)
    if mount is None:
        raise LimitUnavailable("no cgroup2 mount")
    path = _own_cgroups().get("")
    if path is None:
        raise LimitUnavailable("this process has no cgroup2 path")
    d = _host_dir(mount[0], mount[1], path)
    while True:
        try:
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
                delegated = set(f.read().split())
        except OSError:
            delegated = set()
        if {"memory", "pids"} <= delegated and os.access(d, os.W_OK):
            return d
        if os.path.normpath(d) == os.path.normpath(mount[0]):
            raise LimitUnavailable(f"no cgroup2 ancestor of {path} delegates memory and pids to us")
        d = os.path.dirname(d)


def _v1_parents() -> dict[str, str]:
    own = _own_cgroups()
    out = {}
    for controller in ("memory", "pids"):
        mount = next(((m, r) for m, r, t, opts in _mounts() if t == "cgroup" and controller in opts), None)
        if mount is None or controller not in own:
            raise LimitUnavailable(f"no cgroup v1 {controller} hierarchy")
        out[controller] = _host_dir(mount[0], mount[1], own[controller])
    return out


def _make(parent: str, name: str) -> str:
    d = os.path.join(parent, name)
    os.mkdir(d)
    return d


def _create_v2(name: str, limit_bytes: int, pids: int) -> tuple[str, ...]:
    d = _make(_v2_parent(), name)
    try:
        _write(os.path.join(d, "memory.max"), str(limit_bytes))
        if os.path.exists(os.path.join(d, "memory.swap.max")):
            _write(os.path.join(d, "memory.swap.max"), "0")
        _write(os.path.join(d, "memory.oom.group"), "1")
        _write(os.path.join(d, "pids.max"), str(pids))
    except OSError:
        _remove((d,))
        raise
    return (d,)


def _create_v1(name: str, limit_bytes: int, pids: int) -> tuple[str, ...]:
    parents = _v1_parents()
    made: list[str] = []
    try:
        mem = _make(parents["memory"], name)
        made.append(mem)
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(limit_bytes))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):  # swap counts too
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(limit_bytes))
        made.append(_make(parents["pids"], name))
        _write(os.path.join(made[-1], "pids.max"), str(pids))
    except OSError:
        _remove(tuple(made))
        raise
    return tuple(made)


CREATE = {"cgroup2": _create_v2, "cgroup1": _create_v1}
OOM_EVENTS = {"cgroup2": ("memory.events", "oom_kill"), "cgroup1": ("memory.oom_control", "oom_kill")}


def _members(dirs: tuple[str, ...]) -> set[int]:
    pids: set[int] = set()
    for d in dirs:
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids |= {int(x) for x in f.read().split()}
        except OSError:
            pass
    return pids


def _remove(dirs: tuple[str, ...]) -> None:
    """Kill what is left in the cgroups (a sandbox that ended normally leaves nothing), then
    remove them; the kernel needs a moment to release a cgroup whose last task just died."""
    for attempt in range(50):
        for pid in _members(dirs):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = []
        for d in dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
        if not left:
            return
        dirs = tuple(left)
        time.sleep(0.02 * (attempt + 1))


# ---- per run -----------------------------------------------------------------------------
@dataclass
class ProgramLimit:
    """The whole-program limit of one sandbox run."""

    mode: str
    memory_mb: int
    nproc: int
    dirs: tuple[str, ...] = ()

    @property
    def per_process_mb(self) -> int:
        """RLIMIT_AS of each process: the whole limit under a cgroup, else its nproc-th share."""
        return self.memory_mb if self.dirs else max(1, self.memory_mb // self.nproc)

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files the launcher writes its pid to, first thing."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        if not self.dirs:
            return 0
        name, key = OOM_EVENTS[self.mode]
        return _read_key(os.path.join(self.dirs[0], name), key)

    def close(self) -> None:
        if self.dirs:
            _remove(self.dirs)
            self.dirs = ()


def _probe(mode: str) -> None:
    """Raise LimitUnavailable/OSError unless a cgroup of `mode` can be made and joined here."""
    dirs = CREATE[mode](PREFIX + "probe-" + uuid.uuid4().hex[:8], 64 << 20, 4)
    try:
        for d in dirs:  # joining needs write access to cgroup.procs; an empty write checks it
            if not os.access(os.path.join(d, "cgroup.procs"), os.W_OK):
                raise LimitUnavailable(f"cannot move processes into {d}")
    finally:
        _remove(dirs)


@functools.cache
def _pick(requested: str) -> tuple[str, str]:
    """(mode, why the better modes are not used) for a requested mode ("auto" or one of MODES)."""
    if requested not in ("auto", *MODES):
        raise LimitUnavailable(f"{MODE_ENV}={requested!r}: expected auto or one of {list(MODES)}")
    if requested == "rlimit":
        return "rlimit", f"{MODE_ENV}=rlimit"
    why = []
    for mode in (requested,) if requested != "auto" else MODES[:-1]:
        try:
            _probe(mode)
            return mode, "; ".join(why)
        except OSError as e:
            why.append(f"{mode}: {e}")
    if requested != "auto":
        raise LimitUnavailable(f"{MODE_ENV}={requested} but {'; '.join(why)}")
    return "rlimit", "; ".join(why)


def memory_mode() -> tuple[str, str]:
    """(the whole-program limit in force here, why no better one): see the module doc."""
    return _pick(os.environ.get(MODE_ENV, "auto") or "auto")


def program_limit(memory_mb: int, nproc: int) -> ProgramLimit:
    """Set up the limit for one run (a fresh cgroup in the cgroup modes)."""
    mode, _ = memory_mode()
    limit = ProgramLimit(mode, memory_mb, nproc)
    if mode != "rlimit":
        total = (memory_mb + LAUNCHER_MB) << 20
        limit.dirs = CREATE[mode](PREFIX + uuid.uuid4().hex, total, nproc + LAUNCHER_PIDS)
    return limit

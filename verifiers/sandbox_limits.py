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
nothing the program starts can be outside it. A program that reaches its limit is ended
whole, not just the process that asked for the last page (so no other process of it goes on
with its output): in v2 by ``memory.oom.group``; in v1 the kernel pauses it instead of
killing (``memory.oom_control = 1``), signals an eventfd (``ProgramLimit.alarm_fd``) and the
sandbox kills every process in the cgroup. ``ProgramLimit.exceeded`` then tells the verifier,
which fails the test whatever the program printed. When the run ends, whatever is left in
the cgroup is killed and the cgroup removed.

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
        # v1 has no memory.oom.group: instead of killing one process and letting the others
        # go on, the kernel pauses a program at its limit and tells us (ProgramLimit.alarm_fd),
        # and the whole program is killed (kill_all)
        _write(os.path.join(mem, "memory.oom_control"), "1")
        made.append(_make(parents["pids"], name))
        _write(os.path.join(made[-1], "pids.max"), str(pids))
    except OSError:
        _remove(tuple(made))
        raise
    return tuple(made)


def _alarm_v1(dirs: tuple[str, ...]) -> int:
    """An eventfd the kernel signals when the memory cgroup (dirs[0]) reaches its limit."""
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    try:
        ofd = os.open(os.path.join(dirs[0], "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(os.path.join(dirs[0], "cgroup.event_control"), f"{efd} {ofd}")
        finally:
            os.close(ofd)
    except OSError:
        os.close(efd)
        raise
    return efd


CREATE = {"cgroup2": _create_v2, "cgroup1": _create_v1}
ALARM = {"cgroup1": _alarm_v1}  # cgroup2: memory.oom.group kills the whole program itself
# a key of the memory cgroup's file that counts the times the program hit its limit
OOM_EVENTS = {"cgroup2": ("memory.events", ("oom", "oom_kill")), "cgroup1": ("memory.oom_control", ("under_oom", "oom_kill"))}


def _members(dirs: tuple[str, ...]) -> set[int]:
    pids: set[int] = set()
    for d in dirs:
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids |= {int(x) for x in f.read().split()}
        except OSError:
            pass
    return pids


def _kill(dirs: tuple[str, ...]) -> None:
    """SIGKILL every process in the cgroups; v2's cgroup.kill does it in one step."""
    for d in dirs:
        kill = os.path.join(d, "cgroup.kill")
        if os.path.exists(kill):
            try:
                _write(kill, "1")
                continue
            except OSError:
                pass
        for _ in range(10):  # a task forking while we read is caught on the next pass
            pids = _members((d,))
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _remove(dirs: tuple[str, ...]) -> None:
    """Kill what is left in the cgroups (a sandbox that ended normally leaves nothing), then
    remove them; the kernel needs a moment to release a cgroup whose last task just died."""
    for attempt in range(50):
        _kill(dirs)
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
    alarm_fd: int | None = None  # readable once the program reached its memory limit (cgroup1)

    @property
    def per_process_mb(self) -> int:
        """RLIMIT_AS of each process: the whole limit under a cgroup, else its nproc-th share."""
        return self.memory_mb if self.dirs else max(1, self.memory_mb // self.nproc)

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files the launcher writes its pid to, first thing."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def exceeded(self) -> bool:
        """Whether the program reached its memory limit (and was stopped there)."""
        if not self.dirs:
            return False
        if self.alarm_fd is not None:
            try:
                if os.eventfd_read(self.alarm_fd):
                    return True
            except BlockingIOError:
                pass
        name, keys = OOM_EVENTS[self.mode]
        return any(_read_key(os.path.join(self.dirs[0], name), k) for k in keys)

    def kill_all(self) -> None:
        """SIGKILL every process of the program (the launcher's included)."""
        if self.dirs:
            _kill(self.dirs)

    def close(self) -> None:
        if self.alarm_fd is not None:
            os.close(self.alarm_fd)
            self.alarm_fd = None
        if self.dirs:
            _remove(self.dirs)
            self.dirs = ()


def _probe(mode: str) -> None:
    """Raise LimitUnavailable/OSError unless a cgroup of `mode` can be made, watched and
    joined here."""
    limit = ProgramLimit(mode, 64, 4)
    try:
        _setup(limit)
        for d in limit.dirs:  # joining needs write access to cgroup.procs
            if not os.access(os.path.join(d, "cgroup.procs"), os.W_OK):
                raise LimitUnavailable(f"cannot move processes into {d}")
    finally:
        limit.close()


def _setup(limit: ProgramLimit) -> None:
    total = (limit.memory_mb + LAUNCHER_MB) << 20
    limit.dirs = CREATE[limit.mode](PREFIX + uuid.uuid4().hex, total, limit.nproc + LAUNCHER_PIDS)
    if limit.mode in ALARM:
        limit.alarm_fd = ALARM[limit.mode](limit.dirs)


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
    limit = ProgramLimit(memory_mode()[0], memory_mb, nproc)
    if limit.mode != "rlimit":
        try:
            _setup(limit)
        except BaseException:
            limit.close()
            raise
    return limit

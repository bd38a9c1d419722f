"""Run an untrusted Python program in a sandbox built from an allow-list.

Namespace mode ("ns", used wherever the kernel lets this process create a user namespace:
as root, or as a user where unprivileged user namespaces are enabled) guarantees:

- **File system**: the program's root is an empty read-only tmpfs holding read-only bind
  mounts of only: the interpreter binary, its standard library (its site-packages covered
  by an empty mount), the shared libraries those two load (``ldd``), ``/etc/ld.so.cache``,
  the device nodes null/zero/full/random/urandom, and the paths the verifier declares
  (``SandboxConfig.expose``). Nothing else of the host exists in it: no /proc, /sys, /home,
  /etc, project or data dirs, host sockets or other binaries. Writable: only ``/work``
  (its cwd, a tmpfs capped at ``work_mb``) and ``/tmp`` (a tmpfs capped at ``tmp_mb``);
  both vanish with it. Input files are copied in; expected outputs never are.
- **Identity**: a fresh user namespace where the program runs as uid/gid 1000, mapped to an
  unprivileged host uid (60000-64999 when the verifier runs as root, else the verifier's
  own uid); it has no capabilities (dropped at exec) and no_new_privs.
- **Network and IPC**: new network namespace (only a down loopback: no socket of any family
  reaches the host, abstract unix sockets included) and new IPC and UTS namespaces.
- **Processes**: new PID namespace; the program sees no host process and cannot signal
  one. When it exits, times out or floods its output, every process it started is killed
  (the namespace's PID 1 exits; PR_SET_PDEATHSIG does the same if the verifier dies).
- **One limit for the whole program** (``sandbox_limits.py``): ``memory_mb`` and ``nproc``
  bound the program with all its children and threads together. Where a cgroup can be made
  (v2, else v1's memory and pids controllers) the program runs in a fresh one whose memory
  limit covers every page it charges (its processes and its tmpfs files) and whose pids
  limit bounds its tasks; otherwise RLIMIT_NPROC (counted in its own user namespace, its
  PID 1 included) bounds the processes and threads and each process gets
  ``memory_mb // nproc`` of address space. ``sandbox_info()`` and each result's
  ``memory_mode`` say which. ``memfd_create`` and ``shmget`` are refused (seccomp): their
  memory need be in no address space and no capped tmpfs. Also: CPU seconds per process, file size, open files,
  no core dumps, a wall-clock timeout and stdout/stderr caps, and a scrubbed environment
  (PATH, LANG, HOME=/work: no host secrets).
- **Private temp dirs**: the sandbox's scratch dir may lie under dirs only the verifier can
  traverse (a 0700 TMPDIR): the launcher reaches it through its cwd and file descriptors
  opened before it drops to the sandbox's uid, never by a path from the host's root.

Unsafe mode ("unsafe"): where no user namespace can be created, ``run_python`` raises
``SandboxUnavailable`` unless the user opts in with ``RING_SANDBOX_UNSAFE_NO_ISOLATION=1``.
Then the program runs as the verifier's own user in a temp dir with the same rlimits,
timeouts, caps and environment scrubbing, behind a Python audit hook that refuses
sockets, signals, process creation, ctypes, file changes outside the work dir and reads
outside it and the standard library. That hook guards against accidents, not attacks:
native code or an unhooked call gets past it. Use it only for trusted programs.
``isolation_mode()`` says which mode is in force.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .sandbox_limits import LAUNCHER_MB, ProgramLimit, memory_mode, program_limit

LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
UNSAFE_OPT_IN = "RING_SANDBOX_UNSAFE_NO_ISOLATION"
SANDBOX_ID = 1000  # uid and gid of the program inside its user namespace
HOST_ID_RANGE = (60000, 65000)  # host uids the sandbox maps to when the verifier is root
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 125  # the launcher's exit status when it could not build the sandbox


class SandboxUnavailable(RuntimeError):
    """No isolating sandbox can be built here and the user did not opt in to the unsafe mode.
    Not a bad answer: verifiers let it through so that training stops instead of scoring 0."""


@dataclass
class SandboxConfig:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512  # memory of the whole program, children and threads included
    nproc: int = 8  # processes + threads of the whole program, the sandbox's PID 1 included
    file_size_mb: int = 16
    nofile: int = 64
    work_mb: int = 64
    tmp_mb: int = 64
    max_output_bytes: int = 1 << 20
    expose: tuple[str, ...] = ()  # extra host paths the program may read (read-only)

    def memory_bound_mb(self, memory_mode: str) -> int:
        """What the whole program can hold at most in namespace mode: under a cgroup its
        memory_mb (tmpfs files included) plus the launcher's headroom; else nproc processes
        of memory_mb // nproc address space each, plus the files in /work and /tmp."""
        if memory_mode == "rlimit":
            return self.nproc * max(1, self.memory_mb // self.nproc) + self.work_mb + self.tmp_mb
        return self.memory_mb + LAUNCHER_MB


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_capped: bool
    elapsed_s: float
    mode: str
    files: dict[str, bytes] = field(default_factory=dict)
    memory_mode: str = "rlimit"  # how memory_mb bounded the whole program (sandbox_limits.py)
    memory_exceeded: bool = False  # the kernel killed part of the program at its memory limit

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_capped and not self.memory_exceeded


# ---- what the program may see ------------------------------------------------------------
def _interpreter() -> str:
    return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=1)
def _allow_list() -> tuple[tuple[tuple[str, bool], ...], tuple[str, ...]]:
    """(read-only paths as (path, is_dir), dirs to cover with an empty mount): the
    interpreter, its standard library and every shared library they load."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    dynload = os.path.join(stdlib, "lib-dynload")
    binaries = [_interpreter()]
    if os.path.isdir(dynload):
        binaries += [os.path.join(dynload, f) for f in sorted(os.listdir(dynload)) if f.endswith(".so")]
    out = subprocess.run(["ldd", *binaries], capture_output=True, text=True, timeout=60).stdout
    libs = set()
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
            libs.add(parts[parts.index("=>") + 1])
        elif parts and parts[0].startswith("/") and not parts[0].endswith(":"):  # the dynamic loader
            libs.add(parts[0])
    files = {_interpreter(), *libs, "/etc/ld.so.cache"}
    expose = [(stdlib, True)] + [(p, False) for p in sorted(files) if os.path.isfile(p) and not p.startswith(stdlib + "/")]
    mask = tuple(os.path.join(stdlib, d) for d in ("site-packages", "dist-packages") if os.path.isdir(os.path.join(stdlib, d)))
    return tuple(expose), mask


# ---- mode --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _namespace_problem() -> str | None:
    """None when a trivial program runs in namespace mode here, else why not."""
    try:
        r = _run({"main.py": "pass"}, "main.py", b"", SandboxConfig(wall_s=30), (), "ns")
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if r.returncode == 0:
        return None
    return (r.stderr.decode(errors="replace").strip() or f"exit code {r.returncode}")[-500:]


def isolation_mode() -> str:
    """"ns" when namespace isolation works here; else "unsafe" if the user opted in with
    RING_SANDBOX_UNSAFE_NO_ISOLATION=1; else raise SandboxUnavailable saying why."""
    problem = _namespace_problem()
    if problem is None:
        return "ns"
    if os.environ.get(UNSAFE_OPT_IN) == "1":
        return "unsafe"
    raise SandboxUnavailable(
        f"cannot isolate untrusted code here (user namespaces: {problem}); enable unprivileged user "
        f"namespaces or run as root, or set {UNSAFE_OPT_IN}=1 to run programs WITHOUT isolation")


def sandbox_info() -> dict[str, str]:
    """How programs are isolated and limited here: {"isolation", "memory", "memory_why"}
    (memory_why: why no better whole-program limit is in force). Raises SandboxUnavailable
    as ``isolation_mode`` does."""
    isolation = isolation_mode()
    memory, why = memory_mode()
    return {"isolation": isolation, "memory": memory, "memory_why": why}


# ---- running -----------------------------------------------------------------------------
def _preexec() -> None:
    # if the verifying process dies, the kernel SIGKILLs the launcher, whose child (the
    # namespace's PID 1) gets the same from its own PR_SET_PDEATHSIG: the namespace dies
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@functools.lru_cache(maxsize=1)
def _host_root() -> bool:
    """Root of the initial user namespace: may map the sandbox to any host uid. (Root of a
    nested user namespace may not, and is treated like any user.)"""
    try:
        with open("/proc/self/uid_map") as f:
            identity = f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        identity = False
    return os.geteuid() == 0 and identity


def _host_ids() -> tuple[int, int]:
    """The unprivileged host uid/gid the sandbox's 1000 maps to."""
    if _host_root():
        ident = random.randrange(*HOST_ID_RANGE)
        return ident, ident
    return os.geteuid(), os.getegid()


def _write_id_maps(pid: int, host_uid: int, host_gid: int) -> None:
    """Written from outside the new user namespace: a process cannot map itself to another
    host uid."""
    for name, text in (("uid_map", f"{SANDBOX_ID} {host_uid} 1\n"), ("setgroups", "deny\n"),
                       ("gid_map", f"{SANDBOX_ID} {host_gid} 1\n")):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def _stop(proc: subprocess.Popen, mode: str) -> None:
    """End the launcher and everything it started. In ns mode SIGTERM makes the launcher
    kill the namespace's PID 1 and reap it; SIGKILL to the group is the backstop."""
    if mode == "ns" and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def run_python(
    files: dict[str, str | bytes],
    main: str,
    stdin: str | bytes = b"",
    config: SandboxConfig | None = None,
    collect: tuple[str, ...] = (),
    mode: str | None = None,
) -> SandboxResult:
    """Write ``files`` into a fresh work dir and run ``python main`` there, sandboxed.
    ``collect`` names files (written by the program) to read back after it exits.
    Raises SandboxUnavailable (see ``isolation_mode``)."""
    return _run(files, main, stdin, config or SandboxConfig(), collect, mode or isolation_mode())


def _launch_config(files, main, cfg: SandboxConfig, collect, mode, root: str, limit: ProgramLimit) -> dict:
    """What the launcher needs. Its cwd is the run's scratch dir `root`: in namespace mode it
    names the work dir and the new root relative to it, so that no dir above `root` (a private
    TMPDIR) has to be traversable by the sandbox's uid."""
    expose, mask = _allow_list()
    expose += tuple((os.path.realpath(p), os.path.isdir(p)) for p in cfg.expose)
    mb = 1 << 20
    host_work = os.path.join(root, "work")
    return {
        "mode": mode, "host_work": "work" if mode == "ns" else host_work, "newroot": "root",
        "inputs": sorted(files), "collect": list(collect), "collect_cap": cfg.max_output_bytes, "expose": expose,
        "mask": mask, "devices": DEVICES, "tmp_mb": cfg.tmp_mb, "work_mb": cfg.work_mb,
        "sandbox_id": SANDBOX_ID, "workdir": "/work" if mode == "ns" else host_work,
        "cgroup_procs": limit.procs_files,  # the launcher joins them before it starts anything
        "rlimits": {
            "RLIMIT_CPU": [cfg.cpu_s, cfg.cpu_s + 1],
            "RLIMIT_AS": [limit.per_process_mb * mb] * 2,
            "RLIMIT_FSIZE": [cfg.file_size_mb * mb] * 2,
            "RLIMIT_NPROC": [cfg.nproc] * 2,
            "RLIMIT_NOFILE": [cfg.nofile] * 2,
            "RLIMIT_CORE": [0, 0],
        },
        "argv": [_interpreter(), "-E", "-s", "-B", main],
        "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/work" if mode == "ns" else host_work,
                "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"},
    }


def _prepare(files, mode) -> tuple[str, int, int]:
    """A fresh scratch dir holding the input files in work/ (owned by the sandbox's host
    uid when we are root); returns (dir, host uid, host gid)."""
    root = tempfile.mkdtemp(prefix="ring-sbx-")
    try:
        host_work = os.path.join(root, "work")
        os.mkdir(host_work)
        os.mkdir(os.path.join(root, "root"))
        for name, content in files.items():
            with open(os.path.join(host_work, name), "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        host_uid, host_gid = _host_ids()
        if mode == "ns" and _host_root():  # the namespace's PID 1 reads inputs and writes results as it
            for path in (root, host_work, *(os.path.join(host_work, n) for n in files)):
                os.chown(path, host_uid, host_gid)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root, host_uid, host_gid


def _program_limit(cfg: SandboxConfig) -> ProgramLimit:
    try:
        return program_limit(cfg.memory_mb, cfg.nproc)
    except OSError as e:  # fail closed: never run a program without its whole-program limit
        raise SandboxUnavailable(f"cannot set up the program's whole-program memory limit: {e}") from e


def _run(files, main, stdin, cfg: SandboxConfig, collect, mode) -> SandboxResult:
    for name in (*files, *collect):
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(f"sandbox file name must be a plain name: {name!r}")
    root, host_uid, host_gid = _prepare(files, mode)
    t0 = time.perf_counter()
    proc: subprocess.Popen | None = None
    limit: ProgramLimit | None = None
    sync = ()
    try:
        limit = _program_limit(cfg)
        launch = _launch_config(files, main, cfg, collect, mode, root, limit)
        if mode == "ns":
            ready_r, ready_w = os.pipe()
            maps_r, maps_w = os.pipe()
            sync = (ready_r, ready_w, maps_r, maps_w)
            launch["sync_fds"] = [ready_w, maps_r]
        stdin_file = tempfile.TemporaryFile()
        stdin_file.write(stdin.encode() if isinstance(stdin, str) else stdin)
        stdin_file.seek(0)
        proc = subprocess.Popen(
            [_interpreter(), "-I", "-S", LAUNCHER, json.dumps(launch)], stdin=stdin_file,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env={"PATH": "/usr/bin:/bin"},
            cwd=root, preexec_fn=_preexec, pass_fds=launch.get("sync_fds", ()),
            extra_groups=[] if _host_root() else None,
        )
        stdin_file.close()
        if mode == "ns":
            for fd in (ready_w, maps_r):  # the launcher's ends
                os.close(fd)
            sync = (ready_r, maps_w)
            if os.read(ready_r, 1) == b"u":  # else the launcher failed to unshare and says why
                _write_id_maps(proc.pid, host_uid, host_gid)
                os.write(maps_w, b"m")
            for fd in sync:
                os.close(fd)
            sync = ()
        out, err, timed_out, capped, at_limit = _communicate(proc, t0 + cfg.wall_s, cfg.max_output_bytes,
                                                             limit.alarm_fd)
        if at_limit:  # the program reached its memory limit: all of it ends now, none goes on
            limit.kill_all()
        _stop(proc, mode)
        collected = _collected(os.path.join(root, "work"), collect, cfg.max_output_bytes)
        return SandboxResult(proc.returncode, out, err, timed_out, capped, time.perf_counter() - t0, mode, collected,
                             memory_mode=limit.mode, memory_exceeded=at_limit or limit.exceeded())
    finally:
        for fd in sync:  # only fds still open: an fd number closed twice may be someone else's by then
            os.close(fd)
        if proc is not None and proc.returncode is None:
            _stop(proc, mode)
        if limit is not None:
            limit.close()
        shutil.rmtree(root, ignore_errors=True)


def _collected(host_work: str, collect, cap: int) -> dict[str, bytes]:
    out = {}
    for name in collect:
        p = os.path.join(host_work, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                out[name] = f.read(cap)
    return out


def _communicate(proc: subprocess.Popen, deadline: float, cap: int,
                 alarm_fd: int | None) -> tuple[bytes, bytes, bool, bool, bool]:
    """(stdout, stderr, timed out, output capped, memory limit reached): reads until the
    program closes its pipes, times out, floods them, or `alarm_fd` becomes readable."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    if alarm_fd is not None:
        sel.register(alarm_fd, selectors.EVENT_READ)
    timed_out = capped = at_limit = False
    try:
        while len(sel.get_map()) > (alarm_fd is not None):
            left = deadline - time.perf_counter()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                if key.fileobj == alarm_fd:
                    at_limit = True
                    break
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    capped = True
            if capped or at_limit:
                break
        while not (timed_out or capped or at_limit):  # pipes closed: wait for exit, the deadline or the limit
            try:
                proc.wait(timeout=max(0.01, min(0.1, deadline - time.perf_counter())))
                break
            except subprocess.TimeoutExpired:
                timed_out = time.perf_counter() >= deadline
                at_limit = bool(alarm_fd is not None and sel.select(timeout=0))
    finally:
        sel.close()
        for f in bufs:
            f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, capped, at_limit

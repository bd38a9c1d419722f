"""Run an untrusted Python program in a sandbox.

Guarantees (namespace mode, the default where ``unshare`` works, e.g. as root on Linux):
- a fresh temporary directory is the program's cwd and the only place it can write
  (besides a private, size-capped /tmp that vanishes with it); removed afterwards;
- new network namespace: no interface but a down loopback, so no connection leaves;
- new PID namespace: the program is PID 1 of its own namespace and sees no host process
  (it cannot signal its parent or read other processes' /proc/<pid>/environ); killing it
  kills every process it started, including ones that called setsid();
- new mount namespace: the project directory, the caller's cwd, /root, /home, /work, /tmp,
  /var/tmp, /dev/shm, /run, /mnt, /media, /srv are covered by empty tmpfs mounts (extra
  paths: ``SandboxConfig.hide`` or env ``RING_SANDBOX_HIDE``, colon separated); the Python
  installation is re-exposed read-only;
- when started as root, the program runs as an unprivileged uid (60000-64999, no
  supplementary groups, no_new_privs), so it can neither write outside its directory nor
  undo the mounts, and RLIMIT_NPROC applies to it;
- rlimits: CPU seconds, address space, file size, number of processes, open files, no core;
- a scrubbed environment (PATH, LANG, HOME=workdir: nothing of the caller's, so no AWS_*
  or tokens);
- wall-clock timeout and stdout/stderr size caps; on exit, timeout or cap the whole process
  group is SIGKILLed (and ``unshare --kill-child`` + PR_SET_PDEATHSIG kill the namespace if
  the verifying process itself dies).

Fallback mode (no usable ``unshare``): same temp dir, rlimits, env scrubbing, timeouts,
caps and process-group kill, plus a Python audit hook that refuses sockets, os.kill,
process creation, ctypes, writing outside the work directory and opening hidden paths or other processes' /proc entries. This
is weaker: audit hooks are a Python-level guard (a C extension could bypass them) and the
program keeps the caller's uid. ``isolation_mode()`` says which mode is in force;
``RING_SANDBOX_MODE=fallback`` forces the fallback.
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
DEFAULT_HIDE = ("/root", "/home", "/work", "/tmp", "/var/tmp", "/dev/shm", "/run", "/mnt", "/media", "/srv")
_NEVER_HIDE = {"/", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/dev", "/sys", "/var"}
UNSHARE_ARGS = ["--net", "--pid", "--fork", "--kill-child=SIGKILL", "--mount", "--mount-proc"]
PR_SET_PDEATHSIG = 1


@dataclass
class SandboxConfig:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 16
    nproc: int = 32
    nofile: int = 64
    max_output_bytes: int = 1 << 20
    hide: tuple[str, ...] = ()


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

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_capped


def _unshare_cmd() -> list[str] | None:
    exe = shutil.which("unshare")
    if exe is None:
        return None
    cmd = [exe]
    if os.geteuid() != 0:
        cmd.append("--map-root-user")  # needs unprivileged user namespaces
    return cmd + UNSHARE_ARGS


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """"ns" when a throwaway ``unshare`` with all our namespaces runs, else "fallback"."""
    if os.environ.get("RING_SANDBOX_MODE") == "fallback":
        return "fallback"
    cmd = _unshare_cmd()
    if cmd is None:
        return "fallback"
    try:
        r = subprocess.run(cmd + ["true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "fallback"
    return "ns" if r.returncode == 0 else "fallback"


def _hidden_paths(extra: tuple[str, ...]) -> list[str]:
    env_extra = tuple(p for p in os.environ.get("RING_SANDBOX_HIDE", "").split(":") if p)
    paths = set()
    for p in (*DEFAULT_HIDE, PROJECT_ROOT, os.getcwd(), *extra, *env_extra):
        rp = os.path.realpath(p)
        if rp not in _NEVER_HIDE and os.path.isdir(rp):
            paths.add(rp)
    return sorted(paths)


def _exposed_paths() -> list[str]:
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, exe_dir)}
    return sorted(p for p in paths if p not in _NEVER_HIDE)


def _preexec() -> None:
    # If the verifying process dies, the kernel SIGKILLs unshare, whose --kill-child then
    # SIGKILLs the namespace's PID 1, which takes every process of the namespace with it.
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def _descendants(root_pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, stack = [], [root_pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        for pid in _descendants(proc.pid):  # fallback mode: children that left the group
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
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
    """Write ``files`` into a fresh directory and run ``python main`` there, sandboxed.

    ``collect`` names files (written by the program) to read back after it exits.
    """
    cfg = config or SandboxConfig()
    mode = mode or isolation_mode()
    root = tempfile.mkdtemp(prefix="ring-sbx-")
    workdir = os.path.join(root, "work")
    os.mkdir(workdir)
    t0 = time.perf_counter()
    proc: subprocess.Popen | None = None
    try:
        for name, content in files.items():
            p = os.path.join(workdir, name)
            if os.path.dirname(os.path.abspath(p)) != workdir:
                raise ValueError(f"sandbox file name must be a plain name: {name!r}")
            with open(p, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        uid = None
        if os.geteuid() == 0 and mode == "ns":
            uid = 60000 + random.randrange(5000)
            for dirpath, _, fnames in os.walk(root):
                os.chown(dirpath, uid, uid)
                for fn in fnames:
                    os.chown(os.path.join(dirpath, fn), uid, uid)
            os.chmod(root, 0o700)
        mb = 1 << 20
        launch_cfg = {
            "mode": mode,
            "workdir": workdir,
            "hide": _hidden_paths(cfg.hide),
            "expose": _exposed_paths(),
            "uid": uid,
            "rlimits": {
                "RLIMIT_CPU": [cfg.cpu_s, cfg.cpu_s + 1],
                "RLIMIT_AS": [cfg.memory_mb * mb, cfg.memory_mb * mb],
                "RLIMIT_FSIZE": [cfg.file_size_mb * mb, cfg.file_size_mb * mb],
                "RLIMIT_NPROC": [cfg.nproc, cfg.nproc],
                "RLIMIT_NOFILE": [cfg.nofile, cfg.nofile],
                "RLIMIT_CORE": [0, 0],
            },
            "argv": [os.path.realpath(sys.executable), "-E", "-s", "-B", main],
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
                    "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"},
        }
        cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(launch_cfg)]
        if mode == "ns":
            cmd = (_unshare_cmd() or []) + cmd
        stdin_file = tempfile.TemporaryFile()
        stdin_file.write(stdin.encode() if isinstance(stdin, str) else stdin)
        stdin_file.seek(0)
        proc = subprocess.Popen(
            cmd, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, env={"PATH": "/usr/bin:/bin"}, cwd=root, preexec_fn=_preexec,
        )
        stdin_file.close()
        out, err, timed_out, capped = _communicate(proc, t0 + cfg.wall_s, cfg.max_output_bytes)
        if timed_out or capped:
            _kill_tree(proc)
        else:
            proc.wait()
            _kill_tree(proc)  # anything it left running (detached children) goes too
        collected = {}
        for name in collect:
            p = os.path.join(workdir, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    collected[name] = f.read(cfg.max_output_bytes)
        return SandboxResult(proc.returncode, out, err, timed_out, capped, time.perf_counter() - t0, mode, collected)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_tree(proc)
        shutil.rmtree(root, ignore_errors=True)


def _communicate(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    timed_out = capped = False
    try:
        while sel.get_map():
            left = deadline - time.perf_counter()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    capped = True
            if capped:
                break
        if not timed_out and not capped:
            # pipes closed: wait for exit within the deadline
            try:
                proc.wait(timeout=max(0.01, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        sel.close()
        for f in bufs:
            f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, capped

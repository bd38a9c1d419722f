"""The launching process's side of the warm job server (pipeline.job_server): which server a CPU
job is forked from, and the job as launch sees it (`WarmJob`, a `subprocess.Popen` look-alike).

A process's first CPU job starts cold; from the second on, its jobs are forked from a server made
for their working directory and environment (less PER_JOB_VARIABLES and the job's credentials);
the two most recently used servers are kept, one replaced ends once its jobs have, all end with
this process (atexit; kill -9 of it: its servers see their line close, their jobs' guards take
the jobs down). `RING_WARM_JOBS=off`, or no pidfds (not Linux): every job starts cold.
"""
from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from pipeline.job_server import MAX_MESSAGE, WARM_MODULES_VARIABLE

# read by the job as it runs, never by an import: they may differ from the server's own. (pytest
# sets its variable anew for every test phase in a process that launches stages in-process; the
# compile switches are read when a model is compiled: stages.common.compile_layers, fused_loss.)
PER_JOB_VARIABLES = frozenset({"RING_FORWARD_ENV", "RING_COLLECTIVE_TIMEOUT_S", "OMP_NUM_THREADS",
                               "PYTEST_CURRENT_TEST", "RING_COMPILE_BACKEND", "RING_COMPILE_LOSS"})
SWITCH = "RING_WARM_JOBS"  # `off`: every CPU job starts as its own process
_READY_TIMEOUT_S = 300.0  # the server's imports (~10 s on 2 busy cores)


def enabled() -> bool:
    return hasattr(os, "pidfd_open") and os.environ.get(SWITCH, "on").lower() != "off"


@dataclass
class _Server:
    key: tuple
    proc: subprocess.Popen
    control: socket.socket
    running: int = 0  # its jobs not yet ended
    retired: bool = False  # a newer server took its place: it stops when its last job ends

    def stop(self) -> None:
        self.control.close()  # the server's end of the line: it returns from `serve`
        try:
            self.proc.wait(timeout=10)  # reaped: its CPU counts as this process's children's
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def retire(self) -> None:
        """Stop it now if no job of it runs, else when its last job ends (`job_ended`): its
        running jobs' guards would take them down with it."""
        self.retired = True
        if self.running == 0:
            self.stop()

    def job_ended(self) -> None:
        with _lock:
            self.running -= 1
            if self.retired and self.running == 0:
                self.stop()


_lock = threading.Lock()
# this process's servers by environment, the most recently used last. A suite's tests (or a user's
# script) may launch under two environments in turn: the idle server of each is kept.
_servers: dict[tuple, _Server] = {}
_KEPT = 2
_cpu_launches = 0  # the CPU jobs this process asked to start: its first one starts cold
_broken: str | None = None  # why this process starts its jobs cold (a server that failed)
# variables the servers' warm imports set, with their values: the same imports in this process
# set them too, as it goes on (a test that imports DeepSpeed). A server whose imports set one
# ends with what a server started with it has, so they are no part of a server's key.
_set_by_imports: dict[str, str] = {}


def _start_server(key: tuple, env: dict[str, str], cwd: str, tracked: bool) -> _Server | None:
    global _broken
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.job_server", str(theirs.fileno()),
                                 *(["--with-mlflow"] if tracked else [])],
                                env=env, cwd=cwd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = _Server(key, proc, ours)
    ours.settimeout(_READY_TIMEOUT_S)
    try:
        answer = json.loads(ours.recv(MAX_MESSAGE) or b'{"error": "it exited"}')
    except (OSError, ValueError) as e:
        answer = {"error": str(e)}
    ours.settimeout(None)
    if "ready" not in answer:
        _broken = f"the warm job server did not start ({answer.get('error')}); CPU jobs start cold"
        print(f"warning: {_broken}", file=sys.stderr)  # slower from now on, not wrong: said, not fatal
        server.stop()
        return None
    _set_by_imports.update(answer.get("set_by_imports", {}))
    if answer.get("missing"):  # a slower start for every job, not a wrong one: said, not fatal
        print(f"warning: {WARM_MODULES_VARIABLE} names modules that cannot be imported: "
              f"{'; '.join(answer['missing'])}; the warm job server goes on without them", file=sys.stderr)
    return server


def _server_for(common_env: dict[str, str], cwd: str, tracked: bool) -> _Server | None:
    """This process's server for jobs of `common_env` in `cwd`, made if need be; under _lock.
    None for the first CPU job a process launches: a server costs about what it saves one job (its
    imports), so it pays from the second job on and a process that launches one job (a
    `ring-pipeline curate` rerun of one stage) is not made slower by it. A server made for a
    `tracked` job warms MLflow too (a pipeline run's jobs are all tracked or none)."""
    global _cpu_launches, _broken
    _cpu_launches += 1
    env = {k: v for k, v in common_env.items() if k not in PER_JOB_VARIABLES and _set_by_imports.get(k) != v}
    key = (cwd, tuple(sorted(env.items())))
    server = _servers.pop(key, None)
    if server is not None and server.proc.poll() is not None:  # it died (e.g. a kernel without pidfds)
        _broken = f"the warm job server exited by itself (code {server.proc.returncode}); CPU jobs start cold"
        server.retire()
        server = None
    if server is None and (_broken is not None or _cpu_launches < 2):
        return None
    if server is None:
        server = _start_server(key, env, cwd, tracked)
        if server is None:
            return None
    _servers[key] = server
    while len(_servers) > _KEPT:  # the least recently used goes (once its jobs have ended)
        _servers.pop(next(iter(_servers))).retire()
    return server


class WarmJob:
    """A job forked by the server, seen as the `subprocess.Popen` of its guard: `pid` (the
    leader of its process group), `stdout` (text, as Popen's `text=True, errors="replace"`),
    `poll`, `wait` and `returncode`."""

    def __init__(self, pid: int, stdout_fd: int, job: socket.socket, server: _Server) -> None:
        self.pid, self.returncode = pid, None
        self.stdout = open(stdout_fd, errors="replace", buffering=1)  # noqa: SIM115 - Popen's, read to EOF
        self._job, self._server = job, server

    def poll(self) -> int | None:
        return self.returncode if self.returncode is not None else self._receive(0)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._receive(timeout) is None:
            raise subprocess.TimeoutExpired(f"job {self.pid}", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def _receive(self, timeout: float | None) -> int | None:
        if select.select([self._job], [], [], timeout)[0]:
            message = self._job.recv(MAX_MESSAGE)
            # no message: the server was killed; its guard takes the job down (parent death)
            self.returncode = json.loads(message)["status"] if message else -signal.SIGKILL
            self._job.close()
            self._server.job_ended()
        return self.returncode


def start_job(command: list[str], env: dict[str, str], cwd: str | None,
              common_env: dict[str, str], tracked: bool = False) -> WarmJob | None:
    """`command` (`python -m MODULE ARGS...` of this interpreter) forked from this process's warm
    server with `env`, in `cwd` (None: this process's). The server is made for `common_env`, the
    job's environment without its own credentials, less PER_JOB_VARIABLES; for a `tracked` job
    (it logs to MLflow) it warms MLflow's client too. None when it cannot be: the caller starts
    the job cold."""
    if not enabled() or command[:2] != [sys.executable, "-m"] or len(command) < 3:
        return None
    cwd = os.path.abspath(cwd or os.getcwd())
    read_end, write_end = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    started: dict[str, Any] = {}
    try:
        with _lock:
            server = _server_for(common_env, cwd, tracked)
            if server is not None:
                request = json.dumps({"argv": command[2:], "env": env, "cwd": cwd, "parent": os.getpid()})
                server.control.sendmsg([request.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                             array.array("i", [write_end, theirs.fileno()]))])
                started = json.loads(ours.recv(MAX_MESSAGE) or b"{}")
                server.running += "pid" in started
    except OSError:
        pass  # the server went away: this job starts cold
    finally:
        os.close(write_end)
        theirs.close()
    if "pid" not in started:
        os.close(read_end)
        ours.close()
        return None
    return WarmJob(started["pid"], read_end, ours, server)


def stop_servers() -> None:
    """End this process's servers as it exits (their CPU is counted as our children's)."""
    with _lock:
        while _servers:
            _servers.popitem()[1].stop()


def _forget_in_child() -> None:
    """A fork of the launching process (multiprocessing) must not share its servers' lines."""
    for server in _servers.values():
        server.control.close()
    _servers.clear()


atexit.register(stop_servers)
os.register_at_fork(after_in_child=_forget_in_child)

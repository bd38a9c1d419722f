"""A warm process that forks the CPU stage jobs of the process launching them (pipeline.launch).

A stage job started as a fresh `python -m ENTRY` spends most of a small CPU stage importing
torch, transformers' model code and DeepSpeed before its first step (~10 CPU-s on a 2-core
machine), and rank 0 of a tracked stage MLflow's client (~5.5 more); the tiny
recipe starts seven such jobs. So the second CPU job a
process launches starts this server (`python -m pipeline.job_server`), which imports them once,
and that job and every later CPU job of the process are forked from it, as `pipeline.local_ranks`
forks a job's ranks from its warm launcher. (The first job starts cold: a server costs about
what it saves one job, so a process that launches a single job is not made slower.)

A forked job gets what `launch_job`'s Popen of `pipeline.job_guard` gave it:
- its own session, whose leader is its guard (`job_guard.guard`: the group goes down when the
  server is gone, and the server ends when the launching process does); the launching process
  stops the job with `os.killpg` on the guard's pid (`WarmJob.pid`), as before;
- stdout and stderr on the launching process's pipe; stdin /dev/null (a job in a session of its
  own never reads the terminal);
- its environment, working directory and argv; torch's thread count from its OMP_NUM_THREADS
  (`renew_torch_threads`); the default signal dispositions; the module run
  as `__main__` (`run_module_as_main`), with its exit handlers run as it ends;
- its exit status: the server reaps the guard and sends it back (`WarmJob.wait`).

What a fork cannot give: a fresh interpreter (its start-up hooks, sitecustomize, ran once, in
the server). A server is made for one working directory and one environment, less the variables
read when the job runs (`PER_JOB_VARIABLES` and the job's credentials): a job whose environment
differs in any other variable, which an import may have read, gets a server of its own (not one
that the server's own imports set to the value the job has: they were set in it all the same). The two
most recently used are kept; one replaced ends once its running jobs have (pipeline.warm_jobs:
the launching process's side). Only for CPU jobs on one node (launch decides):
forking a process in which CUDA may have initialised is unsafe, and this server never imports
more than torch's CPU side. Linux only (pidfds); elsewhere, or with `RING_WARM_JOBS=off`, every
job starts as its own process.
"""
from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Iterator

from pipeline import job_guard

# imported by the jobs inside `main` (lazily, for the data stages' sake): warmed once here and in
# pipeline.local_ranks; and, in a server for tracked jobs (`--with-mlflow`), MLflow's client and
# SQL store (SQLite is the default tracking), which rank 0 of a tracked stage imports for its
# StageLogger: ~5.5 CPU-s a tracked job (the tiny recipe on 2 cores: 132 -> 111 CPU-s in all).
# A process must not fork with a thread of its own running: a server whose imports started one
# refuses to serve (`_threads_started`).
WARM_MODULES = ("torch", "deepspeed", "transformers.modeling_utils", "mlflow.tracking",
                "mlflow.store.tracking.sqlalchemy_store")
# comma-separated modules to warm instead (empty: none), e.g. a heavy library of a stage kind of
# one's own; part of the server's environment, so jobs asking for other modules get another server
WARM_MODULES_VARIABLE = "RING_WARM_MODULES"
MAX_MESSAGE = 1 << 20  # a request (the job's environment) or an answer, on the server's lines
_PR_SET_NAME = 15


def run_module_as_main(module: str, args: list[str]) -> int:
    """Run `module` as `__main__` with `sys.argv` = [module, *args] in a process forked from a
    warm one (a job here, a rank in pipeline.local_ranks), as `python -m` would: default signal
    handling; when it ends, its non-daemon threads joined and its exit handlers (atexit) run,
    which a fork's own exit would skip (weakref finalizers, logging, verifier pools, ...). Returns
    its exit status; an uncaught exception propagates (a job that fails usually ends the process
    itself: run_job's os._exit)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # as under `python -m`, the module exists only as __main__
    status: Any = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        status = done.code
    finally:
        threading._shutdown()  # type: ignore[attr-defined] - what the interpreter's exit does first
        atexit._run_exitfuncs()
    if isinstance(status, str):  # sys.exit("message"), as Python shows it
        print(status, file=sys.stderr)
    return status if isinstance(status, int) else 0 if status is None else 1


def renew_torch_threads() -> None:
    """In a process just forked from a warm one, before it starts a thread: torch's intra-op
    thread count set to its OMP_NUM_THREADS (what a fresh torch reads), else to the count it has.
    Setting it also replaces, now and in this one thread, the thread pool the fork
    left behind (caffe2's pthreadpool, which every `set_num_threads` asks for): torch otherwise
    replaces it in whichever thread asks first, and once a count was set every new thread asks at
    its first operation. Two threads asking at once (a rank's gloo threads, a bounded store call)
    can be handed no pool: "Invalid thread pool!", seen once in CI in a forked CPU rank."""
    torch, threads = sys.modules.get("torch"), os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None:
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else torch.get_num_threads())


def name_process(name: str) -> None:
    """This process's short name (`/proc/PID/comm`, 15 bytes: what top and pipeline.hang read)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass  # only the labels miss it


@contextlib.contextmanager
def _short_name_kept() -> Iterator[None]:
    """setproctitle also renames the process (its first 15 bytes): keep the name it had."""
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    try:
        yield
    finally:
        name_process(name)


def _show_as(command: list[str]) -> None:
    """A forked process shown in ps as the command it stands for."""
    retitle = sys.modules.get("setproctitle")
    if retitle is not None:  # the server imported it as it started (if installed)
        with _short_name_kept():
            retitle.setproctitle(" ".join(command))


# -- the server ------------------------------------------------------------------------------------
class _ForkedChild:
    """`job_guard.Child` of a job forked in the guard's process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.05)


def _fork_job(module: str, args: list[str]) -> _ForkedChild:
    pid = os.fork()
    if pid != 0:
        return _ForkedChild(pid)
    status, interrupted = 1, False
    try:
        renew_torch_threads()
        _show_as([sys.executable, "-m", module, *args])
        status = run_module_as_main(module, args)
    except KeyboardInterrupt as e:
        _print_uncaught(e)
        interrupted = True
    except BaseException as e:  # noqa: BLE001 - what Python prints for an uncaught exception
        _print_uncaught(e)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if interrupted:  # as Python ends on an uncaught Ctrl-C: by the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _print_uncaught(error: BaseException) -> None:
    """The traceback Python prints for an uncaught exception, from the job's own frames down: the
    forking server's and runpy's above them are no part of the job (a cold `python -m` shows two
    runpy lines there), and a reader of the stage log should not suspect the server."""
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)


def _become_job(request: dict[str, Any], out_fd: int, server_fds: list[int]) -> None:
    """The forked guard: the job's session, its stdio, environment and directory, then the
    guard's loop over the job forked once more. Never returns."""
    status = 70
    try:
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        for fd in (devnull, out_fd):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        module, args = request["argv"][0], request["argv"][1:]
        _show_as([sys.executable, "-m", "pipeline.job_guard", str(request["parent"]), "--",
                  sys.executable, "-m", *request["argv"]])
        status = job_guard.guard(os.getppid(), lambda: _fork_job(module, args))
    except BaseException:  # noqa: BLE001 - reported on the job's own output
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def import_warm_modules(with_mlflow: bool = True) -> list[str]:
    """WARM_MODULES (or RING_WARM_MODULES') imported now, MLflow's only `with_mlflow`; the names
    RING_WARM_MODULES gave that cannot be (a default one missing is an optional stack the jobs do
    not need). Unless MLflow is imported here it is masked meanwhile, as `run_job` masks it in a
    rank that does not log (DeepSpeed's autotuner imports it optionally); rank 0 of a tracked run
    imports it itself."""
    chosen = os.environ.get(WARM_MODULES_VARIABLE)
    names = WARM_MODULES if chosen is None else [n.strip() for n in chosen.split(",") if n.strip()]
    if not with_mlflow:
        names = [name for name in names if name.split(".")[0] != "mlflow"]
    missing = []
    masked = (not any(name.split(".")[0] == "mlflow" for name in names)
              and sys.modules.setdefault("mlflow", None) is None)
    try:
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError as e:
                if chosen is not None:
                    missing.append(f"{name} ({e})")
    finally:
        if masked and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return missing


def _threads_started() -> str:
    """The Python threads running besides this one, by name ('' if none): a fork copies only the
    calling thread, so a lock another thread held would stay held in every job (a library whose
    import starts a thread: an MLflow release whose telemetry did, outside CI)."""
    return ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())


def serve(control: socket.socket) -> None:
    """Fork a guarded job per request until the launching process closes `control`."""
    jobs: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (guard pid, its job socket)
    while True:
        ready, _, _ = select.select([control, *jobs], [], [])
        for fd in ready:
            if fd is control:
                if not _take_request(control, jobs):
                    return
                continue
            pid, job = jobs.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            with job:
                _send(job, {"status": os.waitstatus_to_exitcode(status)})


def _take_request(control: socket.socket, jobs: dict[int, tuple[int, socket.socket]]) -> bool:
    fds = array.array("i")
    message, ancillary, _, _ = control.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(2 * fds.itemsize))
    if not message:
        return False  # the launching process is gone
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    out_fd, job_fd = fds
    job = socket.socket(fileno=job_fd)
    pid = os.fork()
    if pid == 0:
        job.detach()
        _become_job(json.loads(message), out_fd,
                    [control.fileno(), job_fd, *jobs, *(s.fileno() for _, s in jobs.values())])
    os.close(out_fd)
    jobs[os.pidfd_open(pid)] = (pid, job)
    _send(job, {"pid": pid})
    return True


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the launching process stopped listening (it ended)


def _server_main(fd: int, with_mlflow: bool) -> int:
    control = socket.socket(fileno=fd)
    try:
        # the jobs' titles (`_show_as`); only the server needs it (a GPU machine's payload may go
        # without it)
        import setproctitle

        # it finds our command line's memory through the environment block as the process
        # started with it: now, before a job's environment replaces ours
        with _short_name_kept():
            setproctitle.getproctitle()
    except ImportError:
        pass
    before = dict(os.environ)
    try:
        missing = import_warm_modules(with_mlflow)
    except BaseException as e:  # noqa: BLE001 - the launcher falls back to cold starts
        _send(control, {"error": f"{type(e).__name__}: {e}"})
        return 1
    if started := _threads_started():
        _send(control, {"error": f"its imports started threads ({started}), and a process must not fork with "
                                 f"threads of its own (drop their modules from {WARM_MODULES_VARIABLE})"})
        return 1
    # what the imports set (DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK, scikit-learn's
    # KMP_DUPLICATE_LIB_OK): the launching process's own imports set them too, later
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _send(control, {"ready": os.getpid(), "missing": missing, "set_by_imports": set_by_imports})
    serve(control)
    return 0


if __name__ == "__main__":
    sys.exit(_server_main(int(sys.argv[1]), "--with-mlflow" in sys.argv[2:]))

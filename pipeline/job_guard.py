"""`python -m pipeline.job_guard PARENT_PID -- CMD ...`: runs CMD and takes its whole process group down
when the process that started the guard dies, kill -9 included.

Stage jobs run in their own session (a Ctrl-C in the terminal must reach the orchestrator,
which stops them in order, not the jobs directly), so nothing kills them with their
orchestrator. A parent-death signal alone (Linux `prctl(PR_SET_PDEATHSIG)` in the job) is not
enough: it is not inherited, and a distributed job is a launcher whose ranks are grandchildren
that would train on unobserved. So the orchestrator starts this guard as the leader of the
job's new process group; the guard gets a parent-death signal (Linux) and also polls its
parent id (any POSIX), and when the orchestrator is gone it sends SIGTERM to the group, waits
a few seconds, then SIGKILLs it (every rank, launcher and itself).

Stopping a job on purpose is the orchestrator's business: it signals the whole group, and the
guard itself only waits for CMD and exits with its status (128 + N for signal N). The warm job
server (pipeline.job_server) runs the same loop (`guard`) in the process it forks for a CPU
job, over the job forked once more, whose parent it watches instead of the orchestrator (the
server ends with the orchestrator).

`python -m pipeline.job_guard --exec PARENT_PID -- CMD ...` is the variant without a guard
process: it asks for SIGKILL on its parent's death and *becomes* CMD (exec; the request
survives it). A Ray worker (pipeline/ray_worker.py) starts its rank so: when Ray ends an actor
it SIGKILLs the actor's direct children too, which would kill a guard and leave the rank under
it running; a rank that is itself the direct child dies with the actor either way.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable, Protocol

_PR_SET_PDEATHSIG = 1
_ORPHAN_SIGNAL = signal.SIGUSR1
_POLL_S = 0.5
_GRACE_S = 5.0


def _ask_for_parent_death_signal(sig: int = _ORPHAN_SIGNAL) -> bool:
    if sys.platform.startswith("linux"):
        try:
            return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0
        except (OSError, AttributeError):
            pass  # the getppid poll still notices, within _POLL_S
    return False


def exec_with_parent(parent: int, command: list[str]) -> int:
    """Become `command`, to be SIGKILLed when `parent` dies (Linux); exit 1 at once if it already has."""
    if not _ask_for_parent_death_signal(signal.SIGKILL):
        print("job_guard --exec: no parent-death signal on this platform (Linux only)", file=sys.stderr)
        return 2
    if os.getppid() != parent:
        return 1
    os.execvp(command[0], command)
    return 1  # not reached


def _take_group_down(child: Child) -> None:
    group = os.getpgid(0)
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        child.wait(timeout=_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(group, signal.SIGKILL)  # ranks outliving the launcher, and this guard


class Child(Protocol):
    """What the guard waits for: a `subprocess.Popen`, or a job forked in this process
    (pipeline.job_server)."""

    def wait(self, timeout: float | None = None) -> int: ...


def guard(parent: int, start: Callable[[], Child]) -> int:
    """Start the job (`start`) in this process's group and wait for it; take the group down if
    `parent` (the process that asked for the job) is gone. The job's exit status, 128 + N for
    signal N."""
    orphaned = False

    def on_orphan(_signum, _frame) -> None:
        nonlocal orphaned
        orphaned = True

    signal.signal(_ORPHAN_SIGNAL, on_orphan)
    # The orchestrator signals the whole group to stop a job: the guard outlives it to report
    # its status. Python-level handlers (not SIG_IGN): an exec'd command starts with the
    # defaults, and a forked one restores them (job_server.run_module_as_main).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    _ask_for_parent_death_signal()
    child = start()
    while True:
        if orphaned or os.getppid() != parent:  # reparented: the orchestrator is gone
            _take_group_down(child)
        try:
            rc = child.wait(timeout=_POLL_S)
            break
        except subprocess.TimeoutExpired:
            continue
    return rc if rc >= 0 else 128 - rc


def main(argv: list[str]) -> int:
    if argv[:1] == ["--exec"] and len(argv) >= 4 and argv[1].isdigit() and argv[2] == "--":
        return exec_with_parent(int(argv[1]), argv[3:])
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -m pipeline.job_guard [--exec] PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # the orchestrator's pid as it passed it: a parent that died before we could ask for the
    # parent-death signal is noticed too (getppid would already name the new parent)
    return guard(int(argv[0]), lambda: subprocess.Popen(argv[2:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

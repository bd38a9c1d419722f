"""The rank processes of a stage run that a benchmark started (found by their $RANK below the
run's root process): for killing one (fault runs) and for asking a hung run's ranks for their
Python stacks (stages.common.entry: SIGUSR2) before it is killed."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def ranks_of(root_pid: int, module: str) -> dict[str, "psutil.Process"]:
    """The ranks of `module` below `root_pid`, by their $RANK (torchrun sets it in each worker;
    the guard's and the launcher's command lines name the module too, but carry no RANK)."""
    import psutil

    found = {}
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            rank = p.environ().get("RANK")
            if rank is not None and module in " ".join(p.cmdline()):
                found[rank] = p
        except psutil.Error:
            continue
    return found


def dump_rank_stacks(root_pid: int, module: str) -> int:
    """Ask every rank of `module` below `root_pid` for its Python stacks (stages.common.entry:
    SIGUSR2 prints them to the stage log; it would end the guard or the launcher, so ranks
    only); returns how many were asked. A hung run's log then says where each rank waits."""
    import psutil

    from stages.common.entry import STACKS_SIGNAL

    asked = 0
    for p in ranks_of(root_pid, module).values():
        try:
            p.send_signal(STACKS_SIGNAL)
            asked += 1
        except psutil.Error:
            continue
    if asked:
        time.sleep(3)  # faulthandler writes from a signal handler: give it, and the log pipes, a moment
    return asked


def rank_process(root_pid: int, module: str, rank: int):
    """The process of `module` with $RANK = rank below `root_pid` (waits for it up to 60 s)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        found = ranks_of(root_pid, module).get(str(rank))
        if found is not None:
            return found
        time.sleep(0.2)
    raise RuntimeError(f"no process of {module} with RANK={rank} under pid {root_pid}")

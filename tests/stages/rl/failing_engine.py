"""A rollout engine that fails to start on one rank, as vLLM's did on a GPU (round 17, RESULTS.md
"Issue 32"): its constructor raised vLLM's own error ("Engine core initialization failed ...")
on the generating rank, and the stage sat in its collectives for minutes instead of failing.

`rollout.engine: _test_fails_to_start` with `rollout.options`:
    fail_ranks  the global ranks ($RANK) whose engine fails; every other engine rank gets the torch engine
    leave       what the failed start leaves behind, as vLLM's partial start can:
                "thread": a non-daemon thread that never ends (a Python exit waits for it);
                "child": a non-daemon multiprocessing child that never ends (multiprocessing's
                exit handler joins it: vLLM's engine core process is one, since a daemonic
                process may not start its workers)
    trace_dir   where a failing rank R writes `failed_at.R` (time.time() as it raises) and its
                child `child.R.pid` (the test checks that nothing outlives the stage)

A stage's ranks import this module through a `sitecustomize.py` the test puts first on
PYTHONPATH (Python's own start-up hook: the product has no test hook).
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

from stages.rl.engines import create_engine, register_engine

NAME = "_test_fails_to_start"
# vLLM 0.26's error out of AsyncLLM.from_engine_args when its engine core dies while starting
MESSAGE = "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}"
FOREVER_S = 3600.0


def _write_pid_and_wait(pid_file: Path) -> None:
    pid_file.write_text(str(os.getpid()))
    time.sleep(FOREVER_S)


@register_engine(NAME)
def fails_to_start(model_dir: str, *, fail_ranks: list[int], trace_dir: str, leave: tuple[str, ...] = (),
                   tensor_parallel_size: int = 1, **engine_kwargs):
    rank = int(os.environ["RANK"])
    if rank not in fail_ranks:
        return create_engine("torch", model_dir, **engine_kwargs)
    trace = Path(trace_dir)
    pid_file = trace / f"child.{rank}.pid"
    if "child" in leave:
        # fork: the child only sleeps, and a spawned one would import the stage's whole entry first
        child = multiprocessing.get_context("fork").Process(target=_write_pid_and_wait, args=(pid_file,),
                                                            name="EngineCore_DP0", daemon=False)
        child.start()
        deadline = time.monotonic() + 30
        while not Path(pid_file).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    if "thread" in leave:
        threading.Thread(target=time.sleep, args=(FOREVER_S,), name="engine-core-monitor", daemon=False).start()
    (trace / f"failed_at.{rank}").write_text(repr(time.time()))
    raise RuntimeError(MESSAGE)

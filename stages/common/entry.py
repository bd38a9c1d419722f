"""How every stage job runs (the stage contract): `stages/<kind>/job.py` ends with

    if __name__ == "__main__":
        sys.exit(run_job(main))

`run_job` reads the job file, calls `main(job)`, and turns the outcome into the exit status:
0 when `main` returns; 2 when it raises `StageError` (a problem the user can fix), printed
once, by rank 0, without a traceback; anything else is a bug and propagates with its
traceback (exit 1). The process group, when `main` joined one, is always left.

`kill -USR2 <pid of a rank>` prints every thread's Python stack of that rank to the stage log
and the rank goes on: where a hung rank waits (a collective, a lock, a queue). Send it to the
rank processes, not the job's process group: the launcher and the job guard do not catch it.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
from typing import Any, Callable

from pipeline.stage_api import StageError, StageJob
from pipeline.tracking import StageLogger


STACKS_SIGNAL = signal.SIGUSR2  # SIGUSR1 is the job guard's parent-death signal


def run_job(main: Callable[[StageJob], Any], argv: list[str] | None = None) -> int:
    job = StageJob.from_argv(argv)
    faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)  # the process's own fd 2
    if not StageLogger.talks_to_mlflow(job.tracking_uri, job.run_id, job.rank):
        # DeepSpeed imports mlflow as it is imported (its autotuner's optional logging):
        # ~4 s of mlflow, pandas & co. in a rank that never logs to MLflow. Marked absent,
        # `import mlflow` fails at once and DeepSpeed goes on without it.
        sys.modules.setdefault("mlflow", None)
    try:
        main(job)
        group = _process_group()
        if group is not None:
            # every rank done (rank 0 may still be writing the model) before the group goes:
            # a rank tearing down early aborted its peer's in-flight gloo/shm traffic
            group.barrier()
    except StageError as e:
        if job.rank == 0:
            print(f"{job.stage} ({job.kind}) failed: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        group = _process_group()
        if group is not None:
            group.destroy_process_group()
    return 0


def _process_group():
    """torch.distributed when this process joined a group (data stages never import torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None

"""The `main` of a DeepSpeed stage job: run `train(job)`, turn a user error into one message on
rank 0 and exit status 2, and always leave the process group."""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch.distributed as dist

from pipeline.stage_api import StageJob


def run_job(train: Callable[[StageJob], Any], name: str, user_errors: tuple[type[Exception], ...],
            argv: list[str] | None = None) -> int:
    """0 when `train` returns; 2 with "`name` failed: <message>" printed by rank 0 when it
    raises one of `user_errors` (anything else propagates with its traceback)."""
    job = StageJob.from_argv(argv)
    try:
        train(job)
        if dist.is_initialized():
            # every rank done (rank 0 may still be writing the model) before the group goes:
            # a rank tearing down early aborted its peer's in-flight gloo/shm traffic
            dist.barrier()
    except user_errors as e:
        if job.rank == 0:
            print(f"{name} failed: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0

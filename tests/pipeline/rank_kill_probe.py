"""A stand-in stage job for pipeline.local_ranks: 2 gloo ranks; `config.die` says how rank 1
ends while rank 0 waits for it in an all-reduce: "kill" (SIGKILL to itself: it prints
nothing), "user_error" (a StageError), or nothing (both finish). Run through
`stages.common.entry.run_job`, as stage jobs are."""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

from stages.common.contract import StageConfig, StageError
from stages.common.entry import run_job
from stages.common.groups import collective_timeout


class ProbeConfig(StageConfig):
    die: str = ""


def main(job, cfg: ProbeConfig) -> None:
    dist.init_process_group("gloo", timeout=collective_timeout())
    if job.rank == 1 and cfg.die == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if job.rank == 1 and cfg.die == "user_error":
        raise StageError("the probe's shard 3 is missing")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"probe rank {job.rank} of {dist.get_world_size()}: total {total.item():.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(run_job(main, ProbeConfig))

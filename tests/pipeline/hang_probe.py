"""A stand-in stage job for the progress deadline: 2 gloo ranks, rank 1 stalls outside any
collective while rank 0 waits for it in an all-reduce (the hang of a rank that never reaches
a collective). Run through `stages.common.entry.run_job`, as stage jobs are, so SIGUSR2 dumps
its stacks the way a real stage's would."""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from stages.common.contract import StageConfig
from stages.common.entry import run_job
from stages.common.groups import collective_timeout
from stages.common.stage_log import StageLogger


def stall_forever() -> None:
    while True:
        time.sleep(0.2)


def main(job, cfg: StageConfig) -> None:
    dist.init_process_group("gloo", timeout=collective_timeout())
    log = StageLogger(None, None, job.rank)
    log.progress(0, total=3)
    if job.rank == 1:
        time.sleep(2)  # after rank 0's progress line: this is the job's last line
        print("rank 1: loading a shard that never arrives", flush=True)
        stall_forever()
    total = torch.ones(1)
    dist.all_reduce(total)


if __name__ == "__main__":
    sys.exit(run_job(main, StageConfig))

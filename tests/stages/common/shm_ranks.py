"""Run as two processes (test_distributed_shm.py starts them as DeepSpeed's launcher would, with
LOCAL_SIZE set): join with `init_distributed`, all-reduce through DeepSpeed's shared-memory
kernel, and report which of this launch's workspaces are still named in /dev/shm, and the file
DeepSpeed loaded that kernel from."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def main() -> None:
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist

    from stages.common.distributed import init_distributed

    ranks = init_distributed()
    t = torch.full((8,), float(ranks.rank + 1))
    ds_comm.inference_all_reduce(t)  # the shm kernel, through the (unlinked) mapped workspaces
    port = os.environ["MASTER_PORT"]
    named = sorted(p for p in os.listdir("/dev/shm") if p.startswith("deepspeed_allreduce_buffer_")
                   and f"_{port}_" in p)
    shm_op = getattr(ds_comm.comm.cdb, "shm_comm_op", None)  # None: this checks nothing
    print(json.dumps({"rank": ranks.rank, "sum": t.tolist(), "named": named,
                      "shm_op": shm_op and shm_op.__file__}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()

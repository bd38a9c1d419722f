"""A stand-in stage job for launcher tests: joins the process group (gloo) the way stage jobs
do, checks it with an all-reduce, and writes what each rank saw next to the job file.
`--fail-node N` makes node N's ranks exit 1 before joining."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--fail-node", type=int, default=None)
    args = parser.parse_args()
    node = int(os.environ["GROUP_RANK"])
    if args.fail_node == node:
        print(f"probe: node {node} fails on purpose", flush=True)
        return 1
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    Path(f"{args.job}.rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world": world, "node": node, "local_rank": int(os.environ["LOCAL_RANK"]),
         "sum": int(total.item())}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m tests.stages.rl.dp_world RANK_FUNCTION WORLD PORT MODEL_DIR OUT EXTRA_JSON`: a
gloo world of the data-parallel tests (test_data_parallel.py), each rank running
`dp_workers.RANK_FUNCTION(rank, WORLD, PORT, MODEL_DIR, OUT, EXTRA)`.

The ranks are forked from this process once it has imported what they run (torch, DeepSpeed,
transformers' model code, the RL stage's modules), as pipeline.local_ranks forks a stage's CPU
ranks: spawned as fresh processes, each rank paid those imports again (~11 CPU-s a rank on a
2-core machine). This process starts no thread of its own before the fork.
"""
from __future__ import annotations

import json
import sys

# the ranks never log to MLflow: skip DeepSpeed's ~4 s import of it, as stage ranks do
# (stages/common/entry.py)
sys.modules.setdefault("mlflow", None)

import deepspeed  # noqa: E402,F401  imported once, here, for every rank
import torch.multiprocessing as mp  # noqa: E402

import stages.common.deepspeed_setup  # noqa: E402,F401
import stages.common.distributed  # noqa: E402,F401
import stages.common.hf_io  # noqa: E402,F401
import stages.rl.engines  # noqa: E402,F401
import stages.rl.scheduler  # noqa: E402,F401
import stages.rl.weight_sync  # noqa: E402,F401
from tests.stages.rl import dp_workers  # noqa: E402


def main(argv: list[str]) -> None:
    function, world, port, model_dir, out, extra = argv
    # a rank that fails raises its exception here, with its traceback (torch's ProcessRaisedException)
    mp.start_processes(getattr(dp_workers, function), args=(int(world), int(port), model_dir, out, json.loads(extra)),
                       nprocs=int(world), start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1:])

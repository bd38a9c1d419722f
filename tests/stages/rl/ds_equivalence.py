"""Run as a script (a process of its own: DeepSpeed sets up a process group): the
DeepSpeed backend's update equals the plain-torch one, per ZeRO stage, with a step split
into several micro-batches and two optimizer updates. Prints one JSON line per stage."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def main(stages: list[int]) -> None:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0"})  # a world of one: its store binds a port of its own
    # this process never logs to MLflow: skip DeepSpeed's ~4 s import of it, as stage ranks do
    # (stages/common/entry.py)
    sys.modules.setdefault("mlflow", None)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from stages.reasoning_rl.config import ReasoningRLConfig
    from stages.rl.learner import Learner, LearnerConfig, PolicyHead, TorchBackend
    from stages.rl.loss import LossConfig
    from stages.rl.policy import DeepSpeedBackend, policy_ds_config
    from tests.stages.rl.test_learner import batch_samples, naive_logprobs, tiny_lm

    base = tiny_lm(seed=3)
    samples = batch_samples()
    with torch.no_grad():
        for s in samples:
            s.infer_logprobs = (naive_logprobs(base, s, 1.0) + 0.05).tolist()
    lc = LearnerConfig(loss=LossConfig(), pad_id=0, micro_batch_tokens=20, updates_per_batch=2)

    ref = copy.deepcopy(base)
    ref_stats = Learner(TorchBackend(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01), 1.0),
                        lc).train(samples, 0)
    for stage in stages:
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        cfg = ReasoningRLConfig.model_validate({"kind": "reasoning_rl", "model": "m", "data": "d", "steps": 1,
                                                "zero_stage": stage, "grad_clip": 1.0})
        eng, *_ = deepspeed.initialize(model=PolicyHead(m), optimizer=opt, config=policy_ds_config(cfg, False))
        stats = Learner(DeepSpeedBackend(eng, torch.device("cpu")), lc).train(samples, 0)
        with deepspeed.zero.GatheredParameters(list(m.parameters()), enabled=stage == 3):
            diff = max(float((a - b).abs().max()) for a, b in zip(m.parameters(), ref.parameters()))
        moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), base.parameters()))
        print(json.dumps({"stage": stage, "max_param_diff": diff, "moved": moved,
                          "grad_norm": stats["grad_norm"], "ref_grad_norm": ref_stats["grad_norm"],
                          "loss": stats["loss"], "ref_loss": ref_stats["loss"]}), flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]])

"""Run as two processes (RANK 0 and 1; test_policy.py starts them): the learner under
DeepSpeed ZeRO-3 on 2 gloo ranks whose micro batches hold very different numbers of response
tokens, with a head big enough to be partitioned (every call of it gathers the weight: a
collective). Each rank prints one JSON line with the step's reduced stats."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def main() -> None:
    # this process never logs to MLflow: skip DeepSpeed's ~4 s import of it, as stage ranks do
    # (stages/common/entry.py)
    sys.modules.setdefault("mlflow", None)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from stages.common.entry import end_succeeded_process
    from stages.reasoning_rl.config import ReasoningRLConfig
    from stages.rl.learner import Learner, LearnerConfig, PolicyHead
    from stages.rl.loss import LossConfig
    from stages.rl.policy import DeepSpeedBackend, policy_ds_config
    from tests.stages.rl.test_learner import sample, tiny_lm

    # vocab 4096 x hidden 32 = 131k elements: above ZeRO-3's persistence threshold, so the tied
    # embedding / head is partitioned and every head call all-gathers it
    model = tiny_lm(seed=3, vocab=4096)
    g = torch.Generator().manual_seed(0)
    # one long response and many short ones: the ranks' micro batches get 1 vs many chunks
    samples = [sample(torch.randint(2, 64, (3,), generator=g).tolist(),
                      torch.randint(2, 64, (n,), generator=g).tolist(), adv=(-1.0) ** i)
               for i, n in enumerate([40, 3, 2, 3, 2, 3])]
    for s in samples:
        s.infer_logprobs = [-8.3] * len(s.response_ids)  # ~ log(1/4096): ratios near 1, inside IcePop's band
    lc = LearnerConfig(loss=LossConfig(), pad_id=0, micro_batch_tokens=64, logit_chunk=4)
    cfg = ReasoningRLConfig.model_validate({"kind": "reasoning_rl", "model": "m", "data": "d", "steps": 1,
                                            "zero_stage": 3, "grad_clip": 1.0})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng, *_ = deepspeed.initialize(model=PolicyHead(model), optimizer=opt, config=policy_ds_config(cfg, "fp32"))
    stats = Learner(DeepSpeedBackend(eng, torch.device("cpu")), lc).train(samples, 0)
    print(json.dumps({"rank": int(os.environ["RANK"]), "loss": stats["loss"], "grad_norm": stats["grad_norm"],
                      "abs_log_k_mean": stats["abs_log_k_mean"]}), flush=True)
    # leave as a stage rank does (stages/common/entry.py): both ranks done, the group left, then
    # the process ends without the interpreter's finalization, where a gloo worker still freeing
    # an all-gather's tensors could abort the rank ("terminate called", SIGABRT; ~2 in 110 runs)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_succeeded_process()


if __name__ == "__main__":
    main()

"""How far a rollout engine's pi_infer is from the trainer's pi_train at the same weights:
the training-inference mismatch that IcePop corrects (paper Eq. 1-3).

`measure_agreement` decodes requests with the engine, then scores the same prompt + response
tokens with the learner's own forward (`micro_batches.collate` + `PolicyHead`, train mode with
dropout off, exactly as the learner computes log-probs of theta_old) and returns both
per-token log-probs and the learner's mismatch statistics (|log k| mean / max, the share of
tokens outside IcePop's [alpha, beta], the k3 KL; for a MoE model whose engine records routes,
how often the trainer's experts differ from the engine's: routing.py). In fp32 on CPU the two are the same
function computed along two code paths and agree to rounding; in bf16 on a GPU they differ
(tests/stages/rl/test_engine_agreement.py, benchmarks/gpu_moe_mismatch.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from stages.rl.engines.protocol import RolloutEngine, RolloutRequest, RolloutUpdate, SamplingParams
from stages.rl.engines.routes import encode_routes
from stages.rl.learner import PolicyHead
from stages.rl.loss import LossConfig, MismatchStats
from stages.rl.micro_batches import collate
from stages.rl.routing import RouterReplay, moe_routers, routing_metrics


@dataclass
class _Scored:
    """What `micro_batches.collate` reads of a rollout."""

    prompt_ids: list[int]
    response_ids: list[int]
    infer_logprobs: list[float]
    advantage: float = 0.0
    versions: list[int] = field(default_factory=list)
    routes: dict | None = None  # engines/routes.py form

    def token_versions(self) -> list[int]:
        return self.versions or [0] * len(self.response_ids)


@dataclass
class Agreement:
    updates: list[RolloutUpdate]
    engine_logprobs: list[list[float]]
    trainer_logprobs: list[list[float]]
    stats: dict[str, float]   # MismatchStats.finalize(): abs_log_k_mean / _max / quantiles, masked_fraction, ...
    # (+ expert_disagreement / expert_miss_fraction of a MoE model whose engine records routes)


def measure_agreement(engine: RolloutEngine, model: torch.nn.Module, requests: list[RolloutRequest],
                      sampling: SamplingParams, pad_id: int, device: torch.device | str,
                      loss: LossConfig = LossConfig(), micro_batch: int = 16) -> Agreement:
    """Decode `requests` with `engine`, score the results with `model` (the trainer's copy of
    the same weights, on `device`). Responses with no token are left out of the comparison."""
    updates = engine.generate(requests, sampling)
    scored = [_Scored(r.prompt_ids + r.generated_ids, u.token_ids, u.logprobs,
                      routes=encode_routes(u.routes) if u.routes is not None else None)
              for r, u in zip(requests, updates) if u.token_ids]
    head = PolicyHead(model)
    head.train()
    routing = RouterReplay(model, replay=False) if moe_routers(model) else None
    stats = MismatchStats()
    trainer: list[list[float]] = []
    temperature = sampling.temperature or 1.0  # greedy decoding reports log-probs at T = 1
    try:
        with torch.no_grad():
            for s in range(0, len(scored), micro_batch):
                part = scored[s:s + micro_batch]
                mb = collate(part, 0, pad_id, torch.device(device))
                with routing.using(mb.routes, measure=True) if routing is not None else nullcontext():
                    lp, _ = head(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, temperature, 4096)
                stats.add(lp.float(), mb.infer_logp, mb.mask, loss)
                trainer += [lp[b, :len(x.response_ids)].float().tolist() for b, x in enumerate(part)]
    finally:  # the caller's model keeps no hook of ours
        if routing is not None:
            routing.remove()
    routed = routing_metrics(routing.counts) if routing is not None else {}
    return Agreement(updates, [x.infer_logprobs for x in scored], trainer, {**stats.finalize(), **routed})

"""MoE routing in the learner: the rollout engine's expert choices measured against the
trainer's, and replayed in the trainer ("routing replay", R3).

In an MoE policy the train-inference mismatch has a discrete part: the trainer's forward and
the engine's (another code path, another dtype, FP8 weights) can put a token's hidden state
on different sides of a router's top-k boundary, and then a whole expert's output changes.
The torch engine records, for every position it fed through the model, the experts each MoE
layer chose (`RolloutUpdate.routes`, torch_engine/route_log.py); the rollout carries them
(scheduler.py, also across C3PO++ carry-over and checkpoints) and the learner gets them per
micro batch (`micro_batches.collate`: `MicroBatch.routes` [B, T, moe layers, k], -1 where none was
recorded: pads, and a response's last token, which no forward ever reads).

`RouterReplay` puts a forward hook on every MoE router of the policy (blocks found by
structure: `torch_engine.moe.is_moe_block`). While a micro batch's routes are set:
- `measure` (the theta_old pass): counts the (token, layer) routings where the trainer's own
  top-k set differs from the engine's, and the chosen experts the engine did not choose: the
  step metrics `expert_disagreement` and `expert_miss_fraction`, reported in every RL run of
  a MoE policy whose engine records routes;
- `replay` (`routing_replay: true`): the router's output is replaced by the engine's experts
  wherever they were recorded, weighted by the trainer's own scores of those experts (so the
  router still gets its gradient through the weights: what verl / slime's R3 do). A router
  type needs its weighting rule in `REPLAY_WEIGHTS`; others are refused at set-up.

Carry-over: a rollout continued after a weight update is re-encoded by the engine (its prefix
prefilled with the new weights), so its routes are those of its latest encoding; the tokens
sampled before the update were conditioned on the older routing. The theta_old pass runs the
latest weights, so the latest encoding is the one closest to it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from stages.rl.engines.torch_engine.moe import is_moe_block

ROUTING_KEYS = ("routed", "routing_differs", "experts_chosen", "experts_missed")


def _sigmoid_topk_weights(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """ring_moe (Ling 2.0 / DeepSeek-V3): unbiased sigmoid scores of the chosen experts,
    normalised over them (norm_topk_prob), times routed_scaling_factor."""
    weights = torch.sigmoid(logits.float()).gather(-1, index)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# router class name -> its weights of given experts (logits [n, E], index [n, k]) -> [n, k]
REPLAY_WEIGHTS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "RingMoeRouter": _sigmoid_topk_weights,
}


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`'s MoE blocks, in layer order (the engine records them so)."""
    return [m.gate for m in model.modules() if is_moe_block(m)]


class RouterReplay:
    """Hooks on `model`'s routers (module docstring). `replay`: route with the recorded experts."""

    def __init__(self, model: nn.Module, replay: bool):
        self.routers = moe_routers(model)
        if replay:
            if not self.routers:
                raise ValueError("routing_replay: true needs a Mixture-of-Experts policy, and this one has no "
                                 "MoE block (a `gate` router + fused `experts`)")
            bad = sorted({type(r).__name__ for r in self.routers} - set(REPLAY_WEIGHTS))
            if bad:
                raise ValueError(f"routing_replay: true: no replay rule for the router type(s) {bad}; "
                                 f"replayable: {sorted(REPLAY_WEIGHTS)}")
        self.replay = replay
        self.counts = dict.fromkeys(ROUTING_KEYS, 0.0)
        self._routes: torch.Tensor | None = None
        self._measure = False
        self._handles = [r.register_forward_hook(self._hook_for(j)) for j, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def using(self, routes: torch.Tensor | None, measure: bool) -> Iterator[None]:
        """Within: the routers see `routes` ([B, T, layers, k], the micro batch's token rows in
        the order the model flattens them); keep it open over the backward pass too (gradient
        checkpointing recomputes the routers there)."""
        if routes is not None and routes.shape[2] != self.layers:
            raise ValueError(f"the rollout's routes cover {routes.shape[2]} MoE layers, the policy has "
                             f"{self.layers}: the engine ran another model")
        self._routes = None if routes is None else routes.reshape(-1, routes.shape[2], routes.shape[3])
        self._measure = measure
        try:
            yield
        finally:
            self._routes, self._measure = None, False

    def take_counts(self) -> dict[str, float]:
        out, self.counts = self.counts, dict.fromkeys(ROUTING_KEYS, 0.0)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook_for(self, layer: int):
        def hook(module: nn.Module, args, output):
            if self._routes is None:
                return None
            return self._route(layer, module, output)
        return hook

    def _route(self, layer: int, router: nn.Module, output):
        logits, weights, index = output
        recorded = self._routes[:, layer].to(index.device)
        if recorded.shape != index.shape:
            raise ValueError(f"MoE layer {layer}: the rollout recorded {tuple(recorded.shape)} routes, the "
                             f"router chose {tuple(index.shape)} (token rows x top-k)")
        known = (recorded >= 0).all(dim=-1)
        if self._measure:
            self._count(recorded[known], index[known])
        if not self.replay:
            return None
        chosen = torch.where(known[:, None], recorded.long(), index)
        new_weights = REPLAY_WEIGHTS[type(router).__name__](router, logits, chosen)
        return logits, new_weights.to(weights.dtype), chosen

    @torch.no_grad()
    def _count(self, engine: torch.Tensor, trainer: torch.Tensor) -> None:
        if not engine.numel():
            return
        same = engine.long()[:, :, None] == trainer[:, None, :]   # [n, k, k]
        missed = (~same.any(dim=1)).sum(dim=-1)                    # trainer's experts the engine did not pick
        c = self.counts
        c["routed"] += float(engine.shape[0])
        c["routing_differs"] += float((missed > 0).sum())
        c["experts_chosen"] += float(trainer.numel())
        c["experts_missed"] += float(missed.sum())


def routing_metrics(counts: dict[str, float]) -> dict[str, float]:
    """The step metrics of summed counts (none when no routes were compared)."""
    if counts.get("routed", 0) <= 0:
        return {}
    return {"expert_disagreement": counts["routing_differs"] / counts["routed"],
            "expert_miss_fraction": counts["experts_missed"] / max(counts["experts_chosen"], 1.0)}

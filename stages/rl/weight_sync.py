"""How the trained weights reach the rollout engines, after every update and on resume.

One implementation today, `GatherToRank0`: rank 0 holds the only engine; the policy's
parameters are streamed into it by name (`RolloutEngine.update_weights`), under ZeRO-3 one
gathered parameter at a time (every rank joins each gather; only rank 0 keeps the tensor).
Data-parallel rollouts (an engine on every rank) plug in here with another `WeightSync`
(e.g. rank 0 gathers and NCCL-broadcasts each tensor to every rank's engine): the trainer
only calls `push()`.
"""
from __future__ import annotations

import time
from typing import Iterator, Protocol

import torch

from stages.rl.engines.protocol import RolloutEngine


class WeightSync(Protocol):
    def push(self) -> float:
        """Every rank calls it; the engines hold the policy's current weights when it returns.
        Returns the wall time (seconds)."""
        ...


class GatherToRank0:
    def __init__(self, module: torch.nn.Module, engine: RolloutEngine | None, rank: int, zero3: bool):
        self.module, self.engine, self.rank, self.zero3 = module, engine, rank, zero3

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        import deepspeed

        for name, p in self.module.named_parameters():
            if self.zero3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    if self.rank == 0:
                        yield name, p.data.detach().clone()
            else:
                yield name, p.detach()

    def push(self) -> float:
        t0 = time.perf_counter()
        if self.rank == 0:
            self.engine.update_weights(self._named())
        elif self.zero3:
            for _ in self._named():
                pass
        return time.perf_counter() - t0

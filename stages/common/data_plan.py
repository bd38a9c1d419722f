"""Which items (packs, pairs) each rank trains on at each step: a deterministic plan from the
seed, the same number of items on every rank."""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass


@functools.lru_cache(maxsize=2)
def _epoch_order(n_packs: int, seed: int, epoch: int, total: int) -> tuple[int, ...]:
    perm = list(range(n_packs))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return tuple((perm * math.ceil(total / n_packs))[:total])


@dataclass(frozen=True)
class DataPlan:
    """Which packs each rank sees at each step: a deterministic function of the seed.

    Each epoch the packs are permuted (seed, epoch) and the order is extended by
    wrapping around to a multiple of world * micro_batch * grad_accum, so every rank
    gets the same number of packs per step (DistributedSampler-style padding). Rank r
    takes order[r::world]; step k of an epoch is its micro batches k*ga .. (k+1)*ga-1.
    """

    n_packs: int
    world: int
    micro_batch: int
    grad_accum: int
    seed: int

    @property
    def packs_per_step(self) -> int:
        return self.world * self.micro_batch * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_packs / self.packs_per_step)

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        return _epoch_order(self.n_packs, self.seed, epoch, self.steps_per_epoch * self.packs_per_step)

    def position(self, epoch: int, step_in_epoch: int) -> tuple[int, int]:
        """(epoch, step in it) of the step counted as `step_in_epoch` of `epoch`: past an
        epoch's last step, the first step of the next epoch."""
        return (epoch + 1, 0) if step_in_epoch >= self.steps_per_epoch else (epoch, step_in_epoch)

    def step_micro_batches(self, epoch: int, step_in_epoch: int, rank: int) -> list[list[int]]:
        mine = self.epoch_order(epoch)[rank::self.world]
        per_step = self.micro_batch * self.grad_accum
        chunk = list(mine[step_in_epoch * per_step:(step_in_epoch + 1) * per_step])
        return [chunk[j:j + self.micro_batch] for j in range(0, per_step, self.micro_batch)]

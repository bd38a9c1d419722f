"""Which packs / pairs each rank trains on at each step (stages/common/data_plan.py)."""
from __future__ import annotations

import math

from stages.common.data_plan import DataPlan


def test_data_plan_gives_every_rank_the_same_number_of_packs_and_covers_all():
    plan = DataPlan(n_packs=37, world=2, micro_batch=2, grad_accum=3, seed=1)
    assert plan.steps_per_epoch == math.ceil(37 / 12) == 4
    for epoch in range(2):
        seen = []
        for step in range(plan.steps_per_epoch):
            per_rank = [plan.step_micro_batches(epoch, step, r) for r in range(2)]
            for mbs in per_rank:
                assert len(mbs) == 3 and all(len(mb) == 2 for mb in mbs)
            seen += [i for mbs in per_rank for mb in mbs for i in mb]
        assert set(seen) == set(range(37)) and len(seen) == 48  # padded by wrapping around
    assert plan.epoch_order(0) != plan.epoch_order(1)
    assert DataPlan(37, 2, 2, 3, seed=1).epoch_order(0) == plan.epoch_order(0)

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


def test_past_an_epochs_last_step_comes_the_next_epochs_first():
    plan = DataPlan(n_packs=10, world=1, micro_batch=2, grad_accum=2, seed=0)  # 3 steps an epoch
    assert plan.position(0, 2) == (0, 2)
    assert plan.position(0, 3) == (1, 0)
    assert plan.position(4, 0) == (4, 0)


def test_each_step_is_told_the_next_steps_micro_batches_across_epochs_and_after_a_resume():
    """The supervised trainer hands each step the micro batches of the step it runs next (what a
    task prepares while the GPU works), None with the last; after a resume as well."""
    from types import SimpleNamespace

    from stages.common.supervised_trainer import TrainingProgress, _train

    plan = DataPlan(n_packs=10, world=1, micro_batch=2, grad_accum=2, seed=0)

    def run_from(progress, total_steps=7):
        calls = []
        task = SimpleNamespace(
            name="t", progress=progress,
            train_step=lambda run, micro, upcoming: calls.append((micro, upcoming)),
            report=lambda run, trained, lr, s: SimpleNamespace(metrics={}, line="", log_now=False))
        run = SimpleNamespace(
            cfg=SimpleNamespace(log_every=10 ** 6, checkpoint_every=10 ** 6), plan=plan, total_steps=total_steps,
            engine=SimpleNamespace(train=lambda: None), scheduler=SimpleNamespace(get_last_lr=lambda: [0.1]),
            setup=SimpleNamespace(ranks=SimpleNamespace(rank=0), log=SimpleNamespace(metrics=lambda *a: None)))
        _train(run, task, ckpt=None)
        return calls

    calls = run_from(TrainingProgress())
    assert len(calls) == 7
    want = [plan.step_micro_batches(e, s, 0) for e in range(3) for s in range(3)][:7]
    assert [micro for micro, _ in calls] == want  # epochs of 3 steps: steps 4 and 7 start an epoch
    assert [upcoming for _, upcoming in calls] == want[1:] + [None]
    resumed = run_from(TrainingProgress(step=3, epoch=0, step_in_epoch=3))  # resumed after epoch 1
    assert resumed == calls[3:]

"""The training stages' DeepSpeed set-up (stages/common/deepspeed_setup.py): the learning-rate
schedule and the weight-decay parameter groups."""
from __future__ import annotations

import pytest
import torch

from stages.common.deepspeed_setup import lr_factor, param_groups
from stages.sft.config import SFTConfig


def test_lr_schedule_warmup_cosine_min_ratio_and_constant():
    cfg = SFTConfig(model="m", data="d", lr=1.0, warmup_steps=4, min_lr_ratio=0.1, max_steps=20)
    f = lr_factor(cfg, 20)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1)
    assert f(12) == pytest.approx(0.55)  # halfway down the cosine
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
    const = lr_factor(cfg.model_copy(update={"lr_schedule": "constant"}), 20)
    assert [const(s) for s in (0, 3, 4, 19)] == [0.25, 1.0, 1.0, 1.0]


def test_weight_decay_on_matrices_only_also_when_zero3_partitioned():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(10, 4), (4, 4)]
    assert [tuple(p.shape) for p in no_decay["params"]] == [(4,), (4,), (4,)]
    for p in model.parameters():  # what deepspeed.zero.Init leaves: an empty flat tensor
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    assert [len(g["params"]) for g in param_groups(model, 0.1)] == [2, 3]

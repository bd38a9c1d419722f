"""The training stages' DeepSpeed set-up (stages/common/deepspeed_setup.py): the learning-rate
schedule, the weight-decay parameter groups, and DeepSpeed's Muon modules loaded only when used."""
from __future__ import annotations

import sys

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


def test_deepspeed_muon_is_loaded_only_when_used(monkeypatch):
    """The stand-ins for DeepSpeed's Muon modules (its import loads torch's inductor, ~1.3 s a
    rank): no optimizer is a Muon, as with the real class, and the first real use (a Muon
    update) loads the real modules and gives the real result."""
    from stages.common import deepspeed_setup

    names = (deepspeed_setup._MUON, deepspeed_setup._ORIGINAL_MUON)
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)  # restored after the test
    deepspeed_setup._muon_loaded_on_first_use()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    assert all(sys.modules[name].__stand_in__ for name in names)
    assert not isinstance(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), MuonWithAuxAdam)
    grad, momentum = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 4)
    update = muon_update(grad.clone(), momentum.clone(), 0.95)
    real = sys.modules[deepspeed_setup._ORIGINAL_MUON]
    assert not hasattr(real, "__stand_in__") and deepspeed_setup._MUON not in sys.modules  # the next import is real
    assert torch.equal(update, real.muon_update(grad.clone(), momentum.clone(), 0.95))
    deepspeed_setup._muon_loaded_on_first_use()  # the real modules stay
    assert sys.modules[deepspeed_setup._ORIGINAL_MUON] is real
    # a name the stand-in does not define (another DeepSpeed release's import) is the real module's
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    deepspeed_setup._muon_loaded_on_first_use()
    from deepspeed.runtime.zero.muon.original_muon import zeropower_via_newtonschulz5

    assert callable(zeropower_via_newtonschulz5) and not hasattr(sys.modules[deepspeed_setup._ORIGINAL_MUON],
                                                                  "__stand_in__")

"""The training stages' one Checkpointer (stages/common/checkpoint.py), with a real DeepSpeed
engine on a gloo group of one: a resume restores the weights, the RNG and every Stateful, and
a checkpoint written by another setup (world size, data) is refused before anything loads."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from stages.common.checkpoint import Checkpointer, CheckpointError, StatefulDataclass, read_state
from stages.common.contract import StageJob


@dataclasses.dataclass
class Progress(StatefulDataclass):
    step: int = 0
    history: list = dataclasses.field(default_factory=list)


def _engine(seed: int):
    from stages.common.deepspeed_setup import ds_config, initialize

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    engine, _ = initialize(model, model.parameters(), ds_config(0, 1.0, "fp32"), lr=0.1, betas=(0.9, 0.99))
    return engine


def test_resume_restores_weights_rng_and_state_and_refuses_another_setup(tmp_path, gloo_group):
    ranks = gloo_group
    job = StageJob(recipe="t", stage="s", kind="sft", hash="0" * 16, config={},
                   stage_url=f"file://{tmp_path}/store/s", output_dir=str(tmp_path / "out"),
                   work_dir=str(tmp_path / "work"))
    engine = _engine(0)
    assert Checkpointer(job, engine, ranks, {}).resume() is None  # nothing to resume from: a fresh start
    engine.backward(engine(torch.ones(3, 4)).pow(2).sum())
    engine.step()  # the optimizer has state now
    progress = Progress(step=3, history=[{"loss": 1.5}])
    Checkpointer(job, engine, ranks, {"progress": progress, "on_rank0_only": None},
                 fingerprint={"packs": 10}).save(3)
    weights = [p.detach().clone() for p in engine.module.parameters()]
    after_save = (random.random(), torch.rand(3))  # what the RNG gives right after the checkpoint

    fresh, restored = _engine(1), Progress()
    assert not torch.equal(next(fresh.module.parameters()), weights[0])
    ckpt = Checkpointer(job, fresh, ranks, {"progress": restored, "on_rank0_only": None}, fingerprint={"packs": 10})
    assert ckpt.resume() == 3
    assert all(torch.equal(p, w) for p, w in zip(fresh.module.parameters(), weights))
    assert restored == progress
    py, pt = random.random(), torch.rand(3)  # the RNG is back where the checkpoint left it
    assert py == after_save[0] and torch.equal(pt, after_save[1])
    saved = read_state(ckpt.local_root.parent / "resume" / Checkpointer.tag(3))
    assert saved["fingerprint"] == {"world size": 1, "packs": 10} and saved["state"]["progress"]["step"] == 3

    with pytest.raises(CheckpointError, match="world size 1, packs 10; this run has world size 1, packs 11"):
        Checkpointer(job, _engine(2), ranks, {"progress": Progress()}, fingerprint={"packs": 11}).resume()
    two = dataclasses.replace(ranks, world=2)  # what a restart on two ranks declares
    untouched = Progress()
    with pytest.raises(CheckpointError, match="world size 1, packs 10; this run has world size 2, packs 10. "
                                              "Resume with the same resources"):
        Checkpointer(job, _engine(2), two, {"progress": untouched}, fingerprint={"packs": 10}).resume()
    assert untouched == Progress()  # refused before anything was loaded

"""Which ranks train and which generate (stages/rl/placement.py), with tensor-parallel engines:
the generating ranks form groups of `tensor_parallel_size`, the first rank of each runs the
engine; a size that does not divide them is the user's error, named by its key; the engine
options carry the weight sync's bucket size to an engine that buckets the sync itself; each engine
rank's engine gets a seed of its own."""
from __future__ import annotations

import pytest

from stages.common.contract import StageError
from stages.reasoning_rl.config import ReasoningRLConfig
from stages.rl.placement import Placement
from stages.rl.rollouts import engine_options

BASE = {"kind": "reasoning_rl", "model": "m", "data": "d.jsonl", "steps": 1, "prompts_per_step": 4,
        "rollouts_per_prompt": 4}


def _cfg(**rollout) -> ReasoningRLConfig:
    return ReasoningRLConfig.model_validate({**BASE, "rollout": {"engine": "vllm", **rollout}})


def test_split_placement_with_a_tensor_parallel_engine():
    cfg = _cfg(gpus=2, options={"tensor_parallel_size": 2})
    places = [Placement.of(cfg, r, 4) for r in range(4)]
    p = places[0]
    assert p.trainers == range(2) and p.engines == range(2, 4, 2) and p.generators == range(2, 4) and p.split
    assert [q.is_engine for q in places] == [False, False, True, False]  # rank 3's GPU is the engine's second
    assert [q.is_trainer for q in places] == [True, True, False, False] and p.engine0 == 2
    assert p.describe == "split: ranks 0-1 train, 2-3 generate (1 engine, 2 GPUs each (tensor parallel))"


def test_colocated_tensor_parallel_engines_and_the_old_placements_unchanged():
    cfg = _cfg(options={"tensor_parallel_size": 2}, sleep="none")
    p = Placement.of(cfg, 1, 4)
    assert p.engines == range(0, 4, 2) and p.generators == range(4) and not p.split and p.is_trainer
    assert not p.is_engine and Placement.of(cfg, 2, 4).is_engine
    assert p.describe == "colocated: 2 engines, 2 GPUs each (tensor parallel)"
    # without tensor parallelism the placements (and their checkpoint fingerprints) are as before
    one = Placement.of(_cfg(sleep="none"), 0, 2)
    assert one.engines == one.generators == range(2) and one.describe == "colocated: 2 engines"
    split = Placement.of(_cfg(gpus=1), 0, 2)
    assert split.engines == range(1, 2) and split.describe == "split: ranks 0-0 train, 1-1 generate"


@pytest.mark.parametrize("tp,world,gpus", [(3, 4, 2), (2, 3, None), (0, 2, 1), ("2", 4, 2), (True, 2, 1)])
def test_a_tensor_parallel_size_that_does_not_divide_the_generating_ranks_is_refused(tp, world, gpus):
    rollout = {"options": {"tensor_parallel_size": tp}, **({"gpus": gpus} if gpus else {"sleep": "none"})}
    with pytest.raises(StageError, match=r"rollout.options.tensor_parallel_size is .*divides the \d generating"):
        Placement.of(_cfg(**rollout), 0, world)


def test_the_vllm_engine_gets_the_sync_bucket_size_unless_the_options_set_it():
    assert engine_options(_cfg(gpus=1, sync_bucket_mb=64))["sync_bucket_mb"] == 64
    assert engine_options(_cfg(gpus=1, options={"sync_bucket_mb": 8}))["sync_bucket_mb"] == 8
    torch_cfg = ReasoningRLConfig.model_validate({**BASE, "rollout": {"engine": "torch"}})
    assert "sync_bucket_mb" not in engine_options(torch_cfg)


def test_a_rank_of_a_tensor_parallel_group_without_an_engine_joins_every_gather(monkeypatch):
    """Colocated tensor-parallel engines: the group's other ranks hold no engine but must join
    each bucket's ZeRO-3 all-gather, or the engine's rank waits in it for ever."""
    import contextlib

    import torch

    import stages.rl.weight_sync as ws

    joined = []
    monkeypatch.setattr(ws, "gathered", lambda parts, zero3: (joined.append(len(parts)), contextlib.nullcontext())[1])
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    sync = ws.GatherIntoEngines(module, None, zero3=True, bucket_bytes=64 * 64 * 4)
    assert sync.push(1) >= 0
    assert len(joined) == len(sync.buckets) == 2 and sum(joined) == 4


@pytest.mark.parametrize("rollout, world, seeds", [
    ({}, 3, {0: 11, 1: 12, 2: 13}),                 # colocated: every rank an engine
    ({"gpus": 2}, 4, {0: None, 1: None, 2: 11, 3: 12}),  # split: the last two generate; engine 0 keeps the seed
])
def test_each_engine_gets_its_own_seed(monkeypatch, rollout, world, seeds):
    """The stage seed plus the engine's index among the engines: a request an engine samples
    without a seed of its own (vLLM's request_seeds: false) draws other noise on each engine."""
    import torch

    import stages.rl.engines.protocol as protocol
    from stages.common.distributed import Ranks
    from stages.common.groups import SOLO
    from stages.rl import rollouts
    from stages.rl.prompts import PromptSet

    made = {}
    monkeypatch.setattr(rollouts, "make_scheduler", lambda *args, **kwargs: None)  # its shards: test_data_parallel

    def recording(model_dir, **kwargs):
        made[kwargs.pop("rank")] = kwargs["seed"]
        return object()

    cfg = ReasoningRLConfig.model_validate({**BASE, "seed": 11, "rollout": {"engine": "recording", **rollout}})
    prompts = PromptSet(rows=[{"id": "a"}], prompt_ids=[[1, 2]], groups={"all": [0]}, weights=None, summary={},
                        description="")
    for rank in range(world):
        monkeypatch.setitem(protocol.ENGINES, "recording",
                            lambda model_dir, rank=rank, **kw: recording(model_dir, rank=rank, **kw))
        placement = Placement.of(cfg, rank, world)
        ranks = Ranks(rank, world, rank, torch.device("cpu"), False, SOLO)
        rollouts.DataParallelRollouts.start(cfg, placement, ranks, "model", prompts, build_reward=lambda: None,
                                            decode=str, step_metrics=lambda reward: {})
    assert made == {r: s for r, s in seeds.items() if s is not None}

"""Data-parallel rollouts on several gloo ranks (torch engine on CPU), through the public
pieces the RL trainer uses: the scheduler shards with one global C3PO++ budget, GRPO groups
kept whole on one engine, a shard resumed from its state; the weight sync into every engine
(colocated, ZeRO-3 gather) and by broadcast to engine ranks of their own (split)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from stages.common.ports import reserved_port
from stages.rl.prompt_sampler import PromptSampler
from tests.stages.rl import dp_workers
from tests.stages.rl.tiny_model import build_model, save_model

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow  # it starts gloo ranks (CONTRIBUTING: tests that launch processes)

C3PO = {"rollouts_per_prompt": 3, "max_new_tokens": 24, "pool_capacity": 12, "token_budget": 40,
        "retention_limit": 100, "prompts_per_step": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_model(build_model(), tmp_path_factory.mktemp("tiny_dp")))


def run_world(fn, world: int, tmp_path, model_dir: str, extra) -> list[dict]:
    """`fn(rank, world, port, model_dir, out, extra)` on `world` gloo ranks (forked by one fresh
    process: dp_world.py); what each wrote."""
    with reserved_port() as port:  # until rank 0's store has bound it
        out = subprocess.run([sys.executable, "-m", "tests.stages.rl.dp_world", fn.__name__, str(world), str(port),
                              model_dir, str(tmp_path), json.dumps(extra)], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def colocated(model_dir, tmp_path_factory) -> list[dict]:
    """Two ranks, each an engine (and a trainer): scheduler shards, then the weight sync."""
    return run_world(dp_workers.colocated, 2, tmp_path_factory.mktemp("colocated"), model_dir, C3PO)


@pytest.fixture
def shards(colocated) -> list[dict]:
    return [r["shards"] for r in colocated]


def test_one_global_token_budget_spent_in_rounds(shards):
    phi = C3PO["token_budget"]
    for step in range(3):
        calls = [s["steps"][step]["calls"] for s in shards]
        assert len(calls[0]) == len(calls[1]) >= 1  # both engines end the partition in the same round
        spent = 0  # C, over both engines
        for r0, r1 in zip(*calls):
            remaining = phi - spent if spent < phi else phi
            assert r0["budget"] == r1["budget"] == math.ceil(remaining / 2)  # each engine's share
            spent += r0["finished_tokens"] + r1["finished_tokens"]
        assert spent >= phi
        stats = shards[0]["steps"][step]["stats"]
        assert stats["budget_tokens"] == spent and stats["engines"] == 2
        # the pool is global too: each engine decodes half of Omega
        assert all(len(c["uids"]) == C3PO["pool_capacity"] // 2 for c in calls[0] + calls[1])
        assert shards[1]["steps"][step]["samples"] == [] and shards[1]["steps"][step]["stats"] == {}


def test_groups_stay_whole_on_one_engine_and_draw_the_global_prompt_stream(shards):
    owner = {}
    for rank, shard in enumerate(shards):
        for step in shard["steps"]:
            for call in step["calls"]:
                for uid in call["uids"]:
                    group = uid.split("/")[0]
                    assert owner.setdefault(group, rank) == rank, f"{group} decoded on two engines"
                    assert int(group[1:]) % 2 == rank  # engine i opens groups i, i+2, ...
    stream = PromptSampler({"toy": list(range(10))}, None, seed=0)
    draws = [stream.next() for _ in range(max(int(g[1:]) for g in owner) + 1)]
    trained: dict[str, list[dict]] = defaultdict(list)
    for step in shards[0]["steps"]:
        for s in step["samples"]:
            trained[s["group"]].append(s)
    assert {owner[g] for g in trained} == {0, 1}  # the batch holds both engines' groups
    for group, members in trained.items():
        assert len(members) == C3PO["rollouts_per_prompt"]  # nothing purged: every member trained, once
        assert {m["row"] for m in members} == {draws[int(group[1:])]}
        assert sum(m["advantage"] for m in members) == pytest.approx(0.0, abs=1e-6)
    uids = [s["uid"] for step in shards[0]["steps"] for s in step["samples"]]
    assert len(uids) == len(set(uids))


def test_a_shard_resumed_from_its_state_replays_the_step(shards):
    assert shards[0]["pool_before_step_3"] and shards[1]["pool_before_step_3"]
    assert shards[0]["replayed"] == shards[0]["steps"][2]["samples"]


def test_sync_deals_the_step_groups_round_robin(shards):
    calls = [s["sync"]["calls"] for s in shards]
    assert [len(c) for c in calls] == [1, 1] and calls[0][0]["budget"] is None
    assert [sorted({u.split("/")[0] for u in c[0]["uids"]}) for c in calls] == [["g0", "g2"], ["g1"]]
    samples = shards[0]["sync"]["samples"]
    assert len(samples) == C3PO["prompts_per_step"] * C3PO["rollouts_per_prompt"]
    assert {s["group"] for s in samples} == {"g0", "g1", "g2"}


@pytest.fixture(scope="module")
def split_launch(model_dir, tmp_path_factory) -> list[dict]:
    """Three ranks: two trainers in a world of their own, one engine rank in another."""
    return run_world(dp_workers.split, 3, tmp_path_factory.mktemp("split"), model_dir, None)


def test_every_engine_holds_the_trainers_weights_bit_for_bit_after_a_sync(colocated, split_launch):
    """Colocated: two ranks gather (ZeRO-3) and copy into their own engines. Split: two trainer
    ranks (a world of their own, ZeRO-3 over both) and one engine rank, the weights broadcast
    to it by trainer 0, then again into a bf16 engine with stochastic rounding."""
    split = [r["sync"] for r in split_launch]
    together = [r["sync"] for r in colocated]
    for records, engines in ((together, together), (split, split[-1:])):
        for rec in engines:
            assert rec["moved"], "the optimizer step must change the weights for the test to mean anything"
            assert rec["differs"] == [] and rec["compared"] > 0
            assert rec["buckets"] >= 3  # several buckets of 64 KiB
        assert len({r["bytes"] for r in records}) == 1 and records[0]["bytes"] > 0
    # rollout.sync_rounding: stochastic into a bf16 engine rank: trainer 0 rounds before the broadcast
    # (half the bytes travel), the engine holds the trainer's weights rounded under the documented seed
    rounded = [r["stochastic"] for r in split]
    frozen = 2 * rounded[-1]["frozen_numel"]  # the frozen fp32 tensor travels as it is
    assert {r["bytes"] for r in rounded} == {split[0]["bytes"] // 2 + frozen}
    assert rounded[-1]["differs"] == [] and rounded[-1]["compared"] == split[-1]["compared"]
    assert rounded[-1]["not_nearest"]  # stochastic, not the engine's own round-to-nearest


def test_a_tensor_parallel_engine_gets_the_weights_while_its_other_rank_joins_the_gathers(colocated):
    """Colocated, one engine for both ranks (rollout.options.tensor_parallel_size: 2): rank 1
    holds no engine but joins every bucket's ZeRO-3 all-gather, so rank 0's engine gets the
    trained weights bit for bit (a rank that skipped them would leave rank 0 waiting)."""
    engine, other = (r["sync_tp"] for r in colocated)
    assert engine["moved"] and engine["differs"] == [] and engine["compared"] > 0 and engine["buckets"] >= 3
    assert "differs" not in other and other["bytes"] == engine["bytes"] > 0


def test_no_rank_of_a_split_launch_leaves_before_the_last_one_finishes(split_launch):
    """Rank 0 holds the launch's store: on GPUs a role world that first talks at the job's end
    (NCCL opens its communicator through that store) failed when rank 0 left with its own role
    (round 20). The engine rank finishes a second after the trainers; nobody leaves before it."""
    last_finish = max(r["finished_at"] for r in split_launch)
    assert split_launch[-1]["finished_at"] - split_launch[0]["finished_at"] >= 0.9
    assert all(r["left_at"] >= last_finish for r in split_launch)

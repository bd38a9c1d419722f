"""C3PO++ and the sync baseline on a scripted engine: budget, carry-over, purge, refill, resume."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from stages.rl.engines.protocol import SamplingParams
from stages.rl.prompt_sampler import PromptSampler
from stages.rl.rollout_records import SchedulerConfig
from stages.rl.scheduler import C3POScheduler, SyncScheduler, make_scheduler
from tests.stages.rl.fakes import EOS, ScriptedEngine, decode, logprob_at, parity_reward, token_at

ROWS = [{"id": f"r{i}", "domain": "math" if i % 3 else "logic", "prompt": f"p{i}", "reference": i}
        for i in range(12)]
PROMPT_IDS = [[1, 100 + i] for i in range(12)]


def default_length(uid: str) -> int:
    g, m = uid[1:].split("/")
    return 2 + (7 * int(g) + 3 * int(m)) % 9


def make(mode="c3po", lengths=None, seed=0, **cfg):
    overrides = lengths or {}
    engine = ScriptedEngine(lambda uid: overrides.get(uid, default_length(uid)))
    conf = SchedulerConfig(**{"rollouts_per_prompt": 4, "max_new_tokens": 1000, "pool_capacity": 8,
                              "token_budget": 12, "retention_limit": 100, "prompts_per_step": 3, **cfg})
    sampler = PromptSampler({"math": [i for i in range(12) if i % 3], "logic": [0, 3, 6, 9]}, None, seed)
    sched = make_scheduler(mode, engine, conf, ROWS, PROMPT_IDS, sampler, SamplingParams(), decode,
                           parity_reward)
    return sched, engine


def run_steps(sched, engine, n, start_version=0):
    out = []
    for v in range(start_version, start_version + n):
        assert engine.version == v
        out.append(sched.next_batch(v))
        engine.update_weights([])
    return out


def finished_tokens(call) -> int:
    return sum(len(rq.generated_ids) + len(u.token_ids)
               for rq, u in zip(call.requests, call.updates) if u.finished)


def test_budget_accounting_and_refill_to_capacity():
    sched, engine = make()
    phi = sched.cfg.token_budget
    for step in range(4):
        first = len(engine.calls)
        batch = sched.next_batch(step)
        calls = engine.calls[first:]
        c = 0
        for call in calls:
            # refill: every engine call decodes a full pool
            assert len(call.requests) == sched.cfg.pool_capacity
            # the budget handed to the engine is what is left of Phi (a new Phi once spent)
            assert call.budget == (phi - c if c < phi else phi)
            got = finished_tokens(call)
            # the engine stopped as soon as the finished rollouts reached the budget
            if any(not u.finished for u in call.updates):
                assert got >= call.budget
            c += got
        assert batch.stats["budget_tokens"] == c >= phi
        assert batch.stats["generate_calls"] == len(calls)
        # the batch holds whole resolved groups: G members each, group-normalised advantages
        per_group = Counter(s.group_id for s in batch.samples)
        assert per_group and all(n == 4 for n in per_group.values())
        for g in per_group:
            advs = [s.advantage for s in batch.samples if s.group_id == g]
            assert sum(advs) == pytest.approx(0.0, abs=1e-6)
        assert batch.stats["train_rollouts"] == len(batch.samples)
        engine.update_weights([])
    # everything finished is either trained or waiting for its group
    assert sched.totals["rollouts_finished"] == sum(
        sum(1 for u in call.updates if u.finished) for call in engine.calls)


def test_the_reward_sees_each_response_with_its_grpo_group():
    """Rewards normalised within a group (general RL's RM score) need the group of each
    response: a prompt drawn twice in one step is two groups, not one."""
    seen = []

    def reward(rows, texts, groups):
        seen.append((list(rows), list(groups)))
        return parity_reward(rows, texts, groups)

    engine = ScriptedEngine(default_length)
    conf = SchedulerConfig(rollouts_per_prompt=2, max_new_tokens=1000, prompts_per_step=6)
    sampler = PromptSampler({"math": [0]}, None, 0)  # one prompt: every group draws row 0
    batch = SyncScheduler(engine, conf, ROWS, PROMPT_IDS, sampler, SamplingParams(), decode, reward).next_batch(0)
    (rows, groups), = seen
    assert rows == [ROWS[0]] * 12
    assert groups == [s.group_id for s in batch.samples] == [f"g{i}" for i in range(6) for _ in range(2)]


def test_carry_over_keeps_tokens_logprobs_and_versions_across_updates():
    sched, engine = make(lengths={"g0/3": 20}, pool_capacity=4, token_budget=6)
    seen_prefixes = []
    for step in range(12):
        first = len(engine.calls)
        batch = sched.next_batch(step)
        for call in engine.calls[first:]:
            for rq in call.requests:
                if rq.uid == "g0/3":
                    seen_prefixes.append((call.version, list(rq.generated_ids)))
        engine.update_weights([])
        long = [s for s in batch.samples if s.uid == "g0/3"]
        if long:
            break
    else:
        pytest.fail("the long rollout never finished")
    s = long[0]
    assert s.response_ids == [token_at(p) for p in range(19)] + [EOS]
    versions = s.token_versions()
    assert len(set(versions)) >= 2 and versions == sorted(versions)
    # each token's pi_infer is the one recorded by the weights that sampled it
    assert s.infer_logprobs == [pytest.approx(logprob_at(p, v)) for p, v in enumerate(versions)]
    # every continuation request re-sent exactly the tokens generated so far
    for (v, prefix) in seen_prefixes:
        assert prefix == s.response_ids[:len(prefix)]
        assert all(tv <= v for tv in versions[:len(prefix)])
    assert any(v > 0 and prefix for v, prefix in seen_prefixes)  # continued by an updated policy
    assert s.carried
    assert sched.totals["carried_over_finished"] >= 1
    assert batch.stats["carried_over_finished"] >= 1


@pytest.mark.parametrize("min_group_size,trained", [(2, True), (4, False)])
def test_purge_at_retention_limit(min_group_size, trained):
    sched, engine = make(lengths={"g0/3": 10_000}, retention_limit=1, min_group_size=min_group_size)
    b1 = sched.next_batch(0)
    engine.update_weights([])
    assert sched.pool["g0/3"].retention == 1 and b1.stats["purged"] == 0
    assert "g0/3" in sched.pool
    b2 = sched.next_batch(1)
    assert "g0/3" not in sched.pool and b2.stats["purged"] >= 1
    assert sched.totals["purged"] >= 1
    g0 = [s for s in b1.samples + b2.samples if s.group_id == "g0"]
    if trained:
        assert sorted(s.uid for s in g0) == ["g0/0", "g0/1", "g0/2"]
        assert sum(s.advantage for s in g0) == pytest.approx(0.0, abs=1e-6)
    else:
        assert g0 == [] and b2.stats["groups_dropped"] >= 1
    assert not any(uid.startswith("g0/") for uid in sched.waiting)
    assert "g0" not in sched.groups
    # sigma bounds staleness: nothing in the pool has lived through more than sigma partitions
    assert all(r.retention <= 1 for r in sched.pool.values())


def test_sigma_zero_purges_every_unfinished_rollout():
    sched, engine = make(retention_limit=0)
    b = sched.next_batch(0)
    assert not sched.pool and b.stats["carried_over"] == 0
    assert b.stats["purged"] > 0


def test_checkpoint_resume_reproduces_the_pools():
    sched_a, engine_a = make(lengths={"g0/3": 30, "g2/1": 25})
    batches_a = run_steps(sched_a, engine_a, 4)

    sched_b, engine_b = make(lengths={"g0/3": 30, "g2/1": 25})
    run_steps(sched_b, engine_b, 2)
    state = json.loads(json.dumps(sched_b.state_dict()))  # what the checkpoint stores
    assert state["pool"], "the scenario must checkpoint unfinished rollouts"
    # a fresh process: new scheduler, new engine at the restored policy version
    sched_c, engine_c = make(lengths={"g0/3": 30, "g2/1": 25})
    sched_c.load_state_dict(state)
    engine_c.version = 2
    assert {u: r.token_ids for u, r in sched_c.pool.items()} == {u: r.token_ids for u, r in sched_b.pool.items()}
    batches_c = run_steps(sched_c, engine_c, 2, start_version=2)
    for a, c in zip(batches_a[2:], batches_c):
        def key(b):
            return [(s.uid, s.response_ids, s.infer_logprobs, s.segments, s.advantage) for s in b.samples]
        assert key(a) == key(c)
    assert sched_a.totals == sched_c.totals


def test_resume_rejects_a_different_scheduler():
    sched, engine = make()
    run_steps(sched, engine, 1)
    other, _ = make(mode="sync")
    with pytest.raises(ValueError, match="c3po scheduler"):
        other.load_state_dict(sched.state_dict())


def test_sync_generates_every_rollout_to_completion_in_one_call():
    sched, engine = make(mode="sync", lengths={"g1/2": 40})
    assert isinstance(sched, SyncScheduler)
    batch = sched.next_batch(0)
    assert len(engine.calls) == 1 and engine.calls[0].budget is None
    assert len(engine.calls[0].requests) == 3 * 4
    assert len(batch.samples) == 12 and not sched.pool and not sched.waiting
    assert batch.stats["carried_over"] == 0
    assert {len(s.response_ids) for s in batch.samples if s.uid == "g1/2"} == {40}
    # lockstep decoding waits for the longest rollout: slot utilisation below 1
    assert 0 < batch.stats["slot_utilization"] < 1


def test_max_new_tokens_cap_finishes_with_length():
    sched, engine = make(mode="sync", lengths={"g0/0": 10_000}, max_new_tokens=7)
    batch = sched.next_batch(0)
    s = [x for x in batch.samples if x.uid == "g0/0"][0]
    assert len(s.response_ids) == 7 and s.finish_reason == "length"


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="pool_capacity"):
        SchedulerConfig(rollouts_per_prompt=8, pool_capacity=4)
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerConfig(token_budget=0)
    with pytest.raises(ValueError, match="scheduler must be"):
        make(mode="async")


def test_pool_larger_than_engine_batch_keeps_unstarted_rollouts_unaged():
    overrides = {}
    engine = ScriptedEngine(lambda uid: overrides.get(uid, default_length(uid)), max_batch=4)
    conf = SchedulerConfig(rollouts_per_prompt=4, max_new_tokens=1000, pool_capacity=12, token_budget=8,
                           retention_limit=0)
    sampler = PromptSampler({"math": list(range(12))}, None, 0)
    sched = C3POScheduler(engine, conf, ROWS, PROMPT_IDS, sampler, SamplingParams(), decode, parity_reward)
    batch = sched.next_batch(0)
    assert all(len(c.requests) == 12 for c in engine.calls)  # the whole pool is handed over
    unstarted = [r for r in sched.pool.values() if not r.token_ids]
    assert unstarted and all(r.retention == 0 for r in unstarted)
    # sigma = 0 purges every started, unfinished rollout but never an unstarted one
    assert all(not r.token_ids for r in sched.pool.values())
    assert batch.stats["purged"] >= 1

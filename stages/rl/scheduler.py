"""The rollout schedulers: where training batches come from. C3PO++ (Ring-1T, Algorithm 1)
and the sync baseline, over one rollout engine (engines/) and a reward function.

C3PO++ (`C3POScheduler`), one call of `next_batch` = one partition = one training step:

    P (inference pool, capacity Omega) holds unfinished rollouts; Q (training pool) the
    finished ones; C = 0.
    while C < Phi:
        refill P with new rollouts up to Omega                       (new prompts)
        decode every rollout of P in parallel (one engine call) until the rollouts that
        finish in the call reach the remaining budget Phi - C; finished ones (EOS or max
        length) move to Q and their lengths add to C
    for each started rollout still in P: retention += 1; purge it if retention > sigma
    train on the resolved GRPO groups of Q (the trainer does that), remove them from Q

Omega may exceed the engine's own concurrency (`max_batch`): the engine then keeps its
decode slots full from the queued requests within the call (continuous batching), and
rollouts it never started stay in P, unaged, for the next partition.

Unfinished rollouts stay in P across the update and are continued by the updated policy:
the engine re-encodes prompt + earlier tokens with the new weights and appends; the earlier
tokens keep the pi_infer they were sampled with and the policy version that sampled them
(`Rollout.segments`).

Rules this module fixes (the paper leaves them open):
- GRPO groups. A prompt's G rollouts form a group; its advantages need every member's
  reward, so a finished rollout waits in Q until its group is resolved: all G members
  finished or purged. A step trains on the groups resolved by then; the finished members of
  unresolved groups stay in Q (their tokens already counted toward C of the partition they
  finished in) and are trained in the step that resolves their group. A partition that
  reaches Phi without resolving any group is extended by another budget Phi (no empty
  updates). A group resolved with purged members is trained on its finished members
  (advantages normalised over them) when at least `min_group_size` (default 2) finished,
  else dropped (counted). Purged rollouts are never trained (they have no answer).
- Refill is per rollout: a freed slot starts the next member of the oldest group that still
  has unstarted members, else opens a new group (draws a prompt). P is always full, so a
  group's members may start in different partitions.
- Carry-over and IcePop: a carried token's k uses pi_infer recorded at sampling time (under
  the policy version that sampled it) over pi_train(theta_old) = the trainer's current,
  pre-update policy. k then measures engine mismatch plus policy lag; IcePop masks the
  tokens where their product leaves [alpha, beta]. Nothing is recomputed for old tokens
  (that would need an extra prefill under the new weights); masked fractions are logged
  separately for stale and fresh tokens.

Sync baseline (`SyncScheduler`): per step, `prompts_per_step` new prompts x G rollouts are
generated to completion in one engine call, then trained.

The reward function gets, for the responses of the groups a step resolved, their prompt
rows, decoded texts and GRPO group ids (a reward normalised within a group, like general
RL's reward-model score, needs the ids: two groups of one prompt in a step are two groups).

Data parallel (stages/rl/rollouts.py): each of k engine ranks runs one scheduler over its
own engine, a shard of the work; `peers` is the engines' group (a rank alone: SOLO). With
k = 1 everything below is the single-engine algorithm above.
- Prompts: one global stream of PromptSampler draws; engine i takes draws i, k+i, 2k+i, ...
  (each engine runs its own copy of the sampler and skips the others' draws), so k engines
  draw from the same stream as one. A group's id is its draw index (`g{n*k+i}`), unique
  across engines. A GRPO group lives on one engine from its first member to its last: a
  group is never split, and its advantages are computed over all its members.
- Omega is global: engine i holds Omega // k rollouts (+1 for the first Omega % k engines).
- Phi is global, spent in rounds. Each round every engine refills its pool and decodes with
  a local budget of ceil((Phi - C) / k) (ceil(Phi / k) while the partition is extended);
  then the engines all-reduce the summed length of the rollouts that finished in the round
  and their count of resolved groups, and C grows by the sum. Every engine ends the
  partition after the same round: the first after which C >= Phi and some engine holds a
  resolved group. An engine that runs out of rollouts before its share (its pool all
  finished) leaves C short: another round shares the remainder again (the other engines'
  unfinished rollouts continue there, their prefixes re-encoded).
- Retention and purge: at the end of the partition every engine ages its own started,
  unfinished rollouts by one and purges those above sigma: one rule for every rollout.
- The batch: every engine hands the finished members of its resolved groups (with their
  decoded text) and its stats to engine 0, which calls the reward function once for all of
  them, normalises advantages within each group and merges the stats (counts summed; the
  phase's wall time is the slowest engine's; `generate_seconds_mean` is the engines'
  mean busy time). The other engines' `next_batch` returns an empty batch.
- Sync: the step's prompts_per_step groups are dealt round-robin (engine i opens groups
  i, k+i, ... of the step), each engine generates its own to completion.

Each scheduler's whole state (pools, open groups, sampler position, counters) is
`state_dict()` (JSON-able) and comes back with `load_state_dict()`, so a killed stage
resumes with the same unfinished rollouts; with k engines each engine rank checkpoints its
own shard (stages/common/checkpoint.py `rank_state`), resumed on the same k. No torch /
DeepSpeed here beyond the engine and the peers' collectives.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Any, Callable, Sequence

from stages.common.groups import SOLO
from stages.common.groups import Group as EngineGroup
from stages.rl.engines.protocol import RolloutEngine, RolloutRequest, SamplingParams
from stages.rl.engines.routes import encode_routes
from stages.rl.loss import group_advantages
from stages.rl.prompt_sampler import PromptSampler
from stages.rl.rollout_records import Group, RewardFn, Rollout, SchedulerConfig, StepBatch, TrainSample

STATE_VERSION = 2


# -- the schedulers --------------------------------------------------------------------------------
class _Scheduler:
    mode = "base"

    def __init__(self, engine: RolloutEngine, cfg: SchedulerConfig, rows: Sequence[dict], prompt_ids: Sequence[list[int]],
                 sampler: PromptSampler, sampling: SamplingParams, decode: Callable[[list[int]], str],
                 reward_fn: RewardFn | None, max_new_tokens_fn: Callable[[int], int] | None = None,
                 peers: EngineGroup = SOLO):
        """`peers`: the engines' group (this scheduler is engine `peers.rank` of `peers.size`);
        `reward_fn` is needed on engine 0 only."""
        if len(rows) != len(prompt_ids):
            raise ValueError("rows and prompt_ids differ in length")
        self.engine, self.cfg, self.rows, self.prompt_ids = engine, cfg, rows, prompt_ids
        self.sampler, self.sampling, self.decode, self.reward_fn = sampler, sampling, decode, reward_fn
        self.peers = peers
        k, i = peers.size, peers.rank
        # Omega shared over the engines (module docstring)
        self.pool_capacity = cfg.pool_capacity // k + (1 if i < cfg.pool_capacity % k else 0)
        if self.mode == "c3po" and self.pool_capacity < cfg.rollouts_per_prompt:
            raise ValueError(f"pool_capacity {cfg.pool_capacity} over {k} engines leaves engine {i} "
                             f"{self.pool_capacity} rollouts, less than one group of {cfg.rollouts_per_prompt}")
        # benchmark hook: the response cap of the n-th rollout ever started (<= max_new_tokens)
        self.max_new_tokens_fn = max_new_tokens_fn
        self.pool: dict[str, Rollout] = {}      # P: unfinished
        self.waiting: dict[str, Rollout] = {}   # Q: finished, group not yet resolved
        self.groups: dict[str, Group] = {}      # open (unresolved) groups
        self.to_start: deque[str] = deque()     # groups with unstarted members, oldest first
        self.next_group = 0                     # groups this engine opened
        self.rollouts_started = 0
        self.generate_calls = 0
        self.totals = {k: 0 for k in TOTALS}    # this engine's counters (engine 0 also counts trained groups)

    # -- pieces shared by both modes ---------------------------------------------------------
    def _open_group(self) -> Group:
        k, i = self.peers.size, self.peers.rank
        draws = [self.sampler.next() for _ in range(k)]  # the global stream; this engine's is the i-th
        g = Group(f"g{self.next_group * k + i}", draws[i], self.cfg.rollouts_per_prompt)
        self.next_group += 1
        self.groups[g.group_id] = g
        self.to_start.append(g.group_id)
        return g

    def _start_member(self, g: Group) -> Rollout:
        cap = self.cfg.max_new_tokens
        if self.max_new_tokens_fn is not None:
            cap = max(1, min(cap, int(self.max_new_tokens_fn(self.rollouts_started))))
        r = Rollout(f"{g.group_id}/{g.started}", g.group_id, g.row_index,
                    list(self.prompt_ids[g.row_index]), cap)
        g.started += 1
        self.rollouts_started += 1
        if g.started == g.size and self.to_start and self.to_start[0] == g.group_id:
            self.to_start.popleft()
        self.pool[r.uid] = r
        return r

    def _generate(self, budget: int | None, version: int, st: dict[str, float]) -> tuple[list[Group], int]:
        """One engine call over the whole pool; returns the groups it resolved and the
        summed length of the rollouts that finished in it."""
        rollouts = list(self.pool.values())
        if not rollouts:  # sync: an engine dealt no group this step
            return [], 0
        requests = [RolloutRequest(uid=r.uid, prompt_ids=r.prompt_ids,
                                   max_new_tokens=r.max_new_tokens - len(r.token_ids),
                                   generated_ids=list(r.token_ids)) for r in rollouts]
        sampling = self.sampling
        if sampling.seed is not None:  # a fresh, reproducible seed per engine call (resumes replay it)
            sampling = replace(sampling, seed=sampling.seed + self.generate_calls * self.peers.size + self.peers.rank)
        self.generate_calls += 1
        t0 = time.perf_counter()
        updates = self.engine.generate(requests, sampling, finished_token_budget=budget)
        st["generate_seconds"] += time.perf_counter() - t0
        st["generate_calls"] += 1
        if len(updates) != len(requests):
            raise RuntimeError(f"engine returned {len(updates)} updates for {len(requests)} requests")
        new_tokens = 0
        longest = 0
        finished_tokens = 0
        resolved: list[Group] = []
        for r, u in zip(rollouts, updates):
            if u.uid != r.uid:
                raise RuntimeError(f"engine answered request {r.uid} with update {u.uid} (order must be kept)")
            if len(u.token_ids) != len(u.logprobs):
                raise RuntimeError(f"engine update {u.uid}: {len(u.token_ids)} tokens but "
                                   f"{len(u.logprobs)} logprobs")
            if u.token_ids:
                if not r.segments or r.segments[-1][1] != version:
                    r.segments.append([len(r.token_ids), version])
                r.token_ids.extend(int(t) for t in u.token_ids)
                r.logprobs.extend(float(x) for x in u.logprobs)
                r.routes = encode_routes(u.routes) if getattr(u, "routes", None) is not None else None
            if len(r.token_ids) > r.max_new_tokens:
                raise RuntimeError(f"engine generated {len(r.token_ids)} tokens for {r.uid}, "
                                   f"over its max_new_tokens {r.max_new_tokens}")
            new_tokens += len(u.token_ids)
            longest = max(longest, len(u.token_ids))
            if u.finished or len(r.token_ids) == r.max_new_tokens:
                finished_tokens += len(r.token_ids)
                g = self._finish(r, u.finish_reason if u.finished else "length", st)
                if g is not None:
                    resolved.append(g)
        st["generated_tokens"] += new_tokens
        # decode-slot use: from the engine's own counters when it has them (torch engine:
        # tokens of decode steps / (decode steps x max_batch); each request's first token comes
        # from its prefill); else a lockstep decoder's `longest` iterations over all requests
        counters = getattr(self.engine, "last_stats", None) or {}
        slots = getattr(self.engine, "max_batch", None)
        if "decode_steps" in counters and "new_tokens" in counters and slots:
            st["slot_tokens"] += counters["new_tokens"] - sum(1 for u in updates if u.token_ids)
            st["slot_capacity"] += counters["decode_steps"] * slots
        else:
            st["slot_tokens"] += new_tokens
            st["slot_capacity"] += longest * len(requests)
        if new_tokens == 0 and not resolved and not any(u.finished for u in updates):
            raise RuntimeError("the rollout engine made no progress (no token, no finished rollout)")
        return resolved, finished_tokens

    def _finish(self, r: Rollout, reason: str | None, st: dict[str, float]) -> Group | None:
        r.finished, r.finish_reason = True, reason or "eos"
        del self.pool[r.uid]
        self.waiting[r.uid] = r
        st["rollouts_finished"] += 1
        if r.carried:
            st["carried_over_finished"] += 1
        g = self.groups[r.group_id]
        g.finished.append(r.uid)
        return g if g.resolved else None

    def _purge(self, r: Rollout, st: dict[str, float]) -> Group | None:
        del self.pool[r.uid]
        st["purged"] += 1
        g = self.groups[r.group_id]
        g.purged.append(r.uid)
        return g if g.resolved else None

    def _finalize(self, groups: list[Group], st: dict[str, float], started: float) -> StepBatch:
        """The step's batch, on engine 0 (every engine calls it: a collective over the peers):
        each engine's resolved groups with enough finished members, their members' decoded
        texts and its stats go to engine 0, which scores them in one reward call, normalises
        advantages within each group and merges the stats. The others get an empty batch."""
        trained: list[tuple[str, list[Rollout]]] = []
        for g in groups:
            del self.groups[g.group_id]
            members = [self.waiting.pop(u) for u in g.finished]
            if len(members) >= self.cfg.min_group_size:
                trained.append((g.group_id, members))
            else:
                st["groups_dropped"] += 1
        texts = [[self.decode(r.token_ids) for r in members] for _, members in trained]
        st["rollout_seconds"] = time.perf_counter() - started
        self._count(st)
        parts = self.peers.gather_objects((trained, texts, self._shard_stats(st), dict(self.totals)), 0)
        if parts is None:
            return StepBatch([], {})
        trained = [t for part in parts for t in part[0]]
        texts_flat = [text for part in parts for group_texts in part[1] for text in group_texts]
        members = [r for _, group_members in trained for r in group_members]
        rows = [self.rows[r.row_index] for r in members]
        t0 = time.perf_counter()
        rewards = self.reward_fn(rows, texts_flat, [r.group_id for r in members]) if members else []
        verify_seconds = time.perf_counter() - t0
        if len(rewards) != len(members):
            raise RuntimeError(f"reward function returned {len(rewards)} rewards for {len(members)} responses")
        samples: list[TrainSample] = []
        scored = iter(zip(members, rows, texts_flat, rewards))
        for group_id, group_members in trained:
            part = [next(scored) for _ in group_members]
            advantages = group_advantages([float(rw.score) for *_, rw in part], self.cfg.adv_eps)
            for (r, row, text, rw), adv in zip(part, advantages):
                samples.append(TrainSample(
                    uid=r.uid, group_id=group_id, row_index=r.row_index, domain=str(row.get("domain")),
                    prompt_ids=r.prompt_ids, response_ids=r.token_ids, infer_logprobs=r.logprobs,
                    segments=r.segments, advantage=adv, reward=float(rw.score), finish_reason=r.finish_reason,
                    reward_reason=str(getattr(rw, "reason", "")), response_text=text, routes=r.routes))
        self.totals["groups_trained"] += len(trained)
        totals = {k: sum(part[3][k] for part in parts) + (len(trained) if k == "groups_trained" else 0)
                  for k in TOTALS}
        stats = merge_stats([part[2] for part in parts])
        stats.update(verify_seconds=verify_seconds, groups_trained=float(len(trained)),
                     train_rollouts=float(len(samples)),
                     train_tokens=float(sum(len(s.response_ids) for s in samples)))
        stats.update({f"total_{k}": float(v) for k, v in totals.items()})
        return StepBatch(samples, stats)

    def _count(self, st: dict[str, float]) -> None:
        """Add the step's counts to this engine's totals (engine 0 adds trained groups later)."""
        for k in TOTALS:
            if k != "groups_trained":
                self.totals[k] += int(st[k])

    def _shard_stats(self, st: dict[str, float]) -> dict[str, float]:
        """This engine's part of the step's stats (merged over the engines by `merge_stats`)."""
        return {**st, "pool_size": float(len(self.pool)), "waiting_finished": float(len(self.waiting)),
                "open_groups": float(len(self.groups))}

    def _new_stats(self) -> dict[str, float]:
        return {k: 0.0 for k in ("rollout_seconds", "generate_seconds", "generate_calls", "generated_tokens",
                                 "slot_tokens", "slot_capacity", "rollouts_finished", "carried_over_finished",
                                 "purged", "carried_over", "groups_dropped", "budget_tokens")}

    def pool_counts(self) -> dict[str, int]:
        """What this engine holds now (after a resume: its restored pools)."""
        return {"pool_rollouts": len(self.pool), "pool_tokens": sum(len(r.token_ids) for r in self.pool.values()),
                "waiting_rollouts": len(self.waiting)}

    # -- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "mode": self.mode,
                "rollouts_per_prompt": self.cfg.rollouts_per_prompt,
                "engine": self.peers.rank, "engines": self.peers.size,
                "pool": [asdict(r) for r in self.pool.values()],
                "waiting": [asdict(r) for r in self.waiting.values()],
                "groups": [asdict(g) for g in self.groups.values()],
                "to_start": list(self.to_start), "next_group": self.next_group,
                "rollouts_started": self.rollouts_started, "generate_calls": self.generate_calls,
                "totals": dict(self.totals),
                "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"scheduler checkpoint version {state.get('version')} is not {STATE_VERSION}")
        if state["mode"] != self.mode or state["rollouts_per_prompt"] != self.cfg.rollouts_per_prompt:
            raise ValueError(f"checkpoint is of a {state['mode']} scheduler with G={state['rollouts_per_prompt']}; "
                             f"this run is {self.mode} with G={self.cfg.rollouts_per_prompt}")
        if (state["engine"], state["engines"]) != (self.peers.rank, self.peers.size):
            raise ValueError(f"checkpoint is the pool of engine {state['engine']} of {state['engines']}; this is "
                             f"engine {self.peers.rank} of {self.peers.size}: resume with the same engines")
        self.pool = {d["uid"]: Rollout(**d) for d in state["pool"]}
        self.waiting = {d["uid"]: Rollout(**d) for d in state["waiting"]}
        self.groups = {d["group_id"]: Group(**d) for d in state["groups"]}
        self.to_start = deque(state["to_start"])
        self.next_group = int(state["next_group"])
        self.rollouts_started = int(state["rollouts_started"])
        self.generate_calls = int(state["generate_calls"])
        self.totals = {**self.totals, **state["totals"]}
        self.sampler.load_state_dict(state["sampler"])


# counters every engine keeps over the whole run (checkpointed; summed over engines in `total_*`)
TOTALS = ("purged", "carried_over_finished", "groups_dropped", "groups_trained", "generated_tokens",
          "rollouts_finished")
# how the engines' stats of one step combine: the phase's wall time is the slowest engine's, the
# rounds and the global budget count are the same on every engine; everything else adds up
_SLOWEST, _SHARED = ("rollout_seconds",), ("generate_calls", "budget_tokens")


def merge_stats(shards: list[dict[str, float]]) -> dict[str, float]:
    """One step's stats from every engine's share (engine order)."""
    out = {k: (max(s[k] for s in shards) if k in _SLOWEST else shards[0][k] if k in _SHARED
               else sum(s[k] for s in shards)) for k in shards[0]}
    out["engines"] = float(len(shards))
    out["generate_seconds_mean"] = out["generate_seconds"] / len(shards)
    out["generate_seconds_max"] = max(s["generate_seconds"] for s in shards)
    out["slot_utilization"] = out["slot_tokens"] / out["slot_capacity"] if out["slot_capacity"] else 0.0
    return out


class C3POScheduler(_Scheduler):
    """C3PO++: budgeted partitions over a continuously refilled pool (module docstring)."""

    mode = "c3po"

    def _refill(self) -> None:
        while len(self.pool) < self.pool_capacity:
            while self.to_start and self.groups[self.to_start[0]].started >= self.groups[self.to_start[0]].size:
                self.to_start.popleft()
            g = self.groups[self.to_start[0]] if self.to_start else self._open_group()
            self._start_member(g)

    def next_batch(self, version: int) -> StepBatch:
        started = time.perf_counter()
        st = self._new_stats()
        k, phi = self.peers.size, self.cfg.token_budget
        ready: list[Group] = []
        budget_tokens = 0   # C, over every engine
        ready_anywhere = 0  # resolved groups held by any engine
        while budget_tokens < phi or not ready_anywhere:
            self._refill()
            remaining = phi - budget_tokens if budget_tokens < phi else phi
            resolved, finished_tokens = self._generate(math.ceil(remaining / k), version, st)
            ready.extend(resolved)
            round_tokens, ready_anywhere = self.peers.all_reduce_sum([finished_tokens, len(ready)])
            budget_tokens += int(round_tokens)
        # end of the partition: retention, purge
        for r in list(self.pool.values()):
            if not r.token_ids:  # never started (the engine had no free slot for it): does not age
                continue
            r.retention += 1
            if r.retention > self.cfg.retention_limit:
                g = self._purge(r, st)
                if g is not None:
                    ready.append(g)
            else:
                st["carried_over"] += 1
        st["budget_tokens"] = float(budget_tokens)
        return self._finalize(ready, st, started)


class SyncScheduler(_Scheduler):
    """Baseline: prompts_per_step x G fresh rollouts, all generated to the end, then trained
    (with k engines, engine i gets groups i, k+i, ... of the step)."""

    mode = "sync"

    def next_batch(self, version: int) -> StepBatch:
        started = time.perf_counter()
        st = self._new_stats()
        if self.pool or self.waiting or self.groups:
            raise RuntimeError("sync scheduler: rollouts left over from a previous step")
        groups = [self._open_group() for _ in range(self.peers.rank, self.cfg.prompts_per_step, self.peers.size)]
        for g in groups:
            while g.started < g.size:
                self._start_member(g)
        self.to_start.clear()
        resolved, finished_tokens = self._generate(None, version, st)
        if self.pool:
            raise RuntimeError(f"the engine left {len(self.pool)} rollouts unfinished without a token budget")
        st["budget_tokens"] = float(self.peers.all_reduce_sum([finished_tokens])[0])
        return self._finalize(resolved, st, started)


def make_scheduler(mode: str, *args: Any, **kwargs: Any) -> _Scheduler:
    classes = {"c3po": C3POScheduler, "sync": SyncScheduler}
    if mode not in classes:
        raise ValueError(f"scheduler must be one of {sorted(classes)}, not {mode!r}")
    return classes[mode](*args, **kwargs)

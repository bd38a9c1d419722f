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

The scheduler's whole state (pools, open groups, sampler position, counters) is
`state_dict()` (JSON-able) and comes back with `load_state_dict()`, so a killed stage
resumes with the same unfinished rollouts. No torch / DeepSpeed here beyond the engine.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

from stages.rl.engines.protocol import RolloutEngine, RolloutRequest, SamplingParams
from stages.rl.loss import group_advantages
from stages.rl.prompt_sampler import PromptSampler

STATE_VERSION = 1


# -- rollouts, groups, samples -------------------------------------------------------------------
@dataclass
class Rollout:
    uid: str
    group_id: str
    row_index: int
    prompt_ids: list[int]
    max_new_tokens: int  # this rollout's whole response budget
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # pi_infer of each token, at sampling time
    segments: list[list[int]] = field(default_factory=list)  # [first token index, policy version]
    retention: int = 0  # partitions it lived through unfinished
    finished: bool = False
    finish_reason: str | None = None

    def token_versions(self) -> list[int]:
        out: list[int] = []
        bounds = self.segments + [[len(self.token_ids), -1]]
        for (start, v), (end, _) in zip(bounds, bounds[1:]):
            out.extend([v] * (end - start))
        return out

    @property
    def versions(self) -> set[int]:
        return {v for _, v in self.segments}

    @property
    def carried(self) -> bool:
        """Sampled by more than one policy version (it crossed a weight update)."""
        return len(self.versions) > 1


@dataclass
class Group:
    group_id: str
    row_index: int
    size: int
    started: int = 0
    finished: list[str] = field(default_factory=list)
    purged: list[str] = field(default_factory=list)

    @property
    def resolved(self) -> bool:
        return len(self.finished) + len(self.purged) == self.size


@dataclass
class TrainSample:
    """One finished rollout with its reward and advantage: what the learner trains on."""

    uid: str
    group_id: str
    row_index: int
    domain: str
    prompt_ids: list[int]
    response_ids: list[int]
    infer_logprobs: list[float]
    segments: list[list[int]]
    advantage: float
    reward: float
    finish_reason: str | None
    reward_reason: str = ""
    response_text: str = ""

    def token_versions(self) -> list[int]:
        return Rollout(self.uid, self.group_id, self.row_index, self.prompt_ids, len(self.response_ids),
                       self.response_ids, self.infer_logprobs, self.segments).token_versions()

    @property
    def carried(self) -> bool:
        return len({v for _, v in self.segments}) > 1


@dataclass
class StepBatch:
    samples: list[TrainSample]
    stats: dict[str, float]


# (prompt rows, decoded responses, GRPO group ids) -> one object with .score (and .reason) each
RewardFn = Callable[[list[dict], list[str], list[str]], list[Any]]


@dataclass
class SchedulerConfig:
    rollouts_per_prompt: int = 8        # G
    max_new_tokens: int = 65536         # response length cap
    prompts_per_step: int = 480         # sync: prompts per step
    pool_capacity: int = 3840           # C3PO++ Omega: unfinished rollouts decoded in parallel
    token_budget: int = 3840 * 4096     # C3PO++ Phi: finished-rollout tokens per partition
    retention_limit: int = 2            # C3PO++ sigma
    min_group_size: int = 2
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.rollouts_per_prompt < 1 or self.max_new_tokens < 1 or self.prompts_per_step < 1:
            raise ValueError("rollouts_per_prompt, max_new_tokens and prompts_per_step must be >= 1")
        if self.pool_capacity < self.rollouts_per_prompt:
            raise ValueError(f"pool_capacity ({self.pool_capacity}) must hold at least one group "
                             f"(rollouts_per_prompt = {self.rollouts_per_prompt})")
        if self.token_budget < 1 or self.retention_limit < 0:
            raise ValueError("token_budget must be >= 1 and retention_limit >= 0")
        if not 1 <= self.min_group_size <= self.rollouts_per_prompt:
            raise ValueError(f"min_group_size must be in [1, rollouts_per_prompt]; got {self.min_group_size}")


# -- the schedulers --------------------------------------------------------------------------------
class _Scheduler:
    mode = "base"

    def __init__(self, engine: RolloutEngine, cfg: SchedulerConfig, rows: Sequence[dict], prompt_ids: Sequence[list[int]],
                 sampler: PromptSampler, sampling: SamplingParams, decode: Callable[[list[int]], str],
                 reward_fn: RewardFn, max_new_tokens_fn: Callable[[int], int] | None = None):
        if len(rows) != len(prompt_ids):
            raise ValueError("rows and prompt_ids differ in length")
        self.engine, self.cfg, self.rows, self.prompt_ids = engine, cfg, rows, prompt_ids
        self.sampler, self.sampling, self.decode, self.reward_fn = sampler, sampling, decode, reward_fn
        # benchmark hook: the response cap of the n-th rollout ever started (<= max_new_tokens)
        self.max_new_tokens_fn = max_new_tokens_fn
        self.pool: dict[str, Rollout] = {}      # P: unfinished
        self.waiting: dict[str, Rollout] = {}   # Q: finished, group not yet resolved
        self.groups: dict[str, Group] = {}      # open (unresolved) groups
        self.to_start: deque[str] = deque()     # groups with unstarted members, oldest first
        self.next_group = 0
        self.rollouts_started = 0
        self.generate_calls = 0
        self.totals = {"purged": 0, "carried_over_finished": 0, "groups_dropped": 0, "groups_trained": 0,
                       "generated_tokens": 0, "rollouts_finished": 0}

    # -- pieces shared by both modes ---------------------------------------------------------
    def _open_group(self) -> Group:
        row = self.sampler.next()
        g = Group(f"g{self.next_group}", row, self.cfg.rollouts_per_prompt)
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
        requests = [RolloutRequest(uid=r.uid, prompt_ids=r.prompt_ids,
                                   max_new_tokens=r.max_new_tokens - len(r.token_ids),
                                   generated_ids=list(r.token_ids)) for r in rollouts]
        sampling = self.sampling
        if sampling.seed is not None:  # a fresh, reproducible seed per engine call (resumes replay it)
            sampling = replace(sampling, seed=sampling.seed + self.generate_calls)
        self.generate_calls += 1
        t0 = time.perf_counter()
        updates = self.engine.generate(requests, sampling, finished_token_budget=budget)
        st["rollout_seconds"] += time.perf_counter() - t0
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

    def _finalize(self, groups: list[Group], st: dict[str, float]) -> list[TrainSample]:
        """Rewards (one verifier call for the step) and group-normalised advantages."""
        trained: list[Group] = []
        for g in groups:
            del self.groups[g.group_id]
            if len(g.finished) >= self.cfg.min_group_size:
                trained.append(g)
            else:
                st["groups_dropped"] += 1
                for u in g.finished:
                    del self.waiting[u]
        members = [self.waiting.pop(u) for g in trained for u in g.finished]
        rows = [self.rows[r.row_index] for r in members]
        texts = [self.decode(r.token_ids) for r in members]
        t0 = time.perf_counter()
        rewards = self.reward_fn(rows, texts, [r.group_id for r in members]) if members else []
        st["verify_seconds"] += time.perf_counter() - t0
        if len(rewards) != len(members):
            raise RuntimeError(f"reward function returned {len(rewards)} rewards for {len(members)} responses")
        by_uid = {r.uid: (r, row, text, rw) for r, row, text, rw in zip(members, rows, texts, rewards)}
        samples: list[TrainSample] = []
        for g in trained:
            scores = [float(by_uid[u][3].score) for u in g.finished]
            for u, adv in zip(g.finished, group_advantages(scores, self.cfg.adv_eps)):
                r, row, text, rw = by_uid[u]
                samples.append(TrainSample(
                    uid=r.uid, group_id=g.group_id, row_index=r.row_index, domain=str(row.get("domain")),
                    prompt_ids=r.prompt_ids, response_ids=r.token_ids, infer_logprobs=r.logprobs,
                    segments=r.segments, advantage=adv, reward=float(rw.score), finish_reason=r.finish_reason,
                    reward_reason=str(getattr(rw, "reason", "")), response_text=text))
        st["groups_trained"] += len(trained)
        return samples

    def _new_stats(self) -> dict[str, float]:
        return {k: 0.0 for k in ("rollout_seconds", "verify_seconds", "generate_calls", "generated_tokens",
                                 "slot_tokens", "slot_capacity", "rollouts_finished", "carried_over_finished",
                                 "purged", "carried_over", "groups_trained", "groups_dropped", "budget_tokens")}

    def _close_stats(self, st: dict[str, float], samples: list[TrainSample]) -> dict[str, float]:
        for k in self.totals:
            self.totals[k] += int(st[k])
        st["slot_utilization"] = st["slot_tokens"] / st["slot_capacity"] if st["slot_capacity"] else 0.0
        st["pool_size"] = float(len(self.pool))
        st["waiting_finished"] = float(len(self.waiting))
        st["open_groups"] = float(len(self.groups))
        st["train_rollouts"] = float(len(samples))
        st["train_tokens"] = float(sum(len(s.response_ids) for s in samples))
        for k, v in self.totals.items():
            st[f"total_{k}"] = float(v)
        return st

    # -- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "mode": self.mode,
                "rollouts_per_prompt": self.cfg.rollouts_per_prompt,
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
        self.pool = {d["uid"]: Rollout(**d) for d in state["pool"]}
        self.waiting = {d["uid"]: Rollout(**d) for d in state["waiting"]}
        self.groups = {d["group_id"]: Group(**d) for d in state["groups"]}
        self.to_start = deque(state["to_start"])
        self.next_group = int(state["next_group"])
        self.rollouts_started = int(state["rollouts_started"])
        self.generate_calls = int(state["generate_calls"])
        self.totals = {**self.totals, **state["totals"]}
        self.sampler.load_state_dict(state["sampler"])


class C3POScheduler(_Scheduler):
    """C3PO++: budgeted partitions over a continuously refilled pool (module docstring)."""

    mode = "c3po"

    def _refill(self) -> None:
        while len(self.pool) < self.cfg.pool_capacity:
            while self.to_start and self.groups[self.to_start[0]].started >= self.groups[self.to_start[0]].size:
                self.to_start.popleft()
            g = self.groups[self.to_start[0]] if self.to_start else self._open_group()
            self._start_member(g)

    def next_batch(self, version: int) -> StepBatch:
        st = self._new_stats()
        ready: list[Group] = []
        budget_tokens = 0  # C
        while budget_tokens < self.cfg.token_budget or not ready:
            self._refill()
            remaining = self.cfg.token_budget - budget_tokens
            resolved, finished_tokens = self._generate(
                remaining if remaining > 0 else self.cfg.token_budget, version, st)
            ready.extend(resolved)
            budget_tokens += finished_tokens
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
        samples = self._finalize(ready, st)
        return StepBatch(samples, self._close_stats(st, samples))


class SyncScheduler(_Scheduler):
    """Baseline: prompts_per_step x G fresh rollouts, all generated to the end, then trained."""

    mode = "sync"

    def next_batch(self, version: int) -> StepBatch:
        st = self._new_stats()
        if self.pool or self.waiting or self.groups:
            raise RuntimeError("sync scheduler: rollouts left over from a previous step")
        groups = [self._open_group() for _ in range(self.cfg.prompts_per_step)]
        for g in groups:
            while g.started < g.size:
                self._start_member(g)
        self.to_start.clear()
        resolved, finished_tokens = self._generate(None, version, st)
        if self.pool:
            raise RuntimeError(f"the engine left {len(self.pool)} rollouts unfinished without a token budget")
        st["budget_tokens"] = float(finished_tokens)
        samples = self._finalize(resolved, st)
        return StepBatch(samples, self._close_stats(st, samples))


def make_scheduler(mode: str, *args: Any, **kwargs: Any) -> _Scheduler:
    classes = {"c3po": C3POScheduler, "sync": SyncScheduler}
    if mode not in classes:
        raise ValueError(f"scheduler must be one of {sorted(classes)}, not {mode!r}")
    return classes[mode](*args, **kwargs)

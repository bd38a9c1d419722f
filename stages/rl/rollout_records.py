"""What the rollout schedulers (stages/rl/scheduler.py) hand around: a rollout in progress, a
GRPO group, a finished sample the learner trains on, one step's batch; the reward function's
type and the schedulers' settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from stages.rl.engines.routes import Routes


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
    # the engine's MoE routes of prompt + response (engines/routes.py), from its latest encoding
    # (a carried-over rollout is re-encoded by the next policy; stages/rl/routing.py)
    routes: Routes | None = None

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
    routes: Routes | None = None  # as Rollout.routes

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

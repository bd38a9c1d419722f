"""Who generates the rollouts of an RL step, and how the trainer's ranks get them.

One implementation today, `Rank0Rollouts`: rank 0 owns the rollout engine (`rollout.engine`
on `rollout.device`; `auto` = rank 0's own device, i.e. colocated), the reward function and
the scheduler (C3PO++ or sync, scheduler.py); each step rank 0 schedules the batch and
broadcasts its samples to every rank. Data-parallel rollouts (an engine on every rank, the
prompts sharded, samples all-gathered) are another `Rollouts`; the trainer only calls
`next_batch` and checkpoints `stateful`. The engine is made here and nowhere else, through
the one factory `stages.rl.engines.create_engine`.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from stages.common.checkpoint import Stateful
from stages.common.distributed import broadcast, rank0_do, resolve_device
from stages.rl.engines.protocol import RolloutEngine, SamplingParams
from stages.rl.prompt_sampler import PromptSampler
from stages.rl.prompts import PromptSet
from stages.rl.scheduler import RewardFn, SchedulerConfig, TrainSample, make_scheduler
from stages.rl.settings import RLConfig


class Rollouts(Protocol):
    engine: RolloutEngine | None     # this rank's engine, if it has one
    reward_fn: RewardFn | None       # this rank's reward function, if it has one

    def next_batch(self, version: int, step: int) -> tuple[list[TrainSample], dict[str, float]]:
        """The samples of training step `step` (the same list on every rank), generated with
        policy version `version`, and the scheduler's stats (rank 0; {} elsewhere)."""
        ...

    @property
    def stateful(self) -> Stateful | None:
        """What this rank checkpoints of the rollouts (rank 0's is the one saved)."""
        ...


def scheduler_config(cfg: RLConfig) -> SchedulerConfig:
    return SchedulerConfig(rollouts_per_prompt=cfg.rollouts_per_prompt, max_new_tokens=cfg.max_len,
                           prompts_per_step=cfg.prompts_per_step, pool_capacity=cfg.pool_capacity,
                           token_budget=cfg.token_budget, retention_limit=cfg.c3po.retention_limit,
                           min_group_size=cfg.c3po.min_group_size, adv_eps=cfg.adv_eps)


class Rank0Rollouts:
    def __init__(self, rank: int, engine: RolloutEngine | None, reward_fn: RewardFn | None, scheduler):
        self.rank, self.engine, self.reward_fn, self.scheduler = rank, engine, reward_fn, scheduler

    @classmethod
    def start(cls, cfg: RLConfig, rank: int, model_dir, train_device, prompts: PromptSet | None,
              build_reward: Callable[[], RewardFn], decode: Callable[[list[int]], str]) -> "Rank0Rollouts":
        """Rank 0 builds the engine, the reward function and the scheduler over `prompts`; a
        failure there stops every rank with one StageError."""
        from stages.rl.engines import create_engine

        def start():
            engine = create_engine(cfg.rollout.engine, str(model_dir),
                                   device=resolve_device(cfg.rollout.device, "rollout.device", train_device),
                                   dtype=cfg.rollout.dtype, max_batch=cfg.rollout.max_batch,
                                   max_len=cfg.prompt_max_len + cfg.max_len, seed=cfg.seed,
                                   trust_remote_code=cfg.trust_remote_code, **cfg.rollout.options)
            reward_fn = build_reward()
            sampler = PromptSampler(prompts.groups, prompts.weights, seed=cfg.seed)
            sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
            scheduler = make_scheduler(cfg.scheduler, engine, scheduler_config(cfg), prompts.rows,
                                       prompts.prompt_ids, sampler, sampling, decode, reward_fn)
            return engine, reward_fn, scheduler

        built = rank0_do(rank, start, "starting the rollout engine and the reward")
        return cls(rank, *(built if rank == 0 else (None, None, None)))

    def next_batch(self, version: int, step: int) -> tuple[list[TrainSample], dict[str, float]]:
        batch = rank0_do(self.rank, lambda: self.scheduler.next_batch(version), f"step {step}: rollouts")
        samples = broadcast(batch.samples if self.rank == 0 else None)
        return samples, (batch.stats if self.rank == 0 else {})

    @property
    def stateful(self) -> Stateful | None:
        return self.scheduler

    @property
    def totals(self) -> dict[str, int]:
        return dict(self.scheduler.totals) if self.scheduler is not None else {}

    def pool_stats(self) -> dict[str, Any]:
        """What the scheduler holds now (rank 0): after a resume, the restored pools."""
        s = self.scheduler
        return {"resumed_pool_rollouts": len(s.pool),
                "resumed_pool_tokens": sum(len(r.token_ids) for r in s.pool.values()),
                "resumed_waiting_rollouts": len(s.waiting)}

"""Who generates the rollouts of an RL step, and how every rank gets them: `DataParallelRollouts`.

Every engine rank of the placement (placement.py: every rank when colocated, the last
`rollout.gpus` ranks when split) runs a rollout engine on its own device and one shard of
the scheduler (scheduler.py: groups sharded over the engines, never split; one global C3PO++
token budget and retention rule). Engine 0 also holds the reward function: each step it
scores the finished groups of every engine in one call, and sends the step's samples and
stats to every rank (the trainers train on them). The engines' group is their default
process world (all ranks when colocated, the engine ranks' own world when split); the
samples reach the trainers over `Ranks.everyone`.

Rank 0 loads the prompts (`RLSpec.load_prompts`) and hands them to the engines; a failure
while an engine or the reward is built, or while a step is scored, stops every rank with
one StageError. The engines are made here and nowhere else, through the one factory
`stages.rl.engines.create_engine`. Colocated engines `sleep()` while their rank trains
(`rollout.sleep`: release the KV cache, or the KV cache and the weights) and `wake()` before
the weight sync; engines of a split placement own their GPU and never sleep.
"""
from __future__ import annotations

from typing import Any, Callable

from stages.common.checkpoint import Stateful
from stages.common.distributed import Ranks, every_rank_do, make_group, resolve_device, run_on
from stages.common.groups import WorldGroup
from stages.rl.engines import create_engine
from stages.rl.engines.protocol import RolloutEngine, SamplingParams
from stages.rl.placement import Placement
from stages.rl.prompt_sampler import PromptSampler
from stages.rl.prompts import PromptSet
from stages.rl.rollout_records import RewardFn, SchedulerConfig, TrainSample
from stages.rl.scheduler import make_scheduler
from stages.rl.settings import BUCKETED_SYNC_ENGINES, ROUTE_RECORDING_ENGINES, RLConfig


def scheduler_config(cfg: RLConfig) -> SchedulerConfig:
    return SchedulerConfig(rollouts_per_prompt=cfg.rollouts_per_prompt, max_new_tokens=cfg.max_len,
                           prompts_per_step=cfg.prompts_per_step, pool_capacity=cfg.pool_capacity,
                           token_budget=cfg.token_budget, retention_limit=cfg.c3po.retention_limit,
                           min_group_size=cfg.c3po.min_group_size, adv_eps=cfg.adv_eps)


def engine_options(cfg: RLConfig) -> dict[str, Any]:
    """`rollout.options`, plus what the RL loop needs of an engine that can record a MoE
    policy's routes (the learner's expert-choice metric and routing replay: routing.py), and
    the weight sync's bucket size for an engine that stages the sync in buckets of its own."""
    recording = {"record_routes": True} if cfg.rollout.engine in ROUTE_RECORDING_ENGINES else {}
    buckets = {"sync_bucket_mb": cfg.rollout.sync_bucket_mb} if cfg.rollout.engine in BUCKETED_SYNC_ENGINES else {}
    return {**recording, **buckets, **cfg.rollout.options}


class DataParallelRollouts:
    def __init__(self, cfg: RLConfig, placement: Placement, ranks: Ranks, engine: RolloutEngine | None,
                 reward_fn: RewardFn | None, scheduler, step_metrics: Callable[[RewardFn], dict[str, float]]):
        self.cfg, self.placement, self.ranks = cfg, placement, ranks
        self.engine, self.reward_fn, self.scheduler, self.step_metrics = engine, reward_fn, scheduler, step_metrics
        self.totals: dict[str, int] = {}  # the scheduler counters over every engine (rank 0)

    @classmethod
    def start(cls, cfg: RLConfig, placement: Placement, ranks: Ranks, model_dir, prompts: PromptSet | None,
              build_reward: Callable[[], RewardFn], decode: Callable[[list[int]], str],
              step_metrics: Callable[[RewardFn], dict[str, float]]) -> "DataParallelRollouts":
        """Rank 0's `prompts` go to every rank; each engine rank builds its engine and scheduler
        shard, engine 0 the reward function too."""
        prompts = ranks.everyone.broadcast_object(prompts, 0)
        # the scheduler shards' group: the engines' default world, or with tensor-parallel engines
        # (placement.py) their first ranks only (every rank makes the group)
        peers = (WorldGroup(device=ranks.device) if placement.tp == 1
                 else make_group(ranks, "engines", list(placement.engines)))

        def start() -> tuple[Any, Any, Any]:
            if not placement.is_engine:
                return None, None, None
            # each engine its own seed: the scheduler seeds every call per engine, but a request the
            # engine samples without one (vLLM's `request_seeds: false`) draws from the engine's
            # generator, which would give every engine the same noise; engine 0 keeps the stage seed
            engine_seed = cfg.seed + placement.engines.index(ranks.rank)
            engine = create_engine(cfg.rollout.engine, str(model_dir),
                                   device=resolve_device(cfg.rollout.device, "rollout.device", ranks.device),
                                   dtype=cfg.rollout.dtype, max_batch=cfg.rollout.max_batch,
                                   max_len=cfg.prompt_max_len + cfg.max_len, seed=engine_seed,
                                   trust_remote_code=cfg.trust_remote_code, **engine_options(cfg))
            reward_fn = build_reward() if ranks.rank == placement.engine0 else None
            sampler = PromptSampler(prompts.groups, prompts.weights, seed=cfg.seed)
            sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
            scheduler = make_scheduler(cfg.scheduler, engine, scheduler_config(cfg), prompts.rows,
                                       prompts.prompt_ids, sampler, sampling, decode, reward_fn,
                                       peers=peers)
            return engine, reward_fn, scheduler

        built = every_rank_do(ranks.everyone, start, "starting the rollout engines and the reward")
        return cls(cfg, placement, ranks, *built, step_metrics)

    # -- a step ------------------------------------------------------------------------------------
    def next_batch(self, version: int, step: int) -> tuple[list[TrainSample], dict[str, float]]:
        """The samples of training step `step`, generated with policy version `version`, on
        every rank; the step's stats (scheduler + the reward's own metrics) with them."""
        if self.scheduler is not None and self.ranks.rank != self.placement.engine0:
            self.scheduler.next_batch(version)  # this engine's shard; engine 0 assembles the batch

        def assemble() -> tuple[list[TrainSample], dict[str, float]]:
            batch = self.scheduler.next_batch(version)
            return batch.samples, {**batch.stats, **self.step_metrics(self.reward_fn)}

        samples, stats = run_on(self.ranks.everyone, self.placement.engine0, assemble,
                                f"step {step}: rollouts", share=True)
        self.totals = {k.removeprefix("total_"): int(v) for k, v in stats.items() if k.startswith("total_")}
        return samples, stats

    def sleep(self) -> None:
        """Colocated: release what `rollout.sleep` says while this rank trains."""
        if self.engine is not None and not self.placement.split and self.cfg.rollout.sleep != "none":
            self.engine.sleep(weights=self.cfg.rollout.sleep == "weights")

    def wake(self) -> None:
        if self.engine is not None and not self.placement.split and self.cfg.rollout.sleep != "none":
            self.engine.wake()

    def on_engine0(self, fn: Callable[[RolloutEngine], Any], what: str) -> Any:
        """`fn(engine 0's engine)`, its result on every rank (a failure stops every rank)."""
        return run_on(self.ranks.everyone, self.placement.engine0, lambda: fn(self.engine), what, share=True)

    # -- checkpoints ---------------------------------------------------------------------------------
    @property
    def stateful(self) -> Stateful | None:
        """This rank's scheduler shard (a per-rank Stateful; None on a rank without an engine)."""
        return self.scheduler

    def resumed_stats(self) -> dict[str, Any]:
        """After a resume (every rank calls it): what the engines hold, summed over them."""
        sums = None
        if self.scheduler is not None:
            mine = self.scheduler.pool_counts() | {f"total_{k}": v for k, v in self.scheduler.totals.items()}
            keys = sorted(mine)
            sums = dict(zip(keys, map(int, self.scheduler.peers.all_reduce_sum([mine[k] for k in keys]))))
        sums = self.ranks.everyone.broadcast_object(sums, self.placement.engine0)
        self.totals = {k.removeprefix("total_"): v for k, v in sums.items() if k.startswith("total_")}
        return {f"resumed_{k}": v for k, v in sums.items() if not k.startswith("total_")}

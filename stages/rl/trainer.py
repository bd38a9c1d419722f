"""The one RL training loop, for `reasoning_rl` and `general_rl` (what each plugs in: spec.py).

    RLTrainer(job, cfg, spec).train()

Set-up (every rank joins a process group: CPU ranks on gloo, GPUs on nccl): the policy's HF
dir and tokenizer; rank 0 loads the prompts (`spec.load_prompts`); the stage's hooks; the
policy under DeepSpeed with its learner (policy.py); the rollouts (rollouts.py: rank 0 owns
the engine, the reward `spec.build_reward` and the scheduler); the weight sync
(weight_sync.py); the Checkpointer (stages/common/checkpoint.py) over the Statefuls below.

The loop, one optimizer update (x `updates_per_batch`) per step:
1. the step's samples: generated with policy version v = step (v counts the updates applied;
   a rollout carried over keeps the versions of its earlier tokens, scheduler.py), the same
   list on every rank;
2. the update (learner.py): pi_train(theta_old) once, then the IcePop / TIS / GRPO loss;
3. the new weights pushed to the engine(s), timed;
4. rank 0 logs the step's metrics (metrics.py, the reward's own `spec.step_metrics`) and a
   few sample rollouts to MLflow;
5. every `checkpoint_every` steps and at the end, a checkpoint.

Checkpoints hold the DeepSpeed state, every rank's RNG, `Progress` (the step and the metric
history), the rollouts' state (scheduler pools, open groups, sampler position, counters) and
the hooks' state. A restarted job resumes from the latest one with the same unfinished
rollouts, after pushing the restored weights to the engine; one written with another world
size is refused.

Outputs (rank 0, job.output_dir): the final policy as a Hugging Face dir + tokenizer,
`metrics.jsonl` (one line per step), `stage_summary.json`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.stage_api import StageJob
from pipeline.tracking import info
from stages.common.checkpoint import Checkpointer, StatefulDataclass
from stages.common.distributed import rank0_do
from stages.common.hf_io import eos_token_ids_of, save_hf_model
from stages.common.training_job import start_training_job
from stages.rl.decoding import make_decoder
from stages.rl.metrics import batch_metrics, sample_text, summarize
from stages.rl.policy import build_policy
from stages.rl.rollouts import Rank0Rollouts
from stages.rl.settings import RLConfig
from stages.rl.spec import RLContext, RLSpec
from stages.rl.weight_sync import GatherToRank0


@dataclass
class Progress(StatefulDataclass):
    step: int = 0                                                 # training steps done
    history: list[dict[str, float]] = field(default_factory=list)  # rank 0's metrics, one per step


class RLTrainer:
    def __init__(self, job: StageJob, cfg: RLConfig, spec: RLSpec):
        self.cfg, self.spec = cfg, spec
        setup = start_training_job(job, cfg)
        self.ranks = ranks = setup.ranks
        self.rank = ranks.rank
        tokenizer = setup.tokenizer
        eos = set(eos_token_ids_of(setup.model_dir, trust_remote_code=cfg.trust_remote_code)) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.ctx = ctx = RLContext(job, cfg, ranks, setup.model_dir, tokenizer, make_decoder(tokenizer, sorted(eos)),
                                   setup.log)
        self.log = ctx.log

        self.prompts = rank0_do(self.rank, lambda: spec.load_prompts(ctx), "loading the prompts")
        self.hooks = spec.build_hooks(ctx)
        self.policy = build_policy(cfg, setup.model_dir, ranks, setup.bf16, setup.pad_id)
        self.rollouts = Rank0Rollouts.start(cfg, self.rank, setup.model_dir, ranks.device, self.prompts,
                                            lambda: spec.build_reward(ctx), ctx.decode)
        self.weight_sync = GatherToRank0(self.policy.module, self.rollouts.engine, self.rank, cfg.zero_stage == 3)
        self.progress = Progress()
        self.checkpointer = Checkpointer(job, self.policy.ds_engine, ranks, {
            "progress": self.progress, "rollouts": self.rollouts.stateful, "hooks": self.hooks})

    # -- the stage ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any] | None:
        cfg, name = self.cfg, self.spec.name
        resumed_from = self.checkpointer.resume()
        resumed: dict[str, Any] = {}
        if resumed_from is not None:
            sync_s = self.weight_sync.push()
            if self.rank == 0:
                resumed = self.rollouts.pool_stats()
                info(f"{name}: resumed from step {resumed_from} with {resumed['resumed_pool_rollouts']} unfinished "
                     f"rollouts in the pool (weights pushed to the engine in {sync_s:.2f}s)")
        if self.rank == 0:
            info(f"{name}: {self.prompts.description}, scheduler {cfg.scheduler}, correction {cfg.correction}, "
                 f"world {self.ranks.world}, frozen {len(self.policy.frozen)} params, "
                 f"steps {self.progress.step}..{cfg.steps}")
        self.hooks.before_training(self)
        for step in range(self.progress.step, cfg.steps):
            self.train_step(step)
            self.progress.step = step + 1
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                self.checkpointer.save(step + 1)
        hooks_summary = self.hooks.after_training(self)
        return self.write_outputs({"resumed_from_step": resumed_from, **resumed, **hooks_summary})

    def train_step(self, step: int) -> None:
        """One step: samples generated by policy version `step`, one update, weights pushed."""
        t_step = time.perf_counter()
        version = step  # updates applied so far
        samples, stats = self.rollouts.next_batch(version, step + 1)
        t0 = time.perf_counter()
        train_stats = self.policy.learner.train(samples, version)
        t_train = time.perf_counter() - t0
        sync_s = self.weight_sync.push()
        if self.rank != 0:
            return
        m = {**stats, **train_stats, **batch_metrics(samples), **self.spec.step_metrics(self.rollouts.reward_fn),
             "train_seconds": t_train, "weight_sync_seconds": sync_s}
        engine_sync = getattr(self.rollouts.engine, "last_sync_seconds", None)
        if engine_sync is not None:
            m["engine_sync_seconds"] = float(engine_sync)
        m["step_seconds"] = time.perf_counter() - t_step
        m["generated_tokens_per_second"] = m["generated_tokens"] / m["rollout_seconds"] if m["rollout_seconds"] else 0.0
        m["policy_version"] = float(version + 1)
        self.progress.history.append(m)
        self.log.metrics(step + 1, m)
        if self.cfg.sample_rollouts:
            self.log.text(sample_text(self.ctx.tokenizer, samples, self.cfg.sample_rollouts, step + 1),
                          f"rollouts/step_{step + 1:06d}.txt")

    def write_outputs(self, extra: dict[str, Any]) -> dict[str, Any] | None:
        """The policy as a HF dir (every rank joins a ZeRO-3 gather), metrics.jsonl and the
        summary (rank 0)."""
        cfg, out = self.cfg, Path(self.ctx.job.output_dir)
        save_hf_model(self.policy.ds_engine, self.policy.module, self.ctx.model_dir, out, cfg.zero_stage, self.rank)
        if self.rank != 0:
            return None
        history = self.progress.history
        summary = summarize(history, self.rollouts.totals, {
            "scheduler": cfg.scheduler, "correction": cfg.correction, "world_size": self.ranks.world,
            "frozen_params": len(self.policy.frozen), "frozen_param_names": self.policy.frozen[:20],
            "pool_capacity": cfg.pool_capacity, "token_budget": cfg.token_budget,
            "retention_limit": cfg.c3po.retention_limit, **self.prompts.summary, **extra})
        with open(out / "metrics.jsonl", "w") as f:
            for i, h in enumerate(history, 1):
                f.write(json.dumps({"step": i, **{k: v for k, v in h.items() if math.isfinite(v)}}) + "\n")
        (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
        info(f"{self.spec.name}: done: " + json.dumps({k: summary[k] for k in (
            "steps", "reward_first", "reward_last", "carried_over_trained", "purged")}))
        return summary

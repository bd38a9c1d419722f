"""The supervised training loop of the sft and reward_model kinds, written once: a kind plugs
in a `SupervisedTask` (its data, its model, one step's forward / backward and its metrics,
its outputs), as an RL kind plugs an `RLSpec` into `RLTrainer`.

`train_supervised(job, cfg, make_task)`, top to bottom:
1. `start_training_job` (process group, seed, input model + tokenizer), then `make_task(setup)`
   reads the kind's data (each node's local rank 0 first) and says how many items (packs,
   pairs) the `DataPlan` schedules;
2. the schedule: `max_steps`, else `epochs` x the plan's steps per epoch; the task reports
   its data (rank 0) and may refuse the run (StageError);
3. the model under DeepSpeed (`supervised_engine`: AdamW, warmup + cosine, ZeRO);
4. resume from the stage's latest checkpoint (weights, optimizer, schedule, the task's
   `progress`, every rank's RNG; refused when the world size or the task's fingerprint
   changed), then the task's `before_training` (e.g. the held-out evaluation of the
   untrained model);
5. the loop: each optimizer step trains the `grad_accum` micro batches the plan gives this
   rank (`task.train_step`, told the next step's too), then the task turns the step into metrics; rank 0 prints one
   line per step, metrics go out every `log_every` steps (and the last), a checkpoint every
   `checkpoint_every` steps;
6. rank 0 (ZeRO-3 weights gathered on every rank first) writes the model as a HF directory
   with the input model's tokenizer files (with `lora:`, the merged model or the adapter:
   stages/common/lora.py), the task's own files and stage_summary.json.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from stages.common.checkpoint import Checkpointer, StatefulDataclass
from stages.common.contract import StageJob
from stages.common.data_plan import DataPlan
from stages.common.lora import publish_trained_model
from stages.common.stage_log import info
from stages.common.training_job import TrainingJob, start_training_job, supervised_engine
from stages.common.training_settings import SupervisedSettings


@dataclass
class TrainingProgress(StatefulDataclass):
    """Where a supervised stage stands (checkpointed): optimizer steps and data position; a
    kind's subclass adds its own counters."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


@dataclass
class SupervisedRun:
    """What the trainer set up, handed to the task's hooks."""

    job: StageJob
    cfg: Any  # the kind's config: SupervisedSettings and the kind's own fields
    setup: TrainingJob
    plan: DataPlan
    total_steps: int
    engine: Any = None  # the DeepSpeed engine
    scheduler: Any = None  # its learning-rate schedule
    attn: str = ""  # the attention implementation the model got
    resumed_from: int | None = None


@dataclass
class StepReport:
    """One optimizer step as the task tells it: `line` follows `<kind> step N/T | ` on rank 0's
    console; `metrics` are logged every `log_every` steps, or now with `log_now`."""

    metrics: dict[str, float]
    line: str
    log_now: bool = False


class SupervisedTask(Protocol):
    """What a supervised kind plugs into `train_supervised`."""

    name: str  # the kind's name, in front of its log lines
    progress: TrainingProgress  # checkpointed
    items: int  # what the DataPlan schedules (sft: packs, reward_model: pairs)
    fingerprint: dict[str, Any]  # what a resumed run must have unchanged (beyond the world size)
    packed: bool  # the batches pack several samples per row (choose_attention's "auto" depends on it)
    ds_config_updates: dict[str, Any]  # top-level DeepSpeed config keys the task sets itself (sft's speed options)

    def describe(self, run: SupervisedRun) -> None:
        """Check the schedule (StageError) and report the data and the plan (rank 0 prints)."""

    def load_model(self, attn: str) -> torch.nn.Module:
        """The model to train, loaded with the attention implementation `attn`."""

    def before_training(self, run: SupervisedRun) -> None:
        """After the resume, before the first step."""

    def train_step(self, run: SupervisedRun, micro: list[list[int]], upcoming: list[list[int]] | None) -> Any:
        """Forward, backward and `engine.step()` of each micro batch (item indices) of the step.
        `upcoming`: the next step's micro batches (None with the last step), for a task that
        prepares their host-side work while the GPU runs this step."""

    def report(self, run: SupervisedRun, trained: Any, lr: float, seconds: float) -> StepReport:
        """The step just counted in `progress` (what `train_step` returned, the lr it ran with)."""

    def trained_module(self, engine) -> torch.nn.Module:
        """The HF model inside the engine's module (what is saved)."""

    def outputs(self, run: SupervisedRun, out: Path) -> dict[str, Any]:
        """Rank 0: the task's own output files; returns the stage summary."""


def _resume(run: SupervisedRun, task: SupervisedTask) -> Checkpointer:
    ckpt = Checkpointer(run.job, run.engine, run.setup.ranks, {"progress": task.progress},
                        fingerprint=task.fingerprint)
    run.resumed_from = ckpt.resume()
    p = task.progress
    if run.resumed_from is not None and run.setup.ranks.rank == 0:
        info(f"{task.name}: resumed from checkpoint step {p.step} (epoch {p.epoch + 1}, step "
             f"{p.step_in_epoch} of the epoch)")
    run.setup.log.progress(p.step, total=run.total_steps)  # the console's ETA
    return ckpt


def _train(run: SupervisedRun, task: SupervisedTask, ckpt: Checkpointer) -> None:
    cfg, p, rank = run.cfg, task.progress, run.setup.ranks.rank
    run.engine.train()
    while p.step < run.total_steps:
        p.epoch, p.step_in_epoch = run.plan.position(p.epoch, p.step_in_epoch)
        upcoming = (run.plan.step_micro_batches(*run.plan.position(p.epoch, p.step_in_epoch + 1), rank)
                    if p.step + 1 < run.total_steps else None)
        t0 = time.perf_counter()
        lr = run.scheduler.get_last_lr()[0]
        trained = task.train_step(run, run.plan.step_micro_batches(p.epoch, p.step_in_epoch, rank), upcoming)
        p.step, p.step_in_epoch = p.step + 1, p.step_in_epoch + 1
        report = task.report(run, trained, lr, time.perf_counter() - t0)
        if rank == 0:
            info(f"{task.name} step {p.step}/{run.total_steps} | {report.line}")
        if p.step % cfg.log_every == 0 or p.step == run.total_steps or report.log_now:
            run.setup.log.metrics(p.step, report.metrics)
        if p.step % cfg.checkpoint_every == 0 and p.step < run.total_steps:
            ckpt.save(p.step)
            if rank == 0:
                info(f"{task.name}: checkpoint step {p.step} saved under {ckpt.store.stage_url}/checkpoints")


def train_supervised(job: StageJob, cfg: SupervisedSettings,
                     make_task: Callable[[TrainingJob], SupervisedTask]) -> dict[str, Any] | None:
    """Run a supervised kind's stage (see the module docstring); the summary on rank 0."""
    setup = start_training_job(job, cfg)
    task = make_task(setup)
    plan = DataPlan(task.items, setup.ranks.world, cfg.micro_batch_size, cfg.grad_accum, cfg.seed)
    run = SupervisedRun(job, cfg, setup, plan, cfg.max_steps or cfg.epochs * plan.steps_per_epoch)
    task.describe(run)
    run.engine, run.scheduler, run.attn = supervised_engine(cfg, setup, run.total_steps, task.load_model,
                                                            packed=task.packed, ds_updates=task.ds_config_updates)
    ckpt = _resume(run, task)
    task.before_training(run)
    _train(run, task, ckpt)
    out = Path(job.output_dir)
    lora = publish_trained_model(job, cfg.model, run.engine, task.trained_module(run.engine), cfg.lora,
                                 setup.model_dir, cfg.zero_stage, setup.ranks.rank, setup.published_dtype)
    if setup.ranks.rank != 0:
        return None
    summary = task.outputs(run, out)
    if lora is not None:
        summary["lora"] = lora
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    return summary

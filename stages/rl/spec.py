"""What an RL stage plugs into the one RL trainer (trainer.py): the torchtitan split of a
`TrainSpec` of builders and one generic `Trainer`.

A stage's job is its config plus an `RLSpec`:
- `load_prompts(ctx) -> PromptSet` (rank 0): read and render the prompts, say how they are
  grouped and weighted for sampling (reasoning RL: domains; general RL: prompt sources);
- `build_reward(ctx) -> RewardFn` (rank 0): the scheduler's reward function
  `(rows, texts, group ids) -> [obj with .score, .reason]`;
- `step_metrics(reward_fn) -> dict` (rank 0, after each step): the reward's own metrics;
- `build_hooks(ctx) -> RLHooks` (every rank): work before and after the training loop
  (general RL's reasoning guard); a Stateful, checkpointed with the rest.
Everything else, the loop, the engine, the scheduler, the weight sync, checkpoints and
resume, the outputs, is the trainer's and exists once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from stages.common.contract import StageJob
from stages.common.distributed import Ranks
from stages.rl.prompts import PromptSet
from stages.rl.rollout_records import RewardFn
from stages.rl.settings import RLConfig

if TYPE_CHECKING:
    from stages.common.stage_log import StageLogger
    from stages.rl.decoding import Decoded
    from stages.rl.trainer import RLTrainer


@dataclass
class RLContext:
    """What the builders are given."""

    job: StageJob
    cfg: RLConfig
    ranks: Ranks
    model_dir: Path          # the policy's HF directory (local)
    tokenizer: Any
    decode: Callable[[list[int]], "Decoded"]  # response ids -> text, as the reward sees it
    log: "StageLogger"


class RLHooks:
    """Work before and after the training loop, called on every rank (a hook does rank-0 work
    through `stages.common.distributed.run_on`, or on engine 0 through
    `trainer.rollouts.on_engine0`). What it must remember across a restart is
    its `state_dict()`. This base does nothing."""

    def before_training(self, trainer: "RLTrainer") -> None:
        return None

    def after_training(self, trainer: "RLTrainer") -> dict[str, Any]:
        """Fields for the stage summary (rank 0)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def no_step_metrics(reward_fn: RewardFn) -> dict[str, float]:
    return {}


def no_hooks(ctx: RLContext) -> RLHooks:
    return RLHooks()


@dataclass(frozen=True)
class RLSpec:
    name: str  # the stage kind, for log lines
    load_prompts: Callable[[RLContext], PromptSet]
    build_reward: Callable[[RLContext], RewardFn]
    step_metrics: Callable[[RewardFn], dict[str, float]] = field(default=no_step_metrics)
    build_hooks: Callable[[RLContext], RLHooks] = field(default=no_hooks)

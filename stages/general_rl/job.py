"""The `general_rl` stage (RLHF): `python -m stages.general_rl.job --job job.json`.

GRPO on a weighted prompt mix, trained by the one RL trainer (stages/rl/trainer.py) with the
same engines, scheduler, loss and checkpoints as reasoning RL. What this stage plugs in:
- prompts: every `data` source is read (prompts.py) and sampled by its weight (the
  scheduler's PromptSampler over sources instead of domains);
- reward: `rewards.GeneralReward` on rank 0: reward-model scores (RewardScorer, batched on
  `reward.rm_device`: CPU here, a GPU of rank 0's node at scale), verifier scores for rows
  with a reference (instruction constraints, math, ...), format and length penalties,
  combined per GRPO group; its parts are logged per step;
- hooks: the reasoning guard (reasoning_guard.py), before the first step and after the last.
"""
from __future__ import annotations

import sys
from typing import Any

from stages.common.contract import StageError, StageJob
from stages.common.distributed import resolve_device
from stages.common.entry import run_job
from stages.general_rl.config import GeneralRLConfig
from stages.general_rl.prompts import load_sources
from stages.general_rl.reasoning_guard import ReasoningGuard
from stages.general_rl.rewards import GeneralReward
from stages.reward_model.scoring import RewardScorer
from stages.rl.prompts import PromptSet, render_prompts
from stages.rl.settings import reward_grading
from stages.rl.spec import RLContext, RLSpec
from stages.rl.trainer import RLTrainer
from verifiers import VERIFIERS, verify_batch


def load_prompts(ctx: RLContext) -> PromptSet:
    cfg: GeneralRLConfig = ctx.cfg  # type: ignore[assignment]
    sources = {name: src.paths for name, src in cfg.data.items()}
    rows, by_source, skipped = load_sources(ctx.job.fetch, sources, set(VERIFIERS))
    kept, prompt_ids, index = render_prompts(rows, ctx.tokenizer, cfg.prompt_max_len)
    new_pos = {old: new for new, old in enumerate(index)}
    by_source = {s: [new_pos[i] for i in idx if i in new_pos] for s, idx in by_source.items()}
    too_long = len(rows) - len(kept)
    empty = sorted(s for s, idx in by_source.items() if not idx and cfg.data[s].weight > 0)
    if empty:
        raise StageError(f"prompt sources {empty}: every prompt is longer than prompt_max_len="
                         f"{cfg.prompt_max_len} tokens")
    by_source = {s: v for s, v in by_source.items() if v}
    skipped = {**dict(skipped), **({"longer than prompt_max_len": too_long} if too_long else {})}
    sizes = {s: len(v) for s, v in by_source.items()}
    weights = {s: cfg.data[s].weight for s in by_source}
    return PromptSet(kept, prompt_ids, by_source, weights,
                     summary={"prompts": len(kept), "prompts_skipped": skipped, "prompts_per_source": sizes,
                              "source_weights": weights},
                     description=f"{len(kept)} prompts from sources {sizes} (skipped {skipped})")


def build_reward(ctx: RLContext) -> GeneralReward:
    cfg: GeneralRLConfig = ctx.cfg  # type: ignore[assignment]
    scorer = None
    if cfg.reward.rm_weight > 0:
        rm_device = resolve_device(cfg.reward.rm_device, "reward.rm_device", ctx.ranks.device)
        try:
            scorer = RewardScorer(ctx.job.fetch(cfg.reward_model), device=rm_device, batch_size=cfg.reward.rm_batch_size,
                                  trust_remote_code=cfg.trust_remote_code)
        except FileNotFoundError as e:
            raise StageError(f"reward_model {cfg.reward_model}: {e}") from None
    return GeneralReward(cfg.reward, cfg.max_len, scorer=scorer, verify_batch=verify_batch,
                         verifier_workers=cfg.verifier_workers, verifier_timeout_s=cfg.verifier_timeout_s,
                         grading=reward_grading(cfg))


def reward_metrics(reward_fn: GeneralReward) -> dict[str, float]:
    """Means of the reward's parts over the last batch, overall and per source, and the reward
    monitor's metrics of its verified rows."""
    rows, results = reward_fn.last_batch
    if not results:
        return {}
    out: dict[str, float] = {}
    keys = sorted({k for r in results for k in r.parts})
    for k in keys:
        vals = [r.parts[k] for r in results if k in r.parts]
        out[f"reward_part/{k}"] = sum(vals) / len(vals)
        out[f"reward_part_rate/{k}"] = len(vals) / len(results)
    per: dict[str, list[float]] = {}
    for row, r in zip(rows, results):
        per.setdefault(row["source"], []).append(r.score)
    for s, v in sorted(per.items()):
        out[f"reward_mean_source/{s}"] = sum(v) / len(v)
    out.update(reward_fn.last_seconds)
    out.update(reward_fn.last_monitor)
    return out


SPEC = RLSpec(name="general_rl", load_prompts=load_prompts, build_reward=build_reward,
              step_metrics=reward_metrics, build_hooks=ReasoningGuard)


def main(job: StageJob, cfg: GeneralRLConfig) -> dict[str, Any] | None:
    return RLTrainer(job, cfg, SPEC).train()


if __name__ == "__main__":
    sys.exit(run_job(main, GeneralRLConfig))

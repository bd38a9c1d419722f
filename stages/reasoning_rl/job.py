"""The `reasoning_rl` stage (RLVR): `python -m stages.reasoning_rl.job --job job.json`.

GRPO with IcePop (or TIS / none) on verifiable prompts, rollouts scheduled by C3PO++ (or
sync), trained by the one RL trainer (stages/rl/trainer.py). What this stage plugs in:
- prompts: the RL rows of `data` (data.py), rendered with the policy's chat template, rows
  longer than `prompt_max_len` skipped; sampled by domain, weighted by `domain_weights`
  (default: each domain's row count); every domain needs a registered verifier;
- reward: the verifiers' score of each response (`verifiers.verify_batch`, in
  `verifier_workers` processes), under the stage's `grading` (strict by default:
  verifiers/grading.py).
"""
from __future__ import annotations

import sys
from typing import Any

from stages.common.contract import StageError, StageJob
from stages.common.entry import run_job
from stages.common.stage_log import info
from stages.reasoning_rl.config import ReasoningRLConfig
from stages.reasoning_rl.data import load_rows, require_verifiers, rows_by_domain
from stages.rl.prompts import PromptSet, render_prompts
from stages.rl.settings import reward_grading
from stages.rl.spec import RLContext, RLSpec
from stages.rl.trainer import RLTrainer
from verifiers import verify_batch
from verifiers.grading import with_grading
from verifiers.monitor import RewardMonitor


def load_prompts(ctx: RLContext) -> PromptSet:
    cfg = ctx.cfg
    rows = load_rows(ctx.job.fetch, cfg.data_list)
    kept, prompt_ids, _ = render_prompts(rows, ctx.tokenizer, cfg.prompt_max_len)
    skipped = len(rows) - len(kept)
    if not kept:
        raise StageError(f"every RL prompt is longer than prompt_max_len={cfg.prompt_max_len} tokens")
    require_verifiers(kept, "RL data")
    domains = rows_by_domain(kept)
    if cfg.domain_weights is not None:
        missing = sorted(set(cfg.domain_weights) - set(domains))
        if missing:
            raise StageError(f"domain_weights name domains absent from the RL data: {missing} "
                             f"(data domains: {sorted(domains)})")
    sizes = {d: len(v) for d, v in domains.items()}
    return PromptSet(kept, prompt_ids, domains, cfg.domain_weights,
                     summary={"prompts": len(kept), "prompts_skipped": skipped},
                     description=f"{len(kept)} prompts ({skipped} skipped as too long), domains {sizes}")


class MonitoredReward:
    """The verifiers' rewards of one step (`verify_batch`), watched by
    `verifiers.monitor.RewardMonitor`: per domain, the reward mass that came through a fallback
    extraction path, the share of rewarded answers that hedge (several candidates, under either
    grading), the length-reward correlation and the pass rate go to the step's metrics
    (`monitor/<domain>/<name>`), and a value that leaves its recent history prints a warning the
    console shows even when quiet: the first signs of a policy learning to game a verifier."""

    def __init__(self, cfg) -> None:
        self.cfg, self.monitor = cfg, RewardMonitor()
        self.last: dict[str, float] = {}

    def __call__(self, rows: list[dict], texts: list[str], groups: list[str]) -> list[Any]:
        texts = [str(t) for t in texts]
        rewards = verify_batch(with_grading(rows, reward_grading(self.cfg)), texts,
                               num_workers=self.cfg.verifier_workers, timeout_s=self.cfg.verifier_timeout_s)
        metrics, warnings = self.monitor.step(rewards, [len(t) for t in texts])
        self.last = {f"monitor/{k}": v for k, v in metrics.items()}
        for w in warnings:
            info(f"reasoning_rl: warning: reward monitor: {w}")
        return rewards


def build_reward(ctx: RLContext) -> MonitoredReward:
    return MonitoredReward(ctx.cfg)


def monitor_metrics(reward_fn: MonitoredReward) -> dict[str, float]:
    return reward_fn.last


SPEC = RLSpec(name="reasoning_rl", load_prompts=load_prompts, build_reward=build_reward,
              step_metrics=monitor_metrics)


def main(job: StageJob, cfg: ReasoningRLConfig) -> dict[str, Any] | None:
    return RLTrainer(job, cfg, SPEC).train()


if __name__ == "__main__":
    sys.exit(run_job(main, ReasoningRLConfig))

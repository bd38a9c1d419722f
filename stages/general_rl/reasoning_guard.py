"""General RL's reasoning guard: what RLHF costs reasoning, measured.

Before the first step and after the last one, engine 0 (rank 0 unless the placement is split)
decodes the `reasoning_eval` set with its rollout engine (greedy by default; the engine holds
the current policy) and scores it with the verifier; before / after / delta go to MLflow and to
stage_summary.json. The "before" score is
the hook's checkpointed state, so a resumed run reports the delta against the policy the stage
started from. With `reasoning_eval: null` the guard only warns.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from stages.common.contract import StageError
from stages.common.rows import input_rows
from stages.common.stage_log import info
from stages.general_rl.config import GeneralRLConfig
from stages.general_rl.prompts import reasoning_rows
from stages.rl.engines.protocol import SamplingParams
from stages.rl.prompts import render_prompts
from stages.rl.spec import RLContext, RLHooks
from stages.rl.verified_sampling import generate_and_score
from verifiers import VERIFIERS

if TYPE_CHECKING:
    from stages.rl.trainer import RLTrainer


def load_reasoning_set(ctx: RLContext) -> dict[str, Any]:
    cfg: GeneralRLConfig = ctx.cfg  # type: ignore[assignment]
    ev = cfg.reasoning_eval
    what = "reasoning_eval data"
    raw = [row.data for row in input_rows(ctx.job.fetch, ev.data, what)]
    rows = reasoning_rows(raw, ev, ev.source)
    unknown = sorted({r["domain"] for r in rows} - set(VERIFIERS))
    if unknown:
        named = "reasoning_eval.domain" if "domain" in ev.model_fields_set else f"the rows of {ev.source}"
        raise StageError(f"{named}: domain(s) {unknown} have no verifier; known: {sorted(VERIFIERS)}")
    kept, ids, _ = render_prompts([{**r, "messages": [{"role": "user", "content": r["prompt"]}]} for r in rows],
                                  ctx.tokenizer, cfg.prompt_max_len)
    if not kept:
        raise StageError(f"reasoning_eval data {ev.source}: every prompt is longer than prompt_max_len="
                         f"{cfg.prompt_max_len} tokens")
    return {"rows": [{k: v for k, v in r.items() if k != "messages"} for r in kept], "prompt_ids": ids,
            "skipped": len(rows) - len(kept), "domains": sorted({r["domain"] for r in rows})}


def reasoning_check(engine, eval_set: dict[str, Any], decode, cfg: GeneralRLConfig) -> dict[str, float]:
    """Decode the held-out reasoning set with the engine's current weights and verify it."""
    ev = cfg.reasoning_eval
    t0 = time.perf_counter()
    scored = generate_and_score(engine, decode, eval_set["rows"], eval_set["prompt_ids"],
                                SamplingParams(temperature=ev.temperature, seed=cfg.seed),
                                max_new_tokens=ev.max_new_tokens or cfg.max_len, verifier=cfg, uid="eval{row}")
    n = len(scored)
    return {"accuracy": sum(r.reward.score for r in scored) / n, "n": float(n),
            "response_len_mean": sum(r.text.n_tokens for r in scored) / n,
            "truncated_fraction": sum(not r.text.ended_by_eos for r in scored) / n,
            "seconds": time.perf_counter() - t0}


class ReasoningGuard(RLHooks):
    def __init__(self, ctx: RLContext):
        self.ctx = ctx
        self.cfg: GeneralRLConfig = ctx.cfg  # type: ignore[assignment]
        self.rank = ctx.ranks.rank
        self.before: dict[str, float] | None = None
        self.eval_set = None

    def _check(self, trainer: "RLTrainer", when: str) -> dict[str, float]:
        """The check on engine 0 (the eval set loaded there first), its result on every rank."""
        if self.eval_set is None:
            self.eval_set = trainer.rollouts.on_engine0(lambda engine: load_reasoning_set(self.ctx),
                                                        "loading the reasoning_eval set")
        return trainer.rollouts.on_engine0(
            lambda engine: reasoning_check(engine, self.eval_set, self.ctx.decode, self.cfg),
            f"the reasoning check {when} training")

    def before_training(self, trainer: "RLTrainer") -> None:
        ev = self.cfg.reasoning_eval
        if ev is None:
            if self.rank == 0:
                info("general_rl: warning: reasoning_eval is null, the stage does not check what it costs reasoning")
            return
        if self.before is not None:  # resumed: the score of the policy the stage started from
            return
        self.before = self._check(trainer, "before")
        if self.rank == 0:
            self.ctx.log.metrics(0, {f"reasoning_eval/{k}_before": v for k, v in self.before.items()})
            info(f"general_rl: reasoning set before training: accuracy {self.before['accuracy']:.4f} "
                 f"on {int(self.before['n'])} rows of {ev.source} "
                 f"({self.eval_set['skipped']} longer than prompt_max_len skipped)")

    def after_training(self, trainer: "RLTrainer") -> dict[str, Any]:
        ev = self.cfg.reasoning_eval
        if ev is None:
            return {"reasoning_eval": None, "reasoning_delta": None}
        after = self._check(trainer, "after")
        if self.rank != 0:
            return {}
        before = self.before
        delta = after["accuracy"] - before["accuracy"]
        guard = {"data": ev.source, "domain": ", ".join(self.eval_set["domains"]), "rows": int(after["n"]),
                 "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"], "delta": delta,
                 "response_len_before": before["response_len_mean"], "response_len_after": after["response_len_mean"],
                 "truncated_before": before["truncated_fraction"], "truncated_after": after["truncated_fraction"]}
        self.ctx.log.metrics(self.cfg.steps, {**{f"reasoning_eval/{k}_after": v for k, v in after.items()},
                                              "reasoning_eval/delta": delta})
        info(f"general_rl: reasoning set accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f} "
             f"(delta {delta:+.4f})")
        return {"reasoning_eval": guard, "reasoning_delta": delta}

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before = state["before"]

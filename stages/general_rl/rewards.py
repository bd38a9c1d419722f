"""The general-RL reward: reward-model score + rule rewards + format / length penalties.

For response i of GRPO group g (the G responses sampled for one prompt; a prompt drawn twice
in a step makes two groups, normalised apart):

    reward_i = rm_weight   * z_g(rm_i)                  reward model, normalised in the group
                                                         (rows no verifier scored, unless rm_on_verified)
             + rule_weight * rule_i                      verifier score in [0, 1] (rows with a reference)
             - format_penalty     * [format broken]      not `<think>...</think>` + a non-empty answer
             - truncation_penalty * [cut at max_len]     no EOS
             - overlong_penalty   * ramp_i               share of the last `overlong_buffer` tokens used

z_g(x) = (x - mean_g) / (std_g + eps) (population std); a group of one, or whose RM scores
are all equal, gets 0 (the RM then says nothing about it). With rm_normalization "none",
the raw score is used. The RM score comes from `stages.reward_model.scoring.RewardScorer`
(batched on its own device), the rule score from `verifiers.verify_batch` (rows graded with the
stage's `grading`, strict by default: verifiers/grading.py; watched by the reward monitor,
`verifiers.monitor`, whose per-step metrics are `monitor/<domain>/<name>`); a row with no
`reference` gets no rule term (general chat prompts are judged by the RM alone), and a row a
verifier scored gets no RM term unless `rm_on_verified`: a z-scored RM term has unit spread in
every group while a 0/1 verifier's is at most 0.5, so on checkable rows (math, instruction
constraints) the learned model would outweigh the check, and the policy would chase the RM's
taste where the answer is known (on an H100 this cost 3.5-11 points of held-out math accuracy
in general RL, measured by benchmarks/gpu_learning.py). GRPO then
group-normalises the combined reward again for the advantage (stages/rl/loss.py), so only the
relative weights of the terms matter within a group.

`GeneralReward` is the scheduler's reward function: `(rows, texts, group ids) ->
[RewardParts]`, each with `.score` and `.reason`. The texts are `stages.rl.decoding.Decoded`
strings that also carry the response's token count and whether it ended with EOS, which the
length terms need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from stages.common.stage_log import info
from verifiers.grading import with_grading
from verifiers.monitor import RewardMonitor

EPS = 1e-6


def format_ok(text: str, require_thinking: bool) -> tuple[bool, str]:
    """(ok, why not): `<think> ... </think>` once, first, then a non-empty answer."""
    t = text.strip()
    opens, closes = t.count("<think>"), t.count("</think>")
    if require_thinking:
        if not t.startswith("<think>"):
            return False, "does not start with <think>"
        if opens != 1 or closes != 1:
            return False, f"{opens} <think> and {closes} </think> (one each expected)"
    elif opens or closes:
        if opens != 1 or closes != 1 or t.index("<think>") > t.index("</think>"):
            return False, f"unbalanced thinking section ({opens} <think>, {closes} </think>)"
    answer = t.rsplit("</think>", 1)[1] if "</think>" in t else t
    if not answer.strip():
        return False, "empty answer"
    return True, ""


def group_normalise(values: Sequence[float], keys: Sequence[Any], eps: float = EPS) -> list[float]:
    """z-score of each value within the values sharing its key (0 for degenerate groups)."""
    groups: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    out = [0.0] * len(values)
    for idx in groups.values():
        vs = [float(values[i]) for i in idx]
        if len(vs) < 2 or max(vs) == min(vs):
            continue
        mean = sum(vs) / len(vs)
        std = math.sqrt(sum((v - mean) ** 2 for v in vs) / len(vs))
        for i, v in zip(idx, vs):
            out[i] = (v - mean) / (std + eps)
    return out


@dataclass
class RewardParts:
    score: float
    parts: dict[str, float] = field(default_factory=dict)
    reason: str = ""


@dataclass
class ResponseFacts:
    """What the combiner needs to know of one response besides the two scores."""

    group: Any                      # the GRPO group id: responses with the same id form a group
    format_ok: bool = True
    format_why: str = ""
    truncated: bool = False
    n_tokens: int = 0
    rule_reason: str = ""


def combine(rm: Sequence[float | None] | None, rule: Sequence[float | None], facts: Sequence[ResponseFacts],
            settings: Any, max_len: int) -> list[RewardParts]:
    """The reward of each response (module docstring); `settings` is a RewardSettings. `rm[i]`
    is None for a response the reward model did not judge."""
    n = len(facts)
    if len(rule) != n or (rm is not None and len(rm) != n):
        raise ValueError(f"combine: {n} responses but {len(rule)} rule and "
                         f"{'no' if rm is None else len(rm)} RM scores")
    # the RM term of each response (None: not judged by the RM), z-scored over the judged ones
    rm_term: list[float | None] = [None] * n
    if rm is not None and settings.rm_weight > 0:
        judged = [i for i in range(n) if rm[i] is not None]
        scores = [float(rm[i]) for i in judged]
        if settings.rm_normalization == "group":
            scores = group_normalise(scores, [facts[i].group for i in judged])
        for i, v in zip(judged, scores):
            rm_term[i] = v
    out = []
    start = max_len - settings.overlong_buffer
    for i, f in enumerate(facts):
        parts: dict[str, float] = {}
        reasons: list[str] = []
        if rm_term[i] is not None:
            parts["rm_raw"] = float(rm[i])
            parts["rm"] = settings.rm_weight * rm_term[i]
        if rule[i] is not None and settings.rule_weight > 0:
            parts["rule"] = settings.rule_weight * float(rule[i])
            if f.rule_reason:
                reasons.append(f"rule: {f.rule_reason}")
        if not f.format_ok and settings.format_penalty:
            parts["format"] = -settings.format_penalty
            reasons.append(f"format: {f.format_why}")
        if f.truncated and settings.truncation_penalty:
            parts["truncation"] = -settings.truncation_penalty
            reasons.append("truncated at max_len")
        if settings.overlong_buffer and settings.overlong_penalty and f.n_tokens > start:
            parts["overlong"] = -settings.overlong_penalty * min(1.0, (f.n_tokens - start) / settings.overlong_buffer)
        score = sum(v for k, v in parts.items() if k != "rm_raw")
        out.append(RewardParts(score, parts, "; ".join(reasons)))
    return out


class GeneralReward:
    """The scheduler's reward function: RM scores and verifier scores for a batch of
    (row, response) pairs, combined per GRPO group. Rows are the stage's prompt rows (`id`,
    `messages`, and `domain` + `reference` when a verifier checks them)."""

    def __init__(self, settings: Any, max_len: int, scorer=None, verify_batch=None,
                 verifier_workers: int = 2, verifier_timeout_s: float = 10.0, grading: str | None = None,
                 ifeval_grading: str = "strict"):
        if settings.rm_weight > 0 and scorer is None:
            raise ValueError("rm_weight > 0 needs a reward-model scorer")
        self.settings, self.max_len, self.scorer = settings, max_len, scorer
        self.verify_batch, self.grading = verify_batch, grading or ifeval_grading  # the setting's earlier name
        self.monitor, self.last_monitor = RewardMonitor(), {}
        self.workers, self.timeout_s = verifier_workers, verifier_timeout_s
        self.last_seconds: dict[str, float] = {}
        self.last_batch: tuple[list[dict], list[RewardParts]] = ([], [])  # for per-step metrics

    def __call__(self, rows: list[dict], texts: list[str], groups: list[str]) -> list[RewardParts]:
        import time

        if not len(rows) == len(texts) == len(groups):
            raise ValueError(f"{len(rows)} rows, {len(texts)} responses and {len(groups)} group ids")
        s = self.settings
        facts = []
        for text, group in zip(texts, groups):
            ok, why = format_ok(text, s.require_thinking)
            n_tokens = getattr(text, "n_tokens", 0)
            truncated = not getattr(text, "ended_by_eos", True)
            facts.append(ResponseFacts(group=group, format_ok=ok, format_why=why, truncated=truncated,
                                       n_tokens=n_tokens))
        rule: list[float | None] = [None] * len(rows)
        checked = [i for i, row in enumerate(rows) if row.get("reference") is not None]
        t0 = time.perf_counter()
        if checked and s.rule_weight > 0:
            if self.verify_batch is None:
                raise ValueError("rows with a reference need a verifier (verify_batch)")

            rewards = self.verify_batch(with_grading([rows[i] for i in checked], self.grading),
                                        [str(texts[i]) for i in checked],
                                        num_workers=self.workers, timeout_s=self.timeout_s)
            for i, r in zip(checked, rewards):
                rule[i] = float(r.score)
                facts[i].rule_reason = str(getattr(r, "reason", ""))
            self._watch([rows[i] for i in checked], [str(texts[i]) for i in checked], rewards)
        t1 = time.perf_counter()
        rm: list[float | None] | None = None
        if s.rm_weight > 0:
            judged = [i for i in range(len(rows)) if rule[i] is None or s.rm_on_verified]
            rm = [None] * len(rows)
            if judged:
                scores = self.scorer.score([rows[i]["messages"] for i in judged], [str(texts[i]) for i in judged])
                for i, v in zip(judged, scores):
                    rm[i] = v
        t2 = time.perf_counter()
        self.last_seconds = {"rule_seconds": t1 - t0, "rm_seconds": t2 - t1}
        out = combine(rm, rule, facts, s, self.max_len)
        self.last_batch = (list(rows), out)
        return out

    def _watch(self, rows: list[dict], texts: list[str], rewards: list[Any]) -> None:
        """The reward monitor's step over the verified rows (fallback share, hedge share, ...);
        a metric that jumps prints a warning the console shows even when quiet."""
        seen = [{"score": float(r.score), "source": str(getattr(r, "source", "")),
                 "details": {**(getattr(r, "details", None) or {}), "domain": row.get("domain", "unknown")}}
                for row, r in zip(rows, rewards)]
        metrics, warnings = self.monitor.step(seen, [len(t) for t in texts])
        self.last_monitor = {f"monitor/{k}": v for k, v in metrics.items()}
        for w in warnings:
            info(f"general_rl: warning: reward monitor: {w}")

"""Reward-hacking monitors for RL loops: per-step metrics of the verifier rewards and
warnings when one jumps against its recent history. Pure: no I/O, no clock; the caller
logs the metrics (e.g. to MLflow) and the warnings.

    monitor = RewardMonitor()
    metrics, warnings = monitor.step(rewards, lengths, rm_scores)   # once per RL step

Per domain (the verifier that scored the row; rewards from ``verify``/``verify_batch`` carry
it in ``details["domain"]``) and for "all", ``step_metrics`` gives, under "<domain>/<name>":

- ``n``, ``mean_score``, ``pass_rate`` (share of rewards of 1);
- ``fallback_share``: the share of the reward mass that came from a fallback extraction
  path (``schema.FALLBACK_SOURCES``: the last number of a math answer, the whole final
  answer, a program without a code fence). A policy
  that learns to be scored by a fallback shows up here first;
- ``length_reward_corr``: Pearson correlation of response length and reward (present when
  both vary). A climb means length itself is being rewarded;
- ``hedge_share``: of the responses their domain's own verdict rewards (the reference
  grading's score, kept in ``details["reference_score"]`` where strict grading took it), the
  share whose answer states several candidates (``details["hedged"]``, grading.py): measured
  under either grading, so a policy learning to hedge shows up whether or not its hedges are
  paid (present when some rewarded response was checked: every domain with a hedge check);
- ``rm_rule_disagreement`` (when reward-model scores are given): how often the reward model
  ranks a response that fails the rule check above one that passes it, over all such
  pairs (ties count half): 0 = full agreement, 0.5 = unrelated, 1 = inverted.

``jump_warnings`` flags a metric whose value leaves its recent history: more than
``z`` standard deviations and more than ``min_delta`` away from the mean of the last
``window`` steps (once ``min_history`` steps are known).
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from statistics import fmean, pstdev
from typing import Any

from .schema import FALLBACK_SOURCES, Reward

ALL = "all"


def _fields(r: Reward | Mapping[str, Any]) -> tuple[float, str, str]:
    if isinstance(r, Reward):
        return r.score, r.source, str(r.details.get("domain", "unknown"))
    return float(r.get("score", 0.0)), str(r.get("source", "")), str((r.get("details") or {}).get("domain", "unknown"))


def _hedging(r: Reward | Mapping[str, Any]) -> tuple[bool, bool | None]:
    """(rewarded by its domain's own verdict, its answer hedges; None where no check ran: a
    domain without one, IFEval, whose strict grading is its own): under strict grading a
    hedge's score is 0 and ``details["reference_score"]`` the score it had (grading.py)."""
    details = r.details if isinstance(r, Reward) else (r.get("details") or {})
    score = r.score if isinstance(r, Reward) else float(r.get("score", 0.0))
    hedged = details.get("hedged")
    return float(details.get("reference_score", score)) > 0, None if hedged is None else bool(hedged)


def _hedge_share(hedging: Sequence[tuple[bool, bool | None]]) -> float | None:
    checked = [hedged for paid, hedged in hedging if paid and hedged is not None]
    return sum(checked) / len(checked) if checked else None


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = fmean(xs), fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def _disagreement(rule: Sequence[float], rm: Sequence[float]) -> float | None:
    """P(RM scores a failing response above a passing one), ties half; None without both."""
    passing = sorted(m for s, m in zip(rule, rm) if s >= 0.5)
    failing = [m for s, m in zip(rule, rm) if s < 0.5]
    if not passing or not failing:
        return None
    worse = 0.0
    for m in failing:  # passing responses the RM scores below (and equal to) this failing one
        worse += bisect_left(passing, m) + 0.5 * (bisect_right(passing, m) - bisect_left(passing, m))
    return worse / (len(passing) * len(failing))


def step_metrics(rewards: Sequence[Reward | Mapping[str, Any]], lengths: Sequence[int],
                 rm_scores: Sequence[float | None] | None = None,
                 fallback_sources: frozenset[str] = FALLBACK_SOURCES) -> dict[str, float]:
    """Metrics of one RL step (see the module doc). ``lengths`` (tokens or characters) and
    ``rm_scores`` (None where a row has none) are parallel to ``rewards``."""
    if len(lengths) != len(rewards) or (rm_scores is not None and len(rm_scores) != len(rewards)):
        raise ValueError(f"step_metrics: {len(rewards)} rewards but {len(lengths)} lengths"
                         + (f" and {len(rm_scores)} rm_scores" if rm_scores is not None else ""))
    groups: dict[str, list[int]] = defaultdict(list)
    fields = [_fields(r) for r in rewards]
    hedging = [_hedging(r) for r in rewards]
    for i, (_, _, domain) in enumerate(fields):
        groups[domain].append(i)
        groups[ALL].append(i)
    out: dict[str, float] = {}
    for domain, idx in sorted(groups.items()):
        scores = [fields[i][0] for i in idx]
        mass = sum(scores)
        metrics = {
            "n": float(len(idx)),
            "mean_score": mass / len(idx),
            "pass_rate": sum(s >= 1.0 for s in scores) / len(idx),
            "fallback_share": (sum(fields[i][0] for i in idx if fields[i][1] in fallback_sources) / mass) if mass else 0.0,
            "length_reward_corr": _pearson([float(lengths[i]) for i in idx], scores),
            "hedge_share": _hedge_share([hedging[i] for i in idx]),
        }
        if rm_scores is not None:
            pairs = [(fields[i][0], float(rm_scores[i])) for i in idx if rm_scores[i] is not None]
            metrics["rm_rule_disagreement"] = _disagreement([p[0] for p in pairs], [p[1] for p in pairs])
        out.update({f"{domain}/{k}": v for k, v in metrics.items() if v is not None})
    return out


def jump_warnings(history: Sequence[Mapping[str, float]], current: Mapping[str, float], z: float = 4.0,
                  min_delta: float = 0.15, min_history: int = 5) -> list[str]:
    """Warnings for metrics of ``current`` far from their values in ``history`` (older first).
    Counts (``/n``) are not judged."""
    warnings = []
    for key, value in sorted(current.items()):
        if key.endswith("/n"):
            continue
        past = [h[key] for h in history if key in h]
        if len(past) < min_history:
            continue
        mean, sd = fmean(past), pstdev(past)
        if abs(value - mean) > max(z * sd, min_delta):
            direction = "rose" if value > mean else "fell"
            warnings.append(f"{key} {direction} to {value:.3f} (last {len(past)} steps: {mean:.3f} ± {sd:.3f})")
    return warnings


class RewardMonitor:
    """``step_metrics`` + ``jump_warnings`` over a sliding window of past steps."""

    def __init__(self, window: int = 20, z: float = 4.0, min_delta: float = 0.15, min_history: int = 5,
                 fallback_sources: frozenset[str] = FALLBACK_SOURCES) -> None:
        if window < min_history:
            raise ValueError(f"window ({window}) must be at least min_history ({min_history})")
        self.history: deque[dict[str, float]] = deque(maxlen=window)
        self.z, self.min_delta, self.min_history = z, min_delta, min_history
        self.fallback_sources = fallback_sources

    def step(self, rewards: Sequence[Reward | Mapping[str, Any]], lengths: Sequence[int],
             rm_scores: Sequence[float | None] | None = None) -> tuple[dict[str, float], list[str]]:
        metrics = step_metrics(rewards, lengths, rm_scores, self.fallback_sources)
        warnings = jump_warnings(self.history, metrics, self.z, self.min_delta, self.min_history)
        self.history.append(metrics)
        return metrics, warnings

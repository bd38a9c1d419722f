"""Which of a stage kind's metrics tell its story: the headline numbers of its finish line
and the main curves plotted when it ends. Declared as data, per stage kind; a kind that is
not listed has neither.

RL metrics reach MLflow grouped by prefix (`reward/`, `icepop/`, `rollout/`, `perf/`, `loss/`:
`stages.rl.metrics.mlflow_name`), so MLflow shows each group as one section, while the stage
log's `[metrics]` lines keep the flat names. A curve names its MLflow metric and, in `also`,
the flat name the same metric has in the stage log.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping


@dataclass(frozen=True)
class Curve:
    name: str
    also: tuple[str, ...] = ()

    def find(self, available: Iterable[str]) -> str | None:
        """The name this metric has among `available` (the grouped one first)."""
        names = set(available)
        return next((n for n in (self.name, *self.also) if n in names), None)


@dataclass(frozen=True)
class KindMetrics:
    headline: tuple[Curve, ...] = ()
    curves: tuple[Curve, ...] = ()


def _rl(*extra_headline: Curve) -> KindMetrics:
    reward = Curve("reward/mean", ("reward_mean",))
    return KindMetrics(
        headline=(reward, *extra_headline),
        curves=(reward,
                Curve("icepop/masked_fraction", ("masked_fraction",)),
                Curve("icepop/mismatch_kl", ("mismatch_kl",)),
                Curve("loss/pg", ("pg_loss",)),
                Curve("loss/grad_norm", ("grad_norm",)),
                Curve("rollout/response_len_mean", ("response_len_mean",)),
                Curve("perf/step_seconds", ("step_seconds",))))


KIND_METRICS: dict[str, KindMetrics] = {
    "curate": KindMetrics(headline=(Curve("kept"), Curve("removed"), Curve("quarantined"))),
    "distill": KindMetrics(headline=(Curve("acceptance_rate"), Curve("kept")),
                           curves=(Curve("acceptance_rate"), Curve("kept"), Curve("response_len_mean"))),
    "sft": KindMetrics(headline=(Curve("loss"),),
                       curves=(Curve("loss"), Curve("lr"), Curve("grad_norm"), Curve("tokens_per_s"))),
    "reward_model": KindMetrics(headline=(Curve("train/loss"), Curve("eval/accuracy")),
                                curves=(Curve("train/loss"), Curve("train/accuracy"), Curve("eval/accuracy"),
                                        Curve("lr"))),
    "reasoning_rl": _rl(Curve("icepop/masked_fraction", ("masked_fraction",))),
    "general_rl": _rl(Curve("reasoning_eval/delta")),
}


def _number(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v == int(v) and abs(v) < 1e9:
        return str(int(v))
    return f"{v:.4g}"


def headline(kind: str, first: Mapping[str, float], last: Mapping[str, float]) -> dict[str, list[float]]:
    """metric -> [first, last] (or [value] when it was logged once or never changed) of the
    kind's headline metrics that the stage logged."""
    out: dict[str, list[float]] = {}
    for curve in KIND_METRICS.get(kind, KindMetrics()).headline:
        name = curve.find(last)
        if name is not None:
            out[curve.name] = [last[name]] if first[name] == last[name] else [first[name], last[name]]
    return out


def describe(values: Mapping[str, list[float]]) -> str:
    """`loss 6.225 -> 0.4717, eval/accuracy 0.54 -> 0.69`"""
    return ", ".join(f"{k} {' -> '.join(_number(v) for v in vs)}" for k, vs in values.items())

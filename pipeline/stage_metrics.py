"""A stage's headline numbers, from what its kind declares (`StageKind.metrics`,
stages/common/kind_metrics.py) and what its job logged."""
from __future__ import annotations

import math
from typing import Mapping

from stages.common.kind_metrics import KindMetrics
from stages.registry import STAGE_KINDS


def kind_metrics(kind: str | None) -> KindMetrics:
    """What the kind declares (nothing for an unknown kind: a stage of a test's own kind)."""
    return STAGE_KINDS[kind].metrics if kind and kind in STAGE_KINDS else KindMetrics()


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
    for curve in kind_metrics(kind).headline:
        name = curve.find(last)
        if name is not None:
            out[curve.name] = [last[name]] if first[name] == last[name] else [first[name], last[name]]
    return out


def describe(values: Mapping[str, list[float]]) -> str:
    """`loss 6.225 -> 0.4717, eval/accuracy 0.54 -> 0.69`"""
    return ", ".join(f"{k} {' -> '.join(_number(v) for v in vs)}" for k, vs in values.items())

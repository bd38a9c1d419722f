"""Which of a stage kind's metrics tell its story: the headline numbers of its finish line
and the main curves plotted when it ends. A kind declares them on its `StageKind`
(`metrics=KindMetrics(...)`); a kind that declares none has neither.

A curve names its MLflow metric and, in `also`, the flat name the same metric has in the
stage log (RL metrics reach MLflow grouped by prefix, `stages.rl.metrics.mlflow_name`, while
the log's `[metrics]` lines keep the flat names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


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

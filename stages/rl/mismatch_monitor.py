"""Warnings when the train-inference mismatch jumps: what the paper's Figure of
a collapsing run shows first, before the reward falls. Pure, like verifiers/monitor.py's
reward monitor: the trainer prints each warning as `<stage>: warning: mismatch monitor: ...`
(a line the console shows even when quiet) and the metrics are in MLflow (`icepop/`,
`routing/`, metrics.py).

A metric jumps when its value this step is, all at once,
- above the mean of its last `window` steps by more than `z` standard deviations of them,
- more than `ratio` times that mean (the mismatch of a healthy run is tiny and noisy in
  relative terms: |log k| ~ 3e-3 with bf16 engines, so an absolute threshold would fire for
  no reason in one run and never in another), and
- above the metric's floor (`FLOORS`: below it the number is rounding, not a mismatch).
Only rises are judged: a mismatch that falls needs no operator. The history is the trainer's
own metric history (checkpointed), so a resumed run keeps judging against its past.
"""
from __future__ import annotations

from statistics import fmean, pstdev
from typing import Mapping, Sequence

# metric -> the value under which it is not judged
FLOORS = {
    "mismatch_kl": 1e-4,
    "masked_fraction": 1e-3,
    "abs_log_k_p99": 0.05,
    "expert_disagreement": 0.02,
}


def mismatch_warnings(history: Sequence[Mapping[str, float]], current: Mapping[str, float], *,
                      window: int = 20, min_history: int = 5, z: float = 4.0, ratio: float = 3.0) -> list[str]:
    """Warnings for the mismatch metrics of `current` that jumped against `history` (older first)."""
    out = []
    for key, floor in FLOORS.items():
        value = current.get(key)
        if value is None:
            continue
        past = [h[key] for h in history[-window:] if key in h]
        if len(past) < min_history:
            continue
        mean, sd = fmean(past), pstdev(past)
        if value > floor and value > mean + z * sd and value > ratio * mean:
            out.append(f"{key} jumped to {value:.4g} (last {len(past)} steps: {mean:.4g} ± {sd:.2g}); the "
                       f"train-inference mismatch is growing: IcePop masks more tokens (see icepop/ and routing/ "
                       f"in MLflow)")
    return out

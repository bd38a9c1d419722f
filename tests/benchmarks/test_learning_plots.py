"""The learning-curve PNGs of benchmarks/gpu_learning.py, from the data shapes the stages
write (metrics.jsonl rows, eval accuracies), including the gaps a cut-off run leaves."""
from __future__ import annotations

import random

import pytest

from benchmarks.learning import plots


def series(steps: int, seed: int) -> list[dict[str, float]]:
    rng = random.Random(seed)
    return [{"step": s, "reward_mean": rng.random(), "response_len_mean": 100 + s, "masked_fraction": 1e-3 * rng.random(),
             "abs_log_k_mean": 0.01, "mismatch_kl": 1e-4 + 1e-5 * s, "grad_norm": 0.5 + rng.random(),
             "step_seconds": 2.0 + rng.random()} for s in range(1, steps + 1)]


def image(path):
    import matplotlib.image as mpimg

    return mpimg.imread(path)


def test_every_plot_writes_a_png(tmp_path):
    arms = {"icepop": {"metrics": series(6, 0), "accuracy": 0.6}, "tis": {"metrics": series(6, 1), "accuracy": 0.5},
            "none": {"metrics": series(3, 2), "accuracy": None}}  # an arm cut off before its eval
    written = [
        plots.accuracy_table({"base": {"heldout_rl": 0.0}, "SFT": {"heldout_rl": 0.3, "heldout_sft": 0.5},
                              "RL": {"heldout_rl": 0.45, "heldout_sft": 0.6}}, tmp_path / "a.png", "t"),
        plots.rl_curve(series(5, 3), tmp_path / "b.png", "t"),
        plots.corrections(arms, tmp_path / "c.png", "t"),
        plots.schedulers({"c3po++": arms["icepop"], "sync": arms["none"]}, tmp_path / "d.png", "t"),
    ]
    for path in written:
        img = image(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_wall_clock_is_the_running_sum_of_step_seconds():
    s = series(4, 5)
    t = plots.wall_clock(s)
    assert t == pytest.approx([sum(m["step_seconds"] for m in s[:i + 1]) for i in range(4)])

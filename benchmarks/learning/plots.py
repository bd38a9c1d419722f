"""The learning curves of benchmarks/gpu_learning.py as PNGs (matplotlib, Agg: no display).

Each function takes the plain data the driver collected (dicts and lists from the stages'
stage_summary.json and metrics.jsonl) and writes one PNG; none reads files of its own.

- `accuracy_table`: held-out accuracy of each model (base, SFT, RL, RLHF) on each set;
- `rl_curve`: reward and response length per reasoning-RL step;
- `corrections`: IcePop vs TIS vs none per step (masked fraction, |log k|, mismatch KL,
  grad norm, reward) and their held-out accuracy;
- `schedulers`: C3PO++ vs sync, reward against wall-clock, and held-out accuracy at the
  end of each run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Series = list[dict[str, float]]  # one metrics.jsonl: a dict per step


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _values(series: Series, key: str) -> tuple[list[float], list[float]]:
    pts = [(float(m["step"]), float(m[key])) for m in series if key in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def accuracy_table(accuracy: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    """accuracy: model -> set -> accuracy (models in pipeline order)."""
    models = list(accuracy)
    sets = sorted({s for per_set in accuracy.values() for s in per_set})
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(models), 3.6))
    width = 0.8 / max(len(sets), 1)
    for j, s in enumerate(sets):
        xs = [i + (j - (len(sets) - 1) / 2) * width for i in range(len(models))]
        ys = [accuracy[m].get(s, float("nan")) for m in models]
        bars = ax.bar(xs, ys, width, label=s)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def rl_curve(series: Series, path: Path, title: str) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.plot(*_values(series, "reward_mean"))
    a.set_xlabel("step")
    a.set_ylabel("reward (training prompts)")
    b.plot(*_values(series, "response_len_mean"))
    b.set_xlabel("step")
    b.set_ylabel("response tokens")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


CORRECTION_PANELS = (("masked_fraction", "masked fraction (outside [alpha, beta])"),
                     ("abs_log_k_mean", "mean |log k|"), ("mismatch_kl", "mismatch KL"),
                     ("grad_norm", "grad norm"), ("reward_mean", "reward (training prompts)"))
# the MoE mismatch ablation (benchmarks/gpu_mismatch_ablation.py): the |log k| distribution and
# the expert-choice disagreement too
MISMATCH_PANELS = (("mismatch_kl", "mismatch KL"), ("abs_log_k_p50", "|log k| median"),
                   ("abs_log_k_p99", "|log k| p99"), ("masked_fraction", "masked fraction (outside [alpha, beta])"),
                   ("expert_disagreement", "expert choice: trainer != engine"), ("grad_norm", "grad norm"),
                   ("reward_mean", "reward (training prompts)"))
_LOG_SCALE = {"mismatch_kl", "grad_norm", "abs_log_k_p50", "abs_log_k_p99"}


def corrections(arms: dict[str, dict[str, Any]], path: Path, title: str,
                panels: tuple[tuple[str, str], ...] = CORRECTION_PANELS) -> Path:
    """arms: name -> {"metrics": Series, "accuracy": held-out accuracy or None}; a panel per
    metric of `panels`, then the accuracy bars."""
    rows = (len(panels) + 3) // 3
    fig, axes = plt.subplots(rows, 3, figsize=(11, 3 * rows))
    for ax, (key, label) in zip(axes.flat, panels):
        for name, arm in arms.items():
            ax.plot(*_values(arm["metrics"], key), label=name)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=9)
        if key in _LOG_SCALE and any(v > 0 for arm in arms.values() for v in _values(arm["metrics"], key)[1]):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7)
    for ax in axes.flat[len(panels):-1]:
        ax.set_visible(False)
    last = axes.flat[-1]
    names = list(arms)
    accs = [arms[n]["accuracy"] if arms[n]["accuracy"] is not None else float("nan") for n in names]
    bars = last.bar(names, accs)
    last.bar_label(bars, labels=[f"{a:.2f}" for a in accs], fontsize=7)
    last.set_ylim(0, 1.05)
    last.set_title("held-out accuracy after RL", fontsize=9)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def wall_clock(series: Series) -> list[float]:
    """Seconds since the run's start at the end of each step (step_seconds summed)."""
    out, t = [], 0.0
    for m in series:
        t += float(m.get("step_seconds", 0.0))
        out.append(t)
    return out


def schedulers(arms: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """arms: name -> {"metrics": Series, "accuracy": held-out accuracy or None}."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, arm in arms.items():
        t = wall_clock(arm["metrics"])
        line, = a.plot(t, [float(m["reward_mean"]) for m in arm["metrics"]], label=name)
        if arm["accuracy"] is not None and t:
            b.scatter([t[-1]], [arm["accuracy"]], color=line.get_color(), label=name)
            b.annotate(f"{arm['accuracy']:.2f}", (t[-1], arm["accuracy"]), fontsize=7)
    a.set_xlabel("wall-clock seconds (steps)")
    a.set_ylabel("reward (training prompts)")
    a.legend(fontsize=7)
    b.set_xlabel("wall-clock seconds at the end of RL")
    b.set_ylabel("held-out accuracy")
    b.set_ylim(0, 1.05)
    b.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)

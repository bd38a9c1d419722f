"""Per-step curves of reasoning-RL runs, read from the runs' MLflow stores (sqlite), one line a run.

    python benchmarks/plot_rl_curves.py --run "seed 0=r/mlflow.db" --run "seed 1=r/mlflow_seed1.db" \
        --out benchmarks/learning/h200-2026-11-27-r12/reasoning_rl_curves.png --title "..."

Each store's run named `--stage` (default reasoning_rl) is plotted; the first and last ten steps'
means of each metric are printed (what RESULTS.md quotes).
"""
from __future__ import annotations

import argparse
import sqlite3

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

METRICS = ["reward/mean", "icepop/mismatch_kl", "icepop/masked_fraction", "icepop/masked_fraction_fresh",
           "icepop/abs_log_k_p99", "loss/entropy", "perf/step_seconds", "reward/zero_advantage_fraction"]


def curve(db: str, stage: str, key: str) -> list[tuple[int, float]]:
    with sqlite3.connect(db) as c:
        found = c.execute("select run_uuid from tags where key='mlflow.runName' and value=?", (stage,)).fetchone()
        if found is None:
            raise SystemExit(f"{db}: no MLflow run named {stage!r} (--stage)")
        (run,) = found
        return c.execute("select step, value from metrics where run_uuid=? and key=? order by step",
                         (run, key)).fetchall()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="LABEL=path/to/mlflow.db")
    ap.add_argument("--stage", default="reasoning_rl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    for label, db in (r.split("=", 1) for r in args.run):
        for ax, key in zip(axes.flat, METRICS):
            points = curve(db, args.stage, key)
            if not points:
                continue
            steps, values = zip(*points)
            ax.plot(steps, values, label=label)
            ax.set_title(key)
            ax.set_xlabel("step")
            head, tail = values[:10], values[-10:]
            print(f"{label:10} {key:34} first 10 {sum(head) / len(head):.4f}  last 10 {sum(tail) / len(tail):.4f}")
    axes.flat[0].legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)


if __name__ == "__main__":
    main()

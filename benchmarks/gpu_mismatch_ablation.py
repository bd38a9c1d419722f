"""Why IcePop exists (issue 34, item 4): the MoE train-inference mismatch ablation on one GPU
machine. NOT RUN YET: written and checked on CPU (--dry-run, the plots on the smoke data)
in the session that added FP8 rollouts and routing replay; its numbers go to RESULTS.md.

The policy: benchmarks/learning/moe-mismatch.yaml (gpu-small's task on a ring_moe model, 16
experts, 4 routed per token), SFT'd, then reasoning RL for 400 steps with the trainer in bf16
and the torch engine rolling out in FP8 (rollout.dtype fp8): the mismatch is large enough to
act. Five arms from the same SFT model, same prompts and seeds, differing only in
  none        correction none            (plain GRPO: the mismatch ignored)
  tis         correction tis             (truncated importance weights, no token dropped)
  icepop      correction icepop          (the paper: tokens outside [0.5, 5] dropped)
  r3          correction none + routing_replay   (the engine's experts replayed in training)
  icepop_r3   correction icepop + routing_replay
Per step (metrics.jsonl of each arm's stage, also in MLflow): mismatch KL, |log k| p50 / p99 /
max, masked fraction, expert disagreement (R3 arms: the trainer's own choice, which replay
overrides), grad norm, reward; after RL, each arm's held-out accuracy (an eval stage). Plots:
OUT/ablation_mismatch.png (every panel, every arm) and the table in OUT/ablation.json.

What to look for: the paper's figure, `none` degrading (reward falls, grad norm and mismatch
KL climb) while IcePop holds. Report whatever happens; a rerun with `--set
stages.reasoning_rl.seed=1` (another seed) must show the same ordering of arms, or the note
says it does not. If no arm degrades within 400 steps: a longer run, a higher lr
(`--set stages.reasoning_rl.lr=1e-4`), or per-row FP8 scales off (`fp8_scaling: tensor`, the
default here) are the knobs; write down each one tried.

    # GPU machine, wheels in /tmp/site (scripts/gpu_wheels.sh); 4 GPUs: 4 arms at once
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_mismatch_ablation.py --out $OUT                  # SFT model first, then the arms
    python3 benchmarks/gpu_mismatch_ablation.py --out $OUT --arms none,icepop --set stages.reasoning_rl.seed=1
    # here (CPU): the arms' configs validated, nothing run; then the plot on made-up curves
    python benchmarks/gpu_mismatch_ablation.py --dry-run --out /tmp/abl
    python benchmarks/gpu_mismatch_ablation.py --plot-smoke --out /tmp/abl

Reuses benchmarks/gpu_learning.py's machinery (`Run`: the store under --root, the pipeline
runs, the phase log; its `arm` subprocess per arm on its own GPU) with this recipe and these
arms.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere

from benchmarks._record import log  # noqa: E402 - needs REPO on sys.path
from benchmarks.gpu_learning import HEADLINE_SET, Run, accuracy_of, arm_process, eval_config  # noqa: E402

RECIPE = REPO / "benchmarks" / "learning" / "moe-mismatch.yaml"
BASE_STAGES = ["data", "curate", "base", "sft"]
ARMS: dict[str, dict[str, Any]] = {
    "none": {"correction": "none"},
    "tis": {"correction": "tis"},
    "icepop": {"correction": "icepop"},
    "r3": {"correction": "none", "routing_replay": True},
    "icepop_r3": {"correction": "icepop", "routing_replay": True},
}
TABLE_KEYS = ("mismatch_kl", "abs_log_k_p50", "abs_log_k_p99", "masked_fraction", "expert_disagreement", "grad_norm")


def arm_config(recipe, name: str) -> dict[str, Any]:
    """The recipe's reasoning_rl config with the arm's correction / routing replay."""
    cfg = recipe.stages["reasoning_rl"].model_dump(mode="json", exclude={"resources", "launcher"})
    cfg.update(ARMS[name])
    return cfg


def validate_arms(recipe) -> dict[str, dict[str, Any]]:
    """Every arm's config through the stage's own validation (what --dry-run checks)."""
    from stages.reasoning_rl.config import ReasoningRLConfig

    out = {}
    for name in ARMS:
        cfg = ReasoningRLConfig.model_validate(arm_config(recipe, name))
        out[name] = {"correction": cfg.correction, "routing_replay": cfg.routing_replay,
                     "rollout_dtype": cfg.rollout.dtype, "precision": cfg.precision, "steps": cfg.steps}
    return out


def run_arm(args: argparse.Namespace) -> None:
    """One arm in its own process (its GPU by CUDA_VISIBLE_DEVICES): RL from the SFT model, then
    the eval of its model; one JSON line."""
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    run = Run(argparse.Namespace(**{**vars(args), "out": str(Path(args.root) / "arms")}), f"arm_{args.arm}")
    recipe, plan = run.plan()
    resources = Resources(cpu_ranks=1) if args.smoke else Resources(gpus_per_node=1)
    common = dict(storage=f"file://{run.root}/artifacts", recipe=f"{recipe.name}-ablation",
                  tracking_uri=recipe.tracking.uri, experiment=f"{recipe.name}-ablation",
                  work_root=run.root / "work", resources=resources, launcher="torchrun")
    t0 = time.perf_counter()
    rl = run_stage("reasoning_rl", arm_config(recipe, args.arm), stage=f"rl_{args.arm}",
                   upstream={s: plan[s].url for s in ("sft", "data")}, **common)
    rl_seconds = time.perf_counter() - t0
    ev = run_stage("eval", eval_config(recipe, "${stages.arm.output}", args.arm), stage=f"eval_{args.arm}",
                   upstream={"arm": rl.url, "data": plan["data"].url}, **common)
    print("ARM_RESULT " + json.dumps({"arm": args.arm, "rl_url": rl.url, "rl_seconds": rl_seconds,
                                      "eval": ev.summary}), flush=True)


def run_arms(args: argparse.Namespace) -> None:
    import torch

    run = Run(args, "ablation")
    recipe, plan = run.plan()
    run.results["arm_settings"] = validate_arms(recipe)
    if not all(plan[s].done for s in BASE_STAGES):
        log("building the SFT'd ring_moe policy first")
        run.run_stages(BASE_STAGES)
        _, plan = run.plan()
        if not plan["sft"].done:
            log("the SFT stage did not finish: no arm can start")
            return
    arms = args.arms or list(ARMS)
    gpus = max(torch.cuda.device_count(), 1)
    slots = list(range(gpus * args.arms_per_gpu))
    run.results["arms"] = {}

    def one(name: str) -> None:
        slot = slots.pop(0)
        env = {"CUDA_VISIBLE_DEVICES": str(slot % gpus)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", name, "--root", str(run.root),
               "--out", str(run.out)] + [x for o in args.set for x in ("--set", o)]
        try:
            _, res = arm_process(run, name, cmd, env)
        finally:
            slots.append(slot)
        if res is None:
            run.results["arms"][name] = {"failed": True}
        else:
            res["metrics"] = run.metrics(res["rl_url"])
            res["accuracy"] = accuracy_of(res["eval"])
            run.results["arms"][name] = res
            log(f"arm {name}: {res['rl_seconds']:.0f}s of RL; held-out accuracy {res['accuracy']}")
        run.write()

    with ThreadPoolExecutor(len(slots)) as pool:
        list(pool.map(one, arms))
    finish(run)


def finish(run: Run) -> None:
    """The table and the plot of the arms that finished."""
    from benchmarks.learning import plots

    done = {n: a for n, a in run.results.get("arms", {}).items() if not a.get("failed")}
    run.results["table"] = {n: table_row(a["metrics"], a["accuracy"].get(HEADLINE_SET)) for n, a in done.items()}
    run.write()
    if done:
        plots.corrections({n: {"metrics": a["metrics"], "accuracy": a["accuracy"].get(HEADLINE_SET)}
                           for n, a in done.items()}, run.out / "ablation_mismatch.png",
                          "ring_moe, FP8 rollouts, bf16 trainer: none / TIS / IcePop / R3 / IcePop+R3",
                          panels=plots.MISMATCH_PANELS)
    log("ablation: " + json.dumps(run.results["table"]))


def table_row(metrics: list[dict[str, float]], accuracy: float | None) -> dict[str, float | None]:
    """Means over the first and the last quarter of the steps (a mismatch that grows shows as
    late > early), the reward of the last quarter, and the held-out accuracy."""
    quarter = max(1, len(metrics) // 4)

    def mean(rows, key):
        vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None

    row: dict[str, float | None] = {}
    for key in TABLE_KEYS:
        row[f"{key}_early"], row[f"{key}_late"] = mean(metrics[:quarter], key), mean(metrics[-quarter:], key)
    row["reward_last_quarter"] = mean(metrics[-quarter:], "reward_mean")
    row["heldout_accuracy"] = accuracy
    return row


def plot_smoke(args: argparse.Namespace) -> None:
    """The plot and table on made-up curves (CPU: proves the drawing, says nothing about RL)."""
    run = Run(args, "ablation_plot_smoke")
    run.results["arms"] = {}
    for k, name in enumerate(ARMS):
        grow = 0.0 if "icepop" in name else 0.02 * (k + 1)
        metrics = [{"step": s, "mismatch_kl": 1e-4 * (1 + grow * s), "abs_log_k_p50": 2e-3, "abs_log_k_p99": 0.05,
                    "masked_fraction": 1e-3, "expert_disagreement": 0.0 if "r3" in name else 0.05,
                    "grad_norm": 1.0 + grow * s, "reward_mean": 0.5 - grow * s / 100} for s in range(1, 41)]
        run.results["arms"][name] = {"metrics": metrics, "accuracy": {HEADLINE_SET: 0.4 - grow}}
    finish(run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/mismatch_ablation"))
    p.add_argument("--root", default="/tmp/ring-moe", help="artifact store, MLflow and work dirs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--arms", type=lambda t: [n for n in t.split(",") if n], help=f"a subset of {','.join(ARMS)}")
    p.add_argument("--arms-per-gpu", type=int, default=1)
    p.add_argument("--arm", choices=sorted(ARMS), help="(internal) the arm this process runs")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe and every arm's config; run nothing")
    p.add_argument("--plot-smoke", action="store_true", help="draw the plot on made-up curves")
    args = p.parse_args()
    args.smoke, args.recipe = False, str(RECIPE)
    unknown = [n for n in args.arms or [] if n not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; the arms are {', '.join(ARMS)}")
    if args.arm:
        run_arm(args)
    elif args.dry_run:
        recipe, _ = Run(args, "ablation_dry_run").plan()
        print(json.dumps(validate_arms(recipe), indent=2))
    elif args.plot_smoke:
        plot_smoke(args)
    else:
        run_arms(args)


if __name__ == "__main__":
    main()

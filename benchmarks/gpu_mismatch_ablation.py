"""Why IcePop exists (issue 34, item 4): the MoE train-inference mismatch ablation, every arm
and both seeds in one command on one GPU machine (one GPU or four). NOT RUN YET on a GPU; the
orchestration runs end to end on CPU (--smoke), the plans are benchmarks/gpu_plans/
h100x1-mismatch.yaml and h100x4-mismatch.yaml (their headers: the time estimate and its rows).

The policy: benchmarks/learning/moe-mismatch.yaml (gpu-small's task on a ring_moe model, 16
experts, 4 routed per token), SFT'd once, then reasoning RL with the trainer in bf16 and the
torch engine rolling out in FP8 (rollout.dtype fp8): the mismatch is large from the first
step. Five arms from the same SFT model (one stage hash), same prompts, differing only in
  none        correction none            (plain GRPO: the mismatch ignored)
  tis         correction tis             (truncated importance weights, no token dropped)
  icepop      correction icepop          (the paper: tokens outside [0.5, 5] dropped)
  r3          correction none + routing_replay   (the engine's experts replayed in training)
  icepop_r3   correction icepop + routing_replay
each with every seed of --seeds (default 0 and 1: the rerun issue 34 asks for); a run is
`<arm>_s<seed>`. All runs start at once, spread over the GPUs (run i on GPU i mod #GPUs; several
per GPU: the policy is small and each run is launch-bound, so they share a GPU well), each in its
own process: RL, then an eval stage of its model.

Written to --out as it goes (every --write-every seconds and when a run ends; small files only),
so a session cut off still returns what was reached:
  metrics/<run>.jsonl  each run's per-step metrics: read from its stage log while it trains,
                       its published metrics.jsonl once done (mismatch KL, |log k| p50 / p99,
                       masked fraction, expert disagreement, grad norm, reward, ...)
  ablation.json        each run's state and steps, the table (first vs last quarter of every
                       mismatch metric, last-quarter reward, held-out accuracy) and the arms'
                       ordering per seed, and whether the seeds agree
  ablation_mismatch_s<seed>.png   every panel, every arm of one seed
  ablation.log         the SFT pipeline's and each finished run's output

What to look for: the paper's figure, `none` degrading (reward falls, grad norm and mismatch
KL climb) while IcePop holds, the same ordering on both seeds. Report whatever happens. The
knobs if no arm degrades: more steps (a 4-GPU host fits about twice a single GPU's), a higher lr
(`--set stages.reasoning_rl.lr=1e-4`), C3PO++ (`--set stages.reasoning_rl.scheduler=c3po`:
stale tokens on top of the FP8 mismatch); write down each one tried.

    # GPU machine, wheels in /tmp/site (scripts/gpu_wheels.sh); the plans' command:
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_mismatch_ablation.py --out $OUT --set stages.reasoning_rl.steps=130   # one GPU (the recipe: 280, four)
    # here (CPU): configs validated and the placement shown; the plot on made-up curves; the
    # whole orchestration on a tiny MoE (benchmarks/learning/cpu-moe-mismatch.yaml, no FP8 on CPU)
    python benchmarks/gpu_mismatch_ablation.py --dry-run --gpus 4 --out /tmp/abl
    python benchmarks/gpu_mismatch_ablation.py --plot-smoke --out /tmp/abl
    python benchmarks/gpu_mismatch_ablation.py --smoke --arms none,icepop_r3 --seeds 0 --out /tmp/abl_smoke --root /tmp/abl_root

Reuses benchmarks/gpu_learning.py's machinery (`Run`: the store under --root, the pipeline run
of the SFT prefix, the phase log; `arm_process`: one run's process).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere

from benchmarks._record import log  # noqa: E402 - needs REPO on sys.path
from benchmarks.gpu_learning import HEADLINE_SET, Run, accuracy_of, arm_process, eval_config  # noqa: E402
from benchmarks.learning.live_metrics import logged_metrics, stage_log  # noqa: E402

RECIPE = REPO / "benchmarks" / "learning" / "moe-mismatch.yaml"
SMOKE_RECIPE = REPO / "benchmarks" / "learning" / "cpu-moe-mismatch.yaml"
BASE_STAGES = ["data", "curate", "base", "sft"]
ARMS: dict[str, dict[str, Any]] = {
    "none": {"correction": "none"},
    "tis": {"correction": "tis"},
    "icepop": {"correction": "icepop"},
    "r3": {"correction": "none", "routing_replay": True},
    "icepop_r3": {"correction": "icepop", "routing_replay": True},
}
TABLE_KEYS = ("mismatch_kl", "abs_log_k_p50", "abs_log_k_p99", "masked_fraction", "expert_disagreement", "grad_norm")
ORDER_KEYS = ("heldout_accuracy", "reward_last_quarter")  # what the arms are ranked by, per seed


def run_name(arm: str, seed: int) -> str:
    return f"{arm}_s{seed}"


def ablation_recipe(recipe) -> str:
    """The store / work-dir namespace of the arms' stages (the recipe's own stages are beside it)."""
    return f"{recipe.name}-ablation"


def arm_config(recipe, name: str, seed: int | None = None) -> dict[str, Any]:
    """The recipe's reasoning_rl config with the arm's correction / routing replay (and seed)."""
    cfg = recipe.stages["reasoning_rl"].model_dump(mode="json", exclude={"resources", "launcher"})
    cfg.update(ARMS[name])
    if seed is not None:
        cfg["seed"] = seed
    return cfg


def validate_arms(recipe) -> dict[str, dict[str, Any]]:
    """Every arm's config through the stage's own validation (what --dry-run checks)."""
    from stages.reasoning_rl.config import ReasoningRLConfig

    out = {}
    for name in ARMS:
        cfg = ReasoningRLConfig.model_validate(arm_config(recipe, name))
        out[name] = {"correction": cfg.correction, "routing_replay": cfg.routing_replay, "scheduler": cfg.scheduler,
                     "rollout_dtype": cfg.rollout.dtype, "precision": cfg.precision, "steps": cfg.steps}
    return out


def placement(runs: list[tuple[str, int]], gpus: int) -> dict[str, int]:
    """run -> GPU index: round-robin, so each GPU holds at most one run more than another."""
    return {run_name(a, s): i % max(gpus, 1) for i, (a, s) in enumerate(runs)}


def run_arm(args: argparse.Namespace) -> None:
    """One run in its own process (its GPU by CUDA_VISIBLE_DEVICES): RL from the SFT model, then
    the eval of its model; one JSON line."""
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    name = run_name(args.arm, args.seed)
    run = Run(argparse.Namespace(**{**vars(args), "out": str(Path(args.root) / "arms")}), f"arm_{name}")
    recipe, plan = run.plan()
    resources = Resources(cpu_ranks=1) if args.smoke else Resources(gpus_per_node=1)
    # an MLflow store per run: ten runs logging every step into one SQLite file would contend for its lock
    common = dict(storage=f"file://{run.root}/artifacts", recipe=ablation_recipe(recipe),
                  tracking_uri=f"sqlite:///{run.root}/mlflow_{name}.db", experiment=ablation_recipe(recipe),
                  work_root=run.root / "work", resources=resources, launcher="torchrun")
    t0 = time.perf_counter()
    rl = run_stage("reasoning_rl", arm_config(recipe, args.arm, args.seed), stage=f"rl_{name}",
                   upstream={s: plan[s].url for s in ("sft", "data")}, **common)
    rl_seconds = time.perf_counter() - t0
    ev = run_stage("eval", eval_config(recipe, "${stages.arm.output}", name), stage=f"eval_{name}",
                   upstream={"arm": rl.url, "data": plan["data"].url}, **common)
    print("ARM_RESULT " + json.dumps({"run": name, "rl_url": rl.url, "rl_seconds": rl_seconds,
                                      "eval_seconds": time.perf_counter() - t0 - rl_seconds, "eval": ev.summary}),
          flush=True)


class Board:
    """What the ablation has so far, and its files in --out (module docstring). Run threads
    report a run's start and end; a timer thread calls `refresh` to pick up the live curves."""

    def __init__(self, run: Run, recipe_name: str, runs: list[tuple[str, int]]):
        self.run, self.recipe_name = run, recipe_name
        self.runs = {run_name(a, s): (a, s) for a, s in runs}
        self.state: dict[str, dict[str, Any]] = {n: {"arm": a, "seed": s, "state": "waiting"}
                                                 for n, (a, s) in self.runs.items()}
        self.metrics: dict[str, list[dict[str, float]]] = {n: [] for n in self.runs}
        self.accuracy: dict[str, float | None] = {n: None for n in self.runs}
        self.lock = threading.Lock()
        (run.out / "metrics").mkdir(parents=True, exist_ok=True)

    def started(self, name: str, device: str) -> None:
        with self.lock:
            self.state[name].update(state="running", device=device, started=time.strftime("%H:%M:%S"))

    def ended(self, name: str, exit_code: int, res: dict[str, Any] | None) -> None:
        with self.lock:
            s = self.state[name]
            s.update(ended=time.strftime("%H:%M:%S"), exit_code=exit_code)
            if res is None:
                s["state"] = "failed"
            else:
                s.update(state="done", rl_seconds=res["rl_seconds"], eval_seconds=res["eval_seconds"],
                         rl_url=res["rl_url"], accuracy=accuracy_of(res["eval"]))
                self.metrics[name] = self.run.metrics(res["rl_url"])  # the published curve
                self.accuracy[name] = s["accuracy"].get(HEADLINE_SET)
        self.refresh()

    def refresh(self) -> None:
        """Live curves of the running runs from their stage logs, then every file in --out."""
        with self.lock:
            for name, s in self.state.items():
                if s["state"] in ("running", "failed"):  # a failed run keeps the steps it logged
                    live = logged_metrics(stage_log(self.run.root / "work", self.recipe_name, f"rl_{name}"))
                    if len(live) >= len(self.metrics[name]):
                        self.metrics[name] = live
            self.publish()

    def publish(self) -> None:
        """metrics/<run>.jsonl, ablation.json and the plots, from what the board holds."""
        from benchmarks.learning import plots

        for name, m in self.metrics.items():
            self.state[name]["steps"] = len(m)
            if m:
                (self.run.out / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in m))
        table = {n: table_row(m, self.accuracy[n]) for n, m in self.metrics.items() if m}
        self.run.results.update(runs=self.state, table=table, orderings=orderings(table, self.runs))
        self.run.write()
        for seed in sorted({s for _, s in self.runs.values()}):
            arms = {a: {"metrics": self.metrics[n], "accuracy": self.accuracy[n]}
                    for n, (a, s) in self.runs.items() if s == seed and self.metrics[n]}
            if arms:
                steps = max(len(a["metrics"]) for a in arms.values())
                plots.corrections(arms, self.run.out / f"ablation_mismatch_s{seed}.png",
                                  f"ring_moe, FP8 rollouts, bf16 trainer, seed {seed} ({steps} steps so far)",
                                  panels=plots.MISMATCH_PANELS)


def prefix_ready(run: Run) -> bool:
    """The SFT'd ring_moe policy every run starts from: built first if the store lacks it."""
    _, plan = run.plan()
    if all(plan[s].done for s in BASE_STAGES):
        return True
    log("building the SFT'd ring_moe policy first")
    t0 = time.perf_counter()
    run.run_stages(BASE_STAGES)
    run.results["prefix_seconds"] = round(time.perf_counter() - t0, 1)
    _, plan = run.plan()
    if not plan["sft"].done:
        log("the SFT stage did not finish: no arm can start")
    return plan["sft"].done


def run_arms(args: argparse.Namespace) -> None:
    from benchmarks.gpu_learning import gpu_count
    from pipeline.launch import pinned_gpus

    run = Run(args, "ablation")
    recipe, _ = run.plan()
    run.results["arm_settings"] = validate_arms(recipe)
    if not prefix_ready(run):
        sys.exit(1)  # the queue (and the session's summary) must see a failed job, not an ok one
    runs = [(a, s) for s in args.seeds for a in (args.arms or ARMS)]
    gpus = 1 if args.smoke else max(gpu_count(), 1)
    where = placement(runs, gpus)
    # GPU i = the i-th GPU this process sees: a CUDA_VISIBLE_DEVICES of its own (a queue job's) is honoured
    visible = pinned_gpus() or [str(i) for i in range(gpus)]
    at_once = len(runs) if args.arms_per_gpu == 0 else min(len(runs), gpus * args.arms_per_gpu)
    # the runs' CPU threads share the host's cores (ten runs x torch's default of one thread per core
    # would oversubscribe them; each run's CPU work is one launch-bound main thread)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // at_once))
    run.results.update(gpus=gpus, at_once=at_once, placement=where, omp_threads_per_run=threads)
    board = Board(run, ablation_recipe(recipe), runs)
    board.publish()
    log(f"{len(runs)} runs on {gpus} {'CPU slot' if args.smoke else 'GPU(s)'}, {at_once} at once")

    def one(arm_seed: tuple[str, int]) -> None:
        arm, seed = arm_seed
        name = run_name(arm, seed)
        device = "" if args.smoke else visible[where[name]]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", arm, "--seed", str(seed), "--root",
               str(run.root), "--out", str(run.out)] + (["--smoke"] if args.smoke else [])
        cmd += [x for o in args.set for x in ("--set", o)]
        board.started(name, device or "cpu")
        rc, res = arm_process(run, name, cmd, {"CUDA_VISIBLE_DEVICES": device, "OMP_NUM_THREADS": threads})
        board.ended(name, rc, res)
        if res is not None:
            log(f"run {name}: {res['rl_seconds']:.0f}s of RL; held-out accuracy {board.state[name]['accuracy']}")

    stop = threading.Event()

    def keep_writing() -> None:
        while not stop.wait(args.write_every):
            board.refresh()

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(one, runs))
    stop.set()
    writer.join()
    board.refresh()
    log("ablation: " + json.dumps(run.results["orderings"]))


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
    row["steps"] = len(metrics)
    return row


def orderings(table: dict[str, dict[str, Any]], runs: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """Per ORDER_KEYS value: each seed's arms from best to worst ([arm, value] pairs), and whether
    the seeds order them alike: every pair of arms compares the same way (better, worse or tied) on
    every seed; None until two seeds have a value for the same arms."""
    out: dict[str, Any] = {}
    for key in ORDER_KEYS:
        vals: dict[int, dict[str, float]] = {}
        for n, (a, s) in runs.items():
            if n in table and table[n][key] is not None:
                vals.setdefault(s, {})[a] = table[n][key]
        seeds = sorted({s for _, s in runs.values()})
        arms = [set(vals.get(s, {})) for s in seeds]
        same = None
        if len(seeds) > 1 and arms[0] and all(a == arms[0] for a in arms):
            pairs = [(x, y) for x in sorted(arms[0]) for y in sorted(arms[0]) if x < y]
            signs = {tuple((v[x] > v[y]) - (v[x] < v[y]) for x, y in pairs) for v in vals.values()}
            same = len(signs) == 1
        out[key] = {"by_seed": {str(s): sorted(vals.get(s, {}).items(), key=lambda av: -av[1]) for s in seeds},
                    "same_order": same}
    return out


def plot_smoke(args: argparse.Namespace) -> None:
    """The files on made-up curves, two seeds (CPU: proves the drawing, says nothing about RL)."""
    run = Run(args, "ablation_plot_smoke")
    runs = [(a, s) for s in (0, 1) for a in ARMS]
    board = Board(run, "plot-smoke", runs)
    for k, (name, (arm, seed)) in enumerate(board.runs.items()):
        grow = 0.0 if "icepop" in arm else 0.02 * (k % len(ARMS) + 1)
        board.metrics[name] = [
            {"step": s, "mismatch_kl": 1e-4 * (1 + grow * s), "abs_log_k_p50": 2e-3, "abs_log_k_p99": 0.05,
             "masked_fraction": 1e-3, "expert_disagreement": 0.0 if "r3" in arm else 0.05,
             "grad_norm": 1.0 + grow * s, "reward_mean": 0.5 - grow * s / 100 + 0.01 * seed} for s in range(1, 41)]
        board.accuracy[name] = 0.4 - grow
        board.state[name]["state"] = "done"
    board.publish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/mismatch_ablation"))
    p.add_argument("--root", default="/tmp/ring-moe", help="artifact store, MLflow and work dirs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--arms", type=lambda t: [n for n in t.split(",") if n], help=f"a subset of {','.join(ARMS)}")
    p.add_argument("--seeds", type=lambda t: [int(s) for s in t.split(",") if s.strip()], default=[0, 1],
                   help="RL seeds, each arm runs once per seed (default 0,1)")
    p.add_argument("--arms-per-gpu", type=int, default=0, metavar="K",
                   help="at most K runs at once per GPU (default 0: every run at once)")
    p.add_argument("--write-every", type=float, default=60.0, metavar="S", help="seconds between writes of --out")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny MoE of cpu-moe-mismatch.yaml, no FP8")
    p.add_argument("--gpus", type=int, default=4, help="--dry-run: the GPUs to show the placement for")
    p.add_argument("--arm", choices=sorted(ARMS), help="(internal) the arm this process runs")
    p.add_argument("--seed", type=int, default=0, help="(internal) the seed this process runs")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe and every arm's config; run nothing")
    p.add_argument("--plot-smoke", action="store_true", help="draw the plot on made-up curves")
    args = p.parse_args()
    args.recipe = str(SMOKE_RECIPE if args.smoke else RECIPE)
    unknown = [n for n in args.arms or [] if n not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; the arms are {', '.join(ARMS)}")
    if args.arms_per_gpu < 0 or not args.seeds:
        p.error("--arms-per-gpu must be >= 0 and --seeds must name at least one seed")
    if args.arm:
        run_arm(args)
    elif args.dry_run:
        recipe, _ = Run(args, "ablation_dry_run").plan()
        runs = [(a, s) for s in args.seeds for a in (args.arms or ARMS)]
        print(json.dumps({"arms": validate_arms(recipe), f"placement_on_{args.gpus}_gpus": placement(runs, args.gpus)},
                         indent=2))
    elif args.plot_smoke:
        plot_smoke(args)
    else:
        run_arms(args)


if __name__ == "__main__":
    main()

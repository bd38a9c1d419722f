"""Show it learns (issue 18): the gpu-small recipe on one GPU machine, its held-out accuracy
table, and the paper's ablations, as three commands of at most 8 minutes each.

On the GPU machine, from the repository root, with the wheels of scripts/gpu_wheels.sh
installed into /tmp/site, the lead runs these three commands back to back (same warm
machine: /tmp/ring, the artifact store, survives between them; a phase whose inputs are gone
says so and rebuilds them first):

    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_learning.py phase1 --out $OUT   # data, curate, base, SFT, reasoning RL; evals of base, SFT, RL
    python3 benchmarks/gpu_learning.py phase2 --out $OUT   # IcePop / TIS / none, C3PO++ / sync from phase 1's SFT model
    python3 benchmarks/gpu_learning.py phase3 --out $OUT   # reward model, general RL; eval of the RLHF model

On fewer than 4 GPUs the four arms of phase2 run in two or more rounds: add
`--set stages.reasoning_rl.steps=30` to phase2 there (every arm then trains 30 steps;
`--arms icepop,sync` or `--arms icepop,tis,none` runs a subset), or share the GPUs with
`--arms-per-gpu 4` (four arms at once on one GPU: a small model leaves room for them). A
rerun of a phase skips what is published and resumes what was cut off.

GPU time, measured on one H100 (RESULTS.md, round 6): phase1 alone 354 s (SFT 95 s, RL 150
steps at 0.88 s each); phase2 with `--arms-per-gpu 4` (the four arms sharing the GPU, ~310 s of
RL each with C3PO++, 229 s with sync) and phase3 (246 s) side by side: 12 minutes for all three.
On CPU (2 shared cores) a reasoning-RL step of cpu-small takes ~66 s.

CPU smoke of all three (benchmarks/learning/cpu-small.yaml: gpu-small's settings with a
smaller model and fewer steps; it proves the orchestration, not the learning: RESULTS.md
says why; ~30 minutes on 2 shared cores with these overrides):

    python benchmarks/gpu_learning.py all --smoke --out /tmp/gl_out \
        --set stages.reasoning_rl.steps=2 --set stages.reasoning_rl.checkpoint_every=1 \
        --set stages.general_rl.steps=2 --set stages.general_rl.checkpoint_every=1 \
        --set stages.reward_model.max_steps=10 --set stages.eval_base.max_new_tokens=32

What each phase does, through the project's own entry points:
- phase1 / phase3: `python3 -m pipeline.cli run RECIPE --only ...` over the phase's stages
  (and the earlier phases' ones, which are skipped when published): Prefect, MLflow, the
  artifact store, each stage's job under DeepSpeed's launcher on GPU 0.
- phase2: one process per ablation arm, each on its own GPU (CUDA_VISIBLE_DEVICES; as many
  at once as `torch.cuda.device_count()`, the rest queued): `pipeline.execute.run_stage`
  of the recipe's reasoning_rl config with the arm's correction / scheduler, from phase 1's
  SFT artifact, then an `eval` stage of its model. The arms train in fp32 and roll out with
  the bf16 engine: a real train-inference mismatch. Arms are cached by stage hash: a rerun
  skips finished arms.

Every phase writes to --out (at most 8 files): `phaseN.json` (rewritten after each
measurement, so a cut-off run leaves what it finished), `phaseN.log` (the children's output),
and its PNGs (benchmarks/learning/plots.py), which also go to MLflow as artifacts of a run
"learning-curves" in the recipe's experiment. Every child process gets NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere

from benchmarks._record import SAFE_ENV, log  # noqa: E402 - needs REPO on sys.path
from pipeline.launch import pinned_gpus  # noqa: E402

os.environ.update(SAFE_ENV)  # this process and every one it starts

RECIPES = {"gpu": REPO / "recipes" / "gpu-small.yaml", "smoke": REPO / "benchmarks" / "learning" / "cpu-small.yaml"}
PHASE_STAGES = {
    "phase1": ["data", "curate", "base", "sft", "reasoning_rl", "eval_base", "eval_sft", "eval_rl"],
    "phase2": ["data", "curate", "base", "sft"],  # what the arms start from
    "phase3": ["data", "curate", "base", "sft", "reasoning_rl", "reward_model", "general_rl", "eval_rlhf"],
}
# the evals whose accuracy makes the table, in pipeline order: eval stage -> model label
EVALS = {"eval_base": "base", "eval_sft": "SFT", "eval_rl": "RL", "eval_rlhf": "RLHF"}
# the held-out set at the RL prompts' difficulty (recipes/gpu-small.yaml says why it is that one)
HEADLINE_SET, HEADLINE_DECODING = "heldout_sft", "greedy"
# phase 2: the paper's ablations, from the SFT model; every arm trains in fp32 against the
# bf16 rollout engine. In queue order: the C3PO++ / sync pair first (timed side by side).
ARMS = {
    "icepop": {"correction": "icepop", "scheduler": "c3po"},
    "sync": {"correction": "icepop", "scheduler": "sync"},
    "tis": {"correction": "tis", "scheduler": "c3po"},
    "none": {"correction": "none", "scheduler": "c3po"},
}
ARM_PRECISION = {"precision": "fp32", "rollout": {"dtype": "bfloat16"}}


class Run:
    """Where a phase reads the recipe and writes: the store, MLflow and work dirs under
    --root, and its results under --out."""

    def __init__(self, args: argparse.Namespace, phase: str):
        self.args, self.phase, self.smoke = args, phase, args.smoke
        self.recipe_path = RECIPES["smoke" if args.smoke else "gpu"]
        self.root = Path(args.root)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.overrides = [f"storage.url=file://{self.root}/artifacts", f"tracking.uri=sqlite:///{self.root}/mlflow.db",
                          f"defaults.work_dir={self.root}/work", *args.set]
        self.results: dict[str, Any] = {"phase": phase, "recipe": str(self.recipe_path.relative_to(REPO)),
                                        "overrides": args.set, "smoke": self.smoke,
                                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.log_path = self.out / f"{phase}.log"
        self.log_path.write_text("")

    # -- the recipe and its artifacts --------------------------------------------------------
    def plan(self):
        from pipeline.loader import load_recipe
        from pipeline.plan import make_plan

        recipe = load_recipe(str(self.recipe_path), self.overrides)
        return recipe, make_plan(recipe)

    def summary(self, plan, stage: str) -> dict[str, Any] | None:
        from data_curation.urls import local_path

        s = plan[stage]
        path = Path(local_path(s.url)) / "stage_summary.json"
        return json.loads(path.read_text()) if s.done and path.exists() else None

    def metrics(self, url: str) -> list[dict[str, float]]:
        from data_curation.urls import local_path

        path = Path(local_path(url)) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    # -- running -------------------------------------------------------------------------------
    def child(self, cmd: list[str], env: dict[str, str] | None = None) -> int:
        """A child process, its output appended to the phase log; returns its exit status."""
        log("$ " + " ".join(cmd))
        with open(self.log_path, "a") as f:
            f.write(f"\n===== {time.strftime('%H:%M:%S')} $ {' '.join(cmd)}\n")
            f.flush()
            return subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  env={**os.environ, **SAFE_ENV, **(env or {})}).returncode

    def run_stages(self, stages: list[str]) -> None:
        _, plan = self.plan()
        missing = [s for s in stages if not plan[s].done]
        published = [s for s in stages if plan[s].done]
        if published:
            log(f"published already (skipped): {', '.join(published)}")
        if missing:
            log(f"to run: {', '.join(missing)}")
        cmd = [sys.executable, "-m", "pipeline.cli", "run", str(self.recipe_path)]
        for o in self.overrides:
            cmd += ["--set", o]
        for s in stages:
            cmd += ["--only", s]
        t0 = time.perf_counter()
        rc = self.child(cmd)
        self.results.setdefault("pipeline_runs", []).append(
            {"stages": stages, "ran": missing, "exit_code": rc, "seconds": round(time.perf_counter() - t0, 1)})
        self.write()
        if rc != 0:
            log(f"the pipeline run exited {rc}; its output is in {self.log_path}")

    def write(self) -> None:
        self.results["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        (self.out / f"{self.phase}.json").write_text(json.dumps(self.results, indent=2))

    def mlflow_artifacts(self, paths: list[Path]) -> None:
        """The PNGs as artifacts of one MLflow run "learning-curves/<phase>" in the recipe's experiment."""
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            log(f"MLflow is not importable here ({e}): the PNGs are only in {self.out}")
            return
        recipe, _ = self.plan()
        client = MlflowClient(recipe.tracking.uri)
        name = recipe.tracking.experiment or recipe.name
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
        run = client.create_run(exp_id, run_name=f"learning-curves/{self.phase}")
        for p in paths:
            client.log_artifact(run.info.run_id, str(p))
        client.set_terminated(run.info.run_id)
        log(f"PNGs logged to MLflow run {run.info.run_id} ({recipe.tracking.uri}, experiment {name})")


# -- phases 1 and 3: the recipe ---------------------------------------------------------------
def accuracy_of(summary: dict[str, Any] | None) -> dict[str, float]:
    """set -> greedy accuracy (domain all) of an eval stage's one model."""
    if summary is None:
        return {}
    (per_set,) = summary["accuracy"].values()
    return {s: per_dec[HEADLINE_DECODING] for s, per_dec in per_set.items() if HEADLINE_DECODING in per_dec}


def collect_recipe(run: Run) -> list[Path]:
    from benchmarks.learning import plots

    recipe, plan = run.plan()
    evals = {stage: run.summary(plan, stage) for stage in EVALS if stage in plan.names}
    table = {EVALS[s]: accuracy_of(summ) for s, summ in evals.items() if summ is not None}
    run.results["accuracy"] = table
    run.results["evals"] = {s: summ["results"] for s, summ in evals.items() if summ is not None}
    if "RL" in table and "SFT" in table:
        run.results["rl_gain_points"] = round(100 * (table["RL"][HEADLINE_SET] - table["SFT"][HEADLINE_SET]), 1)
    if "RLHF" in table and "RL" in table:
        run.results["rlhf_change_points"] = round(100 * (table["RLHF"][HEADLINE_SET] - table["RL"][HEADLINE_SET]), 1)
    for stage in ("sft", "reasoning_rl", "reward_model", "general_rl"):
        summ = run.summary(plan, stage)
        if summ is not None:
            run.results.setdefault("stages", {})[stage] = {"summary": summ,
                                                           "seconds": stage_seconds(plan[stage].url)}
    rl_metrics = run.metrics(plan["reasoning_rl"].url) if plan["reasoning_rl"].done else []
    run.results["reasoning_rl_metrics"] = rl_metrics
    run.write()
    pngs = []
    if table:
        pngs.append(plots.accuracy_table(table, run.out / f"{run.phase}_accuracy.png",
                                         f"{recipe.name}: held-out accuracy ({HEADLINE_DECODING})"))
    if rl_metrics:
        pngs.append(plots.rl_curve(rl_metrics, run.out / f"{run.phase}_reasoning_rl.png",
                                   f"{recipe.name}: reasoning RL (C3PO++ + IcePop)"))
    return pngs


def stage_seconds(url: str) -> float | None:
    from data_curation.urls import local_path

    path = Path(local_path(url)) / "manifest.json"
    if not path.exists():
        return None
    timings = json.loads(path.read_text()).get("timings", {})
    return timings.get("seconds") or timings.get("job_seconds")


def phase_recipe(args: argparse.Namespace, phase: str) -> None:
    run = Run(args, phase)
    log(f"{phase}: recipe {run.results['recipe']}, store {run.root}/artifacts")
    run.run_stages(PHASE_STAGES[phase])
    pngs = collect_recipe(run)
    run.write()
    if pngs:
        run.mlflow_artifacts(pngs)
    log(f"{phase}: accuracy {json.dumps(run.results.get('accuracy'))}; RL gain "
        f"{run.results.get('rl_gain_points')} points, RLHF change {run.results.get('rlhf_change_points')} points")


# -- phase 2: the ablations ---------------------------------------------------------------------
def arm_config(recipe, name: str) -> dict[str, Any]:
    cfg = recipe.stages["reasoning_rl"].model_dump(mode="json", exclude={"resources", "launcher"})
    cfg.update(ARMS[name])
    cfg["precision"] = ARM_PRECISION["precision"]
    cfg["rollout"] = {**cfg["rollout"], **ARM_PRECISION["rollout"]}
    return cfg


def eval_config(recipe, model_ref: str, name: str) -> dict[str, Any]:
    cfg = recipe.stages["eval_rl"].model_dump(mode="json", exclude={"resources", "launcher"})
    cfg["models"] = {name: model_ref}
    return cfg


def run_arm(args: argparse.Namespace) -> None:
    """One ablation arm, in its own process (its GPU chosen by CUDA_VISIBLE_DEVICES): the RL
    stage from the SFT artifact, then the eval of its model; prints one JSON line."""
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    # the arm's own Run writes nothing of interest: keep it out of $OUT (8 files at most come back)
    run = Run(argparse.Namespace(**{**vars(args), "out": str(Path(args.root) / "arms")}), f"arm_{args.arm}")
    recipe, plan = run.plan()
    upstream = {s: plan[s].url for s in ("sft", "data")}
    # torchrun, not deepspeed's launcher: that one resets CUDA_VISIBLE_DEVICES to its own
    # list, which would put every arm on GPU 0. Both stages get the GPU (no resources = CPU).
    resources = Resources(cpu_ranks=1) if run.smoke else Resources(gpus_per_node=1)
    common = dict(storage=f"file://{run.root}/artifacts", recipe=f"{recipe.name}-ablations",
                  tracking_uri=recipe.tracking.uri, experiment=f"{recipe.name}-ablations",
                  work_root=run.root / "work", resources=resources, launcher="torchrun")
    t0 = time.perf_counter()
    rl = run_stage("reasoning_rl", arm_config(recipe, args.arm), stage=f"rl_{args.arm}", upstream=upstream,
                   **common)
    rl_seconds = time.perf_counter() - t0
    ev = run_stage("eval", eval_config(recipe, "${stages.arm.output}", args.arm), stage=f"eval_{args.arm}",
                   upstream={"arm": rl.url, "data": plan["data"].url}, **common)
    print("ARM_RESULT " + json.dumps({"arm": args.arm, "rl_url": rl.url, "rl_status": rl.status,
                                      "rl_seconds": rl_seconds, "eval_url": ev.url, "eval": ev.summary}), flush=True)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def phase_ablations(args: argparse.Namespace) -> None:
    from benchmarks.learning import plots

    run = Run(args, "phase2")
    _, plan = run.plan()
    if not all(plan[s].done for s in PHASE_STAGES["phase2"]):
        log("phase 1's SFT model is not in the store (a fresh machine?): building it first")
        run.run_stages(PHASE_STAGES["phase2"])
        _, plan = run.plan()
        if not plan["sft"].done:
            log("the SFT stage did not finish: no ablation can start")
            return
    arms = args.arms or list(ARMS)
    gpus = 1 if run.smoke else max(gpu_count(), 1)
    slots = gpus * (1 if run.smoke else args.arms_per_gpu)
    log(f"phase2: {len(arms)} arms on {gpus} {'CPU slot' if run.smoke else 'GPU(s)'}, {slots} at once, "
        f"from {plan['sft'].url}")
    run.results.update(arms={}, slots=slots, gpus=gpus,
                       arm_settings={n: {**a, **ARM_PRECISION} for n, a in ARMS.items()})
    free = list(range(slots))
    # GPU i = the i-th GPU this process sees: a CUDA_VISIBLE_DEVICES of its own is honoured
    visible = pinned_gpus() or [str(i) for i in range(gpus)]

    def one(name: str) -> None:
        slot = free.pop(0)
        gpu = slot % gpus
        env = {"CUDA_VISIBLE_DEVICES": "" if run.smoke else visible[gpu]}
        cmd = [sys.executable, str(Path(__file__).resolve()), "arm", "--arm", name, "--root", str(run.root),
               "--out", str(run.out)] + (["--smoke"] if run.smoke else [])
        for o in args.set:
            cmd += ["--set", o]
        log(f"arm {name}: starting on {'cpu' if run.smoke else f'GPU {gpu}'}")
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                 env={**os.environ, **SAFE_ENV, **env})
        finally:
            free.append(slot)
        with open(run.log_path, "a") as f:
            f.write(f"\n===== arm {name} (exit {out.returncode})\n{out.stdout}\n{out.stderr}\n")
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ARM_RESULT ")]
        if out.returncode != 0 or not lines:
            log(f"arm {name}: FAILED (exit {out.returncode}); tail:\n{(out.stdout + out.stderr)[-1500:]}")
            run.results["arms"][name] = {"failed": True, "exit_code": out.returncode}
        else:
            res = json.loads(lines[-1].removeprefix("ARM_RESULT "))
            res["metrics"] = run.metrics(res["rl_url"])
            res["accuracy"] = accuracy_of(res["eval"])
            res["wall_seconds"] = time.perf_counter() - t0
            run.results["arms"][name] = res
            log(f"arm {name}: {res['rl_status']} in {res['rl_seconds']:.0f}s; held-out accuracy {res['accuracy']}")
        run.write()

    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(one, arms))
    done = {n: a for n, a in run.results["arms"].items() if not a.get("failed")}
    series = {n: {"metrics": a["metrics"], "accuracy": a["accuracy"].get(HEADLINE_SET)} for n, a in done.items()}
    pngs = []
    by_correction = {n: series[n] for n in ("icepop", "tis", "none") if n in series}
    if by_correction:
        pngs.append(plots.corrections(by_correction, run.out / "phase2_corrections.png",
                                      "IcePop vs TIS vs none (fp32 trainer, bf16 rollout engine, C3PO++)"))
    by_scheduler = {{"icepop": "c3po++", "sync": "sync"}[n]: series[n] for n in ("icepop", "sync") if n in series}
    if by_scheduler:
        pngs.append(plots.schedulers(by_scheduler, run.out / "phase2_c3po_vs_sync.png",
                                     "C3PO++ vs sync (IcePop, same prompts and seeds)"))
    run.results["table"] = {n: arm_table_row(a) for n, a in done.items()}
    run.write()
    if pngs:
        run.mlflow_artifacts(pngs)
    log("phase2: " + json.dumps(run.results["table"]))


def arm_table_row(arm: dict[str, Any]) -> dict[str, float | None]:
    """Means over the arm's steps of the mismatch statistics, the reward at the end, time and accuracy."""
    m = arm["metrics"]

    def mean(key: str) -> float | None:
        vals = [s[key] for s in m if key in s]
        return sum(vals) / len(vals) if vals else None

    tail = m[-max(1, len(m) // 4):]
    return {"masked_fraction": mean("masked_fraction"), "abs_log_k_mean": mean("abs_log_k_mean"),
            "mismatch_kl": mean("mismatch_kl"), "grad_norm": mean("grad_norm"),
            "reward_last_quarter": sum(s["reward_mean"] for s in tail) / len(tail) if tail else None,
            "rl_seconds": sum(s.get("step_seconds", 0.0) for s in m),
            "heldout_accuracy": arm["accuracy"].get(HEADLINE_SET)}


def arm_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {unknown or text!r}; the arms are {', '.join(ARMS)}")
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=["phase1", "phase2", "phase3", "all", "arm"])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_learning_out"), help="results folder ($OUT)")
    p.add_argument("--root", default="/tmp/ring", help="artifact store, MLflow and work dirs (kept across phases)")
    p.add_argument("--smoke", action="store_true", help="the CPU regime (benchmarks/learning/cpu-small.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override, as `pipeline.cli run --set` takes it (repeatable), e.g. "
                        "stages.reasoning_rl.steps=30 to shorten the RL stage and the arms")
    p.add_argument("--arms", type=arm_list, help=f"phase2: a comma-separated subset of {','.join(ARMS)} (default all)")
    p.add_argument("--arms-per-gpu", type=int, default=1, metavar="K",
                   help="phase2: run K arms at once on each GPU (they share it: compare their wall-clock "
                        "times only with each other)")
    p.add_argument("--arm", choices=sorted(ARMS), help="(internal) the ablation arm this process runs")
    args = p.parse_args()
    if args.arms_per_gpu < 1:
        p.error(f"--arms-per-gpu must be >= 1, got {args.arms_per_gpu}")
    if args.phase == "arm":
        run_arm(args)
        return
    for phase in (["phase1", "phase2", "phase3"] if args.phase == "all" else [args.phase]):
        t0 = time.perf_counter()
        log(f"===== {phase} =====")
        phase_ablations(args) if phase == "phase2" else phase_recipe(args, phase)
        log(f"{phase} took {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()

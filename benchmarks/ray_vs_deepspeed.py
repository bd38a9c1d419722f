"""Issue 33 item 5: the Ray launcher against the DeepSpeed launcher on the same GPUs, in one run.

A host of 4 GPUs plays a Ray cluster of two nodes (two raylets, GPUs 0,1 and 2,3: each node's
raylet started with its own CUDA_VISIBLE_DEVICES, benchmarks/_ray_cluster.py); with
`--gpus-per-node 1` a 2-GPU host plays two nodes of one GPU each (the same runs at half the
width). The same stage config runs twice, each time through `pipeline.execute.run_stage` as a
recipe would run it (N = --gpus-per-node, default 2):

  sft-deepspeed   `sft` (ZeRO-3) under DeepSpeed's launcher, 1 node x 2N GPUs
  sft-ray         the same under `launcher: ray`, 2 Ray nodes x N GPUs
  rl-deepspeed    `reasoning_rl` split (rollout.gpus: N: the first N ranks train under ZeRO-3, the
                  other N generate; NCCL weight sync from trainer 0) under DeepSpeed's launcher
  rl-ray          the same under `launcher: ray`: the trainers on Ray node 0, the engines on node 1

and the table compares SFT tokens/s (the stage's per-step `tokens_per_s`, the first two steps
left out) and RL rollout tokens/s and step seconds (benchmarks/gpu_scaling.py's readers), with
the ratio Ray / DeepSpeed (issue 33's goal: within 5%). The two launchers alternate (deepspeed,
ray, ray, deepspeed with --repeat 2) so a drift of the host does not favour one of them.

    # on the 4-GPU machine (the wheels of scripts/gpu_wheels.sh in /tmp/site, and ray's: a session
    # of benchmarks/gpu_plans/h100x4-ray.yaml says how it travels):
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    timeout 580 python3 benchmarks/ray_vs_deepspeed.py --out "$OUT" 2>&1 | tee "$OUT/ray_vs_deepspeed.log"
    # here (CPU): the same code paths on tiny shapes, 1 CPU rank per Ray node (no timing claims)
    python benchmarks/ray_vs_deepspeed.py --smoke --out /tmp/ray_vs_ds_smoke

Run on GPUs at half width (round 16) and at full width, 4 x H200 (round 19): benchmarks/RESULTS.md.
Results: OUT/ray_vs_deepspeed.json (rewritten after every run), the stage logs under OUT/work (or --work).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere

from benchmarks._ray_cluster import host_nodes, local_ray_cluster  # noqa: E402 - needs ROOT on sys.path
from benchmarks._record import SAFE_ENV, ResultFile, log, versions  # noqa: E402
from benchmarks.gpu_scaling import BODY_05B, TINY_BODY, rl_metrics, sft_metrics  # noqa: E402

os.environ.update(SAFE_ENV)  # this process and every one it starts


RECIPE = "ray-vs-ds"  # the store's recipe dir of every stage these runs publish (benchmarks/ray_fault.py's too)


def setup_inputs(work: Path, smoke: bool) -> dict[str, str]:
    """Synthetic data and a 0.5B-shape base (tiny for the smoke), published in a file:// store
    under `work` (skipped where an earlier job with the same `work` published them)."""
    from pipeline.execute import run_stage

    store = f"file://{work}/store"
    data = run_stage("synthetic_data", {"files": {
        "sft.jsonl": {"generator": "arithmetic_cot", "n": 600 if smoke else 6000, "params": {"max_digits": 3}},
        "rl.jsonl": {"generator": "arithmetic_rl", "n": 64 if smoke else 2048, "seed": 1}}},
        stage="data", storage=store, recipe=RECIPE, work_root=work / "runs")
    base = run_stage("init_model", {
        "architecture": {"model_type": "qwen2", "max_position_embeddings": 4096, **(TINY_BODY if smoke else BODY_05B)},
        "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 512 if smoke else 8192}},
        stage="base", storage=store, recipe=RECIPE, work_root=work / "runs", upstream={"data": data.url})
    return {"data": data.url, "base": base.url}


def stage_configs(smoke: bool, gpus_per_node: int) -> dict[str, dict[str, Any]]:
    sft = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
           "max_seq_len": 256 if smoke else 2048, "epochs": 4, "max_steps": 4 if smoke else 14,
           "micro_batch_size": 2 if smoke else 8, "lr": 1e-4, "warmup_steps": 1, "zero_stage": 3,
           "checkpoint_every": 1000}
    # a random policy rarely says EOS: the token budget (C3PO++'s Phi) bounds each step's rollout work
    rl = {"model": "${stages.base.output}", "data": "${stages.data.output}/rl.jsonl", "steps": 2 if smoke else 4,
          "prompts_per_step": 4 if smoke else 16, "rollouts_per_prompt": 4 if smoke else 8,
          "max_len": 24 if smoke else 512, "prompt_max_len": 64 if smoke else 128, "lr": 1e-6,
          "scheduler": "c3po", "c3po": {"pool_capacity": 16 if smoke else 256, "token_budget": 160 if smoke else 16384},
          "rollout": {"engine": "torch", "device": "auto", "max_batch": 8 if smoke else 128,
                      "gpus": 1 if smoke else gpus_per_node},
          "zero_stage": 3, "verifier_workers": 0, "checkpoint_every": 1000, "sample_rollouts": 0}
    return {"sft": sft, "reasoning_rl": rl}


def on_ray(config: dict[str, Any], address: str, smoke: bool, gpus_per_node: int) -> tuple[dict[str, Any], Any]:
    """(config, resources) of a stage run on the two Ray nodes: `gpus_per_node` GPU ranks each
    (smoke: 1 CPU rank each)."""
    from stages.common.contract import Resources

    resources = Resources(nodes=2, cpu_ranks=1) if smoke else Resources(nodes=2, gpus_per_node=gpus_per_node)
    return {**config, "ray": {"address": address, "placement_timeout_s": 120}}, resources


def _run(kind: str, launcher: str, config: dict[str, Any], work: Path, upstream: dict[str, str], smoke: bool,
         address: str, repeat: int, gpus_per_node: int) -> dict[str, Any]:
    """One stage run under `launcher` on all 2 x `gpus_per_node` GPUs (smoke: 2 CPU ranks); its rates."""
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    if launcher == "ray":
        config, resources = on_ray(config, address, smoke, gpus_per_node)
    else:
        resources = Resources(cpu_ranks=2) if smoke else Resources(gpus_per_node=2 * gpus_per_node)
    name = f"{'sft' if kind == 'sft' else 'rl'}-{launcher}-{repeat}"
    t0 = time.time()
    run = run_stage(kind, config, stage=name, storage=f"file://{work}/store", recipe=RECIPE,
                    work_root=work / "runs", upstream={k: upstream[k] for k in ("data", "base")},
                    resources=resources, launcher=launcher, force=True)  # a shared --work's earlier run: not a result
    out = Path(run.url.removeprefix("file://"))
    rates = sft_metrics(out, resources.world_size) if kind == "sft" else rl_metrics(out, run.as_dict())
    return {"launcher": launcher, "wall_s": time.time() - t0, **rates}


def _ratio(rows: list[dict[str, Any]], key: str, launcher: str = "ray") -> float | None:
    """Mean `key` of `launcher`'s runs over the mean of DeepSpeed's."""
    by = {ln: [r[key] for r in rows if r["launcher"] == ln and key in r] for ln in (launcher, "deepspeed")}
    if not by[launcher] or not by["deepspeed"]:
        return None
    return (sum(by[launcher]) / len(by[launcher])) / (sum(by["deepspeed"]) / len(by["deepspeed"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths, no timing claims")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs per kind (order alternates)")
    parser.add_argument("--only", choices=["sft", "reasoning_rl"], nargs="*", default=["sft", "reasoning_rl"])
    parser.add_argument("--gpus-per-node", type=int, choices=[1, 2], default=2,
                        help="GPUs of each of the two Ray nodes (1: a 2-GPU host)")
    parser.add_argument("--launchers", nargs="+", choices=["deepspeed", "ray", "torchrun"], default=["deepspeed", "ray"],
                        help="the launchers compared, in the order of the first pass (the next reverses it); "
                        "torchrun beside them tells a DeepSpeed-launcher cost from a Ray gain (round 19: Ray 1.09x on SFT)")
    parser.add_argument("--work", type=Path, help="the store and stage runs (default OUT/work); jobs of one "
                        "session that share it make the data and base once")
    args = parser.parse_args()
    per_node = args.gpus_per_node
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    results = ResultFile.resume(args.out / "ray_vs_deepspeed.json")
    results.put("versions", result=versions())
    results.put("layout", result={"ray_nodes": 2, "gpus_per_node": 0 if args.smoke else per_node})
    nodes = host_nodes(args.smoke, per_node)
    upstream = setup_inputs(work, args.smoke)
    log(f"setup done: {upstream}")
    configs = stage_configs(args.smoke, per_node)
    with local_ray_cluster(work, nodes) as address:
        log(f"Ray cluster of {len(nodes)} nodes at {address}")
        for kind in args.only:
            rows: list[dict[str, Any]] = []
            for i in range(args.repeat):
                order = args.launchers if i % 2 == 0 else args.launchers[::-1]
                for launcher in order:
                    log(f"{kind} under {launcher} ({i + 1}/{args.repeat})")
                    rows.append(_run(kind, launcher, configs[kind], work, upstream, args.smoke, address, i, per_node))
                    key = "tokens_per_s" if kind == "sft" else "rollout_tokens_per_s"
                    results.put(kind, result={
                        "runs": rows, "ray_over_deepspeed": _ratio(rows, key),
                        "step_seconds_ray_over_deepspeed": _ratio(rows, "step_seconds_mean"),
                        "over_deepspeed": {ln: _ratio(rows, key, ln) for ln in args.launchers if ln != "deepspeed"}})
                    log(f"  {rows[-1]}")
    log(f"results: {results.path}")


if __name__ == "__main__":
    main()

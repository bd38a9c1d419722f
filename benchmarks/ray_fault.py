"""Issue 33's fault run: a worker of a stage on a two-node Ray cluster killed after the stage's
first checkpoint; the stage must fail fast naming that worker, and its rerun resume and finish.

The cluster and the stage are benchmarks/ray_vs_deepspeed.py's (same setup, same `sft` config:
ZeRO-3, 0.5B shape, 2 Ray nodes x --gpus-per-node GPUs; `sft` because it checkpoints soonest),
with a checkpoint every few steps. The stage runs through `pipeline.execute.run_stage`, the
path a recipe's stage task takes, so the failure is the orchestrator's own StageFailed. As the
suite's CPU kill test (tests/stages/test_ray_cluster.py) does:

1. start the stage; once its first checkpoint is published (`checkpoints/step-N/_COMPLETE` in
   the store), SIGKILL the job process of one rank (--rank; default the first rank of the second
   Ray node), found by its $RANK and job file (`_ray_cluster.rank_process`);
2. time kill -> StageFailed, and check its reason names that worker: `worker rank R (node ...,
   pid P)` where P is the rank's Ray worker (the killed process's parent), `killed by SIGKILL`;
3. rerun the same stage: record the step it resumed from (the manifest's `resumed_from_step`,
   which must be the last checkpoint published before the failure) and that it finished.

    # on the 4-GPU machine (ray installed as benchmarks/gpu_plans/h100x4-ray.yaml says):
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 benchmarks/ray_fault.py --out "$OUT" --work /tmp/ray_work 2>&1 | tee "$OUT/ray_fault.log"
    # here (CPU): the same code path, 2 raylets with 1 CPU rank each, tiny shapes (~1-2 min)
    python benchmarks/ray_fault.py --smoke --out /tmp/ray_fault_smoke

Results: OUT/ray_fault.json (`checkpoint`, `kill`, `failure`, `rerun`, `problems`); exit 1 when
a fact is not as it should be (each named under `problems`). Run on 4 x H200 in round 19
(benchmarks/RESULTS.md): no problem found.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere

from benchmarks._ray_cluster import host_nodes, local_ray_cluster, rank_process  # noqa: E402 - needs ROOT on sys.path
from benchmarks._record import SAFE_ENV, ResultFile, log, versions  # noqa: E402
from benchmarks.ray_vs_deepspeed import RECIPE, on_ray, setup_inputs, stage_configs  # noqa: E402

os.environ.update(SAFE_ENV)  # this process and every one it starts

STAGE, ENTRY = "sft-fault", "stages.sft.job"
FAST_S = 45.0  # the suite's kill test's bound on kill -> failure


def published_checkpoints(work: Path) -> list[int]:
    """The steps of the fault stage's checkpoints published in the store, ascending."""
    done = glob.glob(f"{work}/store/{RECIPE}/{STAGE}-*/checkpoints/step-*/_COMPLETE")
    return sorted(int(Path(p).parent.name.removeprefix("step-")) for p in done)


class Killer(threading.Thread):
    """Waits for the first published checkpoint, then SIGKILLs rank `rank`'s job process."""

    def __init__(self, work: Path, rank: int):
        super().__init__(daemon=True)
        self.work, self.rank = work, rank
        self.done = threading.Event()  # the stage ended: give up
        self.started_at = time.time()
        self.record: dict[str, Any] = {}

    def run(self) -> None:
        while not self.done.is_set() and not (seen := published_checkpoints(self.work)):
            time.sleep(0.1)
        if self.done.is_set():
            return
        self.record["checkpoint"] = {"step": seen[0], "seen_after_s": time.time() - self.started_at}
        while not self.done.is_set():
            victim = rank_process(self.rank, ENTRY, self.work)
            if victim is not None:
                ray_worker_pid = victim.ppid()
                victim.kill()
                self.record["kill"] = {"at_epoch_s": time.time(), "rank": self.rank, "pid": victim.pid,
                                       "ray_worker_pid": ray_worker_pid, "after_start_s": time.time() - self.started_at,
                                       "checkpoints_published": published_checkpoints(self.work)}
                return
            time.sleep(0.1)


def _run_stage(work: Path, config: dict[str, Any], resources: Any, upstream: dict[str, str], force: bool) -> Any:
    """The fault stage on the Ray cluster, as a recipe's stage task runs it (StageFailed if it fails)."""
    from pipeline.execute import run_stage

    return run_stage("sft", config, stage=STAGE, storage=f"file://{work}/store", recipe=RECIPE, work_root=work / "runs",
                     upstream=upstream, resources=resources, launcher="ray", force=force)


def _first_run(work: Path, config: dict[str, Any], resources: Any, upstream: dict[str, str], rank: int) -> dict[str, Any]:
    """The stage started afresh with a Killer beside it: what the Killer did and how it ended."""
    from stages.common.contract import StageFailed

    killer = Killer(work, rank)
    killer.start()
    record: dict[str, Any] = {}
    try:
        _run_stage(work, config, resources, upstream, force=True)  # fresh: no earlier run's checkpoints
        record["failure"] = None  # finished: the kill came too late (or never)
    except StageFailed as e:
        failed_at = time.time()
        killer.done.set()
        killer.join()
        kill = killer.record.get("kill")
        record["failure"] = {"reason": e.reason, "exit_code": e.exit_code, "log": str(e.log_path),
                             "kill_to_failed_s": failed_at - kill["at_epoch_s"] if kill else None,
                             "checkpoints_published": published_checkpoints(work)}
    killer.done.set()
    killer.join()
    return {**killer.record, **record}


def _rerun(work: Path, config: dict[str, Any], resources: Any, upstream: dict[str, str]) -> dict[str, Any]:
    t0 = time.time()
    run = _run_stage(work, config, resources, upstream, force=False)  # resumes from the published checkpoint
    summary = run.summary or {}
    return {"status": run.status, "wall_s": time.time() - t0, "resumed_from_step": summary.get("resumed_from_step"),
            "steps": summary.get("steps"), "world_size": summary.get("world_size"), "url": run.url}


def problems(facts: dict[str, Any], max_steps: int, world_size: int) -> list[str]:
    """What in the run's facts is not as issue 33 requires (empty: failed fast, named, resumed)."""
    kill, failure, rerun = facts.get("kill"), facts.get("failure"), facts.get("rerun") or {}
    if not kill:
        return ["no rank was killed (no checkpoint published, or the rank's process not found, before the stage ended)"]
    if not failure:
        return ["the stage finished although a rank was killed"]
    found = []
    if failure["kill_to_failed_s"] > FAST_S:
        found.append(f"the stage failed {failure['kill_to_failed_s']:.1f} s after the kill (> {FAST_S:.0f} s)")
    named = f"worker rank {kill['rank']} (node "
    if not (named in failure["reason"] and f"pid {kill['ray_worker_pid']})" in failure["reason"]
            and "killed by SIGKILL" in failure["reason"]):
        found.append(f"the failure does not name the killed worker ({named}..., pid {kill['ray_worker_pid']}), "
                     f"killed by SIGKILL): {failure['reason'][:300]!r}")
    last = max(failure["checkpoints_published"], default=None)
    if rerun.get("resumed_from_step") != last:
        found.append(f"the rerun resumed from step {rerun.get('resumed_from_step')}, not from the last checkpoint ({last})")
    if rerun.get("status") != "ran" or rerun.get("steps") != max_steps or rerun.get("world_size") != world_size:
        found.append(f"the rerun did not finish {max_steps} steps on {world_size} ranks: {rerun}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="the store and stage runs (default OUT/work; a shared one "
                        "reuses benchmarks/ray_vs_deepspeed.py's data and base)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code path, no timing claims")
    parser.add_argument("--gpus-per-node", type=int, choices=[1, 2], default=2)
    parser.add_argument("--rank", type=int, help="the rank to kill (default: the first of the second Ray node)")
    parser.add_argument("--checkpoint-every", type=int, help="default 4 (smoke: 8, its steps take ~0.15 s)")
    args = parser.parse_args()
    every = args.checkpoint_every or (8 if args.smoke else 4)
    per_node = 1 if args.smoke else args.gpus_per_node  # smoke: one CPU rank per node
    rank = per_node if args.rank is None else args.rank
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    results = ResultFile(args.out / "ray_fault.json")
    results.put("versions", result=versions())
    nodes = host_nodes(args.smoke, per_node)
    max_steps = 3 * every  # the kill lands between the first checkpoint and the end
    config = {**stage_configs(args.smoke, per_node)["sft"], "max_steps": max_steps, "checkpoint_every": every}
    results.put("layout", result={"ray_nodes": 2, "gpus_per_node": 0 if args.smoke else per_node, "stage": "sft",
                                  "max_steps": max_steps, "checkpoint_every": every})
    upstream = setup_inputs(work, args.smoke)
    log(f"setup done: {upstream}")
    with local_ray_cluster(work, nodes) as address:
        log(f"Ray cluster of {len(nodes)} nodes at {address}; sft, rank {rank} killed after the first checkpoint")
        config, resources = on_ray(config, address, args.smoke, per_node)
        facts = _first_run(work, config, resources, upstream, rank)
        for key in ("checkpoint", "kill", "failure"):
            results.put(key, result=facts.get(key))
        log(f"first run: {({k: facts.get(k) for k in ('checkpoint', 'kill', 'failure')})}")
        if facts.get("failure"):
            facts["rerun"] = _rerun(work, config, resources, upstream)
            results.put("rerun", result=facts["rerun"])
            log(f"rerun: {facts['rerun']}")
    found = problems(facts, max_steps, resources.world_size)
    results.put("problems", result=found)
    log(f"results: {results.path}" + "".join(f"\n  PROBLEM: {p}" for p in found))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()

"""The reasoning_rl stage on two gloo ranks with split placement (rank 0 trains, rank 1 only
generates), through a fault: the engine rank is killed mid-run, the stage fails in bounded
time with no process left, and a rerun resumes from the last checkpoint with the engine's
unfinished rollouts (its per-rank pool file)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.stages.reasoning_rl.test_reasoning_rl_stage import rl_config

pytestmark = pytest.mark.slow

FAIL_WITHIN_S = 120  # the launcher must bring the other rank down well before any collective timeout


def _rank_process(root: psutil.Process, rank: int) -> psutil.Process:
    from pipeline.hang import rank_processes  # the ranks as the hang report finds them

    deadline = time.time() + 60
    while time.time() < deadline:
        for found, pid in rank_processes(root.pid):
            if found == str(rank):
                return psutil.Process(pid)
        time.sleep(0.1)
    raise AssertionError(f"no reasoning_rl rank {rank} under pid {root.pid}")


def test_split_placement_survives_a_killed_engine_rank_and_resumes_its_pool(tiny_policy, tmp_path):
    from pipeline.execute import adhoc_target, run_stage
    from pipeline.launch import launch_command
    from stages.common.checkpoint import rank_state_file, read_state
    from stages.common.checkpoint_store import CheckpointStore
    from stages.common.contract import Resources, StageJob
    from stages.registry import STAGE_KINDS

    config = rl_config(tiny_policy, steps=4, checkpoint_every=1, zero_stage=3)
    config["rollout"] = {**config["rollout"], "device": "auto", "gpus": 1}
    storage, resources = str(tmp_path / "store"), Resources(cpu_ranks=2)
    spec = STAGE_KINDS["reasoning_rl"]
    cfg = spec.config.model_validate({"kind": "reasoning_rl", **config})
    target = adhoc_target("reasoning_rl", config, stage="rl", storage=storage)

    # 1) the job on two ranks (told to stop after step 3, so it cannot finish before the kill),
    #    its engine rank killed once the first checkpoint is complete
    job = StageJob(recipe="adhoc", stage="rl", kind="reasoning_rl", hash=target.hash,
                   config={**cfg.model_dump(mode="json"), "steps": 3}, stage_url=target.url,
                   output_dir=str(tmp_path / "killed_out"), work_dir=str(tmp_path / "killed_scratch"))
    job.write(tmp_path / "job.json")
    repo = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false"}
    store = CheckpointStore(target.url, {})
    with launch_command(spec.entry, tmp_path / "job.json", resources, "torchrun", True) as command:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=repo,
                                start_new_session=True, text=True)
        try:
            root = psutil.Process(proc.pid)
            deadline = time.time() + 300
            while store.latest() is None and proc.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            assert store.latest() is not None, proc.communicate(timeout=60)[0][-3000:]
            family = [root, *root.children(recursive=True)]
            _rank_process(root, 1).kill()
            killed = time.time()
            log = proc.communicate(timeout=FAIL_WITHIN_S)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    assert proc.returncode != 0 and time.time() - killed < FAIL_WITHIN_S, log[-3000:]
    assert "rank 1" in log or "local_rank: 1" in log, log[-3000:]  # the launcher names the failed rank
    time.sleep(2)  # the launcher reaps its workers as it exits
    assert [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []

    latest = store.latest()
    assert latest in (1, 2), log[-3000:]
    restored = store.restore(latest, tmp_path / "inspect")
    assert read_state(restored)["fingerprint"]["rollout placement"] == "split: ranks 0-0 train, 1-1 generate"
    assert not (restored / rank_state_file(0)).exists()  # rank 0 only trains: it holds no pool
    pool = read_state(restored, rank_state_file(1))["rollouts"]

    # 2) the rerun resumes from that checkpoint with the engine rank's unfinished rollouts
    run = run_stage("reasoning_rl", config, stage="rl", storage=storage, launcher="torchrun",
                    work_root=tmp_path / "work", resources=resources)
    s = run.summary
    assert s["resumed_from_step"] == latest and s["steps"] == 4
    assert s["placement"] == "split" and s["engines"] == 1 and s["trainer_ranks"] == 1
    assert s["resumed_pool_rollouts"] == len(pool["pool"])
    assert s["resumed_pool_tokens"] == sum(len(r["token_ids"]) for r in pool["pool"])
    assert s["resumed_waiting_rollouts"] == len(pool["waiting"])
    assert s["rollouts_trained"] > 0

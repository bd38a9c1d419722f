"""`launcher: ray` on a real Ray cluster of two nodes (two raylets on this machine, started by
`ray start --head` + `ray start --address` in a temp dir, torn down after): the tiny recipe's
`sft` and `reasoning_rl` through `ring-pipeline run`, each stage's 2 ranks one per Ray node;
a rank killed -9 after a checkpoint fails the stage fast, naming that worker, and the rerun
resumes from the checkpoint; reasoning_rl runs split (rank 0 trains on one node, rank 1
generates on the other, the weights broadcast between them); the speed settings' GPU probe runs
as a one-GPU task there."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from benchmarks._ray_cluster import Node, local_ray_cluster, rank_process
from tests.conftest import REPO
from tests.mlflow_db import tracking_uri

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.long_pole]  # stage runs on a cluster it starts: minutes

SFT_STEPS, RL_STEPS = 4, 2


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """The GCS address of a two-node local cluster (two CPUs each; the second declares one GPU,
    which only the speed settings' probe asks for: this machine has no CUDA)."""
    with local_ray_cluster(tmp_path_factory.mktemp("ray"), [Node(cpus=2), Node(cpus=2, gpus=1)]) as address:
        yield address


def _recipe(root: Path, address: str, base_dir: Path, data_dir: Path, policy: dict[str, Path]) -> Path:
    """The tiny recipe's sft and reasoning_rl (fewer steps), on the suite's base model and RL policy."""
    tiny = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())["stages"]
    sft = {**tiny["sft"], "model": str(base_dir), "data": f"{data_dir}/sft.jsonl", "max_steps": SFT_STEPS,
           "checkpoint_every": 2, "max_seq_len": 256}
    rl = {**tiny["reasoning_rl"], "model": str(policy["model"]), "data": str(policy["data"]), "steps": RL_STEPS,
          "checkpoint_every": RL_STEPS, "rollout": {**tiny["reasoning_rl"]["rollout"], "device": "auto", "gpus": 1}}
    recipe = {"name": "raytiny", "storage": {"url": f"file://{root}/store", "keep_checkpoints": 1},
              "tracking": {"uri": tracking_uri(root)},
              "defaults": {"work_dir": str(root / "work"), "launcher": "ray",
                           "ray": {"address": address, "placement_timeout_s": 60},
                           "resources": {"nodes": 2, "cpu_ranks": 1}},
              "stages": {"sft": sft, "reasoning_rl": rl}}
    path = root / "raytiny.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def test_ray_stages_kill_a_worker_fail_fast_and_resume(ray_cluster, tmp_path, base_dir, data_dir, tiny_policy,
                                                       prefect_api):
    recipe = _recipe(tmp_path, ray_cluster, base_dir, data_dir, tiny_policy)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}  # the suite's shared server: Ray is the claim
    first = subprocess.Popen(_cli("run", str(recipe), "--only", "sft"), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    try:
        # a hang guard, not a speed check: the whole test took 220 s in a passing suite run on 2
        # cores, and 240 s to this checkpoint were once not enough there
        deadline = time.time() + 480
        while not glob.glob(f"{tmp_path}/store/raytiny/sft-*/checkpoints/step-*/_COMPLETE"):
            assert first.poll() is None, first.stdout.read()[-4000:]
            assert time.time() < deadline, "no sft checkpoint within 480 s"
            time.sleep(0.1)
        victim = rank_process(1, "stages.sft.job", tmp_path)
        assert victim is not None, "rank 1's job process not found"
        victim.kill()
        killed_at = time.time()
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 1, out[-4000:]
    assert time.time() - killed_at < 45, "the stage did not fail fast after its worker died"
    assert "worker rank 1 (node" in out and "killed by SIGKILL" in out, out[-4000:]

    # the rerun resumes sft from its checkpoint, then runs reasoning_rl split over the two nodes
    rerun = subprocess.run(_cli("run", str(recipe)), cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-6000:]
    assert "sft: ran" in out and "reasoning_rl: ran" in out, out[-3000:]
    sft_dir = Path(glob.glob(f"{tmp_path}/store/raytiny/sft-*")[0])
    summary = json.loads((sft_dir / "manifest.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == SFT_STEPS
    assert summary["resumed_from_step"] and summary["resumed_from_step"] >= 2
    log = (sft_dir / "logs" / "stage.log").read_text()
    nodes = {ln.split("Ray node ")[1].split(",")[0] for ln in log.splitlines() if ln.startswith("ray_launch: worker")}
    assert len(nodes) == 2, log[:2000]  # one rank per Ray node
    rl_dir = Path(glob.glob(f"{tmp_path}/store/raytiny/reasoning_rl-*")[0])
    rl = json.loads((rl_dir / "manifest.json").read_text())["summary"]
    assert rl["steps"] == RL_STEPS and rl["placement"] == "split" and rl["trainer_ranks"] == 1


# -- the launcher alone (no stage): stops, failures and refusals, in seconds ------------------------
def _job_file(root: Path, *, lease: bool = True) -> Path:
    """A job file as pipeline.execute writes it, its stage dir holding the `_RUNNING` lease."""
    stage_dir = root / "store" / "adhoc" / "s-0"
    stage_dir.mkdir(parents=True)
    if lease:
        (stage_dir / "_RUNNING").write_text("{}")
    job = root / "job.json"
    job.write_text(json.dumps({"stage": "probe", "kind": "sft", "stage_url": f"file://{stage_dir}",
                               "output_dir": str(root / "output"), "work_dir": str(root / "scratch")}))
    return job


def _launch(address: str, job: Path, code: str) -> subprocess.Popen:
    """pipeline.ray_launch of `python -c code --job job` on 2 nodes x 1 CPU rank."""
    return subprocess.Popen([sys.executable, "-m", "pipeline.ray_launch", "--address", address, "--nodes", "2",
                             "--cpu-ranks", "1", "--placement-timeout", "30", "--", "-c", code, "--job", str(job)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


_SLEEPER = "import os, time; print('rank', os.environ['RANK'], 'up', flush=True); time.sleep(600)"


def _wait_for_ranks(proc: subprocess.Popen, n: int = 2) -> list[str]:
    seen: list[str] = []
    while sum(" up" in s for s in seen) < n:
        line = proc.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
    return seen


def _sleepers_alive(job: Path) -> bool:
    """Whether a rank of the launch of `job` still runs."""
    import psutil

    return any((p.info["cmdline"] or [])[1:] == ["-c", _SLEEPER, "--job", str(job)]
               for p in psutil.process_iter(["cmdline"]))


def test_a_stop_signal_stops_every_worker(ray_cluster, tmp_path):
    job = _job_file(tmp_path)
    proc = _launch(ray_cluster, job, _SLEEPER)
    _wait_for_ranks(proc)
    os.killpg(proc.pid, signal.SIGINT)  # as pipeline.launch.stop_group does (Ctrl-C, a Prefect cancel)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert not _sleepers_alive(job)


def test_the_driver_killed_takes_its_workers_down(ray_cluster, tmp_path):
    job = _job_file(tmp_path)
    proc = _launch(ray_cluster, job, _SLEEPER)
    _wait_for_ranks(proc)
    proc.kill()  # kill -9: Ray kills the dead driver's actors, and each rank dies with its actor
    proc.wait()
    deadline = time.time() + 60
    while _sleepers_alive(job):
        assert time.time() < deadline, "ranks outlived their driver by 60 s"
        time.sleep(0.5)


def test_a_failing_worker_stops_its_peer_and_is_named(ray_cluster, tmp_path):
    code = ("import os, sys, time\nif os.environ['RANK'] == '1':\n    time.sleep(1); "
            "raise ValueError('rank one broke')\ntime.sleep(600)")
    proc = _launch(ray_cluster, _job_file(tmp_path), code)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    verdict = [ln for ln in out.splitlines() if ln.startswith("[launcher] ")]
    assert len(verdict) == 1 and "worker rank 1 (node" in verdict[0] and "ValueError: rank one broke" in verdict[0]

    from pipeline.job_output import JobOutput

    output = JobOutput("probe", "sft")
    for line in out.splitlines():
        output.feed(line)
    failure = output.failure(proc.returncode)
    assert failure.reason.startswith("worker rank 1 (node") and not failure.user_error


def test_a_node_that_cannot_see_the_store_is_refused_before_any_rank_starts(ray_cluster, tmp_path):
    proc = _launch(ray_cluster, _job_file(tmp_path, lease=False), _SLEEPER)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "probe (sft) failed: " in out and "cannot see the stage's artifact dir" in out
    assert "the artifact store is a local path" in out and " up" not in out


def test_a_cluster_without_room_fails_naming_what_it_asked_for(ray_cluster, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline.ray_launch", "--address", ray_cluster, "--nodes", "3",
                           "--cpu-ranks", "1", "--placement-timeout", "3", "--", "-c", "pass", "--job",
                           str(_job_file(tmp_path))], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no room for 3 node(s) of {'CPU': 1.0}" in proc.stderr and "2 node(s)" in proc.stderr, proc.stderr


def test_the_speed_probe_runs_on_a_gpu_of_the_cluster_and_says_it_saw_no_cuda(ray_cluster):
    """The `auto` speed settings' probe (pipeline/ray_probe.py) as a one-GPU task on the cluster:
    Ray gives it the declared GPU, torch there finds no CUDA device, the facts stay unknown."""
    from pipeline.speed import ray_gpus

    ray_gpus.cache_clear()
    facts = ray_gpus(ray_cluster)
    assert facts.device == "unknown", facts
    assert facts.note.startswith(f"a one-GPU task on the Ray cluster at '{ray_cluster}' saw no CUDA device "
                                 "(no CUDA device visible to torch)"), facts.note

"""`launcher: ray` on a real Ray cluster of two nodes (two raylets on this machine, started by
`ray start --head` + `ray start --address` in a temp dir, torn down after): the tiny recipe's
`sft` and `reasoning_rl` through `ring-pipeline run`, each stage's 2 ranks one per Ray node;
a rank killed -9 after a checkpoint fails the stage fast, naming that worker, and the rerun
resumes from the checkpoint; reasoning_rl runs split (rank 0 trains on one node, rank 1
generates on the other, the weights broadcast between them)."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.conftest import REPO

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SFT_STEPS, RL_STEPS = 6, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], log: Path, timeout_s: float = 90) -> subprocess.Popen:
    """`ray start ... --block` in its own process group; returns once the node is up."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    out = open(log, "w")
    proc = subprocess.Popen(["ray", "start", "--block", "--disable-usage-stats", "--num-cpus=2", "--num-gpus=0",
                             "--object-store-memory=80000000", "--node-ip-address=127.0.0.1",
                             f"--dashboard-agent-listen-port={_free_port()}",
                             f"--dashboard-agent-grpc-port={_free_port()}", f"--metrics-export-port={_free_port()}",
                             f"--runtime-env-agent-port={_free_port()}", *args],
                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + timeout_s
    while "Ray runtime started" not in log.read_text():
        assert proc.poll() is None, f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"ray start not up in {timeout_s}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return proc


def _stop_node(proc: subprocess.Popen) -> None:
    """The node's whole process group (raylet, GCS, agents, workers): these only, by group id."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """The GCS address of a two-node local cluster."""
    root = tmp_path_factory.mktemp("ray")
    temp = Path("/tmp") / f"ring-ray-{os.getpid()}"  # Ray's socket paths must stay short
    port = _free_port()
    nodes = []
    try:
        nodes.append(_start_node(["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
                                  f"--dashboard-port={_free_port()}"],
                                 root / "head.log"))
        nodes.append(_start_node([f"--address=127.0.0.1:{port}"], root / "node2.log"))
        yield f"127.0.0.1:{port}"
    finally:
        for proc in reversed(nodes):
            _stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _recipe(root: Path, address: str, base_dir: Path, data_dir: Path, policy: dict[str, Path]) -> Path:
    """The tiny recipe's sft and reasoning_rl (fewer steps), on the suite's base model and RL policy."""
    tiny = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())["stages"]
    sft = {**tiny["sft"], "model": str(base_dir), "data": f"{data_dir}/sft.jsonl", "max_steps": SFT_STEPS,
           "checkpoint_every": 2, "max_seq_len": 256}
    rl = {**tiny["reasoning_rl"], "model": str(policy["model"]), "data": str(policy["data"]), "steps": RL_STEPS,
          "checkpoint_every": 1, "rollout": {**tiny["reasoning_rl"]["rollout"], "device": "auto", "gpus": 1}}
    recipe = {"name": "raytiny", "storage": {"url": f"file://{root}/store", "keep_checkpoints": 1},
              "tracking": {"uri": f"sqlite:///{root}/mlflow.db"},
              "defaults": {"work_dir": str(root / "work"), "launcher": "ray",
                           "ray": {"address": address, "placement_timeout_s": 60},
                           "resources": {"nodes": 2, "cpu_ranks": 1}},
              "stages": {"sft": sft, "reasoning_rl": rl}}
    path = root / "raytiny.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def _rank_process(rank: int, entry: str):
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info["cmdline"] or []
            if entry in cmd and "pipeline.job_guard" not in cmd and p.environ().get("RANK") == str(rank):
                return p
    return None


def test_ray_stages_kill_a_worker_fail_fast_and_resume(ray_cluster, tmp_path, base_dir, data_dir, tiny_policy):
    recipe = _recipe(tmp_path, ray_cluster, base_dir, data_dir, tiny_policy)
    first = subprocess.Popen(_cli("run", str(recipe), "--only", "sft"), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not glob.glob(f"{tmp_path}/store/raytiny/sft-*/checkpoints/step-*/_COMPLETE"):
            assert first.poll() is None, first.stdout.read()[-4000:]
            assert time.time() < deadline, "no sft checkpoint within 240 s"
            time.sleep(0.1)
        victim = _rank_process(1, "stages.sft.job")
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
    rerun = subprocess.run(_cli("run", str(recipe)), cwd=REPO, capture_output=True, text=True, timeout=600)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-6000:]
    assert "sft: ran" in out and "reasoning_rl: ran" in out, out[-3000:]
    sft_dir = Path(glob.glob(f"{tmp_path}/store/raytiny/sft-*")[0])
    summary = json.loads((sft_dir / "manifest.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == SFT_STEPS
    assert summary["resumed_from_step"] and summary["resumed_from_step"] >= 2
    log = (sft_dir / "logs" / "stage.log").read_text()
    nodes = {line.split("Ray node ")[1].split(",")[0] for line in log.splitlines() if line.startswith("ray_launch: worker")}
    assert len(nodes) == 2, log[:2000]  # one rank per Ray node
    rl_dir = Path(glob.glob(f"{tmp_path}/store/raytiny/reasoning_rl-*")[0])
    rl = json.loads((rl_dir / "manifest.json").read_text())["summary"]
    assert rl["steps"] == RL_STEPS and rl["placement"] == "split" and rl["trainer_ranks"] == 1

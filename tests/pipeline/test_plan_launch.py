"""Plan hashing/selection and the launcher, without running real stages."""
from __future__ import annotations

import sys

import pytest

from pipeline.launch import build_command, launch_job
from pipeline.loader import load_recipe
from pipeline.plan import make_plan
from stages.common.contract import Resources, StageFailed
from tests.pipeline.test_recipe import GOOD


def _plan(tmp_path, overrides=()):
    p = tmp_path / "r.yaml"
    p.write_text(GOOD.replace("name: t\n", f"name: t\nstorage: {{url: 'file://{tmp_path}/store'}}\n"))
    return make_plan(load_recipe(p, list(overrides)))


def test_hash_tracks_results_not_cosmetics(tmp_path):
    base = _plan(tmp_path)
    assert base.names == ["data", "base", "sft"]
    assert base["sft"].deps == ["base", "data"]
    assert all(not s.done for s in base.stages)
    same = _plan(tmp_path, ["stages.sft.checkpoint_every=7", "stages.sft.log_every=3",
                            "defaults.resources.cpu_ranks=4", "defaults.launcher=torchrun"])
    assert [s.hash for s in same.stages] == [s.hash for s in base.stages]
    lr = _plan(tmp_path, ["stages.sft.lr=1e-4"])
    assert lr["sft"].hash != base["sft"].hash and lr["base"].hash == base["base"].hash
    upstream = _plan(tmp_path, ["stages.base.seed=3"])
    assert upstream["base"].hash != base["base"].hash
    assert upstream["sft"].hash != base["sft"].hash  # a changed upstream changes the downstream hash
    assert upstream["data"].hash == base["data"].hash


def test_selection(tmp_path):
    plan = _plan(tmp_path)
    assert plan.select(["sft"], None, []) == (["sft"], set())
    assert plan.select([], "base", []) == (["base", "sft"], {"base", "sft"})
    assert plan.select([], None, ["data"]) == (["data", "base", "sft"], {"data", "base", "sft"})
    with pytest.raises(KeyError, match="no stage named 'nope'"):
        plan.select(["nope"], None, [])


def test_resolved_config_points_at_upstream_artifacts(tmp_path):
    plan = _plan(tmp_path)
    cfg = plan["sft"].resolved_config()
    assert cfg["model"] == plan["base"].url
    assert cfg["data"] == plan["data"].url + "/sft.jsonl"


def test_launch_commands():
    job = "/tmp/job.json"
    cpu = build_command("stages.sft.train", job, Resources(cpu_ranks=2, master_port=29600), "deepspeed", True)
    # CPU ranks of one node: forked from one warm process, whichever launcher is named
    forked = ["-m", "pipeline.local_ranks", "--nproc-per-node", "2", "--master-port", "29600",
              "--", "-m", "stages.sft.train", "--job", job]
    assert cpu[1:] == forked
    assert build_command("stages.sft.train", job, Resources(cpu_ranks=2, master_port=29600), "torchrun", True)[1:] == forked
    gpu = build_command("stages.sft.train", job, Resources(gpus_per_node=2, master_port=29600), "deepspeed", True)
    assert gpu[1:] == ["-m", "deepspeed.launcher.runner", "--master_port", "29600", "--num_nodes", "1",
                       "--num_gpus", "2", "--module", "stages.sft.train", "--job", job]
    multi = build_command("stages.sft.train", job, Resources(nodes=4, gpus_per_node=8, hostfile="/h",
                                                             master_port=29600), "deepspeed", True)
    assert ["--hostfile", "/h", "--num_nodes", "4"] == multi[5:9] and "8" in multi
    tr = build_command("stages.sft.train", job, Resources(gpus_per_node=8, master_port=29600), "torchrun", True)
    assert tr[1:7] == ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "8"]
    single = build_command("stages.curate.job", job, Resources(cpu_ranks=2), "deepspeed", False)
    assert single[1:] == ["-m", "stages.curate.job", "--job", job]


def test_failed_job_raises_with_its_last_lines(tmp_path, capsys):
    script = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)\n"
    log = tmp_path / "stage.log"
    with pytest.raises(StageFailed, match=r"exited with code 3") as failed:
        launch_job([sys.executable, "-c", script], "demo", log, Resources())
    assert failed.value.excerpt == [f"line {i}" for i in range(90, 100)] and not failed.value.user_error
    assert capsys.readouterr().out == ""  # the job's lines go to its log, not the console
    assert log.read_text().splitlines() == [f"line {i}" for i in range(100)]


def test_interrupt_stops_the_job(tmp_path):
    import os
    import signal
    import threading
    import time

    import psutil

    script = "import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nprint('child', p.pid, flush=True)\ntime.sleep(60)\n"
    log = tmp_path / "stage.log"
    # a shell that starts us in the background ignores SIGINT; make Ctrl-C raise as in a terminal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.time()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch_job([sys.executable, "-c", script], "demo", log, Resources())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.time() - t0 < 15
    child = int(log.read_text().split()[1])
    time.sleep(0.5)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_deepspeed_runs_on_the_gpus_the_user_pinned(monkeypatch):
    # DeepSpeed's runner drops CUDA_VISIBLE_DEVICES when --num_gpus is given (ranks would land
    # on GPUs 0..n-1 beside someone else's job): the pinned GPUs must reach it as --include.
    job = "/w/job.json"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    two = build_command("stages.sft.train", job, Resources(gpus_per_node=2, master_port=29600), "deepspeed", True)
    assert two[:3] == ["env", "-u", "CUDA_VISIBLE_DEVICES"]
    assert two[two.index("--include") + 1] == "localhost:2,3" and "--num_gpus" not in two
    assert two[-4:] == ["--module", "stages.sft.train", "--job", job]
    with pytest.raises(StageFailed, match=r"gpus_per_node is 4.*CUDA_VISIBLE_DEVICES='2,3,5'.*only 3"):
        build_command("stages.sft.train", job, Resources(gpus_per_node=4), "deepspeed", True)
    # CPU ranks, torchrun (honours the variable itself) and hostfile runs are left as they were
    assert "--include" not in build_command("stages.sft.train", job, Resources(cpu_ranks=2), "deepspeed", True)
    assert build_command("stages.sft.train", job, Resources(gpus_per_node=2), "torchrun", True)[0] == sys.executable
    multi = build_command("stages.sft.train", job, Resources(nodes=2, gpus_per_node=2, hostfile="/h"), "deepspeed", True)
    assert "--include" not in multi and "--hostfile" in multi
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "--num_gpus" in build_command("stages.sft.train", job, Resources(gpus_per_node=1), "deepspeed", True)

"""run_job, the one way a stage job runs: a user error is one message from rank 0 and exit 2,
a bug keeps its traceback, and the process group is left either way."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from stages.common.contract import StageError, StageJob
from stages.common.entry import run_job


@pytest.fixture
def job_file(tmp_path):
    job = StageJob(recipe="t", stage="train-it", kind="sft", hash="0" * 16, config={},
                   stage_url=f"file://{tmp_path}/store", output_dir=str(tmp_path / "out"),
                   work_dir=str(tmp_path / "work"))
    job.write(tmp_path / "job.json")
    return ["--job", str(tmp_path / "job.json"), "--local_rank=0"]


def test_a_user_error_exits_2_with_one_message_and_leaves_the_group(gloo_group, job_file, capsys):
    def main(job):
        assert dist.is_initialized() and job.stage == "train-it"
        raise StageError("data.jsonl:3: no `messages` field")

    assert run_job(main, job_file) == 2
    assert capsys.readouterr().err == "train-it (sft) failed: data.jsonl:3: no `messages` field\n"
    assert not dist.is_initialized()


def test_a_bug_keeps_its_traceback_and_leaves_the_group(gloo_group, job_file, capsys):
    def main(job):
        raise ZeroDivisionError("a bug")

    with pytest.raises(SystemExit) as exit_:
        run_job(main, job_file)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "ZeroDivisionError: a bug" in err and "in main" in err
    assert not dist.is_initialized()


def test_success_is_0(job_file):
    assert run_job(lambda job: None, job_file) == 0


def test_sigusr2_prints_every_threads_stack_and_the_rank_goes_on(tmp_path):
    """How an operator (or gpu_scaling's stage timeout) sees where a hung rank waits."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    job = StageJob(recipe="t", stage="hang", kind="sft", hash="0" * 16, config={},
                   stage_url=f"file://{tmp_path}/store", output_dir=str(tmp_path / "out"),
                   work_dir=str(tmp_path / "work"))
    job.write(tmp_path / "job.json")
    ready = tmp_path / "ready"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from stages.common.entry import run_job\n"
        "def waits_for_a_peer(job):\n"
        f"    Path({str(ready)!r}).write_text('x')\n"
        "    time.sleep(4)\n"
        f"sys.exit(run_job(waits_for_a_peer, ['--job', {str(tmp_path / 'job.json')!r}]))\n")
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    deadline = time.time() + 60
    while not ready.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err  # still ran to the end
    assert "in waits_for_a_peer" in err and "Current thread" in err


def test_a_failed_rank_prints_its_cause_then_leaves_even_if_the_group_never_lets_go(tmp_path):
    """NCCL's teardown waits forever for a peer still inside a collective (a 4-GPU resume hung
    so, its cause never printed). Stand-in: a destroy_process_group that never returns."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    job = StageJob(recipe="t", stage="stuck", kind="sft", hash="0" * 16, config={},
                   stage_url=f"file://{tmp_path}/store", output_dir=str(tmp_path / "out"),
                   work_dir=str(tmp_path / "work"))
    job.write(tmp_path / "job.json")
    script = (
        "import sys, time\n"
        "import torch.distributed as dist\n"
        "from stages.common import entry\n"
        "from stages.common.distributed import init_distributed\n"
        "entry.LEAVE_GROUP_S = 1.0\n"
        "def main(job):\n"
        "    init_distributed()\n"
        "    dist.destroy_process_group = lambda *a, **k: time.sleep(3600)  # a peer never lets go\n"
        "    raise RuntimeError('shard 3 of the checkpoint is missing')\n"
        f"sys.exit(entry.run_job(main, ['--job', {str(tmp_path / 'job.json')!r}]))\n")
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # world of one
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=repo, env=env,
                         timeout=120)
    assert out.returncode == 1 and time.time() - t0 < 60
    cause = out.stderr.index("RuntimeError: shard 3 of the checkpoint is missing")
    assert cause < out.stderr.index("did not finish in 1s")  # the cause first

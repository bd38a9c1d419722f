"""run_job, the one way a stage job runs: the job gets its config typed, parsed once from the
job file (a hand-edited one that no longer parses is a user error naming the file and the key),
a user error is one message from rank 0 and exit 2, a bug keeps its traceback, and the process
group is left either way."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar, Literal

import pytest
import torch.distributed as dist
from pydantic import Field, model_validator

from stages.common.contract import StageConfig, StageError, StageJob
from stages.common.entry import run_job


class ProbeConfig(StageConfig):
    kind: Literal["probe"] = "probe"
    lr: float = Field(1e-3, gt=0)
    data: str = "rows.jsonl"
    parsed: ClassVar[int] = 0  # how many times a config was parsed into this model

    @model_validator(mode="after")
    def _count(self) -> "ProbeConfig":
        type(self).parsed += 1
        return self


def _job(tmp_path, config=None, stage="train-it") -> StageJob:
    return StageJob(recipe="t", stage=stage, kind="probe", hash="0" * 16,
                    config={"kind": "probe"} if config is None else config,
                    stage_url=f"file://{tmp_path}/store", output_dir=str(tmp_path / "out"),
                    work_dir=str(tmp_path / "work"))


REPO = Path(__file__).resolve().parents[3]


def _script_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -c SCRIPT` job process run from the repository's code."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


@pytest.fixture
def job_file(tmp_path):
    _job(tmp_path, {"kind": "probe", "lr": 0.5, "data": "s3://b/x.jsonl"}).write(tmp_path / "job.json")
    return ["--job", str(tmp_path / "job.json"), "--local_rank=0"]


def test_main_gets_the_config_typed_parsed_once(job_file, monkeypatch):
    monkeypatch.setattr(ProbeConfig, "parsed", 0)
    seen = []
    assert run_job(lambda job, cfg: seen.append((job.stage, cfg)), ProbeConfig, job_file) == 0
    [(stage, cfg)] = seen
    assert stage == "train-it" and isinstance(cfg, ProbeConfig)
    assert (cfg.lr, cfg.data, cfg.log_every) == (0.5, "s3://b/x.jsonl", 1)  # the file's values, defaults filled
    assert ProbeConfig.parsed == 1


def test_an_untracked_job_masks_mlflow_in_its_own_process_only(job_file, tmp_path):
    """A rank that never logs to MLflow skips DeepSpeed's optional `import mlflow` (seconds of
    imports): masked in the job's own process. An in-process call leaves its caller's imports
    alone (masked, a later `from mlflow.tracking import ...` of the caller failed)."""
    seen = []
    assert run_job(lambda job, cfg: seen.append(sys.modules.get("mlflow", "absent")), ProbeConfig, job_file) == 0
    assert seen[0] is not None and sys.modules.get("mlflow", "absent") is not None
    script = ("import sys\nfrom stages.common.contract import StageConfig\nfrom stages.common.entry import run_job\n"
              "def main(job, cfg):\n    print('masked' if sys.modules.get('mlflow', 0) is None else 'importable')\n"
              "sys.exit(run_job(main, StageConfig))\n")
    _job(tmp_path).write(tmp_path / "plain.json")
    done = subprocess.run([sys.executable, "-c", script, "--job", str(tmp_path / "plain.json")], env=_script_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "masked", done.stderr


def test_a_user_error_exits_2_with_one_message_and_leaves_the_group(gloo_group, job_file, capsys):
    def main(job, cfg):
        assert dist.is_initialized() and job.stage == "train-it"
        raise StageError("data.jsonl:3: no `messages` field")

    assert run_job(main, ProbeConfig, job_file) == 2
    assert capsys.readouterr().err == "train-it (probe) failed: data.jsonl:3: no `messages` field\n"
    assert not dist.is_initialized()


def test_a_bug_keeps_its_traceback_and_leaves_the_group(gloo_group, job_file, capsys):
    def main(job, cfg):
        raise ZeroDivisionError("a bug")

    with pytest.raises(SystemExit) as exit_:
        run_job(main, ProbeConfig, job_file)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "ZeroDivisionError: a bug" in err and "in main" in err
    assert not dist.is_initialized()


def _never_called(job, cfg):
    raise AssertionError("main ran on a job file that does not parse")


@pytest.mark.parametrize("config, problem", [
    ({"kind": "probe", "lr": -1}, "config.lr: Input should be greater than 0"),
    ({"kind": "probe", "lrr": 0.1}, "config.lrr: Extra inputs are not permitted"),   # a typo
    ({"kind": "sft"}, "config.kind: Input should be 'probe'"),                      # another kind's config
    ({"kind": "probe", "data": 7}, "config.data: Input should be a valid string"),
])
def test_a_hand_edited_config_is_a_user_error_naming_the_file_and_key(tmp_path, capsys, config, problem):
    path = tmp_path / "job.json"
    _job(tmp_path, config).write(path)
    assert run_job(_never_called, ProbeConfig, ["--job", str(path)]) == 2
    assert capsys.readouterr().err == f"train-it (probe) failed: job file {path}: {problem}\n"


def test_a_broken_job_file_is_a_user_error_on_every_rank(tmp_path, capsys, monkeypatch):
    path = tmp_path / "job.json"
    _job(tmp_path).write(path)
    good = path.read_text()
    cut = good[: len(good) // 2]  # cut short: not JSON, broken on its last line
    path.write_text(cut)
    assert run_job(_never_called, ProbeConfig, ["--job", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"job file {path}:{cut.count(chr(10)) + 1}: not JSON: ") and err.count("\n") == 1, err
    data = json.loads(good)
    del data["stage_url"]
    data["seed"] = "one"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("RANK", "1")  # every rank reads the file: the others say which they are
    assert run_job(_never_called, ProbeConfig, ["--job", str(path)]) == 2
    assert capsys.readouterr().err == (f"[rank 1] job file {path}: stage_url: Field required; "
                                       "seed: Input should be a valid integer, unable to parse string as an integer\n")
    assert run_job(_never_called, ProbeConfig, ["--job", str(tmp_path / "gone.json")]) == 2
    assert capsys.readouterr().err == (f"[rank 1] job file {tmp_path / 'gone.json'}: cannot be read: "
                                       "No such file or directory\n")


def test_the_message_of_a_bad_config_never_holds_its_values(tmp_path, capsys, monkeypatch):
    """A job file carries credentials as `${env:NAME}`; the message names the key, not what it held."""
    monkeypatch.setenv("RING_TEST_TOKEN", "hunter2-not-a-number")
    path = tmp_path / "job.json"
    _job(tmp_path, {"kind": "probe", "lr": "${env:RING_TEST_TOKEN}"}).write(path)
    assert run_job(_never_called, ProbeConfig, ["--job", str(path)]) == 2
    err = capsys.readouterr().err
    assert "config.lr: Input should be a valid number" in err and "hunter2" not in err


def test_sigusr2_prints_every_threads_stack_and_the_rank_goes_on(tmp_path):
    """How an operator (or gpu_scaling's stage timeout) sees where a hung rank waits."""
    _job(tmp_path, stage="hang").write(tmp_path / "job.json")
    ready = tmp_path / "ready"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from stages.common.contract import StageConfig\n"
        "from stages.common.entry import run_job\n"
        "def waits_for_a_peer(job, cfg):\n"
        f"    Path({str(ready)!r}).write_text('x')\n"
        "    time.sleep(4)\n"
        f"sys.exit(run_job(waits_for_a_peer, StageConfig, ['--job', {str(tmp_path / 'job.json')!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=_script_env())
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
    _job(tmp_path, stage="stuck").write(tmp_path / "job.json")
    script = (
        "import sys, time\n"
        "import torch.distributed as dist\n"
        "from stages.common import entry\n"
        "from stages.common.contract import StageConfig\n"
        "from stages.common.distributed import init_distributed\n"
        "entry.LEAVE_GROUP_S = 1.0\n"
        "def main(job, cfg):\n"
        "    init_distributed()\n"
        "    dist.destroy_process_group = lambda *a, **k: time.sleep(3600)  # a peer never lets go\n"
        "    raise RuntimeError('shard 3 of the checkpoint is missing')\n"
        f"sys.exit(entry.run_job(main, StageConfig, ['--job', {str(tmp_path / 'job.json')!r}]))\n")
    env = _script_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # world of one
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=120)
    assert out.returncode == 1 and time.time() - t0 < 60
    cause = out.stderr.index("RuntimeError: shard 3 of the checkpoint is missing")
    assert cause < out.stderr.index("did not finish in 1s")  # the cause first


@pytest.mark.parametrize("failure, status", [("StageError('the engine did not start')", 2),
                                             ("RuntimeError('Engine core initialization failed')", 1)])
def test_a_failed_job_ends_its_process_whatever_its_failure_left_running(tmp_path, failure, status):
    """A rollout engine that failed to start left a thread and a child process that never end
    (vLLM's engine, round 17): Python's exit waits for both, so the rank never exited and its
    stage hung. A job run as its process's entry (run_job without argv) ends its process with
    its status once the cause is printed, its child processes stopped; no child outlives it."""
    _job(tmp_path, stage="leaves-things").write(tmp_path / "job.json")
    child_pid = tmp_path / "child.pid"
    script = (
        "import multiprocessing, sys, threading, time\n"
        "from pathlib import Path\n"
        "from stages.common.contract import StageConfig, StageError\n"
        "from stages.common.entry import run_job\n"
        "def forever(pid_file=None):\n"
        "    if pid_file:  # written whole, then renamed: the parent never reads it half-written\n"
        "        Path(pid_file + '.tmp').write_text(str(__import__('os').getpid()))\n"
        "        __import__('os').replace(pid_file + '.tmp', pid_file)\n"
        "    time.sleep(3600)\n"
        "def main(job, cfg):\n"
        "    threading.Thread(target=forever).start()\n"
        f"    multiprocessing.get_context('fork').Process(target=forever, args=({str(child_pid)!r},)).start()\n"
        f"    while not Path({str(child_pid)!r}).exists():\n"
        "        time.sleep(0.01)\n"
        f"    raise {failure}\n"
        f"sys.argv[1:] = ['--job', {str(tmp_path / 'job.json')!r}]\n"
        "sys.exit(run_job(main, StageConfig))\n")
    t0 = time.time()
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                             env=_script_env(), timeout=60)
    finally:
        pid = int(child_pid.read_text()) if child_pid.exists() else None
        alive = pid is not None and _alive(pid)
        if alive:
            os.kill(pid, 9)
    assert out.returncode == status and time.time() - t0 < 30, out.stderr[-2000:]
    assert failure.split("'")[1] in out.stderr
    assert pid is not None and not alive


def _alive(pid: int) -> bool:
    """`pid` runs (neither gone nor a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_whose_hashed_package_differs_from_the_planned_one_refuses_to_start(tmp_path, capsys):
    """A distribution the stage hash covers (reasoning-gym for its data stages) installed at another
    version where a rank runs (upgraded since `plan`, a Ray worker, another node), or installed there
    while it was missing at plan time, would publish rows the hash does not describe: the rank stops
    before `main`, naming the package, the planned version, this machine's and what to do."""
    from importlib.metadata import version

    from stages.common.contract import NOT_INSTALLED

    ran = []
    job = _job(tmp_path)
    for as_planned in ({"pydantic": version("pydantic")}, {"no-such-dist-xyz": NOT_INSTALLED}):  # run
        job.packages = as_planned
        job.write(tmp_path / "ok.json")
        assert run_job(lambda job, cfg: ran.append(job.packages), ProbeConfig,
                       ["--job", str(tmp_path / "ok.json")]) == 0
    assert ran == [{"pydantic": version("pydantic")}, {"no-such-dist-xyz": NOT_INSTALLED}]
    for planned, here, fix in ((("pydantic", "0.0.1"), version("pydantic"), "pip install pydantic==0.0.1"),
                               (("no-such-dist-xyz", "1.0"), NOT_INSTALLED, "pip install no-such-dist-xyz==1.0"),
                               (("pydantic", NOT_INSTALLED), version("pydantic"), "pip uninstall pydantic")):
        job.packages = dict([planned])
        job.write(tmp_path / "job.json")
        assert run_job(lambda job, cfg: ran.append("ran"), ProbeConfig, ["--job", str(tmp_path / "job.json")]) == 2
        err = capsys.readouterr().err
        name = planned[0]
        assert f"{name} differs from the plan: the stage hash was planned with {name} {planned[1]}, " in err, err
        assert f"has {name} {here};" in err and "Rerun `ring-pipeline plan`/`run`" in err
        assert f"`{fix}` on this machine" in err
    assert len(ran) == 2  # main never ran for the mismatches

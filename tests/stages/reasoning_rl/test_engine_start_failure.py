"""A rollout engine that fails to start fails the RL stage at once, with the engine's own error
(round 17 on GPUs: vLLM's TP engine died while starting on the generating rank, and the trainer
ranks sat in their collectives for minutes until the job was killed from outside).

The stage runs on two gloo ranks, and the engine raises vLLM's error after a partial start that
left what vLLM's can: a non-daemon thread and a non-daemon child process that never end
(tests/stages/rl/failing_engine.py, imported by the ranks through a sitecustomize.py on PYTHONPATH):
- split placement (rank 0 trains, rank 1 generates), the engine failing on rank 1 only: the
  layout of round 17;
- colocated, the engine failing on every rank (one engine config fails the same way
  everywhere): every rank's exit then waited for what its engine left, and the stage hung until
  its progress deadline (30 minutes by default) before stages/common/entry.py ended failed jobs.
The stage must fail well before any progress deadline or collective timeout, name the engine's
error, and leave no process behind.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from tests.stages.reasoning_rl.test_reasoning_rl_stage import rl_config
from tests.stages.rl.failing_engine import MESSAGE, NAME

pytestmark = pytest.mark.slow

FAIL_WITHIN_S = 60  # from the engine's error to the StageFailed; a hang lasts the 3-minute deadline below
REPO = str(Path(__file__).resolve().parents[3])
SITECUSTOMIZE = """import os
# a stage rank (and what it starts), or pipeline.local_ranks, which forks CPU ranks with what it
# imported, or the warm job server (pipeline.job_server), which forks the CPU jobs with what it imported
cmdline = open("/proc/self/cmdline", "rb").read()
if "RANK" in os.environ and "LOCAL_RANK" in os.environ or b"pipeline.local_ranks" in cmdline \
        or b"pipeline.job_server" in cmdline:
    import tests.stages.rl.failing_engine  # noqa: F401  registers the test's engine
"""


@pytest.fixture(scope="module")
def engine_site(tmp_path_factory) -> Path:
    """The sitecustomize's directory, one for both cases: the same PYTHONPATH, so the second
    case's job is forked from the warm job server the first one started (a PYTHONPATH of its
    own would start another: ~15 CPU-s)."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


@pytest.mark.parametrize("placement, fail_ranks", [({"gpus": 1}, [1]), ({}, [0, 1])],
                         ids=["split-one-engine-rank", "colocated-every-rank"])
def test_an_engine_that_fails_to_start_fails_the_stage_at_once(tiny_policy, engine_site, tmp_path, monkeypatch,
                                                               placement, fail_ranks):
    from pipeline.execute import run_stage
    from stages.common.contract import Resources, StageFailed

    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(engine_site), REPO, os.environ.get("PYTHONPATH"))
                                                     if p))
    config = rl_config(tiny_policy, progress_deadline_min=3)
    config["rollout"] = {"engine": NAME, "device": "auto", "max_batch": 8, **placement,
                         "options": {"fail_ranks": fail_ranks, "leave": ["thread", "child"], "trace_dir": str(trace)}}
    try:
        with pytest.raises(StageFailed) as failed:
            run_stage("reasoning_rl", config, stage="rl", storage=str(tmp_path / "store"), launcher="torchrun",
                      work_root=tmp_path / "work", resources=Resources(cpu_ranks=2))
        took = time.time() - min(float(f.read_text()) for f in trace.glob("failed_at.*"))
    finally:
        children = [int(f.read_text()) for f in trace.glob("child.*.pid")]
        left = [pid for pid in children if _alive(pid)]
        for pid in left:
            psutil.Process(pid).kill()
    log = Path(failed.value.log_path).read_text() if failed.value.log_path else ""
    assert took < FAIL_WITHIN_S, f"the stage failed {took:.0f}s after the engine's error:\n{log[-3000:]}"
    assert f"RuntimeError: {MESSAGE}" in str(failed.value), str(failed.value)
    assert len(children) == len(fail_ranks) and not left, f"the engine's child processes {left} outlived the stage"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

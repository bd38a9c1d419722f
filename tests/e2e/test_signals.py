"""Ctrl-C, SIGTERM and kill -9 to a real `ring-pipeline run` (stage jobs waited on in
Prefect worker threads): the job stops within seconds, nothing is published, the stop is
recorded, no stage (or embedded server) process is left behind, and a later run takes over
the stage a killed run left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO
from tests.e2e.recipes import local_recipe
from tests.live_processes import command_line

pytestmark = pytest.mark.slow

STOP_WITHIN_S = 30  # signal -> the run has exited, stage jobs stopped (a loaded 2-core machine)


def _start(tmp_path, env=None) -> tuple[subprocess.Popen, object]:
    # one synthetic_data job that runs for a while (its files are generated one after another)
    files = "".join(f"    part{i}.jsonl: {{generator: arithmetic_cot, n: 80000, seed: {i}}}\n" for i in range(4))
    recipe = local_recipe(tmp_path, "sig", "data:\n  kind: synthetic_data\n  files:\n" + files)
    log = open(tmp_path / "run.log", "w+")
    # its own session, so the test can signal the run's process group without signalling pytest
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(recipe)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait_for_job(proc: subprocess.Popen, tmp_path, timeout_s: float = 240) -> list[psutil.Process]:
    """Every process below the run once the stage job has started (and holds the lease)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        below = psutil.Process(proc.pid).children(recursive=True)
        jobs = [p for p in below if "stages.synthetic_data.job" in " ".join(command_line(p))]
        if jobs and list((tmp_path / "store" / "sig").glob("data-*/_RUNNING")):
            return below
        time.sleep(0.2)
    raise AssertionError("the stage job did not start: " + (tmp_path / "run.log").read_text()[-3000:])


def _alive(procs: list[psutil.Process]) -> list[str]:
    return [" ".join(command_line(p))[:120] for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _mlflow_statuses(tmp_path) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("sig")
    return {r.data.tags.get("ring.stage", "pipeline"): r.info.status
            for r in client.search_runs([exp.experiment_id])}


@pytest.mark.parametrize("how", ["sigint-to-group", "sigterm-to-pid"])
def test_signal_stops_the_job_and_publishes_nothing(tmp_path, how, embedded_prefect_home):
    proc, log = _start(tmp_path)
    try:
        below = _wait_for_job(proc, tmp_path)
        assert any("uvicorn" in " ".join(command_line(p)) for p in below)  # the embedded Prefect server
        sent = time.time()
        if how == "sigint-to-group":  # what Ctrl-C in the terminal does
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "run.log").read_text()
    assert rc == (130 if how == "sigint-to-group" else 143), out[-3000:]
    assert took < STOP_WITHIN_S, f"took {took:.0f} s"
    assert _alive(below) == []  # stage job, its guard, the embedded server: all gone
    assert "interrupted (SIG" in out and "resume with: ring-pipeline run" in out
    assert "All connection attempts failed" not in out  # the server outlived the flow's last report
    (stage,) = (tmp_path / "store" / "sig").glob("data-*")
    assert not (stage / "_SUCCESS").exists() and not (stage / "_RUNNING").exists()
    failed = json.loads((stage / "_FAILED").read_text())
    assert failed["interrupted"] and "interrupted" in failed["error"]
    assert _mlflow_statuses(tmp_path) == {"pipeline": "KILLED", "data": "KILLED"}


def test_killed_orchestrator_leaves_no_job_and_its_stage_is_taken_over(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.execute import ExecutionPolicy, StageTarget, execute
    from pipeline.loader import load_recipe
    from pipeline.plan import make_plan
    from pipeline.tracking import PipelineTracker

    # against a Prefect server (the harness's): the embedded one is covered above
    proc, log = _start(tmp_path, {"PREFECT_API_URL": PREFECT_API_URL.value()})
    try:
        below = _wait_for_job(proc, tmp_path)
        proc.kill()  # kill -9 of the orchestrator alone
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    gone, alive = psutil.wait_procs(below, timeout=15)
    assert _alive(alive) == []  # nothing trains on unobserved

    status = CliRunner().invoke(app, ["status", str(tmp_path / "sig.yaml")]).output
    assert status.split()[1] == "interrupted" and "stopped heartbeating" in status, status
    assert _mlflow_statuses(tmp_path)["data"] == "RUNNING"  # nobody told MLflow yet

    # the next run takes the dead run's lease over at once (its pid is gone on this host)
    plan = make_plan(load_recipe(tmp_path / "sig.yaml"))
    tracker = PipelineTracker(f"sqlite:///{tmp_path}/mlflow.db", "sig", "sig", {})
    result = execute(StageTarget.of(plan["data"]), plan.store, tmp_path / "work",
                     ExecutionPolicy.of(plan.recipe.storage), tracker)
    tracker.end("FINISHED")
    assert result.status == "ran"
    assert (tmp_path / "store" / "sig" / result.url.rsplit("/", 1)[-1] / "_SUCCESS").exists()
    statuses = _mlflow_statuses(tmp_path)
    assert statuses["data"] in ("FINISHED", "KILLED")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sig").experiment_id])
    by_stage = sorted((r.info.status for r in runs if r.data.tags.get("ring.stage") == "data"))
    assert by_stage == ["FINISHED", "KILLED"]  # the dead attempt's run no longer RUNNING
    assert sorted(r.info.status for r in runs if r.data.tags.get("ring.kind") == "pipeline") == \
        ["FINISHED", "KILLED"]
    assert "done" in CliRunner().invoke(app, ["status", str(tmp_path / "sig.yaml")]).output

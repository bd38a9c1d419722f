"""Two `ring-pipeline run` of one recipe in one directory at the same time: each stage is
executed once, the other run waits for it and skips it, and both end with correct artifacts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.recipes import data_and_base, local_recipe

pytestmark = pytest.mark.slow

def test_two_runs_at_once_execute_each_stage_once(tmp_path, prefect_harness):
    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL

    from stages.common.artifact_inputs import verify_artifact

    recipe = local_recipe(tmp_path, "twice", data_and_base(rows=60))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    runs = [subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(recipe)], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [r.communicate(timeout=600)[0] for r in runs]
    for r, out in zip(runs, outs):
        assert r.returncode == 0, out[-4000:]
    for stage in ("data", "base"):
        verdicts = sorted(line.split()[1] for out in outs for line in out.splitlines()
                          if line.startswith(f"{stage}: "))
        assert verdicts == ["ran", "skipped"], (stage, verdicts)
    # (a run that found a stage running waited for it: "already running since ...; waiting")
    assert not any("taking over" in out for out in outs)  # a live run's lease is never taken

    root = tmp_path / "store" / "twice"
    for stage in ("data", "base"):
        (stage_dir,) = root.glob(f"{stage}-*")
        manifest = verify_artifact(f"file://{stage_dir}")
        # one attempt worked on it, and its own log is the one published
        (attempt,) = (tmp_path / "work" / "twice").glob(f"{stage}-*/*")
        assert manifest["attempt"] == attempt.name
        assert (stage_dir / "logs" / "stage.log").read_text() == (attempt / "stage.log").read_text()
        assert not (stage_dir / "_RUNNING").exists()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("twice").experiment_id])
    stage_runs = sorted((r.data.tags["ring.stage"], r.info.status) for r in runs if "ring.stage" in r.data.tags)
    assert stage_runs == [("base", "FINISHED"), ("data", "FINISHED")]
    # a parent run per pipeline run that ran a stage (one that only skipped leaves none)
    ran_something = sum(any(line.split()[1:2] == ["ran"] for line in out.splitlines()
                            if line.startswith(("data: ", "base: "))) for out in outs)
    assert [r.info.status for r in runs if r.data.tags.get("ring.kind") == "pipeline"] == ["FINISHED"] * ran_something
    (base_dir,), (data_dir,) = root.glob("base-*"), root.glob("data-*")
    assert json.loads((base_dir / "manifest.json").read_text())["upstream"]["data"] == \
        json.loads((data_dir / "manifest.json").read_text())["hash"]

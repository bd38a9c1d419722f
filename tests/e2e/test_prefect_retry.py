"""A failed `ring-pipeline run` against a Prefect server reads well everywhere and can be
retried from the Prefect UI: each failed stage is reported once on the console and listed at
the end, `status` says why, the Prefect UI shows named runs, one-line state messages and a
markdown artifact per stage, linked to MLflow; the run is a flow run of the recipe's
deployment, `ring-pipeline serve` serves that deployment, and the retry reruns only what did
not finish.

`prefect flow-run retry` is what the UI's "Retry" button does: it reschedules the failed
flow run, the served deployment picks it up and runs the flow again with its parameters.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests.e2e.recipes import data_and_base, local_recipe

pytestmark = pytest.mark.slow

def _status(recipe) -> dict[str, str]:
    res = CliRunner().invoke(app, ["status", str(recipe)])
    assert res.exit_code == 0, res.output
    return {line.split()[0]: line.split()[1] for line in res.output.splitlines()
            if line.strip() and not line.startswith(" ")}  # indented lines are details


def _wait_terminal(flow_run_id, timeout=180):
    from prefect.client.orchestration import get_client

    async def state():
        async with get_client() as c:
            return (await c.read_flow_run(flow_run_id)).state

    deadline = time.time() + timeout
    while time.time() < deadline:
        s = asyncio.run(state())
        if s is not None and s.is_final():
            return s
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout}s")


def _failures_read_well(console: str, flow_run_id: str, tmp_path) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    lines = console.splitlines()
    assert len(lines) < 30 and "Traceback" not in console and "[metrics]" not in console, console
    for stage, missing in (("base", "missing.jsonl"), ("base2", "nope.jsonl")):
        live = [ln for ln in lines if ln.startswith(f"{stage} ") and "FAILED" in ln]
        listed = [ln for ln in lines if ln.startswith(f"{stage}: FAILED, user error:")]
        assert len(live) == 1 and len(listed) == 1, console  # reported once, listed once at the end
        assert f"{missing} is not in the artifact's manifest" in live[0] and missing in listed[0]
    assert lines.count("sft: not started (an upstream stage failed)") == 1, console
    status = CliRunner().invoke(app, ["status", str(tmp_path / "served.yaml")]).output
    assert "user error (exit code 2):" in status and "missing.jsonl is not in the artifact's manifest" in status

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        assert re.fullmatch(r"served \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", run.name), run.name
        assert run.state.message == ("Flow run encountered an exception: PipelineFailed: 2 of 4 stages failed: "
                                     "base (user error), base2 (user error); not started: sft")
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        assert {t.name.split("-")[0]: t.state.name for t in tasks} == \
            {"data": "Completed", "base": "Failed", "base2": "Failed", "sft": "NotReady"}
        assert all("\n" not in (t.state.message or "") for t in tasks)  # one readable line each
        artifacts = {a.key: a.data for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))) if a.type == "markdown"}
    assert set(artifacts) == {"served-data", "served-base", "served-base2", "served-pipeline"}
    assert "**user error**" in artifacts["served-base"] and "missing.jsonl" in artifacts["served-base"]
    assert "| sft | sft | not started |" in artifacts["served-pipeline"]
    (parent_tag,) = [t for t in run.tags if t.startswith("mlflow-run:")]
    mlflow = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = mlflow.get_run(parent_tag.split(":", 1)[1])
    assert parent.info.run_name == run.name and parent.info.status == "FAILED"
    assert parent.data.tags["prefect.flow_run_id"] == flow_run_id
    assert parent.data.tags["prefect.flow_run_url"].endswith(f"/flow-run/{flow_run_id}")


def test_retry_of_failed_run_reruns_only_unfinished(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    from tests.conftest import REPO

    # the tokenizer corpora name files the data stage does not write: `base` and `base2` fail,
    # and `sft`, which needs `base`, does not start
    broken = textwrap.dedent(data_and_base(rows=30, corpus="missing.jsonl")) + textwrap.dedent("""\
        base2:
          kind: init_model
          architecture: {hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}
          tokenizer: {corpus: ["${stages.data.output}/nope.jsonl"]}
        sft:
          kind: sft
          model: ${stages.base.output}
          data: ${stages.data.output}/sft.jsonl
        """)
    recipe = local_recipe(tmp_path, "served", broken)
    # the served runner polls for scheduled runs every second instead of every ten
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "PYTHONPATH": str(REPO)}
    failed = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(recipe)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    hint = re.search(r"or retry flow run (\S+) from the Prefect UI: it runs where `ring-pipeline serve "
                     r".*served.yaml` serves deployment ring-pipeline/served", failed.stderr)
    assert hint, failed.stderr[-3000:]
    assert "resume with: ring-pipeline run" in failed.stderr
    _failures_read_well(failed.stdout + failed.stderr, hint.group(1), tmp_path)
    serve = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(recipe)], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        from prefect.client.orchestration import get_client

        run_id = hint.group(1)  # the failed flow run, as the UI shows it
        with get_client(sync_client=True) as client:
            assert client.read_flow_run(run_id).deployment_id is not None  # so "Retry" is offered
        state = _wait_terminal(run_id)
        assert state.is_failed(), state
        data_dir = next((tmp_path / "store" / "served").glob("data-*"))
        published_at = json.loads((data_dir / "manifest.json").read_text())["published_at"]
        assert not list((tmp_path / "store" / "served").glob("base-*/_SUCCESS"))
        status = _status(recipe)
        assert status["data"] == "done" and status["base"] == "failed", status

        # the user fixes the recipe, then presses "Retry" (same as `prefect flow-run retry`)
        local_recipe(tmp_path, "served", data_and_base(rows=30))
        out = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", run_id],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        state = _wait_terminal(run_id)
        assert state.is_completed(), state
        assert list((tmp_path / "store" / "served").glob("base-*/_SUCCESS"))
        # `data` was finished before: the retry skipped it instead of publishing it again
        assert json.loads((data_dir / "manifest.json").read_text())["published_at"] == published_at
        assert _status(recipe) == {"data": "done", "base": "done"}
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)

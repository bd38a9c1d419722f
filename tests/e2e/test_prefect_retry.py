"""A failed `ring-pipeline run` against a Prefect server can be retried from the Prefect UI:
the run is a flow run of the recipe's deployment, `ring-pipeline serve` serves that
deployment, and the retry reruns only what did not finish.

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
import time

import pytest

from tests.e2e.recipes import data_and_base, local_recipe

pytestmark = pytest.mark.slow

def _status(recipe) -> dict[str, str]:
    from typer.testing import CliRunner

    from pipeline.cli import app

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


def test_retry_of_failed_run_reruns_only_unfinished(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    from tests.conftest import REPO

    # the tokenizer corpus names a file the data stage does not write: `base` fails
    recipe = local_recipe(tmp_path, "served", data_and_base(rows=30, corpus="missing.jsonl"))
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

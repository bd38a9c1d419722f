"""`ring-pipeline serve` + a Prefect retry of a failed flow run reruns only what did not finish.

This is what the UI's "Retry" button does: it reschedules the failed flow run, the served
deployment picks it up and runs the flow again with the same parameters.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

RECIPE = """\
name: served
storage: {{url: "file://{root}/store"}}
tracking: {{uri: "sqlite:///{root}/mlflow.db"}}
stages:
  data:
    kind: synthetic_data
    files:
      sft.jsonl: {{generator: arithmetic_cot, n: 30}}
  base:
    kind: init_model
    architecture: {{hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}}
    tokenizer: {{corpus: ["${{stages.data.output}}/{corpus}"]}}
"""


def _status(recipe) -> dict[str, str]:
    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(app, ["status", str(recipe)])
    assert res.exit_code == 0, res.output
    return {line.split()[0]: line.split()[1] for line in res.output.splitlines() if line.strip()}


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


def test_retry_of_failed_flow_run_reruns_only_unfinished(tmp_path, prefect_harness):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL

    recipe = tmp_path / "served.yaml"
    # the tokenizer corpus names a file the data stage does not write: `base` fails
    recipe.write_text(textwrap.dedent(RECIPE.format(root=tmp_path, corpus="missing.jsonl")))
    # the served runner polls for scheduled runs every second instead of every ten
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(recipe)], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        run = None
        for _ in range(60):  # the deployment appears once `serve` has registered it
            try:
                run = run_deployment("ring-pipeline/served", timeout=0)
                break
            except Exception:
                time.sleep(1)
        assert run is not None, "the served deployment never appeared"
        state = _wait_terminal(run.id)
        assert state.is_failed(), state
        data_dir = next((tmp_path / "store" / "served").glob("data-*"))
        published_at = json.loads((data_dir / "manifest.json").read_text())["published_at"]
        assert not list((tmp_path / "store" / "served").glob("base-*/_SUCCESS"))
        status = _status(recipe)
        assert status["data"] == "done" and status["base"] == "failed", status

        # the user fixes the recipe, then presses "Retry" (same as `prefect flow-run retry`)
        recipe.write_text(textwrap.dedent(RECIPE.format(root=tmp_path, corpus="sft.jsonl")))
        out = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", str(run.id)],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        state = _wait_terminal(run.id)
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

"""The user story "resume a failed stage from the Prefect UI", in a real browser: a served
recipe's run fails at its last stage; the user fixes the recipe, opens the failed flow run in the
Prefect UI and presses "Retry" (then "Retry" in its confirmation dialog); the retry skips the
finished stages (their artifacts untouched, by hash), reruns the failed one, and the UI shows the
completed run and the stages' markdown summaries. Then the MLflow UI shows the pipeline's
parent runs, a nested run per stage, the training stage's headline metrics and a metric's plot.

Headless Chromium (Debian's `chromium`) driven by Playwright (tests/e2e/browser.py); skipped,
naming the package, where either is missing. Every wait is on the page's state (Playwright's
`expect`, which polls the DOM; the Prefect UI polls its API by itself), never a sleep.
The retried run's screenshot is saved as `prefect-ui-retry.png` under the test's dir.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from tests.e2e.browser import browser_page, mlflow_ui, prefect_ui, require_browser, shown, web_process
from tests.e2e.recipes import data_and_base, local_recipe
from tests.e2e.test_prefect_retry import _status

pytestmark = pytest.mark.slow

NAME = "uiretry"  # the recipe, and so its deployment ring-pipeline/uiretry
SFT = """\
    sft:
      kind: sft
      model: ${{stages.base.output}}
      data: ${{stages.data.output}}/{data}
      max_seq_len: 64
      max_steps: 2
      warmup_steps: 1
      micro_batch_size: 2
    """


def _recipe(tmp_path, sft_data: str):
    return local_recipe(tmp_path, NAME, textwrap.dedent(data_and_base(rows=8)) + textwrap.dedent(SFT).format(data=sft_data))


def _hashes(root) -> dict[str, str]:
    """sha256 of every file of the finished stages' artifacts (data-*, base-*) in the store."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for stage in ("data", "base") for p in sorted(root.glob(f"{stage}-*/**/*")) if p.is_file()}


def test_retry_from_prefect_ui(tmp_path, prefect_api, prefect_harness):
    require_browser()
    from playwright.sync_api import expect

    from tests.conftest import REPO

    started = time.monotonic()
    store = tmp_path / "store" / NAME
    recipe = _recipe(tmp_path, "missing.jsonl")  # sft's data names a file `data` does not write
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "PYTHONPATH": str(REPO)}
    ui_argv, ui_env = prefect_ui(prefect_api, tmp_path)
    ml_argv, ml_env = mlflow_ui(f"sqlite:///{tmp_path}/mlflow.db", tmp_path)
    # the UIs boot while the pipeline runs
    with web_process(ui_argv, ui_env, tmp_path / "prefect-ui.log", "/ui-settings") as prefect_web, \
            web_process(ml_argv, ml_env, tmp_path / "mlflow.log", "/health") as mlflow_web:
        failed = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(recipe)], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        hint = re.search(r"retry flow run (\S+) from the Prefect UI", failed.stderr)
        assert hint, failed.stderr[-3000:]
        run_id = hint.group(1)
        assert _status(recipe) == {"data": "done", "base": "done", "sft": "failed"}
        before = _hashes(store)
        assert any(k.endswith("manifest.json") for k in before) and len(before) > 4, before
        with web_process([sys.executable, "-m", "pipeline.cli", "serve", str(recipe)], env,
                         tmp_path / "serve.log", "", timeout=0):
            _recipe(tmp_path, "sft.jsonl")  # the user fixes the recipe, then presses "Retry"
            with browser_page(tmp_path / "chromium-profile") as page:
                ui = prefect_web.url()
                badge = page.locator(".page-heading-flow-run .state-badge")
                with shown(page, tmp_path, "prefect-failed-run"):
                    page.goto(f"{ui}/runs/flow-run/{run_id}")
                    expect(badge).to_have_text("Failed")
                    page.locator(".page-heading-flow-run").get_by_role("button", name="Retry", exact=True).click()
                    dialog = page.get_by_role("dialog")
                    expect(dialog).to_contain_text("This will retry flow run")
                    dialog.get_by_role("button", name="Retry", exact=True).click()
                    expect(badge).not_to_have_text("Failed")  # AwaitingRetry, then Running
                with shown(page, tmp_path, "prefect-retried-run"):
                    expect(badge).to_have_text("Completed", timeout=300_000)
                    shot = tmp_path / "prefect-ui-retry.png"
                    page.screenshot(path=str(shot))
                    print(f"retried run's screenshot: {shot}")
                    _ui_artifacts(page, expect, ui)
                _store_after_retry(recipe, store, before, run_id)
                _mlflow_ui(page, expect, mlflow_web.url(), tmp_path, run_id)
    print(f"test_retry_from_prefect_ui: {time.monotonic() - started:.0f} s")


def _ui_artifacts(page, expect, ui) -> None:
    """The run's Artifacts tab: its two summaries (the retry's: 1 ran, 2 cached), the retry's
    rendered; then each stage's markdown artifact (Artifacts, by key), as the retry left it."""
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    expect(page.get_by_text("2 ran, 1 failed, 0 cached")).to_be_visible()  # the failed attempt
    page.get_by_role("link").filter(has_text="1 ran, 0 failed, 2 cached").click()
    for stage, kind, status in (("data", "synthetic_data", "skipped"), ("base", "init_model", "skipped"),
                                ("sft", "sft", "ran")):
        row = page.get_by_role("row").filter(has=page.get_by_role("cell", name=stage, exact=True)).first
        expect(row.get_by_role("cell")).to_have_text([stage, kind, status, re.compile(r"[0-9a-f]{12}"),
                                                      re.compile(r"-|[\d.]+ s")])
    for stage, kind, status in (("data", "synthetic_data", "done in|cached"), ("base", "init_model", "done in|cached"),
                                ("sft", "sft", "done in")):
        page.goto(f"{ui}/artifacts/key/{NAME}-{stage}")  # Artifacts, by key: its versions, latest first
        page.get_by_role("link", name=re.compile(r"^[0-9a-f]{8}$")).first.click()  # the latest, rendered
        expect(page.locator("h2").filter(has_text=re.compile(rf"{stage} \({kind}\): ({status})")).first).to_be_visible()
        expect(page.locator("body")).to_contain_text("artifact: file://")
    expect(page.get_by_role("row").filter(has=page.get_by_role("cell", name="loss", exact=True))).to_have_count(1)


def _store_after_retry(recipe, store, before, run_id) -> None:
    from prefect.client.orchestration import get_client

    assert _hashes(store) == before  # the finished stages were skipped, not published again
    assert list(store.glob("sft-*/_SUCCESS"))
    assert _status(recipe) == {"data": "done", "base": "done", "sft": "done"}
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).state.is_completed()


def _mlflow_ui(page, expect, url, tmp_path, run_id) -> None:
    """The run's parent runs (the failed attempt and the retry), each listing its nested run
    per stage that ran; sft's headline metrics on its run page; the loss curve's plot page."""
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (experiment,) = [e for e in mlflow.search_experiments() if e.name == NAME]
    exp = experiment.experiment_id
    runs = mlflow.search_runs([exp])
    parents = {r.info.status: r for r in runs if r.data.tags.get("prefect.flow_run_id") == run_id}
    assert sorted(parents) == ["FAILED", "FINISHED"], parents  # the run, then its retry
    children = {status: sorted(r.info.run_name for r in runs
                               if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
                for status, parent in parents.items()}
    assert children == {"FAILED": ["base", "data", "sft"], "FINISHED": ["sft"]}, children
    slow = {"timeout": 90_000}  # the first page of MLflow's UI compiles its scripts: ~15 s on 2 busy cores
    for status, parent in parents.items():
        with shown(page, tmp_path, f"mlflow-parent-{status.lower()}"):
            page.goto(f"{url}/#/experiments/{exp}/runs/{parent.info.run_id}")
            body = page.locator("main")
            expect(body).to_contain_text("Child runs", **slow)
            expect(body).to_contain_text(parent.info.run_name)
            for child in children[status]:
                expect(body.get_by_role("link", name=child, exact=True).first).to_be_visible()
    (sft,) = [r for r in runs if r.info.run_name == "sft" and r.info.status == "FINISHED"]
    assert "loss" in sft.data.metrics, sft.data.metrics
    with shown(page, tmp_path, "mlflow-sft-metrics"):
        page.goto(f"{url}/#/experiments/{exp}/runs/{sft.info.run_id}")
        body = page.locator("main")
        expect(body).to_contain_text(parents["FINISHED"].info.run_name, **slow)  # its parent run
        for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
            expect(body).to_contain_text(key)
    with shown(page, tmp_path, "mlflow-metric-plot"):
        body.get_by_role("link", name="loss", exact=True).first.click()  # the run's metric plots
        expect(page).to_have_url(re.compile(r"/runs/[0-9a-f]+/model-metrics"))
        expect(page.get_by_text("sft (loss)", exact=True)).to_be_visible(**slow)  # the loss chart's legend
        expect(page.locator(".js-plotly-plot").first).to_be_visible()

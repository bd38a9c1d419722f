"""A failed stage is described once (pipeline.failures) and `ring-pipeline status` shows that
description: what failed, the stage log, the MLflow run."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.execute import FAILED, StageRunning
from pipeline.failures import StageFailure
from pipeline.interrupt import StageInterrupted
from pipeline.loader import load_recipe
from pipeline.plan import make_plan
from stages.common.artifact_inputs import StorageError
from stages.common.contract import StageFailed
from tests.pipeline.test_recipe import GOOD


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - with its traceback, as a stage task sees it
        return e


@pytest.mark.parametrize("error, category, retryable", [
    (StageFailed("data.jsonl:3: not JSON\ndata.jsonl:9: empty", stage="sft", exit_code=2), "user error", False),
    (StageFailed("KeyError: 'x' (exit code 1)", stage="sft", exit_code=1, excerpt=["  File ..."], user_error=False),
     "crash", True),
    (StorageError("cannot publish to s3://b/x: EndpointConnectionError"), "store error", True),
    (StageInterrupted("stage 'sft' was stopped: the run was interrupted (SIGINT)"), "interrupted", False),
    (KeyError("hash"), "bug", True),
    (StageRunning("stage 'sft' is running since 10:00 by host pid 7; wait for it, or rerun without --no-wait"),
     "busy", False),
])
def test_every_kind_of_failure_reads_the_same_way(error, category, retryable):
    failure = StageFailure.of("sft", _raised(error), log="/w/stage.log", run_id="abc", run_link="http://m/#/r/abc")
    assert (failure.category, failure.retryable) == (category, retryable)
    report = failure.report().splitlines()
    assert report[0].startswith(category) and report[-2:] == ["log: /w/stage.log", "MLflow run: http://m/#/r/abc"]
    assert "\n" not in failure.summary()
    if category == "bug":  # ours: the exception and the code that raised it
        assert failure.reason == "KeyError: 'hash'" and any("_raised" in ln for ln in failure.excerpt)
    assert StageFailure.from_note("sft", failure.as_note()) == failure


def test_status_says_why_a_stage_failed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GOOD.replace("name: t\n", f"name: t\nstorage: {{url: 'file://{tmp_path}/store'}}\n"))
    plan = make_plan(load_recipe(recipe))
    failure = StageFailure.of("sft", StageFailed("data.jsonl:3: not valid JSON\ndata.jsonl:9: no messages",
                                                 stage="sft", exit_code=2), log="/w/sft/stage.log", run_id="r123")
    plan.store.write_note(plan["sft"].url, FAILED, failure.as_note())
    # a note written before failures were described (a 40-line log tail as its error)
    plan.store.write_note(plan["base"].url, FAILED, {"time": 1.0, "error": "stage 'base' failed: its job exited "
                                                     "with code 1. Log: /w/base.log\n--- last lines ---\nboom",
                                                     "run_id": None, "type": "StageFailed", "interrupted": False})
    res = CliRunner().invoke(app, ["status", str(recipe)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    sft = lines.index(next(ln for ln in lines if ln.startswith("sft ")))
    assert lines[sft].split()[1] == "failed" and "mlflow run: r123" in lines[sft]
    assert lines[sft + 1].endswith("user error (exit code 2): data.jsonl:3: not valid JSON")
    assert lines[sft + 2:sft + 5] == ["    data.jsonl:9: no messages", "    log: /w/sft/stage.log",
                                      "    MLflow run: r123"]
    assert any(ln.startswith("base ") and ln.split()[1] == "failed" for ln in lines)

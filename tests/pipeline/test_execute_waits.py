"""A stage another live run is executing: `execute` waits for it and then skips the published
stage, or (told not to wait) fails naming the holder; a stop request ends the wait."""
from __future__ import annotations

import textwrap
import threading
import time

import pytest

from pipeline import interrupt
from pipeline.execute import ExecutionPolicy, StageRunning, StageTarget, execute
from pipeline.lease import try_acquire
from pipeline.loader import load_recipe
from pipeline.plan import make_plan


@pytest.fixture
def planned(tmp_path):
    recipe = tmp_path / "w.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: w
        storage: {{url: "file://{tmp_path}/store"}}
        stages:
          data:
            kind: synthetic_data
            files: {{sft.jsonl: {{generator: arithmetic_cot, n: 5}}}}
        """))
    plan = make_plan(load_recipe(recipe))
    other_run = try_acquire(plan["data"].url, {}, 60, {"flow_run_id": "the-other-run"})
    yield plan, StageTarget.of(plan["data"]), other_run
    other_run.release()


def test_no_wait_fails_naming_the_holder(planned, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    plan, target, _ = planned
    status = CliRunner().invoke(app, ["status", str(tmp_path / "w.yaml")]).output
    assert status.split()[1] == "running" and "flow run the-other-run" in status, status
    policy = ExecutionPolicy.of(plan.recipe.storage, wait_if_running=False)
    with pytest.raises(StageRunning, match=r"stage 'data' is running since .* flow run the-other-run"):
        execute(target, plan.store, tmp_path / "work", policy)
    assert not (tmp_path / "work").exists()  # no attempt was started


def test_waits_for_the_other_run_then_skips(planned, tmp_path, capsys):
    plan, target, other_run = planned
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(
        run=execute(target, plan.store, tmp_path / "work", ExecutionPolicy.of(plan.recipe.storage))))
    waiter.start()
    time.sleep(1.5)
    assert waiter.is_alive()  # still waiting
    out = tmp_path / "out"
    out.mkdir()
    (out / "sft.jsonl").write_text("{}\n")
    plan.store.publish(out, target.url, {"stage": "data", "hash": target.hash})  # the other run finishes
    other_run.release()
    waiter.join(timeout=30)
    assert result["run"].status == "skipped"
    assert "already running since" in capsys.readouterr().out


def test_a_stop_request_ends_the_wait(planned, tmp_path):
    plan, target, _ = planned
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            execute(target, plan.store, tmp_path / "work", ExecutionPolicy.of(plan.recipe.storage))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    waiter = threading.Thread(target=wait)
    with interrupt.signals_stop_the_run():  # the stop request lasts as long as this block
        waiter.start()
        time.sleep(1.0)
        interrupt.request_stop("SIGINT")
        waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert isinstance(errors[0], interrupt.StageInterrupted) and "SIGINT" in str(errors[0])
    assert interrupt.stop_requested() is None

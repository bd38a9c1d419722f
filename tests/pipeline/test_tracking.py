"""What MLflow shows of a run (a real SQLite tracking store): named parent runs with their
story, stage runs with their input datasets and plots of their main curves, artifacts beside
the DB, no empty parent run."""
from __future__ import annotations

import textwrap

import pytest
from PIL import Image

from pipeline.execute import StageTarget, input_refs
from pipeline.loader import load_recipe
from pipeline.plan import make_plan
from pipeline.stage_metrics import describe, headline
from pipeline.tracking import PipelineTracker
from stages.common.stage_log import StageLogger
from stages.registry import STAGE_KINDS


@pytest.fixture(scope="module")
def db_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("db")  # one tracking DB (its set-up takes seconds), an experiment per test


@pytest.fixture
def tracker(db_dir, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)  # where MLflow's default would have put ./mlruns
    return PipelineTracker(f"sqlite:///{db_dir}/mlflow.db", request.node.name, "tiny 2026-11-26 10:00:00",
                           {"recipe": "tiny.yaml"}, description="a smoke run", tags={"ring.recipe": "tiny"})


def test_experiment_and_parent_run(tracker, db_dir, tmp_path):
    client = tracker.client
    exp = client.get_experiment(tracker.experiment_id)
    assert exp.artifact_location == (db_dir / "mlartifacts").as_uri()  # not ./mlruns of the cwd
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on its runs
    run = client.get_run(tracker.parent_id)
    assert run.info.run_name == "tiny 2026-11-26 10:00:00"
    assert run.data.tags["mlflow.note.content"] == "a smoke run"
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40
    tracker.attach_text("name: tiny\n", "recipe/tiny.yaml")
    assert [a.path for a in client.list_artifacts(tracker.parent_id, "recipe")] == ["recipe/tiny.yaml"]
    assert not (tmp_path / "mlruns").exists()
    assert tracker.run_link(tracker.parent_id).startswith(f"{tracker.parent_id} (open with: mlflow ui")
    served = PipelineTracker.attach(tracker.uri, tracker.experiment_id, tracker.parent_id, "http://mlflow:5000/")
    assert served.run_url("r1") == f"http://mlflow:5000/#/experiments/{tracker.experiment_id}/runs/r1"


def test_a_run_where_nothing_ran_leaves_no_parent_run(tracker):
    tracker.discard()
    assert tracker.client.search_runs([tracker.experiment_id]) == []


def test_stage_inputs_are_datasets_with_their_urls(tmp_path, tracker):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: r
        storage: {{url: "file://{tmp_path}/store"}}
        stages:
          data:
            kind: synthetic_data
            files: {{sft.jsonl: {{generator: arithmetic_cot, n: 5}}}}
          base:
            kind: init_model
            architecture: {{hidden_size: 32}}
            tokenizer: {{corpus: ["${{stages.data.output}}/sft.jsonl", "{corpus}"]}}
        """))
    plan = make_plan(load_recipe(recipe))
    target = StageTarget.of(plan["base"])
    run_id = tracker.start_stage("base", "init_model", target.hash, target.config, input_refs(target))
    inputs = {d.dataset.name: d for d in tracker.client.get_run(run_id).inputs.dataset_inputs}
    assert set(inputs) == {"data/sft.jsonl", "corpus.jsonl"}
    upstream, external = inputs["data/sft.jsonl"], inputs["corpus.jsonl"]
    assert plan["data"].url + "/sft.jsonl" in upstream.dataset.source
    assert upstream.dataset.digest == plan["data"].hash[:12]
    assert corpus.as_uri() in external.dataset.source
    tags = {t.key: t.value for t in external.tags}
    assert tags == {"mlflow.data.context": "external", "ring.config_key": "tokenizer.corpus[1]"}


@pytest.mark.parametrize("names", ["grouped", "ungrouped"])
def test_main_curves_are_plotted_whatever_their_names(tracker, names):
    run_id = tracker.start_stage("reasoning_rl", "reasoning_rl", "h" * 64, {})
    log = StageLogger(tracker.uri, run_id)
    reward, masked = ("reward/mean", "icepop/masked_fraction") if names == "grouped" else \
        ("reward_mean", "masked_fraction")
    for step in range(1, 7):
        log.metrics(step, {reward: step / 10, masked: 0.01 * step, "unplotted": 1.0})
    log.flush()  # as a stage job does before it ends (stages/common/entry.py)
    path = tracker.plot_main_curves(run_id, "reasoning_rl", "reasoning_rl")
    assert path == "plots/reasoning_rl.png"
    local = tracker.client.download_artifacts(run_id, path)
    with Image.open(local) as png:
        assert png.format == "PNG" and png.size[0] >= 400
    assert tracker.plot_main_curves(run_id, "synthetic_data", "data") is None  # the kind declares none
    assert headline("reasoning_rl", {reward: 0.1, masked: 0.01}, {reward: 0.6, masked: 0.06}) == \
        {"reward/mean": [0.1, 0.6], "icepop/masked_fraction": [0.01, 0.06]}


def test_headline_numbers():
    assert describe(headline("sft", {"loss": 6.225, "lr": 1.0}, {"loss": 0.4717, "lr": 0.1})) == "loss 6.225 -> 0.4717"
    assert describe(headline("curate", {"kept": 200, "removed": 1300}, {"kept": 200, "removed": 1300})) == \
        "kept 200, removed 1300"
    assert headline("synthetic_data", {"x": 1}, {"x": 2}) == {}
    for name, kind in STAGE_KINDS.items():  # every declared curve names a grouped metric or a plain one
        assert all(c.name and not c.name.endswith("/") for c in (*kind.metrics.headline, *kind.metrics.curves)), name


def test_stage_logger_declares_progress(capsys):
    log = StageLogger(None, None, rank=0)
    log.progress(3, total=100)
    log.progress(4)
    StageLogger(None, None, rank=1).progress(5, total=100)  # only rank 0 speaks
    assert capsys.readouterr().out.splitlines() == ['[progress] {"done": 3, "total": 100}', '[progress] {"done": 4}']


def test_a_step_does_not_wait_for_the_tracking_server_and_the_flush_does(tracker, monkeypatch):
    """metrics() hands the batch to the sender thread: it returns while the server has not answered
    (a stand-in that answers only when told); flush() waits until every batch is in."""
    import threading

    run_id = tracker.start_stage("sft", "sft", "h" * 64, {})
    log = StageLogger(tracker.uri, run_id)
    answer, real = threading.Event(), log.client.log_batch

    def slow_log_batch(*args, **kwargs):
        assert answer.wait(60), "the test never let the server answer"
        return real(*args, **kwargs)

    monkeypatch.setattr(log.client, "log_batch", slow_log_batch)
    for step in range(1, 4):
        log.metrics(step, {"loss": 1.0 / step})  # would block here if it waited for the server
    assert tracker.client.get_metric_history(run_id, "loss") == []
    answer.set()
    log.flush()
    assert [m.value for m in tracker.client.get_metric_history(run_id, "loss")] == [1.0, 0.5, 1 / 3]


def test_a_failing_tracking_server_stops_the_stage_within_a_few_steps(tracker, monkeypatch):
    from mlflow.exceptions import MlflowException

    from stages.common.stage_log import _SENDERS, METRICS_IN_FLIGHT

    run_id = tracker.start_stage("sft", "sft", "h" * 64, {})
    log = StageLogger(tracker.uri, run_id)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise MlflowException("the tracking server answered 503")

    monkeypatch.setattr(log.client, "log_batch", refuse)
    with pytest.raises(MlflowException, match="503"):
        # by send M + 2 the sender has taken batch 2 (M wait at most), so batch 1's failure is known
        for step in range(1, METRICS_IN_FLIGHT + 4):
            log.metrics(step, {"loss": 1.0})
    with pytest.raises(MlflowException, match="503"):  # and the job's end says so too
        log.flush()
    assert calls == [1]  # nothing more is sent once a send failed
    _SENDERS.remove(log._sender)  # a job's end flushes every sender of its process: not this test's failed one


def test_the_jobs_end_waits_for_the_metrics_of_a_logger_already_dropped(tracker, monkeypatch):
    """eval makes a logger per model inside a function: the logger is gone as the job ends, its
    sender thread may still hold the last model's batches, and they reach MLflow all the same."""
    import gc
    import time

    from stages.common.stage_log import flush_all

    run_id = tracker.start_stage("eval", "eval", "h" * 64, {})

    def score_one_model():
        log = StageLogger(tracker.uri, run_id)
        real = log.client.log_batch

        def slow_log_batch(*args, **kwargs):
            time.sleep(0.3)  # a tracking server slower than the job's last steps
            return real(*args, **kwargs)

        monkeypatch.setattr(log.client, "log_batch", slow_log_batch)
        for step in range(1, 4):
            log.metrics(step, {"accuracy": step / 10})

    score_one_model()
    gc.collect()
    flush_all()  # as run_job does once main returns
    assert [m.value for m in tracker.client.get_metric_history(run_id, "accuracy")] == [0.1, 0.2, 0.3]

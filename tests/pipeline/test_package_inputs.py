"""A stage whose results come from an installed library (synthetic_data's `reasoning_gym`
generator: another reasoning-gym release may draw other questions from one seed) has that
library's installed version among its input fingerprints (`StageKind.input_packages`): another
release reruns it and `plan` says why; a stage that uses no such library keeps its hash. A job
executed where another release is installed than the planned one (upgraded since `plan`, installed
since) publishes nothing."""
from __future__ import annotations

import importlib.metadata

import pytest

from pipeline.changes import why_rerun
from pipeline.fingerprints import fingerprint_inputs
from pipeline.plan import hash_payload, input_fingerprints, result_config, stage_hash
from stages.registry import STAGE_KINDS

KIND = STAGE_KINDS["synthetic_data"]
RGYM = {"kind": "synthetic_data", "files": {
    "rg.jsonl": {"generator": "reasoning_gym", "n": 4, "params": {"tasks": {"leg_counting": {}}}},
    "rl.jsonl": {"generator": "arithmetic_rl", "n": 4}}}
LOCAL = {"kind": "synthetic_data", "files": {"rl.jsonl": {"generator": "arithmetic_rl", "n": 4},
                                             "sft.jsonl": {"generator": "arithmetic_cot", "n": 4}}}


def _installed(monkeypatch, versions: dict[str, str | None]) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name not in versions:
            return real(name)
        if versions[name] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]
    monkeypatch.setattr(importlib.metadata, "version", version)


def _planned(config: dict):
    cfg = KIND.config.model_validate(config)
    inputs = input_fingerprints(KIND, cfg, {}, 1 << 20)
    return stage_hash(KIND, cfg, {}, inputs), hash_payload(KIND, cfg, {}, inputs), inputs


def test_the_installed_reasoning_gym_release_is_part_of_the_stage_hash(monkeypatch):
    _installed(monkeypatch, {"reasoning-gym": "0.1.25"})
    h, old_payload, old_inputs = _planned(RGYM)
    assert old_inputs["installed reasoning-gym"].summary == "version 0.1.25"
    assert _planned(RGYM)[0] == h  # the same release: the same stage
    _installed(monkeypatch, {"reasoning-gym": "0.1.26"})
    h2, payload, inputs = _planned(RGYM)
    assert h2 != h
    previous = {"hash": h, "hashed": old_payload, "inputs": {k: fp.as_dict() for k, fp in old_inputs.items()}}
    reasons = why_rerun(payload, {k: fp.as_dict() for k, fp in inputs.items()}, previous)
    assert len(reasons) == 1 and reasons[0].startswith(
        "input installed reasoning-gym changed: version 0.1.25 ["), reasons
    assert "-> version 0.1.26 [" in reasons[0]
    _installed(monkeypatch, {"reasoning-gym": None})
    missing = _planned(RGYM)[2]["installed reasoning-gym"]
    assert (missing.kind, missing.summary) == ("missing", "reasoning-gym is not installed")


def test_a_stage_without_such_a_library_keeps_its_hash(monkeypatch):
    """Its inputs are its config's alone, as before a kind could declare libraries: every
    other kind, and synthetic_data with the project's own generators."""
    _installed(monkeypatch, {"reasoning-gym": "9.9.9"})
    assert [k for k, kind in STAGE_KINDS.items() if kind.input_packages is not None] == ["synthetic_data"]
    cfg = KIND.config.model_validate(LOCAL)
    assert list(KIND.input_packages(cfg)) == []
    assert input_fingerprints(KIND, cfg, {}, 1 << 20) == fingerprint_inputs(result_config(cfg), {}, 1 << 20) == {}


def _target(config: dict, name: str = "data", storage: str = "file:///store"):
    from pipeline.execute import StageTarget
    from stages.common.contract import Resources

    h, _, inputs = _planned(config)
    return StageTarget("r", name, KIND, config, h, f"{storage}/r/{name}", {}, Resources(), "deepspeed", inputs=inputs)


def test_the_job_carries_the_versions_the_hash_was_planned_with(monkeypatch):
    """What each rank checks its own environment against (StageJob.check_packages): the versions
    fingerprinted when the stage was planned, not what is installed when it executes (a long run
    whose reasoning-gym was upgraded since `plan` must not publish the new release's rows under the
    old release's hash); one missing at plan time travels as NOT_INSTALLED, so a rank that has it
    refuses too."""
    from pipeline.execute import planned_packages
    from stages.common.contract import NOT_INSTALLED

    _installed(monkeypatch, {"reasoning-gym": "0.1.25"})
    target = _target(RGYM)
    assert target.inputs["installed reasoning-gym"].version == "0.1.25"
    _installed(monkeypatch, {"reasoning-gym": "0.1.26"})  # upgraded between plan and execute
    assert planned_packages(target) == {"reasoning-gym": "0.1.25"}
    _installed(monkeypatch, {"reasoning-gym": None})
    missing_at_plan = _target(RGYM)
    _installed(monkeypatch, {"reasoning-gym": "0.1.25"})  # installed since
    assert planned_packages(missing_at_plan) == {"reasoning-gym": NOT_INSTALLED}
    assert planned_packages(_target(LOCAL)) == {}


def test_the_version_kept_for_the_ranks_changes_no_hash_nor_record(monkeypatch):
    """The planned version rides on the fingerprint beside its digest: the stage hash of a
    reasoning_gym stage is what it was before (pinned below), and the manifest record of every
    other input is unchanged (`version` appears on distribution inputs only)."""
    from pipeline.fingerprints import local_fingerprint

    _installed(monkeypatch, {"reasoning-gym": "0.1.25"})
    _, payload, inputs = _planned(RGYM)
    fp = inputs["installed reasoning-gym"]
    assert payload["inputs"] == {"installed reasoning-gym": fp.digest}
    assert fp.digest == "735cdcdaf4efa0786ecd2550a0d99ff7d185ba2ebafcc2813bb4b41afc048b31"  # as before it
    assert fp.as_dict() == {"kind": "package", "digest": fp.digest, "summary": "version 0.1.25", "version": "0.1.25"}
    _installed(monkeypatch, {"reasoning-gym": None})
    assert "version" not in _planned(RGYM)[2]["installed reasoning-gym"].as_dict()
    assert set(local_fingerprint(__file__, 1 << 20).as_dict()) == {"kind", "digest", "summary"}


def _execute_planned_with(monkeypatch, tmp_path, at_plan: object):
    """Plan the reasoning_gym stage while `at_plan` is the installed release (`...`: the real one),
    then execute it where the real release is installed (the job process sees the real environment)."""
    from data_curation.urls import join
    from pipeline.artifacts import ArtifactStore
    from pipeline.execute import ExecutionPolicy, adhoc_target, execute
    from pipeline.recipe import StorageConfig

    storage = f"file://{tmp_path}/store"
    if at_plan is not ...:
        _installed(monkeypatch, {"reasoning-gym": at_plan})
    target = adhoc_target("synthetic_data", {k: v for k, v in RGYM.items() if k != "kind"}, stage="data",
                          storage=storage)
    monkeypatch.undo()  # between plan and execute: the release installed now is the real one
    store = ArtifactStore(join(storage, "adhoc"), {})
    run = lambda: execute(target, store, tmp_path / "work", ExecutionPolicy.of(StorageConfig(url=storage)))  # noqa: E731
    return target, store, run


@pytest.mark.slow
@pytest.mark.parametrize("at_plan", ["0.0.1", None], ids=["upgraded-since-plan", "installed-since-plan"])
def test_a_stage_executed_under_another_release_than_planned_publishes_nothing(monkeypatch, tmp_path, at_plan):
    """reasoning-gym upgraded (or installed) between `plan` and this stage's execution: the job
    refuses before generating a row, naming the package, the planned release and this machine's,
    and nothing is published under the planned hash."""
    from pipeline.execute import read_failure
    from stages.common.contract import StageFailed

    real = importlib.metadata.version("reasoning-gym")
    target, store, run = _execute_planned_with(monkeypatch, tmp_path, at_plan)
    with pytest.raises(StageFailed) as failed:
        run()
    assert not store.is_done(target.url)
    planned = at_plan or "not installed"
    assert (f"stage 'data' failed: reasoning-gym differs from the plan: the stage hash was planned with "
            f"reasoning-gym {planned}, but this machine") in str(failed.value), failed.value
    assert f"has reasoning-gym {real};" in str(failed.value) and "Rerun `ring-pipeline plan`/`run`" in str(failed.value)
    assert not list((tmp_path / "work").rglob("rg.jsonl"))  # the generator never ran
    assert read_failure(store, target.url) is not None


@pytest.mark.slow
def test_a_stage_executed_under_the_planned_release_runs(monkeypatch, tmp_path):
    target, store, run = _execute_planned_with(monkeypatch, tmp_path, ...)
    assert run().status == "ran"
    assert store.is_done(target.url)

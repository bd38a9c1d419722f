"""A stage whose results come from an installed library (synthetic_data's `reasoning_gym`
generator: another reasoning-gym release may draw other questions from one seed) has that
library's installed version among its input fingerprints (`StageKind.input_packages`): another
release reruns it and `plan` says why; a stage that uses no such library keeps its hash."""
from __future__ import annotations

import importlib.metadata

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


def test_the_job_carries_the_planned_versions_for_every_rank_to_check(monkeypatch):
    """What each rank checks its own environment against (StageJob.check_packages: a Ray worker or
    another node with another release refuses to start): the versions the hash was planned with."""
    from pipeline.execute import StageTarget, planned_packages
    from stages.common.contract import Resources

    _installed(monkeypatch, {"reasoning-gym": "0.1.25"})
    h, _, inputs = _planned(RGYM)
    target = StageTarget("r", "data", KIND, RGYM, h, "file:///store/data", {}, Resources(), "deepspeed", inputs=inputs)
    assert planned_packages(target) == {"reasoning-gym": "0.1.25"}
    local = KIND.config.model_validate(LOCAL)
    assert planned_packages(StageTarget("r", "d", KIND, LOCAL, "h", "file:///s", {}, Resources(), "deepspeed",
                                        inputs=input_fingerprints(KIND, local, {}, 1 << 20))) == {}

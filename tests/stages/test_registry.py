"""The stage registry: lazy (a kind's config is imported when the kind is asked for, in any
order), and every kind package follows the stage contract."""
from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import stages.registry
from stages.registry import STAGE_KINDS, StageKind, register

REPO = Path(__file__).resolve().parents[2]


def _imported_after(code: str) -> list[str]:
    """The stage config modules a fresh interpreter has imported after running `code`."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules " \
                   "if m.startswith('stages.') and m.endswith('.config'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lookup_imports_only_the_kind_asked_for_in_any_order():
    assert _imported_after("import stages.registry") == []
    # general_rl's config first (it builds on the shared RL settings, not on reasoning_rl's config)
    assert _imported_after("from stages.registry import STAGE_KINDS\nSTAGE_KINDS['general_rl']") == \
        ["stages.general_rl.config"]
    assert _imported_after("import stages.general_rl.config, stages.reasoning_rl.config") == \
        ["stages.general_rl.config", "stages.reasoning_rl.config"]
    # a recipe's union of kinds needs them all: iterating finds every package with a config.py,
    # and none of them imports torch (every recipe validation, so every CLI command, imports them)
    kinds = _imported_after("from stages.registry import STAGE_KINDS\nimport sys\nlist(STAGE_KINDS)\n"
                            "assert 'torch' not in sys.modules, 'a stage config imports torch'")
    assert {k.split(".")[1] for k in kinds} == set(STAGE_KINDS)


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown stage kind 'sftt'; known kinds: .*sft"):
        STAGE_KINDS["sftt"]
    with pytest.raises(KeyError, match="unknown stage kind 'common'"):  # a package, not a kind
        STAGE_KINDS["common"]


@pytest.mark.parametrize("name", sorted(STAGE_KINDS))
def test_every_kind_package_follows_the_stage_contract(name):
    """stages/<kind>/config.py registers the kind with a declared version; stages/<kind>/job.py
    has main(job, cfg) and runs it through run_job when executed, with the config model the
    kind registers (run_job parses the job's config into it once)."""
    kind = STAGE_KINDS[name]
    assert kind.name == name and kind.entry == f"stages.{name}.job"
    assert isinstance(kind.version, int) and kind.version >= 1
    assert importlib.import_module(f"stages.{name}.config").KIND is kind
    job = importlib.import_module(kind.entry)
    assert list(inspect.signature(job.main).parameters) == ["job", "cfg"]
    source = Path(job.__file__).read_text()
    model = kind.config.__name__
    assert f'if __name__ == "__main__":\n    sys.exit(run_job(main, {model}))' in source
    assert getattr(job, model) is kind.config
    assert "model_validate(job.config)" not in source and "job.config[" not in source  # parsed once, by run_job


def test_a_kind_registered_elsewhere_is_listed_and_names_its_own_module(monkeypatch):
    monkeypatch.setattr(stages.registry, "_REGISTERED", dict(stages.registry._REGISTERED))  # undone after

    class DummyConfig:  # not validated here: only the registry's bookkeeping is under test
        pass

    kind = register(StageKind(name="registry_test_kind", config=DummyConfig, version=1,  # type: ignore[arg-type]
                              entry="tests.stages.run_stage_process"))
    assert STAGE_KINDS["registry_test_kind"] is kind and "registry_test_kind" in list(STAGE_KINDS)
    with pytest.raises(ValueError, match="registered twice"):
        register(StageKind(name="registry_test_kind", config=DummyConfig, version=1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lowercase"):
        StageKind(name="Bad-Name", config=DummyConfig)  # type: ignore[arg-type]

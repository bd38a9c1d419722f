"""Every import the project makes at run time is installed by `pip install .`.

A new user's machine has only what pyproject.toml declares: a package that a developer had
installed by hand (accelerate, once) must fail this suite, not the user's run. Two checks:
every module of the project imports, and every third-party module imported anywhere in it
(also inside functions: the stages import torch, transformers, deepspeed lazily) belongs
to a distribution that pyproject.toml declares directly.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import pkgutil
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages", "data_curation", "verifiers")
# imported only where they exist, each behind a guard that names the extra or the fallback
OPTIONAL = {
    "vllm": "the [vllm] extra (GPU); engines/vllm_engine.py guards the import",
    "flash_attn": "GPU only; packed_attention.choose_attention falls back to sdpa without it",
    "solution": "the program under test, inside the code verifier's sandbox",
}


def _declared() -> set[str]:
    """Declared distributions, plus what a declared meta-package (one that ships no module
    of its own, e.g. `typer` -> `typer-slim` in some releases) installs in its place."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    reqs += [r for extra, rs in project["optional-dependencies"].items() if extra != "dev" for r in rs]
    with_modules = {d.lower() for dists in md.packages_distributions().values() for d in dists}
    declared = set()
    for r in reqs:
        name = Requirement(r).name
        if not _installed(name):
            continue
        dist = md.distribution(name)
        declared.add(dist.metadata["Name"].lower())
        if dist.metadata["Name"].lower() not in with_modules:
            declared |= {Requirement(sub).name.lower() for sub in dist.requires or []
                         if "extra ==" not in sub}
    return declared


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
        return True
    except md.PackageNotFoundError:
        return False


def _project_modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names.append(pkg)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, prefix=f"{pkg}.")]
    return names


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("module", _project_modules())
def test_every_project_module_imports(module):
    importlib.import_module(module)


def test_every_third_party_import_is_declared():
    declared = _declared()
    owners = md.packages_distributions()
    ours = set(PACKAGES)
    missing = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for top in _imported_top_levels(path) - ours - set(sys.stdlib_module_names) - {"__future__"}:
                if top in OPTIONAL:
                    continue
                dists = {d.lower() for d in owners.get(top, [])}
                if not dists & declared:
                    missing.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert not missing, ("imported but not declared in pyproject.toml [project.dependencies] "
                         f"(module -> files): {missing}")


def test_zero3_model_loading_has_its_dependencies():
    """transformers' ZeRO-3 loading path (HfDeepSpeedConfig) checks for accelerate and
    deepspeed when it is built: what every ZeRO-3 stage does before loading its model."""
    from stages.common.deepspeed_setup import ds_config, hf_zero3_context

    assert hf_zero3_context(ds_config(3, 1.0, "fp32")) is not None

"""The rules of docs/ARCHITECTURE.md, enforced: ruff passes, the import layers only point down
(import-linter, contracts in pyproject.toml), and no product file or function outgrows the size
a reader can hold (files <= 450 lines, functions <= 80 lines). The size rule covers the product
packages only: benchmarks/ (measurement scripts) and tests/ are not held to it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("pipeline", "stages", "data_curation", "verifiers")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def oversized(root: Path, packages: tuple[str, ...] = PRODUCT) -> list[str]:
    """`path: N lines` for every .py file over the file limit and `path:line name: N lines`
    for every function (nested ones on their own) over the function limit."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            rel = path.relative_to(root).as_posix()
            lines = len(source.splitlines())
            if lines > MAX_FILE_LINES:
                found.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES})")
            for node in ast.walk(ast.parse(source, filename=rel)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.lineno} {node.name}: {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


def test_no_product_file_or_function_is_oversized():
    assert oversized(ROOT) == []


def test_the_size_check_finds_a_long_file_and_a_long_nested_function(tmp_path):
    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "long.py").write_text(f"def outer():\n    def inner():\n{textwrap.indent(body, '    ')}\n"
                                 + "\n" * MAX_FILE_LINES)
    (pkg / "fine.py").write_text("def short():\n    return 1\n")
    assert oversized(tmp_path, ("pipeline",)) == [
        f"pipeline/long.py: {MAX_FUNCTION_LINES + 2 + MAX_FILE_LINES} lines (limit {MAX_FILE_LINES})",
        f"pipeline/long.py:1 outer: {MAX_FUNCTION_LINES + 2} lines (limit {MAX_FUNCTION_LINES})",
        f"pipeline/long.py:2 inner: {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"]


def test_ruff_passes():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _lint_imports(root: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))"],
                          cwd=root, env=env, capture_output=True, text=True)


def test_import_layers_point_down():
    run = _lint_imports(ROOT, ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("importer, imported", [
    ("stages/common/x.py", "pipeline"),       # a stage job's ground reaching up into the pipeline
    ("stages/sft/x.py", "pipeline"),
    ("data_curation/x.py", "stages"),         # a library reaching into the stages
    ("verifiers/x.py", "data_curation"),      # the two libraries are independent
    ("stages/common/x.py", "stages.sft"),     # the common ground importing a kind
])
def test_the_contract_catches_an_upward_import(tmp_path, importer, imported):
    """The same contracts on a small tree where one module imports against them (a lazy import
    inside a function counts too)."""
    for d in ("pipeline", "stages", "stages/common", "stages/sft", "stages/rl", "data_curation", "verifiers"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "__init__.py").write_text("")
    for d in ("stages/curate", "stages/eval", "stages/general_rl", "stages/init_model", "stages/reasoning_rl",
              "stages/reward_model", "stages/synthetic_data", "stages/distill"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "stages" / "registry.py").write_text("")
    (tmp_path / "pipeline" / "ok.py").write_text("import stages.sft\nimport data_curation\n")
    (tmp_path / importer).write_text(f"def later():\n    import {imported}\n")
    config = tmp_path / "pyproject.toml"
    config.write_text((ROOT / "pyproject.toml").read_text())
    run = _lint_imports(tmp_path, config)
    assert run.returncode == 1 and "BROKEN" in run.stdout, run.stdout + run.stderr

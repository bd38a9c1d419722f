"""The rules of docs/ARCHITECTURE.md, enforced: ruff passes, the import layers only point down
(import-linter, contracts in pyproject.toml), no product file or function outgrows the size
a reader can hold (files <= 450 lines, functions <= 80 lines), and the project's own modules
are imported at a module's top unless a comment on the import says why not. The size and
import rules cover the product packages only: benchmarks/ (measurement scripts) and tests/
are not held to them."""
from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import textwrap
import tokenize
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


# a comment that only silences a linter is no reason
_DIRECTIVE = re.compile(r"#\s*(noqa(:\s*[A-Z0-9, ]+)?|type:\s*ignore(\[[^\]]*\])?|pragma:[^#]*)\s*", re.IGNORECASE)


def unexplained_local_imports(root: Path, packages: tuple[str, ...] = PRODUCT) -> list[str]:
    """`path:line module` for every import of a product module (PRODUCT) inside a function of
    `packages` (methods and nested functions included) whose lines carry no comment saying why it is not at the module's
    top: an import cycle the layers make legitimate, a heavy or optional dependency that a path
    must not load, a measured start-up cost. Relative imports count as the package's own."""
    found: list[tuple[str, int, str]] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            rel = path.relative_to(root).as_posix()
            comments = {tok.start[0]: _DIRECTIVE.sub("", tok.string).strip("# ")
                        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                        if tok.type == tokenize.COMMENT}
            seen: set[int] = set()
            for fn in ast.walk(ast.parse(source, filename=rel)):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in seen:
                        continue
                    seen.add(id(node))
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    own = (isinstance(node, ast.ImportFrom) and node.level > 0) \
                        or any(n.split(".")[0] in PRODUCT for n in names)
                    why = any(comments.get(line) for line in range(node.lineno, node.end_lineno + 1))
                    if own and not why:
                        found.append((rel, node.lineno, f"{'.' * getattr(node, 'level', 0)}{', '.join(names)}"))
    return [f"{rel}:{line} {what}" for rel, line, what in sorted(found)]


def test_project_modules_are_imported_at_the_top_or_say_why_not():
    assert unexplained_local_imports(ROOT) == []


def test_the_import_check_finds_a_local_import_without_a_reason(tmp_path):
    pkg = tmp_path / "stages"
    pkg.mkdir()
    (pkg / "mod.py").write_text(textwrap.dedent("""\
        import json
        from typing import TYPE_CHECKING

        from stages import other
        if TYPE_CHECKING:
            from pipeline import plan

        def f():
            import torch                      # a third-party module: not this rule's business
            from stages import sibling
            import pipeline.flow
            from .near import x  # noqa: F401
            from verifiers import api  # a cycle: api imports this module
            from data_curation.engine import (  # numpy: only a run needs it
                run_curation,
            )

        class C:
            def method(self):
                def inner():
                    from data_curation import urls
                from stages.common import (
                    contract,  # type: ignore[attr-defined]
                )
        """))
    assert unexplained_local_imports(tmp_path, ("stages",)) == [
        "stages/mod.py:10 stages", "stages/mod.py:11 pipeline.flow", "stages/mod.py:12 .near",
        "stages/mod.py:21 data_curation", "stages/mod.py:22 stages.common"]


# a comment or docstring that cites where a fact was found instead of stating it: a work round,
# an issue number, the benchmark log
_CITATION = re.compile(r"(?i:rounds? [0-9]+|issues? #?[0-9]+)|RESULTS\.md")


def citations(root: Path, packages: tuple[str, ...] = PRODUCT) -> list[str]:
    """`path:line text` for every line of a .py or .md file of `packages` that names a round, an
    issue or RESULTS.md: product text says what was measured and what it shows, in the present
    tense (a benchmark script may be named), never the history of how it was found."""
    found = []
    for package in packages:
        for path in sorted(p for p in (root / package).rglob("*") if p.suffix in (".py", ".md")):
            rel = path.relative_to(root).as_posix()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _CITATION.search(line):
                    found.append(f"{rel}:{number} {line.strip()}")
    return found


def test_product_text_explains_rather_than_cites_rounds_issues_or_results():
    hits = citations(ROOT)
    assert hits == [], "\n".join(hits)


def test_the_citation_check_finds_rounds_issues_and_results(tmp_path):
    pkg = tmp_path / "verifiers"
    pkg.mkdir()
    (pkg / "mod.py").write_text(textwrap.dedent("""\
        x = 1  # sdpa is 1.4x faster than eager at this shape on an H100 (benchmarks/sft_throughput.py)
        y = 2  # measured in Round 7
        def f():
            \"\"\"Fixed in issue #34; see rounds 5b and 7.\"\"\"
        z = round(3.5)  # rounds to the even neighbour: no citation
        """))
    (pkg / "README.md").write_text("Numbers: benchmarks/RESULTS.md.\nIssues 3 and 4.\n")
    (pkg / "notes.txt").write_text("round 1\n")  # neither .py nor .md
    assert citations(tmp_path, ("verifiers",)) == [
        "verifiers/README.md:1 Numbers: benchmarks/RESULTS.md.", "verifiers/README.md:2 Issues 3 and 4.",
        "verifiers/mod.py:2 y = 2  # measured in Round 7",
        'verifiers/mod.py:4 """Fixed in issue #34; see rounds 5b and 7."""']


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

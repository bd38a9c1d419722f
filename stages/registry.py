"""The registry of stage kinds: the only door through which `pipeline` sees stages.

A kind = a package `stages/<kind>/` with
- `config.py`: the config model (pydantic, a `kind` literal) and the kind's registration,
  `KIND = register(StageKind(name=..., config=..., version=1, ...))`; it imports nothing
  heavy (no torch), so validating a recipe stays fast;
- `job.py`: `main(job: StageJob)`, run as `python -m stages.<kind>.job --job job.json`
  through `stages.common.entry.run_job` (the stage contract; CONTRIBUTING.md).

What the pipeline does differently per kind is declared on its `StageKind` (never an `if
kind == ...` in pipeline/): the checks before a launch (`pre_launch`), the headline numbers
and curves (`metrics`), how `ring-pipeline curate` reruns a stage (`rerun_config`), the
installed libraries its results depend on (`input_packages`).

The registry is lazy: `STAGE_KINDS[name]` imports `stages.<name>.config` the first time the
kind is asked for, and iterating `STAGE_KINDS` imports every kind package's config. Nothing
depends on import order: a config module may import another kind's config (or shared
settings) at its top.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pkgutil
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Callable

import stages
from stages.common.contract import StageConfig
from stages.common.eval_suite_gate import check_eval_suite
from stages.common.kind_metrics import KindMetrics

_KIND_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def job_module(kind: str) -> str:
    """The entry module of a kind by the stage contract."""
    return f"stages.{kind}.job"


@dataclass(frozen=True)
class StageKind:
    name: str
    config: type[StageConfig]
    # the kind's declared results version: bumped by hand when a code change changes results
    version: int = 1
    # packages/modules whose source is this kind's code (its digest; see code_version)
    sources: tuple[str, ...] = ()
    # False: one process, no rendezvous (data stages); True: world size from resources
    distributed: bool = True
    description: str = ""
    # the job module; by the stage contract `stages.<name>.job` (left unset). Only a kind that
    # lives outside `stages/` (a test's own kind) names another module.
    entry: str = field(default="")
    # run by the pipeline right before it launches a stage of this kind, with (stage name,
    # resolved config, storage options); a check refuses the launch by raising StageFailed
    pre_launch: tuple[Callable[[str, dict[str, Any], dict[str, Any]], Any], ...] = (check_eval_suite,)
    # the headline numbers of the stage's finish line and the curves plotted when it ends
    metrics: KindMetrics = KindMetrics()
    # the profile of the speed settings whose `auto` the pipeline decides before launch (sft,
    # reward_model, rl: stages/common/speed_defaults.py); None: the kind has none
    speed: str | None = None
    # `ring-pipeline curate RECIPE --only S --benchmarks L` on a stage of this kind: its config
    # (as data) -> the config to run; None: the command does not apply to the kind
    rerun_config: Callable[[dict[str, Any], list[str] | None, str | None], dict[str, Any]] | None = None
    # installed distributions whose code makes part of a stage's results beside the kind's own
    # (whose changes `version` covers): config -> their names. Each one's installed version is
    # one of the stage's input fingerprints, so another release reruns the stage (synthetic_data's
    # `reasoning_gym` generator: another reasoning-gym may draw other questions from one seed)
    input_packages: Callable[[StageConfig], Iterable[str]] | None = None

    def __post_init__(self) -> None:
        if not _KIND_NAME.match(self.name):
            raise ValueError(f"stage kind name {self.name!r}: use lowercase letters, digits and _")
        if not self.entry:
            object.__setattr__(self, "entry", job_module(self.name))

    @cached_property
    def code_version(self) -> str:
        """Digest of the kind's source as syntax: comments, blank lines, formatting and
        docstrings do not change it. Recorded in manifests to warn about code drift; the
        stage hash uses `version` instead."""
        h = hashlib.sha256(self.name.encode())
        for mod in self.sources or (self.entry,):
            spec = importlib.util.find_spec(mod)
            if spec is None or spec.origin is None:
                raise RuntimeError(f"stage kind {self.name}: source module {mod} not found")
            origin = Path(spec.origin)
            files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
            for f in files:
                h.update(f.relative_to(origin.parent.parent).as_posix().encode())
                h.update(_source_syntax(f.read_bytes(), str(f)).encode())
        return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def _source_syntax(source: bytes, filename: str) -> str:
    """A Python source as syntax: its AST without docstrings, comments or positions. Cached
    by content: most kinds list the same shared packages (stages.common, stages.rl), and a
    run asks every kind it launches for its digest, so each file is parsed once a process
    (~1 CPU-second less per `ring-pipeline run` of the tiny recipe)."""
    import ast

    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


_REGISTERED: dict[str, StageKind] = {}


def register(kind: StageKind) -> StageKind:
    """Called by a kind's config module (or a test) when it is imported."""
    if kind.name in _REGISTERED and _REGISTERED[kind.name] is not kind:
        raise ValueError(f"stage kind {kind.name!r} registered twice")
    _REGISTERED[kind.name] = kind
    return kind


def _kind_packages() -> list[str]:
    """The packages under stages/ that are stage kinds (they have a config.py)."""
    return sorted(m.name for m in pkgutil.iter_modules(stages.__path__)
                  if m.ispkg and importlib.util.find_spec(f"stages.{m.name}.config") is not None)


class StageKinds(Mapping[str, StageKind]):
    """name -> StageKind, importing a kind's config module when the kind is first asked for."""

    def __getitem__(self, name: str) -> StageKind:
        if name not in _REGISTERED and _KIND_NAME.match(name) \
                and importlib.util.find_spec(f"stages.{name}") is not None \
                and importlib.util.find_spec(f"stages.{name}.config") is not None:
            importlib.import_module(f"stages.{name}.config")
        try:
            return _REGISTERED[name]
        except KeyError:
            raise KeyError(f"unknown stage kind {name!r}; known kinds: {', '.join(self)}") from None

    def __iter__(self) -> Iterator[str]:
        names = _kind_packages()
        for name in names:
            self[name]  # registers it
        yield from sorted(set(names) | set(_REGISTERED))

    def __len__(self) -> int:
        return sum(1 for _ in self)


STAGE_KINDS: Mapping[str, StageKind] = StageKinds()

"""What a curation step is: a config model that builds a runner.

Two kinds of runner:
- row steps (`mode = "rows"`): `process(table) -> Decision` decides each row on its own
  (filters, cleaners, taggers); parts are processed in parallel worker processes;
- global steps (`mode = "global"`): `features(table)` runs in parallel per part, then
  `resolve(stream, ctx)` sees every part's features in the stable row order in the main
  process (dedup) and returns one Decision per part; extra parallel passes over the parts
  go through `ctx.map_parts`.
A Decision says which rows stay, why the others go (reason + JSON-able detail), which
columns of the kept rows were rewritten (cleaning, tagging) and carries mergeable stats.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pydantic import Field

from data_curation._base import Strict

if TYPE_CHECKING:
    import numpy as np

    from data_curation.row_schema import FieldMap

# modules whose source enters every step's cache key (besides the step's own module)
CORE_MODULES = ("data_curation._base", "data_curation.normalize", "data_curation.hashing",
                "data_curation.row_schema", "data_curation.step_api", "data_curation.io",
                "data_curation.urls", "data_curation.hub", "data_curation.discovery",
                "data_curation.row_reading")


def code_version(*modules: str) -> str:
    h = hashlib.sha256()
    for mod in (*CORE_MODULES, *modules):
        spec = importlib.util.find_spec(mod)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"module {mod} not found")
        h.update(mod.encode())
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()[:16]


@dataclass
class RunContext:
    """What steps see of the run (main process)."""

    fields: "FieldMap"
    storage_options: dict[str, Any]
    work_dir: Path
    num_proc: int
    batch_size: int
    progress: bool
    # set by the engine for global steps: run `runner.<method>(table, *args)` over the parts
    map_parts: Callable[..., list[Any]] | None = None
    total_rows: int = 0      # rows entering the current step


@dataclass
class Decision:
    keep: "np.ndarray"                              # bool per row of the part
    reasons: list[str | None] | None = None         # per row; for removed rows
    details: list[dict | None] | None = None        # per row; JSON-able, for removed rows
    columns: dict[str, list] = field(default_factory=dict)  # rewritten columns (full length)
    stats: dict[str, Any] = field(default_factory=dict)


class StepConfig(Strict):
    """Base of every step's config; subclasses set `step: Literal[...]`."""

    step: str
    name: str | None = Field(None, description="label of this step (default: the step kind); "
                                               "what `only` refers to")

    @property
    def label(self) -> str:
        return self.name or self.step

    def identity(self, ctx: RunContext) -> Any:
        """What determines this step's output besides its input (enters the step's hash)."""
        return self.model_dump(mode="json", exclude={"name", "max_examples"})

    def modules(self) -> tuple[str, ...]:
        """The modules whose code enters this step's hash (besides the core modules)."""
        return (type(self).__module__,)

    def build(self, ctx: RunContext) -> "StepRunner":
        raise NotImplementedError


class StepRunner:
    mode = "rows"

    # rows mode
    def process(self, table) -> Decision:
        raise NotImplementedError

    # global mode
    def features(self, table) -> Any:
        raise NotImplementedError

    def resolve(self, stream: Iterator[tuple[int, Any, Any]], ctx: RunContext) -> list[Decision]:
        """`stream` yields (part index, part `_row` array, features) in order."""
        raise NotImplementedError

    def summarize(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The step's report section from its merged stats."""
        return stats

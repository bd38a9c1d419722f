"""The registry of stage kinds: the only door through which `pipeline` sees stages.

A kind = a config model (pydantic, `kind` literal) + the module its job runs
(`python -m <entry> --job job.json`). Config modules import nothing heavy, so
validating a recipe does not import torch.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.stage_api import StageConfig


@dataclass(frozen=True)
class StageKind:
    name: str
    config: type[StageConfig]
    entry: str
    # packages/modules whose source is this kind's code version (enters the stage hash)
    sources: tuple[str, ...] = ()
    # the kind's declared results version: bumped by hand when a code change changes results
    version: int = 1
    # False: one process, no rendezvous (data stages); True: world size from resources
    distributed: bool = True
    description: str = ""

    @cached_property
    def code_version(self) -> str:
        """Digest of the kind's source as syntax: comments, blank lines, formatting and
        docstrings do not change it. Recorded in manifests to warn about code drift; the
        stage hash uses `version` instead."""
        import ast

        h = hashlib.sha256(self.name.encode())
        for mod in self.sources or (self.entry,):
            spec = importlib.util.find_spec(mod)
            if spec is None or spec.origin is None:
                raise RuntimeError(f"stage kind {self.name}: source module {mod} not found")
            origin = Path(spec.origin)
            files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
            for f in files:
                tree = ast.parse(f.read_bytes(), filename=str(f))
                for node in ast.walk(tree):
                    body = getattr(node, "body", None)
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                            and body and isinstance(body[0], ast.Expr) \
                            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                        node.body = body[1:] or [ast.Pass()]
                h.update(f.relative_to(origin.parent.parent).as_posix().encode())
                h.update(ast.dump(tree, include_attributes=False).encode())
        return h.hexdigest()[:16]


STAGE_KINDS: dict[str, StageKind] = {}


def register(kind: StageKind) -> StageKind:
    if kind.name in STAGE_KINDS:
        raise ValueError(f"stage kind {kind.name!r} registered twice")
    STAGE_KINDS[kind.name] = kind
    return kind


def _load_all() -> None:
    """Import `stages/<kind>/config.py` of every stage package; each registers itself."""
    import pkgutil

    import stages

    for mod in sorted(pkgutil.iter_modules(stages.__path__), key=lambda m: m.name):
        if mod.ispkg and importlib.util.find_spec(f"stages.{mod.name}.config") is not None:
            importlib.import_module(f"stages.{mod.name}.config")


_load_all()

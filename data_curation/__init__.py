"""SFT data curation: normalisation, quality filter, exact + MinHash near dedup,
benchmark decontamination, harmful-content filter, domain tagging, reports.

    from data_curation import run_curation
    report = run_curation(["data.jsonl"], [{"step": "exact_dedup"}, {"step": "near_dedup"}],
                          "out/", num_proc=2)

Imports nothing of the project beyond itself. Step configs (pydantic) import light;
numpy/pyarrow/datasketch/datasets are loaded when a run starts.
"""
from __future__ import annotations

from typing import Any

__all__ = ["run_curation", "curate_standalone", "parse_steps", "default_steps", "CurationError",
           "AccountingError", "FieldMap", "NormalizeConfig"]


def __getattr__(name: str) -> Any:
    """The package's names, each imported from its module when first asked for (PEP 562):
    `import data_curation.urls` and the step configs must not load the engine."""
    if name in ("run_curation", "AccountingError"):
        from data_curation import engine  # lazy: see the docstring
        return getattr(engine, name)
    if name == "curate_standalone":
        from data_curation.cli import curate_standalone  # lazy: see the docstring
        return curate_standalone
    if name in ("parse_steps", "default_steps"):
        from data_curation import step_kinds  # lazy: see the docstring
        return getattr(step_kinds, name)
    if name == "CurationError":
        from data_curation._base import CurationError  # lazy: see the docstring
        return CurationError
    if name == "FieldMap":
        from data_curation.row_schema import FieldMap  # lazy: see the docstring
        return FieldMap
    if name == "NormalizeConfig":
        from data_curation.normalize import NormalizeConfig  # lazy: see the docstring
        return NormalizeConfig
    raise AttributeError(f"module 'data_curation' has no attribute {name!r}")

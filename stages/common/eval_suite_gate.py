"""Decontamination as a gate: a stage whose recipe entry declares `eval_suite` does not
start while its input data overlaps that suite above `max_overlap`.

    stages:
      sft:
        kind: sft
        data: ${stages.curate.output}/curated.jsonl
        eval_suite: {benchmarks: recipes/benchmarks.yaml, max_overlap: 0}

Every kind's `StageKind.pre_launch` runs `check_eval_suite` (unless the kind says otherwise):
the pipeline calls it right before it launches a stage. The input
data is every path under the stage config's `data` (a path, a list of them, or a mapping
of sources with `path`), read like curation input (files, dirs, globs, fsspec URLs; rows
that cannot be read are skipped and counted) and matched against the suite with the
decontaminate step's matcher (exact, containment, n-gram, partial; a row that is only the
same template with new numbers is not an overlap). The refusal names every overlapping
benchmark item (1-based row, the benchmark's own id) and where its first copy is.

Every kind's config imports this module (the registry's default `pre_launch`), so the matcher
(numpy and the hashing kernels: ~90 modules, 0.4 s) is imported when a check runs.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from data_curation import discovery, row_reading
from data_curation._base import CurationError
from data_curation.benchmarks import EvalSuite
from data_curation.row_schema import FieldMap, RowPolicy
from data_curation.step_api import RunContext
from stages.common.contract import StageFailed

MAX_NAMED = 25


class EvalSuiteOverlap(StageFailed):
    """A stage's input data holds evaluation-suite items above the declared threshold."""


def input_data(config: dict[str, Any]) -> list[str]:
    """The paths under a stage config's `data`."""
    def walk(v: Any) -> list[str]:
        if isinstance(v, str):
            return [v]
        if isinstance(v, list):
            return [p for x in v for p in walk(x)]
        if isinstance(v, dict):
            return walk(v["path"]) if "path" in v else [p for x in v.values() for p in walk(x)]
        return []

    return walk(config.get("data"))


def find_overlap(data: list[str], benchmarks: Any, storage_options: dict[str, Any] | None = None,
                 batch_rows: int = 2000) -> dict[str, Any]:
    """Every benchmark item of `benchmarks` (entries or a list file) found in the rows of
    `data`: {"items": [...], "per_benchmark": {name: {"items", "found"}}, "rows_read",
    "rows_unreadable"}. Each found item: benchmark, benchmark_file, benchmark_row,
    benchmark_id, training_rows, methods, first (`file:line` of its first copy)."""
    from data_curation.decontaminate import DecontaminateConfig  # numpy: not in every kind's import

    so = dict(storage_options or {})
    cfg = DecontaminateConfig(benchmarks=benchmarks)
    matcher = cfg.build(RunContext(FieldMap(), so, None, 1, batch_rows, False))
    sources = discovery.discover(data, so)
    reader = row_reading.RowReader(FieldMap(), RowPolicy(response_only="keep"))
    found: dict[str, dict[str, Any]] = {}
    rows_read = unreadable = 0
    with tempfile.TemporaryDirectory(prefix="eval-suite-") as scratch:   # remote jsonl lands here
        for task in row_reading.plan_reads(sources, so, Path(scratch), 1 << 62):
            for b in row_reading.iter_read(task, reader, so, batch_rows):
                rows_read += len(b.rows["_row"])
                unreadable += len(b.quarantine["_row"])
                texts = [(k, t) for part in ("_prompt", "_response") for k, t in enumerate(b.rows[part]) if t]
                per_row: dict[int, dict[str, dict]] = {}   # row -> item key -> its strongest hit
                for (k, _), hits in zip(texts, matcher.check_texts([t for _, t in texts], ["row"] * len(texts))):
                    for h in hits:
                        if not h["numbers_changed"]:
                            key = f"{h['benchmark']}\x1f{h['benchmark_file']}\x1f{h['benchmark_row']}"
                            per_row.setdefault(k, {}).setdefault(key, h)
                for k, hits in per_row.items():
                    for key, h in hits.items():
                        entry = found.setdefault(key, {
                            "benchmark": h["benchmark"], "benchmark_file": h["benchmark_file"],
                            "benchmark_row": h["benchmark_row"], "benchmark_id": h["benchmark_id"],
                            "training_rows": 0, "methods": {},
                            "first": row_reading.row_label(sources, b.rows["_row"][k])})
                        entry["training_rows"] += 1
                        entry["methods"][h["method"]] = entry["methods"].get(h["method"], 0) + 1
    items = sorted(found.values(), key=lambda x: (x["benchmark"], x["benchmark_file"], x["benchmark_row"]))
    per = {name: {"items": info["items"], "found": sum(1 for x in items if x["benchmark"] == name)}
           for name, info in matcher.index.per_benchmark.items()}
    return {"items": items, "per_benchmark": per, "rows_read": rows_read, "rows_unreadable": unreadable}


def check_eval_suite(stage: str, config: dict[str, Any], storage_options: dict[str, Any] | None = None
                     ) -> dict[str, Any] | None:
    """Refuse (EvalSuiteOverlap) to start `stage` when its input data overlaps its declared
    evaluation suite above the threshold; the overlap found otherwise (None: no suite)."""
    if not config.get("eval_suite"):
        return None
    suite = EvalSuite.model_validate(config["eval_suite"])
    data = input_data(config)
    if not data:
        raise EvalSuiteOverlap(f"stage {stage!r} declares eval_suite but has no `data` to check")
    try:
        overlap = find_overlap(data, suite.benchmarks, storage_options)
    except CurationError as e:
        raise EvalSuiteOverlap(f"stage {stage!r}: eval_suite check failed: {e}") from e
    over = {name: p for name, p in overlap["per_benchmark"].items()
            if p["found"] and p["found"] / max(1, p["items"]) > suite.max_overlap}
    if over:
        named = [x for x in overlap["items"] if x["benchmark"] in over]
        listing = "; ".join(
            f"{x['benchmark']} row {x['benchmark_row']}"
            + (f" (id {x['benchmark_id']})" if x["benchmark_id"] is not None else "")
            + f" in {x['training_rows']} row(s), first at {x['first']}" for x in named[:MAX_NAMED])
        more = f"; and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
        shares = ", ".join(f"{n} {p['found']}/{p['items']} items" for n, p in over.items())
        raise EvalSuiteOverlap(
            f"stage {stage!r} not started: its input data overlaps its evaluation suite above "
            f"max_overlap = {suite.max_overlap} ({shares}): {listing}{more}. Decontaminate the "
            "data against these benchmarks (a curate stage with a decontaminate step), or raise "
            "eval_suite.max_overlap")
    return overlap

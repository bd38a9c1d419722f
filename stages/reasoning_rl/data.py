"""RL task rows: jsonl / json / parquet files (or directories of them), read by
stages/common/rows.py, with `domain`, `prompt`, `reference` (and optionally `id`, `extraction`,
anything else the verifier reads).

Errors name the file and line (jsonl) or row (json, parquet) and the field. A row without an
`id` gets its location as id. Each row also gets `messages` (its prompt as one user turn):
what the policy is prompted with (stages/rl/prompts.py renders it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.common.rows import DataError, Row, data_files, read_rows

WHAT = "RL data"


def validate_row(row: Row) -> dict[str, Any]:
    data, where = row.data, row.where
    if not isinstance(data, dict):
        raise DataError(f"{WHAT} {where}: a row must be a JSON object, got {type(data).__name__}")
    for key in ("domain", "prompt"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise DataError(f"{WHAT} {where}: field {key!r} must be a non-empty string (got {data.get(key)!r})")
    if "reference" not in data:
        raise DataError(f"{WHAT} {where}: field 'reference' is missing (what the verifier checks against)")
    out = dict(data)
    if out.get("id") is None:
        out["id"] = where
    out["messages"] = [{"role": "user", "content": data["prompt"]}]
    return out


def load_rows(sources: list[tuple[str, Path]]) -> list[dict[str, Any]]:
    """(source as written in the config, local path) -> validated rows, in file order."""
    rows = [validate_row(row) for source, path in sources
            for row in read_rows(data_files(path, source, WHAT), WHAT)]
    if not rows:
        raise DataError(f"{WHAT} {[s for s, _ in sources]} holds no rows")
    return rows


def rows_by_domain(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        out.setdefault(row["domain"], []).append(i)
    return out

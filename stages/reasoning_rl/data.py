"""RL task rows: any data input the stages read (stages/common/rows.py), each row with a
domain, a prompt and a reference (and optionally an id, `extraction`, anything else the
verifier reads), under the field names its `RLData.fields` gives; rows without a domain
field take `RLData.default_domain`. A row comes out in the canonical shape: `domain`,
`prompt`, `reference`, `id` (the row's location when it has none) and its other fields, plus
`messages` (its prompt as one user turn: what the policy is prompted with,
stages/rl/prompts.py renders it).

Errors (a bad row stops the stage) name the file and line (jsonl) or row, and the field.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from stages.common.contract import StageError
from stages.common.rows import DataError, Row, input_rows
from stages.reasoning_rl.config import RLData
from verifiers import VERIFIERS

WHAT = "RL data"


def validate_row(row: Row, data: RLData) -> dict[str, Any]:
    value, where, f = row.data, row.where, data.fields
    if not isinstance(value, dict):
        raise DataError(f"{WHAT} {where}: a row must be a JSON object, got {type(value).__name__}")
    domain = value.get(f.domain)
    if domain is None and data.default_domain is not None:
        domain = data.default_domain
    for key, v in ((f.domain, domain), (f.prompt, value.get(f.prompt))):
        if not isinstance(v, str) or not v.strip():
            hint = " (or set default_domain)" if key == f.domain else ""
            raise DataError(f"{WHAT} {where}: field {key!r} must be a non-empty string{hint} (got {v!r})")
    if f.reference not in value:
        raise DataError(f"{WHAT} {where}: field {f.reference!r} is missing (what the verifier checks against)")
    out = {k: v for k, v in value.items() if k not in (f.domain, f.prompt, f.reference, f.id)}
    out.update(domain=domain, prompt=value[f.prompt], reference=value[f.reference],
               id=where if value.get(f.id) is None else value[f.id])
    out["messages"] = [{"role": "user", "content": out["prompt"]}]
    return out


def load_rows(fetch: Callable[[str], Path], inputs: list[RLData]) -> list[dict[str, Any]]:
    """The validated rows of every input, in order (`fetch`: the job's)."""
    rows = [validate_row(row, inp) for inp in inputs for row in input_rows(fetch, inp, WHAT)]
    if not rows:
        raise DataError(f"{WHAT} {[i.path for i in inputs]} holds no rows")
    return rows


def require_verifiers(rows: list[dict[str, Any]], what: str) -> None:
    """Every row's domain has a registered verifier; else a StageError naming the first row of
    each domain that has none (`what`: the data, as the message names it)."""
    unknown: dict[str, Any] = {}
    for row in rows:
        if row["domain"] not in VERIFIERS:
            unknown.setdefault(row["domain"], row["id"])
    if unknown:
        raise StageError(f"{what}: domains with no registered verifier (first row of each): {unknown}; "
                         f"known domains: {sorted(VERIFIERS)}")


def rows_by_domain(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        out.setdefault(row["domain"], []).append(i)
    return out

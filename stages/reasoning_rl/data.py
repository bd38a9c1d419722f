"""RL task rows: jsonl / json / parquet files (or directories of them) with `domain`,
`prompt`, `reference` (and optionally `id`, `extraction`, anything else the verifier reads).

Errors name the file and line (jsonl/json) or row (parquet) and the field. Prompts are
rendered with the tokenizer's chat template (one user message, generation prompt added);
rows whose prompt is longer than `prompt_max_len` tokens are skipped and counted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

SUFFIXES = (".jsonl", ".json", ".parquet")


class RLDataError(ValueError):
    """Bad RL data: the message names the file, line/row and field."""


def data_files(path: Path, source: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise RLDataError(f"RL data {source}: directory {path} holds no {'/'.join(SUFFIXES)} file")
        return files
    if path.suffix not in SUFFIXES:
        raise RLDataError(f"RL data {source}: {path.name} is not a {'/'.join(SUFFIXES)} file")
    return [path]


def _iter_file(f: Path) -> Iterator[tuple[str, Any]]:
    if f.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(f).to_pylist()):
            yield f"{f}: row {i}", row
        return
    if f.suffix == ".json":
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RLDataError(f"{f}:{e.lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(data, list):
            raise RLDataError(f"{f}: a .json RL file must hold a list of rows")
        for i, row in enumerate(data):
            yield f"{f}: row {i}", row
        return
    with open(f, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RLDataError(f"{f}:{lineno}: not valid JSON ({e.msg})") from e
            yield f"{f}:{lineno}", row


def validate_row(where: str, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise RLDataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for key in ("domain", "prompt"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise RLDataError(f"{where}: field {key!r} must be a non-empty string (got {row.get(key)!r})")
    if "reference" not in row:
        raise RLDataError(f"{where}: field 'reference' is missing (what the verifier checks against)")
    out = dict(row)
    if out.get("id") is None:
        out["id"] = where
    return out


def load_rows(sources: list[tuple[str, Path]]) -> list[dict[str, Any]]:
    """(source as written in the config, local path) -> validated rows, in file order."""
    rows: list[dict[str, Any]] = []
    for source, path in sources:
        for f in data_files(path, source):
            for where, row in _iter_file(f):
                rows.append(validate_row(where, row))
    if not rows:
        raise RLDataError(f"RL data {[s for s, _ in sources]} holds no rows")
    return rows


def render_prompts(rows: list[dict[str, Any]], tokenizer, prompt_max_len: int
                   ) -> tuple[list[dict[str, Any]], list[list[int]], int]:
    """Chat-templated prompt ids; rows over `prompt_max_len` tokens are dropped (count returned)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RLDataError("the policy's tokenizer has no chat template (needed to render RL prompts)")
    kept, ids, skipped = [], [], 0
    for row in rows:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(enc, dict) or hasattr(enc, "input_ids"):
            enc = enc["input_ids"]
        enc = [int(t) for t in enc]
        if len(enc) > prompt_max_len:
            skipped += 1
            continue
        kept.append(row)
        ids.append(enc)
    return kept, ids, skipped


def rows_by_domain(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        out.setdefault(row["domain"], []).append(i)
    return out

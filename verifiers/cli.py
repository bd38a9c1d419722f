"""``verify_files``: the body of ``ring-pipeline verify data.jsonl responses.jsonl``."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .api import verify_batch


def _read_jsonl(path: str) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            rows.append((lineno, obj))
    return rows


def _match(data, responses, data_path, responses_path) -> list[str]:
    for lineno, row in data:
        if "domain" not in row:
            raise ValueError(f"{data_path}:{lineno}: task row has no 'domain'")
    for lineno, r in responses:
        if not isinstance(r.get("response"), str):
            raise ValueError(f"{responses_path}:{lineno}: no string 'response' field")
    with_ids = [("id" in r) for _, r in responses]
    if responses and all(with_ids):
        by_id: dict[str, str] = {}
        for lineno, r in responses:
            key = str(r["id"])
            if key in by_id:
                raise ValueError(f"{responses_path}:{lineno}: duplicate id {r['id']!r}")
            by_id[key] = r["response"]
        out = []
        for lineno, row in data:
            if "id" not in row:
                raise ValueError(f"{data_path}:{lineno}: responses are matched by id but this row has none")
            if str(row["id"]) not in by_id:
                raise ValueError(f"{data_path}:{lineno}: no response with id {row['id']!r} in {responses_path}")
            out.append(by_id[str(row["id"])])
        return out
    if any(with_ids):
        first = next(lineno for (lineno, _), has in zip(responses, with_ids) if not has)
        raise ValueError(f"{responses_path}:{first}: some responses have an 'id' and this one has none")
    if len(responses) != len(data):
        where = (f"{responses_path}:{responses[len(data)][0]}" if len(responses) > len(data)
                 else f"{data_path}:{data[len(responses)][0]}")
        raise ValueError(f"{where}: {len(data)} task rows but {len(responses)} responses (matched by line order)")
    return [r["response"] for _, r in responses]


def verify_files(data_path: str, responses_path: str, out_path: str | None = None,
                 num_workers: int = 2, timeout_s: float = 10.0) -> dict[str, Any]:
    """Verify every response against its task row; write rewards as jsonl to ``out_path``
    (one {"id", "domain", **reward} per row, in data order) and return a summary:
    {"count", "mean_score", "domains": {domain: {"count", "mean_score"}}}."""
    data = _read_jsonl(data_path)
    responses = _read_jsonl(responses_path)
    texts = _match(data, responses, data_path, responses_path)
    rows = [row for _, row in data]
    rewards = verify_batch(rows, texts, num_workers=num_workers, timeout_s=timeout_s)
    per: dict[str, list[float]] = defaultdict(list)
    for row, rw in zip(rows, rewards):
        per[row["domain"]].append(rw.score)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "w", encoding="utf-8") as f:
            for row, rw in zip(rows, rewards):
                f.write(json.dumps({"id": row.get("id"), "domain": row["domain"], **rw.model_dump()}, default=str) + "\n")
    scores = [rw.score for rw in rewards]
    return {
        "count": len(scores),
        "mean_score": sum(scores) / len(scores) if scores else 0.0,
        "domains": {d: {"count": len(s), "mean_score": sum(s) / len(s)} for d, s in sorted(per.items())},
    }

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_dir(benchmark_sets: Path) -> Path:
    """The public benchmark sets (RING_BENCHMARKS_DIR, tests/conftest.py); skips where none is given."""
    return benchmark_sets


def bench_rows(bench_dir: Path, name: str) -> list[dict]:
    with open(bench_dir / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def chat(i, prompt, response, **kw):
    return {"id": f"r{i}", "messages": [{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": response}], **kw}


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict]):
    """An internal parquet-part table for calling a step runner directly."""
    from data_curation.io import batch_table
    from data_curation.row_schema import FieldMap, extract

    fm = FieldMap()
    cols = {c: [] for c in ("_row", "_src", "_line", "_id", "_raw", "_prompt", "_response")}
    for i, r in enumerate(rows):
        t = extract(r, fm)
        for k, v in zip(cols, (i + 1, 0, i + 1, t.id, json.dumps(r, ensure_ascii=False), t.prompt, t.response)):
            cols[k].append(v)
    return batch_table(cols)


@pytest.fixture
def ctx(tmp_path):
    from data_curation.row_schema import FieldMap
    from data_curation.step_api import RunContext

    return RunContext(FieldMap(), {}, tmp_path / "work", 1, 1000, False)

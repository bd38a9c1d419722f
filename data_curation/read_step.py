"""Step 0 of every run: read the sources into parquet parts, quarantining what cannot be
used, then check row ids across the whole input.

Reading runs in the worker pool, one task per source or per line-aligned byte range of a
big JSON lines file (row_reading.plan_reads); no row can fail the run (row_reading.RowReader). The id check runs in
the main process over the parts' `_id` column, in row order: an id seen on an earlier row
is a repeat, reported with where the id first occurred, and under
`row_policy.duplicate_ids` the repeats (or every row of a repeated id) are moved from the
kept parts to the quarantine parts by the workers.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from data_curation import discovery, io, row_reading, urls
from data_curation.row_schema import RowPolicy
from data_curation.step_api import RunContext
from data_curation.step_cache import StepDir, mark_done, start_dir
from data_curation.worker_pool import WorkerPool, progress

MAX_EXAMPLES = 5


def run_read(sources: list[discovery.Source], url: str, h: str, ctx: RunContext, policy: RowPolicy,
             log: Callable[[str], None]) -> StepDir:
    t0 = time.time()
    so = ctx.storage_options
    start_dir(url, so)
    target = max(1 << 20, min(64 << 20, ctx.batch_size * 1024))
    tasks = row_reading.plan_reads(sources, so, ctx.work_dir, target)
    log(f"[curate] read: {len(sources)} source(s), {len(tasks)} task(s) -> {url}")
    pool = WorkerPool(ctx.num_proc, {"read_tasks": tasks, "reader": row_reading.RowReader(ctx.fields, policy),
                                     "dir": url, "storage_options": so, "batch_size": ctx.batch_size})
    parts: list[dict[str, Any]] = []
    reasons: dict[str, int] = {}
    response_only = 0
    row_sum, row_xor = 0, 0
    try:
        for r in progress(pool.imap("read", [(i,) for i in range(len(tasks))]), len(tasks),
                          "read", ctx.progress):
            parts.extend(r["parts"])
            response_only += r["response_only"]
            row_sum = (row_sum + r["row_sum"]) % (1 << 64)
            row_xor ^= r["row_xor"]
            for k, v in r["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
        duplicates = _duplicate_ids(parts, url, so, policy, sources)
        if duplicates["moves"]:
            moved = pool.imap("quarantine", list(duplicates.pop("moves").items()))
            by_name = {p["name"]: p for p in parts}
            for name, counts, moved_reasons in moved:
                by_name[name].update(counts)
                for k, v in moved_reasons.items():
                    reasons[k] = reasons.get(k, 0) + v
        duplicates.pop("moves", None)
    finally:
        pool.close()
    rows = sum(p["rows"] for p in parts)
    bad = sum(p["quarantined"] for p in parts)
    secs = round(time.time() - t0, 3)
    done = {"step": "read", "hash": h, "parts": parts, "rows_in": rows + bad, "kept": rows,
            "quarantined": bad, "row_sum": row_sum, "row_xor": row_xor,
            "sources": [s.as_dict() for s in sources]}
    report = {"step": "read", "kind": "read", "hash": h, "rows_in": rows + bad, "kept": rows,
              "removed": 0, "quarantined": bad, "quarantine_reasons": reasons,
              "row_policy": policy.model_dump(mode="json"), "response_only_rows": response_only,
              "duplicate_ids": duplicates, "sources": [s.label for s in sources], "seconds": secs}
    log(f"[curate] read: {rows + bad} rows, {bad} quarantined ({secs}s)")
    return mark_done(url, done, report, so)


def _duplicate_ids(parts: list[dict[str, Any]], url: str, so: dict, policy: RowPolicy,
                   sources: list[discovery.Source]) -> dict[str, Any]:
    """Repeated ids in row order: counts, examples and, when the policy quarantines, the
    rows to move per part ({part name: {index in part: reason}})."""
    first: dict[str, int] = {}       # id -> row id of its first row
    repeats: dict[str, int] = {}     # id -> number of later rows with it
    kept = [p for p in parts if p["rows"]]

    def ids(p: dict[str, Any]) -> tuple[list, list]:
        t = io.read_table(urls.join(url, "kept", p["name"] + ".parquet"), so, columns=["_id", "_row"])
        return t.column("_id").to_pylist(), t.column("_row").to_pylist()

    for p in kept:
        for rid, row in zip(*ids(p)):
            if rid is None:
                continue
            if first.setdefault(rid, row) != row:
                repeats[rid] = repeats.get(rid, 0) + 1
    where = lambda row: row_reading.row_label(sources, row)  # noqa: E731
    out: dict[str, Any] = {
        "repeated_ids": len(repeats), "repeat_rows": sum(repeats.values()),
        "policy": policy.duplicate_ids,
        "examples": [{"id": rid, "first": where(first[rid]), "repeats": n}
                     for rid, n in list(repeats.items())[:MAX_EXAMPLES]],
        "moves": {}}
    if not repeats or policy.duplicate_ids == "report":
        return out
    quarantine_all = policy.duplicate_ids == "quarantine_all"
    for p in kept:
        moves = {}
        for i, (rid, row) in enumerate(zip(*ids(p))):
            if rid in repeats and (quarantine_all or first[rid] != row):
                moves[i] = (f"duplicate id {rid[:80]!r}: {repeats[rid] + 1} rows have it, the first at "
                            f"{where(first[rid])} (row_policy.duplicate_ids: {policy.duplicate_ids})")
        if moves:
            out["moves"][p["name"]] = moves
    return out

"""The worker processes of a curation run and the tasks they run on parquet parts.

`WorkerPool(num_proc, state)` forks `num_proc` workers that share `state` (the step's
runner, the step directory, storage options); `num_proc <= 1` runs the tasks in this
process. A task reads one part, decides or transforms it, and writes its results itself,
so only small summaries travel back to the main process.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from typing import Any, Callable, Iterable

import numpy as np

from data_curation import io, row_reading, urls
from data_curation._base import bump
from data_curation.step_api import Decision

_STATE: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]) -> None:
    _STATE.clear()
    _STATE.update(state)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _dispatch(task: tuple[str, tuple]) -> Any:
    name, args = task
    return _TASKS[name](*args)


def _task_read(i: int) -> dict[str, Any]:
    st = _STATE
    task: row_reading.ReadTask = st["read_tasks"][i]
    parts, quarantine_reasons = [], {}
    n_rows = n_bad = 0
    row_sum, row_xor = np.uint64(0), np.uint64(0)
    k = 0
    response_only = 0
    for b in row_reading.iter_read(task, st["reader"], st["storage_options"], st["batch_size"]):
        response_only += b.response_only
        ids = np.array(b.rows["_row"] + b.quarantine["_row"], dtype=np.int64).view(np.uint64)
        row_sum += ids.sum(dtype=np.uint64)
        row_xor ^= np.bitwise_xor.reduce(ids) if len(ids) else np.uint64(0)
        name = f"part-{i:05d}-{k:04d}"
        nr, nq = len(b.rows["_row"]), len(b.quarantine["_row"])
        if nr:
            io.write_table(io.batch_table(b.rows), urls.join(st["dir"], "kept", name + ".parquet"),
                           st["storage_options"])
        if nq:
            io.write_table(io.batch_table(b.quarantine), urls.join(st["dir"], "quarantine", name + ".parquet"),
                           st["storage_options"])
            for r in b.quarantine["_reason"]:
                bump(quarantine_reasons, row_reading.reason_key(r))
        if nr or nq:
            parts.append({"name": name, "rows": nr, "quarantined": nq})
            k += 1
        n_rows += nr
        n_bad += nq
    return {"parts": parts, "rows": n_rows, "quarantined": n_bad, "reasons": quarantine_reasons,
            "response_only": response_only, "row_sum": int(row_sum), "row_xor": int(row_xor)}


def _task_quarantine(name: str, moves: dict[int, str]) -> tuple[str, dict[str, int], dict[str, int]]:
    """Move rows `moves` ({index in the part: reason}) of read part `name` from its kept
    rows to its quarantine rows (kept in row order)."""
    import pyarrow as pa

    st = _STATE
    so = st["storage_options"]
    kept_url = urls.join(st["dir"], "kept", name + ".parquet")
    quarantine_url = urls.join(st["dir"], "quarantine", name + ".parquet")
    table = io.read_table(kept_url, so)
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[list(moves)] = True
    moved = table.filter(pa.array(mask))
    reasons = [moves[i] for i in np.nonzero(mask)[0].tolist()]
    cols = {c: moved.column(c).to_pylist() for c in ("_row", "_src", "_line")}
    cols["_reason"] = reasons
    cols["_rawtext"] = moved.column("_raw").to_pylist()
    quarantine = io.batch_table(cols)
    if io.exists(quarantine_url, so):
        quarantine = pa.concat_tables([io.read_table(quarantine_url, so), quarantine])
        quarantine = quarantine.take(pa.array(np.argsort(quarantine.column("_row").to_numpy(), kind="stable")))
    io.write_table(quarantine, quarantine_url, so)
    rest = table.filter(pa.array(~mask))
    if rest.num_rows:
        io.write_table(rest, kept_url, so)
    else:
        io.remove_tree(kept_url, so)
    counts: dict[str, int] = {}
    for r in reasons:
        bump(counts, row_reading.reason_key(r))
    return name, {"rows": rest.num_rows, "quarantined": quarantine.num_rows}, counts


def _apply(table, d: Decision, name: str) -> dict[str, Any]:
    import pyarrow as pa

    st = _STATE
    n = table.num_rows
    if len(d.keep) != n:
        raise RuntimeError(f"step {st['label']}: decision for {n} rows has {len(d.keep)} entries")
    for col, values in d.columns.items():
        arr = pa.array(values, type=pa.string())
        if col in table.column_names:
            table = table.set_column(table.column_names.index(col), col, arr)
        else:
            table = table.append_column(col, arr)
    keep = np.asarray(d.keep, dtype=bool)
    kept = table.filter(pa.array(keep))
    removed_idx = np.nonzero(~keep)[0]
    reasons: dict[str, int] = {}
    if len(removed_idx):
        removed = table.take(pa.array(removed_idx))
        rs = [(d.reasons[i] if d.reasons else None) or "removed" for i in removed_idx]
        ds = [json.dumps(d.details[i] if d.details else None, ensure_ascii=False, default=str)
              for i in removed_idx]
        removed = removed.append_column("_step", pa.array([st["label"]] * len(rs), pa.string()))
        removed = removed.append_column("_reason", pa.array(rs, pa.string()))
        removed = removed.append_column("_detail", pa.array(ds, pa.string()))
        io.write_table(removed, urls.join(st["dir"], "removed", name + ".parquet"), st["storage_options"])
        for r in rs:
            reasons[r] = reasons.get(r, 0) + 1
    if kept.num_rows:
        io.write_table(kept, urls.join(st["dir"], "kept", name + ".parquet"), st["storage_options"])
    return {"name": name, "rows_in": n, "rows": kept.num_rows, "removed": len(removed_idx),
            "reasons": reasons, "stats": d.stats}


def _task_rows(name: str, url: str) -> dict[str, Any]:
    table = io.read_table(url, _STATE["storage_options"])
    return _apply(table, _STATE["runner"].process(table), name)


def _task_features(url: str) -> tuple[np.ndarray, Any]:
    table = io.read_table(url, _STATE["storage_options"])
    return table.column("_row").to_numpy(), _STATE["runner"].features(table)


def _task_apply(name: str, url: str, decision: Decision) -> dict[str, Any]:
    return _apply(io.read_table(url, _STATE["storage_options"]), decision, name)


def _task_call(method: str, url: str, args: tuple) -> Any:
    table = io.read_table(url, _STATE["storage_options"])
    return getattr(_STATE["runner"], method)(table, *args)


_TASKS: dict[str, Callable[..., Any]] = {
    "read": _task_read, "rows": _task_rows, "features": _task_features, "apply": _task_apply,
    "call": _task_call, "quarantine": _task_quarantine}



class WorkerPool:
    """`num_proc` forked workers sharing `state` (num_proc <= 1: run in this process)."""

    def __init__(self, num_proc: int, state: dict[str, Any]):
        self.pool = None
        self._saved = dict(_STATE)
        if num_proc <= 1:
            _init_worker(state)
        else:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self.pool = mp.get_context(method).Pool(num_proc, _init_worker, (state,))

    def imap(self, name: str, args: Iterable[tuple]) -> Iterable[Any]:
        tasks = [(name, a) for a in args]
        if self.pool is None:
            return (_dispatch(t) for t in tasks)
        return self.pool.imap(_dispatch, tasks)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
        else:
            _STATE.clear()
            _STATE.update(self._saved)


def progress(it: Iterable, total: int, desc: str, enabled: bool) -> Iterable:
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc, unit="part", file=sys.stderr, mininterval=2.0,
                dynamic_ncols=True, leave=True)

